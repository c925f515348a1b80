//! Communicators and device meshes: the bottom layer of Tessera.
//!
//! ```
//! use tessera_mesh::{launch, CommunicatorExt, ReduceOp};
//!
//! // Four ranks, each a thread of this process; every rank runs the closure.
//! let sums = launch(4, |ctx| {
//!     let mut x = vec![ctx.rank() as f32; 3];
//!     ctx.comm().all_reduce_slice(&mut x, ReduceOp::Sum)?;
//!     Ok(x)
//! })
//! .unwrap();
//! assert_eq!(sums, vec![vec![6.0; 3]; 4]);
//! ```
//!
//! - [`Communicator`]: one process group (rank, size, collectives with blocking and
//!   asynchronous forms, `split` into sub-groups). Object safe, a small required core.
//! - [`launch`]: runs a closure on every rank; the threads backend (default) makes
//!   each rank a thread and moves data through shared memory. A rank that fails
//!   poisons the job: the others get errors naming it instead of hanging.
//! - [`DeviceMesh`]: an N-D array of ranks with named dims and one sub-communicator per dim.
//! - [`CommStats`]: per-rank counts of collectives and bytes, for tests and benchmarks.
//!
//! Features: `testing` (the communicator contract checks of [`testing`], for
//! backends' test suites). The `mpi` and `cuda` (NCCL) backends come behind features.
#![deny(missing_docs)]

mod comm;
pub mod context;
mod device_mesh;
mod dtype;
mod error;
mod launcher;
#[cfg(feature = "mpi")]
mod mpi;
pub mod stats;
#[cfg(feature = "testing")]
pub mod testing;
pub mod threads;

pub use comm::{Communicator, CommunicatorExt, ReduceOp, Work};
pub use device_mesh::{DeviceMesh, DimRef};
pub use dtype::{Buf, BufMut, Buffer, DType, Element};
pub use error::{Error, Result};
pub use stats::{CommCounts, CommStats, OpKind};
pub use launcher::{
    BoxError, DEFAULT_TIMEOUT, LaunchOptions, MpiEnv, RankCtx, is_lead_process, launch, launch_with, mpi_env,
};
