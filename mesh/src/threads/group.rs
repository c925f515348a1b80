//! Shared state of one in-process job (`World`) and of one process group (`Group`):
//! published call descriptors, an arrive/withdraw barrier, and the
//! poison flag that turns any failure into an error on every rank.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use smallvec::SmallVec;

use crate::stats::CommStats;
use crate::{DType, Error, OpKind, ReduceOp, Result};

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
}

/// A group made by `split`: (parent group, parent seq, color), the group, and how
/// many members have not picked it up yet.
pub(crate) type PendingSplit = ((u64, u64, u32), Arc<Group>, usize);

/// State shared by every rank and every group of one `launch`.
pub(crate) struct World {
    pub(crate) job: u64,
    pub(crate) timeout: Duration,
    poisoned: AtomicBool,
    poison: Mutex<Option<Poison>>,
    exited: Vec<AtomicBool>,
    pub(crate) stats: Vec<Arc<CommStats>>,
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
            poisoned: AtomicBool::new(false),
            poison: Mutex::new(None),
            exited: (0..size).map(|_| AtomicBool::new(false)).collect(),
            stats: (0..size).map(|_| Arc::new(CommStats::default())).collect(),
            next_group: AtomicU64::new(0),
            splits: Mutex::new(Vec::new()),
        })
    }

    pub(crate) fn next_group_id(&self) -> u64 {
        self.next_group.fetch_add(1, Ordering::Relaxed)
    }

    /// Records `rank`'s failure unless an earlier one is recorded; returns the first failure.
    pub(crate) fn poison(&self, rank: usize, reason: String) -> Poison {
        let mut p = lock(&self.poison);
        let first = p.get_or_insert(Poison { rank, reason }).clone();
        self.poisoned.store(true, Ordering::Release);
        first
    }

    pub(crate) fn first_failure(&self) -> Option<Poison> {
        if !self.poisoned.load(Ordering::Acquire) {
            return None;
        }
        lock(&self.poison).clone()
    }

    pub(crate) fn check(&self) -> Result<()> {
        match self.first_failure() {
            None => Ok(()),
            Some(p) => Err(Error::PeerFailed {
                rank: p.rank,
                reason: p.reason,
            }),
        }
    }

    pub(crate) fn mark_exited(&self, rank: usize) {
        self.exited[rank].store(true, Ordering::Release);
    }

    fn has_exited(&self, rank: usize) -> bool {
        self.exited[rank].load(Ordering::Acquire)
    }
}

/// What one rank asked a collective to do; published so peers can check it and
/// read the buffers it names.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Desc {
    pub(crate) kind: OpKind,
    pub(crate) seq: u64,
    pub(crate) dtype: DType,
    pub(crate) recv_dtype: DType,
    pub(crate) send_ptr: usize,
    pub(crate) send_len: usize,
    pub(crate) recv_ptr: usize,
    pub(crate) recv_len: usize,
    pub(crate) root: usize,
    pub(crate) reduce: Option<ReduceOp>,
    pub(crate) color: u32,
    pub(crate) key: u32,
    /// The variable-count form of `kind` (`all_gather_v`, ...): its counts are
    /// published beside the descriptor ([`Group::enter_v`]).
    pub(crate) v: bool,
}

impl Desc {
    pub(crate) fn new(kind: OpKind) -> Desc {
        Desc {
            kind,
            seq: 0,
            dtype: DType::U8,
            recv_dtype: DType::U8,
            send_ptr: 0,
            send_len: 0,
            recv_ptr: 0,
            recv_len: 0,
            root: 0,
            reduce: None,
            color: 0,
            key: 0,
            v: false,
        }
    }

    /// The collective's name (`"all_gather_v"` for the variable-count forms).
    pub(crate) fn name(&self) -> &'static str {
        if self.v {
            crate::comm::v_name(self.kind)
        } else {
            self.kind.name()
        }
    }
}

impl Default for Desc {
    fn default() -> Self {
        Desc::new(OpKind::Barrier)
    }
}

impl fmt::Display for Desc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (s, r, d) = (self.send_len, self.recv_len, self.dtype);
        match self.kind {
            OpKind::AllGather | OpKind::AllToAll => {
                write!(f, "{}(send {s} × {d}, recv {r} × {})", self.name(), self.recv_dtype)
            }
            OpKind::ReduceScatter => write!(
                f,
                "{}({}, send {s} × {d}, recv {r} × {})",
                self.name(),
                self.reduce.unwrap_or(ReduceOp::Sum),
                self.recv_dtype
            ),
            OpKind::AllReduce => write!(f, "all_reduce({}, {s} × {d})", self.reduce.unwrap_or(ReduceOp::Sum)),
            OpKind::Broadcast => write!(f, "broadcast(root {}, {s} × {d})", self.root),
            OpKind::Barrier => f.write_str("barrier()"),
            OpKind::Split => write!(f, "split(color {}, key {})", self.color, self.key),
        }
    }
}

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
    /// Barrier points each rank has reached (for naming the ranks a barrier waits for).
    phase: Vec<Padded<AtomicU64>>,
    /// Collectives each rank has entered.
    seqs: Vec<Padded<AtomicU64>>,
}

/// The descriptors of every rank for the collective being run.
pub(crate) type Descs = SmallVec<[Desc; 8]>;

/// The count arrays one rank passed to a variable-count collective (`recv` is
/// empty except for `all_to_all_v`).
#[derive(Clone, Debug, Default)]
pub(crate) struct Counts {
    pub(crate) send: Vec<usize>,
    pub(crate) recv: Vec<usize>,
}

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
            phase: (0..n).map(|_| Padded::default()).collect(),
            seqs: (0..n).map(|_| Padded::default()).collect(),
        })
    }

    pub(crate) fn size(&self) -> usize {
        self.members.len()
    }

    /// Publishes `desc` for group rank `r`, waits for every rank to publish, and
    /// checks that the calls agree (identically on every rank). On disagreement
    /// the job is poisoned and every rank returns the same error.
    pub(crate) fn enter(&self, r: usize, desc: Desc) -> Result<Descs> {
        self.enter_inner(r, desc, None).map(|(d, _)| d)
    }

    /// [`enter`](Self::enter) for a variable-count collective (`desc.v`): also
    /// publishes this rank's counts and returns every rank's counts, checked.
    pub(crate) fn enter_v(&self, r: usize, desc: Desc, send: &[usize], recv: &[usize]) -> Result<(Descs, Vec<Counts>)> {
        self.enter_inner(r, desc, Some((send, recv)))
    }

    fn enter_inner(
        &self,
        r: usize,
        mut desc: Desc,
        counts: Option<(&[usize], &[usize])>,
    ) -> Result<(Descs, Vec<Counts>)> {
        self.world.check()?;
        let seq = self.seqs[r].0.fetch_add(1, Ordering::Relaxed);
        let slot = (seq % 2) as usize;
        desc.seq = seq;
        if let Some((send, recv)) = counts {
            let mut c = lock(&self.counts[r][slot]);
            c.send.clear();
            c.send.extend_from_slice(send);
            c.recv.clear();
            c.recv.extend_from_slice(recv);
        }
        *lock(&self.slots[r][slot]) = desc;
        self.barrier(r, desc.name(), seq, true)?;
        let descs: Descs = self.slots.iter().map(|s| *lock(&s[slot])).collect();
        // Every rank's counts are current only if every rank called a variable-count
        // form; validation compares the descriptors first and looks at counts only then.
        let all: Vec<Counts> = if descs.iter().all(|d| d.v) {
            self.counts.iter().map(|c| lock(&c[slot]).clone()).collect()
        } else {
            Vec::new()
        };
        if let Err(e) = super::validate::validate(&descs, &all, &self.members) {
            self.world.poison(self.members[r], e.to_string());
            return Err(e);
        }
        Ok((descs, all))
    }

    /// The barrier after a collective's data phase: returns once every rank of the
    /// group has reached it. Every rank that passed the entry barrier is committed
    /// (peers may be reading its buffers), so a poisoned job does not release this
    /// wait; only a peer that has left its closure (it cannot be reading any more)
    /// or the timeout does. `op` names the collective in errors.
    pub(crate) fn sync(&self, r: usize, op: &'static str, seq: u64) -> Result<()> {
        self.barrier(r, op, seq, false)
    }

    /// Arrives at the barrier and waits. With `entry`, a failure elsewhere (poison, a
    /// peer that left, the timeout) withdraws this rank's arrival atomically and
    /// returns the error, unless the barrier completed first, in which case the rank
    /// is committed and carries on: no peer ever reads the buffers of a rank that
    /// has left.
    fn barrier(&self, r: usize, op: &'static str, seq: u64, entry: bool) -> Result<()> {
        let n = self.size() as u64;
        let my_phase = self.phase[r].0.fetch_add(1, Ordering::Release) + 1;
        let mut s = self.arrivals.0.load(Ordering::Acquire);
        let generation = loop {
            let (g, c) = (s >> 32, s & 0xffff_ffff);
            let next = if c + 1 == n { (g + 1) << 32 } else { s + 1 };
            match self
                .arrivals
                .0
                .compare_exchange_weak(s, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) if c + 1 == n => return Ok(()),
                Ok(_) => break g,
                Err(actual) => s = actual,
            }
        };
        let passed = || self.arrivals.0.load(Ordering::Acquire) >> 32 != generation;
        let start = Instant::now();
        let mut i: u32 = 0;
        loop {
            if passed() {
                return Ok(());
            }
            i = i.saturating_add(1);
            if i < 128 {
                std::hint::spin_loop();
                continue;
            }
            if i.is_multiple_of(16)
                && let Some((failure, blame)) = self.failure(my_phase, op, seq, entry, start.elapsed())
            {
                // A barrier that completed meanwhile commits this rank: carry on.
                if entry && !self.withdraw(generation) {
                    return Ok(());
                }
                if entry {
                    self.phase[r].0.fetch_sub(1, Ordering::Relaxed);
                }
                let failure = match blame {
                    Some((rank, reason)) => {
                        let first = self.world.poison(rank, reason);
                        match failure {
                            Error::Timeout { .. } => failure,
                            _ => Error::PeerFailed {
                                rank: first.rank,
                                reason: first.reason,
                            },
                        }
                    }
                    None => failure,
                };
                return Err(failure);
            }
            if start.elapsed() < Duration::from_millis(2) {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
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

    /// Why a rank waiting at a barrier should stop waiting, if it should: the job is
    /// poisoned (only at entry), a missing peer has left its closure, or the timeout
    /// passed. For the last two it also returns the failure to record (who, why),
    /// which the caller records only if it really leaves.
    fn failure(
        &self,
        my_phase: u64,
        op: &'static str,
        seq: u64,
        entry: bool,
        waited: Duration,
    ) -> Option<(Error, Option<(usize, String)>)> {
        if entry && let Err(e) = self.world.check() {
            return Some((e, None));
        }
        // Read `exited` before `phase`: a peer's arrival is ordered before its exit
        // (release/acquire on the flag), so a peer seen as exited and not arrived
        // really left without arriving.
        let exited: Vec<bool> = self.members.iter().map(|&w| self.world.has_exited(w)).collect();
        let missing: Vec<usize> = (0..self.size())
            .filter(|&q| self.phase[q].0.load(Ordering::Acquire) < my_phase)
            .collect();
        if let Some(&q) = missing.iter().find(|&&q| exited[q]) {
            let gone = self.members[q];
            let reason = format!("returned from its closure without entering {op} (collective #{seq} of its group)");
            return Some((
                Error::PeerFailed {
                    rank: gone,
                    reason: reason.clone(),
                },
                Some((gone, reason)),
            ));
        }
        if waited >= self.world.timeout && !missing.is_empty() {
            let missing: Vec<usize> = missing.iter().map(|&q| self.members[q]).collect();
            let reason = format!(
                "did not enter {op} (collective #{seq} of its group) within {:?}",
                self.world.timeout
            );
            return Some((
                Error::Timeout {
                    op,
                    seq,
                    missing: missing.clone(),
                    after: waited,
                },
                Some((missing[0], reason)),
            ));
        }
        None
    }
}
