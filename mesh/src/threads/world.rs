//! Shared state of one in-process job: the poison flag that turns any failure into
//! an error on every rank, which ranks have left their closures, and what each
//! rank's threads are doing ([`Activity`]).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use super::activity::Activity;
use super::group::Group;
use crate::stats::CommStats;
use crate::{Error, Result};

/// Pads a value to its own cache line pair, so ranks spinning on neighbours' counters
/// do not share lines.
#[repr(align(128))]
#[derive(Default)]
pub(crate) struct Padded<T>(pub(crate) T);

/// Who failed first, and why.
#[derive(Clone, Debug)]
pub(crate) struct Poison {
    pub(crate) rank: usize,
    pub(crate) reason: String,
    /// Set when the failure is ranks waiting for each other in collectives of
    /// different groups: those ranks (world ranks), each of which gets
    /// [`Error::Mismatch`] with `reason` as its detail.
    pub(crate) deadlocked: Vec<usize>,
}

/// Barrier points each member of a group has reached.
pub(crate) type Phases = Arc<Vec<Padded<AtomicU64>>>;

/// The group ranks that have not reached barrier point `phase`.
pub(crate) fn behind(phases: &[Padded<AtomicU64>], phase: u64) -> impl Iterator<Item = usize> + '_ {
    (0..phases.len()).filter(move |&q| phases[q].0.load(Ordering::Acquire) < phase)
}

impl Poison {
    pub(crate) fn new(rank: usize, reason: String) -> Poison {
        Poison {
            rank,
            reason,
            deadlocked: Vec::new(),
        }
    }
}

/// A group made by `split`: (parent group, parent seq, color), the group, and how
/// many members have not picked it up yet.
pub(crate) type PendingSplit = ((u64, u64, u32), Arc<Group>, usize);

/// State shared by every rank and every group of one `launch`.
pub(crate) struct World {
    pub(crate) job: u64,
    pub(crate) timeout: Duration,
    /// More ranks than the machine has cores: a waiting rank parks at once
    /// after its spin rather than yielding first.
    pub(crate) oversubscribed: bool,
    poisoned: AtomicBool,
    poison: Mutex<Option<Poison>>,
    exited: Vec<AtomicBool>,
    pub(crate) stats: Vec<Arc<CommStats>>,
    /// What each rank's threads are doing, for the cross-group mismatch check.
    pub(crate) activity: Activity,
    next_group: AtomicU64,
    /// Groups being created by `split`, keyed by (parent group, parent seq, color),
    /// with the number of members that have not picked theirs up yet.
    pub(crate) splits: Mutex<Vec<PendingSplit>>,
}

/// Locks a mutex, recovering the data if a panicking thread poisoned it: every
/// value guarded here stays consistent across a panic (plain data, written whole).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl World {
    pub(crate) fn new(job: u64, size: usize, timeout: Duration) -> Arc<World> {
        Arc::new(World {
            job,
            timeout,
            oversubscribed: size > crate::intra_op::cores(),
            poisoned: AtomicBool::new(false),
            poison: Mutex::new(None),
            exited: (0..size).map(|_| AtomicBool::new(false)).collect(),
            stats: (0..size).map(|_| Arc::new(CommStats::default())).collect(),
            activity: Activity::new(size),
            next_group: AtomicU64::new(0),
            splits: Mutex::new(Vec::new()),
        })
    }

    pub(crate) fn next_group_id(&self) -> u64 {
        self.next_group.fetch_add(1, Ordering::Relaxed)
    }

    /// Records `rank`'s failure unless an earlier one is recorded; returns the first failure.
    pub(crate) fn poison(&self, rank: usize, reason: String) -> Poison {
        self.poison_with(Poison::new(rank, reason))
    }

    /// Records `p` unless an earlier failure is recorded; returns the first failure.
    pub(crate) fn poison_with(&self, p: Poison) -> Poison {
        let mut slot = lock(&self.poison);
        let first = slot.get_or_insert(p).clone();
        self.poisoned.store(true, Ordering::Release);
        first
    }

    pub(crate) fn first_failure(&self) -> Option<Poison> {
        if !self.poisoned.load(Ordering::Acquire) {
            return None;
        }
        lock(&self.poison).clone()
    }

    /// The error a collective of world rank `me` returns once the job is poisoned:
    /// the mismatch itself for a rank caught in a cross-group mismatch, otherwise
    /// the first failure.
    pub(crate) fn check(&self, me: usize) -> Result<()> {
        match self.first_failure() {
            None => Ok(()),
            Some(p) if p.deadlocked.contains(&me) => Err(Error::Mismatch { detail: p.reason }),
            Some(p) => Err(Error::PeerFailed {
                rank: p.rank,
                reason: p.reason,
            }),
        }
    }

    /// `rank` has returned from its closure: its thread enters no more collectives.
    pub(crate) fn mark_exited(&self, rank: usize) {
        self.exited[rank].store(true, Ordering::Release);
        self.activity.add(rank, -1);
    }

    pub(crate) fn has_exited(&self, rank: usize) -> bool {
        self.exited[rank].load(Ordering::Acquire)
    }
}
