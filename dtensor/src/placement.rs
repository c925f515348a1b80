//! Placements (how a tensor lies along each mesh dim) and shard order (in which order
//! several mesh dims split one tensor dim).
//!
//! PyTorch: `torch/distributed/tensor/placement_types.py` and the `shard_order` field of
//! `DTensorSpec` (`_dtensor_spec.py`), which Tessera makes explicit instead of encoding
//! it in a `_StridedShard` placement.

use std::fmt;

use smallvec::SmallVec;

use crate::{Error, ReduceOp, Result};

/// A list of mesh dims, stored inline for meshes of up to four dims.
pub type MeshDims = SmallVec<[usize; 4]>;

/// How a tensor is laid out along one mesh dim.
///
/// A distributed tensor has one placement per mesh dim. `Display` is compact:
/// `S(0)`, `R`, `P(sum)`.
///
/// PyTorch: `torch.distributed.tensor.placement_types.Placement`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Placement {
    /// Split along this tensor dim across the mesh dim: the rank at index `i` of `n`
    /// holds chunk `i` of `torch.chunk(t, n, dim)` (chunk size `ceil(size / n)`, so
    /// trailing chunks may be short or empty).
    ///
    /// PyTorch: `torch.distributed.tensor.Shard`.
    Shard(usize),
    /// Every rank along the mesh dim holds the same values.
    ///
    /// PyTorch: `torch.distributed.tensor.Replicate`.
    Replicate,
    /// Every rank holds a partial value; the global value is their reduction by `op`.
    ///
    /// PyTorch: `torch.distributed.tensor.Partial`.
    Partial(ReduceOp),
}

impl Placement {
    /// Whether this is `Shard` of any dim.
    ///
    /// PyTorch: `Placement.is_shard()`.
    pub fn is_shard(self) -> bool {
        matches!(self, Placement::Shard(_))
    }

    /// Whether this is `Shard(dim)`.
    ///
    /// PyTorch: `Placement.is_shard(dim)`.
    pub fn is_shard_on(self, dim: usize) -> bool {
        self == Placement::Shard(dim)
    }

    /// The tensor dim of a `Shard`, `None` otherwise.
    pub fn shard_dim(self) -> Option<usize> {
        match self {
            Placement::Shard(d) => Some(d),
            _ => None,
        }
    }

    /// Whether this is `Replicate`.
    ///
    /// PyTorch: `Placement.is_replicate()`.
    pub fn is_replicate(self) -> bool {
        self == Placement::Replicate
    }

    /// Whether this is `Partial` of any reduction.
    ///
    /// PyTorch: `Placement.is_partial()`.
    pub fn is_partial(self) -> bool {
        matches!(self, Placement::Partial(_))
    }

    /// The reduction of a `Partial`, `None` otherwise.
    pub fn reduce_op(self) -> Option<ReduceOp> {
        match self {
            Placement::Partial(op) => Some(op),
            _ => None,
        }
    }
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Placement::Shard(d) => write!(f, "Shard({d})"),
            Placement::Replicate => f.write_str("Replicate"),
            Placement::Partial(op) => write!(f, "Partial({op})"),
        }
    }
}

/// `(Shard(0), Replicate)`: placements as every message, log and description
/// prints them (see [`PlacementsDisplay`](crate::PlacementsDisplay)).
pub(crate) fn fmt_placements(placements: &[Placement]) -> String {
    crate::PlacementsDisplay(placements).to_string()
}

/// Checks that `placements` fit a tensor of rank `tensor_rank` on a mesh of `mesh_ndim`
/// dims: one placement per mesh dim, and every `Shard` dim below the tensor rank.
///
/// # Errors
///
/// [`Error::Placement`] naming the offending placement index, its dim and the rank.
pub fn validate_placements(placements: &[Placement], tensor_rank: usize, mesh_ndim: usize) -> Result<()> {
    const OP: &str = "validate_placements";
    if placements.len() != mesh_ndim {
        return Err(Error::Placement {
            op: OP,
            detail: format!(
                "{} has {} placements but the mesh has {mesh_ndim} dims; give one placement \
                 per mesh dim",
                fmt_placements(placements),
                placements.len()
            ),
        });
    }
    for (i, p) in placements.iter().enumerate() {
        if let Some(d) = p.shard_dim()
            && d >= tensor_rank
        {
            return Err(Error::Placement {
                op: OP,
                detail: format!(
                    "placement {i} of {} is Shard({d}) but the tensor has rank {tensor_rank}; \
                     shard dims must be below {tensor_rank}",
                    fmt_placements(placements)
                ),
            });
        }
    }
    Ok(())
}

/// The mesh dims that shard tensor dim `tensor_dim`, in mesh-dim order.
fn sharding_mesh_dims(placements: &[Placement], tensor_dim: usize) -> MeshDims {
    (0..placements.len())
        .filter(|&m| placements[m].is_shard_on(tensor_dim))
        .collect()
}

/// Every tensor dim sharded by two or more mesh dims, sorted, with its mesh dims in
/// mesh-dim order.
fn multi_sharded(placements: &[Placement]) -> SmallVec<[Entry; 2]> {
    let mut dims: SmallVec<[usize; 4]> = placements.iter().filter_map(|p| p.shard_dim()).collect();
    dims.sort_unstable();
    dims.dedup();
    dims.into_iter()
        .map(|d| Entry {
            tensor_dim: d,
            mesh_dims: sharding_mesh_dims(placements, d),
        })
        .filter(|e| e.mesh_dims.len() >= 2)
        .collect()
}

/// One multiply-sharded tensor dim and its mesh dims, outermost split first.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Entry {
    tensor_dim: usize,
    mesh_dims: MeshDims,
}

/// The order in which several mesh dims split one tensor dim.
///
/// When two or more mesh dims shard the same tensor dim, the first mesh dim of its
/// order splits the whole dim, the next one splits that piece again, and so on. With
/// the default order (mesh dims left to right), `[S(0), S(0)]` on a 2×2 mesh gives
/// rank `(i, j)` row block `2i + j` of 4; the reversed order (the FSDP-over-TP layout:
/// the right mesh dim splits first) gives it block `2j + i`.
///
/// # Representation
///
/// One entry for every tensor dim sharded by two or more mesh dims, sorted by tensor
/// dim, each listing exactly the mesh dims that shard it, once each, in split order.
/// Entries are always explicit, even for the default order, and the type is built only
/// by constructors that check this against the placements. So for given placements
/// there is exactly one value per order, and derived `Eq` and `Hash` agree with each
/// other and with the layout (PyTorch's `_StridedShard`, whose `__eq__` and `__hash__`
/// disagreed, is the lesson). A dim sharded by one mesh dim has only one order and gets
/// no entry; [`ShardOrder::order_of`] gives its chain from the placements.
///
/// An order describes the placements it was built for; [`ShardOrder::validate_for`]
/// checks that it fits others.
///
/// PyTorch: the `shard_order` of `DTensorSpec` (`ShardOrderEntry`), which generalises
/// `_StridedShard(dim, split_factor)`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ShardOrder {
    /// INVARIANT: sorted by `tensor_dim`, one per multiply-sharded dim, each a
    /// permutation of the mesh dims that shard it.
    entries: SmallVec<[Entry; 2]>,
}

impl ShardOrder {
    /// The default order for `placements`: every multiply-sharded dim is split by its
    /// mesh dims left to right.
    pub fn default_for(placements: &[Placement]) -> ShardOrder {
        ShardOrder {
            entries: multi_sharded(placements),
        }
    }

    /// The reversed order for `placements`: every multiply-sharded dim is split by its
    /// mesh dims right to left (the layout FSDP gets when it shards a dim that tensor
    /// parallelism already sharded).
    pub fn reversed_for(placements: &[Placement]) -> ShardOrder {
        let mut entries = multi_sharded(placements);
        for e in &mut entries {
            e.mesh_dims.reverse();
        }
        ShardOrder { entries }
    }

    /// An order for `placements` from `(tensor_dim, mesh dims in split order)` entries,
    /// in any order. A multiply-sharded dim without an entry gets the default order.
    ///
    /// ```
    /// use tessera_dtensor::{Placement::Shard, ShardOrder};
    ///
    /// let p = [Shard(0), Shard(0)];
    /// let order = ShardOrder::new(&p, [(0, [1, 0])]).unwrap();
    /// assert_eq!(order, ShardOrder::reversed_for(&p));
    /// assert_eq!(order.to_string(), "{0: [1, 0]}");
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::Placement`] when an entry names a tensor dim twice, names a dim sharded
    /// by fewer than two mesh dims, or does not list exactly the mesh dims that shard
    /// its tensor dim, each once.
    pub fn new<I, M>(placements: &[Placement], entries: I) -> Result<ShardOrder>
    where
        I: IntoIterator<Item = (usize, M)>,
        M: AsRef<[usize]>,
    {
        const OP: &str = "ShardOrder::new";
        let mut order = ShardOrder::default_for(placements);
        let mut given: SmallVec<[usize; 4]> = SmallVec::new();
        for (tensor_dim, mesh_dims) in entries {
            let mesh_dims = mesh_dims.as_ref();
            let err = |detail: String| Error::Placement { op: OP, detail };
            if given.contains(&tensor_dim) {
                return Err(err(format!(
                    "two order entries for tensor dim {tensor_dim}; give one per dim"
                )));
            }
            given.push(tensor_dim);
            let Some(entry) = order.entries.iter_mut().find(|e| e.tensor_dim == tensor_dim) else {
                let sharding = match sharding_mesh_dims(placements, tensor_dim).as_slice() {
                    [] => "does not shard".to_string(),
                    dims => format!("shards over mesh dims {dims:?} only"),
                };
                return Err(err(format!(
                    "an order entry for tensor dim {tensor_dim}, which {} {sharding}; an \
                     order is needed only where two or more mesh dims shard one tensor dim: \
                     drop this entry",
                    fmt_placements(placements),
                )));
            };
            let mut sorted: MeshDims = mesh_dims.iter().copied().collect();
            sorted.sort_unstable();
            if sorted != entry.mesh_dims {
                return Err(err(format!(
                    "the order {mesh_dims:?} for tensor dim {tensor_dim} must list each mesh \
                     dim that shards it in {} ({:?}) exactly once",
                    fmt_placements(placements),
                    entry.mesh_dims.as_slice()
                )));
            }
            entry.mesh_dims = mesh_dims.iter().copied().collect();
        }
        Ok(order)
    }

    /// The order for `placements` that keeps this order's entries for every tensor
    /// dim but `tensor_dim`, and splits `tensor_dim` by `chain` (outermost first):
    /// what a step that adds or removes one split of a dim gives.
    ///
    /// ```
    /// use tessera_dtensor::{Placement::*, ShardOrder};
    ///
    /// // FSDP adds Shard(0) on mesh dim 0 to a TP shard on mesh dim 1, splitting last.
    /// let tp = ShardOrder::default_for(&[Replicate, Shard(0)]);
    /// let p = [Shard(0), Shard(0)];
    /// assert_eq!(tp.with_chain(&p, 0, &[1, 0]).unwrap(), ShardOrder::reversed_for(&p));
    /// ```
    ///
    /// # Errors
    /// As [`ShardOrder::new`]: `chain` is not the mesh dims that shard `tensor_dim`
    /// in `placements`, or the kept entries do not describe `placements`.
    pub fn with_chain(&self, placements: &[Placement], tensor_dim: usize, chain: &[usize]) -> Result<ShardOrder> {
        let mut entries: SmallVec<[(usize, MeshDims); 2]> = self
            .entries()
            .filter(|(d, _)| *d != tensor_dim)
            .map(|(d, m)| (d, m.into()))
            .collect();
        if chain.len() >= 2 {
            entries.push((tensor_dim, chain.into()));
        }
        ShardOrder::new(placements, entries)
    }

    /// The mesh dims that shard `tensor_dim` in `placements`, in split order (outermost
    /// split first): the entry for a multiply-sharded dim, the one mesh dim of a singly
    /// sharded dim, empty for a dim that is not sharded.
    ///
    /// `self` must describe `placements` (see [`ShardOrder::validate_for`]).
    pub fn order_of(&self, placements: &[Placement], tensor_dim: usize) -> MeshDims {
        match self.entries.iter().find(|e| e.tensor_dim == tensor_dim) {
            Some(e) => e.mesh_dims.clone(),
            None => sharding_mesh_dims(placements, tensor_dim),
        }
    }

    /// The explicit entries: `(tensor_dim, mesh dims in split order)` for every tensor
    /// dim sharded by two or more mesh dims, sorted by tensor dim. They round-trip
    /// through [`ShardOrder::new`].
    pub fn entries(&self) -> impl Iterator<Item = (usize, &[usize])> + '_ {
        self.entries.iter().map(|e| (e.tensor_dim, e.mesh_dims.as_slice()))
    }

    /// The order of `placements` that splits each multiply-sharded tensor dim by
    /// its mesh dims sorted by `keys[mesh dim]` (ties by mesh dim): all-equal keys
    /// give the default order, and any permutation can occur. For generating
    /// orders in tests; `keys` holds one key per mesh dim (callers check).
    #[cfg(any(test, feature = "testing"))]
    pub(crate) fn from_keys(placements: &[Placement], keys: &[u8]) -> Result<ShardOrder> {
        let entries: Vec<(usize, Vec<usize>)> = ShardOrder::default_for(placements)
            .entries()
            .map(|(d, dims)| {
                let mut dims = dims.to_vec();
                dims.sort_by_key(|&m| (keys[m], m));
                (d, dims)
            })
            .collect();
        ShardOrder::new(placements, entries)
    }

    /// Whether every multiply-sharded dim is split left to right (the default order).
    pub fn is_default(&self) -> bool {
        self.entries.iter().all(|e| e.mesh_dims.windows(2).all(|w| w[0] < w[1]))
    }

    /// Checks that this order describes `placements`: one entry for exactly the dims
    /// that two or more mesh dims shard, each listing exactly those mesh dims.
    ///
    /// # Errors
    ///
    /// [`Error::Placement`] naming the order, the placements and the first mismatch.
    pub fn validate_for(&self, placements: &[Placement]) -> Result<()> {
        let expected = multi_sharded(placements);
        let mismatch = |detail: String| Error::Placement {
            op: "ShardOrder::validate_for",
            detail: format!(
                "shard order {self} does not describe {}: {detail}; build the order from \
                 these placements (ShardOrder::default_for or ShardOrder::new)",
                fmt_placements(placements)
            ),
        };
        for e in &self.entries {
            if !expected.iter().any(|x| x.tensor_dim == e.tensor_dim) {
                return Err(mismatch(format!(
                    "tensor dim {} is not sharded by two or more mesh dims",
                    e.tensor_dim
                )));
            }
        }
        for x in &expected {
            let Some(e) = self.entries.iter().find(|e| e.tensor_dim == x.tensor_dim) else {
                return Err(mismatch(format!(
                    "tensor dim {} is sharded by mesh dims {:?} but has no entry",
                    x.tensor_dim,
                    x.mesh_dims.as_slice()
                )));
            };
            let mut sorted = e.mesh_dims.clone();
            sorted.sort_unstable();
            if sorted != x.mesh_dims {
                return Err(mismatch(format!(
                    "tensor dim {} is sharded by mesh dims {:?}, the order lists {:?}",
                    x.tensor_dim,
                    x.mesh_dims.as_slice(),
                    e.mesh_dims.as_slice()
                )));
            }
        }
        Ok(())
    }
}

/// `{0: [1, 0], 2: [0, 2]}`: each multiply-sharded tensor dim and its mesh dims in
/// split order; `{}` when no tensor dim is sharded twice.
impl fmt::Display for ShardOrder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("{")?;
        for (i, e) in self.entries.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{}: {:?}", e.tensor_dim, e.mesh_dims.as_slice())?;
        }
        f.write_str("}")
    }
}

#[cfg(test)]
mod tests {
    use std::collections::hash_map::DefaultHasher;
    use std::hash::{Hash, Hasher};

    use super::Placement::{Partial, Replicate, Shard};
    use super::*;

    fn hash_of<T: Hash>(t: &T) -> u64 {
        let mut h = DefaultHasher::new();
        t.hash(&mut h);
        h.finish()
    }

    fn detail(e: Error) -> String {
        match e {
            Error::Placement { detail, .. } => detail,
            e => panic!("expected a placement error, got {e}"),
        }
    }

    macro_rules! display {
        ($($name:ident: $p:expr => $s:expr;)*) => {$(
            #[test]
            fn $name() {
                assert_eq!($p.to_string(), $s);
            }
        )*};
    }

    display! {
        display_shard0: Shard(0) => "Shard(0)";
        display_shard3: Shard(3) => "Shard(3)";
        display_replicate: Replicate => "Replicate";
        display_sum: Partial(ReduceOp::Sum) => "Partial(sum)";
        display_avg: Partial(ReduceOp::Avg) => "Partial(avg)";
        display_max: Partial(ReduceOp::Max) => "Partial(max)";
        display_min: Partial(ReduceOp::Min) => "Partial(min)";
        display_product: Partial(ReduceOp::Product) => "Partial(product)";
        display_list: fmt_placements(&[Shard(0), Replicate, Partial(ReduceOp::Sum)]) => "(Shard(0), Replicate, Partial(sum))";
        display_order_empty: ShardOrder::default_for(&[Shard(0), Shard(1)]) => "{}";
        display_order_default: ShardOrder::default_for(&[Shard(0), Shard(0)]) => "{0: [0, 1]}";
        display_order_reversed: ShardOrder::reversed_for(&[Shard(0), Shard(0)]) => "{0: [1, 0]}";
        display_order_two: ShardOrder::reversed_for(&[Shard(2), Shard(0), Shard(2), Shard(0)]) => "{0: [3, 1], 2: [2, 0]}";
        display_order_three: ShardOrder::new(&[Shard(1), Shard(1), Shard(1)], [(1, [1, 2, 0])]).unwrap() => "{1: [1, 2, 0]}";
    }

    macro_rules! helpers {
        ($($name:ident: $p:expr => $shard:expr, $dim:expr, $rep:expr, $partial:expr, $op:expr;)*) => {$(
            #[test]
            fn $name() {
                let p: Placement = $p;
                assert_eq!(p.is_shard(), $shard);
                assert_eq!(p.shard_dim(), $dim);
                assert_eq!(p.is_replicate(), $rep);
                assert_eq!(p.is_partial(), $partial);
                assert_eq!(p.reduce_op(), $op);
                assert_eq!(p.is_shard_on(1), $dim == Some(1));
            }
        )*};
    }

    helpers! {
        helpers_shard0: Shard(0) => true, Some(0), false, false, None;
        helpers_shard1: Shard(1) => true, Some(1), false, false, None;
        helpers_replicate: Replicate => false, None, true, false, None;
        helpers_partial: Partial(ReduceOp::Max) => false, None, false, true, Some(ReduceOp::Max);
    }

    #[test]
    fn placement_eq_hash() {
        assert_eq!(Shard(1), Shard(1));
        assert_ne!(Shard(1), Shard(0));
        assert_ne!(Partial(ReduceOp::Sum), Partial(ReduceOp::Avg));
        assert_eq!(hash_of(&Partial(ReduceOp::Sum)), hash_of(&Partial(ReduceOp::Sum)));
    }

    macro_rules! valid {
        ($($name:ident: $p:expr, $rank:expr, $ndim:expr => $want:expr;)*) => {$(
            #[test]
            fn $name() {
                let got = validate_placements(&$p, $rank, $ndim).map_err(detail);
                let want: Result<(), &str> = $want;
                match (got, want) {
                    (Ok(()), Ok(())) => {}
                    (Err(got), Err(want)) => assert!(got.contains(want), "{got:?} lacks {want:?}"),
                    (got, want) => panic!("got {got:?}, want {want:?}"),
                }
            }
        )*};
    }

    valid! {
        valid_empty_mesh: [], 2, 0 => Ok(());
        valid_mixed: [Shard(0), Replicate, Shard(1)], 2, 3 => Ok(());
        valid_scalar_replicate: [Replicate, Partial(ReduceOp::Sum)], 0, 2 => Ok(());
        valid_too_few: [Shard(0)], 2, 2 => Err("(Shard(0)) has 1 placements but the mesh has 2 dims");
        valid_too_many: [Shard(0), Replicate, Replicate], 2, 2 => Err("has 3 placements but the mesh has 2 dims");
        valid_dim_past_rank: [Replicate, Shard(2)], 2, 2 => Err("placement 1 of (Replicate, Shard(2)) is Shard(2) but the tensor has rank 2");
        valid_shard_scalar: [Shard(0)], 0, 1 => Err("placement 0 of (Shard(0)) is Shard(0) but the tensor has rank 0");
    }

    #[test]
    fn order_eq_hash_canonical() {
        let p = [Shard(0), Shard(0)];
        let default = ShardOrder::default_for(&p);
        let explicit = ShardOrder::new(&p, [(0, [0, 1])]).unwrap();
        let implicit = ShardOrder::new(&p, Vec::<(usize, Vec<usize>)>::new()).unwrap();
        let reversed = ShardOrder::reversed_for(&p);
        assert_eq!(default, explicit);
        assert_eq!(default, implicit);
        assert_eq!(hash_of(&default), hash_of(&explicit));
        assert_eq!(hash_of(&default), hash_of(&implicit));
        assert_ne!(default, reversed);
        assert_ne!(hash_of(&default), hash_of(&reversed));
        assert_eq!(reversed, ShardOrder::new(&p, [(0, [1, 0])]).unwrap());
        assert_eq!(
            hash_of(&reversed),
            hash_of(&ShardOrder::new(&p, [(0, [1, 0])]).unwrap())
        );
        assert!(default.is_default() && !reversed.is_default());
    }

    #[test]
    fn order_entries_in_any_order_are_sorted() {
        let p = [Shard(2), Shard(0), Shard(2), Shard(0)];
        let a = ShardOrder::new(&p, [(2, [2, 0]), (0, [3, 1])]).unwrap();
        let b = ShardOrder::new(&p, [(0, [3, 1]), (2, [2, 0])]).unwrap();
        assert_eq!(a, b);
        assert_eq!(hash_of(&a), hash_of(&b));
        assert_eq!(a, ShardOrder::reversed_for(&p));
        // Only dim 2 given: dim 0 keeps the default order.
        let c = ShardOrder::new(&p, [(2, [2, 0])]).unwrap();
        assert_eq!(c.to_string(), "{0: [1, 3], 2: [2, 0]}");
        assert!(!c.is_default());
        // Entries round-trip through `new`.
        let entries: Vec<(usize, Vec<usize>)> = c.entries().map(|(d, m)| (d, m.to_vec())).collect();
        assert_eq!(entries, vec![(0, vec![1, 3]), (2, vec![2, 0])]);
        assert_eq!(ShardOrder::new(&p, entries).unwrap(), c);
    }

    #[test]
    fn order_without_multi_sharded_dims() {
        let p = [Shard(0), Replicate, Shard(1), Partial(ReduceOp::Sum)];
        let o = ShardOrder::default_for(&p);
        assert_eq!(o, ShardOrder::reversed_for(&p));
        assert!(o.is_default());
        assert_eq!(o.entries().count(), 0);
        assert_eq!(o, ShardOrder::default_for(&[]));
    }

    macro_rules! order_of {
        ($($name:ident: $p:expr, $order:expr, $dim:expr => $want:expr;)*) => {$(
            #[test]
            fn $name() {
                let p: &[Placement] = &$p;
                let order: ShardOrder = $order(p);
                let want: &[usize] = &$want;
                assert_eq!(order.order_of(p, $dim).as_slice(), want);
                order.validate_for(p).unwrap();
            }
        )*};
    }

    order_of! {
        order_of_unsharded: [Replicate, Shard(1)], ShardOrder::default_for, 0 => [];
        order_of_single: [Replicate, Shard(1)], ShardOrder::default_for, 1 => [1];
        order_of_single_reversed: [Replicate, Shard(1)], ShardOrder::reversed_for, 1 => [1];
        order_of_default: [Shard(0), Shard(0)], ShardOrder::default_for, 0 => [0, 1];
        order_of_reversed: [Shard(0), Shard(0)], ShardOrder::reversed_for, 0 => [1, 0];
        order_of_three_default: [Shard(1), Replicate, Shard(1), Shard(1)], ShardOrder::default_for, 1 => [0, 2, 3];
        order_of_three_reversed: [Shard(1), Replicate, Shard(1), Shard(1)], ShardOrder::reversed_for, 1 => [3, 2, 0];
        order_of_three_given: [Shard(1), Replicate, Shard(1), Shard(1)], |p| ShardOrder::new(p, [(1, [2, 0, 3])]).unwrap(), 1 => [2, 0, 3];
        order_of_past_rank: [Shard(0), Shard(0)], ShardOrder::default_for, 5 => [];
    }

    macro_rules! new_err {
        ($($name:ident: $p:expr, $entries:expr => $want:expr;)*) => {$(
            #[test]
            fn $name() {
                let got = detail(ShardOrder::new(&$p, $entries).unwrap_err());
                assert!(got.contains($want), "{got:?} lacks {:?}", $want);
            }
        )*};
    }

    new_err! {
        new_err_unsharded: [Shard(0), Shard(0)], [(1, [0, 1])] => "an order entry for tensor dim 1, which (Shard(0), Shard(0)) does not shard; an order is needed only where two or more mesh dims shard one tensor dim: drop this entry";
        new_err_single: [Shard(0), Shard(1)], [(1, [1])] => "tensor dim 1, which (Shard(0), Shard(1)) shards over mesh dims [1] only";
        new_err_duplicate_entry: [Shard(0), Shard(0)], [(0, [1, 0]), (0, [0, 1])] => "two order entries for tensor dim 0";
        new_err_missing_mesh_dim: [Shard(0), Shard(0), Shard(0)], [(0, [2, 0])] => "the order [2, 0] for tensor dim 0 must list each mesh dim that shards it in (Shard(0), Shard(0), Shard(0)) ([0, 1, 2]) exactly once";
        new_err_repeated_mesh_dim: [Shard(0), Shard(0)], [(0, [0, 0])] => "the order [0, 0] for tensor dim 0";
        new_err_foreign_mesh_dim: [Shard(0), Shard(0), Replicate], [(0, [2, 0])] => "the order [2, 0] for tensor dim 0";
        new_err_extra_mesh_dim: [Shard(0), Shard(0)], [(0, [1, 0, 2])] => "the order [1, 0, 2] for tensor dim 0";
    }

    macro_rules! validate_for_err {
        ($($name:ident: $built:expr, $used:expr => $want:expr;)*) => {$(
            #[test]
            fn $name() {
                let order = ShardOrder::reversed_for(&$built);
                let got = detail(order.validate_for(&$used).unwrap_err());
                assert!(got.contains($want), "{got:?} lacks {:?}", $want);
            }
        )*};
    }

    validate_for_err! {
        validate_for_extra_entry: [Shard(0), Shard(0)], [Shard(0), Replicate] => "shard order {0: [1, 0]} does not describe (Shard(0), Replicate): tensor dim 0 is not sharded by two or more mesh dims";
        validate_for_missing_entry: [Shard(0), Shard(1)], [Shard(1), Shard(1)] => "tensor dim 1 is sharded by mesh dims [0, 1] but has no entry";
        validate_for_other_mesh_dims: [Shard(0), Shard(0), Replicate], [Shard(0), Replicate, Shard(0)] => "tensor dim 0 is sharded by mesh dims [0, 2], the order lists [1, 0]";
    }
}
