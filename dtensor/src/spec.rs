//! [`Layout`] (how a global tensor is split, as pure data) and [`DTensorSpec`]
//! (a layout on a concrete mesh).

use std::fmt;

use smallvec::SmallVec;
use tessera_mesh::observe::ShapeDisplay;
use tessera_mesh::{DType, DeviceMesh};

use crate::sharding::local_shape_and_offset;
use crate::{Error, MeshDims, Placement, ReduceOp, Result, ShardOrder, validate_placements};

/// Placements, one per mesh dim.
pub type Placements = SmallVec<[Placement; 4]>;

/// Everything about how a global tensor is laid out over a mesh, without the
/// mesh's communicators: pure data, cheap to compare and hash, what the
/// redistribute planner works on.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Layout {
    /// The mesh shape.
    pub mesh_shape: MeshDims,
    /// One placement per mesh dim.
    pub placements: Placements,
    /// The order in which mesh dims split a tensor dim that several of them shard.
    pub order: ShardOrder,
    /// The global shape.
    pub shape: MeshDims,
    /// The element type.
    pub dtype: DType,
}

/// A box of the global tensor: per dim, an offset and a length.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Region {
    pub(crate) offset: Vec<usize>,
    pub(crate) shape: Vec<usize>,
}

impl Region {
    pub(crate) fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The intersection with `other` (empty when they do not overlap).
    pub(crate) fn intersect(&self, other: &Region) -> Region {
        let mut offset = Vec::with_capacity(self.shape.len());
        let mut shape = Vec::with_capacity(self.shape.len());
        for d in 0..self.shape.len() {
            let lo = self.offset[d].max(other.offset[d]);
            let hi = (self.offset[d] + self.shape[d]).min(other.offset[d] + other.shape[d]);
            offset.push(lo);
            shape.push(hi.saturating_sub(lo));
        }
        Region { offset, shape }
    }

    /// This region's offset relative to `outer`'s origin (which must contain it).
    pub(crate) fn relative_to(&self, outer: &Region) -> Vec<usize> {
        self.offset
            .iter()
            .zip(&outer.offset)
            .map(|(a, b)| a.saturating_sub(*b))
            .collect()
    }
}

impl Layout {
    /// A validated layout with the default shard order.
    ///
    /// # Errors
    /// As [`Layout::with_order`].
    pub fn new(mesh_shape: &[usize], placements: &[Placement], shape: &[usize], dtype: DType) -> Result<Layout> {
        Layout::with_order(
            mesh_shape,
            placements,
            ShardOrder::default_for(placements),
            shape,
            dtype,
        )
    }

    /// A validated layout with an explicit shard order.
    ///
    /// # Errors
    /// [`Error::Placement`] when the placements do not match the mesh (one per mesh
    /// dim), shard a dim past the tensor's rank, carry a reduction the dtype has not
    /// (`Partial(avg)` on integers, any `Partial` on raw bytes), or `order` does not
    /// describe them, or mix pending reductions that do not commute (sum and avg mix;
    /// max, min and product only with themselves).
    pub fn with_order(
        mesh_shape: &[usize],
        placements: &[Placement],
        order: ShardOrder,
        shape: &[usize],
        dtype: DType,
    ) -> Result<Layout> {
        validate_placements(placements, shape.len(), mesh_shape.len())?;
        order.validate_for(placements)?;
        for (m, p) in placements.iter().enumerate() {
            if let Placement::Partial(op) = p {
                op.check("placements", dtype).map_err(|e| Error::Placement {
                    op: "Layout",
                    detail: format!("placement {m} is {p}: {e}"),
                })?;
            }
        }
        let ops: SmallVec<[ReduceOp; 4]> = placements.iter().filter_map(|p| p.reduce_op()).collect();
        let linear = |op: &ReduceOp| matches!(op, ReduceOp::Sum | ReduceOp::Avg);
        if !(ops.iter().all(linear) || ops.windows(2).all(|w| w[0] == w[1])) {
            return Err(Error::Placement {
                op: "Layout",
                detail: format!(
                    "{} mixes pending reductions that do not commute (the global value would depend on \
                     which mesh dim is reduced first); reduce one of them before adding the other",
                    PlacementsDisplay(placements)
                ),
            });
        }
        if mesh_shape.contains(&0) {
            return Err(Error::Placement {
                op: "Layout",
                detail: format!("mesh shape {mesh_shape:?} has a dim of size 0"),
            });
        }
        Ok(Layout {
            mesh_shape: mesh_shape.into(),
            placements: placements.into(),
            order,
            shape: shape.into(),
            dtype,
        })
    }

    /// The region of the global tensor that the rank at `coord` holds: `(offset, shape)`.
    ///
    /// # Errors
    /// A coordinate outside the mesh.
    pub fn local_region(&self, coord: &[usize]) -> Result<(Vec<usize>, Vec<usize>)> {
        local_shape_and_offset(&self.shape, &self.mesh_shape, &self.placements, &self.order, coord)
            .map(|(shape, offset)| (offset, shape))
    }

    pub(crate) fn region(&self, coord: &[usize]) -> Result<Region> {
        let (offset, shape) = self.local_region(coord)?;
        Ok(Region { offset, shape })
    }

    /// The shape of the local tensor at `coord`.
    ///
    /// # Errors
    /// A coordinate outside the mesh.
    pub fn local_shape(&self, coord: &[usize]) -> Result<Vec<usize>> {
        Ok(self.region(coord)?.shape)
    }

    /// Whether any mesh dim holds a pending reduction.
    pub fn has_partial(&self) -> bool {
        self.placements.iter().any(|p| p.is_partial())
    }

    /// The reductions pending on each mesh dim.
    pub fn partial_ops(&self) -> impl Iterator<Item = (usize, ReduceOp)> + '_ {
        self.placements
            .iter()
            .enumerate()
            .filter_map(|(m, p)| p.reduce_op().map(|op| (m, op)))
    }
}

/// Formats placements, one per mesh dim, in the one notation messages, logs
/// and descriptions use: `(Shard(0), Replicate, Partial(sum))`.
pub struct PlacementsDisplay<'a>(pub &'a [Placement]);

impl fmt::Display for PlacementsDisplay<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("(")?;
        for (i, p) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{p}")?;
        }
        f.write_str(")")
    }
}

/// `f32[2048,256] (Shard(0), Replicate) on mesh(2, 4)`, with the shard order
/// when it is not the default.
impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {}",
            ShapeDisplay(self.dtype, &self.shape),
            PlacementsDisplay(&self.placements)
        )?;
        if !self.order.is_default() {
            write!(f, " order {}", self.order)?;
        }
        let dims: Vec<String> = self.mesh_shape.iter().map(usize::to_string).collect();
        write!(f, " on mesh({})", dims.join(", "))
    }
}

/// A layout on a concrete mesh: what a [`DTensor`](crate::DTensor) carries besides its local tensor.
///
/// PyTorch: `torch.distributed.tensor._dtensor_spec.DTensorSpec`.
#[derive(Clone, Debug)]
pub struct DTensorSpec {
    mesh: DeviceMesh,
    layout: Layout,
}

impl DTensorSpec {
    /// A spec from a mesh and a layout whose mesh shape must match it.
    ///
    /// # Errors
    /// [`Error::Placement`] when the layout's mesh shape is not the mesh's.
    pub fn new(mesh: &DeviceMesh, layout: Layout) -> Result<DTensorSpec> {
        if mesh.shape() != &layout.mesh_shape[..] {
            return Err(Error::Placement {
                op: "DTensorSpec",
                detail: format!(
                    "the layout is for a mesh of shape {:?} but the mesh is {:?}",
                    &layout.mesh_shape[..],
                    mesh.shape()
                ),
            });
        }
        Ok(DTensorSpec {
            mesh: mesh.clone(),
            layout,
        })
    }

    /// The mesh.
    pub fn mesh(&self) -> &DeviceMesh {
        &self.mesh
    }
    /// The layout (placements, order, global shape, dtype).
    pub fn layout(&self) -> &Layout {
        &self.layout
    }
    /// One placement per mesh dim.
    pub fn placements(&self) -> &[Placement] {
        &self.layout.placements
    }
    /// The shard order.
    pub fn order(&self) -> &ShardOrder {
        &self.layout.order
    }
    /// The global shape.
    pub fn shape(&self) -> &[usize] {
        &self.layout.shape
    }
    /// The element type.
    pub fn dtype(&self) -> DType {
        self.layout.dtype
    }
    /// The shape of this rank's local tensor.
    pub fn local_shape(&self) -> Vec<usize> {
        // INVARIANT: the layout was validated against this mesh, whose coordinate is in range.
        self.layout
            .local_shape(self.mesh.coordinate())
            .expect("validated layout")
    }
}

impl fmt::Display for DTensorSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.layout, f)
    }
}
