//! What a rank does, as it happens: the module it runs and in which phase, the
//! DTensor ops, the collectives (kind, mesh dim, bytes, start and end), FSDP's
//! regions and samples of its tensor memory. The collective report
//! ([`CommReport`], PyTorch: `CommDebugMode`) and the timeline trace
//! ([`chrome_trace`], PyTorch: the profiler's `export_chrome_trace`) are read
//! from these events.
//!
//! Recording is per rank: [`record`] starts it on the calling thread (the
//! thread that runs a rank), [`Recording::finish`] returns the rank's events.
//! Off, every event site costs one relaxed atomic load. Times are nanoseconds
//! since one process-wide epoch, so the ranks of one process share a clock.
//!
//! ```
//! use tessera_mesh::observe::{self, What};
//!
//! let rec = observe::record();
//! {
//!     let _m = observe::module("layers.0", observe::Phase::Forward);
//!     let _op = observe::span(What::Op("matmul"));
//! }
//! let events = rec.finish();
//! assert_eq!(events.len(), 2);
//! assert_eq!(events[1].module.as_ref().map(|(m, _)| &**m), Some("layers.0"));
//! ```

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use crate::stats::OpKind;

mod oplog;
mod report;
mod trace;

pub use oplog::{
    Moved, OpLog, OpRecord, PlanStep, ShapeDisplay, TensorDesc, logging_ops, op_log, op_log_entries, op_log_json,
    record_ops, unrecorded,
};
pub use report::{CommReport, json_string};
pub use trace::{COMM_TRACK, chrome_trace};

/// Recordings open in this process: event sites look no further while it is 0.
static RECORDING: AtomicUsize = AtomicUsize::new(0);

fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

fn now_ns() -> u64 {
    epoch().elapsed().as_nanos() as u64
}

/// Forward or backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Phase {
    /// The forward pass (a module's call).
    Forward,
    /// The backward pass (the gradients of the ops a module recorded).
    Backward,
}

impl Phase {
    /// `"forward"` or `"backward"`.
    pub fn name(self) -> &'static str {
        match self {
            Phase::Forward => "forward",
            Phase::Backward => "backward",
        }
    }
}

/// What an event is.
#[derive(Clone, Debug, PartialEq)]
pub enum What {
    /// One training step (set by the training loop).
    Step(usize),
    /// A module running in a phase (forward: its call; backward: the
    /// gradients of the ops it recorded).
    Module {
        /// Fully qualified name (`""` for the root).
        fqn: Arc<str>,
        /// Forward or backward.
        phase: Phase,
    },
    /// A DTensor op (its redistributions and local kernels).
    Op(&'static str),
    /// A collective, from issue to completion (`queued`: an asynchronous one,
    /// from issue to its hand-off to the communication thread).
    Collective {
        /// Its kind.
        kind: OpKind,
        /// The mesh dims it runs over (`"dp"`, `"tp"`, `"dp×tp"`), or
        /// `comm(n)` for a communicator no mesh named.
        group: Arc<str>,
        /// Ranks taking part.
        ranks: usize,
        /// Bytes this rank sends (as [`CommStats`](crate::CommStats) counts them).
        bytes: u64,
        /// Issued asynchronously.
        queued: bool,
    },
    /// A named region of a library (FSDP's `unshard`, `reshard`,
    /// `reduce_grads`).
    Region(&'static str),
    /// An asynchronous collective's run on the communication thread, from its
    /// start to its finish (peers' arrival included), recorded when the rank
    /// waits for it ([`Work::wait_timed`](crate::Work::wait_timed)); the trace
    /// draws it on the rank's communication track.
    CommRun {
        /// Its kind.
        kind: OpKind,
        /// The mesh dims it runs over.
        group: Arc<str>,
        /// Bytes this rank sends.
        bytes: u64,
        /// How long the rank blocked waiting for it, in ns.
        blocked_ns: u64,
    },
    /// Bytes of tensor storage in use at the event's start (an instant).
    Memory(u64),
    /// One entry of the op log (an instant at the op's end; recorded only
    /// by a [`record_ops`] recording).
    OpLog(Box<OpRecord>),
}

/// One event of a rank: what, when (ns since the process's epoch), for how
/// long, and the innermost module running then.
#[derive(Clone, Debug, PartialEq)]
pub struct Event {
    /// What happened.
    pub what: What,
    /// Start, in ns since the process-wide epoch.
    pub start_ns: u64,
    /// Duration in ns (0 for instants).
    pub dur_ns: u64,
    /// The innermost module running when it started, and its phase.
    pub module: Option<(Arc<str>, Phase)>,
}

#[derive(Default)]
struct Recorder {
    op_log: OpLog,
    events: Vec<Event>,
    /// Open module scopes, innermost last.
    modules: Vec<(Arc<str>, Phase)>,
    /// Printing the op log as it happens for this rank instead of keeping
    /// events (see [`echo_ops`]).
    echo: Option<usize>,
}

thread_local! {
    static RECORDER: RefCell<Option<Recorder>> = const { RefCell::new(None) };
    /// Names of communicators by address (see [`name_group`]).
    static GROUPS: RefCell<HashMap<usize, Arc<str>>> = RefCell::new(HashMap::new());
}

/// Whether the calling thread records (cheap when no thread of the process does).
pub fn active() -> bool {
    RECORDING.load(Ordering::Relaxed) > 0 && RECORDER.with(|r| r.borrow().is_some())
}

/// An open recording on this thread; [`finish`](Self::finish) ends it.
pub struct Recording {
    _thread: std::marker::PhantomData<*const ()>,
}

/// Starts recording the calling thread's events (a rank's). A recording
/// already open on the thread is ended first, its events dropped.
pub fn record() -> Recording {
    epoch();
    RECORDER.with(|r| {
        if r.borrow_mut().replace(Recorder::default()).is_none() {
            RECORDING.fetch_add(1, Ordering::Relaxed);
        }
    });
    Recording {
        _thread: std::marker::PhantomData,
    }
}

/// Prints every DTensor op the calling rank runs to stderr as it runs, in
/// the op log's notation, one line each: `[rank 0] layers.0.attention
/// forward: matmul(f32[4,32,64] (Shard(0), Replicate), ...) -> ... on mesh(dp=2,
/// tp=2); implicit redistribute of input 1 to (Shard(0), Shard(1))` (and with
/// `OpLog::Values` each output's global sums). Keeps no events, so it can
/// stay on for a whole run; a recording started later on the thread (as
/// `train --op-log` starts) takes over. [`launch`](crate::launch) starts it
/// on every rank when `TESSERA_DEBUG=ops` (or `values`).
///
/// PyTorch: running under `DebugMode` and printing its log.
pub fn echo_ops(rank: usize, log: OpLog) -> Recording {
    let rec = record_ops(log);
    RECORDER.with(|r| {
        if let Some(r) = r.borrow_mut().as_mut() {
            r.echo = Some(rank);
        }
    });
    rec
}

/// The line [`echo_ops`] prints for an op-log entry of `rank` run inside `module`.
fn echo_line(rank: usize, module: Option<&(Arc<str>, Phase)>, record: &OpRecord) -> String {
    match module {
        Some((fqn, phase)) if !fqn.is_empty() => format!("[rank {rank}] {fqn} {}: {record}", phase.name()),
        Some((_, phase)) => format!("[rank {rank}] (root) {}: {record}", phase.name()),
        None => format!("[rank {rank}] {record}"),
    }
}

impl Recording {
    /// Ends the recording: the events in order of their start (an event
    /// starts before the events nested in it).
    pub fn finish(self) -> Vec<Event> {
        let mut events = stop().map(|r| r.events).unwrap_or_default();
        // Spans are stored when they end: sort by start, outer before inner.
        events.sort_by(|a, b| a.start_ns.cmp(&b.start_ns).then(b.dur_ns.cmp(&a.dur_ns)));
        events
    }
}

impl Drop for Recording {
    fn drop(&mut self) {
        stop();
    }
}

fn stop() -> Option<Recorder> {
    let r = RECORDER.with(|r| r.borrow_mut().take());
    if r.is_some() {
        RECORDING.fetch_sub(1, Ordering::Relaxed);
    }
    r
}

/// A module and the phase it runs in.
type ModuleScope = (Arc<str>, Phase);

/// A span being timed: stored as an event when dropped.
#[must_use = "the span lasts until it is dropped"]
pub struct Span {
    open: Option<(What, u64, Option<ModuleScope>)>,
    /// A module scope to pop when the span ends.
    pops: bool,
}

impl Span {
    fn none() -> Span {
        Span {
            open: None,
            pops: false,
        }
    }
}

impl Drop for Span {
    fn drop(&mut self) {
        let Some((what, start, module)) = self.open.take() else {
            return;
        };
        let end = now_ns();
        let pops = self.pops;
        RECORDER.with(|r| {
            if let Some(r) = r.borrow_mut().as_mut() {
                if pops {
                    r.modules.pop();
                }
                if r.echo.is_some() {
                    return;
                }
                r.events.push(Event {
                    what,
                    start_ns: start,
                    dur_ns: end.saturating_sub(start),
                    module,
                });
            }
        });
    }
}

fn innermost(r: &Recorder) -> Option<(Arc<str>, Phase)> {
    r.modules.last().cloned()
}

/// Times `what` until the returned span drops (nothing when not recording).
pub fn span(what: What) -> Span {
    if RECORDING.load(Ordering::Relaxed) == 0 {
        return Span::none();
    }
    RECORDER.with(|r| match r.borrow().as_ref() {
        Some(rec) => Span {
            open: Some((what, now_ns(), innermost(rec))),
            pops: false,
        },
        None => Span::none(),
    })
}

/// Runs the module `fqn` in `phase` until the span drops: events inside are
/// attributed to it.
pub fn module(fqn: impl Into<Arc<str>>, phase: Phase) -> Span {
    if RECORDING.load(Ordering::Relaxed) == 0 {
        return Span::none();
    }
    let fqn = fqn.into();
    RECORDER.with(|r| match r.borrow_mut().as_mut() {
        Some(rec) => {
            let outer = innermost(rec);
            rec.modules.push((fqn.clone(), phase));
            Span {
                open: Some((What::Module { fqn, phase }, now_ns(), outer)),
                pops: true,
            }
        }
        None => Span::none(),
    })
}

/// The innermost module running on this thread now (`None` when not recording).
pub fn current_module() -> Option<(Arc<str>, Phase)> {
    if RECORDING.load(Ordering::Relaxed) == 0 {
        return None;
    }
    RECORDER.with(|r| r.borrow().as_ref().and_then(innermost))
}

/// Records `what`, which ran from `start` to `end` (on another thread, such
/// as a collective's run on the communication thread), as an event of the
/// calling rank's recording, under the innermost module running now.
fn ran(what: What, start: Instant, end: Instant) {
    if RECORDING.load(Ordering::Relaxed) == 0 {
        return;
    }
    let ns = |t: Instant| t.saturating_duration_since(epoch()).as_nanos() as u64;
    RECORDER.with(|r| {
        if let Some(rec) = r.borrow_mut().as_mut()
            && rec.echo.is_none()
        {
            let module = innermost(rec);
            rec.events.push(Event {
                what,
                start_ns: ns(start),
                dur_ns: ns(end).saturating_sub(ns(start)),
                module,
            });
        }
    });
}

/// Records an instant sample of the tensor bytes in use.
pub fn memory(bytes: u64) {
    instant(What::Memory(bytes));
}

/// Stores `what` as an instant of the calling rank's recording, if any,
/// under the innermost module running.
fn instant(what: What) {
    if RECORDING.load(Ordering::Relaxed) == 0 {
        return;
    }
    RECORDER.with(|r| {
        if let Some(rec) = r.borrow_mut().as_mut() {
            let module = innermost(rec);
            if let Some(rank) = rec.echo {
                if let What::OpLog(record) = &what {
                    eprintln!("{}", echo_line(rank, module.as_ref(), record));
                }
                return;
            }
            rec.events.push(Event {
                what,
                start_ns: now_ns(),
                dur_ns: 0,
                module,
            });
        }
    });
}

/// Names the communicator at address `comm` (the data address of the
/// `dyn Communicator`) on this thread: the mesh dims it runs over.
/// `DeviceMesh` names its communicators when it is built.
pub fn name_group(comm: usize, name: &str) {
    GROUPS.with(|g| g.borrow_mut().insert(comm, Arc::from(name)));
}

/// The name of the communicator at `comm` of `ranks` ranks on this thread
/// (see [`name_group`]), `comm(ranks)` when no mesh named it.
fn group_name(comm: usize, ranks: usize) -> Arc<str> {
    let group = GROUPS.with(|g| g.borrow().get(&comm).cloned());
    group.unwrap_or_else(|| Arc::from(format!("comm({ranks})")))
}

/// What an asynchronous collective's run is recorded as when its rank waits
/// for it ([`What::CommRun`]): made where the backend queues it, which names
/// its group as for [`What::Collective`].
pub(crate) struct RunLabel {
    kind: OpKind,
    group: Arc<str>,
    bytes: u64,
}

impl RunLabel {
    /// Records the run, from `start` to `end` on the communication thread,
    /// for which the rank blocked `blocked`.
    pub(crate) fn record(self, start: Instant, end: Instant, blocked: std::time::Duration) {
        let what = What::CommRun {
            kind: self.kind,
            group: self.group,
            bytes: self.bytes,
            blocked_ns: blocked.as_nanos() as u64,
        };
        ran(what, start, end);
    }
}

/// [`collective`] of an asynchronous collective, timed to its hand-off to
/// the communication thread; and, while this thread records, the label its
/// run is recorded under when the rank waits for it.
pub(crate) fn queued(comm: usize, kind: OpKind, ranks: usize, bytes: u64) -> Option<RunLabel> {
    drop(collective(comm, kind, ranks, bytes, true));
    (active() && !matches!(kind, OpKind::Split)).then(|| RunLabel {
        kind,
        group: group_name(comm, ranks),
        bytes,
    })
}

/// The span of a collective that the communicator at `comm` issues (see
/// [`What::Collective`]); backends call it where they count the collective.
pub fn collective(comm: usize, kind: OpKind, ranks: usize, bytes: u64, queued: bool) -> Span {
    if RECORDING.load(Ordering::Relaxed) == 0 || matches!(kind, OpKind::Split) {
        return Span::none();
    }
    let group = group_name(comm, ranks);
    span(What::Collective {
        kind,
        group,
        ranks,
        bytes,
        queued,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Echoing keeps no events (it can stay on for a whole run), logs ops,
    /// and prints each under its rank and module.
    #[test]
    fn echo_prints_instead_of_keeping() {
        let rec = echo_ops(3, OpLog::Ops);
        assert_eq!(logging_ops(), Some(false), "ops log themselves while echoing");
        {
            let _m = module("layers.0.attention", Phase::Backward);
            let _op = span(What::Op("matmul"));
            memory(7);
        }
        assert!(rec.finish().is_empty(), "an echo keeps no events");
        assert_eq!(logging_ops(), None);
        let desc = TensorDesc {
            shape: vec![4, 8],
            dtype: crate::DType::F32,
            placements: "(Shard(0), Replicate)".into(),
        };
        let record = OpRecord {
            op: "matmul",
            explicit: false,
            inputs: vec![desc.clone(), desc.clone()],
            moved: vec![Moved {
                input: 1,
                to: "(Replicate, Replicate)".into(),
                plan: vec![PlanStep {
                    kind: "all_gather".into(),
                    mesh_dims: "dp".into(),
                    bytes: 64,
                }],
            }],
            output: desc,
            mesh: "mesh(dp=2, tp=2)".into(),
            values: None,
        };
        let module: (Arc<str>, Phase) = (Arc::from("layers.0.attention"), Phase::Backward);
        assert_eq!(
            echo_line(3, Some(&module), &record),
            "[rank 3] layers.0.attention backward: matmul(f32[4,8] (Shard(0), Replicate), f32[4,8] (Shard(0), \
             Replicate)) -> f32[4,8] (Shard(0), Replicate) on mesh(dp=2, tp=2); implicit redistribute of input 1 to \
             (Replicate, Replicate) by all_gather over dp (64 B)"
        );
        assert_eq!(echo_line(0, None, &record), format!("[rank 0] {record}"));
        let root: (Arc<str>, Phase) = (Arc::from(""), Phase::Forward);
        assert_eq!(
            echo_line(1, Some(&root), &record),
            format!("[rank 1] (root) forward: {record}")
        );
    }

    #[test]
    fn spans_nest_and_carry_their_module() {
        let rec = record();
        {
            let _s = span(What::Step(0));
            let _m = module("layers.0", Phase::Forward);
            {
                let _inner = module("layers.0.attn", Phase::Forward);
                let _op = span(What::Op("matmul"));
                memory(42);
            }
            let _c = collective(1, OpKind::AllReduce, 2, 100, false);
        }
        assert_eq!(current_module(), None);
        let events = rec.finish();
        let whats: Vec<&What> = events.iter().map(|e| &e.what).collect();
        assert!(matches!(whats[0], What::Step(0)), "{whats:?}");
        assert!(matches!(whats[1], What::Module { fqn, .. } if &**fqn == "layers.0"));
        assert!(matches!(whats[2], What::Module { fqn, .. } if &**fqn == "layers.0.attn"));
        let op = events.iter().find(|e| e.what == What::Op("matmul")).unwrap();
        assert_eq!(op.module.as_ref().map(|(m, _)| &**m), Some("layers.0.attn"));
        let c = events
            .iter()
            .find(|e| matches!(e.what, What::Collective { .. }))
            .unwrap();
        assert_eq!(c.module.as_ref().map(|(m, _)| &**m), Some("layers.0"));
        // Every event lies inside the step.
        let step = &events[0];
        for e in &events[1..] {
            assert!(e.start_ns >= step.start_ns && e.start_ns + e.dur_ns <= step.start_ns + step.dur_ns);
        }
    }
}
