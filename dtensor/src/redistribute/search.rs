//! The planner's search: Dijkstra's search over layouts, minimising the bytes all
//! ranks send, then collectives, then steps (see [`plan`](super::plan) for the
//! moves and the costs), grown on demand from each source and kept per process.

use std::cmp::Reverse;
use std::collections::hash_map::Entry;
use std::collections::{BinaryHeap, HashMap};
use std::sync::{Arc, Mutex};

use smallvec::SmallVec;
use tessera_mesh::ReduceOp;

use super::step::StepKind;
use crate::memo::Memo;
use crate::sharding::shard_size_and_offset;
use crate::spec::{Layout, PlacementsDisplay};
use crate::{Error, MeshDims, Placement, Result, ShardOrder};

/// The planning state: placements and, per tensor dim, its split stack.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct State {
    placements: SmallVec<[Placement; 4]>,
    stacks: SmallVec<[MeshDims; 4]>,
}

impl State {
    fn of(l: &Layout) -> State {
        State {
            placements: l.placements.clone(),
            stacks: (0..l.shape.len()).map(|d| l.order.order_of(&l.placements, d)).collect(),
        }
    }

    fn layout(&self, like: &Layout) -> Result<Layout> {
        let entries = self
            .stacks
            .iter()
            .enumerate()
            .filter(|(_, s)| s.len() > 1)
            .map(|(d, s)| (d, s.clone()));
        let order = ShardOrder::new(&self.placements, entries)?;
        Ok(Layout {
            placements: self.placements.clone(),
            order,
            ..like.clone()
        })
    }

    /// Where mesh dim `m` splits: its tensor dim and depth in that dim's stack.
    fn position(&self, m: usize) -> Option<(usize, usize)> {
        let d = self.placements[m].shard_dim()?;
        self.stacks[d].iter().position(|&x| x == m).map(|i| (d, i))
    }

    /// Ranks holding each element: the product of the sizes of the mesh dims that
    /// do not shard (replicated or partial).
    fn replicas(&self, sizes: &[usize]) -> u128 {
        (0..sizes.len())
            .filter(|&m| !self.placements[m].is_shard())
            .map(|m| sizes[m] as u128)
            .product()
    }

    /// The (offset, length) of tensor dim `d` that the rank at `coord` holds.
    fn extent(&self, shape: &[usize], sizes: &[usize], coord: &[usize], d: usize) -> (usize, usize) {
        self.stacks[d].iter().fold((0, shape[d]), |(off, len), &m| {
            let (l, o) = shard_size_and_offset(len, sizes[m], coord[m]);
            (off + o, l)
        })
    }
}

/// A plan's cost, compared in field order.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
struct Cost {
    /// Elements of the search's shape sent by all ranks together, times the mesh
    /// size (so every `(n−1)/n` share is a whole number): the bytes up to one
    /// factor, the same for every route (see [`Search::new`]).
    bytes: u128,
    collectives: u32,
    steps: u32,
}

impl std::ops::Add for Cost {
    type Output = Cost;
    fn add(self, o: Cost) -> Cost {
        Cost {
            bytes: self.bytes + o.bytes,
            collectives: self.collectives + o.collectives,
            steps: self.steps + o.steps,
        }
    }
}

/// One move of the search: the group, what it does, and the state after.
type Move = (MeshDims, StepKind, State);

/// The fixed facts of one search.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Search {
    /// The tensor's shape, each dim that every split divides evenly standing as
    /// the mesh size (see [`Search::new`]).
    shape: Vec<usize>,
    sizes: Vec<usize>,
    ranks: u128,
    numel: u128,
    /// The pending reductions the layouts hold (the only ones a partition makes:
    /// a partition joins a pending reduction into a wider group, or makes the target's),
    /// in one order.
    ops: SmallVec<[ReduceOp; 2]>,
    /// Every mesh coordinate, row-major.
    coords: Vec<Vec<usize>>,
}

impl Search {
    /// The search for redistributing tensors of `shape` over a mesh of `sizes`,
    /// partitions making only `ops`.
    ///
    /// A tensor dim whose size is a nonzero multiple of the mesh size splits
    /// evenly under every stack of mesh dims (their sizes' product divides the
    /// mesh size), so each rank's extent of it, every overlap, and so every
    /// step's bytes scale with its size: one factor for every route. The search
    /// runs such a dim as the mesh size itself, and every shape (and dtype) alike
    /// in the other dims shares one search tree: the parameters of a model, with
    /// many shapes and a few layouts, plan in a few trees.
    fn new(shape: &[usize], sizes: &[usize], mut ops: SmallVec<[ReduceOp; 2]>) -> Search {
        let ranks = sizes.iter().product::<usize>().max(1);
        let shape: Vec<usize> = shape
            .iter()
            .map(|&n| if n > 0 && n % ranks == 0 { ranks } else { n })
            .collect();
        ops.sort_by_key(|op| *op as u8);
        Search {
            ranks: ranks as u128,
            numel: shape.iter().map(|&n| n as u128).product(),
            coords: crate::sharding::mesh_coords(sizes),
            shape,
            sizes: sizes.to_vec(),
            ops,
        }
    }

    /// Every move from `s`.
    fn moves(&self, s: &State) -> Vec<Move> {
        let nm = self.sizes.len();
        let mut out = Vec::new();
        for m in 0..nm {
            if s.placements[m] != Placement::Replicate {
                continue;
            }
            // Every tensor dim, not only those either layout shards: which dim a
            // detour shards matters to the bytes when splits are uneven.
            for d in 0..self.shape.len() {
                let mut t = s.clone();
                t.placements[m] = Placement::Shard(d);
                t.stacks[d].push(m);
                out.push((SmallVec::from_slice(&[m]), StepKind::Slice, t));
            }
            for &op in &self.ops {
                let mut t = s.clone();
                t.placements[m] = Placement::Partial(op);
                out.push((SmallVec::from_slice(&[m]), StepKind::Partition { op }, t));
            }
        }
        for mask in 1usize..(1 << nm) {
            let group: MeshDims = (0..nm).filter(|m| mask >> m & 1 == 1).collect();
            let first = s.placements[group[0]];
            if let Placement::Partial(op) = first {
                if group.iter().any(|&m| s.placements[m] != first) {
                    continue;
                }
                let mut t = s.clone();
                group.iter().for_each(|&m| t.placements[m] = Placement::Replicate);
                out.push((group.clone(), StepKind::AllReduce { op }, t));
                for t in self.reassign(s, &group, false) {
                    out.push((group.clone(), StepKind::ReduceScatter { op }, t));
                }
            } else if group.iter().all(|&m| s.placements[m].is_shard()) {
                for t in self.exchanges(s, &group) {
                    let kind = if group.iter().all(|&m| t.placements[m] == Placement::Replicate) {
                        StepKind::AllGather
                    } else {
                        StepKind::AllToAll
                    };
                    out.push((group.clone(), kind, t));
                }
            }
        }
        out
    }

    /// Every state an all_gather or all_to_all over `group` (all shards in `s`)
    /// reaches, with every member changing: each member ends `Replicate` or
    /// splitting a tensor dim, while the other mesh dims keep their place in their
    /// stacks. When a kept split sits above a member (in `s` or after), whether
    /// the group's ranks still hold all each needs is checked rank by rank.
    fn exchanges(&self, s: &State, group: &[usize]) -> Vec<State> {
        let mut base = s.clone();
        for stack in &mut base.stacks {
            stack.retain(|m| !group.contains(m));
        }
        group.iter().for_each(|&m| base.placements[m] = Placement::Replicate);
        // Each kept split's (index, mesh dim) in `s`.
        let kept: Vec<Vec<(usize, usize)>> = s
            .stacks
            .iter()
            .map(|st| {
                st.iter()
                    .enumerate()
                    .filter(|(_, m)| !group.contains(m))
                    .map(|(i, &m)| (i, m))
                    .collect()
            })
            .collect();
        let above = |st: &MeshDims| {
            let first = st.iter().position(|m| group.contains(m));
            first.is_some_and(|f| st[f..].iter().any(|m| !group.contains(m)))
        };
        let tangled_before = s.stacks.iter().any(above);
        let mut out = Vec::new();
        'next: for mut t in self.reassign(&base, group, true) {
            // `reassign` put the members on top of the kept splits; move the kept
            // ones back to their indices, the members filling the gaps in order.
            for (d, keep) in kept.iter().enumerate() {
                let members: MeshDims = t.stacks[d].iter().copied().filter(|m| group.contains(m)).collect();
                let len = keep.len() + members.len();
                if keep.last().is_some_and(|&(i, _)| i >= len) {
                    continue 'next;
                }
                let mut fill = members.into_iter();
                let mut k = keep.iter().peekable();
                t.stacks[d] = (0..len)
                    .map(|i| match k.peek() {
                        Some(&&(at, m)) if at == i => {
                            k.next();
                            m
                        }
                        _ => fill.next().expect("as many members as gaps"),
                    })
                    .collect();
            }
            // A member that ends where it was belongs to a smaller group.
            if group.iter().any(|&m| t.position(m) == s.position(m)) {
                continue;
            }
            if (tangled_before || t.stacks.iter().any(above)) && !self.covers(s, &t, group) {
                continue;
            }
            out.push(t);
        }
        out
    }

    /// Whether every rank's region in `t` lies in the regions its `group` holds in `s`
    /// (which are disjoint: every member shards).
    fn covers(&self, s: &State, t: &State, group: &[usize]) -> bool {
        self.coords.iter().all(|c| {
            let need = self.region(t, c);
            let held: u128 = super::group_coords(&self.sizes, c, group)
                .iter()
                .map(|q| overlap(&self.region(s, q), &need))
                .sum();
            held == overlap(&need, &need)
        })
    }

    /// The (offset, length) per tensor dim that the rank at `coord` holds in `st`.
    fn region(&self, st: &State, coord: &[usize]) -> SmallVec<[(usize, usize); 4]> {
        (0..self.shape.len())
            .map(|d| st.extent(&self.shape, &self.sizes, coord, d))
            .collect()
    }

    /// Every way to place `group`'s members on top of `base`'s stacks (or, with
    /// `replicate`, leave them `Replicate`), each result once.
    fn reassign(&self, base: &State, group: &[usize], replicate: bool) -> Vec<State> {
        fn place(s: &State, group: &[usize], i: usize, dims: &[usize], replicate: bool, out: &mut Vec<State>) {
            let Some(&m) = group.get(i) else {
                out.push(s.clone());
                return;
            };
            if replicate {
                let mut t = s.clone();
                t.placements[m] = Placement::Replicate;
                place(&t, group, i + 1, dims, replicate, out);
            }
            for &d in dims {
                // The members placed on `d` so far sit on top of its stack; `m`
                // can go below, between or above them.
                let top = s.stacks[d].len();
                let placed = s.stacks[d].iter().rev().take_while(|x| group[..i].contains(x)).count();
                for at in top - placed..=top {
                    let mut t = s.clone();
                    t.placements[m] = Placement::Shard(d);
                    t.stacks[d].insert(at, m);
                    place(&t, group, i + 1, dims, replicate, out);
                }
            }
        }
        let mut out = Vec::new();
        let dims: Vec<usize> = (0..self.shape.len()).collect();
        place(base, group, 0, &dims, replicate, &mut out);
        out
    }

    /// The cost of one move from `s` to `t`.
    fn cost(&self, s: &State, (group, kind, t): &Move) -> Cost {
        let n: u128 = group.iter().map(|&m| self.sizes[m] as u128).product();
        let step = Cost {
            bytes: 0,
            collectives: 0,
            steps: 1,
        };
        if n == 1 || kind.collective().is_none() {
            return step;
        }
        let data = |st: &State| self.numel * st.replicas(&self.sizes);
        let share = (n - 1) * (self.ranks / n);
        let bytes = match kind {
            StepKind::AllReduce { .. } => 2 * share * data(s),
            StepKind::ReduceScatter { .. } => share * data(s),
            StepKind::AllGather => share * data(t),
            // Each rank sends what the group's ranks need of its piece, less what it keeps.
            _ => {
                let needers: u128 = group
                    .iter()
                    .filter(|&&m| t.placements[m] == Placement::Replicate)
                    .map(|&m| self.sizes[m] as u128)
                    .product();
                self.ranks * (data(s) * needers - self.kept(s, t))
            }
        };
        Cost {
            bytes,
            collectives: 1,
            steps: 1,
        }
    }

    /// Elements every rank holds both in `s` and in `t`, summed over the mesh.
    fn kept(&self, s: &State, t: &State) -> u128 {
        self.coords
            .iter()
            .map(|c| overlap(&self.region(s, c), &self.region(t, c)))
            .sum()
    }
}

/// Elements in both boxes, each given as (offset, length) per dim.
fn overlap(a: &[(usize, usize)], b: &[(usize, usize)]) -> u128 {
    a.iter()
        .zip(b)
        .map(|(&(oa, la), &(ob, lb))| ((oa + la).min(ob + lb).saturating_sub(oa.max(ob))) as u128)
        .product()
}

/// A search node: its state, its cost from the root, and the move from its parent.
type Node = (State, Cost, Option<(usize, MeshDims, StepKind)>);

/// Dijkstra's search from one source, grown on demand: a query settles states in
/// cost order only until its target is settled, and the next query from the same
/// source goes on from there. A settled state's route is the cheapest (no later
/// state costs less), so routes do not depend on the order of queries.
struct Tree {
    search: Search,
    nodes: Vec<Node>,
    index: HashMap<State, usize>,
    settled: Vec<bool>,
    /// Reached states not yet settled, by cost (stale entries skipped on pop).
    frontier: BinaryHeap<Reverse<(Cost, usize)>>,
}

impl Tree {
    fn new(search: Search, src: State) -> Tree {
        Tree {
            search,
            nodes: vec![(src.clone(), Cost::default(), None)],
            index: HashMap::from([(src, 0)]),
            settled: vec![false],
            frontier: BinaryHeap::from([Reverse((Cost::default(), 0))]),
        }
    }

    /// The moves from the root to `dst`, `None` when it is not reachable.
    fn route_to(&mut self, dst: &State) -> Option<Vec<Move>> {
        while !self.index.get(dst).is_some_and(|&j| self.settled[j]) {
            self.settle_next()?;
        }
        let mut at = self.index[dst];
        let mut route = Vec::new();
        while let Some((parent, group, kind)) = self.nodes[at].2.clone() {
            route.push((group, kind, self.nodes[at].0.clone()));
            at = parent;
        }
        route.reverse();
        Some(route)
    }

    /// Settles the cheapest state on the frontier and reaches its moves' states;
    /// `None` once every reachable state is settled.
    fn settle_next(&mut self) -> Option<()> {
        let i = loop {
            let Reverse((_, i)) = self.frontier.pop()?;
            if !self.settled[i] {
                break i;
            }
        };
        self.settled[i] = true;
        let (here, cost) = (self.nodes[i].0.clone(), self.nodes[i].1);
        for mv in self.search.moves(&here) {
            let c = cost + self.search.cost(&here, &mv);
            let (group, kind, t) = mv;
            match self.index.entry(t) {
                Entry::Occupied(e) => {
                    let j = *e.get();
                    if c < self.nodes[j].1 {
                        self.nodes[j].1 = c;
                        self.nodes[j].2 = Some((i, group, kind));
                        self.frontier.push(Reverse((c, j)));
                    }
                }
                Entry::Vacant(e) => {
                    let j = self.nodes.len();
                    self.nodes.push((e.key().clone(), c, Some((i, group, kind))));
                    self.settled.push(false);
                    e.insert(j);
                    self.frontier.push(Reverse((c, j)));
                }
            }
        }
        Some(())
    }
}

/// Search trees, by search and source state (at most 256).
static TREES: Memo<(Search, State), Arc<Mutex<Tree>>> = Memo::new(256);

/// A route: each step's group, kind and layout after.
pub(super) type Route = Arc<[(MeshDims, StepKind, Layout)]>;

/// Searches the cheapest route and turns its states into layouts.
pub(super) fn find_route(src: &Layout, dst: &Layout) -> Result<Route> {
    let mut ops: SmallVec<[ReduceOp; 2]> = SmallVec::new();
    for (_, op) in src.partial_ops().chain(dst.partial_ops()) {
        if !ops.contains(&op) {
            ops.push(op);
        }
    }
    let search = Search::new(&src.shape, &src.mesh_shape, ops);
    let from = State::of(src);
    let tree = TREES
        .with_room()
        .entry((search.clone(), from.clone()))
        .or_insert_with(|| Arc::new(Mutex::new(Tree::new(search.clone(), from.clone()))))
        .clone();
    // A poisoned tree lock means another thread panicked while growing it, maybe
    // halfway through settling a state: the tree starts again.
    let mut grown = tree.lock().unwrap_or_else(|e| {
        let mut g = e.into_inner();
        *g = Tree::new(search, from);
        tree.clear_poison();
        g
    });
    let route = grown.route_to(&State::of(dst));
    drop(grown);
    let route = route.ok_or_else(|| Error::Placement {
        op: "redistribute",
        detail: format!(
            "no plan from {} to {}",
            PlacementsDisplay(&src.placements),
            PlacementsDisplay(&dst.placements)
        ),
    })?;
    route
        .into_iter()
        .map(|(group, kind, state)| Ok((group, kind, state.layout(src)?)))
        .collect()
}
