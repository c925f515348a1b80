//! Hybrid sharding across nodes: 2 nodes × 2 ranks, mesh `[2, 2]` named
//! `["replicate", "shard"]`. Parameters are sharded within a node (the fast links
//! carry every unit's all-gather and reduce-scatter) and replicated across nodes
//! (only the sharded gradients cross, one all-reduce per unit).
//!
//! ```text
//! # two nodes, two slots each (see the README's hostfile section)
//! mpirun -n 4 --hostfile hosts --map-by ppr:2:node target/release/examples/hsdp_multinode
//! # one machine, MPI processes
//! mpirun -n 4 target/release/examples/hsdp_multinode
//! # one machine, in-process threads (no MPI)
//! cargo run --release --example hsdp_multinode
//! ```
//!
//! Build with `--features mpi` for the MPI runs. With OpenMPI's default mapping,
//! ranks 0 and 1 share the first node and 2 and 3 the second, so mesh rows (the
//! `shard` dim) are nodes. The example gathers every rank's host name, prints the
//! layout, warns when a shard group spans nodes, trains the reference Transformer
//! for `--steps` steps and reports the bytes sent within a node (all-gathers and
//! reduce-scatters) and across nodes (all-reduces).
//!
//! Flags: `--steps N` (default 10), `--batch ROWS_PER_RANK` (default 2).

#[path = "common/mod.rs"]
mod common;

use tessera::autograd::nn::{Materializer, Module};
use tessera::autograd::optim::{AdamW, AdamWConfig, Optimizer};
use tessera::autograd::{Var, backward};
use tessera::data::{DATA_SEED, batch};
use tessera::dtensor::{Placement, Tensor, distribute_tensor_from};
use tessera::fsdp::FsdpConfig;
use tessera::mesh::OpKind;
use tessera::models::{Transformer, TransformerConfig};
use tessera::{BoxError, CommunicatorExt, DType, DeviceMesh, is_lead_process, launch};

const USAGE: &str = "usage: hsdp_multinode [--steps N] [--batch ROWS_PER_RANK]";
const SHAPE: [usize; 2] = [2, 2];
const NAMES: [&str; 2] = ["replicate", "shard"];
/// Host names travel as fixed-width byte rows.
const HOST_BYTES: usize = 64;

fn host_name() -> String {
    // The kernel's name first: `HOSTNAME` may be inherited from the submitting shell.
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "unknown-host".into())
}

fn main() {
    let (mut steps, mut rows_per_rank) = (10, 2);
    let parsed = common::parse_flags(std::env::args().skip(1), |flag, value| {
        match flag {
            "--steps" => steps = common::positive(flag, &value("a positive integer")?)?,
            "--batch" => rows_per_rank = common::positive(flag, &value("a positive integer")?)?,
            other => return Err(format!("unknown flag {other}")),
        }
        Ok(())
    });
    match parsed {
        Err(e) if e == common::HELP => {
            println!("{USAGE}");
            return;
        }
        Err(e) => {
            eprintln!("hsdp_multinode: {e}\n{USAGE}");
            std::process::exit(2);
        }
        Ok(()) => {}
    }
    if let Err(e) = run(steps, rows_per_rank) {
        eprintln!("hsdp_multinode: {e}");
        std::process::exit(1);
    }
}

fn run(steps: usize, rows_per_rank: usize) -> Result<(), BoxError> {
    let world: usize = SHAPE.iter().product();
    let cfg = TransformerConfig {
        dim: 128,
        n_layers: 2,
        n_heads: 4,
        vocab: 1024,
        seq: 64,
    };
    let g = world * rows_per_rank;
    let out = launch(world, move |ctx| {
        let backend = ctx.comm().backend();
        let mut host = [0u8; HOST_BYTES];
        let name = host_name();
        let n = name.len().min(HOST_BYTES);
        host[..n].copy_from_slice(&name.as_bytes()[..n]);
        let hosts: Vec<String> = ctx
            .comm()
            .all_gather_vec(&host)?
            .chunks(HOST_BYTES)
            .map(|c| String::from_utf8_lossy(c).trim_end_matches('\0').to_string())
            .collect();
        let mesh = DeviceMesh::with_names(ctx.into_comm(), &SHAPE, &NAMES)?;
        let model = Transformer::new(cfg, &mesh, DType::F32)?;
        let params = model.parameters();
        model.fully_shard(&mesh, &FsdpConfig::default())?;
        Materializer::from_seed(0).materialize(&model)?;
        let mut opt = AdamW::new(
            params,
            AdamWConfig {
                lr: 1e-3,
                betas: (0.9, 0.95),
                eps: 1e-8,
                weight_decay: 0.1,
            },
        )?;
        let placements = vec![Placement::Shard(0); 2];
        let before = mesh.stats();
        let mut losses = Vec::with_capacity(steps);
        for step in 0..steps {
            let v = batch(DATA_SEED, step as u64, 0..g as u64, cfg.seq + 1, cfg.vocab as u64);
            // The same global rows on every rank (seeded by the step): no source
            // rank, so the collectives counted below are the training step's alone.
            let x = distribute_tensor_from(&Tensor::from_vec(v, &[g, cfg.seq + 1])?, &mesh, &placements, None)?;
            let loss = model.loss(&Var::constant(x))?;
            losses.push(loss.value().full_tensor()?.to_f64_vec()[0]);
            backward(&loss)?;
            opt.step()?;
            opt.zero_grad();
        }
        Ok((backend, hosts, losses, mesh.stats() - before))
    })?;
    if !is_lead_process() {
        return Ok(());
    }
    let (backend, hosts, losses, counts) = &out[0];
    println!("backend {backend}; mesh {SHAPE:?} {NAMES:?}");
    for (node, row) in hosts.chunks(SHAPE[1]).enumerate() {
        println!(
            "  shard group {node} (ranks {}..{}): hosts {row:?}",
            node * SHAPE[1],
            (node + 1) * SHAPE[1]
        );
        if row.iter().any(|h| h != &row[0]) {
            println!(
                "  warning: shard group {node} spans hosts; map ranks by node (OpenMPI: --map-by ppr:{}:node)",
                SHAPE[1]
            );
        }
    }
    println!(
        "trained {steps} steps on a global batch of {g}: loss {:.4} -> {:.4}",
        losses[0],
        losses[losses.len() - 1]
    );
    // FSDP's all-gathers and reduce-scatters run on the shard dim (within a node),
    // HSDP's gradient all-reduces on the replicate dim (across nodes).
    let within = counts.bytes(OpKind::AllGather) + counts.bytes(OpKind::ReduceScatter);
    let across = counts.bytes(OpKind::AllReduce);
    println!(
        "rank 0 sent {within} B in all-gathers and reduce-scatters within its node and {across} B in all-reduces \
         across nodes ({:.2}x)",
        across as f64 / within.max(1) as f64
    );
    println!("rank 0 collectives: {counts}");
    Ok(())
}
