//! Small helpers shared by the examples (`bench_*` and `train`, included with `#[path]`):
//! command-line flags, medians, and JSON written atomically.
//!
//! No dependencies beyond std, so a benchmark adds nothing to the build.
#![allow(dead_code)]

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

pub(crate) mod peak;

/// The flags every benchmark takes: `--json PATH` and `--iters N`.
#[derive(Clone, Debug)]
pub(crate) struct BenchArgs {
    /// Where to write the JSON records, if anywhere.
    pub json: Option<PathBuf>,
    /// Timed iterations per case.
    pub iters: usize,
}

/// What `parse_args` returns when the user asked for `--help`.
pub(crate) const HELP: &str = "help";

/// A benchmark's `main` around its parsed flags: `--help` prints `usage` (exit 0);
/// a bad flag prints the message and `usage` (exit 2); otherwise it runs `run`
/// and prints its error, if any, as `name: error: ...` (exit 1).
pub(crate) fn bench_main<A, E: std::fmt::Display>(
    name: &str,
    usage: &str,
    parsed: Result<A, String>,
    run: impl FnOnce(&A) -> Result<(), E>,
) -> std::process::ExitCode {
    use std::process::ExitCode;
    let args = match parsed {
        Ok(a) => a,
        Err(msg) if msg == HELP => {
            println!("{usage}");
            return ExitCode::SUCCESS;
        }
        Err(msg) => {
            eprintln!("{name}: {msg}\n{usage}");
            return ExitCode::from(2);
        }
    };
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{name}: error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Parses `--json PATH`, `--iters N` (also `--flag=value`) and `--help`.
///
/// # Errors
/// A message for the user (unknown flag, missing or bad value, a `--json` folder
/// that does not exist): print it with the usage and exit nonzero. `--help` gives
/// the message [`HELP`]: print the usage and exit zero.
pub(crate) fn parse_args(args: impl IntoIterator<Item = String>, default_iters: usize) -> Result<BenchArgs, String> {
    parse_args_with(args, default_iters, |_, _| Ok(false))
}

/// [`parse_args`] with a benchmark's own flags: `extra` is handed each flag
/// that is not `--json` or `--iters` (with the function that fetches its
/// value) and says whether it took it; a flag nobody takes is an error.
///
/// # Errors
/// As [`parse_args`], and the first message `extra` gives.
pub(crate) fn parse_args_with(
    args: impl IntoIterator<Item = String>,
    default_iters: usize,
    mut extra: impl FnMut(&str, &mut dyn FnMut(&str) -> Result<String, String>) -> Result<bool, String>,
) -> Result<BenchArgs, String> {
    let mut out = BenchArgs {
        json: None,
        iters: default_iters,
    };
    parse_flags(args, |flag, value| {
        match flag {
            "--json" => out.json = Some(json_path(&value("a file path")?)?),
            "--iters" => out.iters = positive(flag, &value("a positive integer")?)?,
            other => {
                if !extra(other, value)? {
                    return Err(format!("unknown argument {other:?}"));
                }
            }
        }
        Ok(())
    })?;
    Ok(out)
}

/// Walks `--flag value` / `--flag=value` pairs, handing each flag to `on` with a
/// function that fetches its value (naming `what` it expects when missing).
/// `-h`/`--help` gives [`HELP`].
///
/// # Errors
/// The first message `on` or a missing value gives.
pub(crate) fn parse_flags(
    args: impl IntoIterator<Item = String>,
    mut on: impl FnMut(&str, &mut dyn FnMut(&str) -> Result<String, String>) -> Result<(), String>,
) -> Result<(), String> {
    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f.to_string(), Some(v.to_string())),
            _ => (arg.clone(), None),
        };
        if flag == "-h" || flag == "--help" {
            return Err(HELP.to_string());
        }
        let mut value = |what: &str| -> Result<String, String> {
            match inline.clone().or_else(|| args.next()) {
                Some(v) if !v.is_empty() => Ok(v),
                _ => Err(format!("{flag} needs a value ({what})")),
            }
        };
        on(&flag, &mut value)?;
    }
    Ok(())
}

/// `v` as a positive integer for `flag`.
///
/// # Errors
/// Anything else.
pub(crate) fn positive(flag: &str, v: &str) -> Result<usize, String> {
    match v.parse::<usize>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(format!("{flag} takes a positive integer, got {v:?}")),
    }
}

/// The `--json` path, checked early (see [`check_writable_dir`]).
///
/// # Errors
/// A folder, or a file in a folder that does not exist.
pub(crate) fn json_path(v: &str) -> Result<PathBuf, String> {
    let path = PathBuf::from(v);
    check_writable_dir(&path)?;
    Ok(path)
}

/// Fails early (before minutes of benchmarking) when `path`'s folder does not exist.
fn check_writable_dir(path: &Path) -> Result<(), String> {
    if path.file_name().is_none() || path.is_dir() {
        return Err(format!("--json {}: give a file path, not a folder", path.display()));
    }
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    if !dir.is_dir() {
        return Err(format!(
            "--json {}: folder {} does not exist; create it first",
            path.display(),
            dir.display()
        ));
    }
    Ok(())
}

/// Timed iterations for a collective on a buffer of `mib` MiB (`given`, from
/// `--iters`, overrides when nonzero).
pub(crate) fn iters_for(mib: usize, given: usize) -> usize {
    if given > 0 {
        given
    } else {
        match mib {
            0..=1 => 60,
            2..=16 => 20,
            _ => 10,
        }
    }
}

/// The median of `xs` (the mean of the middle two for an even count); NaN when empty.
pub(crate) fn median(xs: &[f64]) -> f64 {
    if xs.is_empty() {
        return f64::NAN;
    }
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    }
}

/// Per iteration, the slowest rank: `per_rank[r][i]` is rank `r`'s time of iteration `i`.
pub(crate) fn max_over_ranks(per_rank: &[Vec<f64>]) -> Vec<f64> {
    let iters = per_rank.iter().map(Vec::len).min().unwrap_or(0);
    (0..iters)
        .map(|i| per_rank.iter().map(|t| t[i]).fold(f64::NEG_INFINITY, f64::max))
        .collect()
}

/// A JSON value, just enough for benchmark records.
#[derive(Clone, Debug)]
pub(crate) enum Json {
    /// `null`.
    Null,
    /// A number (non-finite numbers are written as `null`).
    Num(f64),
    /// An integer.
    Int(u64),
    /// A string.
    Str(String),
    /// An object, fields in order.
    Obj(Vec<(String, Json)>),
    /// An array.
    Arr(Vec<Json>),
}

impl Json {
    /// `Some(x)` as a number, `None` as `null`.
    pub(crate) fn opt(x: Option<f64>) -> Json {
        x.map_or(Json::Null, Json::Num)
    }

    /// The compact JSON text.
    pub(crate) fn render(&self) -> String {
        let mut s = String::new();
        self.write(&mut s, 0);
        s
    }

    fn write(&self, s: &mut String, indent: usize) {
        match self {
            Json::Null => s.push_str("null"),
            Json::Num(x) if x.is_finite() => {
                // `{:?}` keeps full precision and always has a digit after the point or an exponent.
                let _ = write!(s, "{x:?}");
            }
            Json::Num(_) => s.push_str("null"),
            Json::Int(n) => {
                let _ = write!(s, "{n}");
            }
            Json::Str(t) => write_str(s, t),
            Json::Obj(fields) => {
                s.push('{');
                for (i, (k, v)) in fields.iter().enumerate() {
                    if i > 0 {
                        s.push_str(", ");
                    }
                    write_str(s, k);
                    s.push_str(": ");
                    v.write(s, indent);
                }
                s.push('}');
            }
            Json::Arr(items) => {
                s.push('[');
                for (i, v) in items.iter().enumerate() {
                    s.push_str(if i > 0 { ",\n" } else { "\n" });
                    s.push_str(&" ".repeat(indent + 2));
                    v.write(s, indent + 2);
                }
                if !items.is_empty() {
                    s.push('\n');
                    s.push_str(&" ".repeat(indent));
                }
                s.push(']');
            }
        }
    }
}

fn write_str(s: &mut String, t: &str) {
    s.push_str(&tessera::mesh::observe::json_string(t));
}

/// Writes `contents` to `path` atomically: a temporary file in the same folder,
/// flushed to disk, then renamed over `path`. Readers see the old file or the new
/// one, never half of it. Temporaries left by killed runs are removed on the next
/// write ([`tessera::autograd::state_dict::write_atomic`], shared with the state
/// dict writers).
///
/// # Errors
/// Any I/O error, with the path in the message; the temporary file is removed.
pub(crate) fn write_atomic(path: &Path, contents: &str) -> Result<(), String> {
    tessera::autograd::state_dict::write_atomic(path, contents.as_bytes()).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_escapes_and_numbers() {
        let j = Json::Arr(vec![Json::Obj(vec![
            ("a\"b".into(), Json::Num(0.5)),
            ("n".into(), Json::Num(f64::NAN)),
            ("i".into(), Json::Int(3)),
        ])]);
        assert_eq!(j.render(), "[\n  {\"a\\\"b\": 0.5, \"n\": null, \"i\": 3}\n]");
    }

    #[test]
    fn medians() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert_eq!(max_over_ranks(&[vec![1.0, 5.0], vec![2.0, 3.0]]), vec![2.0, 5.0]);
    }
}

/// The process's peak resident set size (`VmHWM` in `/proc/self/status`), if the
/// system reports it.
pub(crate) fn peak_rss_bytes() -> Option<usize> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Minor page faults of this process so far (`getrusage`'s `ru_minflt`), if
/// the system reports them: every rank's thread together, so a step's
/// difference counts the fresh pages all ranks touched. One system call, no
/// file to read.
pub(crate) fn minor_faults() -> Option<u64> {
    #[cfg(unix)]
    {
        // SAFETY: `getrusage` only writes the `rusage` it is given, which is
        // valid zeroed (plain integers) and lives across the call.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: as above; `RUSAGE_SELF` is a valid `who`.
        let ok = unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) } == 0;
        ok.then(|| u64::try_from(usage.ru_minflt).unwrap_or(0))
    }
    #[cfg(not(unix))]
    {
        None
    }
}
