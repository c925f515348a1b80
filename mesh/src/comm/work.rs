//! [`Work`]: handles on asynchronous collectives.

use std::fmt;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::observe::RunLabel;
use crate::{Buffer, Element, Error, Result};

/// A handle on an asynchronous collective; [`wait`](Work::wait) returns its output.
///
/// Asynchronous collectives run in issue order per communicator. A blocking
/// collective issued after them waits for them first.
#[must_use = "an asynchronous collective must be waited on"]
pub struct Work {
    state: WorkState,
    /// When the collective was issued.
    issued: Instant,
    /// What its run is recorded as when waited for, while the rank records.
    label: Option<RunLabel>,
    /// Told `-1` when a thread starts blocking in [`wait`](Work::wait) on an
    /// unfinished collective and `+1` when it stops (the threads backend's
    /// activity record: a rank whose closure only waits on its own collectives
    /// is not progressing by itself).
    on_block: Option<BlockHook>,
}

/// See [`Work`]'s `on_block`.
pub(crate) type BlockHook = Box<dyn Fn(i64) + Send>;

enum WorkState {
    Ready(Result<Buffer>, Option<Ran>),
    Pending { rank: usize, rx: mpsc::Receiver<Finished> },
}

/// When a communication thread started and finished a collective.
pub(crate) type Ran = (Instant, Instant);

/// What a communication thread sends back: the collective's result and when
/// it ran.
pub(crate) struct Finished {
    pub(crate) result: Result<Buffer>,
    pub(crate) ran: Ran,
}

/// When an asynchronous collective ran and how long its caller waited for it
/// ([`Work::wait_timed`]): the measure of how much of its communication a
/// rank hid behind its own work.
///
/// PyTorch has no direct counterpart; its profiler's trace shows the same as
/// a collective's kernel on the communication stream beside the compute
/// stream's wait.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkTiming {
    /// When the collective was issued.
    pub issued: Instant,
    /// When the communication thread started and finished it; `None` when it
    /// completed as it was issued (a backend without a communication thread,
    /// or an issue that failed).
    pub ran: Option<(Instant, Instant)>,
    /// How long [`Work::wait_timed`] blocked: zero when the collective had
    /// finished before the caller asked for it. Includes the time it spent
    /// queued behind collectives issued before it.
    pub blocked: Duration,
}

impl WorkTiming {
    /// How long the collective ran on the communication thread (zero when it
    /// completed at issue).
    pub fn run(&self) -> Duration {
        self.ran
            .map_or(Duration::ZERO, |(start, end)| end.saturating_duration_since(start))
    }

    /// The part of the run the caller did not wait for: [`run`](Self::run)
    /// less [`blocked`](Self::blocked), at least zero.
    pub fn hidden(&self) -> Duration {
        self.run().saturating_sub(self.blocked)
    }
}

impl Work {
    /// A handle whose result is already known (what a blocking backend returns).
    pub fn ready(result: Result<Buffer>) -> Work {
        Work {
            state: WorkState::Ready(result, None),
            issued: Instant::now(),
            label: None,
            on_block: None,
        }
    }

    /// A handle on a result that `rank`'s communication thread will send.
    pub(crate) fn pending(rank: usize, rx: mpsc::Receiver<Finished>) -> Work {
        Work {
            state: WorkState::Pending { rank, rx },
            issued: Instant::now(),
            label: None,
            on_block: None,
        }
    }

    /// Records the collective's run under `label` when it is waited for
    /// (see [`observe::queued`](crate::observe)).
    pub(crate) fn labelled(mut self, label: Option<RunLabel>) -> Work {
        self.label = label;
        self
    }

    /// Calls `hook(-1)` when [`wait`](Work::wait) blocks and `hook(1)` when it
    /// returns.
    pub(crate) fn on_block(mut self, hook: BlockHook) -> Work {
        self.on_block = Some(hook);
        self
    }

    /// Whether the collective has finished (`wait` will not block).
    pub fn is_done(&mut self) -> bool {
        match &mut self.state {
            WorkState::Ready(..) => true,
            WorkState::Pending { rank, rx } => match rx.try_recv() {
                Ok(f) => {
                    self.state = WorkState::Ready(f.result, Some(f.ran));
                    true
                }
                Err(mpsc::TryRecvError::Empty) => false,
                Err(mpsc::TryRecvError::Disconnected) => {
                    self.state = WorkState::Ready(Err(disconnected(*rank)), None);
                    true
                }
            },
        }
    }

    /// Blocks until the collective finishes and returns its output buffer.
    ///
    /// # Errors
    /// Whatever the collective failed with (a peer failure, a timeout, a mismatch).
    pub fn wait(self) -> Result<Buffer> {
        self.wait_timed().0
    }

    /// [`wait`](Self::wait), also telling when the collective ran and how
    /// long this call blocked for it; a recording rank records the run on
    /// its communication track ([`What::CommRun`](crate::observe::What::CommRun)).
    pub fn wait_timed(self) -> (Result<Buffer>, WorkTiming) {
        let mut blocked = Duration::ZERO;
        let (result, ran) = match self.state {
            WorkState::Ready(r, ran) => (r, ran),
            WorkState::Pending { rank, rx } => match rx.try_recv() {
                Ok(f) => (f.result, Some(f.ran)),
                Err(mpsc::TryRecvError::Disconnected) => (Err(disconnected(rank)), None),
                Err(mpsc::TryRecvError::Empty) => {
                    let hook = self.on_block.as_ref();
                    hook.inspect(|h| h(-1));
                    let since = Instant::now();
                    let f = rx.recv();
                    blocked = since.elapsed();
                    hook.inspect(|h| h(1));
                    match f {
                        Ok(f) => (f.result, Some(f.ran)),
                        Err(_) => (Err(disconnected(rank)), None),
                    }
                }
            },
        };
        if let (Some(label), Some((start, end))) = (self.label, ran) {
            label.record(start, end, blocked);
        }
        let timing = WorkTiming {
            issued: self.issued,
            ran,
            blocked,
        };
        (result, timing)
    }

    /// Like [`wait`](Work::wait), then unwraps the output as a typed vector.
    ///
    /// # Errors
    /// As `wait`, or [`Error::Backend`] if the output has another dtype.
    pub fn wait_vec<T: Element>(self) -> Result<Vec<T>> {
        self.wait()?.into_vec::<T>().map_err(|b| Error::Backend {
            rank: usize::MAX,
            reason: format!("asynchronous output is {}, not {}", b.dtype(), T::DTYPE),
        })
    }
}

fn disconnected(rank: usize) -> Error {
    Error::Backend {
        rank,
        reason: "the communication thread exited before finishing the collective".into(),
    }
}

impl fmt::Debug for Work {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match &self.state {
            WorkState::Ready(Ok(_), _) => "done",
            WorkState::Ready(Err(_), _) => "failed",
            WorkState::Pending { .. } => "pending",
        };
        f.debug_struct("Work").field("state", &state).finish()
    }
}
