//! Test helpers (feature `testing`): proptest strategies for meshes, shapes,
//! placements and shard orders, oracles computed on the full tensor, and the byte
//! bounds of each collective.
//!
//! - Strategies: [`mesh_shape`], [`global_shape`], [`dtype`], [`placements`],
//!   [`order_from_keys`], and whole redistribution cases: [`transition`] (random
//!   source and target layouts that redistribute allows) and [`shard_swap`] (one mesh
//!   dim moves from `S(i)` to `S(j)`, nothing else changes).
//! - Oracles: [`test_values`] (the full tensor the tests distribute),
//!   [`expected_local`] (the slice of the full tensor a coordinate holds) and
//!   [`partial_local`] (per-rank partial values whose reduction is the full tensor).
//! - [`collective_bound`]: the most bytes a rank may send in one collective, from the
//!   local shapes before and after it.
//! - [`oracle`]: every layout of a small mesh and every one-collective step between
//!   them, for the cheapest plans by exhaustive search.
//!
//! Every strategy builds valid layouts by construction (no rejection), and shrinks
//! toward small meshes, small shapes, `f64`, and the default shard order.

pub mod oracle;

pub use crate::redistribute::with_tensor_path;

use std::fmt;

use proptest::prelude::*;
use tessera_mesh::{DType, OpKind, ReduceOp};

use tessera_tensor::Error as TensorError;

use crate::sharding::local_shape_and_offset;
use crate::spec::PlacementsDisplay;
use crate::{Error, Layout, Placement, Result, ShardOrder, Tensor};

/// The most ranks a generated mesh has.
pub const MAX_RANKS: usize = 8;

/// The largest size of a generated tensor dim.
pub const MAX_DIM: usize = 13;

/// Every mesh shape with 1 to 3 dims and at most `max_ranks` ranks, fewest ranks
/// first (then fewest dims), so that shrinking moves toward small meshes.
pub fn all_mesh_shapes(max_ranks: usize) -> Vec<Vec<usize>> {
    let mut out: Vec<Vec<usize>> = Vec::new();
    for a in 1..=max_ranks {
        out.push(vec![a]);
        for b in 1..=max_ranks / a {
            out.push(vec![a, b]);
            for c in 1..=max_ranks / (a * b) {
                out.push(vec![a, b, c]);
            }
        }
    }
    out.sort_by_key(|m| (m.iter().product::<usize>(), m.len(), m.clone()));
    out
}

/// A mesh shape: 1 to 3 dims, at most [`MAX_RANKS`] ranks, dims of every size from 1
/// to 8 (so sizes 1, 2, 3 and 4 all occur on multi-dim meshes).
pub fn mesh_shape() -> impl Strategy<Value = Vec<usize>> {
    prop::sample::select(all_mesh_shapes(MAX_RANKS))
}

/// A global shape of rank `ranks` (a range within 1..=4), each dim 0..=[`MAX_DIM`].
pub fn global_shape(ranks: std::ops::RangeInclusive<usize>) -> impl Strategy<Value = Vec<usize>> {
    prop::collection::vec(0..=MAX_DIM, ranks)
}

/// A dtype: mostly `f64`, some `i64` and `f32` (all exact on the small integers the
/// tests use).
pub fn dtype() -> impl Strategy<Value = DType> {
    prop_oneof![6 => Just(DType::F64), 2 => Just(DType::I64), 2 => Just(DType::F32)]
}

/// Reductions that may be pending together in one layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PartialFamily {
    /// No `Partial` at all.
    NoPartial,
    /// Sum and avg (linear, so they commute); sum only for `i64`.
    Linear,
    /// Max only.
    Max,
    /// Min only.
    Min,
}

impl PartialFamily {
    /// The reductions of the family that `dtype` supports.
    pub fn ops(self, dtype: DType) -> Vec<ReduceOp> {
        match self {
            PartialFamily::NoPartial => vec![],
            PartialFamily::Linear if dtype == DType::I64 => vec![ReduceOp::Sum],
            PartialFamily::Linear => vec![ReduceOp::Sum, ReduceOp::Avg],
            PartialFamily::Max => vec![ReduceOp::Max],
            PartialFamily::Min => vec![ReduceOp::Min],
        }
    }

    /// Any family with a `Partial`, sum first (the one shrinking goes to).
    pub fn any_partial() -> impl Strategy<Value = PartialFamily> {
        prop_oneof![
            2 => Just(PartialFamily::Linear),
            1 => Just(PartialFamily::Max),
            1 => Just(PartialFamily::Min),
        ]
    }
}

/// One placement per mesh dim for a tensor of rank `rank`: `Shard` of any dim
/// (weight 3; `Replicate` for a rank-0 tensor), `Replicate` (1), `Partial` of one of
/// `ops` (1, when `ops` is not empty).
pub fn placements(rank: usize, mesh_ndim: usize, ops: Vec<ReduceOp>) -> impl Strategy<Value = Vec<Placement>> {
    let shard = (0..rank.max(1)).prop_map(move |d| {
        if rank == 0 {
            Placement::Replicate
        } else {
            Placement::Shard(d)
        }
    });
    let one = if ops.is_empty() {
        prop_oneof![3 => shard, 1 => Just(Placement::Replicate)].boxed()
    } else {
        let partial = prop::sample::select(ops).prop_map(Placement::Partial);
        prop_oneof![3 => shard, 1 => Just(Placement::Replicate), 1 => partial].boxed()
    };
    prop::collection::vec(one, mesh_ndim)
}

/// The shard order of `placements` that splits each multiply-sharded tensor dim by
/// its mesh dims sorted by `keys[mesh dim]` (ties by mesh dim): all-equal keys give
/// the default order, and any permutation can occur.
///
/// # Errors
/// `keys` shorter than `placements`.
pub fn order_from_keys(placements: &[Placement], keys: &[u8]) -> Result<ShardOrder> {
    if keys.len() < placements.len() {
        return Err(Error::from(TensorError::InvalidArgument {
            op: "order_from_keys",
            detail: format!("{} keys for {} placements", keys.len(), placements.len()),
        }));
    }
    ShardOrder::from_keys(placements, keys)
}

/// How a test builds the source tensor of a redistribution.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Source {
    /// [`distribute_tensor_with_order`](crate::distribute_tensor_with_order) of the full tensor.
    Distribute,
    /// [`DTensor::from_local_with_layout`](crate::DTensor::from_local_with_layout) of
    /// [`partial_local`] (random partial values with a known reduction).
    FromLocal,
}

/// A redistribution case: source and target layouts (same mesh, shape and dtype), how
/// to build the source, and the seed of its random partial values.
#[derive(Clone, PartialEq, Eq)]
pub struct Transition {
    /// The layout redistributed from.
    pub src: Layout,
    /// The layout redistributed to.
    pub dst: Layout,
    /// How the source is built.
    pub source: Source,
    /// Seed of [`partial_local`].
    pub seed: u64,
}

impl Transition {
    /// Whether either layout has a pending `Partial(avg)` (whose results are compared
    /// with a tolerance: the mean is a division).
    pub fn has_avg(&self) -> bool {
        let avg = |l: &Layout| l.partial_ops().any(|(_, op)| op == ReduceOp::Avg);
        avg(&self.src) || avg(&self.dst)
    }
}

/// `[S(0),P(sum)] order {..} -> [R,S(1)] of [5, 3] f64 on mesh [2, 2] (from_local, seed 7)`.
impl fmt::Debug for Transition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", PlacementsDisplay(&self.src.placements))?;
        if !self.src.order.is_default() {
            write!(f, " order {}", self.src.order)?;
        }
        write!(f, " -> {}", self.dst)?;
        write!(f, " ({:?}, seed {})", self.source, self.seed)
    }
}

/// Makes `dst` a target that redistribute accepts from `src`: a mesh dim that goes
/// `Shard → Partial` becomes `Replicate`, and one that goes `Partial(a) → Partial(b)`
/// keeps `Partial(a)`. Both come from the same [`PartialFamily`], so the result mixes
/// only reductions that commute.
fn allowed_target(src: &[Placement], dst: &mut [Placement]) {
    for (a, b) in src.iter().zip(dst.iter_mut()) {
        match (*a, *b) {
            (Placement::Shard(_), Placement::Partial(_)) => *b = Placement::Replicate,
            (Placement::Partial(x), Placement::Partial(_)) => *b = Placement::Partial(x),
            _ => {}
        }
    }
}

/// A random redistribution case on a random mesh: shape of rank 1–4 (dims 0–13),
/// dtype, source and target placements with random shard orders. `src_partial` and
/// `dst_partial` say whether the layouts may hold `Partial` placements (of one
/// family: sum/avg, max or min).
pub fn transition(src_partial: bool, dst_partial: bool) -> impl Strategy<Value = Transition> {
    let family = if src_partial || dst_partial {
        PartialFamily::any_partial().boxed()
    } else {
        Just(PartialFamily::NoPartial).boxed()
    };
    (mesh_shape(), global_shape(1..=4), dtype(), family)
        .prop_flat_map(move |(mesh, shape, dtype, family)| {
            let ops = family.ops(dtype);
            let pick = |on: bool| if on { ops.clone() } else { vec![] };
            let n = mesh.len();
            (
                Just((mesh, shape.clone(), dtype)),
                placements(shape.len(), n, pick(src_partial)),
                placements(shape.len(), n, pick(dst_partial)),
                prop::collection::vec(any::<u8>(), n),
                prop::collection::vec(any::<u8>(), n),
                prop_oneof![Just(Source::Distribute), Just(Source::FromLocal)],
                any::<u64>(),
            )
        })
        .prop_map(
            |((mesh, shape, dtype), src, mut dst, src_keys, dst_keys, source, seed)| {
                allowed_target(&src, &mut dst);
                // INVARIANT: the placements fit the mesh and shape, their partial ops come
                // from one family that `dtype` supports, and the keys cover every mesh dim.
                let layout = |p: &[Placement], keys: &[u8]| {
                    let order = order_from_keys(p, keys).expect("keys cover the mesh");
                    Layout::with_order(&mesh, p, order, &shape, dtype).expect("generated layout is valid")
                };
                Transition {
                    src: layout(&src, &src_keys),
                    dst: layout(&dst, &dst_keys),
                    source,
                    seed,
                }
            },
        )
}

/// A case where exactly one mesh dim `m` goes `S(i) → S(j)` (`i ≠ j`) and nothing else
/// changes: `m` is the innermost split of tensor dim `i` in the source and becomes the
/// innermost split of `j` in the target; every other split keeps its place. Returns
/// the case with `(m, i, j)`. No `Partial`; shapes of rank 2–4.
pub fn shard_swap() -> impl Strategy<Value = (Transition, (usize, usize, usize))> {
    (mesh_shape(), global_shape(2..=4), dtype())
        .prop_flat_map(|(mesh, shape, dtype)| {
            let (n, rank) = (mesh.len(), shape.len());
            (
                Just((mesh, shape, dtype)),
                placements(rank, n, vec![]),
                prop::collection::vec(any::<u8>(), n),
                0..n,
                0..rank,
                1..rank,
            )
        })
        .prop_map(|((mesh, shape, dtype), mut p, keys, m, i, j_step)| {
            let rank = shape.len();
            let j = (i + j_step) % rank;
            p[m] = Placement::Shard(i);
            // INVARIANT: `keys` has one key per mesh dim.
            let base = order_from_keys(&p, &keys).expect("keys cover the mesh");
            let mut chains: Vec<Vec<usize>> = (0..rank).map(|d| base.order_of(&p, d).to_vec()).collect();
            // Make `m` the innermost split of `i` in the source.
            chains[i].retain(|&x| x != m);
            chains[i].push(m);
            let src_order = order_with_chains(&p, &chains);
            let mut q = p.clone();
            q[m] = Placement::Shard(j);
            chains[i].pop();
            chains[j].push(m);
            let dst_order = order_with_chains(&q, &chains);
            // INVARIANT: the placements fit and hold no Partial.
            let layout = |p: &[Placement], o| Layout::with_order(&mesh, p, o, &shape, dtype).expect("valid layout");
            let t = Transition {
                src: layout(&p, src_order),
                dst: layout(&q, dst_order),
                source: Source::Distribute,
                seed: 0,
            };
            (t, (m, i, j))
        })
}

/// The order of `placements` whose chain for each tensor dim `d` is `chains[d]`.
fn order_with_chains(placements: &[Placement], chains: &[Vec<usize>]) -> ShardOrder {
    let entries = chains
        .iter()
        .enumerate()
        .filter(|(_, c)| c.len() > 1)
        .map(|(d, c)| (d, c.clone()));
    // INVARIANT: callers pass each tensor dim's sharding mesh dims, permuted.
    ShardOrder::new(placements, entries).expect("chains permute the sharding mesh dims")
}

/// The full tensor the tests distribute: distinct integers `k − numel/2` in row-major
/// order, as `dtype` (exact in `f32` for every shape the strategies make).
///
/// # Errors
/// A shape too large for memory.
pub fn test_values(shape: &[usize], dtype: DType) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let half = (n / 2) as f64;
    let v: Vec<f64> = (0..n).map(|k| k as f64 - half).collect();
    Ok(Tensor::from_vec(v, shape)?.cast(dtype)?)
}

/// The piece of `full` that the rank at `coord` holds under `layout`, as
/// [`local_shape_and_offset`] names it (a contiguous copy; `Partial` is ignored).
///
/// # Errors
/// A layout that does not fit `full` or a coordinate outside the mesh.
pub fn expected_local(full: &Tensor, layout: &Layout, coord: &[usize]) -> Result<Tensor> {
    let (shape, offset) = local_shape_and_offset(
        full.shape(),
        &layout.mesh_shape,
        &layout.placements,
        &layout.order,
        coord,
    )?;
    let mut t = full.clone();
    for (d, (&len, &start)) in shape.iter().zip(&offset).enumerate() {
        t = t.narrow(d, start, len)?;
    }
    Ok(t.contiguous())
}

/// This rank's local tensor of a layout with `Partial` placements whose reduction is
/// `full`: the rank's slice of a contribution that depends only on its coordinates
/// along the `Partial` mesh dims (so ranks along `Replicate` dims agree).
///
/// - sum and avg (any mix): random small integers on every partial coordinate but
///   the last, which holds `full × (product of the avg dims' sizes) − Σ others`;
/// - max: `full` on one random partial coordinate per element, `full − k` (k in 0..=3)
///   elsewhere; min: `full + k`.
///
/// Without `Partial` this is [`expected_local`]. `seed` picks the random values; every
/// rank computes the same contributions.
///
/// # Errors
/// A reduction other than sum, avg, max and min, mixed families, or as [`expected_local`].
pub fn partial_local(full: &Tensor, layout: &Layout, coord: &[usize], seed: u64) -> Result<Tensor> {
    let partial: Vec<(usize, ReduceOp)> = layout.partial_ops().collect();
    if partial.is_empty() {
        return expected_local(full, layout, coord);
    }
    let sizes: Vec<usize> = partial.iter().map(|&(m, _)| layout.mesh_shape[m]).collect();
    let count: usize = sizes.iter().product();
    let me = partial
        .iter()
        .fold(0, |acc, &(m, _)| acc * layout.mesh_shape[m] + coord[m]);
    let ops: Vec<ReduceOp> = partial.iter().map(|&(_, op)| op).collect();
    let linear = ops.iter().all(|op| matches!(op, ReduceOp::Sum | ReduceOp::Avg));
    let family = if linear {
        PartialFamily::Linear
    } else if ops.iter().all(|&op| op == ReduceOp::Max) {
        PartialFamily::Max
    } else if ops.iter().all(|&op| op == ReduceOp::Min) {
        PartialFamily::Min
    } else {
        return Err(Error::from(TensorError::InvalidArgument {
            op: "partial_local",
            detail: format!("no oracle for the reductions {ops:?}"),
        }));
    };
    let avg_scale: f64 = partial
        .iter()
        .filter(|(_, op)| *op == ReduceOp::Avg)
        .map(|&(m, _)| layout.mesh_shape[m] as f64)
        .product();
    let noise = |k: usize, e: usize, span: u64| (mix(seed, k as u64, e as u64) % span) as f64;
    let values = full.to_f64_vec();
    let contribution: Vec<f64> = values
        .iter()
        .enumerate()
        .map(|(e, &v)| match family {
            PartialFamily::Linear => {
                let r = |k: usize| noise(k, e, 7) - 3.0;
                if me + 1 < count {
                    r(me)
                } else {
                    v * avg_scale - (0..count - 1).map(r).sum::<f64>()
                }
            }
            PartialFamily::Max | PartialFamily::Min => {
                let chosen = (mix(seed, u64::MAX, e as u64) % count as u64) as usize;
                let k = if me == chosen { 0.0 } else { noise(me, e, 4) };
                if family == PartialFamily::Max { v - k } else { v + k }
            }
            PartialFamily::NoPartial => v,
        })
        .collect();
    let whole = Tensor::from_vec(contribution, full.shape())?.cast(full.dtype())?;
    expected_local(&whole, layout, coord)
}

/// A 64-bit mix of three values (SplitMix64 finaliser), for reproducible noise.
fn mix(seed: u64, a: u64, b: u64) -> u64 {
    let mut z = seed ^ a.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ b.wrapping_mul(0xC2B2_AE3D_27D4_EB4F).rotate_left(29);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The most bytes the rank at `coord` may send in one collective of `kind` that turns
/// `before` into `after` over `n` ranks, from the local shapes
/// ([`local_shape_and_offset`]) and the per-rank counts of `tessera_mesh::stats`:
///
/// | collective | bound (`b` = bytes) |
/// |---|---|
/// | all_gather | `n−1` copies of the local input (its own piece) |
/// | reduce_scatter | the local input less the local output |
/// | all_reduce | `2 (b − ⌊b/n⌋)` of the local buffer (the smallest chunk's rank sends the most) |
/// | all_to_all | max(`(n−1)/n · b` of the local input, `c · b` less what this rank keeps), `c` the product of the sizes of the mesh dims that go from `Shard` to `Replicate` |
///
/// Other kinds (no collective, broadcast, barrier) get 0.
///
/// # Errors
/// Layouts that do not fit or a coordinate outside the mesh.
pub fn collective_bound(before: &Layout, after: &Layout, kind: OpKind, n: usize, coord: &[usize]) -> Result<u64> {
    let region = |l: &Layout| local_shape_and_offset(&l.shape, &l.mesh_shape, &l.placements, &l.order, coord);
    let (in_shape, in_off) = region(before)?;
    let (out_shape, out_off) = region(after)?;
    let esize = before.dtype.size_in_bytes();
    let bytes = |shape: &[usize]| shape.iter().product::<usize>() * esize;
    Ok(match kind {
        OpKind::AllGather => ((n.max(1) - 1) * bytes(&in_shape)) as u64,
        OpKind::ReduceScatter => bytes(&in_shape).saturating_sub(bytes(&out_shape)) as u64,
        OpKind::AllReduce if n > 1 => 2 * (bytes(&in_shape) - bytes(&in_shape) / n) as u64,
        OpKind::AllReduce => 0,
        OpKind::AllToAll => {
            let kept: usize = (0..in_shape.len())
                .map(|d| {
                    let lo = in_off[d].max(out_off[d]);
                    let hi = (in_off[d] + in_shape[d]).min(out_off[d] + out_shape[d]);
                    hi.saturating_sub(lo)
                })
                .product();
            // Mesh dims that go from a shard to Replicate: each of the local
            // input's elements goes to that many ranks.
            let copies: usize = (0..before.mesh_shape.len())
                .filter(|&m| before.placements[m].is_shard() && after.placements[m].is_replicate())
                .map(|m| before.mesh_shape[m])
                .product();
            let local = bytes(&in_shape);
            OpKind::AllToAll
                .bytes_sent(n, local)
                .max((local * copies - kept * esize) as u64)
        }
        _ => 0,
    })
}

/// Every coordinate of a mesh of `shape`, row-major (rank order).
pub fn all_coords(shape: &[usize]) -> Vec<Vec<usize>> {
    crate::sharding::mesh_coords(shape)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mesh_shapes_are_complete_and_small_first() {
        let all = all_mesh_shapes(8);
        assert_eq!(all[0], vec![1]);
        assert!(
            all.iter()
                .all(|m| (1..=3).contains(&m.len()) && m.iter().product::<usize>() <= 8)
        );
        for want in [
            vec![8],
            vec![2, 4],
            vec![3, 2],
            vec![2, 2, 2],
            vec![1, 3, 2],
            vec![4, 1, 2],
        ] {
            assert!(all.contains(&want), "{want:?}");
        }
        assert_eq!(all.len(), 8 + 20 + 38);
    }

    #[test]
    fn partial_oracle_reduces_to_full() {
        use crate::Placement::{Partial, Shard};
        let full = test_values(&[3, 4], DType::F64).unwrap();
        for ops in [[ReduceOp::Sum, ReduceOp::Avg], [ReduceOp::Max; 2], [ReduceOp::Min; 2]] {
            let p = [Partial(ops[0]), Shard(1), Partial(ops[1])];
            let layout = Layout::new(&[2, 1, 3], &p, &[3, 4], DType::F64).unwrap();
            let locals: Vec<Vec<f64>> = all_coords(&[2, 1, 3])
                .iter()
                .map(|c| partial_local(&full, &layout, c, 5).unwrap().to_f64_vec())
                .collect();
            let reduced: Vec<f64> = (0..12)
                .map(|e| {
                    let xs = locals.iter().map(|l| l[e]);
                    match ops[0] {
                        ReduceOp::Max => xs.fold(f64::MIN, f64::max),
                        ReduceOp::Min => xs.fold(f64::MAX, f64::min),
                        _ => xs.sum::<f64>() / 3.0,
                    }
                })
                .collect();
            assert_eq!(reduced, full.to_f64_vec(), "{ops:?}");
        }
    }
}
