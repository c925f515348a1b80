//! The numeric traits every kernel is written over, one family: [`Scalar`]
//! (conversions between any two element types), [`Float`] (a float element
//! type and the type it computes in) and [`Real`] (that type: `f32` or `f64`).
//! The optimizers compute in [`Real`] too.

use std::ops::{Add, Div, Mul, Neg, Sub};

use half::{bf16, f16};
use tessera_mesh::{DType, Element};

/// The arithmetic type a kernel computes in: `f32` or `f64` (`bf16` and `f16`
/// compute in `f32`). The element-wise optimizers compute in it too.
pub trait Real:
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
    /// 0.
    const ZERO: Self;
    /// 1.
    const ONE: Self;
    /// −∞.
    const NEG_INFINITY: Self;
    /// Rounds `v` to this type (to nearest, as PyTorch turns a Python float into a
    /// kernel scalar).
    fn real(v: f64) -> Self;
    /// Widens to `f64` (exact).
    fn widen(self) -> f64;
    /// Whether this is a NaN.
    fn is_nan(self) -> bool;
    /// `e^self` (libm's).
    fn exp(self) -> Self;
    /// The natural logarithm.
    fn ln(self) -> Self;
    /// The square root (correctly rounded).
    fn sqrt(self) -> Self;
    /// The hyperbolic tangent.
    fn tanh(self) -> Self;
    /// The absolute value.
    fn abs(self) -> Self;
    /// `self^e`.
    fn powf(self, e: Self) -> Self;
    /// The error function.
    fn erf(self) -> Self;
    /// The complementary error function, `1 − erf(self)`.
    fn erfc(self) -> Self;
    /// `self · a + b` with one rounding (the `fmadd` of vectorised kernels; one
    /// instruction where the loop is compiled with FMA, libm's correctly rounded
    /// software fallback elsewhere: the same bits).
    fn mul_add(self, a: Self, b: Self) -> Self;
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
            #[inline(always)]
            fn mul_add(self, a: Self, b: Self) -> Self {
                <$t>::mul_add(self, a, b)
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
    |a: f32| bf16::from_bits(bf16_bits(a.to_bits()))
);
float!(f16, f32, f16::to_f32, f16::from_f32);

/// Conversions between element types, shared by every kernel.
///
/// Semantics (documented on [`Tensor::cast`](crate::Tensor::cast)): float to
/// float rounds to nearest (half types through `f32`, as PyTorch does); float to
/// integer truncates toward zero and saturates, NaN gives 0; integer to integer
/// wraps (two's complement, as PyTorch does).
pub(crate) trait Scalar: Element {
    /// Mantissa bits including the implicit one (0 for integers).
    const MANTISSA_BITS: u32;
    /// The smallest and largest values, for range checks of integer fills.
    const RANGE: (f64, f64);
    fn to_f64(self) -> f64;
    fn from_f64(v: f64) -> Self;
    fn to_i64(self) -> i64;
    fn from_i64(v: i64) -> Self;
}

macro_rules! scalar_float {
    ($t:ty, $bits:expr, $to:expr, $from:expr) => {
        impl Scalar for $t {
            const MANTISSA_BITS: u32 = $bits;
            const RANGE: (f64, f64) = (f64::NEG_INFINITY, f64::INFINITY);
            fn to_f64(self) -> f64 {
                $to(self)
            }
            fn from_f64(v: f64) -> Self {
                $from(v)
            }
            fn to_i64(self) -> i64 {
                self.to_f64() as i64
            }
            fn from_i64(v: i64) -> Self {
                Self::from_f64(v as f64)
            }
        }
    };
}
scalar_float!(f32, 24, |x: f32| x as f64, |v: f64| v as f32);
scalar_float!(f64, 53, |x: f64| x, |v: f64| v);
scalar_float!(bf16, 8, bf16::to_f64, |v: f64| bf16::from_f32(v as f32));
scalar_float!(f16, 11, f16::to_f64, |v: f64| f16::from_f32(v as f32));

macro_rules! scalar_int {
    ($t:ty) => {
        impl Scalar for $t {
            const MANTISSA_BITS: u32 = 0;
            const RANGE: (f64, f64) = (<$t>::MIN as f64, <$t>::MAX as f64);
            fn to_f64(self) -> f64 {
                self as f64
            }
            fn from_f64(v: f64) -> Self {
                v as $t
            }
            fn to_i64(self) -> i64 {
                self as i64
            }
            fn from_i64(v: i64) -> Self {
                v as $t
            }
        }
    };
}
scalar_int!(i64);
scalar_int!(u8);

/// Converts one element from `S` to `D` with the semantics of [`Scalar`].
pub(crate) fn convert<S: Scalar, D: Scalar>(s: S) -> D {
    if S::DTYPE.is_float() || D::DTYPE.is_float() {
        D::from_f64(s.to_f64())
    } else {
        D::from_i64(s.to_i64())
    }
}

/// [`convert`] over a slice, appended to `dst` (`dst.push(convert(x))` for each
/// `x`), in loops of integer bit operations (which vectorize) for the
/// mixed-precision pairs `bf16 → f32` (exact: the bits shifted) and `f32 → bf16`
/// (round to nearest even, NaN kept quiet), with the same values as `convert`.
pub(crate) fn convert_extend<S: Scalar, D: Scalar>(src: &[S], dst: &mut Vec<D>) {
    // Compiled for the widest vectors the CPU has.
    super::Simd::best().run(
        #[inline(always)]
        || match (S::DTYPE, D::DTYPE) {
            (DType::BF16, DType::F32) => {
                let src: &[u16] = bytemuck::cast_slice(src);
                dst.extend(src.iter().map(|&s| bytemuck::cast::<u32, D>(u32::from(s) << 16)));
            }
            (DType::F32, DType::BF16) => {
                let src: &[u32] = bytemuck::cast_slice(src);
                dst.extend(src.iter().map(|&s| bytemuck::cast::<u16, D>(bf16_bits(s))));
            }
            _ => dst.extend(src.iter().map(|&s| convert::<S, D>(s))),
        },
    )
}

/// The `bf16` nearest to the `f32` with bits `x` (ties to even), as bits; a NaN
/// stays a (quiet) NaN of the same sign.
#[inline(always)]
pub(crate) fn bf16_bits(x: u32) -> u16 {
    let nan = x & 0x7fff_ffff > 0x7f80_0000;
    // Adding just under half a unit of the last kept bit, plus that bit, carries
    // into it exactly when the dropped bits exceed half, or equal it and it is odd.
    // Only a NaN's bits can wrap, and then `rounded` is not used.
    let rounded = x.wrapping_add(0x7fff + ((x >> 16) & 1)) >> 16;
    if nan { ((x >> 16) | 0x40) as u16 } else { rounded as u16 }
}

#[cfg(test)]
mod tests {
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
