//! Sharding strategies: for an op and its inputs' layouts, the candidate
//! (input placements → output placements) pairs, and the choice among them.
//!
//! Rules are data. Contractions and batched products come from an einsum-style
//! spec ([`einsum`]): on each mesh dim a letter that survives to the output may be
//! sharded wherever it appears, a contracted letter sharded everywhere gives
//! `Partial(sum)`, and a partial operand times replicated ones stays partial.
//! Element-wise ops come from [`pointwise`], with the linearity rules for
//! `Partial`. Candidates on an N-D mesh are the product of per-mesh-dim options.
//!
//! [`choose`] picks the candidate whose input redistributions send the fewest
//! bytes. The cost is counted at mesh coordinate zero so that every rank, uneven
//! shards or not, makes the same choice.

mod rules;

use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use smallvec::SmallVec;

use crate::memo::Memo;
use crate::redistribute::{Plan, plan};
use crate::spec::{Layout, Placements, PlacementsDisplay};
use crate::{Placement, Result, ShardOrder};

pub use rules::Linearity;
pub(crate) use rules::{einsum, keep_shards_except, keep_shards_except_with, pointwise, reduction};

/// One way to run an op: the placements each input must have and the placements of the output.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Candidate {
    /// Placements per input, in input order.
    pub inputs: SmallVec<[Placements; 3]>,
    /// Placements of the output.
    pub output: Placements,
}

impl std::fmt::Display for Candidate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, p) in self.inputs.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{}", PlacementsDisplay(p))?;
        }
        write!(f, " -> {}", PlacementsDisplay(&self.output))
    }
}

/// One option on one mesh dim: the input placements and the output placement.
pub(crate) type DimOption = (SmallVec<[Placement; 3]>, Placement);

/// Candidates of one rule on one mesh rank: made once per process and shared, and
/// known to [`choose`]'s cache by identity. A step makes hundreds of dispatches,
/// and on a 3-D mesh a contraction or an element-wise op has hundreds of
/// candidates: building, hashing and comparing them on every dispatch cost most of
/// an oversubscribed HSDP+TP step, where identity costs one integer.
#[derive(Clone, Debug)]
pub(crate) struct Candidates(Arc<Interned>);

#[derive(Debug)]
struct Interned {
    /// Unique for the process: never reused, so a kept choice never matches
    /// another list.
    id: u64,
    list: Vec<Candidate>,
}

impl std::ops::Deref for Candidates {
    type Target = [Candidate];

    fn deref(&self) -> &[Candidate] {
        &self.0.list
    }
}

impl Candidates {
    fn new(list: Vec<Candidate>) -> Candidates {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        Candidates(Arc::new(Interned {
            id: NEXT.fetch_add(1, Ordering::Relaxed),
            list,
        }))
    }

    /// The process's list equal to `list` (hashes every candidate: for short
    /// lists; rules build theirs with [`product`]).
    pub(crate) fn of(list: Vec<Candidate>) -> Candidates {
        let key = hash_of(&list);
        let mut lists = LISTS.with_room();
        let bucket = lists.entry(key).or_default();
        if let Some(c) = bucket.iter().find(|c| c.0.list == list) {
            return c.clone();
        }
        let c = Candidates::new(list);
        bucket.push(c.clone());
        c
    }

    /// The candidates `keep` accepts, as the process's one list for this
    /// subset (so that the cache knows it again next step).
    pub(crate) fn retain(&self, keep: impl FnMut(&Candidate) -> bool) -> Candidates {
        let mask: Vec<bool> = self.iter().map(keep).collect();
        if mask.iter().all(|&k| k) {
            return self.clone();
        }
        let key = (self.0.id, mask);
        if let Some(c) = SUBSETS.get(&key) {
            return c;
        }
        let list = self
            .iter()
            .zip(&key.1)
            .filter(|(_, k)| **k)
            .map(|(c, _)| c.clone())
            .collect();
        let c = Candidates::new(list);
        SUBSETS.with_room().insert(key, c.clone());
        c
    }

    /// Each candidate with `f` applied, as the process's one list for this
    /// source and `f`'s `key` (which must name everything `f` depends on).
    pub(crate) fn map_keyed<K: Hash>(&self, key: &K, f: impl FnMut(Candidate) -> Candidate) -> Candidates {
        let key = (self.0.id, hash_of(key));
        if let Some(c) = MAPPED.get(&key) {
            return c;
        }
        let c = Candidates::new(self.iter().cloned().map(f).collect());
        MAPPED.with_room().insert(key, c.clone());
        c
    }
}

fn hash_of(x: &impl Hash) -> u64 {
    let mut h = DefaultHasher::new();
    x.hash(&mut h);
    h.finish()
}

/// One list made by [`product`]: its per-mesh-dim options, its input count, the list.
type Product = (Vec<Vec<DimOption>>, usize, Candidates);

/// Lists made by [`product`], by a hash of its arguments (buckets checked for equality).
static PRODUCTS: Memo<u64, Vec<Product>> = Memo::new(1024);
/// Lists made by [`Candidates::of`], by a hash of their content.
static LISTS: Memo<u64, Vec<Candidates>> = Memo::new(1024);
/// Subsets made by [`Candidates::retain`], by source and the candidates kept.
static SUBSETS: Memo<(u64, Vec<bool>), Candidates> = Memo::new(1024);
/// Lists made by [`Candidates::map_keyed`], by source and key.
static MAPPED: Memo<(u64, u64), Candidates> = Memo::new(1024);

/// Per-mesh-dim options combined over every mesh dim: the cartesian product of
/// `per_dim[m]` (the options on mesh dim m), made once per process for the same
/// options (see [`Candidates`]).
pub(crate) fn product(per_dim: &[Vec<DimOption>], n_inputs: usize) -> Candidates {
    let key = hash_of(&(per_dim, n_inputs));
    let hit = |(o, n, _): &&Product| o[..] == *per_dim && *n == n_inputs;
    if let Some((.., c)) = PRODUCTS.lock().get(&key).and_then(|b| b.iter().find(hit)) {
        return c.clone();
    }
    let c = Candidates::new(expand(per_dim, n_inputs));
    PRODUCTS
        .with_room()
        .entry(key)
        .or_default()
        .push((per_dim.to_vec(), n_inputs, c.clone()));
    c
}

/// [`product`]'s list.
fn expand(per_dim: &[Vec<DimOption>], n_inputs: usize) -> Vec<Candidate> {
    let mut out = vec![Candidate {
        inputs: (0..n_inputs).map(|_| Placements::new()).collect(),
        output: Placements::new(),
    }];
    for options in per_dim {
        let mut next = Vec::with_capacity(out.len() * options.len());
        for c in &out {
            for (ins, o) in options {
                let mut c = c.clone();
                for (i, p) in ins.iter().enumerate() {
                    c.inputs[i].push(*p);
                }
                c.output.push(*o);
                next.push(c);
            }
        }
        out = next;
    }
    out
}

/// The chosen candidate and the plans that bring each input to it.
#[derive(Clone, Debug)]
pub(crate) struct Choice {
    /// The candidate.
    pub candidate: Candidate,
    /// One plan per input (empty when the input already fits).
    pub plans: Vec<Plan>,
    /// Bytes the plans send from the rank at coordinate zero (the cost compared).
    pub cost: u64,
}

/// Picks the candidate whose input redistributions cost the fewest bytes (ties:
/// fewer steps, then the earliest). Candidates whose placements do not fit an input
/// (a shard dim past its rank, a reduction its dtype lacks, a shard or another
/// pending reduction made partial) are skipped. A replicated input may be made
/// `Partial` (a local partition, no bytes): `x P + bias R` runs as `P + P → P`, so
/// the reduction waits for the output's next layout (a reduce_scatter into a
/// sequence shard moves half an all_reduce's bytes) instead of running at once.
/// `op` names the op in errors.
///
/// The choice is a pure function of the layouts and candidates, so the process
/// keeps it: the same dispatch again (every training step) costs a hash of the
/// input layouts and the candidates' identity, not a plan per candidate.
///
/// # Errors
/// No candidate fits the inputs.
pub(crate) fn choose(op: &'static str, inputs: &[&Layout], candidates: &Candidates) -> Result<Arc<Choice>> {
    let id = candidates.0.id;
    let key = hash_of(&(inputs, id));
    let hit = |c: &Made| c.candidates == id && c.inputs.iter().eq(inputs.iter().copied());
    if let Some(made) = CHOICES
        .lock()
        .get(&key)
        .and_then(|bucket| bucket.iter().find(|c| hit(c)))
    {
        return Ok(made.choice.clone());
    }
    let choice = Arc::new(choose_uncached(op, inputs, candidates)?);
    CHOICES.with_room().entry(key).or_default().push(Made {
        inputs: inputs.iter().map(|&l| l.clone()).collect(),
        candidates: id,
        choice: choice.clone(),
    });
    Ok(choice)
}

/// One choice made, with what it was made from (the candidates by their id).
struct Made {
    inputs: SmallVec<[Layout; 3]>,
    candidates: u64,
    choice: Arc<Choice>,
}

/// Choices made, by a hash of (input layouts, candidates' id), each bucket checked
/// for equality on lookup (so a hit clones nothing; at most 4096 hashes). A choice is
/// a pure function of its inputs' layouts and the candidates, and a training step
/// makes the same few hundred again every step: planning each candidate's
/// redistributions again cost most of a small model's step.
static CHOICES: Memo<u64, Vec<Made>> = Memo::new(4096);

/// [`choose`] without the cache.
fn choose_uncached(op: &'static str, inputs: &[&Layout], candidates: &[Candidate]) -> Result<Choice> {
    let zero: SmallVec<[usize; 4]> = inputs
        .first()
        .map_or_else(SmallVec::new, |l| SmallVec::from_elem(0, l.mesh_shape.len()));
    let mut best: Option<Choice> = None;
    let mut best_steps = usize::MAX;
    'next: for c in candidates {
        let mut plans = Vec::with_capacity(inputs.len());
        let (mut cost, mut steps) = (0, 0);
        for (l, target) in inputs.iter().zip(&c.inputs) {
            let Ok(dst) = Layout::with_order(
                &l.mesh_shape,
                target,
                ShardOrder::default_for(target),
                &l.shape,
                l.dtype,
            ) else {
                continue 'next;
            };
            let Ok(p) = plan(l, &dst, &zero) else {
                continue 'next;
            };
            cost += p.bytes();
            steps += p.steps.len();
            plans.push(p);
        }
        // Equal bytes: fewer steps (a collective over a one-rank mesh dim moves
        // nothing but is still a synchronization point).
        if best.as_ref().is_none_or(|b| (cost, steps) < (b.cost, best_steps)) {
            best_steps = steps;
            best = Some(Choice {
                candidate: c.clone(),
                plans,
                cost,
            });
        }
    }
    best.ok_or_else(|| crate::Error::Placement {
        op,
        detail: format!(
            "no sharding strategy fits inputs {}",
            inputs.iter().map(|l| l.to_string()).collect::<Vec<_>>().join(", ")
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DType;
    use crate::Placement::{Partial, Replicate as R, Shard as S};
    use crate::ReduceOp::Sum;

    fn layout(p: &[Placement], shape: &[usize]) -> Layout {
        Layout::new(&[4], p, shape, DType::F32).unwrap()
    }

    #[test]
    fn a_choice_is_made_once_per_layouts_and_candidates() {
        let cands = einsum("mk,kn->mn", 1).unwrap();
        // A shape no other test uses, so the first call here makes the choice.
        let (a, b) = (layout(&[S(1)], &[24, 20]), layout(&[S(0)], &[20, 12]));
        let first = choose("matmul", &[&a, &b], &cands).unwrap();
        let again = choose("matmul", &[&a.clone(), &b.clone()], &cands).unwrap();
        assert!(
            Arc::ptr_eq(&first, &again),
            "the same layouts and candidates chose again"
        );
        // Other layouts, or other candidates, are other choices.
        let rows = layout(&[S(0)], &[24, 20]);
        let other = choose("matmul", &[&rows, &b], &cands).unwrap();
        assert!(!Arc::ptr_eq(&first, &other));
        assert_eq!(other.plans[0].src, rows);
        let replicated = cands
            .iter()
            .find(|c| c.inputs.iter().flatten().all(|&p| p == R))
            .unwrap();
        let narrowed = choose("matmul", &[&a, &b], &Candidates::of(vec![replicated.clone()])).unwrap();
        assert!(!Arc::ptr_eq(&first, &narrowed));
        assert_eq!(&narrowed.candidate, replicated);
        assert_ne!(&first.candidate, replicated);
    }

    #[test]
    fn candidate_lists_are_made_once_per_rule_and_known_by_identity() {
        // A 3-D mesh's contraction: options^3 candidates, built on the first call only.
        let first = einsum("qk,kv->qv", 3).unwrap();
        let again = einsum("qk,kv->qv", 3).unwrap();
        assert!(Arc::ptr_eq(&first.0, &again.0), "the same rule built its list again");
        // Per mesh dim: replicated, q, k or v split, one operand Partial(sum|avg).
        assert_eq!(first.len(), 8 * 8 * 8);
        let other = einsum("qk,kv->qv", 2).unwrap();
        assert!(!Arc::ptr_eq(&first.0, &other.0) && other.0.id != first.0.id);
        // Subsets and mapped lists are kept by what made them.
        let keep = |c: &Candidate| c.output[0] != R;
        let (s1, s2) = (first.retain(keep), first.retain(keep));
        assert!(Arc::ptr_eq(&s1.0, &s2.0));
        assert!(s1.len() < first.len() && s1.iter().all(keep));
        assert!(
            Arc::ptr_eq(&first.retain(|_| true).0, &first.0),
            "keeping all is the list itself"
        );
        let swap = |mut c: Candidate| {
            c.output.reverse();
            c
        };
        let (m1, m2) = (first.map_keyed(&1, swap), first.map_keyed(&1, swap));
        assert!(Arc::ptr_eq(&m1.0, &m2.0));
        assert!(
            !Arc::ptr_eq(&m1.0, &first.map_keyed(&2, swap).0),
            "another key is another list"
        );
        assert_eq!(
            m1[1].output.iter().rev().collect::<Vec<_>>(),
            first[1].output.iter().collect::<Vec<_>>()
        );
        // Lists given whole are interned by content.
        let one = |p| {
            Candidates::of(vec![Candidate {
                inputs: smallvec::smallvec![smallvec::smallvec![p]],
                output: smallvec::smallvec![p],
            }])
        };
        assert!(Arc::ptr_eq(&one(R).0, &one(R).0));
        assert_ne!(one(R).0.id, one(S(0)).0.id);
    }

    #[test]
    fn choose_least_bytes() {
        let cands = einsum("mk,kn->mn", 1).unwrap();
        macro_rules! case {
            ($a:expr, $b:expr => $ins:expr, $out:expr, $cost:expr) => {
                let (a, b) = (layout(&$a, &[8, 16]), layout(&$b, &[16, 4]));
                let c = choose("matmul", &[&a, &b], &cands).unwrap();
                assert_eq!(
                    (
                        c.candidate.inputs.iter().map(|p| p.to_vec()).collect::<Vec<_>>(),
                        c.candidate.output.to_vec(),
                        c.cost
                    ),
                    (
                        $ins.iter()
                            .map(|p: &[Placement; 1]| p.to_vec())
                            .collect::<Vec<_>>(),
                        $out.to_vec(),
                        $cost
                    ),
                    "{:?} x {:?}",
                    $a,
                    $b
                );
            };
        }
        // Already fitting: no communication.
        case!([S(0)], [R] => [[S(0)], [R]], [S(0)], 0);
        case!([S(1)], [S(0)] => [[S(1)], [S(0)]], [Partial(Sum)], 0);
        case!([R], [R] => [[R], [R]], [R], 0);
        case!([Partial(Sum)], [R] => [[Partial(Sum)], [R]], [Partial(Sum)], 0);
        // x arrives column-sharded: slicing the replicated weight's rows is free,
        // so the contraction runs locally into a partial sum.
        case!([S(1)], [R] => [[S(1)], [S(0)]], [Partial(Sum)], 0);
    }

    #[test]
    fn makes_a_replicated_operand_partial_only_to_defer_a_reduction() {
        // Nothing pending: a partition would be a step for nothing.
        let cands = einsum("mk,kn->mn", 1).unwrap();
        let (a, b) = (layout(&[R], &[8, 16]), layout(&[R], &[16, 4]));
        let c = choose("matmul", &[&a, &b], &cands).unwrap();
        assert!(c.candidate.inputs.iter().all(|p| !p[0].is_partial()));
        // A pending sum plus a replicated bias: the bias is partitioned (no bytes)
        // and the sum stays pending, rather than all-reducing x now.
        let add = pointwise(&[&[8, 4], &[4]], &[8, 4], 1, Linearity::Additive);
        let (x, bias) = (layout(&[Partial(Sum)], &[8, 4]), layout(&[R], &[4]));
        let c = choose("add", &[&x, &bias], &add).unwrap();
        assert_eq!(c.candidate.output.to_vec(), vec![Partial(Sum)]);
        assert_eq!(c.candidate.inputs[1].to_vec(), vec![Partial(Sum)]);
        assert_eq!(c.cost, 0);
        // A shard is never made partial.
        let (x, bias) = (layout(&[S(0)], &[8, 4]), layout(&[S(0)], &[8, 4]));
        let add = pointwise(&[&[8, 4], &[8, 4]], &[8, 4], 1, Linearity::Additive);
        let c = choose("add", &[&x, &bias], &add).unwrap();
        assert_eq!(c.candidate.output.to_vec(), vec![S(0)]);
    }

    #[test]
    fn no_fitting_candidate_is_an_error() {
        let a = layout(&[R], &[8, 16]);
        let e = choose("op", &[&a], &Candidates::of(Vec::new()))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("no sharding strategy fits inputs f32[8,16] (Replicate) on mesh("),
            "{e}"
        );
    }
}
