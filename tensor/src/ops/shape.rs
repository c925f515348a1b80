//! Shape ops that kernels need: `permute` (a view), `broadcast_to` and
//! `repeat_interleave` (copies).

use ndarray::IxDyn;

use super::elementwise::broadcast_shapes;
use crate::kernel::any_dispatch;
use crate::{Error, Result, Tensor};

impl Tensor {
    /// The view whose dim `i` is this tensor's dim `dims[i]`, sharing storage.
    /// PyTorch: `Tensor.permute`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `dims` is not a permutation of
    /// `0..rank` (wrong length or a repeated dim); [`Error::DimOutOfRange`].
    pub fn permute(&self, dims: &[impl crate::Dim]) -> Result<Tensor> {
        let dims = &crate::resolve_dims(dims, "permute", self.rank())?[..];
        let rank = self.rank();
        if dims.len() != rank {
            return Err(Error::InvalidArgument {
                op: "permute",
                detail: format!(
                    "{dims:?} has {} dims but the tensor of shape {:?} has {rank}; name every dim once",
                    dims.len(),
                    self.shape()
                ),
            });
        }
        let mut seen = vec![false; rank];
        for &d in dims {
            super::check_dim("permute", d, rank)?;
            if std::mem::replace(&mut seen[d], true) {
                return Err(Error::InvalidArgument {
                    op: "permute",
                    detail: format!("dim {d} appears twice in {dims:?}; name every dim once"),
                });
            }
        }
        // Compose transposes (views): place dims[i] at position i, left to right.
        let mut current: Vec<usize> = (0..rank).collect();
        let mut out = self.clone();
        for (i, &d) in dims.iter().enumerate() {
            // `current` is a permutation holding `d` at or after `i`.
            let j = current.iter().position(|&c| c == d).unwrap_or(i);
            if j != i {
                out = out.transpose(i, j)?;
                current.swap(i, j);
            }
        }
        Ok(out)
    }

    /// This tensor broadcast to `shape` (NumPy rules: dims are aligned from the
    /// right; dims of size 1 repeat), as new contiguous storage. Every dtype.
    ///
    /// PyTorch: `torch.broadcast_to` / `Tensor.expand`, which return views with
    /// zero strides; this copies, because the tensor layout and its ndarray
    /// views do not admit repeated elements. Kernels broadcast their operands
    /// without calling this.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] when this shape does not broadcast to `shape`;
    /// [`Error::OutOfMemory`] when the copy cannot be allocated.
    pub fn broadcast_to(&self, shape: &[usize]) -> Result<Tensor> {
        let fits = shape.len() >= self.rank()
            && broadcast_shapes("broadcast_to", self.shape(), shape).is_ok_and(|b| b == shape);
        if !fits {
            return Err(Error::ShapeMismatch {
                op: "broadcast_to",
                detail: format!(
                    "cannot broadcast {:?} to {shape:?}; each dim must equal the target's \
                     (aligned from the right) or be 1",
                    self.shape()
                ),
            });
        }
        if shape == self.shape() {
            return Ok(self.clone());
        }
        if self.is_meta() {
            return Tensor::meta(shape, self.dtype());
        }
        any_dispatch!("broadcast_to", self.dtype(), T => {
            let view = self.view::<T>()?;
            let wide = view.broadcast(IxDyn(shape)).ok_or_else(|| Error::InvalidArgument {
                op: "broadcast_to",
                detail: format!("internal error: ndarray cannot broadcast {:?} to {shape:?}", self.shape()),
            })?;
            // A small tensor can broadcast to a shape too large for memory.
            let mut out = crate::alloc::with_capacity::<T>("broadcast_to", shape)?;
            out.extend(wide.iter().copied());
            Tensor::from_vec(out, shape)
        })
    }
}

impl Tensor {
    /// Each slice along `dim` repeated `repeats` times in place: `[.., n, ..]`
    /// becomes `[.., n·repeats, ..]` with slice `i` of the output equal to slice
    /// `i / repeats` of the input (`[a, a, b, b]` for 2 repeats of `[a, b]`), as
    /// new contiguous storage. Every dtype, every device. Grouped-query attention
    /// repeats its key/value heads so.
    ///
    /// PyTorch: `torch.repeat_interleave(x, repeats, dim)` with an integer
    /// `repeats` (LLaMA's `repeat_kv`).
    ///
    /// # Errors
    /// [`Error::DimOutOfRange`]; [`Error::InvalidArgument`] for `repeats == 0`.
    pub fn repeat_interleave(&self, repeats: usize, dim: impl crate::Dim) -> Result<Tensor> {
        let dim = dim.resolve("repeat_interleave", self.rank())?;
        const OP: &str = "repeat_interleave";
        super::check_dim(OP, dim, self.rank())?;
        if repeats == 0 {
            return Err(Error::InvalidArgument {
                op: OP,
                detail: "repeats must be at least 1".into(),
            });
        }
        if repeats == 1 {
            return Ok(self.clone());
        }
        let mut unsqueezed = self.shape().to_vec();
        unsqueezed.insert(dim + 1, 1);
        let x = self.reshape(&unsqueezed)?;
        let copies = vec![x; repeats];
        let mut out = self.shape().to_vec();
        out[dim] *= repeats;
        Tensor::cat(&copies, dim + 1)?.reshape(&out)
    }

    /// The gradient of [`repeat_interleave`](Self::repeat_interleave) for the
    /// output gradient `self`: each group of `repeats` consecutive slices along
    /// `dim` summed (`[.., n·repeats, ..]` to `[.., n, ..]`).
    ///
    /// # Errors
    /// [`Error::DimOutOfRange`]; [`Error::ShapeMismatch`] when `repeats` does not
    /// divide the size of `dim`; integer tensors.
    pub fn repeat_interleave_backward(&self, repeats: usize, dim: impl crate::Dim) -> Result<Tensor> {
        let dim = dim.resolve("repeat_interleave_backward", self.rank())?;
        const OP: &str = "repeat_interleave_backward";
        super::check_dim(OP, dim, self.rank())?;
        let n = self.shape()[dim];
        if repeats == 0 || !n.is_multiple_of(repeats) {
            return Err(Error::ShapeMismatch {
                op: OP,
                detail: format!(
                    "dim {dim} of {:?} is not a whole number of groups of {repeats}",
                    self.shape()
                ),
            });
        }
        if repeats == 1 {
            return Ok(self.clone());
        }
        let mut grouped = self.shape().to_vec();
        grouped[dim] = n / repeats;
        grouped.insert(dim + 1, repeats);
        self.reshape(&grouped)?.sum(&[dim + 1], false)
    }
}

#[cfg(test)]
mod tests {
    use tessera_mesh::DType;

    use super::*;

    fn iota(shape: &[usize]) -> Tensor {
        Tensor::arange(shape.iter().product(), DType::I64)
            .unwrap()
            .reshape(shape)
            .unwrap()
    }

    #[test]
    fn permute_table() {
        macro_rules! case {
            ($shape:expr, $dims:expr, $want_shape:expr, $want:expr) => {
                let t = iota(&$shape);
                let p = t.permute(&$dims).unwrap();
                assert!(p.shares_storage(&t));
                assert_eq!(p.shape(), &$want_shape[..]);
                let want: Vec<i64> = $want;
                assert_eq!(p.to_vec::<i64>().unwrap(), want);
            };
        }
        case!([2, 3], [1, 0], [3, 2], vec![0, 3, 1, 4, 2, 5]);
        case!([2, 3], [0, 1], [2, 3], vec![0, 1, 2, 3, 4, 5]);
        case!([2, 1, 3], [2, 0, 1], [3, 2, 1], vec![0, 3, 1, 4, 2, 5]);
        case!([2, 2, 2], [1, 2, 0], [2, 2, 2], vec![0, 4, 1, 5, 2, 6, 3, 7]);
        case!([2, 2, 2], [2, 0, 1], [2, 2, 2], vec![0, 2, 4, 6, 1, 3, 5, 7]);
        case!([0usize; 0], [0usize; 0], [0usize; 0], vec![0]);
        case!([0, 2], [1, 0], [2, 0], vec![]);
        // Against the definition: out[i, j, k, l] = t[idx permuted].
        let t = iota(&[2, 3, 4, 5]);
        let dims = [3, 1, 0, 2];
        let p = t.permute(&dims).unwrap();
        let (x, y) = (t.to_vec::<i64>().unwrap(), p.to_vec::<i64>().unwrap());
        let mut k = 0;
        for a in 0..5 {
            for b in 0..3 {
                for c in 0..2 {
                    for d in 0..4 {
                        let mut idx = [0; 4];
                        (idx[dims[0]], idx[dims[1]], idx[dims[2]], idx[dims[3]]) = (a, b, c, d);
                        assert_eq!(y[k], x[((idx[0] * 3 + idx[1]) * 4 + idx[2]) * 5 + idx[3]]);
                        k += 1;
                    }
                }
            }
        }
    }

    #[test]
    fn broadcast_to_table() {
        macro_rules! case {
            ($shape:expr, $to:expr, $want:expr) => {
                let got = iota(&$shape).broadcast_to(&$to).unwrap();
                assert_eq!(got.shape(), &$to[..]);
                let want: Vec<i64> = $want;
                assert_eq!(got.to_vec::<i64>().unwrap(), want);
            };
        }
        case!([3], [2, 3], vec![0, 1, 2, 0, 1, 2]);
        case!([3, 1], [3, 2], vec![0, 0, 1, 1, 2, 2]);
        case!([0usize; 0], [2, 2], vec![0; 4]);
        case!([1, 2], [2, 0, 2], vec![]);
        case!([2], [2], vec![0, 1]);
        let t = iota(&[2, 3]).transpose(0, 1).unwrap();
        let got = t.broadcast_to(&[2, 3, 2]).unwrap();
        assert_eq!(got.to_vec::<i64>().unwrap(), vec![0, 3, 1, 4, 2, 5, 0, 3, 1, 4, 2, 5]);
        let f = Tensor::from_vec(vec![1.5f32], &[1]).unwrap();
        assert_eq!(f.broadcast_to(&[3]).unwrap().to_vec::<f32>().unwrap(), vec![1.5; 3]);
    }

    #[test]
    fn shape_errors() {
        macro_rules! case {
            ($res:expr, $msg:expr) => {
                assert_eq!($res.unwrap_err().to_string(), $msg);
            };
        }
        let t = iota(&[2, 3]);
        case!(
            t.permute(&[0]),
            "permute: [0] has 1 dims but the tensor of shape [2, 3] has 2; name every dim once"
        );
        case!(
            t.permute(&[0, 0]),
            "permute: dim 0 appears twice in [0, 0]; name every dim once"
        );
        case!(
            t.permute(&[0, 2]),
            "permute: dim 2 is out of range for a tensor of rank 2"
        );
        case!(
            t.broadcast_to(&[3, 3]),
            "broadcast_to: shape mismatch: cannot broadcast [2, 3] to [3, 3]; each dim must equal \
             the target's (aligned from the right) or be 1"
        );
        case!(
            t.broadcast_to(&[3]),
            "broadcast_to: shape mismatch: cannot broadcast [2, 3] to [3]; each dim must equal \
             the target's (aligned from the right) or be 1"
        );
    }

    #[test]
    fn repeat_interleave_repeats_slices_in_place_and_its_backward_sums_the_groups() {
        let x = iota(&[2, 3, 2]);
        let y = x.repeat_interleave(2, 1).unwrap();
        assert_eq!(y.shape(), &[2, 6, 2]);
        let want: Vec<i64> = vec![
            0, 1, 0, 1, 2, 3, 2, 3, 4, 5, 4, 5, 6, 7, 6, 7, 8, 9, 8, 9, 10, 11, 10, 11,
        ];
        assert_eq!(y.to_vec::<i64>().unwrap(), want);
        assert_eq!(
            x.repeat_interleave(3, 2).unwrap().to_vec::<i64>().unwrap()[..6],
            [0, 0, 0, 1, 1, 1]
        );
        let g = iota(&[1, 4]).cast(DType::F32).unwrap();
        let back = g.repeat_interleave_backward(2, 1).unwrap();
        assert_eq!(back.to_vec::<f32>().unwrap(), [1.0, 5.0]);
        assert!(
            x.repeat_interleave(0, 1)
                .unwrap_err()
                .to_string()
                .contains("at least 1")
        );
        assert!(x.repeat_interleave(2, 3).is_err());
        let err = g.repeat_interleave_backward(3, 1).unwrap_err().to_string();
        assert!(err.contains("groups of 3"), "{err}");
    }
}
