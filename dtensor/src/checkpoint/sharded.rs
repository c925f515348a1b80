//! Checkpoints written elsewhere as sharded safetensors files: one file per
//! writing rank, each tensor's piece stored under the tensor's own name, and
//! where the piece lies in the tensor in the file's `__metadata__`
//! (`DCP_SHARDING_INFO`: `{name: {"saved_offsets": [...]}}`), as PyTorch's
//! `HuggingFaceStorageWriter(path, save_distributed=True)` writes them
//! (`shard-00001-model-00001-of-00001.safetensors`, ...). The files are the
//! whole index: [`Index::from_sharded_safetensors`] reads every header.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value;

use super::index::{self, Chunk, Index, SHARDED_SAFETENSORS, TensorEntry};
use super::{ckpt_error, files};
use crate::Result;

impl Index {
    /// The index of the sharded safetensors files in `dir` (every
    /// `*.safetensors` file, hidden ones aside): each tensor's pieces with
    /// their saved offsets, byte ranges and files, and its global shape, the
    /// extent of its pieces. A file without `DCP_SHARDING_INFO` holds whole
    /// tensors. Such files carry no checksums: a load checks each file's
    /// header again when it first reads it, but not the bytes.
    ///
    /// PyTorch: `HuggingFaceStorageReader.read_metadata`.
    ///
    /// # Errors
    /// [`Error::Checkpoint`](crate::Error::Checkpoint) naming the file and
    /// tensor: no safetensors file in `dir`, a file that is not safetensors,
    /// a file a Tessera save wrote (its `index.json` is missing, not optional),
    /// an entry without a known dtype, a shape or byte range, missing saved
    /// offsets, a tensor whose pieces disagree on dtype or rank, overlap or
    /// leave part of it uncovered.
    pub fn from_sharded_safetensors(dir: &Path) -> Result<Index> {
        let mut tensors: BTreeMap<String, TensorEntry> = BTreeMap::new();
        for file in &safetensors_files(dir)? {
            add_pieces(dir, file, &mut tensors)?;
        }
        let index = Index {
            format: SHARDED_SAFETENSORS.into(),
            version: 1,
            id: String::new(),
            block_size: index::BLOCK_SIZE,
            checksum: String::new(),
            tensors,
            metadata: BTreeMap::new(),
        };
        index.validate(&dir.display().to_string())?;
        Ok(index)
    }
}

/// The visible `*.safetensors` files of `dir`, sorted by name.
///
/// # Errors
/// A directory that cannot be listed or holds no such file.
fn safetensors_files(dir: &Path) -> Result<Vec<String>> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map_err(|e| files::io_error(dir, "cannot list the checkpoint directory", e))?
        .filter_map(|e| e.ok().and_then(|e| e.file_name().into_string().ok()))
        .filter(|n| n.ends_with(".safetensors") && !n.starts_with('.'))
        .collect();
    names.sort();
    if names.is_empty() {
        return Err(ckpt_error(
            dir,
            "no checkpoint here: neither an index.json (a Tessera checkpoint) nor .safetensors files (a \
             sharded safetensors checkpoint)"
                .into(),
        ));
    }
    Ok(names)
}

/// Adds the pieces file `file` of `dir` holds to `tensors` (each tensor's
/// global shape grown to cover them).
///
/// # Errors
/// As [`Index::from_sharded_safetensors`], for this file.
fn add_pieces(dir: &Path, file: &str, tensors: &mut BTreeMap<String, TensorEntry>) -> Result<()> {
    let path = dir.join(file);
    let f = files::open_read(&path)?;
    let (header, start) = files::read_header(&path, &f)?;
    if files::stamped_by_tessera(&header) {
        return Err(ckpt_error(
            &dir.join(super::INDEX_FILE),
            format!(
                "missing: {file} was written by a Tessera save, whose index.json holds the checksums and \
                 metadata its files lack; restore the index (or save again) rather than reading the files \
                 unchecked"
            ),
        ));
    }
    let info = files::sharding_info(&path, &header)?;
    for (key, v) in &header {
        if key == "__metadata__" {
            continue;
        }
        let bad = |what: &str| ckpt_error(&path, format!("tensor {key}: {what} (its entry is {v})"));
        let dtype = v
            .get("dtype")
            .and_then(Value::as_str)
            .filter(|d| index::dtype_of(d).is_some())
            .ok_or_else(|| bad("no dtype Tessera holds (F32, F64, BF16, F16, I64, U8)"))?;
        let shape: Vec<usize> = files::whole_numbers(v.get("shape")).ok_or_else(|| bad("no shape"))?;
        let range = files::whole_numbers(v.get("data_offsets"))
            .filter(|r| r.len() == 2 && r[0] <= r[1])
            .ok_or_else(|| bad("no byte range"))?;
        let offsets = files::saved_offsets(&path, info.as_ref(), key, shape.len())?;
        let entry = tensors.entry(key.clone()).or_insert_with(|| TensorEntry {
            shape: vec![0; shape.len()],
            dtype: dtype.to_string(),
            chunks: Vec::new(),
        });
        if entry.dtype != dtype || entry.shape.len() != shape.len() {
            return Err(bad(&format!(
                "another file holds a piece of it as {} of rank {}",
                entry.dtype,
                entry.shape.len()
            )));
        }
        for (d, extent) in entry.shape.iter_mut().enumerate() {
            let end = offsets[d]
                .checked_add(shape[d])
                .ok_or_else(|| bad("offsets overflow"))?;
            *extent = (*extent).max(end);
        }
        entry.chunks.push(Chunk {
            offsets,
            shape,
            file: file.to_string(),
            key: key.clone(),
            begin: start + range[0] as u64,
            end: start + range[1] as u64,
            checksums: String::new(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use tessera_mesh::{DType, DeviceMesh, launch};

    use super::super::Checkpoint;
    use super::super::tests::Scratch;
    use crate::{Layout, Placement};

    /// The checkpoint PyTorch's distributed checkpoint saved on 2 ranks as
    /// sharded safetensors, and the same tensors whole
    /// (`scripts/sharded_safetensors_fixture.py`).
    fn fixture(what: &str) -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/data/sharded_safetensors")
            .join(what)
    }

    /// Every tensor onto 1, 2 and 3 ranks, sharded along each dim and
    /// replicated, equals the tensor saved whole; the index is the files'.
    #[test]
    fn a_sharded_safetensors_checkpoint_loads_onto_any_layout() {
        let ckpt = Checkpoint::open(fixture("shards")).unwrap();
        let index = ckpt.index();
        assert_eq!(index.format, super::SHARDED_SAFETENSORS);
        let shapes: Vec<(&str, &[usize], &str, usize)> = index
            .tensors
            .iter()
            .map(|(n, t)| (n.as_str(), t.shape.as_slice(), t.dtype.as_str(), t.chunks.len()))
            .collect();
        assert_eq!(
            shapes,
            [
                ("b", &[7][..], "F32", 2),
                ("e", &[4, 6][..], "BF16", 2),
                ("r", &[3][..], "F32", 1),
                ("w", &[5, 3][..], "F32", 2)
            ]
        );
        for world in [1usize, 2, 3] {
            launch(world, move |ctx| {
                let mesh = DeviceMesh::new(ctx.into_comm(), &[world])?;
                let ckpt = Checkpoint::open(fixture("shards"))?;
                let whole = Checkpoint::open(fixture("full"))?;
                for (name, shape, dtype) in [
                    ("w", vec![5, 3], DType::F32),
                    ("b", vec![7], DType::F32),
                    ("e", vec![4, 6], DType::BF16),
                    ("r", vec![3], DType::F32),
                ] {
                    let replicated = Layout::new(&[world], &[Placement::Replicate], &shape, dtype)?;
                    let want = whole.load(name, &mesh, replicated)?.to_local().clone();
                    let mut placements = vec![Placement::Replicate];
                    placements.extend((0..shape.len()).map(Placement::Shard));
                    for p in placements {
                        let layout = Layout::new(&[world], &[p], &shape, dtype)?;
                        let got = ckpt.load(name, &mesh, layout)?.full_tensor()?;
                        assert_eq!(got, want, "{name} as {p:?} on {world} ranks");
                    }
                }
                Ok(())
            })
            .unwrap();
        }
    }

    /// The values themselves: `b` is `arange(7)`.
    #[test]
    fn values_are_the_saved_ones() {
        launch(1, |ctx| {
            let mesh = DeviceMesh::new(ctx.into_comm(), &[1])?;
            let ckpt = Checkpoint::open(fixture("shards"))?;
            let b = ckpt.load(
                "b",
                &mesh,
                Layout::new(&[1], &[Placement::Replicate], &[7], DType::F32)?,
            )?;
            assert_eq!(b.to_local().to_f64_vec(), (0..7).map(f64::from).collect::<Vec<_>>());
            Ok(())
        })
        .unwrap();
    }

    /// A copy of the shards in a scratch directory (removed on drop).
    fn shards_copy(tag: &str) -> Scratch {
        let dir = Scratch::new(tag);
        for e in std::fs::read_dir(fixture("shards")).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), dir.0.join(e.file_name())).unwrap();
        }
        dir
    }

    /// Errors name the file and what is wrong: an empty directory, a piece
    /// stored twice (a file copied in), sharding info without a tensor, a
    /// file changed between opening and loading.
    #[test]
    fn bad_directories_and_files_are_errors() {
        let empty = Scratch::new("empty");
        let e = Checkpoint::open(&empty.0).unwrap_err().to_string();
        assert!(
            e.contains("neither an index.json") && e.contains(".safetensors files"),
            "{e}"
        );

        let twice = shards_copy("twice");
        std::fs::copy(
            twice.0.join("shard-00001-model-00001-of-00001.safetensors"),
            twice.0.join("shard-00003-model-00001-of-00001.safetensors"),
        )
        .unwrap();
        let e = Checkpoint::open(&twice.0).unwrap_err().to_string();
        assert!(e.contains("overlap"), "{e}");

        let unnamed = shards_copy("unnamed");
        let f = unnamed.0.join("shard-00002-model-00001-of-00001.safetensors");
        let mut bytes = std::fs::read(&f).unwrap();
        // `r` renamed `q` in the sharding info (same length, so the header stays valid).
        let from = br#"\"r\": {\"saved_offsets\""#;
        let at = bytes
            .windows(from.len())
            .position(|w| w == from)
            .expect("the fixture names r in its sharding info");
        bytes[at + 2] = b'q';
        std::fs::write(&f, &bytes).unwrap();
        let e = Checkpoint::open(&unnamed.0).unwrap_err().to_string();
        assert!(
            e.contains("tensor r") && e.contains("DCP_SHARDING_INFO") && e.contains("shard-00002"),
            "{e}"
        );

        // A Tessera checkpoint without its index is not read as one written elsewhere.
        let tessera = Scratch::new("own");
        let t = tessera.0.join("ck");
        launch(2, move |ctx| {
            let mesh = DeviceMesh::new(ctx.into_comm(), &[2])?;
            let w = crate::distribute_tensor(&crate::Tensor::arange(6, DType::F32)?, &mesh, &[Placement::Shard(0)])?;
            super::super::save(&t, &[("w", &w)], Default::default())?;
            Ok(())
        })
        .unwrap();
        let ck = tessera.0.join("ck");
        std::fs::rename(ck.join("index.json"), ck.join("index.json.old")).unwrap();
        let e = Checkpoint::open(&ck).unwrap_err().to_string();
        assert!(
            e.contains("index.json: missing") && e.contains("written by a Tessera save"),
            "{e}"
        );

        let changed = shards_copy("changed");
        let d = changed.0.clone();
        let e = launch(1, move |ctx| {
            let mesh = DeviceMesh::new(ctx.into_comm(), &[1])?;
            let ckpt = Checkpoint::open(&d)?;
            std::fs::copy(
                d.join("shard-00002-model-00001-of-00001.safetensors"),
                d.join("shard-00001-model-00001-of-00001.safetensors"),
            )?;
            let w = Layout::new(&[1], &[Placement::Replicate], &[5, 3], DType::F32)?;
            Ok(ckpt.load("w", &mesh, w).unwrap_err().to_string())
        })
        .unwrap()
        .remove(0);
        assert!(e.contains("changed since the checkpoint was opened"), "{e}");
    }

    /// A rank reads only the bytes its piece needs: rows 0..3 of `w` are the
    /// first file's chunk exactly, and rows of `e` are runs of both its chunks.
    #[test]
    fn a_rank_reads_only_the_chunks_it_needs() {
        launch(2, |ctx| {
            let mesh = DeviceMesh::new(ctx.into_comm(), &[2])?;
            let ckpt = Checkpoint::open(fixture("shards"))?;
            let layout = Layout::new(&[2], &[Placement::Shard(0)], &[5, 3], DType::F32)?;
            let w = ckpt.load("w", &mesh, layout)?;
            let rows = w.to_local().shape()[0];
            assert!(ckpt.bytes_read() <= 5 * 3 * 4, "{}", ckpt.bytes_read());
            if mesh.rank() == 0 {
                assert_eq!((rows, ckpt.bytes_read()), (3, 3 * 3 * 4));
            }
            // Rows of `e`, which was saved in column halves: each rank reads
            // exactly its rows' bytes from both chunks, no more.
            let before = ckpt.bytes_read();
            let e = ckpt.load(
                "e",
                &mesh,
                Layout::new(&[2], &[Placement::Shard(0)], &[4, 6], DType::BF16)?,
            )?;
            assert_eq!(e.to_local().shape(), [2, 6]);
            assert_eq!(ckpt.bytes_read() - before, 2 * 6 * 2);
            Ok(())
        })
        .unwrap();
    }
}
