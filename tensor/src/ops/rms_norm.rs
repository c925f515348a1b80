//! RMSNorm over the last dim, and its gradients.
//!
//! `y = round(round(x · r) · w)` with `r = 1 / √(mean(x²) + eps)` per row: the
//! normalisation in the compute type (`f32` for `f32`, `bf16` and `f16`),
//! rounded to the dtype, then the weight, as PyTorch's reference LLaMA does
//! (`(x.float() * rsqrt(x.float().pow(2).mean(-1) + eps)).type_as(x) * w`).
//! The mean of squares accumulates in `f64`.

use super::reduce::sum_map_f64;
use super::rows::{check_norm_weight as check_weight, map_rows, need_dims};
use super::{elements, output, same_shape};
use crate::kernel::{Float, Real, Simd, float_dispatch, par_blocks, par_parts};
use crate::{DType, Error, Result, Tensor};

const OP: &str = "rms_norm";

/// Errors unless `rstd` is `x`'s shape with the last dim 1.
fn check_stats(op: &'static str, x: &Tensor, rstd: &Tensor) -> Result<()> {
    let mut want = x.shape().to_vec();
    if let Some(last) = want.last_mut() {
        *last = 1;
    }
    if rstd.shape() != &want[..] {
        return Err(Error::ShapeMismatch {
            op,
            detail: format!(
                "rstd has shape {:?}; the input {:?} needs {want:?}",
                rstd.shape(),
                x.shape()
            ),
        });
    }
    Ok(())
}

/// `1 / √(mean(row²) + eps)` in `f64` (the squares summed in eight lanes).
#[inline(always)]
fn row_rstd<T: Float>(row: &[T], eps: f64) -> f64 {
    let ms = sum_map_f64(row, |v| v.wide() * v.wide()) / row.len() as f64;
    1.0 / (ms + eps).sqrt()
}

/// The normalised value of `x` before the weight, rounded to `T`.
#[inline(always)]
fn normalized<T: Float>(x: T, r: T::Acc) -> T {
    T::from_acc(x.to_acc() * r)
}

impl Tensor {
    /// RMSNorm over the last dim with an optional `[D]` weight (see the
    /// module docs for the rounding). PyTorch: `torch.nn.functional.rms_norm`
    /// (`torch.nn.RMSNorm`).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for rank 0 or integer tensors;
    /// [`Error::ShapeMismatch`] / [`Error::DTypeMismatch`] for a weight that does not fit.
    pub fn rms_norm(&self, weight: Option<&Tensor>, eps: f64) -> Result<Tensor> {
        Ok(self.rms_norm_with_stats(weight, eps)?.0)
    }

    /// [`rms_norm`](Self::rms_norm), also returning each row's `rstd`
    /// (`f64`, shaped as the input with the last dim 1) for the backward.
    ///
    /// # Errors
    /// As [`rms_norm`](Self::rms_norm).
    pub fn rms_norm_with_stats(&self, weight: Option<&Tensor>, eps: f64) -> Result<(Tensor, Tensor)> {
        need_dims(OP, self, "dim to normalize")?;
        check_weight(OP, self, weight)?;
        let inputs: Vec<&Tensor> = [Some(self), weight].into_iter().flatten().collect();
        if let Some(out) = super::meta_float(OP, &inputs, self.shape(), self.dtype()) {
            let stats = super::nn::row_stats_shape(self.shape());
            return Ok((out?, Tensor::meta(&stats, DType::F64)?));
        }
        #[cfg(feature = "cuda")]
        if self.is_cuda() {
            let (y, _mean, rstd) = crate::cuda::ops::norm(self, weight, None, eps, true)?;
            return Ok((y, rstd));
        }
        let d = self.shape()[self.rank() - 1];
        let mut stat_shape = self.shape().to_vec();
        stat_shape[self.rank() - 1] = 1;
        float_dispatch!(OP, self.dtype(), T => {
            let x = elements::<T>(self)?;
            let w = weight.map(elements::<T>).transpose()?;
            let mut rstds = vec![f64::NAN; stat_shape.iter().product()];
            if d > 0 {
                // Each row's rstd, then the rows normalised, in blocks of rows
                // over the rank's threads with the CPU's widest vectors.
                let (simd, x) = (Simd::best(), &x[..]);
                par_blocks(&mut rstds, 1, par_parts(x.len()), |start, block| {
                    simd.run(
                        #[inline(always)]
                        || {
                            for (s, row) in block.iter_mut().zip(x[start * d..].chunks_exact(d)) {
                                *s = row_rstd(row, eps);
                            }
                        },
                    )
                });
            }
            let (rs, w) = (&rstds[..], w.as_deref());
            let y = map_rows::<T, (), 1>(
                OP,
                [self],
                self.rank() - 1,
                #[inline(always)]
                |i, [row], o, _| {
                    let r = <T as Float>::Acc::real(rs[i]);
                    match w {
                        Some(w) => {
                            for ((o, &v), &wj) in o.iter_mut().zip(row).zip(w) {
                                *o = T::from_acc(normalized(v, r).to_acc() * wj.to_acc());
                            }
                        }
                        None => {
                            for (o, &v) in o.iter_mut().zip(row) {
                                *o = normalized(v, r);
                            }
                        }
                    }
                },
            )?;
            Ok((y, output(rstds, &stat_shape)?))
        })
    }

    /// The input gradient of [`rms_norm`](Self::rms_norm) for the output
    /// gradient `self`, from the forward's `rstd`: with `h = g·w` and
    /// `x̂ = x·r`, `r · (h − x̂ · mean(h·x̂))` per row (in `f64`).
    ///
    /// # Errors
    /// Shapes or dtypes that do not fit.
    pub fn rms_norm_backward_with_stats(&self, x: &Tensor, rstd: &Tensor, weight: Option<&Tensor>) -> Result<Tensor> {
        const OP: &str = "rms_norm_backward";
        self.check_rms_backward(OP, x, rstd)?;
        check_weight(OP, x, weight)?;
        if let Some(out) = super::meta_float(OP, &[self, x, rstd], x.shape(), self.dtype()) {
            return out;
        }
        #[cfg(feature = "cuda")]
        if self.is_cuda() {
            let mean = Tensor::assemble(rstd.shape(), DType::F64, rstd.device(), &[])?;
            return crate::cuda::ops::norm_backward(self, x, weight, &mean, rstd, true);
        }
        let d = x.shape()[x.rank() - 1];
        float_dispatch!(OP, self.dtype(), T => {
            let r = elements::<f64>(rstd)?;
            let w = weight.map(elements::<T>).transpose()?;
            let (rs, w) = (&r[..], w.as_deref());
            // Per row, in blocks of rows over the rank's threads: `h = g·w`,
            // `mean(h·x̂)` summed in eight lanes, then each element.
            map_rows::<T, [Vec<f64>; 2], 2>(
                OP,
                [self, x],
                x.rank() - 1,
                #[inline(always)]
                |i, [gr, xr], o, [h, hx]| {
                    let r = rs[i];
                    h.clear();
                    match w {
                        Some(w) => h.extend(gr.iter().zip(w).map(|(&g, &w)| g.wide() * w.wide())),
                        None => h.extend(gr.iter().map(|&g| g.wide())),
                    }
                    hx.clear();
                    hx.extend(h.iter().zip(xr).map(|(&h, &x)| h * x.wide() * r));
                    let dot = sum_map_f64(hx, |v| v) / d as f64;
                    for ((o, &h), &x) in o.iter_mut().zip(h.iter()).zip(xr) {
                        *o = T::from_wide(r * (h - x.wide() * r * dot));
                    }
                },
            )
        })
    }

    /// The weight gradient of [`rms_norm`](Self::rms_norm), `Σ_rows g · x̂`
    /// with `x̂` the normalised input rounded to the dtype as the forward
    /// rounds it, shape `[D]`; `self` is the output's gradient.
    ///
    /// # Errors
    /// Shapes or dtypes that do not fit.
    pub fn rms_norm_weight_grad_with_stats(&self, x: &Tensor, rstd: &Tensor) -> Result<Tensor> {
        const OP: &str = "rms_norm_weight_grad";
        self.check_rms_backward(OP, x, rstd)?;
        if let Some(out) = super::meta_float(OP, &[self, x, rstd], &[x.shape()[x.rank() - 1]], self.dtype()) {
            return out;
        }
        #[cfg(feature = "cuda")]
        if self.is_cuda() {
            let mean = Tensor::assemble(rstd.shape(), DType::F64, rstd.device(), &[])?;
            return crate::cuda::ops::norm_weight_grad(self, x, &mean, rstd);
        }
        let d = x.shape()[x.rank() - 1];
        float_dispatch!(OP, self.dtype(), T => {
            let (g, xs, r) = (elements::<T>(self)?, elements::<T>(x)?, elements::<f64>(rstd)?);
            let mut acc = vec![0f64; d];
            if d > 0 {
                // Blocks of columns over the rank's threads, each column
                // summing its rows in order as on one thread.
                let (g, xs) = (&g[..], &xs[..]);
                crate::kernel::par_columns(&mut acc, g.len(), |c0, cols| {
                    for ((gr, xr), &r) in g.chunks_exact(d).zip(xs.chunks_exact(d)).zip(r.iter()) {
                        let r = <T as Float>::Acc::real(r);
                        for (a, (&gv, &xv)) in cols.iter_mut().zip(gr[c0..].iter().zip(&xr[c0..])) {
                            *a += gv.wide() * normalized(xv, r).wide();
                        }
                    }
                });
            }
            output(acc.into_iter().map(T::from_wide).collect::<Vec<T>>(), &[d])
        })
    }

    fn check_rms_backward(&self, op: &'static str, x: &Tensor, rstd: &Tensor) -> Result<()> {
        need_dims(op, x, "dim to normalize")?;
        same_shape(op, self, x, "the input")?;
        check_stats(op, x, rstd)?;
        if rstd.dtype() != DType::F64 {
            return Err(Error::DTypeMismatch {
                op,
                expected: DType::F64,
                got: rstd.dtype(),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testutil::sample;

    /// Against the formula in f64 on the same values, and the gradients
    /// against central differences of `Σ y·c` (f64 tensors).
    #[test]
    fn forward_and_gradients() {
        let (x, w) = (sample(&[5, 7], DType::F64, 1), sample(&[7], DType::F64, 2));
        let eps = 1e-5;
        let (y, rstd) = x.rms_norm_with_stats(Some(&w), eps).unwrap();
        let (xv, wv, yv) = (x.to_f64_vec(), w.to_f64_vec(), y.to_f64_vec());
        for i in 0..5 {
            let row = &xv[i * 7..(i + 1) * 7];
            let r = 1.0 / (row.iter().map(|v| v * v).sum::<f64>() / 7.0 + eps).sqrt();
            assert!((rstd.to_f64_vec()[i] - r).abs() < 1e-15);
            for j in 0..7 {
                assert!((yv[i * 7 + j] - row[j] * r * wv[j]).abs() < 1e-14, "{i},{j}");
            }
        }
        // d/dx and d/dw of L = Σ y·c by central differences.
        let c = sample(&[5, 7], DType::F64, 3);
        let loss = |x: &Tensor, w: &Tensor| -> f64 {
            let y = x.rms_norm(Some(w), eps).unwrap().to_f64_vec();
            y.iter().zip(c.to_f64_vec()).map(|(a, b)| a * b).sum()
        };
        let gx = c
            .rms_norm_backward_with_stats(&x, &rstd, Some(&w))
            .unwrap()
            .to_f64_vec();
        let gw = c.rms_norm_weight_grad_with_stats(&x, &rstd).unwrap().to_f64_vec();
        let h = 1e-6;
        for k in 0..35 {
            let bump = |s: f64| {
                let mut v = xv.clone();
                v[k] += s;
                Tensor::from_vec(v, &[5, 7]).unwrap()
            };
            let num = (loss(&bump(h), &w) - loss(&bump(-h), &w)) / (2.0 * h);
            assert!((gx[k] - num).abs() < 1e-7, "dx[{k}]: {} vs {num}", gx[k]);
        }
        for k in 0..7 {
            let bump = |s: f64| {
                let mut v = wv.clone();
                v[k] += s;
                Tensor::from_vec(v, &[7]).unwrap()
            };
            let num = (loss(&x, &bump(h)) - loss(&x, &bump(-h))) / (2.0 * h);
            assert!((gw[k] - num).abs() < 1e-7, "dw[{k}]: {} vs {num}", gw[k]);
        }
    }

    /// bf16 rounds the normalised value, then the product with the weight.
    #[test]
    fn bf16_rounds_twice() {
        let x = Tensor::from_vec(vec![1.0f32, 2.0, 3.0], &[1, 3])
            .unwrap()
            .cast(DType::BF16)
            .unwrap();
        let w = Tensor::from_vec(vec![1.1f32, 0.9, 1.3], &[3])
            .unwrap()
            .cast(DType::BF16)
            .unwrap();
        let y = x.rms_norm(Some(&w), 1e-5).unwrap();
        let r = (1.0 / ((1.0 + 4.0 + 9.0) / 3.0f64 + 1e-5).sqrt()) as f32;
        let want: Vec<f32> = [1.0f32, 2.0, 3.0]
            .iter()
            .zip(w.to_f64_vec())
            .map(|(&v, wv)| {
                let y1 = half::bf16::from_f32(v * r).to_f32();
                half::bf16::from_f32(y1 * wv as f32).to_f32()
            })
            .collect();
        assert_eq!(y.cast(DType::F32).unwrap().to_vec::<f32>().unwrap(), want);
    }

    #[test]
    fn errors_name_the_misfit() {
        let x = Tensor::ones(&[2, 3], DType::F32).unwrap();
        let e = x
            .rms_norm(Some(&Tensor::ones(&[2], DType::F32).unwrap()), 1e-5)
            .unwrap_err()
            .to_string();
        assert!(e.contains("[3] weight"), "{e}");
        let e = Tensor::scalar(1.0, DType::F32)
            .unwrap()
            .rms_norm(None, 1e-5)
            .unwrap_err()
            .to_string();
        assert!(e.contains("rank-0"), "{e}");
        let (_, rstd) = x.rms_norm_with_stats(None, 1e-5).unwrap();
        let e = x
            .rms_norm_backward_with_stats(&x, &rstd.reshape(&[1, 2]).unwrap(), None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("rstd has shape"), "{e}");
        let e = Tensor::ones(&[2, 3], DType::I64)
            .unwrap()
            .rms_norm(None, 1e-5)
            .unwrap_err()
            .to_string();
        assert!(e.contains("i64"), "{e}");
    }
}
