//! The fused backward kernels against the op chains they replace, and their errors.

use tessera_mesh::DType;

use super::*;
use crate::ops::Reduction;
use crate::ops::testutil::{assert_close, sample, tol};

#[test]
fn dot_sums_rounded_products_in_eight_lanes_then_the_tail() {
    // The order the blocked half-type path must keep: lane i % 8 of the
    // whole groups of 8, the lanes paired, then the tail in sequence.
    fn scalar(p: &[f64]) -> f64 {
        let whole = p.len() / 8 * 8;
        let mut acc = [0f64; 8];
        for (i, &v) in p[..whole].iter().enumerate() {
            acc[i % 8] += v;
        }
        let tail: f64 = p[whole..].iter().sum();
        ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
    }
    for len in [0, 5, 8, 63, 64, 65, 200, 1029] {
        let g = sample(&[len], DType::F32, 1)
            .mul_scalar(1e3)
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        let y = sample(&[len], DType::F32, 2).to_vec::<f32>().unwrap();
        let (gh, yh): (Vec<half::bf16>, Vec<half::bf16>) = (
            g.iter().map(|&v| half::bf16::from_f32(v)).collect(),
            y.iter().map(|&v| half::bf16::from_f32(v)).collect(),
        );
        let rounded: Vec<f64> = gh
            .iter()
            .zip(&yh)
            .map(|(a, b)| half::bf16::from_f32(a.to_f32() * b.to_f32()).to_f64())
            .collect();
        assert_eq!(
            dot_f64(&gh, &yh).to_bits(),
            scalar(&rounded).to_bits(),
            "bf16, {len} elements"
        );
        let exact: Vec<f64> = g.iter().zip(&y).map(|(&a, &b)| f64::from(a * b)).collect();
        assert_eq!(
            dot_f64(&g, &y).to_bits(),
            scalar(&exact).to_bits(),
            "f32, {len} elements"
        );
    }
}

const FLOATS: [DType; 4] = [DType::F32, DType::F64, DType::BF16, DType::F16];

/// The same gradients from the chains of element-wise ops that they fuse.
#[test]
fn fused_backwards_match_their_op_chains() {
    macro_rules! case {
        ($shape:expr, $dim:expr, $strided:expr) => {
            for dtype in FLOATS {
                let shape: &[usize] = &$shape;
                let view = |t: Tensor| {
                    if $strided {
                        t.transpose(0, shape.len() - 1).unwrap()
                    } else {
                        t
                    }
                };
                let x = view(sample(shape, dtype, 61).mul_scalar(2.0).unwrap());
                let g = view(sample(shape, dtype, 62));
                let what = format!("{shape:?} dim {} strided {} {dtype}", $dim, $strided);
                // Softmax: y · (g − Σ g·y).
                let y = x.softmax($dim).unwrap();
                let dot = g.mul(&y).unwrap().sum(&[$dim], true).unwrap();
                let want = y.mul(&g.sub(&dot).unwrap()).unwrap();
                let got = g.softmax_backward(&y, $dim).unwrap();
                assert_eq!((got.shape(), got.dtype()), (x.shape(), dtype));
                assert_close(
                    &got,
                    &want.to_f64_vec(),
                    4.0 * tol(dtype),
                    &format!("softmax {what}"),
                );
                // Layer norm over the last dim, with and without a weight.
                let last = x.rank() - 1;
                let d = x.shape()[last];
                let w = sample(&[d], dtype, 63);
                let batch: Vec<usize> = (0..last).collect();
                let (x64, g64, w64) = (
                    x.cast(DType::F64).unwrap(),
                    g.cast(DType::F64).unwrap(),
                    w.cast(DType::F64).unwrap(),
                );
                let mean = x64.mean(&[last], true).unwrap();
                let centered = x64.sub(&mean).unwrap();
                let rstd = centered
                    .square()
                    .unwrap()
                    .mean(&[last], true)
                    .unwrap()
                    .add_scalar(1e-5)
                    .unwrap()
                    .rsqrt()
                    .unwrap();
                let xhat = centered.mul(&rstd).unwrap();
                for weight in [Some(&w), None] {
                    let gw = if weight.is_some() {
                        g64.mul(&w64).unwrap()
                    } else {
                        g64.clone()
                    };
                    let m1 = gw.mean(&[last], true).unwrap();
                    let m2 = gw.mul(&xhat).unwrap().mean(&[last], true).unwrap();
                    let want = gw
                        .sub(&m1)
                        .unwrap()
                        .sub(&xhat.mul(&m2).unwrap())
                        .unwrap()
                        .mul(&rstd)
                        .unwrap();
                    let got = g.layer_norm_backward(&x, weight, 1e-5).unwrap();
                    assert_eq!((got.shape(), got.dtype()), (x.shape(), dtype));
                    // The sums of d terms lose a few ulp of the dtype.
                    let rtol = (d as f64) * 4.0 * tol(dtype);
                    assert_close(
                        &got,
                        &want.to_f64_vec(),
                        rtol,
                        &format!("layer_norm {what} {}", weight.is_some()),
                    );
                    // From the forward's statistics: the same bits.
                    let (_, mean, rstd) = x.layer_norm_with_stats(weight, None, 1e-5).unwrap();
                    let saved = g
                        .layer_norm_backward_with_stats(&x, &mean, &rstd, weight)
                        .unwrap();
                    assert_eq!(saved, got, "{what}");
                }
                let want = g64.mul(&xhat).unwrap().sum(&batch, false).unwrap();
                let got = g.layer_norm_weight_grad(&x, 1e-5).unwrap();
                assert_eq!((got.shape(), got.dtype()), (&[d][..], dtype));
                let rows = (x.numel() / d.max(1)) as f64;
                assert_close(
                    &got,
                    &want.to_f64_vec(),
                    rows * 4.0 * tol(dtype),
                    &format!("weight grad {what}"),
                );
                let (_, mean, rstd) = x.layer_norm_with_stats(None, None, 1e-5).unwrap();
                let saved = g.layer_norm_weight_grad_with_stats(&x, &mean, &rstd).unwrap();
                assert_eq!(saved, got, "{what}");
            }
        };
    }
    case!([3, 5], 1, false);
    case!([3, 5], 0, false);
    case!([2, 3, 17], 2, false);
    case!([2, 3, 17], 1, true);
    case!([4, 1, 33], 2, true);
    case!([1], 0, false);
}

#[test]
fn cross_entropy_backward_matches_probabilities() {
    for dtype in FLOATS {
        for (n, c, strided) in [(5, 7, false), (7, 5, true), (3, 33, false), (1, 1, false)] {
            let logits = if strided {
                sample(&[c, n], dtype, 71)
                    .mul_scalar(3.0)
                    .unwrap()
                    .transpose(0, 1)
                    .unwrap()
            } else {
                sample(&[n, c], dtype, 71).mul_scalar(3.0).unwrap()
            };
            let t: Vec<i64> = (0..n).map(|i| ((i * 5 + 2) % c) as i64).collect();
            let targets = Tensor::from_vec(t.clone(), &[n]).unwrap();
            let (_, probs) = logits.cross_entropy_with_grad(&targets, Reduction::Sum).unwrap();
            let mut want = probs.to_f64_vec();
            for (row, &k) in t.iter().enumerate() {
                want[row * c + k as usize] -= 1.0;
            }
            want.iter_mut().for_each(|v| *v *= 0.37);
            let got = logits.cross_entropy_backward(&targets, 0.37).unwrap();
            assert_eq!((got.shape(), got.dtype()), (&[n, c][..], dtype));
            // From the kept probabilities: the same bits without the exponentials.
            let from_probs = probs.cross_entropy_backward_from_probs(&targets, 0.37).unwrap();
            assert_eq!(from_probs.to_f64_vec(), got.to_f64_vec(), "{n}x{c} {dtype} from probs");
            // Bit-identical to rounding the f64 chain once.
            let want = Tensor::from_vec(want, &[n, c]).unwrap().cast(dtype).unwrap();
            assert_eq!(got.to_f64_vec(), want.to_f64_vec(), "{n}x{c} {dtype}");
        }
    }
    let empty = Tensor::zeros(&[0, 3], DType::F32).unwrap();
    let t = Tensor::zeros(&[0], DType::I64).unwrap();
    assert_eq!(empty.cross_entropy_backward(&t, 1.0).unwrap().shape(), &[0, 3]);
    let x = sample(&[2, 4], DType::F32, 1);
    assert_eq!(
        x.cross_entropy_backward(&Tensor::from_vec(vec![1i64, 4], &[2]).unwrap(), 1.0)
            .unwrap_err()
            .to_string(),
        "cross_entropy: target 4 of row 1 is not a class of 0..4"
    );
    assert_eq!(
        x.cross_entropy_backward_from_probs(&Tensor::from_vec(vec![1i64, 4], &[2]).unwrap(), 1.0)
            .unwrap_err()
            .to_string(),
        "cross_entropy: target 4 of row 1 is not a class of 0..4"
    );
}

/// Kernels whose outputs come from the buffer cache write every element: a
/// cached buffer full of NaN of the output's size changes nothing.
#[test]
fn recycled_outputs_are_overwritten() {
    use tessera_mesh::Buffer;
    // 2^19 f32 elements: 2 MiB, the smallest size that the cache keeps.
    let (x, g) = (
        sample(&[8, 256, 256], DType::F32, 81),
        sample(&[8, 256, 256], DType::F32, 82),
    );
    let w = sample(&[256], DType::F32, 83);
    let logits = x.reshape(&[2048, 256]).unwrap();
    let t = Tensor::from_vec((0..2048).map(|i| (i * 7 % 256) as i64).collect(), &[2048]).unwrap();
    type Op<'a> = Box<dyn Fn() -> Tensor + 'a>;
    let ops: Vec<(&str, Op<'_>)> = vec![
        ("gelu", Box::new(|| x.gelu().unwrap())),
        ("gelu_backward", Box::new(|| g.gelu_backward(&x).unwrap())),
        ("softmax", Box::new(|| x.softmax(2).unwrap())),
        ("log_softmax", Box::new(|| x.log_softmax(2).unwrap())),
        (
            "layer_norm",
            Box::new(|| x.layer_norm(Some(&w), Some(&w), 1e-5).unwrap()),
        ),
        ("softmax_backward", Box::new(|| g.softmax_backward(&x, 2).unwrap())),
        ("attention_probs", Box::new(|| x.attention_probs(0.5, true).unwrap())),
        (
            "attention_probs_backward",
            Box::new(|| g.attention_probs_backward(&x, 0.5, true).unwrap()),
        ),
        (
            "layer_norm_backward",
            Box::new(|| g.layer_norm_backward(&x, Some(&w), 1e-5).unwrap()),
        ),
        (
            "cross_entropy_backward",
            Box::new(|| logits.cross_entropy_backward(&t, 0.5).unwrap()),
        ),
        (
            "cross_entropy_with_grad",
            Box::new(|| logits.cross_entropy_with_grad(&t, Reduction::Sum).unwrap().1),
        ),
        (
            "cross_entropy_backward_from_probs",
            Box::new(|| logits.cross_entropy_backward_from_probs(&t, 0.5).unwrap()),
        ),
    ];
    for (name, op) in ops {
        let want = op().to_vec::<f32>().unwrap();
        crate::alloc::recycle(Buffer::F32(vec![f32::NAN; want.len()]));
        let got = op().to_vec::<f32>().unwrap();
        assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "{name}");
    }
}

/// The table gradient sums the rows of each index in f64 and rounds once;
/// a shard keeps its own rows only; untouched rows are zero.
#[test]
fn embedding_dense_backward_sums_rows_per_index() {
    let (n, d, vocab) = (7, 3, 5);
    let idx = [3i64, 1, 3, 0, 3, 4, 1];
    let indices = Tensor::from_vec(idx.to_vec(), &[n]).unwrap();
    for dtype in [DType::F32, DType::BF16, DType::F64] {
        let g = sample(&[n, d], dtype, 11);
        let gv = g.to_f64_vec();
        // Reference: a dense f64 table, each row rounded to the dtype once.
        let mut want = vec![0f64; vocab * d];
        for (k, &i) in idx.iter().enumerate() {
            for j in 0..d {
                want[i as usize * d + j] += gv[k * d + j];
            }
        }
        let want = Tensor::from_vec(want, &[vocab, d]).unwrap().cast(dtype).unwrap();
        let full = g.embedding_dense_backward(&indices, vocab, 0).unwrap();
        assert_eq!((full.shape(), full.dtype()), (&[vocab, d][..], dtype));
        assert_eq!(full.to_f64_vec(), want.to_f64_vec(), "{dtype}");
        // Rows 2..5 of the table: indices 0 and 1 belong to another shard.
        let shard = g.embedding_dense_backward(&indices, 3, 2).unwrap();
        assert_eq!(shard.to_f64_vec(), want.to_f64_vec()[2 * d..], "{dtype} shard");
    }
    // Row 2 is never named: it stays zero.
    let g = sample(&[n, d], DType::F32, 12);
    let out = g.embedding_dense_backward(&indices, vocab, 0).unwrap().to_f64_vec();
    assert!(out[2 * d..3 * d].iter().all(|&v| v == 0.0));
    // Bad input is named.
    let err = |r: Result<Tensor>| r.unwrap_err().to_string();
    assert!(
        err(g
            .reshape(&[n * d])
            .unwrap()
            .embedding_dense_backward(&indices, vocab, 0))
        .contains("[N, d]")
    );
    let short = Tensor::from_vec(vec![0i64; 2], &[2]).unwrap();
    assert!(err(g.embedding_dense_backward(&short, vocab, 0)).contains("needs indices of shape [7]"));
    let float_idx = sample(&[n], DType::F32, 1);
    assert!(matches!(
        g.embedding_dense_backward(&float_idx, vocab, 0),
        Err(Error::DTypeMismatch { .. })
    ));
}

#[test]
fn fused_backward_errors() {
    let x = sample(&[2, 4], DType::F32, 1);
    let y = sample(&[4, 2], DType::F32, 1);
    assert_eq!(
        x.softmax_backward(&y, 1).unwrap_err().to_string(),
        "softmax_backward: shape mismatch: gradient has shape [2, 4] but the softmax output has [4, 2]; \
         they must be equal"
    );
    assert_eq!(
        x.softmax_backward(&x, 2).unwrap_err().to_string(),
        "softmax_backward: dim 2 is out of range for a tensor of rank 2"
    );
    assert_eq!(
        x.layer_norm_backward(&x, Some(&sample(&[3], DType::F32, 1)), 1e-5)
            .unwrap_err()
            .to_string(),
        "layer_norm_backward: shape mismatch: weight has shape [3] but the input's last dim is 4; pass a [4] weight"
    );
    let s = sample(&[], DType::F32, 1);
    assert!(s.layer_norm_weight_grad(&s, 1e-5).is_err());
}

#[test]
fn layer_norm_backward_reads_the_statistics_it_is_given() {
    let x = sample(&[3, 8], DType::F32, 1)
        .mul_scalar(3.0)
        .unwrap()
        .add_scalar(0.5)
        .unwrap();
    let g = sample(&[3, 8], DType::F32, 2);
    let (_, mean, rstd) = x.layer_norm_with_stats(None, None, 1e-5).unwrap();
    let right = g.layer_norm_backward_with_stats(&x, &mean, &rstd, None).unwrap();
    let right_w = g.layer_norm_weight_grad_with_stats(&x, &mean, &rstd).unwrap();
    // Other statistics than the input's give other gradients: the kernels use
    // the ones passed in, not statistics recomputed from `x`.
    let shifted = mean.add_scalar(0.25).unwrap();
    let scaled = rstd.mul_scalar(2.0).unwrap();
    for (m, r) in [(&shifted, &rstd), (&mean, &scaled)] {
        assert_ne!(g.layer_norm_backward_with_stats(&x, m, r, None).unwrap(), right);
        assert_ne!(g.layer_norm_weight_grad_with_stats(&x, m, r).unwrap(), right_w);
    }
}

#[test]
fn layer_norm_backward_with_stats_errors() {
    let x = sample(&[2, 4], DType::F32, 1);
    let (_, mean, rstd) = x.layer_norm_with_stats(None, None, 1e-5).unwrap();
    let err = |r: Result<Tensor>| r.unwrap_err().to_string();
    let wide = sample(&[2, 4], DType::F32, 3);
    assert_eq!(
        err(x.layer_norm_backward_with_stats(&x, &wide, &rstd, None)),
        "layer_norm_backward: shape mismatch: mean has shape [2, 4] but an input of shape [2, 4] has \
         statistics of shape [2, 1] (as layer_norm_with_stats returns them)"
    );
    assert_eq!(
        err(x.layer_norm_weight_grad_with_stats(&x, &mean, &rstd.cast(DType::F32).unwrap())),
        "layer_norm_weight_grad: expected dtype f64, got f32"
    );
    // bf16 inputs have f64 statistics too, as the forward returns them.
    let h = x.cast(DType::BF16).unwrap();
    let (_, hm, hr) = h.layer_norm_with_stats(None, None, 1e-5).unwrap();
    assert_eq!(hm.dtype(), DType::F64);
    assert!(h.layer_norm_backward_with_stats(&h, &hm, &hr, None).is_ok());
    assert_eq!(
        err(h.layer_norm_backward_with_stats(&h, &hm.cast(DType::BF16).unwrap(), &hr, None)),
        "layer_norm_backward: expected dtype f64, got bf16"
    );
    assert_eq!(
        err(x.layer_norm_backward_with_stats(&x, &mean, &rstd, Some(&sample(&[3], DType::F32, 1)))),
        "layer_norm_backward: shape mismatch: weight has shape [3] but the input's last dim is 4; pass a [4] weight"
    );
}

/// 16-bit logits' loss computed as `f32` (`cross_entropy_with_grad_as`) and
/// its gradient rounded back (`cross_entropy_backward_from_probs_as`) have the
/// bits of casting first and last, for every reduction, strided logits, wide
/// rows (several threads), large magnitudes and ties; other dtypes are refused.
#[test]
fn upcast_cross_entropy_has_the_bits_of_casting() {
    for dtype in [DType::BF16, DType::F16] {
        for (n, c, strided) in [(5, 7, false), (7, 5, true), (64, 1031, false), (1, 1, false)] {
            let logits = if strided {
                sample(&[c, n], DType::F32, 9)
                    .mul_scalar(9.0)
                    .unwrap()
                    .transpose(0, 1)
                    .unwrap()
            } else {
                sample(&[n, c], DType::F32, 9).mul_scalar(9.0).unwrap()
            }
            .cast(dtype)
            .unwrap();
            let t: Vec<i64> = (0..n).map(|i| ((i * 5 + 2) % c) as i64).collect();
            let targets = Tensor::from_vec(t, &[n]).unwrap();
            let up = logits.cast(DType::F32).unwrap();
            let bits = |t: &Tensor| -> Vec<u32> { t.to_vec::<f32>().unwrap().into_iter().map(f32::to_bits).collect() };
            for red in [Reduction::Mean, Reduction::Sum, Reduction::None] {
                let (loss, probs) = logits.cross_entropy_with_grad_as(&targets, red, DType::F32).unwrap();
                let (want_loss, want_probs) = up.cross_entropy_with_grad(&targets, red).unwrap();
                let what = format!("{n}x{c} {dtype} {red:?}");
                assert_eq!((loss.dtype(), probs.dtype()), (DType::F32, DType::F32), "{what}");
                assert_eq!(bits(&loss), bits(&want_loss), "{what} loss");
                assert_eq!(bits(&probs), bits(&want_probs), "{what} probs");
                let g = probs
                    .cross_entropy_backward_from_probs_as(&targets, 0.37, dtype)
                    .unwrap();
                let want = want_probs
                    .cross_entropy_backward_from_probs(&targets, 0.37)
                    .unwrap()
                    .cast(dtype)
                    .unwrap();
                assert_eq!(g.dtype(), dtype, "{what}");
                assert_eq!(
                    g.to_f64_vec().iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    want.to_f64_vec().iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    "{what} gradient"
                );
            }
            // The logits' own dtype is the plain op.
            let (own, _) = logits
                .cross_entropy_with_grad_as(&targets, Reduction::Sum, dtype)
                .unwrap();
            assert_eq!(
                own.to_f64_vec(),
                logits.cross_entropy(&targets, Reduction::Sum).unwrap().to_f64_vec()
            );
        }
    }
    let t = Tensor::from_vec(vec![1i64, 0], &[2]).unwrap();
    for (from, to) in [
        (DType::F32, DType::BF16),
        (DType::F64, DType::F32),
        (DType::BF16, DType::F16),
    ] {
        let x = sample(&[2, 3], DType::F32, 1).cast(from).unwrap();
        let err = x
            .cross_entropy_with_grad_as(&t, Reduction::Sum, to)
            .unwrap_err()
            .to_string();
        assert!(err.contains("logits compute in"), "{from:?} -> {to:?}: {err}");
    }
    // Probabilities and a gradient dtype that no upcast pairs.
    for (probs, grad) in [
        (DType::F32, DType::F64),
        (DType::F64, DType::F32),
        (DType::BF16, DType::F16),
    ] {
        let p = sample(&[2, 3], DType::F32, 1).softmax(1).unwrap().cast(probs).unwrap();
        let err = p
            .cross_entropy_backward_from_probs_as(&t, 1.0, grad)
            .unwrap_err()
            .to_string();
        assert!(err.contains("logits compute in"), "{probs:?} probs -> {grad:?}: {err}");
    }
}
