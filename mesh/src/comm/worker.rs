//! The communication thread of one communicator: runs its asynchronous
//! collectives in issue order, so they overlap the caller's compute.

use std::cell::RefCell;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, mpsc};
use std::thread::JoinHandle;

use super::work::Finished;
use crate::context::{self, RankId};
use crate::{Buffer, Error, Result, Work};

type Job = Box<dyn FnOnce() + Send>;

/// Jobs issued and not finished, and a condvar signalled when the count drops to zero.
type Pending = Arc<(Mutex<usize>, Condvar)>;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Decrements the pending count and wakes `fence` when dropped.
struct Done(Pending);

impl Drop for Done {
    fn drop(&mut self) {
        let (count, cv) = &*self.0;
        *lock(count) -= 1;
        cv.notify_all();
    }
}

/// A started communication thread.
struct Thread {
    tx: Option<mpsc::Sender<Job>>,
    handle: Option<JoinHandle<()>>,
    pending: Pending,
}

impl Drop for Thread {
    fn drop(&mut self) {
        // Closing the channel ends the thread once queued jobs are done; every job
        // ends (collectives fail, time out or see the poison), so the join is bounded.
        self.tx.take();
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// The communication thread of one communicator, started on first asynchronous use.
pub(crate) struct Worker {
    thread: RefCell<Option<Thread>>,
    /// The communicator's rank (errors name it).
    rank: usize,
    /// The thread's name, and the rank it works for (tagged with [`context::enter`]).
    name: String,
    tag: Option<RankId>,
}

impl Worker {
    /// A worker for `rank` of a communicator; `tag` is the rank the thread works for
    /// (threads backend), `None` when the process is one rank (MPI).
    pub(crate) fn new(rank: usize, name: String, tag: Option<RankId>) -> Worker {
        Worker {
            thread: RefCell::new(None),
            rank,
            name,
            tag,
        }
    }

    /// Blocks until every issued job has finished, so that a blocking collective
    /// issued next runs after them.
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    pub(crate) fn fence(&self) {
        self.fence_with(|_| {});
    }

    /// [`fence`](Self::fence), calling `on_block(-1)` before blocking (jobs are
    /// still queued or running) and `on_block(1)` after.
    pub(crate) fn fence_with(&self, on_block: impl Fn(i64)) {
        if let Some(t) = self.thread.borrow().as_ref() {
            let (count, cv) = &*t.pending;
            let mut c = lock(count);
            if *c > 0 {
                on_block(-1);
                while *c > 0 {
                    c = cv.wait(c).unwrap_or_else(|e| e.into_inner());
                }
                on_block(1);
            }
        }
    }

    /// Ends the thread once its queue is empty and returns true; with jobs still
    /// queued or running, detaches it instead (it ends when they do) and returns
    /// false, so that a failing rank does not wait here for peers that may never come.
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    pub(crate) fn stop_or_detach(&self) -> bool {
        let Some(mut t) = self.thread.borrow_mut().take() else {
            return true;
        };
        if *lock(&t.pending.0) == 0 {
            drop(t);
            return true;
        }
        t.tx.take();
        t.handle.take();
        false
    }

    fn start(&self) -> Result<Thread> {
        let (tx, rx) = mpsc::channel::<Job>();
        let tag = self.tag;
        let handle = std::thread::Builder::new()
            .name(self.name.clone())
            .spawn(move || {
                let _tag = tag.map(context::enter);
                for job in rx {
                    job();
                }
            })
            .map_err(|e| Error::Backend {
                rank: self.rank,
                reason: format!("cannot start the communication thread: {e}"),
            })?;
        Ok(Thread {
            tx: Some(tx),
            handle: Some(handle),
            pending: Arc::new((Mutex::new(0), Condvar::new())),
        })
    }

    /// Queues `f` (a collective on owned buffers) on the communication thread.
    pub(crate) fn submit(&self, f: impl FnOnce() -> Result<Buffer> + Send + 'static) -> Work {
        let mut slot = self.thread.borrow_mut();
        if slot.is_none() {
            match self.start() {
                Ok(t) => *slot = Some(t),
                Err(e) => return Work::ready(Err(e)),
            }
        }
        // INVARIANT: the slot was filled just above.
        let t = slot.as_ref().expect("communication thread started");
        let (tx, rx) = mpsc::channel();
        let pending = t.pending.clone();
        *lock(&pending.0) += 1;
        let job: Job = Box::new(move || {
            // Counts the job as done even if `f` panics, so `fence` never waits forever.
            let _done = Done(pending);
            let start = std::time::Instant::now();
            let result = f();
            let ran = (start, std::time::Instant::now());
            // The receiver may be gone (the handle was dropped unwaited): nothing to do then.
            let _ = tx.send(Finished { result, ran });
        });
        match t.tx.as_ref().map(|tx| tx.send(job)) {
            Some(Ok(())) => Work::pending(self.rank, rx),
            _ => {
                *lock(&t.pending.0) -= 1;
                Work::ready(Err(Error::Backend {
                    rank: self.rank,
                    reason: "the communication thread has stopped".into(),
                }))
            }
        }
    }
}
