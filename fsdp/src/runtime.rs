//! Per-rank FSDP state shared by all units of a thread: parameter ownership, the
//! order units ran in (for implicit prefetching), and reductions in flight.

use std::cell::RefCell;
use std::collections::{HashMap, HashSet, VecDeque};
use std::rc::{Rc, Weak};

use tessera_autograd::Result;
use tessera_autograd::nn::ModuleId;

use crate::unit::{Reduction, Unit};

#[derive(Default)]
struct Runtime {
    /// Parameter id → the unit owning it.
    owners: HashMap<u64, Weak<Unit>>,
    /// Modules made units.
    sharded: HashSet<ModuleId>,
    /// Units whose forward is running.
    depth: usize,
    /// This iteration's pre-forward order.
    pre_forward: Vec<Weak<Unit>>,
    /// The previous iteration's pre-forward order (implicit forward prefetch).
    last_pre_forward: Vec<Weak<Unit>>,
    /// This iteration's post-forward order (reversed: the backward order).
    post_forward: Vec<Weak<Unit>>,
    backward_started: bool,
    reductions: VecDeque<Reduction>,
}

thread_local! {
    static RT: RefCell<Runtime> = RefCell::new(Runtime::default());
}

fn with<R>(f: impl FnOnce(&mut Runtime) -> R) -> R {
    RT.with(|rt| f(&mut rt.borrow_mut()))
}

/// The live unit owning parameter `id`, if any.
pub(crate) fn owner(id: u64) -> Option<Rc<Unit>> {
    with(|rt| rt.owners.get(&id).and_then(Weak::upgrade))
}

/// Whether `module` was made a unit on this thread.
pub(crate) fn is_sharded(module: &ModuleId) -> bool {
    with(|rt| rt.sharded.contains(module))
}

pub(crate) fn set_sharded(module: ModuleId) {
    with(|rt| rt.sharded.insert(module));
}

pub(crate) fn set_owner(id: u64, unit: &Rc<Unit>) {
    with(|rt| rt.owners.insert(id, Rc::downgrade(unit)));
}

/// What [`enter_forward`] found.
pub(crate) enum Entry {
    /// A forward: the unit to prefetch implicitly (the one that followed this
    /// unit in the previous iteration), if any.
    Forward(Option<Rc<Unit>>),
    /// A recomputation during backward (activation checkpointing): not a new
    /// iteration, and no change to the recorded orders.
    Recompute,
}

/// Records `unit`'s pre-forward.
pub(crate) fn enter_forward(unit: &Rc<Unit>) -> Entry {
    if with(|rt| rt.backward_started) {
        with(|rt| rt.depth += 1);
        return Entry::Recompute;
    }
    let root = with(|rt| rt.depth == 0);
    if root {
        // A new iteration. Units whose gradients were expected from a forward
        // that was never backpropagated forget them.
        let stale: Vec<Rc<Unit>> = with(|rt| {
            rt.last_pre_forward = std::mem::take(&mut rt.pre_forward);
            rt.post_forward.clear();
            rt.backward_started = false;
            rt.last_pre_forward.iter().filter_map(Weak::upgrade).collect()
        });
        for u in stale {
            u.forget_expected();
        }
    }
    unit.is_root.set(root);
    with(|rt| {
        rt.depth += 1;
        rt.pre_forward.push(Rc::downgrade(unit));
        let pos = rt.pre_forward.len() - 1;
        let same_so_far = rt
            .last_pre_forward
            .get(pos)
            .is_some_and(|w| w.upgrade().is_some_and(|u| Rc::ptr_eq(&u, unit)));
        Entry::Forward(if same_so_far {
            rt.last_pre_forward.get(pos + 1).and_then(Weak::upgrade)
        } else {
            None
        })
    })
}

/// Records `unit`'s post-forward (a recomputation only leaves the depth).
pub(crate) fn leave_forward(unit: &Rc<Unit>, recompute: bool) {
    with(|rt| {
        rt.depth = rt.depth.saturating_sub(1);
        if !recompute {
            rt.post_forward.push(Rc::downgrade(unit));
        }
    });
}

/// Undoes [`enter_forward`]'s depth for a forward that failed.
pub(crate) fn abandon_forward() {
    with(|rt| rt.depth = rt.depth.saturating_sub(1));
}

/// Marks the backward as started; true the first time in an iteration.
pub(crate) fn start_backward() -> bool {
    with(|rt| !std::mem::replace(&mut rt.backward_started, true))
}

/// The unit whose backward comes after `unit`'s (the one before it in post-forward order).
pub(crate) fn next_in_backward(unit: &Unit) -> Option<Rc<Unit>> {
    with(|rt| {
        let pos = rt
            .post_forward
            .iter()
            .rposition(|w| std::ptr::eq(w.as_ptr(), unit as *const Unit))?;
        rt.post_forward[..pos]
            .iter()
            .rev()
            .filter_map(Weak::upgrade)
            .find(|u| !std::ptr::eq(Rc::as_ptr(u), unit as *const Unit) && !u.params.is_empty())
    })
}

/// Queues a reduction, then moves the earlier ones on: their reduce-scatters
/// (which overlapped this unit's backward) are waited for and their HSDP
/// all-reduces issued; all-reduces issued before are waited for.
pub(crate) fn push_reduction(r: Reduction) -> Result<()> {
    let earlier: Vec<Reduction> = with(|rt| {
        let v = rt.reductions.drain(..).collect();
        rt.reductions.push_back(r);
        v
    });
    let mut kept = Vec::new();
    for r in earlier {
        if let Some(r) = r.advance()? {
            kept.push(r);
        }
    }
    with(|rt| {
        for r in kept.into_iter().rev() {
            rt.reductions.push_front(r);
        }
    });
    Ok(())
}

/// Finishes every reduction in flight, in issue order.
pub(crate) fn drain() -> Result<()> {
    while let Some(r) = with(|rt| rt.reductions.pop_front()) {
        let mut next = r.advance()?;
        while let Some(r) = next {
            next = r.advance()?;
        }
    }
    Ok(())
}

/// The end of a backward (a callback the first pre-backward queues): units that
/// got only some gradients (a parameter unused in this forward) reduce now, every
/// unit unsharded for backward reshards, and all reductions finish, so the
/// optimizer sees every gradient.
pub(crate) fn finish_backward() -> Result<()> {
    let units: Vec<Rc<Unit>> = with(|rt| {
        let mut seen = Vec::new();
        for u in rt.post_forward.iter().rev().filter_map(Weak::upgrade) {
            if !seen.iter().any(|s: &Rc<Unit>| Rc::ptr_eq(s, &u)) {
                seen.push(u);
            }
        }
        seen
    });
    let mut first: Result<()> = Ok(());
    for u in &units {
        let r = if u.has_arrivals() {
            u.post_backward()
        } else {
            u.forget_expected();
            u.reshard()
        };
        if first.is_ok() {
            first = r;
        }
    }
    let drained = drain();
    with(|rt| {
        rt.backward_started = false;
        rt.post_forward.clear();
    });
    first.and(drained)
}
