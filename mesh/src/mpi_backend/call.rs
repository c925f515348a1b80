//! One MPI call as the communicators make it: under the watchdog's clock, its
//! return code turned into a `Result`, its element counts checked to fit MPI's
//! `int`, and (with `TESSERA_MPI_CHECK`) the ranks' agreement on its arguments
//! ([`agree`]) before it.

use std::os::raw::c_int;
use std::sync::Arc;

use mpi::ffi;

use super::agree::{self, Fingerprint};
use super::messages::error_string;
use super::ops::Handle;
use super::status::Watch;
use crate::{DType, Error, OpKind, ReduceOp, Result};

/// An MPI communicator handle.
pub(super) type Comm = Handle<ffi::MPI_Comm>;

/// Runs one MPI call under the watchdog's clock and turns its return code into a `Result`.
pub(super) fn exec(watch: &Watch, kind: OpKind, rank: usize, call: impl FnOnce() -> c_int) -> Result<()> {
    let rc = {
        let _clock = watch.enter(kind);
        call()
    };
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

/// All-gathers `fp` over `raw` and compares every rank's ([`agree`]).
pub(super) fn agree_on(raw: Comm, watch: &Watch, rank: usize, size: usize, fp: Fingerprint) -> Result<()> {
    let all = gather_words(raw, watch, rank, size, fp.kind, &fp.encode())?;
    agree::compare(&all)
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
    exec(watch, kind, rank, || unsafe {
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
    pub(super) check: bool,
}

impl Exec {
    /// With `TESSERA_MPI_CHECK`, checks that every rank makes the same call.
    pub(super) fn agree(&self, dtype: DType, len: usize, root: usize, reduce: Option<ReduceOp>) -> Result<()> {
        if !self.check {
            return Ok(());
        }
        let fp = print(self.kind, dtype, len, root, reduce);
        agree_on(self.raw, &self.watch, self.rank, self.size, fp)
    }

    pub(super) fn run(&self, call: impl FnOnce(ffi::MPI_Comm) -> c_int) -> Result<()> {
        exec(&self.watch, self.kind, self.rank, || call(self.raw.0))
    }
}
