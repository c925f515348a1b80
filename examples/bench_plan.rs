//! How well planned steps (`train --plan`) predict real ones: for the tiny and
//! bench GPT models and the LLaMA-style model at the bench sizes, on 4
//! in-process ranks, eleven layouts of the kinds `train --auto`
//! considers (FSDP, HSDP, TP splits, resharding, bf16, recomputation) are planned
//! and then run, in this one process's children, one after the other on the same
//! machine.
//!
//! ```text
//! cargo run --release --example bench_plan -- [--json PATH] [--iters N]
//! ```
//!
//! Per layout: the planned and measured peak bytes per rank (their relative
//! error), and the estimated and measured step time (the median of `N` steps,
//! default 6, after 2 more; five times as many for the tiny model). Then, per model: the share of pairs of layouts
//! whose measured step times differ by more than 10% that the estimates put in
//! the same order (target: at least 0.8), and for ten memory budgets spread
//! over the planned peaks, whether the layout `--auto` picks (the fastest
//! estimate that fits) runs within 5% of the measured fastest that fits
//! (target: 9 of 10). `--json PATH` writes `{layouts: [...], summary: [...]}`.
//! Needs the `train` example built beside it (`cargo build --release --examples`).

#[path = "common/mod.rs"]
mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use common::{Json, median};

const USAGE: &str = "usage: bench_plan [--json PATH] [--iters N]";
const TINY: &[&str] = &[
    "--dim",
    "64",
    "--n-layers",
    "2",
    "--n-heads",
    "4",
    "--vocab",
    "256",
    "--seq",
    "32",
];
const BENCH: &[&str] = &[
    "--dim",
    "256",
    "--n-layers",
    "4",
    "--n-heads",
    "8",
    "--vocab",
    "4096",
    "--seq",
    "128",
];
/// Rows of a step over all ranks (every layout trains the same batch).
const GLOBAL_BATCH: usize = 8;

fn main() -> ExitCode {
    common::bench_main(
        "bench_plan",
        USAGE,
        common::parse_args(std::env::args().skip(1), 6),
        run,
    )
}

/// One layout of 4 ranks: train's flags, and the data-parallel ranks.
struct Layout {
    name: &'static str,
    flags: &'static [&'static str],
    dp: usize,
}

const LAYOUTS: &[Layout] = &[
    Layout {
        name: "fsdp 4",
        flags: &["--world-size", "4"],
        dp: 4,
    },
    Layout {
        name: "fsdp 4, no reshard",
        flags: &["--world-size", "4", "--no-reshard"],
        dp: 4,
    },
    Layout {
        name: "fsdp 4, bf16",
        flags: &["--world-size", "4", "--mixed-precision", "bf16"],
        dp: 4,
    },
    Layout {
        name: "hsdp 2x2",
        flags: &["--mesh", "2x2"],
        dp: 4,
    },
    Layout {
        name: "hsdp 2x2, bf16",
        flags: &["--mesh", "2x2", "--mixed-precision", "bf16"],
        dp: 4,
    },
    Layout {
        name: "fsdp 2 + tp 2",
        flags: &["--world-size", "4", "--tp", "2"],
        dp: 2,
    },
    Layout {
        name: "fsdp 2 + tp 2, no reshard",
        flags: &["--world-size", "4", "--tp", "2", "--no-reshard"],
        dp: 2,
    },
    Layout {
        name: "fsdp 1 + tp 4",
        flags: &["--world-size", "4", "--tp", "4"],
        dp: 1,
    },
    Layout {
        name: "fsdp 4, reshard to 2",
        flags: &["--world-size", "4", "--reshard-to", "2"],
        dp: 4,
    },
    Layout {
        name: "fsdp 4, recompute",
        flags: &["--world-size", "4", "--activation-checkpointing", "full"],
        dp: 4,
    },
    Layout {
        name: "fsdp 2 + tp 2, bf16, recompute",
        flags: &[
            "--world-size",
            "4",
            "--tp",
            "2",
            "--mixed-precision",
            "bf16",
            "--activation-checkpointing",
            "full",
        ],
        dp: 2,
    },
];

/// A layout planned and run.
struct Row {
    model: &'static str,
    layout: &'static str,
    planned_peak: u64,
    measured_peak: u64,
    planned_s: f64,
    measured_s: f64,
}

fn train_exe() -> Result<PathBuf, String> {
    let me = std::env::current_exe().map_err(|e| e.to_string())?;
    let exe = me.with_file_name(format!("train{}", std::env::consts::EXE_SUFFIX));
    if exe.exists() {
        Ok(exe)
    } else {
        Err(format!("{} not found: cargo build --release --examples", exe.display()))
    }
}

/// Runs `train` with `args`; its stdout on success.
fn train(exe: &Path, args: &[String]) -> Result<String, String> {
    let o = Command::new(exe).args(args).output().map_err(|e| e.to_string())?;
    if !o.status.success() {
        return Err(format!(
            "train {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&o.stderr)
        ));
    }
    Ok(String::from_utf8_lossy(&o.stdout).into_owned())
}

fn read_json(path: &Path) -> Result<serde_json::Value, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    serde_json::from_slice(&bytes).map_err(|e| format!("{}: {e}", path.display()))
}

fn max_u64(v: &serde_json::Value) -> u64 {
    v.as_array()
        .into_iter()
        .flatten()
        .filter_map(serde_json::Value::as_u64)
        .max()
        .unwrap_or(0)
}

fn run(args: &common::BenchArgs) -> Result<(), String> {
    let exe = train_exe()?;
    let dir = std::env::temp_dir().join(format!("tessera-bench-plan-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let mut rows = Vec::new();
    println!(
        "{:<6} {:<32} {:>12} {:>12} {:>7} {:>10} {:>10}",
        "model", "layout", "planned_B", "measured_B", "err", "planned_s", "measured_s"
    );
    // The LLaMA-style model at the bench sizes (4 key/value heads, SwiGLU hidden 768).
    let llama = [&["--model", "llama"][..], BENCH].concat();
    for (model, sizes) in [("tiny", TINY), ("bench", BENCH), ("llama", &llama[..])] {
        // One machine for every layout of a model (calibrated by the first
        // run and saved, `--machine`), as `train --auto` ranks them, so that
        // calibration noise ranks nothing.
        let machine = dir.join(format!("machine-{model}.json"));
        for l in LAYOUTS {
            let mut base: Vec<String> = sizes.iter().chain(l.flags).map(|s| s.to_string()).collect();
            base.extend(["--machine".into(), machine.to_string_lossy().into_owned()]);
            base.extend(["--batch".into(), (GLOBAL_BATCH / l.dp).to_string()]);
            // The tiny model's steps take milliseconds, where scheduling noise
            // is a tenth of a step: five times the steps for its median.
            let iters = if model == "tiny" { 5 * args.iters } else { args.iters };
            base.extend(["--steps".into(), (iters + 2).to_string()]);
            let (plan, out) = (dir.join("plan.json"), dir.join("run.json"));
            let mut planning = base.clone();
            planning.extend([
                "--plan".into(),
                "--plan-out".into(),
                plan.to_string_lossy().into_owned(),
            ]);
            train(&exe, &planning)?;
            let p = read_json(&plan)?;
            let mut running = base.clone();
            running.extend(["--losses-out".into(), out.to_string_lossy().into_owned()]);
            train(&exe, &running)?;
            let r = read_json(&out)?;
            let times: Vec<f64> = r["step_time_s"]
                .as_array()
                .ok_or("no step_time_s in --losses-out")?
                .iter()
                .skip(2)
                .filter_map(serde_json::Value::as_f64)
                .collect();
            let row = Row {
                model,
                layout: l.name,
                planned_peak: max_u64(&p["peak_bytes_per_rank"]),
                measured_peak: max_u64(&r["peak_bytes_per_rank"]),
                planned_s: p["step_time_s"].as_f64().ok_or("no step_time_s in --plan-out")?,
                measured_s: median(&times),
            };
            println!(
                "{:<6} {:<32} {:>12} {:>12} {:>6.2}% {:>10.4} {:>10.4}",
                row.model,
                row.layout,
                row.planned_peak,
                row.measured_peak,
                100.0 * (row.planned_peak as f64 / row.measured_peak.max(1) as f64 - 1.0),
                row.planned_s,
                row.measured_s
            );
            rows.push(row);
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    let mut summary = Vec::new();
    for model in ["tiny", "bench", "llama"] {
        let rs: Vec<&Row> = rows.iter().filter(|r| r.model == model).collect();
        let (mut pairs, mut ordered) = (0, 0);
        for (i, a) in rs.iter().enumerate() {
            for b in &rs[i + 1..] {
                if (a.measured_s - b.measured_s).abs() > 0.1 * a.measured_s.min(b.measured_s) {
                    pairs += 1;
                    ordered += usize::from((a.planned_s < b.planned_s) == (a.measured_s < b.measured_s));
                }
            }
        }
        // Ten budgets from the smallest planned peak to the largest.
        let (lo, hi) = rs.iter().fold((u64::MAX, 0), |(lo, hi), r| {
            (lo.min(r.planned_peak), hi.max(r.planned_peak))
        });
        let mut good = 0;
        for k in 0..10 {
            let budget = lo + (hi - lo) * k / 9;
            let fits = |peak: u64| peak <= budget;
            let pick = rs
                .iter()
                .filter(|r| fits(r.planned_peak))
                .min_by(|a, b| a.planned_s.total_cmp(&b.planned_s));
            let best = rs
                .iter()
                .filter(|r| fits(r.measured_peak))
                .min_by(|a, b| a.measured_s.total_cmp(&b.measured_s));
            if let (Some(p), Some(b)) = (pick, best) {
                good += usize::from(fits(p.measured_peak) && p.measured_s <= 1.05 * b.measured_s);
            }
        }
        let share = if pairs > 0 {
            ordered as f64 / pairs as f64
        } else {
            f64::NAN
        };
        println!(
            "{model}: {ordered} of {pairs} pairs ordered as measured ({:.2}; target >= 0.8); auto choice within 5% \
             of the measured fastest fitting for {good} of 10 budgets (target >= 9)",
            share
        );
        summary.push(Json::Obj(vec![
            ("model".into(), Json::Str(model.into())),
            ("pairs".into(), Json::Int(pairs as u64)),
            ("ordered".into(), Json::Int(ordered as u64)),
            ("ordered_share".into(), Json::Num(share)),
            ("budgets_within_5pct".into(), Json::Int(good as u64)),
        ]));
    }
    if let Some(path) = &args.json {
        let layouts = rows
            .iter()
            .map(|r| {
                Json::Obj(vec![
                    ("model".into(), Json::Str(r.model.into())),
                    ("layout".into(), Json::Str(r.layout.into())),
                    ("planned_peak_bytes".into(), Json::Int(r.planned_peak)),
                    ("measured_peak_bytes".into(), Json::Int(r.measured_peak)),
                    ("planned_step_s".into(), Json::Num(r.planned_s)),
                    ("measured_step_s".into(), Json::Num(r.measured_s)),
                ])
            })
            .collect();
        let json = Json::Obj(vec![
            ("layouts".into(), Json::Arr(layouts)),
            ("summary".into(), Json::Arr(summary)),
        ]);
        common::write_atomic(path, &json.render())?;
        println!("wrote {}", path.display());
    }
    Ok(())
}
