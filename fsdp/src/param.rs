//! Per-parameter geometry: how FSDP shards one parameter over the data-parallel
//! dims of its mesh, on top of whatever placements it already has on the other
//! dims (tensor parallelism).
//!
//! PyTorch: `_fsdp_param.py` (`FSDPParam`).

use std::rc::Rc;

use tessera_autograd::{Error, Param, Result, Slot};
use tessera_dtensor::sharding::shard_size_and_offset;
use tessera_dtensor::{DTensor, DType, Layout, Placement, PlacementsDisplay, ReduceOp, ShardOrder, Tensor};
use tessera_mesh::DeviceMesh;

use crate::config_error;

/// The data-parallel dims of the parameters' mesh.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct DpDims {
    /// The mesh dim that shards (`Shard(0)`); `None` for a replicated unit
    /// ([`replicate`](crate::replicate)).
    pub(crate) shard: Option<usize>,
    /// The mesh dim that replicates (HSDP), if any.
    pub(crate) replicate: Option<usize>,
}

impl DpDims {
    fn contains(&self, d: usize) -> bool {
        self.shard == Some(d) || self.replicate == Some(d)
    }
}

/// A parameter of a unit: its layout unsharded (what forward sees) and sharded
/// (what it holds between uses), and the slot that holds the unsharded value.
pub(crate) struct FsdpParam {
    pub(crate) param: Param,
    /// The parameter's own placements (tensor parallelism's), `Replicate` on the
    /// data-parallel dims, in the master dtype.
    pub(crate) unsharded: Layout,
    /// `unsharded` with `Shard(0)` on the shard dim, which splits dim 0 last (the
    /// piece tensor parallelism left this rank); `unsharded` itself without a
    /// shard dim.
    pub(crate) sharded: Layout,
    /// Holds the unsharded value while the unit is unsharded.
    pub(crate) slot: Rc<Slot>,
}

impl FsdpParam {
    /// Checks `param` and works out its layouts (the parameter is not changed).
    ///
    /// # Errors
    /// A parameter on another mesh than `mesh`, not replicated on the
    /// data-parallel dims, a scalar, or not floating-point.
    pub(crate) fn new(param: Param, mesh: &DeviceMesh, dims: DpDims) -> Result<FsdpParam> {
        let v = param.value();
        let name = param.name();
        if !v.mesh().same_as(mesh) {
            return Err(config_error(format!(
                "parameter {name} lives on mesh {}, the unit's other parameters on {}; one unit gathers \
                 parameters of one mesh (shard them in separate units)",
                v.mesh(),
                mesh
            )));
        }
        let p = v.placements();
        if let Some(d) = (0..p.len()).find(|&d| dims.contains(d) && !p[d].is_replicate()) {
            let hint = if p[d].is_shard() {
                "is it already sharded by FSDP?"
            } else {
                "reduce it first"
            };
            return Err(config_error(format!(
                "parameter {name} is placed {} on mesh {}; fully_shard needs it replicated on the data-parallel \
                 mesh dim {d} ({hint})",
                PlacementsDisplay(p),
                v.mesh()
            )));
        }
        if let Some(d) = p.iter().position(|pl| pl.is_partial()) {
            return Err(config_error(format!(
                "parameter {name} is placed {}: Partial on mesh dim {d}; a parameter must hold its value \
                 (Shard or Replicate)",
                PlacementsDisplay(p)
            )));
        }
        if v.shape().is_empty() {
            return Err(config_error(format!(
                "parameter {name} is a scalar; FSDP shards dim 0 (reshape it to [1])"
            )));
        }
        if !v.dtype().is_float() {
            return Err(config_error(format!(
                "parameter {name} is {}; FSDP shards floating-point parameters",
                v.dtype()
            )));
        }
        let unsharded = v.layout().clone();
        let sharded = match dims.shard {
            Some(shard) => {
                let mut placements = p.to_vec();
                placements[shard] = Placement::Shard(0);
                let mut chain = unsharded.order.order_of(p, 0);
                chain.push(shard);
                let mut entries: Vec<(usize, Vec<usize>)> = unsharded
                    .order
                    .entries()
                    .filter(|(d, _)| *d != 0)
                    .map(|(d, m)| (d, m.to_vec()))
                    .collect();
                if chain.len() >= 2 {
                    entries.push((0, chain.to_vec()));
                }
                let order = ShardOrder::new(&placements, entries)?;
                Layout::with_order(mesh.shape(), &placements, order, v.shape(), v.dtype())?
            }
            None => unsharded.clone(),
        };
        let slot = Slot::new(name, None);
        Ok(FsdpParam {
            param,
            unsharded,
            sharded,
            slot,
        })
    }

    /// Replaces the parameter's value by this rank's shard (a copy, so the
    /// unsharded value is freed) and clears its gradient. Not collective.
    pub(crate) fn shard(&self, mesh: &DeviceMesh, dims: DpDims) -> Result<()> {
        self.param.set_grad(None);
        let Some(shard) = dims.shard else {
            return Ok(());
        };
        let value = self.param.value();
        let local = value.to_local();
        let rows = local.shape()[0];
        let (len, start) = shard_size_and_offset(rows, mesh.shape()[shard], mesh.coordinate()[shard]);
        let mine = local.narrow(0, start, len)?;
        let mine = Tensor::from_buffer(mine.to_buffer(), mine.shape())?;
        self.param
            .set_value(DTensor::from_local_with_layout(mine, mesh, self.sharded.clone())?);
        Ok(())
    }

    /// Elements of this rank's piece when unsharded (tensor parallelism's local shape).
    pub(crate) fn unsharded_local_numel(&self, coord: &[usize]) -> Result<usize> {
        Ok(self.unsharded.local_shape(coord)?.iter().product())
    }

    /// The placements of a gradient before FSDP reduces it: the unsharded
    /// placements with `Partial(sum)` on the data-parallel dims.
    pub(crate) fn reduce_placements(&self, dims: DpDims) -> Vec<Placement> {
        let mut p = self.unsharded.placements.to_vec();
        for d in dims.shard.into_iter().chain(dims.replicate) {
            p[d] = Placement::Partial(ReduceOp::Sum);
        }
        p
    }

    /// `g`, the gradient of the unsharded parameter (any placements), as this
    /// rank's contribution to the data-parallel sum: placed
    /// [`reduce_placements`](Self::reduce_placements) by `redistribute` (no
    /// communication when it arrives partial or replicated on the data-parallel
    /// dims) and cast to `dtype`.
    ///
    /// # Errors
    /// A gradient of another global shape; a failed redistribution.
    pub(crate) fn contribution(&self, g: &DTensor, dims: DpDims, dtype: DType) -> Result<DTensor> {
        if g.shape() != &self.unsharded.shape[..] {
            return Err(Error::Config {
                op: "fsdp",
                detail: format!(
                    "the gradient of {} has shape {:?}, the parameter {:?}",
                    self.param.name(),
                    g.shape(),
                    &self.unsharded.shape[..]
                ),
            });
        }
        let target = self.reduce_placements(dims);
        let g = if g.placements() == &target[..] && g.layout().order == self.unsharded.order {
            g.clone()
        } else {
            g.redistribute_with_order(&target, self.unsharded.order.clone())?
        };
        if g.dtype() == dtype { Ok(g) } else { Ok(g.cast(dtype)?) }
    }

    /// A zero contribution (for a parameter whose gradient did not arrive).
    pub(crate) fn zero_contribution(&self, mesh: &DeviceMesh, dims: DpDims, dtype: DType) -> Result<DTensor> {
        let placements = self.reduce_placements(dims);
        let layout = Layout::with_order(
            mesh.shape(),
            &placements,
            self.unsharded.order.clone(),
            &self.unsharded.shape,
            dtype,
        )?;
        let local = Tensor::zeros(&layout.local_shape(mesh.coordinate())?, dtype)?;
        Ok(DTensor::from_local_with_layout(local, mesh, layout)?)
    }
}
