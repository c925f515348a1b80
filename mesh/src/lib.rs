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
//!   poisons the job: the others get errors naming it instead of hanging. Under
//!   `mpirun` (detected by [`mpi_env`]) with feature `mpi`, each process is one rank
//!   and the collectives are MPI's; a failing rank aborts the job with its error.
//! - [`DeviceMesh`]: an N-D array of ranks with named dims and one sub-communicator per dim.
//! - [`CommStats`]: per-rank counts of collectives and bytes, for tests and benchmarks.
//!
//! Features: `testing` (the communicator contract checks of `testing`, for
//! backends' test suites); `mpi` (the MPI backend over the `mpi` crate: needs an
//! MPI library such as OpenMPI and libclang to build). A `cuda` (NCCL) backend is
//! planned behind its own feature.

pub mod agree;
pub mod callsite;
mod comm;
pub mod context;
mod device;
mod device_mesh;
mod dtype;
mod env;
mod error;
pub mod intra_op;
mod launcher;
#[cfg(feature = "mpi")]
mod mpi_backend;
pub mod observe;
mod options;
mod pieces;
pub mod pool;
mod rank;
pub mod stats;
#[cfg(feature = "testing")]
pub mod testing;
mod threads;
pub mod vars;

pub use comm::{Communicator, CommunicatorExt, Planned, ReduceOp, Run, Work, WorkTiming, copy_runs};
pub use device::Device;
pub use device_mesh::{DeviceMesh, DimRef};
pub use dtype::{Buf, BufMut, Buffer, DType, Element};
pub use env::{MpiEnv, is_lead_process, mpi_env};
pub use error::{Error, Result};
pub use intra_op::{intra_op_threads, parallel_for};
pub use launcher::{launch, launch_with};
/// The `mpi` crate the MPI backend is built on, for raw MPI calls beside Tessera's
/// (feature `mpi`). Initialise MPI through it before the first [`launch`] to own
/// its `Universe` (at `Threading::Multiple`); otherwise `launch` initialises MPI
/// and finalises it at process exit.
#[cfg(feature = "mpi")]
pub use mpi;
pub use options::LaunchOptions;
pub use pieces::{HeldBuf, Pieces};
pub use rank::{BoxError, RankCtx};
pub use stats::{CommCounts, CommStats, OpKind};
pub use vars::{DEFAULT_TIMEOUT, MAX_THREADS_PER_RANK, MAX_TIMEOUT, MIN_TIMEOUT};
