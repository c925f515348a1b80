//! The op harness: full inputs and, per mesh and input, drawn placements (and shard
//! order); every op runs on meshes `[2]`, `[4]` and `[2, 2]` (one launch per mesh
//! per case) and its `full_tensor()` on every rank is compared with the local
//! `Tensor` op on the full inputs.

use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};

use proptest::prelude::*;
use proptest::test_runner::{Config, FileFailurePersistence, TestCaseError};
use tessera::dtensor::testing::{order_from_keys, partial_local};
use tessera::dtensor::{
    DTensor, DType, Layout, Placement, PlacementsDisplay, ReduceOp, Result, Tensor, distribute_tensor_with_order,
};
use tessera::{BoxError, DeviceMesh, launch};

/// The meshes every case runs on.
pub(crate) const MESHES: [&[usize]; 3] = [&[2], &[4], &[2, 2]];

/// Cases per property when `PROPTEST_CASES` is not set.
const DEFAULT_CASES: u32 = 32;

/// Relative and absolute tolerance of `f64` results that went through arithmetic.
const RTOL: f64 = 1e-12;
const ATOL: f64 = 1e-12;

/// The proptest configuration: 32 cases unless `PROPTEST_CASES` says otherwise,
/// failures persisted under `target/` (out of git).
pub(crate) fn config() -> Config {
    let mut c = Config::default();
    if std::env::var_os("PROPTEST_CASES").is_none() {
        c.cases = DEFAULT_CASES;
    }
    c.failure_persistence = Some(Box::new(FileFailurePersistence::Direct(
        "target/proptest-regressions/ops.txt",
    )));
    c.max_shrink_iters = 1024;
    c
}

/// One launch at a time in this binary (up to 4 rank threads each on few cores).
static LAUNCH: Mutex<()> = Mutex::new(());

/// Runs `f` on every rank of a fresh mesh of `mesh_shape` and returns each rank's
/// result in rank order.
///
/// # Errors
/// The launch's error (a rank that failed or panicked), as a string.
pub(crate) fn on_mesh<T, F>(mesh_shape: &[usize], f: F) -> std::result::Result<Vec<T>, String>
where
    T: Send + 'static,
    F: Fn(&DeviceMesh) -> std::result::Result<T, BoxError> + Send + Sync + 'static,
{
    let n = mesh_shape.iter().product();
    let _one = LAUNCH.lock().unwrap_or_else(PoisonError::into_inner);
    let shape = mesh_shape.to_vec();
    launch(n, move |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), &shape)?;
        f(&mesh)
    })
    .map_err(|e| format!("launch on mesh {mesh_shape:?} failed: {e}"))
}

/// What an input holds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Kind {
    /// `f64` standard normal values (may be `Partial`).
    Float,
    /// `f64` values in `[0.25, 1.25)` (for log, sqrt, rsqrt and divisors; may be `Partial`).
    Positive,
    /// `i64` values in `0..bound` (indices, targets; never `Partial`).
    Index(i64),
}

/// One input of an op: its global shape and values.
#[derive(Clone, PartialEq)]
pub(crate) struct Arg {
    /// The global shape.
    pub shape: Vec<usize>,
    /// What it holds.
    pub kind: Kind,
}

impl fmt::Debug for Arg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.kind {
            Kind::Float => write!(f, "{:?}", self.shape),
            Kind::Positive => write!(f, "{:?}+", self.shape),
            Kind::Index(b) => write!(f, "{:?}<{b}", self.shape),
        }
    }
}

/// A float input of `shape`.
pub(crate) fn float(shape: &[usize]) -> Arg {
    Arg {
        shape: shape.to_vec(),
        kind: Kind::Float,
    }
}

/// A positive float input of `shape`.
pub(crate) fn positive(shape: &[usize]) -> Arg {
    Arg {
        shape: shape.to_vec(),
        kind: Kind::Positive,
    }
}

/// One float input per case, of each of `shapes`.
pub(crate) fn singles(shapes: &[&[usize]]) -> Vec<Vec<Arg>> {
    shapes.iter().map(|s| vec![float(s)]).collect()
}

/// An `i64` input of `shape` with values in `0..bound`.
pub(crate) fn index(shape: &[usize], bound: i64) -> Arg {
    Arg {
        shape: shape.to_vec(),
        kind: Kind::Index(bound),
    }
}

impl Arg {
    /// The placements one mesh dim may give this input: `Replicate`, `Shard(d)` of
    /// each dim, and `Partial(sum)` for floats.
    fn options(&self) -> Vec<Placement> {
        let mut out = vec![Placement::Replicate];
        out.extend((0..self.shape.len()).map(Placement::Shard));
        if !matches!(self.kind, Kind::Index(_)) {
            out.push(Placement::Partial(ReduceOp::Sum));
        }
        out
    }

    /// The full tensor of this input for `seed`.
    pub(crate) fn full(&self, seed: u64) -> Tensor {
        let t = match self.kind {
            Kind::Float => Tensor::randn(&self.shape, DType::F64, seed),
            Kind::Positive => Tensor::rand(&self.shape, DType::F64, seed).and_then(|t| t.add_scalar(0.25)),
            Kind::Index(bound) => {
                let n: usize = self.shape.iter().product();
                let v: Vec<i64> = (0..n as u64).map(|k| (mix(seed, k) % bound as u64) as i64).collect();
                Tensor::from_vec(v, &self.shape)
            }
        };
        // INVARIANT: the shapes of the cases are small and the dtypes fit the kinds.
        t.expect("a small test input")
    }
}

/// How the inputs are built on each rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Source {
    /// `distribute_tensor` of the full tensor (views; `Partial(sum)` holds the value
    /// on coordinate 0 and zeros elsewhere).
    Distribute,
    /// `from_local` of [`partial_local`]: random integer pieces whose sum is the value.
    Split,
}

/// One generated case: an op parameter, the inputs, and per mesh of [`MESHES`] and
/// per input, the placements.
#[derive(Clone)]
pub(crate) struct Case<P> {
    /// The op's parameter (dims, a target shape, ...).
    pub param: P,
    /// The inputs.
    pub args: Vec<Arg>,
    /// Seed of the input values.
    pub seed: u64,
    /// How inputs are built.
    pub source: Source,
    /// Seed of [`partial_local`].
    pub split_seed: u64,
    /// `placements[mesh][input]`.
    pub placements: Vec<Vec<Vec<Placement>>>,
    /// `reversed[mesh][input]`: a tensor dim sharded over several mesh dims is split
    /// by the last mesh dim first (not the default order).
    pub reversed: Vec<Vec<bool>>,
}

impl<P: fmt::Debug> fmt::Debug for Case<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:?} {:?} seed {} {:?}",
            self.param, self.args, self.seed, self.source
        )?;
        if self.source == Source::Split {
            write!(f, " (split seed {})", self.split_seed)?;
        }
        for ((m, ps), rev) in MESHES.iter().zip(&self.placements).zip(&self.reversed) {
            let ps: Vec<String> = ps
                .iter()
                .zip(rev)
                .map(|(p, &r)| format!("{}{}", PlacementsDisplay(p), if r { "(rev)" } else { "" }))
                .collect();
            write!(f, "; {m:?}: {}", ps.join(" "))?;
        }
        Ok(())
    }
}

impl<P> Case<P> {
    /// The full inputs.
    pub(crate) fn fulls(&self) -> Vec<Tensor> {
        self.args
            .iter()
            .enumerate()
            .map(|(i, a)| a.full(self.seed.wrapping_add(i as u64 * 7919)))
            .collect()
    }

    /// Whether any input is `Partial` on any mesh.
    fn has_partial(&self) -> bool {
        self.placements.iter().flatten().flatten().any(|p| p.is_partial())
    }
}

/// Cases drawn from `sets` (an op parameter and the inputs it goes with): values,
/// source, and independent placements for every mesh and input.
pub(crate) fn cases<P: Clone + fmt::Debug + 'static>(sets: Vec<(P, Vec<Arg>)>) -> impl Strategy<Value = Case<P>> {
    prop::sample::select(sets).prop_flat_map(|(param, args)| {
        let placements: Vec<Vec<_>> = MESHES
            .iter()
            .map(|m| {
                args.iter()
                    .map(|a| prop::collection::vec(prop::sample::select(a.options()), m.len()))
                    .collect()
            })
            .collect();
        let reversed: Vec<_> = MESHES
            .iter()
            .map(|_| prop::collection::vec(any::<bool>(), args.len()))
            .collect();
        (
            Just((param, args)),
            placements,
            reversed,
            any::<u64>(),
            prop_oneof![Just(Source::Distribute), Just(Source::Split)],
            any::<u64>(),
        )
            .prop_map(|((param, args), placements, reversed, seed, source, split_seed)| Case {
                param,
                args,
                seed,
                source,
                split_seed,
                placements,
                reversed,
            })
    })
}

/// Cases without an op parameter.
pub(crate) fn plain(sets: Vec<Vec<Arg>>) -> impl Strategy<Value = Case<()>> {
    cases(sets.into_iter().map(|a| ((), a)).collect())
}

type DistFn = Box<dyn Fn(&[DTensor]) -> Result<DTensor> + Send + Sync>;
type LocalFn = Box<dyn Fn(&[Tensor]) -> tessera::tensor::Result<Tensor> + Send + Sync>;

/// One op under test: the DTensor op and its single-device oracle (owning what they
/// use: the DTensor op runs on the ranks of a launch).
pub(crate) struct Op {
    /// Printed in failures.
    pub name: String,
    dist: DistFn,
    local: LocalFn,
    /// Whether the result must be bit-exact (data movement, no partial sums).
    exact: bool,
}

impl Op {
    /// An op compared with a tolerance.
    pub(crate) fn new(
        name: impl Into<String>,
        dist: impl Fn(&[DTensor]) -> Result<DTensor> + Send + Sync + 'static,
        local: impl Fn(&[Tensor]) -> tessera::tensor::Result<Tensor> + Send + Sync + 'static,
    ) -> Op {
        Op {
            name: name.into(),
            dist: Box::new(dist),
            local: Box::new(local),
            exact: false,
        }
    }

    /// The same op, bit-exact unless an input is `Partial`.
    pub(crate) fn exact(mut self) -> Op {
        self.exact = true;
        self
    }
}

/// An [`Op`] whose DTensor and Tensor forms are the same expression in `x` (the inputs).
/// Values the expression uses are copied into both forms; name those that are not
/// `Copy` in brackets, and each form gets its own clone: `op!(name, [dims], |x| ...)`.
#[macro_export]
macro_rules! op {
    ($name:expr, |$x:ident| $body:expr) => {
        $crate::op!($name, [], |$x| $body)
    };
    ($name:expr, [$($owned:ident),*], |$x:ident| $body:expr) => {
        $crate::harness::Op::new(
            $name,
            { $(let $owned = $owned.clone();)* move |$x: &[DTensor]| $body },
            { $(let $owned = $owned.clone();)* move |$x: &[Tensor]| $body },
        )
    };
}

/// The inputs of `case` on this rank of `mesh` (mesh `m` of [`MESHES`]).
fn inputs<P>(case: &Case<P>, fulls: &[Tensor], m: usize, mesh: &DeviceMesh) -> Result<Vec<DTensor>> {
    fulls
        .iter()
        .zip(&case.placements[m])
        .zip(&case.reversed[m])
        .map(|((full, p), &rev)| {
            let keys: Vec<u8> = (0..p.len())
                .map(|d| if rev { (p.len() - d) as u8 } else { 0 })
                .collect();
            let order = order_from_keys(p, &keys)?;
            match case.source {
                Source::Distribute => distribute_tensor_with_order(full, mesh, p, order),
                Source::Split => {
                    let layout = Layout::with_order(mesh.shape(), p, order, full.shape(), full.dtype())?;
                    let local = partial_local(full, &layout, mesh.coordinate(), case.split_seed)?;
                    DTensor::from_local_with_layout(local, mesh, layout)
                }
            }
        })
        .collect()
}

/// Whether `got` matches `want` (shape and dtype, then values exactly or within the
/// tolerance).
fn matches(got: &Tensor, want: &Tensor, exact: bool) -> bool {
    if exact {
        got == want
    } else {
        got.allclose(want, RTOL, ATOL)
    }
}

/// Runs every op of `ops` on the inputs of `case`, on each mesh of [`MESHES`] (one
/// launch per mesh), and compares every rank's `full_tensor()` of each result with
/// the op on the full inputs.
pub(crate) fn check<P>(case: Case<P>, ops: impl Into<Arc<[Op]>>) -> std::result::Result<(), TestCaseError>
where
    P: fmt::Debug + Send + Sync + 'static,
{
    let (case, ops) = (Arc::new(case), ops.into());
    let fulls: Arc<[Tensor]> = case.fulls().into();
    let mut wants = Vec::with_capacity(ops.len());
    for op in ops.iter() {
        let want = (op.local)(&fulls).map_err(|e| TestCaseError::fail(format!("oracle {}: {e}", op.name)))?;
        wants.push(want);
    }
    // Partial pieces from `Split` are sums of integers and the value: exact only
    // when nothing is partial or `Distribute` added zeros.
    let exact_ok = !case.has_partial() || case.source == Source::Distribute;
    for (m, mesh_shape) in MESHES.iter().enumerate() {
        let outs = on_mesh(mesh_shape, {
            let (case, fulls, ops) = (case.clone(), fulls.clone(), ops.clone());
            move |mesh| {
                let xs = inputs(&case, &fulls, m, mesh)?;
                let mut out = Vec::with_capacity(ops.len());
                for op in ops.iter() {
                    let y = (op.dist)(&xs).map_err(|e| format!("{}: {e}", op.name))?;
                    let placements = y.placements().to_vec();
                    let full = y.full_tensor().map_err(|e| format!("{} full_tensor: {e}", op.name))?;
                    out.push((placements, full));
                }
                Ok(out)
            }
        })
        .map_err(TestCaseError::fail)?;
        for (rank, out) in outs.iter().enumerate() {
            for ((op, want), (placements, got)) in ops.iter().zip(&wants).zip(out) {
                prop_assert!(
                    matches(got, want, op.exact && exact_ok),
                    "{} on mesh {:?}, rank {}: output {} gave\n{:?}\nwant\n{:?}",
                    op.name,
                    mesh_shape,
                    rank,
                    PlacementsDisplay(placements),
                    got,
                    want
                );
            }
        }
    }
    Ok(())
}

/// A 64-bit mix of two values (SplitMix64 finaliser).
fn mix(seed: u64, k: u64) -> u64 {
    let mut z = seed ^ k.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}
