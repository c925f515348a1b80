//! Attention on DTensors: scores, weights and the fused attention with its backward,
//! batch and head shards kept; rotary position embeddings (sequence and head
//! shards kept) and the key/value head repetition of grouped-query attention.

use tessera_tensor::Error as TensorError;
use tessera_tensor::ops::Attention;

use super::shape::remap_options;
use super::{dispatch, same_dtypes};
use crate::strategy::{Candidate, Candidates, DimOption, keep_shards_except, keep_shards_except_with, product};
use crate::{DTensor, Error, Placement, Result, Tensor};

impl DTensor {
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

    /// Rotary position embedding of `self` `[.., S, H, D]` with `f32` tables
    /// `cos`, `sin` `[S, D]` for the whole (global) sequence (see
    /// [`Tensor::rotary_embedding`]). Every dim but the head features may stay
    /// sharded: a shard of the sequence reads its own rows of the tables, a
    /// shard of the heads or the batch needs nothing; the rotation is linear, so
    /// a partial sum stays partial.
    ///
    /// PyTorch: the reference LLaMA's `apply_rotary_pos_emb` on DTensors
    /// (torchtitan applies it to the local heads under tensor parallelism).
    ///
    /// # Errors
    /// As [`Tensor::rotary_embedding`].
    pub fn rotary_embedding(&self, cos: &Tensor, sin: &Tensor) -> Result<DTensor> {
        self.rotary("rotary_embedding", cos, sin, false)
    }

    /// The input gradient of [`rotary_embedding`](Self::rotary_embedding) for
    /// the output gradient `self`, placed as `self` (see
    /// [`Tensor::rotary_embedding_backward`]).
    ///
    /// # Errors
    /// As [`Tensor::rotary_embedding_backward`].
    pub fn rotary_embedding_backward(&self, cos: &Tensor, sin: &Tensor) -> Result<DTensor> {
        self.rotary("rotary_embedding_backward", cos, sin, true)
    }

    fn rotary(&self, op: &'static str, cos: &Tensor, sin: &Tensor, backward: bool) -> Result<DTensor> {
        let r = self.shape().len();
        if r < 3 {
            return Err(Error::from(TensorError::InvalidArgument {
                op,
                detail: format!(
                    "the input has shape {:?}; rotary embeddings take [.., seq, heads, head_dim] (rank ≥ 3)",
                    self.shape()
                ),
            }));
        }
        // The kernel on an empty tensor of the global shape (one more leading
        // dim, of size 0) checks the dtype and the tables, moving nothing.
        let probe = [&[0], self.shape()].concat();
        Tensor::zeros(&probe, self.dtype())?.rotary_embedding(cos, sin)?;
        let seq = r - 3;
        let options = remap_options(r, |d| (d != r - 1).then_some(d));
        let cands = product(&vec![options; self.mesh().ndim()], 1);
        dispatch(op, &[self], &cands, self.shape(), self.dtype(), |l, ctx| {
            // This rank's positions: rows [start, start + len) of the tables.
            let (start, len) = (ctx.offset(0)?[seq], l[0].shape()[seq]);
            let (c, s) = (cos.narrow(0, start, len)?, sin.narrow(0, start, len)?);
            Ok(if backward {
                l[0].rotary_embedding_backward(&c, &s)?
            } else {
                l[0].rotary_embedding(&c, &s)?
            })
        })
    }

    /// Each slice along `dim` repeated `repeats` times in place (see
    /// [`Tensor::repeat_interleave`]): `[.., n, ..]` to `[.., n·repeats, ..]`.
    /// Shards of other dims and partial sums are kept; a shard of `dim` is kept
    /// where the mesh dims sharding it split `n` evenly (tensor parallelism
    /// holding whole key/value heads per rank: each rank repeats its own).
    ///
    /// PyTorch: `torch.repeat_interleave` on DTensors (LLaMA's `repeat_kv`).
    ///
    /// # Errors
    /// As [`Tensor::repeat_interleave`].
    pub fn repeat_interleave(&self, repeats: usize, dim: impl tessera_tensor::Dim) -> Result<DTensor> {
        let dim = dim.resolve("repeat_interleave", self.shape().len())?;
        let op = "repeat_interleave";
        let mut out_shape = self.shape().to_vec();
        check_dim(op, dim, out_shape.len())?;
        out_shape[dim] *= repeats;
        let cands = self.group_candidates(dim, self.shape()[dim]);
        dispatch(op, &[self], &cands, &out_shape, self.dtype(), |l, _| {
            Ok(l[0].repeat_interleave(repeats, dim)?)
        })
    }

    /// The gradient of [`repeat_interleave`](Self::repeat_interleave) for the
    /// output gradient `self`: groups of `repeats` slices along `dim` summed,
    /// sharded as the forward was.
    ///
    /// # Errors
    /// As [`Tensor::repeat_interleave_backward`].
    pub fn repeat_interleave_backward(&self, repeats: usize, dim: impl tessera_tensor::Dim) -> Result<DTensor> {
        let dim = dim.resolve("repeat_interleave_backward", self.shape().len())?;
        let op = "repeat_interleave_backward";
        let mut out_shape = self.shape().to_vec();
        check_dim(op, dim, out_shape.len())?;
        if repeats == 0 || !out_shape[dim].is_multiple_of(repeats) {
            // The local kernel's message names the shapes.
            self.to_local().repeat_interleave_backward(repeats.max(1), dim)?;
        }
        out_shape[dim] /= repeats.max(1);
        let cands = self.group_candidates(dim, out_shape[dim]);
        dispatch(op, &[self], &cands, &out_shape, self.dtype(), |l, _| {
            Ok(l[0].repeat_interleave_backward(repeats, dim)?)
        })
    }

    /// Candidates of an op mapping each of `groups` slices along `dim` to a
    /// group of consecutive slices (or back): other dims' shards and partials
    /// kept; `dim` kept sharded on mesh dims whose sizes, together, divide
    /// `groups` (then every rank holds whole groups, in order).
    fn group_candidates(&self, dim: usize, groups: usize) -> Candidates {
        let r = self.shape().len();
        let sizes = self.mesh().shape();
        let per_dim: Vec<Vec<DimOption>> = sizes
            .iter()
            .map(|&m| {
                let mut o = remap_options(r, |d| (d != dim).then_some(d));
                if m > 0 && groups.is_multiple_of(m) {
                    o.push((smallvec::smallvec![Placement::Shard(dim)], Placement::Shard(dim)));
                }
                o
            })
            .collect();
        let split = |c: &Candidate| -> usize {
            c.output
                .iter()
                .zip(sizes)
                .filter(|(p, _)| **p == Placement::Shard(dim))
                .map(|(_, m)| *m)
                .product()
        };
        product(&per_dim, 1).retain(|c| groups.is_multiple_of(split(c)))
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
}

/// Errors unless `dim < rank`.
fn check_dim(op: &'static str, dim: usize, rank: usize) -> Result<()> {
    if dim < rank {
        Ok(())
    } else {
        Err(Error::from(TensorError::DimOutOfRange { op, dim, rank }))
    }
}
