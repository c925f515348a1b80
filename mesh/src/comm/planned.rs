//! Collectives of a planning run: counted as running them would count them,
//! without moving data or meeting the peers.

use crate::stats::OpKind;
use crate::{DType, Result};

/// A collective that a planning run (tensors on [`Device::Meta`](crate::Device::Meta),
/// which have shapes but no values) issues where a real run would issue it, for
/// [`Communicator::count_planned`](super::Communicator::count_planned). Lengths
/// and counts are in elements of `dtype`, as the real call's buffers would be.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub enum Planned<'a> {
    /// `all_gather` (any form) of this rank's piece of `counts[rank]` elements.
    AllGather {
        /// The element type.
        dtype: DType,
        /// Every rank's piece.
        counts: &'a [usize],
    },
    /// `reduce_scatter` (any form) of an input of `counts.iter().sum()` elements.
    ReduceScatter {
        /// The element type.
        dtype: DType,
        /// Every rank's piece of the result.
        counts: &'a [usize],
    },
    /// `all_to_all` (any form) sending `send_counts[q]` elements to rank `q`.
    AllToAll {
        /// The element type.
        dtype: DType,
        /// Elements to each rank.
        send_counts: &'a [usize],
    },
    /// `all_reduce` of `len` elements.
    AllReduce {
        /// The element type.
        dtype: DType,
        /// Elements reduced.
        len: usize,
    },
}

impl Planned<'_> {
    /// The collective's kind and the bytes rank `rank` of `n` sends in it (the
    /// stats table's exact per-rank counts, as the backends record them).
    ///
    /// # Errors
    /// [`Error::BadLength`](crate::Error::BadLength) when a count list does
    /// not have one entry per rank.
    pub fn sent(&self, n: usize, rank: usize) -> Result<(OpKind, u64)> {
        let check = |kind: OpKind, counts: &[usize]| {
            if counts.len() == n {
                Ok(())
            } else {
                Err(crate::Error::BadLength {
                    op: kind.name(),
                    rank,
                    what: "counts (one per rank of the group)",
                    expected: n,
                    got: counts.len(),
                })
            }
        };
        Ok(match *self {
            Planned::AllGather { dtype, counts } => {
                check(OpKind::AllGather, counts)?;
                (OpKind::AllGather, super::all_gather_v_bytes(dtype, counts, rank, n))
            }
            Planned::ReduceScatter { dtype, counts } => {
                check(OpKind::ReduceScatter, counts)?;
                let send_bytes = counts.iter().sum::<usize>() * dtype.size_in_bytes();
                (
                    OpKind::ReduceScatter,
                    super::reduce_scatter_v_bytes(dtype, send_bytes, counts, rank),
                )
            }
            Planned::AllToAll { dtype, send_counts } => {
                check(OpKind::AllToAll, send_counts)?;
                (OpKind::AllToAll, super::all_to_all_v_bytes(dtype, send_counts, rank))
            }
            Planned::AllReduce { dtype, len } => (
                OpKind::AllReduce,
                OpKind::all_reduce_sent(n, rank, len * dtype.size_in_bytes()),
            ),
        })
    }
}
