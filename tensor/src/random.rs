//! Counter-based random tensors: every element is a pure function of a seed, a
//! name, a stream number and the element's global row-major index, so a tensor
//! drawn whole and the same tensor drawn box by box (each rank's shard, on any
//! mesh, with any placements) hold the same bits.
//!
//! ```
//! use tessera_tensor::DType;
//! use tessera_tensor::random::{Distribution, StreamKey, fill, fill_region};
//!
//! let key = StreamKey::new(42, "layers.0.attn.wq");
//! let init = Distribution::Normal { mean: 0.0, std: 0.02 };
//! let whole = fill(&init, key, &[6, 4], DType::F32)?;
//! // Rows 2..5 and columns 1..3, as the rank holding that shard draws them.
//! let piece = fill_region(&init, key, &[6, 4], &[2, 1], &[3, 2], DType::F32)?;
//! assert_eq!(piece, whole.narrow(0, 2, 3)?.narrow(1, 1, 2)?);
//! // Another stream (the next dropout call, say) gives other values.
//! assert_ne!(fill(&init, key.with_stream(1), &[6, 4], DType::F32)?, whole);
//! # Ok::<(), tessera_tensor::Error>(())
//! ```
//!
//! - [`philox4x32_10`]: the generator, Philox4x32-10 (Salmon et al., "Parallel
//!   random numbers: as easy as 1, 2, 3", SC 2011), as Random123, PyTorch's CUDA
//!   generator and JAX define it.
//! - [`StreamKey`]: the Philox key of a `(seed, name)` pair, plus a 64-bit stream
//!   number. Element `i` of a tensor drawn with it is computed from the Philox
//!   output for counter `[lo32(i), hi32(i), lo32(stream), hi32(stream)]`.
//! - [`Distribution`]: what the four output words become (uniform, normal,
//!   truncated normal, constant, Bernoulli), computed in `f64` and rounded once to
//!   the dtype.
//! - [`fill_region`] and [`fill`]: a box of the global tensor, or all of it.
//!
//! Nothing is sequential: there is no generator state to advance or to keep in
//! step between ranks (PyTorch's `torch.distributed.tensor` keeps an offset-based
//! RNG tracker for that), and the values do not depend on how a box is split over
//! the rank's threads. The transcendental functions are the pure-Rust `libm`
//! crate's, so the bits are the same on every platform too. Not for cryptography.

mod region;
mod special;

use std::f64::consts::{FRAC_1_SQRT_2, SQRT_2, TAU};

use crate::kernel::{Scalar, any_dispatch, float_dispatch};
use crate::{DType, Error, Result, Tensor};
use region::{check_region, fill_box};

/// Philox's round multipliers.
const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
/// Philox's key schedule increments (the fractional parts of the golden ratio and of √3, in 32 bits).
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

/// The Philox4x32-10 block function: four 32-bit words of output for a 128-bit
/// counter and a 64-bit key, exactly as Random123's `philox4x32` with 10 rounds
/// (multipliers `0xD2511F53` and `0xCD9E8D57`, key increments `0x9E3779B9` and
/// `0xBB67AE85`), PyTorch's CUDA `Philox4_32` and JAX's `philox4x32` compute it.
///
/// ```
/// use tessera_tensor::random::philox4x32_10;
///
/// // Random123's known-answer vector for a zero counter and key.
/// assert_eq!(philox4x32_10([0; 4], [0; 2]), [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]);
/// ```
pub fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let [mut c0, mut c1, mut c2, mut c3] = counter;
    let [mut k0, mut k1] = key;
    for round in 0..10 {
        if round > 0 {
            k0 = k0.wrapping_add(W0);
            k1 = k1.wrapping_add(W1);
        }
        let p0 = u64::from(M0) * u64::from(c0);
        let p1 = u64::from(M1) * u64::from(c2);
        (c0, c1, c2, c3) = (
            (p1 >> 32) as u32 ^ c1 ^ k0,
            p1 as u32,
            (p0 >> 32) as u32 ^ c3 ^ k1,
            p0 as u32,
        );
    }
    [c0, c1, c2, c3]
}

/// The 64-bit FNV-1a hash of `bytes` (offset basis `0xcbf29ce484222325`, prime
/// `0x100000001b3`).
fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// splitmix64's first output from state `x`.
fn splitmix64(x: u64) -> u64 {
    let mut state = x;
    crate::rng::splitmix64(&mut state)
}

/// Which random numbers a tensor gets: a Philox key derived from a seed and a
/// name (the parameter's, say `"layers.3.mlp.w1"`), and a stream number.
///
/// The key is `k = splitmix64(splitmix64(seed) ^ fnv1a64(name))` (64-bit FNV-1a
/// of the name's UTF-8 bytes; `splitmix64(x)` is the first output of splitmix64
/// from state `x`), split into `[lo32(k), hi32(k)]`: fixed arithmetic, the same
/// on every platform and in every release. Element `i` of a tensor drawn with the
/// key uses the Philox counter `[lo32(i), hi32(i), lo32(stream), hi32(stream)]`.
///
/// ```
/// use tessera_tensor::random::StreamKey;
///
/// let w = StreamKey::new(0, "w");
/// assert_eq!(w, StreamKey::new(0, "w"));
/// assert_ne!(w, StreamKey::new(1, "w"));
/// assert_ne!(w, StreamKey::new(0, "b"));
/// assert_ne!(w.with_stream(3).words(0), w.words(0));
/// ```
///
/// PyTorch: a `torch.Generator`'s `(seed, offset)` pair, with the name in place
/// of the order in which parameters happen to be initialised.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct StreamKey {
    key: [u32; 2],
    stream: u64,
}

impl StreamKey {
    /// The key of `name` under `seed`, on stream 0.
    pub fn new(seed: u64, name: &str) -> StreamKey {
        let k = splitmix64(splitmix64(seed) ^ fnv1a64(name.as_bytes()));
        StreamKey {
            key: [k as u32, (k >> 32) as u32],
            stream: 0,
        }
    }

    /// The same key on stream `stream` (replacing the stream, not adding to it):
    /// independent numbers for each use of one name, such as the `n`-th dropout call.
    pub fn with_stream(self, stream: u64) -> StreamKey {
        StreamKey { stream, ..self }
    }

    /// The four Philox words of element `index` (the global row-major index).
    pub fn words(self, index: u64) -> [u32; 4] {
        let s = self.stream;
        philox4x32_10(
            [index as u32, (index >> 32) as u32, s as u32, (s >> 32) as u32],
            self.key,
        )
    }
}

/// What the random words of an element become. Values are computed in `f64`
/// from the element's four [Philox words](StreamKey::words) `w0..w3` and rounded
/// once to the dtype (as [`Tensor::cast`] rounds, to nearest even). `U53(a, b)`
/// below is the top 53 bits of the 64-bit word `b·2³² + a`, times `2⁻⁵³`: a
/// uniform sample of `[0, 1)`.
///
/// Every parameter must be finite (except a `Constant`'s, see there).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Distribution {
    /// Uniform on `[low, high)`: `low + (high − low)·U53(w0, w1)`. In the dtype, a
    /// value that rounds outside `[low, high)` is moved to the nearest value inside
    /// (when the dtype has one; `low == high` gives `low`), so bf16 draws of
    /// `[0, 1)` never give 1. PyTorch: `nn.init.uniform_(t, a=low, b=high)`.
    Uniform {
        /// The lower bound (included); at most `high`.
        low: f64,
        /// The upper bound (excluded).
        high: f64,
    },
    /// Normal: `mean + std·z` with `z` from Box–Muller's cosine branch,
    /// `z = √(−2 ln u1)·cos(2π u2)`, `u1 = 1 − U53(w0, w1)` in `(0, 1]` and
    /// `u2 = U53(w2, w3)`. PyTorch: `nn.init.normal_(t, mean, std)`.
    Normal {
        /// The mean.
        mean: f64,
        /// The standard deviation, `>= 0`.
        std: f64,
    },
    /// The normal `(mean, std)` truncated to `[low, high]`, by PyTorch's algorithm:
    /// `u` uniform on `[erf(α/√2), erf(β/√2)]` (that is `[2Φ(α) − 1, 2Φ(β) − 1]`,
    /// `α = (low − mean)/std`, `β = (high − mean)/std`) from `U53(w0, w1)`, then
    /// `mean + std·√2·erfinv(u)`, clamped to `[low, high]`. Like PyTorch's, it
    /// piles up at a bound when `[low, high]` lies far (beyond about 8 std) in a
    /// tail. PyTorch: `nn.init.trunc_normal_(t, mean, std, a=low, b=high)`.
    TruncNormal {
        /// The mean of the normal before truncation.
        mean: f64,
        /// Its standard deviation, `> 0`.
        std: f64,
        /// The lower bound; at most `high`.
        low: f64,
        /// The upper bound.
        high: f64,
    },
    /// Every element is this value, converted as [`Tensor::full`] converts it
    /// (so it fills any dtype; integer dtypes take finite values in range, and
    /// float dtypes also infinities and NaN). PyTorch: `nn.init.constant_(t, value)`.
    Constant(f64),
    /// `1.0` with probability `p`, else `0.0`: `U53(w0, w1) < p`. Float dtypes only.
    /// PyTorch: `Tensor.bernoulli_(p)`.
    Bernoulli {
        /// The probability of a one, in `[0, 1]`.
        p: f64,
    },
}

impl Distribution {
    /// Checks the parameters, naming the distribution and what to change.
    fn validate(&self, op: &'static str) -> Result<()> {
        let finite = |values: &[f64]| values.iter().all(|v| v.is_finite());
        let problem = match *self {
            Distribution::Uniform { low, high } if !finite(&[low, high, high - low]) => {
                Some("low, high and high - low must be finite; pass finite bounds")
            }
            Distribution::Uniform { low, high } if low > high => Some("low exceeds high; swap the bounds"),
            Distribution::Normal { mean, std } if !finite(&[mean, std]) => {
                Some("mean and std must be finite; pass finite parameters")
            }
            Distribution::Normal { std, .. } if std < 0.0 => Some("std is negative; pass std >= 0"),
            Distribution::TruncNormal { mean, std, low, high } if !finite(&[mean, std, low, high]) => Some(
                "mean, std, low and high must be finite; use bounds a few std from the mean \
                 instead of infinite ones",
            ),
            Distribution::TruncNormal { std, .. } if std <= 0.0 => {
                Some("std must be positive; use Constant for a fixed value")
            }
            Distribution::TruncNormal { low, high, .. } if low > high => Some("low exceeds high; swap the bounds"),
            Distribution::Bernoulli { p } if !(0.0..=1.0).contains(&p) => Some("p must lie in [0, 1]"),
            _ => None,
        };
        match problem {
            None => Ok(()),
            Some(why) => Err(Error::InvalidArgument {
                op,
                detail: format!("{self:?}: {why}"),
            }),
        }
    }

    /// The value of element `index` under `key`, in `f64`, before it is rounded to
    /// a dtype (and, for `Uniform`, moved inside `[low, high)` in that dtype).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for invalid parameters (see [`fill_region`]).
    pub fn sample(&self, key: StreamKey, index: u64) -> Result<f64> {
        self.validate("Distribution::sample")?;
        Ok(Sampler::new(self).value(key.words(index)))
    }
}

/// `U53(a, b)`: the top 53 bits of `b·2³² + a`, times `2⁻⁵³`, in `[0, 1)`.
#[inline(always)]
fn unit(a: u32, b: u32) -> f64 {
    ((u64::from(b) << 32 | u64::from(a)) >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// A validated distribution with what every element needs computed once.
#[derive(Clone, Copy, Debug)]
enum Sampler {
    Uniform {
        low: f64,
        high: f64,
        width: f64,
    },
    Normal {
        mean: f64,
        std: f64,
    },
    // `lo + width·u` in `[lo, hi]` is the argument of erfinv; `scale` is `std·√2`.
    TruncNormal {
        mean: f64,
        scale: f64,
        lo: f64,
        hi: f64,
        width: f64,
        low: f64,
        high: f64,
    },
    Constant(f64),
    Bernoulli {
        p: f64,
    },
}

impl Sampler {
    /// The sampler of a validated distribution.
    fn new(dist: &Distribution) -> Sampler {
        match *dist {
            Distribution::Uniform { low, high } => Sampler::Uniform {
                low,
                high,
                width: high - low,
            },
            Distribution::Normal { mean, std } => Sampler::Normal { mean, std },
            Distribution::TruncNormal { mean, std, low, high } => {
                // erf(x/√2) = 2Φ(x) − 1, without PyTorch's rounding of (1 + erf)/2.
                let lo = special::erf((low - mean) / std * FRAC_1_SQRT_2);
                let hi = special::erf((high - mean) / std * FRAC_1_SQRT_2);
                Sampler::TruncNormal {
                    mean,
                    scale: std * SQRT_2,
                    lo,
                    hi,
                    width: hi - lo,
                    low,
                    high,
                }
            }
            Distribution::Constant(v) => Sampler::Constant(v),
            Distribution::Bernoulli { p } => Sampler::Bernoulli { p },
        }
    }

    /// The `f64` value for an element's Philox words.
    #[inline]
    fn value(&self, w: [u32; 4]) -> f64 {
        match *self {
            Sampler::Uniform { low, width, .. } => low + width * unit(w[0], w[1]),
            Sampler::Normal { mean, std } => {
                let u1 = 1.0 - unit(w[0], w[1]); // (0, 1]: the logarithm is finite
                let u2 = unit(w[2], w[3]);
                mean + std * ((-2.0 * libm::log(u1)).sqrt() * libm::cos(TAU * u2))
            }
            Sampler::TruncNormal {
                mean,
                scale,
                lo,
                hi,
                width,
                low,
                high,
            } => {
                // `min`: lo + width·u may round just above hi (then erfinv(> 1) is NaN).
                let u = (lo + width * unit(w[0], w[1])).min(hi);
                (mean + scale * special::erfinv(u)).clamp(low, high)
            }
            Sampler::Constant(v) => v,
            Sampler::Bernoulli { p } => {
                if unit(w[0], w[1]) < p {
                    1.0
                } else {
                    0.0
                }
            }
        }
    }

    /// For `Uniform` on `low < high`, the smallest and largest values of `T` in
    /// `[low, high)` (as `f64` and as `T`), when `T` has any there.
    fn uniform_bounds<T: Scalar>(&self) -> Option<(f64, f64, T, T)> {
        let Sampler::Uniform { low, high, .. } = *self else {
            return None;
        };
        let lo = T::from_f64(low).to_f64();
        let lo = if lo >= low { lo } else { adjacent::<T>(lo, true) };
        let hi = T::from_f64(high).to_f64();
        let hi = if hi < high { hi } else { adjacent::<T>(hi, false) };
        (low < high && lo >= low && lo <= hi && hi < high).then(|| (lo, hi, T::from_f64(lo), T::from_f64(hi)))
    }
}

/// The neighbour of `x` (a finite or infinite value of float type `T`) in `T`,
/// above when `up`, else below.
fn adjacent<T: Scalar>(x: f64, up: bool) -> f64 {
    // The neighbour of a 16-bit float's bits, as an f64.
    fn step16(bits: u16, up: bool) -> u16 {
        let toward_zero = (bits & 0x8000 == 0) != up;
        match (bits & 0x7fff == 0, toward_zero) {
            (true, _) => {
                if up {
                    0x0001
                } else {
                    0x8001
                }
            }
            (false, true) => bits - 1,
            (false, false) => bits + 1,
        }
    }
    let step = |v: f64| if up { v.next_up() } else { v.next_down() };
    match T::DTYPE {
        DType::F64 => step(x),
        DType::F32 => f64::from(if up {
            (x as f32).next_up()
        } else {
            (x as f32).next_down()
        }),
        DType::BF16 => crate::bf16::from_bits(step16(crate::bf16::from_f64(x).to_bits(), up)).to_f64(),
        DType::F16 => crate::f16::from_bits(step16(crate::f16::from_f64(x).to_bits(), up)).to_f64(),
        _ => x,
    }
}

/// The contiguous tensor of `local_shape` holding the box `[offset, offset +
/// local_shape)` of the global tensor of `global_shape` drawn from `dist` with
/// `key`: element `j` of the box is element `i` of the global tensor (its
/// row-major index), computed from [`key.words(i)`](StreamKey::words) alone. So
/// boxes that tile a tensor hold exactly the bits of [`fill`] of the whole.
///
/// Large boxes are computed on the rank's threads (split by
/// [`par_parts`](crate::kernel::par_parts)); the split does not change a bit.
///
/// PyTorch: the local shard of `torch.distributed.tensor.rand`/`randn` (there
/// through an offset-based RNG tracker; here the counter is the global index).
///
/// # Errors
/// - [`Error::ShapeMismatch`] when `offset` or `local_shape` has another rank than
///   `global_shape`;
/// - [`Error::InvalidArgument`] when the box does not lie inside the global shape,
///   the global tensor has more than 2⁶⁴ elements (an index must fit the counter),
///   the distribution's parameters are invalid (naming the distribution and what
///   to change), a random distribution or `Bernoulli` is asked for an integer
///   dtype, or a `Constant` does not fit the dtype (as for [`Tensor::full`]);
/// - [`Error::OutOfMemory`] when the box cannot be allocated.
pub fn fill_region(
    dist: &Distribution,
    key: StreamKey,
    global_shape: &[usize],
    offset: &[usize],
    local_shape: &[usize],
    dtype: DType,
) -> Result<Tensor> {
    fill_op("fill_region", dist, key, global_shape, offset, local_shape, dtype)
}

/// The whole tensor of `shape` drawn from `dist` with `key`: [`fill_region`] of
/// the box at offset 0 with the global shape.
///
/// PyTorch: `torch.rand`/`randn` after seeding, or the `nn.init` function that
/// `dist` names applied to a new tensor.
///
/// # Errors
/// As [`fill_region`] (but the box always fits).
pub fn fill(dist: &Distribution, key: StreamKey, shape: &[usize], dtype: DType) -> Result<Tensor> {
    fill_op("fill", dist, key, shape, &vec![0; shape.len()], shape, dtype)
}

/// Dropout's scaled mask for the box at `offset` of extent `local_shape` of a
/// tensor of `global_shape`: each element `0` with probability `p`, else
/// `1 / (1 − p)` (`0` everywhere at `p = 1`), drawn at its global index with
/// `key` (a `Bernoulli` of `1 − p`, then scaled in `dtype`), so every box of a
/// tensor holds the whole mask's elements whatever the split.
///
/// # Errors
/// `p` outside `[0, 1]`; an integer dtype; as [`fill_region`].
pub fn dropout_mask_region(
    p: f64,
    key: StreamKey,
    global_shape: &[usize],
    offset: &[usize],
    local_shape: &[usize],
    dtype: DType,
) -> Result<Tensor> {
    check_dropout("dropout", p, dtype)?;
    let keep = Distribution::Bernoulli { p: 1.0 - p };
    let mask = fill_op("dropout", &keep, key, global_shape, offset, local_shape, dtype)?;
    mask.mul_scalar(if p < 1.0 { 1.0 / (1.0 - p) } else { 0.0 })
}

/// Checks dropout's probability and the dtype it scales.
///
/// # Errors
/// [`Error::InvalidArgument`] naming `op`: `p` outside `[0, 1]`, or an integer
/// dtype.
pub fn check_dropout(op: &'static str, p: f64, dtype: DType) -> Result<()> {
    check_dropout_p(op, p)?;
    if !dtype.is_float() {
        return Err(Error::InvalidArgument {
            op,
            detail: format!("the input is {dtype}; dropout scales floating-point values"),
        });
    }
    Ok(())
}

/// Checks dropout's probability alone (a layer checks it when built, before
/// it sees an input).
///
/// # Errors
/// [`Error::InvalidArgument`] naming `op`: `p` outside `[0, 1]`.
pub fn check_dropout_p(op: &'static str, p: f64) -> Result<()> {
    if (0.0..=1.0).contains(&p) {
        return Ok(());
    }
    Err(Error::InvalidArgument {
        op,
        detail: format!("p = {p} is not a probability; pass p in [0, 1]"),
    })
}

impl Tensor {
    /// Dropout: zeroes each element with probability `p` and scales the others
    /// by `1 / (1 − p)`, the mask drawn with `key` at each element's index
    /// ([`dropout_mask_region`]), so `DTensor::dropout` on any placements
    /// drops exactly these elements. `p = 0` is the identity.
    ///
    /// PyTorch: `torch.nn.functional.dropout(x, p, training=True)` (whose mask
    /// comes from the generator's offset instead of a key).
    ///
    /// # Errors
    /// `p` outside `[0, 1]`; integer inputs.
    pub fn dropout(&self, p: f64, key: StreamKey) -> Result<Tensor> {
        check_dropout("dropout", p, self.dtype())?;
        if p == 0.0 {
            return Ok(self.clone());
        }
        let origin = vec![0; self.shape().len()];
        let mask = dropout_mask_region(p, key, self.shape(), &origin, self.shape(), self.dtype())?;
        self.mul(&mask.to(self.device())?)
    }
}

fn fill_op(
    op: &'static str,
    dist: &Distribution,
    key: StreamKey,
    global_shape: &[usize],
    offset: &[usize],
    local_shape: &[usize],
    dtype: DType,
) -> Result<Tensor> {
    check_region(op, global_shape, offset, local_shape)?;
    dist.validate(op)?;
    let sampler = Sampler::new(dist);
    if let Sampler::Constant(v) = sampler {
        return any_dispatch!(op, dtype, T => {
            let x = crate::tensor::fill_value::<T>(op, v)?;
            fill_box(op, global_shape, offset, local_shape, |_| x)
        });
    }
    if !dtype.is_float() {
        return Err(Error::InvalidArgument {
            op,
            detail: format!(
                "{dist:?} draws floats, and dtype {dtype} is not a floating-point type; \
                 fill a float dtype and cast it"
            ),
        });
    }
    float_dispatch!(op, dtype, T => random_box::<T>(op, sampler, key, global_shape, offset, local_shape))
}

/// [`fill_box`] with random values of float type `T`. Generic rather than inside
/// the dtype dispatch, where `T::from_f64` on a concrete `bf16` would name
/// `half`'s inherent method, which rounds otherwise than casts do.
fn random_box<T: Scalar>(
    op: &'static str,
    sampler: Sampler,
    key: StreamKey,
    global_shape: &[usize],
    offset: &[usize],
    local_shape: &[usize],
) -> Result<Tensor> {
    let bounds = sampler.uniform_bounds::<T>();
    fill_box(op, global_shape, offset, local_shape, |i| {
        let v = sampler.value(key.words(i));
        match bounds {
            Some((lo, _, lo_t, _)) if v < lo => lo_t,
            Some((_, hi, _, hi_t)) if v > hi => hi_t,
            _ => T::from_f64(v),
        }
    })
}

#[cfg(test)]
mod tests;
