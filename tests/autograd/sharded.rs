//! Gradients of sharded runs equal those of one rank seeing the full tensors.
//!
//! Seven small models (an MLP with gelu, layer norm + linear, causal attention as a
//! chain of ops and as the fused op, embedding + cross entropy, one using the
//! remaining ops, and one of a LLaMA's ops with negative dims) run on meshes `[2]`, `[4]` and `[2, 2]` with the batch sharded
//! (evenly, unevenly, with empty shards)
//! and the parameters replicated or sharded; a sharded parameter is redistributed
//! to replicated inside the forward, so its gradient comes home through the
//! backward of that redistribute. Every rank's loss and every parameter's
//! `full_tensor()`ed gradient must equal the one-rank run within 1e-10, and every
//! gradient must sit in its parameter's placements.
//!
//! Two properties draw the model, mesh, batch and placements: one as above (data
//! also feature-sharded or partial), one using the sharded parameters as placed,
//! without the redistribute, so that the ops' own strategies decide.

use proptest::prelude::*;
use proptest::test_runner::{Config, FileFailurePersistence, TestCaseError};
use tessera::autograd::{Param, Result, Var, backward};
use tessera::dtensor::{Placement, Placement::*, ReduceOp, Tensor};
use tessera::tensor::ops::Reduction;

use crate::harness::{
    R, constant, full_grad, gathered, indices, max_rel_err, param, replicate, scalar, try_on_mesh, uniform,
};

const TOL: f64 = 1e-10;

/// A model: its parameters' names and shapes, its data for a batch of `b` (the
/// batch is dim 0 of every data tensor), and its loss.
struct Model {
    name: &'static str,
    params: &'static [(&'static str, &'static [usize])],
    data: fn(usize) -> Vec<Tensor>,
    /// Whether the data are floats (so they may also be given as partial sums).
    float_data: bool,
    /// The loss from the (replicated) parameter vars and the data vars.
    loss: fn(&[Var], &[Var]) -> Result<Var>,
}

const MLP: Model = Model {
    name: "mlp",
    params: &[("w1", &[10, 6]), ("b1", &[10]), ("w2", &[3, 10]), ("b2", &[3])],
    data: |b| vec![uniform(&[b, 6], 1)],
    float_data: true,
    loss: |p, d| {
        d[0].linear(&p[0], Some(&p[1]))?
            .gelu()?
            .linear(&p[2], Some(&p[3]))?
            .square()?
            .mean(&[0, 1], false)
    },
};

const LN_LINEAR: Model = Model {
    name: "layer_norm + linear",
    params: &[("gamma", &[6]), ("beta", &[6]), ("w", &[4, 6]), ("b", &[4])],
    data: |b| vec![uniform(&[b, 6], 2), uniform(&[b, 4], 3)],
    float_data: true,
    loss: |p, d| {
        d[0].layer_norm(Some(&p[0]), Some(&p[1]), 1e-5)?
            .linear(&p[2], Some(&p[3]))?
            .tanh()?
            .sub(&d[1])?
            .square()?
            .mean(&[0, 1], false)
    },
};

const ATTENTION: Model = Model {
    name: "causal attention",
    params: &[("wq", &[6, 6]), ("wk", &[6, 6]), ("wv", &[6, 6])],
    data: |b| vec![uniform(&[b, 4, 6], 4)],
    float_data: true,
    loss: |p, d| {
        let (q, k, v) = (d[0].matmul(&p[0])?, d[0].matmul(&p[1])?, d[0].matmul(&p[2])?);
        let scores = q.matmul(&k.transpose(1, 2)?)?.mul_scalar(1.0 / 6f64.sqrt())?;
        let attn = scores.causal_mask(f64::NEG_INFINITY)?.softmax(2)?;
        attn.matmul(&v)?.square()?.mean(&[0, 1, 2], false)
    },
};

/// The same attention through the fused op, two heads of 3 (heads as dim 1).
const FUSED_ATTENTION: Model = Model {
    name: "fused causal attention",
    params: &[("wq", &[6, 6]), ("wk", &[6, 6]), ("wv", &[6, 6])],
    data: |b| vec![uniform(&[b, 4, 6], 4)],
    float_data: true,
    loss: |p, d| {
        let b = d[0].value().shape()[0];
        let heads = |w: &Var| d[0].matmul(w)?.reshape(&[b, 4, 2, 3])?.permute(&[0, 2, 1, 3]);
        let (q, k, v) = (heads(&p[0])?, heads(&p[1])?, heads(&p[2])?);
        let out = q.scaled_dot_product_attention(&k, &v, true, None)?;
        out.square()?.mean(&[0, 1, 2, 3], false)
    },
};

const EMBEDDING_CE: Model = Model {
    name: "embedding + cross_entropy",
    params: &[("table", &[7, 5]), ("head", &[7, 5])],
    data: |b| vec![indices(&[b, 3], 7, 5), indices(&[b, 3], 7, 6)],
    float_data: false,
    loss: |p, d| {
        p[0].embedding(&d[0])?
            .linear(&p[1], None)?
            .cross_entropy(&d[1], Reduction::Mean)
    },
};

/// The other ops: max (over features and over the batch), a hand-made softmax,
/// narrow, cat, reshape, permute, broadcasting mul, sqrt, log, pow, abs.
const MISC: Model = Model {
    name: "misc ops",
    params: &[("w", &[6, 8]), ("s", &[2])],
    data: |b| vec![uniform(&[b, 6], 7)],
    float_data: true,
    loss: |p, d| {
        let h = d[0].matmul(&p[0])?;
        let e = h.sub(&h.max(&[1], true)?)?.exp()?;
        let soft = e.div(&e.sum(&[1], true)?)?;
        let c = Var::cat(&[&soft.narrow(1, 2, 4)?, &soft.narrow(1, 0, 2)?], 1)?;
        let b = c.value().shape()[0];
        let r = c.reshape(&[b, 2, 3])?.permute(&[0, 2, 1])?.mul(&p[1])?;
        let q = r
            .square()?
            .add_scalar(1.0)?
            .sqrt()?
            .log()?
            .pow(1.5)?
            .mean(&[0, 1, 2], false)?;
        // The column maxima over the (sharded) batch.
        let top = h.abs()?.max(&[0], false)?.mean(&[0], false)?;
        q.add(&top)
    },
};

/// The ops of a LLaMA-style model and its tooling, with negative dims: RMSNorm,
/// rotary embeddings, key/value head repetition, split and stack, masked_fill and
/// where_cond by a per-row mask, gather and index_select, argmax as an index, a
/// reshape inferring its batch size (`-1`).
const LLAMA_OPS: Model = Model {
    name: "llama ops",
    params: &[("w", &[4]), ("s", &[2]), ("t", &[4, 4])],
    data: |b| {
        vec![
            uniform(&[b, 3, 2, 4], 8),
            indices(&[b, 3, 1, 1], 2, 9),
            indices(&[b, 3, 4, 2], 4, 10),
        ]
    },
    float_data: false,
    loss: |p, d| {
        let (cos, sin) = tessera::tensor::ops::rotary_tables(&[0, 1, 2], 4, 100.0)?;
        let x = d[0].rms_norm(Some(&p[0]), 1e-5)?.rotary_embedding(&cos, &sin)?;
        let x = x.repeat_interleave(2, -2)?; // [b, 3, 4, 4]
        let halves = x.split(2, -1)?;
        let y = Var::stack(&[&halves[1], &halves[0].mul(&p[1])?], -1)?.reshape(&[-1, 3, 4, 4])?;
        let mask = d[1].cast(tessera::dtensor::DType::U8)?;
        let y = mask
            .where_cond(&x, &y.masked_fill(&mask, 0.5)?)?
            .add(&y.masked_fill(&mask, -0.5)?)?;
        let picked = y.gather(-1, &d[2])?; // [b, 3, 4, 2]
        let index = p[2].argmax(-1, false)?; // [4] i64, a constant
        let z = y.matmul(&p[2])?.index_select(-1, &index)?;
        picked
            .square()?
            .mean(&[-1, -2, 1, 0], false)?
            .add(&z.mean(&[0, 1, 2, 3], false)?)
    },
};

const MODELS: [&Model; 7] = [
    &MLP,
    &LN_LINEAR,
    &ATTENTION,
    &FUSED_ATTENTION,
    &EMBEDDING_CE,
    &MISC,
    &LLAMA_OPS,
];

/// One rank's results: the loss, and each parameter's full gradient and placements.
struct RankOut {
    loss: f64,
    grads: Vec<(Tensor, Vec<Placement>)>,
}

/// A model's parameters as full tensors (the same for every run).
fn param_values(model: &Model) -> Vec<Tensor> {
    model
        .params
        .iter()
        .enumerate()
        .map(|(i, (_, shape))| uniform(shape, 100 + i as u64))
        .collect()
}

/// Runs forward and backward of `model` on a batch of `batch` and returns every rank's results.
fn run(
    model: &'static Model,
    batch: usize,
    mesh_shape: &[usize],
    data_placements: &[Placement],
    param_placements: &[Vec<Placement>],
    direct: bool,
) -> std::result::Result<Vec<RankOut>, String> {
    let values = param_values(model);
    let data = (model.data)(batch);
    let (data_placements, param_placements) = (data_placements.to_vec(), param_placements.to_vec());
    try_on_mesh(mesh_shape, move |mesh| {
        let params = model
            .params
            .iter()
            .zip(&values)
            .zip(&param_placements)
            .map(|(((name, _), v), pl)| param(name, v, mesh, pl))
            .collect::<R<Vec<_>>>()?;
        let vars = if direct {
            params.iter().map(Param::var).collect::<Result<Vec<_>>>()?
        } else {
            params.iter().map(gathered).collect::<Result<Vec<_>>>()?
        };
        let data = data
            .iter()
            .map(|t| constant(t, mesh, &data_placements))
            .collect::<R<Vec<_>>>()?;
        let loss = (model.loss)(&vars, &data)?;
        backward(&loss)?;
        let grads = params
            .iter()
            .map(|p| {
                Ok((
                    full_grad(p)?,
                    p.grad().map(|g| g.placements().to_vec()).unwrap_or_default(),
                ))
            })
            .collect::<R<Vec<_>>>()?;
        Ok(RankOut {
            loss: scalar(&loss)?,
            grads,
        })
    })
}

/// Checks a sharded run against the one-rank run of the same model and batch.
fn compare(
    model: &'static Model,
    batch: usize,
    mesh_shape: &[usize],
    data_placements: &[Placement],
    param_placements: &[Vec<Placement>],
    direct: bool,
) -> std::result::Result<(), String> {
    let all_rep = vec![replicate(1); model.params.len()];
    let want = run(model, batch, &[1], &[Replicate], &all_rep, false)?.remove(0);
    let got = run(model, batch, mesh_shape, data_placements, param_placements, direct)?;
    let case = format!(
        "{} (batch {batch}) on {mesh_shape:?}, data {data_placements:?}, params {param_placements:?}{}",
        model.name,
        if direct { " used as placed" } else { "" }
    );
    for (rank, out) in got.iter().enumerate() {
        if (out.loss - want.loss).abs() > TOL * want.loss.abs().max(1.0) {
            return Err(format!("{case}: rank {rank} loss {} != {}", out.loss, want.loss));
        }
        for (((g, placed), (w, _)), ((name, _), pl)) in out
            .grads
            .iter()
            .zip(&want.grads)
            .zip(model.params.iter().zip(param_placements))
        {
            match max_rel_err(g, w) {
                Ok(e) if e <= TOL => {}
                Ok(e) => {
                    return Err(format!(
                        "{case}: rank {rank}, grad of {name}: max error {e:.3e}\n got {:?}\nwant {:?}",
                        g.to_f64_vec(),
                        w.to_f64_vec()
                    ));
                }
                Err(m) => return Err(format!("{case}: rank {rank}, grad of {name}: {m}")),
            }
            if placed != pl {
                return Err(format!(
                    "{case}: rank {rank}, grad of {name} placed {placed:?}, not {pl:?}"
                ));
            }
        }
    }
    Ok(())
}

/// The fixed configurations: (mesh, batch, data placements, a parameter's
/// placements by its index).
type Config1 = (
    &'static [usize],
    usize,
    &'static [Placement],
    fn(usize) -> Vec<Placement>,
);

const CONFIGS: &[Config1] = &[
    (&[2], 8, &[Shard(0)], |_| vec![Replicate]),
    (&[4], 8, &[Shard(0)], |_| vec![Replicate]),
    (&[2, 2], 8, &[Shard(0), Shard(0)], |_| vec![Replicate, Replicate]),
    (&[2], 8, &[Shard(0)], |_| vec![Shard(0)]),
    // Uneven: a batch of 6 over 4 ranks is 2, 2, 2, 0 rows.
    (&[4], 6, &[Shard(0)], |i| {
        vec![if i % 2 == 0 { Shard(0) } else { Replicate }]
    }),
    (&[2, 2], 8, &[Shard(0), Shard(0)], |i| {
        if i % 2 == 0 {
            vec![Replicate, Shard(0)]
        } else {
            vec![Shard(0), Shard(0)]
        }
    }),
    (&[2, 2], 5, &[Replicate, Shard(0)], |_| vec![Shard(0), Replicate]),
];

fn check_model(model: &'static Model) {
    for &(mesh, batch, data, params) in CONFIGS {
        let placements: Vec<Vec<Placement>> = (0..model.params.len()).map(params).collect();
        if let Err(e) = compare(model, batch, mesh, data, &placements, false) {
            panic!("{e}");
        }
    }
}

#[test]
fn mlp_with_gelu() {
    check_model(&MLP);
}

#[test]
fn layer_norm_and_linear() {
    check_model(&LN_LINEAR);
}

#[test]
fn causal_attention() {
    check_model(&ATTENTION);
}

#[test]
fn fused_causal_attention() {
    check_model(&FUSED_ATTENTION);
}

#[test]
fn embedding_and_cross_entropy() {
    check_model(&EMBEDDING_CE);
}

#[test]
fn misc_ops() {
    check_model(&MISC);
}

#[test]
fn llama_ops() {
    check_model(&LLAMA_OPS);
}

/// The comparison itself fails when a gradient is off (here: a different batch
/// on the sharded side changes the gradients).
#[test]
fn the_comparison_catches_differences() {
    let all_rep = vec![replicate(1); MLP.params.len()];
    let a = run(&MLP, 8, &[1], &[Replicate], &all_rep, false).unwrap().remove(0);
    let b = run(&MLP, 7, &[1], &[Replicate], &all_rep, false).unwrap().remove(0);
    let e = max_rel_err(&a.grads[0].0, &b.grads[0].0).unwrap();
    assert!(e > TOL, "different batches gave the same gradient ({e:.1e})");
}

/// Proptest configuration: 24 cases unless `PROPTEST_CASES` says otherwise,
/// failures persisted under `target/`.
fn config() -> Config {
    let mut c = Config::default();
    if std::env::var_os("PROPTEST_CASES").is_none() {
        c.cases = 24;
    }
    c.failure_persistence = Some(Box::new(FileFailurePersistence::Direct(
        "target/proptest-regressions/autograd.txt",
    )));
    c.max_shrink_iters = 256;
    c
}

/// Placements of a tensor of rank `rank` on one mesh dim: replicated, sharded on
/// dim 0 or 1, or (`partial`) a pending sum.
fn placement(rank: usize, partial: bool) -> impl Strategy<Value = Placement> {
    let mut options = vec![Replicate, Shard(0)];
    if rank > 1 {
        options.push(Shard(1));
    }
    if partial {
        options.push(Partial(ReduceOp::Sum));
    }
    prop::sample::select(options)
}

/// A model, a mesh, a batch, the data's placements and every parameter's.
fn case() -> impl Strategy<Value = (usize, Vec<usize>, usize, Vec<Placement>, Vec<Vec<Placement>>)> {
    let meshes = vec![vec![1], vec![2], vec![3], vec![4], vec![2, 2]];
    (0..MODELS.len(), prop::sample::select(meshes), 1usize..=9).prop_flat_map(|(m, mesh, batch)| {
        let nd = mesh.len();
        let data = prop::collection::vec(placement(2, MODELS[m].float_data), nd);
        let params: Vec<_> = MODELS[m]
            .params
            .iter()
            .map(|(_, shape)| prop::collection::vec(placement(shape.len(), false), nd))
            .collect();
        (Just(m), Just(mesh), Just(batch), data, params)
    })
}

proptest! {
    #![proptest_config(config())]

    /// Any model, mesh, batch size (uneven and empty shards included), data
    /// placements (batch or feature sharded, or float data as partial sums) and
    /// parameter placements.
    #[test]
    fn sharded_gradients_equal_one_rank((m, mesh, batch, data, params) in case()) {
        compare(MODELS[m], batch, &mesh, &data, &params, false).map_err(TestCaseError::fail)?;
    }

    /// The same with the sharded parameters used as they are placed (no
    /// redistribute in the forward): the ops' own strategies decide, and the
    /// gradients must still be those of one rank, in the parameters' placements.
    #[test]
    fn params_used_as_placed((m, mesh, batch, data, params) in case()) {
        compare(MODELS[m], batch, &mesh, &data, &params, true).map_err(TestCaseError::fail)?;
    }
}
