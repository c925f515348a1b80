//! Cross entropy on class-sharded logits (loss parallel) against the one-device
//! loss: the bytes it moves (two all_reduces of `rows` and `2 · rows` elements,
//! against an all_gather of `rows · V` to gather the logits), partial logits, the
//! class dim split over two mesh dims in either order, and uneven and empty class
//! shards.

use tessera::dtensor::Placement::{self, Partial, Replicate, Shard};
use tessera::dtensor::testing::partial_local;
use tessera::dtensor::{DTensor, DType, Layout, ReduceOp, ShardOrder, Tensor, distribute_tensor_with_order};
use tessera::mesh::{CommCounts, OpKind};
use tessera::tensor::ops::Reduction;

use crate::harness::on_mesh;

const SUM: Placement = Partial(ReduceOp::Sum);

fn randn(shape: &[usize], seed: u64) -> Tensor {
    Tensor::randn(shape, DType::F64, seed).unwrap()
}

fn targets(shape: &[usize], vocab: usize, seed: i64) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<i64> = (0..n as i64).map(|k| (k * 7 + seed) % vocab as i64).collect();
    Tensor::from_vec(v, shape).unwrap()
}

/// The one-device loss of `[..., V]` logits.
fn oracle(logits: &Tensor, targets: &Tensor, reduction: Reduction) -> f64 {
    let v = *logits.shape().last().unwrap();
    let n = targets.numel();
    let flat = logits.reshape(&[n, v]).unwrap();
    flat.cross_entropy(&targets.reshape(&[n]).unwrap(), reduction)
        .unwrap()
        .to_f64_vec()[0]
}

/// What one rank saw.
struct Seen {
    coord: Vec<usize>,
    loss: f64,
    placements: Vec<Placement>,
    /// Collectives of the loss.
    loss_counts: CommCounts,
    /// Collectives of gathering the logits instead.
    gather_counts: CommCounts,
}

/// Cross entropy of `logits` (placed `lp` in `order`, partial mesh dims split into
/// random pieces) against replicated-or-`tp` targets on `mesh_shape`, counting its
/// collectives and those of gathering the logits to `Replicate`.
fn run(
    mesh_shape: &[usize],
    logits: &Tensor,
    targets: &Tensor,
    lp: &[Placement],
    order: fn(&[Placement]) -> ShardOrder,
    tp: &[Placement],
    reduction: Reduction,
) -> Vec<Seen> {
    let (logits, targets, lp, tp) = (logits.clone(), targets.clone(), lp.to_vec(), tp.to_vec());
    on_mesh(mesh_shape, move |mesh| {
        let layout = Layout::with_order(mesh.shape(), &lp, order(&lp), logits.shape(), logits.dtype())?;
        let local = partial_local(&logits, &layout, mesh.coordinate(), 5)?;
        let x = DTensor::from_local_with_layout(local, mesh, layout)?;
        let t = distribute_tensor_with_order(&targets, mesh, &tp, ShardOrder::default_for(&tp))?;
        let s0 = mesh.stats();
        let loss = x.cross_entropy(&t, reduction)?;
        let s1 = mesh.stats();
        let rep = vec![Replicate; mesh.ndim()];
        let gathered = x.redistribute(&rep)?;
        let s2 = mesh.stats();
        drop(gathered);
        Ok(Seen {
            coord: mesh.coordinate().to_vec(),
            placements: loss.placements().to_vec(),
            loss: loss.full_tensor()?.to_f64_vec()[0],
            loss_counts: s1 - s0,
            gather_counts: s2 - s1,
        })
    })
    .unwrap()
}

#[track_caller]
fn assert_loss(what: &str, seen: &Seen, want: f64, tol: f64) {
    assert!(
        (seen.loss - want).abs() <= tol * want.abs().max(1.0),
        "{what} at {:?}: loss {} want {want}",
        seen.coord,
        seen.loss
    );
}

/// The bytes each rank sends for the loss: exactly two all_reduces over the tp
/// group, of `rows` and `2 · rows` f64 elements (the table in `mesh/src/stats.rs`:
/// `2 (n−1)/n · bytes`), O(rows) where gathering the logits is O(rows · V).
#[test]
fn loss_parallel_moves_rows_not_vocab() {
    let (b, t, vocab) = (4, 8, 1000);
    let rows = b * t;
    let logits = randn(&[b, t, vocab], 1);
    let tg = targets(&[b, t], vocab, 3);
    let want = oracle(&logits, &tg, Reduction::Mean);
    let default: fn(&[Placement]) -> ShardOrder = ShardOrder::default_for;
    for tp in [2, 3, 4] {
        let seen = run(&[tp], &logits, &tg, &[Shard(2)], default, &[Replicate], Reduction::Mean);
        for (rank, s) in seen.iter().enumerate() {
            assert_loss(&format!("tp={tp}"), s, want, 1e-12);
            assert_eq!(s.placements, [Replicate]);
            // This rank's exact share of each all-reduce (tessera_mesh::stats).
            let ar = |elems: usize| OpKind::all_reduce_sent(tp, rank, elems * 8);
            let expected = ar(rows) + ar(2 * rows);
            let c = &s.loss_counts;
            assert_eq!((c.total_calls(), c.calls(OpKind::AllReduce)), (2, 2), "tp={tp}: {c}");
            assert_eq!(c.total_bytes(), expected, "tp={tp}: {c}");
            let g = &s.gather_counts;
            assert_eq!(g.calls(OpKind::AllGather), 1, "tp={tp}: {g}");
            // Every rank's class shard here is ceil(V/tp) wide but the last.
            assert!(g.total_bytes() >= OpKind::AllGather.bytes_sent(tp, rows * vocab * 8) / 2);
            assert!(
                c.total_bytes() * 100 < g.total_bytes(),
                "tp={tp}: the loss moved {} bytes, gathering {}",
                c.total_bytes(),
                g.total_bytes()
            );
            if s.coord == [0] {
                println!(
                    "loss parallel [{b}, {t}, {vocab}] f64 on tp={tp}: {} B per rank ({c}); \
                     gathering the logits: {} B per rank ({g})",
                    c.total_bytes(),
                    g.total_bytes()
                );
            }
        }
    }
}

/// Uneven class splits, a rank with no classes, partial logits (reduced first),
/// batch shards on the other mesh dim, targets given sharded.
#[test]
fn loss_parallel_uneven_partial_and_two_mesh_dims() {
    let default: fn(&[Placement]) -> ShardOrder = ShardOrder::default_for;
    let reversed: fn(&[Placement]) -> ShardOrder = ShardOrder::reversed_for;
    // (mesh, logits placements, order, targets placements, loss placements, the
    // all_gathers of targets expected: None where the logits' reversed shard
    // order is first redistributed to the default one)
    type Case = (
        &'static [usize],
        &'static [Placement],
        fn(&[Placement]) -> ShardOrder,
        &'static [Placement],
        &'static [Placement],
        Option<u64>,
    );
    let cases: [Case; 7] = [
        (&[4], &[Shard(2)], default, &[Replicate], &[Replicate], Some(0)),
        (&[4], &[Shard(2)], default, &[Shard(1)], &[Replicate], Some(1)),
        (&[3], &[Shard(2)], default, &[Shard(0)], &[Replicate], Some(1)),
        (
            &[2, 2],
            &[SUM, Shard(2)],
            default,
            &[Replicate, Replicate],
            &[Replicate, Replicate],
            Some(0),
        ),
        (
            &[2, 2],
            &[Shard(1), Shard(2)],
            default,
            &[Replicate, Replicate],
            &[SUM, Replicate],
            Some(0),
        ),
        (
            &[2, 2],
            &[Shard(2), Shard(2)],
            default,
            &[Replicate, Replicate],
            &[Replicate, Replicate],
            Some(0),
        ),
        (
            &[2, 2],
            &[Shard(2), Shard(2)],
            reversed,
            &[Shard(0), Replicate],
            &[Replicate, Replicate],
            None,
        ),
    ];
    // V = 6 over 4: chunks 2, 2, 2, 0; V = 7 over 3: 3, 3, 1; V = 3 over 4: 1, 1, 1, 0.
    for vocab in [6, 7, 3] {
        let logits = randn(&[2, 3, vocab], 10 + vocab as u64);
        let tg = targets(&[2, 3], vocab, 1);
        for reduction in [Reduction::Mean, Reduction::Sum] {
            let want = oracle(&logits, &tg, reduction);
            for (mesh, lp, order, tp, out, gathers) in cases {
                let what = format!("V={vocab} {reduction:?} on {mesh:?} {lp:?} targets {tp:?}");
                for s in run(mesh, &logits, &tg, lp, order, tp, reduction) {
                    assert_loss(&what, &s, want, 1e-12);
                    assert_eq!(s.placements, out, "{what}");
                    if let Some(n) = gathers {
                        let c = &s.loss_counts;
                        assert_eq!(c.calls(OpKind::AllGather), n, "{what}: {c}");
                        // Max and sum once (over the whole mesh when it all shards
                        // the classes), plus the reduction of partial logits.
                        let partial = u64::from(lp.contains(&SUM));
                        assert_eq!(c.calls(OpKind::AllReduce), 2 + partial, "{what}: {c}");
                        assert_eq!(c.total_calls(), n + 2 + partial, "{what}: {c}");
                    }
                }
            }
        }
    }
}

#[test]
fn loss_parallel_rejects_targets_out_of_range() {
    let logits = randn(&[2, 5], 20);
    let bad = Tensor::from_vec(vec![1i64, 5], &[2]).unwrap();
    let errs = on_mesh(&[2], move |mesh| {
        let x = distribute_tensor_with_order(&logits, mesh, &[Shard(1)], ShardOrder::default_for(&[Shard(1)]))?;
        let t = distribute_tensor_with_order(&bad, mesh, &[Replicate], ShardOrder::default_for(&[Replicate]))?;
        Ok(x.cross_entropy(&t, Reduction::Mean).unwrap_err().to_string())
    })
    .unwrap();
    for e in errs {
        assert!(
            e.contains("cross_entropy") && e.contains("target 5 of row 1") && e.contains("0..5"),
            "{e}"
        );
    }
}
