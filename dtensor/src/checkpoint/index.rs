//! The index of a sharded checkpoint (`index.json`): every tensor's global shape
//! and dtype, and where each of its chunks lies.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use tessera_mesh::DType;

use tessera_tensor::Error as TensorError;

use crate::{Error, Result};

/// The `format` an index names.
pub(crate) const FORMAT: &str = "tessera-checkpoint";
/// The version this code writes and reads.
pub(crate) const VERSION: u32 = 1;

/// The index of a checkpoint directory.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Index {
    /// Always `"tessera-checkpoint"`.
    pub format: String,
    /// The format version (1).
    pub version: u32,
    /// Every tensor, by name.
    pub tensors: BTreeMap<String, TensorEntry>,
    /// Free-form strings saved with the tensors (the training step, say).
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
}

/// One tensor of a checkpoint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TensorEntry {
    /// The global shape.
    pub shape: Vec<usize>,
    /// The element type, by its safetensors name (`"F32"`, `"BF16"`, ...).
    pub dtype: String,
    /// The chunks, disjoint and together the whole tensor.
    pub chunks: Vec<Chunk>,
}

/// A box of a tensor stored in one file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Chunk {
    /// Where the box starts in the global tensor.
    pub offsets: Vec<usize>,
    /// The box's extent per dim.
    pub shape: Vec<usize>,
    /// The safetensors file (a plain name in the checkpoint directory).
    pub file: String,
    /// The chunk's name inside that file.
    pub key: String,
    /// The byte range `[begin, end)` of its elements (row-major) in the file.
    pub begin: u64,
    /// See `begin`.
    pub end: u64,
    /// FNV-1a (64-bit) of the chunk's bytes, as 16 hex digits: checked whenever
    /// a load reads the whole chunk.
    pub checksum: String,
}

/// The safetensors name of a dtype.
pub(crate) fn dtype_name(d: DType) -> &'static str {
    match d {
        DType::F32 => "F32",
        DType::F64 => "F64",
        DType::BF16 => "BF16",
        DType::F16 => "F16",
        DType::I64 => "I64",
        DType::U8 => "U8",
        // A dtype added later: no safetensors name yet, and `validate` rejects it.
        _ => "UNKNOWN",
    }
}

/// The dtype of a safetensors name.
pub(crate) fn dtype_of(name: &str) -> Option<DType> {
    DType::ALL.into_iter().find(|&d| dtype_name(d) == name)
}

impl TensorEntry {
    /// The entry's dtype.
    ///
    /// # Errors
    /// A name that is not one of the six dtypes.
    pub fn dtype(&self) -> Result<DType> {
        dtype_of(&self.dtype).ok_or_else(|| {
            Error::from(TensorError::InvalidArgument {
                op: "checkpoint",
                detail: format!("unknown dtype {:?}", self.dtype),
            })
        })
    }
}

impl Index {
    /// Checks everything the index says about itself: format and version, known
    /// dtypes, chunks inside their tensor, byte ranges of the right length,
    /// plain file names, and chunks that tile each tensor exactly. `path` names
    /// the index in errors.
    ///
    /// # Errors
    /// [`Error::Checkpoint`] naming the tensor and what is wrong.
    pub fn validate(&self, path: &str) -> Result<()> {
        let bad = |detail: String| Error::Checkpoint {
            path: path.to_string(),
            detail,
        };
        if self.format != FORMAT || self.version != VERSION {
            return Err(bad(format!(
                "format {:?} version {}; this build reads {FORMAT:?} version {VERSION}",
                self.format, self.version
            )));
        }
        for (name, t) in &self.tensors {
            let dtype = dtype_of(&t.dtype).ok_or_else(|| bad(format!("tensor {name}: unknown dtype {:?}", t.dtype)))?;
            let numel =
                checked_numel(&t.shape).ok_or_else(|| bad(format!("tensor {name}: shape {:?} overflows", t.shape)))?;
            let mut covered = 0usize;
            for (k, c) in t.chunks.iter().enumerate() {
                let inside = c.offsets.len() == t.shape.len()
                    && c.shape.len() == t.shape.len()
                    && (0..t.shape.len())
                        .all(|d| c.offsets[d].checked_add(c.shape[d]).is_some_and(|e| e <= t.shape[d]));
                if !inside {
                    return Err(bad(format!(
                        "tensor {name}: chunk {k} at {:?} of shape {:?} lies outside the tensor's shape {:?}",
                        c.offsets, c.shape, t.shape
                    )));
                }
                let n = checked_numel(&c.shape).unwrap_or(usize::MAX);
                let bytes = (n as u128) * dtype.size_in_bytes() as u128;
                if c.end < c.begin || u128::from(c.end - c.begin) != bytes {
                    return Err(bad(format!(
                        "tensor {name}: chunk {k} spans bytes {}..{} of {}, but {:?} {} elements need {bytes}",
                        c.begin, c.end, c.file, c.shape, t.dtype
                    )));
                }
                if c.file.is_empty() || c.file.contains(['/', '\\']) || c.file.starts_with('.') {
                    return Err(bad(format!(
                        "tensor {name}: chunk {k} names the file {:?}; chunk files are plain names inside the \
                         checkpoint directory",
                        c.file
                    )));
                }
                for (j, o) in t.chunks[..k].iter().enumerate() {
                    let overlap = (0..t.shape.len())
                        .all(|d| c.offsets[d] < o.offsets[d] + o.shape[d] && o.offsets[d] < c.offsets[d] + c.shape[d]);
                    if overlap && n > 0 && checked_numel(&o.shape).unwrap_or(0) > 0 {
                        return Err(bad(format!("tensor {name}: chunks {j} and {k} overlap")));
                    }
                }
                covered = covered.saturating_add(n);
            }
            if covered != numel {
                return Err(bad(format!(
                    "tensor {name}: its chunks hold {covered} of its {numel} elements"
                )));
            }
        }
        Ok(())
    }
}

fn checked_numel(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |a, &b| a.checked_mul(b))
}
