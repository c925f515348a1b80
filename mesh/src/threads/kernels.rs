//! The collectives of the threads backend, over shared memory.
//!
//! Protocol: every rank publishes a descriptor naming its buffers ([`Group::enter`],
//! which also checks that the calls agree), then reads its peers' published inputs
//! and writes only its own output, then waits at a barrier point before returning,
//! so no peer still reads a buffer its owner is about to release. Past the entry
//! barrier a rank is [`Committed`](super::group::Committed): it leaves only through
//! the collective's barrier points, which wait for every rank whatever happens
//! elsewhere (a peer's failure, the timeout, this rank unwinding).
//!
//! Each rank's own output is written through a raw pointer taken once from its
//! `&mut` buffer, and peers only ever read through raw pointers they were given
//! (regions nobody writes during that phase), so no two accesses race.

use half::{bf16, f16};
#[cfg(target_arch = "x86_64")]
use smallvec::SmallVec;

use super::desc::Desc;
use super::group::Group;
use super::store::Store;
use crate::dtype::Filling;
use crate::{Buf, BufMut, Buffer, DType, Element, OpKind, Pieces, ReduceOp, Result};

/// Elements reduced per block: a block of every peer's input and the accumulator
/// stay in L1/L2 while they are combined.
const BLOCK: usize = 2048;

/// How an element type is reduced: accumulate in `Acc` (f32 for 16-bit floats,
/// so a sum over ranks rounds once), then convert back.
pub(crate) trait Reduce: Element {
    type Acc: Copy + Default;
    fn to_acc(self) -> Self::Acc;
    fn from_acc(a: Self::Acc) -> Self;
    /// `acc[i] = op(acc[i], x[i])`.
    fn combine(op: ReduceOp, acc: &mut [Self::Acc], x: &[Self]);
    /// `acc[i] /= n` (Avg; only called for floats).
    fn divide(acc: &mut [Self::Acc], n: usize);
    /// `out` itself as the accumulator, for types that accumulate in
    /// themselves (then a reduction runs in its output, with no accumulator
    /// copy); `None` for 16-bit floats.
    fn as_acc(out: &mut [Self]) -> Option<&mut [Self::Acc]>;
}

macro_rules! reduce_float {
    ($t:ty, $acc:ty, $to:expr, $from:expr, $as_acc:expr) => {
        impl Reduce for $t {
            type Acc = $acc;
            #[inline]
            fn to_acc(self) -> $acc {
                $to(self)
            }
            #[inline]
            fn from_acc(a: $acc) -> $t {
                $from(a)
            }
            fn combine(op: ReduceOp, acc: &mut [$acc], x: &[$t]) {
                let it = acc.iter_mut().zip(x.iter().map(|&v| $to(v)));
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => it.for_each(|(a, v)| *a += v),
                    ReduceOp::Max => it.for_each(|(a, v)| *a = if v > *a || v.is_nan() { v } else { *a }),
                    ReduceOp::Min => it.for_each(|(a, v)| *a = if v < *a || v.is_nan() { v } else { *a }),
                    ReduceOp::Product => it.for_each(|(a, v)| *a *= v),
                }
            }
            fn divide(acc: &mut [$acc], n: usize) {
                let n = n as $acc;
                acc.iter_mut().for_each(|a| *a /= n);
            }
            fn as_acc(out: &mut [$t]) -> Option<&mut [$acc]> {
                $as_acc(out)
            }
        }
    };
}
reduce_float!(f32, f32, |v| v, |a| a, Some);
reduce_float!(f64, f64, |v| v, |a| a, Some);
reduce_float!(bf16, f32, bf16::to_f32, bf16::from_f32, |_| None);
reduce_float!(f16, f32, f16::to_f32, f16::from_f32, |_| None);

macro_rules! reduce_int {
    ($t:ty) => {
        impl Reduce for $t {
            type Acc = $t;
            #[inline]
            fn to_acc(self) -> $t {
                self
            }
            #[inline]
            fn from_acc(a: $t) -> $t {
                a
            }
            fn combine(op: ReduceOp, acc: &mut [$t], x: &[$t]) {
                let it = acc.iter_mut().zip(x.iter().copied());
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => it.for_each(|(a, v)| *a = a.wrapping_add(v)),
                    ReduceOp::Max => it.for_each(|(a, v)| *a = (*a).max(v)),
                    ReduceOp::Min => it.for_each(|(a, v)| *a = (*a).min(v)),
                    ReduceOp::Product => it.for_each(|(a, v)| *a = a.wrapping_mul(v)),
                }
            }
            fn divide(acc: &mut [$t], n: usize) {
                acc.iter_mut().for_each(|a| *a /= n as $t);
            }
            fn as_acc(out: &mut [$t]) -> Option<&mut [$t]> {
                Some(out)
            }
        }
    };
}
reduce_int!(i64);
// Bytes are never reduced (validation rejects it); this impl only lets one generic
// dispatch cover every dtype.
reduce_int!(u8);

/// Peer `q`'s buffer at `ptr` as a slice.
///
/// # Safety
/// `ptr`/`len` must come from a descriptor published in the current collective,
/// whose owner stays inside the collective (and does not write this region) until
/// the next barrier point.
unsafe fn peer<'a, T>(ptr: usize, len: usize) -> &'a [T] {
    if len == 0 {
        return &[];
    }
    // SAFETY: the caller guarantees the region is live, initialised, aligned for T
    // (it came from a `&[T]`) and not written concurrently.
    unsafe { std::slice::from_raw_parts(ptr as *const T, len) }
}

/// Writes `src` into this rank's own output at element offset `at` with `store`.
///
/// # Safety
/// `out` is this rank's output pointer (from its `&mut [T]`), `at + src.len()` is
/// within it, and no peer reads that region during this phase.
unsafe fn write<T: Copy>(store: Store, out: *mut T, at: usize, src: &[T]) {
    // SAFETY: per the caller's contract the destination is in bounds and exclusively ours;
    // the source belongs to another buffer, so they do not overlap.
    unsafe { store.copy(out.add(at), src) }
}

/// A rank's send buffer: one flat buffer, or [`Pieces`] that peers read in place.
#[derive(Clone, Copy)]
pub(crate) enum Source<'a> {
    Flat(Buf<'a>),
    Pieces(&'a Pieces),
}

/// The descriptor of a collective sending `send`; for [`Pieces`], `table` receives
/// its run table (`(address, elements)`, address 0 for zeros), which the
/// descriptor names and the caller keeps alive until the collective's last barrier.
fn source_desc(kind: OpKind, send: Source<'_>, table: &mut Vec<(usize, usize)>) -> Desc {
    match send {
        Source::Flat(b) => send_desc(kind, &b),
        Source::Pieces(p) => {
            let mut d = Desc::new(kind);
            d.dtype = p.dtype();
            d.recv_dtype = p.dtype();
            d.send_len = p.len();
            // Held pieces are never empty (`Pieces::push` drops those), so their
            // addresses are never 0.
            table.extend(
                p.runs()
                    .map(|(b, n)| (b.map_or(0, |b| b.as_bytes().as_ptr() as usize), n)),
            );
            d.runs = (table.as_ptr() as usize, table.len());
            d
        }
    }
}

/// The run of peer `dq`'s send buffer that holds element `pos` (`pos <
/// send_len`): the address of that element (0 inside a run of zeros) and the
/// elements left in the run from it. A flat buffer is one run.
///
/// # Safety
/// `dq` was published in the current collective (its run table, if any, is alive).
unsafe fn run_at(dq: &Desc, size: usize, pos: usize) -> (usize, usize) {
    if dq.runs.0 == 0 {
        return (dq.send_ptr + pos * size, dq.send_len - pos);
    }
    // SAFETY: the table was published with this descriptor and outlives the collective.
    let table = unsafe { std::slice::from_raw_parts(dq.runs.0 as *const (usize, usize), dq.runs.1) };
    let mut start = 0;
    for &(addr, n) in table {
        if pos < start + n {
            let off = pos - start;
            return (if addr == 0 { 0 } else { addr + off * size }, n - off);
        }
        start += n;
    }
    // INVARIANT: the runs add up to `send_len` (both come from one `Pieces`), and
    // callers only ask for `pos < send_len` (validated against every peer).
    unreachable!("element {pos} past a run table of {start} elements")
}

/// Zeros for the runs of zeros of [`Pieces`]: `BLOCK` elements of any dtype
/// (all-zero bits are every dtype's zero).
static ZEROS: [u64; BLOCK] = [0; BLOCK];

/// `n <= BLOCK` zeros of `T`.
fn zeros<T: Element>(n: usize) -> &'static [T] {
    &bytemuck::cast_slice::<u64, T>(&ZEROS)[..n]
}

/// Copies elements `[from, from + len)` of peer `dq`'s send buffer (flat or
/// runs) to `out[at..at + len]` with `store`.
///
/// # Safety
/// As [`write`] for the destination; `dq` as in [`run_at`], with `from + len <=
/// send_len`.
unsafe fn copy_runs<T: Element>(store: Store, dq: &Desc, from: usize, len: usize, out: *mut T, at: usize) {
    let size = size_of::<T>();
    let mut done = 0;
    while done < len {
        // SAFETY: per this function's contract.
        let (addr, left) = unsafe { run_at(dq, size, from + done) };
        let n = left.min(len - done);
        if addr == 0 {
            // SAFETY: in bounds and ours (the contract); all-zero bits are T's zero.
            unsafe { std::ptr::write_bytes(out.add(at + done), 0, n) };
        } else {
            // SAFETY: the run holds `left >= n` elements from `addr`.
            unsafe { write(store, out, at + done, peer::<T>(addr, n)) };
        }
        done += n;
    }
}

fn send_desc(kind: OpKind, send: &Buf<'_>) -> Desc {
    let mut d = Desc::new(kind);
    d.dtype = send.dtype();
    d.recv_dtype = send.dtype();
    d.send_len = send.len();
    d.send_ptr = send.as_bytes().as_ptr() as usize;
    d
}

fn recv_parts(recv: &mut BufMut<'_>) -> (usize, usize) {
    crate::dispatch_buf!(BufMut, recv, s, _T => (s.as_mut_ptr() as usize, s.len()))
}

/// Where a collective writes this rank's output: the first element's address,
/// the length and the dtype, taken from a borrowed [`BufMut`] (blocking forms)
/// or from a [`Filling`] (asynchronous forms, whose output is not zeroed first:
/// these kernels write every element of it before they return `Ok`).
#[derive(Clone, Copy)]
pub(crate) struct Out {
    addr: usize,
    len: usize,
    dtype: DType,
}

impl Out {
    /// The output `recv` (which must outlive the collective).
    pub(crate) fn of(recv: &mut BufMut<'_>) -> Out {
        let (addr, len) = recv_parts(recv);
        Out {
            addr,
            len,
            dtype: recv.dtype(),
        }
    }

    /// The output `recv` (which must outlive the collective).
    pub(crate) fn filling(recv: &mut Filling) -> Out {
        Out {
            addr: recv.addr(),
            len: recv.len(),
            dtype: recv.dtype(),
        }
    }

    fn publish(self, d: &mut Desc) {
        (d.recv_ptr, d.recv_len, d.recv_dtype) = (self.addr, self.len, self.dtype);
    }
}

pub(crate) fn all_gather(g: &Group, r: usize, send: Buf<'_>, recv: Out) -> Result<()> {
    let mut d = send_desc(OpKind::AllGather, &send);
    recv.publish(&mut d);
    let (descs, done) = g.enter(r, d)?;
    let store = Store::of(&descs);
    let c = d.send_len;
    crate::dispatch_buf!(Buf, send, _s, T => {
        let out = d.recv_ptr as *mut T;
        for (q, dq) in descs.iter().enumerate() {
            // SAFETY: every descriptor was published in this collective and validated
            // (same length and dtype); peers hold their send buffers until the barrier
            // below, and block q of our output is ours alone.
            unsafe { write(store, out, q * c, peer::<T>(dq.send_ptr, c)) };
        }
    });
    done.finish()
}

/// [`all_gather`] writing each peer's segments straight into segment order (the
/// segments, checked by the caller to tile the send buffer, lay out only our
/// output), reading each peer's send buffer in place whether flat or [`Pieces`].
pub(crate) fn all_gather_segmented(g: &Group, r: usize, send: Source<'_>, recv: Out, segments: &[usize]) -> Result<()> {
    let mut table = Vec::new();
    let mut d = source_desc(OpKind::AllGather, send, &mut table);
    recv.publish(&mut d);
    let (descs, done) = g.enter(r, d)?;
    let store = Store::of(&descs);
    let probe = Buffer::zeros(d.dtype, 0);
    crate::dispatch_buf!(Buf, probe.as_buf(), _s, T => {
        let out = d.recv_ptr as *mut T;
        for (q, piece, at) in crate::comm::segment_copies(segments, descs.len()) {
            // SAFETY: as in `all_gather` (validation checked that every peer sends
            // `send_len` elements and that our output holds `n · send_len`); the
            // segments tile `send_len`, so `piece` is within every peer's buffer and
            // the writes, `n · send_len` in all, stay in our output.
            unsafe { copy_runs::<T>(store, &descs[q], piece.start, piece.len(), out, at) };
        }
    });
    // The run table (if any) stays alive until every peer is past the barrier.
    let result = done.finish();
    drop(table);
    result
}

pub(crate) fn reduce_scatter(g: &Group, r: usize, send: Source<'_>, recv: Out, op: ReduceOp) -> Result<()> {
    let mut table = Vec::new();
    let mut d = source_desc(OpKind::ReduceScatter, send, &mut table);
    recv.publish(&mut d);
    d.reduce = Some(op);
    let (descs, done) = g.enter(r, d)?;
    let store = Store::of(&descs);
    let c = d.recv_len;
    let probe = Buffer::zeros(d.dtype, 0);
    crate::dispatch_buf!(Buf, probe.as_buf(), _s, T => {
        let out = d.recv_ptr as *mut T;
        if descs.iter().all(|dq| dq.runs.0 == 0) {
            // SAFETY: as in `all_gather`; we read block r of every peer's input and
            // write only our own output.
            unsafe { reduce_blocks::<T>(store, &descs, |dq| dq.send_ptr, r * c, c, op, out, 0) };
        } else {
            // SAFETY: as above; the run tables were published in this collective.
            unsafe { reduce_runs::<T>(store, &descs, r * c, c, op, out) };
        }
    });
    // The run table (if any) stays alive until every peer is past the barrier.
    let result = done.finish();
    drop(table);
    result
}

/// All-reduce of `send` (in place when `send` is `None`) into `buf`.
pub(crate) fn all_reduce(g: &Group, r: usize, send: Option<Buf<'_>>, mut buf: BufMut<'_>, op: ReduceOp) -> Result<()> {
    let mut d = send_desc(OpKind::AllReduce, &send.unwrap_or(buf.as_buf()));
    (d.recv_ptr, d.recv_len) = recv_parts(&mut buf);
    d.recv_dtype = buf.dtype();
    if send.is_none() {
        d.send_ptr = d.recv_ptr;
    }
    d.reduce = Some(op);
    let (descs, mut done) = g.enter(r, d)?;
    let store = Store::of(&descs);
    let n = descs.len();
    let len = d.send_len;
    let lo = |q: usize| q * len / n;
    crate::dispatch_buf!(BufMut, buf, _s, T => {
        let out = d.recv_ptr as *mut T;
        // Phase 1: reduce block [lo(r), lo(r+1)) of every rank's input into our output.
        // Peers read only their own block of our input (never written when out of
        // place; when in place, block r is read only by us), so the regions are disjoint.
        // SAFETY: see the module docs; block r of every input is read only by us in
        // this phase and block r of our output is written only by us.
        unsafe { reduce_blocks::<T>(store, &descs, |dq| dq.send_ptr, lo(r), lo(r + 1) - lo(r), op, out, lo(r)) };
        done.sync();
        // Phase 2: copy every other rank's finished block from its output.
        for (q, dq) in descs.iter().enumerate().filter(|&(q, _)| q != r) {
            // SAFETY: block q of peer q's output is final after the barrier and nobody
            // writes it in this phase; block q of our output is written only by us.
            unsafe { write(store, out, lo(q), peer::<T>(dq.recv_ptr + lo(q) * size_of::<T>(), lo(q + 1) - lo(q))) };
        }
    });
    done.finish()
}

pub(crate) fn all_to_all(g: &Group, r: usize, send: Buf<'_>, recv: Out) -> Result<()> {
    let mut d = send_desc(OpKind::AllToAll, &send);
    recv.publish(&mut d);
    let (descs, done) = g.enter(r, d)?;
    let store = Store::of(&descs);
    let c = d.send_len / descs.len();
    crate::dispatch_buf!(Buf, send, _s, T => {
        let out = d.recv_ptr as *mut T;
        for (q, dq) in descs.iter().enumerate() {
            // SAFETY: as in `all_gather`; block r of peer q's input goes to our block q.
            unsafe { write(store, out, q * c, peer::<T>(dq.send_ptr + r * c * size_of::<T>(), c)) };
        }
    });
    done.finish()
}

pub(crate) fn all_gather_v(g: &Group, r: usize, send: Buf<'_>, mut recv: BufMut<'_>, counts: &[usize]) -> Result<()> {
    let mut d = send_desc(OpKind::AllGather, &send);
    Out::of(&mut recv).publish(&mut d);
    d.v = true;
    let (descs, _, done) = g.enter_v(r, d, counts, &[])?;
    let store = Store::of(&descs);
    crate::dispatch_buf!(Buf, send, _s, T => {
        let out = d.recv_ptr as *mut T;
        let mut at = 0;
        for dq in &descs {
            // SAFETY: as in `all_gather`; validation checked that every rank passed the
            // same counts, that rank q sends counts[q] elements and that our output
            // holds their sum, so segment q of our output is in bounds and ours alone.
            unsafe { write(store, out, at, peer::<T>(dq.send_ptr, dq.send_len)) };
            at += dq.send_len;
        }
    });
    done.finish()
}

pub(crate) fn reduce_scatter_v(
    g: &Group,
    r: usize,
    send: Buf<'_>,
    mut recv: BufMut<'_>,
    counts: &[usize],
    op: ReduceOp,
) -> Result<()> {
    let mut d = send_desc(OpKind::ReduceScatter, &send);
    Out::of(&mut recv).publish(&mut d);
    d.reduce = Some(op);
    d.v = true;
    let (descs, _, done) = g.enter_v(r, d, counts, &[])?;
    let store = Store::of(&descs);
    let from: usize = counts[..r].iter().sum();
    crate::dispatch_buf!(Buf, send, _s, T => {
        // SAFETY: validation checked that every rank passed the same counts and sends
        // their sum, so segment r ([from, from + counts[r])) is within every rank's
        // input; our output holds counts[r] elements and is ours alone.
        unsafe { reduce_blocks::<T>(store, &descs, |dq| dq.send_ptr, from, counts[r], op, d.recv_ptr as *mut T, 0) };
    });
    done.finish()
}

pub(crate) fn all_to_all_v(
    g: &Group,
    r: usize,
    send: Buf<'_>,
    send_counts: &[usize],
    mut recv: BufMut<'_>,
    recv_counts: &[usize],
) -> Result<()> {
    let mut d = send_desc(OpKind::AllToAll, &send);
    Out::of(&mut recv).publish(&mut d);
    d.v = true;
    let (descs, counts, done) = g.enter_v(r, d, send_counts, recv_counts)?;
    let store = Store::of(&descs);
    crate::dispatch_buf!(Buf, send, _s, T => {
        let out = d.recv_ptr as *mut T;
        let mut at = 0;
        for (dq, cq) in descs.iter().zip(&counts) {
            // Our segment of peer q's input starts after its segments for ranks < r.
            let from: usize = cq.send[..r].iter().sum();
            let len = cq.send[r];
            // SAFETY: as in `all_gather`; validation checked that peer q's input holds
            // the sum of its send_counts and that cq.send[r] equals our recv_counts[q],
            // so the read is within its input and segment q of our output (whose
            // length is the sum of our recv_counts) is in bounds and ours alone.
            unsafe { write(store, out, at, peer::<T>(dq.send_ptr + from * size_of::<T>(), len)) };
            at += len;
        }
    });
    done.finish()
}

pub(crate) fn broadcast(g: &Group, r: usize, mut buf: BufMut<'_>, root: usize) -> Result<()> {
    let mut d = send_desc(OpKind::Broadcast, &buf.as_buf());
    (d.recv_ptr, d.recv_len) = recv_parts(&mut buf);
    d.send_ptr = d.recv_ptr;
    d.root = root;
    let (descs, done) = g.enter(r, d)?;
    if r != root {
        crate::dispatch_buf!(BufMut, buf, _s, T => {
            // SAFETY: the root only reads its buffer during a broadcast; ours is ours.
            // Through the cache: every rank reads the root's one buffer, which stays
            // cached (`Store::of` would count each rank's buffer twice).
            unsafe { write(Store::Cached, d.recv_ptr as *mut T, 0, peer::<T>(descs[root].send_ptr, d.send_len)) };
        });
    }
    done.finish()
}

pub(crate) fn barrier(g: &Group, r: usize) -> Result<()> {
    g.enter(r, Desc::new(OpKind::Barrier))?.1.finish()
}

/// `acc = op(x₀, x₁, …)` element-wise over the ranks' slices `x_q = src(desc q)`,
/// combined in rank order (divided by the number of ranks for `Avg`).
fn combine_ranks<'a, T: Reduce + 'a>(acc: &mut [T::Acc], descs: &[Desc], op: ReduceOp, src: impl Fn(&Desc) -> &'a [T]) {
    for (a, &x) in acc.iter_mut().zip(src(&descs[0])) {
        *a = x.to_acc();
    }
    for dq in &descs[1..] {
        T::combine(op, acc, src(dq));
    }
    if op == ReduceOp::Avg {
        T::divide(acc, descs.len());
    }
}

/// [`reduce_blocks`] for send buffers some of which are [`Pieces`]: elements
/// `[from, from + len)` of every rank's send combined into the fresh output
/// `out[..len]`, in chunks that never cross a run boundary of any rank (so each
/// rank's part of a chunk is one slice, or zeros), ranks in rank order.
///
/// # Safety
/// As [`reduce_blocks`]; `out` is a fresh output that no input aliases, and
/// every descriptor as in [`run_at`].
unsafe fn reduce_runs<T: Reduce>(store: Store, descs: &[Desc], from: usize, len: usize, op: ReduceOp, out: *mut T) {
    let size = size_of::<T>();
    // The chunk at `start` stops at the next run boundary of any rank.
    let chunk = |start: usize| {
        descs.iter().fold(BLOCK.min(len - start), |b, dq| {
            // SAFETY: per this function's contract (`from + start < send_len`).
            b.min(unsafe { run_at(dq, size, from + start) }.1)
        })
    };
    let src = |dq: &Desc, start: usize, b: usize| -> &[T] {
        // SAFETY: per this function's contract; the chunk lies within this run.
        match unsafe { run_at(dq, size, from + start) }.0 {
            0 => zeros::<T>(b),
            // SAFETY: as above.
            addr => unsafe { peer::<T>(addr, b) },
        }
    };
    // SAFETY: per this function's contract; no input aliases the fresh output.
    unsafe { reduce_chunks(store, descs, op, out, 0, len, true, chunk, src) }
}

/// Reduces `len` elements starting at element `from` of every rank's buffer
/// (`ptr_of` picks which published pointer) with `op`, writing to `out[at..]`
/// (with `store` where [`reduce_chunks`] can), one cache-sized block at a time,
/// ranks combined in rank order.
///
/// # Safety
/// The regions read are live and not written during this phase; `out[at..at+len]`
/// is this rank's own and read by nobody else during this phase.
#[allow(clippy::too_many_arguments)]
unsafe fn reduce_blocks<T: Reduce>(
    store: Store,
    descs: &[Desc],
    ptr_of: impl Fn(&Desc) -> usize,
    from: usize,
    len: usize,
    op: ReduceOp,
    out: *mut T,
    at: usize,
) {
    let src = |dq: &Desc, start: usize, b: usize| {
        // SAFETY: per this function's contract.
        unsafe { peer::<T>(ptr_of(dq) + (from + start) * size_of::<T>(), b) }
    };
    // The output is written while inputs are read only when no input region is
    // the output (an in-place all-reduce's own block is).
    let size = size_of::<T>();
    let (lo, hi) = (out as usize + at * size, out as usize + (at + len) * size);
    let aliased = descs.iter().any(|dq| {
        let s = ptr_of(dq) + from * size;
        s < hi && lo < s + len * size
    });
    let chunk = |start: usize| BLOCK.min(len - start);
    // SAFETY: per this function's contract; `aliased` as checked above.
    unsafe { reduce_chunks(store, descs, op, out, at, len, !aliased, chunk, src) }
}

/// The loop of [`reduce_blocks`] and [`reduce_runs`]: `out[at..at + len]` gets
/// the ranks' inputs combined in rank order, one chunk at a time, `chunk(start)`
/// elements (at most `BLOCK`) read as `src(desc, start, b)`. Types that
/// accumulate in themselves (f32, f64, integers) reduce straight in the output
/// when `direct`: each chunk is rank 0's copied in, then the others combined
/// into it while it is in cache; one pass over the output, no scratch.
/// Otherwise each chunk is reduced in scratch (in the result's own type when it
/// accumulates in itself) and then copied out.
///
/// With a streaming `store`, `f32` sums and averages read straight from the
/// inputs (`direct`) stream each chunk's result from registers
/// ([`stream_sum_f32`](super::store::stream_sum_f32), the same bits); every
/// other reduction writes through the cache whatever its size (streaming a
/// result from scratch was measured no faster than cached stores).
///
/// # Safety
/// `out[at..at + len]` is this rank's own and read by nobody else during this
/// phase; with `direct`, no input region overlaps it; every slice `src` returns
/// is live and not written during this phase.
#[allow(clippy::too_many_arguments)]
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
unsafe fn reduce_chunks<'a, T: Reduce + 'a>(
    store: Store,
    descs: &[Desc],
    op: ReduceOp,
    out: *mut T,
    at: usize,
    len: usize,
    direct: bool,
    chunk: impl Fn(usize) -> usize,
    src: impl Fn(&Desc, usize, usize) -> &'a [T],
) {
    let mut scratch: Option<([T::Acc; BLOCK], [T; BLOCK])> = None;
    #[cfg(target_arch = "x86_64")]
    let stream_f32 = store == Store::Streaming
        && direct
        && matches!(op, ReduceOp::Sum | ReduceOp::Avg)
        && std::any::TypeId::of::<T>() == std::any::TypeId::of::<f32>();
    let mut start = 0;
    while start < len {
        let b = chunk(start);
        #[cfg(target_arch = "x86_64")]
        if stream_f32 {
            // SAFETY: `T` is `f32` (checked above), so each slice is one of `f32`.
            let parts: SmallVec<[&[f32]; 8]> = descs
                .iter()
                .map(|dq| unsafe { &*(src(dq, start, b) as *const [T] as *const [f32]) })
                .collect();
            let avg = (op == ReduceOp::Avg).then_some(descs.len() as f32);
            // SAFETY: per the contract (with `direct`, no input overlaps our output).
            unsafe { super::store::stream_sum_f32(&parts, out.add(at + start).cast(), b, avg) };
            start += b;
            continue;
        }
        // SAFETY: `out[at + start..][..b]` is ours, and with `direct` no input
        // overlaps it (the contract); without, no slice of it is made.
        let dst = direct.then(|| unsafe { std::slice::from_raw_parts_mut(out.add(at + start), b) });
        if let Some(dst) = dst.and_then(T::as_acc) {
            combine_ranks(dst, descs, op, |dq| src(dq, start, b));
        } else {
            let (acc, res) = scratch.get_or_insert_with(|| ([T::Acc::default(); BLOCK], [T::default(); BLOCK]));
            if let Some(res) = T::as_acc(&mut res[..b]) {
                combine_ranks(res, descs, op, |dq| src(dq, start, b));
            } else {
                combine_ranks(&mut acc[..b], descs, op, |dq| src(dq, start, b));
                for (o, &a) in res[..b].iter_mut().zip(&acc[..b]) {
                    *o = T::from_acc(a);
                }
            }
            // SAFETY: per the contract.
            unsafe { write(Store::Cached, out, at + start, &res[..b]) };
        }
        start += b;
    }
}
