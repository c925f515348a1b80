//! Temporaries of writers, and their removal once the writer is gone.
//!
//! A temporary is a hidden file or directory named `.NAME.tmp-PID-TAG` (the
//! target's name, the writing process, and a tag of lowercase hex digits: a
//! counter or the checkpoint id). Its writer holds an exclusive `flock` for as
//! long as it writes: on the file itself (atomic single-file writes) or on
//! `writer.lock` inside the directory (checkpoint saves; the lock file also
//! records the writer's PID, host and start). A writer killed mid-write cannot
//! remove its temporary; every save or load of a checkpoint therefore removes
//! the temporaries of dead writers anywhere in the checkpoint's parent
//! directory, whatever target they were for.
//!
//! A temporary is stale when nobody holds its lock (a temporary directory
//! without `writer.lock` counts as unlocked) and its PID does not run on this
//! host (on Linux, where `/proc` tells; elsewhere nothing is stale). The PID
//! check covers the instants between creating a temporary and locking it; the
//! lock covers a writer on another host of a shared file system, whose PID
//! means nothing here (a writer there is unprotected only in the instant
//! between `mkdir` and locking, and then its save fails with an error, never
//! silently).

use std::fs::{self, File, OpenOptions, TryLockError};
use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use super::files::{io_error, parent_of};
use crate::{Error, Result};

/// The lock file inside a checkpoint's temporary directory.
pub(crate) const LOCK_FILE: &str = "writer.lock";

/// The writing process of a temporary's file name (`.NAME.tmp-PID-TAG`), or
/// `None` for a name that is not a temporary's.
pub fn temporary_owner(file_name: &str) -> Option<u32> {
    let rest = file_name.strip_prefix('.')?;
    let (target, owner) = rest.rsplit_once(".tmp-")?;
    let (pid, tag) = owner.split_once('-')?;
    let hex = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    let digits = !pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit());
    if target.is_empty() || !digits || !hex(tag) {
        return None;
    }
    pid.parse().ok()
}

/// Removes the temporaries of dead writers (see the module docs) in `dir`:
/// files and directories named `.NAME.tmp-PID-TAG`, whatever `NAME`. Returns
/// what it removed. Best effort: what cannot be listed, locked or removed is
/// left for the next call.
pub fn remove_stale_temporaries(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut removed = Vec::new();
    for entry in entries.flatten() {
        let path = entry.path();
        let Some(pid) = entry.file_name().to_str().and_then(temporary_owner) else {
            continue;
        };
        if process_may_run(pid) {
            continue;
        }
        let Ok(kind) = entry.file_type() else { continue };
        let gone = if kind.is_dir() {
            remove_if_unlocked(&path.join(LOCK_FILE), true, || fs::remove_dir_all(&path))
        } else if kind.is_file() {
            remove_if_unlocked(&path, false, || fs::remove_file(&path))
        } else {
            false
        };
        if gone {
            log::info!(
                "removed {}, a temporary left by process {pid}, which no longer runs",
                path.display()
            );
            removed.push(path);
        }
    }
    removed
}

/// Runs `remove` when nobody holds the lock on `lock` (a missing lock file
/// counts as unlocked when `missing_ok`), holding the lock meanwhile. Whether
/// it removed something.
fn remove_if_unlocked(lock: &Path, missing_ok: bool, remove: impl FnOnce() -> std::io::Result<()>) -> bool {
    let file = match File::open(lock) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && missing_ok => return remove().is_ok(),
        Err(_) => return false,
    };
    match file.try_lock() {
        Ok(()) => {}
        Err(TryLockError::WouldBlock | TryLockError::Error(_)) => return false,
    }
    // The lock is ours; but the writer may have renamed its temporary into
    // place and dropped the lock between our open and our lock: only a lock
    // file still at its path is a dead writer's.
    let same = match (file.metadata(), fs::metadata(lock)) {
        (Ok(a), Ok(b)) => a.ino() == b.ino() && a.dev() == b.dev(),
        _ => false,
    };
    same && remove().is_ok()
}

/// Whether process `pid` may be running on this host: `/proc/PID` exists, or
/// `/proc` is not there to tell. This process counts as running.
#[cfg(target_os = "linux")]
fn process_may_run(pid: u32) -> bool {
    pid == std::process::id() || !Path::new("/proc/self").exists() || Path::new(&format!("/proc/{pid}")).exists()
}

/// Without `/proc`, liveness is unknown: every process may run.
#[cfg(not(target_os = "linux"))]
fn process_may_run(_pid: u32) -> bool {
    true
}

/// The lock a writer holds on its temporary directory until the checkpoint is
/// installed (or the save fails); dropping it releases the lock.
#[derive(Debug)]
pub(crate) struct WriterLock {
    dir: PathBuf,
    path: PathBuf,
    _file: File,
}

impl WriterLock {
    /// The locked temporary directory.
    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }

    /// Removes the lock file (still holding the lock), so that the directory,
    /// renamed into place, is no temporary. The lock itself ends on drop.
    pub(crate) fn remove_file(&self) -> Result<()> {
        fs::remove_file(&self.path).map_err(|e| io_error(&self.path, "cannot remove the writer's lock file", e))
    }
}

/// Removes the checkpoint directory `path` (retiring an old checkpoint, say)
/// so that a process killed midway leaves no half-deleted checkpoint: it is
/// first renamed, in one step, to a temporary of this process
/// (`.NAME.tmp-PID-TAG`), which the next save or load beside it removes if this
/// process dies, and then deleted. A `path` that does not exist is no error.
///
/// # Errors
/// A directory that cannot be renamed or removed (naming it).
pub fn remove_checkpoint(path: &Path) -> Result<()> {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let Some(name) = path.file_name() else {
        return Err(Error::Checkpoint {
            path: path.display().to_string(),
            detail: "a checkpoint directory needs a name (not `/` or `..`)".into(),
        });
    };
    let tag = NEXT.fetch_add(1, Ordering::Relaxed);
    let tmp = parent_of(path).join(format!(
        ".{}.tmp-{}-{tag:x}",
        name.to_string_lossy(),
        std::process::id()
    ));
    match fs::rename(path, &tmp) {
        Ok(()) => fs::remove_dir_all(&tmp).map_err(|e| io_error(&tmp, "cannot remove a retired checkpoint", e)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io_error(path, "cannot retire the checkpoint", e)),
    }
}

/// Makes the temporary directory of a save into `dir` with tag `id`
/// (`.NAME.tmp-PID-ID`, beside `dir`) and locks it; first removes stale
/// temporaries beside `dir` (and a temporary `.NAME.tmp` of an older version of
/// this code for the same `dir`).
///
/// # Errors
/// A `dir` without a name, or a directory or lock file that cannot be made.
pub(crate) fn make_temp_dir(dir: &Path, id: &str) -> Result<(PathBuf, WriterLock)> {
    let name = dir.file_name().ok_or_else(|| Error::Checkpoint {
        path: dir.display().to_string(),
        detail: "a checkpoint directory needs a name (not `/` or `..`)".into(),
    })?;
    let name = name.to_string_lossy();
    let parent = parent_of(dir);
    remove_stale_temporaries(&parent);
    let legacy = parent.join(format!(".{name}.tmp"));
    if legacy.is_dir() {
        fs::remove_dir_all(&legacy).map_err(|e| io_error(&legacy, "cannot remove a stale temporary directory", e))?;
    }
    fs::create_dir_all(&parent).map_err(|e| io_error(&parent, "cannot create", e))?;
    let pid = std::process::id();
    let tmp = parent.join(format!(".{name}.tmp-{pid}-{id}"));
    fs::create_dir(&tmp).map_err(|e| io_error(&tmp, "cannot create the temporary directory", e))?;
    let path = tmp.join(LOCK_FILE);
    let locked = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&path)
        .and_then(|mut f| {
            f.try_lock().map_err(std::io::Error::from)?;
            writeln!(f, "pid {pid}\nhost {}\nstart {}", host(), start_time())?;
            Ok(f)
        });
    match locked {
        Ok(file) => Ok((
            tmp.clone(),
            WriterLock {
                dir: tmp,
                path,
                _file: file,
            },
        )),
        Err(e) => {
            let _ = fs::remove_dir_all(&tmp);
            Err(io_error(&path, "cannot lock the temporary directory", e))
        }
    }
}

/// This host's name, for the record in a lock file (diagnostics only).
fn host() -> String {
    fs::read_to_string("/proc/sys/kernel/hostname")
        .or_else(|_| fs::read_to_string("/etc/hostname"))
        .map_or_else(|_| "unknown".into(), |h| h.trim().to_string())
}

/// This process's start (clock ticks after boot, `/proc/self/stat` field 22)
/// and the boot id, for the record in a lock file (diagnostics only).
fn start_time() -> String {
    let start = fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().nth(19).map(str::to_string))
        })
        .unwrap_or_else(|| "unknown".into());
    let boot = fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map_or_else(|_| "unknown".into(), |b| b.trim().to_string());
    format!("{start} boot {boot}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn temporary_names() {
        macro_rules! case {
            ($file:expr, $want:expr) => {
                assert_eq!(temporary_owner($file), $want, "{}", $file);
            };
        }
        case!(".w.safetensors.tmp-123-0", Some(123));
        case!(".step_000014.tmp-7-0123456789abcdef0123456789abcdef", Some(7));
        case!(".a.tmp-5.tmp-123-0", Some(123));
        case!(".w.tmp-123-", None);
        case!(".w.tmp--0", None);
        case!(".w.tmp-12a-0", None);
        case!(".w.tmp-1-2-3", None);
        case!(".w.tmp-1-ABC", None);
        case!(".w.tmp.123", None);
        case!(".step_000014.tmp", None);
        case!("..tmp-1-0", None);
        case!("w.tmp-1-0", None);
        case!("w.safetensors", None);
    }

    #[test]
    fn a_retired_checkpoint_goes_through_a_temporary_the_cleaner_knows() {
        let parent = std::env::temp_dir().join(format!("tessera-retire-{}", std::process::id()));
        let ckpt = parent.join("step_000007");
        fs::create_dir_all(&ckpt).unwrap();
        fs::write(ckpt.join("index.json"), b"{}").unwrap();
        fs::write(ckpt.join("shard-00001-model-00001-of-00001.safetensors"), vec![0u8; 64]).unwrap();
        remove_checkpoint(&ckpt).unwrap();
        let left: Vec<_> = fs::read_dir(&parent).unwrap().collect();
        assert!(left.is_empty(), "{left:?}");
        // Gone already: no error. A directory killed mid-retire is a temporary
        // of its (dead) process, which the cleaner removes.
        remove_checkpoint(&ckpt).unwrap();
        let dead = parent.join(".step_000003.tmp-999999999-0");
        fs::create_dir_all(&dead).unwrap();
        fs::write(dead.join("shard-00001-model-00001-of-00001.safetensors"), vec![0u8; 64]).unwrap();
        assert_eq!(temporary_owner(".step_000003.tmp-999999999-0"), Some(999_999_999));
        assert_eq!(remove_stale_temporaries(&parent), vec![dead]);
        fs::remove_dir_all(&parent).unwrap();
    }
}
