//! Constructors: zeros, ones, full, from data, ranges and random tensors.

use ndarray::{Array, Dimension};
use tessera_mesh::{Buffer, DType, Element};

use super::Tensor;
use super::geometry::checked_numel;
use super::storage::{fill_value, with_buffer};
use crate::alloc::zeros_buffer;
use crate::kernel::Scalar;
use crate::rng::Rng;
use crate::{Error, Result};

/// Fills `v` with one value from `f` per element, in row-major order.
fn fill_with<T: Scalar>(v: &mut [T], mut f: impl FnMut() -> T) {
    v.iter_mut().for_each(|x| *x = f());
}

/// Errors unless `dtype` is a float type (random tensors and the like).
fn require_float(op: &'static str, dtype: DType) -> Result<()> {
    if dtype.is_float() {
        Ok(())
    } else {
        Err(Error::InvalidArgument {
            op,
            detail: format!(
                "dtype {dtype} is not a floating-point type; generate a float tensor \
                 and cast it"
            ),
        })
    }
}

impl Tensor {
    /// A tensor of `shape` and `dtype` on the meta device: no values and no
    /// memory, but its bytes charged to the memory tracker as a host tensor's
    /// would be (see [`Device::Meta`](crate::Device::Meta)). PyTorch:
    /// `torch.empty(shape, device="meta")`.
    ///
    /// ```
    /// use tessera_tensor::{DType, Device, Tensor};
    ///
    /// let w = Tensor::meta(&[4096, 4096], DType::F32)?;
    /// let x = Tensor::meta(&[8, 4096], DType::F32)?;
    /// let y = x.matmul(&w.transpose(0, 1)?)?; // shapes checked, nothing computed
    /// assert_eq!((y.shape(), y.device()), (&[8, 4096][..], Device::Meta));
    /// assert!(y.to_vec::<f32>().is_err()); // no values to read
    /// # Ok::<(), tessera_tensor::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::OutOfMemory`] when the element or byte count overflows (as
    /// [`zeros`](Self::zeros) would).
    pub fn meta(shape: &[usize], dtype: DType) -> Result<Tensor> {
        let n = crate::alloc::checked_len("meta", shape, dtype)?;
        Ok(Tensor::from_parts(
            std::sync::Arc::new(super::storage::Storage::new_meta(dtype, n)),
            super::geometry::Geometry::contiguous(shape),
        ))
    }

    /// A new meta tensor of this (meta) tensor's shape and dtype: the output of
    /// an op that copies it.
    pub(crate) fn meta_copy(&self) -> Tensor {
        match Tensor::meta(self.shape(), self.dtype()) {
            Ok(t) => t,
            // INVARIANT: this tensor exists, so its size was checked when it was made.
            Err(e) => unreachable!("a tensor's own size is valid: {e}"),
        }
    }

    /// A tensor of `shape` filled with zeros. PyTorch: `torch.zeros`.
    ///
    /// # Errors
    /// [`Error::OutOfMemory`] naming the shape, dtype and bytes when the memory
    /// cannot be allocated (or its size overflows).
    pub fn zeros(shape: &[usize], dtype: DType) -> Result<Tensor> {
        Ok(Tensor::from_storage_data(zeros_buffer("zeros", shape, dtype)?, shape))
    }

    /// A tensor of `shape` filled with ones. PyTorch: `torch.ones`.
    ///
    /// # Errors
    /// [`Error::OutOfMemory`] as for [`zeros`](Self::zeros).
    pub fn ones(shape: &[usize], dtype: DType) -> Result<Tensor> {
        Tensor::full_op("ones", shape, 1.0, dtype)
    }

    /// A tensor of `shape` filled with `value`. PyTorch: `torch.full`.
    ///
    /// Float dtypes take any value (rounded to nearest; out of range gives
    /// infinity). Integer dtypes (`I64`, `U8`) truncate toward zero (`3.7` → 3)
    /// and reject NaN, infinities and values out of range (`U8` holds 0..=255).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a value the dtype cannot hold;
    /// [`Error::OutOfMemory`] as for [`zeros`](Self::zeros).
    pub fn full(shape: &[usize], value: f64, dtype: DType) -> Result<Tensor> {
        Tensor::full_op("full", shape, value, dtype)
    }

    fn full_op(op: &'static str, shape: &[usize], value: f64, dtype: DType) -> Result<Tensor> {
        let mut data = zeros_buffer(op, shape, dtype)?;
        with_buffer!(&mut data, v, T => {
            let x = fill_value::<T>(op, value)?;
            v.fill(x);
        });
        Ok(Tensor::from_storage_data(data, shape))
    }

    /// A rank-0 tensor holding `value`, converted as by [`full`](Self::full).
    /// PyTorch: `torch.tensor(value, dtype=...)`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a value the dtype cannot hold.
    pub fn scalar(value: f64, dtype: DType) -> Result<Tensor> {
        Tensor::full_op("scalar", &[], value, dtype)
    }

    /// A tensor of `shape` that takes ownership of `data` (row-major), without copying.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] when `data.len()` is not the product of `shape`.
    pub fn from_vec<T: Element>(data: Vec<T>, shape: &[usize]) -> Result<Tensor> {
        Tensor::from_buffer_op("from_vec", T::into_buffer(data), shape)
    }

    /// A tensor of `shape` holding a copy of `data` (row-major).
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] when `data.len()` is not the product of `shape`.
    pub fn from_slice<T: Element>(data: &[T], shape: &[usize]) -> Result<Tensor> {
        Tensor::check_len("from_slice", data.len(), shape)?;
        Tensor::from_buffer_op("from_slice", T::into_buffer(data.to_vec()), shape)
    }

    /// A tensor of `shape` that takes ownership of a type-erased buffer (as the
    /// asynchronous collectives return them), without copying.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] when the buffer's length is not the product of `shape`.
    pub fn from_buffer(data: Buffer, shape: &[usize]) -> Result<Tensor> {
        Tensor::from_buffer_op("from_buffer", data, shape)
    }

    fn from_buffer_op(op: &'static str, data: Buffer, shape: &[usize]) -> Result<Tensor> {
        Tensor::check_len(op, data.len(), shape)?;
        Ok(Tensor::from_storage_data(data, shape))
    }

    fn check_len(op: &'static str, len: usize, shape: &[usize]) -> Result<()> {
        let n = checked_numel(op, shape)?;
        if len == n {
            Ok(())
        } else {
            Err(Error::ShapeMismatch {
                op,
                detail: format!(
                    "{len} elements given for shape {shape:?}, which holds {n}; \
                     pass exactly as many elements as the shape's product"
                ),
            })
        }
    }

    /// A tensor holding a copy of an ndarray array (any dimensionality and
    /// memory order; the copy is row-major).
    pub fn from_ndarray<T: Element, D: Dimension>(array: Array<T, D>) -> Tensor {
        let shape = array.shape().to_vec();
        let n = array.len();
        let data = if array.is_standard_layout() {
            // Row-major already: reuse the vector, dropping any sliced-off head and tail.
            let (mut v, offset) = array.into_raw_vec_and_offset();
            let start = if n == 0 { 0 } else { offset.unwrap_or(0) };
            v.truncate(start + n);
            v.drain(..start);
            v
        } else {
            array.iter().copied().collect()
        };
        Tensor::from_storage_data(T::into_buffer(data), &shape)
    }

    /// The 1-D tensor `[0, 1, ..., n - 1]`. PyTorch: `torch.arange(n)`.
    ///
    /// Float dtypes round values they cannot hold exactly (bf16 holds integers
    /// exactly only up to 256).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `n - 1` does not fit an integer dtype
    /// (`U8` allows `n <= 256`); [`Error::OutOfMemory`] as for [`zeros`](Self::zeros).
    pub fn arange(n: usize, dtype: DType) -> Result<Tensor> {
        let mut data = zeros_buffer("arange", &[n], dtype)?;
        with_buffer!(&mut data, v, T => {
            if let Some(last) = n.checked_sub(1) {
                fill_value::<T>("arange", last as f64)?;
            }
            let mut i = 0i64;
            fill_with(v, || {
                let x = T::from_i64(i);
                i += 1;
                x
            });
        });
        Ok(Tensor::from_storage_data(data, &[n]))
    }

    /// A tensor of standard normal samples (mean 0, variance 1), the same for
    /// the same seed on every rank and platform. PyTorch: `torch.randn` after
    /// `torch.manual_seed(seed)` (the values differ from PyTorch's).
    ///
    /// Samples are drawn in `f64` and rounded to `dtype`, so one seed gives
    /// the same values, up to rounding, in every float dtype.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an integer dtype (`I64`, `U8`): draw floats
    /// and [`cast`](Self::cast) them; [`Error::OutOfMemory`] as for
    /// [`zeros`](Self::zeros).
    pub fn randn(shape: &[usize], dtype: DType, seed: u64) -> Result<Tensor> {
        require_float("randn", dtype)?;
        let mut data = zeros_buffer("randn", shape, dtype)?;
        let mut rng = Rng::new(seed);
        with_buffer!(&mut data, v, T => fill_with(v, || T::from_f64(rng.normal())));
        Ok(Tensor::from_storage_data(data, shape))
    }

    /// A tensor of samples uniform on `[0, 1)`, deterministic per seed.
    /// PyTorch: `torch.rand`.
    ///
    /// Each sample is a multiple of `2^-p` with `p` the mantissa bits of
    /// `dtype` (24 for f32, 8 for bf16, ...), so it is exact in `dtype` and
    /// never rounds up to 1.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an integer dtype (`I64`, `U8`);
    /// [`Error::OutOfMemory`] as for [`zeros`](Self::zeros).
    pub fn rand(shape: &[usize], dtype: DType, seed: u64) -> Result<Tensor> {
        require_float("rand", dtype)?;
        let mut data = zeros_buffer("rand", shape, dtype)?;
        let mut rng = Rng::new(seed);
        with_buffer!(&mut data, v, T => {
            fill_with(v, || T::from_f64(rng.uniform_bits(T::MANTISSA_BITS)))
        });
        Ok(Tensor::from_storage_data(data, shape))
    }
}

#[cfg(test)]
mod tests {
    use half::{bf16, f16};
    use ndarray::{ArrayD, IxDyn, array, s};

    use super::*;

    #[test]
    fn filled_constructors_in_every_dtype() {
        macro_rules! case {
            ($make:expr, $shape:expr, $want:expr) => {
                for dtype in DType::ALL {
                    let t = $make(dtype).unwrap();
                    assert_eq!(t.dtype(), dtype);
                    assert_eq!(t.shape(), &$shape[..], "{dtype}");
                    assert!(t.is_contiguous());
                    let want: Vec<f64> = $want;
                    assert_eq!(t.to_f64_vec(), want, "{dtype}");
                }
            };
        }
        case!(|d| Tensor::zeros(&[2, 3], d), [2, 3], vec![0.0; 6]);
        case!(|d| Tensor::ones(&[4], d), [4], vec![1.0; 4]);
        case!(|d| Tensor::full(&[1, 2], 7.0, d), [1, 2], vec![7.0; 2]);
        case!(|d| Tensor::scalar(3.0, d), [0usize; 0], vec![3.0]);
        case!(|d| Tensor::arange(5, d), [5], vec![0.0, 1.0, 2.0, 3.0, 4.0]);
        case!(|d| Tensor::arange(0, d), [0], vec![]);
        case!(|d| Tensor::zeros(&[3, 0], d), [3, 0], vec![]);
    }

    #[test]
    fn fill_values_are_converted_per_dtype() {
        macro_rules! case {
            ($value:expr, $dtype:expr, $want:expr) => {
                let t = Tensor::full(&[2], $value, $dtype).unwrap();
                assert_eq!(t.to_f64_vec(), vec![$want; 2], "{} as {}", $value, $dtype);
            };
        }
        case!(3.7, DType::I64, 3.0);
        case!(-3.7, DType::I64, -3.0);
        case!(255.0, DType::U8, 255.0);
        case!(3.9, DType::U8, 3.0);
        case!(0.1, DType::F64, 0.1);
        case!(0.1, DType::F32, 0.1f32 as f64);
        case!(1.00390625, DType::BF16, 1.0); // ties to even at 8 mantissa bits
        case!(257.0, DType::BF16, 256.0);
        case!(1e6, DType::F16, f64::INFINITY);
    }

    #[test]
    fn constructor_errors() {
        macro_rules! case {
            ($res:expr, $needle:expr) => {
                let e = $res.unwrap_err().to_string();
                assert!(e.contains($needle), "{e:?} lacks {:?}", $needle);
            };
        }
        case!(
            Tensor::full(&[2], 256.0, DType::U8),
            "full: value 256 does not fit dtype u8"
        );
        case!(Tensor::full(&[2], -1.0, DType::U8), "does not fit dtype u8");
        case!(Tensor::full(&[2], f64::NAN, DType::I64), "does not fit dtype i64");
        case!(Tensor::scalar(1e300, DType::I64), "scalar: value");
        case!(
            Tensor::arange(257, DType::U8),
            "arange: value 256 does not fit dtype u8"
        );
        case!(
            Tensor::randn(&[2], DType::I64, 0),
            "randn: dtype i64 is not a floating-point"
        );
        case!(
            Tensor::rand(&[2], DType::U8, 0),
            "rand: dtype u8 is not a floating-point"
        );
        case!(
            Tensor::zeros(&[usize::MAX, 2], DType::F32),
            "zeros: cannot allocate 147573952589676412920 bytes for a [18446744073709551615, 2] f32 tensor"
        );
        case!(
            Tensor::zeros(&[usize::MAX / 2], DType::F32),
            "zeros: cannot allocate 36893488147419103228 bytes"
        );
        case!(
            Tensor::from_vec(vec![1.0f32; 5], &[2, 3]),
            "from_vec: shape mismatch: 5 elements given for shape [2, 3], which holds 6"
        );
        case!(
            Tensor::from_slice(&[1u8; 2], &[3]),
            "from_slice: shape mismatch: 2 elements"
        );
        case!(
            Tensor::from_buffer(Buffer::I64(vec![]), &[1]),
            "from_buffer: shape mismatch"
        );
        assert!(Tensor::arange(256, DType::U8).is_ok());
    }

    #[test]
    fn huge_shapes_are_errors_not_aborts() {
        // 2^40 bytes and more: the allocator refuses them at once (also under
        // Linux's overcommit), so no test touches that memory.
        macro_rules! case {
            ($res:expr, $want:expr) => {
                let e = $res.unwrap_err();
                assert!(matches!(e, Error::OutOfMemory { .. }), "{e:?}");
                assert!(e.to_string().starts_with($want), "{e} lacks {:?}", $want);
            };
        }
        const T: usize = 1 << 40;
        const M: usize = 1 << 20;
        case!(
            Tensor::zeros(&[T], DType::F32),
            "zeros: cannot allocate 4398046511104 bytes for a [1099511627776] f32 tensor"
        );
        case!(
            Tensor::ones(&[T], DType::F64),
            "ones: cannot allocate 8796093022208 bytes for a [1099511627776] f64 tensor"
        );
        case!(
            Tensor::full(&[T], 2.0, DType::I64),
            "full: cannot allocate 8796093022208 bytes for a [1099511627776] i64 tensor"
        );
        case!(
            Tensor::randn(&[T], DType::F32, 0),
            "randn: cannot allocate 4398046511104 bytes for a [1099511627776] f32 tensor"
        );
        case!(
            Tensor::rand(&[T, 4], DType::F16, 0),
            "rand: cannot allocate 8796093022208 bytes for a [1099511627776, 4] f16 tensor"
        );
        case!(
            Tensor::arange(T, DType::F32),
            "arange: cannot allocate 4398046511104 bytes for a [1099511627776] f32 tensor"
        );
        case!(
            Tensor::zeros(&[M, M], DType::BF16),
            "zeros: cannot allocate 2199023255552 bytes for a [1048576, 1048576] bf16 tensor"
        );
        case!(
            Tensor::zeros(&[T, T], DType::F32),
            "zeros: cannot allocate 4835703278458516698824704 bytes for a [1099511627776, 1099511627776] f32"
        );
        case!(
            Tensor::zeros(&[T, T, T, T], DType::U8),
            "zeros: cannot allocate more than 2^128 bytes for a"
        );
        // A float to an integer dtype too large for memory: the size is checked first.
        case!(
            Tensor::full(&[T], 1e300, DType::U8),
            "full: cannot allocate 1099511627776 bytes"
        );
        // Zero-size tensors of huge dims need no memory.
        assert_eq!(Tensor::zeros(&[T, 0, T], DType::F64).unwrap().numel(), 0);
    }

    #[test]
    fn from_data_in_every_dtype() {
        fn case<T: Element>(v: Vec<T>) {
            let t = Tensor::from_vec(v.clone(), &[2, 2]).unwrap();
            assert_eq!((t.shape(), t.dtype()), (&[2, 2][..], T::DTYPE));
            assert_eq!(t.to_vec::<T>().unwrap(), v);
            let t = Tensor::from_slice(&v, &[4]).unwrap();
            assert_eq!((t.shape(), t.to_vec::<T>().unwrap()), (&[4][..], v.clone()));
            let t = Tensor::from_buffer(T::into_buffer(v.clone()), &[1, 4, 1]).unwrap();
            assert_eq!((t.shape(), t.to_vec::<T>().unwrap()), (&[1, 4, 1][..], v));
        }
        case(vec![1.5f32, -2.0, 0.0, 9.0]);
        case(vec![1.5f64, -2.0, 0.0, 1e100]);
        case([1.5f32, -2.0, 0.0, 9.0].map(bf16::from_f32).to_vec());
        case([1.5f32, -2.0, 0.0, 9.0].map(f16::from_f32).to_vec());
        case(vec![1i64, -2, 0, i64::MAX]);
        case(vec![1u8, 2, 0, 255]);
        let s = Tensor::from_vec(vec![4.0f64], &[]).unwrap();
        assert_eq!((s.rank(), s.to_vec::<f64>().unwrap()), (0, vec![4.0]));
    }

    #[test]
    fn from_ndarray_any_layout() {
        macro_rules! case {
            ($a:expr, $shape:expr, $want:expr) => {
                let t = Tensor::from_ndarray($a);
                assert_eq!(t.shape(), &$shape[..]);
                assert_eq!(t.to_vec::<i64>().unwrap(), $want);
                assert!(t.is_contiguous());
            };
        }
        let a = array![[1i64, 2, 3], [4, 5, 6]];
        case!(a.clone(), [2, 3], vec![1, 2, 3, 4, 5, 6]);
        case!(a.clone().reversed_axes(), [3, 2], vec![1, 4, 2, 5, 3, 6]);
        let mut tail = a.clone();
        tail.slice_collapse(s![1.., ..]);
        case!(tail, [1, 3], vec![4, 5, 6]);
        let mut cols = a.clone();
        cols.slice_collapse(s![.., 1..]);
        case!(cols, [2, 2], vec![2, 3, 5, 6]);
        case!(ArrayD::<i64>::zeros(IxDyn(&[0, 4])), [0, 4], Vec::<i64>::new());
        case!(ndarray::arr0(9i64), [0usize; 0], vec![9]);
    }

    #[test]
    fn randn_is_deterministic_and_standard_normal() {
        let a = Tensor::randn(&[100, 100], DType::F64, 42).unwrap();
        assert_eq!(a, Tensor::randn(&[100, 100], DType::F64, 42).unwrap());
        assert_ne!(a, Tensor::randn(&[100, 100], DType::F64, 43).unwrap());
        let v = a.to_f64_vec();
        let n = v.len() as f64;
        let mean = v.iter().sum::<f64>() / n;
        let std = (v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n).sqrt();
        // 10k samples: the standard error of the mean is 0.01, of the std 0.007.
        assert!(mean.abs() < 0.05, "mean {mean}");
        assert!((std - 1.0).abs() < 0.05, "std {std}");
        let beyond_3 = v.iter().filter(|x| x.abs() > 3.0).count();
        assert!(beyond_3 < 60, "{beyond_3} samples beyond 3 sigma (expect ~27)");
        // Every float dtype rounds the same draws.
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let t = Tensor::randn(&[100, 100], dtype, 42).unwrap();
            assert_eq!(t.dtype(), dtype);
            assert_eq!(t, a.cast(dtype).unwrap(), "{dtype}");
        }
    }

    #[test]
    fn rand_is_deterministic_and_uniform() {
        for dtype in [DType::F64, DType::F32, DType::BF16, DType::F16] {
            let t = Tensor::rand(&[10_000], dtype, 7).unwrap();
            assert_eq!(t, Tensor::rand(&[10_000], dtype, 7).unwrap(), "{dtype}");
            let v = t.to_f64_vec();
            assert!(v.iter().all(|x| (0.0..1.0).contains(x)), "{dtype} out of [0, 1)");
            let mean = v.iter().sum::<f64>() / v.len() as f64;
            assert!((mean - 0.5).abs() < 0.02, "{dtype} mean {mean}");
            let low = v.iter().filter(|&&x| x < 0.25).count();
            assert!((2300..2700).contains(&low), "{dtype}: {low} below 0.25");
        }
        assert_ne!(
            Tensor::rand(&[8], DType::F32, 1).unwrap(),
            Tensor::rand(&[8], DType::F32, 2).unwrap()
        );
    }
}
