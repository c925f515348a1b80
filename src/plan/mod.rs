//! Predict, then run: a training step planned on meta tensors measures, per
//! rank, the memory, the collectives and the matrix-product FLOPs of the same
//! step on real tensors, without computing, communicating or allocating it.
//!
//! The model is built deferred, parallelised and sharded exactly as for
//! training, then materialised on the meta device
//! ([`Materializer::on_meta`](crate::autograd::nn::Materializer::on_meta)): every op checks its arguments and yields a
//! meta output of the right shape, whose bytes the memory tracker charges as
//! it would the real tensor's; every collective is counted on its
//! communicator as issuing it would count it
//! ([`Communicator::count_planned`](crate::Communicator::count_planned)), with
//! no data moved and no peer met. The tracker's peaks are then the real
//! step's, the counters its collectives, exactly, except where a collective
//! overlaps computation: a planned collective holds its buffers until it is
//! waited for, the latest a real one can finish, so a planned peak bounds the
//! real one from above by at most the buffers in flight.
//!
//! PyTorch: `FakeTensorMode` under `torch.distributed._tools`' memory
//! tracker and runtime estimator, which run the step on tensors without data.
//!
//! ```
//! use tessera::autograd::nn::{Materializer, Module};
//! use tessera::autograd::optim::{AdamW, AdamWConfig};
//! use tessera::dtensor::{DType, Layout, Placement};
//! use tessera::fsdp::FsdpConfig;
//! use tessera::models::{CausalLm, Transformer, TransformerConfig};
//! use tessera::plan::plan_step;
//! use tessera::{DeviceMesh, launch};
//!
//! let plans = launch(2, |ctx| {
//!     let mesh = DeviceMesh::new(ctx.into_comm(), &[2])?;
//!     let cfg = TransformerConfig::TINY;
//!     let model = Transformer::new(cfg, &mesh, DType::F32)?;
//!     model.fully_shard(&mesh, &FsdpConfig::default())?;
//!     Materializer::on_meta().materialize(&model)?; // shapes, no values
//!     let mut opt = AdamW::new(model.parameters(), AdamWConfig::default())?;
//!     let batch = Layout::new(&[2], &[Placement::Shard(0)], &[4, cfg.seq + 1], DType::I64)?;
//!     Ok(plan_step(&mesh, &mut opt, &batch, |rows| model.loss(rows))?)
//! })?;
//! // Forward gathers each block, backward gathers and reduce-scatters it.
//! assert!(plans[0].peak_bytes() > plans[0].held_bytes);
//! assert!(plans[0].collective_calls() > 0 && plans[0].gemm_flops > 0);
//! # Ok::<(), tessera::BoxError>(())
//! ```

use std::collections::BTreeMap;
use std::fmt::{self, Write as _};

use tessera_autograd::optim::Optimizer;
use tessera_autograd::{Var, backward};
use tessera_dtensor::{DTensor, Layout, Tensor};
use tessera_mesh::observe::{self, CommReport};
use tessera_mesh::{BoxError, DeviceMesh, OpKind};
use tessera_tensor::memory::{Category, category_stats, reset_peak, stats};
use tessera_tensor::profile;

mod machine;
pub use machine::{GroupRate, Machine};

/// The phases of a training step whose peaks a [`StepPlan`] holds.
pub const PHASES: [&str; 3] = ["forward", "backward", "optimizer"];

/// One rank's planned training step: see the [module docs](self).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepPlan {
    /// Bytes this rank holds between steps: its shards of the parameters and
    /// of the optimizer state, and whatever else it keeps.
    pub held_bytes: usize,
    /// The most bytes this rank holds during the forward pass, the backward
    /// pass and the optimizer's step ([`PHASES`]), everything held included.
    pub phase_peak_bytes: [usize; 3],
    /// Collectives by mesh dims (`"dp"`, `"dp_shard×tp"`, ...) and kind:
    /// calls, and bytes this rank sends.
    pub collectives: BTreeMap<(String, OpKind), (u64, u64)>,
    /// The shape of this rank's group over each mesh dims of `collectives`:
    /// its ranks and the world ranks between neighbours (0 where they are not
    /// evenly spaced), for the bandwidth of that shape ([`GroupRate`]).
    pub collective_groups: BTreeMap<String, (usize, usize)>,
    /// Floating-point operations of the step's matrix products on this rank
    /// (linear layers and attention, forward and backward).
    pub gemm_flops: u64,
    /// Of `gemm_flops`, those of products in 16-bit floats (bf16 mixed
    /// precision), which run at their own rate.
    pub half_flops: u64,
    /// DTensor ops the step dispatches on this rank (each with its local
    /// kernels and redistributions).
    pub ops: u64,
    /// Bytes of this rank's shards of the parameters (part of `held_bytes`;
    /// the rest held is the optimizer's state).
    pub param_bytes: usize,
    /// Where the step's peak falls: the innermost module running (`""` for
    /// the root, `"(none)"` outside every module) and its phase, at the
    /// largest of the tracker's samples after each op.
    pub peak_at: String,
    /// Bytes of tensor storage the step allocates on this rank (every op's
    /// outputs, each counted once): its memory traffic beyond the products.
    pub allocated_bytes: usize,
    /// Elements of those outputs, whatever their dtype: element-wise
    /// kernels cost per element (a bf16 element about what an f32 one does).
    pub allocated_elements: usize,
    /// Bytes the forward pass adds to what the rank holds, by kind of module
    /// (a block's `attention`, `feed_forward`, `attention_norm`, ...; the
    /// root's children by name, such as `output`, whose logits these are):
    /// the activations each keeps for backward, summed over the blocks.
    /// FSDP's gathered parameters count where they are gathered (`(block)`,
    /// `(root)`), so the activations stand apart from them.
    pub forward_bytes_by_module: BTreeMap<String, i64>,
    /// The bytes held at the step's peak by what holds them (sharded and
    /// gathered parameters, gradients, gradients waiting to be reduced,
    /// optimizer state, activations and temporaries, collective buffers in
    /// flight): they sum to [`peak_bytes`](Self::peak_bytes).
    pub peak_by_category: BTreeMap<Category, usize>,
}

impl StepPlan {
    /// The most bytes this rank holds during the step.
    pub fn peak_bytes(&self) -> usize {
        self.phase_peak_bytes.into_iter().max().unwrap_or(0)
    }

    /// The phase ([`PHASES`]) in which the peak falls.
    pub fn peak_phase(&self) -> &'static str {
        PHASES[peak_phase_index(&self.phase_peak_bytes)]
    }

    /// Collectives of the step.
    pub fn collective_calls(&self) -> u64 {
        self.collectives.values().map(|c| c.0).sum()
    }

    /// Bytes this rank sends in the step's collectives.
    pub fn collective_bytes(&self) -> u64 {
        self.collectives.values().map(|c| c.1).sum()
    }

    /// The step's time on a machine: its matrix products at `machine`'s
    /// rate, its outputs' elements written and read at its copy rate (four
    /// bytes each, whatever their dtype), its collectives' bytes at the
    /// bandwidth of their groups' shape plus a latency per collective, and
    /// an overhead per op (dispatch and the element-wise
    /// kernels between products). Computation and communication are added:
    /// an upper bound where they overlap.
    pub fn step_time_s(&self, machine: &Machine) -> f64 {
        (self.gemm_flops - self.half_flops) as f64 / machine.flops_per_s
            + self.half_flops as f64 / machine.half_flops_per_s
            + (4 * self.allocated_elements) as f64 / machine.copy_bytes_per_s
            + self
                .collectives
                .iter()
                .map(|((dims, _), &(_, bytes))| {
                    let (size, stride) = self.collective_groups.get(dims).copied().unwrap_or((0, 0));
                    bytes as f64 / machine.bytes_per_s_over(size, stride)
                })
                .sum::<f64>()
            + self.collective_calls() as f64 * machine.collective_latency_s
            + self.ops as f64 * machine.op_s
    }

    /// The plan as a table: memory, then the collectives by mesh dims and kind.
    pub fn table(&self) -> String {
        let mib = |b: usize| b as f64 / (1u64 << 20) as f64;
        let mut out = String::new();
        let _ = writeln!(
            out,
            "  held between steps      {:>10.2} MiB (parameters {:.2}, optimizer state and the rest {:.2})",
            mib(self.held_bytes),
            mib(self.param_bytes),
            mib(self.held_bytes.saturating_sub(self.param_bytes))
        );
        for (name, b) in PHASES.iter().zip(self.phase_peak_bytes) {
            let _ = writeln!(out, "  peak in {name:<15} {:>10.2} MiB", mib(b));
        }
        let _ = writeln!(out, "  matrix-product FLOPs    {:>10.3e}", self.gemm_flops as f64);
        let _ = writeln!(out, "  DTensor ops             {:>10}", self.ops);
        let _ = writeln!(out, "  bytes allocated         {:>10.2} MiB", mib(self.allocated_bytes));
        let _ = writeln!(out, "  peak at                 {}", self.peak_at);
        for (category, bytes) in &self.peak_by_category {
            let _ = writeln!(
                out,
                "    {:<21} {:>10.2} MiB",
                category.name().replace('_', " "),
                mib(*bytes)
            );
        }
        for (module, bytes) in &self.forward_bytes_by_module {
            let _ = writeln!(
                out,
                "  forward keeps, {module:<14} {:>10.2} MiB",
                *bytes as f64 / (1u64 << 20) as f64
            );
        }
        for ((dims, kind), (calls, bytes)) in &self.collectives {
            let _ = writeln!(
                out,
                "  {dims:<22} {:<15} {calls:>5} calls {bytes:>12} bytes",
                kind.name()
            );
        }
        out
    }

    /// The plan as JSON: `{"held_bytes", "phase_peak_bytes": {phase: bytes},
    /// "peak_bytes", "peak_phase", "gemm_flops", "half_flops", "ops",
    /// "param_bytes", "allocated_bytes", "allocated_elements", "peak_at", "collectives":
    /// [{"mesh_dims", "group_size", "group_stride", "collective", "calls",
    /// "bytes"}], "peak_by_category":
    /// {category: bytes}, "forward_bytes_by_module": {module: bytes}}`.
    pub fn to_json(&self) -> String {
        let mut out = format!("{{\"held_bytes\": {}, \"phase_peak_bytes\": {{", self.held_bytes);
        for (i, (name, b)) in PHASES.iter().zip(self.phase_peak_bytes).enumerate() {
            let _ = write!(out, "{}\"{name}\": {b}", if i > 0 { ", " } else { "" });
        }
        let _ = write!(
            out,
            "}}, \"peak_bytes\": {}, \"peak_phase\": \"{}\", \"gemm_flops\": {}, \"half_flops\": {}, \"ops\": {}, \"param_bytes\": {}, \"allocated_bytes\": {}, \"allocated_elements\": {}, \"peak_at\": {}, \"collectives\": [",
            self.peak_bytes(),
            self.peak_phase(),
            self.gemm_flops,
            self.half_flops,
            self.ops,
            self.param_bytes,
            self.allocated_bytes,
            self.allocated_elements,
            observe::json_string(&self.peak_at)
        );
        for (i, ((dims, kind), (calls, bytes))) in self.collectives.iter().enumerate() {
            let (size, stride) = self.collective_groups.get(dims).copied().unwrap_or((0, 0));
            let _ = write!(
                out,
                "{}{{\"mesh_dims\": {}, \"group_size\": {size}, \"group_stride\": {stride}, \"collective\": \"{}\", \"calls\": {calls}, \"bytes\": {bytes}}}",
                if i > 0 { ", " } else { "" },
                observe::json_string(dims),
                kind.name()
            );
        }
        out.push_str("], \"peak_by_category\": {");
        for (i, (category, bytes)) in self.peak_by_category.iter().enumerate() {
            let _ = write!(out, "{}\"{}\": {bytes}", if i > 0 { ", " } else { "" }, category.name());
        }
        out.push_str("}, \"forward_bytes_by_module\": {");
        for (i, (module, bytes)) in self.forward_bytes_by_module.iter().enumerate() {
            let _ = write!(
                out,
                "{}{}: {bytes}",
                if i > 0 { ", " } else { "" },
                observe::json_string(module)
            );
        }
        out.push_str("}}");
        out
    }
}

/// The index in [`PHASES`] of the phase with the most bytes (the first of
/// equal ones).
fn peak_phase_index(peaks: &[usize; 3]) -> usize {
    (0..3).max_by_key(|&i| (peaks[i], 3 - i)).unwrap_or(0)
}

/// [`StepPlan::forward_bytes_by_module`] from a step's events: the change of
/// the rank's bytes from one memory sample (taken after each op) to the next,
/// credited to the kind of module the op ran in, over the forward pass.
fn forward_by_module(events: &[observe::Event], start: usize) -> BTreeMap<String, i64> {
    let mut out = BTreeMap::new();
    let mut last = start as i64;
    for e in events {
        let observe::What::Memory(bytes) = e.what else {
            continue;
        };
        let delta = bytes as i64 - last;
        last = bytes as i64;
        let Some((fqn, observe::Phase::Forward)) = &e.module else {
            continue;
        };
        let parts: Vec<&str> = fqn.split('.').collect();
        let kind = match parts[..] {
            [""] => "(root)".to_string(),
            ["layers", _] => "(block)".to_string(),
            ["layers", _, child, ..] => child.to_string(),
            [first, ..] => first.to_string(),
            [] => "(root)".to_string(),
        };
        *out.entry(kind).or_insert(0) += delta;
    }
    out
}

impl fmt::Display for StepPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.table())
    }
}

/// The shape of this rank's group over the mesh dims `label` names
/// (`"dp_shard×tp"`): its ranks, and the world ranks between neighbours
/// (row-major over `mesh`: the dims after the last named one), 0 where the
/// named dims are not adjacent (ranks not evenly spaced); `(0, 0)` for a
/// label naming a dim `mesh` lacks.
fn group_of(mesh: &DeviceMesh, label: &str) -> (usize, usize) {
    let (names, shape) = (mesh.names(), mesh.shape());
    let Some(mut dims) = label
        .split('×')
        .map(|n| names.iter().position(|m| m == n))
        .collect::<Option<Vec<usize>>>()
    else {
        return (0, 0);
    };
    dims.sort_unstable();
    let size = dims.iter().map(|&d| shape[d]).product();
    let adjacent = dims.windows(2).all(|w| w[1] == w[0] + 1);
    let stride = match dims.last() {
        Some(&last) if adjacent => shape[last + 1..].iter().product(),
        _ => 0,
    };
    (size, stride)
}

/// Plans one training step on this rank: the model's parameters must be on the
/// meta device ([`Materializer::on_meta`]), `loss` computes the step's loss
/// from a batch of token rows laid out as `batch` (global shape and placements
/// on `mesh`), and `opt` steps the parameters; the loss is read after the
/// step, as a training loop reads it. Runs two steps (the second with the
/// optimizer's state in place, as every later step) and measures the second.
/// Collective: every rank of `mesh` calls it.
///
/// [`Materializer::on_meta`]: tessera_autograd::nn::Materializer::on_meta
///
/// # Errors
/// Parameters that are not on meta; the step's own errors (shapes that do not
/// fit, placements a plan cannot serve), on every rank alike.
pub fn plan_step(
    mesh: &DeviceMesh,
    opt: &mut dyn Optimizer,
    batch: &Layout,
    loss: impl Fn(&Var) -> tessera_autograd::Result<Var>,
) -> Result<StepPlan, BoxError> {
    // The planned steps are not the program's: an op log or `TESSERA_DEBUG`
    // echo open on the rank neither sees them nor is ended by the recording
    // the plan makes of its own step.
    observe::unrecorded(|| plan_unrecorded(mesh, opt, batch, loss))
}

/// [`plan_step`], with no recording of the caller's open on the thread.
fn plan_unrecorded(
    mesh: &DeviceMesh,
    opt: &mut dyn Optimizer,
    batch: &Layout,
    loss: impl Fn(&Var) -> tessera_autograd::Result<Var>,
) -> Result<StepPlan, BoxError> {
    let local_shape = batch.local_shape(mesh.coordinate())?;
    let mut plan = StepPlan::default();
    let profiling = profile::enabled();
    let (mut allocated_before, mut elements_before) = (0, 0);
    for step in 0..2 {
        let rows = DTensor::from_local_with_layout(Tensor::meta(&local_shape, batch.dtype)?, mesh, batch.clone())?;
        let last = step == 1;
        let recording = last.then(observe::record);
        if last {
            profile::enable(true);
            let _ = profile::take();
            let _ = profile::take_half_flops();
            plan.held_bytes = stats().current_bytes;
            allocated_before = tessera_tensor::memory::allocated_bytes();
            elements_before = tessera_tensor::memory::allocated_elements();
        }
        let (peaks, categories) = run_step(rows, opt, &loss)?;
        if last {
            plan.allocated_bytes = tessera_tensor::memory::allocated_bytes() - allocated_before;
            plan.allocated_elements = tessera_tensor::memory::allocated_elements() - elements_before;
            let p = profile::take();
            // Timing is on for every thread: turned back only once every rank
            // has counted its step.
            mesh.comm().barrier()?;
            profile::enable(profiling);
            plan.gemm_flops = profile::Kind::ALL.iter().map(|&k| p.flops(k)).sum();
            plan.half_flops = profile::take_half_flops();
            plan.phase_peak_bytes = peaks;
            plan.peak_by_category = Category::ALL
                .into_iter()
                .zip(categories[peak_phase_index(&peaks)])
                .collect();
            let events = recording.map(observe::Recording::finish).unwrap_or_default();
            record_events(&mut plan, &events);
            plan.param_bytes = opt
                .params()
                .iter()
                .map(|p| p.value().map_or(0, |v| v.to_local().size_in_bytes()))
                .sum();
            record_collectives(&mut plan, mesh, &events);
        }
    }
    Ok(plan)
}

/// Runs one step on `rows`: each phase's peak bytes and its bytes by category at that peak.
fn run_step(
    rows: DTensor,
    opt: &mut dyn Optimizer,
    loss: &impl Fn(&Var) -> tessera_autograd::Result<Var>,
) -> Result<([usize; 3], [[usize; 7]; 3]), BoxError> {
    let mut peaks = [0; 3];
    let mut categories = [[0; 7]; 3];
    reset_peak();
    // The batch is the model's to keep (what backward needs of it) or drop.
    let l = loss(&Var::constant(rows));
    peaks[0] = stats().peak_bytes;
    categories[0] = category_stats().at_peak;
    let l = l?;
    if l.value().to_local().numel() > 0 && !l.value().to_local().is_meta() {
        return Err("plan_step: the loss has values: materialise the model with Materializer::on_meta".into());
    }
    reset_peak();
    let b = backward(&l);
    peaks[1] = stats().peak_bytes;
    categories[1] = category_stats().at_peak;
    b?;
    reset_peak();
    let o = opt.step();
    opt.zero_grad();
    peaks[2] = stats().peak_bytes;
    categories[2] = category_stats().at_peak;
    o?;
    // The loss read after the step, as a training loop reads it (a
    // gather of one scalar where it is split or partial).
    drop(l.value().full_tensor()?);
    drop(l);
    Ok((peaks, categories))
}

/// Sets `plan`'s op count, forward bytes by module and peak's place from the recorded `events`.
fn record_events(plan: &mut StepPlan, events: &[observe::Event]) {
    plan.ops = events.iter().filter(|e| matches!(e.what, observe::What::Op(_))).count() as u64;
    plan.forward_bytes_by_module = forward_by_module(events, plan.held_bytes);
    let peak = events
        .iter()
        .filter_map(|e| match e.what {
            observe::What::Memory(b) => Some((b, e)),
            _ => None,
        })
        .max_by_key(|(b, _)| *b);
    plan.peak_at = match peak.and_then(|(_, e)| e.module.as_ref()) {
        Some((m, phase)) => format!("{} {}", if m.is_empty() { "(root)" } else { m }, phase.name()),
        None => "(none)".to_string(),
    };
}

/// Sets `plan`'s collectives to the recorded `events`' ones, with their groups' shapes on `mesh`.
fn record_collectives(plan: &mut StepPlan, mesh: &DeviceMesh, events: &[observe::Event]) {
    plan.collectives = CommReport::from_events(events).by_dims();
    for (dims, _) in plan.collectives.keys() {
        plan.collective_groups.insert(dims.clone(), group_of(mesh, dims));
    }
}

#[cfg(test)]
mod tests {
    use tessera_mesh::launch;

    use super::*;

    /// A mesh dim's group: its size, and the world ranks between neighbours
    /// (row-major); flattened adjacent dims are one group, others uneven.
    #[test]
    fn groups_have_the_shape_of_their_mesh_dims() {
        let shapes = launch(8, |ctx| {
            let mesh = DeviceMesh::with_names(ctx.into_comm(), &[2, 2, 2], &["r", "s", "t"])?;
            Ok(["r", "s", "t", "s×t", "r×s", "r×t", "r×s×t", "x"].map(|l| group_of(&mesh, l)))
        })
        .unwrap();
        assert_eq!(
            shapes[0],
            [(2, 4), (2, 2), (2, 1), (4, 1), (4, 2), (4, 0), (8, 1), (0, 0)]
        );
    }

    /// A step's collectives go at the rate of their groups' shape: slowing the
    /// shape of one dim's groups slows the estimate by that dim's bytes alone.
    #[test]
    fn collectives_take_the_bandwidth_of_their_groups() {
        let mut plan = StepPlan::default();
        plan.collectives.insert(("r".into(), OpKind::AllReduce), (1, 1_000_000));
        plan.collectives.insert(("t".into(), OpKind::AllGather), (1, 4_000_000));
        plan.collective_groups.insert("r".into(), (2, 4));
        plan.collective_groups.insert("t".into(), (2, 1));
        let machine = Machine {
            flops_per_s: 1e12,
            half_flops_per_s: 1e12,
            bytes_per_s: 1e9,
            groups: Vec::new(),
            collective_latency_s: 0.0,
            op_s: 0.0,
            copy_bytes_per_s: 1e12,
            ranks: 8,
        };
        let flat = plan.step_time_s(&machine);
        assert!((flat - 5e-3).abs() < 1e-12, "{flat}");
        let across_nodes = Machine {
            groups: vec![GroupRate {
                size: 2,
                stride: 4,
                bytes_per_s: 1e8,
            }],
            ..machine.clone()
        };
        // The outer dim's megabyte at a tenth of the rate: 10 ms instead of 1.
        let slow = plan.step_time_s(&across_nodes);
        assert!((slow - 14e-3).abs() < 1e-12, "{slow}");
        // Saved and read back, rates and shapes alike.
        let back = Machine::from_json(&across_nodes.to_json()).unwrap();
        assert_eq!(back.bytes_per_s_over(2, 4), 1e8);
        assert_eq!(back.bytes_per_s_over(2, 1), 1e9);
        let bad = across_nodes.to_json().replace("\"stride\": 4", "\"stride\": 0");
        let e = Machine::from_json(&bad).unwrap_err().to_string();
        assert!(e.contains("\"stride\""), "{e}");
    }

    /// Calibration on 4 ranks measures every group shape a mesh dim can have
    /// (2 ranks adjacent, 2 ranks 2 apart), every rank with rank 0's rates.
    #[test]
    fn calibration_measures_every_group_shape() {
        let machines = launch(4, |ctx| {
            let mesh = DeviceMesh::new(ctx.into_comm(), &[4])?;
            Machine::calibrate(&mesh)
        })
        .unwrap();
        let shapes: Vec<(usize, usize)> = machines[0].groups.iter().map(|g| (g.size, g.stride)).collect();
        assert_eq!(shapes, [(2, 1), (2, 2)]);
        assert!(
            machines[0]
                .groups
                .iter()
                .all(|g| g.bytes_per_s > 0.0 && g.bytes_per_s.is_finite())
        );
        assert!(
            machines.iter().all(|m| *m == machines[0]),
            "every rank has rank 0's constants"
        );
    }
}
