//! Argument checks and padded fallbacks shared by the variable-count collectives
//! (`all_gather_v`, `reduce_scatter_v`, `all_to_all_v`).

use crate::stats::OpKind;
use crate::{Buf, BufMut, Buffer, DType, Element, Error, Result};

use super::*;

/// The name of the variable-count form of `kind` (`"all_gather_v"`).
pub(crate) const fn v_name(kind: OpKind) -> &'static str {
    match kind {
        OpKind::AllGather => "all_gather_v",
        OpKind::ReduceScatter => "reduce_scatter_v",
        _ => "all_to_all_v",
    }
}

/// What one rank passed to a variable-count collective, as the cross-rank check
/// ([`check_v`]) sees it. `counts` are the send counts of `all_to_all_v`;
/// `recv_counts` is empty for the other two.
#[derive(Clone, Copy, Debug)]
pub(crate) struct VArgs<'a> {
    pub(crate) send_len: usize,
    pub(crate) recv_len: usize,
    pub(crate) counts: &'a [usize],
    pub(crate) recv_counts: &'a [usize],
}

pub(super) fn sum(counts: &[usize]) -> usize {
    counts.iter().fold(0usize, |a, &c| a.saturating_add(c))
}

/// Checks that `rank` passed one count per rank (`recv_counts` too for all_to_all_v).
pub(super) fn check_counts_len(
    kind: OpKind,
    n: usize,
    rank: usize,
    counts: &[usize],
    recv_counts: &[usize],
) -> Result<()> {
    let a2a = kind == OpKind::AllToAll;
    let bad = |what, got| Error::BadLength {
        op: v_name(kind),
        rank,
        what,
        expected: n,
        got,
    };
    if counts.len() != n {
        let what = if a2a {
            "send_counts (one per rank)"
        } else {
            "counts (one per rank)"
        };
        return Err(bad(what, counts.len()));
    }
    if a2a && recv_counts.len() != n {
        return Err(bad("recv_counts (one per rank)", recv_counts.len()));
    }
    Ok(())
}

/// Checks that every rank's arguments to a variable-count collective (`kind` names
/// the fixed-size counterpart) are consistent, in a fixed order, so every rank that
/// runs it over the same `args` reports the same error. `name(q)` is how errors
/// name group rank `q`.
///
/// Order: counts arrays one per rank; counts equal on every rank (all_gather_v,
/// reduce_scatter_v) or pairwise consistent (all_to_all_v); buffer lengths.
pub(crate) fn check_v(kind: OpKind, args: &[VArgs<'_>], name: impl Fn(usize) -> usize) -> Result<()> {
    let (n, op) = (args.len(), v_name(kind));
    for (q, a) in args.iter().enumerate() {
        check_counts_len(kind, n, name(q), a.counts, a.recv_counts)?;
    }
    if kind == OpKind::AllToAll {
        for (i, a) in args.iter().enumerate() {
            for (j, b) in args.iter().enumerate() {
                let (sent, expected) = (a.counts[j], b.recv_counts[i]);
                if sent != expected {
                    return Err(Error::Mismatch {
                        detail: format!(
                            "{op}: rank {wi} sends {sent} elements to rank {wj} (its send_counts[{j}]) but rank {wj} expects {expected} from rank {wi} (its recv_counts[{i}]); each rank's send_counts must match what its peers pass as recv_counts",
                            wi = name(i),
                            wj = name(j),
                        ),
                    });
                }
            }
        }
    } else if let Some(q) = args.iter().position(|a| a.counts != args[0].counts) {
        let (mine, first) = (args[q].counts, args[0].counts);
        let i = mine.iter().zip(first).position(|(x, y)| x != y).unwrap_or(0);
        return Err(Error::Mismatch {
            detail: format!(
                "{op}: rank {} passed counts {mine:?} but rank {} passed {first:?} (counts[{i}]: {} vs {}); every rank must pass the same counts",
                name(q),
                name(0),
                mine[i],
                first[i]
            ),
        });
    }
    for (q, a) in args.iter().enumerate() {
        let (send, recv) = match kind {
            OpKind::AllGather => (
                ("send buffer (counts[rank])", a.counts[q]),
                ("receive buffer (sum of counts)", sum(a.counts)),
            ),
            OpKind::ReduceScatter => (
                ("send buffer (sum of counts)", sum(a.counts)),
                ("receive buffer (counts[rank])", a.counts[q]),
            ),
            _ => (
                ("send buffer (sum of send_counts)", sum(a.counts)),
                ("receive buffer (sum of recv_counts)", sum(a.recv_counts)),
            ),
        };
        for ((what, expected), got) in [(send, a.send_len), (recv, a.recv_len)] {
            if got != expected {
                return Err(Error::BadLength {
                    op,
                    rank: name(q),
                    what,
                    expected,
                    got,
                });
            }
        }
    }
    Ok(())
}

/// Local checks of the provided variable-count forms: matching dtypes and counts
/// arrays of one per rank (the cross-rank ones need the exchange). Returns the dtype.
pub(crate) fn check_v_local<C: Communicator + ?Sized>(
    c: &C,
    kind: OpKind,
    send: &Buf<'_>,
    recv: &BufMut<'_>,
    counts: &[usize],
    recv_counts: &[usize],
) -> Result<DType> {
    if send.dtype() != recv.dtype() {
        return Err(Error::DTypeMismatch {
            op: v_name(kind),
            send: send.dtype(),
            recv: recv.dtype(),
        });
    }
    check_counts_len(kind, c.size(), c.rank(), counts, recv_counts)?;
    Ok(send.dtype())
}

/// One rank's row in the cross-rank check of a variable-count collective:
/// `[send_len, recv_len, counts.., recv_counts..]`, each counts array padded or cut
/// to `n` (`recv_counts` only for all_to_all_v), so every rank's row has the same
/// width even when its own counts arrays have the wrong length.
pub(crate) fn v_row(
    kind: OpKind,
    n: usize,
    send_len: usize,
    recv_len: usize,
    counts: &[usize],
    recv_counts: &[usize],
) -> Vec<i64> {
    let fixed = |c: &[usize]| (0..n).map(|q| c.get(q).map_or(0, |&x| x as i64)).collect::<Vec<i64>>();
    let mut row = vec![send_len as i64, recv_len as i64];
    row.extend(fixed(counts));
    if kind == OpKind::AllToAll {
        row.extend(fixed(recv_counts));
    }
    row
}

/// Checks every rank's [`v_row`] (`rows[q]` is group rank `q`'s) with [`check_v`],
/// identically on every rank. Returns the largest count (send count for
/// all_to_all_v) of any rank: the block size every rank pads to.
pub(crate) fn check_v_rows(kind: OpKind, n: usize, rows: &[&[i64]]) -> Result<usize> {
    let cols: Vec<Vec<usize>> = rows.iter().map(|r| r.iter().map(|&x| x as usize).collect()).collect();
    let args: Vec<VArgs<'_>> = cols
        .iter()
        .map(|r| VArgs {
            send_len: r[0],
            recv_len: r[1],
            counts: &r[2..2 + n],
            recv_counts: &r[2 + n..],
        })
        .collect();
    check_v(kind, &args, |q| q)?;
    Ok(args.iter().flat_map(|a| a.counts.iter().copied()).max().unwrap_or(0))
}

/// Gathers every rank's buffer lengths and counts (one `all_gather` of `i64`) and
/// checks them with [`check_v_rows`], identically on every rank. Returns the largest
/// count (send count for all_to_all_v) of any rank: the block size every rank pads to.
pub(crate) fn exchange_v<C: Communicator + ?Sized>(
    c: &C,
    kind: OpKind,
    send_len: usize,
    recv_len: usize,
    counts: &[usize],
    recv_counts: &[usize],
) -> Result<usize> {
    let n = c.size();
    let row = v_row(kind, n, send_len, recv_len, counts, recv_counts);
    let mut all = vec![0i64; row.len() * n];
    c.all_gather(i64::buf(&row), i64::buf_mut(&mut all))?;
    let rows: Vec<&[i64]> = all.chunks_exact(row.len()).collect();
    check_v_rows(kind, n, &rows)
}

/// The bytes an all_gather_v over `n` ranks sends off this rank: its own piece
/// (`counts[rank]` elements) to each of the `n − 1` others.
pub(crate) fn all_gather_v_bytes(dtype: DType, counts: &[usize], rank: usize, n: usize) -> u64 {
    let own = counts.get(rank).copied().unwrap_or(0) * dtype.size_in_bytes();
    (n.saturating_sub(1) * own) as u64
}

/// The bytes a reduce_scatter_v of a `send_bytes`-byte input sends off this
/// rank: the input less its own block (`counts[rank]` elements).
pub(crate) fn reduce_scatter_v_bytes(dtype: DType, send_bytes: usize, counts: &[usize], rank: usize) -> u64 {
    let own = counts.get(rank).copied().unwrap_or(0) * dtype.size_in_bytes();
    send_bytes.saturating_sub(own) as u64
}

/// The bytes an all_to_all_v sends off this rank: every segment but its own.
pub(crate) fn all_to_all_v_bytes(dtype: DType, send_counts: &[usize], rank: usize) -> u64 {
    let own = send_counts.get(rank).copied().unwrap_or(0) as u64;
    let total = send_counts.iter().fold(0u64, |a, &c| a.saturating_add(c as u64));
    (total - own).saturating_mul(dtype.size_in_bytes() as u64)
}

/// Copies consecutive segments of `src` (lengths `counts`) into blocks of `block`
/// elements of `dst` (segment `q` at `q · block`).
pub(super) fn pad(src: Buf<'_>, counts: &[usize], block: usize, dst: &mut Buffer) -> Result<()> {
    let mut dst = dst.as_buf_mut();
    crate::dispatch_buf!(Buf, src, s, T => {
        let d: &mut [T] = typed_mut(&mut dst)?;
        let mut at = 0;
        for (q, &c) in counts.iter().enumerate() {
            d[q * block..q * block + c].copy_from_slice(&s[at..at + c]);
            at += c;
        }
    });
    Ok(())
}

/// The inverse of [`pad`]: copies the first `counts[q]` elements of block `q` of
/// `src` into consecutive segments of `dst`.
pub(super) fn unpad(src: &Buffer, counts: &[usize], block: usize, mut dst: BufMut<'_>) -> Result<()> {
    crate::dispatch_buf!(Buffer, src, s, T => {
        let d: &mut [T] = typed_mut(&mut dst)?;
        let mut at = 0;
        for (q, &c) in counts.iter().enumerate() {
            d[at..at + c].copy_from_slice(&s[q * block..q * block + c]);
            at += c;
        }
    });
    Ok(())
}

/// Local checks of [`Communicator::all_gather_segmented`]: the segments tile
/// the send buffer (its dtype and length), and the receive buffer holds
/// `size · send_len` elements of the send dtype.
pub(crate) fn check_segments<C: Communicator + ?Sized>(
    c: &C,
    (send_dtype, send_len): (DType, usize),
    (recv_dtype, recv_len): (DType, usize),
    segments: &[usize],
) -> Result<()> {
    const OP: &str = "all_gather_segmented";
    if send_dtype != recv_dtype {
        return Err(Error::DTypeMismatch {
            op: OP,
            send: send_dtype,
            recv: recv_dtype,
        });
    }
    let total = segments.iter().try_fold(0usize, |a, &s| a.checked_add(s));
    if total != Some(send_len) {
        return Err(Error::BadLength {
            op: OP,
            rank: c.rank(),
            what: "send (the sum of the segments)",
            expected: total.unwrap_or(usize::MAX),
            got: send_len,
        });
    }
    let want = send_len.saturating_mul(c.size());
    if recv_len != want {
        return Err(Error::BadLength {
            op: OP,
            rank: c.rank(),
            what: "recv (size · send)",
            expected: want,
            got: recv_len,
        });
    }
    Ok(())
}

/// The copies that lay out an all-gather of `n` blocks of `Σ segments` elements
/// in segment order (segment 0 of every block, then segment 1 of every block,
/// ...), in output order: `(q, piece, at)` puts elements `piece` of block `q` at
/// `at..at + piece.len()` of the output.
pub(crate) fn segment_copies(
    segments: &[usize],
    n: usize,
) -> impl Iterator<Item = (usize, std::ops::Range<usize>, usize)> + '_ {
    let starts = segments.iter().scan(0, |from, &len| {
        *from += len;
        Some(*from - len..*from)
    });
    // Segment `piece` of every block fills `n · piece.len()` elements from `n · piece.start`.
    starts.flat_map(move |piece| (0..n).map(move |q| (q, piece.clone(), n * piece.start + q * piece.len())))
}

/// Copies the rank-major gather `src` (`n` blocks of `Σ segments`) into `dst` in
/// segment order ([`segment_copies`]).
pub(crate) fn segment_major(src: &Buf<'_>, dst: &mut BufMut<'_>, segments: &[usize], n: usize) -> Result<()> {
    let block: usize = segments.iter().sum();
    crate::dispatch_buf!(Buf, src, s, T => {
        let d: &mut [T] = typed_mut(dst)?;
        for (q, piece, at) in segment_copies(segments, n) {
            d[at..at + piece.len()].copy_from_slice(&s[q * block..][piece]);
        }
    });
    Ok(())
}
