//! Binary element-wise ops with NumPy/PyTorch broadcasting, and their scalar forms.

use std::mem::MaybeUninit;

use ndarray::{ArrayViewMutD, IxDyn, Zip};

use super::{elements, output, par_collect, same_dtype};
use crate::kernel::{Float, Real, Simd, float_dispatch, par_rows};
use crate::{Error, Result, Tensor};

/// A binary element-wise operation, computed in the [`Real`] type of its dtype.
pub(crate) trait Binary {
    /// The name of the op's CUDA kernels (`binary_NAME_T`, `scalar_NAME_T`).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    const KERNEL: &'static str;

    fn apply<R: Real>(a: R, b: R) -> R;
}

macro_rules! binary_op {
    ($name:ident, $kernel:literal, |$a:ident, $b:ident| $body:expr) => {
        pub(crate) struct $name;
        impl Binary for $name {
            const KERNEL: &'static str = $kernel;

            #[inline(always)]
            fn apply<R: Real>($a: R, $b: R) -> R {
                $body
            }
        }
    };
}
binary_op!(AddOp, "add", |a, b| a + b);
binary_op!(SubOp, "sub", |a, b| a - b);
binary_op!(MulOp, "mul", |a, b| a * b);
binary_op!(DivOp, "div", |a, b| a / b);
// NaN-propagating, as `torch.maximum`.
binary_op!(MaxOp, "maximum", |a, b| if a > b || a.is_nan() { a } else { b });
binary_op!(MinOp, "minimum", |a, b| if a < b || a.is_nan() { a } else { b });
binary_op!(PowOp, "pow", |a, b| a.powf(b));

/// The shape that `a` and `b` broadcast to (NumPy rules: dims are aligned from
/// the right; each pair must be equal or contain a 1).
///
/// # Errors
/// [`Error::ShapeMismatch`] naming both shapes and the first dim that clashes.
pub(crate) fn broadcast_shapes(op: &'static str, a: &[usize], b: &[usize]) -> Result<Vec<usize>> {
    let rank = a.len().max(b.len());
    let mut out = vec![0; rank];
    for i in 0..rank {
        let x = if i < a.len() { a[a.len() - 1 - i] } else { 1 };
        let y = if i < b.len() { b[b.len() - 1 - i] } else { 1 };
        out[rank - 1 - i] = match (x, y) {
            _ if x == y => x,
            (1, _) => y,
            (_, 1) => x,
            _ => {
                return Err(Error::ShapeMismatch {
                    op,
                    detail: format!(
                        "shapes {a:?} and {b:?} do not broadcast: dim -{} has sizes {x} and {y}; \
                         sizes must be equal or 1",
                        i + 1
                    ),
                });
            }
        };
    }
    Ok(out)
}

/// When `small` (leading 1s dropped) equals the trailing dims of `shape`: the
/// number of elements after which `small` repeats.
fn repeat_period(small: &[usize], shape: &[usize]) -> Option<usize> {
    let lead = small.iter().take_while(|&&d| d == 1).count();
    let tail = &small[lead..];
    shape.ends_with(tail).then(|| tail.iter().product())
}

/// `g(full[i], small[i % period])` for every element of `full`, where `small`
/// (`period` elements) repeats along `full`'s leading dims: a scalar, a bias, a
/// row of weights. Split over the rank's threads in whole periods when large.
fn repeating<T: Float>(
    op: &'static str,
    full: &[T],
    small: &[T],
    period: usize,
    g: impl Fn(T, T) -> T + Sync + Copy,
) -> Result<Vec<T>> {
    let simd = Simd::best();
    let fill = |out: &mut [MaybeUninit<T>]| {
        par_rows(out, period, |start, out| {
            let full = &full[start..start + out.len()];
            // Plain loops over whole rows, compiled for the widest vectors.
            simd.run(
                #[inline(always)]
                || {
                    if let [y] = *small {
                        for (o, &x) in out.iter_mut().zip(full) {
                            *o = MaybeUninit::new(g(x, y));
                        }
                    } else {
                        for (o, x) in out.chunks_exact_mut(period).zip(full.chunks_exact(period)) {
                            for ((o, &x), &y) in o.iter_mut().zip(x).zip(small) {
                                *o = MaybeUninit::new(g(x, y));
                            }
                        }
                    }
                },
            );
        });
    };
    // SAFETY: `par_rows` hands out blocks of whole periods that tile the output,
    // `full` holds as many elements as the output and `small` one period, so
    // the loops above write every element.
    unsafe { crate::alloc::written(op, &[full.len()], fill) }
}

/// `op(a, b)` broadcast, for tensors of one float dtype.
fn binary<Op: Binary>(op: &'static str, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    same_dtype(op, a, b)?;
    let shape = broadcast_shapes(op, a.shape(), b.shape())?;
    if let Some(out) = super::meta_float(op, &[a, b], &shape, a.dtype()) {
        return out;
    }
    #[cfg(feature = "cuda")]
    if a.is_cuda() || b.is_cuda() {
        return crate::cuda::ops::binary(Op::KERNEL, op, a, b, &shape);
    }
    float_dispatch!(op, a.dtype(), T => binary_typed::<T, Op>(op, a, b, &shape))
}

fn binary_typed<T: Float, Op: Binary>(op: &'static str, a: &Tensor, b: &Tensor, shape: &[usize]) -> Result<Tensor> {
    let f = |x: T, y: T| T::from_acc(Op::apply(x.to_acc(), y.to_acc()));
    if shape.contains(&0) {
        return output(Vec::<T>::new(), shape);
    }
    let dense = |t: &Tensor| t.is_contiguous() && t.shape() == shape;
    let n: usize = shape.iter().product();
    let out: Vec<T> = if dense(a) && dense(b) {
        let (x, y) = (a.as_slice::<T>()?, b.as_slice::<T>()?);
        let pair = |r: std::ops::Range<usize>| x[r.clone()].iter().zip(&y[r]).map(|(&x, &y)| f(x, y));
        par_collect(op, n, 1, pair, || pair(0..n).collect())?
    } else if dense(a)
        && b.is_contiguous()
        && let Some(period) = repeat_period(b.shape(), shape)
    {
        // `b` repeats along leading dims: a scalar, a bias, a row of weights.
        let (x, y) = (a.as_slice::<T>()?, b.as_slice::<T>()?);
        repeating(op, x, y, period, f)?
    } else if dense(b)
        && a.is_contiguous()
        && let Some(period) = repeat_period(a.shape(), shape)
    {
        let (x, y) = (a.as_slice::<T>()?, b.as_slice::<T>()?);
        repeating(op, y, x, period, move |y, x| f(x, y))?
    } else {
        // Strided or broadcast in the middle: ndarray walks both views.
        let (av, bv) = (a.view::<T>()?, b.view::<T>()?);
        let dim = IxDyn(shape);
        let internal = || Error::InvalidArgument {
            op: "broadcast",
            detail: format!("internal error: cannot broadcast {:?} and {:?}", a.shape(), b.shape()),
        };
        let ab = av.broadcast(dim.clone()).ok_or_else(internal)?;
        let bb = bv.broadcast(dim.clone()).ok_or_else(internal)?;
        // Small operands can broadcast to a result too large for memory.
        let mut out = crate::alloc::zeroed::<T>("broadcast", shape)?;
        let mut view = ArrayViewMutD::from_shape(dim, &mut out).map_err(|_| internal())?;
        Zip::from(&mut view)
            .and(&ab)
            .and(&bb)
            .for_each(|o, &x, &y| *o = f(x, y));
        out
    };
    output(out, shape)
}

/// `op(a, s)` for every element of `a`, with the scalar in the compute type.
fn binary_scalar<Op: Binary>(op: &'static str, a: &Tensor, s: f64) -> Result<Tensor> {
    if let Some(out) = super::meta_float(op, &[a], a.shape(), a.dtype()) {
        return out;
    }
    #[cfg(feature = "cuda")]
    if a.is_cuda() {
        return crate::cuda::ops::scalar(Op::KERNEL, op, a, s);
    }
    float_dispatch!(op, a.dtype(), T => {
        let s = <T as Float>::Acc::real(s);
        let x = elements::<T>(a)?;
        let g = |x: &T| T::from_acc(Op::apply(x.to_acc(), s));
        let out = par_collect(op, x.len(), 1, |r| x[r].iter().map(g), || x.iter().map(g).collect())?;
        output(out, a.shape())
    })
}

macro_rules! binary_methods {
    ($($(#[$doc:meta])* $name:ident, $scalar:ident, $Op:ty, $torch:literal;)*) => {
        impl Tensor {
            $(
                $(#[$doc])*
                #[doc = concat!("\n\nBroadcasts as NumPy does. PyTorch: `", $torch, "`.")]
                ///
                /// # Errors
                /// [`Error::ShapeMismatch`] when the shapes do not broadcast (naming
                /// both); [`Error::DTypeMismatch`] when the dtypes differ;
                /// [`Error::InvalidArgument`] for integer tensors.
                pub fn $name(&self, rhs: &Tensor) -> Result<Tensor> {
                    binary::<$Op>(stringify!($name), self, rhs)
                }

                #[doc = concat!("[`", stringify!($name), "`](Self::", stringify!($name),
                    ") with a scalar right-hand side, converted to the compute type \
                    (`f32` for `f32`, `bf16` and `f16`).")]
                ///
                /// # Errors
                /// [`Error::InvalidArgument`] for integer tensors.
                pub fn $scalar(&self, rhs: f64) -> Result<Tensor> {
                    binary_scalar::<$Op>(stringify!($scalar), self, rhs)
                }
            )*
        }
    };
}

binary_methods! {
    /// Element-wise `self + rhs`.
    add, add_scalar, AddOp, "torch.add";
    /// Element-wise `self - rhs`.
    sub, sub_scalar, SubOp, "torch.sub";
    /// Element-wise `self * rhs`.
    mul, mul_scalar, MulOp, "torch.mul";
    /// Element-wise `self / rhs`.
    div, div_scalar, DivOp, "torch.div";
    /// Element-wise maximum; NaN wins (propagates).
    maximum, maximum_scalar, MaxOp, "torch.maximum";
    /// Element-wise minimum; NaN wins (propagates).
    minimum, minimum_scalar, MinOp, "torch.minimum";
}

impl Tensor {
    /// Every element limited to `[min, max]` (either bound may be absent);
    /// NaN stays NaN. PyTorch: `torch.clamp`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when both bounds are absent, or for integer tensors.
    pub fn clamp(&self, min: Option<f64>, max: Option<f64>) -> Result<Tensor> {
        let mut out = match (min, max) {
            (None, None) => {
                return Err(Error::InvalidArgument {
                    op: "clamp",
                    detail: "at least one of min and max must be given".into(),
                });
            }
            (Some(lo), _) => self.maximum_scalar(lo)?,
            (None, _) => self.clone(),
        };
        if let Some(hi) = max {
            out = out.minimum_scalar(hi)?;
        }
        Ok(out)
    }
}

impl Tensor {
    /// Every element raised to `exponent`. PyTorch: `torch.pow(tensor, scalar)`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for integer tensors.
    pub fn pow(&self, exponent: f64) -> Result<Tensor> {
        binary_scalar::<PowOp>("pow", self, exponent)
    }
}

#[cfg(test)]
mod tests {
    use half::{bf16, f16};
    use tessera_mesh::DType;

    use super::*;
    use crate::kernel::unravel;
    use crate::ops::testutil::{assert_close, sample, tol};

    /// Row-major index of `out_idx` in a tensor of `shape` broadcast to `out`.
    fn bidx(shape: &[usize], out: &[usize], out_idx: &[usize]) -> usize {
        let lead = out.len() - shape.len();
        let mut i = 0;
        for (d, &s) in shape.iter().enumerate() {
            let k = if s == 1 { 0 } else { out_idx[lead + d] };
            i = i * s + k;
        }
        i
    }

    /// The naive broadcast reference in f64.
    fn reference(a: &Tensor, b: &Tensor, f: fn(f64, f64) -> f64) -> (Vec<usize>, Vec<f64>) {
        let out = broadcast_shapes("t", a.shape(), b.shape()).unwrap();
        let (x, y) = (a.to_f64_vec(), b.to_f64_vec());
        let n: usize = out.iter().product();
        let v = (0..n)
            .map(|i| {
                let idx = unravel(i, &out);
                f(x[bidx(a.shape(), &out, &idx)], y[bidx(b.shape(), &out, &idx)])
            })
            .collect();
        (out, v)
    }

    #[test]
    fn minimum_and_clamp() {
        let x = Tensor::from_vec(vec![-2.0f32, -0.5, 0.0, 0.7, 3.0, f32::NAN], &[6]).unwrap();
        let y = x.clamp(Some(-1.0), Some(1.0)).unwrap().to_vec::<f32>().unwrap();
        assert_eq!(&y[..5], &[-1.0, -0.5, 0.0, 0.7, 1.0]);
        assert!(y[5].is_nan(), "NaN stays NaN");
        assert_eq!(
            x.clamp(None, Some(0.0)).unwrap().to_vec::<f32>().unwrap()[..5],
            [-2.0, -0.5, 0.0, 0.0, 0.0]
        );
        assert_eq!(
            x.clamp(Some(0.5), None).unwrap().to_vec::<f32>().unwrap()[..5],
            [0.5, 0.5, 0.5, 0.7, 3.0]
        );
        let e = x.clamp(None, None).unwrap_err().to_string();
        assert!(e.contains("at least one of min and max"), "{e}");
        let m = x
            .minimum(&Tensor::full(&[6], 0.1, DType::F32).unwrap())
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        assert_eq!(&m[..5], &[-2.0, -0.5, 0.0, 0.1, 0.1]);
        assert!(m[5].is_nan());
    }

    #[test]
    fn binary_broadcast_table() {
        type Op = (fn(&Tensor, &Tensor) -> Result<Tensor>, fn(f64, f64) -> f64);
        let ops: [(&str, Op); 5] = [
            ("add", (Tensor::add, |a, b| a + b)),
            ("sub", (Tensor::sub, |a, b| a - b)),
            ("mul", (Tensor::mul, |a, b| a * b)),
            ("div", (Tensor::div, |a, b| a / b)),
            ("maximum", (Tensor::maximum, f64::max)),
        ];
        macro_rules! case {
            ($a:expr, $b:expr, $shape:expr) => {
                for dtype in [DType::F32, DType::F64, DType::BF16, DType::F16] {
                    let (a, b) = ($a(dtype), $b(dtype));
                    for (name, (op, f)) in ops {
                        let got = op(&a, &b).unwrap();
                        let (shape, want) = reference(&a, &b, f);
                        assert_eq!(got.shape(), &shape[..]);
                        assert_eq!(shape, $shape);
                        assert_eq!(got.dtype(), dtype);
                        assert!(got.is_contiguous());
                        let what = format!("{name} {:?} {:?} {dtype}", a.shape(), b.shape());
                        assert_close(&got, &want, tol(dtype), &what);
                    }
                }
            };
        }
        let s = |shape: &'static [usize], seed| move |d| sample(shape, d, seed);
        case!(s(&[2, 3], 1), s(&[2, 3], 2), vec![2, 3]);
        case!(s(&[3, 1], 1), s(&[1, 4], 2), vec![3, 4]);
        case!(s(&[2, 3, 4], 1), s(&[4], 2), vec![2, 3, 4]);
        case!(s(&[4], 1), s(&[2, 3, 4], 2), vec![2, 3, 4]);
        case!(s(&[2, 3, 4], 1), s(&[3, 1], 2), vec![2, 3, 4]);
        case!(s(&[2, 3, 4], 1), s(&[], 2), vec![2, 3, 4]);
        case!(s(&[], 1), s(&[2, 3], 2), vec![2, 3]);
        case!(s(&[], 1), s(&[], 2), Vec::<usize>::new());
        case!(s(&[1, 3], 1), s(&[2, 1, 3], 2), vec![2, 1, 3]);
        case!(s(&[2, 1, 3], 1), s(&[4, 1], 2), vec![2, 4, 3]);
        case!(s(&[4, 1], 1), s(&[2, 1, 3], 2), vec![2, 4, 3]);
        case!(s(&[0, 3], 1), s(&[3], 2), vec![0, 3]);
        case!(s(&[2, 1], 1), s(&[0], 2), vec![2, 0]);
        // Strided operands: a transpose, a narrowed view.
        let t = |d| sample(&[4, 3], d, 5).transpose(0, 1).unwrap();
        case!(t, s(&[3, 4], 6), vec![3, 4]);
        case!(s(&[3, 4], 6), t, vec![3, 4]);
        let n = |d| sample(&[3, 6], d, 7).narrow(1, 1, 4).unwrap();
        case!(n, s(&[4], 8), vec![3, 4]);
        case!(n, t, vec![3, 4]);
    }

    #[test]
    fn scalar_forms() {
        macro_rules! case {
            ($method:ident, $s:expr, $f:expr) => {
                for dtype in [DType::F32, DType::F64, DType::BF16, DType::F16] {
                    let a = sample(&[3, 5], dtype, 3).transpose(0, 1).unwrap();
                    let got = a.$method($s).unwrap();
                    let want: Vec<f64> = a.to_f64_vec().into_iter().map(|x| $f(x, $s)).collect();
                    assert_eq!(got.shape(), &[5, 3]);
                    assert_close(&got, &want, tol(dtype), concat!(stringify!($method), " ", $s));
                }
            };
        }
        case!(add_scalar, 0.5, |x, s| x + s);
        case!(sub_scalar, 2.0, |x, s| x - s);
        case!(mul_scalar, -3.0, |x, s| x * s);
        case!(div_scalar, 8.0, |x, s| x / s);
        case!(maximum_scalar, 0.0, f64::max);
        case!(pow, 2.0, f64::powf);
        case!(pow, 3.0, f64::powf);
        case!(pow, -1.0, f64::powf);
        let a = Tensor::from_vec(vec![4.0f32, 9.0, 0.25], &[3]).unwrap();
        assert_eq!(a.pow(0.5).unwrap().to_vec::<f32>().unwrap(), vec![2.0, 3.0, 0.5]);
    }

    #[test]
    fn half_types_round_once() {
        // 1 + 2^-9 is not a bf16, but the sum of two bf16s computed in f32 rounds once.
        let a = Tensor::from_vec(vec![bf16::from_f32(1.0)], &[1]).unwrap();
        let b = Tensor::from_vec(vec![bf16::from_f32(0.00390625)], &[1]).unwrap();
        assert_eq!(a.add(&b).unwrap().to_vec::<bf16>().unwrap(), vec![bf16::from_f32(1.0)]);
        let a = Tensor::from_vec(vec![f16::from_f32(3.0)], &[1]).unwrap();
        assert_eq!(
            a.mul_scalar(1.0 / 3.0).unwrap().to_vec::<f16>().unwrap(),
            vec![f16::ONE]
        );
    }

    #[test]
    fn nan_propagates_through_maximum() {
        let a = Tensor::from_vec(vec![f32::NAN, 1.0, 2.0], &[3]).unwrap();
        let b = Tensor::from_vec(vec![0.0f32, f32::NAN, 1.0], &[3]).unwrap();
        let m = a.maximum(&b).unwrap().to_vec::<f32>().unwrap();
        assert!(m[0].is_nan() && m[1].is_nan() && m[2] == 2.0, "{m:?}");
    }

    #[test]
    fn binary_errors() {
        macro_rules! case {
            ($res:expr, $msg:expr) => {
                assert_eq!($res.unwrap_err().to_string(), $msg);
            };
        }
        let a = sample(&[2, 3], DType::F32, 1);
        case!(
            a.add(&sample(&[4], DType::F32, 1)),
            "add: shape mismatch: shapes [2, 3] and [4] do not broadcast: dim -1 has sizes 3 and 4; \
             sizes must be equal or 1"
        );
        case!(
            a.mul(&sample(&[3, 3], DType::F32, 1)),
            "mul: shape mismatch: shapes [2, 3] and [3, 3] do not broadcast: dim -2 has sizes 2 and 3; \
             sizes must be equal or 1"
        );
        case!(a.sub(&a.cast(DType::F64).unwrap()), "sub: expected dtype f32, got f64");
        let i = Tensor::arange(3, DType::I64).unwrap();
        case!(
            i.div(&i),
            "div: dtype i64 is not a floating-point type; cast the tensor to a float dtype first"
        );
        case!(
            i.add_scalar(1.0),
            "add_scalar: dtype i64 is not a floating-point type; cast the tensor to a float dtype first"
        );
    }
}
