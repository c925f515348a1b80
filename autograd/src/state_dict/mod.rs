//! State dicts as safetensors files: load by name into parameters of any layout,
//! save the gathered full tensors from one rank, atomically.
//!
//! ```
//! use tessera_autograd::nn::ParameterDict;
//! use tessera_autograd::{load_state_dict, save_state_dict_full, Param};
//! use tessera_dtensor::{distribute_tensor, DType, Placement::*, Tensor};
//! use tessera_mesh::{launch, DeviceMesh};
//!
//! let path = std::env::temp_dir().join(format!("tessera-doc-{}.safetensors", std::process::id()));
//! launch(2, {
//!     let path = path.clone();
//!     move |ctx| {
//!         let mesh = DeviceMesh::new(ctx.into_comm(), &[2])?;
//!         let full = Tensor::arange(6, DType::F32)?.reshape(&[3, 2])?;
//!         let w = Param::new(distribute_tensor(&full, &mesh, &[Shard(0)])?);
//!         ParameterDict::new([("w", w.clone())])?; // names it `w`
//!         save_state_dict_full(&[w], &path)?; // collective; rank 0 writes
//!         // Load into a deferred parameter split the other way (materialising it).
//!         let v = Param::deferred(&[3, 2], DType::F32, &mesh)?;
//!         let mut layout = v.layout();
//!         layout.placements = vec![Shard(1)].into();
//!         v.place(layout)?;
//!         ParameterDict::new([("w", v.clone())])?;
//!         load_state_dict(&[v.clone()], &path)?;
//!         assert_eq!(v.value()?.full_tensor()?, full);
//!         Ok(())
//!     }
//! })
//! .unwrap();
//! std::fs::remove_file(&path).unwrap();
//! ```
//!
//! - [`load_state_dict`]: by name, any source layout, dtype conversion, every
//!   mismatch listed; nothing changes on error.
//! - [`save_state_dict_full`]: collective gathers, one writer, atomic.
//! - [`save_checkpoint`] / [`load_checkpoint`]: sharded checkpoints of a model
//!   and its optimizer (each rank writes and reads only its own chunks), loadable
//!   onto any mesh and placements.
//! - [`read_safetensors`], [`write_safetensors`]: whole files of local tensors.
//! - [`SafetensorsReader`]: one rank's region of a tensor, reading only its
//!   bytes (to materialise a shard without reading the whole file).
//! - [`write_atomic`]: any file, atomically; what the writers above use.
//!
//! The format is that of Hugging Face's `safetensors` (little-endian, C order),
//! readable by `safetensors.torch.load_file`; full state dicts use PyTorch's
//! parameter names as keys. Files written here carry the metadata
//! `{"format": "pt"}` and lay tensors out as the `safetensors` crate does (widest
//! dtype first, then by name), so every tensor's data is aligned.

mod atomic;
mod read;
mod region;
mod sharded;
pub(crate) mod stateful;

use std::collections::BTreeSet;
use std::path::Path;
// For `tests` (which imports this module's names).

use half::{bf16, f16};
use safetensors::SafeTensors;
use safetensors::tensor::{Dtype, TensorInfo, TensorView};
use tessera_dtensor::{DTensor, Tensor, distribute_tensor_with_order_from};
use tessera_mesh::{Buffer, CommunicatorExt, DType};

use crate::{Error, Param, Result};
use atomic::AtomicFile;
pub use atomic::write_atomic;
use read::{invalid, read_file};
pub use region::SafetensorsReader;
pub use sharded::{AsyncCheckpointer, LoadReport, load_checkpoint, save_checkpoint, save_checkpoint_async};
pub use stateful::{Progress, Stateful, load_states, states_to_metadata};

/// Reads every tensor of a safetensors file, in the file's order (by offset).
///
/// `F32`, `F64`, `BF16`, `F16`, `I64` and `U8` keep their dtype; `BOOL` becomes
/// `U8`; `I8`, `I16`, `I32`, `U16`, `U32` and `U64` (when every value fits) become
/// `I64`.
///
/// PyTorch: `safetensors.torch.load_file`.
///
/// The length prefix and the JSON header are checked against the file's size
/// before anything else is read, and only the bytes the header declares are read:
/// a corrupt header, a truncated file or a device such as `/dev/zero` is an error
/// at once.
///
/// # Errors
/// [`Error::Io`] naming the path when the file cannot be read; [`Error::StateDict`]
/// naming the path when it is not a regular file, is not a valid safetensors file
/// (a corrupt header; truncated, naming the first tensor cut off and the byte
/// counts), or holds a dtype with no counterpart (8-bit floats).
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
/// Duplicate names, or [`Error::Io`] naming the path when writing fails.
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
/// order, mesh), converted to the parameter's dtype; the file may come from any
/// mesh or from PyTorch. Collective over the parameters' mesh: rank 0 reads and
/// checks the file once, and every rank receives its pieces from it (one
/// all-to-all per tensor, in which only rank 0 sends), so no other rank reads the
/// file or holds a whole tensor it does not replicate. (Parameters on several
/// meshes: every rank reads the file instead.) Deferred parameters are
/// materialised by it, in the layout they were given.
///
/// Everything is checked before any parameter changes, so on error nothing has;
/// every rank gets the same error.
///
/// PyTorch: `model.load_state_dict(safetensors.torch.load_file(path))` with
/// `strict=True`, or `torch.distributed.checkpoint.state_dict.set_model_state_dict`
/// from a full state dict.
///
/// # Errors
/// [`Error::Io`] or [`Error::StateDict`] when the file cannot be read or is not
/// valid safetensors, as for [`read_safetensors`]; [`Error::StateDict`]:
/// parameters missing from the file and tensors in the file that no parameter
/// takes (both listed); a global shape that differs (name, expected, got); a
/// dtype that cannot be converted (a float parameter loads float tensors, an
/// integer one integer tensors); two parameters with one name.
pub fn load_state_dict(params: &[Param], path: impl AsRef<Path>) -> Result<()> {
    let path = path.as_ref();
    require_names(params)?;
    let names: Vec<String> = params.iter().map(Param::name).collect();
    check_unique_names(names.iter().map(String::as_str))?;
    let Some(mesh) = params.first().map(Param::mesh) else {
        return load_on_every_rank(params, path);
    };
    if params.iter().any(|p| !p.mesh().same_as(&mesh)) {
        return load_on_every_rank(params, path);
    }
    let comm = mesh.comm();
    let lead = comm.rank() == 0;
    // Rank 0 reads and checks the file; every rank learns the verdict.
    let read = if lead {
        read_file(path).and_then(|bytes| {
            check_file(params, path, &parse(path, &bytes)?)?;
            Ok(bytes)
        })
    } else {
        Ok(Vec::new())
    };
    let bytes = agree(comm, read)?;
    let mut st = None;
    let values = scatter_from_rank0(params, &mesh, |p| {
        let st = match &mut st {
            Some(st) => st,
            None => st.insert(parse(path, &bytes)?),
        };
        let view = st.tensor(&p.name()).map_err(|e| corrupt(path, e))?;
        decode(path, &p.name(), &view)
    })?;
    for (p, v) in params.iter().zip(values) {
        p.set_value(v);
    }
    Ok(())
}

/// Each rank's piece of every parameter (in its layout, converted to its
/// dtype), cut by rank 0 of `mesh` from the full tensors `full_of` gives (called
/// on rank 0 only, in order) and sent in one all-to-all per parameter in which
/// only rank 0 sends: no other rank holds a whole tensor it does not replicate.
/// Collective over `mesh`. A failure of `full_of` (a value the file's header
/// did not reveal as bad) does not leave the others waiting: rank 0 sends zeros
/// for the rest and every rank returns its error after one last agreement, so
/// nothing is returned unless every piece arrived.
pub(crate) fn scatter_from_rank0(
    params: &[Param],
    mesh: &tessera_mesh::DeviceMesh,
    mut full_of: impl FnMut(&Param) -> Result<Tensor>,
) -> Result<Vec<DTensor>> {
    let comm = mesh.comm();
    let (me, lead) = (comm.rank(), comm.rank() == 0);
    let coords = tessera_dtensor::sharding::mesh_coords(mesh.shape());
    let mut values = Vec::with_capacity(params.len());
    let mut failed: Option<Error> = None;
    for p in params {
        let layout = p.layout();
        let regions: Vec<(Vec<usize>, Vec<usize>)> = coords
            .iter()
            .map(|c| layout.local_region(c))
            .collect::<tessera_dtensor::Result<_>>()?;
        let counts: Vec<usize> = regions.iter().map(|(_, s)| s.iter().product()).collect();
        let send = if lead {
            let cut = || -> Result<Buffer> {
                let full = full_of(p)?.cast(layout.dtype)?;
                let mut pieces = Vec::with_capacity(regions.len());
                for (offset, shape) in &regions {
                    let mut t = full.clone();
                    for (d, (&o, &n)) in offset.iter().zip(shape).enumerate() {
                        t = t.narrow(d, o, n)?;
                    }
                    pieces.push(t.contiguous().reshape(&[counts[pieces.len()]])?);
                }
                Ok(Tensor::cat(&pieces, 0)?.to_buffer())
            };
            match failed.is_none().then(cut) {
                Some(Ok(buf)) => buf,
                Some(Err(e)) => {
                    failed = Some(e);
                    Buffer::zeros(layout.dtype, counts.iter().sum())
                }
                None => Buffer::zeros(layout.dtype, counts.iter().sum()),
            }
        } else {
            Buffer::zeros(layout.dtype, 0)
        };
        let send_counts: Vec<usize> = if lead { counts.clone() } else { vec![0; counts.len()] };
        let mut recv_counts = vec![0; counts.len()];
        recv_counts[0] = counts[me];
        let mut recv = Buffer::zeros(layout.dtype, counts[me]);
        comm.all_to_all_v(send.as_buf(), &send_counts, recv.as_buf_mut(), &recv_counts)?;
        let local = Tensor::from_buffer(recv, &regions[me].1)?;
        values.push(DTensor::from_local_with_layout(local, mesh, layout)?);
    }
    let mine = match failed {
        Some(e) => Err(e),
        None => Ok(values),
    };
    agree(comm, mine)
}

/// [`tessera_mesh::agree::agree_on`] for state-dict work: every rank of `comm`
/// returns `Ok` only when every rank's `mine` is; otherwise the same failure
/// (the failed rank its own error, the others one naming it).
pub(crate) fn agree<T>(comm: &dyn tessera_mesh::Communicator, mine: Result<T>) -> Result<T> {
    tessera_mesh::agree::agree_on(comm, mine, |f| {
        Error::StateDict(format!("rank {} failed: {}", f.rank, f.reason))
    })
}

/// Checks a file against `params`: every name present once, nothing else, shapes
/// equal and dtypes convertible.
fn check_file(params: &[Param], path: &Path, st: &SafeTensors<'_>) -> Result<()> {
    let in_file: BTreeSet<&str> = st.names().into_iter().map(|s| s.as_str()).collect();
    let names: Vec<String> = params.iter().map(Param::name).collect();
    let wanted: BTreeSet<&str> = names.iter().map(String::as_str).collect();
    let missing: Vec<&str> = names
        .iter()
        .map(String::as_str)
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
    for p in params {
        let view = st.tensor(&p.name()).map_err(|e| corrupt(path, e))?;
        if view.shape() != p.shape() {
            problems.push(format!(
                "{}: shape mismatch, the parameter is {:?} but the file holds {:?}",
                p.name(),
                p.shape(),
                view.shape()
            ));
        } else if let Err(e) = convertible(view.dtype(), p.dtype()) {
            problems.push(format!("{}: {e}", p.name()));
        }
    }
    if !problems.is_empty() {
        return Err(Error::StateDict(format!("{}: {}", path.display(), problems.join("; "))));
    }
    Ok(())
}

/// [`load_state_dict`] for parameters on several meshes: every rank reads the file.
fn load_on_every_rank(params: &[Param], path: &Path) -> Result<()> {
    let bytes = read_file(path)?;
    let st = parse(path, &bytes)?;

    check_file(params, path, &st)?;

    let mut values = Vec::with_capacity(params.len());
    for p in params {
        let (layout, mesh) = (p.layout(), p.mesh());
        let view = st.tensor(&p.name()).map_err(|e| corrupt(path, e))?;
        let full = decode(path, &p.name(), &view)?.cast(layout.dtype)?;
        // Every rank read the same file: no source rank, so no collective per
        // parameter between the ranks' own reads (a rank whose read fails stops
        // before any collective instead of leaving its peers waiting).
        let d = distribute_tensor_with_order_from(&full, &mesh, &layout.placements, layout.order.clone(), None)?;
        // A shard is a view of the full tensor: copy it so the full one is freed.
        let local = if d.to_local().numel() < full.numel() {
            Tensor::from_buffer(d.to_local().to_buffer(), d.to_local().shape())?
        } else {
            d.to_local().clone()
        };
        values.push(DTensor::from_local_with_layout(local, &mesh, layout)?);
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
/// communication failure, or [`Error::Io`] when writing fails: on every
/// rank (the writer names the path and the cause; it takes its part in every
/// gather first, so no rank is left waiting).
pub fn save_state_dict_full(params: &[Param], path: impl AsRef<Path>) -> Result<()> {
    save_state_dict_full_renamed(params, path, &|name| name.to_string())
}

/// [`save_state_dict_full`] with each parameter keyed by `rename(its name)`
/// in the file (another library's names, say).
///
/// PyTorch: the key mapping of a checkpoint conversion script, applied to the
/// full state dict before `save_file`.
///
/// # Errors
/// As [`save_state_dict_full`]; two parameters renamed to one key.
pub fn save_state_dict_full_renamed(
    params: &[Param],
    path: impl AsRef<Path>,
    rename: &dyn Fn(&str) -> String,
) -> Result<()> {
    let path = path.as_ref();
    // What could fail on one rank only (a parameter still deferred there) is
    // checked and agreed on before the first gather.
    let prepared = || -> Result<(Vec<DTensor>, Vec<Entry>)> {
        require_names(params)?;
        let values: Vec<DTensor> = params.iter().map(Param::value).collect::<Result<_>>()?;
        let entries: Vec<Entry> = params
            .iter()
            .zip(&values)
            .enumerate()
            .map(|(i, (p, v))| Entry::new(&rename(&p.name()), v.dtype(), v.shape(), i))
            .collect::<Result<_>>()?;
        check_unique_names(entries.iter().map(|e| e.name.as_str()))?;
        Ok((values, sort_entries(entries)))
    };
    let mesh = params.first().map(Param::mesh);
    let (values, entries) = match &mesh {
        Some(mesh) => agree(mesh.comm(), prepared())?,
        None => prepared()?,
    };
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

/// The dtype [`decode`] gives a tensor of `file` dtype (`None`: 8-bit floats,
/// which Tessera cannot hold).
fn decoded_dtype(file: Dtype) -> Option<DType> {
    Some(match file {
        Dtype::F32 => DType::F32,
        Dtype::F64 => DType::F64,
        Dtype::BF16 => DType::BF16,
        Dtype::F16 => DType::F16,
        Dtype::U8 | Dtype::BOOL => DType::U8,
        Dtype::I64 | Dtype::I8 | Dtype::I16 | Dtype::U16 | Dtype::I32 | Dtype::U32 | Dtype::U64 => DType::I64,
        _ => return None,
    })
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

/// Every parameter must have its tree's name: a state-dict key is nothing else.
pub(crate) fn require_names(params: &[Param]) -> Result<()> {
    match params.iter().find(|p| !p.is_named()) {
        Some(p) => Err(Error::StateDict(format!(
            "{} has no name: state dicts key parameters by their names in the module tree; name the tree \
             first (nn::name_parameters on its root, which materialising does)",
            p.name()
        ))),
        None => Ok(()),
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

fn parse<'a>(path: &Path, bytes: &'a [u8]) -> Result<SafeTensors<'a>> {
    SafeTensors::deserialize(bytes).map_err(|e| corrupt(path, e))
}

fn corrupt(path: &Path, e: safetensors::SafeTensorError) -> Error {
    invalid(path, e)
}

#[cfg(test)]
mod tests;
