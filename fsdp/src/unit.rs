//! One communication unit: the parameters a `fully_shard` call owns, their flat
//! buckets, and what runs around the unit's forward and backward.

use std::cell::{Cell, RefCell};
use std::rc::{Rc, Weak};

use smallvec::smallvec;
use tessera_autograd::nn::ModuleHooks;
use tessera_autograd::{Error, Param, Result, Slot, Var, is_grad_enabled, queue_callback};
use tessera_dtensor::memory::Allocation;
use tessera_dtensor::{DTensor, Placement, Tensor};
use tessera_mesh::{Communicator, DType, DeviceMesh, ReduceOp, Work};

use crate::MixedPrecisionPolicy;
use crate::runtime;

/// A parameter of a unit and where its shard sits in the unit's flat bucket.
pub(crate) struct FsdpParam {
    pub(crate) param: Param,
    /// Global shape.
    pub(crate) shape: Vec<usize>,
    /// `shape[0]`.
    pub(crate) rows: usize,
    /// Elements per row (`shape[1..]`'s product).
    pub(crate) row_numel: usize,
    /// Rows of every rank's padded shard (`ceil(rows / world)`, torch.chunk's size).
    pub(crate) chunk_rows: usize,
    /// Rows this rank holds (fewer than `chunk_rows` on the last ranks when uneven).
    pub(crate) local_rows: usize,
    /// Element offset of this parameter's padded shard in a rank's bucket.
    pub(crate) offset: usize,
    /// Holds the unsharded value while the unit is unsharded.
    pub(crate) slot: Rc<Slot>,
}

impl FsdpParam {
    fn padded_numel(&self) -> usize {
        self.chunk_rows * self.row_numel
    }
}

/// An all-gather in flight (or, on a one-rank shard group, already local).
enum Gathering {
    Local(Tensor),
    Comm { work: Work, _charge: Allocation },
}

/// Where a unit's parameters are.
enum State {
    Sharded,
    Gathering(Gathering),
    Unsharded,
}

/// Gradients of the unsharded parameters gathered during the unit's backward.
#[derive(Default)]
struct Grads {
    /// Per parameter: this backward's gradient (this rank's contribution to the
    /// sum over the data-parallel ranks), in the reduce dtype.
    pending: Vec<Option<Tensor>>,
    /// Per parameter: gradients accumulated while gradient sync is off.
    unsynced: Vec<Option<Tensor>>,
    /// Gradients expected this backward (one per trainable parameter per forward call).
    expected: usize,
    arrived: usize,
}

/// A reduction in flight: reduce-scatter, then (HSDP) all-reduce, then accumulate.
pub(crate) struct Reduction {
    unit: Rc<Unit>,
    stage: Stage,
    has_grad: Vec<bool>,
}

enum Stage {
    /// Reduce-scattered already (a one-rank shard group): the rank's flat shard.
    Scattered(Tensor),
    Scatter(Work, Allocation),
    AllReduce(Work, Allocation),
}

/// The unit behind an [`FsdpModule`](crate::FsdpModule).
pub(crate) struct Unit {
    /// For messages: the first parameter's name.
    pub(crate) label: String,
    pub(crate) params: Vec<FsdpParam>,
    pub(crate) mesh: DeviceMesh,
    pub(crate) shard_dim: usize,
    pub(crate) replicate_dim: Option<usize>,
    pub(crate) world: usize,
    /// Elements of one rank's padded bucket.
    pub(crate) bucket_len: usize,
    /// The parameters' own dtype (the master dtype).
    pub(crate) dtype: DType,
    /// Placements of the sharded parameters.
    pub(crate) placements: Vec<Placement>,
    pub(crate) children: Vec<Weak<Unit>>,
    pub(crate) reshard_after_forward: Cell<Option<bool>>,
    pub(crate) mp: MixedPrecisionPolicy,
    pub(crate) grad_sync: Cell<bool>,
    pub(crate) is_root: Cell<bool>,
    /// The current forward is a recomputation during backward (checkpointing).
    recomputing: Cell<bool>,
    pub(crate) forward_prefetch: RefCell<Option<Vec<Weak<Unit>>>>,
    pub(crate) backward_prefetch: RefCell<Option<Vec<Weak<Unit>>>>,
    state: RefCell<State>,
    grads: RefCell<Grads>,
    /// The local shards the current forward gathered (to catch updates between
    /// forward and backward).
    forward_shards: RefCell<Vec<Tensor>>,
    /// The local shards the unsharded values were gathered from (a unit left
    /// unsharded gathers again when they changed since).
    gathered_from: RefCell<Vec<Tensor>>,
    pub(crate) me: Weak<Unit>,
}

/// Whether `a` and `b` are the same elements of the same storage.
fn same_tensor(a: &Tensor, b: &Tensor) -> bool {
    a.shares_storage(b) && a.storage_offset() == b.storage_offset() && a.shape() == b.shape()
}

fn config(detail: String) -> Error {
    Error::Config { op: "fsdp", detail }
}

impl Unit {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        params: Vec<FsdpParam>,
        mesh: DeviceMesh,
        shard_dim: usize,
        replicate_dim: Option<usize>,
        dtype: DType,
        placements: Vec<Placement>,
        children: Vec<Weak<Unit>>,
        reshard_after_forward: Option<bool>,
        mp: MixedPrecisionPolicy,
        label: String,
    ) -> Rc<Unit> {
        let world = mesh.shape()[shard_dim];
        let bucket_len = params.iter().map(FsdpParam::padded_numel).sum();
        let n = params.len();
        Rc::new_cyclic(|me| Unit {
            label,
            params,
            mesh,
            shard_dim,
            replicate_dim,
            world,
            bucket_len,
            dtype,
            placements,
            children,
            reshard_after_forward: Cell::new(reshard_after_forward),
            mp,
            grad_sync: Cell::new(true),
            is_root: Cell::new(false),
            recomputing: Cell::new(false),
            forward_prefetch: RefCell::new(None),
            backward_prefetch: RefCell::new(None),
            state: RefCell::new(State::Sharded),
            grads: RefCell::new(Grads {
                pending: vec![None; n],
                unsynced: vec![None; n],
                expected: 0,
                arrived: 0,
            }),
            forward_shards: RefCell::new(Vec::new()),
            gathered_from: RefCell::new(Vec::new()),
            me: me.clone(),
        })
    }

    fn rc(&self) -> Rc<Unit> {
        self.me.upgrade().expect("a unit is alive while its methods run")
    }

    /// The dtype of the all-gather and of the unsharded parameters.
    pub(crate) fn gather_dtype(&self) -> DType {
        self.mp.param_dtype.unwrap_or(self.dtype)
    }

    /// The dtype gradients are reduced in.
    pub(crate) fn reduce_dtype(&self) -> DType {
        self.mp.reduce_dtype.unwrap_or(self.gather_dtype())
    }

    fn shard_comm(&self) -> Result<&dyn Communicator> {
        Ok(self.mesh.dim_comm(self.shard_dim)?)
    }

    /// The replicate dim's communicator, when it has more than one rank.
    fn replicate_comm(&self) -> Result<Option<&dyn Communicator>> {
        match self.replicate_dim {
            Some(d) if self.mesh.shape()[d] > 1 => Ok(Some(self.mesh.dim_comm(d)?)),
            _ => Ok(None),
        }
    }

    pub(crate) fn is_unsharded(&self) -> bool {
        matches!(*self.state.borrow(), State::Unsharded)
    }

    pub(crate) fn resolved_reshard_after_forward(&self) -> bool {
        self.reshard_after_forward.get().unwrap_or(!self.is_root.get())
    }

    // ----- all-gather -------------------------------------------------------

    /// Copy-in: this rank's shards, cast to the gather dtype and padded to equal
    /// length, as one flat tensor `[bucket_len]`.
    fn copy_in(&self) -> Result<Tensor> {
        let dt = self.gather_dtype();
        let mut pieces = Vec::with_capacity(2 * self.params.len());
        let mut from = self.gathered_from.borrow_mut();
        from.clear();
        for p in &self.params {
            let shard = p.param.value().to_local().clone();
            let local = shard.cast(dt)?;
            from.push(shard);
            pieces.push(local.contiguous().reshape(&[p.local_rows * p.row_numel])?);
            let pad = (p.chunk_rows - p.local_rows) * p.row_numel;
            if pad > 0 {
                pieces.push(Tensor::zeros(&[pad], dt)?);
            }
        }
        Ok(Tensor::cat(&pieces, 0)?)
    }

    /// Issues the all-gather of the flat bucket (asynchronously).
    fn issue_gather(&self) -> Result<Gathering> {
        let send = self.copy_in()?;
        if self.world == 1 {
            return Ok(Gathering::Local(send));
        }
        let bytes = self.world * self.bucket_len * self.gather_dtype().size_in_bytes();
        let charge = Allocation::charge(bytes);
        let work = self.shard_comm()?.all_gather_async(send.into_buffer());
        Ok(Gathering::Comm { work, _charge: charge })
    }

    /// Copy-out: waits for the gather and fills every parameter's slot with its
    /// unsharded (replicated) value.
    fn finish_gather(&self, g: Gathering) -> Result<()> {
        let gathered = match g {
            Gathering::Local(t) => t.reshape(&[1, self.bucket_len])?,
            Gathering::Comm { work, _charge } => {
                let buf = work.wait()?;
                Tensor::from_buffer(buf, &[self.world, self.bucket_len])?
            }
        };
        let replicated = vec![Placement::Replicate; self.mesh.ndim()];
        for p in &self.params {
            let block = gathered.narrow(1, p.offset, p.padded_numel())?;
            let block = if self.world == 1 { block } else { block.contiguous() };
            let full = block
                .reshape(&[self.world * p.padded_numel()])?
                .narrow(0, 0, p.rows * p.row_numel)?
                .reshape(&p.shape)?;
            p.slot
                .fill(DTensor::from_local(full, &self.mesh, &replicated, &p.shape)?);
        }
        *self.state.borrow_mut() = State::Unsharded;
        Ok(())
    }

    /// Gathers the parameters now (waiting for a prefetch in flight).
    pub(crate) fn unshard(&self) -> Result<()> {
        if self.params.is_empty() {
            return Ok(());
        }
        let state = std::mem::replace(&mut *self.state.borrow_mut(), State::Sharded);
        match state {
            State::Unsharded if self.shards_unchanged(&self.gathered_from.borrow()) => {
                *self.state.borrow_mut() = State::Unsharded;
                Ok(())
            }
            State::Unsharded => {
                // Updated (an optimizer step) since they were gathered: gather again.
                let g = self.issue_gather()?;
                self.finish_gather(g)
            }
            State::Gathering(g) => self.finish_gather(g),
            State::Sharded => {
                let g = self.issue_gather()?;
                self.finish_gather(g)
            }
        }
    }

    /// Issues the all-gather without waiting (no-op unless sharded).
    pub(crate) fn prefetch(&self) -> Result<()> {
        if self.params.is_empty() || !matches!(*self.state.borrow(), State::Sharded) {
            return Ok(());
        }
        let g = self.issue_gather()?;
        *self.state.borrow_mut() = State::Gathering(g);
        Ok(())
    }

    /// Frees the unsharded parameters (waiting for a gather in flight first, so
    /// every rank's collectives stay in step).
    pub(crate) fn reshard(&self) -> Result<()> {
        let state = std::mem::replace(&mut *self.state.borrow_mut(), State::Sharded);
        if let State::Gathering(Gathering::Comm { work, .. }) = state {
            work.wait()?;
        }
        for p in &self.params {
            p.slot.free();
        }
        self.gathered_from.borrow_mut().clear();
        Ok(())
    }

    // ----- forward ----------------------------------------------------------

    fn set_stand_ins(&self) -> Result<()> {
        let grad = is_grad_enabled();
        let mut shards = self.forward_shards.borrow_mut();
        shards.clear();
        let mut expected = 0;
        for (i, p) in self.params.iter().enumerate() {
            let value = p.slot.get()?;
            let var = if grad && p.param.requires_grad() {
                expected += 1;
                let me = self.me.clone();
                Var::with_grad_hook("fsdp_unshard", value, move |g| match me.upgrade() {
                    Some(u) => u.on_grad(i, g),
                    None => Ok(()),
                })
            } else {
                Var::constant(value)
            };
            p.param.set_stand_in(Some(var.with_slot(p.slot.clone())));
            if grad {
                shards.push(p.param.value().to_local().clone());
            }
        }
        let mut gs = self.grads.borrow_mut();
        if self.recomputing.get() {
            // The checkpointed forward's own nodes were dropped with its frame:
            // only this recomputation's gradients will arrive.
            gs.expected = gs.arrived + expected;
        } else {
            gs.expected += expected;
        }
        Ok(())
    }

    fn clear_stand_ins(&self) {
        for p in &self.params {
            p.param.set_stand_in(None);
        }
    }

    fn pre_forward_impl(&self, x: &Var) -> Result<Var> {
        let me = self.rc();
        let next = match runtime::enter_forward(&me) {
            runtime::Entry::Forward(next) => next,
            runtime::Entry::Recompute => {
                self.recomputing.set(true);
                None
            }
        };
        let r = self.prepare_forward(next, x);
        if r.is_err() {
            self.clear_stand_ins();
            self.recomputing.set(false);
            runtime::abandon_forward();
        }
        r
    }

    /// Pre-forward after the runtime recorded it: gather, prefetch, stand-ins, input cast.
    fn prepare_forward(&self, next: Option<Rc<Unit>>, x: &Var) -> Result<Var> {
        self.unshard()?;
        let targets = match &*self.forward_prefetch.borrow() {
            Some(list) => list.iter().filter_map(Weak::upgrade).collect(),
            None => next.into_iter().collect::<Vec<_>>(),
        };
        for t in targets {
            t.prefetch()?;
        }
        self.set_stand_ins()?;
        match self.mp.param_dtype {
            Some(dt) if self.mp.cast_forward_inputs && x.value().dtype().is_float() => x.cast(dt),
            _ => Ok(x.clone()),
        }
    }

    fn post_forward_impl(&self, out: Var) -> Result<Var> {
        self.clear_stand_ins();
        let recompute = self.recomputing.replace(false);
        runtime::leave_forward(&self.rc(), recompute);
        // A recomputation's backward follows at once: keep the parameters.
        if !recompute && self.resolved_reshard_after_forward() {
            self.reshard()?;
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
        match self.mp.output_dtype {
            Some(dt) if out.value().dtype().is_float() => out.cast(dt),
            _ => Ok(out),
        }
    }

    // ----- backward ---------------------------------------------------------

    fn pre_backward(&self) -> Result<()> {
        if runtime::start_backward() {
            queue_callback(runtime::finish_backward);
        }
        self.check_unchanged()?;
        self.unshard()?;
        let targets = match &*self.backward_prefetch.borrow() {
            Some(list) => list.iter().filter_map(Weak::upgrade).collect(),
            None => runtime::next_in_backward(self).into_iter().collect::<Vec<_>>(),
        };
        for t in targets {
            t.prefetch()?;
        }
        Ok(())
    }

    /// Errors when a parameter's shard changed since forward gathered it.
    fn check_unchanged(&self) -> Result<()> {
        let shards = self.forward_shards.borrow();
        for (p, s) in self.params.iter().zip(shards.iter()) {
            if !same_tensor(p.param.value().to_local(), s) {
                return Err(config(format!(
                    "parameter {} changed between its unit's forward and backward (an optimizer step or \
                     set_value in between?); its gradient would be computed against other values",
                    p.param.name()
                )));
            }
        }
        Ok(())
    }

    /// Whether every parameter still holds the local shard recorded in `shards`.
    fn shards_unchanged(&self, shards: &[Tensor]) -> bool {
        shards.len() == self.params.len()
            && self
                .params
                .iter()
                .zip(shards)
                .all(|(p, s)| same_tensor(p.param.value().to_local(), s))
    }

    /// This rank's contribution to the sum over data-parallel ranks of an
    /// unsharded gradient, as a full-shape local tensor in the reduce dtype.
    fn contribution(&self, i: usize, g: &DTensor) -> Result<Tensor> {
        let p = &self.params[i];
        if g.shape() != &p.shape[..] {
            return Err(config(format!(
                "the gradient of {} has shape {:?}, the parameter {:?}",
                p.param.name(),
                g.shape(),
                p.shape
            )));
        }
        let summable = g
            .placements()
            .iter()
            .all(|pl| pl.is_replicate() || pl.reduce_op() == Some(ReduceOp::Sum));
        let g = if summable {
            g.clone()
        } else {
            g.redistribute(&vec![Placement::Replicate; self.mesh.ndim()])?
        };
        let coord = self.mesh.coordinate();
        // A replicated dim holds the same value on every coordinate: only
        // coordinate 0 contributes it, so the sum counts it once.
        let duplicate = g
            .placements()
            .iter()
            .enumerate()
            .any(|(d, pl)| pl.is_replicate() && coord[d] != 0);
        let dt = self.reduce_dtype();
        if duplicate {
            Ok(Tensor::zeros(&p.shape, dt)?)
        } else {
            Ok(g.to_local().cast(dt)?)
        }
    }

    fn on_grad(&self, i: usize, g: &DTensor) -> Result<()> {
        let c = self.contribution(i, g)?;
        let done = {
            let mut gs = self.grads.borrow_mut();
            let slot = if self.grad_sync.get() {
                &mut gs.pending[i]
            } else {
                &mut gs.unsynced[i]
            };
            *slot = Some(match slot.take() {
                Some(prev) => prev.add(&c)?,
                None => c,
            });
            gs.arrived += 1;
            gs.arrived >= gs.expected
        };
        if done { self.post_backward() } else { Ok(()) }
    }

    /// After the unit's backward: reduce its gradients (unless sync is off) and
    /// reshard.
    pub(crate) fn post_backward(&self) -> Result<()> {
        let reduce = {
            let mut gs = self.grads.borrow_mut();
            gs.expected = 0;
            gs.arrived = 0;
            if self.grad_sync.get() {
                for i in 0..gs.pending.len() {
                    if let Some(u) = gs.unsynced[i].take() {
                        gs.pending[i] = Some(match gs.pending[i].take() {
                            Some(p) => p.add(&u)?,
                            None => u,
                        });
                    }
                }
                gs.pending.iter().any(Option::is_some)
            } else {
                false
            }
        };
        self.forward_shards.borrow_mut().clear();
        let r = if reduce { self.reduce() } else { Ok(()) };
        self.reshard()?;
        r
    }

    /// Whether gradients of this backward arrived and wait for the unit's post-backward.
    pub(crate) fn has_arrivals(&self) -> bool {
        self.grads.borrow().arrived > 0
    }

    /// Forgets the gradients expected from forwards that were never backpropagated.
    pub(crate) fn forget_expected(&self) {
        let mut gs = self.grads.borrow_mut();
        gs.expected = 0;
        gs.arrived = 0;
    }

    // ----- reduce-scatter ---------------------------------------------------

    /// Copy-in of the gradient bucket `[world, bucket_len]` (rank-major, each
    /// parameter padded to its chunk rows) and the reduce-scatter, issued
    /// asynchronously.
    fn reduce(&self) -> Result<()> {
        let dt = self.reduce_dtype();
        let pending = std::mem::replace(&mut self.grads.borrow_mut().pending, vec![None; self.params.len()]);
        let has_grad: Vec<bool> = pending.iter().map(Option::is_some).collect();
        let mut cols = Vec::with_capacity(self.params.len());
        for (p, g) in self.params.iter().zip(pending) {
            let total = self.world * p.chunk_rows;
            let flat = match g {
                Some(g) => {
                    let g = g.contiguous().reshape(&[p.rows * p.row_numel])?;
                    if total > p.rows {
                        Tensor::cat(&[g, Tensor::zeros(&[(total - p.rows) * p.row_numel], dt)?], 0)?
                    } else {
                        g
                    }
                }
                None => Tensor::zeros(&[total * p.row_numel], dt)?,
            };
            cols.push(flat.reshape(&[self.world, p.padded_numel()])?);
        }
        let bucket = Tensor::cat(&cols, 1)?;
        drop(cols);
        let stage = if self.world == 1 {
            Stage::Scattered(bucket.reshape(&[self.bucket_len])?)
        } else {
            let charge = Allocation::charge(bucket.size_in_bytes() * (self.world + 1) / self.world);
            let work = self
                .shard_comm()?
                .reduce_scatter_async(bucket.into_buffer(), ReduceOp::Sum);
            Stage::Scatter(work, charge)
        };
        runtime::push_reduction(Reduction {
            unit: self.rc(),
            stage,
            has_grad,
        })
    }

    /// Sharded gradients from the reduced flat shard `[bucket_len]`, accumulated
    /// into the parameters' gradients.
    fn accumulate(&self, flat: Tensor, has_grad: &[bool]) -> Result<()> {
        for (p, &has) in self.params.iter().zip(has_grad) {
            if !has {
                continue;
            }
            let mut shape = p.shape.clone();
            shape[0] = p.local_rows;
            let local = flat
                .narrow(0, p.offset, p.local_rows * p.row_numel)?
                .reshape(&shape)?
                .cast(self.dtype)?;
            let g = DTensor::from_local(local, &self.mesh, &self.placements, &p.shape)?;
            let sum = match p.param.grad() {
                Some(prev) if prev.placements() == g.placements() => prev.add(&g)?,
                Some(prev) => {
                    return Err(config(format!(
                        "parameter {} holds a gradient placed {:?}; FSDP accumulates {:?}",
                        p.param.name(),
                        prev.placements(),
                        g.placements()
                    )));
                }
                None => g,
            };
            p.param.set_grad(Some(sum));
        }
        Ok(())
    }
}

impl Reduction {
    /// Moves the reduction one stage on (waiting for the current one); `None`
    /// once the gradients are accumulated.
    pub(crate) fn advance(self) -> Result<Option<Reduction>> {
        let Reduction { unit, stage, has_grad } = self;
        let flat = match stage {
            Stage::Scattered(t) => t,
            Stage::Scatter(work, _charge) => Tensor::from_buffer(work.wait()?, &[unit.bucket_len])?,
            Stage::AllReduce(work, _charge) => {
                let t = Tensor::from_buffer(work.wait()?, &[unit.bucket_len])?;
                unit.accumulate(t, &has_grad)?;
                return Ok(None);
            }
        };
        match unit.replicate_comm()? {
            Some(comm) => {
                let charge = Allocation::charge(flat.size_in_bytes());
                let work = comm.all_reduce_async(flat.into_buffer(), ReduceOp::Sum);
                Ok(Some(Reduction {
                    stage: Stage::AllReduce(work, charge),
                    unit,
                    has_grad,
                }))
            }
            None => {
                unit.accumulate(flat, &has_grad)?;
                Ok(None)
            }
        }
    }
}

impl ModuleHooks for Unit {
    fn pre_forward(&self, input: &Var) -> Result<Var> {
        self.pre_forward_impl(input)
    }

    fn post_forward(&self, output: Var) -> Result<Var> {
        self.post_forward_impl(output)
    }

    fn forward_failed(&self) {
        self.clear_stand_ins();
        self.recomputing.set(false);
        runtime::abandon_forward();
    }
}
