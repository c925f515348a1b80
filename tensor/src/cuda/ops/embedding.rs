//! Embedding lookup and its gradient.

use super::*;

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
    let shape = indices.shape().to_vec();
    check_flag(&s, bad, OP, indices, move |i, at| {
        format!("index {i} (element {at} of indices of shape {shape:?}) is out of range for a table of {rows} rows")
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
