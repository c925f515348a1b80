//! FSDP over tensor parallelism: the reference Transformer with TP over `tp` and
//! `fully_shard` over the data-parallel sub-mesh, on 2-D `(dp, tp)` and 3-D
//! `(dp_replicate, dp_shard, tp)` meshes: parity with PyTorch's runs, the
//! placements and round trips of the parameters, counts and bytes per unit,
//! gradient accumulation, clipping, peak memory and the errors.

use std::cell::RefCell;
use std::rc::Rc;

use tessera::autograd::nn::{Inputs, Module, ModuleHooks, ModuleId, register_module_hooks};
use tessera::autograd::optim::{AdamW, Optimizer, clip_grad_norm};
use tessera::autograd::{Param, Var, backward, read_safetensors, save_state_dict_full};
use tessera::dtensor::{Placement, ShardOrder, Tensor, distribute_tensor};
use tessera::fsdp::{FsdpConfig, MixedPrecisionPolicy};
use tessera::mesh::{CommCounts, OpKind};
use tessera::models::{Transformer, TransformerConfig};
use tessera::tensor::memory::{reset_peak, stats};
use tessera::{DeviceMesh, launch};

use crate::common::{adamw, data, reference_losses, tiny_model, tokens};
use crate::{max_abs_diff, reshard};

const DP_TP: &[&str] = &["dp", "tp"];
const HSDP_TP: &[&str] = &["dp_replicate", "dp_shard", "tp"];

/// One FSDP-over-TP run: the mesh (last dim `tp`), global batch, steps, config.
#[derive(Clone)]
struct Job {
    mesh: &'static [usize],
    names: &'static [&'static str],
    g: usize,
    steps: usize,
    cfg: FsdpConfig,
}

/// What rank 0 saw.
struct Run {
    losses: Vec<f64>,
    fwd: Vec<CommCounts>,
    bwd: Vec<CommCounts>,
    /// Per unit (blocks, then root): `(sharded_bytes, unsharded_bytes)`.
    units: Vec<(usize, usize)>,
}

/// The batch placements: `Shard(0)` on the data-parallel dims, `Replicate` on `tp`.
fn batch_placements(ndim: usize) -> Vec<Placement> {
    let mut p = vec![Placement::Shard(0); ndim];
    p[ndim - 1] = Placement::Replicate;
    p
}

/// Step `step`'s token rows `[g, 33]`, distributed over `mesh`.
fn rows(toks: &Tensor, step: usize, g: usize, mesh: &DeviceMesh) -> tessera::autograd::Result<Var> {
    let rows = toks.narrow(0, step, 1)?.narrow(1, 0, g)?.reshape(&[g, 33])?;
    Ok(Var::constant(distribute_tensor(
        &rows,
        mesh,
        &batch_placements(mesh.ndim()),
    )?))
}

/// The tiny model on `mesh` with TP over `tp` (the reference plan) and FSDP over
/// the other dims.
fn build(
    mesh: &DeviceMesh,
    names: &[&str],
    cfg: &FsdpConfig,
) -> tessera::autograd::Result<(Transformer, Vec<tessera::fsdp::FsdpModule>)> {
    let model = tiny_model(mesh)?;
    model.parallelize(&mesh.dim("tp")?, false)?;
    let dp = mesh.slice(&names[..names.len() - 1])?;
    let units = model.fully_shard(&dp, cfg)?;
    let mut all = units.blocks.clone();
    all.push(units.root);
    Ok((model, all))
}

fn train(job: &Job) -> Run {
    let toks = tokens();
    let world = job.mesh.iter().product();
    let job = job.clone();
    let mut runs = launch(world, move |ctx| {
        let mesh = DeviceMesh::with_names(ctx.into_comm(), job.mesh, job.names)?;
        let (model, units) = build(&mesh, job.names, &job.cfg)?;
        let mut opt = AdamW::new(model.parameters(), adamw())?;
        let mut run = Run {
            losses: Vec::new(),
            fwd: Vec::new(),
            bwd: Vec::new(),
            units: units.iter().map(|u| (u.sharded_bytes(), u.unsharded_bytes())).collect(),
        };
        for step in 0..job.steps {
            let x = rows(&toks, step, job.g, &mesh)?;
            let s0 = mesh.stats();
            let loss = model.loss(&x)?;
            let s1 = mesh.stats();
            backward(&loss)?;
            run.fwd.push(s1 - s0);
            run.bwd.push(mesh.stats() - s1);
            run.losses.push(loss.value().full_tensor()?.to_f64_vec()[0]);
            opt.step()?;
            opt.zero_grad();
        }
        Ok(run)
    })
    .unwrap();
    for r in &runs[1..] {
        assert_eq!(r.losses, runs[0].losses, "ranks saw different losses");
    }
    runs.swap_remove(0)
}

fn check(label: &str, losses: &[f64], reference: &str, tol: f64) {
    let want = reference_losses(reference);
    let d = max_abs_diff(losses, &want[..losses.len()]);
    println!(
        "parity {label:<34} vs {reference}: max |Δloss| = {d:.3e} over {} steps",
        losses.len()
    );
    for (s, (got, want)) in losses.iter().zip(&want).enumerate() {
        assert!((got - want).abs() <= tol, "{label}: step {s} loss {got} vs {want}");
    }
}

// ----- parity with PyTorch -----------------------------------------------------

#[test]
fn fsdp_tp_2x2_matches_pytorch() {
    for (label, cfg) in [("reshard after forward", reshard(true)), ("no reshard", reshard(false))] {
        let job = Job {
            mesh: &[2, 2],
            names: DP_TP,
            g: 8,
            steps: 20,
            cfg,
        };
        check(
            &format!("fsdp dp2 x tp2, {label}"),
            &train(&job).losses,
            "fsdp_tp_2x2_G8",
            1e-5,
        );
    }
}

#[test]
fn hsdp_tp_2x2x2_matches_pytorch() {
    for (label, cfg, steps) in [
        ("reshard after forward", reshard(true), 20),
        ("no reshard", reshard(false), 8),
    ] {
        let job = Job {
            mesh: &[2, 2, 2],
            names: HSDP_TP,
            g: 8,
            steps,
            cfg,
        };
        check(
            &format!("hsdp 2x2 x tp2, {label}"),
            &train(&job).losses,
            "hsdp_tp_2x2x2_G8",
            1e-5,
        );
    }
}

/// Trains `steps` on `mesh` in f32 and with bf16 mixed precision; checks the bf16
/// losses are within 1e-3 of the f32 ones (and differ: the policy did something).
fn bf16_and_f32(mesh: &'static [usize], names: &'static [&'static str], steps: usize) -> (Run, Run) {
    let job = |cfg| Job {
        mesh,
        names,
        g: 8,
        steps,
        cfg,
    };
    let f32_run = train(&job(FsdpConfig::default()));
    let bf16_run = train(&job(FsdpConfig {
        mp_policy: MixedPrecisionPolicy::bf16(),
        ..FsdpConfig::default()
    }));
    let d = max_abs_diff(&bf16_run.losses, &f32_run.losses);
    println!("bf16 {mesh:?} vs f32: max |Δloss| = {d:.3e} over {steps} steps");
    assert!(d < 1e-3 && d > 0.0, "{:?}\nvs {:?}", bf16_run.losses, f32_run.losses);
    (bf16_run, f32_run)
}

/// bf16 mixed precision over TP: within 1e-3 of the f32 run, and every all-gather
/// (FSDP's and TP's logits) moves half the bytes.
#[test]
fn bf16_over_tp_follows_f32() {
    let (bf16_run, f32_run) = bf16_and_f32(&[2, 2], DP_TP, 20);
    let ag = |r: &Run| r.fwd[1].bytes(OpKind::AllGather);
    assert_eq!(2 * ag(&bf16_run), ag(&f32_run));
}

// ----- counts and bytes ----------------------------------------------------------

/// `[rows, cols]` of every parameter of a block and of the root, and its TP
/// placement under the reference plan: `Some(d)` sharded on dim `d`, `None` replicated.
/// `(rows, cols, TP-sharded dim)` of one parameter.
type Shape2 = (usize, usize, Option<usize>);

fn params_tp(cfg: TransformerConfig) -> (Vec<Shape2>, Vec<Shape2>) {
    let (d, v, s) = (cfg.dim, cfg.vocab, cfg.seq);
    let block = vec![
        (d, 1, None),        // attention_norm.weight
        (d, 1, None),        // attention_norm.bias
        (d, d, Some(0)),     // wq (colwise)
        (d, d, Some(0)),     // wk
        (d, d, Some(0)),     // wv
        (d, d, Some(1)),     // wo (rowwise)
        (d, 1, None),        // ffn_norm.weight
        (d, 1, None),        // ffn_norm.bias
        (4 * d, d, Some(0)), // w1 (colwise)
        (4 * d, 1, Some(0)), // w1.bias
        (d, 4 * d, Some(1)), // w2 (rowwise)
        (d, 1, None),        // w2.bias (replicated)
    ];
    let root = vec![
        (v, d, Some(0)), // tok_embeddings (rowwise: table Shard(0))
        (s, d, Some(0)), // pos_embeddings
        (d, 1, None),    // norm.weight
        (d, 1, None),    // norm.bias
        (v, d, Some(0)), // output (colwise)
    ];
    (block, root)
}

/// Bytes of one rank's padded shards and of its unsharded (TP-local) pieces.
fn unit_bytes(params: &[Shape2], dp: usize, tp: usize) -> (usize, usize) {
    let mut sharded = 0;
    let mut unsharded = 0;
    for &(r, c, tp_dim) in params {
        let (r, c) = match tp_dim {
            Some(0) => (r.div_ceil(tp), c),
            Some(_) => (r, c.div_ceil(tp)),
            None => (r, c),
        };
        sharded += r.div_ceil(dp) * c * 4;
        unsharded += r * c * 4;
    }
    (sharded, unsharded)
}

/// Per unit, FSDP's all-gathers and reduce-scatters run over dp only, on the
/// TP-local pieces: against the same step under TP alone, FSDP adds one
/// all-gather per unit in forward (its sharded bytes), one per resharded block in
/// backward, and one reduce-scatter per unit (`dp − 1` times its sharded bytes sent).
#[test]
fn counts_and_bytes_per_unit_on_2d() {
    let cfg = TransformerConfig::TINY;
    let (dp, tp) = (2, 2);
    let (block, root) = params_tp(cfg);
    let (block_s, block_u) = unit_bytes(&block, dp, tp);
    let (root_s, root_u) = unit_bytes(&root, dp, tp);
    let run = train(&Job {
        mesh: &[2, 2],
        names: DP_TP,
        g: 8,
        steps: 2,
        cfg: FsdpConfig::default(),
    });
    let mut want_units = vec![(block_s, block_u); cfg.n_layers];
    want_units.push((root_s, root_u));
    assert_eq!(run.units, want_units, "(sharded, unsharded) bytes per unit");
    // TP alone on the same mesh (plain data parallelism over dp).
    let toks = tokens();
    let tp_only = launch(4, move |ctx| {
        let mesh = DeviceMesh::with_names(ctx.into_comm(), &[2, 2], DP_TP)?;
        let model = tiny_model(&mesh)?;
        model.parallelize(&mesh.dim("tp")?, false)?;
        let x = rows(&toks, 1, 8, &mesh)?;
        let s0 = mesh.stats();
        let loss = model.loss(&x)?;
        let s1 = mesh.stats();
        backward(&loss)?;
        Ok((s1 - s0, mesh.stats() - s1))
    })
    .unwrap()
    .swap_remove(0);
    let (fwd, bwd) = (&run.fwd[1], &run.bwd[1]);
    let units = cfg.n_layers as u64 + 1;
    let sharded_total = (cfg.n_layers * block_s + root_s) as u64;
    let ag = OpKind::AllGather;
    let rs = OpKind::ReduceScatter;
    let ar = OpKind::AllReduce;
    println!(
        "dp2 x tp2 per step: forward {} all-gathers ({} B) vs TP alone {} ({} B); backward {} all-gathers ({} B), \
         {} reduce-scatters ({} B); sharded bytes per block unit {block_s}, root {root_s}",
        fwd.calls(ag),
        fwd.bytes(ag),
        tp_only.0.calls(ag),
        tp_only.0.bytes(ag),
        bwd.calls(ag),
        bwd.bytes(ag),
        bwd.calls(rs),
        bwd.bytes(rs)
    );
    assert_eq!(fwd.calls(ag) - tp_only.0.calls(ag), units);
    assert_eq!(fwd.bytes(ag) - tp_only.0.bytes(ag), sharded_total);
    // The root keeps its parameters for backward; the blocks gather again.
    assert_eq!(bwd.calls(ag) - tp_only.1.calls(ag), cfg.n_layers as u64);
    assert_eq!(bwd.bytes(ag) - tp_only.1.bytes(ag), (cfg.n_layers * block_s) as u64);
    assert_eq!(bwd.calls(rs) - tp_only.1.calls(rs), units);
    // A rank sends (dp − 1) blocks of a reduce-scatter: one of its sharded size here.
    assert_eq!(bwd.bytes(rs) - tp_only.1.bytes(rs), (dp as u64 - 1) * sharded_total);
    // TP's all-reduces are unchanged; plain data parallelism's gradient
    // all-reduces (TP alone) are gone.
    assert_eq!(fwd.calls(ar), tp_only.0.calls(ar));
    assert!(bwd.calls(ar) < tp_only.1.calls(ar));
}

// ----- placements and round trips ------------------------------------------------

/// Records the placements a parameter shows inside a module's forward.
struct Seen {
    param: Param,
    placements: RefCell<Vec<Vec<Placement>>>,
}

impl ModuleHooks for Seen {
    fn pre_forward(&self, inputs: Inputs) -> tessera::autograd::Result<Inputs> {
        let v = self.param.var()?;
        let v = v.value();
        self.placements.borrow_mut().push(v.placements().to_vec());
        assert!(v.layout().order.is_default());
        Ok(inputs)
    }

    fn post_forward(&self, output: Var) -> tessera::autograd::Result<Var> {
        Ok(output)
    }
}

/// Each parameter keeps its TP placement on `tp` and gains `Shard(0)` on dp, the
/// dp shard splitting the TP-local piece; forward sees exactly the TP placement;
/// `full_tensor`, `redistribute` there and back, and a full state dict return the
/// reference's initial weights exactly.
#[test]
fn placements_and_round_trips() {
    let dir = std::env::temp_dir().join(format!("tessera-fsdp-tp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("full.safetensors");
    let out = path.clone();
    launch(4, move |ctx| {
        let mesh = DeviceMesh::with_names(ctx.into_comm(), &[2, 2], DP_TP)?;
        let model = tiny_model(&mesh)?;
        let init: Vec<Tensor> = model
            .parameters()
            .iter()
            .map(|p| Ok(p.value()?.full_tensor()?))
            .collect::<tessera::autograd::Result<_>>()?;
        model.parallelize(&mesh.dim("tp")?, false)?;
        let tp_placements: Vec<Placement> = model.parameters().iter().map(|p| p.placements()[1]).collect();
        model.fully_shard(&mesh.dim("dp")?, &FsdpConfig::default())?;
        let wq = &model.layers[0].attention.wq;
        let seen = Rc::new(Seen {
            param: wq.weight.clone(),
            placements: RefCell::new(Vec::new()),
        });
        let _h = register_module_hooks(&ModuleId::of(wq)?, seen.clone());
        for ((p, tp), full) in model.parameters().iter().zip(&tp_placements).zip(&init) {
            let v = p.value()?;
            assert_eq!(v.placements(), &[Placement::Shard(0), *tp], "{}", p.name());
            if *tp == Placement::Shard(0) {
                let want = ShardOrder::new(v.placements(), [(0, [1, 0])])?;
                assert_eq!(v.layout().order, want, "{}: the dp shard splits the TP piece", p.name());
            }
            assert_eq!(&v.full_tensor()?, full, "{}", p.name());
            let replicated = v.redistribute(&[Placement::Replicate; 2])?;
            assert_eq!(replicated.to_local(), full, "{}", p.name());
            let back = replicated.redistribute_with_order(v.placements(), v.layout().order.clone())?;
            assert_eq!(back.to_local(), v.to_local(), "{}", p.name());
        }
        let toks = tokens();
        let loss = model.loss(&rows(&toks, 0, 8, &mesh)?)?;
        backward(&loss)?;
        assert_eq!(
            *seen.placements.borrow(),
            vec![vec![Placement::Replicate, Placement::Shard(0)]],
            "wq's weight inside forward"
        );
        save_state_dict_full(&model.parameters(), &out)?;
        Ok(())
    })
    .unwrap();
    let saved = read_safetensors(&path).unwrap();
    let init = read_safetensors(data("tiny_init.safetensors")).unwrap();
    assert_eq!(saved.len(), init.len());
    for (name, t) in &init {
        let got = &saved.iter().find(|(n, _)| n == name).unwrap().1;
        assert_eq!(got, t, "{name}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

// ----- accumulation, clipping -----------------------------------------------------

/// Full gradients after two micro-batches (rows 0..4 then 4..8) with gradient
/// sync off for the first, and the collectives of each backward.
fn accumulated(
    mesh_shape: &'static [usize],
    names: &'static [&'static str],
) -> (Vec<Vec<f64>>, CommCounts, CommCounts, f64) {
    let toks = tokens();
    let world = mesh_shape.iter().product();
    launch(world, move |ctx| {
        let mesh = DeviceMesh::with_names(ctx.into_comm(), mesh_shape, names)?;
        let (model, units) = if names.last() == Some(&"tp") {
            build(&mesh, names, &FsdpConfig::default())?
        } else {
            let model = tiny_model(&mesh)?;
            let u = model.fully_shard(&mesh, &FsdpConfig::default())?;
            let mut all = u.blocks.clone();
            all.push(u.root);
            (model, all)
        };
        let root = units.last().unwrap();
        let mut counts = Vec::new();
        for (half, sync) in [(0, false), (1, true)] {
            root.set_requires_gradient_sync(sync);
            let micro = toks.narrow(0, 0, 1)?.narrow(1, 4 * half, 4)?.reshape(&[4, 33])?;
            let x = Var::constant(distribute_tensor(&micro, &mesh, &batch_placements(mesh.ndim()))?);
            let loss = model.loss(&x)?;
            let s = mesh.stats();
            backward(&loss)?;
            counts.push(mesh.stats() - s);
        }
        let params = model.parameters();
        let grads = params
            .iter()
            .map(|p| Ok(p.grad().unwrap().full_tensor()?.to_f64_vec()))
            .collect::<tessera::autograd::Result<Vec<_>>>()?;
        let norm = clip_grad_norm(&params, f64::INFINITY)?;
        Ok((grads, counts[0], counts[1], norm))
    })
    .unwrap()
    .swap_remove(0)
}

/// Accumulation on `mesh` against FSDP alone on 2 ranks: the same gradients and
/// clip norm; while sync is off, only the `activation_rs` reduce-scatters that
/// reduce activation gradients (not FSDP's), and one more per unit on the last.
fn check_accumulation(mesh: &'static [usize], names: &'static [&'static str], activation_rs: u64) {
    let (grads, first, last, norm) = accumulated(mesh, names);
    let (dp_grads, _, _, dp_norm) = accumulated(&[2], &["dp"]);
    let worst = grads
        .iter()
        .zip(&dp_grads)
        .map(|(a, b)| max_abs_diff(a, b))
        .fold(0.0, f64::max);
    println!("accumulated gradients, {mesh:?} vs dp2: max |Δ| = {worst:.3e}; norms {norm} vs {dp_norm}");
    assert!(worst < 1e-6);
    assert!((norm - dp_norm).abs() < 1e-6 * dp_norm);
    assert_eq!(
        first.calls(OpKind::ReduceScatter),
        activation_rs,
        "sync off: no FSDP reduce-scatter"
    );
    assert_eq!(
        last.calls(OpKind::ReduceScatter),
        activation_rs + 3,
        "sync on: one per unit"
    );
}

/// Gradient accumulation (`set_requires_gradient_sync(false)`) under FSDP over TP
/// gives the gradients FSDP alone gives, reducing only on the last micro-batch;
/// `clip_grad_norm`'s norm (one all-reduce spanning dp and tp) is the same.
#[test]
fn accumulation_and_clip_norm_match_fsdp_alone() {
    check_accumulation(&[2, 2], DP_TP, 0);
}

// ----- memory -------------------------------------------------------------------

/// Per-rank peak under FSDP over TP (dp 2 × tp 2, 4 rows per dp rank) stays below
/// a bound computed from the model:
///
/// - sharded state (parameters, gradients, AdamW's two moments): `4·S`, with
///   `S` = every unit's sharded bytes (the model over dp·tp, padded);
/// - two units' TP-local unsharded parameters (the one computing and the one
///   prefetched), their unsharded gradients and reduce-scatter copy-in, the
///   previous unit's reduce-scatter in flight (`(dp+1)/dp` of its unsharded
///   bytes), and the root's parameters and gradients kept through backward:
///   `5·U_block + 2·U_root`;
/// - activations: per block the norm outputs, residual and block output (full
///   width: `4·T·d`), q, k, v, the attention output and its copy, the FFN's
///   `w1` and GELU outputs (TP-local: `(5·d + 8·d)/tp·T`), the attention
///   probabilities (`H/tp·T²`) and the two all-reduced outputs (`2·T·d`); outside
///   the blocks the embeddings and final norm (`2·T·d`) and the logits, local and
///   gathered (`T·V·(1 + 1/tp)`); all times `b` rows and 4 bytes, and the
///   activation gradients alive in one block's backward (`(2·4·d/tp + 3·d)·T·b·4`).
#[test]
fn peak_memory_is_bounded() {
    let cfg = TransformerConfig::TINY;
    let (dp, tp, b) = (2usize, 2usize, 4usize);
    let toks = tokens();
    let peaks = launch(dp * tp, move |ctx| {
        let mesh = DeviceMesh::with_names(ctx.into_comm(), &[2, 2], DP_TP)?;
        let (model, _) = build(&mesh, DP_TP, &FsdpConfig::default())?;
        let mut opt = AdamW::new(model.parameters(), adamw())?;
        let mut peak = 0;
        for step in 0..3 {
            let x = rows(&toks, step, dp * b, &mesh)?;
            reset_peak();
            let loss = model.loss(&x)?;
            backward(&loss)?;
            drop(loss);
            opt.step()?;
            opt.zero_grad();
            peak = stats().peak_bytes;
        }
        Ok(peak)
    })
    .unwrap();
    let (block, root) = params_tp(cfg);
    let (block_s, block_u) = unit_bytes(&block, dp, tp);
    let (root_s, root_u) = unit_bytes(&root, dp, tp);
    let s = cfg.n_layers * block_s + root_s;
    let (d, v, h, l, t) = (cfg.dim, cfg.vocab, cfg.n_heads, cfg.n_layers, cfg.seq);
    let per_block = 4 * t * d + 13 * d / tp * t + h / tp * t * t + 2 * t * d;
    let act = 4 * b * (l * per_block + 2 * t * d + t * v + t * v / tp);
    let act_grads = 4 * b * (2 * 4 * d / tp + 3 * d) * t;
    let working = 5 * block_u + block_u * (dp + 1) / dp + 2 * root_u;
    let bound = 4 * s + working + act + act_grads;
    let unsharded_rank = 16 * cfg.num_params();
    for (rank, p) in peaks.iter().enumerate() {
        println!(
            "rank {rank}: peak {p} B, bound {bound} B ({:.2}); one unsharded rank's state alone {unsharded_rank} B",
            *p as f64 / bound as f64
        );
        assert!(*p <= bound, "rank {rank}: peak {p} B over the bound {bound} B");
    }
}

// ----- errors -------------------------------------------------------------------

#[test]
fn wrong_order_and_wrong_meshes_are_named() {
    let out = launch(4, |ctx| {
        let mesh = DeviceMesh::with_names(ctx.into_comm(), &[2, 2], DP_TP)?;
        // FSDP first, then TP.
        let model = tiny_model(&mesh)?;
        model.fully_shard(&mesh.dim("dp")?, &FsdpConfig::default())?;
        let tp_after = model.parallelize(&mesh.dim("tp")?, false).err().unwrap().to_string();
        // A data-parallel mesh that is not a slice of the parameters' mesh.
        let other = tiny_model(&mesh)?;
        let flat = mesh.flatten(&["dp", "tp"], "all")?;
        let not_slice = other
            .fully_shard(&flat, &FsdpConfig::default())
            .err()
            .unwrap()
            .to_string();
        Ok((tp_after, not_slice))
    })
    .unwrap();
    let (tp_after, not_slice) = &out[0];
    assert!(
        tp_after.contains("before fully_shard") && tp_after.contains("tok_embeddings.weight"),
        "{tp_after}"
    );
    assert!(not_slice.contains("not a slice"), "{not_slice}");
}

/// On the 3-D mesh: accumulation with sync off, then the clip norm (its
/// all-reduce spans dp_replicate, dp_shard and tp), as FSDP alone gives them;
/// and bf16 mixed precision within 1e-3 of the f32 run.
#[test]
fn hsdp_tp_2x2x2_accumulation_clip_and_bf16() {
    // The position embeddings' output gradient is partial over the 4 dp ranks; it
    // reaches Replicate by slicing along tp, a reduce_scatter over dp and an
    // all_gather over the whole mesh: 1.25× its bytes, where an all_reduce over dp
    // would send 1.5×.
    check_accumulation(&[2, 2, 2], HSDP_TP, 1);
    bf16_and_f32(&[2, 2, 2], HSDP_TP, 6);
}
