//! Hooks around a module's forward, run when the module is called through
//! [`Module::call`] (PyTorch runs its hooks in `Module.__call__`, not in `forward`).
//!
//! Hooks attach to a module named by its place in a tree: a [`ModuleId`] is a
//! root and the fully qualified name below it ([`ModuleId::at`]`(root,
//! "layers.0.act")`; [`ModuleId::of`]`(m)` is `m` as its own root, FQN `""`).
//! A Rust value has no lasting address (a model moves into a `Vec`, out of a
//! function, into a `Box`), so a root is recognised by what does not move: its
//! concrete type and the parameter handles of its tree. One module named from
//! different roots is one id: the name is kept from the deepest module on the
//! path that holds parameters, so `at(net, "blocks.1.fc")` and `of(&net.blocks[1].fc)`
//! are equal, and a one-element container differs from its element by type.
//! When a module without parameters (an activation) is called, the call stack of
//! [`Module::call`]s says where it sits below such a module.
//!
//! A module may carry several hooks: `pre_forward`s run in registration order
//! before forward, then `post_forward`s in registration order after it. So a
//! parallelism layer's input preparation and its parameter gathering can sit on
//! one module.

use std::any::{Any, TypeId};
use std::cell::RefCell;
use std::collections::HashMap;
use std::fmt;
use std::hash::{Hash, Hasher};
use std::rc::Rc;

use super::{Inputs, Module, join};
use crate::{Error, ModuleError, Result, Var};

/// What runs around a hooked module's forward.
///
/// PyTorch: `register_forward_pre_hook` / `register_forward_hook`.
pub trait ModuleHooks {
    /// Runs before forward with every input of the call; its result is what
    /// forward (or the next hook) receives.
    ///
    /// # Errors
    /// Whatever the hook fails with; the module's forward does not run.
    fn pre_forward(&self, inputs: Inputs) -> Result<Inputs>;

    /// Runs after forward; its result is what the caller (or the next hook) receives.
    ///
    /// # Errors
    /// Whatever the hook fails with.
    fn post_forward(&self, output: Var) -> Result<Var>;

    /// Runs when forward (or a later hook's `pre_forward`) failed after this hook's
    /// `pre_forward` succeeded, to undo its effects. Hooks are unwound in reverse
    /// registration order.
    fn forward_failed(&self) {}
}

/// How a root is recognised however it moved: its concrete type and the tape
/// leaves of its tree ([`Module::parameters`], by their ids).
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
struct Root {
    ty: TypeId,
    leaves: Vec<u64>,
}

/// A module's place: a root and the fully qualified name below it (`""` for the
/// root itself), the root being the deepest module on the way that holds
/// parameters.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
struct Key {
    root: Root,
    fqn: String,
}

/// The place of a module in a tree, to attach hooks to (see the module docs): a
/// root and the fully qualified name below it. Two ids are equal when they name
/// the same module of a model, however the model was moved.
///
/// PyTorch identifies a module by the Python object and names it by its FQN
/// (`Module.get_submodule(fqn)`); a Rust value moves, so the id is the FQN from a
/// root that is recognised by what it owns.
#[derive(Clone)]
pub struct ModuleId {
    key: Key,
    /// For messages: where the module is or what it holds.
    label: String,
}

impl PartialEq for ModuleId {
    fn eq(&self, other: &Self) -> bool {
        self.key == other.key
    }
}

impl Eq for ModuleId {}

impl Hash for ModuleId {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.key.hash(state);
    }
}

impl fmt::Debug for ModuleId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ModuleId({})", self.label)
    }
}

impl fmt::Display for ModuleId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.label)
    }
}

/// `Linear` for `tessera_autograd::nn::layers::Linear` (generic arguments kept).
fn short_type_name(full: &str) -> &str {
    let base = full.split('<').next().unwrap_or(full);
    let start = base.rfind("::").map_or(0, |i| i + 2);
    &full[start..]
}

/// The concrete type of a module behind `&dyn Module`.
fn type_of(m: &dyn Module) -> TypeId {
    let any: &dyn Any = m;
    any.type_id()
}

/// The data address of a module (its identity while it is borrowed).
fn addr_of<M: ?Sized>(m: &M) -> usize {
    (m as *const M).cast::<()>() as usize
}

/// `m` as a root; `None` when its tree holds no parameters.
fn root_of(m: &(impl Module + ?Sized), ty: TypeId) -> Option<Root> {
    let leaves: Vec<u64> = m.parameters().iter().map(crate::Param::id).collect();
    (!leaves.is_empty()).then_some(Root { ty, leaves })
}

impl ModuleId {
    /// `module` as its own root (FQN `""`); it must hold parameters (in its
    /// subtree) to be recognised.
    ///
    /// # Errors
    /// A module without parameters: name it by its place with [`ModuleId::at`].
    pub fn of(module: &dyn Module) -> Result<ModuleId> {
        let ps = module.parameters();
        let Some(first) = ps.first() else {
            return Err(Error::Config {
                op: "ModuleId::of",
                detail: "the module holds no parameters, so it is known only by its place in a model; \
                         use ModuleId::at(root, \"path.to.module\")"
                    .into(),
            });
        };
        let ty = short_type_name(module.type_name());
        let label = match ps.len() {
            1 => format!("the {ty} holding {}", first.name()),
            n => format!("the {ty} holding {} (and {} more parameters)", first.name(), n - 1),
        };
        let root = Root {
            ty: type_of(module),
            leaves: ps.iter().map(crate::Param::id).collect(),
        };
        Ok(ModuleId {
            key: Key {
                root,
                fqn: String::new(),
            },
            label,
        })
    }

    /// The module at `fqn` below `root` (`""` for `root` itself), with or without
    /// parameters.
    ///
    /// PyTorch: `Module.get_submodule(fqn)`.
    ///
    /// # Errors
    /// No module at `fqn` (the error names the missing part and the children there),
    /// or a parameter-less module none of whose ancestors up to `root` holds
    /// parameters.
    pub fn at(root: &dyn Module, fqn: &str) -> Result<ModuleId> {
        if fqn.is_empty() && !root.parameters().is_empty() {
            return ModuleId::of(root);
        }
        let path = super::module_path(root, fqn)?;
        // The deepest module on the way that holds parameters is the root kept.
        let nodes: Vec<&dyn Module> = std::iter::once(root).chain(path.iter().map(|(_, m)| *m)).collect();
        let Some((i, kept)) = (0..nodes.len())
            .rev()
            .find_map(|i| root_of(nodes[i], type_of(nodes[i])).map(|r| (i, r)))
        else {
            return Err(Error::Config {
                op: "ModuleId::at",
                detail: format!(
                    "module `{fqn}` and every module above it hold no parameters, so it cannot be told apart \
                     from another instance of the model; hooks need a module with parameters at or above it"
                ),
            });
        };
        let rest: Vec<&str> = path[i..].iter().map(|(n, _)| n.as_str()).collect();
        Ok(ModuleId {
            key: Key {
                root: kept,
                fqn: rest.join("."),
            },
            label: format!("`{fqn}`"),
        })
    }
}

/// A registration made by [`register_module_hooks`]; [`remove`](Self::remove) undoes it.
///
/// PyTorch: `torch.utils.hooks.RemovableHandle`.
#[derive(Debug)]
pub struct HookHandle {
    module: ModuleId,
    serial: u64,
}

impl HookHandle {
    /// The module the hooks are attached to.
    pub fn module(&self) -> &ModuleId {
        &self.module
    }

    /// Detaches the hooks; false if they were removed already.
    pub fn remove(&self) -> bool {
        REGISTRY.with(|r| r.borrow_mut().remove(&self.module, self.serial))
    }
}

/// A module's hooks with their registration serials, in registration order.
type HookList = Vec<(u64, Rc<dyn ModuleHooks>)>;

#[derive(Default)]
struct Registry {
    hooks: HashMap<Key, HookList>,
    next: u64,
    /// Registered modules named by a non-empty FQN (parameter-less ones).
    relative: usize,
}

impl Registry {
    fn remove(&mut self, module: &ModuleId, serial: u64) -> bool {
        let Some(list) = self.hooks.get_mut(&module.key) else {
            return false;
        };
        let Some(pos) = list.iter().position(|(s, _)| *s == serial) else {
            return false;
        };
        list.remove(pos);
        if list.is_empty() {
            self.hooks.remove(&module.key);
            if !module.key.fqn.is_empty() {
                self.relative -= 1;
            }
        }
        true
    }
}

/// Lists a called module's children: a type-erased `named_children` of a module
/// borrowed for the duration of its call.
type Lister = dyn Fn() -> Children;

/// A module's children as raw pointers (see [`Lister`]).
type Children = Vec<(String, *const dyn Module)>;

/// A module being called.
struct Frame {
    key: Option<Key>,
    /// The module's fully qualified name below the outermost call, for a
    /// recording rank ([`observe`](tessera_mesh::observe)).
    fqn: Option<std::sync::Arc<str>>,
    /// Valid while the frame is on the stack (see [`FrameGuard`]).
    children: *const Lister,
}

thread_local! {
    static REGISTRY: RefCell<Registry> = RefCell::new(Registry::default());
    static STACK: RefCell<Vec<Frame>> = const { RefCell::new(Vec::new()) };
}

/// Pops its frame when the call ends, however it ends.
struct FrameGuard;

impl Drop for FrameGuard {
    fn drop(&mut self) {
        STACK.with(|s| s.borrow_mut().pop());
    }
}

/// Attaches `hooks` to `module` (on this rank's thread); a module's hooks run in
/// registration order.
///
/// PyTorch: `register_forward_pre_hook` and `register_forward_hook` together.
pub fn register_module_hooks(module: &ModuleId, hooks: Rc<dyn ModuleHooks>) -> HookHandle {
    REGISTRY.with(|r| {
        let mut r = r.borrow_mut();
        let serial = r.next;
        r.next += 1;
        let list = r.hooks.entry(module.key.clone()).or_default();
        let fresh = list.is_empty();
        list.push((serial, hooks));
        if fresh && !module.key.fqn.is_empty() {
            r.relative += 1;
        }
        HookHandle {
            module: module.clone(),
            serial,
        }
    })
}

/// How many hooks are attached to `module`.
pub fn module_hooks_len(module: &ModuleId) -> usize {
    REGISTRY.with(|r| r.borrow().hooks.get(&module.key).map_or(0, Vec::len))
}

/// The place of `m` being called now: `m` as a root when it holds parameters,
/// else its FQN below the module whose call is running.
fn key_of_call<M: Module + ?Sized>(m: &M, relative: bool) -> Option<Key> {
    if let Some(root) = root_of(m, TypeId::of::<M>()) {
        return Some(Key {
            root,
            fqn: String::new(),
        });
    }
    if !relative {
        return None;
    }
    let (parent_key, path) = locate(m, false, |f| f.key.clone())?;
    let path = path?;
    // The deepest module holding parameters on the way down is the root kept.
    let (nodes, names): (Vec<&dyn Module>, Vec<String>) = path.into_iter().map(|(n, c)| (c, n)).unzip();
    match (0..nodes.len() - 1)
        .rev()
        .find_map(|i| root_of(nodes[i], type_of(nodes[i])).map(|r| (i, r)))
    {
        Some((i, root)) => Some(Key {
            root,
            fqn: names[i + 1..].join("."),
        }),
        None => {
            let parent = parent_key?;
            Some(Key {
                fqn: join(&parent.fqn, &names.join(".")),
                root: parent.root,
            })
        }
    }
}

/// The fully qualified name of `m` being called now: `""` for the outermost
/// call, else its path below the module whose call is running (found among
/// that module's descendants by address and type; by its type's name when it
/// is not one of them).
fn fqn_of_call<M: Module + ?Sized>(m: &M) -> std::sync::Arc<str> {
    let Some((Some(parent), path)) = locate(m, true, |f| f.fqn.clone()) else {
        return std::sync::Arc::from("");
    };
    let below = match path {
        Some(path) => path.into_iter().map(|(n, _)| n).collect::<Vec<_>>().join("."),
        None => std::any::type_name::<M>()
            .rsplit("::")
            .next()
            .unwrap_or("module")
            .to_string(),
    };
    std::sync::Arc::from(join(&parent, &below))
}

/// Modules on a path down a tree, each with its name below the one before.
type ModulePath<'a> = Vec<(String, &'a dyn Module)>;

/// What `take` reads of the frame of the call running now, and the path from
/// below its module to the descendant `m` (by address and type; with `loose`,
/// by address alone when the type finds none, as for a call through `dyn
/// Module`). `None` when no call is running.
fn locate<'a, M: Module + ?Sized, T>(
    m: &M,
    loose: bool,
    take: impl FnOnce(&Frame) -> T,
) -> Option<(T, Option<ModulePath<'a>>)> {
    let (taken, children) = STACK.with(|s| s.borrow().last().map(|f| (take(f), f.children)))?;
    // SAFETY: the frame is on the stack, so the call that pushed it is running and
    // the module its lister borrows is alive (frames pop before their call returns).
    let children = unsafe { (*children)() };
    let top = || -> ModulePath<'a> {
        children
            .iter()
            // SAFETY: as above; the children are borrowed from the same live module.
            .map(|(n, c)| (n.clone(), unsafe { &**c }))
            .collect()
    };
    let (want, ty) = (addr_of(m), TypeId::of::<M>());
    let path = find(top(), want, Some(ty)).or_else(|| if loose { find(top(), want, None) } else { None });
    Some((taken, path))
}

/// The path (names and modules) from below a parent to the descendant at address
/// `want` of type `ty`, depth first; with `ty` `None` (a call through `dyn
/// Module`, whose type is not the concrete one), the first module at `want`.
fn find(children: ModulePath<'_>, want: usize, ty: Option<TypeId>) -> Option<ModulePath<'_>> {
    for (name, c) in children {
        if addr_of(c) == want && ty.is_none_or(|t| type_of(c) == t) {
            return Some(vec![(name, c)]);
        }
        if let Some(mut rest) = find(c.named_children(), want, ty) {
            rest.insert(0, (name, c));
            return Some(rest);
        }
    }
    None
}

/// Runs `m`'s forward on `inputs` between its hooks, if any.
pub(crate) fn call<M: Module + ?Sized>(m: &M, inputs: Inputs) -> Result<Var> {
    let (active, relative) = REGISTRY.with(|r| {
        let r = r.borrow();
        (!r.hooks.is_empty(), r.relative > 0)
    });
    let observing = tessera_mesh::observe::active();
    if !active && !observing {
        return m.forward_with(&inputs).map_err(|e| tag(m, e));
    }
    let key = if active { key_of_call(m, relative) } else { None };
    let fqn = observing.then(|| fqn_of_call(m));
    // Memory sampled at the module's edges (and after every op inside), so
    // that what it adds is credited to it: the first sample still to the
    // caller, the last to the module.
    let sample = || {
        if observing {
            tessera_mesh::observe::memory(tessera_tensor::memory::stats().current_bytes as u64);
        }
    };
    sample();
    let _observed = fqn
        .clone()
        .map(|f| tessera_mesh::observe::module(f, tessera_mesh::observe::Phase::Forward));
    let hooks: Vec<Rc<dyn ModuleHooks>> = key.as_ref().map_or_else(Vec::new, |k| {
        REGISTRY.with(|r| {
            r.borrow()
                .hooks
                .get(k)
                .map_or_else(Vec::new, |l| l.iter().map(|(_, h)| h.clone()).collect())
        })
    });
    let lister = || -> Children {
        m.named_children()
            .into_iter()
            .map(|(n, c)| (n, c as *const dyn Module))
            .collect()
    };
    let lister: &(dyn Fn() -> Children + '_) = &lister;
    // SAFETY: only the lifetime is erased; the frame holding the pointer is popped
    // (by the guard) before `lister` and the borrow of `m` end.
    let children: *const Lister =
        unsafe { std::mem::transmute::<&(dyn Fn() -> Vec<(String, *const dyn Module)> + '_), &'static Lister>(lister) };
    STACK.with(|s| s.borrow_mut().push(Frame { key, fqn, children }));
    let _guard = FrameGuard;
    let out = run(m, inputs, &hooks).map_err(|e| tag(m, e));
    sample();
    out
}

/// `e`, leaving the call of `m`, tagged with where it was raised: a new tag
/// naming `m` when `e` was raised in `m`'s own forward or hooks, else the
/// tag's path extended by the names from `m` down to the module it was
/// relative to (found among `m`'s descendants; left for an enclosing call to
/// find when `m` does not hold it). Work done only on failure.
fn tag<M: Module + ?Sized>(m: &M, e: Error) -> Error {
    let here = (addr_of(m), Some(TypeId::of::<M>()));
    match e {
        Error::InModule(mut t) => {
            let (want, ty) = t.at;
            let below = find(m.named_children(), want, ty).or_else(|| find(m.named_children(), want, None));
            if let Some(path) = below {
                t.path.splice(0..0, path.into_iter().map(|(n, _)| n));
                t.at = here;
            }
            Error::InModule(t)
        }
        other => Error::InModule(Box::new(ModuleError {
            path: Vec::new(),
            module_type: std::any::type_name::<M>().rsplit("::").next().unwrap_or("module"),
            at: here,
            error: other,
        })),
    }
}

/// Pre hooks in order, forward, post hooks in order; on failure, the hooks whose
/// pre ran are told, last first.
fn run<M: Module + ?Sized>(m: &M, mut inputs: Inputs, hooks: &[Rc<dyn ModuleHooks>]) -> Result<Var> {
    let unwind = |ran: usize| hooks[..ran].iter().rev().for_each(|h| h.forward_failed());
    for (i, h) in hooks.iter().enumerate() {
        match h.pre_forward(inputs) {
            Ok(y) => inputs = y,
            Err(e) => {
                unwind(i);
                return Err(e);
            }
        }
    }
    let mut out = match m.forward_with(&inputs) {
        Ok(out) => out,
        Err(e) => {
            unwind(hooks.len());
            return Err(e);
        }
    };
    for h in hooks {
        out = h.post_forward(out)?;
    }
    Ok(out)
}
