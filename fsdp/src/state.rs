//! The hooks of a unit and the state its units share on a rank: who owns which
//! parameter, the order units ran in (for implicit prefetching), and the
//! reductions in flight. The hooks decide when; the [`ParamGroup`] does.
//!
//! PyTorch: `_fsdp_state.py` (`FSDPState`, and the root's `FSDPStateContext`).

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, HashSet, VecDeque};
use std::rc::{Rc, Weak};

use smallvec::smallvec;
use tessera_autograd::nn::{Inputs, ModuleHooks, ModuleId};
use tessera_autograd::{Var, queue_callback};

use crate::error::Result;
use crate::group::{GradHook, ParamGroup, Reduction};

/// One unit: its parameter group and what runs around its forward and backward.
pub(crate) struct Unit {
    /// For messages: the unit's module (its type and a parameter it holds).
    pub(crate) label: String,
    pub(crate) group: ParamGroup,
    pub(crate) children: Vec<Weak<Unit>>,
    pub(crate) reshard_after_forward: Cell<Option<bool>>,
    pub(crate) reshard_after_backward: Cell<bool>,
    pub(crate) grad_sync: Cell<bool>,
    pub(crate) all_reduce: Cell<bool>,
    pub(crate) is_root: Cell<bool>,
    /// The current forward is a recomputation during backward (checkpointing).
    recomputing: Cell<bool>,
    /// Modules this unit was made from (their forwards together are the unit's).
    modules: usize,
    /// Pre- and post-forwards of those modules since the unit's forward began.
    entered: Cell<usize>,
    exited: Cell<usize>,
    pub(crate) forward_prefetch: RefCell<Option<Vec<Weak<Unit>>>>,
    pub(crate) backward_prefetch: RefCell<Option<Vec<Weak<Unit>>>>,
    me: Weak<Unit>,
}

impl Unit {
    pub(crate) fn new(
        label: String,
        group: ParamGroup,
        children: Vec<Weak<Unit>>,
        reshard_after_forward: Option<bool>,
        modules: usize,
    ) -> Rc<Unit> {
        Rc::new_cyclic(|me| Unit {
            label,
            group,
            children,
            reshard_after_forward: Cell::new(reshard_after_forward),
            reshard_after_backward: Cell::new(true),
            grad_sync: Cell::new(true),
            all_reduce: Cell::new(true),
            is_root: Cell::new(false),
            recomputing: Cell::new(false),
            modules,
            entered: Cell::new(0),
            exited: Cell::new(0),
            forward_prefetch: RefCell::new(None),
            backward_prefetch: RefCell::new(None),
            me: me.clone(),
        })
    }

    fn rc(&self) -> Rc<Unit> {
        self.me.upgrade().expect("a unit is alive while its methods run")
    }

    fn resolved_reshard_after_forward(&self) -> bool {
        self.reshard_after_forward.get().unwrap_or(!self.is_root.get())
    }

    // ----- forward ----------------------------------------------------------

    /// The forward of a unit made from several modules begins with the first
    /// of them and ends with the last (every one runs once per forward, in any
    /// order or nested); the others only cast their inputs.
    fn pre_forward_impl(&self, inputs: Inputs) -> Result<Inputs> {
        let entered = self.entered.get();
        self.entered.set(entered + 1);
        if entered > 0 {
            return self.cast_inputs(inputs);
        }
        let me = self.rc();
        let next = match enter_forward(&me) {
            Entry::Forward(next) => next,
            Entry::Recompute => {
                self.recomputing.set(true);
                None
            }
        };
        let r = self.prepare_forward(next, inputs);
        if r.is_err() {
            self.forward_failed();
        }
        r
    }

    /// Pre-forward after the context recorded it: gather, prefetch, bind the
    /// unsharded parameters, input cast.
    fn prepare_forward(&self, next: Option<Rc<Unit>>, inputs: Inputs) -> Result<Inputs> {
        self.group.unshard()?;
        let targets = match &*self.forward_prefetch.borrow() {
            Some(list) => list.iter().filter_map(Weak::upgrade).collect(),
            None => next.into_iter().collect::<Vec<_>>(),
        };
        for t in targets {
            t.group.prefetch()?;
        }
        let me = self.me.clone();
        self.group.bind_unsharded(self.recomputing.get(), |i| -> GradHook {
            let me = me.clone();
            Box::new(move |g| match me.upgrade() {
                Some(u) => u.on_grad(i, g),
                None => Ok(()),
            })
        })?;
        self.cast_inputs(inputs)
    }

    /// Every floating-point input, positional or named, cast to the parameter
    /// dtype of mixed precision (when it casts inputs); others left alone.
    fn cast_inputs(&self, inputs: Inputs) -> Result<Inputs> {
        let mp = self.group.mp;
        match mp.param_dtype {
            Some(dt) if mp.cast_forward_inputs => Ok(inputs.map(|_, x| {
                if x.value().dtype().is_float() {
                    x.cast(dt)
                } else {
                    Ok(x)
                }
            })?),
            _ => Ok(inputs),
        }
    }

    fn post_forward_impl(&self, out: Var) -> Result<Var> {
        let exited = self.exited.get() + 1;
        self.exited.set(exited);
        if exited == self.entered.get() && exited >= self.modules {
            self.entered.set(0);
            self.exited.set(0);
            self.group.unbind();
            let recompute = self.recomputing.replace(false);
            leave_forward(&self.rc(), recompute);
            // A recomputation's backward follows at once: keep the parameters.
            if !recompute && self.resolved_reshard_after_forward() {
                self.group.reshard_after_forward()?;
            }
        }
        let out = if out.requires_grad() {
            let me = self.me.clone();
            Var::from_op("fsdp_pre_backward", out.value().clone(), &[&out], move |g| {
                if let Some(u) = me.upgrade() {
                    u.pre_backward()?;
                }
                Ok(smallvec![Some(g.clone())])
            })
        } else {
            out
        };
        match self.group.mp.output_dtype {
            Some(dt) if out.value().dtype().is_float() => Ok(out.cast(dt)?),
            _ => Ok(out),
        }
    }

    // ----- backward ---------------------------------------------------------

    fn pre_backward(&self) -> Result<()> {
        if start_backward() {
            queue_callback(|| Ok(finish_backward()?));
        }
        self.group.check_unchanged()?;
        self.group.unshard()?;
        let targets = match &*self.backward_prefetch.borrow() {
            Some(list) => list.iter().filter_map(Weak::upgrade).collect(),
            None => next_in_backward(self).into_iter().collect::<Vec<_>>(),
        };
        for t in targets {
            t.group.prefetch()?;
        }
        Ok(())
    }

    fn on_grad(&self, i: usize, g: &tessera_dtensor::DTensor) -> Result<()> {
        if self.group.add_grad(i, g, self.grad_sync.get())? {
            self.post_backward()
        } else {
            Ok(())
        }
    }

    /// After the unit's backward: issue the reduction (unless sync is off) and
    /// reshard (unless resharding after backward is off).
    fn post_backward(&self) -> Result<()> {
        let _observed = tessera_mesh::observe::span(tessera_mesh::observe::What::Region("fsdp.reduce_grads"));
        let r = match self.group.finish_grads(self.grad_sync.get(), self.all_reduce.get()) {
            Ok(Some(reduction)) => push_reduction(reduction),
            Ok(None) => Ok(()),
            Err(e) => Err(e),
        };
        self.reshard_after_backward()?;
        r
    }

    fn reshard_after_backward(&self) -> Result<()> {
        if self.reshard_after_backward.get() {
            self.group.reshard()
        } else {
            Ok(())
        }
    }
}

impl ModuleHooks for Unit {
    fn pre_forward(&self, inputs: Inputs) -> tessera_autograd::Result<Inputs> {
        Ok(self.pre_forward_impl(inputs)?)
    }

    fn post_forward(&self, output: Var) -> tessera_autograd::Result<Var> {
        Ok(self.post_forward_impl(output)?)
    }

    fn forward_failed(&self) {
        self.group.unbind();
        self.recomputing.set(false);
        self.exited.set(0);
        // Once per failed forward, however many of the unit's modules unwind.
        if self.entered.replace(0) > 0 {
            abandon_forward();
        }
    }
}

// ----- the state shared by a rank's units ------------------------------------

#[derive(Default)]
struct Context {
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
    static CONTEXT: RefCell<Context> = RefCell::new(Context::default());
}

fn with<R>(f: impl FnOnce(&mut Context) -> R) -> R {
    CONTEXT.with(|c| f(&mut c.borrow_mut()))
}

/// The live unit owning parameter `id`, if any.
pub(crate) fn owner(id: u64) -> Option<Rc<Unit>> {
    with(|c| c.owners.get(&id).and_then(Weak::upgrade))
}

/// Whether `module` was made a unit on this thread.
pub(crate) fn is_sharded(module: &ModuleId) -> bool {
    with(|c| c.sharded.contains(module))
}

/// Records a new unit made from `modules`.
pub(crate) fn register(unit: &Rc<Unit>, modules: &[ModuleId]) {
    with(|c| {
        for p in &unit.group.params {
            c.owners.insert(p.param.id(), Rc::downgrade(unit));
        }
        c.sharded.extend(modules.iter().cloned());
    });
}

/// What [`enter_forward`] found.
enum Entry {
    /// A forward: the unit to prefetch implicitly (the one that followed this
    /// unit in the previous iteration), if any.
    Forward(Option<Rc<Unit>>),
    /// A recomputation during backward (activation checkpointing): not a new
    /// iteration, and no change to the recorded orders.
    Recompute,
}

/// Records `unit`'s pre-forward.
fn enter_forward(unit: &Rc<Unit>) -> Entry {
    if with(|c| c.backward_started) {
        with(|c| c.depth += 1);
        return Entry::Recompute;
    }
    let root = with(|c| c.depth == 0);
    if root {
        // A new iteration. Units whose gradients were expected from a forward
        // that was never backpropagated forget them.
        let stale: Vec<Rc<Unit>> = with(|c| {
            c.last_pre_forward = std::mem::take(&mut c.pre_forward);
            c.post_forward.clear();
            c.backward_started = false;
            c.last_pre_forward.iter().filter_map(Weak::upgrade).collect()
        });
        for u in stale {
            u.group.forget_expected();
        }
    }
    unit.is_root.set(root);
    with(|c| {
        c.depth += 1;
        c.pre_forward.push(Rc::downgrade(unit));
        let pos = c.pre_forward.len() - 1;
        let same_so_far = c
            .last_pre_forward
            .get(pos)
            .is_some_and(|w| w.upgrade().is_some_and(|u| Rc::ptr_eq(&u, unit)));
        Entry::Forward(if same_so_far {
            c.last_pre_forward.get(pos + 1).and_then(Weak::upgrade)
        } else {
            None
        })
    })
}

/// Records `unit`'s post-forward (a recomputation only leaves the depth).
fn leave_forward(unit: &Rc<Unit>, recompute: bool) {
    with(|c| {
        c.depth = c.depth.saturating_sub(1);
        if !recompute {
            c.post_forward.push(Rc::downgrade(unit));
        }
    });
}

/// Undoes [`enter_forward`]'s depth for a forward that failed.
fn abandon_forward() {
    with(|c| c.depth = c.depth.saturating_sub(1));
}

/// Marks the backward as started; true the first time in an iteration.
fn start_backward() -> bool {
    with(|c| !std::mem::replace(&mut c.backward_started, true))
}

/// The unit whose backward comes after `unit`'s (the one before it in post-forward order).
fn next_in_backward(unit: &Unit) -> Option<Rc<Unit>> {
    with(|c| {
        let pos = c
            .post_forward
            .iter()
            .rposition(|w| std::ptr::eq(w.as_ptr(), unit as *const Unit))?;
        c.post_forward[..pos]
            .iter()
            .rev()
            .filter_map(Weak::upgrade)
            .find(|u| !std::ptr::eq(Rc::as_ptr(u), unit as *const Unit) && !u.group.params.is_empty())
    })
}

/// Queues a reduction, then moves the earlier ones on: their reduce-scatters
/// (which overlapped this unit's backward) are waited for and their HSDP
/// all-reduces issued; all-reduces issued before are waited for.
fn push_reduction(r: Reduction) -> Result<()> {
    let earlier: Vec<Reduction> = with(|c| {
        let v = c.reductions.drain(..).collect();
        c.reductions.push_back(r);
        v
    });
    let mut kept = Vec::new();
    for r in earlier {
        if let Some(r) = r.advance()? {
            kept.push(r);
        }
    }
    with(|c| {
        for r in kept.into_iter().rev() {
            c.reductions.push_front(r);
        }
    });
    Ok(())
}

/// Finishes every reduction in flight, in issue order.
fn drain() -> Result<()> {
    while let Some(r) = with(|c| c.reductions.pop_front()) {
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
fn finish_backward() -> Result<()> {
    let units: Vec<Rc<Unit>> = with(|c| {
        let mut seen = Vec::new();
        for u in c.post_forward.iter().rev().filter_map(Weak::upgrade) {
            if !seen.iter().any(|s: &Rc<Unit>| Rc::ptr_eq(s, &u)) {
                seen.push(u);
            }
        }
        seen
    });
    let mut first: Result<()> = Ok(());
    for u in &units {
        let r = if u.group.has_arrivals() {
            u.post_backward()
        } else {
            u.group.forget_expected();
            u.reshard_after_backward()
        };
        if first.is_ok() {
            first = r;
        }
    }
    let drained = drain();
    with(|c| {
        c.backward_started = false;
        c.post_forward.clear();
    });
    first.and(drained)
}
