//! Row-wise helpers shared by the neural-network kernels and their gradients:
//! the row loop, softmax's exponentials, the causal cut, the checks of scores,
//! targets and indices, and layer norm's row statistics.

use tessera_mesh::DType;

use super::reduce::{row_max, sum_map_f64};
use super::{elements, output};
use crate::kernel::{Float, Real, Simd, exp, par_blocks, par_parts, zip_map_inline};
use crate::{Error, Result, Tensor};

/// Runs `f(r, rows, out, scratch)` on every row `r` of `dim` (moved last) of
/// the `N` inputs (one shape, checked by the caller), `rows` holding row `r` of
/// each, returning a tensor of that shape: the rows of contiguous inputs in
/// place when `dim` is last, otherwise through one transposed copy each way.
/// Rows are numbered in the order of the moved tensor (row `r` of a
/// `[..., T, S]` tensor along its last dim is query `r mod T`).
pub(super) fn map_rows<T: Float, S: Default, const N: usize>(
    op: &'static str,
    inputs: [&Tensor; N],
    dim: usize,
    f: impl Fn(usize, [&[T]; N], &mut [T], &mut S) + Sync + Copy,
) -> Result<Tensor> {
    let shape = inputs[0].shape();
    let last = shape.len() - 1;
    let moved = |t: &Tensor| {
        if dim == last {
            Ok(t.clone())
        } else {
            t.transpose(dim, last)
        }
    };
    let srcs = inputs.iter().map(|t| moved(t)).collect::<Result<Vec<_>>>()?;
    let xs = srcs.iter().map(elements::<T>).collect::<Result<Vec<_>>>()?;
    let src_shape = srcs[0].shape();
    let len = src_shape[last];
    // Every element is written below: a recycled buffer needs no zeroing.
    let mut out: Vec<T> = crate::alloc::reused(op, src_shape)?;
    if len > 0 {
        // Blocks of rows over the rank's threads, each with its own scratch `S`,
        // compiled for the CPU's widest vectors (`f` by value, so that it inlines).
        let (simd, xs) = (Simd::best(), &xs[..]);
        crate::kernel::par_rows(&mut out, len, |start, block| {
            simd.run(
                #[inline(always)]
                move || {
                    let mut scratch = S::default();
                    for (j, o) in block.chunks_exact_mut(len).enumerate() {
                        let at = start + j * len;
                        let rows: [&[T]; N] = std::array::from_fn(|i| &xs[i][at..at + len]);
                        f(start / len + j, rows, o, &mut scratch);
                    }
                },
            )
        });
    }
    let out = output(out, src_shape)?;
    if dim == last {
        Ok(out)
    } else {
        Ok(out.transpose(dim, last)?.contiguous())
    }
}

/// The row maximum and `Σ exp(x - max)` of a row (the sum in `f64`), leaving
/// the exponentials in `e` (one vectorisable pass, then the sum). For row
/// kernels inside [`Simd::run`].
#[inline(always)]
pub(super) fn row_exp_sum<T: Float>(row: &[T], e: &mut Vec<T::Acc>) -> (T::Acc, f64) {
    let max = row_max(row);
    // Every element is written below: only a change of length touches the buffer.
    e.resize(row.len(), T::Acc::ZERO);
    zip_map_inline(
        row,
        row,
        e,
        #[inline(always)]
        |x, _| exp(x.to_acc() - max),
    );
    (max, sum_map_f64(e, |v| v.widen()))
}

/// How many keys query `query` of a row of `len` keys sees: all of them, or
/// those at positions `<= query` under a causal mask.
#[inline(always)]
pub(super) fn causal_keep(is_causal: bool, query: usize, len: usize) -> usize {
    if is_causal { (query + 1).min(len) } else { len }
}

/// Errors unless `t` has rank >= 1 (ops over a dim or the last dim).
pub(super) fn need_dims(op: &'static str, t: &Tensor, what: &str) -> Result<()> {
    if t.rank() >= 1 {
        Ok(())
    } else {
        Err(Error::InvalidArgument {
            op,
            detail: format!("a rank-0 tensor has no {what}; reshape it to [1] first"),
        })
    }
}

/// Errors unless `scores` is `[..., T, S]` and `scale` finite (the attention kernels).
pub(super) fn check_scores(op: &'static str, scores: &Tensor, scale: f64) -> Result<()> {
    if scores.rank() < 2 {
        return Err(Error::InvalidArgument {
            op,
            detail: format!("scores must be [..., T, S], got shape {:?}", scores.shape()),
        });
    }
    if !scale.is_finite() {
        return Err(Error::InvalidArgument {
            op,
            detail: format!("the scale must be finite, got {scale}"),
        });
    }
    Ok(())
}

/// Checks cross entropy's `[N, C]` float logits against `[N]` `i64` targets in
/// `0..C`, returning `(N, C, targets)`.
pub(super) fn ce_targets<'a>(
    logits: &Tensor,
    targets: &'a Tensor,
) -> Result<(usize, usize, std::borrow::Cow<'a, [i64]>)> {
    const OP: &str = "cross_entropy";
    ce_shapes(logits, targets)?;
    let (n, c) = (logits.shape()[0], logits.shape()[1]);
    let t = elements::<i64>(targets)?;
    if let Some((row, &k)) = t.iter().enumerate().find(|&(_, &k)| k < 0 || k as u64 >= c as u64) {
        return Err(Error::InvalidArgument {
            op: OP,
            detail: format!("target {k} of row {row} is not a class of 0..{c}"),
        });
    }
    Ok((n, c, t))
}

/// Errors unless `w` (when given) is a `[d]` tensor of `x`'s dtype for `x`'s
/// last dim `d`: the weight of a norm over the last dim.
pub(super) fn check_norm_weight(op: &'static str, x: &Tensor, w: Option<&Tensor>) -> Result<()> {
    let Some(w) = w else { return Ok(()) };
    super::same_dtype(op, x, w)?;
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

/// The shape checks of [`ce_targets`] without reading the targets (for device
/// tensors, whose range the kernel checks).
pub(super) fn ce_shapes(logits: &Tensor, targets: &Tensor) -> Result<()> {
    const OP: &str = "cross_entropy";
    if logits.rank() != 2 {
        return Err(Error::InvalidArgument {
            op: OP,
            detail: format!(
                "logits must be [N, C], got shape {:?}; reshape to 2-D first",
                logits.shape()
            ),
        });
    }
    let n = logits.shape()[0];
    index_shape(OP, targets, n, || format!("logits {:?} need targets", logits.shape()))
}

/// The dtype and shape checks of [`index_vector`], without reading the entries.
pub(super) fn index_shape(op: &'static str, indices: &Tensor, n: usize, need: impl FnOnce() -> String) -> Result<()> {
    if indices.dtype() != DType::I64 {
        return Err(Error::DTypeMismatch {
            op,
            expected: DType::I64,
            got: indices.dtype(),
        });
    }
    if indices.shape() != [n] {
        return Err(Error::ShapeMismatch {
            op,
            detail: format!("{} of shape [{n}], got {:?}", need(), indices.shape()),
        });
    }
    Ok(())
}

/// The entries of `indices`, which must be an `i64` vector of `n`; `need` says
/// what asks for them (`"logits [4, 9] need targets"`) in the shape error.
pub(super) fn index_vector<'a>(
    op: &'static str,
    indices: &'a Tensor,
    n: usize,
    need: impl FnOnce() -> String,
) -> Result<std::borrow::Cow<'a, [i64]>> {
    index_shape(op, indices, n, need)?;
    elements::<i64>(indices)
}

/// `d` copies of `v`: scratch rows of a last dim that an empty input may make
/// larger than memory.
pub(super) fn filled(op: &'static str, d: usize, v: f64) -> Result<Vec<f64>> {
    let mut out = crate::alloc::zeroed::<f64>(op, &[d])?;
    out.fill(v);
    Ok(out)
}

/// [`row_stats`] of every `d`-element row of `xs`, in blocks of rows over the
/// rank's threads.
pub(super) fn all_row_stats<T: Float>(xs: &[T], d: usize, eps: f64) -> Vec<(f64, f64)> {
    let mut stats = vec![(0.0, 0.0); xs.len().checked_div(d).unwrap_or(0)];
    let simd = Simd::best();
    par_blocks(&mut stats, 1, par_parts(xs.len()), |start, block| {
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
pub(super) fn row_stats<T: Float>(row: &[T], eps: f64) -> (f64, f64) {
    let d = row.len() as f64;
    let mean = sum_map_f64(row, |v| v.wide()) / d;
    let var = sum_map_f64(row, |v| (v.wide() - mean).powi(2)) / d;
    (mean, 1.0 / (var + eps).sqrt())
}
