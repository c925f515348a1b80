//! Materialising a deferred model ([`Materializer`]): each rank allocates only
//! its local shard of every deferred parameter, in the placements tensor
//! parallelism and FSDP chose, and fills it from a seed (mesh-invariant: bit for
//! bit the tensor one rank would create whole), a consolidated safetensors file
//! or a sharded checkpoint (reading only this rank's bytes).
//!
//! PyTorch: `model.to_empty(device=...)` followed by `init_weights()` (or a
//! distributed checkpoint load) after building on the `meta` device.

use std::path::{Path, PathBuf};

use tessera_dtensor::checkpoint::Checkpoint;
use tessera_dtensor::{Layout, Tensor, check_replicas};
use tessera_mesh::{CommunicatorExt, DeviceMesh};
use tessera_tensor::memory;
use tessera_tensor::random::{StreamKey, fill_region};

use super::Module;
use super::init::Init;
use super::names::{fqn_matches, name_parameters};
use crate::state_dict::{SafetensorsReader, scatter_from_rank0};
use crate::{Error, Param, Result};

/// Where the values come from.
#[derive(Clone, Debug)]
enum Source {
    /// The counter-based generator keyed by (seed, name, element index).
    Seed(u64),
    /// A consolidated safetensors file (one full tensor per name).
    Safetensors(PathBuf),
    /// A sharded checkpoint directory ([`tessera_dtensor::checkpoint`]).
    Checkpoint(PathBuf),
    /// Full tensors by name on rank 0 of the parameters' mesh (empty elsewhere).
    Rank0(Vec<(String, Tensor)>),
    /// No values: local shards on the meta device.
    Meta,
}

/// What [`Materializer::materialize`] did on this rank.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MaterializeReport {
    /// Parameters materialised (deferred ones; tied parameters count once).
    pub params: usize,
    /// Bytes of this rank's local shards allocated.
    pub local_bytes: usize,
    /// The largest single local shard, in bytes.
    pub largest_local_bytes: usize,
    /// This rank's tracked peak while materialising (the memory tracker's peak
    /// is reset when materialising starts).
    pub peak_bytes: usize,
}

impl MaterializeReport {
    /// Counts one materialised parameter whose local shard holds `bytes`.
    fn count(&mut self, bytes: usize) {
        self.params += 1;
        self.local_bytes += bytes;
        self.largest_local_bytes = self.largest_local_bytes.max(bytes);
    }
}

/// Materialises every deferred parameter of a model: see the module docs.
///
/// ```
/// use tessera_autograd::nn::{Init, Linear, Materializer, Module};
/// use tessera_dtensor::{DType, Placement};
/// use tessera_mesh::{launch, DeviceMesh};
///
/// let firsts = launch(2, |ctx| {
///     let mesh = DeviceMesh::new(ctx.into_comm(), &[2])?;
///     let lin = Linear::new(4, 6, true, &mesh, DType::F32)?; // no storage yet
///     // Shard the weight by rows before any rank allocates it.
///     let mut layout = lin.weight.layout();
///     layout.placements = vec![Placement::Shard(0)].into();
///     lin.weight.place(layout)?;
///     Materializer::from_seed(7).init("bias", Init::Zeros).materialize(&lin)?;
///     assert_eq!(lin.weight.value()?.to_local().shape(), &[3, 4]);
///     Ok(lin.weight.value()?.full_tensor()?.to_f64_vec())
/// })
/// .unwrap();
/// // Both ranks see the same whole weight, each having drawn only its rows.
/// assert_eq!(firsts[0], firsts[1]);
/// # Ok::<(), tessera_mesh::Error>(())
/// ```
///
/// PyTorch: `to_empty` + `init_weights` (or `dcp.load`) after `meta`-device construction.
#[derive(Clone, Debug)]
pub struct Materializer {
    source: Source,
    rules: Vec<(String, Init)>,
    check_replicas: bool,
}

impl Materializer {
    /// Values drawn from one model seed: each parameter by its init scheme (a
    /// rule given to [`init`](Self::init), else its module's
    /// [`Module::init_scheme`]), with the counter-based generator keyed by
    /// (seed, the parameter's name, the global element index), so a sharded
    /// parameter equals bit for bit the one a single rank would draw whole.
    pub fn from_seed(seed: u64) -> Materializer {
        Materializer::new(Source::Seed(seed))
    }

    /// Values from a consolidated safetensors file (the names are the
    /// parameters' fully qualified names); each rank reads only its shards' bytes.
    pub fn from_safetensors(path: impl AsRef<Path>) -> Materializer {
        Materializer::new(Source::Safetensors(path.as_ref().to_path_buf()))
    }

    /// Values from a sharded checkpoint written by
    /// [`save_checkpoint`](crate::save_checkpoint) on any mesh; each rank reads
    /// only the bytes of its shards.
    pub fn from_checkpoint(path: impl AsRef<Path>) -> Materializer {
        Materializer::new(Source::Checkpoint(path.as_ref().to_path_buf()))
    }

    /// Values rank 0 holds: `values` are full tensors by parameter name on rank
    /// 0 of the parameters' mesh (other ranks pass an empty list, which they
    /// ignore); each rank receives only its pieces (one all-to-all per parameter
    /// in which only rank 0 sends), converted to the parameters' dtypes.
    ///
    /// PyTorch: `set_model_state_dict(..., full_state_dict=True,
    /// broadcast_from_rank0=True)`.
    pub fn from_rank0(values: Vec<(String, Tensor)>) -> Materializer {
        Materializer::new(Source::Rank0(values))
    }

    /// No values: every local shard on the [meta device](tessera_tensor::Device::Meta),
    /// its bytes charged to the memory tracker as a real shard's would be. A
    /// model so materialised runs a planning step: every op checks its shapes,
    /// every collective is counted, nothing is computed or moved, and the
    /// memory tracker measures what the real step would hold. Replicas are
    /// not checked (there are no values).
    ///
    /// PyTorch: keeping a model built under `torch.device("meta")` on meta.
    pub fn on_meta() -> Materializer {
        Materializer::new(Source::Meta)
    }

    fn new(source: Source) -> Materializer {
        Materializer {
            source,
            rules: Vec::new(),
            check_replicas: true,
        }
    }

    /// Initialises the parameters whose names match `pattern` (`*` is any run
    /// of characters: `layers.*.attention.wq.weight`, `*.bias`) with `init`,
    /// instead of their modules' defaults; a later rule overrides an earlier one.
    /// Only for [`from_seed`](Self::from_seed).
    #[must_use]
    pub fn init(mut self, pattern: &str, init: Init) -> Materializer {
        self.rules.push((pattern.to_string(), init));
        self
    }

    /// Whether to check, after materialising, that every rank holds the same
    /// values where a parameter is replicated (a hash all-gather per parameter;
    /// on by default). Diverging replicas are an error naming the parameter, the
    /// mesh dim and the ranks.
    #[must_use]
    pub fn check_replicas(mut self, on: bool) -> Materializer {
        self.check_replicas = on;
        self
    }

    /// Names the tree ([`name_parameters`]) and materialises every deferred
    /// parameter below `root` with this rank's local shard. Parameters that hold
    /// values already are left as they are. Collective over the parameters'
    /// meshes (every rank calls it, and every rank returns the same verdict).
    ///
    /// # Errors
    /// A parameter no rule or module default says how to initialise; a file
    /// without a parameter's name, with another shape or a dtype that does not
    /// convert; ranks materialising from different seeds; replicas that differ.
    #[track_caller]
    pub fn materialize(&self, root: &dyn Module) -> Result<MaterializeReport> {
        let _site = tessera_mesh::callsite::enter();
        name_parameters(root)?;
        let params = with_schemes(root);
        let Some(mesh) = params.first().map(|(p, _)| p.mesh()) else {
            return Ok(MaterializeReport::default());
        };
        if let Source::Seed(seed) = self.source {
            agree_on_seed(&mesh, seed)?;
        }
        memory::reset_peak();
        let mut report = MaterializeReport::default();
        let local = match &self.source {
            Source::Rank0(values) => {
                let deferred: Vec<Param> = params
                    .iter()
                    .map(|(p, _)| p.clone())
                    .filter(Param::is_deferred)
                    .collect();
                from_rank0(&mesh, values, &deferred, &mut report)?;
                Ok(())
            }
            _ => self.fill_all(&params, &mut report),
        };
        // Every rank learns whether any failed before anyone communicates again.
        let shared = agree(&mesh, "materialize", local.as_ref().err().map(ToString::to_string));
        local?;
        shared?;
        if self.check_replicas && !matches!(self.source, Source::Meta) {
            check_all(&params.iter().map(|(p, _)| p.clone()).collect::<Vec<_>>())?;
        }
        report.peak_bytes = memory::stats().peak_bytes;
        Ok(report)
    }

    /// Fills every deferred parameter of `params` locally (no communication).
    fn fill_all(&self, params: &[(Param, Option<Init>)], report: &mut MaterializeReport) -> Result<()> {
        // Rank 0's values come collectively (`from_rank0`), never through here.
        let file = match &self.source {
            Source::Safetensors(path) => Some(SafetensorsReader::open(path)?),
            _ => None,
        };
        let ckpt = match &self.source {
            Source::Checkpoint(path) => Some(Checkpoint::open(path)?),
            _ => None,
        };
        for (p, default) in params {
            if !p.is_deferred() {
                continue;
            }
            let name = p.name();
            p.materialize_with(|mesh, layout| {
                let (offset, shape) = layout.local_region(mesh.coordinate())?;
                match &self.source {
                    Source::Seed(seed) => {
                        let init = self
                            .rules
                            .iter()
                            .rev()
                            .find(|(pat, _)| fqn_matches(pat, &name))
                            .map(|(_, i)| *i)
                            .or(*default)
                            .ok_or_else(|| no_scheme(&name, layout))?;
                        let dist = init.distribution(&layout.shape).map_err(|e| named(&name, e))?;
                        let key = StreamKey::new(*seed, &name);
                        Ok(fill_region(&dist, key, &layout.shape, &offset, &shape, layout.dtype)?)
                    }
                    Source::Safetensors(_) => {
                        let file = file.as_ref().expect("opened above");
                        check_file_shape(file, &name, layout)?;
                        file.read_region(&name, &offset, &shape, layout.dtype)
                    }
                    Source::Checkpoint(_) => {
                        let ckpt = ckpt.as_ref().expect("opened above");
                        Ok(ckpt.load(&name, mesh, layout.clone())?.to_local().clone())
                    }
                    Source::Rank0(_) => unreachable!("rank 0's values are scattered collectively"),
                    Source::Meta => Ok(Tensor::meta(&shape, layout.dtype)?),
                }
            })?;
            report.count(p.value()?.to_local().size_in_bytes());
        }
        Ok(())
    }
}

/// Checks that every rank holds the same values wherever a parameter below
/// `root` is replicated (one small hash all-gather per parameter): diverging
/// replicas (a rank-dependent seed, a rank that loaded another file or stepped
/// differently) are an error naming the parameter, the mesh dim and the ranks.
/// Collective; every rank returns the same verdict.
///
/// PyTorch: no counterpart (DDP only checks shapes across ranks at
/// construction, `_verify_param_shape_across_processes`).
///
/// # Errors
/// Replicas that differ; a deferred parameter (on any rank).
#[track_caller]
pub fn verify_replicas(root: &dyn Module) -> Result<()> {
    let _site = tessera_mesh::callsite::enter();
    name_parameters(root)?;
    check_all(&root.parameters())
}

/// [`check_replicas`] of every parameter, once every rank knows all are materialised.
fn check_all(params: &[Param]) -> Result<()> {
    let Some(mesh) = params.first().map(Param::mesh) else {
        return Ok(());
    };
    let deferred = params.iter().find(|p| p.is_deferred()).map(|p| p.value().map(drop));
    agree(
        &mesh,
        "verify_replicas",
        deferred.and_then(|r| r.err()).map(|e| e.to_string()),
    )?;
    for p in params {
        check_replicas(&p.value()?, &p.name())?;
    }
    Ok(())
}

/// Materialises `deferred` from the full tensors rank 0 of `mesh` holds: rank 0
/// checks every name and shape first and every rank learns its verdict, then
/// each parameter is scattered from rank 0.
fn from_rank0(
    mesh: &DeviceMesh,
    values: &[(String, Tensor)],
    deferred: &[Param],
    report: &mut MaterializeReport,
) -> Result<()> {
    let lead = mesh.comm().rank() == 0;
    let find = |p: &Param| values.iter().find(|(n, _)| *n == p.name()).map(|(_, t)| t);
    let mut problem = deferred.iter().find(|p| !p.mesh().same_as(mesh)).map(|p| {
        format!(
            "{} lives on mesh {}, the model's first parameter on {mesh}; from_rank0 scatters over one mesh",
            p.name(),
            p.mesh()
        )
    });
    if lead && problem.is_none() {
        problem = deferred.iter().find_map(|p| match find(p) {
            None => Some(format!("rank 0 has no value for {} ({})", p.name(), p.layout())),
            Some(t) if t.shape() != &p.shape()[..] => Some(format!(
                "rank 0's value for {} has shape {:?}, the parameter {:?}",
                p.name(),
                t.shape(),
                p.shape()
            )),
            Some(_) => None,
        });
    }
    agree(mesh, "materialize", problem)?;
    let pieces = scatter_from_rank0(deferred, mesh, |p| Ok(find(p).expect("checked above").clone()))?;
    for (p, v) in deferred.iter().zip(pieces) {
        report.count(v.to_local().size_in_bytes());
        p.set_value(v);
    }
    Ok(())
}

/// Every parameter below `root` once, with its module's default scheme.
fn with_schemes(root: &dyn Module) -> Vec<(Param, Option<Init>)> {
    let mut seen = std::collections::HashSet::new();
    let mut out = Vec::new();
    for (_, module) in super::named_modules(root) {
        for (local, p) in module.own_parameters() {
            if seen.insert(p.id()) {
                out.push((p, module.init_scheme(&local)));
            }
        }
    }
    out
}

/// The error for a parameter nothing says how to initialise.
fn no_scheme(name: &str, layout: &Layout) -> Error {
    Error::Config {
        op: "materialize",
        detail: format!(
            "no init scheme for {name} ({layout}): its module has no default for it; add a rule \
             (Materializer::init(\"{name}\", Init::...))"
        ),
    }
}

/// `e` with the parameter's name in front.
fn named(name: &str, e: Error) -> Error {
    Error::Config {
        op: "materialize",
        detail: format!("{name}: {e}"),
    }
}

/// The file's tensor `name` must have the parameter's global shape.
fn check_file_shape(file: &SafetensorsReader, name: &str, layout: &Layout) -> Result<()> {
    let (_, shape) = file.info(name)?;
    if shape != &layout.shape[..] {
        return Err(Error::StateDict(format!(
            "{}: {name} has shape {shape:?}, the model's parameter {:?}",
            file.path().display(),
            &layout.shape[..]
        )));
    }
    Ok(())
}

/// Every rank learns the first failure of any rank, so that all return the same
/// verdict (and none waits in a collective another rank left).
fn agree(mesh: &DeviceMesh, op: &'static str, failed: Option<String>) -> Result<()> {
    let mine = failed.map_or(Ok(()), |detail| Err(Error::Config { op, detail }));
    tessera_mesh::agree::agree_on(mesh.comm(), mine, |f| Error::Config {
        op,
        detail: format!("rank {} failed: {}", f.rank, f.reason),
    })
}

/// Every rank must draw from the same seed: otherwise replicas differ, and
/// shards do not form the tensor one rank would draw.
fn agree_on_seed(mesh: &DeviceMesh, seed: u64) -> Result<()> {
    // Seeds travel as their bits.
    let seeds = mesh.comm().all_gather_vec(&[seed as i64])?;
    if seeds.iter().all(|&s| s == seeds[0]) {
        return Ok(());
    }
    let groups: Vec<String> = seeds
        .iter()
        .enumerate()
        .map(|(r, &s)| format!("rank {r}: {}", s as u64))
        .collect();
    Err(Error::Config {
        op: "materialize",
        detail: format!(
            "ranks materialise from different seeds ({}); give every rank the same model seed (a \
             rank-dependent seed trains a different model on each rank)",
            groups.join(", ")
        ),
    })
}
