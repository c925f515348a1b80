//! Reference models: the GPT-style [`Transformer`] and the LLaMA-style
//! [`Llama`], both built deferred, with their tensor-parallel plans and FSDP
//! units, and what a training loop needs of either ([`CausalLm`]).

mod llama;
mod transformer;

pub use llama::{FeedForward as LlamaFeedForward, Llama, LlamaAttention, LlamaBlock, LlamaConfig, hf_name};
pub use transformer::{Attention, Block, FeedForward, Transformer, TransformerConfig};

use std::fmt;
use std::rc::Rc;
use std::str::FromStr;

use tessera_autograd::nn::{Inputs, Materializer, Module};
use tessera_autograd::{Result, Var, checkpoint};
use tessera_dtensor::{DType, Placement, Tensor, distribute_tensor_from};
use tessera_fsdp::tp::{
    Applied, ColwiseParallel, ParallelPlan, PrepareModuleInput, RowwiseParallel, SequenceParallel, TpLayout,
};
use tessera_fsdp::{FsdpConfig, FsdpModule, fully_shard, fully_shard_modules};
use tessera_mesh::DeviceMesh;
use tessera_tensor::ops::Reduction;

/// The FSDP units of a model sharded block by block (see [`CausalLm::fully_shard`]).
pub struct FsdpUnits {
    /// The root unit (with [`UnitLayout::Blocks`]: the embeddings, final norm
    /// and output; with [`UnitLayout::SplitEnds`], whatever the model holds
    /// outside its blocks and ends); its setters recurse into the others.
    pub root: FsdpModule,
    /// One unit per block, in order.
    pub blocks: Vec<FsdpModule>,
    /// [`UnitLayout::SplitEnds`]: the embeddings' unit and the final norm's
    /// and output head's (`None` with [`UnitLayout::Blocks`]).
    pub ends: Option<[FsdpModule; 2]>,
}

impl FsdpUnits {
    /// Every unit with a name: `root`, `embeddings`, `layers.i` in order,
    /// `head` (the ends only when split).
    pub fn named(&self) -> Vec<(String, &FsdpModule)> {
        let mut out = vec![("root".to_string(), &self.root)];
        if let Some([embeddings, _]) = &self.ends {
            out.push(("embeddings".into(), embeddings));
        }
        out.extend(self.blocks.iter().enumerate().map(|(i, b)| (format!("layers.{i}"), b)));
        if let Some([_, head]) = &self.ends {
            out.push(("head".into(), head));
        }
        out
    }
}

/// How [`CausalLm::fully_shard_with`] groups a model's parameters into FSDP
/// units.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum UnitLayout {
    /// Each block a unit, the root the rest (embeddings, final norm, output
    /// head): PyTorch's FSDP2 recipe, and the default.
    #[default]
    Blocks,
    /// Each block a unit, the embeddings one, the final norm with the output
    /// head one (kept gathered from its forward to its backward, unless the
    /// config sets `reshard_after_forward`), the root the rest: torchtitan's
    /// recipe. The head's all-gather is then prefetched while the last block
    /// computes and its reduce-scatter overlaps the blocks' backward, where
    /// the root's were the step's first and last collectives with nothing to
    /// hide behind; the embeddings are gathered again for their backward
    /// (resharded after forward, as every non-root unit by default).
    SplitEnds,
}

impl fmt::Display for UnitLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            UnitLayout::Blocks => "blocks",
            UnitLayout::SplitEnds => "split-ends",
        })
    }
}

impl FromStr for UnitLayout {
    type Err = String;

    /// `blocks` or `split-ends`.
    fn from_str(s: &str) -> std::result::Result<UnitLayout, String> {
        match s {
            "blocks" => Ok(UnitLayout::Blocks),
            "split-ends" => Ok(UnitLayout::SplitEnds),
            other => Err(format!("FSDP units are blocks or split-ends, got {other:?}")),
        }
    }
}

/// Which blocks of a model recompute their activations in backward instead of
/// keeping them from forward: less activation memory for one more forward
/// pass through each such block (its FSDP unit gathered again when resharded
/// after forward, its tensor-parallel collectives issued again).
///
/// PyTorch: torchtitan's `activation_checkpoint.mode` (`"none"`, `"full"`,
/// and `"selective"` with an integer frequency), applied block by block with
/// `checkpoint_wrapper` over `torch.utils.checkpoint`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ActivationCheckpointing {
    /// Every block keeps its activations (the default).
    #[default]
    None,
    /// Every block recomputes.
    Full,
    /// Every `n`-th block recomputes (blocks `n-1`, `2n-1`, ...: the `n`-th,
    /// `2n`-th, counted from 1, as torchtitan counts); `EveryNth(1)` is `Full`.
    EveryNth(usize),
}

impl ActivationCheckpointing {
    /// Whether block `index` (from 0) recomputes its activations.
    pub fn checkpoints(self, index: usize) -> bool {
        match self {
            ActivationCheckpointing::None => false,
            ActivationCheckpointing::Full => true,
            ActivationCheckpointing::EveryNth(n) => n > 0 && (index + 1).is_multiple_of(n),
        }
    }
}

/// `none`, `full`, or an integer `n` (every `n`-th block; `0` is `none`, `1`
/// is `full`), as [`ActivationCheckpointing`] writes itself.
impl FromStr for ActivationCheckpointing {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "none" => Ok(ActivationCheckpointing::None),
            "full" => Ok(ActivationCheckpointing::Full),
            n => match n.parse::<usize>() {
                Ok(0) => Ok(ActivationCheckpointing::None),
                Ok(1) => Ok(ActivationCheckpointing::Full),
                Ok(n) => Ok(ActivationCheckpointing::EveryNth(n)),
                Err(_) => Err(format!(
                    "activation checkpointing `{s}`: use none, full, or N to recompute every N-th block"
                )),
            },
        }
    }
}

impl fmt::Display for ActivationCheckpointing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ActivationCheckpointing::None => f.write_str("none"),
            ActivationCheckpointing::Full => f.write_str("full"),
            ActivationCheckpointing::EveryNth(n) => write!(f, "{n}"),
        }
    }
}

/// Calls block `index` of a model on `xs` (its positional inputs), through
/// [`checkpoint`] when `ac` says that block recomputes: the recomputation in
/// backward calls the same block again (hence the `Rc`), hooks and all.
fn call_block<B: Module>(block: &Rc<B>, index: usize, ac: ActivationCheckpointing, xs: &[Var]) -> Result<Var> {
    fn run<B: Module>(block: &Rc<B>, xs: &[Var]) -> Result<Var> {
        let (first, rest) = xs.split_first().ok_or_else(|| tessera_autograd::Error::Config {
            op: "call_block",
            detail: "a block takes at least one input".into(),
        })?;
        let inputs = rest.iter().fold(Inputs::from(first), |i, x| i.arg(x));
        block.call_with(inputs)
    }
    if ac.checkpoints(index) {
        let block = block.clone();
        checkpoint(xs, move |xs| run(&block, xs))
    } else {
        run(block, xs)
    }
}

/// A next-token language model as a training loop drives it: its
/// tensor-parallel plan, its FSDP units, its loss and its initialisation. The
/// reference models implement it; so can a user's own.
pub trait CausalLm: Module {
    /// Applies the model's tensor-parallel plan over `tp_mesh` (with
    /// `sequence_parallel`, its sequence-parallel plan).
    ///
    /// # Errors
    /// Sizes the tp mesh does not split; as [`parallelize_module`](tessera_fsdp::tp::parallelize_module).
    fn parallelize(&self, tp_mesh: &DeviceMesh, sequence_parallel: bool) -> tessera_fsdp::Result<Vec<Applied>>;

    /// The blocks, in order: each becomes an FSDP unit of its own.
    fn blocks(&self) -> Vec<&dyn Module>;

    /// The modules before the blocks (the embeddings) and after them (the
    /// final norm and the output head), each group a unit of its own with
    /// [`UnitLayout::SplitEnds`]. Default: none (the model cannot split them).
    fn ends(&self) -> [Vec<&dyn Module>; 2] {
        [Vec::new(), Vec::new()]
    }

    /// Which blocks recompute their activations in backward from now on (a
    /// new reference model: none).
    ///
    /// # Errors
    /// A model that cannot recompute its blocks (the default, for anything but
    /// [`ActivationCheckpointing::None`]): its forward must call its blocks
    /// through [`checkpoint`] to offer it.
    fn set_activation_checkpointing(&self, ac: ActivationCheckpointing) -> Result<()> {
        if ac == ActivationCheckpointing::None {
            return Ok(());
        }
        Err(tessera_autograd::Error::Config {
            op: "set_activation_checkpointing",
            detail: format!(
                "this model ({}) does not recompute its blocks; checkpoint them in its forward \
                 (tessera::autograd::checkpoint) and implement set_activation_checkpointing",
                self.type_name()
            ),
        })
    }

    /// Which blocks recompute their activations in backward (default: none).
    fn activation_checkpointing(&self) -> ActivationCheckpointing {
        ActivationCheckpointing::None
    }

    /// Applies FSDP bottom-up as PyTorch's recipe does: each block becomes a
    /// unit, then the root takes what is left (embeddings, final norm, output).
    /// Every unit gets `config`.
    ///
    /// # Errors
    /// As [`fully_shard`].
    fn fully_shard(&self, mesh: &DeviceMesh, config: &FsdpConfig) -> tessera_fsdp::Result<FsdpUnits>
    where
        Self: Sized,
    {
        self.fully_shard_with(mesh, config, UnitLayout::Blocks)
    }

    /// [`fully_shard`](Self::fully_shard) with the units of `layout`, bottom-up:
    /// the blocks, the ends when split ([`ends`](Self::ends)), then the root.
    ///
    /// # Errors
    /// [`UnitLayout::SplitEnds`] for a model whose [`ends`](Self::ends) are
    /// empty; as [`fully_shard`].
    fn fully_shard_with(
        &self,
        mesh: &DeviceMesh,
        config: &FsdpConfig,
        layout: UnitLayout,
    ) -> tessera_fsdp::Result<FsdpUnits>
    where
        Self: Sized,
    {
        // Checked before any unit is made: a refused layout changes nothing.
        let ends = match layout {
            UnitLayout::Blocks => None,
            UnitLayout::SplitEnds => {
                let [first, last] = self.ends();
                if first.is_empty() || last.is_empty() {
                    return Err(tessera_fsdp::Error::Module {
                        module: self.type_name().to_string(),
                        detail: "does not name its embeddings and output head (CausalLm::ends), so \
                                 UnitLayout::SplitEnds cannot make them units; use UnitLayout::Blocks"
                            .into(),
                    });
                }
                Some([first, last])
            }
        };
        let blocks = self
            .blocks()
            .into_iter()
            .map(|b| fully_shard(b, mesh, config.clone()))
            .collect::<tessera_fsdp::Result<Vec<_>>>()?;
        let ends = match ends {
            None => None,
            Some([first, last]) => {
                // The head's backward follows its forward at once: kept gathered
                // in between unless the config says otherwise.
                let head = FsdpConfig {
                    reshard_after_forward: Some(config.reshard_after_forward.unwrap_or(false)),
                    ..config.clone()
                };
                Some([
                    fully_shard_modules(&first, mesh, config.clone())?,
                    fully_shard_modules(&last, mesh, head)?,
                ])
            }
        };
        let root = fully_shard(self, mesh, config.clone())?;
        Ok(FsdpUnits { root, blocks, ends })
    }

    /// The mean next-token cross entropy of token rows `[B, T+1]`: inputs
    /// `row[..T]`, targets `row[1..]`, computed in `f32` whatever the logits'
    /// dtype (see [`Var::cross_entropy`]).
    ///
    /// # Errors
    /// Rows shorter than 2 tokens, shapes that do not fit.
    fn loss(&self, rows: &Var) -> Result<Var>
    where
        Self: Sized,
    {
        next_token_loss(self, rows)
    }

    /// How [`Materializer::from_seed`] initialises this model: `seed` plus the
    /// model's own rules. Default: the layers' own schemes.
    fn materializer(&self, seed: u64) -> Materializer {
        Materializer::from_seed(seed)
    }

    /// Number of parameters (elements).
    fn num_params(&self) -> usize;

    /// Writes the model in Hugging Face's layout (weights and `config.json`)
    /// to `dir`, for the models that have one ([`Llama::save_hf`]).
    /// Collective.
    ///
    /// # Errors
    /// A model without a Hugging Face counterpart (the default); as the
    /// model's export.
    fn save_hf(&self, dir: &std::path::Path) -> Result<()> {
        let _ = dir;
        Err(tessera_autograd::Error::Config {
            op: "save_hf",
            detail: "this model has no Hugging Face layout; the LLaMA-style model (Llama) has one".into(),
        })
    }
}

/// The mean next-token cross entropy of `model` on token rows `[B, T+1]`.
fn next_token_loss(model: &dyn Module, rows: &Var) -> Result<Var> {
    let t = rows.value().shape()[1].saturating_sub(1);
    let inputs = rows.narrow(1, 0, t)?;
    let targets = rows.narrow(1, 1, t)?;
    model.call(&inputs)?.cross_entropy(&targets, Reduction::Mean)
}

/// Positions `0..t` (`i64`), replicated on `mesh`: built on every rank from no
/// source, so no hash exchange on the hot path.
fn positions(t: usize, mesh: &DeviceMesh) -> Result<Var> {
    let p = distribute_tensor_from(
        &Tensor::arange(t, DType::I64)?,
        mesh,
        &vec![Placement::Replicate; mesh.ndim()],
        None,
    )?;
    Ok(Var::constant(p))
}

/// A block's sublayer as the tensor-parallel plans see it: the norm before
/// `module`, `module` itself (whose first input sequence parallelism gathers;
/// its `extra_inputs` more, such as positions, are left alone), its
/// column-parallel input projections and its row-parallel output projection
/// (names relative to `module`).
struct Sublayer {
    norm: &'static str,
    module: &'static str,
    extra_inputs: usize,
    column: &'static [&'static str],
    row: &'static str,
}

/// The module names a reference model's tensor-parallel plans are made of.
struct TpNames {
    /// Embedding tables, with the dim of the sequence in their output (token
    /// embeddings `[B, T, D]`: 1; a position table's `[T, D]`: 0).
    embeddings: &'static [(&'static str, isize)],
    sublayers: &'static [Sublayer],
}

/// The Megatron-style plan of a reference model (torchtitan's): embeddings
/// row-wise, each sublayer's input projections column-wise and its output
/// projection row-wise, the output head column-wise; norms replicated. Without
/// sequence parallelism activations between sublayers are replicated (two
/// all-reduces per block); with it they are sharded along the sequence, the
/// norms run [`SequenceParallel`], each sublayer's input is gathered and its
/// output reduce-scattered, and the head leaves the logits sharded by class
/// (loss parallel).
fn tp_plan(names: &TpNames, sequence_parallel: bool) -> ParallelPlan {
    use TpLayout::{Replicate, Shard};
    let sp = sequence_parallel;
    let between = |seq_dim: isize| if sp { Shard(seq_dim) } else { Replicate };
    let mut plan = ParallelPlan::new();
    for &(name, seq_dim) in names.embeddings {
        let style = RowwiseParallel {
            input_layouts: Some(Replicate),
            output_layouts: between(seq_dim),
        };
        plan = plan.add(name, style);
    }
    for s in names.sublayers {
        if sp {
            let gather = |layout| {
                std::iter::once(Some(layout))
                    .chain(std::iter::repeat_n(None, s.extra_inputs))
                    .collect()
            };
            let inputs = PrepareModuleInput {
                input_layouts: gather(Shard(1)),
                desired_input_layouts: gather(Replicate),
                ..PrepareModuleInput::default()
            };
            plan = plan.add(s.norm, SequenceParallel::default()).add(s.module, inputs);
        }
        for c in s.column {
            plan = plan.add(&format!("{}.{c}", s.module), ColwiseParallel::default());
        }
        let out = RowwiseParallel {
            input_layouts: None,
            output_layouts: between(1),
        };
        plan = plan.add(&format!("{}.{}", s.module, s.row), out);
    }
    if sp {
        plan = plan.add("norm", SequenceParallel::default());
    }
    let head = ColwiseParallel {
        input_layouts: between(1),
        output_layouts: if sp { Shard(-1) } else { Replicate },
    };
    plan.add("output", head)
}

/// Applies the plan of `names` over `tp_mesh` to `model`, after checking that
/// the tp size divides `heads` (`detail` says why it must, given the tp size).
fn parallelize_plan(
    model: &dyn Module,
    names: &TpNames,
    tp_mesh: &DeviceMesh,
    sequence_parallel: bool,
    (op, heads, detail): (&'static str, usize, impl Fn(usize) -> String),
) -> tessera_fsdp::Result<Vec<Applied>> {
    let tp = tp_mesh.size();
    if tp == 0 || !heads.is_multiple_of(tp) {
        return Err(tessera_autograd::Error::Config { op, detail: detail(tp) }.into());
    }
    tessera_fsdp::tp::parallelize_module(model, tp_mesh, &tp_plan(names, sequence_parallel))
}
