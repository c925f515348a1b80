//! The LLaMA-style reference model: RMSNorm, rotary position embeddings,
//! grouped-query attention, a SwiGLU MLP, no biases, an untied output head;
//! parameter names as torchtitan's LLaMA (`layers.0.attention.wq.weight`).

use std::cell::{Cell, RefCell};
use std::path::Path;
use std::rc::Rc;

use tessera_autograd::nn::{Embedding, Init, Inputs, Linear, Materializer, Module, RMSNorm, name_parameters};
use tessera_autograd::{Error, Result, Var};
use tessera_dtensor::{DType, Device, Tensor};
use tessera_fsdp::FsdpConfig;
use tessera_fsdp::tp::{Applied, ParallelPlan};
use tessera_mesh::DeviceMesh;
use tessera_tensor::ops::rotary_tables;

use super::{
    ActivationCheckpointing, CausalLm, FsdpUnits, Sublayer, TpNames, call_block, next_token_loss, parallelize_plan,
    positions,
};

/// Sizes of a [`Llama`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LlamaConfig {
    /// Vocabulary size.
    pub vocab: usize,
    /// Model width.
    pub dim: usize,
    /// Number of blocks.
    pub n_layers: usize,
    /// Query heads (must divide `dim`; `dim / n_heads` must be even).
    pub n_heads: usize,
    /// Key/value heads (must divide `n_heads`): grouped-query attention.
    pub n_kv_heads: usize,
    /// Hidden units of the SwiGLU MLP.
    pub ffn_hidden: usize,
    /// The base of the rotary frequencies.
    pub rope_theta: f64,
    /// RMSNorm's epsilon.
    pub norm_eps: f64,
    /// Longest sequence the model takes.
    pub seq: usize,
}

impl LlamaConfig {
    /// The tiny reference model: dim 64, 2 layers, 4 query and 2 key/value heads,
    /// FFN hidden 192, vocab 256, seq 32, rope theta 10000, eps 1e-5.
    pub const TINY: LlamaConfig = LlamaConfig {
        vocab: 256,
        dim: 64,
        n_layers: 2,
        n_heads: 4,
        n_kv_heads: 2,
        ffn_hidden: 192,
        rope_theta: 10000.0,
        norm_eps: 1e-5,
        seq: 32,
    };

    /// Features per head.
    pub fn head_dim(&self) -> usize {
        self.dim.checked_div(self.n_heads).unwrap_or(0)
    }

    /// Number of parameters (elements).
    pub fn num_params(&self) -> usize {
        let (d, kv) = (self.dim, self.n_kv_heads * self.head_dim());
        let block = 2 * d + 2 * d * d + 2 * kv * d + 3 * d * self.ffn_hidden;
        2 * self.vocab * d + self.n_layers * block + d
    }

    /// Checks that the sizes make a model ([`Llama::new`] does too).
    ///
    /// # Errors
    /// Heads that do not divide the width, key/value heads that do not divide
    /// the query heads, an odd head dim, a theta that is not finite and positive.
    pub fn check(&self) -> Result<()> {
        let bad = |detail: String| Err(Error::Config { op: "Llama", detail });
        if self.n_heads == 0 || !self.dim.is_multiple_of(self.n_heads) {
            return bad(format!("n_heads {} must divide dim {}", self.n_heads, self.dim));
        }
        if self.n_kv_heads == 0 || !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return bad(format!(
                "n_kv_heads {} must divide n_heads {} (each key/value head serves n_heads / n_kv_heads query heads)",
                self.n_kv_heads, self.n_heads
            ));
        }
        if !self.head_dim().is_multiple_of(2) {
            return bad(format!(
                "the head dim {} (dim / n_heads) must be even: rotary embeddings turn pairs of features",
                self.head_dim()
            ));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return bad(format!("rope_theta {} must be finite and positive", self.rope_theta));
        }
        Ok(())
    }
}

/// Rotary tables for the positions last asked for.
type TableCache = RefCell<Option<(Vec<i64>, Tensor, Tensor)>>;

/// Causal grouped-query self-attention with rotary position embeddings: `wq`
/// projects to `n_heads` query heads, `wk`/`wv` to `n_kv_heads` key/value heads
/// (head `h` owns output columns `[h·hd, (h+1)·hd)`); queries and keys are
/// rotated by their positions, each key/value head is repeated for its
/// `n_heads / n_kv_heads` query heads (query head `h` uses kv head
/// `h / n_rep`), then `wo(softmax(q·kᵀ/√hd + causal mask)·v)`.
///
/// Called with `(x [B, T, D], positions [T] i64)`. Under tensor parallelism
/// each rank holds whole query and key/value heads (column-parallel
/// projections), so rotation, repetition and attention run on local heads.
///
/// PyTorch: torchtitan's `Attention` (`forward(x, freqs_cis)`), with the
/// rotation in Hugging Face's "rotate half" layout.
pub struct LlamaAttention {
    /// `layers.i.attention.wq` (`[n_heads·hd, dim]`).
    pub wq: Linear,
    /// `layers.i.attention.wk` (`[n_kv_heads·hd, dim]`).
    pub wk: Linear,
    /// `layers.i.attention.wv` (`[n_kv_heads·hd, dim]`).
    pub wv: Linear,
    /// `layers.i.attention.wo` (`[dim, n_heads·hd]`).
    pub wo: Linear,
    n_heads: usize,
    n_kv_heads: usize,
    rope_theta: f64,
    tables: TableCache,
}

impl LlamaAttention {
    /// The rotary tables `[T, hd]` of `positions` (`i64 [T]`), kept for the next
    /// call with the same positions.
    fn tables(&self, positions: &Var, hd: usize) -> Result<(Tensor, Tensor)> {
        let p = positions.value();
        if p.shape().len() != 1 || p.dtype() != DType::I64 {
            return Err(Error::Config {
                op: "LlamaAttention",
                detail: format!(
                    "positions must be i64 [seq], one per token of a row; got {} {:?}",
                    p.dtype(),
                    p.shape()
                ),
            });
        }
        // On a GPU, reading them waits for the device: the tables are cached.
        let pos = p.full_tensor()?.to(Device::Cpu)?.to_vec::<i64>()?;
        if let Some((cached, cos, sin)) = &*self.tables.borrow()
            && *cached == pos
        {
            return Ok((cos.clone(), sin.clone()));
        }
        let at: Vec<usize> = pos
            .iter()
            .map(|&q| {
                usize::try_from(q).map_err(|_| Error::Config {
                    op: "LlamaAttention",
                    detail: format!("position {q} is negative"),
                })
            })
            .collect::<Result<_>>()?;
        let (cos, sin) = rotary_tables(&at, hd, self.rope_theta)?;
        let device = p.to_local().device();
        let (cos, sin) = (cos.to(device)?, sin.to(device)?);
        *self.tables.borrow_mut() = Some((pos, cos.clone(), sin.clone()));
        Ok((cos, sin))
    }
}

impl Module for LlamaAttention {
    fn named_children(&self) -> Vec<(String, &dyn Module)> {
        vec![
            ("wq".into(), &self.wq),
            ("wk".into(), &self.wk),
            ("wv".into(), &self.wv),
            ("wo".into(), &self.wo),
        ]
    }

    /// Attention over `x` at positions `0..T`.
    fn forward(&self, x: &Var) -> Result<Var> {
        let t = x.value().shape().get(1).copied().unwrap_or(0);
        self.forward_with(&Inputs::from(x).arg(&positions(t, x.value().mesh())?))
    }

    /// Attention over `x` `[B, T, D]` (input 0) at `positions` (input 1, `i64 [T]`).
    fn forward_with(&self, inputs: &Inputs) -> Result<Var> {
        let (x, pos) = (inputs.get(0)?, inputs.get(1)?);
        let s = x.value().shape().to_vec();
        let (b, t, d) = (s[0], s[1], s[2]);
        let hd = d / self.n_heads;
        let heads = |lin: &Linear, n: usize| -> Result<Var> { lin.call(x)?.reshape(&[b, t, n, hd]) };
        let (cos, sin) = self.tables(pos, hd)?;
        let q = heads(&self.wq, self.n_heads)?.rotary_embedding(&cos, &sin)?;
        let k = heads(&self.wk, self.n_kv_heads)?.rotary_embedding(&cos, &sin)?;
        let v = heads(&self.wv, self.n_kv_heads)?;
        let n_rep = self.n_heads / self.n_kv_heads;
        let (k, v) = (k.repeat_interleave(n_rep, 2)?, v.repeat_interleave(n_rep, 2)?);
        let [q, k, v] = [q, k, v].map(|h| h.permute(&[0, 2, 1, 3]));
        let out = q?.scaled_dot_product_attention(&k?, &v?, true, None)?;
        let out = out.permute(&[0, 2, 1, 3])?.reshape(&[b, t, d])?;
        self.wo.call(&out)
    }
}

/// The SwiGLU MLP of a block: `w2(silu(w1(x)) · w3(x))`.
///
/// PyTorch: torchtitan's `FeedForward`.
pub struct FeedForward {
    /// `layers.i.feed_forward.w1` (`[hidden, dim]`).
    pub w1: Linear,
    /// `layers.i.feed_forward.w2` (`[dim, hidden]`).
    pub w2: Linear,
    /// `layers.i.feed_forward.w3` (`[hidden, dim]`).
    pub w3: Linear,
}

impl Module for FeedForward {
    fn named_children(&self) -> Vec<(String, &dyn Module)> {
        vec![
            ("w1".into(), &self.w1),
            ("w2".into(), &self.w2),
            ("w3".into(), &self.w3),
        ]
    }

    fn forward(&self, x: &Var) -> Result<Var> {
        self.w2.call(&self.w1.call(x)?.silu()?.mul(&self.w3.call(x)?)?)
    }
}

/// One block, called with `(x, positions)`:
/// `h = x + attention(attention_norm(x), positions)`, `out = h + feed_forward(ffn_norm(h))`.
///
/// PyTorch: torchtitan's `TransformerBlock`.
pub struct LlamaBlock {
    /// `layers.i.attention_norm`.
    pub attention_norm: RMSNorm,
    /// `layers.i.attention`.
    pub attention: LlamaAttention,
    /// `layers.i.ffn_norm`.
    pub ffn_norm: RMSNorm,
    /// `layers.i.feed_forward`.
    pub feed_forward: FeedForward,
}

impl LlamaBlock {
    fn new(cfg: &LlamaConfig, mesh: &DeviceMesh, dtype: DType) -> Result<LlamaBlock> {
        let (d, kv) = (cfg.dim, cfg.n_kv_heads * cfg.head_dim());
        let lin = |i, o| Linear::new(i, o, false, mesh, dtype);
        Ok(LlamaBlock {
            attention_norm: RMSNorm::new(d, cfg.norm_eps, mesh, dtype)?,
            attention: LlamaAttention {
                wq: lin(d, d)?,
                wk: lin(d, kv)?,
                wv: lin(d, kv)?,
                wo: lin(d, d)?,
                n_heads: cfg.n_heads,
                n_kv_heads: cfg.n_kv_heads,
                rope_theta: cfg.rope_theta,
                tables: RefCell::new(None),
            },
            ffn_norm: RMSNorm::new(d, cfg.norm_eps, mesh, dtype)?,
            feed_forward: FeedForward {
                w1: lin(d, cfg.ffn_hidden)?,
                w2: lin(cfg.ffn_hidden, d)?,
                w3: lin(d, cfg.ffn_hidden)?,
            },
        })
    }
}

impl Module for LlamaBlock {
    fn named_children(&self) -> Vec<(String, &dyn Module)> {
        vec![
            ("attention_norm".into(), &self.attention_norm),
            ("attention".into(), &self.attention),
            ("ffn_norm".into(), &self.ffn_norm),
            ("feed_forward".into(), &self.feed_forward),
        ]
    }

    /// The block at positions `0..T`.
    fn forward(&self, x: &Var) -> Result<Var> {
        let t = x.value().shape().get(1).copied().unwrap_or(0);
        self.forward_with(&Inputs::from(x).arg(&positions(t, x.value().mesh())?))
    }

    fn forward_with(&self, inputs: &Inputs) -> Result<Var> {
        let (x, pos) = (inputs.get(0)?, inputs.get(1)?);
        let attn_in = Inputs::from(self.attention_norm.call(x)?).arg(pos);
        let h = x.add(&self.attention.call_with(attn_in)?)?;
        h.add(&self.feed_forward.call(&self.ffn_norm.call(&h)?)?)
    }
}

/// The LLaMA-style reference model: `h0 = tok[tokens]`, blocks called with
/// `(h, positions)`, RMSNorm, untied output projection. Forward maps `i64`
/// tokens `[B, T]` to logits `[B, T, V]` (positions `0..T`; a call with the
/// named input `positions` takes others).
///
/// PyTorch: torchtitan's LLaMA 3 `Transformer`, without the positional
/// table; parameter names equal its state-dict keys.
pub struct Llama {
    /// `tok_embeddings`.
    pub tok_embeddings: Embedding,
    /// `layers.i` (shared, so that a block recomputed in backward can be
    /// called again: see [`ActivationCheckpointing`]).
    pub layers: Vec<Rc<LlamaBlock>>,
    /// `norm`.
    pub norm: RMSNorm,
    /// `output` (no bias).
    pub output: Linear,
    cfg: LlamaConfig,
    checkpointing: Cell<ActivationCheckpointing>,
}

/// The modules of LLaMA's tensor-parallel plans (the attention's second input,
/// its positions, is not laid out).
const LLAMA_TP: TpNames = TpNames {
    embeddings: &[("tok_embeddings", 1)],
    sublayers: &[
        Sublayer {
            norm: "layers.*.attention_norm",
            module: "layers.*.attention",
            extra_inputs: 1,
            column: &["wq", "wk", "wv"],
            row: "wo",
        },
        Sublayer {
            norm: "layers.*.ffn_norm",
            module: "layers.*.feed_forward",
            extra_inputs: 0,
            column: &["w1", "w3"],
            row: "w2",
        },
    ],
};

/// The Hugging Face name (as `LlamaForCausalLM` keys its state dict) of the
/// [`Llama`] parameter `name`: `layers.0.attention.wq.weight` is
/// `model.layers.0.self_attn.q_proj.weight`, `feed_forward.w1/w3/w2` are
/// `mlp.gate_proj/up_proj/down_proj`, `attention_norm`/`ffn_norm` are
/// `input_layernorm`/`post_attention_layernorm`, `tok_embeddings` is
/// `model.embed_tokens`, `norm` is `model.norm`, `output` is `lm_head`. The
/// values need no change: both apply rotary embeddings in the rotate-half
/// layout and repeat key/value heads alike. `None` for a name the model does
/// not have.
///
/// PyTorch: the key map of torchtitan's checkpoint conversion to Hugging Face.
pub fn hf_name(name: &str) -> Option<String> {
    let fixed = match name {
        "tok_embeddings.weight" => Some("model.embed_tokens.weight"),
        "norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(f) = fixed {
        return Some(f.to_string());
    }
    let rest = name.strip_prefix("layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    layer.parse::<usize>().ok()?;
    let hf = match rest {
        "attention_norm.weight" => "input_layernorm.weight",
        "ffn_norm.weight" => "post_attention_layernorm.weight",
        "attention.wq.weight" => "self_attn.q_proj.weight",
        "attention.wk.weight" => "self_attn.k_proj.weight",
        "attention.wv.weight" => "self_attn.v_proj.weight",
        "attention.wo.weight" => "self_attn.o_proj.weight",
        "feed_forward.w1.weight" => "mlp.gate_proj.weight",
        "feed_forward.w3.weight" => "mlp.up_proj.weight",
        "feed_forward.w2.weight" => "mlp.down_proj.weight",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf}"))
}

impl LlamaConfig {
    /// The `config.json` with which Hugging Face's `LlamaForCausalLM` builds a
    /// model of these sizes, its weights in `dtype` (`float32` or `bfloat16`).
    pub fn hf_config_json(&self, dtype: DType) -> String {
        let torch_dtype = match dtype {
            DType::BF16 => "bfloat16",
            DType::F16 => "float16",
            DType::F64 => "float64",
            _ => "float32",
        };
        let config = serde_json::json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab,
            "hidden_size": self.dim,
            "intermediate_size": self.ffn_hidden,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.head_dim(),
            "hidden_act": "silu",
            "max_position_embeddings": self.seq,
            "rms_norm_eps": self.norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": null,
            "attention_bias": false,
            "mlp_bias": false,
            "tie_word_embeddings": false,
            "initializer_range": 0.02,
            "torch_dtype": torch_dtype,
        });
        // INVARIANT: a JSON value of plain fields always serializes.
        serde_json::to_string_pretty(&config).expect("a JSON object serializes")
    }
}

impl Llama {
    /// Writes the model as Hugging Face's `LlamaForCausalLM.from_pretrained`
    /// reads it: `dir/model.safetensors`, every parameter whole under its
    /// [`hf_name`], and `dir/config.json` ([`LlamaConfig::hf_config_json`]).
    /// Collective over the parameters' meshes, as
    /// [`save_state_dict_full`](tessera_autograd::save_state_dict_full): each
    /// tensor is gathered in turn and rank 0 writes, each file atomically.
    ///
    /// PyTorch: `get_model_state_dict(..., full_state_dict=True)`, renamed by a
    /// conversion script, then `save_pretrained`.
    ///
    /// # Errors
    /// As `save_state_dict_full`; a directory that cannot be made or written.
    pub fn save_hf(&self, dir: impl AsRef<Path>) -> Result<()> {
        let dir = dir.as_ref();
        std::fs::create_dir_all(dir).map_err(|source| Error::Io {
            path: dir.to_path_buf(),
            action: "cannot create the directory",
            source,
        })?;
        let params = self.parameters();
        for p in &params {
            if hf_name(&p.name()).is_none() {
                return Err(Error::Config {
                    op: "save_hf",
                    detail: format!("parameter {} has no Hugging Face name", p.name()),
                });
            }
        }
        let rename = |name: &str| hf_name(name).unwrap_or_else(|| name.to_string());
        tessera_autograd::save_state_dict_full_renamed(&params, dir.join("model.safetensors"), &rename)?;
        let lead = params.first().is_none_or(|p| p.mesh().comm().rank() == 0);
        if lead {
            let dtype = params.first().map_or(DType::F32, |p| p.dtype());
            tessera_autograd::write_atomic(dir.join("config.json"), self.cfg.hf_config_json(dtype).as_bytes())?;
        }
        Ok(())
    }

    /// A deferred model replicated on `mesh`: every parameter has its shape,
    /// dtype and name but no storage. Plan and shard it
    /// ([`parallelize`](Self::parallelize), [`fully_shard`](Self::fully_shard)),
    /// then materialise each rank's shards ([`CausalLm::materializer`] for the
    /// reference initialisation, or a safetensors file or a checkpoint).
    ///
    /// # Errors
    /// Sizes that do not make a model (heads not dividing, an odd head dim),
    /// sizes a tensor cannot have.
    pub fn new(cfg: LlamaConfig, mesh: &DeviceMesh, dtype: DType) -> Result<Llama> {
        cfg.check()?;
        let layers = (0..cfg.n_layers)
            .map(|_| LlamaBlock::new(&cfg, mesh, dtype).map(Rc::new))
            .collect::<Result<Vec<_>>>()?;
        let model = Llama {
            tok_embeddings: Embedding::new(cfg.vocab, cfg.dim, mesh, dtype)?,
            layers,
            norm: RMSNorm::new(cfg.dim, cfg.norm_eps, mesh, dtype)?,
            output: Linear::new(cfg.dim, cfg.vocab, false, mesh, dtype)?,
            cfg,
            checkpointing: Cell::new(ActivationCheckpointing::None),
        };
        name_parameters(&model)?;
        Ok(model)
    }

    /// The configuration.
    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }

    /// torchtitan's tensor-parallel plan without sequence parallelism: the token
    /// table row-wise (vocab rows sharded, replicated output), `wq`/`wk`/`wv` and
    /// `w1`/`w3` column-wise, `wo` and `w2` row-wise (outputs all-reduced), the
    /// output head column-wise with the logits gathered to `Replicate`; norms
    /// replicated. Per block and forward: two all-reduces.
    ///
    /// PyTorch: torchtitan's `apply_tp` with `enable_async_tp=False`, no loss parallel.
    pub fn tp_plan() -> ParallelPlan {
        super::tp_plan(&LLAMA_TP, false)
    }

    /// torchtitan's sequence-parallel plan: activations between blocks sharded
    /// along the sequence (`Shard(1)`), the norms [`SequenceParallel`](tessera_fsdp::tp::SequenceParallel), the
    /// attention's and the MLP's inputs gathered (`PrepareModuleInput`; the
    /// attention's positions, its second input, left alone) and their outputs
    /// reduce-scattered back; the output head gathers the sequence and leaves the
    /// logits sharded by class (`Shard(-1)`): the loss is computed without
    /// gathering them (loss parallel).
    ///
    /// PyTorch: torchtitan's `apply_tp` with sequence parallelism and loss parallel.
    pub fn tp_plan_sequence_parallel() -> ParallelPlan {
        super::tp_plan(&LLAMA_TP, true)
    }

    /// Applies [`tp_plan`](Self::tp_plan) (or, with `sequence_parallel`,
    /// [`tp_plan_sequence_parallel`](Self::tp_plan_sequence_parallel)) over `tp_mesh`.
    ///
    /// # Errors
    /// A tp size not dividing the key/value heads (each rank holds whole key/value
    /// heads and the query heads that use them); as [`parallelize_module`](tessera_fsdp::tp::parallelize_module).
    pub fn parallelize(&self, tp_mesh: &DeviceMesh, sequence_parallel: bool) -> tessera_fsdp::Result<Vec<Applied>> {
        let kv = self.cfg.n_kv_heads;
        let why = move |tp: usize| {
            format!(
                "tensor parallelism over {tp} ranks must give each rank whole key/value heads; \
                 use a tp size dividing n_kv_heads {kv}"
            )
        };
        parallelize_plan(
            self,
            &LLAMA_TP,
            tp_mesh,
            sequence_parallel,
            ("Llama::parallelize", kv, why),
        )
    }

    /// FSDP per block, then the root (see [`CausalLm::fully_shard`]).
    ///
    /// # Errors
    /// As [`fully_shard`](tessera_fsdp::fully_shard).
    pub fn fully_shard(&self, mesh: &DeviceMesh, config: &FsdpConfig) -> tessera_fsdp::Result<FsdpUnits> {
        CausalLm::fully_shard(self, mesh, config)
    }

    /// The mean next-token cross entropy of rows `[B, T+1]`, in f32 (see
    /// [`CausalLm::loss`]).
    ///
    /// # Errors
    /// Rows shorter than 2 tokens, shapes that do not fit.
    pub fn loss(&self, rows: &Var) -> Result<Var> {
        next_token_loss(self, rows)
    }
}

impl Module for Llama {
    fn named_children(&self) -> Vec<(String, &dyn Module)> {
        vec![
            ("tok_embeddings".into(), &self.tok_embeddings),
            ("layers".into(), &self.layers),
            ("norm".into(), &self.norm),
            ("output".into(), &self.output),
        ]
    }

    fn forward(&self, tokens: &Var) -> Result<Var> {
        self.forward_with(&Inputs::from(tokens))
    }

    /// Logits of `tokens` `[B, T]` (input 0) at the named input `positions`
    /// (`i64 [T]`; default `0..T`).
    fn forward_with(&self, inputs: &Inputs) -> Result<Var> {
        let tokens = inputs.get(0)?;
        let t = tokens.value().shape().get(1).copied().unwrap_or(0);
        if t > self.cfg.seq {
            return Err(Error::Config {
                op: "Llama",
                detail: format!("a row of {t} tokens is longer than the model's seq {}", self.cfg.seq),
            });
        }
        let pos = match inputs.named("positions") {
            Some(p) => p.clone(),
            None => positions(t, tokens.value().mesh())?,
        };
        let mut h = self.tok_embeddings.call(tokens)?;
        let ac = self.checkpointing.get();
        for (i, l) in self.layers.iter().enumerate() {
            h = call_block(l, i, ac, &[h, pos.clone()])?;
        }
        self.output.call(&self.norm.call(&h)?)
    }
}

impl CausalLm for Llama {
    fn parallelize(&self, tp_mesh: &DeviceMesh, sequence_parallel: bool) -> tessera_fsdp::Result<Vec<Applied>> {
        Llama::parallelize(self, tp_mesh, sequence_parallel)
    }

    fn blocks(&self) -> Vec<&dyn Module> {
        self.layers.iter().map(|b| b as &dyn Module).collect()
    }

    fn ends(&self) -> [Vec<&dyn Module>; 2] {
        [vec![&self.tok_embeddings], vec![&self.norm, &self.output]]
    }

    fn set_activation_checkpointing(&self, ac: ActivationCheckpointing) -> Result<()> {
        self.checkpointing.set(ac);
        Ok(())
    }

    fn activation_checkpointing(&self) -> ActivationCheckpointing {
        self.checkpointing.get()
    }

    /// The reference initialisation: every weight but the norms' `N(0, 0.02²)`,
    /// norms 1.
    fn materializer(&self, seed: u64) -> Materializer {
        let normal = Init::Normal { mean: 0.0, std: 0.02 };
        Materializer::from_seed(seed)
            .init("tok_embeddings.weight", normal)
            .init("layers.*.attention.*.weight", normal)
            .init("layers.*.feed_forward.*.weight", normal)
            .init("output.weight", normal)
    }

    fn save_hf(&self, dir: &Path) -> Result<()> {
        Llama::save_hf(self, dir)
    }

    fn num_params(&self) -> usize {
        self.cfg.num_params()
    }
}

#[cfg(test)]
mod tests {
    use tessera_mesh::launch;

    use super::*;

    #[test]
    fn names_follow_the_reference_and_bad_sizes_are_named() {
        let names = launch(1, |ctx| {
            let mesh = DeviceMesh::new(ctx.into_comm(), &[1])?;
            let model = Llama::new(LlamaConfig::TINY, &mesh, DType::F32)?;
            let named = model.named_parameters();
            let elements: usize = named.iter().map(|(_, p)| p.shape().iter().product::<usize>()).sum();
            assert_eq!(elements, 131_392, "the reference's parameter count");
            assert_eq!(model.cfg.num_params(), elements);
            for (cfg, want) in [
                (
                    LlamaConfig {
                        n_kv_heads: 3,
                        ..LlamaConfig::TINY
                    },
                    "n_kv_heads 3 must divide n_heads 4",
                ),
                (
                    LlamaConfig {
                        n_heads: 5,
                        ..LlamaConfig::TINY
                    },
                    "n_heads 5 must divide dim 64",
                ),
                (
                    LlamaConfig {
                        n_heads: 64,
                        n_kv_heads: 1,
                        ..LlamaConfig::TINY
                    },
                    "must be even",
                ),
            ] {
                let err = Llama::new(cfg, &mesh, DType::F32)
                    .err()
                    .map(|e| e.to_string())
                    .unwrap_or_default();
                assert!(err.contains(want), "{err}");
            }
            Ok(named.into_iter().map(|(n, _)| n).collect::<Vec<_>>())
        })
        .unwrap();
        let want = [
            "tok_embeddings.weight",
            "layers.0.attention_norm.weight",
            "layers.0.attention.wq.weight",
            "layers.0.attention.wk.weight",
            "layers.0.attention.wv.weight",
            "layers.0.attention.wo.weight",
            "layers.0.ffn_norm.weight",
            "layers.0.feed_forward.w1.weight",
            "layers.0.feed_forward.w2.weight",
            "layers.0.feed_forward.w3.weight",
        ];
        assert_eq!(&names[0][..want.len()], want);
        assert_eq!(&names[0][names[0].len() - 2..], ["norm.weight", "output.weight"]);
    }
}

#[cfg(test)]
mod hf_tests {
    use super::hf_name;

    #[test]
    fn hugging_face_names() {
        for (ours, theirs) in [
            ("tok_embeddings.weight", "model.embed_tokens.weight"),
            (
                "layers.11.attention.wk.weight",
                "model.layers.11.self_attn.k_proj.weight",
            ),
            ("layers.0.feed_forward.w3.weight", "model.layers.0.mlp.up_proj.weight"),
            (
                "layers.0.ffn_norm.weight",
                "model.layers.0.post_attention_layernorm.weight",
            ),
            ("output.weight", "lm_head.weight"),
        ] {
            assert_eq!(hf_name(ours).as_deref(), Some(theirs));
        }
        for bad in [
            "layers.x.attention.wq.weight",
            "layers.0.attention.wq.bias",
            "pos_embeddings.weight",
            "layers",
        ] {
            assert_eq!(hf_name(bad), None, "{bad}");
        }
    }
}
