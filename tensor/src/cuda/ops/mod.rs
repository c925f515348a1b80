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
use super::driver::{self, RankStreams, grid_1d, grid_columns, grid_rows, grid_warp_rows, warp_slots};
use super::library::cuda_error;
use crate::ops::Reduction;
use crate::{Device, Error, Result, Tensor};
use cudarc::driver::LaunchConfig;

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

/// The kernel `{family}_warp{slots}_{ty}` with one warp per row when rows of
/// `n` fit a warp's registers, else `{family}_rows_{ty}` with a block of
/// [`row_threads`] per row.
fn row_kernel(family: &str, ty: &str, rows: usize, n: usize) -> (String, LaunchConfig) {
    match warp_slots(n) {
        Some(slots) => (format!("{family}_warp{slots}_{ty}"), grid_warp_rows(rows)),
        None => (format!("{family}_rows_{ty}"), grid_rows(rows, row_threads(n))),
    }
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

/// Queues the check of the flag `bad` (set by a kernel to position `k + 1`
/// of a bad element of `indices`), read when the host next waits for
/// the rank's work (a value read, [`synchronize`](crate::cuda::synchronize)):
/// `what` says what was wrong with `indices[k]`. Until then the op's output
/// holds zeros where an index was bad, as PyTorch's device-side asserts
/// surface at the next synchronisation.
fn check_flag(
    s: &RankStreams,
    bad: Tensor,
    op: &'static str,
    indices: &Tensor,
    what: impl FnOnce(i64, usize) -> String + Send + 'static,
) -> Result<()> {
    s.defer(driver::PendingCheck {
        flag: bad,
        indices: indices.clone(),
        op,
        what: Box::new(what),
    })
}

mod adamw;
mod attention;
mod elementwise;
mod embedding;
mod matmul;
mod rows;

pub use adamw::AdamScalars;
pub(crate) use adamw::adamw_step;
pub(crate) use attention::attention;
pub(crate) use elementwise::{binary, full, scalar, unary};
pub(crate) use embedding::{embedding, embedding_backward};
pub(crate) use matmul::{causal_scores_unmasked, matmul};
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
        // `Tensor::to` makes meta copies and refuses to read a meta tensor
        // before it calls here.
        (Device::Meta, _) | (_, Device::Meta) => Err(crate::Error::Device {
            op: "to",
            detail: format!("no device copy between {} and {device}", t.device()),
        }),
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
    let src_strides = strides_of(src);
    buf(src).block().used_on(&s.compute)?;
    let elem = src.dtype().size_in_bytes();
    let (o, x) = (dst.ptr(), ptr(src));
    if let Some(word) = row_word(src, &src_strides, (o + (dst_offset * elem) as u64, dst_strides), x) {
        // Rows dense on both sides: whole words per thread, index arithmetic per row.
        let r = src.rank();
        let per = (word / elem) as i64;
        let in_words = |st: &[i64]| st[..r - 1].iter().map(|&v| v / per).collect::<Vec<_>>();
        let g = Geo::new(
            op,
            &src.shape()[..r - 1],
            (&in_words(&src_strides), 0),
            (&in_words(dst_strides), 0),
        )?;
        let inner = (src.shape()[r - 1] * elem / word) as i64;
        let words = src.numel() * elem / word;
        let (o, n) = (o + (dst_offset * elem) as u64, words as i64);
        return launch!(
            s,
            op,
            format!("copy_words_w{word}"),
            grid_1d(words),
            &o,
            &x,
            &n,
            &inner,
            &g
        );
    }
    let g = Geo::new(op, src.shape(), (&src_strides, 0), (dst_strides, dst_offset))?;
    let name = format!("copy_w{elem}");
    launch!(s, op, name, grid_1d(src.numel()), &o, &x, &g)
}

/// The widest word (16, 8, 4, 2 or 1 bytes, at least an element) in which a
/// copy of `src` (its `strides`) to `(address, strides)` can move whole rows:
/// the innermost dim dense on both sides and every row's start on both sides
/// aligned to the word. `None` for copies without such rows, or with rows
/// too short to gain.
fn row_word(src: &Tensor, strides: &[i64], (dst, dst_strides): (u64, &[i64]), src_ptr: u64) -> Option<usize> {
    let r = src.rank();
    let elem = src.dtype().size_in_bytes();
    if r == 0 || strides[r - 1] != 1 || dst_strides[r - 1] != 1 || src.shape()[r - 1] < 4 {
        return None;
    }
    let row_bytes = src.shape()[r - 1] * elem;
    [16, 8, 4, 2, 1].into_iter().filter(|&w| w >= elem).find(|&w| {
        let fits = |st: &[i64]| (0..r - 1).all(|d| src.shape()[d] == 1 || (st[d] as usize * elem).is_multiple_of(w));
        row_bytes.is_multiple_of(w)
            && src_ptr.is_multiple_of(w as u64)
            && dst.is_multiple_of(w as u64)
            && fits(strides)
            && fits(dst_strides)
    })
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
        if t.is_contiguous() && (from, to_) != ("f64", "bf16") {
            // No index arithmetic (f64 to bf16 keeps its one-rounding kernel).
            let (x, n) = (ptr(t), t.numel() as i64);
            launch!(
                s,
                "cast",
                format!("cast_dense_{from}_{to_}"),
                grid_1d(t.numel().div_ceil(4)),
                &o,
                &x,
                &n
            )?;
        } else {
            launch!(s, "cast", format!("cast_{from}_{to_}"), grid_1d(t.numel()), &o, &x, &g)?;
        }
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
