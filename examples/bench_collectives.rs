//! The threads backend's collectives against a single-thread memcpy of the same
//! bytes, measured in the same run.
//!
//! ```text
//! cargo run --release --example bench_collectives -- [--json PATH] [--iters N]
//! ```
//!
//! For world sizes 2 and 4 and sizes 1, 16 and 64 MiB (the all-gather's output,
//! the reduce-scatter's input, the all-reduce's buffer), each iteration runs the
//! blocking collective on f32 buffers after a barrier; its time is the slowest
//! rank's. The baseline copies the same number of bytes (the collective's output
//! bytes: what one rank must at least write) with one thread, `copy_from_slice`
//! between two warm buffers. `gbps` is the collective's output bytes per second;
//! `ratio_vs_memcpy` is the memcpy's median time over the collective's (1.0: as
//! fast as one memcpy of its output). Targets at 16 MiB on 2 ranks:
//! reduce_scatter at least 1.0 (`ratio_vs_memcpy_full`), all_gather at least
//! 0.8, and all_reduce at least 0.8 of the concurrent copy below
//! (`ratio_vs_memcpy_world`).
//!
//! A reduce-scatter's output is `1/world` of its input, yet each rank reads a
//! block of every rank's input: per byte written it moves `world + 1` bytes
//! where the memcpy moves 2, and at 16 MiB its inputs (32 MiB on 2 ranks) do not
//! fit the cache the 8 MiB memcpy runs from. `ratio_vs_memcpy_full` therefore
//! also compares every op with a memcpy of its full tensor (`bytes`: the
//! gathered output, the scattered input, the all-reduced buffer), the size
//! bandwidth tools such as nccl-tests report; it differs from `ratio_vs_memcpy`
//! only for the reduce-scatter.
//!
//! A single-thread memcpy is the floor only while one core cannot use the
//! machine's whole memory bandwidth: where it can, `world` ranks copying at
//! once share it. `memcpy_world` times `world` threads that each copy the
//! full tensor at the same moment (started together, the slowest thread's
//! time), the least any collective whose every rank writes that tensor can
//! take while reading and writing no more than a copy does; an all-reduce
//! reads more (its own input, a block of each peer's, and the peers' reduced
//! blocks), so on a machine whose bandwidth one core fills it cannot reach
//! `ratio_vs_memcpy` 1.0 and `ratio_vs_memcpy_world` bounds what it can.
//!
//! `--json PATH` writes records `{op, world, bytes, median_s, gbps,
//! ratio_vs_memcpy, ratio_vs_memcpy_full, memcpy_world_s, ratio_vs_memcpy_world}`.

#[path = "common/mod.rs"]
mod common;

use std::process::ExitCode;
use std::time::Instant;

use common::{Json, median};
use tessera::{BoxError, CommunicatorExt, ReduceOp, launch};

const USAGE: &str = "usage: bench_collectives [--json PATH] [--iters N]";
const SIZES_MIB: [usize; 3] = [1, 16, 64];
const WORLDS: [usize; 2] = [2, 4];
const OPS: [&str; 3] = ["all_gather", "reduce_scatter", "all_reduce"];

fn main() -> ExitCode {
    common::bench_main(
        "bench_collectives",
        USAGE,
        common::parse_args(std::env::args().skip(1), 0),
        run,
    )
}

/// Median seconds of a single-thread copy of `bytes` bytes.
fn memcpy_median(bytes: usize, iters: usize) -> f64 {
    concurrent_memcpy_median(1, bytes, iters)
}

/// Median seconds (slowest thread per iteration) of `world` threads each
/// copying `bytes` bytes between its own two warm buffers, started together.
fn concurrent_memcpy_median(world: usize, bytes: usize, iters: usize) -> f64 {
    let start = std::sync::Barrier::new(world);
    let per_thread: Vec<Vec<f64>> = std::thread::scope(|s| {
        let threads: Vec<_> = (0..world)
            .map(|_| {
                s.spawn(|| {
                    let src: Vec<u8> = (0..bytes).map(|i| i as u8).collect();
                    let mut dst = vec![0u8; bytes];
                    let mut times = Vec::with_capacity(iters + 2);
                    for _ in 0..iters + 2 {
                        start.wait();
                        let t = Instant::now();
                        dst.copy_from_slice(std::hint::black_box(&src));
                        std::hint::black_box(&mut dst);
                        times.push(t.elapsed().as_secs_f64());
                    }
                    times
                })
            })
            .collect();
        threads
            .into_iter()
            .map(|t| t.join().expect("a copying thread panicked"))
            .collect()
    });
    let slowest: Vec<f64> = (2..iters + 2)
        .map(|i| per_thread.iter().map(|t| t[i]).fold(0.0, f64::max))
        .collect();
    median(&slowest)
}

/// The median (slowest rank per iteration) seconds of `op` on `world` ranks over
/// f32 buffers of `mib` MiB.
fn collective_median(op: &'static str, world: usize, mib: usize, iters: usize) -> Result<f64, BoxError> {
    let per_rank = launch(world, move |ctx| {
        let comm = ctx.comm();
        let total = mib * (1 << 20) / 4;
        let block = total / world;
        let full: Vec<f32> = (0..total).map(|i| (i % 97) as f32).collect();
        let part: Vec<f32> = full[..block].to_vec();
        let (mut out_full, mut out_part) = (vec![0f32; total], vec![0f32; block]);
        let mut times = Vec::with_capacity(iters);
        for i in 0..iters + 2 {
            comm.barrier()?;
            let t = Instant::now();
            match op {
                "all_gather" => comm.all_gather((&part[..]).into(), (&mut out_full[..]).into())?,
                "reduce_scatter" => {
                    comm.reduce_scatter((&full[..]).into(), (&mut out_part[..]).into(), ReduceOp::Sum)?
                }
                _ => comm.all_reduce_into((&full[..]).into(), (&mut out_full[..]).into(), ReduceOp::Sum)?,
            }
            if i >= 2 {
                times.push(t.elapsed().as_secs_f64());
            }
        }
        let mut slowest = times.clone();
        comm.all_reduce_slice(&mut slowest, ReduceOp::Max)?;
        Ok(slowest)
    })?;
    Ok(median(&per_rank[0]))
}

fn run(args: &common::BenchArgs) -> Result<(), BoxError> {
    println!(
        "{:<15} {:>5} {:>9} {:>12} {:>9} {:>12} {:>10} {:>10} {:>12} {:>10}",
        "op", "world", "MiB", "median ms", "GB/s", "memcpy ms", "vs memcpy", "vs full", "world cp ms", "vs world"
    );
    let mut records = Vec::new();
    for world in WORLDS {
        for mib in SIZES_MIB {
            let iters = common::iters_for(mib, args.iters);
            for op in OPS {
                let bytes = mib << 20;
                // What a rank must at least write: the gathered or reduced output.
                let out_bytes = if op == "reduce_scatter" { bytes / world } else { bytes };
                let ours = collective_median(op, world, mib, iters)?;
                let copy = memcpy_median(out_bytes, iters);
                let copy_full = if out_bytes == bytes {
                    copy
                } else {
                    memcpy_median(bytes, iters)
                };
                let copy_world = concurrent_memcpy_median(world, bytes, iters);
                let gbps = out_bytes as f64 / ours / 1e9;
                let (ratio, ratio_full, ratio_world) = (copy / ours, copy_full / ours, copy_world / ours);
                println!(
                    "{op:<15} {world:>5} {mib:>9} {:>12.3} {gbps:>9.2} {:>12.3} {ratio:>10.2} {ratio_full:>10.2} {:>12.3} \
                     {ratio_world:>10.2}",
                    ours * 1e3,
                    copy * 1e3,
                    copy_world * 1e3
                );
                records.push(Json::Obj(vec![
                    ("op".into(), Json::Str(op.into())),
                    ("world".into(), Json::Int(world as u64)),
                    ("bytes".into(), Json::Int(bytes as u64)),
                    ("median_s".into(), Json::Num(ours)),
                    ("gbps".into(), Json::Num(gbps)),
                    ("ratio_vs_memcpy".into(), Json::Num(ratio)),
                    ("ratio_vs_memcpy_full".into(), Json::Num(ratio_full)),
                    ("memcpy_world_s".into(), Json::Num(copy_world)),
                    ("ratio_vs_memcpy_world".into(), Json::Num(ratio_world)),
                ]));
            }
        }
    }
    if let Some(path) = &args.json {
        common::write_atomic(path, &Json::Arr(records).render())?;
        println!("wrote {}", path.display());
    }
    Ok(())
}
