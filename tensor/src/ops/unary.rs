//! Unary element-wise ops (activations and math functions), and GELU's backward.

use std::mem::MaybeUninit;

use super::elementwise::Binary;
use super::lookup::{self, Half, TABLE_MIN};
use super::{elements, output, same_dtype, same_shape};
use crate::kernel::{Float, Real, float_dispatch};
use crate::kernel::{erfc, exp, zip_map, zip3_map};
use crate::{DType, Error, Result, Tensor};

/// A unary element-wise operation, computed in the [`Real`] type of its dtype.
pub(crate) trait Unary {
    /// The name of the op's CUDA kernels (`unary_NAME_T`).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    const KERNEL: &'static str;

    /// Whether a large `bf16` or `f16` tensor reads the op from a table of its
    /// 65,536 inputs ([`lookup`](super::lookup)) rather than computing it:
    /// for ops costlier than the load.
    const TABLED: bool;

    fn apply<R: Real>(x: R) -> R;
}

/// `1 / sqrt(2)`.
const FRAC_1_SQRT_2: f64 = std::f64::consts::FRAC_1_SQRT_2;
/// `1 / sqrt(2 pi)`.
const FRAC_1_SQRT_2PI: f64 = 0.398_942_280_401_432_7;

macro_rules! unary_op {
    ($name:ident, $kernel:literal, $tabled:literal, |$x:ident| $body:expr) => {
        pub(crate) struct $name;
        impl Unary for $name {
            const KERNEL: &'static str = $kernel;
            const TABLED: bool = $tabled;

            #[inline(always)]
            fn apply<R: Real>($x: R) -> R {
                $body
            }
        }
    };
}
unary_op!(NegOp, "neg", false, |x| -x);
unary_op!(ExpOp, "exp", true, |x| exp(x));
unary_op!(LogOp, "log", true, |x| x.ln());
unary_op!(SqrtOp, "sqrt", false, |x| x.sqrt());
unary_op!(RsqrtOp, "rsqrt", true, |x| R::ONE / x.sqrt());
unary_op!(TanhOp, "tanh", true, |x| x.tanh());
unary_op!(ErfOp, "erf", true, |x| x.erf());
// 0.5 x (1 + erf(x / sqrt 2)) = 0.5 x erfc(-x / sqrt 2), without the cancellation
// of 1 + erf for negative x.
// `erfc` and `exp` are the branch-free `f32` kernels of `fastmath` (libm for `f64`).
unary_op!(GeluOp, "gelu", true, |x| R::real(0.5)
    * x
    * erfc(-x * R::real(FRAC_1_SQRT_2)));
// `x <= 0` is false for NaN, so NaN propagates as in PyTorch.
unary_op!(ReluOp, "relu", false, |x| if x <= R::ZERO { R::ZERO } else { x });
unary_op!(SigmoidOp, "sigmoid", true, |x| R::ONE / (R::ONE + exp(-x)));
unary_op!(SiluOp, "silu", true, |x| x / (R::ONE + exp(-x)));
unary_op!(AbsOp, "abs", false, |x| x.abs());
unary_op!(SquareOp, "square", false, |x| x * x);

/// `grad * gelu'(x)` with `gelu'(x) = Φ(x) + x φ(x)`.
pub(crate) struct GeluBackwardOp;
impl GeluBackwardOp {
    /// `gelu'(x) = Φ(x) + x φ(x)`.
    #[inline(always)]
    fn derivative<R: Real>(x: R) -> R {
        let cdf = R::real(0.5) * erfc(-x * R::real(FRAC_1_SQRT_2));
        let pdf = R::real(FRAC_1_SQRT_2PI) * exp(R::real(-0.5) * x * x);
        cdf + x * pdf
    }
}

impl Binary for GeluBackwardOp {
    const KERNEL: &'static str = "gelu_backward";

    #[inline(always)]
    fn apply<R: Real>(g: R, x: R) -> R {
        g * Self::derivative(x)
    }
}

/// An activation's input gradient from its output's gradient `g` and its
/// input `x`, element by element in the compute type.
trait InputGrad {
    fn grad<R: Real>(g: R, x: R) -> R;
}

impl InputGrad for GeluBackwardOp {
    #[inline(always)]
    fn grad<R: Real>(g: R, x: R) -> R {
        <Self as Binary>::apply(g, x)
    }
}

/// `Op::grad(g, x)` per element of the host tensors `g` and `x` (shapes and
/// float dtypes equal: [`input_grad_checks`]), rounded once to their dtype.
fn input_grad<Op: InputGrad>(op: &'static str, g: &Tensor, x: &Tensor) -> Result<Tensor> {
    float_dispatch!(op, g.dtype(), T => {
        let (gv, xv) = (elements::<T>(g)?, elements::<T>(x)?);
        let fill = |out: &mut [MaybeUninit<T>]| {
            zip_map(&gv, &xv, out, #[inline(always)] |g, x| {
                MaybeUninit::new(T::from_acc(Op::grad(g.to_acc(), x.to_acc())))
            });
        };
        // SAFETY: `zip_map` writes every element of the output (`g` and `x`
        // are as long: their shapes are equal).
        output(unsafe { crate::alloc::written(op, g.shape(), fill)? }, g.shape())
    })
}

/// The checks of an activation's input gradient (`g` the output's gradient,
/// `x` the input): equal shapes and dtypes; then, for meta tensors, the
/// planned output.
///
/// # Errors
/// [`Error::ShapeMismatch`] and [`Error::DTypeMismatch`] naming `op`.
fn input_grad_checks(op: &'static str, g: &Tensor, x: &Tensor) -> Result<Option<Result<Tensor>>> {
    same_shape(op, g, x, "input")?;
    Ok(super::meta_float(op, &[g, x], g.shape(), g.dtype()))
}

/// `grad · silu'(x)` in PyTorch's arrangement: with `s = 1 / (1 + e^-x)`,
/// `grad · s · (1 + x · (1 − s))`.
struct SiluBackwardOp;
impl InputGrad for SiluBackwardOp {
    #[inline(always)]
    fn grad<R: Real>(g: R, x: R) -> R {
        let s = R::ONE / (R::ONE + exp(-x));
        g * s * (R::ONE + x * (R::ONE - s))
    }
}

/// `grad · gelu'(x)` as [`GeluBackwardOp`], given also the output
/// `y = gelu(x) = x·Φ(x)`: the CDF is read off it as `Φ(x) = y / x` (one
/// division instead of an `erfc`), and `Φ(x) = 1/2` where `|x|` is below
/// `2⁻²⁴` (`f32`) or `2⁻⁵³` (`f64`), where `Φ(x)` rounds to `1/2` and `y / x`
/// would lose precision (`x = 0`, subnormal `y`).
struct GeluBackwardFromOutputOp;
impl GeluBackwardFromOutputOp {
    #[inline(always)]
    fn apply<R: Real>(g: R, x: R, y: R) -> R {
        let tiny = if size_of::<R>() == 4 {
            2f64.powi(-24)
        } else {
            2f64.powi(-53)
        };
        let cdf = if x.abs() < R::real(tiny) { R::real(0.5) } else { y / x };
        let pdf = R::real(FRAC_1_SQRT_2PI) * exp(R::real(-0.5) * x * x);
        g * (cdf + x * pdf)
    }
}

/// The error of [`Tensor::gelu_backward_with_output`] (and its `DTensor`
/// counterpart) unless the gradient, input and output shapes are equal.
///
/// # Errors
/// [`Error::ShapeMismatch`] naming the three shapes.
pub fn gelu_backward_shapes(g: &[usize], x: &[usize], y: &[usize]) -> Result<()> {
    if g == x && g == y {
        return Ok(());
    }
    Err(Error::ShapeMismatch {
        op: "gelu_backward",
        detail: format!("gradient {g:?}, input {x:?} and output {y:?}: the three shapes must be equal"),
    })
}

fn unary<Op: Unary + 'static>(op: &'static str, t: &Tensor) -> Result<Tensor> {
    if let Some(out) = super::meta_float(op, &[t], t.shape(), t.dtype()) {
        return out;
    }
    #[cfg(feature = "cuda")]
    if t.is_cuda() {
        return crate::cuda::ops::unary(Op::KERNEL, op, t);
    }
    if Op::TABLED && t.numel() >= TABLE_MIN {
        fn tabled<Op: Unary + 'static, T: Half>(op: &'static str, t: &Tensor) -> Result<Tensor> {
            let x = elements::<T>(t)?;
            let fill =
                |out: &mut [MaybeUninit<T>]| lookup::map::<Op, T>(&x, out, |x| T::from_acc(Op::apply(x.to_acc())));
            // SAFETY: `map` writes every element of the output (`x` is as long).
            output(unsafe { crate::alloc::written(op, t.shape(), fill)? }, t.shape())
        }
        match t.dtype() {
            DType::BF16 => return tabled::<Op, half::bf16>(op, t),
            DType::F16 => return tabled::<Op, half::f16>(op, t),
            _ => {}
        }
    }
    float_dispatch!(op, t.dtype(), T => {
        let x = elements::<T>(t)?;
        let fill = |out: &mut [MaybeUninit<T>]| {
            zip_map(&x, &x, out, #[inline(always)] |x, _| MaybeUninit::new(T::from_acc(Op::apply(x.to_acc()))));
        };
        // SAFETY: `zip_map` writes every element of the output (`x` is as long).
        output(unsafe { crate::alloc::written(op, t.shape(), fill)? }, t.shape())
    })
}

macro_rules! unary_methods {
    ($($(#[$doc:meta])* $name:ident, $Op:ty, $torch:literal;)*) => {
        impl Tensor {
            $(
                $(#[$doc])*
                #[doc = concat!("\n\nPyTorch: `", $torch, "`.")]
                ///
                /// # Errors
                /// [`Error::InvalidArgument`] for integer tensors.
                pub fn $name(&self) -> Result<Tensor> {
                    unary::<$Op>(stringify!($name), self)
                }
            )*
        }
    };
}

unary_methods! {
    /// Element-wise `-x`.
    neg, NegOp, "torch.neg";
    /// Element-wise `e^x`.
    exp, ExpOp, "torch.exp";
    /// Element-wise natural logarithm (`-inf` at 0, NaN below).
    log, LogOp, "torch.log";
    /// Element-wise square root.
    sqrt, SqrtOp, "torch.sqrt";
    /// Element-wise `1 / sqrt(x)`.
    rsqrt, RsqrtOp, "torch.rsqrt";
    /// Element-wise hyperbolic tangent.
    tanh, TanhOp, "torch.tanh";
    /// Element-wise error function.
    erf, ErfOp, "torch.erf";
    /// Exact GELU, `0.5·x·(1 + erf(x/√2))`, computed as `0.5·x·erfc(-x/√2)` so
    /// that negative inputs keep full relative precision (PyTorch's `f32` kernel
    /// loses it to cancellation there; elsewhere the two agree to about 1e-7).
    gelu, GeluOp, "torch.nn.functional.gelu(x, approximate='none')";
    /// Element-wise `max(x, 0)`; NaN stays NaN.
    relu, ReluOp, "torch.relu";
    /// Element-wise logistic function `1 / (1 + e^-x)`.
    sigmoid, SigmoidOp, "torch.sigmoid";
    /// Element-wise `x · sigmoid(x)`.
    silu, SiluOp, "torch.nn.functional.silu";
    /// Element-wise absolute value.
    abs, AbsOp, "torch.abs";
    /// Element-wise `x²`.
    square, SquareOp, "torch.square";
}

impl Tensor {
    /// The gradient of exact [`gelu`](Self::gelu) with respect to its input `x`,
    /// given the gradient `self` of its output: `self · (Φ(x) + x·φ(x))`, with
    /// Φ and φ the standard normal CDF and density. Shapes must be equal.
    /// PyTorch: `torch.ops.aten.gelu_backward(grad, x)`.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] when the shapes differ; [`Error::DTypeMismatch`]
    /// when the dtypes differ; [`Error::InvalidArgument`] for integer tensors.
    pub fn gelu_backward(&self, x: &Tensor) -> Result<Tensor> {
        const OP: &str = "gelu_backward";
        if let Some(out) = input_grad_checks(OP, self, x)? {
            return out;
        }
        #[cfg(feature = "cuda")]
        if self.is_cuda() || x.is_cuda() {
            return crate::cuda::ops::binary(GeluBackwardOp::KERNEL, OP, self, x, self.shape());
        }
        if self.numel() >= TABLE_MIN {
            fn tabled<T: Half>(g: &Tensor, x: &Tensor) -> Result<Tensor>
            where
                T::Acc: Send + Sync + 'static,
            {
                let (g, x, shape) = (elements::<T>(g)?, elements::<T>(x)?, g.shape());
                let fill = |out: &mut [MaybeUninit<T>]| {
                    lookup::scale::<GeluBackwardOp, T>(&g, &x, out, GeluBackwardOp::derivative)
                };
                // SAFETY: `scale` writes every element of the output (`g` and
                // `x` are as long: their shapes are equal).
                output(unsafe { crate::alloc::written(OP, shape, fill)? }, shape)
            }
            match self.dtype() {
                DType::BF16 => return tabled::<half::bf16>(self, x),
                DType::F16 => return tabled::<half::f16>(self, x),
                _ => {}
            }
        }
        input_grad::<GeluBackwardOp>(OP, self, x)
    }

    /// The gradient of [`silu`](Self::silu) with respect to its input `x`,
    /// given the gradient `self` of its output: `self · s · (1 + x · (1 − s))`
    /// with `s = sigmoid(x)`, in the compute type (`f32` for `bf16` and `f16`)
    /// and rounded once, in PyTorch's order of operations. Shapes must be
    /// equal. PyTorch: `torch.ops.aten.silu_backward(grad, x)`.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] when the shapes differ; [`Error::DTypeMismatch`]
    /// when the dtypes differ; [`Error::InvalidArgument`] for integer tensors.
    pub fn silu_backward(&self, x: &Tensor) -> Result<Tensor> {
        const OP: &str = "silu_backward";
        if let Some(out) = input_grad_checks(OP, self, x)? {
            return out;
        }
        #[cfg(feature = "cuda")]
        if self.is_cuda() || x.is_cuda() {
            // The device composes it from its element-wise kernels.
            let s = x.sigmoid()?;
            return self.mul(&s.add(&x.mul(&s)?.sub(&x.mul(&s.square()?)?)?)?);
        }
        input_grad::<SiluBackwardOp>(OP, self, x)
    }

    /// [`gelu_backward`](Self::gelu_backward) given also GELU's output
    /// `y = x.gelu()`, which autograd keeps anyway: for `f32` and `f64` the
    /// normal CDF `Φ(x)` is read off it as `y / x` instead of computed again
    /// (`erfc`), about three times as fast; the result is within a few ulp of
    /// [`gelu_backward`](Self::gelu_backward)'s. `bf16` and `f16` ignore `y`
    /// (rounded to 8 or 11 bits, `y / x` would be that coarse) and compute
    /// `Φ(x)` from `x`. `y` must be `x.gelu()`: any other tensor gives a wrong
    /// gradient.
    ///
    /// PyTorch: `torch.ops.aten.gelu_backward(grad, x)`, which takes `x` only.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] when the three shapes differ;
    /// [`Error::DTypeMismatch`] when the dtypes differ; [`Error::InvalidArgument`]
    /// for integer tensors.
    pub fn gelu_backward_with_output(&self, x: &Tensor, y: &Tensor) -> Result<Tensor> {
        const OP: &str = "gelu_backward";
        gelu_backward_shapes(self.shape(), x.shape(), y.shape())?;
        same_dtype(OP, self, x)?;
        same_dtype(OP, self, y)?;
        fn from_output<T: Float>(g: &Tensor, x: &Tensor, y: &Tensor) -> Result<Tensor> {
            let shape = g.shape();
            let (g, x, y) = (elements::<T>(g)?, elements::<T>(x)?, elements::<T>(y)?);
            let fill = |out: &mut [MaybeUninit<T>]| {
                zip3_map(
                    &g,
                    &x,
                    &y,
                    out,
                    #[inline(always)]
                    |g, x, y| {
                        MaybeUninit::new(T::from_acc(GeluBackwardFromOutputOp::apply(
                            g.to_acc(),
                            x.to_acc(),
                            y.to_acc(),
                        )))
                    },
                );
            };
            // SAFETY: `zip3_map` writes every element of the output (the three
            // inputs are as long: their shapes are equal).
            output(unsafe { crate::alloc::written(OP, shape, fill)? }, shape)
        }
        if let Some(out) = super::meta_float(OP, &[self, x, y], self.shape(), self.dtype()) {
            return out;
        }
        match self.dtype() {
            #[cfg(feature = "cuda")]
            _ if self.is_cuda() => self.gelu_backward(x),
            DType::F32 => from_output::<f32>(self, x, y),
            DType::F64 => from_output::<f64>(self, x, y),
            _ => self.gelu_backward(x),
        }
    }
}

#[cfg(test)]
mod tests {
    use tessera_mesh::DType;

    use super::*;
    use crate::ops::testutil::{assert_close, sample, tol};

    fn erf64(x: f64) -> f64 {
        libm::erf(x)
    }

    #[test]
    fn unary_table() {
        macro_rules! case {
            ($method:ident, $f:expr) => {
                for dtype in [DType::F32, DType::F64, DType::BF16, DType::F16] {
                    // A contiguous tensor and a strided view, with an empty one too.
                    let base = sample(&[3, 4], dtype, 11);
                    for t in [
                        base.clone(),
                        base.transpose(0, 1).unwrap(),
                        base.narrow(1, 4, 0).unwrap(),
                    ] {
                        let got = t.$method().unwrap();
                        assert_eq!((got.shape(), got.dtype()), (t.shape(), dtype));
                        let want: Vec<f64> = t.to_f64_vec().into_iter().map($f).collect();
                        let what = format!("{} {dtype} {:?}", stringify!($method), t.shape());
                        // Transcendental functions of f32 are within a few ulp.
                        assert_close(&got, &want, 4.0 * tol(dtype), &what);
                    }
                }
            };
        }
        case!(neg, |x: f64| -x);
        case!(exp, f64::exp);
        case!(log, f64::ln);
        case!(sqrt, f64::sqrt);
        case!(rsqrt, |x: f64| 1.0 / x.sqrt());
        case!(tanh, f64::tanh);
        case!(erf, erf64);
        case!(gelu, |x: f64| 0.5 * x * (1.0 + erf64(x / 2f64.sqrt())));
        case!(relu, |x: f64| x.max(0.0));
        case!(sigmoid, |x: f64| 1.0 / (1.0 + (-x).exp()));
        case!(silu, |x: f64| x / (1.0 + (-x).exp()));
        case!(abs, f64::abs);
        case!(square, |x: f64| x * x);
    }

    #[test]
    fn known_values() {
        macro_rules! case {
            ($method:ident, $x:expr, $want:expr, $rtol:expr) => {
                let t = Tensor::from_vec(vec![$x as f64], &[1]).unwrap();
                let got = t.$method().unwrap().to_vec::<f64>().unwrap()[0];
                let want: f64 = $want;
                assert!(
                    (got - want).abs() <= $rtol * want.abs(),
                    "{}({}) = {got}, want {want}",
                    stringify!($method),
                    $x
                );
                let t = t.cast(DType::F32).unwrap();
                let got = t.$method().unwrap().to_vec::<f32>().unwrap()[0] as f64;
                assert!(
                    (got - want).abs() <= 2e-7 * want.abs(),
                    "f32 {}({}) = {got}, want {want}",
                    stringify!($method),
                    $x
                );
            };
        }
        case!(gelu, 1.0, 0.8413447460685429, 1e-15);
        case!(gelu, -1.0, -0.15865525393145707, 1e-15);
        case!(gelu, 3.0, 2.99595030590511, 1e-15);
        // Far in the negative tail 1 + erf cancels; erfc keeps precision.
        case!(gelu, -5.0, -1.4332578593959731e-6, 1e-13);
        case!(erf, 0.5, 0.5204998778130465, 1e-15);
        case!(sigmoid, 0.0, 0.5, 0.0);
        case!(silu, 2.0, 1.7615941559557646, 1e-15);
        let z = Tensor::from_vec(vec![0.0f32, f32::NAN, -1.0], &[3]).unwrap();
        let r = z.relu().unwrap().to_vec::<f32>().unwrap();
        assert!(r[0] == 0.0 && r[1].is_nan() && r[2] == 0.0, "{r:?}");
        assert_eq!(z.gelu().unwrap().to_vec::<f32>().unwrap()[0], 0.0);
    }

    /// `g · f'(x)` elementwise by central differences of `f` (`f64` tensors).
    fn central_differences(x: &Tensor, g: &Tensor, f: impl Fn(&Tensor) -> Tensor) -> Vec<f64> {
        let h = 1e-6;
        let (p, m) = (f(&x.add_scalar(h).unwrap()), f(&x.sub_scalar(h).unwrap()));
        p.to_f64_vec()
            .iter()
            .zip(m.to_f64_vec())
            .zip(g.to_f64_vec())
            .map(|((p, m), g)| g * (p - m) / (2.0 * h))
            .collect()
    }

    #[test]
    fn gelu_backward_matches_finite_differences() {
        let x = sample(&[4, 5], DType::F64, 3);
        let g = sample(&[5, 4], DType::F64, 4).transpose(0, 1).unwrap();
        let got = g.gelu_backward(&x).unwrap();
        let want = central_differences(&x, &g, |x| x.gelu().unwrap());
        assert_close(&got, &want, 1e-8, "gelu_backward");
        for dtype in [DType::F32, DType::BF16] {
            let got = g.cast(dtype).unwrap().gelu_backward(&x.cast(dtype).unwrap()).unwrap();
            assert_close(&got, &want, 2.0 * tol(dtype) + 1e-6, &format!("gelu_backward {dtype}"));
        }
    }

    /// `silu_backward` against central differences of `silu` (f64, a
    /// transposed gradient), in f32 and bf16 within their rounding, and the
    /// shape and dtype errors.
    #[test]
    fn silu_backward_matches_finite_differences() {
        let x = sample(&[4, 5], DType::F64, 5).mul_scalar(4.0).unwrap();
        let g = sample(&[5, 4], DType::F64, 6).transpose(0, 1).unwrap();
        let got = g.silu_backward(&x).unwrap();
        let want = central_differences(&x, &g, |x| x.silu().unwrap());
        assert_close(&got, &want, 1e-8, "silu_backward");
        for dtype in [DType::F32, DType::BF16] {
            let got = g.cast(dtype).unwrap().silu_backward(&x.cast(dtype).unwrap()).unwrap();
            assert_close(&got, &want, 2.0 * tol(dtype) + 1e-6, &format!("silu_backward {dtype}"));
        }
        let err = g.silu_backward(&x.transpose(0, 1).unwrap()).unwrap_err();
        assert!(err.to_string().contains("must be equal"), "{err}");
        let err = g.silu_backward(&x.cast(DType::F32).unwrap()).unwrap_err();
        assert!(matches!(err, Error::DTypeMismatch { .. }), "{err}");
    }

    /// The exact `g·(Φ(x) + x·φ(x))` in `f64`, and the size `|g|·(Φ(x) + |x·φ(x)|)`
    /// of its terms, against which an `f32` result's rounding is measured (the
    /// sum cancels near `x = -0.75`).
    fn gelu_grad_exact(g: f64, x: f64) -> (f64, f64) {
        let cdf = 0.5 * libm::erfc(-x * FRAC_1_SQRT_2);
        let pdf = FRAC_1_SQRT_2PI * (-0.5 * x * x).exp();
        (g * (cdf + x * pdf), g.abs() * (cdf + (x * pdf).abs()))
    }

    #[test]
    fn gelu_backward_with_output_reads_the_cdf_off_the_output() {
        // A dense sweep over where GELU's gradient is not 0 or g, the points
        // where `y / x` is replaced by 1/2, and special values.
        let mut xs: Vec<f32> = (0..=200_000).map(|i| -14.0 + 28.0 * i as f32 / 200_000.0).collect();
        let tiny = 2f32.powi(-24);
        xs.extend([
            0.0,
            -0.0,
            tiny,
            -tiny,
            tiny * 1.5,
            f32::from_bits(1),
            -1e-30,
            1e-20,
            2e-7,
        ]);
        xs.extend([f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 30.0, -30.0]);
        let gs: Vec<f32> = (0..xs.len()).map(|i| 0.25 + (i % 7) as f32 * 0.5 - 1.5).collect();
        let n = xs.len();
        let (x, g) = (
            Tensor::from_vec(xs.clone(), &[n]).unwrap(),
            Tensor::from_vec(gs.clone(), &[n]).unwrap(),
        );
        let y = x.gelu().unwrap();
        let fast = g.gelu_backward_with_output(&x, &y).unwrap().to_vec::<f32>().unwrap();
        let slow = g.gelu_backward(&x).unwrap().to_vec::<f32>().unwrap();
        let mut worst = (0.0f64, 0.0f32);
        for i in 0..n {
            if !xs[i].is_finite() || xs[i].abs() > 20.0 {
                // Infinities give NaN (`x·φ(x)` is ∞·0), as the erfc path and PyTorch do.
                let same = (fast[i].is_nan() && slow[i].is_nan()) || fast[i] == slow[i];
                assert!(same, "x = {}: {} vs gelu_backward's {}", xs[i], fast[i], slow[i]);
                continue;
            }
            let (want, size) = gelu_grad_exact(gs[i] as f64, xs[i] as f64);
            // In units of f32 rounding at the terms' size, times the `1 + x²/2`
            // by which rounding `x²/2` (`e^(-x²/2)`'s argument) scales the
            // density's error, plus 32 steps of the subnormal spacing (far in the
            // negative tail several roundings land on subnormals).
            let x = xs[i] as f64;
            let unit = size * f64::from(f32::EPSILON) * (1.0 + 0.5 * x * x) + 32.0 * f64::from(f32::from_bits(1));
            let err = (fast[i] as f64 - want).abs() / unit;
            if err > worst.0 {
                worst = (err, xs[i]);
            }
        }
        // Measured 1.37 here, and 1.25 for gelu_backward (Φ from `erfc`).
        assert!(worst.0 <= 2.0, "{} ulp of the terms' size at x = {}", worst.0, worst.1);
        // Where |x| < 2⁻²⁴ the CDF is exactly 1/2 (also at x = 0, where y / x is 0/0).
        for (i, &xi) in xs.iter().enumerate() {
            if xi.abs() < tiny {
                assert_eq!(fast[i], gs[i] * (0.5 + xi * FRAC_1_SQRT_2PI as f32), "x = {xi}");
            }
        }

        // f64 against the finite differences of gelu, as gelu_backward.
        let x = sample(&[4, 5], DType::F64, 3);
        let g = sample(&[5, 4], DType::F64, 4).transpose(0, 1).unwrap();
        let want: Vec<f64> = g
            .to_f64_vec()
            .iter()
            .zip(x.to_f64_vec())
            .map(|(&g, x)| gelu_grad_exact(g, x).0)
            .collect();
        let got = g.gelu_backward_with_output(&x, &x.gelu().unwrap()).unwrap();
        assert_close(&got, &want, 1e-14, "gelu_backward_with_output f64");
    }

    #[test]
    fn gelu_backward_with_output_uses_y_only_at_full_precision() {
        let x = sample(&[3, 4], DType::F32, 5);
        let g = sample(&[3, 4], DType::F32, 6);
        let y = x.gelu().unwrap();
        // A wrong `y` gives a wrong gradient in f32 and f64: the CDF is read off it.
        for dtype in [DType::F32, DType::F64] {
            let (x, g, y) = (x.cast(dtype).unwrap(), g.cast(dtype).unwrap(), y.cast(dtype).unwrap());
            let right = g.gelu_backward_with_output(&x, &y).unwrap().to_f64_vec();
            let wrong = g
                .gelu_backward_with_output(&x, &y.mul_scalar(2.0).unwrap())
                .unwrap()
                .to_f64_vec();
            assert!(
                right.iter().zip(&wrong).all(|(a, b)| a != b),
                "{dtype}: {right:?} vs {wrong:?}"
            );
        }
        // bf16 and f16 compute Φ from x: the same bits as gelu_backward, whatever y is.
        for dtype in [DType::BF16, DType::F16] {
            let (x, g, y) = (x.cast(dtype).unwrap(), g.cast(dtype).unwrap(), y.cast(dtype).unwrap());
            let want = g.gelu_backward(&x).unwrap().to_f64_vec();
            let got = g
                .gelu_backward_with_output(&x, &y.mul_scalar(2.0).unwrap())
                .unwrap()
                .to_f64_vec();
            assert_eq!(got, want, "{dtype}");
        }
        // Strided operands read as their logical elements.
        let (xt, gt) = (x.transpose(0, 1).unwrap(), g.transpose(0, 1).unwrap());
        let got = gt.gelu_backward_with_output(&xt, &xt.gelu().unwrap()).unwrap();
        let want = g.gelu_backward_with_output(&x, &y).unwrap().transpose(0, 1).unwrap();
        assert_eq!(got.to_vec::<f32>().unwrap(), want.to_vec::<f32>().unwrap());
    }

    #[test]
    fn unary_errors() {
        macro_rules! case {
            ($res:expr, $msg:expr) => {
                assert_eq!($res.unwrap_err().to_string(), $msg);
            };
        }
        let i = Tensor::arange(3, DType::I64).unwrap();
        case!(
            i.exp(),
            "exp: dtype i64 is not a floating-point type; cast the tensor to a float dtype first"
        );
        let x = sample(&[2, 3], DType::F32, 1);
        case!(
            x.gelu_backward(&sample(&[3, 2], DType::F32, 1)),
            "gelu_backward: shape mismatch: gradient has shape [2, 3] but input has [3, 2]; they must be equal"
        );
        case!(
            x.gelu_backward(&sample(&[2, 3], DType::F64, 1)),
            "gelu_backward: expected dtype f32, got f64"
        );
        case!(
            x.gelu_backward_with_output(&x, &sample(&[3, 2], DType::F32, 1)),
            "gelu_backward: shape mismatch: gradient [2, 3], input [2, 3] and output [3, 2]: the three shapes must be equal"
        );
        case!(
            x.gelu_backward_with_output(&x, &sample(&[2, 3], DType::F64, 1)),
            "gelu_backward: expected dtype f32, got f64"
        );
        case!(
            i.gelu_backward_with_output(&i, &i),
            "gelu_backward: dtype i64 is not a floating-point type; cast the tensor to a float dtype first"
        );
    }
}
