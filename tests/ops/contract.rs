//! Contractions and reductions: matmul (2-D, batched, batched with a 2-D right
//! operand), its causal parts, fused attention, and sum, mean, max over one
//! and two dims.

use proptest::prelude::*;
use tessera::dtensor::{DTensor, Tensor};
use tessera::tensor::ops::{Attention, Causal};

use crate::harness::{Arg, Op, check, config, float, plain, singles};
use crate::op;

type Shapes = &'static [(&'static [usize], &'static [usize])];

const MATMUL_2D: Shapes = &[
    (&[3, 5], &[5, 7]),
    (&[4, 6], &[6, 2]),
    (&[7, 3], &[3, 5]),
    (&[4, 4], &[4, 4]),
];
const MATMUL_BATCHED: Shapes = &[
    (&[2, 3, 5], &[2, 5, 4]),
    (&[3, 5, 7], &[3, 7, 2]),
    (&[4, 2, 6], &[4, 6, 4]),
];
/// Attention-like `[b, t, e] × [b, e, s]` (scores) whose output `[b, t, s]`
/// is also the left operand of the weights' products (`× [b, s, n]`, and
/// transposed `× [b, t, n]`): the third operand is those right operands' (n
/// columns and as many rows as each product needs, taken from `[b, 7, n]`).
const ATTENTION: &[[&[usize]; 3]] = &[
    [&[2, 5, 3], &[2, 3, 5], &[2, 7, 4]],
    [&[3, 4, 2], &[3, 2, 6], &[3, 7, 3]],
    [&[2, 6, 4], &[2, 4, 3], &[2, 7, 2]],
];
/// Fused attention's `q [b, h, l, e]`, `k [b, h, s, e]`, `v [b, h, s, ev]` and
/// the output's gradient `[b, h, l, ev]`.
const FUSED_ATTENTION: &[[&[usize]; 4]] = &[
    [&[2, 3, 5, 4], &[2, 3, 5, 4], &[2, 3, 5, 2], &[2, 3, 5, 2]],
    [&[3, 2, 4, 3], &[3, 2, 6, 3], &[3, 2, 6, 5], &[3, 2, 4, 5]],
    [&[4, 2, 7, 2], &[4, 2, 3, 2], &[4, 2, 3, 3], &[4, 2, 7, 3]],
];
const MATMUL_2D_RHS: Shapes = &[(&[2, 3, 5], &[5, 4]), (&[3, 5, 7], &[7, 3]), (&[4, 2, 6], &[6, 4])];

fn pairs(shapes: &[(&[usize], &[usize])]) -> Vec<Vec<Arg>> {
    shapes.iter().map(|(a, b)| vec![float(a), float(b)]).collect()
}

/// Every set of one or two dims of a rank-`rank` input (a pair also in descending order).
fn dim_sets(rank: usize) -> Vec<Vec<usize>> {
    let mut out: Vec<Vec<usize>> = (0..rank).map(|d| vec![d]).collect();
    for a in 0..rank {
        for b in a + 1..rank {
            out.push(vec![a, b]);
        }
    }
    if rank > 2 {
        out.push(vec![rank - 1, 0]);
    }
    out
}

proptest! {
    #![proptest_config(config())]

    /// `[m, k] × [k, n]`.
    #[test]
    fn matmul_2d(c in plain(pairs(MATMUL_2D))) {
        check(c, [op!("matmul", |x| x[0].matmul(&x[1]))])?;
    }

    /// `[b, m, k] × [b, k, n]`.
    #[test]
    fn matmul_batched(c in plain(pairs(MATMUL_BATCHED))) {
        check(c, [op!("matmul", |x| x[0].matmul(&x[1]))])?;
    }

    /// `[b, m, k] × [k, n]`.
    #[test]
    fn matmul_batched_2d_rhs(c in plain(pairs(MATMUL_2D_RHS))) {
        check(c, [op!("matmul", |x| x[0].matmul(&x[1]))])?;
    }

    /// The causal parts of batched products against the same parts on the full
    /// tensors (each as exact as the dense product on one device); the weights'
    /// left operands are scores with their masked part zeroed, as attention's are.
    #[test]
    fn matmul_causal(c in plain(ATTENTION.iter().map(|s| s.iter().map(|d| float(d)).collect()).collect())) {
        let (t, s) = (c.args[0].shape[1], c.args[1].shape[2]);
        check(c, [
            op!("scores", |x| x[0].matmul_causal(&x[1], Causal::Scores)),
            op!("weights", |x| {
                let w = x[0].matmul(&x[1])?.causal_mask(0.0)?;
                w.matmul_causal(&x[2].narrow(1, 0, s)?, Causal::Weights)
            }),
            op!("weights transposed", |x| {
                let w = x[0].matmul(&x[1])?.causal_mask(0.0)?.transpose(1, 2)?;
                w.matmul_causal(&x[2].narrow(1, 0, t)?, Causal::WeightsTransposed)
            }),
            op!("dense", |x| x[0].matmul_causal(&x[1], Causal::Dense)),
        ])?;
    }

    /// Fused attention (output, weights and the three gradients, causal or
    /// not) on sharded inputs against the same kernels on the full tensors.
    #[test]
    fn attention(c in plain(FUSED_ATTENTION.iter().map(|s| s.iter().map(|d| float(d)).collect()).collect())) {
        let mut ops = Vec::new();
        for is_causal in [true, false] {
            let attn = Attention { scale: 0.7, is_causal };
            ops.push(op!(format!("output, causal {is_causal}"), [attn], |x| Ok(x[0].attention(&x[1], &x[2], attn)?.0)));
            ops.push(op!(format!("weights, causal {is_causal}"), [attn], |x| Ok(x[0].attention(&x[1], &x[2], attn)?.1)));
            for (j, name) in ["dq", "dk", "dv"].iter().enumerate() {
                ops.push(op!(format!("{name}, causal {is_causal}"), [attn], |x| {
                    let (_, probs) = x[0].attention(&x[1], &x[2], attn)?;
                    let mut grads = x[3].attention_backward(&x[0], &x[1], &x[2], &probs, attn, [true; 3])?;
                    Ok(grads[j].take().expect("asked for"))
                }));
            }
        }
        check(c, ops)?;
    }

    /// sum, mean and max over every one or two dims, with and without keepdim.
    #[test]
    fn reductions(c in plain(singles(&[&[7], &[3, 5], &[4, 6], &[2, 3, 5], &[3, 5, 7]]))) {
        let sets = dim_sets(c.args[0].shape.len());
        let mut ops: Vec<Op> = Vec::new();
        for dims in &sets {
            for keep in [false, true] {
                ops.push(op!(format!("sum({dims:?}, {keep})"), [dims], |x| x[0].sum(&dims, keep)));
                ops.push(op!(format!("mean({dims:?}, {keep})"), [dims], |x| x[0].mean(&dims, keep)));
                ops.push(op!(format!("max({dims:?}, {keep})"), [dims], |x| x[0].max(&dims, keep)));
            }
        }
        check(c, ops)?;
    }
}
