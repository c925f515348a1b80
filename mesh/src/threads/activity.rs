//! What each rank's threads are doing, and the check that finds ranks waiting for
//! each other in collectives of different groups.
//!
//! Rank 0 calling `all_gather` on one group while rank 1 calls `barrier` on
//! another group that also holds rank 0 is a cross-group mismatch: each waits at
//! an entry barrier for the other, and neither can ever proceed. The per-group
//! descriptor check cannot see it (each group sees only its own calls), so
//! without this check only the timeout would end it, blaming whichever rank it
//! happened to wait for.
//!
//! The check works on *agents*: a rank's closure thread (until it returns) and
//! each asynchronous collective queued on one of its communication threads (from
//! submission to completion). An agent is active unless it waits at an entry
//! barrier; only active agents can make a rank arrive anywhere. A rank with no
//! active agent progresses only when one of its waits completes, and a wait
//! completes only when every missing member arrives. The ranks that can never
//! progress are what is left after repeatedly adding, to the set of ranks with an
//! active agent, every rank one of whose waits misses only ranks of the set: if
//! such a stuck rank waits only for stuck ranks, the wait is a deadlock.
//!
//! A closure thread blocked in `Work::wait` or in the fence before a blocking
//! collective counts as active (it wakes when its own collectives complete, and
//! counting it idle would race with that hand-over), as does every queued
//! collective behind one that waits. So a mismatch that only shows through such a
//! wait is not found here; the timeout still ends it. The check never reports a
//! job that could still progress.
//!
//! The state a check reads is versioned per rank, and a deadlock is declared only
//! when a second look, at least 10 ms later, finds the same ranks in the same
//! states (the same versions): a wait that completes or an agent that wakes
//! changes its rank's version. So the check never fires on a transient state.

use std::fmt::Write as _;
use std::sync::Mutex;

use smallvec::SmallVec;

use super::desc::Desc;
use super::sync::{Phases, behind, lock};

/// One agent waiting at an entry barrier.
#[derive(Clone)]
struct Wait {
    token: u64,
    group: u64,
    members: Vec<usize>,
    phases: Phases,
    /// The barrier point the agent waits at.
    phase: u64,
    desc: Desc,
}

impl Wait {
    /// World ranks of the members that have not reached the barrier point.
    fn missing(&self) -> Vec<usize> {
        behind(&self.phases, self.phase).map(|q| self.members[q]).collect()
    }
}

#[derive(Default)]
struct RankState {
    /// Bumped on every change below.
    version: u64,
    /// Agents of the rank that are not waiting at an entry barrier.
    active: i64,
    waits: SmallVec<[Wait; 2]>,
    next_token: u64,
}

/// One rank's state as one check saw it: version, active agents, and each wait
/// with the members it was missing.
type Snapshot = (u64, i64, Vec<(Wait, Vec<usize>)>);

/// Every rank's agents, for the cross-group mismatch check.
pub(crate) struct Activity {
    ranks: Vec<Mutex<RankState>>,
}

/// Ranks found waiting for each other: what to tell them.
pub(crate) struct Deadlock {
    /// (world rank, version of its state when found).
    seen: Vec<(usize, u64)>,
    /// What each of them waits in and for.
    pub(crate) detail: String,
}

impl Deadlock {
    /// The world ranks caught in it.
    pub(crate) fn ranks(&self) -> Vec<usize> {
        self.seen.iter().map(|&(r, _)| r).collect()
    }
}

impl Activity {
    /// Every rank starts with one active agent: its closure's thread.
    pub(crate) fn new(size: usize) -> Activity {
        Activity {
            ranks: (0..size)
                .map(|_| {
                    Mutex::new(RankState {
                        active: 1,
                        ..RankState::default()
                    })
                })
                .collect(),
        }
    }

    /// An agent of `rank` starts (+1: an asynchronous collective was queued) or
    /// ends (-1: it completed, or the closure returned).
    pub(crate) fn add(&self, rank: usize, delta: i64) {
        let mut s = lock(&self.ranks[rank]);
        s.active += delta;
        s.version += 1;
    }

    /// An agent of `rank` waits at barrier point `phase` of group `group` (whose
    /// members are the world ranks `members`, with barrier points `phases`) in the
    /// collective `desc`; returns the token that ends the wait.
    pub(crate) fn begin_wait(
        &self,
        rank: usize,
        group: u64,
        members: &[usize],
        phases: &Phases,
        phase: u64,
        desc: Desc,
    ) -> u64 {
        let mut s = lock(&self.ranks[rank]);
        let token = s.next_token;
        s.next_token += 1;
        s.waits.push(Wait {
            token,
            group,
            members: members.to_vec(),
            phases: phases.clone(),
            phase,
            desc,
        });
        s.active -= 1;
        s.version += 1;
        token
    }

    /// The wait of `token` has ended (the barrier completed or the agent gave up).
    pub(crate) fn end_wait(&self, rank: usize, token: u64) {
        let mut s = lock(&self.ranks[rank]);
        s.waits.retain(|w| w.token != token);
        s.active += 1;
        s.version += 1;
    }

    /// Looks for a deadlock that holds world rank `me`. The first finding is kept
    /// in `suspect`; a later call that finds the same ranks with unchanged states
    /// confirms and returns it.
    pub(crate) fn confirm_deadlock(&self, me: usize, suspect: &mut Option<Deadlock>) -> Option<Deadlock> {
        let found = self.find(me);
        let confirmed = match (&found, suspect.as_ref()) {
            (Some(now), Some(before)) => now.seen == before.seen,
            _ => false,
        };
        if confirmed {
            return found;
        }
        *suspect = found;
        None
    }

    /// One look at every rank's state: the ranks, `me` among them, that wait only
    /// for each other.
    fn find(&self, me: usize) -> Option<Deadlock> {
        let snap: Vec<Snapshot> = self
            .ranks
            .iter()
            .map(|m| {
                let s = lock(m);
                let waits = s.waits.iter().map(|w| (w.clone(), w.missing())).collect();
                (s.version, s.active, waits)
            })
            .collect();
        let n = snap.len();
        // Ranks that can progress: an active agent, or a wait whose missing members
        // can all progress.
        let mut progress: Vec<bool> = snap.iter().map(|(_, active, _)| *active > 0).collect();
        loop {
            let more: Vec<usize> = (0..n)
                .filter(|&m| !progress[m] && snap[m].2.iter().any(|(_, miss)| miss.iter().all(|&q| progress[q])))
                .collect();
            if more.is_empty() {
                break;
            }
            more.into_iter().for_each(|m| progress[m] = true);
        }
        // Stuck ranks that wait only for stuck ranks that also wait. A missing rank
        // with no wait and no active agent has left its closure: the entry barrier
        // reports that itself.
        let mut stuck: Vec<bool> = (0..n).map(|m| !progress[m] && !snap[m].2.is_empty()).collect();
        loop {
            let drop: Vec<usize> = (0..n)
                .filter(|&m| stuck[m] && snap[m].2.iter().any(|(_, miss)| !miss.iter().any(|&q| stuck[q])))
                .collect();
            if drop.is_empty() {
                break;
            }
            drop.into_iter().for_each(|m| stuck[m] = false);
        }
        if !stuck.get(me).copied().unwrap_or(false) {
            return None;
        }
        let mut detail = String::from("ranks wait for each other in collectives of different groups: ");
        let mut seen = Vec::new();
        for m in (0..n).filter(|&m| stuck[m]) {
            seen.push((m, snap[m].0));
            for (w, miss) in &snap[m].2 {
                let _ = write!(
                    detail,
                    "rank {m} called {} on group {} (ranks {:?}; collective #{} of that group) and waits there for rank(s) {:?}; ",
                    w.desc, w.group, w.members, w.desc.seq, miss
                );
            }
        }
        detail.push_str(
            "none of them can proceed. Every rank must call the collectives of each group in the same order \
             (a rank that skips a collective on one communicator, or issues them in another order across \
             communicators, deadlocks)",
        );
        Some(Deadlock { seen, detail })
    }
}
