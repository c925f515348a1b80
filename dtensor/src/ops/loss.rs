//! Cross entropy on DTensors: batch-sharded, and class-parallel over a sharded
//! vocabulary (loss parallel), each with its backward rule.

use smallvec::{SmallVec, smallvec};
use tessera_mesh::{Communicator, CommunicatorExt, DType, DeviceMesh};
use tessera_tensor::Error as TensorError;
use tessera_tensor::ops::Reduction;

use super::dispatch;
use crate::strategy::{Candidate, Candidates, DimOption, product};
use crate::{DTensor, Error, Layout, Placement, Placements, ReduceOp, Result, ShardOrder, Tensor};

impl DTensor {
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
        Ok(self.cross_entropy_class_whole(targets, reduction, None)?.0)
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
        self.cross_entropy_with_grad_as(targets, reduction, self.dtype())
    }

    /// [`cross_entropy_with_grad`](Self::cross_entropy_with_grad) of these
    /// logits cast to `dtype` (`f32` for `bf16` or `f16` logits), bit for bit,
    /// without the cast's pass ([`Tensor::cross_entropy_with_grad_as`]): the
    /// loss and the probabilities are `dtype`.
    ///
    /// PyTorch: `F.cross_entropy(logits.float(), targets)`.
    ///
    /// # Errors
    /// As [`cross_entropy_with_grad`](Self::cross_entropy_with_grad), and a
    /// `dtype` other than the logits' own or, for 16-bit logits, `f32`.
    pub fn cross_entropy_with_grad_as(
        &self,
        targets: &DTensor,
        reduction: Reduction,
        dtype: DType,
    ) -> Result<(DTensor, DTensor)> {
        // Checked before any rank dispatches: a rank without rows never reaches the kernel's check.
        tessera_tensor::ops::upcast_target("cross_entropy", self.dtype(), dtype)?;
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
        let (loss, probs) = self.cross_entropy_class_whole(targets, reduction, Some(dtype))?;
        // INVARIANT: asked for them, `cross_entropy_class_whole` returns the probabilities.
        Ok((loss, probs.expect("probabilities kept")))
    }

    /// Cross entropy of logits whose class dim no mesh dim shards: batch-sharded
    /// logits and targets give `Partial(sum)` (scaled by the global count for a
    /// mean); with `keep_probs`, also the probabilities, placed as the logits were
    /// for the loss, the loss and the probabilities computed in that dtype
    /// ([`Tensor::cross_entropy_with_grad_as`]).
    fn cross_entropy_class_whole(
        &self,
        targets: &DTensor,
        reduction: Reduction,
        keep_probs: Option<DType>,
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
            keep_probs.unwrap_or(self.dtype()),
            |l, ctx| {
                let n = l[1].numel();
                let (logits, t) = (l[0].reshape(&[n, c])?, l[1].reshape(&[n])?);
                // No rows here: the sum is a zero partial sum (NaN for a mean over no rows at all).
                let Some(dtype) = keep_probs else {
                    return Ok(logits.cross_entropy(&t, Reduction::Sum)?.mul_scalar(scale)?);
                };
                let (loss, p) = logits.cross_entropy_with_grad_as(&t, Reduction::Sum, dtype)?;
                // Placed as the logits were, in the loss's dtype.
                let mut layout = ctx.inputs[0].clone();
                layout.dtype = dtype;
                probs = Some((p.reshape(l[0].shape())?, layout));
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
            &Candidates::of(vec![cand]),
            &[],
            self.dtype(),
            |l, ctx| {
                let offset = ctx.offset(0)?[cd];
                let (total, row_lse) = class_parallel_rows(mesh, &class_dims, &l[0], &l[1], offset, vocab, wire)?;
                lse = Some(row_lse);
                Ok(Tensor::from_vec(vec![total * scale], &[])?
                    .cast(l[0].dtype())?
                    .to(l[0].device())?)
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

    /// The gradient of class-parallel cross entropy with respect to the logits:
    /// `(exp(x − lse) − onehot(target − class_offset)) · scale · g`, from the
    /// logits (`self`), targets and per-row log-sum-exp the forward kept
    /// ([`DTensor::cross_entropy_class_parallel`]). Local: the output has the
    /// logits' placements and no collective runs (a replicated `g` assumed).
    ///
    /// # Errors
    /// Inputs on different meshes or of shapes the forward did not give.
    pub fn cross_entropy_class_parallel_backward(
        &self,
        targets: &DTensor,
        lse: &DTensor,
        g: &DTensor,
        scale: f64,
    ) -> Result<DTensor> {
        let logits = self;
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
            &Candidates::of(vec![cand]),
            logits.shape(),
            logits.dtype(),
            |l, ctx| {
                if l.iter().any(Tensor::is_meta) {
                    // A planning run: the f64 gradient below and its cast.
                    return Ok(Tensor::meta(l[0].shape(), DType::F64)?.cast(l[0].dtype())?);
                }
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
                Ok(Tensor::from_vec(x, l[0].shape())?
                    .cast(l[0].dtype())?
                    .to(l[0].device())?)
            },
        )
    }

    /// `(probs − onehot(targets)) · scale · g`, the logits' gradient from the
    /// probabilities (`self`) that the forward kept, sharded like their batch
    /// (see [`Tensor::cross_entropy_backward_from_probs`]).
    ///
    /// # Errors
    /// Shapes that do not fit, a failed redistribution.
    pub fn cross_entropy_backward_from_probs(&self, targets: &DTensor, g: &DTensor, scale: f64) -> Result<DTensor> {
        self.cross_entropy_backward_from_probs_as(targets, g, scale, self.dtype())
    }

    /// [`cross_entropy_backward_from_probs`](Self::cross_entropy_backward_from_probs)
    /// cast to `dtype`, bit for bit, in one pass
    /// ([`Tensor::cross_entropy_backward_from_probs_as`]): the `bf16` or
    /// `f16` gradient of logits whose loss
    /// [`cross_entropy_with_grad_as`](Self::cross_entropy_with_grad_as) computed in `f32`.
    ///
    /// # Errors
    /// As [`cross_entropy_backward_from_probs`](Self::cross_entropy_backward_from_probs),
    /// and a `dtype` that no logits' upcast pairs with the probabilities'.
    pub fn cross_entropy_backward_from_probs_as(
        &self,
        targets: &DTensor,
        g: &DTensor,
        scale: f64,
        dtype: DType,
    ) -> Result<DTensor> {
        // Checked before any rank dispatches: a rank without rows never reaches the kernel's check.
        if self.dtype().is_float() {
            tessera_tensor::ops::upcast_target("cross_entropy_backward", dtype, self.dtype())?;
        }
        let probs = self;
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
            dtype,
            |l, _| {
                let n = l[1].numel();
                if n == 0 {
                    return Ok(Tensor::zeros(l[0].shape(), dtype)?.to(l[0].device())?);
                }
                let flat = l[0].reshape(&[n, c])?;
                let t = l[1].contiguous().reshape(&[n])?;
                let gs = l[2].to_f64_vec()[0] * scale;
                Ok(flat
                    .cross_entropy_backward_from_probs_as(&t, gs, dtype)?
                    .reshape(l[0].shape())?)
            },
        )
    }
}

/// Cross entropy's candidates with the class dim replicated: per mesh dim, all
/// replicated, or logits and targets split alike on a batch dim (of `target_rank`)
/// for a partial sum.
fn ce_candidates(target_rank: usize, mesh_ndim: usize) -> Candidates {
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
    if logits.is_meta() || targets.is_meta() {
        // A planning run: the two all-reductions below, counted (the targets,
        // having no values, are not checked); the per-row lse, without values.
        for len in [n, 2 * n] {
            if len > 0 {
                for comm in row_comms(mesh, class_dims)? {
                    comm.count_planned(tessera_mesh::Planned::AllReduce { dtype: wire, len })?;
                }
            }
        }
        return Ok((f64::NAN, Tensor::meta(targets.shape(), DType::F64)?));
    }
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
    Ok((total, Tensor::from_vec(lse, targets.shape())?.to(logits.device())?))
}

/// The communicators of an all-reduction over the mesh dims `dims`: the whole
/// mesh's when they are all of its dims, else one per dim.
fn row_comms<'m>(mesh: &'m DeviceMesh, dims: &[usize]) -> Result<SmallVec<[&'m dyn Communicator; 4]>> {
    Ok(if dims.len() > 1 && dims.len() == mesh.ndim() {
        smallvec![mesh.comm()]
    } else {
        dims.iter()
            .map(|&m| mesh.dim_comm(m))
            .collect::<std::result::Result<_, _>>()?
    })
}

/// All-reduces `buf` with `op` over the mesh dims `dims` (one collective over the
/// whole mesh when they are all of its dims, else one per dim), sent as `wire`
/// (`f64`, or `f32`). Every rank of those dims holds as many rows, so an empty
/// buffer is skipped on all of them alike.
fn all_reduce_rows(mesh: &DeviceMesh, dims: &[usize], buf: &mut [f64], op: ReduceOp, wire: DType) -> Result<()> {
    if buf.is_empty() {
        return Ok(());
    }
    for comm in row_comms(mesh, dims)? {
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
