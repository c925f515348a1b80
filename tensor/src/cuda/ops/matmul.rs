//! Matrix products on cuBLAS.

use super::*;

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
