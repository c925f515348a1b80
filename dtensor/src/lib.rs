//! Local tensors, placements, distributed tensors and redistribution.
//!
//! ```
//! use tessera_dtensor::{distribute_tensor, DType, Placement::*, Tensor};
//! use tessera_mesh::{launch, DeviceMesh};
//!
//! launch(2, |ctx| {
//!     let mesh = DeviceMesh::new(ctx.into_comm(), &[2])?;
//!     let full = Tensor::arange(8, DType::F32)?.reshape(&[4, 2])?;
//!     let x = distribute_tensor(&full, &mesh, &[Shard(0)])?;
//!     // Shard(0) -> Shard(1) is one all_to_all.
//!     let plan = x.redistribute_plan(&[Shard(1)])?;
//!     assert_eq!(plan.collectives(), 1);
//!     assert_eq!(x.run_plan(&plan)?.full_tensor()?, full);
//!     Ok(())
//! })
//! .unwrap();
//! ```
//!
//! - [`Tensor`]: the local CPU tensor (six dtypes, cheap views), with a per-rank
//!   [`memory`](tessera_tensor::memory) tracker.
//! - [`Placement`], [`ShardOrder`] and the pure [`sharding`] math (torch.chunk splits).
//! - [`DTensor`], [`distribute_tensor`] (rank 0's values, as PyTorch's default
//!   `src_data_rank=0`; [`distribute_tensor_from`] names another source or none),
//!   and redistribution as a pure planner ([`redistribute::plan`]) plus an executor.
//! - [`check_replicas`]: one small all-gather that tells whether the ranks of every
//!   `Replicate` mesh dim hold equal values ([`replicas`]).
//! - [`DTensor::random`]: sharded random tensors ([`Distribution`], [`StreamKey`]),
//!   each rank drawing only its piece, the same bits on every mesh and layout.

pub mod bucket;
pub mod checkpoint;
pub mod debug;
mod dtensor;
mod error;
pub mod explicit;
mod memo;
pub mod ops;
mod placement;
mod random;
pub mod redistribute;
pub mod replicas;
pub mod sharding;
mod spec;
mod strategy;
mod tensor_comm;
#[cfg(feature = "testing")]
pub mod testing;

pub use dtensor::{
    DTensor, LayoutOrigin, distribute_tensor, distribute_tensor_from, distribute_tensor_with_order,
    distribute_tensor_with_order_from,
};
pub use error::{Error, ReplicaDivergence, Result};
pub use placement::{MeshDims, Placement, ShardOrder, validate_placements};
pub use replicas::{check_replicas, tensor_hash};
pub use spec::{DTensorSpec, Layout, Placements, PlacementsDisplay};
pub use strategy::Linearity;
pub use tessera_mesh::{DType, ReduceOp};
pub use tessera_tensor::random::{Distribution, StreamKey};
pub use tessera_tensor::{Device, Dim, ShapeSize, Tensor};
