//! Matrix products on cuBLAS.

use super::*;
use crate::ops::Causal;

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

/// `t` (`[batch.., m, k]`, `count` matrices, not broadcast) as one row-major
/// `[count·m, k]` matrix, when its rows are evenly spaced through the batch
/// dims; `None` otherwise.
fn folded_rows(t: &Tensor, count: usize) -> Option<Operand> {
    let r = t.rank();
    let (shape, strides) = (t.shape(), t.strides());
    let (m, k) = (shape[r - 2], shape[r - 1]);
    let ld = strides[r - 2];
    let dense_rows = strides[r - 1] == 1 || k == 1;
    if r < 3 || shape[..r - 2].iter().product::<usize>() != count || !dense_rows || ld < k.max(1) {
        return None;
    }
    if i32::try_from(count * m).is_err() {
        return None;
    }
    let mut next = ld * m;
    for d in (0..r - 2).rev() {
        if shape[d] != 1 && strides[d] != next {
            return None;
        }
        next *= shape[d];
    }
    Some(Operand {
        ptr: ptr(t),
        transposed: false,
        ld,
        batch_stride: 0,
    })
}

/// `t` as the one matrix every product of a batch shares: a matrix, or a
/// stack of one, whose rows or columns are dense; `None` otherwise.
fn shared_matrix(t: &Tensor) -> Option<Operand> {
    let r = t.rank();
    if t.shape()[..r - 2].iter().product::<usize>() != 1 {
        return None;
    }
    let (transposed, ld) = matrix_layout(t)?;
    Some(Operand {
        ptr: ptr(t),
        transposed,
        ld,
        batch_stride: 0,
    })
}

/// Rows per block of a causal part's products: a product of `m` rows in
/// blocks of 128 or more (at most 8 blocks), so that each cuBLAS call stays
/// large; `m` itself (one dense product) below 256 rows.
fn causal_block_rows(m: usize) -> usize {
    if m < 256 {
        m
    } else {
        m.div_ceil(m.div_ceil(128).min(8)).next_multiple_of(64)
    }
}

/// `a · b` for `a` `[batch.., m, k]` and `b` `[batch.., k, n]` whose batch
/// dims are already broadcast to `batch` (shapes checked by the caller), or
/// the causal `part` of it (see [`Causal`]): in blocks of rows, each block's
/// product skips the columns (or inner dims) that the mask leaves out, about
/// half of the flops of a long sequence. Scores are zero above the diagonal,
/// as on the host.
pub(crate) fn matmul(a: &Tensor, b: &Tensor, batch: &[usize], part: Causal) -> Result<Tensor> {
    product(a, b, batch, part, true)
}

/// The causal `Scores` part of `a · b` as [`matmul`] computes it, but with
/// the masked elements (`[i, j]`, `j > i`) left as they were in memory: for
/// a reader that reads only the kept ones (attention's softmax kernels with
/// their causal period), which saves zeroing half of the scores.
pub(crate) fn causal_scores_unmasked(a: &Tensor, b: &Tensor, batch: &[usize]) -> Result<Tensor> {
    product(a, b, batch, Causal::Scores, false)
}

/// [`matmul`], zeroing a `Scores` part's masked elements when `zero_masked`.
fn product(a: &Tensor, b: &Tensor, batch: &[usize], part: Causal, zero_masked: bool) -> Result<Tensor> {
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
    // A product of a stack of matrices by one shared matrix, `[batch.., m, k]
    // · [k, n]`, whose left rows run on through its batch dims is one product
    // of `count·m` rows (PyTorch folds it the same way): cuBLAS tiles one tall
    // product far better than `count` short ones (a third faster for
    // `8 × [512, 1024] · [1024, 1024]` in f32 on an H200).
    if part == Causal::Dense
        && count > 1
        && let (Some(oa), Some(ob)) = (folded_rows(a, count), shared_matrix(b))
    {
        let oc = Operand {
            ptr: ptr(&out),
            transposed: false,
            ld: n,
            batch_stride: 0,
        };
        blas::gemm(&s.blas, a.dtype(), (1, count * m, k, n), oa, ob, oc)?;
        return Ok(out);
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
            // Copied in the order its elements lie: a transposed view (columns
            // closer than rows, as kᵀ of heads read from `[b, t, h, e]`) as its
            // transpose, whose rows the copy moves in words, then read transposed.
            let (r, st) = (shaped.rank(), shaped.strides());
            cand = if st[r - 1] > st[r - 2] {
                contiguous(&shaped.transpose(r - 2, r - 1)?)?.transpose(r - 2, r - 1)?
            } else {
                contiguous(&shaped)?
            };
        }
    };
    let (oa, _ka) = operand(a)?;
    let (ob, _kb) = operand(b)?;
    let oc = Operand {
        ptr: ptr(&out),
        transposed: false,
        ld: n,
        batch_stride: m * n,
    };
    let dtype = a.dtype();
    let block = causal_block_rows(m);
    if part == Causal::Dense || block >= m {
        blas::gemm(&s.blas, dtype, (count, m, k, n), oa, ob, oc)?;
        if part == Causal::Scores && zero_masked {
            // One tile as wide as the matrix: every key past its query.
            zero_above_diagonal(&s, &out, count, m, n, m.max(n))?;
        }
        return Ok(out);
    }
    let elem = dtype.size_in_bytes();
    if part == Causal::Scores && zero_masked {
        // The blocks right of each block's diagonal tile are not computed.
        s.gpu.bind()?;
        // SAFETY: the block holds the output's bytes; zeroed on the rank's stream.
        unsafe { cudarc::driver::result::memset_d8_async(ptr(&out), 0, out.size_in_bytes(), s.compute.cu_stream()) }
            .map_err(|e| cuda_error(OP, e))?;
    }
    for r0 in (0..m).step_by(block) {
        let r1 = (r0 + block).min(m);
        let (a0, c0) = (oa.at(r0, 0, elem), oc.at(r0, 0, elem));
        match part {
            // Queries [r0, r1) see keys [0, r1).
            Causal::Scores => blas::gemm(&s.blas, dtype, (count, r1 - r0, k, r1.min(n)), a0, ob, c0)?,
            // Weights of queries [r0, r1) are zero past key r1.
            Causal::Weights => blas::gemm(&s.blas, dtype, (count, r1 - r0, r1.min(k), n), a0, ob, c0)?,
            // Keys [r0, r1) are seen by queries [r0, k).
            Causal::WeightsTransposed => {
                let i0 = r0.min(k);
                let (a0, b0) = (oa.at(r0, i0, elem), ob.at(i0, 0, elem));
                blas::gemm(&s.blas, dtype, (count, r1 - r0, k - i0, n), a0, b0, c0)?
            }
            Causal::Dense => unreachable!("dense products returned above"),
        }
    }
    if part == Causal::Scores && zero_masked {
        zero_above_diagonal(&s, &out, count, m, n, block)?;
    }
    Ok(out)
}

/// Zeroes the elements `[i, j]`, `j > i`, of the diagonal tiles (`block`
/// rows and columns each) of `count` row-major `[m, n]` matrices: what the
/// block products of a causal `Scores` part computed past the diagonal.
fn zero_above_diagonal(s: &RankStreams, out: &Tensor, count: usize, m: usize, n: usize, block: usize) -> Result<()> {
    const OP: &str = "matmul_causal";
    let (o, c, mm, nn, b) = (ptr(out), count as i64, m as i64, n as i64, block as i64);
    let name = format!("causal_zero_w{}", out.dtype().size_in_bytes());
    launch!(s, OP, name, grid_1d(count * m * block.min(n)), &o, &c, &mm, &nn, &b)
}
