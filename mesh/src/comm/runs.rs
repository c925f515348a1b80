//! Variable-count collectives that read each element where its sender holds
//! it and write it where its receiver wants it ([`Run`] lists), so that a
//! caller whose pieces are strided boxes of a larger tensor (redistribution)
//! need not pack them into a send buffer and unpack a receive buffer.

use crate::stats::OpKind;
use crate::{Buf, BufMut, Buffer, Element, Error, Result};

use super::typed_mut;

/// One contiguous run of elements moved by [`all_gather_v_runs`] or
/// [`all_to_all_v_runs`]: `len` elements from offset `src` of the sender's
/// buffer to offset `dst` of the receiver's.
///
/// [`all_gather_v_runs`]: super::Communicator::all_gather_v_runs
/// [`all_to_all_v_runs`]: super::Communicator::all_to_all_v_runs
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Run {
    /// Offset in the sender's buffer, in elements.
    pub src: usize,
    /// Offset in the receiver's buffer, in elements.
    pub dst: usize,
    /// Elements.
    pub len: usize,
}

/// Copies each run of `runs` from offset `src` of `src` to offset `dst` of
/// `dst` on this thread, writing as the threads backend's collectives do:
/// when the two buffers together outgrow the last-level cache, with
/// streaming stores of whole lines (the lines two runs meet in assembled
/// first), else through the cache. For the local steps of a redistribution
/// (each rank's slice of a replicated tensor), which move as many bytes as a
/// collective and should cost what a `memcpy` of them costs.
///
/// ```
/// use tessera_mesh::{copy_runs, Run};
///
/// // Column 1 of a 3 × 2 row-major matrix.
/// let m = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
/// let mut col = [0.0f32; 3];
/// let runs: Vec<Run> = (0..3).map(|i| Run { src: 2 * i + 1, dst: i, len: 1 }).collect();
/// copy_runs(&m, &mut col, &runs)?;
/// assert_eq!(col, [2.0, 4.0, 6.0]);
/// # Ok::<(), tessera_mesh::Error>(())
/// ```
///
/// # Errors
/// [`Error::RunOutside`] for a run past the end of either buffer (nothing
/// is copied then).
pub fn copy_runs<T: Element>(src: &[T], dst: &mut [T], runs: &[Run]) -> Result<()> {
    const OP: &str = "copy_runs";
    for r in runs {
        for (what, at, len) in [("source", r.src, src.len()), ("destination", r.dst, dst.len())] {
            let end = at.saturating_add(r.len);
            if end > len {
                return Err(Error::RunOutside { op: OP, what, end, len });
            }
        }
    }
    let bytes = std::mem::size_of_val(src) + std::mem::size_of_val(dst);
    let store = crate::threads::Store::for_bytes(bytes, crate::threads::last_level_cache_bytes());
    // SAFETY: every run lies inside both buffers (checked above), `dst` is
    // ours alone while the writer lives, and `src` is a different borrow.
    let mut w = unsafe { crate::threads::Writer::new(store, dst.as_mut_ptr().cast()) };
    for r in runs {
        // SAFETY: as above.
        unsafe { w.put(r.dst, &src[r.src..r.src + r.len]) };
    }
    drop(w);
    crate::threads::order_streamed_stores();
    Ok(())
}

/// Elements in `runs`.
pub(crate) fn run_elements(runs: &[Run]) -> usize {
    runs.iter().fold(0usize, |a, r| a.saturating_add(r.len))
}

/// Checks one rank's run lists locally: one list per rank, every run inside
/// the buffer it names on this rank (`src` for `send`, `dst` for `recv`).
/// Returns the element counts per rank of `send_runs` and `recv_runs`.
pub(crate) fn check_runs(
    kind: OpKind,
    (n, rank): (usize, usize),
    send: &Buf<'_>,
    send_runs: &[Vec<Run>],
    recv: &BufMut<'_>,
    recv_runs: &[Vec<Run>],
) -> Result<(Vec<usize>, Vec<usize>)> {
    let op = runs_name(kind);
    if send.dtype() != recv.dtype() {
        return Err(Error::DTypeMismatch {
            op,
            send: send.dtype(),
            recv: recv.dtype(),
        });
    }
    for (what, lists) in [
        ("send runs (one list per rank)", send_runs),
        ("recv runs (one list per rank)", recv_runs),
    ] {
        if lists.len() != n {
            return Err(Error::BadLength {
                op,
                rank,
                what,
                expected: n,
                got: lists.len(),
            });
        }
    }
    let inside = |runs: &[Vec<Run>], end: fn(&Run) -> usize, len: usize, what: &'static str| {
        for r in runs.iter().flatten() {
            let last = end(r).checked_add(r.len);
            if last.is_none_or(|last| last > len) {
                return Err(Error::BadLength {
                    op,
                    rank,
                    what,
                    expected: len,
                    got: last.unwrap_or(usize::MAX),
                });
            }
        }
        Ok(())
    };
    inside(send_runs, |r| r.src, send.len(), "send buffer (end of a send run)")?;
    inside(recv_runs, |r| r.dst, recv.len(), "recv buffer (end of a recv run)")?;
    Ok((
        send_runs.iter().map(|r| run_elements(r)).collect(),
        recv_runs.iter().map(|r| run_elements(r)).collect(),
    ))
}

/// The name errors give the runs form of `kind`.
pub(crate) const fn runs_name(kind: OpKind) -> &'static str {
    match kind {
        OpKind::AllGather => "all_gather_v_runs",
        OpKind::ReduceScatter => "reduce_scatter_v_runs",
        _ => "all_to_all_v_runs",
    }
}

/// The default runs forms' scratch: `send`'s runs to each rank, packed in
/// rank order (what `all_to_all_v` sends).
pub(crate) fn pack_runs(send: &Buf<'_>, send_runs: &[Vec<Run>]) -> Buffer {
    let total = send_runs.iter().map(|r| run_elements(r)).sum();
    // Every element is written: an empty buffer of that capacity, not zeros.
    let out = crate::pool::alloc(send.dtype(), total, false);
    crate::dispatch_buf!(Buf, send, s, T => {
        let mut v = T::from_buffer(out).unwrap_or_else(|_| unreachable!("allocated with the send buffer's dtype"));
        for r in send_runs.iter().flatten() {
            v.extend_from_slice(&s[r.src..r.src + r.len]);
        }
        T::into_buffer(v)
    })
}

/// The default runs forms' placement: `got` holds each rank's elements in
/// rank order (what `all_to_all_v` or `all_gather_v` received). With
/// `segments` (the gather form: rank `q`'s whole buffer at `segments[q]`),
/// each run reads from its `src` in its rank's segment; without (the
/// all-to-all form, whose sender packed its runs in order), the runs read
/// `got` in order.
pub(crate) fn place_runs(
    got: &Buf<'_>,
    recv: &mut BufMut<'_>,
    recv_runs: &[Vec<Run>],
    segments: Option<&[usize]>,
) -> Result<()> {
    crate::dispatch_buf!(Buf, got, s, T => {
        let d: &mut [T] = typed_mut(recv)?;
        let mut at = 0;
        for (q, runs) in recv_runs.iter().enumerate() {
            for r in runs {
                let from = segments.map_or(at, |seg| seg[q] + r.src);
                d[r.dst..r.dst + r.len].copy_from_slice(&s[from..from + r.len]);
                at += r.len;
            }
        }
    });
    Ok(())
}

/// `runs[rank]` alone, in a list of one per rank (the others empty): the
/// receive side of a reduce-scatter's runs.
pub(crate) fn own_runs(runs: &[Vec<Run>], rank: usize, n: usize) -> Vec<Vec<Run>> {
    (0..n)
        .map(|q| {
            if q == rank {
                runs.get(q).cloned().unwrap_or_default()
            } else {
                Vec::new()
            }
        })
        .collect()
}
