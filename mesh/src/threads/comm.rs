//! [`ThreadComm`]: this rank's handle on a group of the threads backend, with a
//! communication thread that runs the asynchronous collectives in issue order.

use std::sync::Arc;

use super::group::Group;
use super::kernels::{self, Out, Source};
use super::split::split_group;
use crate::comm::{
    Run, Worker, all_gather_v_bytes, all_to_all_v_bytes, check_runs, nbytes as bytes, own_runs, reduce_scatter_v_bytes,
};
use crate::context::RankId;
use crate::dtype::Filling;
use crate::observe::RunLabel;
use crate::stats::CommStats;
use crate::{Buf, BufMut, Buffer, Communicator, OpKind, Pieces, ReduceOp, Result, Work};

/// This rank's communicator on one group of the threads backend.
pub(crate) struct ThreadComm {
    group: Arc<Group>,
    rank: usize,
    stats: Arc<CommStats>,
    worker: Worker,
}

impl ThreadComm {
    pub(crate) fn new(group: Arc<Group>, rank: usize) -> ThreadComm {
        let world_rank = group.members[rank];
        let stats = group.world.stats[world_rank].clone();
        let tag = RankId {
            job: group.world.job,
            rank: world_rank,
        };
        let worker = Worker::new(rank, format!("tessera-comm-{world_rank}"), Some(tag));
        ThreadComm {
            group,
            rank,
            stats,
            worker,
        }
    }

    /// Waits for queued asynchronous collectives, so blocking ones run in issue order.
    /// Blocked there, the closure thread is not an active agent of its rank: the
    /// rank progresses only through the queued collectives, each an agent itself.
    fn fence(&self) {
        let (world, me) = (&self.group.world, self.group.members[self.rank]);
        self.worker.fence_with(|delta| world.activity.add(me, delta));
    }

    /// Counts a collective on a buffer of `bytes` (its even share, by the
    /// stats table), and times it for [`observe`](crate::observe) until the
    /// returned span drops.
    fn record(&self, kind: OpKind, bytes: usize) -> crate::observe::Span {
        self.record_sent(kind, kind.bytes_sent(self.size(), bytes))
    }

    /// [`record`](Self::record) of a collective that sends exactly `sent` bytes
    /// from this rank.
    fn record_sent(&self, kind: OpKind, sent: u64) -> crate::observe::Span {
        self.stats.record_exact(kind, sent);
        crate::observe::collective(self.addr(), kind, self.size(), sent, false)
    }

    /// This rank's bytes in an all-reduce of `buf` (see the stats table).
    fn all_reduce_sent(&self, buf: &Buf<'_>) -> u64 {
        OpKind::all_reduce_sent(self.size(), self.rank, bytes(buf))
    }

    /// [`record`](Self::record) for an asynchronous collective, timed to its
    /// hand-off; the label its run is recorded under (for [`submit`](Self::submit)).
    fn record_queued(&self, kind: OpKind, bytes: usize) -> Option<RunLabel> {
        self.record_queued_sent(kind, kind.bytes_sent(self.size(), bytes))
    }

    /// [`record_sent`](Self::record_sent) for an asynchronous collective.
    fn record_queued_sent(&self, kind: OpKind, sent: u64) -> Option<RunLabel> {
        self.stats.record_exact(kind, sent);
        crate::observe::queued(self.addr(), kind, self.size(), sent)
    }

    /// This communicator's address, by which meshes name it.
    fn addr(&self) -> usize {
        (self as *const Self).cast::<()>() as usize
    }

    /// Queues `f` (a collective on owned buffers) on the communication thread. The
    /// queued collective is an agent of this rank until it completes or is dropped
    /// unrun (see the cross-group mismatch check in `activity`).
    /// The call site is the caller's (the asynchronous method's caller), captured
    /// here and set on the communication thread while the collective runs.
    /// Its run is recorded under `label` when waited for.
    #[track_caller]
    fn submit(
        &self,
        label: Option<RunLabel>,
        f: impl FnOnce(&Group, usize) -> Result<Buffer> + Send + 'static,
    ) -> Work {
        let (group, rank) = (self.group.clone(), self.rank);
        let site = crate::callsite::here();
        let agent = Agent::start(&group, rank);
        let (world, me) = (group.world.clone(), group.members[rank]);
        self.worker
            .submit(move || {
                let _agent = agent;
                let _site = crate::callsite::issue_at(site);
                f(&group, rank)
            })
            // A closure thread blocked on the result is not an active agent (as
            // in `fence`).
            .on_block(Box::new(move |delta| world.activity.add(me, delta)))
            .labelled(label)
    }
}

/// One queued asynchronous collective of a rank, counted as an active agent of
/// that rank until dropped.
struct Agent {
    group: Arc<Group>,
    world_rank: usize,
}

impl Agent {
    fn start(group: &Arc<Group>, rank: usize) -> Agent {
        let world_rank = group.members[rank];
        group.world.activity.add(world_rank, 1);
        Agent {
            group: group.clone(),
            world_rank,
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.group.world.activity.add(self.world_rank, -1);
    }
}

impl Communicator for ThreadComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.group.size()
    }

    fn stats(&self) -> &CommStats {
        &self.stats
    }

    fn backend(&self) -> &'static str {
        "threads"
    }

    fn all_gather(&self, send: Buf<'_>, mut recv: BufMut<'_>) -> Result<()> {
        let _site = crate::callsite::issue();
        self.fence();
        let _obs = self.record(OpKind::AllGather, bytes(&send) * self.size());
        kernels::all_gather(&self.group, self.rank, send, Out::of(&mut recv))
    }

    fn all_gather_segmented(&self, send: Buf<'_>, mut recv: BufMut<'_>, segments: &[usize]) -> Result<()> {
        let _site = crate::callsite::issue();
        crate::comm::check_segments(self, (send.dtype(), send.len()), (recv.dtype(), recv.len()), segments)?;
        self.fence();
        let _obs = self.record(OpKind::AllGather, bytes(&send) * self.size());
        kernels::all_gather_segmented(&self.group, self.rank, Source::Flat(send), Out::of(&mut recv), segments)
    }

    fn reduce_scatter(&self, send: Buf<'_>, mut recv: BufMut<'_>, op: ReduceOp) -> Result<()> {
        let _site = crate::callsite::issue();
        self.fence();
        let _obs = self.record(OpKind::ReduceScatter, bytes(&send));
        kernels::reduce_scatter(&self.group, self.rank, Source::Flat(send), Out::of(&mut recv), op)
    }

    fn all_reduce(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<()> {
        let _site = crate::callsite::issue();
        self.fence();
        let _obs = self.record_sent(OpKind::AllReduce, self.all_reduce_sent(&buf.as_buf()));
        kernels::all_reduce(&self.group, self.rank, None, buf, op)
    }

    fn all_reduce_into(&self, send: Buf<'_>, recv: BufMut<'_>, op: ReduceOp) -> Result<()> {
        let _site = crate::callsite::issue();
        self.fence();
        let _obs = self.record_sent(OpKind::AllReduce, self.all_reduce_sent(&send));
        kernels::all_reduce(&self.group, self.rank, Some(send), recv, op)
    }

    fn all_to_all(&self, send: Buf<'_>, mut recv: BufMut<'_>) -> Result<()> {
        let _site = crate::callsite::issue();
        self.fence();
        let _obs = self.record(OpKind::AllToAll, bytes(&send));
        kernels::all_to_all(&self.group, self.rank, send, Out::of(&mut recv))
    }

    fn all_gather_v(&self, send: Buf<'_>, recv: BufMut<'_>, counts: &[usize]) -> Result<()> {
        let _site = crate::callsite::issue();
        self.fence();
        // n−1 copies of its own piece (the stats table).
        let sent = all_gather_v_bytes(send.dtype(), counts, self.rank, self.size());
        let _obs = self.record_sent(OpKind::AllGather, sent);
        kernels::all_gather_v(&self.group, self.rank, send, recv, counts)
    }

    fn reduce_scatter_v(&self, send: Buf<'_>, recv: BufMut<'_>, counts: &[usize], op: ReduceOp) -> Result<()> {
        let _site = crate::callsite::issue();
        self.fence();
        // The input less its own piece (the stats table).
        let sent = reduce_scatter_v_bytes(send.dtype(), bytes(&send), counts, self.rank);
        let _obs = self.record_sent(OpKind::ReduceScatter, sent);
        kernels::reduce_scatter_v(&self.group, self.rank, send, recv, counts, op)
    }

    fn all_to_all_v(
        &self,
        send: Buf<'_>,
        send_counts: &[usize],
        recv: BufMut<'_>,
        recv_counts: &[usize],
    ) -> Result<()> {
        let _site = crate::callsite::issue();
        self.fence();
        let sent = all_to_all_v_bytes(send.dtype(), send_counts, self.rank);
        let _obs = self.record_sent(OpKind::AllToAll, sent);
        kernels::all_to_all_v(&self.group, self.rank, send, send_counts, recv, recv_counts)
    }

    fn all_gather_v_runs(&self, send: Buf<'_>, recv: BufMut<'_>, recv_runs: &[Vec<Run>]) -> Result<()> {
        let _site = crate::callsite::issue();
        self.fence();
        let none = vec![Vec::new(); self.size()];
        let (_, counts) = check_runs(
            OpKind::AllGather,
            (self.size(), self.rank),
            &send,
            &none,
            &recv,
            recv_runs,
        )?;
        // n−1 copies of its own piece, as all_gather_v.
        let sent = all_gather_v_bytes(send.dtype(), &counts, self.rank, self.size());
        let _obs = self.record_sent(OpKind::AllGather, sent);
        kernels::runs(
            &self.group,
            self.rank,
            OpKind::AllGather,
            send,
            recv,
            (&counts, &[]),
            recv_runs,
            true,
        )
    }

    fn reduce_scatter_v_runs(&self, send: Buf<'_>, recv: BufMut<'_>, runs: &[Vec<Run>], op: ReduceOp) -> Result<()> {
        let _site = crate::callsite::issue();
        self.fence();
        let mine = own_runs(runs, self.rank, self.size());
        let (counts, _) = check_runs(
            OpKind::ReduceScatter,
            (self.size(), self.rank),
            &send,
            runs,
            &recv,
            &mine,
        )?;
        // The input less its own piece, as reduce_scatter_v.
        let sent = reduce_scatter_v_bytes(send.dtype(), bytes(&send), &counts, self.rank);
        let _obs = self.record_sent(OpKind::ReduceScatter, sent);
        kernels::reduce_scatter_runs(&self.group, self.rank, send, recv, &counts, &mine[self.rank], op, true)
    }

    fn all_to_all_v_runs(
        &self,
        send: Buf<'_>,
        send_runs: &[Vec<Run>],
        recv: BufMut<'_>,
        recv_runs: &[Vec<Run>],
    ) -> Result<()> {
        let _site = crate::callsite::issue();
        self.fence();
        let (send_counts, recv_counts) = check_runs(
            OpKind::AllToAll,
            (self.size(), self.rank),
            &send,
            send_runs,
            &recv,
            recv_runs,
        )?;
        let sent = all_to_all_v_bytes(send.dtype(), &send_counts, self.rank);
        let _obs = self.record_sent(OpKind::AllToAll, sent);
        kernels::runs(
            &self.group,
            self.rank,
            OpKind::AllToAll,
            send,
            recv,
            (&send_counts, &recv_counts),
            recv_runs,
            true,
        )
    }

    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<()> {
        let _site = crate::callsite::issue();
        self.fence();
        let _obs = self.record(OpKind::Broadcast, bytes(&buf.as_buf()));
        kernels::broadcast(&self.group, self.rank, buf, root)
    }

    fn barrier(&self) -> Result<()> {
        let _site = crate::callsite::issue();
        self.fence();
        let _obs = self.record(OpKind::Barrier, 0);
        kernels::barrier(&self.group, self.rank)
    }

    fn split(&self, color: u32, key: u32) -> Result<Box<dyn Communicator>> {
        let _site = crate::callsite::issue();
        self.fence();
        let _obs = self.record(OpKind::Split, 0);
        let (group, rank) = split_group(&self.group, self.rank, color, key)?;
        Ok(Box::new(ThreadComm::new(group, rank)))
    }

    fn all_gather_async(&self, send: Buffer) -> Work {
        let run = self.record_queued(OpKind::AllGather, bytes(&send.as_buf()) * self.size());
        let n = self.size();
        self.submit(run, move |g, r| {
            filled(send.dtype(), send.len() * n, |out| {
                kernels::all_gather(g, r, send.as_buf(), out)
            })
        })
    }

    fn all_gather_segmented_async(&self, send: Buffer, segments: Vec<usize>) -> Work {
        let n = self.size();
        let recv = (send.dtype(), send.len().saturating_mul(n));
        if let Err(e) = crate::comm::check_segments(self, (send.dtype(), send.len()), recv, &segments) {
            return Work::ready(Err(e));
        }
        let run = self.record_queued(OpKind::AllGather, bytes(&send.as_buf()) * n);
        self.submit(run, move |g, r| {
            filled(send.dtype(), send.len() * n, |out| {
                kernels::all_gather_segmented(g, r, Source::Flat(send.as_buf()), out, &segments)
            })
        })
    }

    fn reduce_scatter_async(&self, send: Buffer, op: ReduceOp) -> Work {
        let run = self.record_queued(OpKind::ReduceScatter, bytes(&send.as_buf()));
        let n = self.size();
        self.submit(run, move |g, r| {
            filled(send.dtype(), send.len() / n, |out| {
                kernels::reduce_scatter(g, r, Source::Flat(send.as_buf()), out, op)
            })
        })
    }

    fn all_gather_segmented_pieces_async(&self, send: Pieces, segments: Vec<usize>) -> Work {
        let n = self.size();
        let (dtype, len) = (send.dtype(), send.len());
        if let Err(e) = crate::comm::check_segments(self, (dtype, len), (dtype, len.saturating_mul(n)), &segments) {
            return Work::ready(Err(e));
        }
        let run = self.record_queued(OpKind::AllGather, len * dtype.size_in_bytes() * n);
        self.submit(run, move |g, r| {
            filled(dtype, len * n, |out| {
                kernels::all_gather_segmented(g, r, Source::Pieces(&send), out, &segments)
            })
        })
    }

    fn reduce_scatter_pieces_async(&self, send: Pieces, op: ReduceOp) -> Work {
        let (dtype, len) = (send.dtype(), send.len());
        let run = self.record_queued(OpKind::ReduceScatter, len * dtype.size_in_bytes());
        let n = self.size();
        self.submit(run, move |g, r| {
            filled(dtype, len / n, |out| {
                kernels::reduce_scatter(g, r, Source::Pieces(&send), out, op)
            })
        })
    }

    fn all_reduce_async(&self, mut buf: Buffer, op: ReduceOp) -> Work {
        let sent = self.all_reduce_sent(&buf.as_buf());
        let run = self.record_queued_sent(OpKind::AllReduce, sent);
        self.submit(run, move |g, r| {
            kernels::all_reduce(g, r, None, buf.as_buf_mut(), op).map(|_| buf)
        })
    }

    fn all_to_all_async(&self, send: Buffer) -> Work {
        let run = self.record_queued(OpKind::AllToAll, bytes(&send.as_buf()));
        self.submit(run, move |g, r| {
            filled(send.dtype(), send.len(), |out| {
                kernels::all_to_all(g, r, send.as_buf(), out)
            })
        })
    }

    fn broadcast_async(&self, mut buf: Buffer, root: usize) -> Work {
        let run = self.record_queued(OpKind::Broadcast, bytes(&buf.as_buf()));
        self.submit(run, move |g, r| {
            kernels::broadcast(g, r, buf.as_buf_mut(), root).map(|_| buf)
        })
    }
}

/// A new output of `len` elements of `dtype` that `kernel` fills: allocated
/// without zeroing, since every kernel given an [`Out`] writes each of its
/// elements before it returns `Ok`; on an error the output is dropped unread.
fn filled(dtype: crate::DType, len: usize, kernel: impl FnOnce(Out) -> Result<()>) -> Result<Buffer> {
    let mut recv = Filling::new(dtype, len);
    kernel(Out::filling(&mut recv))?;
    // SAFETY: the kernel returned Ok, so it wrote every element.
    Ok(unsafe { recv.finish() })
}
