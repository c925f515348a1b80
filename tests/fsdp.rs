//! `tessera-fsdp` end to end: FSDP, HSDP and DDP-shaped meshes train the tiny
//! reference Transformer exactly as PyTorch's FSDP2 does (loss at every step against
//! `tests/data/tiny_reference.json`), with the collectives per step FSDP2 issues, the
//! memory it promises, and errors for configurations it cannot serve.
//!
//! Every distributed result is compared with a reference: PyTorch's losses, or the
//! same model trained replicated (no FSDP) on the same ranks.
//!
//! Run with `cargo test --test fsdp -- --nocapture` to see the figures (parity
//! differences, collective counts, memory bound and peaks).

mod common;

use std::cell::RefCell;
use std::ops::Range;

use common::{adamw, reference_losses, tiny_model, tokens};
use tessera::autograd::nn::{Linear, Module};
use tessera::autograd::optim::{AdamW, Optimizer, Sgd, SgdConfig};
use tessera::autograd::{Error, Param, Var, backward, load_state_dict};
use tessera::dtensor::{DTensor, Placement, Tensor, distribute_tensor};
use tessera::fsdp::{FsdpConfig, FsdpModule, MixedPrecisionPolicy, fully_shard};
use tessera::mesh::{CommCounts, OpKind};
use tessera::models::{FsdpUnits, Transformer, TransformerConfig};
use tessera::{BoxError, Communicator, DType, DeviceMesh, launch};

// ----- shared helpers ---------------------------------------------------------

type TestResult<T> = Result<T, BoxError>;

/// Rows `rows` of step `step`, `[rows.len(), 33]`, split over every mesh dim (`Shard(0)`).
fn batch(toks: &Tensor, step: usize, rows: Range<usize>, mesh: &DeviceMesh) -> TestResult<Var> {
    let n = rows.len();
    let t = toks.narrow(0, step, 1)?.narrow(1, rows.start, n)?.reshape(&[n, 33])?;
    Ok(Var::constant(distribute_tensor(
        &t,
        mesh,
        &vec![Placement::Shard(0); mesh.ndim()],
    )?))
}

fn scalar(v: &Var) -> TestResult<f64> {
    Ok(v.value().full_tensor()?.to_f64_vec()[0])
}

fn max_abs_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len(), "lengths differ");
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max)
}

/// A mesh of `shape` over the rank's world communicator (named when `names` is given).
fn mesh_of(comm: Box<dyn Communicator>, shape: &[usize], names: Option<&[&str]>) -> TestResult<DeviceMesh> {
    Ok(match names {
        Some(n) => DeviceMesh::with_names(comm, shape, n)?,
        None => DeviceMesh::new(comm, shape)?,
    })
}

/// (all_gather, reduce_scatter, all_reduce, every other data-moving collective) calls.
fn calls(c: &CommCounts) -> (u64, u64, u64, u64) {
    let ag = c.calls(OpKind::AllGather);
    let rs = c.calls(OpKind::ReduceScatter);
    let ar = c.calls(OpKind::AllReduce);
    (ag, rs, ar, c.total_calls() - ag - rs - ar)
}

/// Full (replicated) values of `params`' gradients, by name; `None` for no gradient.
fn full_grads(params: &[Param]) -> TestResult<Vec<(String, Option<Vec<f64>>)>> {
    params
        .iter()
        .map(|p| {
            let g = match p.grad() {
                Some(g) => Some(g.full_tensor()?.to_f64_vec()),
                None => None,
            };
            Ok((p.name().to_string(), g))
        })
        .collect()
}

/// Full values of `params`, by name.
fn full_values(params: &[Param]) -> TestResult<Vec<(String, Vec<f64>)>> {
    params
        .iter()
        .map(|p| Ok((p.name().to_string(), p.value().full_tensor()?.to_f64_vec())))
        .collect()
}

/// The largest difference between two named lists of values (names must agree).
fn max_named_diff(a: &[(String, Vec<f64>)], b: &[(String, Vec<f64>)]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|((na, va), (nb, vb))| {
            assert_eq!(na, nb);
            max_abs_diff(va, vb)
        })
        .fold(0.0, f64::max)
}

/// The message of an error that must occur.
fn err_msg<T>(r: Result<T, Error>, what: &str) -> String {
    match r {
        Ok(_) => panic!("{what}: expected an error"),
        Err(e) => e.to_string(),
    }
}

fn no_setup(_: &FsdpUnits) {}

/// One training run of the tiny reference model.
#[derive(Clone)]
struct Job {
    mesh: &'static [usize],
    names: Option<&'static [&'static str]>,
    /// Global batch (rows of `tokens[step]`).
    g: usize,
    steps: usize,
    /// `None`: no FSDP (replicated parameters, data parallel through DTensor).
    fsdp: Option<FsdpConfig>,
    /// Runs on the units after `fully_shard`.
    setup: fn(&FsdpUnits),
}

impl Job {
    fn fsdp(mesh: &'static [usize], g: usize, steps: usize, cfg: FsdpConfig) -> Job {
        Job {
            mesh,
            names: None,
            g,
            steps,
            fsdp: Some(cfg),
            setup: no_setup,
        }
    }
}

/// What a rank saw.
#[derive(Debug, PartialEq)]
struct Run {
    losses: Vec<f64>,
    /// Collectives of each step's `model.loss` (forward).
    fwd: Vec<CommCounts>,
    /// Collectives of each step's `backward`.
    bwd: Vec<CommCounts>,
    /// Per unit (blocks, then root): `sharded_bytes()`.
    sharded_bytes: Vec<usize>,
    /// Per unit: `placements()`.
    placements: Vec<Vec<Placement>>,
}

/// Trains `job` with the reference AdamW; checks every rank saw the same and
/// returns rank 0's run.
fn train(job: &Job) -> Run {
    let toks = tokens();
    let world = job.mesh.iter().product();
    let job = job.clone();
    let runs = launch(world, move |ctx| {
        let mesh = mesh_of(ctx.into_comm(), job.mesh, job.names)?;
        let model = tiny_model(&mesh)?;
        let params = model.parameters();
        let mut run = Run {
            losses: Vec::new(),
            fwd: Vec::new(),
            bwd: Vec::new(),
            sharded_bytes: Vec::new(),
            placements: Vec::new(),
        };
        if let Some(cfg) = &job.fsdp {
            let units = model.fully_shard(&mesh, cfg)?;
            (job.setup)(&units);
            for u in units.blocks.iter().chain([&units.root]) {
                run.sharded_bytes.push(u.sharded_bytes());
                run.placements.push(u.placements().to_vec());
            }
        }
        let mut opt = AdamW::new(params, adamw())?;
        for step in 0..job.steps {
            let rows = batch(&toks, step, 0..job.g, &mesh)?;
            let before = mesh.stats();
            let loss = model.loss(&rows)?;
            let mid = mesh.stats();
            backward(&loss)?;
            let after = mesh.stats();
            run.fwd.push(mid - before);
            run.bwd.push(after - mid);
            run.losses.push(scalar(&loss)?);
            opt.step()?;
            opt.zero_grad();
        }
        Ok(run)
    })
    .unwrap();
    for (r, run) in runs.iter().enumerate().skip(1) {
        assert_eq!(run.losses, runs[0].losses, "rank {r} saw other losses");
        assert_eq!(run.fwd, runs[0].fwd, "rank {r} issued other forward collectives");
        assert_eq!(run.bwd, runs[0].bwd, "rank {r} issued other backward collectives");
    }
    runs.into_iter().next().unwrap()
}

fn reshard(on: bool) -> FsdpConfig {
    FsdpConfig {
        reshard_after_forward: Some(on),
        ..FsdpConfig::default()
    }
}

fn bf16() -> FsdpConfig {
    FsdpConfig {
        mp_policy: MixedPrecisionPolicy::bf16(),
        ..FsdpConfig::default()
    }
}

fn no_reshard_setter(u: &FsdpUnits) {
    u.root.set_reshard_after_forward(false);
}

// ----- 1. parity with PyTorch ---------------------------------------------------

mod parity {
    use super::*;

    /// Trains `job` and checks every step's loss against the reference run.
    fn check(label: &str, job: &Job, reference: &str, tol: f64) -> Run {
        let run = train(job);
        let want = reference_losses(reference);
        assert_eq!(run.losses.len(), job.steps);
        let d = max_abs_diff(&run.losses, &want[..job.steps]);
        println!(
            "parity {label:<28} vs {reference:<16}: max |Δloss| = {d:.3e} over {} steps",
            job.steps
        );
        for (s, (got, want)) in run.losses.iter().zip(&want).enumerate() {
            assert!(
                (got - want).abs() <= tol,
                "{label}: step {s} loss {got} vs reference {want} (tolerance {tol})"
            );
        }
        run
    }

    #[test]
    fn fsdp_w2() {
        let run = check(
            "FSDP W2",
            &Job::fsdp(&[2], 8, 20, FsdpConfig::default()),
            "fsdp_W2_G8",
            1e-5,
        );
        assert!(run.placements.iter().all(|p| p == &[Placement::Shard(0)]));
        check(
            "FSDP W2 no reshard",
            &Job::fsdp(&[2], 8, 20, reshard(false)),
            "fsdp_W2_G8",
            1e-5,
        );
    }

    #[test]
    fn fsdp_w4() {
        check(
            "FSDP W4",
            &Job::fsdp(&[4], 16, 20, FsdpConfig::default()),
            "fsdp_W4_G16",
            1e-5,
        );
        check(
            "FSDP W4 no reshard",
            &Job::fsdp(&[4], 16, 20, reshard(false)),
            "fsdp_W4_G16",
            1e-5,
        );
    }

    #[test]
    fn hsdp_2x2() {
        let run = check(
            "HSDP 2x2",
            &Job::fsdp(&[2, 2], 16, 20, FsdpConfig::default()),
            "hsdp_2x2_G16",
            1e-5,
        );
        assert!(
            run.placements
                .iter()
                .all(|p| p == &[Placement::Replicate, Placement::Shard(0)])
        );
        check(
            "HSDP 2x2 no reshard",
            &Job::fsdp(&[2, 2], 16, 20, reshard(false)),
            "hsdp_2x2_G16",
            1e-5,
        );
    }

    /// HSDP with the shard dim named, and first: `[Shard(0), Replicate]`.
    #[test]
    fn hsdp_named_shard_dim_first() {
        let job = Job {
            names: Some(&["shard", "replicate"]),
            ..Job::fsdp(
                &[2, 2],
                16,
                10,
                FsdpConfig {
                    shard_dim: Some("shard".into()),
                    ..FsdpConfig::default()
                },
            )
        };
        let run = check("HSDP 2x2 shard dim 0", &job, "hsdp_2x2_G16", 1e-5);
        assert!(
            run.placements
                .iter()
                .all(|p| p == &[Placement::Shard(0), Placement::Replicate])
        );
    }

    #[test]
    fn fsdp_w2_bf16() {
        check("FSDP W2 bf16", &Job::fsdp(&[2], 8, 20, bf16()), "fsdp_W2_G8_bf16", 1e-3);
    }
}

// ----- 2. collectives per step -------------------------------------------------

mod counts {
    use super::*;

    /// Checks every step of `run`: forward and backward (all_gather,
    /// reduce_scatter, all_reduce, other) calls.
    fn check(label: &str, run: &Run, fwd: (u64, u64, u64, u64), bwd: (u64, u64, u64, u64)) {
        println!("counts {label:<22}: forward {} | backward {}", run.fwd[1], run.bwd[1]);
        for (s, (f, b)) in run.fwd.iter().zip(&run.bwd).enumerate() {
            assert_eq!(calls(f), fwd, "{label}: forward of step {s}: {f}");
            assert_eq!(calls(b), bwd, "{label}: backward of step {s}: {b}");
        }
    }

    /// Bytes this rank sends per all-gather round of every unit: `(W−1)/W` of the
    /// gathered `[W, bucket]` buffer.
    fn gather_bytes(run: &Run, world: u64, gather_size: usize, master_size: usize) -> u64 {
        run.sharded_bytes
            .iter()
            .map(|&b| (world - 1) * (b / master_size * gather_size) as u64)
            .sum()
    }

    #[test]
    fn fsdp_reshard_after_forward() {
        let run = train(&Job::fsdp(&[2], 8, 5, FsdpConfig::default()));
        // Three units: forward gathers each; backward gathers the two blocks again
        // (the root keeps its parameters) and reduce-scatters all three.
        check("FSDP W2", &run, (3, 0, 0, 0), (2, 3, 0, 0));
        let all = gather_bytes(&run, 2, 4, 4);
        assert_eq!(run.fwd[1].bytes(OpKind::AllGather), all);
        let root = run.sharded_bytes[2] as u64;
        assert_eq!(run.bwd[1].bytes(OpKind::AllGather), all - root);
        assert_eq!(run.bwd[1].bytes(OpKind::ReduceScatter), all);
    }

    #[test]
    fn fsdp_keep_after_forward() {
        // Kept after forward (by config or by the recursive setter), every unit
        // still reshards after backward: the next forward gathers all three.
        let run = train(&Job::fsdp(&[2], 8, 5, reshard(false)));
        check("FSDP W2 no reshard", &run, (3, 0, 0, 0), (0, 3, 0, 0));
        let setter = train(&Job {
            setup: no_reshard_setter,
            ..Job::fsdp(&[2], 8, 5, FsdpConfig::default())
        });
        check("FSDP W2 setter", &setter, (3, 0, 0, 0), (0, 3, 0, 0));
        assert_eq!(setter.losses, run.losses);
    }

    #[test]
    fn hsdp() {
        let run = train(&Job::fsdp(&[2, 2], 16, 5, FsdpConfig::default()));
        check("HSDP 2x2", &run, (3, 0, 0, 0), (2, 3, 3, 0));
        let run = train(&Job::fsdp(&[2, 2], 16, 5, reshard(false)));
        check("HSDP 2x2 no reshard", &run, (3, 0, 0, 0), (0, 3, 3, 0));
    }

    #[test]
    fn bf16_gathers_half_the_bytes() {
        let f32_run = train(&Job::fsdp(&[2], 8, 3, FsdpConfig::default()));
        let bf16_run = train(&Job::fsdp(&[2], 8, 3, bf16()));
        check("FSDP W2 bf16", &bf16_run, (3, 0, 0, 0), (2, 3, 0, 0));
        for s in 0..3 {
            let (a, b) = (&f32_run, &bf16_run);
            assert_eq!(2 * b.fwd[s].bytes(OpKind::AllGather), a.fwd[s].bytes(OpKind::AllGather));
            assert_eq!(2 * b.bwd[s].bytes(OpKind::AllGather), a.bwd[s].bytes(OpKind::AllGather));
            // Gradients are reduced in f32 either way.
            assert_eq!(
                b.bwd[s].bytes(OpKind::ReduceScatter),
                a.bwd[s].bytes(OpKind::ReduceScatter)
            );
        }
        assert_eq!(
            bf16_run.fwd[0].bytes(OpKind::AllGather),
            gather_bytes(&bf16_run, 2, 2, 4)
        );
        println!(
            "counts all_gather bytes per forward: f32 {} B, bf16 {} B",
            f32_run.fwd[0].bytes(OpKind::AllGather),
            bf16_run.fwd[0].bytes(OpKind::AllGather)
        );
    }

    /// Three micro-batches, gradient sync off for the first two.
    #[test]
    fn accumulation() {
        for (shape, g, ar) in [(&[2][..], 4, 0), (&[2, 2][..], 4, 3)] {
            let acc = accumulate(shape, g, 1, |_| {});
            let c = &acc.counts[0];
            println!(
                "counts accumulation {shape:?}: micro-batches {} | {} | {}",
                c[0], c[1], c[2]
            );
            assert_eq!(calls(&c[0]), (5, 0, 0, 0), "micro-batch 1 of {shape:?}: {}", c[0]);
            assert_eq!(calls(&c[1]), (5, 0, 0, 0), "micro-batch 2 of {shape:?}: {}", c[1]);
            assert_eq!(calls(&c[2]), (5, 3, ar, 0), "micro-batch 3 of {shape:?}: {}", c[2]);
        }
    }
}

// ----- 3. gradient accumulation --------------------------------------------------

/// What a gradient-accumulation run saw (rank 0).
struct Accumulated {
    /// Per step, per micro-batch: collectives of forward plus backward.
    counts: Vec<Vec<CommCounts>>,
    /// Per step: the full gradients before the optimizer step.
    grads: Vec<Vec<(String, Option<Vec<f64>>)>>,
    /// Per step: the sum of the scaled micro-batch losses.
    losses: Vec<f64>,
}

/// `steps` SGD steps of FSDP on `mesh_shape`, each accumulating three micro-batches
/// of `g` rows (rows `k·g..(k+1)·g` of `tokens[step]`), loss scaled by 1/3, with
/// gradient sync off for the first two. `check_mid` runs after the second micro-batch.
fn accumulate(mesh_shape: &'static [usize], g: usize, steps: usize, check_mid: fn(&[Param])) -> Accumulated {
    let toks = tokens();
    let world = mesh_shape.iter().product();
    let runs = launch(world, move |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), mesh_shape)?;
        let model = tiny_model(&mesh)?;
        let params = model.parameters();
        let units = model.fully_shard(&mesh, &FsdpConfig::default())?;
        let mut opt = Sgd::new(params.clone(), sgd())?;
        let mut out = Accumulated {
            counts: Vec::new(),
            grads: Vec::new(),
            losses: Vec::new(),
        };
        for step in 0..steps {
            let mut counts = Vec::new();
            let mut total = 0.0;
            for k in 0..3 {
                units.root.set_requires_gradient_sync(k == 2);
                let rows = batch(&toks, step, k * g..(k + 1) * g, &mesh)?;
                let before = mesh.stats();
                let loss = model.loss(&rows)?.mul_scalar(1.0 / 3.0)?;
                backward(&loss)?;
                counts.push(mesh.stats() - before);
                total += scalar(&loss)?;
                if k == 1 {
                    check_mid(&params);
                }
            }
            for p in &params {
                // Reduced once, into the parameters' own (sharded) placements.
                let g = p.grad().unwrap_or_else(|| panic!("{} has no gradient", p.name()));
                assert_eq!(g.placements(), p.value().placements(), "{}", p.name());
            }
            out.counts.push(counts);
            out.grads.push(full_grads(&params)?);
            out.losses.push(total);
            opt.step()?;
            opt.zero_grad();
        }
        Ok(out)
    })
    .unwrap();
    runs.into_iter().next().unwrap()
}

fn sgd() -> SgdConfig {
    SgdConfig {
        lr: 0.5,
        momentum: 0.9,
        ..SgdConfig::default()
    }
}

/// `steps` SGD steps on the whole `3g`-row batches, with FSDP or replicated.
fn one_big_batch(mesh_shape: &'static [usize], g: usize, steps: usize, fsdp: bool) -> Accumulated {
    let toks = tokens();
    let world = mesh_shape.iter().product();
    let runs = launch(world, move |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), mesh_shape)?;
        let model = tiny_model(&mesh)?;
        let params = model.parameters();
        if fsdp {
            model.fully_shard(&mesh, &FsdpConfig::default())?;
        }
        let mut opt = Sgd::new(params.clone(), sgd())?;
        let mut out = Accumulated {
            counts: Vec::new(),
            grads: Vec::new(),
            losses: Vec::new(),
        };
        for step in 0..steps {
            let loss = model.loss(&batch(&toks, step, 0..3 * g, &mesh)?)?;
            backward(&loss)?;
            out.grads.push(full_grads(&params)?);
            out.losses.push(scalar(&loss)?);
            opt.step()?;
            opt.zero_grad();
        }
        Ok(out)
    })
    .unwrap();
    runs.into_iter().next().unwrap()
}

/// The largest gradient difference of one step (both must have every gradient).
fn grad_diff(a: &[(String, Option<Vec<f64>>)], b: &[(String, Option<Vec<f64>>)]) -> f64 {
    let unwrap = |v: &[(String, Option<Vec<f64>>)]| -> Vec<(String, Vec<f64>)> {
        v.iter()
            .map(|(n, g)| (n.clone(), g.clone().unwrap_or_else(|| panic!("{n} has no gradient"))))
            .collect()
    };
    max_named_diff(&unwrap(a), &unwrap(b))
}

mod accumulation {
    use super::*;

    fn no_grads_yet(params: &[Param]) {
        // Sync off: the gradients wait unsharded inside the units.
        for p in params {
            assert!(
                p.grad().is_none(),
                "{} has a gradient before the synced micro-batch",
                p.name()
            );
        }
    }

    #[test]
    fn equals_one_step_on_the_concatenated_batch() {
        let steps = 3;
        let acc = accumulate(&[2], 4, steps, no_grads_yet);
        let big = one_big_batch(&[2], 4, steps, true);
        let replicated = one_big_batch(&[2], 4, steps, false);
        for s in 0..steps {
            let d = grad_diff(&acc.grads[s], &big.grads[s]);
            let d_rep = grad_diff(&big.grads[s], &replicated.grads[s]);
            let scale = big.grads[s]
                .iter()
                .flat_map(|(_, g)| g.iter().flatten())
                .fold(0.0f64, |m, x| m.max(x.abs()));
            println!(
                "accumulation step {s}: max |Δgrad| accumulated vs one batch {d:.3e}, FSDP vs replicated \
                 {d_rep:.3e} (max |grad| {scale:.3e}); loss {} vs {}",
                acc.losses[s], big.losses[s]
            );
            assert!(d <= 1e-6, "step {s}: accumulated gradients differ by {d}");
            assert!(
                d_rep <= 1e-6,
                "step {s}: FSDP gradients differ from replicated by {d_rep}"
            );
            assert!((acc.losses[s] - big.losses[s]).abs() <= 1e-5);
        }
    }
}

// ----- 4. uneven and empty shards ---------------------------------------------

/// `x → tanh(fc1 x) → tanh(fc2 ·) → fc3 ·`: rows 5, 3 and 1, so on 4 ranks the
/// shards hold rows (2, 2, 1, 0), (1, 1, 1, 0) and (1, 0, 0, 0).
struct Mlp {
    fc1: Linear,
    fc2: Linear,
    fc3: Linear,
}

impl Mlp {
    fn new(mesh: &DeviceMesh) -> tessera::autograd::Result<Mlp> {
        Ok(Mlp {
            fc1: Linear::new("fc1", 2, 5, true, mesh, DType::F32, 1)?,
            fc2: Linear::new("fc2", 5, 3, true, mesh, DType::F32, 3)?,
            fc3: Linear::new("fc3", 3, 1, true, mesh, DType::F32, 5)?,
        })
    }
}

impl Module for Mlp {
    fn parameters(&self) -> Vec<Param> {
        [self.fc1.parameters(), self.fc2.parameters(), self.fc3.parameters()].concat()
    }

    fn forward(&self, x: &Var) -> tessera::autograd::Result<Var> {
        let h = self.fc1.call(x)?.tanh()?;
        let h = self.fc2.call(&h)?.tanh()?;
        self.fc3.call(&h)
    }
}

mod uneven {
    use super::*;

    #[derive(Clone, Copy, Debug, PartialEq)]
    enum Units {
        None,
        /// One unit holding everything.
        Root,
        /// One unit per layer and a root unit with no parameters of its own.
        PerLayer,
    }

    struct Out {
        losses: Vec<f64>,
        weights: Vec<(String, Vec<f64>)>,
        /// Per parameter: this rank's local shape after `fully_shard`.
        local_shapes: Vec<Vec<usize>>,
    }

    fn run(units: Units) -> Vec<Out> {
        launch(4, move |ctx| {
            let mesh = DeviceMesh::new(ctx.into_comm(), &[4])?;
            let mlp = Mlp::new(&mesh)?;
            match units {
                Units::None => {}
                Units::Root => {
                    fully_shard(&mlp, &mesh, FsdpConfig::default())?;
                }
                Units::PerLayer => {
                    for l in [&mlp.fc1, &mlp.fc2, &mlp.fc3] {
                        fully_shard(l, &mesh, FsdpConfig::default())?;
                    }
                    fully_shard(&mlp, &mesh, FsdpConfig::default())?;
                }
            }
            let local_shapes = mlp
                .parameters()
                .iter()
                .map(|p| p.value().to_local().shape().to_vec())
                .collect();
            let mut opt = AdamW::new(mlp.parameters(), adamw())?;
            let mut losses = Vec::new();
            for step in 0..3 {
                let x = Tensor::randn(&[8, 2], DType::F32, 100 + step)?;
                let x = Var::constant(distribute_tensor(&x, &mesh, &[Placement::Shard(0)])?);
                let loss = mlp.call(&x)?.square()?.mean(&[0, 1], false)?;
                backward(&loss)?;
                losses.push(scalar(&loss)?);
                opt.step()?;
                opt.zero_grad();
            }
            Ok(Out {
                losses,
                weights: full_values(&mlp.parameters())?,
                local_shapes,
            })
        })
        .unwrap()
    }

    #[test]
    fn match_the_replicated_model() {
        let replicated = run(Units::None);
        for units in [Units::Root, Units::PerLayer] {
            let out = run(units);
            // torch.chunk: ceil(rows / 4) rows per rank, trailing ranks short or empty.
            let rows = [
                [2, 2, 1, 0],
                [2, 2, 1, 0],
                [1, 1, 1, 0],
                [1, 1, 1, 0],
                [1, 0, 0, 0],
                [1, 0, 0, 0],
            ];
            let cols = [vec![2], vec![], vec![5], vec![], vec![3], vec![]];
            for (r, o) in out.iter().enumerate() {
                for (i, shape) in o.local_shapes.iter().enumerate() {
                    let mut want = vec![rows[i][r]];
                    want.extend(&cols[i]);
                    assert_eq!(shape, &want, "{units:?}: rank {r}, parameter {i}");
                }
            }
            let dl = max_abs_diff(&out[0].losses, &replicated[0].losses);
            let dw = max_named_diff(&out[0].weights, &replicated[0].weights);
            println!("uneven {units:?}: max |Δloss| {dl:.3e}, max |Δweight| {dw:.3e} after 3 AdamW steps");
            assert!(dl <= 1e-6, "{units:?}: losses differ by {dl}");
            assert!(dw <= 1e-6, "{units:?}: weights differ by {dw}");
            for o in &out[1..] {
                assert_eq!(o.losses, out[0].losses);
                assert_eq!(o.weights, out[0].weights);
            }
        }
    }
}

// ----- 5. a one-rank shard dim: DDP ----------------------------------------------

mod ddp {
    use super::*;

    #[test]
    fn mesh_4x1_all_reduces_only() {
        let ddp = train(&Job::fsdp(&[4, 1], 16, 20, FsdpConfig::default()));
        let fsdp = train(&Job::fsdp(&[4], 16, 20, FsdpConfig::default()));
        // The same model without FSDP on the same mesh: what the model itself issues.
        let plain = train(&Job {
            fsdp: None,
            ..Job::fsdp(&[4, 1], 16, 1, FsdpConfig::default())
        });
        println!(
            "counts DDP [4, 1]: forward {} | backward {} (no FSDP on [4, 1]: forward {})",
            ddp.fwd[1], ddp.bwd[1], plain.fwd[0]
        );
        // The batch is `[Shard(0), Shard(0)]`: narrowing it to inputs and targets
        // gathers over the one-rank dim (two all_gather calls of 0 bytes, issued by
        // DTensor's narrow, with or without FSDP). FSDP adds no gather and no scatter.
        assert_eq!(plain.fwd[0].bytes(OpKind::AllGather), 0);
        for (s, (f, b)) in ddp.fwd.iter().zip(&ddp.bwd).enumerate() {
            assert_eq!(calls(f), calls(&plain.fwd[0]), "forward of step {s}: {f}");
            assert_eq!(
                f.calls(OpKind::ReduceScatter) + f.calls(OpKind::AllReduce),
                0,
                "forward of step {s}: {f}"
            );
            assert_eq!(f.bytes(OpKind::AllGather), 0, "forward of step {s}: {f}");
            assert_eq!(calls(b), (0, 0, 3, 0), "backward of step {s}: {b}");
        }
        let d = max_abs_diff(&ddp.losses, &fsdp.losses);
        let d_ref = max_abs_diff(&ddp.losses, &reference_losses("fsdp_W4_G16"));
        println!("parity DDP [4, 1] vs FSDP W4: max |Δloss| = {d:.3e}; vs fsdp_W4_G16 {d_ref:.3e} over 20 steps");
        assert!(d <= 1e-6, "DDP and FSDP losses differ by {d}");
        assert!(d_ref <= 1e-5);
    }
}

// ----- 6. memory ---------------------------------------------------------------

mod memory {
    use super::*;
    use tessera::data::{DATA_SEED, batch as data_batch};
    use tessera::dtensor::memory::{reset_peak, stats};

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
            let model = Transformer::new(CFG, &mesh, DType::F32, 0)?;
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
}

// ----- 7. resharding and freed parameters --------------------------------------

/// A linear layer that keeps the weight it used in forward (the unit's unsharded
/// stand-in), to look at it after forward.
struct Stash {
    lin: Linear,
    seen: RefCell<Option<Var>>,
}

impl Module for Stash {
    fn parameters(&self) -> Vec<Param> {
        self.lin.parameters()
    }

    fn forward(&self, x: &Var) -> tessera::autograd::Result<Var> {
        let w = self.lin.weight.var();
        *self.seen.borrow_mut() = Some(w.clone());
        x.linear(&w, self.lin.bias.as_ref().map(Param::var).as_ref())
    }
}

mod resharding {
    use super::*;

    fn states(u: &FsdpUnits) -> (Vec<bool>, bool) {
        (
            u.blocks.iter().map(FsdpModule::is_unsharded).collect(),
            u.root.is_unsharded(),
        )
    }

    #[test]
    fn after_forward_and_backward() {
        let toks = tokens();
        launch(2, move |ctx| {
            let mesh = DeviceMesh::new(ctx.into_comm(), &[2])?;
            let model = tiny_model(&mesh)?;
            let units = model.fully_shard(&mesh, &FsdpConfig::default())?;
            assert_eq!(states(&units), (vec![false, false], false), "before any forward");
            // Default: blocks free their parameters after forward, the root keeps them.
            let loss = model.loss(&batch(&toks, 0, 0..8, &mesh)?)?;
            assert_eq!(states(&units), (vec![false, false], true), "after forward");
            backward(&loss)?;
            assert_eq!(states(&units), (vec![false, false], false), "after backward");
            // Kept after forward (the recursive setter): every unit still reshards after backward.
            units.root.set_reshard_after_forward(false);
            let loss = model.loss(&batch(&toks, 1, 0..8, &mesh)?)?;
            assert_eq!(states(&units), (vec![true, true], true), "after forward, kept");
            backward(&loss)?;
            assert_eq!(states(&units), (vec![false, false], false), "after backward, kept");
            // And back on: `Some(true)` also frees the root's after forward.
            units.root.set_reshard_after_forward(true);
            let loss = model.loss(&batch(&toks, 2, 0..8, &mesh)?)?;
            assert_eq!(
                states(&units),
                (vec![false, false], false),
                "after forward, all resharded"
            );
            let before = mesh.stats();
            backward(&loss)?;
            let c = mesh.stats() - before;
            assert_eq!(calls(&c), (3, 3, 0, 0), "backward gathers every unit again: {c}");
            assert_eq!(states(&units), (vec![false, false], false));
            Ok(())
        })
        .unwrap();
    }

    #[test]
    fn manual_unshard_and_reshard() {
        let toks = tokens();
        launch(2, move |ctx| {
            let mesh = DeviceMesh::new(ctx.into_comm(), &[2])?;
            let model = tiny_model(&mesh)?;
            let units = model.fully_shard(&mesh, &FsdpConfig::default())?;
            let b = &units.blocks[0];
            let gathered = |f: &dyn Fn() -> tessera::autograd::Result<()>| -> TestResult<CommCounts> {
                let before = mesh.stats();
                f()?;
                Ok(mesh.stats() - before)
            };
            // unshard gathers once; again is a no-op; reshard frees.
            let c = gathered(&|| {
                b.unshard()?;
                b.unshard()
            })?;
            assert_eq!(calls(&c), (1, 0, 0, 0), "{c}");
            assert_eq!(c.bytes(OpKind::AllGather), b.sharded_bytes() as u64);
            assert!(b.is_unsharded());
            b.reshard()?;
            assert!(!b.is_unsharded());
            // unshard_async issues the gather; unshard waits for it without another.
            let c = gathered(&|| b.unshard_async())?;
            assert_eq!(calls(&c), (1, 0, 0, 0), "{c}");
            assert!(!b.is_unsharded(), "in flight is not unsharded yet");
            let c = gathered(&|| b.unshard())?;
            assert_eq!(calls(&c), (0, 0, 0, 0), "{c}");
            assert!(b.is_unsharded());
            b.reshard()?;
            // Resharding a gather in flight waits for it and frees.
            b.unshard_async()?;
            b.reshard()?;
            assert!(!b.is_unsharded());
            // Unsharded before forward: forward gathers only the other two units,
            // and the step still matches the reference.
            b.unshard()?;
            let rows = batch(&toks, 0, 0..8, &mesh)?;
            let before = mesh.stats();
            let loss = model.loss(&rows)?;
            backward(&loss)?;
            let c = mesh.stats() - before;
            assert_eq!(calls(&c), (4, 3, 0, 0), "{c}");
            let want = reference_losses("fsdp_W2_G8")[0];
            assert!((scalar(&loss)? - want).abs() <= 1e-5);
            assert_eq!(states(&units), (vec![false, false], false));
            Ok(())
        })
        .unwrap();
    }

    /// The unsharded value a forward used is freed after it: reading it is an
    /// error naming the parameter; backward gathers it again.
    #[test]
    fn freed_parameter_cannot_be_read() {
        launch(2, move |ctx| {
            let mesh = DeviceMesh::new(ctx.into_comm(), &[2])?;
            let stash = Stash {
                lin: Linear::new("stash", 3, 4, true, &mesh, DType::F32, 7)?,
                seen: RefCell::new(None),
            };
            let twin = Linear::new("twin", 3, 4, true, &mesh, DType::F32, 7)?;
            let unit = fully_shard(&stash, &mesh, reshard(true))?;
            let x = Tensor::randn(&[6, 3], DType::F32, 11)?;
            let x = Var::constant(distribute_tensor(&x, &mesh, &[Placement::Shard(0)])?);
            let loss = stash.call(&x)?.square()?.mean(&[0, 1], false)?;
            assert!(!unit.is_unsharded());
            let seen = stash.seen.borrow_mut().take().unwrap();
            assert_eq!(
                seen.value().placements(),
                &[Placement::Replicate],
                "forward saw the unsharded weight"
            );
            match seen.saved().get() {
                Err(e @ Error::Freed(_)) => {
                    let msg = e.to_string();
                    assert!(msg.contains("stash.weight") && msg.contains("resharded"), "{msg}");
                }
                Err(e) => panic!("expected Freed, got {e}"),
                Ok(_) => panic!("the unsharded weight is still readable after forward"),
            }
            backward(&loss)?;
            let twin_loss = twin.call(&x)?.square()?.mean(&[0, 1], false)?;
            backward(&twin_loss)?;
            assert_eq!(scalar(&loss)?, scalar(&twin_loss)?);
            let g = full_grads(&stash.parameters())?;
            let want = full_grads(&twin.parameters())?;
            for ((n, g), (_, w)) in g.iter().zip(&want) {
                let d = max_abs_diff(g.as_ref().unwrap(), w.as_ref().unwrap());
                assert!(d <= 1e-6, "{n}: gradient differs by {d}");
            }
            Ok(())
        })
        .unwrap();
    }
}

// ----- 8. configurations FSDP refuses, and parameters it must respect ------------

/// A module that is just a list of parameters (forward: a chain of linears).
struct Params(Vec<Param>);

impl Module for Params {
    fn parameters(&self) -> Vec<Param> {
        self.0.clone()
    }

    fn forward(&self, x: &Var) -> tessera::autograd::Result<Var> {
        let mut y = x.clone();
        for p in &self.0 {
            y = y.linear(&p.var(), None)?;
        }
        Ok(y)
    }
}

mod errors {
    use super::*;

    fn param(name: &str, shape: &[usize], dtype: DType, mesh: &DeviceMesh, placement: Placement) -> TestResult<Param> {
        let full = match dtype {
            DType::I64 => Tensor::zeros(shape, dtype)?,
            _ => Tensor::randn(shape, dtype, 3)?,
        };
        let placements = vec![placement; mesh.ndim()];
        Ok(Param::new(name, distribute_tensor(&full, mesh, &placements)?))
    }

    /// The detail of a `fully_shard` configuration error.
    fn config_err<T>(r: tessera::autograd::Result<T>, what: &str) -> String {
        match r {
            Ok(_) => panic!("{what}: fully_shard accepted it"),
            Err(Error::Config { op, detail }) => {
                assert_eq!(op, "fully_shard", "{what}: {detail}");
                detail
            }
            Err(e) => panic!("{what}: expected a configuration error, got {e}"),
        }
    }

    #[test]
    fn bad_configurations() {
        launch(2, move |ctx| {
            let world = ctx.into_comm();
            let comm = || world.split(0, world.rank() as u32);
            let mesh = DeviceMesh::new(comm()?, &[2])?;
            let mesh2 = DeviceMesh::with_names(comm()?, &[1, 2], &["replicate", "shard"])?;
            let mesh3 = DeviceMesh::new(comm()?, &[1, 2, 1])?;
            let rep = Placement::Replicate;
            let cfg = FsdpConfig::default;
            let p = |name: &str| param(name, &[4, 3], DType::F32, &mesh, rep);
            macro_rules! case {
                ($what:expr, $result:expr, $($needle:expr),+) => {{
                    let detail = config_err($result, $what);
                    for needle in [$($needle),+] {
                        assert!(detail.contains(needle), "{}: {detail:?} does not mention {needle:?}", $what);
                    }
                }};
            }

            // A parameter shared by two modules, neither inside the other.
            let shared = p("shared.weight")?;
            let a = Params(vec![p("a.weight")?, shared.clone()]);
            let b = Params(vec![shared.clone(), p("b.weight")?]);
            fully_shard(&a, &mesh, cfg())?;
            case!(
                "overlap",
                fully_shard(&b, &mesh, cfg()),
                "shared.weight",
                "already owned",
                "a.weight"
            );
            assert_eq!(
                b.0[1].value().placements(),
                &[rep],
                "a refused module is left as it was"
            );

            // The same module twice: a leaf, and a Transformer root.
            let fc = Linear::new("fc", 3, 4, true, &mesh, DType::F32, 0)?;
            fully_shard(&fc, &mesh, cfg())?;
            case!(
                "twice",
                fully_shard(&fc, &mesh, cfg()),
                "fc.weight",
                "already fully_shard"
            );
            let model = Transformer::new(TransformerConfig::TINY, &mesh, DType::F32, 0)?;
            model.fully_shard(&mesh, &cfg())?;
            let again = err_msg(fully_shard(&model, &mesh, cfg()), "root twice");
            assert!(again.contains("already fully_shard-ed"), "root twice: {again}");
            case!(
                "blocks twice",
                model.fully_shard(&mesh, &cfg()),
                "layers.0.attention_norm.weight",
                "already fully_shard"
            );

            // Meshes FSDP cannot shard over.
            let on2 = Params(vec![param("on2.weight", &[4, 3], DType::F32, &mesh2, rep)?]);
            let dp = FsdpConfig {
                shard_dim: Some("dp".into()),
                ..cfg()
            };
            case!(
                "unknown shard dim",
                fully_shard(&on2, &mesh2, dp),
                "\"dp\"",
                "\"replicate\"",
                "\"shard\""
            );
            let on3 = Params(vec![param("on3.weight", &[4, 3], DType::F32, &mesh3, rep)?]);
            case!("3-D mesh", fully_shard(&on3, &mesh3, cfg()), "3 dims", "[1, 2, 1]");
            let elsewhere = Params(vec![p("elsewhere.weight")?]);
            case!(
                "other mesh",
                fully_shard(&elsewhere, &mesh2, cfg()),
                "elsewhere.weight",
                "mesh"
            );

            // Parameters FSDP cannot shard; nothing changes on refusal.
            let fine = p("fine.weight")?;
            let sharded = param("sharded.weight", &[4, 3], DType::F32, &mesh, Placement::Shard(0))?;
            let m = Params(vec![fine.clone(), sharded]);
            case!(
                "already sharded",
                fully_shard(&m, &mesh, cfg()),
                "sharded.weight",
                "already sharded"
            );
            assert_eq!(fine.value().placements(), &[rep], "a refused module is left as it was");
            assert!(!fine.value().to_local().shape().is_empty());
            let scalar_p = Params(vec![param("scalar", &[], DType::F32, &mesh, rep)?]);
            case!("scalar", fully_shard(&scalar_p, &mesh, cfg()), "scalar", "[1]");
            let ints = Params(vec![param("ints", &[4], DType::I64, &mesh, rep)?]);
            case!("integer", fully_shard(&ints, &mesh, cfg()), "ints", "floating-point");
            let mixed = Params(vec![
                p("f32.weight")?,
                param("f64.weight", &[4, 3], DType::F64, &mesh, rep)?,
            ]);
            case!(
                "mixed dtypes",
                fully_shard(&mixed, &mesh, cfg()),
                "f32.weight",
                "f64.weight",
                "dtype"
            );
            let x = p("x.weight")?;
            case!(
                "listed twice",
                fully_shard(&Params(vec![x.clone(), x]), &mesh, cfg()),
                "x.weight",
                "twice"
            );
            case!(
                "no parameters",
                fully_shard(&Params(vec![]), &mesh, cfg()),
                "no parameters"
            );
            Ok(())
        })
        .unwrap();
    }

    /// A parameter replaced between its unit's forward and backward (an optimizer
    /// step or `set_value` in between) makes backward fail, naming it.
    #[test]
    fn parameter_changed_between_forward_and_backward() {
        let toks = tokens();
        let errors = launch(2, move |ctx| {
            let mesh = DeviceMesh::new(ctx.into_comm(), &[2])?;
            let model = tiny_model(&mesh)?;
            model.fully_shard(&mesh, &FsdpConfig::default())?;
            let loss = model.loss(&batch(&toks, 0, 0..8, &mesh)?)?;
            let p = &model.layers[1].attention.wq.weight;
            let v = p.value();
            // The same values in a new storage.
            let copy = v.to_local().cast(DType::F64)?.cast(DType::F32)?;
            p.set_value(DTensor::from_local(copy, &mesh, v.placements(), v.shape())?);
            Ok(match backward(&loss) {
                Err(Error::Config { op: "fsdp", detail }) => detail,
                Err(e) => panic!("expected an fsdp configuration error, got {e}"),
                Ok(()) => panic!("backward accepted a parameter changed since forward"),
            })
        })
        .unwrap();
        for msg in errors {
            assert!(
                msg.contains("layers.1.attention.wq.weight") && msg.contains("changed between"),
                "{msg}"
            );
        }
    }

    /// A frozen parameter gets no gradient; its unit still reduce-scatters the
    /// others', which equal the replicated model's.
    #[test]
    fn frozen_parameter() {
        let toks = tokens();
        let run = |fsdp: bool| {
            launch(2, {
                let toks = toks.clone();
                move |ctx| {
                    let mesh = DeviceMesh::new(ctx.into_comm(), &[2])?;
                    let model = tiny_model(&mesh)?;
                    let params = model.parameters();
                    if fsdp {
                        model.fully_shard(&mesh, &FsdpConfig::default())?;
                    }
                    let frozen = &model.layers[0].attention.wq.weight;
                    frozen.set_requires_grad(false);
                    let start = frozen.value().full_tensor()?.to_f64_vec();
                    let mut opt = AdamW::new(params.clone(), adamw())?;
                    let mut out = Vec::new();
                    for step in 0..2 {
                        let rows = batch(&toks, step, 0..8, &mesh)?;
                        let before = mesh.stats();
                        let loss = model.loss(&rows)?;
                        backward(&loss)?;
                        let c = mesh.stats() - before;
                        assert!(frozen.grad().is_none(), "the frozen parameter got a gradient");
                        out.push((c, full_grads(&params)?));
                        opt.step()?;
                        opt.zero_grad();
                    }
                    assert_eq!(
                        frozen.value().full_tensor()?.to_f64_vec(),
                        start,
                        "the frozen parameter moved"
                    );
                    Ok(out)
                }
            })
            .unwrap()
            .swap_remove(0)
        };
        let fsdp = run(true);
        let replicated = run(false);
        for (step, ((c, g), (_, want))) in fsdp.iter().zip(&replicated).enumerate() {
            assert_eq!(calls(c), (5, 3, 0, 0), "step {step}: {c}");
            let mut max = 0.0f64;
            for ((n, g), (_, w)) in g.iter().zip(want) {
                match (g, w) {
                    (None, None) => assert_eq!(n, "layers.0.attention.wq.weight"),
                    (Some(g), Some(w)) => max = max.max(max_abs_diff(g, w)),
                    _ => panic!("step {step}: {n} has a gradient in one run only"),
                }
            }
            println!("frozen parameter, step {step}: max |Δgrad| FSDP vs replicated {max:.3e}");
            assert!(max <= 1e-6, "step {step}: gradients differ by {max}");
        }
    }

    /// A forward that fails inside the units leaves FSDP usable: the next steps
    /// match the model that never failed.
    #[test]
    fn failed_forward_leaves_fsdp_usable() {
        let toks = tokens();
        let losses = launch(2, move |ctx| {
            let mesh = DeviceMesh::new(ctx.into_comm(), &[2])?;
            let model = tiny_model(&mesh)?;
            let params = model.parameters();
            let units = model.fully_shard(&mesh, &FsdpConfig::default())?;
            // 34 tokens: 33 inputs, one more than the position table (fails in the root's forward).
            let long = Tensor::zeros(&[8, 35], DType::I64)?;
            let long = Var::constant(distribute_tensor(&long, &mesh, &[Placement::Shard(0)])?);
            err_msg(model.loss(&long), "too long a row");
            let mut opt = AdamW::new(params, adamw())?;
            let mut losses = Vec::new();
            for step in 0..5 {
                let rows = batch(&toks, step, 0..8, &mesh)?;
                let before = mesh.stats();
                let loss = model.loss(&rows)?;
                backward(&loss)?;
                let c = mesh.stats() - before;
                if step > 0 {
                    assert_eq!(calls(&c), (5, 3, 0, 0), "step {step}: {c}");
                }
                assert!(units.blocks.iter().chain([&units.root]).all(|u| !u.is_unsharded()));
                losses.push(scalar(&loss)?);
                opt.step()?;
                opt.zero_grad();
            }
            Ok(losses)
        })
        .unwrap();
        let d = max_abs_diff(&losses[0], &reference_losses("fsdp_W2_G8")[..5]);
        assert!(d <= 1e-5, "after a failed forward, losses differ by {d}");
    }
}

// ----- 9. explicit prefetch ----------------------------------------------------

mod prefetch {
    use super::*;

    fn explicit(u: &FsdpUnits) {
        u.blocks[0].set_modules_to_forward_prefetch(&[&u.blocks[1]]);
        u.blocks[1].set_modules_to_backward_prefetch(&[&u.blocks[0]]);
    }

    #[test]
    fn explicit_prefetch_changes_only_the_order() {
        for cfg in [FsdpConfig::default(), reshard(false)] {
            let implicit = train(&Job::fsdp(&[2], 8, 5, cfg.clone()));
            let set = train(&Job {
                setup: explicit,
                ..Job::fsdp(&[2], 8, 5, cfg.clone())
            });
            let bwd_gathers = if cfg.reshard_after_forward == Some(false) { 0 } else { 2 };
            for (s, (f, b)) in set.fwd.iter().zip(&set.bwd).enumerate() {
                assert_eq!(calls(f), (3, 0, 0, 0), "forward of step {s}: {f}");
                assert_eq!(calls(b), (bwd_gathers, 3, 0, 0), "backward of step {s}: {b}");
            }
            assert_eq!(set.fwd, implicit.fwd);
            assert_eq!(set.bwd, implicit.bwd);
            assert_eq!(set.losses, implicit.losses, "{cfg:?}");
        }
    }
}

// ----- beyond one call per unit: eval forwards, reuse, activation checkpointing ---

mod usage {
    use std::rc::Rc;

    use super::*;
    use tessera::autograd::{checkpoint, no_grad};
    use tessera::dtensor::ops::Reduction;

    /// An eval forward (no_grad) before each training step: the eval loss equals
    /// the training loss of the same step, and training still matches PyTorch.
    /// After an optimizer step the root, kept unsharded by the eval forward,
    /// gathers its updated shards again.
    #[test]
    fn eval_forward_between_steps() {
        let toks = tokens();
        let runs = launch(2, move |ctx| {
            let mesh = DeviceMesh::new(ctx.into_comm(), &[2])?;
            let model = tiny_model(&mesh)?;
            let params = model.parameters();
            let units = model.fully_shard(&mesh, &FsdpConfig::default())?;
            let mut opt = AdamW::new(params, adamw())?;
            let mut out = Vec::new();
            for step in 0..5 {
                let rows = batch(&toks, step, 0..8, &mesh)?;
                let before = mesh.stats();
                let eval = no_grad(|| model.loss(&rows))?;
                let eval_counts = mesh.stats() - before;
                assert!(!units.blocks[0].is_unsharded() && !units.blocks[1].is_unsharded());
                let before = mesh.stats();
                let loss = model.loss(&rows)?;
                backward(&loss)?;
                let train_counts = mesh.stats() - before;
                assert_eq!(
                    calls(&eval_counts),
                    (3, 0, 0, 0),
                    "eval forward of step {step}: {eval_counts}"
                );
                // The root is still gathered from the eval forward.
                assert_eq!(
                    calls(&train_counts),
                    (4, 3, 0, 0),
                    "training step {step}: {train_counts}"
                );
                out.push((scalar(&eval)?, scalar(&loss)?));
                opt.step()?;
                opt.zero_grad();
            }
            Ok(out)
        })
        .unwrap();
        let want = reference_losses("fsdp_W2_G8");
        for (step, &(eval, train)) in runs[0].iter().enumerate() {
            assert_eq!(eval, train, "step {step}");
            assert!(
                (train - want[step]).abs() <= 1e-5,
                "step {step}: {train} vs {}",
                want[step]
            );
        }
    }

    /// `x → fc1 → fc2 → fc2 → fc3` (tanh between): the fc2 unit runs twice per
    /// forward and still reduce-scatters once.
    struct Reused {
        fc1: Linear,
        fc2: Linear,
        fc3: Linear,
    }

    impl Module for Reused {
        fn parameters(&self) -> Vec<Param> {
            [self.fc1.parameters(), self.fc2.parameters(), self.fc3.parameters()].concat()
        }

        fn forward(&self, x: &Var) -> tessera::autograd::Result<Var> {
            let h = self.fc1.call(x)?.tanh()?;
            let h = self.fc2.call(&h)?.tanh()?;
            let h = self.fc2.call(&h)?.tanh()?;
            self.fc3.call(&h)
        }
    }

    #[test]
    fn unit_called_twice_per_forward() {
        let run = |fsdp: bool| {
            launch(2, move |ctx| {
                let mesh = DeviceMesh::new(ctx.into_comm(), &[2])?;
                let m = Reused {
                    fc1: Linear::new("fc1", 2, 4, true, &mesh, DType::F32, 1)?,
                    fc2: Linear::new("fc2", 4, 4, true, &mesh, DType::F32, 3)?,
                    fc3: Linear::new("fc3", 4, 1, true, &mesh, DType::F32, 5)?,
                };
                if fsdp {
                    for l in [&m.fc1, &m.fc2, &m.fc3] {
                        fully_shard(l, &mesh, FsdpConfig::default())?;
                    }
                    fully_shard(&m, &mesh, FsdpConfig::default())?;
                }
                let mut opt = AdamW::new(m.parameters(), adamw())?;
                let mut losses = Vec::new();
                for step in 0..3 {
                    let x = Tensor::randn(&[8, 2], DType::F32, 100 + step)?;
                    let x = Var::constant(distribute_tensor(&x, &mesh, &[Placement::Shard(0)])?);
                    let before = mesh.stats();
                    let loss = m.call(&x)?.square()?.mean(&[0, 1], false)?;
                    backward(&loss)?;
                    let c = mesh.stats() - before;
                    if fsdp {
                        assert_eq!(c.calls(OpKind::ReduceScatter), 3, "step {step}: {c}");
                    }
                    losses.push(scalar(&loss)?);
                    opt.step()?;
                    opt.zero_grad();
                }
                Ok((losses, full_values(&m.parameters())?))
            })
            .unwrap()
            .swap_remove(0)
        };
        let (fsdp, replicated) = (run(true), run(false));
        let dl = max_abs_diff(&fsdp.0, &replicated.0);
        let dw = max_named_diff(&fsdp.1, &replicated.1);
        assert!(dl <= 1e-6 && dw <= 1e-6, "losses differ by {dl}, weights by {dw}");
    }

    /// The tiny model with each block recomputed in backward
    /// (`checkpoint(|xs| block.call(&xs[0]))`).
    struct Checkpointed(Rc<Transformer>);

    impl Module for Checkpointed {
        fn parameters(&self) -> Vec<Param> {
            self.0.parameters()
        }

        fn forward(&self, tokens: &Var) -> tessera::autograd::Result<Var> {
            let mut h = self.0.embed(tokens)?;
            for i in 0..self.0.layers.len() {
                let model = self.0.clone();
                h = checkpoint(&[h], move |xs| model.layers[i].call(&xs[0]))?;
            }
            self.0.head(&h)
        }
    }

    /// Activation checkpointing outside the block units: FSDP2 reduce-scatters
    /// each unit once per backward, as without checkpointing.
    #[test]
    fn checkpointed_blocks_reduce_once() {
        let toks = tokens();
        let runs = launch(2, move |ctx| {
            let mesh = DeviceMesh::new(ctx.into_comm(), &[2])?;
            let model = Rc::new(tiny_model(&mesh)?);
            let ck = Checkpointed(model.clone());
            for b in &model.layers {
                fully_shard(b, &mesh, FsdpConfig::default())?;
            }
            fully_shard(&ck, &mesh, FsdpConfig::default())?;
            let mut opt = AdamW::new(ck.parameters(), adamw())?;
            let mut out = Vec::new();
            for step in 0..3 {
                let rows = batch(&toks, step, 0..8, &mesh)?;
                let before = mesh.stats();
                let logits = ck.call(&rows.narrow(1, 0, 32)?)?;
                let loss = logits.cross_entropy(&rows.narrow(1, 1, 32)?, Reduction::Mean)?;
                backward(&loss)?;
                let c = mesh.stats() - before;
                out.push((scalar(&loss)?, c));
                opt.step()?;
                opt.zero_grad();
            }
            Ok(out)
        })
        .unwrap();
        let want = reference_losses("fsdp_W2_G8");
        for (step, (loss, c)) in runs[0].iter().enumerate() {
            println!("checkpointed step {step}: loss {loss}, {c}");
            assert!(
                (loss - want[step]).abs() <= 1e-5,
                "step {step}: {loss} vs {}",
                want[step]
            );
            assert_eq!(calls(c), (5, 3, 0, 0), "step {step}: {c}");
        }
    }
}

/// Full state dicts of sharded parameters: saved from FSDP on 2 ranks (gathered,
/// one file), loaded into FSDP on 4 ranks and into HSDP 2×2 (each rank keeps its
/// rows): the full weights are the same everywhere.
mod state_dict {
    use super::*;
    use tessera::autograd::save_state_dict_full;

    fn full_weights(model: &Transformer) -> TestResult<Vec<(String, Vec<f64>)>> {
        model
            .parameters()
            .iter()
            .map(|p| Ok((p.name().to_string(), p.value().full_tensor()?.to_f64_vec())))
            .collect()
    }

    #[test]
    fn saved_on_one_mesh_loads_onto_another() {
        let dir = std::env::temp_dir().join(format!("tessera-fsdp-sd-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("model.safetensors");
        let toks = tokens();
        let saved = launch(2, {
            let path = path.clone();
            move |ctx| {
                let mesh = DeviceMesh::new(ctx.into_comm(), &[2])?;
                let model = tiny_model(&mesh)?;
                model.fully_shard(&mesh, &FsdpConfig::default())?;
                let mut opt = AdamW::new(model.parameters(), adamw())?;
                let loss = model.loss(&batch(&toks, 0, 0..8, &mesh)?)?;
                backward(&loss)?;
                opt.step()?;
                save_state_dict_full(&model.parameters(), &path)?;
                full_weights(&model)
            }
        })
        .unwrap();
        for shape in [&[4][..], &[2, 2]] {
            let loaded = launch(4, {
                let path = path.clone();
                move |ctx| {
                    let mesh = DeviceMesh::new(ctx.into_comm(), shape)?;
                    let model = Transformer::new(TransformerConfig::TINY, &mesh, DType::F32, 7)?;
                    let units = model.fully_shard(&mesh, &FsdpConfig::default())?;
                    load_state_dict(&model.parameters(), &path)?;
                    assert_eq!(
                        model.tok_embeddings.weight.value().placements(),
                        units.root.placements()
                    );
                    full_weights(&model)
                }
            })
            .unwrap();
            for rank in &loaded {
                assert_eq!(rank, &saved[0], "mesh {shape:?}");
            }
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
