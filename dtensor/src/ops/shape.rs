//! View-like ops on DTensors: transpose, permute, reshape, narrow, cat.

use smallvec::smallvec;

use tessera_tensor::Error as TensorError;

use super::dispatch;
use crate::strategy::{DimOption, product};
use crate::{DTensor, Error, Placement, ReduceOp, Result, Tensor};

/// Per-mesh-dim options of a one-input op that moves dim `d` to `map(d)` (`None`:
/// that dim cannot stay sharded). Replicate and linear partials are kept.
pub(super) fn remap_options(rank: usize, map: impl Fn(usize) -> Option<usize>) -> Vec<DimOption> {
    let r = Placement::Replicate;
    let mut options: Vec<DimOption> = vec![(smallvec![r], r)];
    for op in [ReduceOp::Sum, ReduceOp::Avg] {
        options.push((smallvec![Placement::Partial(op)], Placement::Partial(op)));
    }
    for d in 0..rank {
        if let Some(o) = map(d) {
            options.push((smallvec![Placement::Shard(d)], Placement::Shard(o)));
        }
    }
    options
}

impl DTensor {
    /// Swaps two dims (a local view; shards move with their dims).
    ///
    /// # Errors
    /// Dims out of range.
    pub fn transpose(&self, d0: impl tessera_tensor::Dim, d1: impl tessera_tensor::Dim) -> Result<DTensor> {
        let (d0, d1) = (
            d0.resolve("transpose", self.shape().len())?,
            d1.resolve("transpose", self.shape().len())?,
        );
        let rank = self.shape().len();
        let mut perm: Vec<usize> = (0..rank).collect();
        if d0 >= rank || d1 >= rank {
            return Err(Error::from(TensorError::DimOutOfRange {
                op: "transpose",
                dim: d0.max(d1),
                rank,
            }));
        }
        perm.swap(d0, d1);
        self.permute(&perm)
    }

    /// Reorders dims: output dim `i` is input dim `dims[i]` (a local view).
    ///
    /// # Errors
    /// `dims` not a permutation of the dims.
    pub fn permute(&self, dims: &[impl tessera_tensor::Dim]) -> Result<DTensor> {
        let dims = &tessera_tensor::resolve_dims(dims, "permute", self.shape().len())?[..];
        let rank = self.shape().len();
        let mut seen = vec![false; rank];
        if dims.len() != rank || dims.iter().any(|&d| d >= rank || std::mem::replace(&mut seen[d], true)) {
            return Err(Error::from(TensorError::InvalidArgument {
                op: "permute",
                detail: format!("{dims:?} is not a permutation of the {rank} dims of {:?}", self.shape()),
            }));
        }
        let out: Vec<usize> = dims.iter().map(|&d| self.shape()[d]).collect();
        let options = remap_options(rank, |d| dims.iter().position(|&x| x == d));
        let cands = product(&vec![options; self.mesh().ndim()], 1);
        dispatch("permute", &[self], &cands, &out, self.dtype(), |l, _| {
            Ok(l[0].permute(dims)?)
        })
    }

    /// The same elements in a new shape. A shard survives when its dim keeps its size
    /// and the dims before it hold the same number of elements (e.g. splitting or
    /// merging the dims after a batch-sharded dim); otherwise the input is gathered.
    /// One size may be `-1`, inferred from the element count.
    ///
    /// # Errors
    /// A shape with another element count.
    pub fn reshape(&self, shape: &[impl tessera_tensor::ShapeSize]) -> Result<DTensor> {
        let shape = &tessera_tensor::infer_shape("reshape", shape, self.shape().iter().product())?[..];
        let a = self.shape();
        if a.iter().product::<usize>() != shape.iter().product::<usize>() {
            return Err(Error::from(TensorError::ShapeMismatch {
                op: "reshape",
                detail: format!("cannot reshape {a:?} into {shape:?}: element counts differ"),
            }));
        }
        // Input dim `d` can stay sharded as output dim `o` when `o` starts where `d`
        // starts and either has its size, or merges `d` with the dims after it, or
        // splits `d` with `o` leading — the last two only when every rank's shard is
        // whole rows of the merged or split dim: `d`'s (resp. `o`'s) size divisible
        // by the number of shards the mesh dims sharding `d` make (checked per
        // candidate below).
        let remap = |d: usize| -> Option<(usize, Option<usize>)> {
            let before: usize = a[..d].iter().product();
            let o = (0..shape.len()).find(|&o| shape[..o].iter().product::<usize>() == before)?;
            let prefix_of = |big: &[usize], from: usize, target: usize| {
                let mut p = 1usize;
                big[from..].iter().any(|&x| {
                    p = p.saturating_mul(x);
                    p == target
                })
            };
            if shape[o] == a[d] {
                Some((o, None))
            } else if shape[o] > a[d] {
                prefix_of(a, d, shape[o]).then_some((o, Some(a[d])))
            } else {
                prefix_of(shape, o, a[d]).then_some((o, Some(shape[o])))
            }
        };
        let map = |d: usize| remap(d).map(|(o, _)| o);
        let options = remap_options(a.len(), map);
        let mesh_shape = self.mesh().shape();
        let cands = product(&vec![options; self.mesh().ndim()], 1).retain(|c| {
            (0..a.len()).all(|d| {
                let shards: usize = c.inputs[0]
                    .iter()
                    .zip(mesh_shape)
                    .filter(|(p, _)| p.is_shard_on(d))
                    .map(|(_, n)| n)
                    .product();
                match remap(d) {
                    Some((_, Some(rows))) => rows.is_multiple_of(shards),
                    _ => true,
                }
            })
        });
        dispatch("reshape", &[self], &cands, shape, self.dtype(), |l, ctx| {
            let mut local = shape.to_vec();
            for p in &ctx.inputs[0].placements {
                if let Placement::Shard(d) = *p {
                    // INVARIANT: only dims with a mapping are sharded in the candidates,
                    // and those shard evenly, so the ratio is exact.
                    let o = map(d).expect("mapped dim");
                    local[o] = (shape[o] * l[0].shape()[d]).checked_div(a[d]).unwrap_or(0);
                }
            }
            Ok(l[0].contiguous().reshape(&local)?)
        })
    }

    /// `len` elements of `dim` from `start` (that dim replicated, other shards kept).
    ///
    /// # Errors
    /// A range past the dim's end.
    pub fn narrow(&self, dim: impl tessera_tensor::Dim, start: usize, len: usize) -> Result<DTensor> {
        let dim = dim.resolve("narrow", self.shape().len())?;
        let rank = self.shape().len();
        if dim >= rank || start + len > self.shape()[dim] {
            return Err(Error::from(TensorError::InvalidArgument {
                op: "narrow",
                detail: format!("dim {dim}, start {start}, len {len} is outside {:?}", self.shape()),
            }));
        }
        let mut out = self.shape().to_vec();
        out[dim] = len;
        let options = remap_options(rank, |d| (d != dim).then_some(d));
        let cands = product(&vec![options; self.mesh().ndim()], 1);
        dispatch("narrow", &[self], &cands, &out, self.dtype(), |l, _| {
            Ok(l[0].narrow(dim, start, len)?)
        })
    }

    /// Concatenates along `dim` (that dim replicated; other shards and partial sums
    /// kept when every input has them).
    ///
    /// # Errors
    /// No inputs, shapes that differ off `dim`, different dtypes or meshes.
    pub fn cat(xs: &[&DTensor], dim: impl tessera_tensor::Dim) -> Result<DTensor> {
        // No tensors: any dim resolves, and the missing input is the error below.
        let dim = dim.resolve("cat", xs.first().map_or(usize::MAX, |x| x.shape().len()))?;
        let first = xs.first().ok_or_else(|| {
            Error::from(TensorError::InvalidArgument {
                op: "cat",
                detail: "no tensors to concatenate".into(),
            })
        })?;
        let rank = first.shape().len();
        let mut out = first.shape().to_vec();
        if dim >= rank {
            return Err(Error::from(TensorError::DimOutOfRange { op: "cat", dim, rank }));
        }
        out[dim] = 0;
        for x in xs {
            let ok = x.shape().len() == rank
                && (0..rank).all(|d| d == dim || x.shape()[d] == first.shape()[d])
                && x.dtype() == first.dtype();
            if !ok {
                return Err(Error::from(TensorError::ShapeMismatch {
                    op: "cat",
                    detail: format!(
                        "{:?} {} vs {:?} {} along dim {dim}",
                        first.shape(),
                        first.dtype(),
                        x.shape(),
                        x.dtype()
                    ),
                }));
            }
            out[dim] += x.shape()[dim];
        }
        let n = xs.len();
        let per: Vec<DimOption> = remap_options(rank, |d| (d != dim).then_some(d))
            .into_iter()
            .map(|(i, o)| (smallvec![i[0]; n], o))
            .collect();
        let cands = product(&vec![per; first.mesh().ndim()], n);
        dispatch("cat", xs, &cands, &out, first.dtype(), |l, _| Ok(Tensor::cat(l, dim)?))
    }
}
