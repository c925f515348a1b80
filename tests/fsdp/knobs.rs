//! FSDP2's knobs for gradient accumulation, each checked against the default
//! run (same gradients) and by the collectives it saves (a knob that did nothing
//! fails): `set_reshard_after_backward`, `set_requires_all_reduce` (HSDP and
//! replicated units).

use tessera::autograd::backward;
use tessera::autograd::nn::Module;
use tessera::fsdp::{FsdpConfig, replicate};
use tessera::mesh::{CommCounts, OpKind};
use tessera::models::FsdpUnits;
use tessera::{DeviceMesh, launch};

use crate::common::{tiny_model, tokens};
use crate::{TestResult, batch, full_grads};

/// Per micro-batch forward and backward counters, and the gradients at the end.
struct Micro {
    fwd: Vec<CommCounts>,
    bwd: Vec<CommCounts>,
    grads: Vec<(String, Option<Vec<f64>>)>,
}

/// Two micro-batches (rows 0..4, then 4..8 of step 0) of the tiny model under
/// FSDP on `mesh` (with `replicate`d units when `shard` is off); `before(units,
/// i)` runs before micro-batch `i`.
fn micro(mesh: &'static [usize], shard: bool, before: fn(&FsdpUnits, usize)) -> Micro {
    let toks = tokens();
    launch(mesh.iter().product(), move |ctx| -> TestResult<Micro> {
        let mesh = DeviceMesh::new(ctx.into_comm(), mesh)?;
        let model = tiny_model(&mesh)?;
        let units = if shard {
            model.fully_shard(&mesh, &FsdpConfig::default())?
        } else {
            let blocks = model
                .layers
                .iter()
                .map(|b| replicate(b, &mesh, FsdpConfig::default()))
                .collect::<Result<Vec<_>, _>>()?;
            let root = replicate(&model, &mesh, FsdpConfig::default())?;
            FsdpUnits {
                root,
                blocks,
                ends: None,
            }
        };
        let mut out = Micro {
            fwd: Vec::new(),
            bwd: Vec::new(),
            grads: Vec::new(),
        };
        for i in 0..2 {
            before(&units, i);
            let x = batch(&toks, 0, 4 * i..4 * i + 4, &mesh)?;
            let s0 = mesh.stats();
            let loss = model.loss(&x)?;
            let s1 = mesh.stats();
            backward(&loss)?;
            out.fwd.push(s1 - s0);
            out.bwd.push(mesh.stats() - s1);
        }
        out.grads = full_grads(&model.parameters())?;
        Ok(out)
    })
    .unwrap()
    .swap_remove(0)
}

fn grad_diff(a: &Micro, b: &Micro) -> f64 {
    a.grads
        .iter()
        .zip(&b.grads)
        .map(|((_, x), (_, y))| {
            let (x, y) = (x.as_ref().unwrap(), y.as_ref().unwrap());
            x.iter().zip(y).map(|(p, q)| (p - q).abs()).fold(0.0, f64::max)
        })
        .fold(0.0, f64::max)
}

/// Off, the units stay gathered after the first micro-batch's backward, so the
/// second forward gathers nothing; the gradients are the default run's.
#[test]
fn reshard_after_backward_off_skips_the_next_gathers() {
    let default = micro(&[2], true, |u, i| u.root.set_requires_gradient_sync(i == 1));
    let kept = micro(&[2], true, |u, i| {
        u.root.set_requires_gradient_sync(i == 1);
        u.root.set_reshard_after_backward(i == 1);
    });
    let ag = |c: &CommCounts| c.calls(OpKind::AllGather);
    println!(
        "second forward: {} all-gathers by default, {} with reshard_after_backward off",
        ag(&default.fwd[1]),
        ag(&kept.fwd[1])
    );
    assert_eq!(ag(&default.fwd[1]), 3, "root and two blocks gather again");
    assert_eq!(ag(&kept.fwd[1]), 0, "nothing to gather");
    // The blocks still reshard after forward and gather for backward.
    assert_eq!(ag(&kept.bwd[1]), 2);
    let d = grad_diff(&default, &kept);
    assert!(d < 1e-7, "gradients differ by {d}");
}

/// HSDP with the all-reduce off for the first micro-batch: it reduce-scatters
/// within the replica only; the second all-reduces both at once; the gradients
/// are those of all-reducing every micro-batch.
#[test]
fn requires_all_reduce_off_defers_the_replica_all_reduce() {
    let default = micro(&[2, 2], true, |_, _| {});
    let deferred = micro(&[2, 2], true, |u, i| u.root.set_requires_all_reduce(i == 1));
    let (rs, ar) = (OpKind::ReduceScatter, OpKind::AllReduce);
    println!(
        "HSDP 2x2 backward all-reduces per micro-batch: default {} + {}, deferred {} + {}",
        default.bwd[0].calls(ar),
        default.bwd[1].calls(ar),
        deferred.bwd[0].calls(ar),
        deferred.bwd[1].calls(ar)
    );
    assert_eq!(default.bwd[0].calls(ar), 3);
    assert_eq!(deferred.bwd[0].calls(ar), 0);
    assert_eq!(deferred.bwd[0].calls(rs), 3);
    assert_eq!(deferred.bwd[1].calls(ar), 3);
    let d = grad_diff(&default, &deferred);
    assert!(d < 1e-6, "gradients differ by {d}");
}

/// Replicated (NO_SHARD) units with the all-reduce off for the first
/// micro-batch: no communication then, one all-reduce per unit on the second;
/// the gradients are those of all-reducing every micro-batch.
#[test]
fn requires_all_reduce_off_defers_a_replicated_units_all_reduce() {
    let default = micro(&[2], false, |_, _| {});
    let deferred = micro(&[2], false, |u, i| u.root.set_requires_all_reduce(i == 1));
    assert_eq!(default.bwd[0].calls(OpKind::AllReduce), 3);
    assert_eq!(deferred.bwd[0].total_calls(), 0);
    assert_eq!(deferred.bwd[1].calls(OpKind::AllReduce), 3);
    let d = grad_diff(&default, &deferred);
    assert!(d < 1e-6, "gradients differ by {d}");
}
