//! Local CPU kernels on [`Tensor`]: matmul, element-wise ops with broadcasting,
//! reductions, and the neural-network ops of a Transformer.
//!
//! ```
//! use tessera_dtensor::{DType, Tensor};
//!
//! let x = Tensor::arange(6, DType::F32)?.reshape(&[2, 3])?;
//! let w = Tensor::ones(&[3, 4], DType::F32)?;
//! let b = Tensor::arange(4, DType::F32)?;
//! let y = x.matmul(&w)?.add(&b)?.gelu()?; // [2, 4]
//! assert_eq!(y.shape(), &[2, 4]);
//! let p = y.softmax(1)?;
//! let rows = p.sum(&[1], false)?.to_vec::<f32>()?;
//! assert!(rows.iter().all(|s| (s - 1.0).abs() < 1e-6));
//! # Ok::<(), tessera_dtensor::Error>(())
//! ```
//!
//! Every kernel is written once, generic over the element type, and dispatches
//! on the dtype once per call. Large products and large element-wise and
//! row-wise kernels (softmax, layer norm and their gradients) split their output
//! over the rank's [`intra_op_threads`](tessera_mesh::intra_op_threads), in
//! blocks of whole rows, so that every element is computed by the same code in
//! the same order whatever the split: results do not depend on the thread
//! count. Numerics:
//!
//! - `f32` and `f64` compute in their own precision; `bf16` and `f16` compute in
//!   `f32` and round once per output element (PyTorch's "opmath" rule).
//! - Sums and means accumulate in `f64` for every float dtype, and so do the
//!   statistics of softmax, layer norm and cross entropy. PyTorch reduces `f32`
//!   in `f32` with vectorised pairwise sums; results agree to about 1e-7
//!   relative, with `f64` accumulation the more accurate of the two.
//! - Integer tensors are rejected by arithmetic kernels (cast them first);
//!   shape ops ([`Tensor::permute`], [`Tensor::broadcast_to`]) and
//!   [`Tensor::embedding`]'s table accept every dtype.
//! - Operands must have the same dtype: there is no type promotion.

mod attention;
mod elementwise;
mod fastmath;
mod matmul;
mod nn;
mod nn_backward;
mod reduce;
mod shape;
#[cfg(test)]
mod testutil;
mod unary;

use std::borrow::Cow;
use std::ops::{Add, Div, Mul, Neg, Sub};

use half::{bf16, f16};
use tessera_mesh::{DType, Element};

pub use attention::Attention;
pub use matmul::{Causal, GemmKernel};
pub use nn::Reduction;
pub(crate) use unary::gelu_backward_shapes;

use crate::{Error, Result, Tensor};

/// The arithmetic type a kernel computes in: `f32` or `f64`.
pub(crate) trait Real:
    Element
    + PartialOrd
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + Neg<Output = Self>
    + Send
    + Sync
    + 'static
{
    const ZERO: Self;
    const ONE: Self;
    const NEG_INFINITY: Self;
    /// Rounds `v` to this type.
    fn real(v: f64) -> Self;
    /// Widens to `f64` (exact).
    fn widen(self) -> f64;
    fn is_nan(self) -> bool;
    fn exp(self) -> Self;
    fn ln(self) -> Self;
    fn sqrt(self) -> Self;
    fn tanh(self) -> Self;
    fn abs(self) -> Self;
    fn powf(self, e: Self) -> Self;
    fn erf(self) -> Self;
    fn erfc(self) -> Self;
}

macro_rules! real {
    ($t:ty, $erf:path, $erfc:path) => {
        impl Real for $t {
            const ZERO: Self = 0.0;
            const ONE: Self = 1.0;
            const NEG_INFINITY: Self = <$t>::NEG_INFINITY;
            #[inline(always)]
            fn real(v: f64) -> Self {
                v as $t
            }
            #[inline(always)]
            fn widen(self) -> f64 {
                self as f64
            }
            #[inline(always)]
            fn is_nan(self) -> bool {
                <$t>::is_nan(self)
            }
            #[inline(always)]
            fn exp(self) -> Self {
                <$t>::exp(self)
            }
            #[inline(always)]
            fn ln(self) -> Self {
                <$t>::ln(self)
            }
            #[inline(always)]
            fn sqrt(self) -> Self {
                <$t>::sqrt(self)
            }
            #[inline(always)]
            fn tanh(self) -> Self {
                <$t>::tanh(self)
            }
            #[inline(always)]
            fn abs(self) -> Self {
                <$t>::abs(self)
            }
            #[inline(always)]
            fn powf(self, e: Self) -> Self {
                <$t>::powf(self, e)
            }
            #[inline(always)]
            fn erf(self) -> Self {
                $erf(self)
            }
            #[inline(always)]
            fn erfc(self) -> Self {
                $erfc(self)
            }
        }
    };
}
real!(f32, libm::erff, libm::erfcf);
real!(f64, libm::erf, libm::erfc);

/// A float element type and the type it computes in ([`Real`]).
pub(crate) trait Float: Element {
    /// `f32` for `f32`, `bf16` and `f16`; `f64` for `f64`.
    type Acc: Real;
    fn to_acc(self) -> Self::Acc;
    /// Rounds once to this type.
    fn from_acc(a: Self::Acc) -> Self;
    /// The value in `f64` (exact). Not `to_f64`: `half`'s types have inherent
    /// methods of that name, which a call on a concrete `bf16` would pick.
    #[inline(always)]
    fn wide(self) -> f64 {
        self.to_acc().widen()
    }
    /// Rounds `v` to this type (half types through `f32`, as casts do, by the
    /// integer arithmetic of [`from_acc`](Self::from_acc)). Not `from_f64`: on a
    /// concrete `bf16`, `half`'s inherent `from_f64` would be called instead,
    /// which rounds differently (from the top half of the `f64`) and branches.
    #[inline(always)]
    fn from_wide(v: f64) -> Self {
        Self::from_acc(Self::Acc::real(v))
    }
}

macro_rules! float {
    ($t:ty, $acc:ty, $to:expr, $from:expr) => {
        impl Float for $t {
            type Acc = $acc;
            #[inline(always)]
            fn to_acc(self) -> $acc {
                $to(self)
            }
            #[inline(always)]
            fn from_acc(a: $acc) -> Self {
                $from(a)
            }
        }
    };
}
float!(f32, f32, |x| x, |a| a);
float!(f64, f64, |x| x, |a| a);
// Both ways by integer arithmetic without a branch, as casts do: widening is a
// shift (a NaN stays a NaN), rounding the same bits as `bf16::from_f32`.
float!(
    bf16,
    f32,
    |x: bf16| f32::from_bits(u32::from(x.to_bits()) << 16),
    |a: f32| bf16::from_bits(crate::tensor::bf16_bits(a.to_bits()))
);
float!(f16, f32, f16::to_f32, f16::from_f32);

/// Runs `$body` with `$T` bound to the element type of `$dtype` when it is a
/// float type; otherwise returns an error naming `$op`.
macro_rules! float_dispatch {
    ($op:expr, $dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            tessera_mesh::DType::F32 => {
                type $T = f32;
                $body
            }
            tessera_mesh::DType::F64 => {
                type $T = f64;
                $body
            }
            tessera_mesh::DType::BF16 => {
                type $T = half::bf16;
                $body
            }
            tessera_mesh::DType::F16 => {
                type $T = half::f16;
                $body
            }
            other => return Err($crate::ops::not_float($op, other)),
        }
    };
}
pub(crate) use float_dispatch;

pub(crate) use fastmath::Simd;

/// Runs `$body` with `$T` bound to the element type of `$dtype`, for every dtype
/// (an error naming `$op` for dtypes added later).
macro_rules! any_dispatch {
    ($op:expr, $dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            tessera_mesh::DType::F32 => {
                type $T = f32;
                $body
            }
            tessera_mesh::DType::F64 => {
                type $T = f64;
                $body
            }
            tessera_mesh::DType::BF16 => {
                type $T = half::bf16;
                $body
            }
            tessera_mesh::DType::F16 => {
                type $T = half::f16;
                $body
            }
            tessera_mesh::DType::I64 => {
                type $T = i64;
                $body
            }
            tessera_mesh::DType::U8 => {
                type $T = u8;
                $body
            }
            other => {
                return Err($crate::Error::InvalidArgument {
                    op: $op,
                    detail: format!("dtype {other} is not supported"),
                });
            }
        }
    };
}
pub(crate) use any_dispatch;

/// The error for a float-only op given an integer tensor.
/// The index of element `i` of `shape` (row-major).
pub(crate) fn unravel(mut i: usize, shape: &[usize]) -> Vec<usize> {
    let mut index = vec![0; shape.len()];
    for d in (0..shape.len()).rev() {
        index[d] = i % shape[d];
        i /= shape[d];
    }
    index
}

pub(crate) fn not_float(op: &'static str, dtype: DType) -> Error {
    Error::InvalidArgument {
        op,
        detail: format!("dtype {dtype} is not a floating-point type; cast the tensor to a float dtype first"),
    }
}

/// Errors unless both tensors have the same dtype.
pub(crate) fn same_dtype(op: &'static str, a: &Tensor, b: &Tensor) -> Result<()> {
    if a.dtype() == b.dtype() {
        Ok(())
    } else {
        Err(Error::DTypeMismatch {
            op,
            expected: a.dtype(),
            got: b.dtype(),
        })
    }
}

/// Errors unless `dim < rank`.
pub(crate) fn check_dim(op: &'static str, dim: usize, rank: usize) -> Result<()> {
    if dim < rank {
        Ok(())
    } else {
        Err(Error::DimOutOfRange { op, dim, rank })
    }
}

/// The elements of `t` in row-major order: borrowed when contiguous, copied otherwise.
pub(crate) fn elements<T: Element>(t: &Tensor) -> Result<Cow<'_, [T]>> {
    if t.is_contiguous() {
        Ok(Cow::Borrowed(t.as_slice::<T>()?))
    } else {
        Ok(Cow::Owned(t.to_vec::<T>()?))
    }
}

/// Fewest elements of output per thread that a kernel splits over the rank's
/// threads: below it, handing out the parts costs more than they save.
pub(crate) const PAR_MIN_ELEMENTS: usize = 1 << 15;

/// How many threads [`par_rows`] splits an output of `len` elements over (1:
/// not split).
pub(crate) fn par_parts(len: usize) -> usize {
    (len / PAR_MIN_ELEMENTS).clamp(1, tessera_mesh::intra_op_threads())
}

/// A vector of `len` elements where `block(range)` yields the elements of
/// `range` (a block of whole `row`-element rows): split over the rank's threads
/// by [`par_rows`] (into a recycled or fresh, not zeroed, buffer) when
/// [`par_parts`] says so, else `serial()` on this thread (which must yield the
/// same elements).
///
/// # Panics
/// When `block(range)` yields fewer elements than `range` holds (a bug in the
/// caller); the buffer is then freed unread.
pub(crate) fn par_collect<T: Element, I: Iterator<Item = T>>(
    op: &'static str,
    len: usize,
    row: usize,
    block: impl Fn(std::ops::Range<usize>) -> I + Sync,
    serial: impl FnOnce() -> Vec<T>,
) -> Result<Vec<T>> {
    // Both loops are compiled for the widest vectors the CPU has.
    let simd = Simd::best();
    if par_parts(len) <= 1 {
        return Ok(simd.run(serial));
    }
    let fill = |out: &mut [std::mem::MaybeUninit<T>]| {
        par_rows(out, row, |start, out| {
            let end = start + out.len();
            let written = simd.run(
                #[inline(always)]
                || {
                    out.iter_mut()
                        .zip(block(start..end))
                        .map(|(o, v)| *o = std::mem::MaybeUninit::new(v))
                        .count()
                },
            );
            assert_eq!(written, end - start, "{op}: a block yielded too few elements");
        });
    };
    // SAFETY: the blocks of `par_rows` tile the output, and each block's every
    // element is written (asserted above: a short block panics instead).
    unsafe { crate::alloc::written(op, &[len], fill) }
}

/// Runs `f(start, block)` over blocks of `out` that hold whole rows of `row`
/// elements (`start` is the block's first element), one block per thread on
/// the rank's [`intra_op_threads`](tessera_mesh::intra_op_threads) when each
/// gets at least [`PAR_MIN_ELEMENTS`], else one block on this thread.
pub(crate) fn par_rows<C: Send>(out: &mut [C], row: usize, f: impl Fn(usize, &mut [C]) + Sync) {
    par_blocks(out, row, par_parts(out.len()), f);
}

/// [`par_rows`] over at most `parts` blocks: for outputs much smaller than the
/// work behind them (one loss per row of logits), with `parts` from
/// [`par_parts`] of the work's size.
pub(crate) fn par_blocks<C: Send>(out: &mut [C], row: usize, parts: usize, f: impl Fn(usize, &mut [C]) + Sync) {
    let rows = out.len().checked_div(row).unwrap_or(0);
    let parts = parts.min(rows);
    if parts <= 1 {
        f(0, out);
        return;
    }
    let per = rows.div_ceil(parts) * row;
    let blocks: Vec<std::sync::Mutex<&mut [C]>> = out.chunks_mut(per).map(std::sync::Mutex::new).collect();
    tessera_mesh::parallel_for(blocks.len(), |i| {
        let mut block = blocks[i].lock().unwrap_or_else(|e| e.into_inner());
        f(i * per, &mut block);
    });
}

/// A new contiguous tensor of `shape` holding `data` (whose length is the
/// shape's product by construction).
pub(crate) fn output<T: Element>(data: Vec<T>, shape: &[usize]) -> Result<Tensor> {
    Tensor::from_vec(data, shape)
}

#[cfg(test)]
mod float_tests {
    use half::bf16;

    use super::Float;

    /// `from_wide` rounds as casts do (through `f32`), also where `half`'s
    /// inherent `from_f64` (what `T::from_f64` named on a concrete `bf16`) rounds
    /// otherwise: `1 + 2⁻⁷ + 2⁻⁸ − 2⁻²⁵` is `1 + 2⁻⁷ + 2⁻⁸` in `f32`, a tie that
    /// rounds to even, up; `half` reads the top 20 mantissa bits and rounds down.
    #[test]
    fn from_wide_rounds_through_f32() {
        let v = 1.0 + 2f64.powi(-7) + 2f64.powi(-8) - 2f64.powi(-25);
        let through_f32 = bf16::from_f32(v as f32);
        assert_eq!(through_f32, bf16::from_f32(1.0 + 2f32.powi(-6)));
        assert_eq!(<bf16 as Float>::from_wide(v), through_f32);
        assert_ne!(bf16::from_f64(v), through_f32, "half's own rounding differs here");
        let cast = crate::Tensor::from_vec(vec![v], &[1])
            .unwrap()
            .cast(tessera_mesh::DType::BF16)
            .unwrap();
        assert_eq!(cast.to_vec::<bf16>().unwrap(), vec![through_f32]);
        assert_eq!(<bf16 as Float>::wide(through_f32), 1.0 + 2f64.powi(-6));
    }

    /// The branch-free bf16 conversions of the kernels give `half`'s bits:
    /// widening every bf16 exactly (a NaN stays a NaN), rounding ties to even.
    #[test]
    fn bf16_conversions_match_half() {
        for bits in 0..=u16::MAX {
            let x = bf16::from_bits(bits);
            let (ours, theirs) = (x.to_acc(), x.to_f32());
            assert!(
                ours.to_bits() == theirs.to_bits() || (ours.is_nan() && theirs.is_nan()),
                "widening {bits:#06x}: {ours} against {theirs}"
            );
        }
        // Every 4099th f32 bit pattern, plus the ties and near-ties of each bf16.
        let sweep = (0..=u32::MAX).step_by(4099).chain((0..=u16::MAX).flat_map(|h| {
            let b = u32::from(h) << 16;
            [b | 0x8000, b | 0x7fff, b | 0x8001]
        }));
        for bits in sweep {
            let a = f32::from_bits(bits);
            let (ours, theirs) = (bf16::from_acc(a), bf16::from_f32(a));
            assert!(
                ours.to_bits() == theirs.to_bits() || (ours.is_nan() && theirs.is_nan()),
                "rounding {bits:#010x}: {:#06x} against {:#06x}",
                ours.to_bits(),
                theirs.to_bits()
            );
        }
    }
}

#[cfg(test)]
mod par_tests {
    use tessera_mesh::DType;

    use super::testutil::sample;
    use super::*;

    /// Large element-wise and row-wise kernels split over a rank's threads give
    /// the one-thread result bit for bit (each element is computed by the same
    /// code in the same order in every block; column sums such as layer norm's
    /// weight gradient split by columns and keep their row order).
    #[test]
    fn split_kernels_equal_the_one_thread_ones() {
        // 256 rows of 1024: 2^18 elements, split over 3 threads.
        let (rows, d) = (256, 1024);
        assert!(rows * d / PAR_MIN_ELEMENTS >= 3, "the case must split over 3 threads");
        for dtype in [DType::F32, DType::BF16] {
            let (x, g) = (sample(&[rows, d], dtype, 1), sample(&[rows, d], dtype, 2));
            let (bias, w) = (sample(&[d], dtype, 3), sample(&[d], dtype, 4));
            let run = |threads: usize| {
                let (x, g, bias, w) = (x.clone(), g.clone(), bias.clone(), w.clone());
                let opts = tessera_mesh::LaunchOptions::default().threads_per_rank(threads);
                let out = tessera_mesh::launch_with(&opts, 1, move |_| {
                    let y = x.softmax(1)?;
                    let ln = x.layer_norm_with_stats(Some(&w), Some(&bias), 1e-5)?;
                    let targets = Tensor::from_vec((0..rows as i64).map(|i| (i * 7) % d as i64).collect(), &[rows])?;
                    Ok(vec![
                        g.gelu_backward_with_output(&x, &x.gelu()?)?,
                        x.add(&g)?,
                        x.add(&bias)?,
                        bias.mul(&x)?,
                        x.mul_scalar(0.37)?,
                        x.gelu()?,
                        g.gelu_backward(&x)?,
                        y.clone(),
                        x.log_softmax(1)?,
                        g.softmax_backward(&y, 1)?,
                        g.layer_norm_backward(&x, Some(&w), 1e-5)?,
                        x.softmax(0)?,
                        ln.0,
                        ln.1,
                        ln.2,
                        g.layer_norm_weight_grad(&x, 1e-5)?,
                        x.cross_entropy(&targets, nn::Reduction::None)?,
                        x.cross_entropy(&targets, nn::Reduction::Mean)?,
                        x.cross_entropy_backward(&targets, 0.25)?,
                        x.cross_entropy_with_grad(&targets, nn::Reduction::Sum)?.0,
                        x.cross_entropy_with_grad(&targets, nn::Reduction::Sum)?.1,
                        y.cross_entropy_backward_from_probs(&targets, 0.25)?,
                        x.reshape(&[rows / 64, 64, d])?.causal_mask(-1e4)?,
                        // Blocks of 86 rows: a block starts mid-sequence (row 86 is query 22).
                        x.reshape(&[rows / 64, 64, d])?.attention_probs(0.3, true)?,
                        g.attention_probs_backward(&y, 0.3, true)?,
                        x.sum(&[0], false)?,
                        x.sum(&[1], true)?,
                        x.max(&[0], false)?,
                        x.mean(&[1], false)?,
                        x.reshape(&[rows / 64, 64, d])?.sum(&[1], false)?,
                        // Copies of views, split along their first dim: rows of
                        // contiguous elements, and elements a row apart.
                        x.reshape(&[rows / 64, 64, d])?.transpose(0, 1)?.contiguous(),
                        x.transpose(0, 1)?.contiguous(),
                        x.narrow(1, 3, d - 5)?.contiguous(),
                    ])
                });
                out.unwrap().remove(0)
            };
            let (one, three) = (run(1), run(3));
            for (i, (a, b)) in one.iter().zip(&three).enumerate() {
                let bits = |t: &Tensor| t.to_f64_vec().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(a), bits(b), "{dtype} kernel {i}");
            }
        }
    }

    /// Copies of large views split over the rank's threads hold the viewed
    /// elements in row-major order (checked by index arithmetic).
    #[test]
    fn split_copies_of_views_hold_the_viewed_elements() {
        let (b, s, h) = (4, 96, 256);
        let opts = tessera_mesh::LaunchOptions::default().threads_per_rank(3);
        tessera_mesh::launch_with(&opts, 1, move |_| {
            let data: Vec<f32> = (0..b * s * h).map(|i| i as f32).collect();
            let x = Tensor::from_vec(data.clone(), &[b, s, h])?;
            assert!(b * s * h / PAR_MIN_ELEMENTS >= 3, "the case must split over 3 threads");
            // [s, b, h]: rows of h contiguous elements.
            let t = x.transpose(0, 1)?.contiguous().to_vec::<f32>()?;
            // [h, b, s]: elements h apart.
            let u = x.permute(&[2, 0, 1])?.contiguous().to_vec::<f32>()?;
            for (i, j, k) in (0..b).flat_map(|i| (0..s).flat_map(move |j| (0..h).map(move |k| (i, j, k)))) {
                let want = data[(i * s + j) * h + k];
                assert_eq!(t[(j * b + i) * h + k], want, "transpose at {i},{j},{k}");
                assert_eq!(u[(k * b + i) * s + j], want, "permute at {i},{j},{k}");
            }
            Ok(())
        })
        .unwrap();
    }

    #[test]
    fn blocks_hold_whole_rows() {
        let opts = tessera_mesh::LaunchOptions::default().threads_per_rank(4);
        let blocks = tessera_mesh::launch_with(&opts, 1, |_| {
            // 14,100 rows of 7: just over 3 threads' worth.
            let mut out = vec![0u32; 7 * 14_100];
            let seen = std::sync::Mutex::new(Vec::new());
            par_rows(&mut out, 7, |start, block| {
                block.fill(1);
                seen.lock().unwrap().push((start, block.len()));
            });
            let mut seen = seen.into_inner().unwrap();
            seen.sort();
            Ok((seen, out.iter().all(|&v| v == 1)))
        })
        .unwrap();
        let (seen, all) = &blocks[0];
        assert!(all, "every element is in a block");
        assert_eq!(seen.len(), 3, "{seen:?}");
        assert!(seen.iter().all(|&(s, len)| s % 7 == 0 && (len % 7 == 0)), "{seen:?}");
    }
}
