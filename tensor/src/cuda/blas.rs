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
    let (data, compute) = data_types(dtype)?;
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
    let call = Call {
        handle: *handle,
        op_b: op(b.transposed),
        op_a: op(a.transposed),
        nn,
        mm,
        kk,
        alpha,
        beta,
        data,
        lda,
        ldb,
        ldc,
        count,
        compute,
        algo,
    };
    match batched {
        Batch::Strided => gemm_strided(&call, a, b, c),
        Batch::Pointers(arrays) => gemm_pointers(&call, arrays),
    }
}

/// cuBLAS's data and compute types for a product of `dtype` matrices.
fn data_types(dtype: DType) -> Result<(sys::cudaDataType, sys::cublasComputeType_t)> {
    Ok(match dtype {
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
    })
}

/// A [`gemm`]'s cuBLAS arguments but its matrices' addresses, for `Cᵀ = Bᵀ·Aᵀ` (valid while [`gemm`] runs).
#[derive(Clone, Copy)]
struct Call {
    handle: sys::cublasHandle_t,
    op_b: sys::cublasOperation_t,
    op_a: sys::cublasOperation_t,
    nn: i32,
    mm: i32,
    kk: i32,
    alpha: *const c_void,
    beta: *const c_void,
    data: sys::cudaDataType,
    lda: i32,
    ldb: i32,
    ldc: i32,
    count: i32,
    compute: sys::cublasComputeType_t,
    algo: sys::cublasGemmAlgo_t,
}

/// Queues `call` on matrices `batch_stride` apart in each of `a`, `b`, `c`.
fn gemm_strided(call: &Call, a: Operand, b: Operand, c: Operand) -> Result<()> {
    // SAFETY: the pointers address live device blocks holding the shapes
    // and strides described (checked by the caller), on the handle's stream.
    unsafe {
        blas::gemm_strided_batched_ex(
            call.handle,
            call.op_b,
            call.op_a,
            call.nn,
            call.mm,
            call.kk,
            call.alpha,
            b.ptr as *const c_void,
            call.data,
            call.ldb,
            b.batch_stride as i64,
            a.ptr as *const c_void,
            call.data,
            call.lda,
            a.batch_stride as i64,
            call.beta,
            c.ptr as *mut c_void,
            call.data,
            call.ldc,
            c.batch_stride as i64,
            call.count,
            call.compute,
            call.algo,
        )
    }
    .map_err(|e| cuda_error("matmul", e))
}

/// Queues `call` on the matrices at the addresses held in the device arrays `[pa, pb, pc]`.
fn gemm_pointers(call: &Call, [pa, pb, pc]: [u64; 3]) -> Result<()> {
    // SAFETY: the three arrays hold `call.count` addresses each, of live
    // device blocks holding the shapes described (checked by the caller), on
    // the handle's stream.
    let status = unsafe {
        sys::cublasGemmBatchedEx(
            call.handle,
            call.op_b,
            call.op_a,
            call.nn,
            call.mm,
            call.kk,
            call.alpha,
            pb as *const *const c_void,
            call.data,
            call.ldb,
            pa as *const *const c_void,
            call.data,
            call.lda,
            call.beta,
            pc as *const *mut c_void,
            call.data,
            call.ldc,
            call.count,
            call.compute,
            call.algo,
        )
    };
    status.result().map_err(|e| cuda_error("matmul", e))
}
