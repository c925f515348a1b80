//! An AVX-512 `f32` kernel for the small products of a batch: attention's
//! per-head `q·kᵀ` and `p·v` and their four gradients, `[T, E]·[E, T]` and
//! `[T, T]·[T, E]` for every head.
//!
//! The `gemm` crate packs both operands into panels on every call, which for a
//! product of a few hundred thousand multiply-adds costs as much as a fifth of
//! the product (`examples/bench_gemm`: 86 GFLOP/s on `32 × [128,32]·[32,128]`
//! against 105-112 on large products). This kernel reads the left operand in
//! place through its strides (one broadcast per element and row of a tile) and
//! the right one in place when its rows are contiguous, or from one transposed
//! copy (`Kᵀ`, `Vᵀ`) per product otherwise.
//!
//! Each output element is one chain of fused multiply-adds over the depth, in
//! order, from zero: the same arithmetic as the `gemm` crate's micro-kernels
//! for a depth that fits one of its panels ([`MAX_DEPTH`]), so the products
//! have the same bits whichever of the two runs them (tested).
//!
//! With a [`Causal`] part it skips what causal attention makes zero: the
//! tiles of scores above the diagonal, and the depth ranges over which the
//! weights (or their transpose) are zero.

use std::arch::x86_64::*;

use super::{Causal, Mat, zero_above_diagonal};
use crate::kernel::avx512::{lanes_below, load, store};

/// The deepest product this kernel takes: the `gemm` crate sums a depth of up
/// to 512 in one chain per element for products of this size; beyond, its
/// partial sums would round differently from one chain.
pub(super) const MAX_DEPTH: usize = 256;
/// The largest `m` and `n` this kernel takes (the copy of a transposed right
/// operand is at most `MAX_DEPTH · MAX_SIDE` elements).
pub(super) const MAX_SIDE: usize = 512;

/// Rows of the left operand per tile: 12 rows × 2 vectors of 16 columns are
/// 24 accumulators, which with the two right-operand vectors and a broadcast
/// fill 27 of the 32 vector registers.
const MR: usize = 12;
/// Columns per tile (two 16-lane vectors).
const NR: usize = 32;

/// Whether this CPU runs the kernel (AVX-512F, detected once).
pub(super) fn detected() -> bool {
    crate::kernel::avx512::avx512f()
}

/// Whether an `m×k · k×n` product with right operand `b` fits this kernel:
/// small enough, and `b` with unit column stride (read in place) or unit row
/// stride and columns that do not overlap (copied transposed; tensor views
/// never overlap, this guards the copy's bounds).
pub(super) fn fits([m, k, n]: [usize; 3], b: Mat<f32>) -> bool {
    let readable = b.cs == 1 || (b.rs == 1 && b.cs >= k as isize);
    detected() && k <= MAX_DEPTH && m <= MAX_SIDE && n <= MAX_SIDE && readable
}

thread_local! {
    /// Per thread: the transposed copy of the current product's right operand.
    static TURNED: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `c = a · b` (or the [`Causal`] part of it) for one `m×k · k×n` product
/// that [`fits`], `c` row-major with row stride `rsc`.
///
/// # Safety
/// As [`Gemm::gemm`](super::Gemm::gemm), and the product must [`fit`](fits).
pub(super) unsafe fn product([m, k, n]: [usize; 3], a: Mat<f32>, b: Mat<f32>, c: *mut f32, rsc: isize, part: Causal) {
    debug_assert!(fits([m, k, n], b));
    if b.cs == 1 {
        // SAFETY: the caller's guarantees, and AVX-512F (`fits`).
        unsafe { tiles([m, k, n], a, b.ptr, b.rs, c, rsc, part) };
        return;
    }
    TURNED.with_borrow_mut(|turned| {
        turned.clear();
        turned.reserve(k * n);
        // SAFETY: `b` has unit row stride (`fits`), so its element [kk, j] is at
        // `kk + j·cs`: the `n×k` row-major matrix of row stride `cs` that these
        // `(n - 1)·cs + k` elements hold, readable (caller).
        let src = unsafe { std::slice::from_raw_parts(b.ptr, (n - 1) * b.cs as usize + k) };
        super::transpose::transpose(src, n, k, b.cs as usize, &mut turned.spare_capacity_mut()[..k * n]);
        // SAFETY: `transpose` wrote all k·n elements.
        unsafe { turned.set_len(k * n) };
        // SAFETY: the copy is the k×n row-major right operand; the rest as above.
        unsafe { tiles([m, k, n], a, turned.as_ptr(), n as isize, c, rsc, part) };
    });
}

/// The product over tiles of `MR` rows and `NR` columns, `b` row-major with
/// row stride `rsb` (unit column stride).
///
/// # Safety
/// As [`product`], with `b` read at `kk·rsb + j`; AVX-512F present.
#[target_feature(enable = "avx512f")]
unsafe fn tiles([m, k, n]: [usize; 3], a: Mat<f32>, b: *const f32, rsb: isize, c: *mut f32, rsc: isize, part: Causal) {
    for i0 in (0..m).step_by(MR) {
        let rows = MR.min(m - i0);
        // The depth this row tile needs, and the columns it computes.
        let (depth, cols) = match part {
            Causal::Dense => (0..k, n),
            Causal::Scores => (0..k, n.min(i0 + rows)),
            Causal::Weights => (0..k.min(i0 + rows), n),
            Causal::WeightsTransposed => (i0.min(k)..k, n),
        };
        for j0 in (0..cols).step_by(NR) {
            let width = NR.min(n - j0);
            let tile = Tile {
                // SAFETY: row i0 < m of `a` lies inside the operand (caller).
                a: unsafe { a.ptr.offset(i0 as isize * a.rs) },
                ars: a.rs,
                acs: a.cs,
                // SAFETY: column j0 < n of `b` lies inside its first row (caller).
                b: unsafe { b.add(j0) },
                rsb,
                // SAFETY: element (i0, j0) lies inside the m×n output (caller).
                c: unsafe { c.offset(i0 as isize * rsc).add(j0) },
                rsc,
                width,
            };
            // SAFETY: the tile and the depth range (inside 0..k) are inside the
            // operands and the output (above); AVX-512F is present.
            unsafe { tile.run(rows, depth.clone()) };
        }
        if part == Causal::Scores {
            // Above the diagonal: zeros (the columns no tile computed, and the
            // part of the diagonal tile right of each row's diagonal).
            // SAFETY: the tile's rows are inside the output (caller).
            unsafe { zero_above_diagonal(c, i0..i0 + rows, n, rsc) };
        }
    }
}

/// One tile of at most `MR` rows and `NR` columns: its rows of `a` (strides
/// `ars`, `acs`), its columns of `b` (row stride `rsb`, unit column stride) and
/// of `c` (row stride `rsc`), `width` of them.
struct Tile {
    a: *const f32,
    ars: isize,
    acs: isize,
    b: *const f32,
    rsb: isize,
    c: *mut f32,
    rsc: isize,
    width: usize,
}

impl Tile {
    /// `c = a · b` over `depth` for the tile's first `rows` rows (at most `MR`).
    ///
    /// # Safety
    /// The tile's rows, columns and depth are inside the operands; AVX-512F.
    #[target_feature(enable = "avx512f")]
    unsafe fn run(&self, rows: usize, depth: std::ops::Range<usize>) {
        macro_rules! by_rows {
            ($nv:literal) => {
                // SAFETY: as this function's.
                unsafe {
                    match rows {
                        1 => self.rows::<1, $nv>(depth),
                        2 => self.rows::<2, $nv>(depth),
                        3 => self.rows::<3, $nv>(depth),
                        4 => self.rows::<4, $nv>(depth),
                        5 => self.rows::<5, $nv>(depth),
                        6 => self.rows::<6, $nv>(depth),
                        7 => self.rows::<7, $nv>(depth),
                        8 => self.rows::<8, $nv>(depth),
                        9 => self.rows::<9, $nv>(depth),
                        10 => self.rows::<10, $nv>(depth),
                        11 => self.rows::<11, $nv>(depth),
                        _ => self.rows::<MR, $nv>(depth),
                    }
                }
            };
        }
        if self.width > 16 { by_rows!(2) } else { by_rows!(1) }
    }

    /// [`run`](Self::run) for `R` rows and `V` vectors of 16 columns.
    ///
    /// # Safety
    /// As [`run`](Self::run).
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn rows<const R: usize, const V: usize>(&self, depth: std::ops::Range<usize>) {
        // Lanes past `width` are loaded as zeros and never stored.
        let masks: [__mmask16; V] = std::array::from_fn(|v| lanes_below(self.width, 16 * v));
        let mut acc = [[_mm512_setzero_ps(); V]; R];
        for kk in depth {
            // SAFETY: row kk of the tile's columns of `b`, and element kk of
            // each of its rows of `a`, are inside the operands (caller); masked
            // lanes are not read.
            unsafe {
                let bk = self.b.offset(kk as isize * self.rsb);
                let bv: [__m512; V] = std::array::from_fn(|v| load(masks[v], bk.add(16 * v)));
                for (r, acc) in acc.iter_mut().enumerate() {
                    let x = _mm512_set1_ps(*self.a.offset(r as isize * self.ars + kk as isize * self.acs));
                    for v in 0..V {
                        acc[v] = _mm512_fmadd_ps(x, bv[v], acc[v]);
                    }
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            for v in 0..V {
                // SAFETY: the tile's row r, columns 16v.. (masked to `width`),
                // are inside the output.
                // (Only the ragged right edge takes a masked store.)
                unsafe { store(self.c.offset(r as isize * self.rsc).add(16 * v), masks[v], acc[v]) };
            }
        }
    }
}
