//! Softmax and layer norm on DTensors, each forward beside its backward rules.

use smallvec::{SmallVec, smallvec};
use tessera_tensor::Error as TensorError;

use super::dispatch;
use crate::strategy::{DimOption, keep_shards_except, keep_shards_except_with, product};
use crate::{DTensor, Error, Placement, ReduceOp, Result};

impl DTensor {
    /// Softmax along `dim` (that dim replicated, other shards kept).
    ///
    /// # Errors
    /// `dim` out of range, integer inputs.
    pub fn softmax(&self, dim: impl tessera_tensor::Dim) -> Result<DTensor> {
        let dim = dim.resolve("softmax", self.shape().len())?;
        let cands = keep_shards_except(self.shape().len(), &[dim], self.mesh().ndim());
        dispatch("softmax", &[self], &cands, self.shape(), self.dtype(), |l, _| {
            Ok(l[0].softmax(dim)?)
        })
    }

    /// Log-softmax along `dim` (that dim replicated, other shards kept).
    ///
    /// # Errors
    /// `dim` out of range, integer inputs.
    pub fn log_softmax(&self, dim: impl tessera_tensor::Dim) -> Result<DTensor> {
        let dim = dim.resolve("log_softmax", self.shape().len())?;
        let cands = keep_shards_except(self.shape().len(), &[dim], self.mesh().ndim());
        dispatch("log_softmax", &[self], &cands, self.shape(), self.dtype(), |l, _| {
            Ok(l[0].log_softmax(dim)?)
        })
    }

    /// Layer norm over the last dim with optional `[D]` affine weight and bias
    /// (replicated); the last dim is replicated, other shards kept.
    ///
    /// # Errors
    /// Shapes or dtypes that do not fit.
    pub fn layer_norm(&self, weight: Option<&DTensor>, bias: Option<&DTensor>, eps: f64) -> Result<DTensor> {
        Ok(self.layer_norm_with_stats(weight, bias, eps)?.0)
    }

    /// [`layer_norm`](Self::layer_norm), also returning the per-row `mean` and
    /// `rstd` its backward takes ([`Tensor::layer_norm_with_stats`](crate::Tensor::layer_norm_with_stats)): shaped as
    /// the input with the last dim 1, placed as the output.
    ///
    /// PyTorch: `torch.native_layer_norm` on DTensors.
    ///
    /// # Errors
    /// As [`layer_norm`](Self::layer_norm).
    pub fn layer_norm_with_stats(
        &self,
        weight: Option<&DTensor>,
        bias: Option<&DTensor>,
        eps: f64,
    ) -> Result<(DTensor, DTensor, DTensor)> {
        let r = self.shape().len();
        if r == 0 {
            return Err(Error::from(TensorError::InvalidArgument {
                op: "layer_norm",
                detail: "the input must have rank ≥ 1".into(),
            }));
        }
        let mut inputs: SmallVec<[&DTensor; 3]> = smallvec![self];
        inputs.extend(weight);
        inputs.extend(bias);
        let cands = keep_shards_except_with(r, &[r - 1], 1, inputs.len() - 1, self.mesh().ndim());
        let mut stats = None;
        let out = dispatch("layer_norm", &inputs, &cands, self.shape(), self.dtype(), |l, _| {
            let w = weight.map(|_| &l[1]);
            let b = bias.map(|_| &l[1 + usize::from(weight.is_some())]);
            let (out, mean, rstd) = l[0].layer_norm_with_stats(w, b, eps)?;
            stats = Some((mean, rstd));
            Ok(out)
        })?;
        let mut stat_shape = self.shape().to_vec();
        stat_shape[r - 1] = 1;
        // INVARIANT: the kernel ran (dispatch returned its output).
        let (mean, rstd) = stats.expect("the kernel ran");
        let place = |t| DTensor::from_local(t, self.mesh(), out.placements(), &stat_shape);
        let (mean, rstd) = (place(mean)?, place(rstd)?);
        Ok((out, mean, rstd))
    }

    /// `y · (g − Σ_dim g·y)`, the input gradient of a softmax with output `y`, in one
    /// pass per row, for the gradient `self`; sharded like `y` off `dim`
    /// (see [`Tensor::softmax_backward`](crate::Tensor::softmax_backward)).
    ///
    /// # Errors
    /// Shapes or dtypes that differ, a dim out of range.
    ///
    /// PyTorch: `torch.ops.aten._softmax_backward_data`.
    pub fn softmax_backward(&self, y: &DTensor, dim: impl tessera_tensor::Dim) -> Result<DTensor> {
        let dim = dim.resolve("softmax_backward", self.shape().len())?;
        let g = self;
        let cands = keep_shards_except_with(y.shape().len(), &[dim], 2, 0, y.mesh().ndim());
        dispatch("softmax_backward", &[g, y], &cands, y.shape(), y.dtype(), |l, _| {
            Ok(l[0].softmax_backward(&l[1], dim)?)
        })
    }

    /// The input gradient of layer norm over the last dim from the forward's row
    /// statistics `[mean, rstd]` (see [`Tensor::layer_norm_backward_with_stats`](crate::Tensor::layer_norm_backward_with_stats)),
    /// for the gradient `self`, sharded like `x` off the last dim, with the weight replicated.
    ///
    /// # Errors
    /// Shapes or dtypes that do not fit, a failed redistribution.
    pub fn layer_norm_backward_with_stats(
        &self,
        x: &DTensor,
        mean: &DTensor,
        rstd: &DTensor,
        w: Option<&DTensor>,
    ) -> Result<DTensor> {
        let g = self;
        let last = x.shape().len() - 1;
        let cands = keep_shards_except_with(last + 1, &[last], 4, usize::from(w.is_some()), x.mesh().ndim());
        let mut inputs: SmallVec<[&DTensor; 5]> = smallvec![g, x, mean, rstd];
        inputs.extend(w);
        dispatch("layer_norm_backward", &inputs, &cands, x.shape(), x.dtype(), |l, _| {
            Ok(l[0].layer_norm_backward_with_stats(&l[1], &l[2], &l[3], l.get(4))?)
        })
    }

    /// The weight gradient of layer norm, `Σ_rows g · x̂`, from the forward's row
    /// statistics (see [`Tensor::layer_norm_weight_grad_with_stats`](crate::Tensor::layer_norm_weight_grad_with_stats)): a partial
    /// sum when the rows are sharded; `self` is the output's gradient.
    ///
    /// # Errors
    /// Shapes or dtypes that do not fit, a failed redistribution.
    pub fn layer_norm_weight_grad_with_stats(&self, x: &DTensor, mean: &DTensor, rstd: &DTensor) -> Result<DTensor> {
        let g = self;
        let (r, s) = (Placement::Replicate, Placement::Shard);
        let last = x.shape().len() - 1;
        let mut options: Vec<DimOption> = vec![(smallvec![r, r, r, r], r)];
        options.extend((0..last).map(|d| (smallvec![s(d), s(d), s(d), s(d)], Placement::Partial(ReduceOp::Sum))));
        let cands = product(&vec![options; x.mesh().ndim()], 4);
        dispatch(
            "layer_norm_weight_grad",
            &[g, x, mean, rstd],
            &cands,
            &[x.shape()[last]],
            x.dtype(),
            |l, _| Ok(l[0].layer_norm_weight_grad_with_stats(&l[1], &l[2], &l[3])?),
        )
    }

    /// RMSNorm over the last dim with an optional `[D]` weight (replicated);
    /// the last dim is replicated, other shards kept.
    /// PyTorch: `torch.nn.functional.rms_norm` on DTensors.
    ///
    /// # Errors
    /// Shapes or dtypes that do not fit.
    pub fn rms_norm(&self, weight: Option<&DTensor>, eps: f64) -> Result<DTensor> {
        Ok(self.rms_norm_with_stats(weight, eps)?.0)
    }

    /// [`rms_norm`](Self::rms_norm), also returning the per-row
    /// `rstd` its backward takes (shaped as the input with the last dim 1,
    /// placed as the output). See [`Tensor::rms_norm_with_stats`](crate::Tensor::rms_norm_with_stats).
    ///
    /// PyTorch: `torch.nn.functional.rms_norm` on DTensors.
    ///
    /// # Errors
    /// Shapes or dtypes that do not fit.
    pub fn rms_norm_with_stats(&self, weight: Option<&DTensor>, eps: f64) -> Result<(DTensor, DTensor)> {
        let r = self.shape().len();
        if r == 0 {
            return Err(Error::from(TensorError::InvalidArgument {
                op: "rms_norm",
                detail: "the input must have rank ≥ 1".into(),
            }));
        }
        let mut inputs: SmallVec<[&DTensor; 2]> = smallvec![self];
        inputs.extend(weight);
        let cands = keep_shards_except_with(r, &[r - 1], 1, inputs.len() - 1, self.mesh().ndim());
        let mut stats = None;
        let out = dispatch("rms_norm", &inputs, &cands, self.shape(), self.dtype(), |l, _| {
            let (out, rstd) = l[0].rms_norm_with_stats(l.get(1), eps)?;
            stats = Some(rstd);
            Ok(out)
        })?;
        let mut stat_shape = self.shape().to_vec();
        stat_shape[r - 1] = 1;
        // INVARIANT: the kernel ran (dispatch returned its output).
        let rstd = stats.expect("the kernel ran");
        let rstd = DTensor::from_local(rstd, self.mesh(), out.placements(), &stat_shape)?;
        Ok((out, rstd))
    }

    /// The input gradient of RMSNorm from the forward's `rstd` (see
    /// [`Tensor::rms_norm_backward_with_stats`](crate::Tensor::rms_norm_backward_with_stats)),
    /// for the gradient `self`, sharded like `x` off the last dim, the weight replicated.
    ///
    /// # Errors
    /// Shapes or dtypes that do not fit, a failed redistribution.
    pub fn rms_norm_backward_with_stats(&self, x: &DTensor, rstd: &DTensor, w: Option<&DTensor>) -> Result<DTensor> {
        let last = x.shape().len() - 1;
        let cands = keep_shards_except_with(last + 1, &[last], 3, usize::from(w.is_some()), x.mesh().ndim());
        let mut inputs: SmallVec<[&DTensor; 4]> = smallvec![self, x, rstd];
        inputs.extend(w);
        dispatch("rms_norm_backward", &inputs, &cands, x.shape(), x.dtype(), |l, _| {
            Ok(l[0].rms_norm_backward_with_stats(&l[1], &l[2], l.get(3))?)
        })
    }

    /// The weight gradient of RMSNorm, `Σ_rows g · x̂` (see
    /// [`Tensor::rms_norm_weight_grad_with_stats`](crate::Tensor::rms_norm_weight_grad_with_stats)):
    /// a partial sum when the rows are sharded; `self` is the output's gradient.
    ///
    /// # Errors
    /// Shapes or dtypes that do not fit, a failed redistribution.
    pub fn rms_norm_weight_grad_with_stats(&self, x: &DTensor, rstd: &DTensor) -> Result<DTensor> {
        let (r, s) = (Placement::Replicate, Placement::Shard);
        let last = x.shape().len() - 1;
        let mut options: Vec<DimOption> = vec![(smallvec![r, r, r], r)];
        options.extend((0..last).map(|d| (smallvec![s(d), s(d), s(d)], Placement::Partial(ReduceOp::Sum))));
        let cands = product(&vec![options; x.mesh().ndim()], 3);
        dispatch(
            "rms_norm_weight_grad",
            &[self, x, rstd],
            &cands,
            &[x.shape()[last]],
            x.dtype(),
            |l, _| Ok(l[0].rms_norm_weight_grad_with_stats(&l[1], &l[2])?),
        )
    }
}
