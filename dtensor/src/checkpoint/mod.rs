//! Sharded checkpoints of DTensors: [`save`] writes each rank's chunks (one
//! replica of each) into a directory, [`Checkpoint::load`] reads any tensor back
//! onto any mesh and placements, each rank reading only the byte ranges its
//! piece overlaps.
//!
//! A checkpoint is a directory holding one safetensors file per writing rank
//! (`shard-00004-model-00001-of-00001.safetensors` for rank 3: its piece of
//! each tensor under the tensor's name) and `index.json` ([`Index`]): every
//! tensor's global shape and dtype, and each chunk's offsets, extents, file,
//! byte range and checksums per 64 KiB block. The files alone are also a
//! sharded safetensors checkpoint as PyTorch's distributed checkpoint reads
//! them (`HuggingFaceStorageReader`: each piece's offsets are in the file's
//! `DCP_SHARDING_INFO`), and [`Checkpoint::open`] reads such a directory
//! written elsewhere, without an index ([`Index::from_sharded_safetensors`]).
//! A save draws a random 128-bit checkpoint id (rank 0, shared with all) and
//! stamps it into the index and every chunk file; a load checks each file's
//! header against the index and each block it reads against its checksum, so a
//! corrupt, renamed, swapped or foreign file is an error naming the file and
//! tensor, whether a load reads a chunk whole or in part.
//!
//! A save writes a hidden temporary directory (`.NAME.tmp-PID-ID`, locked by
//! its writer), fsyncs every file and the directory, and then renames it into
//! place (exchanging it with an older checkpoint of that name in one step, on
//! Linux), so a save that fails or is killed leaves the previous checkpoint,
//! never a half-written one; the next save or load beside it removes the
//! temporaries of dead writers ([`remove_stale_temporaries`]).
//!
//! PyTorch: `torch.distributed.checkpoint` (`save`, `load`, its
//! `FileSystemWriter` / `FileSystemReader` and the `.metadata` index).
//!
//! ```
//! use tessera_dtensor::checkpoint::{save, Checkpoint};
//! use tessera_dtensor::{distribute_tensor, DType, Layout, Placement::*, Tensor};
//! use tessera_mesh::{launch, DeviceMesh};
//!
//! let dir = std::env::temp_dir().join(format!("tessera-doc-ckpt-{}", std::process::id()));
//! let d = dir.clone();
//! launch(2, move |ctx| {
//!     let mesh = DeviceMesh::new(ctx.into_comm(), &[2])?;
//!     let full = Tensor::arange(12, DType::F32)?.reshape(&[4, 3])?;
//!     save(&d, &[("w", &distribute_tensor(&full, &mesh, &[Shard(0)])?)], Default::default())?;
//!     // Back as column shards: each rank reads only its columns' bytes.
//!     let ckpt = Checkpoint::open(&d)?;
//!     let layout = Layout::new(mesh.shape(), &[Shard(1)], &[4, 3], DType::F32)?;
//!     let w = ckpt.load("w", &mesh, layout)?;
//!     assert_eq!(w.full_tensor()?, full);
//!     Ok(())
//! })
//! .unwrap();
//! std::fs::remove_dir_all(&dir).unwrap();
//! ```

mod files;
mod index;
mod load;
mod save;
mod sharded;
mod temps;
#[cfg(test)]
mod tests;

use std::path::Path;

pub use index::{Chunk, Index, SHARDED_SAFETENSORS, TensorEntry};
pub use load::Checkpoint;
pub use save::{AsyncSave, async_save, save};
pub use temps::{remove_checkpoint, remove_stale_temporaries, temporary_owner};

use crate::Error;

/// The index file of a checkpoint directory.
pub const INDEX_FILE: &str = "index.json";

fn ckpt_error(path: &Path, detail: String) -> Error {
    Error::Checkpoint {
        path: path.display().to_string(),
        detail,
    }
}

/// What one rank did in a [`save`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SaveReport {
    /// Bytes of tensor data this rank wrote (0 for a rank whose chunks other
    /// replicas wrote).
    pub bytes_written: u64,
    /// Chunks this rank wrote.
    pub chunks: usize,
}
