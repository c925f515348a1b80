//! The redistribute planner: a pure function from two layouts to the list of
//! per-mesh-dim steps that turns one into the other.
//!
//! The state of a layout, for planning, is its placements plus, per tensor dim,
//! the stack of mesh dims that split it (outermost first). A mesh dim can leave a
//! stack only from the top (the innermost split), and enters one on top. For each
//! tensor dim the common prefix of the current and target stacks stays; what lies
//! above it in the current stack is removed innermost first, what lies above it in
//! the target stack is added in order. Each round the planner takes the cheapest
//! applicable move, in this order:
//!
//! 1. `R → S(d)`: a local slice (shrinks the data, free);
//! 2. `P → S(d)`: reduce_scatter (shrinks the data);
//! 3. `S(i) → S(j)`: all_to_all, when the mesh dim leaves the top of `i` and is
//!    next to enter `j` (never a detour through Replicate);
//! 4. `P → R`: all_reduce;
//! 5. `S(d) → R`: all_gather of the innermost split that must go (grows the data,
//!    so last);
//! 6. `R → P`: a local partition.
//!
//! Each round makes progress (a removal can always gather; once nothing needs
//! removing, the next mesh dim to add is Replicate or Partial), so planning ends.
//! Among gathers, those whose target is Replicate go first, and of them the one
//! along the innermost tensor dim (its strided copy into place then runs on the
//! smaller data; a gather along the outermost dim needs no copy at all).
//!
//! Two whole-mesh steps replace several per-dim ones: when both layouts shard on
//! every mesh dim and the rounds would take more than one step, one all_to_all over
//! the whole mesh (every element moves at most once, straight to its owner); and
//! when every mesh dim reduces the same pending op to Replicate in a row, one
//! all_reduce over the whole mesh (`2(N−1)/N` of the data instead of `Σ 2(nᵢ−1)/nᵢ`).

use std::fmt;

use smallvec::SmallVec;
use tessera_mesh::{OpKind, ReduceOp};

use crate::spec::{Layout, PlacementsDisplay};
use crate::{Error, MeshDims, Placement, Result, ShardOrder};

/// What one step does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum StepKind {
    /// `Shard(dim) → Replicate`: all_gather along the mesh dim.
    AllGather {
        /// The tensor dim gathered.
        dim: usize,
    },
    /// `Partial(op) → Shard(dim)`: reduce_scatter along the mesh dim.
    ReduceScatter {
        /// The pending reduction.
        op: ReduceOp,
        /// The tensor dim scattered.
        dim: usize,
    },
    /// `Partial(op) → Replicate`: all_reduce along the mesh dim.
    AllReduce {
        /// The pending reduction.
        op: ReduceOp,
    },
    /// `Shard(from) → Shard(to)`: all_to_all along the mesh dim.
    AllToAll {
        /// The tensor dim sharded before.
        from: usize,
        /// The tensor dim sharded after.
        to: usize,
    },
    /// An all_to_all over the whole mesh between two all-shard layouts.
    AllToAllMesh,
    /// `Partial(op) → Replicate` on every mesh dim at once: one all_reduce over the
    /// whole mesh (moves `2(N−1)/N` instead of the sum of `2(nᵢ−1)/nᵢ`).
    AllReduceMesh {
        /// The pending reduction (the same on every mesh dim).
        op: ReduceOp,
    },
    /// `Replicate → Shard(dim)`: keep this rank's slice, no communication.
    Slice {
        /// The tensor dim sliced.
        dim: usize,
    },
    /// `Replicate → Partial(op)`: the value on one rank and the reduction's identity
    /// elsewhere (sum, product), or the value everywhere (avg, max, min). No communication.
    Partition {
        /// The reduction made pending.
        op: ReduceOp,
    },
}

impl StepKind {
    /// The collective this step issues, if any.
    pub fn collective(&self) -> Option<OpKind> {
        match self {
            StepKind::AllGather { .. } => Some(OpKind::AllGather),
            StepKind::ReduceScatter { .. } => Some(OpKind::ReduceScatter),
            StepKind::AllReduce { .. } | StepKind::AllReduceMesh { .. } => Some(OpKind::AllReduce),
            StepKind::AllToAll { .. } | StepKind::AllToAllMesh => Some(OpKind::AllToAll),
            StepKind::Slice { .. } | StepKind::Partition { .. } => None,
        }
    }
}

/// One step of a plan: a change on one mesh dim (or the whole mesh).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Step {
    /// The mesh dim the step works along; `None` for [`StepKind::AllToAllMesh`].
    pub mesh_dim: Option<usize>,
    /// What it does.
    pub kind: StepKind,
    /// The layout after the step.
    pub after: Layout,
    /// Bytes this rank sends in the step (see `tessera_mesh::stats` for the convention).
    pub bytes: u64,
}

impl Step {
    /// Ranks in the step's group: the mesh dim's size, or the whole mesh's.
    pub fn group_size(&self) -> usize {
        match self.mesh_dim {
            Some(m) => self.after.mesh_shape[m],
            None => self.after.mesh_shape.iter().product(),
        }
    }

    /// The collective this step issues: its kind's, unless the group has one rank
    /// (nothing moves, so the step is local and synchronizes nothing).
    pub fn collective(&self) -> Option<OpKind> {
        self.kind.collective().filter(|_| self.group_size() > 1)
    }
}

/// A redistribution plan: the steps from `src` to `dst`, in order.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Plan {
    /// The layout redistributed from.
    pub src: Layout,
    /// The steps; empty when the layouts are equal.
    pub steps: Vec<Step>,
}

impl Plan {
    /// Bytes this rank sends over the whole plan.
    pub fn bytes(&self) -> u64 {
        self.steps.iter().map(|s| s.bytes).sum()
    }

    /// Number of collectives the plan issues.
    pub fn collectives(&self) -> usize {
        self.steps.iter().filter(|s| s.collective().is_some()).count()
    }

    /// The layout the plan ends at.
    pub fn dst(&self) -> &Layout {
        self.steps.last().map_or(&self.src, |s| &s.after)
    }

    /// `(before, step)` pairs.
    pub fn transitions(&self) -> impl Iterator<Item = (&Layout, &Step)> {
        let befores = std::iter::once(&self.src).chain(self.steps.iter().map(|s| &s.after));
        befores.zip(&self.steps)
    }
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} -> {}",
            PlacementsDisplay(&self.src.placements),
            PlacementsDisplay(&self.dst().placements)
        )?;
        if self.steps.is_empty() {
            return f.write_str(": nothing to do");
        }
        writeln!(f, " ({} collectives, {} bytes/rank):", self.collectives(), self.bytes())?;
        for (i, (before, s)) in self.transitions().enumerate() {
            let what = match s.kind {
                StepKind::AllGather { .. } => "all_gather",
                StepKind::ReduceScatter { .. } => "reduce_scatter",
                StepKind::AllReduce { .. } | StepKind::AllReduceMesh { .. } => "all_reduce",
                StepKind::AllToAll { .. } | StepKind::AllToAllMesh => "all_to_all",
                StepKind::Slice { .. } => "local slice",
                StepKind::Partition { .. } => "local partition",
            };
            let on = match s.mesh_dim {
                Some(m) => format!("mesh dim {m}"),
                None => "whole mesh".to_string(),
            };
            write!(
                f,
                "  {}. {what} on {on}: {} -> {}, {} bytes",
                i + 1,
                PlacementsDisplay(&before.placements),
                PlacementsDisplay(&s.after.placements),
                s.bytes
            )?;
            if i + 1 < self.steps.len() {
                writeln!(f)?;
            }
        }
        Ok(())
    }
}

/// The planning state: placements and, per tensor dim, its split stack.
#[derive(Clone, PartialEq, Eq)]
struct State {
    placements: SmallVec<[Placement; 4]>,
    stacks: Vec<MeshDims>,
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
}

/// Plans the redistribution from `src` to `dst`, reporting the bytes that the rank at
/// `coord` sends.
///
/// # Errors
/// [`Error::Placement`] when the layouts differ in mesh shape, global shape or dtype,
/// or a mesh dim goes from `Shard` to `Partial` or between two different `Partial`s
/// (neither has a meaning: a shard is not a pending sum, and pending reductions
/// cannot be converted without reducing).
pub fn plan(src: &Layout, dst: &Layout, coord: &[usize]) -> Result<Plan> {
    let err = |detail: String| Error::Placement {
        op: "redistribute",
        detail,
    };
    if src.mesh_shape != dst.mesh_shape {
        return Err(err(format!(
            "source is on a mesh of shape {:?}, target on {:?}; redistribute stays on one mesh",
            &src.mesh_shape[..],
            &dst.mesh_shape[..]
        )));
    }
    if src.shape != dst.shape || src.dtype != dst.dtype {
        return Err(err(format!(
            "source is {:?} {}, target {:?} {}; redistribute keeps the global shape and dtype",
            &src.shape[..],
            src.dtype,
            &dst.shape[..],
            dst.dtype
        )));
    }
    for (m, (a, b)) in src.placements.iter().zip(&dst.placements).enumerate() {
        match (a, b) {
            (Placement::Shard(_), Placement::Partial(_)) => {
                return Err(err(format!(
                    "mesh dim {m}: {a} -> {b} is not defined (a shard is not a pending reduction); \
                     redistribute to Replicate first if you need a partial value"
                )));
            }
            (Placement::Partial(x), Placement::Partial(y)) if x != y => {
                return Err(err(format!(
                    "mesh dim {m}: {a} -> {b} would change a pending reduction; reduce it first (to Replicate or Shard)"
                )));
            }
            _ => {}
        }
    }
    let target = State::of(dst);
    let mut cur = State::of(src);
    let mut steps = Vec::new();
    let mut before = src.clone();
    while cur != target {
        let (mesh_dim, kind) = next_move(&cur, &target);
        apply(&mut cur, mesh_dim, kind);
        let after = cur.layout(src)?;
        let bytes = step_bytes(&before, &after, Some(mesh_dim), kind, coord)?;
        steps.push(Step {
            mesh_dim: Some(mesh_dim),
            kind,
            after: after.clone(),
            bytes,
        });
        before = after;
    }
    let all_shard = |l: &Layout| l.placements.iter().all(|p| p.is_shard());
    if steps.len() > 1 && all_shard(src) && all_shard(dst) {
        let after = dst.clone();
        let bytes = step_bytes(src, &after, None, StepKind::AllToAllMesh, coord)?;
        steps = vec![Step {
            mesh_dim: None,
            kind: StepKind::AllToAllMesh,
            after,
            bytes,
        }];
    }
    merge_all_reduces(src, &mut steps, coord)?;
    Ok(Plan {
        src: src.clone(),
        steps,
    })
}

/// Replaces a run of all_reduces with one op, covering every mesh dim, by one
/// all_reduce over the whole mesh.
fn merge_all_reduces(src: &Layout, steps: &mut Vec<Step>, coord: &[usize]) -> Result<()> {
    let ndim = src.mesh_shape.len();
    if ndim < 2 {
        return Ok(());
    }
    for start in 0..steps.len() {
        let StepKind::AllReduce { op } = steps[start].kind else {
            continue;
        };
        let run = steps[start..]
            .iter()
            .take_while(|s| s.kind == StepKind::AllReduce { op })
            .count();
        if run == ndim {
            let before = if start == 0 {
                src.clone()
            } else {
                steps[start - 1].after.clone()
            };
            let after = steps[start + run - 1].after.clone();
            let kind = StepKind::AllReduceMesh { op };
            let bytes = step_bytes(&before, &after, None, kind, coord)?;
            let merged = Step {
                mesh_dim: None,
                kind,
                after,
                bytes,
            };
            steps.splice(start..start + run, [merged]);
            return Ok(());
        }
    }
    Ok(())
}

/// Where each tensor dim's current and target stacks first differ.
fn prefix(cur: &[usize], tgt: &[usize]) -> usize {
    cur.iter().zip(tgt).take_while(|(a, b)| a == b).count()
}

/// The next move, by the priority in the module docs.
fn next_move(cur: &State, tgt: &State) -> (usize, StepKind) {
    let nd = cur.stacks.len();
    let p: Vec<usize> = (0..nd).map(|d| prefix(&cur.stacks[d], &tgt.stacks[d])).collect();
    let removals_done = |d: usize| cur.stacks[d].len() == p[d];
    // Can mesh dim m enter tensor dim d's stack now?
    let can_enter = |m: usize, d: usize| removals_done(d) && tgt.stacks[d].get(p[d]) == Some(&m);
    // Does mesh dim m sit on top of d's stack, above the common prefix?
    let must_leave_top = |m: usize, d: usize| !removals_done(d) && cur.stacks[d].last() == Some(&m);
    let nm = cur.placements.len();
    let find = |f: &dyn Fn(usize, Placement, Placement) -> Option<StepKind>| {
        (0..nm).find_map(|m| f(m, cur.placements[m], tgt.placements[m]).map(|k| (m, k)))
    };
    let rules: [&dyn Fn(usize, Placement, Placement) -> Option<StepKind>; 4] = [
        &|m, a, b| match (a, b) {
            (Placement::Replicate, Placement::Shard(d)) if can_enter(m, d) => Some(StepKind::Slice { dim: d }),
            _ => None,
        },
        &|m, a, b| match (a, b) {
            (Placement::Partial(op), Placement::Shard(d)) if can_enter(m, d) => {
                Some(StepKind::ReduceScatter { op, dim: d })
            }
            _ => None,
        },
        &|m, a, b| match (a, b) {
            (Placement::Shard(i), Placement::Shard(j)) if i != j && must_leave_top(m, i) && can_enter(m, j) => {
                Some(StepKind::AllToAll { from: i, to: j })
            }
            _ => None,
        },
        &|_, a, b| match (a, b) {
            (Placement::Partial(op), Placement::Replicate) => Some(StepKind::AllReduce { op }),
            _ => None,
        },
    ];
    for rule in rules {
        if let Some(mv) = find(rule) {
            return mv;
        }
    }
    // Gathers grow the data: first those whose target is Replicate, and among them
    // the one along the innermost tensor dim (its copy into place is the strided
    // one, cheapest while the data is small; a later gather along an outer dim
    // needs no copy at all).
    let gather = |to_replicate: bool| {
        (0..nm)
            .filter_map(|m| match (cur.placements[m], tgt.placements[m]) {
                (Placement::Shard(d), b) if must_leave_top(m, d) && (b == Placement::Replicate) == to_replicate => {
                    Some((m, d))
                }
                _ => None,
            })
            .max_by_key(|&(m, d)| (d, std::cmp::Reverse(m)))
    };
    if let Some((m, d)) = gather(true).or_else(|| gather(false)) {
        return (m, StepKind::AllGather { dim: d });
    }
    // Only partitions are left (see the module docs for why).
    match find(&|_, a, b| match (a, b) {
        (Placement::Replicate, Placement::Partial(op)) => Some(StepKind::Partition { op }),
        _ => None,
    }) {
        Some(mv) => mv,
        // INVARIANT: `cur != tgt` and every other difference has a rule above.
        None => unreachable!("redistribute planner found no move"),
    }
}

fn apply(s: &mut State, m: usize, kind: StepKind) {
    let to = match kind {
        StepKind::AllGather { dim } => {
            s.stacks[dim].pop();
            Placement::Replicate
        }
        StepKind::AllReduce { .. } => Placement::Replicate,
        StepKind::ReduceScatter { dim, .. } | StepKind::Slice { dim } => {
            s.stacks[dim].push(m);
            Placement::Shard(dim)
        }
        StepKind::AllToAll { from, to } => {
            s.stacks[from].pop();
            s.stacks[to].push(m);
            Placement::Shard(to)
        }
        StepKind::Partition { op } => Placement::Partial(op),
        StepKind::AllToAllMesh | StepKind::AllReduceMesh { .. } => return,
    };
    s.placements[m] = to;
}

/// Bytes the rank at `coord` sends in one step (see `tessera_mesh::stats`).
pub(crate) fn step_bytes(
    before: &Layout,
    after: &Layout,
    mesh_dim: Option<usize>,
    kind: StepKind,
    coord: &[usize],
) -> Result<u64> {
    let esize = before.dtype.size_in_bytes();
    let n = mesh_dim.map_or(before.mesh_shape.iter().product(), |m| before.mesh_shape[m]);
    let bytes = match kind {
        StepKind::AllGather { .. } => OpKind::AllGather.bytes_sent(n, after.region(coord)?.numel() * esize),
        StepKind::ReduceScatter { .. } => OpKind::ReduceScatter.bytes_sent(n, before.region(coord)?.numel() * esize),
        StepKind::AllReduce { .. } | StepKind::AllReduceMesh { .. } => {
            OpKind::AllReduce.bytes_sent(n, before.region(coord)?.numel() * esize)
        }
        StepKind::AllToAll { .. } | StepKind::AllToAllMesh => {
            let mine = before.region(coord)?;
            let mut off_rank = 0;
            for (q, peer) in super::group_coords(&before.mesh_shape, coord, mesh_dim)
                .iter()
                .enumerate()
            {
                if q != super::group_index(&before.mesh_shape, coord, mesh_dim) {
                    off_rank += mine.intersect(&after.region(peer)?).numel();
                }
            }
            (off_rank * esize) as u64
        }
        StepKind::Slice { .. } | StepKind::Partition { .. } => 0,
    };
    Ok(bytes)
}
