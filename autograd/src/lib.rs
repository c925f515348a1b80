//! A small tape autograd over [`DTensor`](tessera_dtensor::DTensor)s.
//!
//! ```
//! use tessera_autograd::{backward, Param, Var};
//! use tessera_dtensor::{distribute_tensor, DType, Placement::*, Tensor};
//! use tessera_mesh::{launch, DeviceMesh};
//!
//! let grads = launch(2, |ctx| {
//!     let mesh = DeviceMesh::new(ctx.into_comm(), &[2])?;
//!     // A replicated weight and a batch split over the two ranks.
//!     let w = Param::new(distribute_tensor(&Tensor::ones(&[3, 1], DType::F64)?, &mesh, &[Replicate])?);
//!     let x = Tensor::arange(12, DType::F64)?.reshape(&[4, 3])?;
//!     let x = Var::constant(distribute_tensor(&x, &mesh, &[Shard(0)])?);
//!     let loss = x.matmul(&w.var()?)?.mean(&[0, 1], false)?;
//!     backward(&loss)?;
//!     // d mean(x·w)/dw = column means of x, all-reduced into the replicated grad.
//!     Ok(w.grad().unwrap().to_local().to_vec::<f64>()?)
//! })
//! .unwrap();
//! assert_eq!(grads[0], vec![4.5, 5.5, 6.5]);
//! assert_eq!(grads[0], grads[1]);
//! ```
//!
//! - [`Var`]: a value on the tape; [`Param`]: a named leaf holding its gradient in
//!   its own placements.
//! - [`backward`], [`no_grad`], [`checkpoint`]; a tape per rank (thread-local).
//! - Differentiable ops on `Var` mirroring the DTensor ops, each with a backward rule
//!   written in DTensor ops (so gradients are as sharded as the forward).
//! - One extension point for layers above the tape (parallelism, offloading):
//!   [`Binding`] says what a parameter yields while a module runs and where its
//!   gradient goes, [`SavedHandle`] how backward re-reads an operand; with the
//!   module hooks of [`nn`] (attached by a module's place in the tree), that is
//!   all such a layer needs.

mod backward;
mod error;
pub mod nn;
mod ops;
pub mod optim;
mod param;
pub mod random;
mod saved;
pub mod state_dict;
mod tape;
mod var;

pub use backward::{backward, checkpoint};
pub use error::{BoxError, Error, ModuleError, Result};
pub use ops::unbroadcast;
pub use param::{Binding, Param, WeakParam};
pub use saved::{Saved, SavedHandle};
pub use state_dict::{
    LoadReport, Progress, SafetensorsReader, Stateful, load_checkpoint, load_state_dict, load_states, read_safetensors,
    save_checkpoint, save_state_dict_full, save_state_dict_full_renamed, states_to_metadata, write_atomic,
    write_safetensors,
};
pub use tape::{clear_tape, is_grad_enabled, no_grad, queue_callback, recorded_ops};
pub use var::Var;
