//! Matmul and the neural-network ops, with their gradients.

use smallvec::{SmallVec, smallvec};
use tessera_dtensor::dist::dispatch;
use tessera_dtensor::sharding::local_shape_and_offset;
use tessera_dtensor::strategy::{Candidate, DimOption, keep_shards_except_with, product};
use tessera_dtensor::{DTensor, Layout, Placement, Placements, ReduceOp, ShardOrder, Tensor};
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
            // reduced once, to `x`'s placements, for all three gradients (each would
            // otherwise reduce it on its own).
            let reduced;
            let g = if g.placements().iter().any(|p| p.is_partial()) {
                let target: Vec<Placement> = g
                    .placements()
                    .iter()
                    .zip(x.placements())
                    .map(|(p, xp)| if p.is_partial() { *xp } else { *p })
                    .collect();
                reduced = g.redistribute(&target)?;
                &reduced
            } else {
                g
            };
            let stats = [&mean, &rstd];
            let mut out: SmallVec<[Option<DTensor>; 3]> =
                smallvec![Some(layer_norm_backward(g, &x, stats, w.as_ref())?)];
            if w.is_some() {
                out.push(Some(layer_norm_weight_grad(g, &x, stats)?));
            }
            if has_bias {
                let batch: Vec<usize> = (0..last).collect();
                out.push(Some(g.sum(&batch, false)?));
            }
            Ok(out)
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
            Ok(smallvec![Some(embedding_backward(&idx, g, vocab, &table)?), None])
        }))
    }

    /// Cross entropy of logits `[..., C]` against `i64` targets `[...]`, mean or sum.
    /// Logits whose class dim is sharded take the loss-parallel path
    /// ([`DTensor::cross_entropy_class_parallel`]): no gather in forward, and a
    /// backward without communication whose gradient has the logits' placements.
    ///
    /// PyTorch: `F.cross_entropy`, under `loss_parallel()` for class-sharded logits.
    ///
    /// # Errors
    /// As [`DTensor::cross_entropy`].
    pub fn cross_entropy(&self, targets: &Var, reduction: Reduction) -> Result<Var> {
        let (logits, t) = (self.value().clone(), targets.value().clone());
        let n: usize = t.shape().iter().product();
        let scale = if reduction == Reduction::Mean {
            1.0 / n.max(1) as f64
        } else {
            1.0
        };
        let class_dim = logits.shape().len().saturating_sub(1);
        if logits.placements().iter().any(|p| p.is_shard_on(class_dim)) {
            // Brought to the loss's layouts here, so that backward reuses them.
            let (x, t) = logits.class_parallel_inputs(&t)?;
            let (loss, lse) = x.cross_entropy_class_parallel(&t, reduction)?;
            return Ok(Var::from_op("cross_entropy", loss, &[self, targets], move |g| {
                Ok(smallvec![
                    Some(class_parallel_ce_backward(&x, &t, &lse, g, scale)?),
                    None
                ])
            }));
        }
        // The probabilities, not the logits, are kept for backward (the same bytes).
        let (value, probs) = logits.cross_entropy_with_grad(&t, reduction)?;
        Ok(Var::from_op("cross_entropy", value, &[self, targets], move |g| {
            Ok(smallvec![Some(cross_entropy_backward(&probs, &t, g, scale)?), None])
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

/// The gradient of an embedding table of `vocab` rows placed `table`: rows of `g`
/// added at `indices`. Per mesh dim: batch-sharded indices give a partial sum
/// (each rank scatters its rows); where the table is row-sharded (`Shard(0)`),
/// replicated indices and gradient give a row-sharded gradient (each rank
/// scatters only the indices in its rows); where it is column-sharded
/// (`Shard(1)`), a gradient sharded on its last dim gives a column-sharded one.
/// Neither builds the full table nor communicates.
///
/// PyTorch: the backward of `F.embedding` (`embedding_dense_backward`) under the
/// sharding rules of DTensor's embedding op.
fn embedding_backward(
    indices: &DTensor,
    g: &DTensor,
    vocab: usize,
    table: &[Placement],
) -> tessera_dtensor::Result<DTensor> {
    let d = *g.shape().last().unwrap_or(&0);
    let ir = indices.shape().len();
    let (r, s, sum) = (
        Placement::Replicate,
        Placement::Shard,
        Placement::Partial(ReduceOp::Sum),
    );
    let batch = (0..ir).map(|k| (smallvec![s(k), s(k)], sum));
    // Where the table is sharded, its sharding replaces the replicated option (it
    // always fits: replicated inputs slice for free), so a row of replicated
    // inputs is never gathered into a full table. Each input pair appears at most
    // once per mesh dim, so the kernel can tell the chosen output placements from
    // its inputs' ([`embedding_grad_placements`]).
    let per_dim: Vec<Vec<DimOption>> = (0..g.mesh().ndim())
        .map(|m| {
            let mut options: Vec<DimOption> = match table.get(m) {
                Some(Placement::Shard(0)) => vec![(smallvec![r, r], s(0))],
                Some(Placement::Shard(1)) => vec![(smallvec![r, s(ir)], s(1))],
                // The gradient is linear in `g`: a pending sum (a gradient summed
                // over a batch sharded elsewhere) stays pending, reduced once where
                // the parameter's gradient lands (FSDP's reduce-scatter).
                _ => vec![(smallvec![r, r], r), (smallvec![r, sum], sum)],
            };
            options.extend(batch.clone());
            options
        })
        .collect();
    let cands = product(&per_dim, 2);
    let table = table.to_vec();
    let mesh_shape = g.mesh().shape().to_vec();
    dispatch(
        "embedding_backward",
        &[indices, g],
        &cands,
        &[vocab, d],
        g.dtype(),
        |l, ctx| {
            let out = embedding_grad_placements(ctx.inputs, &table, ir);
            let (shape, offset) = local_shape_and_offset(
                &[vocab, d],
                &mesh_shape,
                &out,
                &ShardOrder::default_for(&out),
                ctx.coord,
            )?;
            let (rows, cols) = (shape[0], shape[1]);
            let n = l[0].numel();
            let idx = l[0].reshape(&[n])?;
            Ok(l[1]
                .reshape(&[n, cols])?
                .embedding_dense_backward(&idx, rows, offset[0])?)
        },
    )
}

/// The output placements of `embedding_backward` for its inputs' layouts after
/// redistribution: per mesh dim, batch-sharded indices give `Partial(sum)`, a
/// gradient sharded on its last dim (dim `ir`, the column-sharded table's option)
/// gives `Shard(1)`, and replicated inputs give `Shard(0)` where the table is
/// row-sharded, `Replicate` elsewhere.
fn embedding_grad_placements(inputs: &[Layout], table: &[Placement], ir: usize) -> Vec<Placement> {
    inputs[0]
        .placements
        .iter()
        .zip(&inputs[1].placements)
        .zip(table)
        .map(|((&i, &g), &t)| match (i, g, t) {
            (Placement::Shard(_), _, _) | (_, Placement::Partial(_), _) => Placement::Partial(ReduceOp::Sum),
            (_, Placement::Shard(k), _) if k == ir => Placement::Shard(1),
            (_, _, Placement::Shard(0)) => Placement::Shard(0),
            _ => Placement::Replicate,
        })
        .collect()
}

/// The gradient of class-parallel cross entropy with respect to the logits:
/// `(exp(x − lse) − onehot(target − class_offset)) · scale · g`, from the
/// logits, targets and per-row log-sum-exp the forward kept
/// ([`DTensor::cross_entropy_class_parallel`]). Local: the output has the
/// logits' placements and no collective runs (a replicated `g` assumed).
fn class_parallel_ce_backward(
    logits: &DTensor,
    targets: &DTensor,
    lse: &DTensor,
    g: &DTensor,
    scale: f64,
) -> tessera_dtensor::Result<DTensor> {
    let lp: Placements = logits.placements().iter().copied().collect();
    let tp: Placements = targets.placements().iter().copied().collect();
    let rep: Placements = smallvec![Placement::Replicate; g.mesh().ndim()];
    let cand = Candidate {
        inputs: smallvec![lp.clone(), tp.clone(), tp, rep],
        output: lp,
    };
    let cd = logits.shape().len() - 1;
    dispatch(
        "cross_entropy_backward",
        &[logits, targets, lse, g],
        &[cand],
        logits.shape(),
        logits.dtype(),
        |l, ctx| {
            let offset = ctx.offset(0)?[cd];
            let c = *l[0].shape().last().unwrap_or(&0);
            let gs = l[3].to_f64_vec()[0] * scale;
            let t = l[1].contiguous().to_vec::<i64>()?;
            let lse = l[2].to_f64_vec();
            let mut x = l[0].to_f64_vec();
            if c > 0 {
                for ((row, &k), &lse) in x.chunks_exact_mut(c).zip(&t).zip(&lse) {
                    row.iter_mut().for_each(|v| *v = (*v - lse).exp() * gs);
                    if let Some(k) = (k as usize).checked_sub(offset).filter(|&k| k < c) {
                        row[k] -= gs;
                    }
                }
            }
            Ok(Tensor::from_vec(x, l[0].shape())?.cast(l[0].dtype())?)
        },
    )
}

/// `(probs − onehot(targets)) · scale · g`, the logits' gradient from the
/// probabilities that the forward kept, sharded like their batch.
fn cross_entropy_backward(
    probs: &DTensor,
    targets: &DTensor,
    g: &DTensor,
    scale: f64,
) -> tessera_dtensor::Result<DTensor> {
    let tr = targets.shape().len();
    let (r, s) = (Placement::Replicate, Placement::Shard);
    let mut options: Vec<DimOption> = vec![(smallvec![r, r, r], r)];
    options.extend((0..tr).map(|k| (smallvec![s(k), s(k), r], s(k))));
    let cands = product(&vec![options; g.mesh().ndim()], 3);
    let c = *probs.shape().last().unwrap_or(&0);
    dispatch(
        "cross_entropy_backward",
        &[probs, targets, g],
        &cands,
        probs.shape(),
        probs.dtype(),
        |l, _| {
            let n = l[1].numel();
            if n == 0 {
                return Ok(Tensor::zeros(l[0].shape(), l[0].dtype())?);
            }
            let flat = l[0].reshape(&[n, c])?;
            let t = l[1].contiguous().reshape(&[n])?;
            let gs = l[2].to_f64_vec()[0] * scale;
            Ok(flat.cross_entropy_backward_from_probs(&t, gs)?.reshape(l[0].shape())?)
        },
    )
}

/// `y · (g − Σ_dim g·y)`, the input gradient of a softmax with output `y`, in one
/// pass per row; sharded like `y` off `dim`.
fn softmax_backward(g: &DTensor, y: &DTensor, dim: usize) -> tessera_dtensor::Result<DTensor> {
    let cands = keep_shards_except_with(y.shape().len(), &[dim], 2, 0, y.mesh().ndim());
    dispatch("softmax_backward", &[g, y], &cands, y.shape(), y.dtype(), |l, _| {
        Ok(l[0].softmax_backward(&l[1], dim)?)
    })
}

/// The input gradient of layer norm over the last dim from the forward's row
/// statistics `[mean, rstd]` (see [`Tensor::layer_norm_backward_with_stats`]),
/// sharded like `x` off the last dim, with the weight replicated.
fn layer_norm_backward(
    g: &DTensor,
    x: &DTensor,
    [mean, rstd]: [&DTensor; 2],
    w: Option<&DTensor>,
) -> tessera_dtensor::Result<DTensor> {
    let last = x.shape().len() - 1;
    let cands = keep_shards_except_with(last + 1, &[last], 4, usize::from(w.is_some()), x.mesh().ndim());
    let mut inputs: SmallVec<[&DTensor; 5]> = smallvec![g, x, mean, rstd];
    inputs.extend(w);
    dispatch("layer_norm_backward", &inputs, &cands, x.shape(), x.dtype(), |l, _| {
        Ok(l[0].layer_norm_backward_with_stats(&l[1], &l[2], &l[3], l.get(4))?)
    })
}

/// The weight gradient of layer norm, `Σ_rows g · x̂`, from the forward's row
/// statistics (see [`Tensor::layer_norm_weight_grad_with_stats`]): a partial
/// sum when the rows are sharded.
fn layer_norm_weight_grad(g: &DTensor, x: &DTensor, [mean, rstd]: [&DTensor; 2]) -> tessera_dtensor::Result<DTensor> {
    let (r, s) = (Placement::Replicate, Placement::Shard);
    let last = x.shape().len() - 1;
    let mut options: Vec<DimOption> = vec![(smallvec![r, r, r, r], r)];
    options.extend((0..last).map(|d| (smallvec![s(d), s(d), s(d), s(d)], Placement::Partial(ReduceOp::Sum))));
    let cands = product(&vec![options; x.mesh().ndim()], 4);
    dispatch(
        "layer_norm_weight_grad",
        &[g, x, mean, rstd],
        &cands,
        &[x.shape()[last]],
        x.dtype(),
        |l, _| Ok(l[0].layer_norm_weight_grad_with_stats(&l[1], &l[2], &l[3])?),
    )
}
