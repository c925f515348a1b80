//! The error type of `tessera-dtensor`.

use tessera_mesh::DType;

/// Errors from tensors, placements, sharding math and redistribution.
///
/// Each variant names the operation and the values a user needs to fix the call.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Two shapes that must agree do not.
    #[error("{op}: shape mismatch: {detail}")]
    ShapeMismatch {
        /// The operation.
        op: &'static str,
        /// Both shapes and what had to agree.
        detail: String,
    },

    /// A dimension index past the tensor's rank.
    #[error("{op}: dim {dim} is out of range for a tensor of rank {rank}")]
    DimOutOfRange {
        /// The operation.
        op: &'static str,
        /// The dim asked for.
        dim: usize,
        /// The tensor's rank.
        rank: usize,
    },

    /// A tensor has another dtype than the operation needs.
    #[error("{op}: expected dtype {expected}, got {got}")]
    DTypeMismatch {
        /// The operation.
        op: &'static str,
        /// What the operation needs.
        expected: DType,
        /// What it was given.
        got: DType,
    },

    /// An argument outside its valid range (a slice past the end, a zero chunk count, ...).
    #[error("{op}: {detail}")]
    InvalidArgument {
        /// The operation.
        op: &'static str,
        /// What was wrong and what to do.
        detail: String,
    },

    /// Placements that do not fit the mesh or the tensor.
    #[error("{op}: invalid placements: {detail}")]
    Placement {
        /// The operation.
        op: &'static str,
        /// What was wrong.
        detail: String,
    },

    /// A communicator or mesh error.
    #[error(transparent)]
    Comm(#[from] tessera_mesh::Error),
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
