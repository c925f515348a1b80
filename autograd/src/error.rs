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

    /// An error raised inside a module's forward, with the module it was raised
    /// in: its fully qualified name below the outermost module called and its
    /// type ([`ModuleError`]). [`Error::innermost`] is the error itself.
    ///
    /// PyTorch names no module; its traceback shows the `forward` frames.
    #[error("{0}")]
    InModule(Box<ModuleError>),
}

impl Error {
    /// The error as raised: for [`Error::InModule`] the one inside the module,
    /// else `self`.
    pub fn innermost(&self) -> &Error {
        match self {
            Error::InModule(m) => m.error(),
            other => other,
        }
    }
}

/// Where an error was raised: the module whose forward raised it (by the
/// innermost module call running), named by its path below the outermost
/// module called. The path is resolved as the error leaves each enclosing
/// call (nothing is kept while calls succeed).
#[derive(Debug)]
pub struct ModuleError {
    /// Names from below the outermost module resolved so far down to the module.
    pub(crate) path: Vec<String>,
    /// The short name of the module's type.
    pub(crate) module_type: &'static str,
    /// The module the path is relative to: the last call the error left
    /// (address and type, `None` through `dyn Module`).
    pub(crate) at: (usize, Option<std::any::TypeId>),
    pub(crate) error: Error,
}

impl ModuleError {
    /// The module's fully qualified name (`layers.0.attention`), as
    /// `named_modules` gives it; empty for the outermost module.
    pub fn fqn(&self) -> String {
        self.path.join(".")
    }

    /// The short name of the module's type (`Attention`).
    pub fn module_type(&self) -> &str {
        self.module_type
    }

    /// The error raised inside the module.
    pub fn error(&self) -> &Error {
        &self.error
    }
}

impl std::fmt::Display for ModuleError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.path.is_empty() {
            write!(f, "in the outermost module ({}): {}", self.module_type, self.error)
        } else {
            write!(f, "in module {} ({}): {}", self.fqn(), self.module_type, self.error)
        }
    }
}

impl std::error::Error for ModuleError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

impl From<tessera_tensor::Error> for Error {
    /// A local tensor error, as the DTensor error that wraps it.
    fn from(e: tessera_tensor::Error) -> Error {
        Error::Tensor(e.into())
    }
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
