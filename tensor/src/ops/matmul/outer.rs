//! An AVX-512 `f32` kernel for the products whose operands the `gemm` crate
//! packs by gathering: a linear layer's weight gradient `dyᵀ·x` (the left
//! operand `a` depth-major, the transposed view of `dy` `[tokens, out]`) and,
//! from 512 to 1024 deep and from 512 wide, its forward `x·Wᵀ` (the right
//! operand the transposed view of the row-major weight).
//!
//! The `gemm` crate turns a row-major output into the column-major product
//! `cᵀ = bᵀ·aᵀ` and packs its operands in the layout its micro-kernel reads:
//! for these two it gathers them element by element, a whole activation or
//! weight wide, per block of the depth. The weight gradients of the bench
//! Transformer ran at 166-213 GFLOP/s per thread and the large config's
//! `x·Wᵀ` at 156-198 where its products of row-major operands reach 224-236
//! (`examples/bench_fsdp --profile`). This kernel computes the sum of outer
//! products in the order of the depth: per depth step, one row of `b` (four
//! 16-lane vectors, from a packed panel that stays in L1) times six elements
//! of one row of `a` (broadcast from a packed tile), into 6×64 accumulators.
//! Packing copies row pieces of a row-major `b` or turns a transposed one
//! over with 8×8 register transposes, and moves six-element pieces of a
//! depth-major `a`'s steps or interleaves six rows of a row-major one with
//! vector permutes.
//!
//! Each output element is one chain of fused multiply-adds over the depth, in
//! order, from zero (a block of the depth continues the chain of the one
//! before from the output it left): its bits do not depend on how the output
//! is split into blocks or over threads.

use std::arch::x86_64::*;
use std::cell::RefCell;

use super::Mat;
use crate::kernel::avx512::{lanes_below, load, store};

/// Rows of the output per tile (elements of `a` broadcast per depth step).
const MR: usize = 6;
/// Columns of the output per tile: four 16-lane vectors, so a tile is 24
/// accumulators, with the four `b` vectors and a broadcast 29 of the 32
/// vector registers.
const NR: usize = 64;
/// Depth per packed panel: a panel of `b` (`KC × NR` floats, 32 KiB) stays
/// in L1 while every tile of a block of rows runs over it.
const KC: usize = 128;
/// Columns of `b` packed at once (`KC × NC` floats, 512 KiB, in L2).
const NC: usize = 1024;
/// Rows of the output per block: the block's `KC × MC` packed elements of
/// `a` (96 KiB) stay in L2 while every panel runs over them.
const MC: usize = 192;
/// The most bytes of output (rows of one block of `NC` columns) that one
/// pass over the depth updates: each block of `KC` depth steps reads and
/// writes back what it updates, which must stay in cache between the
/// passes, while each block of rows packs `b` again (so no smaller: the
/// weight gradient of a 3072-wide MLP, `[768, 256]·[256, 3072]`, ran at 189
/// GFLOP/s in blocks of 192 rows and 212 in one). The weight gradient of a
/// 32,000-word head (`[32000, 512]·[512, 768]`, a 98 MB output) ran at 183
/// GFLOP/s per thread when each pass went over all of it, from memory.
const OUTPUT_BLOCK_BYTES: usize = 4 << 20;

/// Depth steps ahead whose rows of `a` [`pack_a`] prefetches: a weight
/// gradient over a 4096-wide vocabulary packed 5% faster with 4 to 8 than
/// with none, slower again with 16.
const PREFETCH_ROWS: isize = 8;

/// The smallest depth and width of a product of a row-major `a` by a
/// transposed `b` that the kernel takes: it turns `b` over and interleaves
/// `a`'s rows into tiles, which on shallow or narrow products costs more
/// than the `gemm` crate's gathering of `b` (`examples/bench_fsdp`, GFLOP/s
/// per product on one thread: the large config's `[256, 768]·[768, 768]ᵀ`
/// 192 here against 170, `[256, 3072]·[3072, 768]ᵀ` 215 against 177 on a
/// row-major copy; the bench config's `[512, 256]·[256, 256]ᵀ` 199-208
/// against 216).
const ROWS_MIN_SIDE: usize = 512;
/// The deepest product of a row-major `a` by a transposed `b` that the
/// kernel takes: deeper, its tiles read and write their output back once per
/// [`KC`] steps of depth, where the `gemm` crate's deeper blocks on a
/// row-major copy of `b` do better (the large config's `[512, 3072]·[3072,
/// 768]ᵀ` on two threads: 172 GFLOP/s per thread here against 204).
const ROWS_MAX_DEPTH: usize = 1024;

/// The smallest output side and depth the kernel takes; smaller products
/// stay on the `gemm` crate, whose packing costs little there.
const MIN_SIDE: usize = 16;

/// One cache line of packed `b`: panels are loaded with aligned loads.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([f32; 16]);

thread_local! {
    /// Per thread: the packed panels of the current block of `b` and tiles
    /// of the current block of `a`.
    static PACKED: RefCell<(Vec<Line>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// Whether an `m×k · k×n` product of `a` and `b` fits this kernel: AVX-512F,
/// no side smaller than [`MIN_SIDE`], and a layout the `gemm` crate packs by
/// gathering: a depth-major `a` (unit row stride: the transposed view of a
/// row-major `[k, m]`, a weight gradient's `dyᵀ`) times a row-major `b` or
/// a transposed one, or a row-major `a` times a transposed row-major `b`
/// (unit row stride, columns `k` or more apart: a linear layer's `Wᵀ`) at
/// least [`ROWS_MIN_SIDE`] deep and wide and at most [`ROWS_MAX_DEPTH`]
/// deep. Row-major times row-major stays on the `gemm` crate, which reads
/// both in place at the same speed.
pub(super) fn fits([m, k, n]: [usize; 3], a: Mat<f32>, b: Mat<f32>) -> bool {
    let a_depth_major = a.rs == 1 && a.cs >= 1;
    let a_rows = a.cs == 1 && a.rs >= k as isize;
    let b_rows = b.cs == 1 && b.rs >= 1;
    let b_turned = b.rs == 1 && b.cs >= k as isize;
    super::small::detected()
        && m.min(k).min(n) >= MIN_SIDE
        && ((a_depth_major && (b_rows || b_turned))
            || (a_rows && b_turned && k.min(n) >= ROWS_MIN_SIDE && k <= ROWS_MAX_DEPTH))
}

/// `c = a · b` for one `m×k · k×n` product that [`fits`], `c` row-major with
/// row stride `rsc`.
///
/// # Safety
/// As [`Gemm::gemm`](super::Gemm::gemm), and the product must [`fit`](fits).
pub(super) unsafe fn product([m, k, n]: [usize; 3], a: Mat<f32>, b: Mat<f32>, c: *mut f32, rsc: isize) {
    debug_assert!(fits([m, k, n], a, b));
    PACKED.with_borrow_mut(|(packed_b, packed_a)| {
        packed_b.resize(KC * NC / 16, Line([0.0; 16]));
        packed_a.resize(KC * MC, 0.0);
        for j0 in (0..n).step_by(NC) {
            let nc = NC.min(n - j0);
            // Rows of the output per pass over the depth: a block of at most
            // OUTPUT_BLOCK_BYTES of these columns, whole blocks of MC rows.
            let stripe = (OUTPUT_BLOCK_BYTES / (4 * nc)).max(MC) / MC * MC;
            for i1 in (0..m).step_by(stripe) {
                let m1 = stripe.min(m - i1);
                for t0 in (0..k).step_by(KC) {
                    let kc = KC.min(k - t0);
                    // SAFETY: rows t0..t0 + kc and columns j0..j0 + nc of `b`
                    // are inside it (caller); `packed_b` holds KC·NC floats.
                    unsafe { pack_b(b, [t0, j0], [kc, nc], packed_b) };
                    for i0 in (i1..i1 + m1).step_by(MC) {
                        let mc = MC.min(i1 + m1 - i0);
                        // SAFETY: depth t0..t0 + kc of rows i0..i0 + mc of `a`
                        // (caller); `packed_a` holds KC·MC floats.
                        unsafe { pack_a(a, [i0, t0], [mc, kc], packed_a) };
                        for (q, j) in (j0..j0 + nc).step_by(NR).enumerate() {
                            let nr = NR.min(n - j);
                            let panel = packed_b[q * KC * NR / 16..].as_ptr().cast::<f32>();
                            for (s, i) in (i0..i0 + mc).step_by(MR).enumerate() {
                                let rows = MR.min(i0 + mc - i);
                                // SAFETY: rows i..i + rows, columns j..j + nr of
                                // the output (caller); the packed tiles hold kc
                                // steps of MR (of `a`) and NR (of `b`) floats.
                                unsafe {
                                    let at = packed_a.as_ptr().add(s * KC * MR);
                                    let ct = c.offset(i as isize * rsc + j as isize);
                                    tile(rows, [kc, nr], at, panel, ct, rsc, t0 == 0);
                                }
                            }
                        }
                    }
                }
            }
        }
    });
}

/// Copies depth steps `t0..t0 + kc` of rows `i0..i0 + mc` of `a` into
/// tiles of [`MR`] rows: tile `s`, step `t` at `packed[(s·KC + t)·MR ..]`.
///
/// # Safety
/// Those elements of `a` must be readable; AVX-512F; `a` depth-major
/// (unit row stride) or row-major (unit column stride); `kc <= KC`, `mc <= MC`,
/// `packed` at least `KC·MC` floats.
unsafe fn pack_a(a: Mat<f32>, [i0, t0]: [usize; 2], [mc, kc]: [usize; 2], packed: &mut [f32]) {
    // SAFETY: the caller's guarantees.
    unsafe {
        let from = a.ptr.offset(i0 as isize * a.rs + t0 as isize * a.cs);
        if a.rs == 1 {
            pack_a_depth_major(from, a.cs, kc, mc, packed);
        } else {
            pack_a_rows(from, a.rs, kc, mc, packed);
        }
    }
}

/// [`pack_a`] for a row-major `a` (element `[i, t]` at `i·lda + t`, an
/// activation `x` times `Wᵀ`): sixteen depth steps of a whole tile's six
/// rows at a time, interleaved by six masked permutes per output vector;
/// the rest (depth past a multiple of 16, a tile of fewer rows) element by
/// element.
///
/// # Safety
/// AVX-512F; `a` must be readable at `i·lda + t` for `i < mc`, `t < kc`;
/// `kc <= KC`, `mc <= MC`, `packed` at least `KC·MC` floats.
#[target_feature(enable = "avx512f")]
unsafe fn pack_a_rows(a: *const f32, lda: isize, kc: usize, mc: usize, packed: &mut [f32]) {
    assert!(
        kc <= KC && mc <= MC && packed.len() >= KC * MC,
        "pack_a_rows: bad block"
    );
    // Output vector v of a group of 16 steps holds the packed elements
    // 16·v + l: step (16·v + l) / 6 of row (16·v + l) % 6.
    let idx: [__m512i; MR] = std::array::from_fn(|v| {
        let lanes: [i32; 16] = std::array::from_fn(|l| ((16 * v + l) / MR) as i32);
        // SAFETY: 16 i32 lanes read from an array of 16.
        unsafe { _mm512_loadu_si512(lanes.as_ptr().cast()) }
    });
    let masks: [[__mmask16; MR]; MR] = std::array::from_fn(|v| {
        std::array::from_fn(|r| (0..16).filter(|l| (16 * v + l) % MR == r).fold(0, |m, l| m | (1 << l)))
    });
    let dst = packed.as_mut_ptr();
    for (s, i) in (0..mc).step_by(MR).enumerate() {
        let rows = MR.min(mc - i);
        // SAFETY: rows i..i + rows, steps below kc of `a` (caller); tile s's
        // kc·MR floats inside `packed` (checked above).
        unsafe {
            let tile = dst.add(s * KC * MR);
            let row = |r: usize| a.offset((i + r) as isize * lda);
            let mut t0 = 0;
            if rows == MR {
                while t0 + 16 <= kc {
                    let src: [__m512; MR] = std::array::from_fn(|r| _mm512_loadu_ps(row(r).add(t0)));
                    for v in 0..MR {
                        let mut out = _mm512_maskz_permutexvar_ps(masks[v][0], idx[v], src[0]);
                        for r in 1..MR {
                            out = _mm512_mask_permutexvar_ps(out, masks[v][r], idx[v], src[r]);
                        }
                        _mm512_storeu_ps(tile.add(t0 * MR + 16 * v), out);
                    }
                    t0 += 16;
                }
            }
            for r in 0..rows {
                for t in t0..kc {
                    *tile.add(t * MR + r) = *row(r).add(t);
                }
            }
        }
    }
}

/// [`pack_a`] for a depth-major `a` (element `[i, t]` at `i + t·lda`, a
/// weight gradient's `dyᵀ`): six-element pieces of each depth step, moved
/// under a mask of six lanes. The tiles' rows are contiguous whatever `lda`
/// is: read in place, rows a power of two apart (a vocabulary of 4096) fell
/// on the same few cache sets and missed in L1 and L2.
///
/// # Safety
/// AVX-512F; `a` must be readable at `i + t·lda` for `i < mc`, `t < kc`;
/// `kc <= KC`, `mc <= MC`, `packed` at least `KC·MC` floats.
#[target_feature(enable = "avx512f")]
unsafe fn pack_a_depth_major(a: *const f32, lda: isize, kc: usize, mc: usize, packed: &mut [f32]) {
    let whole = mc / MR;
    let (piece, tail): (__mmask16, __mmask16) = ((1 << MR) - 1, (1 << (mc % MR)) - 1);
    let dst = packed.as_mut_ptr();
    for t in 0..kc {
        // SAFETY: step t's mc elements (caller), read and written MR at a
        // time under a mask of MR (or the tail's) lanes; tile s's step t is
        // inside `packed` (KC·MC floats).
        unsafe {
            let src = a.offset(t as isize * lda);
            // Rows of `a` lie a row of the activation apart, each on pages of
            // its own, where the hardware prefetcher does not follow.
            let ahead = src.wrapping_offset(PREFETCH_ROWS * lda).cast::<i8>();
            for line in (0..mc * 4).step_by(64) {
                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(line));
            }
            for s in 0..whole {
                let v = _mm512_maskz_loadu_ps(piece, src.add(s * MR));
                _mm512_mask_storeu_ps(dst.add((s * KC + t) * MR), piece, v);
            }
            if tail != 0 {
                let v = _mm512_maskz_loadu_ps(tail, src.add(whole * MR));
                _mm512_mask_storeu_ps(dst.add((whole * KC + t) * MR), tail, v);
            }
        }
    }
}

/// Copies depth steps `t0..t0 + kc` of columns `j0..j0 + nc` of `b` into
/// panels of [`NR`] columns: panel `q`, step `t` at `packed[(q·KC + t)·NR
/// ..]`, the columns past `nc` of the last panel zero.
///
/// # Safety
/// Those elements of `b` must be readable; AVX-512F; `b` row-major (unit
/// column stride) or transposed (unit row stride, columns at least `kc`
/// apart); `kc <= KC`, `nc <= NC`, `packed` at least `KC·NC` floats.
unsafe fn pack_b(b: Mat<f32>, [t0, j0]: [usize; 2], [kc, nc]: [usize; 2], packed: &mut [Line]) {
    // SAFETY: the caller's guarantees.
    unsafe {
        let from = b.ptr.offset(t0 as isize * b.rs + j0 as isize * b.cs);
        if b.cs == 1 {
            pack_b_rows(from, b.rs, kc, nc, packed);
        } else {
            pack_b_turned(from, b.cs, kc, nc, packed);
        }
    }
}

/// [`pack_b`] for a transposed row-major `b` (element `[t, j]` at `t +
/// j·ldw`, a linear layer's `Wᵀ`): each panel is `NR` rows of `W` turned
/// over with 8×8 register transposes, in cache, where the `gemm` crate
/// gathers them element by element.
///
/// # Safety
/// `b` must be readable at `t + j·ldw` for `t < kc`, `j < nc`, `ldw >= kc`;
/// `kc <= KC`, `nc <= NC`, `packed` at least `KC·NC` floats.
unsafe fn pack_b_turned(b: *const f32, ldw: isize, kc: usize, nc: usize, packed: &mut [Line]) {
    let ld = ldw as usize;
    for (q, j) in (0..nc).step_by(NR).enumerate() {
        let nr = NR.min(nc - j);
        let panel = &mut packed[q * KC * NR / 16..][..KC * NR / 16];
        // SAFETY: `Line` is 16 plain floats; the panel's first kc·NR of them.
        let panel =
            unsafe { std::slice::from_raw_parts_mut(panel.as_mut_ptr().cast::<std::mem::MaybeUninit<f32>>(), kc * NR) };
        // SAFETY: rows j..j + nr of `W` (columns of `b`), kc elements each,
        // `ld` apart (caller).
        let src = unsafe { std::slice::from_raw_parts(b.add(j * ld), (nr - 1) * ld + kc) };
        if nr == NR {
            super::transpose::transpose(src, NR, kc, ld, panel);
        } else {
            for t in 0..kc {
                for col in 0..NR {
                    let v = if col < nr { src[col * ld + t] } else { 0.0 };
                    panel[t * NR + col] = std::mem::MaybeUninit::new(v);
                }
            }
        }
    }
}

/// [`pack_b`] for a row-major `b` (row stride `ldb`, an activation `x`). A
/// row of a panel is four vector moves (masked at the edge): calls of
/// `memcpy` for its 256 bytes took 2.6% of a training step's samples.
///
/// # Safety
/// AVX-512F; `b` must be readable at `t·ldb + j` for `t < kc`, `j < nc`;
/// `kc <= KC`, `nc <= NC`, `packed` at least `KC·NC` floats.
#[target_feature(enable = "avx512f")]
unsafe fn pack_b_rows(b: *const f32, ldb: isize, kc: usize, nc: usize, packed: &mut [Line]) {
    let dst = packed.as_mut_ptr().cast::<f32>();
    for (q, j) in (0..nc).step_by(NR).enumerate() {
        let nr = NR.min(nc - j);
        let masks: [__mmask16; 4] = std::array::from_fn(|v| lanes_below(nr, 16 * v));
        for t in 0..kc {
            // SAFETY: row t, the masks' columns j.. of `b` (caller); the panel
            // row is NR floats inside `packed`, 64-byte aligned (`Line`),
            // written whole (zeros past nr).
            unsafe {
                let src = b.offset(t as isize * ldb + j as isize);
                let row = dst.add((q * KC + t) * NR);
                for (v, &mask) in masks.iter().enumerate() {
                    _mm512_store_ps(row.add(16 * v), load(mask, src.add(16 * v)));
                }
            }
        }
    }
}

/// One tile of `rows <= MR` rows and `nr <= NR` columns over `kc` depth
/// steps, dispatched to the kernel for its row count.
///
/// # Safety
/// As [`tile_rows`].
#[allow(clippy::too_many_arguments)]
unsafe fn tile(rows: usize, kcnr: [usize; 2], a: *const f32, panel: *const f32, c: *mut f32, rsc: isize, first: bool) {
    // SAFETY: the caller's guarantees; AVX-512F was detected (`fits`).
    unsafe {
        match rows {
            6 => tile_rows::<6>(kcnr, a, panel, c, rsc, first),
            5 => tile_rows::<5>(kcnr, a, panel, c, rsc, first),
            4 => tile_rows::<4>(kcnr, a, panel, c, rsc, first),
            3 => tile_rows::<3>(kcnr, a, panel, c, rsc, first),
            2 => tile_rows::<2>(kcnr, a, panel, c, rsc, first),
            _ => tile_rows::<1>(kcnr, a, panel, c, rsc, first),
        }
    }
}

/// `R` rows and `nr` columns of the output: `c[r, j] (+)= Σ_t a[t·MR + r] ·
/// panel[t·NR + j]`, continuing the chain from `c` unless `first`.
///
/// # Safety
/// AVX-512F; `a` (a packed tile) readable at `t·MR + r` for `t < kc`, `r < R`; `panel` at
/// `kc·NR` floats, 64-byte aligned; `c` readable and writable at `r·rsc + j`
/// for `r < R`, `j < nr` (read only when not `first`).
#[target_feature(enable = "avx512f")]
unsafe fn tile_rows<const R: usize>(
    [kc, nr]: [usize; 2],
    a: *const f32,
    panel: *const f32,
    c: *mut f32,
    rsc: isize,
    first: bool,
) {
    let masks: [__mmask16; 4] = std::array::from_fn(|v| lanes_below(nr, 16 * v));
    let mut acc = [[_mm512_setzero_ps(); 4]; R];
    if !first {
        // The next tile's rows of the output, read when it starts: from L3
        // at the end of the output a large weight gradient has (4 MiB).
        for r in R..R + MR {
            for v in 0..4 {
                let line = c.wrapping_offset(r as isize * rsc).wrapping_add(16 * v);
                _mm_prefetch::<_MM_HINT_T0>(line.cast());
            }
        }

        for (r, acc) in acc.iter_mut().enumerate() {
            for (v, acc) in acc.iter_mut().enumerate() {
                // SAFETY: row r, the mask's columns of vector v (caller).
                *acc = unsafe { load(masks[v], c.offset(r as isize * rsc).add(16 * v)) };
            }
        }
    }
    for t in 0..kc {
        // SAFETY: panel row t (aligned, NR floats) and row t of `a`'s R
        // elements (caller).
        unsafe {
            let row = panel.add(t * NR);
            let bv = [
                _mm512_load_ps(row),
                _mm512_load_ps(row.add(16)),
                _mm512_load_ps(row.add(32)),
                _mm512_load_ps(row.add(48)),
            ];
            let at = a.add(t * MR);
            for (r, acc) in acc.iter_mut().enumerate() {
                let av = _mm512_set1_ps(*at.add(r));
                for (acc, &bv) in acc.iter_mut().zip(&bv) {
                    *acc = _mm512_fmadd_ps(av, bv, *acc);
                }
            }
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        for (v, &acc) in acc.iter().enumerate() {
            // SAFETY: row r, the mask's columns of vector v (caller).
            unsafe { store(c.offset(r as isize * rsc).add(16 * v), masks[v], acc) };
        }
    }
}
