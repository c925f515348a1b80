//! Sharding math: the sizes and offsets of every rank's piece of a tensor.
//!
//! This module is the one place these numbers are computed. Everything here is a pure
//! function of (global shape, mesh shape, placements, shard order, coordinate).
//!
//! - [`shard_size_and_offset`]: one split, with `torch.chunk` semantics.
//! - [`local_shape_and_offset`]: the local shape and global offset on a coordinate.
//! - [`split_chain`]: every split of one tensor dim in split order, with the piece
//!   before and after each (what a padded collective along one mesh dim needs);
//!   [`logical_size_before`] and [`logical_shape_per_mesh_dim`] read from it.
//! - [`num_shards`], [`padded_chunk_size`]: small helpers for the redistribute planner.
//!
//! An empty piece has offset equal to the global dim size (PyTorch DCP's sentinel).
//!
//! PyTorch: `torch/distributed/tensor/_utils.py` (`compute_local_shape_and_global_offset`)
//! and `Shard.local_shard_size_and_offset`.

use smallvec::SmallVec;

use tessera_tensor::Error as TensorError;

use crate::placement::{Placement, ShardOrder, validate_placements};
use crate::{Error, Result};

/// The size and offset of piece `idx` when a dim of `size` is split into `n` pieces, with
/// `torch.chunk` semantics.
///
/// The chunk is `ceil(size / n)`; piece `idx` starts at `chunk * idx`. A piece that
/// starts at or past the end is empty and gets offset `size`; otherwise it runs to
/// `min(size, start + chunk)`. So trailing pieces may be short or empty:
/// 13 over 4 gives sizes 4, 4, 4, 1 and 6 over 4 gives 2, 2, 2, 0. `idx >= n` gives an
/// empty piece; `n == 0` (no pieces, which a valid mesh never has) gives `(0, size)`.
///
/// ```
/// use tessera_dtensor::sharding::shard_size_and_offset;
///
/// assert_eq!(shard_size_and_offset(13, 4, 3), (1, 12));
/// assert_eq!(shard_size_and_offset(6, 4, 3), (0, 6));
/// ```
///
/// PyTorch: `Shard.local_shard_size_and_offset`.
pub fn shard_size_and_offset(size: usize, n: usize, idx: usize) -> (usize, usize) {
    tessera_tensor::chunk_size_and_offset(size, n, idx)
}

/// The chunk size a padded collective uses when a piece of `logical_size` is split `n`
/// ways: `ceil(logical_size / n)` (0 when `n == 0`). Every rank pads its piece to this
/// length before an all_gather or reduce_scatter and unpads after.
pub fn padded_chunk_size(logical_size: usize, n: usize) -> usize {
    if n == 0 { 0 } else { logical_size.div_ceil(n) }
}

/// How many pieces tensor dim `tensor_dim` is split into: the product of the sizes of
/// the mesh dims whose placement is `Shard(tensor_dim)` (1 when none).
///
/// `placements` and `mesh_shape` go together (one placement per mesh dim, checked by
/// [`validate_placements`]); entries past the shorter of the two are ignored.
///
/// PyTorch: `DTensorSpec.num_shards_map`.
pub fn num_shards(placements: &[Placement], mesh_shape: &[usize], tensor_dim: usize) -> usize {
    placements
        .iter()
        .zip(mesh_shape)
        .filter(|(p, _)| p.is_shard_on(tensor_dim))
        .map(|(_, &n)| n)
        .product()
}

/// One split in the chain of a tensor dim, as seen from one mesh coordinate.
///
/// The piece `logical_size` long at `logical_offset` is split `num_chunks` ways along
/// `mesh_dim`, and this coordinate keeps piece `index` of it: `local_size` long at
/// `local_offset`. Offsets are global; an empty piece has offset equal to the global dim
/// size. Only the mesh dims earlier in the chain decide `logical_size`, so all ranks
/// along `mesh_dim` (which differ only in `index`) agree on it, and a collective along
/// `mesh_dim` pads every piece to [`Split::padded_chunk_size`]. The local tensor is this
/// split's piece only when it is the last split of the chain; an outer split's piece has
/// been cut further by the later ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct Split {
    /// The mesh dim that splits.
    pub mesh_dim: usize,
    /// The size of that mesh dim: how many pieces.
    pub num_chunks: usize,
    /// This coordinate along `mesh_dim`: which piece it keeps.
    pub index: usize,
    /// The size of the piece before this split.
    pub logical_size: usize,
    /// The global offset of the piece before this split.
    pub logical_offset: usize,
    /// The size of the piece kept.
    pub local_size: usize,
    /// The global offset of the piece kept.
    pub local_offset: usize,
}

impl Split {
    /// `ceil(logical_size / num_chunks)`: the length every rank along `mesh_dim` pads its
    /// piece to for a collective.
    pub fn padded_chunk_size(&self) -> usize {
        padded_chunk_size(self.logical_size, self.num_chunks)
    }

    /// How many elements this coordinate pads: `padded_chunk_size() - local_size`.
    pub fn padding(&self) -> usize {
        self.padded_chunk_size() - self.local_size
    }
}

/// The splits of a tensor dim of `global_size` by the mesh dims of `chain` (outermost
/// split first, as [`ShardOrder::order_of`] gives it), seen from `coord`.
///
/// The result has one [`Split`] per entry of `chain`, in chain order; the last one's
/// `local_size`/`local_offset` are the coordinate's piece (the whole dim at offset 0 when
/// `chain` is empty).
///
/// # Errors
///
/// [`InvalidArgument`](TensorError::InvalidArgument) when `coord` and `mesh_shape` differ in length, a mesh dim
/// has size 0, a coordinate is out of range, or `chain` names a mesh dim twice or one
/// past the mesh.
pub fn split_chain(
    global_size: usize,
    mesh_shape: &[usize],
    chain: &[usize],
    coord: &[usize],
) -> Result<SmallVec<[Split; 4]>> {
    const OP: &str = "split_chain";
    check_mesh_coord(OP, mesh_shape, coord)?;
    for (i, &m) in chain.iter().enumerate() {
        if m >= mesh_shape.len() || chain[..i].contains(&m) {
            return Err(Error::from(TensorError::InvalidArgument {
                op: OP,
                detail: format!(
                    "the split chain {chain:?} must name distinct mesh dims below {} (the \
                     mesh has shape {mesh_shape:?})",
                    mesh_shape.len()
                ),
            }));
        }
    }
    Ok(splits_unchecked(global_size, mesh_shape, chain, coord))
}

/// [`split_chain`] without checks: the caller has validated every index.
fn splits_unchecked(
    global_size: usize,
    mesh_shape: &[usize],
    chain: &[usize],
    coord: &[usize],
) -> SmallVec<[Split; 4]> {
    let (mut size, mut offset) = (global_size, 0);
    chain
        .iter()
        .map(|&m| {
            let (n, index) = (mesh_shape[m], coord[m]);
            let (sub_size, sub_offset) = shard_size_and_offset(size, n, index);
            let split = Split {
                mesh_dim: m,
                num_chunks: n,
                index,
                logical_size: size,
                logical_offset: offset,
                local_size: sub_size,
                local_offset: if sub_size == 0 {
                    global_size
                } else {
                    offset + sub_offset
                },
            };
            (size, offset) = (split.local_size, split.local_offset);
            split
        })
        .collect()
}

/// The size of the piece of a tensor dim of `global_size` just before mesh dim `mesh_dim`
/// splits it, along the split `chain`, seen from `coord` (the "logical shape per mesh
/// dim" of that tensor dim). It depends only on the coordinates of the mesh dims before
/// `mesh_dim` in the chain, so every rank along `mesh_dim` gets the same value: an
/// all_gather along `mesh_dim` (the last split of the chain) pads each piece to
/// `padded_chunk_size(size, n)` and narrows the result back to `size`.
///
/// # Errors
///
/// As [`split_chain`], and [`InvalidArgument`](TensorError::InvalidArgument) when `mesh_dim` is not in `chain`.
pub fn logical_size_before(
    global_size: usize,
    mesh_shape: &[usize],
    chain: &[usize],
    mesh_dim: usize,
    coord: &[usize],
) -> Result<usize> {
    split_chain(global_size, mesh_shape, chain, coord)?
        .iter()
        .find(|s| s.mesh_dim == mesh_dim)
        .map(|s| s.logical_size)
        .ok_or_else(|| {
            Error::from(TensorError::InvalidArgument {
                op: "logical_size_before",
                detail: format!("mesh dim {mesh_dim} is not in the split chain {chain:?}"),
            })
        })
}

/// The shape of the piece of `global_shape` that mesh coordinate `coord` holds, and the
/// global offset of its first element.
///
/// Each tensor dim is split by the mesh dims that shard it, in the order `order` gives
/// (see [`ShardOrder`]); each split keeps sub-piece `coord[m]` of `mesh_shape[m]`
/// ([`shard_size_and_offset`]). `Replicate` and `Partial` do not change the shape. A dim
/// whose piece is empty has offset equal to its global size.
///
/// ```
/// use tessera_dtensor::{Placement::Shard, ShardOrder, sharding::local_shape_and_offset};
///
/// let p = [Shard(1), Shard(1)];
/// let order = ShardOrder::default_for(&p);
/// let got = local_shape_and_offset(&[2, 5], &[2, 2], &p, &order, &[1, 0]).unwrap();
/// assert_eq!(got, (vec![2, 1], vec![0, 3]));
/// ```
///
/// PyTorch: `torch.distributed.tensor._utils.compute_local_shape_and_global_offset`.
///
/// # Errors
///
/// [`Error::Placement`] when the placements do not fit the mesh or the tensor rank, or
/// `order` does not describe them; [`InvalidArgument`](TensorError::InvalidArgument) for a mesh dim of size 0
/// or a coordinate outside the mesh.
pub fn local_shape_and_offset(
    global_shape: &[usize],
    mesh_shape: &[usize],
    placements: &[Placement],
    order: &ShardOrder,
    coord: &[usize],
) -> Result<(Vec<usize>, Vec<usize>)> {
    check_layout(
        "local_shape_and_offset",
        global_shape,
        mesh_shape,
        placements,
        order,
        coord,
    )?;
    let mut shape = global_shape.to_vec();
    let mut offset = vec![0; global_shape.len()];
    for (d, &size) in global_shape.iter().enumerate() {
        let chain = order.order_of(placements, d);
        if let Some(last) = splits_unchecked(size, mesh_shape, &chain, coord).last() {
            (shape[d], offset[d]) = (last.local_size, last.local_offset);
        }
    }
    Ok((shape, offset))
}

/// Every coordinate of a mesh of `shape`, row-major (the order of the ranks of the
/// communicator the mesh was built over).
pub fn mesh_coords(shape: &[usize]) -> Vec<Vec<usize>> {
    let mut out = vec![vec![]];
    for &n in shape {
        out = out
            .into_iter()
            .flat_map(|c| (0..n).map(move |i| [c.as_slice(), &[i]].concat()))
            .collect();
    }
    out
}

/// For every mesh dim `m`, the shape of the tensor as a collective along `m` sees it on
/// `coord`: the local shape, except that when `placements[m]` is `Shard(d)`, dim `d` has
/// the size of the piece before `m` splits it ([`logical_size_before`]).
///
/// Unlike PyTorch's left-to-right prefix, this follows `order` and leaves the other dims
/// at their local sizes, which is what the local tensor holds.
///
/// # Errors
///
/// As [`local_shape_and_offset`].
pub fn logical_shape_per_mesh_dim(
    global_shape: &[usize],
    mesh_shape: &[usize],
    placements: &[Placement],
    order: &ShardOrder,
    coord: &[usize],
) -> Result<Vec<Vec<usize>>> {
    const OP: &str = "logical_shape_per_mesh_dim";
    check_layout(OP, global_shape, mesh_shape, placements, order, coord)?;
    let splits: Vec<SmallVec<[Split; 4]>> = global_shape
        .iter()
        .enumerate()
        .map(|(d, &size)| splits_unchecked(size, mesh_shape, &order.order_of(placements, d), coord))
        .collect();
    let local: Vec<usize> = global_shape
        .iter()
        .zip(&splits)
        .map(|(&size, s)| s.last().map_or(size, |s| s.local_size))
        .collect();
    let per_mesh_dim = placements.iter().enumerate().map(|(m, p)| {
        let mut shape = local.clone();
        // `check_layout` validated `order` against `placements`, so the chain of `d`
        // contains every mesh dim whose placement is `Shard(d)`.
        if let Some(d) = p.shard_dim()
            && let Some(split) = splits[d].iter().find(|s| s.mesh_dim == m)
        {
            shape[d] = split.logical_size;
        }
        shape
    });
    Ok(per_mesh_dim.collect())
}

/// Validates everything [`local_shape_and_offset`] indexes.
fn check_layout(
    op: &'static str,
    global_shape: &[usize],
    mesh_shape: &[usize],
    placements: &[Placement],
    order: &ShardOrder,
    coord: &[usize],
) -> Result<()> {
    let placement_err = |e: Error| match e {
        Error::Placement { detail, .. } => Error::Placement { op, detail },
        e => e,
    };
    validate_placements(placements, global_shape.len(), mesh_shape.len()).map_err(placement_err)?;
    order.validate_for(placements).map_err(placement_err)?;
    check_mesh_coord(op, mesh_shape, coord)
}

/// Checks that `coord` is a coordinate of a mesh of shape `mesh_shape` with no empty dim.
fn check_mesh_coord(op: &'static str, mesh_shape: &[usize], coord: &[usize]) -> Result<()> {
    let err = |detail: String| Error::from(TensorError::InvalidArgument { op, detail });
    if let Some(m) = mesh_shape.iter().position(|&n| n == 0) {
        return Err(err(format!(
            "mesh dim {m} of mesh shape {mesh_shape:?} has size 0; every mesh dim needs at \
             least one rank"
        )));
    }
    if coord.len() != mesh_shape.len() {
        return Err(err(format!(
            "coordinate {coord:?} has {} entries but the mesh {mesh_shape:?} has {} dims",
            coord.len(),
            mesh_shape.len()
        )));
    }
    if let Some(m) = (0..coord.len()).find(|&m| coord[m] >= mesh_shape[m]) {
        return Err(err(format!(
            "coordinate {coord:?} is outside the mesh {mesh_shape:?}: coord[{m}] = {} must \
             be below {}",
            coord[m], mesh_shape[m]
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::*;
    use crate::Placement::{Partial, Replicate, Shard};
    use crate::ReduceOp;

    const SUM: Placement = Partial(ReduceOp::Sum);

    fn default(p: &[Placement]) -> ShardOrder {
        ShardOrder::default_for(p)
    }

    fn reversed(p: &[Placement]) -> ShardOrder {
        ShardOrder::reversed_for(p)
    }

    /// `(size, n) => sizes, offsets` of every piece, one line per case.
    macro_rules! sso {
        ($($name:ident: $size:expr, $n:expr => $sizes:expr, $offsets:expr;)*) => {$(
            #[test]
            fn $name() {
                let got: Vec<(usize, usize)> =
                    (0..$n).map(|i| shard_size_and_offset($size, $n, i)).collect();
                let want: Vec<(usize, usize)> =
                    $sizes.into_iter().zip($offsets).collect();
                assert_eq!(got, want);
            }
        )*};
    }

    sso! {
        sso_0_1: 0, 1 => [0], [0];
        sso_0_2: 0, 2 => [0, 0], [0, 0];
        sso_0_3: 0, 3 => [0, 0, 0], [0, 0, 0];
        sso_0_4: 0, 4 => [0, 0, 0, 0], [0, 0, 0, 0];
        sso_1_1: 1, 1 => [1], [0];
        sso_1_2: 1, 2 => [1, 0], [0, 1];
        sso_1_3: 1, 3 => [1, 0, 0], [0, 1, 1];
        sso_1_4: 1, 4 => [1, 0, 0, 0], [0, 1, 1, 1];
        sso_2_1: 2, 1 => [2], [0];
        sso_2_2: 2, 2 => [1, 1], [0, 1];
        sso_2_3: 2, 3 => [1, 1, 0], [0, 1, 2];
        sso_2_4: 2, 4 => [1, 1, 0, 0], [0, 1, 2, 2];
        sso_3_1: 3, 1 => [3], [0];
        sso_3_2: 3, 2 => [2, 1], [0, 2];
        sso_3_3: 3, 3 => [1, 1, 1], [0, 1, 2];
        sso_3_4: 3, 4 => [1, 1, 1, 0], [0, 1, 2, 3];
        sso_4_1: 4, 1 => [4], [0];
        sso_4_2: 4, 2 => [2, 2], [0, 2];
        sso_4_3: 4, 3 => [2, 2, 0], [0, 2, 4];
        sso_4_4: 4, 4 => [1, 1, 1, 1], [0, 1, 2, 3];
        sso_5_1: 5, 1 => [5], [0];
        sso_5_2: 5, 2 => [3, 2], [0, 3];
        sso_5_3: 5, 3 => [2, 2, 1], [0, 2, 4];
        sso_5_4: 5, 4 => [2, 2, 1, 0], [0, 2, 4, 5];
        sso_6_1: 6, 1 => [6], [0];
        sso_6_2: 6, 2 => [3, 3], [0, 3];
        sso_6_3: 6, 3 => [2, 2, 2], [0, 2, 4];
        sso_6_4: 6, 4 => [2, 2, 2, 0], [0, 2, 4, 6];
        sso_7_1: 7, 1 => [7], [0];
        sso_7_2: 7, 2 => [4, 3], [0, 4];
        sso_7_3: 7, 3 => [3, 3, 1], [0, 3, 6];
        sso_7_4: 7, 4 => [2, 2, 2, 1], [0, 2, 4, 6];
        sso_8_1: 8, 1 => [8], [0];
        sso_8_2: 8, 2 => [4, 4], [0, 4];
        sso_8_3: 8, 3 => [3, 3, 2], [0, 3, 6];
        sso_8_4: 8, 4 => [2, 2, 2, 2], [0, 2, 4, 6];
        sso_9_1: 9, 1 => [9], [0];
        sso_9_2: 9, 2 => [5, 4], [0, 5];
        sso_9_3: 9, 3 => [3, 3, 3], [0, 3, 6];
        sso_9_4: 9, 4 => [3, 3, 3, 0], [0, 3, 6, 9];
        sso_10_1: 10, 1 => [10], [0];
        sso_10_2: 10, 2 => [5, 5], [0, 5];
        sso_10_3: 10, 3 => [4, 4, 2], [0, 4, 8];
        sso_10_4: 10, 4 => [3, 3, 3, 1], [0, 3, 6, 9];
        sso_11_1: 11, 1 => [11], [0];
        sso_11_2: 11, 2 => [6, 5], [0, 6];
        sso_11_3: 11, 3 => [4, 4, 3], [0, 4, 8];
        sso_11_4: 11, 4 => [3, 3, 3, 2], [0, 3, 6, 9];
        sso_12_1: 12, 1 => [12], [0];
        sso_12_2: 12, 2 => [6, 6], [0, 6];
        sso_12_3: 12, 3 => [4, 4, 4], [0, 4, 8];
        sso_12_4: 12, 4 => [3, 3, 3, 3], [0, 3, 6, 9];
        sso_13_1: 13, 1 => [13], [0];
        sso_13_2: 13, 2 => [7, 6], [0, 7];
        sso_13_3: 13, 3 => [5, 5, 3], [0, 5, 10];
        sso_13_4: 13, 4 => [4, 4, 4, 1], [0, 4, 8, 12];
        sso_14_1: 14, 1 => [14], [0];
        sso_14_2: 14, 2 => [7, 7], [0, 7];
        sso_14_3: 14, 3 => [5, 5, 4], [0, 5, 10];
        sso_14_4: 14, 4 => [4, 4, 4, 2], [0, 4, 8, 12];
    }

    macro_rules! scalar {
        ($($name:ident: $got:expr => $want:expr;)*) => {$(
            #[test]
            fn $name() {
                assert_eq!($got, $want);
            }
        )*};
    }

    scalar! {
        sso_past_n: shard_size_and_offset(13, 4, 4) => (0, 13);
        sso_huge_index: shard_size_and_offset(13, 4, usize::MAX) => (0, 13);
        sso_zero_pieces: shard_size_and_offset(13, 0, 0) => (0, 13);
        padded_13_4: padded_chunk_size(13, 4) => 4;
        padded_12_4: padded_chunk_size(12, 4) => 3;
        padded_1_4: padded_chunk_size(1, 4) => 1;
        padded_0_4: padded_chunk_size(0, 4) => 0;
        padded_zero_pieces: padded_chunk_size(5, 0) => 0;
        num_shards_none: num_shards(&[Replicate, SUM], &[2, 3], 0) => 1;
        num_shards_one: num_shards(&[Replicate, Shard(0)], &[2, 3], 0) => 3;
        num_shards_two: num_shards(&[Shard(1), Shard(1), Shard(0)], &[2, 3, 4], 1) => 6;
        num_shards_other_dim: num_shards(&[Shard(1), Shard(1), Shard(0)], &[2, 3, 4], 0) => 4;
        num_shards_empty_mesh: num_shards(&[], &[], 0) => 1;
    }

    /// `global, mesh, placements, order, coord => local shape, offset`, one line per case.
    macro_rules! local {
        ($($name:ident: $global:expr, $mesh:expr, $p:expr, $order:expr, $coord:expr => $shape:expr, $offset:expr;)*) => {$(
            #[test]
            fn $name() {
                let p: &[Placement] = &$p;
                let order_for: fn(&[Placement]) -> ShardOrder = $order;
                let got = local_shape_and_offset(&$global, &$mesh, p, &order_for(p), &$coord).unwrap();
                assert_eq!(got, ($shape.to_vec(), $offset.to_vec()));
            }
        )*};
    }

    local! {
        // PyTorch's doc fixture.
        doc_00: [2, 5], [2, 2], [Shard(1), Shard(1)], default, [0, 0] => [2, 2], [0, 0];
        doc_01: [2, 5], [2, 2], [Shard(1), Shard(1)], default, [0, 1] => [2, 1], [0, 2];
        doc_10: [2, 5], [2, 2], [Shard(1), Shard(1)], default, [1, 0] => [2, 1], [0, 3];
        doc_11: [2, 5], [2, 2], [Shard(1), Shard(1)], default, [1, 1] => [2, 1], [0, 4];
        // Default order: rank (i, j) holds rows block 2i + j.
        s0s0_default_00: [8, 8], [2, 2], [Shard(0), Shard(0)], default, [0, 0] => [2, 8], [0, 0];
        s0s0_default_01: [8, 8], [2, 2], [Shard(0), Shard(0)], default, [0, 1] => [2, 8], [2, 0];
        s0s0_default_10: [8, 8], [2, 2], [Shard(0), Shard(0)], default, [1, 0] => [2, 8], [4, 0];
        s0s0_default_11: [8, 8], [2, 2], [Shard(0), Shard(0)], default, [1, 1] => [2, 8], [6, 0];
        // Reversed (FSDP over TP): rank (i, j) holds rows block 2j + i.
        s0s0_reversed_00: [8, 8], [2, 2], [Shard(0), Shard(0)], reversed, [0, 0] => [2, 8], [0, 0];
        s0s0_reversed_01: [8, 8], [2, 2], [Shard(0), Shard(0)], reversed, [0, 1] => [2, 8], [4, 0];
        s0s0_reversed_10: [8, 8], [2, 2], [Shard(0), Shard(0)], reversed, [1, 0] => [2, 8], [2, 0];
        s0s0_reversed_11: [8, 8], [2, 2], [Shard(0), Shard(0)], reversed, [1, 1] => [2, 8], [6, 0];
        // 3-D mesh, one dim split three times: default 4i + 2j + k, reversed 4k + 2j + i,
        // order [1, 0, 2]: 4j + 2i + k.
        mesh3_default_011: [8], [2, 2, 2], [Shard(0), Shard(0), Shard(0)], default, [0, 1, 1] => [1], [3];
        mesh3_default_100: [8], [2, 2, 2], [Shard(0), Shard(0), Shard(0)], default, [1, 0, 0] => [1], [4];
        mesh3_reversed_011: [8], [2, 2, 2], [Shard(0), Shard(0), Shard(0)], reversed, [0, 1, 1] => [1], [6];
        mesh3_reversed_100: [8], [2, 2, 2], [Shard(0), Shard(0), Shard(0)], reversed, [1, 0, 0] => [1], [1];
        mesh3_given_011: [8], [2, 2, 2], [Shard(0), Shard(0), Shard(0)], |p| ShardOrder::new(p, [(0, [1, 0, 2])]).unwrap(), [0, 1, 1] => [1], [5];
        mesh3_given_100: [8], [2, 2, 2], [Shard(0), Shard(0), Shard(0)], |p| ShardOrder::new(p, [(0, [1, 0, 2])]).unwrap(), [1, 0, 0] => [1], [2];
        // 3-D mesh, two dims split twice in opposite orders.
        mesh3_two_dims: [8, 9], [2, 2, 3], [Shard(0), Shard(1), Shard(0)], reversed, [1, 0, 2] => [1, 5], [7, 0];
        mesh3_uneven: [7, 5], [3, 2, 2], [Shard(1), Shard(0), Shard(1)], default, [2, 1, 1] => [3, 0], [4, 5];
        // Mixed placements: Replicate and Partial leave the shape alone.
        mixed_000: [5, 7], [2, 1, 3], [Shard(0), Replicate, Shard(1)], default, [0, 0, 0] => [3, 3], [0, 0];
        mixed_102: [5, 7], [2, 1, 3], [Shard(0), Replicate, Shard(1)], default, [1, 0, 2] => [2, 1], [3, 6];
        mixed_rep_coord: [5, 7], [2, 2, 3], [Shard(0), Replicate, Shard(1)], default, [1, 1, 1] => [2, 3], [3, 3];
        partial_shard: [6, 4], [2, 3], [SUM, Shard(0)], default, [1, 2] => [2, 4], [4, 0];
        partial_max: [6, 4], [2, 3], [Partial(ReduceOp::Max), Shard(1)], default, [1, 2] => [6, 0], [0, 4];
        partial_only: [6, 4], [2, 3], [SUM, Partial(ReduceOp::Avg)], default, [1, 2] => [6, 4], [0, 0];
        replicate_only: [6, 4], [2], [Replicate], default, [1] => [6, 4], [0, 0];
        scalar: [], [2], [Replicate], default, [1] => [0usize; 0], [0usize; 0];
        no_mesh_dims: [3, 4], [], [], default, [] => [3, 4], [0, 0];
        // Uneven, with empty trailing pieces (offset = global size).
        uneven_3_default_10: [3], [2, 2], [Shard(0), Shard(0)], default, [1, 0] => [1], [2];
        uneven_3_default_11: [3], [2, 2], [Shard(0), Shard(0)], default, [1, 1] => [0], [3];
        uneven_3_reversed_10: [3], [2, 2], [Shard(0), Shard(0)], reversed, [1, 0] => [1], [1];
        uneven_3_reversed_01: [3], [2, 2], [Shard(0), Shard(0)], reversed, [0, 1] => [1], [2];
        uneven_3_reversed_11: [3], [2, 2], [Shard(0), Shard(0)], reversed, [1, 1] => [0], [3];
        uneven_1_00: [1], [2, 2], [Shard(0), Shard(0)], default, [0, 0] => [1], [0];
        uneven_1_01: [1], [2, 2], [Shard(0), Shard(0)], default, [0, 1] => [0], [1];
        uneven_1_10: [1], [2, 2], [Shard(0), Shard(0)], default, [1, 0] => [0], [1];
        empty_before_second_split: [2], [4, 2], [Shard(0), Shard(0)], default, [2, 1] => [0], [2];
        empty_last_split_only: [5, 4], [4], [Shard(0)], default, [3] => [0, 4], [5, 0];
        zero_size_dim: [0, 3], [2], [Shard(0)], default, [1] => [0, 3], [0, 0];
        six_over_four: [6], [4], [Shard(0)], default, [3] => [0], [6];
        thirteen_over_four: [13], [4], [Shard(0)], default, [3] => [1], [12];
    }

    /// `global, mesh, placements, order built for, coord => error substring`.
    macro_rules! local_err {
        ($($name:ident: $global:expr, $mesh:expr, $p:expr, $built_for:expr, $coord:expr => $want:expr;)*) => {$(
            #[test]
            fn $name() {
                let p: &[Placement] = &$p;
                let built_for: &[Placement] = &$built_for;
                let order = ShardOrder::reversed_for(built_for);
                let err = local_shape_and_offset(&$global, &$mesh, p, &order, &$coord).unwrap_err();
                let msg = err.to_string();
                assert!(msg.starts_with("local_shape_and_offset: "), "{msg}");
                assert!(msg.contains($want), "{msg:?} lacks {:?}", $want);
            }
        )*};
    }

    local_err! {
        err_too_few_placements: [4], [2, 2], [Shard(0)], [Shard(0)], [0, 0] => "(Shard(0)) has 1 placements but the mesh has 2 dims";
        err_too_many_placements: [4], [2], [Shard(0), Replicate], [], [0] => "has 2 placements but the mesh has 1 dims";
        err_shard_past_rank: [4, 4], [2, 2], [Replicate, Shard(2)], [], [0, 0] => "placement 1 of (Replicate, Shard(2)) is Shard(2) but the tensor has rank 2";
        err_order_for_other: [4], [2, 2], [Shard(0), Replicate], [Shard(0), Shard(0)], [0, 0] => "shard order {0: [1, 0]} does not describe (Shard(0), Replicate)";
        err_order_missing: [4], [2, 2], [Shard(0), Shard(0)], [Shard(0), Replicate], [0, 0] => "tensor dim 0 is sharded by mesh dims [0, 1] but has no entry";
        err_coord_short: [4], [2, 2], [Shard(0), Replicate], [], [0] => "coordinate [0] has 1 entries but the mesh [2, 2] has 2 dims";
        err_coord_long: [4], [2], [Shard(0)], [], [0, 0] => "coordinate [0, 0] has 2 entries but the mesh [2] has 1 dims";
        err_coord_out_of_range: [4], [2, 3], [Replicate, Shard(0)], [], [1, 3] => "coordinate [1, 3] is outside the mesh [2, 3]: coord[1] = 3 must be below 3";
        err_empty_mesh_dim: [4], [2, 0], [Replicate, Shard(0)], [], [1, 0] => "mesh dim 1 of mesh shape [2, 0] has size 0";
    }

    #[test]
    fn split_chain_records_every_split() {
        // 13 split 2 ways by mesh dim 0, then that piece 4 ways by mesh dim 1.
        let got = split_chain(13, &[2, 4], &[0, 1], &[1, 3]).unwrap();
        let want = [
            Split {
                mesh_dim: 0,
                num_chunks: 2,
                index: 1,
                logical_size: 13,
                logical_offset: 0,
                local_size: 6,
                local_offset: 7,
            },
            Split {
                mesh_dim: 1,
                num_chunks: 4,
                index: 3,
                logical_size: 6,
                logical_offset: 7,
                local_size: 0,
                local_offset: 13,
            },
        ];
        assert_eq!(got.as_slice(), &want);
        assert_eq!((want[0].padded_chunk_size(), want[0].padding()), (7, 1));
        assert_eq!((want[1].padded_chunk_size(), want[1].padding()), (2, 2));
        assert!(split_chain(13, &[2, 4], &[], &[1, 3]).unwrap().is_empty());
    }

    macro_rules! before {
        ($($name:ident: $size:expr, $mesh:expr, $chain:expr, $m:expr, $coord:expr => $want:expr;)*) => {$(
            #[test]
            fn $name() {
                let got = logical_size_before($size, &$mesh, &$chain, $m, &$coord)
                    .map_err(|e| e.to_string());
                let want: Result<usize, &str> = $want;
                match (got, want) {
                    (Ok(got), Ok(want)) => assert_eq!(got, want),
                    (Err(got), Err(want)) => assert!(got.contains(want), "{got:?} lacks {want:?}"),
                    (got, want) => panic!("got {got:?}, want {want:?}"),
                }
            }
        )*};
    }

    before! {
        before_outer: 13, [2, 4], [0, 1], 0, [1, 3] => Ok(13);
        before_inner: 13, [2, 4], [0, 1], 1, [1, 3] => Ok(6);
        before_inner_other_piece: 13, [2, 4], [0, 1], 1, [0, 2] => Ok(7);
        before_reversed: 13, [2, 4], [1, 0], 0, [1, 3] => Ok(1);
        before_three: 8, [2, 2, 2], [2, 0, 1], 1, [1, 0, 0] => Ok(2);
        before_not_in_chain: 13, [2, 4], [1], 0, [1, 3] => Err("logical_size_before: mesh dim 0 is not in the split chain [1]");
        before_chain_repeats: 13, [2, 4], [1, 1], 1, [1, 3] => Err("split_chain: the split chain [1, 1] must name distinct mesh dims below 2");
        before_chain_past_mesh: 13, [2, 4], [0, 2], 0, [1, 3] => Err("the split chain [0, 2] must name distinct mesh dims below 2");
        before_bad_coord: 13, [2, 4], [0, 1], 0, [2, 3] => Err("split_chain: coordinate [2, 3] is outside the mesh [2, 4]");
    }

    macro_rules! logical {
        ($($name:ident: $global:expr, $mesh:expr, $p:expr, $order:expr, $coord:expr => $want:expr;)*) => {$(
            #[test]
            fn $name() {
                let p: &[Placement] = &$p;
                let order_for: fn(&[Placement]) -> ShardOrder = $order;
                let got = logical_shape_per_mesh_dim(&$global, &$mesh, p, &order_for(p), &$coord).unwrap();
                let want: Vec<Vec<usize>> = $want.iter().map(|s| s.to_vec()).collect();
                assert_eq!(got, want);
            }
        )*};
    }

    logical! {
        logical_default: [8, 6], [2, 2], [Shard(0), Shard(0)], default, [1, 0] => [[8, 6], [4, 6]];
        logical_reversed: [8, 6], [2, 2], [Shard(0), Shard(0)], reversed, [1, 0] => [[4, 6], [8, 6]];
        logical_mixed: [5, 7], [2, 2, 3], [Shard(0), SUM, Shard(1)], default, [1, 0, 2] => [[5, 1], [2, 1], [2, 7]];
        logical_uneven: [13], [2, 4], [Shard(0), Shard(0)], default, [1, 3] => [[13], [6]];
        logical_no_mesh: [3], [], [], default, [] => [[0usize; 1]; 0];
    }

    #[test]
    fn logical_shape_per_mesh_dim_validates() {
        let p = [Shard(0), Shard(0)];
        let err = logical_shape_per_mesh_dim(&[4], &[2, 2], &p, &default(&[Shard(0)]), &[0, 0])
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("logical_shape_per_mesh_dim: invalid placements: shard order {}"),
            "{err}"
        );
    }

    /// The oracle: the global indices that coordinate `coord` holds along a dim of `size`
    /// split by `chain`, by slicing an index list as `torch.chunk` does.
    fn nested_chunk(size: usize, mesh: &[usize], chain: &[usize], coord: &[usize]) -> Vec<usize> {
        let mut piece: Vec<usize> = (0..size).collect();
        for &m in chain {
            let chunk = piece.len().div_ceil(mesh[m]);
            let start = (chunk * coord[m]).min(piece.len());
            let end = (start + chunk).min(piece.len());
            piece = piece[start..end].to_vec();
        }
        piece
    }

    /// A random layout: mesh (1–3 dims, ≤ 8 ranks), shape (rank 1–4, dims ≤ 13),
    /// placements, and a shard order from random split keys per mesh dim.
    fn layout() -> impl Strategy<Value = (Vec<usize>, Vec<usize>, Vec<Placement>, ShardOrder)> {
        let mesh = prop::collection::vec(1usize..=4, 1..=3)
            .prop_filter("at most 8 ranks", |m| m.iter().product::<usize>() <= 8);
        let shape = prop::collection::vec(0usize..=13, 1..=4);
        (mesh, shape)
            .prop_flat_map(|(mesh, shape)| {
                let rank = shape.len();
                let placement = prop_oneof![
                    3 => (0..rank).prop_map(Shard),
                    1 => Just(Replicate),
                    1 => Just(SUM),
                ];
                let n = mesh.len();
                (
                    Just(mesh),
                    Just(shape),
                    prop::collection::vec(placement, n),
                    prop::collection::vec(any::<u8>(), n),
                )
            })
            .prop_map(|(mesh, shape, placements, keys)| {
                // INVARIANT: one key per mesh dim.
                let order = ShardOrder::from_keys(&placements, &keys).unwrap();
                (mesh, shape, placements, order)
            })
    }

    proptest! {
        #[test]
        fn pieces_tile_the_global_tensor((mesh, shape, placements, order) in layout()) {
            let volume: usize = shape.iter().product();
            let mut count = vec![0u8; volume];
            let mut seen: HashMap<Vec<usize>, (Vec<usize>, Vec<usize>)> = HashMap::new();
            for coord in mesh_coords(&mesh) {
                let (local, offset) =
                    local_shape_and_offset(&shape, &mesh, &placements, &order, &coord).unwrap();
                for d in 0..shape.len() {
                    let chain = order.order_of(&placements, d);
                    let want = nested_chunk(shape[d], &mesh, &chain, &coord);
                    prop_assert_eq!(local[d], want.len());
                    prop_assert_eq!(offset[d], want.first().copied().unwrap_or(shape[d]));
                    prop_assert!(local[d] <= shape[d] && offset[d] + local[d] <= shape[d]);
                }
                // Ranks that differ only on Replicate/Partial mesh dims hold the same piece.
                let key: Vec<usize> = (0..mesh.len())
                    .map(|m| if placements[m].is_shard() { coord[m] } else { 0 })
                    .collect();
                if let Some(prev) = seen.get(&key) {
                    prop_assert_eq!(prev, &(local.clone(), offset.clone()));
                    continue;
                }
                seen.insert(key, (local.clone(), offset.clone()));
                // Count every element of the piece.
                for idx in mesh_coords(&local) {
                    let flat = idx
                        .iter()
                        .zip(&offset)
                        .zip(&shape)
                        .fold(0, |acc, ((i, o), s)| acc * s + i + o);
                    count[flat] += 1;
                }
                // All ranks along a mesh dim agree on the logical size before its split.
                let logical =
                    logical_shape_per_mesh_dim(&shape, &mesh, &placements, &order, &coord).unwrap();
                for m in 0..mesh.len() {
                    let mut first = coord.clone();
                    first[m] = 0;
                    let other =
                        logical_shape_per_mesh_dim(&shape, &mesh, &placements, &order, &first)
                            .unwrap();
                    prop_assert_eq!(&logical[m], &other[m]);
                }
            }
            prop_assert!(count.iter().all(|&c| c == 1), "counts {:?}", count);
            for d in 0..shape.len() {
                prop_assert!(seen.len() <= mesh.iter().product::<usize>());
                prop_assert!(num_shards(&placements, &mesh, d) >= 1);
            }
        }
    }
}
