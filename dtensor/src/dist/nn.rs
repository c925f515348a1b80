//! Contractions, reductions and the neural-network ops on DTensors.

use smallvec::{SmallVec, smallvec};
use tessera_mesh::{Communicator, CommunicatorExt, DType, DeviceMesh};

use tessera_tensor::Error as TensorError;

use super::{dispatch, replicate_only};
use crate::strategy::{Candidate, DimOption, einsum, keep_shards_except, keep_shards_except_with, product, reduction};
use crate::{DTensor, Error, Layout, Placement, Placements, ReduceOp, Result, ShardOrder, Tensor};
use tessera_tensor::ops::{Attention, Causal, Reduction};

const BATCH: &str = "abcdefgh";

impl DTensor {
    /// Matrix product of `[..., m, k]` and `[k, n]` or `[..., k, n]` (same batch
    /// dims). Strategies from the einsum `"..mk,..kn->..mn"`: batch and free dims may
    /// be sharded, a sharded `k` gives `Partial(sum)`, a partial operand times a
    /// replicated one stays partial.
    ///
    /// # Errors
    /// Operands of rank < 2, mismatched inner dims or batch dims, different dtypes or meshes.
    pub fn matmul(&self, rhs: &DTensor) -> Result<DTensor> {
        let (spec, out) = self.product_shapes("matmul", rhs)?;
        let cands = einsum(&spec, self.mesh().ndim())?;
        dispatch("matmul", &[self, rhs], &cands, &out, self.dtype(), |l, _| {
            Ok(l[0].matmul(&l[1])?)
        })
    }

    /// The [`Causal`] `part` of the matrix product of `[..., m, k]` and `[k, n]`
    /// or `[..., k, n]` (see [`Tensor::matmul_causal`]): attention's products
    /// without what the causal mask makes zero or unused. The mask follows each
    /// row's and column's position, so the last two dims are replicated; batch
    /// shards (and TP's head shards) are kept. [`Causal::Dense`] is
    /// [`matmul`](Self::matmul), with all its strategies.
    ///
    /// # Errors
    /// As [`matmul`](Self::matmul).
    pub fn matmul_causal(&self, rhs: &DTensor, part: Causal) -> Result<DTensor> {
        if part == Causal::Dense {
            return self.matmul(rhs);
        }
        let (_, out) = self.product_shapes("matmul_causal", rhs)?;
        let r = out.len();
        // The right operand splits as the left one where it has the batch dims,
        // and is replicated where it is one matrix.
        let (sharded, replicated) = if rhs.shape().len() == r { (2, 0) } else { (1, 1) };
        let cands = keep_shards_except_with(r, &[r - 2, r - 1], sharded, replicated, self.mesh().ndim());
        dispatch("matmul_causal", &[self, rhs], &cands, &out, self.dtype(), |l, _| {
            Ok(l[0].matmul_causal(&l[1], part)?)
        })
    }

    /// The einsum spec and output shape of the product of `self` and `rhs`
    /// ([`matmul`](Self::matmul)'s rules), or the error that names what does not fit.
    fn product_shapes(&self, op: &'static str, rhs: &DTensor) -> Result<(String, Vec<usize>)> {
        let (a, b) = (self.shape(), rhs.shape());
        let bad = |why: &str| {
            Error::from(TensorError::ShapeMismatch {
                op,
                detail: format!("{a:?} × {b:?}: {why}"),
            })
        };
        if a.len() < 2 || b.len() < 2 {
            return Err(bad("both operands need rank ≥ 2"));
        }
        if a.len() > 2 + BATCH.len() || b.len() > 2 + BATCH.len() {
            return Err(bad("too many batch dims"));
        }
        if a[a.len() - 1] != b[b.len() - 2] {
            return Err(bad("inner dims differ"));
        }
        if self.dtype() != rhs.dtype() {
            return Err(Error::from(TensorError::DTypeMismatch {
                op,
                expected: self.dtype(),
                got: rhs.dtype(),
            }));
        }
        let batch = &BATCH[..a.len() - 2];
        let spec = if b.len() == 2 {
            format!("{batch}xy,yz->{batch}xz")
        } else if a[..a.len() - 2] == b[..b.len() - 2] {
            format!("{batch}xy,{batch}yz->{batch}xz")
        } else {
            return Err(bad("batch dims must be equal (or the right operand 2-D)"));
        };
        let mut out = a[..a.len() - 1].to_vec();
        out.push(b[b.len() - 1]);
        Ok((spec, out))
    }

    /// Sum over `dims`: a sharded reduced dim gives `Partial(sum)`.
    ///
    /// # Errors
    /// Dims out of range, integer inputs.
    pub fn sum(&self, dims: &[usize], keepdim: bool) -> Result<DTensor> {
        let out = reduced_shape("sum", self.shape(), dims, keepdim)?;
        let cands = reduction(self.shape().len(), dims, keepdim, ReduceOp::Sum, self.mesh().ndim());
        dispatch("sum", &[self], &cands, &out, self.dtype(), |l, _| {
            Ok(l[0].sum(dims, keepdim)?)
        })
    }

    /// Mean over `dims`: each rank sums its piece and scales by the global count, so
    /// a sharded reduced dim gives `Partial(sum)` of exact partial means, uneven shards included.
    ///
    /// # Errors
    /// Dims out of range, integer inputs.
    pub fn mean(&self, dims: &[usize], keepdim: bool) -> Result<DTensor> {
        let out = reduced_shape("mean", self.shape(), dims, keepdim)?;
        let count: usize = dims.iter().map(|&d| self.shape()[d]).product();
        let cands = reduction(self.shape().len(), dims, keepdim, ReduceOp::Sum, self.mesh().ndim());
        dispatch("mean", &[self], &cands, &out, self.dtype(), |l, _| {
            Ok(l[0].sum(dims, keepdim)?.mul_scalar(1.0 / count as f64)?)
        })
    }

    /// Maximum over `dims`: a sharded reduced dim gives `Partial(max)` (a rank with
    /// an empty piece contributes −∞).
    ///
    /// # Errors
    /// Dims out of range, an empty reduced dim, integer inputs.
    pub fn max(&self, dims: &[usize], keepdim: bool) -> Result<DTensor> {
        let out = reduced_shape("max", self.shape(), dims, keepdim)?;
        if let Some(&d) = dims.iter().find(|&&d| self.shape()[d] == 0) {
            return Err(Error::from(TensorError::InvalidArgument {
                op: "max",
                detail: format!("cannot take the max over dim {d} of size 0 in {:?}", self.shape()),
            }));
        }
        let cands = reduction(self.shape().len(), dims, keepdim, ReduceOp::Max, self.mesh().ndim());
        dispatch("max", &[self], &cands, &out, self.dtype(), |l, _| {
            if dims.iter().any(|&d| l[0].shape()[d] == 0) {
                let shape = reduced_shape("max", l[0].shape(), dims, keepdim)?;
                return Ok(Tensor::full(&shape, f64::NEG_INFINITY, l[0].dtype())?);
            }
            Ok(l[0].max(dims, keepdim)?)
        })
    }

    /// Softmax along `dim` (that dim replicated, other shards kept).
    ///
    /// # Errors
    /// `dim` out of range, integer inputs.
    pub fn softmax(&self, dim: usize) -> Result<DTensor> {
        let cands = keep_shards_except(self.shape().len(), &[dim], self.mesh().ndim());
        dispatch("softmax", &[self], &cands, self.shape(), self.dtype(), |l, _| {
            Ok(l[0].softmax(dim)?)
        })
    }

    /// Log-softmax along `dim` (that dim replicated, other shards kept).
    ///
    /// # Errors
    /// `dim` out of range, integer inputs.
    pub fn log_softmax(&self, dim: usize) -> Result<DTensor> {
        let cands = keep_shards_except(self.shape().len(), &[dim], self.mesh().ndim());
        dispatch("log_softmax", &[self], &cands, self.shape(), self.dtype(), |l, _| {
            Ok(l[0].log_softmax(dim)?)
        })
    }

    /// Causal masking of `[..., T, S]` scores: key `j > i` set to `fill` (the last two
    /// dims replicated, batch shards kept).
    ///
    /// # Errors
    /// Rank < 2.
    pub fn causal_mask(&self, fill: f64) -> Result<DTensor> {
        self.per_query_and_key("causal_mask", |l| Ok(l.causal_mask(fill)?))
    }

    /// The attention weights of `[..., T, S]` scores (see [`Tensor::attention_probs`]):
    /// softmax of `scale · self` over keys, causally masked when `is_causal`; the
    /// last two dims replicated, batch shards (and TP's head shards) kept.
    ///
    /// # Errors
    /// Rank < 2, a non-finite `scale`, integer inputs.
    pub fn attention_probs(&self, scale: f64, is_causal: bool) -> Result<DTensor> {
        self.per_query_and_key("attention_probs", |l| Ok(l.attention_probs(scale, is_causal)?))
    }

    /// Fused scaled dot-product attention of queries `self` `[..., L, E]` over
    /// keys `k` `[..., S, E]` and values `v` `[..., S, Ev]` (see
    /// [`Tensor::attention`]): returns the output `[..., L, Ev]` and the
    /// attention weights `[..., L, S]`, both placed alike. Batch shards (and
    /// TP's head shards) are kept; the last two dims of every input are
    /// replicated (each query needs every key).
    ///
    /// PyTorch: `torch.ops.aten._scaled_dot_product_attention_math` on DTensors.
    ///
    /// # Errors
    /// As [`Tensor::attention`]; inputs on different meshes.
    pub fn attention(&self, k: &DTensor, v: &DTensor, attn: Attention) -> Result<(DTensor, DTensor)> {
        const OP: &str = "attention";
        attn.check(OP, self.shape(), k.shape(), v.shape())?;
        same_dtypes(OP, &[self, k, v])?;
        let r = self.shape().len();
        let cands = keep_shards_except_with(r, &[r - 2, r - 1], 3, 0, self.mesh().ndim());
        let mut out_shape = self.shape().to_vec();
        out_shape[r - 1] = v.shape()[r - 1];
        let mut probs = None;
        let out = dispatch(OP, &[self, k, v], &cands, &out_shape, self.dtype(), |l, _| {
            let (out, p) = l[0].attention(&l[1], &l[2], attn)?;
            probs = Some(p);
            Ok(out)
        })?;
        let mut probs_shape = self.shape().to_vec();
        probs_shape[r - 1] = k.shape()[r - 2];
        // INVARIANT: the kernel ran (dispatch returned its output).
        let probs = probs.expect("the kernel ran");
        let probs = DTensor::from_local(probs, self.mesh(), out.placements(), &probs_shape)?;
        Ok((out, probs))
    }

    /// The gradients of [`attention`](Self::attention) with respect to `q`, `k`
    /// and `v` (those `need` asks for), given the gradient `self` of its output
    /// and the weights `probs` it returned (see [`Tensor::attention_backward`]):
    /// each placed as its input's batch dims are (batch and head shards kept,
    /// the last two dims replicated).
    ///
    /// # Errors
    /// As [`Tensor::attention_backward`]; inputs on different meshes.
    pub fn attention_backward(
        &self,
        q: &DTensor,
        k: &DTensor,
        v: &DTensor,
        probs: &DTensor,
        attn: Attention,
        need: [bool; 3],
    ) -> Result<[Option<DTensor>; 3]> {
        const OP: &str = "attention_backward";
        attn.check_backward(OP, [q.shape(), k.shape(), v.shape()], self.shape(), probs.shape())?;
        same_dtypes(OP, &[self, q, k, v, probs])?;
        let r = q.shape().len();
        // The first gradient asked for is the dispatched output, the others ride along.
        let Some(first) = need.iter().position(|&n| n) else {
            return Ok([None, None, None]);
        };
        let inputs = [q, k, v];
        let cands = keep_shards_except_with(r, &[r - 2, r - 1], 5, 0, self.mesh().ndim());
        let mut rest = None;
        let out = dispatch(
            OP,
            &[self, q, k, v, probs],
            &cands,
            inputs[first].shape(),
            self.dtype(),
            |l, _| {
                let mut grads = l[0].attention_backward(&l[1], &l[2], &l[3], &l[4], attn, need)?;
                let out = grads[first].take();
                rest = Some(grads);
                // INVARIANT: `need[first]`, so the kernel returned that gradient.
                Ok(out.expect("a gradient asked for"))
            },
        )?;
        // INVARIANT: the kernel ran (dispatch returned its output).
        let mut rest = rest.expect("the kernel ran");
        let mut grads = [None, None, None];
        for (j, grad) in rest.iter_mut().enumerate() {
            grads[j] = match grad.take() {
                Some(local) => Some(DTensor::from_local(
                    local,
                    self.mesh(),
                    out.placements(),
                    inputs[j].shape(),
                )?),
                None => None,
            };
        }
        grads[first] = Some(out);
        Ok(grads)
    }

    /// `kernel` on `[..., T, S]` scores whose last two dims it needs whole (the
    /// queries' positions decide what each row keeps): those dims replicated,
    /// batch (and head) shards kept, the output shaped like the input.
    fn per_query_and_key(&self, op: &'static str, kernel: impl FnOnce(&Tensor) -> Result<Tensor>) -> Result<DTensor> {
        let r = self.shape().len();
        if r < 2 {
            return Err(Error::from(TensorError::InvalidArgument {
                op,
                detail: format!("scores must have rank ≥ 2, got {:?}", self.shape()),
            }));
        }
        let cands = keep_shards_except(r, &[r - 2, r - 1], self.mesh().ndim());
        dispatch(op, &[self], &cands, self.shape(), self.dtype(), |l, _| kernel(&l[0]))
    }

    /// Layer norm over the last dim with optional `[D]` affine weight and bias
    /// (replicated); the last dim is replicated, other shards kept.
    ///
    /// # Errors
    /// Shapes or dtypes that do not fit.
    pub fn layer_norm(&self, weight: Option<&DTensor>, bias: Option<&DTensor>, eps: f64) -> Result<DTensor> {
        Ok(self.layer_norm_with_stats(weight, bias, eps)?.0)
    }

    /// [`layer_norm`](Self::layer_norm), also returning the per-row `mean` and
    /// `rstd` its backward takes ([`Tensor::layer_norm_with_stats`]): shaped as
    /// the input with the last dim 1, placed as the output.
    ///
    /// PyTorch: `torch.native_layer_norm` on DTensors.
    ///
    /// # Errors
    /// As [`layer_norm`](Self::layer_norm).
    pub fn layer_norm_with_stats(
        &self,
        weight: Option<&DTensor>,
        bias: Option<&DTensor>,
        eps: f64,
    ) -> Result<(DTensor, DTensor, DTensor)> {
        let r = self.shape().len();
        if r == 0 {
            return Err(Error::from(TensorError::InvalidArgument {
                op: "layer_norm",
                detail: "the input must have rank ≥ 1".into(),
            }));
        }
        let mut inputs: SmallVec<[&DTensor; 3]> = smallvec![self];
        inputs.extend(weight);
        inputs.extend(bias);
        let cands = keep_shards_except_with(r, &[r - 1], 1, inputs.len() - 1, self.mesh().ndim());
        let mut stats = None;
        let out = dispatch("layer_norm", &inputs, &cands, self.shape(), self.dtype(), |l, _| {
            let w = weight.map(|_| &l[1]);
            let b = bias.map(|_| &l[1 + usize::from(weight.is_some())]);
            let (out, mean, rstd) = l[0].layer_norm_with_stats(w, b, eps)?;
            stats = Some((mean, rstd));
            Ok(out)
        })?;
        let mut stat_shape = self.shape().to_vec();
        stat_shape[r - 1] = 1;
        // INVARIANT: the kernel ran (dispatch returned its output).
        let (mean, rstd) = stats.expect("the kernel ran");
        let place = |t| DTensor::from_local(t, self.mesh(), out.placements(), &stat_shape);
        let (mean, rstd) = (place(mean)?, place(rstd)?);
        Ok((out, mean, rstd))
    }

    /// Rows of this `[V, D]` table picked by `indices` (`i64`): output
    /// `[..indices, D]`. Strategies: batch-sharded indices with a replicated table;
    /// a column-sharded table (output sharded on its last dim); a row-sharded table
    /// (each rank looks up the rows it holds, zeros elsewhere: `Partial(sum)`).
    ///
    /// PyTorch: `F.embedding`, with `_MaskPartial` for the row-sharded table.
    ///
    /// # Errors
    /// A table that is not 2-D, indices that are not `i64`, indices out of range.
    pub fn embedding(&self, indices: &DTensor) -> Result<DTensor> {
        if self.shape().len() != 2 || indices.dtype() != DType::I64 {
            return Err(Error::from(TensorError::InvalidArgument {
                op: "embedding",
                detail: format!(
                    "needs a [V, D] table and i64 indices, got {:?} {} and {}",
                    self.shape(),
                    self.dtype(),
                    indices.dtype()
                ),
            }));
        }
        let (v, d) = (self.shape()[0], self.shape()[1]);
        let ir = indices.shape().len();
        let mut out = indices.shape().to_vec();
        out.push(d);
        let (r, s) = (Placement::Replicate, Placement::Shard);
        let mut options: Vec<DimOption> = vec![
            (smallvec![r, r], r),
            (smallvec![s(1), r], s(ir)),
            (smallvec![s(0), r], Placement::Partial(ReduceOp::Sum)),
        ];
        options.extend((0..ir).map(|k| (smallvec![r, s(k)], s(k))));
        let cands = product(&vec![options; self.mesh().ndim()], 2);
        dispatch("embedding", &[self, indices], &cands, &out, self.dtype(), |l, ctx| {
            let (table, idx) = (&l[0], &l[1]);
            if table.shape()[0] == v {
                return Ok(table.embedding(idx)?);
            }
            masked_embedding(table, idx, ctx.offset(0)?[0], v)
        })
    }

    /// Cross entropy of logits `[..., C]` against `i64` targets `[...]`.
    ///
    /// With the class dim replicated, batch-sharded logits and targets give
    /// `Partial(sum)` (each rank scales its sum by the global count for a mean), so
    /// no collective runs until the loss is reduced. With the class dim sharded on
    /// some mesh dims (a column-parallel output head), the logits are never
    /// gathered: see [`cross_entropy_class_parallel`](Self::cross_entropy_class_parallel).
    ///
    /// PyTorch: `F.cross_entropy`, and inside `loss_parallel()` for class-sharded logits.
    ///
    /// # Errors
    /// Shapes or dtypes that do not fit, targets out of range, `Reduction::None`.
    pub fn cross_entropy(&self, targets: &DTensor, reduction: Reduction) -> Result<DTensor> {
        if self.placements().iter().any(|p| p.is_shard_on(self.shape().len() - 1)) {
            return Ok(self.cross_entropy_class_parallel(targets, reduction)?.0);
        }
        Ok(self.cross_entropy_class_whole(targets, reduction, false)?.0)
    }

    /// [`cross_entropy`](Self::cross_entropy) with the class dim replicated, also
    /// returning the softmax probabilities of the logits (logits' dtype, placed as
    /// the logits were for the loss), from which the logits' gradient is one pass
    /// ([`Tensor::cross_entropy_backward_from_probs`]): a training step's backward
    /// then reads the probabilities instead of computing every exponential again.
    ///
    /// PyTorch: `F.cross_entropy` (whose backward recomputes the softmax).
    ///
    /// # Errors
    /// As [`cross_entropy`](Self::cross_entropy), and logits sharded on their
    /// class dim (use [`cross_entropy_class_parallel`](Self::cross_entropy_class_parallel)).
    pub fn cross_entropy_with_grad(&self, targets: &DTensor, reduction: Reduction) -> Result<(DTensor, DTensor)> {
        if self.placements().iter().any(|p| p.is_shard_on(self.shape().len() - 1)) {
            return Err(Error::Placement {
                op: "cross_entropy",
                detail: format!(
                    "logits placed {} shard their class dim; their probabilities are never gathered: \
                     use cross_entropy_class_parallel",
                    crate::PlacementsDisplay(self.placements())
                ),
            });
        }
        let (loss, probs) = self.cross_entropy_class_whole(targets, reduction, true)?;
        // INVARIANT: asked for them, `cross_entropy_class_whole` returns the probabilities.
        Ok((loss, probs.expect("probabilities kept")))
    }

    /// Cross entropy of logits whose class dim no mesh dim shards: batch-sharded
    /// logits and targets give `Partial(sum)` (scaled by the global count for a
    /// mean); with `keep_probs`, also the probabilities, placed as the logits were
    /// for the loss.
    fn cross_entropy_class_whole(
        &self,
        targets: &DTensor,
        reduction: Reduction,
        keep_probs: bool,
    ) -> Result<(DTensor, Option<DTensor>)> {
        let scale = ce_scale(self, targets, reduction)?;
        let (ls, ts) = (self.shape(), targets.shape());
        let c = ls[ls.len() - 1];
        let mut probs = None;
        let loss = dispatch(
            "cross_entropy",
            &[self, targets],
            &ce_candidates(ts.len(), self.mesh().ndim()),
            &[],
            self.dtype(),
            |l, ctx| {
                let n = l[1].numel();
                let (logits, t) = (l[0].reshape(&[n, c])?, l[1].reshape(&[n])?);
                // No rows here: the sum is a zero partial sum (NaN for a mean over no rows at all).
                if !keep_probs {
                    return Ok(logits.cross_entropy(&t, Reduction::Sum)?.mul_scalar(scale)?);
                }
                let (loss, p) = logits.cross_entropy_with_grad(&t, Reduction::Sum)?;
                probs = Some((p.reshape(l[0].shape())?, ctx.inputs[0].clone()));
                Ok(loss.mul_scalar(scale)?)
            },
        )?;
        let probs = probs
            .map(|(p, layout)| DTensor::from_local_with_layout(p, self.mesh(), layout))
            .transpose()?;
        Ok((loss, probs))
    }

    /// Cross entropy of logits `[..., C]` whose class dim may be sharded, without
    /// gathering them: per row, the local max is reduced with one `all_reduce(max)`,
    /// then the local `Σ exp(x − max)` and the target's logit (0 on a rank whose
    /// class range lacks it) with one `all_reduce(sum)` of both, over the mesh dims
    /// that shard the class dim; so `3 · rows` elements move instead of `rows · C`.
    /// When every mesh dim shards the class dim, each all_reduce runs once over
    /// the whole mesh; otherwise once per class-sharding mesh dim. The statistics
    /// travel in `f64` for `f64` logits and in `f32` otherwise. Uneven class splits
    /// and ranks holding no classes are fine.
    ///
    /// The inputs are first brought to [`class_parallel_inputs`](Self::class_parallel_inputs)
    /// (nothing moves when they already are). The loss is `Partial(sum)` on the
    /// mesh dims that shard a batch dim (a mean is scaled by the global count) and
    /// `Replicate` on the others.
    ///
    /// Returns the loss and, per row, `lse = log Σ_c exp(logit_c)` over all classes
    /// (`f64`, placed like the targets), from which the gradient
    /// `(exp(x − lse) − onehot(target)) · scale` is local.
    ///
    /// PyTorch: `torch.distributed.tensor.parallel.loss_parallel`.
    ///
    /// # Errors
    /// Shapes or dtypes that do not fit, targets out of range, `Reduction::None`,
    /// a failed collective.
    pub fn cross_entropy_class_parallel(&self, targets: &DTensor, reduction: Reduction) -> Result<(DTensor, DTensor)> {
        let scale = ce_scale(self, targets, reduction)?;
        let (logits, targets) = self.class_parallel_inputs(targets)?;
        let cd = self.shape().len() - 1;
        let vocab = self.shape()[cd];
        let mesh = self.mesh();
        let class_dims: SmallVec<[usize; 4]> = (0..mesh.ndim())
            .filter(|&m| logits.placements()[m].is_shard_on(cd))
            .collect();
        let (r, sum) = (Placement::Replicate, Placement::Partial(ReduceOp::Sum));
        let out: Placements = logits
            .placements()
            .iter()
            .map(|&p| if p.is_shard() && !p.is_shard_on(cd) { sum } else { r })
            .collect();
        let cand = Candidate {
            inputs: smallvec![logits.placements().into(), targets.placements().into()],
            output: out,
        };
        let wire = if self.dtype() == DType::F64 {
            DType::F64
        } else {
            DType::F32
        };
        let mut lse = None;
        let loss = dispatch(
            "cross_entropy",
            &[&logits, &targets],
            &[cand],
            &[],
            self.dtype(),
            |l, ctx| {
                let offset = ctx.offset(0)?[cd];
                let (total, row_lse) = class_parallel_rows(mesh, &class_dims, &l[0], &l[1], offset, vocab, wire)?;
                lse = Some(row_lse);
                Ok(Tensor::from_vec(vec![total * scale], &[])?.cast(l[0].dtype())?)
            },
        )?;
        let layout = Layout::new(mesh.shape(), targets.placements(), targets.shape(), DType::F64)?;
        // INVARIANT: dispatch ran the kernel, which set `lse`, before returning Ok.
        let lse = lse.expect("the kernel ran");
        Ok((loss, DTensor::from_local_with_layout(lse, mesh, layout)?))
    }

    /// These logits `[..., C]` and `targets` `[...]` as class-parallel cross
    /// entropy ([`cross_entropy_class_parallel`](Self::cross_entropy_class_parallel))
    /// reads them, in the default shard order: partial mesh dims of the logits
    /// reduced (`Replicate`), their shards kept; the targets `Replicate` on the
    /// mesh dims that shard the class dim and placed like the logits elsewhere.
    /// Each is itself when it already fits (no communication).
    ///
    /// PyTorch: the input layouts `loss_parallel` expects of the logits and targets.
    ///
    /// # Errors
    /// Logits of rank 0, targets of another rank than the logits' batch dims, a
    /// failed redistribution.
    pub fn class_parallel_inputs(&self, targets: &DTensor) -> Result<(DTensor, DTensor)> {
        let ls = self.shape();
        if ls.is_empty() || targets.shape().len() + 1 != ls.len() {
            return Err(Error::from(TensorError::ShapeMismatch {
                op: "cross_entropy",
                detail: format!(
                    "logits {ls:?} need targets of shape {:?}, got {:?}",
                    &ls[..ls.len().saturating_sub(1)],
                    targets.shape()
                ),
            }));
        }
        let cd = ls.len() - 1;
        let r = Placement::Replicate;
        let lp: Placements = self
            .placements()
            .iter()
            .map(|&p| if p.is_partial() { r } else { p })
            .collect();
        let tp: Placements = lp.iter().map(|&p| if p.is_shard_on(cd) { r } else { p }).collect();
        Ok((with_placements(self, &lp)?, with_placements(targets, &tp)?))
    }

    /// All candidates replicated: run the local kernel on full tensors (the fallback).
    ///
    /// # Errors
    /// As the kernel.
    pub fn replicated_op(
        op: &'static str,
        inputs: &[&DTensor],
        out_shape: &[usize],
        out_dtype: DType,
        kernel: impl FnOnce(&[Tensor]) -> Result<Tensor>,
    ) -> Result<DTensor> {
        let cands = replicate_only(inputs.len(), inputs[0].mesh().ndim());
        log::debug!("{op}: no sharding strategy, replicating its inputs");
        dispatch(op, inputs, &cands, out_shape, out_dtype, |l, _| kernel(l))
    }
}

/// Cross entropy's candidates with the class dim replicated: per mesh dim, all
/// replicated, or logits and targets split alike on a batch dim (of `target_rank`)
/// for a partial sum.
fn ce_candidates(target_rank: usize, mesh_ndim: usize) -> Vec<Candidate> {
    let (r, s) = (Placement::Replicate, Placement::Shard);
    let mut options: Vec<DimOption> = vec![(smallvec![r, r], r)];
    options.extend((0..target_rank).map(|k| (smallvec![s(k), s(k)], Placement::Partial(ReduceOp::Sum))));
    product(&vec![options; mesh_ndim], 2)
}

/// Checks cross entropy's logits and targets and returns the loss scale (one
/// over the global row count for a mean, 1 for a sum).
fn ce_scale(logits: &DTensor, targets: &DTensor, reduction: Reduction) -> Result<f64> {
    let (ls, ts) = (logits.shape(), targets.shape());
    if ls.is_empty() || ls[..ls.len() - 1] != *ts || targets.dtype() != DType::I64 || !logits.dtype().is_float() {
        return Err(Error::from(TensorError::ShapeMismatch {
            op: "cross_entropy",
            detail: format!(
                "float logits {ls:?} {} need i64 targets of shape {:?}, got {ts:?} {}",
                logits.dtype(),
                &ls[..ls.len().saturating_sub(1)],
                targets.dtype()
            ),
        }));
    }
    match reduction {
        Reduction::Mean => Ok(1.0 / ts.iter().product::<usize>() as f64),
        Reduction::Sum => Ok(1.0),
        _ => Err(Error::from(TensorError::InvalidArgument {
            op: "cross_entropy",
            detail: "only Mean and Sum reductions are supported on DTensors".into(),
        })),
    }
}

/// `x` with `placements` in the default shard order (itself when it has them).
fn with_placements(x: &DTensor, placements: &[Placement]) -> Result<DTensor> {
    let order = ShardOrder::default_for(placements);
    if x.placements() == placements && x.layout().order == order {
        Ok(x.clone())
    } else {
        x.redistribute_with_order(placements, order)
    }
}

/// The local rows of class-parallel cross entropy: `logits` `[..., c]` holding
/// classes `[offset, offset + c)` of `vocab`, `targets` `[...]` (the same rows on
/// every rank of `class_dims`). Returns the sum of the row losses and the rows'
/// log-sum-exp (`f64`, shaped like `targets`).
fn class_parallel_rows(
    mesh: &DeviceMesh,
    class_dims: &[usize],
    logits: &Tensor,
    targets: &Tensor,
    offset: usize,
    vocab: usize,
    wire: DType,
) -> Result<(f64, Tensor)> {
    let n = targets.numel();
    let c = logits.shape().last().copied().unwrap_or(0);
    let t = targets.contiguous().to_vec::<i64>()?;
    if let Some((row, &k)) = t.iter().enumerate().find(|&(_, &k)| k < 0 || k as u64 >= vocab as u64) {
        return Err(Error::from(TensorError::InvalidArgument {
            op: "cross_entropy",
            detail: format!("target {k} of row {row} is not a class of 0..{vocab}"),
        }));
    }
    let x = logits.to_f64_vec();
    let row = |i: usize| &x[i * c..(i + 1) * c];
    let mut max: Vec<f64> = (0..n)
        .map(|i| row(i).iter().copied().fold(f64::NEG_INFINITY, f64::max))
        .collect();
    all_reduce_rows(mesh, class_dims, &mut max, ReduceOp::Max, wire)?;
    // Σ exp(x − max) in the first n, the target's logit in the last n.
    let mut stats = vec![0.0; 2 * n];
    for (i, &m) in max.iter().enumerate() {
        stats[i] = row(i).iter().map(|&v| (v - m).exp()).sum();
        if let Some(k) = (t[i] as usize).checked_sub(offset).filter(|&k| k < c) {
            stats[n + i] = row(i)[k];
        }
    }
    all_reduce_rows(mesh, class_dims, &mut stats, ReduceOp::Sum, wire)?;
    let lse: Vec<f64> = (0..n).map(|i| stats[i].ln() + max[i]).collect();
    let total = lse.iter().zip(&stats[n..]).map(|(l, x)| l - x).sum();
    Ok((total, Tensor::from_vec(lse, targets.shape())?))
}

/// All-reduces `buf` with `op` over the mesh dims `dims` (one collective over the
/// whole mesh when they are all of its dims, else one per dim), sent as `wire`
/// (`f64`, or `f32`). Every rank of those dims holds as many rows, so an empty
/// buffer is skipped on all of them alike.
fn all_reduce_rows(mesh: &DeviceMesh, dims: &[usize], buf: &mut [f64], op: ReduceOp, wire: DType) -> Result<()> {
    if buf.is_empty() {
        return Ok(());
    }
    let comms: SmallVec<[&dyn Communicator; 4]> = if dims.len() > 1 && dims.len() == mesh.ndim() {
        smallvec![mesh.comm()]
    } else {
        dims.iter()
            .map(|&m| mesh.dim_comm(m))
            .collect::<std::result::Result<_, _>>()?
    };
    for comm in comms {
        if wire == DType::F64 {
            comm.all_reduce_slice(buf, op)?;
        } else {
            let mut narrow: Vec<f32> = buf.iter().map(|&v| v as f32).collect();
            comm.all_reduce_slice(&mut narrow, op)?;
            buf.iter_mut().zip(narrow).for_each(|(b, v)| *b = f64::from(v));
        }
    }
    Ok(())
}

/// The shape after reducing `dims`.
pub(crate) fn reduced_shape(op: &'static str, shape: &[usize], dims: &[usize], keepdim: bool) -> Result<Vec<usize>> {
    if let Some(&d) = dims.iter().find(|&&d| d >= shape.len()) {
        return Err(Error::from(TensorError::DimOutOfRange {
            op,
            dim: d,
            rank: shape.len(),
        }));
    }
    Ok(shape
        .iter()
        .enumerate()
        .filter_map(|(i, &s)| match (dims.contains(&i), keepdim) {
            (false, _) => Some(s),
            (true, true) => Some(1),
            (true, false) => None,
        })
        .collect())
}

/// Lookup in the rows `[offset, offset + rows)` of a `vocab`-row table that this rank
/// holds: other indices give zero rows.
fn masked_embedding(table: &Tensor, indices: &Tensor, offset: usize, vocab: usize) -> Result<Tensor> {
    let rows = table.shape()[0];
    let idx = indices.contiguous().to_vec::<i64>()?;
    if let Some(&bad) = idx.iter().find(|&&i| i < 0 || i as usize >= vocab) {
        return Err(Error::from(TensorError::InvalidArgument {
            op: "embedding",
            detail: format!("index {bad} is out of range for a table of {vocab} rows"),
        }));
    }
    let mut out_shape = indices.shape().to_vec();
    out_shape.push(table.shape()[1]);
    if rows == 0 {
        return Ok(Tensor::zeros(&out_shape, table.dtype())?);
    }
    let mine = |i: i64| (offset..offset + rows).contains(&(i as usize));
    let local: Vec<i64> = idx
        .iter()
        .map(|&i| if mine(i) { i - offset as i64 } else { 0 })
        .collect();
    let mask: Vec<f64> = idx.iter().map(|&i| f64::from(u8::from(mine(i)))).collect();
    let mut mask_shape = indices.shape().to_vec();
    mask_shape.push(1);
    let looked = table.embedding(&Tensor::from_vec(local, indices.shape())?)?;
    Ok(looked.mul(&Tensor::from_vec(mask, &mask_shape)?.cast(table.dtype())?)?)
}

/// Errors unless every input has the first one's dtype.
pub(super) fn same_dtypes(op: &'static str, inputs: &[&DTensor]) -> Result<()> {
    let expected = inputs[0].dtype();
    match inputs.iter().find(|x| x.dtype() != expected) {
        Some(x) => Err(Error::from(TensorError::DTypeMismatch {
            op,
            expected,
            got: x.dtype(),
        })),
        None => Ok(()),
    }
}
