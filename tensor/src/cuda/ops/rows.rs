//! Kernels over rows and columns: reductions, the softmax family, layer
//! norm and RMSNorm, cross entropy.

use super::*;

// ---- reductions ----------------------------------------------------------------

/// Sum (`mean` scales by 1/count) or maximum of `t` over `dims` (sorted,
/// distinct, checked by the caller).
pub(crate) fn reduce(t: &Tensor, dims: &[usize], keepdim: bool, kind: Reduce) -> Result<Tensor> {
    let op = kind.op();
    let s = streams_for(op, &[t])?;
    let ty = kernel_dtype(op, t.dtype())?;
    let shape: Vec<usize> = (0..t.rank())
        .filter_map(|d| {
            if dims.contains(&d) {
                keepdim.then_some(1)
            } else {
                Some(t.shape()[d])
            }
        })
        .collect();
    // Sums over leading dims (bias gradients, means over a batch): column sums
    // of the contiguous tensor as [rows, n], without moving the reduced dims last.
    let leading = dims.iter().enumerate().all(|(i, &d)| d == i);
    if leading && kind != Reduce::Max && !dims.is_empty() && t.numel() > 0 {
        let rows: usize = dims.iter().map(|&d| t.shape()[d]).product();
        let n = t.numel() / rows;
        let x = contiguous(t)?;
        let out = empty(&s, &shape, t.dtype(), op)?;
        let scale = if kind == Reduce::Mean { 1.0 / rows as f64 } else { 1.0 };
        column_sums(&s, op, &out, &x, None, rows, n, scale)?;
        return Ok(out);
    }
    // The kept dims first, the reduced ones last: rows of `n` to reduce.
    let kept: Vec<usize> = (0..t.rank()).filter(|d| !dims.contains(d)).collect();
    let order: Vec<usize> = kept.iter().chain(dims).copied().collect();
    let x = contiguous(&t.permute(&order)?)?;
    let n: usize = dims.iter().map(|&d| t.shape()[d]).product();
    let rows: usize = kept.iter().map(|&d| t.shape()[d]).product();
    if n == 0 {
        let v = match kind {
            Reduce::Sum => 0.0,
            Reduce::Mean => f64::NAN,
            Reduce::Max => {
                return Err(Error::InvalidArgument {
                    op,
                    detail: format!("cannot take the maximum over an empty dim of {:?}", t.shape()),
                });
            }
        };
        return full(t.device(), &shape, v, t.dtype());
    }
    let out = empty(&s, &shape, t.dtype(), op)?;
    if rows > 0 {
        let (o, xp) = (ptr(&out), ptr(&x));
        let scale = if kind == Reduce::Mean { 1.0 / n as f64 } else { 1.0 };
        let is_max = i32::from(kind == Reduce::Max);
        let (r, nn) = (rows as i64, n as i64);
        launch!(
            s,
            op,
            format!("reduce_rows_{ty}"),
            grid_rows(rows, row_threads(n)),
            &o,
            &xp,
            &r,
            &nn,
            &scale,
            &is_max
        )?;
    }
    Ok(out)
}

/// What [`reduce`] computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Reduce {
    Sum,
    Mean,
    Max,
}

impl Reduce {
    fn op(self) -> &'static str {
        match self {
            Reduce::Sum => "sum",
            Reduce::Mean => "mean",
            Reduce::Max => "max",
        }
    }
}

// ---- softmax family ------------------------------------------------------------

/// `t` with `dim` moved last and made contiguous, and the permutation back.
fn dim_last(t: &Tensor, dim: usize) -> Result<(Tensor, Option<Vec<usize>>)> {
    let last = t.rank() - 1;
    if dim == last {
        return Ok((contiguous(t)?, None));
    }
    let mut order: Vec<usize> = (0..t.rank()).collect();
    order.swap(dim, last);
    Ok((contiguous(&t.permute(&order)?)?, Some(order)))
}

fn restore(t: Tensor, order: Option<Vec<usize>>) -> Result<Tensor> {
    match order {
        // A swap is its own inverse.
        Some(order) => contiguous(&t.permute(&order)?),
        None => Ok(t),
    }
}

/// Softmax or log-softmax of `scale · t` along `dim`, causal over rows of
/// `period` queries when `period > 0`.
pub(crate) fn softmax(t: &Tensor, dim: usize, scale: f64, period: usize, log: bool) -> Result<Tensor> {
    let op = if log { "log_softmax" } else { "softmax" };
    let s = streams_for(op, &[t])?;
    let ty = kernel_dtype(op, t.dtype())?;
    let (x, order) = dim_last(t, dim)?;
    let (rows, n) = rows_of(&x);
    let out = empty(&s, x.shape(), x.dtype(), op)?;
    if rows > 0 && n > 0 {
        let (o, xp) = (ptr(&out), ptr(&x));
        let (r, nn, p, lg) = (rows as i64, n as i64, period as i64, i32::from(log));
        let kernel = row_kernel("softmax", ty, rows, n);
        launch!(s, op, kernel.0, kernel.1, &o, &xp, &r, &nn, &scale, &p, &lg)?;
    }
    restore(out, order)
}

/// `scale · y · (g − Σ g·y)` along `dim`; causal over rows of `period`
/// queries when `period > 0` (masked keys get `0 · scale`, and `g` is not
/// read there, so it may hold anything).
pub(crate) fn softmax_backward(g: &Tensor, y: &Tensor, dim: usize, scale: f64, period: usize) -> Result<Tensor> {
    const OP: &str = "softmax_backward";
    let s = streams_for(OP, &[g, y])?;
    let ty = kernel_dtype(OP, g.dtype())?;
    let (gc, order) = dim_last(g, dim)?;
    let (yc, _) = dim_last(y, dim)?;
    let (rows, n) = rows_of(&gc);
    let out = empty(&s, gc.shape(), gc.dtype(), OP)?;
    if rows > 0 && n > 0 {
        let (o, gp, yp) = (ptr(&out), ptr(&gc), ptr(&yc));
        let (r, nn, p) = (rows as i64, n as i64, period as i64);
        let kernel = row_kernel("softmax_backward", ty, rows, n);
        launch!(s, OP, kernel.0, kernel.1, &o, &gp, &yp, &r, &nn, &scale, &p)?;
    }
    restore(out, order)
}

// ---- normalisation ------------------------------------------------------------------

fn opt_ptr(t: Option<&Tensor>) -> Result<(u64, Option<Tensor>)> {
    match t {
        Some(t) => {
            let c = contiguous(t)?;
            Ok((ptr(&c), Some(c)))
        }
        None => Ok((0, None)),
    }
}

/// Layer norm (`rms == false`) or RMSNorm of the last dim: `(y, mean, rstd)`,
/// the statistics f64 of shape `[..., 1]`.
pub(crate) fn norm(
    x: &Tensor,
    w: Option<&Tensor>,
    b: Option<&Tensor>,
    eps: f64,
    rms: bool,
) -> Result<(Tensor, Tensor, Tensor)> {
    let op = if rms { "rms_norm" } else { "layer_norm" };
    let mut all = vec![x];
    all.extend(w);
    all.extend(b);
    let s = streams_for(op, &all)?;
    let ty = kernel_dtype(op, x.dtype())?;
    let xc = contiguous(x)?;
    let (rows, n) = rows_of(x);
    let mut stat_shape = x.shape().to_vec();
    *stat_shape.last_mut().expect("rank checked by the caller") = 1;
    let out = empty(&s, x.shape(), x.dtype(), op)?;
    let mean = empty(&s, &stat_shape, DType::F64, op)?;
    let rstd = empty(&s, &stat_shape, DType::F64, op)?;
    if rows > 0 && n > 0 {
        let ((wp, _wk), (bp, _bk)) = (opt_ptr(w)?, opt_ptr(b)?);
        let (o, m, rs, xp) = (ptr(&out), ptr(&mean), ptr(&rstd), ptr(&xc));
        let (r, nn, is_rms) = (rows as i64, n as i64, i32::from(rms));
        let kernel = row_kernel("norm", ty, rows, n);
        launch!(
            s, op, kernel.0, kernel.1, &o, &m, &rs, &xp, &wp, &bp, &r, &nn, &eps, &is_rms
        )?;
    }
    Ok((out, mean, rstd))
}

/// The input gradient of layer norm or RMSNorm from the forward statistics.
pub(crate) fn norm_backward(
    g: &Tensor,
    x: &Tensor,
    w: Option<&Tensor>,
    mean: &Tensor,
    rstd: &Tensor,
    rms: bool,
) -> Result<Tensor> {
    let op = if rms {
        "rms_norm_backward"
    } else {
        "layer_norm_backward"
    };
    let mut all = vec![g, x, mean, rstd];
    all.extend(w);
    let s = streams_for(op, &all)?;
    let ty = kernel_dtype(op, x.dtype())?;
    let (gc, xc, mc, rc) = (contiguous(g)?, contiguous(x)?, contiguous(mean)?, contiguous(rstd)?);
    let (rows, n) = rows_of(x);
    let out = empty(&s, x.shape(), x.dtype(), op)?;
    if rows > 0 && n > 0 {
        let (wp, _wk) = opt_ptr(w)?;
        let (o, gp, xp, mp, rp) = (ptr(&out), ptr(&gc), ptr(&xc), ptr(&mc), ptr(&rc));
        let (r, nn, is_rms) = (rows as i64, n as i64, i32::from(rms));
        let kernel = row_kernel("norm_backward", ty, rows, n);
        launch!(s, op, kernel.0, kernel.1, &o, &gp, &xp, &wp, &mp, &rp, &r, &nn, &is_rms)?;
    }
    Ok(out)
}

/// `Σ_rows g · x̂`: the weight gradient of layer norm or RMSNorm, shape `[n]`.
pub(crate) fn norm_weight_grad(g: &Tensor, x: &Tensor, mean: &Tensor, rstd: &Tensor) -> Result<Tensor> {
    const OP: &str = "norm_weight_grad";
    let s = streams_for(OP, &[g, x, mean, rstd])?;
    let (gc, xc, mc, rc) = (contiguous(g)?, contiguous(x)?, contiguous(mean)?, contiguous(rstd)?);
    let (rows, n) = rows_of(x);
    let out = empty(&s, &[n], x.dtype(), OP)?;
    if n > 0 {
        column_sums(&s, OP, &out, &gc, Some((&xc, &mc, &rc)), rows, n, 1.0)?;
    }
    Ok(out)
}

/// Blocks of columns a column sum aims for: with few columns, the rows are cut
/// into chunks so that the whole GPU works (two 1024-thread blocks per
/// multiprocessor of a 132-SM Hopper, about).
const COLUMN_BLOCKS: usize = 256;

/// `out[j] = scale · Σ_r g[r, j]` over the contiguous `[rows, n]` `g`, or of
/// `g·x̂` with `norm = (x, mean, rstd)` (layer norm's weight gradient). Few
/// columns: the rows go in chunks to more blocks, whose f64 sums a second
/// kernel adds in chunk order.
#[allow(clippy::too_many_arguments)]
fn column_sums(
    s: &RankStreams,
    op: &'static str,
    out: &Tensor,
    g: &Tensor,
    norm: Option<(&Tensor, &Tensor, &Tensor)>,
    rows: usize,
    n: usize,
    scale: f64,
) -> Result<()> {
    let ty = kernel_dtype(op, g.dtype())?;
    let chunks = (COLUMN_BLOCKS / n.div_ceil(32)).clamp(1, rows.div_ceil(32).max(1));
    let chunk = rows.div_ceil(chunks).max(1);
    let chunks = rows.div_ceil(chunk).max(1);
    let parts = if chunks > 1 {
        Some(empty(s, &[chunks, n], DType::F64, op)?)
    } else {
        None
    };
    let (o, p, gp) = (ptr(out), parts.as_ref().map_or(0, ptr), ptr(g));
    let (xp, mp, rp) = norm.map_or((0, 0, 0), |(x, m, r)| (ptr(x), ptr(m), ptr(r)));
    let (r, nn, ch) = (rows as i64, n as i64, chunk as i64);
    launch!(
        s,
        op,
        format!("column_sums_{ty}"),
        grid_columns(n, chunks),
        &o,
        &p,
        &gp,
        &xp,
        &mp,
        &rp,
        &r,
        &nn,
        &ch,
        &scale
    )?;
    if parts.is_some() {
        let k = chunks as i64;
        launch!(
            s,
            op,
            format!("column_finish_{ty}"),
            grid_1d(n),
            &o,
            &p,
            &k,
            &nn,
            &scale
        )?;
    }
    Ok(())
}

// ---- cross entropy ---------------------------------------------------------------------

/// Cross entropy of logits `x` `[n, c]` against `targets` `[n]` (i64, on the
/// same GPU), and the probabilities when `probs` (shapes checked by the caller).
pub(crate) fn cross_entropy(
    x: &Tensor,
    targets: &Tensor,
    reduction: Reduction,
    probs: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    const OP: &str = "cross_entropy";
    let s = streams_for(OP, &[x, targets])?;
    let ty = kernel_dtype(OP, x.dtype())?;
    let (xc, tc) = (contiguous(x)?, contiguous(targets)?);
    let (n, c) = (x.shape()[0], x.shape()[1]);
    let losses = empty(&s, &[n], DType::F64, OP)?;
    let p = if probs {
        Some(empty(&s, &[n, c], x.dtype(), OP)?)
    } else {
        None
    };
    let bad = flag(&s, OP)?;
    if n > 0 {
        let (l, pp, xp, tp, bp) = (ptr(&losses), p.as_ref().map_or(0, ptr), ptr(&xc), ptr(&tc), ptr(&bad));
        let (r, cc) = (n as i64, c as i64);
        launch!(
            s,
            OP,
            format!("cross_entropy_rows_{ty}"),
            grid_rows(n, row_threads(c)),
            &l,
            &pp,
            &xp,
            &tp,
            &r,
            &cc,
            &bp
        )?;
    }
    check_flag(&s, bad, OP, targets, move |t, row| {
        format!("target {t} of row {row} is not a class of 0..{c}")
    })?;
    let loss = match reduction {
        Reduction::None => cast(&losses, x.dtype())?,
        Reduction::Sum | Reduction::Mean => {
            let scale = if reduction == Reduction::Mean {
                1.0 / n as f64
            } else {
                1.0
            };
            let total = empty(&s, &[], DType::F64, OP)?;
            let (o, lp, nn) = (ptr(&total), ptr(&losses), n as i64);
            launch!(s, OP, "sum_f64_ordered", grid_rows(1, 512), &o, &lp, &nn, &scale)?;
            if n == 0 && reduction == Reduction::Mean {
                full(x.device(), &[], f64::NAN, x.dtype())?
            } else {
                cast(&total, x.dtype())?
            }
        }
    };
    Ok((loss, p))
}

/// `scale · (p − onehot(targets))` from probabilities `p` `[n, c]`.
pub(crate) fn cross_entropy_backward_from_probs(p: &Tensor, targets: &Tensor, scale: f64) -> Result<Tensor> {
    const OP: &str = "cross_entropy_backward";
    let s = streams_for(OP, &[p, targets])?;
    let ty = kernel_dtype(OP, p.dtype())?;
    let (pc, tc) = (contiguous(p)?, contiguous(targets)?);
    let (n, c) = (p.shape()[0], p.shape()[1]);
    let out = empty(&s, &[n, c], p.dtype(), OP)?;
    if n * c > 0 {
        let (o, pp, tp) = (ptr(&out), ptr(&pc), ptr(&tc));
        let (r, cc) = (n as i64, c as i64);
        launch!(
            s,
            OP,
            format!("cross_entropy_backward_{ty}"),
            grid_rows(n, row_threads(c)),
            &o,
            &pp,
            &tp,
            &r,
            &cc,
            &scale
        )?;
    }
    Ok(out)
}
