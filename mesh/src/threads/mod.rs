//! The threads backend: every rank is a thread of this process and collectives
//! move data through shared memory.
//!
//! [`launch`] runs a closure on every rank and returns every rank's result.
//! Failures never hang the job: a rank whose closure returns an error or panics
//! poisons it, and every other rank's pending or next collective fails with
//! [`Error::PeerFailed`] naming that rank; a rank that never reaches a collective
//! makes the others fail with [`Error::Timeout`] after [`LaunchOptions::timeout`];
//! a rank that returns while its peers wait for it in a collective is reported
//! as soon as they notice; ranks that wait for each other in collectives of
//! different groups all fail with [`Error::Mismatch`] within tens of milliseconds
//! (see `activity`). `launch` then returns [`Error::RankFailed`] naming the rank
//! that failed first; a rank still in its closure a timeout after every other
//! rank returned is reported and left running, detached. The process is never
//! aborted.
//!
//! Memory safety: a collective reads its peers' buffers in place. A rank that has
//! passed a collective's entry barrier is committed and leaves only through the
//! collective's barrier points, which wait for every member whatever fails
//! elsewhere; so no buffer is released while any thread, a peer's communication
//! thread included, can still read it.

mod activity;
mod comm;
mod desc;
mod group;
mod kernels;
mod store;
#[cfg(test)]
mod tests;
mod validate;
mod world;

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, mpsc};
use std::time::Instant;

use desc::Desc;
use group::Group;
use world::{World, lock};

use crate::context::{self, RankId};
use crate::launcher::panic_message;
use crate::{BoxError, Error, LaunchOptions, OpKind, RankCtx, Result};

/// Runs `f` on `world_size` ranks, one thread each, with options from the
/// environment ([`LaunchOptions::from_env`]): the threads backend whatever the
/// environment says ([`crate::launch`] picks the backend).
///
/// Returns every rank's result in rank order.
///
/// The closure and its results must own what they hold (`'static`, as for
/// [`std::thread::spawn`]): a rank stuck outside any collective is left running,
/// detached, when `launch` returns, so nothing it uses may live on the caller's
/// stack. Move what a closure needs into it (`move |ctx| ...`), sharing large
/// inputs through an `Arc`.
///
/// # Errors
/// [`Error::Launch`] for `world_size == 0`, an invalid `TESSERA_TIMEOUT_S`, or
/// when threads cannot be started; [`Error::RankFailed`] naming the first rank
/// that failed (returned an error, panicked, never arrived at a collective, or
/// returned while its peers waited), or a rank that had not returned from its
/// closure [`LaunchOptions::timeout`] after every other rank had (its thread is
/// then left running, detached, and its later collectives fail at once).
pub fn launch<T, F>(world_size: usize, f: F) -> Result<Vec<T>>
where
    T: Send + 'static,
    F: Fn(RankCtx) -> Result<T, BoxError> + Send + Sync + 'static,
{
    launch_with(&LaunchOptions::from_env()?, world_size, f)
}

/// [`launch`] with explicit options.
///
/// # Errors
/// As [`launch`].
pub fn launch_with<T, F>(opts: &LaunchOptions, world_size: usize, f: F) -> Result<Vec<T>>
where
    T: Send + 'static,
    F: Fn(RankCtx) -> Result<T, BoxError> + Send + Sync + 'static,
{
    if world_size == 0 {
        return Err(Error::Launch("world_size must be at least 1".into()));
    }
    let job = context::next_job();
    let world = World::new(job, world_size, opts.timeout);
    let group = Group::new(world.clone(), (0..world_size).collect());
    let f = Arc::new(f);
    let threads = opts.threads_for(world_size);
    let (tx, rx) = mpsc::channel::<(usize, Result<T, BoxError>)>();
    let mut handles = Vec::with_capacity(world_size);
    for rank in 0..world_size {
        let (w, g, f, tx) = (world.clone(), group.clone(), f.clone(), tx.clone());
        let spawned = std::thread::Builder::new()
            .name(format!("tessera-rank-{rank}"))
            .stack_size(16 << 20)
            .spawn(move || {
                let _intra = crate::intra_op::enter_intra_op(threads, world_size);
                let out = run_rank(&*f, w, g, job, rank);
                // The receiver is gone only if `launch` gave up on this rank.
                let _ = tx.send((rank, out));
            });
        match spawned {
            Ok(h) => handles.push(Some(h)),
            Err(e) => {
                world.poison(rank, format!("could not start its thread: {e}"));
                handles.push(None);
                break;
            }
        }
    }
    drop(tx);
    let started = handles.len();
    let mut results: Vec<Option<Result<T, BoxError>>> = (0..world_size).map(|_| None).collect();
    let mut left = started;
    let mut last_return = Instant::now();
    while left > 0 {
        // Ranks are waited for without limit while any other rank still runs; once
        // all others have returned, the rest get one timeout more.
        let wait = if left == started {
            None
        } else {
            Some((last_return + opts.timeout).saturating_duration_since(Instant::now()))
        };
        let got = match wait {
            None => rx.recv().map_err(|_| mpsc::RecvTimeoutError::Disconnected),
            Some(w) => rx.recv_timeout(w),
        };
        match got {
            Ok((rank, out)) => {
                results[rank] = Some(out);
                left -= 1;
                last_return = Instant::now();
            }
            Err(_) => break,
        }
    }
    let stuck: Vec<usize> = (0..started).filter(|&r| results[r].is_none()).collect();
    if let Some(&first) = stuck.first() {
        world.poison(
            first,
            format!(
                "did not return from its closure within {:?} after every other rank had returned \
                 (stuck outside any collective?); its thread was left running, detached",
                opts.timeout
            ),
        );
    }
    // Ranks that returned still run their thread-local destructors (which may wait
    // for their communication threads, each bounded by the timeout): join them, so
    // that nothing of theirs outlives the launch. Stuck ranks are detached.
    for (rank, h) in handles.into_iter().enumerate() {
        if let Some(h) = h
            && results[rank].is_some()
        {
            let _ = h.join();
        }
    }
    match world.first_failure() {
        None => results
            .into_iter()
            .map(|r| r.unwrap_or_else(|| Err("rank thread ended without a result".into())))
            .collect::<Result<Vec<T>, BoxError>>()
            .map_err(|source| {
                // Unreachable in practice: every failing rank poisons the world first.
                Error::RankFailed { rank: 0, source }
            }),
        Some(p) => {
            let source = match results.into_iter().nth(p.rank).flatten() {
                Some(Err(e)) => e,
                _ => p.reason.into(),
            };
            Err(Error::RankFailed { rank: p.rank, source })
        }
    }
}

fn run_rank<T, F>(f: &F, world: Arc<World>, group: Arc<Group>, job: u64, rank: usize) -> Result<T, BoxError>
where
    F: Fn(RankCtx) -> Result<T, BoxError>,
{
    let _tag = context::enter(RankId { job, rank });
    let ctx = RankCtx::new(Box::new(comm::ThreadComm::new(group, rank)), job);
    let out = match catch_unwind(AssertUnwindSafe(|| f(ctx))) {
        Ok(r) => r,
        Err(payload) => Err(format!("panicked: {}", panic_message(&*payload)).into()),
    };
    if let Err(e) = &out {
        world.poison(rank, e.to_string());
    }
    world.mark_exited(rank);
    out
}

/// Splits `group`: ranks with the same color form a new group ordered by (key, rank).
fn split(group: &Arc<Group>, r: usize, color: u32, key: u32) -> Result<(Arc<Group>, usize)> {
    let mut d = Desc::new(OpKind::Split);
    d.color = color;
    d.key = key;
    let (descs, done) = group.enter(r, d)?;
    done.finish()?;
    let seq = descs[r].seq;
    let mut mine: Vec<(u32, usize)> = descs
        .iter()
        .enumerate()
        .filter(|(_, dq)| dq.color == color)
        .map(|(q, dq)| (dq.key, q))
        .collect();
    mine.sort_unstable();
    let new_rank = mine.iter().position(|&(_, q)| q == r).unwrap_or(0);
    let members: Vec<usize> = mine.iter().map(|&(_, q)| group.members[q]).collect();
    let n = members.len();
    let k = (group.id, seq, color);
    let world = &group.world;
    let mut splits = lock(&world.splits);
    let g = if let Some(i) = splits.iter().position(|e| e.0 == k) {
        let g = splits[i].1.clone();
        splits[i].2 -= 1;
        if splits[i].2 == 0 {
            splits.swap_remove(i);
        }
        g
    } else {
        let g = Group::new(world.clone(), members);
        if n > 1 {
            splits.push((k, g.clone(), n - 1));
        }
        g
    };
    Ok((g, new_rank))
}
