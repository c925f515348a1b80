//! The MPI backend (feature `mpi`): every rank is a process started by
//! `mpirun`/`mpiexec`/`srun`, and collectives are MPI's.
//!
//! - MPI is initialised once per process at `MPI_THREAD_MULTIPLE` (or taken as
//!   the application initialised it, which must be at that level) and finalised
//!   when the process exits, so a process may run several launches.
//! - Each communicator duplicates its MPI communicator (Tessera's traffic never
//!   mixes with the application's), returns MPI errors instead of aborting on them,
//!   and has a communication thread for its asynchronous collectives: they run
//!   there as blocking MPI calls, in issue order, and so truly overlap the caller's
//!   compute. Blocking collectives run on the caller's thread once the queue is
//!   empty.
//! - bf16 and f16 move as 16-bit words and reduce with user operators (each
//!   pairwise step through f32, rounded back to 16 bits); `Avg` is a sum divided
//!   locally. Over more than two ranks a 16-bit sum can therefore differ in the last
//!   bits from the threads backend's (which rounds once), and an f16 `Avg` can
//!   overflow where the threads backend's does not: reduce in f32 where that
//!   matters (FSDP's mixed precision reduces gradients in f32).
//! - Every collective first agrees on its fingerprint across ranks ([`agree`]:
//!   one small all-reduce of a digest; the full fingerprints and call sites are
//!   exchanged only on a disagreement, or every time with `TESSERA_MPI_CHECK=1`),
//!   so mismatched calls fail with [`Error::Mismatch`] naming both ranks' call
//!   sites instead of MPI's undefined behaviour.
//! - A rank whose closure fails or panics prints why and calls `MPI_Abort`, which
//!   ends every process of the job. A watchdog thread ([`watchdog`]) aborts the
//!   job when a rank waits in a collective longer than the launch's timeout
//!   (`TESSERA_TIMEOUT_S`), so peers that never arrive never hang it. Its message
//!   names the collective and what each other rank of that collective's group
//!   says it is doing (the watchdogs answer each other over a control
//!   communicator of their own, even while their rank's main thread is stalled):
//!   "rank 1: outside any collective for 3.0 s (last: all_reduce #2 ...)", "rank 1
//!   exited (its process called exit) while this rank waited for it, ...", or
//!   "rank 1 did not answer (it exited, or is not responding)". A process tells
//!   its peers that it exits when it finalises MPI; after its closure returned it
//!   does so only in worlds of at most 64 ranks (it would cost n² messages), so in
//!   larger ones such a rank is reported as not answering.
//!
//! Layers, bottom up: `messages` (MPI's texts, aborting the job), `ops` (datatypes
//! and reduction operators), `status` and [`agree`] (what each rank is doing, and
//! the cross-rank check of a call's arguments), [`watchdog`], `runtime` (MPI's
//! initialisation, once per process), `call` (one MPI call), `comm` (the
//! [`Communicator`](crate::Communicator)), and this file (the rank's launch).

mod agree;
mod call;
mod comm;
mod messages;
mod ops;
mod runtime;
mod status;
mod watchdog;

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::Ordering;

use comm::MpiComm;
use messages::abort;
use runtime::runtime;

use crate::env::MpiEnv;
use crate::options::LaunchOptions;
use crate::rank::{BoxError, RankCtx, panic_message};
use crate::{Error, Result};

/// Runs `f` as this process's rank of an MPI job of `world_size` (at least 1) ranks.
pub(crate) fn launch<T, F>(opts: &LaunchOptions, world_size: usize, env: &MpiEnv, f: F) -> Result<Vec<T>>
where
    F: Fn(RankCtx) -> Result<T, BoxError>,
{
    let rt = runtime()?;
    if rt.world_size != world_size {
        return Err(Error::Launch(format!(
            "the job asks for {world_size} ranks but the MPI launcher ({}) started {} processes; start it with \
             `mpirun -n {world_size}` or ask for {} ranks",
            env.launcher, rt.world_size, rt.world_size
        )));
    }
    call::MODE.store(
        match (opts.fingerprints, opts.strict_collectives) {
            (false, _) => call::OFF,
            (true, false) => call::ON,
            (true, true) => call::STRICT,
        },
        Ordering::Relaxed,
    );
    watchdog::TIMEOUT_MS.store(
        u64::try_from(opts.timeout.as_millis()).unwrap_or(u64::MAX).max(1),
        Ordering::Relaxed,
    );
    let ctx = RankCtx::new(Box::new(MpiComm::world(rt)?), crate::context::next_job());
    status::set_closure_returned(false);
    // Ranks on this machine: OpenMPI names them; other launchers count as one.
    let local: usize = std::env::var("OMPI_COMM_WORLD_LOCAL_SIZE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let _intra = crate::intra_op::enter_intra_op(opts.threads_for(local), local);
    match catch_unwind(AssertUnwindSafe(|| f(ctx))) {
        Ok(Ok(out)) => {
            status::set_closure_returned(true);
            Ok(vec![out])
        }
        Ok(Err(e)) => abort(rt.world_rank, &format!("of {world_size} failed: {e}")),
        Err(payload) => abort(
            rt.world_rank,
            &format!("of {world_size} panicked: {}", panic_message(&*payload)),
        ),
    }
}
