//! Contiguous transposed copies of row-major `f32` matrices.
//!
//! A linear layer multiplies by `Wᵀ`, a transposed view of the row-major
//! weight. The `gemm` crate packs such an operand element by element (its
//! panels want the other layout), which costs a step more than turning `W` over
//! once with 8×8 register transposes and handing it a row-major operand.

use std::mem::MaybeUninit;

/// `dst[j·rows + i] = src[i·ld + j]`: the `rows×cols` matrix at `src` (row
/// stride `ld >= cols`) transposed into the row-major `cols×rows` `dst`.
/// Every element of `dst` is written.
///
/// # Panics
/// When `src` does not hold the matrix or `dst` is not `rows·cols` long.
pub(super) fn transpose(src: &[f32], rows: usize, cols: usize, ld: usize, dst: &mut [MaybeUninit<f32>]) {
    assert!(ld >= cols && dst.len() == rows * cols, "transpose: bad shape");
    assert!(
        rows == 0 || cols == 0 || src.len() >= (rows - 1) * ld + cols,
        "transpose: source too short"
    );
    let (r8, c8) = (rows / 8 * 8, cols / 8 * 8);
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 is present; every 8×8 block read is inside `src` (rows
        // below `r8 <= rows`, columns below `c8 <= cols`, checked above) and
        // every block written inside `dst` (`rows·cols` long).
        unsafe { blocks_avx2(src.as_ptr(), r8, c8, ld, dst.as_mut_ptr().cast(), rows) };
    } else {
        scalar(src, 0..r8, 0..c8, ld, dst, rows);
    }
    #[cfg(not(target_arch = "x86_64"))]
    scalar(src, 0..r8, 0..c8, ld, dst, rows);
    // The ragged right columns and bottom rows.
    scalar(src, 0..rows, c8..cols, ld, dst, rows);
    scalar(src, r8..rows, 0..c8, ld, dst, rows);
}

fn scalar(
    src: &[f32],
    rows: std::ops::Range<usize>,
    cols: std::ops::Range<usize>,
    ld: usize,
    dst: &mut [MaybeUninit<f32>],
    n: usize,
) {
    for i in rows {
        for j in cols.clone() {
            dst[j * n + i] = MaybeUninit::new(src[i * ld + j]);
        }
    }
}

/// The 8×8 blocks of the top-left `r8×c8` part (multiples of 8).
///
/// # Safety
/// AVX2 must be present; `src` readable for `r8` rows of stride `ld` and `c8`
/// columns, `dst` writable for `c8` rows of stride `n` and `r8` columns.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn blocks_avx2(src: *const f32, r8: usize, c8: usize, ld: usize, dst: *mut f32, n: usize) {
    // Rows of the source turned per pass along its columns: sixteen write whole
    // 64-byte lines of the destination (the halves of a line written in two
    // passes may have left the cache in between), 2-3 times as fast on tall
    // sources such as a linear layer's `[4096, 256]` weight; but sixteen rows
    // of 2 KiB or more apart fall in the same few cache sets and evict each
    // other before their next eight columns are read, so wide sources keep eight.
    let rows = if ld <= WIDE_ROW { 16 } else { 8 };
    let r = r8 / rows * rows;
    for i in (0..r).step_by(rows) {
        for j in (0..c8).step_by(8) {
            for h in (0..rows).step_by(8) {
                // SAFETY: rows i+h..i+h+8 (below `r8`), columns j..j+8 of the
                // source and rows j..j+8, columns i+h..i+h+8 of the destination
                // are inside what the caller grants.
                unsafe {
                    turn8(
                        src.add((i + h) * ld + j).cast(),
                        (ld * 4) as isize,
                        dst.add(j * n + i + h).cast(),
                        n,
                    )
                };
            }
        }
    }
    // The last eight rows when sixteen do not divide `r8`.
    for i in (r..r8).step_by(8) {
        for j in (0..c8).step_by(8) {
            // SAFETY: as above, for rows i..i+8 < r8.
            unsafe {
                turn8(
                    src.add(i * ld + j).cast(),
                    (ld * 4) as isize,
                    dst.add(j * n + i).cast(),
                    n,
                )
            };
        }
    }
}

/// The widest source row (elements) that [`blocks_avx2`] turns sixteen rows
/// at a time.
#[cfg(target_arch = "x86_64")]
const WIDE_ROW: usize = 512;

/// An 8 × 8 block of 32-bit values turned: row `t` of the block starts at
/// byte `t · step` from `src` (unaligned), and its element `u` goes to
/// `dst[u · ld + t]`. Shuffles move the bits without reading them as floats.
///
/// # Safety
/// `src` readable for 8 rows of 32 bytes at that step; `dst` writable for 8
/// rows of 8 elements at stride `ld`.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
pub(super) unsafe fn turn8(src: *const u8, step: isize, dst: *mut u32, ld: usize) {
    use std::arch::x86_64::*;
    // SAFETY: the 8 rows of 32 bytes are readable (caller).
    let r: [__m256; 8] = std::array::from_fn(|t| unsafe { _mm256_loadu_ps(src.offset(t as isize * step).cast()) });
    let t0 = _mm256_unpacklo_ps(r[0], r[1]);
    let t1 = _mm256_unpackhi_ps(r[0], r[1]);
    let t2 = _mm256_unpacklo_ps(r[2], r[3]);
    let t3 = _mm256_unpackhi_ps(r[2], r[3]);
    let t4 = _mm256_unpacklo_ps(r[4], r[5]);
    let t5 = _mm256_unpackhi_ps(r[4], r[5]);
    let t6 = _mm256_unpacklo_ps(r[6], r[7]);
    let t7 = _mm256_unpackhi_ps(r[6], r[7]);
    let s0 = _mm256_shuffle_ps::<0x44>(t0, t2);
    let s1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
    let s2 = _mm256_shuffle_ps::<0x44>(t1, t3);
    let s3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
    let s4 = _mm256_shuffle_ps::<0x44>(t4, t6);
    let s5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
    let s6 = _mm256_shuffle_ps::<0x44>(t5, t7);
    let s7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
    let rows = [
        _mm256_permute2f128_ps::<0x20>(s0, s4),
        _mm256_permute2f128_ps::<0x20>(s1, s5),
        _mm256_permute2f128_ps::<0x20>(s2, s6),
        _mm256_permute2f128_ps::<0x20>(s3, s7),
        _mm256_permute2f128_ps::<0x31>(s0, s4),
        _mm256_permute2f128_ps::<0x31>(s1, s5),
        _mm256_permute2f128_ps::<0x31>(s2, s6),
        _mm256_permute2f128_ps::<0x31>(s3, s7),
    ];
    for (u, v) in rows.into_iter().enumerate() {
        // SAFETY: row u of the destination block is writable (caller).
        unsafe { _mm256_storeu_ps(dst.add(u * ld).cast(), v) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transposes_every_shape_exactly() {
        for (rows, cols, ld) in [
            (0, 3, 3),
            (3, 0, 0),
            (1, 1, 1),
            (8, 8, 8),
            (16, 24, 30),
            (13, 21, 21),
            // Sixteen-row passes with an eight-row rest, and wide rows (eight-row passes).
            (40, 20, 20),
            (33, 17, 600),
            (24, 520, 520),
            (7, 9, 12),
        ] {
            let src: Vec<f32> = (0..rows * ld).map(|x| x as f32).collect();
            let mut dst = vec![MaybeUninit::new(f32::NAN); rows * cols];
            transpose(&src, rows, cols, ld, &mut dst);
            for i in 0..rows {
                for j in 0..cols {
                    // SAFETY: every element was initialised (NaN) before.
                    let got = unsafe { dst[j * rows + i].assume_init() };
                    assert_eq!(got, src[i * ld + j], "{rows}x{cols} (ld {ld}) at {i},{j}");
                }
            }
        }
    }
}
