//! Every differentiable op against central finite differences, in f64 on one rank.
//!
//! For inputs `xs` (float inputs are parameters, index inputs constants) the loss is
//! `L = Σ op(xs) · R` with a fixed random `R` of the output's shape, so every output
//! element carries its own weight. Each parameter's analytic gradient must match
//! `(L(x + h·eᵢ) − L(x − h·eᵢ)) / 2h` with `h = 1e-6` within `1e-6` (relative above
//! one, absolute below), element by element. Inputs keep to the op's smooth domain:
//! positive for log/sqrt/rsqrt/pow, away from zero for relu/abs, far-apart values
//! for max.

use tessera::autograd::{Param, Result, Var, backward};
use tessera::dtensor::{DType, Placement::*, Tensor};
use tessera::tensor::ops::Reduction::{Mean, Sum};

use crate::harness::{R, Rng, constant, indices, max_rel_err, on_mesh, param, scalar, values, weighted_sum};

const H: f64 = 1e-6;
const TOL: f64 = 1e-6;

/// How an input's values are drawn.
#[derive(Clone, Copy)]
enum Init {
    /// Uniform on `[-1, 1)`.
    Signed,
    /// Uniform on `[0.5, 2)`.
    Positive,
    /// `±[0.2, 1.2)`: no value within a finite-difference step of a kink at 0.
    AwayFromZero,
    /// A shuffled `0, 0.25, 0.5, …` minus an offset, plus small noise: no two values
    /// within a step of each other (no ties for max).
    Distinct,
    /// `i64` indices in `0..n` (a constant, not differentiated).
    Index(usize),
}

#[derive(Clone)]
struct In {
    shape: Vec<usize>,
    init: Init,
}

fn input(shape: &[usize], init: Init) -> In {
    In {
        shape: shape.to_vec(),
        init,
    }
}

fn signed(shape: &[usize]) -> In {
    input(shape, Init::Signed)
}
fn positive(shape: &[usize]) -> In {
    input(shape, Init::Positive)
}
fn away(shape: &[usize]) -> In {
    input(shape, Init::AwayFromZero)
}
fn distinct(shape: &[usize]) -> In {
    input(shape, Init::Distinct)
}
fn index(shape: &[usize], n: usize) -> In {
    input(shape, Init::Index(n))
}

impl In {
    fn make(&self, seed: u64) -> Tensor {
        let shape = &self.shape;
        match self.init {
            Init::Signed => values(shape, seed, Rng::signed),
            Init::Positive => values(shape, seed, |r| r.uniform(0.5, 2.0)),
            Init::AwayFromZero => values(shape, seed, |r| {
                let m = r.uniform(0.2, 1.2);
                if r.next_u64() & 1 == 0 { m } else { -m }
            }),
            Init::Distinct => {
                let n: usize = shape.iter().product();
                let mut rng = Rng::new(seed);
                let mut order: Vec<usize> = (0..n).collect();
                for i in (1..n).rev() {
                    order.swap(i, rng.below(i + 1));
                }
                let v: Vec<f64> = order
                    .iter()
                    .map(|&k| 0.25 * k as f64 - 0.125 * n as f64 + rng.uniform(0.0, 0.05))
                    .collect();
                // INVARIANT: the length is the shape's element count.
                Tensor::from_vec(v, shape).expect("valid shape")
            }
            Init::Index(n) => indices(shape, n, seed),
        }
    }

    fn differentiable(&self) -> bool {
        !matches!(self.init, Init::Index(_))
    }
}

/// Checks `f`'s gradients for every float input against finite differences.
fn check(inputs: &[In], f: impl Fn(&[Var]) -> Result<Var> + Send + Sync + 'static) {
    let failures = failures(inputs, f);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// What [`check`] finds wrong, one line per input.
fn failures(inputs: &[In], f: impl Fn(&[Var]) -> Result<Var> + Send + Sync + 'static) -> Vec<String> {
    let fulls: Vec<Tensor> = inputs.iter().enumerate().map(|(i, x)| x.make(11 + i as u64)).collect();
    let inputs = inputs.to_vec();
    let failures = on_mesh(&[1], move |mesh| {
        let rep = [Replicate];
        let leaf = |xs: &[Tensor]| -> R<Vec<Var>> { xs.iter().map(|t| constant(t, mesh, &rep)).collect() };
        // The analytic gradients.
        let params: Vec<Option<Param>> = fulls
            .iter()
            .zip(&inputs)
            .enumerate()
            .map(|(i, (t, x))| {
                x.differentiable()
                    .then(|| param(&format!("x{i}"), t, mesh, &rep))
                    .transpose()
            })
            .collect::<R<_>>()?;
        let vars: Vec<Var> = params
            .iter()
            .zip(leaf(&fulls)?)
            .map(|(p, c)| p.as_ref().map_or(Ok(c), Param::var))
            .collect::<tessera::autograd::Result<_>>()?;
        let out = f(&vars)?;
        let r = constant(&values(out.value().shape(), 7, Rng::signed), mesh, &rep)?;
        backward(&weighted_sum(&out, &r)?)?;
        // The loss at other inputs, recording nothing.
        let loss_at = |xs: &[Tensor]| -> R<f64> { scalar(&weighted_sum(&f(&leaf(xs)?)?, &r)?) };
        let mut failures = Vec::new();
        for (i, p) in params.iter().enumerate() {
            let Some(p) = p else { continue };
            let Some(g) = p.grad() else {
                failures.push(format!("input {i} got no gradient"));
                continue;
            };
            if g.placements() != rep {
                failures.push(format!("input {i}: gradient placed {:?}", g.placements()));
            }
            let base = fulls[i].to_f64_vec();
            let mut numeric = Vec::with_capacity(base.len());
            for j in 0..base.len() {
                let at = |d: f64| -> R<f64> {
                    let mut v = base.clone();
                    v[j] += d;
                    let mut xs = fulls.clone();
                    xs[i] = Tensor::from_vec(v, &inputs[i].shape)?;
                    loss_at(&xs)
                };
                numeric.push((at(H)? - at(-H)?) / (2.0 * H));
            }
            let numeric = Tensor::from_vec(numeric, &inputs[i].shape)?;
            let analytic = g.full_tensor()?;
            match max_rel_err(&analytic, &numeric) {
                Ok(e) if e <= TOL => {}
                Ok(e) => failures.push(format!(
                    "input {i}: max error {e:.3e} > {TOL:.0e}\n  analytic {:?}\n  numeric  {:?}",
                    analytic.to_f64_vec(),
                    numeric.to_f64_vec()
                )),
                Err(m) => failures.push(format!("input {i}: {m}")),
            }
        }
        Ok(failures)
    });
    failures.into_iter().next().unwrap_or_default()
}

/// One test per line: a name, the inputs, and the op applied to their vars `v`.
macro_rules! grad {
    ($($name:ident: [$($input:expr),+ $(,)?] => |$v:ident| $body:expr;)*) => {
        $(
            #[test]
            fn $name() {
                check(&[$($input),+], |$v: &[Var]| $body);
            }
        )*
    };
}

grad! {
    // Binary ops, broadcasting both ways.
    add_row: [signed(&[3, 4]), signed(&[4])] => |v| v[0].add(&v[1]);
    add_outer: [signed(&[3, 1]), signed(&[1, 4])] => |v| v[0].add(&v[1]);
    add_lead: [signed(&[3, 1]), signed(&[2, 3, 4])] => |v| v[0].add(&v[1]);
    sub_row: [signed(&[3, 4]), signed(&[4])] => |v| v[0].sub(&v[1]);
    sub_outer: [signed(&[3, 1]), signed(&[1, 4])] => |v| v[0].sub(&v[1]);
    mul_outer: [signed(&[3, 1]), signed(&[1, 4])] => |v| v[0].mul(&v[1]);
    mul_row: [signed(&[3, 4]), signed(&[4])] => |v| v[0].mul(&v[1]);
    mul_same: [signed(&[3, 4]), signed(&[3, 4])] => |v| v[0].mul(&v[1]);
    div_row: [signed(&[3, 4]), away(&[4])] => |v| v[0].div(&v[1]);
    div_outer: [signed(&[3, 1]), away(&[1, 4])] => |v| v[0].div(&v[1]);
    div_col: [signed(&[4]), positive(&[3, 1])] => |v| v[0].div(&v[1]);
    // Unary ops.
    neg: [signed(&[3, 4])] => |v| v[0].neg();
    exp: [signed(&[3, 4])] => |v| v[0].exp();
    log: [positive(&[3, 4])] => |v| v[0].log();
    sqrt: [positive(&[3, 4])] => |v| v[0].sqrt();
    rsqrt: [positive(&[3, 4])] => |v| v[0].rsqrt();
    tanh: [signed(&[3, 4])] => |v| v[0].mul_scalar(2.0)?.tanh();
    gelu: [signed(&[3, 4])] => |v| v[0].mul_scalar(3.0)?.gelu();
    relu: [away(&[3, 4])] => |v| v[0].relu();
    sigmoid: [signed(&[3, 4])] => |v| v[0].mul_scalar(3.0)?.sigmoid();
    silu: [signed(&[3, 4])] => |v| v[0].mul_scalar(3.0)?.silu();
    abs: [away(&[3, 4])] => |v| v[0].abs();
    square: [signed(&[3, 4])] => |v| v[0].square();
    pow_frac: [positive(&[3, 4])] => |v| v[0].pow(2.5);
    pow_neg: [positive(&[3, 4])] => |v| v[0].pow(-1.5);
    pow_int: [signed(&[3, 4])] => |v| v[0].pow(3.0);
    mul_scalar: [signed(&[3, 4])] => |v| v[0].mul_scalar(2.5);
    div_scalar: [signed(&[3, 4])] => |v| v[0].div_scalar(-4.0);
    add_scalar: [signed(&[3, 4])] => |v| v[0].add_scalar(3.0)?.square();
    sub_scalar: [signed(&[3, 4])] => |v| v[0].sub_scalar(1.5)?.square();
    // Shapes.
    transpose: [signed(&[2, 3, 4])] => |v| v[0].transpose(0, 2);
    permute: [signed(&[2, 3, 4])] => |v| v[0].permute(&[2, 0, 1]);
    reshape_split: [signed(&[3, 4])] => |v| v[0].reshape(&[2, 6]);
    reshape_merge: [signed(&[2, 3, 4])] => |v| v[0].reshape(&[6, 4]);
    reshape_of_transpose: [signed(&[3, 4])] => |v| v[0].transpose(0, 1)?.reshape(&[12]);
    narrow_middle: [signed(&[4, 5])] => |v| v[0].narrow(1, 1, 3);
    narrow_head: [signed(&[4, 5])] => |v| v[0].narrow(0, 0, 2);
    narrow_tail: [signed(&[4, 5])] => |v| v[0].narrow(1, 3, 2);
    cat_last: [signed(&[3, 2]), signed(&[3, 1]), signed(&[3, 3])] => |v| Var::cat(&[&v[0], &v[1], &v[2]], 1);
    cat_first: [signed(&[1, 4]), signed(&[2, 4])] => |v| Var::cat(&[&v[0], &v[1]], 0);
    cat_same_twice: [signed(&[2, 3])] => |v| Var::cat(&[&v[0], &v[0].square()?], 0);
    // Reductions.
    sum_one: [signed(&[3, 4])] => |v| v[0].sum(&[1], false);
    sum_keep: [signed(&[2, 3, 4])] => |v| v[0].sum(&[0, 2], true);
    sum_all: [signed(&[3, 4])] => |v| v[0].sum(&[0, 1], false);
    mean_one: [signed(&[3, 4])] => |v| v[0].mean(&[0], false);
    mean_keep: [signed(&[2, 3, 4])] => |v| v[0].mean(&[1, 2], true);
    mean_all: [signed(&[3, 4])] => |v| v[0].mean(&[0, 1], false);
    max_one: [distinct(&[3, 4])] => |v| v[0].max(&[1], false);
    max_keep: [distinct(&[2, 3, 4])] => |v| v[0].max(&[0, 2], true);
    max_all: [distinct(&[3, 4])] => |v| v[0].max(&[0, 1], false);
    // Placements (on one rank the values move nowhere, but the rule must still run).
    redistribute_shard: [signed(&[4, 3])] => |v| v[0].redistribute(&[Shard(0)])?.square();
    redistribute_back: [signed(&[4, 3])] => |v| v[0].redistribute(&[Shard(1)])?.redistribute(&[Replicate]);
    // Contractions.
    matmul: [signed(&[3, 4]), signed(&[4, 5])] => |v| v[0].matmul(&v[1]);
    matmul_batched: [signed(&[2, 3, 4]), signed(&[2, 4, 5])] => |v| v[0].matmul(&v[1]);
    matmul_batch_by_2d: [signed(&[2, 3, 4]), signed(&[4, 5])] => |v| v[0].matmul(&v[1]);
    matmul_self: [signed(&[3, 3])] => |v| v[0].matmul(&v[0].transpose(0, 1)?);
    linear: [signed(&[3, 4]), signed(&[5, 4]), signed(&[5])] => |v| v[0].linear(&v[1], Some(&v[2]));
    linear_no_bias: [signed(&[2, 3, 4]), signed(&[5, 4])] => |v| v[0].linear(&v[1], None);
    // Neural-network ops.
    softmax_last: [signed(&[3, 4])] => |v| v[0].mul_scalar(2.0)?.softmax(1);
    softmax_first: [signed(&[3, 4])] => |v| v[0].mul_scalar(2.0)?.softmax(0);
    log_softmax_last: [signed(&[2, 3, 4])] => |v| v[0].mul_scalar(2.0)?.log_softmax(2);
    log_softmax_first: [signed(&[3, 4])] => |v| v[0].log_softmax(0);
    causal_mask_zero: [signed(&[2, 4, 4])] => |v| v[0].causal_mask(0.0);
    causal_mask_wide: [signed(&[3, 5])] => |v| v[0].causal_mask(0.5);
    causal_softmax: [signed(&[2, 4, 4])] => |v| v[0].causal_mask(f64::NEG_INFINITY)?.softmax(2);
    sdpa_causal: [signed(&[2, 2, 4, 3]), signed(&[2, 2, 4, 3]), signed(&[2, 2, 4, 5])] =>
        |v| v[0].scaled_dot_product_attention(&v[1], &v[2], true, None);
    sdpa_cross: [signed(&[3, 2, 3]), signed(&[3, 5, 3]), signed(&[3, 5, 2])] =>
        |v| v[0].scaled_dot_product_attention(&v[1], &v[2], false, Some(0.7));
    sdpa_self: [signed(&[2, 4, 3])] => |v| v[0].scaled_dot_product_attention(&v[0], &v[0], true, Some(1.3));
    layer_norm_affine: [signed(&[3, 5]), signed(&[5]), signed(&[5])] =>
        |v| v[0].layer_norm(Some(&v[1]), Some(&v[2]), 1e-5);
    layer_norm_plain: [signed(&[2, 3, 5])] => |v| v[0].layer_norm(None, None, 1e-5);
    layer_norm_weight: [signed(&[3, 5]), signed(&[5])] => |v| v[0].layer_norm(Some(&v[1]), None, 1e-3);
    layer_norm_bias: [signed(&[3, 5]), signed(&[5])] => |v| v[0].layer_norm(None, Some(&v[1]), 1e-3);
    clamp_both: [signed(&[3, 5])] => |v| v[0].clamp(Some(-0.3), Some(0.4));
    clamp_max: [signed(&[2, 3, 5])] => |v| v[0].clamp(None, Some(0.2));
    rms_norm_weight: [signed(&[3, 5]), signed(&[5])] => |v| v[0].rms_norm(Some(&v[1]), 1e-5);
    rms_norm_plain: [signed(&[2, 3, 5])] => |v| v[0].rms_norm(None, 1e-3);
    rotary: [signed(&[2, 3, 2, 4])] => |v| {
        let (cos, sin) = tessera::tensor::ops::rotary_tables(&[0, 2, 5], 4, 10.0).unwrap();
        v[0].rotary_embedding(&cos, &sin)
    };
    repeat_interleave_heads: [signed(&[2, 3, 2, 4])] => |v| v[0].repeat_interleave(2, 2);
    repeat_interleave_last: [signed(&[3, 2])] => |v| v[0].repeat_interleave(3, 1);
    where_cond: [index(&[3, 1], 2), signed(&[3, 4]), signed(&[4])] => |v| v[0].cast(DType::U8)?.where_cond(&v[1], &v[2]);
    masked_fill: [signed(&[3, 4]), index(&[4], 2)] => |v| v[0].masked_fill(&v[1].cast(DType::U8)?, 7.0);
    index_select: [signed(&[4, 3]), index(&[6], 4)] => |v| v[0].index_select(0, &v[1]);
    index_select_inner: [signed(&[2, 5, 3]), index(&[4], 5)] => |v| v[0].index_select(1, &v[1]);
    gather: [signed(&[3, 5]), index(&[3, 4], 5)] => |v| v[0].gather(1, &v[1]);
    split_pieces: [signed(&[5, 3])] => |v| {
        let p = v[0].split(2, 0)?;
        Var::cat(&[&p[2], &p[0].mul_scalar(2.0)?, &p[1]], 0)
    };
    chunk_pieces: [signed(&[2, 7])] => |v| {
        let p = v[0].chunk(3, 1)?;
        p[0].sum(&[1], true)?.add(&p[2].mul_scalar(3.0)?.sum(&[1], true)?)
    };
    stack: [signed(&[3, 2]), signed(&[3, 2])] => |v| Var::stack(&[&v[0], &v[1].mul_scalar(0.5)?, &v[0]], 1);
    embedding: [signed(&[6, 3]), index(&[2, 5], 6)] => |v| v[0].embedding(&v[1]);
    embedding_flat: [signed(&[4, 2]), index(&[9], 4)] => |v| v[0].embedding(&v[1]);
    cross_entropy_mean: [signed(&[4, 5]), index(&[4], 5)] => |v| v[0].mul_scalar(2.0)?.cross_entropy(&v[1], Mean);
    cross_entropy_sum: [signed(&[4, 5]), index(&[4], 5)] => |v| v[0].mul_scalar(2.0)?.cross_entropy(&v[1], Sum);
    cross_entropy_3d: [signed(&[2, 3, 5]), index(&[2, 3], 5)] => |v| v[0].cross_entropy(&v[1], Mean);
}

/// The `Distinct` values really have no near-ties, and the index inputs really repeat
/// (so the embedding checks cover accumulation into one row).
#[test]
fn inputs_are_what_the_checks_assume() {
    let t = distinct(&[2, 3, 4]).make(1).to_f64_vec();
    for (i, a) in t.iter().enumerate() {
        for b in &t[i + 1..] {
            assert!((a - b).abs() > 0.1, "{a} and {b} are too close for max");
        }
    }
    let idx = index(&[2, 5], 6).make(12).to_vec::<i64>().unwrap();
    let mut seen = idx.clone();
    seen.sort_unstable();
    seen.dedup();
    assert!(seen.len() < idx.len(), "indices {idx:?} never repeat");
    assert_eq!(index(&[2, 5], 6).make(12).dtype(), DType::I64);
}

/// The check itself catches a rule that is slightly off, and an input left without
/// a gradient (an op whose rule returns `None` for it).
#[test]
fn the_check_catches_wrong_rules() {
    let slightly_off = |v: &[Var]| -> Result<Var> {
        let y = v[0].value().exp()?;
        let out = y.clone();
        Ok(Var::from_op("bad_exp", y, &[&v[0]], move |g| {
            Ok([Some(g.mul(&out)?.mul_scalar(1.0 + 1e-4)?)].into_iter().collect())
        }))
    };
    let found = failures(&[signed(&[2, 3])], slightly_off);
    assert!(found.len() == 1 && found[0].contains("max error"), "{found:?}");
    let dropped = |v: &[Var]| -> Result<Var> {
        let y = v[0].value().add(v[1].value())?;
        Ok(Var::from_op("bad_add", y, &[&v[0], &v[1]], |g| {
            Ok([Some(g.clone()), None].into_iter().collect())
        }))
    };
    let found = failures(&[signed(&[2, 3]), signed(&[2, 3])], dropped);
    assert!(
        found.len() == 1 && found[0].contains("input 1 got no gradient"),
        "{found:?}"
    );
}
