//! Matrix multiplication: 2-D, batched with broadcast batch dims, strided operands.

use half::{bf16, f16};
use tessera_mesh::DType;

use super::elementwise::broadcast_shapes;
use super::{Float, not_float, output, same_dtype, unravel};
use crate::{Error, Result, Tensor};

/// The GEMM that runs [`Tensor::matmul`].
///
/// Both take arbitrary strides, so transposed and narrowed views multiply
/// without a copy. Measured by `examples/bench_gemm` on the project's machine
/// (Xeon with AVX-512, one thread, f32, square 512 to 2048): `gemm` with its
/// AVX-512 kernels reaches about 165 GFLOP/s against `matrixmultiply`'s 130;
/// with AVX2/FMA only, `gemm` reaches 95, so [`auto`](Self::auto) picks
/// `matrixmultiply` on CPUs without AVX-512 when the rank has one thread.
///
/// A product of at least [`PARALLEL_MIN_FLOPS`] is split into blocks of output
/// rows (or columns), one per [`intra_op_threads`](tessera_mesh::intra_op_threads),
/// each block one call of the kernel on the rank's team
/// ([`parallel_for`](tessera_mesh::parallel_for)).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GemmKernel {
    /// The `gemm` crate (pure Rust; runtime-detected AVX-512 or AVX2/FMA
    /// kernels).
    Gemm,
    /// The `matrixmultiply` crate (pure Rust; AVX2/FMA kernels), which
    /// ndarray's `dot` uses.
    MatrixMultiply,
}

impl GemmKernel {
    /// The faster kernel on this CPU: [`Gemm`](Self::Gemm) where AVX-512 is
    /// available or the rank has several threads, [`MatrixMultiply`](Self::MatrixMultiply)
    /// otherwise.
    pub fn auto() -> GemmKernel {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512f") {
            return GemmKernel::Gemm;
        }
        if tessera_mesh::intra_op_threads() > 1 {
            return GemmKernel::Gemm;
        }
        GemmKernel::MatrixMultiply
    }
}

/// The smallest product (`2·m·k·n` flops) that is split over the rank's
/// threads: below it, handing out the parts costs more than they save.
pub const PARALLEL_MIN_FLOPS: usize = 1 << 23;

/// Rows (or columns) per block of a split product are a multiple of this, the
/// height of the `gemm` crate's AVX-512 f32 micro-kernel tile, so no block ends
/// in a partial tile that a whole product would not have.
const SPLIT_ALIGN: usize = 16;

/// Flops of `entries` products `m×k · k×n`.
fn flops(entries: usize, [m, k, n]: [usize; 3]) -> u128 {
    2 * entries as u128 * m as u128 * k as u128 * n as u128
}

/// How one `m×k · k×n` product is split over `threads` threads: blocks of
/// `block` output rows (`by_rows`) or columns, `parts` of them; one part when
/// the product is too small to split.
#[derive(Debug, PartialEq, Eq)]
struct Split {
    by_rows: bool,
    block: usize,
    parts: usize,
}

fn split(threads: usize, [m, k, n]: [usize; 3]) -> Split {
    let by_rows = m >= n;
    let len = if by_rows { m } else { n };
    if threads <= 1 || flops(1, [m, k, n]) < PARALLEL_MIN_FLOPS as u128 || len < 2 * SPLIT_ALIGN {
        return Split {
            by_rows,
            block: len,
            parts: 1,
        };
    }
    let block = len.div_ceil(threads).next_multiple_of(SPLIT_ALIGN);
    Split {
        by_rows,
        block,
        parts: len.div_ceil(block),
    }
}

/// One strided matrix operand: base pointer and (row, column) strides.
#[derive(Clone, Copy)]
struct Mat<T> {
    ptr: *const T,
    rs: isize,
    cs: isize,
}

/// Element types with a native GEMM: `c = a · b` (c overwritten, never read).
trait Gemm: Float {
    /// # Safety
    /// With `[m, k, n] = mkn` (all > 0): `a` (m×k) and `b` (k×n) must be
    /// readable at every index their strides reach; `c` must be writable for
    /// `m` rows of stride `rsc` and `n` columns of stride 1, and not overlap
    /// `a` or `b`.
    unsafe fn gemm(kernel: GemmKernel, mkn: [usize; 3], a: Mat<Self>, b: Mat<Self>, c: *mut Self, rsc: isize);
}

macro_rules! impl_gemm {
    ($t:ty, $mm:path) => {
        impl Gemm for $t {
            unsafe fn gemm(kernel: GemmKernel, [m, k, n]: [usize; 3], a: Mat<$t>, b: Mat<$t>, c: *mut $t, rsc: isize) {
                // SAFETY: the caller guarantees the bounds and disjointness that both
                // kernels require; `c` is written without being read (beta = 0 for
                // matrixmultiply, read_dst = false for gemm).
                unsafe {
                    match kernel {
                        GemmKernel::MatrixMultiply => {
                            $mm(m, k, n, 1.0, a.ptr, a.rs, a.cs, b.ptr, b.rs, b.cs, 0.0, c, rsc, 1)
                        }
                        GemmKernel::Gemm => gemm::gemm(
                            m,
                            n,
                            k,
                            c,
                            1,
                            rsc,
                            false,
                            a.ptr,
                            a.cs,
                            a.rs,
                            b.ptr,
                            b.cs,
                            b.rs,
                            0.0,
                            1.0,
                            false,
                            false,
                            false,
                            gemm::Parallelism::None,
                        ),
                    }
                }
            }
        }
    };
}
impl_gemm!(f32, matrixmultiply::sgemm);
impl_gemm!(f64, matrixmultiply::dgemm);

// Half-precision operands run the f32 GEMM with their conversions fused in.
macro_rules! impl_gemm_half {
    ($t:ty) => {
        impl Gemm for $t {
            unsafe fn gemm(kernel: GemmKernel, mkn: [usize; 3], a: Mat<$t>, b: Mat<$t>, c: *mut $t, rsc: isize) {
                // SAFETY: forwarded unchanged from the caller's guarantees.
                unsafe { gemm_half(kernel, mkn, a, b, c, rsc) }
            }
        }
    };
}
impl_gemm_half!(bf16);
impl_gemm_half!(f16);

/// Bytes of the `f32` output panel that a half-precision product is computed
/// in before it is rounded: small enough to stay in a core's L2 cache.
const HALF_PANEL_BYTES: usize = 1 << 20;

/// Scratch bytes a thread keeps between half-precision products; more is
/// freed after the product that needed it.
const HALF_SCRATCH_KEEP: usize = 32 << 20;

thread_local! {
    /// This thread's scratch for half-precision products: the two widened
    /// operands and the `f32` output panel.
    static HALF_SCRATCH: std::cell::RefCell<[Vec<f32>; 3]> = const {
        std::cell::RefCell::new([Vec::new(), Vec::new(), Vec::new()])
    };
}

/// `c = a · b` for `bf16` / `f16` operands, each output element the `f32`
/// GEMM's sum of the widened operands rounded once: the same values as
/// widening both operands, multiplying in `f32` and rounding the product, but
/// without the `f32` copies in memory. The output is computed in panels of
/// whole columns (or rows) along its longer dim, each in an L2-sized `f32`
/// buffer that is rounded into `c` while it is hot; the operand that spans
/// every panel is widened once, the other one panel at a time, into this
/// thread's scratch (no allocation once it has grown).
///
/// PyTorch: `torch.matmul` on `bfloat16` CPU tensors (oneDNN's bf16 GEMM, f32
/// accumulation).
///
/// # Safety
/// As [`Gemm::gemm`].
unsafe fn gemm_half<H: Float<Acc = f32>>(
    kernel: GemmKernel,
    [m, k, n]: [usize; 3],
    a: Mat<H>,
    b: Mat<H>,
    c: *mut H,
    rsc: isize,
) {
    let simd = super::fastmath::Simd::best();
    HALF_SCRATCH.with(|scratch| {
        let mut scratch = scratch.borrow_mut();
        let [sa, sb, sc] = &mut *scratch;
        let by_cols = n >= m;
        let (long, short) = if by_cols { (n, m) } else { (m, n) };
        let width = (HALF_PANEL_BYTES / 4 / short).next_multiple_of(SPLIT_ALIGN).min(long);
        // SAFETY (all blocks below): a panel's rows (columns) are a sub-range
        // of the product's, so each operand block lies inside what the caller
        // guarantees readable; the output block inside what it guarantees
        // writable. The f32 operands and panel are this thread's scratch,
        // sized by `widen` and `grow` for what the GEMM reads and writes.
        let whole = unsafe {
            if by_cols {
                widen(simd, a, m, k, sa)
            } else {
                widen(simd, b, k, n, sb)
            }
        };
        for start in (0..long).step_by(width) {
            let w = width.min(long - start);
            let (rows, cols) = if by_cols { (m, w) } else { (w, n) };
            let (wa, wb) = unsafe {
                if by_cols {
                    let panel = Mat {
                        ptr: b.ptr.wrapping_offset(start as isize * b.cs),
                        ..b
                    };
                    (whole, widen(simd, panel, k, w, sb))
                } else {
                    let panel = Mat {
                        ptr: a.ptr.wrapping_offset(start as isize * a.rs),
                        ..a
                    };
                    (widen(simd, panel, w, k, sa), whole)
                }
            };
            let out = grow(sc, rows * cols);
            let panel = out.as_mut_ptr();
            let origin = if by_cols { start } else { start * rsc as usize };
            unsafe {
                <f32 as Gemm>::gemm(kernel, [rows, k, cols], wa, wb, panel, cols as isize);
                simd.run(
                    #[inline(always)]
                    || {
                        for (i, line) in out[..rows * cols].chunks_exact(cols).enumerate() {
                            let dst = std::slice::from_raw_parts_mut(c.add(origin + i * rsc as usize), cols);
                            for (d, &x) in dst.iter_mut().zip(line) {
                                *d = H::from_acc(x);
                            }
                        }
                    },
                );
            }
        }
        for v in [sa, sb, sc] {
            if v.capacity() * 4 > HALF_SCRATCH_KEEP {
                *v = Vec::new();
            }
        }
    });
}

/// `v` with at least `len` elements (grown with zeros, never shrunk), as its
/// first `len`.
fn grow(v: &mut Vec<f32>, len: usize) -> &mut [f32] {
    if v.len() < len {
        v.resize(len, 0.0);
    }
    &mut v[..len]
}

/// The `rows × cols` matrix `src` widened to `f32` into `dst`, laid out
/// row-major, or column-major when `src` is (a transposed view), so the copy
/// reads and writes in runs.
///
/// # Safety
/// Every element of `src` that its strides reach for `rows × cols` must be readable.
unsafe fn widen<H: Float<Acc = f32>>(
    simd: super::fastmath::Simd,
    src: Mat<H>,
    rows: usize,
    cols: usize,
    dst: &mut Vec<f32>,
) -> Mat<f32> {
    let column_major = src.rs == 1 && src.cs != 1;
    let (lines, len, line_step, step) = if column_major {
        (cols, rows, src.cs, src.rs)
    } else {
        (rows, cols, src.rs, src.cs)
    };
    let out = grow(dst, rows * cols);
    simd.run(
        #[inline(always)]
        || {
            for (l, line) in out.chunks_exact_mut(len.max(1)).take(lines).enumerate() {
                let first = src.ptr.wrapping_offset(l as isize * line_step);
                if step == 1 {
                    // SAFETY: a line of `len` consecutive readable elements.
                    let run = unsafe { std::slice::from_raw_parts(first, len) };
                    for (d, &x) in line.iter_mut().zip(run) {
                        *d = x.to_acc();
                    }
                } else {
                    for (j, d) in line.iter_mut().enumerate() {
                        // SAFETY: element `j` of the line is readable (caller).
                        *d = unsafe { *first.wrapping_offset(j as isize * step) }.to_acc();
                    }
                }
            }
        },
    );
    let (rs, cs) = if column_major {
        (1, rows as isize)
    } else {
        (cols as isize, 1)
    };
    Mat {
        ptr: dst.as_ptr(),
        rs,
        cs,
    }
}

/// The error for shapes that cannot be multiplied.
fn mismatch(a: &Tensor, b: &Tensor, why: String) -> Error {
    Error::ShapeMismatch {
        op: "matmul",
        detail: format!("cannot multiply {:?} by {:?}: {why}", a.shape(), b.shape()),
    }
}

/// Whether dims `0..=last` of `t` are laid out as one dim of stride
/// `t.strides()[last]` (so a batch of row blocks is one tall matrix).
fn rows_fold(t: &Tensor, last: usize) -> bool {
    let (shape, strides) = (t.shape(), t.strides());
    let mut step = strides[last] as u128 * shape[last] as u128;
    for d in (0..last).rev() {
        if shape[d] != 1 && strides[d] as u128 != step {
            return false;
        }
        step *= shape[d] as u128;
    }
    true
}

// SAFETY: an operand is only read, from storage its tensor keeps borrowed for
// the whole product, including by the threads of a split batch.
unsafe impl<T> Send for Mat<T> {}
// SAFETY: as for Send.
unsafe impl<T> Sync for Mat<T> {}

/// How many parts a batch of `count` `m×k · k×n` products runs in: 1 unless the
/// rank has several threads and each product is too small to split itself
/// ([`split`]) while the batch is large enough to be worth splitting.
fn batch_threads(threads: usize, count: usize, mkn: [usize; 3]) -> usize {
    let min = PARALLEL_MIN_FLOPS as u128;
    if threads > 1 && count > 1 && split(threads, mkn).parts == 1 && flops(count, mkn) >= min {
        threads.min(count)
    } else {
        1
    }
}

/// `c = a · b` for one `m×k · k×n` product, split over the rank's threads in
/// blocks of rows or columns when it is large enough ([`split`]).
///
/// # Safety
/// As [`Gemm::gemm`], with `c` an [`OutPtr`] to the product's first element.
unsafe fn gemm_split<T: Gemm>(
    kernel: GemmKernel,
    [m, k, n]: [usize; 3],
    a: Mat<T>,
    b: Mat<T>,
    c: OutPtr<T>,
    rsc: isize,
) {
    let Split { by_rows, block, parts } = split(tessera_mesh::intra_op_threads(), [m, k, n]);
    let part = |p: usize| {
        let start = p * block;
        let (mut a, mut b, mut mkn) = (a, b, [m, k, n]);
        let offset = if by_rows {
            mkn[0] = block.min(m - start);
            a.ptr = a.ptr.wrapping_offset(start as isize * a.rs);
            start * rsc as usize
        } else {
            mkn[2] = block.min(n - start);
            b.ptr = b.ptr.wrapping_offset(start as isize * b.cs);
            start
        };
        // SAFETY: the block's rows (columns) are a sub-range of the product's,
        // so each operand's block lies inside what the caller guarantees readable
        // and the output block inside what it guarantees writable; blocks of
        // different parts are disjoint.
        unsafe { T::gemm(kernel, mkn, a, b, c.block(offset), rsc) };
    };
    tessera_mesh::parallel_for(parts, part);
}

/// The output's base pointer, shared by the threads that write its disjoint blocks.
#[derive(Clone, Copy)]
struct OutPtr<T>(*mut T);

impl<T> OutPtr<T> {
    /// The element `offset` past the base (a method, so closures capture the
    /// whole `Send` wrapper rather than its raw-pointer field).
    ///
    /// # Safety
    /// `offset` must be inside the output's allocation.
    unsafe fn block(self, offset: usize) -> *mut T {
        // SAFETY: the caller keeps `offset` inside the allocation.
        unsafe { self.0.add(offset) }
    }
}

// SAFETY: each thread writes only its own blocks (disjoint), and
// `parallel_for` returns before the output is read or freed.
unsafe impl<T> Send for OutPtr<T> {}
// SAFETY: as for Send: shared only to compute disjoint block addresses.
unsafe impl<T> Sync for OutPtr<T> {}

/// `a · b` for rank >= 2 operands of a GEMM type, shapes already checked.
fn matmul_typed<T: Gemm>(a: &Tensor, b: &Tensor, batch: &[usize], kernel: GemmKernel) -> Result<Tensor> {
    let (ra, rb) = (a.rank(), b.rank());
    let (m, k, n) = (a.shape()[ra - 2], a.shape()[ra - 1], b.shape()[rb - 1]);
    let mut shape = batch.to_vec();
    shape.extend([m, n]);
    // Small operands can make a product too large for memory ([m, 1] × [1, n]).
    let len = crate::alloc::checked_len("matmul", &shape, T::DTYPE)?;
    if len == 0 || k == 0 {
        return output(crate::alloc::zeroed::<T>("matmul", &shape)?, &shape);
    }
    // Non-zero and checked above, so neither product overflows.
    let count: usize = batch.iter().product();
    // The GEMM overwrites every output element without reading it, so the
    // output is not zeroed first (a memset as long as the product's write).
    let mut out = crate::alloc::with_capacity::<T>("matmul", &shape)?;
    let (av, bv) = (a.view::<T>()?, b.view::<T>()?);
    let mat = |ptr: *const T, t: &Tensor, r: usize| Mat {
        ptr,
        rs: t.strides()[r - 2] as isize,
        cs: t.strides()[r - 1] as isize,
    };
    let (am, bm) = (mat(av.as_ptr(), a, ra), mat(bv.as_ptr(), b, rb));
    let c = OutPtr(out.as_mut_ptr());
    // One tall GEMM when `b` is one matrix and `a`'s batch folds into its rows
    // (a linear layer on [batch, seq, features]).
    let b_single = b.shape()[..rb - 2].iter().all(|&d| d == 1);
    if b_single && rows_fold(a, ra - 2) {
        // SAFETY: `a` folds to a (count·m)×k matrix of row stride `am.rs` inside
        // its storage (checked by `rows_fold`; views keep the storage borrowed);
        // `b` is one k×n matrix; `out` has capacity for count·m rows of n elements.
        unsafe {
            gemm_split(kernel, [count * m, k, n], am, bm, c, n as isize);
            // SAFETY: the GEMM wrote all count·m·n elements (m, n, k > 0, beta = 0).
            out.set_len(len);
        }
        return output(out, &shape);
    }
    // Offsets of each batch entry, with size-1 (broadcast) dims fixed at 0.
    let offset = |t: &Tensor, r: usize, index: &[usize]| -> isize {
        let lead = batch.len() - (r - 2);
        (0..r - 2)
            .map(|d| {
                if t.shape()[d] == 1 {
                    0
                } else {
                    index[lead + d] * t.strides()[d]
                }
            })
            .sum::<usize>() as isize
    };
    // Batch entries `range`, one GEMM each, on the calling thread.
    let entries = |range: std::ops::Range<usize>| {
        let mut index = unravel(range.start, batch);
        for i in range {
            let (mut ai, mut bi) = (am, bm);
            ai.ptr = av.as_ptr().wrapping_offset(offset(a, ra, &index));
            bi.ptr = bv.as_ptr().wrapping_offset(offset(b, rb, &index));
            // SAFETY: `index` is inside `batch`, so every element each operand's
            // strides reach from its batch offset is an element of that tensor,
            // inside its borrowed storage; the output block `i` is m×n inside the
            // capacity of `out`, disjoint from the operands (fresh allocation) and
            // from every other entry's block.
            unsafe { gemm_split(kernel, [m, k, n], ai, bi, OutPtr(c.block(i * m * n)), n as isize) };
            for d in (0..batch.len()).rev() {
                index[d] += 1;
                if index[d] < batch[d] {
                    break;
                }
                index[d] = 0;
            }
        }
    };
    // Entries too small to split one by one (attention's per-head products) are
    // split among the rank's threads in contiguous runs.
    let parts = batch_threads(tessera_mesh::intra_op_threads(), count, [m, k, n]);
    let per = count.div_ceil(parts);
    tessera_mesh::parallel_for(parts, |p| entries(p * per..((p + 1) * per).min(count)));
    // SAFETY: the entries wrote the m×n block of each of the `count` batch
    // entries, every element of the `len` reserved.
    unsafe { out.set_len(len) };
    output(out, &shape)
}

impl Tensor {
    /// The matrix product with PyTorch's `torch.matmul` rules: `[m, k] × [k, n]
    /// → [m, n]`; batched `[..., m, k] × [..., k, n]` with the batch dims
    /// broadcast (`[2, 1, m, k] × [3, k, n] → [2, 3, m, n]`); a 1-D operand is
    /// a vector (its dim is removed from the result). Transposed and narrowed
    /// views are read in place through their strides. Runs the
    /// [`GemmKernel::auto`] kernel on the calling thread.
    ///
    /// `f32` and `f64` use the GEMM directly; `bf16` and `f16` products are the
    /// `f32` GEMM of the widened operands, rounded once per output element,
    /// with the conversions fused into the product (operands widened a panel
    /// at a time into per-thread scratch, output panels rounded while they are
    /// in cache) instead of `f32` copies of the operands and the product.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] naming both shapes when the inner dims differ
    /// or the batch dims do not broadcast; [`Error::DTypeMismatch`] for
    /// different dtypes; [`Error::InvalidArgument`] for rank-0 or integer tensors;
    /// [`Error::OutOfMemory`] when the product cannot be allocated.
    pub fn matmul(&self, rhs: &Tensor) -> Result<Tensor> {
        self.matmul_with(rhs, GemmKernel::auto())
    }

    /// [`matmul`](Self::matmul) with a chosen GEMM kernel (for benchmarks and
    /// for comparing kernels).
    ///
    /// # Errors
    /// As [`matmul`](Self::matmul).
    pub fn matmul_with(&self, rhs: &Tensor, kernel: GemmKernel) -> Result<Tensor> {
        same_dtype("matmul", self, rhs)?;
        if self.rank() == 0 || rhs.rank() == 0 {
            return Err(Error::InvalidArgument {
                op: "matmul",
                detail: format!(
                    "cannot multiply {:?} by {:?}: both operands need at least one dim; use mul for scalars",
                    self.shape(),
                    rhs.shape()
                ),
            });
        }
        // Vectors become matrices: [k] is [1, k] on the left and [k, 1] on the right.
        let a = if self.rank() == 1 {
            self.reshape(&[1, self.numel()])?
        } else {
            self.clone()
        };
        let b = if rhs.rank() == 1 {
            rhs.reshape(&[rhs.numel(), 1])?
        } else {
            rhs.clone()
        };
        let (ra, rb) = (a.rank(), b.rank());
        let (ka, kb) = (a.shape()[ra - 1], b.shape()[rb - 2]);
        if ka != kb {
            return Err(mismatch(self, rhs, format!("inner dims {ka} and {kb} differ")));
        }
        let batch = broadcast_shapes("matmul", &a.shape()[..ra - 2], &b.shape()[..rb - 2]).map_err(|_| {
            let why = format!(
                "batch dims {:?} and {:?} do not broadcast",
                &a.shape()[..ra - 2],
                &b.shape()[..rb - 2]
            );
            mismatch(self, rhs, why)
        })?;
        let out = match self.dtype() {
            DType::F32 => matmul_typed::<f32>(&a, &b, &batch, kernel)?,
            DType::F64 => matmul_typed::<f64>(&a, &b, &batch, kernel)?,
            DType::BF16 => matmul_typed::<bf16>(&a, &b, &batch, kernel)?,
            DType::F16 => matmul_typed::<f16>(&a, &b, &batch, kernel)?,
            other => return Err(not_float("matmul", other)),
        };
        // Drop the dims that the vectors' promotion added.
        let mut shape = out.shape().to_vec();
        if rhs.rank() == 1 {
            shape.pop();
        }
        if self.rank() == 1 {
            shape.remove(shape.len() - if rhs.rank() == 1 { 1 } else { 2 });
        }
        if shape.len() == out.rank() {
            Ok(out)
        } else {
            out.reshape(&shape)
        }
    }
}

#[cfg(test)]
mod tests {
    use tessera_mesh::DType;

    use super::*;
    use crate::ops::testutil::{assert_close, sample, tol};

    #[test]
    fn large_products_split_over_the_ranks_threads() {
        let rows = |block, parts| Split {
            by_rows: true,
            block,
            parts,
        };
        assert_eq!(split(2, [1024, 256, 256]), rows(512, 2));
        assert_eq!(split(3, [1000, 256, 256]), rows(336, 3), "blocks of whole tiles");
        assert_eq!(
            split(2, [256, 1024, 4096]),
            Split {
                by_rows: false,
                block: 2048,
                parts: 2
            },
            "wide: by columns"
        );
        assert_eq!(split(1, [1024, 256, 256]).parts, 1, "one thread");
        assert_eq!(split(2, [16, 16, 16]).parts, 1, "too small");
        assert_eq!(split(8, [40, 100_000, 8]), rows(16, 3), "no block under a tile");
    }

    #[test]
    fn small_batched_products_split_by_entry() {
        // Attention's per-head products: 64 entries of 1 MFLOP.
        assert_eq!(batch_threads(2, 64, [128, 32, 128]), 2);
        assert_eq!(batch_threads(1, 64, [128, 32, 128]), 1, "one thread");
        assert_eq!(batch_threads(4, 3, [256, 32, 256]), 3, "no more threads than entries");
        assert_eq!(batch_threads(2, 4, [8, 8, 8]), 1, "too little work in all");
        assert_eq!(batch_threads(2, 4, [1024, 256, 256]), 1, "each entry splits itself");
    }

    #[test]
    fn a_split_batch_equals_the_single_threaded_one() {
        let (a, b) = (
            sample(&[4, 64, 64, 32], DType::F32, 13),
            sample(&[64, 32, 64], DType::F32, 14),
        );
        assert_eq!(batch_threads(2, 256, [64, 32, 64]), 2, "the case must split");
        let product = |threads: usize| {
            let (a, b) = (a.clone(), b.clone());
            let opts = tessera_mesh::LaunchOptions::default().threads_per_rank(threads);
            tessera_mesh::launch_with(&opts, 1, move |_| Ok(a.matmul(&b)?)).unwrap()
        };
        let (one, two) = (product(1), product(2));
        assert_eq!(one[0].to_f64_vec(), two[0].to_f64_vec());
        let (shape, want) = reference(&a, &b);
        assert_eq!(two[0].shape(), &shape[..]);
        assert_close(&two[0], &want, 1e-5, "split batch (f32 sums of 32 products)");
    }

    #[test]
    fn a_split_product_equals_the_single_threaded_one() {
        // By rows, by columns, and by rows of an uneven last block.
        for (sa, sb) in [
            ([512, 256], [256, 384]),
            ([96, 256], [256, 1024]),
            ([520, 192], [192, 200]),
        ] {
            let (a, b) = (sample(&sa, DType::F32, 11), sample(&sb, DType::F32, 12));
            assert!(split(3, [sa[0], sa[1], sb[1]]).parts > 1, "{sa:?} x {sb:?} must split");
            for kernel in [GemmKernel::Gemm, GemmKernel::MatrixMultiply] {
                let product = |threads: usize| {
                    let (a, b) = (a.clone(), b.clone());
                    let opts = tessera_mesh::LaunchOptions::default().threads_per_rank(threads);
                    tessera_mesh::launch_with(&opts, 1, move |_| Ok(a.matmul_with(&b, kernel)?)).unwrap()
                };
                let (one, three) = (product(1), product(3));
                assert_eq!(
                    one[0].to_f64_vec(),
                    three[0].to_f64_vec(),
                    "{sa:?} x {sb:?} {kernel:?}: each output element sums in the same order"
                );
                let (_, want) = reference(&a, &b);
                assert_close(&three[0], &want, 4.0 * sa[1] as f64 * tol(DType::F32), "split product");
            }
        }
    }

    /// The half-precision product as the f32 GEMM of the widened operands,
    /// rounded once: what the fused path must equal bit for bit.
    fn widened_product(a: &Tensor, b: &Tensor, kernel: GemmKernel) -> Vec<f64> {
        let (a32, b32) = (a.cast(DType::F32).unwrap(), b.cast(DType::F32).unwrap());
        let p = a32.matmul_with(&b32, kernel).unwrap().cast(a.dtype()).unwrap();
        p.to_f64_vec()
    }

    #[test]
    fn half_products_round_the_f32_product_once() {
        // Panels by columns (n >= m) and by rows, one panel and several (an
        // uneven last one: the f32 panel holds 2^18 elements), row-major,
        // transposed, narrowed, strided and batched operands.
        let t = |shape: &[usize], dtype, seed| sample(shape, dtype, seed).transpose(0, 1).unwrap();
        for dtype in [DType::BF16, DType::F16] {
            let cases: Vec<(Tensor, Tensor)> = vec![
                (sample(&[64, 48], dtype, 1), sample(&[48, 96], dtype, 2)),
                (sample(&[96, 48], dtype, 1), t(&[40, 48], dtype, 2)),
                (sample(&[200, 64], dtype, 3), t(&[2100, 64], dtype, 4)),
                (t(&[72, 2100], dtype, 5), sample(&[72, 200], dtype, 6)),
                (
                    sample(&[40, 80], dtype, 7).narrow(1, 8, 64).unwrap(),
                    sample(&[64, 30], dtype, 8),
                ),
                // Neither stride 1: rows 2 apart, columns 100 apart.
                (
                    sample(&[64, 50, 2], dtype, 9)
                        .narrow(2, 0, 1)
                        .unwrap()
                        .permute(&[2, 1, 0])
                        .unwrap(),
                    sample(&[64, 30], dtype, 10),
                ),
                (sample(&[3, 33, 17], dtype, 11), t(&[40, 17], dtype, 12)),
                (sample(&[4, 128, 32], dtype, 13), sample(&[4, 32, 128], dtype, 14)),
            ];
            for (a, b) in &cases {
                let [m, n] = [a.shape()[a.rank() - 2], b.shape()[b.rank() - 1]];
                let long_panels = (HALF_PANEL_BYTES / 4 / m.min(n)).next_multiple_of(SPLIT_ALIGN);
                let what = format!(
                    "{:?} x {:?} {dtype} ({} panels)",
                    a.shape(),
                    b.shape(),
                    m.max(n).div_ceil(long_panels)
                );
                for kernel in [GemmKernel::Gemm, GemmKernel::MatrixMultiply] {
                    let got = a.matmul_with(b, kernel).unwrap();
                    assert_eq!(got.dtype(), dtype, "{what}");
                    assert_eq!(got.to_f64_vec(), widened_product(a, b, kernel), "{what} {kernel:?}");
                }
            }
        }
    }

    #[test]
    fn half_products_split_over_threads_equal_the_single_threaded_one() {
        let (a, b) = (
            sample(&[520, 192], DType::BF16, 21),
            sample(&[200, 192], DType::BF16, 22),
        );
        let b = b.transpose(0, 1).unwrap();
        assert!(split(2, [520, 192, 200]).parts > 1, "the case must split");
        let product = |threads: usize| {
            let (a, b) = (a.clone(), b.clone());
            let opts = tessera_mesh::LaunchOptions::default().threads_per_rank(threads);
            tessera_mesh::launch_with(&opts, 1, move |_| Ok(a.matmul(&b)?)).unwrap()
        };
        let two = product(2);
        assert_eq!(product(1)[0].to_f64_vec(), two[0].to_f64_vec());
        assert_eq!(two[0].to_f64_vec(), widened_product(&a, &b, GemmKernel::auto()));
    }

    #[test]
    fn half_product_scratch_is_kept_only_up_to_its_cap() {
        let scratch = || HALF_SCRATCH.with(|s| s.borrow().iter().map(|v| v.capacity() * 4).collect::<Vec<_>>());
        // Run on a fresh thread so other tests' products do not count.
        std::thread::spawn(move || {
            let (a, b) = (sample(&[64, 64], DType::BF16, 1), sample(&[64, 64], DType::BF16, 2));
            a.matmul(&b).unwrap();
            let kept = scratch();
            assert!(
                kept.iter().all(|&c| c > 0),
                "a small product's scratch is kept for the next: {kept:?}"
            );
            // A widened operand of 4096 x 2304 f32 (36 MiB) is over the cap.
            let (a, b) = (
                sample(&[4096, 2304], DType::BF16, 3),
                sample(&[2304, 16], DType::BF16, 4),
            );
            a.matmul(&b).unwrap();
            let kept = scratch();
            assert!(
                kept.iter().all(|&c| c <= HALF_SCRATCH_KEEP),
                "scratch over the cap is freed: {kept:?}"
            );
            assert!(kept[2] > 0, "the output panel, under the cap, is kept");
        })
        .join()
        .unwrap();
    }

    /// The naive product in f64 with torch.matmul's shape rules.
    fn reference(a: &Tensor, b: &Tensor) -> (Vec<usize>, Vec<f64>) {
        let promote = |t: &Tensor, left: bool| match (t.rank(), left) {
            (1, true) => vec![1, t.numel()],
            (1, false) => vec![t.numel(), 1],
            _ => t.shape().to_vec(),
        };
        let (sa, sb) = (promote(a, true), promote(b, false));
        let (ra, rb) = (sa.len(), sb.len());
        let (m, k, n) = (sa[ra - 2], sa[ra - 1], sb[rb - 1]);
        let batch = broadcast_shapes("t", &sa[..ra - 2], &sb[..rb - 2]).unwrap();
        let (x, y) = (a.to_f64_vec(), b.to_f64_vec());
        let count: usize = batch.iter().product();
        let mut out = Vec::new();
        let base = |s: &[usize], bi: usize| {
            // Offset of batch entry `bi` of `batch` in a tensor with batch dims `s`.
            let (mut rest, mut off, mut stride) = (bi, 0, 1);
            for d in (0..batch.len()).rev() {
                let i = rest % batch[d];
                rest /= batch[d];
                let lead = batch.len() - s.len();
                if d >= lead {
                    let size = s[d - lead];
                    off += if size == 1 { 0 } else { i * stride };
                    stride *= size;
                }
            }
            off
        };
        for bi in 0..count {
            let (oa, ob) = (base(&sa[..ra - 2], bi) * m * k, base(&sb[..rb - 2], bi) * k * n);
            for i in 0..m {
                for j in 0..n {
                    out.push((0..k).map(|l| x[oa + i * k + l] * y[ob + l * n + j]).sum());
                }
            }
        }
        let mut shape = batch;
        if a.rank() > 1 {
            shape.push(m);
        }
        if b.rank() > 1 {
            shape.push(n);
        }
        (shape, out)
    }

    #[test]
    fn matmul_table() {
        macro_rules! case {
            ($a:expr, $b:expr, $shape:expr) => {
                for dtype in [DType::F32, DType::F64, DType::BF16, DType::F16] {
                    let (a, b): (Tensor, Tensor) = ($a(dtype), $b(dtype));
                    let (shape, want) = reference(&a, &b);
                    assert_eq!(shape, $shape);
                    for kernel in [GemmKernel::Gemm, GemmKernel::MatrixMultiply] {
                        let got = a.matmul_with(&b, kernel).unwrap();
                        let what = format!("{:?} x {:?} {dtype} {kernel:?}", a.shape(), b.shape());
                        assert_eq!(got.shape(), &shape[..], "{what}");
                        assert_eq!(got.dtype(), dtype);
                        // Sums of k products: allow a few roundings per term.
                        let k = a.shape()[a.rank() - 1].max(1) as f64;
                        assert_close(&got, &want, 4.0 * k * tol(dtype), &what);
                    }
                    assert_eq!(a.matmul(&b).unwrap().shape(), &shape[..]);
                }
            };
        }
        let s = |shape: &'static [usize], seed| move |d| sample(shape, d, seed);
        let t = |shape: &'static [usize], seed| move |d| sample(shape, d, seed).transpose(0, 1).unwrap();
        case!(s(&[2, 3], 1), s(&[3, 4], 2), vec![2, 4]);
        case!(s(&[1, 1], 1), s(&[1, 1], 2), vec![1, 1]);
        case!(s(&[17, 33], 1), s(&[33, 9], 2), vec![17, 9]);
        case!(t(&[3, 2], 1), s(&[3, 4], 2), vec![2, 4]);
        case!(s(&[2, 3], 1), t(&[4, 3], 2), vec![2, 4]);
        case!(t(&[3, 2], 1), t(&[4, 3], 2), vec![2, 4]);
        case!(s(&[2, 3, 4], 1), s(&[2, 4, 5], 2), vec![2, 3, 5]);
        case!(s(&[2, 1, 3, 4], 1), s(&[3, 4, 5], 2), vec![2, 3, 3, 5]);
        case!(s(&[5, 3, 4], 1), s(&[4, 2], 2), vec![5, 3, 2]);
        case!(s(&[2, 5, 3, 4], 1), t(&[2, 4], 2), vec![2, 5, 3, 2]);
        case!(s(&[3, 4], 1), s(&[2, 4, 5], 2), vec![2, 3, 5]);
        case!(s(&[4], 1), s(&[4, 3], 2), vec![3]);
        case!(s(&[3, 4], 1), s(&[4], 2), vec![3]);
        case!(s(&[4], 1), s(&[4], 2), Vec::<usize>::new());
        case!(s(&[4], 1), s(&[2, 4, 3], 2), vec![2, 3]);
        case!(s(&[2, 3, 4], 1), s(&[4], 2), vec![2, 3]);
        // Batched transposes (attention's q·kᵀ) and narrowed views.
        let kt = |d| sample(&[2, 5, 4], d, 3).transpose(1, 2).unwrap();
        case!(s(&[2, 3, 4], 1), kt, vec![2, 3, 5]);
        let qn = |d| sample(&[2, 3, 8], d, 4).narrow(2, 2, 4).unwrap();
        case!(qn, kt, vec![2, 3, 5]);
        let rows = |d| sample(&[4, 6, 4], d, 5).narrow(1, 1, 3).unwrap();
        case!(rows, s(&[4, 2], 2), vec![4, 3, 2]);
        let perm = |d| sample(&[3, 2, 4], d, 6).permute(&[1, 0, 2]).unwrap();
        case!(perm, s(&[4, 5], 2), vec![2, 3, 5]);
        // Empty dims.
        case!(s(&[2, 0], 1), s(&[0, 3], 2), vec![2, 3]);
        case!(s(&[0, 3], 1), s(&[3, 2], 2), vec![0, 2]);
        case!(s(&[2, 3], 1), s(&[3, 0], 2), vec![2, 0]);
        case!(s(&[0, 2, 3], 1), s(&[3, 2], 2), vec![0, 2, 2]);
    }

    /// The output is not zeroed before the GEMM writes it: with the allocator
    /// handing back blocks just filled with NaN, every path (one tall GEMM,
    /// per-batch GEMMs, broadcast batches, vectors, both kernels) still gives
    /// the reference product.
    #[test]
    fn matmul_writes_every_output_element() {
        let cases: [(&[usize], &[usize]); 6] = [
            (&[17, 33], &[33, 9]),
            (&[3, 5, 7], &[7, 11]),
            (&[3, 5, 7], &[3, 7, 11]),
            (&[2, 1, 5, 3], &[4, 3, 6]),
            (&[1, 64], &[64, 1]),
            (&[65, 2], &[2, 130]),
        ];
        for (sa, sb) in cases {
            for dtype in [DType::F32, DType::F64] {
                let (a, b) = (sample(sa, dtype, 7), sample(sb, dtype, 8));
                let (shape, want) = reference(&a, &b);
                for kernel in [GemmKernel::Gemm, GemmKernel::MatrixMultiply] {
                    for _ in 0..3 {
                        drop(std::hint::black_box(vec![f64::NAN; want.len()]));
                        drop(std::hint::black_box(vec![f32::NAN; want.len()]));
                        let got = a.matmul_with(&b, kernel).unwrap();
                        assert_eq!(got.shape(), &shape[..]);
                        let what = format!("{sa:?} x {sb:?} {dtype} {kernel:?}");
                        assert_close(&got, &want, 4.0 * sa[sa.len() - 1] as f64 * tol(dtype), &what);
                    }
                }
            }
        }
    }

    #[test]
    fn matmul_known_product() {
        let a = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]).unwrap();
        let b = Tensor::from_vec(vec![7.0f32, 8.0, 9.0, 10.0, 11.0, 12.0], &[3, 2]).unwrap();
        for kernel in [GemmKernel::Gemm, GemmKernel::MatrixMultiply] {
            let c = a.matmul_with(&b, kernel).unwrap();
            assert_eq!(c.to_vec::<f32>().unwrap(), vec![58.0, 64.0, 139.0, 154.0]);
        }
        let zero = Tensor::zeros(&[2, 0], DType::F64)
            .unwrap()
            .matmul(&Tensor::zeros(&[0, 2], DType::F64).unwrap());
        assert_eq!(zero.unwrap().to_vec::<f64>().unwrap(), vec![0.0; 4]);
    }

    #[test]
    fn matmul_errors() {
        macro_rules! case {
            ($res:expr, $msg:expr) => {
                assert_eq!($res.unwrap_err().to_string(), $msg);
            };
        }
        let f = |shape: &[usize]| sample(shape, DType::F32, 1);
        case!(
            f(&[2, 3]).matmul(&f(&[4, 5])),
            "matmul: shape mismatch: cannot multiply [2, 3] by [4, 5]: inner dims 3 and 4 differ"
        );
        case!(
            f(&[2, 2, 3]).matmul(&f(&[3, 3, 4])),
            "matmul: shape mismatch: cannot multiply [2, 2, 3] by [3, 3, 4]: batch dims [2] and [3] do not broadcast"
        );
        case!(
            f(&[3]).matmul(&f(&[4])),
            "matmul: shape mismatch: cannot multiply [3] by [4]: inner dims 3 and 4 differ"
        );
        case!(
            f(&[]).matmul(&f(&[2])),
            "matmul: cannot multiply [] by [2]: both operands need at least one dim; use mul for scalars"
        );
        case!(
            f(&[2, 2]).matmul(&sample(&[2, 2], DType::F64, 1)),
            "matmul: expected dtype f32, got f64"
        );
        let i = Tensor::zeros(&[2, 2], DType::I64).unwrap();
        case!(
            i.matmul(&i),
            "matmul: dtype i64 is not a floating-point type; cast the tensor to a float dtype first"
        );
    }
}
