//! Matmul and the neural-network ops, with their gradients.

use smallvec::{SmallVec, smallvec};
use tessera_dtensor::dist::dispatch;
use tessera_dtensor::ops::Reduction;
use tessera_dtensor::strategy::{DimOption, product};
use tessera_dtensor::{DTensor, Placement, ReduceOp, Tensor};

use crate::{Result, Var};

impl Var {
    /// Matrix product (see [`DTensor::matmul`]).
    ///
    /// # Errors
    /// As [`DTensor::matmul`].
    pub fn matmul(&self, rhs: &Var) -> Result<Var> {
        let value = self.value().matmul(rhs.value())?;
        let (sa, sb) = (self.saved(), rhs.saved());
        let (need_a, need_b) = (self.requires_grad(), rhs.requires_grad());
        Ok(Var::from_op("matmul", value, &[self, rhs], move |g| {
            let (a, b) = (sa.get()?, sb.get()?);
            let (ra, rb) = (a.shape().len(), b.shape().len());
            let ga = if need_a {
                Some(g.matmul(&b.transpose(rb - 2, rb - 1)?)?)
            } else {
                None
            };
            let gb = if need_b {
                let prod = a.transpose(ra - 2, ra - 1)?.matmul(g)?;
                Some(if rb == 2 && ra > 2 {
                    let batch: Vec<usize> = (0..ra - 2).collect();
                    prod.sum(&batch, false)?
                } else {
                    prod
                })
            } else {
                None
            };
            Ok(smallvec![ga, gb])
        }))
    }

    /// `x · Wᵀ (+ b)` with `W` stored `[out, in]`, as `nn.Linear` computes it. One op:
    /// backward keeps `x` and (through [`Var::saved`]) `W`, never a transposed copy.
    ///
    /// # Errors
    /// Shapes that do not fit.
    pub fn linear(&self, weight: &Var, bias: Option<&Var>) -> Result<Var> {
        let mut value = self.value().matmul(&weight.value().transpose(0, 1)?)?;
        if let Some(b) = bias {
            value = value.add(b.value())?;
        }
        let (sx, sw) = (self.saved(), weight.saved());
        let (need_x, need_w) = (self.requires_grad(), weight.requires_grad());
        let need_b = bias.is_some_and(Var::requires_grad);
        let mut inputs: SmallVec<[&Var; 3]> = smallvec![self, weight];
        inputs.extend(bias);
        Ok(Var::from_op("linear", value, &inputs, move |g| {
            let r = g.shape().len();
            let batch: Vec<usize> = (0..r - 1).collect();
            let gx = if need_x { Some(g.matmul(&sw.get()?)?) } else { None };
            let gw = if need_w {
                // gᵀ·x over all leading dims at once: [out, N] × [N, in] with the
                // rows flattened (no per-batch products to sum afterwards).
                let x = sx.get()?;
                // Flattening keeps the shards local when only dim 0 is sharded, evenly.
                let leading_ok = |t: &DTensor| {
                    t.placements().iter().all(|p| match p.shard_dim() {
                        Some(d) => d == 0 || d == r - 1,
                        None => true,
                    }) && t.shape()[0].is_multiple_of(t.mesh().size().max(1))
                };
                Some(if r == 2 {
                    g.transpose(0, 1)?.matmul(&x)?
                } else if !(leading_ok(g) && leading_ok(&x)) {
                    let lead: Vec<usize> = (0..r - 2).collect();
                    g.transpose(r - 2, r - 1)?.matmul(&x)?.sum(&lead, false)?
                } else {
                    let n: usize = g.shape()[..r - 1].iter().product();
                    let (out, inp) = (g.shape()[r - 1], x.shape()[r - 1]);
                    let g2 = g.reshape(&[n, out])?;
                    let x2 = x.reshape(&[n, inp])?;
                    g2.transpose(0, 1)?.matmul(&x2)?
                })
            } else {
                None
            };
            let mut out: SmallVec<[Option<DTensor>; 3]> = smallvec![gx, gw];
            if need_b {
                out.push(Some(g.sum(&batch, false)?));
            }
            Ok(out)
        }))
    }

    /// Softmax along `dim`.
    ///
    /// # Errors
    /// `dim` out of range.
    pub fn softmax(&self, dim: usize) -> Result<Var> {
        let y = self.value().softmax(dim)?;
        let out = y.clone();
        Ok(self.unary_op("softmax", y, move |g| softmax_backward(g, &out, dim)))
    }

    /// Log-softmax along `dim`.
    ///
    /// # Errors
    /// `dim` out of range.
    pub fn log_softmax(&self, dim: usize) -> Result<Var> {
        let y = self.value().log_softmax(dim)?;
        let out = y.clone();
        Ok(self.unary_op("log_softmax", y, move |g| {
            let total = g.sum(&[dim], true)?;
            g.sub(&out.exp()?.mul(&total)?)
        }))
    }

    /// Causal masking of `[..., T, S]` scores with `fill` (−∞ for attention).
    ///
    /// # Errors
    /// Rank < 2.
    pub fn causal_mask(&self, fill: f64) -> Result<Var> {
        Ok(self.unary_op("causal_mask", self.value().causal_mask(fill)?, |g| g.causal_mask(0.0)))
    }

    /// Layer norm over the last dim with optional `[D]` weight and bias.
    ///
    /// # Errors
    /// Shapes that do not fit.
    pub fn layer_norm(&self, weight: Option<&Var>, bias: Option<&Var>, eps: f64) -> Result<Var> {
        let x = self.value().clone();
        let value = x.layer_norm(weight.map(Var::value), bias.map(|b| b.value()), eps)?;
        let w = weight.map(Var::saved);
        let mut inputs: SmallVec<[&Var; 3]> = smallvec![self];
        inputs.extend(weight);
        inputs.extend(bias);
        let has_bias = bias.is_some();
        Ok(Var::from_op("layer_norm", value, &inputs, move |g| {
            let last = x.shape().len() - 1;
            let w = w.as_ref().map(|w| w.get()).transpose()?;
            let mut out: SmallVec<[Option<DTensor>; 3]> = smallvec![Some(layer_norm_backward(g, &x, w.as_ref(), eps)?)];
            if w.is_some() {
                out.push(Some(layer_norm_weight_grad(g, &x, eps)?));
            }
            if has_bias {
                let batch: Vec<usize> = (0..last).collect();
                out.push(Some(g.sum(&batch, false)?));
            }
            Ok(out)
        }))
    }

    /// Rows of this `[V, D]` table picked by `indices` (`i64`).
    ///
    /// # Errors
    /// As [`DTensor::embedding`].
    pub fn embedding(&self, indices: &Var) -> Result<Var> {
        let idx = indices.value().clone();
        let value = self.value().embedding(&idx)?;
        let vocab = self.value().shape()[0];
        Ok(Var::from_op("embedding", value, &[self, indices], move |g| {
            Ok(smallvec![Some(embedding_backward(&idx, g, vocab)?), None])
        }))
    }

    /// Cross entropy of logits `[..., C]` against `i64` targets `[...]`, mean or sum.
    ///
    /// # Errors
    /// As [`DTensor::cross_entropy`].
    pub fn cross_entropy(&self, targets: &Var, reduction: Reduction) -> Result<Var> {
        let (logits, t) = (self.value().clone(), targets.value().clone());
        let value = logits.cross_entropy(&t, reduction)?;
        let n: usize = t.shape().iter().product();
        let scale = if reduction == Reduction::Mean {
            1.0 / n.max(1) as f64
        } else {
            1.0
        };
        Ok(Var::from_op("cross_entropy", value, &[self, targets], move |g| {
            Ok(smallvec![Some(cross_entropy_backward(&logits, &t, g, scale)?), None])
        }))
    }
}

/// The gradient of an embedding table: rows of `g` added at `indices`. Batch-sharded
/// indices give a partial sum (each rank scatters its rows).
fn embedding_backward(indices: &DTensor, g: &DTensor, vocab: usize) -> tessera_dtensor::Result<DTensor> {
    let d = *g.shape().last().unwrap_or(&0);
    let ir = indices.shape().len();
    let (r, s) = (Placement::Replicate, Placement::Shard);
    let mut options: Vec<DimOption> = vec![(smallvec![r, r], r)];
    options.extend((0..ir).map(|k| (smallvec![s(k), s(k)], Placement::Partial(ReduceOp::Sum))));
    let cands = product(&vec![options; g.mesh().ndim()], 2);
    dispatch(
        "embedding_backward",
        &[indices, g],
        &cands,
        &[vocab, d],
        g.dtype(),
        |l, _| {
            let idx = l[0].contiguous().to_vec::<i64>()?;
            let rows = l[1].to_f64_vec();
            let mut out = vec![0.0f64; vocab * d];
            for (k, &i) in idx.iter().enumerate() {
                let i = i as usize;
                for j in 0..d {
                    out[i * d + j] += rows[k * d + j];
                }
            }
            Tensor::from_vec(out, &[vocab, d])?.cast(l[1].dtype())
        },
    )
}

/// `(softmax(logits) − onehot(targets)) · scale · g`, sharded like the logits' batch.
fn cross_entropy_backward(
    logits: &DTensor,
    targets: &DTensor,
    g: &DTensor,
    scale: f64,
) -> tessera_dtensor::Result<DTensor> {
    let tr = targets.shape().len();
    let (r, s) = (Placement::Replicate, Placement::Shard);
    let mut options: Vec<DimOption> = vec![(smallvec![r, r, r], r)];
    options.extend((0..tr).map(|k| (smallvec![s(k), s(k), r], s(k))));
    let cands = product(&vec![options; g.mesh().ndim()], 3);
    let c = *logits.shape().last().unwrap_or(&0);
    dispatch(
        "cross_entropy_backward",
        &[logits, targets, g],
        &cands,
        logits.shape(),
        logits.dtype(),
        |l, _| {
            let n = l[1].numel();
            if n == 0 {
                return Tensor::zeros(l[0].shape(), l[0].dtype());
            }
            let flat = l[0].reshape(&[n, c])?;
            let t = l[1].contiguous().reshape(&[n])?;
            let gs = l[2].to_f64_vec()[0] * scale;
            flat.cross_entropy_backward(&t, gs)?.reshape(l[0].shape())
        },
    )
}

/// `y · (g − Σ_dim g·y)`, the input gradient of a softmax with output `y`, in one
/// pass per row; sharded like `y` off `dim`.
fn softmax_backward(g: &DTensor, y: &DTensor, dim: usize) -> tessera_dtensor::Result<DTensor> {
    let (r, s) = (Placement::Replicate, Placement::Shard);
    let mut options: Vec<DimOption> = vec![(smallvec![r, r], r)];
    options.extend(
        (0..y.shape().len())
            .filter(|&d| d != dim)
            .map(|d| (smallvec![s(d), s(d)], s(d))),
    );
    let cands = product(&vec![options; y.mesh().ndim()], 2);
    dispatch("softmax_backward", &[g, y], &cands, y.shape(), y.dtype(), |l, _| {
        l[0].softmax_backward(&l[1], dim)
    })
}

/// The input gradient of layer norm over the last dim (see
/// [`Tensor::layer_norm_backward`]), sharded like `x` off the last dim, with the
/// weight replicated.
fn layer_norm_backward(g: &DTensor, x: &DTensor, w: Option<&DTensor>, eps: f64) -> tessera_dtensor::Result<DTensor> {
    let (r, s) = (Placement::Replicate, Placement::Shard);
    let last = x.shape().len() - 1;
    let n = 2 + usize::from(w.is_some());
    let mut options: Vec<DimOption> = vec![(smallvec![r; n], r)];
    options.extend((0..last).map(|d| {
        let mut ins: SmallVec<[Placement; 3]> = smallvec![s(d), s(d)];
        ins.extend(w.map(|_| r));
        (ins, s(d))
    }));
    let cands = product(&vec![options; x.mesh().ndim()], n);
    let mut inputs: SmallVec<[&DTensor; 3]> = smallvec![g, x];
    inputs.extend(w);
    dispatch("layer_norm_backward", &inputs, &cands, x.shape(), x.dtype(), |l, _| {
        l[0].layer_norm_backward(&l[1], l.get(2), eps)
    })
}

/// The weight gradient of layer norm, `Σ_rows g · x̂` (see
/// [`Tensor::layer_norm_weight_grad`]): a partial sum when the rows are sharded.
fn layer_norm_weight_grad(g: &DTensor, x: &DTensor, eps: f64) -> tessera_dtensor::Result<DTensor> {
    let (r, s) = (Placement::Replicate, Placement::Shard);
    let last = x.shape().len() - 1;
    let mut options: Vec<DimOption> = vec![(smallvec![r, r], r)];
    options.extend((0..last).map(|d| (smallvec![s(d), s(d)], Placement::Partial(ReduceOp::Sum))));
    let cands = product(&vec![options; x.mesh().ndim()], 2);
    dispatch(
        "layer_norm_weight_grad",
        &[g, x],
        &cands,
        &[x.shape()[last]],
        x.dtype(),
        |l, _| l[0].layer_norm_weight_grad(&l[1], eps),
    )
}
