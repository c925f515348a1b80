//! Choosing units: `replicate` (NO_SHARD) units, `ignored_params`, several
//! modules as one unit (`fully_shard_modules`), and
//! `auto_wrap` by module type and by parameter count; each against the
//! reference losses and by what it changes (collectives, placements, units).

use tessera::autograd::backward;
use tessera::autograd::nn::Module;
use tessera::autograd::optim::{AdamW, Optimizer};
use tessera::dtensor::Placement;
use tessera::fsdp::{FsdpConfig, FsdpModule, WrapPolicy, auto_wrap, fully_shard, fully_shard_modules, replicate};
use tessera::mesh::{CommCounts, OpKind};
use tessera::models::{Block, Transformer};
use tessera::{DeviceMesh, launch};

use crate::common::{adamw, reference_losses, tiny_model, tokens};
use crate::{Job, TestResult, batch, max_abs_diff, scalar};

/// What rank 0 saw: losses, step 1's forward and backward counters, the units
/// (by name) with their sharded bytes, and every parameter's placements.
struct Seen {
    losses: Vec<f64>,
    fwd: CommCounts,
    bwd: CommCounts,
    units: Vec<(String, usize)>,
    placements: Vec<(String, Vec<Placement>)>,
}

/// Makes a model's units; returns them by name.
type Wrap = fn(&Transformer, &DeviceMesh) -> TestResult<Vec<(String, FsdpModule)>>;

/// Trains the tiny model for 5 steps on 2 ranks (global batch 8) after `wrap`
/// made its units.
fn run(wrap: Wrap) -> Seen {
    let toks = tokens();
    launch(2, move |ctx| -> TestResult<Seen> {
        let mesh = DeviceMesh::new(ctx.into_comm(), &[2])?;
        let model = tiny_model(&mesh)?;
        let units = wrap(&model, &mesh)?;
        let mut opt = AdamW::new(model.parameters(), adamw())?;
        let mut seen = Seen {
            losses: Vec::new(),
            fwd: CommCounts::default(),
            bwd: CommCounts::default(),
            units: units.iter().map(|(n, u)| (n.clone(), u.sharded_bytes())).collect(),
            placements: model.parameters().iter().map(|p| (p.name(), p.placements())).collect(),
        };
        for step in 0..5 {
            let x = batch(&toks, step, 0..8, &mesh)?;
            let s0 = mesh.stats();
            let loss = model.loss(&x)?;
            let s1 = mesh.stats();
            backward(&loss)?;
            if step == 1 {
                seen.fwd = s1 - s0;
                seen.bwd = mesh.stats() - s1;
            }
            seen.losses.push(scalar(&loss)?);
            opt.step()?;
            opt.zero_grad();
        }
        Ok(seen)
    })
    .unwrap()
    .swap_remove(0)
}

fn parity(label: &str, losses: &[f64]) {
    let want = reference_losses("fsdp_W2_G8");
    let d = max_abs_diff(losses, &want[..losses.len()]);
    println!("{label}: max |Δloss| vs fsdp_W2_G8 = {d:.3e}");
    assert!(d < 1e-5, "{label}: {losses:?}");
}

fn counts(c: &CommCounts) -> (u64, u64, u64) {
    (
        c.calls(OpKind::AllGather),
        c.calls(OpKind::ReduceScatter),
        c.calls(OpKind::AllReduce),
    )
}

/// Replicated units gather nothing and all-reduce their bucket once per
/// backward; mixed with sharded blocks, each unit communicates its own way.
#[test]
fn replicate_units_all_reduce_only() {
    let all = run(|m, mesh| {
        let mut u: Vec<(String, FsdpModule)> = m
            .layers
            .iter()
            .enumerate()
            .map(|(i, b)| Ok((format!("layers.{i}"), replicate(b, mesh, FsdpConfig::default())?)))
            .collect::<TestResult<_>>()?;
        u.push((String::new(), replicate(m, mesh, FsdpConfig::default())?));
        Ok(u)
    });
    parity("replicate everywhere", &all.losses);
    assert_eq!(counts(&all.fwd), (0, 0, 0), "forward of replicated units");
    assert_eq!(counts(&all.bwd), (0, 0, 3), "one all-reduce per unit");
    assert!(all.placements.iter().all(|(_, p)| p == &[Placement::Replicate]));
    let mixed = run(|m, mesh| {
        let mut u: Vec<(String, FsdpModule)> = m
            .layers
            .iter()
            .enumerate()
            .map(|(i, b)| Ok((format!("layers.{i}"), fully_shard(b, mesh, FsdpConfig::default())?)))
            .collect::<TestResult<_>>()?;
        u.push((String::new(), replicate(m, mesh, FsdpConfig::default())?));
        Ok(u)
    });
    parity("sharded blocks, replicated root", &mixed.losses);
    // Blocks: gathered in forward and again in backward, reduce-scattered.
    assert_eq!(counts(&mixed.fwd), (2, 0, 0));
    assert_eq!(counts(&mixed.bwd), (2, 2, 1));
}

/// An ignored parameter stays replicated and out of its unit's bucket; its
/// gradient is all-reduced by autograd; training is unchanged.
#[test]
fn ignored_params_stay_replicated() {
    let default = run(|m, mesh| {
        let u = m.fully_shard(mesh, &FsdpConfig::default())?;
        Ok(vec![(String::new(), u.root)])
    });
    let ignoring = run(|m, mesh| {
        let cfg = FsdpConfig {
            ignored_params: vec![m.tok_embeddings.weight.name().to_string()],
            ..FsdpConfig::default()
        };
        let u = m.fully_shard(mesh, &cfg)?;
        Ok(vec![(String::new(), u.root)])
    });
    parity("ignoring tok_embeddings.weight", &ignoring.losses);
    let (_, table) = ignoring
        .placements
        .iter()
        .find(|(n, _)| n == "tok_embeddings.weight")
        .unwrap();
    assert_eq!(table, &[Placement::Replicate]);
    // The root's bucket lost the table's shard: 128 of its 256 rows of 64 f32.
    assert_eq!(default.units[0].1 - ignoring.units[0].1, 128 * 64 * 4);
    // Its gradient: one more all-reduce (autograd's), same gathers.
    assert_eq!(
        ignoring.bwd.calls(OpKind::AllReduce),
        default.bwd.calls(OpKind::AllReduce) + 1
    );
    assert_eq!(
        ignoring.fwd.calls(OpKind::AllGather),
        default.fwd.calls(OpKind::AllGather)
    );
}

/// By type: the blocks, then the root, as `Transformer::fully_shard` does, with
/// the same losses bit for bit. By size: the threshold decides which modules.
#[test]
fn auto_wrap_by_type_and_by_size() {
    let recipe = crate::train(&Job::fsdp(&[2], 8, 5, FsdpConfig::default()));
    let by_type = run(|m, mesh| {
        Ok(auto_wrap(
            m,
            mesh,
            &FsdpConfig::default(),
            &WrapPolicy::module::<Block>(),
        )?)
    });
    let names: Vec<&str> = by_type.units.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["layers.1", "layers.0", ""]);
    assert_eq!(by_type.losses, recipe.losses);
    // A block holds 12·64² + 9·64 = 49728 elements, its MLP 33088, attention 16384.
    let by_size = run(|m, mesh| {
        Ok(auto_wrap(
            m,
            mesh,
            &FsdpConfig::default(),
            &WrapPolicy::MinParams(40_000),
        )?)
    });
    let names: Vec<&str> = by_size.units.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["layers.1", "layers.0", ""]);
    let smaller = run(|m, mesh| {
        Ok(auto_wrap(
            m,
            mesh,
            &FsdpConfig::default(),
            &WrapPolicy::MinParams(20_000),
        )?)
    });
    let names: Vec<&str> = smaller.units.iter().map(|(n, _)| n.as_str()).collect();
    // The MLPs first; a block's remaining 16640 are too few; the block list's
    // 33280 together are enough.
    assert_eq!(names, ["layers.1.feed_forward", "layers.0.feed_forward", "layers", ""]);
    parity("auto_wrap MinParams(20000)", &smaller.losses);
}

/// The two embedding tables as one unit: one all-gather and one reduce-scatter
/// for both (two when each is its own unit); the same losses.
#[test]
fn several_modules_as_one_unit() {
    fn units(m: &Transformer, mesh: &DeviceMesh, grouped: bool) -> TestResult<Vec<(String, FsdpModule)>> {
        let cfg = FsdpConfig::default;
        let mut u = Vec::new();
        for (i, b) in m.layers.iter().enumerate() {
            u.push((format!("layers.{i}"), fully_shard(b, mesh, cfg())?));
        }
        if grouped {
            let both = fully_shard_modules(&[&m.tok_embeddings, &m.pos_embeddings], mesh, cfg())?;
            assert_eq!(both.params().len(), 2);
            u.push(("embeddings".into(), both));
        } else {
            u.push(("tok_embeddings".into(), fully_shard(&m.tok_embeddings, mesh, cfg())?));
            u.push(("pos_embeddings".into(), fully_shard(&m.pos_embeddings, mesh, cfg())?));
        }
        u.push((String::new(), fully_shard(m, mesh, cfg())?));
        Ok(u)
    }
    let grouped = run(|m, mesh| units(m, mesh, true));
    let separate = run(|m, mesh| units(m, mesh, false));
    parity("embeddings as one unit", &grouped.losses);
    assert_eq!(grouped.losses, separate.losses);
    let ag = OpKind::AllGather;
    let rs = OpKind::ReduceScatter;
    assert_eq!(separate.fwd.calls(ag) - grouped.fwd.calls(ag), 1);
    assert_eq!(separate.bwd.calls(rs) - grouped.bwd.calls(rs), 1);
    assert_eq!(grouped.fwd.calls(ag), 4, "root, embeddings, two blocks");
}
