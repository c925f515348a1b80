//! Shared state of one in-process job (`World`) and of one process group (`Group`):
//! published call descriptors, per-rank phase counters used as a barrier, and the
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
                write!(f, "{}(send {s} × {d}, recv {r} × {})", self.kind, self.recv_dtype)
            }
            OpKind::ReduceScatter => write!(
                f,
                "reduce_scatter({}, send {s} × {d}, recv {r} × {})",
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
    /// Barrier points each rank has passed.
    phase: Vec<Padded<AtomicU64>>,
    /// Collectives each rank has entered.
    seqs: Vec<Padded<AtomicU64>>,
}

/// The descriptors of every rank for the collective being run.
pub(crate) type Descs = SmallVec<[Desc; 8]>;

impl Group {
    pub(crate) fn new(world: Arc<World>, members: Vec<usize>) -> Arc<Group> {
        let n = members.len();
        Arc::new(Group {
            id: world.next_group_id(),
            world,
            members,
            slots: (0..n).map(|_| Default::default()).collect(),
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
    pub(crate) fn enter(&self, r: usize, mut desc: Desc) -> Result<Descs> {
        self.world.check()?;
        let seq = self.seqs[r].0.fetch_add(1, Ordering::Relaxed);
        desc.seq = seq;
        *lock(&self.slots[r][(seq % 2) as usize]) = desc;
        self.sync(r, desc.kind, seq)?;
        let descs: Descs = self.slots.iter().map(|s| *lock(&s[(seq % 2) as usize])).collect();
        if let Err(e) = super::validate::validate(&descs, &self.members) {
            self.world.poison(self.members[r], e.to_string());
            return Err(e);
        }
        Ok(descs)
    }

    /// A barrier point: returns once every rank of the group has reached it.
    pub(crate) fn sync(&self, r: usize, kind: OpKind, seq: u64) -> Result<()> {
        let target = self.phase[r].0.fetch_add(1, Ordering::AcqRel) + 1;
        let n = self.size();
        let arrived = |q: usize| self.phase[q].0.load(Ordering::Acquire) >= target;
        let start = Instant::now();
        let mut i: u32 = 0;
        loop {
            if (0..n).all(arrived) {
                return Ok(());
            }
            i = i.saturating_add(1);
            if i < 128 {
                std::hint::spin_loop();
                continue;
            }
            self.world.check()?;
            let waited = start.elapsed();
            if i.is_multiple_of(64) {
                let missing: Vec<usize> = (0..n).filter(|&q| !arrived(q)).map(|q| self.members[q]).collect();
                if let Some(&gone) = missing.iter().find(|&&w| self.world.has_exited(w)) {
                    let p = self.world.poison(
                        gone,
                        format!("returned from its closure without entering {kind} (collective #{seq} of its group)"),
                    );
                    return Err(Error::PeerFailed {
                        rank: p.rank,
                        reason: p.reason,
                    });
                }
                if waited >= self.world.timeout && !missing.is_empty() {
                    self.world.poison(
                        missing[0],
                        format!(
                            "did not enter {kind} (collective #{seq} of its group) within {:?}",
                            self.world.timeout
                        ),
                    );
                    return Err(Error::Timeout {
                        op: kind.name(),
                        seq,
                        missing,
                        after: waited,
                    });
                }
            }
            if waited < Duration::from_millis(2) {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }
}
