//! `--profile`'s tables: where rank 0's time went per phase and kind of work,
//! its costliest op kernels, its GEMM rate against the FMA peak (and the model
//! FLOPs utilisation), and its FSDP units' collectives.

use tessera::fsdp::{CollectiveTimes, CommOverlap};
use tessera::tensor::profile::Kind;

use crate::Summary;
use crate::common::median;

/// Prints, per mode and phase, the median milliseconds per step of each kind of
/// work on rank 0, and the rest of the phase's median ("other").
pub(crate) fn print_profiles(s: &[Summary]) {
    println!();
    println!("where rank 0's time goes (ms per step, medians over the timed steps; exclusive times):");
    let mut head = format!("{:<8} {:<9} {:>8}", "mode", "phase", "total");
    for k in Kind::ALL {
        head += &format!(" {:>13}", k.name());
    }
    println!("{head} {:>8}", "other");
    for m in s {
        let totals = [m.forward_s, m.backward_s, m.optim_s];
        for (i, phase) in ["forward", "backward", "optimizer"].into_iter().enumerate() {
            let mut line = format!("{:<8} {phase:<9} {:>8.1}", m.mode.name(), totals[i] * 1e3);
            let mut covered = 0.0;
            for k in Kind::ALL {
                let t = median(
                    &m.rank0
                        .profiles
                        .iter()
                        .map(|p| p[i].time(k).as_secs_f64())
                        .collect::<Vec<_>>(),
                );
                covered += t;
                line += &format!(" {:>13.1}", t * 1e3);
            }
            println!("{line} {:>8.1}", (totals[i] - covered).max(0.0) * 1e3);
        }
    }
}

/// Prints, per FSDP unit of rank 0, how long its all-gathers and
/// reduce-scatters ran on the communication thread per step, how long the
/// rank waited for them (exposed), and the share of their run hidden behind
/// compute.
pub(crate) fn print_overlap(s: &[Summary], steps: usize) {
    let steps = steps.max(1) as f64;
    let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3 / steps;
    let pct = |t: &CollectiveTimes| {
        t.hidden_fraction()
            .map_or("-".to_string(), |f| format!("{:.0}%", 100.0 * f))
    };
    for m in s.iter().filter(|m| !m.rank0.overlap.is_empty()) {
        println!();
        println!(
            "rank 0's FSDP collectives per unit, {} (ms per step on the communication thread, ms the rank waited for \
             them, share hidden behind compute):",
            m.mode.name()
        );
        println!(
            "{:<10} {:>8} {:>10} {:>10} {:>7} {:>8} {:>10} {:>10} {:>7}",
            "unit", "gathers", "gather_ms", "exposed", "hidden", "scatters", "scatter_ms", "exposed", "hidden"
        );
        let row = |name: &str, o: &CommOverlap| {
            let (g, r) = (&o.all_gather, &o.reduce_scatter);
            println!(
                "{name:<10} {:>8.1} {:>10.2} {:>10.2} {:>7} {:>8.1} {:>10.2} {:>10.2} {:>7}",
                g.count as f64 / steps,
                ms(g.run),
                ms(g.exposed),
                pct(g),
                r.count as f64 / steps,
                ms(r.run),
                ms(r.exposed),
                pct(r)
            );
        };
        let mut total = CommOverlap::default();
        for (name, o) in &m.rank0.overlap {
            row(name, o);
            total += *o;
        }
        row("all", &total);
    }
}

/// Prints, per mode and phase, the ops whose local kernels took the most time on
/// rank 0 (mean ms per timed step, and kernels per step).
pub(crate) fn print_top_ops(s: &[Summary], top: usize) {
    println!();
    println!("rank 0's costliest op kernels (ms per step, exclusive; calls per step):");
    for m in s {
        let steps = m.rank0.profiles.len().max(1) as f64;
        for (i, phase) in ["forward", "backward", "optimizer"].into_iter().enumerate() {
            let mut ops = m.rank0.ops[i].clone();
            if ops.is_empty() {
                continue;
            }
            ops.sort_by_key(|o| std::cmp::Reverse(o.time));
            let line: Vec<String> = ops
                .iter()
                .take(top)
                .map(|o| {
                    format!(
                        "{} {:.1} ({:.0})",
                        o.op,
                        o.time.as_secs_f64() * 1e3 / steps,
                        o.count as f64 / steps
                    )
                })
                .collect();
            println!("{:<8} {phase:<9} {}", m.mode.name(), line.join(", "));
        }
    }
}

/// Rank 0's GEMMs (the products of `matmul` ops) in forward and backward,
/// from the profile: floating-point operations and time per timed step; and
/// the products inside the attention kernels (the only NN kernels that count
/// FLOPs), which the model FLOPs count too.
pub(crate) struct GemmRate {
    /// GFLOP per step of the `matmul` ops.
    pub(crate) gflop: f64,
    /// GFLOP per step of the attention kernels' products.
    pub(crate) attention_gflop: f64,
    /// Milliseconds per step.
    pub(crate) ms: f64,
    /// GFLOP/s on each of the rank's threads (the products' time is the rank's
    /// wall time, its threads working on them together).
    pub(crate) per_thread: f64,
}

impl GemmRate {
    /// Model FLOPs utilisation: the step's GEMM FLOPs (the `matmul` ops' and
    /// the attention products') at `peak` GFLOP/s per thread, over the
    /// measured step.
    pub(crate) fn mfu(&self, peak: f64, x: &Summary) -> f64 {
        (self.gflop + self.attention_gflop) / (peak * x.rank0.threads.max(1) as f64) / x.median_s
    }

    /// `None` without profiles (no `--profile`) or GEMM time.
    pub(crate) fn of(x: &Summary) -> Option<GemmRate> {
        let steps = x.rank0.profiles.len();
        let (mut flops, mut attention, mut secs) = (0.0, 0.0, 0.0);
        for p in x.rank0.profiles.iter().flat_map(|phases| &phases[..2]) {
            flops += p.flops(Kind::Gemm) as f64;
            attention += p.flops(Kind::Nn) as f64;
            secs += p.time(Kind::Gemm).as_secs_f64();
        }
        (steps > 0 && secs > 0.0).then(|| GemmRate {
            gflop: flops / steps as f64 / 1e9,
            attention_gflop: attention / steps as f64 / 1e9,
            ms: secs / steps as f64 * 1e3,
            per_thread: flops / secs / x.rank0.threads.max(1) as f64 / 1e9,
        })
    }
}

/// Prints, per mode, rank 0's GEMM rate against one core's FMA peak measured
/// in this run, and what the step would take with every GEMM at that peak and
/// everything else as measured: how much a faster GEMM could still give.
pub(crate) fn print_gemm_rates(s: &[Summary], peak: Option<f64>) {
    println!();
    match peak {
        Some(p) => println!(
            "rank 0's GEMMs (forward + backward) against one core's f32 FMA peak, {p:.1} GFLOP/s (measured in this run):"
        ),
        None => println!("rank 0's GEMMs (forward + backward); no FMA peak measured on this CPU:"),
    }
    for x in s {
        let Some(r) = GemmRate::of(x) else { continue };
        let mut line = format!(
            "{:<8} {:.2} GFLOP per step in {:.1} ms on {} thread(s): {:.1} GFLOP/s per thread",
            x.mode.name(),
            r.gflop,
            r.ms,
            x.rank0.threads,
            r.per_thread
        );
        if let Some(p) = peak {
            let at_peak = r.gflop / (p * x.rank0.threads.max(1) as f64) * 1e3;
            let step = x.median_s * 1e3;
            line += &format!(
                " ({:.0}% of peak); at the peak: GEMMs {at_peak:.1} ms, the step {:.1} ms (median {step:.1})",
                100.0 * r.per_thread / p,
                step - r.ms + at_peak
            );
        }
        println!("{line}");
    }
}
