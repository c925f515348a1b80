//! [`Slot`]: where a unit keeps a parameter's unsharded value, which the tape
//! re-reads in backward.
//!
//! A unit gathers its parameters into slots for its forward and binds each
//! parameter to its slot's value ([`tessera_autograd::Binding::saved_through`]);
//! the tape keeps only the slots, so emptying them after forward frees the
//! unsharded parameters, and gathering again before the unit's backward refills
//! them. Reading an empty slot is an [`Error::Resharded`] naming the parameter,
//! never stale data.
//!
//! PyTorch: `FSDPParam._unsharded_param`, whose storage FSDP2 frees after forward
//! (`free_storage`) and re-allocates before backward (`alloc_storage`).

use std::cell::RefCell;
use std::rc::Rc;

use tessera_autograd::{BoxError, Param, SavedHandle, WeakParam};
use tessera_dtensor::DTensor;

use crate::error::{Error, Result};

/// A parameter's unsharded value, which can be emptied and refilled.
pub(crate) struct Slot {
    /// The parameter, named in errors by its name at the time (its tree may
    /// name it after the slot is made).
    param: WeakParam,
    value: RefCell<Option<DTensor>>,
}

impl Slot {
    /// An empty slot for `param`.
    pub(crate) fn new(param: &Param) -> Rc<Slot> {
        Rc::new(Slot {
            param: param.downgrade(),
            value: RefCell::new(None),
        })
    }

    /// The value.
    ///
    /// # Errors
    /// [`Error::Resharded`] when the slot is empty.
    pub(crate) fn get(&self) -> Result<DTensor> {
        self.value.borrow().clone().ok_or_else(|| Error::Resharded {
            param: self
                .param
                .upgrade()
                .map_or_else(|| "a dropped parameter".into(), |p| p.name()),
        })
    }

    /// Fills the slot.
    pub(crate) fn fill(&self, value: DTensor) {
        *self.value.borrow_mut() = Some(value);
    }

    /// Empties the slot (its value is freed once nothing else holds it).
    pub(crate) fn free(&self) {
        self.value.borrow_mut().take();
    }
}

impl SavedHandle for Slot {
    fn unpack(&self) -> std::result::Result<DTensor, BoxError> {
        Ok(self.get()?)
    }
}

#[cfg(test)]
mod tests {
    use tessera_dtensor::{DType, Placement, Tensor, distribute_tensor};
    use tessera_mesh::{DeviceMesh, launch};

    use super::*;

    #[test]
    fn an_empty_slot_names_its_parameter() {
        launch(1, |ctx| {
            let mesh = DeviceMesh::new(ctx.into_comm(), &[1])?;
            let v = distribute_tensor(&Tensor::ones(&[2], DType::F64)?, &mesh, &[Placement::Replicate])?;
            let w = Param::new(v.clone());
            tessera_autograd::nn::ParameterDict::new([("w", w.clone())])?;
            let slot = Slot::new(&w);
            let e = slot.get().unwrap_err().to_string();
            assert!(e.contains("parameter w is resharded"), "{e}");
            slot.fill(v);
            assert_eq!(slot.unpack()?.to_local().to_vec::<f64>()?, [1.0, 1.0]);
            slot.free();
            let e = tessera_autograd::Saved::Handle(slot.clone()).get().unwrap_err();
            assert!(matches!(Error::from(e), Error::Resharded { param } if param == "w"));
            drop(w);
            assert!(slot.get().unwrap_err().to_string().contains("a dropped parameter"));
            Ok(())
        })
        .unwrap();
    }
}
