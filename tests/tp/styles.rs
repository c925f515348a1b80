//! Each style's layer on its own against one rank on full tensors: forward output
//! and the gradients of the parameters and of the input, on tp = 2, 3, 4 with
//! sizes that do not divide (torch.chunk's uneven splits, empty shards included).

use tessera::autograd::nn::{Embedding, Inputs, LayerNorm, Linear, Materializer, Module};
use tessera::autograd::{Param, Var, backward};
use tessera::dtensor::{DType, Placement, Tensor, distribute_tensor};
use tessera::fsdp::tp::{
    ColwiseParallel, ParallelPlan, PrepareModuleInput, PrepareModuleOutput, RowwiseParallel, SequenceParallel,
    TpLayout, parallelize_module,
};
use tessera::{DeviceMesh, launch};

type R<T> = tessera::autograd::Result<T>;

/// One layer under one style.
#[derive(Clone, Copy)]
struct Case {
    name: &'static str,
    build: fn(&DeviceMesh) -> R<Box<dyn Module>>,
    style: fn() -> ParallelPlan,
    /// The input's shape; `None` in `tokens`: float input, else i64 indices below it.
    x_shape: &'static [usize],
    tokens: Option<usize>,
    /// The input's placement on the tp dim.
    x_tp: Placement,
    /// The output's placement on the tp dim.
    out_tp: Placement,
    /// The first parameter's (the weight's) placement on the tp dim.
    weight_tp: Placement,
}

fn linear(mesh: &DeviceMesh) -> R<Box<dyn Module>> {
    Ok(Box::new(Linear::new(5, 7, true, mesh, DType::F64)?))
}

fn embedding(mesh: &DeviceMesh) -> R<Box<dyn Module>> {
    Ok(Box::new(Embedding::new(7, 5, mesh, DType::F64)?))
}

fn norm(mesh: &DeviceMesh) -> R<Box<dyn Module>> {
    let ln = LayerNorm::new(4, 1e-5, mesh, DType::F64)?;
    // Not the identity initialisation, so the parameter gradients matter.
    ln.weight.set_value(distribute_tensor(
        &Tensor::randn(&[4], DType::F64, 8)?,
        &ln.weight.mesh(),
        &ln.weight.placements(),
    )?);
    Ok(Box::new(ln))
}

fn on_root(style: impl tessera::fsdp::tp::ParallelStyle + 'static) -> ParallelPlan {
    ParallelPlan::new().add("", style)
}

const CASES: &[Case] = &[
    Case {
        name: "colwise linear",
        build: linear,
        style: || on_root(ColwiseParallel::default()),
        x_shape: &[2, 3, 5],
        tokens: None,
        x_tp: Placement::Replicate,
        out_tp: Placement::Shard(2),
        weight_tp: Placement::Shard(0),
    },
    Case {
        name: "colwise linear gathered",
        build: linear,
        style: || {
            on_root(ColwiseParallel {
                input_layouts: TpLayout::Replicate,
                output_layouts: TpLayout::Replicate,
            })
        },
        x_shape: &[2, 3, 5],
        tokens: None,
        x_tp: Placement::Replicate,
        out_tp: Placement::Replicate,
        weight_tp: Placement::Shard(0),
    },
    Case {
        name: "rowwise linear",
        build: linear,
        style: || on_root(RowwiseParallel::default()),
        x_shape: &[2, 3, 5],
        tokens: None,
        x_tp: Placement::Shard(2),
        out_tp: Placement::Replicate,
        weight_tp: Placement::Shard(1),
    },
    Case {
        name: "rowwise linear to sequence shards",
        build: linear,
        style: || {
            on_root(RowwiseParallel {
                input_layouts: None,
                output_layouts: TpLayout::Shard(1),
            })
        },
        x_shape: &[2, 3, 5],
        tokens: None,
        x_tp: Placement::Shard(2),
        out_tp: Placement::Shard(1),
        weight_tp: Placement::Shard(1),
    },
    Case {
        name: "colwise embedding",
        build: embedding,
        style: || on_root(ColwiseParallel::default()),
        x_shape: &[2, 3],
        tokens: Some(7),
        x_tp: Placement::Replicate,
        out_tp: Placement::Shard(2),
        weight_tp: Placement::Shard(1),
    },
    Case {
        name: "rowwise embedding",
        build: embedding,
        style: || on_root(RowwiseParallel::default()),
        x_shape: &[2, 3],
        tokens: Some(7),
        x_tp: Placement::Replicate,
        out_tp: Placement::Replicate,
        weight_tp: Placement::Shard(0),
    },
    Case {
        name: "sequence-parallel layer norm",
        build: norm,
        style: || on_root(SequenceParallel::default()),
        x_shape: &[2, 5, 4],
        tokens: None,
        x_tp: Placement::Replicate,
        out_tp: Placement::Shard(1),
        weight_tp: Placement::Replicate,
    },
    Case {
        name: "prepare input: sequence shards gathered",
        build: linear,
        style: || {
            on_root(PrepareModuleInput::new(
                Some(TpLayout::Shard(1)),
                Some(TpLayout::Replicate),
            ))
        },
        x_shape: &[2, 3, 5],
        tokens: None,
        x_tp: Placement::Shard(1),
        out_tp: Placement::Replicate,
        weight_tp: Placement::Replicate,
    },
    Case {
        name: "prepare output: replicated to row shards",
        build: linear,
        style: || {
            on_root(PrepareModuleOutput {
                output_layouts: Some(TpLayout::Replicate),
                desired_output_layouts: Some(TpLayout::Shard(0)),
            })
        },
        x_shape: &[2, 3, 5],
        tokens: None,
        x_tp: Placement::Replicate,
        out_tp: Placement::Shard(0),
        weight_tp: Placement::Replicate,
    },
];

/// Full values of the output and of every gradient (parameters by name, then the input).
type Values = Vec<(String, Vec<f64>)>;

/// Runs `case` on `mesh`: forward, `Σ y · c` with fixed `c`, backward.
fn run(case: Case, mesh: &DeviceMesh, tp: bool) -> R<Values> {
    let m = (case.build)(mesh)?;
    if tp {
        parallelize_module(&*m, mesh, &(case.style)())?;
    }
    // The same values with or without TP: the init is mesh-invariant.
    Materializer::from_seed(1).materialize(&*m)?;
    let x_full = match case.tokens {
        Some(v) => {
            let n: usize = case.x_shape.iter().product();
            Tensor::from_vec((0..n).map(|i| ((i * 5 + 2) % v) as i64).collect(), case.x_shape)?
        }
        None => Tensor::randn(case.x_shape, DType::F64, 11)?,
    };
    let x_place = if tp { case.x_tp } else { Placement::Replicate };
    let x = Param::new(distribute_tensor(&x_full, mesh, &[x_place])?);
    let xv = if case.tokens.is_some() {
        Var::constant(x.value()?)
    } else {
        x.var()?
    };
    let y = m.call(&xv)?;
    if tp {
        assert_eq!(
            y.value().placements(),
            &[case.out_tp],
            "{}: output placement",
            case.name
        );
        let w = &m.parameters()[0];
        assert_eq!(
            w.value()?.placements(),
            &[case.weight_tp],
            "{}: {}",
            case.name,
            w.name()
        );
    }
    let c = Tensor::randn(y.value().shape(), DType::F64, 12)?;
    let c = Var::constant(distribute_tensor(&c, mesh, &[Placement::Replicate])?);
    let dims: Vec<usize> = (0..y.value().shape().len()).collect();
    backward(&y.mul(&c)?.sum(&dims, false)?)?;
    let mut out = vec![("output".to_string(), y.value().full_tensor()?.to_f64_vec())];
    for (name, p) in m.named_parameters() {
        let g = p.grad().expect("every parameter gets a gradient");
        assert_eq!(
            g.placements(),
            p.value()?.placements(),
            "{}: {name}'s gradient",
            case.name
        );
        out.push((format!("grad {name}"), g.full_tensor()?.to_f64_vec()));
    }
    if case.tokens.is_none() {
        out.push((
            "grad x".into(),
            x.grad().expect("x gets a gradient").full_tensor()?.to_f64_vec(),
        ));
    }
    Ok(out)
}

#[test]
fn every_style_matches_one_rank_on_full_tensors() {
    for tp in [2, 3, 4] {
        let worst = launch(tp, move |ctx| {
            let mesh = DeviceMesh::with_names(ctx.into_comm(), &[tp], &["tp"])?;
            let alone = DeviceMesh::new(mesh.comm().split(mesh.rank() as u32, 0)?, &[1])?;
            let mut worst = 0.0f64;
            for &case in CASES {
                let got = run(case, &mesh, true)?;
                let want = run(case, &alone, false)?;
                assert_eq!(got.len(), want.len());
                for ((name, g), (_, w)) in got.iter().zip(&want) {
                    assert_eq!(g.len(), w.len(), "tp={tp} {}: {name}", case.name);
                    let d = g.iter().zip(w).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
                    assert!(d < 1e-12, "tp={tp} {}: {name} differs by {d:e}", case.name);
                    worst = worst.max(d);
                }
            }
            Ok(worst)
        })
        .unwrap();
        eprintln!("tp={tp}: every style within {:e} of one rank", worst[0]);
    }
}

/// `fc(x) + skip` with `skip` positional or named (`"skip"`): a module of two inputs.
struct TwoInputs {
    fc: Linear,
}

impl Module for TwoInputs {
    fn named_children(&self) -> Vec<(String, &dyn Module)> {
        vec![("fc".into(), &self.fc)]
    }

    fn forward(&self, x: &Var) -> R<Var> {
        self.fc.call(x)
    }

    fn forward_with(&self, inputs: &Inputs) -> R<Var> {
        let skip = match inputs.named("skip") {
            Some(s) => s,
            None => inputs.get(1)?,
        };
        // Both inputs must arrive replicated on tp: the output is compared to one rank.
        for v in [inputs.get(0)?, skip] {
            assert_eq!(
                v.value().placements(),
                [Placement::Replicate],
                "an input was not laid out"
            );
        }
        self.fc.call(inputs.get(0)?)?.add(skip)
    }
}

/// PrepareModuleInput lays out every positional input by position and named
/// inputs by name (`None` entries left alone), and refuses a call whose
/// positional inputs the plan does not count.
#[test]
fn prepare_module_input_lays_out_each_input_of_a_several_input_module() {
    launch(2, |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), &[2])?;
        let full = |seed| Tensor::randn(&[2, 4, 5], DType::F64, seed);
        let (x, skip) = (full(1)?, full(2)?);
        let on = |t: &Tensor, p| -> R<Var> { Ok(Var::constant(distribute_tensor(t, &mesh, &[p])?)) };
        let build = || -> R<TwoInputs> {
            let m = TwoInputs {
                fc: Linear::new(5, 5, false, &mesh, DType::F64)?,
            };
            Materializer::from_seed(4).materialize(&m)?;
            Ok(m)
        };
        let reference = {
            let m = build()?;
            m.call_with(
                Inputs::new()
                    .arg(&on(&x, Placement::Replicate)?)
                    .arg(&on(&skip, Placement::Replicate)?),
            )?
        };
        let want = reference.value().full_tensor()?.to_f64_vec();
        // Positional: x arrives sequence-sharded, skip is left alone (already replicated).
        let m = build()?;
        let positional = PrepareModuleInput {
            input_layouts: vec![Some(TpLayout::Shard(1)), None],
            desired_input_layouts: vec![Some(TpLayout::Replicate), None],
            ..PrepareModuleInput::default()
        };
        parallelize_module(&m, &mesh, &on_root(positional))?;
        let (xs, skip_r) = (on(&x, Placement::Shard(1))?, on(&skip, Placement::Replicate)?);
        let got = m.call_with(Inputs::new().arg(&xs).arg(&skip_r))?;
        assert_eq!(got.value().full_tensor()?.to_f64_vec(), want);
        let err = m.call_with(Inputs::from(&xs)).unwrap_err().to_string();
        assert!(
            err.contains("called with 1 positional inputs but the plan lays out 2"),
            "{err}"
        );
        // Named: skip arrives sharded on the last dim under its name.
        let m = build()?;
        let named = PrepareModuleInput {
            input_kwarg_layouts: vec![("skip".into(), TpLayout::Shard(-1))],
            desired_input_kwarg_layouts: vec![("skip".into(), TpLayout::Replicate)],
            ..PrepareModuleInput::new(Some(TpLayout::Shard(1)), Some(TpLayout::Replicate))
        };
        parallelize_module(&m, &mesh, &on_root(named))?;
        let skip_s = on(&skip, Placement::Shard(2))?;
        let got = m.call_with(Inputs::new().arg(&xs).kwarg("skip", &skip_s))?;
        assert_eq!(got.value().full_tensor()?.to_f64_vec(), want);
        // The named layout is checked as a positional one is.
        let err = m
            .call_with(Inputs::new().arg(&xs).kwarg("skip", &skip_r))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("its input `skip` arrives Replicate on the tp dim but the plan says Shard(-1)"),
            "{err}"
        );
        // Lists of different lengths are refused before anything changes.
        let m = build()?;
        let bad = PrepareModuleInput {
            input_layouts: vec![None, None],
            desired_input_layouts: vec![None],
            ..PrepareModuleInput::default()
        };
        let err = parallelize_module(&m, &mesh, &on_root(bad)).unwrap_err().to_string();
        assert!(
            err.contains("input_layouts has 2 entries but desired_input_layouts 1"),
            "{err}"
        );
        Ok(())
    })
    .unwrap();
}
