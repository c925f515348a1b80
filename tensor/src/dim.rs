//! Dims as PyTorch takes them: counted from the front (`0`, `1`, ...) or, when
//! negative, from the back (`-1` is the last dim); and shapes with one size
//! inferred (`-1`).

use crate::{Error, Result};

/// A dim of a tensor, wherever an op takes one: a `usize` counts from the
/// front; a signed integer (`i32`, `i64`, `isize`) counts from the back when
/// negative (`-1`: the last dim), as PyTorch's dims do. An integer literal
/// works as either (`x.softmax(-1)`, `x.narrow(1, 0, 4)`).
///
/// ```
/// use tessera_tensor::{DType, Dim, Tensor};
///
/// let x = Tensor::zeros(&[2, 3, 4], DType::F32)?;
/// assert_eq!(x.sum(&[-1], false)?.shape(), &[2, 3]);
/// assert_eq!(x.transpose(0, -1)?.shape(), &[4, 3, 2]);
/// assert_eq!((-2).resolve("example", 3)?, 1);
/// assert!((-4).resolve("example", 3).is_err());
/// # Ok::<(), tessera_tensor::Error>(())
/// ```
pub trait Dim: Copy {
    /// The dim of a tensor of rank `rank`, counted from the front.
    ///
    /// # Errors
    /// A dim outside `-rank..rank`, naming `op` and the range.
    fn resolve(self, op: &'static str, rank: usize) -> Result<usize>;
}

impl Dim for usize {
    fn resolve(self, op: &'static str, rank: usize) -> Result<usize> {
        if self < rank {
            Ok(self)
        } else {
            Err(Error::DimOutOfRange { op, dim: self, rank })
        }
    }
}

macro_rules! signed_dim {
    ($($t:ty),*) => {$(
        impl Dim for $t {
            fn resolve(self, op: &'static str, rank: usize) -> Result<usize> {
                let (d, r) = (i128::from(self as i64), rank as i128);
                if d >= 0 {
                    // From the front: as a `usize` dim (a literal `3` is an `i32`).
                    return usize::try_from(d).unwrap_or(usize::MAX).resolve(op, rank);
                }
                let at = r + d;
                if at >= 0 {
                    Ok(at as usize)
                } else {
                    Err(Error::InvalidArgument {
                        op,
                        detail: format!(
                            "dim {self} is out of range for a tensor of rank {rank} (dims are {}..={})",
                            -r,
                            r - 1
                        ),
                    })
                }
            }
        }
    )*};
}
signed_dim!(i32, i64, isize);

/// Every dim of `dims` resolved for a tensor of rank `rank`.
///
/// # Errors
/// The first dim out of range.
pub fn resolve_dims(dims: &[impl Dim], op: &'static str, rank: usize) -> Result<Vec<usize>> {
    dims.iter().map(|d| d.resolve(op, rank)).collect()
}

/// A size in the shape given to a reshape: a `usize`, or a signed integer where
/// `-1` stands for the one size that makes the element count match, as
/// PyTorch's `view` and `reshape` take it (`x.reshape(&[b, t, -1, 16])`).
pub trait ShapeSize: Copy {
    /// The size, or `None` for `-1`.
    ///
    /// # Errors
    /// A negative size other than `-1`.
    fn size(self, op: &'static str) -> Result<Option<usize>>;
}

impl ShapeSize for usize {
    fn size(self, _op: &'static str) -> Result<Option<usize>> {
        Ok(Some(self))
    }
}

macro_rules! signed_size {
    ($($t:ty),*) => {$(
        impl ShapeSize for $t {
            fn size(self, op: &'static str) -> Result<Option<usize>> {
                match self {
                    -1 => Ok(None),
                    s if s >= 0 => Ok(Some(s as usize)),
                    s => Err(Error::InvalidArgument {
                        op,
                        detail: format!("size {s} in a shape; sizes are ≥ 0, or -1 for the one inferred"),
                    }),
                }
            }
        }
    )*};
}
signed_size!(i32, i64, isize);

/// `shape` with its `-1` (at most one) replaced by the size that makes its
/// element count `numel`.
///
/// # Errors
/// Two `-1`s, a negative size, or no size that makes the counts match.
pub fn infer_shape(op: &'static str, shape: &[impl ShapeSize], numel: usize) -> Result<Vec<usize>> {
    let sizes: Vec<Option<usize>> = shape.iter().map(|s| s.size(op)).collect::<Result<_>>()?;
    let inferred: Vec<usize> = (0..sizes.len()).filter(|&i| sizes[i].is_none()).collect();
    let known: usize = sizes.iter().flatten().product();
    let shown = || {
        let parts: Vec<String> = sizes.iter().map(|s| s.map_or("-1".into(), |v| v.to_string())).collect();
        format!("[{}]", parts.join(", "))
    };
    match inferred[..] {
        [] => Ok(sizes.into_iter().flatten().collect()),
        [at] if known > 0 && numel.is_multiple_of(known) => {
            let mut out: Vec<usize> = sizes.iter().map(|s| s.unwrap_or(0)).collect();
            out[at] = numel / known;
            Ok(out)
        }
        [_] => Err(Error::ShapeMismatch {
            op,
            detail: format!("no size for the -1 in {} makes {numel} elements", shown()),
        }),
        _ => Err(Error::InvalidArgument {
            op,
            detail: format!("{} has more than one -1; at most one size is inferred", shown()),
        }),
    }
}

#[cfg(test)]
mod tests {
    use crate::{DType, Tensor};

    use super::*;

    #[test]
    fn negative_dims_count_from_the_back_in_every_op() {
        let x = Tensor::randn(&[2, 3, 4], DType::F64, 5).unwrap();
        let v = |t: Tensor| t.to_f64_vec();
        assert_eq!(v(x.softmax(-1).unwrap()), v(x.softmax(2).unwrap()));
        assert_eq!(v(x.log_softmax(-3).unwrap()), v(x.log_softmax(0).unwrap()));
        assert_eq!(v(x.narrow(-2, 1, 2).unwrap()), v(x.narrow(1, 1, 2).unwrap()));
        assert_eq!(v(x.mean(&[-1, 0], true).unwrap()), v(x.mean(&[2, 0], true).unwrap()));
        assert_eq!(v(x.argmax(-1, false).unwrap()), v(x.argmax(2, false).unwrap()));
        assert_eq!(v(x.permute(&[-1, 0, 1]).unwrap()), v(x.permute(&[2, 0, 1]).unwrap()));
        assert_eq!(
            v(x.repeat_interleave(2, -2).unwrap()),
            v(x.repeat_interleave(2, 1).unwrap())
        );
        let pair = [x.clone(), x.clone()];
        assert_eq!(Tensor::cat(&pair, -1).unwrap().shape(), &[2, 3, 8]);
        // A stack's dim counts in the result's rank: -1 is a new last dim.
        assert_eq!(Tensor::stack(&pair, -1).unwrap().shape(), &[2, 3, 4, 2]);
        assert_eq!(x.split(3, -1).unwrap().len(), 2);
        assert_eq!(x.dim(-1).unwrap(), 4);
        let err = x.softmax(-4).unwrap_err().to_string();
        assert!(
            err.contains("dim -4 is out of range for a tensor of rank 3 (dims are -3..=2)"),
            "{err}"
        );
        assert!(matches!(
            x.softmax(3),
            Err(Error::DimOutOfRange { dim: 3, rank: 3, .. })
        ));
        assert_eq!(resolve_dims(&[-1i64, 0], "t", 2).unwrap(), [1, 0]);
        assert_eq!((-1isize).resolve("t", 1).unwrap(), 0);
    }

    #[test]
    fn one_size_of_a_reshape_may_be_inferred() {
        let x = Tensor::arange(24, DType::F32).unwrap();
        assert_eq!(x.reshape(&[2, -1, 4]).unwrap().shape(), &[2, 3, 4]);
        assert_eq!(x.reshape(&[-1]).unwrap().shape(), &[24]);
        assert_eq!(x.reshape(&[4usize, 6]).unwrap().shape(), &[4, 6]);
        let err = infer_shape("t", &[0i64, -1], 0).unwrap_err().to_string();
        assert!(err.contains("no size"), "{err}");
        let err = x.reshape(&[-1, -1]).unwrap_err().to_string();
        assert!(err.contains("[-1, -1] has more than one -1"), "{err}");
        let err = x.reshape(&[5, -1]).unwrap_err().to_string();
        assert!(err.contains("no size for the -1 in [5, -1] makes 24 elements"), "{err}");
        let err = x.reshape(&[-2, 12]).unwrap_err().to_string();
        assert!(err.contains("size -2"), "{err}");
    }
}
