//! What backward rules keep of their operands: a value, or a handle on a [`Slot`]
//! that its owner can empty after forward and refill before backward.
//!
//! FSDP gathers a unit's parameters into slots for the unit's forward; the tape
//! keeps only the slots, so emptying them after forward frees the unsharded
//! parameters, and gathering again before the unit's backward refills them. Touching
//! an empty slot is an error naming the parameter, never stale data.

use std::cell::RefCell;
use std::rc::Rc;

use tessera_dtensor::DTensor;

use crate::{Error, Result};

/// A value that can be emptied and refilled (an unsharded parameter).
pub struct Slot {
    name: String,
    value: RefCell<Option<DTensor>>,
}

impl Slot {
    /// A slot named `name` (the parameter's name, for errors), holding `value`.
    pub fn new(name: impl Into<String>, value: Option<DTensor>) -> Rc<Slot> {
        Rc::new(Slot {
            name: name.into(),
            value: RefCell::new(value),
        })
    }

    /// The slot's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The value.
    ///
    /// # Errors
    /// [`Error::Freed`] when the slot is empty.
    pub fn get(&self) -> Result<DTensor> {
        self.value
            .borrow()
            .clone()
            .ok_or_else(|| Error::Freed(self.name.clone()))
    }

    /// Whether the slot holds a value.
    pub fn is_filled(&self) -> bool {
        self.value.borrow().is_some()
    }

    /// Fills the slot.
    pub fn fill(&self, value: DTensor) {
        *self.value.borrow_mut() = Some(value);
    }

    /// Empties the slot (its value is freed once nothing else holds it).
    pub fn free(&self) {
        self.value.borrow_mut().take();
    }
}

/// An operand kept for backward.
#[derive(Clone)]
pub enum Saved {
    /// The value itself (boxed: a DTensor is large next to a slot handle).
    Value(Box<DTensor>),
    /// A slot, read when backward runs.
    Slot(Rc<Slot>),
}

impl Saved {
    /// The operand's value now.
    ///
    /// # Errors
    /// [`Error::Freed`] for an empty slot.
    pub fn get(&self) -> Result<DTensor> {
        match self {
            Saved::Value(v) => Ok((**v).clone()),
            Saved::Slot(s) => s.get(),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use smallvec::smallvec;
    use tessera_dtensor::{DType, Placement, Tensor, distribute_tensor};
    use tessera_mesh::{DeviceMesh, launch};

    use super::*;
    use crate::{Param, Var, backward, queue_callback};

    /// On one rank: `w` (a parameter) reaches the loss `sum(x · wᵀ)` through a
    /// stand-in var whose value lives in a slot, as FSDP arranges it; `x` is a
    /// parameter too, so its gradient (`g · w`) must read `w` back from the slot.
    /// Returns `x`'s gradient and backward's error, if any.
    fn run(free_before_backward: bool, refill: bool) -> Result<(Option<Vec<f64>>, String)> {
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
            let w = Param::new("w", full(&[3, 4], 1)?);
            let xp = Param::new("x", full(&[2, 4], 2)?);
            let x = xp.var();
            let slot = Slot::new("w", Some(w.value()));
            let leaf = w.var();
            let stand_in = Var::from_op("unshard", w.value(), &[&leaf], |g| Ok(smallvec![Some(g.clone())]))
                .with_slot(slot.clone());
            w.set_stand_in(Some(stand_in));
            let loss = x.linear(&w.var(), None)?.sum(&[0, 1], false)?;
            w.set_stand_in(None);
            if free_before_backward {
                slot.free();
            }
            if refill {
                slot.fill(w.value());
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
    fn saved_slots_free_and_refill() {
        let (plain, e) = run(false, false).unwrap();
        assert!(e.is_empty(), "{e}");
        let plain = plain.expect("a gradient");
        // d sum(x·wᵀ)/dx[n][j] = Σ_i w[i][j]: both rows of x's gradient are the same.
        assert_eq!(plain[..4], plain[4..8]);
        let (freed, e) = run(true, false).unwrap();
        assert!(freed.is_none(), "{freed:?} {e}");
        assert!(e.contains("parameter w is resharded"), "{e}");
        let (refilled, e) = run(true, true).unwrap();
        assert!(e.is_empty(), "{e}");
        assert_eq!(refilled.expect("a gradient"), plain);
    }

    #[test]
    fn callbacks_run_once_after_the_walk() {
        launch(1, |ctx| {
            let mesh = DeviceMesh::new(ctx.into_comm(), &[1])?;
            let w = Param::new(
                "w",
                distribute_tensor(&Tensor::ones(&[2], DType::F64)?, &mesh, &[Placement::Replicate])?,
            );
            let ran = Rc::new(Cell::new(0));
            let loss = w.var().sum(&[0], false)?;
            queue_callback({
                let ran = ran.clone();
                move || {
                    ran.set(ran.get() + 10);
                    Ok(())
                }
            });
            backward(&loss)?;
            assert_eq!(ran.get(), 10, "the queued callback ran once, after the walk");
            let loss = w.var().sum(&[0], false)?;
            backward(&loss)?;
            assert_eq!(ran.get(), 10, "and not again");
            queue_callback(|| Err(Error::Backward("callback failed".into())));
            let loss = w.var().sum(&[0], false)?;
            let e = backward(&loss).unwrap_err().to_string();
            assert!(e.contains("callback failed"), "{e}");
            Ok(())
        })
        .unwrap();
    }
}
