//! Model and optimizer checkpoints: a run stopped after step k and resumed from
//! its checkpoint continues bitwise as the uninterrupted run on the same mesh,
//! and within 1e-6 on another mesh (FSDP, FSDP over TP, HSDP over TP, one rank); AdamW's moments
//! and step counts and SGD's momentum come back with the parameters.

use std::collections::BTreeMap;
use std::path::PathBuf;

use tessera::autograd::nn::Module;
use tessera::autograd::optim::{AdamW, Optimizer, Sgd, SgdConfig};
use tessera::autograd::{Var, backward, load_checkpoint, save_checkpoint};
use tessera::dtensor::{DType, Placement, distribute_tensor};
use tessera::fsdp::FsdpConfig;
use tessera::models::{Transformer, TransformerConfig};
use tessera::{DeviceMesh, launch};

use crate::common::{adamw, max_abs_diff, tiny_model, tokens};
use crate::{Cleanup, scratch};

#[derive(Clone, Copy, PartialEq, Eq)]
enum Opt {
    AdamW,
    Sgd,
}

/// One leg of a run: the mesh (a last dim named `tp` means FSDP over TP), the
/// steps `from..to` of the reference batches (global batch 8), an optional
/// checkpoint to start from and one to save after the last step.
#[derive(Clone)]
struct Leg {
    mesh: &'static [usize],
    names: &'static [&'static str],
    opt: Opt,
    from: usize,
    to: usize,
    load: Option<PathBuf>,
    save: Option<PathBuf>,
    /// Build the model deferred (no storage): the checkpoint materialises it.
    deferred: bool,
}

/// Rank 0's losses of `leg`.
fn run(leg: Leg) -> Vec<f64> {
    let toks = tokens();
    launch(leg.mesh.iter().product(), move |ctx| {
        let mesh = DeviceMesh::with_names(ctx.into_comm(), leg.mesh, leg.names)?;
        let model = if leg.deferred {
            Transformer::new(TransformerConfig::TINY, &mesh, DType::F32)?
        } else {
            tiny_model(&mesh)?
        };
        let tp = leg.names.last() == Some(&"tp");
        let mut batch = vec![Placement::Shard(0); mesh.ndim()];
        if tp {
            model.parallelize(&mesh.dim("tp")?, false)?;
            batch[mesh.ndim() - 1] = Placement::Replicate;
            model.fully_shard(&mesh.slice(&leg.names[..leg.names.len() - 1])?, &FsdpConfig::default())?;
        } else {
            model.fully_shard(&mesh, &FsdpConfig::default())?;
        }
        let params = model.parameters();
        let mut opt: Box<dyn Optimizer> = match leg.opt {
            Opt::AdamW => Box::new(AdamW::new(params.clone(), adamw())?),
            Opt::Sgd => Box::new(Sgd::new(
                params.clone(),
                SgdConfig {
                    lr: 0.05,
                    momentum: 0.9,
                    ..SgdConfig::default()
                },
            )?),
        };
        if let Some(dir) = &leg.load {
            let r = load_checkpoint(dir, &params, Some(opt.as_mut()))?;
            assert_eq!(r.metadata["step"], leg.from.to_string());
        }
        let mut losses = Vec::new();
        for step in leg.from..leg.to {
            let rows = toks.narrow(0, step, 1)?.narrow(1, 0, 8)?.reshape(&[8, 33])?;
            let loss = model.loss(&Var::constant(distribute_tensor(&rows, &mesh, &batch)?))?;
            backward(&loss)?;
            opt.step()?;
            opt.zero_grad();
            losses.push(loss.value().full_tensor()?.to_f64_vec()[0]);
        }
        if let Some(dir) = &leg.save {
            let meta = BTreeMap::from([("step".to_string(), leg.to.to_string())]);
            save_checkpoint(dir, &params, Some(opt.as_ref()), meta)?;
        }
        Ok(losses)
    })
    .unwrap()
    .swap_remove(0)
}

const FSDP2: (&[usize], &[&str]) = (&[2], &["dp"]);
const ONE: (&[usize], &[&str]) = (&[1], &["dp"]);
const FSDP_TP: (&[usize], &[&str]) = (&[2, 2], &["dp", "tp"]);
const HSDP_TP: (&[usize], &[&str]) = (&[2, 2, 2], &["dp_replicate", "dp_shard", "tp"]);

fn leg(on: (&'static [usize], &'static [&'static str]), opt: Opt, from: usize, to: usize) -> Leg {
    Leg {
        mesh: on.0,
        names: on.1,
        opt,
        from,
        to,
        load: None,
        save: None,
        deferred: false,
    }
}

/// Stops after step 3 of 6 on `saved_on`, resumes on each of `resumed_on`.
fn check(
    opt: Opt,
    saved_on: (&'static [usize], &'static [&'static str]),
    resumed_on: &[(&'static [usize], &'static [&'static str])],
) {
    let dir = scratch("resume");
    let _c = Cleanup(dir.clone());
    let whole = run(leg(saved_on, opt, 0, 6));
    let first = run(Leg {
        save: Some(dir.clone()),
        ..leg(saved_on, opt, 0, 3)
    });
    assert_eq!(first, whole[..3]);
    for &on in resumed_on {
        let rest = run(Leg {
            load: Some(dir.clone()),
            ..leg(on, opt, 3, 6)
        });
        let d = max_abs_diff(&rest, &whole[3..]);
        println!(
            "saved on {:?}, resumed on {:?}: max |Δloss| = {d:.3e} over steps 4..6",
            saved_on.0, on.0
        );
        if on == saved_on {
            assert_eq!(rest, whole[3..], "same mesh: bitwise");
        } else {
            assert!(d < 1e-6, "{rest:?} vs {:?}", &whole[3..]);
        }
    }
}

#[test]
fn adamw_resumes_bitwise_and_across_meshes() {
    check(Opt::AdamW, FSDP2, &[FSDP2, FSDP_TP, HSDP_TP, ONE]);
}

#[test]
fn fsdp_tp_checkpoint_resumes_on_fsdp() {
    check(Opt::AdamW, FSDP_TP, &[FSDP_TP, FSDP2]);
}

#[test]
fn sgd_momentum_resumes_bitwise() {
    check(Opt::Sgd, FSDP2, &[FSDP2, ONE]);
}

/// Without the optimizer state the resumed run differs (the test above would
/// catch an optimizer whose state did not come back).
#[test]
fn resuming_without_optimizer_state_differs() {
    let dir = scratch("nostate");
    let _c = Cleanup(dir.clone());
    let whole = run(leg(FSDP2, Opt::AdamW, 0, 6));
    let d = dir.clone();
    let toks = tokens();
    // Save the parameters only after 3 steps.
    launch(2, move |ctx| {
        let mesh = DeviceMesh::with_names(ctx.into_comm(), &[2], &["dp"])?;
        let model = tiny_model(&mesh)?;
        model.fully_shard(&mesh, &FsdpConfig::default())?;
        let mut opt = AdamW::new(model.parameters(), adamw())?;
        for step in 0..3 {
            let rows = toks.narrow(0, step, 1)?.narrow(1, 0, 8)?.reshape(&[8, 33])?;
            let loss = model.loss(&Var::constant(distribute_tensor(&rows, &mesh, &[Placement::Shard(0)])?))?;
            backward(&loss)?;
            opt.step()?;
            opt.zero_grad();
        }
        let meta = BTreeMap::from([("step".to_string(), "3".to_string())]);
        save_checkpoint(&d, &model.parameters(), None, meta)?;
        Ok(())
    })
    .unwrap();
    let rest = run(Leg {
        load: Some(dir.clone()),
        ..leg(FSDP2, Opt::AdamW, 3, 6)
    });
    assert!(max_abs_diff(&rest, &whole[3..]) > 1e-4);
}

/// Background saves while training goes on: one after step 3, another after
/// step 5 (which first waits for the first). Each checkpoint holds the state of
/// its step, not of the steps that ran while it was written: resuming from
/// either continues bitwise as the uninterrupted run.
#[test]
fn async_saves_snapshot_their_step() {
    use tessera::autograd::state_dict::AsyncCheckpointer;
    let (a, b) = (scratch("async-a"), scratch("async-b"));
    let (_ca, _cb) = (Cleanup(a.clone()), Cleanup(b.clone()));
    let whole = run(leg(FSDP2, Opt::AdamW, 0, 6));
    let (da, db) = (a.clone(), b.clone());
    let toks = tokens();
    let reports = launch(2, move |ctx| {
        let mesh = DeviceMesh::with_names(ctx.into_comm(), &[2], &["dp"])?;
        let model = tiny_model(&mesh)?;
        model.fully_shard(&mesh, &FsdpConfig::default())?;
        let params = model.parameters();
        let mut opt = AdamW::new(params.clone(), adamw())?;
        let mut ckpt = AsyncCheckpointer::new();
        let mut waited = Vec::new();
        for step in 0..6 {
            let rows = toks.narrow(0, step, 1)?.narrow(1, 0, 8)?.reshape(&[8, 33])?;
            let loss = model.loss(&Var::constant(distribute_tensor(&rows, &mesh, &[Placement::Shard(0)])?))?;
            backward(&loss)?;
            opt.step()?;
            opt.zero_grad();
            let meta = |s: usize| BTreeMap::from([("step".to_string(), s.to_string())]);
            if step + 1 == 3 {
                waited.push(ckpt.save(&da, &params, Some(&opt), meta(3))?.is_some());
                assert!(ckpt.is_saving());
            }
            if step + 1 == 5 {
                waited.push(ckpt.save(&db, &params, Some(&opt), meta(5))?.is_some());
            }
        }
        waited.push(ckpt.wait()?.is_some());
        Ok(waited)
    })
    .unwrap();
    // The second save waited for the first; the final wait finished the second.
    assert_eq!(reports[0], [false, true, true]);
    let from_a = run(Leg {
        load: Some(a.clone()),
        ..leg(FSDP2, Opt::AdamW, 3, 6)
    });
    assert_eq!(from_a, whole[3..]);
    let from_b = run(Leg {
        load: Some(b.clone()),
        ..leg(FSDP2, Opt::AdamW, 5, 6)
    });
    assert_eq!(from_b, whole[5..]);
}

/// A deferred model (shapes, no storage, no init) resumed on another mesh:
/// the checkpoint materialises its parameters and AdamW's state alone.
#[test]
fn a_deferred_model_is_materialised_by_the_checkpoint() {
    let dir = scratch("resume-deferred");
    let _c = Cleanup(dir.clone());
    let whole = run(leg(FSDP_TP, Opt::AdamW, 0, 5));
    run(Leg {
        save: Some(dir.clone()),
        ..leg(FSDP_TP, Opt::AdamW, 0, 2)
    });
    let rest = run(Leg {
        load: Some(dir.clone()),
        deferred: true,
        ..leg(FSDP2, Opt::AdamW, 2, 5)
    });
    let d = max_abs_diff(&rest, &whole[2..]);
    assert!(d < 1e-6, "{rest:?} vs {:?}", &whole[2..]);
}
