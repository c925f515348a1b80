//! Contractions, reductions and the neural-network ops on DTensors.

use smallvec::{SmallVec, smallvec};
use tessera_mesh::DType;

use super::{dispatch, replicate_only};
use crate::ops::Reduction;
use crate::strategy::{Candidate, DimOption, einsum, keep_shards_except, product, reduction};
use crate::{DTensor, Error, Placement, ReduceOp, Result, Tensor};

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
        let (a, b) = (self.shape(), rhs.shape());
        let bad = |why: &str| Error::ShapeMismatch {
            op: "matmul",
            detail: format!("{a:?} × {b:?}: {why}"),
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
            return Err(Error::DTypeMismatch {
                op: "matmul",
                expected: self.dtype(),
                got: rhs.dtype(),
            });
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
        let cands = einsum(&spec, self.mesh().ndim())?;
        dispatch("matmul", &[self, rhs], &cands, &out, self.dtype(), |l, _| {
            l[0].matmul(&l[1])
        })
    }

    /// Sum over `dims`: a sharded reduced dim gives `Partial(sum)`.
    ///
    /// # Errors
    /// Dims out of range, integer inputs.
    pub fn sum(&self, dims: &[usize], keepdim: bool) -> Result<DTensor> {
        let out = reduced_shape("sum", self.shape(), dims, keepdim)?;
        let cands = reduction(self.shape().len(), dims, keepdim, ReduceOp::Sum, self.mesh().ndim());
        dispatch("sum", &[self], &cands, &out, self.dtype(), |l, _| {
            l[0].sum(dims, keepdim)
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
            l[0].sum(dims, keepdim)?.mul_scalar(1.0 / count as f64)
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
            return Err(Error::InvalidArgument {
                op: "max",
                detail: format!("cannot take the max over dim {d} of size 0 in {:?}", self.shape()),
            });
        }
        let cands = reduction(self.shape().len(), dims, keepdim, ReduceOp::Max, self.mesh().ndim());
        dispatch("max", &[self], &cands, &out, self.dtype(), |l, _| {
            if dims.iter().any(|&d| l[0].shape()[d] == 0) {
                let shape = reduced_shape("max", l[0].shape(), dims, keepdim)?;
                return Tensor::full(&shape, f64::NEG_INFINITY, l[0].dtype());
            }
            l[0].max(dims, keepdim)
        })
    }

    /// Softmax along `dim` (that dim replicated, other shards kept).
    ///
    /// # Errors
    /// `dim` out of range, integer inputs.
    pub fn softmax(&self, dim: usize) -> Result<DTensor> {
        let cands = keep_shards_except(self.shape().len(), &[dim], self.mesh().ndim());
        dispatch("softmax", &[self], &cands, self.shape(), self.dtype(), |l, _| {
            l[0].softmax(dim)
        })
    }

    /// Log-softmax along `dim` (that dim replicated, other shards kept).
    ///
    /// # Errors
    /// `dim` out of range, integer inputs.
    pub fn log_softmax(&self, dim: usize) -> Result<DTensor> {
        let cands = keep_shards_except(self.shape().len(), &[dim], self.mesh().ndim());
        dispatch("log_softmax", &[self], &cands, self.shape(), self.dtype(), |l, _| {
            l[0].log_softmax(dim)
        })
    }

    /// Causal masking of `[..., T, S]` scores: key `j > i` set to `fill` (the last two
    /// dims replicated, batch shards kept).
    ///
    /// # Errors
    /// Rank < 2.
    pub fn causal_mask(&self, fill: f64) -> Result<DTensor> {
        let r = self.shape().len();
        if r < 2 {
            return Err(Error::InvalidArgument {
                op: "causal_mask",
                detail: format!("scores must have rank ≥ 2, got {:?}", self.shape()),
            });
        }
        let cands = keep_shards_except(r, &[r - 2, r - 1], self.mesh().ndim());
        dispatch("causal_mask", &[self], &cands, self.shape(), self.dtype(), |l, _| {
            l[0].causal_mask(fill)
        })
    }

    /// Layer norm over the last dim with optional `[D]` affine weight and bias
    /// (replicated); the last dim is replicated, other shards kept.
    ///
    /// # Errors
    /// Shapes or dtypes that do not fit.
    pub fn layer_norm(&self, weight: Option<&DTensor>, bias: Option<&DTensor>, eps: f64) -> Result<DTensor> {
        let r = self.shape().len();
        if r == 0 {
            return Err(Error::InvalidArgument {
                op: "layer_norm",
                detail: "the input must have rank ≥ 1".into(),
            });
        }
        let mut inputs: SmallVec<[&DTensor; 3]> = smallvec![self];
        inputs.extend(weight);
        inputs.extend(bias);
        let extra = inputs.len() - 1;
        let cands: Vec<Candidate> = keep_shards_except(r, &[r - 1], self.mesh().ndim())
            .into_iter()
            .map(|mut c| {
                let rep: SmallVec<[Placement; 4]> = smallvec![Placement::Replicate; self.mesh().ndim()];
                c.inputs.extend(std::iter::repeat_n(rep, extra));
                c
            })
            .collect();
        dispatch("layer_norm", &inputs, &cands, self.shape(), self.dtype(), |l, _| {
            let w = weight.map(|_| &l[1]);
            let b = bias.map(|_| &l[1 + usize::from(weight.is_some())]);
            l[0].layer_norm(w, b, eps)
        })
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
            return Err(Error::InvalidArgument {
                op: "embedding",
                detail: format!(
                    "needs a [V, D] table and i64 indices, got {:?} {} and {}",
                    self.shape(),
                    self.dtype(),
                    indices.dtype()
                ),
            });
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
                return table.embedding(idx);
            }
            masked_embedding(table, idx, ctx.offset(0)?[0], v)
        })
    }

    /// Cross entropy of logits `[..., C]` against `i64` targets `[...]`, with the
    /// class dim replicated. Batch-sharded logits and targets give `Partial(sum)`
    /// (each rank scales its sum by the global count for a mean), so no collective
    /// runs until the loss is reduced.
    ///
    /// # Errors
    /// Shapes or dtypes that do not fit, targets out of range, `Reduction::None`.
    pub fn cross_entropy(&self, targets: &DTensor, reduction: Reduction) -> Result<DTensor> {
        let (ls, ts) = (self.shape(), targets.shape());
        if ls.is_empty() || ls[..ls.len() - 1] != *ts || targets.dtype() != DType::I64 {
            return Err(Error::ShapeMismatch {
                op: "cross_entropy",
                detail: format!(
                    "logits {ls:?} {} need i64 targets of shape {:?}, got {ts:?} {}",
                    self.dtype(),
                    &ls[..ls.len().saturating_sub(1)],
                    targets.dtype()
                ),
            });
        }
        let scale = match reduction {
            Reduction::Mean => 1.0 / ts.iter().product::<usize>() as f64,
            Reduction::Sum => 1.0,
            _ => {
                return Err(Error::InvalidArgument {
                    op: "cross_entropy",
                    detail: "only Mean and Sum reductions are supported on DTensors".into(),
                });
            }
        };
        let (r, s) = (Placement::Replicate, Placement::Shard);
        let mut options: Vec<DimOption> = vec![(smallvec![r, r], r)];
        options.extend((0..ts.len()).map(|k| (smallvec![s(k), s(k)], Placement::Partial(ReduceOp::Sum))));
        let cands = product(&vec![options; self.mesh().ndim()], 2);
        let c = ls[ls.len() - 1];
        dispatch("cross_entropy", &[self, targets], &cands, &[], self.dtype(), |l, _| {
            let n = l[1].numel();
            if n == 0 {
                // No rows here: a zero partial sum (NaN for a mean over no rows at all).
                return Tensor::zeros(&[], l[0].dtype())?.mul_scalar(scale);
            }
            let logits = l[0].reshape(&[n, c])?;
            let t = l[1].reshape(&[n])?;
            logits.cross_entropy(&t, Reduction::Sum)?.mul_scalar(scale)
        })
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

/// The shape after reducing `dims`.
pub(crate) fn reduced_shape(op: &'static str, shape: &[usize], dims: &[usize], keepdim: bool) -> Result<Vec<usize>> {
    if let Some(&d) = dims.iter().find(|&&d| d >= shape.len()) {
        return Err(Error::DimOutOfRange {
            op,
            dim: d,
            rank: shape.len(),
        });
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
        return Err(Error::InvalidArgument {
            op: "embedding",
            detail: format!("index {bad} is out of range for a table of {vocab} rows"),
        });
    }
    let mut out_shape = indices.shape().to_vec();
    out_shape.push(table.shape()[1]);
    if rows == 0 {
        return Tensor::zeros(&out_shape, table.dtype());
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
    looked.mul(&Tensor::from_vec(mask, &mask_shape)?.cast(table.dtype())?)
}
