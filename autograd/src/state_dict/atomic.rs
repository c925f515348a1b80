//! Atomic file writes: a temporary file in the target's directory, synced, then
//! renamed over the target, so that readers see the old file or the new one,
//! never half of one. Shared by the state dict writers and the examples' result
//! files.
//!
//! Temporaries are named `.NAME.tmp-PID-N` (the writing process and a counter),
//! and the writer holds an exclusive lock (`flock`) on its temporary until it is
//! renamed into place. A writer killed mid-save cannot remove its own, so every
//! new write first removes the temporaries of dead writers in the target's
//! directory, whatever their target
//! ([`tessera_dtensor::checkpoint::remove_stale_temporaries`]: unlocked, and
//! the PID no longer runs here, on Linux, where `/proc` tells; elsewhere nothing
//! is removed). Temporaries of live writers, this process's included, are left
//! alone: they may be saves in flight.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use tessera_dtensor::checkpoint::remove_stale_temporaries;

use crate::{Error, Result};

/// Writes `bytes` to `path` atomically (see the module docs), first removing
/// stale temporaries of `path` left by killed writers.
///
/// # Errors
/// [`Error::Io`] naming the file and the step that failed; the temporary file is
/// removed and any previous file at `path` is left as it was.
pub fn write_atomic(path: impl AsRef<Path>, bytes: &[u8]) -> Result<()> {
    let mut file = AtomicFile::create(path.as_ref())?;
    file.write(bytes)?;
    file.commit()
}

/// A file written under a temporary name and renamed into place on `commit`;
/// dropped uncommitted, it removes the temporary file.
pub(crate) struct AtomicFile {
    dest: PathBuf,
    tmp: PathBuf,
    out: Option<BufWriter<File>>,
}

impl AtomicFile {
    /// Creates the temporary file for `dest` (after removing stale ones).
    pub(crate) fn create(dest: &Path) -> Result<AtomicFile> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let name = dest
            .file_name()
            .ok_or_else(|| Error::Io {
                path: dest.to_path_buf(),
                action: "cannot write",
                source: std::io::Error::new(std::io::ErrorKind::InvalidInput, "the path names no file"),
            })?
            .to_string_lossy();
        let dir = match dest.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        remove_stale_temporaries(dir);
        let tmp = dest.with_file_name(format!(
            "{}{}-{}",
            temp_prefix(&name),
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let file = File::options()
            .write(true)
            .create_new(true)
            .open(&tmp)
            .map_err(|source| Error::Io {
                path: tmp.clone(),
                action: "cannot create",
                source,
            })?;
        // Held until the file is closed (after the rename): a live writer's mark.
        if let Err(e) = file.try_lock() {
            let _ = std::fs::remove_file(&tmp);
            return Err(Error::Io {
                path: tmp,
                action: "cannot lock",
                source: e.into(),
            });
        }
        Ok(AtomicFile {
            dest: dest.to_path_buf(),
            tmp,
            out: Some(BufWriter::new(file)),
        })
    }

    fn fail(&self, action: &'static str, source: std::io::Error) -> Error {
        Error::Io {
            path: self.dest.clone(),
            action,
            source,
        }
    }

    pub(crate) fn write(&mut self, bytes: &[u8]) -> Result<()> {
        // INVARIANT: `out` is `Some` until `commit` consumes the file.
        let out = self.out.as_mut().expect("file open until commit");
        out.write_all(bytes).map_err(|e| self.fail("write failed", e))
    }

    pub(crate) fn commit(mut self) -> Result<()> {
        // INVARIANT: `out` is `Some` until here.
        let out = self.out.take().expect("file open until commit");
        let file = out
            .into_inner()
            .map_err(|e| self.fail("write failed", e.into_error()))?;
        file.sync_all().map_err(|e| self.fail("sync failed", e))?;
        drop(file);
        std::fs::rename(&self.tmp, &self.dest).map_err(|e| self.fail("rename failed", e))?;
        // Make the rename durable; not every platform can open a directory.
        if let Some(dir) = self.dest.parent().filter(|d| !d.as_os_str().is_empty())
            && let Ok(d) = File::open(dir)
        {
            let _ = d.sync_all();
        }
        self.tmp = PathBuf::new();
        Ok(())
    }
}

impl Drop for AtomicFile {
    fn drop(&mut self) {
        if !self.tmp.as_os_str().is_empty() {
            drop(self.out.take());
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

/// The start of the temporary names for a target named `name`: `.NAME.tmp-`.
fn temp_prefix(name: &str) -> String {
    format!(".{name}.tmp-")
}

#[cfg(test)]
mod tests {
    use super::super::tests::TmpDir;
    use super::*;

    /// The PID of a process that has exited (a child, reaped).
    fn dead_pid() -> u32 {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        pid
    }

    #[test]
    #[cfg_attr(not(target_os = "linux"), ignore = "needs /proc to tell dead writers")]
    fn a_write_removes_temporaries_of_dead_writers_only() {
        let dir = TmpDir::new("atomic-stale");
        let path = dir.0.join("w.safetensors");
        let dead = format!(".w.safetensors.tmp-{}-3", dead_pid());
        let live = format!(".w.safetensors.tmp-{}-999999", std::process::id());
        let other = format!(".other.tmp-{}-0", dead_pid());
        let held = format!(".held.tmp-{}-0", dead_pid());
        for name in [&dead, &live, &other, &held] {
            std::fs::write(dir.0.join(name), b"partial").unwrap();
        }
        // A writer elsewhere (its PID means nothing here) holding its lock.
        let lock = std::fs::File::options().write(true).open(dir.0.join(&held)).unwrap();
        lock.try_lock().unwrap();
        write_atomic(&path, b"new").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"new");
        let mut want = vec![live.clone(), held, "w.safetensors".to_string()];
        want.sort();
        assert_eq!(
            dir.entries(),
            want,
            "dead writers' temporaries are gone, whatever their target; live ones stay"
        );
        drop(lock);
        write_atomic(&path, b"newer").unwrap();
        assert_eq!(dir.entries(), [live, "w.safetensors".to_string()]);
    }

    #[test]
    fn failures_name_the_file_and_leave_nothing() {
        let dir = TmpDir::new("atomic-fail");
        let err = write_atomic(dir.0.join("no/such/dir.json"), b"x").unwrap_err();
        assert!(
            matches!(
                err,
                Error::Io {
                    action: "cannot create",
                    ..
                }
            ),
            "{err:?}"
        );
        assert!(err.to_string().contains("no/such/.dir.json.tmp-"), "{err}");
        let err = write_atomic(dir.0.join(".."), b"x").unwrap_err().to_string();
        assert!(err.ends_with("..: cannot write: the path names no file"), "{err}");
        assert!(dir.entries().is_empty(), "{:?}", dir.entries());
    }
}
