//! Property tests: every generated case runs on a fresh launch of up to 8 thread
//! ranks and is compared with the oracle on the full tensor.

use proptest::prelude::*;
use tessera::dtensor::redistribute::{Plan, StepKind, plan};
use tessera::dtensor::testing::{
    all_coords, collective_bound, expected_local, shard_swap, transition, with_tensor_path,
};
use tessera::dtensor::{Placement, Tensor};
use tessera::mesh::{CommCounts, OpKind};

use crate::harness::{close, config, full_of, on_case, source};

/// What one rank saw in the byte-count property.
struct Counted {
    coord: Vec<usize>,
    plan: Plan,
    /// Counters around the whole `redistribute` call.
    whole: CommCounts,
    /// Counters around each step run alone.
    steps: Vec<CommCounts>,
    /// Whether running the steps one by one gave the same local tensor.
    stepwise_same: bool,
}

proptest! {
    #![proptest_config(config())]

    /// (a) distribute (or partial `from_local`) → redistribute → `full_tensor` is the
    /// original on every rank, and the result has the target layout.
    #[test]
    fn full_tensor_survives_redistribute(t in transition(true, true)) {
        let want = full_of(&t);
        let outs = on_case(&t, |t, mesh| {
            let x = source(t, mesh)?;
            let before = x.full_tensor()?;
            let y = x.redistribute_with_order(&t.dst.placements, t.dst.order.clone())?;
            Ok((before, y.layout().clone(), y.full_tensor()?))
        })?;
        for (r, (before, layout, full)) in outs.iter().enumerate() {
            prop_assert!(close(before, &want, t.has_avg()), "rank {}: source full {:?}, want {:?}", r, before, want);
            prop_assert_eq!(layout, &t.dst, "rank {}", r);
            prop_assert!(close(full, &want, t.has_avg()), "rank {}: full {:?}, want {:?}", r, full, want);
        }
    }

    /// (b) after redistributing to a layout without Partial, every rank holds exactly
    /// the slice of the original that `local_shape_and_offset` names for it.
    #[test]
    fn local_shards_are_the_named_slices(t in transition(true, false)) {
        let full = full_of(&t);
        let outs = on_case(&t, |t, mesh| {
            let y = source(t, mesh)?.redistribute_with_order(&t.dst.placements, t.dst.order.clone())?;
            Ok((mesh.coordinate().to_vec(), y.to_local().clone()))
        })?;
        for (coord, local) in &outs {
            let want = expected_local(&full, &t.dst, coord).map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert!(close(local, &want, t.has_avg()), "coord {:?}: local {:?}, want {:?}", coord, local, want);
        }
    }

    /// (c) bytes each rank sends, counted by the communicators, equal the plan's (for
    /// the whole call and for each step run alone); each step issues exactly its one
    /// collective and stays within that collective's bound; ranks agree on the steps.
    #[test]
    fn bytes_match_plan_and_bounds(t in transition(true, true)) {
        let outs = on_case(&t, |t, mesh| {
            let x = source(t, mesh)?;
            let plan = x.redistribute_plan_with_order(&t.dst.placements, t.dst.order.clone())?;
            let s0 = mesh.stats();
            let y = x.redistribute_with_order(&t.dst.placements, t.dst.order.clone())?;
            let whole = mesh.stats() - s0;
            let mut steps = Vec::new();
            let mut cur = x;
            for step in &plan.steps {
                let one = Plan { src: cur.layout().clone(), steps: vec![step.clone()] };
                let s = mesh.stats();
                cur = cur.run_plan(&one)?;
                steps.push(mesh.stats() - s);
            }
            let stepwise_same = cur.to_local() == y.to_local();
            Ok(Counted { coord: mesh.coordinate().to_vec(), plan, whole, steps, stepwise_same })
        })?;
        let shape_of = |p: &Plan| -> Vec<_> { p.steps.iter().map(|s| (s.mesh_dims.clone(), s.kind, s.after.clone())).collect() };
        let first = shape_of(&outs[0].plan);
        for c in &outs {
            let (plan, coord) = (&c.plan, &c.coord);
            prop_assert_eq!(shape_of(plan), first.clone(), "ranks disagree on the steps; coord {:?}", coord);
            prop_assert_eq!(plan.dst(), &t.dst);
            prop_assert!(c.stepwise_same, "coord {:?}: steps run one by one differ from the whole plan", coord);
            prop_assert_eq!(c.whole.total_bytes(), plan.bytes(), "coord {:?}: measured {} vs plan\n{}", coord, c.whole, plan);
            // The first step over a flattened group of mesh dims splits that
            // group's communicator once per mesh (a `split`, no bytes).
            // (`total_calls` leaves splits out.)
            let ndim = t.src.mesh_shape.len();
            let sub_meshes = plan.steps.iter().filter(|s| s.mesh_dims.len() > 1 && s.mesh_dims.len() < ndim).count();
            prop_assert!(c.whole.calls(OpKind::Split) <= sub_meshes as u64, "coord {:?}: measured {}", coord, c.whole);
            prop_assert_eq!(c.whole.total_calls(), plan.collectives() as u64, "coord {:?}: measured {}", coord, c.whole);
            for kind in OpKind::ALL.into_iter().filter(|k| *k != OpKind::Split) {
                let planned = plan.steps.iter().filter(|s| s.collective() == Some(kind));
                let (calls, bytes) = planned.fold((0, 0), |(n, b), s| (n + 1, b + s.bytes));
                prop_assert_eq!(c.whole.calls(kind), calls, "coord {:?}: {} calls", coord, kind);
                prop_assert_eq!(c.whole.bytes(kind), bytes, "coord {:?}: {} bytes", coord, kind);
            }
            for ((before, step), measured) in plan.transitions().zip(&c.steps) {
                let what = format!("coord {coord:?}, step {:?} on {:?} of\n{plan}", step.kind, step.mesh_dims);
                prop_assert_eq!(measured.total_bytes(), step.bytes, "measured {}: {}", measured, what);
                match step.collective() {
                    Some(kind) => {
                        prop_assert_eq!(measured.calls(kind), 1, "{}", what);
                        prop_assert_eq!(measured.total_calls(), 1, "measured {}: {}", measured, what);
                        let n = step.group_size();
                        let bound = collective_bound(before, &step.after, kind, n, coord)
                            .map_err(|e| TestCaseError::fail(e.to_string()))?;
                        prop_assert!(step.bytes <= bound, "{} bytes over the bound {}: {}", step.bytes, bound, what);
                    }
                    None => {
                        prop_assert_eq!(measured.total_calls(), 0, "measured {}: {}", measured, what);
                        prop_assert_eq!(step.bytes, 0, "{}", what);
                    }
                }
            }
        }
    }

    /// (c) `S(i) → S(j)` on one mesh dim, everything else equal, is exactly one
    /// all_to_all on that mesh dim on every rank (no all_gather), and it lands every
    /// rank on its slice.
    #[test]
    fn shard_to_shard_is_one_all_to_all((t, (m, i, j)) in shard_swap()) {
        for coord in all_coords(&t.src.mesh_shape) {
            let p = plan(&t.src, &t.dst, &coord).map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(p.steps.len(), 1, "coord {:?}:\n{}", coord, p);
            prop_assert_eq!(&p.steps[0].mesh_dims[..], &[m], "coord {:?}:\n{}", coord, p);
            prop_assert_eq!(p.steps[0].kind, StepKind::AllToAll, "coord {:?}:\n{}", coord, p);
            prop_assert_eq!(p.steps[0].after.placements[m], Placement::Shard(j), "coord {:?}:\n{}", coord, p);
            prop_assert_eq!(t.src.placements[m], Placement::Shard(i));
            prop_assert_eq!(p.collectives(), usize::from(t.src.mesh_shape[m] > 1));
        }
        let full = full_of(&t);
        let outs = on_case(&t, |t, mesh| {
            let x = source(t, mesh)?;
            let s0 = mesh.stats();
            let y = x.redistribute_with_order(&t.dst.placements, t.dst.order.clone())?;
            Ok((mesh.coordinate().to_vec(), y.to_local().clone(), mesh.stats() - s0))
        })?;
        // Along a one-rank mesh dim the all_to_all is local: nothing moves.
        let calls = u64::from(t.src.mesh_shape[m] > 1);
        for (coord, local, counts) in &outs {
            prop_assert_eq!(counts.calls(OpKind::AllToAll), calls, "coord {:?}: {}", coord, counts);
            prop_assert_eq!(counts.calls(OpKind::AllGather), 0, "coord {:?}: {}", coord, counts);
            prop_assert_eq!(counts.total_calls(), calls, "coord {:?}: {}", coord, counts);
            let want = expected_local(&full, &t.dst, coord).map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(local, &want, "coord {:?}", coord);
        }
    }

    /// (d) there and back (no Partial, random orders both ways) restores every local
    /// shard exactly, and the way there lands on the target's slices.
    #[test]
    fn there_and_back_restores_locals(t in transition(false, false)) {
        let full = full_of(&t);
        let outs = on_case(&t, |t, mesh| {
            let x = source(t, mesh)?;
            let y = x.redistribute_with_order(&t.dst.placements, t.dst.order.clone())?;
            let z = y.redistribute_with_order(&t.src.placements, t.src.order.clone())?;
            let locals: [Tensor; 3] = [x.to_local().clone(), y.to_local().clone(), z.to_local().clone()];
            Ok((mesh.coordinate().to_vec(), locals, z.layout().clone()))
        })?;
        for (coord, [x, y, z], layout) in &outs {
            prop_assert_eq!(layout, &t.src);
            prop_assert_eq!(z, x, "coord {:?}: back differs from the source", coord);
            let want = expected_local(&full, &t.dst, coord).map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(y, &want, "coord {:?}: there", coord);
        }
    }

    /// (e) the tensor path (whole-tensor packing, assembly and collectives,
    /// which GPU tensors take) gives every rank the same local tensor as the
    /// slice path, bit for bit, moving the plan's bytes.
    #[test]
    fn tensor_path_equals_slice_path(t in transition(true, true)) {
        let outs = on_case(&t, |t, mesh| {
            let x = source(t, mesh)?;
            let plan = x.redistribute_plan_with_order(&t.dst.placements, t.dst.order.clone())?;
            let a = x.redistribute_with_order(&t.dst.placements, t.dst.order.clone())?;
            let s0 = mesh.stats();
            let b = with_tensor_path(|| x.redistribute_with_order(&t.dst.placements, t.dst.order.clone()))?;
            let moved = (mesh.stats() - s0).total_bytes();
            Ok((mesh.coordinate().to_vec(), a.to_local().clone(), b.to_local().clone(), moved, plan.bytes()))
        })?;
        for (coord, a, b, moved, planned) in &outs {
            let bits = |t: &Tensor| t.to_f64_vec().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            prop_assert_eq!(a.shape(), b.shape(), "coord {:?}", coord);
            prop_assert_eq!(bits(a), bits(b), "coord {:?}: the tensor path differs", coord);
            prop_assert_eq!(moved, planned, "coord {:?}: bytes", coord);
        }
    }
}
