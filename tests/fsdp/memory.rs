//! Memory: the peak bytes of an FSDP training step against a term-by-term bound and
//! the replicated peak, and the replicated parameters `fully_shard` frees.

use tessera::autograd::nn::{Materializer, Module};
use tessera::autograd::optim::{AdamW, Optimizer};
use tessera::autograd::{Var, backward};
use tessera::data::{DATA_SEED, batch as data_batch};
use tessera::dtensor::{Placement, Tensor, distribute_tensor};
use tessera::fsdp::FsdpConfig;
use tessera::models::{Transformer, TransformerConfig};
use tessera::tensor::memory::{reset_peak, stats};
use tessera::{DType, DeviceMesh, launch};

use crate::common::adamw;

/// Bigger than TINY so that parameters dominate: dim 128, 4 blocks.
const CFG: TransformerConfig = TransformerConfig {
    vocab: 256,
    dim: 128,
    n_layers: 4,
    n_heads: 4,
    seq: 32,
};
const WORLD: usize = 4;
/// Tokens per row (inputs), rows per rank.
const T: usize = 32;
const ROWS: usize = 1;
const F32: usize = 4;

struct Mem {
    /// Current bytes after building the replicated model, and after `fully_shard`.
    built: usize,
    sharded: usize,
    /// Current bytes when the measured step starts.
    base: usize,
    /// Peaks of the measured step's forward, backward and optimizer step.
    phases: [usize; 3],
    /// Per unit (blocks, then root): sharded and unsharded bytes.
    units: Vec<(usize, usize)>,
}

impl Mem {
    fn peak(&self) -> usize {
        self.phases.into_iter().max().unwrap()
    }
}

/// Three AdamW steps of `CFG` on 4 ranks, one row of 33 tokens per rank;
/// measures step 2 (the optimizer state exists since step 0).
fn measure(fsdp: bool) -> Vec<Mem> {
    launch(WORLD, move |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), &[WORLD])?;
        let model = Transformer::new(CFG, &mesh, DType::F32)?;
        // Materialised replicated first, to measure what fully_shard frees.
        Materializer::from_seed(0).materialize(&model)?;
        let built = stats().current_bytes;
        let mut units = Vec::new();
        if fsdp {
            let u = model.fully_shard(&mesh, &FsdpConfig::default())?;
            for m in u.blocks.iter().chain([&u.root]) {
                units.push((m.sharded_bytes(), m.unsharded_bytes()));
            }
        }
        let sharded = stats().current_bytes;
        let mut opt = AdamW::new(model.parameters(), adamw())?;
        let mut mem = None;
        for step in 0..3u64 {
            let toks = data_batch(DATA_SEED, step, 0..(WORLD * ROWS) as u64, T + 1, CFG.vocab as u64);
            let rows = Tensor::from_vec(toks, &[WORLD * ROWS, T + 1])?;
            let rows = Var::constant(distribute_tensor(&rows, &mesh, &[Placement::Shard(0)])?);
            let base = stats().current_bytes;
            reset_peak();
            let loss = model.loss(&rows)?;
            let fwd = stats().peak_bytes;
            reset_peak();
            backward(&loss)?;
            drop(loss);
            let bwd = stats().peak_bytes;
            reset_peak();
            opt.step()?;
            opt.zero_grad();
            let opt_peak = stats().peak_bytes;
            mem = Some(Mem {
                built,
                sharded,
                base,
                phases: [fwd, bwd, opt_peak],
                units: units.clone(),
            });
        }
        Ok(mem.unwrap())
    })
    .unwrap()
}

/// Bytes of one rank's padded shards of every parameter (`ceil(rows / W)` rows each).
fn sharded_state_bytes() -> usize {
    let (d, v, s) = (CFG.dim, CFG.vocab, CFG.seq);
    let shard = |rows: usize, cols: usize| rows.div_ceil(WORLD) * cols * F32;
    // [rows, cols] of every parameter: norms and biases are [n] = [n, 1].
    let block = [
        (d, 1),
        (d, 1),
        (d, d),
        (d, d),
        (d, d),
        (d, d),
        (d, 1),
        (d, 1),
        (4 * d, d),
        (4 * d, 1),
    ]
    .iter()
    .chain(&[(d, 4 * d), (d, 1)])
    .map(|&(r, c)| shard(r, c))
    .sum::<usize>();
    let root = shard(v, d) + shard(s, d) + 2 * shard(d, 1) + shard(v, d);
    CFG.n_layers * block + root
}

/// The most bytes one FSDP rank should hold during a training step, term by term:
///
/// - sharded state: parameters, gradients, AdamW's two moments: `4·S`;
/// - the root unit's unsharded parameters (kept from forward into backward) and
///   the unsharded gradients of the root parameters that get theirs first (the
///   output projection; at most the whole root): `2·U_root`;
/// - the saved activations of the whole forward (`A`, below);
/// - the block working set: the block computing and the one prefetched
///   (`2·U_block`), in backward the computing block's unsharded gradients and
///   their reduce-scatter copy-in (`2·U_block`), and the previous block's
///   reduce-scatter still in flight (its `W`-rank input charge and output
///   shard, `(W+1)/W·U_block`);
/// - activation gradients alive at once in a block's backward: the two
///   `4·dim`-wide FFN activations' and the residual stream's, `(2·4d + d)·T·b·4`.
///
/// Saved activations per rank (`b` rows of `T` tokens, f32): per block the two
/// norm outputs, q, k, v, the attention output (a copy after the head
/// permute), the residual `h`, the FFN's `w1` output and GELU output (`4·d`
/// wide each) and the block output: `16·T·d` elements, plus the attention
/// probabilities `H·T²`; outside the blocks the embedding output, the final norm
/// output and the logits (`T·V`):
/// `A = 4·b·(L·(16·T·d + H·T²) + 2·T·d + T·V)`.
fn bound(state: usize, u_block: usize, u_root: usize) -> (usize, usize) {
    let (d, v, h, l) = (CFG.dim, CFG.vocab, CFG.n_heads, CFG.n_layers);
    let act = F32 * ROWS * (l * (16 * T * d + h * T * T) + 2 * T * d + T * v);
    let act_grads = F32 * ROWS * (2 * 4 * d + d) * T;
    let working = 4 * u_block + u_block * (WORLD + 1) / WORLD;
    (4 * state + 2 * u_root + act + working + act_grads, act)
}

#[test]
fn fsdp_peak_is_bounded() {
    let fsdp = measure(true);
    let replicated = measure(false);
    let s = sharded_state_bytes();
    let (d, v) = (CFG.dim, CFG.vocab);
    let u_block = (12 * d * d + 9 * d) * F32;
    let u_root = (2 * v * d + CFG.seq * d + 2 * d) * F32;
    let f = &fsdp[0];
    let want_units: Vec<(usize, usize)> = (0..CFG.n_layers)
        .map(|_| (u_block / WORLD, u_block))
        .chain([(u_root / WORLD, u_root)])
        .collect();
    assert_eq!(f.units, want_units, "sharded and unsharded bytes per unit");
    assert_eq!(f.units.iter().map(|u| u.0).sum::<usize>(), s);
    assert_eq!(s * WORLD, CFG.num_params() * F32);
    let (limit, act) = bound(s, u_block, u_root);
    let r = &replicated[0];
    println!(
        "memory: S = {s} B sharded state per rank, U_block = {u_block} B, U_root = {u_root} B, \
         activations A = {act} B"
    );
    println!("memory: FSDP bound = {limit} B");
    println!(
        "memory: FSDP W4 peak {} B (forward {}, backward {}, optimizer {}; step start {})",
        f.peak(),
        f.phases[0],
        f.phases[1],
        f.phases[2],
        f.base
    );
    println!(
        "memory: replicated peak {} B (forward {}, backward {}, optimizer {}; step start {})",
        r.peak(),
        r.phases[0],
        r.phases[1],
        r.phases[2],
        r.base
    );
    println!(
        "memory: FSDP peak / bound = {:.3}, FSDP peak / replicated peak = {:.3}",
        f.peak() as f64 / limit as f64,
        f.peak() as f64 / r.peak() as f64
    );
    for (rank, (f, r)) in fsdp.iter().zip(&replicated).enumerate() {
        // At the step's start: sharded parameters and both moments, nothing else
        // (a few hundred bytes of token rows aside).
        assert!(
            f.base >= 3 * s && f.base <= 3 * s + 4096,
            "rank {rank}: step starts at {} B",
            f.base
        );
        assert!(
            f.peak() <= limit,
            "rank {rank}: FSDP peak {} B over the bound {limit} B",
            f.peak()
        );
        assert!(
            10 * f.peak() < 6 * r.peak(),
            "rank {rank}: FSDP peak {} B not below 0.6 × the replicated peak {} B",
            f.peak(),
            r.peak()
        );
    }
}

/// `fully_shard` keeps only this rank's rows: right after it, a rank holds
/// `S` bytes of parameters, not the whole model.
#[test]
fn fully_shard_frees_the_replicated_parameters() {
    let f = measure(true);
    let s = sharded_state_bytes();
    for (rank, m) in f.iter().enumerate() {
        println!(
            "memory after fully_shard, rank {rank}: {} B (built {} B, S = {s} B)",
            m.sharded, m.built
        );
        assert_eq!(m.built, CFG.num_params() * F32);
        assert!(
            m.sharded <= s,
            "rank {rank}: {} B after fully_shard, {s} B sharded",
            m.sharded
        );
    }
}

/// A step after the first two (which create the optimizer's state) asks for
/// the same large buffers the step before gave back: its requests of 256 KiB
/// or more are served by the rank's pool (no fresh pages), and what the pool
/// keeps counts as reserved, not in use. (The rank's communication thread
/// takes the prefetched gathers' outputs while the rank computes, so the order
/// of requests and returns varies a little from step to step: a few buffers
/// may join the pool in later steps, each one a miss once; without the pool,
/// each of a step's 37 requests would be fresh memory.)
#[test]
fn steady_state_steps_take_every_large_buffer_from_the_pool() {
    use tessera::mesh::pool;
    // Parameters of 256 KiB and more (the gathered units and their gradient
    // buckets), logits of 512 KiB per rank.
    const BIG: TransformerConfig = TransformerConfig {
        vocab: 2048,
        dim: 256,
        n_layers: 2,
        n_heads: 4,
        seq: 64,
    };
    const W: usize = 2;
    let per_rank = launch(W, move |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), &[W])?;
        let model = Transformer::new(BIG, &mesh, DType::F32)?;
        model.fully_shard(&mesh, &FsdpConfig::default())?;
        Materializer::from_seed(0).materialize(&model)?;
        let mut opt = AdamW::new(model.parameters(), adamw())?;
        let mut per_step = Vec::new();
        for step in 0..8u64 {
            let toks = data_batch(DATA_SEED, step, 0..W as u64, BIG.seq + 1, BIG.vocab as u64);
            let rows = Tensor::from_vec(toks, &[W, BIG.seq + 1])?;
            let rows = Var::constant(distribute_tensor(&rows, &mesh, &[Placement::Shard(0)])?);
            let before = pool::stats();
            let loss = model.loss(&rows)?;
            backward(&loss)?;
            drop(loss);
            opt.step()?;
            opt.zero_grad();
            let after = pool::stats();
            per_step.push((after.hits - before.hits, after.misses - before.misses));
        }
        let s = stats();
        Ok((per_step, s.current_bytes, s.reserved_bytes, pool::stats().kept_bytes))
    })
    .unwrap();
    for (rank, (per_step, current, reserved, kept)) in per_rank.iter().enumerate() {
        println!("rank {rank}: (hits, misses) per step {per_step:?}; {current} B in use, {reserved} B reserved");
        let steady: u64 = per_step[2..].iter().map(|&(_, misses)| misses).sum();
        assert!(
            steady <= 6,
            "rank {rank}: steady-state steps allocated fresh {steady} times: {per_step:?}"
        );
        for &(hits, _) in &per_step[2..] {
            assert!(
                hits >= 32,
                "rank {rank}: the step's large buffers come from the pool: {per_step:?}"
            );
        }
        assert!(per_step[0].1 > 0, "the first step allocates fresh: {per_step:?}");
        assert_eq!(*reserved, current + kept, "rank {rank}: reserved = in use + kept");
        assert!(*kept > 0);
    }
}
