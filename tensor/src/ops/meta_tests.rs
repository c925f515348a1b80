//! Every op on meta tensors gives what it gives on host tensors, less the
//! values: the same outputs' shapes and dtypes, and the same errors.

use tessera_mesh::DType;

use super::{Attention, Reduction, rotary_tables};
use crate::{Device, Tensor};

type Op = fn(&[Tensor]) -> crate::Result<Vec<Tensor>>;

fn r(shape: &[usize], seed: u64) -> Tensor {
    Tensor::randn(shape, DType::F32, seed).unwrap()
}

fn idx(v: &[i64], shape: &[usize]) -> Tensor {
    Tensor::from_slice(v, shape).unwrap()
}

/// Runs `op` on `inputs` and on meta copies of them: the same number of
/// outputs, each with the host output's shape and dtype, all on meta; or the
/// same error.
fn same_on_meta(name: &str, op: Op, inputs: &[Tensor]) {
    let metas: Vec<Tensor> = inputs.iter().map(|t| t.to(Device::Meta).unwrap()).collect();
    assert!(metas.iter().all(Tensor::is_meta));
    match (op(inputs), op(&metas)) {
        (Ok(host), Ok(meta)) => {
            assert_eq!(host.len(), meta.len(), "{name}: outputs");
            for (i, (h, m)) in host.iter().zip(&meta).enumerate() {
                assert_eq!((m.shape(), m.dtype()), (h.shape(), h.dtype()), "{name}: output {i}");
                assert!(m.is_meta(), "{name}: output {i} is on {}", m.device());
            }
        }
        (Err(h), Err(m)) => assert_eq!(h.to_string(), m.to_string(), "{name}: the error"),
        (h, m) => panic!("{name}: host {:?} but meta {:?}", h.map(|_| ()), m.map(|_| ())),
    }
}

#[test]
fn every_op_gives_the_host_shapes_and_dtypes_on_meta() {
    let (cos, sin) = rotary_tables(&[0, 1, 2], 4, 10000.0).unwrap();
    let cases: Vec<(&str, Op, Vec<Tensor>)> = vec![
        ("add", |x| Ok(vec![x[0].add(&x[1])?]), vec![r(&[2, 3], 1), r(&[3], 2)]),
        (
            "add mismatch",
            |x| Ok(vec![x[0].add(&x[1])?]),
            vec![r(&[2, 3], 1), r(&[4], 2)],
        ),
        ("mul_scalar", |x| Ok(vec![x[0].mul_scalar(2.0)?]), vec![r(&[2, 3], 1)]),
        ("gelu", |x| Ok(vec![x[0].gelu()?]), vec![r(&[5], 1)]),
        ("gelu int", |x| Ok(vec![x[0].gelu()?]), vec![idx(&[1, 2], &[2])]),
        (
            "gelu_backward",
            |x| Ok(vec![x[0].gelu_backward(&x[1])?]),
            vec![r(&[5], 1), r(&[5], 2)],
        ),
        ("silu", |x| Ok(vec![x[0].silu()?]), vec![r(&[5], 1)]),
        (
            "sum",
            |x| Ok(vec![x[0].sum(&[1], false)?, x[0].sum(&[0, 2], true)?]),
            vec![r(&[2, 3, 4], 1)],
        ),
        ("mean", |x| Ok(vec![x[0].mean(&[-1], false)?]), vec![r(&[2, 3], 1)]),
        ("max", |x| Ok(vec![x[0].max(&[0], true)?]), vec![r(&[2, 3], 1)]),
        ("argmax", |x| Ok(vec![x[0].argmax(1, false)?]), vec![r(&[2, 3], 1)]),
        (
            "matmul",
            |x| Ok(vec![x[0].matmul(&x[1])?]),
            vec![r(&[2, 3, 4], 1), r(&[4, 5], 2)],
        ),
        (
            "matmul vec",
            |x| Ok(vec![x[0].matmul(&x[1])?]),
            vec![r(&[4], 1), r(&[4, 5], 2)],
        ),
        (
            "matmul bad",
            |x| Ok(vec![x[0].matmul(&x[1])?]),
            vec![r(&[2, 3], 1), r(&[4, 5], 2)],
        ),
        (
            "softmax",
            |x| Ok(vec![x[0].softmax(1)?, x[0].log_softmax(0)?]),
            vec![r(&[2, 3], 1)],
        ),
        (
            "softmax_backward",
            |x| Ok(vec![x[0].softmax_backward(&x[1], 1)?]),
            vec![r(&[2, 3], 1), r(&[2, 3], 2)],
        ),
        (
            "attention_probs",
            |x| Ok(vec![x[0].attention_probs(0.5, true)?]),
            vec![r(&[2, 3, 3], 1)],
        ),
        (
            "attention_probs_backward",
            |x| Ok(vec![x[0].attention_probs_backward(&x[1], 0.5, true)?]),
            vec![r(&[2, 3, 3], 1), r(&[2, 3, 3], 2)],
        ),
        (
            "causal_mask",
            |x| Ok(vec![x[0].causal_mask(f64::NEG_INFINITY)?]),
            vec![r(&[3, 3], 1)],
        ),
        (
            "layer_norm",
            |x| {
                let (y, m, s) = x[0].layer_norm_with_stats(Some(&x[1]), Some(&x[2]), 1e-5)?;
                Ok(vec![
                    y,
                    m.clone(),
                    s.clone(),
                    x[3].layer_norm_backward_with_stats(&x[0], &m, &s, Some(&x[1]))?,
                    x[3].layer_norm_backward(&x[0], Some(&x[1]), 1e-5)?,
                    x[3].layer_norm_weight_grad_with_stats(&x[0], &m, &s)?,
                    x[3].layer_norm_weight_grad(&x[0], 1e-5)?,
                ])
            },
            vec![r(&[2, 4], 1), r(&[4], 2), r(&[4], 3), r(&[2, 4], 4)],
        ),
        (
            "rms_norm",
            |x| {
                let (y, s) = x[0].rms_norm_with_stats(Some(&x[1]), 1e-5)?;
                Ok(vec![
                    y,
                    s.clone(),
                    x[2].rms_norm_backward_with_stats(&x[0], &s, Some(&x[1]))?,
                    x[2].rms_norm_weight_grad_with_stats(&x[0], &s)?,
                ])
            },
            vec![r(&[2, 4], 1), r(&[4], 2), r(&[2, 4], 4)],
        ),
        (
            "embedding",
            |x| {
                Ok(vec![
                    x[0].embedding(&x[1])?,
                    x[2].embedding_dense_backward(&x[1], 5, 0)?,
                ])
            },
            vec![r(&[5, 3], 1), idx(&[4, 0, 2, 2], &[2, 2]), r(&[4, 3], 2)],
        ),
        (
            "cross_entropy",
            |x| {
                let (l, p) = x[0].cross_entropy_with_grad(&x[1], Reduction::Mean)?;
                Ok(vec![
                    l,
                    p.clone(),
                    x[0].cross_entropy(&x[1], Reduction::None)?,
                    x[0].cross_entropy_backward(&x[1], 0.5)?,
                    p.cross_entropy_backward_from_probs(&x[1], 0.5)?,
                ])
            },
            vec![r(&[3, 4], 1), idx(&[0, 3, 1], &[3])],
        ),
        (
            "where",
            |x| Ok(vec![x[0].where_cond(&x[1], &x[2])?, x[1].masked_fill(&x[0], 0.0)?]),
            vec![
                Tensor::from_slice(&[1u8, 0, 1], &[3]).unwrap(),
                r(&[2, 3], 1),
                r(&[3], 2),
            ],
        ),
        (
            "index_select",
            |x| {
                Ok(vec![
                    x[0].index_select(0, &x[1])?,
                    x[2].index_select_backward(0, &x[1], 4)?,
                ])
            },
            vec![r(&[4, 3], 1), idx(&[3, 0], &[2]), r(&[2, 3], 2)],
        ),
        (
            "gather",
            |x| Ok(vec![x[0].gather(1, &x[1])?, x[2].gather_backward(1, &x[1], &[2, 3])?]),
            vec![r(&[2, 3], 1), idx(&[2, 0, 1, 1], &[2, 2]), r(&[2, 2], 2)],
        ),
        (
            "rotary",
            |x| {
                Ok(vec![
                    x[0].rotary_embedding(&x[1], &x[2])?,
                    x[0].rotary_embedding_backward(&x[1], &x[2])?,
                ])
            },
            vec![r(&[2, 3, 4], 1), cos.clone(), sin.clone()],
        ),
        (
            "attention",
            |x| {
                let attn = Attention {
                    scale: 0.5,
                    is_causal: true,
                };
                let (o, p) = x[0].attention(&x[1], &x[2], attn)?;
                let g = x[3].attention_backward(&x[0], &x[1], &x[2], &p, attn, [true, false, true])?;
                Ok([o, p].into_iter().chain(g.into_iter().flatten()).collect())
            },
            vec![r(&[2, 3, 4], 1), r(&[2, 5, 4], 2), r(&[2, 5, 6], 3), r(&[2, 3, 6], 4)],
        ),
        ("cast", |x| Ok(vec![x[0].cast(DType::BF16)?]), vec![r(&[2, 3], 1)]),
        (
            "views and copies",
            |x| {
                let t = x[0].transpose(0, 1)?;
                Ok(vec![
                    t.contiguous(),
                    t.reshape(&[6])?,
                    Tensor::cat(&[x[0].clone(), x[0].clone()], 1)?,
                    Tensor::stack(&[x[0].clone(), x[0].clone()], 0)?,
                    x[0].broadcast_to(&[4, 2, 3])?,
                    x[0].repeat_interleave(2, 0)?,
                    x[0].narrow(1, 1, 2)?,
                ])
            },
            vec![r(&[2, 3], 1)],
        ),
    ];
    for (name, op, inputs) in &cases {
        same_on_meta(name, *op, inputs);
    }
}

#[test]
fn meta_tensors_charge_the_tracker_and_hold_no_values() {
    let before = crate::memory::stats().current_bytes;
    let t = Tensor::meta(&[1024, 256], DType::F32).unwrap();
    assert_eq!(
        crate::memory::stats().current_bytes - before,
        1 << 20,
        "charged as host memory"
    );
    let y = t.gelu().unwrap();
    assert_eq!(
        crate::memory::stats().current_bytes - before,
        2 << 20,
        "an op's output too"
    );
    drop((t, y));
    assert_eq!(crate::memory::stats().current_bytes, before);
    let t = Tensor::meta(&[2], DType::F32).unwrap();
    let e = t.to_vec::<f32>().unwrap_err().to_string();
    assert!(e.contains("meta device") && e.contains("no values"), "{e}");
    assert!(t.to(Device::Cpu).is_err() && t.as_slice::<f32>().is_err());
    assert!(t.to_f64_vec().iter().all(|v| v.is_nan()));
    assert_ne!(t, t.clone(), "no values: equal to nothing");
    assert_eq!(format!("{t:?}"), "Tensor[2] f32 meta");
    let host = Tensor::ones(&[2], DType::F32).unwrap();
    assert!(host.to(Device::Meta).unwrap().is_meta());
    assert!(Tensor::meta(&[usize::MAX, 2], DType::F32).is_err());
}
