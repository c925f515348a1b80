//! Neural-network ops: softmax, log-softmax, layer norm, embedding, cross
//! entropy and the causal attention mask.

use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicU64, Ordering};

use tessera_mesh::{DType, Element};

use super::reduce::{row_max, sum_map_f64};
use super::rows::{all_row_stats, causal_keep, ce_targets, check_scores, map_rows, need_dims, row_exp_sum};
use super::{check_dim, elements, output, same_dtype};
use crate::kernel::{Float, Real, any_dispatch, float_dispatch};
use crate::kernel::{Simd, exp, zip_map_inline};
use crate::{Error, Result, Tensor};

/// How [`Tensor::cross_entropy`] combines the per-row losses.
/// PyTorch: the `reduction` argument (`'mean'`, `'sum'`, `'none'`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Reduction {
    /// The mean over rows (NaN for no rows), a rank-0 tensor.
    #[default]
    Mean,
    /// The sum over rows, a rank-0 tensor.
    Sum,
    /// One loss per row, shape `[N]`.
    None,
}

/// Per-thread scratch of [`attention_probs_row`]: the scaled row, then its exponentials.
pub(super) type ProbsScratch<T> = (Vec<T>, Vec<<T as Float>::Acc>);

/// One row of [`Tensor::attention_probs`]: `out` gets the softmax of `scale ·
/// row` over its first `keep` keys and exact zeros after. For row kernels
/// inside [`Simd::run`].
#[inline(always)]
pub(super) fn attention_probs_row<T: Float>(
    keep: usize,
    scale: T::Acc,
    row: &[T],
    out: &mut [T],
    scratch: &mut ProbsScratch<T>,
) {
    #[cfg(target_arch = "x86_64")]
    if T::DTYPE == DType::F32 && vector_rows(row.len()) {
        assert_eq!(row.len(), out.len(), "attention_probs_row: row and output lengths");
        // SAFETY: `T` is `f32` (checked), AVX-512F and whole groups of eight
        // keys (checked), one row of `row.len()` keys in and out.
        unsafe {
            softmax_avx512::rows::<1>(
                [keep],
                scale.widen() as f32,
                row.as_ptr().cast(),
                out.as_mut_ptr().cast(),
                row.len(),
            )
        };
        return;
    }
    probs_row_generic(keep, scale, row, out, scratch);
}

/// [`attention_probs_row`] over every row of `rows` (`s` keys each; row `i`
/// is query `i`, which keeps `causal_keep(is_causal, i, s)` keys), into the
/// rows of `out`. `f32` rows run four at a time: each row's passes are a
/// chain of dependent steps (its maximum before its exponentials, their sum
/// before the division), which four independent rows overlap.
#[inline(always)]
pub(super) fn attention_probs_rows<T: Float>(
    is_causal: bool,
    scale: T::Acc,
    rows: &[T],
    out: &mut [T],
    s: usize,
    scratch: &mut ProbsScratch<T>,
) {
    assert_eq!(rows.len(), out.len(), "attention_probs_rows: rows and output lengths");
    #[cfg(target_arch = "x86_64")]
    if T::DTYPE == DType::F32 && s > 0 && vector_rows(s) {
        let n = rows.len() / s;
        let (src, dst) = (rows.as_ptr().cast::<f32>(), out.as_mut_ptr().cast::<f32>());
        let scale = scale.widen() as f32;
        let mut q = 0;
        // SAFETY: `T` is `f32` (checked), AVX-512F and whole groups of eight
        // keys (checked); rows q.. of `s` keys lie inside both slices (equal
        // lengths, asserted above, of `n` rows).
        unsafe {
            while q + 4 <= n {
                let keep = std::array::from_fn(|r| causal_keep(is_causal, q + r, s));
                softmax_avx512::rows::<4>(keep, scale, src.add(q * s), dst.add(q * s), s);
                q += 4;
            }
            for q in q..n {
                softmax_avx512::rows::<1>([causal_keep(is_causal, q, s)], scale, src.add(q * s), dst.add(q * s), s);
            }
        }
        return;
    }
    for (q, (x, y)) in rows.chunks_exact(s).zip(out.chunks_exact_mut(s)).enumerate() {
        probs_row_generic(causal_keep(is_causal, q, s), scale, x, y, scratch);
    }
}

/// Whether an `f32` softmax row of `len` keys runs the AVX-512 kernel
/// ([`softmax_avx512::rows`]): AVX-512F and whole groups of eight keys.
pub(super) fn vector_rows(len: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    return softmax_avx512::fits(len);
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = len;
        false
    }
}

/// [`attention_probs_row`] for any float type: the scaled row, its maximum,
/// the exponentials, their sum and the weights, one pass each.
#[inline(always)]
pub(super) fn probs_row_generic<T: Float>(
    keep: usize,
    scale: T::Acc,
    row: &[T],
    out: &mut [T],
    (scaled, e): &mut ProbsScratch<T>,
) {
    // The scaled row rounded to the dtype (as `mul_scalar` leaves it), then
    // its exponentials in the compute type.
    scaled.resize(keep, T::default());
    let scaled = &mut scaled[..keep];
    zip_map_inline(
        &row[..keep],
        &row[..keep],
        scaled,
        #[inline(always)]
        |x, _| T::from_acc(x.to_acc() * scale),
    );
    let max = row_max(scaled);
    // The full row's sum adds the masked keys' zeros to its eight lanes, which
    // leaves them as they are: summing up to the end of the last group of eight
    // that holds a kept key gives the same bits (the full row's tail of fewer
    // than eight, if any, is then all zeros and adds nothing either).
    let whole = row.len() / 8 * 8;
    let upto = match keep.next_multiple_of(8) {
        k if k <= whole => k,
        _ => row.len(),
    };
    e.clear();
    e.resize(upto, T::Acc::ZERO);
    zip_map_inline(
        scaled,
        scaled,
        &mut e[..keep],
        #[inline(always)]
        |x, _| exp(x.to_acc() - max),
    );
    let inv = 1.0 / sum_map_f64(e, |v| v.widen());
    for (o, &v) in out.iter_mut().zip(&e[..keep]) {
        *o = T::from_wide(v.widen() * inv);
    }
    // A masked key's weight, `0 · inv` as for the full row (NaN when `inv` is).
    out[keep..].fill(T::from_wide(0.0 * inv));
}

/// Checks an optional `[D]` affine parameter of layer norm.
fn check_affine(x: &Tensor, p: Option<&Tensor>, name: &str) -> Result<()> {
    let Some(p) = p else { return Ok(()) };
    same_dtype("layer_norm", x, p)?;
    let d = x.shape()[x.rank() - 1];
    if p.shape() != [d] {
        return Err(Error::ShapeMismatch {
            op: "layer_norm",
            detail: format!(
                "{name} has shape {:?} but input {:?} normalizes a last dim of {d}; pass a [{d}] {name}",
                p.shape(),
                x.shape()
            ),
        });
    }
    Ok(())
}

/// Layer norm over the last dim in `f64`: output, and per-row mean and rstd.
fn layer_norm_typed<T: Float>(
    x: &Tensor,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    eps: f64,
) -> Result<(Tensor, Tensor, Tensor)> {
    let d = x.shape()[x.rank() - 1];
    let xs = elements::<T>(x)?;
    // The affine parameters in f64 (1 and 0 when absent: exact no-ops).
    let affine = |p: Option<&Tensor>, default: f64| -> Result<Vec<f64>> {
        Ok(match p {
            Some(p) => elements::<T>(p)?.iter().map(|v| v.wide()).collect(),
            None => super::rows::filled("layer_norm", d, default)?,
        })
    };
    let (w, b) = (affine(weight, 1.0)?, affine(bias, 0.0)?);
    let rows = xs.len().checked_div(d).unwrap_or(0);
    // Every element is written below: a recycled buffer needs no zeroing.
    let mut out: Vec<T> = crate::alloc::reused("layer_norm", x.shape())?;
    let (mut means, mut rstds) = (Vec::with_capacity(rows), Vec::with_capacity(rows));
    if d > 0 {
        let stats = all_row_stats(&xs, d, eps);
        // Blocks of rows over the rank's threads.
        let (simd, xs, w, b, stats) = (Simd::best(), &xs[..], &w[..], &b[..], &stats[..]);
        crate::kernel::par_rows(&mut out, d, |start, block| {
            simd.run(
                #[inline(always)]
                || {
                    let rows = xs[start..].chunks_exact(d).zip(&stats[start / d..]);
                    for ((row, &(mean, rstd)), o) in rows.zip(block.chunks_exact_mut(d)) {
                        for (((o, &v), &w), &b) in o.iter_mut().zip(row).zip(w).zip(b) {
                            *o = <T as Float>::from_wide((v.wide() - mean) * rstd * w + b);
                        }
                    }
                },
            )
        });
        means.extend(stats.iter().map(|s| s.0));
        rstds.extend(stats.iter().map(|s| s.1));
    }
    let mut stat_shape = x.shape().to_vec();
    if let Some(last) = stat_shape.last_mut() {
        *last = 1;
    }
    if d == 0 {
        // An empty input can still have many rows (`[n, 0]`).
        means = crate::alloc::with_capacity("layer_norm", &stat_shape)?;
        // Allocated above, so the product fits.
        means.resize(stat_shape.iter().product(), f64::NAN);
        rstds = crate::alloc::with_capacity("layer_norm", &stat_shape)?;
        rstds.clone_from(&means);
    }
    Ok((
        output(out, x.shape())?,
        output(means, &stat_shape)?,
        output(rstds, &stat_shape)?,
    ))
}

impl Tensor {
    /// Softmax along `dim`, max-subtracted (stable): `exp(x - max) / Σ exp(x - max)`,
    /// with the sum in `f64`. PyTorch: `torch.softmax(x, dim)`.
    ///
    /// # Errors
    /// [`Error::DimOutOfRange`]; [`Error::InvalidArgument`] for integer tensors.
    pub fn softmax(&self, dim: impl crate::Dim) -> Result<Tensor> {
        let dim = dim.resolve("softmax", self.rank())?;
        check_dim("softmax", dim, self.rank())?;
        if let Some(out) = super::meta_float("softmax", &[self], self.shape(), self.dtype()) {
            return out;
        }
        #[cfg(feature = "cuda")]
        if self.is_cuda() {
            return crate::cuda::ops::softmax(self, dim, 1.0, 0, false);
        }
        float_dispatch!("softmax", self.dtype(), T => {
            // The exponentials in the compute type, so that half types round once.
            map_rows::<T, Vec<_>, 1>("softmax", [self], dim, #[inline(always)] |_, [row], out, e| {
                let inv = 1.0 / row_exp_sum(row, e).1;
                for (o, &v) in out.iter_mut().zip(e.iter()) {
                    *o = <T as Float>::from_wide(v.widen() * inv);
                }
            })
        })
    }

    /// The attention weights of scores `self` `[..., T, S]`: softmax over the last
    /// dim of `scale · self`, with every key `j > i` of query `i` given weight 0
    /// when `is_causal` (the top-left aligned mask of [`causal_mask`](Self::causal_mask)).
    /// Bit for bit `self.mul_scalar(scale)?.causal_mask(-∞)?.softmax(last)` in one
    /// pass per row, without the two intermediate tensors and without the
    /// exponentials of masked keys. PyTorch: `attn_weight` in the reference
    /// implementation of `torch.nn.functional.scaled_dot_product_attention`,
    /// `softmax(q @ k.mT * scale + causal_bias, dim=-1)`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for rank < 2, a non-finite `scale` or integer tensors.
    pub fn attention_probs(&self, scale: f64, is_causal: bool) -> Result<Tensor> {
        const OP: &str = "attention_probs";
        check_scores(OP, self, scale)?;
        let (t, last) = (self.shape()[self.rank() - 2], self.rank() - 1);
        if let Some(out) = super::meta_float(OP, &[self], self.shape(), self.dtype()) {
            return out;
        }
        #[cfg(feature = "cuda")]
        if self.is_cuda() {
            return crate::cuda::ops::softmax(self, last, scale, if is_causal { t } else { 0 }, false);
        }
        float_dispatch!(OP, self.dtype(), T => {
            let s = <T as Float>::Acc::real(scale);
            // Scratch: the scaled row (rounded to the dtype, as `mul_scalar` leaves
            // it), then its exponentials in the compute type.
            map_rows::<T, ProbsScratch<T>, 1>(OP, [self], last, #[inline(always)] |r, [row], out, scratch| {
                attention_probs_row(causal_keep(is_causal, r % t, row.len()), s, row, out, scratch);
            })
        })
    }

    /// Log-softmax along `dim`: `x - max - ln Σ exp(x - max)`.
    /// PyTorch: `torch.log_softmax(x, dim)`.
    ///
    /// # Errors
    /// [`Error::DimOutOfRange`]; [`Error::InvalidArgument`] for integer tensors.
    pub fn log_softmax(&self, dim: impl crate::Dim) -> Result<Tensor> {
        let dim = dim.resolve("log_softmax", self.rank())?;
        check_dim("log_softmax", dim, self.rank())?;
        if let Some(out) = super::meta_float("log_softmax", &[self], self.shape(), self.dtype()) {
            return out;
        }
        #[cfg(feature = "cuda")]
        if self.is_cuda() {
            return crate::cuda::ops::softmax(self, dim, 1.0, 0, true);
        }
        float_dispatch!("log_softmax", self.dtype(), T => {
            map_rows::<T, Vec<_>, 1>("log_softmax", [self], dim, #[inline(always)] |_, [row], out, e| {
                let (max, sum) = row_exp_sum(row, e);
                let lse = sum.ln();
                for (o, &x) in out.iter_mut().zip(row) {
                    *o = <T as Float>::from_wide((x.to_acc() - max).widen() - lse);
                }
            })
        })
    }

    /// Layer norm over the last dim: `(x - mean) / sqrt(var + eps) · weight + bias`
    /// with the biased variance; `weight` and `bias` are `[D]` and optional.
    /// Statistics and the output are computed in `f64` and rounded once.
    /// PyTorch: `torch.nn.functional.layer_norm(x, [D], weight, bias, eps)`.
    ///
    /// # Errors
    /// As [`layer_norm_with_stats`](Self::layer_norm_with_stats).
    pub fn layer_norm(&self, weight: Option<&Tensor>, bias: Option<&Tensor>, eps: f64) -> Result<Tensor> {
        Ok(self.layer_norm_with_stats(weight, bias, eps)?.0)
    }

    /// [`layer_norm`](Self::layer_norm), also returning what its backward
    /// needs: `(output, mean, rstd)`, where `mean` and `rstd = 1 / sqrt(var + eps)`
    /// have the input's shape with the last dim 1, in `f64` for every input
    /// dtype: the statistics the output was computed with, unrounded, so that
    /// [`layer_norm_backward_with_stats`](Self::layer_norm_backward_with_stats)
    /// gives the bits of [`layer_norm_backward`](Self::layer_norm_backward).
    /// PyTorch: `torch.native_layer_norm`, whose statistics are `f32` for `f32`,
    /// `bf16` and `f16` inputs (rounding them costs a row of nearly equal
    /// values most of its gradient's precision).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a rank-0 or integer input;
    /// [`Error::ShapeMismatch`] when `weight` or `bias` is not `[D]`;
    /// [`Error::DTypeMismatch`] when their dtype differs from the input's.
    pub fn layer_norm_with_stats(
        &self,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        eps: f64,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        need_dims("layer_norm", self, "dim to normalize")?;
        check_affine(self, weight, "weight")?;
        check_affine(self, bias, "bias")?;
        let inputs: Vec<&Tensor> = [Some(self), weight, bias].into_iter().flatten().collect();
        if let Some(out) = super::meta_float("layer_norm", &inputs, self.shape(), self.dtype()) {
            let stats = row_stats_shape(self.shape());
            return Ok((
                out?,
                Tensor::meta(&stats, DType::F64)?,
                Tensor::meta(&stats, DType::F64)?,
            ));
        }
        #[cfg(feature = "cuda")]
        if self.is_cuda() {
            return crate::cuda::ops::norm(self, weight, bias, eps, false);
        }
        float_dispatch!("layer_norm", self.dtype(), T => layer_norm_typed::<T>(self, weight, bias, eps))
    }

    /// Rows of this `[V, D]` table picked by `indices` (`i64`, any shape):
    /// the result has shape `[..indices.shape, D]`. Every dtype.
    /// PyTorch: `torch.nn.functional.embedding(indices, weight)`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when this tensor is not 2-D or an index is
    /// negative or `>= V` (naming the index and V); [`Error::DTypeMismatch`]
    /// when `indices` is not `i64`.
    pub fn embedding(&self, indices: &Tensor) -> Result<Tensor> {
        if self.rank() != 2 {
            return Err(Error::InvalidArgument {
                op: "embedding",
                detail: format!("the table must be [V, D], got shape {:?}", self.shape()),
            });
        }
        if indices.dtype() != DType::I64 {
            return Err(Error::DTypeMismatch {
                op: "embedding",
                expected: DType::I64,
                got: indices.dtype(),
            });
        }
        let (v, d) = (self.shape()[0], self.shape()[1]);
        // On meta, the indices (which have no values) are not checked.
        if let Some(out) = super::meta_output(&[self, indices], &[indices.shape(), &[d]].concat(), self.dtype()) {
            return out;
        }
        #[cfg(feature = "cuda")]
        if self.is_cuda() || indices.is_cuda() {
            return crate::cuda::ops::embedding(self, indices, 0);
        }
        let idx = elements::<i64>(indices)?;
        if let Some((pos, &i)) = idx.iter().enumerate().find(|&(_, &i)| i < 0 || i as u64 >= v as u64) {
            return Err(Error::InvalidArgument {
                op: "embedding",
                detail: format!(
                    "index {i} (element {pos} of indices of shape {:?}) is out of range for a table \
                     of {v} rows; indices must be in 0..{v}",
                    indices.shape()
                ),
            });
        }
        let mut shape = indices.shape().to_vec();
        shape.push(d);
        any_dispatch!("embedding", self.dtype(), T => gather_rows::<T>(self, &idx, d, &shape))
    }

    /// Cross entropy of `[N, C]` logits against `i64` class `targets` of shape
    /// `[N]`: `logsumexp(row) - row[target]`, reduced by `reduction`, and returned
    /// in the logits' dtype. The exponentials are taken in the compute type (as
    /// in [`softmax`](Self::softmax)), their sums, the logarithm and the
    /// reduction in `f64`.
    /// PyTorch: `torch.nn.functional.cross_entropy(logits, targets, reduction=...)`
    /// (without class weights, `ignore_index` or label smoothing).
    ///
    /// # Errors
    /// As [`cross_entropy_with_grad`](Self::cross_entropy_with_grad).
    pub fn cross_entropy(&self, targets: &Tensor, reduction: Reduction) -> Result<Tensor> {
        Ok(self.cross_entropy_impl(targets, reduction, false, self.dtype())?.0)
    }

    /// [`cross_entropy`](Self::cross_entropy), also returning the softmax
    /// probabilities `[N, C]` (logits' dtype) that its backward needs: the
    /// gradient of the mean loss with respect to the logits is
    /// `(probs - onehot(targets)) / N`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the logits are not 2-D, are integers, or a
    /// target is outside `0..C` (naming the row, the target and C);
    /// [`Error::ShapeMismatch`] when `targets` is not `[N]`;
    /// [`Error::DTypeMismatch`] when `targets` is not `i64`.
    pub fn cross_entropy_with_grad(&self, targets: &Tensor, reduction: Reduction) -> Result<(Tensor, Tensor)> {
        self.cross_entropy_with_grad_as(targets, reduction, self.dtype())
    }

    /// [`cross_entropy_with_grad`](Self::cross_entropy_with_grad) of these
    /// logits cast to `dtype` (`f32` for `bf16` or `f16` logits, the upcast
    /// that mixed-precision losses take), bit for bit, without the cast's
    /// pass: each element is widened as it is read, and the loss and the
    /// probabilities are `dtype`. `dtype` must be the logits' own or, for
    /// 16-bit logits, `f32` (whose compute type is theirs).
    ///
    /// PyTorch: `F.cross_entropy(logits.float(), targets)`.
    ///
    /// # Errors
    /// As [`cross_entropy_with_grad`](Self::cross_entropy_with_grad);
    /// [`Error::InvalidArgument`] for another `dtype`.
    pub fn cross_entropy_with_grad_as(
        &self,
        targets: &Tensor,
        reduction: Reduction,
        dtype: DType,
    ) -> Result<(Tensor, Tensor)> {
        match self.cross_entropy_impl(targets, reduction, true, dtype)? {
            (loss, Some(probs)) => Ok((loss, probs)),
            // Unreachable: asked for probabilities, `cross_entropy_impl` returns them.
            (_, None) => Err(Error::InvalidArgument {
                op: "cross_entropy",
                detail: "internal error: probabilities were not computed".into(),
            }),
        }
    }

    fn cross_entropy_impl(
        &self,
        targets: &Tensor,
        reduction: Reduction,
        probs: bool,
        dtype: DType,
    ) -> Result<(Tensor, Option<Tensor>)> {
        const OP: &str = "cross_entropy";
        let d = self.dtype();
        if !d.is_float() {
            return Err(crate::kernel::not_float(OP, d));
        }
        upcast_target(OP, d, dtype)?;
        if self.is_meta() || targets.is_meta() {
            // The targets (which have no values) are not checked against C.
            super::rows::ce_shapes(self, targets)?;
            let rows = [self.shape()[0]];
            let loss = Tensor::meta(if reduction == Reduction::None { &rows } else { &[] }, dtype)?;
            return Ok((
                loss,
                if probs {
                    Some(Tensor::meta(self.shape(), dtype)?)
                } else {
                    None
                },
            ));
        }
        #[cfg(feature = "cuda")]
        if self.is_cuda() || targets.is_cuda() {
            super::rows::ce_shapes(self, targets)?;
            if dtype != d {
                return self.cast(dtype)?.cross_entropy_impl(targets, reduction, probs, dtype);
            }
            return crate::cuda::ops::cross_entropy(self, targets, reduction, probs);
        }
        let (n, c, t) = ce_targets(self, targets)?;
        float_dispatch!(OP, d, T => {
            let x = elements::<T>(self)?;
            if dtype == d {
                cross_entropy_rows::<T, T>(&x, &t, n, c, reduction, probs)
            } else {
                cross_entropy_rows::<T, f32>(&x, &t, n, c, reduction, probs)
            }
        })
    }

    /// The attention scores `[..., T, S]` with every key `j > i` of query `i`
    /// set to `fill` (usually `f64::NEG_INFINITY`, so that softmax gives them
    /// weight 0). PyTorch: `scores.masked_fill(torch.ones(T, S).triu(1).bool(), fill)`,
    /// the mask of `scaled_dot_product_attention(is_causal=True)`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for rank < 2 or integer tensors.
    pub fn causal_mask(&self, fill: f64) -> Result<Tensor> {
        if self.rank() < 2 {
            return Err(Error::InvalidArgument {
                op: "causal_mask",
                detail: format!("scores must be [..., T, S], got shape {:?}", self.shape()),
            });
        }
        if let Some(out) = super::meta_float("causal_mask", &[self], self.shape(), self.dtype()) {
            return out;
        }
        let (t, s) = (self.shape()[self.rank() - 2], self.shape()[self.rank() - 1]);
        float_dispatch!("causal_mask", self.dtype(), T => {
            let x = elements::<T>(self)?;
            let fill = <T as Float>::from_wide(fill);
            // Every element is written below: a recycled buffer needs no zeroing.
            let mut out: Vec<T> = crate::alloc::reused("causal_mask", self.shape())?;
            if s > 0 {
                // Blocks of rows over the rank's threads; row `r` is query `r mod T`.
                let x = &x[..];
                crate::kernel::par_rows(&mut out, s, |start, block| {
                    for (j, (o, row)) in block.chunks_exact_mut(s).zip(x[start..].chunks_exact(s)).enumerate() {
                        let keep = ((start / s + j) % t + 1).min(s);
                        o[..keep].copy_from_slice(&row[..keep]);
                        o[keep..].fill(fill);
                    }
                });
            }
            output(out, self.shape())
        })
    }
}

/// The shape of per-row statistics (layer norm's and RMSNorm's mean and rstd)
/// of an input of `shape`: the shape with the last dim 1.
pub(super) fn row_stats_shape(shape: &[usize]) -> Vec<usize> {
    let mut s = shape.to_vec();
    if let Some(last) = s.last_mut() {
        *last = 1;
    }
    s
}

/// Errors unless `to` is `from` or, for 16-bit `from`, `f32`: the dtypes a
/// loss of `from` logits can be computed in without changing its compute type
/// ([`Tensor::cross_entropy_with_grad_as`]; its backward pairs the other way).
///
/// # Errors
/// [`Error::InvalidArgument`] naming both dtypes.
pub fn upcast_target(op: &'static str, from: DType, to: DType) -> Result<()> {
    if to == from || (to == DType::F32 && matches!(from, DType::BF16 | DType::F16)) {
        return Ok(());
    }
    Err(Error::InvalidArgument {
        op,
        detail: format!("{from:?} logits compute in {from:?} or, when 16-bit, in F32; {to:?} was asked for"),
    })
}

/// The CPU cross entropy of `[n, c]` logits `x` against in-range targets `t`:
/// the loss reduced by `reduction` and, with `probs`, the probabilities,
/// both of `O` (`T`, or `f32` for 16-bit `T`: the same arithmetic in `T`'s
/// compute type, rounded to `O`).
fn cross_entropy_rows<T: Float, O: Float>(
    x: &[T],
    t: &[i64],
    n: usize,
    c: usize,
    reduction: Reduction,
    probs: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    const OP: &str = "cross_entropy";
    // `ce_row` (inline) runs inside `Simd::run` below, so that the row's
    // exponentials are computed with the CPU's widest vectors.
    let row = |i: usize| &x[i * c..(i + 1) * c];
    let mut losses = vec![0f64; n];
    let simd = Simd::best();
    let p = if probs {
        // Blocks of rows over the rank's threads: each writes its rows'
        // probabilities and, through `row_losses`, their losses.
        let row_losses: Vec<AtomicU64> = (0..n).map(|_| AtomicU64::new(0)).collect();
        let write = |p: &mut [MaybeUninit<O>]| {
            crate::kernel::par_rows(p, c.max(1), |start, block| {
                simd.run(
                    #[inline(always)]
                    || {
                        let mut e = Vec::with_capacity(c);
                        let first = start / c.max(1);
                        for (j, out) in block.chunks_exact_mut(c.max(1)).enumerate() {
                            let i = first + j;
                            let (loss, sum) = ce_row::<T>(row(i), t[i] as usize, &mut e);
                            row_losses[i].store(loss.to_bits(), Ordering::Relaxed);
                            // The softmax from the exponentials already at hand, as `softmax` does.
                            let inv = 1.0 / sum;
                            zip_map_inline(
                                &e,
                                &e,
                                out,
                                #[inline(always)]
                                |v, _| MaybeUninit::new(<O as Float>::from_wide(v.widen() * inv)),
                            );
                        }
                    },
                )
            })
        };
        // SAFETY: the blocks of `par_rows` tile the `n · c` elements, and each
        // row's `c` elements are written (targets are in range, so `n > 0`
        // means `c > 0`, and `e` holds one exponential per element).
        let p = unsafe { crate::alloc::written(OP, &[n, c], write)? };
        // `par_rows` returned: every row's loss is stored.
        for (l, r) in losses.iter_mut().zip(&row_losses) {
            *l = f64::from_bits(r.load(Ordering::Relaxed));
        }
        Some(output(p, &[n, c])?)
    } else {
        // Blocks of rows over the rank's threads; every row's loss is the
        // same at any split, and they are summed in row order below.
        crate::kernel::par_blocks(&mut losses, 1, crate::kernel::par_parts(n * c), |start, block| {
            simd.run(
                #[inline(always)]
                || {
                    let mut e = Vec::with_capacity(c);
                    for (j, l) in block.iter_mut().enumerate() {
                        *l = ce_row::<T>(row(start + j), t[start + j] as usize, &mut e).0;
                    }
                },
            )
        });
        None
    };
    let loss = match reduction {
        Reduction::Mean => output(
            vec![<O as Float>::from_wide(losses.iter().sum::<f64>() / n as f64)],
            &[],
        )?,
        Reduction::Sum => output(vec![<O as Float>::from_wide(losses.iter().sum::<f64>())], &[])?,
        Reduction::None => output(losses.into_iter().map(<O as Float>::from_wide).collect(), &[n])?,
    };
    Ok((loss, p))
}

/// Cross entropy of one row of logits against class `k`, and the row's
/// `Σ exp(x - max)` (its exponentials left in `e`).
#[inline(always)]
fn ce_row<T: Float>(row: &[T], k: usize, e: &mut Vec<T::Acc>) -> (f64, f64) {
    let (max, sum) = row_exp_sum(row, e);
    (sum.ln() - (row[k].to_acc() - max).widen(), sum)
}

/// The rows `idx` of a `[V, d]` table, concatenated.
fn gather_rows<T: Element>(table: &Tensor, idx: &[i64], d: usize, shape: &[usize]) -> Result<Tensor> {
    let w = elements::<T>(table)?;
    // A few indices into a wide table can ask for more than memory holds.
    let mut out = crate::alloc::with_capacity::<T>("embedding", shape)?;
    for &i in idx {
        let start = i as usize * d;
        out.extend_from_slice(&w[start..start + d]);
    }
    output(out, shape)
}

#[cfg(target_arch = "x86_64")]
mod softmax_avx512;
#[cfg(test)]
mod tests;
