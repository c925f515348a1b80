//! Reading a checkpoint: the index checked once, then each tensor's pieces read
//! from the byte ranges that overlap them.

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use tessera_mesh::{DType, DeviceMesh};

use super::index::{Chunk, Index, TensorEntry};
use super::{INDEX_FILE, ckpt_error, files};
use crate::redistribute::for_each_run;
use crate::spec::{PlacementsDisplay, Region};
use crate::{DTensor, Layout, Result, Tensor};

/// A checkpoint directory opened for reading: its index, checked, and the
/// chunk files it names, checked to exist and be long enough. Lives on one
/// rank; opening reads only `index.json` and the files' sizes.
pub struct Checkpoint {
    dir: PathBuf,
    index: Index,
    files: RefCell<HashMap<String, File>>,
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
    /// not valid JSON of the format or fails [`Index::validate`], a chunk file
    /// that is missing or shorter than the byte ranges the index gives it.
    pub fn open(dir: impl AsRef<Path>) -> Result<Checkpoint> {
        let dir = dir.as_ref().to_path_buf();
        let path = dir.join(INDEX_FILE);
        let text = std::fs::read(&path).map_err(|e| files::io_error(&path, "cannot read the index", e))?;
        let index: Index = serde_json::from_slice(&text)
            .map_err(|e| ckpt_error(&path, format!("not a valid checkpoint index: {e}")))?;
        index.validate(&path.display().to_string())?;
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
        Ok(Checkpoint {
            dir,
            index,
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

    /// [`load`](Self::load) into `like`'s mesh and layout.
    ///
    /// # Errors
    /// As `load`.
    pub fn load_like(&self, name: &str, like: &DTensor) -> Result<DTensor> {
        self.load(name, like.mesh(), like.layout().clone())
    }

    /// Reads the runs of `part` (inside `chunk`, laid out row-major in its file
    /// range) into `out` (laid out as `mine`).
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
        let mut files = self.files.borrow_mut();
        let file = match files.get(&c.file) {
            Some(f) => f,
            None => {
                let f = files::open_read(&path)?;
                files.entry(c.file.clone()).or_insert(f)
            }
        };
        if part == chunk {
            // The whole chunk: one read, checked against its checksum.
            let mut whole = vec![0u8; (c.end - c.begin) as usize];
            file.read_exact_at(&mut whole, c.begin)
                .map_err(|e| files::io_error(&path, &format!("cannot read tensor {name}"), e))?;
            self.bytes_read.set(self.bytes_read.get() + whole.len() as u64);
            if files::checksum(&whole) != c.checksum {
                return Err(ckpt_error(
                    &path,
                    format!(
                        "tensor {name}: chunk {} (bytes {}..{}) does not match its checksum: the file is corrupt",
                        c.key, c.begin, c.end
                    ),
                ));
            }
            for_each_run(chunk, mine, part, |src, dst, len| {
                out[dst * size..(dst + len) * size].copy_from_slice(&whole[src * size..(src + len) * size]);
            });
            return Ok(());
        }
        let mut failed = None;
        let mut read = 0u64;
        for_each_run(chunk, mine, part, |src, dst, len| {
            if failed.is_some() {
                return;
            }
            let at = c.begin + (src * size) as u64;
            let buf = &mut out[dst * size..(dst + len) * size];
            match file.read_exact_at(buf, at) {
                Ok(()) => read += buf.len() as u64,
                Err(e) => failed = Some(e),
            }
        });
        self.bytes_read.set(self.bytes_read.get() + read);
        match failed {
            Some(e) => Err(files::io_error(&path, &format!("cannot read tensor {name}"), e)),
            None => Ok(()),
        }
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
