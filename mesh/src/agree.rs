//! Agreement on success: after each rank of a group tried an operation on its
//! own (read a file, checked an argument, staged a state), every rank learns
//! whether all of them succeeded, and if not, which rank failed first and why.
//!
//! This is what keeps a fault on one rank from leaving the others waiting in a
//! collective the failed rank never enters: an operation that mixes local work
//! that can fail with collectives calls [`agree`] after the local work and before
//! the next collective (or before applying anything), and every rank returns
//! the same verdict. A success costs one all-gather of three words per rank.
//!
//! ```
//! use tessera_mesh::{agree, launch};
//!
//! let verdicts = launch(3, |ctx| {
//!     // Rank 1 fails on its own; every rank learns it.
//!     let mine = if ctx.rank() == 1 { Err("chunk 7 is corrupt") } else { Ok(()) };
//!     let v = agree::agree(ctx.comm(), mine.err())?;
//!     Ok(v.map(|f| (f.rank, f.reason)))
//! })
//! .unwrap();
//! assert!(verdicts.iter().all(|v| v == &Some((1, "chunk 7 is corrupt".to_string()))));
//! ```

use std::fmt::Display;

use crate::{Communicator, CommunicatorExt, Result};

/// The first failure of a group's ranks, as every rank of the group learns it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failure {
    /// The world rank that failed (the lowest, when several did).
    pub rank: usize,
    /// Its error, as text.
    pub reason: String,
    /// Whether the calling rank is the one that failed.
    pub is_me: bool,
}

/// Every rank of `comm` passes its own failure (`None` when its part
/// succeeded) and learns the first one of any rank: `Ok(None)` when every rank
/// succeeded, `Ok(Some(failure))` on every rank otherwise (the lowest failed
/// rank's). Collective over `comm`: every rank must call it, also the ones that
/// failed.
///
/// PyTorch has no counterpart: there a rank that raises leaves its peers in the
/// next collective until the timeout.
///
/// # Errors
/// A communication failure.
pub fn agree(comm: &dyn Communicator, mine: Option<impl Display>) -> Result<Option<Failure>> {
    agree_with(comm, mine, 0).map(|v| v.failure)
}

/// What [`agree_with`] made known to every rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Verdict {
    /// The first failure, if any rank failed.
    pub failure: Option<Failure>,
    /// `(world rank, word)` of each group rank, in group order.
    pub words: Vec<(usize, u64)>,
}

/// [`agree`], with one word from each rank made known to all in the same
/// all-gather (a hash of what each rank is about to do, say, so that callers
/// can compare it). Collective over `comm`.
///
/// # Errors
/// A communication failure.
pub fn agree_with(comm: &dyn Communicator, mine: Option<impl Display>, word: u64) -> Result<Verdict> {
    let me = crate::context::current_rank().map_or(comm.rank(), |r| r.rank);
    let reason = mine.map(|e| {
        let s = e.to_string();
        if s.is_empty() {
            "failed (no message)".to_string()
        } else {
            s
        }
    });
    let len = reason.as_ref().map_or(0, String::len) as i64;
    let heads = comm.all_gather_vec(&[len, me as i64, word as i64])?;
    let words = heads.chunks(3).map(|h| (h[1] as usize, h[2] as u64)).collect();
    let Some(first) = heads.chunks(3).position(|h| h[0] > 0) else {
        return Ok(Verdict { failure: None, words });
    };
    let (len, world) = (heads[3 * first] as usize, heads[3 * first + 1] as usize);
    let mut body = reason.unwrap_or_default().into_bytes();
    body.resize(len, 0);
    comm.broadcast_slice(&mut body, first)?;
    let failure = Failure {
        rank: world,
        reason: String::from_utf8_lossy(&body).into_owned(),
        is_me: first == comm.rank(),
    };
    Ok(Verdict {
        failure: Some(failure),
        words,
    })
}

/// [`agree`] on a typed result: every rank returns `Ok` only when every rank's
/// `mine` is `Ok`; otherwise the first failed rank returns its own error and
/// every other rank `peer(failure)`, an error of the caller's type naming that
/// rank. Collective over `comm`.
///
/// # Errors
/// As described, or a communication failure (converted with `From`).
pub fn agree_on<T, E>(
    comm: &dyn Communicator,
    mine: std::result::Result<T, E>,
    peer: impl FnOnce(Failure) -> E,
) -> std::result::Result<T, E>
where
    E: Display + From<crate::Error>,
{
    agree_on_with(comm, mine, 0, peer).map(|(v, _)| v)
}

/// [`agree_on`] with each rank's `word` ([`agree_with`]): on success, the value
/// and every rank's `(world rank, word)`, for the caller to compare.
///
/// # Errors
/// As [`agree_on`].
pub fn agree_on_with<T, E>(
    comm: &dyn Communicator,
    mine: std::result::Result<T, E>,
    word: u64,
    peer: impl FnOnce(Failure) -> E,
) -> std::result::Result<(T, Vec<(usize, u64)>), E>
where
    E: Display + From<crate::Error>,
{
    let Verdict { failure, words } = agree_with(comm, mine.as_ref().err(), word)?;
    match (mine, failure) {
        (Ok(v), None) => Ok((v, words)),
        (Err(e), Some(f)) if f.is_me => Err(e),
        (_, Some(f)) => Err(peer(f)),
        // `agree_with` reports a failure whenever this rank had one.
        (Err(e), None) => Err(e),
    }
}
