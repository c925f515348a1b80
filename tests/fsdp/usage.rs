//! Beyond one call per unit: eval forwards between steps, a unit called twice per
//! forward, and activation checkpointing outside the block units.

use std::rc::Rc;

use tessera::autograd::nn::{Linear, Materializer, Module};
use tessera::autograd::optim::{AdamW, Optimizer};
use tessera::autograd::{Var, backward, checkpoint, no_grad};
use tessera::dtensor::{Placement, Tensor, distribute_tensor};
use tessera::fsdp::{FsdpConfig, fully_shard};
use tessera::mesh::OpKind;
use tessera::models::Transformer;
use tessera::tensor::ops::Reduction;
use tessera::{DType, DeviceMesh, launch};

use crate::common::{adamw, reference_losses, tiny_model, tokens};
use crate::{batch, calls, full_values, max_abs_diff, max_named_diff, scalar};

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
    fn named_children(&self) -> Vec<(String, &dyn Module)> {
        vec![
            ("fc1".into(), &self.fc1),
            ("fc2".into(), &self.fc2),
            ("fc3".into(), &self.fc3),
        ]
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
                fc1: Linear::new(2, 4, true, &mesh, DType::F32)?,
                fc2: Linear::new(4, 4, true, &mesh, DType::F32)?,
                fc3: Linear::new(4, 1, true, &mesh, DType::F32)?,
            };
            if fsdp {
                for l in [&m.fc1, &m.fc2, &m.fc3] {
                    fully_shard(l, &mesh, FsdpConfig::default())?;
                }
                fully_shard(&m, &mesh, FsdpConfig::default())?;
            }
            Materializer::from_seed(1).materialize(&m)?;
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
    fn named_children(&self) -> Vec<(String, &dyn Module)> {
        self.0.named_children()
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
