//! Element-wise ops and their gradients.

use smallvec::smallvec;
use tessera_dtensor::Linearity;

use super::{map_f64, unbroadcast};
use crate::{Result, Var};

impl Var {
    /// The same values in `dtype`; the gradient is cast back to this var's dtype.
    ///
    /// PyTorch: `Tensor.to(dtype)`.
    ///
    /// # Errors
    /// A cast the kernels reject.
    pub fn cast(&self, dtype: tessera_dtensor::DType) -> Result<Var> {
        if dtype == self.value().dtype() {
            return Ok(self.clone());
        }
        let from = self.value().dtype();
        let value = self.value().cast(dtype)?;
        Ok(self.unary_op("cast", value, move |g| g.cast(from)))
    }

    /// `self + rhs` with broadcasting.
    ///
    /// # Errors
    /// As [`DTensor::add`](tessera_dtensor::DTensor::add).
    pub fn add(&self, rhs: &Var) -> Result<Var> {
        let (sa, sb) = (self.value().shape().to_vec(), rhs.value().shape().to_vec());
        let value = self.value().add(rhs.value())?;
        Ok(Var::from_op("add", value, &[self, rhs], move |g| {
            Ok(smallvec![Some(unbroadcast(g, &sa)?), Some(unbroadcast(g, &sb)?)])
        }))
    }

    /// `self - rhs` with broadcasting.
    ///
    /// # Errors
    /// As [`DTensor::sub`](tessera_dtensor::DTensor::sub).
    pub fn sub(&self, rhs: &Var) -> Result<Var> {
        let (sa, sb) = (self.value().shape().to_vec(), rhs.value().shape().to_vec());
        let value = self.value().sub(rhs.value())?;
        Ok(Var::from_op("sub", value, &[self, rhs], move |g| {
            Ok(smallvec![
                Some(unbroadcast(g, &sa)?),
                Some(unbroadcast(&g.neg()?, &sb)?)
            ])
        }))
    }

    /// `self · rhs` with broadcasting.
    ///
    /// # Errors
    /// As [`DTensor::mul`](tessera_dtensor::DTensor::mul).
    pub fn mul(&self, rhs: &Var) -> Result<Var> {
        let value = self.value().mul(rhs.value())?;
        let (sa, sb) = (self.saved(), rhs.saved());
        let (need_a, need_b) = (self.requires_grad(), rhs.requires_grad());
        Ok(Var::from_op("mul", value, &[self, rhs], move |g| {
            let (a, b) = (sa.get()?, sb.get()?);
            let ga = if need_a {
                Some(unbroadcast(&g.mul(&b)?, a.shape())?)
            } else {
                None
            };
            let gb = if need_b {
                Some(unbroadcast(&g.mul(&a)?, b.shape())?)
            } else {
                None
            };
            Ok(smallvec![ga, gb])
        }))
    }

    /// `self / rhs` with broadcasting.
    ///
    /// # Errors
    /// As [`DTensor::div`](tessera_dtensor::DTensor::div).
    pub fn div(&self, rhs: &Var) -> Result<Var> {
        let value = self.value().div(rhs.value())?;
        let out = value.clone();
        let (sa, sb) = (self.saved(), rhs.saved());
        let (need_a, need_b) = (self.requires_grad(), rhs.requires_grad());
        Ok(Var::from_op("div", value, &[self, rhs], move |g| {
            let (a, b) = (sa.get()?, sb.get()?);
            let ga = if need_a {
                Some(unbroadcast(&g.div(&b)?, a.shape())?)
            } else {
                None
            };
            let gb = if need_b {
                Some(unbroadcast(&g.mul(&out)?.div(&b)?.neg()?, b.shape())?)
            } else {
                None
            };
            Ok(smallvec![ga, gb])
        }))
    }

    /// `-x`.
    ///
    /// # Errors
    /// Integer inputs.
    pub fn neg(&self) -> Result<Var> {
        Ok(self.unary_op("neg", self.value().neg()?, |g| g.neg()))
    }

    /// `eˣ`.
    ///
    /// # Errors
    /// Integer inputs.
    pub fn exp(&self) -> Result<Var> {
        let y = self.value().exp()?;
        let out = y.clone();
        Ok(self.unary_op("exp", y, move |g| g.mul(&out)))
    }

    /// Natural logarithm.
    ///
    /// # Errors
    /// Integer inputs.
    pub fn log(&self) -> Result<Var> {
        let x = self.value().clone();
        Ok(self.unary_op("log", x.log()?, move |g| g.div(&x)))
    }

    /// Square root.
    ///
    /// # Errors
    /// Integer inputs.
    pub fn sqrt(&self) -> Result<Var> {
        let y = self.value().sqrt()?;
        let out = y.clone();
        Ok(self.unary_op("sqrt", y, move |g| g.div(&out)?.mul_scalar(0.5)))
    }

    /// `1/√x`.
    ///
    /// # Errors
    /// Integer inputs.
    pub fn rsqrt(&self) -> Result<Var> {
        let y = self.value().rsqrt()?;
        let out = y.clone();
        Ok(self.unary_op("rsqrt", y, move |g| g.mul(&out.pow(3.0)?)?.mul_scalar(-0.5)))
    }

    /// Hyperbolic tangent.
    ///
    /// # Errors
    /// Integer inputs.
    pub fn tanh(&self) -> Result<Var> {
        let y = self.value().tanh()?;
        let out = y.clone();
        Ok(self.unary_op("tanh", y, move |g| g.sub(&g.mul(&out.square()?)?)))
    }

    /// Exact GELU.
    ///
    /// # Errors
    /// Integer inputs.
    pub fn gelu(&self) -> Result<Var> {
        let x = self.value().clone();
        let y = x.gelu()?;
        // The output is kept anyway (the next op's input): the backward reads
        // the normal CDF off it instead of computing it again.
        let out = y.clone();
        Ok(self.unary_op("gelu", y, move |g| g.gelu_backward_with_output(&x, &out)))
    }

    /// Dropout: zeroes each element with probability `p` and scales the others
    /// by `1/(1 − p)`. The mask is drawn by the counter-based generator from
    /// `key` at each element's *global* index, so a sharded run drops exactly the
    /// elements the unsharded run drops, on any mesh and placements (pass a new
    /// stream per call, e.g. `StreamKey::new(seed, "layers.0.dropout").with_stream(step)`).
    /// `p = 0` is the identity.
    ///
    /// PyTorch: `torch.nn.functional.dropout(x, p, training=True)` (whose mask
    /// comes from the device generator's offset instead of a key).
    ///
    /// # Errors
    /// `p` outside `[0, 1]`; a `Partial` input (reduce it first); integer inputs.
    pub fn dropout(&self, p: f64, key: tessera_dtensor::StreamKey) -> Result<Var> {
        let x = self.value();
        tessera_tensor::random::check_dropout("dropout", p, x.dtype()).map_err(tessera_dtensor::Error::from)?;
        if p == 0.0 {
            return Ok(self.clone());
        }
        let mask = x.dropout_mask(p, key)?;
        let y = x.mul(&mask)?;
        Ok(self.unary_op("dropout", y, move |g| g.mul(&mask)))
    }

    /// `max(x, 0)`.
    ///
    /// # Errors
    /// Integer inputs.
    pub fn relu(&self) -> Result<Var> {
        let x = self.value().clone();
        Ok(self.unary_op("relu", x.relu()?, move |g| {
            g.binary("relu_backward", &x, Linearity::FirstOnly, |g, x| {
                Ok(g.mul(&map_f64(x, |v| if v > 0.0 { 1.0 } else { 0.0 })?)?)
            })
        }))
    }

    /// Every element limited to `[min, max]`; the gradient passes where
    /// `min ≤ x ≤ max` and is zero where the input was clamped.
    /// PyTorch: `torch.clamp`.
    ///
    /// # Errors
    /// Both bounds absent, integer inputs.
    pub fn clamp(&self, min: Option<f64>, max: Option<f64>) -> Result<Var> {
        let x = self.value().clone();
        let (lo, hi) = (min.unwrap_or(f64::NEG_INFINITY), max.unwrap_or(f64::INFINITY));
        Ok(self.unary_op("clamp", x.clamp(min, max)?, move |g| {
            g.binary("clamp_backward", &x, Linearity::FirstOnly, |g, x| {
                Ok(g.mul(&map_f64(x, |v| if (lo..=hi).contains(&v) { 1.0 } else { 0.0 })?)?)
            })
        }))
    }

    /// `1/(1 + e⁻ˣ)`.
    ///
    /// # Errors
    /// Integer inputs.
    pub fn sigmoid(&self) -> Result<Var> {
        let y = self.value().sigmoid()?;
        let s = y.clone();
        Ok(self.unary_op("sigmoid", y, move |g| g.mul(&s)?.sub(&g.mul(&s.square()?)?)))
    }

    /// `x · sigmoid(x)`.
    ///
    /// # Errors
    /// Integer inputs.
    pub fn silu(&self) -> Result<Var> {
        let x = self.value().clone();
        Ok(self.unary_op("silu", x.silu()?, move |g| {
            // d/dx x·s(x) = s·(1 + x·(1 − s)), one kernel (PyTorch's silu_backward).
            g.binary(
                "silu_backward",
                &x,
                Linearity::FirstOnly,
                |g, x| Ok(g.silu_backward(x)?),
            )
        }))
    }

    /// `|x|`.
    ///
    /// # Errors
    /// Integer inputs.
    pub fn abs(&self) -> Result<Var> {
        let x = self.value().clone();
        Ok(self.unary_op("abs", x.abs()?, move |g| {
            g.binary("abs_backward", &x, Linearity::FirstOnly, |g, x| {
                Ok(g.mul(&map_f64(x, f64::signum)?)?)
            })
        }))
    }

    /// `x²`.
    ///
    /// # Errors
    /// Integer inputs.
    pub fn square(&self) -> Result<Var> {
        let x = self.value().clone();
        Ok(self.unary_op("square", x.square()?, move |g| g.mul(&x)?.mul_scalar(2.0)))
    }

    /// `xᵉ`.
    ///
    /// # Errors
    /// Integer inputs.
    pub fn pow(&self, e: f64) -> Result<Var> {
        let x = self.value().clone();
        Ok(self.unary_op("pow", x.pow(e)?, move |g| g.mul(&x.pow(e - 1.0)?)?.mul_scalar(e)))
    }

    /// `x · s`.
    ///
    /// # Errors
    /// Integer inputs.
    pub fn mul_scalar(&self, s: f64) -> Result<Var> {
        Ok(self.unary_op("mul_scalar", self.value().mul_scalar(s)?, move |g| g.mul_scalar(s)))
    }

    /// `x / s`.
    ///
    /// # Errors
    /// Integer inputs.
    pub fn div_scalar(&self, s: f64) -> Result<Var> {
        Ok(self.unary_op("div_scalar", self.value().div_scalar(s)?, move |g| g.div_scalar(s)))
    }

    /// `x + s`.
    ///
    /// # Errors
    /// Integer inputs.
    pub fn add_scalar(&self, s: f64) -> Result<Var> {
        Ok(self.unary_op("add_scalar", self.value().add_scalar(s)?, |g| Ok(g.clone())))
    }

    /// `x - s`.
    ///
    /// # Errors
    /// Integer inputs.
    pub fn sub_scalar(&self, s: f64) -> Result<Var> {
        Ok(self.unary_op("sub_scalar", self.value().sub_scalar(s)?, |g| Ok(g.clone())))
    }
}
