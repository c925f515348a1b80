//! The op log (PyTorch: `DebugMode`): each DTensor op of a recording rank,
//! with its inputs, output and redistributions, as [`What::OpLog`] events.

use std::fmt::{self, Write as _};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::{Event, RECORDER, RECORDING, Recorder, Recording, What, instant, json_string, record};
use crate::DType;

/// A tensor as the op log and error messages print it:
/// `f32[8,32,64] (Shard(0), Replicate)`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorDesc {
    /// Global shape.
    pub shape: Vec<usize>,
    /// Element type.
    pub dtype: DType,
    /// Placements, one per mesh dim: `(Shard(0), Replicate)`.
    pub placements: String,
}

impl fmt::Display for TensorDesc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", ShapeDisplay(self.dtype, &self.shape), self.placements)
    }
}

/// `f32[2048,256]`: a dtype and a global shape, as tensors are described.
pub struct ShapeDisplay<'a>(pub DType, pub &'a [usize]);

impl fmt::Display for ShapeDisplay<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let dims: Vec<String> = self.1.iter().map(usize::to_string).collect();
        write!(f, "{}[{}]", self.0, dims.join(","))
    }
}

/// An input an op redistributed: its index, the placements it was moved to,
/// and the plan's steps.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Moved {
    /// The input's index among the op's inputs.
    pub input: usize,
    /// The placements it was moved to: `(Replicate, Shard(1))`.
    pub to: String,
    /// The plan's steps, in order.
    pub plan: Vec<PlanStep>,
}

/// One step of a redistribute plan as the op log shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanStep {
    /// What the step does: a collective (`all_gather`, `reduce_scatter`,
    /// `all_reduce`, `all_to_all`) or a local step (`slice`, `partition`).
    pub kind: String,
    /// The mesh dims it works along, by name where the mesh names them
    /// (`tp`, `dp×tp`).
    pub mesh_dims: String,
    /// Bytes this rank sends in it (0 for a local step).
    pub bytes: u64,
}

impl fmt::Display for PlanStep {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} over {}", self.kind, self.mesh_dims)?;
        if self.bytes > 0 {
            write!(f, " ({} B)", self.bytes)?;
        }
        Ok(())
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
    /// Inputs the op redistributed first, implicitly, with the placements
    /// they were moved to and the plan that moved them; an explicit
    /// redistribute lists its one input here.
    pub moved: Vec<Moved>,
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
        for m in &self.moved {
            let how = if self.explicit { "explicit" } else { "implicit" };
            write!(f, "; {how} redistribute of input {} to {}", m.input, m.to)?;
            let steps: Vec<String> = m.plan.iter().map(ToString::to_string).collect();
            if !steps.is_empty() {
                write!(f, " by {}", steps.join(", then "))?;
            }
        }
        if let Some([sum, abs, sq]) = self.values {
            write!(f, "; sum {sum:.6e} |x| {abs:.6e} x² {sq:.6e}")?;
        }
        Ok(())
    }
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
    instant(What::OpLog(Box::new(record)));
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
/// [{"shape", "dtype", "placements"}], "moved": [{"input", "to", "plan":
/// [{"kind", "mesh_dims", "bytes"}]}], "output",
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
            .map(|m| {
                let plan: Vec<String> = m
                    .plan
                    .iter()
                    .map(|s| {
                        format!(
                            "{{\"kind\": \"{}\", \"mesh_dims\": {}, \"bytes\": {}}}",
                            s.kind,
                            json_string(&s.mesh_dims),
                            s.bytes
                        )
                    })
                    .collect();
                format!(
                    "{{\"input\": {}, \"to\": {}, \"plan\": [{}]}}",
                    m.input,
                    json_string(&m.to),
                    plan.join(", ")
                )
            })
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
