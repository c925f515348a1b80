//! The error type of `tessera-fsdp`'s `fully_shard`.

/// Errors of [`fully_shard`](crate::fully_shard) and of the units it makes: each
/// names the module, parameter or mesh it is about.
///
/// Inside a forward or backward (a unit's hooks run there), these errors reach the
/// caller as [`tessera_autograd::Error::External`]; [`Error::from`] such an
/// autograd error gives this error back.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A module that cannot become a unit: no parameters, made a unit already,
    /// or sharing parameters with a unit that does not lie inside it.
    #[error("fully_shard of {module}: {detail}")]
    Module {
        /// The module (what it holds, as [`ModuleId`](tessera_autograd::nn::ModuleId) shows it).
        module: String,
        /// What is wrong, and what to do.
        detail: String,
    },

    /// A parameter that cannot be sharded, or that changed between its unit's
    /// forward and backward.
    #[error("parameter {param}: {detail}")]
    Param {
        /// The parameter's name.
        param: String,
        /// What is wrong, and what to do.
        detail: String,
    },

    /// A data-parallel mesh that a unit cannot shard or reduce over.
    #[error("data-parallel mesh {mesh}: {detail}")]
    Mesh {
        /// The mesh (its shape and dim names).
        mesh: String,
        /// What is wrong, and what to do.
        detail: String,
    },

    /// A tensor-parallel plan or style that does not fit the module tree, its
    /// parameters or the mesh (the detail names the module by its FQN, and what to do).
    #[error("parallelize_module: {detail}")]
    TensorParallel {
        /// What is wrong, naming the module, and what to do.
        detail: String,
    },

    /// A parameter's unsharded value was read after its unit freed it.
    #[error("parameter {param} is resharded (its unsharded value was freed after forward); unshard it before using it")]
    Resharded {
        /// The parameter's name.
        param: String,
    },

    /// The tape, a module or an optimizer failed.
    #[error(transparent)]
    Autograd(tessera_autograd::Error),

    /// A tensor operation failed.
    #[error(transparent)]
    Tensor(#[from] tessera_dtensor::Error),

    /// A communicator failed.
    #[error(transparent)]
    Comm(#[from] tessera_mesh::Error),
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl From<tessera_tensor::Error> for Error {
    /// A local tensor error, as the DTensor error that wraps it.
    fn from(e: tessera_tensor::Error) -> Error {
        Error::Tensor(e.into())
    }
}

impl From<tessera_autograd::Error> for Error {
    /// The autograd error, or what it carries: an error of this crate (a unit's
    /// hook that failed inside a forward or backward), a tensor or communicator error.
    fn from(e: tessera_autograd::Error) -> Error {
        match e {
            tessera_autograd::Error::External(source) => match source.downcast::<Error>() {
                Ok(mine) => *mine,
                Err(other) => Error::Autograd(tessera_autograd::Error::External(other)),
            },
            tessera_autograd::Error::Tensor(e) => Error::Tensor(e),
            tessera_autograd::Error::Comm(e) => Error::Comm(e),
            other => Error::Autograd(other),
        }
    }
}

impl From<Error> for tessera_autograd::Error {
    /// What a unit's hook reports to the tape: the autograd, tensor or
    /// communicator error it carries, or this error as
    /// [`tessera_autograd::Error::External`].
    fn from(e: Error) -> tessera_autograd::Error {
        match e {
            Error::Autograd(inner) => inner,
            Error::Tensor(e) => tessera_autograd::Error::Tensor(e),
            Error::Comm(e) => tessera_autograd::Error::Comm(e),
            other => tessera_autograd::Error::External(Box::new(other)),
        }
    }
}

impl Error {
    /// A [`Error::Param`] error.
    pub(crate) fn param(param: &str, detail: impl Into<String>) -> Error {
        Error::Param {
            param: param.to_string(),
            detail: detail.into(),
        }
    }

    /// A [`Error::Mesh`] error.
    pub(crate) fn mesh(mesh: &tessera_mesh::DeviceMesh, detail: impl Into<String>) -> Error {
        Error::Mesh {
            mesh: mesh.to_string(),
            detail: detail.into(),
        }
    }

    /// A [`Error::Module`] error.
    pub(crate) fn module(module: impl Into<String>, detail: impl Into<String>) -> Error {
        Error::Module {
            module: module.into(),
            detail: detail.into(),
        }
    }
}
