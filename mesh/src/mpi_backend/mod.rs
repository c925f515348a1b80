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
//!   ends every process of the job. A watchdog aborts the job, naming the
//!   collective, when a rank waits in one longer than the launch's timeout
//!   (`TESSERA_TIMEOUT_S`): peers that never arrive never hang it.

mod agree;
mod comm;
mod ops;

use std::os::raw::{c_char, c_int, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use mpi::environment::{Threading, Universe};
use mpi::ffi;

use crate::launcher::panic_message;
use crate::stats::CommStats;
use crate::{BoxError, Error, LaunchOptions, MpiEnv, OpKind, RankCtx, Result};

pub(crate) use comm::MpiComm;
use ops::{Handle, Ops};

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
    start_watchdog(rt.world_rank);
    Ok(rt)
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
    eprintln!("tessera: rank {world_rank} {why}; aborting the MPI job");
    // SAFETY: MPI is initialised (only called after `runtime()` succeeded).
    unsafe { ffi::MPI_Abort(ffi::RSMPI_COMM_WORLD, 1) };
    // MPI_Abort does not return on any implementation we know; make sure.
    std::process::exit(1)
}

/// Runs `f` as this process's rank of an MPI job.
pub(crate) fn launch<T, F>(opts: &LaunchOptions, world_size: usize, env: &MpiEnv, f: F) -> Result<Vec<T>>
where
    F: Fn(RankCtx) -> Result<T, BoxError>,
{
    if world_size == 0 {
        return Err(Error::Launch("world_size must be at least 1".into()));
    }
    let rt = runtime()?;
    if rt.world_size != world_size {
        return Err(Error::Launch(format!(
            "the job asks for {world_size} ranks but the MPI launcher ({}) started {} processes; start it with \
             `mpirun -n {world_size}` or ask for {} ranks",
            env.launcher, rt.world_size, rt.world_size
        )));
    }
    TIMEOUT_MS.store(
        u64::try_from(opts.timeout.as_millis()).unwrap_or(u64::MAX).max(1),
        Ordering::Relaxed,
    );
    let ctx = RankCtx::new(Box::new(MpiComm::world(rt)?), crate::context::next_job());
    match catch_unwind(AssertUnwindSafe(|| f(ctx))) {
        Ok(Ok(out)) => Ok(vec![out]),
        Ok(Err(e)) => abort(rt.world_rank, &format!("of {world_size} failed: {e}")),
        Err(payload) => abort(
            rt.world_rank,
            &format!("of {world_size} panicked: {}", panic_message(&*payload)),
        ),
    }
}

/// How long a collective may wait before the watchdog aborts the job.
static TIMEOUT_MS: AtomicU64 = AtomicU64::new(300_000);
/// Every live communicator's clock.
static WATCHED: Mutex<Vec<Weak<Watch>>> = Mutex::new(Vec::new());

/// Which collective a communicator is in, and since when (for the watchdog).
pub(crate) struct Watch {
    /// Milliseconds since `epoch()` plus one when the collective began; 0 when idle.
    since: AtomicU64,
    kind: AtomicUsize,
    seq: AtomicU64,
    rank: usize,
    size: usize,
}

fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

fn now_ms() -> u64 {
    u64::try_from(epoch().elapsed().as_millis()).unwrap_or(u64::MAX)
}

impl Watch {
    /// A registered clock for a communicator of `size` ranks in which this process is `rank`.
    pub(crate) fn new(rank: usize, size: usize) -> Arc<Watch> {
        let w = Arc::new(Watch {
            since: AtomicU64::new(0),
            kind: AtomicUsize::new(0),
            seq: AtomicU64::new(0),
            rank,
            size,
        });
        if let Ok(mut all) = WATCHED.lock() {
            all.retain(|w| w.strong_count() > 0);
            all.push(Arc::downgrade(&w));
        }
        w
    }

    /// Starts the clock of one collective; it stops when the guard drops.
    pub(crate) fn enter(&self, kind: OpKind) -> WatchGuard<'_> {
        let i = OpKind::ALL.iter().position(|&k| k == kind).unwrap_or(0);
        self.kind.store(i, Ordering::Relaxed);
        self.seq.fetch_add(1, Ordering::Relaxed);
        self.since.store(now_ms() + 1, Ordering::Release);
        WatchGuard(self)
    }
}

/// Stops a [`Watch`]'s clock on drop.
pub(crate) struct WatchGuard<'a>(&'a Watch);

impl Drop for WatchGuard<'_> {
    fn drop(&mut self) {
        self.0.since.store(0, Ordering::Release);
    }
}

fn start_watchdog(world_rank: usize) {
    let spawned = std::thread::Builder::new().name("tessera-mpi-watchdog".into()).spawn(move || {
        loop {
            let timeout = TIMEOUT_MS.load(Ordering::Relaxed);
            std::thread::sleep(Duration::from_millis((timeout / 10).clamp(10, 1000)));
            let now = now_ms();
            let live: Vec<Arc<Watch>> = match WATCHED.lock() {
                Ok(all) => all.iter().filter_map(Weak::upgrade).collect(),
                Err(_) => continue,
            };
            for w in live {
                let since = w.since.load(Ordering::Acquire);
                if since != 0 && now.saturating_sub(since - 1) > timeout {
                    let kind = OpKind::ALL[w.kind.load(Ordering::Relaxed).min(OpKind::ALL.len() - 1)];
                    abort(
                        world_rank,
                        &format!(
                            "waited {:.1} s in {kind} (collective #{} of its group of {} ranks, where it is rank {}) \
                             for peers that never arrived (raise TESSERA_TIMEOUT_S if they are only slow)",
                            (now - (since - 1)) as f64 / 1000.0,
                            w.seq.load(Ordering::Relaxed),
                            w.size,
                            w.rank
                        ),
                    );
                }
            }
        }
    });
    if let Err(e) = spawned {
        eprintln!("tessera: rank {world_rank}: could not start the MPI watchdog ({e}); collectives will not time out");
    }
}
