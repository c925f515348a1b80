//! Exact collective counts (`mesh.stats()` deltas around the op) of the strategies
//! that must run without communication, on a 1-D mesh of 4 and on 2×2; and the
//! values they give.

use tessera::dtensor::Placement::{self, Partial, Replicate as R, Shard as S};
use tessera::dtensor::testing::partial_local;
use tessera::dtensor::{DTensor, DType, Layout, ReduceOp, Result, Tensor};
use tessera::mesh::{CommCounts, OpKind};
use tessera::tensor::ops::Reduction;

use crate::harness::on_mesh;

const P: Placement = Partial(ReduceOp::Sum);

/// What one rank saw.
struct Counted {
    coord: Vec<usize>,
    /// Counters around the op.
    op: CommCounts,
    /// The output's placements.
    placements: Vec<Placement>,
    /// Counters around `full_tensor()` of the output.
    gather: CommCounts,
    /// The output's `full_tensor()`.
    full: Tensor,
}

/// Builds each input from its full tensor and placements (partial ones split into
/// random integer pieces, no communication), runs `f` between two stats snapshots,
/// then `full_tensor()` between two more.
fn counted(
    mesh_shape: &[usize],
    inputs: &[(&Tensor, &[Placement])],
    f: impl Fn(&[DTensor]) -> Result<DTensor> + Send + Sync + 'static,
) -> Vec<Counted> {
    let inputs: Vec<(Tensor, Vec<Placement>)> = inputs.iter().map(|&(t, p)| (t.clone(), p.to_vec())).collect();
    on_mesh(mesh_shape, move |mesh| {
        let mut xs = Vec::new();
        for (full, p) in &inputs {
            let layout = Layout::new(mesh.shape(), p, full.shape(), full.dtype())?;
            let local = partial_local(full, &layout, mesh.coordinate(), 11)?;
            xs.push(DTensor::from_local_with_layout(local, mesh, layout)?);
        }
        let s0 = mesh.stats();
        let y = f(&xs)?;
        let s1 = mesh.stats();
        let full = y.full_tensor()?;
        let s2 = mesh.stats();
        Ok(Counted {
            coord: mesh.coordinate().to_vec(),
            op: s1 - s0,
            placements: y.placements().to_vec(),
            gather: s2 - s1,
            full,
        })
    })
    .unwrap()
}

/// Every kind's count in `got` is the one `want` names (0 for the others).
fn assert_calls(got: &CommCounts, want: &[(OpKind, u64)], what: &str) {
    for k in OpKind::ALL {
        let n = want.iter().find(|(w, _)| *w == k).map_or(0, |&(_, n)| n);
        assert_eq!(got.calls(k), n, "{what}: {k} calls ({got})");
    }
}

/// Runs the op on `mesh_shape` and checks, on every rank: exactly `calls`
/// collectives in the op, output `placements`, and `full_tensor()` close to `want`.
#[track_caller]
fn expect(
    what: &str,
    mesh_shape: &[usize],
    inputs: &[(&Tensor, &[Placement])],
    calls: &[(OpKind, u64)],
    placements: &[Placement],
    want: &Tensor,
    f: impl Fn(&[DTensor]) -> Result<DTensor> + Send + Sync + 'static,
) -> Vec<Counted> {
    let outs = counted(mesh_shape, inputs, f);
    for c in &outs {
        let what = format!("{what} on {mesh_shape:?} at {:?}", c.coord);
        assert_calls(&c.op, calls, &what);
        assert_eq!(c.placements, placements, "{what}");
        assert!(
            c.full.allclose(want, 1e-12, 1e-12),
            "{what}: {:?} want {:?}",
            c.full,
            want
        );
    }
    outs
}

fn randn(shape: &[usize], seed: u64) -> Tensor {
    Tensor::randn(shape, DType::F64, seed).unwrap()
}

fn indices(shape: &[usize], bound: i64) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<i64> = (0..n as i64).map(|k| (k * 5 + 3) % bound).collect();
    Tensor::from_vec(v, shape).unwrap()
}

const NONE: &[(OpKind, u64)] = &[];

#[test]
fn matmul_shard0_replicate_is_local() {
    let (x, w) = (randn(&[7, 6], 1), randn(&[6, 5], 2));
    let want = x.matmul(&w).unwrap();
    let mm = |t: &[DTensor]| t[0].matmul(&t[1]);
    expect("S(0)×R", &[4], &[(&x, &[S(0)]), (&w, &[R])], NONE, &[S(0)], &want, mm);
    let (a, b): (&[_], &[_]) = (&[S(0), S(0)], &[R, R]);
    expect("S(0)×R", &[2, 2], &[(&x, a), (&w, b)], NONE, &[S(0), S(0)], &want, mm);
    let (a, b): (&[_], &[_]) = (&[S(0), R], &[R, R]);
    expect("S(0)×R", &[2, 2], &[(&x, a), (&w, b)], NONE, &[S(0), R], &want, mm);
}

#[test]
fn matmul_shard1_shard0_is_partial_sum() {
    let (x, w) = (randn(&[5, 7], 3), randn(&[7, 3], 4));
    let want = x.matmul(&w).unwrap();
    let mm = |t: &[DTensor]| t[0].matmul(&t[1]);
    expect(
        "S(1)×S(0)",
        &[4],
        &[(&x, &[S(1)]), (&w, &[S(0)])],
        NONE,
        &[P],
        &want,
        mm,
    );
    let (a, b): (&[_], &[_]) = (&[S(1), S(1)], &[S(0), S(0)]);
    expect("S(1)×S(0)", &[2, 2], &[(&x, a), (&w, b)], NONE, &[P, P], &want, mm);
    let (a, b): (&[_], &[_]) = (&[S(0), S(1)], &[R, S(0)]);
    expect(
        "[S(0),S(1)]×[R,S(0)]",
        &[2, 2],
        &[(&x, a), (&w, b)],
        NONE,
        &[S(0), P],
        &want,
        mm,
    );
}

#[test]
fn matmul_replicate_shard1_is_local() {
    let (x, w) = (randn(&[5, 6], 5), randn(&[6, 7], 6));
    let want = x.matmul(&w).unwrap();
    let mm = |t: &[DTensor]| t[0].matmul(&t[1]);
    expect("R×S(1)", &[4], &[(&x, &[R]), (&w, &[S(1)])], NONE, &[S(1)], &want, mm);
    let (a, b): (&[_], &[_]) = (&[R, R], &[S(1), S(1)]);
    expect("R×S(1)", &[2, 2], &[(&x, a), (&w, b)], NONE, &[S(1), S(1)], &want, mm);
    let (a, b): (&[_], &[_]) = (&[S(0), R], &[R, S(1)]);
    expect(
        "[S(0),R]×[R,S(1)]",
        &[2, 2],
        &[(&x, a), (&w, b)],
        NONE,
        &[S(0), S(1)],
        &want,
        mm,
    );
}

#[test]
fn layer_norm_on_batch_shards_is_local() {
    let (x, w, b) = (randn(&[5, 3, 6], 7), randn(&[6], 8), randn(&[6], 9));
    let want = x.layer_norm(Some(&w), Some(&b), 1e-5).unwrap();
    let ln = |t: &[DTensor]| t[0].layer_norm(Some(&t[1]), Some(&t[2]), 1e-5);
    let ins: [(&Tensor, &[Placement]); 3] = [(&x, &[S(0)]), (&w, &[R]), (&b, &[R])];
    expect("layer_norm S(0)", &[4], &ins, NONE, &[S(0)], &want, ln);
    let ins: [(&Tensor, &[Placement]); 3] = [(&x, &[S(0), S(1)]), (&w, &[R, R]), (&b, &[R, R])];
    expect("layer_norm [S(0),S(1)]", &[2, 2], &ins, NONE, &[S(0), S(1)], &want, ln);
}

#[test]
fn softmax_last_dim_on_batch_shards_is_local() {
    let x = randn(&[5, 3, 6], 10);
    let want = x.softmax(2).unwrap();
    let sm = |t: &[DTensor]| t[0].softmax(2);
    expect("softmax S(0)", &[4], &[(&x, &[S(0)])], NONE, &[S(0)], &want, sm);
    expect(
        "softmax [S(0),S(1)]",
        &[2, 2],
        &[(&x, &[S(0), S(1)])],
        NONE,
        &[S(0), S(1)],
        &want,
        sm,
    );
}

#[test]
fn cross_entropy_on_batch_shards_is_one_all_reduce() {
    let (logits, targets) = (randn(&[10, 5], 11), indices(&[10], 5));
    let ar1: &[(OpKind, u64)] = &[(OpKind::AllReduce, 1)];
    for reduction in [Reduction::Mean, Reduction::Sum] {
        let want = logits.cross_entropy(&targets, reduction).unwrap();
        let ce = move |t: &[DTensor]| t[0].cross_entropy(&t[1], reduction);
        let what = format!("cross_entropy({reduction:?})");
        let cases: [(&[usize], &[Placement], &[Placement]); 2] =
            [(&[4], &[S(0)], &[P]), (&[2, 2], &[S(0), R], &[P, R])];
        for (mesh, p, out) in cases {
            let outs = expect(&what, mesh, &[(&logits, p), (&targets, p)], NONE, out, &want, ce);
            for c in &outs {
                assert_calls(
                    &c.gather,
                    ar1,
                    &format!("{what} full_tensor on {mesh:?} at {:?}", c.coord),
                );
                assert_eq!(c.full.shape(), &[] as &[usize]);
            }
        }
    }
    // [B, T, C] sharded on batch and time: a partial sum on both mesh dims, which
    // full_tensor reduces with one all_reduce over the whole mesh.
    let (logits, targets) = (randn(&[3, 5, 4], 12), indices(&[3, 5], 4));
    let flat = logits.reshape(&[15, 4]).unwrap();
    let want = flat
        .cross_entropy(&targets.reshape(&[15]).unwrap(), Reduction::Mean)
        .unwrap();
    let ce = |t: &[DTensor]| t[0].cross_entropy(&t[1], Reduction::Mean);
    let p: &[Placement] = &[S(0), S(1)];
    let outs = expect(
        "cross_entropy [B,T,C]",
        &[2, 2],
        &[(&logits, p), (&targets, p)],
        NONE,
        &[P, P],
        &want,
        ce,
    );
    for c in &outs {
        assert_calls(
            &c.gather,
            &[(OpKind::AllReduce, 1)],
            "cross_entropy [B,T,C] full_tensor",
        );
    }
}

#[test]
fn embedding_with_batch_sharded_indices_is_local() {
    let (table, idx) = (randn(&[7, 4], 13), indices(&[6, 3], 7));
    let want = table.embedding(&idx).unwrap();
    let emb = |t: &[DTensor]| t[0].embedding(&t[1]);
    expect(
        "embedding R, S(0)",
        &[4],
        &[(&table, &[R]), (&idx, &[S(0)])],
        NONE,
        &[S(0)],
        &want,
        emb,
    );
    let (a, b): (&[_], &[_]) = (&[R, R], &[S(0), S(1)]);
    expect(
        "embedding R, [S(0),S(1)]",
        &[2, 2],
        &[(&table, a), (&idx, b)],
        NONE,
        &[S(0), S(1)],
        &want,
        emb,
    );
}

#[test]
fn embedding_with_row_sharded_table_is_partial_sum() {
    let (table, idx) = (randn(&[7, 4], 14), indices(&[2, 3], 7));
    let want = table.embedding(&idx).unwrap();
    let emb = |t: &[DTensor]| t[0].embedding(&t[1]);
    expect(
        "embedding S(0), R",
        &[4],
        &[(&table, &[S(0)]), (&idx, &[R])],
        NONE,
        &[P],
        &want,
        emb,
    );
    let (a, b): (&[_], &[_]) = (&[S(0), S(0)], &[R, R]);
    expect(
        "embedding [S(0),S(0)], R",
        &[2, 2],
        &[(&table, a), (&idx, b)],
        NONE,
        &[P, P],
        &want,
        emb,
    );
    let (a, b): (&[_], &[_]) = (&[S(0), R], &[R, S(0)]);
    expect(
        "embedding [S(0),R], [R,S(0)]",
        &[2, 2],
        &[(&table, a), (&idx, b)],
        NONE,
        &[P, S(0)],
        &want,
        emb,
    );
}

#[test]
fn add_of_partial_sums_is_local() {
    let (x, y) = (randn(&[5, 3], 15), randn(&[5, 3], 16));
    let want = x.add(&y).unwrap();
    let add = |t: &[DTensor]| t[0].add(&t[1]);
    expect("P + P", &[4], &[(&x, &[P]), (&y, &[P])], NONE, &[P], &want, add);
    let p: &[Placement] = &[P, S(0)];
    expect(
        "[P,S(0)] + [P,S(0)]",
        &[2, 2],
        &[(&x, p), (&y, p)],
        NONE,
        &[P, S(0)],
        &want,
        add,
    );
    expect(
        "[P,P] + [P,P]",
        &[2, 2],
        &[(&x, &[P, P]), (&y, &[P, P])],
        NONE,
        &[P, P],
        &want,
        add,
    );
}

/// Adding a constant to a partial sum must reduce first. A rank-0 value (a loss)
/// can only be all_reduced: exactly one all_reduce per partial mesh dim.
#[test]
fn add_scalar_on_partial_scalar_is_one_all_reduce() {
    let x = randn(&[], 17);
    let want = x.add_scalar(1.5).unwrap();
    let ar = |n| [(OpKind::AllReduce, n)];
    let f = |t: &[DTensor]| t[0].add_scalar(1.5);
    expect("add_scalar P", &[4], &[(&x, &[P])], &ar(1), &[R], &want, f);
    expect("add_scalar [P,R]", &[2, 2], &[(&x, &[P, R])], &ar(1), &[R, R], &want, f);
    expect("add_scalar [R,P]", &[2, 2], &[(&x, &[R, P])], &ar(1), &[R, R], &want, f);
    // Partial on both mesh dims: one all_reduce over the whole mesh.
    expect("add_scalar [P,P]", &[2, 2], &[(&x, &[P, P])], &ar(1), &[R, R], &want, f);
}

/// A partial tensor of rank ≥ 1 is reduced by exactly one collective: a
/// reduce_scatter (over the flattened group when several mesh dims are partial),
/// the least-bytes candidate dispatch picks (half the bytes of an all_reduce), so
/// the output is sharded.
#[test]
fn add_scalar_on_partial_tensor_is_one_reduce_scatter() {
    let x = randn(&[5, 3], 18);
    let want = x.add_scalar(1.5).unwrap();
    let rs = |n| [(OpKind::ReduceScatter, n)];
    let f = |t: &[DTensor]| t[0].add_scalar(1.5);
    expect("add_scalar P", &[4], &[(&x, &[P])], &rs(1), &[S(0)], &want, f);
    expect(
        "add_scalar [P,S(0)]",
        &[2, 2],
        &[(&x, &[P, S(0)])],
        &rs(1),
        &[S(1), S(0)],
        &want,
        f,
    );
    expect(
        "add_scalar [S(1),P]",
        &[2, 2],
        &[(&x, &[S(1), P])],
        &rs(1),
        &[S(1), S(0)],
        &want,
        f,
    );
    expect(
        "add_scalar [P,P]",
        &[2, 2],
        &[(&x, &[P, P])],
        &rs(1),
        &[S(0), S(0)],
        &want,
        f,
    );
}

#[test]
fn reduction_over_a_sharded_dim_is_partial() {
    let x = randn(&[7, 5], 18);
    let sum = x.sum(&[0], false).unwrap();
    let f = |t: &[DTensor]| t[0].sum(&[0], false);
    expect("sum S(0)", &[4], &[(&x, &[S(0)])], NONE, &[P], &sum, f);
    expect(
        "sum [S(0),S(1)]",
        &[2, 2],
        &[(&x, &[S(0), S(1)])],
        NONE,
        &[P, S(0)],
        &sum,
        f,
    );
    let f = |t: &[DTensor]| t[0].sum(&[0, 1], true);
    let all = x.sum(&[0, 1], true).unwrap();
    expect(
        "sum all [S(0),S(1)]",
        &[2, 2],
        &[(&x, &[S(0), S(1)])],
        NONE,
        &[P, P],
        &all,
        f,
    );
    let mean = x.mean(&[1], false).unwrap();
    let f = |t: &[DTensor]| t[0].mean(&[1], false);
    expect("mean S(1)", &[4], &[(&x, &[S(1)])], NONE, &[P], &mean, f);
    let max = x.max(&[0], true).unwrap();
    let f = |t: &[DTensor]| t[0].max(&[0], true);
    expect(
        "max S(0)",
        &[4],
        &[(&x, &[S(0)])],
        NONE,
        &[Partial(ReduceOp::Max)],
        &max,
        f,
    );
}

/// Merging a batch dim sharded evenly with the dims after it (`[B, T, D]` →
/// `[B·T, D]`), and splitting it back, keeps the shards where they are: each
/// rank's rows are whole rows of the merged dim.
#[test]
fn reshape_merging_an_evenly_sharded_batch_dim_is_local() {
    let x = randn(&[4, 3, 2], 21);
    let merged = x.reshape(&[12, 2]).unwrap();
    let merge = |t: &[DTensor]| t[0].reshape(&[12, 2]);
    expect(
        "reshape [4,3,2]->[12,2]",
        &[4],
        &[(&x, &[S(0)])],
        NONE,
        &[S(0)],
        &merged,
        merge,
    );
    expect(
        "reshape [4,3,2]->[12,2]",
        &[2, 2],
        &[(&x, &[S(0), S(0)])],
        NONE,
        &[S(0), S(0)],
        &merged,
        merge,
    );
    expect(
        "reshape [4,3,2]->[12,2]",
        &[2, 2],
        &[(&x, &[S(0), P])],
        NONE,
        &[S(0), P],
        &merged,
        merge,
    );
    let split = |t: &[DTensor]| t[0].reshape(&[4, 3, 2]);
    expect(
        "reshape [12,2]->[4,3,2]",
        &[4],
        &[(&merged, &[S(0)])],
        NONE,
        &[S(0)],
        &x,
        split,
    );
    // 3 rows over 2 ranks: rank 0's 2 rows would be 6 of the 9 merged rows, not
    // torch.chunk's 5, so the op moves data first (the values stay right).
    let odd = randn(&[3, 3, 2], 22);
    let outs = counted(&[2], &[(&odd, &[S(0)])], |t| t[0].reshape(&[9, 2]));
    for c in &outs {
        let moved: u64 = OpKind::ALL.iter().map(|&k| c.op.calls(k)).sum();
        assert!(moved > 0, "an uneven merge redistributes ({})", c.op);
        assert!(c.full.allclose(&odd.reshape(&[9, 2]).unwrap(), 0.0, 0.0));
    }
}

/// A pending sum plus a replicated bias stays pending: dispatch partitions the bias
/// (no communication) instead of all-reducing the sum, so the reduction waits for
/// the output's next layout. Into a row shard that is one reduce_scatter, half the
/// bytes of the all_reduce the add would otherwise have run.
#[test]
fn partial_plus_replicated_bias_defers_the_reduction() {
    let (x, w, b) = (randn(&[8, 6], 21), randn(&[6, 4], 22), randn(&[4], 23));
    let want = x.matmul(&w).unwrap().add(&b).unwrap();
    let f = |t: &[DTensor]| t[0].matmul(&t[1])?.add(&t[2]);
    let ins = [(&x, &[S(1)][..]), (&w, &[S(0)][..]), (&b, &[R][..])];
    expect("S(1)×S(0) + R", &[4], &ins, NONE, &[P], &want, f);
    let ins2 = [(&x, &[S(1), R][..]), (&w, &[S(0), R][..]), (&b, &[R, R][..])];
    expect("[S(1),R]×[S(0),R] + R", &[2, 2], &ins2, NONE, &[P, R], &want, f);
    // Then to rows: one reduce_scatter of the 8×4 f64 output, (3/4)·256 bytes,
    // where reducing at the add would have all-reduced 2·(3/4)·256.
    let to_rows = |t: &[DTensor]| t[0].matmul(&t[1])?.add(&t[2])?.redistribute(&[S(0)]);
    for c in expect(
        "… then S(0)",
        &[4],
        &ins,
        &[(OpKind::ReduceScatter, 1)],
        &[S(0)],
        &want,
        to_rows,
    ) {
        assert_eq!(c.op.bytes(OpKind::ReduceScatter), 192, "coord {:?}: {}", c.coord, c.op);
        assert_eq!(c.op.total_bytes(), 192, "coord {:?}: {}", c.coord, c.op);
    }
}

/// `zeros_like` keeps its input's layout (a partial input's zeros are a partial
/// zero) and communicates nothing.
#[test]
fn zeros_like_keeps_the_layout_without_communication() {
    let x = randn(&[5, 6], 31);
    let zeros = Tensor::zeros(&[5, 6], DType::F64).unwrap();
    for p in [&[S(0), R][..], &[P, S(1)], &[R, P]] {
        expect("zeros_like", &[2, 2], &[(&x, p)], NONE, p, &zeros, |x| {
            x[0].zeros_like()
        });
    }
}

/// `replicated_op`, the fallback an op without a sharding rule takes: the
/// kernel runs on the full inputs (gathered from shards, a partial input
/// reduced) and the output is replicated.
#[test]
fn replicated_op_runs_the_kernel_on_full_inputs() {
    let (x, y) = (randn(&[4, 6], 32), randn(&[4, 6], 33));
    // A kernel the strategies know nothing of: x·yᵀ row sums, kept [4, 1].
    let kernel = |l: &[Tensor]| -> Result<Tensor> { Ok(l[0].mul(&l[1])?.sum(&[1], true)?) };
    let want = kernel(&[x.clone(), y.clone()]).unwrap();
    let outs = expect(
        "replicated_op",
        &[2, 2],
        &[(&x, &[S(0), S(1)]), (&y, &[P, R])],
        // x's four blocks in one all-gather over both dims, y's partial sum
        // in one all-reduce over dim 0.
        &[(OpKind::AllGather, 1), (OpKind::AllReduce, 1)],
        &[R, R],
        &want,
        move |x| DTensor::replicated_op("row_dots", &[&x[0], &x[1]], &[4, 1], DType::F64, kernel),
    );
    assert_eq!(outs.len(), 4);
}
