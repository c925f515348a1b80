//! Matrix products on cuBLAS: f32 in f32 with TF32 off (cuBLAS's default math
//! mode, PyTorch's `allow_tf32 = False`), bf16 and f16 with f32 accumulation,
//! f64 in f64.

use std::ffi::c_void;
use std::sync::{Arc, Mutex, PoisonError};

use cudarc::cublas::{result as blas, sys};
use cudarc::driver::{CudaContext, CudaStream};
use tessera_mesh::DType;

use super::library::{check_library, cuda_error};
use crate::{Error, Result};

/// A cuBLAS handle bound to one rank's compute stream.
pub(crate) struct Blas {
    handle: Mutex<sys::cublasHandle_t>,
}

impl Blas {
    pub(crate) fn new(ctx: &Arc<CudaContext>, stream: &Arc<CudaStream>) -> Result<Blas> {
        check_library("cublas")?;
        ctx.bind_to_thread().map_err(|e| cuda_error("cublas", e))?;
        let handle = blas::create_handle().map_err(|e| cuda_error("cublas", e))?;
        // SAFETY: a fresh handle and a live stream of the same context.
        unsafe { blas::set_stream(handle, stream.cu_stream() as sys::cudaStream_t) }
            .map_err(|e| cuda_error("cublas", e))?;
        Ok(Blas {
            handle: Mutex::new(handle),
        })
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        let handle = *self.handle.get_mut().unwrap_or_else(PoisonError::into_inner);
        // SAFETY: the handle was created by `new` and is destroyed once.
        let _ = unsafe { blas::destroy_handle(handle) };
    }
}

/// One operand of a batched product: a device pointer to `[batch, rows, cols]`
/// elements laid out either row-major (`transposed == false`, rows `ld`
/// elements apart) or column-major (`transposed == true`, columns `ld` apart),
/// matrices `batch_stride` elements apart (0 repeats one matrix).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Operand {
    pub(crate) ptr: u64,
    pub(crate) transposed: bool,
    pub(crate) ld: usize,
    pub(crate) batch_stride: usize,
}

impl Operand {
    /// The operand starting at element `(row, col)` of each matrix (a block of
    /// it: the caller's shapes say how far it reaches), for `elem`-byte elements.
    pub(crate) fn at(self, row: usize, col: usize, elem: usize) -> Operand {
        let offset = if self.transposed {
            col * self.ld + row
        } else {
            row * self.ld + col
        };
        Operand {
            ptr: self.ptr + (offset * elem) as u64,
            ..self
        }
    }
}

/// Where a batch of products finds its matrices: `batch_stride` apart in
/// each operand, or at the addresses in three device arrays of `batch`
/// pointers each (a's, b's, c's: for operands whose batch dims do not run
/// on with one stride, such as heads read from `[b, t, h, e]`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Batch {
    Strided,
    Pointers([u64; 3]),
}

/// `c[b] = a[b] · b[b]` for `batch` products of `[m, k] · [k, n]`, `c`
/// row-major (`c.transposed` false): rows `c.ld` apart, matrices
/// `c.batch_stride` apart (or where `batched` points).
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm(
    blas: &Blas,
    dtype: DType,
    (batch, m, k, n): (usize, usize, usize, usize),
    a: Operand,
    b: Operand,
    c: Operand,
    batched: Batch,
) -> Result<()> {
    debug_assert!(!c.transposed, "cuBLAS writes the row-major product");
    let int = |v: usize, what: &str| {
        i32::try_from(v).map_err(|_| Error::Device {
            op: "matmul",
            detail: format!("{what} {v} is beyond what one cuBLAS call takes (2^31 - 1)"),
        })
    };
    let (data, compute) = match dtype {
        DType::F32 => (
            sys::cudaDataType::CUDA_R_32F,
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        ),
        DType::BF16 => (
            sys::cudaDataType::CUDA_R_16BF,
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        ),
        DType::F16 => (
            sys::cudaDataType::CUDA_R_16F,
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        ),
        DType::F64 => (
            sys::cudaDataType::CUDA_R_64F,
            sys::cublasComputeType_t::CUBLAS_COMPUTE_64F,
        ),
        other => {
            return Err(Error::Device {
                op: "matmul",
                detail: format!("dtype {other} has no matrix product on cuda; cast to f32 or bf16"),
            });
        }
    };
    let (one32, zero32, one64, zero64) = (1f32, 0f32, 1f64, 0f64);
    let (alpha, beta): (*const c_void, *const c_void) = if dtype == DType::F64 {
        ((&raw const one64).cast(), (&raw const zero64).cast())
    } else {
        ((&raw const one32).cast(), (&raw const zero32).cast())
    };
    // Row-major C = A·B is column-major Cᵀ = Bᵀ·Aᵀ: cuBLAS's first operand is B.
    let op = |t: bool| {
        if t {
            sys::cublasOperation_t::CUBLAS_OP_T
        } else {
            sys::cublasOperation_t::CUBLAS_OP_N
        }
    };
    let (nn, mm, kk) = (int(n, "n")?, int(m, "m")?, int(k, "k")?);
    let (lda, ldb, ldc) = (
        int(a.ld, "leading dim")?,
        int(b.ld, "leading dim")?,
        int(c.ld, "leading dim")?,
    );
    let count = int(batch, "batch")?;
    let algo = sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT;
    let handle = blas.handle.lock().unwrap_or_else(PoisonError::into_inner);
    match batched {
        // SAFETY: the pointers address live device blocks holding the shapes
        // and strides described (checked by the caller), on the handle's stream.
        Batch::Strided => unsafe {
            blas::gemm_strided_batched_ex(
                *handle,
                op(b.transposed),
                op(a.transposed),
                nn,
                mm,
                kk,
                alpha,
                b.ptr as *const c_void,
                data,
                ldb,
                b.batch_stride as i64,
                a.ptr as *const c_void,
                data,
                lda,
                a.batch_stride as i64,
                beta,
                c.ptr as *mut c_void,
                data,
                ldc,
                c.batch_stride as i64,
                count,
                compute,
                algo,
            )
        }
        .map_err(|e| cuda_error("matmul", e)),
        Batch::Pointers([pa, pb, pc]) => {
            // SAFETY: as above, the three arrays holding `batch` such addresses each.
            let status = unsafe {
                sys::cublasGemmBatchedEx(
                    *handle,
                    op(b.transposed),
                    op(a.transposed),
                    nn,
                    mm,
                    kk,
                    alpha,
                    pb as *const *const c_void,
                    data,
                    ldb,
                    pa as *const *const c_void,
                    data,
                    lda,
                    beta,
                    pc as *const *mut c_void,
                    data,
                    ldc,
                    count,
                    compute,
                    algo,
                )
            };
            status.result().map_err(|e| cuda_error("matmul", e))
        }
    }
}
