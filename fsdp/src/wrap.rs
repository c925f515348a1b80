//! Auto-wrapping: [`fully_shard`] applied bottom-up to the modules of a tree that
//! a [`WrapPolicy`] picks, then to the root.

use std::any::{Any, TypeId};
use std::fmt;

use tessera_autograd::nn::{Module, named_modules};
use tessera_mesh::DeviceMesh;

use crate::config::FsdpConfig;
use crate::error::Result;
use crate::fully_shard::{FsdpModule, fully_shard};
use crate::state;

/// Which modules [`auto_wrap`] makes units (the root always becomes one).
///
/// PyTorch: `ModuleWrapPolicy` / `transformer_auto_wrap_policy`, and
/// `size_based_auto_wrap_policy`.
#[derive(Clone)]
pub enum WrapPolicy {
    /// Every module of one of these concrete types (build with
    /// [`WrapPolicy::module`], which lists `Rc<M>` beside `M`).
    ModuleTypes(Vec<(TypeId, &'static str)>),
    /// Every module whose parameters not yet owned by a unit (inside it) hold at
    /// least this many elements.
    MinParams(usize),
}

impl WrapPolicy {
    /// Wrap every module of type `M`, held directly or shared (`Rc<M>`, as
    /// models hold blocks they may recompute: a shared module is the module).
    pub fn module<M: Module>() -> WrapPolicy {
        WrapPolicy::ModuleTypes(Self::types_of::<M>())
    }

    /// `M` and `Rc<M>`, under `M`'s name.
    fn types_of<M: Module>() -> Vec<(TypeId, &'static str)> {
        let name = std::any::type_name::<M>();
        vec![(TypeId::of::<M>(), name), (TypeId::of::<std::rc::Rc<M>>(), name)]
    }

    fn picks(&self, m: &dyn Module, unowned: usize) -> bool {
        if unowned == 0 {
            return false;
        }
        match self {
            WrapPolicy::ModuleTypes(types) => {
                let any: &dyn Any = m;
                types.iter().any(|(t, _)| *t == any.type_id())
            }
            WrapPolicy::MinParams(n) => unowned >= *n,
        }
    }
}

impl fmt::Debug for WrapPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WrapPolicy::ModuleTypes(t) => {
                let mut names: Vec<&str> = t.iter().map(|(_, n)| *n).collect();
                names.dedup();
                write!(f, "ModuleTypes({names:?})")
            }
            WrapPolicy::MinParams(n) => write!(f, "MinParams({n})"),
        }
    }
}

/// Applies [`fully_shard`] with `config` to every module below `root` that
/// `policy` picks, children before parents (so each unit owns the parameters
/// no unit inside it took), then to `root`. Returns the units by fully
/// qualified name in the order they were made (`""`, the root, last).
///
/// PyTorch: FSDP's `auto_wrap_policy`, for `fully_shard`.
///
/// # Errors
/// As [`fully_shard`] for any of the modules (units made before the failing
/// one stay).
pub fn auto_wrap(
    root: &dyn Module,
    mesh: &DeviceMesh,
    config: &FsdpConfig,
    policy: &WrapPolicy,
) -> Result<Vec<(String, FsdpModule)>> {
    let modules = named_modules(root);
    let mut units = Vec::new();
    // Reversed pre-order: every module comes after all its descendants.
    for (name, m) in modules.iter().rev() {
        if name.is_empty() {
            continue;
        }
        let unowned: usize = m
            .parameters()
            .iter()
            .filter(|p| !config.ignored_params.iter().any(|n| *n == p.name()) && state::owner(p.id()).is_none())
            .map(|p| p.shape().iter().product::<usize>())
            .sum();
        if policy.picks(*m, unowned) {
            units.push((name.clone(), fully_shard(*m, mesh, config.clone())?));
        }
    }
    units.push((String::new(), fully_shard(root, mesh, config.clone())?));
    Ok(units)
}
