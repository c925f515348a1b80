//! Means over no elements are NaN, as on one device (regressions of two fixed bugs).

use tessera::dtensor::Placement::{Replicate as R, Shard as S};
use tessera::dtensor::{DType, Tensor, distribute_tensor};
use tessera::tensor::ops::Reduction;

use crate::harness::on_mesh;

/// Every rank's `full_tensor()` of the op's result, which must be all NaN (as the
/// single-device op gives).
fn assert_all_nan(outs: &[Tensor], want: &Tensor, what: &str) {
    assert!(want.to_f64_vec().iter().all(|v| v.is_nan()), "oracle {want:?}");
    for (rank, got) in outs.iter().enumerate() {
        assert_eq!(got.shape(), want.shape(), "{what} rank {rank}");
        assert!(
            got.to_f64_vec().iter().all(|v| v.is_nan()),
            "{what} rank {rank}: {got:?}, want {want:?}"
        );
    }
}

/// `Tensor::mean` (and PyTorch) give NaN over an empty dim; the DTensor mean
/// scales by `1 / count.max(1)` and gives 0, replicated input included.
#[test]
fn mean_over_an_empty_dim_is_nan() {
    let full = Tensor::zeros(&[0, 3], DType::F64).unwrap();
    let want = full.mean(&[0], false).unwrap();
    for p in [R, S(1)] {
        let outs = on_mesh(&[2], {
            let full = full.clone();
            move |m| Ok(distribute_tensor(&full, m, &[p])?.mean(&[0], false)?.full_tensor()?)
        })
        .unwrap();
        assert_all_nan(&outs, &want, &format!("mean of [0, 3] {p}"));
    }
}

/// `Tensor::cross_entropy` with `Reduction::Mean` is "NaN for no rows" (as PyTorch);
/// the DTensor op gives 0.
#[test]
fn cross_entropy_mean_of_no_rows_is_nan() {
    let logits = Tensor::zeros(&[0, 3], DType::F64).unwrap();
    let targets = Tensor::from_vec(Vec::<i64>::new(), &[0]).unwrap();
    let want = logits.cross_entropy(&targets, Reduction::Mean).unwrap();
    let outs = on_mesh(&[2], move |m| {
        let x = distribute_tensor(&logits, m, &[R])?;
        let t = distribute_tensor(&targets, m, &[R])?;
        Ok(x.cross_entropy(&t, Reduction::Mean)?.full_tensor()?)
    })
    .unwrap();
    assert_all_nan(&outs, &want, "cross_entropy(mean) of [0, 3]");
}
