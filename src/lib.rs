//! Tessera: distributed tensors, redistribution, tape autograd and FSDP for
//! training models that do not fit on one device.
//!
//! ```
//! use tessera::{launch, CommunicatorExt, DeviceMesh};
//!
//! let out = launch(4, |ctx| {
//!     let mesh = DeviceMesh::with_names(ctx.into_comm(), &[2, 2], &["dp", "tp"])?;
//!     // Gather every rank's coordinate along "tp".
//!     let tp = mesh.dim_comm("tp")?;
//!     let coords = tp.all_gather_vec(&[mesh.coordinate()[1] as i64])?;
//!     Ok(coords)
//! })
//! .unwrap();
//! assert!(out.iter().all(|c| c == &vec![0, 1]));
//! ```
//!
//! The facade re-exports the member crates:
//!
//! - [`mesh`] (`tessera-mesh`): communicators (threads backend by default), launch, `DeviceMesh`.
//! - [`tensor`] (`tessera-tensor`): the local tensor engine: `Tensor`, kernels, memory tracker, profiler, RNG.
//! - [`dtensor`] (`tessera-dtensor`): placements, `DTensor`, redistribute, sharded ops, checkpoints.
//! - [`autograd`] (`tessera-autograd`): the tape, modules, optimizers.
//! - [`fsdp`] (`tessera-fsdp`): `fully_shard`, HSDP, mixed precision.
//! - [`models`]: the reference Transformer; [`data`]: the reference token generator.

pub mod data;
pub mod models;
pub mod plan;

pub use tessera_autograd as autograd;
pub use tessera_dtensor as dtensor;
pub use tessera_fsdp as fsdp;
pub use tessera_mesh as mesh;
pub use tessera_tensor as tensor;

pub use tessera_mesh::{
    BoxError, Communicator, CommunicatorExt, DType, DeviceMesh, LaunchOptions, MpiEnv, RankCtx, ReduceOp,
    is_lead_process, launch, launch_with, mpi_env,
};

/// The README's examples, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
