//! Embedding lookups on DTensors (row-, column- or un-sharded tables) and their backward.

use smallvec::smallvec;
use tessera_mesh::DType;
use tessera_tensor::Error as TensorError;

use super::dispatch;
use crate::sharding::local_shape_and_offset;
use crate::strategy::{DimOption, product};
use crate::{DTensor, Error, Layout, Placement, ReduceOp, Result, ShardOrder, Tensor};

impl DTensor {
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

    /// The gradient of an embedding table of `vocab` rows placed `table`: rows of `g`
    /// added at `indices`. Per mesh dim: batch-sharded indices give a partial sum
    /// (each rank scatters its rows); where the table is row-sharded (`Shard(0)`),
    /// replicated indices and gradient give a row-sharded gradient (each rank
    /// scatters only the indices in its rows); where it is column-sharded
    /// (`Shard(1)`), a gradient sharded on its last dim gives a column-sharded one.
    /// Neither builds the full table nor communicates.
    ///
    /// `self` is the gradient of the embedding's output (`[..., d]`, the indices' shape plus `d`).
    ///
    /// # Errors
    /// Shapes or placements that do not fit, a failed redistribution.
    ///
    /// PyTorch: the backward of `F.embedding` (`embedding_dense_backward`) under the
    /// sharding rules of DTensor's embedding op.
    pub fn embedding_backward(&self, indices: &DTensor, vocab: usize, table: &[Placement]) -> Result<DTensor> {
        let g = self;
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
                    // the parameter's gradient lands (a data-parallel reduce-scatter).
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
}

/// Lookup in the rows `[offset, offset + rows)` of a `vocab`-row table that this rank
/// holds: other indices give zero rows.
fn masked_embedding(table: &Tensor, indices: &Tensor, offset: usize, vocab: usize) -> Result<Tensor> {
    let rows = table.shape()[0];
    if table.is_meta() || indices.is_meta() {
        // A planning run: the tensors the host path below makes, without
        // values (and without the indices' range check).
        let mut mask_shape = indices.shape().to_vec();
        mask_shape.push(1);
        let looked = table.embedding(&Tensor::meta(indices.shape(), DType::I64)?)?;
        return Ok(looked.mul(&Tensor::meta(&mask_shape, DType::F64)?.cast(table.dtype())?)?);
    }
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
        return Ok(Tensor::zeros(&out_shape, table.dtype())?.to(table.device())?);
    }
    let mine = |i: i64| (offset..offset + rows).contains(&(i as usize));
    let local: Vec<i64> = idx
        .iter()
        .map(|&i| if mine(i) { i - offset as i64 } else { 0 })
        .collect();
    let mask: Vec<f64> = idx.iter().map(|&i| f64::from(u8::from(mine(i)))).collect();
    let mut mask_shape = indices.shape().to_vec();
    mask_shape.push(1);
    // The shifted indices and the mask are made on the host (the indices
    // were read there to check them) and go where the table is.
    let device = table.device();
    let looked = table.embedding(&Tensor::from_vec(local, indices.shape())?.to(device)?)?;
    Ok(looked.mul(&Tensor::from_vec(mask, &mask_shape)?.cast(table.dtype())?.to(device)?)?)
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
