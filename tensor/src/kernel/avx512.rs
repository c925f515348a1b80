//! What the kernels written with AVX-512 intrinsics share: the CPU check, and
//! loads and stores of sixteen floats that are plain when the whole vector is
//! in and masked only at a ragged edge. Masked moves of whole vectors ran at
//! about half the speed of plain ones where the lines came from memory (a
//! weight gradient's activation and its output read back per block of the
//! depth, cross entropy's logits), and a masked store is several times slower
//! than a plain one on some CPUs.

use std::arch::x86_64::{
    __m512, __mmask16, _mm512_loadu_ps, _mm512_mask_storeu_ps, _mm512_maskz_loadu_ps, _mm512_storeu_ps,
};

/// Whether this CPU has AVX-512F (detected once).
pub(crate) fn avx512f() -> bool {
    static DETECTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *DETECTED.get_or_init(|| std::arch::is_x86_feature_detected!("avx512f"))
}

/// The lanes of a vector of sixteen elements from element `start` that lie
/// below `len`: all sixteen, the first few at a ragged edge, or none past it.
pub(crate) fn lanes_below(len: usize, start: usize) -> __mmask16 {
    let n = len.saturating_sub(start).min(16);
    ((1u32 << n) - 1) as __mmask16
}

/// The lanes in `mask` of the sixteen floats at `p`, zero elsewhere.
///
/// # Safety
/// AVX-512F; the lanes in `mask` readable.
#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) unsafe fn load(mask: __mmask16, p: *const f32) -> __m512 {
    // SAFETY: the caller's.
    unsafe {
        if mask == !0 {
            _mm512_loadu_ps(p)
        } else {
            _mm512_maskz_loadu_ps(mask, p)
        }
    }
}

/// Stores the lanes in `mask` of `v` to `p`.
///
/// # Safety
/// AVX-512F; the lanes in `mask` writable.
#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) unsafe fn store(p: *mut f32, mask: __mmask16, v: __m512) {
    // SAFETY: the caller's.
    unsafe {
        if mask == !0 {
            _mm512_storeu_ps(p, v)
        } else {
            _mm512_mask_storeu_ps(p, mask, v)
        }
    }
}
