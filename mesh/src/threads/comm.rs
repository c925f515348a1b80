//! [`ThreadComm`]: this rank's handle on a group of the threads backend, with a
//! communication thread that runs the asynchronous collectives in issue order.

use std::cell::RefCell;
use std::sync::{Arc, Condvar, Mutex, mpsc};
use std::thread::JoinHandle;

use super::group::{Group, lock};
use super::kernels;
use crate::context::{self, RankId};
use crate::stats::CommStats;
use crate::{Buf, BufMut, Buffer, Communicator, Error, OpKind, ReduceOp, Result, Work};

type Job = Box<dyn FnOnce() + Send>;

/// The communication thread of one communicator, started on first asynchronous use.
struct Worker {
    tx: Option<mpsc::Sender<Job>>,
    handle: Option<JoinHandle<()>>,
    /// Jobs issued and not finished, and a condvar signalled when it drops to zero.
    pending: Arc<(Mutex<usize>, Condvar)>,
}

impl Worker {
    fn start(group: &Group, rank: usize) -> Result<Worker> {
        let (tx, rx) = mpsc::channel::<Job>();
        let id = RankId {
            job: group.world.job,
            rank: group.members[rank],
        };
        let handle = std::thread::Builder::new()
            .name(format!("tessera-comm-{}", id.rank))
            .spawn(move || {
                let _tag = context::enter(id);
                for job in rx {
                    job();
                }
            })
            .map_err(|e| Error::Backend {
                rank,
                reason: format!("cannot start the communication thread: {e}"),
            })?;
        Ok(Worker {
            tx: Some(tx),
            handle: Some(handle),
            pending: Arc::new((Mutex::new(0), Condvar::new())),
        })
    }

    /// Blocks until every issued job has finished.
    fn drain(&self) {
        let (count, cv) = &*self.pending;
        let mut c = lock(count);
        while *c > 0 {
            c = cv.wait(c).unwrap_or_else(|e| e.into_inner());
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // Closing the channel ends the thread once queued jobs are done; every job
        // ends (collectives time out or see the poison), so the join is bounded.
        self.tx.take();
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// This rank's communicator on one group of the threads backend.
pub(crate) struct ThreadComm {
    group: Arc<Group>,
    rank: usize,
    stats: Arc<CommStats>,
    worker: RefCell<Option<Worker>>,
}

impl ThreadComm {
    pub(crate) fn new(group: Arc<Group>, rank: usize) -> ThreadComm {
        let stats = group.world.stats[group.members[rank]].clone();
        ThreadComm {
            group,
            rank,
            stats,
            worker: RefCell::new(None),
        }
    }

    /// Waits for queued asynchronous collectives, so blocking ones run in issue order.
    fn fence(&self) {
        if let Some(w) = self.worker.borrow().as_ref() {
            w.drain();
        }
    }

    fn record(&self, kind: OpKind, bytes: usize) {
        self.stats.record(kind, self.size(), bytes);
    }

    /// Queues `f` (a collective on owned buffers) on the communication thread.
    fn submit(&self, f: impl FnOnce(&Group, usize) -> Result<Buffer> + Send + 'static) -> Work {
        let mut slot = self.worker.borrow_mut();
        if slot.is_none() {
            match Worker::start(&self.group, self.rank) {
                Ok(w) => *slot = Some(w),
                Err(e) => return Work::ready(Err(e)),
            }
        }
        // INVARIANT: the slot was filled just above.
        let w = slot.as_ref().expect("worker started");
        let (tx, rx) = mpsc::channel();
        let group = self.group.clone();
        let rank = self.rank;
        let pending = w.pending.clone();
        *lock(&pending.0) += 1;
        let job: Job = Box::new(move || {
            let out = f(&group, rank);
            // The receiver may be gone (the handle was dropped unwaited): nothing to do then.
            let _ = tx.send(out);
            let (count, cv) = &*pending;
            *lock(count) -= 1;
            cv.notify_all();
        });
        let sent = w.tx.as_ref().map(|tx| tx.send(job));
        match sent {
            Some(Ok(())) => Work::pending(rank, rx),
            _ => {
                *lock(&w.pending.0) -= 1;
                Work::ready(Err(Error::Backend {
                    rank,
                    reason: "the communication thread has stopped".into(),
                }))
            }
        }
    }
}

fn bytes(b: &Buf<'_>) -> usize {
    b.len() * b.dtype().size_in_bytes()
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

    fn all_gather(&self, send: Buf<'_>, recv: BufMut<'_>) -> Result<()> {
        self.fence();
        self.record(OpKind::AllGather, bytes(&send) * self.size());
        kernels::all_gather(&self.group, self.rank, send, recv)
    }

    fn reduce_scatter(&self, send: Buf<'_>, recv: BufMut<'_>, op: ReduceOp) -> Result<()> {
        self.fence();
        self.record(OpKind::ReduceScatter, bytes(&send));
        kernels::reduce_scatter(&self.group, self.rank, send, recv, op)
    }

    fn all_reduce(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<()> {
        self.fence();
        self.record(OpKind::AllReduce, bytes(&buf.as_buf()));
        kernels::all_reduce(&self.group, self.rank, None, buf, op)
    }

    fn all_reduce_into(&self, send: Buf<'_>, recv: BufMut<'_>, op: ReduceOp) -> Result<()> {
        self.fence();
        self.record(OpKind::AllReduce, bytes(&send));
        kernels::all_reduce(&self.group, self.rank, Some(send), recv, op)
    }

    fn all_to_all(&self, send: Buf<'_>, recv: BufMut<'_>) -> Result<()> {
        self.fence();
        self.record(OpKind::AllToAll, bytes(&send));
        kernels::all_to_all(&self.group, self.rank, send, recv)
    }

    fn all_gather_v(&self, send: Buf<'_>, recv: BufMut<'_>, counts: &[usize]) -> Result<()> {
        self.fence();
        let total = counts.iter().fold(0usize, |a, &c| a.saturating_add(c));
        self.record(OpKind::AllGather, total.saturating_mul(send.dtype().size_in_bytes()));
        kernels::all_gather_v(&self.group, self.rank, send, recv, counts)
    }

    fn reduce_scatter_v(&self, send: Buf<'_>, recv: BufMut<'_>, counts: &[usize], op: ReduceOp) -> Result<()> {
        self.fence();
        self.record(OpKind::ReduceScatter, bytes(&send));
        kernels::reduce_scatter_v(&self.group, self.rank, send, recv, counts, op)
    }

    fn all_to_all_v(
        &self,
        send: Buf<'_>,
        send_counts: &[usize],
        recv: BufMut<'_>,
        recv_counts: &[usize],
    ) -> Result<()> {
        self.fence();
        // Exactly what leaves this rank: every segment but our own.
        let own = send_counts.get(self.rank).copied().unwrap_or(0);
        let off_rank = send_counts.iter().fold(0u64, |a, &c| a.saturating_add(c as u64)) - own as u64;
        let elem = send.dtype().size_in_bytes() as u64;
        self.stats.record_exact(OpKind::AllToAll, off_rank.saturating_mul(elem));
        kernels::all_to_all_v(&self.group, self.rank, send, send_counts, recv, recv_counts)
    }

    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<()> {
        self.fence();
        self.record(OpKind::Broadcast, bytes(&buf.as_buf()));
        kernels::broadcast(&self.group, self.rank, buf, root)
    }

    fn barrier(&self) -> Result<()> {
        self.fence();
        self.record(OpKind::Barrier, 0);
        kernels::barrier(&self.group, self.rank)
    }

    fn split(&self, color: u32, key: u32) -> Result<Box<dyn Communicator>> {
        self.fence();
        self.record(OpKind::Split, 0);
        let (group, rank) = super::split(&self.group, self.rank, color, key)?;
        Ok(Box::new(ThreadComm::new(group, rank)))
    }

    fn all_gather_async(&self, send: Buffer) -> Work {
        self.record(OpKind::AllGather, bytes(&send.as_buf()) * self.size());
        let n = self.size();
        self.submit(move |g, r| {
            let mut recv = Buffer::zeros(send.dtype(), send.len() * n);
            kernels::all_gather(g, r, send.as_buf(), recv.as_buf_mut()).map(|_| recv)
        })
    }

    fn reduce_scatter_async(&self, send: Buffer, op: ReduceOp) -> Work {
        self.record(OpKind::ReduceScatter, bytes(&send.as_buf()));
        let n = self.size();
        self.submit(move |g, r| {
            let mut recv = Buffer::zeros(send.dtype(), send.len() / n);
            kernels::reduce_scatter(g, r, send.as_buf(), recv.as_buf_mut(), op).map(|_| recv)
        })
    }

    fn all_reduce_async(&self, mut buf: Buffer, op: ReduceOp) -> Work {
        self.record(OpKind::AllReduce, bytes(&buf.as_buf()));
        self.submit(move |g, r| kernels::all_reduce(g, r, None, buf.as_buf_mut(), op).map(|_| buf))
    }

    fn all_to_all_async(&self, send: Buffer) -> Work {
        self.record(OpKind::AllToAll, bytes(&send.as_buf()));
        self.submit(move |g, r| {
            let mut recv = Buffer::zeros(send.dtype(), send.len());
            kernels::all_to_all(g, r, send.as_buf(), recv.as_buf_mut()).map(|_| recv)
        })
    }

    fn broadcast_async(&self, mut buf: Buffer, root: usize) -> Work {
        self.record(OpKind::Broadcast, bytes(&buf.as_buf()));
        self.submit(move |g, r| kernels::broadcast(g, r, buf.as_buf_mut(), root).map(|_| buf))
    }
}
