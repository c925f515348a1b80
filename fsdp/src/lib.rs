//! Fully sharded data parallelism: [`fully_shard`] shards a module's parameters
//! over a data-parallel mesh dim and turns the module into one communication unit.
//!
//! ```
//! use tessera_autograd::nn::{Linear, Module};
//! use tessera_autograd::optim::{AdamW, AdamWConfig, Optimizer};
//! use tessera_autograd::{backward, Var};
//! use tessera_dtensor::{distribute_tensor, DType, Placement, Tensor};
//! use tessera_fsdp::{fully_shard, FsdpConfig};
//! use tessera_mesh::{launch, DeviceMesh};
//!
//! let losses = launch(2, |ctx| {
//!     let mesh = DeviceMesh::new(ctx.into_comm(), &[2])?;
//!     let layer = Linear::new("fc", 3, 5, true, &mesh, DType::F32, 0)?;
//!     let unit = fully_shard(&layer, &mesh, FsdpConfig::default())?;
//!     // Each rank now holds its rows of the weight: 3 of 5 on rank 0, 2 on rank 1.
//!     assert_eq!(layer.weight.value().placements(), &[Placement::Shard(0)]);
//!     let mut opt = AdamW::new(layer.parameters(), AdamWConfig::default())?;
//!     let x = Tensor::randn(&[4, 3], DType::F32, 7)?;
//!     let x = Var::constant(distribute_tensor(&x, &mesh, &[Placement::Shard(0)])?);
//!     // `call` runs the unit's hooks: one all-gather before forward, and in
//!     // backward one reduce-scatter of the gradients.
//!     let loss = layer.call(&x)?.square()?.mean(&[0, 1], false)?;
//!     backward(&loss)?;
//!     opt.step()?;
//!     assert!(!unit.is_unsharded());
//!     Ok(loss.value().full_tensor()?.to_f64_vec()[0])
//! })
//! .unwrap();
//! assert_eq!(losses[0], losses[1]);
//! ```
//!
//! As in PyTorch's FSDP2:
//!
//! - apply [`fully_shard`] bottom-up (each block, then the root, which takes the
//!   parameters no inner unit owns); models call submodules through
//!   [`Module::call`], which runs the units' hooks;
//! - each parameter becomes `Shard(0)` on the shard dim (`[Replicate, Shard(0)]`
//!   on a 2-D mesh: HSDP), its shard padded to `ceil(rows / world)` rows in the
//!   unit's flat bucket so every rank moves the same number of elements;
//! - over tensor parallelism (apply [`tp::parallelize_module`] first, then pass
//!   the data-parallel sub-mesh, `mesh.slice(&["dp"])`): parameters keep their
//!   placements on the other mesh dims and the shard dim splits the piece tensor
//!   parallelism left the rank; forward sees exactly the TP placements, and the
//!   unit's collectives run over the data-parallel dims on those pieces;
//! - per unit and step, one all-gather before forward (and again before backward
//!   when resharded after forward), one reduce-scatter of the gradient bucket after
//!   its backward, plus one all-reduce over the replicate dim for HSDP; on a
//!   one-rank shard dim there is no gather and no scatter, only the all-reduce
//!   (DDP);
//! - the next unit's all-gather is issued before the current unit computes, in
//!   forward order and reverse order in backward (or as set with
//!   [`FsdpModule::set_modules_to_forward_prefetch`] /
//!   [`FsdpModule::set_modules_to_backward_prefetch`]); reduce-scatters run on the
//!   communication thread while the previous unit's backward computes;
//! - the unsharded parameters live in [`Slot`](tessera_autograd::Slot)s that the
//!   tape reads in backward: they are freed after forward and refilled before
//!   backward, and reading a freed one is an error;
//! - [`MixedPrecisionPolicy`]: gathers and compute in `param_dtype`, gradient
//!   reduction in `reduce_dtype`, master shards and optimizer in the parameters'
//!   own dtype;
//! - gradients are the gradients of the global loss (DTensor semantics: a mean
//!   over the global batch), so the reductions are sums;
//! - [`replicate`] makes a unit that keeps its parameters replicated (NO_SHARD)
//!   and all-reduces its gradient bucket; [`FsdpConfig::ignored_params`] leaves
//!   parameters out of a unit; [`auto_wrap`] applies `fully_shard` to the
//!   modules a [`WrapPolicy`] picks (by type or parameter count), bottom-up;
//! - for gradient accumulation: [`FsdpModule::set_requires_gradient_sync`],
//!   [`FsdpModule::set_reshard_after_backward`] and (HSDP)
//!   [`FsdpModule::set_requires_all_reduce`].
#![deny(missing_docs)]

mod config;
mod group;
mod param;
mod state;
pub mod tp;
mod wrap;

use std::collections::HashSet;
use std::rc::{Rc, Weak};

use tessera_autograd::Param;
use tessera_autograd::nn::{Module, ModuleId, register_module_hooks};
use tessera_dtensor::Placement;
use tessera_mesh::{DType, DeviceMesh};

pub use config::{FsdpConfig, MixedPrecisionPolicy};
pub use tessera_autograd::{Error, Result};
pub use wrap::{WrapPolicy, auto_wrap};

use group::ParamGroup;
use param::{DpDims, FsdpParam};
use state::Unit;

pub(crate) fn config_error(detail: String) -> Error {
    Error::Config {
        op: "fully_shard",
        detail,
    }
}

/// Shards `module`'s parameters over the data-parallel mesh `mesh` and makes
/// the module one FSDP unit.
///
/// `mesh` is 1-D (FSDP) or 2-D (HSDP: `config.shard_dim`, by default dim 1,
/// shards and the other dim replicates). It is the parameters' mesh, or a
/// sub-mesh of it ([`DeviceMesh::slice`], [`DeviceMesh::dim`]) when the
/// parameters live on a larger mesh, as after tensor parallelism on a
/// `(dp, tp)` or `(dp_replicate, dp_shard, tp)` mesh. Parameters must be
/// replicated on the data-parallel dims; each gains `Shard(0)` on the shard dim
/// and keeps its placements on the others (tensor parallelism's), the shard dim
/// splitting the piece those left this rank. Parameters already owned by a unit
/// made from a submodule stay there.
///
/// PyTorch: `torch.distributed.fsdp.fully_shard`.
///
/// # Errors
/// A mesh with more than two dims or without the named shard dim; a mesh that is
/// not along dims of the parameters' mesh; a module already sharded, or sharing
/// a parameter with a unit that does not lie inside it; a parameter that is not
/// replicated on the data-parallel dims, lives on another mesh than the unit's
/// other parameters, is a scalar, or is not floating-point; parameters of
/// different dtypes in one unit.
pub fn fully_shard(module: &dyn Module, mesh: &DeviceMesh, config: FsdpConfig) -> Result<FsdpModule> {
    fully_shard_modules(&[module], mesh, config)
}

/// [`fully_shard`] of several modules as one unit: one all-gather before the
/// first of them runs, one reduce-scatter after their backward. The unit's
/// forward begins when the first of the modules is called and ends when the
/// last returns (each runs once per forward, one after another or nested).
/// For modules that always run together, as an embedding table and the
/// positional one.
///
/// PyTorch: `fully_shard([module_a, module_b], ...)`.
///
/// # Errors
/// No modules, and as [`fully_shard`].
pub fn fully_shard_modules(modules: &[&dyn Module], mesh: &DeviceMesh, config: FsdpConfig) -> Result<FsdpModule> {
    let (shard_dim, replicate_dim) = resolve_dims(mesh, config.shard_dim.as_deref())?;
    make_unit(modules, mesh, config, Some(shard_dim), replicate_dim)
}

/// Makes `module` one data-parallel unit whose parameters stay replicated over
/// the 1-D mesh `mesh` (NO_SHARD, DDP's layout): no all-gathers, and after the
/// unit's backward one all-reduce of its gradient bucket. Mixed precision,
/// gradient accumulation, prefetch-free scheduling and the other [`FsdpModule`]
/// controls work as for [`fully_shard`], and the two mix in one model.
///
/// PyTorch: `torch.distributed._composable.replicate`, FSDP's `NO_SHARD`.
///
/// # Errors
/// A mesh that is not 1-D, and as [`fully_shard`].
pub fn replicate(module: &dyn Module, mesh: &DeviceMesh, config: FsdpConfig) -> Result<FsdpModule> {
    if mesh.ndim() != 1 {
        return Err(config_error(format!(
            "replicate takes the 1-D data-parallel mesh, got {:?}",
            mesh.shape()
        )));
    }
    make_unit(&[module], mesh, config, None, Some(0))
}

/// The unit of `module` over the data-parallel `mesh`: `shard_dim` and
/// `replicate_dim` are dims of `mesh`.
fn make_unit(
    modules: &[&dyn Module],
    mesh: &DeviceMesh,
    config: FsdpConfig,
    shard_dim: Option<usize>,
    replicate_dim: Option<usize>,
) -> Result<FsdpModule> {
    if modules.is_empty() {
        return Err(config_error("no modules to shard".into()));
    }
    let mut all: Vec<Param> = Vec::new();
    let mut ids = HashSet::new();
    for module in modules {
        let mut mine = HashSet::new();
        for p in module.parameters() {
            if !mine.insert(p.id()) {
                return Err(config_error(format!(
                    "parameter {} appears twice in the module's parameters",
                    p.name()
                )));
            }
            // A parameter shared by two of the modules belongs to the unit once.
            if ids.insert(p.id()) && !config.ignored_params.iter().any(|n| n == p.name()) {
                all.push(p);
            }
        }
    }
    ids = all.iter().map(Param::id).collect();
    if all.is_empty() {
        return Err(config_error(
            "the module has no parameters (besides ignored ones)".into(),
        ));
    }
    // Units inside this module keep their parameters; a unit that shares only
    // some of its parameters with this module is an error.
    let mut children: Vec<Rc<Unit>> = Vec::new();
    let mut own: Vec<Param> = Vec::new();
    for p in &all {
        match state::owner(p.id()) {
            Some(u) => {
                if let Some(outside) = u.group.params.iter().find(|q| !ids.contains(&q.param.id())) {
                    return Err(config_error(format!(
                        "parameter {} is already owned by the FSDP unit of {}, which does not lie inside this \
                         module (its parameter {} is not the module's); a parameter can belong to one unit only",
                        p.name(),
                        u.label,
                        outside.param.name()
                    )));
                }
                if !children.iter().any(|c| Rc::ptr_eq(c, &u)) {
                    children.push(u);
                }
            }
            None => own.push(p.clone()),
        }
    }
    let mut module_ids = Vec::with_capacity(modules.len());
    for module in modules {
        let id = ModuleId::of(*module)?;
        if state::is_sharded(&id) || module_ids.contains(&id) {
            return Err(config_error(format!("{id} is already fully_shard-ed")));
        }
        module_ids.push(id);
    }
    let dtype = unit_dtype(&own, &config)?;
    // The parameters' mesh and where the data-parallel dims sit in it.
    let param_mesh = own.first().map_or_else(|| mesh.clone(), |p| p.value().mesh().clone());
    let Some(in_params) = param_mesh.dims_of(mesh) else {
        return Err(config_error(format!(
            "parameter {} lives on mesh {param_mesh}, which the data-parallel mesh {mesh} is not a slice of; \
             pass the parameters' mesh or a slice of it (mesh.slice(&[\"dp\"]))",
            own[0].name()
        )));
    };
    let dims = DpDims {
        shard: shard_dim.map(|s| in_params[s]),
        replicate: replicate_dim.map(|r| in_params[r]),
    };
    if let Some(k) = config.reshard_after_forward_to {
        let world = dims.shard.map(|d| param_mesh.shape()[d]);
        if !world.is_some_and(|w| k > 0 && w.is_multiple_of(k)) {
            return Err(config_error(format!(
                "reshard_after_forward_to is {k}; it must divide the {} ranks of the shard dim",
                world.map_or_else(|| "(absent)".to_string(), |w| w.to_string())
            )));
        }
    }
    // Check every parameter before changing any.
    let params: Vec<FsdpParam> = own
        .into_iter()
        .map(|p| FsdpParam::new(p, &param_mesh, dims))
        .collect::<Result<_>>()?;
    for p in &params {
        p.shard(&param_mesh, dims)?;
    }
    let mut dp_placements = vec![Placement::Replicate; mesh.ndim()];
    if let Some(s) = shard_dim {
        dp_placements[s] = Placement::Shard(0);
    }
    let mut group = ParamGroup::new(params, param_mesh, dims, dtype, config.mp_policy);
    if let Some(size) = config.reshard_after_forward_to {
        group.regroup_after_forward(size)?;
    }
    let unit = Unit::new(
        all[0].name().to_string(),
        group,
        children.iter().map(Rc::downgrade).collect(),
        config.reshard_after_forward,
        modules.len(),
    );
    state::register(&unit, &module_ids);
    for id in &module_ids {
        register_module_hooks(id, unit.clone());
    }
    Ok(FsdpModule { unit, dp_placements })
}

/// The shard dim and the replicate dim (HSDP) of the data-parallel mesh.
fn resolve_dims(mesh: &DeviceMesh, shard_dim: Option<&str>) -> Result<(usize, Option<usize>)> {
    let shard = match shard_dim {
        Some(name) => mesh.dim_index(name).map_err(|_| {
            config_error(format!(
                "the mesh has no dim named {name:?} (its dims are {:?}); name the data-parallel shard dim",
                mesh.names()
            ))
        })?,
        None => mesh.ndim().saturating_sub(1),
    };
    match mesh.ndim() {
        1 => Ok((0, None)),
        2 => Ok((shard, Some(1 - shard))),
        n => Err(config_error(format!(
            "fully_shard takes a 1-D (FSDP) or 2-D (HSDP: replicate × shard) data-parallel mesh, got {n} dims \
             {:?}; pass the data-parallel sub-mesh (mesh.slice(&[\"dp_replicate\", \"dp_shard\"]))",
            mesh.shape()
        ))),
    }
}

/// The unit's master dtype: its parameters' common dtype.
fn unit_dtype(own: &[Param], config: &FsdpConfig) -> Result<DType> {
    let Some(first) = own.first() else {
        return Ok(config.mp_policy.param_dtype.unwrap_or(DType::F32));
    };
    let dtype = first.value().dtype();
    if let Some(p) = own.iter().find(|p| p.value().dtype() != dtype) {
        return Err(config_error(format!(
            "parameters {} ({}) and {} ({}) differ in dtype; one unit gathers one dtype \
             (shard them in separate units)",
            first.name(),
            dtype,
            p.name(),
            p.value().dtype()
        )));
    }
    Ok(dtype)
}

/// Where a unit's parameters are ([`FsdpModule::gather_state`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GatherState {
    /// Only the shards exist.
    Sharded,
    /// An all-gather was issued (a prefetch) and not yet waited for.
    Gathering,
    /// The unsharded parameters exist.
    Unsharded,
    /// Resharded after forward to smaller groups
    /// ([`FsdpConfig::reshard_after_forward_to`]): backward gathers within them.
    Regrouped,
}

/// A module made an FSDP unit by [`fully_shard`]: a handle to control its
/// communication. Cheap to clone; lives on its rank's thread.
///
/// PyTorch: `FSDPModule`.
#[derive(Clone)]
pub struct FsdpModule {
    unit: Rc<Unit>,
    dp_placements: Vec<Placement>,
}

impl FsdpModule {
    /// The parameters this unit owns (not those of units inside it).
    pub fn params(&self) -> Vec<Param> {
        self.unit.group.params.iter().map(|p| p.param.clone()).collect()
    }

    /// Whether the unit's parameters are gathered now.
    pub fn is_unsharded(&self) -> bool {
        self.unit.group.is_unsharded()
    }

    /// Where the unit's parameters are now: sharded, being gathered (prefetched),
    /// or unsharded. What prefetching did shows here.
    ///
    /// PyTorch: the param group's `_training_state` / `is_unsharded`.
    pub fn gather_state(&self) -> GatherState {
        self.unit.group.gather_state()
    }

    /// Gathers the unit's parameters now (one all-gather), e.g. to overlap it
    /// with other work before forward. Not recursive. Collective over the shard dim.
    ///
    /// PyTorch: `FSDPModule.unshard()`.
    ///
    /// # Errors
    /// Communication failures.
    pub fn unshard(&self) -> Result<()> {
        self.unit.group.unshard()
    }

    /// Issues the all-gather without waiting; the unit's forward (or
    /// [`unshard`](Self::unshard)) waits for it. Collective over the shard dim.
    ///
    /// PyTorch: `FSDPModule.unshard(async_op=True)`.
    ///
    /// # Errors
    /// Communication failures.
    pub fn unshard_async(&self) -> Result<()> {
        self.unit.group.prefetch()
    }

    /// Frees the unsharded parameters. Not recursive.
    ///
    /// PyTorch: `FSDPModule.reshard()`.
    ///
    /// # Errors
    /// A failed all-gather that was in flight.
    pub fn reshard(&self) -> Result<()> {
        self.unit.group.reshard()
    }

    fn units(&self) -> Vec<Rc<Unit>> {
        let mut out = vec![self.unit.clone()];
        out.extend(self.unit.children.iter().filter_map(Weak::upgrade));
        out
    }

    /// Sets whether this unit and the units inside it free their parameters after
    /// forward.
    ///
    /// PyTorch: `FSDPModule.set_reshard_after_forward(..., recurse=True)`.
    pub fn set_reshard_after_forward(&self, on: bool) {
        for u in self.units() {
            u.reshard_after_forward.set(Some(on));
        }
    }

    /// Sets whether backward reduces gradients (this unit and the units inside it).
    /// Off, each unit accumulates its unsharded gradients locally (in the reduce
    /// dtype) and the first backward with sync on reduces the sum: gradient
    /// accumulation with one reduce-scatter per unit on the last micro-batch.
    ///
    /// PyTorch: `FSDPModule.set_requires_gradient_sync(..., recurse=True)`.
    pub fn set_requires_gradient_sync(&self, on: bool) {
        for u in self.units() {
            u.grad_sync.set(on);
        }
    }

    /// Sets whether this unit and the units inside it free their parameters after
    /// backward. Off, the next forward finds them gathered and communicates
    /// nothing, as long as the shards did not change (no optimizer step in
    /// between): gradient accumulation without re-gathering each micro-batch.
    ///
    /// PyTorch: `FSDPModule.set_reshard_after_backward(..., recurse=True)`.
    pub fn set_reshard_after_backward(&self, on: bool) {
        for u in self.units() {
            u.reshard_after_backward.set(on);
        }
    }

    /// Sets whether HSDP all-reduces gradients over the replicate dim (this unit
    /// and the units inside it). Off, backward reduce-scatters within each replica
    /// and keeps the result; the next backward with it on adds it in before its
    /// all-reduce: accumulation across micro-batches with one inter-replica
    /// all-reduce on the last. No effect on a 1-D mesh.
    ///
    /// PyTorch: `FSDPModule.set_requires_all_reduce(..., recurse=True)`.
    pub fn set_requires_all_reduce(&self, on: bool) {
        for u in self.units() {
            u.all_reduce.set(on);
        }
    }

    /// The units whose all-gathers this unit's pre-forward issues (instead of the
    /// next unit of the previous iteration's order).
    ///
    /// PyTorch: `FSDPModule.set_modules_to_forward_prefetch`.
    pub fn set_modules_to_forward_prefetch(&self, modules: &[&FsdpModule]) {
        *self.unit.forward_prefetch.borrow_mut() = Some(modules.iter().map(|m| Rc::downgrade(&m.unit)).collect());
    }

    /// The units whose all-gathers this unit's pre-backward issues (instead of the
    /// unit whose backward comes next).
    ///
    /// PyTorch: `FSDPModule.set_modules_to_backward_prefetch`.
    pub fn set_modules_to_backward_prefetch(&self, modules: &[&FsdpModule]) {
        *self.unit.backward_prefetch.borrow_mut() = Some(modules.iter().map(|m| Rc::downgrade(&m.unit)).collect());
    }

    /// Bytes of this rank's padded shards (the all-gather's input) in the parameters' dtype.
    pub fn sharded_bytes(&self) -> usize {
        let g = &self.unit.group;
        g.bucket_len().unwrap_or(0) * g.dtype.size_in_bytes()
    }

    /// Bytes of this rank's unsharded parameters in the gather dtype (the pieces
    /// tensor parallelism leaves it; the whole parameters without it).
    pub fn unsharded_bytes(&self) -> usize {
        let g = &self.unit.group;
        g.unsharded_numel().unwrap_or(0) * g.gather_dtype().size_in_bytes()
    }

    /// The mixed-precision policy.
    pub fn mp_policy(&self) -> MixedPrecisionPolicy {
        self.unit.group.mp
    }

    /// The placements the unit gives its parameters on the data-parallel mesh
    /// (`[Shard(0)]`, or `[Replicate, Shard(0)]` for HSDP).
    pub fn placements(&self) -> &[Placement] {
        &self.dp_placements
    }
}
