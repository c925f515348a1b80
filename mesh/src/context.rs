//! Which rank the current thread works for.
//!
//! With the threads backend every rank of a job is a thread of one process, so
//! per-rank bookkeeping (the tensor memory tracker, for one) cannot be global.
//! [`launch`](crate::launch) tags each rank thread (and its communication
//! threads) with a [`RankId`]; code anywhere in the stack reads it with
//! [`current_rank`]. Outside a launch (or in a process started by MPI) it is `None`,
//! meaning "this process is one rank".

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};

/// Identifies one rank of one job in this process.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RankId {
    /// A process-unique number for the job (each `launch` gets a new one).
    pub job: u64,
    /// The rank in the job's world.
    pub rank: usize,
}

thread_local! {
    static CURRENT: Cell<Option<RankId>> = const { Cell::new(None) };
}

static NEXT_JOB: AtomicU64 = AtomicU64::new(1);

/// A fresh job number, unique within this process.
pub(crate) fn next_job() -> u64 {
    NEXT_JOB.fetch_add(1, Ordering::Relaxed)
}

/// The rank the current thread works for, if it was started by a launcher.
pub fn current_rank() -> Option<RankId> {
    CURRENT.with(|c| c.get())
}

/// Runs `f` with the current thread tagged as working for `id`, then restores the
/// previous tag (also when `f` panics).
///
/// Launchers tag their rank threads themselves; this is for tests and for helper
/// threads that work on behalf of a rank (so that, for example, the tensors they
/// allocate are charged to that rank by the memory tracker).
///
/// ```
/// use tessera_mesh::context::{RankId, current_rank, scoped};
///
/// let id = RankId { job: 7, rank: 1 };
/// assert_eq!(scoped(id, current_rank), Some(id));
/// ```
pub fn scoped<R>(id: RankId, f: impl FnOnce() -> R) -> R {
    let _guard = enter(id);
    f()
}

/// Tags the current thread as working for `id` until the guard drops.
pub(crate) fn enter(id: RankId) -> RankGuard {
    let prev = CURRENT.with(|c| c.replace(Some(id)));
    RankGuard { prev }
}

/// Restores the previous tag on drop.
pub(crate) struct RankGuard {
    prev: Option<RankId>,
}

impl Drop for RankGuard {
    fn drop(&mut self) {
        CURRENT.with(|c| c.set(self.prev));
    }
}
