//! Storage of tensors: host memory, device memory, or none (meta).

use tessera_mesh::{Buf, Buffer, DType, Element};

use crate::kernel::Scalar;

use crate::memory::Allocation;
use crate::{Error, Result};

/// Where a storage's elements are.
#[derive(Debug)]
pub(crate) enum Data {
    /// In host memory.
    Host(Buffer),
    /// In device memory.
    #[cfg(feature = "cuda")]
    Cuda(crate::cuda::CudaBuffer),
    /// Nowhere: a meta storage's dtype and length, charged as host bytes.
    Meta(DType, usize),
}

/// One flat, immutable buffer that tensors view through a layout.
///
/// Charged to the allocating rank by the memory tracker while it lives (host
/// and device bytes counted apart).
#[derive(Debug)]
pub(crate) struct Storage {
    data: Data,
    _charge: Allocation,
}

impl Storage {
    /// Wraps `data`, charging its bytes to the current thread's rank.
    pub(crate) fn new(data: Buffer) -> Storage {
        crate::alloc::tune_malloc_once();
        let (bytes, len) = (data.len() * data.dtype().size_in_bytes(), data.len());
        Storage {
            data: Data::Host(data),
            _charge: Allocation::charge_storage(bytes, len),
        }
    }

    /// Wraps device memory, charging its bytes to the current rank's device bytes.
    #[cfg(feature = "cuda")]
    pub(crate) fn new_cuda(data: crate::cuda::CudaBuffer) -> Storage {
        let bytes = data.len() * data.dtype().size_in_bytes();
        Storage {
            data: Data::Cuda(data),
            _charge: Allocation::charge_device(bytes),
        }
    }

    /// A meta storage of `len` elements of `dtype`: no memory, but its bytes
    /// charged to the current thread's rank as host bytes, as the host storage
    /// it stands for would be.
    pub(crate) fn new_meta(dtype: DType, len: usize) -> Storage {
        Storage {
            data: Data::Meta(dtype, len),
            _charge: Allocation::charge_storage(len * dtype.size_in_bytes(), len),
        }
    }

    /// The memory tracker's charge of this storage (to move it to another
    /// [`Category`](crate::memory::Category)).
    pub(crate) fn charge(&self) -> &Allocation {
        &self._charge
    }

    /// The host buffer, or an error naming the device for device and meta storage.
    pub(crate) fn data(&self) -> Result<&Buffer> {
        match &self.data {
            Data::Host(b) => Ok(b),
            Data::Meta(..) => Err(meta_error("host access")),
            #[cfg(feature = "cuda")]
            Data::Cuda(b) => Err(Error::Device {
                op: "host access",
                detail: format!(
                    "the tensor is on cuda:{}, and this operation reads its elements on the host \
                     (it has no CUDA kernel yet); copy it with .to(Device::Cpu) first",
                    b.ordinal()
                ),
            }),
        }
    }

    /// The device buffer, if the storage is on a GPU.
    #[cfg(feature = "cuda")]
    pub(crate) fn cuda(&self) -> Option<&crate::cuda::CudaBuffer> {
        match &self.data {
            Data::Cuda(b) => Some(b),
            Data::Host(_) | Data::Meta(..) => None,
        }
    }

    /// The device that holds the elements.
    pub(crate) fn device(&self) -> crate::Device {
        match &self.data {
            Data::Host(_) => crate::Device::Cpu,
            #[cfg(feature = "cuda")]
            Data::Cuda(b) => crate::Device::Cuda(b.ordinal()),
            Data::Meta(..) => crate::Device::Meta,
        }
    }

    /// The number of elements.
    pub(crate) fn len(&self) -> usize {
        match &self.data {
            Data::Host(b) => b.len(),
            #[cfg(feature = "cuda")]
            Data::Cuda(b) => b.len(),
            Data::Meta(_, len) => *len,
        }
    }

    /// The host buffer, mutably (for the storage's sole owner); `None` on a
    /// device or meta.
    pub(crate) fn data_mut(&mut self) -> Option<&mut Buffer> {
        match &mut self.data {
            Data::Host(b) => Some(b),
            #[cfg(feature = "cuda")]
            Data::Cuda(_) => None,
            Data::Meta(..) => None,
        }
    }

    /// Moves the host buffer out (the storage is left empty, and its charge
    /// goes when it drops); `None` on a device or meta.
    pub(crate) fn take_data(&mut self) -> Option<Buffer> {
        match &mut self.data {
            Data::Host(b) => Some(std::mem::replace(b, Buffer::U8(Vec::new()))),
            #[cfg(feature = "cuda")]
            Data::Cuda(_) => None,
            Data::Meta(..) => None,
        }
    }
}

impl Drop for Storage {
    fn drop(&mut self) {
        // Large buffers go back to this thread's cache for the next exchange.
        if let Some(data) = self.take_data() {
            crate::alloc::recycle(data);
        }
    }
}

impl Storage {
    pub(crate) fn dtype(&self) -> DType {
        match &self.data {
            Data::Host(b) => b.dtype(),
            #[cfg(feature = "cuda")]
            Data::Cuda(b) => b.dtype(),
            Data::Meta(dtype, _) => *dtype,
        }
    }
}

/// The error of an operation `op` that needs the values of a meta tensor.
pub(crate) fn meta_error(op: &'static str) -> Error {
    Error::Device {
        op,
        detail: "the tensor is on the meta device: it has a shape and a dtype but no values (a planning \
                 run's tensor); run on cpu or cuda tensors to read values"
            .into(),
    }
}

/// The elements of `buf` as `&[T]`, or `None` when `T` is not its dtype.
pub(crate) fn typed<T: Element>(buf: Buf<'_>) -> Option<&[T]> {
    if buf.dtype() != T::DTYPE {
        return None;
    }
    // Same dtype, so the inner slice is a `[T]`: the cast never fails.
    tessera_mesh::dispatch_buf!(Buf, buf, s, _S => bytemuck::try_cast_slice(s).ok())
}

/// Converts a fill value for a constructor: floats take any value; integers
/// take finite values in range and truncate toward zero.
pub(crate) fn fill_value<T: Scalar>(op: &'static str, v: f64) -> Result<T> {
    if !T::DTYPE.is_float() {
        let (lo, hi) = T::RANGE;
        // Compare the truncated value, so that 255.5 fills a u8 with 255. The upper
        // bound is exclusive: `hi + 1.0` is 256 for u8 and 2^63 for i64 (where
        // `hi` itself already rounds to 2^63, which does not fit).
        let t = v.trunc();
        let fits = v.is_finite() && t >= lo && t < hi + 1.0;
        if !fits {
            return Err(Error::InvalidArgument {
                op,
                detail: format!(
                    "value {v} does not fit dtype {} (range {lo}..={hi}); \
                     use a float dtype or a value in range",
                    T::DTYPE
                ),
            });
        }
    }
    Ok(T::from_f64(v))
}

/// Dispatches on an owned or borrowed [`Buffer`], binding the inner vector to
/// `$x` and its element type to `$T` (which implements [`Scalar`]).
macro_rules! with_buffer {
    ($val:expr, $x:ident, $T:ident => $body:expr) => {
        tessera_mesh::dispatch_buf!(Buffer, $val, $x, $T => $body)
    };
}
pub(crate) use with_buffer;

#[cfg(test)]
mod tests {
    use half::{bf16, f16};

    use super::*;
    use crate::kernel::{convert, convert_extend};

    #[test]
    fn slice_conversions_match_the_element_conversion() {
        // Every bf16 to f32.
        let all: Vec<bf16> = (0..=u16::MAX).map(bf16::from_bits).collect();
        let mut wide: Vec<f32> = Vec::new();
        convert_extend(&all, &mut wide);
        assert_eq!(wide.len(), all.len());
        for (&b, &w) in all.iter().zip(&wide) {
            let want: f32 = convert(b);
            if b.is_nan() {
                // The bits shifted keep a signalling NaN's payload as it is.
                assert!(w.is_nan() && w.is_sign_negative() == b.is_sign_negative(), "{b:?}");
            } else {
                assert_eq!(w.to_bits(), want.to_bits(), "{b:?}");
            }
        }
        // f32 to bf16: every 251st bit pattern (all exponents, NaNs and
        // infinities), and each bf16 neighbourhood's ties and near-ties.
        let mut xs: Vec<f32> = (0..=u32::MAX).step_by(251).map(f32::from_bits).collect();
        for &w in &wide {
            let b = w.to_bits();
            for d in [0x7fffu32, 0x8000, 0x8001, 0x1_8000, 0x1_7fff] {
                xs.push(f32::from_bits(b.wrapping_add(d)));
            }
        }
        xs.extend([
            f32::MAX,
            f32::MIN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
            0.0,
            -0.0,
        ]);
        let mut narrow = vec![bf16::ONE];
        convert_extend(&xs, &mut narrow);
        assert_eq!(narrow.remove(0), bf16::ONE, "appended after what was there");
        assert_eq!(narrow.len(), xs.len());
        for (&x, &n) in xs.iter().zip(&narrow) {
            let want: bf16 = convert(x);
            if x.is_nan() {
                assert!(
                    n.is_nan() && n.is_sign_negative() == x.is_sign_negative(),
                    "{x:?} -> {n:?}"
                );
            } else {
                assert_eq!(n.to_bits(), want.to_bits(), "{x:?} ({:#x})", x.to_bits());
            }
        }
    }

    #[test]
    fn conversions() {
        macro_rules! case {
            ($s:ty, $v:expr, $d:ty, $want:expr) => {
                assert_eq!(
                    convert::<$s, $d>($v),
                    $want,
                    "{:?} as {}",
                    $v,
                    stringify!($d)
                );
            };
        }
        case!(f32, 2.7f32, i64, 2);
        case!(f32, -2.7f32, i64, -2);
        case!(f64, f64::NAN, i64, 0);
        case!(f64, 1e30, i64, i64::MAX);
        case!(f32, 300.0f32, u8, 255);
        case!(f32, -3.0f32, u8, 0);
        case!(i64, 257i64, u8, 1);
        case!(i64, -1i64, u8, 255);
        case!(u8, 200u8, i64, 200);
        case!(f32, 1.0 + 2f32.powi(-8), bf16, bf16::from_f32(1.0));
        case!(f64, 65520.0f64, f16, f16::INFINITY);
        case!(bf16, bf16::from_f32(3.5), f16, f16::from_f32(3.5));
        case!(i64, 1i64 << 40, f64, (1u64 << 40) as f64);
    }

    #[test]
    fn fill_values() {
        macro_rules! case {
            ($t:ty, $v:expr, ok $want:expr) => {
                assert_eq!(fill_value::<$t>("t", $v).unwrap(), $want, "{}", $v);
            };
            ($t:ty, $v:expr, err) => {
                let e = fill_value::<$t>("t", $v).unwrap_err().to_string();
                assert!(e.contains("does not fit dtype"), "{}: {e}", $v);
            };
        }
        case!(u8, 255.0, ok 255);
        case!(u8, 255.5, ok 255);
        case!(u8, -0.5, ok 0);
        case!(u8, 3.9, ok 3);
        case!(u8, 256.0, err);
        case!(u8, -1.0, err);
        case!(u8, f64::NAN, err);
        case!(i64, -7.9, ok - 7);
        case!(i64, f64::INFINITY, err);
        case!(i64, 9.3e18, err);
        case!(i64, -(2f64.powi(63)), ok i64::MIN);
        case!(i64, 2f64.powi(63), err);
        case!(f32, f64::INFINITY, ok f32::INFINITY);
        case!(bf16, 1.0, ok bf16::ONE);
    }
}
