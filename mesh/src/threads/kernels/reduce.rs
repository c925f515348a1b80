//! Reductions over the ranks' inputs: [`Reduce`] (how each dtype accumulates)
//! and the cache-blocked loops that combine every rank's elements, in rank order,
//! into this rank's output.

use half::{bf16, f16};
#[cfg(target_arch = "x86_64")]
use smallvec::SmallVec;

use super::access::{peer, run_at, write};
use crate::threads::desc::Desc;
use crate::threads::store::Store;
use crate::{Element, ReduceOp};

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

/// Zeros for the runs of zeros of [`Pieces`](crate::Pieces): `BLOCK` elements of any dtype
/// (all-zero bits are every dtype's zero).
static ZEROS: [u64; BLOCK] = [0; BLOCK];

/// `n <= BLOCK` zeros of `T`.
fn zeros<T: Element>(n: usize) -> &'static [T] {
    &bytemuck::cast_slice::<u64, T>(&ZEROS)[..n]
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

/// [`reduce_blocks`] for send buffers some of which are [`Pieces`](crate::Pieces): elements
/// `[from, from + len)` of every rank's send combined into the fresh output
/// `out[..len]`, in chunks that never cross a run boundary of any rank (so each
/// rank's part of a chunk is one slice, or zeros), ranks in rank order.
///
/// # Safety
/// As [`reduce_blocks`]; `out` is a fresh output that no input aliases, and
/// every descriptor as in [`run_at`].
pub(super) unsafe fn reduce_runs<T: Reduce>(
    store: Store,
    descs: &[Desc],
    from: usize,
    len: usize,
    op: ReduceOp,
    out: *mut T,
) {
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
pub(super) unsafe fn reduce_blocks<T: Reduce>(
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
/// ([`stream_sum_f32`](crate::threads::store::stream_sum_f32), the same bits); every
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
            unsafe { crate::threads::store::stream_sum_f32(&parts, out.add(at + start).cast(), b, avg) };
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
