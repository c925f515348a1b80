//! Gradient accumulation: three micro-batches with gradient sync off for the first
//! two equal one step on the concatenated batch (FSDP and replicated).

use tessera::autograd::nn::Module;
use tessera::autograd::optim::{Optimizer, Sgd, SgdConfig};
use tessera::autograd::{Param, backward};
use tessera::fsdp::FsdpConfig;
use tessera::mesh::CommCounts;
use tessera::{DeviceMesh, launch};

use crate::common::{tiny_model, tokens};
use crate::{batch, full_grads, max_named_diff, scalar};

/// What a gradient-accumulation run saw (rank 0).
pub(crate) struct Accumulated {
    /// Per step, per micro-batch: collectives of forward plus backward.
    pub counts: Vec<Vec<CommCounts>>,
    /// Per step: the full gradients before the optimizer step.
    pub grads: Vec<Vec<(String, Option<Vec<f64>>)>>,
    /// Per step: the sum of the scaled micro-batch losses.
    pub losses: Vec<f64>,
}

/// `steps` SGD steps of FSDP on `mesh_shape`, each accumulating three micro-batches
/// of `g` rows (rows `k·g..(k+1)·g` of `tokens[step]`), loss scaled by 1/3, with
/// gradient sync off for the first two. `check_mid` runs after the second micro-batch.
pub(crate) fn accumulate(mesh_shape: &'static [usize], g: usize, steps: usize, check_mid: fn(&[Param])) -> Accumulated {
    let toks = tokens();
    let world = mesh_shape.iter().product();
    let runs = launch(world, move |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), mesh_shape)?;
        let model = tiny_model(&mesh)?;
        let params = model.parameters();
        let units = model.fully_shard(&mesh, &FsdpConfig::default())?;
        let mut opt = Sgd::new(params.clone(), sgd())?;
        let mut out = Accumulated {
            counts: Vec::new(),
            grads: Vec::new(),
            losses: Vec::new(),
        };
        for step in 0..steps {
            let mut counts = Vec::new();
            let mut total = 0.0;
            for k in 0..3 {
                units.root.set_requires_gradient_sync(k == 2);
                let rows = batch(&toks, step, k * g..(k + 1) * g, &mesh)?;
                let before = mesh.stats();
                let loss = model.loss(&rows)?.mul_scalar(1.0 / 3.0)?;
                backward(&loss)?;
                counts.push(mesh.stats() - before);
                total += scalar(&loss)?;
                if k == 1 {
                    check_mid(&params);
                }
            }
            for p in &params {
                // Reduced once, into the parameters' own (sharded) placements.
                let g = p.grad().unwrap_or_else(|| panic!("{} has no gradient", p.name()));
                assert_eq!(g.placements(), p.value()?.placements(), "{}", p.name());
            }
            out.counts.push(counts);
            out.grads.push(full_grads(&params)?);
            out.losses.push(total);
            opt.step()?;
            opt.zero_grad();
        }
        Ok(out)
    })
    .unwrap();
    runs.into_iter().next().unwrap()
}

fn sgd() -> SgdConfig {
    SgdConfig {
        lr: 0.5,
        momentum: 0.9,
        ..SgdConfig::default()
    }
}

/// `steps` SGD steps on the whole `3g`-row batches, with FSDP or replicated.
fn one_big_batch(mesh_shape: &'static [usize], g: usize, steps: usize, fsdp: bool) -> Accumulated {
    let toks = tokens();
    let world = mesh_shape.iter().product();
    let runs = launch(world, move |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), mesh_shape)?;
        let model = tiny_model(&mesh)?;
        let params = model.parameters();
        if fsdp {
            model.fully_shard(&mesh, &FsdpConfig::default())?;
        }
        let mut opt = Sgd::new(params.clone(), sgd())?;
        let mut out = Accumulated {
            counts: Vec::new(),
            grads: Vec::new(),
            losses: Vec::new(),
        };
        for step in 0..steps {
            let loss = model.loss(&batch(&toks, step, 0..3 * g, &mesh)?)?;
            backward(&loss)?;
            out.grads.push(full_grads(&params)?);
            out.losses.push(scalar(&loss)?);
            opt.step()?;
            opt.zero_grad();
        }
        Ok(out)
    })
    .unwrap();
    runs.into_iter().next().unwrap()
}

/// The largest gradient difference of one step (both must have every gradient).
fn grad_diff(a: &[(String, Option<Vec<f64>>)], b: &[(String, Option<Vec<f64>>)]) -> f64 {
    let unwrap = |v: &[(String, Option<Vec<f64>>)]| -> Vec<(String, Vec<f64>)> {
        v.iter()
            .map(|(n, g)| (n.clone(), g.clone().unwrap_or_else(|| panic!("{n} has no gradient"))))
            .collect()
    };
    max_named_diff(&unwrap(a), &unwrap(b))
}

fn no_grads_yet(params: &[Param]) {
    // Sync off: the gradients wait unsharded inside the units.
    for p in params {
        assert!(
            p.grad().is_none(),
            "{} has a gradient before the synced micro-batch",
            p.name()
        );
    }
}

#[test]
fn equals_one_step_on_the_concatenated_batch() {
    let steps = 3;
    let acc = accumulate(&[2], 4, steps, no_grads_yet);
    let big = one_big_batch(&[2], 4, steps, true);
    let replicated = one_big_batch(&[2], 4, steps, false);
    for s in 0..steps {
        let d = grad_diff(&acc.grads[s], &big.grads[s]);
        let d_rep = grad_diff(&big.grads[s], &replicated.grads[s]);
        let scale = big.grads[s]
            .iter()
            .flat_map(|(_, g)| g.iter().flatten())
            .fold(0.0f64, |m, x| m.max(x.abs()));
        println!(
            "accumulation step {s}: max |Δgrad| accumulated vs one batch {d:.3e}, FSDP vs replicated \
             {d_rep:.3e} (max |grad| {scale:.3e}); loss {} vs {}",
            acc.losses[s], big.losses[s]
        );
        assert!(d <= 1e-6, "step {s}: accumulated gradients differ by {d}");
        assert!(
            d_rep <= 1e-6,
            "step {s}: FSDP gradients differ from replicated by {d_rep}"
        );
        assert!((acc.losses[s] - big.losses[s]).abs() <= 1e-5);
    }
}
