//! The error type of `tessera-dtensor`.

use std::fmt;

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

    /// Ranks that must hold equal values along a `Replicate` mesh dim do not
    /// (see [`check_replicas`](crate::check_replicas)). Every rank of the mesh
    /// returns the same error.
    #[error("{0}")]
    ReplicasDiffer(Box<ReplicaDivergence>),

    /// `distribute_tensor` with a source rank could not agree on one rank's
    /// values: a source that is not a rank of the mesh, ranks passing another
    /// source, placements or full tensor shape or dtype. Every rank of the mesh
    /// returns the same error.
    #[error("distribute_tensor: {detail}")]
    Distribute {
        /// What was wrong, naming the ranks concerned, and what to do.
        detail: String,
    },

    /// A communicator or mesh error.
    #[error(transparent)]
    Comm(#[from] tessera_mesh::Error),
}

/// Where replicas differ: what [`Error::ReplicasDiffer`] reports (boxed, so
/// that it does not make every `Result` of the crate larger).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReplicaDivergence {
    /// What was checked (a parameter's name).
    pub what: String,
    /// The mesh dim whose ranks differ (the first one, in mesh order).
    pub mesh_dim: usize,
    /// Its name, when the mesh names its dims.
    pub dim_name: Option<String>,
    /// Its size.
    pub dim_size: usize,
    /// The ranks (positions in the mesh's row-major order) whose values differ
    /// from those of coordinate 0 of the dim through them.
    pub ranks: Vec<usize>,
    /// The ranks at coordinate 0 of the dim they were compared with.
    pub reference: Vec<usize>,
}

impl fmt::Display for ReplicaDivergence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "replicas of `{}` differ on mesh dim {} (", self.what, self.mesh_dim)?;
        if let Some(name) = &self.dim_name {
            write!(f, "{name}, ")?;
        }
        write!(
            f,
            "size {}): ranks {:?} hold other values than rank 0 of the dim ({:?}); build it identically \
             on every rank (same seed, no rank-dependent code), or pass src_data_rank \
             (distribute_tensor_from) to take one rank's values",
            self.dim_size, self.ranks, self.reference
        )
    }
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
