//! The inputs of a module call: positional inputs, then named ones.

use crate::{Error, Result, Var};

/// Which input of a call: the `i`-th positional one, or a named one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InputSlot<'a> {
    /// The positional input at this index.
    Positional(usize),
    /// The named input.
    Named(&'a str),
}

impl std::fmt::Display for InputSlot<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            InputSlot::Positional(i) => write!(f, "positional input {i}"),
            InputSlot::Named(n) => write!(f, "input `{n}`"),
        }
    }
}

/// What a module is called with: positional inputs in order, then named ones
/// (token ids and positions, an attention mask, a cache). Hooks see and may
/// replace every one of them ([`ModuleHooks::pre_forward`](super::ModuleHooks::pre_forward)).
/// A single [`Var`] converts into one positional input.
///
/// ```
/// use tessera_autograd::nn::Inputs;
/// use tessera_autograd::Var;
/// use tessera_dtensor::{distribute_tensor, DType, Placement, Tensor};
/// use tessera_mesh::{launch, DeviceMesh};
///
/// launch(1, |ctx| {
///     let mesh = DeviceMesh::new(ctx.into_comm(), &[1])?;
///     let x = Var::constant(distribute_tensor(&Tensor::ones(&[2, 3], DType::F32)?, &mesh, &[Placement::Replicate])?);
///     let pos = Var::constant(distribute_tensor(&Tensor::arange(3, DType::I64)?, &mesh, &[Placement::Replicate])?);
///     let inputs = Inputs::from(&x).kwarg("positions", &pos);
///     assert_eq!(inputs.args().len(), 1);
///     assert_eq!(inputs.named("positions").map(|p| p.value().shape().to_vec()), Some(vec![3]));
///     assert!(inputs.require("mask").is_err());
///     Ok(())
/// })?;
/// # Ok::<(), tessera_mesh::Error>(())
/// ```
///
/// PyTorch: a forward's `*args` and `**kwargs`.
#[derive(Clone, Default)]
pub struct Inputs {
    args: Vec<Var>,
    kwargs: Vec<(String, Var)>,
}

impl From<Var> for Inputs {
    fn from(x: Var) -> Inputs {
        Inputs {
            args: vec![x],
            kwargs: Vec::new(),
        }
    }
}

impl From<&Var> for Inputs {
    fn from(x: &Var) -> Inputs {
        Inputs::from(x.clone())
    }
}

impl Inputs {
    /// No inputs.
    pub fn new() -> Inputs {
        Inputs::default()
    }

    /// These inputs and `x` as the next positional input.
    #[must_use]
    pub fn arg(mut self, x: &Var) -> Inputs {
        self.args.push(x.clone());
        self
    }

    /// These inputs and `x` as the input named `name` (replacing one of that name).
    #[must_use]
    pub fn kwarg(mut self, name: &str, x: &Var) -> Inputs {
        match self.kwargs.iter_mut().find(|(n, _)| n == name) {
            Some((_, v)) => *v = x.clone(),
            None => self.kwargs.push((name.to_string(), x.clone())),
        }
        self
    }

    /// The positional inputs, in order.
    pub fn args(&self) -> &[Var] {
        &self.args
    }

    /// The named inputs, in the order they were given.
    pub fn kwargs(&self) -> &[(String, Var)] {
        &self.kwargs
    }

    /// The named input `name`, if given.
    pub fn named(&self, name: &str) -> Option<&Var> {
        self.kwargs.iter().find(|(n, _)| n == name).map(|(_, v)| v)
    }

    /// The positional input `i`.
    ///
    /// # Errors
    /// Fewer than `i + 1` positional inputs; the message lists what was given.
    pub fn get(&self, i: usize) -> Result<&Var> {
        self.args.get(i).ok_or_else(|| Error::Config {
            op: "module input",
            detail: format!(
                "the forward needs positional input {i} but was called with {}",
                self.describe()
            ),
        })
    }

    /// The named input `name`.
    ///
    /// # Errors
    /// No input of that name; the message lists what was given.
    pub fn require(&self, name: &str) -> Result<&Var> {
        self.named(name).ok_or_else(|| Error::Config {
            op: "module input",
            detail: format!(
                "the forward needs the input `{name}` but was called with {}",
                self.describe()
            ),
        })
    }

    /// The one input of a single-input call.
    ///
    /// # Errors
    /// Anything but exactly one positional input and no named ones: a module
    /// whose forward takes more implements [`Module::forward_with`](super::Module::forward_with).
    pub fn single(&self) -> Result<&Var> {
        match (&self.args[..], self.kwargs.is_empty()) {
            ([x], true) => Ok(x),
            _ => Err(Error::Config {
                op: "module input",
                detail: format!(
                    "the module's forward takes one input but was called with {}; a module taking \
                     several implements Module::forward_with",
                    self.describe()
                ),
            }),
        }
    }

    /// Every input passed through `f` with its slot (positional ones first):
    /// what a hook that lays out or casts inputs does.
    ///
    /// # Errors
    /// The first error of `f`.
    pub fn map(self, mut f: impl FnMut(InputSlot<'_>, Var) -> Result<Var>) -> Result<Inputs> {
        let args = self
            .args
            .into_iter()
            .enumerate()
            .map(|(i, x)| f(InputSlot::Positional(i), x))
            .collect::<Result<Vec<_>>>()?;
        let kwargs = self
            .kwargs
            .into_iter()
            .map(|(n, x)| {
                let y = f(InputSlot::Named(&n), x)?;
                Ok((n, y))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Inputs { args, kwargs })
    }

    /// "2 positional inputs and `mask`", for messages.
    fn describe(&self) -> String {
        let n = self.args.len();
        let pos = format!("{n} positional input{}", if n == 1 { "" } else { "s" });
        if self.kwargs.is_empty() {
            return pos;
        }
        let names: Vec<String> = self.kwargs.iter().map(|(k, _)| format!("`{k}`")).collect();
        format!("{pos} and {}", names.join(", "))
    }
}
