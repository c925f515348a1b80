//! Reading a checkpoint: the index checked once, then each tensor's pieces read
//! from the byte ranges that overlap them.

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use tessera_mesh::{DType, DeviceMesh};

use super::index::{self, Chunk, Index, TensorEntry};
use super::{INDEX_FILE, ckpt_error, files, temps};
use crate::redistribute::for_each_run;
use crate::spec::{PlacementsDisplay, Region};
use crate::{DTensor, Layout, Result, Tensor};

/// A checkpoint directory opened for reading: its index, checked, and the
/// chunk files it names, checked to exist and be long enough. Lives on one
/// rank; opening reads only `index.json` and the files' sizes (and removes
/// dead writers' temporaries beside the checkpoint).
///
/// Every byte a load returns is checked: a chunk file's safetensors header
/// against the index when a load first opens the file (the checkpoint id and
/// file name it is stamped with, and the names, dtypes, shapes and byte ranges
/// of its chunks), and every block of the index's `block_size` that a load
/// reads against its checksum. A load reads whole blocks: at most its own
/// bytes plus two partial blocks per contiguous run of its piece inside a
/// chunk, and never more than the chunks it overlaps.
pub struct Checkpoint {
    dir: PathBuf,
    index: Index,
    /// Chunk files opened and checked so far.
    files: RefCell<HashMap<String, File>>,
    /// Per file: the (tensor, chunk index) pairs the index puts in it.
    by_file: HashMap<String, Vec<(String, usize)>>,
    bytes_read: Cell<u64>,
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Checkpoint({}, {} tensors)",
            self.dir.display(),
            self.index.tensors.len()
        )
    }
}

impl Checkpoint {
    /// Opens the checkpoint at `dir`. Not collective.
    ///
    /// # Errors
    /// [`Error::Checkpoint`](crate::Error::Checkpoint) naming the file: no `index.json`, an index that is
    /// not valid JSON of the format, fails [`Index::validate`] or does not
    /// match its own checksum, a chunk file
    /// that is missing or shorter than the byte ranges the index gives it.
    pub fn open(dir: impl AsRef<Path>) -> Result<Checkpoint> {
        let dir = dir.as_ref().to_path_buf();
        temps::remove_stale_temporaries(&files::parent_of(&dir));
        let path = dir.join(INDEX_FILE);
        let index = if path.exists() || !dir.is_dir() {
            let text = std::fs::read(&path).map_err(|e| files::io_error(&path, "cannot read the index", e))?;
            let index: Index = serde_json::from_slice(&text)
                .map_err(|e| ckpt_error(&path, format!("not a valid checkpoint index: {e}")))?;
            if index.id.is_empty() {
                return Err(ckpt_error(&path, "an index.json without a checkpoint id".into()));
            }
            index.validate(&path.display().to_string())?;
            let sealed = index.sealed_checksum()?;
            if index.checksum != sealed {
                return Err(ckpt_error(
                    &path,
                    format!(
                        "the index does not match its checksum ({} recorded, {sealed} computed): it was edited or \
                         is corrupt",
                        index.checksum
                    ),
                ));
            }
            index
        } else {
            Index::from_sharded_safetensors(&dir)?
        };
        let mut needed: BTreeMap<&str, (u64, &str)> = BTreeMap::new();
        for (name, t) in &index.tensors {
            for c in &t.chunks {
                let e = needed.entry(c.file.as_str()).or_insert((0, name.as_str()));
                if c.end > e.0 {
                    *e = (c.end, name.as_str());
                }
            }
        }
        for (file, (end, name)) in needed {
            let p = dir.join(file);
            let len = std::fs::metadata(&p)
                .map_err(|e| files::io_error(&p, &format!("missing chunk file of tensor {name}"), e))?
                .len();
            if len < end {
                return Err(ckpt_error(
                    &p,
                    format!("truncated: {len} bytes, but tensor {name} has a chunk up to byte {end}"),
                ));
            }
        }
        let mut by_file: HashMap<String, Vec<(String, usize)>> = HashMap::new();
        for (name, t) in &index.tensors {
            for (k, c) in t.chunks.iter().enumerate() {
                by_file.entry(c.file.clone()).or_default().push((name.clone(), k));
            }
        }
        Ok(Checkpoint {
            dir,
            index,
            by_file,
            files: RefCell::new(HashMap::new()),
            bytes_read: Cell::new(0),
        })
    }

    /// The index.
    pub fn index(&self) -> &Index {
        &self.index
    }

    /// The metadata saved with the tensors.
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        &self.index.metadata
    }

    /// Bytes of tensor data this handle has read so far.
    pub fn bytes_read(&self) -> u64 {
        self.bytes_read.get()
    }

    /// The entry of tensor `name`.
    ///
    /// # Errors
    /// No tensor of that name (the error lists a few that exist).
    pub fn entry(&self, name: &str) -> Result<&TensorEntry> {
        self.index.tensors.get(name).ok_or_else(|| {
            let some: Vec<&String> = self.index.tensors.keys().take(8).collect();
            ckpt_error(
                &self.dir,
                format!(
                    "no tensor {name} (it holds {} tensors, e.g. {some:?})",
                    self.index.tensors.len()
                ),
            )
        })
    }

    /// Reads tensor `name` as a DTensor of `layout` on `mesh`: this rank reads
    /// only the bytes of the chunks its piece overlaps (the whole tensor only
    /// when `layout` replicates it). Not collective.
    ///
    /// # Errors
    /// A missing tensor; a layout whose global shape or dtype differs from the
    /// saved one, or with `Partial` placements; a chunk file that cannot be read.
    pub fn load(&self, name: &str, mesh: &DeviceMesh, layout: Layout) -> Result<DTensor> {
        let t = self.entry(name)?;
        let dtype = t.dtype()?;
        if t.shape != layout.shape.as_slice() || dtype != layout.dtype {
            return Err(ckpt_error(
                &self.dir,
                format!(
                    "tensor {name} is saved as {:?} {dtype}; asked for {:?} {}",
                    t.shape,
                    &layout.shape[..],
                    layout.dtype
                ),
            ));
        }
        if layout.has_partial() {
            return Err(ckpt_error(
                &self.dir,
                format!(
                    "tensor {name}: load into Shard or Replicate placements, not {}",
                    PlacementsDisplay(&layout.placements)
                ),
            ));
        }
        let mine = layout.region(mesh.coordinate())?;
        let size = dtype.size_in_bytes();
        let mut bytes = vec![0u8; mine.numel() * size];
        let mut covered = 0usize;
        for c in &t.chunks {
            let chunk = Region {
                offset: c.offsets.clone(),
                shape: c.shape.clone(),
            };
            let part = mine.intersect(&chunk);
            if part.numel() == 0 {
                continue;
            }
            covered += part.numel();
            self.read_part(name, c, &chunk, &mine, &part, size, &mut bytes)?;
        }
        if covered != mine.numel() {
            return Err(ckpt_error(
                &self.dir,
                format!(
                    "tensor {name}: the chunks cover {covered} of the {} elements this rank needs",
                    mine.numel()
                ),
            ));
        }
        let local = Tensor::from_buffer(buffer_from_bytes(dtype, &bytes)?, &mine.shape)?;
        DTensor::from_local_with_layout(local, mesh, layout)
    }

    /// Opens chunk file `c.file` and checks its header against the index, once
    /// per handle (a file that fails is checked again on the next load).
    fn checked_file(&self, name: &str, c: &Chunk) -> Result<std::cell::RefMut<'_, File>> {
        let mut files = self.files.borrow_mut();
        if !files.contains_key(&c.file) {
            let path = self.dir.join(&c.file);
            let f = files::open_read(&path)?;
            let held: Vec<(&str, &str, &Chunk)> = self
                .by_file
                .get(&c.file)
                .into_iter()
                .flatten()
                .map(|(t, k)| {
                    let e = &self.index.tensors[t];
                    (t.as_str(), e.dtype.as_str(), &e.chunks[*k])
                })
                .collect();
            files::check_header(&path, &f, (&self.index.id, self.index.version), &c.file, &held).map_err(
                |e| match e {
                    crate::Error::Checkpoint { path, detail } => crate::Error::Checkpoint {
                        path,
                        detail: format!("loading tensor {name}: {detail}"),
                    },
                    e => e,
                },
            )?;
            files.insert(c.file.clone(), f);
        }
        // INVARIANT: inserted above when missing.
        Ok(std::cell::RefMut::map(files, |f| {
            f.get_mut(&c.file).expect("opened above")
        }))
    }

    /// Reads the runs of `part` (inside `chunk`, laid out row-major in its file
    /// range) into `out` (laid out as `mine`): every block the runs touch is
    /// read whole and checked against its checksum, then the runs copied out.
    #[allow(clippy::too_many_arguments)]
    fn read_part(
        &self,
        name: &str,
        c: &Chunk,
        chunk: &Region,
        mine: &Region,
        part: &Region,
        size: usize,
        out: &mut [u8],
    ) -> Result<()> {
        let path = self.dir.join(&c.file);
        let file = self.checked_file(name, c)?;
        // The runs (element offsets in the chunk and in `out`, length), in
        // increasing chunk offset, grouped into spans of consecutive blocks.
        let mut runs = Vec::new();
        for_each_run(chunk, mine, part, |src, dst, len| {
            if len > 0 {
                runs.push((src, dst, len));
            }
        });
        runs.sort_unstable();
        // Whole checksum blocks, so that each can be checked; a checkpoint
        // written elsewhere has no checksums, so exactly the runs' bytes.
        let verified = !c.checksums.is_empty();
        let block = if verified { self.index.block_size } else { 1 };
        let chunk_bytes = c.end - c.begin;
        let mut spans: Vec<(u64, u64, usize)> = Vec::new(); // first block, last block, runs until
        for (i, &(src, _, len)) in runs.iter().enumerate() {
            let (lo, hi) = ((src * size) as u64 / block, ((src + len) * size) as u64 - 1);
            let hi = hi / block;
            match spans.last_mut() {
                Some(s) if lo <= s.1 + 1 => {
                    s.1 = s.1.max(hi);
                    s.2 = i + 1;
                }
                _ => spans.push((lo, hi, i + 1)),
            }
        }
        let mut first_run = 0;
        let mut buf = Vec::new();
        for (lo, hi, runs_end) in spans {
            let begin = lo * block;
            let end = ((hi + 1) * block).min(chunk_bytes);
            buf.resize((end - begin) as usize, 0);
            file.read_exact_at(&mut buf, c.begin + begin)
                .map_err(|e| files::io_error(&path, &format!("cannot read tensor {name}"), e))?;
            self.bytes_read.set(self.bytes_read.get() + buf.len() as u64);
            for k in (lo..=hi).filter(|_| verified) {
                let at = ((k - lo) * block) as usize;
                let bytes = &buf[at..(at + block as usize).min(buf.len())];
                if index::checksum(bytes) != c.block_checksum(k) {
                    let from = c.begin + k * block;
                    return Err(ckpt_error(
                        &path,
                        format!(
                            "tensor {name}: chunk {} does not match its checksum in block {k} (bytes {from}..{}): \
                             the file is corrupt",
                            c.key,
                            from + bytes.len() as u64
                        ),
                    ));
                }
            }
            for &(src, dst, len) in &runs[first_run..runs_end] {
                let at = src * size - begin as usize;
                out[dst * size..(dst + len) * size].copy_from_slice(&buf[at..at + len * size]);
            }
            first_run = runs_end;
        }
        Ok(())
    }
}

/// A buffer of `dtype` from its little-endian bytes.
fn buffer_from_bytes(dtype: DType, bytes: &[u8]) -> Result<tessera_mesh::Buffer> {
    let mut buf = tessera_mesh::Buffer::zeros(dtype, bytes.len() / dtype.size_in_bytes().max(1));
    tessera_mesh::dispatch_buf!(BufMut, buf.as_buf_mut(), s, T => {
        bytemuck::cast_slice_mut::<T, u8>(s).copy_from_slice(bytes)
    });
    Ok(buf)
}
