//! The flat-bucket collectives (`tessera::dtensor::bucket`) against `redistribute`
//! as the oracle: random meshes (up to 3-D, 8 ranks), several tensors of uneven
//! shapes per bucket, the other mesh dims sharded, replicated or (for the
//! reductions) partial in any order. Each bucket issues exactly one collective
//! over its mesh dim (none on a one-rank dim).

use proptest::prelude::*;
use tessera::dtensor::bucket::{all_gather_bucket, all_reduce_bucket, reduce_scatter_bucket};
use tessera::dtensor::testing::{
    global_shape, mesh_shape, order_from_keys, partial_local, placements, test_values, with_tensor_path,
};
use tessera::dtensor::{DTensor, DType, Layout, Placement, ReduceOp, ShardOrder, Tensor, distribute_tensor_with_order};

use crate::harness::{close, config, on_mesh};

/// One tensor of a bucket: its global shape and its layout before the step.
#[derive(Clone, Debug)]
struct Member {
    layout: Layout,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Step {
    Gather,
    Scatter,
    AllReduce,
}

/// `placements` with `mesh_dim` set for `step`, and an order where (for a gather)
/// `mesh_dim` is the last split of dim 0.
fn member_layout(
    mesh: &[usize],
    mut p: Vec<Placement>,
    keys: &[u8],
    shape: &[usize],
    mesh_dim: usize,
    step: Step,
    dtype: DType,
) -> Layout {
    p[mesh_dim] = match step {
        Step::Gather => Placement::Shard(0),
        Step::Scatter | Step::AllReduce => Placement::Partial(ReduceOp::Sum),
    };
    let order = order_from_keys(&p, keys).expect("one key per mesh dim");
    let order = if step == Step::Gather {
        let mut chain = order.order_of(&p, 0);
        chain.retain(|m| *m != mesh_dim);
        chain.push(mesh_dim);
        order
            .with_chain(&p, 0, &chain)
            .expect("a permutation of dim 0's mesh dims")
    } else {
        order
    };
    Layout::with_order(mesh, &p, order, shape, dtype).expect("valid layout")
}

/// A bucket: mesh, mesh dim, step and 1–4 members (rank 1–3 tensors, dims 1..=13
/// on dim 0, 0..=13 elsewhere; other mesh dims Shard/Replicate, or Partial(sum) for
/// the reductions).
fn bucket(step: Step) -> impl Strategy<Value = (Vec<usize>, usize, Vec<Member>, DType)> {
    let dtype = prop_oneof![3 => Just(DType::F64), 1 => Just(DType::F32)];
    (mesh_shape(), dtype).prop_flat_map(move |(mesh, dtype)| {
        let nd = mesh.len();
        let ops = if step == Step::Gather {
            vec![]
        } else {
            vec![ReduceOp::Sum]
        };
        let member = (global_shape(1..=3), 1..=13usize).prop_flat_map(move |(mut shape, rows)| {
            shape[0] = rows;
            (
                Just(shape.clone()),
                placements(shape.len(), nd, ops.clone()),
                prop::collection::vec(any::<u8>(), nd),
            )
        });
        (
            Just(mesh.clone()),
            0..nd,
            prop::collection::vec(member, 1..=4),
            Just(dtype),
        )
            .prop_map(move |(mesh, mesh_dim, members, dtype)| {
                let members = members
                    .into_iter()
                    .map(|(shape, p, keys)| Member {
                        layout: member_layout(&mesh, p, &keys, &shape, mesh_dim, step, dtype),
                    })
                    .collect();
                (mesh, mesh_dim, members, dtype)
            })
    })
}

/// Per rank: (bucket output, redistribute output) per member, collectives on the
/// bucket's mesh dim, collectives in all.
type Outcome = (Vec<(Tensor, Tensor)>, u64, u64);

/// Runs `step` as one bucket and, per member, `redistribute` to the bucket's output
/// layout; returns per rank the pairs of local tensors and the collectives issued
/// on the bucket's mesh dim.
fn run(
    mesh: &[usize],
    mesh_dim: usize,
    members: &[Member],
    step: Step,
    gather_dtype: DType,
    tensor_path: bool,
) -> Result<Vec<Outcome>, TestCaseError> {
    let members = members.to_vec();
    on_mesh(mesh, move |m| {
        let inputs: Vec<DTensor> = members
            .iter()
            .enumerate()
            .map(|(i, mb)| {
                let full = test_values(&mb.layout.shape, mb.layout.dtype)?;
                if step == Step::Gather {
                    Ok(distribute_tensor_with_order(
                        &full,
                        m,
                        &mb.layout.placements,
                        mb.layout.order.clone(),
                    )?)
                } else {
                    let local = partial_local(&full, &mb.layout, m.coordinate(), i as u64)?;
                    Ok(DTensor::from_local_with_layout(local, m, mb.layout.clone())?)
                }
            })
            .collect::<Result<_, tessera::BoxError>>()?;
        let before = m.dim_comm(mesh_dim)?.stats().snapshot();
        let s0 = m.stats();
        let bucket = || -> tessera::dtensor::Result<Vec<DTensor>> {
            match step {
                Step::Gather => all_gather_bucket(&inputs, mesh_dim, gather_dtype)?,
                Step::Scatter => reduce_scatter_bucket(&inputs, mesh_dim)?,
                Step::AllReduce => all_reduce_bucket(&inputs, mesh_dim)?,
            }
            .wait()
        };
        let outs = if tensor_path {
            with_tensor_path(bucket)?
        } else {
            bucket()?
        };
        let on_dim = m.dim_comm(mesh_dim)?.stats().snapshot() - before;
        let total = (m.stats() - s0).total_calls();
        let mut pairs = Vec::new();
        for (x, y) in inputs.iter().zip(&outs) {
            let want = x.redistribute_with_order(y.placements(), y.layout().order.clone())?;
            let want = want.to_local().cast(y.dtype())?;
            if y.shape() != x.shape() {
                return Err(format!("global shape {:?} became {:?}", x.shape(), y.shape()).into());
            }
            pairs.push((y.to_local().clone(), want));
        }
        Ok((pairs, on_dim.total_calls(), total))
    })
}

fn check(
    mesh: &[usize],
    mesh_dim: usize,
    members: &[Member],
    step: Step,
    gather_dtype: DType,
) -> Result<(), TestCaseError> {
    check_with(mesh, mesh_dim, members, step, gather_dtype, false)
}

/// [`check`], the bucket run through the tensor path when `tensor_path`.
fn check_with(
    mesh: &[usize],
    mesh_dim: usize,
    members: &[Member],
    step: Step,
    gather_dtype: DType,
    tensor_path: bool,
) -> Result<(), TestCaseError> {
    let outs = run(mesh, mesh_dim, members, step, gather_dtype, tensor_path)?;
    let want_calls = u64::from(mesh[mesh_dim] > 1);
    for (r, (pairs, on_dim, total)) in outs.iter().enumerate() {
        prop_assert_eq!(*on_dim, want_calls, "rank {}: collectives on mesh dim {}", r, mesh_dim);
        prop_assert_eq!(*total, want_calls, "rank {}: collectives in all", r);
        for (i, (got, want)) in pairs.iter().enumerate() {
            prop_assert!(
                close(got, want, step != Step::Gather),
                "rank {} member {}: bucket {:?}, redistribute {:?}",
                r,
                i,
                got,
                want
            );
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(config())]

    /// One all-gather of a bucket equals redistributing each member Shard(0) → Replicate.
    #[test]
    fn gather_matches_redistribute((mesh, dim, members, dtype) in bucket(Step::Gather)) {
        check(&mesh, dim, &members, Step::Gather, dtype)?;
    }

    /// The gather casts to the gather dtype (f64 shards gathered as f32 and back).
    #[test]
    fn gather_casts((mesh, dim, members, _) in bucket(Step::Gather)) {
        check(&mesh, dim, &members, Step::Gather, DType::F32)?;
    }

    /// One reduce-scatter equals redistributing each member Partial(sum) → Shard(0),
    /// the new split innermost on dim 0.
    #[test]
    fn reduce_scatter_matches_redistribute((mesh, dim, members, dtype) in bucket(Step::Scatter)) {
        check(&mesh, dim, &members, Step::Scatter, dtype)?;
    }

    /// One all-reduce equals redistributing each member Partial(sum) → Replicate.
    #[test]
    fn all_reduce_matches_redistribute((mesh, dim, members, dtype) in bucket(Step::AllReduce)) {
        check(&mesh, dim, &members, Step::AllReduce, dtype)?;
    }

    /// The tensor path (which GPU tensors take) gives each step's results too.
    #[test]
    fn tensor_path_matches_redistribute(
        (step, (mesh, dim, members, dtype)) in prop_oneof![
            bucket(Step::Gather).prop_map(|c| (Step::Gather, c)),
            bucket(Step::Scatter).prop_map(|c| (Step::Scatter, c)),
            bucket(Step::AllReduce).prop_map(|c| (Step::AllReduce, c)),
        ]
    ) {
        check_with(&mesh, dim, &members, step, dtype, true)?;
    }
}

/// Misplaced inputs are errors naming the input and its placements.
#[test]
fn misplaced_inputs_are_named() {
    let out = on_mesh(&[2, 2], |m| {
        let full = test_values(&[4, 3], DType::F64)?;
        let r = distribute_tensor_with_order(&full, m, &[Placement::Replicate; 2], ShardOrder::default_for(&[]))?;
        let s = distribute_tensor_with_order(
            &full,
            m,
            &[Placement::Shard(0), Placement::Shard(0)],
            ShardOrder::default_for(&[Placement::Shard(0), Placement::Shard(0)]),
        )?;
        let gather_r = all_gather_bucket(&[s.clone(), r.clone()], 1, DType::F64)
            .unwrap_err()
            .to_string();
        // Dim 0 split by mesh dims [0, 1]: mesh dim 0 is not the last split.
        let gather_outer = all_gather_bucket(std::slice::from_ref(&s), 0, DType::F64)
            .unwrap_err()
            .to_string();
        let scatter_r = reduce_scatter_bucket(std::slice::from_ref(&r), 0)
            .unwrap_err()
            .to_string();
        let past = all_reduce_bucket(&[r], 2).unwrap_err().to_string();
        Ok((gather_r, gather_outer, scatter_r, past))
    })
    .unwrap();
    let (gather_r, gather_outer, scatter_r, past) = &out[0];
    assert!(
        gather_r.contains("input 1") && gather_r.contains("Shard(0)"),
        "{gather_r}"
    );
    assert!(gather_outer.contains("last split"), "{gather_outer}");
    assert!(scatter_r.contains("Partial(sum)"), "{scatter_r}");
    assert!(past.contains("mesh dim 2"), "{past}");
}

/// The receive buffer is charged to the rank while the collective runs; the
/// send is read from the inputs themselves (no packed copy to charge).
#[test]
fn buffers_in_flight_are_charged() {
    let out = on_mesh(&[2], |m| {
        let full = test_values(&[1024, 4], DType::F32)?;
        let x = distribute_tensor_with_order(&full, m, &[Placement::Shard(0)], ShardOrder::default_for(&[]))?;
        let before = tessera::tensor::memory::stats().current_bytes;
        let work = all_gather_bucket(std::slice::from_ref(&x), 0, DType::F32)?;
        let during = tessera::tensor::memory::stats().current_bytes;
        let out = work.wait()?;
        drop(out);
        Ok((during - before, tessera::tensor::memory::stats().current_bytes - before))
    })
    .unwrap();
    for (during, after) in out {
        // 1024 rows × 4 f32 received.
        assert_eq!(during, 1024 * 4 * 4);
        assert_eq!(after, 0);
    }
}

/// On a one-rank mesh dim (here the first dim of a 1×2 mesh) the buckets pack
/// and copy nothing: every output holds its input's local tensor (same storage,
/// no bytes charged), re-placed; a gather to another dtype casts instead.
#[test]
fn one_rank_dim_moves_no_bytes() {
    let out = on_mesh(&[1, 2], |m| {
        let a = test_values(&[5, 3], DType::F32)?;
        let b = test_values(&[4], DType::F32)?;
        let shard = |t: &Tensor| {
            let p = [Placement::Shard(0), Placement::Replicate];
            distribute_tensor_with_order(t, m, &p, ShardOrder::default_for(&p))
        };
        let partial = |t: &Tensor| {
            let p = [Placement::Partial(ReduceOp::Sum), Placement::Replicate];
            DTensor::from_local(t.clone(), m, &p, t.shape())
        };
        let shards = [shard(&a)?, shard(&b)?];
        let before = tessera::tensor::memory::stats().current_bytes;
        let gather = all_gather_bucket(&shards, 0, DType::F32)?;
        let charged = tessera::tensor::memory::stats().current_bytes - before;
        let gathered = gather.wait()?;
        let cast = all_gather_bucket(&shards, 0, DType::BF16)?.wait()?;
        let grads = [partial(&a)?, partial(&b)?];
        let scattered = reduce_scatter_bucket(&grads, 0)?.wait()?;
        let reduced = all_reduce_bucket(&grads, 0)?.wait()?;
        for (x, y) in shards.iter().zip(&gathered) {
            assert!(y.to_local().shares_storage(x.to_local()));
            assert_eq!(y.placements(), &[Placement::Replicate; 2]);
        }
        for (x, y) in grads.iter().zip(scattered.iter().chain(&reduced)) {
            assert!(y.to_local().shares_storage(x.to_local()));
        }
        assert_eq!(scattered[0].placements(), &[Placement::Shard(0), Placement::Replicate]);
        assert_eq!(reduced[1].placements(), &[Placement::Replicate; 2]);
        assert_eq!(cast[0].dtype(), DType::BF16);
        assert!(!cast[0].to_local().shares_storage(shards[0].to_local()));
        Ok((
            charged,
            gathered[0].full_tensor()?,
            cast[1].full_tensor()?,
            scattered[0].full_tensor()?,
        ))
    })
    .unwrap();
    let a = test_values(&[5, 3], DType::F32).unwrap();
    let b = test_values(&[4], DType::F32).unwrap();
    for (charged, gathered, cast, scattered) in out {
        assert_eq!(charged, 0);
        assert_eq!(gathered, a);
        assert_eq!(cast, b.cast(DType::BF16).unwrap());
        assert_eq!(scattered, a);
    }
}
