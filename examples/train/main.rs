//! The main job: trains a reference model (`--model gpt`, the GPT-style
//! `Transformer`, by default; `--model llama`, the LLaMA-style `Llama`) on in-process ranks (or, built
//! with `--features mpi` and started by `mpirun -n N`, one rank per process) on the
//! reference data generator, printing progress and a summary.
//!
//! ```text
//! cargo run --release --example train -- [--world-size 4 | --mesh RxS] [--tp T [--sequence-parallel]]
//!     [--steps 50] [--batch 2] [--dim 64 --n-layers 2 --n-heads 4 --vocab 256 --seq 32] [--lr 1e-3]
//!     [--model gpt | --model llama [--n-kv-heads K] [--ffn-hidden H] [--rope-theta F]]
//!     [--mixed-precision bf16] [--no-reshard]
//!     [--init PATH | --seed 0] [--tokens PATH] [--data-seed 1234] [--losses-out PATH]
//! ```
//!
//! The model is built deferred (`Transformer::new`, `Llama::new`: shapes, no storage), planned
//! and sharded, and only then materialised (`Materializer`): each rank allocates
//! its own shards and fills them from `--init PATH` (a safetensors file, reading
//! only this rank's bytes) or from `--seed` (the counter-based generator: the
//! same parameters bit for bit on every mesh). No rank ever holds the whole model.
//!
//! Each block of the model is an FSDP unit and the root takes the rest
//! (`CausalLm::fully_shard`): parameters, gradients and AdamW states are sharded
//! over the ranks, each unit's parameters are all-gathered for its forward and
//! backward, and its gradients reduce-scattered. `--mesh RxS` trains HSDP on an
//! `R × S` mesh (replicate over R, shard over S). The batch (`--batch` rows per
//! rank) is split over all ranks; every step is the single-device step on the
//! global batch.
//!
//! `--tp T` adds tensor parallelism under FSDP: a `(dp, tp)` mesh with
//! `dp = world / T`, the model's plan (`Transformer::tp_plan`, `Llama::tp_plan`;
//! with `--sequence-parallel`, their `tp_plan_sequence_parallel`) over `tp`,
//! then FSDP over `dp` (`fully_shard` on `mesh.dim("dp")`); with `--mesh RxS`,
//! a `(dp_replicate, dp_shard, tp)` mesh of `R·S·T` ranks and HSDP over the first
//! two dims. `--batch` stays rows per data-parallel rank: `--world-size 2 --tp 2
//! --batch 8` trains every rank on the same 8 rows (pure TP, FSDP over one rank).
//!
//! `--checkpoint-dir DIR --checkpoint-every N` saves a sharded checkpoint of the
//! model and AdamW every N steps (`DIR/step_000010/`, and `DIR/latest` naming the
//! newest); `--resume DIR` (such a directory, or one checkpoint in it, saved on
//! any mesh, TP or not) loads one and goes on: `--steps` counts the whole run,
//! so a run resumed after step k trains steps k+1..N on the batches the
//! uninterrupted run would use, and `--losses-out` lists those N−k losses.
//! `--async-save` writes them in the background while training goes on (one at
//! a time; `latest` moves once a checkpoint is complete); `--keep-checkpoints K`
//! removes all but the newest K complete ones (directories with a valid
//! `index.json`; a save's temporaries never count, and those of a save killed
//! mid-write are removed by the next save or resume). `--save-full PATH`
//! writes the consolidated safetensors file at the end.
//!
//! Under `mpirun` the world size defaults to the number of processes, and only
//! rank 0 prints and writes `--losses-out`.

#[path = "../common/mod.rs"]
mod common;

mod args;
mod auto;
mod checkpoints;
mod metrics;
mod report;

use std::time::Instant;

use tessera::autograd::nn::{MaterializeReport, Materializer};
use tessera::autograd::optim::clip_grad_norm;
use tessera::autograd::optim::{AdamW, AdamWConfig, LrScheduler, Optimizer, Schedule};
use tessera::autograd::{
    Param, Progress, Var, backward, load_checkpoint, load_states, read_safetensors, save_state_dict_full,
};
use tessera::dtensor::{Layout, Placement, Tensor, distribute_tensor_from};
use tessera::fsdp::{FsdpConfig, MixedPrecisionPolicy};
use tessera::mesh::observe;
use tessera::models::{CausalLm, Llama, Transformer};
use tessera::plan::{Machine, StepPlan, plan_step};
use tessera::tensor::{memory, profile};
use tessera::{BoxError, CommunicatorExt, DType, DeviceMesh, RankCtx, is_lead_process, launch};

use args::{Arch, Args, USAGE, parse, rows};
use checkpoints::{Checkpoints, PROGRESS, SCHEDULE, resume_dir};
use metrics::{MetricsWriter, StepMetrics};
use report::{Observed, RankReport, StepProfile, banner, progress, summarize};

fn main() {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("train: {e}\n{USAGE}");
            std::process::exit(2);
        }
    };
    if let Err(e) = run(&args) {
        eprintln!("train: {e}");
        std::process::exit(1);
    }
}

fn run(args: &Args) -> Result<(), BoxError> {
    let lead = is_lead_process();
    let chosen;
    // The constants step times are estimated from: saved, or measured once
    // for every plan of this run.
    let machine = if args.plan || args.auto || (!args.device.is_cuda() && args.resume.is_none()) {
        Some(machine(args)?)
    } else {
        None
    };
    let args = if args.auto {
        chosen = auto::choose(args, machine.as_ref(), lead)?;
        if args.plan {
            return Ok(());
        }
        if lead {
            println!("running {}", auto::label(&chosen));
        }
        &chosen
    } else {
        args
    };
    let tokens = read_tokens(args)?;
    if lead {
        println!("{}", banner(args));
    }
    // Measured before the ranks start, on a quiet machine, by the process that
    // prints the summary and holds rank 0 (which writes --metrics-out).
    let peak = if lead { metrics::machine_peak_flops() } else { None };
    // The step planned on meta tensors: the whole job with `--plan`, else
    // (on the CPU, from scratch) a prediction to print against the run's.
    let plans = if let Some(machine) = machine {
        let plans = launch(args.world, {
            let (args, machine) = (args.clone(), machine.clone());
            move |ctx| plan_rank(ctx, &args, &machine)
        })?;
        if args.plan {
            if lead {
                report::print_plan(args, &plans, &machine)?;
            }
            return Ok(());
        }
        Some(plans)
    } else {
        None
    };
    let reports = launch(args.world, {
        let args = args.clone();
        move |ctx| train_rank(ctx, &args, tokens.as_ref(), peak.map(|p| p.0))
    })?;
    if lead {
        summarize(args, &reports[0], peak)?;
        if let Some(plans) = &plans {
            report::compare_plan(args, plans, &reports[0]);
        }
    }
    report::write_observed(args, &reports, lead)?;
    Ok(())
}

/// The `tokens` tensor of `--tokens`, if given.
fn read_tokens(args: &Args) -> Result<Option<Tensor>, BoxError> {
    let Some(p) = &args.tokens else {
        return Ok(None);
    };
    let (_, t) = read_safetensors(p)?
        .into_iter()
        .find(|(n, _)| n == "tokens")
        .ok_or_else(|| format!("{}: no tensor named \"tokens\"", p.display()))?;
    Ok(Some(t))
}

/// One rank's model, optimizer and mesh, ready to train.
struct Job<M> {
    mesh: DeviceMesh,
    model: M,
    params: Vec<Param>,
    opt: AdamW,
    /// The learning-rate schedule, stepped with the optimizer.
    sched: LrScheduler,
    /// How a batch of token rows is placed on the mesh.
    batch_placements: Vec<Placement>,
    /// What materialising the model took on this rank.
    init: MaterializeReport,
}

/// Builds the mesh and the deferred model, applies tensor parallelism (printing
/// the plan on the lead rank) and FSDP, materialises this rank's shards from
/// `--init` or `--seed`, and makes the optimizer.
fn setup<M: CausalLm>(
    ctx: RankCtx,
    args: &Args,
    build: fn(&Args, &DeviceMesh) -> tessera::autograd::Result<M>,
    meta: bool,
) -> Result<Job<M>, BoxError> {
    let rank = ctx.rank();
    let names: &[&str] = match (args.tp > 0, args.mesh.len()) {
        (true, 3) => &["dp_replicate", "dp_shard", "tp"],
        (true, _) => &["dp", "tp"],
        (false, 2) => &["dp_replicate", "dp_shard"],
        (false, _) => &["dp"],
    };
    let mesh = DeviceMesh::with_names(ctx.into_comm(), &args.mesh, names)?.on_device(args.device);
    let model = build(args, &mesh)?;
    let params = model.parameters();
    model.set_activation_checkpointing(args.ac)?;
    let fsdp = FsdpConfig {
        reshard_after_forward: args.no_reshard.then_some(false),
        reshard_after_forward_to: args.reshard_to,
        mp_policy: if args.bf16 {
            MixedPrecisionPolicy::bf16()
        } else {
            MixedPrecisionPolicy::default()
        },
        ..FsdpConfig::default()
    };
    let batch_placements = if args.tp > 0 {
        let applied = model.parallelize(&mesh.dim("tp")?, args.sequence_parallel)?;
        // (Not for each layout `--auto` plans.)
        if rank == 0 && is_lead_process() && !(meta && args.auto) {
            println!("plan:");
            for a in &applied {
                println!("  {:<28} {}", a.fqn, a.style);
            }
        }
        let dp = mesh.slice(&names[..names.len() - 1])?;
        model.fully_shard_with(&dp, &fsdp, args.units)?;
        let mut p = vec![Placement::Shard(0); args.mesh.len()];
        p[args.mesh.len() - 1] = Placement::Replicate;
        p
    } else {
        model.fully_shard_with(&mesh, &fsdp, args.units)?;
        vec![Placement::Shard(0); args.mesh.len()]
    };
    let init = match &args.init {
        _ if meta => Materializer::on_meta(),
        Some(path) => Materializer::from_safetensors(path),
        None => model.materializer(args.seed),
    }
    .materialize(&model)?;
    let adamw = AdamWConfig {
        lr: args.lr,
        betas: (0.9, 0.95),
        eps: 1e-8,
        weight_decay: 0.1,
    };
    let mut opt = AdamW::new(params.clone(), adamw)?;
    let sched = LrScheduler::new(schedule(args)?, &mut opt)?;
    Ok(Job {
        mesh,
        model,
        params,
        opt,
        sched,
        batch_placements,
        init,
    })
}

/// The `--lr-schedule` over the run's `--steps`.
fn schedule(args: &Args) -> Result<Schedule, BoxError> {
    let (warmup, total) = (args.warmup_steps as u64, args.steps as u64);
    Ok(match args.lr_schedule.as_str() {
        "cosine" => Schedule::warmup_cosine(warmup, total, 0.0)?,
        "wsd" => Schedule::warmup_stable_decay(warmup, total.div_ceil(10), total, 0.0)?,
        _ if warmup > 0 => return Err("--warmup-steps needs --lr-schedule cosine or wsd".into()),
        _ => Schedule::Constant,
    })
}

/// Loads the `--resume` checkpoint into the model and optimizer, recording the
/// step it is from and what reading it cost.
fn resume<M>(args: &Args, path: &std::path::Path, job: &mut Job<M>, report: &mut RankReport) -> Result<(), BoxError> {
    let t = Instant::now();
    let dir = resume_dir(path)?;
    let r = load_checkpoint(&dir, &job.params, Some(&mut job.opt))?;
    report.resume_s = t.elapsed().as_secs_f64();
    // The run's progress and its schedule, saved with the tensors; a
    // checkpoint written elsewhere has none, and `--resume-step` names its step.
    let mut progress = Progress::default();
    match args.resume_step {
        Some(step) => {
            progress.step = step as u64;
            job.sched.set_steps(progress.step);
        }
        None => load_states(
            &r.metadata,
            &mut [(PROGRESS, &mut progress), (SCHEDULE, &mut job.sched)],
        )
        .map_err(|e| {
            format!(
                "{}: {e} (a checkpoint written elsewhere: give its step with --resume-step)",
                dir.display()
            )
        })?,
    }
    job.sched.apply(&mut job.opt)?;
    report.first_step = usize::try_from(progress.step)?;
    report.resume_bytes = r.bytes_read;
    if report.first_step >= args.steps {
        return Err(format!(
            "--resume: the checkpoint is from step {}, --steps is {}: nothing left to train",
            report.first_step, args.steps
        )
        .into());
    }
    Ok(())
}

/// What a step returns: its loss, the learning rate its update used, and with
/// `--metrics-out` the gradients' global norm before the update.
struct StepOut {
    loss: f64,
    lr: f64,
    grad_norm: Option<f64>,
    /// Seconds until the step was queued, before its loss was read (on a GPU,
    /// the host's share of the step when the device keeps up).
    queued_s: f64,
}

/// One training step on the rows of `step`: forward, backward, the optimizer's
/// update.
fn train_step<M: CausalLm>(
    args: &Args,
    job: &mut Job<M>,
    tokens: Option<&Tensor>,
    step: usize,
) -> Result<StepOut, BoxError> {
    let start = Instant::now();
    // Every rank builds the same global rows of the step (seeded by the step):
    // each keeps its piece, with no hash exchange per step.
    let x = distribute_tensor_from(&rows(args, tokens, step)?, &job.mesh, &job.batch_placements, None)?;
    let loss = job.model.loss(&Var::constant(x))?;
    backward(&loss)?;
    // Measured only (max_norm infinite: the gradients are left as they are).
    let grad_norm = match args.metrics_out {
        Some(_) => Some(clip_grad_norm(&job.params, f64::INFINITY)?),
        None => None,
    };
    let lr = job.opt.lr();
    job.opt.step()?;
    job.sched.step(&mut job.opt)?;
    job.opt.zero_grad();
    // Read once the whole step is queued: on a GPU, reading waits for the
    // device, and reading before backward would keep the host from queueing
    // backward's kernels while forward's run.
    let queued_s = start.elapsed().as_secs_f64();
    let value = loss.value().full_tensor()?.to_f64_vec()[0];
    Ok(StepOut {
        loss: value,
        lr,
        grad_norm,
        queued_s,
    })
}

/// The machine constants of `--machine PATH` (calibrated and saved there when
/// the file does not exist yet), else calibrated now: every rank of the world
/// measuring at once on a flat mesh, rank 0's constants kept.
fn machine(args: &Args) -> Result<Machine, BoxError> {
    if let Some(path) = args.machine.as_ref().filter(|p| p.exists()) {
        let m = Machine::load(path)?;
        if m.ranks != args.world {
            return Err(format!(
                "--machine {}: calibrated with {} ranks sharing the machine, this job has {}; \
                 give another path (it is calibrated and saved there) or delete the file",
                path.display(),
                m.ranks,
                args.world
            )
            .into());
        }
        return Ok(m);
    }
    let world = args.world;
    let m = launch(world, move |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), &[world])?;
        Machine::calibrate(&mesh)
    })?
    .swap_remove(0);
    let Some(path) = &args.machine else {
        return Ok(m);
    };
    if is_lead_process() {
        m.save(path)?;
        println!("calibrated the machine for {world} ranks; saved to {}", path.display());
    }
    // The constants as saved (rounded), so that this run plans as later ones will.
    Machine::from_json(&m.to_json())
}

/// One rank's planned step, and every rank's planned peak and step time.
pub(crate) struct Planned {
    /// This rank's plan.
    pub(crate) plan: StepPlan,
    /// Every rank's planned peak bytes and estimated step time, in rank order
    /// (gathered, so that every process of an MPI job ranks layouts alike).
    pub(crate) ranks: Vec<(usize, f64)>,
}

impl Planned {
    /// The largest planned peak of any rank.
    pub(crate) fn peak(&self) -> usize {
        self.ranks.iter().map(|r| r.0).max().unwrap_or(0)
    }

    /// The slowest rank's estimated step time.
    pub(crate) fn step_time_s(&self) -> f64 {
        self.ranks.iter().map(|r| r.1).fold(0.0, f64::max)
    }
}

/// One rank's planned step (`--plan`): the job set up as for training, on
/// meta tensors; its step time estimated on `machine`.
pub(crate) fn plan_rank(ctx: RankCtx, args: &Args, machine: &Machine) -> Result<Planned, BoxError> {
    fn plan<M: CausalLm>(
        ctx: RankCtx,
        args: &Args,
        machine: &Machine,
        build: fn(&Args, &DeviceMesh) -> tessera::autograd::Result<M>,
    ) -> Result<Planned, BoxError> {
        let mut job = setup(ctx, args, build, true)?;
        let shape = [args.global_batch(), args.model.seq + 1];
        let batch = Layout::new(&args.mesh, &job.batch_placements, &shape, DType::I64)?;
        let Job { mesh, model, opt, .. } = &mut job;
        let plan = plan_step(mesh, opt, &batch, |rows| model.loss(rows))?;
        let mine = [plan.peak_bytes() as f64, plan.step_time_s(machine)];
        let all = mesh.comm().all_gather_vec(&mine)?;
        let ranks = all.chunks(2).map(|r| (r[0] as usize, r[1])).collect();
        Ok(Planned { plan, ranks })
    }
    match args.arch {
        Arch::Gpt => plan(ctx, args, machine, gpt),
        Arch::Llama => plan(ctx, args, machine, llama),
    }
}

/// The deferred GPT model of `--model gpt` (the default) on `mesh`.
fn gpt(args: &Args, mesh: &DeviceMesh) -> tessera::autograd::Result<Transformer> {
    Transformer::new(args.model, mesh, DType::F32)
}

/// The deferred LLaMA-style model of `--model llama` on `mesh`.
fn llama(args: &Args, mesh: &DeviceMesh) -> tessera::autograd::Result<Llama> {
    Llama::new(args.llama(), mesh, DType::F32)
}

/// What every rank runs: setup, resumption, the steps with their checkpoints,
/// the final saves, and the report (with every rank's peak memory).
fn train_rank(
    ctx: RankCtx,
    args: &Args,
    tokens: Option<&Tensor>,
    peak_flops: Option<f64>,
) -> Result<RankReport, BoxError> {
    match args.arch {
        Arch::Gpt => train_model(ctx, args, tokens, peak_flops, gpt),
        Arch::Llama => train_model(ctx, args, tokens, peak_flops, llama),
    }
}

/// [`train_rank`] for the model `build` makes.
fn train_model<M: CausalLm>(
    ctx: RankCtx,
    args: &Args,
    tokens: Option<&Tensor>,
    peak_flops: Option<f64>,
    build: fn(&Args, &DeviceMesh) -> tessera::autograd::Result<M>,
) -> Result<RankReport, BoxError> {
    let rank = ctx.rank();
    let mut job = setup(ctx, args, build, false)?;
    let mut report = RankReport::default();
    if let Some(path) = &args.resume {
        resume(args, path, &mut job, &mut report)?;
    }
    let mut checkpoints = Checkpoints::default();
    memory::reset_peak();
    memory::reset_device_peak();
    let start = Instant::now();
    let tokens_per_step = (args.global_batch() * args.model.seq) as f64;
    let mut writer = match &args.metrics_out {
        Some(path) if rank == 0 => Some(MetricsWriter::create(path, args, peak_flops)?),
        _ => None,
    };
    // With metrics, the tracker's peak is reset every step; the run's is kept here.
    let (mut run_peak, mut run_peak_reserved) = (0, 0);
    // `--profile`: rank 0's ops over the steps after the first two.
    let profiled_from = (report.first_step + 2).min(args.steps.saturating_sub(1));
    if args.profile && rank == 0 {
        profile::enable(true);
        profile::sync_device(args.device.is_cuda());
    }
    // `--comm-report`, `--trace`: this rank's events over the steps, and its
    // collective counters over the same steps.
    let counters_before = job.mesh.stats();
    let op_log = match (&args.op_log, args.op_log_values) {
        (None, _) => observe::OpLog::Off,
        (Some(_), false) => observe::OpLog::Ops,
        (Some(_), true) => observe::OpLog::Values,
    };
    let recording = (args.comm_report.is_some() || args.trace.is_some() || args.op_log.is_some())
        .then(|| observe::record_ops(op_log));
    for step in report.first_step..args.steps {
        let _step = observe::span(observe::What::Step(step + 1));
        if args.profile && rank == 0 && step == profiled_from {
            profile::take();
            profile::take_ops();
        }
        let t = Instant::now();
        let waits_before = device_waits(args)?;
        let faults_before = (rank == 0).then(common::minor_faults).flatten();
        let out = train_step(args, &mut job, tokens, step)?;
        if let (Some(before), Some(after)) = (faults_before, common::minor_faults()) {
            report.minor_faults.push(after.saturating_sub(before));
        }
        if let Some(before) = waits_before {
            report
                .device_host_waits
                .push(device_waits(args)?.unwrap_or(before) - before);
            report.queued_s.push(out.queued_s);
        }
        let value = out.loss;
        report.losses.push(value);
        report.step_time_s.push(t.elapsed().as_secs_f64());
        if args.metrics_out.is_some() {
            let now = memory::stats();
            run_peak = run_peak.max(now.peak_bytes);
            run_peak_reserved = run_peak_reserved.max(now.peak_reserved_bytes);
            memory::reset_peak();
            // Every rank's bytes (a collective: every rank takes part).
            let all = job
                .mesh
                .comm()
                .all_gather_vec(&[now.current_bytes as i64, now.peak_bytes as i64])?;
            let column = |i: usize| all.chunks(2).map(|c| c[i] as usize).collect();
            if let Some(w) = &mut writer {
                w.write(&StepMetrics {
                    step: step + 1,
                    loss: value,
                    lr: out.lr,
                    grad_norm: out.grad_norm.unwrap_or(f64::NAN),
                    step_time_s: t.elapsed().as_secs_f64(),
                    bytes_in_use: column(0),
                    peak_bytes: column(1),
                })?;
            }
        }
        if let Some(stats) = device_memory(args)? {
            report.device_reserved_bytes.push(stats.0);
        }
        checkpoints.after_step(args, &job, step, &mut report)?;
        if rank == 0 {
            let done = step + 1 - report.first_step;
            progress(
                step + 1,
                args.steps,
                value,
                done as f64 * tokens_per_step / start.elapsed().as_secs_f64(),
            );
        }
    }
    report.comm = Some(job.mesh.stats() - counters_before);
    if let Some(rec) = recording {
        report.observed = Some(Observed {
            rank,
            events: rec.finish(),
            counters: job.mesh.stats() - counters_before,
        });
    }
    if args.profile && rank == 0 {
        let steps = args.steps - profiled_from;
        report.profile = Some(StepProfile {
            steps,
            step_s: report.step_time_s[report.step_time_s.len() - steps..].iter().sum(),
            kinds: profile::take(),
            ops: profile::take_ops(),
        });
        profile::enable(false);
    }
    checkpoints.finish(args, &job, &mut report)?;
    if let Some(path) = &args.save_full {
        save_state_dict_full(&job.params, path)?;
    }
    if let Some(dir) = &args.save_hf {
        job.model.save_hf(dir)?;
    }
    let now = memory::stats();
    let (peak, peak_reserved, device_peak) = (
        now.peak_bytes.max(run_peak),
        now.peak_reserved_bytes.max(run_peak_reserved),
        memory::device_stats().peak_bytes,
    );
    let mine = [
        peak,
        job.init.peak_bytes,
        job.init.local_bytes,
        device_peak,
        peak_reserved,
    ];
    let all = job.mesh.comm().all_gather_vec(&mine.map(|b| b as i64))?;
    let column = |i: usize| all.chunks(mine.len()).map(|c| c[i] as usize).collect();
    (report.peak_bytes, report.init_peak_bytes, report.init_local_bytes) = (column(0), column(1), column(2));
    (report.device_peak_bytes, report.peak_reserved_bytes) = (column(3), column(4));
    if let Some((_, allocated, reserved)) = device_memory(args)? {
        report.device_allocator_peaks = (allocated, reserved);
    }
    Ok(report)
}

/// On a GPU: how many times this rank's host has waited for the device.
fn device_waits(args: &Args) -> Result<Option<u64>, BoxError> {
    #[cfg(feature = "cuda")]
    if let tessera::dtensor::Device::Cuda(n) = args.device {
        return Ok(Some(tessera::tensor::cuda::host_waits(n)?));
    }
    let _ = args;
    Ok(None)
}

/// On a GPU: the caching allocator's reserved bytes now, and its peak
/// allocated and reserved bytes (all ranks on the GPU together).
fn device_memory(args: &Args) -> Result<Option<(usize, usize, usize)>, BoxError> {
    #[cfg(feature = "cuda")]
    if let tessera::dtensor::Device::Cuda(n) = args.device {
        let s = tessera::tensor::cuda::memory_stats(n)?;
        return Ok(Some((s.reserved_bytes, s.peak_allocated_bytes, s.peak_reserved_bytes)));
    }
    let _ = args;
    Ok(None)
}
