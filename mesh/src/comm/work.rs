//! [`Work`]: handles on asynchronous collectives.

use std::fmt;
use std::sync::mpsc;

use crate::{Buffer, Element, Error, Result};

/// A handle on an asynchronous collective; [`wait`](Work::wait) returns its output.
///
/// Asynchronous collectives run in issue order per communicator. A blocking
/// collective issued after them waits for them first.
#[must_use = "an asynchronous collective must be waited on"]
pub struct Work {
    state: WorkState,
    /// Told `-1` when a thread starts blocking in [`wait`](Work::wait) on an
    /// unfinished collective and `+1` when it stops (the threads backend's
    /// activity record: a rank whose closure only waits on its own collectives
    /// is not progressing by itself).
    on_block: Option<BlockHook>,
}

/// See [`Work`]'s `on_block`.
pub(crate) type BlockHook = Box<dyn Fn(i64) + Send>;

enum WorkState {
    Ready(Result<Buffer>),
    Pending {
        rank: usize,
        rx: mpsc::Receiver<Result<Buffer>>,
    },
}

impl Work {
    /// A handle whose result is already known (what a blocking backend returns).
    pub fn ready(result: Result<Buffer>) -> Work {
        Work {
            state: WorkState::Ready(result),
            on_block: None,
        }
    }

    /// A handle on a result that `rank`'s communication thread will send.
    pub fn pending(rank: usize, rx: mpsc::Receiver<Result<Buffer>>) -> Work {
        Work {
            state: WorkState::Pending { rank, rx },
            on_block: None,
        }
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
            WorkState::Ready(_) => true,
            WorkState::Pending { rank, rx } => match rx.try_recv() {
                Ok(r) => {
                    self.state = WorkState::Ready(r);
                    true
                }
                Err(mpsc::TryRecvError::Empty) => false,
                Err(mpsc::TryRecvError::Disconnected) => {
                    self.state = WorkState::Ready(Err(disconnected(*rank)));
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
        match self.state {
            WorkState::Ready(r) => r,
            WorkState::Pending { rank, rx } => match rx.try_recv() {
                Ok(r) => r,
                Err(mpsc::TryRecvError::Disconnected) => Err(disconnected(rank)),
                Err(mpsc::TryRecvError::Empty) => {
                    let hook = self.on_block.as_ref();
                    hook.inspect(|h| h(-1));
                    let r = rx.recv().unwrap_or_else(|_| Err(disconnected(rank)));
                    hook.inspect(|h| h(1));
                    r
                }
            },
        }
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
            WorkState::Ready(Ok(_)) => "done",
            WorkState::Ready(Err(_)) => "failed",
            WorkState::Pending { .. } => "pending",
        };
        f.debug_struct("Work").field("state", &state).finish()
    }
}
