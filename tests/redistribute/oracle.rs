//! The planner against the exhaustive oracle (`dtensor::testing::oracle`): on every
//! small mesh and shape below, for (source, target) pairs of layouts, the plan
//! moves exactly the fewest bytes any sequence of per-dim or flattened-group steps
//! can, in no more collectives than the best such sequence.
//!
//! CI checks every pair on 1-D and 2-D meshes and a fixed sample on 3-D ones;
//! `TESSERA_ORACLE_ALL=1` checks every pair everywhere.

use tessera::ReduceOp;
use tessera::dtensor::Placement::{self, Partial, Replicate as R, Shard as S};
use tessera::dtensor::redistribute::plan;
use tessera::dtensor::testing::oracle::{Cost, Oracle};
use tessera::dtensor::{DType, Layout};

const SUM: ReduceOp = ReduceOp::Sum;

/// Whether redistribute accepts the pair (no `Shard → Partial`, no change of a
/// pending reduction).
fn allowed(src: &Layout, dst: &Layout) -> bool {
    src.placements.iter().zip(&dst.placements).all(|(a, b)| match (a, b) {
        (Placement::Shard(_), Placement::Partial(_)) => false,
        (Placement::Partial(x), Placement::Partial(y)) => x == y,
        _ => true,
    })
}

/// Checks the planner on the pairs of one configuration (every `stride`-th pair),
/// returning (layouts, steps in the graph, pairs checked).
fn check(mesh: &[usize], shape: &[usize], ops: &[ReduceOp], stride: usize) -> (usize, usize, usize) {
    let oracle = Oracle::new(mesh, shape, DType::F32, ops).unwrap();
    let layouts: Vec<Layout> = oracle.layouts().cloned().collect();
    let coord = vec![0; mesh.len()];
    let mut checked = 0;
    let mut k = 0usize;
    for src in &layouts {
        let best = oracle.cheapest_from(src);
        for (dst, best) in layouts.iter().zip(&best) {
            if !allowed(src, dst) {
                continue;
            }
            k += 1;
            if !k.is_multiple_of(stride) {
                continue;
            }
            let best = best.unwrap_or_else(|| panic!("oracle cannot reach {dst:?} from {src:?}"));
            let p = plan(src, dst, &coord).unwrap();
            let got = oracle
                .price(&p)
                .unwrap_or_else(|e| panic!("mesh {mesh:?}, shape {shape:?}: {e}"));
            let route = || {
                let r = oracle.cheapest_route(src, dst).unwrap_or_default();
                r.iter()
                    .map(|l| format!("{:?} {:?}", l.placements, l.order))
                    .collect::<Vec<_>>()
                    .join("\n")
            };
            assert_eq!(
                got.bytes,
                best.bytes,
                "mesh {mesh:?}, shape {shape:?}: the plan moves {} bytes/rank, the oracle's best {}:\n{p}\n{src:?}\n{dst:?}\nthe oracle's route:\n{}",
                got.bytes_per_rank(oracle_ranks(mesh)),
                best.bytes_per_rank(oracle_ranks(mesh)),
                route()
            );
            assert!(
                got.collectives <= best.collectives,
                "mesh {mesh:?}, shape {shape:?}: {} collectives, the oracle's best at these bytes {}:\n{p}\nthe oracle's route:\n{}",
                got.collectives,
                best.collectives,
                route()
            );
            checked += 1;
        }
    }
    (layouts.len(), oracle.edge_count(), checked)
}

fn oracle_ranks(mesh: &[usize]) -> usize {
    mesh.iter().product()
}

fn all_pairs() -> bool {
    std::env::var("TESSERA_ORACLE_ALL").is_ok_and(|v| v == "1")
}

fn run(configs: &[(&[usize], &[usize], &[ReduceOp])], stride: usize) {
    let stride = if all_pairs() { 1 } else { stride };
    for (mesh, shape, ops) in configs {
        let (layouts, edges, pairs) = check(mesh, shape, ops, stride);
        println!(
            "mesh {mesh:?}, shape {shape:?}, ops {ops:?}: {layouts} layouts, {edges} steps, {pairs} pairs checked"
        );
        assert!(pairs > 0);
    }
}

#[test]
fn one_dim_meshes_every_pair() {
    run(
        &[
            (&[4], &[5], &[SUM]),
            (&[4], &[4, 6], &[SUM]),
            (&[3], &[7, 2], &[ReduceOp::Max]),
            (&[2], &[3, 2, 5], &[SUM, ReduceOp::Avg]),
        ],
        1,
    );
}

#[test]
fn two_dim_meshes_every_pair() {
    run(
        &[
            (&[2, 2], &[4, 6], &[SUM]),
            (&[2, 2], &[5, 3], &[SUM]),
            (&[4, 2], &[8, 6], &[SUM]),
            (&[2, 3], &[5, 7], &[SUM]),
            (&[4, 1], &[8, 8], &[SUM]),
            (&[2, 2], &[3, 2, 5], &[SUM]),
        ],
        1,
    );
}

#[test]
fn three_dim_meshes_sampled() {
    run(
        &[
            (&[2, 2, 2], &[8, 8], &[SUM]),
            (&[2, 2, 2], &[5, 3], &[SUM]),
            (&[2, 1, 2], &[4, 6], &[SUM]),
            (&[2, 2, 2], &[4, 3, 5], &[SUM]),
            // Dims the mesh size divides (searched as one tree for every such
            // size) beside dims it does not.
            (&[2, 2, 2], &[8, 3, 5], &[SUM]),
        ],
        11,
    );
}

/// A 4-D tensor on a 2×2×2 mesh: 296 layouts, 29,006 one-collective steps. Every
/// 97th pair (the oracle's enumeration dominates: about 20 s in the test profile).
#[test]
fn three_dim_mesh_four_dim_tensor_sampled() {
    run(&[(&[2, 2, 2], &[16, 3, 8, 2], &[SUM])], 97);
}

/// The cases named when the oracle was written, with the bytes per rank of the
/// greedy per-dim planner before it, the oracle's best and the plan's.
#[test]
fn named_cases() {
    let p = Partial(SUM);
    // f32, so an (8, 8, 8) tensor is 2048 bytes.
    type Case = (&'static [usize], &'static [usize], Vec<Placement>, Vec<Placement>, f64);
    let cases: [Case; 4] = [
        // Gather mesh dim 0, then dim 2, then two slices: 512 + 1024 bytes.
        (&[2, 2, 2], &[8, 8, 8], vec![S(1), R, S(0)], vec![R, S(0), S(0)], 1536.0),
        // One all_reduce per mesh dim: 2 · 1/2 · 2048, twice.
        (&[2, 2, 2], &[8, 8, 8], vec![p, R, p], vec![R, R, R], 4096.0),
        // all_reduce dim 0, all_reduce dim 2 (1024 each), all_gather dim 1 (1024).
        (&[2, 2, 2], &[8, 8, 8], vec![p, S(0), p], vec![R, R, R], 3072.0),
        // A one-rank mesh dim: nothing moves either way, but no collective now.
        (&[4, 1], &[8, 8], vec![S(0), S(1)], vec![S(0), S(0)], 0.0),
    ];
    for (mesh, shape, a, b, greedy) in cases {
        let src = Layout::new(mesh, &a, shape, DType::F32).unwrap();
        let dst = Layout::new(mesh, &b, shape, DType::F32).unwrap();
        let oracle = Oracle::new(mesh, shape, DType::F32, &[SUM]).unwrap();
        let best: Cost = oracle.cheapest_from(&src)[oracle.layouts().position(|l| *l == dst).unwrap()].unwrap();
        let p = plan(&src, &dst, &vec![0; mesh.len()]).unwrap();
        let got = oracle.price(&p).unwrap();
        let n = oracle_ranks(mesh);
        println!(
            "{mesh:?} {shape:?}: greedy {greedy} bytes/rank, oracle {} ({} collectives), plan {} ({} collectives)\n{p}",
            best.bytes_per_rank(n),
            best.collectives,
            got.bytes_per_rank(n),
            got.collectives
        );
        assert_eq!(got, best);
        assert!(got.bytes_per_rank(n) <= greedy);
        assert_eq!(p.collectives(), got.collectives as usize);
    }
}
