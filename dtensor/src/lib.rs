//! Local tensors, placements, distributed tensors and redistribution.
#![deny(missing_docs)]

mod error;
pub mod memory;
mod placement;
pub mod rng;
pub mod sharding;
mod tensor;

pub use error::{Error, Result};
pub use placement::{MeshDims, Placement, ShardOrder, validate_placements};
pub use tensor::Tensor;
pub use tessera_mesh::{DType, ReduceOp};
