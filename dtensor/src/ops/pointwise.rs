//! Element-wise ops on DTensors: binary ops with broadcasting, scalar ops and unary
//! ops, with the linearity rules for `Partial`.

use tessera_tensor::Error as TensorError;

use super::dispatch;
use crate::strategy::{Linearity, pointwise};
use crate::{DTensor, Error, Result, Tensor};

/// NumPy broadcasting of two shapes.
///
/// # Errors
/// Shapes that do not broadcast.
pub fn broadcast_shape(op: &'static str, a: &[usize], b: &[usize]) -> Result<Vec<usize>> {
    let n = a.len().max(b.len());
    let dim = |s: &[usize], i: usize| if i + s.len() < n { 1 } else { s[i + s.len() - n] };
    (0..n)
        .map(|i| match (dim(a, i), dim(b, i)) {
            (x, y) if x == y || y == 1 => Ok(x),
            (1, y) => Ok(y),
            _ => Err(Error::from(TensorError::ShapeMismatch {
                op,
                detail: format!("shapes {a:?} and {b:?} do not broadcast (dim {i})"),
            })),
        })
        .collect()
}

macro_rules! binary {
    ($($name:ident => $lin:expr, $doc:literal;)*) => {
        impl DTensor {
            $(
                #[doc = $doc]
                ///
                /// # Errors
                /// Shapes that do not broadcast, dtypes that differ, different meshes, communication failures.
                pub fn $name(&self, rhs: &DTensor) -> Result<DTensor> {
                    self.binary(stringify!($name), rhs, $lin, |a, b| Ok(a.$name(b)?))
                }
            )*
        }
    };
}

binary! {
    add => Linearity::Additive, "Element-wise `self + rhs` with broadcasting; two partial sums add without communication.";
    sub => Linearity::Additive, "Element-wise `self - rhs` with broadcasting; two partial sums subtract without communication.";
    mul => Linearity::Multiplicative, "Element-wise `self · rhs` with broadcasting; a partial times a replicated value stays partial.";
    div => Linearity::FirstOnly, "Element-wise `self / rhs` with broadcasting; a partial numerator over a replicated divisor stays partial.";
    maximum => Linearity::None, "Element-wise maximum with broadcasting (partial inputs are reduced first).";
    minimum => Linearity::None, "Element-wise minimum with broadcasting (partial inputs are reduced first).";
}

macro_rules! unary {
    ($($name:ident => $lin:expr, $doc:literal;)*) => {
        impl DTensor {
            $(
                #[doc = $doc]
                ///
                /// # Errors
                /// Integer inputs, communication failures.
                pub fn $name(&self) -> Result<DTensor> {
                    self.unary(stringify!($name), $lin, |t| Ok(t.$name()?))
                }
            )*
        }
    };
}

unary! {
    neg => Linearity::Additive, "`-x`, linear: shards and partial sums are kept.";
    exp => Linearity::None, "`eˣ`.";
    log => Linearity::None, "Natural logarithm.";
    sqrt => Linearity::None, "Square root.";
    rsqrt => Linearity::None, "`1/√x`.";
    tanh => Linearity::None, "Hyperbolic tangent.";
    gelu => Linearity::None, "Exact GELU, `0.5·x·(1 + erf(x/√2))`.";
    relu => Linearity::None, "`max(x, 0)`.";
    silu => Linearity::None, "`x·sigmoid(x)`.";
    sigmoid => Linearity::None, "`1/(1 + e⁻ˣ)`.";
    abs => Linearity::None, "`|x|`.";
    square => Linearity::None, "`x²`.";
}

impl DTensor {
    /// A custom element-wise binary op: broadcasting strategies with `linearity`'s
    /// `Partial` rules, running `kernel` on the local pieces.
    ///
    /// # Errors
    /// Shapes that do not broadcast, different dtypes or meshes, the kernel's error.
    pub fn binary(
        &self,
        op: &'static str,
        rhs: &DTensor,
        linearity: Linearity,
        kernel: impl FnOnce(&Tensor, &Tensor) -> Result<Tensor>,
    ) -> Result<DTensor> {
        if self.dtype() != rhs.dtype() {
            return Err(Error::from(TensorError::DTypeMismatch {
                op,
                expected: self.dtype(),
                got: rhs.dtype(),
            }));
        }
        let out = broadcast_shape(op, self.shape(), rhs.shape())?;
        let cands = pointwise(&[self.shape(), rhs.shape()], &out, self.mesh().ndim(), linearity);
        dispatch(op, &[self, rhs], &cands, &out, self.dtype(), |l, _| {
            kernel(&l[0], &l[1])
        })
    }

    /// The gradient of exact GELU at `x` given the gradient `self` of its output
    /// `y = x.gelu()` ([`Tensor::gelu_backward_with_output`] on the local
    /// pieces): shards kept, and a partial gradient stays partial over a
    /// replicated `x` and `y` (the gradient is linear in `self`).
    ///
    /// PyTorch: `torch.ops.aten.gelu_backward(grad, x)` on DTensors, which
    /// takes `x` only.
    ///
    /// # Errors
    /// Shapes that differ, dtypes that differ, different meshes, integer
    /// tensors, communication failures.
    pub fn gelu_backward_with_output(&self, x: &DTensor, y: &DTensor) -> Result<DTensor> {
        const OP: &str = "gelu_backward";
        super::same_dtypes(OP, &[self, x, y])?;
        tessera_tensor::ops::gelu_backward_shapes(self.shape(), x.shape(), y.shape())?;
        let shapes = [self.shape(), x.shape(), y.shape()];
        let cands = pointwise(&shapes, self.shape(), self.mesh().ndim(), Linearity::FirstOnly);
        dispatch(OP, &[self, x, y], &cands, self.shape(), self.dtype(), |l, _| {
            Ok(l[0].gelu_backward_with_output(&l[1], &l[2])?)
        })
    }

    /// A custom element-wise unary op: shards kept, `Partial` kept only if
    /// `linearity` allows, running `kernel` on the local piece.
    ///
    /// # Errors
    /// The kernel's error, communication failures.
    pub fn unary(
        &self,
        op: &'static str,
        linearity: Linearity,
        kernel: impl FnOnce(&Tensor) -> Result<Tensor>,
    ) -> Result<DTensor> {
        let cands = pointwise(&[self.shape()], self.shape(), self.mesh().ndim(), linearity);
        dispatch(op, &[self], &cands, self.shape(), self.dtype(), |l, _| kernel(&l[0]))
    }

    /// The same tensor in `dtype`: each rank casts its local piece (no
    /// communication; placements and shard order are kept).
    ///
    /// PyTorch: `DTensor.to(dtype)`.
    ///
    /// # Errors
    /// A cast the local kernel rejects.
    pub fn cast(&self, dtype: tessera_mesh::DType) -> Result<DTensor> {
        if dtype == self.dtype() {
            return Ok(self.clone());
        }
        let mut layout = self.layout().clone();
        layout.dtype = dtype;
        let local = {
            let _t = tessera_tensor::profile::op_scope("cast");
            self.to_local().cast(dtype)?
        };
        let out = DTensor::from_local_with_layout(local, self.mesh(), layout)?;
        crate::debug::log_op("cast", &[self], &out, false, Vec::new);
        Ok(out)
    }

    /// Zeros with this tensor's layout (no communication; a partial layout holds
    /// zeros everywhere, which is a partial zero).
    ///
    /// # Errors
    /// Never for a valid tensor.
    pub fn zeros_like(&self) -> Result<DTensor> {
        let local = Tensor::assemble(self.to_local().shape(), self.dtype(), self.to_local().device(), &[])?;
        DTensor::from_local_with_layout(local, self.mesh(), self.layout().clone())
    }

    /// Zeros laid out as `layout` on `mesh` (no communication).
    ///
    /// # Errors
    /// A layout that does not fit the mesh.
    pub fn zeros_with_layout(mesh: &tessera_mesh::DeviceMesh, layout: &crate::Layout) -> Result<DTensor> {
        let local = Tensor::assemble(
            &layout.local_shape(mesh.coordinate())?,
            layout.dtype,
            mesh.device(),
            &[],
        )?;
        DTensor::from_local_with_layout(local, mesh, layout.clone())
    }

    /// A tensor of `value` with this tensor's shape and placements, except that
    /// partial placements become replicated (no communication).
    ///
    /// # Errors
    /// Never for a valid tensor.
    pub fn full_like_replicated(&self, value: f64) -> Result<DTensor> {
        let l = self.layout();
        let placements: Vec<crate::Placement> = l
            .placements
            .iter()
            .map(|p| {
                if p.is_partial() {
                    crate::Placement::Replicate
                } else {
                    *p
                }
            })
            .collect();
        let order = if l.has_partial() {
            crate::ShardOrder::default_for(&placements)
        } else {
            l.order.clone()
        };
        let layout = crate::Layout::with_order(&l.mesh_shape, &placements, order, &l.shape, l.dtype)?;
        let shape = layout.local_shape(self.mesh().coordinate())?;
        let local = Tensor::full(&shape, value, self.dtype())?.to(self.to_local().device())?;
        DTensor::from_local_with_layout(local, self.mesh(), layout)
    }

    /// `x · s`: linear, so shards and partial values are kept.
    ///
    /// # Errors
    /// Integer inputs.
    pub fn mul_scalar(&self, s: f64) -> Result<DTensor> {
        self.unary("mul_scalar", Linearity::Additive, |t| Ok(t.mul_scalar(s)?))
    }

    /// `x / s`: linear, so shards and partial values are kept.
    ///
    /// # Errors
    /// Integer inputs.
    pub fn div_scalar(&self, s: f64) -> Result<DTensor> {
        self.unary("div_scalar", Linearity::Additive, |t| Ok(t.div_scalar(s)?))
    }

    /// `x + s`. Adding a constant to a partial sum would add it once per rank, so a
    /// partial input is reduced first.
    ///
    /// # Errors
    /// Integer inputs, communication failures.
    pub fn add_scalar(&self, s: f64) -> Result<DTensor> {
        self.unary("add_scalar", Linearity::None, |t| Ok(t.add_scalar(s)?))
    }

    /// `x - s` (a partial input is reduced first, as for [`add_scalar`](Self::add_scalar)).
    ///
    /// # Errors
    /// Integer inputs, communication failures.
    pub fn sub_scalar(&self, s: f64) -> Result<DTensor> {
        self.unary("sub_scalar", Linearity::None, |t| Ok(t.sub_scalar(s)?))
    }

    /// Every element limited to `[min, max]` (a partial input is reduced first).
    /// PyTorch: `torch.clamp` on DTensors.
    ///
    /// # Errors
    /// Both bounds absent, integer inputs, communication failures.
    pub fn clamp(&self, min: Option<f64>, max: Option<f64>) -> Result<DTensor> {
        self.unary("clamp", Linearity::None, |t| Ok(t.clamp(min, max)?))
    }

    /// `xᵉ`.
    ///
    /// # Errors
    /// Integer inputs, communication failures.
    pub fn pow(&self, e: f64) -> Result<DTensor> {
        self.unary("pow", Linearity::None, |t| Ok(t.pow(e)?))
    }
}
