//! Modules: [`Module`] (a tree of named children and parameters, and a forward),
//! [`named_modules`], [`Linear`], [`Embedding`], [`LayerNorm`], [`RMSNorm`]; names from the
//! tree ([`name_parameters`]); init schemes ([`Init`]) and materialising a
//! deferred model ([`Materializer`]).
//!
//! Layers are built *deferred*: their parameters know shape, dtype and mesh
//! (replicated) but hold no storage. Sharding them is a later step that only
//! decides placements (tensor parallelism, FSDP); [`Materializer`] then
//! allocates each rank's local shard and fills it, so no rank ever holds a whole
//! model it does not need.

mod hooks;
pub mod init;
mod inputs;
mod layers;
mod materialize;
mod names;

pub use hooks::{HookHandle, ModuleHooks, ModuleId, module_hooks_len, register_module_hooks};
pub use init::{FanMode, Init, Nonlinearity};
pub use inputs::{InputSlot, Inputs};
pub use layers::{Dropout, Embedding, LayerNorm, Linear, ParameterDict, RMSNorm};
pub use materialize::{MaterializeReport, Materializer, verify_replicas};
pub use names::{fqn_matches, name_parameters};

use std::any::Any;

use crate::{Error, Param, Result, Var};

/// A differentiable module: a forward, its own parameters and its named children,
/// forming a tree as `torch.nn.Module`s do.
///
/// A module implements [`forward`](Self::forward) and lists what it holds:
/// [`own_parameters`](Self::own_parameters) (the parameters it holds directly, by
/// local name: `"weight"`) and [`named_children`](Self::named_children) (its
/// submodules, by field name: `"attention"`). Everything else is derived from that
/// tree: [`parameters`](Self::parameters), [`named_parameters`](Self::named_parameters)
/// (fully qualified names such as `layers.0.attention.wq.weight`, equal to the
/// state-dict keys of the layers in this crate) and [`named_modules`].
///
/// ```
/// use tessera_autograd::nn::{named_modules, Linear, Module};
/// use tessera_autograd::{Param, Result, Var};
/// use tessera_dtensor::DType;
/// use tessera_mesh::{launch, DeviceMesh};
///
/// /// Two layers with an activation between them.
/// struct Mlp {
///     up: Linear,
///     down: Linear,
/// }
///
/// impl Module for Mlp {
///     fn named_children(&self) -> Vec<(String, &dyn Module)> {
///         vec![("up".into(), &self.up), ("down".into(), &self.down)]
///     }
///     fn forward(&self, x: &Var) -> Result<Var> {
///         self.down.call(&self.up.call(x)?.gelu()?)
///     }
/// }
///
/// launch(1, |ctx| {
///     let mesh = DeviceMesh::new(ctx.into_comm(), &[1])?;
///     let mlp = Mlp {
///         up: Linear::new(4, 8, true, &mesh, DType::F32)?,
///         down: Linear::new(8, 4, false, &mesh, DType::F32)?,
///     };
///     let names: Vec<String> = mlp.named_parameters().into_iter().map(|(n, _)| n).collect();
///     assert_eq!(names, ["up.weight", "up.bias", "down.weight"]);
///     let modules: Vec<String> = named_modules(&mlp).into_iter().map(|(n, _)| n).collect();
///     assert_eq!(modules, ["", "up", "down"]);
///     Ok(())
/// })?;
/// # Ok::<(), tessera_mesh::Error>(())
/// ```
///
/// That is all a model needs for a parallelism layer: it finds modules by their
/// fully qualified names and acts through hooks that [`call`](Self::call) runs (so
/// a model calls its submodules with `call`, not `forward`); the layers in this
/// crate are what such a layer splits.
///
/// Modules are `'static` types (they own their parameters), so a module behind
/// `&dyn Module` can be downcast (`(m as &dyn Any).downcast_ref::<Linear>()`), as
/// tensor-parallel styles do to find the layers they shard.
///
/// PyTorch: `torch.nn.Module` (`forward`, `named_children`, `named_parameters`,
/// `named_modules`).
pub trait Module: Any {
    /// The parameters this module holds directly (not its children's), by local
    /// name, in a fixed order. Default: none.
    ///
    /// PyTorch: `named_parameters(recurse=False)`.
    fn own_parameters(&self) -> Vec<(String, Param)> {
        Vec::new()
    }

    /// How [`Materializer::from_seed`] initialises the own parameter `param`
    /// (a local name from [`own_parameters`](Self::own_parameters)) unless a
    /// rule says otherwise; `None`: no default (materialising it then needs a
    /// rule). Default: none.
    ///
    /// PyTorch: a module's `reset_parameters`.
    fn init_scheme(&self, param: &str) -> Option<Init> {
        let _ = param;
        None
    }

    /// The module's type, for messages (`std::any::type_name` of the
    /// implementing type; not meant to be overridden).
    fn type_name(&self) -> &'static str {
        std::any::type_name::<Self>()
    }

    /// The direct submodules, by name, in a fixed order. Default: none.
    ///
    /// PyTorch: `named_children`.
    fn named_children(&self) -> Vec<(String, &dyn Module)> {
        Vec::new()
    }

    /// The forward computation of a single input.
    ///
    /// # Errors
    /// Shapes that do not fit, communication failures.
    fn forward(&self, x: &Var) -> Result<Var>;

    /// The forward computation of a call with several inputs (positional and
    /// named: tokens and positions, a mask, a cache); [`call_with`](Self::call_with)
    /// runs it between the hooks. Default: [`forward`](Self::forward) of the one
    /// positional input, an error for anything else. A module taking several
    /// inputs overrides this and keeps `forward` for its one-input use (or an
    /// error naming what it needs).
    ///
    /// PyTorch: `forward(*args, **kwargs)`.
    ///
    /// # Errors
    /// As [`forward`](Self::forward); inputs the module does not take.
    fn forward_with(&self, inputs: &Inputs) -> Result<Var> {
        self.forward(inputs.single()?)
    }

    /// Every parameter of the tree by fully qualified name (`child.grandchild.local`):
    /// this module's own first, then each child's, depth first; a parameter
    /// reachable under several names (tied weights) only under its first.
    /// Derived from the tree: a module lists [`own_parameters`](Self::own_parameters)
    /// and [`named_children`](Self::named_children) rather than overriding this
    /// (naming, materialising and FSDP walk the tree itself).
    ///
    /// PyTorch: `named_parameters`.
    fn named_parameters(&self) -> Vec<(String, Param)> {
        names::dedup(self.named_parameters_with_duplicates())
    }

    /// Every parameter of the tree under every fully qualified name it is
    /// reachable by, depth first (a tied parameter appears once per name).
    ///
    /// PyTorch: `named_parameters(remove_duplicate=False)`.
    fn named_parameters_with_duplicates(&self) -> Vec<(String, Param)> {
        let mut out = self.own_parameters();
        for (name, child) in self.named_children() {
            out.extend(
                child
                    .named_parameters_with_duplicates()
                    .into_iter()
                    .map(|(n, p)| (join(&name, &n), p)),
            );
        }
        out
    }

    /// Every parameter of the tree, in [`named_parameters`](Self::named_parameters) order.
    ///
    /// PyTorch: `parameters`.
    fn parameters(&self) -> Vec<Param> {
        self.named_parameters().into_iter().map(|(_, p)| p).collect()
    }

    /// Calls the module with one input: [`forward_with`](Self::forward_with) (by
    /// default [`forward`](Self::forward)) between the hooks attached to
    /// it (see [`register_module_hooks`]; a parallelism layer attaches its hooks
    /// so). Models call their submodules with `call`, so wrapping a
    /// submodule needs no change to the model.
    ///
    /// PyTorch: `module(x)` (`Module.__call__`).
    ///
    /// # Errors
    /// Whatever forward or a hook fails with.
    #[track_caller]
    fn call(&self, x: &Var) -> Result<Var> {
        let _site = tessera_mesh::callsite::enter();
        hooks::call(self, Inputs::from(x))
    }

    /// Calls the module with several inputs: [`forward_with`](Self::forward_with)
    /// between the hooks, which see every input.
    ///
    /// PyTorch: `module(*args, **kwargs)`.
    ///
    /// # Errors
    /// Whatever forward or a hook fails with.
    #[track_caller]
    fn call_with(&self, inputs: Inputs) -> Result<Var> {
        let _site = tessera_mesh::callsite::enter();
        hooks::call(self, inputs)
    }
}

/// `root` and every module below it, by fully qualified name (`""` for `root`),
/// parents before children.
///
/// PyTorch: `Module.named_modules`.
pub fn named_modules(root: &dyn Module) -> Vec<(String, &dyn Module)> {
    let mut out = vec![(String::new(), root)];
    let mut i = 0;
    while i < out.len() {
        let (prefix, m) = (out[i].0.clone(), out[i].1);
        let children: Vec<(String, &dyn Module)> = m
            .named_children()
            .into_iter()
            .map(|(n, c)| (join(&prefix, &n), c))
            .collect();
        // Depth first: a module's children come right after it.
        out.splice(i + 1..i + 1, children);
        i += 1;
    }
    out
}

/// The module at `fqn` below `root` (`""` is `root`).
///
/// PyTorch: `Module.get_submodule`.
///
/// # Errors
/// No module at `fqn`: the error names the first missing part and the children
/// that exist there.
pub fn get_submodule<'a>(root: &'a dyn Module, fqn: &str) -> Result<&'a dyn Module> {
    Ok(module_path(root, fqn)?.last().map_or(root, |(_, m)| *m))
}

/// The modules on the way from `root` down to `fqn` (`root` excluded), with their
/// local names.
pub(crate) fn module_path<'a>(root: &'a dyn Module, fqn: &str) -> Result<Vec<(String, &'a dyn Module)>> {
    let mut out: Vec<(String, &'a dyn Module)> = Vec::new();
    if fqn.is_empty() {
        return Ok(out);
    }
    let mut here = root;
    for (i, part) in fqn.split('.').enumerate() {
        let children = here.named_children();
        let Some((name, child)) = children.iter().find(|(n, _)| n == part).cloned() else {
            let at = fqn.split('.').take(i).collect::<Vec<_>>().join(".");
            let names: Vec<&str> = children.iter().map(|(n, _)| n.as_str()).collect();
            return Err(Error::Config {
                op: "get_submodule",
                detail: format!(
                    "no module `{fqn}`: {} has no child `{part}` (its children: {names:?})",
                    if at.is_empty() {
                        "the root".to_string()
                    } else {
                        format!("`{at}`")
                    }
                ),
            });
        };
        out.push((name, child));
        here = child;
    }
    Ok(out)
}

/// A list of modules, run one after another; children are named by index (`"0"`,
/// `"1"`, ...).
///
/// PyTorch: `torch.nn.ModuleList` (its children) and `torch.nn.Sequential` (its forward).
impl<M: Module> Module for Vec<M> {
    fn named_children(&self) -> Vec<(String, &dyn Module)> {
        self.iter()
            .enumerate()
            .map(|(i, m)| (i.to_string(), m as &dyn Module))
            .collect()
    }

    fn forward(&self, x: &Var) -> Result<Var> {
        self.iter().try_fold(x.clone(), |h, m| m.call(&h))
    }
}

/// A module shared by reference counting is that module: the same
/// parameters, children and forward. A model holds a submodule in an `Rc` so
/// that a computation kept for backward can call it again, as
/// [`checkpoint`](crate::checkpoint) does to recompute a block; hooks attach to
/// the `Rc` (the module the tree lists), so every call goes through it.
impl<M: Module> Module for std::rc::Rc<M> {
    fn own_parameters(&self) -> Vec<(String, Param)> {
        (**self).own_parameters()
    }

    fn init_scheme(&self, param: &str) -> Option<Init> {
        (**self).init_scheme(param)
    }

    fn type_name(&self) -> &'static str {
        (**self).type_name()
    }

    fn named_children(&self) -> Vec<(String, &dyn Module)> {
        (**self).named_children()
    }

    fn forward(&self, x: &Var) -> Result<Var> {
        (**self).forward(x)
    }

    fn forward_with(&self, inputs: &Inputs) -> Result<Var> {
        (**self).forward_with(inputs)
    }
}

/// Joins a module prefix and a name with a dot (`"layers.0" + "wq"`).
pub fn join(prefix: &str, name: &str) -> String {
    if prefix.is_empty() {
        name.to_string()
    } else {
        format!("{prefix}.{name}")
    }
}

#[cfg(test)]
mod tests {
    use tessera_dtensor::{DType, Placement, Tensor, distribute_tensor};
    use tessera_mesh::{DeviceMesh, launch};

    use super::*;

    #[test]
    fn a_list_of_modules_names_its_children_by_index_and_runs_them_in_order() {
        launch(1, |ctx| {
            let mesh = DeviceMesh::new(ctx.into_comm(), &[1])?;
            let list = vec![
                Linear::new(3, 4, true, &mesh, DType::F32)?,
                Linear::new(4, 2, false, &mesh, DType::F32)?,
            ];
            Materializer::from_seed(0).materialize(&list)?;
            let names: Vec<String> = list.named_parameters().into_iter().map(|(n, _)| n).collect();
            assert_eq!(names, ["0.weight", "0.bias", "1.weight"]);
            let modules: Vec<String> = named_modules(&list).into_iter().map(|(n, _)| n).collect();
            assert_eq!(modules, ["", "0", "1"]);
            assert!(list.own_parameters().is_empty());
            let x = Var::constant(distribute_tensor(
                &Tensor::randn(&[5, 3], DType::F32, 9)?,
                &mesh,
                &[Placement::Replicate],
            )?);
            let chained = list[1].forward(&list[0].forward(&x)?)?;
            assert_eq!(list.forward(&x)?.value().full_tensor()?, chained.value().full_tensor()?);
            Ok(())
        })
        .unwrap();
    }
}

#[cfg(test)]
mod hook_tests;
