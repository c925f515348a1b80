//! The error type of `tessera-tensor`.

use tessera_mesh::DType;

/// Errors from local tensors and their kernels.
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

    /// Memory for a tensor could not be allocated: its byte count overflows, exceeds
    /// what one allocation may hold (`isize::MAX` bytes), or the system refused it.
    #[error(
        "{op}: cannot allocate {} for a {shape:?} {dtype} tensor; use a smaller shape or \
         dtype, or shard the tensor over more ranks",
        bytes_text(.bytes)
    )]
    OutOfMemory {
        /// The operation.
        op: &'static str,
        /// The shape of the tensor (or buffer) that was to be allocated.
        shape: Vec<usize>,
        /// Its element type.
        dtype: DType,
        /// The bytes it needs; `None` when even that count overflows 128 bits.
        bytes: Option<u128>,
    },

    /// The operation needs its tensors on another device, or the device failed
    /// (a CUDA library that cannot be loaded, a driver error, device memory
    /// exhausted).
    #[error("{op}: {detail}")]
    Device {
        /// The operation.
        op: &'static str,
        /// What was wrong and what to do.
        detail: String,
    },
}

/// "4398046511104 bytes", or "more than 2^128 bytes" when the count overflowed.
fn bytes_text(bytes: &Option<u128>) -> String {
    match bytes {
        Some(b) => format!("{b} bytes"),
        None => "more than 2^128 bytes".to_string(),
    }
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
