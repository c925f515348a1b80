//! Local tensors, placements, distributed tensors and redistribution.
#![deny(missing_docs)]

mod error;

pub use error::{Error, Result};
pub use tessera_mesh::{DType, ReduceOp};
