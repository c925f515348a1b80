//! The rules of gradients: their placements and the collectives that bring them
//! there, accumulation across backward calls, `zero_grad`, `no_grad`, `detach`,
//! frozen parameters, and the errors of `backward`.

use tessera::autograd::{Param, Var, backward, clear_tape, no_grad, recorded_ops};
use tessera::dtensor::{Placement, Placement::*, ShardOrder, Tensor, distribute_tensor_with_order};
use tessera::mesh::{CommCounts, OpKind};

use crate::harness::{R, constant, full_grad, max_rel_err, on_mesh, param, scalar, try_on_mesh, uniform};

/// `mean((x · w)²)` with `x` `[8, 4]` batch-sharded on every mesh dim and `w`
/// `[4, 3]` placed as `w_placements`, used replicated (through `redistribute` when
/// it is stored otherwise).
fn square_loss(mesh: &tessera::DeviceMesh, w: &Param) -> R<Var> {
    let x = constant(&uniform(&[8, 4], 1), mesh, &vec![Shard(0); mesh.ndim()])?;
    let wv = w.var()?;
    let wv = if wv.value().placements().iter().all(|p| p.is_replicate()) {
        wv
    } else {
        wv.redistribute(&vec![Replicate; mesh.ndim()])?
    };
    Ok(x.matmul(&wv)?.square()?.mean(&[0, 1], false)?)
}

/// What each rank saw: the gradient's placements, its local values, its full
/// value, and the collectives issued during `backward` alone.
struct Seen {
    placements: Vec<Placement>,
    local: Vec<f64>,
    full: Tensor,
    during_backward: CommCounts,
}

fn grad_of_square_loss(mesh_shape: &[usize], w_placements: &[Placement]) -> Vec<Seen> {
    let w_placements = w_placements.to_vec();
    on_mesh(mesh_shape, move |mesh| {
        let w = param("w", &uniform(&[4, 3], 2), mesh, &w_placements)?;
        let loss = square_loss(mesh, &w)?;
        let before = mesh.stats();
        backward(&loss)?;
        let during_backward = mesh.stats() - before;
        let g = w.grad().ok_or("no gradient")?;
        Ok(Seen {
            placements: g.placements().to_vec(),
            local: g.to_local().to_f64_vec(),
            full: g.full_tensor()?,
            during_backward,
        })
    })
}

/// The gradient of the square loss on one rank.
fn reference_grad() -> Tensor {
    grad_of_square_loss(&[1], &[Replicate]).remove(0).full
}

#[test]
fn a_replicated_param_gets_a_replicated_grad_equal_on_every_rank() {
    let want = reference_grad();
    for mesh in [&[2][..], &[4], &[2, 2]] {
        let rep = vec![Replicate; mesh.len()];
        let seen = grad_of_square_loss(mesh, &rep);
        for (rank, s) in seen.iter().enumerate() {
            assert_eq!(s.placements, rep, "mesh {mesh:?} rank {rank}");
            assert_eq!(
                s.local, seen[0].local,
                "mesh {mesh:?}: rank {rank}'s replicated grad differs from rank 0's"
            );
            assert!(
                max_rel_err(&s.full, &want).unwrap() <= 1e-12,
                "mesh {mesh:?} rank {rank}"
            );
            // The partial weight gradient is summed by one all_reduce over the whole
            // mesh (partial on every mesh dim), nothing else.
            let c = s.during_backward;
            assert_eq!(c.calls(OpKind::AllReduce), 1, "mesh {mesh:?}: {c}");
            assert_eq!(c.total_calls(), 1, "mesh {mesh:?}: {c}");
        }
    }
}

#[test]
fn a_sharded_param_gets_a_sharded_grad_through_one_reduce_scatter() {
    let want = reference_grad();
    for mesh in [&[2][..], &[4]] {
        let seen = grad_of_square_loss(mesh, &[Shard(0)]);
        let n = mesh[0];
        for (rank, s) in seen.iter().enumerate() {
            assert_eq!(s.placements, [Shard(0)], "mesh {mesh:?} rank {rank}");
            // Rows of the [4, 3] gradient this rank holds (torch.chunk split).
            let per = 4usize.div_ceil(n);
            let rows = per.min(4usize.saturating_sub(rank * per));
            assert_eq!(s.local.len(), rows * 3, "mesh {mesh:?} rank {rank}");
            let full = s.full.to_f64_vec();
            assert_eq!(
                s.local[..],
                full[rank * per * 3..rank * per * 3 + rows * 3],
                "rank {rank}'s shard"
            );
            assert!(
                max_rel_err(&s.full, &want).unwrap() <= 1e-12,
                "mesh {mesh:?} rank {rank}"
            );
            let c = s.during_backward;
            assert_eq!(c.calls(OpKind::ReduceScatter), 1, "mesh {mesh:?}: {c}");
            assert_eq!(c.calls(OpKind::AllReduce), 0, "mesh {mesh:?}: {c}");
            assert_eq!(c.total_calls(), 1, "mesh {mesh:?}: {c}");
        }
    }
}

#[test]
fn an_hsdp_param_gets_one_all_reduce_and_one_reduce_scatter() {
    let want = reference_grad();
    let seen = grad_of_square_loss(&[2, 2], &[Replicate, Shard(0)]);
    for (rank, s) in seen.iter().enumerate() {
        assert_eq!(s.placements, [Replicate, Shard(0)], "rank {rank}");
        assert!(max_rel_err(&s.full, &want).unwrap() <= 1e-12, "rank {rank}");
        let c = s.during_backward;
        assert_eq!(c.calls(OpKind::ReduceScatter), 1, "{c}");
        assert_eq!(c.calls(OpKind::AllReduce), 1, "{c}");
        assert_eq!(c.total_calls(), 2, "{c}");
    }
}

#[test]
fn backward_accumulates_and_zero_grad_clears() {
    for (mesh, pl) in [(&[1][..], &[Replicate][..]), (&[2], &[Shard(0)]), (&[2], &[Replicate])] {
        let out = on_mesh(mesh, |mesh| {
            let w = param("w", &uniform(&[4, 3], 2), mesh, pl)?;
            backward(&square_loss(mesh, &w)?)?;
            let once = full_grad(&w)?;
            backward(&square_loss(mesh, &w)?)?;
            let twice = full_grad(&w)?;
            let placed = w.grad().ok_or("no grad")?.placements().to_vec();
            w.zero_grad();
            let cleared = w.grad().is_none();
            backward(&square_loss(mesh, &w)?)?;
            let again = full_grad(&w)?;
            Ok((once, twice, placed, cleared, again))
        });
        for (once, twice, placed, cleared, again) in out {
            let doubled: Vec<f64> = once.to_f64_vec().iter().map(|v| 2.0 * v).collect();
            let doubled = Tensor::from_vec(doubled, once.shape()).unwrap();
            assert!(
                max_rel_err(&twice, &doubled).unwrap() <= 1e-14,
                "{mesh:?}: second backward did not add"
            );
            assert_eq!(placed, pl, "{mesh:?}: the sum left the param's placements");
            assert!(cleared, "zero_grad left a gradient");
            assert!(
                max_rel_err(&again, &once).unwrap() <= 1e-14,
                "{mesh:?}: after zero_grad"
            );
        }
    }
}

#[test]
fn backward_consumes_the_tape() {
    let out = on_mesh(&[1], |mesh| {
        let w = param("w", &uniform(&[4, 3], 2), mesh, &[Replicate])?;
        let loss = square_loss(mesh, &w)?;
        let before = recorded_ops();
        backward(&loss)?;
        Ok((before, recorded_ops()))
    });
    let (before, after) = out[0];
    assert!(before >= 3, "matmul, square and mean recorded only {before} ops");
    assert_eq!(after, 0);
}

#[test]
fn no_grad_records_nothing() {
    let out = on_mesh(&[2], |mesh| {
        let w = param("w", &uniform(&[4, 3], 2), mesh, &[Shard(0)])?;
        clear_tape();
        let (loss, counted, leaf_requires) = no_grad(|| -> R<_> {
            let leaf = w.var()?;
            let loss = square_loss(mesh, &w)?;
            Ok((loss, recorded_ops(), leaf.requires_grad()))
        })?;
        let after = recorded_ops();
        let err = backward(&loss).map(|_| ()).map_err(|e| e.to_string());
        let value = scalar(&loss)?;
        Ok((
            counted,
            after,
            leaf_requires,
            loss.requires_grad(),
            err,
            value,
            w.grad().is_none(),
        ))
    });
    for (counted, after, leaf_requires, requires, err, value, no_grad_left) in out {
        assert_eq!((counted, after), (0, 0), "ops recorded under no_grad");
        assert!(
            !leaf_requires && !requires,
            "values computed under no_grad require grad"
        );
        let err = err.expect_err("backward of a no_grad loss succeeded");
        assert!(err.contains("no_grad"), "unclear error: {err}");
        assert!(value > 0.0, "the forward under no_grad still computes");
        assert!(no_grad_left, "a gradient appeared");
    }
}

#[test]
fn grad_mode_comes_back_after_no_grad() {
    let out = on_mesh(&[1], |mesh| {
        let w = param("w", &uniform(&[4, 3], 2), mesh, &[Replicate])?;
        no_grad(|| ());
        let loss = square_loss(mesh, &w)?;
        Ok(loss.requires_grad() && recorded_ops() > 0)
    });
    assert!(out[0]);
}

#[test]
fn detach_stops_gradients() {
    let out = on_mesh(&[1], |mesh| {
        let p = param("p", &uniform(&[3, 4], 3), mesh, &[Replicate])?;
        // d/dp Σ p·detach(p) = detach(p) = p, not 2p.
        let v = p.var()?;
        let loss = v.mul(&v.detach())?.sum(&[0, 1], false)?;
        backward(&loss)?;
        let g = full_grad(&p)?;
        // Only through a detached value: nothing requires a gradient.
        let q = param("q", &uniform(&[3, 4], 4), mesh, &[Replicate])?;
        let cut = q.var()?.exp()?.detach();
        let requires = cut.requires_grad() || cut.square()?.requires_grad();
        clear_tape();
        Ok((g, p.value()?.full_tensor()?, requires, q.grad().is_none()))
    });
    let (g, p, requires, q_none) = &out[0];
    assert!(
        max_rel_err(g, p).unwrap() <= 1e-15,
        "grad {:?} != p {:?}",
        g.to_f64_vec(),
        p.to_f64_vec()
    );
    assert!(!requires, "a detached value requires grad");
    assert!(q_none);
}

#[test]
fn frozen_params_get_no_grad() {
    let out = on_mesh(&[2], |mesh| {
        let x = constant(&uniform(&[6, 4], 1), mesh, &[Shard(0)])?;
        let w1 = param("w1", &uniform(&[5, 4], 2), mesh, &[Replicate])?;
        let w2 = param("w2", &uniform(&[2, 5], 3), mesh, &[Shard(0)])?;
        w1.set_requires_grad(false);
        let loss = |w2v: Var| -> R<Var> {
            Ok(x.linear(&w1.var()?, None)?
                .tanh()?
                .linear(&w2v, None)?
                .square()?
                .mean(&[0, 1], false)?)
        };
        let w2v = w2.var()?.redistribute(&[Replicate])?;
        backward(&loss(w2v)?)?;
        let trained = full_grad(&w2)?;
        // The same gradient for w2 as when w1 is trained too.
        w1.set_requires_grad(true);
        let w2b = param("w2b", &uniform(&[2, 5], 3), mesh, &[Shard(0)])?;
        backward(&loss(w2b.var()?.redistribute(&[Replicate])?)?)?;
        let both = full_grad(&w2b)?;
        let w1_trained = w1.grad().is_some();
        // Everything frozen: nothing to differentiate.
        w1.set_requires_grad(false);
        w2.set_requires_grad(false);
        let err = backward(&loss(w2.var()?)?).map_err(|e| e.to_string()).err();
        Ok((w1.requires_grad(), trained, both, w1_trained, err))
    });
    for (w1_flag, trained, both, w1_trained, err) in out {
        assert!(!w1_flag);
        assert!(max_rel_err(&trained, &both).unwrap() <= 1e-14);
        assert!(w1_trained, "unfreezing w1 did not give it a gradient");
        let err = err.expect("backward with every parameter frozen succeeded");
        assert!(err.contains("does not depend on any parameter"), "unclear error: {err}");
    }
}

#[test]
fn a_frozen_param_gets_no_grad_while_others_do() {
    let out = on_mesh(&[1], |mesh| {
        let a = param("a", &uniform(&[3], 1), mesh, &[Replicate])?;
        let b = param("b", &uniform(&[3], 2), mesh, &[Replicate])?;
        b.set_requires_grad(false);
        backward(&a.var()?.mul(&b.var()?)?.sum(&[0], false)?)?;
        Ok((
            a.grad().is_some(),
            b.grad().is_none(),
            full_grad(&a)?,
            b.value()?.full_tensor()?,
        ))
    });
    let (a_has, b_none, ga, b) = &out[0];
    assert!(*a_has && *b_none);
    assert!(max_rel_err(ga, b).unwrap() <= 1e-15);
}

#[test]
fn backward_of_a_non_scalar_is_a_clear_error() {
    let out = try_on_mesh(&[1], |mesh| {
        let w = param("w", &uniform(&[4, 3], 2), mesh, &[Replicate])?;
        let y = w.var()?.square()?;
        let err = backward(&y).map_err(|e| e.to_string()).err();
        // The failed call leaves the tape alone; a scalar loss still works.
        let ops = recorded_ops();
        backward(&y.sum(&[0, 1], false)?)?;
        Ok((err, ops, w.grad().is_some()))
    })
    .unwrap();
    let (err, ops, has) = &out[0];
    let err = err.as_ref().expect("backward of a [4, 3] loss succeeded");
    assert!(err.contains("scalar") && err.contains("[4, 3]"), "unclear error: {err}");
    assert_eq!(*ops, 1);
    assert!(has);
}

/// A parameter split twice along one dim in the reversed order (FSDP over tensor
/// parallelism) gets its gradient in that same order, with this rank's piece of it.
#[test]
fn a_reversed_shard_order_survives_into_the_grad() {
    let want = reference_grad();
    let placements = [Shard(0), Shard(0)];
    let order = ShardOrder::reversed_for(&placements);
    let out = on_mesh(&[2, 2], {
        let order = order.clone();
        move |mesh| {
            let w = distribute_tensor_with_order(&uniform(&[4, 3], 2), mesh, &placements, order.clone())?;
            let w = Param::new(w);
            backward(&square_loss(mesh, &w)?)?;
            let g = w.grad().ok_or("no gradient")?;
            let expected_local = distribute_tensor_with_order(&want, mesh, &placements, order.clone())?;
            Ok((
                g.placements().to_vec(),
                g.layout().order.clone(),
                g.to_local().to_f64_vec(),
                expected_local.to_local().to_f64_vec(),
            ))
        }
    });
    for (rank, (placed, got_order, local, expected)) in out.into_iter().enumerate() {
        assert_eq!(placed, placements, "rank {rank}");
        assert_eq!(got_order, order, "rank {rank}");
        let err = local
            .iter()
            .zip(&expected)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max);
        assert!(
            local.len() == expected.len() && err <= 1e-12,
            "rank {rank}: {local:?} vs {expected:?}"
        );
    }
}

/// Two losses computed before either's backward: the first backward consumes the
/// whole tape, so the second finds none of its ops and returns `Ok` having done
/// nothing. It must either add its gradients or say why it cannot.
#[test]
fn backward_of_a_second_loss_is_not_silently_lost() {
    let out = on_mesh(&[1], |mesh| {
        let w = param("w", &uniform(&[3], 1), mesh, &[Replicate])?;
        let l1 = w.var()?.sum(&[0], false)?; // d/dw = 1
        let l2 = w.var()?.mul_scalar(2.0)?.sum(&[0], false)?; // d/dw = 2
        backward(&l1)?;
        let second = backward(&l2).map_err(|e| e.to_string());
        Ok((second, full_grad(&w)?.to_f64_vec()))
    });
    let (second, grad) = &out[0];
    if second.is_ok() {
        assert_eq!(grad, &vec![3.0; 3], "the second backward returned Ok but added nothing");
    }
}
