//! The error type of `tessera-dtensor`.

/// Errors from placements, sharding math, redistribution and checkpoints, and the
/// local tensor errors they wrap.
///
/// Each variant names the operation and the values a user needs to fix the call.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A local tensor operation failed (a shape, dim, dtype or argument error, or an
    /// allocation that could not be made).
    #[error(transparent)]
    Tensor(#[from] tessera_tensor::Error),

    /// Placements that do not fit the mesh or the tensor.
    #[error("{op}: invalid placements: {detail}")]
    Placement {
        /// The operation.
        op: &'static str,
        /// What was wrong.
        detail: String,
    },

    /// A checkpoint that cannot be written or read: a missing, truncated or
    /// corrupt index or chunk file, a tensor missing or of another shape or dtype.
    #[error("checkpoint {path}: {detail}")]
    Checkpoint {
        /// The file or directory concerned.
        path: String,
        /// What was wrong (naming the tensor where there is one) and what to do.
        detail: String,
    },

    /// A communicator or mesh error.
    #[error(transparent)]
    Comm(#[from] tessera_mesh::Error),
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
