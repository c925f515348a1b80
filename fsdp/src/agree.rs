//! The ranks agree before a parallelism API changes anything: every rank's own
//! checks passed, and every rank is about to do the same thing to the same
//! parameters. Otherwise every rank returns an error (the failed rank its own),
//! so a fault on one rank never leaves the others waiting in the first
//! collective, and models built differently on different ranks fail at setup,
//! not as a mismatched collective mid-step.

use std::hash::{Hash, Hasher};

use tessera_autograd::Param;
use tessera_mesh::DeviceMesh;

use crate::error::{Error, Result};

/// Agrees over `mesh` on `checked` (each rank's own checks) and `geometry`
/// (a hash of what each rank is about to do, [`geometry_hash`]); `what` says
/// what every rank must call alike (`"fully_shard on the same modules"`). One
/// all-gather of three words per rank (and a broadcast of the message on failure).
pub(crate) fn agree<T>(mesh: &DeviceMesh, checked: Result<T>, geometry: u64, what: &str) -> Result<T> {
    let tessera_mesh::agree::Verdict { failure, words } =
        tessera_mesh::agree::agree_with(mesh.comm(), checked.as_ref().err(), geometry)?;
    match (checked, failure) {
        (Err(e), Some(f)) if f.is_me => Err(e),
        (_, Some(f)) => Err(Error::mesh(mesh, format!("rank {} failed: {}", f.rank, f.reason))),
        (Err(e), None) => Err(e),
        (Ok(v), None) => match words.iter().find(|(_, w)| *w != words[0].1) {
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
        },
    }
}

/// A hash of `params` as every rank should see them: each one's name, global
/// shape, dtype and placements, in order, and `extra` (a plan, say).
pub(crate) fn geometry_hash(params: &[Param]) -> u64 {
    geometry_hash_with(params, "")
}

/// [`geometry_hash`] with `extra` folded in.
pub(crate) fn geometry_hash_with(params: &[Param], extra: &str) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    extra.hash(&mut h);
    for p in params {
        let layout = p.layout();
        (
            p.name(),
            &layout.shape[..],
            format!("{:?} {:?}", layout.dtype, layout.placements),
        )
            .hash(&mut h);
    }
    h.finish()
}
