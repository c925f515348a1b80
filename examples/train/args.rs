//! The command line of `train`: flags, their defaults and checks.

use std::path::PathBuf;

use tessera::data::{DATA_SEED, batch};
use tessera::dtensor::{Device, Tensor};
use tessera::models::{ActivationCheckpointing, LlamaConfig, TransformerConfig, UnitLayout};
use tessera::{BoxError, mpi_env};

use crate::schedule;

pub(crate) const USAGE: &str = "usage: train [--world-size N | --mesh RxS] [--tp T [--sequence-parallel]] [--steps N] [--batch ROWS_PER_RANK] [--dim N] \
[--n-layers N] [--n-heads N] [--vocab N] [--seq N] [--model gpt|llama [--n-kv-heads K] [--ffn-hidden H] [--rope-theta F]] [--lr F] [--lr-schedule S] [--warmup-steps N] [--mixed-precision bf16] [--no-reshard | --reshard-to N] [--fsdp-units blocks|split-ends] [--activation-checkpointing none|full|N] [--init PATH | --seed N] \
[--tokens PATH] [--data-seed N] [--losses-out PATH] [--metrics-out PATH] [--checkpoint-dir DIR --checkpoint-every N [--async-save] [--keep-checkpoints K]] [--resume DIR [--resume-step K]] \
[--save-full PATH] [--save-hf DIR] [--device cpu|cuda|cuda:N] [--plan [--plan-out PATH]] [--machine PATH] [--auto --memory-budget SIZE] [--profile] [--comm-report PATH] [--trace PATH] [--op-log PATH [--op-log-values]]";

/// Every flag with its default (`train --help`).
pub(crate) const HELP: &str = "\
mesh and parallelism:
  --world-size N        ranks (default 4; under mpirun, the number of processes)
  --mesh RxS            HSDP: replicate over R, shard over S (default: FSDP over all ranks)
  --tp T                tensor parallelism over T ranks under FSDP (default 0: none)
  --sequence-parallel   the sequence-parallel TP plan (default: off)
  --mixed-precision M   bf16 or none (default none)
  --no-reshard          keep parameters gathered from forward to backward (default: reshard)
  --reshard-to N        after forward, keep parameters sharded over groups of N ranks of the
                        shard dim (N divides it), so backward gathers within a group
                        (default: reshard over the whole shard dim)
  --fsdp-units U        blocks (each block a unit, the root the rest: the default) or
                        split-ends (also the embeddings and the final norm with the output
                        head a unit each, the head's gather prefetched and its
                        reduce-scatter overlapped, as torchtitan does)
  --activation-checkpointing A
                        none, full (every block recomputes its activations in backward) or N
                        (every N-th block) (default none)
  --device D            cpu, or cuda / cuda:N: every rank computes on that GPU, ranks
                        sharing it as threads (needs a build with --features cuda;
                        default cpu)
model and data:
  --model M             gpt (learned positions, LayerNorm, GELU MLP: the default) or llama
                        (RMSNorm, rotary positions, grouped-query attention, SwiGLU)
  --dim N --n-layers N --n-heads N --vocab N --seq N
                        model sizes (default 64, 2, 4, 256, 32: the tiny reference)
  --n-kv-heads K        llama: key/value heads (default n_heads / 2, at least 1)
  --ffn-hidden H        llama: SwiGLU hidden units (default 3 * dim)
  --rope-theta F        llama: base of the rotary frequencies (default 10000)
  --init PATH           materialise from a safetensors state dict, each rank reading its bytes
                        (default: none, the model drawn from --seed)
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
  --losses-out PATH     JSON: losses, step times, peak memory per rank, init peak, peak RSS,
                        minor page faults per step (default: none)
  --metrics-out PATH    one JSON line per step: loss, lr, grad norm, step time, tokens/s,
                        model FLOPs utilisation, bytes in use and peak per rank (default: none)
  --checkpoint-dir DIR --checkpoint-every N
                        sharded checkpoints every N steps (default: none)
  --async-save          write checkpoints in the background (default: off)
  --keep-checkpoints K  keep the newest K complete checkpoints (default 0: all)
  --resume DIR          continue from a checkpoint saved on any mesh (default: none)
  --resume-step K       (with --resume) a checkpoint written elsewhere (PyTorch's sharded
                        safetensors) carries no training state: it stops after step K,
                        and the schedule starts there from --lr (default: the step the
                        checkpoint saved)
  --save-full PATH      consolidated safetensors state dict at the end (default: none)
  --save-hf DIR         (--model llama) the model as Hugging Face's LlamaForCausalLM loads it
                        (DIR/model.safetensors with its names, DIR/config.json) at the end
                        (default: none)
  --comm-report PATH    collectives per module, phase (forward, backward), mesh dims and kind,
                        with calls and bytes, over the steps: printed for rank 0 and
                        written to PATH as JSON with the rank's collective counters
                        (default: none)
  --trace PATH          a timeline of the steps as Chrome trace-event JSON (Perfetto,
                        chrome://tracing): a track per rank with steps, modules, ops,
                        collectives, FSDP's unshard/reshard/reduce_grads and memory,
                        and a communication track per rank (asynchronous collectives
                        as they ran) (default: none; under mpirun each process writes
                        PATH.rankN)
  --op-log PATH         every DTensor op of the steps with its module, inputs, output and the
                        redistributions it made (implicit) or was asked for (explicit), as
                        JSON (rank 0's; under mpirun each process writes PATH.rankN)
                        (default: none)
  --op-log-values       with --op-log: each op's global output sums too, for
                        `op_log_diff A B` to name the first op two runs disagree on
                        (slow: gathers every output) (default: off)
  --plan                plan one step on meta tensors (shapes, no values) and print, per rank,
                        its peak memory per phase, its collectives by mesh dims and kind, its
                        matrix-product FLOPs and an estimated step time from a short
                        calibration run, without training; a training run on the CPU plans
                        first and prints predicted against measured at the end
                        (default: off)
  --plan-out PATH       the plan as JSON: peak_bytes_per_rank, step_time_s, each rank's plan
                        (default: none)
  --auto --memory-budget SIZE
                        plan every layout of the ranks (FSDP, HSDP, TP splits, sequence
                        parallelism, resharding, integer resharding, bf16, recomputing no
                        block, every block or one in n; the global batch fixed), rank them
                        by estimated step time and train the fastest whose
                        planned peak per rank fits SIZE (4GiB, 512MiB, ...); with --plan, only
                        print the ranking (default: off, the layout the flags above name)
  --machine PATH        the machine constants step times are estimated from: read from PATH,
                        or, where PATH does not exist, calibrated (a short run) and saved there
                        (default: calibrated each run)
  --profile             print where rank 0's step time went, per op and kind of work, over
                        the steps after the first two (on a GPU every op waits for its
                        kernels, so steps run slower: device time per op) (default: off)
environment: TESSERA_TIMEOUT_S, TESSERA_THREADS_PER_RANK, TESSERA_BACKEND, TESSERA_BF16_DOT,
  TESSERA_SYSTEM_MALLOC, TESSERA_MPI_CHECK, TESSERA_STRICT_COLLECTIVES, TESSERA_FINGERPRINTS,
  TESSERA_DEBUG (off, ops or values: every rank prints its DTensor ops as they run)
  (see tessera::mesh::vars)";

/// The reference model `--model` names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Arch {
    /// `models::Transformer`.
    Gpt,
    /// `models::Llama`.
    Llama,
}

#[derive(Clone, Debug)]
pub(crate) struct Args {
    pub(crate) world: usize,
    /// `[R, S]` for HSDP, `[world]` for FSDP.
    pub(crate) mesh: Vec<usize>,
    pub(crate) bf16: bool,
    pub(crate) no_reshard: bool,
    /// Reshard after forward to groups of this many ranks (`--reshard-to`).
    pub(crate) reshard_to: Option<usize>,
    /// How the model is grouped into FSDP units (`--fsdp-units`).
    pub(crate) units: UnitLayout,
    /// Which blocks recompute their activations (`--activation-checkpointing`).
    pub(crate) ac: ActivationCheckpointing,
    /// Tensor-parallel ranks (0: no TP).
    pub(crate) tp: usize,
    pub(crate) sequence_parallel: bool,
    pub(crate) steps: usize,
    pub(crate) batch: usize,
    pub(crate) model: TransformerConfig,
    pub(crate) arch: Arch,
    /// LLaMA's sizes beyond `model` (`None`: the defaults).
    pub(crate) n_kv_heads: Option<usize>,
    pub(crate) ffn_hidden: Option<usize>,
    pub(crate) rope_theta: Option<f64>,
    pub(crate) lr: f64,
    /// `constant`, `cosine` (warmup then cosine to 0) or `wsd` (warmup, stable,
    /// linear decay over the last tenth).
    pub(crate) lr_schedule: String,
    pub(crate) warmup_steps: usize,
    pub(crate) init: Option<PathBuf>,
    /// The model seed (without `--init`).
    pub(crate) seed: u64,
    pub(crate) tokens: Option<PathBuf>,
    pub(crate) data_seed: u64,
    pub(crate) losses_out: Option<PathBuf>,
    /// One JSON line per step (`--metrics-out`).
    pub(crate) metrics_out: Option<PathBuf>,
    /// The collective report's JSON (`--comm-report`).
    pub(crate) comm_report: Option<PathBuf>,
    /// The Chrome trace (`--trace`).
    pub(crate) trace: Option<PathBuf>,
    /// The op log (`--op-log`), with values (`--op-log-values`).
    pub(crate) op_log: Option<PathBuf>,
    pub(crate) op_log_values: bool,
    pub(crate) checkpoint_dir: Option<PathBuf>,
    pub(crate) checkpoint_every: usize,
    pub(crate) async_save: bool,
    /// Completed checkpoints to keep (0: all).
    pub(crate) keep: usize,
    pub(crate) resume: Option<PathBuf>,
    /// `--resume-step`: the step a checkpoint without training state stops at.
    pub(crate) resume_step: Option<usize>,
    pub(crate) save_full: Option<PathBuf>,
    pub(crate) save_hf: Option<PathBuf>,
    /// Where the ranks compute (`--device`).
    pub(crate) device: Device,
    /// Time ops and kinds of work on rank 0 (`--profile`).
    pub(crate) profile: bool,
    /// Plan the step on meta tensors and print it, without training (`--plan`).
    pub(crate) plan: bool,
    /// The plan as JSON (`--plan-out`).
    pub(crate) plan_out: Option<PathBuf>,
    /// Choose the layout for `memory_budget` (`--auto`).
    pub(crate) auto: bool,
    /// Bytes per rank `--auto` may plan for (`--memory-budget`).
    pub(crate) memory_budget: Option<usize>,
    /// Saved machine constants (`--machine`).
    pub(crate) machine: Option<PathBuf>,
}

pub(crate) fn parse() -> Result<Args, String> {
    let mut a = Args {
        // Under mpirun: one rank per process.
        world: mpi_env().and_then(|e| e.size).unwrap_or(4),
        mesh: Vec::new(),
        bf16: false,
        no_reshard: false,
        reshard_to: None,
        units: UnitLayout::Blocks,
        ac: ActivationCheckpointing::None,
        tp: 0,
        sequence_parallel: false,
        steps: 50,
        batch: 2,
        model: TransformerConfig::TINY,
        arch: Arch::Gpt,
        n_kv_heads: None,
        ffn_hidden: None,
        rope_theta: None,
        lr: 1e-3,
        lr_schedule: "constant".to_string(),
        warmup_steps: 0,
        init: None,
        seed: 0,
        tokens: None,
        data_seed: DATA_SEED,
        losses_out: None,
        metrics_out: None,
        comm_report: None,
        trace: None,
        op_log: None,
        op_log_values: false,
        checkpoint_dir: None,
        checkpoint_every: 0,
        async_save: false,
        keep: 0,
        resume: None,
        resume_step: None,
        save_full: None,
        save_hf: None,
        device: Device::Cpu,
        profile: false,
        plan: false,
        plan_out: None,
        auto: false,
        memory_budget: None,
        machine: None,
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
        if flag == "--profile" {
            a.profile = true;
            continue;
        }
        if flag == "--plan" {
            a.plan = true;
            continue;
        }
        if flag == "--auto" {
            a.auto = true;
            continue;
        }
        if flag == "--op-log-values" {
            a.op_log_values = true;
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
            "--model" => {
                a.arch = match value.as_str() {
                    "gpt" => Arch::Gpt,
                    "llama" => Arch::Llama,
                    other => return Err(format!("--model: {other:?} (gpt or llama)")),
                }
            }
            "--n-kv-heads" => a.n_kv_heads = Some(num(&value)?),
            "--ffn-hidden" => a.ffn_hidden = Some(num(&value)?),
            "--rope-theta" => {
                a.rope_theta = Some(
                    value
                        .parse()
                        .map_err(|_| format!("--rope-theta: {value:?} is not a number"))?,
                )
            }
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
            "--metrics-out" => a.metrics_out = Some(value.into()),
            "--comm-report" => a.comm_report = Some(value.into()),
            "--trace" => a.trace = Some(value.into()),
            "--plan-out" => a.plan_out = Some(value.into()),
            "--memory-budget" => a.memory_budget = Some(parse_size(&value)?),
            "--machine" => a.machine = Some(value.into()),
            "--reshard-to" => a.reshard_to = Some(num(&value)?),
            "--fsdp-units" => a.units = value.parse().map_err(|e| format!("--fsdp-units: {e}"))?,
            "--activation-checkpointing" => {
                a.ac = value.parse().map_err(|e| format!("--activation-checkpointing: {e}"))?
            }
            "--op-log" => a.op_log = Some(value.into()),
            "--checkpoint-dir" => a.checkpoint_dir = Some(value.into()),
            "--checkpoint-every" => a.checkpoint_every = num(&value)?,
            "--keep-checkpoints" => a.keep = num(&value)?,
            "--resume" => a.resume = Some(value.into()),
            "--resume-step" => a.resume_step = Some(num(&value)?),
            "--save-full" => a.save_full = Some(value.into()),
            "--save-hf" => a.save_hf = Some(value.into()),
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
        if a.checkpoint_dir.is_some()
            || a.resume.is_some()
            || a.save_full.is_some()
            || a.save_hf.is_some()
            || mpi_env().is_some()
        {
            return Err("--device cuda runs in-process ranks without checkpoints so far; \
                        drop --checkpoint-dir, --resume, --save-full, --save-hf (and mpirun)"
                .into());
        }
    }
    if a.resume_step.is_some() && a.resume.is_none() {
        return Err("--resume-step names the step of the --resume checkpoint: give --resume DIR too".into());
    }
    if a.save_hf.is_some() && a.arch != Arch::Llama {
        return Err("--save-hf writes Hugging Face's LlamaForCausalLM: it needs --model llama".into());
    }
    if a.arch == Arch::Gpt && (a.n_kv_heads.is_some() || a.ffn_hidden.is_some() || a.rope_theta.is_some()) {
        return Err("--n-kv-heads, --ffn-hidden and --rope-theta are for --model llama".into());
    }
    if a.arch == Arch::Llama {
        a.llama().check().map_err(|e| format!("--model llama: {e}"))?;
    }
    if a.auto
        && (a.tp > 0
            || a.mesh.len() > 1
            || a.bf16
            || a.no_reshard
            || a.reshard_to.is_some()
            || a.ac != ActivationCheckpointing::None)
    {
        return Err(
            "--auto chooses the mesh, --tp, --mixed-precision, --no-reshard, --reshard-to and \
                    --activation-checkpointing: give only --world-size"
                .into(),
        );
    }
    if a.no_reshard && a.reshard_to.is_some() {
        return Err(
            "--no-reshard keeps parameters gathered; --reshard-to N reshards them to groups of N: give one".into(),
        );
    }
    if a.reshard_to == Some(0) {
        return Err("--reshard-to N: N must be at least 1 (it divides the shard dim's ranks)".into());
    }
    if a.memory_budget.is_some() && !a.auto {
        return Err("--memory-budget is the budget of --auto".into());
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

/// A size in bytes: a number with an optional unit (`B`, `KiB`, `MiB`, `GiB`,
/// `TiB`, or `KB`, `MB`, `GB` in powers of 1000).
fn parse_size(v: &str) -> Result<usize, String> {
    let v = v.trim();
    let split = v.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(v.len());
    let (num, unit) = (v[..split].trim(), v[split..].trim());
    let scale: f64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kib" => 1024.0,
        "mib" => 1024.0 * 1024.0,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        "tib" => 1024f64.powi(4),
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        _ => {
            return Err(format!(
                "--memory-budget {v:?}: the unit must be B, KiB, MiB, GiB, TiB, KB, MB or GB"
            ));
        }
    };
    match num.parse::<f64>() {
        Ok(n) if n.is_finite() && n > 0.0 && n * scale < usize::MAX as f64 => Ok((n * scale) as usize),
        _ => Err(format!(
            "--memory-budget {v:?}: give a positive size such as 4GiB or 512MiB"
        )),
    }
}

impl Args {
    /// Data-parallel ranks: each takes `batch` rows.
    pub(crate) fn dp(&self) -> usize {
        self.world.checked_div(self.tp).unwrap_or(self.world)
    }

    /// The LLaMA configuration of `--model llama`: the shared sizes, then its own.
    pub(crate) fn llama(&self) -> LlamaConfig {
        let m = self.model;
        LlamaConfig {
            vocab: m.vocab,
            dim: m.dim,
            n_layers: m.n_layers,
            n_heads: m.n_heads,
            n_kv_heads: self.n_kv_heads.unwrap_or((m.n_heads / 2).max(1)),
            ffn_hidden: self.ffn_hidden.unwrap_or(3 * m.dim),
            rope_theta: self.rope_theta.unwrap_or(10000.0),
            norm_eps: 1e-5,
            seq: m.seq,
        }
    }

    /// Parameters of the model (elements).
    pub(crate) fn num_params(&self) -> usize {
        match self.arch {
            Arch::Gpt => self.model.num_params(),
            Arch::Llama => self.llama().num_params(),
        }
    }

    /// The model in words, with its sizes.
    pub(crate) fn describe(&self) -> String {
        let m = self.model;
        match self.arch {
            Arch::Gpt => format!(
                "{}-layer Transformer (dim {}, {} heads, vocab {}, seq {})",
                m.n_layers, m.dim, m.n_heads, m.vocab, m.seq
            ),
            Arch::Llama => {
                let c = self.llama();
                format!(
                    "{}-layer LLaMA (dim {}, {} heads / {} kv heads, ffn {}, vocab {}, seq {}, rope theta {})",
                    c.n_layers, c.dim, c.n_heads, c.n_kv_heads, c.ffn_hidden, c.vocab, c.seq, c.rope_theta
                )
            }
        }
    }

    /// Rows of a step over all data-parallel ranks.
    pub(crate) fn global_batch(&self) -> usize {
        self.dp() * self.batch
    }
}

/// Token rows `[world·batch, seq+1]` of `step`: from the file if given, else generated.
pub(crate) fn rows(args: &Args, file: Option<&Tensor>, step: usize) -> Result<Tensor, BoxError> {
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
