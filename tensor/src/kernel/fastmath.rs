//! Branch-free `f32` `exp` and `erfc` for the hot loops of softmax, cross
//! entropy and GELU.
//!
//! libm's scalar `expf` and `erfcf` branch on the input's range and cannot be
//! vectorised; these compute every range with plain arithmetic and pick the
//! result with selects, so that a loop over a slice compiles to vector code.
//! Their polynomials are evaluated with fused multiply-adds (one instruction
//! per degree instead of two): the AVX2 and AVX-512 loops of [`Simd::run`]
//! compile them to FMA instructions, and the baseline loop (CPUs without AVX2
//! and FMA) to calls of libm's exactly rounded `fmaf`, slower but the same
//! bits, so results do not depend on the CPU.
//!
//! Accuracy against `f64` libm over dense sweeps of 4·10⁶ points (the tests
//! assert these bounds): [`exp_f32`] within 0.97 ulp on `[-104, 88.72]`
//! (subnormal results counted in the subnormal spacing), asserted <= 1 ulp;
//! [`erfc_f32`] within 4.71 ulp on `[-10, 10]`, asserted <= 5 ulp (libm's
//! scalar `erfcf` measures 3.03 ulp on the same sweep; the FreeBSD rational
//! approximations that this kernel used before, 2.53 ulp, cost 1.4 times as
//! much per element). Special values
//! follow libm: NaN stays NaN, `exp(-inf) = 0`, `exp(+inf) = inf`,
//! `erfc(-inf) = 2`, `erfc(+inf) = 0`.
//!
//! [`exp`] and [`erfc`] take any [`Real`]: `f32` goes through these, `f64`
//! through libm, unchanged.

use super::num::Real;

/// `e^x` for any [`Real`]: the fast kernel for `f32`, libm for `f64`.
#[inline(always)]
pub(crate) fn exp<R: Real>(x: R) -> R {
    // `Real` has two types; the size picks `f32`, and the casts through `f64`
    // are exact round trips that compile away.
    if size_of::<R>() == 4 {
        R::real(f64::from(exp_f32(x.widen() as f32)))
    } else {
        x.exp()
    }
}

/// `erfc(x)` for any [`Real`]: the fast kernel for `f32`, libm for `f64`.
#[inline(always)]
pub(crate) fn erfc<R: Real>(x: R) -> R {
    if size_of::<R>() == 4 {
        R::real(f64::from(erfc_f32(x.widen() as f32)))
    } else {
        x.erfc()
    }
}

/// `out[i] = f(x[i], y[i])` over `out` (which `x` and `y` are at least as
/// long as), with the loop compiled for the baseline target, for AVX2 (eight
/// `f32` lanes instead of four) and for AVX-512 (sixteen), the widest that the
/// CPU has taken, and split over the rank's threads when long enough
/// ([`par_rows`](super::par::par_rows)). All three give the same bits (a fused
/// multiply-add in `f` is one on every one of them).
#[inline(always)]
pub(crate) fn zip_map<A: Copy + Sync, B: Copy + Sync, C: Send>(
    x: &[A],
    y: &[B],
    out: &mut [C],
    f: impl Fn(A, B) -> C + Sync + Copy,
) {
    let simd = Simd::best();
    super::par::par_rows(out, 1, |start, out| {
        let end = start + out.len();
        // By value (a copy): through a reference the call would not inline into
        // the vectorized loop.
        zip_map_on(simd, &x[start..end], &y[start..end], out, f);
    });
}

/// [`zip_map`] over three inputs: `out[i] = f(x[i], y[i], z[i])` over `out`
/// (which the inputs are at least as long as), compiled for the widest vectors
/// the CPU has and split over the rank's threads as [`zip_map`] is.
#[inline(always)]
pub(crate) fn zip3_map<A: Copy + Sync, B: Copy + Sync, C: Copy + Sync, D: Send>(
    x: &[A],
    y: &[B],
    z: &[C],
    out: &mut [D],
    f: impl Fn(A, B, C) -> D + Sync + Copy,
) {
    let simd = Simd::best();
    super::par::par_rows(out, 1, |start, out| {
        let end = start + out.len();
        let (x, y, z) = (&x[start..end], &y[start..end], &z[start..end]);
        simd.run(
            #[inline(always)]
            move || {
                for (((o, &a), &b), &c) in out.iter_mut().zip(x).zip(y).zip(z) {
                    *o = f(a, b, c);
                }
            },
        );
    });
}

/// The instruction sets a kernel's loop is compiled for ([`Simd::run`]): the
/// widest the CPU has is picked at run time, and every one gives the same bits
/// (a fused multiply-add is one rounding on each).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Simd {
    /// The build's baseline target (fused multiply-adds through libm).
    Baseline,
    /// AVX2 with FMA.
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// AVX-512F (with FMA).
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

impl Simd {
    /// The widest that this CPU supports.
    #[inline(always)]
    pub fn best() -> Simd {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("fma") {
                if std::arch::is_x86_feature_detected!("avx512f") {
                    return Simd::Avx512;
                }
                if std::arch::is_x86_feature_detected!("avx2") {
                    return Simd::Avx2;
                }
            }
        }
        Simd::Baseline
    }

    /// Every variant that this CPU supports (for tests that compare them).
    pub fn supported() -> Vec<Simd> {
        let mut all = vec![Simd::Baseline];
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("fma") {
            if std::arch::is_x86_feature_detected!("avx2") {
                all.push(Simd::Avx2);
            }
            if std::arch::is_x86_feature_detected!("avx512f") {
                all.push(Simd::Avx512);
            }
        }
        all
    }

    /// Runs `f` compiled for this instruction set, which the CPU must support
    /// (anything else is a panic: [`Simd::best`] and [`Simd::supported`] only
    /// give supported ones). `f` must be `#[inline(always)]` for its loops to
    /// be compiled for the wider vectors; so must everything it calls that
    /// should be.
    ///
    /// # Panics
    /// When the CPU lacks the instruction set.
    #[inline(always)]
    pub fn run<R>(self, f: impl FnOnce() -> R) -> R {
        match self {
            Simd::Baseline => f(),
            #[cfg(target_arch = "x86_64")]
            Simd::Avx2 => {
                #[target_feature(enable = "avx2,fma")]
                fn avx2<R>(f: impl FnOnce() -> R) -> R {
                    f()
                }
                assert!(
                    std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma"),
                    "Simd::run: no AVX2 and FMA"
                );
                // SAFETY: the CPU supports AVX2 and FMA (asserted just above), the
                // only requirement of calling a function compiled with them.
                unsafe { avx2(f) }
            }
            #[cfg(target_arch = "x86_64")]
            Simd::Avx512 => {
                #[target_feature(enable = "avx512f,fma")]
                fn avx512<R>(f: impl FnOnce() -> R) -> R {
                    f()
                }
                assert!(
                    std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("fma"),
                    "Simd::run: no AVX-512 and FMA"
                );
                // SAFETY: the CPU supports AVX-512F and FMA (asserted just above),
                // the only requirement of calling a function compiled with them.
                unsafe { avx512(f) }
            }
        }
    }
}

/// `out[i] = f(x[i], y[i])` as a plain loop, for row kernels that already run
/// inside [`Simd::run`] (it inlines into their wide-vector code; calling
/// [`zip_map`] once per short row would cost more in dispatch than the row's work).
#[inline(always)]
pub(crate) fn zip_map_inline<A: Copy, B: Copy, C>(x: &[A], y: &[B], out: &mut [C], f: impl Fn(A, B) -> C) {
    for ((o, &a), &b) in out.iter_mut().zip(x).zip(y) {
        *o = f(a, b);
    }
}

/// [`zip_map`] on the loop compiled for `simd` (see [`Simd::run`]).
#[inline(always)]
pub(crate) fn zip_map_on<A: Copy, B: Copy, C>(simd: Simd, x: &[A], y: &[B], out: &mut [C], f: impl Fn(A, B) -> C) {
    simd.run(
        #[inline(always)]
        move || zip_map_inline(x, y, out, f),
    );
}

/// The polynomial with coefficients `c` (highest degree first) at `x`, by
/// Horner's rule with one fused multiply-add per degree.
#[inline(always)]
fn horner<const N: usize>(x: f32, c: &[f32; N]) -> f32 {
    c[1..].iter().fold(c[0], |acc, &k| acc.mul_add(x, k))
}

/// Inputs above this give `inf` (`ln f32::MAX` is 88.72284).
const EXP_HI: f32 = 88.722_84;
/// Inputs below this give 0 (`e^-103.972` is half the smallest subnormal).
const EXP_LO: f32 = -103.972_08;

/// `2^n` for `n` in `-126..=127`, built from its exponent bits.
#[inline(always)]
fn pow2i(n: i32) -> f32 {
    f32::from_bits(((n + 127) as u32) << 23)
}

/// `log2(e)`, for [`exp_hi_lo`]'s range reduction.
const LOG2E: f32 = std::f32::consts::LOG2_E;
/// `ln 2` split so that `n · LN2_HI` is exact for the exponents in range.
const LN2_HI: f32 = 0.693_359_4;
/// The rest of `ln 2` after [`LN2_HI`].
const LN2_LO: f32 = -2.121_944_4e-4;
/// `1.5 · 2^23`: adding it rounds to an integer (to nearest, ties to even),
/// which sits in the low mantissa bits.
const ROUND: f32 = 12_582_912.0;
/// Cephes' polynomial for `(e^r − 1 − r) / r²` on `|r| <= ln2 / 2`,
/// highest degree first.
const EXP_POLY: [f32; 6] = [
    1.987_569_2e-4,
    1.398_2e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    0.5,
];

/// `e^(hi + lo)`, where `lo` is a small correction to `hi` that is added after
/// the range reduction (so that it keeps its low bits when `hi` is large).
#[inline(always)]
fn exp_hi_lo(hi: f32, lo: f32) -> f32 {
    // Cephes `expf`: x = n ln2 + r with |r| <= ln2 / 2, ln2 split so that
    // n * LN2_HI is exact, and a degree-7 polynomial for e^r.
    let x = hi + lo;
    // NaN stays NaN through the clamp.
    let xc = x.clamp(EXP_LO, EXP_HI);
    let t = xc * LOG2E + ROUND;
    let n = t - ROUND;
    let ni = (t.to_bits() as i32) - (ROUND.to_bits() as i32);
    let r = (hi - n * LN2_HI) - n * LN2_LO + lo;
    let r2 = r * r;
    let p = horner(r, &EXP_POLY);
    let y = p * r2 + r + 1.0;
    // 2^n in two factors so that neither overflows nor goes subnormal; the
    // second product rounds once, to a subnormal where the result is one.
    let n1 = ni >> 1;
    let y = y * pow2i(n1) * pow2i(ni - n1);
    if x > EXP_HI {
        f32::INFINITY
    } else if x < EXP_LO {
        0.0
    } else {
        // NaN fails every comparison above and arrives here as NaN.
        y
    }
}

/// `e^x` in `f32`, branch-free.
#[inline(always)]
pub(crate) fn exp_f32(x: f32) -> f32 {
    exp_hi_lo(x, 0.0)
}

/// [`exp_f32`] of sixteen lanes with explicit AVX-512 instructions: the same
/// operations in the same order (the clamp, the range reduction, the
/// polynomial by fused multiply-adds, the two-factor scaling, the selects),
/// so the same bits lane by lane. For kernels whose loop around the `exp` the
/// compiler does not vectorise (a running `f64` sum in the same pass).
///
/// # Safety
/// AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) unsafe fn exp_f32x16(x: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    let f = _mm512_set1_ps;
    // `hi + lo` with `lo = 0` (as `exp_f32` calls `exp_hi_lo`: −0 becomes +0).
    let lo = _mm512_setzero_ps();
    let x = _mm512_add_ps(x, lo);
    // `f32::clamp`, NaN kept: `max_ps` and `min_ps` return their second
    // operand when either is NaN.
    let xc = _mm512_min_ps(f(EXP_HI), _mm512_max_ps(f(EXP_LO), x));
    let t = _mm512_add_ps(_mm512_mul_ps(xc, f(LOG2E)), f(ROUND));
    let n = _mm512_sub_ps(t, f(ROUND));
    let ni = _mm512_sub_epi32(_mm512_castps_si512(t), _mm512_set1_epi32(ROUND.to_bits() as i32));
    let r = _mm512_sub_ps(
        _mm512_sub_ps(x, _mm512_mul_ps(n, f(LN2_HI))),
        _mm512_mul_ps(n, f(LN2_LO)),
    );
    let r = _mm512_add_ps(r, lo);
    let r2 = _mm512_mul_ps(r, r);
    let p = EXP_POLY[1..]
        .iter()
        .fold(f(EXP_POLY[0]), |acc, &k| _mm512_fmadd_ps(acc, r, f(k)));
    let y = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(p, r2), r), f(1.0));
    let pow2i = |n: __m512i| _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(n, _mm512_set1_epi32(127))));
    let n1 = _mm512_srai_epi32::<1>(ni);
    let y = _mm512_mul_ps(_mm512_mul_ps(y, pow2i(n1)), pow2i(_mm512_sub_epi32(ni, n1)));
    let over = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(x, f(EXP_HI));
    let under = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, f(EXP_LO));
    let y = _mm512_mask_blend_ps(over, y, f(f32::INFINITY));
    _mm512_mask_blend_ps(under, y, _mm512_setzero_ps())
}

/// `erfc(x)` in `f32`, branch-free, from two approximations computed for
/// every element and selected per element:
///
/// - `|x| < 0.84375`: `erfc(x) = 1 - x·(1 + P(x²))`, `P` of degree 6 (fit
///   error 1.2e-10), with FreeBSD's `s_erff.c` arrangement of the subtraction;
/// - `|x| >= 0.84375`: `erfc(|x|) = t·exp(-|x|² + Q(s))` with
///   `t = 1/(1 + |x|/2)` and `s` that `t` scaled to `[-1, 1]`, `Q` of degree 8
///   (minimax fit error 6.8e-9 in `Q`, so relative in `erfc`). `-|x|²` is split
///   into an exact high part and a small low part so that the exponent keeps
///   full relative precision in the tail; `erfc(-z) = 2 - erfc(z)`.
///
/// One division and one `exp` per element: less than half the arithmetic of
/// FreeBSD's three rational approximations (three divisions), which a
/// branch-free loop had to compute for every element.
#[inline(always)]
pub(crate) fn erfc_f32(x: f32) -> f32 {
    /// Where the tail approximation takes over.
    const SPLIT: f32 = 0.843_75;
    /// `t` over `[1/(1 + 10.1/2), 1/(1 + SPLIT/2)]` maps to `s = A·t + B` in `[-1, 1]`.
    const A: f32 = 3.717_420_6;
    const B: f32 = -1.614_449_7;
    let z = x.abs();

    let zz = x * x;
    let y = horner(
        zz,
        &[
            8.897_333e-5,
            -0.000_825_676_95,
            0.005_210_253,
            -0.026_862_817,
            0.112_837_52,
            -0.376_126_38,
            0.128_379_17,
        ],
    );
    let small = if x < 0.25 {
        1.0 - x.mul_add(y, x)
    } else {
        0.5 - x.mul_add(y, x - 0.5)
    };

    let t = 1.0 / (1.0 + 0.5 * z);
    let s = t.mul_add(A, B);
    let q = horner(
        s,
        &[
            -5.524_274_5e-6,
            -1.866_092_7e-5,
            8.906_874e-5,
            0.000_295_822_22,
            -0.001_259_322_6,
            -0.006_272_742,
            0.018_703_759,
            0.353_940_37,
            -0.759_268_1,
        ],
    );
    // z with its low 13 bits cleared: zh² is exact, so the large part of the
    // exponent loses nothing; the rest rides along as a correction.
    let zh = f32::from_bits(z.to_bits() & 0xffff_e000);
    let tail = t * exp_hi_lo(-zh * zh, q - (z - zh) * (z + zh));
    let tail = if z < 10.1 { tail } else { 0.0 };

    let big = if x < 0.0 { 2.0 - tail } else { tail };
    if z < SPLIT {
        small
    } else if x.is_nan() {
        x
    } else {
        big
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The distance from `got` to the exact `want` in units of the last place
    /// of `want` rounded to `f32` (the subnormal spacing below the normals).
    fn ulps(got: f32, want: f64) -> f64 {
        if got as f64 == want || (got.is_nan() && want.is_nan()) {
            return 0.0;
        }
        let w = want as f32;
        let ulp = if w.abs() < f32::MIN_POSITIVE {
            f32::from_bits(1) as f64
        } else {
            let next = f32::from_bits(w.abs().to_bits() + 1) as f64;
            next - w.abs() as f64
        };
        (got as f64 - want).abs() / ulp
    }

    /// The largest ulp error of `f` against `want` over `n + 1` points from
    /// `lo` to `hi`, and where it is.
    fn sweep(lo: f32, hi: f32, n: u32, f: impl Fn(f32) -> f32, want: impl Fn(f64) -> f64) -> (f64, f32) {
        (0..=n)
            .map(|i| {
                let x = lo + (hi - lo) * (i as f32 / n as f32);
                (ulps(f(x), want(x as f64)), x)
            })
            .fold((0.0, lo), |a, b| if b.0 > a.0 { b } else { a })
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn exp_f32x16_is_exp_f32_lane_by_lane() {
        if !crate::kernel::avx512::avx512f() {
            // Nothing to compare with: no kernel calls it on this CPU.
            assert!(
                !Simd::supported().contains(&Simd::Avx512),
                "AVX-512F detected one way, not the other"
            );
            return;
        }
        // A dense sweep over every range (overflow, underflow to subnormals and
        // zero, both signs), the boundaries and the special values.
        let mut xs: Vec<f32> = (0..400_000).map(|i| -120.0 + i as f32 * 0.000_52).collect();
        xs.extend([
            0.0,
            -0.0,
            EXP_HI,
            EXP_LO,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::MAX,
            f32::MIN,
            f32::MIN_POSITIVE,
            -f32::MIN_POSITIVE,
            1e-30,
            -1e-30,
            88.72,
            88.73,
            -103.97,
            -103.98,
            -87.33,
        ]);
        xs.extend(
            [EXP_HI, EXP_LO]
                .iter()
                .flat_map(|&b| (-40..40).map(move |d| f32::from_bits((b.to_bits() as i32 + d) as u32))),
        );
        let pad = xs.len().next_multiple_of(16);
        xs.resize(pad, 1.0);
        for c in xs.chunks_exact(16) {
            // SAFETY: AVX-512F detected above; 16 lanes read from and written to arrays of 16.
            let got: [f32; 16] = unsafe {
                let v = std::arch::x86_64::_mm512_loadu_ps(c.as_ptr());
                std::mem::transmute(exp_f32x16(v))
            };
            for (&x, &g) in c.iter().zip(&got) {
                let want = exp_f32(x);
                assert!(
                    g.to_bits() == want.to_bits() || (g.is_nan() && want.is_nan()),
                    "exp({x:e}): {g:e} lane, {want:e} scalar"
                );
            }
        }
    }

    #[test]
    fn exp_error_bound() {
        let (err, at) = sweep(-104.0, 88.72, 4_000_000, exp_f32, f64::exp);
        assert!(err <= 1.0, "exp_f32: {err} ulp at {at}");
        // Near 0, where most softmax inputs are.
        let (err, at) = sweep(-1.0, 1.0, 1_000_000, exp_f32, f64::exp);
        assert!(err <= 1.0, "exp_f32: {err} ulp at {at}");
    }

    #[test]
    fn erfc_error_bound() {
        let (err, at) = sweep(-10.0, 10.0, 4_000_000, erfc_f32, libm::erfc);
        assert!(err <= 5.0, "erfc_f32: {err} ulp at {at}");
        let (lib, at) = sweep(-10.0, 10.0, 4_000_000, libm::erfcf, libm::erfc);
        assert!(lib <= 3.5, "libm erfcf: {lib} ulp at {at}");
    }

    /// Every loop variant gives the same bits (no FMA contraction, same
    /// selects), on a sweep that crosses every range of both kernels, with an
    /// odd length so that the vector loops have a remainder.
    #[test]
    fn simd_variants_agree() {
        let xs: Vec<f32> = (0..20_011)
            .map(|i| -110.0 + 200.0 * i as f32 / 20_011.0)
            .chain([f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.0, -0.0])
            .collect();
        let run = |simd| {
            let mut e = vec![0f32; xs.len()];
            let mut g = vec![0f64; xs.len()];
            zip_map_on(simd, &xs, &xs, &mut e, |x, y| exp_f32(x) + erfc_f32(y * 0.1));
            zip_map_on(simd, &xs, &e, &mut g, |x, e| f64::from(x) * f64::from(e) - 0.5);
            (e, g)
        };
        let (want_e, want_g) = run(Simd::Baseline);
        assert!(
            want_e
                .iter()
                .zip(&xs)
                .take(20_011)
                .all(|(&e, &x)| e == exp_f32(x) + erfc_f32(x * 0.1))
        );
        for simd in Simd::supported() {
            let (e, g) = run(simd);
            let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(same(&e, &want_e), "{simd:?} f32");
            assert!(
                g.iter().zip(&want_g).all(|(x, y)| x.to_bits() == y.to_bits()),
                "{simd:?} f64"
            );
        }
        assert_eq!(Simd::supported().last(), Some(&Simd::best()));
    }

    #[test]
    fn special_values() {
        macro_rules! case {
            ($f:expr, $x:expr, $want:expr) => {
                let got: f32 = $f($x);
                let want: f32 = $want;
                assert!(
                    got == want || (got.is_nan() && want.is_nan()),
                    "{}({}) = {got}, want {want}",
                    stringify!($f),
                    $x
                );
            };
        }
        case!(exp_f32, 0.0, 1.0);
        case!(exp_f32, f32::NEG_INFINITY, 0.0);
        case!(exp_f32, f32::INFINITY, f32::INFINITY);
        case!(exp_f32, f32::NAN, f32::NAN);
        case!(exp_f32, 89.0, f32::INFINITY);
        case!(exp_f32, -105.0, 0.0);
        case!(exp_f32, -103.0, (-103f64).exp() as f32);
        case!(exp_f32, -90.0, (-90f64).exp() as f32);
        case!(erfc_f32, 0.0, 1.0);
        case!(erfc_f32, f32::INFINITY, 0.0);
        case!(erfc_f32, f32::NEG_INFINITY, 2.0);
        case!(erfc_f32, f32::NAN, f32::NAN);
        case!(erfc_f32, 30.0, 0.0);
        case!(erfc_f32, -30.0, 2.0);
        assert_eq!(exp(1.0f64), 1f64.exp());
        assert_eq!(erfc(0.5f64), libm::erfc(0.5));
        assert_eq!(exp(0.5f32), exp_f32(0.5));
        assert_eq!(erfc(0.5f32), erfc_f32(0.5));
    }
}
