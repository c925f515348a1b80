//! How Tessera's dtypes and reductions map onto MPI: datatypes, the built-in
//! operators, and user operators for what MPI lacks (bf16 and f16 moved as
//! 16-bit words and reduced through f32; NaN-propagating max/min for floats, as
//! the threads backend does).

use std::os::raw::{c_int, c_void};

use half::{bf16, f16};
use mpi::ffi;

use super::messages::error_string;

use crate::{Buf, BufMut, Buffer, DType, ReduceOp};

/// An MPI handle (a pointer in OpenMPI) that may move between threads:
/// `MPI_THREAD_MULTIPLE` lets any thread use it, and Tessera never uses one
/// communicator from two threads at once.
#[derive(Clone, Copy, Debug)]
pub(super) struct Handle<T>(pub(super) T);
impl<T: Copy> Handle<T> {
    /// The handle (a method, so that closures capture the whole `Send` wrapper).
    pub(super) fn get(self) -> T {
        self.0
    }
}

/// The handle types that [`Handle`] may carry across threads.
pub(super) trait MpiHandle: Copy {}
impl MpiHandle for ffi::MPI_Comm {}
impl MpiHandle for ffi::MPI_Op {}
/// The watchdog's send requests, used by one thread at a time (under its lock).
impl MpiHandle for ffi::MPI_Request {}
/// `MPI_IN_PLACE`, a sentinel address never dereferenced by Tessera.
impl MpiHandle for *mut c_void {}

// SAFETY: see the type's docs; the handles are opaque identifiers owned by the MPI library.
unsafe impl<T: MpiHandle> Send for Handle<T> {}
// SAFETY: as above; shared handles (communicators, operators) are only read.
unsafe impl<T: MpiHandle> Sync for Handle<T> {}

/// The MPI datatype that moves elements of `dtype`.
pub(super) fn datatype(dtype: DType) -> ffi::MPI_Datatype {
    // SAFETY: reading the library's predefined datatype handles after MPI_Init.
    unsafe {
        match dtype {
            DType::F32 => ffi::RSMPI_FLOAT,
            DType::F64 => ffi::RSMPI_DOUBLE,
            DType::BF16 | DType::F16 => ffi::RSMPI_UINT16_T,
            DType::I64 => ffi::RSMPI_INT64_T,
            DType::U8 => ffi::RSMPI_UINT8_T,
        }
    }
}

/// Where empty buffers point: an empty slice's dangling pointer may equal the
/// library's `MPI_IN_PLACE` (`(void *) 1` in OpenMPI is a `&[u8]`'s), which would
/// change the call's meaning. MPI never reads or writes through it (count 0).
static EMPTY: [u64; 1] = [0];

fn empty() -> *mut c_void {
    EMPTY.as_ptr().cast_mut().cast()
}

/// Raw pointer to a buffer's first element.
pub(super) fn ptr(b: &Buf<'_>) -> *const c_void {
    if b.is_empty() {
        return empty();
    }
    crate::dispatch_buf!(Buf, b, s, _T => s.as_ptr().cast())
}

/// Raw pointer to an output buffer's first element.
pub(super) fn ptr_mut(b: &mut BufMut<'_>) -> *mut c_void {
    if b.is_empty() {
        return empty();
    }
    crate::dispatch_buf!(BufMut, b, s, _T => s.as_mut_ptr().cast())
}

/// The second half of `Avg` (a sum over `n` ranks): `x /= n` element-wise; nothing
/// for the other reductions. `Avg` is defined for floats only ([`ReduceOp::check`]).
pub(super) fn average(op: ReduceOp, b: &mut BufMut<'_>, n: usize) {
    if op != ReduceOp::Avg {
        return;
    }
    let d = n as f64;
    match b {
        BufMut::F32(x) => x.iter_mut().for_each(|v| *v /= d as f32),
        BufMut::F64(x) => x.iter_mut().for_each(|v| *v /= d),
        BufMut::BF16(x) => x.iter_mut().for_each(|v| *v = bf16::from_f32(v.to_f32() / d as f32)),
        BufMut::F16(x) => x.iter_mut().for_each(|v| *v = f16::from_f32(v.to_f32() / d as f32)),
        BufMut::I64(_) | BufMut::U8(_) => {}
    }
}

/// The `sendbuf` argument of an in-place reduction of `buf`: the library's
/// `MPI_IN_PLACE` where known, otherwise a copy of `buf` (kept alive by the
/// returned buffer for as long as the call runs).
pub(super) fn in_place_send(in_place: Option<Handle<*mut c_void>>, buf: &Buf<'_>) -> (*const c_void, Option<Buffer>) {
    match in_place {
        Some(p) => (p.get().cast_const(), None),
        None => {
            let copy = buf.to_buffer();
            (ptr(&copy.as_buf()), Some(copy))
        }
    }
}

#[inline]
fn max_nan(a: f32, b: f32) -> f32 {
    if a.is_nan() || b.is_nan() { f32::NAN } else { a.max(b) }
}

#[inline]
fn min_nan(a: f32, b: f32) -> f32 {
    if a.is_nan() || b.is_nan() { f32::NAN } else { a.min(b) }
}

/// Defines `unsafe extern "C" fn $name(in, inout, len, _)` with
/// `inout[i] = $f(in[i], inout[i])` over elements of `$t`.
macro_rules! user_fn {
    ($name:ident, $t:ty, $f:expr) => {
        unsafe extern "C" fn $name(a: *mut c_void, b: *mut c_void, len: *mut c_int, _: *mut ffi::MPI_Datatype) {
            let n = if len.is_null() {
                0
            } else {
                // SAFETY: `len` is not null, and MPI passes a pointer to the
                // element count that stays valid for the call.
                usize::try_from(unsafe { *len }).unwrap_or(0)
            };
            if n == 0 || a.is_null() || b.is_null() {
                return;
            }
            // SAFETY: MPI passes two buffers of `n` elements of the datatype the
            // operator was used with, which Tessera only pairs with `$t`.
            let (x, y) = unsafe {
                (
                    std::slice::from_raw_parts(a as *const $t, n),
                    std::slice::from_raw_parts_mut(b as *mut $t, n),
                )
            };
            let f = $f;
            for (y, &x) in y.iter_mut().zip(x) {
                *y = f(x, *y);
            }
        }
    };
}

macro_rules! half_fns {
    ($t:ident, $sum:ident, $prod:ident, $max:ident, $min:ident) => {
        user_fn!($sum, $t, |x: $t, y: $t| $t::from_f32(x.to_f32() + y.to_f32()));
        user_fn!($prod, $t, |x: $t, y: $t| $t::from_f32(x.to_f32() * y.to_f32()));
        user_fn!($max, $t, |x: $t, y: $t| $t::from_f32(max_nan(
            x.to_f32(),
            y.to_f32()
        )));
        user_fn!($min, $t, |x: $t, y: $t| $t::from_f32(min_nan(
            x.to_f32(),
            y.to_f32()
        )));
    };
}
half_fns!(bf16, bf16_sum, bf16_prod, bf16_max, bf16_min);
half_fns!(f16, f16_sum, f16_prod, f16_max, f16_min);
user_fn!(f32_max, f32, max_nan);
user_fn!(f32_min, f32, min_nan);
user_fn!(f64_max, f64, |x: f64, y: f64| if x.is_nan() || y.is_nan() {
    f64::NAN
} else {
    x.max(y)
});
user_fn!(f64_min, f64, |x: f64, y: f64| if x.is_nan() || y.is_nan() {
    f64::NAN
} else {
    x.min(y)
});

type UserFn = unsafe extern "C" fn(*mut c_void, *mut c_void, *mut c_int, *mut ffi::MPI_Datatype);

/// The user operators, created once after `MPI_Init`.
pub(super) struct Ops {
    /// `[sum, product, max, min]` for bf16, then f16.
    bf16: [Handle<ffi::MPI_Op>; 4],
    f16: [Handle<ffi::MPI_Op>; 4],
    /// `[max, min]` for f32, then f64.
    f32: [Handle<ffi::MPI_Op>; 2],
    f64: [Handle<ffi::MPI_Op>; 2],
}

fn create(f: UserFn) -> Result<Handle<ffi::MPI_Op>, String> {
    let mut op = std::mem::MaybeUninit::<ffi::MPI_Op>::uninit();
    // SAFETY: `f` has the MPI_User_function signature; `op` is a valid out-pointer.
    let rc = unsafe { ffi::MPI_Op_create(Some(f), 1, op.as_mut_ptr()) };
    if rc != 0 {
        return Err(format!("MPI_Op_create failed: {}", error_string(rc)));
    }
    // SAFETY: MPI_Op_create succeeded, so it wrote the handle.
    Ok(Handle(unsafe { op.assume_init() }))
}

impl Ops {
    /// Creates every operator (after `MPI_Init`).
    pub(super) fn create() -> Result<Ops, String> {
        Ok(Ops {
            bf16: [
                create(bf16_sum)?,
                create(bf16_prod)?,
                create(bf16_max)?,
                create(bf16_min)?,
            ],
            f16: [create(f16_sum)?, create(f16_prod)?, create(f16_max)?, create(f16_min)?],
            f32: [create(f32_max)?, create(f32_min)?],
            f64: [create(f64_max)?, create(f64_min)?],
        })
    }

    /// The operator that reduces `dtype` by `op` (`Avg` sums; the caller divides).
    /// `op` must be defined for `dtype` ([`ReduceOp::check`]).
    pub(super) fn get(&self, dtype: DType, op: ReduceOp) -> ffi::MPI_Op {
        let i = match op {
            ReduceOp::Sum | ReduceOp::Avg => 0,
            ReduceOp::Product => 1,
            ReduceOp::Max => 2,
            ReduceOp::Min => 3,
        };
        // SAFETY: reading the library's predefined operator handles after MPI_Init.
        let builtin = unsafe { [ffi::RSMPI_SUM, ffi::RSMPI_PROD, ffi::RSMPI_MAX, ffi::RSMPI_MIN] };
        match dtype {
            DType::BF16 => self.bf16[i].0,
            DType::F16 => self.f16[i].0,
            DType::F32 if i >= 2 => self.f32[i - 2].0,
            DType::F64 if i >= 2 => self.f64[i - 2].0,
            _ => builtin[i],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn apply(f: UserFn, x: &mut [f32], y: &mut [f32]) {
        let mut n = x.len() as c_int;
        // SAFETY: both slices hold `n` f32s; the datatype argument is unused.
        unsafe {
            f(
                x.as_mut_ptr().cast(),
                y.as_mut_ptr().cast(),
                &mut n,
                std::ptr::null_mut(),
            )
        };
    }

    #[test]
    fn user_operators_reduce_into_the_second_buffer() {
        let mut x = [1.0f32, f32::NAN, -3.0];
        let mut y = [2.0f32, 0.0, -4.0];
        apply(f32_max, &mut x, &mut y);
        assert_eq!(y[0], 2.0);
        assert!(y[1].is_nan(), "max propagates NaN like the threads backend");
        assert_eq!(y[2], -3.0);
        let (mut a, mut b) = ([bf16::from_f32(1.5); 3], [bf16::from_f32(2.0); 3]);
        let mut n: c_int = 3;
        // SAFETY: both arrays hold 3 bf16s.
        unsafe {
            bf16_sum(
                a.as_mut_ptr().cast(),
                b.as_mut_ptr().cast(),
                &mut n,
                std::ptr::null_mut(),
            )
        };
        assert_eq!(b, [bf16::from_f32(3.5); 3]);
        assert_eq!(a, [bf16::from_f32(1.5); 3], "the input buffer is left alone");
    }

    #[test]
    fn average_is_the_mean_for_avg_only() {
        let mut v = vec![bf16::from_f32(3.0), bf16::from_f32(-6.0)];
        average(ReduceOp::Avg, &mut BufMut::BF16(&mut v), 3);
        assert_eq!(v, [bf16::from_f32(1.0), bf16::from_f32(-2.0)]);
        let mut w = vec![9.0f64];
        average(ReduceOp::Avg, &mut BufMut::F64(&mut w), 4);
        assert_eq!(w, [2.25]);
        average(ReduceOp::Sum, &mut BufMut::F64(&mut w), 4);
        assert_eq!(w, [2.25], "a sum is left alone");
    }
}
