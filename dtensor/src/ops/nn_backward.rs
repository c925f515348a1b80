//! Fused backward kernels of softmax, layer norm and cross entropy: one pass
//! over each row instead of a chain of element-wise ops and their temporaries.

use std::mem::MaybeUninit;

use tessera_mesh::DType;

use super::fastmath::{Simd, zip_map_inline};
use super::nn::{causal_keep, ce_targets, check_scores, index_vector, map_rows, row_exp_sum};
use super::reduce::sum_map_f64;
use super::{Float, Real, check_dim, elements, float_dispatch, output, same_dtype};
use crate::{Error, Result, Tensor};

/// Errors unless `a` and `b` have the same shape and dtype.
fn same_shape(op: &'static str, a: &Tensor, b: &Tensor, what: &str) -> Result<()> {
    if a.shape() != b.shape() {
        return Err(Error::ShapeMismatch {
            op,
            detail: format!(
                "gradient has shape {:?} but {what} has {:?}; they must be equal",
                a.shape(),
                b.shape()
            ),
        });
    }
    same_dtype(op, a, b)
}

/// `d` copies of `v`: scratch rows of a last dim that an empty input may make
/// larger than memory.
pub(crate) fn filled(op: &'static str, d: usize, v: f64) -> Result<Vec<f64>> {
    let mut out = crate::alloc::zeroed::<f64>(op, &[d])?;
    out.fill(v);
    Ok(out)
}

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
    pub fn softmax_backward(&self, y: &Tensor, dim: usize) -> Result<Tensor> {
        const OP: &str = "softmax_backward";
        same_shape(OP, self, y, "the softmax output")?;
        check_dim(OP, dim, self.rank())?;
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
        float_dispatch!(OP, self.dtype(), T => {
            let s = <T as Float>::Acc::real(scale);
            map_rows::<T, (), 2>(OP, [self, probs], last, #[inline(always)] |r, [g, y], o, _| {
                attention_probs_grad_row(causal_keep(is_causal, r % t, g.len()), s, g, y, o);
            })
        })
    }

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
        float_dispatch!(OP, self.dtype(), T => {
            let stats = saved_stats(OP, x, mean, rstd)?;
            ln_weight_grad::<T>(self, &elements::<T>(x)?, d, &stats)
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
        let (n, c, t) = ce_targets(self, targets)?;
        float_dispatch!("cross_entropy", self.dtype(), T => {
            let x = elements::<T>(self)?;
            // Every element is written below: a recycled buffer needs no zeroing.
            let mut out: Vec<T> = crate::alloc::reused("cross_entropy", &[n, c])?;
            // Blocks of rows over the rank's threads, each with its own scratch.
            let (simd, x, c) = (Simd::best(), &x[..], c.max(1));
            super::par_rows(&mut out, c, |start, block| {
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
        let (n, c, t) = ce_targets(self, targets)?;
        float_dispatch!("cross_entropy", self.dtype(), T => {
            let p = elements::<T>(self)?;
            let (simd, p, c) = (Simd::best(), &p[..], c.max(1));
            let write = |out: &mut [MaybeUninit<T>]| {
                super::par_rows(out, c, |start, block| {
                    simd.run(#[inline(always)] || {
                        zip_map_inline(&p[start..], &p[start..], block, #[inline(always)] |v, _| {
                            MaybeUninit::new(T::from_wide(v.wide() * scale))
                        });
                        let rows = block.chunks_exact_mut(c).zip(t[start / c..].iter().zip(p[start..].chunks_exact(c)));
                        for (o, (&k, row)) in rows {
                            let k = k as usize;
                            o[k] = MaybeUninit::new(T::from_wide((row[k].wide() - 1.0) * scale));
                        }
                    })
                })
            };
            // SAFETY: the blocks of `par_rows` tile the output, and the first loop
            // writes each block's every element (`p` holds as many from `start`).
            let out = unsafe { crate::alloc::written("cross_entropy", &[n, c], write)? };
            output(out, &[n, c])
        })
    }
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

/// Errors unless `t` has a last dim.
/// The checks shared by layer norm's backward kernels: `g` and `x` of one shape
/// and dtype, rank >= 1, and an optional `[D]` weight of that dtype.
fn ln_backward_checks(op: &'static str, g: &Tensor, x: &Tensor, weight: Option<&Tensor>) -> Result<()> {
    same_shape(op, g, x, "the input")?;
    need_rank(op, x)?;
    let Some(w) = weight else { return Ok(()) };
    same_dtype(op, x, w)?;
    let d = x.shape()[x.rank() - 1];
    if w.shape() != [d] {
        return Err(Error::ShapeMismatch {
            op,
            detail: format!(
                "weight has shape {:?} but the input's last dim is {d}; pass a [{d}] weight",
                w.shape()
            ),
        });
    }
    Ok(())
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
        super::par_blocks(&mut gw, 1, super::par_parts(gv.len()), |c0, cols| {
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

/// [`row_stats`] of every `d`-element row of `xs`, in blocks of rows over the
/// rank's threads.
pub(super) fn all_row_stats<T: Float>(xs: &[T], d: usize, eps: f64) -> Vec<(f64, f64)> {
    let mut stats = vec![(0.0, 0.0); xs.len().checked_div(d).unwrap_or(0)];
    let simd = Simd::best();
    super::par_blocks(&mut stats, 1, super::par_parts(xs.len()), |start, block| {
        simd.run(
            #[inline(always)]
            || {
                for (s, row) in block.iter_mut().zip(xs[start * d..].chunks_exact(d)) {
                    *s = row_stats(row, eps);
                }
            },
        )
    });
    stats
}

/// The mean and `1 / sqrt(var + eps)` of a row in `f64`: the mean, then the
/// squared deviations from it (two passes: no cancellation).
#[inline(always)]
fn row_stats<T: Float>(row: &[T], eps: f64) -> (f64, f64) {
    let d = row.len() as f64;
    let mean = sum_map_f64(row, |v| v.wide()) / d;
    let var = sum_map_f64(row, |v| (v.wide() - mean).powi(2)) / d;
    (mean, 1.0 / (var + eps).sqrt())
}

#[cfg(test)]
mod tests {
    use tessera_mesh::DType;

    use super::*;
    use crate::ops::Reduction;
    use crate::ops::testutil::{assert_close, sample, tol};

    #[test]
    fn dot_sums_rounded_products_in_eight_lanes_then_the_tail() {
        // The order the blocked half-type path must keep: lane i % 8 of the
        // whole groups of 8, the lanes paired, then the tail in sequence.
        fn scalar(p: &[f64]) -> f64 {
            let whole = p.len() / 8 * 8;
            let mut acc = [0f64; 8];
            for (i, &v) in p[..whole].iter().enumerate() {
                acc[i % 8] += v;
            }
            let tail: f64 = p[whole..].iter().sum();
            ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
        }
        for len in [0, 5, 8, 63, 64, 65, 200, 1029] {
            let g = sample(&[len], DType::F32, 1)
                .mul_scalar(1e3)
                .unwrap()
                .to_vec::<f32>()
                .unwrap();
            let y = sample(&[len], DType::F32, 2).to_vec::<f32>().unwrap();
            let (gh, yh): (Vec<half::bf16>, Vec<half::bf16>) = (
                g.iter().map(|&v| half::bf16::from_f32(v)).collect(),
                y.iter().map(|&v| half::bf16::from_f32(v)).collect(),
            );
            let rounded: Vec<f64> = gh
                .iter()
                .zip(&yh)
                .map(|(a, b)| half::bf16::from_f32(a.to_f32() * b.to_f32()).to_f64())
                .collect();
            assert_eq!(
                dot_f64(&gh, &yh).to_bits(),
                scalar(&rounded).to_bits(),
                "bf16, {len} elements"
            );
            let exact: Vec<f64> = g.iter().zip(&y).map(|(&a, &b)| f64::from(a * b)).collect();
            assert_eq!(
                dot_f64(&g, &y).to_bits(),
                scalar(&exact).to_bits(),
                "f32, {len} elements"
            );
        }
    }

    const FLOATS: [DType; 4] = [DType::F32, DType::F64, DType::BF16, DType::F16];

    /// The same gradients from the chains of element-wise ops that they fuse.
    #[test]
    fn fused_backwards_match_their_op_chains() {
        macro_rules! case {
            ($shape:expr, $dim:expr, $strided:expr) => {
                for dtype in FLOATS {
                    let shape: &[usize] = &$shape;
                    let view = |t: Tensor| {
                        if $strided {
                            t.transpose(0, shape.len() - 1).unwrap()
                        } else {
                            t
                        }
                    };
                    let x = view(sample(shape, dtype, 61).mul_scalar(2.0).unwrap());
                    let g = view(sample(shape, dtype, 62));
                    let what = format!("{shape:?} dim {} strided {} {dtype}", $dim, $strided);
                    // Softmax: y · (g − Σ g·y).
                    let y = x.softmax($dim).unwrap();
                    let dot = g.mul(&y).unwrap().sum(&[$dim], true).unwrap();
                    let want = y.mul(&g.sub(&dot).unwrap()).unwrap();
                    let got = g.softmax_backward(&y, $dim).unwrap();
                    assert_eq!((got.shape(), got.dtype()), (x.shape(), dtype));
                    assert_close(
                        &got,
                        &want.to_f64_vec(),
                        4.0 * tol(dtype),
                        &format!("softmax {what}"),
                    );
                    // Layer norm over the last dim, with and without a weight.
                    let last = x.rank() - 1;
                    let d = x.shape()[last];
                    let w = sample(&[d], dtype, 63);
                    let batch: Vec<usize> = (0..last).collect();
                    let (x64, g64, w64) = (
                        x.cast(DType::F64).unwrap(),
                        g.cast(DType::F64).unwrap(),
                        w.cast(DType::F64).unwrap(),
                    );
                    let mean = x64.mean(&[last], true).unwrap();
                    let centered = x64.sub(&mean).unwrap();
                    let rstd = centered
                        .square()
                        .unwrap()
                        .mean(&[last], true)
                        .unwrap()
                        .add_scalar(1e-5)
                        .unwrap()
                        .rsqrt()
                        .unwrap();
                    let xhat = centered.mul(&rstd).unwrap();
                    for weight in [Some(&w), None] {
                        let gw = if weight.is_some() {
                            g64.mul(&w64).unwrap()
                        } else {
                            g64.clone()
                        };
                        let m1 = gw.mean(&[last], true).unwrap();
                        let m2 = gw.mul(&xhat).unwrap().mean(&[last], true).unwrap();
                        let want = gw
                            .sub(&m1)
                            .unwrap()
                            .sub(&xhat.mul(&m2).unwrap())
                            .unwrap()
                            .mul(&rstd)
                            .unwrap();
                        let got = g.layer_norm_backward(&x, weight, 1e-5).unwrap();
                        assert_eq!((got.shape(), got.dtype()), (x.shape(), dtype));
                        // The sums of d terms lose a few ulp of the dtype.
                        let rtol = (d as f64) * 4.0 * tol(dtype);
                        assert_close(
                            &got,
                            &want.to_f64_vec(),
                            rtol,
                            &format!("layer_norm {what} {}", weight.is_some()),
                        );
                        // From the forward's statistics: the same bits.
                        let (_, mean, rstd) = x.layer_norm_with_stats(weight, None, 1e-5).unwrap();
                        let saved = g
                            .layer_norm_backward_with_stats(&x, &mean, &rstd, weight)
                            .unwrap();
                        assert_eq!(saved, got, "{what}");
                    }
                    let want = g64.mul(&xhat).unwrap().sum(&batch, false).unwrap();
                    let got = g.layer_norm_weight_grad(&x, 1e-5).unwrap();
                    assert_eq!((got.shape(), got.dtype()), (&[d][..], dtype));
                    let rows = (x.numel() / d.max(1)) as f64;
                    assert_close(
                        &got,
                        &want.to_f64_vec(),
                        rows * 4.0 * tol(dtype),
                        &format!("weight grad {what}"),
                    );
                    let (_, mean, rstd) = x.layer_norm_with_stats(None, None, 1e-5).unwrap();
                    let saved = g.layer_norm_weight_grad_with_stats(&x, &mean, &rstd).unwrap();
                    assert_eq!(saved, got, "{what}");
                }
            };
        }
        case!([3, 5], 1, false);
        case!([3, 5], 0, false);
        case!([2, 3, 17], 2, false);
        case!([2, 3, 17], 1, true);
        case!([4, 1, 33], 2, true);
        case!([1], 0, false);
    }

    #[test]
    fn cross_entropy_backward_matches_probabilities() {
        for dtype in FLOATS {
            for (n, c, strided) in [(5, 7, false), (7, 5, true), (3, 33, false), (1, 1, false)] {
                let logits = if strided {
                    sample(&[c, n], dtype, 71)
                        .mul_scalar(3.0)
                        .unwrap()
                        .transpose(0, 1)
                        .unwrap()
                } else {
                    sample(&[n, c], dtype, 71).mul_scalar(3.0).unwrap()
                };
                let t: Vec<i64> = (0..n).map(|i| ((i * 5 + 2) % c) as i64).collect();
                let targets = Tensor::from_vec(t.clone(), &[n]).unwrap();
                let (_, probs) = logits.cross_entropy_with_grad(&targets, Reduction::Sum).unwrap();
                let mut want = probs.to_f64_vec();
                for (row, &k) in t.iter().enumerate() {
                    want[row * c + k as usize] -= 1.0;
                }
                want.iter_mut().for_each(|v| *v *= 0.37);
                let got = logits.cross_entropy_backward(&targets, 0.37).unwrap();
                assert_eq!((got.shape(), got.dtype()), (&[n, c][..], dtype));
                // From the kept probabilities: the same bits without the exponentials.
                let from_probs = probs.cross_entropy_backward_from_probs(&targets, 0.37).unwrap();
                assert_eq!(from_probs.to_f64_vec(), got.to_f64_vec(), "{n}x{c} {dtype} from probs");
                // Bit-identical to rounding the f64 chain once.
                let want = Tensor::from_vec(want, &[n, c]).unwrap().cast(dtype).unwrap();
                assert_eq!(got.to_f64_vec(), want.to_f64_vec(), "{n}x{c} {dtype}");
            }
        }
        let empty = Tensor::zeros(&[0, 3], DType::F32).unwrap();
        let t = Tensor::zeros(&[0], DType::I64).unwrap();
        assert_eq!(empty.cross_entropy_backward(&t, 1.0).unwrap().shape(), &[0, 3]);
        let x = sample(&[2, 4], DType::F32, 1);
        assert_eq!(
            x.cross_entropy_backward(&Tensor::from_vec(vec![1i64, 4], &[2]).unwrap(), 1.0)
                .unwrap_err()
                .to_string(),
            "cross_entropy: target 4 of row 1 is not a class of 0..4"
        );
        assert_eq!(
            x.cross_entropy_backward_from_probs(&Tensor::from_vec(vec![1i64, 4], &[2]).unwrap(), 1.0)
                .unwrap_err()
                .to_string(),
            "cross_entropy: target 4 of row 1 is not a class of 0..4"
        );
    }

    /// Kernels whose outputs come from the buffer cache write every element: a
    /// cached buffer full of NaN of the output's size changes nothing.
    #[test]
    fn recycled_outputs_are_overwritten() {
        use tessera_mesh::Buffer;
        // 2^19 f32 elements: 2 MiB, the smallest size that the cache keeps.
        let (x, g) = (
            sample(&[8, 256, 256], DType::F32, 81),
            sample(&[8, 256, 256], DType::F32, 82),
        );
        let w = sample(&[256], DType::F32, 83);
        let logits = x.reshape(&[2048, 256]).unwrap();
        let t = Tensor::from_vec((0..2048).map(|i| (i * 7 % 256) as i64).collect(), &[2048]).unwrap();
        type Op<'a> = Box<dyn Fn() -> Tensor + 'a>;
        let ops: Vec<(&str, Op<'_>)> = vec![
            ("gelu", Box::new(|| x.gelu().unwrap())),
            ("gelu_backward", Box::new(|| g.gelu_backward(&x).unwrap())),
            ("softmax", Box::new(|| x.softmax(2).unwrap())),
            ("log_softmax", Box::new(|| x.log_softmax(2).unwrap())),
            (
                "layer_norm",
                Box::new(|| x.layer_norm(Some(&w), Some(&w), 1e-5).unwrap()),
            ),
            ("softmax_backward", Box::new(|| g.softmax_backward(&x, 2).unwrap())),
            ("attention_probs", Box::new(|| x.attention_probs(0.5, true).unwrap())),
            (
                "attention_probs_backward",
                Box::new(|| g.attention_probs_backward(&x, 0.5, true).unwrap()),
            ),
            (
                "layer_norm_backward",
                Box::new(|| g.layer_norm_backward(&x, Some(&w), 1e-5).unwrap()),
            ),
            (
                "cross_entropy_backward",
                Box::new(|| logits.cross_entropy_backward(&t, 0.5).unwrap()),
            ),
            (
                "cross_entropy_with_grad",
                Box::new(|| logits.cross_entropy_with_grad(&t, Reduction::Sum).unwrap().1),
            ),
            (
                "cross_entropy_backward_from_probs",
                Box::new(|| logits.cross_entropy_backward_from_probs(&t, 0.5).unwrap()),
            ),
        ];
        for (name, op) in ops {
            let want = op().to_vec::<f32>().unwrap();
            crate::alloc::recycle(Buffer::F32(vec![f32::NAN; want.len()]));
            let got = op().to_vec::<f32>().unwrap();
            assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "{name}");
        }
    }

    /// The table gradient sums the rows of each index in f64 and rounds once;
    /// a shard keeps its own rows only; untouched rows are zero.
    #[test]
    fn embedding_dense_backward_sums_rows_per_index() {
        let (n, d, vocab) = (7, 3, 5);
        let idx = [3i64, 1, 3, 0, 3, 4, 1];
        let indices = Tensor::from_vec(idx.to_vec(), &[n]).unwrap();
        for dtype in [DType::F32, DType::BF16, DType::F64] {
            let g = sample(&[n, d], dtype, 11);
            let gv = g.to_f64_vec();
            // Reference: a dense f64 table, each row rounded to the dtype once.
            let mut want = vec![0f64; vocab * d];
            for (k, &i) in idx.iter().enumerate() {
                for j in 0..d {
                    want[i as usize * d + j] += gv[k * d + j];
                }
            }
            let want = Tensor::from_vec(want, &[vocab, d]).unwrap().cast(dtype).unwrap();
            let full = g.embedding_dense_backward(&indices, vocab, 0).unwrap();
            assert_eq!((full.shape(), full.dtype()), (&[vocab, d][..], dtype));
            assert_eq!(full.to_f64_vec(), want.to_f64_vec(), "{dtype}");
            // Rows 2..5 of the table: indices 0 and 1 belong to another shard.
            let shard = g.embedding_dense_backward(&indices, 3, 2).unwrap();
            assert_eq!(shard.to_f64_vec(), want.to_f64_vec()[2 * d..], "{dtype} shard");
        }
        // Row 2 is never named: it stays zero.
        let g = sample(&[n, d], DType::F32, 12);
        let out = g.embedding_dense_backward(&indices, vocab, 0).unwrap().to_f64_vec();
        assert!(out[2 * d..3 * d].iter().all(|&v| v == 0.0));
        // Bad input is named.
        let err = |r: Result<Tensor>| r.unwrap_err().to_string();
        assert!(
            err(g
                .reshape(&[n * d])
                .unwrap()
                .embedding_dense_backward(&indices, vocab, 0))
            .contains("[N, d]")
        );
        let short = Tensor::from_vec(vec![0i64; 2], &[2]).unwrap();
        assert!(err(g.embedding_dense_backward(&short, vocab, 0)).contains("needs indices of shape [7]"));
        let float_idx = sample(&[n], DType::F32, 1);
        assert!(matches!(
            g.embedding_dense_backward(&float_idx, vocab, 0),
            Err(Error::DTypeMismatch { .. })
        ));
    }

    #[test]
    fn fused_backward_errors() {
        let x = sample(&[2, 4], DType::F32, 1);
        let y = sample(&[4, 2], DType::F32, 1);
        assert_eq!(
            x.softmax_backward(&y, 1).unwrap_err().to_string(),
            "softmax_backward: shape mismatch: gradient has shape [2, 4] but the softmax output has [4, 2]; \
             they must be equal"
        );
        assert_eq!(
            x.softmax_backward(&x, 2).unwrap_err().to_string(),
            "softmax_backward: dim 2 is out of range for a tensor of rank 2"
        );
        assert_eq!(
            x.layer_norm_backward(&x, Some(&sample(&[3], DType::F32, 1)), 1e-5)
                .unwrap_err()
                .to_string(),
            "layer_norm_backward: shape mismatch: weight has shape [3] but the input's last dim is 4; pass a [4] weight"
        );
        let s = sample(&[], DType::F32, 1);
        assert!(s.layer_norm_weight_grad(&s, 1e-5).is_err());
    }

    #[test]
    fn layer_norm_backward_reads_the_statistics_it_is_given() {
        let x = sample(&[3, 8], DType::F32, 1)
            .mul_scalar(3.0)
            .unwrap()
            .add_scalar(0.5)
            .unwrap();
        let g = sample(&[3, 8], DType::F32, 2);
        let (_, mean, rstd) = x.layer_norm_with_stats(None, None, 1e-5).unwrap();
        let right = g.layer_norm_backward_with_stats(&x, &mean, &rstd, None).unwrap();
        let right_w = g.layer_norm_weight_grad_with_stats(&x, &mean, &rstd).unwrap();
        // Other statistics than the input's give other gradients: the kernels use
        // the ones passed in, not statistics recomputed from `x`.
        let shifted = mean.add_scalar(0.25).unwrap();
        let scaled = rstd.mul_scalar(2.0).unwrap();
        for (m, r) in [(&shifted, &rstd), (&mean, &scaled)] {
            assert_ne!(g.layer_norm_backward_with_stats(&x, m, r, None).unwrap(), right);
            assert_ne!(g.layer_norm_weight_grad_with_stats(&x, m, r).unwrap(), right_w);
        }
    }

    #[test]
    fn layer_norm_backward_with_stats_errors() {
        let x = sample(&[2, 4], DType::F32, 1);
        let (_, mean, rstd) = x.layer_norm_with_stats(None, None, 1e-5).unwrap();
        let err = |r: Result<Tensor>| r.unwrap_err().to_string();
        let wide = sample(&[2, 4], DType::F32, 3);
        assert_eq!(
            err(x.layer_norm_backward_with_stats(&x, &wide, &rstd, None)),
            "layer_norm_backward: shape mismatch: mean has shape [2, 4] but an input of shape [2, 4] has \
             statistics of shape [2, 1] (as layer_norm_with_stats returns them)"
        );
        assert_eq!(
            err(x.layer_norm_weight_grad_with_stats(&x, &mean, &rstd.cast(DType::F32).unwrap())),
            "layer_norm_weight_grad: expected dtype f64, got f32"
        );
        // bf16 inputs have f64 statistics too, as the forward returns them.
        let h = x.cast(DType::BF16).unwrap();
        let (_, hm, hr) = h.layer_norm_with_stats(None, None, 1e-5).unwrap();
        assert_eq!(hm.dtype(), DType::F64);
        assert!(h.layer_norm_backward_with_stats(&h, &hm, &hr, None).is_ok());
        assert_eq!(
            err(h.layer_norm_backward_with_stats(&h, &hm.cast(DType::BF16).unwrap(), &hr, None)),
            "layer_norm_backward: expected dtype f64, got bf16"
        );
        assert_eq!(
            err(x.layer_norm_backward_with_stats(&x, &mean, &rstd, Some(&sample(&[3], DType::F32, 1)))),
            "layer_norm_backward: shape mismatch: weight has shape [3] but the input's last dim is 4; pass a [4] weight"
        );
    }
}
