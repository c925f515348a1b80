//! Getting data out: casts, typed vectors and slices, buffers, ndarray views, comparison.

use ndarray::{ArrayD, ArrayViewD, IxDyn, ShapeBuilder};
use tessera_mesh::{Buf, Buffer, DType, Element};

use super::Tensor;
use super::storage::{typed, with_buffer};
use crate::kernel::{Scalar, convert, convert_extend};
use crate::{Error, Result};

impl Tensor {
    /// The elements as `&[T]` when `T` is the dtype, before any contiguity check.
    fn elements<T: Element>(&self, op: &'static str) -> Result<&[T]> {
        typed::<T>(self.data()?.as_buf()).ok_or(Error::DTypeMismatch {
            op,
            expected: T::DTYPE,
            got: self.dtype(),
        })
    }

    fn require_contiguous(&self, op: &'static str) -> Result<()> {
        if self.is_contiguous() {
            Ok(())
        } else {
            Err(Error::InvalidArgument {
                op,
                detail: format!(
                    "tensor of shape {:?} with strides {:?} is not contiguous; \
                     call .contiguous() first",
                    self.shape(),
                    self.strides()
                ),
            })
        }
    }

    /// The storage range this (contiguous) tensor covers.
    fn span(&self) -> std::ops::Range<usize> {
        let start = self.storage_offset();
        start..start + self.numel()
    }

    /// The elements converted to `dtype` in new storage; this tensor itself
    /// (no copy) when it already has `dtype`. PyTorch: `Tensor.to(dtype)`.
    ///
    /// - float → float rounds to nearest even; `bf16` and `f16` are converted
    ///   through `f32` (as PyTorch does), values beyond their range become ±inf;
    /// - float → integer truncates toward zero (`-2.7` → -2); NaN gives 0 and
    ///   values out of range saturate (PyTorch leaves these undefined);
    /// - integer → integer wraps (`-1i64` → `255u8`), as PyTorch does;
    /// - integer → float rounds to nearest (exact for |x| ≤ 2^53 into f64).
    ///
    /// # Errors
    /// [`Error::OutOfMemory`] when the new storage cannot be allocated.
    pub fn cast(&self, dtype: DType) -> Result<Tensor> {
        if dtype == self.dtype() {
            return Ok(self.clone());
        }
        if self.is_meta() {
            return Tensor::meta(self.shape(), dtype);
        }
        #[cfg(feature = "cuda")]
        if self.is_cuda() {
            return crate::cuda::ops::cast(self, dtype);
        }
        let span = self.is_contiguous().then(|| self.span());
        Ok(Tensor::from_storage_data(self.converted(dtype, span)?, self.shape()))
    }

    /// This tensor's elements converted to `dtype` in new storage: the storage
    /// range `span` in memory order, or (`None`) every element in row-major
    /// order. Filled by appending: the new storage is written once, never
    /// zeroed first.
    fn converted(&self, dtype: DType, span: Option<std::ops::Range<usize>>) -> Result<Buffer> {
        let layout = self.geometry();
        Ok(
            with_buffer!(self.data()?, src, S => crate::kernel::any_dispatch!("cast", dtype, D => {
                let mut out = crate::alloc::with_capacity::<D>("cast", self.shape())?;
                match &span {
                    // The common case (mixed precision) in a loop the compiler can vectorize.
                    Some(span) => convert_extend(&src[span.clone()], &mut out),
                    None => out.extend(layout.offsets().map(|i| convert::<S, D>(src[i]))),
                }
                D::into_buffer(out)
            })),
        )
    }

    /// This tensor's elements on `device`: itself when already there, else a
    /// contiguous copy (to `meta`: its shape and dtype only). PyTorch:
    /// `Tensor.to(device)`.
    ///
    /// # Errors
    /// [`Error::Device`] when `device` is a GPU and this build has no `cuda`
    /// feature, the GPU does not exist, or the copy fails; when this tensor is
    /// on the meta device and `device` is not (there are no values to copy).
    pub fn to(&self, device: crate::Device) -> Result<Tensor> {
        if device == self.device() {
            return Ok(self.clone());
        }
        if device.is_meta() {
            return Tensor::meta(self.shape(), self.dtype());
        }
        if self.is_meta() {
            return Err(super::storage::meta_error("to"));
        }
        #[cfg(feature = "cuda")]
        {
            crate::cuda::ops::to(self, device)
        }
        #[cfg(not(feature = "cuda"))]
        Err(Error::Device {
            op: "to",
            detail: format!(
                "cannot move a tensor to {device}: this build has no GPU support; build with --features cuda"
            ),
        })
    }

    /// The elements in row-major logical order (copied from any layout).
    ///
    /// # Errors
    /// [`Error::DTypeMismatch`] when `T` is not the tensor's dtype (use
    /// [`cast`](Self::cast) or [`to_f64_vec`](Self::to_f64_vec)).
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        if self.is_cuda() {
            return self.to(crate::Device::Cpu)?.to_vec();
        }
        Ok(self.geometry().gather(self.elements::<T>("to_vec")?))
    }

    /// The elements as `f64` in row-major order, from any dtype (for tests and
    /// printing; see [`cast`](Self::cast) for the conversion). A meta tensor's
    /// values, which do not exist, read as NaN.
    ///
    /// # Panics
    /// For a device tensor, when the copy to the host fails (a lost GPU).
    pub fn to_f64_vec(&self) -> Vec<f64> {
        if self.is_meta() {
            return vec![f64::NAN; self.numel()];
        }
        let host = self.on_host();
        let layout = host.geometry();
        with_buffer!(host.host_data(), v, T => layout.offsets().map(|i| v[i].to_f64()).collect())
    }

    /// The elements of a contiguous tensor, without copying.
    ///
    /// # Errors
    /// [`Error::DTypeMismatch`] when `T` is not the dtype; [`Error::InvalidArgument`]
    /// when the tensor is not contiguous (call [`contiguous`](Self::contiguous)).
    pub fn as_slice<T: Element>(&self) -> Result<&[T]> {
        let all = self.elements::<T>("as_slice")?;
        self.require_contiguous("as_slice")?;
        Ok(&all[self.span()])
    }

    /// The elements of a contiguous tensor as a type-erased buffer, without
    /// copying (to hand to a communicator).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the tensor is not contiguous.
    pub fn as_buf(&self) -> Result<Buf<'_>> {
        self.require_contiguous("as_buf")?;
        let span = self.span();
        Ok(with_buffer!(self.data()?, v, _T => Buf::from(&v[span])))
    }

    /// The elements (row-major, copied from any layout) as an owned type-erased
    /// buffer, for the asynchronous collectives.
    ///
    /// # Panics
    /// For a device tensor, when the copy to the host fails (a lost GPU); for
    /// a meta tensor, which has no elements to copy (check
    /// [`is_meta`](Self::is_meta) first).
    pub fn to_buffer(&self) -> Buffer {
        assert!(
            !self.is_meta(),
            "to_buffer: {}",
            super::storage::meta_error("to_buffer")
        );
        let host = self.on_host();
        let layout = host.geometry();
        with_buffer!(host.host_data(), v, _T => Buffer::from(layout.gather(v)))
    }

    /// [`to_buffer`](Self::to_buffer) that moves the storage's buffer out instead
    /// of copying it when this tensor is its only holder and spans all of it in
    /// row-major order (a freshly built bucket handed to an asynchronous collective).
    pub fn into_buffer(mut self) -> Buffer {
        let whole = self.is_contiguous() && self.storage_offset() == 0 && self.numel() == self.0.storage.len();
        if whole
            && let Some(inner) = std::sync::Arc::get_mut(&mut self.0)
            && let Some(storage) = std::sync::Arc::get_mut(&mut inner.storage)
            && let Some(data) = storage.take_data()
        {
            return data;
        }
        self.to_buffer()
    }

    /// The elements as a mutable slice, when this tensor alone holds its
    /// storage (no other tensor, view or clone shares it), spans all of it in
    /// row-major order and has dtype `T`; `None` otherwise. Writing through it
    /// is invisible to everyone else, since nobody else can see the storage: an
    /// in-place update for the sole owner (an optimizer's step on a parameter),
    /// where otherwise a copy would be made.
    ///
    /// PyTorch: in-place ops (`Tensor.add_` and friends) on a tensor without
    /// other views.
    pub fn try_as_mut_slice<T: Element>(&mut self) -> Option<&mut [T]> {
        if !self.is_sole_owner() || self.dtype() != T::DTYPE {
            return None;
        }
        let inner = std::sync::Arc::get_mut(&mut self.0)?;
        let storage = std::sync::Arc::get_mut(&mut inner.storage)?;
        // Same dtype (checked above), so the inner slice is a `[T]`: the cast never fails.
        tessera_mesh::dispatch_buf!(BufMut, storage.data_mut()?.as_buf_mut(), s, _S => bytemuck::try_cast_slice_mut(s).ok())
    }

    /// Whether this tensor alone holds its storage and spans all of it in
    /// row-major order: the condition under which a kernel may write it in
    /// place (host or device) without anyone else seeing the change.
    pub(crate) fn is_sole_owner(&mut self) -> bool {
        let whole = self.is_contiguous() && self.storage_offset() == 0 && self.numel() == self.0.storage.len();
        whole
            && std::sync::Arc::get_mut(&mut self.0)
                .and_then(|i| std::sync::Arc::get_mut(&mut i.storage))
                .is_some()
    }

    /// An ndarray view of the elements, with this tensor's strides, without copying.
    ///
    /// # Errors
    /// [`Error::DTypeMismatch`] when `T` is not the tensor's dtype.
    pub fn view<T: Element>(&self) -> Result<ArrayViewD<'_, T>> {
        let all = self.elements::<T>("view")?;
        if self.numel() == 0 {
            // No element to reach: any strides would do, and ndarray accepts
            // only in-bounds ones, which an empty storage may not have.
            return ArrayViewD::from_shape(IxDyn(self.shape()), &all[..0]).map_err(|e| Error::InvalidArgument {
                op: "view",
                detail: format!("internal error: an empty view of shape {:?}: {e}", self.shape()),
            });
        }
        let shape = IxDyn(self.shape()).strides(IxDyn(self.strides()));
        // The layout's invariant keeps every element inside the storage, so
        // ndarray accepts it; an error here would be a bug in a view op.
        ArrayViewD::from_shape(shape, &all[self.storage_offset()..]).map_err(|e| Error::InvalidArgument {
            op: "view",
            detail: format!(
                "internal error: layout {:?}/{:?}+{} does not fit storage of {}: {e}",
                self.shape(),
                self.strides(),
                self.storage_offset(),
                all.len()
            ),
        })
    }

    /// The elements as an owned ndarray array (row-major copy).
    ///
    /// # Errors
    /// [`Error::DTypeMismatch`] when `T` is not the tensor's dtype.
    pub fn to_ndarray<T: Element>(&self) -> Result<ArrayD<T>> {
        let v = self.geometry().gather(self.elements::<T>("to_ndarray")?);
        ArrayD::from_shape_vec(IxDyn(self.shape()), v).map_err(|e| Error::InvalidArgument {
            op: "to_ndarray",
            detail: format!("internal error: {e}"),
        })
    }

    /// Whether both tensors have the same shape and dtype and every pair of
    /// elements satisfies `|a - b| <= atol + rtol * |b|` (compared as `f64`;
    /// NaN is never close, equal infinities are). PyTorch: `torch.allclose`
    /// (which raises on a dtype mismatch where this returns `false`).
    pub fn allclose(&self, other: &Tensor, rtol: f64, atol: f64) -> bool {
        if self.shape() != other.shape() || self.dtype() != other.dtype() {
            return false;
        }
        let (a, b) = (self.to_f64_vec(), other.to_f64_vec());
        a.iter()
            .zip(&b)
            .all(|(&x, &y)| x == y || (x.is_finite() && y.is_finite() && (x - y).abs() <= atol + rtol * y.abs()))
    }
}

#[cfg(test)]
mod tests {
    use half::{bf16, f16};
    use ndarray::array;

    use super::*;

    #[test]
    fn cast_table() {
        fn check<S: Element, D: Element>(from: &[S], to: DType, want: &[D]) {
            let src = Tensor::from_slice(from, &[from.len()]).unwrap();
            let out = src.cast(to).unwrap();
            assert_eq!(out.dtype(), to);
            assert_eq!(out.to_vec::<D>().unwrap(), want, "{src:?} -> {to}");
            assert_eq!(out.shares_storage(&src), S::DTYPE == to);
        }
        macro_rules! case {
            ($from:expr, $to:expr, $want:expr) => {
                check(&$from, $to, &$want)
            };
        }
        // float -> i64 truncates toward zero; NaN -> 0; saturates.
        case!([2.7f32, -2.7, 0.5, -0.5], DType::I64, [2i64, -2, 0, 0]);
        case!([f64::NAN, 1e300, -1e300], DType::I64, [0i64, i64::MAX, i64::MIN]);
        // bf16 keeps 8 mantissa bits, ties to even.
        case!(
            [1.0f32, 1.0 + 2f32.powi(-8), 1.0 + 3.0 * 2f32.powi(-8), 3.3, f32::MAX],
            DType::BF16,
            [1.0f32, 1.0, 1.015625, 3.296875, f32::INFINITY].map(bf16::from_f32)
        );
        // f64 -> bf16 goes through f32 (double rounding, as PyTorch).
        case!(
            [1.0f64 + 2f64.powi(-8) + 2f64.powi(-30)],
            DType::BF16,
            [bf16::from_f32(1.0)]
        );
        case!(
            [65504.0f32, 70000.0, 0.1],
            DType::F16,
            [65504.0, f32::INFINITY, 0.1].map(f16::from_f32)
        );
        case!([bf16::from_f32(2.5)], DType::F16, [f16::from_f32(2.5)]);
        case!([f16::from_f32(-0.75)], DType::F64, [-0.75f64]);
        case!([0.1f64], DType::F32, [0.1f32]);
        case!([300i64, -1, 7], DType::U8, [44u8, 255, 7]);
        case!([200u8, 0], DType::I64, [200i64, 0]);
        case!([255u8, 3], DType::BF16, [255.0f32, 3.0].map(bf16::from_f32));
        case!([257.9f32, -1.0], DType::U8, [255u8, 0]);
        case!([(1i64 << 53) + 1], DType::F64, [(1u64 << 53) as f64]);
        case!([1.5f32, 2.0], DType::F32, [1.5f32, 2.0]);
    }

    #[test]
    fn into_buffer_moves_a_sole_whole_storage_and_copies_otherwise() {
        let t = Tensor::arange(6, DType::F32).unwrap().reshape(&[2, 3]).unwrap();
        let addr = t.as_buf().unwrap().as_bytes().as_ptr();
        let moved = t.into_buffer();
        assert_eq!(
            moved.as_buf().as_bytes().as_ptr(),
            addr,
            "the only holder gives its buffer away"
        );
        assert_eq!(moved.into_vec::<f32>().unwrap(), vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);

        let t = Tensor::arange(6, DType::F32).unwrap().reshape(&[2, 3]).unwrap();
        let kept = t.clone();
        let copied = t.into_buffer();
        assert_ne!(
            copied.as_buf().as_bytes().as_ptr(),
            kept.as_buf().unwrap().as_bytes().as_ptr()
        );
        assert_eq!(
            kept.to_vec::<f32>().unwrap(),
            vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0],
            "a shared one is left alone"
        );

        let view = Tensor::arange(6, DType::F32)
            .unwrap()
            .reshape(&[2, 3])
            .unwrap()
            .transpose(0, 1)
            .unwrap();
        assert_eq!(
            view.into_buffer().into_vec::<f32>().unwrap(),
            vec![0.0, 3.0, 1.0, 4.0, 2.0, 5.0]
        );
        let part = Tensor::arange(6, DType::F32).unwrap().narrow(0, 2, 3).unwrap();
        assert_eq!(part.into_buffer().into_vec::<f32>().unwrap(), vec![2.0, 3.0, 4.0]);
    }

    #[test]
    fn cast_of_a_strided_view_is_row_major() {
        let t = Tensor::arange(6, DType::I64).unwrap().reshape(&[2, 3]).unwrap();
        let c = t.transpose(0, 1).unwrap().cast(DType::F32).unwrap();
        assert_eq!(c.shape(), &[3, 2]);
        assert!(c.is_contiguous());
        assert_eq!(c.to_vec::<f32>().unwrap(), vec![0.0, 3.0, 1.0, 4.0, 2.0, 5.0]);
        let row = t.narrow(0, 1, 1).unwrap().cast(DType::U8).unwrap();
        assert_eq!((row.shape(), row.to_vec::<u8>().unwrap()), (&[1, 3][..], vec![3, 4, 5]));
    }

    #[test]
    fn typed_access_checks_dtype() {
        let t = Tensor::ones(&[2], DType::F64).unwrap();
        macro_rules! case {
            ($res:expr, $msg:expr) => {
                assert_eq!($res.unwrap_err().to_string(), $msg);
            };
        }
        case!(t.to_vec::<f32>(), "to_vec: expected dtype f32, got f64");
        case!(t.to_vec::<i64>(), "to_vec: expected dtype i64, got f64");
        case!(t.to_vec::<bf16>(), "to_vec: expected dtype bf16, got f64");
        case!(t.as_slice::<u8>(), "as_slice: expected dtype u8, got f64");
        case!(t.view::<f16>(), "view: expected dtype f16, got f64");
        case!(t.to_ndarray::<f32>(), "to_ndarray: expected dtype f32, got f64");
        assert_eq!(t.to_vec::<f64>().unwrap(), vec![1.0, 1.0]);
    }

    #[test]
    fn slices_and_buffers_of_contiguous_tensors() {
        let t = Tensor::arange(12, DType::F32).unwrap().reshape(&[3, 4]).unwrap();
        let rows = t.narrow(0, 1, 2).unwrap();
        assert_eq!(
            rows.as_slice::<f32>().unwrap(),
            &[4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0]
        );
        let buf = rows.as_buf().unwrap();
        assert_eq!((buf.dtype(), buf.len()), (DType::F32, 8));
        assert_eq!(
            buf.as_bytes(),
            bytemuck::cast_slice::<f32, u8>(rows.as_slice().unwrap())
        );
        let empty = t.narrow(0, 3, 0).unwrap();
        assert_eq!(empty.as_slice::<f32>().unwrap(), &[] as &[f32]);
        let cols = t.narrow(1, 1, 2).unwrap();
        let msg = "tensor of shape [3, 2] with strides [4, 1] is not contiguous; call .contiguous() first";
        assert_eq!(
            cols.as_slice::<f32>().unwrap_err().to_string(),
            format!("as_slice: {msg}")
        );
        assert_eq!(cols.as_buf().unwrap_err().to_string(), format!("as_buf: {msg}"));
        assert_eq!(cols.to_buffer(), Buffer::F32(vec![1.0, 2.0, 5.0, 6.0, 9.0, 10.0]));
        let c = cols.contiguous();
        assert_eq!(c.as_slice::<f32>().unwrap(), &[1.0, 2.0, 5.0, 6.0, 9.0, 10.0]);
    }

    #[test]
    fn ndarray_interop() {
        let t = Tensor::arange(6, DType::F64).unwrap().reshape(&[2, 3]).unwrap();
        let tt = t.transpose(0, 1).unwrap();
        let v = tt.view::<f64>().unwrap();
        assert_eq!(v, array![[0.0, 3.0], [1.0, 4.0], [2.0, 5.0]].into_dyn());
        let cols = t.narrow(1, 1, 2).unwrap();
        assert_eq!(cols.view::<f64>().unwrap(), array![[1.0, 2.0], [4.0, 5.0]].into_dyn());
        let e = t.narrow(0, 2, 0).unwrap().narrow(1, 3, 0).unwrap();
        assert_eq!(e.view::<f64>().unwrap().shape(), &[0, 0]);
        let a = tt.to_ndarray::<f64>().unwrap();
        assert_eq!(a, array![[0.0, 3.0], [1.0, 4.0], [2.0, 5.0]].into_dyn());
        assert_eq!(Tensor::from_ndarray(a), tt);
        let s = Tensor::scalar(5.0, DType::F64).unwrap();
        assert_eq!(s.view::<f64>().unwrap(), ndarray::arr0(5.0).into_dyn());
    }

    #[test]
    fn allclose_table() {
        let f = |v: &[f64]| Tensor::from_slice(v, &[v.len()]).unwrap();
        macro_rules! case {
            ($a:expr, $b:expr, $rtol:expr, $atol:expr, $want:expr) => {
                assert_eq!(
                    $a.allclose(&$b, $rtol, $atol),
                    $want,
                    "{:?} vs {:?}",
                    $a,
                    $b
                );
            };
        }
        case!(f(&[1.0, 2.0]), f(&[1.0, 2.0]), 0.0, 0.0, true);
        case!(f(&[1.0, 2.0]), f(&[1.0, 2.001]), 1e-3, 0.0, true);
        case!(f(&[1.0, 2.0]), f(&[1.0, 2.01]), 1e-3, 0.0, false);
        case!(f(&[0.0]), f(&[1e-9]), 0.0, 1e-8, true);
        case!(f(&[0.0]), f(&[1e-7]), 0.0, 1e-8, false);
        case!(f(&[f64::INFINITY]), f(&[f64::INFINITY]), 0.0, 0.0, true);
        case!(f(&[f64::INFINITY]), f(&[f64::NEG_INFINITY]), 1.0, 1.0, false);
        case!(f(&[f64::NAN]), f(&[f64::NAN]), 1.0, 1.0, false);
        case!(f(&[1.0, 2.0]), f(&[1.0]), 1.0, 1.0, false);
        case!(f(&[1.0]), f(&[1.0]).cast(DType::F32).unwrap(), 1.0, 1.0, false);
        let t = Tensor::arange(6, DType::BF16).unwrap().reshape(&[2, 3]).unwrap();
        case!(
            t.transpose(0, 1).unwrap(),
            t.transpose(0, 1).unwrap().contiguous(),
            0.0,
            0.0,
            true
        );
    }
}

#[cfg(test)]
mod device_tests {
    use crate::{DType, Device, Tensor};

    #[test]
    fn host_tensors_and_moves() {
        let t = Tensor::arange(3, DType::F32).unwrap();
        assert_eq!((t.device(), t.is_cuda()), (Device::Cpu, false));
        assert!(
            t.to(Device::Cpu).unwrap().shares_storage(&t),
            "a move to where it is does not copy"
        );
        #[cfg(not(feature = "cuda"))]
        {
            let e = t.to(Device::Cuda(0)).unwrap_err().to_string();
            assert!(e.contains("--features cuda"), "{e}");
        }
    }
}
