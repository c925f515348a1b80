//! The error type of `tessera-autograd`.

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

    /// A parameter's unsharded value was used after it was freed (resharded).
    #[error("parameter {0} is resharded (its unsharded value was freed after forward); unshard it before using it")]
    Freed(String),

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
