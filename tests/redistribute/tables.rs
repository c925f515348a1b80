//! Plans for named cases, one line each, with steps and bytes computed by hand
//! (f64: 8 bytes an element; each rank's exact share as `tessera_mesh::stats`
//! counts it: `n−1` copies of its own piece gathered, the input less its own
//! piece scattered, `2 (b − its chunk)` all-reduced);
//! a plan's `Display`; the sharding fixture and the reversed-order round trip on
//! real launches.

use tessera::ReduceOp;
use tessera::dtensor::Placement::{self, Partial, Replicate as R, Shard as S};
use tessera::dtensor::redistribute::{StepKind, plan};
use tessera::dtensor::testing::expected_local;
use tessera::dtensor::{DType, Layout, ShardOrder, Tensor, distribute_tensor, distribute_tensor_with_order};
use tessera::mesh::OpKind;

use crate::harness::on_mesh;

use StepKind::{AllGather as Ag, AllReduce as Ar, AllToAll as A2a, Partition, ReduceScatter as Rs, Slice};

const SUM: Placement = Partial(ReduceOp::Sum);
const AVG: Placement = Partial(ReduceOp::Avg);
const MAX: Placement = Partial(ReduceOp::Max);
const SUM_OP: ReduceOp = ReduceOp::Sum;

fn default(p: &[Placement]) -> ShardOrder {
    ShardOrder::default_for(p)
}

fn reversed(p: &[Placement]) -> ShardOrder {
    ShardOrder::reversed_for(p)
}

fn f64_layout(mesh: &[usize], shape: &[usize], p: &[Placement], order: fn(&[Placement]) -> ShardOrder) -> Layout {
    Layout::with_order(mesh, p, order(p), shape, DType::F64).unwrap()
}

/// `name: mesh, shape: src (order) -> dst (order) @ coord => [(mesh dims, kind, bytes), ...];`
macro_rules! plans {
    ($($name:ident: $mesh:tt, $shape:tt: $src:tt, $so:ident -> $dst:tt, $do:ident @ $coord:tt
        => [$($step:expr),* $(,)?];)*) => {$(
        #[test]
        fn $name() {
            let src = f64_layout(&$mesh, &$shape, &$src, $so);
            let dst = f64_layout(&$mesh, &$shape, &$dst, $do);
            let p = plan(&src, &dst, &$coord).unwrap();
            let got: Vec<(Vec<usize>, StepKind, u64)> =
                p.steps.iter().map(|s| (s.mesh_dims.to_vec(), s.kind, s.bytes)).collect();
            let want: Vec<(Vec<usize>, StepKind, u64)> = vec![$($step),*];
            assert_eq!(got, want, "\n{p}");
            assert_eq!(p.dst(), &dst);
            assert_eq!(p.bytes(), want.iter().map(|s| s.2).sum::<u64>());
            assert_eq!(p.collectives(), want.iter().filter(|s| s.1.collective().is_some()).count());
        }
    )*};
}

plans! {
    // 1-D mesh of 4, [8, 6] f64 = 384 bytes.
    one_s_to_r: [4], [8, 6]: [S(0)], default -> [R], default @ [1] => [(vec![0], Ag, 288)];
    one_p_to_s: [4], [8, 6]: [SUM], default -> [S(0)], default @ [1] => [(vec![0], Rs { op: SUM_OP }, 288)];
    one_p_to_r: [4], [8, 6]: [SUM], default -> [R], default @ [1] => [(vec![0], Ar { op: SUM_OP }, 576)];
    one_avg_to_r: [4], [8, 6]: [AVG], default -> [R], default @ [2] => [(vec![0], Ar { op: ReduceOp::Avg }, 576)];
    // Columns split 2, 2, 2, 0: rank 3 keeps none of the 384 bytes and sends them all.
    one_max_to_s1: [4], [8, 6]: [MAX], default -> [S(1)], default @ [3] => [(vec![0], Rs { op: ReduceOp::Max }, 384)];
    // Rows 2..4 of 8 → columns 2..4 of 6: keeps a 2×2 block, sends 8 elements.
    one_s0_to_s1: [4], [8, 6]: [S(0)], default -> [S(1)], default @ [1] => [(vec![0], A2a, 64)];
    // Columns split 2, 2, 2, 0: the last rank keeps nothing and sends all 12 elements.
    one_s0_to_s1_empty: [4], [8, 6]: [S(0)], default -> [S(1)], default @ [3] => [(vec![0], A2a, 96)];
    one_r_to_s: [4], [8, 6]: [R], default -> [S(1)], default @ [1] => [(vec![0], Slice, 0)];
    one_r_to_p: [4], [8, 6]: [R], default -> [SUM], default @ [1] => [(vec![0], Partition { op: SUM_OP }, 0)];
    one_same: [4], [8, 6]: [S(0)], default -> [S(0)], default @ [1] => [];
    // Uneven: 13 over 4 is 4, 4, 4, 1; all_gather output 104 bytes → ⌊104·3/4⌋ = 78.
    // 13 rows split 4, 4, 4, 1: rank 3 sends its one row (8 bytes) to 3 peers;
    // rank 0 sends the 9 rows of 13 that are not its own.
    one_uneven_gather: [4], [13]: [S(0)], default -> [R], default @ [3] => [(vec![0], Ag, 24)];
    one_uneven_scatter: [4], [13]: [SUM], default -> [S(0)], default @ [0] => [(vec![0], Rs { op: SUM_OP }, 72)];
    // 7 rows split 3, 3, 1: rank 2's row of 2 (16 bytes) to 2 peers.
    one_mesh_of_3: [3], [7, 2]: [S(0)], default -> [R], default @ [2] => [(vec![0], Ag, 32)];

    // 2-D mesh 2×2, [4, 6] f64 = 192 bytes.
    // Different tensor dims: one all_gather over the whole mesh, (3/4)·192 (the
    // same bytes as two per-dim gathers, 48 + 96, in one collective).
    two_s0s1_to_rr: [2, 2], [4, 6]: [S(0), S(1)], default -> [R, R], default @ [0, 0]
        => [(vec![0, 1], Ag, 144)];
    // Partial on both mesh dims: one all_reduce over the whole mesh, 2·(3/4)·192.
    two_pp_to_rr: [2, 2], [4, 6]: [SUM, SUM], default -> [R, R], default @ [1, 0]
        => [(vec![0, 1], Ar { op: SUM_OP }, 288)];
    // One tensor dim split twice, in either order: one all_gather over the mesh.
    two_s0s0_to_rr: [2, 2], [4, 6]: [S(0), S(0)], default -> [R, R], default @ [0, 1]
        => [(vec![0, 1], Ag, 144)];
    two_s0s0_reversed_to_rr: [2, 2], [4, 6]: [S(0), S(0)], reversed -> [R, R], default @ [0, 1]
        => [(vec![0, 1], Ag, 144)];
    // Row 1 of 4 → column 1 of 4: keeps one element, sends 3.
    two_s0s0_to_s1s1: [2, 2], [4, 4]: [S(0), S(0)], default -> [S(1), S(1)], default @ [0, 1]
        => [(vec![0, 1], A2a, 24)];
    // Reordering the splits of one dim is one all_to_all over the mesh too: (0, 1) holds
    // rows 2..4 (block 1 of 4) and needs rows 4..6 (block 2): all 6 elements move.
    two_reorder: [2, 2], [8, 3]: [S(0), S(0)], default -> [S(0), S(0)], reversed @ [0, 1]
        => [(vec![0, 1], A2a, 48)];
    // (0, 1) holds rows 0..2 × columns 3..6 and needs rows 2..4 × columns 0..3: all 6 move.
    two_s0s1_to_s1s0: [2, 2], [4, 6]: [S(0), S(1)], default -> [S(1), S(0)], default @ [0, 1]
        => [(vec![0, 1], A2a, 48)];
    two_s0s1_to_s1s0_keeps: [2, 2], [4, 6]: [S(0), S(1)], default -> [S(1), S(0)], default @ [0, 0]
        => [(vec![0, 1], A2a, 0)];
    two_rr_to_s0s1: [2, 2], [4, 6]: [R, R], default -> [S(0), S(1)], default @ [1, 1]
        => [(vec![0], Slice, 0), (vec![1], Slice, 0)];
    // Slice first, then all_reduce the half left: 96 bytes, 2·(1/2)·96.
    two_pr_to_rs: [2, 2], [4, 6]: [SUM, R], default -> [R, S(0)], default @ [0, 1]
        => [(vec![1], Slice, 0), (vec![0], Ar { op: SUM_OP }, 96)];
    two_pp_to_s0s1: [2, 2], [4, 6]: [SUM, AVG], default -> [S(0), S(1)], default @ [1, 0]
        => [(vec![0], Rs { op: SUM_OP }, 96), (vec![1], Rs { op: ReduceOp::Avg }, 48)];
    two_s_to_ss: [2, 2], [4, 6]: [S(0), R], default -> [S(0), S(0)], default @ [1, 1]
        => [(vec![1], Slice, 0)];
    two_one_dim_a2a: [2, 2], [4, 6]: [S(0), R], default -> [S(1), R], default @ [1, 0]
        => [(vec![0], A2a, 48)];

    // 3-D mesh 2×2×2, [8, 2] f64 = 128 bytes.
    // (7/8)·128 in one all_gather, as 16 + 32 + 64 in three.
    three_sss_to_rrr: [2, 2, 2], [8, 2]: [S(0), S(0), S(0)], default -> [R, R, R], default @ [0, 0, 0]
        => [(vec![0, 1, 2], Ag, 112)];
    // Mesh dims 0 and 1 flattened: (3/4)·128.
    three_ss_reversed_to_rrr: [2, 2, 2], [8, 2]: [S(0), S(0), R], reversed -> [R, R, R], default @ [0, 1, 0]
        => [(vec![0, 1], Ag, 96)];
    three_rps_to_srs: [2, 2, 2], [8, 2]: [R, SUM, S(1)], default -> [S(0), R, S(1)], default @ [1, 0, 1]
        => [(vec![0], Slice, 0), (vec![1], Ar { op: SUM_OP }, 32)];
    three_ppp_to_rrs: [2, 2, 2], [8, 2]: [SUM, SUM, SUM], default -> [R, R, S(0)], default @ [0, 0, 0]
        => [(vec![2], Rs { op: SUM_OP }, 64), (vec![0, 1], Ar { op: SUM_OP }, 96)];
    // (0, 0, 1) holds rows 0..2 × column 1 and needs rows 2..4 × column 0: 2 elements move.
    three_all_shard: [2, 2, 2], [8, 2]: [S(0), S(0), S(1)], default -> [S(1), S(0), S(0)], default @ [0, 0, 1]
        => [(vec![0, 1, 2], A2a, 16)];
    three_all_shard_keeps: [2, 2, 2], [8, 2]: [S(0), S(0), S(1)], default -> [S(1), S(0), S(0)], default @ [0, 0, 0]
        => [(vec![0, 1, 2], A2a, 0)];
}

/// Summed over every rank, a plan's bytes are what the group moves in total
/// ((n−1)·b gathered or scattered, 2(n−1)·b all-reduced): the planner's
/// objective, exactly, however unevenly the tensor splits.
#[test]
fn per_rank_bytes_add_up_to_the_group_total() {
    for (mesh, shape) in [
        (vec![4], vec![13]),
        (vec![3], vec![7, 2]),
        (vec![4], vec![8, 6]),
        (vec![2, 3], vec![5, 7]),
    ] {
        let b = shape.iter().product::<usize>() as u64 * 8;
        let n = mesh.iter().product::<usize>() as u64;
        let coords: Vec<Vec<usize>> = (0..n as usize)
            .map(|i| {
                let mut c = vec![0; mesh.len()];
                let mut r = i;
                for d in (0..mesh.len()).rev() {
                    c[d] = r % mesh[d];
                    r /= mesh[d];
                }
                c
            })
            .collect();
        let whole = |p: Placement| vec![p; mesh.len()];
        let total = |src: &[Placement], dst: &[Placement]| -> u64 {
            let (src, dst) = (
                f64_layout(&mesh, &shape, src, default),
                f64_layout(&mesh, &shape, dst, default),
            );
            coords.iter().map(|c| plan(&src, &dst, c).unwrap().bytes()).sum()
        };
        let what = format!("mesh {mesh:?}, shape {shape:?}");
        assert_eq!(total(&whole(S(0)), &whole(R)), (n - 1) * b, "gather, {what}");
        assert_eq!(total(&whole(SUM), &whole(S(0))), (n - 1) * b, "scatter, {what}");
        assert_eq!(total(&whole(SUM), &whole(R)), 2 * (n - 1) * b, "all-reduce, {what}");
    }
}

#[test]
fn plan_display() {
    let src = f64_layout(&[2, 2], &[4, 6], &[SUM, R], default);
    let dst = f64_layout(&[2, 2], &[4, 6], &[R, S(0)], default);
    let p = plan(&src, &dst, &[0, 1]).unwrap();
    assert_eq!(
        p.to_string(),
        "(Partial(sum), Replicate) -> (Replicate, Shard(0)) (1 collectives, 96 bytes/rank):\n  \
         1. local slice on mesh dim 1: (Partial(sum), Replicate) -> (Partial(sum), Shard(0)), 0 bytes\n  \
         2. all_reduce on mesh dim 0: (Partial(sum), Shard(0)) -> (Replicate, Shard(0)), 96 bytes"
    );
    let same = plan(&src, &src, &[0, 1]).unwrap();
    assert_eq!(
        same.to_string(),
        "(Partial(sum), Replicate) -> (Partial(sum), Replicate): nothing to do"
    );
    let a = f64_layout(&[2, 2], &[4, 4], &[S(0), S(0)], default);
    let b = f64_layout(&[2, 2], &[4, 4], &[S(1), S(1)], default);
    assert_eq!(
        plan(&a, &b, &[0, 1]).unwrap().to_string(),
        "(Shard(0), Shard(0)) -> (Shard(1), Shard(1)) (1 collectives, 24 bytes/rank):\n  \
         1. all_to_all on whole mesh: (Shard(0), Shard(0)) -> (Shard(1), Shard(1)), 24 bytes"
    );
}

/// The sharding fixture (PyTorch's `compute_local_shape_and_global_offset` docs): global
/// [2, 5] on a 2×2 mesh with [S(1), S(1)], checked through `DTensor` on 4 ranks.
#[test]
fn sharding_fixture_through_dtensor() {
    let outs = on_mesh(&[2, 2], |mesh| {
        let full = Tensor::arange(10, DType::F64)?.reshape(&[2, 5])?;
        let x = distribute_tensor(&full, mesh, &[S(1), S(1)])?;
        let region = x.layout().local_region(mesh.coordinate())?;
        Ok((x.to_local().clone(), region, x.full_tensor()? == full))
    })
    .unwrap();
    let want: [(&[usize], &[usize], &[f64]); 4] = [
        (&[2, 2], &[0, 0], &[0.0, 1.0, 5.0, 6.0]),
        (&[2, 1], &[0, 2], &[2.0, 7.0]),
        (&[2, 1], &[0, 3], &[3.0, 8.0]),
        (&[2, 1], &[0, 4], &[4.0, 9.0]),
    ];
    for (rank, ((local, (offset, shape), round_trip), (w_shape, w_offset, w_values))) in
        outs.iter().zip(want).enumerate()
    {
        assert_eq!(local.shape(), w_shape, "rank {rank}");
        assert_eq!(shape, w_shape, "rank {rank}");
        assert_eq!(offset, w_offset, "rank {rank}");
        assert_eq!(local.to_f64_vec(), w_values, "rank {rank}");
        assert!(round_trip, "rank {rank}");
    }
}

/// `[S(0), S(0)]` in the reversed order (FSDP over TP) → `[R, R]` → back to the reversed
/// order restores every local; → the default order gives the default layout's slices.
#[test]
fn reversed_order_round_trip() {
    let p = [S(0), S(0)];
    let outs = on_mesh(&[2, 2], move |mesh| {
        let full = Tensor::arange(21, DType::F64)?.reshape(&[7, 3])?;
        let x = distribute_tensor_with_order(&full, mesh, &p, reversed(&p))?;
        let r = x.redistribute(&[R, R])?;
        let back = r.redistribute_with_order(&p, reversed(&p))?;
        let dflt = r.redistribute(&p)?;
        let direct = x.redistribute(&p)?;
        let direct_plan = x.redistribute_plan(&p)?;
        let locals = [x, r, back, dflt, direct].map(|t| t.to_local().clone());
        Ok((mesh.coordinate().to_vec(), locals, direct_plan))
    })
    .unwrap();
    let full = Tensor::arange(21, DType::F64).unwrap().reshape(&[7, 3]).unwrap();
    let rev = f64_layout(&[2, 2], &[7, 3], &p, reversed);
    let dflt = f64_layout(&[2, 2], &[7, 3], &p, default);
    for (coord, [x, r, back, d, direct], direct_plan) in &outs {
        assert_eq!(x, &expected_local(&full, &rev, coord).unwrap(), "{coord:?}");
        assert_eq!(r, &full, "{coord:?}");
        assert_eq!(back, x, "{coord:?}");
        assert_eq!(d, &expected_local(&full, &dflt, coord).unwrap(), "{coord:?}");
        assert_eq!(direct, d, "{coord:?}");
        // Reversed → default directly: one all_to_all over the whole mesh.
        assert_eq!(direct_plan.collectives(), 1, "{direct_plan}");
        assert_eq!(direct_plan.steps[0].kind.collective(), Some(OpKind::AllToAll));
    }
    // 7 rows: the reversed order gives (0, 1) rows 4..6 (mesh dim 1 splits 4 + 3 first),
    // the default order rows 2..4 (mesh dim 0 splits 4 + 3 first).
    let (x01, d01) = (&outs[1].1[0], &outs[1].1[3]);
    assert_eq!(x01.to_f64_vec(), vec![12.0, 13.0, 14.0, 15.0, 16.0, 17.0]);
    assert_eq!(d01.to_f64_vec(), vec![6.0, 7.0, 8.0, 9.0, 10.0, 11.0]);
}

/// A gather or all-to-all of strided boxes (pieces of `Shard(1)`) moves every
/// element once, from where its sender holds it to where its receiver wants it:
/// the step asks for one large buffer (its output), not a packed send buffer
/// and a receive buffer beside it. The pool's requests of 256 KiB or more
/// count them; the values are checked against the full tensor.
#[test]
fn strided_steps_allocate_only_their_output() {
    use tessera::mesh::pool;
    const N: usize = 512; // [512, 512] f32: 512 KiB per rank on 2 ranks
    for (src, dst) in [([S(0)], [S(1)]), ([S(1)], [R])] {
        let requests = on_mesh(&[2], move |mesh| {
            let full = Tensor::from_vec((0..N * N).map(|i| i as f32).collect::<Vec<f32>>(), &[N, N])?;
            let x = distribute_tensor(&full, mesh, &src)?;
            let _ = x.redistribute(&dst)?; // warm: plan memo, communicators
            let before = pool::stats();
            let y = x.redistribute(&dst)?;
            let after = pool::stats();
            assert!(*y.to_local() == expected_local(&full, y.layout(), mesh.coordinate())?);
            Ok((after.hits + after.misses) - (before.hits + before.misses))
        })
        .unwrap();
        assert_eq!(
            requests,
            vec![1, 1],
            "{src:?} -> {dst:?}: large buffers asked for per rank"
        );
    }
}
