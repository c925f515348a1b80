//! Tessera's collectives over MPI against the raw `mpi` crate on the same buffers.
//!
//! ```text
//! cargo run --release --features mpi --example bench_mpi -- [--json PATH] [--iters N]
//! ```
//!
//! Run without `mpirun`, it starts itself under `mpirun -n 2` and `mpirun -n 4`
//! (`TESSERA_MPIRUN` names another launcher) and prints one table. Each rank
//! process initialises MPI through the `mpi` crate, then `tessera::launch` takes
//! that MPI world. For each collective (all_gather, reduce_scatter, all_reduce of
//! f32) and each size (1, 16, 64 MiB: the all-gather's output, the reduce-scatter's
//! input, the all-reduce's buffer), iterations alternate the raw call
//! (`all_gather_into`, `reduce_scatter_block_into`, `all_reduce_into` on the world
//! communicator) with Tessera's blocking call through `dyn Communicator` on the
//! same buffers, each after a barrier; an iteration's time is the slowest rank's.
//! Overhead is Tessera's median over the raw median, minus one. Target: at most 5%.
//!
//! `--json PATH` writes records `{op, ranks, bytes, raw_median_s, tessera_median_s,
//! overhead}`.

#[path = "common/mod.rs"]
mod common;

use std::process::Command;
use std::process::ExitCode;
use std::time::Instant;

use common::{Json, median};
use tessera::mesh::mpi::collective::SystemOperation;
use tessera::mesh::mpi::topology::SimpleCommunicator;
use tessera::mesh::mpi::traits::{Communicator as _, CommunicatorCollectives as _};
use tessera::{BoxError, ReduceOp, launch, mpi_env};

const USAGE: &str = "usage: bench_mpi [--json PATH] [--iters N]";
const SIZES_MIB: [usize; 3] = [1, 16, 64];
const OPS: [&str; 3] = ["all_gather", "reduce_scatter", "all_reduce"];

fn main() -> ExitCode {
    common::bench_main(
        "bench_mpi",
        USAGE,
        common::parse_args(std::env::args().skip(1), 0),
        |args| match mpi_env() {
            Some(_) => rank(args.iters),
            None => driver(args),
        },
    )
}

/// One rank of one world size: prints `RESULT op ranks bytes raw_s tessera_s` lines on rank 0.
fn rank(iters: usize) -> Result<(), BoxError> {
    let (universe, level) = tessera::mesh::mpi::initialize_with_threading(tessera::mesh::mpi::Threading::Multiple)
        .ok_or("MPI was already initialised")?;
    if level != tessera::mesh::mpi::Threading::Multiple {
        return Err("the MPI library lacks MPI_THREAD_MULTIPLE".into());
    }
    let n = universe.world().size() as usize;
    launch(n, move |ctx| {
        let raw = SimpleCommunicator::world();
        let comm = ctx.comm();
        for mib in SIZES_MIB {
            let total = mib * (1 << 20) / 4;
            let block = total / n;
            let full: Vec<f32> = (0..block * n).map(|i| (i % 97) as f32).collect();
            let part: Vec<f32> = full[..block].to_vec();
            let (mut out_full, mut out_part) = (vec![0f32; block * n], vec![0f32; block]);
            for op in OPS {
                let mut times = (Vec::new(), Vec::new());
                let iters = common::iters_for(mib, iters);
                for i in 0..iters + 2 {
                    raw.barrier();
                    let t = Instant::now();
                    match op {
                        "all_gather" => raw.all_gather_into(&part[..], &mut out_full[..]),
                        "reduce_scatter" => {
                            raw.reduce_scatter_block_into(&full[..], &mut out_part[..], SystemOperation::sum())
                        }
                        _ => raw.all_reduce_into(&full[..], &mut out_full[..], SystemOperation::sum()),
                    }
                    let raw_s = t.elapsed().as_secs_f64();
                    raw.barrier();
                    let t = Instant::now();
                    match op {
                        "all_gather" => comm.all_gather((&part[..]).into(), (&mut out_full[..]).into())?,
                        "reduce_scatter" => {
                            comm.reduce_scatter((&full[..]).into(), (&mut out_part[..]).into(), ReduceOp::Sum)?
                        }
                        _ => comm.all_reduce_into((&full[..]).into(), (&mut out_full[..]).into(), ReduceOp::Sum)?,
                    }
                    let ours = t.elapsed().as_secs_f64();
                    // Two warm-up iterations.
                    if i >= 2 {
                        times.0.push(raw_s);
                        times.1.push(ours);
                    }
                }
                // The slowest rank per iteration.
                let mut slowest = vec![0f64; 2 * times.0.len()];
                let mine: Vec<f64> = times.0.iter().chain(&times.1).copied().collect();
                raw.all_reduce_into(&mine[..], &mut slowest[..], SystemOperation::max());
                let (r, t) = slowest.split_at(times.0.len());
                if ctx.rank() == 0 {
                    println!("RESULT {op} {n} {} {:e} {:e}", block * n * 4, median(r), median(t));
                }
            }
        }
        Ok(())
    })?;
    drop(universe);
    Ok(())
}

struct Row {
    op: String,
    ranks: usize,
    bytes: usize,
    raw: f64,
    ours: f64,
}

fn driver(args: &common::BenchArgs) -> Result<(), BoxError> {
    let me = std::env::current_exe()?;
    let mpirun = std::env::var("TESSERA_MPIRUN").unwrap_or_else(|_| "mpirun".into());
    let mut rows = Vec::new();
    for n in [2, 4] {
        let mut cmd = Command::new(&mpirun);
        cmd.args(["-n", &n.to_string(), "--oversubscribe", "--allow-run-as-root"]);
        cmd.arg(&me);
        if args.iters > 0 {
            cmd.args(["--iters", &args.iters.to_string()]);
        }
        let out = cmd
            .output()
            .map_err(|e| format!("cannot run {mpirun}: {e} (install OpenMPI: apt-get install openmpi-bin)"))?;
        if !out.status.success() {
            return Err(format!(
                "mpirun -n {n} failed ({}):\n{}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            )
            .into());
        }
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() == 6 && f[0] == "RESULT" {
                rows.push(Row {
                    op: f[1].to_string(),
                    ranks: f[2].parse()?,
                    bytes: f[3].parse()?,
                    raw: f[4].parse()?,
                    ours: f[5].parse()?,
                });
            }
        }
    }
    if rows.len() != 2 * OPS.len() * SIZES_MIB.len() {
        return Err(format!(
            "expected {} results, got {}",
            2 * OPS.len() * SIZES_MIB.len(),
            rows.len()
        )
        .into());
    }
    println!(
        "{:<15} {:>5} {:>8} {:>12} {:>12} {:>9}",
        "op", "ranks", "MiB", "raw ms", "tessera ms", "overhead"
    );
    for r in &rows {
        println!(
            "{:<15} {:>5} {:>8} {:>12.3} {:>12.3} {:>8.1}%",
            r.op,
            r.ranks,
            r.bytes >> 20,
            r.raw * 1e3,
            r.ours * 1e3,
            (r.ours / r.raw - 1.0) * 100.0
        );
    }
    let worst = rows
        .iter()
        .map(|r| r.ours / r.raw - 1.0)
        .fold(f64::NEG_INFINITY, f64::max);
    println!("worst overhead {:.1}% (target at most 5%)", worst * 100.0);
    if let Some(path) = &args.json {
        let records = rows
            .iter()
            .map(|r| {
                Json::Obj(vec![
                    ("op".into(), Json::Str(r.op.clone())),
                    ("ranks".into(), Json::Int(r.ranks as u64)),
                    ("bytes".into(), Json::Int(r.bytes as u64)),
                    ("raw_median_s".into(), Json::Num(r.raw)),
                    ("tessera_median_s".into(), Json::Num(r.ours)),
                    ("overhead".into(), Json::Num(r.ours / r.raw - 1.0)),
                ])
            })
            .collect();
        common::write_atomic(path, &Json::Arr(records).render())?;
        println!("wrote {}", path.display());
    }
    Ok(())
}
