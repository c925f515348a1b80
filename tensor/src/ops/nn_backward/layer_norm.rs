//! Layer norm's backward kernels: the input gradient and the weight gradient,
//! with the row statistics recomputed from the input or the forward's.

use tessera_mesh::DType;

use super::dot_f64;
use crate::kernel::Simd;
use crate::kernel::{Float, float_dispatch, par_columns};
use crate::ops::reduce::sum_map_f64;
use crate::ops::rows::{all_row_stats, filled, map_rows, row_stats};
use crate::ops::{elements, output, same_shape};
use crate::{Error, Result, Tensor};

impl Tensor {
    /// The gradient of [`layer_norm`](Self::layer_norm) with respect to its input
    /// `x`, given the gradient `self` of its output:
    /// `rstd · (ĝ − mean(ĝ) − x̂ · mean(ĝ · x̂))` with `ĝ = self · weight` and
    /// `x̂ = (x − mean) · rstd`, per row of the last dim, with the statistics
    /// recomputed from `x` in `f64` (as the forward computes them) and the result
    /// rounded once. PyTorch: the input gradient of `torch.ops.aten.native_layer_norm_backward`.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] when the shapes differ or `weight` is not `[D]`;
    /// [`Error::DTypeMismatch`]; [`Error::InvalidArgument`] for rank-0 or integer tensors.
    pub fn layer_norm_backward(&self, x: &Tensor, weight: Option<&Tensor>, eps: f64) -> Result<Tensor> {
        const OP: &str = "layer_norm_backward";
        ln_backward_checks(OP, self, x, weight)?;
        if let Some(out) = super::super::meta_float(OP, &[self, x], x.shape(), self.dtype()) {
            return out;
        }
        #[cfg(feature = "cuda")]
        if self.is_cuda() {
            let (_, mean, rstd) = x.layer_norm_with_stats(None, None, eps)?;
            return crate::cuda::ops::norm_backward(self, x, weight, &mean, &rstd, false);
        }
        float_dispatch!(OP, self.dtype(), T => ln_input_grad::<T>(self, x, weight, #[inline(always)] |_, row| row_stats(row, eps)))
    }

    /// [`layer_norm_backward`](Self::layer_norm_backward) with the row
    /// statistics that [`layer_norm_with_stats`](Self::layer_norm_with_stats)
    /// returned (`f64`) instead of recomputing them from `x`: two passes over
    /// each row fewer, the same bits. PyTorch: the input gradient of
    /// `torch.ops.aten.native_layer_norm_backward`, which takes the forward's
    /// `mean` and `rstd` likewise.
    ///
    /// # Errors
    /// As [`layer_norm_backward`](Self::layer_norm_backward), and
    /// [`Error::ShapeMismatch`] or [`Error::DTypeMismatch`] when `mean` or `rstd`
    /// is not what the forward returns for `x`.
    pub fn layer_norm_backward_with_stats(
        &self,
        x: &Tensor,
        mean: &Tensor,
        rstd: &Tensor,
        weight: Option<&Tensor>,
    ) -> Result<Tensor> {
        const OP: &str = "layer_norm_backward";
        ln_backward_checks(OP, self, x, weight)?;
        if let Some(out) = super::super::meta_float(OP, &[self, x, mean, rstd], x.shape(), self.dtype()) {
            return out;
        }
        #[cfg(feature = "cuda")]
        if self.is_cuda() {
            return crate::cuda::ops::norm_backward(self, x, weight, mean, rstd, false);
        }
        float_dispatch!(OP, self.dtype(), T => {
            let stats = saved_stats(OP, x, mean, rstd)?;
            ln_input_grad::<T>(self, x, weight, #[inline(always)] |r, _| stats[r])
        })
    }

    /// The gradient of [`layer_norm`](Self::layer_norm)'s weight, given the
    /// gradient `self` of its output: `Σ_rows self · x̂`, `[D]` in the dtype of
    /// `x`, with the statistics of `x` recomputed in `f64` and the sum taken in
    /// `f64`. (The bias gradient is `Σ_rows self`, a plain sum.) PyTorch: the
    /// weight gradient of `torch.ops.aten.native_layer_norm_backward`.
    ///
    /// # Errors
    /// As [`layer_norm_backward`](Self::layer_norm_backward).
    pub fn layer_norm_weight_grad(&self, x: &Tensor, eps: f64) -> Result<Tensor> {
        const OP: &str = "layer_norm_weight_grad";
        ln_backward_checks(OP, self, x, None)?;
        let d = x.shape()[x.rank() - 1];
        if let Some(out) = super::super::meta_float(OP, &[self, x], &[d], self.dtype()) {
            return out;
        }
        #[cfg(feature = "cuda")]
        if self.is_cuda() {
            let (_, mean, rstd) = x.layer_norm_with_stats(None, None, eps)?;
            return crate::cuda::ops::norm_weight_grad(self, x, &mean, &rstd);
        }
        float_dispatch!(OP, self.dtype(), T => {
            let xv = elements::<T>(x)?;
            let stats = if d > 0 { all_row_stats(&xv, d, eps) } else { Vec::new() };
            ln_weight_grad::<T>(self, &xv, d, &stats)
        })
    }

    /// [`layer_norm_weight_grad`](Self::layer_norm_weight_grad) with the row
    /// statistics that [`layer_norm_with_stats`](Self::layer_norm_with_stats)
    /// returned (see [`layer_norm_backward_with_stats`](Self::layer_norm_backward_with_stats)).
    /// PyTorch: the weight gradient of `torch.ops.aten.native_layer_norm_backward`.
    ///
    /// # Errors
    /// As [`layer_norm_backward_with_stats`](Self::layer_norm_backward_with_stats).
    pub fn layer_norm_weight_grad_with_stats(&self, x: &Tensor, mean: &Tensor, rstd: &Tensor) -> Result<Tensor> {
        const OP: &str = "layer_norm_weight_grad";
        ln_backward_checks(OP, self, x, None)?;
        let d = x.shape()[x.rank() - 1];
        if let Some(out) = super::super::meta_float(OP, &[self, x, mean, rstd], &[d], self.dtype()) {
            return out;
        }
        #[cfg(feature = "cuda")]
        if self.is_cuda() {
            let _ = d;
            return crate::cuda::ops::norm_weight_grad(self, x, mean, rstd);
        }
        float_dispatch!(OP, self.dtype(), T => {
            let stats = saved_stats(OP, x, mean, rstd)?;
            ln_weight_grad::<T>(self, &elements::<T>(x)?, d, &stats)
        })
    }
}

/// The checks shared by layer norm's backward kernels: `g` and `x` of one shape
/// and dtype, rank >= 1, and an optional `[D]` weight of that dtype.
fn ln_backward_checks(op: &'static str, g: &Tensor, x: &Tensor, weight: Option<&Tensor>) -> Result<()> {
    same_shape(op, g, x, "the input")?;
    need_rank(op, x)?;
    super::super::rows::check_norm_weight(op, x, weight)
}

/// The per-row `(mean, rstd)` of `x` that [`Tensor::layer_norm_with_stats`]
/// returned, after checking that they have its shape (the input's with the
/// last dim 1) and dtype (`f64`).
fn saved_stats(op: &'static str, x: &Tensor, mean: &Tensor, rstd: &Tensor) -> Result<Vec<(f64, f64)>> {
    let mut want = x.shape().to_vec();
    if let Some(last) = want.last_mut() {
        *last = 1;
    }
    for (name, t) in [("mean", mean), ("rstd", rstd)] {
        if t.shape() != want {
            return Err(Error::ShapeMismatch {
                op,
                detail: format!(
                    "{name} has shape {:?} but an input of shape {:?} has statistics of shape {want:?} \
                     (as layer_norm_with_stats returns them)",
                    t.shape(),
                    x.shape()
                ),
            });
        }
        if t.dtype() != DType::F64 {
            return Err(Error::DTypeMismatch {
                op,
                expected: DType::F64,
                got: t.dtype(),
            });
        }
    }
    let (m, r) = (elements::<f64>(mean)?, elements::<f64>(rstd)?);
    Ok(m.iter().copied().zip(r.iter().copied()).collect())
}

/// Layer norm's input gradient (see [`Tensor::layer_norm_backward`]) with each
/// row's `(mean, rstd)` from `stats(row index, row of x)`; shapes checked.
fn ln_input_grad<T: Float>(
    g: &Tensor,
    x: &Tensor,
    weight: Option<&Tensor>,
    stats: impl Fn(usize, &[T]) -> (f64, f64) + Sync + Copy,
) -> Result<Tensor> {
    const OP: &str = "layer_norm_backward";
    let d = x.shape()[x.rank() - 1];
    let w: Vec<f64> = match weight {
        Some(w) => elements::<T>(w)?.iter().map(|v| v.wide()).collect(),
        None => filled(OP, d, 1.0)?,
    };
    map_rows::<T, [Vec<f64>; 2], 2>(
        OP,
        [g, x],
        x.rank() - 1,
        #[inline(always)]
        |r, [g, x], o, [gw, xhat]| {
            gw.resize(d, 0.0);
            xhat.resize(d, 0.0);
            let (mean, rstd) = stats(r, x);
            for ((a, &g), &w) in gw.iter_mut().zip(g).zip(&w) {
                *a = g.wide() * w;
            }
            for (h, &x) in xhat.iter_mut().zip(x) {
                *h = (x.wide() - mean) * rstd;
            }
            // Sums in eight lanes (vector adds), not one chain of dependent adds.
            let m1 = sum_map_f64(gw, |a| a) / d as f64;
            let m2 = dot_f64::<f64>(gw, xhat) / d as f64;
            for ((o, &a), &h) in o.iter_mut().zip(gw.iter()).zip(xhat.iter()) {
                *o = T::from_wide((a - m1 - h * m2) * rstd);
            }
        },
    )
}

/// Layer norm's weight gradient `Σ_rows g · x̂` (see
/// [`Tensor::layer_norm_weight_grad`]) of `g` over the rows of `xv` (`d` wide)
/// with their `stats`; shapes checked.
fn ln_weight_grad<T: Float>(g: &Tensor, xv: &[T], d: usize, stats: &[(f64, f64)]) -> Result<Tensor> {
    const OP: &str = "layer_norm_weight_grad";
    let gv = elements::<T>(g)?;
    let mut gw = filled(OP, d, 0.0)?;
    if d > 0 {
        // Blocks of columns over the rank's threads: every column sums its rows
        // in order, as on one thread.
        let (simd, gv) = (Simd::best(), &gv[..]);
        par_columns(&mut gw, gv.len(), |c0, cols| {
            simd.run(
                #[inline(always)]
                || {
                    let rows = gv.chunks_exact(d).zip(xv.chunks_exact(d)).zip(stats);
                    for ((g, x), &(mean, rstd)) in rows {
                        for ((a, &g), &x) in cols.iter_mut().zip(&g[c0..]).zip(&x[c0..]) {
                            *a += g.wide() * ((x.wide() - mean) * rstd);
                        }
                    }
                },
            )
        });
    }
    output(gw.into_iter().map(T::from_wide).collect::<Vec<T>>(), &[d])
}

fn need_rank(op: &'static str, t: &Tensor) -> Result<()> {
    if t.rank() >= 1 {
        Ok(())
    } else {
        Err(Error::InvalidArgument {
            op,
            detail: "a rank-0 tensor has no dim to normalize; reshape it to [1] first".into(),
        })
    }
}
