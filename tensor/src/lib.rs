//! The local tensor engine of Tessera: one rank's CPU tensors and their kernels.
//!
//! ```
//! use tessera_tensor::{DType, Tensor};
//!
//! let x = Tensor::arange(6, DType::F32)?.reshape(&[2, 3])?;
//! let w = Tensor::ones(&[3, 4], DType::F32)?;
//! let y = x.matmul(&w)?.gelu()?; // [2, 4]
//! let parts = y.chunk(2, 1)?; // two [2, 2] views, no copy
//! assert!(parts[0].shares_storage(&y));
//! assert_eq!(Tensor::cat(&parts, 1)?, y);
//! # Ok::<(), tessera_tensor::Error>(())
//! ```
//!
//! - [`Tensor`]: a runtime-typed (six [`DType`]s), strided, immutable view of shared
//!   storage; views are cheap, every computed value gets new storage.
//! - [`ops`]: the kernels (matmul, element-wise with broadcasting, reductions, the
//!   neural-network ops of a Transformer and their gradients), written once over
//!   [`Element`] and split over the rank's threads with results that do not depend
//!   on the thread count.
//! - [`memory`]: the per-rank tracker of live tensor bytes; [`alloc`]: large
//!   buffers recycled across steps; [`profile`]: opt-in per-kernel time and flops.
//! - [`random`]: counter-based (Philox) random tensors whose every element depends
//!   only on a seed, a name, a stream and its global index, so any box of a tensor
//!   (a rank's shard on any mesh) is drawn alone with the bits of the whole;
//!   [`rng`]: a small sequential generator seeded the same on every rank.
//!
//! Everything here is local to one rank: distributed tensors, placements and
//! collectives live in the crates above (`tessera-dtensor`, `tessera-mesh`).

pub mod alloc;
#[cfg(feature = "cuda")]
pub mod cuda;
mod dim;
mod error;
pub mod kernel;
pub mod memory;
pub mod ops;
pub mod profile;
pub mod random;
pub mod rng;
mod tensor;

pub use dim::{Dim, ShapeSize, infer_shape, resolve_dims};
pub use error::{Error, Result};
/// The element types of the half-precision dtypes (`DType::BF16`, `DType::F16`).
pub use half::{bf16, f16};
pub use tensor::{Tensor, chunk_size_and_offset};
pub use tessera_mesh::{DType, Device, Element};
