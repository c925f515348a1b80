//! Per-rank counters of collectives: how many were issued and how many bytes each rank sent.
//!
//! Bytes are those a bandwidth-optimal algorithm sends from one rank, whatever
//! the backend really does, so counts compare across backends:
//!
//! | collective | bytes sent per rank (`b` = bytes of the full buffer named) |
//! |---|---|
//! | all_gather | `(n−1)/n · b` of the output: `n−1` copies of its own piece |
//! | reduce_scatter | `(n−1)/n · b` of the input: all of it but its own piece |
//! | all_reduce | `2 (b − c)`, `c` its chunk of `b` split into `n` near-equal byte chunks (the first `b mod n` one byte longer): `2 (n−1)/n · b` on average |
//! | all_to_all | `(n−1)/n · b` of the local data |
//! | broadcast | `(n−1)/n · b` (rounded down) |
//! | all_gather_v (as all_gather) | `n−1` copies of its own piece (its count) |
//! | reduce_scatter_v (as reduce_scatter) | the input less its own piece (its count) |
//! | all_to_all_v (as all_to_all) | exactly the bytes sent to other ranks (`send_counts` without this rank's own segment), via [`CommStats::record_exact`] |
//!
//! Each count is whole, and the counts of one collective's ranks add up exactly
//! to the group's total (`(n−1)·b` or `2(n−1)·b`), however unevenly the data
//! splits: summed over ranks they are the redistribution planner's objective.
//!
//! The provided (padded) variable-count forms of [`Communicator`](crate::Communicator)
//! record the fixed-size collectives they run, padding included.
//!
//! Tests use these counters to check collectives per step and bytes moved.

use std::fmt;
use std::ops::Sub;
use std::sync::atomic::{AtomicU64, Ordering};

/// The kind of a collective.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
pub enum OpKind {
    /// `all_gather`.
    AllGather,
    /// `reduce_scatter`.
    ReduceScatter,
    /// `all_reduce`.
    AllReduce,
    /// `broadcast`.
    Broadcast,
    /// `all_to_all`.
    AllToAll,
    /// `barrier`.
    Barrier,
    /// `split`.
    Split,
}

impl OpKind {
    /// All kinds, in a fixed order.
    pub const ALL: [OpKind; 7] = [
        OpKind::AllGather,
        OpKind::ReduceScatter,
        OpKind::AllReduce,
        OpKind::Broadcast,
        OpKind::AllToAll,
        OpKind::Barrier,
        OpKind::Split,
    ];

    /// The snake_case name (`"all_gather"`).
    pub const fn name(self) -> &'static str {
        match self {
            OpKind::AllGather => "all_gather",
            OpKind::ReduceScatter => "reduce_scatter",
            OpKind::AllReduce => "all_reduce",
            OpKind::Broadcast => "broadcast",
            OpKind::AllToAll => "all_to_all",
            OpKind::Barrier => "barrier",
            OpKind::Split => "split",
        }
    }

    const fn index(self) -> usize {
        self as usize
    }

    /// Bytes rank `index` of a group of `n` sends in an all-reduce of a
    /// `bytes`-byte buffer: `2 (bytes − c)` with `c` its chunk (see the module
    /// docs); the group's ranks together send exactly `2 (n−1) · bytes`.
    pub const fn all_reduce_sent(n: usize, index: usize, bytes: usize) -> u64 {
        if n <= 1 {
            return 0;
        }
        let chunk = bytes / n + if index < bytes % n { 1 } else { 0 };
        2 * (bytes - chunk) as u64
    }

    /// Bytes one rank sends for this collective over `n` ranks, where `bytes`
    /// is the size of the buffer the table in the module docs names, for even
    /// splits (`(n−1)/n` of it, rounded down; an all-reduce's mean). Exact
    /// per-rank counts of uneven ones: [`all_reduce_sent`](Self::all_reduce_sent)
    /// and the own-piece rules of the module docs.
    pub const fn bytes_sent(self, n: usize, bytes: usize) -> u64 {
        if n == 0 {
            return 0;
        }
        let share = (bytes as u64 * (n as u64 - 1)) / n as u64;
        match self {
            OpKind::AllReduce => 2 * share,
            OpKind::Barrier | OpKind::Split => 0,
            _ => share,
        }
    }
}

impl fmt::Display for OpKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

const KINDS: usize = OpKind::ALL.len();

/// Live counters, shared by every communicator of one rank.
#[derive(Debug, Default)]
pub struct CommStats {
    calls: [AtomicU64; KINDS],
    bytes: [AtomicU64; KINDS],
}

impl CommStats {
    /// Records one collective of `kind` over `n` ranks on a buffer of `bytes` (see the module docs).
    pub fn record(&self, kind: OpKind, n: usize, bytes: usize) {
        self.calls[kind.index()].fetch_add(1, Ordering::Relaxed);
        self.bytes[kind.index()].fetch_add(kind.bytes_sent(n, bytes), Ordering::Relaxed);
    }

    /// Records one collective of `kind` that sent exactly `bytes_sent` bytes from
    /// this rank (used where the data per peer is uneven, as in `all_to_all_v`).
    pub fn record_exact(&self, kind: OpKind, bytes_sent: u64) {
        self.calls[kind.index()].fetch_add(1, Ordering::Relaxed);
        self.bytes[kind.index()].fetch_add(bytes_sent, Ordering::Relaxed);
    }

    /// A copy of the counters now.
    pub fn snapshot(&self) -> CommCounts {
        let mut c = CommCounts::default();
        for k in 0..KINDS {
            c.calls[k] = self.calls[k].load(Ordering::Relaxed);
            c.bytes[k] = self.bytes[k].load(Ordering::Relaxed);
        }
        c
    }
}

/// A snapshot of [`CommStats`]; subtract two snapshots to count what happened between them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CommCounts {
    calls: [u64; KINDS],
    bytes: [u64; KINDS],
}

impl CommCounts {
    /// Number of collectives of `kind`.
    pub fn calls(&self, kind: OpKind) -> u64 {
        self.calls[kind.index()]
    }
    /// Bytes this rank sent in collectives of `kind`.
    pub fn bytes(&self, kind: OpKind) -> u64 {
        self.bytes[kind.index()]
    }
    /// Collectives of every kind that move data (barriers and splits excluded).
    pub fn total_calls(&self) -> u64 {
        OpKind::ALL
            .iter()
            .filter(|k| !matches!(k, OpKind::Barrier | OpKind::Split))
            .map(|&k| self.calls(k))
            .sum()
    }
    /// Bytes sent in collectives of every kind.
    pub fn total_bytes(&self) -> u64 {
        self.bytes.iter().sum()
    }
}

impl Sub for CommCounts {
    type Output = CommCounts;
    fn sub(self, rhs: CommCounts) -> CommCounts {
        let mut c = CommCounts::default();
        for k in 0..KINDS {
            c.calls[k] = self.calls[k].saturating_sub(rhs.calls[k]);
            c.bytes[k] = self.bytes[k].saturating_sub(rhs.bytes[k]);
        }
        c
    }
}

impl fmt::Display for CommCounts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut first = true;
        for k in OpKind::ALL {
            if self.calls(k) > 0 {
                if !first {
                    f.write_str(", ")?;
                }
                first = false;
                write!(f, "{k}×{} ({} B)", self.calls(k), self.bytes(k))?;
            }
        }
        if first {
            f.write_str("no collectives")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_sent_table() {
        macro_rules! case {
            ($k:expr, $n:expr, $b:expr, $want:expr) => {
                assert_eq!($k.bytes_sent($n, $b), $want, "{} n={} b={}", $k, $n, $b);
            };
        }
        case!(OpKind::AllGather, 4, 1600, 1200);
        case!(OpKind::ReduceScatter, 4, 1600, 1200);
        case!(OpKind::AllReduce, 4, 1600, 2400);
        case!(OpKind::AllToAll, 2, 1600, 800);
        case!(OpKind::AllGather, 1, 1600, 0);
        case!(OpKind::Barrier, 8, 0, 0);
    }

    /// Uneven all-reduces: each rank's count is whole and the group's add up
    /// to `2 (n−1) · b` exactly (the mean rounded down would lose bytes).
    #[test]
    fn all_reduce_counts_add_up() {
        for (n, b) in [(4usize, 9usize), (3, 10), (4, 16), (5, 3), (2, 1)] {
            let per: Vec<u64> = (0..n).map(|i| OpKind::all_reduce_sent(n, i, b)).collect();
            assert_eq!(
                per.iter().sum::<u64>(),
                2 * (n as u64 - 1) * b as u64,
                "n {n} b {b}: {per:?}"
            );
        }
        assert_eq!(
            (0..4).map(|i| OpKind::all_reduce_sent(4, i, 9)).collect::<Vec<_>>(),
            [12, 14, 14, 14]
        );
        assert_eq!(OpKind::all_reduce_sent(1, 0, 100), 0);
        assert_eq!(OpKind::all_reduce_sent(4, 0, 16), OpKind::AllReduce.bytes_sent(4, 16));
    }

    #[test]
    fn snapshots_subtract() {
        let s = CommStats::default();
        s.record(OpKind::AllGather, 2, 100);
        let a = s.snapshot();
        s.record(OpKind::AllGather, 2, 100);
        s.record(OpKind::Barrier, 2, 0);
        let d = s.snapshot() - a;
        assert_eq!(d.calls(OpKind::AllGather), 1);
        assert_eq!(d.bytes(OpKind::AllGather), 50);
        assert_eq!(d.total_calls(), 1);
        assert_eq!(d.to_string(), "all_gather×1 (50 B), barrier×1 (0 B)");
        s.record_exact(OpKind::AllToAll, 37);
        let d = s.snapshot() - a;
        assert_eq!(d.calls(OpKind::AllToAll), 1);
        assert_eq!(d.bytes(OpKind::AllToAll), 37);
    }
}
