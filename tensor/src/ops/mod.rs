//! Local CPU kernels on [`Tensor`]: matmul, element-wise ops with broadcasting,
//! reductions, and the neural-network ops of a Transformer.
//!
//! ```
//! use tessera_tensor::{DType, Tensor};
//!
//! let x = Tensor::arange(6, DType::F32)?.reshape(&[2, 3])?;
//! let w = Tensor::ones(&[3, 4], DType::F32)?;
//! let b = Tensor::arange(4, DType::F32)?;
//! let y = x.matmul(&w)?.add(&b)?.gelu()?; // [2, 4]
//! assert_eq!(y.shape(), &[2, 4]);
//! let p = y.softmax(1)?;
//! let rows = p.sum(&[1], false)?.to_vec::<f32>()?;
//! assert!(rows.iter().all(|s| (s - 1.0).abs() < 1e-6));
//! # Ok::<(), tessera_tensor::Error>(())
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
//! - Every dim argument is a [`Dim`](crate::Dim): a `usize`, or a signed
//!   integer where `-1` is the last dim, as in PyTorch.

mod attention;
mod elementwise;
mod lookup;
mod matmul;
#[cfg(test)]
mod meta_tests;
mod nn;
mod nn_backward;
mod reduce;
mod rms_norm;
mod rotary;
mod rows;
mod select;
mod shape;
mod split;
#[cfg(test)]
mod testutil;
mod unary;

use std::borrow::Cow;

use tessera_mesh::{DType, Element};

pub use attention::Attention;
pub use matmul::{Causal, GemmKernel};
pub use nn::{Reduction, upcast_target};
pub use rotary::rotary_tables;
pub use select::check_gather;
pub use split::{chunk_sizes, split_ranges, split_sizes, stack_pieces};
pub use unary::gelu_backward_shapes;

use crate::kernel::{Simd, par_parts, par_rows};
use crate::{Error, Result, Tensor};

/// The output of an op when any of `inputs` is on the meta device: a meta
/// tensor of `shape` and `dtype`, the op having checked its arguments as for
/// host tensors; `None` when none is, and the op computes.
pub(crate) fn meta_output(inputs: &[&Tensor], shape: &[usize], dtype: DType) -> Option<Result<Tensor>> {
    inputs.iter().any(|t| t.is_meta()).then(|| Tensor::meta(shape, dtype))
}

/// [`meta_output`] for an op on float tensors only: the first input's dtype
/// must be a float type, as the host kernels' dispatch requires.
pub(crate) fn meta_float(
    op: &'static str,
    inputs: &[&Tensor],
    shape: &[usize],
    dtype: DType,
) -> Option<Result<Tensor>> {
    let first = inputs.first().map(|t| t.dtype());
    if let Some(d) = first.filter(|d| !d.is_float())
        && inputs.iter().any(|t| t.is_meta())
    {
        return Some(Err(crate::kernel::not_float(op, d)));
    }
    meta_output(inputs, shape, dtype)
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

/// Errors unless the gradient `a` and the tensor `b` (named `what` in the
/// error) have the same shape and dtype: the check of a backward kernel that
/// takes a gradient beside its forward's input or output.
pub(crate) fn same_shape(op: &'static str, a: &Tensor, b: &Tensor, what: &str) -> Result<()> {
    if a.shape() != b.shape() {
        return Err(Error::ShapeMismatch {
            op,
            detail: format!(
                "gradient has shape {:?} but {what} has {:?}; they must be equal",
                a.shape(),
                b.shape()
            ),
        });
    }
    same_dtype(op, a, b)
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

/// A vector of `len` elements where `block(range)` yields the elements of
/// `range` (a block of whole `row`-element rows): split over the rank's threads
/// by [`par_rows`] (into a recycled or fresh, not zeroed, buffer) when
/// [`par_parts`] says so or the output is large enough to be kept for reuse,
/// else `serial()` on this thread (which must yield the same elements).
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
    // Large outputs come from the rank's pool (`written`) even on one thread.
    if par_parts(len) <= 1 && len.saturating_mul(std::mem::size_of::<T>()) < tessera_mesh::pool::MIN_BYTES {
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

/// A new contiguous tensor of `shape` holding `data` (whose length is the
/// shape's product by construction).
pub(crate) fn output<T: Element>(data: Vec<T>, shape: &[usize]) -> Result<Tensor> {
    Tensor::from_vec(data, shape)
}

#[cfg(test)]
mod par_tests {
    use tessera_mesh::DType;

    use super::testutil::sample;
    use super::*;
    use crate::kernel::PAR_MIN_ELEMENTS;

    /// Large element-wise and row-wise kernels split over a rank's threads give
    /// the one-thread result bit for bit (each element is computed by the same
    /// code in the same order in every block; column sums such as layer norm's
    /// and RMSNorm's weight gradients and sums over leading dims split by
    /// columns, each block in a buffer of its own, and keep their row order).
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
                    let (cos, sin) = rotary_tables(&(0..64).collect::<Vec<_>>(), 256, 10_000.0)?;
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
                        g.silu_backward(&x)?,
                        y.clone(),
                        x.log_softmax(1)?,
                        g.softmax_backward(&y, 1)?,
                        g.layer_norm_backward(&x, Some(&w), 1e-5)?,
                        x.softmax(0)?,
                        ln.0,
                        ln.1,
                        ln.2,
                        g.layer_norm_weight_grad(&x, 1e-5)?,
                        g.rms_norm_weight_grad_with_stats(&x, &x.rms_norm_with_stats(None, 1e-6)?.1)?,
                        x.rms_norm_with_stats(Some(&w), 1e-6)?.0,
                        x.reshape(&[4, 64, 4, 256])?.rotary_embedding(&cos, &sin)?,
                        g.reshape(&[4, 64, 4, 256])?.rotary_embedding_backward(&cos, &sin)?,
                        x.rms_norm_with_stats(Some(&w), 1e-6)?.1,
                        g.rms_norm_backward_with_stats(&x, &x.rms_norm_with_stats(None, 1e-6)?.1, Some(&w))?,
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
                        x.reshape(&[rows / 64, 64, d])?.sum(&[0, 1], false)?,
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
