//! [`LaunchOptions`]: how a launch runs (the collective timeout, the threads each
//! rank's kernels may use), read from `TESSERA_TIMEOUT_S` and
//! `TESSERA_THREADS_PER_RANK` by [`LaunchOptions::from_env`]. Every backend takes
//! them.

use std::time::Duration;

use crate::Result;
use crate::observe::OpLog;
use crate::vars::{DEFAULT_TIMEOUT, MAX_THREADS_PER_RANK, parse_threads, parse_timeout};

/// Options of [`launch_with`](crate::launch_with).
#[derive(Clone, Debug)]
pub struct LaunchOptions {
    /// How long a rank waits inside a collective for peers that have not arrived
    /// before the job fails with [`Error::Timeout`](crate::Error::Timeout) (threads; under MPI a watchdog
    /// aborts the job naming the collective), and how long [`launch`](crate::launch) waits for a
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
    /// Strict collectives: besides kind, sizes, dtype, reduction, root and tags,
    /// every rank must issue each collective from the same call site (the user's
    /// line, see [`callsite`](crate::callsite)). This catches same-shape
    /// collectives issued in a different order on different ranks (two
    /// `all_reduce`s swapped), which otherwise silently exchange each other's data.
    ///
    /// Off by default, for tests and debugging: legitimate SPMD code may issue one
    /// collective from different lines on different ranks (`if rank == 0 { ... }
    /// else { ... }` around a broadcast), which strict mode rejects.
    /// [`LaunchOptions::from_env`] reads `TESSERA_STRICT_COLLECTIVES`.
    ///
    /// PyTorch: `TORCH_DISTRIBUTED_DEBUG=DETAIL`'s collective fingerprint check,
    /// stricter (it compares call sites too).
    pub strict_collectives: bool,
    /// Whether collectives carry fingerprints (call site and tag) and compare
    /// them across ranks. On by default; under MPI it costs one small
    /// all-reduce per collective. Turn it off only to measure that cost
    /// (`TESSERA_FINGERPRINTS=0`); it also turns strict mode off.
    pub fingerprints: bool,
    /// The op log every rank prints to stderr as it runs
    /// ([`observe::echo_ops`](crate::observe::echo_ops)): off by default;
    /// [`LaunchOptions::from_env`] reads `TESSERA_DEBUG` (`ops`, `values`).
    pub debug_ops: OpLog,
}

impl Default for LaunchOptions {
    /// The defaults, whatever the environment says ([`LaunchOptions::from_env`] reads it).
    fn default() -> Self {
        LaunchOptions {
            timeout: DEFAULT_TIMEOUT,
            threads_per_rank: None,
            strict_collectives: false,
            fingerprints: true,
            debug_ops: OpLog::Off,
        }
    }
}

impl LaunchOptions {
    /// The options [`launch`](crate::launch) uses: the defaults, with the timeout from
    /// `TESSERA_TIMEOUT_S` (seconds, a decimal number such as `30` or `0.5`) and the
    /// threads per rank from `TESSERA_THREADS_PER_RANK` (a whole number from 1 to
    /// [`MAX_THREADS_PER_RANK`]) when they are set.
    ///
    /// # Errors
    /// [`Error::Launch`](crate::Error::Launch) naming the value when `TESSERA_TIMEOUT_S` is not a number of
    /// seconds between [`MIN_TIMEOUT`](crate::MIN_TIMEOUT) and [`MAX_TIMEOUT`](crate::MAX_TIMEOUT), `TESSERA_THREADS_PER_RANK`
    /// not a whole number in range, or any other Tessera variable set to a value it
    /// does not accept ([`vars::check`](crate::vars::check)).
    pub fn from_env() -> Result<LaunchOptions> {
        // Every Tessera variable first, so a typo anywhere stops the job here.
        crate::vars::check()?;
        let mut opts = LaunchOptions::default();
        if let Some(v) = std::env::var_os("TESSERA_TIMEOUT_S") {
            opts.timeout = parse_timeout(&v.to_string_lossy())?;
        }
        if let Some(v) = std::env::var_os("TESSERA_THREADS_PER_RANK") {
            opts.threads_per_rank = Some(parse_threads(&v.to_string_lossy())?);
        }
        if let Some(on) = crate::vars::flag("TESSERA_STRICT_COLLECTIVES")? {
            opts.strict_collectives = on;
        }
        if let Some(on) = crate::vars::flag("TESSERA_FINGERPRINTS")? {
            opts.fingerprints = on;
        }
        opts.debug_ops = crate::vars::debug()?;
        Ok(opts)
    }

    /// Sets strict collectives (see [`strict_collectives`](Self::strict_collectives)).
    pub fn strict_collectives(mut self, on: bool) -> Self {
        self.strict_collectives = on;
        self
    }

    /// Sets the op log every rank prints as it runs (see [`debug_ops`](Self::debug_ops)).
    pub fn debug_ops(mut self, log: OpLog) -> Self {
        self.debug_ops = log;
        self
    }

    /// Turns collective fingerprints on or off (see [`fingerprints`](Self::fingerprints)).
    pub fn fingerprints(mut self, on: bool) -> Self {
        self.fingerprints = on;
        self
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::intra_op::cores;
    use crate::vars::MAX_TIMEOUT;

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
}
