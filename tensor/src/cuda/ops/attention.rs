//! Attention's forward in one kernel on tensor cores (bf16).

use super::*;
use crate::ops::Attention;

/// The most batch dims the fused kernel takes (`kernels.cu`'s `ATT_DIMS`).
const ATT_DIMS: usize = 4;

/// Where the fused kernel finds each batch entry's matrices
/// (`kernels.cu`'s `AttnGeo`): batch sizes, each tensor's batch strides and
/// row stride, the query and key counts, the scale.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct AttnGeo {
    nbatch: i32,
    causal: i32,
    batch: [i64; ATT_DIMS],
    sq: [i64; ATT_DIMS],
    sk: [i64; ATT_DIMS],
    sv: [i64; ATT_DIMS],
    so: [i64; ATT_DIMS],
    rq: i64,
    rk: i64,
    rv: i64,
    ro: i64,
    l: i64,
    s: i64,
    scale: f32,
    _pad: f32,
}

// SAFETY: plain old data laid out as the kernel's struct.
unsafe impl DeviceRepr for AttnGeo {}

/// Whether `t` suits the kernel's 16-byte loads: a dense last dim, and
/// strides and offset in multiples of 8 elements (rows start at 16-byte
/// boundaries; device blocks are aligned wider).
fn rows_aligned(t: &Tensor) -> bool {
    let st = t.strides();
    st[t.rank() - 1] == 1 && st.iter().rev().skip(1).all(|s| s % 8 == 0) && t.storage_offset().is_multiple_of(8)
}

/// The fused attention forward, `(out, probs)` as the chain of ops gives them
/// (the weights contiguous, zeros where masked; the output in `q`'s memory
/// order, so that merging heads back moves nothing), or `None` where the
/// kernel does not apply: it takes bf16 on a GPU of compute capability 8.0
/// or later, head sizes 16, 32, 64 or 128 for queries, keys and values alike,
/// query and key counts that are multiples of 16, rows that start at 16-byte
/// boundaries, and at most four batch dims. Shapes are checked by the caller ([`Attention::check`]).
pub(crate) fn attention(q: &Tensor, k: &Tensor, v: &Tensor, attn: Attention) -> Result<Option<(Tensor, Tensor)>> {
    const OP: &str = "attention";
    let r = q.rank();
    let (l, e, s_len, ev) = (q.shape()[r - 2], q.shape()[r - 1], k.shape()[r - 2], v.shape()[r - 1]);
    let batch = &q.shape()[..r - 2];
    let count: usize = batch.iter().product();
    let applies = q.dtype() == DType::BF16
        && r - 2 <= ATT_DIMS
        && ev == e
        && matches!(e, 16 | 32 | 64 | 128)
        && l % 16 == 0
        && s_len % 16 == 0
        && l > 0
        && s_len > 0
        && count > 0
        && count <= i32::MAX as usize
        && l.div_ceil(64) <= 65535
        && [q, k, v].iter().all(|t| rows_aligned(t));
    if !applies {
        return Ok(None);
    }
    let s = streams_for(OP, &[q, k, v])?;
    if s.gpu.arch.0 < 8 {
        return Ok(None);
    }
    // The output in q's memory order: its dims by q's strides, the last one last.
    let mut order: Vec<usize> = (0..r - 1).collect();
    order.sort_by_key(|&d| std::cmp::Reverse(q.strides()[d]));
    order.push(r - 1);
    let dense: Vec<usize> = order.iter().map(|&d| q.shape()[d]).collect();
    let mut back = vec![0; r];
    for (i, &d) in order.iter().enumerate() {
        back[d] = i;
    }
    let out = empty(&s, &dense, DType::BF16, OP)?.permute(&back)?;
    let probs = empty(&s, &[batch, &[l, s_len]].concat(), DType::BF16, OP)?;
    let mut geo = AttnGeo {
        nbatch: (r - 2) as i32,
        causal: i32::from(attn.is_causal),
        rq: q.strides()[r - 2] as i64,
        rk: k.strides()[r - 2] as i64,
        rv: v.strides()[r - 2] as i64,
        ro: out.strides()[r - 2] as i64,
        l: l as i64,
        s: s_len as i64,
        scale: attn.scale as f32,
        ..Default::default()
    };
    for (d, &n) in batch.iter().enumerate() {
        geo.batch[d] = n as i64;
        geo.sq[d] = q.strides()[d] as i64;
        geo.sk[d] = k.strides()[d] as i64;
        geo.sv[d] = v.strides()[d] as i64;
        geo.so[d] = out.strides()[d] as i64;
    }
    let cfg = LaunchConfig {
        grid_dim: (count as u32, l.div_ceil(64) as u32, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    let (o, p, qp, kp, vp) = (ptr(&out), ptr(&probs), ptr(q), ptr(k), ptr(v));
    launch!(s, OP, format!("attention_bf16_e{e}"), cfg, &o, &p, &qp, &kp, &vp, &geo)?;
    Ok(Some((out, probs)))
}
