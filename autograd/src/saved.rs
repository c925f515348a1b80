//! What backward rules keep of their operands: the value itself, or a handle that
//! re-reads it when backward runs.
//!
//! A layer above the tape that lends a value to forward and drops it afterwards
//! (a parallelism layer gathering a parameter, an offloading scheme moving
//! activations elsewhere) gives the value a [`SavedHandle`] with
//! [`Var::with_saved`](crate::Var::with_saved); the tape then keeps only the
//! handle, and backward asks it for the value. A handle that cannot produce it
//! fails with its own error, carried by [`Error::External`]: never stale data.

use std::rc::Rc;

use tessera_dtensor::DTensor;

use crate::{BoxError, Error, Result};

/// How backward re-reads an operand that its owner may drop after forward and
/// restore before backward.
///
/// PyTorch: the `unpack` hook of `torch.autograd.graph.saved_tensors_hooks(pack, unpack)`
/// (packing is implicit: the tape keeps the handle instead of the value).
pub trait SavedHandle {
    /// The operand's value now.
    ///
    /// # Errors
    /// The owner's own error when it cannot produce the value (it was dropped and
    /// not restored); [`Saved::get`] reports it as [`Error::External`].
    fn unpack(&self) -> std::result::Result<DTensor, BoxError>;
}

/// An operand kept for backward.
///
/// PyTorch: a `SavedVariable`.
#[derive(Clone)]
pub enum Saved {
    /// The value itself (boxed: a DTensor is large next to a handle).
    Value(Box<DTensor>),
    /// A handle, unpacked when backward runs.
    Handle(Rc<dyn SavedHandle>),
}

impl Saved {
    /// The operand's value now.
    ///
    /// PyTorch: `SavedVariable::unpack`.
    ///
    /// # Errors
    /// [`Error::External`] carrying the handle's error when it cannot produce the value.
    pub fn get(&self) -> Result<DTensor> {
        match self {
            Saved::Value(v) => Ok((**v).clone()),
            Saved::Handle(h) => h.unpack().map_err(Error::External),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::cell::{Cell, RefCell};

    use smallvec::smallvec;
    use tessera_dtensor::{DType, Placement, Tensor, distribute_tensor};
    use tessera_mesh::{DeviceMesh, launch};

    use super::*;
    use crate::{Binding, Param, backward, queue_callback};

    /// A value its owner can drop and restore (what a layer above the tape keeps).
    struct Stash {
        name: String,
        value: RefCell<Option<DTensor>>,
    }

    #[derive(Debug, thiserror::Error)]
    #[error("{0} was dropped after forward")]
    struct Dropped(String);

    impl SavedHandle for Stash {
        fn unpack(&self) -> std::result::Result<DTensor, BoxError> {
            self.value
                .borrow()
                .clone()
                .ok_or_else(|| Dropped(self.name.clone()).into())
        }
    }

    /// On one rank: `w` (a parameter) reaches the loss `sum(x · wᵀ)` through a
    /// binding whose value lives in a stash; `x` is a parameter too, so its
    /// gradient (`g · w`) must read `w` back from the stash.
    /// Returns `x`'s gradient and backward's error, if any.
    fn run(drop_before_backward: bool, restore: bool) -> Result<(Option<Vec<f64>>, String)> {
        let out = launch(1, move |ctx| {
            let mesh = DeviceMesh::new(ctx.into_comm(), &[1])?;
            let rep = [Placement::Replicate];
            let full = |shape: &[usize], seed| -> crate::Result<DTensor> {
                Ok(distribute_tensor(
                    &Tensor::randn(shape, DType::F64, seed)?,
                    &mesh,
                    &rep,
                )?)
            };
            let w = Param::named("w", full(&[3, 4], 1)?);
            let xp = Param::named("x", full(&[2, 4], 2)?);
            let x = xp.var()?;
            let stash = Rc::new(Stash {
                name: "w".into(),
                value: RefCell::new(Some(w.value()?)),
            });
            let leaf = w.var()?;
            let lent = crate::Var::from_op("lend", w.value()?, &[&leaf], |g| Ok(smallvec![Some(g.clone())]));
            w.bind(Some(Binding::of_var(lent).saved_through(stash.clone())));
            let loss = x.linear(&w.var()?, None)?.sum(&[0, 1], false)?;
            w.bind(None);
            if drop_before_backward {
                stash.value.borrow_mut().take();
            }
            if restore {
                *stash.value.borrow_mut() = Some(w.value()?);
            }
            let r = backward(&loss);
            Ok((
                w.grad().map(|g| g.to_local().to_f64_vec()),
                r.err().map(|e| e.to_string()).unwrap_or_default(),
            ))
        });
        out.map(|mut v| v.remove(0)).map_err(|e| Error::Backward(e.to_string()))
    }

    #[test]
    fn saved_handles_are_unpacked_in_backward() {
        let (plain, e) = run(false, false).unwrap();
        assert!(e.is_empty(), "{e}");
        let plain = plain.expect("a gradient");
        // d sum(x·wᵀ)/dx[n][j] = Σ_i w[i][j]: both rows of x's gradient are the same.
        assert_eq!(plain[..4], plain[4..8]);
        let (dropped, e) = run(true, false).unwrap();
        assert!(dropped.is_none(), "{dropped:?} {e}");
        assert!(e.contains("w was dropped after forward"), "{e}");
        let (restored, e) = run(true, true).unwrap();
        assert!(e.is_empty(), "{e}");
        assert_eq!(restored.expect("a gradient"), plain);
    }

    #[test]
    fn callbacks_run_once_after_the_walk() {
        launch(1, |ctx| {
            let mesh = DeviceMesh::new(ctx.into_comm(), &[1])?;
            let w = Param::named(
                "w",
                distribute_tensor(&Tensor::ones(&[2], DType::F64)?, &mesh, &[Placement::Replicate])?,
            );
            let ran = Rc::new(Cell::new(0));
            let loss = w.var()?.sum(&[0], false)?;
            queue_callback({
                let ran = ran.clone();
                move || {
                    ran.set(ran.get() + 10);
                    Ok(())
                }
            });
            backward(&loss)?;
            assert_eq!(ran.get(), 10, "the queued callback ran once, after the walk");
            let loss = w.var()?.sum(&[0], false)?;
            backward(&loss)?;
            assert_eq!(ran.get(), 10, "and not again");
            queue_callback(|| Err(Error::Backward("callback failed".into())));
            let loss = w.var()?.sum(&[0], false)?;
            let e = backward(&loss).unwrap_err().to_string();
            assert!(e.contains("callback failed"), "{e}");
            Ok(())
        })
        .unwrap();
    }
}
