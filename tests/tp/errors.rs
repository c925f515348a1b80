//! What `parallelize_module` refuses, each error naming the module; a refused plan
//! changes nothing.

use tessera::autograd::Var;
use tessera::autograd::nn::{Linear, Materializer, Module};
use tessera::dtensor::{DType, Placement, Tensor, distribute_tensor};
use tessera::fsdp::FsdpConfig;
use tessera::fsdp::tp::{ColwiseParallel, ParallelPlan, RowwiseParallel, TpLayout, parallelize_module};
use tessera::models::{Transformer, TransformerConfig};
use tessera::{DeviceMesh, launch};

fn err<T, E: std::fmt::Display>(r: Result<T, E>, what: &str) -> String {
    match r {
        Ok(_) => panic!("{what}: accepted"),
        Err(e) => e.to_string(),
    }
}

fn has(msg: &str, parts: &[&str]) {
    for p in parts {
        assert!(msg.contains(p), "{msg:?} lacks {p:?}");
    }
}

fn all_replicated(m: &dyn Module) -> bool {
    m.parameters()
        .iter()
        .all(|p| p.placements().iter().all(|pl| pl.is_replicate()))
}

#[test]
fn bad_plans_are_refused_by_name_and_change_nothing() {
    launch(2, |ctx| {
        let mesh = DeviceMesh::with_names(ctx.into_comm(), &[1, 2], &["dp", "tp"])?;
        let tp = mesh.dim("tp")?;
        let model = Transformer::new(TransformerConfig::TINY, &mesh, DType::F32)?;

        let typo = Transformer::tp_plan().add("layers.*.attn.wq", ColwiseParallel::default());
        has(
            &err(parallelize_module(&model, &tp, &typo), "no match"),
            &["plan entry `layers.*.attn.wq`", "matches no module"],
        );
        assert!(all_replicated(&model), "a refused plan changes nothing");

        let on_norm = ParallelPlan::new()
            .add("output", ColwiseParallel::default())
            .add("layers.1.attention_norm", ColwiseParallel::default());
        has(
            &err(parallelize_module(&model, &tp, &on_norm), "norm"),
            &["ColwiseParallel on `layers.1.attention_norm`", "LayerNorm"],
        );
        let on_block = ParallelPlan::new().add("layers.0", RowwiseParallel::default());
        has(
            &err(parallelize_module(&model, &tp, &on_block), "block"),
            &["RowwiseParallel on `layers.0`", "a container"],
        );
        assert!(all_replicated(&model));

        has(
            &err(
                parallelize_module(&model, &mesh, &Transformer::tp_plan()),
                "2-D tp mesh",
            ),
            &["the tp mesh must be 1-D", "[1, 2]"],
        );

        // A tp mesh that is no dim of the parameters' mesh.
        let other = DeviceMesh::with_names(mesh.comm().split(0, mesh.rank() as u32)?, &[2], &["tp"])?;
        has(
            &err(
                parallelize_module(&model, &other, &Transformer::tp_plan()),
                "foreign mesh",
            ),
            &[
                "`tok_embeddings`",
                "tok_embeddings.weight",
                "no dim matching the tp mesh",
            ],
        );

        // Twice, and after FSDP.
        model.parallelize(&tp, false)?;
        has(
            &err(model.parallelize(&tp, false), "twice"),
            &["`tok_embeddings`", "already tensor-parallel"],
        );
        // FSDP over a mesh that includes the tp dim: the hint names the dim, not FSDP.
        let over_tp = err(model.fully_shard(&mesh, &FsdpConfig::default()), "fsdp over tp");
        has(
            &over_tp,
            &[
                "mesh dim 1 (\"tp\") shards it already",
                "tensor parallelism",
                "mesh.slice",
            ],
        );
        assert!(!over_tp.contains("by FSDP?"), "{over_tp}");
        let dp_mesh = DeviceMesh::with_names(mesh.comm().split(0, mesh.rank() as u32)?, &[2, 1], &["dp", "tp"])?;
        let sharded = Linear::new(4, 6, true, &dp_mesh, DType::F32)?;
        let mut layout = sharded.weight.layout();
        layout.placements = vec![Placement::Shard(0), Placement::Replicate].into();
        sharded.weight.place(layout)?;
        has(
            &err(
                parallelize_module(
                    &sharded,
                    &dp_mesh.dim("tp")?,
                    &ParallelPlan::new().add("", ColwiseParallel::default()),
                ),
                "after FSDP",
            ),
            &[
                "the root module",
                "parameter weight",
                "apply tensor parallelism before fully_shard",
            ],
        );

        let heads = TransformerConfig {
            n_heads: 3,
            dim: 48,
            ..TransformerConfig::TINY
        };
        let three = Transformer::new(heads, &mesh, DType::F32)?;
        has(
            &err(three.parallelize(&tp, false), "heads"),
            &["3 attention heads", "tp size"],
        );
        Ok(())
    })
    .unwrap();
}

#[test]
fn an_input_in_another_layout_than_planned_is_an_error_naming_the_module() {
    launch(2, |ctx| {
        let mesh = DeviceMesh::with_names(ctx.into_comm(), &[2], &["tp"])?;
        let fc = Linear::new(4, 6, true, &mesh, DType::F32)?;
        parallelize_module(&fc, &mesh, &ParallelPlan::new().add("", RowwiseParallel::default()))?;
        Materializer::from_seed(0).materialize(&fc)?;
        let x = Tensor::randn(&[3, 4], DType::F32, 2)?;
        let replicated = Var::constant(distribute_tensor(&x, &mesh, &[Placement::Replicate])?);
        has(
            &err(fc.call(&replicated), "replicated input"),
            &[
                "RowwiseParallel on the root module",
                "input arrives Replicate",
                "the plan says Shard(-1)",
                "fix the layouts in the plan",
            ],
        );
        // An op re-laid the input out before the layer: the error names it.
        let xt = distribute_tensor(&x.transpose(0, 1)?.contiguous(), &mesh, &[Placement::Shard(1)])?;
        let relaid = Var::constant(xt).transpose(0, 1)?.mul_scalar(2.0)?;
        has(
            &err(fc.call(&relaid), "re-laid input"),
            &[
                "input arrives Shard(0)",
                "the last op that changed its layout was permute (from (Shard(1)))",
            ],
        );
        let sharded = Var::constant(distribute_tensor(&x, &mesh, &[Placement::Shard(1)])?);
        assert_eq!(fc.call(&sharded)?.value().placements(), &[Placement::Replicate]);
        // Column-wise with a declared sequence-sharded input that arrives replicated.
        let up = Linear::new(4, 6, false, &mesh, DType::F32)?;
        let style = ColwiseParallel {
            input_layouts: TpLayout::Shard(0),
            output_layouts: TpLayout::Shard(-1),
        };
        parallelize_module(&up, &mesh, &ParallelPlan::new().add("", style))?;
        Materializer::from_seed(0).materialize(&up)?;
        has(&err(up.call(&replicated), "colwise"), &["ColwiseParallel", "Shard(0)"]);
        Ok(())
    })
    .unwrap();
}

#[test]
fn a_plan_that_differs_on_one_rank_fails_every_rank_before_anything_changes() {
    let seen = launch(2, |ctx| {
        let mesh = DeviceMesh::with_names(ctx.into_comm(), &[1, 2], &["dp", "tp"])?;
        let tp = mesh.dim("tp")?;
        let model = Transformer::new(TransformerConfig::TINY, &mesh, DType::F32)?;
        // Rank 1 shards the output head by rows, rank 0 by columns.
        let plan = if tp.rank() == 1 {
            ParallelPlan::new().add("output", RowwiseParallel::default())
        } else {
            ParallelPlan::new().add("output", ColwiseParallel::default())
        };
        let e = err(parallelize_module(&model, &tp, &plan), "plans differ");
        assert!(all_replicated(&model), "a refused plan changes nothing");
        // Rank 1 alone names a module the model does not have.
        let typo = if tp.rank() == 1 {
            Transformer::tp_plan().add("layers.*.attn.wq", ColwiseParallel::default())
        } else {
            Transformer::tp_plan()
        };
        let typo = err(parallelize_module(&model, &tp, &typo), "typo on rank 1");
        assert!(all_replicated(&model));
        // The ranks are still in step.
        mesh.comm().barrier()?;
        Ok((e, typo))
    })
    .unwrap();
    for (r, (differ, typo)) in seen.iter().enumerate() {
        has(
            differ,
            &[
                "rank 0 and rank 1 hold different parameters",
                "parallelize_module with the same plan",
            ],
        );
        has(typo, &["matches no module"]);
        if r == 0 {
            has(typo, &["rank 1 failed"]);
        }
    }
}
