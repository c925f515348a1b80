//! [`launch`]: runs a closure on every rank of a job, on the backend the
//! environment calls for. The one entry point above the backends: it picks one,
//! and the backends know nothing of it (what they share with it, the options and
//! what a rank receives, lives in `options` and `rank`).
//!
//! - Started by `mpirun`/`mpiexec`/`srun` (an MPI launch, detected by
//!   [`mpi_env`] from the variables the launcher sets) and built with the `mpi`
//!   feature: this process is one rank; MPI is initialised (at
//!   `MPI_THREAD_MULTIPLE`) and the closure runs once, on this process's rank.
//! - Otherwise: the threads backend, every rank a thread of this process.
//!
//! `TESSERA_BACKEND=threads` or `=mpi` overrides the detection. So one binary
//! runs either way: `cargo run --example train` or `mpirun -n 4 target/release/examples/train`.

use crate::env::{MpiEnv, mpi_env};
use crate::observe::OpLog;
use crate::options::LaunchOptions;
use crate::rank::{BoxError, RankCtx};
use crate::{Error, Result};

/// Runs `f` on every rank of a `world_size`-rank job with the options of
/// [`LaunchOptions::from_env`].
///
/// Returns the results of the ranks this process ran, in rank order: every rank's
/// with the threads backend, this process's own (one element) under MPI.
///
/// With the threads backend a failure never hangs the job: a rank whose closure
/// returns an error or panics poisons it, and every other rank's pending or next
/// collective fails with [`Error::PeerFailed`] naming that rank; a rank that never
/// reaches a collective makes the others fail with [`Error::Timeout`] after
/// [`LaunchOptions::timeout`]; ranks that wait for each other in collectives of
/// different groups fail with [`Error::Mismatch`]. The process is never aborted.
///
/// The closure owns what it uses (`'static`, as for [`std::thread::spawn`]): with
/// the threads backend a rank stuck outside any collective is left running,
/// detached, when `launch` gives up on it. Move inputs in (`move |ctx| ...`),
/// sharing large ones through an `Arc`.
///
/// # Errors
/// [`Error::Launch`] for `world_size == 0`, an invalid `TESSERA_TIMEOUT_S`, an MPI
/// launch whose process count is not `world_size`, or an MPI launch of a build
/// without the `mpi` feature;
/// [`Error::RankFailed`] naming the first rank that failed (returned an error,
/// panicked, never arrived at a collective, or returned while its peers waited), or
/// a rank still in its closure a timeout after every other rank returned (threads
/// backend: its thread is then left running, detached, and its later collectives
/// fail at once; under
/// MPI a failing rank prints its error and aborts the whole job instead, so that no
/// peer waits for it forever).
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
    let debug = opts.debug_ops;
    let f = move |ctx: RankCtx| {
        let _echo = (debug != OpLog::Off).then(|| crate::observe::echo_ops(ctx.rank(), debug));
        f(ctx)
    };
    match mpi_env() {
        None => crate::threads::launch(opts, world_size, f),
        Some(env) => launch_mpi(opts, world_size, &env, f),
    }
}

/// This process as one rank of an MPI job.
#[cfg(feature = "mpi")]
fn launch_mpi<T, F>(opts: &LaunchOptions, world_size: usize, env: &MpiEnv, f: F) -> Result<Vec<T>>
where
    F: Fn(RankCtx) -> Result<T, BoxError>,
{
    crate::mpi_backend::launch(opts, world_size, env, f)
}

/// Without the `mpi` feature an MPI launch is an error that says how to rebuild.
#[cfg(not(feature = "mpi"))]
fn launch_mpi<T, F>(_: &LaunchOptions, _: usize, env: &MpiEnv, _: F) -> Result<Vec<T>>
where
    F: Fn(RankCtx) -> Result<T, BoxError>,
{
    Err(Error::Launch(format!(
        "this process was started by an MPI launcher (found {}, rank {}) but Tessera was built without \
         the `mpi` feature; rebuild with `--features mpi`, or run without mpirun to use in-process threads \
         (TESSERA_BACKEND=threads forces them)",
        env.launcher, env.rank
    )))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::intra_op::{cores, intra_op_threads};

    #[test]
    fn ranks_see_their_threads() {
        let inside = crate::launch_with(&LaunchOptions::default().threads_per_rank(3), 2, |_| {
            Ok(intra_op_threads())
        });
        assert_eq!(inside.unwrap(), vec![3, 3]);
        let default = crate::launch_with(&LaunchOptions::default(), 2, |_| Ok(intra_op_threads())).unwrap();
        assert_eq!(default, vec![(cores() / 2).max(1); 2]);
        assert_eq!(intra_op_threads(), cores(), "outside a rank: every core");
    }

    #[cfg(not(feature = "mpi"))]
    #[test]
    fn mpi_launch_without_the_feature_is_an_error() {
        let e = MpiEnv {
            launcher: "OpenMPI",
            rank: 1,
            size: Some(2),
        };
        let err = launch_mpi(&LaunchOptions::default(), 2, &e, |_| Ok::<(), BoxError>(())).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("--features mpi") && msg.contains("OpenMPI"), "{msg}");
    }
}
