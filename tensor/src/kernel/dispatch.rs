//! Dtype dispatch: one `match` that binds a kernel's element type, written once
//! (candle's `Map1`/`Map2` idea as macros), and the errors it gives.

use tessera_mesh::DType;

use crate::Error;

/// Runs `$body` with `$T` bound to the element type of `$dtype` when it is a
/// float type; otherwise returns an error naming `$op`.
macro_rules! float_dispatch {
    ($op:expr, $dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            $crate::DType::F32 => {
                type $T = f32;
                $body
            }
            $crate::DType::F64 => {
                type $T = f64;
                $body
            }
            $crate::DType::BF16 => {
                type $T = $crate::bf16;
                $body
            }
            $crate::DType::F16 => {
                type $T = $crate::f16;
                $body
            }
            other => return Err($crate::kernel::not_float($op, other)),
        }
    };
}
pub(crate) use float_dispatch;

/// Runs `$body` with `$T` bound to the element type of `$dtype`, for every dtype
/// (returns an [`Error::InvalidArgument`](crate::Error::InvalidArgument) naming `$op`,
/// converted with `into`, for dtypes added later): a kernel is written once,
/// generic over [`Element`](crate::Element), and dispatched here.
///
/// ```
/// use tessera_tensor::{any_dispatch, DType, Tensor};
///
/// fn bytes(t: &Tensor) -> tessera_tensor::Result<usize> {
///     any_dispatch!("bytes", t.dtype(), T => Ok(t.to_vec::<T>()?.len() * size_of::<T>()))
/// }
/// assert_eq!(bytes(&Tensor::arange(3, DType::I64)?)?, 24);
/// assert_eq!(bytes(&Tensor::arange(3, DType::BF16)?)?, 6);
/// # Ok::<(), tessera_tensor::Error>(())
/// ```
#[macro_export]
macro_rules! any_dispatch {
    ($op:expr, $dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            $crate::DType::F32 => {
                type $T = f32;
                $body
            }
            $crate::DType::F64 => {
                type $T = f64;
                $body
            }
            $crate::DType::BF16 => {
                type $T = $crate::bf16;
                $body
            }
            $crate::DType::F16 => {
                type $T = $crate::f16;
                $body
            }
            $crate::DType::I64 => {
                type $T = i64;
                $body
            }
            $crate::DType::U8 => {
                type $T = u8;
                $body
            }
            other => {
                return Err($crate::Error::InvalidArgument {
                    op: $op,
                    detail: format!("dtype {other} is not supported"),
                }
                .into());
            }
        }
    };
}
pub(crate) use crate::any_dispatch;

/// The index of element `i` of `shape` (row-major).
pub(crate) fn unravel(mut i: usize, shape: &[usize]) -> Vec<usize> {
    let mut index = vec![0; shape.len()];
    for d in (0..shape.len()).rev() {
        index[d] = i % shape[d];
        i /= shape[d];
    }
    index
}

/// The error for a float-only op given an integer tensor.
pub(crate) fn not_float(op: &'static str, dtype: DType) -> Error {
    Error::InvalidArgument {
        op,
        detail: format!("dtype {dtype} is not a floating-point type; cast the tensor to a float dtype first"),
    }
}
