//! Per-parameter geometry: how FSDP shards one parameter over the data-parallel
//! dims of its mesh, on top of whatever placements it already has on the other
//! dims (tensor parallelism).
//!
//! PyTorch: `_fsdp_param.py` (`FSDPParam`).

use std::rc::Rc;

use tessera_autograd::Param;
use tessera_dtensor::sharding::shard_size_and_offset;
use tessera_dtensor::{DTensor, DType, Layout, Placement, PlacementsDisplay, ReduceOp, ShardOrder, Tensor};
use tessera_mesh::DeviceMesh;

use crate::error::{Error, Result};
use crate::slot::Slot;

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

/// Checks that a parameter placed `p` on `param_mesh` can be sharded over the
/// data-parallel `dims`: replicated on them, and partial on no dim.
///
/// # Errors
/// The placement that is not, with what to do instead.
fn check_placements(name: &str, p: &[Placement], param_mesh: &DeviceMesh, dims: DpDims) -> Result<()> {
    if let Some(d) = (0..p.len()).find(|&d| dims.contains(d) && !p[d].is_replicate()) {
        let hint = if p[d].is_shard() {
            let named = param_mesh
                .names()
                .get(d)
                .map_or(String::new(), |n| format!(" (\"{n}\")"));
            format!(
                "mesh dim {d}{named} shards it already, as tensor parallelism does on its dim: fully_shard \
                 over the data-parallel dims only (mesh.slice(&[\"dp\"]) or FsdpConfig::shard_dim), or \
                 distribute the parameter replicated on them"
            )
        } else {
            "reduce it first".to_string()
        };
        return Err(Error::param(
            name,
            format!(
                "is placed {} on mesh {}; fully_shard needs it replicated on the data-parallel mesh dim {d} \
                 ({hint})",
                PlacementsDisplay(p),
                param_mesh
            ),
        ));
    }
    if let Some(d) = p.iter().position(|pl| pl.is_partial()) {
        return Err(Error::param(
            name,
            format!(
                "is placed {}: Partial on mesh dim {d}; a parameter must hold its value (Shard or Replicate)",
                PlacementsDisplay(p)
            ),
        ));
    }
    Ok(())
}

impl FsdpParam {
    /// Checks `param` and works out its layouts (the parameter is not changed).
    ///
    /// # Errors
    /// A parameter on another mesh than `mesh`, not replicated on the
    /// data-parallel dims, a scalar, or not floating-point.
    pub(crate) fn new(param: Param, mesh: &DeviceMesh, dims: DpDims) -> Result<FsdpParam> {
        let (layout, param_mesh) = (param.layout(), param.mesh());
        let name = &param.name();
        if !param_mesh.same_as(mesh) {
            return Err(Error::param(
                name,
                format!(
                    "lives on mesh {}, the unit's other parameters on {}; one unit gathers parameters of one \
                     mesh (shard them in separate units)",
                    param_mesh, mesh
                ),
            ));
        }
        let p = &layout.placements.clone()[..];
        check_placements(name, p, &param_mesh, dims)?;
        if layout.shape.is_empty() {
            return Err(Error::param(name, "is a scalar; FSDP shards dim 0 (reshape it to [1])"));
        }
        if !layout.dtype.is_float() {
            return Err(Error::param(
                name,
                format!("is {}; FSDP shards floating-point parameters", layout.dtype),
            ));
        }
        let unsharded = layout;
        let sharded = match dims.shard {
            Some(shard) => {
                let mut placements = p.to_vec();
                placements[shard] = Placement::Shard(0);
                let mut chain = unsharded.order.order_of(p, 0);
                chain.push(shard);
                let order = unsharded.order.with_chain(&placements, 0, &chain)?;
                Layout::with_order(
                    mesh.shape(),
                    &placements,
                    order,
                    &unsharded.shape.clone(),
                    unsharded.dtype,
                )?
            }
            None => unsharded.clone(),
        };
        let slot = Slot::new(&param);
        Ok(FsdpParam {
            param,
            unsharded,
            sharded,
            slot,
        })
    }

    /// Replaces the parameter's value by this rank's shard (a copy, so the
    /// unsharded value is freed) and clears its gradient; a deferred parameter
    /// only takes the sharded layout. Not collective.
    pub(crate) fn shard(&self, mesh: &DeviceMesh, dims: DpDims) -> Result<()> {
        self.param.set_grad(None);
        let Some(shard) = dims.shard else {
            return Ok(());
        };
        if self.param.is_deferred() {
            self.param.place(self.sharded.clone())?;
            return Ok(());
        }
        let value = self.param.value()?;
        let mine = rows_of(value.to_local(), mesh.shape()[shard], mesh.coordinate()[shard])?;
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
            return Err(Error::param(
                &self.param.name(),
                format!(
                    "its gradient has shape {:?}, the parameter {:?}",
                    g.shape(),
                    &self.unsharded.shape[..]
                ),
            ));
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

/// The smaller groups a unit reshards to after forward (hpZ): the parameters'
/// mesh with the shard dim split into `[outer, inner]`, `inner` ranks of the
/// shard dim (consecutive ones) holding the parameters between them.
pub(crate) struct Regroup {
    /// The parameters' mesh with the shard dim unflattened.
    pub(crate) mesh: DeviceMesh,
    /// The inner dim's index in `mesh` (the outer one is right before it).
    pub(crate) inner: usize,
    /// Per parameter: the layout of its post-forward piece.
    pub(crate) layouts: Vec<Layout>,
}

impl Regroup {
    /// Groups of `size` ranks of the shard dim for `params`, pieces in `dtype`.
    /// Collective over `mesh`.
    ///
    /// # Errors
    /// A size that does not divide the shard dim, a unit without a shard dim, a
    /// failed split.
    pub(crate) fn new(
        mesh: &DeviceMesh,
        dims: DpDims,
        size: usize,
        params: &[FsdpParam],
        dtype: DType,
    ) -> Result<Regroup> {
        let Some(shard) = dims.shard else {
            return Err(Error::mesh(
                mesh,
                "reshard_after_forward_to needs a shard dim (a replicated unit has nothing to reshard)",
            ));
        };
        let world = mesh.shape()[shard];
        if size == 0 || !world.is_multiple_of(size) {
            return Err(Error::mesh(
                mesh,
                format!("reshard_after_forward_to is {size}; it must divide the {world} ranks of the shard dim"),
            ));
        }
        let names: Vec<String> = if mesh.names().is_empty() {
            Vec::new()
        } else {
            let base = &mesh.names()[shard];
            vec![format!("{base}_outer"), format!("{base}_inner")]
        };
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        let regrouped = mesh.unflatten(shard, &[world / size, size], &names)?;
        let inner = shard + 1;
        let at = |d: usize| if d > shard { d + 1 } else { d };
        let mut layouts = Vec::with_capacity(params.len());
        for p in params {
            let u = &p.unsharded;
            let mut placements = Vec::with_capacity(u.placements.len() + 1);
            for (d, pl) in u.placements.iter().enumerate() {
                if d == shard {
                    placements.extend([Placement::Replicate, Placement::Shard(0)]);
                } else {
                    placements.push(*pl);
                }
            }
            let mut entries: Vec<(usize, Vec<usize>)> = u
                .order
                .entries()
                .filter(|(d, _)| *d != 0)
                .map(|(d, m)| (d, m.iter().map(|&x| at(x)).collect()))
                .collect();
            let mut chain: Vec<usize> = u.order.order_of(&u.placements, 0).iter().map(|&x| at(x)).collect();
            chain.push(inner);
            if chain.len() >= 2 {
                entries.push((0, chain));
            }
            let order = ShardOrder::new(&placements, entries)?;
            layouts.push(Layout::with_order(
                regrouped.shape(),
                &placements,
                order,
                &u.shape,
                dtype,
            )?);
        }
        Ok(Regroup {
            mesh: regrouped,
            inner,
            layouts,
        })
    }

    /// The post-forward piece of the unsharded value `v` of parameter `i`: the
    /// rows of its local tensor this rank keeps in its group (a copy).
    pub(crate) fn piece(&self, i: usize, v: &DTensor) -> Result<DTensor> {
        let (n, k) = (self.mesh.shape()[self.inner], self.mesh.coordinate()[self.inner]);
        let mine = rows_of(v.to_local(), n, k)?;
        Ok(DTensor::from_local_with_layout(
            mine,
            &self.mesh,
            self.layouts[i].clone(),
        )?)
    }
}

/// Piece `k` of `n` of `local`'s dim 0 (torch.chunk's split), as a copy, so that
/// dropping `local` frees the rest.
fn rows_of(local: &Tensor, n: usize, k: usize) -> Result<Tensor> {
    let (len, start) = shard_size_and_offset(local.shape()[0], n, k);
    let mine = local.narrow(0, start, len)?;
    if mine.is_meta() {
        // A planning run: the piece's bytes are charged, nothing is copied.
        return Ok(Tensor::meta(mine.shape(), mine.dtype())?);
    }
    Ok(Tensor::from_buffer(mine.to_buffer(), mine.shape())?)
}
