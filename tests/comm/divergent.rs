//! Rank-divergent sequences: ranks that issue different collectives (an extra
//! micro-batch, a skipped module, other shapes, dtypes, groups, reductions or
//! roots, a reordered pair of same-shape collectives in strict mode,
//! `clip_grad_norm` over other parameters) fail on every involved rank with an
//! error naming both ranks' call sites (`file:line:col`), never a silent
//! exchange of each other's data or a hang.
//!
//! Each case records, per rank, the line of the call that diverges (`line!()`
//! on the line before it) and checks that every involved rank's error names
//! `divergent.rs:<line>:` for both ranks' lines.

use std::sync::{Arc, Mutex, mpsc};
use std::time::Duration;

use tessera::autograd::nn::{Init, Linear, Materializer, Module, name_parameters};
use tessera::autograd::optim::clip_grad_norm;
use tessera::autograd::{Param, Var, backward};
use tessera::dtensor::{DTensor, Placement, Tensor, distribute_tensor, distribute_tensor_from};
use tessera::fsdp::{FsdpConfig, fully_shard};
use tessera::mesh::{Element, Error};
use tessera::{BoxError, Communicator, CommunicatorExt, DType, DeviceMesh, LaunchOptions, ReduceOp, launch_with};

fn opts() -> LaunchOptions {
    LaunchOptions::default().timeout(Duration::from_secs(60))
}

fn strict() -> LaunchOptions {
    opts().strict_collectives(true)
}

/// Per rank: the line of its diverging call.
type Lines = Arc<Mutex<Vec<u32>>>;

/// Runs `body` on `n` ranks (given the rank, its world communicator and where
/// to record its diverging call's line), collects every rank's error, and
/// checks that the ranks in `involved` all failed naming every recorded line.
/// Returns the launch's error and the ranks' errors.
fn diverge(
    opts: &LaunchOptions,
    n: usize,
    involved: &[usize],
    body: impl Fn(usize, Box<dyn Communicator>, &dyn Fn(u32)) -> Result<(), BoxError> + Send + Sync + 'static,
) -> (Error, Vec<String>) {
    let lines: Lines = Arc::new(Mutex::new(vec![0; n]));
    let (tx, rx) = mpsc::channel();
    let recorded = lines.clone();
    let err = launch_with(opts, n, move |ctx| {
        let r = ctx.rank();
        let record = |line: u32| recorded.lock().unwrap()[r] = line;
        let out = body(r, ctx.into_comm(), &record);
        if let Err(e) = &out {
            let _ = tx.send((r, e.to_string()));
        }
        out
    })
    .expect_err("diverging ranks must fail the job");
    let mut seen = vec![String::new(); n];
    while let Ok((r, e)) = rx.recv_timeout(Duration::from_secs(60)) {
        seen[r] = e;
    }
    let lines = lines.lock().unwrap().clone();
    for &r in involved {
        for &q in involved {
            let site = format!("divergent.rs:{}:", lines[q]);
            assert!(lines[q] > 0, "rank {q} recorded no line");
            assert!(
                seen[r].contains(&site),
                "rank {r}'s error must name rank {q}'s call site {site}: {}",
                seen[r]
            );
        }
        assert!(
            seen[r].contains(&format!("rank {} called", involved[0])) || seen[r].contains("rank 0"),
            "rank {r}: {}",
            seen[r]
        );
    }
    (err, seen)
}

#[test]
fn track_caller_reaches_through_dyn_communicator() {
    let (_, seen) = diverge(&opts(), 2, &[0, 1], |r, comm, at| {
        let comm: &dyn Communicator = &*comm;
        let mut x = vec![1.0f32; 4 + r];
        at(line!() + 1);
        comm.all_reduce(f32::buf_mut(&mut x), ReduceOp::Sum)?;
        Ok(())
    });
    // Both ranks issued it from the same line: the message names it for both.
    assert!(
        seen[0].contains("4 × f32") && seen[0].contains("5 × f32"),
        "{}",
        seen[0]
    );
}

#[test]
fn mismatched_shapes() {
    diverge(&opts(), 2, &[0, 1], |r, comm, at| {
        if r == 0 {
            let mut x = vec![1.0f32; 4];
            at(line!() + 1);
            comm.all_reduce_slice(&mut x, ReduceOp::Sum)?;
        } else {
            let mut x = vec![1.0f32; 6];
            at(line!() + 1);
            comm.all_reduce_slice(&mut x, ReduceOp::Sum)?;
        }
        Ok(())
    });
}

#[test]
fn mismatched_dtypes() {
    let (_, seen) = diverge(&opts(), 2, &[0, 1], |r, comm, at| {
        if r == 0 {
            let x = vec![1.0f32; 4];
            at(line!() + 1);
            comm.all_gather_vec(&x)?;
        } else {
            let x = vec![1.0f64; 4];
            at(line!() + 1);
            comm.all_gather_vec(&x)?;
        }
        Ok(())
    });
    assert!(seen[1].contains("f32") && seen[1].contains("f64"), "{}", seen[1]);
}

#[test]
fn different_reductions() {
    let (_, seen) = diverge(&opts(), 2, &[0, 1], |r, comm, at| {
        let mut x = vec![1.0f32; 4];
        if r == 0 {
            at(line!() + 1);
            comm.all_reduce_slice(&mut x, ReduceOp::Sum)?;
        } else {
            at(line!() + 1);
            comm.all_reduce_slice(&mut x, ReduceOp::Max)?;
        }
        Ok(())
    });
    assert!(seen[0].contains("sum") && seen[0].contains("max"), "{}", seen[0]);
}

#[test]
fn different_roots() {
    let (_, seen) = diverge(&opts(), 2, &[0, 1], |r, comm, at| {
        let mut x = vec![r as f32; 4];
        if r == 0 {
            at(line!() + 1);
            comm.broadcast_slice(&mut x, 0)?;
        } else {
            at(line!() + 1);
            comm.broadcast_slice(&mut x, 1)?;
        }
        Ok(())
    });
    assert!(seen[0].contains("root 0") && seen[0].contains("root 1"), "{}", seen[0]);
}

#[test]
fn different_groups() {
    // Rank 0 reduces over the mesh's only dim, rank 1 over the whole mesh: the
    // same ranks, but two groups, so each waits for the other forever unless the
    // cross-group check names both.
    let (_, seen) = diverge(&opts(), 2, &[0, 1], |r, comm, at| {
        let mesh = DeviceMesh::new(comm, &[2])?;
        let mut x = vec![1.0f32; 4];
        if r == 0 {
            at(line!() + 1);
            mesh.dim_comm(0)?.all_reduce_slice(&mut x, ReduceOp::Sum)?;
        } else {
            at(line!() + 1);
            mesh.comm().all_reduce_slice(&mut x, ReduceOp::Sum)?;
        }
        Ok(())
    });
    assert!(seen[0].contains("different groups"), "{}", seen[0]);
}

#[test]
fn extra_micro_batch_of_a_dtensor_loop() {
    // Rank 0 runs one more step than rank 1, which goes on to its final
    // reduction: rank 0's all_gather meets rank 1's all_reduce.
    diverge(&opts(), 2, &[0, 1], |r, comm, at| {
        let mesh = DeviceMesh::new(comm, &[2])?;
        let x = distribute_tensor(&Tensor::ones(&[4, 4], DType::F32)?, &mesh, &[Placement::Shard(0)])?;
        let steps = if r == 0 { 3 } else { 2 };
        for _ in 0..steps {
            at(line!() + 1);
            x.full_tensor()?;
        }
        let mut loss = [1.0f64];
        at(line!() + 1);
        mesh.comm().all_reduce_slice(&mut loss, ReduceOp::Avg)?;
        Ok(())
    });
}

/// Two FSDP units of the same shapes (`a` and `b`), each `Linear(4→4)`.
struct Pair {
    a: Linear,
    b: Linear,
}

impl Module for Pair {
    fn named_children(&self) -> Vec<(String, &dyn Module)> {
        vec![("a".to_string(), &self.a), ("b".to_string(), &self.b)]
    }

    fn forward(&self, x: &Var) -> tessera::autograd::Result<Var> {
        self.b.call(&self.a.call(x)?)
    }
}

fn two_units(mesh: &DeviceMesh) -> Result<Pair, BoxError> {
    let pair = Pair {
        a: Linear::new(4, 4, false, mesh, DType::F32)?,
        b: Linear::new(4, 4, false, mesh, DType::F32)?,
    };
    name_parameters(&pair)?;
    Materializer::from_seed(0)
        .init("*", Init::Constant(0.25))
        .materialize(&pair)?;
    fully_shard(&pair.a, mesh, FsdpConfig::default())?;
    fully_shard(&pair.b, mesh, FsdpConfig::default())?;
    Ok(pair)
}

fn batch(mesh: &DeviceMesh) -> Result<Var, BoxError> {
    let x = Tensor::ones(&[2, 4], DType::F32)?;
    Ok(Var::constant(distribute_tensor(&x, mesh, &[Placement::Shard(0)])?))
}

#[test]
fn skipped_module_of_the_same_shape() {
    // Rank 1 skips unit `a`: its gather of `b` has the same size as rank 0's of
    // `a`; the units' tags (their parameters' names) tell them apart by default.
    let (_, seen) = diverge(&opts(), 2, &[0, 1], |r, comm, at| {
        let mesh = DeviceMesh::new(comm, &[2])?;
        let Pair { a, b } = two_units(&mesh)?;
        let x = batch(&mesh)?;
        let h = if r == 0 {
            at(line!() + 1);
            a.call(&x)?
        } else {
            at(line!() + 1);
            b.call(&x)?
        };
        b.call(&h)?;
        Ok(())
    });
    assert!(seen[0].contains("about different things"), "{}", seen[0]);
}

#[test]
fn extra_micro_batch_of_an_fsdp_loop_in_strict_mode() {
    // Rank 0 runs a second micro-batch while rank 1 goes on to an evaluation
    // forward: both gather unit `a` first (same size, same tag), from different
    // lines. Strict mode stops them there; by default they would fail one
    // collective later (rank 0's backward gather of `a` against rank 1's gather
    // of `b`, whose tags differ).
    diverge(&strict(), 2, &[0, 1], |r, comm, at| {
        let mesh = DeviceMesh::new(comm, &[2])?;
        let pair = two_units(&mesh)?;
        let x = batch(&mesh)?;
        let micro = if r == 0 { 2 } else { 1 };
        for _ in 0..micro {
            at(line!() + 1);
            let loss = pair.a.call(&x)?.square()?.mean(&[0, 1], false)?;
            backward(&loss)?;
        }
        at(line!() + 1);
        pair.call(&x)?;
        Ok(())
    });
}

#[test]
fn extra_micro_batch_of_an_fsdp_loop_by_default() {
    // Rank 0 runs a second micro-batch: its forward waits in an asynchronous
    // gather of unit `a` (on the mesh dim's group) while rank 1 has gone on to
    // clip its gradients (an all-reduce on the whole mesh). Each waits for the
    // other in a different group; rank 0's closure only waits on its own
    // collective, so the cross-group check finds it well before the timeout.
    let (_, seen) = diverge(&opts(), 2, &[0, 1], |r, comm, at| {
        let mesh = DeviceMesh::new(comm, &[2])?;
        let pair = two_units(&mesh)?;
        let x = batch(&mesh)?;
        let micro = if r == 0 { 2 } else { 1 };
        for _ in 0..micro {
            at(line!() + 1);
            let loss = pair.call(&x)?.square()?.mean(&[0, 1], false)?;
            backward(&loss)?;
        }
        at(line!() + 1);
        clip_grad_norm(&pair.parameters(), 1.0)?;
        Ok(())
    });
    assert!(
        seen.iter()
            .all(|e| e.contains("ranks wait for each other in collectives of different groups")),
        "{seen:?}"
    );
}

/// Parameters `p` (4 elements) and `q` (6), `Shard(0)` on a 2-rank mesh, with
/// gradients of ones.
struct Two {
    p: Param,
    q: Param,
}

impl Module for Two {
    fn own_parameters(&self) -> Vec<(String, Param)> {
        vec![("p".to_string(), self.p.clone()), ("q".to_string(), self.q.clone())]
    }

    fn forward(&self, x: &Var) -> tessera::autograd::Result<Var> {
        Ok(x.clone())
    }
}

fn two_params(mesh: &DeviceMesh) -> Result<Two, BoxError> {
    let grad = |n: usize| distribute_tensor(&Tensor::ones(&[n], DType::F32)?, mesh, &[Placement::Shard(0)]);
    let two = Two {
        p: Param::new(grad(4)?),
        q: Param::new(grad(6)?),
    };
    name_parameters(&two)?;
    two.p.set_grad(Some(grad(4)?));
    two.q.set_grad(Some(grad(6)?));
    Ok(two)
}

#[test]
fn clip_grad_norm_over_different_parameters_is_caught_by_its_tag() {
    // Both ranks all-reduce one f64 (same shape): without the tag each would
    // return a norm over a mix of the two sets. Caught by default, not only in
    // strict mode.
    let (_, seen) = diverge(&opts(), 2, &[0, 1], |r, comm, at| {
        let mesh = DeviceMesh::new(comm, &[2])?;
        let Two { p, q } = two_params(&mesh)?;
        let params = if r == 0 { vec![p, q] } else { vec![q] };
        at(line!() + 1);
        clip_grad_norm(&params, 0.5)?;
        Ok(())
    });
    assert!(seen[1].contains("about different things"), "{}", seen[1]);
}

#[test]
fn same_size_redistributes_of_other_layouts_are_caught_by_their_tags() {
    // `Shard(0) → Replicate` and `Shard(1) → Replicate` of a 4×4 tensor both
    // all-gather 8 elements per rank: the tags (the layouts) differ.
    diverge(&opts(), 2, &[0, 1], |r, comm, at| {
        let mesh = DeviceMesh::new(comm, &[2])?;
        let t = Tensor::ones(&[4, 4], DType::F32)?;
        let x: DTensor = distribute_tensor_from(&t, &mesh, &[Placement::Shard(r)], None)?;
        at(line!() + 1);
        x.redistribute(&[Placement::Replicate])?;
        Ok(())
    });
}

#[test]
fn strict_mode_catches_reordered_same_shape_all_reduces() {
    let (_, seen) = diverge(&strict(), 2, &[0, 1], |r, comm, at| {
        let (mut a, mut b) = ([1.0f32; 4], [2.0f32; 4]);
        if r == 0 {
            at(line!() + 1);
            comm.all_reduce_slice(&mut a, ReduceOp::Sum)?;
            comm.all_reduce_slice(&mut b, ReduceOp::Sum)?;
        } else {
            at(line!() + 1);
            comm.all_reduce_slice(&mut b, ReduceOp::Sum)?;
            comm.all_reduce_slice(&mut a, ReduceOp::Sum)?;
        }
        Ok(())
    });
    assert!(seen[0].contains("different call sites"), "{}", seen[0]);
}

#[test]
fn strict_mode_catches_reordered_asynchronous_all_reduces() {
    diverge(&strict(), 2, &[0, 1], |r, comm, at| {
        let (a, b) = (
            tessera::mesh::Buffer::zeros(DType::F32, 4),
            tessera::mesh::Buffer::zeros(DType::F32, 4),
        );
        let (first, second) = if r == 0 { (a, b) } else { (b, a) };
        if r == 0 {
            at(line!() + 1);
            let w = comm.all_reduce_async(first, ReduceOp::Sum);
            w.wait()?;
        } else {
            at(line!() + 1);
            let w = comm.all_reduce_async(first, ReduceOp::Sum);
            w.wait()?;
        }
        comm.all_reduce_async(second, ReduceOp::Sum).wait()?;
        Ok(())
    });
}

#[test]
fn strict_mode_is_off_by_default_so_rank_dependent_lines_run() {
    // Legitimate SPMD code: one broadcast written on two lines.
    #[allow(clippy::if_same_then_else)] // the point: one call written on two lines
    let body = |r: usize, comm: &dyn Communicator| -> Result<Vec<f32>, BoxError> {
        let mut x = vec![r as f32 + 1.0; 4];
        if r == 0 {
            comm.broadcast_slice(&mut x, 0)?;
        } else {
            comm.broadcast_slice(&mut x, 0)?;
        }
        Ok(x)
    };
    let got = launch_with(&opts(), 2, move |ctx| body(ctx.rank(), ctx.comm())).unwrap();
    assert_eq!(got, vec![vec![1.0f32; 4]; 2]);
    let e = launch_with(&strict(), 2, move |ctx| body(ctx.rank(), ctx.comm())).unwrap_err();
    assert!(e.to_string().contains("different call sites"), "{e}");
}
