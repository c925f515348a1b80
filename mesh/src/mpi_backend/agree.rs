//! The cross-rank check of every collective's fingerprint.
//!
//! MPI does not compare what ranks pass to a collective: mismatched calls hang,
//! truncate or read garbage. So every collective first agrees on a fingerprint
//! (kind, dtype, length, root, reduction, sequence number in its communicator,
//! the call site's tag, and in strict mode the call site's hash): by default
//! through one all-reduce (max) of four words, a 64-bit digest of the
//! fingerprint and the tag, each with its complement (max of the complement is
//! the complement of the min, so one all-reduce tells every rank whether all
//! agree). Only on a disagreement do the ranks all-gather their full
//! fingerprints ([`WORDS`] words) and their call sites' strings, and all fail
//! with the same [`Error::Mismatch`] naming both ranks and both call sites.
//! `TESSERA_MPI_CHECK=1` takes the full exchange every time (a debugging aid,
//! like PyTorch's `TORCH_DISTRIBUTED_DEBUG=DETAIL`).

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

/// Words of a fingerprint's call (kind, dtype, length, root, reduction, ok).
pub(super) const WORDS: usize = 6;
/// Words of a full row: the call's, then the sequence number, the tag and the
/// site's hash (0 outside strict mode).
pub(super) const ROW: usize = WORDS + 3;

/// A full row: `fp`, then `seq`, `tag` and `site` (the site's hash in strict mode, else 0).
pub(super) fn row(fp: &Fingerprint, seq: u64, tag: u64, site: u64) -> [i64; ROW] {
    let c = fp.encode();
    [c[0], c[1], c[2], c[3], c[4], c[5], seq as i64, tag as i64, site as i64]
}

/// The four words ranks all-reduce with max: a digest of `row` without its tag
/// (with it in strict mode, where a tag set on one rank only is a mismatch), and
/// the tag, each followed by its complement. An unset tag sends `i64::MIN` twice.
pub(super) fn digest(row: &[i64; ROW], strict: bool) -> [i64; 4] {
    let tag = row[WORDS + 1];
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for (i, &w) in row.iter().enumerate() {
        if i == WORDS + 1 && !strict {
            continue;
        }
        for b in w.to_le_bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    let h = (h >> 1) as i64;
    let (t, nt) = if tag == 0 || strict {
        (i64::MIN, i64::MIN)
    } else {
        let t = ((tag as u64) >> 1) as i64;
        (t, !t)
    };
    [h, !h, t, nt]
}

/// Whether the all-reduced (max) [`digest`]s of every rank agree: equal
/// digests, and the tags set are equal.
pub(super) fn digests_agree(max: &[i64; 4]) -> bool {
    max[0] == !max[1] && (max[2] == i64::MIN || max[2] == !max[3])
}

/// Compares every rank's full [`row`] (rank order); on a disagreement returns
/// the first rank that differs from rank 0 (or rejected its own arguments) and
/// what differs. `strict` compares the sites' hashes too.
pub(super) fn compare_rows(rows: &[i64], strict: bool) -> Option<(usize, String)> {
    let rows: Vec<&[i64]> = rows.chunks(ROW).collect();
    let calls: Vec<i64> = rows.iter().flat_map(|r| r[..WORDS].iter().copied()).collect();
    if let Err(e) = compare(&calls) {
        let q = rows
            .iter()
            .position(|r| r[WORDS - 1] == 0)
            .unwrap_or_else(|| rows.iter().position(|r| r[..WORDS] != rows[0][..WORDS]).unwrap_or(0));
        let detail = match e {
            Error::Mismatch { detail } => detail,
            e => e.to_string(),
        };
        return Some((q, detail));
    }
    let first = rows[0];
    for (q, r) in rows.iter().enumerate().skip(1) {
        let detail = if r[WORDS] != first[WORDS] {
            format!(
                "rank 0 is at collective #{} of its communicator but rank {q} at #{}",
                first[WORDS], r[WORDS]
            )
        } else if (r[WORDS + 1] != first[WORDS + 1]) && (strict || (r[WORDS + 1] != 0 && first[WORDS + 1] != 0)) {
            "the same collective about different things (their entry points' tags differ: e.g. clip_grad_norm \
             over different parameters, a redistribute of another shape or placements)"
                .to_string()
        } else if strict && r[WORDS + 2] != first[WORDS + 2] {
            "the same collective from different call sites (strict collectives: TESSERA_STRICT_COLLECTIVES / \
             LaunchOptions::strict_collectives)"
                .to_string()
        } else {
            continue;
        };
        let call = Fingerprint::decode(&first[..WORDS]).map_or("a collective".to_string(), |p| p.describe());
        return Some((q, format!("ranks 0 and {q} both called {call}, but {detail}")));
    }
    None
}

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
                    "rank 0 called {} but rank {q} called {} (ranks of a communicator of {n}; MPI backend); every rank must issue the same collectives in the same order",
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
        // Digests: equal rows agree; a tag set on one rank only is ignored
        // unless strict; different tags or calls do not agree.
        let max = |ds: &[[i64; 4]]| {
            let mut m = [i64::MIN; 4];
            for d in ds {
                for i in 0..4 {
                    m[i] = m[i].max(d[i]);
                }
            }
            m
        };
        let (x, y) = (row(&a, 3, 0, 0), row(&a, 3, 77, 0));
        assert!(digests_agree(&max(&[digest(&x, false), digest(&x, false)])));
        assert!(digests_agree(&max(&[digest(&x, false), digest(&y, false)])));
        assert!(!digests_agree(&max(&[digest(&x, true), digest(&y, true)])));
        assert!(!digests_agree(&max(&[
            digest(&y, false),
            digest(&row(&a, 3, 78, 0), false)
        ])));
        assert!(!digests_agree(&max(&[
            digest(&x, false),
            digest(&row(&a, 4, 0, 0), false)
        ])));
        let full: Vec<i64> = [y, row(&a, 3, 78, 0)].concat();
        let (q, why) = compare_rows(&full, false).unwrap();
        assert!(q == 1 && why.contains("about different things"), "{why}");
        let full: Vec<i64> = [row(&a, 3, 0, 5), row(&a, 3, 0, 6)].concat();
        assert!(compare_rows(&full, false).is_none());
        assert!(compare_rows(&full, true).unwrap().1.contains("different call sites"));
        let bad = Fingerprint { ok: false, ..a };
        let e = compare(&rows(&[a, bad])).unwrap_err().to_string();
        assert!(
            e.contains("rank 1 of a communicator of 2 rejected its own arguments to all_gather"),
            "{e}"
        );
    }
}
