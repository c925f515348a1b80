//! The [`Communicator`] trait: one process group and its collectives.

use crate::stats::{CommStats, OpKind};
use crate::{Buf, BufMut, Buffer, Element, Error, Pieces, Result};

mod check;
mod planned;
mod reduce_op;
mod runs;
mod variable;
mod work;
mod worker;

pub use planned::Planned;
pub use reduce_op::ReduceOp;
pub use runs::{Run, copy_runs};
pub use work::{Work, WorkTiming};

pub(crate) use check::{Call, check_call};
pub(crate) use runs::{check_runs, own_runs, runs_name};
pub(crate) use variable::*;
pub(crate) use worker::Worker;

/// One process group: this rank's view of a set of ranks and their collectives.
///
/// Only seven methods are required ([`rank`](Self::rank), [`size`](Self::size),
/// [`all_gather`](Self::all_gather), [`reduce_scatter`](Self::reduce_scatter),
/// [`broadcast`](Self::broadcast), [`barrier`](Self::barrier), [`split`](Self::split))
/// plus [`stats`](Self::stats) for accounting; everything else has a provided
/// default written in terms of them, which a backend overrides when it has a
/// faster native call. The trait is object safe: meshes hold `Box<dyn Communicator>`.
///
/// Buffer conventions (all collectives, as in MPI and NCCL): with `n` ranks,
/// `all_gather` sends `c` elements and receives `n·c` (rank `i`'s block at `i·c`);
/// `reduce_scatter` sends `n·c` and receives the reduction of block `rank`;
/// `all_to_all` sends and receives `n·c`, block `j` of the input going to rank `j`.
/// Every rank must call the same collectives in the same order with matching
/// lengths and dtypes; backends report a mismatch as [`Error::Mismatch`] rather
/// than hang where they can detect it.
///
/// Communicators are `Send` but not `Sync`: one thread drives a communicator.
///
/// PyTorch: `torch.distributed.ProcessGroup`.
pub trait Communicator: Send {
    /// This rank's index in the group, `0..size`.
    fn rank(&self) -> usize;

    /// Number of ranks in the group.
    fn size(&self) -> usize;

    /// Gathers every rank's `send` into `recv`, in rank order.
    ///
    /// # Errors
    /// Length or dtype mismatches, peer failures, timeouts.
    #[track_caller]
    fn all_gather(&self, send: Buf<'_>, recv: BufMut<'_>) -> Result<()>;

    /// Reduces `send` element-wise across ranks and gives this rank block `rank`.
    ///
    /// # Errors
    /// Length or dtype mismatches, a reduction not defined for the dtype, peer failures.
    #[track_caller]
    fn reduce_scatter(&self, send: Buf<'_>, recv: BufMut<'_>, op: ReduceOp) -> Result<()>;

    /// Copies `root`'s `buf` into every other rank's `buf`.
    ///
    /// # Errors
    /// Length mismatches, an out-of-range root, peer failures.
    #[track_caller]
    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<()>;

    /// Returns once every rank has entered the barrier.
    ///
    /// # Errors
    /// Peer failures, timeouts.
    #[track_caller]
    fn barrier(&self) -> Result<()>;

    /// Splits the group: ranks passing the same `color` form a new group,
    /// ordered by `(key, rank)`. Every rank must call it.
    ///
    /// PyTorch: `torch.distributed.split_group`; MPI: `MPI_Comm_split`.
    ///
    /// # Errors
    /// Peer failures, timeouts.
    #[track_caller]
    fn split(&self, color: u32, key: u32) -> Result<Box<dyn Communicator>>;

    /// Counters of the collectives this rank has issued (shared by every
    /// communicator of the rank, sub-groups included).
    fn stats(&self) -> &CommStats;

    /// A short name of the backend (`"threads"`, `"mpi"`, ...).
    fn backend(&self) -> &'static str {
        "unknown"
    }

    /// Counts `call` as issuing it would (in [`stats`](Self::stats), and for
    /// [`observe`](crate::observe)'s reports), without moving data or waiting
    /// for the peers: the collectives of a planning run, whose tensors are on
    /// [`Device::Meta`](crate::Device::Meta). Every rank of a planning run
    /// counts its own calls; no rank meets another.
    ///
    /// # Errors
    /// A count list without one entry per rank.
    fn count_planned(&self, call: Planned<'_>) -> Result<()> {
        let (kind, sent) = call.sent(self.size(), self.rank())?;
        self.stats().record_exact(kind, sent);
        // The communicator's address, by which meshes name it (as the backends do).
        let addr = (self as *const Self).cast::<()>() as usize;
        drop(crate::observe::collective(addr, kind, self.size(), sent, false));
        Ok(())
    }

    /// Reduces `buf` element-wise across ranks, in place.
    ///
    /// Default: a padded `reduce_scatter` followed by an `all_gather`.
    ///
    /// # Errors
    /// Length mismatches, a reduction not defined for the dtype, peer failures.
    #[track_caller]
    fn all_reduce(&self, mut buf: BufMut<'_>, op: ReduceOp) -> Result<()> {
        op.check("all_reduce", buf.dtype())?;
        let n = self.size();
        let len = buf.len();
        let chunk = len.div_ceil(n);
        let mut padded = Buffer::zeros(buf.dtype(), chunk * n);
        copy_prefix(buf.as_buf(), padded.as_buf_mut());
        let mut mine = Buffer::zeros(buf.dtype(), chunk);
        self.reduce_scatter(padded.as_buf(), mine.as_buf_mut(), op)?;
        self.all_gather(mine.as_buf(), padded.as_buf_mut())?;
        copy_prefix(padded.as_buf(), buf.reborrow());
        Ok(())
    }

    /// Reduces `send` element-wise across ranks into `recv` (out of place: `send` is
    /// left as it is). Same length and dtype.
    ///
    /// Default: copies `send` into `recv` and reduces in place.
    ///
    /// # Errors
    /// As [`all_reduce`](Self::all_reduce), plus a `recv` of another length or dtype.
    #[track_caller]
    fn all_reduce_into(&self, send: Buf<'_>, mut recv: BufMut<'_>, op: ReduceOp) -> Result<()> {
        if send.dtype() != recv.dtype() {
            return Err(Error::DTypeMismatch {
                op: "all_reduce",
                send: send.dtype(),
                recv: recv.dtype(),
            });
        }
        if send.len() != recv.len() {
            return Err(Error::BadLength {
                op: "all_reduce",
                rank: self.rank(),
                what: "receive buffer",
                expected: send.len(),
                got: recv.len(),
            });
        }
        copy_prefix(send, recv.reborrow());
        self.all_reduce(recv, op)
    }

    /// Sends block `j` of `send` to rank `j` and receives block `i` of rank `i`'s
    /// `send` into block `i` of `recv`.
    ///
    /// Default: an `all_gather` of everything (moves `n` times more than needed;
    /// backends override it).
    ///
    /// # Errors
    /// Length or dtype mismatches (the length must be a multiple of `size`), peer failures.
    #[track_caller]
    fn all_to_all(&self, send: Buf<'_>, mut recv: BufMut<'_>) -> Result<()> {
        let n = self.size();
        check_all_to_all(self.rank(), n, &send, &recv)?;
        let block = send.len() / n;
        let mut all = Buffer::zeros(send.dtype(), send.len() * n);
        self.all_gather(send, all.as_buf_mut())?;
        let me = self.rank();
        crate::dispatch_buf!(Buffer, &all, src, T => {
            let dst: &mut [T] = typed_mut(&mut recv)?;
            for j in 0..n {
                let from = j * n * block + me * block;
                dst[j * block..(j + 1) * block].copy_from_slice(&src[from..from + block]);
            }
        });
        Ok(())
    }

    /// Gathers a variable number of elements per rank: rank `q` contributes
    /// `counts[q]` elements (`send.len() == counts[rank]`) and `recv` receives the
    /// concatenation in rank order (`recv.len() == counts.iter().sum()`). Every rank
    /// passes the same `counts`, one per rank; zeros are allowed.
    ///
    /// Default: one `all_gather` of every rank's lengths and counts (so ranks that
    /// disagree all get the same error instead of garbage), then an `all_gather`
    /// with every block padded to the largest count (moves the padding; backends
    /// override it to move only the logical data).
    ///
    /// MPI: `MPI_Allgatherv`.
    ///
    /// # Errors
    /// [`Error::BadLength`] for counts that are not one per rank or buffers whose
    /// lengths do not match the counts, [`Error::Mismatch`] for ranks passing
    /// different counts, dtype mismatches, peer failures.
    #[track_caller]
    fn all_gather_v(&self, send: Buf<'_>, recv: BufMut<'_>, counts: &[usize]) -> Result<()> {
        let dtype = check_v_local(self, OpKind::AllGather, &send, &recv, counts, &[])?;
        let block = exchange_v(self, OpKind::AllGather, send.len(), recv.len(), counts, &[])?;
        let mut mine = Buffer::zeros(dtype, block);
        copy_prefix(send, mine.as_buf_mut());
        let mut all = Buffer::zeros(dtype, block * self.size());
        self.all_gather(mine.as_buf(), all.as_buf_mut())?;
        unpad(&all, counts, block, recv)
    }

    /// Reduces `send` element-wise across ranks and gives this rank its segment of
    /// the result: segment `r` has `counts[r]` elements starting at
    /// `counts[..r].iter().sum()`. `send.len() == counts.iter().sum()` and
    /// `recv.len() == counts[rank]`; every rank passes the same `counts`.
    ///
    /// Default: one `all_gather` of every rank's lengths and counts, then a
    /// `reduce_scatter` with every segment padded to the largest count.
    ///
    /// MPI: `MPI_Reduce_scatter`.
    ///
    /// # Errors
    /// As [`all_gather_v`](Self::all_gather_v), or a reduction not defined for the dtype.
    #[track_caller]
    fn reduce_scatter_v(&self, send: Buf<'_>, mut recv: BufMut<'_>, counts: &[usize], op: ReduceOp) -> Result<()> {
        let dtype = check_v_local(self, OpKind::ReduceScatter, &send, &recv, counts, &[])?;
        op.check("reduce_scatter_v", dtype)?;
        let block = exchange_v(self, OpKind::ReduceScatter, send.len(), recv.len(), counts, &[])?;
        let mut padded = Buffer::zeros(dtype, block * self.size());
        pad(send, counts, block, &mut padded)?;
        let mut mine = Buffer::zeros(dtype, block);
        self.reduce_scatter(padded.as_buf(), mine.as_buf_mut(), op)?;
        copy_prefix(mine.as_buf(), recv.reborrow());
        Ok(())
    }

    /// Sends segment `j` of `send` (`send_counts[j]` elements, segments in rank
    /// order) to rank `j`, and receives rank `i`'s segment for this rank
    /// (`recv_counts[i]` elements) into segment `i` of `recv`. The counts must be
    /// consistent: rank `i`'s `send_counts[j]` equals rank `j`'s `recv_counts[i]`.
    ///
    /// Default: one `all_gather` of every rank's lengths and counts, then an
    /// `all_to_all` with every segment padded to the largest count of any rank.
    ///
    /// MPI: `MPI_Alltoallv`.
    ///
    /// # Errors
    /// [`Error::BadLength`] for counts that are not one per rank or buffers whose
    /// lengths do not match their sums, [`Error::Mismatch`] naming both ranks when
    /// a sender's and a receiver's counts disagree, dtype mismatches, peer failures.
    #[track_caller]
    fn all_to_all_v(
        &self,
        send: Buf<'_>,
        send_counts: &[usize],
        recv: BufMut<'_>,
        recv_counts: &[usize],
    ) -> Result<()> {
        let dtype = check_v_local(self, OpKind::AllToAll, &send, &recv, send_counts, recv_counts)?;
        let block = exchange_v(self, OpKind::AllToAll, send.len(), recv.len(), send_counts, recv_counts)?;
        let n = self.size();
        let mut padded = Buffer::zeros(dtype, block * n);
        pad(send, send_counts, block, &mut padded)?;
        let mut got = Buffer::zeros(dtype, block * n);
        self.all_to_all(padded.as_buf(), got.as_buf_mut())?;
        unpad(&got, recv_counts, block, recv)
    }

    /// [`all_gather_v`](Self::all_gather_v) that writes every element where this
    /// rank wants it: `recv_runs[q]` lists runs of rank `q`'s `send` (`src`
    /// offsets in it) and where each goes in `recv` (`dst`), and together they
    /// hold all of rank `q`'s `send` (its count, as `all_gather_v`'s
    /// `counts[q]`; `recv` holds their sum, as in `all_gather_v`). A
    /// redistribution that gathers strided boxes of a tensor (the pieces of
    /// a `Shard(1)`) places them with no unpacking pass. Counted as the
    /// `all_gather_v` of those counts.
    ///
    /// Default: `all_gather_v` into a scratch buffer, then one copy per run
    /// (the threads backend copies each run straight from its peer's buffer).
    ///
    /// # Errors
    /// [`Error::BadLength`] for run lists that are not one per rank or a run
    /// past the end of `recv`; as [`all_gather_v`](Self::all_gather_v) for the
    /// counts the runs add up to.
    #[track_caller]
    fn all_gather_v_runs(&self, send: Buf<'_>, mut recv: BufMut<'_>, recv_runs: &[Vec<Run>]) -> Result<()> {
        let all: Vec<Vec<Run>> = vec![Vec::new(); self.size()];
        let (_, counts) = check_runs(
            OpKind::AllGather,
            (self.size(), self.rank()),
            &send,
            &all,
            &recv,
            recv_runs,
        )?;
        let mut got = Buffer::zeros(send.dtype(), counts.iter().sum());
        self.all_gather_v(send, got.as_buf_mut(), &counts)?;
        let starts: Vec<usize> = counts
            .iter()
            .scan(0, |at, &c| {
                *at += c;
                Some(*at - c)
            })
            .collect();
        runs::place_runs(&got.as_buf(), &mut recv, recv_runs, Some(&starts))
    }

    /// [`all_to_all_v`](Self::all_to_all_v) that reads every element where
    /// this rank holds it and writes it where its receiver wants it:
    /// `send_runs[q]` lists the runs of `send` that go to rank `q` (`src`
    /// offsets in `send`, `dst` in rank `q`'s `recv`), and `recv_runs[q]` the
    /// runs that come from rank `q` (`src` in its `send`, `dst` in `recv`):
    /// rank `q`'s `send_runs[r]` and rank `r`'s `recv_runs[q]` must be the same
    /// runs in the same order (both sides derive them from the same layouts).
    /// The receive runs' counts sum to `recv`'s length (as `all_to_all_v`'s
    /// `recv_counts`); the send runs may leave parts of `send` unsent. A
    /// redistribution between strided boxes of a tensor moves them with no
    /// packing or unpacking pass. Counted as the `all_to_all_v` of the runs'
    /// element counts.
    ///
    /// Default: packs the send runs, `all_to_all_v`, then one copy per receive
    /// run (the threads backend copies each run straight from its peer's
    /// buffer and reads no send runs).
    ///
    /// # Errors
    /// [`Error::BadLength`] for run lists that are not one per rank or a run
    /// past the end of its buffer; as [`all_to_all_v`](Self::all_to_all_v) for
    /// the counts the runs add up to.
    #[track_caller]
    fn all_to_all_v_runs(
        &self,
        send: Buf<'_>,
        send_runs: &[Vec<Run>],
        mut recv: BufMut<'_>,
        recv_runs: &[Vec<Run>],
    ) -> Result<()> {
        let (send_counts, recv_counts) = check_runs(
            OpKind::AllToAll,
            (self.size(), self.rank()),
            &send,
            send_runs,
            &recv,
            recv_runs,
        )?;
        let packed = runs::pack_runs(&send, send_runs);
        let mut got = Buffer::zeros(send.dtype(), recv_counts.iter().sum());
        self.all_to_all_v(packed.as_buf(), &send_counts, got.as_buf_mut(), &recv_counts)?;
        runs::place_runs(&got.as_buf(), &mut recv, recv_runs, None)
    }

    /// [`reduce_scatter_v`](Self::reduce_scatter_v) whose blocks are lists of
    /// runs: every rank's `send` has one layout, `runs[q]` lists the runs of
    /// rank `q`'s block (`src` offsets in every rank's `send`, `dst` in rank
    /// `q`'s `recv`), and this rank's `recv` gets, at each run's `dst`, the
    /// reduction over ranks (in rank order) of that run of every `send`. The
    /// runs of all blocks hold all of `send` and this rank's fill its `recv`
    /// (their counts are `reduce_scatter_v`'s). A redistribution from
    /// `Partial` to a shard of an inner dim reduces strided boxes in place,
    /// with no packing pass. Counted as the `reduce_scatter_v` of those counts.
    ///
    /// Default: packs `send` block by block, `reduce_scatter_v`, then one copy
    /// per run of this rank's block (the threads backend reduces each run
    /// straight from its peers' buffers).
    ///
    /// # Errors
    /// [`Error::BadLength`] for run lists that are not one per rank or a run
    /// past the end of its buffer; as [`reduce_scatter_v`](Self::reduce_scatter_v)
    /// for the counts the runs add up to and the reduction.
    #[track_caller]
    fn reduce_scatter_v_runs(
        &self,
        send: Buf<'_>,
        mut recv: BufMut<'_>,
        runs: &[Vec<Run>],
        op: ReduceOp,
    ) -> Result<()> {
        let (n, r) = (self.size(), self.rank());
        let mine = runs::own_runs(runs, r, n);
        let (counts, _) = check_runs(OpKind::ReduceScatter, (n, r), &send, runs, &recv, &mine)?;
        let packed = runs::pack_runs(&send, runs);
        let mut got = Buffer::zeros(send.dtype(), counts.get(r).copied().unwrap_or(0));
        self.reduce_scatter_v(packed.as_buf(), got.as_buf_mut(), &counts, op)?;
        runs::place_runs(&got.as_buf(), &mut recv, &mine, None)
    }

    /// [`all_gather`](Self::all_gather) with the output grouped by segment: this
    /// rank's view of every block as consecutive segments of `segments[i]`
    /// elements (summing to `send.len()`), and `recv` holding segment 0 of every
    /// rank in rank order, then segment 1 of every rank, and so on. With one
    /// segment it is `all_gather`. The segments only lay out this rank's output
    /// (the collective itself is an `all_gather`, counted as one): a bucket of
    /// tensors gathered this way holds each tensor's pieces side by side, so the
    /// gathered tensors are views of `recv`, with no copy out.
    ///
    /// PyTorch: FSDP2's all-gather followed by its copy-out
    /// (`split_with_sizes_copy`), in one step.
    ///
    /// Default: `all_gather` into a scratch buffer, then one copy into segment
    /// order (backends override it to write each segment in place).
    ///
    /// # Errors
    /// [`Error::BadLength`] when the segments do not sum to `send.len()` or
    /// `recv` does not hold `size · send.len()`; as [`all_gather`](Self::all_gather).
    #[track_caller]
    fn all_gather_segmented(&self, send: Buf<'_>, mut recv: BufMut<'_>, segments: &[usize]) -> Result<()> {
        check_segments(self, (send.dtype(), send.len()), (recv.dtype(), recv.len()), segments)?;
        let mut rank_major = Buffer::zeros(send.dtype(), recv.len());
        self.all_gather(send, rank_major.as_buf_mut())?;
        segment_major(&rank_major.as_buf(), &mut recv, segments, self.size())
    }

    /// Asynchronous [`all_gather_segmented`](Self::all_gather_segmented): returns
    /// the gathered buffer in segment order.
    ///
    /// Default: runs the blocking form and returns a finished handle.
    #[track_caller]
    fn all_gather_segmented_async(&self, send: Buffer, segments: Vec<usize>) -> Work {
        let mut recv = Buffer::zeros(send.dtype(), send.len() * self.size());
        Work::ready(
            self.all_gather_segmented(send.as_buf(), recv.as_buf_mut(), &segments)
                .map(|_| recv),
        )
    }

    /// Asynchronous [`all_gather`](Self::all_gather): returns the gathered buffer.
    ///
    /// Default: runs the blocking form and returns a finished handle.
    #[track_caller]
    fn all_gather_async(&self, send: Buffer) -> Work {
        let mut recv = Buffer::zeros(send.dtype(), send.len() * self.size());
        Work::ready(self.all_gather(send.as_buf(), recv.as_buf_mut()).map(|_| recv))
    }

    /// Asynchronous [`reduce_scatter`](Self::reduce_scatter): returns this rank's block.
    ///
    /// Default: runs the blocking form and returns a finished handle.
    #[track_caller]
    fn reduce_scatter_async(&self, send: Buffer, op: ReduceOp) -> Work {
        let mut recv = Buffer::zeros(send.dtype(), send.len() / self.size().max(1));
        Work::ready(self.reduce_scatter(send.as_buf(), recv.as_buf_mut(), op).map(|_| recv))
    }

    /// [`all_gather_segmented_async`](Self::all_gather_segmented_async) of a
    /// send buffer given as [`Pieces`]: the same collective, the same result,
    /// counted the same. A backend that reads its peers' memory (threads) reads
    /// the pieces where they are.
    ///
    /// Default: packs the pieces into one buffer first.
    #[track_caller]
    fn all_gather_segmented_pieces_async(&self, send: Pieces, segments: Vec<usize>) -> Work {
        self.all_gather_segmented_async(send.pack(), segments)
    }

    /// [`reduce_scatter_async`](Self::reduce_scatter_async) of a send buffer
    /// given as [`Pieces`]: the same collective, the same result (bit for bit),
    /// counted the same. A backend that reads its peers' memory (threads) reads
    /// the pieces where they are.
    ///
    /// Default: packs the pieces into one buffer first.
    #[track_caller]
    fn reduce_scatter_pieces_async(&self, send: Pieces, op: ReduceOp) -> Work {
        self.reduce_scatter_async(send.pack(), op)
    }

    /// Asynchronous in-place [`all_reduce`](Self::all_reduce): returns the reduced buffer.
    ///
    /// Default: runs the blocking form and returns a finished handle.
    #[track_caller]
    fn all_reduce_async(&self, mut buf: Buffer, op: ReduceOp) -> Work {
        Work::ready(self.all_reduce(buf.as_buf_mut(), op).map(|_| buf))
    }

    /// Asynchronous [`all_to_all`](Self::all_to_all).
    ///
    /// Default: runs the blocking form and returns a finished handle.
    #[track_caller]
    fn all_to_all_async(&self, send: Buffer) -> Work {
        let mut recv = Buffer::zeros(send.dtype(), send.len());
        Work::ready(self.all_to_all(send.as_buf(), recv.as_buf_mut()).map(|_| recv))
    }

    /// Asynchronous [`broadcast`](Self::broadcast): returns root's buffer.
    ///
    /// Default: runs the blocking form and returns a finished handle.
    #[track_caller]
    fn broadcast_async(&self, mut buf: Buffer, root: usize) -> Work {
        Work::ready(self.broadcast(buf.as_buf_mut(), root).map(|_| buf))
    }
}

/// Typed conveniences over any [`Communicator`] (blanket-implemented).
pub trait CommunicatorExt: Communicator {
    /// `all_gather` of typed slices.
    ///
    /// # Errors
    /// As [`Communicator::all_gather`].
    #[track_caller]
    fn all_gather_slice<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        self.all_gather(T::buf(send), T::buf_mut(recv))
    }

    /// `all_gather` returning a new vector of `size · send.len()` elements.
    ///
    /// # Errors
    /// As [`Communicator::all_gather`].
    #[track_caller]
    fn all_gather_vec<T: Element>(&self, send: &[T]) -> Result<Vec<T>> {
        let mut recv = vec![T::default(); send.len() * self.size()];
        self.all_gather(T::buf(send), T::buf_mut(&mut recv))?;
        Ok(recv)
    }

    /// `reduce_scatter` of typed slices.
    ///
    /// # Errors
    /// As [`Communicator::reduce_scatter`].
    #[track_caller]
    fn reduce_scatter_slice<T: Element>(&self, send: &[T], recv: &mut [T], op: ReduceOp) -> Result<()> {
        self.reduce_scatter(T::buf(send), T::buf_mut(recv), op)
    }

    /// In-place `all_reduce` of a typed slice.
    ///
    /// # Errors
    /// As [`Communicator::all_reduce`].
    #[track_caller]
    fn all_reduce_slice<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.all_reduce(T::buf_mut(buf), op)
    }

    /// `broadcast` of a typed slice.
    ///
    /// # Errors
    /// As [`Communicator::broadcast`].
    #[track_caller]
    fn broadcast_slice<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.broadcast(T::buf_mut(buf), root)
    }

    /// `all_to_all` of typed slices.
    ///
    /// # Errors
    /// As [`Communicator::all_to_all`].
    #[track_caller]
    fn all_to_all_slice<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        self.all_to_all(T::buf(send), T::buf_mut(recv))
    }
}

impl<C: Communicator + ?Sized> CommunicatorExt for C {}

/// Copies `min(src.len(), dst.len())` leading elements; dtypes must match.
/// The size of a buffer in bytes (what the statistics count).
pub(crate) fn nbytes(b: &Buf<'_>) -> usize {
    b.len() * b.dtype().size_in_bytes()
}

fn copy_prefix(src: Buf<'_>, mut dst: BufMut<'_>) {
    crate::dispatch_buf!(Buf, src, s, T => {
        if let Ok(d) = typed_mut::<T>(&mut dst) {
            let k = s.len().min(d.len());
            d[..k].copy_from_slice(&s[..k]);
        }
    })
}

/// Views an output buffer as `&mut [T]`, or fails if its dtype is not `T`.
pub(crate) fn typed_mut<'a, T: Element>(b: &'a mut BufMut<'_>) -> Result<&'a mut [T]> {
    let dtype = b.dtype();
    let bytes: &mut [u8] = crate::dispatch_buf!(BufMut, b, s, _T => bytemuck::cast_slice_mut(&mut s[..]));
    if dtype != T::DTYPE {
        return Err(Error::DTypeMismatch {
            op: "buffer",
            send: T::DTYPE,
            recv: dtype,
        });
    }
    Ok(bytemuck::cast_slice_mut(bytes))
}

/// Local argument checks shared by backends' `all_to_all`.
pub(crate) fn check_all_to_all(rank: usize, n: usize, send: &Buf<'_>, recv: &BufMut<'_>) -> Result<()> {
    if send.dtype() != recv.dtype() {
        return Err(Error::DTypeMismatch {
            op: "all_to_all",
            send: send.dtype(),
            recv: recv.dtype(),
        });
    }
    if !send.len().is_multiple_of(n) {
        return Err(Error::BadLength {
            op: "all_to_all",
            rank,
            what: "send buffer",
            expected: send.len().div_ceil(n) * n,
            got: send.len(),
        });
    }
    if recv.len() != send.len() {
        return Err(Error::BadLength {
            op: "all_to_all",
            rank,
            what: "receive buffer",
            expected: send.len(),
            got: recv.len(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DType;

    fn _object_safe(_: &dyn Communicator) {}

    #[test]
    fn reduce_op_checks() {
        assert!(ReduceOp::Avg.check("x", DType::I64).is_err());
        assert!(ReduceOp::Sum.check("x", DType::I64).is_ok());
        assert!(ReduceOp::Sum.check("x", DType::U8).is_err());
        assert!(ReduceOp::Avg.check("x", DType::BF16).is_ok());
        let msg = ReduceOp::Avg.check("all_reduce", DType::I64).unwrap_err().to_string();
        assert!(
            msg.contains("avg") && msg.contains("i64") && msg.contains("Sum"),
            "{msg}"
        );
    }
}
