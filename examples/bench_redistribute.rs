//! Redistribute benchmark: an f32 4096×4096 tensor on a 2×2 mesh of in-process ranks.
//!
//! ```text
//! cargo run --release --example bench_redistribute -- [--json PATH] [--iters N]
//! ```
//!
//! For each case the source DTensor is built once; then `redistribute` runs `N`
//! times (default 10, after 2 warm-ups), each after a barrier, interleaved with
//! the baselines below. An iteration's time is the slowest rank's (every rank's
//! times come back from `launch` at the end); the table shows the median. Bytes
//! per rank come from `mesh.stats()` and are checked against the plan's `bytes()`.
//!
//! The baseline is the plan's collectives, same sizes, same communicators, called
//! directly on flat `Vec<f32>` buffers prepared outside timing: `ratio` is the
//! redistribute median over the baseline median (1.0 = no overhead). A step
//! without communication (`R -> S(d)`, a local slice) has a plain `memcpy` of the
//! slice's elements as its baseline. `coll+alloc_s` is the same baseline with
//! fresh output buffers allocated inside timing, as an out-of-place redistribute
//! must do (zeroed and not yet touched; for an in-place all_reduce, a copy of the
//! input): the gap between the two baselines is the cost of allocation and
//! first-touch page faults, the rest of the gap to `median_s` is redistribute's
//! own (packing copies, extra buffers, bookkeeping).

#[path = "common/mod.rs"]
mod common;

use std::hint::black_box;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use common::{Json, max_over_ranks, median};
use tessera::dtensor::redistribute::{Plan, StepKind};
use tessera::dtensor::{DType, Placement, PlacementsDisplay, Tensor, distribute_tensor};
use tessera::{BoxError, CommunicatorExt, DeviceMesh, ReduceOp, launch};

const SHAPE: [usize; 2] = [4096, 4096];
const MESH: [usize; 2] = [2, 2];
const WARMUP: usize = 2;
const DEFAULT_ITERS: usize = 10;
const SEED: u64 = 42;

const USAGE: &str = "usage: bench_redistribute [--json PATH] [--iters N]
  --json PATH  also write the results as a JSON array of records (atomically)
  --iters N    timed iterations per case (default 10; 2 warm-ups come first)";

/// One redistribution to time, with PyTorch 2.15 (gloo, 4 ranks) where known.
struct Case {
    src: [Placement; 2],
    dst: [Placement; 2],
    pytorch_ms: Option<f64>,
}

impl Case {
    fn name(&self) -> String {
        format!("{}->{}", PlacementsDisplay(&self.src), PlacementsDisplay(&self.dst))
    }
}

fn cases() -> Vec<Case> {
    use Placement::{Replicate as R, Shard as S};
    let p = Placement::Partial(ReduceOp::Sum);
    let case = |src, dst, pytorch_ms| Case { src, dst, pytorch_ms };
    vec![
        // One mesh dim (dim 0); the other stays Replicate.
        case([S(0), R], [R, R], Some(194.0)),
        case([R, R], [S(1), R], None),
        case([p, R], [R, R], None),
        case([p, R], [S(0), R], None),
        case([S(0), R], [S(1), R], Some(238.0)),
        // Both mesh dims.
        case([S(0), S(1)], [R, R], Some(329.0)),
        case([S(0), S(0)], [S(1), S(1)], None),
        case([p, p], [R, R], None),
    ]
}

/// What one rank measured for one case.
struct RankCase {
    times: Vec<f64>,
    base_times: Vec<f64>,
    alloc_times: Vec<f64>,
    /// Bytes this rank sent in one redistribute (stats delta).
    bytes: u64,
    plan_bytes: u64,
    /// Bytes this rank sent in one run of the baseline (stats delta).
    base_bytes: u64,
    plan: String,
    baseline: String,
}

/// The baseline's stand-in for one plan step.
#[derive(Clone, Copy, Debug)]
enum Coll {
    AllGather,
    ReduceScatter,
    AllReduce,
    AllToAll,
    /// A plain copy of the slice's elements (the step has no communication).
    Memcpy,
}

/// One baseline operation on flat buffers (`AllReduce` works in place on `recv`).
struct BaseOp {
    coll: Coll,
    mesh_dim: Option<usize>,
    send: Vec<f32>,
    recv: Vec<f32>,
}

fn main() -> ExitCode {
    let args = match common::parse_args(std::env::args().skip(1), DEFAULT_ITERS) {
        Ok(a) => a,
        Err(msg) if msg == common::HELP => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(msg) => {
            eprintln!("bench_redistribute: {msg}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bench_redistribute: error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &common::BenchArgs) -> Result<(), BoxError> {
    let cases = Arc::new(cases());
    let n: usize = MESH.iter().product();
    println!(
        "redistribute of f32 {:?} on a {:?} mesh ({n} ranks, threads backend), {} iterations after {WARMUP} warm-ups",
        SHAPE, MESH, args.iters
    );
    let per_rank = launch(n, {
        let (cases, iters) = (cases.clone(), args.iters);
        move |ctx| {
            let mesh = DeviceMesh::new(ctx.into_comm(), &MESH)?;
            let full = Tensor::randn(&SHAPE, DType::F32, SEED)?;
            cases
                .iter()
                .map(|c| bench_case(&mesh, &full, c, iters))
                .collect::<Result<Vec<_>, _>>()
        }
    })?;

    let mut records = Vec::new();
    println!();
    println!(
        "{:<28} {:>10} {:>14} {:>13} {:>13} {:>7} {:>11} {:>10}",
        "case", "median_s", "bytes_per_rank", "coll_median_s", "coll+alloc_s", "ratio", "pytorch_ms", "vs_pytorch"
    );
    let mut notes = Vec::new();
    for (i, case) in cases.iter().enumerate() {
        let ranks: Vec<&RankCase> = per_rank.iter().map(|r| &r[i]).collect();
        let col = |f: fn(&RankCase) -> &Vec<f64>| {
            median(&max_over_ranks(&ranks.iter().map(|r| f(r).clone()).collect::<Vec<_>>()))
        };
        let med = col(|r| &r.times);
        let base = col(|r| &r.base_times);
        let alloc = col(|r| &r.alloc_times);
        let bytes = ranks.iter().map(|r| r.bytes).max().unwrap_or(0);
        let ratio = if base > 0.0 { med / base } else { f64::NAN };
        let speedup = case.pytorch_ms.map(|p| p / (med * 1e3));
        let name = case.name();
        for (rank, r) in ranks.iter().enumerate() {
            if r.bytes != r.plan_bytes {
                notes.push(format!(
                    "WARNING {name}: rank {rank} sent {} bytes but its plan says {}",
                    r.bytes, r.plan_bytes
                ));
            }
            if r.base_bytes != r.plan_bytes {
                notes.push(format!(
                    "WARNING {name}: rank {rank}'s baseline sent {} bytes, the plan {}; the ratio compares unequal work",
                    r.base_bytes, r.plan_bytes
                ));
            }
        }
        println!(
            "{:<28} {:>10.4} {:>14} {:>13.4} {:>13.4} {:>7.2} {:>11} {:>10}",
            name,
            med,
            bytes,
            base,
            alloc,
            ratio,
            case.pytorch_ms.map_or("-".into(), |p| format!("{p:.0}")),
            speedup.map_or("-".into(), |s| format!("{s:.1}x")),
        );
        records.push(Json::Obj(vec![
            ("case".into(), Json::Str(name)),
            ("median_s".into(), Json::Num(med)),
            ("bytes_per_rank".into(), Json::Int(bytes)),
            ("collective_median_s".into(), Json::Num(base)),
            ("collective_alloc_median_s".into(), Json::Num(alloc)),
            ("ratio".into(), Json::Num(ratio)),
            ("pytorch_ms".into(), Json::opt(case.pytorch_ms)),
            ("speedup_vs_pytorch".into(), Json::opt(speedup)),
            ("collectives".into(), Json::Str(ranks[0].baseline.clone())),
            ("iters".into(), Json::Int(args.iters as u64)),
        ]));
    }
    println!();
    println!("plans (rank 0) and baselines:");
    for r in per_rank.first().into_iter().flatten() {
        println!("{}\n  baseline: {}", r.plan, r.baseline);
    }
    println!(
        "\nratio = median_s / coll_median_s; an R->S(d) step has no collective, its baseline is a memcpy of the slice."
    );
    println!("pytorch_ms: PyTorch 2.15, gloo, 4 ranks (reference numbers, not measured here).");
    for n in &notes {
        println!("{n}");
    }
    if let Some(path) = &args.json {
        common::write_atomic(path, &(Json::Arr(records).render() + "\n"))?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

/// Times one case on this rank.
fn bench_case(mesh: &DeviceMesh, full: &Tensor, case: &Case, iters: usize) -> Result<RankCase, BoxError> {
    let x = distribute_tensor(full, mesh, &case.src)?;
    let plan = x.redistribute_plan(&case.dst)?;

    // One probe call: bytes sent, and a check that the result is right.
    let before = mesh.stats();
    let y = x.redistribute(&case.dst)?;
    let bytes = (mesh.stats() - before).total_bytes();
    if y.placements() != case.dst || y.full_tensor()? != *full {
        return Err(format!(
            "{}: redistribute gave a wrong result on rank {}",
            case.name(),
            mesh.rank()
        )
        .into());
    }
    drop(y);

    let mut ops = baseline_ops(&plan, mesh)?;
    let baseline = describe(&ops);
    let before = mesh.stats();
    run_ops(&mut ops, mesh, false)?;
    let base_bytes = (mesh.stats() - before).total_bytes();

    // Interleaved, so that load from elsewhere on the machine hits all three alike.
    let (mut times, mut base_times, mut alloc_times) = (Vec::new(), Vec::new(), Vec::new());
    for it in 0..WARMUP + iters {
        let t = timed(mesh, || Ok(x.redistribute(&case.dst)?))?;
        let b = timed(mesh, || run_ops(&mut ops, mesh, false))?;
        let a = timed(mesh, || run_ops(&mut ops, mesh, true))?;
        if it >= WARMUP {
            times.push(t);
            base_times.push(b);
            alloc_times.push(a);
        }
    }
    Ok(RankCase {
        times,
        base_times,
        alloc_times,
        bytes,
        plan_bytes: plan.bytes(),
        base_bytes,
        plan: plan.to_string(),
        baseline,
    })
}

/// Seconds one call of `f` takes on this rank, after a barrier; its result is
/// dropped outside the timed region.
fn timed<R>(mesh: &DeviceMesh, f: impl FnOnce() -> Result<R, BoxError>) -> Result<f64, BoxError> {
    mesh.comm().barrier()?;
    let t = Instant::now();
    let out = f()?;
    let dt = t.elapsed().as_secs_f64();
    drop(out);
    Ok(dt)
}

/// The plain collectives that stand in for `plan`'s steps, with the same sizes on
/// the same communicators.
fn baseline_ops(plan: &Plan, mesh: &DeviceMesh) -> Result<Vec<BaseOp>, BoxError> {
    let coord = mesh.coordinate();
    let mut ops = Vec::new();
    for (before, step) in plan.transitions() {
        let n_in: usize = before.local_shape(coord)?.iter().product();
        let n_out: usize = step.after.local_shape(coord)?.iter().product();
        let group = step.mesh_dim.map_or(mesh.size(), |m| mesh.shape()[m]);
        let (coll, send, recv, even) = match step.kind {
            StepKind::AllGather { .. } => (Coll::AllGather, n_in, n_out, n_out == n_in * group),
            StepKind::ReduceScatter { .. } => (Coll::ReduceScatter, n_in, n_out, n_in == n_out * group),
            StepKind::AllReduce { .. } | StepKind::AllReduceMesh { .. } => (Coll::AllReduce, 0, n_in, true),
            StepKind::AllToAll { .. } | StepKind::AllToAllMesh => {
                (Coll::AllToAll, n_in, n_out, n_in == n_out && n_in.is_multiple_of(group))
            }
            StepKind::Slice { .. } => (Coll::Memcpy, n_out, n_out, true),
            other => return Err(format!("no baseline for plan step {other:?}").into()),
        };
        if !even {
            return Err(format!(
                "{}: uneven shards ({n_in} -> {n_out} elements over {group} ranks) have no fixed-size \
                 collective to compare with; use a shape divisible by the mesh",
                PlacementsDisplay(&before.placements)
            )
            .into());
        }
        // Ones, written here so every page is touched before timing; an all_reduce
        // works in place, so its buffer is then zeroed to stay finite over any number
        // of iterations.
        let mut recv = vec![1.0; recv];
        if matches!(coll, Coll::AllReduce) {
            recv.fill(0.0);
        }
        ops.push(BaseOp {
            coll,
            mesh_dim: step.mesh_dim,
            send: vec![1.0; send],
            recv,
        });
    }
    Ok(ops)
}

/// `all_gather(8388608 f32, mesh dim 0)`, ... for the report.
fn describe(ops: &[BaseOp]) -> String {
    if ops.is_empty() {
        return "none".into();
    }
    let items: Vec<String> = ops
        .iter()
        .map(|op| {
            let (name, len) = match op.coll {
                Coll::AllGather => ("all_gather", op.send.len()),
                Coll::ReduceScatter => ("reduce_scatter", op.send.len()),
                Coll::AllReduce => ("all_reduce", op.recv.len()),
                Coll::AllToAll => ("all_to_all", op.send.len()),
                Coll::Memcpy => ("memcpy", op.send.len()),
            };
            let on = op.mesh_dim.map_or("whole mesh".into(), |m| format!("mesh dim {m}"));
            format!("{name}({len} f32 in, {on})")
        })
        .collect();
    items.join(" + ")
}

/// Runs the baseline once. With `fresh`, each output goes to a new buffer
/// allocated inside the caller's timing, as redistribute allocates its outputs
/// (zeroed, or for an all_reduce a copy of the input); those buffers are returned
/// so that they are freed outside it.
fn run_ops(ops: &mut [BaseOp], mesh: &DeviceMesh, fresh: bool) -> Result<Vec<Vec<f32>>, BoxError> {
    let mut outputs = Vec::new();
    for op in ops.iter_mut() {
        let comm = match op.mesh_dim {
            Some(m) => mesh.dim_comm(m)?,
            None => mesh.comm(),
        };
        if fresh {
            // An all_reduce works in place, so out of place it starts from a copy
            // of its input; every other output starts as fresh zeroed memory.
            outputs.push(match op.coll {
                Coll::AllReduce => op.recv.clone(),
                _ => vec![0.0f32; op.recv.len()],
            });
        }
        let recv: &mut [f32] = match outputs.last_mut() {
            Some(buf) if fresh => buf,
            _ => &mut op.recv,
        };
        match op.coll {
            Coll::AllGather => comm.all_gather_slice(&op.send, recv)?,
            Coll::ReduceScatter => comm.reduce_scatter_slice(&op.send, recv, ReduceOp::Sum)?,
            Coll::AllReduce => comm.all_reduce_slice(recv, ReduceOp::Sum)?,
            Coll::AllToAll => comm.all_to_all_slice(&op.send, recv)?,
            Coll::Memcpy => recv.copy_from_slice(&op.send),
        }
        black_box(recv);
    }
    Ok(outputs)
}
