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
//!
//! Layers, bottom up: `sync` (padding, barrier points, locks), `desc` and
//! `validate` (call descriptors and their cross-rank check), `activity` (the
//! cross-group mismatch check), `world` (the job's shared state), `group` (one
//! process group's barriers), `store` and `kernels` (the data phases), `split`,
//! `comm` (the [`Communicator`](crate::Communicator)), and this file (the ranks'
//! threads).

mod activity;
mod comm;
mod desc;
mod group;
mod kernels;
mod split;
mod store;
pub(crate) use store::{Store, Writer, last_level_cache_bytes, order_streamed_stores};
mod sync;
#[cfg(test)]
mod tests;
mod validate;
mod world;

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, mpsc};
use std::thread::JoinHandle;
use std::time::Instant;

use group::Group;
use world::World;

use crate::context::{self, RankId};
use crate::options::LaunchOptions;
use crate::rank::{BoxError, RankCtx, panic_message};
use crate::{Error, Result};

/// What a rank thread sends back: its rank and its closure's result.
type Returned<T> = (usize, Result<T, BoxError>);

/// Runs `f` on `world_size` (at least 1) ranks, one thread each, and returns every
/// rank's result in rank order (see the module docs for how failures end the job).
///
/// # Errors
/// [`Error::RankFailed`] naming the first rank that failed (returned an error,
/// panicked, could not start its thread, never arrived at a collective, or
/// returned while its peers waited), or a rank that had not returned from its
/// closure [`LaunchOptions::timeout`] after every other rank had (its thread is
/// then left running, detached, and its later collectives fail at once).
pub(crate) fn launch<T, F>(opts: &LaunchOptions, world_size: usize, f: F) -> Result<Vec<T>>
where
    T: Send + 'static,
    F: Fn(RankCtx) -> Result<T, BoxError> + Send + Sync + 'static,
{
    let job = context::next_job();
    let world = World::new(
        job,
        world_size,
        opts.timeout,
        (opts.fingerprints, opts.strict_collectives),
    );
    let (handles, rx) = spawn_ranks(opts, &world, world_size, job, f);
    let started = handles.len();
    let results = collect(opts, &world, &rx, world_size, started);
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
    outcome(&world, results)
}

/// Starts one thread per rank, each running [`run_rank`] and sending its result
/// back. A thread that cannot be started poisons the job and no more are started.
fn spawn_ranks<T, F>(
    opts: &LaunchOptions,
    world: &Arc<World>,
    world_size: usize,
    job: u64,
    f: F,
) -> (Vec<Option<JoinHandle<()>>>, mpsc::Receiver<Returned<T>>)
where
    T: Send + 'static,
    F: Fn(RankCtx) -> Result<T, BoxError> + Send + Sync + 'static,
{
    let group = Group::new(world.clone(), (0..world_size).collect());
    let f = Arc::new(f);
    let threads = opts.threads_for(world_size);
    let (tx, rx) = mpsc::channel::<Returned<T>>();
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
    (handles, rx)
}

/// Receives the results of the `started` ranks: without limit while any other rank
/// still runs; once all others have returned, the rest get one timeout more, after
/// which the first rank still out is blamed (poisoning the job) and left running.
fn collect<T>(
    opts: &LaunchOptions,
    world: &World,
    rx: &mpsc::Receiver<Returned<T>>,
    world_size: usize,
    started: usize,
) -> Vec<Option<Result<T, BoxError>>> {
    let mut results: Vec<Option<Result<T, BoxError>>> = (0..world_size).map(|_| None).collect();
    let mut left = started;
    let mut last_return = Instant::now();
    while left > 0 {
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
    results
}

/// Every rank's result, or the first failure recorded in the job (with the failed
/// rank's own error where it returned one).
fn outcome<T>(world: &World, results: Vec<Option<Result<T, BoxError>>>) -> Result<Vec<T>> {
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

/// One rank's thread: tags it with its rank, runs the closure on the world
/// group, and records a failure (an error or a panic) and the rank's return.
fn run_rank<T, F>(f: &F, world: Arc<World>, group: Arc<Group>, job: u64, rank: usize) -> Result<T, BoxError>
where
    F: Fn(RankCtx) -> Result<T, BoxError>,
{
    let _tag = context::enter(RankId { job, rank });
    // The rank's kept buffers go when it ends.
    let _pool = crate::pool::RankPool::new(RankId { job, rank });
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
