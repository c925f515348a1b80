//! [`DTensor`]: one global tensor stored as a local tensor on every rank plus a spec.

use std::fmt;
use std::sync::Arc;

use tessera_mesh::{DeviceMesh, ReduceOp};

use tessera_tensor::Error as TensorError;

use crate::redistribute::{self, Plan};
use crate::replicas;
use crate::spec::{DTensorSpec, Layout, PlacementsDisplay};
use crate::{Error, Placement, Result, ShardOrder, Tensor};

/// A distributed tensor: single-device semantics over a [`DeviceMesh`], stored as
/// this rank's local tensor and a [`DTensorSpec`] (placements, shard order, global
/// shape, dtype).
///
/// ```
/// use tessera_dtensor::{distribute_tensor, DType, Placement::*, Tensor};
/// use tessera_mesh::{launch, DeviceMesh};
///
/// launch(4, |ctx| {
///     let mesh = DeviceMesh::new(ctx.into_comm(), &[2, 2])?;
///     let full = Tensor::arange(30, DType::F32)?.reshape(&[5, 6])?;
///     let x = distribute_tensor(&full, &mesh, &[Shard(0), Shard(1)])?;
///     // Rows split 3 + 2, columns 3 + 3.
///     assert_eq!(x.to_local().shape(), if mesh.coordinate()[0] == 0 { &[3, 3] } else { &[2, 3] });
///     let y = x.redistribute(&[Replicate, Shard(0)])?;
///     assert_eq!(y.full_tensor()?, full);
///     Ok(())
/// })
/// .unwrap();
/// ```
///
/// PyTorch: `torch.distributed.tensor.DTensor`.
#[derive(Clone)]
pub struct DTensor {
    local: Tensor,
    spec: DTensorSpec,
    /// The op that last changed the placements on the way to this tensor.
    origin: Option<Arc<LayoutOrigin>>,
}

/// The op that last changed a DTensor's placements (ops that keep them pass
/// it on), and the module that ran it when the rank was recording
/// ([`tessera_mesh::observe`]): what a layout error names, so that a
/// mismatch is blamed on the op that made it rather than on the check that
/// meets it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayoutOrigin {
    /// The op (`"reshape"`, `"redistribute"`, ...).
    pub op: &'static str,
    /// The module that ran it, when known.
    pub module: Option<Arc<str>>,
    /// The placements before it: `(Shard(2))`.
    pub from: String,
}

impl fmt::Display for LayoutOrigin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.op)?;
        if let Some(m) = &self.module {
            write!(f, " in module {}", if m.is_empty() { "(root)" } else { m })?;
        }
        write!(f, " (from {})", self.from)
    }
}

/// Splits rank 0's `full` over `mesh` by `placements`, default shard order: every
/// rank keeps its piece of rank 0's values. Collective: every rank of the mesh
/// must call it (see [`distribute_tensor_from`], of which this is
/// `src_data_rank = Some(0)`).
///
/// A `Partial` placement leaves the full value on coordinate 0 of that mesh dim
/// and the reduction's identity elsewhere (sum, product), or the value
/// everywhere (avg, max, min).
///
/// PyTorch: `torch.distributed.tensor.distribute_tensor` (with its default
/// `src_data_rank=0`).
///
/// # Errors
/// As [`distribute_tensor_from`].
#[track_caller]
pub fn distribute_tensor(full: &Tensor, mesh: &DeviceMesh, placements: &[Placement]) -> Result<DTensor> {
    let _site = tessera_mesh::callsite::enter();
    distribute_tensor_from(full, mesh, placements, Some(0))
}

/// [`distribute_tensor`] with an explicit shard order (rank 0's values; collective).
///
/// # Errors
/// As [`distribute_tensor_with_order_from`].
#[track_caller]
pub fn distribute_tensor_with_order(
    full: &Tensor,
    mesh: &DeviceMesh,
    placements: &[Placement],
    order: ShardOrder,
) -> Result<DTensor> {
    distribute_tensor_with_order_from(full, mesh, placements, order, Some(0))
}

/// Splits `full` over `mesh` by `placements`, default shard order, taking the
/// values of rank `src_data_rank`, or of every rank itself when it is `None`.
///
/// - `Some(r)`: the values are rank `r`'s, where `r` is a position in the
///   mesh's row-major order (a rank of [`DeviceMesh::comm`]). Collective: every
///   rank of the mesh must call it with the same `r`, placements and full
///   tensor shape and dtype. The ranks exchange a hash of their `full` (one
///   all-gather of a few `u64`s per rank); when all agree, each slices its own
///   (no data moves), otherwise rank `r` broadcasts its tensor first.
/// - `None`: every rank trusts its own `full` and keeps its piece; no
///   communication. Ranks holding different "full" tensors then silently hold
///   pieces of different tensors (see [`check_replicas`](crate::check_replicas)).
///   For values every rank computes identically by construction on a hot path.
///
/// A `Partial` placement leaves the full value on coordinate 0 of that mesh dim
/// and the reduction's identity elsewhere (sum, product), or the value
/// everywhere (avg, max, min).
///
/// ```
/// use tessera_dtensor::{distribute_tensor_from, DType, Placement::*, Tensor};
/// use tessera_mesh::{launch, DeviceMesh};
///
/// launch(2, |ctx| {
///     let mesh = DeviceMesh::new(ctx.into_comm(), &[2])?;
///     let mine = Tensor::full(&[4], mesh.rank() as f64, DType::F32)?;
///     let x = distribute_tensor_from(&mine, &mesh, &[Shard(0)], Some(1))?;
///     assert_eq!(x.full_tensor()?.to_vec::<f32>()?, vec![1.0; 4]);
///     Ok(())
/// })
/// .unwrap();
/// ```
///
/// PyTorch: `torch.distributed.tensor.distribute_tensor(tensor, mesh,
/// placements, src_data_rank=...)` (which scatters from the source rather than
/// checking first).
///
/// # Errors
/// Placements that do not fit the mesh or tensor (see [`Layout::with_order`]);
/// with a source rank, [`Error::Distribute`] on every rank for a source that is
/// not a rank of the mesh, or ranks that pass another source, other placements
/// or a full tensor of another shape or dtype than the source's; a
/// communication failure.
#[track_caller]
pub fn distribute_tensor_from(
    full: &Tensor,
    mesh: &DeviceMesh,
    placements: &[Placement],
    src_data_rank: Option<usize>,
) -> Result<DTensor> {
    distribute_tensor_with_order_from(
        full,
        mesh,
        placements,
        ShardOrder::default_for(placements),
        src_data_rank,
    )
}

/// [`distribute_tensor_from`] with an explicit shard order.
///
/// # Errors
/// As [`distribute_tensor_from`], plus an order that does not describe the placements.
#[track_caller]
pub fn distribute_tensor_with_order_from(
    full: &Tensor,
    mesh: &DeviceMesh,
    placements: &[Placement],
    order: ShardOrder,
    src_data_rank: Option<usize>,
) -> Result<DTensor> {
    let _site = tessera_mesh::callsite::enter();
    // With a source, agree first: the checks below then see the same tensor
    // shape on every rank, so they fail on all ranks or none.
    let full = match src_data_rank {
        Some(src) => {
            let args = format!("{} in order {order}", crate::PlacementsDisplay(placements));
            replicas::take_from(full, mesh, &args, src)?
        }
        None => full.clone(),
    };
    let dst = Layout::with_order(mesh.shape(), placements, order, full.shape(), full.dtype())?;
    let replicated = vec![Placement::Replicate; mesh.ndim()];
    let src = Layout::new(mesh.shape(), &replicated, full.shape(), full.dtype())?;
    let plan = redistribute::plan(&src, &dst, mesh.coordinate())?;
    debug_assert_eq!(
        plan.collectives(),
        0,
        "distributing a replicated tensor needs no communication"
    );
    // The piece moves to the mesh's device after it is cut (the whole tensor
    // never goes there).
    let local = redistribute::execute(&full, mesh, &plan)?.to(mesh.device())?;
    Ok(DTensor {
        local,
        spec: DTensorSpec::new(mesh, dst)?,
        origin: None,
    })
}

impl DTensor {
    /// Assembles a DTensor from a local tensor already known to fit `spec`.
    pub(crate) fn from_parts(local: Tensor, spec: DTensorSpec) -> DTensor {
        DTensor {
            local,
            spec,
            origin: None,
        }
    }

    /// This tensor with `origin` as the op that last changed its placements.
    pub(crate) fn with_origin(mut self, origin: Option<Arc<LayoutOrigin>>) -> DTensor {
        self.origin = origin;
        self
    }

    /// The shared origin, for ops that pass it on.
    pub(crate) fn origin(&self) -> Option<Arc<LayoutOrigin>> {
        self.origin.clone()
    }

    /// The op that last changed this tensor's placements, if an op did (see
    /// [`LayoutOrigin`]); `None` for tensors made by distributing or wrapping.
    pub fn layout_origin(&self) -> Option<&LayoutOrigin> {
        self.origin.as_deref()
    }

    /// Wraps this rank's `local` piece of a global tensor of `global_shape`, default
    /// shard order. Not collective; checks that `local` has the shape the spec gives
    /// this rank.
    ///
    /// PyTorch: `DTensor.from_local(..., shape=global_shape)`.
    ///
    /// # Errors
    /// Placements that do not fit, or a local shape that differs from this rank's
    /// piece of `global_shape` (the message names both and the rank's coordinate).
    pub fn from_local(
        local: Tensor,
        mesh: &DeviceMesh,
        placements: &[Placement],
        global_shape: &[usize],
    ) -> Result<DTensor> {
        let layout = Layout::new(mesh.shape(), placements, global_shape, local.dtype())?;
        DTensor::from_local_with_layout(local, mesh, layout)
    }

    /// [`from_local`](Self::from_local) with a full layout (which fixes the shard order and dtype).
    ///
    /// # Errors
    /// As `from_local`, plus a local dtype that is not the layout's.
    pub fn from_local_with_layout(local: Tensor, mesh: &DeviceMesh, layout: Layout) -> Result<DTensor> {
        if local.dtype() != layout.dtype {
            return Err(Error::from(TensorError::DTypeMismatch {
                op: "DTensor::from_local",
                expected: layout.dtype,
                got: local.dtype(),
            }));
        }
        let spec = DTensorSpec::new(mesh, layout)?;
        let want = spec.local_shape();
        if local.shape() != &want[..] {
            return Err(Error::from(TensorError::ShapeMismatch {
                op: "DTensor::from_local",
                detail: format!(
                    "rank at mesh coordinate {:?} holds a local tensor of shape {:?}, but {} gives it {:?}; \
                     pass the global shape the pieces form",
                    mesh.coordinate(),
                    local.shape(),
                    spec,
                    want
                ),
            }));
        }
        Ok(DTensor {
            local,
            spec,
            origin: None,
        })
    }

    /// The value of a one-element DTensor as `f64` (collective when it is
    /// sharded or a pending reduction: every rank gets the value).
    /// PyTorch: `Tensor.item()`.
    ///
    /// # Errors
    /// [`Error::Placement`] for a tensor of more than one element; a failed redistribution.
    pub fn item(&self) -> Result<f64> {
        let n: usize = self.shape().iter().product();
        if n != 1 {
            return Err(Error::Placement {
                op: "item",
                detail: format!(
                    "item() needs one element, but the tensor has shape {:?} ({n} elements)",
                    self.shape()
                ),
            });
        }
        Ok(self.full_tensor()?.to_f64_vec()[0])
    }

    /// This rank's local tensor.
    pub fn to_local(&self) -> &Tensor {
        &self.local
    }

    /// This rank's local elements as a mutable slice, when this DTensor alone
    /// holds its local storage (see [`Tensor::try_as_mut_slice`]); `None`
    /// otherwise. The spec is unchanged: an in-place update of the local piece.
    pub fn try_local_mut_slice<T: tessera_mesh::Element>(&mut self) -> Option<&mut [T]> {
        self.local.try_as_mut_slice()
    }

    /// Runs `f` on this rank's local tensor for an in-place update (a device
    /// optimizer step): the spec is kept, so `f` must leave the local tensor's
    /// shape, dtype and device as they were.
    ///
    /// # Errors
    /// Whatever `f` returns; [`Error::Placement`] when `f` changed the shape,
    /// dtype or device (a bug in `f`: the DTensor must then be dropped).
    pub fn update_local(&mut self, f: impl FnOnce(&mut Tensor) -> Result<()>) -> Result<()> {
        let before = (self.local.shape().to_vec(), self.local.dtype(), self.local.device());
        f(&mut self.local)?;
        let l = &self.local;
        if (l.shape(), l.dtype(), l.device()) != (&before.0[..], before.1, before.2) {
            return Err(Error::Placement {
                op: "update_local",
                detail: format!(
                    "an in-place update turned the local {} {:?} on {} into {} {:?} on {}",
                    before.1,
                    before.0,
                    before.2,
                    l.dtype(),
                    l.shape(),
                    l.device()
                ),
            });
        }
        Ok(())
    }

    /// The spec.
    pub fn spec(&self) -> &DTensorSpec {
        &self.spec
    }

    /// The layout (pure data of the spec).
    pub fn layout(&self) -> &Layout {
        self.spec.layout()
    }

    /// The placements.
    pub fn placements(&self) -> &[Placement] {
        self.spec.placements()
    }

    /// The global shape.
    pub fn shape(&self) -> &[usize] {
        self.spec.shape()
    }

    /// The element type.
    pub fn dtype(&self) -> tessera_mesh::DType {
        self.spec.dtype()
    }

    /// The mesh.
    pub fn mesh(&self) -> &DeviceMesh {
        self.spec.mesh()
    }

    /// The plan that [`redistribute`](Self::redistribute) to `placements` (default
    /// order) would run: steps, collectives and bytes this rank sends. Pure.
    ///
    /// # Errors
    /// As [`redistribute`](Self::redistribute).
    pub fn redistribute_plan(&self, placements: &[Placement]) -> Result<Plan> {
        self.redistribute_plan_with_order(placements, ShardOrder::default_for(placements))
    }

    /// [`redistribute_plan`](Self::redistribute_plan) with an explicit target shard order.
    ///
    /// # Errors
    /// As [`redistribute`](Self::redistribute).
    pub fn redistribute_plan_with_order(&self, placements: &[Placement], order: ShardOrder) -> Result<Plan> {
        let l = self.layout();
        let dst = Layout::with_order(&l.mesh_shape, placements, order, &l.shape, l.dtype)?;
        redistribute::plan(l, &dst, self.mesh().coordinate())
    }

    /// The same global tensor with new placements (default shard order). Collective
    /// along the mesh dims that change.
    ///
    /// PyTorch: `DTensor.redistribute`.
    ///
    /// # Errors
    /// Placements that do not fit, `Shard → Partial`, `Partial(a) → Partial(b)`, or a
    /// communication failure.
    #[track_caller]
    pub fn redistribute(&self, placements: &[Placement]) -> Result<DTensor> {
        let _site = tessera_mesh::callsite::enter();
        self.redistribute_with_order(placements, ShardOrder::default_for(placements))
    }

    /// [`redistribute`](Self::redistribute) to an explicit shard order.
    ///
    /// # Errors
    /// As [`redistribute`](Self::redistribute).
    #[track_caller]
    pub fn redistribute_with_order(&self, placements: &[Placement], order: ShardOrder) -> Result<DTensor> {
        let _site = tessera_mesh::callsite::enter();
        let plan = self.redistribute_plan_with_order(placements, order)?;
        self.run_plan(&plan)
    }

    /// Runs a plan made for this tensor's layout.
    ///
    /// # Errors
    /// A plan made for another layout, or a communication failure.
    #[track_caller]
    pub fn run_plan(&self, plan: &Plan) -> Result<DTensor> {
        let _site = tessera_mesh::callsite::enter().tag(tessera_mesh::callsite::tag_of(&(&plan.src, plan.dst())));
        if &plan.src != self.layout() {
            return Err(Error::Placement {
                op: "DTensor::run_plan",
                detail: format!("the plan starts from {} but the tensor is {}", plan.src, self.layout()),
            });
        }
        let _observed = tessera_mesh::observe::span(tessera_mesh::observe::What::Op("redistribute"));
        let local = redistribute::execute(&self.local, self.mesh(), plan)?;
        let moved = !plan.steps.is_empty() && plan.dst().placements != plan.src.placements;
        let origin = if moved {
            Some(Arc::new(LayoutOrigin {
                op: "redistribute",
                module: tessera_mesh::observe::current_module().map(|(m, _)| m),
                from: PlacementsDisplay(&plan.src.placements).to_string(),
            }))
        } else {
            self.origin.clone()
        };
        let out = DTensor {
            local,
            spec: DTensorSpec::new(self.mesh(), plan.dst().clone())?,
            origin,
        };
        if !plan.steps.is_empty() {
            crate::debug::log_op("redistribute", &[self], &out, true, || {
                vec![crate::debug::moved(0, plan, self.mesh())]
            });
        }
        Ok(out)
    }

    /// The global tensor, on every rank (all_gathers and all_reduces as needed).
    ///
    /// PyTorch: `DTensor.full_tensor`.
    ///
    /// # Errors
    /// A communication failure.
    #[track_caller]
    pub fn full_tensor(&self) -> Result<Tensor> {
        let _site = tessera_mesh::callsite::enter();
        let replicated = vec![Placement::Replicate; self.mesh().ndim()];
        Ok(self.redistribute(&replicated)?.local)
    }

    /// The pending reductions (mesh dim, op).
    pub fn partial_ops(&self) -> Vec<(usize, ReduceOp)> {
        self.layout().partial_ops().collect()
    }
}

/// `f32[2048,256] (Shard(0), Replicate) on mesh(dp=2, tp=4)`: the global
/// tensor, its placements and its mesh (the notation of messages and logs).
impl fmt::Display for DTensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {} on {}",
            tessera_mesh::observe::ShapeDisplay(self.dtype(), self.shape()),
            PlacementsDisplay(self.placements()),
            crate::debug::mesh_string(self.mesh())
        )
    }
}

impl fmt::Debug for DTensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DTensor({self}, local {:?})", self.local.shape())
    }
}

#[cfg(test)]
mod tests {
    use tessera_mesh::{DType, launch};

    use super::*;

    /// `full_tensor` of a DTensor whose spec claims a `[2^40]` f32 global tensor
    /// (4 TiB) over a small local piece: the gather's receive buffer, sized from
    /// the spec, fails with an error on every rank instead of aborting.
    #[test]
    fn item_reduces_and_refuses_many_elements() {
        let out = launch(2, |ctx| {
            let mesh = DeviceMesh::new(ctx.into_comm(), &[2])?;
            let mine = Tensor::full(&[], 1.0 + mesh.rank() as f64, DType::F32)?;
            let partial = DTensor::from_local(mine, &mesh, &[Placement::Partial(ReduceOp::Sum)], &[])?;
            let whole = crate::distribute_tensor(&Tensor::arange(2, DType::F32)?, &mesh, &[Placement::Shard(0)])?;
            Ok((partial.item()?, whole.item().unwrap_err().to_string()))
        })
        .unwrap();
        for (v, e) in out {
            assert_eq!(v, 3.0, "1 + 2 on every rank");
            assert!(e.contains("one element") && e.contains("[2]"), "{e}");
        }
    }

    #[test]
    fn full_tensor_of_a_huge_global_shape_is_an_error() {
        // (On one rank the gather is local: no receive buffer, nothing to allocate.)
        for (ranks, placements) in [(2, [Placement::Shard(0)]), (3, [Placement::Shard(0)])] {
            let msgs = launch(ranks, move |ctx| {
                let mesh = DeviceMesh::new(ctx.into_comm(), &[ranks])?;
                let layout = Layout::new(mesh.shape(), &placements, &[1 << 40], DType::F32)?;
                let spec = DTensorSpec::new(&mesh, layout)?;
                let x = DTensor::from_parts(Tensor::zeros(&[4], DType::F32)?, spec);
                Ok(x.full_tensor().map(|t| t.shape().to_vec()).map_err(|e| e.to_string()))
            })
            .unwrap();
            for msg in msgs {
                let msg = msg.unwrap_err();
                let want = "redistribute: cannot allocate 4398046511104 bytes for a [1099511627776] f32 tensor";
                assert!(msg.starts_with(want), "{ranks} ranks: {msg}");
            }
        }
    }
}
