//! The main job: trains the reference Transformer on in-process ranks (or, built
//! with `--features mpi` and started by `mpirun -n N`, one rank per process) on the
//! reference data generator, printing progress and a summary.
//!
//! ```text
//! cargo run --release --example train -- [--world-size 4 | --mesh RxS] [--tp T [--sequence-parallel]]
//!     [--steps 50] [--batch 2] [--dim 64 --n-layers 2 --n-heads 4 --vocab 256 --seq 32] [--lr 1e-3]
//!     [--mixed-precision bf16] [--no-reshard]
//!     [--init PATH | --seed 0] [--tokens PATH] [--data-seed 1234] [--losses-out PATH]
//! ```
//!
//! The model is built deferred (`Transformer::new`: shapes, no storage), planned
//! and sharded, and only then materialised (`Materializer`): each rank allocates
//! its own shards and fills them from `--init PATH` (a safetensors file, reading
//! only this rank's bytes) or from `--seed` (the counter-based generator: the
//! same parameters bit for bit on every mesh). No rank ever holds the whole model.
//!
//! Each block of the model is an FSDP unit and the root takes the rest
//! (`Transformer::fully_shard`): parameters, gradients and AdamW states are sharded
//! over the ranks, each unit's parameters are all-gathered for its forward and
//! backward, and its gradients reduce-scattered. `--mesh RxS` trains HSDP on an
//! `R × S` mesh (replicate over R, shard over S). The batch (`--batch` rows per
//! rank) is split over all ranks; every step is the single-device step on the
//! global batch.
//!
//! `--tp T` adds tensor parallelism under FSDP: a `(dp, tp)` mesh with
//! `dp = world / T`, the reference plan (`Transformer::tp_plan`; with
//! `--sequence-parallel`, `Transformer::tp_plan_sequence_parallel`) over `tp`,
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

#[path = "common/mod.rs"]
mod common;

use std::io::Write as _;
use std::path::PathBuf;
use std::time::Instant;

use tessera::autograd::nn::{MaterializeReport, Materializer, Module};
use tessera::autograd::optim::{AdamW, AdamWConfig, LrScheduler, Optimizer, Schedule};
use tessera::autograd::state_dict::{AsyncCheckpointer, write_atomic};
use tessera::autograd::{
    Param, Var, backward, load_checkpoint, read_safetensors, save_checkpoint, save_state_dict_full,
};
use tessera::data::{DATA_SEED, batch};
use tessera::dtensor::checkpoint::{Checkpoint, SaveReport, remove_checkpoint};
use tessera::dtensor::{Device, Placement, Tensor, distribute_tensor_from};
use tessera::fsdp::{FsdpConfig, MixedPrecisionPolicy};
use tessera::models::{Transformer, TransformerConfig};
use tessera::tensor::memory;
use tessera::{BoxError, CommunicatorExt, DType, DeviceMesh, RankCtx, is_lead_process, launch, mpi_env};

const USAGE: &str = "usage: train [--world-size N | --mesh RxS] [--tp T [--sequence-parallel]] [--steps N] [--batch ROWS_PER_RANK] [--dim N] \
[--n-layers N] [--n-heads N] [--vocab N] [--seq N] [--lr F] [--lr-schedule S] [--warmup-steps N] [--mixed-precision bf16] [--no-reshard] [--init PATH | --seed N] \
[--tokens PATH] [--data-seed N] [--losses-out PATH] [--checkpoint-dir DIR --checkpoint-every N [--async-save] [--keep-checkpoints K]] [--resume DIR] \
[--save-full PATH] [--device cpu|cuda|cuda:N]";

/// Every flag with its default (`train --help`).
const HELP: &str = "\
mesh and parallelism:
  --world-size N        ranks (default 4; under mpirun, the number of processes)
  --mesh RxS            HSDP: replicate over R, shard over S (default: FSDP over all ranks)
  --tp T                tensor parallelism over T ranks under FSDP (default 0: none)
  --sequence-parallel   the sequence-parallel TP plan (default: off)
  --mixed-precision M   bf16 or none (default none)
  --no-reshard          keep parameters gathered from forward to backward (default: reshard)
  --device D            cpu, or cuda / cuda:N: every rank computes on that GPU, ranks
                        sharing it as threads (needs a build with --features cuda;
                        default cpu)
model and data:
  --dim N --n-layers N --n-heads N --vocab N --seq N
                        model sizes (default 64, 2, 4, 256, 32: the tiny reference)
  --init PATH           materialise from a safetensors state dict, each rank reading its bytes
  --seed N              model seed without --init (default 0; the same model on every mesh)
  --tokens PATH         token batches, int64 [steps, global_batch, seq+1] (default: generated)
  --data-seed N         seed of the generated batches (default 1234)
training:
  --steps N             steps (default 50)
  --batch N             rows per data-parallel rank (default 2)
  --lr F                AdamW learning rate (default 0.001)
  --lr-schedule S       constant, cosine (warmup, then cosine to 0) or wsd (warmup,
                        stable, linear decay to 0 over the last tenth) (default constant)
  --warmup-steps N      linear warmup steps of cosine and wsd (default 0)
output and checkpoints:
  --losses-out PATH     JSON: losses, step times, peak memory per rank, init peak, peak RSS
  --checkpoint-dir DIR --checkpoint-every N
                        sharded checkpoints every N steps (default: none)
  --async-save          write checkpoints in the background
  --keep-checkpoints K  keep the newest K complete checkpoints (default 0: all)
  --resume DIR          continue from a checkpoint saved on any mesh
  --save-full PATH      consolidated safetensors state dict at the end
environment: TESSERA_TIMEOUT_S, TESSERA_THREADS_PER_RANK, TESSERA_BACKEND, TESSERA_BF16_DOT,
  TESSERA_SYSTEM_MALLOC, TESSERA_MPI_CHECK, TESSERA_STRICT_COLLECTIVES, TESSERA_FINGERPRINTS
  (see tessera::mesh::vars)";

#[derive(Clone, Debug)]
struct Args {
    world: usize,
    /// `[R, S]` for HSDP, `[world]` for FSDP.
    mesh: Vec<usize>,
    bf16: bool,
    no_reshard: bool,
    /// Tensor-parallel ranks (0: no TP).
    tp: usize,
    sequence_parallel: bool,
    steps: usize,
    batch: usize,
    model: TransformerConfig,
    lr: f64,
    /// `constant`, `cosine` (warmup then cosine to 0) or `wsd` (warmup, stable,
    /// linear decay over the last tenth).
    lr_schedule: String,
    warmup_steps: usize,
    init: Option<PathBuf>,
    /// The model seed (without `--init`).
    seed: u64,
    tokens: Option<PathBuf>,
    data_seed: u64,
    losses_out: Option<PathBuf>,
    checkpoint_dir: Option<PathBuf>,
    checkpoint_every: usize,
    async_save: bool,
    /// Completed checkpoints to keep (0: all).
    keep: usize,
    resume: Option<PathBuf>,
    save_full: Option<PathBuf>,
    /// Where the ranks compute (`--device`).
    device: Device,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        // Under mpirun: one rank per process.
        world: mpi_env().and_then(|e| e.size).unwrap_or(4),
        mesh: Vec::new(),
        bf16: false,
        no_reshard: false,
        tp: 0,
        sequence_parallel: false,
        steps: 50,
        batch: 2,
        model: TransformerConfig::TINY,
        lr: 1e-3,
        lr_schedule: "constant".to_string(),
        warmup_steps: 0,
        init: None,
        seed: 0,
        tokens: None,
        data_seed: DATA_SEED,
        losses_out: None,
        checkpoint_dir: None,
        checkpoint_every: 0,
        async_save: false,
        keep: 0,
        resume: None,
        save_full: None,
        device: Device::Cpu,
    };
    let mut world_given = false;
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--help" || flag == "-h" {
            println!("{USAGE}\n\n{HELP}");
            std::process::exit(0);
        }
        if flag == "--no-reshard" {
            a.no_reshard = true;
            continue;
        }
        if flag == "--sequence-parallel" {
            a.sequence_parallel = true;
            continue;
        }
        if flag == "--async-save" {
            a.async_save = true;
            continue;
        }
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let num = |v: &str| {
            v.parse::<usize>()
                .map_err(|_| format!("{flag}: {v:?} is not a whole number"))
        };
        match flag.as_str() {
            "--device" => a.device = value.parse().map_err(|e| format!("--device: {e}"))?,
            "--world-size" => {
                a.world = num(&value)?;
                world_given = true;
            }
            "--mesh" => {
                let dims: Vec<usize> = value.split(['x', 'X']).map(num).collect::<Result<_, _>>()?;
                if dims.len() != 2 {
                    return Err(format!("--mesh: {value:?} is not RxS (e.g. 2x2)"));
                }
                a.mesh = dims;
            }
            "--mixed-precision" => match value.as_str() {
                "bf16" => a.bf16 = true,
                "none" | "f32" => a.bf16 = false,
                other => return Err(format!("--mixed-precision: {other:?} (bf16 or none)")),
            },
            "--tp" => a.tp = num(&value)?,
            "--steps" => a.steps = num(&value)?,
            "--batch" => a.batch = num(&value)?,
            "--dim" => a.model.dim = num(&value)?,
            "--n-layers" => a.model.n_layers = num(&value)?,
            "--n-heads" => a.model.n_heads = num(&value)?,
            "--vocab" => a.model.vocab = num(&value)?,
            "--seq" => a.model.seq = num(&value)?,
            "--lr" => a.lr = value.parse().map_err(|_| format!("--lr: {value:?} is not a number"))?,
            "--lr-schedule" => match value.as_str() {
                "constant" | "cosine" | "wsd" => a.lr_schedule = value,
                other => return Err(format!("--lr-schedule: {other:?} (constant, cosine or wsd)")),
            },
            "--warmup-steps" => a.warmup_steps = num(&value)?,
            "--init" => a.init = Some(value.into()),
            "--tokens" => a.tokens = Some(value.into()),
            "--seed" => a.seed = value.parse().map_err(|_| format!("--seed: {value:?} is not a u64"))?,
            "--data-seed" => a.data_seed = value.parse().map_err(|_| format!("--data-seed: {value:?}"))?,
            "--losses-out" => a.losses_out = Some(value.into()),
            "--checkpoint-dir" => a.checkpoint_dir = Some(value.into()),
            "--checkpoint-every" => a.checkpoint_every = num(&value)?,
            "--keep-checkpoints" => a.keep = num(&value)?,
            "--resume" => a.resume = Some(value.into()),
            "--save-full" => a.save_full = Some(value.into()),
            other => return Err(format!("unknown flag {other}")),
        }
    }
    if a.mesh.is_empty() {
        a.mesh = vec![a.world];
    } else {
        let n = a.mesh[0] * a.mesh[1] * a.tp.max(1);
        if world_given && n != a.world {
            return Err(format!(
                "--mesh {}x{}{} has {n} ranks, --world-size says {}",
                a.mesh[0],
                a.mesh[1],
                if a.tp > 0 {
                    format!(" with --tp {}", a.tp)
                } else {
                    String::new()
                },
                a.world
            ));
        }
        a.world = n;
    }
    if a.world == 0 || a.batch == 0 || a.steps == 0 {
        return Err("--world-size (or the mesh), --batch and --steps must be at least 1".into());
    }
    schedule(&a).map_err(|e| e.to_string())?;
    if a.keep > 0 && a.checkpoint_dir.is_none() {
        return Err("--keep-checkpoints needs --checkpoint-dir and --checkpoint-every".into());
    }
    if a.async_save && a.checkpoint_dir.is_none() {
        return Err("--async-save needs --checkpoint-dir and --checkpoint-every".into());
    }
    if a.checkpoint_dir.is_some() != (a.checkpoint_every > 0) {
        return Err("--checkpoint-dir and --checkpoint-every N (N ≥ 1) go together".into());
    }
    if a.device.is_cuda() {
        if !cfg!(feature = "cuda") {
            return Err("--device cuda needs a build with the cuda feature: \
                        cargo run --release --features cuda --example train -- --device cuda"
                .into());
        }
        if a.checkpoint_dir.is_some() || a.resume.is_some() || a.save_full.is_some() || mpi_env().is_some() {
            return Err("--device cuda runs in-process ranks without checkpoints so far; \
                        drop --checkpoint-dir, --resume, --save-full (and mpirun)"
                .into());
        }
    }
    if a.sequence_parallel && a.tp == 0 {
        return Err("--sequence-parallel needs --tp T".into());
    }
    if a.tp > 0 {
        if a.mesh.len() == 2 {
            a.mesh.push(a.tp);
        } else if !a.world.is_multiple_of(a.tp) {
            return Err(format!("--tp {} must divide --world-size {}", a.tp, a.world));
        } else {
            a.mesh = vec![a.world / a.tp, a.tp];
        }
    }
    Ok(a)
}

impl Args {
    /// Data-parallel ranks: each takes `batch` rows.
    fn dp(&self) -> usize {
        self.world.checked_div(self.tp).unwrap_or(self.world)
    }

    /// Rows of a step over all data-parallel ranks.
    fn global_batch(&self) -> usize {
        self.dp() * self.batch
    }
}

/// Token rows `[world·batch, seq+1]` of `step`: from the file if given, else generated.
fn rows(args: &Args, file: Option<&Tensor>, step: usize) -> Result<Tensor, BoxError> {
    let g = args.global_batch();
    let len = args.model.seq + 1;
    match file {
        Some(t) => {
            let s = t.shape();
            if s.len() != 3 || s[2] != len || s[1] < g || step >= s[0] {
                return Err(format!(
                    "--tokens holds {s:?}; this run needs [≥{} steps, ≥{g} rows, {len}]",
                    args.steps
                )
                .into());
            }
            Ok(t.narrow(0, step, 1)?.narrow(1, 0, g)?.contiguous().reshape(&[g, len])?)
        }
        None => {
            let v = batch(args.data_seed, step as u64, 0..g as u64, len, args.model.vocab as u64);
            Ok(Tensor::from_vec(v, &[g, len])?)
        }
    }
}

#[derive(Default)]
struct RankReport {
    /// The step the run started from (0, or the resumed checkpoint's).
    first_step: usize,
    losses: Vec<f64>,
    step_time_s: Vec<f64>,
    /// Every rank's peak tensor memory (gathered, so MPI's rank 0 knows them all).
    peak_bytes: Vec<usize>,
    /// Per checkpoint: the seconds training waited for it (the whole save, or
    /// for a background one its staging and the end of the one before).
    save_s: Vec<f64>,
    /// Per completed checkpoint: bytes all ranks wrote together.
    saved_bytes: Vec<u64>,
    /// Every rank's tracked peak while materialising the model, and its shards' bytes.
    init_peak_bytes: Vec<usize>,
    /// Peak bytes of device tensors per rank (0 on the CPU).
    device_peak_bytes: Vec<usize>,
    /// On a GPU: the caching allocator's reserved bytes after each step, and
    /// its peak allocated and reserved bytes (all ranks on the GPU together).
    device_reserved_bytes: Vec<usize>,
    device_allocator_peaks: (usize, usize),
    init_local_bytes: Vec<usize>,
    /// Bytes this rank read resuming, and the seconds it took.
    resume_bytes: u64,
    resume_s: f64,
}

/// Records a completed checkpoint `name` in `dir`: `latest` names it (rank 0
/// writes) and the report gets the bytes all ranks wrote. Collective.
fn finish_save(
    mesh: &DeviceMesh,
    dir: &std::path::Path,
    name: &str,
    saved: &SaveReport,
    keep: usize,
    report: &mut RankReport,
) -> Result<(), BoxError> {
    let total: i64 = mesh.comm().all_gather_vec(&[saved.bytes_written as i64])?.iter().sum();
    if mesh.comm().rank() == 0 {
        write_atomic(dir.join("latest"), name.as_bytes())?;
        if keep > 0 {
            // Step directories sort by step; `latest` now names the newest. Only
            // complete checkpoints count (a valid index.json): never a
            // temporary (hidden, and not `step_`) nor a damaged directory.
            let mut steps: Vec<String> = std::fs::read_dir(dir)?
                .filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with("step_") && n.as_str() <= name)
                .filter(|n| Checkpoint::open(dir.join(n)).is_ok())
                .collect();
            steps.sort();
            // Retired through a temporary: a kill mid-delete leaves no
            // half-deleted checkpoint, only a temporary the next save removes.
            for old in &steps[..steps.len().saturating_sub(keep)] {
                remove_checkpoint(&dir.join(old))?;
            }
        }
    }
    report.saved_bytes.push(total as u64);
    Ok(())
}

/// The checkpoint `--resume` names: a checkpoint directory, or a `--checkpoint-dir`
/// whose `latest` file names the newest one.
fn resume_dir(path: &std::path::Path) -> Result<PathBuf, BoxError> {
    if path.join("index.json").exists() {
        return Ok(path.to_path_buf());
    }
    let latest = path.join("latest");
    let name = std::fs::read_to_string(&latest).map_err(|e| {
        format!(
            "--resume {}: neither a checkpoint (no index.json) nor a checkpoint directory ({}: {e})",
            path.display(),
            latest.display()
        )
    })?;
    Ok(path.join(name.trim()))
}

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
    let tokens = read_tokens(args)?;
    let lead = is_lead_process();
    if lead {
        println!("{}", banner(args));
    }
    let reports = launch(args.world, {
        let args = args.clone();
        move |ctx| train_rank(ctx, &args, tokens.as_ref())
    })?;
    if lead {
        summarize(args, &reports[0])?;
    }
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

/// The line that says what this run trains, and how it is parallelised.
fn banner(args: &Args) -> String {
    let cfg = args.model;
    let layout = if args.tp > 0 {
        let sp = if args.sequence_parallel {
            " with sequence parallelism"
        } else {
            ""
        };
        if args.mesh.len() == 3 {
            format!(
                "HSDP over (dp_replicate, dp_shard) on TP over {} ranks{sp}: a {}x{}x{} mesh",
                args.tp, args.mesh[0], args.mesh[1], args.mesh[2]
            )
        } else {
            format!(
                "FSDP over dp on TP over {} ranks{sp}: a (dp, tp) = {}x{} mesh",
                args.tp, args.mesh[0], args.mesh[1]
            )
        }
    } else if args.mesh.len() == 2 {
        format!("HSDP on a {}x{} mesh (replicate x shard)", args.mesh[0], args.mesh[1])
    } else {
        format!("FSDP on {} ranks", args.world)
    };
    format!(
        "training a {}-layer Transformer (dim {}, {} heads, vocab {}, seq {}; {} parameters), {layout}, \
         global batch {}{}{}{}",
        cfg.n_layers,
        cfg.dim,
        cfg.n_heads,
        cfg.vocab,
        cfg.seq,
        cfg.num_params(),
        args.global_batch(),
        if args.bf16 { ", bf16 mixed precision" } else { "" },
        if args.no_reshard {
            ", no reshard after forward"
        } else {
            ""
        },
        if args.device.is_cuda() {
            format!(", on {} (ranks sharing it)", args.device)
        } else {
            String::new()
        },
    )
}

/// One rank's model, optimizer and mesh, ready to train.
struct Job {
    mesh: DeviceMesh,
    model: Transformer,
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
fn setup(ctx: RankCtx, args: &Args) -> Result<Job, BoxError> {
    let rank = ctx.rank();
    let names: &[&str] = match (args.tp > 0, args.mesh.len()) {
        (true, 3) => &["dp_replicate", "dp_shard", "tp"],
        (true, _) => &["dp", "tp"],
        (false, 2) => &["dp_replicate", "dp_shard"],
        (false, _) => &["dp"],
    };
    let mesh = DeviceMesh::with_names(ctx.into_comm(), &args.mesh, names)?.on_device(args.device);
    let model = Transformer::new(args.model, &mesh, DType::F32)?;
    let params = model.parameters();
    let fsdp = FsdpConfig {
        reshard_after_forward: args.no_reshard.then_some(false),
        mp_policy: if args.bf16 {
            MixedPrecisionPolicy::bf16()
        } else {
            MixedPrecisionPolicy::default()
        },
        ..FsdpConfig::default()
    };
    let batch_placements = if args.tp > 0 {
        let applied = model.parallelize(&mesh.dim("tp")?, args.sequence_parallel)?;
        if rank == 0 && is_lead_process() {
            println!("plan:");
            for a in &applied {
                println!("  {:<28} {}", a.fqn, a.style);
            }
        }
        let dp = mesh.slice(&names[..names.len() - 1])?;
        model.fully_shard(&dp, &fsdp)?;
        let mut p = vec![Placement::Shard(0); args.mesh.len()];
        p[args.mesh.len() - 1] = Placement::Replicate;
        p
    } else {
        model.fully_shard(&mesh, &fsdp)?;
        vec![Placement::Shard(0); args.mesh.len()]
    };
    let init = match &args.init {
        Some(path) => Materializer::from_safetensors(path),
        None => Materializer::from_seed(args.seed),
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
fn resume(args: &Args, path: &std::path::Path, job: &mut Job, report: &mut RankReport) -> Result<(), BoxError> {
    let t = Instant::now();
    let dir = resume_dir(path)?;
    let r = load_checkpoint(&dir, &job.params, Some(&mut job.opt))?;
    report.resume_s = t.elapsed().as_secs_f64();
    report.first_step = r
        .metadata
        .get("step")
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("{}: no step in the checkpoint's metadata", dir.display()))?;
    report.resume_bytes = r.bytes_read;
    // The schedule resumes from its saved state (a checkpoint saved without one
    // resumes at its step, from the base learning rate of this run).
    let mut state = r.metadata.clone();
    state
        .entry("lr_scheduler.step".into())
        .or_insert_with(|| report.first_step.to_string());
    state
        .entry("lr_scheduler.base_lr".into())
        .or_insert_with(|| args.lr.to_string());
    job.sched.load_state(&state, &mut job.opt)?;
    if report.first_step >= args.steps {
        return Err(format!(
            "--resume: the checkpoint is from step {}, --steps is {}: nothing left to train",
            report.first_step, args.steps
        )
        .into());
    }
    Ok(())
}

/// One training step on the rows of `step`: forward, backward, the optimizer's
/// update. Returns the loss.
fn train_step(args: &Args, job: &mut Job, tokens: Option<&Tensor>, step: usize) -> Result<f64, BoxError> {
    // Every rank builds the same global rows of the step (seeded by the step):
    // each keeps its piece, with no hash exchange per step.
    let x = distribute_tensor_from(&rows(args, tokens, step)?, &job.mesh, &job.batch_placements, None)?;
    let loss = job.model.loss(&Var::constant(x))?;
    let value = loss.value().full_tensor()?.to_f64_vec()[0];
    backward(&loss)?;
    job.opt.step()?;
    job.sched.step(&mut job.opt)?;
    job.opt.zero_grad();
    Ok(value)
}

/// The checkpoints of a run: the background saver and the name of the save in
/// flight in it.
#[derive(Default)]
struct Checkpoints {
    background: AsyncCheckpointer,
    pending: Option<String>,
}

impl Checkpoints {
    /// Saves after `step` (0-based) when `--checkpoint-every` says so, and records
    /// a checkpoint that completed (this one, or in the background the one before).
    fn after_step(&mut self, args: &Args, job: &Job, step: usize, report: &mut RankReport) -> Result<(), BoxError> {
        let Some(dir) = &args.checkpoint_dir else {
            return Ok(());
        };
        if !(step + 1).is_multiple_of(args.checkpoint_every) {
            return Ok(());
        }
        let t = Instant::now();
        let name = format!("step_{:06}", step + 1);
        let mut meta = job.sched.state();
        meta.insert("step".to_string(), (step + 1).to_string());
        let done = if args.async_save {
            let previous = self
                .background
                .save(dir.join(&name), &job.params, Some(&job.opt), meta)?;
            previous.zip(self.pending.replace(name))
        } else {
            Some((
                save_checkpoint(dir.join(&name), &job.params, Some(&job.opt), meta)?,
                name,
            ))
        };
        report.save_s.push(t.elapsed().as_secs_f64());
        if let Some((saved, finished)) = done {
            finish_save(&job.mesh, dir, &finished, &saved, args.keep, report)?;
        }
        Ok(())
    }

    /// Waits for the background save in flight, if any, and records it.
    fn finish(mut self, args: &Args, job: &Job, report: &mut RankReport) -> Result<(), BoxError> {
        if let (Some(dir), Some(saved), Some(name)) =
            (&args.checkpoint_dir, self.background.wait()?, self.pending.take())
        {
            finish_save(&job.mesh, dir, &name, &saved, args.keep, report)?;
        }
        Ok(())
    }
}

/// What every rank runs: setup, resumption, the steps with their checkpoints,
/// the final saves, and the report (with every rank's peak memory).
fn train_rank(ctx: RankCtx, args: &Args, tokens: Option<&Tensor>) -> Result<RankReport, BoxError> {
    let rank = ctx.rank();
    let mut job = setup(ctx, args)?;
    let mut report = RankReport::default();
    if let Some(path) = &args.resume {
        resume(args, path, &mut job, &mut report)?;
    }
    let mut checkpoints = Checkpoints::default();
    memory::reset_peak();
    memory::reset_device_peak();
    let start = Instant::now();
    let tokens_per_step = (args.global_batch() * args.model.seq) as f64;
    for step in report.first_step..args.steps {
        let t = Instant::now();
        let value = train_step(args, &mut job, tokens, step)?;
        report.losses.push(value);
        report.step_time_s.push(t.elapsed().as_secs_f64());
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
    checkpoints.finish(args, &job, &mut report)?;
    if let Some(path) = &args.save_full {
        save_state_dict_full(&job.params, path)?;
    }
    let (peak, device_peak) = (memory::stats().peak_bytes, memory::device_stats().peak_bytes);
    let all = job
        .mesh
        .comm()
        .all_gather_vec(&[peak, job.init.peak_bytes, job.init.local_bytes, device_peak].map(|b| b as i64))?;
    let column = |i: usize| all.chunks(4).map(|c| c[i] as usize).collect();
    (report.peak_bytes, report.init_peak_bytes, report.init_local_bytes) = (column(0), column(1), column(2));
    report.device_peak_bytes = column(3);
    if let Some((_, allocated, reserved)) = device_memory(args)? {
        report.device_allocator_peaks = (allocated, reserved);
    }
    Ok(report)
}

/// On a GPU: the caching allocator's reserved bytes now, and its peak
/// allocated and reserved bytes (all ranks on the GPU together).
fn device_memory(args: &Args) -> Result<Option<(usize, usize, usize)>, BoxError> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(n) = args.device {
        let s = tessera::tensor::cuda::memory_stats(n)?;
        return Ok(Some((s.reserved_bytes, s.peak_allocated_bytes, s.peak_reserved_bytes)));
    }
    let _ = args;
    Ok(None)
}

/// Prints the run's summary from rank 0's report and writes `--losses-out`.
fn summarize(args: &Args, r0: &RankReport) -> Result<(), BoxError> {
    let cfg = args.model;
    println!();
    let total: f64 = r0.step_time_s.iter().sum();
    let tokens_seen = ((args.steps - r0.first_step) * args.global_batch() * cfg.seq) as f64;
    let peak = r0.peak_bytes.iter().copied().max().unwrap_or(0);
    // One unsharded rank holds every parameter, its gradient and two AdamW
    // states in f32 before any activation.
    let unsharded = 16 * cfg.num_params();
    println!(
        "done on mesh {:?}: loss {:.4} -> {:.4}; {:.0} tokens/s; peak tensor memory per rank {} (one unsharded rank \
         needs {} for parameters, gradients and AdamW states alone)",
        args.mesh,
        r0.losses[0],
        r0.losses[r0.losses.len() - 1],
        tokens_seen / total,
        human(peak),
        human(unsharded)
    );
    if args.device.is_cuda() {
        let reserved = &r0.device_reserved_bytes;
        println!(
            "device: peak tensor memory per rank {} (all ranks {}); the allocator on {}: peak in use {}, \
             peak reserved {}, reserved after step 1 {} and after step {} {}",
            human(r0.device_peak_bytes.iter().copied().max().unwrap_or(0)),
            human(r0.device_peak_bytes.iter().sum()),
            args.device,
            human(r0.device_allocator_peaks.0),
            human(r0.device_allocator_peaks.1),
            human(reserved.first().copied().unwrap_or(0)),
            reserved.len(),
            human(reserved.last().copied().unwrap_or(0)),
        );
    }
    let rss = common::peak_rss_bytes();
    println!(
        "init: {} per rank at most while materialising (its shards: {}); process peak RSS {}",
        human(r0.init_peak_bytes.iter().copied().max().unwrap_or(0)),
        human(r0.init_local_bytes.iter().copied().max().unwrap_or(0)),
        rss.map_or_else(|| "unknown".to_string(), human)
    );
    if let Some(path) = &args.resume {
        println!(
            "resumed from {} after step {} in {:.3} s: {} read by rank 0",
            path.display(),
            r0.first_step,
            r0.resume_s,
            human(r0.resume_bytes as usize)
        );
    }
    if let Some(bytes) = r0.saved_bytes.last() {
        let n = r0.save_s.len();
        let secs: f64 = r0.save_s.iter().sum();
        println!(
            "checkpoints: {n} saved in {}{}, training waited {:.3} s per save on average; {} written per save by \
             all ranks together",
            args.checkpoint_dir
                .as_ref()
                .map_or(String::new(), |d| d.display().to_string()),
            if args.async_save { " in the background" } else { "" },
            secs / n as f64,
            human(*bytes as usize)
        );
    }
    if let Some(path) = &args.save_full {
        println!("wrote the consolidated state dict {}", path.display());
    }
    if let Some(path) = &args.losses_out {
        let json = serde_json::json!({
            "loss": r0.losses,
            "step_time_s": r0.step_time_s,
            "peak_bytes_per_rank": r0.peak_bytes,
            "init_peak_bytes_per_rank": r0.init_peak_bytes,
            "device_peak_bytes_per_rank": r0.device_peak_bytes,
            "device_reserved_bytes_per_step": r0.device_reserved_bytes,
            "device_allocator_peak_allocated_bytes": r0.device_allocator_peaks.0,
            "device_allocator_peak_reserved_bytes": r0.device_allocator_peaks.1,
            "peak_rss_bytes": rss,
        });
        common::write_atomic(path, &serde_json::to_string_pretty(&json)?)?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

/// A bar redrawn in place on a terminal; in a redirected log, one line at the
/// first step, every tenth of the run and at the last step instead of `\r` frames. Under an
/// MPI launcher, always lines: `mpirun` gives each rank a pseudo-terminal and
/// forwards it to wherever its own output goes, usually a log.
fn progress(step: usize, steps: usize, loss: f64, tok_s: f64) {
    use std::io::IsTerminal as _;
    if !std::io::stdout().is_terminal() || tessera::mpi_env().is_some() {
        if step == 1 || step == steps || step.is_multiple_of(steps.div_ceil(10)) {
            println!("step {step}/{steps}  loss {loss:.4}  {tok_s:.0} tok/s");
        }
        return;
    }
    const WIDTH: usize = 30;
    let filled = step * WIDTH / steps;
    print!(
        "\r[{}{}] step {step}/{steps}  loss {loss:.4}  {tok_s:.0} tok/s",
        "#".repeat(filled),
        " ".repeat(WIDTH - filled)
    );
    let _ = std::io::stdout().flush();
}

fn human(bytes: usize) -> String {
    const UNITS: [&str; 4] = ["B", "KiB", "MiB", "GiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    format!("{v:.1} {}", UNITS[u])
}
