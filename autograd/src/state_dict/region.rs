//! Reading one region of a tensor from a consolidated safetensors file: the
//! header checked once at open (as [`read_safetensors`](super::read_safetensors)
//! checks it), then for each region one positioned read per contiguous run of
//! its bytes, and nothing else.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use safetensors::tensor::{TensorInfo, TensorView};
use tessera_dtensor::redistribute::for_each_region_run;
use tessera_dtensor::{DTensor, Layout, PlacementsDisplay, Tensor};
use tessera_mesh::{DType, DeviceMesh};

use super::read::{Checked, invalid, open_checked};
use super::{convertible, decode, decoded_dtype};
use crate::{Error, Result};

/// A safetensors file opened for reading regions of its tensors: each rank
/// reads only the bytes of its own shard, so a model can be materialised shard
/// by shard from a consolidated file without any rank reading (or holding) a
/// whole tensor it does not replicate. Not collective; `Send` and `Sync`, so
/// ranks on threads may share one.
///
/// Opening reads the length prefix and the header and checks them against the
/// file's size exactly as [`read_safetensors`](super::read_safetensors) does;
/// [`read_region`](Self::read_region) then reads with positioned reads, one per
/// maximal contiguous run of the region (trailing dims it holds whole merge
/// into one run), and converts dtypes as
/// [`load_state_dict`](super::load_state_dict) does.
///
/// PyTorch: `safetensors.safe_open(path, "pt").get_slice(name)[...]`.
///
/// ```
/// use tessera_autograd::state_dict::{SafetensorsReader, write_safetensors};
/// use tessera_dtensor::{DType, Tensor};
///
/// let path = std::env::temp_dir().join(format!("tessera-doc-region-{}.safetensors", std::process::id()));
/// let w = Tensor::arange(12, DType::F32)?.reshape(&[4, 3])?;
/// write_safetensors(&path, &[("w".to_string(), w)])?;
/// let reader = SafetensorsReader::open(&path)?;
/// assert_eq!(reader.info("w")?, (DType::F32, &[4, 3][..]));
/// // Rows 1..3, columns 1..3, as f64: two reads of 8 bytes each.
/// let part = reader.read_region("w", &[1, 1], &[2, 2], DType::F64)?;
/// assert_eq!(part.to_f64_vec(), [4.0, 5.0, 7.0, 8.0]);
/// assert_eq!(reader.bytes_read(), 16);
/// # std::fs::remove_file(&path).unwrap();
/// # Ok::<(), tessera_autograd::Error>(())
/// ```
pub struct SafetensorsReader {
    path: PathBuf,
    file: File,
    data_start: u64,
    /// Name and header entry of every tensor, in the file's order (by offset).
    tensors: Vec<(String, TensorInfo)>,
    by_name: HashMap<String, usize>,
    bytes_read: AtomicU64,
}

impl std::fmt::Debug for SafetensorsReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "SafetensorsReader({}, {} tensors)",
            self.path.display(),
            self.tensors.len()
        )
    }
}

impl SafetensorsReader {
    /// Opens the safetensors file at `path`, reading only its length prefix and
    /// header, and checks them against the file's size.
    ///
    /// # Errors
    /// As [`read_safetensors`](super::read_safetensors), for everything but the
    /// data itself: [`Error::Io`] when the file cannot be opened or read;
    /// [`Error::StateDict`] naming the path for anything but a regular file, a
    /// corrupt header, a tensor whose byte span does not fit its shape and
    /// dtype, or a data section shorter (naming the first tensor cut off) or
    /// longer than the header declares.
    pub fn open(path: impl AsRef<Path>) -> Result<SafetensorsReader> {
        let path = path.as_ref();
        let Checked {
            file,
            metadata,
            data_start,
            ..
        } = open_checked(path)?;
        let mut tensors: Vec<(String, TensorInfo)> = metadata
            .tensors()
            .into_iter()
            .map(|(name, info)| (name, info.clone()))
            .collect();
        tensors.sort_by(|a, b| (a.1.data_offsets, &a.0).cmp(&(b.1.data_offsets, &b.0)));
        let by_name = tensors.iter().enumerate().map(|(i, (n, _))| (n.clone(), i)).collect();
        Ok(SafetensorsReader {
            path: path.to_path_buf(),
            file,
            data_start,
            tensors,
            by_name,
            bytes_read: AtomicU64::new(0),
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The names of the file's tensors, in the file's order (by offset).
    pub fn names(&self) -> impl Iterator<Item = &str> + '_ {
        self.tensors.iter().map(|(n, _)| n.as_str())
    }

    /// The dtype tensor `name` reads as by default (as
    /// [`read_safetensors`](super::read_safetensors) gives it: `BOOL` as `U8`,
    /// the other integer dtypes as `I64`) and its global shape.
    ///
    /// # Errors
    /// [`Error::StateDict`] naming the file and the tensor: no tensor of that
    /// name (a few that exist are listed), or a dtype Tessera cannot hold
    /// (8-bit floats).
    pub fn info(&self, name: &str) -> Result<(DType, &[usize])> {
        let info = self.entry(name)?;
        let dtype = decoded_dtype(info.dtype).ok_or_else(|| {
            self.error(
                name,
                format!(
                    "dtype {:?}, which Tessera cannot hold; convert it to F32 or BF16",
                    info.dtype
                ),
            )
        })?;
        Ok((dtype, &info.shape))
    }

    /// Bytes of tensor data this reader has read so far (the header excluded).
    pub fn bytes_read(&self) -> u64 {
        self.bytes_read.load(Ordering::Relaxed)
    }

    /// The region `[offset, offset + shape)` of tensor `name`, as a contiguous
    /// tensor of `shape` and `dtype`: reads only the region's bytes, one
    /// positioned read per maximal contiguous run, and converts the file's
    /// dtype to `dtype` as [`load_state_dict`](super::load_state_dict) does
    /// (floats to any float dtype, integers to any integer dtype). An empty
    /// region reads nothing; a scalar's region is `offset = shape = []`.
    ///
    /// # Errors
    /// [`Error::StateDict`] naming the file and the tensor: no tensor of that
    /// name (a few that exist are listed); an `offset` or `shape` of another
    /// length than the tensor's shape, or a region that does not lie inside it
    /// (both given, with the tensor's shape); a file dtype that cannot convert
    /// to `dtype`, or that Tessera cannot hold; a file cut short since it was
    /// opened; a read that fails; a buffer that cannot be allocated.
    pub fn read_region(&self, name: &str, offset: &[usize], shape: &[usize], dtype: DType) -> Result<Tensor> {
        let info = self.entry(name)?;
        let full = &info.shape;
        let inside = offset.len() == full.len()
            && shape.len() == full.len()
            && (0..full.len()).all(|d| offset[d].checked_add(shape[d]).is_some_and(|end| end <= full[d]));
        if !inside {
            return Err(self.error(
                name,
                format!(
                    "the region at offset {offset:?} of shape {shape:?} does not lie inside the tensor's shape \
                     {full:?}; give one offset and one extent per dim, with offset + extent <= size"
                ),
            ));
        }
        convertible(info.dtype, dtype).map_err(|e| self.error(name, e))?;
        let size = info.dtype.size();
        // Inside a tensor whose byte length the header check bounded: no overflow.
        let len = shape.iter().product::<usize>() * size;
        let mut bytes = Vec::new();
        bytes
            .try_reserve_exact(len)
            .map_err(|_| self.error(name, format!("cannot allocate {len} bytes for the region")))?;
        bytes.resize(len, 0);
        let base = self.data_start + info.data_offsets.0 as u64;
        let mut failed = None;
        let mut read = 0u64;
        for_each_region_run(full, offset, shape, |at, into, n| {
            if failed.is_some() {
                return;
            }
            let buf = &mut bytes[into * size..(into + n) * size];
            match self.file.read_exact_at(buf, base + (at * size) as u64) {
                Ok(()) => read += buf.len() as u64,
                Err(e) => failed = Some(e),
            }
        })?;
        self.bytes_read.fetch_add(read, Ordering::Relaxed);
        if let Some(e) = failed {
            return Err(if e.kind() == std::io::ErrorKind::UnexpectedEof {
                invalid(
                    &self.path,
                    format!("truncated: tensor {name:?} is cut off; the file shrank after it was opened"),
                )
            } else {
                self.error(name, format!("cannot read: {e}"))
            });
        }
        let view = TensorView::new(info.dtype, shape.to_vec(), &bytes).map_err(|e| invalid(&self.path, e))?;
        Ok(decode(&self.path, name, &view)?.cast(dtype)?)
    }

    /// Tensor `name` as a DTensor of `layout` on `mesh`: this rank reads only
    /// its local region ([`Layout::local_region`] at its coordinate) with
    /// [`read_region`](Self::read_region), in `layout`'s dtype. Not collective.
    ///
    /// The counterpart, for a consolidated file, of
    /// [`Checkpoint::load`](tessera_dtensor::checkpoint::Checkpoint::load).
    ///
    /// # Errors
    /// As `read_region`, and a `layout` whose global shape is not the tensor's,
    /// or with `Partial` placements.
    pub fn load(&self, name: &str, mesh: &DeviceMesh, layout: Layout) -> Result<DTensor> {
        let full = &self.entry(name)?.shape;
        if full.as_slice() != &layout.shape[..] {
            return Err(self.error(
                name,
                format!(
                    "shape mismatch, the file holds {full:?} but the layout is of {:?}",
                    &layout.shape[..]
                ),
            ));
        }
        if layout.has_partial() {
            return Err(self.error(
                name,
                format!(
                    "load into Shard or Replicate placements, not {}",
                    PlacementsDisplay(&layout.placements)
                ),
            ));
        }
        let (offset, shape) = layout.local_region(mesh.coordinate())?;
        let local = self.read_region(name, &offset, &shape, layout.dtype)?;
        Ok(DTensor::from_local_with_layout(local, mesh, layout)?)
    }

    /// The header entry of tensor `name`.
    fn entry(&self, name: &str) -> Result<&TensorInfo> {
        match self.by_name.get(name) {
            Some(&i) => Ok(&self.tensors[i].1),
            None => {
                let some: Vec<&str> = self.names().take(8).collect();
                Err(self.error(
                    name,
                    format!(
                        "no such tensor (the file holds {} tensors, e.g. {some:?}); check the name",
                        self.tensors.len()
                    ),
                ))
            }
        }
    }

    /// An error about tensor `name` of this file.
    fn error(&self, name: &str, detail: impl std::fmt::Display) -> Error {
        Error::StateDict(format!("{}: tensor {name:?}: {detail}", self.path.display()))
    }
}

#[cfg(test)]
mod tests;
