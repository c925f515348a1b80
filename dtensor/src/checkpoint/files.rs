//! The files of a checkpoint: one safetensors file per writing rank, written and
//! fsynced in a temporary directory that replaces the target in one rename.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value, json};

use super::index::dtype_name;
use crate::{Error, Result, Tensor};

pub(crate) fn io_error(path: &Path, what: &str, e: std::io::Error) -> Error {
    Error::Checkpoint {
        path: path.display().to_string(),
        detail: format!("{what}: {e}"),
    }
}

/// Where a chunk landed in its file: its key, absolute byte range and checksum.
pub(crate) struct Written {
    pub(crate) key: String,
    pub(crate) begin: u64,
    pub(crate) end: u64,
    pub(crate) checksum: String,
}

/// FNV-1a, 64-bit, over `bytes`, as 16 hex digits.
pub(crate) fn checksum(bytes: &[u8]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

/// Writes `chunks` (key, contiguous tensor) as one safetensors file at `path`,
/// streaming one tensor at a time, and fsyncs it. Returns each chunk's range.
pub(crate) fn write_safetensors(path: &Path, chunks: &[(String, &Tensor)]) -> Result<Vec<Written>> {
    let mut header = Map::new();
    let mut at = 0u64;
    let mut ranges = Vec::with_capacity(chunks.len());
    for (key, t) in chunks {
        let n = (t.numel() * t.dtype().size_in_bytes()) as u64;
        header.insert(
            key.clone(),
            json!({"dtype": dtype_name(t.dtype()), "shape": t.shape(), "data_offsets": [at, at + n]}),
        );
        ranges.push((at, at + n));
        at += n;
    }
    header.insert(
        "__metadata__".into(),
        json!({"format": "tessera-checkpoint chunk file"}),
    );
    let mut text = Value::Object(header).to_string().into_bytes();
    // Pad the header with spaces so the data starts 8-byte aligned.
    while !(8 + text.len()).is_multiple_of(8) {
        text.push(b' ');
    }
    let data_start = 8 + text.len() as u64;
    let mut f = File::create(path).map_err(|e| io_error(path, "cannot create", e))?;
    let mut w = std::io::BufWriter::with_capacity(1 << 20, &mut f);
    let write = |w: &mut std::io::BufWriter<&mut File>, bytes: &[u8]| {
        w.write_all(bytes).map_err(|e| io_error(path, "cannot write", e))
    };
    write(&mut w, &(text.len() as u64).to_le_bytes())?;
    write(&mut w, &text)?;
    let mut sums = Vec::with_capacity(chunks.len());
    for (_, t) in chunks {
        let c = t.contiguous();
        let buf = c.as_buf()?;
        let bytes = buf.as_bytes();
        sums.push(checksum(bytes));
        write(&mut w, bytes)?;
    }
    w.flush().map_err(|e| io_error(path, "cannot write", e))?;
    drop(w);
    f.sync_all().map_err(|e| io_error(path, "cannot fsync", e))?;
    Ok(chunks
        .iter()
        .zip(ranges)
        .zip(sums)
        .map(|(((key, _), (b, e)), checksum)| Written {
            key: key.clone(),
            begin: data_start + b,
            end: data_start + e,
            checksum,
        })
        .collect())
}

/// Writes `bytes` to `path` and fsyncs it.
pub(crate) fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = File::create(path).map_err(|e| io_error(path, "cannot create", e))?;
    f.write_all(bytes).map_err(|e| io_error(path, "cannot write", e))?;
    f.sync_all().map_err(|e| io_error(path, "cannot fsync", e))
}

/// Fsyncs a directory (so the names in it are durable).
pub(crate) fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| io_error(dir, "cannot fsync the directory", e))
}

/// The temporary directory a save into `dir` writes first: a hidden sibling.
pub(crate) fn temp_dir_for(dir: &Path) -> Result<PathBuf> {
    let name = dir.file_name().ok_or_else(|| Error::Checkpoint {
        path: dir.display().to_string(),
        detail: "a checkpoint directory needs a name (not `/` or `..`)".into(),
    })?;
    let parent = parent_of(dir);
    Ok(parent.join(format!(".{}.tmp", name.to_string_lossy())))
}

fn parent_of(dir: &Path) -> PathBuf {
    match dir.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// Makes `tmp` the checkpoint at `dir` in one atomic step: a rename when `dir`
/// does not exist, else an exchange of the two (Linux `renameat2`), after which
/// the old checkpoint, now at `tmp`, is removed. A crash at any point leaves
/// either the old or the new checkpoint at `dir`.
pub(crate) fn install(tmp: &Path, dir: &Path) -> Result<()> {
    if !dir.exists() {
        fs::rename(tmp, dir).map_err(|e| io_error(dir, "cannot rename the new checkpoint into place", e))?;
    } else {
        exchange(tmp, dir)?;
        fs::remove_dir_all(tmp).map_err(|e| io_error(tmp, "cannot remove the replaced checkpoint", e))?;
    }
    sync_dir(&parent_of(dir))
}

#[cfg(target_os = "linux")]
fn exchange(a: &Path, b: &Path) -> Result<()> {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    let c = |p: &Path| {
        CString::new(p.as_os_str().as_bytes()).map_err(|_| Error::Checkpoint {
            path: p.display().to_string(),
            detail: "a path with a NUL byte".into(),
        })
    };
    let (ca, cb) = (c(a)?, c(b)?);
    // SAFETY: both are valid NUL-terminated paths; renameat2 reads them only.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_renameat2,
            libc::AT_FDCWD,
            ca.as_ptr(),
            libc::AT_FDCWD,
            cb.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io_error(
            b,
            "cannot exchange the new checkpoint with the old one",
            std::io::Error::last_os_error(),
        ))
    }
}

#[cfg(not(target_os = "linux"))]
fn exchange(a: &Path, b: &Path) -> Result<()> {
    // Not atomic: the old checkpoint is moved aside first.
    let aside = b.with_extension("old");
    fs::rename(b, &aside).map_err(|e| io_error(b, "cannot move the old checkpoint aside", e))?;
    fs::rename(a, b).map_err(|e| io_error(b, "cannot rename the new checkpoint into place", e))?;
    fs::rename(&aside, a).map_err(|e| io_error(a, "cannot move the old checkpoint", e))
}

/// A fresh, empty `tmp` (a stale one from a killed save is removed).
pub(crate) fn fresh_dir(tmp: &Path) -> Result<()> {
    if tmp.exists() {
        fs::remove_dir_all(tmp).map_err(|e| io_error(tmp, "cannot remove a stale temporary directory", e))?;
    }
    fs::create_dir_all(tmp).map_err(|e| io_error(tmp, "cannot create", e))
}

/// Opens a chunk file for reading.
pub(crate) fn open_read(path: &Path) -> Result<File> {
    OpenOptions::new()
        .read(true)
        .open(path)
        .map_err(|e| io_error(path, "cannot open", e))
}
