//! The LLaMA-style reference model against PyTorch's reference runs: the same
//! initial weights (`llama_tiny_init.safetensors`), token batches and AdamW, on
//! one rank, FSDP, TP, TP with sequence parallelism, FSDP×TP, HSDP×TP and bf16
//! mixed precision; the loss at every step within 1e-5 (bf16: 1e-3), the
//! weights after 20 single-rank steps within 1e-5; and the collectives of a
//! block under the TP plans.

mod common;

use common::{adamw, data, max_abs_diff, reference_losses_in, tokens};
use tessera::autograd::nn::{Materializer, Module};
use tessera::autograd::optim::{AdamW, Optimizer};
use tessera::autograd::{Var, backward, read_safetensors};
use tessera::dtensor::{Placement, Tensor, distribute_tensor};
use tessera::fsdp::{FsdpConfig, MixedPrecisionPolicy};
use tessera::mesh::{CommCounts, OpKind};
use tessera::models::{ActivationCheckpointing, CausalLm, Llama, LlamaConfig, Transformer, TransformerConfig};
use tessera::tensor::ops::rotary_tables;
use tessera::{DType, DeviceMesh, launch};

/// The reference's losses of `run`.
fn reference(run: &str) -> Vec<f64> {
    reference_losses_in("llama_reference.json", run)
}

/// How a run is laid out.
#[derive(Clone, Copy)]
struct Layout {
    /// Mesh sizes and names; a last dim named `tp` is tensor-parallel.
    mesh: &'static [usize],
    names: &'static [&'static str],
    /// FSDP over the data-parallel dims (HSDP when there are two).
    fsdp: bool,
    sequence_parallel: bool,
    bf16: bool,
    /// Which blocks recompute their activations in backward.
    ac: ActivationCheckpointing,
}

struct Run {
    losses: Vec<f64>,
    weights: Vec<(String, Tensor)>,
}

/// Trains the tiny LLaMA for `steps` with global batch 8 laid out as `layout`.
fn train(layout: Layout, steps: usize) -> Run {
    let toks = tokens();
    let world = layout.mesh.iter().product();
    launch(world, move |ctx| {
        let mesh = DeviceMesh::with_names(ctx.into_comm(), layout.mesh, layout.names)?;
        let model = Llama::new(LlamaConfig::TINY, &mesh, DType::F32)?;
        model.set_activation_checkpointing(layout.ac)?;
        let tp = layout.names.last() == Some(&"tp");
        let dp_names = &layout.names[..layout.names.len() - usize::from(tp)];
        if tp {
            model.parallelize(&mesh.dim("tp")?, layout.sequence_parallel)?;
        }
        if layout.fsdp {
            let config = FsdpConfig {
                mp_policy: if layout.bf16 {
                    MixedPrecisionPolicy::bf16()
                } else {
                    MixedPrecisionPolicy::default()
                },
                ..FsdpConfig::default()
            };
            model.fully_shard(&mesh.slice(dp_names)?, &config)?;
        }
        Materializer::from_safetensors(data("llama_tiny_init.safetensors")).materialize(&model)?;
        let params = model.parameters();
        let mut opt = AdamW::new(params.clone(), adamw())?;
        let placements: Vec<Placement> = layout
            .names
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
        for step in 0..steps {
            let rows = toks.narrow(0, step, 1)?.narrow(1, 0, 8)?.reshape(&[8, 33])?;
            let rows = Var::constant(distribute_tensor(&rows, &mesh, &placements)?);
            let loss = model.loss(&rows)?;
            assert_eq!(
                loss.value().dtype(),
                DType::F32,
                "the loss is f32 whatever the compute dtype"
            );
            losses.push(loss.value().full_tensor()?.to_f64_vec()[0]);
            backward(&loss)?;
            opt.step()?;
            opt.zero_grad();
        }
        let weights = params
            .iter()
            .map(|p| Ok((p.name(), p.value()?.full_tensor()?)))
            .collect::<tessera::autograd::Result<Vec<_>>>()?;
        Ok(Run { losses, weights })
    })
    .unwrap()
    .swap_remove(0)
}

fn check(layout: Layout, run: &str, tol: f64) -> Run {
    let got = train(layout, 20);
    let want = reference(run);
    let worst = max_abs_diff(&got.losses, &want);
    eprintln!("llama {run}: max |Δloss| over {} steps = {worst:e}", want.len());
    assert!(worst < tol, "{run}: {:?}\nvs PyTorch {want:?}", got.losses);
    got
}

const FLAT: Layout = Layout {
    mesh: &[1],
    names: &["dp"],
    fsdp: false,
    sequence_parallel: false,
    bf16: false,
    ac: ActivationCheckpointing::None,
};

#[test]
fn single_rank_matches_pytorch_in_losses_and_final_weights() {
    let run = check(FLAT, "single_G8", 1e-5);
    let want = read_safetensors(data("llama_tiny_single_G8.final.safetensors")).unwrap();
    let mut worst = 0.0f64;
    for (name, w) in &run.weights {
        let (_, r) = want.iter().find(|(n, _)| n == name).unwrap_or_else(|| panic!("{name}"));
        worst = worst.max(max_abs_diff(&w.to_f64_vec(), &r.to_f64_vec()));
    }
    eprintln!("llama single_G8: max |Δw| after 20 steps = {worst:e}");
    assert!(worst < 1e-5, "final weights differ by {worst:e}");
}

#[test]
fn fsdp_matches_pytorch() {
    let layout = Layout {
        mesh: &[2],
        fsdp: true,
        ..FLAT
    };
    check(layout, "fsdp_W2_G8", 1e-5);
}

#[test]
fn tensor_parallel_matches_pytorch_with_and_without_sequence_parallelism() {
    let tp = Layout {
        mesh: &[2],
        names: &["tp"],
        ..FLAT
    };
    check(tp, "tp_W2_G8", 1e-5);
    let sp = Layout {
        sequence_parallel: true,
        ..tp
    };
    check(sp, "tp_sp_W2_G8", 1e-5);
}

#[test]
fn fsdp_and_hsdp_over_tensor_parallelism_match_pytorch() {
    let fsdp_tp = Layout {
        mesh: &[2, 2],
        names: &["dp", "tp"],
        fsdp: true,
        ..FLAT
    };
    check(fsdp_tp, "fsdp_tp_2x2_G8", 1e-5);
    let hsdp_tp = Layout {
        mesh: &[2, 2, 2],
        names: &["dp_replicate", "dp_shard", "tp"],
        fsdp: true,
        ..FLAT
    };
    check(hsdp_tp, "hsdp_tp_2x2x2_G8", 1e-5);
}

/// Recomputing every block (FSDP over sequence-parallel TP: the blocks' FSDP
/// units and TP collectives run again in backward) trains the same model:
/// PyTorch's losses, and bit for bit the weights of the run that keeps its
/// activations.
#[test]
fn activation_checkpointing_trains_the_same_model() {
    let kept = Layout {
        mesh: &[2, 2],
        names: &["dp", "tp"],
        fsdp: true,
        sequence_parallel: true,
        ..FLAT
    };
    let recomputed = check(
        Layout {
            ac: ActivationCheckpointing::Full,
            ..kept
        },
        "fsdp_tp_2x2_G8",
        1e-5,
    );
    let kept = train(kept, 20);
    assert_eq!(recomputed.losses, kept.losses);
    for ((name, a), (_, b)) in recomputed.weights.iter().zip(&kept.weights) {
        assert_eq!(a.to_f64_vec(), b.to_f64_vec(), "{name}");
    }
}

#[test]
fn bf16_mixed_precision_matches_pytorch() {
    let fsdp = Layout {
        mesh: &[2],
        fsdp: true,
        bf16: true,
        ..FLAT
    };
    check(fsdp, "fsdp_W2_G8_bf16", 1e-3);
    // One rank with the same policy: PyTorch's emulated run (f32 master
    // weights, a bf16 compute copy).
    let single = Layout {
        fsdp: true,
        bf16: true,
        ..FLAT
    };
    check(single, "single_G8_bf16_emulated", 1e-3);
}

/// The rotary tables equal the reference's bit for bit.
#[test]
fn rotary_tables_equal_the_references_bits() {
    let want = read_safetensors(data("llama_tiny_rope.safetensors")).unwrap();
    let positions: Vec<usize> = (0..32).collect();
    let (cos, sin) = rotary_tables(&positions, 16, 10000.0).unwrap();
    for (name, got) in [("cos", cos), ("sin", sin)] {
        let (_, r) = want.iter().find(|(n, _)| n == name).unwrap();
        let bits = |t: &Tensor| {
            t.to_vec::<f32>()
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect::<Vec<_>>()
        };
        assert_eq!(bits(&got), bits(r), "{name}");
    }
}

/// Collectives (all-gather, reduce-scatter, all-reduce, all-to-all calls) of
/// one forward and one backward of `model(n_layers)` on `tp` ranks.
fn step_calls<M: CausalLm>(
    tp: usize,
    sequence_parallel: bool,
    n_layers: usize,
    model: fn(usize, &DeviceMesh) -> tessera::autograd::Result<M>,
) -> [[u64; 4]; 2] {
    launch(tp, move |ctx| {
        let mesh = DeviceMesh::with_names(ctx.into_comm(), &[tp], &["tp"])?;
        let model = model(n_layers, &mesh)?;
        model.parallelize(&mesh, sequence_parallel)?;
        model.materializer(3).materialize(&model)?;
        let rows = tokens().narrow(0, 0, 1)?.narrow(1, 0, 4)?.reshape(&[4, 33])?;
        let rows = Var::constant(distribute_tensor(&rows, &mesh, &[Placement::Replicate])?);
        let calls = |c: CommCounts| {
            [
                OpKind::AllGather,
                OpKind::ReduceScatter,
                OpKind::AllReduce,
                OpKind::AllToAll,
            ]
            .map(|k| c.calls(k))
        };
        let before = mesh.stats();
        let loss = model.loss(&rows)?;
        let mid = mesh.stats();
        backward(&loss)?;
        Ok([calls(mid - before), calls(mesh.stats() - mid)])
    })
    .unwrap()
    .swap_remove(0)
}

/// Per-block calls: two layers minus one.
fn per_block<M: CausalLm>(
    sequence_parallel: bool,
    model: fn(usize, &DeviceMesh) -> tessera::autograd::Result<M>,
) -> [[u64; 4]; 2] {
    let (one, two) = (
        step_calls(2, sequence_parallel, 1, model),
        step_calls(2, sequence_parallel, 2, model),
    );
    [0, 1].map(|w| [0, 1, 2, 3].map(|k| two[w][k] - one[w][k]))
}

fn llama(n_layers: usize, mesh: &DeviceMesh) -> tessera::autograd::Result<Llama> {
    Llama::new(
        LlamaConfig {
            n_layers,
            ..LlamaConfig::TINY
        },
        mesh,
        DType::F32,
    )
}

fn gpt(n_layers: usize, mesh: &DeviceMesh) -> tessera::autograd::Result<Transformer> {
    Transformer::new(
        TransformerConfig {
            n_layers,
            ..TransformerConfig::TINY
        },
        mesh,
        DType::F32,
    )
}

/// Per block, LLaMA's TP plans cost what the GPT model's do: two all-reduces
/// forward and two backward without sequence parallelism; with it, an
/// all-gather and a reduce-scatter for the attention and for the MLP, each way,
/// plus in backward one all-reduce per sequence-parallel norm parameter (their
/// gradients are partial over the sequence shards): RMSNorm's 2 weights where
/// LayerNorm has 2 weights and 2 biases. (Calls listed as [all-gather,
/// reduce-scatter, all-reduce, all-to-all].)
#[test]
fn per_block_collectives_equal_the_gpt_models() {
    let plain = per_block(false, llama);
    eprintln!("llama tp block (forward, backward): {plain:?}");
    assert_eq!(plain, [[0, 0, 2, 0]; 2]);
    assert_eq!(plain, per_block(false, gpt));
    let (sp, gpt_sp) = (per_block(true, llama), per_block(true, gpt));
    eprintln!("llama sp block (forward, backward): {sp:?}; gpt: {gpt_sp:?}");
    assert_eq!(sp, [[2, 2, 0, 0], [2, 2, 2, 0]]);
    assert_eq!(sp[0], gpt_sp[0]);
    assert_eq!(sp[1][..2], gpt_sp[1][..2]);
    assert_eq!(gpt_sp[1][2], 4, "LayerNorm: weight and bias");
}
