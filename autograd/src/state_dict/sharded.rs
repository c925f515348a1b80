//! Sharded checkpoints of a model and its optimizer, keyed by parameter name, on
//! top of [`tessera_dtensor::checkpoint`]: parameters under their names (the
//! state-dict keys), optimizer state under `optim.<name>.<state>`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use tessera_dtensor::checkpoint::{AsyncSave, Checkpoint, SaveReport, async_save, save};
use tessera_dtensor::{DTensor, Layout, Placement};

use crate::optim::Optimizer;
use crate::{Error, Param, Result};

const OP: &str = "checkpoint";

/// The key of an optimizer state tensor.
fn state_key(param: &str, state: &str) -> String {
    format!("optim.{param}.{state}")
}

/// Saves `params` and `optimizer`'s state (moments, step counts, momentum
/// buffers, in their parameters' placements) as a sharded checkpoint at `dir`,
/// with `metadata`. Each rank writes only its own chunks; the directory replaces
/// an older checkpoint atomically. Collective over the parameters' mesh.
///
/// PyTorch: `torch.distributed.checkpoint.save({"model": ..., "optim": ...})`
/// with `get_state_dict`.
///
/// # Errors
/// As [`tessera_dtensor::checkpoint::save`] (every rank gets the same error),
/// and parameters with one name twice.
pub fn save_checkpoint(
    dir: impl AsRef<Path>,
    params: &[Param],
    optimizer: Option<&dyn Optimizer>,
    metadata: BTreeMap<String, String>,
) -> Result<SaveReport> {
    let tensors = state_of(params, optimizer)?;
    let refs: Vec<(&str, &DTensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    Ok(save(dir, &refs, metadata)?)
}

/// The tensors of a model and optimizer checkpoint, by key, agreed on by every
/// rank before the save's collectives (a parameter deferred on one rank only, or
/// optimizer state one rank cannot give, fails every rank: [`agreed`]).
fn state_of(params: &[Param], optimizer: Option<&dyn Optimizer>) -> Result<Vec<(String, DTensor)>> {
    let mine = (|| {
        super::require_names(params)?;
        let mut tensors: Vec<(String, DTensor)> = params
            .iter()
            .map(|p| Ok((p.name(), p.value()?)))
            .collect::<Result<_>>()?;
        if let Some(opt) = optimizer {
            let names = opt.params();
            for (i, state, t) in opt.state_tensors()? {
                tensors.push((state_key(&names[i].name(), state), t));
            }
        }
        Ok(tensors)
    })();
    agreed(params, mine)
}

/// Every rank's `mine` agreed on over the widest of the parameters' meshes
/// ([`super::agree`]); without parameters, `mine` itself.
fn agreed<T>(params: &[Param], mine: Result<T>) -> Result<T> {
    match params.iter().map(Param::mesh).max_by_key(|m| m.size()) {
        Some(mesh) => super::agree(mesh.comm(), mine),
        None => mine,
    }
}

/// [`save_checkpoint`] in the background ([`async_save`]): the state is staged
/// now, at a step boundary, and written while training goes on; the returned
/// handle's `wait` completes it (collectively).
///
/// PyTorch: `torch.distributed.checkpoint.async_save`.
///
/// # Errors
/// As [`save_checkpoint`], for what can be checked before writing.
pub fn save_checkpoint_async(
    dir: impl AsRef<Path>,
    params: &[Param],
    optimizer: Option<&dyn Optimizer>,
    metadata: BTreeMap<String, String>,
) -> Result<AsyncSave> {
    let tensors = state_of(params, optimizer)?;
    let refs: Vec<(&str, &DTensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    Ok(async_save(dir, &refs, metadata)?)
}

/// Background checkpoints, one at a time: a save first waits for the one in
/// flight. Lives on its rank's thread.
#[derive(Debug, Default)]
pub struct AsyncCheckpointer {
    pending: Option<AsyncSave>,
}

impl AsyncCheckpointer {
    /// A checkpointer with nothing in flight.
    pub fn new() -> AsyncCheckpointer {
        AsyncCheckpointer::default()
    }

    /// Waits for the save in flight, if any, then starts saving `params` and
    /// `optimizer` to `dir` in the background. Collective. Returns the report
    /// of the save it waited for.
    ///
    /// # Errors
    /// The previous save's error, or this one's as [`save_checkpoint_async`].
    pub fn save(
        &mut self,
        dir: impl AsRef<Path>,
        params: &[Param],
        optimizer: Option<&dyn Optimizer>,
        metadata: BTreeMap<String, String>,
    ) -> Result<Option<SaveReport>> {
        let previous = self.wait()?;
        self.pending = Some(save_checkpoint_async(dir, params, optimizer, metadata)?);
        Ok(previous)
    }

    /// Waits for the save in flight and completes it. Collective when one is in
    /// flight.
    ///
    /// # Errors
    /// As [`save_checkpoint`].
    pub fn wait(&mut self) -> Result<Option<SaveReport>> {
        match self.pending.take() {
            Some(s) => Ok(Some(s.wait()?)),
            None => Ok(None),
        }
    }

    /// Whether a save is in flight.
    pub fn is_saving(&self) -> bool {
        self.pending.is_some()
    }
}

/// What [`load_checkpoint`] read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoadReport {
    /// The metadata saved with the checkpoint.
    pub metadata: BTreeMap<String, String>,
    /// Bytes of tensor data this rank read.
    pub bytes_read: u64,
}

/// Loads the checkpoint at `dir` into `params` (each in its current mesh and
/// placements, whatever the checkpoint was saved with; a deferred parameter is
/// materialised from it) and `optimizer`'s state. Each rank reads only the byte
/// ranges of its own pieces. All or nothing, on every rank: each rank stages
/// what it read and checked, the ranks agree (one all-gather over the widest
/// of the parameters' meshes), and only then is anything applied; a failure on
/// any rank is the same error on every rank and leaves every parameter and the
/// optimizer as they were. Collective over the parameters' mesh.
///
/// PyTorch: `torch.distributed.checkpoint.load` with `set_state_dict`.
///
/// # Errors
/// As [`Checkpoint::open`] and [`Checkpoint::load`] (missing, truncated or
/// corrupt files; a parameter missing or of another shape or dtype), a
/// checkpoint holding tensors no parameter or optimizer state takes (another
/// model, or another optimizer), or state the optimizer rejects; on a rank
/// whose own part loaded, the error names the rank that failed.
pub fn load_checkpoint(
    dir: impl AsRef<Path>,
    params: &[Param],
    optimizer: Option<&mut dyn Optimizer>,
) -> Result<LoadReport> {
    let dir = dir.as_ref();
    super::require_names(params)?;
    let staged = agreed(params, stage(dir, params, optimizer.as_deref()))?;
    if let Some(opt) = optimizer {
        opt.load_state_tensors(&staged.states).map_err(|e| Error::Config {
            op: OP,
            detail: format!("{}: {e}", dir.display()),
        })?;
    }
    for (p, v) in params.iter().zip(staged.values) {
        p.set_value(v);
    }
    Ok(staged.report)
}

/// What one rank read of a checkpoint and checked, not yet applied.
struct Staged {
    values: Vec<DTensor>,
    states: Vec<(usize, Vec<(&'static str, DTensor)>)>,
    report: LoadReport,
}

/// Reads and checks this rank's part of the checkpoint at `dir`: every
/// parameter's piece, the optimizer's state (each parameter's every name, or
/// none when it has not stepped, checked by the optimizer), nothing left over.
fn stage(dir: &Path, params: &[Param], optimizer: Option<&dyn Optimizer>) -> Result<Staged> {
    let ckpt = Checkpoint::open(dir)?;
    let mut used: BTreeSet<String> = BTreeSet::new();
    let mut values = Vec::with_capacity(params.len());
    for p in params {
        let name = p.name();
        values.push(ckpt.load(&name, &p.mesh(), p.layout())?);
        used.insert(name);
    }
    let mut states: Vec<(usize, Vec<(&'static str, DTensor)>)> = Vec::new();
    if let Some(opt) = optimizer {
        for (i, p) in opt.params().iter().enumerate() {
            let keys: Vec<(&'static str, String)> = opt
                .state_names()
                .iter()
                .map(|s| (*s, state_key(&p.name(), s)))
                .collect();
            let present = keys
                .iter()
                .filter(|(_, k)| ckpt.index().tensors.contains_key(k))
                .count();
            if present == 0 {
                continue;
            }
            if present < keys.len() {
                return Err(Error::StateDict(format!(
                    "{}: the optimizer state of {} is incomplete (it needs {:?})",
                    dir.display(),
                    p.name(),
                    opt.state_names()
                )));
            }
            let (mesh, like) = (p.mesh(), p.layout());
            let mut ts = Vec::with_capacity(keys.len());
            for (state, key) in keys {
                let entry = ckpt.entry(&key)?;
                let layout = if opt.replicated_state_names().contains(&state) {
                    let r = vec![Placement::Replicate; mesh.ndim()];
                    Layout::new(mesh.shape(), &r, &entry.shape, entry.dtype()?)?
                } else {
                    Layout {
                        dtype: entry.dtype()?,
                        ..like.clone()
                    }
                };
                ts.push((state, ckpt.load(&key, &mesh, layout)?));
                used.insert(key);
            }
            states.push((i, ts));
        }
        opt.check_state_tensors(&states).map_err(|e| Error::Config {
            op: OP,
            detail: format!("{}: {e}", dir.display()),
        })?;
    }
    let unused: Vec<&String> = ckpt.index().tensors.keys().filter(|k| !used.contains(*k)).collect();
    if !unused.is_empty() {
        return Err(Error::StateDict(format!(
            "{}: the checkpoint holds {} tensors nothing here takes (another model or optimizer?): {:?}",
            dir.display(),
            unused.len(),
            unused.iter().take(8).collect::<Vec<_>>()
        )));
    }
    let report = LoadReport {
        metadata: ckpt.metadata().clone(),
        bytes_read: ckpt.bytes_read(),
    };
    Ok(Staged { values, states, report })
}
