//! Tessera's environment variables, read with one policy: unset means the
//! default; a value outside the accepted ones is an error naming the variable,
//! the value and what it accepts (never silently ignored or misread).
//! [`check`] validates all of them, and [`launch`](crate::launch) runs it first,
//! so a typo stops a job before it starts.
//!
//! | variable | accepts | default |
//! |---|---|---|
//! | `TESSERA_BACKEND` | `threads`, `mpi` | detected from the launcher's variables |
//! | `TESSERA_TIMEOUT_S` | seconds, 0.001 to 31536000 | 300 |
//! | `TESSERA_THREADS_PER_RANK` | 1 to 1024 | the cores divided among the ranks |
//! | `TESSERA_BF16_DOT` | a flag | on where the CPU has AVX512_BF16 |
//! | `TESSERA_SYSTEM_MALLOC` | a flag | off (`malloc` tuned to keep freed memory) |
//! | `TESSERA_MPI_CHECK` | a flag | off (under MPI, exchange every call's full fingerprint, not only its hash) |
//! | `TESSERA_STRICT_COLLECTIVES` | a flag | off (call sites need not match; see `LaunchOptions::strict_collectives`) |
//! | `TESSERA_FINGERPRINTS` | a flag | on (collectives compare call sites' tags; off only to measure the cost) |
//! | `TESSERA_DEBUG` | `off`, `ops`, `values` | `off` (`ops`: every rank prints each DTensor op and redistribute as it runs, see [`observe::echo_ops`](crate::observe::echo_ops); `values`: with each output's global sums) |
//!
//! A flag is `1`, `true`, `yes`, `on` or `0`, `false`, `no`, `off` (any case).
//!
//! ```
//! use tessera_mesh::vars;
//!
//! assert_eq!(vars::parse_flag("TESSERA_BF16_DOT", "false").unwrap(), false);
//! let e = vars::parse_choice("TESSERA_BACKEND", "bogus", &["threads", "mpi"]).unwrap_err();
//! assert!(e.to_string().contains("accepted: threads, mpi"));
//! ```

use std::time::Duration;

use crate::{Error, Result};

/// How long a rank waits in a collective for peers before giving up, unless
/// `TESSERA_TIMEOUT_S` says otherwise.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);
/// The longest timeout `TESSERA_TIMEOUT_S` may set: one year (effectively none).
pub const MAX_TIMEOUT: Duration = Duration::from_secs(365 * 24 * 3600);
/// The shortest timeout `TESSERA_TIMEOUT_S` may set.
pub const MIN_TIMEOUT: Duration = Duration::from_millis(1);

/// The values `TESSERA_BACKEND` accepts.
pub const BACKENDS: &[&str] = &["threads", "mpi"];

/// The values `TESSERA_DEBUG` accepts.
pub const DEBUG_LEVELS: &[&str] = &["off", "ops", "values"];

/// The flags: variables that switch something on or off.
const FLAGS: &[&str] = &[
    "TESSERA_BF16_DOT",
    "TESSERA_SYSTEM_MALLOC",
    "TESSERA_MPI_CHECK",
    "TESSERA_STRICT_COLLECTIVES",
    "TESSERA_FINGERPRINTS",
];

const TRUE: &[&str] = &["1", "true", "yes", "on"];
const FALSE: &[&str] = &["0", "false", "no", "off"];

/// Parses the value `v` of the flag `name`.
///
/// # Errors
/// [`Error::Launch`] naming the variable, the value and the accepted spellings.
pub fn parse_flag(name: &str, v: &str) -> Result<bool> {
    let t = v.trim().to_ascii_lowercase();
    if TRUE.contains(&t.as_str()) {
        Ok(true)
    } else if FALSE.contains(&t.as_str()) {
        Ok(false)
    } else {
        Err(Error::Launch(format!(
            "{name}={v:?} is not a flag; accepted: {} (on) or {} (off), or unset for the default",
            TRUE.join(", "),
            FALSE.join(", ")
        )))
    }
}

/// Parses the value `v` of `name`, which must be one of `accepted`.
///
/// # Errors
/// [`Error::Launch`] naming the variable, the value and the accepted values.
pub fn parse_choice(name: &str, v: &str, accepted: &[&'static str]) -> Result<&'static str> {
    let t = v.trim();
    accepted.iter().copied().find(|a| *a == t).ok_or_else(|| {
        Error::Launch(format!(
            "{name}={v:?} is not an accepted value; accepted: {}, or unset for the default",
            accepted.join(", ")
        ))
    })
}

/// The flag `name` from the environment: `None` when unset.
///
/// # Errors
/// A value that is not a flag ([`parse_flag`]).
pub fn flag(name: &str) -> Result<Option<bool>> {
    flag_from(name, |k| std::env::var(k).ok())
}

/// The flag `name` from the environment, or `default` when unset or (for
/// readers that cannot fail, such as a kernel's dispatch) not a flag: a bad
/// value has already failed [`check`] at launch.
pub fn flag_or(name: &str, default: bool) -> bool {
    flag(name).ok().flatten().unwrap_or(default)
}

/// `TESSERA_BACKEND` from the environment: `None` when unset.
///
/// # Errors
/// A value other than `threads` or `mpi`.
pub fn backend() -> Result<Option<&'static str>> {
    backend_from(|k| std::env::var(k).ok())
}

/// `TESSERA_DEBUG` from the environment: the op log every rank prints as it
/// runs ([`OpLog::Off`](crate::observe::OpLog::Off) when unset).
///
/// # Errors
/// A value other than `off`, `ops` or `values`.
pub fn debug() -> Result<crate::observe::OpLog> {
    debug_from(|k| std::env::var(k).ok())
}

pub(crate) fn debug_from(var: impl Fn(&str) -> Option<String>) -> Result<crate::observe::OpLog> {
    use crate::observe::OpLog;
    Ok(match var("TESSERA_DEBUG") {
        None => OpLog::Off,
        Some(v) => match parse_choice("TESSERA_DEBUG", &v, DEBUG_LEVELS)? {
            "ops" => OpLog::Ops,
            "values" => OpLog::Values,
            _ => OpLog::Off,
        },
    })
}

fn flag_from(name: &str, var: impl Fn(&str) -> Option<String>) -> Result<Option<bool>> {
    var(name).map(|v| parse_flag(name, &v)).transpose()
}

pub(crate) fn backend_from(var: impl Fn(&str) -> Option<String>) -> Result<Option<&'static str>> {
    var("TESSERA_BACKEND")
        .map(|v| parse_choice("TESSERA_BACKEND", &v, BACKENDS))
        .transpose()
}

/// Validates every Tessera variable that is set (the table above).
///
/// # Errors
/// The first variable with a value it does not accept, named with the value
/// and what it accepts.
pub fn check() -> Result<()> {
    check_from(|k| std::env::var(k).ok())
}

pub(crate) fn check_from(var: impl Fn(&str) -> Option<String>) -> Result<()> {
    backend_from(&var)?;
    debug_from(&var)?;
    for name in FLAGS {
        flag_from(name, &var)?;
    }
    if let Some(v) = var("TESSERA_TIMEOUT_S") {
        parse_timeout(&v)?;
    }
    if let Some(v) = var("TESSERA_THREADS_PER_RANK") {
        parse_threads(&v)?;
    }
    Ok(())
}

/// The most threads per rank `TESSERA_THREADS_PER_RANK` may set.
pub const MAX_THREADS_PER_RANK: usize = 1024;

/// Parses a `TESSERA_THREADS_PER_RANK` value: a whole number in 1..=[`MAX_THREADS_PER_RANK`].
pub(crate) fn parse_threads(v: &str) -> Result<usize> {
    match v.trim().parse::<usize>() {
        Ok(n) if (1..=MAX_THREADS_PER_RANK).contains(&n) => Ok(n),
        _ => Err(Error::Launch(format!(
            "TESSERA_THREADS_PER_RANK={v:?} is not a whole number from 1 to {MAX_THREADS_PER_RANK} \
             (unset means the cores divided among the ranks on this machine)"
        ))),
    }
}

/// Parses a `TESSERA_TIMEOUT_S` value: seconds within [`MIN_TIMEOUT`]..=[`MAX_TIMEOUT`].
pub(crate) fn parse_timeout(v: &str) -> Result<Duration> {
    let bad = |why: &str| {
        Error::Launch(format!(
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

#[cfg(test)]
mod tests {
    use super::*;

    fn with(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let vars: Vec<(String, String)> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k| vars.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
    }

    #[test]
    fn flags_accept_every_spelling_and_nothing_else() {
        for v in ["1", "true", "TRUE", " yes ", "On"] {
            assert!(parse_flag("TESSERA_X", v).unwrap(), "{v}");
        }
        for v in ["0", "false", "No", "off"] {
            assert!(!parse_flag("TESSERA_X", v).unwrap(), "{v}");
        }
        for v in ["", "2", "enabled", "fals"] {
            let e = parse_flag("TESSERA_BF16_DOT", v).unwrap_err().to_string();
            assert!(
                e.contains("TESSERA_BF16_DOT=") && e.contains("accepted: 1, true"),
                "{e}"
            );
        }
    }

    #[test]
    fn debug_names_an_op_log() {
        use crate::observe::OpLog;
        let read = |v: &str| debug_from(with(&[("TESSERA_DEBUG", v)]));
        assert_eq!(debug_from(with(&[])).unwrap(), OpLog::Off);
        assert_eq!(read("off").unwrap(), OpLog::Off);
        assert_eq!(read("ops").unwrap(), OpLog::Ops);
        assert_eq!(read(" values ").unwrap(), OpLog::Values);
        let e = read("1").unwrap_err().to_string();
        assert!(
            e.contains("TESSERA_DEBUG=\"1\"") && e.contains("accepted: off, ops, values"),
            "{e}"
        );
    }

    #[test]
    fn every_variable_is_checked_with_one_policy() {
        assert!(check_from(with(&[])).is_ok());
        assert!(
            check_from(with(&[
                ("TESSERA_BACKEND", "mpi"),
                ("TESSERA_BF16_DOT", "false"),
                ("TESSERA_TIMEOUT_S", "30"),
                ("TESSERA_THREADS_PER_RANK", "2"),
            ]))
            .is_ok()
        );
        for (k, v, says) in [
            ("TESSERA_BACKEND", "bogus", "accepted: threads, mpi"),
            ("TESSERA_BF16_DOT", "nope", "not a flag"),
            ("TESSERA_SYSTEM_MALLOC", "yes please", "not a flag"),
            ("TESSERA_MPI_CHECK", "2", "not a flag"),
            ("TESSERA_STRICT_COLLECTIVES", "strict", "not a flag"),
            ("TESSERA_FINGERPRINTS", "maybe", "not a flag"),
            ("TESSERA_TIMEOUT_S", "soon", "TESSERA_TIMEOUT_S"),
            ("TESSERA_THREADS_PER_RANK", "0", "TESSERA_THREADS_PER_RANK"),
            ("TESSERA_DEBUG", "all", "accepted: off, ops, values"),
        ] {
            let e = check_from(with(&[(k, v)])).unwrap_err().to_string();
            assert!(e.contains(says) && e.contains(v), "{k}={v}: {e}");
        }
        // Unset and set-to-default are different: `false` is read as off.
        assert_eq!(
            flag_from("TESSERA_BF16_DOT", with(&[("TESSERA_BF16_DOT", "false")])).unwrap(),
            Some(false)
        );
        assert_eq!(flag_from("TESSERA_BF16_DOT", with(&[])).unwrap(), None);
    }
}
