//! Selection: `where_cond` and `masked_fill`, `index_select` and `gather` with
//! their scatter-add gradients.
//!
//! Masks are `u8` tensors (nonzero: true), PyTorch's `torch.bool`; indices are
//! `i64`. These kernels run on the host; a device tensor is refused with an
//! error naming the op (move it with `.to(Device::Cpu)`).

use super::elementwise::broadcast_shapes;
use super::{check_dim, elements, output, same_dtype};
use crate::kernel::any_dispatch;
use crate::{DType, Error, Result, Tensor};

/// A gather (or its backward, `float`) on meta tensors: the shapes checked
/// as [`gather_map`] checks them (the indices, having no values, are not);
/// a meta output of `out`.
fn meta_gather(
    op: &'static str,
    source: &[usize],
    dim: usize,
    index: &Tensor,
    out: &[usize],
    dtype: DType,
    float: bool,
) -> Result<Tensor> {
    check_gather(op, source, dim, index.shape(), index.dtype())?;
    if float && !dtype.is_float() {
        return Err(crate::kernel::not_float(op, dtype));
    }
    Tensor::meta(out, dtype)
}

/// Errors for a device tensor among `ts`: these kernels run on the host.
fn host_only(op: &'static str, ts: &[&Tensor]) -> Result<()> {
    match ts.iter().find(|t| t.is_cuda()) {
        Some(t) => Err(Error::Device {
            op,
            detail: format!(
                "{op} runs on the host so far and an input is on {}; move it with .to(Device::Cpu)",
                t.device()
            ),
        }),
        None => Ok(()),
    }
}

/// Errors unless `t` has `dtype` (`what` names the input).
fn need_dtype(op: &'static str, t: &Tensor, dtype: DType, what: &str) -> Result<()> {
    if t.dtype() == dtype {
        Ok(())
    } else {
        Err(Error::InvalidArgument {
            op,
            detail: format!("{what} must be {dtype}, got {}", t.dtype()),
        })
    }
}

/// The indices of `index` (`i64`), each checked against `size`.
fn checked_indices(op: &'static str, index: &Tensor, size: usize, dim: usize) -> Result<Vec<usize>> {
    need_dtype(op, index, DType::I64, "the index")?;
    elements::<i64>(index)?
        .iter()
        .map(|&i| {
            usize::try_from(i)
                .ok()
                .filter(|&u| u < size)
                .ok_or_else(|| Error::InvalidArgument {
                    op,
                    detail: format!("index {i} is out of range for dim {dim} of size {size}"),
                })
        })
        .collect()
}

/// Row-major strides of `shape`.
fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        s[d] = s[d + 1] * shape[d + 1];
    }
    s
}

impl Tensor {
    /// Where this mask (`u8`, nonzero: true) is set, the element of `x`; elsewhere
    /// the element of `y`. The three broadcast together (NumPy rules); `x` and `y`
    /// have one dtype, any dtype.
    ///
    /// PyTorch: `torch.where(cond, x, y)`.
    ///
    /// # Errors
    /// A mask that is not `u8`; `x` and `y` of different dtypes; shapes that do
    /// not broadcast; device tensors.
    pub fn where_cond(&self, x: &Tensor, y: &Tensor) -> Result<Tensor> {
        const OP: &str = "where_cond";
        host_only(OP, &[self, x, y])?;
        need_dtype(OP, self, DType::U8, "the condition")?;
        same_dtype(OP, x, y)?;
        let shape = broadcast_shapes(OP, &broadcast_shapes(OP, self.shape(), x.shape())?, y.shape())?;
        if let Some(out) = super::meta_output(&[self, x, y], &shape, x.dtype()) {
            return out;
        }
        let (c, x, y) = (
            self.broadcast_to(&shape)?,
            x.broadcast_to(&shape)?,
            y.broadcast_to(&shape)?,
        );
        let c = elements::<u8>(&c)?;
        any_dispatch!(OP, x.dtype(), T => {
            let (a, b) = (elements::<T>(&x)?, elements::<T>(&y)?);
            let out: Vec<T> = c.iter().zip(a.iter().zip(b.iter())).map(|(&c, (&a, &b))| if c != 0 { a } else { b }).collect();
            output(out, &shape)
        })
    }

    /// This tensor with `value` wherever `mask` (`u8`, broadcast to this shape)
    /// is set.
    ///
    /// PyTorch: `Tensor.masked_fill(mask, value)`.
    ///
    /// # Errors
    /// A mask that is not `u8` or does not broadcast to this shape (without
    /// growing it); device tensors.
    pub fn masked_fill(&self, mask: &Tensor, value: f64) -> Result<Tensor> {
        const OP: &str = "masked_fill";
        host_only(OP, &[self, mask])?;
        if broadcast_shapes(OP, mask.shape(), self.shape()).ok().as_deref() != Some(self.shape()) {
            return Err(Error::ShapeMismatch {
                op: OP,
                detail: format!(
                    "the mask {:?} must broadcast to the tensor's shape {:?}",
                    mask.shape(),
                    self.shape()
                ),
            });
        }
        let fill = Tensor::full(&[], value, self.dtype())?;
        mask.where_cond(&fill, self)
    }

    /// The slices of `dim` at `index` (`i64 [n]`), in its order (repeats allowed):
    /// the output has `n` along `dim`.
    ///
    /// PyTorch: `torch.index_select(x, dim, index)`.
    ///
    /// # Errors
    /// A `dim` out of range; an index that is not `i64 [n]` or out of range; device tensors.
    pub fn index_select(&self, dim: impl crate::Dim, index: &Tensor) -> Result<Tensor> {
        let dim = dim.resolve("index_select", self.rank())?;
        const OP: &str = "index_select";
        host_only(OP, &[self, index])?;
        check_dim(OP, dim, self.rank())?;
        if index.rank() != 1 {
            return Err(Error::InvalidArgument {
                op: OP,
                detail: format!("the index must be 1-D, got shape {:?}", index.shape()),
            });
        }
        let mut shape = self.shape().to_vec();
        shape[dim] = index.numel();
        // On meta, the indices (which have no values) are not checked.
        if let Some(out) = super::meta_output(&[self, index], &shape, self.dtype()) {
            return out;
        }
        let idx = checked_indices(OP, index, self.shape()[dim], dim)?;
        let pieces = idx
            .iter()
            .map(|&i| self.narrow(dim, i, 1))
            .collect::<Result<Vec<_>>>()?;
        if pieces.is_empty() {
            let mut shape = self.shape().to_vec();
            shape[dim] = 0;
            return Tensor::zeros(&shape, self.dtype());
        }
        Tensor::cat(&pieces, dim)
    }

    /// The gradient of [`index_select`](Self::index_select) for the output
    /// gradient `self`: zeros with `size` slices along `dim`, slice `index[k]`
    /// getting slice `k` of `self` added (repeated indices accumulate).
    ///
    /// PyTorch: `Tensor.index_add_` into zeros.
    ///
    /// # Errors
    /// Shapes that do not fit the index; indices out of range; integer tensors.
    pub fn index_select_backward(&self, dim: impl crate::Dim, index: &Tensor, size: usize) -> Result<Tensor> {
        let dim = dim.resolve("index_select_backward", self.rank())?;
        const OP: &str = "index_select_backward";
        host_only(OP, &[self, index])?;
        check_dim(OP, dim, self.rank())?;
        if index.rank() != 1 || index.numel() != self.shape()[dim] {
            return Err(Error::ShapeMismatch {
                op: OP,
                detail: format!(
                    "the gradient {:?} has {} slices along dim {dim} for an index of shape {:?}",
                    self.shape(),
                    self.shape().get(dim).copied().unwrap_or(0),
                    index.shape()
                ),
            });
        }
        let mut shape = self.shape().to_vec();
        shape[dim] = size;
        if let Some(out) = super::meta_float(OP, &[self, index], &shape, self.dtype()) {
            return out;
        }
        let idx = checked_indices(OP, index, size, dim)?;
        let inner: usize = shape[dim + 1..].iter().product();
        let outer: usize = shape[..dim].iter().product();
        let n = idx.len();
        crate::kernel::float_dispatch!(OP, self.dtype(), T => {
            use crate::kernel::Float as _;
            let g = elements::<T>(self)?;
            let mut acc = vec![0f64; outer * size * inner];
            for o in 0..outer {
                for (k, &i) in idx.iter().enumerate() {
                    let src = &g[(o * n + k) * inner..(o * n + k + 1) * inner];
                    let dst = &mut acc[(o * size + i) * inner..(o * size + i + 1) * inner];
                    for (d, s) in dst.iter_mut().zip(src) {
                        *d += s.wide();
                    }
                }
            }
            output(acc.into_iter().map(T::from_wide).collect::<Vec<T>>(), &shape)
        })
    }

    /// Elements along `dim` picked per position by `index` (`i64`, the rank of
    /// this tensor): `out[i][j] = x[i][index[i][j]]` for `dim = 1`; the output has
    /// the index's shape, which may be smaller than this tensor's on every dim.
    ///
    /// PyTorch: `torch.gather(x, dim, index)`.
    ///
    /// # Errors
    /// A `dim` out of range; an index of another rank, larger than this tensor
    /// on a dim other than `dim`, not `i64`, or out of range; device tensors.
    pub fn gather(&self, dim: impl crate::Dim, index: &Tensor) -> Result<Tensor> {
        let dim = dim.resolve("gather", self.rank())?;
        const OP: &str = "gather";
        if self.is_meta() || index.is_meta() {
            return meta_gather(OP, self.shape(), dim, index, index.shape(), self.dtype(), false);
        }
        let (map, shape) = gather_map(OP, self.shape(), dim, index)?;
        host_only(OP, &[self, index])?;
        any_dispatch!(OP, self.dtype(), T => {
            let x = elements::<T>(self)?;
            output(map.iter().map(|&at| x[at]).collect::<Vec<T>>(), &shape)
        })
    }

    /// The gradient of [`gather`](Self::gather) for the output gradient `self`
    /// (shaped as the index): zeros of `shape` with each element of `self` added
    /// where it was gathered from (repeats accumulate).
    ///
    /// PyTorch: `Tensor.scatter_add_` into zeros.
    ///
    /// # Errors
    /// As [`gather`](Self::gather); a gradient not shaped as the index; integer tensors.
    pub fn gather_backward(&self, dim: impl crate::Dim, index: &Tensor, shape: &[usize]) -> Result<Tensor> {
        let dim = dim.resolve("gather_backward", self.rank())?;
        const OP: &str = "gather_backward";
        if self.is_meta() || index.is_meta() {
            check_dim(OP, dim, shape.len())?;
            if self.shape() != index.shape() {
                return Err(Error::ShapeMismatch {
                    op: OP,
                    detail: format!(
                        "the gradient has shape {:?} but the index {:?}",
                        self.shape(),
                        index.shape()
                    ),
                });
            }
            return meta_gather(OP, shape, dim, index, shape, self.dtype(), true);
        }
        let (map, want) = gather_map(OP, shape, dim, index)?;
        host_only(OP, &[self, index])?;
        if self.shape() != &want[..] {
            return Err(Error::ShapeMismatch {
                op: OP,
                detail: format!("the gradient has shape {:?} but the index {want:?}", self.shape()),
            });
        }
        crate::kernel::float_dispatch!(OP, self.dtype(), T => {
            use crate::kernel::Float as _;
            let g = elements::<T>(self)?;
            let mut acc = vec![0f64; shape.iter().product()];
            for (&at, v) in map.iter().zip(g.iter()) {
                acc[at] += v.wide();
            }
            output(acc.into_iter().map(T::from_wide).collect::<Vec<T>>(), shape)
        })
    }
}

/// Checks a gather from a tensor of `shape` along `dim` with an index of
/// `index_shape` and `index_dtype`: the same rank, no larger off `dim`, `i64`.
///
/// # Errors
/// The first of those that fails, naming the shapes.
pub fn check_gather(
    op: &'static str,
    shape: &[usize],
    dim: usize,
    index_shape: &[usize],
    index_dtype: DType,
) -> Result<()> {
    check_dim(op, dim, shape.len())?;
    let is = index_shape;
    let fits = is.len() == shape.len() && (0..is.len()).all(|d| d == dim || is[d] <= shape[d]);
    if !fits {
        return Err(Error::ShapeMismatch {
            op,
            detail: format!(
                "the index has shape {is:?} for a tensor of shape {shape:?}; it must have the same rank and \
                 be no larger on every dim but {dim}"
            ),
        });
    }
    if index_dtype != DType::I64 {
        return Err(Error::InvalidArgument {
            op,
            detail: format!("the index must be i64, got {index_dtype}"),
        });
    }
    Ok(())
}

/// For `gather` on a tensor of `shape`: each index position's flat offset in
/// the tensor, and the output shape (the index's).
fn gather_map(op: &'static str, shape: &[usize], dim: usize, index: &Tensor) -> Result<(Vec<usize>, Vec<usize>)> {
    check_gather(op, shape, dim, index.shape(), index.dtype())?;
    let is = index.shape().to_vec();
    let idx = checked_indices(op, index, shape[dim], dim)?;
    let (xs, ixs) = (strides(shape), strides(&is));
    let map = idx
        .iter()
        .enumerate()
        .map(|(flat, &i)| {
            (0..is.len())
                .map(|d| {
                    let coord = if d == dim { i } else { flat / ixs[d] % is[d] };
                    coord * xs[d]
                })
                .sum()
        })
        .collect();
    Ok((map, is))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(v: &[f32], shape: &[usize]) -> Tensor {
        Tensor::from_slice(v, shape).unwrap()
    }

    #[test]
    fn where_and_masked_fill_pick_by_the_broadcast_mask() {
        let mask = Tensor::from_slice(&[1u8, 0, 2], &[3]).unwrap();
        let x = t(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]);
        let y = t(&[-1.0], &[1]);
        let out = mask.where_cond(&x, &y).unwrap();
        assert_eq!(out.to_vec::<f32>().unwrap(), [1.0, -1.0, 3.0, 4.0, -1.0, 6.0]);
        let filled = x
            .masked_fill(&mask, f64::NEG_INFINITY)
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        assert_eq!(
            filled,
            [
                f32::NEG_INFINITY,
                2.0,
                f32::NEG_INFINITY,
                f32::NEG_INFINITY,
                5.0,
                f32::NEG_INFINITY
            ]
        );
        let err = x.where_cond(&x, &y).unwrap_err().to_string();
        assert!(err.contains("the condition must be u8"), "{err}");
        let big = Tensor::zeros(&[4, 3], DType::U8).unwrap();
        assert!(
            x.masked_fill(&big, 0.0)
                .unwrap_err()
                .to_string()
                .contains("must broadcast")
        );
    }

    #[test]
    fn index_select_and_its_backward_accumulate_repeats() {
        let x = t(&[0.0, 1.0, 2.0, 3.0, 4.0, 5.0], &[3, 2]);
        let idx = Tensor::from_slice(&[2i64, 0, 2], &[3]).unwrap();
        let y = x.index_select(0, &idx).unwrap();
        assert_eq!(y.to_vec::<f32>().unwrap(), [4.0, 5.0, 0.0, 1.0, 4.0, 5.0]);
        let cols = x.index_select(1, &Tensor::from_slice(&[1i64], &[1]).unwrap()).unwrap();
        assert_eq!(cols.to_vec::<f32>().unwrap(), [1.0, 3.0, 5.0]);
        let g = t(&[1.0; 6], &[3, 2]);
        let back = g.index_select_backward(0, &idx, 3).unwrap();
        assert_eq!(back.to_vec::<f32>().unwrap(), [1.0, 1.0, 0.0, 0.0, 2.0, 2.0]);
        let bad = Tensor::from_slice(&[3i64], &[1]).unwrap();
        let err = x.index_select(0, &bad).unwrap_err().to_string();
        assert!(err.contains("index 3 is out of range for dim 0 of size 3"), "{err}");
    }

    #[test]
    fn gather_picks_per_position_and_its_backward_scatters() {
        let x = t(&[0.0, 1.0, 2.0, 10.0, 11.0, 12.0], &[2, 3]);
        let idx = Tensor::from_slice(&[2i64, 2, 0, 1], &[2, 2]).unwrap();
        let y = x.gather(1, &idx).unwrap();
        assert_eq!(y.to_vec::<f32>().unwrap(), [2.0, 2.0, 10.0, 11.0]);
        let rows = x.gather(0, &Tensor::from_slice(&[1i64, 0], &[1, 2]).unwrap()).unwrap();
        assert_eq!(rows.to_vec::<f32>().unwrap(), [10.0, 1.0]);
        let back = t(&[1.0, 2.0, 3.0, 4.0], &[2, 2])
            .gather_backward(1, &idx, &[2, 3])
            .unwrap();
        assert_eq!(back.to_vec::<f32>().unwrap(), [0.0, 0.0, 3.0, 3.0, 4.0, 0.0]);
        let err = x
            .gather(1, &Tensor::zeros(&[3, 1], DType::I64).unwrap())
            .unwrap_err()
            .to_string();
        assert!(err.contains("no larger on every dim but 1"), "{err}");
    }

    #[test]
    fn argmin_takes_the_first_minimum() {
        let x = t(&[3.0, 1.0, 1.0, 0.0, 5.0, -2.0], &[2, 3]);
        assert_eq!(x.argmin(1, false).unwrap().to_vec::<i64>().unwrap(), [1, 2]);
        assert_eq!(x.argmin(0, true).unwrap().shape(), &[1, 3]);
        assert_eq!(x.argmax(1, false).unwrap().to_vec::<i64>().unwrap(), [0, 1]);
    }
}
