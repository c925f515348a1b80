//! Redistribution: a pure planner ([`plan`]) and an executor that runs a plan on a
//! rank's local tensor.
//!
//! | from → to (one mesh dim) | collective |
//! |---|---|
//! | `S(d) → R` | all_gather |
//! | `P → R` | all_reduce |
//! | `P → S(d)` | reduce_scatter |
//! | `R → S(d)` | local slice |
//! | `R → P` | local partition |
//! | `S(i) → S(j)` | all_to_all |
//!
//! Uneven shards move through variable-count collectives, so no padding is sent and
//! none is ever visible outside.

mod exec;
mod plan;

pub(crate) use exec::{execute, for_each_row};
pub use plan::{Plan, Step, StepKind, plan};

/// The coordinates of the ranks a step along `mesh_dim` talks to, in the order of
/// that step's communicator: along one mesh dim, or (for `None`) the whole mesh,
/// row-major.
pub(crate) fn group_coords(mesh_shape: &[usize], coord: &[usize], mesh_dim: Option<usize>) -> Vec<Vec<usize>> {
    match mesh_dim {
        Some(m) => (0..mesh_shape[m])
            .map(|k| {
                let mut c = coord.to_vec();
                c[m] = k;
                c
            })
            .collect(),
        None => crate::sharding::mesh_coords(mesh_shape),
    }
}

/// This rank's index in the group of [`group_coords`].
pub(crate) fn group_index(mesh_shape: &[usize], coord: &[usize], mesh_dim: Option<usize>) -> usize {
    match mesh_dim {
        Some(m) => coord[m],
        None => coord.iter().zip(mesh_shape).fold(0, |acc, (&c, &n)| acc * n + c),
    }
}
