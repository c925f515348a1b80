//! The process's MPI runtime: MPI initialised once per process (at
//! `MPI_THREAD_MULTIPLE`, or taken as the application initialised it) and
//! finalised at process exit, with what every communicator of the process shares.

use std::os::raw::{c_int, c_void};
use std::sync::{Arc, Mutex, OnceLock};

use mpi::environment::{Threading, Universe};
use mpi::ffi;

use super::messages::library_version;
use super::ops::{Handle, Ops};
use super::watchdog;
use crate::stats::CommStats;
use crate::{Error, Result};

/// What this process knows once MPI is initialised.
pub(super) struct Runtime {
    pub(super) world_rank: usize,
    pub(super) world_size: usize,
    pub(super) ops: Ops,
    /// Counters shared by every communicator of this process (it is one rank).
    pub(super) stats: Arc<CommStats>,
    /// The library's `MPI_IN_PLACE`, where known (OpenMPI, MPICH); otherwise in-place
    /// reductions go through a copy.
    pub(super) in_place: Option<Handle<*mut c_void>>,
    /// `TESSERA_MPI_CHECK`: compare every collective's arguments across ranks first.
    pub(super) check_calls: bool,
}

/// Set when Tessera initialised MPI itself: finalised at process exit.
static UNIVERSE: Mutex<Option<Universe>> = Mutex::new(None);
static RUNTIME: OnceLock<std::result::Result<Runtime, String>> = OnceLock::new();

/// Registered with `atexit` when Tessera initialised MPI: finalises it.
extern "C" fn finalize_at_exit() {
    // Tell the peers' watchdogs, and stop this one's MPI calls, before MPI_Finalize.
    watchdog::finalizing(true);
    let universe = UNIVERSE.lock().map(|mut u| u.take()).unwrap_or(None);
    // Dropping the universe calls MPI_Finalize.
    drop(universe);
}

/// Initialises MPI (once per process) and returns the runtime.
pub(super) fn runtime() -> Result<&'static Runtime> {
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
        check_calls: crate::vars::flag_or("TESSERA_MPI_CHECK", false),
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
