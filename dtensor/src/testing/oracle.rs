//! An exhaustive oracle for redistribution plans: every layout of a small mesh and
//! shape, every one-collective step between two of them, and the cheapest
//! sequences by brute force.
//!
//! It shares nothing with the planner but the layout semantics
//! ([`Layout::local_region`]): the layouts are enumerated (every placement on every
//! mesh dim, every shard order), a step between two layouts is recognised by
//! simulating every rank's region before and after, and its bytes are counted from
//! those regions. A step works along the mesh dims `D` where the layouts differ
//! (placement, or depth in a tensor dim's split stack), as one collective over
//! their flattened group:
//!
//! | `D` before → after | step | valid when (for every rank `r`, group `G(r)`) |
//! |---|---|---|
//! | all `R` → `S` or `P` | local | `after(r) ⊆ before(r)` |
//! | all `P(op)` → all `R` | all_reduce | always |
//! | all `P(op)` → all `S` | reduce_scatter | the group's `after` regions tile `before(r)` |
//! | all `S` → all `R` | all_gather | the group's `before` regions cover `after(r)` |
//! | all `S` → `S` / `R` | all_to_all | the group's `before` regions cover `after(r)` |
//!
//! Bytes follow `tessera_mesh`'s convention (`(n−1)/n` of an all_gather's output or
//! a reduce_scatter's input, twice that for an all_reduce, what leaves the rank in
//! an all_to_all), summed over every rank and multiplied by the mesh size so each
//! share is a whole number ([`Cost::bytes`]). A group of one rank moves nothing and
//! is no collective.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use tessera_mesh::{DType, ReduceOp};

use crate::redistribute::{Plan, StepKind};
use crate::{Layout, MeshDims, Placement, Result, ShardOrder};

/// The cost of a step or a sequence of steps.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Cost {
    /// Bytes sent by all ranks together, times the mesh size.
    pub bytes: u128,
    /// Collectives issued.
    pub collectives: u32,
}

impl Cost {
    /// The mean bytes one rank sends, given the mesh size.
    pub fn bytes_per_rank(&self, ranks: usize) -> f64 {
        self.bytes as f64 / (ranks * ranks) as f64
    }
}

impl std::ops::Add for Cost {
    type Output = Cost;
    fn add(self, o: Cost) -> Cost {
        Cost {
            bytes: self.bytes + o.bytes,
            collectives: self.collectives + o.collectives,
        }
    }
}

/// What kind of step a transition is, as the oracle sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Slices and partitions: no communication.
    Local,
    /// all_reduce over the group.
    AllReduce,
    /// reduce_scatter over the group.
    ReduceScatter,
    /// all_gather over the group.
    AllGather,
    /// all_to_all over the group.
    AllToAll,
}

impl Kind {
    /// The oracle's kind for a planner step's kind.
    pub fn of(kind: StepKind) -> Kind {
        match kind {
            StepKind::AllGather => Kind::AllGather,
            StepKind::ReduceScatter { .. } => Kind::ReduceScatter,
            StepKind::AllReduce { .. } => Kind::AllReduce,
            StepKind::AllToAll => Kind::AllToAll,
            _ => Kind::Local,
        }
    }
}

/// One step the oracle recognises between two layouts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OracleStep {
    /// The mesh dims that change (the step's group), in mesh order.
    pub group: MeshDims,
    /// What the step is.
    pub kind: Kind,
    /// What it costs.
    pub cost: Cost,
}

/// A box of the global tensor: (offset, length) per dim.
type Region = Vec<(usize, usize)>;

fn numel(r: &Region) -> u128 {
    r.iter().map(|&(_, l)| l as u128).product()
}

fn overlap(a: &Region, b: &Region) -> u128 {
    a.iter()
        .zip(b)
        .map(|(&(oa, la), &(ob, lb))| ((oa + la).min(ob + lb).saturating_sub(oa.max(ob))) as u128)
        .product()
}

/// Every layout of `shape` (`dtype`) on `mesh`: each mesh dim `Replicate`, `Shard`
/// of any tensor dim or `Partial` of any of `ops`, with every shard order.
///
/// # Errors
/// An invalid mesh or shape.
pub fn all_layouts(mesh: &[usize], shape: &[usize], dtype: DType, ops: &[ReduceOp]) -> Result<Vec<Layout>> {
    let mut choices = vec![Placement::Replicate];
    choices.extend((0..shape.len()).map(Placement::Shard));
    choices.extend(ops.iter().map(|&op| Placement::Partial(op)));
    let mut out = Vec::new();
    let total = choices.len().pow(mesh.len() as u32);
    for code in 0..total {
        let mut c = code;
        let placements: Vec<Placement> = (0..mesh.len())
            .map(|_| {
                let p = choices[c % choices.len()];
                c /= choices.len();
                p
            })
            .collect();
        // Every order of the mesh dims on each tensor dim split more than once.
        let multi: Vec<(usize, Vec<usize>)> = (0..shape.len())
            .map(|d| {
                (
                    d,
                    (0..mesh.len())
                        .filter(|&m| placements[m] == Placement::Shard(d))
                        .collect::<Vec<_>>(),
                )
            })
            .filter(|(_, ms)| ms.len() > 1)
            .collect();
        let mut orders: Vec<Vec<(usize, Vec<usize>)>> = vec![Vec::new()];
        for (d, ms) in &multi {
            orders = orders
                .into_iter()
                .flat_map(|o| {
                    permutations(ms).into_iter().map(move |p| {
                        let mut o = o.clone();
                        o.push((*d, p));
                        o
                    })
                })
                .collect();
        }
        for o in orders {
            let order = ShardOrder::new(&placements, o)?;
            out.push(Layout::with_order(mesh, &placements, order, shape, dtype)?);
        }
    }
    Ok(out)
}

fn permutations(xs: &[usize]) -> Vec<Vec<usize>> {
    if xs.len() <= 1 {
        return vec![xs.to_vec()];
    }
    let mut out = Vec::new();
    for i in 0..xs.len() {
        let mut rest = xs.to_vec();
        let x = rest.remove(i);
        for mut p in permutations(&rest) {
            p.insert(0, x);
            out.push(p);
        }
    }
    out
}

/// Every rank's region of a layout, row-major over the mesh.
fn regions(l: &Layout, coords: &[Vec<usize>]) -> Result<Vec<Region>> {
    coords
        .iter()
        .map(|c| {
            let (offset, shape) = l.local_region(c)?;
            Ok(offset.into_iter().zip(shape).collect())
        })
        .collect()
}

/// Where mesh dim `m` splits in `l`: tensor dim and depth in its split stack.
fn position(l: &Layout, m: usize) -> Option<(usize, usize)> {
    let d = l.placements[m].shard_dim()?;
    l.order
        .order_of(&l.placements, d)
        .iter()
        .position(|&x| x == m)
        .map(|i| (d, i))
}

/// The exhaustive graph of one mesh, shape and dtype: every layout, every step.
pub struct Oracle {
    mesh: Vec<usize>,
    coords: Vec<Vec<usize>>,
    /// The layouts, and each one's regions per rank.
    layouts: Vec<(Layout, Vec<Region>)>,
    index: HashMap<Layout, usize>,
    /// Out-edges per layout: (target index, cost).
    edges: Vec<Vec<(usize, Cost)>>,
}

impl Oracle {
    /// Builds the graph: every layout from [`all_layouts`] and every step between two of them.
    ///
    /// # Errors
    /// An invalid mesh or shape.
    pub fn new(mesh: &[usize], shape: &[usize], dtype: DType, ops: &[ReduceOp]) -> Result<Oracle> {
        let coords = crate::sharding::mesh_coords(mesh);
        let layouts: Vec<(Layout, Vec<Region>)> = all_layouts(mesh, shape, dtype, ops)?
            .into_iter()
            .map(|l| {
                let r = regions(&l, &coords)?;
                Ok((l, r))
            })
            .collect::<Result<_>>()?;
        let index = layouts.iter().enumerate().map(|(i, (l, _))| (l.clone(), i)).collect();
        let mut oracle = Oracle {
            mesh: mesh.to_vec(),
            coords,
            layouts,
            index,
            edges: Vec::new(),
        };
        let n = oracle.layouts.len();
        let mut edges = vec![Vec::new(); n];
        for (a, out) in edges.iter_mut().enumerate() {
            for b in 0..n {
                if a != b
                    && let Some(s) = oracle.step_between(a, b)
                {
                    out.push((b, s.cost));
                }
            }
        }
        oracle.edges = edges;
        Ok(oracle)
    }

    /// The layouts the graph holds.
    pub fn layouts(&self) -> impl Iterator<Item = &Layout> {
        self.layouts.iter().map(|(l, _)| l)
    }

    /// Number of one-step transitions in the graph.
    pub fn edge_count(&self) -> usize {
        self.edges.iter().map(Vec::len).sum()
    }

    /// The step from `before` to `after` if one collective (or local work) does it.
    pub fn step(&self, before: &Layout, after: &Layout) -> Option<OracleStep> {
        self.step_between(*self.index.get(before)?, *self.index.get(after)?)
    }

    fn step_between(&self, a: usize, b: usize) -> Option<OracleStep> {
        let ((la, ra), (lb, rb)) = (&self.layouts[a], &self.layouts[b]);
        let group: MeshDims = (0..self.mesh.len())
            .filter(|&m| la.placements[m] != lb.placements[m] || position(la, m) != position(lb, m))
            .collect();
        let first = la.placements[*group.first()?];
        let all = |f: &dyn Fn(Placement) -> bool, l: &Layout| group.iter().all(|&m| f(l.placements[m]));
        let n: usize = group.iter().map(|&m| self.mesh[m]).product();
        let ranks = self.coords.len() as u128;
        let share = (n as u128 - 1) * (ranks / n as u128);
        let esize = la.dtype.size_in_bytes() as u128;
        // The ranks of r's group, by index into `coords`.
        let members = |r: usize| -> Vec<usize> {
            (0..self.coords.len())
                .filter(|&q| (0..self.mesh.len()).all(|m| group.contains(&m) || self.coords[q][m] == self.coords[r][m]))
                .collect()
        };
        let ranks_of = 0..self.coords.len();
        let (kind, bytes) = if all(&|p| p == Placement::Replicate, la) {
            let local = ranks_of.clone().all(|r| overlap(&rb[r], &ra[r]) == numel(&rb[r]));
            if !local || !all(&|p| !p.is_replicate(), lb) {
                return None;
            }
            (Kind::Local, 0)
        } else if first.is_partial() && all(&|p| p == first, la) {
            if all(&|p| p == Placement::Replicate, lb) {
                let data: u128 = ranks_of.map(|r| numel(&ra[r])).sum();
                (Kind::AllReduce, 2 * share * data * esize)
            } else if all(&|p| p.is_shard(), lb) {
                for r in ranks_of.clone() {
                    let g = members(r);
                    let inside = g.iter().all(|&q| overlap(&rb[q], &ra[r]) == numel(&rb[q]));
                    let sizes: u128 = g.iter().map(|&q| numel(&rb[q])).sum();
                    let disjoint = g
                        .iter()
                        .enumerate()
                        .all(|(i, &p)| g[i + 1..].iter().all(|&q| overlap(&rb[p], &rb[q]) == 0));
                    if !(inside && disjoint && sizes == numel(&ra[r])) {
                        return None;
                    }
                }
                let data: u128 = ranks_of.map(|r| numel(&ra[r])).sum();
                (Kind::ReduceScatter, share * data * esize)
            } else {
                return None;
            }
        } else if all(&|p| p.is_shard(), la) && all(&|p| !p.is_partial(), lb) {
            let mut off_rank = 0;
            for r in ranks_of.clone() {
                let g = members(r);
                let disjoint = g
                    .iter()
                    .enumerate()
                    .all(|(i, &p)| g[i + 1..].iter().all(|&q| overlap(&ra[p], &ra[q]) == 0));
                let covered: u128 = g.iter().map(|&q| overlap(&ra[q], &rb[r])).sum();
                if !disjoint || covered != numel(&rb[r]) {
                    return None;
                }
                off_rank += g
                    .iter()
                    .filter(|&&q| q != r)
                    .map(|&q| overlap(&ra[r], &rb[q]))
                    .sum::<u128>();
            }
            if all(&|p| p == Placement::Replicate, lb) {
                let data: u128 = ranks_of.map(|r| numel(&rb[r])).sum();
                (Kind::AllGather, share * data * esize)
            } else {
                (Kind::AllToAll, ranks * off_rank * esize)
            }
        } else {
            return None;
        };
        let collectives = u32::from(kind != Kind::Local && n > 1);
        Some(OracleStep {
            group,
            kind,
            cost: Cost { bytes, collectives },
        })
    }

    /// The cheapest cost from `src` to every layout (by bytes, then collectives),
    /// `None` where no sequence of steps reaches it.
    ///
    /// # Panics
    /// `src` not among the oracle's layouts.
    pub fn cheapest_from(&self, src: &Layout) -> Vec<Option<Cost>> {
        self.search(src).into_iter().map(|b| b.map(|(c, _)| c)).collect()
    }

    /// One cheapest sequence of layouts from `src` to `dst` (both included), `None`
    /// when none reaches it.
    ///
    /// # Panics
    /// `src` or `dst` not among the oracle's layouts.
    pub fn cheapest_route(&self, src: &Layout, dst: &Layout) -> Option<Vec<Layout>> {
        let best = self.search(src);
        let mut at = self.index[dst];
        let mut route = vec![self.layouts[at].0.clone()];
        while at != self.index[src] {
            at = best[at]?.1;
            route.push(self.layouts[at].0.clone());
        }
        route.reverse();
        Some(route)
    }

    /// Dijkstra's search from `src`: each layout's best cost and predecessor.
    fn search(&self, src: &Layout) -> Vec<Option<(Cost, usize)>> {
        let s = self.index[src];
        let mut best: Vec<Option<(Cost, usize)>> = vec![None; self.layouts.len()];
        best[s] = Some((Cost::default(), s));
        let mut heap = BinaryHeap::from([Reverse((Cost::default(), s))]);
        while let Some(Reverse((c, i))) = heap.pop() {
            if best[i].is_some_and(|(b, _)| b < c) {
                continue;
            }
            for &(j, w) in &self.edges[i] {
                let next = c + w;
                if best[j].is_none_or(|(b, _)| next < b) {
                    best[j] = Some((next, i));
                    heap.push(Reverse((next, j)));
                }
            }
        }
        best
    }

    /// A planner's plan priced by the oracle, step by step.
    ///
    /// # Errors
    /// A message naming the first step the oracle does not recognise as one
    /// collective along the step's mesh dims, or recognises as another kind.
    pub fn price(&self, plan: &Plan) -> std::result::Result<Cost, String> {
        let mut total = Cost::default();
        for (i, (before, step)) in plan.transitions().enumerate() {
            let Some(s) = self.step(before, &step.after) else {
                return Err(format!("step {} is not one step the oracle knows:\n{plan}", i + 1));
            };
            if s.group != step.mesh_dims || s.kind != Kind::of(step.kind) {
                return Err(format!(
                    "step {} is {:?} on {:?} for the oracle, {:?} on {:?} for the plan:\n{plan}",
                    i + 1,
                    s.kind,
                    s.group,
                    step.kind,
                    step.mesh_dims
                ));
            }
            total = total + s.cost;
        }
        Ok(total)
    }
}
