//! Operations on [`DTensor`]s, one file per topic (matmul, reduce, attention,
//! norm, embedding, loss, pointwise, shape), each forward beside its backward
//! rules: how an op is sharded has this one home.
//!
//! Every op proposes candidate placements (the strategies of `crate::strategy`),
//! and `dispatch` picks the cheapest, redistributes the inputs to it, runs the
//! local kernel of `tessera_tensor` on the local tensors and wraps the result
//! with the candidate's output placements. Other crates define ops of their own
//! through [`DTensor::binary`], [`DTensor::unary`] and [`DTensor::replicated_op`].

mod attention;
mod embedding;
mod loss;
mod matmul;
mod norm;
mod pointwise;
mod reduce;
mod select;
mod shape;

pub use pointwise::broadcast_shape;

use smallvec::SmallVec;
use tessera_mesh::{DType, DeviceMesh};

use tessera_tensor::Error as TensorError;

use crate::redistribute::execute;
use crate::spec::{DTensorSpec, Layout};
use crate::strategy::{Candidate, Candidates, choose};
use crate::{DTensor, Error, Placement, Result, ShardOrder, Tensor};

/// What a local kernel may need to know about where its pieces sit.
pub(crate) struct LocalCtx<'a> {
    /// The inputs' layouts after redistribution (what the local tensors are pieces of).
    pub(crate) inputs: &'a [Layout],
    /// This rank's mesh coordinate.
    pub(crate) coord: &'a [usize],
}

impl LocalCtx<'_> {
    /// The global offset of this rank's piece of input `i`.
    ///
    /// # Errors
    /// Never for a valid context (the layouts were validated).
    pub(crate) fn offset(&self, i: usize) -> Result<Vec<usize>> {
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
pub(crate) fn dispatch(
    op: &'static str,
    inputs: &[&DTensor],
    candidates: &Candidates,
    out_shape: &[usize],
    out_dtype: DType,
    kernel: impl FnOnce(&[Tensor], &LocalCtx<'_>) -> Result<Tensor>,
) -> Result<DTensor> {
    let mesh = common_mesh(op, inputs)?;
    // The op, its redistributions and its kernel, for a recording rank.
    let _observed = tessera_mesh::observe::span(tessera_mesh::observe::What::Op(op));
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
    // Every rank makes the same choice, so every rank refuses alike, before
    // any input moves.
    for (i, p) in choice.plans.iter().enumerate().filter(|(_, p)| !p.steps.is_empty()) {
        crate::explicit::check_implicit(op, i, p)?;
    }
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
    let local = {
        let _t = tessera_tensor::profile::op_scope(op);
        kernel(&locals, &ctx)?
    };
    if tessera_mesh::observe::active() {
        tessera_mesh::observe::memory(tessera_tensor::memory::stats().current_bytes as u64);
    }
    let out = &choice.candidate.output;
    let layout = Layout::with_order(mesh.shape(), out, ShardOrder::default_for(out), out_shape, out_dtype)?;
    let spec = DTensorSpec::new(mesh, layout)?;
    check_local_output(op, &local, &spec, &choice.candidate)?;
    let origin = layout_origin(op, inputs[0], out);
    let out = DTensor::from_parts(local, spec).with_origin(origin);
    crate::debug::log_op(op, inputs, &out, false, || {
        choice
            .plans
            .iter()
            .enumerate()
            .filter(|(_, p)| !p.steps.is_empty())
            .map(|(i, p)| crate::debug::moved(i, p, mesh))
            .collect()
    });
    Ok(out)
}

/// The mesh every input lives on.
///
/// # Errors
/// Inputs on different meshes, naming what tells them apart.
fn common_mesh<'a>(op: &'static str, inputs: &[&'a DTensor]) -> Result<&'a DeviceMesh> {
    let mesh = inputs[0].mesh();
    if let Some(i) = inputs.iter().position(|x| !x.mesh().same_as(mesh)) {
        let other = inputs[i].mesh();
        return Err(Error::Placement {
            op,
            detail: format!(
                "inputs live on different meshes: input 0 is on {mesh} and input {i} on {other}, which {}; \
                 distribute both inputs on one mesh (clones of one DeviceMesh)",
                mesh_difference(mesh, other)
            ),
        });
    }
    Ok(mesh)
}

/// Checks that a kernel returned this rank's piece of the output `spec`
/// describes (a wrong shape or dtype is a bug in the op's strategy).
///
/// # Errors
/// A local output of another shape or dtype than `spec`'s.
fn check_local_output(op: &'static str, local: &Tensor, spec: &DTensorSpec, candidate: &Candidate) -> Result<()> {
    let want = spec.local_shape();
    let out_dtype = spec.layout().dtype;
    if local.shape() == &want[..] && local.dtype() == out_dtype {
        return Ok(());
    }
    Err(Error::from(TensorError::ShapeMismatch {
        op,
        detail: format!(
            "the local kernel returned {:?} {} on coordinate {:?} but strategy {candidate} needs {:?} {out_dtype} \
             (a bug in the op's strategy)",
            local.shape(),
            local.dtype(),
            spec.mesh().coordinate(),
            want
        ),
    }))
}

/// The op that last changed the placements, for layout errors to name: `op`
/// if its output placements `out` differ from its first input's, else that
/// input's own origin.
fn layout_origin(op: &'static str, first: &DTensor, out: &[Placement]) -> Option<std::sync::Arc<crate::LayoutOrigin>> {
    if out[..] != first.placements()[..] {
        Some(std::sync::Arc::new(crate::LayoutOrigin {
            op,
            module: tessera_mesh::observe::current_module().map(|(m, _)| m),
            from: crate::PlacementsDisplay(first.placements()).to_string(),
        }))
    } else {
        first.origin()
    }
}

/// What tells two meshes apart (their `Display` may be identical): the shapes,
/// dim names, ranks or communicators that differ.
fn mesh_difference(a: &DeviceMesh, b: &DeviceMesh) -> String {
    let mut parts = Vec::new();
    if a.names() != b.names() {
        parts.push(format!("dim names {:?} and {:?}", a.names(), b.names()));
    }
    if a.ranks() != b.ranks() {
        parts.push(format!("ranks {:?} and {:?}", a.ranks(), b.ranks()));
    }
    if a.comm_id() != b.comm_id() {
        parts.push(format!(
            "communicators (#{} and #{}; every DeviceMesh::new, split or flatten builds a new one)",
            a.comm_id(),
            b.comm_id()
        ));
    }
    if a.shape() != b.shape() {
        parts.insert(0, format!("shapes {:?} and {:?}", a.shape(), b.shape()));
        return format!("have different {}", parts.join(", "));
    }
    if parts.is_empty() {
        // `same_as` compares nothing else; kept in case it ever does.
        parts.push("constructions".into());
    }
    format!("have the same shape {:?} but different {}", a.shape(), parts.join(", "))
}

/// A candidate list holding only the all-replicated candidate for `n` inputs.
pub(crate) fn replicate_only(n: usize, mesh_ndim: usize) -> Candidates {
    let r = crate::Placement::Replicate;
    Candidates::of(vec![Candidate {
        inputs: (0..n).map(|_| std::iter::repeat_n(r, mesh_ndim).collect()).collect(),
        output: std::iter::repeat_n(r, mesh_ndim).collect(),
    }])
}

impl DTensor {
    /// All candidates replicated: run the local kernel on full tensors (the fallback).
    ///
    /// # Errors
    /// As the kernel.
    pub fn replicated_op(
        op: &'static str,
        inputs: &[&DTensor],
        out_shape: &[usize],
        out_dtype: DType,
        kernel: impl FnOnce(&[Tensor]) -> Result<Tensor>,
    ) -> Result<DTensor> {
        let cands = replicate_only(inputs.len(), inputs[0].mesh().ndim());
        log::debug!("{op}: no sharding strategy, replicating its inputs");
        dispatch(op, inputs, &cands, out_shape, out_dtype, |l, _| kernel(l))
    }
}

/// Errors unless every input has the first one's dtype.
pub(super) fn same_dtypes(op: &'static str, inputs: &[&DTensor]) -> Result<()> {
    let expected = inputs[0].dtype();
    match inputs.iter().find(|x| x.dtype() != expected) {
        Some(x) => Err(Error::from(TensorError::DTypeMismatch {
            op,
            expected,
            got: x.dtype(),
        })),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use tessera_mesh::launch;

    use crate::{DType, Placement, Tensor, distribute_tensor};

    /// Meshes whose `Display` is identical (same shape and coordinate) are told
    /// apart in the error by what differs: here, the communicator.
    #[test]
    fn different_meshes_name_what_differs() {
        let msgs = launch(3, move |ctx| {
            let mesh = super::DeviceMesh::new(ctx.into_comm(), &[3])?;
            let split = super::DeviceMesh::new(mesh.comm().split(0, mesh.comm().rank() as u32)?, &[3])?;
            assert_eq!(mesh.clone().comm_id(), mesh.comm_id(), "clones share the id");
            assert_eq!(mesh.dim(0)?.comm_id(), mesh.dim(0)?.comm_id(), "one dim, one id");
            assert_ne!(split.comm_id(), mesh.comm_id());
            let x = Tensor::ones(&[3, 2], DType::F32)?;
            let a = distribute_tensor(&x, &mesh, &[Placement::Shard(0)])?;
            let b = distribute_tensor(&x, &split, &[Placement::Shard(0)])?;
            let same_shape = a.add(&b).unwrap_err().to_string();
            let want = format!(
                "add: invalid placements: inputs live on different meshes: input 0 is on {mesh} and input 1 on \
                 {split}, which have the same shape [3] but different communicators (#{} and #{}; \
                 every DeviceMesh::new, split or flatten builds a new one)",
                mesh.comm_id(),
                split.comm_id()
            );
            assert!(same_shape.starts_with(&want), "{same_shape}\nlacks {want}");
            Ok(same_shape)
        })
        .unwrap();
        // The two descriptions are identical, which is why the difference is spelled out.
        assert!(msgs[0].contains("on DeviceMesh([3], coord [0]) and input 1 on DeviceMesh([3], coord [0])"));
        // Meshes along the two dims of a 2×2 mesh: ranks and communicators differ.
        let msgs = launch(4, move |ctx| {
            let mesh = super::DeviceMesh::new(ctx.into_comm(), &[2, 2])?;
            let x = Tensor::ones(&[2], DType::F32)?;
            let a = distribute_tensor(&x, &mesh.dim(0)?, &[Placement::Replicate])?;
            let b = distribute_tensor(&x, &mesh.dim(1)?, &[Placement::Replicate])?;
            Ok(a.mul(&b).unwrap_err().to_string())
        })
        .unwrap();
        assert!(
            msgs[0].contains("have the same shape [2] but different ranks [0, 2] and [0, 1], communicators (#"),
            "{}",
            msgs[0]
        );
        assert!(msgs[3].contains("ranks [1, 3] and [2, 3]"), "{}", msgs[3]);
    }
}
