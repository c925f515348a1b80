//! Writing a checkpoint: each rank's chunks to its own file, then the index and
//! the rename, collectively; in the foreground or on a background thread.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use tessera_mesh::{Communicator, CommunicatorExt, DType, DeviceMesh};

use super::index::{self, Chunk, Index, TensorEntry};
use super::temps::{self, WriterLock};
use super::{INDEX_FILE, SaveReport, ckpt_error, files};
use crate::spec::PlacementsDisplay;
use crate::{DTensor, Result, Tensor};

/// Every rank's `mine` made known to all, or, when any rank failed, the same
/// error on every rank naming the first failed rank. Collective.
fn agree(comm: &dyn Communicator, path: &Path, mine: Result<Vec<u8>>) -> Result<Vec<Vec<u8>>> {
    let (ok, bytes) = match &mine {
        Ok(b) => (1i64, b.clone()),
        Err(e) => (0, e.to_string().into_bytes()),
    };
    let heads = comm.all_gather_vec(&[ok, bytes.len() as i64])?;
    let longest = heads.chunks(2).map(|h| h[1] as usize).max().unwrap_or(0);
    let mut padded = bytes;
    padded.resize(longest, 0);
    let all = comm.all_gather_vec(&padded)?;
    let mut out = Vec::with_capacity(comm.size());
    for (r, h) in heads.chunks(2).enumerate() {
        let body = all[r * longest..r * longest + h[1] as usize].to_vec();
        if h[0] == 0 {
            if let Err(e) = mine {
                return Err(e);
            }
            return Err(ckpt_error(
                path,
                format!("rank {r} failed: {}", String::from_utf8_lossy(&body)),
            ));
        }
        out.push(body);
    }
    Ok(out)
}

/// Saves `tensors` (name, DTensor; all on one mesh, none `Partial`) as a
/// sharded checkpoint directory `dir`, replacing a checkpoint already there.
/// Each rank writes the chunks it holds; of replicas (ranks that differ only
/// along `Replicate` mesh dims) the one at coordinate 0 writes. Collective over
/// the tensors' mesh.
///
/// # Errors
/// Every rank gets the same error when any rank fails: no tensors, two tensors
/// of one name, tensors on different meshes, a `Partial` tensor (reduce it
/// first), a file that cannot be written (naming it). The previous checkpoint
/// at `dir` is then left as it was.
pub fn save(
    dir: impl AsRef<Path>,
    tensors: &[(&str, &DTensor)],
    metadata: BTreeMap<String, String>,
) -> Result<SaveReport> {
    let staged = Staged::new(dir.as_ref(), tensors, metadata)?;
    let written = staged.chunks.write(&staged.tmp);
    staged.finish(written)
}

/// [`save`] in the background: stages the tensors now (their local pieces, by
/// reference: tensors are immutable, so later optimizer steps, which make new
/// ones, do not change what is saved; the staged pieces stay alive until
/// written), writes this rank's file on a background thread while training goes
/// on, and [`AsyncSave::wait`] completes the checkpoint (the index and the
/// rename, collectively). Collective over the tensors' mesh, as is `wait`.
///
/// PyTorch: `torch.distributed.checkpoint.async_save`.
///
/// # Errors
/// As [`save`], for what can be checked before writing; the rest from `wait`.
pub fn async_save(
    dir: impl AsRef<Path>,
    tensors: &[(&str, &DTensor)],
    metadata: BTreeMap<String, String>,
) -> Result<AsyncSave> {
    let staged = Staged::new(dir.as_ref(), tensors, metadata)?;
    let chunks = staged.chunks.clone();
    let tmp = staged.tmp.clone();
    let writer = std::thread::Builder::new()
        .name("tessera-checkpoint".into())
        .spawn(move || chunks.write(&tmp))
        .map_err(|e| files::io_error(&staged.dir, "cannot start the writer thread", e))?;
    Ok(AsyncSave {
        staged: Some(staged),
        writer: Some(writer),
    })
}

/// A checkpoint being written in the background ([`async_save`]). Lives on its
/// rank's thread; dropping it without [`wait`](Self::wait) waits for the
/// writer but leaves the checkpoint unfinished (the previous one stays, and
/// rank 0 removes the temporary directory).
pub struct AsyncSave {
    staged: Option<Staged>,
    writer: Option<std::thread::JoinHandle<Result<Written>>>,
}

impl std::fmt::Debug for AsyncSave {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.staged {
            Some(s) => write!(f, "AsyncSave({})", s.dir.display()),
            None => f.write_str("AsyncSave(done)"),
        }
    }
}

impl AsyncSave {
    /// Whether this rank's file is written (so `wait` will not block on it).
    pub fn is_written(&self) -> bool {
        self.writer.as_ref().is_none_or(std::thread::JoinHandle::is_finished)
    }

    /// Waits for this rank's file, then completes the checkpoint with the other
    /// ranks. Collective.
    ///
    /// # Errors
    /// As [`save`]: every rank gets the same error.
    pub fn wait(mut self) -> Result<SaveReport> {
        let staged = self.staged.take().expect("an AsyncSave is waited for once");
        let written = match self.writer.take().map(std::thread::JoinHandle::join) {
            Some(Ok(r)) => r,
            Some(Err(_)) => Err(ckpt_error(&staged.dir, "the writer thread panicked".into())),
            None => Err(ckpt_error(&staged.dir, "no writer thread".into())),
        };
        staged.finish(written)
    }
}

impl Drop for AsyncSave {
    fn drop(&mut self) {
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
        // Never completed: rank 0 removes the temporary directory (best
        // effort; another rank's writer still in it then fails, unheard).
        if let Some(Staged { tmp, lock: Some(_), .. }) = &self.staged {
            let _ = std::fs::remove_dir_all(tmp);
        }
    }
}

/// A save between its collective start and its collective end.
struct Staged {
    dir: PathBuf,
    tmp: PathBuf,
    /// Rank 0's lock on `tmp`, held until the checkpoint is installed.
    lock: Option<WriterLock>,
    mesh: DeviceMesh,
    /// Every tensor's name, global shape and dtype (for the index).
    tensors: Vec<(String, Vec<usize>, DType)>,
    chunks: Chunks,
    metadata: BTreeMap<String, String>,
}

/// This rank's chunks (those it is the first replica of): name, offsets, local
/// piece. Plain data, so a background thread can write them.
#[derive(Clone)]
struct Chunks {
    /// The checkpoint's id, stamped into the file.
    id: String,
    file: String,
    list: Vec<(String, Vec<usize>, Tensor)>,
}

impl Staged {
    /// Checks the tensors; rank 0 draws the checkpoint's id, removes stale
    /// temporaries and makes and locks the temporary directory, and tells the
    /// others both; picks this rank's chunks.
    fn new(dir: &Path, tensors: &[(&str, &DTensor)], metadata: BTreeMap<String, String>) -> Result<Staged> {
        let Some((_, first)) = tensors.first() else {
            return Err(ckpt_error(dir, "nothing to save: no tensors given".into()));
        };
        let mesh = first.mesh().clone();
        let comm = mesh.comm();
        let checked = check_tensors(dir, tensors, &mesh);
        let mut lock = None;
        let made = checked.and_then(|()| {
            if comm.rank() != 0 {
                return Ok(Vec::new());
            }
            let id = new_id();
            let (tmp, l) = temps::make_temp_dir(dir, &id)?;
            lock = Some(l);
            // INVARIANT: `make_temp_dir` returns a path with a file name.
            let name = tmp.file_name().expect("a temporary directory has a name");
            Ok(format!("{id}/{}", name.to_string_lossy()).into_bytes())
        });
        let shared = match agree(comm, dir, made) {
            Ok(all) => all,
            Err(e) => {
                if let Some(l) = lock.take() {
                    let _ = std::fs::remove_dir_all(l.dir());
                }
                return Err(e);
            }
        };
        let shared = String::from_utf8_lossy(&shared[0]).into_owned();
        let Some((id, name)) = shared.split_once('/') else {
            return Err(ckpt_error(
                dir,
                format!("rank 0 sent {shared:?}, not a checkpoint id and directory"),
            ));
        };
        let tmp = files::parent_of(dir).join(name);
        let coord = mesh.coordinate();
        let mut list = Vec::new();
        for (name, x) in tensors {
            let writer = x
                .placements()
                .iter()
                .zip(coord)
                .all(|(p, &c)| !p.is_replicate() || c == 0);
            let (offsets, _) = x.layout().local_region(coord)?;
            if writer && x.to_local().numel() > 0 {
                list.push((name.to_string(), offsets, x.to_local().clone()));
            }
        }
        Ok(Staged {
            dir: dir.to_path_buf(),
            tmp,
            lock,
            tensors: tensors
                .iter()
                .map(|(n, x)| (n.to_string(), x.shape().to_vec(), x.dtype()))
                .collect(),
            chunks: Chunks {
                id: id.to_string(),
                file: chunk_file_name(mesh.rank()),
                list,
            },
            mesh,
            metadata,
        })
    }

    /// Shares every rank's chunk list; rank 0 writes the index and installs the
    /// directory. Collective.
    fn finish(self, written: Result<Written>) -> Result<SaveReport> {
        let Staged {
            dir,
            tmp,
            lock,
            mesh,
            tensors,
            metadata,
            chunks,
        } = self;
        let comm = mesh.comm();
        let lead = comm.rank() == 0;
        let (listed, report) = match written {
            Ok((l, r)) => (serde_json::to_vec(&l).map_err(|e| ckpt_error(&dir, e.to_string())), r),
            Err(e) => (Err(e), SaveReport::default()),
        };
        let all = match agree(comm, &dir, listed) {
            Ok(all) => all,
            Err(e) => {
                if lead {
                    let _ = std::fs::remove_dir_all(&tmp);
                }
                return Err(e);
            }
        };
        let installed = if let Some(lock) = &lock {
            let r = write_index(&tmp, &dir, &chunks.id, lock, &tensors, &all, metadata);
            if r.is_err() {
                let _ = std::fs::remove_dir_all(&tmp);
            }
            r
        } else {
            Ok(())
        };
        drop(lock);
        agree(comm, &dir, installed.map(|()| Vec::new()))?;
        Ok(report)
    }
}

impl Chunks {
    /// Writes the chunks to one file in `tmp` (none when there are none).
    fn write(&self, tmp: &Path) -> Result<Written> {
        if self.list.is_empty() {
            return Ok((Vec::new(), SaveReport::default()));
        }
        // Keyed by the tensor's name (one piece per tensor per rank), as
        // readers of sharded safetensors expect.
        let keyed: Vec<(String, &[usize], &Tensor)> =
            self.list.iter().map(|(n, o, t)| (n.clone(), &o[..], t)).collect();
        let stamp = files::Stamp {
            id: &self.id,
            file: &self.file,
        };
        let ranges = files::write_safetensors(&tmp.join(&self.file), &keyed, &stamp, index::BLOCK_SIZE)?;
        let report = SaveReport {
            chunks: self.list.len(),
            bytes_written: ranges.iter().map(|w| w.end - w.begin).sum(),
        };
        let listed = self
            .list
            .iter()
            .zip(ranges)
            .map(|((n, offsets, t), w)| {
                let chunk = Chunk {
                    offsets: offsets.clone(),
                    shape: t.shape().to_vec(),
                    file: self.file.clone(),
                    key: w.key,
                    begin: w.begin,
                    end: w.end,
                    checksums: w.checksums,
                };
                (n.clone(), chunk)
            })
            .collect();
        Ok((listed, report))
    }
}

fn check_tensors(dir: &Path, tensors: &[(&str, &DTensor)], mesh: &DeviceMesh) -> Result<()> {
    for (i, (name, x)) in tensors.iter().enumerate() {
        if tensors[..i].iter().any(|(n, _)| n == name) {
            return Err(ckpt_error(dir, format!("two tensors are named {name:?}")));
        }
        if !x.mesh().same_as(mesh) {
            return Err(ckpt_error(
                dir,
                format!(
                    "tensor {name} lives on mesh {}, the first on {mesh}; save one mesh's tensors together",
                    x.mesh()
                ),
            ));
        }
        if x.placements().iter().any(|p| p.is_partial()) {
            return Err(ckpt_error(
                dir,
                format!(
                    "tensor {name} is placed {}; a checkpoint holds values: reduce the Partial dims first",
                    PlacementsDisplay(x.placements())
                ),
            ));
        }
    }
    Ok(())
}

/// The chunk file of `rank`: `shard-{rank + 1}-model-00001-of-00001.safetensors`
/// (five digits), the name PyTorch's `HuggingFaceStorageWriter(...,
/// save_distributed=True)` gives a rank's file.
pub(crate) fn chunk_file_name(rank: usize) -> String {
    format!("shard-{:05}-model-00001-of-00001.safetensors", rank + 1)
}

/// A chunk as a rank reports it to rank 0: the tensor's name and the chunk.
type Listed = (String, Chunk);

/// What a rank's writer produced: its chunks and its report.
type Written = (Vec<Listed>, SaveReport);

/// A fresh checkpoint id: 128 random bits as 32 hex digits, from the system's
/// random source (or, without one, from the standard library's random hash
/// keys mixed with the time and process).
fn new_id() -> String {
    use std::io::Read;
    let mut bytes = [0u8; 16];
    let urandom = std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut bytes));
    if urandom.is_err() {
        use std::hash::{BuildHasher, Hasher};
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        for half in bytes.chunks_mut(8) {
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u128(now);
            h.write_u32(std::process::id());
            half.copy_from_slice(&h.finish().to_le_bytes());
        }
    }
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Builds, checks and writes the index (with checkpoint `id`) from every
/// rank's chunk list, then installs `tmp` as `dir`, removing the lock file of
/// `lock` first (the lock itself is held until the caller drops it).
fn write_index(
    tmp: &Path,
    dir: &Path,
    id: &str,
    lock: &WriterLock,
    tensors: &[(String, Vec<usize>, DType)],
    lists: &[Vec<u8>],
    metadata: BTreeMap<String, String>,
) -> Result<()> {
    let mut entries: BTreeMap<String, TensorEntry> = tensors
        .iter()
        .map(|(n, shape, dtype)| {
            (
                n.clone(),
                TensorEntry {
                    shape: shape.clone(),
                    dtype: index::dtype_name(*dtype).to_string(),
                    chunks: Vec::new(),
                },
            )
        })
        .collect();
    for list in lists {
        let chunks: Vec<Listed> = serde_json::from_slice(list).map_err(|e| ckpt_error(dir, e.to_string()))?;
        for (name, chunk) in chunks {
            let t = entries
                .get_mut(&name)
                .ok_or_else(|| ckpt_error(dir, format!("a rank wrote unknown tensor {name}")))?;
            t.chunks.push(chunk);
        }
    }
    let mut index = Index {
        format: index::FORMAT.into(),
        version: index::VERSION,
        id: id.to_string(),
        block_size: index::BLOCK_SIZE,
        checksum: String::new(),
        tensors: entries,
        metadata,
    };
    index.validate(&dir.join(INDEX_FILE).display().to_string())?;
    index.checksum = index.sealed_checksum()?;
    let text = serde_json::to_vec_pretty(&index).map_err(|e| ckpt_error(dir, e.to_string()))?;
    files::write_synced(&tmp.join(INDEX_FILE), &text)?;
    lock.remove_file()?;
    files::sync_dir(tmp)?;
    files::install(tmp, dir)
}
