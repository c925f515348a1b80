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
//!   over the global batch), so the reductions are sums.
#![deny(missing_docs)]

mod config;
mod runtime;
pub mod tp;
mod unit;

use std::collections::HashSet;
use std::rc::{Rc, Weak};

use tessera_autograd::nn::{Module, ModuleId, register_module_hooks};
use tessera_autograd::{Param, Slot};
use tessera_dtensor::sharding::shard_size_and_offset;
use tessera_dtensor::{DTensor, Placement, Tensor};
use tessera_mesh::{DType, DeviceMesh};

pub use config::{FsdpConfig, MixedPrecisionPolicy};
pub use tessera_autograd::{Error, Result};

use unit::{FsdpParam, Unit};

fn config_error(detail: String) -> Error {
    Error::Config {
        op: "fully_shard",
        detail,
    }
}

/// Shards `module`'s parameters over `mesh` and makes the module one FSDP unit.
///
/// `mesh` is the data-parallel mesh: 1-D (FSDP) or 2-D (HSDP: `config.shard_dim`,
/// by default dim 1, shards and the other dim replicates). Parameters must be
/// replicated on `mesh` (as modules create them); each becomes `Shard(0)` on the
/// shard dim. Parameters already owned by a unit made from a submodule stay there.
///
/// PyTorch: `torch.distributed.fsdp.fully_shard`.
///
/// # Errors
/// A mesh with more than two dims or without the named shard dim; a module already
/// sharded, or sharing a parameter with a unit that does not lie inside it; a
/// parameter that is not replicated on `mesh`, lives on another mesh, is a scalar,
/// or is not floating-point; parameters of different dtypes in one unit without a
/// `param_dtype`.
pub fn fully_shard(module: &dyn Module, mesh: &DeviceMesh, config: FsdpConfig) -> Result<FsdpModule> {
    let (shard_dim, replicate_dim) = resolve_dims(mesh, config.shard_dim.as_deref())?;
    let all = module.parameters();
    let mut ids = HashSet::new();
    for p in &all {
        if !ids.insert(p.id()) {
            return Err(config_error(format!(
                "parameter {} appears twice in the module's parameters",
                p.name()
            )));
        }
    }
    // Units inside this module keep their parameters; a unit that shares only
    // some of its parameters with this module is an error.
    let mut children: Vec<Rc<Unit>> = Vec::new();
    let mut own: Vec<Param> = Vec::new();
    for p in &all {
        match runtime::owner(p.id()) {
            Some(u) => {
                if let Some(outside) = u.params.iter().find(|q| !ids.contains(&q.param.id())) {
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
    if all.is_empty() {
        return Err(config_error("the module has no parameters".into()));
    }
    let id = ModuleId::of(module)?;
    if runtime::is_sharded(&id) {
        return Err(config_error(format!("{id} is already fully_shard-ed")));
    }
    let dtype = unit_dtype(&own, &config)?;
    let world = mesh.shape()[shard_dim];
    let rank = mesh.coordinate()[shard_dim];
    let mut placements = vec![Placement::Replicate; mesh.ndim()];
    placements[shard_dim] = Placement::Shard(0);
    // Check every parameter before changing any.
    for p in &own {
        check_param(p, mesh)?;
    }
    let mut params = Vec::with_capacity(own.len());
    let mut offset = 0;
    for p in own {
        let value = p.value();
        let shape = value.shape().to_vec();
        let rows = shape[0];
        let row_numel: usize = shape[1..].iter().product();
        let chunk_rows = rows.div_ceil(world);
        let (local_rows, start) = shard_size_and_offset(rows, world, rank);
        // A copy, not a view: the replicated value is freed once set_value replaces it.
        let rows_here = value.to_local().narrow(0, start, local_rows)?;
        let mut local_shape = shape.clone();
        local_shape[0] = local_rows;
        let local = Tensor::from_buffer(rows_here.to_buffer(), &local_shape)?;
        p.set_value(DTensor::from_local(local, mesh, &placements, &shape)?);
        p.set_grad(None);
        let slot = Slot::new(p.name(), None);
        params.push(FsdpParam {
            param: p,
            shape,
            rows,
            row_numel,
            chunk_rows,
            local_rows,
            offset,
            slot,
        });
        offset += chunk_rows * row_numel;
    }
    let label = all[0].name().to_string();
    let unit = Unit::new(
        params,
        mesh.clone(),
        shard_dim,
        replicate_dim,
        dtype,
        placements,
        children.iter().map(Rc::downgrade).collect(),
        config.reshard_after_forward,
        config.mp_policy,
        label,
    );
    for p in &unit.params {
        runtime::set_owner(p.param.id(), &unit);
    }
    runtime::set_sharded(id.clone());
    register_module_hooks(&id, unit.clone());
    Ok(FsdpModule { unit })
}

/// The shard dim and the replicate dim (HSDP) of `mesh`.
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
             {:?}; pass the data-parallel sub-mesh",
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

fn check_param(p: &Param, mesh: &DeviceMesh) -> Result<()> {
    let v = p.value();
    if !v.mesh().same_as(mesh) {
        return Err(config_error(format!(
            "parameter {} lives on a mesh of shape {:?}, not on the data-parallel mesh {:?} given to fully_shard",
            p.name(),
            v.mesh().shape(),
            mesh.shape()
        )));
    }
    if v.placements().iter().any(|pl| !pl.is_replicate()) {
        return Err(config_error(format!(
            "parameter {} is placed {:?}; fully_shard shards replicated parameters (is it already sharded?)",
            p.name(),
            v.placements()
        )));
    }
    if v.shape().is_empty() {
        return Err(config_error(format!(
            "parameter {} is a scalar; FSDP shards dim 0 (reshape it to [1])",
            p.name()
        )));
    }
    if !v.dtype().is_float() {
        return Err(config_error(format!(
            "parameter {} is {}; FSDP shards floating-point parameters",
            p.name(),
            v.dtype()
        )));
    }
    Ok(())
}

/// A module made an FSDP unit by [`fully_shard`]: a handle to control its
/// communication. Cheap to clone; lives on its rank's thread.
///
/// PyTorch: `FSDPModule`.
#[derive(Clone)]
pub struct FsdpModule {
    unit: Rc<Unit>,
}

impl FsdpModule {
    /// The parameters this unit owns (not those of units inside it).
    pub fn params(&self) -> Vec<Param> {
        self.unit.params.iter().map(|p| p.param.clone()).collect()
    }

    /// Whether the unit's parameters are gathered now.
    pub fn is_unsharded(&self) -> bool {
        self.unit.is_unsharded()
    }

    /// Gathers the unit's parameters now (one all-gather), e.g. to overlap it
    /// with other work before forward. Not recursive. Collective over the shard dim.
    ///
    /// PyTorch: `FSDPModule.unshard()`.
    ///
    /// # Errors
    /// Communication failures.
    pub fn unshard(&self) -> Result<()> {
        self.unit.unshard()
    }

    /// Issues the all-gather without waiting; the unit's forward (or
    /// [`unshard`](Self::unshard)) waits for it. Collective over the shard dim.
    ///
    /// PyTorch: `FSDPModule.unshard(async_op=True)`.
    ///
    /// # Errors
    /// Communication failures.
    pub fn unshard_async(&self) -> Result<()> {
        self.unit.prefetch()
    }

    /// Frees the unsharded parameters. Not recursive.
    ///
    /// PyTorch: `FSDPModule.reshard()`.
    ///
    /// # Errors
    /// A failed all-gather that was in flight.
    pub fn reshard(&self) -> Result<()> {
        self.unit.reshard()
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

    /// Bytes of this rank's padded shards (the all-gather's input).
    pub fn sharded_bytes(&self) -> usize {
        self.unit.bucket_len * self.unit.dtype.size_in_bytes()
    }

    /// Bytes of the unsharded parameters in the gather dtype.
    pub fn unsharded_bytes(&self) -> usize {
        self.unit.params.iter().map(|p| p.rows * p.row_numel).sum::<usize>() * self.unit.gather_dtype().size_in_bytes()
    }

    /// The mixed-precision policy.
    pub fn mp_policy(&self) -> MixedPrecisionPolicy {
        self.unit.mp
    }

    /// The placements of the sharded parameters (`[Shard(0)]`, or `[Replicate, Shard(0)]` for HSDP).
    pub fn placements(&self) -> &[Placement] {
        &self.unit.placements
    }
}
