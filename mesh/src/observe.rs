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
use std::collections::{BTreeMap, HashMap};
use std::fmt::{self, Write as _};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use crate::stats::OpKind;

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
    /// Bytes of tensor storage in use at the event's start (an instant).
    Memory(u64),
    /// One entry of the op log (an instant at the op's end; recorded only
    /// by a [`record_ops`] recording).
    OpLog(Box<OpRecord>),
}

/// A tensor as the op log and error messages print it:
/// `f32[8,32,64] (Shard(0), Replicate)`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorDesc {
    /// Global shape.
    pub shape: Vec<usize>,
    /// Element type.
    pub dtype: crate::DType,
    /// Placements, one per mesh dim: `(Shard(0), Replicate)`.
    pub placements: String,
}

impl fmt::Display for TensorDesc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let dims: Vec<String> = self.shape.iter().map(usize::to_string).collect();
        write!(f, "{}[{}] {}", self.dtype, dims.join(","), self.placements)
    }
}

/// One DTensor op of the op log (PyTorch: an entry of `DebugMode`'s log).
#[derive(Clone, Debug, PartialEq)]
pub struct OpRecord {
    /// The op (`"matmul"`, `"add"`), or `"redistribute"` for an explicit one.
    pub op: &'static str,
    /// The mesh (`mesh(dp=2, tp=2)`).
    pub mesh: String,
    /// Its inputs as given.
    pub inputs: Vec<TensorDesc>,
    /// Inputs the op redistributed first, implicitly (by index), with the
    /// placements they were moved to; an explicit redistribute lists its one
    /// input here with its target.
    pub moved: Vec<(usize, String)>,
    /// The output.
    pub output: TensorDesc,
    /// Whether this is a redistribute the program asked for.
    pub explicit: bool,
    /// Global sum, sum of absolute values and sum of squares of the output
    /// (`f64`), when values are logged.
    pub values: Option<[f64; 3]>,
}

impl fmt::Display for OpRecord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let inputs: Vec<String> = self.inputs.iter().map(ToString::to_string).collect();
        write!(
            f,
            "{}({}) -> {} on {}",
            self.op,
            inputs.join(", "),
            self.output,
            self.mesh
        )?;
        for (i, to) in &self.moved {
            let how = if self.explicit { "explicit" } else { "implicit" };
            write!(f, "; {how} redistribute of input {i} to {to}")?;
        }
        if let Some([sum, abs, sq]) = self.values {
            write!(f, "; sum {sum:.6e} |x| {abs:.6e} x² {sq:.6e}")?;
        }
        Ok(())
    }
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

/// Records an instant sample of the tensor bytes in use.
pub fn memory(bytes: u64) {
    if RECORDING.load(Ordering::Relaxed) == 0 {
        return;
    }
    RECORDER.with(|r| {
        if let Some(rec) = r.borrow_mut().as_mut() {
            let module = innermost(rec);
            rec.events.push(Event {
                what: What::Memory(bytes),
                start_ns: now_ns(),
                dur_ns: 0,
                module,
            });
        }
    });
}

/// Whether a recording keeps an op log (see [`record_ops`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OpLog {
    /// No op log.
    #[default]
    Off,
    /// Every DTensor op and explicit redistribute, with its layouts.
    Ops,
    /// As `Ops`, each with its output's global sums (gathered: slow, and the
    /// gathers count in the rank's collective counters, unrecorded).
    Values,
}

/// Starts recording the calling thread's events with an op log: each DTensor
/// op the rank runs adds a [`What::OpLog`] entry. PyTorch: `DebugMode`
/// (`record_tensor_attributes`, its tensor hashes).
pub fn record_ops(log: OpLog) -> Recording {
    let rec = record();
    RECORDER.with(|r| {
        if let Some(r) = r.borrow_mut().as_mut() {
            r.op_log = log;
        }
    });
    rec
}

/// Whether DTensor ops should log themselves now (this thread records with
/// an op log), and whether with values.
pub fn logging_ops() -> Option<bool> {
    if RECORDING.load(Ordering::Relaxed) == 0 {
        return None;
    }
    RECORDER.with(|r| match r.borrow().as_ref().map(|r| r.op_log) {
        Some(OpLog::Ops) => Some(false),
        Some(OpLog::Values) => Some(true),
        _ => None,
    })
}

/// Adds an op-log entry (see [`record_ops`]).
pub fn op_log(record: OpRecord) {
    RECORDER.with(|r| {
        if let Some(rec) = r.borrow_mut().as_mut() {
            let module = innermost(rec);
            rec.events.push(Event {
                what: What::OpLog(Box::new(record)),
                start_ns: now_ns(),
                dur_ns: 0,
                module,
            });
        }
    });
}

/// Runs `f` unrecorded (its ops and collectives leave no events): the op
/// log's own gathers of values.
pub fn unrecorded<R>(f: impl FnOnce() -> R) -> R {
    let saved = RECORDER.with(|r| r.borrow_mut().take());
    struct Restore(Option<Recorder>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let saved = self.0.take();
            RECORDER.with(|r| *r.borrow_mut() = saved);
        }
    }
    let _restore = Restore(saved);
    f()
}

/// The op log among `events`: `(module, entry)` in order.
pub fn op_log_entries(events: &[Event]) -> Vec<(Option<Arc<str>>, &OpRecord)> {
    events
        .iter()
        .filter_map(|e| match &e.what {
            What::OpLog(r) => Some((e.module.as_ref().map(|(m, _)| m.clone()), &**r)),
            _ => None,
        })
        .collect()
}

/// The op log as JSON: `{"ops": [{"module", "op", "explicit", "inputs":
/// [{"shape", "dtype", "placements"}], "moved": [{"input", "to"}], "output",
/// "values": [sum, abs, sq] or null}]}`.
pub fn op_log_json(events: &[Event]) -> String {
    let desc = |t: &TensorDesc| {
        let dims: Vec<String> = t.shape.iter().map(usize::to_string).collect();
        format!(
            "{{\"shape\": [{}], \"dtype\": \"{}\", \"placements\": {}}}",
            dims.join(", "),
            t.dtype,
            json_string(&t.placements)
        )
    };
    let num = |x: f64| if x.is_finite() { format!("{x:e}") } else { "null".into() };
    let mut out = String::from("{\"ops\": [\n");
    for (i, (module, r)) in op_log_entries(events).into_iter().enumerate() {
        if i > 0 {
            out.push_str(",\n");
        }
        let inputs: Vec<String> = r.inputs.iter().map(desc).collect();
        let moved: Vec<String> = r
            .moved
            .iter()
            .map(|(i, to)| format!("{{\"input\": {i}, \"to\": {}}}", json_string(to)))
            .collect();
        let values = r.values.map_or("null".to_string(), |v| {
            format!("[{}, {}, {}]", num(v[0]), num(v[1]), num(v[2]))
        });
        let _ = write!(
            out,
            "{{\"module\": {}, \"op\": \"{}\", \"mesh\": {}, \"explicit\": {}, \"inputs\": [{}], \"moved\": [{}], \"output\": {}, \"values\": {values}}}",
            module.map_or("null".to_string(), |m| json_string(&m)),
            r.op,
            json_string(&r.mesh),
            r.explicit,
            inputs.join(", "),
            moved.join(", "),
            desc(&r.output)
        );
    }
    out.push_str("\n]}\n");
    out
}

/// Names the communicator at address `comm` (the data address of the
/// `dyn Communicator`) on this thread: the mesh dims it runs over.
/// `DeviceMesh` names its communicators when it is built.
pub fn name_group(comm: usize, name: &str) {
    GROUPS.with(|g| g.borrow_mut().insert(comm, Arc::from(name)));
}

/// The span of a collective that the communicator at `comm` issues (see
/// [`What::Collective`]); backends call it where they count the collective.
pub fn collective(comm: usize, kind: OpKind, ranks: usize, bytes: u64, queued: bool) -> Span {
    if RECORDING.load(Ordering::Relaxed) == 0 || matches!(kind, OpKind::Split) {
        return Span::none();
    }
    let group = GROUPS.with(|g| g.borrow().get(&comm).cloned());
    let group = group.unwrap_or_else(|| Arc::from(format!("comm({ranks})")));
    span(What::Collective {
        kind,
        group,
        ranks,
        bytes,
        queued,
    })
}

// ---- the collective report ----------------------------------------------------------------

/// Collectives by module, phase, mesh dims and kind: calls and bytes sent by
/// this rank. PyTorch: `CommDebugMode.get_comm_counts` per module
/// (`generate_comm_debug_tracing_table`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CommReport {
    /// `(module, phase, mesh dims, kind) -> (calls, bytes)`; collectives
    /// issued outside any module have module `"(none)"` and phase forward.
    pub rows: BTreeMap<(String, Phase, String, OpKind), (u64, u64)>,
}

impl CommReport {
    /// The collectives among `events` (barriers left out).
    pub fn from_events(events: &[Event]) -> CommReport {
        let mut rows: BTreeMap<(String, Phase, String, OpKind), (u64, u64)> = BTreeMap::new();
        for e in events {
            if let What::Collective { kind, group, bytes, .. } = &e.what {
                if *kind == OpKind::Barrier {
                    continue;
                }
                let (module, phase) = match &e.module {
                    Some((m, p)) => (if m.is_empty() { "(root)".into() } else { m.to_string() }, *p),
                    None => ("(none)".to_string(), Phase::Forward),
                };
                let row = rows.entry((module, phase, group.to_string(), *kind)).or_default();
                row.0 += 1;
                row.1 += bytes;
            }
        }
        CommReport { rows }
    }

    /// Calls and bytes of `kind` over every row.
    pub fn total(&self, kind: OpKind) -> (u64, u64) {
        self.rows
            .iter()
            .filter(|((_, _, _, k), _)| *k == kind)
            .fold((0, 0), |(c, b), (_, &(rc, rb))| (c + rc, b + rb))
    }

    /// The report as JSON: `{"rows": [{"module", "phase", "mesh_dims",
    /// "collective", "calls", "bytes"}, ...]}`.
    pub fn to_json(&self) -> String {
        let mut out = String::from("{\"rows\": [");
        for (i, ((module, phase, group, kind), (calls, bytes))) in self.rows.iter().enumerate() {
            if i > 0 {
                out.push_str(", ");
            }
            let _ = write!(
                out,
                "{{\"module\": {}, \"phase\": \"{}\", \"mesh_dims\": {}, \"collective\": \"{}\", \"calls\": {calls}, \"bytes\": {bytes}}}",
                json_string(module),
                phase.name(),
                json_string(group),
                kind.name()
            );
        }
        out.push_str("]}");
        out
    }
}

impl fmt::Display for CommReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let width = self.rows.keys().map(|(m, ..)| m.len()).max().unwrap_or(6).max(6);
        writeln!(
            f,
            "{:<width$}  {:<8}  {:<10}  {:<14}  {:>6}  {:>12}",
            "module", "phase", "mesh dims", "collective", "calls", "bytes"
        )?;
        for ((module, phase, group, kind), (calls, bytes)) in &self.rows {
            writeln!(
                f,
                "{module:<width$}  {:<8}  {group:<10}  {:<14}  {calls:>6}  {bytes:>12}",
                phase.name(),
                kind.name()
            )?;
        }
        Ok(())
    }
}

/// `s` as a JSON string literal.
pub fn json_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

// ---- the timeline trace --------------------------------------------------------------------

/// The events of each rank (`(rank, events)`) as Chrome trace-event JSON
/// (opens in Perfetto or `chrome://tracing`): one track per rank, spans as
/// complete events (`"ph": "X"`, microseconds) nesting by time, categories
/// `step`, `module`, `op`, `collective`, `fsdp`; tensor memory as a counter
/// track per rank.
pub fn chrome_trace(ranks: &[(usize, Vec<Event>)]) -> String {
    let mut out = String::from("{\"displayTimeUnit\": \"ms\", \"traceEvents\": [\n");
    let mut first = true;
    let mut push = |s: String| {
        if !first {
            out.push_str(",\n");
        }
        first = false;
        out.push_str(&s);
    };
    for (rank, events) in ranks {
        push(format!(
            "{{\"ph\": \"M\", \"name\": \"thread_name\", \"pid\": 0, \"tid\": {rank}, \"args\": {{\"name\": \"rank {rank}\"}}}}"
        ));
        for e in events {
            let ts = e.start_ns as f64 / 1e3;
            let dur = e.dur_ns as f64 / 1e3;
            let (name, cat, args) = match &e.what {
                What::Step(s) => (format!("step {s}"), "step", String::new()),
                What::Module { fqn, phase } => (
                    format!("{} ({})", if fqn.is_empty() { "(root)" } else { fqn }, phase.name()),
                    "module",
                    String::new(),
                ),
                What::Op(op) => (op.to_string(), "op", String::new()),
                What::Collective {
                    kind,
                    group,
                    ranks,
                    bytes,
                    queued,
                } => (
                    format!("{} {}", kind.name(), group),
                    "collective",
                    format!(
                        "\"mesh_dims\": {}, \"ranks\": {ranks}, \"bytes\": {bytes}, \"queued\": {queued}",
                        json_string(group)
                    ),
                ),
                What::Region(r) => (r.to_string(), "fsdp", String::new()),
                What::OpLog(_) => continue,
                What::Memory(bytes) => {
                    push(format!(
                        "{{\"ph\": \"C\", \"name\": \"memory rank {rank}\", \"pid\": 0, \"tid\": {rank}, \"ts\": {ts:.3}, \"args\": {{\"bytes\": {bytes}}}}}"
                    ));
                    continue;
                }
            };
            let module = match &e.module {
                Some((m, p)) => format!("\"module\": {}, \"phase\": \"{}\"", json_string(m), p.name()),
                None => String::new(),
            };
            let args = [args, module]
                .into_iter()
                .filter(|s| !s.is_empty())
                .collect::<Vec<_>>()
                .join(", ");
            push(format!(
                "{{\"ph\": \"X\", \"name\": {}, \"cat\": \"{cat}\", \"pid\": 0, \"tid\": {rank}, \"ts\": {ts:.3}, \"dur\": {dur:.3}, \"args\": {{{args}}}}}",
                json_string(&name)
            ));
        }
    }
    out.push_str("\n]}\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn nothing_is_recorded_off_and_groups_take_their_names() {
        {
            let _op = span(What::Op("add"));
            let _m = module("x", Phase::Forward);
        }
        assert_eq!(current_module(), None);
        name_group(7, "tp");
        let rec = record();
        {
            let _m = module("layers.1.ffn", Phase::Backward);
            drop(collective(7, OpKind::AllReduce, 4, 300, false));
            drop(collective(8, OpKind::AllGather, 2, 50, true));
            drop(collective(7, OpKind::Barrier, 4, 0, false));
        }
        let report = CommReport::from_events(&rec.finish());
        assert_eq!(
            report
                .rows
                .get(&("layers.1.ffn".into(), Phase::Backward, "tp".into(), OpKind::AllReduce)),
            Some(&(1, 300))
        );
        assert_eq!(
            report.rows.get(&(
                "layers.1.ffn".into(),
                Phase::Backward,
                "comm(2)".into(),
                OpKind::AllGather
            )),
            Some(&(1, 50))
        );
        assert_eq!(report.rows.len(), 2, "barriers are left out: {report}");
        assert_eq!(report.total(OpKind::AllReduce), (1, 300));
        let json = report.to_json();
        assert!(
            json.contains("\"module\": \"layers.1.ffn\", \"phase\": \"backward\", \"mesh_dims\": \"tp\""),
            "{json}"
        );
        assert!(report.to_string().contains("all_reduce"));
    }

    #[test]
    fn the_trace_names_ranks_and_escapes_strings() {
        let events = vec![
            Event {
                what: What::Module {
                    fqn: Arc::from("a\"b"),
                    phase: Phase::Forward,
                },
                start_ns: 1000,
                dur_ns: 5000,
                module: None,
            },
            Event {
                what: What::Memory(64),
                start_ns: 2000,
                dur_ns: 0,
                module: None,
            },
        ];
        let json = chrome_trace(&[(3, events)]);
        assert!(json.contains("\"name\": \"rank 3\""), "{json}");
        assert!(json.contains("\"name\": \"a\\\"b (forward)\""), "{json}");
        assert!(json.contains("\"ts\": 1.000, \"dur\": 5.000"), "{json}");
        assert!(json.contains("\"ph\": \"C\", \"name\": \"memory rank 3\""), "{json}");
    }
}
