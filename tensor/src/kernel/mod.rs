//! The kernel toolkit, below [`Tensor`](crate::Tensor): the numeric traits, dtype
//! dispatch, SIMD selection and branch-free math (and what the kernels written
//! with AVX-512 intrinsics share), and the parallel loops over a rank's threads.
//! Nothing here knows the tensor type, so storage, views and the kernels of
//! [`ops`](crate::ops) all build on it; so do kernels of other crates
//! (the optimizers' updates), through what is public here: [`Real`], [`Simd`]
//! and the split rule [`par_parts`].

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512;
mod dispatch;
mod fastmath;
mod num;
mod par;

pub(crate) use dispatch::{any_dispatch, float_dispatch, not_float, unravel};
pub use fastmath::Simd;
#[cfg(target_arch = "x86_64")]
pub(crate) use fastmath::exp_f32x16;
pub(crate) use fastmath::{erfc, exp, zip_map, zip_map_inline, zip3_map};
pub use num::Real;
pub(crate) use num::{Float, Scalar, convert, convert_extend};
pub use par::{PAR_MIN_ELEMENTS, par_parts};
pub(crate) use par::{par_blocks, par_columns, par_rows};
