//! Shared state of one in-process job: the poison flag that turns any failure into
//! an error on every rank, which ranks have left their closures, and what each
//! rank's threads are doing ([`Activity`]).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::activity::Activity;
use super::sync::lock;
use crate::stats::CommStats;
use crate::{Error, Result};

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

impl Poison {
    pub(crate) fn new(rank: usize, reason: String) -> Poison {
        Poison {
            rank,
            reason,
            deadlocked: Vec::new(),
        }
    }
}

/// State shared by every rank and every group of one `launch`.
pub(crate) struct World {
    pub(crate) job: u64,
    pub(crate) timeout: Duration,
    /// More ranks than the machine has cores: a waiting rank parks at once
    /// after its spin rather than yielding first.
    pub(crate) oversubscribed: bool,
    /// Collectives carry their call sites and tags, and tags are compared
    /// ([`LaunchOptions::fingerprints`](crate::LaunchOptions)).
    pub(crate) fingerprints: bool,
    /// Call sites must match too ([`LaunchOptions::strict_collectives`](crate::LaunchOptions::strict_collectives)).
    pub(crate) strict: bool,
    poisoned: AtomicBool,
    poison: Mutex<Option<Poison>>,
    exited: Vec<AtomicBool>,
    pub(crate) stats: Vec<Arc<CommStats>>,
    /// What each rank's threads are doing, for the cross-group mismatch check.
    pub(crate) activity: Activity,
    next_group: AtomicU64,
}

impl World {
    pub(crate) fn new(job: u64, size: usize, timeout: Duration, (fingerprints, strict): (bool, bool)) -> Arc<World> {
        Arc::new(World {
            job,
            timeout,
            fingerprints,
            strict: strict && fingerprints,
            oversubscribed: size > crate::intra_op::cores(),
            poisoned: AtomicBool::new(false),
            poison: Mutex::new(None),
            exited: (0..size).map(|_| AtomicBool::new(false)).collect(),
            stats: (0..size).map(|_| Arc::new(CommStats::default())).collect(),
            activity: Activity::new(size),
            next_group: AtomicU64::new(0),
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
