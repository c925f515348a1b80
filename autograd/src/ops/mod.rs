//! Differentiable ops on [`Var`]s. Each forward runs the sharded DTensor op; each
//! backward rule is written with DTensor ops too, so gradients are sharded,
//! partial or replicated exactly as single-device semantics require, with no
//! communication beyond what their placements imply. Dims may be negative (`-1`: the last),
//! as in PyTorch ([`Dim`](tessera_dtensor::Dim)).

mod nn;
mod pointwise;
mod select;
mod shape;

use smallvec::{SmallVec, smallvec};
use tessera_dtensor::{DTensor, Tensor};

use crate::{Result, Var};

/// Gradients for the inputs of a backward rule.
pub(crate) type Grads = SmallVec<[Option<DTensor>; 3]>;

pub(crate) fn one(g: DTensor) -> Grads {
    smallvec![Some(g)]
}

/// Sums `g` down to `shape`, undoing NumPy broadcasting (the one generic rule every
/// broadcasting op's backward uses).
pub fn unbroadcast(g: &DTensor, shape: &[usize]) -> Result<DTensor> {
    if g.shape() == shape {
        return Ok(g.clone());
    }
    let lead = g.shape().len() - shape.len();
    let mut out = g.clone();
    if lead > 0 {
        let dims: Vec<usize> = (0..lead).collect();
        out = out.sum(&dims, false)?;
    }
    let dims: Vec<usize> = (0..shape.len())
        .filter(|&d| shape[d] == 1 && out.shape()[d] != 1)
        .collect();
    if !dims.is_empty() {
        out = out.sum(&dims, true)?;
    }
    Ok(out)
}

/// `g` (broadcastable to `like`'s shape) expanded to `like`'s shape and shards.
pub(crate) fn expand_like(g: &DTensor, like: &DTensor) -> tessera_dtensor::Result<DTensor> {
    like.full_like_replicated(0.0)?.add(g)
}

/// Applies `f` to every element of a local tensor through f64 (masks and other
/// small helpers of backward rules).
pub(crate) fn map_f64(t: &Tensor, f: impl Fn(f64) -> f64) -> tessera_dtensor::Result<Tensor> {
    let v: Vec<f64> = t.to_f64_vec().into_iter().map(f).collect();
    Ok(Tensor::from_vec(v, t.shape())?.cast(t.dtype())?.to(t.device())?)
}

impl Var {
    /// The output var of a one-input op whose backward is `rule(g)`.
    pub(crate) fn unary_op(
        &self,
        name: &'static str,
        value: DTensor,
        rule: impl FnOnce(&DTensor) -> tessera_dtensor::Result<DTensor> + 'static,
    ) -> Var {
        Var::from_op(name, value, &[self], move |g| Ok(one(rule(g)?)))
    }
}
