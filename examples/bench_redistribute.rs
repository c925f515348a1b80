//! Redistribute benchmark: an f32 4096×4096 tensor on a 2×2 mesh and an f32
//! 256×256×256 tensor on a 2×2×2 mesh, of in-process ranks.
//!
//! ```text
//! cargo run --release --example bench_redistribute -- [--json PATH] [--iters N] [--case TEXT]...
//! ```
//!
//! `--case TEXT` (repeatable) keeps only the cases whose name, as the table
//! prints it, contains one of the texts: a row measured again without the
//! others (each launch of a mesh still builds its tensor and plans).
//!
//! For each case the source DTensor is built once; then `redistribute` runs `N`
//! times (default 10, after 2 warm-ups), each after a barrier, interleaved with
//! the baselines below. An iteration's time is the slowest rank's (every rank's
//! times come back from `launch` at the end); the table shows the median. Bytes
//! per rank come from `mesh.stats()` and are checked against the plan's `bytes()`.
//! Beside them, `mean_B` is the mean over ranks of the bytes sent and `oracle_B` the
//! fewest any sequence of per-dim or flattened-group steps can send (mean per rank,
//! from the exhaustive search of `dtensor::testing::oracle`), with the collectives
//! of each.
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
use tessera::dtensor::redistribute::{Plan, StepKind, plan};
use tessera::dtensor::testing::oracle::{Oracle, all_layouts};
use tessera::dtensor::{DType, Layout, Placement, PlacementsDisplay, Tensor, distribute_tensor};
use tessera::mesh::Element;
use tessera::{BoxError, CommunicatorExt, DeviceMesh, ReduceOp, launch};

const MESH_2D: &[usize] = &[2, 2];
const SHAPE_2D: &[usize] = &[4096, 4096];
const MESH_3D: &[usize] = &[2, 2, 2];
const SHAPE_3D: &[usize] = &[256, 256, 256];
const WARMUP: usize = 2;
const DEFAULT_ITERS: usize = 10;
const SEED: u64 = 42;

const USAGE: &str = "usage: bench_redistribute [--json PATH] [--iters N] [--case TEXT]...
  --json PATH  also write the results as a JSON array of records (atomically)
  --iters N    timed iterations per case (default 10; 2 warm-ups come first)
  --case TEXT  only the cases whose name (as the table prints it) contains TEXT;
               repeatable (default: every case)";

/// The benchmark's flags: the common ones and the case filter.
#[derive(Clone, Debug)]
struct Args {
    common: common::BenchArgs,
    /// Texts a case's name must contain one of (empty: every case).
    cases: Vec<String>,
}

/// Parses the common flags and `--case TEXT` (repeatable).
///
/// # Errors
/// As [`common::parse_args`], and a `--case` that no case's name contains
/// (the message lists the names).
fn parse_args(args: impl IntoIterator<Item = String>) -> Result<Args, String> {
    let mut cases = Vec::new();
    let common = common::parse_args_with(args, DEFAULT_ITERS, |flag, value| {
        if flag != "--case" {
            return Ok(false);
        }
        cases.push(value("a text that case names contain")?);
        Ok(true)
    })?;
    let names: Vec<String> = self::cases().iter().map(Case::name).collect();
    if let Some(none) = cases
        .iter()
        .find(|text| !names.iter().any(|n| n.contains(text.as_str())))
    {
        return Err(format!(
            "no case's name contains --case {none:?}; the cases are: {}",
            names.join(", ")
        ));
    }
    Ok(Args { common, cases })
}

/// One redistribution to time, with PyTorch 2.15 (gloo, 4 ranks) where known.
struct Case {
    mesh: &'static [usize],
    shape: &'static [usize],
    src: Vec<Placement>,
    dst: Vec<Placement>,
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
    let case = |src: [Placement; 2], dst: [Placement; 2], pytorch_ms| Case {
        mesh: MESH_2D,
        shape: SHAPE_2D,
        src: src.to_vec(),
        dst: dst.to_vec(),
        pytorch_ms,
    };
    let case3 = |src: [Placement; 3], dst: [Placement; 3]| Case {
        mesh: MESH_3D,
        shape: SHAPE_3D,
        src: src.to_vec(),
        dst: dst.to_vec(),
        pytorch_ms: None,
    };
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
        // 2×2×2: flattened groups and whole-mesh steps.
        case3([S(1), R, S(0)], [R, S(0), S(0)]),
        case3([p, R, p], [R, R, R]),
        case3([p, S(0), p], [R, R, R]),
        case3([S(0), S(1), S(2)], [R, R, R]),
        case3([S(0), S(0), S(1)], [S(1), S(0), S(0)]),
        case3([p, p, p], [R, R, S(0)]),
    ]
}

/// Sources timed by [`planning`].
const PLAN_SAMPLES: usize = 9;

/// The planner's own time, median over [`PLAN_SAMPLES`] sources: the first plan
/// from a source to a near target (one slice), to a far one (whole-mesh
/// all_to_all), from a new source to every layout of its shape in turn (the
/// search settled to the end, as a dispatch among many candidates may), and a
/// plan already made (the route cache). Each sample's shape has an odd first dim,
/// so no two share a search tree and every first plan searches afresh.
fn planning() -> Result<Vec<(String, f64)>, BoxError> {
    use Placement::{Replicate as R, Shard as S};
    let ms = |since: Instant| since.elapsed().as_secs_f64() * 1e3;
    let layout = |p: &[Placement], shape: &[usize]| Layout::new(MESH_3D, p, shape, DType::F32);
    let coord = [0, 0, 0];
    let mut times: [Vec<f64>; 4] = Default::default();
    let mut layouts = 0;
    for k in 0..PLAN_SAMPLES {
        let shape = |j: usize| [5 + 2 * (2 * k + j), 3, 7, 4];
        let (a, b) = (shape(0), shape(1));
        let from = layout(&[S(0), S(1), R], &a)?;
        let (near, far) = (layout(&[S(0), S(1), S(2)], &a)?, layout(&[S(3), S(2), S(0)], &a)?);
        // The first two search afresh; the last repeats the second.
        for (slot, dst) in [(0, &near), (1, &far), (3, &far)] {
            let t = Instant::now();
            black_box(plan(&from, dst, &coord))?;
            times[slot].push(ms(t));
        }
        let every = all_layouts(MESH_3D, &b, DType::F32, &[])?;
        let from = layout(&[S(0), S(1), R], &b)?;
        layouts = every.len();
        let t = Instant::now();
        for dst in &every {
            black_box(plan(&from, dst, &coord))?;
        }
        times[2].push(ms(t));
    }
    let queries = [
        "first plan, near target (a slice)".to_string(),
        "first plan, far target (an all_to_all)".to_string(),
        format!("first plans to every layout ({layouts}), in turn"),
        "the same plan again (cached)".to_string(),
    ];
    Ok(queries.into_iter().zip(&times).map(|(q, t)| (q, median(t))).collect())
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
    collectives: u32,
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
    /// The step's mesh dims, and the mesh over them (its communicator is the step's).
    group: Vec<usize>,
    on: DeviceMesh,
    send: Vec<f32>,
    recv: Vec<f32>,
    /// Elements to and from each rank of the group, for an all_to_all.
    counts: Option<(Vec<usize>, Vec<usize>)>,
}

fn main() -> ExitCode {
    common::bench_main("bench_redistribute", USAGE, parse_args(std::env::args().skip(1)), run)
}

fn run(args: &Args) -> Result<(), BoxError> {
    let picked = |c: &Case| args.cases.is_empty() || args.cases.iter().any(|t| c.name().contains(t.as_str()));
    let cases = Arc::new(cases().into_iter().filter(picked).collect::<Vec<_>>());
    let args = &args.common;
    println!(
        "redistribute of f32 {SHAPE_2D:?} on a {MESH_2D:?} mesh and f32 {SHAPE_3D:?} on {MESH_3D:?} (threads backend), \
         {} iterations after {WARMUP} warm-ups",
        args.iters
    );
    // Per case, every rank's measurements (one launch per mesh).
    let mut per_case: Vec<Vec<RankCase>> = (0..cases.len()).map(|_| Vec::new()).collect();
    for (mesh_shape, shape) in [(MESH_2D, SHAPE_2D), (MESH_3D, SHAPE_3D)] {
        let mine: Vec<usize> = (0..cases.len()).filter(|&i| cases[i].mesh == mesh_shape).collect();
        if mine.is_empty() {
            continue;
        }
        let per_rank = launch(mesh_shape.iter().product(), {
            let (cases, iters, mine) = (cases.clone(), args.iters, mine.clone());
            move |ctx| {
                let mesh = DeviceMesh::new(ctx.into_comm(), mesh_shape)?;
                let full = Tensor::randn(shape, DType::F32, SEED)?;
                mine.iter()
                    .map(|&i| bench_case(&mesh, &full, &cases[i], iters))
                    .collect::<Result<Vec<_>, _>>()
            }
        })?;
        for rank in per_rank {
            for (&i, r) in mine.iter().zip(rank) {
                per_case[i].push(r);
            }
        }
    }
    // The oracle's fewest bytes (mean per rank) and collectives, per case.
    let mut oracles = std::collections::HashMap::new();
    let oracle_best =
        |case: &Case, oracles: &mut std::collections::HashMap<_, Oracle>| -> Result<(f64, u32), BoxError> {
            let n: usize = case.mesh.iter().product();
            let oracle = match oracles.entry((case.mesh, case.shape)) {
                std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::hash_map::Entry::Vacant(e) => {
                    e.insert(Oracle::new(case.mesh, case.shape, DType::F32, &[ReduceOp::Sum])?)
                }
            };
            let src = Layout::new(case.mesh, &case.src, case.shape, DType::F32)?;
            let dst = Layout::new(case.mesh, &case.dst, case.shape, DType::F32)?;
            let at = oracle
                .layouts()
                .position(|l| *l == dst)
                .ok_or("target not among the oracle's layouts")?;
            let best = oracle.cheapest_from(&src)[at].ok_or("the oracle cannot reach the target")?;
            Ok((best.bytes_per_rank(n), best.collectives))
        };

    let mut records = Vec::new();
    println!();
    println!(
        "{:<34} {:>10} {:>14} {:>10} {:>10} {:>7} {:>13} {:>13} {:>7} {:>11} {:>10}",
        "case",
        "median_s",
        "bytes_per_rank",
        "mean_B",
        "oracle_B",
        "coll",
        "coll_median_s",
        "coll+alloc_s",
        "ratio",
        "pytorch_ms",
        "vs_pytorch"
    );
    let mut notes = Vec::new();
    for (i, case) in cases.iter().enumerate() {
        let ranks: Vec<&RankCase> = per_case[i].iter().collect();
        let col = |f: fn(&RankCase) -> &Vec<f64>| {
            median(&max_over_ranks(&ranks.iter().map(|r| f(r).clone()).collect::<Vec<_>>()))
        };
        let med = col(|r| &r.times);
        let base = col(|r| &r.base_times);
        let alloc = col(|r| &r.alloc_times);
        let bytes = ranks.iter().map(|r| r.bytes).max().unwrap_or(0);
        let mean = ranks.iter().map(|r| r.bytes as f64).sum::<f64>() / ranks.len() as f64;
        let (oracle_bytes, oracle_colls) = oracle_best(case, &mut oracles)?;
        let colls = ranks[0].collectives;
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
            "{:<34} {:>10.4} {:>14} {:>10.0} {:>10.0} {:>7} {:>13.4} {:>13.4} {:>7.2} {:>11} {:>10}",
            name,
            med,
            bytes,
            mean,
            oracle_bytes,
            format!("{colls}/{oracle_colls}"),
            base,
            alloc,
            ratio,
            case.pytorch_ms.map_or("-".into(), |p| format!("{p:.0}")),
            speedup.map_or("-".into(), |s| format!("{s:.1}x")),
        );
        records.push(Json::Obj(vec![
            ("case".into(), Json::Str(name)),
            ("median_s".into(), Json::Num(med)),
            ("mesh".into(), Json::Str(format!("{:?}", case.mesh))),
            ("bytes_per_rank".into(), Json::Int(bytes)),
            ("mean_bytes_per_rank".into(), Json::Num(mean)),
            ("oracle_mean_bytes_per_rank".into(), Json::Num(oracle_bytes)),
            ("plan_collectives".into(), Json::Int(colls as u64)),
            ("oracle_collectives".into(), Json::Int(oracle_colls as u64)),
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
    for r in per_case.iter().filter_map(|ranks| ranks.first()) {
        println!("{}\n  baseline: {}", r.plan, r.baseline);
    }
    println!(
        "\nratio = median_s / coll_median_s; an R->S(d) step has no collective, its baseline is a memcpy of the slice."
    );
    println!(
        "mean_B: bytes sent, mean over ranks; oracle_B: the fewest any plan can send; coll: plan/oracle collectives."
    );
    println!("pytorch_ms: PyTorch 2.15, gloo, 4 ranks (reference numbers, not measured here).");
    for n in &notes {
        println!("{n}");
    }
    println!();
    println!(
        "planning, f32 4-D tensor on {MESH_3D:?} from [S(0),S(1),R] ({PLAN_SAMPLES} sources, each with a shape of its own):"
    );
    println!("{:<44} {:>12}", "query", "median_ms");
    for (query, ms) in planning()? {
        println!("{query:<44} {ms:>12.3}");
        records.push(Json::Obj(vec![
            ("planning".into(), Json::Str(query)),
            ("median_ms".into(), Json::Num(ms)),
        ]));
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
    run_ops(&mut ops, false)?;
    let base_bytes = (mesh.stats() - before).total_bytes();

    // The redistribute and its baseline interleaved, so that load from
    // elsewhere on the machine hits both alike. The baseline with fresh
    // outputs runs after, on its own: the system's unmapping of its hundreds
    // of MiB of fresh pages slowed whichever call came next (interleaved, the
    // 3-D gather's redistribute took 1.26-1.69x its baseline over three runs,
    // 1.17-1.3x without).
    let (mut times, mut base_times, mut alloc_times) = (Vec::new(), Vec::new(), Vec::new());
    for it in 0..WARMUP + iters {
        let t = timed(mesh, || Ok(x.redistribute(&case.dst)?))?;
        let b = timed(mesh, || run_ops(&mut ops, false))?;
        if it >= WARMUP {
            times.push(t);
            base_times.push(b);
        }
    }
    for it in 0..WARMUP + iters {
        let a = timed(mesh, || run_ops(&mut ops, true))?;
        if it >= WARMUP {
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
        collectives: plan.collectives() as u32,
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
        let group = step.group_size();
        let mut counts = None;
        let (coll, send, recv, even) = match step.kind {
            StepKind::AllGather => (Coll::AllGather, n_in, n_out, n_out == n_in * group),
            StepKind::ReduceScatter { .. } => (Coll::ReduceScatter, n_in, n_out, n_in == n_out * group),
            StepKind::AllReduce { .. } => (Coll::AllReduce, 0, n_in, true),
            StepKind::AllToAll => {
                // An element a member sends to several ranks (one that ends
                // `Replicate`) is packed once per receiver.
                let c = exchange_counts(before, &step.after, &step.mesh_dims, coord)?;
                let (send, recv) = (c.0.iter().sum(), c.1.iter().sum());
                counts = Some(c);
                (Coll::AllToAll, send, recv, true)
            }
            StepKind::Slice => (Coll::Memcpy, n_out, n_out, true),
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
        let on = match &step.mesh_dims[..] {
            [m] => mesh.dim(*m)?,
            dims if dims.len() == mesh.ndim() => mesh.clone(),
            dims => mesh.slice_dims(dims)?,
        };
        // Ones, written here so every page is touched before timing; an all_reduce
        // works in place, so its buffer is then zeroed to stay finite over any number
        // of iterations.
        let mut recv = vec![1.0; recv];
        if matches!(coll, Coll::AllReduce) {
            recv.fill(0.0);
        }
        ops.push(BaseOp {
            coll,
            group: step.mesh_dims.to_vec(),
            on,
            send: vec![1.0; send],
            recv,
            counts,
        });
    }
    Ok(ops)
}

/// Elements this rank sends to and receives from each rank of `group` when going
/// from `before` to `after` (the group's ranks row-major over its mesh dims).
fn exchange_counts(
    before: &Layout,
    after: &Layout,
    group: &[usize],
    coord: &[usize],
) -> Result<(Vec<usize>, Vec<usize>), BoxError> {
    let overlap = |(ao, ash): &(Vec<usize>, Vec<usize>), (bo, bsh): &(Vec<usize>, Vec<usize>)| -> usize {
        (0..ao.len())
            .map(|d| (ao[d] + ash[d]).min(bo[d] + bsh[d]).saturating_sub(ao[d].max(bo[d])))
            .product()
    };
    let (mine_before, mine_after) = (before.local_region(coord)?, after.local_region(coord)?);
    let sizes: Vec<usize> = group.iter().map(|&m| before.mesh_shape[m]).collect();
    let (mut send, mut recv) = (Vec::new(), Vec::new());
    for k in 0..sizes.iter().product() {
        let mut peer = coord.to_vec();
        let mut rest = k;
        for (&m, &n) in group.iter().zip(&sizes).rev() {
            peer[m] = rest % n;
            rest /= n;
        }
        send.push(overlap(&mine_before, &after.local_region(&peer)?));
        recv.push(overlap(&before.local_region(&peer)?, &mine_after));
    }
    Ok((send, recv))
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
            let on = match &op.group[..] {
                [m] => format!("mesh dim {m}"),
                dims => format!("mesh dims {dims:?}"),
            };
            format!("{name}({len} f32 in, {on})")
        })
        .collect();
    items.join(" + ")
}

/// Runs the baseline once. With `fresh`, each output goes to a new buffer
/// allocated inside the caller's timing, as redistribute allocates its outputs
/// (zeroed, or for an all_reduce a copy of the input); those buffers are returned
/// so that they are freed outside it.
fn run_ops(ops: &mut [BaseOp], fresh: bool) -> Result<Vec<Vec<f32>>, BoxError> {
    let mut outputs = Vec::new();
    for op in ops.iter_mut() {
        let comm = op.on.comm();
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
            Coll::AllToAll => match &op.counts {
                Some((sc, rc)) => comm.all_to_all_v(f32::buf(&op.send), sc, f32::buf_mut(recv), rc)?,
                None => comm.all_to_all_slice(&op.send, recv)?,
            },
            Coll::Memcpy => recv.copy_from_slice(&op.send),
        }
        black_box(recv);
    }
    Ok(outputs)
}
