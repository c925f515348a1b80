//! Operations on [`DTensor`]s: every op picks a sharding strategy (see
//! [`crate::strategy`]), redistributes its inputs to it, runs the local kernel on
//! the local tensors, and wraps the result with the strategy's output placements.
//!
//! [`dispatch`] is that machinery, public so that other crates (autograd's
//! backward rules) can define sharded ops of their own.

mod nn;
mod pointwise;

pub use pointwise::broadcast_shape;
mod shape;

use smallvec::SmallVec;
use tessera_mesh::DType;

use crate::redistribute::execute;
use crate::spec::{DTensorSpec, Layout};
use crate::strategy::{Candidate, choose};
use crate::{DTensor, Error, Result, ShardOrder, Tensor};

/// What a local kernel may need to know about where its pieces sit.
pub struct LocalCtx<'a> {
    /// The inputs' layouts after redistribution (what the local tensors are pieces of).
    pub inputs: &'a [Layout],
    /// This rank's mesh coordinate.
    pub coord: &'a [usize],
}

impl LocalCtx<'_> {
    /// The global offset of this rank's piece of input `i`.
    ///
    /// # Errors
    /// Never for a valid context (the layouts were validated).
    pub fn offset(&self, i: usize) -> Result<Vec<usize>> {
        Ok(self.inputs[i].local_region(self.coord)?.0)
    }
}

/// Runs a sharded op: picks the least-cost candidate for `inputs`, redistributes
/// them, runs `kernel` on the local tensors and wraps its output as a DTensor of
/// global shape `out_shape` and dtype `out_dtype` with the candidate's output placements.
///
/// Every candidate must be correct for the kernel: run on the local pieces of the
/// inputs in the candidate's placements, the kernel must produce the local piece
/// of the output in the candidate's output placements. The all-replicated
/// candidate should always be among them (the fallback when nothing else fits).
///
/// # Errors
/// Inputs on different meshes, no candidate fitting, a failed redistribution, the
/// kernel's error, or a kernel whose output does not have this rank's local shape.
pub fn dispatch(
    op: &'static str,
    inputs: &[&DTensor],
    candidates: &[Candidate],
    out_shape: &[usize],
    out_dtype: DType,
    kernel: impl FnOnce(&[Tensor], &LocalCtx<'_>) -> Result<Tensor>,
) -> Result<DTensor> {
    let mesh = inputs[0].mesh();
    if let Some(other) = inputs.iter().find(|x| !x.mesh().same_as(mesh)) {
        return Err(Error::Placement {
            op,
            detail: format!(
                "inputs live on different meshes ({mesh} and {}); move one first",
                other.mesh()
            ),
        });
    }
    let layouts: SmallVec<[&Layout; 3]> = inputs.iter().map(|x| x.layout()).collect();
    let choice = choose(op, &layouts, candidates)?;
    if choice.cost > 0 {
        log::debug!(
            "{op}: redistributing inputs to {} ({} bytes from rank 0)",
            choice.candidate,
            choice.cost
        );
    }
    let mut locals = Vec::with_capacity(inputs.len());
    let mut after = Vec::with_capacity(inputs.len());
    for (x, p) in inputs.iter().zip(&choice.plans) {
        locals.push(if p.steps.is_empty() {
            x.to_local().clone()
        } else {
            execute(x.to_local(), mesh, p)?
        });
        after.push(p.dst().clone());
    }
    let ctx = LocalCtx {
        inputs: &after,
        coord: mesh.coordinate(),
    };
    let local = kernel(&locals, &ctx)?;
    let out = &choice.candidate.output;
    let layout = Layout::with_order(mesh.shape(), out, ShardOrder::default_for(out), out_shape, out_dtype)?;
    let spec = DTensorSpec::new(mesh, layout)?;
    let want = spec.local_shape();
    if local.shape() != &want[..] || local.dtype() != out_dtype {
        return Err(Error::ShapeMismatch {
            op,
            detail: format!(
                "the local kernel returned {:?} {} on coordinate {:?} but strategy {} needs {:?} {out_dtype} \
                 (a bug in the op's strategy)",
                local.shape(),
                local.dtype(),
                mesh.coordinate(),
                choice.candidate,
                want
            ),
        });
    }
    Ok(DTensor::from_parts(local, spec))
}

/// A candidate list holding only the all-replicated candidate for `n` inputs.
pub(crate) fn replicate_only(n: usize, mesh_ndim: usize) -> Vec<Candidate> {
    let r = crate::Placement::Replicate;
    vec![Candidate {
        inputs: (0..n).map(|_| std::iter::repeat_n(r, mesh_ndim).collect()).collect(),
        output: std::iter::repeat_n(r, mesh_ndim).collect(),
    }]
}
