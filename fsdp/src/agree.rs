//! The ranks agree before a parallelism API changes anything: every rank's own
//! checks passed, and every rank is about to do the same thing to the same
//! parameters. Otherwise every rank returns an error (the failed rank its own),
//! so a fault on one rank never leaves the others waiting in the first
//! collective, and models built differently on different ranks fail at setup,
//! not as a mismatched collective mid-step.

use tessera_autograd::Param;
use tessera_mesh::DeviceMesh;

use crate::error::{Error, Result};

/// Agrees over `mesh` on `checked` (each rank's own checks) and `geometry`
/// (a hash of what each rank is about to do, [`geometry_hash`]); `what` says
/// what every rank must call alike (`"fully_shard on the same modules"`). One
/// all-gather of three words per rank (and a broadcast of the message on failure).
pub(crate) fn agree<T>(mesh: &DeviceMesh, checked: Result<T>, geometry: u64, what: &str) -> Result<T> {
    let (v, words) = tessera_mesh::agree::agree_on_with(mesh.comm(), checked, geometry, |f| {
        Error::mesh(mesh, format!("rank {} failed: {}", f.rank, f.reason))
    })?;
    match words.iter().find(|(_, w)| *w != words[0].1) {
        None => Ok(v),
        Some((other, _)) => Err(Error::mesh(
            mesh,
            format!(
                "rank {} and rank {other} hold different parameters here (names, global shapes, dtypes \
                 or placements differ): every rank must build the same model and call {what}, in the \
                 same order",
                words[0].0
            ),
        )),
    }
}

/// A hash of `params` as every rank should see them: each one's name, global
/// shape, dtype and placements, in order, and `extra` (a plan, say).
pub(crate) fn geometry_hash(params: &[Param]) -> u64 {
    geometry_hash_with(params, "")
}

/// [`geometry_hash`] with `extra` folded in.
pub(crate) fn geometry_hash_with(params: &[Param], extra: &str) -> u64 {
    let each: Vec<(String, Vec<usize>, String)> = params
        .iter()
        .map(|p| {
            let layout = p.layout();
            (
                p.name(),
                layout.shape.to_vec(),
                format!("{:?} {:?}", layout.dtype, layout.placements),
            )
        })
        .collect();
    tessera_mesh::callsite::tag_of(&(extra, each))
}
