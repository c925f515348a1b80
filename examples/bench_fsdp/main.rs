//! FSDP benchmark: one training step of the reference Transformer on one rank
//! against FSDP on two in-process ranks, with the same global batch.
//!
//! ```text
//! cargo run --release --example bench_fsdp -- [--json PATH] [--steps N] [--config bench|tiny|large]
//!     [--mixed-precision bf16] [--threads N] [--profile] [--units blocks|split-ends]
//! ```
//!
//! A step is forward (`model.loss` on the token rows), backward, `AdamW::step`
//! (lr 1e-3, betas (0.9, 0.95), eps 1e-8, weight decay 0.1) and `zero_grad`, in
//! f32, on rows of the reference generator (`tessera::data::batch`, data seed
//! 1234), 4 rows per FSDP rank (2 for the `large` config: dim 768, 6 layers,
//! 12 heads, vocab 32000, seq 128, 92M parameters, `train`'s research-size
//! run with `--batch 2`):
//!
//! - `single`: `launch(1)`, a 1-rank mesh, no FSDP, the 8 rows of the global batch;
//! - `fsdp`: `launch(2)`, a 2-rank mesh, `model.fully_shard(&mesh, &FsdpConfig::default())`
//!   (each block a unit, then the root), the batch split `Shard(0)`, 4 rows each.
//!
//! With `--mixed-precision bf16` both modes use `MixedPrecisionPolicy::bf16()`
//! (bf16 compute, f32 gradient reduction and master weights); the single rank
//! gets it from `fully_shard` on its 1-rank mesh, which gathers and scatters
//! nothing.
//!
//! The token rows of a step are built before its timing starts; each step starts
//! after a barrier. After 2 warm-up steps come `N` timed ones (default 10); a
//! step's time is the slowest rank's, the table shows the median, and for rank 0
//! the medians of its phases (forward, backward, optimizer step with `zero_grad`).
//! Peak memory is the per-rank high-water mark of tensor storage
//! (`tessera::tensor::memory`) from after setup (model, sharding, optimizer;
//! AdamW's moments appear in the first step) to the last step, the largest over
//! ranks. The first-step losses of both modes are printed as a check: they start
//! from the same weights on the same global batch, so they agree to rounding.
//!
//! The ranks are threads of this process and share the machine's cores, so other
//! load skews the comparison. `cores_ours` is this process's CPU time over the
//! wall time of the timed steps (all its threads: about 1 for `single`, up to 2
//! for `fsdp`), `cores_others` the rest of the machine's busy time over the same
//! interval (Linux `/proc`, in 10 ms ticks: coarse for short runs such as the
//! tiny config's); a mode whose steps shared the machine with more than 0.2 cores
//! of other work is flagged.
//!
//! `--profile` also prints, per mode and phase, where rank 0's time went:
//! GEMM, element-wise, reductions, the fused NN kernels, communication (the
//! collectives, their packing and the wait for peers), allocation and the
//! optimizer (exclusive times from `tessera::tensor::profile`, medians over
//! the timed steps), and what no timer covered ("other"); then, per phase, the
//! ops whose local kernels took the most time (`tessera::tensor::profile::take_ops`);
//! then rank 0's GEMM rate (the `matmul` ops' flops over their time, per thread)
//! against one core's `f32` FMA peak measured in the same run (x86-64), and the
//! step's time if every GEMM ran at that peak: the floor a faster GEMM could
//! reach, and the model FLOPs utilisation: the step's GEMM FLOPs at that
//! peak (on the rank's threads) over the measured step. The GEMM FLOPs are
//! the `matmul` ops' and the attention kernel's products (`q·kᵀ`, the
//! weights times `v`, and their gradients), the latter counted for the
//! causal half they compute (the pairs of a query and an earlier or equal
//! key), not the full square some conventions count. `--json` records then
//! gain `gemm_gflop_per_step` (the `matmul` ops'), `attention_gflop_per_step`,
//! `gemm_gflops_per_thread`, `fma_peak_gflops` and `mfu`.
//!
//! `--threads N` gives each rank N threads for its kernels (default: the cores
//! divided among the ranks, or `TESSERA_THREADS_PER_RANK`); the table's
//! `threads` column shows what the ranks ran with.
//!
//! `--profile` ends with rank 0's FSDP units in the `fsdp` mode
//! (`FsdpModule::comm_overlap`): per unit and step, its all-gathers and
//! reduce-scatters, how long they ran on the communication thread (from its
//! start to its finish, waiting for the peer included), how long the rank
//! blocked for them (exposed), and the share of the run hidden behind compute.
//!
//! `--json PATH` writes one record per mode, `{mode, world, threads_per_rank,
//! precision, median_step_s, peak_bytes_per_rank, ...}`, atomically; the
//! `fsdp` record also has rank 0's `all_gather_ms_per_step`,
//! `all_gather_exposed_ms_per_step`, `reduce_scatter_ms_per_step` and
//! `reduce_scatter_exposed_ms_per_step`, summed over its units. PyTorch 2.15 FSDP2 (gloo) times on
//! this machine are shown for comparison; they are reference figures, not
//! measured here.

#[path = "../common/mod.rs"]
mod common;
mod tables;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use common::{Json, max_over_ranks, median};
use tables::{GemmRate, print_gemm_rates, print_overlap, print_profiles, print_top_ops};
use tessera::autograd::nn::{Materializer, Module};
use tessera::autograd::optim::{AdamW, AdamWConfig, Optimizer};
use tessera::autograd::{Var, backward};
use tessera::data::{DATA_SEED, batch};
use tessera::dtensor::{Placement, Tensor, distribute_tensor_from};
use tessera::fsdp::{CommOverlap, FsdpConfig, FsdpModule, MixedPrecisionPolicy};
use tessera::models::{CausalLm, Transformer, TransformerConfig, UnitLayout};
use tessera::tensor::memory;
use tessera::tensor::profile::{self, OpTime, Profile};
use tessera::{BoxError, DType, DeviceMesh, LaunchOptions, launch_with};

const WARMUP: usize = 2;
const DEFAULT_STEPS: usize = 10;
const FSDP_WORLD: usize = 2;
const INIT_SEED: u64 = 0;
/// Cores busy with other work above which a mode's times are flagged as noisy.
const OTHERS_NOISE: f64 = 0.2;

/// The research-size model of `train`'s large run: 92M parameters.
const LARGE: TransformerConfig = TransformerConfig {
    vocab: 32000,
    dim: 768,
    n_layers: 6,
    n_heads: 12,
    seq: 128,
};

/// The bench model: dim 256, 4 layers, 8 heads, vocab 4096, seq 128.
const BENCH: TransformerConfig = TransformerConfig {
    vocab: 4096,
    dim: 256,
    n_layers: 4,
    n_heads: 8,
    seq: 128,
};

const USAGE: &str = "usage: bench_fsdp [--json PATH] [--steps N] [--config bench|tiny|large] [--mixed-precision bf16]
  --json PATH              also write the results as a JSON array of records (atomically)
  --steps N                timed steps per mode (default 10; 2 warm-ups come first)
  --config bench|tiny|large  bench: dim 256, 4 layers, 8 heads, vocab 4096, seq 128 (default);
                           tiny: dim 64, 2 layers, 4 heads, vocab 256, seq 32;
                           large: dim 768, 6 layers, 12 heads, vocab 32000, seq 128, 2 rows per rank
  --mixed-precision bf16   bf16 compute and gathers, f32 gradient reduction (both modes)
  --threads N              threads per rank for its kernels (default: cores / ranks)
  --profile                print where each phase's time went, by kind of work
  --units blocks|split-ends  FSDP units: each block and the root (default), or also the
                           embeddings and the final norm with the output head";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Single,
    Fsdp,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Single => "single",
            Mode::Fsdp => "fsdp",
        }
    }

    fn world(self) -> usize {
        match self {
            Mode::Single => 1,
            Mode::Fsdp => FSDP_WORLD,
        }
    }
}

#[derive(Clone, Debug)]
struct Args {
    json: Option<PathBuf>,
    steps: usize,
    config_name: &'static str,
    model: TransformerConfig,
    /// Rows per FSDP rank (the single rank takes them all).
    rows_per_rank: usize,
    /// PyTorch 2.15 FSDP2 ms per step: (one process, W=2), same global batch,
    /// where measured (`side_by_side.py` measures the large row).
    pytorch_ms: Option<(f64, f64)>,
    bf16: bool,
    /// `--threads`: threads per rank, else the launch's default.
    threads: Option<usize>,
    profile: bool,
    /// `--units`: how the model is grouped into FSDP units.
    units: UnitLayout,
}

/// What one rank measured.
struct RankReport {
    step_s: Vec<f64>,
    forward_s: Vec<f64>,
    backward_s: Vec<f64>,
    optim_s: Vec<f64>,
    /// Cores busy during the timed steps (rank 0's view).
    cpu: Option<CpuUse>,
    peak_bytes: usize,
    first_loss: f64,
    last_loss: f64,
    /// Per timed step and phase (forward, backward, optimizer): rank 0's profile.
    profiles: Vec<[Profile; 3]>,
    /// Per phase: the op kernels' time summed over the timed steps.
    ops: [Vec<OpTime>; 3],
    /// The threads this rank's kernels ran on.
    threads: usize,
    /// Per FSDP unit (`root`, `layers.i`): its collectives over the timed steps.
    overlap: Vec<(String, CommOverlap)>,
}

/// One mode's summary: its medians and peak over the ranks, and what rank 0
/// measured (its profiles, op kernels, units' collectives, losses, threads).
struct Summary {
    mode: Mode,
    /// The median over the timed steps of the slowest rank's step.
    median_s: f64,
    forward_s: f64,
    backward_s: f64,
    optim_s: f64,
    /// The largest peak over the ranks.
    peak_bytes: usize,
    rank0: RankReport,
}

fn main() -> ExitCode {
    common::bench_main("bench_fsdp", USAGE, parse(std::env::args().skip(1)), run)
}

/// Parses the flags (also `--flag=value`); `--help` gives [`common::HELP`].
fn parse(args: impl IntoIterator<Item = String>) -> Result<Args, String> {
    let mut out = Args {
        json: None,
        steps: DEFAULT_STEPS,
        config_name: "bench",
        model: BENCH,
        rows_per_rank: 4,
        pytorch_ms: Some((233.0, 316.8)),
        bf16: false,
        threads: None,
        profile: false,
        units: UnitLayout::Blocks,
    };
    let mut args: Vec<String> = args.into_iter().collect();
    if let Some(i) = args.iter().position(|a| a == "--profile") {
        args.remove(i);
        out.profile = true;
    }
    common::parse_flags(args, |flag, value| {
        match flag {
            "--json" => out.json = Some(common::json_path(&value("a file path")?)?),
            "--steps" => out.steps = common::positive(flag, &value("a positive integer")?)?,
            "--config" => {
                (out.config_name, out.model, out.rows_per_rank, out.pytorch_ms) =
                    match value("bench, tiny or large")?.as_str() {
                        "bench" => ("bench", BENCH, 4, Some((233.0, 316.8))),
                        "tiny" => ("tiny", TransformerConfig::TINY, 4, Some((6.3, 34.8))),
                        "large" => ("large", LARGE, 2, None),
                        other => return Err(format!("--config takes bench, tiny or large, got {other:?}")),
                    }
            }
            "--mixed-precision" => match value("bf16")?.as_str() {
                "bf16" => out.bf16 = true,
                other => return Err(format!("--mixed-precision takes bf16, got {other:?}")),
            },
            "--threads" => out.threads = Some(common::positive(flag, &value("a positive integer")?)?),
            "--units" => out.units = value("blocks or split-ends")?.parse()?,
            other => return Err(format!("unknown argument {other:?}")),
        }
        Ok(())
    })?;
    Ok(out)
}

fn run(args: &Args) -> Result<(), BoxError> {
    let cfg = args.model;
    let global = FSDP_WORLD * args.rows_per_rank;
    println!(
        "one training step (forward, backward, AdamW) of the {} Transformer (dim {}, {} layers, {} heads, vocab {}, \
         seq {}; {} parameters), {}, global batch {global} rows; {} steps after {WARMUP} warm-ups",
        args.config_name,
        cfg.dim,
        cfg.n_layers,
        cfg.n_heads,
        cfg.vocab,
        cfg.seq,
        cfg.num_params(),
        if args.bf16 { "bf16 mixed precision" } else { "f32" },
        args.steps,
    );
    // Before the modes, on a machine this benchmark does not load yet.
    let peak = if args.profile {
        common::peak::f32_fma_gflops()
    } else {
        None
    };
    let mut summaries = Vec::new();
    for mode in [Mode::Single, Mode::Fsdp] {
        let mut opts = LaunchOptions::from_env()?;
        if let Some(threads) = args.threads {
            opts = opts.threads_per_rank(threads);
        }
        let reports = launch_with(&opts, mode.world(), {
            let args = args.clone();
            move |ctx| bench_rank(ctx.into_comm(), mode, &args)
        })?;
        let med = |f: fn(&RankReport) -> &Vec<f64>| median(f(&reports[0]));
        let median_s = median(&max_over_ranks(
            &reports.iter().map(|r| r.step_s.clone()).collect::<Vec<_>>(),
        ));
        let (forward_s, backward_s, optim_s) = (med(|r| &r.forward_s), med(|r| &r.backward_s), med(|r| &r.optim_s));
        let peak_bytes = reports.iter().map(|r| r.peak_bytes).max().unwrap_or(0);
        summaries.push(Summary {
            mode,
            median_s,
            forward_s,
            backward_s,
            optim_s,
            peak_bytes,
            rank0: reports.into_iter().next().ok_or("no rank reported")?,
        });
    }
    report(args, &summaries, peak)?;
    if args.profile {
        print_profiles(&summaries);
        print_top_ops(&summaries, 12);
        print_gemm_rates(&summaries, peak);
        print_overlap(&summaries, args.steps);
    }
    Ok(())
}

/// Sets up one rank of `mode` and times its steps.
fn bench_rank(comm: Box<dyn tessera::Communicator>, mode: Mode, args: &Args) -> Result<RankReport, BoxError> {
    let world = mode.world();
    let mesh = DeviceMesh::new(comm, &[world])?;
    let cfg = args.model;
    let model = Transformer::new(cfg, &mesh, DType::F32)?;
    let fsdp_config = FsdpConfig {
        mp_policy: if args.bf16 {
            MixedPrecisionPolicy::bf16()
        } else {
            MixedPrecisionPolicy::default()
        },
        ..FsdpConfig::default()
    };
    // Kept alive for the whole run: dropping the units would end FSDP.
    let units = match mode {
        Mode::Fsdp => Some(model.fully_shard_with(&mesh, &fsdp_config, args.units)?),
        Mode::Single if args.bf16 => Some(model.fully_shard_with(&mesh, &fsdp_config, args.units)?),
        Mode::Single => None,
    };
    Materializer::from_seed(INIT_SEED).materialize(&model)?;
    let adamw = AdamWConfig {
        lr: 1e-3,
        betas: (0.9, 0.95),
        eps: 1e-8,
        weight_decay: 0.1,
    };
    let mut opt = AdamW::new(model.parameters(), adamw)?;
    let global = FSDP_WORLD * args.rows_per_rank;
    let len = cfg.seq + 1;
    memory::reset_peak();

    let mut r = RankReport {
        step_s: Vec::new(),
        forward_s: Vec::new(),
        backward_s: Vec::new(),
        optim_s: Vec::new(),
        cpu: None,
        peak_bytes: 0,
        first_loss: f64::NAN,
        last_loss: f64::NAN,
        profiles: Vec::new(),
        ops: Default::default(),
        threads: tessera::mesh::intra_op_threads(),
        overlap: Vec::new(),
    };
    // The units by name, only where FSDP communicates.
    let named: Vec<(String, &FsdpModule)> = match &units {
        Some(u) if world > 1 => u.named(),
        _ => Vec::new(),
    };
    profile::enable(args.profile);
    let mut cpu_start = None;
    for step in 0..WARMUP + args.steps {
        // Every rank builds the same global rows and keeps its own, with no
        // source rank (so no hash exchange per step).
        let rows = batch(DATA_SEED, step as u64, 0..global as u64, len, cfg.vocab as u64);
        let rows = distribute_tensor_from(
            &Tensor::from_vec(rows, &[global, len])?,
            &mesh,
            &[Placement::Shard(0)],
            None,
        )?;
        let rows = Var::constant(rows);
        mesh.comm().barrier()?;
        if step == WARMUP {
            cpu_start = cpu_seconds().map(|c| (c, Instant::now()));
            named.iter().for_each(|(_, u)| u.reset_comm_overlap());
        }
        profile::take();
        profile::take_ops();
        let t0 = Instant::now();
        let loss = model.loss(&rows)?;
        let t1 = Instant::now();
        let p_fwd = profile::take();
        let o_fwd = profile::take_ops();
        backward(&loss)?;
        let t2 = Instant::now();
        let p_bwd = profile::take();
        let o_bwd = profile::take_ops();
        opt.step()?;
        opt.zero_grad();
        let t3 = Instant::now();
        let p_opt = profile::take();
        let o_opt = profile::take_ops();
        let value = loss.value().full_tensor()?.to_f64_vec()[0];
        if !value.is_finite() {
            return Err(format!("{} step {step}: the loss is {value}", mode.name()).into());
        }
        if step == 0 {
            r.first_loss = value;
        }
        r.last_loss = value;
        if step >= WARMUP {
            r.step_s.push((t3 - t0).as_secs_f64());
            r.forward_s.push((t1 - t0).as_secs_f64());
            r.backward_s.push((t2 - t1).as_secs_f64());
            r.optim_s.push((t3 - t2).as_secs_f64());
            r.profiles.push([p_fwd, p_bwd, p_opt]);
            for (sum, step) in r.ops.iter_mut().zip([o_fwd, o_bwd, o_opt]) {
                step.into_iter().for_each(|o| profile::add_op(sum, o));
            }
        }
    }
    // Every rank has finished its last step once this barrier passes.
    mesh.comm().barrier()?;
    if let (Some(((ours0, all0), w0)), Some((ours1, all1))) = (cpu_start, cpu_seconds()) {
        let wall = w0.elapsed().as_secs_f64();
        let ours = (ours1 - ours0) / wall;
        r.cpu = Some(CpuUse {
            ours,
            others: ((all1 - all0) / wall - ours).max(0.0),
        });
    }
    r.peak_bytes = memory::stats().peak_bytes;
    r.overlap = named.iter().map(|(name, u)| (name.clone(), u.comm_overlap())).collect();
    Ok(r)
}

/// Average busy cores over an interval: this process's threads, and everything else
/// on the machine (other processes, the kernel's own work).
#[derive(Clone, Copy, Debug)]
struct CpuUse {
    ours: f64,
    others: f64,
}

/// CPU seconds (user + system) so far of this process (all its threads) and of the
/// whole machine (all CPUs, not idle or waiting on I/O); `None` where `/proc`
/// cannot be read (not Linux). Assumes `USER_HZ` = 100, as on every mainstream
/// Linux architecture.
fn cpu_seconds() -> Option<(f64, f64)> {
    const HZ: f64 = 100.0;
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the parenthesised command name: state is field 3, utime 14, stime 15.
    let rest = stat.get(stat.rfind(')')? + 1..)?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| fields.get(i - 3)?.parse::<u64>().ok();
    let ours = (ticks(14)? + ticks(15)?) as f64 / HZ;
    // `cpu  user nice system idle iowait irq softirq steal ...`, summed over CPUs.
    let machine = std::fs::read_to_string("/proc/stat").ok()?;
    let cpu: Vec<u64> = machine
        .lines()
        .next()?
        .strip_prefix("cpu ")?
        .split_whitespace()
        .take(8)
        .map(|v| v.parse().ok())
        .collect::<Option<_>>()?;
    let busy = cpu.iter().sum::<u64>() - cpu.get(3)? - cpu.get(4)?;
    Some((ours, busy as f64 / HZ))
}

/// Prints the table and the targets, and writes the JSON.
fn report(args: &Args, s: &[Summary], peak: Option<f64>) -> Result<(), BoxError> {
    let (single, fsdp) = (&s[0], &s[1]);
    let (pt_single, pt_fsdp) = args.pytorch_ms.map_or((None, None), |(a, b)| (Some(a), Some(b)));
    let mib = |b: usize| b as f64 / (1u64 << 20) as f64;
    println!();
    println!(
        "{:<7} {:>5} {:>7} {:>10} {:>8} {:>8} {:>9} {:>11} {:>13} {:>14} {:>11} {:>11} {:>11}",
        "mode",
        "world",
        "threads",
        "median_ms",
        "fwd_ms",
        "bwd_ms",
        "optim_ms",
        "cores_ours",
        "cores_others",
        "peak_MiB/rank",
        "first_loss",
        "pytorch_ms",
        "vs_pytorch"
    );
    let mut records = Vec::new();
    for (x, pt) in [(single, pt_single), (fsdp, pt_fsdp)] {
        let ms = x.median_s * 1e3;
        println!(
            "{:<7} {:>5} {:>7} {:>10.1} {:>8.1} {:>8.1} {:>9.1} {:>11} {:>13} {:>14.1} {:>11.5} {:>11} {:>11}",
            x.mode.name(),
            x.mode.world(),
            x.rank0.threads,
            ms,
            x.forward_s * 1e3,
            x.backward_s * 1e3,
            x.optim_s * 1e3,
            x.rank0.cpu.map_or("-".into(), |c| format!("{:.2}", c.ours)),
            x.rank0.cpu.map_or("-".into(), |c| format!("{:.2}", c.others)),
            mib(x.peak_bytes),
            x.rank0.first_loss,
            pt.map_or("-".into(), |pt| format!("{pt:.1}")),
            pt.map_or("-".into(), |pt| format!("{:.2}x", ms / pt)),
        );
        records.push(Json::Obj(vec![
            ("mode".into(), Json::Str(x.mode.name().into())),
            ("world".into(), Json::Int(x.mode.world() as u64)),
            ("threads_per_rank".into(), Json::Int(x.rank0.threads as u64)),
            ("median_step_s".into(), Json::Num(x.median_s)),
            ("peak_bytes_per_rank".into(), Json::Int(x.peak_bytes as u64)),
            ("config".into(), Json::Str(args.config_name.into())),
            (
                "precision".into(),
                Json::Str(if args.bf16 { "bf16" } else { "f32" }.into()),
            ),
            (
                "global_batch".into(),
                Json::Int((FSDP_WORLD * args.rows_per_rank) as u64),
            ),
            ("steps".into(), Json::Int(args.steps as u64)),
            ("first_loss".into(), Json::Num(x.rank0.first_loss)),
            ("last_loss".into(), Json::Num(x.rank0.last_loss)),
        ]));
        if let (false, Some(Json::Obj(fields))) = (x.rank0.overlap.is_empty(), records.last_mut()) {
            let steps = args.steps.max(1) as f64;
            let ms = |f: fn(&CommOverlap) -> std::time::Duration| {
                Json::Num(x.rank0.overlap.iter().map(|(_, o)| f(o).as_secs_f64()).sum::<f64>() * 1e3 / steps)
            };
            fields.push(("all_gather_ms_per_step".into(), ms(|o| o.all_gather.run)));
            fields.push(("all_gather_exposed_ms_per_step".into(), ms(|o| o.all_gather.exposed)));
            fields.push(("reduce_scatter_ms_per_step".into(), ms(|o| o.reduce_scatter.run)));
            fields.push((
                "reduce_scatter_exposed_ms_per_step".into(),
                ms(|o| o.reduce_scatter.exposed),
            ));
        }
        if let (Some(r), Some(Json::Obj(fields))) = (GemmRate::of(x), records.last_mut()) {
            fields.push(("gemm_gflop_per_step".into(), Json::Num(r.gflop)));
            fields.push(("attention_gflop_per_step".into(), Json::Num(r.attention_gflop)));
            fields.push(("gemm_gflops_per_thread".into(), Json::Num(r.per_thread)));
            if let Some(peak) = peak {
                fields.push(("fma_peak_gflops".into(), Json::Num(peak)));
                fields.push(("mfu".into(), Json::Num(r.mfu(peak, x))));
            }
        }
    }
    let time_ratio = fsdp.median_s / single.median_s;
    let mem_ratio = fsdp.peak_bytes as f64 / single.peak_bytes as f64;
    println!();
    println!("fsdp/single: step time {time_ratio:.2}x, peak memory per rank {mem_ratio:.2}x");
    let verdict = |ok: bool| if ok { "met" } else { "NOT met" };
    println!(
        "target fsdp W=2 <= 1.1x our single-rank step: {time_ratio:.2}x, {}",
        verdict(time_ratio <= 1.1)
    );
    match pt_fsdp {
        Some(pt_fsdp) => {
            let vs_pt = fsdp.median_s * 1e3 / pt_fsdp;
            println!(
                "pytorch_ms: PyTorch 2.15 FSDP2, gloo, f32, on this machine, {} config, {} rows (reference figures, not \
                 measured here); vs_pytorch = our median / theirs, in the same mode",
                args.config_name,
                FSDP_WORLD * args.rows_per_rank
            );
            println!(
                "target fsdp W=2 <= 0.6x PyTorch FSDP2 W=2 ({pt_fsdp} ms): {vs_pt:.2}x, {}",
                verdict(vs_pt <= 0.6)
            );
        }
        None => println!(
            "no PyTorch reference figures for the {} config: ../shared/peers/side_by_side.py measures them beside ours",
            args.config_name
        ),
    }
    if let Some(p) = peak {
        for x in s {
            if let Some(r) = GemmRate::of(x) {
                let mfu = r.mfu(p, x);
                println!(
                    "target {} model FLOPs utilisation >= 70%: {:.1}% ({:.2} GFLOP of matmuls and {:.2} of attention \
                     products per step), {}",
                    x.mode.name(),
                    100.0 * mfu,
                    r.gflop,
                    r.attention_gflop,
                    verdict(mfu >= 0.7)
                );
            }
        }
    }
    let drift = (fsdp.rank0.first_loss - single.rank0.first_loss).abs();
    if drift > 1e-3 * single.rank0.first_loss.abs().max(1.0) {
        println!(
            "WARNING: the first-step losses differ ({} single, {} fsdp): the two modes do not compute the same step",
            single.rank0.first_loss, fsdp.rank0.first_loss
        );
    }
    for x in s {
        if let Some(c) = x.rank0.cpu.filter(|c| c.others > OTHERS_NOISE) {
            println!(
                "WARNING: other work kept {:.2} cores busy during the {} steps (this run used {:.2}): its times \
                 are not clean; rerun on an idle machine",
                c.others,
                x.mode.name(),
                c.ours
            );
        }
    }
    if let Some(path) = &args.json {
        common::write_atomic(path, &(Json::Arr(records).render() + "\n"))?;
        println!("wrote {}", path.display());
    }
    Ok(())
}
