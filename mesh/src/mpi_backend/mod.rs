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
//! - `TESSERA_MPI_CHECK=1` compares every collective's arguments across ranks
//!   before running it ([`agree`]), so mismatched calls fail with
//!   [`Error::Mismatch`] instead of MPI's undefined behaviour.
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

mod agree;
mod comm;
mod ops;
mod status;
mod watchdog;

use std::os::raw::{c_char, c_int, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, OnceLock};

use mpi::environment::{Threading, Universe};
use mpi::ffi;

use crate::env::MpiEnv;
use crate::options::LaunchOptions;
use crate::rank::{BoxError, RankCtx, panic_message};
use crate::stats::CommStats;
use crate::{Error, Result};

pub(crate) use comm::MpiComm;
use ops::{Handle, Ops};
pub(crate) use status::Watch;

/// What this process knows once MPI is initialised.
pub(crate) struct Runtime {
    world_rank: usize,
    world_size: usize,
    ops: Ops,
    /// Counters shared by every communicator of this process (it is one rank).
    stats: Arc<CommStats>,
    /// The library's `MPI_IN_PLACE`, where known (OpenMPI, MPICH); otherwise in-place
    /// reductions go through a copy.
    in_place: Option<Handle<*mut c_void>>,
    /// `TESSERA_MPI_CHECK`: compare every collective's arguments across ranks first.
    check_calls: bool,
}

/// Set when Tessera initialised MPI itself: finalised at process exit.
static UNIVERSE: Mutex<Option<Universe>> = Mutex::new(None);
static RUNTIME: OnceLock<std::result::Result<Runtime, String>> = OnceLock::new();

extern "C" fn finalize_at_exit() {
    // Tell the peers' watchdogs, and stop this one's MPI calls, before MPI_Finalize.
    watchdog::finalizing(true);
    let universe = UNIVERSE.lock().map(|mut u| u.take()).unwrap_or(None);
    // Dropping the universe calls MPI_Finalize.
    drop(universe);
}

/// Initialises MPI (once per process) and returns the runtime.
pub(crate) fn runtime() -> Result<&'static Runtime> {
    RUNTIME.get_or_init(init).as_ref().map_err(|e| Error::Launch(e.clone()))
}

fn init() -> std::result::Result<Runtime, String> {
    if mpi::environment::is_finalized() {
        return Err("MPI was already finalized in this process".into());
    }
    let provided = if mpi::environment::is_initialized() {
        let mut level: c_int = 0;
        // SAFETY: MPI is initialised; `level` is a valid out-pointer.
        unsafe { ffi::MPI_Query_thread(&mut level) };
        // SAFETY: reading a predefined constant.
        (level == unsafe { ffi::RSMPI_THREAD_MULTIPLE }).then_some(Threading::Multiple)
    } else {
        let (universe, level) = mpi::initialize_with_threading(Threading::Multiple)
            .ok_or("MPI_Init_thread failed (MPI initialised concurrently?)")?;
        *UNIVERSE.lock().map_err(|_| "MPI state lock poisoned")? = Some(universe);
        // SAFETY: registering a plain `extern "C" fn` without arguments.
        unsafe { libc::atexit(finalize_at_exit) };
        (level == Threading::Multiple).then_some(level)
    };
    if provided.is_none() {
        return Err(
            "the MPI library does not provide MPI_THREAD_MULTIPLE, which Tessera's communication \
                    threads need (OpenMPI and MPICH do in their standard builds)"
                .into(),
        );
    }
    let (mut rank, mut size): (c_int, c_int) = (0, 0);
    // SAFETY: MPI is initialised; out-pointers are valid.
    unsafe {
        ffi::MPI_Comm_rank(ffi::RSMPI_COMM_WORLD, &mut rank);
        ffi::MPI_Comm_size(ffi::RSMPI_COMM_WORLD, &mut size);
    }
    let rt = Runtime {
        world_rank: usize::try_from(rank).map_err(|_| "negative MPI rank")?,
        world_size: usize::try_from(size).map_err(|_| "negative MPI world size")?,
        ops: Ops::create()?,
        stats: Arc::new(CommStats::default()),
        in_place: in_place_sentinel(),
        check_calls: std::env::var("TESSERA_MPI_CHECK").is_ok_and(|v| matches!(v.trim(), "1" | "true" | "yes")),
    };
    watchdog::start(rt.world_rank, rt.world_size, control_comm());
    Ok(rt)
}

/// A duplicate of `MPI_COMM_WORLD` for the watchdogs' own messages (collective
/// over the world, as `init` is); `None` if MPI refuses (the watchdog then only
/// names the collective).
fn control_comm() -> Option<ffi::MPI_Comm> {
    // SAFETY: MPI is initialised; reading a predefined handle.
    let mut raw = unsafe { ffi::RSMPI_COMM_NULL };
    // SAFETY: `raw` is a valid out-pointer.
    if unsafe { ffi::MPI_Comm_dup(ffi::RSMPI_COMM_WORLD, &mut raw) } != 0 {
        return None;
    }
    // SAFETY: `raw` is the communicator just created: a gone peer must return an
    // error to the watchdog, not abort the job.
    let rc = unsafe { ffi::MPI_Comm_set_errhandler(raw, ffi::RSMPI_ERRORS_RETURN) };
    (rc == 0).then_some(raw)
}

/// `MPI_IN_PLACE` is a macro the bindings cannot see: `(void *) 1` in OpenMPI,
/// `(void *) -1` in MPICH and its derivatives.
fn in_place_sentinel() -> Option<Handle<*mut c_void>> {
    let version = library_version();
    if version.contains("Open MPI") {
        Some(Handle(std::ptr::without_provenance_mut(1)))
    } else if version.contains("MPICH") || version.contains("Intel(R) MPI") {
        Some(Handle(std::ptr::without_provenance_mut(usize::MAX)))
    } else {
        None
    }
}

/// The first `len` characters MPI wrote into `buf`, as trimmed text.
fn mpi_text(buf: &[c_char], len: c_int) -> String {
    let bytes: Vec<u8> = buf[..usize::try_from(len).unwrap_or(0).min(buf.len())]
        .iter()
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).trim().to_string()
}

/// The MPI library's version string (`MPI_Get_library_version`).
pub(crate) fn library_version() -> String {
    let mut buf = vec![0 as c_char; 8192];
    let mut len: c_int = 0;
    // SAFETY: the buffer is larger than MPI_MAX_LIBRARY_VERSION_STRING.
    unsafe { ffi::MPI_Get_library_version(buf.as_mut_ptr(), &mut len) };
    mpi_text(&buf, len)
}

/// The text of an MPI error code.
pub(crate) fn error_string(code: c_int) -> String {
    let mut buf = vec![0 as c_char; 1024];
    let mut len: c_int = 0;
    // SAFETY: the buffer is larger than MPI_MAX_ERROR_STRING.
    let rc = unsafe { ffi::MPI_Error_string(code, buf.as_mut_ptr(), &mut len) };
    if rc != 0 {
        return format!("MPI error code {code}");
    }
    format!("{} (MPI error code {code})", mpi_text(&buf, len))
}

/// Prints why and ends every process of the job.
fn abort(world_rank: usize, why: &str) -> ! {
    abort_with(world_rank, why, &[])
}

/// Prints why, then each line of `details`, and ends every process of the job.
fn abort_with(world_rank: usize, why: &str, details: &[String]) -> ! {
    let mut text = format!("tessera: rank {world_rank} {why}; aborting the MPI job\n");
    for d in details {
        text += &format!("tessera: rank {world_rank}: {d}\n");
    }
    watchdog::write_stderr(&text);
    // SAFETY: MPI is initialised (only called after `runtime()` succeeded).
    unsafe { ffi::MPI_Abort(ffi::RSMPI_COMM_WORLD, 1) };
    // MPI_Abort does not return on any implementation we know; make sure.
    std::process::exit(1)
}

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
