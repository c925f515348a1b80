//! Configurations `fully_shard` refuses (each error naming what it refuses, a
//! refused module left as it was), and parameters it must respect: changed between
//! forward and backward, frozen; a failed forward leaves FSDP usable.

use tessera::autograd::nn::{Linear, Module, ParameterDict};
use tessera::autograd::optim::{AdamW, Optimizer};
use tessera::autograd::{Param, Var, backward};
use tessera::dtensor::{DTensor, Placement, Tensor, distribute_tensor};
use tessera::fsdp::{Error as FsdpError, FsdpConfig, fully_shard};
use tessera::models::{CausalLm, Transformer, TransformerConfig, UnitLayout};
use tessera::{DType, DeviceMesh, launch};

use crate::common::{adamw, reference_losses, tiny_model, tokens};
use crate::{TestResult, batch, calls, full_grads, max_abs_diff, scalar};

/// A module that is just a list of parameters (forward: a chain of linears).
struct Params(Vec<Param>);

impl Module for Params {
    fn own_parameters(&self) -> Vec<(String, Param)> {
        self.0.iter().map(|p| (p.name(), p.clone())).collect()
    }

    fn forward(&self, x: &Var) -> tessera::autograd::Result<Var> {
        let mut y = x.clone();
        for p in &self.0 {
            y = y.linear(&p.var()?, None)?;
        }
        Ok(y)
    }
}

fn param(name: &str, shape: &[usize], dtype: DType, mesh: &DeviceMesh, placement: Placement) -> TestResult<Param> {
    let full = match dtype {
        DType::I64 => Tensor::zeros(shape, dtype)?,
        _ => Tensor::randn(shape, dtype, 3)?,
    };
    let placements = vec![placement; mesh.ndim()];
    let p = Param::new(distribute_tensor(&full, mesh, &placements)?);
    ParameterDict::new([(name, p.clone())])?;
    Ok(p)
}

/// The detail of a `fully_shard` configuration error.
fn config_err<T>(r: tessera::fsdp::Result<T>, what: &str) -> String {
    match r {
        Ok(_) => panic!("{what}: fully_shard accepted it"),
        Err(e @ (FsdpError::Module { .. } | FsdpError::Param { .. } | FsdpError::Mesh { .. })) => e.to_string(),
        Err(e) => panic!("{what}: expected a configuration error, got {e}"),
    }
}

/// The message of an error that must occur.
fn err_msg<T, E: std::fmt::Display>(r: Result<T, E>, what: &str) -> String {
    match r {
        Ok(_) => panic!("{what}: expected an error"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn bad_configurations() {
    launch(2, move |ctx| {
        let world = ctx.into_comm();
        let comm = || world.split(0, world.rank() as u32);
        let mesh = DeviceMesh::new(comm()?, &[2])?;
        let mesh2 = DeviceMesh::with_names(comm()?, &[1, 2], &["replicate", "shard"])?;
        let mesh3 = DeviceMesh::new(comm()?, &[1, 2, 1])?;
        let rep = Placement::Replicate;
        let cfg = FsdpConfig::default;
        let p = |name: &str| param(name, &[4, 3], DType::F32, &mesh, rep);
        macro_rules! case {
            ($what:expr, $result:expr, $($needle:expr),+) => {{
                let detail = config_err($result, $what);
                for needle in [$($needle),+] {
                    assert!(detail.contains(needle), "{}: {detail:?} does not mention {needle:?}", $what);
                }
            }};
        }

        // A parameter shared by two modules, neither inside the other.
        let shared = p("shared.weight")?;
        let a = Params(vec![p("a.weight")?, shared.clone()]);
        let b = Params(vec![shared.clone(), p("b.weight")?]);
        fully_shard(&a, &mesh, cfg())?;
        case!(
            "overlap",
            fully_shard(&b, &mesh, cfg()),
            "shared.weight",
            "already owned",
            "a.weight"
        );
        assert_eq!(
            b.0[1].value()?.placements(),
            &[rep],
            "a refused module is left as it was"
        );

        // The same module twice: a leaf, and a Transformer root.
        let fc = Linear::new(3, 4, true, &mesh, DType::F32)?;
        fully_shard(&fc, &mesh, cfg())?;
        case!("twice", fully_shard(&fc, &mesh, cfg()), "weight", "already fully_shard");
        let model = Transformer::new(TransformerConfig::TINY, &mesh, DType::F32)?;
        model.fully_shard(&mesh, &cfg())?;
        let again = err_msg(fully_shard(&model, &mesh, cfg()), "root twice");
        assert!(again.contains("already fully_shard-ed"), "root twice: {again}");
        case!(
            "blocks twice",
            model.fully_shard(&mesh, &cfg()),
            "layers.0.attention_norm.weight",
            "already fully_shard"
        );

        // Top-down: the root first, then a block inside it. The error names
        // the root unit by its type and says fully_shard goes bottom-up.
        let top_down = Transformer::new(TransformerConfig::TINY, &mesh, DType::F32)?;
        fully_shard(&top_down, &mesh, cfg())?;
        let e = config_err(fully_shard(&top_down.layers[0], &mesh, cfg()), "block after its root");
        assert!(
            e.contains("lies inside the Transformer holding") && e.contains("fully_shard goes bottom-up"),
            "block after its root: {e}"
        );

        // Meshes FSDP cannot shard over.
        let on2 = Params(vec![param("on2.weight", &[4, 3], DType::F32, &mesh2, rep)?]);
        let dp = FsdpConfig {
            shard_dim: Some("dp".into()),
            ..cfg()
        };
        case!(
            "unknown shard dim",
            fully_shard(&on2, &mesh2, dp),
            "\"dp\"",
            "\"replicate\"",
            "\"shard\""
        );
        let on3 = Params(vec![param("on3.weight", &[4, 3], DType::F32, &mesh3, rep)?]);
        case!("3-D mesh", fully_shard(&on3, &mesh3, cfg()), "3 dims", "[1, 2, 1]");
        let elsewhere = Params(vec![p("elsewhere.weight")?]);
        case!(
            "other mesh",
            fully_shard(&elsewhere, &mesh2, cfg()),
            "elsewhere.weight",
            "mesh"
        );

        // Parameters FSDP cannot shard; nothing changes on refusal.
        let fine = p("fine.weight")?;
        let sharded = param("sharded.weight", &[4, 3], DType::F32, &mesh, Placement::Shard(0))?;
        let m = Params(vec![fine.clone(), sharded]);
        case!(
            "already sharded",
            fully_shard(&m, &mesh, cfg()),
            "sharded.weight",
            "mesh dim 0 shards it already"
        );
        assert_eq!(fine.value()?.placements(), &[rep], "a refused module is left as it was");
        assert!(!fine.value()?.to_local().shape().is_empty());
        let scalar_p = Params(vec![param("scalar", &[], DType::F32, &mesh, rep)?]);
        case!("scalar", fully_shard(&scalar_p, &mesh, cfg()), "scalar", "[1]");
        let ints = Params(vec![param("ints", &[4], DType::I64, &mesh, rep)?]);
        case!("integer", fully_shard(&ints, &mesh, cfg()), "ints", "floating-point");
        let mixed = Params(vec![
            p("f32.weight")?,
            param("f64.weight", &[4, 3], DType::F64, &mesh, rep)?,
        ]);
        case!(
            "mixed dtypes",
            fully_shard(&mixed, &mesh, cfg()),
            "f32.weight",
            "f64.weight",
            "dtype"
        );
        // A parameter a module lists twice is one parameter (tied), held once.
        let x = p("x.weight")?;
        let unit = fully_shard(&Params(vec![x.clone(), x]), &mesh, cfg())?;
        assert_eq!(unit.params().len(), 1, "a tied parameter belongs to its unit once");
        case!(
            "no parameters",
            fully_shard(&Params(vec![]), &mesh, cfg()),
            "no parameters"
        );
        Ok(())
    })
    .unwrap();
}

/// A parameter replaced between its unit's forward and backward (an optimizer
/// step or `set_value` in between) makes backward fail, naming it.
#[test]
fn parameter_changed_between_forward_and_backward() {
    let toks = tokens();
    let errors = launch(2, move |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), &[2])?;
        let model = tiny_model(&mesh)?;
        model.fully_shard(&mesh, &FsdpConfig::default())?;
        let loss = model.loss(&batch(&toks, 0, 0..8, &mesh)?)?;
        let p = &model.layers[1].attention.wq.weight;
        let v = p.value()?;
        // The same values in a new storage.
        let copy = v.to_local().cast(DType::F64)?.cast(DType::F32)?;
        p.set_value(DTensor::from_local(copy, &mesh, v.placements(), v.shape())?);
        Ok(match backward(&loss).map_err(FsdpError::from) {
            Err(FsdpError::Param { param, detail }) => format!("{param}: {detail}"),
            Err(e) => panic!("expected an fsdp configuration error, got {e}"),
            Ok(()) => panic!("backward accepted a parameter changed since forward"),
        })
    })
    .unwrap();
    for msg in errors {
        assert!(
            msg.contains("layers.1.attention.wq.weight") && msg.contains("changed between"),
            "{msg}"
        );
    }
}

/// A frozen parameter gets no gradient; its unit still reduce-scatters the
/// others', which equal the replicated model's.
#[test]
fn frozen_parameter() {
    let toks = tokens();
    let run = |fsdp: bool| {
        launch(2, {
            let toks = toks.clone();
            move |ctx| {
                let mesh = DeviceMesh::new(ctx.into_comm(), &[2])?;
                let model = tiny_model(&mesh)?;
                let params = model.parameters();
                if fsdp {
                    model.fully_shard(&mesh, &FsdpConfig::default())?;
                }
                let frozen = &model.layers[0].attention.wq.weight;
                frozen.set_requires_grad(false);
                let start = frozen.value()?.full_tensor()?.to_f64_vec();
                let mut opt = AdamW::new(params.clone(), adamw())?;
                let mut out = Vec::new();
                for step in 0..2 {
                    let rows = batch(&toks, step, 0..8, &mesh)?;
                    let before = mesh.stats();
                    let loss = model.loss(&rows)?;
                    backward(&loss)?;
                    let c = mesh.stats() - before;
                    assert!(frozen.grad().is_none(), "the frozen parameter got a gradient");
                    out.push((c, full_grads(&params)?));
                    opt.step()?;
                    opt.zero_grad();
                }
                assert_eq!(
                    frozen.value()?.full_tensor()?.to_f64_vec(),
                    start,
                    "the frozen parameter moved"
                );
                Ok(out)
            }
        })
        .unwrap()
        .swap_remove(0)
    };
    let fsdp = run(true);
    let replicated = run(false);
    for (step, ((c, g), (_, want))) in fsdp.iter().zip(&replicated).enumerate() {
        assert_eq!(calls(c), (5, 3, 0, 0), "step {step}: {c}");
        let mut max = 0.0f64;
        for ((n, g), (_, w)) in g.iter().zip(want) {
            match (g, w) {
                (None, None) => assert_eq!(n, "layers.0.attention.wq.weight"),
                (Some(g), Some(w)) => max = max.max(max_abs_diff(g, w)),
                _ => panic!("step {step}: {n} has a gradient in one run only"),
            }
        }
        println!("frozen parameter, step {step}: max |Δgrad| FSDP vs replicated {max:.3e}");
        assert!(max <= 1e-6, "step {step}: gradients differ by {max}");
    }
}

/// A forward that fails inside the units leaves FSDP usable: the next steps
/// match the model that never failed.
#[test]
fn failed_forward_leaves_fsdp_usable() {
    let toks = tokens();
    let losses = launch(2, move |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), &[2])?;
        let model = tiny_model(&mesh)?;
        let params = model.parameters();
        let units = model.fully_shard(&mesh, &FsdpConfig::default())?;
        // 34 tokens: 33 inputs, one more than the position table (fails in the root's forward).
        let long = Tensor::zeros(&[8, 35], DType::I64)?;
        let long = Var::constant(distribute_tensor(&long, &mesh, &[Placement::Shard(0)])?);
        err_msg(model.loss(&long), "too long a row");
        let mut opt = AdamW::new(params, adamw())?;
        let mut losses = Vec::new();
        for step in 0..5 {
            let rows = batch(&toks, step, 0..8, &mesh)?;
            let before = mesh.stats();
            let loss = model.loss(&rows)?;
            backward(&loss)?;
            let c = mesh.stats() - before;
            if step > 0 {
                assert_eq!(calls(&c), (5, 3, 0, 0), "step {step}: {c}");
            }
            assert!(units.blocks.iter().chain([&units.root]).all(|u| !u.is_unsharded()));
            losses.push(scalar(&loss)?);
            opt.step()?;
            opt.zero_grad();
        }
        Ok(losses)
    })
    .unwrap();
    let d = max_abs_diff(&losses[0], &reference_losses("fsdp_W2_G8")[..5]);
    assert!(d <= 1e-5, "after a failed forward, losses differ by {d}");
}

#[test]
fn a_unit_that_differs_or_fails_on_one_rank_fails_every_rank_before_anything_changes() {
    let seen = launch(2, |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), &[2])?;
        let me = mesh.comm().rank();
        // Rank 1 built its second parameter with another shape.
        let a = param("a", &[4, 4], DType::F32, &mesh, Placement::Replicate)?;
        let b = param("b", &[4, 4], DType::F32, &mesh, Placement::Replicate)?;
        let c = param("c", &[4, 3], DType::F32, &mesh, Placement::Replicate)?;
        let module = Params(if me == 1 {
            vec![a.clone(), c]
        } else {
            vec![a.clone(), b]
        });
        let differ = err_msg(fully_shard(&module, &mesh, FsdpConfig::default()), "shapes differ");
        assert!(a.placements()[0].is_replicate(), "a refused unit changes nothing");
        // Rank 1 alone asks for a shard dim the mesh does not have.
        let config = FsdpConfig {
            shard_dim: (me == 1).then(|| "tp".to_string()),
            ..FsdpConfig::default()
        };
        let one = err_msg(
            fully_shard(&Params(vec![a.clone()]), &mesh, config),
            "bad dim on rank 1",
        );
        assert!(a.placements()[0].is_replicate());
        mesh.comm().barrier()?;
        Ok((differ, one))
    })
    .unwrap();
    for (r, (differ, one)) in seen.iter().enumerate() {
        assert!(
            differ.contains("rank 0 and rank 1 hold different parameters") && differ.contains("fully_shard"),
            "rank {r}: {differ}"
        );
        assert!(one.contains("tp"), "rank {r}: {one}");
        if r == 0 {
            assert!(one.contains("rank 1 failed"), "rank 0: {one}");
        }
    }
}

/// A model that does not name its ends (`CausalLm::ends` left to its
/// default): the tiny Transformer, through a wrapper.
struct NoEnds(Transformer);

impl Module for NoEnds {
    fn named_children(&self) -> Vec<(String, &dyn Module)> {
        self.0.named_children()
    }

    fn forward(&self, x: &Var) -> tessera::autograd::Result<Var> {
        self.0.forward(x)
    }
}

impl CausalLm for NoEnds {
    fn parallelize(
        &self,
        tp_mesh: &DeviceMesh,
        sequence_parallel: bool,
    ) -> tessera::fsdp::Result<Vec<tessera::fsdp::tp::Applied>> {
        self.0.parallelize(tp_mesh, sequence_parallel)
    }

    fn blocks(&self) -> Vec<&dyn Module> {
        CausalLm::blocks(&self.0)
    }

    fn num_params(&self) -> usize {
        CausalLm::num_params(&self.0)
    }
}

/// `UnitLayout::SplitEnds` on a model without ends: an error naming the
/// model and the way out, with nothing sharded (the blocks layout still works).
#[test]
fn split_ends_needs_the_models_ends() {
    launch(2, |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), &[2])?;
        let model = NoEnds(tiny_model(&mesh)?);
        let err = match model.fully_shard_with(&mesh, &FsdpConfig::default(), UnitLayout::SplitEnds) {
            Err(e) => e,
            Ok(_) => panic!("split ends on a model without ends"),
        };
        let msg = err.to_string();
        assert!(
            msg.contains("CausalLm::ends") && msg.contains("UnitLayout::Blocks"),
            "{msg}"
        );
        let units = model.fully_shard_with(&mesh, &FsdpConfig::default(), UnitLayout::Blocks)?;
        assert_eq!((units.blocks.len(), units.ends.is_none()), (2, true));
        Ok(())
    })
    .unwrap();
}
