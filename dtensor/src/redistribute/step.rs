//! A redistribution plan as a value: its steps, what each does along its group
//! of mesh dims, and the bytes each sends.

use std::fmt;

use tessera_mesh::{OpKind, ReduceOp};

use crate::spec::{Layout, PlacementsDisplay};
use crate::{MeshDims, Result};

/// What one step does along its group of mesh dims.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum StepKind {
    /// `Shard → Replicate` on every member: all_gather over the group.
    AllGather,
    /// `Partial(op) → Shard` on every member: reduce_scatter over the group.
    ReduceScatter {
        /// The pending reduction.
        op: ReduceOp,
    },
    /// `Partial(op) → Replicate` on every member: all_reduce over the group.
    AllReduce {
        /// The pending reduction.
        op: ReduceOp,
    },
    /// `Shard → Shard` (or `Replicate`) on every member, some shard moving to
    /// another tensor dim or position: all_to_all over the group (each element
    /// moves at most once, straight to the ranks that need it).
    AllToAll,
    /// `Replicate → Shard` on one mesh dim: keep this rank's slice, no communication.
    Slice,
    /// `Replicate → Partial(op)` on one mesh dim: the value on one rank and the
    /// reduction's identity elsewhere (sum, product), or the value everywhere (avg,
    /// max, min). No communication.
    Partition {
        /// The reduction made pending.
        op: ReduceOp,
    },
}

impl StepKind {
    /// The collective this step issues on a group of more than one rank, if any.
    pub fn collective(&self) -> Option<OpKind> {
        match self {
            StepKind::AllGather => Some(OpKind::AllGather),
            StepKind::ReduceScatter { .. } => Some(OpKind::ReduceScatter),
            StepKind::AllReduce { .. } => Some(OpKind::AllReduce),
            StepKind::AllToAll => Some(OpKind::AllToAll),
            StepKind::Slice | StepKind::Partition { .. } => None,
        }
    }

    fn name(&self) -> &'static str {
        match self {
            StepKind::AllGather => "all_gather",
            StepKind::ReduceScatter { .. } => "reduce_scatter",
            StepKind::AllReduce { .. } => "all_reduce",
            StepKind::AllToAll => "all_to_all",
            StepKind::Slice => "local slice",
            StepKind::Partition { .. } => "local partition",
        }
    }
}

/// One step of a plan: a change along one mesh dim or a flattened group of them.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Step {
    /// The mesh dims the step works along, in mesh order: one for a per-dim step,
    /// several for a collective over their flattened group (row-major over them),
    /// every mesh dim for the whole mesh.
    pub mesh_dims: MeshDims,
    /// What it does.
    pub kind: StepKind,
    /// The layout after the step.
    pub after: Layout,
    /// Bytes this rank sends in the step (see `tessera_mesh::stats` for the convention).
    pub bytes: u64,
}

impl Step {
    /// Ranks in the step's group: the product of its mesh dims' sizes.
    pub fn group_size(&self) -> usize {
        self.mesh_dims.iter().map(|&m| self.after.mesh_shape[m]).product()
    }

    /// The collective this step issues: its kind's, unless the group has one rank
    /// (nothing moves, so the step is local and synchronizes nothing).
    pub fn collective(&self) -> Option<OpKind> {
        self.kind.collective().filter(|_| self.group_size() > 1)
    }
}

/// A redistribution plan: the steps from `src` to `dst`, in order.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Plan {
    /// The layout redistributed from.
    pub src: Layout,
    /// The steps; empty when the layouts are equal.
    pub steps: Vec<Step>,
}

impl Plan {
    /// Bytes this rank sends over the whole plan, counted as
    /// `tessera_mesh::stats` counts them (what the rank's counters will show):
    /// whole per-rank counts that, summed over the ranks, are exactly the
    /// bytes the planner minimised, uneven splits included.
    pub fn bytes(&self) -> u64 {
        self.steps.iter().map(|s| s.bytes).sum()
    }

    /// Number of collectives the plan issues.
    pub fn collectives(&self) -> usize {
        self.steps.iter().filter(|s| s.collective().is_some()).count()
    }

    /// The layout the plan ends at.
    pub fn dst(&self) -> &Layout {
        self.steps.last().map_or(&self.src, |s| &s.after)
    }

    /// `(before, step)` pairs.
    pub fn transitions(&self) -> impl Iterator<Item = (&Layout, &Step)> {
        let befores = std::iter::once(&self.src).chain(self.steps.iter().map(|s| &s.after));
        befores.zip(&self.steps)
    }
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} -> {}",
            PlacementsDisplay(&self.src.placements),
            PlacementsDisplay(&self.dst().placements)
        )?;
        if self.steps.is_empty() {
            return f.write_str(": nothing to do");
        }
        writeln!(f, " ({} collectives, {} bytes/rank):", self.collectives(), self.bytes())?;
        for (i, (before, s)) in self.transitions().enumerate() {
            let on = match &s.mesh_dims[..] {
                [m] => format!("mesh dim {m}"),
                dims if dims.len() == s.after.mesh_shape.len() => "whole mesh".to_string(),
                dims => format!("mesh dims {dims:?}"),
            };
            write!(
                f,
                "  {}. {} on {on}: {} -> {}, {} bytes",
                i + 1,
                s.kind.name(),
                PlacementsDisplay(&before.placements),
                PlacementsDisplay(&s.after.placements),
                s.bytes
            )?;
            if i + 1 < self.steps.len() {
                writeln!(f)?;
            }
        }
        Ok(())
    }
}

/// Bytes the rank at `coord` sends in one step along `group` (see `tessera_mesh::stats`).
pub(crate) fn step_bytes(
    before: &Layout,
    after: &Layout,
    group: &[usize],
    kind: StepKind,
    coord: &[usize],
) -> Result<u64> {
    let esize = before.dtype.size_in_bytes();
    let n = group.iter().map(|&m| before.mesh_shape[m]).product();
    // The exact per-rank counts of `tessera_mesh::stats`: a group's ranks add
    // up to the bytes the planner's cost charges it, uneven pieces included.
    let bytes = match kind {
        // n−1 copies of its own piece.
        StepKind::AllGather => ((n - 1) * before.region(coord)?.numel() * esize) as u64,
        // The input less its own piece.
        StepKind::ReduceScatter { .. } => {
            ((before.region(coord)?.numel() - after.region(coord)?.numel()) * esize) as u64
        }
        StepKind::AllReduce { .. } => {
            let me = super::group_index(&before.mesh_shape, coord, group);
            OpKind::all_reduce_sent(n, me, before.region(coord)?.numel() * esize)
        }
        StepKind::AllToAll => {
            let mine = before.region(coord)?;
            let me = super::group_index(&before.mesh_shape, coord, group);
            let mut off_rank = 0;
            for (q, peer) in super::group_coords(&before.mesh_shape, coord, group).iter().enumerate() {
                if q != me {
                    off_rank += mine.intersect(&after.region(peer)?).numel();
                }
            }
            (off_rank * esize) as u64
        }
        StepKind::Slice | StepKind::Partition { .. } => 0,
    };
    Ok(bytes)
}
