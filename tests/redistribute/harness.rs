//! Running one case on a fresh launch, and comparing results with the oracle.

use std::sync::{Mutex, PoisonError};

use proptest::test_runner::{Config, FileFailurePersistence, TestCaseError};
use tessera::dtensor::testing::{Source, Transition, partial_local, test_values};
use tessera::dtensor::{DTensor, DType, Tensor, distribute_tensor_with_order};
use tessera::{BoxError, DeviceMesh, launch};

/// Cases per property when `PROPTEST_CASES` is not set.
const DEFAULT_CASES: u32 = 256;

/// The proptest configuration of every property: 256 cases unless `PROPTEST_CASES`
/// says otherwise, failures persisted under `target/` (out of git).
pub(crate) fn config() -> Config {
    // `Config::default()` reads the `PROPTEST_*` variables; keep its case count when
    // the variable is set.
    let mut c = Config::default();
    if std::env::var_os("PROPTEST_CASES").is_none() {
        c.cases = DEFAULT_CASES;
    }
    c.failure_persistence = Some(Box::new(FileFailurePersistence::Direct(
        "target/proptest-regressions/redistribute.txt",
    )));
    c.max_shrink_iters = 4096;
    c
}

/// One launch at a time in this binary: up to 8 rank threads per launch is already more
/// than the CI's cores, and tests running in parallel would multiply that. (It makes
/// the cases cheaper; it does not avoid the race of `bugs.rs`.)
static LAUNCH: Mutex<()> = Mutex::new(());

/// Runs `f` on every rank of a fresh mesh of `mesh_shape`; a failed launch (an error
/// or panic on any rank) fails the case.
pub(crate) fn on_mesh<T, F>(mesh_shape: &[usize], f: F) -> Result<Vec<T>, TestCaseError>
where
    T: Send + 'static,
    F: Fn(&DeviceMesh) -> Result<T, BoxError> + Send + Sync + 'static,
{
    let n = mesh_shape.iter().product();
    // A test that failed while holding the lock leaves nothing to clean up.
    let _one = LAUNCH.lock().unwrap_or_else(PoisonError::into_inner);
    let shape = mesh_shape.to_vec();
    launch(n, move |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), &shape)?;
        f(&mesh)
    })
    .map_err(|e| TestCaseError::fail(format!("launch on mesh {mesh_shape:?} failed: {e}")))
}

/// [`on_mesh`] on the case's source mesh, `f` getting the rank's own copy of the case.
pub(crate) fn on_case<T, F>(t: &Transition, f: F) -> Result<Vec<T>, TestCaseError>
where
    T: Send + 'static,
    F: Fn(&Transition, &DeviceMesh) -> Result<T, BoxError> + Send + Sync + 'static,
{
    let case = t.clone();
    on_mesh(&t.src.mesh_shape, move |mesh| f(&case, mesh))
}

/// The full tensor of a case (every rank and the oracle build the same one).
pub(crate) fn full_of(t: &Transition) -> Tensor {
    // INVARIANT: generated shapes are small.
    test_values(&t.src.shape, t.src.dtype).expect("small shape")
}

/// The case's source tensor on this rank: the full tensor distributed, or per-rank
/// partial values (with a known reduction) wrapped by `from_local`.
pub(crate) fn source(t: &Transition, mesh: &DeviceMesh) -> Result<DTensor, BoxError> {
    let full = full_of(t);
    Ok(match t.source {
        Source::Distribute => distribute_tensor_with_order(&full, mesh, &t.src.placements, t.src.order.clone())?,
        Source::FromLocal => {
            let local = partial_local(&full, &t.src, mesh.coordinate(), t.seed)?;
            DTensor::from_local_with_layout(local, mesh, t.src.clone())?
        }
    })
}

/// Whether `got` equals `want`: exactly, or (`approx`, for means) within a tight
/// tolerance for the dtype.
pub(crate) fn close(got: &Tensor, want: &Tensor, approx: bool) -> bool {
    if !approx {
        return got == want;
    }
    let (rtol, atol) = match want.dtype() {
        DType::F32 => (1e-5, 1e-3),
        _ => (1e-12, 1e-9),
    };
    got.allclose(want, rtol, atol)
}
