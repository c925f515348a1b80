//! Matrix multiplication: 2-D, batched with broadcast batch dims, strided operands.

use half::{bf16, f16};
use tessera_mesh::DType;

use super::elementwise::broadcast_shapes;
use super::{output, same_dtype};
use crate::kernel::{Float, not_float, unravel};
use crate::{Error, Result, Tensor};

#[cfg(target_arch = "x86_64")]
pub(super) mod bf16_dot;
mod half_gemm;
#[cfg(target_arch = "x86_64")]
mod outer;
#[cfg(target_arch = "x86_64")]
mod small;
mod transpose;

/// The GEMM that runs [`Tensor::matmul`].
///
/// Both take arbitrary strides, so transposed and narrowed views multiply
/// without a copy. Measured by `examples/bench_gemm` on the project's machine
/// (Xeon with AVX-512, one thread, f32, square 512 to 2048): `gemm` with its
/// AVX-512 kernels reaches about 165 GFLOP/s against `matrixmultiply`'s 130;
/// with AVX2/FMA only, `gemm` reaches 95, so [`auto`](Self::auto) picks
/// `matrixmultiply` on CPUs without AVX-512 when the rank has one thread.
///
/// A product of at least 2²³ flops (`2·m·k·n`) is split into blocks of output
/// rows (or columns), one per [`intra_op_threads`](tessera_mesh::intra_op_threads),
/// each block one call of the kernel on the rank's team
/// ([`parallel_for`](tessera_mesh::parallel_for)).
///
/// `bf16` products run [`Bf16Dot`](Self::Bf16Dot) where the CPU has the bf16
/// dot-product instructions ([`auto_for`](Self::auto_for)); `f32` kernels
/// multiply `bf16` and `f16` operands widened to `f32`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GemmKernel {
    /// The `gemm` crate (pure Rust; runtime-detected AVX-512 or AVX2/FMA
    /// kernels).
    Gemm,
    /// The `matrixmultiply` crate (pure Rust; AVX2/FMA kernels), which
    /// ndarray's `dot` uses.
    MatrixMultiply,
    /// `bf16` operands only, on CPUs with AVX512_BF16: the `VDPBF16PS`
    /// instruction multiplies pairs of `bf16` elements and adds them to `f32`
    /// sums, twice the multiply-adds per instruction of the `f32` kernels
    /// (about 1.9x their speed, `examples/bench_gemm`). Each output is its
    /// `f32` sum rounded once, as with the widened kernels; the sums run in
    /// another order, and `bf16` subnormal inputs (below 2⁻¹²⁶) count as zero.
    ///
    /// PyTorch: oneDNN's bf16 GEMM on the same instructions (`torch.matmul`
    /// on `bfloat16` CPU tensors).
    Bf16Dot,
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

    /// The kernel that [`Tensor::matmul`] runs for operands of `dtype`:
    /// [`Bf16Dot`](Self::Bf16Dot) for `bf16` where the CPU has AVX512_BF16
    /// (detected at run time) unless the environment sets
    /// `TESSERA_BF16_DOT=0`, [`auto`](Self::auto) otherwise.
    ///
    /// PyTorch: the CPU capability dispatch (`ATEN_CPU_CAPABILITY` overrides it).
    pub fn auto_for(dtype: DType) -> GemmKernel {
        static ALLOWED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        let allowed = || *ALLOWED.get_or_init(|| tessera_mesh::vars::flag_or("TESSERA_BF16_DOT", true));
        if dtype == DType::BF16 && GemmKernel::bf16_dot_detected() && allowed() {
            return GemmKernel::Bf16Dot;
        }
        GemmKernel::auto()
    }

    /// Whether this CPU runs [`Bf16Dot`](Self::Bf16Dot) (AVX-512F and
    /// AVX512_BF16, detected once).
    pub fn bf16_dot_detected() -> bool {
        #[cfg(target_arch = "x86_64")]
        return bf16_dot::detected();
        #[cfg(not(target_arch = "x86_64"))]
        return false;
    }

    /// An error when this kernel cannot multiply `dtype` on this CPU.
    fn check(self, dtype: DType) -> Result<()> {
        if self != GemmKernel::Bf16Dot {
            return Ok(());
        }
        let why = if dtype != DType::BF16 {
            format!("it multiplies bf16 operands, not {dtype}")
        } else if !GemmKernel::bf16_dot_detected() {
            "this CPU lacks the AVX512_BF16 instructions it runs on".to_string()
        } else {
            return Ok(());
        };
        Err(Error::InvalidArgument {
            op: "matmul",
            detail: format!("cannot use GemmKernel::Bf16Dot: {why}; use GemmKernel::auto_for"),
        })
    }
}

/// Which part of a causal attention product [`Tensor::matmul_causal`]
/// computes, for queries `i` that see keys `j <= i` (the top-left aligned mask
/// of [`Tensor::causal_mask`]). The parts skip the products that the mask makes
/// zero or unused: about half of each of attention's six products.
///
/// PyTorch: the block skipping inside `scaled_dot_product_attention(...,
/// is_causal=True)`'s fused CPU kernels (`_scaled_dot_product_flash_attention_for_cpu`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Causal {
    /// Every element: the dense product, as [`Tensor::matmul`].
    Dense,
    /// Scores (`q·kᵀ`, and `dO·vᵀ` in the backward), `[..., T, S]`: the
    /// elements `[i, j]` with `j <= i` are the product's, the others zero.
    Scores,
    /// Weights times values (`p·v`, and `dS·k` in the backward): the left
    /// operand `[..., T, S]` must be zero at `[i, j]` for `j > i` (attention's
    /// weights and their gradients are), and most of those elements are not
    /// read (all but the few in a tile that crosses the diagonal).
    Weights,
    /// Transposed weights times gradients (`pᵀ·dO`, `dSᵀ·q`): the left operand
    /// `[..., S, T]` must be zero at `[j, i]` for `i < j`, and most of those
    /// elements are not read.
    WeightsTransposed,
}

/// The smallest product (`2·m·k·n` flops) that is split over the rank's
/// threads: below it, handing out the parts costs more than they save.
pub(super) const PARALLEL_MIN_FLOPS: usize = 1 << 23;

/// Rows (or columns) per block of a split product are a multiple of this, the
/// height of the `gemm` crate's AVX-512 f32 micro-kernel tile, so no block ends
/// in a partial tile that a whole product would not have.
const SPLIT_ALIGN: usize = 16;

/// Flops of `entries` products `m×k · k×n`.
fn flops(entries: usize, [m, k, n]: [usize; 3]) -> u128 {
    2 * entries as u128 * m as u128 * k as u128 * n as u128
}

/// Flops of the causal `part` of `entries` products `m×k · k×n`: the
/// multiply-adds of the pairs (query `i`, key `j <= i`) the mask keeps, times
/// the dim they run along (a tile crossing the diagonal computes a few more).
pub(crate) fn part_flops(entries: usize, part: Causal, [m, k, n]: [usize; 3]) -> u128 {
    // Pairs `j <= i` of `t` queries and `s` keys.
    let kept = |t: usize, s: usize| -> u128 {
        let (t, s) = (t as u128, s as u128);
        let d = t.min(s);
        d * (d + 1) / 2 + (t - d) * s
    };
    let pairs_times_dim = match part {
        Causal::Dense => return flops(entries, [m, k, n]),
        Causal::Scores => kept(m, n) * k as u128,
        Causal::Weights => kept(m, k) * n as u128,
        Causal::WeightsTransposed => kept(k, m) * n as u128,
    };
    2 * entries as u128 * pairs_times_dim
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
    let block = if threads <= 1 || flops(1, [m, k, n]) < PARALLEL_MIN_FLOPS as u128 || len < 2 * SPLIT_ALIGN {
        len
    } else {
        len.div_ceil(threads).next_multiple_of(SPLIT_ALIGN)
    };
    let block = if by_rows { block } else { block.min(MAX_BLOCK_COLUMNS) };
    Split {
        by_rows,
        block,
        parts: len.div_ceil(block),
    }
}

/// The widest block of columns one call of the kernel computes: a wider
/// product (an output head over a vocabulary) runs in blocks of this many
/// columns, on one thread as on several. The `gemm` crate allocates its
/// packed operands per call, sized by the block; past a few MiB the system
/// allocator maps them fresh each time: on the large config (FSDP on 2
/// ranks, a 32,000-column head) blocks took a steady-state step from 4,755
/// minor page faults to about 500. A multiple of [`SPLIT_ALIGN`].
const MAX_BLOCK_COLUMNS: usize = 4096;

/// One strided matrix operand: base pointer and (row, column) strides.
#[derive(Clone, Copy)]
pub(super) struct Mat<T> {
    pub(super) ptr: *const T,
    pub(super) rs: isize,
    pub(super) cs: isize,
}

impl<T> Mat<T> {
    /// The same operand read as elements of `U` (a concrete type behind a
    /// generic one, or a float's bits), strides unchanged.
    pub(super) fn cast<U>(self) -> Mat<U> {
        Mat {
            ptr: self.ptr.cast(),
            rs: self.rs,
            cs: self.cs,
        }
    }
}

/// Element types with a native GEMM: `c = a · b` (c overwritten, never read).
pub(super) trait Gemm: Float {
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
                        // `Bf16Dot` is refused for other dtypes before any product
                        // (`GemmKernel::check`); the widened half products pass
                        // their f32 kernel, never it.
                        GemmKernel::Gemm | GemmKernel::Bf16Dot => gemm::gemm(
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
        #[cfg(target_arch = "x86_64")]
        if outer_takes(kernel, mkn, a, b) {
            // SAFETY: `T` is `f32` (`outer_takes`); as for the kernel below.
            unsafe { outer::product(mkn, a.cast(), b.cast(), c.block(offset).cast(), rsc) };
            return;
        }
        // SAFETY: the block's rows (columns) are a sub-range of the product's,
        // so each operand's block lies inside what the caller guarantees readable
        // and the output block inside what it guarantees writable; blocks of
        // different parts are disjoint.
        unsafe { T::gemm(kernel, mkn, a, b, c.block(offset), rsc) };
    };
    tessera_mesh::parallel_for(parts, part);
}

/// Whether the outer-product kernel (`outer.rs`) runs this product: `f32` on
/// the `gemm` kernel, in a layout and size it [`fits`](outer::fits).
fn outer_takes<T: Gemm>(kernel: GemmKernel, mkn: [usize; 3], a: Mat<T>, b: Mat<T>) -> bool {
    #[cfg(target_arch = "x86_64")]
    return T::DTYPE == DType::F32 && kernel == GemmKernel::Gemm && outer::fits(mkn, a.cast(), b.cast());
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (kernel, mkn, a, b);
        false
    }
}

/// The output's base pointer, shared by the threads that write its disjoint blocks.
#[derive(Clone, Copy)]
pub(super) struct OutPtr<T>(pub(super) *mut T);

impl<T> OutPtr<T> {
    /// The element `offset` past the base (a method, so closures capture the
    /// whole `Send` wrapper rather than its raw-pointer field).
    ///
    /// # Safety
    /// `offset` must be inside the output's allocation.
    pub(super) unsafe fn block(self, offset: usize) -> *mut T {
        // SAFETY: the caller keeps `offset` inside the allocation.
        unsafe { self.0.add(offset) }
    }
}

// SAFETY: each thread writes only its own blocks (disjoint), and
// `parallel_for` returns before the output is read or freed.
unsafe impl<T> Send for OutPtr<T> {}
// SAFETY: as for Send: shared only to compute disjoint block addresses.
unsafe impl<T> Sync for OutPtr<T> {}

/// Rows of the left operand from which an `f32` product by a transposed
/// right operand turns it over first ([`turned_rhs`]): below, the copy costs
/// more than the packing it saves.
const TURN_MIN_ROWS: usize = 64;

/// Where the outer-product kernel does not take the product (no AVX-512F):
/// a row-major copy of `b` when it is the transposed view of a row-major
/// matrix (a linear layer's `Wᵀ`: unit row stride) in an `f32` product of at
/// least [`TURN_MIN_ROWS`] rows on the `gemm` kernel, deeper than it is wide
/// (`k > n`: a layer that narrows, as an MLP's down projection), which the
/// kernel would otherwise pack element by element; `None` otherwise. A layer
/// as wide as deep or wider keeps the view: there the kernel reads it at its
/// own speed (within 1%, or faster: a `[256, 768]·[768, 32000]` output head
/// ran at 1.7× the time with the copy, `[1024, 256]·[256, 1024]` at 1.1×),
/// while narrowing layers gain (`[1024, 1024]·[1024, 256]` at 0.9× the view's
/// time, `[256, 3072]·[3072, 768]` at 0.72×). The copy ([`transpose`]) is
/// split in blocks of its rows over the rank's threads. The product's bits do
/// not change: the kernel packs both layouts into the same panels.
///
/// # Errors
/// [`Error::OutOfMemory`] when the copy cannot be allocated.
fn turned_rhs<T: Gemm>(
    kernel: GemmKernel,
    rows: usize,
    [k, n]: [usize; 2],
    b: Mat<T>,
) -> Result<Option<crate::alloc::Scratch<T>>> {
    let ld = b.cs as usize;
    if T::DTYPE != DType::F32
        || kernel != GemmKernel::Gemm
        || rows < TURN_MIN_ROWS
        || k <= n
        || b.rs != 1
        || b.cs < 1
        || ld < k
    {
        return Ok(None);
    }
    // SAFETY: `T` is `f32` (checked above), and the caller's view `b` reaches
    // elements `kk + j·ld` for `kk < k`, `j < n`: all of the slice, inside the
    // storage its tensor keeps borrowed.
    let src = unsafe { std::slice::from_raw_parts(b.ptr.cast::<f32>(), (n - 1) * ld + k) };
    // Rows of the copy (columns of `b`) in blocks over the rank's threads.
    let write = |dst: &mut [std::mem::MaybeUninit<f32>]| {
        crate::kernel::par_rows(dst, n, |start, block| {
            transpose::transpose(&src[start / n..], n, block.len() / n, ld, block);
        });
    };
    // SAFETY: `transpose` writes every element of its `k·n` output.
    let turned = unsafe { crate::alloc::written::<f32>("matmul", &[k, n], write)? };
    Ok(T::from_buffer(tessera_mesh::Buffer::F32(turned))
        .ok()
        .map(crate::alloc::Scratch::new))
}

/// One `m×k · k×n` product of a batch (or its [`Causal`] `part`): the small
/// `f32` kernel where it fits (`small`), the `bf16` dot-product kernel's part
/// for `bf16` ones on one thread, the `kernel` otherwise (dense, split over
/// the rank's threads when large); the zeros of [`Causal::Scores`] written
/// after.
///
/// # Safety
/// As [`gemm_split`].
pub(super) unsafe fn entry<T: Gemm>(
    kernel: GemmKernel,
    [m, k, n]: [usize; 3],
    a: Mat<T>,
    b: Mat<T>,
    c: OutPtr<T>,
    rsc: isize,
    part: Causal,
) {
    #[cfg(target_arch = "x86_64")]
    if T::DTYPE == DType::F32 && kernel == GemmKernel::Gemm && small::fits([m, k, n], b.cast()) {
        // SAFETY: `T` is `f32` (checked); the caller's guarantees.
        unsafe { small::product([m, k, n], a.cast(), b.cast(), c.0.cast(), rsc, part) };
        return;
    }
    // A causal part of a bf16 product on the dot-product kernel skips what
    // the part leaves out, when the product is not split over threads (an
    // attention head's are not: the heads are).
    #[cfg(target_arch = "x86_64")]
    let bf16_part = T::DTYPE == DType::BF16
        && kernel == GemmKernel::Bf16Dot
        && part != Causal::Dense
        && split(tessera_mesh::intra_op_threads(), [m, k, n]).parts == 1;
    #[cfg(not(target_arch = "x86_64"))]
    let bf16_part = false;
    if bf16_part {
        // SAFETY: `T` is `bf16` (checked) and the kernel was checked present
        // (`GemmKernel::check`); the caller's guarantees, and those of the
        // part (the left operand zero where it says).
        #[cfg(target_arch = "x86_64")]
        unsafe {
            bf16_dot::gemm_part([m, k, n], a.cast(), b.cast(), c.0.cast(), rsc, part)
        };
    } else {
        // SAFETY: the caller's guarantees.
        unsafe { gemm_split(kernel, [m, k, n], a, b, c, rsc) };
    }
    if part == Causal::Scores {
        // SAFETY: rows 0..m of the m×n output (caller).
        unsafe { zero_above_diagonal(c.0, 0..m, n, rsc) };
    }
}

/// Zeros the elements `[i, j]` with `j > i` of rows `rows` of a row-major
/// output with `n` columns and row stride `rsc` ([`Causal::Scores`]).
///
/// # Safety
/// Those rows' `n` elements must be writable.
unsafe fn zero_above_diagonal<T>(c: *mut T, rows: std::ops::Range<usize>, n: usize, rsc: isize) {
    for i in rows.start..rows.end.min(n.saturating_sub(1)) {
        // SAFETY: row i's columns i+1..n are inside the output (caller).
        unsafe { std::ptr::write_bytes(c.offset(i as isize * rsc).add(i + 1), 0, n - i - 1) };
    }
}

/// The element offset of batch entry `index` (an index into the output's batch
/// dims, which `t`'s batch dims end) in `t`, with size-1 (broadcast) dims fixed at 0.
fn batch_offset(t: &Tensor, index: &[usize]) -> isize {
    let r = t.rank();
    let lead = index.len() - (r - 2);
    (0..r - 2)
        .map(|d| {
            if t.shape()[d] == 1 {
                0
            } else {
                index[lead + d] * t.strides()[d]
            }
        })
        .sum::<usize>() as isize
}

/// Steps `index` to the next batch entry of `batch` in row-major order (back to
/// all zeros after the last).
fn next_index(index: &mut [usize], batch: &[usize]) {
    for d in (0..batch.len()).rev() {
        index[d] += 1;
        if index[d] < batch[d] {
            break;
        }
        index[d] = 0;
    }
}

/// `a · b` (or its causal `part`) for rank >= 2 operands of a GEMM type,
/// shapes already checked.
fn matmul_typed<T: Gemm>(a: &Tensor, b: &Tensor, batch: &[usize], kernel: GemmKernel, part: Causal) -> Result<Tensor> {
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
    crate::profile::add_flops_of(
        part_flops(count, part, [m, k, n]).try_into().unwrap_or(u64::MAX),
        T::DTYPE,
    );
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
    // (Not for a causal part: the mask starts over with each batch entry.)
    let b_single = b.shape()[..rb - 2].iter().all(|&d| d == 1);
    if part == Causal::Dense && b_single && rows_fold(a, ra - 2) {
        // The outer-product kernel packs a transposed weight itself, in cache.
        let turned = if outer_takes(kernel, [count * m, k, n], am, bm) {
            None
        } else {
            turned_rhs(kernel, count * m, [k, n], bm)?
        };
        let bm = turned.as_ref().map_or(bm, |t| Mat {
            ptr: t.as_ptr(),
            rs: n as isize,
            cs: 1,
        });
        // SAFETY: `a` folds to a (count·m)×k matrix of row stride `am.rs` inside
        // its storage (checked by `rows_fold`; views keep the storage borrowed);
        // `b` is one k×n matrix (or its row-major copy, alive until the product
        // returns); `out` has capacity for count·m rows of n elements.
        unsafe {
            gemm_split(kernel, [count * m, k, n], am, bm, c, n as isize);
            // SAFETY: the GEMM wrote all count·m·n elements (m, n, k > 0, beta = 0).
            out.set_len(len);
        }
        return output(out, &shape);
    }
    // Batch entries `range`, one GEMM each, on the calling thread.
    let entries = |range: std::ops::Range<usize>| {
        let mut index = unravel(range.start, batch);
        for i in range {
            let (mut ai, mut bi) = (am, bm);
            ai.ptr = av.as_ptr().wrapping_offset(batch_offset(a, &index));
            bi.ptr = bv.as_ptr().wrapping_offset(batch_offset(b, &index));
            // SAFETY: `index` is inside `batch`, so every element each operand's
            // strides reach from its batch offset is an element of that tensor,
            // inside its borrowed storage; the output block `i` is m×n inside the
            // capacity of `out`, disjoint from the operands (fresh allocation) and
            // from every other entry's block.
            unsafe { entry(kernel, [m, k, n], ai, bi, OutPtr(c.block(i * m * n)), n as isize, part) };
            next_index(&mut index, batch);
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
    /// views are read in place through their strides, except a transposed
    /// row-major right operand of an `f32` product of at least 64 rows (a
    /// linear layer's `Wᵀ`), which is turned over into a row-major copy first
    /// (the `gemm` kernel would pack it element by element). Runs the
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
        self.matmul_with(rhs, GemmKernel::auto_for(self.dtype()))
    }

    /// [`matmul`](Self::matmul) with a chosen GEMM kernel (for benchmarks and
    /// for comparing kernels).
    ///
    /// # Errors
    /// As [`matmul`](Self::matmul); [`Error::InvalidArgument`] for
    /// [`GemmKernel::Bf16Dot`] on other dtypes than `bf16` or on a CPU without
    /// AVX512_BF16.
    pub fn matmul_with(&self, rhs: &Tensor, kernel: GemmKernel) -> Result<Tensor> {
        self.matmul_part(rhs, kernel, Causal::Dense)
    }

    /// The [`Causal`] `part` of the product of `self` `[..., m, k]` and `rhs`
    /// `[..., k, n]` (batch dims broadcast as in [`matmul`](Self::matmul)):
    /// attention's products without the work that a causal mask makes zero or
    /// unused. Each computed element has the bits of the same element of
    /// [`matmul`](Self::matmul), up to the sign of a zero result, for finite
    /// operands (with the zeros that [`Causal::Weights`] and
    /// [`Causal::WeightsTransposed`] require of `self`; other values there
    /// give unspecified results).
    ///
    /// # Errors
    /// As [`matmul`](Self::matmul); [`Error::InvalidArgument`] for a 1-D
    /// operand with a part other than [`Causal::Dense`].
    pub fn matmul_causal(&self, rhs: &Tensor, part: Causal) -> Result<Tensor> {
        if part != Causal::Dense && (self.rank() < 2 || rhs.rank() < 2) {
            return Err(Error::InvalidArgument {
                op: "matmul_causal",
                detail: format!(
                    "{part:?} needs matrices ([..., m, k] and [..., k, n]), got {:?} and {:?}",
                    self.shape(),
                    rhs.shape()
                ),
            });
        }
        self.matmul_part(rhs, GemmKernel::auto_for(self.dtype()), part)
    }

    /// [`matmul_with`](Self::matmul_with) of a causal `part`.
    fn matmul_part(&self, rhs: &Tensor, kernel: GemmKernel, part: Causal) -> Result<Tensor> {
        same_dtype("matmul", self, rhs)?;
        kernel.check(self.dtype())?;
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
        let meta_shape = || [&batch[..], &[a.shape()[ra - 2], b.shape()[rb - 1]]].concat();
        let out = match self.dtype() {
            d if !d.is_float() => return Err(not_float("matmul", d)),
            d if a.is_meta() || b.is_meta() => {
                let (m, k, n) = (a.shape()[ra - 2], a.shape()[ra - 1], b.shape()[rb - 1]);
                let count: usize = batch.iter().product();
                crate::profile::add_flops_of(part_flops(count, part, [m, k, n]).try_into().unwrap_or(u64::MAX), d);
                Tensor::meta(&meta_shape(), d)?
            }
            #[cfg(feature = "cuda")]
            _ if a.is_cuda() || b.is_cuda() => crate::cuda::ops::matmul(&a, &b, &batch, part)?,
            DType::F32 => matmul_typed::<f32>(&a, &b, &batch, kernel, part)?,
            DType::F64 => matmul_typed::<f64>(&a, &b, &batch, kernel, part)?,
            DType::BF16 => matmul_typed::<bf16>(&a, &b, &batch, kernel, part)?,
            DType::F16 => matmul_typed::<f16>(&a, &b, &batch, kernel, part)?,
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
mod tests;
