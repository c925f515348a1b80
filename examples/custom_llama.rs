//! A user's own LLaMA-style model, the path a researcher follows: the model
//! written on Tessera's public API (RMSNorm, rotary positions, grouped-query
//! attention, a SwiGLU MLP; its blocks take `(x, positions)`), its own
//! tensor-parallel plan, FSDP over TP on a `(dp 2, tp 2)` mesh with a
//! warmup-cosine schedule, a sharded checkpoint after step 6, and the run
//! resumed from it on another mesh (FSDP on 2 ranks, no TP), where it goes on
//! as the uninterrupted run does.
//!
//! ```text
//! cargo run --release --example custom_llama
//! ```

use std::path::PathBuf;

use tessera::autograd::nn::{Embedding, Init, Inputs, Linear, Materializer, Module, RMSNorm, name_parameters};
use tessera::autograd::optim::{AdamW, AdamWConfig, LrScheduler, Optimizer, Schedule};
use tessera::autograd::{
    Progress, Result, Var, backward, load_checkpoint, load_states, save_checkpoint, states_to_metadata,
};
use tessera::data::batch;
use tessera::dtensor::{DType, Placement, Tensor, distribute_tensor_from};
use tessera::fsdp::FsdpConfig;
use tessera::fsdp::tp::{Applied, ColwiseParallel, ParallelPlan, RowwiseParallel, TpLayout, parallelize_module};
use tessera::models::CausalLm;
use tessera::tensor::ops::rotary_tables;
use tessera::{BoxError, DeviceMesh, launch};

const VOCAB: usize = 256;
const DIM: usize = 64;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const HIDDEN: usize = 160;
const LAYERS: usize = 2;
const SEQ: usize = 32;
const ROWS: usize = 8;
const STEPS: usize = 12;
const SAVE_AFTER: usize = 6;

/// Causal self-attention with rotary positions and grouped-query heads, called
/// with `(x [B, T, DIM], positions i64 [T])`.
struct SelfAttention {
    q: Linear,
    k: Linear,
    v: Linear,
    out: Linear,
}

impl Module for SelfAttention {
    fn named_children(&self) -> Vec<(String, &dyn Module)> {
        vec![
            ("q".into(), &self.q),
            ("k".into(), &self.k),
            ("v".into(), &self.v),
            ("out".into(), &self.out),
        ]
    }

    fn forward(&self, x: &Var) -> Result<Var> {
        // Needs its positions: a one-input call names what is missing.
        self.forward_with(&Inputs::from(x))
    }

    fn forward_with(&self, inputs: &Inputs) -> Result<Var> {
        let (x, positions) = (inputs.get(0)?, inputs.get(1)?);
        let (b, t, hd) = (x.value().shape()[0], x.value().shape()[1], DIM / HEADS);
        let at: Vec<usize> = positions
            .value()
            .full_tensor()?
            .to_vec::<i64>()?
            .iter()
            .map(|&p| p as usize)
            .collect();
        let (cos, sin) = rotary_tables(&at, hd, 10000.0)?;
        // Under TP the projections are column-parallel: each rank holds whole
        // heads, and the ops below run on them as written, with global shapes.
        let q = self
            .q
            .call(x)?
            .reshape(&[b, t, HEADS, hd])?
            .rotary_embedding(&cos, &sin)?;
        let k = self
            .k
            .call(x)?
            .reshape(&[b, t, KV_HEADS, hd])?
            .rotary_embedding(&cos, &sin)?;
        let v = self.v.call(x)?.reshape(&[b, t, KV_HEADS, hd])?;
        let (k, v) = (
            k.repeat_interleave(HEADS / KV_HEADS, -2)?,
            v.repeat_interleave(HEADS / KV_HEADS, -2)?,
        );
        let y =
            q.transpose(1, 2)?
                .scaled_dot_product_attention(&k.transpose(1, 2)?, &v.transpose(1, 2)?, true, None)?;
        self.out.call(&y.transpose(1, 2)?.reshape(&[b, t, DIM])?)
    }
}

/// `down(silu(gate(x)) · up(x))`.
struct Mlp {
    gate: Linear,
    up: Linear,
    down: Linear,
}

impl Module for Mlp {
    fn named_children(&self) -> Vec<(String, &dyn Module)> {
        vec![
            ("gate".into(), &self.gate),
            ("up".into(), &self.up),
            ("down".into(), &self.down),
        ]
    }

    fn forward(&self, x: &Var) -> Result<Var> {
        self.down.call(&self.gate.call(x)?.silu()?.mul(&self.up.call(x)?)?)
    }
}

/// A pre-norm block, called with `(x, positions)`.
struct Layer {
    norm1: RMSNorm,
    attn: SelfAttention,
    norm2: RMSNorm,
    mlp: Mlp,
}

impl Module for Layer {
    fn named_children(&self) -> Vec<(String, &dyn Module)> {
        vec![
            ("norm1".into(), &self.norm1),
            ("attn".into(), &self.attn),
            ("norm2".into(), &self.norm2),
            ("mlp".into(), &self.mlp),
        ]
    }

    fn forward(&self, x: &Var) -> Result<Var> {
        self.forward_with(&Inputs::from(x))
    }

    fn forward_with(&self, inputs: &Inputs) -> Result<Var> {
        let (x, positions) = (inputs.get(0)?, inputs.get(1)?);
        let h = x.add(&self.attn.call_with(Inputs::from(self.norm1.call(x)?).arg(positions))?)?;
        h.add(&self.mlp.call(&self.norm2.call(&h)?)?)
    }
}

/// The whole model: token ids `[B, T]` to logits `[B, T, VOCAB]`.
struct MyLm {
    embed: Embedding,
    layers: Vec<Layer>,
    norm: RMSNorm,
    head: Linear,
}

impl MyLm {
    /// Deferred: shapes and names, no storage until materialised.
    fn new(mesh: &DeviceMesh) -> Result<MyLm> {
        let lin = |i, o| Linear::new(i, o, false, mesh, DType::F32);
        let hd = DIM / HEADS;
        let layers = (0..LAYERS)
            .map(|_| {
                Ok(Layer {
                    norm1: RMSNorm::new(DIM, 1e-5, mesh, DType::F32)?,
                    attn: SelfAttention {
                        q: lin(DIM, HEADS * hd)?,
                        k: lin(DIM, KV_HEADS * hd)?,
                        v: lin(DIM, KV_HEADS * hd)?,
                        out: lin(HEADS * hd, DIM)?,
                    },
                    norm2: RMSNorm::new(DIM, 1e-5, mesh, DType::F32)?,
                    mlp: Mlp {
                        gate: lin(DIM, HIDDEN)?,
                        up: lin(DIM, HIDDEN)?,
                        down: lin(HIDDEN, DIM)?,
                    },
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let model = MyLm {
            embed: Embedding::new(VOCAB, DIM, mesh, DType::F32)?,
            layers,
            norm: RMSNorm::new(DIM, 1e-5, mesh, DType::F32)?,
            head: lin(DIM, VOCAB)?,
        };
        name_parameters(&model)?;
        Ok(model)
    }

    /// This model's tensor-parallel plan, by its own names.
    fn plan() -> ParallelPlan {
        let replicated = TpLayout::Replicate;
        ParallelPlan::new()
            .add(
                "embed",
                RowwiseParallel {
                    input_layouts: Some(replicated),
                    output_layouts: replicated,
                },
            )
            .add("layers.*.attn.q", ColwiseParallel::default())
            .add("layers.*.attn.k", ColwiseParallel::default())
            .add("layers.*.attn.v", ColwiseParallel::default())
            .add("layers.*.attn.out", RowwiseParallel::default())
            .add("layers.*.mlp.gate", ColwiseParallel::default())
            .add("layers.*.mlp.up", ColwiseParallel::default())
            .add("layers.*.mlp.down", RowwiseParallel::default())
            .add(
                "head",
                ColwiseParallel {
                    input_layouts: replicated,
                    output_layouts: replicated,
                },
            )
    }
}

impl Module for MyLm {
    fn named_children(&self) -> Vec<(String, &dyn Module)> {
        vec![
            ("embed".into(), &self.embed),
            ("layers".into(), &self.layers),
            ("norm".into(), &self.norm),
            ("head".into(), &self.head),
        ]
    }

    fn forward(&self, tokens: &Var) -> Result<Var> {
        let (t, mesh) = (tokens.value().shape()[1], tokens.value().mesh());
        let positions = Var::constant(distribute_tensor_from(
            &Tensor::arange(t, DType::I64)?,
            mesh,
            &vec![Placement::Replicate; mesh.ndim()],
            None,
        )?);
        let mut h = self.embed.call(tokens)?;
        for layer in &self.layers {
            h = layer.call_with(Inputs::from(&h).arg(&positions))?;
        }
        self.head.call(&self.norm.call(&h)?)
    }
}

/// What a training loop needs: the plan, the blocks (FSDP units), and the init.
impl CausalLm for MyLm {
    fn parallelize(&self, tp_mesh: &DeviceMesh, _sequence_parallel: bool) -> tessera::fsdp::Result<Vec<Applied>> {
        parallelize_module(self, tp_mesh, &MyLm::plan())
    }

    fn blocks(&self) -> Vec<&dyn Module> {
        self.layers.iter().map(|l| l as &dyn Module).collect()
    }

    fn materializer(&self, seed: u64) -> Materializer {
        Materializer::from_seed(seed)
            .init("*.weight", Init::Normal { mean: 0.0, std: 0.02 })
            .init("*norm*", Init::Ones)
    }

    fn num_params(&self) -> usize {
        self.parameters()
            .iter()
            .map(|p| p.shape().iter().product::<usize>())
            .sum()
    }
}

/// One run on `mesh` (names: a last `tp` dim is tensor-parallel): steps
/// `from..STEPS`, from `resume` (a checkpoint) or the seed, saving after
/// `SAVE_AFTER` steps into `save`. Returns rank 0's losses.
fn run(
    shape: &'static [usize],
    names: &'static [&'static str],
    resume: Option<PathBuf>,
    save: Option<PathBuf>,
) -> std::result::Result<Vec<f64>, BoxError> {
    let world = shape.iter().product();
    let losses = launch(world, move |ctx| {
        let mesh = DeviceMesh::with_names(ctx.into_comm(), shape, names)?;
        let model = MyLm::new(&mesh)?;
        let tp = names.last() == Some(&"tp");
        if tp {
            model.parallelize(&mesh.dim("tp")?, false)?;
        }
        let dp_names = &names[..names.len() - usize::from(tp)];
        model.fully_shard(&mesh.slice(dp_names)?, &FsdpConfig::default())?;
        let params = model.parameters();
        let adamw = AdamWConfig {
            lr: 3e-3,
            betas: (0.9, 0.95),
            eps: 1e-8,
            weight_decay: 0.1,
        };
        let mut opt = AdamW::new(params.clone(), adamw)?;
        let mut sched = LrScheduler::new(Schedule::warmup_cosine(2, STEPS as u64, 0.0)?, &mut opt)?;
        let mut first = 0;
        match &resume {
            // The checkpoint materialises the (deferred) parameters and the
            // optimizer's state on this mesh, whatever mesh saved them.
            Some(dir) => {
                let loaded = load_checkpoint(dir, &params, Some(&mut opt))?;
                let mut progress = Progress::default();
                load_states(
                    &loaded.metadata,
                    &mut [("progress", &mut progress), ("lr_scheduler", &mut sched)],
                )?;
                sched.apply(&mut opt)?;
                first = usize::try_from(progress.step)?;
            }
            None => {
                model.materializer(0).materialize(&model)?;
            }
        }
        let placements: Vec<Placement> = names
            .iter()
            .map(|n| {
                if *n == "tp" {
                    Placement::Replicate
                } else {
                    Placement::Shard(0)
                }
            })
            .collect();
        let mut losses = Vec::new();
        for step in first..STEPS {
            let rows = Tensor::from_vec(
                batch(1234, step as u64, 0..ROWS as u64, SEQ + 1, VOCAB as u64),
                &[ROWS, SEQ + 1],
            )?;
            let rows = Var::constant(distribute_tensor_from(&rows, &mesh, &placements, None)?);
            let loss = model.loss(&rows)?;
            losses.push(loss.value().item()?);
            backward(&loss)?;
            opt.step()?;
            sched.step(&mut opt)?;
            opt.zero_grad();
            if step + 1 == SAVE_AFTER
                && let Some(dir) = &save
            {
                let progress = Progress {
                    step: SAVE_AFTER as u64,
                    position: (SAVE_AFTER * ROWS) as u64,
                };
                let meta = states_to_metadata(&[("progress", &progress), ("lr_scheduler", &sched)])?;
                save_checkpoint(dir, &params, Some(&opt), meta)?;
            }
        }
        Ok(losses)
    })?;
    Ok(losses.into_iter().next().unwrap_or_default())
}

fn main() -> std::result::Result<(), BoxError> {
    let dir = std::env::temp_dir().join(format!("tessera-custom-llama-{}", std::process::id()));
    let ckpt = dir.join("step_000006");
    let whole = run(&[2, 2], &["dp", "tp"], None, Some(ckpt.clone()))?;
    println!("FSDP x TP on (dp 2, tp 2), steps 1..{STEPS}: {}", show(&whole));
    let resumed = run(&[2], &["dp"], Some(ckpt), None);
    let _ = std::fs::remove_dir_all(&dir);
    let resumed = resumed?;
    println!(
        "resumed after step {SAVE_AFTER} with FSDP on 2 ranks: {}",
        show(&resumed)
    );
    let worst = whole[SAVE_AFTER..]
        .iter()
        .zip(&resumed)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    println!("max |Δloss| of the resumed steps: {worst:e}");
    if resumed.len() != STEPS - SAVE_AFTER || worst > 1e-5 {
        return Err(format!("the resumed run left the uninterrupted one (max |Δloss| {worst:e})").into());
    }
    if whole[STEPS - 1] >= whole[0] {
        return Err("the loss did not go down".into());
    }
    Ok(())
}

fn show(losses: &[f64]) -> String {
    losses.iter().map(|l| format!("{l:.4}")).collect::<Vec<_>>().join(" ")
}
