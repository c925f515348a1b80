//! Neural-network ops: softmax, log-softmax, layer norm, embedding, cross
//! entropy and the causal attention mask.

use tessera_mesh::{DType, Element};

use super::fastmath::{exp, zip_map};
use super::reduce::{row_max, sum_f64, sum_map_f64};
use super::{Float, Real, any_dispatch, check_dim, elements, float_dispatch, output, same_dtype};
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

/// Runs `f` on every row of `dim` (moved last), returning a tensor of the
/// input's shape: the rows of a contiguous tensor in place when `dim` is last,
/// otherwise through one transposed copy each way.
fn map_rows<T: Float>(op: &'static str, t: &Tensor, dim: usize, mut f: impl FnMut(&[T], &mut [T])) -> Result<Tensor> {
    let last = t.rank() - 1;
    let src = if dim == last {
        t.clone()
    } else {
        t.transpose(dim, last)?
    };
    let x = elements::<T>(&src)?;
    let len = src.shape()[last];
    // Every element is written below: a recycled buffer needs no zeroing.
    let mut out: Vec<T> = crate::alloc::reused(op, src.shape())?;
    if len > 0 {
        for (row, o) in x.chunks_exact(len).zip(out.chunks_exact_mut(len)) {
            f(row, o);
        }
    }
    let out = output(out, src.shape())?;
    if dim == last {
        Ok(out)
    } else {
        Ok(out.transpose(dim, last)?.contiguous())
    }
}

/// The row maximum and `Σ exp(x - max)` of a row (the sum in `f64`), leaving
/// the exponentials in `e` (one vectorisable pass, then the sum).
pub(super) fn row_exp_sum<T: Float>(row: &[T], e: &mut Vec<T::Acc>) -> (T::Acc, f64) {
    let max = row_max(row);
    e.clear();
    e.resize(row.len(), T::Acc::ZERO);
    zip_map(
        row,
        row,
        e,
        #[inline(always)]
        |x, _| exp(x.to_acc() - max),
    );
    (max, sum_map_f64(e, |v| v.widen()))
}

/// Errors unless `t` has rank >= 1 (ops over a dim or the last dim).
fn need_dims(op: &'static str, t: &Tensor, what: &str) -> Result<()> {
    if t.rank() >= 1 {
        Ok(())
    } else {
        Err(Error::InvalidArgument {
            op,
            detail: format!("a rank-0 tensor has no {what}; reshape it to [1] first"),
        })
    }
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
            Some(p) => elements::<T>(p)?.iter().map(|v| v.to_f64()).collect(),
            None => super::nn_backward::filled("layer_norm", d, default)?,
        })
    };
    let (w, b) = (affine(weight, 1.0)?, affine(bias, 0.0)?);
    let rows = xs.len().checked_div(d).unwrap_or(0);
    // Every element is written below: a recycled buffer needs no zeroing.
    let mut out: Vec<T> = crate::alloc::reused("layer_norm", x.shape())?;
    let (mut means, mut rstds) = (Vec::with_capacity(rows), Vec::with_capacity(rows));
    if d > 0 {
        for (row, o) in xs.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
            // Two passes (mean, then squared deviations): no cancellation.
            let mean = sum_f64(row) / d as f64;
            let var = sum_map_f64(row, |v| (v.to_f64() - mean).powi(2)) / d as f64;
            let rstd = 1.0 / (var + eps).sqrt();
            for (((o, &v), &w), &b) in o.iter_mut().zip(row).zip(&w).zip(&b) {
                *o = <T as Float>::from_f64((v.to_f64() - mean) * rstd * w + b);
            }
            means.push(T::Acc::real(mean));
            rstds.push(T::Acc::real(rstd));
        }
    }
    let mut stat_shape = x.shape().to_vec();
    if let Some(last) = stat_shape.last_mut() {
        *last = 1;
    }
    if d == 0 {
        // An empty input can still have many rows (`[n, 0]`).
        means = crate::alloc::with_capacity("layer_norm", &stat_shape)?;
        // Allocated above, so the product fits.
        means.resize(stat_shape.iter().product(), T::Acc::real(f64::NAN));
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
    pub fn softmax(&self, dim: usize) -> Result<Tensor> {
        check_dim("softmax", dim, self.rank())?;
        float_dispatch!("softmax", self.dtype(), T => {
            // The exponentials in the compute type, so that half types round once.
            let mut e = Vec::new();
            map_rows::<T>("softmax", self, dim, |row, out| {
                let inv = 1.0 / row_exp_sum(row, &mut e).1;
                for (o, &v) in out.iter_mut().zip(&e) {
                    *o = <T as Float>::from_f64(v.widen() * inv);
                }
            })
        })
    }

    /// Log-softmax along `dim`: `x - max - ln Σ exp(x - max)`.
    /// PyTorch: `torch.log_softmax(x, dim)`.
    ///
    /// # Errors
    /// [`Error::DimOutOfRange`]; [`Error::InvalidArgument`] for integer tensors.
    pub fn log_softmax(&self, dim: usize) -> Result<Tensor> {
        check_dim("log_softmax", dim, self.rank())?;
        float_dispatch!("log_softmax", self.dtype(), T => {
            let mut e = Vec::new();
            map_rows::<T>("log_softmax", self, dim, |row, out| {
                let (max, sum) = row_exp_sum(row, &mut e);
                let lse = sum.ln();
                for (o, &x) in out.iter_mut().zip(row) {
                    *o = <T as Float>::from_f64((x.to_acc() - max).widen() - lse);
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
    /// have the input's shape with the last dim 1, in `f32` for `f32`, `bf16` and
    /// `f16` inputs and `f64` for `f64`. PyTorch: `torch.native_layer_norm`.
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
        Ok(self.cross_entropy_impl(targets, reduction, false)?.0)
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
        match self.cross_entropy_impl(targets, reduction, true)? {
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
    ) -> Result<(Tensor, Option<Tensor>)> {
        const OP: &str = "cross_entropy";
        let (n, c, t) = ce_targets(self, targets)?;
        float_dispatch!(OP, self.dtype(), T => {
            let x = elements::<T>(self)?;
            let mut losses = Vec::with_capacity(n);
            let mut p = Vec::with_capacity(if probs { n * c } else { 0 });
            let mut e = Vec::with_capacity(c);
            for (i, &k) in t.iter().enumerate() {
                let row = &x[i * c..(i + 1) * c];
                let (max, sum) = row_exp_sum(row, &mut e);
                losses.push(sum.ln() - (row[k as usize].to_acc() - max).widen());
                if probs {
                    // The softmax from the exponentials already at hand, as `softmax` does.
                    let inv = 1.0 / sum;
                    p.extend(e.iter().map(|&v| <T as Float>::from_f64(v.widen() * inv)));
                }
            }
            let loss = match reduction {
                Reduction::Mean => output(vec![<T as Float>::from_f64(losses.iter().sum::<f64>() / n as f64)], &[])?,
                Reduction::Sum => output(vec![<T as Float>::from_f64(losses.iter().sum::<f64>())], &[])?,
                Reduction::None => output(losses.into_iter().map(<T as Float>::from_f64).collect(), &[n])?,
            };
            let p = if probs { Some(output(p, &[n, c])?) } else { None };
            Ok((loss, p))
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
        let (t, s) = (self.shape()[self.rank() - 2], self.shape()[self.rank() - 1]);
        float_dispatch!("causal_mask", self.dtype(), T => {
            let mut out = elements::<T>(self)?.into_owned();
            let fill = <T as Float>::from_f64(fill);
            if t * s > 0 {
                for block in out.chunks_exact_mut(t * s) {
                    for (i, row) in block.chunks_exact_mut(s).enumerate() {
                        row.iter_mut().skip(i + 1).for_each(|x| *x = fill);
                    }
                }
            }
            output(out, self.shape())
        })
    }
}

/// Checks cross entropy's `[N, C]` float logits against `[N]` `i64` targets in
/// `0..C`, returning `(N, C, targets)`.
pub(super) fn ce_targets<'a>(
    logits: &Tensor,
    targets: &'a Tensor,
) -> Result<(usize, usize, std::borrow::Cow<'a, [i64]>)> {
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
    if targets.dtype() != DType::I64 {
        return Err(Error::DTypeMismatch {
            op: OP,
            expected: DType::I64,
            got: targets.dtype(),
        });
    }
    let (n, c) = (logits.shape()[0], logits.shape()[1]);
    if targets.shape() != [n] {
        return Err(Error::ShapeMismatch {
            op: OP,
            detail: format!(
                "logits {:?} need targets of shape [{n}], got {:?}",
                logits.shape(),
                targets.shape()
            ),
        });
    }
    let t = elements::<i64>(targets)?;
    if let Some((row, &k)) = t.iter().enumerate().find(|&(_, &k)| k < 0 || k as u64 >= c as u64) {
        return Err(Error::InvalidArgument {
            op: OP,
            detail: format!("target {k} of row {row} is not a class of 0..{c}"),
        });
    }
    Ok((n, c, t))
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

#[cfg(test)]
mod tests {
    use half::bf16;
    use tessera_mesh::DType;

    use super::*;
    use crate::ops::testutil::{assert_close, sample, tol};

    const FLOATS: [DType; 4] = [DType::F32, DType::F64, DType::BF16, DType::F16];

    /// `f` applied to every row of the last dim of `x` (shape `shape`), in f64.
    fn rows(x: &[f64], len: usize, f: impl Fn(&[f64]) -> Vec<f64>) -> Vec<f64> {
        x.chunks(len.max(1)).flat_map(f).collect()
    }

    fn softmax_ref(r: &[f64]) -> Vec<f64> {
        let m = r.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let s: f64 = r.iter().map(|x| (x - m).exp()).sum();
        r.iter().map(|x| (x - m).exp() / s).collect()
    }

    fn log_softmax_ref(r: &[f64]) -> Vec<f64> {
        softmax_ref(r).iter().map(|p| p.ln()).collect()
    }

    #[test]
    fn softmax_table() {
        type Method = fn(&Tensor, usize) -> Result<Tensor>;
        type Reference = fn(&[f64]) -> Vec<f64>;
        let ops: [(&str, Method, Reference); 2] = [
            ("softmax", Tensor::softmax, softmax_ref),
            ("log_softmax", Tensor::log_softmax, log_softmax_ref),
        ];
        macro_rules! case {
            ($t:expr, $dim:expr) => {
                for dtype in FLOATS {
                    let t: Tensor = $t(dtype);
                    for (name, method, f) in ops {
                        let got = method(&t, $dim).unwrap();
                        assert_eq!((got.shape(), got.dtype()), (t.shape(), dtype));
                        // Reference: move `dim` last, apply per row, move back.
                        let last = t.rank() - 1;
                        let moved = t.transpose($dim, last).unwrap();
                        let want = rows(&moved.to_f64_vec(), moved.shape()[last], f);
                        let want = Tensor::from_vec(want, moved.shape())
                            .unwrap()
                            .transpose($dim, last)
                            .unwrap();
                        let what = format!("{name} {:?} dim {} {dtype}", t.shape(), $dim);
                        assert_close(&got, &want.to_f64_vec(), 2.0 * tol(dtype), &what);
                    }
                }
            };
        }
        let s = |shape: &'static [usize]| move |d| sample(shape, d, 31).mul_scalar(3.0).unwrap();
        case!(s(&[2, 5]), 1);
        case!(s(&[2, 5]), 0);
        case!(s(&[2, 3, 4]), 1);
        case!(s(&[7]), 0);
        case!(s(&[3, 0]), 1);
        case!(s(&[0, 3]), 1);
        case!(|d| s(&[4, 3])(d).transpose(0, 1).unwrap(), 1);
        // Large logits stay finite (max-subtracted).
        let big = Tensor::from_vec(vec![1000.0f32, 1001.0, 1002.0], &[1, 3]).unwrap();
        assert_close(&big.softmax(1).unwrap(), &softmax_ref(&[0.0, 1.0, 2.0]), 1e-6, "large");
        let rowsum = sample(&[6, 50], DType::F32, 3)
            .softmax(1)
            .unwrap()
            .sum(&[1], false)
            .unwrap();
        assert_close(&rowsum, &[1.0; 6], 1e-6, "rows sum to 1");
        // -inf entries (a causal mask) get probability 0.
        let masked = Tensor::from_vec(vec![0.0f32, f32::NEG_INFINITY], &[2]).unwrap();
        assert_eq!(masked.softmax(0).unwrap().to_vec::<f32>().unwrap(), vec![1.0, 0.0]);
    }

    #[test]
    fn layer_norm_table() {
        // A known vector: mean 2.5, biased variance 1.25.
        let x = Tensor::from_vec(vec![1.0f64, 2.0, 3.0, 4.0], &[1, 4]).unwrap();
        let (y, mean, rstd) = x.layer_norm_with_stats(None, None, 0.0).unwrap();
        let r = 1.0 / 1.25f64.sqrt();
        assert_close(&y, &[-1.5 * r, -0.5 * r, 0.5 * r, 1.5 * r], 1e-15, "known");
        assert_eq!((mean.shape(), mean.to_vec::<f64>().unwrap()), (&[1, 1][..], vec![2.5]));
        assert_close(&rstd, &[r], 1e-15, "rstd");
        for dtype in FLOATS {
            let x = sample(&[3, 4, 8], dtype, 41);
            let w = sample(&[8], dtype, 42);
            let b = sample(&[8], dtype, 43);
            for (xs, w, b) in [
                (x.clone(), Some(&w), Some(&b)),
                (x.clone(), None, None),
                (x.transpose(0, 1).unwrap(), Some(&w), None),
            ] {
                let (wv, bv) = (w.map(|w| w.to_f64_vec()), b.map(|b| b.to_f64_vec()));
                let want = rows(&xs.to_f64_vec(), 8, |r| {
                    let m = r.iter().sum::<f64>() / 8.0;
                    let v = r.iter().map(|x| (x - m).powi(2)).sum::<f64>() / 8.0;
                    (0..8)
                        .map(|j| {
                            let y = (r[j] - m) / (v + 1e-5).sqrt();
                            y * wv.as_ref().map_or(1.0, |w| w[j]) + bv.as_ref().map_or(0.0, |b| b[j])
                        })
                        .collect()
                });
                let (got, mean, rstd) = xs.layer_norm_with_stats(w, b, 1e-5).unwrap();
                assert_eq!((got.shape(), got.dtype()), (xs.shape(), dtype));
                assert_eq!(mean.shape(), &[xs.shape()[0], xs.shape()[1], 1]);
                let acc = if dtype == DType::F64 { DType::F64 } else { DType::F32 };
                assert_eq!((mean.dtype(), rstd.dtype()), (acc, acc));
                assert_close(&got, &want, 2.0 * tol(dtype), &format!("layer_norm {dtype}"));
                assert_eq!(got, xs.layer_norm(w, b, 1e-5).unwrap());
            }
        }
        let e = Tensor::zeros(&[0, 4], DType::F32)
            .unwrap()
            .layer_norm(None, None, 1e-5)
            .unwrap();
        assert_eq!(e.shape(), &[0, 4]);
    }

    #[test]
    fn embedding_table() {
        let w = Tensor::arange(12, DType::F32).unwrap().reshape(&[4, 3]).unwrap();
        macro_rules! case {
            ($idx:expr, $shape:expr, $want:expr) => {
                let idx = Tensor::from_vec($idx.to_vec(), &$shape).unwrap();
                let got = w.embedding(&idx).unwrap();
                let mut shape = $shape.to_vec();
                shape.push(3);
                assert_eq!(got.shape(), &shape[..]);
                let want: Vec<f32> = $want;
                assert_eq!(got.to_vec::<f32>().unwrap(), want);
            };
        }
        case!([2i64], [1], vec![6.0, 7.0, 8.0]);
        case!(
            [3i64, 0, 3, 1],
            [2, 2],
            vec![9., 10., 11., 0., 1., 2., 9., 10., 11., 3., 4., 5.]
        );
        case!([1i64], [0usize; 0], vec![3.0, 4.0, 5.0]);
        case!([0i64; 0], [0], vec![]);
        // A strided table, and other dtypes.
        let wt = w.transpose(0, 1).unwrap(); // [3, 4]
        let idx = Tensor::from_vec(vec![2i64, 0], &[2]).unwrap();
        assert_eq!(
            wt.embedding(&idx).unwrap().to_vec::<f32>().unwrap(),
            vec![2., 5., 8., 11., 0., 3., 6., 9.]
        );
        let wb = w.cast(DType::BF16).unwrap();
        assert_eq!(
            wb.embedding(&idx).unwrap().to_vec::<bf16>().unwrap()[0],
            bf16::from_f32(6.0)
        );
    }

    #[test]
    fn cross_entropy_table() {
        // Uniform logits over C classes: the loss is ln C in every dtype.
        for dtype in FLOATS {
            let logits = Tensor::full(&[3, 10], 0.7, dtype).unwrap();
            let t = Tensor::from_vec(vec![0i64, 9, 4], &[3]).unwrap();
            for red in [Reduction::Mean, Reduction::Sum] {
                let loss = logits.cross_entropy(&t, red).unwrap();
                assert_eq!((loss.shape(), loss.dtype()), (&[][..], dtype));
                let want = 10f64.ln() * if red == Reduction::Sum { 3.0 } else { 1.0 };
                assert_close(&loss, &[want], tol(dtype), &format!("uniform {dtype} {red:?}"));
            }
        }
        // Random logits against the f64 reference, strided.
        for dtype in FLOATS {
            let logits = sample(&[7, 5], dtype, 51)
                .mul_scalar(2.0)
                .unwrap()
                .transpose(0, 1)
                .unwrap(); // [5, 7]
            let t = Tensor::from_vec(vec![0i64, 6, 3, 3, 1], &[5]).unwrap();
            let x = logits.to_f64_vec();
            let want: Vec<f64> = (0..5)
                .map(|i| {
                    let r = &x[i * 7..(i + 1) * 7];
                    -log_softmax_ref(r)[t.to_vec::<i64>().unwrap()[i] as usize]
                })
                .collect();
            let none = logits.cross_entropy(&t, Reduction::None).unwrap();
            assert_eq!(none.shape(), &[5]);
            assert_close(&none, &want, tol(dtype), &format!("none {dtype}"));
            let (mean, probs) = logits.cross_entropy_with_grad(&t, Reduction::Mean).unwrap();
            assert_close(
                &mean,
                &[want.iter().sum::<f64>() / 5.0],
                tol(dtype),
                &format!("mean {dtype}"),
            );
            assert_close(
                &probs,
                &logits.softmax(1).unwrap().to_f64_vec(),
                tol(dtype),
                &format!("probs {dtype}"),
            );
        }
        let empty = Tensor::zeros(&[0, 3], DType::F32).unwrap();
        let t = Tensor::zeros(&[0], DType::I64).unwrap();
        assert!(
            empty
                .cross_entropy(&t, Reduction::Mean)
                .unwrap()
                .to_vec::<f32>()
                .unwrap()[0]
                .is_nan()
        );
        assert_eq!(
            empty
                .cross_entropy(&t, Reduction::Sum)
                .unwrap()
                .to_vec::<f32>()
                .unwrap(),
            vec![0.0]
        );
    }

    #[test]
    fn causal_mask_table() {
        macro_rules! case {
            ($shape:expr, $want:expr) => {
                let n: usize = $shape.iter().product();
                let t = Tensor::arange(n, DType::F32).unwrap().reshape(&$shape).unwrap();
                let got = t.causal_mask(-1.0).unwrap();
                assert_eq!(got.shape(), &$shape[..]);
                let want: Vec<f32> = $want;
                assert_eq!(got.to_vec::<f32>().unwrap(), want);
            };
        }
        case!([2, 2], vec![0., -1., 2., 3.]);
        case!([2, 3], vec![0., -1., -1., 3., 4., -1.]);
        case!([3, 2], vec![0., -1., 2., 3., 4., 5.]);
        case!([2, 2, 2], vec![0., -1., 2., 3., 4., -1., 6., 7.]);
        case!([0, 2], vec![]);
        let s = sample(&[2, 3, 3], DType::BF16, 1).transpose(1, 2).unwrap();
        let m = s.causal_mask(f64::NEG_INFINITY).unwrap();
        let (x, y) = (s.to_f64_vec(), m.to_f64_vec());
        for (k, (&a, &b)) in x.iter().zip(&y).enumerate() {
            let (i, j) = ((k / 3) % 3, k % 3);
            assert_eq!(b, if j > i { f64::NEG_INFINITY } else { a }, "element {k}");
        }
    }

    #[test]
    fn nn_errors() {
        macro_rules! case {
            ($res:expr, $msg:expr) => {
                assert_eq!($res.unwrap_err().to_string(), $msg);
            };
        }
        let x = sample(&[2, 4], DType::F32, 1);
        case!(x.softmax(2), "softmax: dim 2 is out of range for a tensor of rank 2");
        case!(
            x.log_softmax(5),
            "log_softmax: dim 5 is out of range for a tensor of rank 2"
        );
        case!(
            x.layer_norm(Some(&sample(&[3], DType::F32, 1)), None, 1e-5),
            "layer_norm: shape mismatch: weight has shape [3] but input [2, 4] normalizes a last dim of 4; \
             pass a [4] weight"
        );
        case!(
            x.layer_norm(None, Some(&sample(&[4], DType::F64, 1)), 1e-5),
            "layer_norm: expected dtype f32, got f64"
        );
        case!(
            sample(&[], DType::F32, 1).layer_norm(None, None, 1e-5),
            "layer_norm: a rank-0 tensor has no dim to normalize; reshape it to [1] first"
        );
        let idx = Tensor::from_vec(vec![1i64, 4, 0], &[3]).unwrap();
        case!(
            x.embedding(&idx),
            "embedding: index 4 (element 1 of indices of shape [3]) is out of range for a table of 2 rows; \
             indices must be in 0..2"
        );
        case!(
            x.embedding(&Tensor::from_vec(vec![-1i64], &[1]).unwrap()),
            "embedding: index -1 (element 0 of indices of shape [1]) is out of range for a table of 2 rows; \
             indices must be in 0..2"
        );
        case!(x.embedding(&x), "embedding: expected dtype i64, got f32");
        case!(
            sample(&[4], DType::F32, 1).embedding(&idx),
            "embedding: the table must be [V, D], got shape [4]"
        );
        let t = Tensor::from_vec(vec![1i64, 3], &[2]).unwrap();
        case!(
            x.cross_entropy(&Tensor::from_vec(vec![1i64, 4], &[2]).unwrap(), Reduction::Mean),
            "cross_entropy: target 4 of row 1 is not a class of 0..4"
        );
        case!(
            x.cross_entropy(&idx, Reduction::Sum),
            "cross_entropy: shape mismatch: logits [2, 4] need targets of shape [2], got [3]"
        );
        case!(
            x.reshape(&[8]).unwrap().cross_entropy(&t, Reduction::Mean),
            "cross_entropy: logits must be [N, C], got shape [8]; reshape to 2-D first"
        );
        case!(
            x.cross_entropy(&x, Reduction::Mean),
            "cross_entropy: expected dtype i64, got f32"
        );
        case!(
            t.cast(DType::I64)
                .unwrap()
                .reshape(&[1, 2])
                .unwrap()
                .cross_entropy(&Tensor::zeros(&[1], DType::I64).unwrap(), Reduction::Mean),
            "cross_entropy: dtype i64 is not a floating-point type; cast the tensor to a float dtype first"
        );
        case!(
            sample(&[3], DType::F32, 1).causal_mask(0.0),
            "causal_mask: scores must be [..., T, S], got shape [3]"
        );
    }
}
