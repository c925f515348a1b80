//! The fused attention kernels against the chain of ops they replace.

use tessera_mesh::DType;

use super::*;
use crate::ops::testutil::{assert_close, sample};

/// The chain's forward, written with the public ops: scores, weights, output.
fn chain(q: &Tensor, k: &Tensor, v: &Tensor, attn: Attention) -> (Tensor, Tensor) {
    let r = q.rank();
    let part = |p| if attn.is_causal { p } else { Causal::Dense };
    let scores = q
        .matmul_causal(&k.transpose(r - 2, r - 1).unwrap(), part(Causal::Scores))
        .unwrap();
    let probs = scores.attention_probs(attn.scale, attn.is_causal).unwrap();
    (probs.matmul_causal(v, part(Causal::Weights)).unwrap(), probs)
}

/// The chain's backward with the public ops: `dq`, `dk`, `dv`.
fn chain_grads(g: &Tensor, q: &Tensor, k: &Tensor, v: &Tensor, probs: &Tensor, attn: Attention) -> [Tensor; 3] {
    let r = q.rank();
    let part = |p| if attn.is_causal { p } else { Causal::Dense };
    let t = |x: &Tensor| x.transpose(r - 2, r - 1).unwrap();
    let dp = g.matmul_causal(&t(v), part(Causal::Scores)).unwrap();
    let ds = dp.attention_probs_backward(probs, attn.scale, attn.is_causal).unwrap();
    [
        ds.matmul_causal(k, part(Causal::Weights)).unwrap(),
        t(&ds).matmul_causal(q, part(Causal::WeightsTransposed)).unwrap(),
        t(probs).matmul_causal(g, part(Causal::WeightsTransposed)).unwrap(),
    ]
}

fn bits(t: &Tensor) -> Vec<u64> {
    t.to_f64_vec().iter().map(|v| v.to_bits()).collect()
}

/// `[b, h, t, e]` heads as attention reads them: a permuted view of a
/// `[b, t, h, e]` projection (strided rows, heads interleaved).
fn heads(b: usize, h: usize, t: usize, e: usize, dtype: DType, seed: u64) -> Tensor {
    sample(&[b, t, h, e], dtype, seed).permute(&[0, 2, 1, 3]).unwrap()
}

/// Values and all three gradients equal the chain's bit for bit: every float
/// dtype, causal or not, ragged tile edges, more queries than keys and fewer,
/// products too deep for the small kernel (300 keys), one batch entry (no
/// split over threads) and many, contiguous and strided head views.
#[test]
fn fused_attention_has_the_chains_bits() {
    // (batch, heads, queries, keys, head size, value size)
    let shapes = [
        (2, 3, 37, 37, 16, 8),
        (1, 1, 128, 128, 32, 32),
        (2, 2, 20, 33, 5, 7),
        (1, 2, 33, 20, 4, 4),
        (1, 2, 300, 300, 8, 8),
        // Whole groups of eight keys (the f32 rows' vector kernel), queries
        // not a multiple of the four rows it runs at once.
        (2, 2, 13, 24, 8, 8),
    ];
    for dtype in [DType::F32, DType::F64, DType::BF16, DType::F16] {
        for (case, &(b, h, l, s, e, ev)) in shapes.iter().enumerate() {
            let seed = 10 * case as u64;
            let q = heads(b, h, l, e, dtype, seed);
            let (k, v) = if case % 2 == 0 {
                (heads(b, h, s, e, dtype, seed + 1), heads(b, h, s, ev, dtype, seed + 2))
            } else {
                (
                    sample(&[b, h, s, e], dtype, seed + 1),
                    sample(&[b, h, s, ev], dtype, seed + 2),
                )
            };
            let g = heads(b, h, l, ev, dtype, seed + 3);
            for is_causal in [true, false] {
                let attn = Attention {
                    scale: 1.0 / (e as f64).sqrt(),
                    is_causal,
                };
                let what = format!("{dtype} {:?} causal {is_causal}", shapes[case]);
                let (out, probs) = q.attention(&k, &v, attn).unwrap();
                let (want_out, want_probs) = chain(&q, &k, &v, attn);
                assert_eq!(out.shape(), want_out.shape(), "{what}");
                assert_eq!(bits(&out), bits(&want_out), "output, {what}");
                assert_eq!(bits(&probs), bits(&want_probs), "weights, {what}");
                let grads = g.attention_backward(&q, &k, &v, &probs, attn, [true; 3]).unwrap();
                let want = chain_grads(&g, &q, &k, &v, &want_probs, attn);
                for (name, (got, want)) in ["dq", "dk", "dv"].iter().zip(grads.iter().zip(&want)) {
                    let got = got.as_ref().unwrap();
                    assert_eq!(got.shape(), want.shape(), "{name}, {what}");
                    assert_eq!(bits(got), bits(want), "{name}, {what}");
                }
            }
        }
    }
}

/// Only the gradients asked for are computed; each equals the full run's.
#[test]
fn attention_backward_returns_what_is_asked() {
    let (q, k, v) = (
        heads(2, 2, 9, 4, DType::F32, 1),
        heads(2, 2, 9, 4, DType::F32, 2),
        heads(2, 2, 9, 3, DType::F32, 3),
    );
    let g = sample(&[2, 2, 9, 3], DType::F32, 4);
    let attn = Attention {
        scale: 0.5,
        is_causal: true,
    };
    let (_, probs) = q.attention(&k, &v, attn).unwrap();
    let all = g.attention_backward(&q, &k, &v, &probs, attn, [true; 3]).unwrap();
    for j in 0..3 {
        let mut need = [false; 3];
        need[j] = true;
        let one = g.attention_backward(&q, &k, &v, &probs, attn, need).unwrap();
        for (i, grad) in one.iter().enumerate() {
            assert_eq!(grad.is_some(), i == j, "need {need:?}: gradient {i}");
        }
        assert_eq!(
            bits(one[j].as_ref().unwrap()),
            bits(all[j].as_ref().unwrap()),
            "gradient {j}"
        );
    }
    assert!(
        g.attention_backward(&q, &k, &v, &probs, attn, [false; 3])
            .unwrap()
            .iter()
            .all(Option::is_none)
    );
}

/// Against values worked out by hand: with a head size of 0 every score is 0,
/// so causal query `i` averages the values of keys `0..=i`, and the others
/// average all of them.
#[test]
fn empty_head_size_averages_the_values() {
    let q = Tensor::zeros(&[1, 3, 0], DType::F64).unwrap();
    let k = Tensor::zeros(&[1, 3, 0], DType::F64).unwrap();
    let v = Tensor::from_vec(vec![3.0f64, 6.0, 9.0], &[1, 3, 1]).unwrap();
    for (is_causal, want) in [(true, [3.0, 4.5, 6.0]), (false, [6.0, 6.0, 6.0])] {
        let (out, probs) = q.attention(&k, &v, Attention { scale: 1.0, is_causal }).unwrap();
        assert_eq!(probs.shape(), &[1, 3, 3]);
        assert_close(&out, &want, 1e-15, "output");
    }
}

#[test]
fn attention_errors_name_what_does_not_fit() {
    let t = |shape: &[usize]| sample(shape, DType::F32, 1);
    let attn = Attention {
        scale: 1.0,
        is_causal: true,
    };
    let msg = |r: Result<(Tensor, Tensor)>| r.unwrap_err().to_string();
    let cases = [
        (
            msg(t(&[2, 5, 3]).attention(&t(&[2, 5, 4]), &t(&[2, 5, 3]), attn)),
            "q's head size 3 differs from k's 4",
        ),
        (
            msg(t(&[2, 5, 3]).attention(&t(&[2, 7, 3]), &t(&[2, 6, 3]), attn)),
            "k has 7 keys but v has 6 values",
        ),
        (
            msg(t(&[2, 5, 3]).attention(&t(&[1, 5, 3]), &t(&[1, 5, 3]), attn)),
            "batch dims must be equal",
        ),
        (msg(t(&[3]).attention(&t(&[3]), &t(&[3]), attn)), "need one rank ≥ 2"),
        (
            msg(t(&[2, 5, 3]).attention(
                &t(&[2, 5, 3]),
                &t(&[2, 5, 3]),
                Attention {
                    scale: f64::NAN,
                    is_causal: false,
                },
            )),
            "the scale must be finite, got NaN",
        ),
        (
            msg(t(&[2, 5, 3]).attention(&t(&[2, 5, 3]), &sample(&[2, 5, 3], DType::F64, 1), attn)),
            "f64",
        ),
        (
            msg(Tensor::zeros(&[2, 5, 3], DType::I64).unwrap().attention(
                &Tensor::zeros(&[2, 5, 3], DType::I64).unwrap(),
                &Tensor::zeros(&[2, 5, 3], DType::I64).unwrap(),
                attn,
            )),
            "i64",
        ),
    ];
    for (got, want) in cases {
        assert!(got.contains("attention") && got.contains(want), "{got} (want {want})");
    }
    let (q, k, v) = (t(&[2, 5, 3]), t(&[2, 6, 3]), t(&[2, 6, 4]));
    let (_, probs) = q.attention(&k, &v, attn).unwrap();
    let bad_grad = t(&[2, 5, 3])
        .attention_backward(&q, &k, &v, &probs, attn, [true; 3])
        .unwrap_err()
        .to_string();
    assert!(
        bad_grad.contains("the output's gradient has shape [2, 5, 3]") && bad_grad.contains("[2, 5, 4]"),
        "{bad_grad}"
    );
    let bad_probs = t(&[2, 5, 4])
        .attention_backward(&q, &k, &v, &t(&[2, 5, 5]), attn, [true; 3])
        .unwrap_err()
        .to_string();
    assert!(
        bad_probs.contains("probs has shape [2, 5, 5]") && bad_probs.contains("[2, 5, 6]"),
        "{bad_probs}"
    );
}

/// The output and each gradient are stored in their input's memory order:
/// heads read as a permuted view of `[b, t, h, e]` come back as one (merging
/// them back moves nothing), contiguous inputs give contiguous results, and an
/// input whose last dim is not innermost gives a contiguous result.
#[test]
fn outputs_follow_their_inputs_memory_order() {
    let attn = Attention {
        scale: 0.5,
        is_causal: true,
    };
    let merged = |t: &Tensor| t.permute(&[0, 2, 1, 3]).unwrap().is_contiguous();
    let (q, k, v) = (
        heads(2, 3, 5, 4, DType::F32, 1),
        heads(2, 3, 5, 4, DType::F32, 2),
        heads(2, 3, 5, 6, DType::F32, 3),
    );
    let g = heads(2, 3, 5, 6, DType::F32, 4);
    let (out, probs) = q.attention(&k, &v, attn).unwrap();
    assert!(
        merged(&out) && !out.is_contiguous(),
        "output strides {:?}",
        out.strides()
    );
    assert!(probs.is_contiguous());
    let grads = g.attention_backward(&q, &k, &v, &probs, attn, [true; 3]).unwrap();
    for (name, grad) in ["dq", "dk", "dv"].iter().zip(&grads) {
        assert!(
            merged(grad.as_ref().unwrap()),
            "{name} strides {:?}",
            grad.as_ref().unwrap().strides()
        );
    }
    let (q, k, v) = (
        sample(&[2, 3, 5, 4], DType::F32, 1),
        sample(&[2, 3, 5, 4], DType::F32, 2),
        sample(&[2, 3, 5, 6], DType::F32, 3),
    );
    let (out, probs) = q.attention(&k, &v, attn).unwrap();
    assert!(out.is_contiguous());
    let grads = g.attention_backward(&q, &k, &v, &probs, attn, [true; 3]).unwrap();
    assert!(grads.iter().all(|t| t.as_ref().unwrap().is_contiguous()));
    // Queries with their head size outermost: a contiguous output.
    let qt = sample(&[2, 3, 4, 5], DType::F32, 5).transpose(2, 3).unwrap();
    assert!(qt.attention(&k, &v, attn).unwrap().0.is_contiguous());
}

#[test]
#[cfg(target_arch = "x86_64")]
fn prefetches_cover_each_line_of_a_row_once() {
    // For rows at every alignment and of every length up to four lines: one
    // address in each line from the row's first byte to its last, in order.
    for start in 1000..1000 + 2 * LINE {
        for bytes in 0..4 * LINE {
            let got: Vec<usize> = row_lines(start, bytes).map(|o| (start + o) / LINE).collect();
            let want: Vec<usize> = if bytes == 0 {
                vec![]
            } else {
                (start / LINE..=(start + bytes - 1) / LINE).collect()
            };
            assert_eq!(got, want, "start {start}, {bytes} bytes");
            // Every address is inside the row.
            assert!(
                row_lines(start, bytes).all(|o| o < bytes),
                "start {start}, {bytes} bytes"
            );
        }
    }
}
