//! Tensors on NVIDIA GPUs (feature `cuda`): storage in device memory from a
//! caching allocator, kernels compiled at run time by NVRTC, matrix products on
//! cuBLAS, and collectives between ranks on one GPU or over NCCL.
//!
//! Nothing CUDA is needed to build: cudarc loads the driver, NVRTC, cuBLAS and
//! NCCL when first used, and a missing library is an [`Error::Device`](crate::Error::Device)
//! naming it.
//!
//! ```no_run
//! use tessera_tensor::{DType, Device, Tensor};
//!
//! let x = Tensor::randn(&[64, 128], DType::F32, 0)?.to(Device::Cuda(0))?;
//! let w = Tensor::randn(&[128, 32], DType::F32, 1)?.to(Device::Cuda(0))?;
//! let y = x.matmul(&w)?.gelu()?; // on the GPU
//! assert_eq!(y.device(), Device::Cuda(0));
//! let back = y.to(Device::Cpu)?;
//! assert!(back.allclose(&x.to(Device::Cpu)?.matmul(&w.to(Device::Cpu)?)?.gelu()?, 1e-5, 1e-5));
//! # Ok::<(), tessera_tensor::Error>(())
//! ```
//!
//! Each rank has a compute stream and a communication stream per GPU; all of a
//! rank's kernels run in order on its compute stream, so freed device memory
//! is reused at once on that stream, and memory another stream used waits for
//! an event (PyTorch: the caching allocator and `record_stream`).

mod alloc;
mod blas;
mod buffer;
pub mod comm;
pub(crate) mod driver;
mod kernels;
mod library;
pub(crate) mod ops;
mod staging;

pub use alloc::CudaMemoryStats;
pub(crate) use buffer::CudaBuffer;
pub use kernels::{SOURCE as KERNEL_SOURCE, compile_ptx};

use crate::Result;

/// Whether a CUDA driver and at least one GPU are present.
/// PyTorch: `torch.cuda.is_available()`.
pub fn is_available() -> bool {
    driver::device_count() > 0
}

/// How many GPUs the driver sees (0 without a driver).
/// PyTorch: `torch.cuda.device_count()`.
pub fn device_count() -> usize {
    driver::device_count()
}

/// The name of GPU `ordinal` (`"NVIDIA H100 80GB HBM3"`).
///
/// # Errors
/// [`Error::Device`](crate::Error::Device) when there is no such GPU.
pub fn device_name(ordinal: usize) -> Result<String> {
    let gpu = driver::gpu(ordinal)?;
    gpu.ctx.name().map_err(|e| library::cuda_error("device_name", e))
}

/// The caching allocator's statistics on GPU `ordinal` (all ranks together).
/// PyTorch: `torch.cuda.memory_stats`.
///
/// # Errors
/// [`Error::Device`](crate::Error::Device) when there is no such GPU.
pub fn memory_stats(ordinal: usize) -> Result<CudaMemoryStats> {
    Ok(driver::gpu(ordinal)?.pool.stats())
}

/// Sets the peaks of [`memory_stats`] to the current values.
/// PyTorch: `torch.cuda.reset_peak_memory_stats`.
///
/// # Errors
/// [`Error::Device`](crate::Error::Device) when there is no such GPU.
pub fn reset_peak_memory_stats(ordinal: usize) -> Result<()> {
    driver::gpu(ordinal)?.pool.reset_peaks();
    Ok(())
}

/// Gives the allocator's cached blocks on GPU `ordinal` back to the driver.
/// PyTorch: `torch.cuda.empty_cache`.
///
/// # Errors
/// [`Error::Device`](crate::Error::Device) when there is no such GPU or the driver fails.
pub fn empty_cache(ordinal: usize) -> Result<()> {
    driver::gpu(ordinal)?.pool.empty_cache()
}

/// Waits until the calling rank's work on GPU `ordinal` has finished.
/// PyTorch: `torch.cuda.synchronize`.
///
/// # Errors
/// [`Error::Device`](crate::Error::Device) when there is no such GPU or a kernel failed.
///
/// An index that a kernel found out of range since the host last waited (an
/// embedding's index, a cross entropy's target) is reported here, or by the
/// next read of a value, whichever comes first: checking it at the op would
/// make the host wait for the device in the middle of every step.
pub fn synchronize(ordinal: usize) -> Result<()> {
    let gpu = driver::gpu(ordinal)?;
    driver::streams(&gpu)?.wait("synchronize", true)
}

/// How many times the host has waited for the calling rank's work on GPU
/// `ordinal` (a value read to the host, a copy from the host of more than
/// 256 KiB, a [`synchronize`]; smaller copies pass through pinned memory): each wait drains the rank's queue of kernels, so a
/// training step that waits once (for its loss) keeps the GPU busy while the
/// host queues the step.
///
/// # Errors
/// [`Error::Device`](crate::Error::Device) when there is no such GPU.
pub fn host_waits(ordinal: usize) -> Result<u64> {
    let gpu = driver::gpu(ordinal)?;
    Ok(driver::streams(&gpu)?.waits())
}

pub use ops::AdamScalars;

/// One AdamW step in place on the GPU: PyTorch's `torch.optim.AdamW`
/// single-tensor update with the per-step `scalars` (rounded to f32 as the host
/// kernel rounds them), in the host kernel's order of operations:
/// `p ← p·decay`, `m ← lerp(m, g, 1−β₁)`, `v ← β₂v + (1−β₂)g²`,
/// `p ← p − step · m / (√v / √(1−β₂ᵗ) + ε)`. Every tensor is f32 on one GPU
/// with the same element count; a tensor whose storage another handle shares
/// is copied first (the other handle sees no change).
///
/// # Errors
/// [`Error::Device`](crate::Error::Device) for other dtypes, sizes or devices.
pub fn adamw_step(
    param: &mut crate::Tensor,
    grad: &crate::Tensor,
    exp_avg: &mut crate::Tensor,
    exp_avg_sq: &mut crate::Tensor,
    scalars: AdamScalars,
) -> Result<()> {
    ops::adamw_step(param, grad, exp_avg, exp_avg_sq, scalars)
}
