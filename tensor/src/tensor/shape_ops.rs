//! Shape ops: views (narrow, chunk, transpose, reshape) and copies (contiguous, cat).

use std::borrow::Cow;

use tessera_mesh::{Buffer, DType, Element};

use super::Tensor;
use super::geometry::{Geometry, checked_numel};
use super::storage::{typed, with_buffer};
use crate::{Error, Result};

/// The length and start of piece `idx` when a dim of `size` elements is split
/// into `n` pieces as `torch.chunk` splits it: every piece has `ceil(size / n)`
/// elements, the trailing ones fewer or none (13 over 4 gives 4, 4, 4, 1 and 6
/// over 4 gives 2, 2, 2, 0). An empty piece starts at `size`; `n == 0` gives `(0, size)`.
///
/// ```
/// use tessera_tensor::chunk_size_and_offset;
///
/// assert_eq!(chunk_size_and_offset(13, 4, 3), (1, 12));
/// assert_eq!(chunk_size_and_offset(6, 4, 3), (0, 6));
/// ```
///
/// PyTorch: the split of `torch.chunk` (and of `Shard.local_shard_size_and_offset`).
pub fn chunk_size_and_offset(size: usize, n: usize, idx: usize) -> (usize, usize) {
    let chunk = if n == 0 { 0 } else { size.div_ceil(n) };
    let start = chunk.saturating_mul(idx);
    if n == 0 || start >= size {
        (0, size)
    } else {
        (chunk.min(size - start), start)
    }
}

impl Tensor {
    /// The view of `len` entries of dim `dim` starting at `start`, sharing storage.
    /// PyTorch: `Tensor.narrow`.
    ///
    /// # Errors
    /// [`Error::DimOutOfRange`], or [`Error::InvalidArgument`] when
    /// `start + len` exceeds the dim's size.
    pub fn narrow(&self, dim: impl crate::Dim, start: usize, len: usize) -> Result<Tensor> {
        let dim = dim.resolve("narrow", self.rank())?;
        Ok(self.with_geometry(self.geometry().narrow(dim, start, len)?))
    }

    /// Exactly `n` views along `dim`, each of `ceil(size / n)` entries except
    /// that trailing ones may be short or empty: 13 over 4 gives 4, 4, 4, 1;
    /// 5 over 4 gives 2, 2, 1, 0; 6 over 4 gives 2, 2, 2, 0. This is how
    /// `Shard(dim)` splits a tensor.
    ///
    /// PyTorch: `torch.chunk` (which may return fewer than `n` chunks; DTensor
    /// pads the list with empty ones, as this does).
    ///
    /// # Errors
    /// [`Error::DimOutOfRange`], or [`Error::InvalidArgument`] when `n` is 0.
    pub fn chunk(&self, n: usize, dim: impl crate::Dim) -> Result<Vec<Tensor>> {
        let dim = dim.resolve("chunk", self.rank())?;
        self.geometry().check_dim("chunk", dim)?;
        if n == 0 {
            return Err(Error::InvalidArgument {
                op: "chunk",
                detail: format!("cannot split dim {dim} into 0 chunks; ask for at least 1"),
            });
        }
        let size = self.shape()[dim];
        (0..n)
            .map(|i| {
                // The same split DTensor shards use; an empty chunk's offset is the size.
                let (len, start) = chunk_size_and_offset(size, n, i);
                self.narrow(dim, start, len)
            })
            .collect()
    }

    /// The view with dims `d0` and `d1` swapped (usually not contiguous).
    /// PyTorch: `Tensor.transpose`.
    ///
    /// # Errors
    /// [`Error::DimOutOfRange`] for either dim.
    pub fn transpose(&self, d0: impl crate::Dim, d1: impl crate::Dim) -> Result<Tensor> {
        let (d0, d1) = (
            d0.resolve("transpose", self.rank())?,
            d1.resolve("transpose", self.rank())?,
        );
        Ok(self.with_geometry(self.geometry().transpose(d0, d1)?))
    }

    /// This tensor if it is contiguous, otherwise a row-major copy.
    /// PyTorch: `Tensor.contiguous`.
    ///
    /// # Panics
    /// For a device tensor, when the copy kernel cannot run (device memory
    /// exhausted, a lost GPU).
    pub fn contiguous(&self) -> Tensor {
        if self.is_contiguous() {
            return self.clone();
        }
        if self.is_meta() {
            return self.meta_copy();
        }
        #[cfg(feature = "cuda")]
        if self.is_cuda() {
            match crate::cuda::ops::contiguous(self) {
                Ok(t) => return t,
                Err(e) => panic!("contiguous copy on {} failed: {e}", self.device()),
            }
        }
        let layout = self.geometry();
        let data = with_buffer!(self.host_data(), v, _T => Buffer::from(layout.gather(v)));
        Tensor::from_storage_data(data, self.shape())
    }

    /// The same elements (row-major order) in another shape: a view when this
    /// tensor is contiguous, a copy otherwise; one size may be `-1`, inferred
    /// from the element count. PyTorch: `Tensor.reshape`.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] when `shape` holds another number of elements.
    pub fn reshape(&self, shape: &[impl crate::ShapeSize]) -> Result<Tensor> {
        let shape = &crate::infer_shape("reshape", shape, self.numel())?[..];
        let n = checked_numel("reshape", shape)?;
        if n != self.numel() {
            return Err(Error::ShapeMismatch {
                op: "reshape",
                detail: format!(
                    "cannot reshape {:?} ({} elements) into {shape:?} ({n} elements)",
                    self.shape(),
                    self.numel()
                ),
            });
        }
        let base = self.contiguous();
        let mut layout = Geometry::contiguous(shape);
        layout.offset = if n == 0 { 0 } else { base.storage_offset() };
        Ok(base.with_geometry(layout))
    }

    /// Concatenates `tensors` along `dim` into new contiguous storage. Shapes
    /// must agree except on `dim`; empty pieces are fine. PyTorch: `torch.cat`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an empty list; [`Error::DimOutOfRange`];
    /// [`Error::ShapeMismatch`] naming the first piece whose rank or other dims
    /// differ from piece 0's; [`Error::DTypeMismatch`] for a piece of another dtype;
    /// [`Error::OutOfMemory`] when the output cannot be allocated.
    pub fn cat(tensors: &[Tensor], dim: impl crate::Dim) -> Result<Tensor> {
        // No tensors: any dim resolves, and the missing input is the error below.
        let dim = dim.resolve("cat", tensors.first().map_or(usize::MAX, Tensor::rank))?;
        let Some(first) = tensors.first() else {
            return Err(Error::InvalidArgument {
                op: "cat",
                detail: "no tensors to concatenate; pass at least one".into(),
            });
        };
        first.geometry().check_dim("cat", dim)?;
        let mut shape = first.shape().to_vec();
        shape[dim] = 0;
        for (i, t) in tensors.iter().enumerate() {
            if t.dtype() != first.dtype() {
                return Err(Error::DTypeMismatch {
                    op: "cat",
                    expected: first.dtype(),
                    got: t.dtype(),
                });
            }
            let agrees =
                t.rank() == first.rank() && (0..t.rank()).all(|d| d == dim || t.shape()[d] == first.shape()[d]);
            if !agrees {
                return Err(Error::ShapeMismatch {
                    op: "cat",
                    detail: format!(
                        "tensor {i} has shape {:?} but tensor 0 has {:?}; all dims but \
                         dim {dim} must agree",
                        t.shape(),
                        first.shape()
                    ),
                });
            }
            shape[dim] = shape[dim]
                .checked_add(t.shape()[dim])
                .ok_or_else(|| Error::InvalidArgument {
                    op: "cat",
                    detail: format!("the sizes of dim {dim} add up past usize::MAX; concatenate fewer pieces"),
                })?;
        }
        if tensors.iter().any(Tensor::is_meta) {
            return Tensor::meta(&shape, first.dtype());
        }
        #[cfg(feature = "cuda")]
        if tensors.iter().any(Tensor::is_cuda) {
            return crate::cuda::ops::cat(tensors, dim, &shape);
        }
        let data = with_buffer!(first.data()?, _v, T => Buffer::from(cat_rows::<T>(tensors, dim, &shape)?));
        Ok(Tensor::from_storage_data(data, &shape))
    }
}

impl Tensor {
    /// A new contiguous tensor of `shape` on `device` in which each `(offset,
    /// piece)` is copied to the box at `offset` (elements no piece covers are
    /// zero): the inverse of cutting a tensor into [`narrow`](Self::narrow)ed
    /// boxes. PyTorch: `out = torch.zeros(shape); out[box] = piece` for each piece.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] for a piece whose rank differs from `shape`'s or
    /// whose box leaves it; [`Error::DTypeMismatch`] for a piece of another
    /// dtype; [`Error::Device`] for a piece on another device.
    pub fn assemble(
        shape: &[usize],
        dtype: DType,
        device: crate::Device,
        pieces: &[(&[usize], &Tensor)],
    ) -> Result<Tensor> {
        const OP: &str = "assemble";
        for (i, (offset, piece)) in pieces.iter().enumerate() {
            if piece.dtype() != dtype {
                return Err(Error::DTypeMismatch {
                    op: OP,
                    expected: dtype,
                    got: piece.dtype(),
                });
            }
            if piece.device() != device {
                return Err(Error::Device {
                    op: OP,
                    detail: format!("piece {i} is on {} but the output is on {device}", piece.device()),
                });
            }
            let fits = offset.len() == shape.len()
                && piece.rank() == shape.len()
                && (0..shape.len()).all(|d| offset[d] + piece.shape()[d] <= shape[d]);
            if !fits {
                return Err(Error::ShapeMismatch {
                    op: OP,
                    detail: format!(
                        "piece {i} of shape {:?} at {offset:?} does not fit in {shape:?}",
                        piece.shape()
                    ),
                });
            }
        }
        if device.is_meta() {
            return Tensor::meta(shape, dtype);
        }
        #[cfg(feature = "cuda")]
        if device.is_cuda() {
            return crate::cuda::ops::assemble(shape, dtype, device, pieces);
        }
        #[cfg(not(feature = "cuda"))]
        if device.is_cuda() {
            return Err(Error::Device {
                op: OP,
                detail: format!(
                    "cannot assemble a tensor on {device}: this build has no GPU support; build with --features cuda"
                ),
            });
        }
        let strides = Geometry::contiguous(shape).strides;
        let mut out = Tensor::zeros(shape, dtype)?;
        let dst = out.host_buffer_mut();
        for (offset, piece) in pieces {
            let piece = piece.contiguous();
            let base: usize = offset.iter().zip(&strides).map(|(o, s)| o * s).sum();
            let src = piece.host_data();
            let inner = piece.shape().last().copied().unwrap_or(1);
            let rows = piece.numel().checked_div(inner).unwrap_or(0);
            let pshape = piece.shape().to_vec();
            // Row by row: the row's start in the output from its index.
            for r in 0..rows {
                let (mut rem, mut at) = (r, base);
                for d in (0..pshape.len().saturating_sub(1)).rev() {
                    at += (rem % pshape[d]) * strides[d];
                    rem /= pshape[d];
                }
                let from = piece.storage_offset() + r * inner;
                copy_run(src, from, dst, at, inner);
            }
        }
        Ok(out)
    }

    /// The host buffer of a fresh tensor this handle alone holds.
    fn host_buffer_mut(&mut self) -> &mut Buffer {
        // INVARIANT: called on tensors just made by a constructor, whose one
        // handle holds host storage alone.
        let inner = std::sync::Arc::get_mut(&mut self.0).expect("a fresh tensor has one handle");
        let storage = std::sync::Arc::get_mut(&mut inner.storage).expect("a fresh tensor's storage has one holder");
        storage.data_mut().expect("a host tensor has a host buffer")
    }
}

/// Copies `len` elements of `src` from `from` into `dst` at `to` (same dtype).
fn copy_run(src: &Buffer, from: usize, dst: &mut Buffer, to: usize, len: usize) {
    with_buffer!(src, s, T => {
        if let Some(d) = typed_mut::<T>(dst) {
            d[to..to + len].copy_from_slice(&s[from..from + len]);
        }
    })
}

fn typed_mut<T: Element>(b: &mut Buffer) -> Option<&mut [T]> {
    if b.dtype() != T::DTYPE {
        return None;
    }
    tessera_mesh::dispatch_buf!(BufMut, b.as_buf_mut(), s, _S => bytemuck::try_cast_slice_mut(s).ok())
}

/// The elements of `tensors` (all of dtype `T`, shapes checked) concatenated
/// along `dim` into a tensor of `shape`, row-major.
fn cat_rows<T: Element>(tensors: &[Tensor], dim: usize, shape: &[usize]) -> Result<Vec<T>> {
    // Allocated first: the output may not fit even when every piece does.
    let mut out = crate::alloc::with_capacity("cat", shape)?;
    let outer: usize = tensors[0].shape()[..dim].iter().product();
    let parts: Vec<(Cow<'_, [T]>, usize)> = tensors
        .iter()
        .map(|t| {
            // `cat` checked that every piece has dtype `T`, so `typed` is `Some`.
            // Contiguous pieces are read in place (one copy, into `out`).
            let v = match typed::<T>(t.host_data().as_buf()) {
                Some(v) if t.is_contiguous() => {
                    let start = t.storage_offset();
                    Cow::Borrowed(&v[start..start + t.numel()])
                }
                Some(v) => Cow::Owned(t.geometry().gather(v)),
                None => Cow::Owned(Vec::new()),
            };
            // Elements per outer index: this piece's slab of `dim` and later dims.
            let block = t.shape()[dim..].iter().product();
            (v, block)
        })
        .collect();
    for o in 0..outer {
        for (v, block) in &parts {
            out.extend_from_slice(&v[o * block..(o + 1) * block]);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use tessera_mesh::DType;

    use super::*;

    fn iota(shape: &[usize]) -> Tensor {
        let n = shape.iter().product();
        Tensor::arange(n, DType::I64).unwrap().reshape(shape).unwrap()
    }

    fn vals(t: &Tensor) -> Vec<i64> {
        t.to_vec::<i64>().unwrap()
    }

    #[test]
    fn chunk_table() {
        macro_rules! case {
            ($shape:expr, $n:expr, $dim:expr, $sizes:expr) => {
                let t = iota(&$shape);
                let parts = t.chunk($n, $dim).unwrap();
                let sizes: Vec<usize> = parts.iter().map(|p| p.shape()[$dim]).collect();
                assert_eq!(sizes, $sizes, "{:?} over {} on dim {}", $shape, $n, $dim);
                assert!(parts.iter().all(|p| p.shares_storage(&t)), "chunks are views");
                assert_eq!(Tensor::cat(&parts, $dim).unwrap(), t, "chunks cover it");
            };
        }
        case!([13], 4, 0, vec![4, 4, 4, 1]);
        case!([6], 4, 0, vec![2, 2, 2, 0]);
        case!([5], 4, 0, vec![2, 2, 1, 0]);
        case!([0], 3, 0, vec![0, 0, 0]);
        case!([8], 4, 0, vec![2, 2, 2, 2]);
        case!([3], 1, 0, vec![3]);
        case!([2], 5, 0, vec![1, 1, 0, 0, 0]);
        case!([3, 7], 3, 1, vec![3, 3, 1]);
        case!([3, 7], 2, 0, vec![2, 1]);
        case!([2, 3, 4], 4, 2, vec![1, 1, 1, 1]);
    }

    #[test]
    fn chunk_values_on_dim_1() {
        let parts = iota(&[2, 5]).chunk(2, 1).unwrap();
        assert_eq!(parts[0].shape(), &[2, 3]);
        assert_eq!(vals(&parts[0]), vec![0, 1, 2, 5, 6, 7]);
        assert_eq!(vals(&parts[1]), vec![3, 4, 8, 9]);
    }

    #[test]
    fn narrow_views() {
        macro_rules! case {
            ($shape:expr, $dim:expr, $start:expr, $len:expr, $want_shape:expr, $want:expr) => {
                let t = iota(&$shape);
                let v = t.narrow($dim, $start, $len).unwrap();
                assert!(v.shares_storage(&t));
                assert_eq!(v.shape(), &$want_shape[..]);
                assert_eq!(vals(&v), $want);
            };
        }
        case!([6], 0, 2, 3, [3], vec![2, 3, 4]);
        case!([3, 4], 0, 1, 2, [2, 4], vec![4, 5, 6, 7, 8, 9, 10, 11]);
        case!([3, 4], 1, 1, 2, [3, 2], vec![1, 2, 5, 6, 9, 10]);
        case!([3, 4], 1, 4, 0, [3, 0], Vec::<i64>::new());
        case!([2, 2, 3], 2, 2, 1, [2, 2, 1], vec![2, 5, 8, 11]);
        // A narrow of a narrow of a transpose.
        let t = iota(&[3, 4]).transpose(0, 1).unwrap().narrow(0, 1, 2).unwrap();
        assert_eq!(vals(&t.narrow(1, 1, 2).unwrap()), vec![5, 9, 6, 10]);
    }

    #[test]
    fn shape_op_errors() {
        macro_rules! case {
            ($res:expr, $msg:expr) => {
                assert_eq!($res.unwrap_err().to_string(), $msg);
            };
        }
        let t = iota(&[3, 4]);
        case!(
            t.narrow(1, 3, 2),
            "narrow: start 3 + len 2 exceeds size 4 of dim 1 (shape [3, 4]); need start + len <= 4"
        );
        case!(
            t.narrow(0, usize::MAX, 2),
            format!(
                "narrow: start {} + len 2 exceeds size 3 of dim 0 (shape [3, 4]); need start + len <= 3",
                usize::MAX
            )
        );
        case!(
            t.narrow(2, 0, 1),
            "narrow: dim 2 is out of range for a tensor of rank 2"
        );
        case!(t.chunk(2, 5), "chunk: dim 5 is out of range for a tensor of rank 2");
        case!(
            t.chunk(0, 0),
            "chunk: cannot split dim 0 into 0 chunks; ask for at least 1"
        );
        case!(
            t.transpose(0, 2),
            "transpose: dim 2 is out of range for a tensor of rank 2"
        );
        case!(
            t.reshape(&[5, 2]),
            "reshape: shape mismatch: cannot reshape [3, 4] (12 elements) into [5, 2] (10 elements)"
        );
        case!(Tensor::cat(&[], 0), "cat: no tensors to concatenate; pass at least one");
        case!(
            Tensor::cat(std::slice::from_ref(&t), 2),
            "cat: dim 2 is out of range for a tensor of rank 2"
        );
        case!(
            Tensor::cat(&[t.clone(), iota(&[3, 4]).cast(DType::F32).unwrap()], 0),
            "cat: expected dtype i64, got f32"
        );
        case!(
            Tensor::cat(&[t.clone(), iota(&[3, 4]), iota(&[2, 4])], 1),
            "cat: shape mismatch: tensor 2 has shape [2, 4] but tensor 0 has [3, 4]; all dims but dim 1 must agree"
        );
        case!(
            Tensor::cat(&[t.clone(), iota(&[12])], 0),
            "cat: shape mismatch: tensor 1 has shape [12] but tensor 0 has [3, 4]; all dims but dim 0 must agree"
        );
    }

    #[test]
    fn cat_table() {
        macro_rules! case {
            ($parts:expr, $dim:expr, $shape:expr, $want:expr) => {
                let c = Tensor::cat(&$parts, $dim).unwrap();
                assert_eq!(c.shape(), &$shape[..]);
                assert!(c.is_contiguous());
                assert_eq!(vals(&c), $want);
            };
        }
        let t = iota(&[2, 3]);
        case!([iota(&[2, 3])], 0, [2, 3], vec![0, 1, 2, 3, 4, 5]);
        case!(
            [t.clone(), t.clone()],
            0,
            [4, 3],
            vec![0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5]
        );
        case!(
            [t.clone(), t.clone()],
            1,
            [2, 6],
            vec![0, 1, 2, 0, 1, 2, 3, 4, 5, 3, 4, 5]
        );
        case!(
            [iota(&[2, 0]), t.clone(), iota(&[2, 0])],
            1,
            [2, 3],
            vec![0, 1, 2, 3, 4, 5]
        );
        case!([iota(&[0, 3]), iota(&[0, 3])], 0, [0, 3], Vec::<i64>::new());
        case!(
            [t.transpose(0, 1).unwrap(), iota(&[3, 1])],
            1,
            [3, 3],
            vec![0, 3, 0, 1, 4, 1, 2, 5, 2]
        );
        case!([iota(&[0]), iota(&[2])], 0, [2], vec![0, 1]);
        // Contiguous views at a storage offset are read in place; narrowed rows
        // (row stride 1, not contiguous) are gathered row by row.
        case!(
            [t.narrow(0, 1, 1).unwrap(), t.clone()],
            0,
            [3, 3],
            vec![3, 4, 5, 0, 1, 2, 3, 4, 5]
        );
        let wide = iota(&[3, 4]);
        case!(
            [
                wide.narrow(1, 1, 2).unwrap(),
                iota(&[3, 1]),
                wide.narrow(1, 3, 1).unwrap()
            ],
            1,
            [3, 4],
            vec![1, 2, 0, 3, 5, 6, 1, 7, 9, 10, 2, 11]
        );
    }

    #[test]
    fn contiguous_copies_only_strided_views() {
        let t = iota(&[3, 4]);
        assert!(t.contiguous().shares_storage(&t));
        let rows = t.narrow(0, 1, 2).unwrap();
        assert!(rows.is_contiguous() && rows.contiguous().shares_storage(&t));
        macro_rules! case {
            ($view:expr, $want:expr) => {
                let v = $view;
                assert!(!v.is_contiguous());
                let c = v.contiguous();
                assert!(c.is_contiguous() && !c.shares_storage(&t));
                assert_eq!(c.storage_offset(), 0);
                assert_eq!(
                    c.strides(),
                    &super::super::geometry::contiguous_strides(c.shape())[..]
                );
                assert_eq!(vals(&c), $want);
                assert_eq!(c, v);
            };
        }
        case!(t.transpose(0, 1).unwrap(), vec![0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11]);
        case!(t.narrow(1, 1, 2).unwrap(), vec![1, 2, 5, 6, 9, 10]);
        case!(t.chunk(2, 1).unwrap()[1].clone(), vec![2, 3, 6, 7, 10, 11]);
    }

    #[test]
    fn reshape_table() {
        macro_rules! case {
            ($t:expr, $shape:expr, $view:expr, $want:expr) => {
                let t = $t;
                let r = t.reshape(&$shape).unwrap();
                assert_eq!(r.shape(), &$shape[..]);
                assert_eq!(r.shares_storage(&t), $view, "view or copy");
                assert_eq!(vals(&r), $want);
            };
        }
        let t = iota(&[2, 3]);
        case!(t.clone(), [3, 2], true, vec![0, 1, 2, 3, 4, 5]);
        case!(t.clone(), [6], true, vec![0, 1, 2, 3, 4, 5]);
        case!(t.clone(), [1, 6, 1], true, vec![0, 1, 2, 3, 4, 5]);
        case!(t.narrow(0, 1, 1).unwrap(), [3], true, vec![3, 4, 5]);
        case!(t.transpose(0, 1).unwrap(), [6], false, vec![0, 3, 1, 4, 2, 5]);
        case!(iota(&[0, 3]), [3, 0], true, Vec::<i64>::new());
        case!(iota(&[1]), [0usize; 0], true, vec![0]);
    }
}

#[cfg(test)]
mod assemble_tests {
    use super::*;
    use crate::Device;

    #[test]
    fn boxes_reassemble_and_misfits_are_refused() {
        let t = Tensor::arange(60, DType::F32).unwrap().reshape(&[3, 4, 5]).unwrap();
        // A 2×2 grid of boxes over dims 1 and 2, uneven.
        let boxes = [
            ([0, 0, 0], [3, 3, 2]),
            ([0, 0, 2], [3, 3, 3]),
            ([0, 3, 0], [3, 1, 2]),
            ([0, 3, 2], [3, 1, 3]),
        ];
        let pieces: Vec<([usize; 3], Tensor)> = boxes
            .iter()
            .map(|(o, s)| (*o, t.narrow(1, o[1], s[1]).unwrap().narrow(2, o[2], s[2]).unwrap()))
            .collect();
        let refs: Vec<(&[usize], &Tensor)> = pieces.iter().map(|(o, p)| (&o[..], p)).collect();
        assert_eq!(Tensor::assemble(&[3, 4, 5], DType::F32, Device::Cpu, &refs).unwrap(), t);
        // Uncovered elements are zero.
        let one = Tensor::assemble(
            &[2, 2],
            DType::I64,
            Device::Cpu,
            &[(&[1, 1][..], &Tensor::full(&[1, 1], 7.0, DType::I64).unwrap())],
        )
        .unwrap();
        assert_eq!(one.to_vec::<i64>().unwrap(), vec![0, 0, 0, 7]);
        let big = Tensor::ones(&[2, 3], DType::F32).unwrap();
        let e = Tensor::assemble(&[2, 2], DType::F32, Device::Cpu, &[(&[0, 0][..], &big)])
            .unwrap_err()
            .to_string();
        assert!(e.contains("does not fit"), "{e}");
        let e = Tensor::assemble(&[2, 3], DType::BF16, Device::Cpu, &[(&[0, 0][..], &big)])
            .unwrap_err()
            .to_string();
        assert!(e.contains("bf16"), "{e}");
    }
}
