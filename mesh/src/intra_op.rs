//! Intra-op parallelism: the threads one rank's kernels may use, and the team
//! of helper threads that runs a kernel's parts beside the rank's own thread.
//!
//! Each rank (each thread backend rank, or the process under MPI) gets
//! [`intra_op_threads`] threads: its own plus `threads - 1` helpers, started on
//! the first [`parallel_for`] and stopped when the rank's thread ends. The rank's
//! thread works on a part itself instead of handing the whole kernel to a pool
//! and sleeping until it is done, and the helpers spin for a moment after each
//! job before they park, so a step's GEMMs and element-wise kernels, a few
//! hundred microseconds apart, find them awake. Helpers spin only when the
//! machine's cores cover every rank's threads; otherwise they park at once and
//! leave the core to the other ranks.
//!
//! PyTorch: `at::parallel_for` over the intra-op thread pool
//! (`torch.get_num_threads`).

use std::cell::{Cell, RefCell};
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long a helper spins for the next job before it parks.
const SPIN: Duration = Duration::from_millis(1);

/// Cores this process may run on, read once: `available_parallelism` reads the
/// cgroup's CPU quota from files on every call, and kernels ask on every product.
pub(crate) fn cores() -> usize {
    static CORES: OnceLock<usize> = OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

thread_local! {
    /// This thread's intra-op threads, 0 outside a rank.
    static INTRA_OP: Cell<usize> = const { Cell::new(0) };
    /// Whether this rank's helpers may spin between jobs (the machine's cores
    /// cover every rank's threads).
    static SPIN_OK: Cell<bool> = const { Cell::new(true) };
    /// This thread's team, started on its first split job.
    static TEAM: RefCell<Option<Team>> = const { RefCell::new(None) };
    /// Whether this thread is running a part of a split job (a nested
    /// [`parallel_for`] then runs its parts in order on this thread).
    static IN_JOB: Cell<bool> = const { Cell::new(false) };
}

/// Threads the calling rank's kernels may use: the launch's
/// [`threads_per_rank`](crate::LaunchOptions::threads_per_rank) inside a rank (so
/// ranks × threads = cores by default), every core outside one, and 1 on a
/// helper thread.
///
/// PyTorch: `torch.get_num_threads`.
pub fn intra_op_threads() -> usize {
    match INTRA_OP.with(Cell::get) {
        0 => cores(),
        n => n,
    }
}

/// Sets the calling thread's [`intra_op_threads`] for as long as the guard lives
/// (a rank's thread, or the process under MPI), for `ranks_here` ranks on this
/// machine (helpers spin only while ranks × threads fit the cores).
pub(crate) fn enter_intra_op(threads: usize, ranks_here: usize) -> IntraOpGuard {
    let threads = threads.max(1);
    let before = INTRA_OP.with(|c| c.replace(threads));
    let spin = SPIN_OK.with(|c| c.replace(ranks_here.max(1).saturating_mul(threads) <= cores()));
    IntraOpGuard { before, spin }
}

/// Restores the thread's intra-op settings when dropped.
pub(crate) struct IntraOpGuard {
    before: usize,
    spin: bool,
}

impl Drop for IntraOpGuard {
    fn drop(&mut self) {
        INTRA_OP.with(|c| c.set(self.before));
        SPIN_OK.with(|c| c.set(self.spin));
    }
}

/// Runs `f(0)`, …, `f(parts - 1)` on the calling rank's [`intra_op_threads`]:
/// the calling thread and its helpers each take the next part not yet taken,
/// and the call returns when every part has returned. With one thread, one
/// part, or from inside a part (nested), the parts run in order on the calling
/// thread.
///
/// Parts should write disjoint outputs; how they are assigned to threads is
/// unspecified, so a result must not depend on it.
///
/// # Panics
/// Re-raises the first panic of a part on the calling thread, after every part
/// has finished.
///
/// PyTorch: `at::parallel_for`.
pub fn parallel_for(parts: usize, f: impl Fn(usize) + Sync) {
    let threads = intra_op_threads();
    if parts <= 1 || threads <= 1 || IN_JOB.with(Cell::get) {
        (0..parts).for_each(f);
        return;
    }
    TEAM.with(|cell| {
        let mut team = cell.borrow_mut();
        let spin = SPIN_OK.with(Cell::get);
        if team
            .as_ref()
            .is_none_or(|t| t.threads != threads || t.shared.spin != spin)
        {
            // Dropping the old team (threads changed) stops its helpers first.
            *team = None;
            *team = Some(Team::start(threads - 1, spin));
        }
        let team = team.as_ref().expect("started above");
        team.run(parts, &f);
    });
}

/// One split job, on the stack of the thread that runs [`parallel_for`].
struct Job<'a> {
    f: &'a (dyn Fn(usize) + Sync),
    parts: usize,
    /// The next part not yet taken.
    next: AtomicUsize,
    /// The first panic of a part.
    panic: Mutex<Option<Box<dyn std::any::Any + Send>>>,
}

impl Job<'_> {
    /// Takes and runs parts until none is left.
    fn work(&self) {
        loop {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            if i >= self.parts {
                return;
            }
            if let Err(p) = catch_unwind(AssertUnwindSafe(|| (self.f)(i))) {
                let mut first = self.panic.lock().unwrap_or_else(|e| e.into_inner());
                first.get_or_insert(p);
            }
        }
    }
}

/// State shared between a rank's thread and its helpers.
struct Shared {
    /// Bumped once per job (and at shutdown); helpers run each new epoch's job.
    epoch: AtomicU64,
    /// The current job (a `Job` on the rank thread's stack), valid while the
    /// rank thread waits in [`Team::run`].
    job: AtomicPtr<Job<'static>>,
    /// Helpers done with the current job.
    done: AtomicUsize,
    /// Per helper: parked (or about to), so the next job must unpark it.
    sleeping: Vec<AtomicBool>,
    stop: AtomicBool,
    spin: bool,
}

/// A rank's helper threads.
struct Team {
    shared: Arc<Shared>,
    helpers: Vec<JoinHandle<()>>,
    /// The intra-op threads it was started for.
    threads: usize,
}

impl Team {
    /// Starts `n` helpers (fewer if the system refuses threads: the rank's
    /// thread then takes their parts).
    fn start(n: usize, spin: bool) -> Team {
        let shared = Arc::new(Shared {
            epoch: AtomicU64::new(0),
            job: AtomicPtr::new(std::ptr::null_mut()),
            done: AtomicUsize::new(0),
            sleeping: (0..n).map(|_| AtomicBool::new(false)).collect(),
            stop: AtomicBool::new(false),
            spin,
        });
        let name = std::thread::current().name().unwrap_or("tessera").to_string();
        let helpers = (0..n)
            .map_while(|id| {
                let s = shared.clone();
                std::thread::Builder::new()
                    .name(format!("{name}-op{}", id + 1))
                    .spawn(move || helper(&s, id))
                    .ok()
            })
            .collect();
        Team {
            shared,
            helpers,
            threads: n + 1,
        }
    }

    /// Runs `parts` parts of `f` on this thread and the helpers.
    fn run(&self, parts: usize, f: &(dyn Fn(usize) + Sync)) {
        let job = Job {
            f,
            parts,
            next: AtomicUsize::new(0),
            panic: Mutex::new(None),
        };
        let s = &*self.shared;
        // The helpers read the job only between the epoch bump and their `done`
        // increment, and this function waits for every increment before `job`
        // goes out of scope.
        s.job
            .store((&raw const job).cast_mut().cast::<Job<'static>>(), Ordering::Relaxed);
        s.done.store(0, Ordering::Relaxed);
        s.epoch.fetch_add(1, Ordering::SeqCst);
        for (flag, h) in s.sleeping.iter().zip(&self.helpers) {
            if flag.swap(false, Ordering::SeqCst) {
                h.thread().unpark();
            }
        }
        IN_JOB.with(|c| c.set(true));
        job.work();
        IN_JOB.with(|c| c.set(false));
        let mut spins = 0u32;
        while s.done.load(Ordering::Acquire) < self.helpers.len() {
            spins += 1;
            if spins < 1 << 12 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        s.job.store(std::ptr::null_mut(), Ordering::Relaxed);
        if let Some(p) = job.panic.into_inner().unwrap_or_else(|e| e.into_inner()) {
            resume_unwind(p);
        }
    }
}

impl Drop for Team {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.epoch.fetch_add(1, Ordering::SeqCst);
        for h in &self.helpers {
            h.thread().unpark();
        }
        for handle in self.helpers.drain(..) {
            // A helper catches its parts' panics, so it cannot end in one.
            let _ = handle.join();
        }
    }
}

/// A helper's loop: wait for a new epoch (spinning up to [`SPIN`], then parked),
/// run the job's parts, report done.
fn helper(s: &Shared, id: usize) {
    // Kernels called from a part run on this thread alone.
    INTRA_OP.with(|c| c.set(1));
    IN_JOB.with(|c| c.set(true));
    let mut seen = 0u64;
    loop {
        let start = Instant::now();
        let mut spins = 0u32;
        while s.epoch.load(Ordering::Acquire) == seen {
            spins = spins.wrapping_add(1);
            if s.spin && (!spins.is_multiple_of(64) || start.elapsed() < SPIN) {
                std::hint::spin_loop();
                continue;
            }
            // Announce the park, then look once more: a job posted between the
            // two sees the flag (both SeqCst) and unparks this thread.
            s.sleeping[id].store(true, Ordering::SeqCst);
            if s.epoch.load(Ordering::SeqCst) == seen {
                std::thread::park();
            }
            s.sleeping[id].store(false, Ordering::SeqCst);
        }
        seen = s.epoch.load(Ordering::Acquire);
        if s.stop.load(Ordering::SeqCst) {
            return;
        }
        let job = s.job.load(Ordering::Relaxed);
        // SAFETY: the epoch bump (SeqCst, read with Acquire above) was made after
        // `job` was stored and before the poster waits for `done`; the job lives
        // on the poster's stack until every helper has incremented `done`.
        if let Some(job) = unsafe { job.as_ref() } {
            job.work();
        }
        s.done.fetch_add(1, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::LaunchOptions;

    #[test]
    fn every_part_runs_once_on_the_ranks_threads() {
        let opts = LaunchOptions::default().threads_per_rank(3);
        let seen = crate::launch_with(&opts, 2, |_| {
            let hits: Vec<AtomicUsize> = (0..100).map(|_| AtomicUsize::new(0)).collect();
            let threads = Mutex::new(std::collections::HashSet::new());
            for _ in 0..50 {
                parallel_for(hits.len(), |i| {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                    threads.lock().unwrap().insert(std::thread::current().id());
                    // Long enough that one thread cannot take every part.
                    std::thread::sleep(Duration::from_micros(20));
                });
            }
            let counts: Vec<usize> = hits.iter().map(|h| h.load(Ordering::Relaxed)).collect();
            Ok((counts, threads.into_inner().unwrap().len()))
        })
        .unwrap();
        for (counts, threads) in seen {
            assert!(counts.iter().all(|&c| c == 50), "{counts:?}");
            assert_eq!(threads, 3, "the rank's thread and its two helpers");
        }
    }

    #[test]
    fn one_thread_or_a_nested_call_runs_in_order_here() {
        let opts = LaunchOptions::default().threads_per_rank(1);
        let order = crate::launch_with(&opts, 1, |_| {
            let order = Mutex::new(Vec::new());
            parallel_for(5, |i| order.lock().unwrap().push((i, std::thread::current().id())));
            Ok(order.into_inner().unwrap())
        })
        .unwrap();
        let here: Vec<usize> = order[0].iter().map(|&(i, _)| i).collect();
        assert_eq!(here, [0, 1, 2, 3, 4]);
        let opts = LaunchOptions::default().threads_per_rank(2);
        let nested = crate::launch_with(&opts, 1, |_| {
            let inner = Mutex::new(Vec::new());
            parallel_for(2, |_| {
                let me = std::thread::current().id();
                parallel_for(3, |j| inner.lock().unwrap().push((me, j, std::thread::current().id())));
            });
            Ok(inner.into_inner().unwrap())
        })
        .unwrap();
        assert_eq!(nested[0].len(), 6);
        assert!(
            nested[0].iter().all(|&(outer, _, inner)| outer == inner),
            "a nested call stays on its part's thread"
        );
    }

    #[test]
    fn a_panicking_part_reaches_the_caller_after_the_others() {
        let opts = LaunchOptions::default().threads_per_rank(2);
        let out = crate::launch_with(&opts, 1, |_| {
            let done = AtomicUsize::new(0);
            let caught = catch_unwind(AssertUnwindSafe(|| {
                parallel_for(8, |i| {
                    if i == 3 {
                        panic!("part 3 failed");
                    }
                    done.fetch_add(1, Ordering::Relaxed);
                })
            }));
            let msg = caught.unwrap_err().downcast_ref::<&str>().map(|s| s.to_string());
            // The team still works after a panic.
            let after = AtomicUsize::new(0);
            parallel_for(4, |_| {
                after.fetch_add(1, Ordering::Relaxed);
            });
            Ok((done.into_inner(), msg, after.into_inner()))
        })
        .unwrap();
        assert_eq!(out[0], (7, Some("part 3 failed".to_string()), 4));
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn helpers_of_an_oversubscribed_rank_park_between_jobs() {
        // Jobs 200 µs apart: a helper allowed to spin would burn most of each gap
        // (it spins up to 1 ms). Ranks × threads beyond the cores forbid it.
        let opts = LaunchOptions::default().threads_per_rank(2);
        let out = crate::launch_with(&opts, 1, |_| {
            let _oversubscribed = enter_intra_op(2, cores() + 1);
            let me = std::thread::current().id();
            let helper = Mutex::new(None);
            while helper.lock().unwrap().is_none() {
                parallel_for(2, |_| {
                    std::thread::sleep(Duration::from_millis(1));
                    if std::thread::current().id() != me {
                        *helper.lock().unwrap() = Some(std::fs::read_link("/proc/thread-self").unwrap());
                    }
                });
            }
            let stat = std::path::Path::new("/proc")
                .join(helper.into_inner().unwrap().unwrap())
                .join("stat");
            let (before, wall) = (thread_cpu(&stat), Instant::now());
            for _ in 0..500 {
                parallel_for(2, |_| {});
                std::thread::sleep(Duration::from_micros(200));
            }
            Ok((thread_cpu(&stat) - before, wall.elapsed()))
        })
        .unwrap();
        let (cpu, wall) = out[0];
        assert!(cpu < wall / 5, "the helper used {cpu:?} of CPU in {wall:?}");
    }

    /// CPU time (user + system) of the thread whose /proc stat file is `stat`
    /// (in the kernel's fixed 100 ticks per second of its user interface).
    #[cfg(target_os = "linux")]
    fn thread_cpu(stat: &std::path::Path) -> Duration {
        let stat = std::fs::read_to_string(stat).expect("/proc stat");
        // Fields after the command name (which may contain spaces) in ')'.
        let rest = &stat[stat.rfind(')').expect("stat format") + 2..];
        let f: Vec<u64> = rest.split(' ').skip(11).take(2).map(|v| v.parse().unwrap()).collect();
        Duration::from_millis((f[0] + f[1]) * 10)
    }
}
