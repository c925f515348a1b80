//! The boxes of a global tensor: checking one, and filling one element by
//! element from the elements' global indices on the rank's threads.

use std::mem::MaybeUninit;

use crate::kernel::{par_blocks, par_parts, unravel};
use crate::{Element, Error, Result, Tensor};

/// The global row-major indices of a box's elements, in the box's row-major order.
struct Indices<'a> {
    local: &'a [usize],
    /// The global tensor's row-major strides (wrapping: a global tensor of 2⁶⁴
    /// elements has a stride of 2⁶⁴ where it is multiplied only by 0).
    strides: Vec<u64>,
    /// The current element's index in the box, per dim.
    idx: Vec<usize>,
    /// The current element's global index.
    global: u64,
}

impl<'a> Indices<'a> {
    /// From element `start` (row-major, `< numel(local)`) of the box at `offset`.
    fn new(global_shape: &[usize], offset: &[usize], local: &'a [usize], start: usize) -> Indices<'a> {
        let rank = local.len();
        let mut strides = vec![1u64; rank];
        for d in (1..rank).rev() {
            strides[d - 1] = strides[d].wrapping_mul(global_shape[d] as u64);
        }
        let idx = unravel(start, local);
        let global = (0..rank).fold(0u64, |g, d| {
            g.wrapping_add(((offset[d] + idx[d]) as u64).wrapping_mul(strides[d]))
        });
        Indices {
            local,
            strides,
            idx,
            global,
        }
    }

    /// The current element's global index; moves to the next element (after the
    /// last one, back to the first).
    #[inline]
    fn next_index(&mut self) -> u64 {
        let current = self.global;
        for d in (0..self.local.len()).rev() {
            self.idx[d] += 1;
            self.global = self.global.wrapping_add(self.strides[d]);
            if self.idx[d] < self.local[d] {
                break;
            }
            self.idx[d] = 0;
            let span = (self.local[d] as u64).wrapping_mul(self.strides[d]);
            self.global = self.global.wrapping_sub(span);
        }
        current
    }
}

/// Checks that the box `[offset, offset + local_shape)` lies in `global_shape`,
/// and that global indices fit 64 bits.
pub(super) fn check_region(
    op: &'static str,
    global_shape: &[usize],
    offset: &[usize],
    local_shape: &[usize],
) -> Result<()> {
    let rank = global_shape.len();
    if offset.len() != rank || local_shape.len() != rank {
        return Err(Error::ShapeMismatch {
            op,
            detail: format!(
                "global shape {global_shape:?} has rank {rank}, but the offset {offset:?} has {} entries \
                 and the local shape {local_shape:?} {}; pass one entry per dim",
                offset.len(),
                local_shape.len()
            ),
        });
    }
    for d in 0..rank {
        if offset[d]
            .checked_add(local_shape[d])
            .is_none_or(|end| end > global_shape[d])
        {
            return Err(Error::InvalidArgument {
                op,
                detail: format!(
                    "the box at offset {offset:?} of shape {local_shape:?} ends past dim {d} of the global \
                     shape {global_shape:?} ({} + {} > {}); pass a box inside the global tensor",
                    offset[d], local_shape[d], global_shape[d]
                ),
            });
        }
    }
    let numel = global_shape.iter().try_fold(1u128, |n, &s| n.checked_mul(s as u128));
    if !global_shape.contains(&0) && numel.is_none_or(|n| n > 1 << 64) {
        return Err(Error::InvalidArgument {
            op,
            detail: format!(
                "global shape {global_shape:?} has more than 2^64 elements, so an element's index \
                 does not fit the 64 bits of the counter; use a smaller tensor"
            ),
        });
    }
    Ok(())
}

/// A contiguous tensor of `local_shape` whose element at global index `i` is
/// `value(i)`, split over the rank's threads by [`par_parts`].
pub(super) fn fill_box<T: Element>(
    op: &'static str,
    global_shape: &[usize],
    offset: &[usize],
    local_shape: &[usize],
    value: impl Fn(u64) -> T + Sync,
) -> Result<Tensor> {
    let write = |out: &mut [MaybeUninit<T>]| {
        par_blocks(out, 1, par_parts(out.len()), |start, block| {
            if block.is_empty() {
                return;
            }
            let mut indices = Indices::new(global_shape, offset, local_shape, start);
            for o in block.iter_mut() {
                *o = MaybeUninit::new(value(indices.next_index()));
            }
        });
    };
    // SAFETY: the blocks of `par_blocks` tile the output, and each block's loop
    // writes every element of its block.
    let data = unsafe { crate::alloc::written(op, local_shape, write)? };
    Tensor::from_vec(data, local_shape)
}
