//! The reverse walk.

use std::collections::HashMap;
use tessera_mesh::observe;

use tessera_dtensor::DTensor;

use crate::tape::{self, Frame};
use crate::{Error, Result, Var};

/// Computes gradients of the scalar `loss` and accumulates them into every
/// parameter it depends on, consuming the current frame of the tape.
///
/// The seed gradient is one, replicated: the gradient of a partial value is
/// replicated (PyTorch's rule), so a loss that is a pending sum over ranks seeds
/// every rank with one.
///
/// PyTorch: `loss.backward()`.
///
/// # Errors
/// A non-scalar loss, a loss that does not require a gradient, or a failing backward rule.
#[track_caller]
pub fn backward(loss: &Var) -> Result<()> {
    let _site = tessera_mesh::callsite::enter();
    if !loss.value().shape().is_empty() {
        return Err(Error::Backward(format!(
            "the loss must be a scalar, got shape {:?}; reduce it (sum or mean) first",
            loss.value().shape()
        )));
    }
    if !loss.requires_grad() {
        return Err(Error::Backward(
            "the loss does not depend on any parameter that requires a gradient (computed under no_grad?)".into(),
        ));
    }
    let seed = loss.value().full_like_replicated(1.0)?;
    let frame = tape::take_reachable(loss.id())?;
    let walked = walk(frame, loss.id(), seed, &[]);
    let finished = tape::run_callbacks();
    walked?;
    finished
}

/// Walks `frame` backwards from `output` with gradient `seed`, accumulating into the
/// frame's parameters, and returns the gradients reaching the ids in `wanted`.
pub(crate) fn walk(frame: Frame, output: u64, seed: DTensor, wanted: &[u64]) -> Result<Vec<Option<DTensor>>> {
    let Frame { nodes, params, .. } = frame;
    let mut grads: HashMap<u64, DTensor> = HashMap::new();
    grads.insert(output, seed);
    let _no_record = NoRecord::new();
    // For a recording rank: consecutive nodes of one module run in one
    // backward span of that module.
    let mut module: (Option<std::sync::Arc<str>>, Option<observe::Span>) = (None, None);
    for node in nodes.into_iter().rev() {
        let Some(g) = grads.remove(&node.output) else {
            continue;
        };
        if node.module != module.0 {
            module.1 = None;
            module = (
                node.module.clone(),
                node.module
                    .clone()
                    .map(|m| observe::module(m, observe::Phase::Backward)),
            );
        }
        let gins = (node.backward)(&g).map_err(|e| match e {
            Error::Backward(m) => Error::Backward(format!("{}: {m}", node.name)),
            other => other,
        })?;
        for (&(id, needs), gi) in node.inputs.iter().zip(gins) {
            if let (true, Some(gi)) = (needs, gi) {
                let total = match grads.remove(&id) {
                    Some(prev) => prev.add(&gi)?,
                    None => gi,
                };
                grads.insert(id, total);
            }
        }
    }
    drop(module);
    let mut ids: Vec<u64> = params.keys().copied().collect();
    ids.sort_unstable();
    for id in ids {
        if let (Some(p), Some(g)) = (params.get(&id), grads.get(&id)) {
            p.accumulate(g.clone())?;
        }
    }
    Ok(wanted.iter().map(|id| grads.remove(id)).collect())
}

/// Backward rules run without recording (their ops are not differentiated again).
struct NoRecord(bool);

impl NoRecord {
    fn new() -> NoRecord {
        let prev = tape::is_grad_enabled();
        tape::set_grad_enabled(false);
        NoRecord(prev)
    }
}

impl Drop for NoRecord {
    fn drop(&mut self) {
        tape::set_grad_enabled(self.0);
    }
}

/// Runs `f` on its inputs without keeping its intermediate values, and recomputes
/// them during backward (trading compute for activation memory).
///
/// The recomputation replays `f`'s random draws ([`random`](crate::random)), so
/// dropout inside drops the elements it dropped in forward.
///
/// PyTorch: `torch.utils.checkpoint.checkpoint(f, *inputs, use_reentrant=False)`
/// (with `preserve_rng_state=True`).
///
/// # Errors
/// Whatever `f` returns.
pub fn checkpoint(inputs: &[Var], f: impl Fn(&[Var]) -> Result<Var> + 'static) -> Result<Var> {
    if !tape::is_grad_enabled() {
        return f(inputs);
    }
    // Run forward recording into a throwaway frame: it tells whether the output
    // needs a gradient (through the inputs or parameters used inside), and its saved
    // activations are dropped right away. The random state it starts from is
    // kept, so that the recomputation draws the same dropout masks.
    let rng = crate::random::state();
    let (out, frame) = tape::in_frame(|| f(inputs));
    let out = out?;
    // Values from outside that `f` captured and that need a gradient become extra
    // inputs of the checkpoint, so their gradients flow on in the outer walk.
    let input_ids: Vec<u64> = inputs.iter().map(Var::id).collect();
    let produced: std::collections::HashSet<u64> = frame.nodes.iter().map(|n| n.output).collect();
    let mut captured: Vec<u64> = Vec::new();
    for &(id, needs) in frame.nodes.iter().flat_map(|n| n.inputs.iter()) {
        let outside = !produced.contains(&id) && !frame.params.contains_key(&id) && !input_ids.contains(&id);
        if needs && outside && !captured.contains(&id) {
            captured.push(id);
        }
    }
    drop(frame);
    let saved: Vec<Var> = inputs.to_vec();
    let mut ids: smallvec::SmallVec<[(u64, bool); 3]> = inputs.iter().map(|v| (v.id(), v.requires_grad())).collect();
    ids.extend(captured.iter().map(|&id| (id, true)));
    let requires_grad = out.requires_grad();
    Ok(Var::record_op_ids(
        "checkpoint",
        out.value().clone(),
        ids,
        requires_grad,
        move |g| {
            let fresh: Vec<Var> = saved.iter().map(Var::fresh_leaf).collect();
            let (out, frame) = {
                let _replay = crate::random::Replay::from(rng);
                tape::in_frame(|| tape::with_grad_mode(true, || f(&fresh)))
            };
            let out = out?;
            let wanted: Vec<u64> = fresh.iter().map(Var::id).chain(captured.iter().copied()).collect();
            if !out.requires_grad() {
                return Ok(wanted.iter().map(|_| None).collect());
            }
            let grads = walk(frame, out.id(), g.clone(), &wanted)?;
            Ok(grads.into_iter().collect())
        },
    ))
}
