//! Rotary position embedding (RoPE) in the "rotate half" layout, its gradient,
//! and the tables it reads.
//!
//! For a head of `D` features and `h = D / 2`, dims `j` and `j + h` form the
//! rotated pair (the layout of Hugging Face's LLaMA, not Meta's interleaved
//! pairs): `out = x·cos + rotate_half(x)·sin` with
//! `rotate_half(x) = [−x[h..], x[..h]]`. Each output element is three rounded
//! operations in the compute type (`f32` for `f32`, `bf16` and `f16`; `f64`
//! for `f64`), `a = x·cos`, `b = ±x'·sin`, `a + b`, rounded once to the
//! input's dtype: PyTorch's `(x.float() * cos + rotate_half(x.float()) * sin).type_as(x)`.

use std::mem::MaybeUninit;

use super::{elements, output};
use crate::kernel::{Float, Real, Simd, float_dispatch, par_rows};
use crate::{DType, Error, Result, Tensor};

/// `cos` and `sin` tables `[positions.len(), head_dim]` (`f32`) for rotary
/// embeddings in the "rotate half" layout: with `inv_freq[j] = 1 / theta^(2j / head_dim)`
/// for `j < head_dim / 2`, `cos[p][c] = f32(cos(positions[p] · inv_freq[c mod head_dim/2]))`,
/// computed in `f64` and rounded once (columns `c` and `c + head_dim/2` share a
/// frequency); likewise `sin`.
///
/// PyTorch: the tables of Hugging Face's `LlamaRotaryEmbedding` (torchtitan's
/// `precompute_freqs_cis` holds the same angles as complex numbers).
///
/// ```
/// use tessera_tensor::ops::rotary_tables;
///
/// let (cos, sin) = rotary_tables(&[0, 1, 2], 4, 10000.0)?;
/// assert_eq!(cos.shape(), &[3, 4]);
/// assert_eq!(cos.to_vec::<f32>()?[..4], [1.0; 4]); // position 0: no rotation
/// assert_eq!(sin.to_vec::<f32>()?[4], 1f64.sin() as f32); // position 1, frequency 1
/// # Ok::<(), tessera_tensor::Error>(())
/// ```
///
/// # Errors
/// [`Error::InvalidArgument`] for an odd or zero `head_dim` or a `theta` that is
/// not finite and positive.
pub fn rotary_tables(positions: &[usize], head_dim: usize, theta: f64) -> Result<(Tensor, Tensor)> {
    const OP: &str = "rotary_tables";
    if head_dim == 0 || !head_dim.is_multiple_of(2) {
        return Err(Error::InvalidArgument {
            op: OP,
            detail: format!("head_dim {head_dim} must be even and positive: dims j and j + head_dim/2 rotate together"),
        });
    }
    if !(theta.is_finite() && theta > 0.0) {
        return Err(Error::InvalidArgument {
            op: OP,
            detail: format!("theta {theta} must be finite and positive (LLaMA uses 10000 or 500000)"),
        });
    }
    let half = head_dim / 2;
    let inv_freq: Vec<f64> = (0..half)
        .map(|j| 1.0 / theta.powf((2 * j) as f64 / head_dim as f64))
        .collect();
    let mut cos = Vec::with_capacity(positions.len() * head_dim);
    let mut sin = Vec::with_capacity(positions.len() * head_dim);
    for &p in positions {
        let (c, s): (Vec<f32>, Vec<f32>) = inv_freq
            .iter()
            .map(|f| {
                let a = p as f64 * f;
                (a.cos() as f32, a.sin() as f32)
            })
            .unzip();
        for _ in 0..2 {
            cos.extend_from_slice(&c);
            sin.extend_from_slice(&s);
        }
    }
    let shape = [positions.len(), head_dim];
    Ok((output(cos, &shape)?, output(sin, &shape)?))
}

impl Tensor {
    /// Rotary position embedding of `self` `[.., S, H, D]` (a sequence of `S`
    /// positions, `H` heads of `D` features, `D` even) with `f32` tables `cos`
    /// and `sin` `[S, D]` (row `s` for position `s` of every batch row and head):
    /// `out = x·cos + rotate_half(x)·sin` (see the module docs for the layout
    /// and the rounding). Tables come from [`rotary_tables`].
    ///
    /// PyTorch: the reference LLaMA's `apply_rotary_pos_emb` (Hugging Face
    /// layout), applied to `[batch, seq, heads, head_dim]` as torchtitan does.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for rank < 3, an odd `D` or integer input;
    /// [`Error::ShapeMismatch`] / [`Error::DTypeMismatch`] for tables that are
    /// not `f32 [S, D]`.
    pub fn rotary_embedding(&self, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        self.rotary("rotary_embedding", cos, sin, false)
    }

    /// The input gradient of [`rotary_embedding`](Self::rotary_embedding) for the
    /// output gradient `self`: `g·cos + rotate_halfᵀ(g·sin)` with
    /// `rotate_halfᵀ(y) = [y[h..], −y[..h]]`, the same three rounded operations
    /// per element as PyTorch's autograd of the forward (the rotation is linear,
    /// so this needs neither `x` nor the output).
    ///
    /// # Errors
    /// As [`rotary_embedding`](Self::rotary_embedding).
    pub fn rotary_embedding_backward(&self, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        self.rotary("rotary_embedding_backward", cos, sin, true)
    }

    fn rotary(&self, op: &'static str, cos: &Tensor, sin: &Tensor, backward: bool) -> Result<Tensor> {
        let (s, d) = check_rotary(op, self, cos, sin)?;
        if let Some(out) = super::meta_float(op, &[self, cos, sin], self.shape(), self.dtype()) {
            return out;
        }
        if self.numel() == 0 {
            // Nothing to rotate: the tables (wherever they are) are not read.
            return Tensor::zeros(self.shape(), self.dtype())?.to(self.device());
        }
        #[cfg(feature = "cuda")]
        if self.is_cuda() {
            return rotary_composed(self, &cos.to(self.device())?, &sin.to(self.device())?, backward);
        }
        let (c, sn) = (elements::<f32>(cos)?, elements::<f32>(sin)?);
        let h = d / 2;
        // Elements per position: the heads of one position are contiguous.
        let per_pos = self.shape()[self.rank() - 2] * d;
        float_dispatch!(op, self.dtype(), T => {
            let x = elements::<T>(self)?;
            let (c, sn, x) = (&c[..], &sn[..], &x[..]);
            let acc = |v: f32| <T as Float>::Acc::real(f64::from(v));
            // Blocks of heads over the rank's threads, with the CPU's widest
            // vectors; each element the same three rounded operations.
            let fill = |out: &mut [MaybeUninit<T>]| {
                let simd = Simd::best();
                par_rows(out, d, |start, block| {
                    simd.run(
                        #[inline(always)]
                        || {
                            for (k, dst) in block.chunks_exact_mut(d).enumerate() {
                                let i = start / d + k;
                                let head = &x[i * d..(i + 1) * d];
                                let pos = (i * d / per_pos) % s;
                                let (cr, sr) = (&c[pos * d..pos * d + d], &sn[pos * d..pos * d + d]);
                                let (lo, hi) = dst.split_at_mut(h);
                                for j in 0..h {
                                    let (a, b) = (head[j].to_acc(), head[j + h].to_acc());
                                    let (first, second) = if backward {
                                        // dx[j] = g[j]·cos[j] + g[j+h]·sin[j+h]; dx[j+h] = g[j+h]·cos[j+h] + (−g[j])·sin[j].
                                        (a * acc(cr[j]) + b * acc(sr[j + h]), b * acc(cr[j + h]) + (-a) * acc(sr[j]))
                                    } else {
                                        // out[j] = x[j]·cos[j] + (−x[j+h])·sin[j]; out[j+h] = x[j+h]·cos[j+h] + x[j]·sin[j+h].
                                        (a * acc(cr[j]) + (-b) * acc(sr[j]), b * acc(cr[j + h]) + a * acc(sr[j + h]))
                                    };
                                    lo[j] = MaybeUninit::new(T::from_acc(first));
                                    hi[j] = MaybeUninit::new(T::from_acc(second));
                                }
                            }
                        },
                    )
                })
            };
            // SAFETY: the blocks of `par_rows` tile the output in whole heads of
            // `d` elements, and every element of each head is written above.
            let out = unsafe { crate::alloc::written(op, self.shape(), fill)? };
            output(out, self.shape())
        })
    }
}

/// Checks a rotary embedding's input and tables; returns `(S, D)`.
fn check_rotary(op: &'static str, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<(usize, usize)> {
    let r = x.rank();
    if r < 3 {
        return Err(Error::InvalidArgument {
            op,
            detail: format!(
                "the input has shape {:?}; rotary embeddings take [.., seq, heads, head_dim] (rank ≥ 3)",
                x.shape()
            ),
        });
    }
    if !x.dtype().is_float() {
        return Err(crate::kernel::not_float(op, x.dtype()));
    }
    let (s, d) = (x.shape()[r - 3], x.shape()[r - 1]);
    if !d.is_multiple_of(2) {
        return Err(Error::InvalidArgument {
            op,
            detail: format!("head_dim {d} (the last dim of {:?}) must be even", x.shape()),
        });
    }
    for (name, t) in [("cos", cos), ("sin", sin)] {
        if t.dtype() != DType::F32 {
            return Err(Error::DTypeMismatch {
                op,
                expected: DType::F32,
                got: t.dtype(),
            });
        }
        if t.shape() != [s, d] {
            return Err(Error::ShapeMismatch {
                op,
                detail: format!(
                    "the {name} table has shape {:?} but the input {:?} needs [seq, head_dim] = [{s}, {d}]",
                    t.shape(),
                    x.shape()
                ),
            });
        }
    }
    Ok((s, d))
}

/// The rotation from existing device kernels: the same three rounded
/// operations per element, computed in `f32` (or `f64`) and rounded once.
#[cfg(feature = "cuda")]
fn rotary_composed(x: &Tensor, cos: &Tensor, sin: &Tensor, backward: bool) -> Result<Tensor> {
    let r = x.rank();
    let d = x.shape()[r - 1];
    let h = d / 2;
    let compute = if x.dtype() == DType::F64 {
        DType::F64
    } else {
        DType::F32
    };
    let xf = x.cast(compute)?;
    let (s, hd) = (cos.shape()[0], cos.shape()[1]);
    // Tables `[S, 1, D]` broadcast over batch rows and heads.
    let table = |t: &Tensor| -> Result<Tensor> { t.cast(compute)?.reshape(&[s, 1, hd]) };
    let (c, sn) = (table(cos)?, table(sin)?);
    let out = if backward {
        // g·cos + rotate_halfᵀ(g·sin), rotate_halfᵀ(y) = [y[h..], −y[..h]].
        let gs = xf.mul(&sn)?;
        let rot = Tensor::cat(&[gs.narrow(r - 1, h, h)?, gs.narrow(r - 1, 0, h)?.neg()?], r - 1)?;
        xf.mul(&c)?.add(&rot)?
    } else {
        // x·cos + rotate_half(x)·sin, rotate_half(x) = [−x[h..], x[..h]].
        let rot = Tensor::cat(&[xf.narrow(r - 1, h, h)?.neg()?, xf.narrow(r - 1, 0, h)?], r - 1)?;
        xf.mul(&c)?.add(&rot.mul(&sn)?)?
    };
    out.cast(x.dtype())
}

#[cfg(test)]
mod tests {
    use super::super::testutil::{assert_close, sample};
    use super::*;

    /// `out = x·cos + rotate_half(x)·sin` element by element in f64, from the
    /// formula (rotate_half built by index).
    fn reference(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Vec<f64> {
        let (xs, c, s) = (x.to_f64_vec(), cos.to_f64_vec(), sin.to_f64_vec());
        let sh = x.shape();
        let (seq, heads, d) = (sh[sh.len() - 3], sh[sh.len() - 2], sh[sh.len() - 1]);
        let h = d / 2;
        (0..xs.len())
            .map(|i| {
                let col = i % d;
                let pos = (i / (heads * d)) % seq;
                let rot = if col < h { -xs[i + h] } else { xs[i - h] };
                xs[i] * c[pos * d + col] + rot * s[pos * d + col]
            })
            .collect()
    }

    #[test]
    fn rotary_matches_the_formula_for_every_float_dtype() {
        let (cos, sin) = rotary_tables(&[0, 1, 2, 3, 4], 8, 10000.0).unwrap();
        for dtype in [DType::F32, DType::F64, DType::BF16] {
            let x = sample(&[2, 5, 3, 8], dtype, 7);
            let y = x.rotary_embedding(&cos, &sin).unwrap();
            assert_eq!(y.dtype(), dtype);
            let tol = if dtype == DType::BF16 { 8e-3 } else { 1e-6 };
            assert_close(&y, &reference(&x, &cos, &sin), tol, "rotary");
        }
    }

    #[test]
    fn rotary_in_f32_is_three_rounded_operations() {
        let (cos, sin) = rotary_tables(&[3, 7], 4, 500000.0).unwrap();
        let x = sample(&[2, 1, 4], DType::F32, 3);
        let y = x.rotary_embedding(&cos, &sin).unwrap().to_vec::<f32>().unwrap();
        let (xs, c, s) = (
            x.to_vec::<f32>().unwrap(),
            cos.to_vec::<f32>().unwrap(),
            sin.to_vec::<f32>().unwrap(),
        );
        for p in 0..2 {
            let (x, c, s) = (&xs[p * 4..], &c[p * 4..], &s[p * 4..]);
            let want = [
                x[0] * c[0] + (-x[2]) * s[0],
                x[1] * c[1] + (-x[3]) * s[1],
                x[2] * c[2] + x[0] * s[2],
                x[3] * c[3] + x[1] * s[3],
            ];
            assert_eq!(&y[p * 4..p * 4 + 4], want, "position {p}");
        }
    }

    #[test]
    fn the_backward_is_the_transposed_rotation() {
        // <rope(x), g> = <x, rope_backward(g)> for any x and g: the adjoint.
        let (cos, sin) = rotary_tables(&[0, 5, 9], 6, 10000.0).unwrap();
        let x = sample(&[2, 3, 2, 6], DType::F64, 1);
        let g = sample(&[2, 3, 2, 6], DType::F64, 2);
        let lhs: f64 = x
            .rotary_embedding(&cos, &sin)
            .unwrap()
            .to_f64_vec()
            .iter()
            .zip(g.to_f64_vec())
            .map(|(a, b)| a * b)
            .sum();
        let rhs: f64 = x
            .to_f64_vec()
            .iter()
            .zip(g.rotary_embedding_backward(&cos, &sin).unwrap().to_f64_vec())
            .map(|(a, b)| a * b)
            .sum();
        assert!((lhs - rhs).abs() < 1e-12, "{lhs} vs {rhs}");
    }

    #[test]
    fn tables_follow_the_formula_and_bad_arguments_are_named() {
        let (cos, sin) = rotary_tables(&[2], 4, 100.0).unwrap();
        // inv_freq = [1, 1/10]; columns c and c + 2 share a frequency.
        let want_c = [2f64.cos(), 0.2f64.cos(), 2f64.cos(), 0.2f64.cos()].map(|v| v as f32);
        let want_s = [2f64.sin(), 0.2f64.sin(), 2f64.sin(), 0.2f64.sin()].map(|v| v as f32);
        assert_eq!(cos.to_vec::<f32>().unwrap(), want_c);
        assert_eq!(sin.to_vec::<f32>().unwrap(), want_s);
        assert!(
            rotary_tables(&[0], 3, 1e4)
                .unwrap_err()
                .to_string()
                .contains("must be even")
        );
        assert!(rotary_tables(&[0], 4, 0.0).unwrap_err().to_string().contains("theta"));
        let x = sample(&[1, 2, 1, 4], DType::F32, 0);
        let err = x.rotary_embedding(&cos, &sin).unwrap_err().to_string();
        assert!(err.contains("needs [seq, head_dim] = [2, 4]"), "{err}");
        let err = sample(&[2, 4], DType::F32, 0)
            .rotary_embedding(&cos, &sin)
            .unwrap_err()
            .to_string();
        assert!(err.contains("rank ≥ 3"), "{err}");
        let err = x
            .rotary_embedding(&cos.cast(DType::BF16).unwrap(), &sin)
            .unwrap_err()
            .to_string();
        assert!(err.contains("f32"), "{err}");
    }
}
