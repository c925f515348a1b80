//! Splitting and stacking: `split`, `split_with_sizes`, `stack`, and the size
//! rules of `torch.split` / `torch.chunk` that the distributed layers share.

use super::check_dim;
use crate::{Error, Result, Tensor};

impl Tensor {
    /// Views of `split_size` slices along `dim`, the last one shorter when
    /// `split_size` does not divide the dim (`ceil(size / split_size)` views).
    ///
    /// PyTorch: `torch.split(x, split_size, dim)`.
    ///
    /// # Errors
    /// [`Error::DimOutOfRange`]; [`Error::InvalidArgument`] for `split_size == 0`.
    pub fn split(&self, split_size: usize, dim: impl crate::Dim) -> Result<Vec<Tensor>> {
        let dim = dim.resolve("split", self.rank())?;
        self.split_with_sizes(&split_sizes("split", self.shape(), split_size, dim)?, dim)
    }

    /// Views of `sizes[i]` slices along `dim`, in order; the sizes add up to the dim.
    ///
    /// PyTorch: `torch.split(x, sizes, dim)` (`split_with_sizes`).
    ///
    /// # Errors
    /// [`Error::DimOutOfRange`]; [`Error::ShapeMismatch`] when the sizes do not add up.
    pub fn split_with_sizes(&self, sizes: &[usize], dim: impl crate::Dim) -> Result<Vec<Tensor>> {
        let dim = dim.resolve("split_with_sizes", self.rank())?;
        split_ranges("split_with_sizes", self.shape(), sizes, dim)?
            .into_iter()
            .map(|(start, len)| self.narrow(dim, start, len))
            .collect()
    }

    /// The tensors (one shape, one dtype) stacked along a new dim `dim`
    /// (`0..=rank`).
    ///
    /// PyTorch: `torch.stack`.
    ///
    /// # Errors
    /// An empty list, shapes or dtypes that differ, `dim` past the rank.
    pub fn stack(tensors: &[Tensor], dim: impl crate::Dim) -> Result<Tensor> {
        // No tensors: any dim resolves, and the missing input is the error below.
        let dim = dim.resolve("stack", tensors.first().map_or(usize::MAX, |t| t.rank() + 1))?;
        let pieces = stack_pieces("stack", tensors.iter().map(Tensor::shape), dim)?;
        let unsqueezed = tensors
            .iter()
            .zip(&pieces)
            .map(|(t, s)| t.reshape(s))
            .collect::<Result<Vec<_>>>()?;
        Tensor::cat(&unsqueezed, dim)
    }
}

/// The sizes of `torch.split(x, split_size, dim)` for a tensor of `shape`.
///
/// # Errors
/// `dim` out of range; a zero `split_size` for a non-empty dim.
pub fn split_sizes(op: &'static str, shape: &[usize], split_size: usize, dim: usize) -> Result<Vec<usize>> {
    check_dim(op, dim, shape.len())?;
    let size = shape[dim];
    if split_size == 0 {
        return if size == 0 {
            Ok(vec![0])
        } else {
            Err(Error::InvalidArgument {
                op,
                detail: format!("split_size 0 cannot split dim {dim} of size {size}; give at least 1"),
            })
        };
    }
    let n = size.div_ceil(split_size).max(1);
    Ok((0..n)
        .map(|i| split_size.min(size - (i * split_size).min(size)))
        .collect())
}

/// The sizes of `torch.chunk(x, n, dim)`: `ceil(size / n)` each, the last
/// shorter, and fewer than `n` pieces when the size runs out first.
///
/// # Errors
/// `dim` out of range; `n == 0`.
pub fn chunk_sizes(op: &'static str, shape: &[usize], n: usize, dim: usize) -> Result<Vec<usize>> {
    check_dim(op, dim, shape.len())?;
    if n == 0 {
        return Err(Error::InvalidArgument {
            op,
            detail: format!("cannot split dim {dim} into 0 chunks; ask for at least 1"),
        });
    }
    split_sizes(op, shape, shape[dim].div_ceil(n), dim)
}

/// The `(start, len)` of each piece of a split of dim `dim` of `shape` into
/// `sizes`, checked: the sizes add up to the dim.
///
/// # Errors
/// `dim` out of range; sizes that do not add up.
pub fn split_ranges(op: &'static str, shape: &[usize], sizes: &[usize], dim: usize) -> Result<Vec<(usize, usize)>> {
    check_dim(op, dim, shape.len())?;
    let total: usize = sizes.iter().sum();
    if total != shape[dim] {
        return Err(Error::ShapeMismatch {
            op,
            detail: format!(
                "the sizes {sizes:?} add up to {total}, but dim {dim} of {shape:?} has {}",
                shape[dim]
            ),
        });
    }
    let mut at = 0;
    Ok(sizes
        .iter()
        .map(|&n| {
            at += n;
            (at - n, n)
        })
        .collect())
}

/// The shape of each piece of a stack along `dim` (a 1 inserted at `dim`).
///
/// # Errors
/// No pieces, shapes that differ, `dim` past the rank.
pub fn stack_pieces<'a>(
    op: &'static str,
    shapes: impl Iterator<Item = &'a [usize]>,
    dim: usize,
) -> Result<Vec<Vec<usize>>> {
    let shapes: Vec<&[usize]> = shapes.collect();
    let Some(first) = shapes.first() else {
        return Err(Error::InvalidArgument {
            op,
            detail: "no tensors to stack; pass at least one".into(),
        });
    };
    if dim > first.len() {
        return Err(Error::DimOutOfRange {
            op,
            dim,
            rank: first.len() + 1,
        });
    }
    if let Some((i, s)) = shapes.iter().enumerate().find(|(_, s)| *s != first) {
        return Err(Error::ShapeMismatch {
            op,
            detail: format!("tensor {i} has shape {s:?} but tensor 0 has {first:?}; stacked tensors share one shape"),
        });
    }
    Ok(shapes
        .iter()
        .map(|s| {
            let mut v = s.to_vec();
            v.insert(dim, 1);
            v
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DType;

    #[test]
    fn split_chunk_and_stack_follow_pytorch() {
        assert_eq!(split_sizes("t", &[7, 2], 3, 0).unwrap(), [3, 3, 1]);
        assert_eq!(
            chunk_sizes("t", &[5], 4, 0).unwrap(),
            [2, 2, 1],
            "fewer than n, as torch.chunk"
        );
        assert_eq!(chunk_sizes("t", &[6], 4, 0).unwrap(), [2, 2, 2]);
        assert_eq!(chunk_sizes("t", &[0], 3, 0).unwrap(), [0]);
        let x = Tensor::arange(6, DType::F32).unwrap().reshape(&[3, 2]).unwrap();
        let parts = x.split_with_sizes(&[1, 2], 0).unwrap();
        assert_eq!(parts[1].to_vec::<f32>().unwrap(), [2.0, 3.0, 4.0, 5.0]);
        assert_eq!(x.split(2, 0).unwrap().len(), 2);
        let err = x.split_with_sizes(&[1, 1], 0).unwrap_err().to_string();
        assert!(err.contains("add up to 2, but dim 0 of [3, 2] has 3"), "{err}");
        let s = Tensor::stack(&[x.clone(), x.clone()], 1).unwrap();
        assert_eq!(s.shape(), &[3, 2, 2]);
        assert_eq!(s.to_vec::<f32>().unwrap()[..4], [0.0, 1.0, 0.0, 1.0]);
        let err = Tensor::stack(&[x.clone(), x.reshape(&[2, 3]).unwrap()], 0)
            .unwrap_err()
            .to_string();
        assert!(err.contains("tensor 1 has shape [2, 3]"), "{err}");
        assert!(Tensor::stack(&[x], 3).is_err());
    }
}
