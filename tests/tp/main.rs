//! Tensor parallelism: the reference Transformer's plans against PyTorch's TP runs,
//! collective counts per block, each style against one rank on full tensors, and
//! the errors of `parallelize_module`.

#[path = "../common/mod.rs"]
mod common;

mod counts;
mod errors;
mod parity;
mod styles;

use tessera::autograd::nn::Module;
use tessera::autograd::optim::{AdamW, Optimizer};
use tessera::autograd::{Var, backward};
use tessera::dtensor::{Placement, Tensor, distribute_tensor};
use tessera::mesh::CommCounts;
use tessera::models::Transformer;
use tessera::{DeviceMesh, launch};

pub(crate) use common::max_abs_diff;
use common::{adamw, tiny_model, tokens};

/// One TP training run: per step the loss and the communication of forward and
/// of backward (rank 0's counters).
pub struct Run {
    /// The loss of each step.
    pub losses: Vec<f64>,
    /// Collectives of each step's forward.
    pub fwd: Vec<CommCounts>,
    /// Collectives of each step's backward.
    pub bwd: Vec<CommCounts>,
}

/// Trains the tiny model on a `(dp, tp)` mesh for `steps`: TP over `tp` with the
/// plain or the sequence-parallel plan, plain data parallelism over `dp`; each
/// data-parallel rank takes `g / dp` rows of the reference batch.
pub fn train(dp: usize, tp: usize, g: usize, sp: bool, steps: usize) -> Run {
    let toks = tokens();
    launch(dp * tp, move |ctx| {
        let mesh = DeviceMesh::with_names(ctx.into_comm(), &[dp, tp], &["dp", "tp"])?;
        let model = tiny_model(&mesh)?;
        model.parallelize(&mesh.dim("tp")?, sp)?;
        let mut opt = AdamW::new(model.parameters(), adamw())?;
        let mut run = Run {
            losses: Vec::new(),
            fwd: Vec::new(),
            bwd: Vec::new(),
        };
        for step in 0..steps {
            let rows = toks.narrow(0, step, 1)?.narrow(1, 0, g)?.reshape(&[g, 33])?;
            let (loss, fwd, bwd) = step_counted(&model, &mesh, &rows)?;
            run.losses.push(loss);
            run.fwd.push(fwd);
            run.bwd.push(bwd);
            opt.step()?;
            opt.zero_grad();
        }
        Ok(run)
    })
    .unwrap()
    .swap_remove(0)
}

/// One forward and backward of `model` on token `rows` (batch `Shard(0)` over dp,
/// replicated over tp): the loss and this rank's counters of forward and of backward.
pub fn step_counted(
    model: &Transformer,
    mesh: &DeviceMesh,
    rows: &Tensor,
) -> tessera::autograd::Result<(f64, CommCounts, CommCounts)> {
    let rows = Var::constant(distribute_tensor(
        rows,
        mesh,
        &[Placement::Shard(0), Placement::Replicate],
    )?);
    let before = mesh.stats();
    let loss = model.loss(&rows)?;
    let mid = mesh.stats();
    backward(&loss)?;
    let bwd = mesh.stats() - mid;
    Ok((loss.value().full_tensor()?.to_f64_vec()[0], mid - before, bwd))
}
