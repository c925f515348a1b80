//! Element types that communicators move, and typed views of host buffers.
//!
//! Collectives are object safe, so they take type-erased buffers: [`Buf`] (a
//! borrowed input), [`BufMut`] (a borrowed output) and [`Buffer`] (an owned
//! buffer, for the asynchronous forms). [`Element`] converts a typed slice into
//! them, so callers write `comm.all_gather((&send[..]).into(), (&mut recv[..]).into())`
//! or use the typed helpers of [`CommunicatorExt`](crate::CommunicatorExt).

use std::fmt;

use half::{bf16, f16};

/// The element type of a buffer or tensor.
///
/// `U8` is for raw bytes: flat buckets that pack tensors of several dtypes.
/// It can be gathered, scattered, broadcast and exchanged, but not reduced.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DType {
    /// 32-bit IEEE float.
    F32,
    /// 64-bit IEEE float.
    F64,
    /// bfloat16 (8-bit exponent, 7-bit mantissa).
    BF16,
    /// IEEE half precision.
    F16,
    /// 64-bit signed integer.
    I64,
    /// Raw bytes.
    U8,
}

impl DType {
    /// Size of one element in bytes.
    pub const fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F64 | DType::I64 => 8,
            DType::BF16 | DType::F16 => 2,
            DType::U8 => 1,
        }
    }

    /// Whether this is a floating-point type.
    pub const fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::BF16 | DType::F16)
    }

    /// Every dtype, in declaration order (handy for tests).
    pub const ALL: [DType; 6] = [DType::F32, DType::F64, DType::BF16, DType::F16, DType::I64, DType::U8];
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::I64 => "i64",
            DType::U8 => "u8",
        })
    }
}

mod sealed {
    pub trait Sealed {}
}

/// A type that communicators can move: `f32`, `f64`, `bf16`, `f16`, `i64`, `u8`.
///
/// Sealed: the set of element types is closed, so every backend handles all of them.
pub trait Element:
    sealed::Sealed + bytemuck::Pod + Copy + Send + Sync + Default + PartialEq + fmt::Debug + 'static
{
    /// The runtime tag of this type.
    const DTYPE: DType;
    /// Wraps a slice as a type-erased input buffer.
    fn buf(s: &[Self]) -> Buf<'_>;
    /// Wraps a mutable slice as a type-erased output buffer.
    fn buf_mut(s: &mut [Self]) -> BufMut<'_>;
    /// Wraps a vector as an owned buffer.
    fn into_buffer(v: Vec<Self>) -> Buffer;
    /// Unwraps an owned buffer of this type; returns it back when the dtype differs.
    fn from_buffer(b: Buffer) -> Result<Vec<Self>, Buffer>;
}

/// Applies `$m!(Variant, Type)` for every element type.
#[macro_export]
#[doc(hidden)]
macro_rules! for_each_dtype {
    ($m:ident) => {
        $m!(F32, f32);
        $m!(F64, f64);
        $m!(BF16, half::bf16);
        $m!(F16, half::f16);
        $m!(I64, i64);
        $m!(U8, u8);
    };
}

/// A borrowed, type-erased input buffer.
#[derive(Clone, Copy, Debug)]
#[allow(missing_docs)]
pub enum Buf<'a> {
    F32(&'a [f32]),
    F64(&'a [f64]),
    BF16(&'a [bf16]),
    F16(&'a [f16]),
    I64(&'a [i64]),
    U8(&'a [u8]),
}

/// A borrowed, type-erased output buffer.
#[derive(Debug)]
#[allow(missing_docs)]
pub enum BufMut<'a> {
    F32(&'a mut [f32]),
    F64(&'a mut [f64]),
    BF16(&'a mut [bf16]),
    F16(&'a mut [f16]),
    I64(&'a mut [i64]),
    U8(&'a mut [u8]),
}

/// An owned, type-erased buffer (the asynchronous collectives take and return these).
#[derive(Clone, Debug, PartialEq)]
#[allow(missing_docs)]
pub enum Buffer {
    F32(Vec<f32>),
    F64(Vec<f64>),
    BF16(Vec<bf16>),
    F16(Vec<f16>),
    I64(Vec<i64>),
    U8(Vec<u8>),
}

macro_rules! impl_element {
    ($v:ident, $t:ty) => {
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DType = DType::$v;
            fn buf(s: &[Self]) -> Buf<'_> {
                Buf::$v(s)
            }
            fn buf_mut(s: &mut [Self]) -> BufMut<'_> {
                BufMut::$v(s)
            }
            fn into_buffer(v: Vec<Self>) -> Buffer {
                Buffer::$v(v)
            }
            fn from_buffer(b: Buffer) -> Result<Vec<Self>, Buffer> {
                match b {
                    Buffer::$v(v) => Ok(v),
                    other => Err(other),
                }
            }
        }
        impl<'a> From<&'a [$t]> for Buf<'a> {
            fn from(s: &'a [$t]) -> Self {
                Buf::$v(s)
            }
        }
        impl<'a> From<&'a mut [$t]> for BufMut<'a> {
            fn from(s: &'a mut [$t]) -> Self {
                BufMut::$v(s)
            }
        }
        impl From<Vec<$t>> for Buffer {
            fn from(v: Vec<$t>) -> Self {
                Buffer::$v(v)
            }
        }
    };
}
for_each_dtype!(impl_element);

/// Dispatches on a type-erased buffer enum, binding the inner slice or vector to
/// `$x` with its element type as `$T`, and evaluates `$body` (written once,
/// generic over `$T: Element`).
#[macro_export]
#[doc(hidden)]
macro_rules! dispatch_buf {
    ($enum:ident, $val:expr, $x:ident, $T:ident => $body:expr) => {
        match $val {
            $crate::$enum::F32($x) => {
                type $T = f32;
                $body
            }
            $crate::$enum::F64($x) => {
                type $T = f64;
                $body
            }
            $crate::$enum::BF16($x) => {
                type $T = half::bf16;
                $body
            }
            $crate::$enum::F16($x) => {
                type $T = half::f16;
                $body
            }
            $crate::$enum::I64($x) => {
                type $T = i64;
                $body
            }
            $crate::$enum::U8($x) => {
                type $T = u8;
                $body
            }
        }
    };
}

impl Buf<'_> {
    /// The element type.
    pub fn dtype(&self) -> DType {
        crate::dispatch_buf!(Buf, self, _s, T => T::DTYPE)
    }
    /// Number of elements.
    pub fn len(&self) -> usize {
        crate::dispatch_buf!(Buf, self, s, _T => s.len())
    }
    /// Whether the buffer has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The bytes of the buffer.
    pub fn as_bytes(&self) -> &[u8] {
        crate::dispatch_buf!(Buf, self, s, _T => bytemuck::cast_slice(s))
    }
    /// Copies the buffer into an owned [`Buffer`].
    pub fn to_buffer(&self) -> Buffer {
        crate::dispatch_buf!(Buf, *self, s, _T => Buffer::from(s.to_vec()))
    }
}

impl BufMut<'_> {
    /// The element type.
    pub fn dtype(&self) -> DType {
        crate::dispatch_buf!(BufMut, self, _s, T => T::DTYPE)
    }
    /// Number of elements.
    pub fn len(&self) -> usize {
        crate::dispatch_buf!(BufMut, self, s, _T => s.len())
    }
    /// Whether the buffer has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Reborrows as an input buffer.
    pub fn as_buf(&self) -> Buf<'_> {
        crate::dispatch_buf!(BufMut, self, s, _T => Buf::from(&s[..]))
    }
    /// Reborrows mutably (so a `BufMut` can be passed on without being consumed).
    pub fn reborrow(&mut self) -> BufMut<'_> {
        crate::dispatch_buf!(BufMut, self, s, _T => BufMut::from(&mut s[..]))
    }
}

impl Buffer {
    /// A zero-filled buffer of `len` elements of `dtype`.
    pub fn zeros(dtype: DType, len: usize) -> Buffer {
        // Large ones from the rank's kept buffers first (see `pool`), refilled:
        // writes to mapped pages cost less than the faults of fresh ones.
        crate::pool::alloc(dtype, len, true)
    }
    /// The element type.
    pub fn dtype(&self) -> DType {
        crate::dispatch_buf!(Buffer, self, _s, T => T::DTYPE)
    }
    /// Number of elements.
    pub fn len(&self) -> usize {
        crate::dispatch_buf!(Buffer, self, s, _T => s.len())
    }
    /// Whether the buffer has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Borrows as an input buffer.
    pub fn as_buf(&self) -> Buf<'_> {
        crate::dispatch_buf!(Buffer, self, s, _T => Buf::from(&s[..]))
    }
    /// Borrows as an output buffer.
    pub fn as_buf_mut(&mut self) -> BufMut<'_> {
        crate::dispatch_buf!(Buffer, self, s, _T => BufMut::from(&mut s[..]))
    }
    /// Unwraps into a typed vector, or returns the buffer back when `T` is not its dtype.
    pub fn into_vec<T: Element>(self) -> Result<Vec<T>, Buffer> {
        T::from_buffer(self)
    }
}

/// An output buffer of `len` elements that a collective's kernel writes in full
/// before anyone reads it: allocated without zeroing (for the multi-megabyte
/// outputs of the asynchronous collectives, a zeroing pass costs about as much
/// as the copy that then overwrites it), and handed out as a [`Buffer`] only
/// once the kernel says every element is written.
pub(crate) struct Filling {
    /// Capacity `len`, length 0 until [`finish`](Self::finish).
    buf: Buffer,
    len: usize,
}

impl Filling {
    /// Room for `len` elements of `dtype`, none written yet.
    pub(crate) fn new(dtype: DType, len: usize) -> Filling {
        // A kept buffer first (see `pool`): its pages are mapped already.
        Filling {
            buf: crate::pool::alloc(dtype, len, false),
            len,
        }
    }

    /// The element type.
    pub(crate) fn dtype(&self) -> DType {
        self.buf.dtype()
    }

    /// Elements to be written.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The address of the first element (writes go through it; the
    /// allocation does not move while `self` lives).
    pub(crate) fn addr(&mut self) -> usize {
        crate::dispatch_buf!(Buffer, &mut self.buf, v, _T => v.as_mut_ptr() as usize)
    }

    /// The written buffer.
    ///
    /// # Safety
    /// All `len` elements must have been written through [`addr`](Self::addr).
    pub(crate) unsafe fn finish(mut self) -> Buffer {
        let len = self.len;
        // SAFETY: the capacity is at least `len` (from `new`) and the caller
        // guarantees that every element below it is initialised.
        crate::dispatch_buf!(Buffer, &mut self.buf, v, _T => unsafe { v.set_len(len) });
        self.buf
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_tags() {
        macro_rules! case {
            ($t:ty, $d:expr, $n:expr) => {
                assert_eq!(<$t as Element>::DTYPE, $d);
                assert_eq!($d.size_in_bytes(), $n);
                assert_eq!($d.size_in_bytes(), std::mem::size_of::<$t>());
            };
        }
        case!(f32, DType::F32, 4);
        case!(f64, DType::F64, 8);
        case!(bf16, DType::BF16, 2);
        case!(f16, DType::F16, 2);
        case!(i64, DType::I64, 8);
        case!(u8, DType::U8, 1);
    }

    #[test]
    fn buffers_round_trip() {
        let v = vec![1.0f32, 2.0, 3.0];
        let b = Buffer::from(v.clone());
        assert_eq!(b.dtype(), DType::F32);
        assert_eq!(b.len(), 3);
        assert_eq!(b.as_buf().as_bytes().len(), 12);
        assert_eq!(b.clone().into_vec::<f32>().unwrap(), v);
        assert!(b.into_vec::<f64>().is_err());
        assert_eq!(Buffer::zeros(DType::I64, 2), Buffer::I64(vec![0, 0]));
        assert_eq!(DType::BF16.to_string(), "bf16");
        assert!(DType::F16.is_float() && !DType::I64.is_float());
    }
}
