//! [`launch`]: runs a closure on every rank of a job, on the backend the
//! environment calls for.
//!
//! - Started by `mpirun`/`mpiexec`/`srun` (an MPI launch, detected by
//!   [`mpi_env`] from the variables the launcher sets) and built with the `mpi`
//!   feature: this process is one rank; MPI is initialised (at
//!   `MPI_THREAD_MULTIPLE`) and the closure runs once, on this process's rank.
//! - Otherwise: the threads backend ([`threads::launch_with`](crate::threads::launch_with)),
//!   every rank a thread of this process.
//!
//! `TESSERA_BACKEND=threads` or `=mpi` overrides the detection. So one binary
//! runs either way: `cargo run --example train` or `mpirun -n 4 target/release/examples/train`.

use std::time::Duration;

#[cfg(not(feature = "mpi"))]
use crate::Error;
use crate::{Communicator, Result};

/// Any error a rank's closure returns (`?` converts every error type into it).
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// How long a rank waits in a collective for peers before giving up, unless
/// `TESSERA_TIMEOUT_S` says otherwise.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// The longest timeout `TESSERA_TIMEOUT_S` may set: one year (effectively none).
pub const MAX_TIMEOUT: Duration = Duration::from_secs(365 * 24 * 3600);

/// The shortest timeout `TESSERA_TIMEOUT_S` may set.
pub const MIN_TIMEOUT: Duration = Duration::from_millis(1);

/// Options of [`launch_with`].
#[derive(Clone, Debug)]
pub struct LaunchOptions {
    /// How long a rank waits inside a collective for peers that have not arrived
    /// before the job fails with [`Error::Timeout`](crate::Error::Timeout) (threads; under MPI a watchdog
    /// aborts the job naming the collective), and how long [`launch`] waits for a
    /// rank that has not returned once every other rank has. Default
    /// [`DEFAULT_TIMEOUT`]; [`LaunchOptions::from_env`] reads `TESSERA_TIMEOUT_S`.
    pub timeout: Duration,
    /// Threads each rank's kernels may use (intra-op parallelism: GEMMs split
    /// their output over them), read inside a rank by [`intra_op_threads`](crate::intra_op_threads).
    /// `None` (the default) divides the machine's cores among the ranks on it:
    /// `cores / ranks` with the threads backend, `cores / local ranks` under MPI
    /// (at least 1). [`LaunchOptions::from_env`] reads `TESSERA_THREADS_PER_RANK`.
    ///
    /// PyTorch: `torch.set_num_threads` in each rank (torchrun sets
    /// `OMP_NUM_THREADS=1` when several ranks share a machine).
    pub threads_per_rank: Option<usize>,
}

impl Default for LaunchOptions {
    /// The defaults, whatever the environment says ([`LaunchOptions::from_env`] reads it).
    fn default() -> Self {
        LaunchOptions {
            timeout: DEFAULT_TIMEOUT,
            threads_per_rank: None,
        }
    }
}

impl LaunchOptions {
    /// The options [`launch`] uses: the defaults, with the timeout from
    /// `TESSERA_TIMEOUT_S` (seconds, a decimal number such as `30` or `0.5`) and the
    /// threads per rank from `TESSERA_THREADS_PER_RANK` (a whole number from 1 to
    /// [`MAX_THREADS_PER_RANK`]) when they are set.
    ///
    /// # Errors
    /// [`Error::Launch`](crate::Error::Launch) naming the value when `TESSERA_TIMEOUT_S` is not a number of
    /// seconds between [`MIN_TIMEOUT`] and [`MAX_TIMEOUT`], or `TESSERA_THREADS_PER_RANK`
    /// not a whole number in range.
    pub fn from_env() -> Result<LaunchOptions> {
        let mut opts = LaunchOptions::default();
        if let Some(v) = std::env::var_os("TESSERA_TIMEOUT_S") {
            opts.timeout = parse_timeout(&v.to_string_lossy())?;
        }
        if let Some(v) = std::env::var_os("TESSERA_THREADS_PER_RANK") {
            opts.threads_per_rank = Some(parse_threads(&v.to_string_lossy())?);
        }
        Ok(opts)
    }

    /// Sets the threads each rank's kernels may use (see
    /// [`threads_per_rank`](Self::threads_per_rank)).
    pub fn threads_per_rank(mut self, threads: usize) -> Self {
        self.threads_per_rank = Some(threads.clamp(1, MAX_THREADS_PER_RANK));
        self
    }

    /// The threads per rank for `ranks_here` ranks on this machine: the option,
    /// or the cores divided among them (at least 1).
    pub(crate) fn threads_for(&self, ranks_here: usize) -> usize {
        self.threads_per_rank
            .unwrap_or_else(|| (crate::intra_op::cores() / ranks_here.max(1)).max(1))
    }

    /// Sets the collective timeout.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }
}

/// The most threads per rank `TESSERA_THREADS_PER_RANK` may set.
pub const MAX_THREADS_PER_RANK: usize = 1024;

/// Parses a `TESSERA_THREADS_PER_RANK` value: a whole number in 1..=[`MAX_THREADS_PER_RANK`].
fn parse_threads(v: &str) -> Result<usize> {
    match v.trim().parse::<usize>() {
        Ok(n) if (1..=MAX_THREADS_PER_RANK).contains(&n) => Ok(n),
        _ => Err(crate::Error::Launch(format!(
            "TESSERA_THREADS_PER_RANK={v:?} is not a whole number from 1 to {MAX_THREADS_PER_RANK} \
             (unset means the cores divided among the ranks on this machine)"
        ))),
    }
}

/// Parses a `TESSERA_TIMEOUT_S` value: seconds within [`MIN_TIMEOUT`]..=[`MAX_TIMEOUT`].
fn parse_timeout(v: &str) -> Result<Duration> {
    let bad = |why: &str| {
        crate::Error::Launch(format!(
            "TESSERA_TIMEOUT_S={v:?} {why}; give seconds between {} and {} (unset means {})",
            MIN_TIMEOUT.as_secs_f64(),
            MAX_TIMEOUT.as_secs(),
            DEFAULT_TIMEOUT.as_secs()
        ))
    };
    let s: f64 = v.trim().parse().map_err(|_| bad("is not a number"))?;
    if !s.is_finite() {
        return Err(bad("is not finite"));
    }
    if s < MIN_TIMEOUT.as_secs_f64() {
        return Err(bad("is too short"));
    }
    if s > MAX_TIMEOUT.as_secs_f64() {
        return Err(bad("is too long"));
    }
    Ok(Duration::from_secs_f64(s))
}

/// What a rank's closure receives: its world communicator.
pub struct RankCtx {
    comm: Box<dyn Communicator>,
    job: u64,
}

impl RankCtx {
    pub(crate) fn new(comm: Box<dyn Communicator>, job: u64) -> RankCtx {
        RankCtx { comm, job }
    }
    /// This rank, `0..world_size`.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }
    /// Number of ranks in the job.
    pub fn world_size(&self) -> usize {
        self.comm.size()
    }
    /// The world communicator.
    pub fn comm(&self) -> &dyn Communicator {
        &*self.comm
    }
    /// Takes the world communicator (to build a [`DeviceMesh`](crate::DeviceMesh) over it).
    pub fn into_comm(self) -> Box<dyn Communicator> {
        self.comm
    }
    /// The job's process-unique number.
    pub fn job(&self) -> u64 {
        self.job
    }
}

/// An MPI launch, as read from the environment of this process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MpiEnv {
    /// Which launcher's variables were found (`"OpenMPI"`, `"PMI"`, `"PMIx"`).
    pub launcher: &'static str,
    /// This process's rank in the MPI world.
    pub rank: usize,
    /// The number of processes, where the launcher says (PMIx alone does not).
    pub size: Option<usize>,
}

/// Detects an MPI launch from the environment: OpenMPI's
/// `OMPI_COMM_WORLD_RANK`/`OMPI_COMM_WORLD_SIZE`, then PMI's `PMI_RANK`/`PMI_SIZE`
/// (MPICH, Intel MPI, Slurm with PMI-2), then PMIx's `PMIX_RANK`. `None` when none
/// is set, or when `TESSERA_BACKEND=threads` asks for the threads backend.
///
/// ```
/// // `cargo test` is not started by mpirun.
/// if std::env::var_os("OMPI_COMM_WORLD_SIZE").is_none()
///     && std::env::var_os("PMI_SIZE").is_none()
///     && std::env::var_os("PMIX_RANK").is_none()
/// {
///     assert_eq!(tessera_mesh::mpi_env(), None);
/// }
/// ```
pub fn mpi_env() -> Option<MpiEnv> {
    mpi_env_from(|k| std::env::var(k).ok())
}

fn mpi_env_from(var: impl Fn(&str) -> Option<String>) -> Option<MpiEnv> {
    if var("TESSERA_BACKEND").is_some_and(|b| b.trim() == "threads") {
        return None;
    }
    let num = |k: &str| var(k).and_then(|v| v.trim().parse::<usize>().ok());
    let found = [
        ("OpenMPI", "OMPI_COMM_WORLD_RANK", Some("OMPI_COMM_WORLD_SIZE")),
        ("PMI", "PMI_RANK", Some("PMI_SIZE")),
        ("PMIx", "PMIX_RANK", None),
    ]
    .into_iter()
    .find_map(|(launcher, rank, size)| {
        Some(MpiEnv {
            launcher,
            rank: num(rank)?,
            size: size.and_then(num),
        })
    });
    match found {
        Some(env) => Some(env),
        // Forced MPI with no launcher variables: a singleton MPI process.
        None if var("TESSERA_BACKEND").is_some_and(|b| b.trim() == "mpi") => Some(MpiEnv {
            launcher: "TESSERA_BACKEND=mpi",
            rank: 0,
            size: None,
        }),
        None => None,
    }
}

/// Whether this process should print the job's summaries: always with the threads
/// backend, on world rank 0 only under MPI.
pub fn is_lead_process() -> bool {
    mpi_env().is_none_or(|e| e.rank == 0)
}

/// Runs `f` on every rank of a `world_size`-rank job with the options of
/// [`LaunchOptions::from_env`].
///
/// Returns the results of the ranks this process ran, in rank order: every rank's
/// with the threads backend, this process's own (one element) under MPI.
///
/// The closure owns what it uses (`'static`, as for [`std::thread::spawn`]): with
/// the threads backend a rank stuck outside any collective is left running,
/// detached, when `launch` gives up on it. Move inputs in (`move |ctx| ...`),
/// sharing large ones through an `Arc`.
///
/// # Errors
/// [`Error::Launch`](crate::Error::Launch) for `world_size == 0`, an invalid `TESSERA_TIMEOUT_S`, an MPI
/// launch whose process count is not `world_size`, or an MPI launch of a build
/// without the `mpi` feature;
/// [`Error::RankFailed`](crate::Error::RankFailed) naming the first rank that failed, or a rank still in its
/// closure a timeout after every other rank returned (threads backend; under
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
    match mpi_env() {
        None => crate::threads::launch_with(opts, world_size, f),
        Some(env) => launch_mpi(opts, world_size, &env, f),
    }
}

#[cfg(feature = "mpi")]
fn launch_mpi<T, F>(opts: &LaunchOptions, world_size: usize, env: &MpiEnv, f: F) -> Result<Vec<T>>
where
    F: Fn(RankCtx) -> Result<T, BoxError>,
{
    crate::mpi_backend::launch(opts, world_size, env, f)
}

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

/// The text of a panic payload (`&str` or `String`).
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic payload".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::intra_op::{cores, intra_op_threads};

    #[test]
    fn threads_per_rank_values() {
        assert_eq!(parse_threads("3").unwrap(), 3);
        assert_eq!(parse_threads(" 1 ").unwrap(), 1);
        for bad in ["0", "-1", "two", "1.5", "", "1025"] {
            let e = parse_threads(bad).unwrap_err().to_string();
            assert!(
                e.contains("TESSERA_THREADS_PER_RANK") && e.contains(&format!("{bad:?}")),
                "{e}"
            );
        }
        let opts = LaunchOptions::default();
        assert_eq!(opts.threads_for(1), cores());
        assert_eq!(
            opts.threads_for(cores() * 4),
            1,
            "more ranks than cores: one thread each"
        );
        assert_eq!(opts.clone().threads_per_rank(5).threads_for(64), 5);
        assert_eq!(opts.threads_per_rank(0).threads_per_rank, Some(1));
    }

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

    fn env(vars: &[(&str, &str)]) -> Option<MpiEnv> {
        let vars: Vec<(String, String)> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        mpi_env_from(|k| vars.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone()))
    }

    #[test]
    fn detects_each_launcher() {
        assert_eq!(env(&[]), None);
        let ompi = env(&[("OMPI_COMM_WORLD_RANK", "3"), ("OMPI_COMM_WORLD_SIZE", "4")]);
        assert_eq!(
            ompi,
            Some(MpiEnv {
                launcher: "OpenMPI",
                rank: 3,
                size: Some(4)
            })
        );
        let pmi = env(&[("PMI_RANK", "1"), ("PMI_SIZE", "2")]).unwrap();
        assert_eq!((pmi.launcher, pmi.rank, pmi.size), ("PMI", 1, Some(2)));
        let pmix = env(&[("PMIX_RANK", "0")]).unwrap();
        assert_eq!((pmix.launcher, pmix.size), ("PMIx", None));
        // OpenMPI sets PMIx variables too; its own win.
        let both = env(&[
            ("PMIX_RANK", "2"),
            ("OMPI_COMM_WORLD_RANK", "2"),
            ("OMPI_COMM_WORLD_SIZE", "8"),
        ])
        .unwrap();
        assert_eq!((both.launcher, both.size), ("OpenMPI", Some(8)));
    }

    #[test]
    fn backend_override() {
        let forced = [
            ("TESSERA_BACKEND", "threads"),
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
        ];
        assert_eq!(env(&forced), None);
        let mpi = env(&[("TESSERA_BACKEND", "mpi")]).unwrap();
        assert_eq!((mpi.rank, mpi.size), (0, None));
        // Unparsable values are not a launch.
        assert_eq!(
            env(&[("OMPI_COMM_WORLD_RANK", "x"), ("OMPI_COMM_WORLD_SIZE", "2")]),
            None
        );
    }

    #[test]
    fn timeout_values() {
        macro_rules! ok {
            ($v:expr, $want:expr) => {
                assert_eq!(parse_timeout($v).unwrap(), $want, "{}", $v)
            };
        }
        macro_rules! bad {
            ($v:expr, $why:expr) => {{
                let msg = parse_timeout($v).unwrap_err().to_string();
                assert!(
                    msg.contains($why) && msg.contains("TESSERA_TIMEOUT_S"),
                    "{}: {msg}",
                    $v
                );
            }};
        }
        ok!("30", Duration::from_secs(30));
        ok!(" 0.5 ", Duration::from_millis(500));
        ok!("0.001", Duration::from_millis(1));
        ok!("31536000", MAX_TIMEOUT);
        bad!("0", "too short");
        bad!("1e-300", "too short");
        bad!("-3", "too short");
        bad!("1e20", "too long");
        bad!("1e300", "too long");
        bad!("18446744073709551616", "too long");
        bad!("inf", "not finite");
        bad!("NaN", "not finite");
        bad!("ten", "not a number");
        bad!("", "not a number");
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
