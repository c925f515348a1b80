//! Attention on DTensors: scores, weights and the fused attention with its backward,
//! batch and head shards kept.

use tessera_tensor::Error as TensorError;
use tessera_tensor::ops::Attention;

use super::{dispatch, same_dtypes};
use crate::strategy::{keep_shards_except, keep_shards_except_with};
use crate::{DTensor, Error, Result, Tensor};

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
