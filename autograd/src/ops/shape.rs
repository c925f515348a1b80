//! View-like ops, reductions and redistribution, with their gradients.

use smallvec::smallvec;
use tessera_dtensor::{DTensor, Placement, ShardOrder};

use super::expand_like;
use crate::{Result, Var};

impl Var {
    /// Swaps two dims.
    ///
    /// # Errors
    /// Dims out of range.
    pub fn transpose(&self, d0: impl tessera_dtensor::Dim, d1: impl tessera_dtensor::Dim) -> Result<Var> {
        let (d0, d1) = (
            d0.resolve("transpose", self.value().shape().len())?,
            d1.resolve("transpose", self.value().shape().len())?,
        );
        Ok(self.unary_op("transpose", self.value().transpose(d0, d1)?, move |g| {
            g.transpose(d0, d1)
        }))
    }

    /// Reorders dims.
    ///
    /// # Errors
    /// Not a permutation.
    pub fn permute(&self, dims: &[impl tessera_dtensor::Dim]) -> Result<Var> {
        let dims = &tessera_tensor::resolve_dims(dims, "permute", self.value().shape().len())?[..];
        let mut inverse = vec![0; dims.len()];
        for (i, &d) in dims.iter().enumerate() {
            if d < inverse.len() {
                inverse[d] = i;
            }
        }
        Ok(self.unary_op("permute", self.value().permute(dims)?, move |g| g.permute(&inverse)))
    }

    /// A new shape with the same elements; one size may be `-1`, inferred from
    /// the element count. PyTorch: `Tensor.reshape` / `view`.
    ///
    /// # Errors
    /// Another element count.
    pub fn reshape(&self, shape: &[impl tessera_dtensor::ShapeSize]) -> Result<Var> {
        let orig = self.value().shape().to_vec();
        Ok(self.unary_op("reshape", self.value().reshape(shape)?, move |g| g.reshape(&orig)))
    }

    /// `len` elements of `dim` from `start`.
    ///
    /// # Errors
    /// A range outside the dim.
    pub fn narrow(&self, dim: impl tessera_dtensor::Dim, start: usize, len: usize) -> Result<Var> {
        let dim = dim.resolve("narrow", self.value().shape().len())?;
        let value = self.value().narrow(dim, start, len)?;
        // Keep only a zero tensor's recipe, not the input (it may be a parameter).
        let (mesh, layout) = (self.value().mesh().clone(), self.value().layout().clone());
        let size = layout.shape[dim];
        Ok(self.unary_op("narrow", value, move |g| {
            if g.placements().iter().any(|p| p.is_shard_on(dim)) {
                let zeros = DTensor::zeros_with_layout(&mesh, &layout)?.full_like_replicated(0.0)?;
                let before = zeros.narrow(dim, 0, start)?;
                let after = zeros.narrow(dim, start + len, size - start - len)?;
                return DTensor::cat(&[&before, g, &after], dim);
            }
            // Zeros placed like `g` (a partial zero is zero on every rank), so a
            // partial gradient stays partial: padding is linear.
            let zeros = |n: usize| {
                let mut shape = g.shape().to_vec();
                shape[dim] = n;
                let l = g.layout();
                let piece = tessera_dtensor::Layout::with_order(
                    &l.mesh_shape,
                    &l.placements,
                    l.order.clone(),
                    &shape,
                    l.dtype,
                )?;
                DTensor::zeros_with_layout(&mesh, &piece)
            };
            DTensor::cat(&[&zeros(start)?, g, &zeros(size - start - len)?], dim)
        }))
    }

    /// Each slice along `dim` repeated `repeats` times in place (see
    /// [`DTensor::repeat_interleave`]); the gradient sums each group.
    ///
    /// PyTorch: `torch.repeat_interleave(x, repeats, dim)` (LLaMA's `repeat_kv`).
    ///
    /// # Errors
    /// As [`DTensor::repeat_interleave`].
    pub fn repeat_interleave(&self, repeats: usize, dim: impl tessera_dtensor::Dim) -> Result<Var> {
        let dim = dim.resolve("repeat_interleave", self.value().shape().len())?;
        let value = self.value().repeat_interleave(repeats, dim)?;
        Ok(self.unary_op("repeat_interleave", value, move |g| {
            g.repeat_interleave_backward(repeats, dim)
        }))
    }

    /// Concatenation along `dim`.
    ///
    /// # Errors
    /// As [`DTensor::cat`].
    pub fn cat(xs: &[&Var], dim: impl tessera_dtensor::Dim) -> Result<Var> {
        // No tensors: any dim resolves, and the missing input is the error below.
        let dim = dim.resolve("cat", xs.first().map_or(usize::MAX, |x| x.value().shape().len()))?;
        let values: Vec<&DTensor> = xs.iter().map(|v| v.value()).collect();
        let value = DTensor::cat(&values, dim)?;
        let sizes: Vec<usize> = values.iter().map(|v| v.shape()[dim]).collect();
        Ok(Var::from_op("cat", value, xs, move |g| {
            let mut at = 0;
            let mut out = smallvec![];
            for &n in &sizes {
                out.push(Some(g.narrow(dim, at, n)?));
                at += n;
            }
            Ok(out)
        }))
    }

    /// Sum over `dims`.
    ///
    /// # Errors
    /// Dims out of range.
    pub fn sum(&self, dims: &[impl tessera_dtensor::Dim], keepdim: bool) -> Result<Var> {
        let dims = &tessera_tensor::resolve_dims(dims, "sum", self.value().shape().len())?[..];
        let x = self.value().clone();
        let value = x.sum(dims, keepdim)?;
        let dims = dims.to_vec();
        Ok(self.unary_op("sum", value, move |g| expand_like(&keep(g, &x, &dims, keepdim)?, &x)))
    }

    /// Mean over `dims`.
    ///
    /// # Errors
    /// Dims out of range.
    pub fn mean(&self, dims: &[impl tessera_dtensor::Dim], keepdim: bool) -> Result<Var> {
        let dims = &tessera_tensor::resolve_dims(dims, "mean", self.value().shape().len())?[..];
        let x = self.value().clone();
        let value = x.mean(dims, keepdim)?;
        let count: usize = dims.iter().map(|&d| x.shape()[d]).product();
        let dims = dims.to_vec();
        Ok(self.unary_op("mean", value, move |g| {
            expand_like(&keep(g, &x, &dims, keepdim)?.div_scalar(count.max(1) as f64)?, &x)
        }))
    }

    /// Maximum over `dims`; the gradient is shared evenly among tied maxima.
    ///
    /// # Errors
    /// Dims out of range or empty.
    pub fn max(&self, dims: &[impl tessera_dtensor::Dim], keepdim: bool) -> Result<Var> {
        let dims = &tessera_tensor::resolve_dims(dims, "max", self.value().shape().len())?[..];
        let x = self.value().clone();
        let value = x.max(dims, keepdim)?;
        let m = value.clone();
        let dims = dims.to_vec();
        Ok(self.unary_op("max", value, move |g| {
            let m = keep(&m, &x, &dims, keepdim)?;
            let hits = x.binary("max_hits", &m, tessera_dtensor::Linearity::None, |x, m| {
                let eq = x.sub(m)?;
                super::map_f64(&eq, |d| if d == 0.0 { 1.0 } else { 0.0 })
            })?;
            let ties = hits.sum(&dims, true)?;
            expand_like(&keep(g, &x, &dims, keepdim)?, &x)?.mul(&hits)?.div(&ties)
        }))
    }

    /// The same value with new placements (default shard order). In backward the
    /// gradient goes back to the input's placements, except that a partial input
    /// gets a replicated gradient; so an all-gather in forward becomes a
    /// reduce-scatter when the gradient arrives partial.
    ///
    /// PyTorch: `DTensor.redistribute` (its autograd function).
    ///
    /// # Errors
    /// As [`DTensor::redistribute`].
    #[track_caller]
    pub fn redistribute(&self, placements: &[Placement]) -> Result<Var> {
        let _site = tessera_mesh::callsite::enter();
        let src = self.value().layout().clone();
        let value = self.value().redistribute(placements)?;
        Ok(self.unary_op("redistribute", value, move |g| {
            let target: Vec<Placement> = src
                .placements
                .iter()
                .map(|p| if p.is_partial() { Placement::Replicate } else { *p })
                .collect();
            let order = if src.has_partial() {
                ShardOrder::default_for(&target)
            } else {
                src.order.clone()
            };
            g.redistribute_with_order(&target, order)
        }))
    }
}

/// `g` (reduced over `dims`) with the reduced dims kept as size 1.
fn keep(g: &DTensor, x: &DTensor, dims: &[usize], keepdim: bool) -> tessera_dtensor::Result<DTensor> {
    if keepdim {
        return Ok(g.clone());
    }
    let shape: Vec<usize> = (0..x.shape().len())
        .map(|d| if dims.contains(&d) { 1 } else { x.shape()[d] })
        .collect();
    g.reshape(&shape)
}
