//! The error function and its inverse in `f64`, for the truncated normal.
//!
//! `erf` and `erfc` are the pure-Rust `libm` crate's (ports of FreeBSD's msun,
//! within an ulp, and the same bits on every platform, which a generator whose
//! values must agree across the nodes of a run needs); `erfinv` is written here.

use std::f64::consts::FRAC_2_SQRT_PI;

/// The error function (libm's, within an ulp).
#[inline]
pub(crate) fn erf(x: f64) -> f64 {
    libm::erf(x)
}

/// The inverse error function: the `y` with `erf(y) = x` for `x` in `(-1, 1)`;
/// `±∞` at `±1`, NaN outside `[-1, 1]` and for NaN. Relative error below `1e-14`
/// over the whole range (tested against 30-digit values).
///
/// Giles' single-precision approximation ("Approximating the erfinv function",
/// GPU Computing Gems, 2011) as the first guess, then refined on libm's `erf`
/// and `erfc`: Halley steps on `erf(y) − x` in the centre (`|x| ≤ 0.5`), Newton
/// steps on `ln erfc(|y|) − ln(1 − |x|)` in the tails, where `1 − |x|` is exact
/// and the logarithm makes the equation nearly quadratic, so that even
/// `x = 1 − 2⁻⁵³` (beyond the range the first guess was made for) converges in a
/// few steps. The number of steps depends only on `x`: the same bits everywhere.
pub(crate) fn erfinv(x: f64) -> f64 {
    if x.is_nan() || x.abs() > 1.0 {
        return f64::NAN;
    }
    if x.abs() == 1.0 {
        return x * f64::INFINITY;
    }
    if x == 0.0 {
        return x; // ±0 keeps its sign
    }
    let ax = x.abs();
    let mut y = giles(ax);
    if ax <= 0.5 {
        // erf' = 2/√π e^{−y²} and erf'' = −2y erf', so Halley's step is f / (erf' + y f).
        for _ in 0..2 {
            let f = erf(y) - ax;
            y -= f / (FRAC_2_SQRT_PI * libm::exp(-y * y) + y * f);
        }
    } else {
        // 1 − ax is exact for ax in [0.5, 1] (Sterbenz), and at least 2⁻⁵³.
        let tail = 1.0 - ax;
        for _ in 0..8 {
            let c = libm::erfc(y);
            let f = libm::log(c / tail);
            // d/dy ln erfc(y) = −(2/√π) e^{−y²} / erfc(y).
            let step = f / (-FRAC_2_SQRT_PI * libm::exp(-y * y) / c);
            y -= step;
            if step.abs() <= 1e-16 * y {
                break;
            }
        }
    }
    y.copysign(x)
}

/// Giles' single-precision approximation of `erfinv(x)` for `x` in `(0, 1)`,
/// evaluated in `f64` (relative error about `1e-7` for `1 − x ≥ 2⁻²⁴`, about
/// 10% at `1 − 2⁻⁵³`).
fn giles(x: f64) -> f64 {
    const CENTRE: [f64; 9] = [
        2.810_226_36e-08,
        3.432_739_39e-07,
        -3.523_387_7e-06,
        -4.391_506_54e-06,
        0.000_218_580_87,
        -0.001_253_725_03,
        -0.004_177_681_64,
        0.246_640_727,
        1.501_409_41,
    ];
    const TAIL: [f64; 9] = [
        -0.000_200_214_257,
        0.000_100_950_558,
        0.001_349_343_22,
        -0.003_673_428_44,
        0.005_739_507_73,
        -0.007_622_461_3,
        0.009_438_870_47,
        1.001_674_06,
        2.832_976_82,
    ];
    let w = -libm::log((1.0 - x) * (1.0 + x));
    let (coeffs, w) = if w < 5.0 {
        (&CENTRE, w - 2.5)
    } else {
        (&TAIL, w.sqrt() - 3.0)
    };
    coeffs.iter().fold(0.0, |p, &c| c + p * w) * x
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `erf`, `erfc` and `erfinv` against 20-digit values of the `f64` inputs
    /// (mpmath at 30 digits; the decimal inputs differ, which matters where
    /// `erfinv` is steep: its slope at 0.999999999 is 10⁸).
    #[test]
    // The references keep all 20 digits; the compiler rounds them.
    #[allow(clippy::excessive_precision)]
    fn known_values() {
        macro_rules! case {
            ($f:expr, $x:expr => $want:expr) => {
                let (got, want): (f64, f64) = ($f($x), $want);
                let err = ((got - want) / want).abs();
                assert!(
                    err < 1e-14,
                    "{}({:e}) = {got:e}, want {want:e} (rel err {err:e})",
                    stringify!($f),
                    $x
                );
            };
        }
        case!(erf, 0.01 => 0.011283415555849617151);
        case!(erf, 0.5 => 0.52049987781304653768);
        case!(erf, 1.0 => 0.84270079294971486934);
        case!(erf, 2.0 => 0.99532226501895273416);
        case!(erf, -1.5 => -0.96610514647531072707);
        case!(erf, 4.0 => 0.99999998458274209972);
        case!(libm::erfc, 4.0 => 1.5417257900280018852e-8);
        case!(libm::erfc, 6.0 => 2.1519736712498913117e-17);
        case!(erfinv, 1e-300 => 8.8622692545275803586e-301);
        case!(erfinv, 1e-10 => 8.8622692545275804594e-11);
        case!(erfinv, 0.1 => 0.088855990494257691974);
        case!(erfinv, -0.3 => -0.27246271472675434502);
        case!(erfinv, 0.5 => 0.47693627620446987338);
        case!(erfinv, 0.9 => 1.1630871536766741628);
        case!(erfinv, -0.999 => -2.3267537655135244939);
        case!(erfinv, 0.999999999 => 4.3200053881053620459);
        // The largest f64 below 1: 1 − 2⁻⁵³.
        case!(erfinv, 1.0 - f64::EPSILON / 2.0 => 5.8635847487551679272);
    }

    #[test]
    fn erfinv_edges_and_round_trips() {
        assert_eq!(erfinv(1.0), f64::INFINITY);
        assert_eq!(erfinv(-1.0), f64::NEG_INFINITY);
        assert!(erfinv(1.5).is_nan() && erfinv(-1.0000001).is_nan() && erfinv(f64::NAN).is_nan());
        assert_eq!(erfinv(0.0).to_bits(), 0.0f64.to_bits());
        assert_eq!(erfinv(-0.0).to_bits(), (-0.0f64).to_bits());
        // erf(erfinv(x)) = x to a few ulps of x (erf is well conditioned in y).
        for i in 1..2000 {
            let x = -1.0 + i as f64 / 1000.0;
            let back = erf(erfinv(x));
            assert!((back - x).abs() <= 4.0 * f64::EPSILON, "{x}: erf(erfinv) = {back}");
        }
        // erfinv(erf(y)) = y where erf(y) is not yet 1 to within the precision of y.
        for i in -500..=500 {
            let y = i as f64 / 100.0;
            let err = (erfinv(erf(y)) - y).abs();
            // d erfinv / dx = √π/2 e^{y²}: an ulp of erf(y) moves y by that much.
            let tol = 4.0 * f64::EPSILON * (1.0 + libm::exp(y * y));
            assert!(err <= tol, "{y}: error {err:e} above {tol:e}");
        }
    }
}
