//! The tape: one per rank (a thread-local), recording each differentiable op in
//! execution order with its backward closure, so the reverse walk needs no sort.
//!
//! The tape is a stack of frames; [`checkpoint`](crate::checkpoint) pushes a frame
//! to recompute a region in backward. Each frame also registers the parameters
//! used in it, so the walk knows where leaf gradients go.

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};

use smallvec::SmallVec;
use tessera_dtensor::DTensor;

use crate::{Error, Param, Result};

/// A backward rule: from the gradient of the output, the gradients of the inputs
/// (`None` for an input that needs none).
pub(crate) type BackwardFn = Box<dyn FnOnce(&DTensor) -> Result<SmallVec<[Option<DTensor>; 3]>>>;

/// One recorded op.
pub(crate) struct Node {
    pub(crate) name: &'static str,
    pub(crate) output: u64,
    /// Ids of the inputs, with whether each needs a gradient.
    pub(crate) inputs: SmallVec<[(u64, bool); 3]>,
    pub(crate) backward: BackwardFn,
    /// The module that recorded it, for a recording rank
    /// ([`observe`](tessera_mesh::observe)): its backward is attributed there.
    pub(crate) module: Option<std::sync::Arc<str>>,
}

#[derive(Default)]
pub(crate) struct Frame {
    pub(crate) nodes: Vec<Node>,
    pub(crate) params: HashMap<u64, Param>,
    /// Values whose producing ops an earlier backward consumed (cleared once the
    /// frame is empty again).
    pub(crate) consumed: HashSet<u64>,
}

/// Work to run once the current backward has walked the whole tape.
type Callback = Box<dyn FnOnce() -> Result<()>>;

thread_local! {
    static CALLBACKS: RefCell<Vec<Callback>> = const { RefCell::new(Vec::new()) };
    static TAPE: RefCell<Vec<Frame>> = RefCell::new(vec![Frame::default()]);
    static GRAD_ENABLED: Cell<bool> = const { Cell::new(true) };
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// A fresh id for a value.
pub(crate) fn next_id() -> u64 {
    NEXT_ID.fetch_add(1, Ordering::Relaxed)
}

/// Whether ops record onto the tape now.
pub fn is_grad_enabled() -> bool {
    GRAD_ENABLED.with(|g| g.get())
}

/// Runs `f` without recording: its results do not require gradients.
///
/// PyTorch: `torch.no_grad()`.
pub fn no_grad<R>(f: impl FnOnce() -> R) -> R {
    with_grad_mode(false, f)
}

pub(crate) fn set_grad_enabled(on: bool) {
    GRAD_ENABLED.with(|g| g.set(on));
}

pub(crate) fn with_grad_mode<R>(enabled: bool, f: impl FnOnce() -> R) -> R {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            GRAD_ENABLED.with(|g| g.set(self.0));
        }
    }
    let _restore = Restore(GRAD_ENABLED.with(|g| g.replace(enabled)));
    f()
}

pub(crate) fn record(node: Node) {
    TAPE.with(|t| {
        if let Some(frame) = t.borrow_mut().last_mut() {
            frame.nodes.push(node);
        }
    });
}

pub(crate) fn register_param(p: &Param) {
    TAPE.with(|t| {
        if let Some(frame) = t.borrow_mut().last_mut() {
            frame.params.entry(p.id()).or_insert_with(|| p.clone());
        }
    });
}

/// Takes the current frame's records, leaving it empty.
pub(crate) fn take_frame() -> Frame {
    TAPE.with(|t| t.borrow_mut().last_mut().map(std::mem::take).unwrap_or_default())
}

/// Takes from the current frame the ops that `output` depends on (in recording
/// order), leaving the others for later backwards, together with the frame's
/// parameters.
///
/// # Errors
/// `output` was already backpropagated, its ops are not on the tape, or part of its
/// graph was consumed by an earlier backward.
pub(crate) fn take_reachable(output: u64) -> Result<Frame> {
    TAPE.with(|t| {
        let mut t = t.borrow_mut();
        let frame = t.last_mut().ok_or_else(|| Error::Backward("no tape".into()))?;
        if frame.consumed.contains(&output) {
            return Err(Error::Backward(
                "this loss was already backpropagated (its ops are consumed); compute it again".into(),
            ));
        }
        let mut needed: HashSet<u64> = HashSet::from([output]);
        let mut reachable = Vec::new();
        let mut kept = Vec::new();
        for node in std::mem::take(&mut frame.nodes).into_iter().rev() {
            if needed.contains(&node.output) {
                needed.extend(node.inputs.iter().filter(|(_, needs)| *needs).map(|(id, _)| *id));
                reachable.push(node);
            } else {
                kept.push(node);
            }
        }
        reachable.reverse();
        kept.reverse();
        frame.nodes = kept;
        if reachable.is_empty() && !frame.params.contains_key(&output) {
            return Err(Error::Backward(
                "the ops that produced the loss are not on the tape (consumed by an earlier backward or cleared)"
                    .into(),
            ));
        }
        if let Some(id) = needed.iter().find(|id| frame.consumed.contains(id)) {
            return Err(Error::Backward(format!(
                "part of this loss's graph (value #{id}) was consumed by an earlier backward; \
                 recompute the shared part for each loss"
            )));
        }
        frame.consumed.extend(reachable.iter().map(|n| n.output));
        if frame.nodes.is_empty() {
            frame.consumed.clear();
        }
        Ok(Frame {
            nodes: reachable,
            params: frame.params.clone(),
            consumed: HashSet::new(),
        })
    })
}

/// Runs `f` in a fresh frame and returns its result with the frame's records.
pub(crate) fn in_frame<R>(f: impl FnOnce() -> R) -> (R, Frame) {
    TAPE.with(|t| t.borrow_mut().push(Frame::default()));
    struct Pop;
    impl Drop for Pop {
        fn drop(&mut self) {
            TAPE.with(|t| {
                let mut t = t.borrow_mut();
                if t.len() > 1 {
                    t.pop();
                }
            });
        }
    }
    let pop = Pop;
    let r = f();
    let frame = take_frame();
    drop(pop);
    (r, frame)
}

/// Queues `f` to run when the backward in progress has walked the whole tape
/// (in queueing order). For backward rules that defer work to the end, as a
/// parallelism layer does to finish its gradient reductions. Outside a backward it runs at the end of the next one.
///
/// PyTorch: `Variable._execution_engine.queue_callback`.
pub fn queue_callback(f: impl FnOnce() -> Result<()> + 'static) {
    CALLBACKS.with(|c| c.borrow_mut().push(Box::new(f)));
}

/// Runs (and clears) the queued callbacks; the first error is returned after all ran.
pub(crate) fn run_callbacks() -> Result<()> {
    let mut first = Ok(());
    loop {
        let batch: Vec<Callback> = CALLBACKS.with(|c| std::mem::take(&mut *c.borrow_mut()));
        if batch.is_empty() {
            return first;
        }
        for f in batch {
            let r = f();
            if first.is_ok() {
                first = r;
            }
        }
    }
}

/// Number of ops recorded in the current frame (for tests and memory accounting).
pub fn recorded_ops() -> usize {
    TAPE.with(|t| t.borrow().last().map_or(0, |f| f.nodes.len()))
}

/// Drops everything recorded in the current frame (e.g. after a forward pass whose
/// result will not be differentiated).
pub fn clear_tape() {
    drop(take_frame());
}
