//! The tensor-parallel styles: what each does to a module's parameters, and the
//! hooks that lay out its input and output on the tp mesh dim.

use std::any::Any;
use std::fmt;
use std::rc::Rc;

use tessera_autograd::nn::{
    Embedding, InputSlot, Inputs, LayerNorm, Linear, Module, ModuleHooks, ModuleId, RMSNorm, register_module_hooks,
};
use tessera_autograd::{Param, Result, Var};
use tessera_dtensor::{Layout, Placement, ReduceOp};
use tessera_mesh::DeviceMesh;

use super::{at, tp_dim, tp_error};

/// [`tp_error`] as the tape's error, for styles' steps that run inside module hooks
/// (the message is the same: autograd carries it as an external error).
fn style_error(detail: String) -> tessera_autograd::Error {
    tp_error(detail).into()
}

/// A placement on the tp mesh dim, with `Shard` counted from the end when
/// negative (`Shard(-1)`: the last dim), as PyTorch writes layouts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TpLayout {
    /// Every tp rank holds the whole tensor.
    Replicate,
    /// Split along this tensor dim (negative: from the end).
    Shard(isize),
    /// Every tp rank holds a partial sum.
    Partial,
}

impl TpLayout {
    /// The placement for a tensor of rank `rank`.
    fn resolve(self, rank: usize, fqn: &str, what: &str) -> Result<Placement> {
        Ok(match self {
            TpLayout::Replicate => Placement::Replicate,
            TpLayout::Partial => Placement::Partial(ReduceOp::Sum),
            TpLayout::Shard(d) => {
                let dim = if d < 0 { rank as isize + d } else { d };
                if dim < 0 || dim >= rank as isize {
                    return Err(style_error(format!(
                        "{}: {what} layout Shard({d}) does not fit a tensor of rank {rank}",
                        at(fqn)
                    )));
                }
                Placement::Shard(dim as usize)
            }
        })
    }
}

impl fmt::Display for TpLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TpLayout::Replicate => f.write_str("Replicate"),
            TpLayout::Shard(d) => write!(f, "Shard({d})"),
            TpLayout::Partial => f.write_str("Partial"),
        }
    }
}

/// Where a style is being applied: the module's name and the tp mesh.
pub struct StyleCtx<'a> {
    /// The module's fully qualified name in the model.
    pub fqn: &'a str,
    /// The model root the plan was applied to.
    pub root: &'a dyn Module,
    /// The 1-D tensor-parallel mesh.
    pub tp_mesh: &'a DeviceMesh,
}

/// A way to parallelize one module over the tp mesh dim.
///
/// [`parallelize_module`](super::parallelize_module) first calls
/// [`check`](Self::check) for every planned module, then [`apply`](Self::apply),
/// so a plan that does not fit changes nothing.
///
/// PyTorch: `torch.distributed.tensor.parallel.ParallelStyle`.
pub trait ParallelStyle: fmt::Debug {
    /// Whether the style fits `module` (type, parameters, layouts); changes nothing.
    ///
    /// # Errors
    /// A module type the style does not support, parameters that are not
    /// replicated on the tp dim or live on a mesh without it; each naming the module.
    /// Default: fits any module (a style that changes no parameters).
    fn check(&self, _module: &dyn Module, _ctx: &StyleCtx<'_>) -> Result<()> {
        Ok(())
    }

    /// Shards the module's parameters and attaches its input/output hooks.
    ///
    /// # Errors
    /// As [`check`](Self::check), and redistribution failures.
    fn apply(&self, module: &dyn Module, ctx: &StyleCtx<'_>) -> Result<()>;
}

/// Column-wise parallel: a `Linear`'s weight `[out, in]` and bias are `Shard(0)`
/// on the tp dim (each rank computes some output features); an `Embedding`'s table
/// `[num, dim]` is `Shard(1)` (each rank holds some embedding columns).
///
/// Input: expected in `input_layouts` (default `Replicate`), redistributed to
/// `Replicate`. Output: `Shard(-1)` as computed, redistributed to `output_layouts`
/// (default `Shard(-1)`).
///
/// PyTorch: `ColwiseParallel`. Its `use_local_output` has no counterpart: outputs
/// stay DTensors, so the code after a parallel layer is written with global shapes
/// and runs on the local shards (attention after column-parallel q/k/v runs
/// `n_heads / tp` heads per rank with no change to the model).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ColwiseParallel {
    /// The layout the input arrives in.
    pub input_layouts: TpLayout,
    /// The layout the output is handed on in.
    pub output_layouts: TpLayout,
}

impl Default for ColwiseParallel {
    fn default() -> Self {
        ColwiseParallel {
            input_layouts: TpLayout::Replicate,
            output_layouts: TpLayout::Shard(-1),
        }
    }
}

/// Row-wise parallel: a `Linear`'s weight `[out, in]` is `Shard(1)` on the tp dim
/// (each rank contracts some input features, giving a partial sum) and its bias is
/// replicated and added once; an `Embedding`'s table is `Shard(0)` (each rank looks
/// up the rows it holds, zeros for the others: a partial sum).
///
/// Input: expected in `input_layouts` (default `Shard(-1)` for a `Linear`,
/// `Replicate` indices for an `Embedding`), redistributed to what the layer needs.
/// Output: the partial sum reduced to `output_layouts` (default `Replicate`: an
/// all-reduce; `Shard(1)`: a reduce-scatter, for sequence parallelism).
///
/// PyTorch: `RowwiseParallel`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowwiseParallel {
    /// The layout the input arrives in; `None`: `Shard(-1)` for a `Linear`,
    /// `Replicate` for an `Embedding`.
    pub input_layouts: Option<TpLayout>,
    /// The layout the output is reduced to.
    pub output_layouts: TpLayout,
}

impl Default for RowwiseParallel {
    fn default() -> Self {
        RowwiseParallel {
            input_layouts: None,
            output_layouts: TpLayout::Replicate,
        }
    }
}

/// Sequence parallel: the module (a norm, dropout, any module acting on each
/// position alone) runs on activations sharded along the sequence dim; its
/// parameters stay replicated, and their gradients, partial over the sequence
/// shards, are reduced over the tp dim when they accumulate.
///
/// Input: redistributed to `Shard(sequence_dim)` (from `Replicate` that is a local
/// slice). Output: left `Shard(sequence_dim)`.
///
/// PyTorch: `SequenceParallel`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SequenceParallel {
    /// The sequence dim of the activations (default 1: `[batch, seq, ...]`).
    pub sequence_dim: usize,
}

impl Default for SequenceParallel {
    fn default() -> Self {
        SequenceParallel { sequence_dim: 1 }
    }
}

/// Lays out a module's inputs: each positional input expected in its entry of
/// `input_layouts` and redistributed to its entry of `desired_input_layouts`
/// (`None`: left as it arrives, for inputs that are not laid out, such as
/// positions); named inputs likewise by name. The module must be called with
/// exactly as many positional inputs as the lists have entries; named inputs
/// the lists do not name pass unchanged.
///
/// ```
/// use tessera_fsdp::tp::{PrepareModuleInput, TpLayout};
///
/// // An attention block called with (hidden states, positions): gather the
/// // sequence-sharded states, leave the positions alone.
/// let style = PrepareModuleInput {
///     input_layouts: vec![Some(TpLayout::Shard(1)), None],
///     desired_input_layouts: vec![Some(TpLayout::Replicate), None],
///     ..PrepareModuleInput::default()
/// };
/// assert_eq!(PrepareModuleInput::new(Some(TpLayout::Shard(1)), Some(TpLayout::Replicate)).input_layouts.len(), 1);
/// # let _ = style;
/// ```
///
/// PyTorch: `PrepareModuleInput` (`input_layouts`, `desired_input_layouts`,
/// `input_kwarg_layouts`, `desired_input_kwarg_layouts`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PrepareModuleInput {
    /// The layout each positional input arrives in (checked), if given.
    pub input_layouts: Vec<Option<TpLayout>>,
    /// The layout the module receives each positional input in, if given.
    pub desired_input_layouts: Vec<Option<TpLayout>>,
    /// The layout named inputs arrive in (checked).
    pub input_kwarg_layouts: Vec<(String, TpLayout)>,
    /// The layout the module receives named inputs in.
    pub desired_input_kwarg_layouts: Vec<(String, TpLayout)>,
}

impl PrepareModuleInput {
    /// One positional input: expected in `input`, redistributed to `desired`.
    pub fn new(input: Option<TpLayout>, desired: Option<TpLayout>) -> PrepareModuleInput {
        PrepareModuleInput {
            input_layouts: vec![input],
            desired_input_layouts: vec![desired],
            ..PrepareModuleInput::default()
        }
    }

    /// The expected and wanted layouts of each input, checked for agreement.
    fn lays(&self, fqn: &str) -> Result<InputLays> {
        if self.input_layouts.len() != self.desired_input_layouts.len() {
            return Err(style_error(format!(
                "PrepareModuleInput on {}: input_layouts has {} entries but desired_input_layouts {}; \
                 give one entry per positional input in both (None for an input left alone)",
                at(fqn),
                self.input_layouts.len(),
                self.desired_input_layouts.len()
            )));
        }
        let args = self
            .input_layouts
            .iter()
            .zip(&self.desired_input_layouts)
            .map(|(&expect, &want)| Lay { expect, want })
            .collect();
        let mut kwargs: Vec<(String, Lay)> = Vec::new();
        for (name, l) in &self.input_kwarg_layouts {
            kwargs.push((
                name.clone(),
                Lay {
                    expect: Some(*l),
                    want: None,
                },
            ));
        }
        for (name, l) in &self.desired_input_kwarg_layouts {
            match kwargs.iter_mut().find(|(n, _)| n == name) {
                Some((_, lay)) => lay.want = Some(*l),
                None => kwargs.push((
                    name.clone(),
                    Lay {
                        expect: None,
                        want: Some(*l),
                    },
                )),
            }
        }
        Ok(InputLays::All { args, kwargs })
    }
}

/// Lays out a module's output: expected in `output_layouts`, redistributed to
/// `desired_output_layouts`.
///
/// PyTorch: `PrepareModuleOutput`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrepareModuleOutput {
    /// The layout the module's output comes out in (checked), if given.
    pub output_layouts: Option<TpLayout>,
    /// The layout the caller receives, if given.
    pub desired_output_layouts: Option<TpLayout>,
}

/// The layer types the column- and row-wise styles shard.
enum Layer<'a> {
    Linear(&'a Linear),
    Embedding(&'a Embedding),
}

fn layer<'a>(style: &str, module: &'a dyn Module, fqn: &str) -> Result<Layer<'a>> {
    let any: &dyn Any = module;
    if let Some(l) = any.downcast_ref::<Linear>() {
        return Ok(Layer::Linear(l));
    }
    if let Some(e) = any.downcast_ref::<Embedding>() {
        return Ok(Layer::Embedding(e));
    }
    let found = if any.is::<LayerNorm>() {
        "a LayerNorm (use SequenceParallel, or leave it replicated)"
    } else if any.is::<RMSNorm>() {
        "an RMSNorm (use SequenceParallel, or leave it replicated)"
    } else if module.own_parameters().is_empty() && !module.named_children().is_empty() {
        "a container (name its Linear or Embedding children, e.g. with `*`)"
    } else {
        "another module type"
    };
    Err(style_error(format!(
        "{style} on {}: the style shards Linear and Embedding layers, but this module is {found}",
        at(fqn)
    )))
}

/// The tp dim of the mesh `p` lives on; `p` must be replicated there.
fn replicated_tp_dim(p: &Param, ctx: &StyleCtx<'_>) -> Result<usize> {
    let (mesh, placements) = (p.mesh(), p.placements());
    let Some(d) = tp_dim(&mesh, ctx.tp_mesh) else {
        return Err(style_error(format!(
            "{}: parameter {} lives on mesh {:?} (dims {:?}), which has no dim matching the tp mesh \
             (dim {:?} of size {}); create the parameters on the mesh the tp mesh was taken from",
            at(ctx.fqn),
            p.name(),
            mesh.shape(),
            mesh.names(),
            ctx.tp_mesh.names(),
            ctx.tp_mesh.size()
        )));
    };
    if let Some((i, pl)) = placements.iter().enumerate().find(|(_, pl)| !pl.is_replicate()) {
        let why = if i == d {
            "it is already tensor-parallel (is the module in the plan twice?)"
        } else {
            "apply tensor parallelism before fully_shard, which shards it on the data-parallel dim"
        };
        return Err(style_error(format!(
            "{}: parameter {} is placed {pl} on mesh dim {i} ({:?}); tensor-parallel styles start from \
             replicated parameters: {why}",
            at(ctx.fqn),
            p.name(),
            placements
        )));
    }
    Ok(d)
}

/// Places `p` as `Shard(dim)` (or leaves it replicated: `None`) on the tp dim.
fn place(p: &Param, dim: Option<usize>, ctx: &StyleCtx<'_>) -> Result<()> {
    let d = replicated_tp_dim(p, ctx)?;
    if let Some(dim) = dim {
        let mut placements = p.placements();
        placements[d] = Placement::Shard(dim);
        let mesh = p.mesh();
        p.place(Layout::new(mesh.shape(), &placements, &p.shape(), p.dtype())?)?;
        p.set_grad(None);
    }
    Ok(())
}

/// The parameters of a sharded layer with their tp shard dims.
fn layer_params(layer: &Layer<'_>, colwise: bool) -> Vec<(Param, Option<usize>)> {
    match (layer, colwise) {
        (Layer::Linear(l), true) => std::iter::once((l.weight.clone(), Some(0)))
            .chain(l.bias.clone().map(|b| (b, Some(0))))
            .collect(),
        (Layer::Linear(l), false) => std::iter::once((l.weight.clone(), Some(1)))
            .chain(l.bias.clone().map(|b| (b, None)))
            .collect(),
        (Layer::Embedding(e), true) => vec![(e.weight.clone(), Some(1))],
        (Layer::Embedding(e), false) => vec![(e.weight.clone(), Some(0))],
    }
}

/// Input or output handling on the tp dim: an expected layout (checked) and a
/// wanted one (redistributed to).
#[derive(Clone, Copy, Debug)]
struct Lay {
    expect: Option<TpLayout>,
    want: Option<TpLayout>,
}

impl Lay {
    const KEEP: Lay = Lay {
        expect: None,
        want: None,
    };
}

/// How a style lays out a call's inputs.
#[derive(Clone, Debug)]
enum InputLays {
    /// The first positional input (the layer styles); the others pass unchanged.
    First(Lay),
    /// Every positional input by position (their count checked) and named inputs by name.
    All { args: Vec<Lay>, kwargs: Vec<(String, Lay)> },
}

/// The hooks a style attaches.
struct TpHooks {
    fqn: String,
    style: &'static str,
    tp_mesh: DeviceMesh,
    input: InputLays,
    output: Lay,
}

impl TpHooks {
    fn lay_inputs(&self, inputs: Inputs) -> Result<Inputs> {
        match &self.input {
            InputLays::First(lay) => inputs.map(|slot, x| match slot {
                InputSlot::Positional(0) => self.lay(&x, *lay, "input"),
                _ => Ok(x),
            }),
            InputLays::All { args, kwargs } => {
                if inputs.args().len() != args.len() {
                    return Err(style_error(format!(
                        "{} on {}: the module was called with {} positional inputs but the plan lays out {}; \
                         give one entry per positional input (None for an input left alone)",
                        self.style,
                        at(&self.fqn),
                        inputs.args().len(),
                        args.len()
                    )));
                }
                inputs.map(|slot, x| match slot {
                    InputSlot::Positional(i) => self.lay(&x, args[i], &slot.to_string()),
                    InputSlot::Named(n) => match kwargs.iter().find(|(k, _)| k == n) {
                        Some((_, lay)) => self.lay(&x, *lay, &slot.to_string()),
                        None => Ok(x),
                    },
                })
            }
        }
    }

    fn lay(&self, x: &Var, lay: Lay, what: &str) -> Result<Var> {
        if lay.expect.is_none() && lay.want.is_none() {
            return Ok(x.clone());
        }
        let v = x.value();
        let Some(d) = tp_dim(v.mesh(), &self.tp_mesh) else {
            return Err(style_error(format!(
                "{} on {}: its {what} lives on mesh {:?} (dims {:?}), which has no dim matching the tp mesh",
                self.style,
                at(&self.fqn),
                v.mesh().shape(),
                v.mesh().names()
            )));
        };
        let rank = v.shape().len();
        let actual = v.placements()[d];
        if let Some(expect) = lay.expect {
            let expected = expect.resolve(rank, &self.fqn, what)?;
            if actual != expected {
                // Blame the op that laid it out so, when one did: the plan may be right.
                let fix = match v.layout_origin() {
                    Some(o) => format!(
                        "the last op that changed its layout was {o}; make that op keep the planned layout, \
                         or fix the layouts in the plan"
                    ),
                    None => "fix the layouts in the plan".to_string(),
                };
                return Err(style_error(format!(
                    "{} on {}: its {what} arrives {actual} on the tp dim but the plan says {expect} ({expected}); {fix}",
                    self.style,
                    at(&self.fqn)
                )));
            }
        }
        let Some(want) = lay.want else {
            return Ok(x.clone());
        };
        let want = want.resolve(rank, &self.fqn, what)?;
        if actual == want {
            return Ok(x.clone());
        }
        let mut placements = v.placements().to_vec();
        placements[d] = want;
        x.redistribute(&placements)
    }
}

impl ModuleHooks for TpHooks {
    fn pre_forward(&self, inputs: Inputs) -> Result<Inputs> {
        self.lay_inputs(inputs)
    }

    fn post_forward(&self, output: Var) -> Result<Var> {
        self.lay(&output, self.output, "output")
    }
}

fn attach(ctx: &StyleCtx<'_>, style: &'static str, input: InputLays, output: Lay) -> Result<()> {
    let id = ModuleId::at(ctx.root, ctx.fqn)?;
    register_module_hooks(
        &id,
        Rc::new(TpHooks {
            fqn: ctx.fqn.to_string(),
            style,
            tp_mesh: ctx.tp_mesh.clone(),
            input,
            output,
        }),
    );
    Ok(())
}

fn check_params(params: &[(Param, Option<usize>)], ctx: &StyleCtx<'_>) -> Result<()> {
    params
        .iter()
        .try_for_each(|(p, _)| replicated_tp_dim(p, ctx).map(|_| ()))
}

impl ParallelStyle for ColwiseParallel {
    fn check(&self, module: &dyn Module, ctx: &StyleCtx<'_>) -> Result<()> {
        let l = layer("ColwiseParallel", module, ctx.fqn)?;
        check_params(&layer_params(&l, true), ctx)
    }

    fn apply(&self, module: &dyn Module, ctx: &StyleCtx<'_>) -> Result<()> {
        let l = layer("ColwiseParallel", module, ctx.fqn)?;
        for (p, dim) in layer_params(&l, true) {
            place(&p, dim, ctx)?;
        }
        let input = Lay {
            expect: Some(self.input_layouts),
            want: Some(TpLayout::Replicate),
        };
        let output = Lay {
            expect: Some(TpLayout::Shard(-1)),
            want: Some(self.output_layouts),
        };
        attach(ctx, "ColwiseParallel", InputLays::First(input), output)
    }
}

impl ParallelStyle for RowwiseParallel {
    fn check(&self, module: &dyn Module, ctx: &StyleCtx<'_>) -> Result<()> {
        let l = layer("RowwiseParallel", module, ctx.fqn)?;
        check_params(&layer_params(&l, false), ctx)
    }

    fn apply(&self, module: &dyn Module, ctx: &StyleCtx<'_>) -> Result<()> {
        let l = layer("RowwiseParallel", module, ctx.fqn)?;
        for (p, dim) in layer_params(&l, false) {
            place(&p, dim, ctx)?;
        }
        let (default_in, want_in) = match l {
            Layer::Linear(_) => (TpLayout::Shard(-1), TpLayout::Shard(-1)),
            Layer::Embedding(_) => (TpLayout::Replicate, TpLayout::Replicate),
        };
        let input = Lay {
            expect: Some(self.input_layouts.unwrap_or(default_in)),
            want: Some(want_in),
        };
        let output = Lay {
            expect: Some(TpLayout::Partial),
            want: Some(self.output_layouts),
        };
        attach(ctx, "RowwiseParallel", InputLays::First(input), output)
    }
}

impl ParallelStyle for SequenceParallel {
    fn check(&self, module: &dyn Module, ctx: &StyleCtx<'_>) -> Result<()> {
        module
            .parameters()
            .iter()
            .try_for_each(|p| replicated_tp_dim(p, ctx).map(|_| ()))
    }

    fn apply(&self, module: &dyn Module, ctx: &StyleCtx<'_>) -> Result<()> {
        self.check(module, ctx)?;
        let seq = TpLayout::Shard(self.sequence_dim as isize);
        let input = Lay {
            expect: None,
            want: Some(seq),
        };
        attach(ctx, "SequenceParallel", InputLays::First(input), Lay::KEEP)
    }
}

impl ParallelStyle for PrepareModuleInput {
    fn check(&self, _module: &dyn Module, ctx: &StyleCtx<'_>) -> Result<()> {
        self.lays(ctx.fqn).map(|_| ())
    }

    fn apply(&self, _module: &dyn Module, ctx: &StyleCtx<'_>) -> Result<()> {
        attach(ctx, "PrepareModuleInput", self.lays(ctx.fqn)?, Lay::KEEP)
    }
}

impl ParallelStyle for PrepareModuleOutput {
    fn apply(&self, _module: &dyn Module, ctx: &StyleCtx<'_>) -> Result<()> {
        let output = Lay {
            expect: self.output_layouts,
            want: self.desired_output_layouts,
        };
        attach(ctx, "PrepareModuleOutput", InputLays::First(Lay::KEEP), output)
    }
}
