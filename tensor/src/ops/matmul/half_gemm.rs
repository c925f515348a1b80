//! `bf16` and `f16` products: the `f32` GEMM with the conversions fused in.

use half::{bf16, f16};

use super::{Gemm, GemmKernel, Mat, SPLIT_ALIGN};
use crate::kernel::Float;
use crate::kernel::Simd;

// Half-precision operands run the f32 GEMM with their conversions fused in;
// bf16 ones the dot-product kernel when it was chosen.
impl Gemm for bf16 {
    unsafe fn gemm(kernel: GemmKernel, mkn: [usize; 3], a: Mat<bf16>, b: Mat<bf16>, c: *mut bf16, rsc: isize) {
        // SAFETY: forwarded unchanged from the caller's guarantees; `Bf16Dot`
        // reaches here only where the CPU has it (`GemmKernel::check`).
        unsafe {
            #[cfg(target_arch = "x86_64")]
            if kernel == GemmKernel::Bf16Dot {
                return super::bf16_dot::gemm(mkn, a, b, c, rsc);
            }
            gemm_half(kernel, mkn, a, b, c, rsc)
        }
    }
}

impl Gemm for f16 {
    unsafe fn gemm(kernel: GemmKernel, mkn: [usize; 3], a: Mat<f16>, b: Mat<f16>, c: *mut f16, rsc: isize) {
        // SAFETY: forwarded unchanged from the caller's guarantees.
        unsafe { gemm_half(kernel, mkn, a, b, c, rsc) }
    }
}

/// Bytes of the `f32` output panel that a half-precision product is computed
/// in before it is rounded: small enough to stay in a core's L2 cache.
pub(super) const HALF_PANEL_BYTES: usize = 1 << 20;

/// Scratch bytes a thread keeps between half-precision products; more is
/// freed after the product that needed it.
pub(super) const HALF_SCRATCH_KEEP: usize = 32 << 20;

thread_local! {
    /// This thread's scratch for half-precision products: the two widened
    /// operands and the `f32` output panel.
    pub(super) static HALF_SCRATCH: std::cell::RefCell<[Vec<f32>; 3]> = const {
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
    let simd = Simd::best();
    HALF_SCRATCH.with(|scratch| {
        let mut scratch = scratch.borrow_mut();
        let [sa, sb, sc] = &mut *scratch;
        let by_cols = n >= m;
        let (long, short) = if by_cols { (n, m) } else { (m, n) };
        let width = (HALF_PANEL_BYTES / 4 / short).next_multiple_of(SPLIT_ALIGN).min(long);
        // For the blocks below: a panel's rows (columns) are a sub-range of the
        // product's, so each operand block lies inside what the caller
        // guarantees readable; the output block inside what it guarantees
        // writable. The f32 operands and panel are this thread's scratch,
        // sized by `widen` and `grow` for what the GEMM reads and writes.
        // SAFETY: the whole of `a` (m×k) or `b` (k×n) is readable (caller).
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
            // SAFETY: the panel is columns start..start+w of `b` (rows of `a`),
            // inside the operand the caller makes readable.
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
            // SAFETY: `wa`, `wb` are the widened scratch copies (rows×k, k×cols)
            // and `panel` is `rows·cols` f32s of separate scratch; the rows and
            // columns written through `c` from `origin` are the panel's part of
            // the m×n output the caller makes writable.
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
    simd: Simd,
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
