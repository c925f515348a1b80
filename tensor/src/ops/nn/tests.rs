//! Unit tests of the neural-network ops.

use half::bf16;
use tessera_mesh::DType;

use super::*;
use crate::ops::testutil::{assert_close, sample, tol};

const FLOATS: [DType; 4] = [DType::F32, DType::F64, DType::BF16, DType::F16];

/// `f` applied to every row of the last dim of `x` (shape `shape`), in f64.
fn rows(x: &[f64], len: usize, f: impl Fn(&[f64]) -> Vec<f64>) -> Vec<f64> {
    x.chunks(len.max(1)).flat_map(f).collect()
}

fn softmax_ref(r: &[f64]) -> Vec<f64> {
    let m = r.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let s: f64 = r.iter().map(|x| (x - m).exp()).sum();
    r.iter().map(|x| (x - m).exp() / s).collect()
}

fn log_softmax_ref(r: &[f64]) -> Vec<f64> {
    softmax_ref(r).iter().map(|p| p.ln()).collect()
}

#[test]
fn softmax_table() {
    type Method = fn(&Tensor, usize) -> Result<Tensor>;
    type Reference = fn(&[f64]) -> Vec<f64>;
    let ops: [(&str, Method, Reference); 2] = [
        ("softmax", Tensor::softmax, softmax_ref),
        ("log_softmax", Tensor::log_softmax, log_softmax_ref),
    ];
    macro_rules! case {
        ($t:expr, $dim:expr) => {
            for dtype in FLOATS {
                let t: Tensor = $t(dtype);
                for (name, method, f) in ops {
                    let got = method(&t, $dim).unwrap();
                    assert_eq!((got.shape(), got.dtype()), (t.shape(), dtype));
                    // Reference: move `dim` last, apply per row, move back.
                    let last = t.rank() - 1;
                    let moved = t.transpose($dim, last).unwrap();
                    let want = rows(&moved.to_f64_vec(), moved.shape()[last], f);
                    let want = Tensor::from_vec(want, moved.shape())
                        .unwrap()
                        .transpose($dim, last)
                        .unwrap();
                    let what = format!("{name} {:?} dim {} {dtype}", t.shape(), $dim);
                    assert_close(&got, &want.to_f64_vec(), 2.0 * tol(dtype), &what);
                }
            }
        };
    }
    let s = |shape: &'static [usize]| move |d| sample(shape, d, 31).mul_scalar(3.0).unwrap();
    case!(s(&[2, 5]), 1);
    case!(s(&[2, 5]), 0);
    case!(s(&[2, 3, 4]), 1);
    case!(s(&[7]), 0);
    case!(s(&[3, 0]), 1);
    case!(s(&[0, 3]), 1);
    case!(|d| s(&[4, 3])(d).transpose(0, 1).unwrap(), 1);
    // Large logits stay finite (max-subtracted).
    let big = Tensor::from_vec(vec![1000.0f32, 1001.0, 1002.0], &[1, 3]).unwrap();
    assert_close(&big.softmax(1).unwrap(), &softmax_ref(&[0.0, 1.0, 2.0]), 1e-6, "large");
    let rowsum = sample(&[6, 50], DType::F32, 3)
        .softmax(1)
        .unwrap()
        .sum(&[1], false)
        .unwrap();
    assert_close(&rowsum, &[1.0; 6], 1e-6, "rows sum to 1");
    // -inf entries (a causal mask) get probability 0.
    let masked = Tensor::from_vec(vec![0.0f32, f32::NEG_INFINITY], &[2]).unwrap();
    assert_eq!(masked.softmax(0).unwrap().to_vec::<f32>().unwrap(), vec![1.0, 0.0]);
}

#[test]
fn layer_norm_table() {
    // A known vector: mean 2.5, biased variance 1.25.
    let x = Tensor::from_vec(vec![1.0f64, 2.0, 3.0, 4.0], &[1, 4]).unwrap();
    let (y, mean, rstd) = x.layer_norm_with_stats(None, None, 0.0).unwrap();
    let r = 1.0 / 1.25f64.sqrt();
    assert_close(&y, &[-1.5 * r, -0.5 * r, 0.5 * r, 1.5 * r], 1e-15, "known");
    assert_eq!((mean.shape(), mean.to_vec::<f64>().unwrap()), (&[1, 1][..], vec![2.5]));
    assert_close(&rstd, &[r], 1e-15, "rstd");
    for dtype in FLOATS {
        let x = sample(&[3, 4, 8], dtype, 41);
        let w = sample(&[8], dtype, 42);
        let b = sample(&[8], dtype, 43);
        for (xs, w, b) in [
            (x.clone(), Some(&w), Some(&b)),
            (x.clone(), None, None),
            (x.transpose(0, 1).unwrap(), Some(&w), None),
        ] {
            let (wv, bv) = (w.map(|w| w.to_f64_vec()), b.map(|b| b.to_f64_vec()));
            let want = rows(&xs.to_f64_vec(), 8, |r| {
                let m = r.iter().sum::<f64>() / 8.0;
                let v = r.iter().map(|x| (x - m).powi(2)).sum::<f64>() / 8.0;
                (0..8)
                    .map(|j| {
                        let y = (r[j] - m) / (v + 1e-5).sqrt();
                        y * wv.as_ref().map_or(1.0, |w| w[j]) + bv.as_ref().map_or(0.0, |b| b[j])
                    })
                    .collect()
            });
            let (got, mean, rstd) = xs.layer_norm_with_stats(w, b, 1e-5).unwrap();
            assert_eq!((got.shape(), got.dtype()), (xs.shape(), dtype));
            assert_eq!(mean.shape(), &[xs.shape()[0], xs.shape()[1], 1]);
            assert_eq!((mean.dtype(), rstd.dtype()), (DType::F64, DType::F64));
            assert_close(&got, &want, 2.0 * tol(dtype), &format!("layer_norm {dtype}"));
            assert_eq!(got, xs.layer_norm(w, b, 1e-5).unwrap());
        }
    }
    let e = Tensor::zeros(&[0, 4], DType::F32)
        .unwrap()
        .layer_norm(None, None, 1e-5)
        .unwrap();
    assert_eq!(e.shape(), &[0, 4]);
}

#[test]
fn embedding_table() {
    let w = Tensor::arange(12, DType::F32).unwrap().reshape(&[4, 3]).unwrap();
    macro_rules! case {
        ($idx:expr, $shape:expr, $want:expr) => {
            let idx = Tensor::from_vec($idx.to_vec(), &$shape).unwrap();
            let got = w.embedding(&idx).unwrap();
            let mut shape = $shape.to_vec();
            shape.push(3);
            assert_eq!(got.shape(), &shape[..]);
            let want: Vec<f32> = $want;
            assert_eq!(got.to_vec::<f32>().unwrap(), want);
        };
    }
    case!([2i64], [1], vec![6.0, 7.0, 8.0]);
    case!(
        [3i64, 0, 3, 1],
        [2, 2],
        vec![9., 10., 11., 0., 1., 2., 9., 10., 11., 3., 4., 5.]
    );
    case!([1i64], [0usize; 0], vec![3.0, 4.0, 5.0]);
    case!([0i64; 0], [0], vec![]);
    // A strided table, and other dtypes.
    let wt = w.transpose(0, 1).unwrap(); // [3, 4]
    let idx = Tensor::from_vec(vec![2i64, 0], &[2]).unwrap();
    assert_eq!(
        wt.embedding(&idx).unwrap().to_vec::<f32>().unwrap(),
        vec![2., 5., 8., 11., 0., 3., 6., 9.]
    );
    let wb = w.cast(DType::BF16).unwrap();
    assert_eq!(
        wb.embedding(&idx).unwrap().to_vec::<bf16>().unwrap()[0],
        bf16::from_f32(6.0)
    );
}

#[test]
fn cross_entropy_table() {
    // Uniform logits over C classes: the loss is ln C in every dtype.
    for dtype in FLOATS {
        let logits = Tensor::full(&[3, 10], 0.7, dtype).unwrap();
        let t = Tensor::from_vec(vec![0i64, 9, 4], &[3]).unwrap();
        for red in [Reduction::Mean, Reduction::Sum] {
            let loss = logits.cross_entropy(&t, red).unwrap();
            assert_eq!((loss.shape(), loss.dtype()), (&[][..], dtype));
            let want = 10f64.ln() * if red == Reduction::Sum { 3.0 } else { 1.0 };
            assert_close(&loss, &[want], tol(dtype), &format!("uniform {dtype} {red:?}"));
        }
    }
    // Random logits against the f64 reference, strided.
    for dtype in FLOATS {
        let logits = sample(&[7, 5], dtype, 51)
            .mul_scalar(2.0)
            .unwrap()
            .transpose(0, 1)
            .unwrap(); // [5, 7]
        let t = Tensor::from_vec(vec![0i64, 6, 3, 3, 1], &[5]).unwrap();
        let x = logits.to_f64_vec();
        let want: Vec<f64> = (0..5)
            .map(|i| {
                let r = &x[i * 7..(i + 1) * 7];
                -log_softmax_ref(r)[t.to_vec::<i64>().unwrap()[i] as usize]
            })
            .collect();
        let none = logits.cross_entropy(&t, Reduction::None).unwrap();
        assert_eq!(none.shape(), &[5]);
        assert_close(&none, &want, tol(dtype), &format!("none {dtype}"));
        let (mean, probs) = logits.cross_entropy_with_grad(&t, Reduction::Mean).unwrap();
        assert_close(
            &mean,
            &[want.iter().sum::<f64>() / 5.0],
            tol(dtype),
            &format!("mean {dtype}"),
        );
        assert_close(
            &probs,
            &logits.softmax(1).unwrap().to_f64_vec(),
            tol(dtype),
            &format!("probs {dtype}"),
        );
    }
    let empty = Tensor::zeros(&[0, 3], DType::F32).unwrap();
    let t = Tensor::zeros(&[0], DType::I64).unwrap();
    assert!(
        empty
            .cross_entropy(&t, Reduction::Mean)
            .unwrap()
            .to_vec::<f32>()
            .unwrap()[0]
            .is_nan()
    );
    assert_eq!(
        empty
            .cross_entropy(&t, Reduction::Sum)
            .unwrap()
            .to_vec::<f32>()
            .unwrap(),
        vec![0.0]
    );
}

#[test]
fn causal_mask_table() {
    macro_rules! case {
        ($shape:expr, $want:expr) => {
            let n: usize = $shape.iter().product();
            let t = Tensor::arange(n, DType::F32).unwrap().reshape(&$shape).unwrap();
            let got = t.causal_mask(-1.0).unwrap();
            assert_eq!(got.shape(), &$shape[..]);
            let want: Vec<f32> = $want;
            assert_eq!(got.to_vec::<f32>().unwrap(), want);
        };
    }
    case!([2, 2], vec![0., -1., 2., 3.]);
    case!([2, 3], vec![0., -1., -1., 3., 4., -1.]);
    case!([3, 2], vec![0., -1., 2., 3., 4., 5.]);
    case!([2, 2, 2], vec![0., -1., 2., 3., 4., -1., 6., 7.]);
    case!([0, 2], vec![]);
    let s = sample(&[2, 3, 3], DType::BF16, 1).transpose(1, 2).unwrap();
    let m = s.causal_mask(f64::NEG_INFINITY).unwrap();
    let (x, y) = (s.to_f64_vec(), m.to_f64_vec());
    for (k, (&a, &b)) in x.iter().zip(&y).enumerate() {
        let (i, j) = ((k / 3) % 3, k % 3);
        assert_eq!(b, if j > i { f64::NEG_INFINITY } else { a }, "element {k}");
    }
}

#[test]
fn nn_errors() {
    macro_rules! case {
        ($res:expr, $msg:expr) => {
            assert_eq!($res.unwrap_err().to_string(), $msg);
        };
    }
    let x = sample(&[2, 4], DType::F32, 1);
    case!(x.softmax(2), "softmax: dim 2 is out of range for a tensor of rank 2");
    case!(
        x.log_softmax(5),
        "log_softmax: dim 5 is out of range for a tensor of rank 2"
    );
    case!(
        x.layer_norm(Some(&sample(&[3], DType::F32, 1)), None, 1e-5),
        "layer_norm: shape mismatch: weight has shape [3] but input [2, 4] normalizes a last dim of 4; \
         pass a [4] weight"
    );
    case!(
        x.layer_norm(None, Some(&sample(&[4], DType::F64, 1)), 1e-5),
        "layer_norm: expected dtype f32, got f64"
    );
    case!(
        sample(&[], DType::F32, 1).layer_norm(None, None, 1e-5),
        "layer_norm: a rank-0 tensor has no dim to normalize; reshape it to [1] first"
    );
    let idx = Tensor::from_vec(vec![1i64, 4, 0], &[3]).unwrap();
    case!(
        x.embedding(&idx),
        "embedding: index 4 (element 1 of indices of shape [3]) is out of range for a table of 2 rows; \
         indices must be in 0..2"
    );
    case!(
        x.embedding(&Tensor::from_vec(vec![-1i64], &[1]).unwrap()),
        "embedding: index -1 (element 0 of indices of shape [1]) is out of range for a table of 2 rows; \
         indices must be in 0..2"
    );
    case!(x.embedding(&x), "embedding: expected dtype i64, got f32");
    case!(
        sample(&[4], DType::F32, 1).embedding(&idx),
        "embedding: the table must be [V, D], got shape [4]"
    );
    let t = Tensor::from_vec(vec![1i64, 3], &[2]).unwrap();
    case!(
        x.cross_entropy(&Tensor::from_vec(vec![1i64, 4], &[2]).unwrap(), Reduction::Mean),
        "cross_entropy: target 4 of row 1 is not a class of 0..4"
    );
    case!(
        x.cross_entropy(&idx, Reduction::Sum),
        "cross_entropy: shape mismatch: logits [2, 4] need targets of shape [2], got [3]"
    );
    case!(
        x.reshape(&[8]).unwrap().cross_entropy(&t, Reduction::Mean),
        "cross_entropy: logits must be [N, C], got shape [8]; reshape to 2-D first"
    );
    case!(
        x.cross_entropy(&x, Reduction::Mean),
        "cross_entropy: expected dtype i64, got f32"
    );
    case!(
        t.cast(DType::I64)
            .unwrap()
            .reshape(&[1, 2])
            .unwrap()
            .cross_entropy(&Tensor::zeros(&[1], DType::I64).unwrap(), Reduction::Mean),
        "cross_entropy: dtype i64 is not a floating-point type; cast the tensor to a float dtype first"
    );
    case!(
        sample(&[3], DType::F32, 1).causal_mask(0.0),
        "causal_mask: scores must be [..., T, S], got shape [3]"
    );
}

/// The bits of a tensor's elements (widened to f64, so NaN payloads compare too).
fn bits(t: &Tensor) -> Vec<u64> {
    t.to_f64_vec().iter().map(|v| v.to_bits()).collect()
}

/// The fused attention kernels give the bits of the chains they replace:
/// `mul_scalar`, `causal_mask(−∞)`, `softmax` forward; `softmax_backward`,
/// `causal_mask(0)`, `mul_scalar` backward. Square and non-square scores, a
/// transposed (non-contiguous) input, −∞ and NaN scores, a negative scale.
#[test]
fn attention_probs_equal_the_chain_they_fuse() {
    let special = |dtype| {
        let mut v = sample(&[2, 4, 4], DType::F64, 9).to_f64_vec();
        v[1] = f64::NEG_INFINITY; // one masked-looking score in a kept place
        v[16..20].fill(f64::NEG_INFINITY); // a whole row of −∞: NaN, as softmax gives
        v[22] = f64::NAN;
        Tensor::from_vec(v, &[2, 4, 4]).unwrap().cast(dtype).unwrap()
    };
    type Make = fn(DType) -> Tensor;
    let cases: [(&str, Make); 8] = [
        ("[2,3,5,5]", |d| sample(&[2, 3, 5, 5], d, 1).mul_scalar(4.0).unwrap()),
        // Rows of two groups of eight and a tail of four: the causal rows' sums
        // stop after the group of their last kept key, or run to the end.
        ("[2,20,20] ragged rows", |d| {
            sample(&[2, 20, 20], d, 10).mul_scalar(4.0).unwrap()
        }),
        ("[4,7] more keys", |d| sample(&[4, 7], d, 2).mul_scalar(4.0).unwrap()),
        ("[6,3] more queries", |d| sample(&[6, 3], d, 3).mul_scalar(4.0).unwrap()),
        ("[3,40,40] long rows", |d| {
            sample(&[3, 40, 40], d, 4).mul_scalar(4.0).unwrap()
        }),
        ("transposed", |d| sample(&[2, 6, 6], d, 5).transpose(1, 2).unwrap()),
        ("[0,3,3] empty", |d| sample(&[0, 3, 3], d, 6)),
        ("special values", special),
    ];
    for dtype in FLOATS {
        for (name, make) in cases {
            let x = make(dtype);
            let last = x.rank() - 1;
            let g = sample(x.shape(), dtype, 7);
            for causal in [true, false] {
                for scale in [0.35, -1.5] {
                    let what = format!("{name} {dtype} causal {causal} scale {scale}");
                    let scaled = x.mul_scalar(scale).unwrap();
                    let masked = if causal {
                        scaled.causal_mask(f64::NEG_INFINITY).unwrap()
                    } else {
                        scaled
                    };
                    let want = masked.softmax(last).unwrap();
                    let got = x.attention_probs(scale, causal).unwrap();
                    assert_eq!((got.shape(), got.dtype()), (x.shape(), dtype), "{what}");
                    assert_eq!(bits(&got), bits(&want), "forward {what}");

                    let d = g.softmax_backward(&want, last).unwrap();
                    let d = if causal { d.causal_mask(0.0).unwrap() } else { d };
                    let want_g = d.mul_scalar(scale).unwrap();
                    let got_g = g.attention_probs_backward(&got, scale, causal).unwrap();
                    assert_eq!(bits(&got_g), bits(&want_g), "backward {what}");
                }
            }
        }
    }
    // Masked keys get exactly zero weight; kept ones sum to 1 per row.
    let p = sample(&[3, 5, 5], DType::F32, 8).attention_probs(0.5, true).unwrap();
    let p = p.to_f64_vec();
    for (r, row) in p.chunks(5).enumerate() {
        let i = r % 5;
        assert!(row[i + 1..].iter().all(|&v| v == 0.0), "row {r}: {row:?}");
        assert!((row.iter().sum::<f64>() - 1.0).abs() < 1e-6, "row {r}: {row:?}");
    }
}

/// The `f32` rows of whole groups of eight keys (the AVX-512 kernel, one row
/// at a time and four at a time) give the bits of the generic row kernel:
/// every count of kept keys from none to all, rows of one to sixteen groups,
/// large, tiny, −∞ and NaN scores, a negative scale, and blocks of rows that
/// are not a multiple of four.
#[test]
fn attention_probs_rows_have_the_generic_rows_bits() {
    assert_eq!(
        vector_rows(24),
        Simd::best() == Simd::Avx512,
        "the vector rows run where AVX-512F is"
    );
    assert!(!vector_rows(20), "rows of a partial group stay generic");
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for s in [8, 16, 24, 40, 128] {
        let mut x: Vec<f32> = sample(&[s + 3, s], DType::F32, s as u64)
            .mul_scalar(30.0)
            .unwrap()
            .to_f64_vec()
            .iter()
            .map(|&v| v as f32)
            .collect();
        // Special rows: a huge score, a NaN, a −∞ among finite scores, tiny
        // scores (subnormal weights), all −∞.
        x[s + 1] = 3.0e38;
        x[2 * s + s / 2] = f32::NAN;
        x[3 * s] = f32::NEG_INFINITY;
        x[4 * s..5 * s].iter_mut().for_each(|v| *v = -100.0 * v.abs() - 80.0);
        x[5 * s..6 * s].fill(f32::NEG_INFINITY);
        for scale in [0.35f32, -1.5] {
            let generic = |keep: usize, row: &[f32]| {
                let mut out = vec![7.0f32; s];
                probs_row_generic(keep, scale, row, &mut out, &mut Default::default());
                out
            };
            for (r, row) in x.chunks_exact(s).enumerate() {
                for keep in 0..=s {
                    let mut got = vec![7.0f32; s];
                    attention_probs_row(keep, scale, row, &mut got, &mut Default::default());
                    assert_eq!(
                        bits(&got),
                        bits(&generic(keep, row)),
                        "s {s} row {r} keep {keep} scale {scale}"
                    );
                }
            }
            for causal in [true, false] {
                let mut got = vec![7.0f32; x.len()];
                attention_probs_rows(causal, scale, &x, &mut got, s, &mut Default::default());
                for (q, (row, got)) in x.chunks_exact(s).zip(got.chunks_exact(s)).enumerate() {
                    let keep = crate::ops::rows::causal_keep(causal, q, s);
                    assert_eq!(
                        bits(got),
                        bits(&generic(keep, row)),
                        "s {s} query {q} causal {causal} scale {scale}"
                    );
                }
            }
        }
    }
}

#[test]
fn attention_probs_errors() {
    let x = sample(&[2, 4], DType::F32, 1);
    let msg = |r: Result<Tensor>| r.unwrap_err().to_string();
    assert_eq!(
        msg(sample(&[4], DType::F32, 1).attention_probs(1.0, true)),
        "attention_probs: scores must be [..., T, S], got shape [4]"
    );
    assert_eq!(
        msg(x.attention_probs(f64::INFINITY, true)),
        "attention_probs: the scale must be finite, got inf"
    );
    assert!(msg(Tensor::zeros(&[2, 4], DType::I64).unwrap().attention_probs(1.0, true)).contains("attention_probs"));
    assert_eq!(
        msg(sample(&[2, 3], DType::F32, 1).attention_probs_backward(&x, 1.0, true)),
        "attention_probs_backward: shape mismatch: gradient has shape [2, 3] but probs has [2, 4]; they must be equal"
    );
    assert_eq!(
        msg(x.attention_probs_backward(&x, f64::NAN, false)),
        "attention_probs_backward: the scale must be finite, got NaN"
    );
    assert!(
        msg(x.cast(DType::BF16).unwrap().attention_probs_backward(&x, 1.0, true)).contains("attention_probs_backward")
    );
}
