//! The redistribute planner: a pure function from two layouts to the cheapest list
//! of steps that turns one into the other.
//!
//! A layout, for planning, is its placements plus, per tensor dim, the stack of
//! mesh dims that split it (outermost first). A step works along a *group* of mesh
//! dims: one mesh dim, or several at once as one flattened communicator (all of
//! them: the whole mesh). The steps a group can take, with every member changing:
//!
//! | members before → after | step | communication |
//! |---|---|---|
//! | `R → S(d)` (one dim) | local slice | none |
//! | `R → P` (one dim) | local partition | none |
//! | all `P(op) → R` | all_reduce over the group | `2(n−1)/n` of the data |
//! | all `P(op) → S(..)` | reduce_scatter over the group | `(n−1)/n` of the data |
//! | all `S(..) → R` | all_gather over the group | `(n−1)/n` of the result |
//! | all `S(..) → S(..)` or `R` | all_to_all over the group | what leaves each rank |
//!
//! A member leaves a stack only from its top (a split with other splits inside it
//! cannot change without them) and enters on top. A collective over several mesh
//! dims replaces a run of per-dim ones when that moves fewer bytes (`[P, R, P] →
//! [R, R, R]` is one all_reduce over dims 0 and 2: `2(N−1)/N` of the data rather
//! than `Σ 2(nᵢ−1)/nᵢ`) or the same bytes in fewer collectives.
//!
//! The planner is Dijkstra's search over those steps, minimizing, in order: the
//! bytes all ranks send together (the stats convention of `tessera_mesh`, summed
//! over the mesh; exact with uneven shards), the number of collectives, then the
//! number of steps. Every rank plans the same steps (the cost does not depend on
//! the rank); each rank's [`Step::bytes`](super::Step::bytes) are its own. The exhaustive oracle in
//! `tessera_dtensor::testing::oracle` checks on every pair of layouts of small
//! meshes that no sequence of such steps moves fewer bytes, or the same bytes in
//! fewer collectives. The search from a source grows only as far as the targets
//! asked of it need (states settle in cost order), and is kept per process and
//! shared by every shape alike up to evenly split dims; routes are cached by
//! (source, target), so rank threads planning the same pair search once.
//!
//! PyTorch: `torch.distributed.tensor._redistribute` (whose planner is greedy per
//! mesh dim, with no flattened-group steps).

use super::search::{Route, find_route};
use super::step::{Plan, Step, step_bytes};
use crate::memo::Memo;
use crate::spec::Layout;
use crate::{Error, Placement, Result};

/// Routes found, by (source, target) layout, shared by every rank thread of the
/// process (they plan the same pairs; at most 4096).
static ROUTES: Memo<(Layout, Layout), Route> = Memo::new(4096);

/// Plans the redistribution from `src` to `dst`, reporting the bytes that the rank at
/// `coord` sends.
///
/// # Errors
/// [`Error::Placement`] when the layouts differ in mesh shape, global shape or dtype,
/// or a mesh dim goes from `Shard` to `Partial` or between two different `Partial`s
/// (neither has a meaning: a shard is not a pending sum, and pending reductions
/// cannot be converted without reducing).
pub fn plan(src: &Layout, dst: &Layout, coord: &[usize]) -> Result<Plan> {
    check(src, dst)?;
    let key = (src.clone(), dst.clone());
    let route = match ROUTES.get(&key) {
        Some(route) => route,
        None => {
            let route = find_route(src, dst)?;
            ROUTES.with_room().insert(key, route.clone());
            route
        }
    };

    let mut steps = Vec::with_capacity(route.len());
    let mut before = src;
    for (group, kind, after) in route.iter() {
        let bytes = step_bytes(before, after, group, *kind, coord)?;
        steps.push(Step {
            mesh_dims: group.clone(),
            kind: *kind,
            after: after.clone(),
            bytes,
        });
        before = after;
    }
    Ok(Plan {
        src: src.clone(),
        steps,
    })
}

/// The layouts must be on one mesh with one shape and dtype, and each mesh dim's
/// change must have a meaning.
fn check(src: &Layout, dst: &Layout) -> Result<()> {
    let err = |detail: String| Error::Placement {
        op: "redistribute",
        detail,
    };
    if src.mesh_shape != dst.mesh_shape {
        return Err(err(format!(
            "source is on a mesh of shape {:?}, target on {:?}; redistribute stays on one mesh",
            &src.mesh_shape[..],
            &dst.mesh_shape[..]
        )));
    }
    if src.shape != dst.shape || src.dtype != dst.dtype {
        return Err(err(format!(
            "source is {:?} {}, target {:?} {}; redistribute keeps the global shape and dtype",
            &src.shape[..],
            src.dtype,
            &dst.shape[..],
            dst.dtype
        )));
    }
    for (m, (a, b)) in src.placements.iter().zip(&dst.placements).enumerate() {
        match (a, b) {
            (Placement::Shard(_), Placement::Partial(_)) => {
                return Err(err(format!(
                    "mesh dim {m}: {a} -> {b} is not defined (a shard is not a pending reduction); \
                     redistribute to Replicate first if you need a partial value"
                )));
            }
            (Placement::Partial(x), Placement::Partial(y)) if x != y => {
                return Err(err(format!(
                    "mesh dim {m}: {a} -> {b} would change a pending reduction; reduce it first (to Replicate or Shard)"
                )));
            }
            _ => {}
        }
    }
    Ok(())
}
