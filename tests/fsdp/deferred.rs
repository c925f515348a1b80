//! Deferred models: built without storage, planned and sharded, then materialised
//! shard by shard. The materialised parameters equal, bit for bit, what one rank
//! draws whole (on every mesh and layout); init never holds more than a rank's
//! shards plus one shard; ranks that would train different models are errors.

use std::collections::BTreeMap;

use tessera::autograd::nn::{FanMode, Init, Materializer, Module, Nonlinearity, ParameterDict, verify_replicas};
use tessera::autograd::optim::{AdamW, Optimizer};
use tessera::autograd::{Param, Var, backward, save_checkpoint};
use tessera::data::{DATA_SEED, batch as data_batch};
use tessera::dtensor::testing::order_from_keys;
use tessera::dtensor::{Layout, Placement, Tensor, distribute_tensor};
use tessera::fsdp::FsdpConfig;
use tessera::models::{Transformer, TransformerConfig};
use tessera::tensor::memory::{reset_peak, stats};
use tessera::tensor::rng::Rng;
use tessera::{DType, DeviceMesh, launch};

use crate::common::data;

/// Uneven everywhere: 50 rows over 3, 4 or 8 ranks, 7 positions, 24 columns.
const CFG: TransformerConfig = TransformerConfig {
    vocab: 50,
    dim: 24,
    n_layers: 2,
    n_heads: 4,
    seq: 7,
};

/// How a run lays the model out.
#[derive(Clone, Copy, Debug)]
enum Plan {
    /// One rank, nothing sharded.
    Single,
    /// FSDP over `n` ranks.
    Fsdp(usize),
    /// HSDP over `r × s`.
    Hsdp(usize, usize),
    /// Tensor parallelism over `t` ranks.
    Tp(usize),
    /// FSDP over `d` times TP over `t`.
    FsdpTp(usize, usize),
    /// HSDP over `r × s` times TP over `t`.
    HsdpTp(usize, usize, usize),
}

impl Plan {
    fn world(self) -> usize {
        match self {
            Plan::Single => 1,
            Plan::Fsdp(n) | Plan::Tp(n) => n,
            Plan::Hsdp(a, b) | Plan::FsdpTp(a, b) => a * b,
            Plan::HsdpTp(a, b, c) => a * b * c,
        }
    }

    /// The mesh's shape and dim names.
    fn dims(self) -> (Vec<usize>, Vec<&'static str>) {
        match self {
            Plan::Single => (vec![1], vec!["dp"]),
            Plan::Fsdp(n) => (vec![n], vec!["dp"]),
            Plan::Hsdp(r, s) => (vec![r, s], vec!["dp_replicate", "dp_shard"]),
            Plan::Tp(t) => (vec![t], vec!["tp"]),
            Plan::FsdpTp(d, t) => (vec![d, t], vec!["dp", "tp"]),
            Plan::HsdpTp(r, s, t) => (vec![r, s, t], vec!["dp_replicate", "dp_shard", "tp"]),
        }
    }

    /// The plan's mesh over `comm`.
    fn mesh(self, comm: Box<dyn tessera::Communicator>) -> tessera::mesh::Result<DeviceMesh> {
        let (shape, names) = self.dims();
        DeviceMesh::with_names(comm, &shape, &names)
    }

    /// A deferred `cfg` model planned on `mesh` (this plan's).
    fn model(self, mesh: &DeviceMesh, cfg: TransformerConfig, dtype: DType) -> tessera::fsdp::Result<Transformer> {
        let names = self.dims().1;
        let model = Transformer::new(cfg, mesh, dtype)?;
        let config = FsdpConfig::default();
        match self {
            Plan::Single => {}
            Plan::Fsdp(_) | Plan::Hsdp(..) => {
                model.fully_shard(mesh, &config)?;
            }
            Plan::Tp(_) => {
                model.parallelize(mesh, false)?;
            }
            Plan::FsdpTp(..) | Plan::HsdpTp(..) => {
                model.parallelize(&mesh.dim("tp")?, false)?;
                model.fully_shard(&mesh.slice(&names[..names.len() - 1])?, &config)?;
            }
        }
        Ok(model)
    }

    /// The `CFG` model planned on this plan's mesh over `comm`.
    fn build(self, comm: Box<dyn tessera::Communicator>, dtype: DType) -> tessera::fsdp::Result<Transformer> {
        self.model(&self.mesh(comm)?, CFG, dtype)
    }
}

/// Every parameter's gathered value as bits, by name.
type Bits = BTreeMap<String, Vec<u64>>;

fn gathered_bits(model: &dyn Module) -> tessera::autograd::Result<Bits> {
    model
        .named_parameters()
        .into_iter()
        .map(|(n, p)| {
            let full = p.value()?.full_tensor()?;
            Ok((n, full.to_f64_vec().into_iter().map(f64::to_bits).collect()))
        })
        .collect()
}

/// Rank 0's gathered parameters after materialising `plan` from `seed`.
fn materialized(plan: Plan, dtype: DType, seed: u64) -> Bits {
    launch(plan.world(), move |ctx| {
        let model = plan.build(ctx.into_comm(), dtype)?;
        assert!(model.parameters().iter().all(Param::is_deferred));
        Materializer::from_seed(seed).materialize(&model)?;
        Ok(gathered_bits(&model)?)
    })
    .unwrap()
    .swap_remove(0)
}

/// The bitwise-equality matrix: every plan's materialised model is the one rank
/// draws whole, parameter by parameter, in f32 and bf16.
#[test]
fn materialized_parameters_equal_whole_tensor_init_on_every_layout() {
    let plans = [
        Plan::Fsdp(2),
        Plan::Fsdp(3),
        Plan::Fsdp(4),
        Plan::Fsdp(8),
        Plan::Hsdp(2, 2),
        Plan::Tp(2),
        Plan::Tp(4),
        Plan::FsdpTp(2, 2),
        Plan::FsdpTp(3, 2),
        Plan::FsdpTp(2, 4),
        Plan::HsdpTp(2, 2, 2),
    ];
    for dtype in [DType::F32, DType::BF16] {
        let whole = materialized(Plan::Single, dtype, 5);
        assert_eq!(whole.len(), 5 + CFG.n_layers * 12);
        for plan in plans {
            let got = materialized(plan, dtype, 5);
            assert_eq!(got.len(), whole.len(), "{plan:?}");
            for (name, bits) in &whole {
                assert!(
                    got[name] == *bits,
                    "{plan:?} {dtype}: {name} differs from the whole-tensor init"
                );
            }
            println!("{plan:?} {dtype}: {} parameters bitwise equal", got.len());
        }
    }
    // A different seed is a different model (the comparison above can fail).
    assert_ne!(
        materialized(Plan::Fsdp(2), DType::F32, 6),
        materialized(Plan::Single, DType::F32, 5)
    );
}

/// A random layout on `mesh`: each mesh dim shards a random tensor dim or
/// replicates, and a tensor dim that several mesh dims shard splits in a random
/// order.
fn random_layout(rng: &mut Rng, mesh_shape: &[usize], shape: &[usize], dtype: DType) -> Layout {
    let placements: Vec<Placement> = mesh_shape
        .iter()
        .map(|_| {
            if shape.is_empty() || rng.next_u64().is_multiple_of(3) {
                Placement::Replicate
            } else {
                Placement::Shard((rng.next_u64() % shape.len() as u64) as usize)
            }
        })
        .collect();
    let keys: Vec<u8> = mesh_shape.iter().map(|_| rng.next_u64() as u8).collect();
    let order = order_from_keys(&placements, &keys).unwrap();
    Layout::with_order(mesh_shape, &placements, order, shape, dtype).unwrap()
}

fn random_init(rng: &mut Rng, rank: usize) -> Init {
    let schemes = [
        Init::Normal { mean: 0.5, std: 2.0 },
        Init::Uniform { low: -3.0, high: 1.0 },
        Init::TruncNormal {
            mean: 0.0,
            std: 1.0,
            low: -0.5,
            high: 2.0,
        },
        Init::Constant(0.25),
        Init::XavierUniform { gain: 1.5 },
        Init::KaimingNormal {
            a: 0.0,
            mode: FanMode::FanOut,
            nonlinearity: Nonlinearity::Relu,
        },
    ];
    // Fan-based schemes need two dims.
    let n = if rank >= 2 { schemes.len() } else { 4 };
    schemes[(rng.next_u64() % n as u64) as usize]
}

/// One parameter on a random layout of `mesh_shape`, materialised: its full
/// value's bits (rank 0's).
fn one_param(mesh_shape: Vec<usize>, layout: Option<Layout>, shape: Vec<usize>, dtype: DType, init: Init) -> Vec<u64> {
    let world = mesh_shape.iter().product();
    launch(world, move |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), &mesh_shape)?;
        let p = Param::deferred(&shape, dtype, &mesh)?;
        let dict = ParameterDict::new([("blocks.3.w", p.clone())])?;
        if let Some(layout) = &layout {
            p.place(layout.clone())?;
        }
        Materializer::from_seed(11).init("blocks.*", init).materialize(&dict)?;
        let full = p.value()?.full_tensor()?;
        Ok(full.to_f64_vec().into_iter().map(f64::to_bits).collect::<Vec<_>>())
    })
    .unwrap()
    .swap_remove(0)
}

/// Property: random shapes, meshes of 1–8 ranks in 1–3 dims, random Shard /
/// Replicate placements and shard orders, f32 / bf16 / f64 and every scheme —
/// the materialised parameter is the one-rank tensor bit for bit.
/// `TESSERA_INIT_CASES` sets the number of cases (default 24).
#[test]
fn random_layouts_materialize_the_whole_tensor_bit_for_bit() {
    let cases: usize = std::env::var("TESSERA_INIT_CASES").map_or(24, |v| {
        v.parse()
            .unwrap_or_else(|_| panic!("TESSERA_INIT_CASES={v:?}: expected a number of cases"))
    });
    let meshes: [&[usize]; 9] = [&[1], &[2], &[3], &[4], &[8], &[2, 2], &[2, 4], &[4, 2], &[2, 2, 2]];
    let mut rng = Rng::new(2026);
    for case in 0..cases {
        let mesh_shape = meshes[(rng.next_u64() % meshes.len() as u64) as usize].to_vec();
        let rank = 1 + (rng.next_u64() % 3) as usize;
        let shape: Vec<usize> = (0..rank).map(|_| 1 + (rng.next_u64() % 11) as usize).collect();
        let dtype = [DType::F32, DType::BF16, DType::F64][(rng.next_u64() % 3) as usize];
        let init = random_init(&mut rng, rank);
        let layout = random_layout(&mut rng, &mesh_shape, &shape, dtype);
        let got = one_param(mesh_shape.clone(), Some(layout.clone()), shape.clone(), dtype, init);
        let whole = one_param(vec![1], None, shape.clone(), dtype, init);
        assert!(
            got == whole,
            "case {case}: {layout} on mesh {mesh_shape:?} ({init:?}) differs from the whole tensor"
        );
    }
}

/// Materialising allocates only this rank's shards: the tracked peak from
/// building the model to the end of init stays within its shards plus the
/// largest one, far below one replica.
#[test]
fn init_memory_stays_within_each_ranks_shards() {
    let cfg = TransformerConfig {
        vocab: 4096,
        dim: 256,
        n_layers: 4,
        n_heads: 8,
        seq: 64,
    };
    let replica_bytes = 4 * cfg.num_params();
    for plan in [Plan::Fsdp(4), Plan::FsdpTp(2, 2)] {
        let per_rank = launch(4, move |ctx| {
            reset_peak();
            let before = stats().current_bytes;
            let model = plan.model(&plan.mesh(ctx.into_comm())?, cfg, DType::F32)?;
            assert_eq!(stats().current_bytes, before, "planning allocates nothing");
            let report = Materializer::from_seed(0).materialize(&model)?;
            let peak = stats().peak_bytes - before;
            Ok((peak, report))
        })
        .unwrap();
        let shards: usize = per_rank.iter().map(|(_, r)| r.local_bytes).sum();
        if matches!(plan, Plan::Fsdp(_)) {
            assert_eq!(shards, replica_bytes, "{plan:?}: the shards make one replica");
        }
        for (rank, (peak, r)) in per_rank.iter().enumerate() {
            let bound = r.local_bytes + r.largest_local_bytes;
            println!(
                "{plan:?} rank {rank}: init peak {peak} B, shards {} B, largest {} B, one replica {replica_bytes} B",
                r.local_bytes, r.largest_local_bytes
            );
            assert!(
                *peak <= bound,
                "{plan:?} rank {rank}: init peak {peak} > shards + largest {bound}"
            );
            assert!(
                r.local_bytes <= replica_bytes / 3,
                "{plan:?} rank {rank}: holds {} B",
                r.local_bytes
            );
        }
    }
}

/// Ranks that draw from different seeds would train different models: an error
/// on every rank naming the ranks and their seeds.
#[test]
fn rank_dependent_seeds_are_an_error() {
    let errors = launch(2, |ctx| {
        let seed = 7 + ctx.rank() as u64;
        let model = Plan::Fsdp(2).build(ctx.into_comm(), DType::F32)?;
        let e = Materializer::from_seed(seed)
            .materialize(&model)
            .unwrap_err()
            .to_string();
        assert!(
            model.parameters().iter().all(Param::is_deferred),
            "nothing materialised"
        );
        Ok(e)
    })
    .unwrap();
    for e in errors {
        assert!(
            e.contains("rank 0: 7") && e.contains("rank 1: 8") && e.contains("same model seed"),
            "{e}"
        );
    }
}

/// A rank whose replicated values differ (here: one rank changed its copy) is
/// named with the parameter and the mesh dim, on every rank.
#[test]
fn diverging_replicas_are_named() {
    let errors = launch(4, |ctx| {
        let rank = ctx.rank();
        let model = Plan::Hsdp(2, 2).build(ctx.into_comm(), DType::F32)?;
        Materializer::from_seed(3).materialize(&model)?;
        verify_replicas(&model)?;
        if rank == 2 {
            let w = model.layers[1].feed_forward.w2.bias.as_ref().unwrap();
            w.set_value(w.value()?.add_scalar(1.0)?);
        }
        Ok(verify_replicas(&model).unwrap_err().to_string())
    })
    .unwrap();
    for e in errors {
        assert!(
            e.contains("layers.1.feed_forward.w2.bias") && e.contains("dp_replicate") && e.contains("[2]"),
            "{e}"
        );
    }
}

/// Using a parameter before it is materialised is an error naming it.
#[test]
fn a_deferred_parameter_in_an_op_is_named() {
    launch(1, |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), &[1])?;
        let model = Transformer::new(CFG, &mesh, DType::F32)?;
        let tokens = distribute_tensor(&Tensor::zeros(&[1, 4], DType::I64)?, &mesh, &[Placement::Replicate])?;
        let e = model.forward(&Var::constant(tokens)).unwrap_err().to_string();
        assert!(
            e.contains("_embeddings.weight is deferred") && e.contains("materialize"),
            "{e}"
        );
        Ok(())
    })
    .unwrap();
}

/// Rules override a module's defaults by name (and a rule that did nothing
/// would leave the defaults).
#[test]
fn init_rules_override_module_defaults() {
    let runs = launch(2, |ctx| {
        let model = Plan::Fsdp(2).build(ctx.into_comm(), DType::F32)?;
        Materializer::from_seed(1)
            .init("*.bias", Init::Constant(0.5))
            .init("layers.*.attention.wq.weight", Init::Zeros)
            .materialize(&model)?;
        let b = model.layers[0]
            .feed_forward
            .w1
            .bias
            .as_ref()
            .unwrap()
            .value()?
            .full_tensor()?;
        let wq = model.layers[1].attention.wq.weight.value()?.full_tensor()?;
        let wk = model.layers[1].attention.wk.weight.value()?.full_tensor()?;
        let norm = model.norm.weight.value()?.full_tensor()?;
        Ok((b.to_f64_vec(), wq.to_f64_vec(), wk.to_f64_vec(), norm.to_f64_vec()))
    })
    .unwrap();
    let (b, wq, wk, norm) = &runs[0];
    assert!(b.iter().all(|&x| x == 0.5));
    assert!(wq.iter().all(|&x| x == 0.0));
    // Defaults elsewhere: wk is kaiming-uniform in ±1/√dim, the norm ones.
    let bound = 1.0 / (CFG.dim as f64).sqrt();
    assert!(wk.iter().all(|x| x.abs() <= bound) && wk.iter().any(|&x| x != 0.0));
    assert!(norm.iter().all(|&x| x == 1.0));
}

/// A parameter without a default or a rule is named with the fix.
#[test]
fn a_parameter_without_a_scheme_is_named() {
    launch(1, |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), &[1])?;
        let dict = ParameterDict::new([("scale", Param::deferred(&[3], DType::F32, &mesh)?)])?;
        let e = Materializer::from_seed(0).materialize(&dict).unwrap_err().to_string();
        assert!(
            e.contains("no init scheme for scale") && e.contains("Materializer::init"),
            "{e}"
        );
        Materializer::from_seed(0)
            .init("scale", Init::Ones)
            .materialize(&dict)?;
        assert_eq!(
            dict.get("scale").unwrap().value()?.full_tensor()?.to_f64_vec(),
            [1.0; 3]
        );
        Ok(())
    })
    .unwrap();
}

/// The tiny reference model loaded whole from its init file on one rank: what
/// every source must reproduce in shards.
fn tiny_from_file_on_one_rank() -> Bits {
    launch(1, |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), &[1])?;
        let model = Transformer::new(TransformerConfig::TINY, &mesh, DType::F32)?;
        tessera::autograd::load_state_dict(&model.parameters(), data("tiny_init.safetensors"))?;
        Ok(gathered_bits(&model)?)
    })
    .unwrap()
    .swap_remove(0)
}

/// From the reference safetensors file straight into FSDP×TP shards: the same
/// parameters as loading it whole on one rank.
#[test]
fn safetensors_materialize_into_shards() {
    let whole = tiny_from_file_on_one_rank();
    let sharded = launch(4, |ctx| {
        let plan = Plan::FsdpTp(2, 2);
        let model = plan.model(&plan.mesh(ctx.into_comm())?, TransformerConfig::TINY, DType::F32)?;
        Materializer::from_safetensors(data("tiny_init.safetensors")).materialize(&model)?;
        Ok(gathered_bits(&model)?)
    })
    .unwrap()
    .swap_remove(0);
    assert!(sharded == whole, "FSDP×TP shards from the file differ from the file");
}

/// A checkpoint saved on one mesh materialises a deferred model on another.
#[test]
fn checkpoints_materialize_onto_another_mesh() {
    let dir = std::env::temp_dir().join(format!("tessera-deferred-ckpt-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let saved = {
        let dir = dir.clone();
        launch(2, move |ctx| {
            let model = Plan::Fsdp(2).build(ctx.into_comm(), DType::F32)?;
            Materializer::from_seed(9).materialize(&model)?;
            save_checkpoint(&dir, &model.parameters(), None, BTreeMap::new())?;
            Ok(gathered_bits(&model)?)
        })
        .unwrap()
        .swap_remove(0)
    };
    let loaded = {
        let dir = dir.clone();
        launch(4, move |ctx| {
            let model = Plan::FsdpTp(2, 2).build(ctx.into_comm(), DType::F32)?;
            Materializer::from_checkpoint(&dir).materialize(&model)?;
            Ok(gathered_bits(&model)?)
        })
        .unwrap()
        .swap_remove(0)
    };
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(
        loaded == saved,
        "the checkpoint's values differ after materialising on another mesh"
    );
}

/// The main job's path from a seed: one rank, FSDP 2, FSDP×TP 2×2 and HSDP×TP
/// 2×2×2 start from the same parameters (the matrix above) and train the same
/// losses, within 1e-6 at every step.
#[test]
fn training_from_a_seed_agrees_on_every_layout() {
    let plans = [Plan::Single, Plan::Fsdp(2), Plan::FsdpTp(2, 2), Plan::HsdpTp(2, 2, 2)];
    let runs: Vec<Vec<f64>> = plans
        .into_iter()
        .map(|plan| {
            launch(plan.world(), move |ctx| {
                let model = plan.build(ctx.into_comm(), DType::F32)?;
                Materializer::from_seed(0).materialize(&model)?;
                let mesh = model.tok_embeddings.weight.mesh();
                // Rows split over the data-parallel dims, replicated over tp.
                let tp = matches!(plan, Plan::FsdpTp(..) | Plan::HsdpTp(..));
                let mut placements = vec![Placement::Shard(0); mesh.ndim()];
                if tp {
                    placements[mesh.ndim() - 1] = Placement::Replicate;
                }
                let mut opt = AdamW::new(model.parameters(), crate::common::adamw())?;
                let mut losses = Vec::new();
                for step in 0..4u64 {
                    let rows = data_batch(DATA_SEED, step, 0..8, CFG.seq + 1, CFG.vocab as u64);
                    let rows = Tensor::from_vec(rows, &[8, CFG.seq + 1])?;
                    let rows = Var::constant(distribute_tensor(&rows, &mesh, &placements)?);
                    let loss = model.loss(&rows)?;
                    backward(&loss)?;
                    losses.push(loss.value().full_tensor()?.to_f64_vec()[0]);
                    opt.step()?;
                    opt.zero_grad();
                }
                Ok(losses)
            })
            .unwrap()
            .swap_remove(0)
        })
        .collect();
    for (plan, losses) in plans.iter().zip(&runs) {
        let d = crate::max_abs_diff(losses, &runs[0]);
        println!("{plan:?}: losses {losses:?}, max |Δ| vs one rank {d:.2e}");
        assert!(
            d <= 1e-6,
            "{plan:?}: losses {losses:?} differ from one rank's {:?} by {d}",
            runs[0]
        );
    }
}

/// Dropout masks follow the same rule as init: a sharded run drops exactly the
/// elements one rank drops, and the gradient goes through the same mask.
#[test]
fn dropout_masks_are_mesh_invariant() {
    let run = |mesh_shape: Vec<usize>, placements: Vec<Placement>| {
        let world = mesh_shape.iter().product();
        launch(world, move |ctx| {
            let mesh = DeviceMesh::new(ctx.into_comm(), &mesh_shape)?;
            let full = Tensor::randn(&[6, 10], DType::F32, 4)?;
            let x = Param::new(distribute_tensor(&full, &mesh, &placements)?);
            let key = tessera::dtensor::StreamKey::new(3, "blocks.0.dropout").with_stream(2);
            let y = x.var()?.dropout(0.25, key)?;
            let direct = x.value()?.dropout(0.25, key)?.full_tensor()?.to_f64_vec();
            backward(&y.sum(&[0, 1], false)?)?;
            let out = y.value().full_tensor()?.to_f64_vec();
            assert_eq!(direct, out, "DTensor::dropout against Var::dropout");
            let grad = x.grad().unwrap().full_tensor()?.to_f64_vec();
            Ok((out, grad, full.to_f64_vec()))
        })
        .unwrap()
        .swap_remove(0)
    };
    let (out, grad, full) = run(vec![1], vec![Placement::Replicate]);
    // The local Tensor's dropout with the same key drops the same elements.
    let key = tessera::dtensor::StreamKey::new(3, "blocks.0.dropout").with_stream(2);
    let local = Tensor::randn(&[6, 10], DType::F32, 4)
        .unwrap()
        .dropout(0.25, key)
        .unwrap();
    assert_eq!(local.to_f64_vec(), out, "Tensor::dropout against the DTensor's");
    let dropped = out.iter().filter(|&&v| v == 0.0).count();
    assert!((5..=25).contains(&dropped), "{dropped} of 60 dropped at p = 0.25");
    for ((o, g), x) in out.iter().zip(&grad).zip(&full) {
        // Kept elements are scaled by 4/3, and their gradient is the scale.
        if *g == 0.0 {
            assert_eq!(*o, 0.0);
        } else {
            assert!(
                (g - 1.0 / 0.75).abs() < 1e-6 && (o - x / 0.75).abs() < 1e-5,
                "{o} {g} {x}"
            );
        }
    }
    for (mesh, placements) in [
        (vec![2], vec![Placement::Shard(0)]),
        (vec![3], vec![Placement::Shard(1)]),
        (vec![2, 2], vec![Placement::Shard(0), Placement::Shard(1)]),
        (vec![2, 2], vec![Placement::Replicate, Placement::Shard(0)]),
    ] {
        let (o, g, _) = run(mesh.clone(), placements.clone());
        assert!(
            o == out && g == grad,
            "{mesh:?} {placements:?}: another mask than one rank's"
        );
    }
    let e = launch(1, |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), &[1])?;
        let x = Var::constant(distribute_tensor(
            &Tensor::ones(&[2], DType::F32)?,
            &mesh,
            &[Placement::Replicate],
        )?);
        Ok(x.dropout(1.5, tessera::dtensor::StreamKey::new(0, "d"))
            .unwrap_err()
            .to_string())
    })
    .unwrap();
    assert!(e[0].contains("not a probability"), "{}", e[0]);
}

/// Rank 0's values, scattered: every other rank passes nothing and receives its
/// pieces; a value rank 0 lacks is an error on every rank.
#[test]
fn rank0_values_materialize_into_shards() {
    let whole = tiny_from_file_on_one_rank();
    let runs = launch(4, |ctx| {
        let rank = ctx.rank();
        let plan = Plan::FsdpTp(2, 2);
        let mesh = plan.mesh(ctx.into_comm())?;
        let build = || plan.model(&mesh, TransformerConfig::TINY, DType::F32);
        let values = if rank == 0 {
            tessera::autograd::read_safetensors(data("tiny_init.safetensors"))?
        } else {
            Vec::new()
        };
        let model = build()?;
        Materializer::from_rank0(values.clone()).materialize(&model)?;
        let bits = gathered_bits(&model)?;
        // Without the output head's table on rank 0: every rank errs, nothing hangs.
        let short: Vec<_> = values.into_iter().filter(|(n, _)| n != "output.weight").collect();
        let e = Materializer::from_rank0(short)
            .materialize(&build()?)
            .unwrap_err()
            .to_string();
        Ok((bits, e))
    })
    .unwrap();
    for (bits, e) in &runs {
        assert!(*bits == whole, "rank 0's values differ after scattering");
        assert!(e.contains("rank 0 has no value for output.weight"), "{e}");
    }
}

/// `auto_wrap` plans a deferred model by parameter counts (read from shapes,
/// no storage) and the model materialises into its units' shards: the same
/// parameters as one rank's.
#[test]
fn auto_wrap_plans_a_deferred_model() {
    use tessera::fsdp::{WrapPolicy, auto_wrap};
    let whole = materialized(Plan::Single, DType::F32, 5);
    let got = launch(2, |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), &[2])?;
        let model = Transformer::new(CFG, &mesh, DType::F32)?;
        let units = auto_wrap(&model, &mesh, &FsdpConfig::default(), &WrapPolicy::MinParams(2_000))?;
        let names: Vec<String> = units.iter().map(|(n, _)| n.clone()).collect();
        assert!(model.parameters().iter().all(Param::is_deferred), "planning allocated");
        Materializer::from_seed(5).materialize(&model)?;
        let w = model.layers[0].feed_forward.w1.weight.value()?;
        assert_eq!(w.placements(), &[Placement::Shard(0)]);
        Ok((names, gathered_bits(&model)?))
    })
    .unwrap()
    .swap_remove(0);
    assert!(
        got.0.len() >= 3 && got.0.last().map(String::as_str) == Some(""),
        "units {:?}",
        got.0
    );
    assert!(got.1 == whole, "auto-wrapped shards differ from the whole-tensor init");
}
