//! Hooks around a module's forward, run when the module is called through
//! [`Module::call`] (PyTorch runs its hooks in `Module.__call__`, not in `forward`).
//!
//! A module is identified by its parameters: hooks registered for a parameter list
//! run for any module whose [`Module::parameters`] returns exactly that list. FSDP
//! registers its units this way, so a model needs no change beyond calling its
//! submodules with `call`.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

use super::Module;
use crate::{Error, Param, Result, Var};

/// What runs around a hooked module's forward.
///
/// PyTorch: `register_forward_pre_hook` / `register_forward_hook`.
pub trait ModuleHooks {
    /// Runs before forward; its result is what forward receives.
    ///
    /// # Errors
    /// Whatever the hook fails with; the module's forward does not run.
    fn pre_forward(&self, input: &Var) -> Result<Var>;

    /// Runs after forward; its result is what the caller receives.
    ///
    /// # Errors
    /// Whatever the hook fails with.
    fn post_forward(&self, output: Var) -> Result<Var>;

    /// Runs when forward failed, after `pre_forward` succeeded (to undo its effects).
    fn forward_failed(&self) {}
}

type Key = Vec<u64>;

thread_local! {
    static HOOKS: RefCell<HashMap<Key, Rc<dyn ModuleHooks>>> = RefCell::new(HashMap::new());
}

fn key(params: &[Param]) -> Key {
    params.iter().map(Param::id).collect()
}

/// Registers `hooks` for the module whose parameters are `params` (on this rank's
/// thread).
///
/// # Errors
/// An empty parameter list, or hooks already registered for the same list.
pub fn register_module_hooks(params: &[Param], hooks: Rc<dyn ModuleHooks>) -> Result<()> {
    if params.is_empty() {
        return Err(Error::Config {
            op: "register_module_hooks",
            detail: "the module has no parameters, so it cannot be identified".into(),
        });
    }
    HOOKS.with(|h| {
        let mut h = h.borrow_mut();
        let k = key(params);
        if h.contains_key(&k) {
            return Err(Error::Config {
                op: "register_module_hooks",
                detail: format!(
                    "hooks are already registered for the module holding {} (and {} more parameters)",
                    params[0].name(),
                    params.len() - 1
                ),
            });
        }
        h.insert(k, hooks);
        Ok(())
    })
}

/// Whether hooks are registered for the module whose parameters are `params`.
pub fn has_module_hooks(params: &[Param]) -> bool {
    HOOKS.with(|h| h.borrow().contains_key(&key(params)))
}

/// Removes the hooks registered for `params`, returning whether there were any.
pub fn remove_module_hooks(params: &[Param]) -> bool {
    HOOKS.with(|h| h.borrow_mut().remove(&key(params)).is_some())
}

/// Runs `m`'s forward on `x` between its registered hooks, if any.
pub(crate) fn call<M: Module + ?Sized>(m: &M, x: &Var) -> Result<Var> {
    if HOOKS.with(|h| h.borrow().is_empty()) {
        return m.forward(x);
    }
    let hooks = HOOKS.with(|h| h.borrow().get(&key(&m.parameters())).cloned());
    let Some(hooks) = hooks else {
        return m.forward(x);
    };
    let x = hooks.pre_forward(x)?;
    match m.forward(&x) {
        Ok(out) => hooks.post_forward(out),
        Err(e) => {
            hooks.forward_failed();
            Err(e)
        }
    }
}
