//! A timeout blames the rank that is not progressing, not the peer the timed-out
//! rank happened to wait for: with TP traffic on 2×2 and 2×2×2 meshes, a rank
//! that stalls in its own code leaves its peers waiting on it directly or through
//! ranks that wait on it in collectives of other groups, and every error of every
//! rank names the stalled rank.
//!
//! `TESSERA_BLAME_STALLS` sets how many stalls [`every_error_names_the_stalled_rank`]
//! tries (default 64, half on each mesh).

use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use tessera::mesh::Error;
use tessera::{CommunicatorExt, DeviceMesh, LaunchOptions, ReduceOp, launch_with};

/// Short enough that the sweep stays quick, long enough that a rank that is only
/// descheduled is not taken for a stalled one.
const TIMEOUT: Duration = Duration::from_millis(250);

/// One collective of a training step, on one mesh dim.
#[derive(Clone, Copy, Debug)]
enum Op {
    AllGather(usize),
    ReduceScatter(usize),
    AllReduce(usize),
}

impl Op {
    fn run(self, mesh: &DeviceMesh) -> Result<(), Error> {
        let x = [mesh.rank() as f32; 8];
        match self {
            Op::AllGather(d) => mesh.dim_comm(d)?.all_gather_vec(&x).map(drop),
            Op::ReduceScatter(d) => {
                let n = mesh.dim_comm(d)?.size();
                let mut out = vec![0.0f32; 8 / n];
                mesh.dim_comm(d)?.reduce_scatter_slice(&x, &mut out, ReduceOp::Sum)
            }
            Op::AllReduce(d) => mesh.dim_comm(d)?.all_reduce_slice(&mut x.clone(), ReduceOp::Sum),
        }
    }
}

/// A step of tensor-parallel traffic (the last dim is TP, dim 0 data parallel):
/// gather the activations, reduce-scatter and all-reduce the partial outputs over
/// TP, then the gradients over the other dims.
fn step(dims: usize) -> Vec<Op> {
    let tp = dims - 1;
    let mut ops = vec![Op::AllGather(tp), Op::ReduceScatter(tp), Op::AllReduce(tp)];
    if dims == 3 {
        ops.extend([Op::AllGather(1), Op::ReduceScatter(1)]);
    }
    ops.push(Op::AllReduce(0));
    ops
}

const STEPS: usize = 2;

/// The points a rank may stall at: before each collective of [`STEPS`] steps, and
/// before the closing barrier of the whole mesh.
fn points(dims: usize) -> usize {
    step(dims).len() * STEPS + 1
}

/// Holds the stalled rank until every other rank has reported its error (or a
/// minute has passed: then the counts below fail the test).
#[derive(Default)]
struct Gate {
    reported: Mutex<usize>,
    cv: Condvar,
}

impl Gate {
    fn report(&self) {
        *self.reported.lock().unwrap() += 1;
        self.cv.notify_all();
    }

    fn hold_until(&self, n: usize) {
        let reported = self.reported.lock().unwrap();
        drop(
            self.cv
                .wait_timeout_while(reported, Duration::from_secs(60), |r| *r < n)
                .unwrap(),
        );
    }
}

/// What one stall showed: the launch's error and each rank's own error.
struct Outcome {
    launch: Error,
    seen: Vec<Option<Error>>,
}

/// Runs TP traffic on a mesh of `shape` in which rank `stalled` stalls at `point`.
fn stall(shape: &'static [usize], stalled: usize, point: usize) -> Outcome {
    let n: usize = shape.iter().product();
    let seen: Arc<Mutex<Vec<Option<Error>>>> = Arc::new(Mutex::new((0..n).map(|_| None).collect()));
    let gate = Arc::new(Gate::default());
    let (errs, g) = (seen.clone(), gate.clone());
    let opts = LaunchOptions::default().timeout(TIMEOUT);
    let launch = launch_with(&opts, n, move |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), shape)?;
        let r = mesh.rank();
        let ops: Vec<Op> = (0..STEPS).flat_map(|_| step(shape.len())).collect();
        let mut out = Ok(());
        for (at, op) in ops.iter().enumerate() {
            if r == stalled && at == point {
                g.hold_until(n - 1);
            }
            out = op.run(&mesh);
            if out.is_err() {
                break;
            }
        }
        if out.is_ok() {
            if r == stalled && point == ops.len() {
                g.hold_until(n - 1);
            }
            out = mesh.comm().barrier();
        }
        let Err(e) = out else { return Ok(()) };
        let text = e.to_string();
        errs.lock().unwrap()[r] = Some(e);
        if r != stalled {
            g.report();
        }
        Err(text.into())
    })
    .expect_err("a stalled rank must fail the job");
    let seen = std::mem::take(&mut *seen.lock().unwrap());
    Outcome { launch, seen }
}

/// The rank an error blames, if it blames one.
fn blamed(e: &Error) -> Option<usize> {
    match e {
        Error::Timeout { stalled, .. } => Some(*stalled),
        Error::PeerFailed { rank, .. } | Error::RankFailed { rank, .. } => Some(*rank),
        _ => None,
    }
}

/// Whether every rank but `stalled` reported an error naming `stalled`, and the
/// launch did too; otherwise what was wrong.
fn check(o: &Outcome, stalled: usize) -> Result<(), String> {
    if blamed(&o.launch) != Some(stalled) {
        return Err(format!("launch: {}", o.launch));
    }
    for (r, e) in o.seen.iter().enumerate().filter(|&(r, _)| r != stalled) {
        match e {
            Some(e) if blamed(e) == Some(stalled) => {}
            Some(e) => return Err(format!("rank {r}: {e}")),
            None => return Err(format!("rank {r} reported no error")),
        }
    }
    Ok(())
}

/// Timeouts that blamed the stalled rank through a peer waiting in another group.
fn through_a_peer(o: &Outcome, stalled: usize) -> usize {
    o.seen
        .iter()
        .flatten()
        .filter(|e| matches!(e, Error::Timeout { missing, .. } if !missing.contains(&stalled)))
        .count()
}

fn stalls_wanted() -> usize {
    match std::env::var("TESSERA_BLAME_STALLS") {
        Ok(v) => v
            .parse()
            .unwrap_or_else(|_| panic!("TESSERA_BLAME_STALLS={v:?}: give a whole number of stalls")),
        Err(_) => 64,
    }
}

#[test]
fn every_error_names_the_stalled_rank() {
    let total = stalls_wanted();
    assert!(total >= 2, "TESSERA_BLAME_STALLS={total}: give at least 2 stalls");
    let (mut right, mut chained) = (0, 0);
    let mut wrong = Vec::new();
    let meshes: [&'static [usize]; 2] = [&[2, 2], &[2, 2, 2]];
    for (m, shape) in meshes.into_iter().enumerate() {
        let n: usize = shape.iter().product();
        let combos = n * points(shape.len());
        // A stride coprime to the number of (rank, point) pairs visits them all
        // once before repeating, spread over ranks and points.
        let stride = (combos / 3..).find(|s| gcd(*s, combos) == 1).unwrap();
        let count = total / 2 + (m * total % 2);
        for i in 0..count {
            let c = i * stride % combos;
            let (stalled, point) = (c % n, c / n);
            let o = stall(shape, stalled, point);
            chained += through_a_peer(&o, stalled);
            match check(&o, stalled) {
                Ok(()) => right += 1,
                Err(e) => wrong.push(format!("{shape:?}, rank {stalled} stalled at point {point}: {e}")),
            }
        }
    }
    println!(
        "blamed correctly: {right}/{total} stalls; {chained} timeouts blamed it through a peer waiting in another group"
    );
    assert_eq!(right, total, "misblamed:\n{}", wrong.join("\n"));
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}

#[test]
fn a_timeout_names_the_rank_its_missing_peer_waits_on() {
    // 2×2 mesh: rank 0 stalls; rank 3 waits on rank 1 over dim 0 at once; rank 1,
    // slower, then waits on rank 0 over dim 1; rank 2 enters the mesh's barrier
    // last. Rank 3 times out first, waiting on rank 1, which waits on rank 0.
    let seen: Arc<Mutex<Vec<Option<Error>>>> = Arc::new(Mutex::new((0..4).map(|_| None).collect()));
    let gate = Arc::new(Gate::default());
    let (errs, g) = (seen.clone(), gate.clone());
    let opts = LaunchOptions::default().timeout(Duration::from_millis(300));
    let launch = launch_with(&opts, 4, move |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), &[2, 2])?;
        let r = mesh.rank();
        let out = match r {
            0 => {
                g.hold_until(3);
                mesh.comm().barrier()
            }
            1 => {
                std::thread::sleep(Duration::from_millis(150));
                Op::AllGather(1).run(&mesh)
            }
            2 => {
                std::thread::sleep(Duration::from_millis(250));
                mesh.comm().barrier()
            }
            _ => Op::AllReduce(0).run(&mesh),
        };
        let Err(e) = out else { return Ok(()) };
        let text = e.to_string();
        errs.lock().unwrap()[r] = Some(e);
        if r != 0 {
            g.report();
        }
        Err(text.into())
    })
    .expect_err("a stalled rank must fail the job");
    let seen = std::mem::take(&mut *seen.lock().unwrap());
    let o = Outcome { launch, seen };
    check(&o, 0).unwrap();
    match &o.seen[3] {
        Some(
            e @ Error::Timeout {
                missing, stalled: 0, ..
            },
        ) => {
            assert_eq!(missing, &[1], "{e}");
            let msg = e.to_string();
            for needle in [
                "waiting on rank(s) [1]; rank 0 is not progressing: rank 1 waits on rank 0 in all_gather(",
                "ranks [0, 1])",
                "rank 0 is not progressing",
                "it is outside any collective (its last collective was split(",
                "which it passed",
            ] {
                assert!(msg.contains(needle), "{needle:?} missing from: {msg}");
            }
        }
        other => panic!("rank 3 should time out blaming rank 0 through rank 1: {other:?}"),
    }
    // The failure every other rank sees says the same.
    let msg = o.launch.to_string();
    for needle in [
        "rank 0 failed: did not enter all_gather (collective #0 of group",
        "where rank 1 waits for it; rank 3 timed out after 300ms in all_reduce",
        "waiting on rank(s) [1]",
    ] {
        assert!(msg.contains(needle), "{needle:?} missing from: {msg}");
    }
}
