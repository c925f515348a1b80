//! The threads backend: every rank is a thread of this process and collectives
//! move data through shared memory.
//!
//! [`launch`] runs a closure on every rank and returns every rank's result.
//! Failures never hang the job: a rank whose closure returns an error or panics
//! poisons it, and every other rank's pending or next collective fails with
//! [`Error::PeerFailed`] naming that rank; a rank that never reaches a collective
//! makes the others fail with [`Error::Timeout`] after [`LaunchOptions::timeout`];
//! a rank that returns while its peers wait for it in a collective is reported
//! as soon as they notice. `launch` then returns [`Error::RankFailed`] naming the
//! rank that failed first. The process is never aborted.

mod comm;
mod group;
mod kernels;
mod validate;

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;

use group::{Desc, Group, World, lock};

use crate::context::{self, RankId};
use crate::launcher::panic_message;
use crate::{BoxError, Error, LaunchOptions, OpKind, RankCtx, Result};

/// Runs `f` on `world_size` ranks, one thread each, with default options: the
/// threads backend whatever the environment says ([`crate::launch`] picks the backend).
///
/// Returns every rank's result in rank order.
///
/// # Errors
/// [`Error::Launch`] for `world_size == 0` or when threads cannot be started;
/// [`Error::RankFailed`] naming the first rank that failed (returned an error,
/// panicked, never arrived at a collective, or returned while its peers waited).
pub fn launch<T, F>(world_size: usize, f: F) -> Result<Vec<T>>
where
    T: Send,
    F: Fn(RankCtx) -> Result<T, BoxError> + Sync,
{
    launch_with(&LaunchOptions::default(), world_size, f)
}

/// [`launch`] with explicit options.
///
/// # Errors
/// As [`launch`].
pub fn launch_with<T, F>(opts: &LaunchOptions, world_size: usize, f: F) -> Result<Vec<T>>
where
    T: Send,
    F: Fn(RankCtx) -> Result<T, BoxError> + Sync,
{
    if world_size == 0 {
        return Err(Error::Launch("world_size must be at least 1".into()));
    }
    let job = context::next_job();
    let world = World::new(job, world_size, opts.timeout);
    let group = Group::new(world.clone(), (0..world_size).collect());
    let f = &f;
    let results: Vec<Result<T, BoxError>> = std::thread::scope(|s| {
        let mut handles = Vec::with_capacity(world_size);
        for rank in 0..world_size {
            let (w, g) = (world.clone(), group.clone());
            let spawned = std::thread::Builder::new()
                .name(format!("tessera-rank-{rank}"))
                .stack_size(16 << 20)
                .spawn_scoped(s, move || run_rank(f, w, g, job, rank));
            match spawned {
                Ok(h) => handles.push(h),
                Err(e) => {
                    world.poison(rank, format!("could not start its thread: {e}"));
                    break;
                }
            }
        }
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("rank thread panicked outside its closure".into()))
            })
            .collect()
    });
    match world.first_failure() {
        None => results
            .into_iter()
            .collect::<Result<Vec<T>, BoxError>>()
            .map_err(|source| {
                // Unreachable in practice: every failing rank poisons the world first.
                Error::RankFailed { rank: 0, source }
            }),
        Some(p) => {
            let source = match results.into_iter().nth(p.rank) {
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
    let descs = group.enter(r, d)?;
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
