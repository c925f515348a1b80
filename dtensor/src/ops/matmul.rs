//! Matrix products on DTensors: strategies from einsum specs.

use tessera_tensor::Error as TensorError;
use tessera_tensor::ops::Causal;

use super::dispatch;
use crate::strategy::{einsum, keep_shards_except_with};
use crate::{DTensor, Error, Result};

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
    /// or `[..., k, n]` (see [`Tensor::matmul_causal`](crate::Tensor::matmul_causal)): attention's products
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
}
