//! The neural-network ops: softmax, log_softmax, layer_norm, rms_norm, rotary
//! embeddings, key/value head repetition, embedding, cross_entropy, causal_mask.

use proptest::prelude::*;
use tessera::dtensor::{DTensor, Placement, Tensor};
use tessera::tensor::ops::Reduction;

use crate::harness::{Op, check, config, float, index, plain, singles};
use crate::op;

/// Cross entropy of `[..., C]` logits on one device: rows flattened to `[N, C]`.
fn cross_entropy_oracle(x: &[Tensor], reduction: Reduction) -> tessera::tensor::Result<Tensor> {
    let s = x[0].shape();
    let c = s[s.len() - 1];
    let n = x[1].numel();
    x[0].reshape(&[n, c])?.cross_entropy(&x[1].reshape(&[n])?, reduction)
}

/// `x` with its last (class) dim gathered wherever a mesh dim shards it.
fn class_whole(x: &DTensor) -> tessera::dtensor::Result<DTensor> {
    let last = x.shape().len() - 1;
    let target: Vec<Placement> = x
        .placements()
        .iter()
        .map(|&p| if p.is_shard_on(last) { Placement::Replicate } else { p })
        .collect();
    x.redistribute(&target)
}

proptest! {
    #![proptest_config(config())]

    /// softmax and log_softmax along every dim.
    #[test]
    fn softmax(c in plain(singles(&[&[7], &[3, 5], &[4, 6], &[2, 3, 5], &[3, 5, 7]]))) {
        let mut ops: Vec<Op> = Vec::new();
        for d in 0..c.args[0].shape.len() {
            ops.push(op!(format!("softmax({d})"), |x| x[0].softmax(d)));
            ops.push(op!(format!("log_softmax({d})"), |x| x[0].log_softmax(d)));
        }
        check(c, ops)?;
    }

    /// layer_norm over the last dim with weight and bias (and with only one of them).
    #[test]
    fn layer_norm(c in plain([&[3, 5][..], &[4, 6], &[2, 3, 5], &[3, 5, 7]].iter().map(|s| {
        let d = s[s.len() - 1];
        vec![float(s), float(&[d]), float(&[d])]
    }).collect())) {
        check(c, [
            op!("layer_norm(w, b)", |x| x[0].layer_norm(Some(&x[1]), Some(&x[2]), 1e-5)),
            op!("layer_norm(w, -)", |x| x[0].layer_norm(Some(&x[1]), None, 1e-5)),
            op!("layer_norm(-, b)", |x| x[0].layer_norm(None, Some(&x[2]), 1e-5)),
            op!("layer_norm(-, -)", |x| x[0].layer_norm(None, None, 1e-5)),
            // The statistics the backward takes, placed as the output.
            op!("layer_norm_with_stats mean", |x| Ok(x[0].layer_norm_with_stats(Some(&x[1]), None, 1e-5)?.1)),
            op!("layer_norm_with_stats rstd", |x| Ok(x[0].layer_norm_with_stats(None, Some(&x[2]), 1e-5)?.2)),
        ])?;
    }

    /// RMSNorm over the last dim, with and without its weight, and its `rstd`.
    #[test]
    fn rms_norm(c in plain([&[3, 5][..], &[4, 6], &[2, 3, 5], &[3, 5, 7]].iter().map(|s| {
        vec![float(s), float(&[s[s.len() - 1]])]
    }).collect())) {
        check(c, [
            op!("rms_norm(w)", |x| x[0].rms_norm(Some(&x[1]), 1e-5)),
            op!("rms_norm(-)", |x| x[0].rms_norm(None, 1e-5)),
            op!("rms_norm_with_stats rstd", |x| Ok(x[0].rms_norm_with_stats(Some(&x[1]), 1e-5)?.1)),
        ])?;
    }

    /// Rotary embeddings of `[B, S, H, D]` and `[S, H, D]` (sequence, head and
    /// batch shards kept; the tables' rows follow a sequence shard) and their
    /// backward.
    #[test]
    fn rotary_embedding(c in plain(singles(&[&[2, 5, 3, 4], &[3, 4, 2, 6], &[5, 3, 4]]))) {
        let s = &c.args[0].shape;
        let (seq, d) = (s[s.len() - 3], s[s.len() - 1]);
        let positions: Vec<usize> = (0..seq).map(|p| 3 * p + 1).collect();
        let (cos, sin) = tessera::tensor::ops::rotary_tables(&positions, d, 100.0).unwrap();
        check(c, [
            op!("rotary_embedding", [cos, sin], |x| x[0].rotary_embedding(&cos, &sin)),
            op!("rotary_embedding_backward", [cos, sin], |x| x[0].rotary_embedding_backward(&cos, &sin)),
        ])?;
    }

    /// Key/value head repetition along each dim, and the group sums of its backward.
    #[test]
    fn repeat_interleave(c in plain(singles(&[&[2, 4, 2, 3], &[3, 2, 5], &[4, 6]]))) {
        let rank = c.args[0].shape.len();
        let mut ops: Vec<Op> = Vec::new();
        for dim in 0..rank {
            ops.push(op!(format!("repeat_interleave(2, {dim})"), |x| x[0].repeat_interleave(2, dim)).exact());
            if c.args[0].shape[dim] % 2 == 0 {
                ops.push(op!(format!("repeat_interleave_backward(2, {dim})"), |x| {
                    x[0].repeat_interleave_backward(2, dim)
                }));
            }
        }
        check(c, ops)?;
    }

    /// Embedding of a `[7, 4]` table (and a `[5, 3]` one).
    #[test]
    fn embedding(c in plain(vec![
        vec![float(&[7, 4]), index(&[2, 3], 7)],
        vec![float(&[7, 4]), index(&[5], 7)],
        vec![float(&[5, 3]), index(&[3, 4], 5)],
    ])) {
        check(c, [op!("embedding", |x| x[0].embedding(&x[1])).exact()])?;
    }

    /// Cross entropy, mean and sum, of `[N, C]` and `[B, T, C]` logits.
    #[test]
    fn cross_entropy(c in plain(vec![
        vec![float(&[5, 3]), index(&[5], 3)],
        vec![float(&[4, 6]), index(&[4], 6)],
        vec![float(&[7, 5]), index(&[7], 5)],
        vec![float(&[2, 3, 5]), index(&[2, 3], 5)],
        vec![float(&[3, 5, 4]), index(&[3, 5], 4)],
    ])) {
        check(c, [
            Op::new("cross_entropy(mean)", |x| x[0].cross_entropy(&x[1], Reduction::Mean), |x| {
                cross_entropy_oracle(x, Reduction::Mean)
            }),
            Op::new("cross_entropy(sum)", |x| x[0].cross_entropy(&x[1], Reduction::Sum), |x| {
                cross_entropy_oracle(x, Reduction::Sum)
            }),
        ])?;
    }

    /// Cross entropy with its probabilities (the class dim gathered first): the
    /// loss and the probabilities as on one device, and the gradient from the
    /// probabilities as the one from the logits.
    #[test]
    fn cross_entropy_with_grad(c in plain(vec![
        vec![float(&[5, 3]), index(&[5], 3)],
        vec![float(&[4, 6]), index(&[4], 6)],
        vec![float(&[2, 3, 5]), index(&[2, 3], 5)],
    ])) {
        let oracle = |x: &[Tensor], reduction| {
            let s = x[0].shape();
            let n = x[1].numel();
            let (loss, p) = x[0].reshape(&[n, s[s.len() - 1]])?.cross_entropy_with_grad(&x[1].reshape(&[n])?, reduction)?;
            Ok::<_, tessera::tensor::Error>((loss, p.reshape(s)?))
        };
        check(c, [
            Op::new("cross_entropy_with_grad(mean).loss", |x| Ok(class_whole(&x[0])?.cross_entropy_with_grad(&x[1], Reduction::Mean)?.0), move |x| {
                Ok(oracle(x, Reduction::Mean)?.0)
            }),
            Op::new("cross_entropy_with_grad(sum).probs", |x| Ok(class_whole(&x[0])?.cross_entropy_with_grad(&x[1], Reduction::Sum)?.1), move |x| {
                Ok(oracle(x, Reduction::Sum)?.1)
            }),
        ])?;
    }

    /// Causal masking of `[..., T, S]` scores, with −∞ and a finite fill.
    #[test]
    fn causal_mask(c in plain(singles(&[&[3, 5], &[5, 3], &[4, 4], &[2, 3, 5], &[2, 5, 5]]))) {
        check(c, [
            op!("causal_mask(-inf)", |x| x[0].causal_mask(f64::NEG_INFINITY)).exact(),
            op!("causal_mask(-1e4)", |x| x[0].causal_mask(-1e4)).exact(),
        ])?;
    }
}
