//! Local CPU kernels on [`Tensor`]: matmul, element-wise ops with broadcasting,
//! reductions, and the neural-network ops of a Transformer.
//!
//! ```
//! use tessera_dtensor::{DType, Tensor};
//!
//! let x = Tensor::arange(6, DType::F32)?.reshape(&[2, 3])?;
//! let w = Tensor::ones(&[3, 4], DType::F32)?;
//! let b = Tensor::arange(4, DType::F32)?;
//! let y = x.matmul(&w)?.add(&b)?.gelu()?; // [2, 4]
//! assert_eq!(y.shape(), &[2, 4]);
//! let p = y.softmax(1)?;
//! let rows = p.sum(&[1], false)?.to_vec::<f32>()?;
//! assert!(rows.iter().all(|s| (s - 1.0).abs() < 1e-6));
//! # Ok::<(), tessera_dtensor::Error>(())
//! ```
//!
//! Every kernel is written once, generic over the element type, and dispatches
//! on the dtype once per call. Kernels run on the calling thread (each rank is a
//! thread already). Numerics:
//!
//! - `f32` and `f64` compute in their own precision; `bf16` and `f16` compute in
//!   `f32` and round once per output element (PyTorch's "opmath" rule).
//! - Sums and means accumulate in `f64` for every float dtype, and so do the
//!   statistics of softmax, layer norm and cross entropy. PyTorch reduces `f32`
//!   in `f32` with vectorised pairwise sums; results agree to about 1e-7
//!   relative, with `f64` accumulation the more accurate of the two.
//! - Integer tensors are rejected by arithmetic kernels (cast them first);
//!   shape ops ([`Tensor::permute`], [`Tensor::broadcast_to`]) and
//!   [`Tensor::embedding`]'s table accept every dtype.
//! - Operands must have the same dtype: there is no type promotion.

mod elementwise;
mod fastmath;
mod matmul;
mod nn;
mod nn_backward;
mod reduce;
mod shape;
#[cfg(test)]
mod testutil;
mod unary;

use std::borrow::Cow;
use std::ops::{Add, Div, Mul, Neg, Sub};

use half::{bf16, f16};
use tessera_mesh::{DType, Element};

pub use matmul::GemmKernel;
pub use nn::Reduction;

use crate::{Error, Result, Tensor};

/// The arithmetic type a kernel computes in: `f32` or `f64`.
pub(crate) trait Real:
    Element
    + PartialOrd
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + Neg<Output = Self>
    + Send
    + Sync
    + 'static
{
    const ZERO: Self;
    const ONE: Self;
    const NEG_INFINITY: Self;
    /// Rounds `v` to this type.
    fn real(v: f64) -> Self;
    /// Widens to `f64` (exact).
    fn widen(self) -> f64;
    fn is_nan(self) -> bool;
    fn exp(self) -> Self;
    fn ln(self) -> Self;
    fn sqrt(self) -> Self;
    fn tanh(self) -> Self;
    fn abs(self) -> Self;
    fn powf(self, e: Self) -> Self;
    fn erf(self) -> Self;
    fn erfc(self) -> Self;
}

macro_rules! real {
    ($t:ty, $erf:path, $erfc:path) => {
        impl Real for $t {
            const ZERO: Self = 0.0;
            const ONE: Self = 1.0;
            const NEG_INFINITY: Self = <$t>::NEG_INFINITY;
            #[inline(always)]
            fn real(v: f64) -> Self {
                v as $t
            }
            #[inline(always)]
            fn widen(self) -> f64 {
                self as f64
            }
            #[inline(always)]
            fn is_nan(self) -> bool {
                <$t>::is_nan(self)
            }
            #[inline(always)]
            fn exp(self) -> Self {
                <$t>::exp(self)
            }
            #[inline(always)]
            fn ln(self) -> Self {
                <$t>::ln(self)
            }
            #[inline(always)]
            fn sqrt(self) -> Self {
                <$t>::sqrt(self)
            }
            #[inline(always)]
            fn tanh(self) -> Self {
                <$t>::tanh(self)
            }
            #[inline(always)]
            fn abs(self) -> Self {
                <$t>::abs(self)
            }
            #[inline(always)]
            fn powf(self, e: Self) -> Self {
                <$t>::powf(self, e)
            }
            #[inline(always)]
            fn erf(self) -> Self {
                $erf(self)
            }
            #[inline(always)]
            fn erfc(self) -> Self {
                $erfc(self)
            }
        }
    };
}
real!(f32, libm::erff, libm::erfcf);
real!(f64, libm::erf, libm::erfc);

/// A float element type and the type it computes in ([`Real`]).
pub(crate) trait Float: Element {
    /// `f32` for `f32`, `bf16` and `f16`; `f64` for `f64`.
    type Acc: Real;
    fn to_acc(self) -> Self::Acc;
    /// Rounds once to this type.
    fn from_acc(a: Self::Acc) -> Self;
    #[inline(always)]
    fn to_f64(self) -> f64 {
        self.to_acc().widen()
    }
    /// Rounds `v` to this type (half types through `f32`, as casts do).
    #[inline(always)]
    fn from_f64(v: f64) -> Self {
        Self::from_acc(Self::Acc::real(v))
    }
}

macro_rules! float {
    ($t:ty, $acc:ty, $to:expr, $from:expr) => {
        impl Float for $t {
            type Acc = $acc;
            #[inline(always)]
            fn to_acc(self) -> $acc {
                $to(self)
            }
            #[inline(always)]
            fn from_acc(a: $acc) -> Self {
                $from(a)
            }
        }
    };
}
float!(f32, f32, |x| x, |a| a);
float!(f64, f64, |x| x, |a| a);
float!(bf16, f32, bf16::to_f32, bf16::from_f32);
float!(f16, f32, f16::to_f32, f16::from_f32);

/// Runs `$body` with `$T` bound to the element type of `$dtype` when it is a
/// float type; otherwise returns an error naming `$op`.
macro_rules! float_dispatch {
    ($op:expr, $dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            tessera_mesh::DType::F32 => {
                type $T = f32;
                $body
            }
            tessera_mesh::DType::F64 => {
                type $T = f64;
                $body
            }
            tessera_mesh::DType::BF16 => {
                type $T = half::bf16;
                $body
            }
            tessera_mesh::DType::F16 => {
                type $T = half::f16;
                $body
            }
            other => return Err($crate::ops::not_float($op, other)),
        }
    };
}
pub(crate) use float_dispatch;

/// Runs `$body` with `$T` bound to the element type of `$dtype`, for every dtype
/// (an error naming `$op` for dtypes added later).
macro_rules! any_dispatch {
    ($op:expr, $dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            tessera_mesh::DType::F32 => {
                type $T = f32;
                $body
            }
            tessera_mesh::DType::F64 => {
                type $T = f64;
                $body
            }
            tessera_mesh::DType::BF16 => {
                type $T = half::bf16;
                $body
            }
            tessera_mesh::DType::F16 => {
                type $T = half::f16;
                $body
            }
            tessera_mesh::DType::I64 => {
                type $T = i64;
                $body
            }
            tessera_mesh::DType::U8 => {
                type $T = u8;
                $body
            }
            other => {
                return Err($crate::Error::InvalidArgument {
                    op: $op,
                    detail: format!("dtype {other} is not supported"),
                });
            }
        }
    };
}
pub(crate) use any_dispatch;

/// The error for a float-only op given an integer tensor.
/// The index of element `i` of `shape` (row-major).
pub(crate) fn unravel(mut i: usize, shape: &[usize]) -> Vec<usize> {
    let mut index = vec![0; shape.len()];
    for d in (0..shape.len()).rev() {
        index[d] = i % shape[d];
        i /= shape[d];
    }
    index
}

pub(crate) fn not_float(op: &'static str, dtype: DType) -> Error {
    Error::InvalidArgument {
        op,
        detail: format!("dtype {dtype} is not a floating-point type; cast the tensor to a float dtype first"),
    }
}

/// Errors unless both tensors have the same dtype.
pub(crate) fn same_dtype(op: &'static str, a: &Tensor, b: &Tensor) -> Result<()> {
    if a.dtype() == b.dtype() {
        Ok(())
    } else {
        Err(Error::DTypeMismatch {
            op,
            expected: a.dtype(),
            got: b.dtype(),
        })
    }
}

/// Errors unless `dim < rank`.
pub(crate) fn check_dim(op: &'static str, dim: usize, rank: usize) -> Result<()> {
    if dim < rank {
        Ok(())
    } else {
        Err(Error::DimOutOfRange { op, dim, rank })
    }
}

/// The elements of `t` in row-major order: borrowed when contiguous, copied otherwise.
pub(crate) fn elements<T: Element>(t: &Tensor) -> Result<Cow<'_, [T]>> {
    if t.is_contiguous() {
        Ok(Cow::Borrowed(t.as_slice::<T>()?))
    } else {
        Ok(Cow::Owned(t.to_vec::<T>()?))
    }
}

/// A new contiguous tensor of `shape` holding `data` (whose length is the
/// shape's product by construction).
pub(crate) fn output<T: Element>(data: Vec<T>, shape: &[usize]) -> Result<Tensor> {
    Tensor::from_vec(data, shape)
}
