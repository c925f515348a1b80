//! `tessera-fsdp` end to end: FSDP, HSDP and DDP-shaped meshes train the tiny
//! reference Transformer exactly as PyTorch's FSDP2 does (loss at every step against
//! `tests/data/tiny_reference.json`), with the collectives per step FSDP2 issues, the
//! memory it promises, and errors for configurations it cannot serve.
//!
//! Every distributed result is compared with a reference: PyTorch's losses, or the
//! same model trained replicated (no FSDP) on the same ranks.
//!
//! Organised by topic, one file each:
//!
//! - `parity.rs`: FSDP W2/W4, HSDP 2×2 and bf16 mixed precision against PyTorch's losses;
//! - `counts.rs`: the collectives (calls and bytes) of every step's forward and backward;
//! - `accumulation.rs`: gradient accumulation with gradient sync off, against one step
//!   on the concatenated batch;
//! - `uneven.rs`: parameters whose rows do not divide by the ranks (short and empty
//!   shards) against the replicated model;
//! - `deferred.rs`: deferred models materialised shard by shard (bitwise equal to the
//!   whole-tensor init on every layout, init memory within the shards, replica errors);
//! - `ddp.rs`: a one-rank shard dim (`[4, 1]`), which only all-reduces;
//! - `memory.rs`: the peak bytes of a training step against a bound, and what
//!   `fully_shard` frees;
//! - `resharding.rs`: when units are unsharded, manual `unshard`/`reshard`, and a
//!   freed parameter that cannot be read;
//! - `errors.rs`: configurations `fully_shard` refuses, parameters changed or frozen,
//!   and a failed forward;
//! - `prefetch.rs`: explicit forward and backward prefetch;
//! - `overlap.rs`: each unit's collectives counted and timed (`comm_overlap`);
//! - `usage.rs`: beyond one call per unit: eval forwards, a unit called twice,
//!   activation checkpointing;
//! - `knobs.rs`: `set_reshard_after_backward`, `set_requires_all_reduce`.
//! - `state_dict.rs`: a full state dict saved on one mesh and loaded onto others.
//! - `wrapping.rs`: `replicate` (NO_SHARD) units, `ignored_params`, `auto_wrap`.
//! - `tp.rs`: FSDP over tensor parallelism on 2-D and 3-D meshes (parity, placements,
//!   counts and bytes per unit, accumulation, clipping, memory, errors).
//!
//! This file holds what they share: the batches, the comparisons, the collective
//! counts, and `train`, which runs a `Job` of the tiny reference model and returns
//! rank 0's `Run`.
//!
//! Run with `cargo test --test fsdp -- --nocapture` to see the figures (parity
//! differences, collective counts, memory bound and peaks).

#[path = "../common/mod.rs"]
mod common;

mod accumulation;
mod counts;
mod ddp;
mod deferred;
mod errors;
mod knobs;
mod memory;
mod overlap;
mod parity;
mod prefetch;
mod resharding;
mod state_dict;
mod tp;
mod uneven;
mod usage;
mod wrapping;

use std::ops::Range;

pub(crate) use common::max_abs_diff;
use common::{adamw, tiny_model, tokens};
use tessera::autograd::nn::Module;
use tessera::autograd::optim::{AdamW, Optimizer};
use tessera::autograd::{Param, Var, backward};
use tessera::dtensor::{Placement, Tensor, distribute_tensor};
use tessera::fsdp::{FsdpConfig, MixedPrecisionPolicy};
use tessera::mesh::{CommCounts, OpKind};
use tessera::models::{CausalLm, FsdpUnits, UnitLayout};
use tessera::{BoxError, Communicator, DeviceMesh, launch};

/// What the helpers and the ranks' closures return.
pub type TestResult<T> = Result<T, BoxError>;

/// Rows `rows` of step `step`, `[rows.len(), 33]`, split over every mesh dim (`Shard(0)`).
pub fn batch(toks: &Tensor, step: usize, rows: Range<usize>, mesh: &DeviceMesh) -> TestResult<Var> {
    let n = rows.len();
    let t = toks.narrow(0, step, 1)?.narrow(1, rows.start, n)?.reshape(&[n, 33])?;
    Ok(Var::constant(distribute_tensor(
        &t,
        mesh,
        &vec![Placement::Shard(0); mesh.ndim()],
    )?))
}

/// The value of the scalar `v` (its full tensor's first element).
pub fn scalar(v: &Var) -> TestResult<f64> {
    Ok(v.value().full_tensor()?.to_f64_vec()[0])
}

/// A mesh of `shape` over the rank's world communicator (named when `names` is given).
pub fn mesh_of(comm: Box<dyn Communicator>, shape: &[usize], names: Option<&[&str]>) -> TestResult<DeviceMesh> {
    Ok(match names {
        Some(n) => DeviceMesh::with_names(comm, shape, n)?,
        None => DeviceMesh::new(comm, shape)?,
    })
}

/// (all_gather, reduce_scatter, all_reduce, every other data-moving collective) calls.
pub fn calls(c: &CommCounts) -> (u64, u64, u64, u64) {
    let ag = c.calls(OpKind::AllGather);
    let rs = c.calls(OpKind::ReduceScatter);
    let ar = c.calls(OpKind::AllReduce);
    (ag, rs, ar, c.total_calls() - ag - rs - ar)
}

/// Full (replicated) values of `params`' gradients, by name; `None` for no gradient.
pub fn full_grads(params: &[Param]) -> TestResult<Vec<(String, Option<Vec<f64>>)>> {
    params
        .iter()
        .map(|p| {
            let g = match p.grad() {
                Some(g) => Some(g.full_tensor()?.to_f64_vec()),
                None => None,
            };
            Ok((p.name().to_string(), g))
        })
        .collect()
}

/// Full values of `params`, by name.
pub fn full_values(params: &[Param]) -> TestResult<Vec<(String, Vec<f64>)>> {
    params
        .iter()
        .map(|p| Ok((p.name(), p.value()?.full_tensor()?.to_f64_vec())))
        .collect()
}

/// The largest difference between two named lists of values (names must agree).
pub fn max_named_diff(a: &[(String, Vec<f64>)], b: &[(String, Vec<f64>)]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|((na, va), (nb, vb))| {
            assert_eq!(na, nb);
            max_abs_diff(va, vb)
        })
        .fold(0.0, f64::max)
}

/// The `Job::setup` that does nothing.
pub fn no_setup(_: &FsdpUnits) {}

/// One training run of the tiny reference model.
#[derive(Clone)]
pub struct Job {
    /// Shape of the device mesh.
    pub mesh: &'static [usize],
    /// Names of the mesh dims (`None`: the defaults).
    pub names: Option<&'static [&'static str]>,
    /// Global batch (rows of `tokens[step]`).
    pub g: usize,
    /// Training steps.
    pub steps: usize,
    /// `None`: no FSDP (replicated parameters, data parallel through DTensor).
    pub fsdp: Option<FsdpConfig>,
    /// Runs on the units after `fully_shard`.
    pub setup: fn(&FsdpUnits),
    /// How the model is grouped into units.
    pub units: UnitLayout,
}

impl Job {
    /// A run with FSDP configured by `cfg` on a mesh of this shape and no setup.
    pub fn fsdp(mesh: &'static [usize], g: usize, steps: usize, cfg: FsdpConfig) -> Job {
        Job {
            mesh,
            names: None,
            g,
            steps,
            fsdp: Some(cfg),
            setup: no_setup,
            units: UnitLayout::Blocks,
        }
    }
}

/// What a rank saw.
#[derive(Debug, PartialEq)]
pub struct Run {
    /// The loss of each step.
    pub losses: Vec<f64>,
    /// Collectives of each step's `model.loss` (forward).
    pub fwd: Vec<CommCounts>,
    /// Collectives of each step's `backward`.
    pub bwd: Vec<CommCounts>,
    /// Per unit (blocks, the ends when split, then root): `sharded_bytes()`.
    pub sharded_bytes: Vec<usize>,
    /// Per unit: `placements()`.
    pub placements: Vec<Vec<Placement>>,
}

/// Trains `job` with the reference AdamW; checks every rank saw the same and
/// returns rank 0's run.
pub fn train(job: &Job) -> Run {
    let toks = tokens();
    let world = job.mesh.iter().product();
    let job = job.clone();
    let runs = launch(world, move |ctx| {
        let mesh = mesh_of(ctx.into_comm(), job.mesh, job.names)?;
        let model = tiny_model(&mesh)?;
        let params = model.parameters();
        let mut run = Run {
            losses: Vec::new(),
            fwd: Vec::new(),
            bwd: Vec::new(),
            sharded_bytes: Vec::new(),
            placements: Vec::new(),
        };
        if let Some(cfg) = &job.fsdp {
            let units = model.fully_shard_with(&mesh, cfg, job.units)?;
            (job.setup)(&units);
            let ends = units.ends.iter().flatten();
            for u in units.blocks.iter().chain(ends).chain([&units.root]) {
                run.sharded_bytes.push(u.sharded_bytes());
                run.placements.push(u.placements().to_vec());
            }
        }
        let mut opt = AdamW::new(params, adamw())?;
        for step in 0..job.steps {
            let rows = batch(&toks, step, 0..job.g, &mesh)?;
            let before = mesh.stats();
            let loss = model.loss(&rows)?;
            let mid = mesh.stats();
            backward(&loss)?;
            let after = mesh.stats();
            run.fwd.push(mid - before);
            run.bwd.push(after - mid);
            run.losses.push(scalar(&loss)?);
            opt.step()?;
            opt.zero_grad();
        }
        Ok(run)
    })
    .unwrap();
    for (r, run) in runs.iter().enumerate().skip(1) {
        assert_eq!(run.losses, runs[0].losses, "rank {r} saw other losses");
        assert_eq!(run.fwd, runs[0].fwd, "rank {r} issued other forward collectives");
        assert_eq!(run.bwd, runs[0].bwd, "rank {r} issued other backward collectives");
    }
    runs.into_iter().next().unwrap()
}

/// The default config with `reshard_after_forward: Some(on)`.
pub fn reshard(on: bool) -> FsdpConfig {
    FsdpConfig {
        reshard_after_forward: Some(on),
        ..FsdpConfig::default()
    }
}

/// The default config with bf16 mixed precision (`MixedPrecisionPolicy::bf16()`).
pub fn bf16() -> FsdpConfig {
    FsdpConfig {
        mp_policy: MixedPrecisionPolicy::bf16(),
        ..FsdpConfig::default()
    }
}
