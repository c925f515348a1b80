//! Helpers shared by the kernels' unit tests.

use tessera_mesh::DType;

use crate::Tensor;

/// A float tensor of `shape` with standard normal values.
pub(crate) fn sample(shape: &[usize], dtype: DType, seed: u64) -> Tensor {
    Tensor::randn(shape, dtype, seed).unwrap()
}

/// A relative tolerance for results rounded to `dtype` from an exact reference.
pub(crate) fn tol(dtype: DType) -> f64 {
    match dtype {
        DType::F64 => 1e-14,
        DType::F32 => 2e-7,
        DType::BF16 => 8e-3,
        _ => 1e-3,
    }
}

/// Asserts `|got - want| <= rtol * (1 + |want|)` element-wise (NaN matches NaN,
/// equal infinities match).
pub(crate) fn assert_close(got: &Tensor, want: &[f64], rtol: f64, what: &str) {
    let g = got.to_f64_vec();
    assert_eq!(g.len(), want.len(), "{what}: length");
    for (i, (&x, &y)) in g.iter().zip(want).enumerate() {
        let ok = (x.is_nan() && y.is_nan()) || x == y || (x - y).abs() <= rtol * (1.0 + y.abs());
        assert!(ok, "{what}: element {i}: got {x}, want {y}");
    }
}
