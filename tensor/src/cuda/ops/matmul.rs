//! Matrix products on cuBLAS.

use super::*;
use crate::cuda::blas::Batch;
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
    if part == Causal::Dense && count > 1 && folded_product(&s, a, b, &out, count, (m, k, n))? {
        return Ok(out);
    }
    let (sa, sb) = (over_batch(a, batch, count)?, over_batch(b, batch, count)?);
    let dtype = a.dtype();
    let elem = dtype.size_in_bytes();
    let pointers = reads_in_place(&sa, &sb, batch, count);
    // The copies strided operands read are kept alive until the products are queued.
    let (oa, _keep_a) = batch_operand(&sa, pointers)?;
    let (ob, _keep_b) = batch_operand(&sb, pointers)?;
    let oc = Operand {
        ptr: ptr(&out),
        transposed: false,
        ld: n,
        batch_stride: m * n,
    };
    let block = causal_block_rows(m);
    let calls = block_calls(part, (m, k, n), block, [oa, ob, oc], elem);
    if part == Causal::Scores && zero_masked && calls.len() > 1 {
        // The blocks right of each block's diagonal tile are not computed.
        s.gpu.bind()?;
        // SAFETY: the block holds the output's bytes; zeroed on the rank's stream.
        unsafe { cudarc::driver::result::memset_d8_async(ptr(&out), 0, out.size_in_bytes(), s.compute.cu_stream()) }
            .map_err(|e| cuda_error(OP, e))?;
    }
    // Read in place: the addresses of every call's matrices, from one kernel.
    let arrays = if pointers {
        let bases: Vec<[u64; 3]> = calls.iter().map(|(_, a, b, c)| [a.ptr, b.ptr, c.ptr]).collect();
        Some(batch_pointers(&s, batch, [&sa, &sb, &out], &bases)?)
    } else {
        None
    };
    queue_calls(&s, dtype, count, &calls, arrays.as_ref())?;
    if part == Causal::Scores && zero_masked {
        // The diagonal tiles (one as wide as the matrix for a single call).
        let tile = if calls.len() > 1 { block } else { m.max(n) };
        zero_above_diagonal(&s, &out, count, m, n, tile)?;
    }
    Ok(out)
}

/// Queues `a · b` into `out` as one `[count·m, k] · [k, n]` product when it folds so; says whether it did.
fn folded_product(
    s: &RankStreams,
    a: &Tensor,
    b: &Tensor,
    out: &Tensor,
    count: usize,
    (m, k, n): (usize, usize, usize),
) -> Result<bool> {
    // A product of a stack of matrices by one shared matrix, `[batch.., m, k]
    // · [k, n]`, whose left rows run on through its batch dims is one product
    // of `count·m` rows (PyTorch folds it the same way): cuBLAS tiles one tall
    // product far better than `count` short ones (a third faster for
    // `8 × [512, 1024] · [1024, 1024]` in f32 on an H200).
    let (Some(oa), Some(ob)) = (folded_rows(a, count), shared_matrix(b)) else {
        return Ok(false);
    };
    let oc = Operand {
        ptr: ptr(out),
        transposed: false,
        ld: n,
        batch_stride: 0,
    };
    blas::gemm(&s.blas, a.dtype(), (1, count * m, k, n), oa, ob, oc, Batch::Strided)?;
    Ok(true)
}

/// Operand `t` as `batch` matrices: broadcast to the batch (one matrix shared by every product kept as it is).
fn over_batch(t: &Tensor, batch: &[usize], count: usize) -> Result<Tensor> {
    let r = t.rank();
    if t.shape()[..r - 2].iter().product::<usize>() == 1 && count > 1 {
        Ok(t.clone())
    } else {
        t.broadcast_to(&[batch, &t.shape()[r - 2..]].concat())
    }
}

/// Whether `sa` and `sb` are read in place, through arrays of their matrices' addresses.
fn reads_in_place(sa: &Tensor, sb: &Tensor, batch: &[usize], count: usize) -> bool {
    // Operands whose batch dims do not run on with one stride (heads read
    // from `[b, t, h, e]`) but whose matrices have dense rows or columns are
    // read in place, through arrays of the matrices' addresses; others are
    // strided batches, copied first when their matrices are not dense.
    count > 1
        && batch.len() <= MAX_DIMS
        && (batch_stride(sa).is_none() || batch_stride(sb).is_none())
        && matrix_layout(sa).is_some()
        && matrix_layout(sb).is_some()
}

/// `t` as a cuBLAS operand, read in place when `pointers`, with the copy a strided one reads.
fn batch_operand(t: &Tensor, pointers: bool) -> Result<(Operand, Option<Tensor>)> {
    Ok(if pointers {
        // INVARIANT: `pointers` only when `reads_in_place` found a matrix layout.
        let (transposed, ld) = matrix_layout(t).expect("a dense matrix layout");
        let op = Operand {
            ptr: ptr(t),
            transposed,
            ld,
            batch_stride: 0,
        };
        (op, None)
    } else {
        let (op, copy) = strided_operand(t)?;
        (op, Some(copy))
    })
}

/// One cuBLAS call of a product: its `(m, k, n)` and its operands a, b, c.
type Call = ((usize, usize, usize), Operand, Operand, Operand);

/// The products: the whole batch, or a causal part's blocks of `block` rows.
fn block_calls(
    part: Causal,
    (m, k, n): (usize, usize, usize),
    block: usize,
    [oa, ob, oc]: [Operand; 3],
    elem: usize,
) -> Vec<Call> {
    if part == Causal::Dense || block >= m {
        vec![((m, k, n), oa, ob, oc)]
    } else {
        (0..m)
            .step_by(block)
            .map(|r0| {
                let r1 = (r0 + block).min(m);
                let (a0, c0) = (oa.at(r0, 0, elem), oc.at(r0, 0, elem));
                match part {
                    // Queries [r0, r1) see keys [0, r1).
                    Causal::Scores => ((r1 - r0, k, r1.min(n)), a0, ob, c0),
                    // Weights of queries [r0, r1) are zero past key r1.
                    Causal::Weights => ((r1 - r0, r1.min(k), n), a0, ob, c0),
                    // Keys [r0, r1) are seen by queries [r0, k).
                    Causal::WeightsTransposed => {
                        let i0 = r0.min(k);
                        ((r1 - r0, k - i0, n), oa.at(r0, i0, elem), ob.at(i0, 0, elem), c0)
                    }
                    // INVARIANT: a dense product is one call (above).
                    Causal::Dense => unreachable!("a dense product is one call"),
                }
            })
            .collect()
    }
}

/// Queues `calls` (`count` products each), strided or at the addresses in `arrays` when given.
fn queue_calls(s: &RankStreams, dtype: DType, count: usize, calls: &[Call], arrays: Option<&Tensor>) -> Result<()> {
    for (i, &((m, k, n), a, b, c)) in calls.iter().enumerate() {
        let batched = match arrays {
            Some(t) => {
                let step = (count * 8) as u64;
                let p = ptr(t) + 3 * i as u64 * step;
                Batch::Pointers([p, p + step, p + 2 * step])
            }
            None => Batch::Strided,
        };
        blas::gemm(&s.blas, dtype, (count, m, k, n), a, b, c, batched)?;
    }
    Ok(())
}

/// The one stride between the matrices of `t` (`[batch.., r, c]`, or one
/// matrix shared by the batch: stride 0), or `None` when its batch dims do
/// not run on with one stride.
fn batch_stride(t: &Tensor) -> Option<usize> {
    let r = t.rank();
    if r == 2 || t.shape()[..r - 2].iter().product::<usize>() == 1 {
        return Some(0);
    }
    let dims = &t.shape()[..r - 2];
    let strides = &t.strides()[..r - 2];
    let ok = (0..r - 3).all(|d| dims[d + 1] == 1 || strides[d] == strides[d + 1] * dims[d + 1]);
    ok.then_some(strides[r - 3])
}

/// `t` as a strided batch operand, and the copy it reads when `t`'s own
/// layout cannot be read in place (kept alive by the caller until the
/// product is queued).
fn strided_operand(t: &Tensor) -> Result<(Operand, Tensor)> {
    let mut cand = t.clone();
    loop {
        if let (Some(bs), Some((transposed, ld))) = (batch_stride(&cand), matrix_layout(&cand)) {
            let op = Operand {
                ptr: ptr(&cand),
                transposed,
                ld,
                batch_stride: bs,
            };
            return Ok((op, cand));
        }
        // Copied in the order its elements lie: a transposed view (columns
        // closer than rows) as its transpose, whose rows the copy moves in
        // words, then read transposed.
        let (r, st) = (t.rank(), t.strides());
        cand = if st[r - 1] > st[r - 2] {
            contiguous(&t.transpose(r - 2, r - 1)?)?.transpose(r - 2, r - 1)?
        } else {
            contiguous(t)?
        };
    }
}

/// The most products one `batch_pointers` launch addresses (`kernels.cu`'s
/// `MAX_CALLS`): a causal part has at most 8 blocks.
const MAX_CALLS: usize = 8;

/// The `PtrGeo` of `kernels.cu`'s `batch_pointers`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct PtrGeo {
    rank: i32,
    calls: i32,
    count: i64,
    shape: [i64; MAX_DIMS],
    strides: [[i64; MAX_DIMS]; 3],
    base: [[u64; 3]; MAX_CALLS],
}

// SAFETY: plain old data laid out as the kernel's struct.
unsafe impl DeviceRepr for PtrGeo {}

/// A device array of the matrices' addresses of each product in `bases`
/// (a's, b's and c's first matrices): for product `i`, `count` addresses of
/// each operand in turn from `3·i·count`, over the `batch` dims at the
/// strides of `ops`' leading dims (0 for a matrix every product shares).
fn batch_pointers(s: &RankStreams, batch: &[usize], ops: [&Tensor; 3], bases: &[[u64; 3]]) -> Result<Tensor> {
    let count: usize = batch.iter().product();
    debug_assert!(bases.len() <= MAX_CALLS);
    let mut g = PtrGeo {
        rank: batch.len() as i32,
        calls: bases.len() as i32,
        count: count as i64,
        ..Default::default()
    };
    for (d, &n) in batch.iter().enumerate() {
        g.shape[d] = n as i64;
    }
    for (o, t) in ops.iter().enumerate() {
        let r = t.rank();
        let elem = t.dtype().size_in_bytes() as i64;
        if t.shape()[..r - 2].iter().product::<usize>() == 1 {
            continue;
        }
        for d in 0..batch.len() {
            g.strides[o][d] = t.strides()[d] as i64 * elem;
        }
    }
    g.base[..bases.len()].copy_from_slice(bases);
    let arrays = empty(s, &[3 * count * bases.len()], DType::I64, "matmul")?;
    let out = ptr(&arrays);
    launch!(s, "matmul", "batch_pointers", grid_1d(count * bases.len()), &out, &g)?;
    Ok(arrays)
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
