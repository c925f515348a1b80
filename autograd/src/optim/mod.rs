//! Optimizers that update each rank's local shard without communication, and
//! gradient clipping by the global norm (one all_reduce).
//!
//! ```
//! use tessera_autograd::optim::{AdamW, AdamWConfig, Optimizer};
//! use tessera_autograd::Param;
//! use tessera_dtensor::{distribute_tensor, DType, Placement::*, Tensor};
//! use tessera_mesh::{launch, DeviceMesh};
//!
//! let full = launch(2, |ctx| {
//!     let mesh = DeviceMesh::new(ctx.into_comm(), &[2])?;
//!     let w = Param::new(distribute_tensor(&Tensor::ones(&[4], DType::F32)?, &mesh, &[Shard(0)])?);
//!     w.set_grad(Some(distribute_tensor(&Tensor::ones(&[4], DType::F32)?, &mesh, &[Shard(0)])?));
//!     let mut opt = AdamW::new(vec![w.clone()], AdamWConfig { weight_decay: 0.0, ..AdamWConfig::default() })?;
//!     opt.step()?; // each rank updates its two elements, no communication
//!     Ok(w.value()?.full_tensor()?.to_vec::<f32>()?)
//! })
//! .unwrap();
//! // The first Adam step moves every element by lr (1e-3) against the gradient's sign.
//! assert!(full[0].iter().all(|&x| (x - 0.999).abs() < 1e-6));
//! ```
//!
//! - [`Optimizer`]: `step` and `zero_grad` over a list of [`Param`]s.
//! - [`Sgd`] (momentum, dampening, weight decay, Nesterov) and [`AdamW`] (decoupled
//!   weight decay), each written as one loop over the local elements, in the order
//!   of operations of PyTorch's single-tensor CPU implementations.
//! - [`clip_grad_norm`]: the global 2-norm of all gradients, one all_reduce per mesh.
//! - [`Schedule`] and [`LrScheduler`]: learning-rate schedules (linear, cosine,
//!   warmup-cosine, warmup-stable-decay, composed in sequence), resumable from
//!   a checkpoint's metadata.
//!
//! The update is element-wise, so a sharded parameter and its sharded gradient (same
//! placements) are updated shard by shard; replicas of a replicated parameter make
//! the same update. Optimizer state (momentum, moments) has the shape of the local
//! shard and lives on its rank; its bytes are charged to the rank's
//! [memory tracker](tessera_tensor::memory). `f32` and `f64` parameters keep state
//! and compute in their own dtype; `bf16` and `f16` parameters compute in `f32`
//! with `f32` state, and only the updated parameter is rounded back.

mod adamw;
mod clip;
mod schedule;
mod sgd;

use std::borrow::Cow;

use tessera_dtensor::{DTensor, Layout, PlacementsDisplay, Tensor};
use tessera_mesh::{Buffer, DType};
use tessera_tensor::kernel::Real;
use tessera_tensor::memory::{Allocation, Category};

use crate::{Error, Param, Result};

pub use adamw::{AdamW, AdamWConfig};
pub use clip::clip_grad_norm;
pub use schedule::{LrScheduler, Schedule};
pub use sgd::{Sgd, SgdConfig};

/// An optimizer over a fixed list of parameters.
///
/// PyTorch: `torch.optim.Optimizer` (one parameter group).
pub trait Optimizer {
    /// Updates every parameter that has a gradient, in place on each rank's local
    /// shard. Parameters without a gradient are skipped (their state is untouched).
    /// Not collective.
    ///
    /// PyTorch: `Optimizer.step`.
    ///
    /// # Errors
    /// A gradient laid out differently from its parameter (other placements, shard
    /// order, global shape or mesh), a parameter whose layout changed since the
    /// optimizer state was created, or a non-float parameter. Every parameter is
    /// checked before any is updated, so on error nothing has changed.
    fn step(&mut self) -> Result<()>;

    /// Clears every parameter's gradient.
    ///
    /// PyTorch: `Optimizer.zero_grad(set_to_none=True)`.
    fn zero_grad(&self) {
        for p in self.params() {
            p.zero_grad();
        }
    }

    /// The parameters, in the order given at construction.
    fn params(&self) -> &[Param];

    /// The learning rate.
    fn lr(&self) -> f64;

    /// Sets the learning rate (for schedules).
    ///
    /// # Errors
    /// A negative or NaN learning rate.
    fn set_lr(&mut self, lr: f64) -> Result<()>;

    /// The names of the state a parameter holds once it has stepped
    /// (`["exp_avg", "exp_avg_sq", "step"]` for AdamW).
    fn state_names(&self) -> &'static [&'static str];

    /// Those of [`state_names`](Self::state_names) that are not laid out as
    /// their parameter but replicated (a step count); default none.
    fn replicated_state_names(&self) -> &'static [&'static str] {
        &[]
    }

    /// The per-parameter state as DTensors, `(parameter index, name, value)`:
    /// buffers in their parameter's layout (and the state's dtype), step counts
    /// as `i64` `[1]` replicated on the parameter's mesh. Parameters that have
    /// not stepped have none. For checkpoints.
    ///
    /// PyTorch: `Optimizer.state_dict()["state"]`.
    ///
    /// # Errors
    /// A parameter whose layout changed since its state was made.
    fn state_tensors(&self) -> Result<Vec<(usize, &'static str, DTensor)>>;

    /// Replaces the state of each listed parameter, `(parameter index, tensors)`,
    /// by its tensors (every name of [`state_names`](Self::state_names), as
    /// `state_tensors` gives them, in the parameter's current layout). All or
    /// nothing: every entry is checked before any state changes, so on error
    /// the optimizer is as it was.
    ///
    /// PyTorch: `Optimizer.load_state_dict`.
    ///
    /// # Errors
    /// An index past the parameters, a missing or unknown name, a buffer in
    /// another layout than the parameter's or not floating-point, a step that is
    /// not one `i64`.
    fn load_state_tensors(&mut self, states: &[(usize, Vec<(&str, DTensor)>)]) -> Result<()>;

    /// Runs every check of [`load_state_tensors`](Self::load_state_tensors)
    /// on `states` without changing anything: `Ok` exactly when loading them
    /// would succeed. A collective load checks on every rank and agrees before
    /// any rank applies.
    ///
    /// # Errors
    /// As `load_state_tensors`.
    fn check_state_tensors(&self, states: &[(usize, Vec<(&str, DTensor)>)]) -> Result<()>;
}

/// A step count as an `i64` `[1]` replicated on `mesh`.
pub(crate) fn step_tensor(mesh: &tessera_mesh::DeviceMesh, step: u64) -> Result<DTensor> {
    let r = vec![tessera_dtensor::Placement::Replicate; mesh.ndim()];
    Ok(DTensor::from_local(
        Tensor::from_vec(vec![step as i64], &[1])?,
        mesh,
        &r,
        &[1],
    )?)
}

/// Every parameter's state slot made from its checkpointed tensors by
/// `slot_of` (which checks them), all before any is stored: what makes
/// [`Optimizer::load_state_tensors`] all or nothing.
pub(crate) fn slots_of<S>(
    states: &[(usize, Vec<(&str, DTensor)>)],
    slot_of: impl Fn(usize, &[(&str, DTensor)]) -> Result<S>,
) -> Result<Vec<(usize, S)>> {
    states.iter().map(|(i, ts)| Ok((*i, slot_of(*i, ts)?))).collect()
}

/// Parameter `index` of `params`, or an error naming the count.
pub(crate) fn param_at<'a>(op: &'static str, params: &'a [Param], index: usize) -> Result<&'a Param> {
    params.get(index).ok_or_else(|| Error::Config {
        op,
        detail: format!("no parameter {index} (the optimizer has {})", params.len()),
    })
}

/// The state tensor `name` of `tensors`, or an error naming the parameter.
pub(crate) fn named<'a>(
    op: &'static str,
    param: &Param,
    tensors: &'a [(&str, DTensor)],
    name: &str,
) -> Result<&'a DTensor> {
    tensors
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, t)| t)
        .ok_or_else(|| Error::Config {
            op,
            detail: format!("the state of {} has no {name}", param.name()),
        })
}

/// Checks that `tensors` names only `known` states.
pub(crate) fn only_known(op: &'static str, param: &Param, tensors: &[(&str, DTensor)], known: &[&str]) -> Result<()> {
    match tensors.iter().find(|(n, _)| !known.contains(n)) {
        Some((n, _)) => Err(Error::Config {
            op,
            detail: format!(
                "the state of {} holds an unknown {n} (this optimizer keeps {known:?})",
                param.name()
            ),
        }),
        None => Ok(()),
    }
}

/// A step count from its `i64` `[1]` tensor.
pub(crate) fn step_of(op: &'static str, param: &Param, t: &DTensor) -> Result<u64> {
    let v = t.to_local();
    if t.dtype() != DType::I64 || t.shape() != [1] || v.numel() != 1 {
        return Err(Error::Config {
            op,
            detail: format!(
                "the step of {} must be one i64, got {:?} {}",
                param.name(),
                t.shape(),
                t.dtype()
            ),
        });
    }
    let s = v.to_vec::<i64>()?[0];
    u64::try_from(s).map_err(|_| Error::Config {
        op,
        detail: format!("the step of {} is {s}", param.name()),
    })
}

/// The elements of `b` as `&mut [F]`, or `None` when `F` is not its dtype.
fn typed_mut<F: Real>(b: &mut Buffer) -> Option<&mut [F]> {
    if b.dtype() != F::DTYPE {
        return None;
    }
    // Same dtype, so the inner vector is a `Vec<F>`: the cast never fails.
    tessera_mesh::dispatch_buf!(BufMut, b.as_buf_mut(), s, _S => bytemuck::try_cast_slice_mut(s).ok())
}

/// The dtype an optimizer computes in for a parameter of `dtype`.
pub(crate) fn compute_dtype(op: &'static str, name: &str, dtype: DType) -> Result<DType> {
    match dtype {
        DType::F64 => Ok(DType::F64),
        DType::F32 | DType::BF16 | DType::F16 => Ok(DType::F32),
        _ => Err(Error::Config {
            op,
            detail: format!("parameter {name} has dtype {dtype}; only float parameters can be optimized (freeze it)"),
        }),
    }
}

/// Whether two layouts place the same global shape the same way (dtype aside).
pub(crate) fn same_placement(a: &Layout, b: &Layout) -> bool {
    a.mesh_shape == b.mesh_shape && a.placements == b.placements && a.order == b.order && a.shape == b.shape
}

/// A parameter ready for an update: its value and its gradient, checked.
/// What an element-wise optimizer implements; [`step_all`] runs the shared steps.
pub(crate) trait PerParam {
    /// The optimizer's name, for errors.
    const OP: &'static str;
    /// The parameters, in order.
    fn param_list(&self) -> &[Param];
    /// Checks (and creates) a parameter's state; runs for every parameter before
    /// any is updated, so a failing step changes nothing.
    fn prepare(&mut self, r: &Ready) -> Result<()>;
    /// Updates one parameter's local shard (`r` by value: its copy of the
    /// value goes before the update, so that the parameter may hold it alone
    /// and be updated in place, see [`update_local`]).
    fn update<F: Real>(&mut self, r: Ready) -> Result<()>;
}

/// One optimizer step: check every parameter that has a gradient, then update
/// each, computing in f64 for f64 parameters and in f32 otherwise.
pub(crate) fn step_all<O: PerParam>(opt: &mut O) -> Result<()> {
    let _t = tessera_tensor::profile::scope(tessera_tensor::profile::Kind::Optimizer);
    let mut ready = Vec::new();
    for (i, p) in opt.param_list().iter().enumerate() {
        if let Some(r) = ready_param(O::OP, i, p)? {
            ready.push(r);
        }
    }
    for r in &ready {
        opt.prepare(r)?;
    }
    for r in ready {
        // A planning run's parameter (on meta): its state exists (`prepare`
        // made it), and there is nothing to compute.
        if r.value.to_local().is_meta() {
            continue;
        }
        match r.dtype {
            DType::F64 => opt.update::<f64>(r)?,
            _ => opt.update::<f32>(r)?,
        }
    }
    Ok(())
}

pub(crate) struct Ready {
    pub(crate) index: usize,
    pub(crate) value: DTensor,
    pub(crate) grad: DTensor,
    pub(crate) dtype: DType,
}

/// The parameter's value and gradient when it has one, after the checks every
/// optimizer makes: a float, non-partial parameter, and a gradient in exactly its
/// layout on the same mesh.
pub(crate) fn ready_param(op: &'static str, index: usize, p: &Param) -> Result<Option<Ready>> {
    let Some(grad) = p.grad() else {
        return Ok(None);
    };
    let value = p.value()?;
    let dtype = compute_dtype(op, &p.name(), value.dtype())?;
    if value.placements().iter().any(|pl| pl.is_partial()) {
        return Err(Error::Config {
            op,
            detail: format!(
                "parameter {} is {} (a pending reduction); reduce it to Replicate or Shard before optimizing",
                p.name(),
                PlacementsDisplay(value.placements())
            ),
        });
    }
    if !same_placement(grad.layout(), value.layout()) || !grad.mesh().same_as(value.mesh()) {
        return Err(Error::Config {
            op,
            detail: format!(
                "the gradient of {} is {} on {}, the parameter {} on {}; gradients must have their \
                 parameter's layout (redistribute the gradient first)",
                p.name(),
                grad.layout(),
                grad.mesh(),
                value.layout(),
                value.mesh()
            ),
        });
    }
    if !grad.dtype().is_float() {
        return Err(Error::Config {
            op,
            detail: format!(
                "the gradient of {} has dtype {}; gradients must be floats",
                p.name(),
                grad.dtype()
            ),
        });
    }
    Ok(Some(Ready {
        index,
        value,
        grad,
        dtype,
    }))
}

/// The elements of a local tensor as `F`: borrowed when it already is a contiguous
/// `F` tensor, else converted (row-major).
pub(crate) fn local_cow<F: Real>(t: &Tensor) -> Result<Cow<'_, [F]>> {
    if t.dtype() == F::DTYPE && t.is_contiguous() {
        Ok(Cow::Borrowed(t.as_slice::<F>()?))
    } else {
        Ok(Cow::Owned(t.cast(F::DTYPE)?.to_vec::<F>()?))
    }
}

/// Runs `f` on parameter `p`'s local elements (in `F`, row-major) and keeps
/// the result as its value: in place when `p` alone holds its value's storage,
/// whole and already in `F` (no copy, no allocation); otherwise on a copy that
/// becomes the new value (whoever still holds the old value sees it unchanged,
/// e.g. a parallelism layer's record of the values it lent). `value` is the copy of the
/// value that [`ready_param`] took, dropped first.
pub(crate) fn update_local<F: Real>(p: &Param, value: DTensor, f: impl FnOnce(&mut [F])) -> Result<()> {
    drop(value);
    let mut current = p.value_mut()?;
    if let Some(data) = current.try_local_mut_slice::<F>() {
        f(data);
        return Ok(());
    }
    let mut data = local_cow::<F>(current.to_local())?.into_owned();
    f(&mut data);
    *current = with_local(&current, data)?;
    Ok(())
}

/// `value` with its local tensor replaced by `data` (row-major, in `F`), rounded
/// to the value's dtype; same layout and mesh.
pub(crate) fn with_local<F: Real>(value: &DTensor, data: Vec<F>) -> Result<DTensor> {
    let local = Tensor::from_vec(data, value.to_local().shape())?.cast(value.dtype())?;
    Ok(DTensor::from_local_with_layout(
        local,
        value.mesh(),
        value.layout().clone(),
    )?)
}

/// One per-parameter state vector (a momentum buffer, a moment) in the compute
/// dtype, charged to the rank's memory tracker.
pub(crate) struct StateVec {
    data: Buffer,
    /// The state on a GPU (then `data` is empty): the device tensor, flat.
    device: Option<Tensor>,
    _charge: Allocation,
}

impl StateVec {
    /// The state over `param`'s local shard as a DTensor in `layout` (the
    /// parameter's) with the state's dtype.
    pub(crate) fn to_dtensor(&self, param: &Param, layout: &Layout) -> Result<DTensor> {
        let value = param.value()?;
        let layout = Layout {
            dtype: self.data.dtype(),
            ..layout.clone()
        };
        let shape = layout.local_shape(value.mesh().coordinate())?;
        let local = match &self.device {
            // A host copy: the state stays the optimizer's alone (updated in place).
            Some(t) => t.to(tessera_tensor::Device::Cpu)?.reshape(&shape)?,
            None => Tensor::from_buffer(self.data.clone(), &shape)?,
        };
        Ok(DTensor::from_local_with_layout(local, value.mesh(), layout)?)
    }

    /// A state vector from a DTensor laid out as `param` is now (any float dtype).
    ///
    /// # Errors
    /// Another layout than the parameter's, or a non-float dtype.
    pub(crate) fn from_dtensor(op: &'static str, param: &Param, name: &str, t: &DTensor) -> Result<StateVec> {
        // The parameter's layout and device, not its value: a deferred
        // parameter (loaded from the same checkpoint) has none yet.
        let layout = param.layout();
        if !same_placement(t.layout(), &layout) || !t.dtype().is_float() {
            return Err(Error::Config {
                op,
                detail: format!(
                    "the {name} state of {} is {} {}; the parameter is {} (load state in its layout, a float dtype)",
                    param.name(),
                    t.layout(),
                    t.dtype(),
                    layout
                ),
            });
        }
        let device = param.mesh().device();
        if device.is_cuda() {
            let flat = t.to_local().reshape(&[t.to_local().numel()])?.to(device)?;
            // A copy the optimizer holds alone (the loaded tensor may be shared).
            let own = Tensor::assemble(flat.shape(), flat.dtype(), device, &[(&[0][..], &flat)])?;
            own.set_memory_category(Category::OptimizerState);
            return Ok(StateVec {
                data: Buffer::zeros(own.dtype(), 0),
                device: Some(own),
                _charge: Allocation::charge(0),
            });
        }
        let data = t.to_local().to_buffer();
        let bytes = data.len() * data.dtype().size_in_bytes();
        Ok(StateVec {
            data,
            device: None,
            _charge: Allocation::charge_as(bytes, Category::OptimizerState),
        })
    }

    pub(crate) fn dtype(&self) -> DType {
        self.device.as_ref().map_or(self.data.dtype(), Tensor::dtype)
    }

    pub(crate) fn zeros(dtype: DType, len: usize) -> StateVec {
        StateVec {
            data: Buffer::zeros(dtype, len),
            device: None,
            _charge: Allocation::charge_as(len * dtype.size_in_bytes(), Category::OptimizerState),
        }
    }

    /// Zeros on `device` (the host's [`zeros`](Self::zeros) for the CPU; a
    /// device tensor, charged to the rank's device bytes, for a GPU; a meta
    /// tensor, charged as host bytes, for a planning run).
    pub(crate) fn zeros_on(dtype: DType, len: usize, device: tessera_tensor::Device) -> Result<StateVec> {
        if device == tessera_tensor::Device::Cpu {
            return Ok(StateVec::zeros(dtype, len));
        }
        let state = Tensor::assemble(&[len], dtype, device, &[])?;
        state.set_memory_category(Category::OptimizerState);
        Ok(StateVec {
            data: Buffer::zeros(dtype, 0),
            device: Some(state),
            _charge: Allocation::charge(0),
        })
    }

    /// The state's device tensor, when it lives on a GPU.
    #[cfg(feature = "cuda")]
    pub(crate) fn device_mut(&mut self) -> Option<&mut Tensor> {
        self.device.as_mut()
    }

    /// The elements as `F`.
    ///
    /// # Errors
    /// `F` is not the dtype the state was created with (the parameter changed dtype).
    pub(crate) fn get<F: Real>(&mut self, op: &'static str, name: &str) -> Result<&mut [F]> {
        let dtype = self.data.dtype();
        typed_mut::<F>(&mut self.data).ok_or_else(|| Error::Config {
            op,
            detail: format!(
                "the state of {name} is {dtype} but the parameter now computes in {}; \
                 parameters must keep their dtype across steps (build a new optimizer)",
                F::DTYPE
            ),
        })
    }
}

/// Checks that the layout a parameter's state was built for is still its layout.
pub(crate) fn check_state_layout(op: &'static str, name: &str, state: &Layout, now: &Layout) -> Result<()> {
    if same_placement(state, now) {
        Ok(())
    } else {
        Err(Error::Config {
            op,
            detail: format!(
                "parameter {name} is now {now} but its optimizer state was built for {state}; \
                 the state is per local shard, so keep the parameter's placements between steps \
                 (or build the optimizer after sharding)"
            ),
        })
    }
}

/// Rejects the same parameter listed twice (its update would run twice).
pub(crate) fn check_unique(op: &'static str, params: &[Param]) -> Result<()> {
    for (i, p) in params.iter().enumerate() {
        if params[..i].iter().any(|q| q.id() == p.id()) {
            return Err(Error::Config {
                op,
                detail: format!("parameter {} is listed twice; list each parameter once", p.name()),
            });
        }
    }
    Ok(())
}

/// Checks a hyperparameter against a range (`what` names it in the error).
pub(crate) fn check_range(op: &'static str, what: &str, x: f64, ok: bool, want: &str) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(Error::Config {
            op,
            detail: format!("{what} is {x}, it must be {want}"),
        })
    }
}

/// Runs `f` on a one-rank mesh (the threads backend) and returns its result.
#[cfg(test)]
pub(crate) fn on_one_rank<T: Send + 'static>(
    f: impl Fn(&tessera_mesh::DeviceMesh) -> Result<T> + Send + Sync + 'static,
) -> T {
    let mut out = tessera_mesh::launch(1, move |ctx| {
        let mesh = tessera_mesh::DeviceMesh::new(ctx.into_comm(), &[1])?;
        Ok(f(&mesh)?)
    })
    .unwrap();
    out.remove(0)
}
