//! One process group of a threads job: published call descriptors, and an
//! arrive/withdraw entry barrier before each collective's data phase and the
//! committed barrier points after it.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering, fence};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::activity::Deadlock;
use super::desc::{Counts, Desc, Descs};
use super::sync::{Padded, Phases, behind, lock};
use super::world::{Poison, World};
use crate::{Error, OpKind, Result};

/// One process group of a threads job.
pub(crate) struct Group {
    pub(crate) world: Arc<World>,
    pub(crate) id: u64,
    /// World rank of each group rank.
    pub(crate) members: Vec<usize>,
    /// Descriptor slots, double-buffered by sequence parity: a rank may publish
    /// collective k+1 while a slower peer still reads collective k.
    slots: Vec<[Mutex<Desc>; 2]>,
    /// Copies of the count arrays of variable-count collectives, double-buffered
    /// like `slots`. Copies (not pointers into the caller's arrays) so that
    /// validation never reads memory a rank that has already failed may release.
    counts: Vec<[Mutex<Counts>; 2]>,
    /// The barrier: generation (high 32 bits) and ranks arrived in it (low 32 bits),
    /// changed only by compare-and-swap, so arriving and withdrawing are totally ordered.
    arrivals: Padded<AtomicU64>,
    /// Barrier points each rank has reached (for naming the ranks a barrier waits
    /// for, and for the cross-group mismatch check, which holds a reference).
    phase: Phases,
    /// Collectives each rank has entered.
    seqs: Vec<Padded<AtomicU64>>,
    /// Where ranks past their spin sleep until the barrier completes.
    parking: Parking,
    /// Groups being made by `split` of this group (see [`split_group`](super::split::split_group)).
    pub(crate) splits: Mutex<Vec<PendingSplit>>,
}

/// A group being made by `split`: (this group's seq of the split, color), the new
/// group, and how many of its members have not picked it up yet.
pub(crate) type PendingSplit = ((u64, u32), Arc<Group>, usize);

/// Where a rank waiting at a barrier sleeps once its short spin is over, until
/// the arrival that completes the barrier wakes it: a waiting rank gives its core
/// to the ranks still working. With more ranks than cores a spinning (or
/// yielding) waiter takes time from the very rank it waits for.
#[derive(Default)]
struct Parking {
    lock: Mutex<()>,
    wake: Condvar,
    /// Threads inside [`sleep`](Self::sleep); the completing arrival takes the
    /// lock and notifies only when some are.
    sleepers: AtomicUsize,
}

impl Parking {
    /// Sleeps until woken or `limit` passes, unless `passed()` already holds.
    /// The caller rechecks what it waits for either way (a wake-up may be
    /// spurious, and the limit lets it check for failures).
    fn sleep(&self, passed: impl Fn() -> bool, limit: Duration) {
        let guard = lock(&self.lock);
        self.sleepers.fetch_add(1, Ordering::SeqCst);
        // Pairs with the fence in `wake`: either this load sees the completed
        // barrier, or `wake` sees this sleeper (and, taking the lock, notifies
        // only once this thread waits on the condvar).
        fence(Ordering::SeqCst);
        if !passed() {
            let _ = self.wake.wait_timeout(guard, limit).unwrap_or_else(|e| e.into_inner());
        }
        self.sleepers.fetch_sub(1, Ordering::SeqCst);
    }

    /// Wakes every sleeper; called after the barrier completed.
    fn wake(&self) {
        fence(Ordering::SeqCst);
        if self.sleepers.load(Ordering::SeqCst) > 0 {
            let _guard = lock(&self.lock);
            self.wake.notify_all();
        }
    }
}

/// How long a parked waiter sleeps before it looks again for failures (a poisoned
/// job, a peer that left, the timeout) even if nothing wakes it.
const PARK_LIMIT: Duration = Duration::from_millis(2);

/// How long a waiter yields its core before parking when the job has no more
/// ranks than the machine has cores (a collective's peers then usually arrive
/// within microseconds, sooner than a wake-up from a parked sleep).
const YIELD_FOR: Duration = Duration::from_micros(50);

impl Group {
    pub(crate) fn new(world: Arc<World>, members: Vec<usize>) -> Arc<Group> {
        let n = members.len();
        Arc::new(Group {
            id: world.next_group_id(),
            world,
            members,
            slots: (0..n).map(|_| Default::default()).collect(),
            counts: (0..n).map(|_| Default::default()).collect(),
            arrivals: Padded::default(),
            phase: Arc::new((0..n).map(|_| Padded::default()).collect()),
            seqs: (0..n).map(|_| Padded::default()).collect(),
            parking: Parking::default(),
            splits: Mutex::new(Vec::new()),
        })
    }

    pub(crate) fn size(&self) -> usize {
        self.members.len()
    }

    /// Publishes `desc` for group rank `r`, waits for every rank to publish, and
    /// checks that the calls agree (identically on every rank). On disagreement
    /// the job is poisoned and every rank returns the same error. On success the
    /// rank is committed: see [`Committed`].
    pub(crate) fn enter(&self, r: usize, desc: Desc) -> Result<(Descs, Committed<'_>)> {
        self.enter_inner(r, desc, None).map(|(d, _, c)| (d, c))
    }

    /// [`enter`](Self::enter) for a variable-count collective (`desc.v`): also
    /// publishes this rank's counts and returns every rank's counts, checked.
    pub(crate) fn enter_v(
        &self,
        r: usize,
        desc: Desc,
        send: &[usize],
        recv: &[usize],
    ) -> Result<(Descs, Vec<Counts>, Committed<'_>)> {
        self.enter_inner(r, desc, Some((send, recv)))
    }

    fn enter_inner(
        &self,
        r: usize,
        mut desc: Desc,
        counts: Option<(&[usize], &[usize])>,
    ) -> Result<(Descs, Vec<Counts>, Committed<'_>)> {
        self.world.check(self.members[r])?;
        let seq = self.seqs[r].0.fetch_add(1, Ordering::Relaxed);
        let slot = (seq % 2) as usize;
        desc.seq = seq;
        if self.world.fingerprints {
            desc.site = crate::callsite::issuing();
        }
        if let Some((send, recv)) = counts {
            let mut c = lock(&self.counts[r][slot]);
            c.send.clear();
            c.send.extend_from_slice(send);
            c.recv.clear();
            c.recv.extend_from_slice(recv);
        }
        *lock(&self.slots[r][slot]) = desc;
        self.entry_barrier(r, &desc)?;
        let descs: Descs = self.slots.iter().map(|s| *lock(&s[slot])).collect();
        // Every rank's counts are current only if every rank called a variable-count
        // form; validation compares the descriptors first and looks at counts only then.
        let all: Vec<Counts> = if descs.iter().all(|d| d.v) {
            self.counts.iter().map(|c| lock(&c[slot]).clone()).collect()
        } else {
            Vec::new()
        };
        if let Err(e) = super::validate::validate(&descs, &all, &self.members, self.world.strict) {
            self.world.poison(self.members[r], e.to_string());
            return Err(e);
        }
        let points = match desc.kind {
            OpKind::Barrier | OpKind::Split => 0,
            OpKind::AllReduce => 2,
            _ => 1,
        };
        Ok((descs, all, Committed { group: self, r, points }))
    }

    /// Arrives at the next barrier point; returns the generation to wait for, or
    /// `None` when this arrival completed the barrier.
    fn arrive(&self, r: usize) -> (u64, Option<u64>) {
        let n = self.size() as u64;
        let my_phase = self.phase[r].0.fetch_add(1, Ordering::Release) + 1;
        let mut s = self.arrivals.0.load(Ordering::Acquire);
        loop {
            let (g, c) = (s >> 32, s & 0xffff_ffff);
            let next = if c + 1 == n { (g + 1) << 32 } else { s + 1 };
            match self
                .arrivals
                .0
                .compare_exchange_weak(s, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) if c + 1 == n => {
                    self.parking.wake();
                    return (my_phase, None);
                }
                Ok(_) => return (my_phase, Some(g)),
                Err(actual) => s = actual,
            }
        }
    }

    fn passed(&self, generation: u64) -> bool {
        self.arrivals.0.load(Ordering::Acquire) >> 32 != generation
    }

    /// The barrier before a collective's data phase. A failure elsewhere (poison, a
    /// peer that left, a cross-group mismatch, the timeout) withdraws this rank's
    /// arrival atomically and returns the error, unless the barrier completed
    /// first, in which case the rank is committed and carries on: no peer ever
    /// reads the buffers of a rank that has left. The rank's last collective is
    /// recorded (entered, passed) for a timeout that blames it.
    fn entry_barrier(&self, r: usize, desc: &Desc) -> Result<()> {
        let me = self.members[r];
        self.world.activity.entering(me, self.id, &self.members, desc);
        let out = self.await_entry(r, desc);
        if out.is_ok() {
            self.world.activity.passed(me);
        }
        out
    }

    /// [`entry_barrier`](Self::entry_barrier)'s arrival and wait.
    fn await_entry(&self, r: usize, desc: &Desc) -> Result<()> {
        let me = self.members[r];
        let (my_phase, generation) = self.arrive(r);
        let Some(generation) = generation else {
            return Ok(());
        };
        let start = Instant::now();
        let mut wait: Option<WaitGuard<'_>> = None;
        let mut suspect: Option<Deadlock> = None;
        let mut next_check = Duration::from_millis(10);
        let mut i: u32 = 0;
        loop {
            if self.passed(generation) {
                return Ok(());
            }
            i = i.saturating_add(1);
            if i < 128 {
                std::hint::spin_loop();
                continue;
            }
            // Past the spin: this thread now only waits, which the cross-group
            // mismatch check must know.
            if wait.is_none() {
                wait = Some(WaitGuard {
                    world: &self.world,
                    rank: me,
                    token: self
                        .world
                        .activity
                        .begin_wait(me, self.id, &self.members, &self.phase, my_phase, *desc),
                });
            }
            if i.is_multiple_of(16) {
                let waited = start.elapsed();
                let mut failure = self.failure(r, my_phase, desc, waited);
                if failure.is_none() && waited >= next_check {
                    next_check = waited + Duration::from_millis(20);
                    failure = self.world.activity.confirm_deadlock(me, &mut suspect).map(|d| {
                        let blame = Poison {
                            rank: me,
                            reason: d.detail.clone(),
                            deadlocked: d.ranks(),
                        };
                        (Error::Mismatch { detail: d.detail }, Some(blame))
                    });
                }
                if let Some((failure, blame)) = failure {
                    // A barrier that completed meanwhile commits this rank: carry on.
                    if !self.withdraw(generation) {
                        return Ok(());
                    }
                    self.phase[r].0.fetch_sub(1, Ordering::Relaxed);
                    return Err(match blame {
                        Some(blame) => {
                            let first = self.world.poison_with(blame);
                            match failure {
                                Error::Timeout { .. } | Error::Mismatch { .. } => failure,
                                _ => Error::PeerFailed {
                                    rank: first.rank,
                                    reason: first.reason,
                                },
                            }
                        }
                        None => failure,
                    });
                }
            }
            self.wait(start, generation);
        }
    }

    /// One wait of a rank past its spin for the barrier of `generation`: a yield
    /// of its core for the first [`YIELD_FOR`] when every rank has a core of its
    /// own, otherwise a sleep until the barrier completes (or [`PARK_LIMIT`]).
    fn wait(&self, start: Instant, generation: u64) {
        if !self.world.oversubscribed && start.elapsed() < YIELD_FOR {
            std::thread::yield_now();
        } else {
            self.parking.sleep(|| self.passed(generation), PARK_LIMIT);
        }
    }

    /// Takes back this rank's arrival unless the barrier of `generation` has completed.
    fn withdraw(&self, generation: u64) -> bool {
        let mut s = self.arrivals.0.load(Ordering::Acquire);
        loop {
            if s >> 32 != generation {
                return false;
            }
            match self
                .arrivals
                .0
                .compare_exchange_weak(s, s - 1, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return true,
                Err(actual) => s = actual,
            }
        }
    }

    /// Why a rank waiting at an entry barrier should stop waiting, if it should:
    /// the job is poisoned, a missing peer has left its closure, or the timeout
    /// passed. For the last two it also returns the failure to record (who, why),
    /// which the caller records only if it really leaves.
    fn failure(&self, r: usize, my_phase: u64, desc: &Desc, waited: Duration) -> Option<(Error, Option<Poison>)> {
        let (op, seq) = (desc.name(), desc.seq);
        if let Err(e) = self.world.check(self.members[r]) {
            return Some((e, None));
        }
        // Read `exited` before `phase`: a peer's arrival is ordered before its exit
        // (release/acquire on the flag), so a peer seen as exited and not arrived
        // really left without arriving.
        let exited: Vec<bool> = self.members.iter().map(|&w| self.world.has_exited(w)).collect();
        let missing: Vec<usize> = behind(&self.phase, my_phase).collect();
        if let Some(&q) = missing.iter().find(|&&q| exited[q]) {
            let gone = self.members[q];
            let reason = format!("returned from its closure without entering {op} (collective #{seq} of its group)");
            return Some((
                Error::PeerFailed {
                    rank: gone,
                    reason: reason.clone(),
                },
                Some(Poison::new(gone, reason)),
            ));
        }
        if waited >= self.world.timeout && !missing.is_empty() {
            return Some(self.timeout(r, desc, &missing, waited));
        }
        None
    }

    /// The timeout of group rank `r` in `desc` after `waited`, `missing` (group
    /// ranks) not having arrived: blames the rank that is not progressing, found by
    /// following who waits for whom across groups from the missing peers
    /// ([`Activity::blame`](super::activity::Activity::blame)), or the first
    /// missing peer if every rank reached waits for another.
    fn timeout(&self, r: usize, desc: &Desc, missing: &[usize], waited: Duration) -> (Error, Option<Poison>) {
        let (op, seq, me, timeout) = (desc.name(), desc.seq, self.members[r], self.world.timeout);
        let missing: Vec<usize> = missing.iter().map(|&q| self.members[q]).collect();
        let blame = self.world.activity.blame(me, &missing, |w| self.world.has_exited(w));
        // A rank that gave up its wait (and so looks stalled to the walk) first
        // poisoned the job; its failure is the one to report.
        if let Err(e) = self.world.check(me) {
            return (e, None);
        }
        let direct = format!("did not enter {op} (collective #{seq} of its group) within {timeout:?}");
        let (stalled, detail, reason) = match blame {
            Some(b) => match b.nearest() {
                None => (
                    b.rank,
                    format!("it never arrived; {}", b.state),
                    format!("{direct}; {}", b.state),
                ),
                Some((waiter, name, k, group, members)) => {
                    let reason = format!(
                        "did not enter {name} (collective #{k} of group {group}, ranks {members:?}), where rank \
                         {waiter} waits for it; rank {me} timed out after {timeout:?} in {op} (collective #{seq} \
                         of its group) waiting on rank(s) {missing:?}: {}; {}",
                        b.chain(),
                        b.state
                    );
                    (b.rank, format!("{}; {}", b.chain(), b.state), reason)
                }
            },
            None => (
                missing[0],
                "it never arrived (every rank it leads to waits in a collective)".to_string(),
                direct,
            ),
        };
        (
            Error::Timeout {
                op,
                seq,
                missing,
                after: waited,
                stalled,
                detail,
            },
            Some(Poison::new(stalled, reason)),
        )
    }
}

/// Ends a registered wait when dropped.
struct WaitGuard<'w> {
    world: &'w World,
    rank: usize,
    token: u64,
}

impl Drop for WaitGuard<'_> {
    fn drop(&mut self) {
        self.world.activity.end_wait(self.rank, self.token);
    }
}

/// A rank inside a collective's data phase, having passed its entry barrier:
/// peers may be reading its buffers and it theirs. It leaves only through the
/// collective's barrier points, every one of them, each waiting until every rank
/// of the group has reached it, also when this rank unwinds: a committed rank
/// never fails or times out there, because every committed peer only copies and
/// reduces in memory until it arrives. So no buffer is released while any thread
/// (a peer, or a peer's communication thread) can still read it.
#[must_use = "a committed rank must pass its barrier points"]
pub(crate) struct Committed<'g> {
    group: &'g Group,
    r: usize,
    points: u32,
}

impl Committed<'_> {
    /// Waits at the next barrier point of the collective, after ordering this
    /// rank's streaming stores before its arrival
    /// ([`order_streamed_stores`](super::store::order_streamed_stores)), so that
    /// peers past the point read all it wrote.
    pub(crate) fn sync(&mut self) {
        if self.points == 0 {
            return;
        }
        self.points -= 1;
        super::store::order_streamed_stores();
        let (_, generation) = self.group.arrive(self.r);
        if let Some(generation) = generation {
            let start = Instant::now();
            let mut i: u32 = 0;
            while !self.group.passed(generation) {
                i = i.saturating_add(1);
                if i < 128 {
                    std::hint::spin_loop();
                } else {
                    self.group.wait(start, generation);
                }
            }
        }
    }

    /// Passes the remaining barrier points: the collective is complete on every rank.
    pub(crate) fn finish(mut self) -> Result<()> {
        while self.points > 0 {
            self.sync();
        }
        Ok(())
    }
}

impl Drop for Committed<'_> {
    fn drop(&mut self) {
        while self.points > 0 {
            self.sync();
        }
    }
}
