//! Fully sharded data parallelism: [`fully_shard`] shards a module's parameters
//! over a data-parallel mesh dim and turns the module into one communication unit.
//!
//! ```
//! use tessera_autograd::nn::{Linear, Materializer, Module};
//! use tessera_autograd::optim::{AdamW, AdamWConfig, Optimizer};
//! use tessera_autograd::{backward, Var};
//! use tessera_dtensor::{distribute_tensor, DType, Placement, Tensor};
//! use tessera_fsdp::{fully_shard, FsdpConfig};
//! use tessera_mesh::{launch, DeviceMesh};
//!
//! let losses = launch(2, |ctx| {
//!     let mesh = DeviceMesh::new(ctx.into_comm(), &[2])?;
//!     let layer = Linear::new(3, 5, true, &mesh, DType::F32)?;
//!     let unit = fully_shard(&layer, &mesh, FsdpConfig::default())?;
//!     // Each rank allocates only its rows of the weight: 3 of 5 on rank 0, 2 on rank 1.
//!     Materializer::from_seed(0).materialize(&layer)?;
//!     assert_eq!(layer.weight.value()?.placements(), &[Placement::Shard(0)]);
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
//!   [`Module::call`](tessera_autograd::nn::Module::call), which runs the units' hooks;
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
//! - while a unit computes, its parameters are bound
//!   ([`Param::bind`](tessera_autograd::Param::bind)) to their unsharded values,
//!   which the tape re-reads in backward through a slot: they are freed after
//!   forward and refilled before backward, and reading a freed one is an
//!   [`Error::Resharded`];
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
//!   [`FsdpModule::set_requires_all_reduce`];
//! - errors name the module, parameter or mesh ([`Error`]); inside a forward or
//!   backward they travel as `tessera_autograd::Error::External`, and
//!   [`Error::from`] gives them back.
//!
//! The crate follows FSDP2's seams, one file each: the API (`fully_shard.rs`),
//! per-parameter geometry (`param.rs`, `FSDPParam`), the parameter group of a
//! unit (`group.rs`, `FSDPParamGroup`), its hooks and the state units share
//! (`state.rs`, `FSDPState`), and where unsharded values live (`slot.rs`).
//! Tensor parallelism ([`tp`]) is a sibling module.

mod agree;
mod config;
mod error;
mod fully_shard;
mod group;
mod overlap;
mod param;
mod slot;
mod state;
pub mod tp;
mod wrap;

pub use config::{FsdpConfig, MixedPrecisionPolicy};
pub use error::{Error, Result};
pub use fully_shard::{FsdpModule, fully_shard, fully_shard_modules, replicate};
pub use group::GatherState;
pub use overlap::{CollectiveTimes, CommOverlap};
pub use wrap::{WrapPolicy, auto_wrap};
