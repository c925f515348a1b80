//! Modules: [`Module`] (named parameters and a forward), [`Linear`], [`Embedding`],
//! [`LayerNorm`].
//!
//! Parameters are created replicated on a mesh; sharding them is a later step
//! (FSDP or tensor-parallel styles redistribute each parameter's value).

mod hooks;
mod layers;

pub use hooks::{ModuleHooks, has_module_hooks, register_module_hooks, remove_module_hooks};
pub use layers::{Embedding, LayerNorm, Linear};

use tessera_dtensor::{DType, Placement, Tensor, distribute_tensor};
use tessera_mesh::DeviceMesh;

use crate::{Param, Result, Var};

/// A differentiable module: its parameters (named with their state-dict keys, in a
/// fixed order) and its forward.
///
/// PyTorch: `torch.nn.Module` (`named_parameters`, `forward`).
pub trait Module {
    /// Every parameter, in a fixed order.
    fn parameters(&self) -> Vec<Param>;

    /// The forward computation.
    ///
    /// # Errors
    /// Shapes that do not fit, communication failures.
    fn forward(&self, x: &Var) -> Result<Var>;

    /// Calls the module: [`forward`](Self::forward) between the hooks registered
    /// for it (see [`register_module_hooks`]; FSDP registers its units so). Models
    /// call their submodules with `call`, so wrapping a submodule needs no change
    /// to the model.
    ///
    /// PyTorch: `module(x)` (`Module.__call__`).
    ///
    /// # Errors
    /// Whatever forward or a hook fails with.
    fn call(&self, x: &Var) -> Result<Var> {
        hooks::call(self, x)
    }
}

/// A replicated parameter on `mesh` from a full tensor.
pub(crate) fn replicated(name: String, full: &Tensor, mesh: &DeviceMesh) -> Result<Param> {
    let placements = vec![Placement::Replicate; mesh.ndim()];
    Ok(Param::new(name, distribute_tensor(full, mesh, &placements)?))
}

/// A full tensor of `shape` uniform in `[-bound, bound)`.
pub(crate) fn uniform(shape: &[usize], bound: f64, dtype: DType, seed: u64) -> Result<Tensor> {
    Ok(Tensor::rand(shape, DType::F64, seed)?
        .mul_scalar(2.0 * bound)?
        .sub_scalar(bound)?
        .cast(dtype)?)
}

/// Joins a module prefix and a name with a dot (`"layers.0" + "wq"`).
pub fn join(prefix: &str, name: &str) -> String {
    if prefix.is_empty() {
        name.to_string()
    } else {
        format!("{prefix}.{name}")
    }
}
