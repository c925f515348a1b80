//! The index of a sharded checkpoint (`index.json`): every tensor's global shape
//! and dtype, and where each of its chunks lies.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use tessera_mesh::DType;

use tessera_tensor::Error as TensorError;

use crate::{Error, Result};

/// The index's file name, for errors without a path.
const INDEX_NAME: &str = "index.json";

/// The `format` an index names.
pub(crate) const FORMAT: &str = "tessera-checkpoint";
/// The `format` of an index built from the files of a sharded safetensors
/// checkpoint written elsewhere ([`Index::from_sharded_safetensors`]).
pub const SHARDED_SAFETENSORS: &str = "sharded-safetensors";
/// The version this code writes: 3, whose chunk files are also a sharded
/// safetensors checkpoint as PyTorch's distributed checkpoint reads them
/// (`HuggingFaceStorageReader`): each rank's file
/// `shard-NNNNN-model-00001-of-00001.safetensors` holds its piece of each
/// tensor under the tensor's name, with the piece's offsets in
/// `DCP_SHARDING_INFO`. Version 2 (chunks keyed `NAME@OFFSETS` in
/// `rankNNNNN.safetensors`) is still read; version 1 (one checksum per chunk,
/// which a partial read could not check, and no checkpoint id) no longer is.
pub(crate) const VERSION: u32 = 3;
/// The oldest version this code reads.
pub(crate) const OLDEST_VERSION: u32 = 2;
/// The block size a save checksums chunks at: 64 KiB. A load reads and checks
/// every block its runs touch, so it reads at most its own bytes plus two
/// partial blocks per contiguous run (and never more than the chunks it
/// overlaps).
pub(crate) const BLOCK_SIZE: u64 = 64 << 10;
/// The largest block size an index may name (1 GiB).
const MAX_BLOCK_SIZE: u64 = 1 << 30;
/// Hex digits of one block checksum.
pub(crate) const CHECKSUM_DIGITS: usize = 16;

/// The index of a checkpoint directory.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Index {
    /// Always `"tessera-checkpoint"`.
    pub format: String,
    /// The format version (2).
    pub version: u32,
    /// The checkpoint's identity: 128 random bits as 32 hex digits, drawn once
    /// per save and stamped into every chunk file's `__metadata__`, so a file
    /// of another checkpoint is told apart.
    pub id: String,
    /// The block size (bytes, a power of two) of the chunks' checksums.
    pub block_size: u64,
    /// FNV-1a (64-bit) of the index itself, as 16 hex digits
    /// ([`Index::sealed_checksum`]): an edited or corrupt index (a metadata
    /// value, a checksum of a block no rank reads) is an error on every rank.
    pub checksum: String,
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
    /// FNV-1a (64-bit) of each `block_size` block of the chunk's bytes (the
    /// last one shorter), 16 hex digits each, concatenated: a load checks every
    /// block it reads, whole chunk or part.
    pub checksums: String,
}

impl Chunk {
    /// The number of checksum blocks of this chunk at `block_size`.
    pub(crate) fn blocks(&self, block_size: u64) -> u64 {
        (self.end - self.begin).div_ceil(block_size)
    }

    /// The checksum of block `k`.
    pub(crate) fn block_checksum(&self, k: u64) -> &str {
        let at = k as usize * CHECKSUM_DIGITS;
        &self.checksums[at..at + CHECKSUM_DIGITS]
    }
}

/// A chunk's key in its file: `NAME@OFFSETS` (offsets comma-separated).
pub(crate) fn chunk_key(name: &str, offsets: &[usize]) -> String {
    let o: Vec<String> = offsets.iter().map(usize::to_string).collect();
    format!("{name}@{}", o.join(","))
}

/// FNV-1a, 64-bit, over `bytes`, as 16 hex digits. Any change of one byte
/// changes it (each step is a bijection of the state).
pub(crate) fn checksum(bytes: &[u8]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
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
    /// The checksum this index should carry: FNV-1a (64-bit) of its compact
    /// JSON with `checksum` empty.
    ///
    /// # Errors
    /// An index that does not serialize (never, for a valid one).
    pub fn sealed_checksum(&self) -> Result<String> {
        let mut unsealed = self.clone();
        unsealed.checksum.clear();
        let bytes = serde_json::to_vec(&unsealed).map_err(|e| Error::Checkpoint {
            path: INDEX_NAME.into(),
            detail: e.to_string(),
        })?;
        Ok(checksum(&bytes))
    }

    /// Checks everything the index says about itself: format and version, a
    /// checkpoint id of 32 hex digits, a block size that is a power of two,
    /// known dtypes, chunks inside their tensor, keys as the format version names them, byte ranges
    /// of the right length, one checksum per block, plain file names, and
    /// chunks that tile each tensor exactly. `path` names the index in errors.
    ///
    /// # Errors
    /// [`Error::Checkpoint`] naming the tensor and what is wrong.
    pub fn validate(&self, path: &str) -> Result<()> {
        let bad = |detail: String| Error::Checkpoint {
            path: path.to_string(),
            detail,
        };
        if self.format == SHARDED_SAFETENSORS && self.id.is_empty() {
            // Built from the files themselves: no stamps, no checksums, keys
            // are the tensors' names.
            return self.validate_tensors(path, false);
        }
        if self.format != FORMAT || !(OLDEST_VERSION..=VERSION).contains(&self.version) {
            let hint = if self.format == FORMAT && self.version < OLDEST_VERSION {
                "; older versions (one checksum per chunk, which partial reads could not check, and no checkpoint \
                 id) are not read: save the tensors again with this build (from full tensors written by the \
                 build that saved them)"
            } else {
                ""
            };
            return Err(bad(format!(
                "format {:?} version {}; this build reads {FORMAT:?} versions {OLDEST_VERSION} to {VERSION}{hint}",
                self.format, self.version
            )));
        }
        if self.id.len() != 32 || !is_hex(&self.id) {
            return Err(bad(format!(
                "checkpoint id {:?}: it must be 32 lowercase hex digits",
                self.id
            )));
        }
        self.validate_tensors(path, true)
    }

    /// The key of the chunk of tensor `name` at `offsets` in its file: the
    /// name (version 3, and checkpoints written elsewhere), or `NAME@OFFSETS`
    /// (version 2).
    pub(crate) fn key_of(&self, name: &str, offsets: &[usize]) -> String {
        if self.format == FORMAT && self.version == 2 {
            chunk_key(name, offsets)
        } else {
            name.to_string()
        }
    }

    /// The checks of [`validate`](Self::validate) on the block size and the
    /// tensors, chunks keyed as [`key_of`](Self::key_of) says; `stamped`:
    /// with block checksums (a Tessera checkpoint), else without.
    fn validate_tensors(&self, path: &str, stamped: bool) -> Result<()> {
        let bad = |detail: String| Error::Checkpoint {
            path: path.to_string(),
            detail,
        };
        if !self.block_size.is_power_of_two() || self.block_size > MAX_BLOCK_SIZE {
            return Err(bad(format!(
                "block size {}: it must be a power of two up to {MAX_BLOCK_SIZE}",
                self.block_size
            )));
        }
        for (name, t) in &self.tensors {
            let dtype = dtype_of(&t.dtype).ok_or_else(|| bad(format!("tensor {name}: unknown dtype {:?}", t.dtype)))?;
            let numel =
                checked_numel(&t.shape).ok_or_else(|| bad(format!("tensor {name}: shape {:?} overflows", t.shape)))?;
            let mut covered = 0usize;
            for k in 0..t.chunks.len() {
                covered = covered.saturating_add(self.check_chunk(name, t, k, dtype, stamped).map_err(&bad)?);
            }
            if covered != numel {
                return Err(bad(format!(
                    "tensor {name}: its chunks hold {covered} of its {numel} elements"
                )));
            }
        }
        Ok(())
    }

    /// Checks chunk `k` of tensor `name` (entry `t` of dtype `dtype`): inside
    /// the tensor, a byte range of its size, keyed as
    /// [`key_of`](Self::key_of) says, its block checksums when `stamped`, a
    /// plain file name, and no overlap with an earlier chunk. Returns its
    /// element count, or what is wrong.
    fn check_chunk(
        &self,
        name: &str,
        t: &TensorEntry,
        k: usize,
        dtype: DType,
        stamped: bool,
    ) -> std::result::Result<usize, String> {
        let c = &t.chunks[k];
        let inside = c.offsets.len() == t.shape.len()
            && c.shape.len() == t.shape.len()
            && (0..t.shape.len()).all(|d| c.offsets[d].checked_add(c.shape[d]).is_some_and(|e| e <= t.shape[d]));
        if !inside {
            return Err(format!(
                "tensor {name}: chunk {k} at {:?} of shape {:?} lies outside the tensor's shape {:?}",
                c.offsets, c.shape, t.shape
            ));
        }
        let n = checked_numel(&c.shape).unwrap_or(usize::MAX);
        let bytes = (n as u128) * dtype.size_in_bytes() as u128;
        if c.end < c.begin || u128::from(c.end - c.begin) != bytes {
            return Err(format!(
                "tensor {name}: chunk {k} spans bytes {}..{} of {}, but {:?} {} elements need {bytes}",
                c.begin, c.end, c.file, c.shape, t.dtype
            ));
        }
        let key = self.key_of(name, &c.offsets);
        if c.key != key {
            return Err(format!(
                "tensor {name}: chunk {k} is keyed {:?}, but a chunk at {:?} is keyed {key:?}",
                c.key, c.offsets
            ));
        }
        let blocks = if stamped { c.blocks(self.block_size) as usize } else { 0 };
        if c.checksums.len() != blocks * CHECKSUM_DIGITS || !is_hex(&c.checksums) {
            return Err(format!(
                "tensor {name}: chunk {k} needs {blocks} block checksums of {CHECKSUM_DIGITS} hex digits \
                 ({} digits), got {} characters",
                blocks * CHECKSUM_DIGITS,
                c.checksums.len()
            ));
        }
        if c.file.is_empty() || c.file.contains(['/', '\\']) || c.file.starts_with('.') {
            return Err(format!(
                "tensor {name}: chunk {k} names the file {:?}; chunk files are plain names inside the \
                 checkpoint directory",
                c.file
            ));
        }
        for (j, o) in t.chunks[..k].iter().enumerate() {
            if o.file == c.file && o.key == c.key {
                return Err(format!(
                    "tensor {name}: chunks {j} and {k} are both {:?} in {}",
                    c.key, c.file
                ));
            }
            let overlap = (0..t.shape.len())
                .all(|d| c.offsets[d] < o.offsets[d] + o.shape[d] && o.offsets[d] < c.offsets[d] + c.shape[d]);
            if overlap && n > 0 && checked_numel(&o.shape).unwrap_or(0) > 0 {
                return Err(format!("tensor {name}: chunks {j} and {k} overlap"));
            }
        }
        Ok(n)
    }
}

fn is_hex(s: &str) -> bool {
    s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

fn checked_numel(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |a, &b| a.checked_mul(b))
}
