//! The reference Transformer: pre-norm GPT-style blocks with learned positions,
//! exactly the architecture of the parity reference (parameter names equal the
//! reference state-dict keys).

use std::cell::Cell;
use std::rc::Rc;

use tessera_autograd::nn::{Embedding, LayerNorm, Linear, Module, name_parameters};
use tessera_autograd::{Result, Var};
use tessera_dtensor::DType;
use tessera_fsdp::FsdpConfig;
use tessera_fsdp::tp::{Applied, ParallelPlan};
use tessera_mesh::DeviceMesh;

use super::{
    ActivationCheckpointing, CausalLm, FsdpUnits, Sublayer, TpNames, call_block, next_token_loss, parallelize_plan,
    positions,
};

/// Sizes of a [`Transformer`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TransformerConfig {
    /// Vocabulary size.
    pub vocab: usize,
    /// Model width.
    pub dim: usize,
    /// Number of blocks.
    pub n_layers: usize,
    /// Attention heads (must divide `dim`).
    pub n_heads: usize,
    /// Maximum sequence length (rows of the position table).
    pub seq: usize,
}

impl TransformerConfig {
    /// The tiny reference model: dim 64, 2 layers, 4 heads, vocab 256, seq 32.
    pub const TINY: TransformerConfig = TransformerConfig {
        vocab: 256,
        dim: 64,
        n_layers: 2,
        n_heads: 4,
        seq: 32,
    };

    /// Number of parameters (elements).
    pub fn num_params(&self) -> usize {
        let (d, v, s) = (self.dim, self.vocab, self.seq);
        let block = 2 * 2 * d + 4 * d * d + (4 * d * d + 4 * d) + (4 * d * d + d);
        v * d + s * d + self.n_layers * block + 2 * d + v * d
    }
}

/// Causal multi-head self-attention: `wo(softmax(q·kᵀ/√hd + mask)·v)`; head `h`
/// owns feature columns `[h·hd, (h+1)·hd)` of `q`, `k` and `v`.
pub struct Attention {
    /// `layers.i.attention.wq` (no bias).
    pub wq: Linear,
    /// `layers.i.attention.wk` (no bias).
    pub wk: Linear,
    /// `layers.i.attention.wv` (no bias).
    pub wv: Linear,
    /// `layers.i.attention.wo` (no bias).
    pub wo: Linear,
    n_heads: usize,
}

impl Module for Attention {
    fn named_children(&self) -> Vec<(String, &dyn Module)> {
        vec![
            ("wq".into(), &self.wq),
            ("wk".into(), &self.wk),
            ("wv".into(), &self.wv),
            ("wo".into(), &self.wo),
        ]
    }

    /// Attention over `x` `[B, T, D]`.
    fn forward(&self, x: &Var) -> Result<Var> {
        let s = x.value().shape().to_vec();
        let (b, t, d) = (s[0], s[1], s[2]);
        let (h, hd) = (self.n_heads, d / self.n_heads);
        let heads = |lin: &Linear| -> Result<Var> { lin.call(x)?.reshape(&[b, t, h, hd])?.permute(&[0, 2, 1, 3]) };
        let (q, k, v) = (heads(&self.wq)?, heads(&self.wk)?, heads(&self.wv)?);
        // Scale 1/√hd, causal: bit for bit the chain matmul, mul_scalar, causal_mask, softmax, matmul.
        let out = q.scaled_dot_product_attention(&k, &v, true, None)?;
        let out = out.permute(&[0, 2, 1, 3])?.reshape(&[b, t, d])?;
        self.wo.call(&out)
    }
}

/// The MLP of a block: `w2(gelu(w1(x)))`.
pub struct FeedForward {
    /// `layers.i.feed_forward.w1` (`[4·dim, dim]`, with bias).
    pub w1: Linear,
    /// `layers.i.feed_forward.w2` (`[dim, 4·dim]`, with bias).
    pub w2: Linear,
}

impl Module for FeedForward {
    fn named_children(&self) -> Vec<(String, &dyn Module)> {
        vec![("w1".into(), &self.w1), ("w2".into(), &self.w2)]
    }

    fn forward(&self, x: &Var) -> Result<Var> {
        self.w2.call(&self.w1.call(x)?.gelu()?)
    }
}

/// One block: `h = x + attention(attention_norm(x))`, `out = h + feed_forward(ffn_norm(h))`.
pub struct Block {
    /// `layers.i.attention_norm`.
    pub attention_norm: LayerNorm,
    /// `layers.i.attention`.
    pub attention: Attention,
    /// `layers.i.ffn_norm`.
    pub ffn_norm: LayerNorm,
    /// `layers.i.feed_forward`.
    pub feed_forward: FeedForward,
}

impl Block {
    fn new(cfg: &TransformerConfig, mesh: &DeviceMesh, dtype: DType) -> Result<Block> {
        let d = cfg.dim;
        let lin = |i, o, bias| Linear::new(i, o, bias, mesh, dtype);
        Ok(Block {
            attention_norm: LayerNorm::new(d, 1e-5, mesh, dtype)?,
            attention: Attention {
                wq: lin(d, d, false)?,
                wk: lin(d, d, false)?,
                wv: lin(d, d, false)?,
                wo: lin(d, d, false)?,
                n_heads: cfg.n_heads,
            },
            ffn_norm: LayerNorm::new(d, 1e-5, mesh, dtype)?,
            feed_forward: FeedForward {
                w1: lin(d, 4 * d, true)?,
                w2: lin(4 * d, d, true)?,
            },
        })
    }
}

impl Module for Block {
    fn named_children(&self) -> Vec<(String, &dyn Module)> {
        vec![
            ("attention_norm".into(), &self.attention_norm),
            ("attention".into(), &self.attention),
            ("ffn_norm".into(), &self.ffn_norm),
            ("feed_forward".into(), &self.feed_forward),
        ]
    }

    fn forward(&self, x: &Var) -> Result<Var> {
        let h = x.add(&self.attention.call(&self.attention_norm.call(x)?)?)?;
        h.add(&self.feed_forward.call(&self.ffn_norm.call(&h)?)?)
    }
}

/// The reference Transformer: `h0 = tok[tokens] + pos[0..T]`, blocks, final norm,
/// untied output projection. Forward maps `i64` tokens `[B, T]` to logits `[B, T, V]`.
pub struct Transformer {
    /// `tok_embeddings`.
    pub tok_embeddings: Embedding,
    /// `pos_embeddings`.
    pub pos_embeddings: Embedding,
    /// `layers.i` (shared, so that a block recomputed in backward can be
    /// called again: see [`ActivationCheckpointing`]).
    pub layers: Vec<Rc<Block>>,
    /// `norm`.
    pub norm: LayerNorm,
    /// `output` (no bias).
    pub output: Linear,
    cfg: TransformerConfig,
    checkpointing: Cell<ActivationCheckpointing>,
}

/// The modules of the GPT model's tensor-parallel plans.
const GPT_TP: TpNames = TpNames {
    embeddings: &[("tok_embeddings", 1), ("pos_embeddings", 0)],
    sublayers: &[
        Sublayer {
            norm: "layers.*.attention_norm",
            module: "layers.*.attention",
            extra_inputs: 0,
            column: &["wq", "wk", "wv"],
            row: "wo",
        },
        Sublayer {
            norm: "layers.*.ffn_norm",
            module: "layers.*.feed_forward",
            extra_inputs: 0,
            column: &["w1"],
            row: "w2",
        },
    ],
};

impl Transformer {
    /// A deferred model replicated on `mesh`: every parameter has its shape,
    /// dtype and name (`layers.0.attention.wq.weight`) but no storage. Plan and
    /// shard it ([`parallelize`](Self::parallelize),
    /// [`fully_shard`](Self::fully_shard)), then materialise each rank's shards
    /// with [`Materializer`](tessera_autograd::nn::Materializer) (from a seed, a
    /// safetensors file or a checkpoint).
    ///
    /// # Errors
    /// `n_heads` not dividing `dim`, sizes a tensor cannot have.
    pub fn new(cfg: TransformerConfig, mesh: &DeviceMesh, dtype: DType) -> Result<Transformer> {
        if cfg.n_heads == 0 || !cfg.dim.is_multiple_of(cfg.n_heads) {
            return Err(tessera_autograd::Error::Config {
                op: "Transformer",
                detail: format!("n_heads {} must divide dim {}", cfg.n_heads, cfg.dim),
            });
        }
        let layers = (0..cfg.n_layers)
            .map(|_| Block::new(&cfg, mesh, dtype).map(Rc::new))
            .collect::<Result<Vec<_>>>()?;
        let model = Transformer {
            tok_embeddings: Embedding::new(cfg.vocab, cfg.dim, mesh, dtype)?,
            pos_embeddings: Embedding::new(cfg.seq, cfg.dim, mesh, dtype)?,
            layers,
            norm: LayerNorm::new(cfg.dim, 1e-5, mesh, dtype)?,
            output: Linear::new(cfg.dim, cfg.vocab, false, mesh, dtype)?,
            cfg,
            checkpointing: Cell::new(ActivationCheckpointing::None),
        };
        name_parameters(&model)?;
        Ok(model)
    }

    /// Applies FSDP bottom-up as PyTorch's recipe does: each block becomes a unit,
    /// then the root takes the embeddings, the final norm and the output
    /// projection. Every unit gets `config`.
    ///
    /// # Errors
    /// As [`fully_shard`](tessera_fsdp::fully_shard).
    pub fn fully_shard(&self, mesh: &DeviceMesh, config: &FsdpConfig) -> tessera_fsdp::Result<FsdpUnits> {
        CausalLm::fully_shard(self, mesh, config)
    }

    /// The tensor-parallel plan of the reference runs (Megatron style, no sequence
    /// parallelism): embeddings row-wise (tables `Shard(0)`, replicated output),
    /// `wq`/`wk`/`wv` and `w1` column-wise, `wo` and `w2` row-wise (outputs
    /// all-reduced), the output head column-wise with the logits gathered to
    /// `Replicate`; norms replicated. Attention runs `n_heads / tp` heads per rank.
    /// Per block and forward: two all-reduces (attention out, MLP out).
    ///
    /// PyTorch: the reference's `parallelize_module` plan.
    pub fn tp_plan() -> ParallelPlan {
        super::tp_plan(&GPT_TP, false)
    }

    /// The sequence-parallel plan: as [`tp_plan`](Self::tp_plan), but activations
    /// between blocks are sharded along the sequence (`Shard(1)`), the norms run
    /// [`SequenceParallel`](tessera_fsdp::tp::SequenceParallel), each all-reduce becomes an all-gather before the
    /// attention and the MLP plus a reduce-scatter after them (the same bytes),
    /// and the output head leaves the logits sharded by class (`Shard(-1)`), so the
    /// loss is computed without gathering them (loss parallel).
    ///
    /// PyTorch: the sequence-parallel plan of TorchTitan's Llama.
    pub fn tp_plan_sequence_parallel() -> ParallelPlan {
        super::tp_plan(&GPT_TP, true)
    }

    /// Applies [`tp_plan`](Self::tp_plan) (or, with `sequence_parallel`,
    /// [`tp_plan_sequence_parallel`](Self::tp_plan_sequence_parallel)) over
    /// `tp_mesh` (a dim of the parameters' mesh, or all of it).
    ///
    /// # Errors
    /// `n_heads` not divisible by the tp size; as [`parallelize_module`](tessera_fsdp::tp::parallelize_module).
    pub fn parallelize(&self, tp_mesh: &DeviceMesh, sequence_parallel: bool) -> tessera_fsdp::Result<Vec<Applied>> {
        let heads = self.cfg.n_heads;
        let why = move |tp: usize| {
            format!(
                "tensor parallelism over {tp} ranks splits the {heads} attention heads evenly; use a tp size dividing n_heads"
            )
        };
        parallelize_plan(
            self,
            &GPT_TP,
            tp_mesh,
            sequence_parallel,
            ("Transformer::parallelize", heads, why),
        )
    }

    /// The configuration.
    pub fn config(&self) -> &TransformerConfig {
        &self.cfg
    }

    /// The embeddings of `tokens` `[B, T]` (token plus position).
    ///
    /// # Errors
    /// `T` longer than the position table, indices out of range.
    pub fn embed(&self, tokens: &Var) -> Result<Var> {
        let positions = positions(tokens.value().shape()[1], tokens.value().mesh())?;
        let pos = self.pos_embeddings.call(&positions)?;
        self.tok_embeddings.call(tokens)?.add(&pos)
    }

    /// Logits from the last hidden state.
    ///
    /// # Errors
    /// Shapes that do not fit.
    pub fn head(&self, h: &Var) -> Result<Var> {
        self.output.call(&self.norm.call(h)?)
    }

    /// The mean next-token cross entropy of rows `[B, T+1]` (inputs `row[..T]`,
    /// targets `row[1..]`), computed in f32 whatever the logits' dtype.
    ///
    /// # Errors
    /// Rows shorter than 2 tokens, shapes that do not fit.
    pub fn loss(&self, rows: &Var) -> Result<Var> {
        next_token_loss(self, rows)
    }
}

impl Module for Transformer {
    fn named_children(&self) -> Vec<(String, &dyn Module)> {
        vec![
            ("tok_embeddings".into(), &self.tok_embeddings),
            ("pos_embeddings".into(), &self.pos_embeddings),
            ("layers".into(), &self.layers),
            ("norm".into(), &self.norm),
            ("output".into(), &self.output),
        ]
    }

    fn forward(&self, tokens: &Var) -> Result<Var> {
        let mut h = self.embed(tokens)?;
        let ac = self.checkpointing.get();
        for (i, l) in self.layers.iter().enumerate() {
            h = call_block(l, i, ac, &[h])?;
        }
        self.head(&h)
    }
}

impl CausalLm for Transformer {
    fn parallelize(&self, tp_mesh: &DeviceMesh, sequence_parallel: bool) -> tessera_fsdp::Result<Vec<Applied>> {
        Transformer::parallelize(self, tp_mesh, sequence_parallel)
    }

    fn blocks(&self) -> Vec<&dyn Module> {
        self.layers.iter().map(|b| b as &dyn Module).collect()
    }

    fn ends(&self) -> [Vec<&dyn Module>; 2] {
        [
            vec![&self.tok_embeddings, &self.pos_embeddings],
            vec![&self.norm, &self.output],
        ]
    }

    fn set_activation_checkpointing(&self, ac: ActivationCheckpointing) -> Result<()> {
        self.checkpointing.set(ac);
        Ok(())
    }

    fn activation_checkpointing(&self) -> ActivationCheckpointing {
        self.checkpointing.get()
    }

    fn num_params(&self) -> usize {
        self.cfg.num_params()
    }
}

#[cfg(test)]
mod tests {
    use tessera_autograd::nn::{Module, named_modules};
    use tessera_mesh::{DeviceMesh, launch};

    use super::*;

    #[test]
    fn the_tree_names_every_parameter_by_its_state_dict_key() {
        let out = launch(1, |ctx| {
            let mesh = DeviceMesh::new(ctx.into_comm(), &[1])?;
            let cfg = TransformerConfig {
                n_layers: 2,
                ..TransformerConfig::TINY
            };
            let model = Transformer::new(cfg, &mesh, DType::F32)?;
            // Fully qualified names from the tree equal the names the parameters
            // were created with (the reference state-dict keys), in the same order.
            let named = model.named_parameters();
            let fqns: Vec<&str> = named.iter().map(|(n, _)| n.as_str()).collect();
            let created: Vec<String> = model.parameters().iter().map(|p| p.name().to_string()).collect();
            assert_eq!(fqns, created);
            assert_eq!(named.len(), 2 + 2 * 12 + 3);
            assert_eq!(
                &fqns[..6],
                [
                    "tok_embeddings.weight",
                    "pos_embeddings.weight",
                    "layers.0.attention_norm.weight",
                    "layers.0.attention_norm.bias",
                    "layers.0.attention.wq.weight",
                    "layers.0.attention.wk.weight",
                ]
            );
            assert_eq!(fqns.last(), Some(&"output.weight"));
            let modules: Vec<String> = named_modules(&model).into_iter().map(|(n, _)| n).collect();
            let want_prefix = [
                "",
                "tok_embeddings",
                "pos_embeddings",
                "layers",
                "layers.0",
                "layers.0.attention_norm",
                "layers.0.attention",
                "layers.0.attention.wq",
                "layers.0.attention.wk",
                "layers.0.attention.wv",
                "layers.0.attention.wo",
                "layers.0.ffn_norm",
                "layers.0.feed_forward",
                "layers.0.feed_forward.w1",
                "layers.0.feed_forward.w2",
                "layers.1",
            ];
            assert_eq!(&modules[..want_prefix.len()], want_prefix);
            assert_eq!(&modules[modules.len() - 2..], ["norm", "output"]);
            // Containers (no parameters of their own) are modules too.
            let layers = named_modules(&model)
                .into_iter()
                .find(|(n, _)| n == "layers")
                .map(|(_, m)| m);
            assert_eq!(layers.map(|m| m.own_parameters().len()), Some(0));
            assert_eq!(layers.map(|m| m.parameters().len()), Some(2 * 12));
            Ok(modules.len())
        })
        .unwrap();
        assert_eq!(out, vec![1 + 2 + 1 + 2 * 11 + 2]);
    }
}
