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
//!
//! `access` holds those raw reads and writes, `reduce` the reductions (how each
//! dtype accumulates, and the cache-blocked loops over the ranks' inputs).

mod access;
mod reduce;

use access::{copy_from_peer, peer, write};
use reduce::{reduce_blocks, reduce_runs};

use super::desc::Desc;
use super::group::Group;
use super::store::{Store, Writer};
use crate::dtype::Filling;
use crate::{Buf, BufMut, Buffer, DType, Error, OpKind, Pieces, ReduceOp, Result};

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
        // SAFETY: our output, written only by us until the barrier below.
        let mut w = unsafe { Writer::new(store, d.recv_ptr as *mut u8) };
        for (q, dq) in descs.iter().enumerate() {
            // SAFETY: every descriptor was published in this collective and validated
            // (same length and dtype); peers hold their send buffers until the barrier
            // below, and block q of our output is ours alone.
            unsafe { w.put(q * c, peer::<T>(dq.send_ptr, c)) };
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
        // SAFETY: our output, written only by us until the barrier below. The
        // copies go in output order, so each piece continues the last one's line.
        let mut w = unsafe { Writer::new(store, d.recv_ptr as *mut u8) };
        for (q, piece, at) in crate::comm::segment_copies(segments, descs.len()) {
            // SAFETY: as in `all_gather` (validation checked that every peer sends
            // `send_len` elements and that our output holds `n · send_len`); the
            // segments tile `send_len`, so `piece` is within every peer's buffer and
            // the writes, `n · send_len` in all, stay in our output.
            unsafe { copy_from_peer::<T>(&mut w, &descs[q], piece.start, piece.len(), at) };
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
        // SAFETY: our output, written only by us until the barrier below.
        let mut w = unsafe { Writer::new(store, d.recv_ptr as *mut u8) };
        for (q, dq) in descs.iter().enumerate() {
            // SAFETY: as in `all_gather`; block r of peer q's input goes to our block q.
            unsafe { w.put(q * c, peer::<T>(dq.send_ptr + r * c * size_of::<T>(), c)) };
        }
    });
    done.finish()
}

pub(crate) fn all_gather_v(g: &Group, r: usize, send: Buf<'_>, recv: BufMut<'_>, counts: &[usize]) -> Result<()> {
    // Rank q's whole input at segment q of ours: one run each (counts that
    // disagree fail validation before anything is copied).
    let mut at = 0;
    let runs: Vec<Vec<crate::comm::Run>> = counts
        .iter()
        .map(|&len| {
            at += len;
            vec![crate::comm::Run {
                src: 0,
                dst: at - len,
                len,
            }]
        })
        .collect();
    self::runs(g, r, OpKind::AllGather, send, recv, (counts, &[]), &runs, false)
}

pub(crate) fn reduce_scatter_v(
    g: &Group,
    r: usize,
    send: Buf<'_>,
    recv: BufMut<'_>,
    counts: &[usize],
    op: ReduceOp,
) -> Result<()> {
    // Segment r of every input, one run (counts too short fail validation).
    let run = crate::comm::Run {
        src: counts.iter().take(r).sum(),
        dst: 0,
        len: counts.get(r).copied().unwrap_or(0),
    };
    reduce_scatter_runs(g, r, send, recv, counts, &[run], op, false)
}

/// The runs forms (`all_gather_v_runs`, `all_to_all_v_runs`: `placed`), and
/// `all_gather_v` as one run per rank: after the variable-count checks of
/// `counts` (per rank, what the runs add up to), each rank copies the runs it
/// receives straight from its peers' send buffers (into its output, inside
/// which the caller checked every run). A run outside its peer's buffer is
/// skipped and reported once every rank has finished (so no peer waits on
/// this one).
#[allow(clippy::too_many_arguments)]
pub(crate) fn runs(
    g: &Group,
    r: usize,
    kind: OpKind,
    send: Buf<'_>,
    mut recv: BufMut<'_>,
    (send_counts, recv_counts): (&[usize], &[usize]),
    recv_runs: &[Vec<crate::comm::Run>],
    placed: bool,
) -> Result<()> {
    let mut d = send_desc(kind, &send);
    Out::of(&mut recv).publish(&mut d);
    d.v = true;
    d.placed = placed;
    let (descs, _, done) = g.enter_v(r, d, send_counts, recv_counts)?;
    let store = Store::of(&descs);
    let mut outside = None;
    crate::dispatch_buf!(Buf, send, _s, T => {
        // SAFETY: our output, written only by us until the barrier below.
        let mut w = unsafe { Writer::new(store, d.recv_ptr as *mut u8) };
        let streaming = store == Store::Streaming;
        let mut order = DstOrder::new(recv_runs, streaming);
        let mut next = order.next();
        while let Some((q, run)) = next {
            next = order.next();
            let dq = &descs[q];
            if run.src.checked_add(run.len).is_none_or(|end| end > dq.send_len) {
                outside.get_or_insert((q, *run, dq.send_len));
                continue;
            }
            if let Some((p, ahead)) = next.filter(|_| streaming) {
                // The next run's first page while this one copies (past the
                // cache's size, where the copies stream): runs
                // strided through a peer's buffer each start on a page the
                // hardware prefetcher has not reached. (A transpose's 4 KiB
                // runs: 2.6-2.8 ms with the first 512 bytes prefetched,
                // 2.0-2.2 with the page, against 1.4-1.5 for the plain
                // all_to_all, on a machine where memory was fast.)
                let at = descs[p].send_ptr.wrapping_add(ahead.src.wrapping_mul(size_of::<T>()));
                prefetch_lines(at, (ahead.len * size_of::<T>()).min(4096));
            }
            // SAFETY: as in `all_gather`; the run lies inside peer q's input
            // (checked above) and inside our output (checked before entering:
            // `check_runs`), which is ours alone.
            unsafe { w.put(run.dst, peer::<T>(dq.send_ptr + run.src * size_of::<T>(), run.len)) };
        }
    });
    done.finish()?;
    match outside {
        None => Ok(()),
        Some((q, run, len)) => Err(Error::BadLength {
            op: d.name(),
            rank: q,
            what: "send buffer (a run another rank reads from it)",
            expected: len,
            got: run.src.saturating_add(run.len),
        }),
    }
}

/// `reduce_scatter_v_runs` (`placed`), and `reduce_scatter_v` as its one run:
/// after the variable-count checks of `counts`, this rank reduces each of its
/// runs straight from every rank's send buffer (one layout on every rank, of
/// the counts' sum, so every run inside this rank's (`check_runs`, or segment
/// `r` of the counts) lies inside each peer's).
#[allow(clippy::too_many_arguments)]
pub(crate) fn reduce_scatter_runs(
    g: &Group,
    r: usize,
    send: Buf<'_>,
    mut recv: BufMut<'_>,
    counts: &[usize],
    mine: &[crate::comm::Run],
    op: ReduceOp,
    placed: bool,
) -> Result<()> {
    let mut d = send_desc(OpKind::ReduceScatter, &send);
    Out::of(&mut recv).publish(&mut d);
    d.reduce = Some(op);
    d.v = true;
    d.placed = placed;
    let (descs, _, done) = g.enter_v(r, d, counts, &[])?;
    let store = Store::of(&descs);
    crate::dispatch_buf!(Buf, send, _s, T => {
        for run in mine {
            // SAFETY: validation checked that every rank's input holds the
            // counts' sum, as ours does, so the run (inside ours: `check_runs`)
            // lies inside every input; it lies inside our output, ours alone.
            unsafe { reduce_blocks::<T>(store, &descs, |dq| dq.send_ptr, run.src, run.len, op, d.recv_ptr as *mut T, run.dst) };
        }
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
        // SAFETY: our output, written only by us until the barrier below.
        let mut w = unsafe { Writer::new(store, d.recv_ptr as *mut u8) };
        let mut at = 0;
        for (dq, cq) in descs.iter().zip(&counts) {
            // Our segment of peer q's input starts after its segments for ranks < r.
            let from: usize = cq.send[..r].iter().sum();
            let len = cq.send[r];
            // SAFETY: as in `all_gather`; validation checked that peer q's input holds
            // the sum of its send_counts and that cq.send[r] equals our recv_counts[q],
            // so the read is within its input and segment q of our output (whose
            // length is the sum of our recv_counts) is in bounds and ours alone.
            unsafe { w.put(at, peer::<T>(dq.send_ptr + from * size_of::<T>(), len)) };
            at += len;
        }
    });
    done.finish()
}

/// Asks the cache for the lines of `bytes` bytes from address `at` (a hint:
/// any address is allowed).
fn prefetch_lines(at: usize, bytes: usize) {
    #[cfg(target_arch = "x86_64")]
    for line in (0..bytes).step_by(64) {
        // SAFETY: a prefetch has no effect but on the cache, at any address.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(at.wrapping_add(line) as *const i8)
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (at, bytes);
}

/// The runs of every peer's list (`(peer, run)`), each list in its order:
/// with `merged`, the lists interleaved in output order wherever they allow
/// (each next run the one that starts where the last ended, else the one
/// that starts first), so that a [`Writer`] streams the lines where runs of
/// different peers meet whole; without, list after list.
///
/// A redistribution's gather sends runs that alternate between peers in the
/// output (a `[256, 256, 256]` gather over `2 × 2 × 2` ranks: 512-byte runs
/// from two peers in turn): in list order every such meeting is a line
/// written by halves.
struct DstOrder<'a> {
    lists: &'a [Vec<crate::comm::Run>],
    /// The next run of each list.
    at: Vec<usize>,
    merged: bool,
    /// The list of the last run, the list of the run before (the likeliest
    /// to continue the output: two peers in turn), and where the last ended.
    last: usize,
    before: usize,
    end: usize,
}

impl<'a> DstOrder<'a> {
    fn new(lists: &'a [Vec<crate::comm::Run>], merged: bool) -> DstOrder<'a> {
        DstOrder {
            lists,
            at: vec![0; lists.len()],
            merged,
            last: 0,
            before: 0,
            end: usize::MAX,
        }
    }

    /// Whether the next run of list `q` starts at element `at`.
    fn starts_at(&self, q: usize, at: usize) -> bool {
        self.lists[q].get(self.at[q]).is_some_and(|r| r.dst == at)
    }
}

impl<'a> Iterator for DstOrder<'a> {
    type Item = (usize, &'a crate::comm::Run);

    fn next(&mut self) -> Option<Self::Item> {
        let n = self.lists.len();
        let (last, end) = (self.last, self.end);
        let q = if n == 0 {
            return None;
        } else if !self.merged {
            (last..n).find(|&q| self.at[q] < self.lists[q].len())?
        } else if self.starts_at(last, end) {
            last
        } else if last + 1 < n && self.starts_at(last + 1, end) {
            last + 1
        } else if self.starts_at(self.before, end) {
            self.before
        } else {
            // No list continues the output: the run that starts first.
            (0..n)
                .filter(|&q| self.at[q] < self.lists[q].len())
                .min_by_key(|&q| self.lists[q][self.at[q]].dst)?
        };
        let list = &self.lists[q];
        let run = &list[self.at[q]];
        self.at[q] += 1;
        // The lists are read in turns and each run is a few lines of copying:
        // without a prefetch, the wait for the next run's entry was a third
        // of the time outside the copies.
        #[cfg(target_arch = "x86_64")]
        if let Some(ahead) = list.get(self.at[q] + 8) {
            // SAFETY: a prefetch has no effect but on the cache.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(std::ptr::from_ref(ahead).cast())
            };
        }
        if q != last {
            self.before = last;
        }
        self.last = q;
        self.end = run.dst + run.len;
        Some((q, run))
    }
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

#[cfg(test)]
mod tests {
    use super::DstOrder;
    use crate::comm::Run;

    fn run(dst: usize, len: usize) -> Run {
        Run { src: dst, dst, len }
    }

    /// The `(peer, dst)` order of `lists`.
    fn order(lists: &[Vec<Run>], merged: bool) -> Vec<(usize, usize)> {
        DstOrder::new(lists, merged).map(|(q, r)| (q, r.dst)).collect()
    }

    /// Merged, runs of two peers that alternate in the output come in output
    /// order, also with gaps and with lists of other peers in between;
    /// unmerged, list after list.
    #[test]
    fn merged_runs_come_in_output_order() {
        // Peers 1 and 2 alternate rows of 8; peer 0 and 3 have none; a gap
        // after every fourth row.
        let mut lists = vec![Vec::new(); 4];
        for row in 0..12 {
            let at = row * 16 + (row / 4) * 5;
            lists[1].push(run(at, 8));
            lists[2].push(run(at + 8, 8));
        }
        let got = order(&lists, true);
        let mut dsts: Vec<usize> = got.iter().map(|&(_, d)| d).collect();
        assert!(dsts.is_sorted(), "{got:?}");
        assert_eq!(got[..3], [(1, 0), (2, 8), (1, 16)]);
        dsts.dedup();
        assert_eq!(dsts.len(), 24);
        let unmerged = order(&lists, false);
        assert_eq!(
            unmerged[..12],
            (0..12).map(|i| (1, lists[1][i].dst)).collect::<Vec<_>>()[..]
        );
        assert!(unmerged[12..].iter().all(|&(q, _)| q == 2));
        assert!(order(&[], true).is_empty() && order(&[vec![], vec![]], true).is_empty());
    }

    /// Lists out of output order (which the runs forms allow) still yield
    /// every run exactly once, each list's runs in its own order.
    #[test]
    fn unsorted_lists_yield_every_run_once() {
        let lists = vec![
            vec![run(40, 4), run(0, 4), run(20, 2)],
            vec![run(4, 6), run(90, 1)],
            vec![run(10, 10), run(44, 3), run(22, 1)],
        ];
        for merged in [true, false] {
            let got = order(&lists, merged);
            assert_eq!(got.len(), 8, "merged {merged}: {got:?}");
            for (q, list) in lists.iter().enumerate() {
                let mine: Vec<usize> = got.iter().filter(|&&(p, _)| p == q).map(|&(_, d)| d).collect();
                assert_eq!(
                    mine,
                    list.iter().map(|r| r.dst).collect::<Vec<_>>(),
                    "merged {merged}, list {q}"
                );
            }
        }
    }
}
