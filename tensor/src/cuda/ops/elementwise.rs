//! Element-wise kernels: dense, repeating (a bias) and strided.

use super::*;

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
            grid_1d(n.div_ceil(4)),
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
