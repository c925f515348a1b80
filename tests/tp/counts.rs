//! Collectives per block and step of the reference Transformer's TP plans (rank 0's
//! counters): the plain plan all-reduces twice per block in forward, the
//! sequence-parallel plan moves the same bytes as all-gather + reduce-scatter
//! pairs, and loss parallel moves per-row statistics, never the logits.

use tessera::autograd::nn::Materializer;
use tessera::dtensor::{DType, Tensor};
use tessera::mesh::{CommCounts, OpKind};
use tessera::models::{Transformer, TransformerConfig};
use tessera::{DeviceMesh, launch};

use crate::step_counted;

/// Forward and backward counters of one step of a randomly initialised tiny model
/// with `n_layers` blocks on `tp` ranks (pure TP), batch `[4, 17]`.
fn step(tp: usize, n_layers: usize, sp: bool) -> (CommCounts, CommCounts) {
    launch(tp, move |ctx| {
        let mesh = DeviceMesh::with_names(ctx.into_comm(), &[1, tp], &["dp", "tp"])?;
        let cfg = TransformerConfig {
            n_layers,
            ..TransformerConfig::TINY
        };
        let model = Transformer::new(cfg, &mesh, DType::F32)?;
        model.parallelize(&mesh.dim("tp")?, sp)?;
        Materializer::from_seed(0).materialize(&model)?;
        let rows: Vec<i64> = (0..4 * 17).map(|i| (i * 37 % 256) as i64).collect();
        let (_, fwd, bwd) = step_counted(&model, &mesh, &Tensor::from_vec(rows, &[4, 17])?)?;
        Ok((fwd, bwd))
    })
    .unwrap()
    .swap_remove(0)
}

fn calls(c: &CommCounts) -> [u64; 4] {
    [
        c.calls(OpKind::AllGather),
        c.calls(OpKind::ReduceScatter),
        c.calls(OpKind::AllReduce),
        c.calls(OpKind::AllToAll),
    ]
}

fn bytes(c: &CommCounts) -> [u64; 4] {
    [
        c.bytes(OpKind::AllGather),
        c.bytes(OpKind::ReduceScatter),
        c.bytes(OpKind::AllReduce),
        c.bytes(OpKind::AllToAll),
    ]
}

fn minus(a: [u64; 4], b: [u64; 4]) -> [u64; 4] {
    [a[0] - b[0], a[1] - b[1], a[2] - b[2], a[3] - b[3]]
}

/// `(n − 1)/n` of `b` bytes: what one rank sends in an all-gather or reduce-scatter.
fn share(n: u64, b: u64) -> u64 {
    (n - 1) * b / n
}

#[test]
fn plain_plan_all_reduces_twice_per_block() {
    for tp in [2u64, 4] {
        let (f1, b1) = step(tp as usize, 1, false);
        let (f3, b3) = step(tp as usize, 3, false);
        let (act, logits) = (4 * 16 * 64 * 4, 4 * 16 * 256 * 4);
        // Two blocks' worth: the attention output and the MLP output, all-reduced.
        assert_eq!(minus(calls(&f3), calls(&f1)), [0, 0, 4, 0], "tp={tp}: {f1} / {f3}");
        assert_eq!(bytes(&f3)[2] - bytes(&f1)[2], 4 * 2 * share(tp, act));
        // One block: its two all-reduces, both embeddings' and the head's logits gathered.
        assert_eq!(calls(&f1), [1, 0, 2 + 2, 0], "tp={tp}: {f1}");
        assert_eq!(bytes(&f1)[0], share(tp, logits), "the head gathers the logits");
        // Backward, as Megatron's: per block one all-reduce of the input gradient of
        // the column-parallel layers before attention and before the MLP (reduced
        // once for the norm's three gradients), plus one for the head's input.
        let per_block = minus(calls(&b3), calls(&b1));
        eprintln!("tp={tp} plain: forward {f1}; backward {b1}; backward per block {per_block:?}");
        assert_eq!(per_block, [0, 0, 4, 0], "tp={tp}: {b1} / {b3}");
        assert_eq!(bytes(&b3)[2] - bytes(&b1)[2], 4 * 2 * share(tp, act));
        assert_eq!(calls(&b1), [0, 0, 2 + 1, 0], "tp={tp}: {b1}");
    }
}

#[test]
fn sequence_parallel_moves_the_same_bytes_as_gather_scatter_pairs() {
    for tp in [2u64, 4] {
        let (p1, _) = step(tp as usize, 1, false);
        let (p3, _) = step(tp as usize, 3, false);
        let (s1, sb1) = step(tp as usize, 1, true);
        let (s3, _) = step(tp as usize, 3, true);
        let act = 4 * 16 * 64 * 4;
        // Per block: all-gather before attention and MLP, reduce-scatter after each.
        assert_eq!(minus(calls(&s3), calls(&s1)), [4, 4, 0, 0], "tp={tp}: {s1} / {s3}");
        let sp_block = minus(bytes(&s3), bytes(&s1));
        let plain_block = minus(bytes(&p3), bytes(&p1));
        assert_eq!(
            sp_block[0] + sp_block[1],
            plain_block[2],
            "tp={tp}: the same bytes per block"
        );
        assert_eq!(sp_block[0], 4 * share(tp, act));
        // One block: its 2 + 2, the embeddings reduce-scattered to sequence shards,
        // the head's input gathered, and the loss's two row-statistic all-reduces.
        assert_eq!(calls(&s1), [2 + 1, 2 + 2, 2, 0], "tp={tp}: {s1}");
        // Backward mirrors it (an all-gather where forward reduce-scattered and the
        // reverse); the norms' replicated parameters get their gradients, partial
        // over the sequence shards, all-reduced: 3 norms × (weight, bias).
        assert_eq!(calls(&sb1), [2 + 2, 2 + 1, 3 * 2, 0], "tp={tp}: {sb1}");
        eprintln!("tp={tp} sequence parallel: forward {s1}; backward {sb1}");
    }
}

#[test]
fn loss_parallel_moves_row_statistics_not_logits() {
    for tp in [2u64, 4] {
        let (p1, _) = step(tp as usize, 1, false);
        let (s1, sb1) = step(tp as usize, 1, true);
        let rows = 4 * 16;
        let logits = rows * 256 * 4;
        // Max, then sum of exponentials and target logit together: 3 f32 per row.
        let loss_bytes = 2 * share(tp, rows * 4) + 2 * share(tp, 2 * rows * 4);
        assert_eq!(bytes(&s1)[2], loss_bytes, "tp={tp}: {s1}");
        // The plain plan gathers the logits instead (what loss parallel avoids).
        let gathered = share(tp, logits);
        assert_eq!(bytes(&p1)[0], gathered);
        assert!(loss_bytes * 20 < gathered);
        eprintln!(
            "tp={tp}: loss parallel all-reduces {loss_bytes} B per rank; gathering the logits sends {gathered} B \
             ({:.0}x more)",
            gathered as f64 / loss_bytes as f64
        );
        // Backward through the loss moves nothing over tp beyond the blocks' own.
        assert_eq!(sb1.calls(OpKind::AllToAll), 0);
    }
}
