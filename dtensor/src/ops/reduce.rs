//! Reductions on DTensors: a reduced sharded dim gives a partial result.

use tessera_tensor::Error as TensorError;

use super::dispatch;
use crate::strategy::reduction;
use crate::{DTensor, Error, ReduceOp, Result, Tensor};

impl DTensor {
    /// Sum over `dims`: a sharded reduced dim gives `Partial(sum)`.
    ///
    /// # Errors
    /// Dims out of range, integer inputs.
    pub fn sum(&self, dims: &[impl tessera_tensor::Dim], keepdim: bool) -> Result<DTensor> {
        let dims = &tessera_tensor::resolve_dims(dims, "sum", self.shape().len())?[..];
        let out = reduced_shape("sum", self.shape(), dims, keepdim)?;
        let cands = reduction(self.shape().len(), dims, keepdim, ReduceOp::Sum, self.mesh().ndim());
        dispatch("sum", &[self], &cands, &out, self.dtype(), |l, _| {
            Ok(l[0].sum(dims, keepdim)?)
        })
    }

    /// Mean over `dims`: each rank sums its piece and scales by the global count, so
    /// a sharded reduced dim gives `Partial(sum)` of exact partial means, uneven shards included.
    ///
    /// # Errors
    /// Dims out of range, integer inputs.
    pub fn mean(&self, dims: &[impl tessera_tensor::Dim], keepdim: bool) -> Result<DTensor> {
        let dims = &tessera_tensor::resolve_dims(dims, "mean", self.shape().len())?[..];
        let out = reduced_shape("mean", self.shape(), dims, keepdim)?;
        let count: usize = dims.iter().map(|&d| self.shape()[d]).product();
        let cands = reduction(self.shape().len(), dims, keepdim, ReduceOp::Sum, self.mesh().ndim());
        dispatch("mean", &[self], &cands, &out, self.dtype(), |l, _| {
            Ok(l[0].sum(dims, keepdim)?.mul_scalar(1.0 / count as f64)?)
        })
    }

    /// Maximum over `dims`: a sharded reduced dim gives `Partial(max)` (a rank with
    /// an empty piece contributes −∞).
    ///
    /// # Errors
    /// Dims out of range, an empty reduced dim, integer inputs.
    pub fn max(&self, dims: &[impl tessera_tensor::Dim], keepdim: bool) -> Result<DTensor> {
        let dims = &tessera_tensor::resolve_dims(dims, "max", self.shape().len())?[..];
        let out = reduced_shape("max", self.shape(), dims, keepdim)?;
        if let Some(&d) = dims.iter().find(|&&d| self.shape()[d] == 0) {
            return Err(Error::from(TensorError::InvalidArgument {
                op: "max",
                detail: format!("cannot take the max over dim {d} of size 0 in {:?}", self.shape()),
            }));
        }
        let cands = reduction(self.shape().len(), dims, keepdim, ReduceOp::Max, self.mesh().ndim());
        dispatch("max", &[self], &cands, &out, self.dtype(), |l, _| {
            if dims.iter().any(|&d| l[0].shape()[d] == 0) {
                let shape = reduced_shape("max", l[0].shape(), dims, keepdim)?;
                return Ok(Tensor::full(&shape, f64::NEG_INFINITY, l[0].dtype())?.to(l[0].device())?);
            }
            Ok(l[0].max(dims, keepdim)?)
        })
    }
}

/// The shape after reducing `dims`.
pub(crate) fn reduced_shape(op: &'static str, shape: &[usize], dims: &[usize], keepdim: bool) -> Result<Vec<usize>> {
    if let Some(&d) = dims.iter().find(|&&d| d >= shape.len()) {
        return Err(Error::from(TensorError::DimOutOfRange {
            op,
            dim: d,
            rank: shape.len(),
        }));
    }
    Ok(shape
        .iter()
        .enumerate()
        .filter_map(|(i, &s)| match (dims.contains(&i), keepdim) {
            (false, _) => Some(s),
            (true, true) => Some(1),
            (true, false) => None,
        })
        .collect())
}
