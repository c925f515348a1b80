//! [`Param`] (a leaf that holds its gradient, possibly deferred) and [`Binding`] (what a
//! parameter yields in its place while a module runs).
//!
//! A layer above the tape (a parallelism layer that gathers parameters for a
//! module's forward, a quantiser, an offloading scheme) lends a parameter a value
//! with [`Param::bind`] in a module's forward pre-hook and clears it in the
//! post-hook: while bound, [`Param::var`] yields that value; its gradient goes
//! where the binding says ([`Binding::grad_to`]), and backward rules re-read it
//! through the binding's [`SavedHandle`] ([`Binding::saved_through`]), so the
//! layer may drop it after forward and restore it before backward.

use std::cell::{Cell, RefCell};
use std::fmt;
use std::rc::Rc;

use tessera_dtensor::{DTensor, DTensorSpec, DType, Layout, Placement, ShardOrder, Tensor};
use tessera_mesh::DeviceMesh;
use tessera_tensor::memory::Category;

use crate::saved::SavedHandle;
use crate::tape::{self, next_id};
use crate::var::Var;
use crate::{Error, Result};

/// Receives the gradient that reaches a bound value.
type GradHook = Box<dyn FnOnce(&DTensor) -> Result<()>>;

/// Where the gradient of a bound value goes.
enum Grad {
    /// Nowhere: the value needs no gradient.
    None,
    /// To a hook, under this op name on the tape.
    Hook(&'static str, GradHook),
}

/// What a parameter yields while bound ([`Param::bind`]): a value in place of its
/// own, where that value's gradient goes, and how backward re-reads it.
///
/// ```
/// use std::cell::RefCell;
/// use std::rc::Rc;
///
/// use tessera_autograd::{backward, Binding, Param};
/// use tessera_dtensor::{distribute_tensor, DType, Placement::*, Tensor};
/// use tessera_mesh::{launch, DeviceMesh};
///
/// launch(1, |ctx| {
///     let mesh = DeviceMesh::new(ctx.into_comm(), &[1])?;
///     let w = Param::new(distribute_tensor(&Tensor::ones(&[2], DType::F64)?, &mesh, &[Replicate])?);
///     // Lend a doubled weight for one forward and catch its gradient.
///     let caught = Rc::new(RefCell::new(None));
///     let sink = caught.clone();
///     let lent = w.value()?.mul_scalar(2.0)?;
///     w.bind(Some(Binding::new(lent).grad_to("lent", move |g| {
///         *sink.borrow_mut() = Some(g.clone());
///         Ok(())
///     })));
///     let loss = w.var()?.square()?.sum(&[0], false)?;
///     w.bind(None);
///     backward(&loss)?;
///     // d Σ v² / dv = 2v = 4 at v = 2; the parameter itself got nothing.
///     assert_eq!(caught.borrow().as_ref().unwrap().to_local().to_vec::<f64>()?, [4.0, 4.0]);
///     assert!(w.grad().is_none());
///     Ok(())
/// })?;
/// # Ok::<(), tessera_mesh::Error>(())
/// ```
///
/// PyTorch: a forward pre-hook that swaps a module's parameter for another tensor
/// (`module.weight = other`, as `torch.func.functional_call` does for a call),
/// receiving that tensor's gradient through `Tensor.register_hook` or a custom
/// `autograd.Function`; the re-reading is `torch.autograd.graph.saved_tensors_hooks`.
pub struct Binding {
    source: Source,
    saved: Option<Rc<dyn SavedHandle>>,
}

/// What a binding yields: a value (and where its gradient goes), or a var
/// already on the tape.
enum Source {
    Value(DTensor, Grad),
    Var(Var),
}

impl Binding {
    /// `value` in place of the parameter's own; it needs no gradient until
    /// [`grad_to`](Self::grad_to) says where the gradient goes.
    pub fn new(value: DTensor) -> Binding {
        Binding {
            source: Source::Value(value, Grad::None),
            saved: None,
        }
    }

    /// `var`, a value already on the tape, in place of the parameter's own (its
    /// gradient flows on through the ops that produced it).
    ///
    /// PyTorch: a parametrization's output (`torch.nn.utils.parametrize`).
    pub fn of_var(var: Var) -> Binding {
        Binding {
            source: Source::Var(var),
            saved: None,
        }
    }

    /// The value requires a gradient, and backward hands the gradient that reaches
    /// it to `on_grad` (recorded as the op `name`) instead of accumulating it into
    /// the parameter. Without grad mode the value is a constant. No effect on a
    /// binding made [`of_var`](Self::of_var).
    ///
    /// PyTorch: `Tensor.register_hook` on the swapped-in tensor, or
    /// `register_post_accumulate_grad_hook`.
    #[must_use]
    pub fn grad_to(mut self, name: &'static str, on_grad: impl FnOnce(&DTensor) -> Result<()> + 'static) -> Binding {
        if let Source::Value(_, grad) = &mut self.source {
            *grad = Grad::Hook(name, Box::new(on_grad));
        }
        self
    }

    /// Backward rules that keep the value re-read it through `handle` (which must
    /// produce it now), so its owner may drop it after forward and restore it
    /// before backward.
    ///
    /// PyTorch: `torch.autograd.graph.saved_tensors_hooks` around the module's forward.
    #[must_use]
    pub fn saved_through(mut self, handle: Rc<dyn SavedHandle>) -> Binding {
        self.saved = Some(handle);
        self
    }

    /// The var [`Param::var`] yields while bound.
    fn into_var(self) -> Var {
        let var = match self.source {
            Source::Var(v) => v,
            Source::Value(value, Grad::Hook(name, on_grad)) => Var::with_grad_hook(name, value, on_grad),
            Source::Value(value, Grad::None) => Var::constant(value),
        };
        match self.saved {
            Some(h) => var.with_saved(h),
            None => var,
        }
    }
}

struct ParamInner {
    /// The fully qualified name its module tree gave it ([`crate::nn::name_parameters`]).
    name: RefCell<Option<Rc<str>>>,
    id: u64,
    value: RefCell<Value>,
    grad: RefCell<Option<DTensor>>,
    requires_grad: Cell<bool>,
    /// What [`Param::var`] yields while bound ([`Param::bind`]).
    bound: RefCell<Option<Var>>,
}

/// A parameter's value: a tensor, or only where one will be (deferred).
enum Value {
    Ready(DTensor),
    /// Shape, dtype, mesh and placements, no storage.
    Deferred {
        mesh: DeviceMesh,
        layout: Layout,
    },
}

/// A trainable tensor: a leaf of the tape that accumulates its gradient, always
/// in its own placements (a partial gradient of a replicated parameter is
/// all-reduced, that of a sharded one reduce-scattered).
///
/// A parameter may be *deferred* ([`Param::deferred`]): it knows its global
/// shape, dtype, mesh and placements but holds no storage, so a model larger
/// than one rank can be built, planned and sharded before any rank allocates
/// its piece; [`nn::Materializer`](crate::nn::Materializer) then fills each
/// rank's local shard. Using a deferred parameter (its [`value`](Self::value) or
/// [`var`](Self::var)) is an error naming it.
///
/// Its name is its fully qualified name in the module tree
/// (`layers.0.attention.wq.weight`), given by [`nn::name_parameters`](crate::nn::name_parameters)
/// (which materialising, tensor parallelism and the reference models run on their
/// root): constructors take no names.
///
/// Cheap to clone (a shared handle); lives on its rank's thread.
///
/// PyTorch: `torch.nn.Parameter` (deferred: a parameter on the `meta` device).
#[derive(Clone)]
pub struct Param {
    inner: Rc<ParamInner>,
}

impl Param {
    /// A trainable parameter holding `value` (unnamed until its module tree
    /// names it).
    pub fn new(value: DTensor) -> Param {
        Param::with_value(Value::Ready(value))
    }

    /// A deferred parameter: `shape` and `dtype`, replicated on `mesh`, no storage.
    ///
    /// PyTorch: `torch.empty(shape, device="meta")` wrapped in a `Parameter`.
    ///
    /// # Errors
    /// A shape or dtype a tensor cannot have.
    pub fn deferred(shape: &[usize], dtype: DType, mesh: &DeviceMesh) -> Result<Param> {
        let replicated = vec![Placement::Replicate; mesh.ndim()];
        let layout = Layout::new(mesh.shape(), &replicated, shape, dtype)?;
        Ok(Param::with_value(Value::Deferred {
            mesh: mesh.clone(),
            layout,
        }))
    }

    fn with_value(value: Value) -> Param {
        Param {
            inner: Rc::new(ParamInner {
                name: RefCell::new(None),
                id: next_id(),
                value: RefCell::new(value),
                grad: RefCell::new(None),
                requires_grad: Cell::new(true),
                bound: RefCell::new(None),
            }),
        }
    }

    /// The parameter's fully qualified name in its module tree (its state-dict
    /// key); `parameter #<id>` until the tree names it.
    pub fn name(&self) -> String {
        match self.inner.name.borrow().as_deref() {
            Some(n) => n.to_string(),
            None => format!("parameter #{}", self.inner.id),
        }
    }

    /// Whether a module tree has named the parameter.
    pub fn is_named(&self) -> bool {
        self.inner.name.borrow().is_some()
    }

    /// Gives the parameter its name (its tree's walk does this).
    pub(crate) fn set_name(&self, name: &str) {
        *self.inner.name.borrow_mut() = Some(name.into());
    }

    /// A parameter named `name` without a tree, for this crate's unit tests.
    #[cfg(test)]
    pub(crate) fn named(name: impl AsRef<str>, value: DTensor) -> Param {
        let p = Param::new(value);
        p.set_name(name.as_ref());
        p
    }

    /// A unique id of this parameter (shared by its clones; its leaf's id on the
    /// tape), for keying per-parameter state such as an optimizer's or a
    /// parallelism layer's.
    pub fn id(&self) -> u64 {
        self.inner.id
    }

    /// The current value.
    ///
    /// # Errors
    /// The parameter is deferred (not materialised yet).
    pub fn value(&self) -> Result<DTensor> {
        match &*self.inner.value.borrow() {
            Value::Ready(v) => Ok(v.clone()),
            Value::Deferred { layout, .. } => Err(self.deferred_error(layout)),
        }
    }

    fn deferred_error(&self, layout: &Layout) -> Error {
        Error::Deferred {
            name: self.name(),
            detail: format!("{layout} has no storage yet; materialize the model first (nn::Materializer on its root)"),
        }
    }

    /// Whether the parameter is deferred: placed, but without storage.
    pub fn is_deferred(&self) -> bool {
        matches!(&*self.inner.value.borrow(), Value::Deferred { .. })
    }

    /// The layout (global shape, dtype, placements, shard order), deferred or not.
    pub fn layout(&self) -> Layout {
        match &*self.inner.value.borrow() {
            Value::Ready(v) => v.layout().clone(),
            Value::Deferred { layout, .. } => layout.clone(),
        }
    }

    /// The mesh the parameter lives on.
    pub fn mesh(&self) -> DeviceMesh {
        match &*self.inner.value.borrow() {
            Value::Ready(v) => v.mesh().clone(),
            Value::Deferred { mesh, .. } => mesh.clone(),
        }
    }

    /// The global shape.
    pub fn shape(&self) -> Vec<usize> {
        self.layout().shape.to_vec()
    }

    /// The dtype.
    pub fn dtype(&self) -> DType {
        self.layout().dtype
    }

    /// The placements.
    pub fn placements(&self) -> Vec<Placement> {
        self.layout().placements.to_vec()
    }

    /// The value, mutably (an optimizer's in-place step).
    pub(crate) fn value_mut(&self) -> Result<std::cell::RefMut<'_, DTensor>> {
        let value = self.inner.value.borrow_mut();
        if let Value::Deferred { layout, .. } = &*value {
            return Err(self.deferred_error(layout));
        }
        Ok(std::cell::RefMut::map(value, |v| match v {
            Value::Ready(t) => t,
            Value::Deferred { .. } => unreachable!("checked above"),
        }))
    }

    /// Replaces the value (optimizers, loading; it materialises a deferred
    /// parameter). The placements may change (a parallelism layer redistributing
    /// it does that); the gradient keeps whatever placements it had.
    pub fn set_value(&self, value: DTensor) {
        value.to_local().set_memory_category(Category::Parameters);
        *self.inner.value.borrow_mut() = Value::Ready(value);
    }

    /// Places the parameter `layout` on its mesh: a deferred one only records it
    /// (no storage, no communication); a materialised one is redistributed.
    /// Collective for a materialised parameter.
    ///
    /// PyTorch: `distribute_tensor` of a parameter (on the `meta` device, only
    /// the placements change).
    ///
    /// # Errors
    /// A layout of another global shape or dtype, or for another mesh shape; a
    /// failed redistribution.
    pub fn place(&self, layout: Layout) -> Result<()> {
        let current = self.layout();
        if layout.shape != current.shape || layout.dtype != current.dtype {
            return Err(Error::Config {
                op: "Param::place",
                detail: format!(
                    "{} is {current}; it cannot be placed as {layout} (another shape or dtype)",
                    self.name()
                ),
            });
        }
        let mut value = self.inner.value.borrow_mut();
        match &mut *value {
            Value::Deferred { mesh, layout: l } => {
                DTensorSpec::new(mesh, layout.clone())?;
                *l = layout;
            }
            Value::Ready(v) => {
                *v = v.redistribute_with_order(&layout.placements, layout.order.clone())?;
            }
        }
        Ok(())
    }

    /// Materialises a deferred parameter with this rank's local shard, which
    /// `local` computes from the mesh and layout (a materialised parameter is left
    /// as it is, and `local` is not called), on the mesh's
    /// [device](DeviceMesh::device). Not collective.
    ///
    /// # Errors
    /// Whatever `local` fails with; a local tensor of another shape or dtype than
    /// the layout gives this rank.
    pub fn materialize_with(&self, local: impl FnOnce(&DeviceMesh, &Layout) -> Result<Tensor>) -> Result<()> {
        let (mesh, layout) = match &*self.inner.value.borrow() {
            Value::Ready(_) => return Ok(()),
            Value::Deferred { mesh, layout } => (mesh.clone(), layout.clone()),
        };
        let t = local(&mesh, &layout)?;
        let want = layout.local_shape(mesh.coordinate())?;
        if t.shape() != &want[..] || t.dtype() != layout.dtype {
            return Err(Error::Config {
                op: "materialize",
                detail: format!(
                    "{}: this rank's shard of {layout} is {}{want:?}, the initialiser gave {}{:?}",
                    self.name(),
                    layout.dtype,
                    t.dtype(),
                    t.shape()
                ),
            });
        }
        // Made on the host, kept on the mesh's device (a planning run's meta
        // shard stays on meta).
        let t = if t.is_meta() { t } else { t.to(mesh.device())? };
        self.set_value(DTensor::from_local_with_layout(t, &mesh, layout)?);
        Ok(())
    }

    /// The accumulated gradient, in the placements the parameter had when the
    /// gradient was accumulated (its own placements, unless they changed since).
    pub fn grad(&self) -> Option<DTensor> {
        self.inner.grad.borrow().clone()
    }

    /// Replaces the gradient.
    pub fn set_grad(&self, grad: Option<DTensor>) {
        if let Some(g) = &grad {
            g.to_local().set_memory_category(Category::Gradients);
        }
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
    /// into [`grad`](Self::grad). While bound ([`bind`](Self::bind)), the bound
    /// value instead (the same var each call).
    ///
    /// # Errors
    /// The parameter is deferred and not bound.
    pub fn var(&self) -> Result<Var> {
        if let Some(v) = self.inner.bound.borrow().as_ref() {
            return Ok(v.clone());
        }
        let value = self.value()?;
        let requires_grad = self.requires_grad() && tape::is_grad_enabled();
        if requires_grad {
            tape::register_param(self);
        }
        Ok(Var::leaf(value, self.inner.id, requires_grad))
    }

    /// Makes [`var`](Self::var) yield what `binding` says until cleared with
    /// `None` (see [`Binding`]); the value's gradient goes where the binding
    /// says, not into [`grad`](Self::grad), unless the binding passes it on.
    ///
    /// PyTorch: swapping `module.weight` for another tensor in a forward pre-hook
    /// and back in the post-hook (`torch.func.functional_call` for one call).
    pub fn bind(&self, binding: Option<Binding>) {
        *self.inner.bound.borrow_mut() = binding.map(Binding::into_var);
    }

    /// Adds `g` (any placements) to the gradient, converted to the parameter's
    /// placements and shard order (a partial gradient of a replicated parameter is
    /// all-reduced, that of a sharded one reduce-scattered; nothing moves when `g`
    /// already has them). What backward does for every parameter, and what a layer
    /// above the tape does with the gradients it received through a [`Binding`].
    ///
    /// PyTorch: autograd's accumulation into `param.grad`.
    ///
    /// # Errors
    /// A gradient of another global shape; a deferred parameter; a failed
    /// redistribution or add.
    pub fn accumulate(&self, g: DTensor) -> Result<()> {
        let value = self.value()?;
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

/// A handle to a parameter that does not keep it alive, for a layer that names
/// a parameter in its errors without owning it.
///
/// PyTorch: a `weakref.ref` to a `Parameter`.
#[derive(Clone)]
pub struct WeakParam(std::rc::Weak<ParamInner>);

impl WeakParam {
    /// The parameter, if it is still alive.
    pub fn upgrade(&self) -> Option<Param> {
        self.0.upgrade().map(|inner| Param { inner })
    }
}

impl Param {
    /// A [`WeakParam`] to this parameter.
    pub fn downgrade(&self) -> WeakParam {
        WeakParam(Rc::downgrade(&self.inner))
    }
}

impl fmt::Debug for Param {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &*self.inner.value.borrow() {
            Value::Ready(v) => write!(f, "Param({} {v:?})", self.name()),
            Value::Deferred { layout, .. } => write!(f, "Param({} deferred {layout})", self.name()),
        }
    }
}
