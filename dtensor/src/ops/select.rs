//! Selection on DTensors: `where_cond` and `masked_fill` (element-wise), index
//! selection and gathering with their scatter-add gradients, `argmax` /
//! `argmin`; and splitting and stacking, built on `narrow`, `reshape` and `cat`.

use smallvec::smallvec;
use tessera_tensor::Error as TensorError;
use tessera_tensor::ops::{check_gather, chunk_sizes, split_ranges, split_sizes, stack_pieces};

use super::{dispatch, same_dtypes};
use crate::strategy::{Candidates, DimOption, Linearity, keep_shards_except, pointwise, product};
use crate::{DTensor, DType, Error, Placement, ReduceOp, Result, Tensor};

const SUM: Placement = Placement::Partial(ReduceOp::Sum);

/// Errors unless `dim < rank`.
fn check_dim(op: &'static str, dim: usize, rank: usize) -> Result<()> {
    if dim < rank {
        Ok(())
    } else {
        Err(Error::from(TensorError::DimOutOfRange { op, dim, rank }))
    }
}

/// Errors unless `index` is a 1-D `i64` tensor.
fn check_index_1d(op: &'static str, index: &DTensor) -> Result<()> {
    if index.shape().len() == 1 && index.dtype() == DType::I64 {
        Ok(())
    } else {
        Err(Error::from(TensorError::InvalidArgument {
            op,
            detail: format!("the index must be i64 [n], got {} {:?}", index.dtype(), index.shape()),
        }))
    }
}

impl DTensor {
    /// Where this mask (`u8`) is set, the element of `x`, elsewhere of `y`,
    /// broadcast together (see [`Tensor::where_cond`]); sharded as an
    /// element-wise op (partial sums reduced first).
    ///
    /// PyTorch: `torch.where(cond, x, y)` on DTensors.
    ///
    /// # Errors
    /// As [`Tensor::where_cond`]; inputs on different meshes.
    pub fn where_cond(&self, x: &DTensor, y: &DTensor) -> Result<DTensor> {
        const OP: &str = "where_cond";
        same_dtypes(OP, &[x, y])?;
        need_mask(OP, self)?;
        let out = super::broadcast_shape(OP, &super::broadcast_shape(OP, self.shape(), x.shape())?, y.shape())?;
        let cands = pointwise(
            &[self.shape(), x.shape(), y.shape()],
            &out,
            self.mesh().ndim(),
            Linearity::None,
        );
        dispatch(OP, &[self, x, y], &cands, &out, x.dtype(), |l, _| {
            Ok(l[0].where_cond(&l[1], &l[2])?)
        })
    }

    /// This tensor with `value` wherever `mask` (`u8`, broadcast to this shape)
    /// is set (see [`Tensor::masked_fill`]); sharded as an element-wise op.
    ///
    /// PyTorch: `Tensor.masked_fill` on DTensors.
    ///
    /// # Errors
    /// As [`Tensor::masked_fill`]; inputs on different meshes.
    pub fn masked_fill(&self, mask: &DTensor, value: f64) -> Result<DTensor> {
        need_mask("masked_fill", mask)?;
        if super::broadcast_shape("masked_fill", mask.shape(), self.shape())
            .ok()
            .as_deref()
            != Some(self.shape())
        {
            return Err(Error::from(TensorError::ShapeMismatch {
                op: "masked_fill",
                detail: format!(
                    "the mask {:?} must broadcast to the tensor's shape {:?}",
                    mask.shape(),
                    self.shape()
                ),
            }));
        }
        let cands = pointwise(
            &[self.shape(), mask.shape()],
            self.shape(),
            self.mesh().ndim(),
            Linearity::None,
        );
        dispatch(
            "masked_fill",
            &[self, mask],
            &cands,
            self.shape(),
            self.dtype(),
            |l, _| Ok(l[0].masked_fill(&l[1], value)?),
        )
    }

    /// The slices of `dim` at `index` (`i64 [n]`, see [`Tensor::index_select`]):
    /// other dims keep their shards (the index replicated), a sharded index
    /// shards the output's `dim` (this tensor replicated), partial sums stay
    /// partial.
    ///
    /// PyTorch: `torch.index_select` on DTensors.
    ///
    /// # Errors
    /// As [`Tensor::index_select`].
    pub fn index_select(&self, dim: impl tessera_tensor::Dim, index: &DTensor) -> Result<DTensor> {
        let dim = dim.resolve("index_select", self.shape().len())?;
        const OP: &str = "index_select";
        let rank = self.shape().len();
        check_dim(OP, dim, rank)?;
        check_index_1d(OP, index)?;
        let mut out = self.shape().to_vec();
        out[dim] = index.shape()[0];
        let (r, s) = (Placement::Replicate, Placement::Shard);
        let mut options: Vec<DimOption> = vec![
            (smallvec![r, r], r),
            (smallvec![SUM, r], SUM),
            (smallvec![r, s(0)], s(dim)),
        ];
        options.extend((0..rank).filter(|&d| d != dim).map(|d| (smallvec![s(d), r], s(d))));
        let cands = product(&vec![options; self.mesh().ndim()], 2);
        dispatch(OP, &[self, index], &cands, &out, self.dtype(), |l, _| {
            Ok(l[0].index_select(dim, &l[1])?)
        })
    }

    /// The gradient of [`index_select`](Self::index_select) for the output
    /// gradient `self` (see [`Tensor::index_select_backward`]): other dims keep
    /// their shards; a gradient sharded along `dim` with its index gives partial
    /// sums.
    ///
    /// # Errors
    /// As [`Tensor::index_select_backward`].
    pub fn index_select_backward(
        &self,
        dim: impl tessera_tensor::Dim,
        index: &DTensor,
        size: usize,
    ) -> Result<DTensor> {
        let dim = dim.resolve("index_select_backward", self.shape().len())?;
        const OP: &str = "index_select_backward";
        let rank = self.shape().len();
        check_dim(OP, dim, rank)?;
        check_index_1d(OP, index)?;
        let mut out = self.shape().to_vec();
        out[dim] = size;
        let (r, s) = (Placement::Replicate, Placement::Shard);
        let mut options: Vec<DimOption> = vec![
            (smallvec![r, r], r),
            (smallvec![SUM, r], SUM),
            (smallvec![s(dim), s(0)], SUM),
        ];
        options.extend((0..rank).filter(|&d| d != dim).map(|d| (smallvec![s(d), r], s(d))));
        let cands = product(&vec![options; self.mesh().ndim()], 2);
        dispatch(OP, &[self, index], &cands, &out, self.dtype(), |l, _| {
            Ok(l[0].index_select_backward(dim, &l[1], size)?)
        })
    }

    /// Elements along `dim` picked per position by `index` (see
    /// [`Tensor::gather`]): a replicated tensor with a sharded index gives the
    /// index's shards; both sharded alike off `dim` where their sizes agree.
    ///
    /// PyTorch: `torch.gather` on DTensors.
    ///
    /// # Errors
    /// As [`Tensor::gather`].
    pub fn gather(&self, dim: impl tessera_tensor::Dim, index: &DTensor) -> Result<DTensor> {
        let dim = dim.resolve("gather", self.shape().len())?;
        const OP: &str = "gather";
        check_gather(OP, self.shape(), dim, index.shape(), index.dtype())?;
        let cands = self.gather_candidates(dim, index, self.shape(), false);
        dispatch(OP, &[self, index], &cands, index.shape(), self.dtype(), |l, _| {
            Ok(l[0].gather(dim, &l[1])?)
        })
    }

    /// The gradient of [`gather`](Self::gather) for the output gradient `self`
    /// (shaped as the index; see [`Tensor::gather_backward`]) into a tensor of
    /// `shape`: shards kept where the gather kept them, partial sums where the
    /// index alone was sharded.
    ///
    /// # Errors
    /// As [`Tensor::gather_backward`].
    pub fn gather_backward(&self, dim: impl tessera_tensor::Dim, index: &DTensor, shape: &[usize]) -> Result<DTensor> {
        let dim = dim.resolve("gather_backward", self.shape().len())?;
        const OP: &str = "gather_backward";
        check_gather(OP, shape, dim, index.shape(), index.dtype())?;
        if self.shape() != index.shape() {
            return Err(Error::from(TensorError::ShapeMismatch {
                op: OP,
                detail: format!(
                    "the gradient has shape {:?} but the index {:?}",
                    self.shape(),
                    index.shape()
                ),
            }));
        }
        let cands = self.gather_candidates(dim, index, shape, true);
        let global = index.shape().to_vec();
        dispatch(OP, &[self, index], &cands, shape, self.dtype(), |l, _| {
            // Dims off `dim` where the sizes agree follow the index's shards.
            let local: Vec<usize> = (0..shape.len())
                .map(|d| {
                    if d != dim && shape[d] == global[d] {
                        l[1].shape()[d]
                    } else {
                        shape[d]
                    }
                })
                .collect();
            Ok(l[0].gather_backward(dim, &l[1], &local)?)
        })
    }

    /// Candidates of `gather` (`backward`: of its gradient): the index sharded
    /// along `dim` (each position reads its own coordinate elsewhere) with the
    /// source replicated gives the index's shards (backward: partial sums), and
    /// both sharded alike off `dim` where their sizes agree stay so.
    fn gather_candidates(&self, dim: usize, index: &DTensor, source: &[usize], backward: bool) -> Candidates {
        let (r, s) = (Placement::Replicate, Placement::Shard);
        let rank = index.shape().len();
        let mut options: Vec<DimOption> = vec![(smallvec![r, r], r)];
        if backward {
            options.push((smallvec![SUM, r], SUM));
            options.push((smallvec![s(dim), s(dim)], SUM));
        } else {
            options.push((smallvec![r, s(dim)], s(dim)));
        }
        options.extend(
            (0..rank)
                .filter(|&d| d != dim && source.get(d) == index.shape().get(d))
                .map(|d| (smallvec![s(d), s(d)], s(d))),
        );
        product(&vec![options; self.mesh().ndim()], 2)
    }

    /// The index of the largest value along `dim` (`i64`; see
    /// [`Tensor::argmax`]): `dim` replicated, other shards kept.
    ///
    /// PyTorch: `torch.argmax` on DTensors.
    ///
    /// # Errors
    /// As [`Tensor::argmax`].
    pub fn argmax(&self, dim: impl tessera_tensor::Dim, keepdim: bool) -> Result<DTensor> {
        let dim = dim.resolve("argmax", self.shape().len())?;
        self.arg_reduce("argmax", dim, keepdim, |t| t.argmax(dim, keepdim))
    }

    /// The index of the smallest value along `dim` (`i64`; see
    /// [`Tensor::argmin`]): `dim` replicated, other shards kept.
    ///
    /// PyTorch: `torch.argmin` on DTensors.
    ///
    /// # Errors
    /// As [`Tensor::argmin`].
    pub fn argmin(&self, dim: impl tessera_tensor::Dim, keepdim: bool) -> Result<DTensor> {
        let dim = dim.resolve("argmin", self.shape().len())?;
        self.arg_reduce("argmin", dim, keepdim, |t| t.argmin(dim, keepdim))
    }

    fn arg_reduce(
        &self,
        op: &'static str,
        dim: usize,
        keepdim: bool,
        kernel: impl FnOnce(&Tensor) -> tessera_tensor::Result<Tensor>,
    ) -> Result<DTensor> {
        let rank = self.shape().len();
        check_dim(op, dim, rank)?;
        let mut out = self.shape().to_vec();
        if keepdim {
            out[dim] = 1;
        } else {
            out.remove(dim);
        }
        let shift = |d: usize| if keepdim || d < dim { d } else { d - 1 };
        let cands = keep_shards_except(rank, &[dim], self.mesh().ndim()).map_keyed(&(dim, keepdim), |mut c| {
            for p in c.output.iter_mut() {
                if let Placement::Shard(d) = *p {
                    *p = Placement::Shard(shift(d));
                }
            }
            c
        });
        dispatch(op, &[self], &cands, &out, DType::I64, |l, _| Ok(kernel(&l[0])?))
    }

    /// Pieces of `split_size` along `dim`, the last shorter (see
    /// [`Tensor::split`]); each a [`narrow`](Self::narrow).
    ///
    /// PyTorch: `torch.split(x, split_size, dim)` on DTensors.
    ///
    /// # Errors
    /// As [`Tensor::split`].
    pub fn split(&self, split_size: usize, dim: impl tessera_tensor::Dim) -> Result<Vec<DTensor>> {
        let dim = dim.resolve("split", self.shape().len())?;
        self.split_with_sizes(&split_sizes("split", self.shape(), split_size, dim)?, dim)
    }

    /// Pieces of `sizes[i]` along `dim` (see [`Tensor::split_with_sizes`]).
    ///
    /// PyTorch: `torch.split(x, sizes, dim)` on DTensors.
    ///
    /// # Errors
    /// As [`Tensor::split_with_sizes`].
    pub fn split_with_sizes(&self, sizes: &[usize], dim: impl tessera_tensor::Dim) -> Result<Vec<DTensor>> {
        let dim = dim.resolve("split_with_sizes", self.shape().len())?;
        split_ranges("split_with_sizes", self.shape(), sizes, dim)?
            .into_iter()
            .map(|(start, len)| self.narrow(dim, start, len))
            .collect()
    }

    /// `ceil(size / n)` slices along `dim` per piece, the last shorter, and
    /// fewer than `n` pieces when the size runs out first.
    ///
    /// PyTorch: `torch.chunk` on DTensors.
    ///
    /// # Errors
    /// `dim` out of range, `n == 0`.
    pub fn chunk(&self, n: usize, dim: impl tessera_tensor::Dim) -> Result<Vec<DTensor>> {
        let dim = dim.resolve("chunk", self.shape().len())?;
        self.split_with_sizes(&chunk_sizes("chunk", self.shape(), n, dim)?, dim)
    }

    /// The tensors (one shape, dtype and mesh) stacked along a new dim `dim`:
    /// shards of the other dims kept.
    ///
    /// PyTorch: `torch.stack` on DTensors.
    ///
    /// # Errors
    /// No tensors, shapes that differ, `dim` past the rank.
    pub fn stack(xs: &[&DTensor], dim: impl tessera_tensor::Dim) -> Result<DTensor> {
        // No tensors: any dim resolves, and the missing input is the error below.
        let dim = dim.resolve("stack", xs.first().map_or(usize::MAX, |x| x.shape().len() + 1))?;
        let pieces = stack_pieces("stack", xs.iter().map(|x| x.shape()), dim)?;
        let unsqueezed = xs
            .iter()
            .zip(&pieces)
            .map(|(x, s)| x.reshape(s))
            .collect::<Result<Vec<_>>>()?;
        DTensor::cat(&unsqueezed.iter().collect::<Vec<_>>(), dim)
    }
}

/// Errors unless `mask` is `u8` (PyTorch's `torch.bool`).
fn need_mask(op: &'static str, mask: &DTensor) -> Result<()> {
    if mask.dtype() == DType::U8 {
        Ok(())
    } else {
        Err(Error::from(TensorError::InvalidArgument {
            op,
            detail: format!("the mask must be u8 (nonzero: true), got {}", mask.dtype()),
        }))
    }
}
