//! Faults at every point of an FSDP training step with large units, each launch in
//! a child process so that a crash (a signal, an abort) is counted instead of
//! taking the test binary down with it.
//!
//! The model has [`UNITS`] units of `Linear(2048→4096)` + `Linear(4096→2048)` on
//! [`WORLD`] ranks of the threads backend (64 MiB of gathered parameters per rank
//! and unit: a reduce-scatter's input is 64 MiB, an all-gather's 16 MiB) and
//! trains one step on a tiny batch. One rank returns an error or panics at one
//! [`Point`] of that step, as soon as it gets there or once every other rank got
//! there too ([`Timing`]). The launch must return `RankFailed` naming that rank
//! and carrying the injected message; nothing else may happen: no crash, no
//! hang.
//!
//! What this catches: a failing rank whose closure has returned while its
//! communication thread (kept alive by FSDP's thread-local state) is still in a
//! collective. A peer that then leaves the collective's final barrier early frees
//! its buffers while other ranks' communication threads may still read them. The
//! children run with glibc's mmap threshold fixed at 1 MiB and without Tessera's
//! malloc tuning (`TESSERA_SYSTEM_MALLOC=1`), so such a buffer is unmapped when
//! freed and a late read faults instead of reading stale memory. Before the
//! threads backend made every rank wait for every peer at barrier points
//! (commit 7a6d348), 13 of 180 launches crashed with SIGSEGV in the kernels'
//! copies, mostly in the `after-rs*/panic` and `forward0/*/last` scenarios.
//!
//! The parent test [`faults_at_every_point_of_a_step`] runs
//! `TESSERA_FAULT_LAUNCHES` launches (default: every scenario once, one to three
//! minutes on two cores in the dev profile, depending on load), cycling over the
//! scenarios whose names contain `TESSERA_FAULT_ONLY` (default: all of them), at
//! most `TESSERA_FAULT_JOBS` children at a time (default 2), and prints a table
//! per scenario. Each child is this binary run again on the ignored test
//! [`child`], with `TESSERA_FAULT_SCENARIO` naming its scenario.
//!
//! `cargo test --test fsdp_faults -- --nocapture` shows the table;
//! `TESSERA_FAULT_LAUNCHES=180 cargo test --test fsdp_faults` stresses harder.

use std::fmt;
use std::io::Read;
use std::os::unix::process::ExitStatusExt;
use std::process::{Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tessera::autograd::nn::{Init, Linear, Materializer, Module};
use tessera::autograd::optim::{Optimizer, Sgd, SgdConfig};
use tessera::autograd::{Error, Var, backward};
use tessera::dtensor::{Placement, Tensor, distribute_tensor};
use tessera::fsdp::{FsdpConfig, fully_shard};
use tessera::{BoxError, DType, DeviceMesh, LaunchOptions, launch_with};

// ----- the training step and its faults ----------------------------------------

const WORLD: usize = 4;
const UNITS: usize = 2;
/// Model width; each unit's hidden width is twice this.
const DIM: usize = 2048;
/// Global batch rows (one per rank).
const ROWS: usize = 4;
/// How long a collective waits for a missing peer.
const COLLECTIVE_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a rank failing [`Timing::Last`] waits for the others to get there.
const RENDEZVOUS_TIMEOUT: Duration = Duration::from_secs(20);
/// How long, in milliseconds, it then lets their communication threads start
/// the collective just issued before it fails: launches cycle through these
/// (the parent passes one in [`SETTLE_ENV`]), since the right one depends on the
/// machine: long enough for every rank to enter, shorter than the data phase
/// (50 to 150 ms for 64 MiB on two busy cores).
const SETTLES_MS: [u64; 3] = [3, 10, 25];

/// Where in the step the failing rank fails.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Point {
    /// First thing in the rank's closure, before it builds its mesh.
    Start,
    /// At the top of unit `k`'s forward (the model's code), which FSDP's
    /// pre-forward hook entered once it had issued the prefetch all-gather of
    /// unit `k + 1`: that all-gather is in flight.
    Forward(usize),
    /// The loss is computed, backward has not started.
    BeforeBackward,
    /// In backward, right after unit `k`'s post-backward issued the
    /// reduce-scatter of its gradients: a hook on the activation entering unit
    /// `k`. The unit's parameter hooks, the last of which issues the
    /// reduce-scatter, are recorded after it, so backward runs them just before it.
    AfterReduceScatter(usize),
    /// Backward has returned (every reduction finished), before the optimizer step.
    BeforeStep,
}

impl Point {
    /// Whether a collective is in flight here (issued just before, not waited for).
    fn in_flight(self) -> bool {
        matches!(self, Point::Forward(_) | Point::AfterReduceScatter(_))
    }
}

impl fmt::Display for Point {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Point::Start => f.write_str("start"),
            Point::Forward(k) => write!(f, "forward{k}"),
            Point::BeforeBackward => f.write_str("before-backward"),
            Point::AfterReduceScatter(k) => write!(f, "after-rs{k}"),
            Point::BeforeStep => f.write_str("before-step"),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Error,
    Panic,
}

/// When the failing rank fails, relative to the other ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Timing {
    /// As soon as it gets to the point: a collective issued just before may not
    /// have every rank yet.
    First,
    /// Once every other rank got there too (they report to shared memory, which
    /// the threads backend's ranks have, not through a collective), and a
    /// settling time later (see [`SETTLES_MS`]): the collective issued just
    /// before has every rank and is moving data, so the failing rank leaves
    /// while its communication thread still reads the peers' buffers.
    Last,
}

/// One way for one launch to fail.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Scenario {
    point: Point,
    mode: Mode,
    rank: usize,
    timing: Timing,
}

impl fmt::Display for Scenario {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mode = match self.mode {
            Mode::Error => "error",
            Mode::Panic => "panic",
        };
        write!(f, "{}/{mode}/r{}", self.point, self.rank)?;
        match self.timing {
            Timing::First => Ok(()),
            Timing::Last => f.write_str("/last"),
        }
    }
}

/// Every scenario: each point of the step × error or panic × the first and last
/// rank, failing first and (where a collective is in flight) last.
fn scenarios() -> Vec<Scenario> {
    let mut points = vec![Point::Start];
    points.extend((0..UNITS - 1).map(Point::Forward));
    points.push(Point::BeforeBackward);
    points.extend((0..UNITS).rev().map(Point::AfterReduceScatter));
    points.push(Point::BeforeStep);
    let mut out = Vec::new();
    for point in points {
        let timings: &[Timing] = if point.in_flight() {
            &[Timing::First, Timing::Last]
        } else {
            &[Timing::First]
        };
        for &timing in timings {
            for mode in [Mode::Error, Mode::Panic] {
                for rank in [0, WORLD - 1] {
                    out.push(Scenario {
                        point,
                        mode,
                        rank,
                        timing,
                    });
                }
            }
        }
    }
    out
}

/// The text every injected failure carries.
const INJECTED: &str = "injected fault";

/// The points each rank of one launch has passed (the failing rank's excepted).
#[derive(Default)]
struct Arrivals {
    passed: Mutex<Vec<Point>>,
    cv: Condvar,
}

impl Arrivals {
    fn arrive(&self, at: Point) {
        lock(&self.passed).push(at);
        self.cv.notify_all();
    }

    /// Waits until `n` ranks passed `at`, or [`RENDEZVOUS_TIMEOUT`].
    fn wait_for(&self, at: Point, n: usize) {
        let deadline = Instant::now() + RENDEZVOUS_TIMEOUT;
        let mut passed = lock(&self.passed);
        while passed.iter().filter(|&&p| p == at).count() < n {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            passed = self.cv.wait_timeout(passed, left).unwrap_or_else(|e| e.into_inner()).0;
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The fault as one rank sees it.
#[derive(Clone)]
struct Fault {
    scenario: Scenario,
    rank: usize,
    arrivals: Arc<Arrivals>,
    settle: Duration,
}

impl Fault {
    /// This rank gets to `at`: it fails there if the scenario says so.
    fn at(&self, at: Point) -> tessera::autograd::Result<()> {
        let s = self.scenario;
        if s.rank != self.rank {
            self.arrivals.arrive(at);
            return Ok(());
        }
        if s.point != at {
            return Ok(());
        }
        if s.timing == Timing::Last {
            self.arrivals.wait_for(at, WORLD - 1);
            std::thread::sleep(self.settle);
        }
        let what = format!("{INJECTED} at {at} on rank {}", self.rank);
        match s.mode {
            Mode::Error => Err(Error::Config {
                op: "fault injection",
                detail: what,
            }),
            Mode::Panic => panic!("{what}"),
        }
    }

    /// `x`, with a backward hook that gets to `at` once `x`'s gradient is complete.
    fn tap(&self, x: &Var, at: Point) -> Var {
        let me = self.clone();
        if x.requires_grad() {
            Var::from_op("fault_tap", x.value().clone(), &[x], move |g| {
                me.at(at)?;
                Ok(std::iter::once(Some(g.clone())).collect())
            })
        } else {
            Var::with_grad_hook("fault_tap", x.value().clone(), move |_| me.at(at))
        }
    }
}

/// One FSDP unit: `fc2(relu(fc1(x)))`.
struct Block {
    index: usize,
    fc1: Linear,
    fc2: Linear,
    fault: Fault,
}

impl Module for Block {
    fn named_children(&self) -> Vec<(String, &dyn Module)> {
        vec![("fc1".into(), &self.fc1), ("fc2".into(), &self.fc2)]
    }

    fn forward(&self, x: &Var) -> tessera::autograd::Result<Var> {
        if self.index + 1 < UNITS {
            self.fault.at(Point::Forward(self.index))?;
        }
        let h = self.fc1.call(x)?.relu()?;
        self.fc2.call(&h)
    }
}

struct Net {
    blocks: Vec<Block>,
    fault: Fault,
}

impl Module for Net {
    fn named_children(&self) -> Vec<(String, &dyn Module)> {
        self.blocks
            .iter()
            .enumerate()
            .map(|(i, b)| (i.to_string(), b as &dyn Module))
            .collect()
    }

    fn forward(&self, x: &Var) -> tessera::autograd::Result<Var> {
        let mut h = x.clone();
        for b in &self.blocks {
            h = b.call(&self.fault.tap(&h, Point::AfterReduceScatter(b.index)))?;
        }
        Ok(h)
    }
}

/// A replicated `Linear(inputs→outputs)` with constant weights: the values do not
/// matter here, and random initialisation of 64 MiB per unit on every rank would
/// take most of a launch.
fn linear(inputs: usize, outputs: usize, mesh: &DeviceMesh) -> tessera::autograd::Result<Linear> {
    let lin = Linear::new(inputs, outputs, true, mesh, DType::F32)?;
    Materializer::from_seed(0)
        .init("*", Init::Constant(1.0 / inputs as f64))
        .check_replicas(false)
        .materialize(&lin)?;
    Ok(lin)
}

/// One launch: every rank trains one step, and the scenario's rank fails.
fn run(scenario: Scenario, settle: Duration) -> tessera::mesh::Result<Vec<f64>> {
    let opts = LaunchOptions::default().timeout(COLLECTIVE_TIMEOUT);
    let arrivals = Arc::new(Arrivals::default());
    launch_with(&opts, WORLD, move |ctx| -> Result<f64, BoxError> {
        let fault = Fault {
            scenario,
            rank: ctx.rank(),
            arrivals: arrivals.clone(),
            settle,
        };
        fault.at(Point::Start)?;
        let mesh = DeviceMesh::new(ctx.into_comm(), &[WORLD])?;
        let mut blocks = Vec::new();
        for index in 0..UNITS {
            blocks.push(Block {
                index,
                fc1: linear(DIM, 2 * DIM, &mesh)?,
                fc2: linear(2 * DIM, DIM, &mesh)?,
                fault: fault.clone(),
            });
        }
        let net = Net {
            blocks,
            fault: fault.clone(),
        };
        tessera::autograd::nn::name_parameters(&net)?;
        let units = net
            .blocks
            .iter()
            .map(|b| fully_shard(b, &mesh, FsdpConfig::default()))
            .collect::<Result<Vec<_>, _>>()?;
        // The first step has no recorded order to prefetch by: name the next unit.
        for pair in units.windows(2) {
            pair[0].set_modules_to_forward_prefetch(&[&pair[1]]);
        }
        let _root = fully_shard(&net, &mesh, FsdpConfig::default())?;
        let mut opt = Sgd::new(net.parameters(), SgdConfig::default())?;
        let x = Tensor::randn(&[ROWS, DIM], DType::F32, 1)?;
        let x = Var::constant(distribute_tensor(&x, &mesh, &[Placement::Shard(0)])?);
        let loss = net.call(&x)?.square()?.mean(&[0, 1], false)?;
        fault.at(Point::BeforeBackward)?;
        backward(&loss)?;
        fault.at(Point::BeforeStep)?;
        opt.step()?;
        Ok(loss.value().full_tensor()?.to_f64_vec()[0])
    })
}

/// Whether a launch ended as the scenario must: `RankFailed` naming the failing
/// rank, with the injected message.
fn check(s: Scenario, r: &tessera::mesh::Result<Vec<f64>>) -> Result<(), String> {
    match r {
        Err(tessera::mesh::Error::RankFailed { rank, source }) => {
            let msg = source.to_string();
            if *rank != s.rank {
                Err(format!("RankFailed names rank {rank}, rank {} failed: {msg}", s.rank))
            } else if !msg.contains(INJECTED) {
                Err(format!("RankFailed {rank} without the injected failure: {msg}"))
            } else {
                Ok(())
            }
        }
        Err(e) => Err(format!("expected RankFailed {{ rank: {} }}, got: {e}", s.rank)),
        Ok(v) => Err(format!(
            "expected RankFailed {{ rank: {} }}, the launch succeeded: {v:?}",
            s.rank
        )),
    }
}

// ----- child and parent -----------------------------------------------------------

/// Names the child's scenario (its `Display` form).
const SCENARIO_ENV: &str = "TESSERA_FAULT_SCENARIO";
/// The child's settling time in milliseconds (default the middle of [`SETTLES_MS`]).
const SETTLE_ENV: &str = "TESSERA_FAULT_SETTLE_MS";
/// The child's exit code for a launch that ended otherwise than it must.
const WRONG_EXIT: i32 = 3;
/// The child's last line of output when the launch ended as it must.
const OK_LINE: &str = "fault-child ok";

/// A child running longer than this is killed and counted as a hang.
const CHILD_DEADLINE: Duration = Duration::from_secs(150);

/// One launch in this process: the scenario that [`SCENARIO_ENV`] names.
#[test]
#[ignore = "a child of faults_at_every_point_of_a_step, which runs it with TESSERA_FAULT_SCENARIO set"]
fn child() {
    let name = std::env::var(SCENARIO_ENV).unwrap_or_default();
    let all = scenarios();
    let Some(&s) = all.iter().find(|s| s.to_string() == name) else {
        let names: Vec<String> = all.iter().map(Scenario::to_string).collect();
        panic!("set {SCENARIO_ENV} to one of {names:?} (got {name:?})");
    };
    let settle = Duration::from_millis(env_count(SETTLE_ENV, SETTLES_MS[1] as usize) as u64);
    let t = Instant::now();
    let r = run(s, settle);
    let ms = t.elapsed().as_millis();
    match check(s, &r) {
        Ok(()) => println!("{OK_LINE} {s} {ms} ms"),
        Err(why) => {
            eprintln!("fault-child wrong result {s} after {ms} ms: {why}");
            std::process::exit(WRONG_EXIT);
        }
    }
}

/// How one child ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Outcome {
    Ok,
    /// Killed by a signal (SIGSEGV, SIGABRT, ...).
    Crash,
    /// Killed after [`CHILD_DEADLINE`].
    Hang,
    /// Exit code [`WRONG_EXIT`]: the launch returned something else than it must.
    Wrong,
    /// Any other exit (the child test itself failed, or printed no verdict).
    Failed,
}

struct Launch {
    scenario: usize,
    outcome: Outcome,
    wall: Duration,
    /// The launch's own duration as the child measured it.
    launch_ms: Option<u64>,
    detail: String,
}

fn env_count(name: &str, default: usize) -> usize {
    match std::env::var(name) {
        Ok(v) => v
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v:?} is not a count")),
        Err(_) => default,
    }
}

fn read_all(mut r: impl Read + Send + 'static) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut b = Vec::new();
        let _ = r.read_to_end(&mut b);
        String::from_utf8_lossy(&b).into_owned()
    })
}

/// The last `n` lines of `s`.
fn tail(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

fn classify(status: Option<ExitStatus>, out: &str) -> Outcome {
    match status {
        None => Outcome::Hang,
        Some(st) if st.signal().is_some() => Outcome::Crash,
        Some(st) if st.code() == Some(WRONG_EXIT) => Outcome::Wrong,
        Some(st) if st.success() && out.contains(OK_LINE) => Outcome::Ok,
        Some(_) => Outcome::Failed,
    }
}

/// Runs scenario `s` in a child process.
fn launch_child(index: usize, s: Scenario, settle_ms: u64) -> Launch {
    let exe = std::env::current_exe().expect("the test binary's path");
    let start = Instant::now();
    let mut child = Command::new(exe)
        .args(["--exact", "child", "--ignored", "--nocapture", "--test-threads=1"])
        .env(SCENARIO_ENV, s.to_string())
        .env(SETTLE_ENV, settle_ms.to_string())
        .env("RUST_BACKTRACE", "0")
        // Buffers of 1 MiB or more get their own mapping, unmapped when freed, so
        // that a read of a freed buffer faults instead of reading stale memory:
        // glibc's threshold fixed at 1 MiB, and Tessera's own tuning (which keeps
        // buffers up to 32 MiB in the heap) off.
        .env("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=1048576")
        .env("TESSERA_SYSTEM_MALLOC", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("cannot start a child test process");
    let out = read_all(child.stdout.take().expect("piped stdout"));
    let err = read_all(child.stderr.take().expect("piped stderr"));
    let status = loop {
        match child.try_wait().expect("waiting for a child") {
            Some(st) => break Some(st),
            None if start.elapsed() > CHILD_DEADLINE => {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            None => std::thread::sleep(Duration::from_millis(20)),
        }
    };
    let wall = start.elapsed();
    let (out, err) = (out.join().unwrap_or_default(), err.join().unwrap_or_default());
    let outcome = classify(status, &out);
    let launch_ms = out
        .lines()
        .find_map(|l| l.split_once(OK_LINE))
        .and_then(|(_, l)| l.split_whitespace().nth(1))
        .and_then(|ms| ms.parse().ok());
    let how = match status {
        None => format!("killed after {:.0?}", CHILD_DEADLINE),
        Some(st) => match st.signal() {
            Some(sig) => format!("signal {sig}"),
            None => format!("exit {}", st.code().unwrap_or(-1)),
        },
    };
    Launch {
        scenario: index,
        outcome,
        wall,
        launch_ms,
        detail: format!(
            "{s} (settle {settle_ms} ms): {how}\n{}",
            tail(&format!("{out}{err}"), 12)
        ),
    }
}

/// Faults at every point of an FSDP step with 64 MiB units: every launch returns
/// `RankFailed` naming the failing rank; none crashes, hangs, or ends otherwise.
#[test]
fn faults_at_every_point_of_a_step() {
    let only = std::env::var("TESSERA_FAULT_ONLY").unwrap_or_default();
    let all: Vec<Scenario> = scenarios()
        .into_iter()
        .filter(|s| s.to_string().contains(&only))
        .collect();
    assert!(!all.is_empty(), "no scenario name contains TESSERA_FAULT_ONLY={only:?}");
    let n = env_count("TESSERA_FAULT_LAUNCHES", all.len());
    let jobs = env_count("TESSERA_FAULT_JOBS", 2).max(1);
    let next = AtomicUsize::new(0);
    let done = Mutex::new(Vec::with_capacity(n));
    let start = Instant::now();
    std::thread::scope(|sc| {
        for _ in 0..jobs.min(n) {
            sc.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= n {
                        break;
                    }
                    // Each pass over the scenarios shifts the settling times.
                    let settle = SETTLES_MS[(i + i / all.len()) % SETTLES_MS.len()];
                    let l = launch_child(i % all.len(), all[i % all.len()], settle);
                    if l.outcome != Outcome::Ok {
                        eprintln!("launch {i}: {:?} {}", l.outcome, l.detail);
                    }
                    lock(&done).push(l);
                }
            });
        }
    });
    let runs = done.into_inner().unwrap_or_else(|e| e.into_inner());
    let total = start.elapsed();

    let kinds = [
        Outcome::Ok,
        Outcome::Crash,
        Outcome::Hang,
        Outcome::Wrong,
        Outcome::Failed,
    ];
    let count = |i: Option<usize>, o: Outcome| {
        runs.iter()
            .filter(|l| i.is_none_or(|i| l.scenario == i) && l.outcome == o)
            .count()
    };
    println!(
        "{:<26}{:>9}{:>6}{:>9}{:>7}{:>7}{:>8}{:>14}",
        "scenario", "launches", "ok", "crashes", "hangs", "wrong", "failed", "launch ms"
    );
    for (i, s) in all.iter().enumerate() {
        let mine: Vec<&Launch> = runs.iter().filter(|l| l.scenario == i).collect();
        if mine.is_empty() {
            continue;
        }
        let ms: Vec<u64> = mine.iter().filter_map(|l| l.launch_ms).collect();
        let ms = match ms.iter().max() {
            Some(max) => format!("{}/{max}", ms.iter().sum::<u64>() / ms.len() as u64),
            None => "-".into(),
        };
        let c: Vec<usize> = kinds.iter().map(|&o| count(Some(i), o)).collect();
        println!(
            "{:<26}{:>9}{:>6}{:>9}{:>7}{:>7}{:>8}{:>14}",
            s.to_string(),
            mine.len(),
            c[0],
            c[1],
            c[2],
            c[3],
            c[4],
            ms
        );
    }
    let c: Vec<usize> = kinds.iter().map(|&o| count(None, o)).collect();
    let walls: Vec<f64> = runs.iter().map(|l| l.wall.as_secs_f64()).collect();
    let mean_wall = walls.iter().sum::<f64>() / walls.len().max(1) as f64;
    let max_wall = walls.iter().copied().fold(0.0, f64::max);
    println!(
        "{:<26}{:>9}{:>6}{:>9}{:>7}{:>7}{:>8}",
        "total",
        runs.len(),
        c[0],
        c[1],
        c[2],
        c[3],
        c[4]
    );
    println!(
        "{n} launches, {jobs} at a time, in {:.1} s; child wall time mean {mean_wall:.2} s, max {max_wall:.2} s \
         (launch ms above: mean/max of the launch itself)",
        total.as_secs_f64()
    );
    assert_eq!(runs.len(), n, "every launch ran");
    assert!(
        c[1] == 0 && c[2] == 0 && c[3] == 0 && c[4] == 0,
        "of {n} launches, {} crashed, {} hung, {} ended with a wrong result and {} failed otherwise (details above)",
        c[1],
        c[2],
        c[3],
        c[4]
    );
}
