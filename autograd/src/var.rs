//! [`Var`]: a value on the tape.

use std::fmt;
use std::rc::Rc;

use smallvec::SmallVec;
use tessera_dtensor::DTensor;

use crate::Result;
use crate::saved::{Saved, SavedHandle};
use crate::tape::{self, Node, next_id};

/// A DTensor flowing through differentiable ops. Cheap to clone.
#[derive(Clone)]
pub struct Var {
    value: DTensor,
    id: u64,
    requires_grad: bool,
    /// Where backward rules re-read this value, when its owner may drop it.
    saved: Option<Rc<dyn SavedHandle>>,
}

impl Var {
    /// A value that needs no gradient (inputs, targets, constants).
    pub fn constant(value: DTensor) -> Var {
        Var {
            value,
            id: next_id(),
            requires_grad: false,
            saved: None,
        }
    }

    /// A var for a parameter's leaf (its id is the parameter's).
    pub(crate) fn leaf(value: DTensor, id: u64, requires_grad: bool) -> Var {
        Var {
            value,
            id,
            requires_grad,
            saved: None,
        }
    }

    /// What a backward rule should keep of this value: its handle when it has one
    /// (so its owner can drop the value after forward), else the value.
    ///
    /// PyTorch: `SavedVariable` (packing through `saved_tensors_hooks` when set).
    pub fn saved(&self) -> Saved {
        match &self.saved {
            Some(h) => Saved::Handle(h.clone()),
            None => Saved::Value(Box::new(self.value.clone())),
        }
    }

    /// The same var, re-read by backward rules through `handle` (which must
    /// produce its value now).
    pub(crate) fn with_saved(mut self, handle: Rc<dyn SavedHandle>) -> Var {
        self.saved = Some(handle);
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
            saved: self.saved.clone(),
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
            saved: None,
        };
        if requires_grad {
            tape::record(Node {
                name,
                output: out.id,
                inputs,
                backward: Box::new(backward),
                module: tessera_mesh::observe::current_module().map(|(m, _)| m),
            });
        }
        out
    }

    /// A value that requires a gradient and, in backward, hands the gradient that
    /// reaches it to `on_grad` instead of to a parameter (a layer above the tape
    /// receiving the gradient of a value it lent, see [`Binding::grad_to`](crate::Binding::grad_to)).
    /// Without grad mode it is a constant.
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
    #[track_caller]
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
