//! Shape, strides and offset: how a tensor sees its storage.

use std::mem::MaybeUninit;

use smallvec::SmallVec;

use crate::{Error, Result};

/// Dims stored inline up to this rank.
pub(crate) type Dims = SmallVec<[usize; 4]>;

/// A strided view of a flat buffer: element `idx` lives at
/// `offset + sum(idx[d] * strides[d])`. Strides are in elements.
///
/// Invariant: every element of a non-empty layout lies inside its storage;
/// an empty layout (some dim of size 0) has offset 0.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Geometry {
    pub(crate) shape: Dims,
    pub(crate) strides: Dims,
    pub(crate) offset: usize,
}

/// The product of `shape`, or an error naming `op` on overflow.
pub(crate) fn checked_numel(op: &'static str, shape: &[usize]) -> Result<usize> {
    shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .ok_or_else(|| Error::InvalidArgument {
            op,
            detail: format!("shape {shape:?} has more elements than fit in memory"),
        })
}

/// Row-major strides of `shape`.
pub(crate) fn contiguous_strides(shape: &[usize]) -> Dims {
    let mut strides: Dims = SmallVec::from_elem(0, shape.len());
    let mut step = 1usize;
    for (s, &d) in strides.iter_mut().zip(shape).rev() {
        *s = step;
        step = step.saturating_mul(d);
    }
    strides
}

impl Geometry {
    /// A row-major layout of `shape` from offset 0.
    pub(crate) fn contiguous(shape: &[usize]) -> Geometry {
        Geometry {
            shape: SmallVec::from_slice(shape),
            strides: contiguous_strides(shape),
            offset: 0,
        }
    }

    pub(crate) fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Whether the elements are row-major and dense from `offset` (dims of size
    /// 1 may have any stride; empty layouts are contiguous).
    pub(crate) fn is_contiguous(&self) -> bool {
        if self.shape.contains(&0) {
            return true;
        }
        let mut step = 1usize;
        for (&d, &s) in self.shape.iter().zip(&self.strides).rev() {
            if d != 1 && s != step {
                return false;
            }
            step *= d;
        }
        true
    }

    /// Checks that `dim` is a dim of this layout.
    pub(crate) fn check_dim(&self, op: &'static str, dim: usize) -> Result<()> {
        if dim < self.shape.len() {
            Ok(())
        } else {
            Err(Error::DimOutOfRange {
                op,
                dim,
                rank: self.shape.len(),
            })
        }
    }

    /// The view of `len` entries of `dim` from `start`.
    pub(crate) fn narrow(&self, dim: usize, start: usize, len: usize) -> Result<Geometry> {
        self.check_dim("narrow", dim)?;
        let size = self.shape[dim];
        if start.checked_add(len).is_none_or(|end| end > size) {
            return Err(Error::InvalidArgument {
                op: "narrow",
                detail: format!(
                    "start {start} + len {len} exceeds size {size} of dim {dim} \
                     (shape {:?}); need start + len <= {size}",
                    self.shape
                ),
            });
        }
        let mut out = self.clone();
        out.shape[dim] = len;
        out.offset += start * self.strides[dim];
        if out.shape.contains(&0) {
            out.offset = 0;
        }
        Ok(out)
    }

    /// The view with dims `d0` and `d1` swapped.
    pub(crate) fn transpose(&self, d0: usize, d1: usize) -> Result<Geometry> {
        self.check_dim("transpose", d0)?;
        self.check_dim("transpose", d1)?;
        let mut out = self.clone();
        out.shape.swap(d0, d1);
        out.strides.swap(d0, d1);
        Ok(out)
    }

    /// The storage offsets of all elements in row-major logical order.
    pub(crate) fn offsets(&self) -> Offsets<'_> {
        Offsets {
            layout: self,
            index: SmallVec::from_elem(0, self.shape.len()),
            next: self.offset,
            left: self.numel(),
        }
    }

    /// Copies the elements of this view of `data` into a new row-major vector,
    /// split along the first dim over the rank's threads when large
    /// ([`par_rows`](crate::kernel::par_rows)): each thread copies the rows that
    /// the kernel before it most likely wrote on that thread, from its own cache.
    pub(crate) fn gather<T: Copy + Send + Sync>(&self, data: &[T]) -> Vec<T> {
        let n = self.numel();
        if self.is_contiguous() {
            return data[self.offset..self.offset + n].to_vec();
        }
        // Not contiguous, so not empty and of rank >= 1.
        let inner = n / self.shape[0];
        let mut out = Vec::with_capacity(n);
        crate::kernel::par_rows(&mut out.spare_capacity_mut()[..n], inner, |start, block| {
            let mut part = self.clone();
            part.shape[0] = block.len() / inner;
            part.offset += start / inner * self.strides[0];
            part.gather_into(data, block);
        });
        // SAFETY: the blocks of `par_rows` tile the `n` elements, and
        // `gather_into` wrote every element of each (it asserts so).
        unsafe { out.set_len(n) };
        out
    }

    /// Writes the elements of this (non-contiguous, non-empty) view of `data`
    /// into `out`, row-major; `out` holds exactly as many.
    fn gather_into<T: Copy>(&self, data: &[T], out: &mut [MaybeUninit<T>]) {
        // Copy rows of the last dim.
        let last = self.shape.len() - 1;
        let (row_len, row_stride) = (self.shape[last], self.strides[last]);
        let rows = Geometry {
            shape: SmallVec::from_slice(&self.shape[..last]),
            strides: SmallVec::from_slice(&self.strides[..last]),
            offset: self.offset,
        };
        let mut written = 0;
        for (o, base) in out.chunks_exact_mut(row_len).zip(rows.offsets()) {
            if row_stride == 1 {
                // Rows of contiguous elements (a narrowed or sliced tensor): one copy each.
                for (o, &x) in o.iter_mut().zip(&data[base..base + row_len]) {
                    *o = MaybeUninit::new(x);
                }
            } else {
                for (i, o) in o.iter_mut().enumerate() {
                    *o = MaybeUninit::new(data[base + i * row_stride]);
                }
            }
            written += row_len;
        }
        assert_eq!(written, out.len(), "gather: the view does not fill its output");
    }
}

/// Iterator over the storage offsets of a layout, row-major.
pub(crate) struct Offsets<'a> {
    layout: &'a Geometry,
    index: Dims,
    next: usize,
    left: usize,
}

impl Iterator for Offsets<'_> {
    type Item = usize;

    fn next(&mut self) -> Option<usize> {
        if self.left == 0 {
            return None;
        }
        self.left -= 1;
        let current = self.next;
        if self.left > 0 {
            // Odometer step: bump the last dim, carrying into earlier dims.
            for d in (0..self.index.len()).rev() {
                self.index[d] += 1;
                self.next += self.layout.strides[d];
                if self.index[d] < self.layout.shape[d] {
                    break;
                }
                self.next -= self.layout.strides[d] * self.layout.shape[d];
                self.index[d] = 0;
            }
        }
        Some(current)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.left, Some(self.left))
    }
}

impl ExactSizeIterator for Offsets<'_> {}

#[cfg(test)]
mod tests {
    use super::*;

    fn geometry(shape: &[usize], strides: &[usize], offset: usize) -> Geometry {
        Geometry {
            shape: SmallVec::from_slice(shape),
            strides: SmallVec::from_slice(strides),
            offset,
        }
    }

    #[test]
    fn contiguity() {
        macro_rules! case {
            ($shape:expr, $strides:expr, $want:expr) => {
                assert_eq!(
                    geometry(&$shape, &$strides, 0).is_contiguous(),
                    $want,
                    "{:?} {:?}",
                    $shape,
                    $strides
                );
            };
        }
        case!([2, 3], [3, 1], true);
        case!([2, 3], [1, 2], false);
        case!([2, 2], [3, 1], false); // narrowed rows
        case!([1, 3], [99, 1], true); // size-1 dims may have any stride
        case!([0, 3], [1, 7], true);
        case!([0usize; 0], [0usize; 0], true);
        case!([4], [2], false);
    }

    #[test]
    fn offsets_and_gather() {
        macro_rules! case {
            ($shape:expr, $strides:expr, $off:expr, $want:expr) => {
                let l = geometry(&$shape, &$strides, $off);
                let want: Vec<usize> = $want;
                assert_eq!(l.offsets().collect::<Vec<_>>(), want, "{l:?}");
                let data: Vec<usize> = (0..32).collect();
                assert_eq!(l.gather(&data), want, "{l:?}");
            };
        }
        case!([2, 3], [3, 1], 0, vec![0, 1, 2, 3, 4, 5]);
        case!([3, 2], [1, 3], 0, vec![0, 3, 1, 4, 2, 5]);
        case!([2, 2], [3, 1], 1, vec![1, 2, 4, 5]);
        case!([2, 2, 2], [8, 1, 2], 4, vec![4, 6, 5, 7, 12, 14, 13, 15]);
        case!([], [], 5, vec![5]);
        case!([2, 0], [0, 1], 0, vec![]);
    }

    #[test]
    fn narrow_of_empty_keeps_offset_in_bounds() {
        let l = Geometry::contiguous(&[2, 3]);
        let l = l.narrow(0, 2, 0).unwrap().narrow(1, 3, 0).unwrap();
        assert_eq!((l.offset, l.numel()), (0, 0));
    }

    #[test]
    fn numel_overflow_is_an_error() {
        assert_eq!(checked_numel("t", &[2, 3, 4]).unwrap(), 24);
        assert_eq!(checked_numel("t", &[]).unwrap(), 1);
        let e = checked_numel("t", &[usize::MAX, 2]).unwrap_err();
        assert!(e.to_string().contains("more elements than fit"), "{e}");
    }
}
