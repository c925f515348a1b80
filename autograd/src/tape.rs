//! The tape: one per rank (a thread-local), recording each differentiable op in
//! execution order with its backward closure, so the reverse walk needs no sort.
//!
//! The tape is a stack of frames; [`checkpoint`](crate::checkpoint) pushes a frame
//! to recompute a region in backward. Each frame also registers the parameters
//! used in it, so the walk knows where leaf gradients go.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

use smallvec::SmallVec;
use tessera_dtensor::DTensor;

use crate::{Param, Result};

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
}

#[derive(Default)]
pub(crate) struct Frame {
    pub(crate) nodes: Vec<Node>,
    pub(crate) params: HashMap<u64, Param>,
}

thread_local! {
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

/// Number of ops recorded in the current frame (for tests and memory accounting).
pub fn recorded_ops() -> usize {
    TAPE.with(|t| t.borrow().last().map_or(0, |f| f.nodes.len()))
}

/// Drops everything recorded in the current frame (e.g. after a forward pass whose
/// result will not be differentiated).
pub fn clear_tape() {
    drop(take_frame());
}
