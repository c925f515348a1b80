//! One MPI call as the communicators make it: under the watchdog's clock, its
//! return code turned into a `Result`, its element counts checked to fit MPI's
//! `int`, and the ranks' agreement on its arguments before it ([`agree`]: a
//! digest all-reduce by default, full fingerprints with `TESSERA_MPI_CHECK`).

use std::os::raw::c_int;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};

use mpi::ffi;

use super::agree::{self, Fingerprint};
use super::messages::error_string;
use super::ops::Handle;
use super::status::Watch;
use crate::callsite::CallSite;
use crate::{DType, Error, OpKind, ReduceOp, Result};

/// Fingerprints off ([`MODE`]).
pub(super) const OFF: u8 = 0;
/// Fingerprints compared through their digest ([`MODE`]).
pub(super) const ON: u8 = 1;
/// Fingerprints with call sites compared ([`MODE`]).
pub(super) const STRICT: u8 = 2;
/// How this process's collectives check their fingerprints, set by each launch
/// from its options.
pub(super) static MODE: AtomicU8 = AtomicU8::new(ON);

/// What the fingerprint check of one collective needs besides the call.
#[derive(Clone)]
pub(super) struct Agreement {
    /// The caller's site (captured where the collective was issued).
    pub(super) site: Option<CallSite>,
    /// The communicator's count of checked collectives.
    pub(super) seq: Arc<AtomicU64>,
    /// Exchange full fingerprints every time (`TESSERA_MPI_CHECK`).
    pub(super) full: bool,
}

impl Agreement {
    /// Whether collectives are checked at all.
    pub(super) fn on(&self) -> bool {
        self.full || MODE.load(Ordering::Relaxed) != OFF
    }
}

/// An MPI communicator handle.
pub(super) type Comm = Handle<ffi::MPI_Comm>;

/// Runs one MPI call under the watchdog's clock and turns its return code into a `Result`.
pub(super) fn exec(watch: &Watch, kind: OpKind, rank: usize, call: impl FnOnce() -> c_int) -> Result<()> {
    let rc = {
        let _clock = watch.enter(kind);
        call()
    };
    checked(kind, rank, rc)
}

/// Runs one call of a fingerprint check under the watchdog's clock, counted as
/// the collective `kind` it checks ([`Watch::enter_check`]).
fn exec_check(watch: &Watch, kind: OpKind, rank: usize, call: impl FnOnce() -> c_int) -> Result<()> {
    let rc = {
        let _clock = watch.enter_check(kind);
        call()
    };
    checked(kind, rank, rc)
}

/// An MPI return code as a `Result`.
fn checked(kind: OpKind, rank: usize, rc: c_int) -> Result<()> {
    if rc == 0 {
        Ok(())
    } else {
        Err(Error::Mpi {
            op: kind.name(),
            rank,
            reason: error_string(rc),
        })
    }
}

/// Checks that every rank of `raw` makes the same call ([`agree`]): one
/// all-reduce of a digest, and only on a disagreement (or with
/// `TESSERA_MPI_CHECK`) an all-gather of the full fingerprints and then of the
/// call sites' strings, for an error naming both ranks and both sites.
pub(super) fn agree_on(
    raw: Comm,
    watch: &Watch,
    rank: usize,
    size: usize,
    fp: Fingerprint,
    a: &Agreement,
) -> Result<()> {
    let strict = MODE.load(Ordering::Relaxed) == STRICT;
    let seq = a.seq.fetch_add(1, Ordering::Relaxed);
    let (tag, site) = a
        .site
        .map_or((0, 0), |s| (s.tag, if strict { s.site_hash() } else { 0 }));
    let row = agree::row(&fp, seq, tag, site);
    if !a.full {
        let max = max_words(raw, watch, rank, fp.kind, agree::digest(&row, strict))?;
        if agree::digests_agree(&max) {
            return Ok(());
        }
    }
    let all = gather_words(raw, watch, rank, size, fp.kind, &row)?;
    let Some((q, detail)) = agree::compare_rows(&all, strict) else {
        return Ok(());
    };
    let text = a
        .site
        .map_or_else(|| "an unknown call site".to_string(), |s| s.to_string());
    let sites = gather_strings(raw, watch, rank, size, fp.kind, &text)?;
    Err(Error::Mismatch {
        detail: format!(
            "{detail} (MPI backend, collective #{seq} of a communicator of {size}); call sites: rank 0 at {}, rank {q} at {}; \
             every rank must issue the same collectives in the same order",
            sites[0], sites[q]
        ),
    })
}

/// All-reduces four words with max over `raw` (the digest check's one call).
fn max_words(raw: Comm, watch: &Watch, rank: usize, kind: OpKind, words: [i64; 4]) -> Result<[i64; 4]> {
    let mut out = [0i64; 4];
    let (s, r) = (words.as_ptr().cast(), out.as_mut_ptr().cast());
    // SAFETY: MPI is initialised; reading predefined handles.
    let (dt, max) = unsafe { (ffi::RSMPI_INT64_T, ffi::RSMPI_MAX) };
    // SAFETY: both buffers hold 4 i64s.
    exec_check(watch, kind, rank, || unsafe {
        ffi::MPI_Allreduce(s, r, 4, dt, max, raw.0)
    })?;
    Ok(out)
}

/// All-gathers one string per rank (lengths first, then the bytes padded to the longest).
fn gather_strings(raw: Comm, watch: &Watch, rank: usize, size: usize, kind: OpKind, text: &str) -> Result<Vec<String>> {
    let lens = gather_words(raw, watch, rank, size, kind, &[text.len() as i64])?;
    let words = lens
        .iter()
        .map(|&l| usize::try_from(l).unwrap_or(0).div_ceil(8))
        .max()
        .unwrap_or(0)
        .max(1);
    let mut row = vec![0i64; words];
    for (i, chunk) in text.as_bytes().chunks(8).enumerate() {
        let mut b = [0u8; 8];
        b[..chunk.len()].copy_from_slice(chunk);
        row[i] = i64::from_le_bytes(b);
    }
    let all = gather_words(raw, watch, rank, size, kind, &row)?;
    Ok(all
        .chunks(words)
        .zip(&lens)
        .map(|(w, &l)| {
            let bytes: Vec<u8> = w.iter().flat_map(|x| x.to_le_bytes()).collect();
            String::from_utf8_lossy(&bytes[..usize::try_from(l).unwrap_or(0).min(bytes.len())]).into_owned()
        })
        .collect())
}

/// All-gathers `row` (the same length on every rank) as i64 words, outside the
/// statistics: the checks' own traffic is not a collective the caller issued.
pub(super) fn gather_words(
    raw: Comm,
    watch: &Watch,
    rank: usize,
    size: usize,
    kind: OpKind,
    row: &[i64],
) -> Result<Vec<i64>> {
    let mut all = vec![0i64; row.len() * size];
    let words = count(kind.name(), rank, row.len())?;
    count(kind.name(), rank, all.len())?;
    let (s, r) = (row.as_ptr().cast(), all.as_mut_ptr().cast());
    // SAFETY: MPI is initialised; reading a predefined handle.
    let dt = unsafe { ffi::RSMPI_INT64_T };
    // SAFETY: `row` holds `words` i64s and `all` `words` per rank.
    exec_check(watch, kind, rank, || unsafe {
        ffi::MPI_Allgather(s, words, dt, r, words, dt, raw.0)
    })?;
    Ok(all)
}

/// The fingerprint of a call whose arguments passed this rank's own checks.
pub(super) fn print(kind: OpKind, dtype: DType, len: usize, root: usize, reduce: Option<ReduceOp>) -> Fingerprint {
    Fingerprint {
        kind,
        dtype: Some(dtype),
        len,
        root,
        reduce,
        ok: true,
    }
}

/// An element count as MPI's `int`.
pub(super) fn count(op: &'static str, rank: usize, n: usize) -> Result<c_int> {
    c_int::try_from(n).map_err(|_| Error::BadLength {
        op,
        rank,
        what: "buffer (the MPI backend moves at most 2^31 - 1 elements per call)",
        expected: c_int::MAX as usize,
        got: n,
    })
}

/// Per-rank element counts `c` as MPI `int`s, with their displacements.
pub(super) fn counts(op: &'static str, rank: usize, c: &[usize]) -> Result<(Vec<c_int>, Vec<c_int>)> {
    let mut displs = Vec::with_capacity(c.len());
    let mut at = 0usize;
    for &k in c {
        displs.push(count(op, rank, at)?);
        at += k;
    }
    count(op, rank, at)?;
    let c = c.iter().map(|&k| count(op, rank, k)).collect::<Result<Vec<_>>>()?;
    Ok((c, displs))
}

/// What an asynchronous job needs to make its MPI call.
pub(super) struct Exec {
    pub(super) raw: Comm,
    pub(super) watch: Arc<Watch>,
    pub(super) rank: usize,
    pub(super) size: usize,
    pub(super) kind: OpKind,
    pub(super) check: Agreement,
}

impl Exec {
    /// Checks that every rank makes the same call (unless fingerprints are off).
    pub(super) fn agree(&self, dtype: DType, len: usize, root: usize, reduce: Option<ReduceOp>) -> Result<()> {
        if !self.check.on() {
            return Ok(());
        }
        let fp = print(self.kind, dtype, len, root, reduce);
        agree_on(self.raw, &self.watch, self.rank, self.size, fp, &self.check)
    }

    pub(super) fn run(&self, call: impl FnOnce(ffi::MPI_Comm) -> c_int) -> Result<()> {
        exec(&self.watch, self.kind, self.rank, || call(self.raw.0))
    }
}
