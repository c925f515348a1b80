//! Softmax rows of `f32` in explicit AVX-512 code, for attention's weights:
//! a row's exponentials and their `f64` sum in one pass, which the compiler
//! does not vectorise written as a loop (the generic rows take five passes:
//! scale, maximum, exponentials, sum, weights). Bit for bit the generic rows.

use std::arch::x86_64::*;

use crate::kernel::avx512::{load, store};

/// Whether an `f32` row of `len` keys runs [`rows`]: AVX-512F, and whole
/// groups of eight keys (the sum's lanes then need no tail).
pub(super) fn fits(len: usize) -> bool {
    len.is_multiple_of(8) && crate::kernel::avx512::avx512f()
}

/// The softmax of `scale ·` each of `R` consecutive `f32` rows over its first
/// `keep[r]` keys (row `r` at `src + r·s`, its weights at `dst + r·s`, exact
/// zeros past the kept keys, `0 · (1/sum)` precisely): the same bits as
/// [`probs_row_generic`](super::probs_row_generic), in three passes over
/// each row instead of five: the largest scaled score, then each exponential written out and added to the
/// same eight `f64` lanes in the same order, then the weights scaled in
/// place. Sixteen keys at a time, the last group of a row under a mask of
/// its kept keys (zero past them, as the generic sum sees them).
///
/// # Safety
/// AVX-512F; `s` a multiple of 8, `keep[r] <= s`; `R` rows of `s` floats
/// readable at `src` and writable at `dst`.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn rows<const R: usize>(keep: [usize; R], scale: f32, src: *const f32, dst: *mut f32, s: usize) {
    // The kept lanes of the group from key i (as `avx512::lanes_below`, which,
    // inlined here, let the optimiser fold a row without kept keys to `0 · ∞`
    // of the other NaN sign than the generic row's: Rust leaves that sign
    // unspecified, and the tests compare bits).
    let mask = |r: usize, i: usize| -> __mmask16 {
        match keep[r].saturating_sub(i) {
            k if k >= 16 => !0,
            k => (1u16 << k) - 1,
        }
    };
    let longest = keep.iter().copied().max().unwrap_or(0);
    let sc = _mm512_set1_ps(scale);
    // Every access below is to keys i..i + 16 of row r under a mask of those
    // below its `keep` (masked-off lanes are neither read nor written).
    let scaled = |r: usize, i: usize, m: __mmask16| {
        // SAFETY: the kept keys of row r are inside its `s` keys at `src` (the caller).
        _mm512_mul_ps(unsafe { load(m, src.add(r * s + i)) }, sc)
    };
    let mut max = [_mm512_set1_ps(f32::NEG_INFINITY); R];
    let mut nan = [0; R];
    for i in (0..longest).step_by(16) {
        for r in 0..R {
            let (m, x) = (mask(r, i), scaled(r, i, mask(r, i)));
            nan[r] |= _mm512_mask_cmp_ps_mask::<_CMP_UNORD_Q>(m, x, x);
            max[r] = _mm512_mask_max_ps(max[r], m, max[r], x);
        }
    }
    // Which of two equal zeros is the largest does not change `x − max`'s
    // exponential, so the order of the maximum does not matter.
    let max: [__m512; R] = std::array::from_fn(|r| {
        _mm512_set1_ps(if nan[r] != 0 {
            f32::NAN
        } else {
            _mm512_reduce_max_ps(max[r])
        })
    });
    let high = |v: __m512| _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
    let mut acc = [_mm512_setzero_pd(); R];
    for i in (0..longest).step_by(16) {
        for r in 0..R {
            let m = mask(r, i);
            // SAFETY: AVX-512F (the caller).
            let e = unsafe { crate::kernel::exp_f32x16(_mm512_sub_ps(scaled(r, i, m), max[r])) };
            let e = _mm512_maskz_mov_ps(m, e);
            // SAFETY: row r's kept keys at `dst` are writable (the caller).
            unsafe { store(dst.add(r * s + i), m, e) };
            acc[r] = _mm512_add_pd(acc[r], _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
            acc[r] = _mm512_add_pd(acc[r], _mm512_cvtps_pd(high(e)));
        }
    }
    let inv: [f64; R] = std::array::from_fn(|r| {
        let mut a = [0f64; 8];
        // SAFETY: eight lanes stored to an array of eight.
        unsafe { _mm512_storeu_pd(a.as_mut_ptr(), acc[r]) };
        1.0 / (((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7])))
    });
    for i in (0..longest).step_by(16) {
        for r in 0..R {
            let (m, inv) = (mask(r, i), _mm512_set1_pd(inv[r]));
            // SAFETY: key i of row r is inside the rows at `dst` (i < keep[r] <= s).
            let p = unsafe { dst.add(r * s + i) };
            // SAFETY: row r's kept keys at `dst`, written in the pass above.
            let e = unsafe { load(m, p) };
            let lo = _mm512_cvtpd_ps(_mm512_mul_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(e)), inv));
            let hi = _mm512_cvtpd_ps(_mm512_mul_pd(_mm512_cvtps_pd(high(e)), inv));
            let both = _mm512_insertf64x4::<1>(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi));
            // SAFETY: as the load above.
            unsafe { store(p, m, _mm512_castpd_ps(both)) };
        }
    }
    for r in 0..R {
        // A masked key's weight, `0 · inv` as for the full row (NaN when `inv` is).
        // SAFETY: keys keep[r]..s of row r, inside the rows at `dst` (the caller).
        let tail = unsafe { std::slice::from_raw_parts_mut(dst.add(r * s + keep[r]), s - keep[r]) };
        tail.fill((0.0 * inv[r]) as f32);
    }
}
