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
//! A step may also work along several mesh dims at once, as one collective over
//! their flattened group (see [`plan`]).
//!
//! Uneven shards move through variable-count collectives, so no padding is sent and
//! none is ever visible outside.

mod exec;
mod plan;
mod region_runs;
mod search;
mod step;

#[cfg(any(test, feature = "testing"))]
pub use crate::tensor_comm::with_tensor_path;
pub(crate) use exec::{execute, for_each_run};
pub use plan::plan;
pub use region_runs::for_each_region_run;
pub use step::{Plan, Step, StepKind};

/// The coordinates of the ranks a step along the mesh dims `group` talks to, in
/// the order of that group's communicator: row-major over the group's dims, the
/// other coordinates this rank's.
pub(crate) fn group_coords(mesh_shape: &[usize], coord: &[usize], group: &[usize]) -> Vec<Vec<usize>> {
    let sizes: Vec<usize> = group.iter().map(|&m| mesh_shape[m]).collect();
    crate::sharding::mesh_coords(&sizes)
        .into_iter()
        .map(|sub| {
            let mut c = coord.to_vec();
            for (&m, v) in group.iter().zip(sub) {
                c[m] = v;
            }
            c
        })
        .collect()
}

/// This rank's index in the group of [`group_coords`].
pub(crate) fn group_index(mesh_shape: &[usize], coord: &[usize], group: &[usize]) -> usize {
    group.iter().fold(0, |acc, &m| acc * mesh_shape[m] + coord[m])
}
