//! The local (per-rank) tensor: a runtime-typed, strided view of shared CPU storage.
//!
//! ```
//! use tessera_tensor::{DType, Tensor};
//!
//! let t = Tensor::arange(12, DType::F32)?.reshape(&[3, 4])?;
//! let parts = t.chunk(2, 1)?; // two [3, 2] views of `t`'s storage, no copy
//! assert_eq!(parts[1].to_vec::<f32>()?, vec![2.0, 3.0, 6.0, 7.0, 10.0, 11.0]);
//! assert!(parts[1].shares_storage(&t) && !parts[1].is_contiguous());
//! let back = Tensor::cat(&parts, 1)?;
//! assert_eq!(back, t);
//! assert_eq!(t.cast(DType::I64)?.to_vec::<i64>()?, (0..12).collect::<Vec<_>>());
//! # Ok::<(), tessera_tensor::Error>(())
//! ```

mod construct;
mod convert;
mod geometry;
mod shape_ops;
mod storage;

use std::fmt;
use std::sync::Arc;

use tessera_mesh::{Buffer, DType};

use geometry::Geometry;
pub use shape_ops::chunk_size_and_offset;
pub(crate) use storage::fill_value;
use storage::{Storage, with_buffer};

/// A tensor on one rank: shape, strides and a runtime [`DType`] over shared storage.
///
/// Cheap to clone (an `Arc`). Tensors are immutable; views (`narrow`, `chunk`,
/// `transpose`, `reshape` of contiguous data) share storage with the tensor
/// they come from, and every op that computes new values allocates new storage,
/// which the per-rank [memory tracker](crate::memory) counts. The one write,
/// [`try_as_mut_slice`](Tensor::try_as_mut_slice), is granted only to a
/// tensor that alone holds its storage, so no other handle ever sees a change.
///
/// Every dtype of [`DType`] is supported; `U8` is raw bytes (flat communication
/// buckets). Kernels are written once over [`Element`](tessera_mesh::Element).
///
/// PyTorch: `torch.Tensor` on the CPU, without autograd.
#[derive(Clone)]
pub struct Tensor(Arc<Inner>);

struct Inner {
    storage: Arc<Storage>,
    geometry: Geometry,
}

impl Tensor {
    /// A tensor over fresh storage holding `data` in row-major order.
    fn from_storage_data(data: Buffer, shape: &[usize]) -> Tensor {
        Tensor::from_parts(Arc::new(Storage::new(data)), Geometry::contiguous(shape))
    }

    fn from_parts(storage: Arc<Storage>, layout: Geometry) -> Tensor {
        Tensor(Arc::new(Inner {
            storage,
            geometry: layout,
        }))
    }

    /// A view of this tensor's storage with another layout.
    fn with_geometry(&self, layout: Geometry) -> Tensor {
        Tensor::from_parts(Arc::clone(&self.0.storage), layout)
    }

    fn geometry(&self) -> &Geometry {
        &self.0.geometry
    }

    /// The host buffer (an error naming the device for a device tensor).
    fn data(&self) -> crate::Result<&Buffer> {
        self.0.storage.data()
    }

    /// A tensor over fresh device storage, row-major.
    #[cfg(feature = "cuda")]
    pub(crate) fn from_cuda(data: crate::cuda::CudaBuffer, shape: &[usize]) -> Tensor {
        Tensor::from_parts(Arc::new(Storage::new_cuda(data)), Geometry::contiguous(shape))
    }

    /// The device buffer, for a device tensor.
    #[cfg(feature = "cuda")]
    pub(crate) fn cuda_buffer(&self) -> Option<&crate::cuda::CudaBuffer> {
        self.0.storage.cuda()
    }

    /// The device that holds the elements. PyTorch: `Tensor.device`.
    pub fn device(&self) -> crate::Device {
        self.0.storage.device()
    }

    /// Whether the elements are on a GPU. PyTorch: `Tensor.is_cuda`.
    pub fn is_cuda(&self) -> bool {
        self.device().is_cuda()
    }

    /// Counts this tensor's storage (every view of it) as `category` in the
    /// memory tracker from now on: what keeps a tensor says what it is (a
    /// parameter's value, a gradient, optimizer state); ops allocate
    /// [`Activations`](crate::memory::Category::Activations).
    pub fn set_memory_category(&self, category: crate::memory::Category) {
        self.0.storage.charge().set_category(category);
    }

    /// The memory tracker's category of this tensor's storage.
    pub fn memory_category(&self) -> crate::memory::Category {
        self.0.storage.charge().category()
    }

    /// Whether the tensor is on the meta device (a shape and a dtype, no
    /// values; see [`Tensor::meta`]). PyTorch: `Tensor.is_meta`.
    pub fn is_meta(&self) -> bool {
        self.device().is_meta()
    }

    /// This tensor, or a host copy of a device tensor, for the readers that
    /// cannot fail (printing, comparing, [`to_f64_vec`](Self::to_f64_vec),
    /// [`to_buffer`](Self::to_buffer)).
    ///
    /// # Panics
    /// When a device tensor cannot be copied to the host (a lost GPU), or
    /// when reading it reports an index a kernel found out of range since
    /// the host last waited for the GPU (see `cuda::synchronize`;
    /// [`to`](Self::to) returns that error instead).
    /// A meta tensor is returned as it is: the callers check for it first.
    fn on_host(&self) -> std::borrow::Cow<'_, Tensor> {
        if self.is_cuda() {
            match self.to(crate::Device::Cpu) {
                Ok(t) => std::borrow::Cow::Owned(t),
                Err(e) => panic!("copying a {} tensor to the host failed: {e}", self.device()),
            }
        } else {
            std::borrow::Cow::Borrowed(self)
        }
    }

    /// The host buffer of a tensor known to be on the host.
    fn host_data(&self) -> &Buffer {
        match self.data() {
            Ok(b) => b,
            Err(e) => unreachable!("host_data is called on host tensors only: {e}"),
        }
    }

    /// The size of every dim.
    pub fn shape(&self) -> &[usize] {
        &self.0.geometry.shape
    }

    /// The size of every dim (same as [`shape`](Self::shape); candle's name).
    pub fn dims(&self) -> &[usize] {
        self.shape()
    }

    /// The number of dims (0 for a scalar). PyTorch: `Tensor.dim()`.
    pub fn rank(&self) -> usize {
        self.shape().len()
    }

    /// The size of dim `dim`.
    ///
    /// # Errors
    /// [`Error::DimOutOfRange`](crate::Error::DimOutOfRange) when `dim >= rank`.
    pub fn dim(&self, dim: impl crate::Dim) -> crate::Result<usize> {
        let dim = dim.resolve("dim", self.rank())?;
        self.geometry().check_dim("dim", dim)?;
        Ok(self.shape()[dim])
    }

    /// The number of elements (1 for a scalar).
    pub fn numel(&self) -> usize {
        self.geometry().numel()
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.0.storage.dtype()
    }

    /// Strides in elements, one per dim. PyTorch: `Tensor.stride()`.
    pub fn strides(&self) -> &[usize] {
        &self.0.geometry.strides
    }

    /// Offset of the first element in the storage, in elements.
    /// PyTorch: `Tensor.storage_offset()`.
    pub fn storage_offset(&self) -> usize {
        self.0.geometry.offset
    }

    /// Whether the elements lie row-major and dense in storage (so that
    /// [`as_slice`](Self::as_slice) and [`as_buf`](Self::as_buf) work).
    pub fn is_contiguous(&self) -> bool {
        self.geometry().is_contiguous()
    }

    /// Logical size in bytes: `numel × dtype size` (a view counts its own
    /// elements, not its storage).
    pub fn size_in_bytes(&self) -> usize {
        self.numel() * self.dtype().size_in_bytes()
    }

    /// Whether `self` and `other` view the same storage (views of one another).
    pub fn shares_storage(&self, other: &Tensor) -> bool {
        Arc::ptr_eq(&self.0.storage, &other.0.storage)
    }
}

/// Same shape, same dtype and equal values (so a NaN makes a tensor unequal to
/// itself, as with floats). Strides and storage do not matter. A meta tensor,
/// having no values, equals nothing (its values read as NaN).
impl PartialEq for Tensor {
    fn eq(&self, other: &Tensor) -> bool {
        if self.shape() != other.shape() || self.dtype() != other.dtype() || self.is_meta() || other.is_meta() {
            return false;
        }
        let (this, other) = (self.on_host(), other.on_host());
        let (a, b) = (this.geometry(), other.geometry());
        with_buffer!(this.host_data(), x, T => {
            let Some(y) = storage::typed::<T>(other.host_data().as_buf()) else {
                return false;
            };
            a.offsets().zip(b.offsets()).all(|(i, j)| x[i] == y[j])
        })
    }
}

/// How many values `Debug` prints.
const DEBUG_VALUES: usize = 8;

impl fmt::Debug for Tensor {
    /// `Tensor[2, 3] f32 [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]`, with at most eight values.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_meta() {
            return write!(f, "Tensor{:?} {} meta", self.shape(), self.dtype());
        }
        write!(f, "Tensor{:?} {} [", self.shape(), self.dtype())?;
        if self.is_cuda() {
            write!(f, "{}: ", self.device())?;
        }
        let host = self.on_host();
        with_buffer!(host.host_data(), x, _T => {
            for (k, i) in host.geometry().offsets().take(DEBUG_VALUES).enumerate() {
                if k > 0 {
                    f.write_str(", ")?;
                }
                write!(f, "{:?}", x[i])?;
            }
        });
        if self.numel() > DEBUG_VALUES {
            write!(f, ", ... ({} values)", self.numel())?;
        }
        f.write_str("]")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accessors() {
        let t = Tensor::zeros(&[2, 3, 4], DType::BF16).unwrap();
        assert_eq!(t.shape(), &[2, 3, 4]);
        assert_eq!(t.dims(), &[2, 3, 4]);
        assert_eq!(t.rank(), 3);
        assert_eq!(t.dim(1).unwrap(), 3);
        assert!(matches!(
            t.dim(3),
            Err(crate::Error::DimOutOfRange { dim: 3, rank: 3, .. })
        ));
        assert_eq!(t.numel(), 24);
        assert_eq!(t.dtype(), DType::BF16);
        assert_eq!(t.strides(), &[12, 4, 1]);
        assert_eq!(t.storage_offset(), 0);
        assert!(t.is_contiguous());
        assert_eq!(t.size_in_bytes(), 48);
        let v = t.narrow(2, 1, 2).unwrap();
        assert_eq!(v.size_in_bytes(), 24);
        assert_eq!(v.storage_offset(), 1);
        assert!(!v.is_contiguous() && v.shares_storage(&t));
        let s = Tensor::scalar(2.0, DType::F64).unwrap();
        assert_eq!((s.rank(), s.numel(), s.shape()), (0, 1, &[][..]));
    }

    #[test]
    fn equality() {
        let t = Tensor::arange(6, DType::F32).unwrap().reshape(&[2, 3]).unwrap();
        let same = Tensor::from_vec(vec![0.0f32, 1.0, 2.0, 3.0, 4.0, 5.0], &[2, 3]).unwrap();
        let tt = t.transpose(0, 1).unwrap();
        macro_rules! case {
            ($a:expr, $b:expr, $want:expr) => {
                assert_eq!($a == $b, $want, "{:?} == {:?}", $a, $b);
            };
        }
        case!(t, same, true);
        case!(tt, tt.contiguous(), true); // strides do not matter
        case!(t, t.cast(DType::F64).unwrap(), false); // dtype does
        case!(t, t.reshape(&[3, 2]).unwrap(), false); // shape does
        case!(t, tt, false);
        case!(
            t,
            Tensor::from_vec(vec![0.0f32, 1.0, 2.0, 3.0, 4.0, 5.5], &[2, 3]).unwrap(),
            false
        );
        let nan = Tensor::full(&[1], f64::NAN, DType::F32).unwrap();
        case!(nan, nan, false);
    }

    #[test]
    fn debug_is_compact() {
        macro_rules! case {
            ($t:expr, $want:expr) => {
                assert_eq!(format!("{:?}", $t), $want);
            };
        }
        case!(
            Tensor::arange(6, DType::F32).unwrap().reshape(&[2, 3]).unwrap(),
            "Tensor[2, 3] f32 [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]"
        );
        case!(
            Tensor::arange(10, DType::I64).unwrap(),
            "Tensor[10] i64 [0, 1, 2, 3, 4, 5, 6, 7, ... (10 values)]"
        );
        case!(
            Tensor::arange(4, DType::U8)
                .unwrap()
                .reshape(&[2, 2])
                .unwrap()
                .transpose(0, 1)
                .unwrap(),
            "Tensor[2, 2] u8 [0, 2, 1, 3]"
        );
        case!(Tensor::zeros(&[0, 2], DType::BF16).unwrap(), "Tensor[0, 2] bf16 []");
        case!(Tensor::meta(&[2, 3], DType::F32).unwrap(), "Tensor[2, 3] f32 meta");
    }
}
