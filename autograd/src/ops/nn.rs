//! Matmul and the neural-network ops, with their gradients.

use smallvec::{SmallVec, smallvec};
use tessera_dtensor::{DTensor, DType, Placement, ReduceOp};
use tessera_tensor::ops::{Attention, Reduction};

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
    /// A contraction-sharded product (`x` `Shard(-1)`, `W` `Shard(1)`: row-parallel)
    /// is `Partial(sum)`; a replicated bias is then made partial on those mesh dims
    /// (kept on one rank, zeros elsewhere: no communication), so the output stays
    /// partial and the bias is added exactly once when whoever redistributes it
    /// reduces (an all_reduce to `Replicate`, a reduce_scatter to `Shard(1)` for
    /// sequence parallelism).
    ///
    /// PyTorch: `F.linear`; the deferred reduction is what `RowwiseParallel` does
    /// with its output layouts.
    ///
    /// # Errors
    /// Shapes that do not fit.
    pub fn linear(&self, weight: &Var, bias: Option<&Var>) -> Result<Var> {
        let mut value = self.value().matmul(&weight.value().transpose(0, 1)?)?;
        if let Some(b) = bias {
            value = value.add(&bias_for(&value, b.value())?)?;
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
    pub fn softmax(&self, dim: impl tessera_dtensor::Dim) -> Result<Var> {
        let dim = dim.resolve("softmax", self.value().shape().len())?;
        let y = self.value().softmax(dim)?;
        let out = y.clone();
        Ok(self.unary_op("softmax", y, move |g| g.softmax_backward(&out, dim)))
    }

    /// Log-softmax along `dim`.
    ///
    /// # Errors
    /// `dim` out of range.
    pub fn log_softmax(&self, dim: impl tessera_dtensor::Dim) -> Result<Var> {
        let dim = dim.resolve("log_softmax", self.value().shape().len())?;
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

    /// Scaled dot-product attention of queries `self` `[..., L, E]` over keys `k`
    /// `[..., S, E]` and values `v` `[..., S, Ev]`: `softmax(q·kᵀ·scale (+ causal
    /// mask))·v`, `[..., L, Ev]`, with `scale` `1/√E` unless given. One op on the
    /// tape, one fused kernel per head each way ([`DTensor::attention`] and
    /// [`DTensor::attention_backward`]: the scores and their gradient never
    /// leave the core's cache); backward keeps `q`, `k`, `v` and the attention
    /// weights. Its values and gradients are bit for bit those of the chain
    /// `q.matmul(kᵀ)`, `mul_scalar`, `causal_mask(−∞)`, `softmax`, `matmul(v)`.
    /// Batch dims (and attention heads) may be sharded; `L`, `S` and `E` are gathered.
    ///
    /// PyTorch: `torch.nn.functional.scaled_dot_product_attention(q, k, v,
    /// is_causal=is_causal, scale=scale)` without `attn_mask`, dropout or GQA.
    ///
    /// # Errors
    /// Ranks below 2 or unequal, batch dims that differ, `k` and `q` of different
    /// head sizes, `v` with another key count than `k`, a non-finite `scale`,
    /// different dtypes or meshes.
    pub fn scaled_dot_product_attention(&self, k: &Var, v: &Var, is_causal: bool, scale: Option<f64>) -> Result<Var> {
        let e = self.value().shape().last().copied().unwrap_or(0);
        let attn = Attention {
            scale: scale.unwrap_or(1.0 / (e as f64).sqrt()),
            is_causal,
        };
        let shapes = (self.value().shape(), k.value().shape(), v.value().shape());
        attn.check("scaled_dot_product_attention", shapes.0, shapes.1, shapes.2)?;
        let (value, probs) = self.value().attention(k.value(), v.value(), attn)?;
        let (sq, sk, sv) = (self.saved(), k.saved(), v.saved());
        let need = [self.requires_grad(), k.requires_grad(), v.requires_grad()];
        Ok(Var::from_op(
            "scaled_dot_product_attention",
            value,
            &[self, k, v],
            move |g| {
                let (q, k, v) = (sq.get()?, sk.get()?, sv.get()?);
                let [gq, gk, gv] = g.attention_backward(&q, &k, &v, &probs, attn, need)?;
                Ok(smallvec![gq, gk, gv])
            },
        ))
    }

    /// Layer norm over the last dim with optional `[D]` weight and bias.
    ///
    /// # Errors
    /// Shapes that do not fit.
    pub fn layer_norm(&self, weight: Option<&Var>, bias: Option<&Var>, eps: f64) -> Result<Var> {
        let x = self.value().clone();
        // The row statistics are kept for the backward (as `torch.native_layer_norm`
        // does): two passes over each row of `x` fewer in each of its two kernels.
        let (value, mean, rstd) = x.layer_norm_with_stats(weight.map(Var::value), bias.map(|b| b.value()), eps)?;
        let w = weight.map(Var::saved);
        let mut inputs: SmallVec<[&Var; 3]> = smallvec![self];
        inputs.extend(weight);
        inputs.extend(bias);
        let has_bias = bias.is_some();
        Ok(Var::from_op("layer_norm", value, &inputs, move |g| {
            let last = x.shape().len() - 1;
            let w = w.as_ref().map(|w| w.get()).transpose()?;
            // A pending sum in `g` (the input gradient of column-parallel layers) is
            // reduced once, for all three gradients (each would otherwise reduce it).
            let g = &reduce_partial_like(g, &x)?;
            let stats = [&mean, &rstd];
            let mut out: SmallVec<[Option<DTensor>; 3]> = smallvec![Some(g.layer_norm_backward_with_stats(
                &x,
                stats[0],
                stats[1],
                w.as_ref()
            )?)];
            if w.is_some() {
                out.push(Some(g.layer_norm_weight_grad_with_stats(&x, stats[0], stats[1])?));
            }
            if has_bias {
                let batch: Vec<usize> = (0..last).collect();
                out.push(Some(g.sum(&batch, false)?));
            }
            Ok(out)
        }))
    }

    /// RMSNorm over the last dim with an optional `[D]` weight (see
    /// [`DTensor::rms_norm_with_stats`]). PyTorch: `torch.nn.functional.rms_norm`.
    ///
    /// # Errors
    /// Shapes that do not fit.
    pub fn rms_norm(&self, weight: Option<&Var>, eps: f64) -> Result<Var> {
        let x = self.value().clone();
        let (value, rstd) = x.rms_norm_with_stats(weight.map(Var::value), eps)?;
        let w = weight.map(Var::saved);
        let mut inputs: SmallVec<[&Var; 2]> = smallvec![self];
        inputs.extend(weight);
        Ok(Var::from_op("rms_norm", value, &inputs, move |g| {
            let w = w.as_ref().map(|w| w.get()).transpose()?;
            // A pending sum in `g` is reduced once, for both gradients.
            let g = &reduce_partial_like(g, &x)?;
            let mut out: SmallVec<[Option<DTensor>; 3]> =
                smallvec![Some(g.rms_norm_backward_with_stats(&x, &rstd, w.as_ref())?)];
            if w.is_some() {
                out.push(Some(g.rms_norm_weight_grad_with_stats(&x, &rstd)?));
            }
            Ok(out)
        }))
    }

    /// Rotary position embedding of `[.., S, H, D]` with `f32` tables `[S, D]`
    /// (see [`DTensor::rotary_embedding`]); the gradient is the transposed
    /// rotation, which needs neither the input nor the output.
    ///
    /// PyTorch: the reference LLaMA's `apply_rotary_pos_emb`.
    ///
    /// # Errors
    /// As [`DTensor::rotary_embedding`].
    pub fn rotary_embedding(&self, cos: &tessera_dtensor::Tensor, sin: &tessera_dtensor::Tensor) -> Result<Var> {
        let value = self.value().rotary_embedding(cos, sin)?;
        let (cos, sin) = (cos.clone(), sin.clone());
        Ok(self.unary_op("rotary_embedding", value, move |g| {
            g.rotary_embedding_backward(&cos, &sin)
        }))
    }

    /// Rows of this `[V, D]` table picked by `indices` (`i64`). The table's
    /// gradient comes in its own sharding when it is sharded (see `embedding_backward`).
    ///
    /// # Errors
    /// As [`DTensor::embedding`].
    pub fn embedding(&self, indices: &Var) -> Result<Var> {
        let idx = indices.value().clone();
        let value = self.value().embedding(&idx)?;
        let table = self.value().placements().to_vec();
        let vocab = self.value().shape()[0];
        Ok(Var::from_op("embedding", value, &[self, indices], move |g| {
            Ok(smallvec![Some(g.embedding_backward(&idx, vocab, &table)?), None])
        }))
    }

    /// Cross entropy of logits `[..., C]` against `i64` targets `[...]`, mean or sum.
    /// Logits whose class dim is sharded take the loss-parallel path
    /// ([`DTensor::cross_entropy_class_parallel`]): no gather in forward, and a
    /// backward without communication whose gradient has the logits' placements.
    ///
    /// The loss is computed in `f32` when the logits are `bf16` or `f16`: they
    /// are upcast (exactly) as the loss reads them, the loss is `f32`, and the
    /// logits' gradient is rounded back to their dtype as it is written, the
    /// bits of torchtitan's `logits.float()` before the loss without a cast's
    /// pass each way (class-sharded logits are cast first); no model upcasts
    /// by hand.
    ///
    /// PyTorch: `F.cross_entropy(logits.float(), ..)`, under `loss_parallel()`
    /// for class-sharded logits.
    ///
    /// # Errors
    /// As [`DTensor::cross_entropy`].
    pub fn cross_entropy(&self, targets: &Var, reduction: Reduction) -> Result<Var> {
        let (logits, t) = (self.value().clone(), targets.value().clone());
        let class_dim = logits.shape().len().saturating_sub(1);
        let class_sharded = logits.placements().iter().any(|p| p.is_shard_on(class_dim));
        let dtype = logits.dtype();
        // 16-bit logits' loss is computed in f32.
        let upcast = if matches!(dtype, DType::BF16 | DType::F16) {
            DType::F32
        } else {
            dtype
        };
        if upcast != dtype && class_sharded {
            return self.cast(DType::F32)?.cross_entropy(targets, reduction);
        }
        let n: usize = t.shape().iter().product();
        let scale = if reduction == Reduction::Mean {
            1.0 / n.max(1) as f64
        } else {
            1.0
        };
        if class_sharded {
            // Brought to the loss's layouts here, so that backward reuses them.
            let (x, t) = logits.class_parallel_inputs(&t)?;
            let (loss, lse) = x.cross_entropy_class_parallel(&t, reduction)?;
            return Ok(Var::from_op("cross_entropy", loss, &[self, targets], move |g| {
                Ok(smallvec![
                    Some(x.cross_entropy_class_parallel_backward(&t, &lse, g, scale)?),
                    None
                ])
            }));
        }
        // The probabilities, not the logits, are kept for backward (the same
        // bytes; `f32` for 16-bit logits, upcast as they are read, and the
        // gradient rounded back as it is written).
        let (value, probs) = logits.cross_entropy_with_grad_as(&t, reduction, upcast)?;
        Ok(Var::from_op("cross_entropy", value, &[self, targets], move |g| {
            Ok(smallvec![
                Some(probs.cross_entropy_backward_from_probs_as(&t, g, scale, dtype)?),
                None
            ])
        }))
    }
}

/// The bias placed so that adding it to the product `prod` keeps the product's
/// pending sums: `Replicate → Partial(sum)` on the mesh dims where `prod` is
/// `Partial(sum)` (free: the value on one coordinate, zeros elsewhere), other
/// mesh dims as they are.
fn bias_for(prod: &DTensor, bias: &DTensor) -> tessera_dtensor::Result<DTensor> {
    let sum = Placement::Partial(ReduceOp::Sum);
    let target: Vec<Placement> = prod
        .placements()
        .iter()
        .zip(bias.placements())
        .map(|(&p, &b)| if p == sum && b.is_replicate() { sum } else { b })
        .collect();
    if target == bias.placements() {
        Ok(bias.clone())
    } else {
        // Only Replicate mesh dims change, so the bias's shard order still fits.
        bias.redistribute_with_order(&target, bias.layout().order.clone())
    }
}

/// `g` with its pending sums reduced to `x`'s placements on those mesh dims
/// (itself when nothing is pending): one reduction for all the gradients a
/// norm's backward computes from it.
fn reduce_partial_like(g: &DTensor, x: &DTensor) -> tessera_dtensor::Result<DTensor> {
    if !g.placements().iter().any(|p| p.is_partial()) {
        return Ok(g.clone());
    }
    let target: Vec<Placement> = g
        .placements()
        .iter()
        .zip(x.placements())
        .map(|(p, xp)| if p.is_partial() { *xp } else { *p })
        .collect();
    g.redistribute(&target)
}
