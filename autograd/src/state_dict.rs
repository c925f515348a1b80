//! State dicts as safetensors files: load by name into parameters of any layout,
//! save the gathered full tensors from one rank, atomically.
//!
//! ```
//! use tessera_autograd::{load_state_dict, save_state_dict_full, Param};
//! use tessera_dtensor::{distribute_tensor, DType, Placement::*, Tensor};
//! use tessera_mesh::{launch, DeviceMesh};
//!
//! let path = std::env::temp_dir().join(format!("tessera-doc-{}.safetensors", std::process::id()));
//! launch(2, |ctx| {
//!     let mesh = DeviceMesh::new(ctx.into_comm(), &[2])?;
//!     let full = Tensor::arange(6, DType::F32)?.reshape(&[3, 2])?;
//!     let w = Param::new("w", distribute_tensor(&full, &mesh, &[Shard(0)])?);
//!     save_state_dict_full(&[w], &path)?; // collective; rank 0 writes
//!     // Load into a parameter split the other way.
//!     let v = Param::new("w", distribute_tensor(&Tensor::zeros(&[3, 2], DType::F32)?, &mesh, &[Shard(1)])?);
//!     load_state_dict(&[v.clone()], &path)?;
//!     assert_eq!(v.value().full_tensor()?, full);
//!     Ok(())
//! })
//! .unwrap();
//! std::fs::remove_file(&path).unwrap();
//! ```
//!
//! - [`load_state_dict`]: by name, any source layout, dtype conversion, every
//!   mismatch listed; nothing changes on error.
//! - [`save_state_dict_full`]: collective gathers, one writer, atomic.
//! - [`read_safetensors`], [`write_safetensors`]: whole files of local tensors.
//!
//! The format is that of Hugging Face's `safetensors` (little-endian, C order),
//! readable by `safetensors.torch.load_file`; full state dicts use PyTorch's
//! parameter names as keys. Files written here carry the metadata
//! `{"format": "pt"}` and lay tensors out as the `safetensors` crate does (widest
//! dtype first, then by name), so every tensor's data is aligned.

use std::collections::BTreeSet;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use half::{bf16, f16};
use safetensors::SafeTensors;
use safetensors::tensor::{Dtype, TensorInfo, TensorView};
use tessera_dtensor::{DTensor, Tensor, distribute_tensor_with_order};
use tessera_mesh::{Buffer, CommunicatorExt, DType};

use crate::{Error, Param, Result};

/// Reads every tensor of a safetensors file, in the file's order (by offset).
///
/// `F32`, `F64`, `BF16`, `F16`, `I64` and `U8` keep their dtype; `BOOL` becomes
/// `U8`; `I8`, `I16`, `I32`, `U16`, `U32` and `U64` (when every value fits) become
/// `I64`.
///
/// PyTorch: `safetensors.torch.load_file`.
///
/// # Errors
/// [`Error::StateDict`] naming the path: the file cannot be read, is not a valid
/// safetensors file (truncated or corrupt), or holds a dtype with no counterpart
/// (8-bit floats).
pub fn read_safetensors(path: impl AsRef<Path>) -> Result<Vec<(String, Tensor)>> {
    let path = path.as_ref();
    let bytes = read_file(path)?;
    let st = parse(path, &bytes)?;
    let mut views = st.tensors();
    views.sort_by_key(|(_, v)| v.data().as_ptr() as usize);
    views
        .iter()
        .map(|(name, v)| Ok((name.clone(), decode(path, name, v)?)))
        .collect()
}

/// Writes `tensors` to a safetensors file atomically: to a temporary file in the
/// same directory, synced, then renamed over `path`; a failure leaves no file (and
/// any previous file at `path` as it was). Not collective: every caller writes.
///
/// PyTorch: `safetensors.torch.save_file`.
///
/// # Errors
/// Duplicate names, or [`Error::StateDict`] naming the path when writing fails.
pub fn write_safetensors(path: impl AsRef<Path>, tensors: &[(String, Tensor)]) -> Result<()> {
    let path = path.as_ref();
    let entries: Vec<Entry> = tensors
        .iter()
        .enumerate()
        .map(|(i, (name, t))| Entry::new(name, t.dtype(), t.shape(), i))
        .collect::<Result<_>>()?;
    check_unique_names(entries.iter().map(|e| e.name.as_str()))?;
    let entries = sort_entries(entries);
    let mut file = AtomicFile::create(path)?;
    file.write(&header(&entries)?)?;
    for e in &entries {
        file.write(&encode(&tensors[e.index].1))?;
    }
    file.commit()
}

/// Loads a safetensors file into `params` by name: each parameter gets this rank's
/// piece of the file's tensor in the parameter's current layout (placements, shard
/// order, mesh), converted to the parameter's dtype. Not collective (every rank
/// reads the file); the file may come from any mesh or from PyTorch.
///
/// Everything is checked before any parameter changes, so on error nothing has.
///
/// PyTorch: `model.load_state_dict(safetensors.torch.load_file(path))` with
/// `strict=True`, or `torch.distributed.checkpoint.state_dict.set_model_state_dict`
/// from a full state dict.
///
/// # Errors
/// [`Error::StateDict`]: the file cannot be read or is not valid safetensors (the
/// path and the parser's error); parameters missing from the file and tensors in
/// the file that no parameter takes (both listed); a global shape that differs
/// (name, expected, got); a dtype that cannot be converted (a float parameter
/// loads float tensors, an integer one integer tensors); two parameters with one
/// name.
pub fn load_state_dict(params: &[Param], path: impl AsRef<Path>) -> Result<()> {
    let path = path.as_ref();
    check_unique_names(params.iter().map(|p| p.name()))?;
    let bytes = read_file(path)?;
    let st = parse(path, &bytes)?;

    let in_file: BTreeSet<&str> = st.names().into_iter().map(|s| s.as_str()).collect();
    let wanted: BTreeSet<&str> = params.iter().map(|p| p.name()).collect();
    let missing: Vec<&str> = params
        .iter()
        .map(|p| p.name())
        .filter(|n| !in_file.contains(n))
        .collect();
    let unexpected: Vec<&str> = in_file.difference(&wanted).copied().collect();
    if !missing.is_empty() || !unexpected.is_empty() {
        let mut parts = Vec::new();
        if !missing.is_empty() {
            parts.push(format!(
                "missing tensors {missing:?} (parameters the file does not hold)"
            ));
        }
        if !unexpected.is_empty() {
            parts.push(format!(
                "unexpected tensors {unexpected:?} (no parameter has these names)"
            ));
        }
        return Err(Error::StateDict(format!(
            "{}: {}; the names must match the parameters' exactly",
            path.display(),
            parts.join("; ")
        )));
    }

    let mut problems = Vec::new();
    let mut views = Vec::with_capacity(params.len());
    for p in params {
        let view = st.tensor(p.name()).map_err(|e| corrupt(path, e))?;
        let value = p.value();
        if view.shape() != value.shape() {
            problems.push(format!(
                "{}: shape mismatch, the parameter is {:?} but the file holds {:?}",
                p.name(),
                value.shape(),
                view.shape()
            ));
        } else if let Err(e) = convertible(view.dtype(), value.dtype()) {
            problems.push(format!("{}: {e}", p.name()));
        }
        views.push((value, view));
    }
    if !problems.is_empty() {
        return Err(Error::StateDict(format!("{}: {}", path.display(), problems.join("; "))));
    }

    let mut values = Vec::with_capacity(params.len());
    for (p, (value, view)) in params.iter().zip(&views) {
        let full = decode(path, p.name(), view)?.cast(value.dtype())?;
        let d = distribute_tensor_with_order(&full, value.mesh(), value.placements(), value.layout().order.clone())?;
        // A shard is a view of the full tensor: copy it so the full one is freed.
        let local = if d.to_local().numel() < full.numel() {
            Tensor::from_buffer(d.to_local().to_buffer(), d.to_local().shape())?
        } else {
            d.to_local().clone()
        };
        values.push(DTensor::from_local_with_layout(
            local,
            value.mesh(),
            value.layout().clone(),
        )?);
    }
    for (p, v) in params.iter().zip(values) {
        p.set_value(v);
    }
    Ok(())
}

/// Saves the full (gathered) value of every parameter to one safetensors file,
/// keyed by parameter name. Collective: every rank calls it with the same
/// parameters. Each tensor is gathered in turn (`full_tensor`); rank 0 of the
/// first parameter's mesh streams them, one at a time, to a temporary file in the
/// same directory that is renamed over `path` once complete, then broadcasts
/// whether that worked. When it returns `Ok` on any rank, the whole file is in
/// place. (Parameters on a sub-mesh, `mesh.dim("tp")` say, have one writer per
/// sub-mesh; each writes the same bytes atomically.)
///
/// PyTorch: `torch.distributed.checkpoint.state_dict.get_model_state_dict(model,
/// options=StateDictOptions(full_state_dict=True))` then
/// `safetensors.torch.save_file` on rank 0.
///
/// # Errors
/// Two parameters with one name, a dtype with no safetensors counterpart, a
/// communication failure, or [`Error::StateDict`] when writing fails: on every
/// rank (the writer names the path and the cause; it takes its part in every
/// gather first, so no rank is left waiting).
pub fn save_state_dict_full(params: &[Param], path: impl AsRef<Path>) -> Result<()> {
    let path = path.as_ref();
    let values: Vec<DTensor> = params.iter().map(|p| p.value()).collect();
    let entries: Vec<Entry> = params
        .iter()
        .zip(&values)
        .enumerate()
        .map(|(i, (p, v))| Entry::new(p.name(), v.dtype(), v.shape(), i))
        .collect::<Result<_>>()?;
    check_unique_names(entries.iter().map(|e| e.name.as_str()))?;
    let entries = sort_entries(entries);
    let mesh = values.first().map(|v| v.mesh().clone());
    let writer = match &mesh {
        Some(mesh) => mesh.comm().rank() == 0,
        None => tessera_mesh::context::current_rank().is_none_or(|r| r.rank == 0),
    };

    // The writer keeps gathering after a write error, so that its peers are not
    // left waiting; the first error is reported at the end.
    let mut sink: Option<Result<AtomicFile>> = writer.then(|| {
        let mut f = AtomicFile::create(path)?;
        f.write(&header(&entries)?)?;
        Ok(f)
    });
    for e in &entries {
        let full = values[e.index].full_tensor()?;
        if let Some(Ok(f)) = &mut sink
            && let Err(err) = f.write(&encode(&full))
        {
            sink = Some(Err(err));
        }
    }
    let result = match sink {
        Some(f) => f.and_then(AtomicFile::commit),
        None => Ok(()),
    };
    if let Some(mesh) = mesh {
        let mut ok = [u8::from(result.is_ok())];
        mesh.comm().broadcast_slice(&mut ok, 0)?;
        if ok[0] == 0 && result.is_ok() {
            return Err(Error::StateDict(format!(
                "{}: the writing rank (rank 0 of {mesh}) failed to write the file; see its error",
                path.display()
            )));
        }
    }
    result
}

/// One tensor of a file being written: where its data comes from and its header.
struct Entry {
    name: String,
    index: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    bytes: usize,
}

impl Entry {
    fn new(name: &str, dtype: DType, shape: &[usize], index: usize) -> Result<Entry> {
        let (dtype, size) = match dtype {
            DType::F32 => (Dtype::F32, 4),
            DType::F64 => (Dtype::F64, 8),
            DType::BF16 => (Dtype::BF16, 2),
            DType::F16 => (Dtype::F16, 2),
            DType::I64 => (Dtype::I64, 8),
            DType::U8 => (Dtype::U8, 1),
            other => {
                return Err(Error::StateDict(format!(
                    "{name}: dtype {other} has no safetensors counterpart"
                )));
            }
        };
        Ok(Entry {
            name: name.to_string(),
            index,
            dtype,
            shape: shape.to_vec(),
            bytes: shape.iter().product::<usize>() * size,
        })
    }
}

/// The order in which the `safetensors` crate lays tensors out (widest dtype
/// first, then by name), so that every tensor's data is aligned in the file.
fn sort_entries(mut entries: Vec<Entry>) -> Vec<Entry> {
    entries.sort_by(|a, b| b.dtype.cmp(&a.dtype).then_with(|| a.name.cmp(&b.name)));
    entries
}

/// The length prefix and JSON header for `entries` (data in their order).
fn header(entries: &[Entry]) -> Result<Vec<u8>> {
    let mut map = serde_json::Map::new();
    map.insert("__metadata__".into(), serde_json::json!({ "format": "pt" }));
    let mut offset = 0;
    for e in entries {
        let info = TensorInfo {
            dtype: e.dtype,
            shape: e.shape.clone(),
            data_offsets: (offset, offset + e.bytes),
        };
        offset += e.bytes;
        let info = serde_json::to_value(&info).map_err(|err| Error::StateDict(format!("{}: {err}", e.name)))?;
        map.insert(e.name.clone(), info);
    }
    let mut json = serde_json::to_vec(&map).map_err(|err| Error::StateDict(format!("header: {err}")))?;
    json.resize(json.len().div_ceil(8) * 8, b' ');
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&json);
    Ok(out)
}

/// The elements of `t` as little-endian bytes, row-major.
fn encode(t: &Tensor) -> Vec<u8> {
    fn le<T, const N: usize>(v: &[T], f: impl Fn(&T) -> [u8; N]) -> Vec<u8> {
        let mut out = Vec::with_capacity(v.len() * N);
        for x in v {
            out.extend_from_slice(&f(x));
        }
        out
    }
    match t.to_buffer() {
        Buffer::F32(v) => le(&v, |x| x.to_le_bytes()),
        Buffer::F64(v) => le(&v, |x| x.to_le_bytes()),
        Buffer::BF16(v) => le(&v, |x| x.to_le_bytes()),
        Buffer::F16(v) => le(&v, |x| x.to_le_bytes()),
        Buffer::I64(v) => le(&v, |x| x.to_le_bytes()),
        Buffer::U8(v) => v,
    }
}

/// The tensor a view holds, in the dtype [`read_safetensors`] documents.
fn decode(path: &Path, name: &str, view: &TensorView<'_>) -> Result<Tensor> {
    fn le<T, const N: usize>(data: &[u8], f: impl Fn([u8; N]) -> T) -> Vec<T> {
        data.chunks_exact(N)
            .map(|c| {
                let mut b = [0u8; N];
                b.copy_from_slice(c);
                f(b)
            })
            .collect()
    }
    let (data, shape) = (view.data(), view.shape());
    let t = match view.dtype() {
        Dtype::F32 => Tensor::from_vec(le(data, f32::from_le_bytes), shape),
        Dtype::F64 => Tensor::from_vec(le(data, f64::from_le_bytes), shape),
        Dtype::BF16 => Tensor::from_vec(le(data, bf16::from_le_bytes), shape),
        Dtype::F16 => Tensor::from_vec(le(data, f16::from_le_bytes), shape),
        Dtype::I64 => Tensor::from_vec(le(data, i64::from_le_bytes), shape),
        Dtype::U8 | Dtype::BOOL => Tensor::from_vec(data.to_vec(), shape),
        Dtype::I8 => Tensor::from_vec(le(data, |b: [u8; 1]| i8::from_le_bytes(b) as i64), shape),
        Dtype::I16 => Tensor::from_vec(le(data, |b| i16::from_le_bytes(b) as i64), shape),
        Dtype::U16 => Tensor::from_vec(le(data, |b| u16::from_le_bytes(b) as i64), shape),
        Dtype::I32 => Tensor::from_vec(le(data, |b| i32::from_le_bytes(b) as i64), shape),
        Dtype::U32 => Tensor::from_vec(le(data, |b| u32::from_le_bytes(b) as i64), shape),
        Dtype::U64 => {
            let v = le(data, u64::from_le_bytes);
            let v: Option<Vec<i64>> = v.into_iter().map(|x| i64::try_from(x).ok()).collect();
            let v = v.ok_or_else(|| {
                Error::StateDict(format!(
                    "{}: tensor {name} is U64 with values beyond i64::MAX, which Tessera cannot hold",
                    path.display()
                ))
            })?;
            Tensor::from_vec(v, shape)
        }
        other => {
            return Err(Error::StateDict(format!(
                "{}: tensor {name} has dtype {other:?}, which Tessera cannot hold; convert it to F32 or BF16",
                path.display()
            )));
        }
    };
    Ok(t?)
}

/// Whether a file tensor of `file` dtype may load into a parameter of `param` dtype.
fn convertible(file: Dtype, param: DType) -> std::result::Result<(), String> {
    let float = matches!(file, Dtype::F32 | Dtype::F64 | Dtype::BF16 | Dtype::F16);
    let int = matches!(
        file,
        Dtype::BOOL
            | Dtype::U8
            | Dtype::I8
            | Dtype::I16
            | Dtype::U16
            | Dtype::I32
            | Dtype::U32
            | Dtype::I64
            | Dtype::U64
    );
    if (float && param.is_float()) || (int && !param.is_float()) {
        Ok(())
    } else {
        Err(format!(
            "dtype {file:?} in the file cannot be converted to the parameter's {param} \
             (float parameters load F32/F64/BF16/F16 tensors, integer ones integer tensors)"
        ))
    }
}

fn check_unique_names<'a>(names: impl Iterator<Item = &'a str>) -> Result<()> {
    let mut seen = BTreeSet::new();
    for n in names {
        if !seen.insert(n) {
            return Err(Error::StateDict(format!(
                "two tensors are named {n:?}; state dict names must be unique"
            )));
        }
    }
    Ok(())
}

fn read_file(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| Error::StateDict(format!("{}: cannot read: {e}", path.display())))
}

fn parse<'a>(path: &Path, bytes: &'a [u8]) -> Result<SafeTensors<'a>> {
    SafeTensors::deserialize(bytes).map_err(|e| corrupt(path, e))
}

fn corrupt(path: &Path, e: safetensors::SafeTensorError) -> Error {
    Error::StateDict(format!(
        "{}: not a valid safetensors file ({e}); it may be truncated or corrupt, write it again",
        path.display()
    ))
}

/// A file written under a temporary name and renamed into place on `commit`;
/// dropped uncommitted, it removes the temporary file.
struct AtomicFile {
    dest: PathBuf,
    tmp: PathBuf,
    out: Option<BufWriter<File>>,
}

impl AtomicFile {
    fn create(dest: &Path) -> Result<AtomicFile> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let name = dest
            .file_name()
            .ok_or_else(|| Error::StateDict(format!("{}: not a file path", dest.display())))?;
        let tmp = dest.with_file_name(format!(
            ".{}.tmp-{}-{}",
            name.to_string_lossy(),
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let file = File::options()
            .write(true)
            .create_new(true)
            .open(&tmp)
            .map_err(|e| Error::StateDict(format!("{}: cannot create: {e}", tmp.display())))?;
        Ok(AtomicFile {
            dest: dest.to_path_buf(),
            tmp,
            out: Some(BufWriter::new(file)),
        })
    }

    fn fail(&self, what: &str, e: std::io::Error) -> Error {
        Error::StateDict(format!("{}: {what}: {e}", self.dest.display()))
    }

    fn write(&mut self, bytes: &[u8]) -> Result<()> {
        // INVARIANT: `out` is `Some` until `commit` consumes the file.
        let out = self.out.as_mut().expect("file open until commit");
        out.write_all(bytes).map_err(|e| self.fail("write failed", e))
    }

    fn commit(mut self) -> Result<()> {
        // INVARIANT: `out` is `Some` until here.
        let out = self.out.take().expect("file open until commit");
        let file = out
            .into_inner()
            .map_err(|e| self.fail("write failed", e.into_error()))?;
        file.sync_all().map_err(|e| self.fail("sync failed", e))?;
        drop(file);
        std::fs::rename(&self.tmp, &self.dest).map_err(|e| self.fail("rename failed", e))?;
        // Make the rename durable; not every platform can open a directory.
        if let Some(dir) = self.dest.parent().filter(|d| !d.as_os_str().is_empty())
            && let Ok(d) = File::open(dir)
        {
            let _ = d.sync_all();
        }
        self.tmp = PathBuf::new();
        Ok(())
    }
}

impl Drop for AtomicFile {
    fn drop(&mut self) {
        if !self.tmp.as_os_str().is_empty() {
            drop(self.out.take());
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

#[cfg(test)]
mod tests {
    use tessera_dtensor::{Placement, Placement::*, distribute_tensor};
    use tessera_mesh::{DeviceMesh, launch};

    use super::*;

    /// A fresh empty directory under the system temp dir, removed on drop.
    struct TmpDir(PathBuf);

    impl TmpDir {
        fn new(tag: &str) -> TmpDir {
            static NEXT: AtomicU64 = AtomicU64::new(0);
            let dir = std::env::temp_dir().join(format!(
                "tessera-state-dict-{tag}-{}-{}",
                std::process::id(),
                NEXT.fetch_add(1, Ordering::Relaxed)
            ));
            std::fs::create_dir_all(&dir).unwrap();
            TmpDir(dir)
        }

        fn file(&self, name: &str) -> PathBuf {
            self.0.join(name)
        }

        /// The names in the directory (to spot leftover temporary files).
        fn entries(&self) -> Vec<String> {
            let mut v: Vec<String> = std::fs::read_dir(&self.0)
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect();
            v.sort();
            v
        }
    }

    impl Drop for TmpDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn data(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/data").join(name)
    }

    /// Three tensors of three dtypes: (name, full tensor).
    fn sample() -> Vec<(String, Tensor)> {
        vec![
            ("w".into(), Tensor::randn(&[5, 3], DType::F32, 1).unwrap()),
            ("layers.0.b".into(), Tensor::randn(&[7], DType::F64, 2).unwrap()),
            (
                "h".into(),
                Tensor::randn(&[2, 2], DType::F32, 3)
                    .unwrap()
                    .cast(DType::BF16)
                    .unwrap(),
            ),
        ]
    }

    /// Parameters with `sample`'s names, shapes and dtypes, zero, placed by `placements`.
    fn zeros_like_sample(mesh: &DeviceMesh, placements: &[&[Placement]]) -> Result<Vec<Param>> {
        sample()
            .iter()
            .zip(placements)
            .map(|((n, t), pl)| {
                Ok(Param::new(
                    n.clone(),
                    distribute_tensor(&Tensor::zeros(t.shape(), t.dtype())?, mesh, pl)?,
                ))
            })
            .collect()
    }

    fn err_of(r: Result<()>) -> String {
        r.unwrap_err().to_string()
    }

    #[test]
    fn write_then_read_keeps_names_dtypes_values() {
        let dir = TmpDir::new("rw");
        let path = dir.file("a.safetensors");
        write_safetensors(&path, &sample()).unwrap();
        let mut got = read_safetensors(&path).unwrap();
        got.sort_by(|a, b| a.0.cmp(&b.0));
        let mut want = sample();
        want.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(got, want);
        assert_eq!(dir.entries(), vec!["a.safetensors"]);
        // The safetensors crate reads it too, data aligned to its dtype.
        let bytes = std::fs::read(&path).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        for (_, v) in st.tensors() {
            assert_eq!(
                (v.data().as_ptr() as usize - bytes.as_ptr() as usize - 8) % v.dtype().size(),
                0
            );
        }
        let err = err_of(write_safetensors(
            &path,
            &[("x".into(), want[0].1.clone()), ("x".into(), want[1].1.clone())],
        ));
        assert!(err.contains("two tensors are named \"x\""), "{err}");
    }

    #[test]
    fn round_trip_on_one_and_two_ranks() {
        let dir = TmpDir::new("round-trip");
        for (world, save_pl, load_pl) in [
            (
                1,
                [&[Replicate][..], &[Replicate], &[Replicate]],
                [&[Replicate][..], &[Replicate], &[Replicate]],
            ),
            (
                2,
                [&[Shard(0)][..], &[Shard(0)], &[Replicate]],
                [&[Shard(1)][..], &[Replicate], &[Shard(0)]],
            ),
            (
                2,
                [&[Replicate][..], &[Shard(0)], &[Shard(1)]],
                [&[Shard(0)][..], &[Shard(0)], &[Replicate]],
            ),
        ] {
            let path = dir.file(&format!("w{world}.safetensors"));
            launch(world, |ctx| {
                let mesh = DeviceMesh::new(ctx.into_comm(), &[world])?;
                let params: Vec<Param> = sample()
                    .into_iter()
                    .zip(save_pl)
                    .map(|((n, t), pl)| Ok(Param::new(n, distribute_tensor(&t, &mesh, pl)?)))
                    .collect::<Result<_>>()?;
                let before = mesh.stats().total_calls();
                save_state_dict_full(&params, &path)?;
                assert!(mesh.stats().total_calls() > before || world == 1);
                // No barrier needed: the file is in place when save returns.
                let loaded = zeros_like_sample(&mesh, &load_pl)?;
                let before = mesh.stats().total_calls();
                load_state_dict(&loaded, &path)?;
                assert_eq!(mesh.stats().total_calls(), before, "loading communicates");
                for ((p, (name, t)), pl) in loaded.iter().zip(sample()).zip(load_pl) {
                    assert_eq!(p.name(), name);
                    assert_eq!(p.value().placements(), pl);
                    assert_eq!(p.value().full_tensor()?, t, "{name}");
                    // The local piece owns its storage: no view of the file's full tensor.
                    let local = p.value().to_local().clone();
                    assert!(local.numel() == t.numel() || local.size_in_bytes() < t.size_in_bytes());
                }
                Ok(())
            })
            .unwrap();
            let mut got = read_safetensors(&path).unwrap();
            got.sort_by(|a, b| a.0.cmp(&b.0));
            let mut want = sample();
            want.sort_by(|a, b| a.0.cmp(&b.0));
            assert_eq!(got, want, "world {world}");
        }
        // One file per save, no temporary left behind.
        assert_eq!(dir.entries(), vec!["w1.safetensors", "w2.safetensors"]);
    }

    #[test]
    fn mismatches_are_listed_and_change_nothing() {
        let dir = TmpDir::new("errors");
        let path = dir.file("m.safetensors");
        let s = sample();
        // The file lacks "h" and has an extra "extra".
        let mut file = vec![
            s[0].clone(),
            s[1].clone(),
            ("extra".to_string(), Tensor::zeros(&[1], DType::F32).unwrap()),
        ];
        write_safetensors(&path, &file).unwrap();
        let p = path.display().to_string();
        launch(1, |ctx| {
            let mesh = DeviceMesh::new(ctx.into_comm(), &[1])?;
            let params = zeros_like_sample(&mesh, &[&[Replicate], &[Replicate], &[Replicate]])?;
            let err = err_of(load_state_dict(&params, &path));
            assert!(err.contains(&p), "{err}");
            assert!(err.contains("missing tensors [\"h\"]"), "{err}");
            assert!(err.contains("unexpected tensors [\"extra\"]"), "{err}");
            assert!(
                params
                    .iter()
                    .all(|p| p.value().to_local().to_f64_vec().iter().all(|&x| x == 0.0))
            );
            Ok(())
        })
        .unwrap();

        // Right names, wrong shapes and an integer tensor for a float parameter.
        file = vec![
            (s[0].0.clone(), Tensor::zeros(&[3, 5], DType::F32).unwrap()),
            (s[1].0.clone(), Tensor::zeros(&[7], DType::I64).unwrap()),
            s[2].clone(),
        ];
        write_safetensors(&path, &file).unwrap();
        launch(1, |ctx| {
            let mesh = DeviceMesh::new(ctx.into_comm(), &[1])?;
            let params = zeros_like_sample(&mesh, &[&[Replicate], &[Replicate], &[Replicate]])?;
            let err = err_of(load_state_dict(&params, &path));
            assert!(
                err.contains("w: shape mismatch, the parameter is [5, 3] but the file holds [3, 5]"),
                "{err}"
            );
            assert!(
                err.contains("layers.0.b: dtype I64 in the file cannot be converted to the parameter's f64"),
                "{err}"
            );
            assert!(
                params[2].value().to_local().to_f64_vec().iter().all(|&x| x == 0.0),
                "h loaded anyway"
            );
            // Two parameters with one name.
            let dup = vec![params[0].clone(), params[0].clone()];
            assert!(err_of(load_state_dict(&dup, &path)).contains("two tensors are named \"w\""));
            Ok(())
        })
        .unwrap();
    }

    #[test]
    fn truncated_missing_and_garbage_files_name_the_path() {
        let dir = TmpDir::new("corrupt");
        let path = dir.file("t.safetensors");
        write_safetensors(&path, &sample()).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        for (case, content) in [
            ("truncated data", bytes[..bytes.len() - 3].to_vec()),
            ("truncated header", bytes[..20].to_vec()),
            ("empty", Vec::new()),
            ("garbage", b"not a safetensors file at all".to_vec()),
        ] {
            std::fs::write(&path, &content).unwrap();
            let err = read_safetensors(&path).unwrap_err().to_string();
            assert!(err.contains(&path.display().to_string()), "{case}: {err}");
            assert!(err.contains("not a valid safetensors file"), "{case}: {err}");
            let err = launch(1, |ctx| {
                let mesh = DeviceMesh::new(ctx.into_comm(), &[1])?;
                let params = zeros_like_sample(&mesh, &[&[Replicate], &[Replicate], &[Replicate]])?;
                Ok(err_of(load_state_dict(&params, &path)))
            })
            .unwrap()
            .remove(0);
            assert!(err.contains("may be truncated or corrupt"), "{case}: {err}");
        }
        let err = read_safetensors(dir.file("nope.safetensors")).unwrap_err().to_string();
        assert!(err.contains("nope.safetensors: cannot read"), "{err}");
    }

    #[test]
    fn failed_write_leaves_the_old_file() {
        let dir = TmpDir::new("atomic");
        let path = dir.file("keep.safetensors");
        write_safetensors(&path, &sample()).unwrap();
        // A file in a directory that does not exist: an error naming it, nothing written.
        let err = write_safetensors(dir.file("no/such/dir.safetensors"), &sample())
            .unwrap_err()
            .to_string();
        assert!(err.contains("cannot create"), "{err}");
        // Overwriting replaces the file whole.
        let other = vec![("only".to_string(), Tensor::ones(&[2], DType::F32).unwrap())];
        write_safetensors(&path, &other).unwrap();
        assert_eq!(read_safetensors(&path).unwrap(), other);
        assert_eq!(dir.entries(), vec!["keep.safetensors"]);
        // An uncommitted file removes its temporary on drop.
        let mut f = AtomicFile::create(&path).unwrap();
        f.write(b"partial").unwrap();
        drop(f);
        assert_eq!(dir.entries(), vec!["keep.safetensors"]);
        assert_eq!(read_safetensors(&path).unwrap(), other);
    }

    #[test]
    fn a_failed_save_fails_on_every_rank() {
        let dir = TmpDir::new("save-fails");
        let path = dir.file("missing-dir/x.safetensors");
        let errs = launch(2, |ctx| {
            let mesh = DeviceMesh::new(ctx.into_comm(), &[2])?;
            let w = Param::new(
                "w",
                distribute_tensor(&Tensor::ones(&[4], DType::F32)?, &mesh, &[Shard(0)])?,
            );
            Ok(err_of(save_state_dict_full(&[w], &path)))
        })
        .unwrap();
        assert!(errs[0].contains("cannot create"), "{}", errs[0]);
        assert!(
            errs[1].contains("the writing rank (rank 0 of DeviceMesh([2]"),
            "{}",
            errs[1]
        );
        assert!(errs.iter().all(|e| e.contains("missing-dir")));
        assert!(dir.entries().is_empty());
    }

    #[test]
    fn half_and_double_files_load_into_f32() {
        let dir = TmpDir::new("dtypes");
        let path = dir.file("h.safetensors");
        let full = Tensor::randn(&[4, 2], DType::F32, 9).unwrap();
        for dtype in [DType::BF16, DType::F16, DType::F64] {
            let stored = full.cast(dtype).unwrap();
            write_safetensors(&path, &[("w".into(), stored.clone())]).unwrap();
            launch(2, |ctx| {
                let mesh = DeviceMesh::new(ctx.into_comm(), &[2])?;
                let w = Param::new(
                    "w",
                    distribute_tensor(&Tensor::zeros(&[4, 2], DType::F32)?, &mesh, &[Shard(0)])?,
                );
                load_state_dict(std::slice::from_ref(&w), &path)?;
                assert_eq!(w.value().dtype(), DType::F32);
                assert_eq!(w.value().full_tensor()?, stored.cast(DType::F32)?, "{dtype}");
                Ok(())
            })
            .unwrap();
        }
    }

    /// The tiny model's parameters, as the reference README lists them.
    fn tiny_names_and_shapes() -> Vec<(String, Vec<usize>)> {
        let (dim, vocab, seq) = (64, 256, 32);
        let mut v = vec![
            ("tok_embeddings.weight".to_string(), vec![vocab, dim]),
            ("pos_embeddings.weight".to_string(), vec![seq, dim]),
        ];
        for i in 0..2 {
            let l = |s: &str| format!("layers.{i}.{s}");
            v.push((l("attention_norm.weight"), vec![dim]));
            v.push((l("attention_norm.bias"), vec![dim]));
            for w in ["wq", "wk", "wv", "wo"] {
                v.push((l(&format!("attention.{w}.weight")), vec![dim, dim]));
            }
            v.push((l("ffn_norm.weight"), vec![dim]));
            v.push((l("ffn_norm.bias"), vec![dim]));
            v.push((l("feed_forward.w1.weight"), vec![4 * dim, dim]));
            v.push((l("feed_forward.w1.bias"), vec![4 * dim]));
            v.push((l("feed_forward.w2.weight"), vec![dim, 4 * dim]));
            v.push((l("feed_forward.w2.bias"), vec![dim]));
        }
        v.push(("norm.weight".to_string(), vec![dim]));
        v.push(("norm.bias".to_string(), vec![dim]));
        v.push(("output.weight".to_string(), vec![vocab, dim]));
        v
    }

    #[test]
    fn reference_files_load() {
        let want = tiny_names_and_shapes();
        assert_eq!(want.len(), 29);
        for file in ["tiny_init.safetensors", "tiny_single_G8.final.safetensors"] {
            let got = read_safetensors(data(file)).unwrap();
            let mut names: Vec<(String, Vec<usize>)> =
                got.iter().map(|(n, t)| (n.clone(), t.shape().to_vec())).collect();
            names.sort();
            let mut w = want.clone();
            w.sort();
            assert_eq!(names, w, "{file}");
            assert!(got.iter().all(|(_, t)| t.dtype() == DType::F32));
            // LayerNorm starts at weight 1, bias 0 (PyTorch's init); a sanity check of the bytes.
            if file == "tiny_init.safetensors" {
                let norm = &got.iter().find(|(n, _)| n == "norm.weight").unwrap().1;
                assert!(norm.to_f64_vec().iter().all(|&x| x == 1.0));
            }
        }
        // Loaded into FSDP-style Shard(0) parameters on 2 ranks, every piece is the file's.
        let path = data("tiny_init.safetensors");
        let full = read_safetensors(&path).unwrap();
        launch(2, |ctx| {
            let mesh = DeviceMesh::new(ctx.into_comm(), &[2])?;
            let params: Vec<Param> = want
                .iter()
                .map(|(n, s)| {
                    Ok(Param::new(
                        n.clone(),
                        distribute_tensor(&Tensor::zeros(s, DType::F32)?, &mesh, &[Shard(0)])?,
                    ))
                })
                .collect::<Result<_>>()?;
            load_state_dict(&params, &path)?;
            for p in &params {
                let t = &full.iter().find(|(n, _)| n == p.name()).unwrap().1;
                assert_eq!(&p.value().full_tensor()?, t, "{}", p.name());
            }
            Ok(())
        })
        .unwrap();

        let tokens = read_safetensors(data("tiny_tokens_G16.safetensors")).unwrap();
        assert_eq!(tokens.len(), 1);
        assert_eq!(tokens[0].0, "tokens");
        assert_eq!(
            (tokens[0].1.dtype(), tokens[0].1.shape()),
            (DType::I64, &[20, 16, 33][..])
        );
        assert!(
            tokens[0]
                .1
                .to_vec::<i64>()
                .unwrap()
                .iter()
                .all(|&t| (0..256).contains(&t))
        );

        let json: serde_json::Value =
            serde_json::from_slice(&std::fs::read(data("tiny_reference.json")).unwrap()).unwrap();
        let losses = json["runs"]["single_G8"]["loss"].as_array().unwrap();
        assert_eq!(losses.len(), 20);
    }
}
