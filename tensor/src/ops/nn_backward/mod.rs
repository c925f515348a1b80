//! Fused backward kernels of softmax, layer norm and cross entropy: one pass
//! over each row instead of a chain of element-wise ops and their temporaries.
//! Layer norm's are in [`layer_norm`].

use std::mem::MaybeUninit;

use super::rows::{causal_keep, ce_targets, check_scores, index_vector, map_rows, row_exp_sum};
use super::{check_dim, elements, output, same_shape};
use crate::kernel::{Float, Real, float_dispatch};
use crate::kernel::{Simd, zip_map_inline};
use crate::{DType, Error, Result, Tensor};

mod layer_norm;

impl Tensor {
    /// The gradient of [`softmax`](Self::softmax) along `dim` with respect to its
    /// input, given the gradient `self` of its output `y`:
    /// `y · (self − Σ_dim self·y)`. The products `self·y` are rounded to the dtype
    /// and summed in `f64`, and every intermediate is rounded to the dtype, as the
    /// same chain of element-wise ops computes it.
    /// PyTorch: `torch.ops.aten._softmax_backward_data(grad, y, dim, dtype)`.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] when the shapes differ; [`Error::DTypeMismatch`];
    /// [`Error::DimOutOfRange`]; [`Error::InvalidArgument`] for integer tensors.
    pub fn softmax_backward(&self, y: &Tensor, dim: impl crate::Dim) -> Result<Tensor> {
        let dim = dim.resolve("softmax_backward", self.rank())?;
        const OP: &str = "softmax_backward";
        same_shape(OP, self, y, "the softmax output")?;
        check_dim(OP, dim, self.rank())?;
        if let Some(out) = super::meta_float(OP, &[self, y], self.shape(), self.dtype()) {
            return out;
        }
        #[cfg(feature = "cuda")]
        if self.is_cuda() || y.is_cuda() {
            return crate::cuda::ops::softmax_backward(self, y, dim, 1.0, 0);
        }
        float_dispatch!(OP, self.dtype(), T => map_rows::<T, (), 2>(OP, [self, y], dim, #[inline(always)] |_, [g, y], o, _| {
            softmax_grad_row(g, y, o, #[inline(always)] |d| d);
        }))
    }

    /// The gradient of [`attention_probs`](Self::attention_probs) with respect
    /// to its scores, given the gradient `self` of its output `probs`:
    /// `scale · probs · (self − Σ_last self·probs)`, exactly 0 at masked keys.
    /// Bit for bit `self.softmax_backward(probs, last)?.causal_mask(0)?.mul_scalar(scale)`
    /// (the mask only when `is_causal`), in one pass per row.
    /// PyTorch: the scores' gradient in the reference implementation of
    /// `torch.nn.functional.scaled_dot_product_attention`.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] when the shapes differ; [`Error::DTypeMismatch`];
    /// [`Error::InvalidArgument`] for rank < 2, a non-finite `scale` or integer tensors.
    pub fn attention_probs_backward(&self, probs: &Tensor, scale: f64, is_causal: bool) -> Result<Tensor> {
        const OP: &str = "attention_probs_backward";
        same_shape(OP, self, probs, "probs")?;
        check_scores(OP, probs, scale)?;
        let (t, last) = (probs.shape()[probs.rank() - 2], probs.rank() - 1);
        if let Some(out) = super::meta_float(OP, &[self, probs], self.shape(), self.dtype()) {
            return out;
        }
        #[cfg(feature = "cuda")]
        if self.is_cuda() || probs.is_cuda() {
            let period = if is_causal { t } else { 0 };
            return crate::cuda::ops::softmax_backward(self, probs, last, scale, period);
        }
        float_dispatch!(OP, self.dtype(), T => {
            let s = <T as Float>::Acc::real(scale);
            map_rows::<T, (), 2>(OP, [self, probs], last, #[inline(always)] |r, [g, y], o, _| {
                attention_probs_grad_row(causal_keep(is_causal, r % t, g.len()), s, g, y, o);
            })
        })
    }

    /// The gradient of [`embedding`](Self::embedding)'s table, or of its rows
    /// `first..first + rows` (a shard of it), given the gradient `self`
    /// (`[N, d]`) of the looked-up rows `indices` (`[N]`, `i64`): row `i` of the
    /// result is the sum of the rows `k` of `self` with `indices[k] = first + i`,
    /// taken in `f64` in index order and rounded once; untouched rows are zero
    /// and indices outside the shard are skipped. `[rows, d]` in `self`'s dtype.
    /// PyTorch: `torch.ops.aten.embedding_dense_backward` (without
    /// `padding_idx` or `scale_grad_by_freq`).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `self` is not 2-D or is an integer tensor;
    /// [`Error::ShapeMismatch`] when `indices` is not `[N]`;
    /// [`Error::DTypeMismatch`] when `indices` is not `i64`.
    pub fn embedding_dense_backward(&self, indices: &Tensor, rows: usize, first: usize) -> Result<Tensor> {
        const OP: &str = "embedding_backward";
        if self.rank() != 2 {
            return Err(Error::InvalidArgument {
                op: OP,
                detail: format!("the gradient must be [N, d], got shape {:?}", self.shape()),
            });
        }
        let (n, d) = (self.shape()[0], self.shape()[1]);
        if self.is_meta() || indices.is_meta() {
            // The indices (which have no values) are not checked against the rows.
            super::rows::index_shape(OP, indices, n, || format!("a [{n}, {d}] gradient needs indices"))?;
            if let Some(out) = super::meta_float(OP, &[self, indices], &[rows, d], self.dtype()) {
                return out;
            }
        }
        #[cfg(feature = "cuda")]
        if self.is_cuda() || indices.is_cuda() {
            super::rows::index_shape(OP, indices, n, || format!("a [{n}, {d}] gradient needs indices"))?;
            return crate::cuda::ops::embedding_backward(self, indices, rows, first);
        }
        let idx = index_vector(OP, indices, n, || format!("a [{n}, {d}] gradient needs indices"))?;
        float_dispatch!(OP, self.dtype(), T => {
            let g = elements::<T>(self)?;
            // The shard's rows that some index names, in first-seen order, each with
            // its f64 sum: only those are summed, so the table is written once.
            let (mut slot, mut touched, mut acc) = (vec![u32::MAX; rows], Vec::<usize>::new(), Vec::<f64>::new());
            for (k, &i) in idx.iter().enumerate() {
                let Some(r) = (i as usize).checked_sub(first).filter(|&r| r < rows) else {
                    continue;
                };
                if slot[r] == u32::MAX {
                    slot[r] = touched.len() as u32;
                    touched.push(r);
                    acc.resize(acc.len() + d, 0.0);
                }
                let s = slot[r] as usize;
                for (a, &v) in acc[s * d..(s + 1) * d].iter_mut().zip(&g[k * d..(k + 1) * d]) {
                    *a += v.wide();
                }
            }
            let mut out = crate::alloc::zeroed::<T>(OP, &[rows, d])?;
            for (s, &r) in touched.iter().enumerate() {
                for (o, &a) in out[r * d..(r + 1) * d].iter_mut().zip(&acc[s * d..(s + 1) * d]) {
                    *o = T::from_wide(a);
                }
            }
            output(out, &[rows, d])
        })
    }

    /// The gradient of the summed [`cross_entropy`](Self::cross_entropy) of
    /// `[N, C]` logits with respect to them, times `scale`:
    /// `(softmax(self) − onehot(targets)) · scale`, in one pass per row. The
    /// probabilities are rounded to the dtype first (as
    /// [`cross_entropy_with_grad`](Self::cross_entropy_with_grad) returns them),
    /// then shifted and scaled in `f64` and rounded once. For the mean loss pass
    /// `scale = 1 / N` (times the incoming gradient).
    ///
    /// # Errors
    /// As [`cross_entropy_with_grad`](Self::cross_entropy_with_grad).
    pub fn cross_entropy_backward(&self, targets: &Tensor, scale: f64) -> Result<Tensor> {
        if self.is_meta() || targets.is_meta() {
            super::rows::ce_shapes(self, targets)?;
            if let Some(out) = super::meta_float("cross_entropy_backward", &[self, targets], self.shape(), self.dtype())
            {
                return out;
            }
        }
        #[cfg(feature = "cuda")]
        if self.is_cuda() || targets.is_cuda() {
            super::rows::ce_shapes(self, targets)?;
            let p = self.softmax(1)?;
            return crate::cuda::ops::cross_entropy_backward_from_probs(&p, targets, scale);
        }
        let (n, c, t) = ce_targets(self, targets)?;
        float_dispatch!("cross_entropy", self.dtype(), T => {
            let x = elements::<T>(self)?;
            // Every element is written below: a recycled buffer needs no zeroing.
            let mut out: Vec<T> = crate::alloc::reused("cross_entropy", &[n, c])?;
            // Blocks of rows over the rank's threads, each with its own scratch.
            let (simd, x, c) = (Simd::best(), &x[..], c.max(1));
            crate::kernel::par_rows(&mut out, c, |start, block| {
                simd.run(#[inline(always)] || {
                    let mut e = Vec::with_capacity(c);
                    let rows = x[start..].chunks_exact(c).zip(block.chunks_exact_mut(c));
                    for ((row, o), &k) in rows.zip(&t[start / c..]) {
                        let inv = 1.0 / row_exp_sum(row, &mut e).1;
                        zip_map_inline(&e, &e, o, #[inline(always)] |v, _| {
                            T::from_wide(T::from_wide(v.widen() * inv).wide() * scale)
                        });
                        let k = k as usize;
                        o[k] = T::from_wide((T::from_wide(e[k].widen() * inv).wide() - 1.0) * scale);
                    }
                })
            });
            output(out, &[n, c])
        })
    }
}

impl Tensor {
    /// [`cross_entropy_backward`](Self::cross_entropy_backward) from the
    /// probabilities `self` (`[N, C]`) that
    /// [`cross_entropy_with_grad`](Self::cross_entropy_with_grad) returned for
    /// the logits, instead of the logits: `(self − onehot(targets)) · scale`,
    /// bit for bit the same, without recomputing the exponentials (one pass
    /// that reads and writes each element once).
    ///
    /// # Errors
    /// As [`cross_entropy_with_grad`](Self::cross_entropy_with_grad), for the
    /// probabilities in place of the logits.
    pub fn cross_entropy_backward_from_probs(&self, targets: &Tensor, scale: f64) -> Result<Tensor> {
        self.cross_entropy_backward_from_probs_as(targets, scale, self.dtype())
    }

    /// [`cross_entropy_backward_from_probs`](Self::cross_entropy_backward_from_probs)
    /// cast to `dtype`, bit for bit, in one pass: the gradient of logits that
    /// [`cross_entropy_with_grad_as`](Self::cross_entropy_with_grad_as) upcast,
    /// from its `f32` probabilities back to the logits' `bf16` or `f16`.
    /// `dtype` must be the probabilities' own or, for `f32` ones, `bf16` or
    /// `f16`.
    ///
    /// # Errors
    /// As [`cross_entropy_backward_from_probs`](Self::cross_entropy_backward_from_probs);
    /// [`Error::InvalidArgument`] for another `dtype`.
    pub fn cross_entropy_backward_from_probs_as(&self, targets: &Tensor, scale: f64, dtype: DType) -> Result<Tensor> {
        const OP: &str = "cross_entropy_backward";
        if self.dtype().is_float() {
            super::nn::upcast_target(OP, dtype, self.dtype())?;
        }
        if self.is_meta() || targets.is_meta() {
            super::rows::ce_shapes(self, targets)?;
            if let Some(out) = super::meta_float(OP, &[self, targets], self.shape(), dtype) {
                return out;
            }
        }
        #[cfg(feature = "cuda")]
        if self.is_cuda() || targets.is_cuda() {
            super::rows::ce_shapes(self, targets)?;
            return crate::cuda::ops::cross_entropy_backward_from_probs(self, targets, scale)?.cast(dtype);
        }
        let (n, c, t) = ce_targets(self, targets)?;
        float_dispatch!("cross_entropy", self.dtype(), T => {
            let p = elements::<T>(self)?;
            // Narrowed: rounded to `T`, then (exactly widened) to the 16-bit
            // type, a cast's rounding.
            match dtype {
                DType::BF16 if dtype != self.dtype() => ce_grad_rows(&p, &t, n, c, scale, |v| {
                    <half::bf16 as Float>::from_wide(T::from_wide(v).wide())
                }),
                DType::F16 if dtype != self.dtype() => ce_grad_rows(&p, &t, n, c, scale, |v| {
                    <half::f16 as Float>::from_wide(T::from_wide(v).wide())
                }),
                _ => ce_grad_rows(&p, &t, n, c, scale, <T as Float>::from_wide),
            }
        })
    }
}

/// `(p − onehot(t)) · scale` for `[n, c]` probabilities `p` and in-range
/// targets `t`, each element rounded to `O` by `round`.
fn ce_grad_rows<T: Float, O: Float>(
    p: &[T],
    t: &[i64],
    n: usize,
    c: usize,
    scale: f64,
    round: impl Fn(f64) -> O + Copy + Sync,
) -> Result<Tensor> {
    let (simd, c) = (Simd::best(), c.max(1));
    let write = |out: &mut [MaybeUninit<O>]| {
        crate::kernel::par_rows(out, c, |start, block| {
            simd.run(
                #[inline(always)]
                || {
                    zip_map_inline(
                        &p[start..],
                        &p[start..],
                        block,
                        #[inline(always)]
                        |v, _| MaybeUninit::new(round(v.wide() * scale)),
                    );
                    let rows = block
                        .chunks_exact_mut(c)
                        .zip(t[start / c..].iter().zip(p[start..].chunks_exact(c)));
                    for (o, (&k, row)) in rows {
                        let k = k as usize;
                        o[k] = MaybeUninit::new(round((row[k].wide() - 1.0) * scale));
                    }
                },
            )
        })
    };
    // SAFETY: the blocks of `par_rows` tile the output, and the first loop
    // writes each block's every element (`p` holds as many from `start`).
    let out = unsafe { crate::alloc::written("cross_entropy", &[n, c], write)? };
    output(out, &[n, c])
}

/// One row of [`Tensor::attention_probs_backward`]: the scores' gradient
/// from the probabilities' gradient `g` and the probabilities `y`, over the
/// first `keep` keys, and what the mask leaves after them. For row kernels
/// inside [`Simd::run`].
#[inline(always)]
pub(super) fn attention_probs_grad_row<T: Float>(keep: usize, scale: T::Acc, g: &[T], y: &[T], o: &mut [T]) {
    softmax_grad_row(
        g,
        y,
        &mut o[..keep],
        #[inline(always)]
        |d| T::from_acc(d.to_acc() * scale),
    );
    // What `causal_mask(0)` then `mul_scalar` leave there (−0 for a negative scale).
    o[keep..].fill(T::from_acc(T::from_wide(0.0).to_acc() * scale));
}

/// One row of the softmax gradient, `y · (g − Σ g·y)` rounded as the chain of
/// ops rounds it, each element then passed through `then`, written to the first
/// `out.len()` elements (the dot runs over the whole row).
#[inline(always)]
fn softmax_grad_row<T: Float>(g: &[T], y: &[T], out: &mut [T], then: impl Fn(T) -> T) {
    let dot = T::from_wide(dot_f64(g, y)).to_acc();
    zip_map_inline(
        g,
        y,
        out,
        #[inline(always)]
        |g, y| then(T::from_acc(y.to_acc() * T::from_acc(g.to_acc() - dot).to_acc())),
    );
}

/// `Σ g·y` in `f64` of the products rounded to the dtype (as `g.mul(y).sum()`
/// computes it), with eight independent accumulators.
#[inline(always)]
fn dot_f64<T: Float>(g: &[T], y: &[T]) -> f64 {
    #[inline(always)]
    fn prod<T: Float>(g: T, y: T) -> T::Acc {
        T::from_acc(g.to_acc() * y.to_acc()).to_acc()
    }
    let whole = g.len().min(y.len()) / 8 * 8;
    let tail: f64 = g[whole..]
        .iter()
        .zip(&y[whole..])
        .map(|(&g, &y)| prod(g, y).widen())
        .sum();
    let mut acc = [0f64; 8];
    if size_of::<T>() == size_of::<T::Acc>() {
        // f32 and f64: no rounding, one loop.
        for (g, y) in g[..whole].chunks_exact(8).zip(y[..whole].chunks_exact(8)) {
            for ((a, &g), &y) in acc.iter_mut().zip(g).zip(y) {
                *a += prod(g, y).widen();
            }
        }
    } else {
        // The half types' products are rounded in blocks by an element-wise
        // loop, which vectorizes where the rounding inside the sum did not,
        // then summed in the same order.
        let mut products = [<T::Acc as Real>::ZERO; 64];
        for (g, y) in g[..whole].chunks(64).zip(y[..whole].chunks(64)) {
            let products = &mut products[..g.len()];
            zip_map_inline(g, y, products, prod);
            for p in products.chunks_exact(8) {
                for (a, &p) in acc.iter_mut().zip(p) {
                    *a += p.widen();
                }
            }
        }
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

#[cfg(test)]
mod tests;
