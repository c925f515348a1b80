//! Activation checkpointing: the same gradients as without it, and fewer bytes of
//! tensor storage held between forward and backward (the per-rank memory tracker).

use tessera::DeviceMesh;
use tessera::autograd::{Param, Result, Var, backward, checkpoint, no_grad, recorded_ops};
use tessera::dtensor::{Placement, Placement::*, Tensor};
use tessera::tensor::memory;

use crate::harness::{R, constant, full_grad, gathered, max_rel_err, on_mesh, param, replicate, uniform};

const WIDTH: usize = 64;
const BATCH: usize = 32;
const LAYERS: usize = 4;

/// `h ← gelu(h·Wᵢᵀ + bᵢ)` for every layer.
fn stack(h: &Var, layers: &[(Param, Param)]) -> Result<Var> {
    let mut h = h.clone();
    for (w, b) in layers {
        h = h.linear(&gathered(w)?, Some(&gathered(b)?))?.gelu()?;
    }
    Ok(h)
}

fn layers(mesh: &DeviceMesh, placements: &[Placement]) -> R<Vec<(Param, Param)>> {
    (0..LAYERS)
        .map(|i| {
            let scale = 1.0 / (WIDTH as f64).sqrt();
            let w = uniform(&[WIDTH, WIDTH], 10 + i as u64).mul_scalar(2.0 * scale)?;
            let b = uniform(&[WIDTH], 20 + i as u64).mul_scalar(0.1)?;
            Ok((
                param(&format!("w{i}"), &w, mesh, placements)?,
                param(&format!("b{i}"), &b, mesh, placements)?,
            ))
        })
        .collect()
}

/// How the stack is run.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    Plain,
    /// The whole stack in one checkpoint.
    Whole,
    /// Each layer in its own checkpoint.
    PerLayer,
}

/// One run: the gradients of the input and of every parameter, the bytes held
/// after forward beyond those held before it, and the ops on the tape then.
struct Run {
    grads: Vec<Tensor>,
    held_after_forward: usize,
    ops_after_forward: usize,
}

fn run(mesh_shape: &[usize], batch: &'static [Placement], params: &'static [Placement], mode: Mode) -> Vec<Run> {
    on_mesh(mesh_shape, move |mesh| {
        let x = param("x", &uniform(&[BATCH, WIDTH], 1), mesh, batch)?;
        let ls = layers(mesh, params)?;
        let target = constant(&uniform(&[BATCH, WIDTH], 2), mesh, batch)?;
        let before = memory::stats().current_bytes;
        let y = match mode {
            Mode::Plain => stack(&x.var()?, &ls)?,
            Mode::Whole => {
                let ls = ls.clone();
                checkpoint(&[x.var()?], move |xs| stack(&xs[0], &ls))?
            }
            Mode::PerLayer => {
                let mut h = x.var()?;
                for layer in &ls {
                    let layer = [layer.clone()];
                    h = checkpoint(&[h], move |xs| stack(&xs[0], &layer))?;
                }
                h
            }
        };
        let loss = y.sub(&target)?.square()?.mean(&[0, 1], false)?;
        let held_after_forward = memory::stats().current_bytes - before;
        let ops_after_forward = recorded_ops();
        backward(&loss)?;
        let mut grads = vec![full_grad(&x)?];
        for (w, b) in &ls {
            grads.push(full_grad(w)?);
            grads.push(full_grad(b)?);
        }
        Ok(Run {
            grads,
            held_after_forward,
            ops_after_forward,
        })
    })
}

fn assert_same_grads(got: &Run, want: &Run, what: &str) {
    for (i, (g, w)) in got.grads.iter().zip(&want.grads).enumerate() {
        let e = max_rel_err(g, w).unwrap();
        assert!(e <= 1e-10, "{what}: gradient {i} (0 is the input) off by {e:.2e}");
    }
}

#[test]
fn checkpointing_gives_the_same_gradients() {
    let plain = run(&[1], &[Replicate], &[Replicate], Mode::Plain).remove(0);
    for mode in [Mode::Whole, Mode::PerLayer] {
        let ckpt = run(&[1], &[Replicate], &[Replicate], mode).remove(0);
        assert_same_grads(&ckpt, &plain, &format!("{mode:?}"));
    }
}

#[test]
fn checkpointing_on_a_sharded_batch_with_sharded_params() {
    let plain = run(&[1], &[Replicate], &[Replicate], Mode::Plain).remove(0);
    for mode in [Mode::Plain, Mode::Whole, Mode::PerLayer] {
        for out in run(&[2], &[Shard(0)], &[Shard(0)], mode) {
            assert_same_grads(&out, &plain, &format!("{mode:?} on [2]"));
        }
    }
}

#[test]
fn checkpointing_holds_fewer_bytes_after_forward() {
    let plain = run(&[1], &[Replicate], &[Replicate], Mode::Plain).remove(0);
    let whole = run(&[1], &[Replicate], &[Replicate], Mode::Whole).remove(0);
    let per_layer = run(&[1], &[Replicate], &[Replicate], Mode::PerLayer).remove(0);
    let act = BATCH * WIDTH * 8;
    // Without checkpointing every layer keeps at least its pre-activation (for
    // gelu's backward) and its output (for the next matmul's).
    assert!(
        plain.held_after_forward >= 2 * LAYERS * act,
        "plain forward holds only {} bytes",
        plain.held_after_forward
    );
    // One checkpoint keeps its output and the loss's few activations; one per layer
    // keeps each layer's output too.
    assert!(
        whole.held_after_forward < plain.held_after_forward / 2,
        "whole-stack checkpoint holds {} bytes, plain {}",
        whole.held_after_forward,
        plain.held_after_forward
    );
    assert!(
        per_layer.held_after_forward < plain.held_after_forward,
        "per-layer checkpoints hold {} bytes, plain {}",
        per_layer.held_after_forward,
        plain.held_after_forward
    );
    assert!(whole.held_after_forward <= per_layer.held_after_forward);
    // And the tape holds one node for the checkpointed stack, not one per op.
    assert!(whole.ops_after_forward < plain.ops_after_forward);
    assert_eq!(per_layer.ops_after_forward - whole.ops_after_forward, LAYERS - 1);
}

#[test]
fn checkpointing_holds_fewer_bytes_on_every_rank_of_a_sharded_run() {
    let plain = run(&[2], &[Shard(0)], &[Shard(0)], Mode::Plain);
    let whole = run(&[2], &[Shard(0)], &[Shard(0)], Mode::Whole);
    for (rank, (p, w)) in plain.iter().zip(&whole).enumerate() {
        assert!(
            w.held_after_forward < p.held_after_forward / 2,
            "rank {rank}: checkpointed {} bytes, plain {}",
            w.held_after_forward,
            p.held_after_forward
        );
    }
}

/// A checkpoint whose inputs need no gradient still trains the parameters used
/// inside it; an identity checkpoint passes the gradient straight through; nested
/// checkpoints, and a backward run under `no_grad`, give the plain gradients.
#[test]
fn checkpoint_edge_cases() {
    let out = on_mesh(&[1], |mesh| {
        let rep = replicate(1);
        let w = param("w", &uniform(&[3, 3], 1), mesh, &rep)?;
        let x = constant(&uniform(&[2, 3], 2), mesh, &rep)?;
        let block = |h: &Var, w: &Param| -> Result<Var> { h.matmul(&w.var()?)?.tanh() };
        let loss = |y: Var| -> Result<Var> { y.square()?.sum(&[0, 1], false) };
        let grad_of = |y: Var, through_no_grad: bool| -> R<Tensor> {
            w.zero_grad();
            let l = loss(y)?;
            if through_no_grad {
                no_grad(|| backward(&l))?;
            } else {
                backward(&l)?;
            }
            full_grad(&w)
        };
        let plain = grad_of(block(&block(&x, &w)?, &w)?, false)?;
        let (w1, w2) = (w.clone(), w.clone());
        let inputs_without_grad = grad_of(
            checkpoint(std::slice::from_ref(&x), move |xs| block(&block(&xs[0], &w1)?, &w1))?,
            false,
        )?;
        let nested = grad_of(
            checkpoint(std::slice::from_ref(&x), move |xs| {
                let w3 = w2.clone();
                let inner = checkpoint(&[xs[0].clone()], move |ys| block(&ys[0], &w3))?;
                block(&inner, &w2)
            })?,
            false,
        )?;
        let w4 = w.clone();
        let under_no_grad = grad_of(
            checkpoint(std::slice::from_ref(&x), move |xs| block(&block(&xs[0], &w4)?, &w4))?,
            true,
        )?;
        let p = param("p", &uniform(&[2, 3], 3), mesh, &rep)?;
        let id = checkpoint(&[p.var()?], |xs| Ok(xs[0].clone()))?;
        backward(&id.mul_scalar(3.0)?.sum(&[0, 1], false)?)?;
        Ok((plain, [inputs_without_grad, nested, under_no_grad], full_grad(&p)?))
    });
    let (plain, checkpointed, identity) = &out[0];
    for (g, what) in checkpointed
        .iter()
        .zip(["inputs without grad", "nested", "backward under no_grad"])
    {
        let e = max_rel_err(g, plain).unwrap();
        assert!(e <= 1e-12, "{what}: off by {e:.2e}");
    }
    assert_eq!(identity.to_f64_vec(), vec![3.0; 6]);
}

/// After backward, once the forward's values are dropped, a rank holds exactly its
/// gradients beyond what it held before: the tape freed every saved activation,
/// recomputed ones included.
#[test]
fn backward_frees_every_saved_activation() {
    for mode in [Mode::Plain, Mode::Whole, Mode::PerLayer] {
        let out = on_mesh(&[2], move |mesh| {
            let x = param("x", &uniform(&[BATCH, WIDTH], 1), mesh, &[Shard(0)])?;
            let ls = layers(mesh, &[Shard(0)])?;
            let before = memory::stats().current_bytes;
            let y = match mode {
                Mode::Plain => stack(&x.var()?, &ls)?,
                _ => {
                    let ls = ls.clone();
                    checkpoint(&[x.var()?], move |xs| stack(&xs[0], &ls))?
                }
            };
            backward(&y.square()?.mean(&[0, 1], false)?)?;
            drop(y);
            let held = memory::stats().current_bytes - before;
            let mut grads = x.grad().map_or(0, |g| g.to_local().size_in_bytes());
            for (w, b) in &ls {
                for p in [w, b] {
                    grads += p.grad().map_or(0, |g| g.to_local().size_in_bytes());
                }
            }
            Ok((held, grads))
        });
        for (rank, (held, grads)) in out.into_iter().enumerate() {
            assert_eq!(
                held, grads,
                "{mode:?} rank {rank}: {held} bytes held after backward, gradients are {grads}"
            );
        }
    }
}

/// A var that requires a gradient and is captured by the checkpointed closure
/// (rather than passed in `inputs`) loses its gradient: the recomputation walks a
/// fresh frame and only asks for the inputs' gradients, and the parameter behind
/// the captured leaf is registered in the outer frame, not the recomputation's.
/// PyTorch's non-reentrant checkpoint gives captured tensors their gradients.
#[test]
fn checkpoint_keeps_the_gradient_of_a_captured_var() {
    let out = on_mesh(&[1], |mesh| {
        let rep = replicate(1);
        let w = param("w", &uniform(&[3], 1), mesh, &rep)?;
        let x = param("x", &uniform(&[3], 2), mesh, &rep)?;
        let wv = w.var()?;
        let y = checkpoint(&[x.var()?], move |xs| xs[0].mul(&wv))?;
        backward(&y.sum(&[0], false)?)?;
        // d/dw Σ x·w = x.
        Ok((
            w.grad().map(|g| g.to_local().to_f64_vec()),
            x.value()?.to_local().to_f64_vec(),
        ))
    });
    let (gw, xv) = &out[0];
    assert_eq!(gw.as_ref(), Some(xv), "w's gradient");
}
