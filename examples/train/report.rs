//! What a run reports: the banner, per-rank reports, progress and the summary.

use std::io::Write as _;

use tessera::BoxError;
use tessera::mesh::{CommCounts, OpKind, observe};
use tessera::models::ActivationCheckpointing;
use tessera::plan::Machine;
use tessera::tensor::profile::{Kind, OpTime, Profile};

use crate::Planned;
use crate::args::Args;
use crate::common;
use crate::metrics;

#[derive(Default)]
pub(crate) struct RankReport {
    /// The step the run started from (0, or the resumed checkpoint's).
    pub(crate) first_step: usize,
    pub(crate) losses: Vec<f64>,
    pub(crate) step_time_s: Vec<f64>,
    /// The process's minor page faults during each step (rank 0 counts them
    /// for every rank's thread together; empty where the system does not say).
    pub(crate) minor_faults: Vec<u64>,
    /// Every rank's peak tensor memory (gathered, so MPI's rank 0 knows them all).
    pub(crate) peak_bytes: Vec<usize>,
    /// Every rank's peak of reserved host bytes: in use plus its cache's.
    pub(crate) peak_reserved_bytes: Vec<usize>,
    /// Per checkpoint: the seconds training waited for it (the whole save, or
    /// for a background one its staging and the end of the one before).
    pub(crate) save_s: Vec<f64>,
    /// Per completed checkpoint: bytes all ranks wrote together.
    pub(crate) saved_bytes: Vec<u64>,
    /// Every rank's tracked peak while materialising the model, and its shards' bytes.
    pub(crate) init_peak_bytes: Vec<usize>,
    /// Peak bytes of device tensors per rank (0 on the CPU).
    pub(crate) device_peak_bytes: Vec<usize>,
    /// On a GPU: the caching allocator's reserved bytes after each step, and
    /// its peak allocated and reserved bytes (all ranks on the GPU together).
    pub(crate) device_reserved_bytes: Vec<usize>,
    pub(crate) device_allocator_peaks: (usize, usize),
    /// On a GPU, per step: how many times the host waited for the device, and
    /// the seconds until the step was queued (before its loss was read).
    pub(crate) device_host_waits: Vec<u64>,
    pub(crate) queued_s: Vec<f64>,
    pub(crate) init_local_bytes: Vec<usize>,
    /// Bytes this rank read resuming, and the seconds it took.
    pub(crate) resume_bytes: u64,
    pub(crate) resume_s: f64,
    /// Rank 0's profile (`--profile`).
    pub(crate) profile: Option<StepProfile>,
    /// The rank's events and collective counters over the steps
    /// (`--comm-report`, `--trace`).
    pub(crate) observed: Option<Observed>,
    /// The rank's collectives over the steps (calls and bytes per kind).
    pub(crate) comm: Option<tessera::mesh::CommCounts>,
}

/// A rank's recorded steps (`--comm-report`, `--trace`).
pub(crate) struct Observed {
    pub(crate) rank: usize,
    pub(crate) events: Vec<observe::Event>,
    /// The rank's collective counters over the same steps.
    pub(crate) counters: CommCounts,
}

/// Writes `--comm-report` (the first rank of this process's: rank 0 in the
/// lead process, printed there too) and `--trace` (every rank of this process;
/// under MPI each process its own file, `PATH.rankN` but for the lead's).
pub(crate) fn write_observed(args: &Args, reports: &[RankReport], lead: bool) -> Result<(), BoxError> {
    let observed: Vec<&Observed> = reports.iter().filter_map(|r| r.observed.as_ref()).collect();
    let Some(first) = observed.first() else {
        return Ok(());
    };
    let suffix = |p: &std::path::Path| {
        if lead {
            p.to_path_buf()
        } else {
            std::path::PathBuf::from(format!("{}.rank{}", p.display(), first.rank))
        }
    };
    if let Some(path) = &args.comm_report {
        let report = observe::CommReport::from_events(&first.events);
        if lead {
            println!("collectives of rank {} over {} steps:", first.rank, args.steps);
            print!("{report}");
        }
        let counters = OpKind::ALL
            .iter()
            .filter(|k| !matches!(k, OpKind::Barrier | OpKind::Split))
            .map(|&k| {
                format!(
                    "\"{}\": {{\"calls\": {}, \"bytes\": {}}}",
                    k.name(),
                    first.counters.calls(k),
                    first.counters.bytes(k)
                )
            })
            .collect::<Vec<_>>()
            .join(", ");
        let json = format!(
            "{{\"rank\": {}, \"steps\": {}, \"report\": {}, \"counters\": {{{counters}}}}}\n",
            first.rank,
            args.steps,
            report.to_json()
        );
        common::write_atomic(&suffix(path), &json)?;
    }
    if let Some(path) = &args.op_log {
        common::write_atomic(&suffix(path), &observe::op_log_json(&first.events))?;
        if lead {
            let ops = observe::op_log_entries(&first.events).len();
            println!(
                "wrote the op log of rank {} ({ops} ops) to {}",
                first.rank,
                suffix(path).display()
            );
        }
    }
    if let Some(path) = &args.trace {
        let ranks: Vec<(usize, Vec<observe::Event>)> = observed.iter().map(|o| (o.rank, o.events.clone())).collect();
        common::write_atomic(&suffix(path), &observe::chrome_trace(&ranks))?;
        if lead {
            println!(
                "wrote the trace of {} rank(s) to {}",
                ranks.len(),
                suffix(path).display()
            );
        }
    }
    Ok(())
}

/// Where rank 0's time went over the profiled steps (`--profile`).
pub(crate) struct StepProfile {
    /// Steps profiled, and their wall time together.
    pub(crate) steps: usize,
    pub(crate) step_s: f64,
    /// Exclusive time per kind of work, and per op's local kernels.
    pub(crate) kinds: Profile,
    pub(crate) ops: Vec<OpTime>,
}

impl StepProfile {
    /// The table `--profile` prints: per kind, then the ops by time (ms per step).
    fn print(&self, on_device: bool) {
        let n = self.steps.max(1) as f64;
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3 / n;
        let step_ms = self.step_s * 1e3 / n;
        println!(
            "profile of rank 0 over {} steps{}: {step_ms:.2} ms per step",
            self.steps,
            if on_device {
                " (every op waits for its GPU kernels)"
            } else {
                ""
            }
        );
        let mut covered = 0.0;
        for k in Kind::ALL {
            let t = ms(self.kinds.time(k));
            covered += t;
            if self.kinds.count(k) > 0 {
                println!(
                    "  {:<14} {t:8.2} ms  {:5.1}%  {:7.0} calls",
                    k.name(),
                    100.0 * t / step_ms,
                    self.kinds.count(k) as f64 / n
                );
            }
        }
        println!(
            "  {:<14} {:8.2} ms  {:5.1}%  (autograd, FSDP hooks, dispatch outside the timed kernels)",
            "other",
            (step_ms - covered).max(0.0),
            100.0 * (step_ms - covered).max(0.0) / step_ms
        );
        let mut ops = self.ops.clone();
        ops.sort_by_key(|o| std::cmp::Reverse(o.time));
        println!("  ops by time (local kernels):");
        for o in ops.iter().take(24) {
            let t = ms(o.time);
            println!(
                "    {:<28} {:<12} {t:8.3} ms  {:5.1}%  {:6.0} calls  {:8.1} us/call",
                o.op,
                o.kind.name(),
                100.0 * t / step_ms,
                o.count as f64 / n,
                o.time.as_secs_f64() * 1e6 / o.count.max(1) as f64
            );
        }
    }
}

/// The line that says what this run trains, and how it is parallelised.
pub(crate) fn banner(args: &Args) -> String {
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
        "training a {} ({} parameters), {layout}, global batch {}{}{}{}{}",
        args.describe(),
        args.num_params(),
        args.global_batch(),
        if args.bf16 { ", bf16 mixed precision" } else { "" },
        match (args.no_reshard, args.reshard_to) {
            (true, _) => ", no reshard after forward".to_string(),
            (false, Some(n)) => format!(", resharded to groups of {n} after forward"),
            (false, None) => String::new(),
        },
        match args.ac {
            ActivationCheckpointing::None => String::new(),
            ActivationCheckpointing::Full => ", every block recomputed in backward".to_string(),
            ActivationCheckpointing::EveryNth(n) => format!(", one block in {n} recomputed in backward"),
        },
        if args.device.is_cuda() {
            format!(", on {} (ranks sharing it)", args.device)
        } else {
            String::new()
        },
    )
}

/// Prints the run's summary from rank 0's report and writes `--losses-out`.
pub(crate) fn summarize(args: &Args, r0: &RankReport, peak_flops: Option<(f64, usize)>) -> Result<(), BoxError> {
    let cfg = args.model;
    println!();
    let total: f64 = r0.step_time_s.iter().sum();
    let tokens_seen = ((args.steps - r0.first_step) * args.global_batch() * cfg.seq) as f64;
    let peak = r0.peak_bytes.iter().copied().max().unwrap_or(0);
    // One unsharded rank holds every parameter, its gradient and two AdamW
    // states in f32 before any activation.
    let unsharded = 16 * args.num_params();
    println!(
        "done on mesh {:?}: loss {:.4} -> {:.4}; {:.0} tokens/s; peak tensor memory per rank {} in use, {} reserved \
         with the host cache (one unsharded rank needs {} for parameters, gradients and AdamW states alone)",
        args.mesh,
        r0.losses[0],
        r0.losses[r0.losses.len() - 1],
        tokens_seen / total,
        human(peak),
        human(r0.peak_reserved_bytes.iter().copied().max().unwrap_or(0)),
        human(unsharded)
    );
    // Model FLOPs (6 per parameter and token, plus attention) against the
    // f32 FMA peak of the cores, measured before training.
    let achieved = tokens_seen / total * metrics::flops_per_token(args);
    match peak_flops {
        Some((p, cores)) if !args.device.is_cuda() => println!(
            "model FLOPs utilisation {:.1}%: {:.2} GFLOP/s of the f32 FMA peak {:.1} GFLOP/s ({cores} cores at {:.1}, \
             measured)",
            100.0 * achieved / p,
            achieved / 1e9,
            p / 1e9,
            p / 1e9 / cores as f64
        ),
        _ => {}
    }
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
        if !r0.queued_s.is_empty() {
            let waits: Vec<f64> = r0.device_host_waits.iter().map(|&w| w as f64).collect();
            println!(
                "device: per step (medians) the host waited {} time(s) for the GPU and had queued the step after \
                 {:.2} ms of its {:.2} ms",
                common::median(&waits),
                common::median(&r0.queued_s) * 1e3,
                common::median(&r0.step_time_s) * 1e3
            );
        }
    }
    if let Some(p) = &r0.profile {
        p.print(args.device.is_cuda());
    }
    let rss = common::peak_rss_bytes();
    println!(
        "init: {} per rank at most while materialising (its shards: {}); process peak RSS {}",
        human(r0.init_peak_bytes.iter().copied().max().unwrap_or(0)),
        human(r0.init_local_bytes.iter().copied().max().unwrap_or(0)),
        rss.map_or_else(|| "unknown".to_string(), human)
    );
    if let Some(faults) = steady_faults(&r0.minor_faults) {
        println!(
            "host memory: {faults:.0} minor page faults per step after the first two (median; the process, all ranks)"
        );
    }
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
    if let Some(dir) = &args.save_hf {
        println!(
            "wrote the model for Hugging Face's LlamaForCausalLM in {}",
            dir.display()
        );
    }
    if let Some(path) = &args.losses_out {
        let json = serde_json::json!({
            "loss": r0.losses,
            "step_time_s": r0.step_time_s,
            "peak_bytes_per_rank": r0.peak_bytes,
            "peak_reserved_bytes_per_rank": r0.peak_reserved_bytes,
            "init_peak_bytes_per_rank": r0.init_peak_bytes,
            "device_peak_bytes_per_rank": r0.device_peak_bytes,
            "device_reserved_bytes_per_step": r0.device_reserved_bytes,
            "device_allocator_peak_allocated_bytes": r0.device_allocator_peaks.0,
            "device_allocator_peak_reserved_bytes": r0.device_allocator_peaks.1,
            "device_host_waits_per_step": r0.device_host_waits,
            "queued_s_per_step": r0.queued_s,
            "peak_rss_bytes": rss,
            "minor_faults_per_step": r0.minor_faults,
            "tokens_per_s": tokens_seen / total,
            "model_flops_per_s": achieved,
            "mfu": peak_flops.map(|(p, _)| achieved / p),
        });
        common::write_atomic(path, &serde_json::to_string_pretty(&json)?)?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

/// The median minor page faults of the steps after the first two (the
/// first steps fill the caches), or `None` without such steps.
fn steady_faults(per_step: &[u64]) -> Option<f64> {
    let steady: Vec<f64> = per_step.iter().skip(2).map(|&f| f as f64).collect();
    (!steady.is_empty()).then(|| common::median(&steady))
}

/// A bar redrawn in place on a terminal; in a redirected log, one line at the
/// first step, every tenth of the run and at the last step instead of `\r` frames. Under an
/// MPI launcher, always lines: `mpirun` gives each rank a pseudo-terminal and
/// forwards it to wherever its own output goes, usually a log.
pub(crate) fn progress(step: usize, steps: usize, loss: f64, tok_s: f64) {
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

pub(crate) fn human(bytes: usize) -> String {
    const UNITS: [&str; 4] = ["B", "KiB", "MiB", "GiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    format!("{v:.1} {}", UNITS[u])
}

/// `--plan`: rank 0's planned step as a table, every rank's planned peak, and
/// the step time estimated from the calibrated constants; with `--plan-out`
/// the JSON `{"peak_bytes_per_rank", "step_time_s", "machine", "ranks"}`.
pub(crate) fn print_plan(args: &Args, plans: &[Planned], m0: &Machine) -> Result<(), BoxError> {
    let p0 = &plans[0].plan;
    println!(
        "planned step on mesh {:?} (meta tensors: nothing computed, moved or allocated), rank 0:",
        args.mesh
    );
    print!("{}", p0.table());
    let peaks: Vec<usize> = plans[0].ranks.iter().map(|r| r.0).collect();
    let step_s = plans[0].step_time_s();
    println!(
        "peak per rank: {} (rank 0's in {}); estimated step time {:.4} s ({:.3} GFLOP/s per rank for products, {} per \
         second of collectives{})",
        peaks.iter().map(|&b| human(b)).collect::<Vec<_>>().join(", "),
        p0.peak_phase(),
        step_s,
        m0.flops_per_s / 1e9,
        if m0.bytes_per_s.is_finite() {
            human(m0.bytes_per_s as usize)
        } else {
            "∞".into()
        },
        match &args.machine {
            Some(p) => format!(", constants of {}", p.display()),
            None => ", calibrated".into(),
        }
    );
    if let Some(path) = &args.plan_out {
        let list = |v: Vec<String>| v.join(", ");
        let json = format!(
            "{{\"peak_bytes_per_rank\": [{}], \"step_time_s\": {step_s:.6e}, \"machine\": {}, \"ranks\": [{}]}}\n",
            list(peaks.iter().map(ToString::to_string).collect()),
            m0.to_json(),
            list(plans.iter().map(|p| p.plan.to_json()).collect())
        );
        common::write_atomic(path, &json)?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

/// After a run: the planned step against the measured one (rank 0's peak,
/// bytes sent per step, and the median step time).
pub(crate) fn compare_plan(args: &Args, plans: &[Planned], r0: &RankReport) {
    let planned_peak = plans[0].peak();
    let measured_peak = r0.peak_bytes.iter().copied().max().unwrap_or(0);
    let steps = (args.steps - r0.first_step).max(1) as u64;
    let measured_bytes = r0
        .comm
        .map_or(0, |c| OpKind::ALL.iter().map(|&k| c.bytes(k)).sum::<u64>() / steps);
    // The first two steps warm caches and the allocator; a run of two steps or
    // fewer has only those, and says so rather than printing no time.
    let warm_up = if r0.step_time_s.len() > 2 { 2 } else { 0 };
    let mut times = r0.step_time_s[warm_up..].to_vec();
    times.sort_by(f64::total_cmp);
    let measured_s = times.get(times.len() / 2).copied().unwrap_or(f64::NAN);
    let which = if warm_up > 0 {
        "median after two warm-up steps"
    } else {
        "median, warm-up steps included"
    };
    println!(
        "predicted against measured: peak per rank {} vs {} ({:+.2}%); rank 0's collectives {} vs {} bytes per step; \
         step time {:.4} vs {:.4} s ({which})",
        human(planned_peak),
        human(measured_peak),
        100.0 * (planned_peak as f64 / measured_peak.max(1) as f64 - 1.0),
        plans[0].plan.collective_bytes(),
        measured_bytes,
        plans[0].step_time_s(),
        measured_s
    );
}
