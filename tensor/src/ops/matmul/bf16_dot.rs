//! `bf16` products on the CPU's bf16 dot-product instruction (`VDPBF16PS`,
//! AVX512_BF16): each instruction multiplies 16 pairs of adjacent `bf16`
//! elements of one operand by 16 pairs of the other and adds both products to
//! 16 `f32` sums, twice the multiply-adds per instruction of the `f32` GEMM.
//!
//! Both operands are packed into pairs along `k` (one `u32` per pair): the
//! left one in panels of [`MR`] rows (`[panel][pair][row]`), the right one in
//! panels of [`NR`] columns (`[panel][pair][column]`), zero-padded at the
//! edges (a zero pair adds nothing). A tile of `MR × NR` outputs keeps its sums
//! in 24 vector registers for the whole of `k`, one pair after the other, then
//! rounds each sum to `bf16` once. So an output element's sum runs over `k` in
//! the same order whatever the product's size, split or tile position.
//!
//! The instruction differs from the widened `f32` GEMM in two ways: it adds the
//! two products of a pair to the running sum one after the other (the sums are
//! in another order than the `f32` kernel's, so results differ in the last
//! bits, as between any two GEMMs), and it treats `bf16` subnormal inputs
//! (magnitudes below 2⁻¹²⁶) as zero and flushes subnormal sums to zero.

use std::arch::x86_64::{
    __m256i, __m512, __m512bh, _mm256_mask_storeu_epi16, _mm256_storeu_si256, _mm512_add_epi32, _mm512_and_si512,
    _mm512_castps_si512, _mm512_cmpgt_epu32_mask, _mm512_cvtepi32_epi16, _mm512_dpbf16_ps, _mm512_loadu_si512,
    _mm512_mask_blend_epi32, _mm512_or_si512, _mm512_set1_epi32, _mm512_setzero_ps, _mm512_srli_epi32,
};

use half::bf16;

use super::transpose::turn8;
use super::{Causal, Mat};

/// Rows of a tile (a left-operand panel).
pub(super) const MR: usize = 12;

/// Columns of a tile (a right-operand panel): two vectors of 16 `f32` sums.
pub(super) const NR: usize = 32;

/// Bytes of the packed left operand worked on at once (rows of it, all of
/// `k`): it stays in the core's L2 cache while every right-operand panel
/// passes over it.
const A_BLOCK_BYTES: usize = 192 << 10;

/// Scratch bytes a thread keeps between products; more is freed after the
/// product that needed it.
pub(super) const SCRATCH_KEEP: usize = 32 << 20;

thread_local! {
    /// This thread's packed operands: the left block and the whole right one.
    pub(super) static SCRATCH: std::cell::RefCell<[Vec<u32>; 2]> = const {
        std::cell::RefCell::new([Vec::new(), Vec::new()])
    };
}

/// Whether this CPU has the instructions (AVX-512F and AVX512_BF16), detected
/// once.
pub(super) fn detected() -> bool {
    static DETECTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *DETECTED.get_or_init(|| {
        std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("avx512bf16")
    })
}

/// `c = a · b` for `bf16` operands on the dot-product instruction, each output
/// element its `f32` sum rounded to `bf16` once.
///
/// # Safety
/// As [`Gemm::gemm`](super::Gemm::gemm), and [`detected`] must be true.
pub(super) unsafe fn gemm(mkn: [usize; 3], a: Mat<bf16>, b: Mat<bf16>, c: *mut bf16, rsc: isize) {
    // SAFETY: the caller's guarantees.
    unsafe { gemm_part(mkn, a, b, c, rsc, Causal::Dense) }
}

/// [`gemm`], or its causal `part` (the product as a whole, not a block of a
/// split one: row `i` and column `j` of `c` are the query and key positions):
/// [`Causal::Scores`] skips the tiles wholly above the diagonal (left
/// unwritten: the caller zeroes them); [`Causal::Weights`] sums each tile
/// only up to its last row's position along `k` (the left operand is zero
/// past it), and [`Causal::WeightsTransposed`] only from its first row's (zero
/// before), to within a pair: about half the work of the dense product, and
/// its sums (the pairs skipped add zero products).
///
/// # Safety
/// As [`gemm`]; for the weights' parts the left operand may hold anything
/// where the part says it is zero, at most one tile height away from the
/// diagonal along `k` (further elements are not read).
pub(super) unsafe fn gemm_part(
    [m, k, n]: [usize; 3],
    a: Mat<bf16>,
    b: Mat<bf16>,
    c: *mut bf16,
    rsc: isize,
    part: Causal,
) {
    let (a, b, c) = (a.cast::<u16>(), b.cast::<u16>(), c.cast::<u16>());
    SCRATCH.with(|scratch| {
        let mut scratch = scratch.borrow_mut();
        let [sa, sb] = &mut *scratch;
        let pairs = k.div_ceil(2);
        // A row-major `a` of even `k` is read in place: each row's pairs are
        // consecutive `u32`s already. Otherwise it is packed a block at a time.
        let direct = a.cs == 1 && k % 2 == 0;
        // Rows of `a` per block: whole panels, at least one.
        let block = ((A_BLOCK_BYTES / (pairs * 4 * MR)).max(1) * MR).min(m.next_multiple_of(MR));
        // SAFETY: (for the whole block) `a` and `b` are readable wherever their
        // strides reach for m×k and k×n (caller), which is all that the packing
        // reads; the packed panels hold `pairs` pairs of MR rows or NR columns
        // each, as `tile` reads them; `c` is writable for m rows of stride
        // `rsc` and n columns (caller), and `store` writes only inside them;
        // the instructions are present (caller).
        unsafe {
            // The right operand's lines are its columns: pack its transposed view.
            let columns = Mat {
                ptr: b.ptr,
                rs: b.cs,
                cs: b.rs,
            };
            pack::<NR>(columns, 0, n, k, sb);
            for r0 in (0..m).step_by(block) {
                let rows = block.min(m - r0);
                if !direct {
                    pack::<MR>(a, r0, rows, k, sa);
                }
                for jp in 0..n.div_ceil(NR) {
                    let cols = NR.min(n - jp * NR);
                    let panel_b = sb.as_ptr().add(jp * pairs * NR);
                    for ip in 0..rows.div_ceil(MR) {
                        let (row, tile_rows) = (r0 + ip * MR, MR.min(rows - ip * MR));
                        let Some(span) = pair_span(part, row, tile_rows, jp * NR, k) else {
                            continue;
                        };
                        let first = c.wrapping_offset(row as isize * rsc + (jp * NR) as isize);
                        let out = Out {
                            ptr: first,
                            rs: rsc,
                            rows: tile_rows,
                            cols,
                        };
                        if direct {
                            let left = a.ptr.wrapping_offset(row as isize * a.rs);
                            tile::<true>(span, left, a.rs, panel_b, out);
                        } else {
                            let left = sa.as_ptr().add(ip * pairs * MR).cast::<u16>();
                            tile::<false>(span, left, 0, panel_b, out);
                        }
                    }
                }
            }
        }
        for v in [sa, sb] {
            if v.capacity() * 4 > SCRATCH_KEEP {
                *v = Vec::new();
            }
        }
    });
}

/// The pairs along `k` that the tile of `rows` rows from `row`, columns from
/// `col`, sums for the causal `part`: all of them for a dense product and the
/// scores, except that a scores tile wholly above the diagonal sums nothing
/// (`None`: it is not computed); up to the pair holding the last row's
/// position for weights, from the pair holding the first row's for
/// transposed weights.
fn pair_span(part: Causal, row: usize, rows: usize, col: usize, k: usize) -> Option<std::ops::Range<usize>> {
    let pairs = k.div_ceil(2);
    let last = row + rows - 1;
    match part {
        Causal::Dense => Some(0..pairs),
        Causal::Scores => (col <= last).then_some(0..pairs),
        Causal::Weights => Some(0..k.min(last + 1).div_ceil(2)),
        Causal::WeightsTransposed => Some((row / 2).min(pairs)..pairs),
    }
}

/// Where a tile's outputs go: the first `rows × cols` of its `MR × NR`, row
/// stride `rs`.
#[derive(Clone, Copy)]
struct Out {
    ptr: *mut u16,
    rs: isize,
    rows: usize,
    cols: usize,
}

/// 16 `f32` sums rounded to `bf16` bit for bit as casts do (`bf16_bits`: (to
/// to nearest, ties to even; a NaN stays a quiet NaN), into the first `lanes`
/// (at most 16) elements at `dst`.
///
/// # Safety
/// `dst` must be writable for `lanes` elements; the CPU must have AVX-512F, BW and VL.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
pub(in crate::ops) unsafe fn round_store(s: __m512, dst: *mut u16, lanes: usize) {
    let x = _mm512_castps_si512(s);
    let high = _mm512_srli_epi32::<16>(x);
    // Just under half a unit of the last kept bit, plus that bit: carries
    // into it exactly when the dropped bits exceed half, or equal it and it is odd.
    let bias = _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(high, _mm512_set1_epi32(1)));
    let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(x, bias));
    let magnitude = _mm512_and_si512(x, _mm512_set1_epi32(0x7fff_ffff));
    let nan = _mm512_cmpgt_epu32_mask(magnitude, _mm512_set1_epi32(0x7f80_0000));
    let quiet = _mm512_or_si512(high, _mm512_set1_epi32(0x40));
    let bits = _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet));
    // SAFETY: `lanes` elements at `dst` are writable (caller).
    unsafe {
        if lanes == 16 {
            _mm256_storeu_si256(dst.cast::<__m256i>(), bits);
        } else {
            _mm256_mask_storeu_epi16(dst.cast::<i16>(), (1u16 << lanes) - 1, bits);
        }
    }
}

/// `lo | hi << 16`: the pair that one `u32` lane of the instruction reads.
#[inline(always)]
fn pair(lo: u16, hi: u16) -> u32 {
    u32::from(lo) | u32::from(hi) << 16
}

/// `out[j] = pair(x[j], y[j])`, or `pair(x[j], 0)` without `y` (an odd `k`'s last pair).
#[inline(always)]
fn interleave(out: &mut [u32], x: &[u16], y: Option<&[u16]>) {
    match y {
        Some(y) => {
            for ((d, &lo), &hi) in out.iter_mut().zip(x).zip(y) {
                *d = pair(lo, hi);
            }
        }
        None => {
            for (d, &lo) in out.iter_mut().zip(x) {
                *d = pair(lo, 0);
            }
        }
    }
}

/// The first `len` elements of `v`, grown with zeros if it is shorter (their
/// old values otherwise: the packing overwrites every element but the
/// padding, which [`zero_padding`] clears).
fn fit(v: &mut Vec<u32>, len: usize) -> &mut [u32] {
    if v.len() < len {
        v.resize(len, 0);
    }
    &mut v[..len]
}

/// Zeroes lanes `valid..width` of every line of a panel of lines of `width`
/// (the rows or columns past the matrix's edge).
fn zero_padding(panel: &mut [u32], width: usize, valid: usize) {
    if valid < width {
        for line in panel.chunks_exact_mut(width) {
            line[valid..].fill(0);
        }
    }
}

/// `len` consecutive elements from `p`, or none when `present` is false.
///
/// # Safety
/// When `present`, `p` must be readable for `len` elements.
#[inline(always)]
unsafe fn run<'a>(present: bool, p: *const u16, len: usize) -> Option<&'a [u16]> {
    // SAFETY: the caller's guarantee.
    present.then(|| unsafe { std::slice::from_raw_parts(p, len) })
}

/// Pair `q` of line `line` whose `k` elements run consecutively from `p`
/// (possibly unaligned); its high half zero past `k`.
///
/// # Safety
/// `p` must be readable for `k` elements, and `2·q < k`.
#[inline(always)]
unsafe fn pair_at(p: *const u16, q: usize, k: usize) -> u32 {
    // SAFETY: elements 2q and (when < k) 2q+1 are readable (caller).
    unsafe {
        if 2 * q + 1 < k {
            p.add(2 * q).cast::<u32>().read_unaligned()
        } else {
            pair(*p.add(2 * q), 0)
        }
    }
}

/// Lines `first..first + lines` of the `? × k` matrix `m`, packed into panels
/// of `W` lines: `dst[panel][pair][line]`, zero past the last line. The left
/// operand's lines are its rows (`W` = [`MR`]); the right operand's are its
/// columns (`W` = [`NR`], `m` its transposed view).
///
/// # Safety
/// Those lines of `m` must be readable for `k` elements.
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn pack<const W: usize>(m: Mat<u16>, first: usize, lines: usize, k: usize, dst: &mut Vec<u32>) {
    let pairs = k.div_ceil(2);
    let panels = fit(dst, lines.div_ceil(W) * pairs * W);
    for (p, out) in panels.chunks_exact_mut(pairs * W).enumerate() {
        let valid = W.min(lines - p * W);
        zero_padding(out, W, valid);
        let start = m.ptr.wrapping_offset((first + p * W) as isize * m.rs);
        // Every element read below lies in one of the panel's `valid` lines and
        // its first `k` elements, which the caller makes readable.
        if m.rs == 1 && m.cs != 1 {
            // Lines side by side (a column-major left operand, a row-major
            // right one): elements 2q and 2q+1 of the panel's lines are runs.
            for (q, slot) in out.chunks_exact_mut(W).enumerate() {
                // SAFETY: element 2q (< k, as q < pairs) of the `valid` lines,
                // which lie side by side at stride 1 (`m.rs == 1`).
                let x = unsafe { run(true, start.wrapping_offset(2 * q as isize * m.cs), valid) }.unwrap_or(&[]);
                // SAFETY: as above for element 2q+1, read only when it is < k.
                let y = unsafe { run(2 * q + 1 < k, start.wrapping_offset((2 * q + 1) as isize * m.cs), valid) };
                interleave(&mut slot[..valid], x, y);
            }
        } else if m.cs == 1 {
            // Each line's pairs are consecutive `u32`s (a row-major left
            // operand of odd `k`, a transposed weight on the right): blocks of
            // 8 lines × 8 whole pairs are turned in registers, the rest one
            // pair at a time.
            let (lines8, pairs8) = (valid / 8 * 8, k / 2 / 8 * 8);
            for i in (0..lines8).step_by(8) {
                for q in (0..pairs8).step_by(8) {
                    let src = start.wrapping_offset(i as isize * m.rs + 2 * q as isize);
                    // SAFETY: rows i..i+8 (<= lines8 <= valid) and pairs
                    // q..q+8 (<= k/2) of the panel are readable (caller), the
                    // byte step of a row is 2·rs; `out` holds `pairs · W` slots
                    // and the block writes rows q..q+8 (< pairs) at stride W,
                    // lanes i..i+8 (<= W); `avx512f` implies `avx2`.
                    unsafe { turn8(src.cast(), 2 * m.rs, out.as_mut_ptr().add(q * W + i), W) };
                }
            }
            for i in 0..valid {
                let line = start.wrapping_offset(i as isize * m.rs);
                let from = if i < lines8 { pairs8 } else { 0 };
                for q in from..pairs {
                    // SAFETY: line i < valid is readable for `k` elements
                    // (caller) and 2q < k since q < pairs.
                    out[q * W + i] = unsafe { pair_at(line, q, k) };
                }
            }
        } else {
            for i in 0..valid {
                for q in 0..pairs {
                    // SAFETY: only called with c < k, on line i < valid, which
                    // the caller makes readable for `k` elements.
                    let at = |c: usize| unsafe { *start.offset(i as isize * m.rs + c as isize * m.cs) };
                    out[q * W + i] = pair(at(2 * q), if 2 * q + 1 < k { at(2 * q + 1) } else { 0 });
                }
            }
        }
    }
}

/// The `MR × NR` sums of one tile over the pairs `span` (all of a dense
/// product's: `0..pairs`), rounded to `bf16` into `out`; `b` is a packed
/// right panel (of every pair). The left rows are a packed panel at `a`
/// (`DIRECT` false; `rs` unused), or, with `DIRECT`, `out.rows` rows of a
/// row-major matrix at `a` with row stride `rs` (the missing rows of a last
/// panel repeat its last row; their sums are not stored).
///
/// # Safety
/// `a` must be readable for the pairs `span` of each of its rows (packed: `MR`
/// `u32`s per pair) and `b` for `NR` elements per pair of it; `out` writable for its
/// `rows × cols` (at least one of each, at most `MR × NR`); the CPU must have
/// AVX-512F, BW, VL and AVX512_BF16.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn tile<const DIRECT: bool>(span: std::ops::Range<usize>, a: *const u16, rs: isize, b: *const u32, out: Out) {
    let row: [isize; MR] = std::array::from_fn(|i| {
        if DIRECT {
            i.min(out.rows - 1) as isize * rs
        } else {
            2 * i as isize
        }
    });
    let step = if DIRECT { 2 } else { 2 * MR };
    let mut sums: [[__m512; 2]; MR] = [[_mm512_setzero_ps(); 2]; MR];
    for q in span {
        // SAFETY: pair q of both panels, and of each left row, is inside them
        // (caller); an `__m512i` of 16 packed pairs is an `__m512bh` of 32
        // `bf16` (same size, any bits valid).
        unsafe {
            let b0: __m512bh = std::mem::transmute(_mm512_loadu_si512(b.add(q * NR).cast()));
            let b1: __m512bh = std::mem::transmute(_mm512_loadu_si512(b.add(q * NR + 16).cast()));
            let left = a.add(q * step);
            for (s, &r) in sums.iter_mut().zip(&row) {
                let pair = left.offset(r).cast::<u32>().read_unaligned();
                let ai: __m512bh = std::mem::transmute(_mm512_set1_epi32(pair as i32));
                s[0] = _mm512_dpbf16_ps(s[0], ai, b0);
                s[1] = _mm512_dpbf16_ps(s[1], ai, b1);
            }
        }
    }
    let (low, high) = (out.cols.min(16), out.cols.saturating_sub(16));
    for (i, s) in sums.iter().enumerate().take(out.rows) {
        // SAFETY: row i < rows of the output, `cols` elements (caller).
        unsafe {
            let row = out.ptr.offset(i as isize * out.rs);
            round_store(s[0], row, low);
            if high > 0 {
                round_store(s[1], row.add(16), high);
            }
        }
    }
}
