//! Resharding and freed parameters: which units are unsharded after forward and
//! backward, manual `unshard`/`unshard_async`/`reshard`, and the unsharded value a
//! forward used, freed after it; resharding after forward to smaller groups (hpZ).

use std::cell::RefCell;

use tessera::autograd::nn::{Linear, Materializer, Module};
use tessera::autograd::{Param, Var, backward};
use tessera::dtensor::{Placement, Tensor, distribute_tensor};
use tessera::fsdp::{Error as FsdpError, FsdpConfig, FsdpModule, fully_shard};
use tessera::mesh::{CommCounts, OpKind};
use tessera::models::FsdpUnits;
use tessera::{DType, DeviceMesh, launch};

use crate::common::{reference_losses, tiny_model, tokens};
use crate::{TestResult, batch, calls, full_grads, max_abs_diff, reshard, scalar};

/// A linear layer that keeps the weight it used in forward (the unit's unsharded
/// stand-in), to look at it after forward.
struct Stash {
    lin: Linear,
    seen: RefCell<Option<Var>>,
}

impl Module for Stash {
    fn named_children(&self) -> Vec<(String, &dyn Module)> {
        vec![("lin".into(), &self.lin)]
    }

    fn forward(&self, x: &Var) -> tessera::autograd::Result<Var> {
        let w = self.lin.weight.var()?;
        *self.seen.borrow_mut() = Some(w.clone());
        let b = self.lin.bias.as_ref().map(Param::var).transpose()?;
        x.linear(&w, b.as_ref())
    }
}

fn states(u: &FsdpUnits) -> (Vec<bool>, bool) {
    (
        u.blocks.iter().map(FsdpModule::is_unsharded).collect(),
        u.root.is_unsharded(),
    )
}

#[test]
fn after_forward_and_backward() {
    let toks = tokens();
    launch(2, move |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), &[2])?;
        let model = tiny_model(&mesh)?;
        let units = model.fully_shard(&mesh, &FsdpConfig::default())?;
        assert_eq!(states(&units), (vec![false, false], false), "before any forward");
        // Default: blocks free their parameters after forward, the root keeps them.
        let loss = model.loss(&batch(&toks, 0, 0..8, &mesh)?)?;
        assert_eq!(states(&units), (vec![false, false], true), "after forward");
        backward(&loss)?;
        assert_eq!(states(&units), (vec![false, false], false), "after backward");
        // Kept after forward (the recursive setter): every unit still reshards after backward.
        units.root.set_reshard_after_forward(false);
        let loss = model.loss(&batch(&toks, 1, 0..8, &mesh)?)?;
        assert_eq!(states(&units), (vec![true, true], true), "after forward, kept");
        backward(&loss)?;
        assert_eq!(states(&units), (vec![false, false], false), "after backward, kept");
        // And back on: `Some(true)` also frees the root's after forward.
        units.root.set_reshard_after_forward(true);
        let loss = model.loss(&batch(&toks, 2, 0..8, &mesh)?)?;
        assert_eq!(
            states(&units),
            (vec![false, false], false),
            "after forward, all resharded"
        );
        let before = mesh.stats();
        backward(&loss)?;
        let c = mesh.stats() - before;
        assert_eq!(calls(&c), (3, 3, 0, 0), "backward gathers every unit again: {c}");
        assert_eq!(states(&units), (vec![false, false], false));
        Ok(())
    })
    .unwrap();
}

#[test]
fn manual_unshard_and_reshard() {
    let toks = tokens();
    launch(2, move |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), &[2])?;
        let model = tiny_model(&mesh)?;
        let units = model.fully_shard(&mesh, &FsdpConfig::default())?;
        let b = &units.blocks[0];
        let gathered = |f: &dyn Fn() -> tessera::fsdp::Result<()>| -> TestResult<CommCounts> {
            let before = mesh.stats();
            f()?;
            Ok(mesh.stats() - before)
        };
        // unshard gathers once; again is a no-op; reshard frees.
        let c = gathered(&|| {
            b.unshard()?;
            b.unshard()
        })?;
        assert_eq!(calls(&c), (1, 0, 0, 0), "{c}");
        assert_eq!(c.bytes(OpKind::AllGather), b.sharded_bytes() as u64);
        assert!(b.is_unsharded());
        b.reshard()?;
        assert!(!b.is_unsharded());
        // unshard_async issues the gather; unshard waits for it without another.
        let c = gathered(&|| b.unshard_async())?;
        assert_eq!(calls(&c), (1, 0, 0, 0), "{c}");
        assert!(!b.is_unsharded(), "in flight is not unsharded yet");
        let c = gathered(&|| b.unshard())?;
        assert_eq!(calls(&c), (0, 0, 0, 0), "{c}");
        assert!(b.is_unsharded());
        b.reshard()?;
        // Resharding a gather in flight waits for it and frees.
        b.unshard_async()?;
        b.reshard()?;
        assert!(!b.is_unsharded());
        // Unsharded before forward: forward gathers only the other two units,
        // and the step still matches the reference.
        b.unshard()?;
        let rows = batch(&toks, 0, 0..8, &mesh)?;
        let before = mesh.stats();
        let loss = model.loss(&rows)?;
        backward(&loss)?;
        let c = mesh.stats() - before;
        assert_eq!(calls(&c), (4, 3, 0, 0), "{c}");
        let want = reference_losses("fsdp_W2_G8")[0];
        assert!((scalar(&loss)? - want).abs() <= 1e-5);
        assert_eq!(states(&units), (vec![false, false], false));
        Ok(())
    })
    .unwrap();
}

/// The unsharded value a forward used is freed after it: reading it is an
/// error naming the parameter; backward gathers it again.
#[test]
fn freed_parameter_cannot_be_read() {
    launch(2, move |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), &[2])?;
        let stash = Stash {
            lin: Linear::new(3, 4, true, &mesh, DType::F32)?,
            seen: RefCell::new(None),
        };
        let twin = Stash {
            lin: Linear::new(3, 4, true, &mesh, DType::F32)?,
            seen: RefCell::new(None),
        };
        let unit = fully_shard(&stash, &mesh, reshard(true))?;
        // Equal names and seed: the twin holds the same values, unsharded.
        Materializer::from_seed(7).materialize(&stash)?;
        Materializer::from_seed(7).materialize(&twin)?;
        let x = Tensor::randn(&[6, 3], DType::F32, 11)?;
        let x = Var::constant(distribute_tensor(&x, &mesh, &[Placement::Shard(0)])?);
        let loss = stash.call(&x)?.square()?.mean(&[0, 1], false)?;
        assert!(!unit.is_unsharded());
        let seen = stash.seen.borrow_mut().take().unwrap();
        assert_eq!(
            seen.value().placements(),
            &[Placement::Replicate],
            "forward saw the unsharded weight"
        );
        match seen.saved().get().map_err(FsdpError::from) {
            Err(e @ FsdpError::Resharded { .. }) => {
                let msg = e.to_string();
                assert!(msg.contains("lin.weight") && msg.contains("resharded"), "{msg}");
            }
            Err(e) => panic!("expected Freed, got {e}"),
            Ok(_) => panic!("the unsharded weight is still readable after forward"),
        }
        backward(&loss)?;
        let twin_loss = twin.call(&x)?.square()?.mean(&[0, 1], false)?;
        backward(&twin_loss)?;
        assert_eq!(scalar(&loss)?, scalar(&twin_loss)?);
        let g = full_grads(&stash.parameters())?;
        let want = full_grads(&twin.parameters())?;
        for ((n, g), (_, w)) in g.iter().zip(&want) {
            let d = max_abs_diff(g.as_ref().unwrap(), w.as_ref().unwrap());
            assert!(d <= 1e-6, "{n}: gradient differs by {d}");
        }
        Ok(())
    })
    .unwrap();
}

/// `reshard_after_forward_to: Some(2)` on 4 ranks (hpZ): after forward each
/// block keeps half of its unsharded parameters (its pair's share), and
/// backward gathers within the pair; training is bitwise the default's.
#[test]
fn reshard_after_forward_to_a_smaller_group() {
    let hpz = FsdpConfig {
        reshard_after_forward_to: Some(2),
        ..FsdpConfig::default()
    };
    let default = crate::train(&crate::Job::fsdp(&[4], 8, 5, FsdpConfig::default()));
    let paired = crate::train(&crate::Job::fsdp(&[4], 8, 5, hpz.clone()));
    assert_eq!(paired.losses, default.losses);
    // A block: 12·64² + 9·64 f32 unsharded; a pair member sends its half.
    let block = (12 * 64 * 64 + 9 * 64) * 4;
    let ag = OpKind::AllGather;
    println!(
        "backward all-gathers: {} B (whole dim, 4 ranks) vs {} B (pairs)",
        default.bwd[1].bytes(ag),
        paired.bwd[1].bytes(ag)
    );
    assert_eq!(paired.bwd[1].calls(ag), 2);
    assert_eq!(paired.bwd[1].bytes(ag), 2 * block as u64 / 2);
    assert_ne!(paired.bwd[1].bytes(ag), default.bwd[1].bytes(ag));
    // Memory held after forward, and the blocks' state.
    let toks = tokens();
    let held = launch(4, move |ctx| -> TestResult<_> {
        let mesh = DeviceMesh::new(ctx.into_comm(), &[4])?;
        let mut out = Vec::new();
        for cfg in [FsdpConfig::default(), hpz.clone()] {
            let model = tiny_model(&mesh)?;
            let units = model.fully_shard(&mesh, &cfg)?;
            let x = batch(&toks, 0, 0..8, &mesh)?;
            let before = tessera::tensor::memory::stats().current_bytes;
            let loss = model.loss(&x)?;
            let after = tessera::tensor::memory::stats().current_bytes;
            out.push((after - before, units.blocks[0].gather_state()));
            backward(&loss)?;
        }
        let bad = tiny_model(&mesh)?
            .fully_shard(
                &mesh,
                &FsdpConfig {
                    reshard_after_forward_to: Some(3),
                    ..FsdpConfig::default()
                },
            )
            .err()
            .map(|e| e.to_string());
        Ok((out, bad))
    })
    .unwrap()
    .swap_remove(0);
    let ((default_held, default_state), (paired_held, paired_state)) = (held.0[0], held.0[1]);
    assert_eq!(paired_held - default_held, 2 * block / 2, "two blocks keep half each");
    assert_eq!(default_state, tessera::fsdp::GatherState::Sharded);
    assert_eq!(paired_state, tessera::fsdp::GatherState::Regrouped);
    let bad = held.1.unwrap();
    assert!(bad.contains("must divide the 4 ranks"), "{bad}");
}
