//! Explicit redistribution: a scope in which an op may not redistribute its
//! inputs by itself.
//!
//! An op whose inputs do not fit any of its strategies redistributes them
//! (*implicitly*: the communication is nowhere in the user's code). Inside
//! [`explicit_redistribution`] such a redistribution is an error naming the op,
//! the input and both layouts (or, with [`Implicit::Warn`], a warning in the
//! log), while [`DTensor::redistribute`](crate::DTensor::redistribute) — the
//! explicit kind — still runs. Each rank (thread) has its own scope.
//!
//! ```
//! use tessera_dtensor::explicit::{explicit_redistribution, Implicit};
//! use tessera_dtensor::{distribute_tensor, DType, Placement, Tensor};
//! use tessera_mesh::{launch, DeviceMesh};
//!
//! launch(2, |ctx| {
//!     let mesh = DeviceMesh::new(ctx.into_comm(), &[2])?;
//!     let x = distribute_tensor(&Tensor::ones(&[4, 3], DType::F32)?, &mesh, &[Placement::Shard(0)])?;
//!     explicit_redistribution(Implicit::Error, || {
//!         // Row-wise: fits Shard(0) as it is.
//!         assert!(x.softmax(1).is_ok());
//!         // Along the sharded dim: would gather the rows first, so it is refused...
//!         assert!(x.softmax(0).is_err());
//!         // ...unless the user redistributes, explicitly.
//!         let whole = x.redistribute(&[Placement::Replicate])?;
//!         assert!(whole.softmax(0).is_ok());
//!         Ok::<_, tessera_dtensor::Error>(())
//!     })?;
//!     Ok(())
//! })?;
//! # Ok::<(), tessera_mesh::Error>(())
//! ```

use std::cell::Cell;

use crate::redistribute::Plan;
use crate::{Error, Result};

/// What an implicit redistribution does inside [`explicit_redistribution`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Implicit {
    /// The op fails with an error naming the op, the input and the layouts.
    Error,
    /// The op runs; the redistribution is logged at warning level.
    Warn,
}

thread_local! {
    static MODE: Cell<Option<Implicit>> = const { Cell::new(None) };
}

/// Restores the mode that was in force when the scope opened.
struct Restore(Option<Implicit>);

impl Drop for Restore {
    fn drop(&mut self) {
        MODE.with(|m| m.set(self.0));
    }
}

/// Runs `f` with implicit redistributions handled as `policy` says (see the
/// module docs); the previous mode comes back when `f` returns or panics.
/// Scopes nest: the innermost policy applies.
///
/// PyTorch: `torch.distributed.tensor.debug`'s explicit-redistribution mode
/// (`ExplicitRedistributionContext`).
pub fn explicit_redistribution<T>(policy: Implicit, f: impl FnOnce() -> T) -> T {
    let _restore = Restore(MODE.with(|m| m.replace(Some(policy))));
    f()
}

/// The policy in force on this thread, if inside a scope.
pub fn implicit_policy() -> Option<Implicit> {
    MODE.with(Cell::get)
}

/// Called by an op about to redistribute input `i` along `plan` by itself.
pub(crate) fn check_implicit(op: &'static str, i: usize, plan: &Plan) -> Result<()> {
    let Some(policy) = implicit_policy() else {
        return Ok(());
    };
    let what = format!(
        "input {i} would be redistributed implicitly, {} -> {} ({} collective{}, {} bytes from this rank)",
        plan.src,
        plan.dst(),
        plan.collectives(),
        if plan.collectives() == 1 { "" } else { "s" },
        plan.bytes()
    );
    match policy {
        Implicit::Warn => {
            log::warn!("{op}: {what}");
            Ok(())
        }
        Implicit::Error => Err(Error::Placement {
            op,
            detail: format!(
                "{what}, inside explicit_redistribution; redistribute it yourself (DTensor::redistribute) to \
                 a layout the op takes as it is, or run the op outside the scope"
            ),
        }),
    }
}

#[cfg(test)]
mod tests {
    use tessera_mesh::{DeviceMesh, launch};

    use super::*;
    use crate::{DType, Placement, Tensor, distribute_tensor};

    #[test]
    fn implicit_redistributions_are_refused_or_logged_inside_the_scope_only() {
        let msgs = launch(2, |ctx| {
            let mesh = DeviceMesh::new(ctx.into_comm(), &[2])?;
            let x = distribute_tensor(&Tensor::randn(&[4, 3], DType::F32, 1)?, &mesh, &[Placement::Shard(0)])?;
            let w = distribute_tensor(&Tensor::randn(&[3, 5], DType::F32, 2)?, &mesh, &[Placement::Replicate])?;
            let wt = distribute_tensor(&Tensor::randn(&[5, 3], DType::F32, 3)?, &mesh, &[Placement::Shard(1)])?;
            let before = mesh.stats().total_calls();
            let refused = explicit_redistribution(Implicit::Error, || {
                // Fits as placed: row shards times a replicated weight.
                assert!(x.matmul(&w).is_ok());
                // Needs the weight replicated: refused before anything moves.
                let e = x.matmul(&wt.transpose(0, 1)?).unwrap_err().to_string();
                // Nested scopes: the innermost policy applies, then the outer one again.
                let warned = explicit_redistribution(Implicit::Warn, || x.softmax(0).is_ok());
                assert!(warned);
                assert_eq!(implicit_policy(), Some(Implicit::Error));
                Ok::<_, Error>(e)
            })?;
            assert_eq!(implicit_policy(), None);
            // Only the warned softmax gathered (one all-gather of x's rows).
            assert_eq!(mesh.stats().total_calls() - before, 1);
            // Outside the scope the same op redistributes and runs.
            assert!(x.matmul(&wt.transpose(0, 1)?).is_ok());
            Ok(refused)
        })
        .unwrap();
        let m = &msgs[0];
        assert!(m.starts_with("matmul: "), "{m}");
        assert!(
            m.contains("input 0 would be redistributed implicitly, f32[4,3] (Shard(0)) on mesh("),
            "{m}"
        );
        assert!(m.contains("inside explicit_redistribution"), "{m}");
        assert_eq!(msgs[0], msgs[1], "every rank refuses alike");
    }
}
