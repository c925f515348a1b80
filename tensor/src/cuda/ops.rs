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

// ---- element-wise -------------------------------------------------------------

/// Strides of `t` broadcast to `shape` (right-aligned, 0 where `t` has size 1).
fn broadcast_strides(t: &Tensor, shape: &[usize]) -> Vec<i64> {
    let lead = shape.len() - t.rank();
    (0..shape.len())
        .map(|d| {
            if d < lead || t.shape()[d - lead] == 1 {
                0
            } else {
                t.strides()[d - lead] as i64
            }
        })
        .collect()
}

/// `kernel(a, b)` broadcast to `shape` (checked by the caller): a dense
/// kernel when both match `shape`, a repeating one when `b` is a dense block
/// that repeats along `a`'s leading dims (a bias), else the strided one.
pub(crate) fn binary(kernel: &str, op: &'static str, a: &Tensor, b: &Tensor, shape: &[usize]) -> Result<Tensor> {
    let s = streams_for(op, &[a, b])?;
    let ty = kernel_dtype(op, a.dtype())?;
    let out = empty(&s, shape, a.dtype(), op)?;
    let n = out.numel();
    if n == 0 {
        return Ok(out);
    }
    let dense = |t: &Tensor| t.is_contiguous() && t.shape() == shape;
    let (o, nn) = (ptr(&out), n as i64);
    if dense(a) && dense(b) {
        let (x, y) = (ptr(a), ptr(b));
        launch!(
            s,
            op,
            format!("dense_{kernel}_{ty}"),
            grid_1d(n.div_ceil(4)),
            &o,
            &x,
            &y,
            &nn
        )?;
    } else if dense(a) && b.is_contiguous() && repeats(b.shape(), shape) && b.numel() > 0 {
        let (x, y, period) = (ptr(a), ptr(b), b.numel() as i64);
        launch!(
            s,
            op,
            format!("rows_{kernel}_{ty}"),
            grid_1d(n),
            &o,
            &x,
            &y,
            &nn,
            &period
        )?;
    } else {
        let g = Geo::new(
            op,
            shape,
            (&broadcast_strides(a, shape), a.storage_offset()),
            (&broadcast_strides(b, shape), b.storage_offset()),
        )?;
        let (x, y) = (buf(a).ptr(), buf(b).ptr());
        launch!(s, op, format!("binary_{kernel}_{ty}"), grid_1d(n), &o, &x, &y, &g)?;
    }
    Ok(out)
}

/// Whether `small` (leading 1s dropped) is the trailing dims of `shape`, so
/// that its elements repeat every `small.numel()` elements of `shape`.
fn repeats(small: &[usize], shape: &[usize]) -> bool {
    let lead = small.iter().take_while(|&&d| d == 1).count();
    shape.ends_with(&small[lead..])
}

/// `kernel(a, scalar)` element-wise.
pub(crate) fn scalar(kernel: &str, op: &'static str, a: &Tensor, v: f64) -> Result<Tensor> {
    dense_map(op, &format!("scalar_{kernel}"), a, Some(v))
}

/// `kernel(a)` element-wise.
pub(crate) fn unary(kernel: &str, op: &'static str, a: &Tensor) -> Result<Tensor> {
    dense_map(op, &format!("unary_{kernel}"), a, None)
}

/// The dense one-input kernel `name_T` over `a` (made contiguous), with the
/// scalar argument when there is one; each thread takes 16 bytes.
fn dense_map(op: &'static str, name: &str, a: &Tensor, scalar: Option<f64>) -> Result<Tensor> {
    let s = streams_for(op, &[a])?;
    let ty = kernel_dtype(op, a.dtype())?;
    let a = contiguous(a)?;
    let out = empty(&s, a.shape(), a.dtype(), op)?;
    let n = a.numel() as i64;
    if n > 0 {
        let (o, x, name, grid) = (
            ptr(&out),
            ptr(&a),
            format!("{name}_{ty}"),
            grid_1d((n as usize).div_ceil(4)),
        );
        match scalar {
            Some(v) => launch!(s, op, name, grid, &o, &x, &v, &n)?,
            None => launch!(s, op, name, grid, &o, &x, &n)?,
        }
    }
    Ok(out)
}

/// Every element of a new tensor set to `value`.
pub(crate) fn full(device: Device, shape: &[usize], value: f64, dtype: DType) -> Result<Tensor> {
    let Device::Cuda(ordinal) = device else {
        return Tensor::full(shape, value, dtype);
    };
    let gpu = driver::gpu(ordinal)?;
    let s = driver::streams(&gpu)?;
    let ty = kernel_dtype("full", dtype)?;
    let out = empty(&s, shape, dtype, "full")?;
    let n = out.numel() as i64;
    if n > 0 {
        let o = ptr(&out);
        launch!(s, "full", format!("fill_{ty}"), grid_1d(n as usize), &o, &value, &n)?;
    }
    Ok(out)
}

// ---- reductions ----------------------------------------------------------------

/// Sum (`mean` scales by 1/count) or maximum of `t` over `dims` (sorted,
/// distinct, checked by the caller).
pub(crate) fn reduce(t: &Tensor, dims: &[usize], keepdim: bool, kind: Reduce) -> Result<Tensor> {
    let op = kind.op();
    let s = streams_for(op, &[t])?;
    let ty = kernel_dtype(op, t.dtype())?;
    let shape: Vec<usize> = (0..t.rank())
        .filter_map(|d| {
            if dims.contains(&d) {
                keepdim.then_some(1)
            } else {
                Some(t.shape()[d])
            }
        })
        .collect();
    // Sums over leading dims (bias gradients, means over a batch): column sums
    // of the contiguous tensor as [rows, n], without moving the reduced dims last.
    let leading = dims.iter().enumerate().all(|(i, &d)| d == i);
    if leading && kind != Reduce::Max && !dims.is_empty() && t.numel() > 0 {
        let rows: usize = dims.iter().map(|&d| t.shape()[d]).product();
        let n = t.numel() / rows;
        let x = contiguous(t)?;
        let out = empty(&s, &shape, t.dtype(), op)?;
        let scale = if kind == Reduce::Mean { 1.0 / rows as f64 } else { 1.0 };
        let (o, xp, r, nn) = (ptr(&out), ptr(&x), rows as i64, n as i64);
        launch!(
            s,
            op,
            format!("sum_columns_{ty}"),
            grid_columns(n),
            &o,
            &xp,
            &r,
            &nn,
            &scale
        )?;
        return Ok(out);
    }
    // The kept dims first, the reduced ones last: rows of `n` to reduce.
    let kept: Vec<usize> = (0..t.rank()).filter(|d| !dims.contains(d)).collect();
    let order: Vec<usize> = kept.iter().chain(dims).copied().collect();
    let x = contiguous(&t.permute(&order)?)?;
    let n: usize = dims.iter().map(|&d| t.shape()[d]).product();
    let rows: usize = kept.iter().map(|&d| t.shape()[d]).product();
    if n == 0 {
        let v = match kind {
            Reduce::Sum => 0.0,
            Reduce::Mean => f64::NAN,
            Reduce::Max => {
                return Err(Error::InvalidArgument {
                    op,
                    detail: format!("cannot take the maximum over an empty dim of {:?}", t.shape()),
                });
            }
        };
        return full(t.device(), &shape, v, t.dtype());
    }
    let out = empty(&s, &shape, t.dtype(), op)?;
    if rows > 0 {
        let (o, xp) = (ptr(&out), ptr(&x));
        let scale = if kind == Reduce::Mean { 1.0 / n as f64 } else { 1.0 };
        let is_max = i32::from(kind == Reduce::Max);
        let (r, nn) = (rows as i64, n as i64);
        launch!(
            s,
            op,
            format!("reduce_rows_{ty}"),
            grid_rows(rows, row_threads(n)),
            &o,
            &xp,
            &r,
            &nn,
            &scale,
            &is_max
        )?;
    }
    Ok(out)
}

/// What [`reduce`] computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Reduce {
    Sum,
    Mean,
    Max,
}

impl Reduce {
    fn op(self) -> &'static str {
        match self {
            Reduce::Sum => "sum",
            Reduce::Mean => "mean",
            Reduce::Max => "max",
        }
    }
}

// ---- softmax family ------------------------------------------------------------

/// `t` with `dim` moved last and made contiguous, and the permutation back.
fn dim_last(t: &Tensor, dim: usize) -> Result<(Tensor, Option<Vec<usize>>)> {
    let last = t.rank() - 1;
    if dim == last {
        return Ok((contiguous(t)?, None));
    }
    let mut order: Vec<usize> = (0..t.rank()).collect();
    order.swap(dim, last);
    Ok((contiguous(&t.permute(&order)?)?, Some(order)))
}

fn restore(t: Tensor, order: Option<Vec<usize>>) -> Result<Tensor> {
    match order {
        // A swap is its own inverse.
        Some(order) => contiguous(&t.permute(&order)?),
        None => Ok(t),
    }
}

/// Softmax or log-softmax of `scale · t` along `dim`, causal over rows of
/// `period` queries when `period > 0`.
pub(crate) fn softmax(t: &Tensor, dim: usize, scale: f64, period: usize, log: bool) -> Result<Tensor> {
    let op = if log { "log_softmax" } else { "softmax" };
    let s = streams_for(op, &[t])?;
    let ty = kernel_dtype(op, t.dtype())?;
    let (x, order) = dim_last(t, dim)?;
    let n = x.shape()[x.rank() - 1];
    let rows = x.numel().checked_div(n).unwrap_or(0);
    let out = empty(&s, x.shape(), x.dtype(), op)?;
    if rows > 0 && n > 0 {
        let (o, xp) = (ptr(&out), ptr(&x));
        let (r, nn, p, lg) = (rows as i64, n as i64, period as i64, i32::from(log));
        launch!(
            s,
            op,
            format!("softmax_rows_{ty}"),
            grid_rows(rows, row_threads(n)),
            &o,
            &xp,
            &r,
            &nn,
            &scale,
            &p,
            &lg
        )?;
    }
    restore(out, order)
}

/// `scale · y · (g − Σ g·y)` along `dim`.
pub(crate) fn softmax_backward(g: &Tensor, y: &Tensor, dim: usize, scale: f64) -> Result<Tensor> {
    const OP: &str = "softmax_backward";
    let s = streams_for(OP, &[g, y])?;
    let ty = kernel_dtype(OP, g.dtype())?;
    let (gc, order) = dim_last(g, dim)?;
    let (yc, _) = dim_last(y, dim)?;
    let n = gc.shape()[gc.rank() - 1];
    let rows = gc.numel().checked_div(n).unwrap_or(0);
    let out = empty(&s, gc.shape(), gc.dtype(), OP)?;
    if rows > 0 && n > 0 {
        let (o, gp, yp) = (ptr(&out), ptr(&gc), ptr(&yc));
        let (r, nn) = (rows as i64, n as i64);
        launch!(
            s,
            OP,
            format!("softmax_backward_rows_{ty}"),
            grid_rows(rows, row_threads(n)),
            &o,
            &gp,
            &yp,
            &r,
            &nn,
            &scale
        )?;
    }
    restore(out, order)
}

// ---- normalisation ------------------------------------------------------------------

fn opt_ptr(t: Option<&Tensor>) -> Result<(u64, Option<Tensor>)> {
    match t {
        Some(t) => {
            let c = contiguous(t)?;
            Ok((ptr(&c), Some(c)))
        }
        None => Ok((0, None)),
    }
}

/// Layer norm (`rms == false`) or RMSNorm of the last dim: `(y, mean, rstd)`,
/// the statistics f64 of shape `[..., 1]`.
pub(crate) fn norm(
    x: &Tensor,
    w: Option<&Tensor>,
    b: Option<&Tensor>,
    eps: f64,
    rms: bool,
) -> Result<(Tensor, Tensor, Tensor)> {
    let op = if rms { "rms_norm" } else { "layer_norm" };
    let mut all = vec![x];
    all.extend(w);
    all.extend(b);
    let s = streams_for(op, &all)?;
    let ty = kernel_dtype(op, x.dtype())?;
    let xc = contiguous(x)?;
    let n = x.shape()[x.rank() - 1];
    let rows = x.numel().checked_div(n).unwrap_or(0);
    let mut stat_shape = x.shape().to_vec();
    *stat_shape.last_mut().expect("rank checked by the caller") = 1;
    let out = empty(&s, x.shape(), x.dtype(), op)?;
    let mean = empty(&s, &stat_shape, DType::F64, op)?;
    let rstd = empty(&s, &stat_shape, DType::F64, op)?;
    if rows > 0 && n > 0 {
        let ((wp, _wk), (bp, _bk)) = (opt_ptr(w)?, opt_ptr(b)?);
        let (o, m, rs, xp) = (ptr(&out), ptr(&mean), ptr(&rstd), ptr(&xc));
        let (r, nn, is_rms) = (rows as i64, n as i64, i32::from(rms));
        launch!(
            s,
            op,
            format!("norm_rows_{ty}"),
            grid_rows(rows, row_threads(n)),
            &o,
            &m,
            &rs,
            &xp,
            &wp,
            &bp,
            &r,
            &nn,
            &eps,
            &is_rms
        )?;
    }
    Ok((out, mean, rstd))
}

/// The input gradient of layer norm or RMSNorm from the forward statistics.
pub(crate) fn norm_backward(
    g: &Tensor,
    x: &Tensor,
    w: Option<&Tensor>,
    mean: &Tensor,
    rstd: &Tensor,
    rms: bool,
) -> Result<Tensor> {
    let op = if rms {
        "rms_norm_backward"
    } else {
        "layer_norm_backward"
    };
    let mut all = vec![g, x, mean, rstd];
    all.extend(w);
    let s = streams_for(op, &all)?;
    let ty = kernel_dtype(op, x.dtype())?;
    let (gc, xc, mc, rc) = (contiguous(g)?, contiguous(x)?, contiguous(mean)?, contiguous(rstd)?);
    let n = x.shape()[x.rank() - 1];
    let rows = x.numel().checked_div(n).unwrap_or(0);
    let out = empty(&s, x.shape(), x.dtype(), op)?;
    if rows > 0 && n > 0 {
        let (wp, _wk) = opt_ptr(w)?;
        let (o, gp, xp, mp, rp) = (ptr(&out), ptr(&gc), ptr(&xc), ptr(&mc), ptr(&rc));
        let (r, nn, is_rms) = (rows as i64, n as i64, i32::from(rms));
        launch!(
            s,
            op,
            format!("norm_backward_rows_{ty}"),
            grid_rows(rows, row_threads(n)),
            &o,
            &gp,
            &xp,
            &wp,
            &mp,
            &rp,
            &r,
            &nn,
            &is_rms
        )?;
    }
    Ok(out)
}

/// `Σ_rows g · x̂`: the weight gradient of layer norm or RMSNorm, shape `[n]`.
pub(crate) fn norm_weight_grad(g: &Tensor, x: &Tensor, mean: &Tensor, rstd: &Tensor) -> Result<Tensor> {
    const OP: &str = "norm_weight_grad";
    let s = streams_for(OP, &[g, x, mean, rstd])?;
    let ty = kernel_dtype(OP, x.dtype())?;
    let (gc, xc, mc, rc) = (contiguous(g)?, contiguous(x)?, contiguous(mean)?, contiguous(rstd)?);
    let n = x.shape()[x.rank() - 1];
    let rows = x.numel().checked_div(n).unwrap_or(0);
    let out = empty(&s, &[n], x.dtype(), OP)?;
    if n > 0 {
        let (o, gp, xp, mp, rp) = (ptr(&out), ptr(&gc), ptr(&xc), ptr(&mc), ptr(&rc));
        let (r, nn) = (rows as i64, n as i64);
        launch!(
            s,
            OP,
            format!("norm_weight_grad_{ty}"),
            grid_columns(n),
            &o,
            &gp,
            &xp,
            &mp,
            &rp,
            &r,
            &nn
        )?;
    }
    Ok(out)
}

// ---- cross entropy ---------------------------------------------------------------------

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

/// Cross entropy of logits `x` `[n, c]` against `targets` `[n]` (i64, on the
/// same GPU), and the probabilities when `probs` (shapes checked by the caller).
pub(crate) fn cross_entropy(
    x: &Tensor,
    targets: &Tensor,
    reduction: Reduction,
    probs: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    const OP: &str = "cross_entropy";
    let s = streams_for(OP, &[x, targets])?;
    let ty = kernel_dtype(OP, x.dtype())?;
    let (xc, tc) = (contiguous(x)?, contiguous(targets)?);
    let (n, c) = (x.shape()[0], x.shape()[1]);
    let losses = empty(&s, &[n], DType::F64, OP)?;
    let p = if probs {
        Some(empty(&s, &[n, c], x.dtype(), OP)?)
    } else {
        None
    };
    let bad = flag(&s, OP)?;
    if n > 0 {
        let (l, pp, xp, tp, bp) = (ptr(&losses), p.as_ref().map_or(0, ptr), ptr(&xc), ptr(&tc), ptr(&bad));
        let (r, cc) = (n as i64, c as i64);
        launch!(
            s,
            OP,
            format!("cross_entropy_rows_{ty}"),
            grid_rows(n, row_threads(c)),
            &l,
            &pp,
            &xp,
            &tp,
            &r,
            &cc,
            &bp
        )?;
    }
    check_flag(&bad, OP, targets, |t, row| {
        format!("target {t} of row {row} is not a class of 0..{c}")
    })?;
    let loss = match reduction {
        Reduction::None => cast(&losses, x.dtype())?,
        Reduction::Sum | Reduction::Mean => {
            let scale = if reduction == Reduction::Mean {
                1.0 / n as f64
            } else {
                1.0
            };
            let total = empty(&s, &[], DType::F64, OP)?;
            let (o, lp, nn) = (ptr(&total), ptr(&losses), n as i64);
            launch!(s, OP, "sum_f64_ordered", grid_rows(1, 512), &o, &lp, &nn, &scale)?;
            if n == 0 && reduction == Reduction::Mean {
                full(x.device(), &[], f64::NAN, x.dtype())?
            } else {
                cast(&total, x.dtype())?
            }
        }
    };
    Ok((loss, p))
}

/// `scale · (p − onehot(targets))` from probabilities `p` `[n, c]`.
pub(crate) fn cross_entropy_backward_from_probs(p: &Tensor, targets: &Tensor, scale: f64) -> Result<Tensor> {
    const OP: &str = "cross_entropy_backward";
    let s = streams_for(OP, &[p, targets])?;
    let ty = kernel_dtype(OP, p.dtype())?;
    let (pc, tc) = (contiguous(p)?, contiguous(targets)?);
    let (n, c) = (p.shape()[0], p.shape()[1]);
    let out = empty(&s, &[n, c], p.dtype(), OP)?;
    if n * c > 0 {
        let (o, pp, tp) = (ptr(&out), ptr(&pc), ptr(&tc));
        let (r, cc) = (n as i64, c as i64);
        launch!(
            s,
            OP,
            format!("cross_entropy_backward_{ty}"),
            grid_1d(n * c),
            &o,
            &pp,
            &tp,
            &r,
            &cc,
            &scale
        )?;
    }
    Ok(out)
}

// ---- embedding --------------------------------------------------------------------------

/// Rows `indices − first` of `table` `[rows, d]`: shape `indices.shape() + [d]`.
pub(crate) fn embedding(table: &Tensor, indices: &Tensor, first: usize) -> Result<Tensor> {
    const OP: &str = "embedding";
    let s = streams_for(OP, &[table, indices])?;
    let (tc, ic) = (contiguous(table)?, contiguous(indices)?);
    let (rows, d) = (table.shape()[0], table.shape()[1]);
    let n = indices.numel();
    let mut shape = indices.shape().to_vec();
    shape.push(d);
    let out = empty(&s, &shape, table.dtype(), OP)?;
    let bad = flag(&s, OP)?;
    let width = table.dtype().size_in_bytes();
    if !matches!(width, 2 | 4 | 8) {
        return Err(Error::Device {
            op: OP,
            detail: format!(
                "a {} table has no CUDA embedding kernel; cast it to f32 or bf16",
                table.dtype()
            ),
        });
    }
    if n * d > 0 {
        let (o, tp, ip, bp) = (ptr(&out), ptr(&tc), ptr(&ic), ptr(&bad));
        let (nn, dd, rr, ff) = (n as i64, d as i64, rows as i64, first as i64);
        launch!(
            s,
            OP,
            format!("embedding_w{width}"),
            grid_1d(n * d),
            &o,
            &tp,
            &ip,
            &nn,
            &dd,
            &rr,
            &ff,
            &bp
        )?;
    }
    check_flag(&bad, OP, indices, |i, at| {
        format!(
            "index {i} (element {at} of indices of shape {:?}) is out of range for a table of {rows} rows",
            indices.shape()
        )
    })?;
    Ok(out)
}

/// The gradient of a `[rows, d]` table (rows `first..first + rows` of the
/// whole) from the gradient `g` `[n, d]` of an embedding by `indices` `[n]`.
pub(crate) fn embedding_backward(g: &Tensor, indices: &Tensor, rows: usize, first: usize) -> Result<Tensor> {
    const OP: &str = "embedding_backward";
    let s = streams_for(OP, &[g, indices])?;
    let ty = match g.dtype() {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        other => {
            return Err(Error::Device {
                op: OP,
                detail: format!("dtype {other} has no CUDA embedding gradient; cast to f32 or bf16"),
            });
        }
    };
    let (gc, ic) = (contiguous(g)?, contiguous(indices)?);
    let (n, d) = (g.shape()[0], g.shape()[1]);
    let acc = full(g.device(), &[rows, d], 0.0, DType::F32)?;
    if n * d > 0 {
        let (a, gp, ip) = (ptr(&acc), ptr(&gc), ptr(&ic));
        let (nn, dd, rr, ff) = (n as i64, d as i64, rows as i64, first as i64);
        launch!(
            s,
            OP,
            format!("embedding_backward_{ty}"),
            grid_1d(n * d),
            &a,
            &gp,
            &ip,
            &nn,
            &dd,
            &rr,
            &ff
        )?;
    }
    cast(&acc, g.dtype())
}

// ---- matrix products ------------------------------------------------------------------------

/// How a `[.., r, c]` tensor's last two dims lie: `(transposed, leading dim)`,
/// or `None` when neither rows nor columns are dense.
fn matrix_layout(t: &Tensor) -> Option<(bool, usize)> {
    let k = t.rank();
    let (r, c) = (t.shape()[k - 2], t.shape()[k - 1]);
    let (sr, sc) = (t.strides()[k - 2], t.strides()[k - 1]);
    if sc == 1 || c == 1 {
        Some((false, sr.max(c).max(1)))
    } else if sr == 1 || r == 1 {
        Some((true, sc.max(r).max(1)))
    } else {
        None
    }
}

/// `a · b` for `a` `[batch.., m, k]` and `b` `[batch.., k, n]` whose batch
/// dims are already broadcast to `batch` (shapes checked by the caller).
pub(crate) fn matmul(a: &Tensor, b: &Tensor, batch: &[usize]) -> Result<Tensor> {
    const OP: &str = "matmul";
    let s = streams_for(OP, &[a, b])?;
    let (ra, rb) = (a.rank(), b.rank());
    let (m, k, n) = (a.shape()[ra - 2], a.shape()[ra - 1], b.shape()[rb - 1]);
    let count: usize = batch.iter().product();
    let mut shape = batch.to_vec();
    shape.extend([m, n]);
    let out = empty(&s, &shape, a.dtype(), OP)?;
    if count * m * n == 0 {
        return Ok(out);
    }
    if k == 0 {
        return full(a.device(), &shape, 0.0, a.dtype());
    }
    // One operand per batch: strided batches need one stride over the batch
    // dims, so an operand whose batch dims are not one run is copied first.
    let operand = |t: &Tensor| -> Result<(Operand, Tensor)> {
        let r = t.rank();
        let tb = &t.shape()[..r - 2];
        let tbn: usize = tb.iter().product();
        let shaped = if tbn == 1 && count > 1 {
            t.clone()
        } else {
            t.broadcast_to(&[batch, &t.shape()[r - 2..]].concat())?
        };
        let mut cand = shaped.clone();
        loop {
            let rr = cand.rank();
            let batch_stride = if rr == 2 || tbn == 1 {
                Some(0)
            } else {
                // The batch dims must collapse to one stride.
                let dims = &cand.shape()[..rr - 2];
                let strides = &cand.strides()[..rr - 2];
                let inner = strides[rr - 3];
                let ok = (0..rr - 3).all(|d| dims[d + 1] == 1 || strides[d] == strides[d + 1] * dims[d + 1]);
                ok.then_some(inner)
            };
            if let (Some(bs), Some((transposed, ld))) = (batch_stride, matrix_layout(&cand)) {
                let op = Operand {
                    ptr: ptr(&cand),
                    transposed,
                    ld,
                    batch_stride: bs,
                };
                return Ok((op, cand));
            }
            cand = contiguous(&shaped)?;
        }
    };
    let (oa, _ka) = operand(a)?;
    let (ob, _kb) = operand(b)?;
    blas::gemm(&s.blas, a.dtype(), (count, m, k, n), oa, ob, ptr(&out))?;
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

/// The per-step scalars of an AdamW step, in f32 (`kernels.cu`'s `AdamScalars`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct AdamScalars {
    /// `1 − lr·λ`.
    pub decay: f32,
    /// `1 − β₁` (the weight of `lerp`).
    pub lerp_weight: f32,
    /// `β₂`.
    pub beta2: f32,
    /// `1 − β₂`.
    pub one_minus_beta2: f32,
    /// `√(1 − β₂ᵗ)`.
    pub bias_correction2_sqrt: f32,
    /// `ε`.
    pub eps: f32,
    /// `−lr / (1 − β₁ᵗ)`.
    pub neg_step_size: f32,
    /// Whether `|1 − β₁| < ½` (1 or 0; PyTorch's `lerp` switches formula there).
    pub lerp_small: i32,
}

// SAFETY: plain old data laid out as the kernel's struct.
unsafe impl DeviceRepr for AdamScalars {}

/// A private copy of `t` when another handle shares its storage (copy on
/// write), so that an in-place kernel changes nothing anyone else sees.
fn make_unique(t: &mut Tensor) -> Result<()> {
    if !t.is_sole_owner() {
        *t = assemble(t.shape(), t.dtype(), t.device(), &[(&vec![0; t.rank()], t)])?;
    }
    Ok(())
}

/// One AdamW step in place on f32 device tensors `p`, `m`, `v` with gradient
/// `g` (each of `p`, `m`, `v` copied first if another handle shares it).
pub(crate) fn adamw_step(
    p: &mut Tensor,
    g: &Tensor,
    m: &mut Tensor,
    v: &mut Tensor,
    scalars: AdamScalars,
) -> Result<()> {
    const OP: &str = "adamw";
    let s = streams_for(OP, &[p, g, m, v])?;
    for t in [&*p, g, &*m, &*v] {
        if t.dtype() != DType::F32 || t.numel() != p.numel() {
            return Err(Error::Device {
                op: OP,
                detail: format!(
                    "the CUDA AdamW step takes f32 tensors of {} elements, got {} {:?}",
                    p.numel(),
                    t.dtype(),
                    t.shape()
                ),
            });
        }
    }
    let g = contiguous(g)?;
    for t in [&mut *p, &mut *m, &mut *v] {
        make_unique(t)?;
    }
    let n = p.numel() as i64;
    let (pp, gp, mp, vp) = (ptr(p), ptr(&g), ptr(m), ptr(v));
    launch!(
        s,
        OP,
        "adamw_f32",
        grid_1d(n as usize),
        &pp,
        &gp,
        &mp,
        &vp,
        &n,
        &scalars
    )
}
