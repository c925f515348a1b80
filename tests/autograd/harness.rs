//! Launching ranks, deterministic test values, and comparing gradients.

use std::sync::{Mutex, PoisonError};

use tessera::autograd::nn::ParameterDict;
use tessera::autograd::{Param, Var};
use tessera::dtensor::{Placement, Tensor, distribute_tensor};
use tessera::{BoxError, DeviceMesh, launch};

/// What a rank's closure returns.
pub(crate) type R<T> = Result<T, BoxError>;

/// One multi-rank launch at a time: the CI has two cores, and several 4-rank jobs at
/// once only make every one of them slower. One-rank jobs run freely.
static LAUNCH: Mutex<()> = Mutex::new(());

/// Runs `f` on every rank of a fresh mesh of `mesh_shape` and returns every rank's
/// result, or the launch's error (naming the rank that failed and why).
pub(crate) fn try_on_mesh<T, F>(mesh_shape: &[usize], f: F) -> Result<Vec<T>, String>
where
    T: Send + 'static,
    F: Fn(&DeviceMesh) -> R<T> + Send + Sync + 'static,
{
    let n: usize = mesh_shape.iter().product();
    let _one = (n > 1).then(|| LAUNCH.lock().unwrap_or_else(PoisonError::into_inner));
    let shape = mesh_shape.to_vec();
    launch(n, move |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), &shape)?;
        f(&mesh)
    })
    .map_err(|e| format!("launch on mesh {mesh_shape:?} failed: {e}"))
}

/// [`try_on_mesh`], failing the test on an error.
pub(crate) fn on_mesh<T, F>(mesh_shape: &[usize], f: F) -> Vec<T>
where
    T: Send + 'static,
    F: Fn(&DeviceMesh) -> R<T> + Send + Sync + 'static,
{
    try_on_mesh(mesh_shape, f).unwrap_or_else(|e| panic!("{e}"))
}

/// SplitMix64: the same values on every rank and every run.
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform on `[lo, hi)`.
    pub(crate) fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform on `[-1, 1)`.
    pub(crate) fn signed(&mut self) -> f64 {
        self.uniform(-1.0, 1.0)
    }

    /// Uniform on `0..n`.
    pub(crate) fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// An f64 tensor of `shape` with values `f(rng)`.
pub(crate) fn values(shape: &[usize], seed: u64, mut f: impl FnMut(&mut Rng) -> f64) -> Tensor {
    let mut rng = Rng::new(seed);
    let n: usize = shape.iter().product();
    let v: Vec<f64> = (0..n).map(|_| f(&mut rng)).collect();
    // INVARIANT: the length is the shape's element count.
    Tensor::from_vec(v, shape).expect("valid shape")
}

/// An f64 tensor of `shape` uniform on `[-1, 1)`.
pub(crate) fn uniform(shape: &[usize], seed: u64) -> Tensor {
    values(shape, seed, Rng::signed)
}

/// An i64 tensor of `shape` with values in `0..n`.
pub(crate) fn indices(shape: &[usize], n: usize, seed: u64) -> Tensor {
    let mut rng = Rng::new(seed);
    let count: usize = shape.iter().product();
    let v: Vec<i64> = (0..count).map(|_| rng.below(n) as i64).collect();
    // INVARIANT: the length is the shape's element count.
    Tensor::from_vec(v, shape).expect("valid shape")
}

/// `Replicate` on every one of `n` mesh dims.
pub(crate) fn replicate(n: usize) -> Vec<Placement> {
    vec![Placement::Replicate; n]
}

/// A parameter holding `full` distributed with `placements`.
pub(crate) fn param(name: &str, full: &Tensor, mesh: &DeviceMesh, placements: &[Placement]) -> R<Param> {
    let p = Param::new(distribute_tensor(full, mesh, placements)?);
    ParameterDict::new([(name, p.clone())])?;
    Ok(p)
}

/// A constant holding `full` distributed with `placements`.
pub(crate) fn constant(full: &Tensor, mesh: &DeviceMesh, placements: &[Placement]) -> R<Var> {
    Ok(Var::constant(distribute_tensor(full, mesh, placements)?))
}

/// A parameter's leaf, redistributed to replicated when it is stored otherwise
/// (so the backward of that redistribute is what brings its gradient home).
pub(crate) fn gathered(p: &Param) -> tessera::autograd::Result<Var> {
    let v = p.var()?;
    if v.value().placements().iter().all(|p| p.is_replicate()) {
        Ok(v)
    } else {
        v.redistribute(&replicate(v.value().placements().len()))
    }
}

/// The value of a scalar var, on every rank.
pub(crate) fn scalar(v: &Var) -> R<f64> {
    Ok(v.value().full_tensor()?.to_f64_vec()[0])
}

/// The full gradient of `p`, or an error naming it.
pub(crate) fn full_grad(p: &Param) -> R<Tensor> {
    let g = p
        .grad()
        .ok_or_else(|| format!("parameter {} has no gradient", p.name()))?;
    Ok(g.full_tensor()?)
}

/// `Σ x·r` over every element (`r` broadcast to `x`'s shape).
pub(crate) fn weighted_sum(x: &Var, r: &Var) -> tessera::autograd::Result<Var> {
    let y = x.mul(r)?;
    let dims: Vec<usize> = (0..y.value().shape().len()).collect();
    if dims.is_empty() { Ok(y) } else { y.sum(&dims, false) }
}

/// The largest `|got − want| / max(1, |want|)`, or an error for different shapes or
/// dtypes.
pub(crate) fn max_rel_err(got: &Tensor, want: &Tensor) -> Result<f64, String> {
    if got.shape() != want.shape() || got.dtype() != want.dtype() {
        return Err(format!(
            "shape/dtype {:?} {} where {:?} {} was expected",
            got.shape(),
            got.dtype(),
            want.shape(),
            want.dtype()
        ));
    }
    let err = got
        .to_f64_vec()
        .iter()
        .zip(want.to_f64_vec())
        .map(|(g, w)| {
            let e = (g - w).abs() / w.abs().max(1.0);
            if e.is_nan() { f64::INFINITY } else { e }
        })
        .fold(0.0, f64::max);
    Ok(err)
}
