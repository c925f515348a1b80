//! The kernel toolkit, below [`Tensor`](crate::Tensor): the numeric traits, dtype
//! dispatch, SIMD selection and branch-free math, and the parallel loops over a
//! rank's threads. Nothing here knows the tensor type, so storage, views and the
//! kernels of [`ops`](crate::ops) all build on it.

mod dispatch;
mod fastmath;
mod num;
mod par;

pub(crate) use dispatch::{any_dispatch, float_dispatch, not_float, unravel};
pub(crate) use fastmath::{Simd, erfc, exp, zip_map, zip_map_inline, zip3_map};
pub(crate) use num::{Float, Real, Scalar, convert, convert_extend};
#[cfg(test)]
pub(crate) use par::PAR_MIN_ELEMENTS;
pub(crate) use par::{par_blocks, par_parts, par_rows};
