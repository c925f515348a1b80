//! [`Var`] (a value on the tape) and [`Param`] (a named leaf that holds its gradient).

use std::cell::{Cell, RefCell};
use std::fmt;
use std::rc::Rc;

use smallvec::SmallVec;
use tessera_dtensor::{DTensor, Placement, ShardOrder};

use crate::saved::{Saved, Slot};
use crate::tape::{self, Node, next_id};
use crate::{Error, Result};

/// A DTensor flowing through differentiable ops. Cheap to clone.
#[derive(Clone)]
pub struct Var {
    value: DTensor,
    id: u64,
    requires_grad: bool,
    /// Where backward rules read this value from, when its owner may free it.
    slot: Option<Rc<Slot>>,
}

impl Var {
    /// A value that needs no gradient (inputs, targets, constants).
    pub fn constant(value: DTensor) -> Var {
        Var {
            value,
            id: next_id(),
            requires_grad: false,
            slot: None,
        }
    }

    /// What a backward rule should keep of this value: the slot when the value
    /// lives in one (so it can be freed after forward), else the value.
    pub fn saved(&self) -> Saved {
        match &self.slot {
            Some(s) => Saved::Slot(s.clone()),
            None => Saved::Value(Box::new(self.value.clone())),
        }
    }

    /// The same var, read by backward rules from `slot` (which must hold its value now).
    pub fn with_slot(mut self, slot: Rc<Slot>) -> Var {
        self.slot = Some(slot);
        self
    }

    /// The value.
    pub fn value(&self) -> &DTensor {
        &self.value
    }

    /// Whether gradients flow to this value.
    pub fn requires_grad(&self) -> bool {
        self.requires_grad
    }

    /// The same value, cut from the tape.
    ///
    /// PyTorch: `Tensor.detach`.
    pub fn detach(&self) -> Var {
        Var::constant(self.value.clone())
    }

    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// A fresh leaf with this value that requires a gradient (for recomputation).
    pub(crate) fn fresh_leaf(&self) -> Var {
        Var {
            value: self.value.clone(),
            id: next_id(),
            requires_grad: self.requires_grad,
            slot: self.slot.clone(),
        }
    }

    /// Records an op: `value` computed from `inputs`, with `backward` mapping the
    /// output's gradient to the inputs' (in order; `None` where an input needs none).
    /// Without grad mode, or when no input needs a gradient, nothing is recorded.
    pub fn from_op(
        name: &'static str,
        value: DTensor,
        inputs: &[&Var],
        backward: impl FnOnce(&DTensor) -> Result<SmallVec<[Option<DTensor>; 3]>> + 'static,
    ) -> Var {
        let requires_grad = inputs.iter().any(|v| v.requires_grad);
        Var::record_op(name, value, inputs, requires_grad, backward)
    }

    /// [`from_op`](Self::from_op) with an explicit "needs a gradient" flag (for ops
    /// whose gradient reaches parameters that are not among `inputs`).
    pub(crate) fn record_op(
        name: &'static str,
        value: DTensor,
        inputs: &[&Var],
        requires_grad: bool,
        backward: impl FnOnce(&DTensor) -> Result<SmallVec<[Option<DTensor>; 3]>> + 'static,
    ) -> Var {
        let ids = inputs.iter().map(|v| (v.id, v.requires_grad)).collect();
        Var::record_op_ids(name, value, ids, requires_grad, backward)
    }

    /// [`record_op`](Self::record_op) with inputs given as `(id, needs a gradient)`.
    pub(crate) fn record_op_ids(
        name: &'static str,
        value: DTensor,
        inputs: SmallVec<[(u64, bool); 3]>,
        requires_grad: bool,
        backward: impl FnOnce(&DTensor) -> Result<SmallVec<[Option<DTensor>; 3]>> + 'static,
    ) -> Var {
        let requires_grad = requires_grad && tape::is_grad_enabled();
        let out = Var {
            value,
            id: next_id(),
            requires_grad,
            slot: None,
        };
        if requires_grad {
            tape::record(Node {
                name,
                output: out.id,
                inputs,
                backward: Box::new(backward),
            });
        }
        out
    }

    /// A value that requires a gradient and, in backward, hands the gradient that
    /// reaches it to `on_grad` instead of to a parameter (how FSDP receives the
    /// gradients of its unsharded parameters). Without grad mode it is a constant.
    ///
    /// PyTorch: a leaf with a `register_hook` that consumes the gradient.
    pub fn with_grad_hook(
        name: &'static str,
        value: DTensor,
        on_grad: impl FnOnce(&DTensor) -> Result<()> + 'static,
    ) -> Var {
        Var::record_op_ids(name, value, SmallVec::new(), true, move |g| {
            on_grad(g)?;
            Ok(SmallVec::new())
        })
    }

    /// Runs backward from this scalar: accumulates into every parameter it depends
    /// on (see [`backward`](crate::backward)).
    ///
    /// # Errors
    /// As [`backward`](crate::backward).
    pub fn backward(&self) -> Result<()> {
        crate::backward(self)
    }
}

impl fmt::Debug for Var {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Var(#{} {:?}, requires_grad {})",
            self.id, self.value, self.requires_grad
        )
    }
}

struct ParamInner {
    name: String,
    id: u64,
    value: RefCell<DTensor>,
    grad: RefCell<Option<DTensor>>,
    requires_grad: Cell<bool>,
    /// What [`Param::var`] returns while set (FSDP's unsharded parameter).
    stand_in: RefCell<Option<Var>>,
}

/// A named trainable tensor: a leaf of the tape that accumulates its gradient,
/// always in its own placements (a partial gradient of a replicated parameter is
/// all-reduced, that of a sharded one reduce-scattered).
///
/// Cheap to clone (a shared handle); lives on its rank's thread.
///
/// PyTorch: `torch.nn.Parameter`.
#[derive(Clone)]
pub struct Param {
    inner: Rc<ParamInner>,
}

impl Param {
    /// A trainable parameter.
    pub fn new(name: impl Into<String>, value: DTensor) -> Param {
        Param {
            inner: Rc::new(ParamInner {
                name: name.into(),
                id: next_id(),
                value: RefCell::new(value),
                grad: RefCell::new(None),
                requires_grad: Cell::new(true),
                stand_in: RefCell::new(None),
            }),
        }
    }

    /// The parameter's name (its state-dict key).
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// A unique id of this parameter (shared by its clones), for keying
    /// per-parameter state such as FSDP's ownership.
    pub fn id(&self) -> u64 {
        self.inner.id
    }

    /// The current value.
    pub fn value(&self) -> DTensor {
        self.inner.value.borrow().clone()
    }

    /// The value, mutably (an optimizer's in-place step).
    pub(crate) fn value_mut(&self) -> std::cell::RefMut<'_, DTensor> {
        self.inner.value.borrow_mut()
    }

    /// Replaces the value (optimizers, loading). The placements may change (FSDP
    /// does that); the gradient keeps whatever placements it had.
    pub fn set_value(&self, value: DTensor) {
        *self.inner.value.borrow_mut() = value;
    }

    /// The accumulated gradient, in the placements the parameter had when the
    /// gradient was accumulated (its own placements, unless they changed since).
    pub fn grad(&self) -> Option<DTensor> {
        self.inner.grad.borrow().clone()
    }

    /// Replaces the gradient.
    pub fn set_grad(&self, grad: Option<DTensor>) {
        *self.inner.grad.borrow_mut() = grad;
    }

    /// Clears the gradient.
    ///
    /// PyTorch: `optimizer.zero_grad(set_to_none=True)`.
    pub fn zero_grad(&self) {
        self.set_grad(None);
    }

    /// Whether the parameter is trained (frozen parameters get no gradient).
    pub fn requires_grad(&self) -> bool {
        self.inner.requires_grad.get()
    }

    /// Freezes or unfreezes the parameter.
    pub fn set_requires_grad(&self, on: bool) {
        self.inner.requires_grad.set(on);
    }

    /// The parameter as a tape leaf: ops on it record, and backward accumulates
    /// into [`grad`](Self::grad).
    pub fn var(&self) -> Var {
        if let Some(v) = self.inner.stand_in.borrow().as_ref() {
            return v.clone();
        }
        let requires_grad = self.requires_grad() && tape::is_grad_enabled();
        if requires_grad {
            tape::register_param(self);
        }
        Var {
            value: self.value(),
            id: self.inner.id,
            requires_grad,
            slot: None,
        }
    }

    /// Makes [`var`](Self::var) return `v` until cleared (`None`). FSDP sets the
    /// unsharded parameter here for its unit's forward; its gradient then reaches
    /// this parameter through `v`'s own backward rule.
    pub fn set_stand_in(&self, v: Option<Var>) {
        *self.inner.stand_in.borrow_mut() = v;
    }

    /// Adds `g` (any placements) to the gradient, converted to the parameter's
    /// placements and shard order (a partial gradient of a replicated parameter is
    /// all-reduced, that of a sharded one reduce-scattered; nothing moves when `g`
    /// already has them). What backward does for every parameter, and what FSDP
    /// does with the gradients it reduced.
    ///
    /// PyTorch: autograd's accumulation into `param.grad`.
    ///
    /// # Errors
    /// A gradient of another global shape; a failed redistribution or add.
    pub fn accumulate(&self, g: DTensor) -> Result<()> {
        let value = self.value();
        let target: Vec<Placement> = value.placements().to_vec();
        let g = if g.placements() == &target[..] && g.layout().order == value.layout().order {
            g
        } else {
            g.redistribute_with_order(&target, value.layout().order.clone())
                .or_else(|_| g.redistribute_with_order(&target, ShardOrder::default_for(&target)))?
        };
        if g.shape() != value.shape() {
            return Err(Error::Backward(format!(
                "gradient of {} has shape {:?}, the parameter {:?}",
                self.name(),
                g.shape(),
                value.shape()
            )));
        }
        let sum = match self.grad() {
            Some(prev) => prev.add(&g)?,
            None => g,
        };
        self.set_grad(Some(sum));
        Ok(())
    }
}

impl fmt::Debug for Param {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Param({} {:?})", self.name(), self.value())
    }
}
