//! The opt-in cross-rank check of every collective (`TESSERA_MPI_CHECK=1`).
//!
//! MPI does not compare what ranks pass to a collective: mismatched calls hang,
//! truncate or read garbage. With the check on, every collective first
//! all-gathers a small fingerprint (kind, dtype, length, root, reduction) from
//! every rank of its communicator and fails on every rank with the same
//! [`Error::Mismatch`] when they differ, as the threads backend always does. It
//! costs one small all-gather per collective, so it is off by default (a
//! debugging aid, like PyTorch's `TORCH_DISTRIBUTED_DEBUG=DETAIL`).

use crate::{DType, Error, OpKind, ReduceOp, Result};

/// What one rank passes to a collective, as far as every rank must agree.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Fingerprint {
    pub(super) kind: OpKind,
    /// `None` for barrier and split.
    pub(super) dtype: Option<DType>,
    /// The send length (all_gather, reduce_scatter, all_to_all) or the buffer's.
    pub(super) len: usize,
    pub(super) root: usize,
    pub(super) reduce: Option<ReduceOp>,
    /// Whether the rank's own checks of its arguments passed.
    pub(super) ok: bool,
}

/// Words per fingerprint on the wire.
pub(super) const WORDS: usize = 6;

fn index<T: PartialEq>(all: &[T], x: &T) -> i64 {
    all.iter().position(|a| a == x).map_or(-1, |i| i as i64)
}

fn pick<T: Copy>(all: &[T], i: i64) -> Option<T> {
    usize::try_from(i).ok().and_then(|i| all.get(i).copied())
}

impl Fingerprint {
    /// A fingerprint with only a kind (barrier, split).
    pub(super) fn bare(kind: OpKind) -> Fingerprint {
        Fingerprint {
            kind,
            dtype: None,
            len: 0,
            root: 0,
            reduce: None,
            ok: true,
        }
    }

    pub(super) fn encode(&self) -> [i64; WORDS] {
        [
            index(&OpKind::ALL, &self.kind),
            self.dtype.map_or(-1, |d| index(&DType::ALL, &d)),
            self.len as i64,
            self.root as i64,
            self.reduce.map_or(-1, |r| index(&ReduceOp::ALL, &r)),
            i64::from(self.ok),
        ]
    }

    fn decode(w: &[i64]) -> Option<Fingerprint> {
        Some(Fingerprint {
            kind: pick(&OpKind::ALL, w[0])?,
            dtype: pick(&DType::ALL, w[1]),
            len: usize::try_from(w[2]).ok()?,
            root: usize::try_from(w[3]).ok()?,
            reduce: pick(&ReduceOp::ALL, w[4]),
            ok: w[5] != 0,
        })
    }

    fn describe(&self) -> String {
        let what = |d: Option<DType>| d.map_or("?".to_string(), |d| format!("{} × {d}", self.len));
        let op = self.reduce.unwrap_or(ReduceOp::Sum);
        match self.kind {
            OpKind::AllGather | OpKind::AllToAll => format!("{}(send {})", self.kind, what(self.dtype)),
            OpKind::ReduceScatter | OpKind::AllReduce => format!("{}({op}, send {})", self.kind, what(self.dtype)),
            OpKind::Broadcast => format!("broadcast(root {}, {})", self.root, what(self.dtype)),
            OpKind::Barrier | OpKind::Split => format!("{}()", self.kind),
        }
    }
}

/// Compares every rank's fingerprint (`rows` holds [`WORDS`] words per rank, in
/// rank order). Every rank runs it over the same rows, so all report the same error.
pub(super) fn compare(rows: &[i64]) -> Result<()> {
    let prints: Vec<Option<Fingerprint>> = rows.chunks(WORDS).map(Fingerprint::decode).collect();
    let n = prints.len();
    let name = |p: &Option<Fingerprint>| p.map_or("an unknown collective".to_string(), |p| p.describe());
    if let Some(q) = prints.iter().position(|p| p.is_some_and(|p| !p.ok)) {
        return Err(Error::Mismatch {
            detail: format!(
                "rank {q} of a communicator of {n} rejected its own arguments to {} (its error says why); \
                 the collective was not run",
                name(&prints[q])
            ),
        });
    }
    for (q, p) in prints.iter().enumerate().skip(1) {
        if *p != prints[0] {
            return Err(Error::Mismatch {
                detail: format!(
                    "rank 0 called {} but rank {q} called {} (ranks of a communicator of {n}; MPI backend with \
                     TESSERA_MPI_CHECK); every rank must issue the same collectives in the same order",
                    name(&prints[0]),
                    name(p)
                ),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fp(kind: OpKind, len: usize) -> Fingerprint {
        Fingerprint {
            kind,
            dtype: Some(DType::F32),
            len,
            root: 0,
            reduce: None,
            ok: true,
        }
    }

    #[test]
    fn equal_calls_pass_and_different_ones_are_named() {
        let rows = |ps: &[Fingerprint]| ps.iter().flat_map(|p| p.encode()).collect::<Vec<i64>>();
        let a = fp(OpKind::AllGather, 13);
        assert!(compare(&rows(&[a, a, a])).is_ok());
        let e = compare(&rows(&[a, a, fp(OpKind::AllGather, 14)]))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("rank 0 called all_gather(send 13 × f32) but rank 2 called all_gather(send 14 × f32)"),
            "{e}"
        );
        let mut r = fp(OpKind::AllReduce, 13);
        r.reduce = Some(ReduceOp::Max);
        let e = compare(&rows(&[r, Fingerprint::bare(OpKind::Barrier)]))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("all_reduce(max, send 13 × f32) but rank 1 called barrier()"),
            "{e}"
        );
        assert_eq!(Fingerprint::decode(&r.encode()), Some(r));
        let bad = Fingerprint { ok: false, ..a };
        let e = compare(&rows(&[a, bad])).unwrap_err().to_string();
        assert!(
            e.contains("rank 1 of a communicator of 2 rejected its own arguments to all_gather"),
            "{e}"
        );
    }
}
