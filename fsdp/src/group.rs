//! The parameter group of one unit: unshard (one bucket all-gather), reshard,
//! and reduce (one bucket reduce-scatter, plus an all-reduce over the replicate
//! dim for HSDP). Passive: the hooks in [`crate::state`] decide when.
//!
//! The group adds no gradient semantics: a gradient arrives as a DTensor in
//! whatever placements backward gave it, is placed `Partial(sum)` on the
//! data-parallel dims by `redistribute` ([`FsdpParam::contribution`]), reduced by
//! the bucket collectives (Partial → Shard, Partial → Replicate), and added to
//! the parameter by [`Param::accumulate`].
//!
//! PyTorch: `_fsdp_param_group.py` (`FSDPParamGroup`).

use std::cell::{Cell, RefCell};
use std::rc::Rc;

use tessera_autograd::{Binding, Param, is_grad_enabled};
use tessera_dtensor::bucket::{BucketWork, all_gather_bucket, all_reduce_bucket, reduce_scatter_bucket};
use tessera_dtensor::{DTensor, Tensor};
use tessera_mesh::{DType, DeviceMesh};
use tessera_tensor::memory::Category;

use crate::config::MixedPrecisionPolicy;
use crate::error::{Error, Result};
use crate::overlap::CommOverlap;
use crate::param::{DpDims, FsdpParam, Regroup};

/// Where a group's parameters are.
enum State {
    Sharded,
    /// (Boxed: a gather in flight is far larger than the other states.)
    Gathering(Box<Gather>),
    Unsharded,
    /// Resharded after forward to smaller groups: the pieces on the regrouped mesh.
    Regrouped(Vec<DTensor>),
}

/// Where a unit's parameters are ([`FsdpModule::gather_state`](crate::FsdpModule::gather_state)).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GatherState {
    /// Only the shards exist.
    Sharded,
    /// An all-gather was issued (a prefetch) and not yet waited for.
    Gathering,
    /// The unsharded parameters exist.
    Unsharded,
    /// Resharded after forward to smaller groups
    /// ([`FsdpConfig::reshard_after_forward_to`](crate::FsdpConfig::reshard_after_forward_to)):
    /// backward gathers within them.
    Regrouped,
}

/// An all-gather in flight, or (a replicated group) the values themselves.
enum Gather {
    Work(BucketWork),
    Ready(Vec<DTensor>),
    /// Within the smaller groups: the results live on the regrouped mesh.
    Regrouped(BucketWork),
}

/// Gradients of the unsharded parameters gathered during the unit's backward,
/// each this rank's contribution (`Partial(sum)` on the data-parallel dims) in
/// the reduce dtype.
#[derive(Default)]
struct Grads {
    /// Per parameter: this backward's gradient.
    pending: Vec<Option<DTensor>>,
    /// Per parameter: gradients accumulated while gradient sync is off.
    unsynced: Vec<Option<DTensor>>,
    /// Gradients expected this backward (one per trainable parameter per forward call).
    expected: usize,
    arrived: usize,
}

/// A callback for the gradient of parameter `i`'s bound unsharded value.
pub(crate) type GradHook = Box<dyn FnOnce(&DTensor) -> Result<()>>;

/// The parameters of one unit and their communication.
pub(crate) struct ParamGroup {
    pub(crate) params: Vec<FsdpParam>,
    /// The parameters' mesh.
    pub(crate) mesh: DeviceMesh,
    pub(crate) dims: DpDims,
    /// The parameters' own dtype (the master dtype).
    pub(crate) dtype: DType,
    pub(crate) mp: MixedPrecisionPolicy,
    state: RefCell<State>,
    grads: RefCell<Grads>,
    /// The local shards the current forward gathered (to catch updates between
    /// forward and backward).
    forward_shards: RefCell<Vec<Tensor>>,
    /// The local shards the unsharded values were gathered from (a group left
    /// unsharded gathers again when they changed since).
    gathered_from: RefCell<Vec<Tensor>>,
    /// Per parameter: reduce-scattered gradients still partial over the replicate
    /// dim (HSDP with the all-reduce off), added in before the next all-reduce.
    unreduced: Rc<RefCell<Vec<Option<DTensor>>>>,
    /// Where to reshard after forward instead of the whole shard dim (hpZ).
    regroup: Option<Regroup>,
    /// The call-site tag of the unit's collectives, once computed ([`tag`](Self::tag)).
    tag: Cell<Option<u64>>,
    /// How long the unit's collectives ran and how long the rank waited for them.
    pub(crate) overlap: Rc<Cell<CommOverlap>>,
}

/// Whether `a` and `b` are the same elements of the same storage.
fn same_tensor(a: &Tensor, b: &Tensor) -> bool {
    a.shares_storage(b) && a.storage_offset() == b.storage_offset() && a.shape() == b.shape()
}

/// Keeps the gradients that arrived (`grads[k]` of parameter `index[k]`) in
/// `kept` for a later all-reduce.
fn keep(kept: &mut [Option<DTensor>], grads: Vec<DTensor>, index: &[usize], has_grad: &[bool]) -> Result<()> {
    for ((g, &i), &has) in grads.into_iter().zip(index).zip(has_grad) {
        if has {
            add_into(&mut kept[i], g)?;
        }
    }
    Ok(())
}

/// Adds the kept gradients into `grads` before their all-reduce (a parameter
/// with a kept gradient has one now).
fn fold_kept(
    kept: &mut [Option<DTensor>],
    grads: &mut [DTensor],
    index: &[usize],
    has_grad: &mut [bool],
) -> Result<()> {
    for ((g, &i), has) in grads.iter_mut().zip(index).zip(has_grad) {
        if let Some(prev) = kept[i].take() {
            *g = g.add(&prev)?;
            *has = true;
        }
    }
    Ok(())
}

/// Adds `g` to the gradient held in `slot` (or puts it there).
fn add_into(slot: &mut Option<DTensor>, g: DTensor) -> Result<()> {
    *slot = Some(match slot.take() {
        Some(prev) => prev.add(&g)?,
        None => g,
    });
    Ok(())
}

impl ParamGroup {
    pub(crate) fn new(
        params: Vec<FsdpParam>,
        mesh: DeviceMesh,
        dims: DpDims,
        dtype: DType,
        mp: MixedPrecisionPolicy,
    ) -> ParamGroup {
        let n = params.len();
        ParamGroup {
            params,
            mesh,
            dims,
            dtype,
            mp,
            state: RefCell::new(State::Sharded),
            grads: RefCell::new(Grads {
                pending: vec![None; n],
                unsynced: vec![None; n],
                expected: 0,
                arrived: 0,
            }),
            forward_shards: RefCell::new(Vec::new()),
            gathered_from: RefCell::new(Vec::new()),
            unreduced: Rc::new(RefCell::new(vec![None; n])),
            regroup: None,
            tag: Cell::new(None),
            overlap: Rc::default(),
        }
    }

    /// The call-site tag of this unit's collectives: its parameters' geometry
    /// ([`geometry_hash`](crate::agree::geometry_hash): a rank gathering another
    /// unit then fails on every rank). Computed at the first gather (names are
    /// settled by then) and kept: gathers are on every step's path.
    fn tag(&self) -> u64 {
        if let Some(tag) = self.tag.get() {
            return tag;
        }
        let params: Vec<Param> = self.params.iter().map(|p| p.param.clone()).collect();
        let tag = crate::agree::geometry_hash(&params);
        self.tag.set(Some(tag));
        tag
    }

    /// Reshards after forward to groups of `size` ranks of the shard dim.
    /// Collective over the parameters' mesh.
    pub(crate) fn regroup_after_forward(&mut self, size: usize) -> Result<()> {
        self.regroup = Some(Regroup::new(
            &self.mesh,
            self.dims,
            size,
            &self.params,
            self.gather_dtype(),
        )?);
        Ok(())
    }

    /// The dtype of the all-gather and of the unsharded parameters.
    pub(crate) fn gather_dtype(&self) -> DType {
        self.mp.param_dtype.unwrap_or(self.dtype)
    }

    /// The dtype gradients are reduced in.
    pub(crate) fn reduce_dtype(&self) -> DType {
        self.mp.reduce_dtype.unwrap_or(self.gather_dtype())
    }

    /// Ranks along the shard dim.
    pub(crate) fn shard_world(&self) -> usize {
        self.dims.shard.map_or(1, |d| self.mesh.shape()[d])
    }

    pub(crate) fn is_unsharded(&self) -> bool {
        matches!(*self.state.borrow(), State::Unsharded)
    }

    pub(crate) fn gather_state(&self) -> GatherState {
        match *self.state.borrow() {
            State::Sharded => GatherState::Sharded,
            State::Gathering(_) => GatherState::Gathering,
            State::Unsharded => GatherState::Unsharded,
            State::Regrouped(_) => GatherState::Regrouped,
        }
    }

    /// Elements of this rank's padded bucket (the all-gather's input).
    pub(crate) fn bucket_len(&self) -> Result<usize> {
        let world = self.shard_world();
        let coord = self.mesh.coordinate();
        let mut n = 0;
        for p in &self.params {
            let local = p.unsharded.local_shape(coord)?;
            let row: usize = local[1..].iter().product();
            n += local[0].div_ceil(world) * row;
        }
        Ok(n)
    }

    /// Elements of this rank's unsharded pieces (tensor parallelism's local shapes).
    pub(crate) fn unsharded_numel(&self) -> Result<usize> {
        let coord = self.mesh.coordinate();
        self.params.iter().map(|p| p.unsharded_local_numel(coord)).sum()
    }

    // ----- all-gather -------------------------------------------------------

    /// Issues the bucket all-gather of the shards (asynchronously); a replicated
    /// group only casts its values to the gather dtype.
    fn issue_gather(&self) -> Result<Gather> {
        let _site = tessera_mesh::callsite::enter().tag(self.tag());
        let mut from = self.gathered_from.borrow_mut();
        from.clear();
        let values: Vec<DTensor> = self.params.iter().map(|p| p.param.value()).collect::<Result<_, _>>()?;
        from.extend(values.iter().map(|v| v.to_local().clone()));
        let dt = self.gather_dtype();
        match self.dims.shard {
            Some(d) => Ok(Gather::Work(all_gather_bucket(&values, d, dt)?)),
            None => Ok(Gather::Ready(
                values
                    .into_iter()
                    .map(|v| if v.dtype() == dt { Ok(v) } else { v.cast(dt) })
                    .collect::<tessera_dtensor::Result<_>>()?,
            )),
        }
    }

    /// Waits for the gather and fills every parameter's slot with its unsharded value.
    fn finish_gather(&self, gather: Gather) -> Result<()> {
        let full = match gather {
            Gather::Work(work) => self.wait_gather(work)?,
            Gather::Ready(values) => values,
            Gather::Regrouped(work) => {
                // The same local tensors, back on the parameters' mesh.
                let dt = self.gather_dtype();
                self.wait_gather(work)?
                    .into_iter()
                    .zip(&self.params)
                    .map(|(v, p)| {
                        let layout = tessera_dtensor::Layout {
                            dtype: dt,
                            ..p.unsharded.clone()
                        };
                        DTensor::from_local_with_layout(v.to_local().clone(), &self.mesh, layout)
                    })
                    .collect::<tessera_dtensor::Result<_>>()?
            }
        };
        for (p, v) in self.params.iter().zip(full) {
            debug_assert_eq!(v.placements(), &p.unsharded.placements[..]);
            v.to_local().set_memory_category(Category::GatheredParameters);
            p.slot.fill(v);
        }
        *self.state.borrow_mut() = State::Unsharded;
        Ok(())
    }

    /// Waits for an all-gather of the unit's, counting its times.
    fn wait_gather(&self, work: BucketWork) -> Result<Vec<DTensor>> {
        let (out, timing) = work.wait_timed()?;
        update(&self.overlap, |o| o.all_gather.add(timing));
        Ok(out)
    }

    /// Gathers the parameters now (waiting for a prefetch in flight).
    pub(crate) fn unshard(&self) -> Result<()> {
        if self.params.is_empty() {
            return Ok(());
        }
        let _observed = tessera_mesh::observe::span(tessera_mesh::observe::What::Region("fsdp.unshard"));
        let state = std::mem::replace(&mut *self.state.borrow_mut(), State::Sharded);
        match state {
            State::Unsharded if self.shards_unchanged(&self.gathered_from.borrow()) => {
                *self.state.borrow_mut() = State::Unsharded;
                Ok(())
            }
            // Updated (an optimizer step) since they were gathered: gather again.
            State::Unsharded | State::Sharded => {
                let work = self.issue_gather()?;
                self.finish_gather(work)
            }
            State::Gathering(work) => self.finish_gather(*work),
            State::Regrouped(pieces) => {
                let work = self.issue_regrouped_gather(&pieces)?;
                self.finish_gather(work)
            }
        }
    }

    fn issue_regrouped_gather(&self, pieces: &[DTensor]) -> Result<Gather> {
        let r = self
            .regroup
            .as_ref()
            .ok_or_else(|| Error::mesh(&self.mesh, "the unit was regrouped without a regroup"))?;
        Ok(Gather::Regrouped(all_gather_bucket(
            pieces,
            r.inner,
            self.gather_dtype(),
        )?))
    }

    /// Issues the all-gather without waiting (no-op unless sharded or regrouped).
    pub(crate) fn prefetch(&self) -> Result<()> {
        if self.params.is_empty() {
            return Ok(());
        }
        let _observed = tessera_mesh::observe::span(tessera_mesh::observe::What::Region("fsdp.prefetch"));
        let state = std::mem::replace(&mut *self.state.borrow_mut(), State::Sharded);
        let next = match state {
            State::Sharded => State::Gathering(Box::new(self.issue_gather()?)),
            State::Regrouped(pieces) => State::Gathering(Box::new(self.issue_regrouped_gather(&pieces)?)),
            other => other,
        };
        *self.state.borrow_mut() = next;
        Ok(())
    }

    /// Reshards after forward: to the smaller groups when set (keeping this
    /// rank's piece of each unsharded parameter), else as [`reshard`](Self::reshard).
    pub(crate) fn reshard_after_forward(&self) -> Result<()> {
        let Some(r) = &self.regroup else {
            return self.reshard();
        };
        if !self.is_unsharded() {
            return self.reshard();
        }
        let pieces = self
            .params
            .iter()
            .enumerate()
            .map(|(i, p)| r.piece(i, &p.slot.get()?))
            .collect::<Result<Vec<_>>>()?;
        for piece in &pieces {
            piece.to_local().set_memory_category(Category::GatheredParameters);
        }
        for p in &self.params {
            p.slot.free();
        }
        *self.state.borrow_mut() = State::Regrouped(pieces);
        Ok(())
    }

    /// Frees the unsharded parameters (waiting for a gather in flight first, so
    /// every rank's collectives stay in step).
    pub(crate) fn reshard(&self) -> Result<()> {
        let _observed = tessera_mesh::observe::span(tessera_mesh::observe::What::Region("fsdp.reshard"));
        let state = std::mem::replace(&mut *self.state.borrow_mut(), State::Sharded);
        if let State::Gathering(gather) = state
            && let Gather::Work(work) | Gather::Regrouped(work) = *gather
        {
            self.wait_gather(work)?;
        }
        for p in &self.params {
            p.slot.free();
        }
        self.gathered_from.borrow_mut().clear();
        Ok(())
    }

    // ----- forward ----------------------------------------------------------

    /// Binds every parameter to its unsharded value for the forward (re-read
    /// from its slot in backward); trainable ones hand their gradient to `hook(i)`. `recomputing`: a
    /// recomputation during backward (activation checkpointing), whose own
    /// gradients replace those of the dropped forward.
    pub(crate) fn bind_unsharded(&self, recomputing: bool, hook: impl Fn(usize) -> GradHook) -> Result<()> {
        let grad = is_grad_enabled();
        let mut shards = self.forward_shards.borrow_mut();
        shards.clear();
        let mut expected = 0;
        for (i, p) in self.params.iter().enumerate() {
            let value = p.slot.get()?;
            let binding = if grad && p.param.requires_grad() {
                expected += 1;
                let hook = hook(i);
                Binding::new(value).grad_to("fsdp_unshard", move |g| Ok(hook(g)?))
            } else {
                Binding::new(value)
            };
            p.param.bind(Some(binding.saved_through(p.slot.clone())));
            if grad {
                shards.push(p.param.value()?.to_local().clone());
            }
        }
        let mut gs = self.grads.borrow_mut();
        if recomputing {
            gs.expected = gs.arrived + expected;
        } else {
            gs.expected += expected;
        }
        Ok(())
    }

    /// Unbinds every parameter (its `var()` is its own leaf again).
    pub(crate) fn unbind(&self) {
        for p in &self.params {
            p.param.bind(None);
        }
    }

    // ----- backward ---------------------------------------------------------

    /// Errors when a parameter's shard changed since forward gathered it.
    pub(crate) fn check_unchanged(&self) -> Result<()> {
        let shards = self.forward_shards.borrow();
        for (p, s) in self.params.iter().zip(shards.iter()) {
            if !same_tensor(p.param.value()?.to_local(), s) {
                return Err(Error::param(
                    &p.param.name(),
                    "changed between its unit's forward and backward (an optimizer step or set_value in \
                     between?); its gradient would be computed against other values",
                ));
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
                .all(|(p, s)| p.param.value().is_ok_and(|v| same_tensor(v.to_local(), s)))
    }

    /// Adds the gradient of parameter `i`'s unsharded value (kept for the next
    /// synchronized backward when `sync` is off); true once every expected
    /// gradient of this backward arrived.
    pub(crate) fn add_grad(&self, i: usize, g: &DTensor, sync: bool) -> Result<bool> {
        let c = self.params[i].contribution(g, self.dims, self.reduce_dtype())?;
        let mut gs = self.grads.borrow_mut();
        let slot = if sync { &mut gs.pending[i] } else { &mut gs.unsynced[i] };
        add_into(slot, c)?;
        if let Some(sum) = slot {
            sum.to_local().set_memory_category(Category::UnshardedGradients);
        }
        gs.arrived += 1;
        Ok(gs.arrived >= gs.expected)
    }

    /// Whether gradients of this backward arrived and wait for the post-backward.
    pub(crate) fn has_arrivals(&self) -> bool {
        self.grads.borrow().arrived > 0
    }

    /// Forgets the gradients expected from forwards that were never backpropagated.
    pub(crate) fn forget_expected(&self) {
        let mut gs = self.grads.borrow_mut();
        gs.expected = 0;
        gs.arrived = 0;
    }

    /// Ends the group's backward: with `sync`, folds the unsynchronized
    /// gradients in and issues the reduction (`None` when no gradient arrived).
    /// Without `all_reduce` an HSDP reduction stops after the reduce-scatter and
    /// keeps its result for the next one that all-reduces.
    pub(crate) fn finish_grads(&self, sync: bool, all_reduce: bool) -> Result<Option<Reduction>> {
        self.forget_expected();
        self.forward_shards.borrow_mut().clear();
        if !sync {
            return Ok(None);
        }
        let pending = {
            let mut gs = self.grads.borrow_mut();
            let n = self.params.len();
            let mut pending = std::mem::replace(&mut gs.pending, vec![None; n]);
            for (p, u) in pending.iter_mut().zip(gs.unsynced.iter_mut()) {
                if let Some(u) = u.take() {
                    add_into(p, u)?;
                }
            }
            pending
        };
        if pending.iter().all(Option::is_none) {
            return Ok(None);
        }
        self.reduce(pending, all_reduce)
    }

    /// Issues the bucket reduce-scatter of the gradients: every trainable
    /// parameter's contribution (zeros for one whose gradient did not arrive, so
    /// every rank packs the same bucket); frozen parameters stay out. A
    /// replicated group all-reduces instead (or keeps the contributions while
    /// the all-reduce is off).
    fn reduce(&self, pending: Vec<Option<DTensor>>, all_reduce: bool) -> Result<Option<Reduction>> {
        let _site = tessera_mesh::callsite::enter().tag(self.tag());
        let dt = self.reduce_dtype();
        let mut params = Vec::new();
        let mut index = Vec::new();
        let mut has_grad = Vec::new();
        let mut grads: Vec<DTensor> = Vec::new();
        for (i, (p, g)) in self.params.iter().zip(pending).enumerate() {
            if g.is_none() && !p.param.requires_grad() {
                continue;
            }
            index.push(i);
            has_grad.push(g.is_some());
            grads.push(match g {
                Some(g) => g,
                None => p.zero_contribution(&self.mesh, self.dims, dt)?,
            });
            params.push(p.param.clone());
        }
        let stage = match (self.dims.shard, self.dims.replicate) {
            (Some(d), _) => Stage::Scatter(reduce_scatter_bucket(&grads, d)?),
            (None, Some(r)) => {
                let mut kept = self.unreduced.borrow_mut();
                if !all_reduce {
                    keep(&mut kept, grads, &index, &has_grad)?;
                    return Ok(None);
                }
                fold_kept(&mut kept, &mut grads, &index, &mut has_grad)?;
                Stage::AllReduce(all_reduce_bucket(&grads, r)?)
            }
            (None, None) => {
                return Err(Error::mesh(
                    &self.mesh,
                    "a unit without a shard or a replicate dim has nothing to reduce over",
                ));
            }
        };
        Ok(Some(Reduction {
            stage,
            params,
            index,
            has_grad,
            replicate: self.dims.replicate,
            all_reduce,
            unreduced: self.unreduced.clone(),
            dtype: self.dtype,
            overlap: self.overlap.clone(),
        }))
    }
}

/// A reduction in flight: reduce-scatter, then (HSDP) all-reduce, then
/// accumulation into the parameters' gradients.
pub(crate) struct Reduction {
    stage: Stage,
    params: Vec<Param>,
    /// Each parameter's index in its group.
    index: Vec<usize>,
    has_grad: Vec<bool>,
    /// The replicate dim (HSDP).
    replicate: Option<usize>,
    /// Whether to all-reduce over the replicate dim (else keep the result in `unreduced`).
    all_reduce: bool,
    unreduced: Rc<RefCell<Vec<Option<DTensor>>>>,
    /// The master dtype.
    dtype: DType,
    /// The group's collective times.
    overlap: Rc<Cell<CommOverlap>>,
}

enum Stage {
    Scatter(BucketWork),
    AllReduce(BucketWork),
}

impl Reduction {
    /// Moves the reduction one stage on (waiting for the current one); `None`
    /// once the gradients are accumulated.
    pub(crate) fn advance(self) -> Result<Option<Reduction>> {
        let Reduction {
            stage,
            params,
            index,
            mut has_grad,
            replicate,
            all_reduce,
            unreduced,
            dtype,
            overlap,
        } = self;
        let reduced = match stage {
            Stage::Scatter(work) => {
                let (mut sharded, timing) = work.wait_timed()?;
                update(&overlap, |o| o.reduce_scatter.add(timing));
                if let Some(r) = replicate {
                    let mut kept = unreduced.borrow_mut();
                    if !all_reduce {
                        keep(&mut kept, sharded, &index, &has_grad)?;
                        return Ok(None);
                    }
                    fold_kept(&mut kept, &mut sharded, &index, &mut has_grad)?;
                    drop(kept);
                    return Ok(Some(Reduction {
                        stage: Stage::AllReduce(all_reduce_bucket(&sharded, r)?),
                        params,
                        index,
                        has_grad,
                        replicate,
                        all_reduce,
                        unreduced,
                        dtype,
                        overlap,
                    }));
                }
                sharded
            }
            Stage::AllReduce(work) => {
                let (reduced, timing) = work.wait_timed()?;
                update(&overlap, |o| o.all_reduce.add(timing));
                reduced
            }
        };
        for ((p, g), has) in params.iter().zip(reduced).zip(has_grad) {
            if has {
                p.accumulate(if g.dtype() == dtype { g } else { g.cast(dtype)? })?;
            }
        }
        Ok(None)
    }
}

/// Applies `f` to the times in `cell`.
fn update(cell: &Cell<CommOverlap>, f: impl FnOnce(&mut CommOverlap)) {
    let mut o = cell.get();
    f(&mut o);
    cell.set(o);
}
