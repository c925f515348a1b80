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
//! collective is not an active agent while it blocks: its rank progresses only
//! through the queued collectives it waits for, each an agent of its own (active
//! from submission until it completes, except while it waits at an entry
//! barrier). So a rank whose closure waits on an asynchronous all-gather that
//! waits for a peer stuck elsewhere is found like a blocking one. When such a
//! collective completes, its agent ends before the closure thread wakes: for that
//! moment the rank has neither an active agent nor a wait, which makes it "not
//! stuck" (below), so the hand-over can never look like a deadlock. A queued
//! collective behind the one that waits still counts as active, so a mismatch
//! that only shows behind it is not found here; the timeout ends it. The check
//! never reports a job that could still progress.
//!
//! The state a check reads is versioned per rank, and a deadlock is declared only
//! when a second look, at least 10 ms later, finds the same ranks in the same
//! states (the same versions): a wait that completes or an agent that wakes
//! changes its rank's version. So the check never fires on a transient state.
//!
//! The same state tells a timeout whom to blame ([`Activity::blame`]): the peer a
//! rank timed out waiting for may itself wait, in a collective of another group,
//! for a third rank. The walk follows who waits for whom from the missing peers
//! to the nearest rank that waits in no collective (stalled in its own code, or
//! returned from its closure), and the rank's last collective ([`Last`]) says
//! what it was last doing.

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::sync::Mutex;
use std::time::{Duration, Instant};

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

/// A rank's waits, each with the members it was missing.
type Waits = Vec<(Wait, Vec<usize>)>;

/// One rank's state as one check saw it: version, active agents, and each wait
/// with the members it was missing.
type Snapshot = (u64, i64, Waits);

/// Every rank's agents, for the cross-group mismatch check, and the last
/// collective each entered, for naming what a stalled rank last did.
pub(crate) struct Activity {
    ranks: Vec<Mutex<RankState>>,
    last: Vec<Mutex<Last>>,
}

/// The last collective one rank (any of its threads) entered.
#[derive(Default)]
struct Last {
    /// `None` until the rank enters its first collective.
    desc: Option<Desc>,
    group: u64,
    /// The group's world ranks (kept in place: no allocation per collective).
    members: SmallVec<[usize; 8]>,
    entered: Option<Instant>,
    /// When it passed that collective's entry barrier; `None` while it waits
    /// there, or if it left it with an error.
    passed: Option<Instant>,
}

/// Whom a timeout blames: the rank that is not progressing, and the chain of
/// waits that leads to it from the peer the timed-out rank waited for.
pub(crate) struct Blame {
    /// The world rank that is not progressing.
    pub(crate) rank: usize,
    /// The waits from the missing peer to `rank`, nearest to the timed-out rank
    /// first; empty when `rank` is itself a missing peer.
    chain: Vec<Link>,
    /// What `rank` is doing ("it is outside any collective; ...").
    pub(crate) state: String,
}

/// One wait on the way to the blamed rank: `waiter` waits in `desc` on group
/// `group` (world ranks `members`) for `on`.
struct Link {
    waiter: usize,
    desc: Desc,
    group: u64,
    members: Vec<usize>,
    on: usize,
}

impl Blame {
    /// The chain in words ("rank 1 waits on rank 3 in ...; rank 3 waits on rank 0
    /// in ..."), empty when the blamed rank is a missing peer itself.
    pub(crate) fn chain(&self) -> String {
        let links: Vec<String> = self
            .chain
            .iter()
            .map(|l| {
                format!(
                    "rank {} waits on rank {} in {} (collective #{} of group {}, ranks {:?})",
                    l.waiter, l.on, l.desc, l.desc.seq, l.group, l.members
                )
            })
            .collect();
        links.join("; ")
    }

    /// The wait nearest to the blamed rank: (waiter, collective name, its seq,
    /// group, members), `None` when the blamed rank is a missing peer itself.
    pub(crate) fn nearest(&self) -> Option<(usize, &'static str, u64, u64, &[usize])> {
        self.chain
            .last()
            .map(|l| (l.waiter, l.desc.name(), l.desc.seq, l.group, &l.members[..]))
    }
}

/// Seconds, for messages.
fn secs(d: Duration) -> String {
    format!("{:.2} s", d.as_secs_f64())
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
            last: (0..size).map(|_| Mutex::new(Last::default())).collect(),
        }
    }

    /// `rank` enters the collective `desc` on group `group` (world ranks `members`).
    pub(crate) fn entering(&self, rank: usize, group: u64, members: &[usize], desc: &Desc) {
        let mut l = lock(&self.last[rank]);
        if l.desc.is_none() || l.group != group {
            l.group = group;
            l.members.clear();
            l.members.extend_from_slice(members);
        }
        l.desc = Some(*desc);
        l.entered = Some(Instant::now());
        l.passed = None;
    }

    /// `rank` has passed the entry barrier of the collective it last entered.
    pub(crate) fn passed(&self, rank: usize) {
        lock(&self.last[rank]).passed = Some(Instant::now());
    }

    /// What `rank` last did, in words ("last in all_gather(...) (collective #3 of
    /// group 2, ranks [0, 1]), entered 0.31 s ago and passed").
    fn last_words(&self, rank: usize) -> String {
        let l = lock(&self.last[rank]);
        let (Some(desc), Some(entered)) = (l.desc, l.entered) else {
            return "it has not entered any collective yet".to_string();
        };
        let outcome = match l.passed {
            Some(p) => format!("which it passed {} ago", secs(p.elapsed())),
            None => "and did not pass it".to_string(),
        };
        format!(
            "its last collective was {desc} (collective #{} of group {}, ranks {:?}), entered {} ago, {outcome}",
            desc.seq,
            l.group,
            &l.members[..],
            secs(entered.elapsed())
        )
    }

    /// The rank to blame when world rank `me` times out waiting for the world ranks
    /// `missing`: from them, follows the waits (each waiting rank to the members
    /// its waits miss) to the nearest rank that waits in no collective (`exited`
    /// says which ranks have returned from their closures). Failing that (every
    /// rank reached waits), the nearest rank with an agent not waiting (a closure
    /// busy while its asynchronous collectives wait). `None` if neither exists.
    pub(crate) fn blame(&self, me: usize, missing: &[usize], exited: impl Fn(usize) -> bool) -> Option<Blame> {
        let snap: Vec<(i64, Waits)> = self
            .ranks
            .iter()
            .map(|m| {
                let s = lock(m);
                (s.active, s.waits.iter().map(|w| (w.clone(), w.missing())).collect())
            })
            .collect();
        let n = snap.len();
        // How each reached rank was reached: `None` for a missing peer, else the
        // waiting rank and the index of its wait.
        let mut via: Vec<Option<Option<(usize, usize)>>> = vec![None; n];
        via[me] = Some(None);
        let mut order = Vec::new();
        let mut queue: VecDeque<usize> = VecDeque::new();
        for &q in missing.iter().filter(|&&q| q < n) {
            if via[q].is_none() {
                via[q] = Some(None);
                queue.push_back(q);
            }
        }
        while let Some(q) = queue.pop_front() {
            order.push(q);
            for (i, (_, miss)) in snap[q].1.iter().enumerate() {
                for &m in miss.iter().filter(|&&m| m < n) {
                    if via[m].is_none() {
                        via[m] = Some(Some((q, i)));
                        queue.push_back(m);
                    }
                }
            }
        }
        let idle = order.iter().copied().find(|&q| snap[q].1.is_empty());
        let busy = || order.iter().copied().find(|&q| snap[q].0 > 0);
        let rank = idle.or_else(busy)?;
        let mut chain = Vec::new();
        let mut at = rank;
        while let Some(Some((waiter, i))) = via[at] {
            let w = &snap[waiter].1[i].0;
            chain.push(Link {
                waiter,
                desc: w.desc,
                group: w.group,
                members: w.members.clone(),
                on: at,
            });
            at = waiter;
        }
        chain.reverse();
        let last = self.last_words(rank);
        let state = if exited(rank) {
            format!("it has returned from its closure ({last})")
        } else if idle.is_some() {
            format!("it is outside any collective ({last})")
        } else {
            let waits: Vec<String> = snap[rank]
                .1
                .iter()
                .map(|(w, miss)| format!("{} on group {} for rank(s) {miss:?}", w.desc, w.group))
                .collect();
            format!(
                "its own code runs outside any collective while its other threads wait in {} ({last})",
                waits.join(" and ")
            )
        };
        Some(Blame { rank, chain, state })
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};

    use super::*;
    use crate::OpKind;
    use crate::threads::sync::Padded;

    /// World rank `rank` waits at barrier point 1 of a group of the world ranks
    /// `members`, in which the ranks `missing` have not arrived; the group's id is
    /// its first member.
    fn wait(a: &Activity, rank: usize, members: &[usize], missing: &[usize]) {
        let phases: Phases = Arc::new(
            members
                .iter()
                .map(|m| Padded(AtomicU64::new(u64::from(!missing.contains(m)))))
                .collect(),
        );
        assert_eq!(
            phases[0].0.load(Ordering::Relaxed),
            u64::from(!missing.contains(&members[0]))
        );
        let mut desc = Desc::new(OpKind::AllGather);
        desc.seq = 7;
        a.begin_wait(rank, members[0] as u64, members, &phases, 1, desc);
    }

    #[test]
    fn the_walk_blames_the_nearest_rank_in_no_collective() {
        // (waits: rank, group members, missing), agents added per rank, exited ranks,
        // who times out and on whom => blamed rank, chain, words of its state.
        type Case = (
            &'static [(usize, &'static [usize], &'static [usize])],
            &'static [(usize, i64)],
            &'static [usize],
            usize,
            &'static [usize],
            Option<(usize, &'static str, &'static str)>,
        );
        let cases: &[Case] = &[
            // Rank 2 waits on rank 3, which waits on rank 1, which waits on stalled rank 0.
            (
                &[(2, &[2, 3], &[3]), (3, &[1, 3], &[1]), (1, &[0, 1], &[0])],
                &[],
                &[],
                2,
                &[3],
                Some((
                    0,
                    "rank 3 waits on rank 1 in all_gather(send 0 × u8, recv 0 × u8) (collective #7 of group 1, \
                     ranks [1, 3]); rank 1 waits on rank 0 in all_gather(send 0 × u8, recv 0 × u8) (collective #7 \
                     of group 0, ranks [0, 1])",
                    "it is outside any collective (it has not entered any collective yet)",
                )),
            ),
            // The missing peer is the stalled rank itself.
            (
                &[(2, &[0, 2], &[0]), (1, &[0, 1], &[0])],
                &[],
                &[],
                2,
                &[0],
                Some((0, "", "it is outside any collective")),
            ),
            // Two stalled ranks: the nearer one (a missing peer) is blamed.
            (
                &[(2, &[1, 2, 3], &[1, 3]), (1, &[0, 1], &[0])],
                &[],
                &[],
                2,
                &[1, 3],
                Some((3, "", "it is outside any collective")),
            ),
            // The chain ends at a rank that returned from its closure.
            (
                &[(2, &[1, 2], &[1]), (1, &[0, 1], &[0])],
                &[(0, -1)],
                &[0],
                2,
                &[1],
                Some((0, "rank 1 waits on rank 0", "it has returned from its closure")),
            ),
            // Everyone reached waits, and nobody has an agent outside a wait: no blame.
            (
                &[(2, &[0, 2], &[0]), (0, &[0, 1], &[1]), (1, &[0, 1], &[0])],
                &[],
                &[],
                2,
                &[0],
                None,
            ),
            // Rank 0's closure runs (an agent of its own) while its queued collective
            // waits on rank 1, which waits on rank 0: rank 0 is the one to look at.
            (
                &[(2, &[0, 2], &[0]), (0, &[0, 1], &[1]), (1, &[0, 1], &[0])],
                &[(0, 1)],
                &[],
                2,
                &[0],
                Some((
                    0,
                    "",
                    "its own code runs outside any collective while its other threads wait in all_gather",
                )),
            ),
        ];
        for (i, (waits, agents, exited, me, missing, want)) in cases.iter().enumerate() {
            let a = Activity::new(4);
            for &(rank, delta) in *agents {
                a.add(rank, delta);
            }
            for (rank, members, miss) in *waits {
                wait(&a, *rank, members, miss);
            }
            let got = a.blame(*me, missing, |r| exited.contains(&r));
            match (got, want) {
                (None, None) => {}
                (Some(b), Some((rank, chain, state))) => {
                    assert_eq!(b.rank, *rank, "case {i}");
                    assert!(b.chain().starts_with(chain), "case {i}: {}", b.chain());
                    assert_eq!(b.nearest().is_none(), chain.is_empty(), "case {i}");
                    assert!(b.state.starts_with(state), "case {i}: {}", b.state);
                }
                (got, want) => panic!("case {i}: got {:?}, want {want:?}", got.map(|b| b.rank)),
            }
        }
    }

    #[test]
    fn the_last_collective_is_named_with_its_group() {
        let a = Activity::new(2);
        assert_eq!(a.last_words(1), "it has not entered any collective yet");
        let mut d = Desc::new(OpKind::Barrier);
        d.seq = 4;
        a.entering(1, 9, &[0, 1], &d);
        let w = a.last_words(1);
        assert!(
            w.starts_with("its last collective was barrier() (collective #4 of group 9, ranks [0, 1]), entered ")
                && w.ends_with(" ago, and did not pass it"),
            "{w}"
        );
        a.passed(1);
        assert!(
            a.last_words(1).contains(" ago, which it passed "),
            "{}",
            a.last_words(1)
        );
    }
}
