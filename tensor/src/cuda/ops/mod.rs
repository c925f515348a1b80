//! The device side of [`Tensor`]'s ops: each public op checks its arguments as
//! on the host, then calls here when its tensors are on a GPU.
//!
//! Kernels take contiguous inputs unless they read through strides (copies,
//! casts, element-wise ops); other inputs are made contiguous first.

use std::sync::Arc;

use cudarc::driver::{DeviceRepr, PushKernelArg};
use tessera_mesh::DType;

use super::blas::{self, Operand};
use super::buffer::CudaBuffer;
use super::driver::{self, RankStreams, grid_1d, grid_columns, grid_rows};
use super::library::cuda_error;
use crate::ops::Reduction;
use crate::{Device, Error, Result, Tensor};

/// The most dims a strided kernel takes.
const MAX_DIMS: usize = 8;

/// The shape of an output and two inputs' strides over it (`kernels.cu`'s `Geo`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct Geo {
    rank: i32,
    _pad: i32,
    numel: i64,
    shape: [i64; MAX_DIMS],
    sa: [i64; MAX_DIMS],
    sb: [i64; MAX_DIMS],
    oa: i64,
    ob: i64,
}

// SAFETY: `Geo` is plain old data laid out as the kernels' struct.
unsafe impl DeviceRepr for Geo {}

/// Up to 16 peer pointers (`kernels.cu`'s `Peers`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Peers {
    pub(crate) n: i32,
    pub(crate) _pad: i32,
    pub(crate) ptr: [u64; 16],
}

// SAFETY: plain old data laid out as the kernels' struct.
unsafe impl DeviceRepr for Peers {}

impl Geo {
    /// `shape` read through `(strides a, offset a)` and `(strides b, offset b)`,
    /// with dims of size 1 dropped (they move no index).
    fn new(op: &'static str, shape: &[usize], a: (&[i64], usize), b: (&[i64], usize)) -> Result<Geo> {
        let keep: Vec<usize> = (0..shape.len()).filter(|&d| shape[d] != 1).collect();
        if keep.len() > MAX_DIMS {
            return Err(Error::Device {
                op,
                detail: format!(
                    "shape {shape:?} has more than {MAX_DIMS} dims of size > 1, which the CUDA kernels take"
                ),
            });
        }
        let mut g = Geo {
            rank: keep.len() as i32,
            numel: shape.iter().product::<usize>() as i64,
            oa: a.1 as i64,
            ob: b.1 as i64,
            ..Geo::default()
        };
        for (i, &d) in keep.iter().enumerate() {
            g.shape[i] = shape[d] as i64;
            g.sa[i] = a.0[d];
            g.sb[i] = b.0[d];
        }
        Ok(g)
    }
}

fn strides_of(t: &Tensor) -> Vec<i64> {
    t.strides().iter().map(|&s| s as i64).collect()
}

fn contiguous_strides(shape: &[usize]) -> Vec<i64> {
    let mut s = vec![0i64; shape.len()];
    let mut acc = 1i64;
    for d in (0..shape.len()).rev() {
        s[d] = acc;
        acc *= shape[d] as i64;
    }
    s
}

/// The device buffer of `t`.
fn buf(t: &Tensor) -> &CudaBuffer {
    t.cuda_buffer().expect("device ops are only called for device tensors")
}

/// The address of `t`'s first element.
fn ptr(t: &Tensor) -> u64 {
    buf(t).ptr() + (t.storage_offset() * t.dtype().size_in_bytes()) as u64
}

/// The streams of the calling rank on the one GPU that holds every tensor.
pub(crate) fn streams_for(op: &'static str, tensors: &[&Tensor]) -> Result<Arc<RankStreams>> {
    let first = tensors[0].device();
    for (i, t) in tensors.iter().enumerate() {
        if t.device() != first || !first.is_cuda() {
            return Err(Error::Device {
                op,
                detail: format!(
                    "expected every tensor on {first}, but tensor {i} is on {}; move it with .to({first})",
                    t.device()
                ),
            });
        }
    }
    let gpu = driver::gpu(buf(tensors[0]).ordinal())?;
    driver::streams(&gpu)
}

fn kernel_dtype(op: &'static str, dtype: DType) -> Result<&'static str> {
    match dtype {
        DType::F32 => Ok("f32"),
        DType::F64 => Ok("f64"),
        DType::BF16 => Ok("bf16"),
        other => Err(Error::Device {
            op,
            detail: format!("dtype {other} has no CUDA kernel for this op; cast to f32 or bf16"),
        }),
    }
}

/// A new contiguous device tensor of `shape` (uninitialised).
fn empty(s: &RankStreams, shape: &[usize], dtype: DType, op: &'static str) -> Result<Tensor> {
    let n = shape.iter().product();
    Ok(Tensor::from_cuda(CudaBuffer::uninit_on(s, n, dtype, op)?, shape))
}

/// Launches kernel `$name` on the rank's compute stream with the arguments
/// given (pointers as u64), as `Result<()>`.
macro_rules! launch {
    ($s:expr, $op:expr, $name:expr, $cfg:expr, $($arg:expr),* $(,)?) => {{
        let f = $s.gpu.function(&$name)?;
        let mut b = $s.compute.launch_builder(&f);
        $( b.arg($arg); )*
        // SAFETY: every kernel's arguments are pushed in its declared order and
        // types (pointers as u64), and the buffers they address are alive and
        // sized for the launch (checked by the op before the launch).
        unsafe { b.launch($cfg) }.map(|_| ()).map_err(|e| cuda_error($op, e))
    }};
}

/// Threads per row for the row kernels: enough for the row, a multiple of 32.
fn row_threads(n: usize) -> u32 {
    (n.div_ceil(32) * 32).clamp(32, 512) as u32
}

/// `(rows, n)` of `t` seen as rows of its last dim `n` (0 rows when `n` is 0).
fn rows_of(t: &Tensor) -> (usize, usize) {
    let n = t.shape()[t.rank() - 1];
    (t.numel().checked_div(n).unwrap_or(0), n)
}

/// A device word set by kernels that find a bad index; read after the kernel.
fn flag(s: &RankStreams, op: &'static str) -> Result<Tensor> {
    let t = empty(s, &[1], DType::I64, op)?;
    s.gpu.bind()?;
    // SAFETY: the block holds 8 bytes; zeroed on the rank's stream before use.
    unsafe { cudarc::driver::result::memset_d8_async(ptr(&t), 0, 8, s.compute.cu_stream()) }
        .map_err(|e| cuda_error(op, e))?;
    Ok(t)
}

/// Errors when a kernel set the flag `bad` to position `k + 1`: `what` says
/// what was wrong with `indices[k]`.
fn check_flag(bad: &Tensor, op: &'static str, indices: &Tensor, what: impl FnOnce(i64, usize) -> String) -> Result<()> {
    let k = to(bad, Device::Cpu)?.to_vec::<i64>()?[0];
    if k <= 0 {
        return Ok(());
    }
    let at = k as usize - 1;
    let value = to(indices, Device::Cpu)?.reshape(&[indices.numel()])?.to_vec::<i64>()?[at];
    Err(Error::InvalidArgument {
        op,
        detail: what(value, at),
    })
}

mod adamw;
mod elementwise;
mod embedding;
mod matmul;
mod rows;

pub use adamw::AdamScalars;
pub(crate) use adamw::adamw_step;
pub(crate) use elementwise::{binary, full, scalar, unary};
pub(crate) use embedding::{embedding, embedding_backward};
pub(crate) use matmul::matmul;
pub(crate) use rows::{
    Reduce, cross_entropy, cross_entropy_backward_from_probs, norm, norm_backward, norm_weight_grad, reduce, softmax,
    softmax_backward,
};

// ---- moving ----------------------------------------------------------------

/// `t` on `device`.
pub(crate) fn to(t: &Tensor, device: Device) -> Result<Tensor> {
    match (t.device(), device) {
        (a, b) if a == b => Ok(t.clone()),
        (Device::Cpu, Device::Cuda(n)) => {
            // `to_buffer` gathers any layout row-major: one host copy.
            Ok(Tensor::from_cuda(CudaBuffer::from_host(n, &t.to_buffer())?, t.shape()))
        }
        (Device::Cuda(_), Device::Cpu) => {
            let c = contiguous(t)?;
            let data = buf(&c).to_host(c.storage_offset(), c.numel())?;
            Tensor::from_buffer(data, t.shape())
        }
        (Device::Cuda(_), Device::Cuda(n)) => to(&to(t, Device::Cpu)?, Device::Cuda(n)),
        (Device::Cpu, Device::Cpu) => Ok(t.clone()),
    }
}

/// `src` copied into the strided view `(shape, strides, offset)` of `dst`'s buffer.
fn copy_into(
    s: &RankStreams,
    op: &'static str,
    src: &Tensor,
    dst: &CudaBuffer,
    dst_strides: &[i64],
    dst_offset: usize,
) -> Result<()> {
    if src.numel() == 0 {
        return Ok(());
    }
    let g = Geo::new(op, src.shape(), (&strides_of(src), 0), (dst_strides, dst_offset))?;
    let name = format!("copy_w{}", src.dtype().size_in_bytes());
    let (o, x) = (dst.ptr(), ptr(src));
    buf(src).block().used_on(&s.compute)?;
    launch!(s, op, name, grid_1d(src.numel()), &o, &x, &g)
}

/// A row-major copy of `t` (itself when contiguous).
pub(crate) fn contiguous(t: &Tensor) -> Result<Tensor> {
    if t.is_contiguous() {
        return Ok(t.clone());
    }
    let s = streams_for("contiguous", &[t])?;
    let out = empty(&s, t.shape(), t.dtype(), "contiguous")?;
    copy_into(&s, "contiguous", t, buf(&out), &contiguous_strides(t.shape()), 0)?;
    Ok(out)
}

/// `tensors` concatenated along `dim` (shapes and dtypes checked by the caller).
pub(crate) fn cat(tensors: &[Tensor], dim: usize, shape: &[usize]) -> Result<Tensor> {
    let refs: Vec<&Tensor> = tensors.iter().collect();
    let s = streams_for("cat", &refs)?;
    let out = empty(&s, shape, tensors[0].dtype(), "cat")?;
    let strides = contiguous_strides(shape);
    let mut at = 0usize;
    for t in tensors {
        copy_into(&s, "cat", t, buf(&out), &strides, at * strides[dim] as usize)?;
        at += t.shape()[dim];
    }
    Ok(out)
}

/// A zeroed tensor of `shape` with each piece copied in at its offset
/// (arguments checked by the caller).
pub(crate) fn assemble(
    shape: &[usize],
    dtype: DType,
    device: Device,
    pieces: &[(&[usize], &Tensor)],
) -> Result<Tensor> {
    let out = zeros_any(device, shape, dtype)?;
    let s = streams_for("assemble", &[&out])?;
    let strides = contiguous_strides(shape);
    for (offset, piece) in pieces {
        let at: i64 = offset.iter().zip(&strides).map(|(&o, &s)| o as i64 * s).sum();
        copy_into(&s, "assemble", piece, buf(&out), &strides, at as usize)?;
    }
    Ok(out)
}

/// Zeros of any dtype (integers and bytes included), by a memset.
fn zeros_any(device: Device, shape: &[usize], dtype: DType) -> Result<Tensor> {
    let Device::Cuda(ordinal) = device else {
        return Tensor::zeros(shape, dtype);
    };
    let gpu = driver::gpu(ordinal)?;
    let s = driver::streams(&gpu)?;
    let out = empty(&s, shape, dtype, "zeros")?;
    gpu.bind()?;
    // SAFETY: the block holds the tensor's bytes; zeroed on the rank's stream.
    unsafe { cudarc::driver::result::memset_d8_async(ptr(&out), 0, out.size_in_bytes(), s.compute.cu_stream()) }
        .map_err(|e| cuda_error("zeros", e))?;
    Ok(out)
}

/// `t` converted to `dtype`.
pub(crate) fn cast(t: &Tensor, dtype: DType) -> Result<Tensor> {
    if t.dtype() == dtype {
        return contiguous(t);
    }
    let s = streams_for("cast", &[t])?;
    let (from, to_) = (kernel_dtype("cast", t.dtype())?, kernel_dtype("cast", dtype)?);
    let out = empty(&s, t.shape(), dtype, "cast")?;
    if t.numel() > 0 {
        // The output is dense: the kernel writes element i at i.
        let g = Geo::new(
            "cast",
            t.shape(),
            (&strides_of(t), t.storage_offset()),
            (&strides_of(t), 0),
        )?;
        let (o, x) = (ptr(&out), buf(t).ptr());
        launch!(s, "cast", format!("cast_{from}_{to_}"), grid_1d(t.numel()), &o, &x, &g)?;
    }
    Ok(out)
}

// ---- collectives' and optimizers' helpers ---------------------------------------------------------

/// The rank's streams for a device tensor (for the collectives).
pub(crate) fn rank_streams(t: &Tensor) -> Result<Arc<RankStreams>> {
    streams_for("collective", &[t])
}

/// Address of `t`'s first element (for the collectives).
pub(crate) fn address(t: &Tensor) -> u64 {
    ptr(t)
}

/// Notes that `stream` read or wrote `t`'s storage.
pub(crate) fn used_on(t: &Tensor, stream: &cudarc::driver::CudaStream) -> Result<()> {
    buf(t).block().used_on(stream)
}

/// A new uninitialised contiguous tensor on the rank's GPU (for the collectives).
pub(crate) fn empty_like_on(s: &RankStreams, shape: &[usize], dtype: DType) -> Result<Tensor> {
    empty(s, shape, dtype, "collective")
}

/// `out[i] = op_p peers[p][offset + i]` on `stream` (`kernels.cu`'s `reduce_peers`).
pub(crate) fn reduce_peers(
    s: &RankStreams,
    out: &Tensor,
    peers: Peers,
    offset: usize,
    len: usize,
    op: i32,
) -> Result<()> {
    let ty = match out.dtype() {
        DType::I64 if op == 1 => {
            return Err(Error::Device {
                op: "reduce",
                detail: "an average of i64 tensors is not an integer; cast to a float dtype first".into(),
            });
        }
        DType::I64 => "i64",
        other => kernel_dtype("reduce", other)?,
    };
    let f = s.gpu.function(&format!("reduce_peers_{ty}"))?;
    let mut b = s.comm.launch_builder(&f);
    let (o, off, l) = (ptr(out), offset as i64, len as i64);
    b.arg(&o).arg(&peers).arg(&off).arg(&l).arg(&op);
    // SAFETY: the arguments match the kernel; every peer pointer addresses a
    // live buffer of at least `offset + len` elements, kept alive by the
    // collective until its completion event.
    unsafe { b.launch(grid_1d(len)) }.map_err(|e| cuda_error("reduce", e))?;
    Ok(())
}
