//! The error type of `tessera-autograd`.

/// A boxed error of another crate, carried by [`Error::External`].
pub use tessera_mesh::BoxError;

/// Errors from the tape, modules and optimizers.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A tensor operation failed.
    #[error(transparent)]
    Tensor(#[from] tessera_dtensor::Error),

    /// A communicator failed.
    #[error(transparent)]
    Comm(#[from] tessera_mesh::Error),

    /// `backward` called on something it cannot differentiate.
    #[error("backward: {0}")]
    Backward(String),

    /// A layer above the tape failed with its own error inside the tape's work: a
    /// [`SavedHandle`](crate::SavedHandle) that could not produce a saved operand,
    /// a [`Binding`](crate::Binding)'s gradient hook, a module hook or a queued
    /// callback. The message is the source's.
    ///
    /// PyTorch: the exception an `unpack` hook or a module hook raises, propagated
    /// unchanged.
    #[error(transparent)]
    External(BoxError),

    /// A deferred parameter (no storage yet) used as a value.
    #[error("parameter {name} is deferred: {detail}")]
    Deferred {
        /// The parameter's name.
        name: String,
        /// Its layout and what to do.
        detail: String,
    },

    /// A state dict that does not fit the module, or a file that is not a valid
    /// safetensors file.
    #[error("state dict: {0}")]
    StateDict(String),

    /// Reading or writing a file failed.
    #[error("{}: {action}: {source}", path.display())]
    Io {
        /// The file.
        path: std::path::PathBuf,
        /// What failed ("cannot read", "cannot create", "write failed", ...).
        action: &'static str,
        /// The system's error.
        source: std::io::Error,
    },

    /// Bad optimizer or module configuration.
    #[error("{op}: {detail}")]
    Config {
        /// What was configured.
        op: &'static str,
        /// What was wrong.
        detail: String,
    },
}

impl From<tessera_tensor::Error> for Error {
    /// A local tensor error, as the DTensor error that wraps it.
    fn from(e: tessera_tensor::Error) -> Error {
        Error::Tensor(e.into())
    }
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
