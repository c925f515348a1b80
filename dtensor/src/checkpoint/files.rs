//! The files of a checkpoint: one safetensors file per writing rank, written and
//! fsynced in a temporary directory that replaces the target in one rename;
//! each stamped with the checkpoint's id and its own name, and checked against
//! the index when a load first opens it.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value, json};

use super::ckpt_error;
use super::index::{Chunk, checksum, dtype_name};
use crate::{Error, Result, Tensor};

/// What a chunk file's `__metadata__` says it is, under [`STAMP_FORMAT`].
const FILE_FORMAT: &str = "tessera-checkpoint chunk file";
/// The `__metadata__` key of [`FILE_FORMAT`] (version 2 put it in `format`).
const STAMP_FORMAT: &str = "tessera";
/// The largest safetensors header this reader accepts (as safetensors does).
const MAX_HEADER: u64 = 100 << 20;

pub(crate) fn io_error(path: &Path, what: &str, e: std::io::Error) -> Error {
    ckpt_error(path, format!("{what}: {e}"))
}

/// Where a chunk landed in its file: its key, absolute byte range and block
/// checksums.
pub(crate) struct Written {
    pub(crate) key: String,
    pub(crate) begin: u64,
    pub(crate) end: u64,
    pub(crate) checksums: String,
}

/// The checksums of each `block` bytes of `bytes` (the last block shorter),
/// concatenated.
pub(crate) fn block_checksums(bytes: &[u8], block: u64) -> String {
    bytes.chunks(block as usize).map(checksum).collect()
}

/// What a chunk file is stamped with: the checkpoint's id and its own name.
pub(crate) struct Stamp<'a> {
    pub(crate) id: &'a str,
    pub(crate) file: &'a str,
}

/// Writes `chunks` (key, offsets in the global tensor, tensor) as one
/// safetensors file at `path`, streaming one tensor at a time, and fsyncs it.
/// Its `__metadata__` holds `stamp` and, for readers of sharded safetensors
/// (PyTorch's `HuggingFaceStorageReader`), each chunk's offsets in
/// `DCP_SHARDING_INFO` with `DCP_VERSION` 1.0 and `format` `pt`. Returns each
/// chunk's range and its checksums per `block` bytes.
pub(crate) fn write_safetensors(
    path: &Path,
    chunks: &[(String, &[usize], &Tensor)],
    stamp: &Stamp<'_>,
    block: u64,
) -> Result<Vec<Written>> {
    let mut header = Map::new();
    let mut at = 0u64;
    let mut ranges = Vec::with_capacity(chunks.len());
    let mut sharding = Map::new();
    for (key, offsets, t) in chunks {
        sharding.insert(key.clone(), json!({"saved_offsets": offsets}));
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
        json!({
            STAMP_FORMAT: FILE_FORMAT,
            "checkpoint": stamp.id,
            "file": stamp.file,
            SHARDING_INFO: Value::Object(sharding).to_string(),
            "DCP_VERSION": "1.0",
            "format": "pt",
        }),
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
    for (_, _, t) in chunks {
        let c = t.contiguous();
        let buf = c.as_buf()?;
        let bytes = buf.as_bytes();
        sums.push(block_checksums(bytes, block));
        write(&mut w, bytes)?;
    }
    w.flush().map_err(|e| io_error(path, "cannot write", e))?;
    drop(w);
    f.sync_all().map_err(|e| io_error(path, "cannot fsync", e))?;
    Ok(chunks
        .iter()
        .zip(ranges)
        .zip(sums)
        .map(|(((key, _, _), (b, e)), checksums)| Written {
            key: key.clone(),
            begin: data_start + b,
            end: data_start + e,
            checksums,
        })
        .collect())
}

/// Checks the safetensors header of the chunk file `path` (open as `file`)
/// against what the index says of it: stamped with checkpoint `id` and its own
/// name `file_name`, and holding exactly `chunks` (tensor name, dtype name,
/// chunk) with their dtypes, shapes and byte ranges. An empty `id` is a
/// checkpoint written elsewhere ([`Index::from_sharded_safetensors`](super::Index::from_sharded_safetensors)):
/// its files carry no stamp, and the same chunk checks find a file changed
/// since the index was built from it.
///
/// # Errors
/// [`Error::Checkpoint`] naming the file and the tensor that disagrees: a file
/// of another checkpoint, one renamed or swapped, a header that is not
/// safetensors or describes other chunks.
pub(crate) fn check_header(
    path: &Path,
    file: &File,
    (id, version): (&str, u32),
    file_name: &str,
    chunks: &[(&str, &str, &Chunk)],
) -> Result<()> {
    let bad = |detail: String| ckpt_error(path, detail);
    let (header, start) = read_header(path, file)?;
    if id.is_empty() {
        // Written elsewhere: no stamp, and the index was built from these
        // very headers when the checkpoint was opened.
        return check_chunks(path, &header, start, (version, false), chunks).map_err(|e| match e {
            Error::Checkpoint { path, detail } => Error::Checkpoint {
                path,
                detail: format!("the file changed since the checkpoint was opened: {detail}"),
            },
            e => e,
        });
    }
    let meta = header.get("__metadata__");
    let field = |k: &str| meta.and_then(|m| m.get(k)).and_then(Value::as_str);
    // Version 2 stamped the chunk file in `format`; version 3 leaves `format`
    // to sharded safetensors (`pt`) and stamps `tessera`.
    let stamp_field = if version == 2 { "format" } else { STAMP_FORMAT };
    if field(stamp_field) != Some(FILE_FORMAT) {
        return Err(bad(format!(
            "not a chunk file of a checkpoint: its __metadata__ is {}",
            meta.map_or("missing".to_string(), Value::to_string)
        )));
    }
    if field("checkpoint") != Some(id) {
        return Err(bad(format!(
            "belongs to checkpoint {}, but the index is of checkpoint {id}: a file copied from another \
             checkpoint (tensor {} and the rest of this file cannot be trusted)",
            field("checkpoint").unwrap_or("(none)"),
            chunks.first().map_or("-", |c| c.0)
        )));
    }
    if field("file") != Some(file_name) {
        return Err(bad(format!(
            "was written as {}, but the index reads it as {file_name}: files renamed or swapped (tensor {})",
            field("file").unwrap_or("(none)"),
            chunks.first().map_or("-", |c| c.0)
        )));
    }
    check_chunks(path, &header, start, (version, true), chunks)
}

/// The chunk checks of [`check_header`]: the file `path`, whose `header`'s
/// data starts at `start`, holds exactly `chunks` with their dtypes, shapes,
/// byte ranges and (past version 2) saved offsets; `stamped` (a Tessera
/// save's file) must carry sharding info past version 2, where a file
/// written elsewhere without it holds whole tensors.
fn check_chunks(
    path: &Path,
    header: &Map<String, Value>,
    start: u64,
    (version, stamped): (u32, bool),
    chunks: &[(&str, &str, &Chunk)],
) -> Result<()> {
    let bad = |detail: String| ckpt_error(path, detail);
    // What a reader of sharded safetensors takes each chunk's place to be.
    let info = if version == 2 {
        None
    } else {
        Some(sharding_info(path, header)?)
    };
    for (name, dtype, c) in chunks {
        let want = json!({
            "dtype": dtype,
            "shape": c.shape,
            "data_offsets": [c.begin.checked_sub(start), c.end.checked_sub(start)],
        });
        if let Some(info) = &info {
            let offsets = saved_offsets(path, info.as_ref(), &c.key, c.offsets.len())?;
            if (stamped && info.is_none()) || offsets != c.offsets {
                return Err(bad(format!(
                    "tensor {name}: its {SHARDING_INFO} puts chunk {} at {offsets:?}, but the index at {:?}",
                    c.key, c.offsets
                )));
            }
        }
        match header.get(&c.key) {
            Some(got) if *got == want => {}
            Some(got) => {
                return Err(bad(format!(
                    "tensor {name}: chunk {} is {got} in the file, but the index says {want}",
                    c.key
                )));
            }
            None => {
                return Err(bad(format!(
                    "tensor {name}: the index puts chunk {} in this file, which does not hold it",
                    c.key
                )));
            }
        }
    }
    let held = header.keys().filter(|k| *k != "__metadata__").count();
    if held != chunks.len() {
        let extra = header
            .keys()
            .find(|k| *k != "__metadata__" && !chunks.iter().any(|c| &c.2.key == *k))
            .map_or(String::new(), |k| format!(": {k:?} is not in the index"));
        return Err(bad(format!(
            "holds {held} chunks, the index names {} in it{extra}",
            chunks.len()
        )));
    }
    Ok(())
}

/// The safetensors header of `path` (open as `file`) as a JSON object, and
/// where its data starts (8 + the header's length).
///
/// # Errors
/// [`Error::Checkpoint`] naming the file when it is not safetensors: a header
/// length beyond the file or [`MAX_HEADER`], or a header that is not a JSON object.
pub(crate) fn read_header(path: &Path, file: &File) -> Result<(Map<String, Value>, u64)> {
    let bad = |detail: String| ckpt_error(path, detail);
    let len = file
        .metadata()
        .map_err(|e| io_error(path, "cannot read the size of", e))?
        .len();
    let mut head = [0u8; 8];
    file.read_exact_at(&mut head, 0)
        .map_err(|e| io_error(path, "cannot read the safetensors header", e))?;
    let n = u64::from_le_bytes(head);
    if n > MAX_HEADER || n > len.saturating_sub(8) {
        return Err(bad(format!(
            "not a safetensors file: its header claims {n} bytes of a {len}-byte file"
        )));
    }
    let mut text = vec![0u8; n as usize];
    file.read_exact_at(&mut text, 8)
        .map_err(|e| io_error(path, "cannot read the safetensors header", e))?;
    let header = serde_json::from_slice(&text)
        .map_err(|e| bad(format!("not a safetensors file: its header is not a JSON object ({e})")))?;
    Ok((header, 8 + n))
}

/// The saved offsets of each tensor of a sharded safetensors file, from the
/// `DCP_SHARDING_INFO` of its `__metadata__` (a JSON string `{name:
/// {"saved_offsets": [...]}}`); `None` for a file without it (whole tensors).
///
/// # Errors
/// `DCP_SHARDING_INFO` that is not that JSON.
pub(crate) fn sharding_info(path: &Path, header: &Map<String, Value>) -> Result<Option<Map<String, Value>>> {
    let Some(info) = header
        .get("__metadata__")
        .and_then(|m| m.get(SHARDING_INFO))
        .and_then(Value::as_str)
    else {
        return Ok(None);
    };
    serde_json::from_str(info).map(Some).map_err(|e| {
        ckpt_error(
            path,
            format!("its {SHARDING_INFO} is not a JSON object of saved offsets ({e})"),
        )
    })
}

/// The offsets `info` (see [`sharding_info`]) gives tensor `key` of rank
/// `rank`: zeros without sharding info.
///
/// # Errors
/// Sharding info that does not name `key`, or offsets that are not `rank`
/// whole numbers.
pub(crate) fn saved_offsets(
    path: &Path,
    info: Option<&Map<String, Value>>,
    key: &str,
    rank: usize,
) -> Result<Vec<usize>> {
    let Some(info) = info else {
        return Ok(vec![0; rank]);
    };
    match whole_numbers(info.get(key).and_then(|e| e.get("saved_offsets"))) {
        Some(o) if o.len() == rank => Ok(o),
        _ => Err(ckpt_error(
            path,
            format!(
                "tensor {key}: its {SHARDING_INFO} entry is {}, not {rank} saved offsets",
                info.get(key).map_or("missing".to_string(), Value::to_string)
            ),
        )),
    }
}

/// A JSON array of whole numbers as `usize`s (`None` for anything else).
pub(crate) fn whole_numbers(v: Option<&Value>) -> Option<Vec<usize>> {
    v?.as_array()?
        .iter()
        .map(|x| x.as_u64().and_then(|x| usize::try_from(x).ok()))
        .collect()
}

/// Whether a chunk file's header carries Tessera's stamp (written by a
/// Tessera save, whose `index.json` holds its checksums and metadata).
pub(crate) fn stamped_by_tessera(header: &Map<String, Value>) -> bool {
    header
        .get("__metadata__")
        .and_then(|m| m.get(STAMP_FORMAT).or_else(|| m.get("format")))
        .and_then(Value::as_str)
        == Some(FILE_FORMAT)
}

/// The `__metadata__` key of the saved offsets in a sharded safetensors file.
pub(crate) const SHARDING_INFO: &str = "DCP_SHARDING_INFO";

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

/// Makes `tmp` the checkpoint at `dir` in one atomic step: a rename when `dir`
/// does not exist, else an exchange of the two (Linux `renameat2`), after which
/// the old checkpoint, now at `tmp`, is removed. A crash at any point leaves
/// either the old or the new checkpoint at `dir`.
pub(crate) fn install(tmp: &Path, dir: &Path) -> Result<()> {
    if !dir.exists() {
        fs::rename(tmp, dir).map_err(|e| io_error(dir, "cannot rename the new checkpoint into place", e))?;
    } else {
        exchange(tmp, dir)?;
        // A concurrent cleaner may have removed it already (it is a dead
        // temporary to anyone else now): that is as good.
        match fs::remove_dir_all(tmp) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(io_error(tmp, "cannot remove the replaced checkpoint", e));
            }
            _ => {}
        }
    }
    sync_dir(&parent_of(dir))
}

#[cfg(target_os = "linux")]
fn exchange(a: &Path, b: &Path) -> Result<()> {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    let c =
        |p: &Path| CString::new(p.as_os_str().as_bytes()).map_err(|_| ckpt_error(p, "a path with a NUL byte".into()));
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

/// The directory `dir` lies in (`.` for a bare name).
pub(crate) fn parent_of(dir: &Path) -> PathBuf {
    match dir.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// Opens a chunk file for reading.
pub(crate) fn open_read(path: &Path) -> Result<File> {
    OpenOptions::new()
        .read(true)
        .open(path)
        .map_err(|e| io_error(path, "cannot open", e))
}
