//! The API: [`fully_shard`] (and [`fully_shard_modules`], [`replicate`]) makes a
//! module one unit, and [`FsdpModule`] controls a unit's communication.
//!
//! Making a unit takes the steps of `make_unit`: collect the modules'
//! parameters, leave those of units already made inside them, name the modules,
//! find the data-parallel dims in the parameters' mesh, check and shard each
//! parameter, then build the parameter group and attach the unit's hooks.
//!
//! PyTorch: `torch/distributed/fsdp/_fully_shard/_fully_shard.py`.

use std::collections::HashSet;
use std::rc::{Rc, Weak};

use tessera_autograd::Param;
use tessera_autograd::nn::{Module, ModuleId, register_module_hooks};
use tessera_dtensor::Placement;
use tessera_mesh::{DType, DeviceMesh};

use crate::agree::{agree, geometry_hash};
use crate::config::{FsdpConfig, MixedPrecisionPolicy};
use crate::error::{Error, Result};
use crate::group::{GatherState, ParamGroup};
use crate::overlap::CommOverlap;
use crate::param::{DpDims, FsdpParam};
use crate::state::{self, Unit};

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
#[track_caller]
pub fn fully_shard(module: &dyn Module, mesh: &DeviceMesh, config: FsdpConfig) -> Result<FsdpModule> {
    let _site = tessera_mesh::callsite::enter();
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
#[track_caller]
pub fn fully_shard_modules(modules: &[&dyn Module], mesh: &DeviceMesh, config: FsdpConfig) -> Result<FsdpModule> {
    let _site = tessera_mesh::callsite::enter();
    let dims = resolve_dims(mesh, config.shard_dim.as_deref()).map(|(shard, replicate)| (Some(shard), replicate));
    make_unit(modules, mesh, config, dims)
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
#[track_caller]
pub fn replicate(module: &dyn Module, mesh: &DeviceMesh, config: FsdpConfig) -> Result<FsdpModule> {
    let _site = tessera_mesh::callsite::enter();
    let dims = if mesh.ndim() == 1 {
        Ok((None, Some(0)))
    } else {
        Err(Error::mesh(
            mesh,
            format!("replicate takes the 1-D data-parallel mesh, got {:?}", mesh.shape()),
        ))
    };
    make_unit(&[module], mesh, config, dims)
}

/// The unit of `modules` over the data-parallel `mesh`: `dims` are the shard
/// and replicate dims of `mesh` (or why they are not). Checks everything, agrees
/// with the other ranks on the verdict and on the parameters before changing
/// anything, then shards the parameters and attaches the unit's hooks.
fn make_unit(
    modules: &[&dyn Module],
    mesh: &DeviceMesh,
    config: FsdpConfig,
    dims: Result<(Option<usize>, Option<usize>)>,
) -> Result<FsdpModule> {
    let checked = check_unit(modules, mesh, &config, dims);
    let geometry = checked.as_ref().map_or(0, |c| geometry_hash(&c.own));
    let Checked {
        children,
        own,
        module_ids,
        dtype,
        param_mesh,
        dims,
        shard_dim,
    } = agree(mesh, checked, geometry, "fully_shard on the same modules")?;
    let params = shard_params(own, &param_mesh, dims)?;
    let mut group = ParamGroup::new(params, param_mesh, dims, dtype, config.mp_policy);
    if let Some(size) = config.reshard_after_forward_to {
        group.regroup_after_forward(size)?;
    }
    let unit = Unit::new(
        label(modules[0]),
        group,
        children.iter().map(Rc::downgrade).collect(),
        config.reshard_after_forward,
        modules.len(),
    );
    state::register(&unit, &module_ids);
    for id in &module_ids {
        register_module_hooks(id, unit.clone());
    }
    let mut dp_placements = vec![Placement::Replicate; mesh.ndim()];
    if let Some(s) = shard_dim {
        dp_placements[s] = Placement::Shard(0);
    }
    Ok(FsdpModule { unit, dp_placements })
}

/// What [`check_unit`] found on this rank, before the ranks agree.
struct Checked {
    children: Vec<Rc<Unit>>,
    own: Vec<Param>,
    module_ids: Vec<ModuleId>,
    dtype: DType,
    param_mesh: DeviceMesh,
    dims: DpDims,
    shard_dim: Option<usize>,
}

/// Every check of a unit this rank can make on its own, changing nothing.
fn check_unit(
    modules: &[&dyn Module],
    mesh: &DeviceMesh,
    config: &FsdpConfig,
    dims: Result<(Option<usize>, Option<usize>)>,
) -> Result<Checked> {
    let (shard_dim, replicate_dim) = dims?;
    let all = collect_params(modules, config)?;
    let (children, own) = split_owned(modules, &all)?;
    let module_ids = unsharded_ids(modules)?;
    let dtype = unit_dtype(&own, config)?;
    let (param_mesh, dims) = dp_dims(&own, mesh, shard_dim, replicate_dim, config)?;
    Ok(Checked {
        children,
        own,
        module_ids,
        dtype,
        param_mesh,
        dims,
        shard_dim,
    })
}

/// How a module is named in errors: what it holds.
fn label(module: &dyn Module) -> String {
    ModuleId::of(module).map_or_else(|_| "a module without parameters".into(), |id| id.to_string())
}

/// The parameters of `modules` the unit takes: each once (a parameter a module
/// holds twice, as tied weights are, is one parameter), ignored ones left out.
///
/// # Errors
/// No modules; two parameters under one name; no parameters left.
fn collect_params(modules: &[&dyn Module], config: &FsdpConfig) -> Result<Vec<Param>> {
    let Some(first) = modules.first() else {
        return Err(Error::module(
            "no modules",
            "fully_shard_modules needs at least one module to shard",
        ));
    };
    let mut all: Vec<Param> = Vec::new();
    let mut ids = HashSet::new();
    for module in modules {
        // Parameters no tree has named yet take their names below this module
        // (a later walk from the root names them in full).
        let named = module.named_parameters();
        if named.iter().any(|(_, p)| !p.is_named()) {
            tessera_autograd::nn::name_parameters(*module)?;
        }
        for (local, p) in named {
            // A parameter shared by two of the modules belongs to the unit once.
            // Ignored by its name in the tree, or below the module being sharded.
            let ignored = config.ignored_params.iter().any(|n| *n == p.name() || *n == local);
            if ids.insert(p.id()) && !ignored {
                all.push(p);
            }
        }
    }
    if all.is_empty() {
        return Err(Error::module(
            label(*first),
            "the module has no parameters (besides ignored ones)",
        ));
    }
    Ok(all)
}

/// The units already made inside the modules (they keep their parameters) and
/// the parameters no unit owns yet.
///
/// # Errors
/// A unit that shares only some of its parameters with the modules.
fn split_owned(modules: &[&dyn Module], all: &[Param]) -> Result<(Vec<Rc<Unit>>, Vec<Param>)> {
    let ids: HashSet<u64> = all.iter().map(Param::id).collect();
    let mut children: Vec<Rc<Unit>> = Vec::new();
    let mut own: Vec<Param> = Vec::new();
    for p in all {
        match state::owner(p.id()) {
            Some(u) => {
                if let Some(outside) = u.group.params.iter().find(|q| !ids.contains(&q.param.id())) {
                    let unit: HashSet<u64> = u.group.params.iter().map(|q| q.param.id()).collect();
                    if ids.iter().all(|id| unit.contains(id)) {
                        // A unit around this module exists already: the order was top-down.
                        return Err(Error::module(
                            label(modules[0]),
                            format!(
                                "lies inside {}, which was made an FSDP unit before it; fully_shard goes \
                                 bottom-up: call it on each block first, then on the module that holds them \
                                 (PyTorch: fully_shard(layer) for every layer, then fully_shard(model))",
                                u.label
                            ),
                        ));
                    }
                    return Err(Error::module(
                        label(modules[0]),
                        format!(
                            "parameter {} is already owned by the FSDP unit of {}, which does not lie inside this \
                             module (its parameter {} is not the module's); a parameter can belong to one unit only",
                            p.name(),
                            u.label,
                            outside.param.name()
                        ),
                    ));
                }
                if !children.iter().any(|c| Rc::ptr_eq(c, &u)) {
                    children.push(u);
                }
            }
            None => own.push(p.clone()),
        }
    }
    Ok((children, own))
}

/// Each module as the root its hooks attach to (its place: itself, FQN `""`).
///
/// # Errors
/// A module made a unit already, or listed twice.
fn unsharded_ids(modules: &[&dyn Module]) -> Result<Vec<ModuleId>> {
    let mut module_ids = Vec::with_capacity(modules.len());
    for module in modules {
        let id = ModuleId::at(*module, "")?;
        if state::is_sharded(&id) || module_ids.contains(&id) {
            return Err(Error::module(id.to_string(), "is already fully_shard-ed"));
        }
        module_ids.push(id);
    }
    Ok(module_ids)
}

/// The parameters' mesh and where the data-parallel dims of `mesh` sit in it.
///
/// # Errors
/// `mesh` not a slice of the parameters' mesh; a `reshard_after_forward_to`
/// that does not divide the shard dim.
fn dp_dims(
    own: &[Param],
    mesh: &DeviceMesh,
    shard_dim: Option<usize>,
    replicate_dim: Option<usize>,
    config: &FsdpConfig,
) -> Result<(DeviceMesh, DpDims)> {
    let param_mesh = own.first().map_or_else(|| mesh.clone(), Param::mesh);
    let Some(in_params) = param_mesh.dims_of(mesh) else {
        return Err(Error::param(
            &own[0].name(),
            format!(
                "lives on mesh {param_mesh}, which the data-parallel mesh {mesh} is not a slice of; pass the \
                 parameters' mesh or a slice of it (mesh.slice(&[\"dp\"]))"
            ),
        ));
    };
    let dims = DpDims {
        shard: shard_dim.map(|s| in_params[s]),
        replicate: replicate_dim.map(|r| in_params[r]),
    };
    if let Some(k) = config.reshard_after_forward_to {
        let world = dims.shard.map(|d| param_mesh.shape()[d]);
        if !world.is_some_and(|w| k > 0 && w.is_multiple_of(k)) {
            return Err(Error::mesh(
                mesh,
                format!(
                    "reshard_after_forward_to is {k}; it must divide the {} ranks of the shard dim",
                    world.map_or_else(|| "(absent)".to_string(), |w| w.to_string())
                ),
            ));
        }
    }
    Ok((param_mesh, dims))
}

/// Checks every parameter, then replaces each value by this rank's shard.
///
/// # Errors
/// A parameter that cannot be sharded (nothing is changed then).
fn shard_params(own: Vec<Param>, param_mesh: &DeviceMesh, dims: DpDims) -> Result<Vec<FsdpParam>> {
    let params: Vec<FsdpParam> = own
        .into_iter()
        .map(|p| FsdpParam::new(p, param_mesh, dims))
        .collect::<Result<_>>()?;
    for p in &params {
        p.shard(param_mesh, dims)?;
    }
    Ok(params)
}

/// The shard dim and the replicate dim (HSDP) of the data-parallel mesh.
fn resolve_dims(mesh: &DeviceMesh, shard_dim: Option<&str>) -> Result<(usize, Option<usize>)> {
    let shard = match shard_dim {
        Some(name) => mesh.dim_index(name).map_err(|_| {
            Error::mesh(
                mesh,
                format!(
                    "the mesh has no dim named {name:?} (its dims are {:?}); name the data-parallel shard dim",
                    mesh.names()
                ),
            )
        })?,
        None => mesh.ndim().saturating_sub(1),
    };
    match mesh.ndim() {
        1 => Ok((0, None)),
        2 => Ok((shard, Some(1 - shard))),
        n => Err(Error::mesh(
            mesh,
            format!(
                "fully_shard takes a 1-D (FSDP) or 2-D (HSDP: replicate × shard) data-parallel mesh, got {n} dims \
                 {:?}; pass the data-parallel sub-mesh (mesh.slice(&[\"dp_replicate\", \"dp_shard\"]))",
                mesh.shape()
            ),
        )),
    }
}

/// The unit's master dtype: its parameters' common dtype.
fn unit_dtype(own: &[Param], config: &FsdpConfig) -> Result<DType> {
    let Some(first) = own.first() else {
        return Ok(config.mp_policy.param_dtype.unwrap_or(DType::F32));
    };
    let dtype = first.dtype();
    if let Some(p) = own.iter().find(|p| p.dtype() != dtype) {
        return Err(Error::param(
            &p.name(),
            format!(
                "is {} while parameter {} of the same unit is {}; one unit gathers one dtype (shard them in \
                 separate units)",
                p.dtype(),
                first.name(),
                dtype,
            ),
        ));
    }
    Ok(dtype)
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

    /// How long this unit's collectives (not those of units inside it) ran on
    /// the communication thread since FSDP began or since the last
    /// [`reset_comm_overlap`](Self::reset_comm_overlap), and how long this
    /// rank blocked waiting for them: how much of the unit's communication
    /// prefetching hid behind compute.
    pub fn comm_overlap(&self) -> CommOverlap {
        self.unit.group.overlap.get()
    }

    /// Starts this unit's [`comm_overlap`](Self::comm_overlap) over from zero.
    pub fn reset_comm_overlap(&self) {
        self.unit.group.overlap.set(CommOverlap::default());
    }

    /// Gathers the unit's parameters now (one all-gather), e.g. to overlap it
    /// with other work before forward. Not recursive. Collective over the shard dim.
    ///
    /// PyTorch: `FSDPModule.unshard()`.
    ///
    /// # Errors
    /// Communication failures.
    #[track_caller]
    pub fn unshard(&self) -> Result<()> {
        let _site = tessera_mesh::callsite::enter();
        self.unit.group.unshard()
    }

    /// Issues the all-gather without waiting; the unit's forward (or
    /// [`unshard`](Self::unshard)) waits for it. Collective over the shard dim.
    ///
    /// PyTorch: `FSDPModule.unshard(async_op=True)`.
    ///
    /// # Errors
    /// Communication failures.
    #[track_caller]
    pub fn unshard_async(&self) -> Result<()> {
        let _site = tessera_mesh::callsite::enter();
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
