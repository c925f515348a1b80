//! The op log's entries ([`tessera_mesh::observe::record_ops`]): DTensor ops and
//! explicit redistributes described in one notation,
//! `f32[8,32,64] (Shard(0), Replicate)` on `mesh(dp=2, tp=2)`.

use tessera_mesh::DeviceMesh;
use tessera_mesh::observe::{self, Moved, OpRecord, PlanStep, TensorDesc};

use crate::redistribute::{Plan, StepKind};
use crate::{DTensor, PlacementsDisplay};

/// `x` as the op log prints it.
pub fn describe(x: &DTensor) -> TensorDesc {
    TensorDesc {
        shape: x.shape().to_vec(),
        dtype: x.dtype(),
        placements: PlacementsDisplay(x.placements()).to_string(),
    }
}

/// `mesh(dp=2, tp=4)`, or `mesh(2, 4)` for a mesh without dim names.
pub fn mesh_string(mesh: &DeviceMesh) -> String {
    let dims: Vec<String> = mesh
        .shape()
        .iter()
        .enumerate()
        .map(|(d, n)| match mesh.names().get(d) {
            Some(name) => format!("{name}={n}"),
            None => n.to_string(),
        })
        .collect();
    format!("mesh({})", dims.join(", "))
}

/// Adds the op-log entry of `op` on `inputs` giving `out` when this thread
/// records an op log (`moved`, the inputs redistributed first, is computed
/// only then).
pub(crate) fn log_op(
    op: &'static str,
    inputs: &[&DTensor],
    out: &DTensor,
    explicit: bool,
    moved: impl FnOnce() -> Vec<Moved>,
) {
    if let Some(values) = observe::logging_ops() {
        observe::op_log(op_record(op, inputs, moved(), out, explicit, values));
    }
}

/// The op-log entry of `op` on `inputs` giving `out`.
fn op_record(
    op: &'static str,
    inputs: &[&DTensor],
    moved: Vec<Moved>,
    out: &DTensor,
    explicit: bool,
    values: bool,
) -> OpRecord {
    OpRecord {
        op,
        mesh: mesh_string(out.mesh()),
        inputs: inputs.iter().map(|x| describe(x)).collect(),
        moved,
        output: describe(out),
        explicit,
        values: values.then(|| global_sums(out)).flatten(),
    }
}

/// Input `input`'s redistribution by `plan` on `mesh`, as the op log shows it:
/// its target placements and each step's kind, mesh dims (labelled as the
/// collectives over them are) and bytes this rank sends.
pub(crate) fn moved(input: usize, plan: &Plan, mesh: &DeviceMesh) -> Moved {
    let plan_steps = plan
        .steps
        .iter()
        .map(|s| PlanStep {
            kind: match (s.collective(), &s.kind) {
                (Some(c), _) => c.to_string(),
                (None, StepKind::Partition { .. }) => "partition".to_string(),
                (None, StepKind::Slice) => "slice".to_string(),
                (None, _) => "local copy".to_string(),
            },
            mesh_dims: mesh.dims_label(&s.mesh_dims),
            bytes: s.bytes,
        })
        .collect();
    Moved {
        input,
        to: PlacementsDisplay(&plan.dst().placements).to_string(),
        plan: plan_steps,
    }
}

/// Sum, sum of absolute values and sum of squares of `x`'s global value, in
/// `f64` (gathered unrecorded; `None` for values that cannot be read).
fn global_sums(x: &DTensor) -> Option<[f64; 3]> {
    let full = observe::unrecorded(|| x.full_tensor()).ok()?;
    let host = full.to(tessera_tensor::Device::Cpu).ok()?;
    Some(
        host.to_f64_vec()
            .iter()
            .fold([0.0; 3], |[s, a, q], &v| [s + v, a + v.abs(), q + v * v]),
    )
}
