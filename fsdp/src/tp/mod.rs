//! Tensor parallelism: [`parallelize_module`] applies [`ParallelStyle`]s to the
//! modules of a model named by a [`ParallelPlan`].
//!
//! ```
//! use tessera_autograd::nn::{Linear, Materializer, Module};
//! use tessera_autograd::Var;
//! use tessera_dtensor::{distribute_tensor, DType, Placement, Tensor};
//! use tessera_fsdp::tp::{parallelize_module, ColwiseParallel, ParallelPlan, RowwiseParallel};
//! use tessera_mesh::{launch, DeviceMesh};
//!
//! /// An MLP: `down(gelu(up(x)))`.
//! struct Mlp {
//!     up: Linear,
//!     down: Linear,
//! }
//!
//! impl Module for Mlp {
//!     fn named_children(&self) -> Vec<(String, &dyn Module)> {
//!         vec![("up".into(), &self.up), ("down".into(), &self.down)]
//!     }
//!     fn forward(&self, x: &Var) -> tessera_autograd::Result<Var> {
//!         self.down.call(&self.up.call(x)?.gelu()?)
//!     }
//! }
//!
//! let out = launch(2, |ctx| {
//!     let mesh = DeviceMesh::with_names(ctx.into_comm(), &[2], &["tp"])?;
//!     let mlp = Mlp {
//!         up: Linear::new(4, 8, true, &mesh, DType::F32)?,
//!         down: Linear::new(8, 4, true, &mesh, DType::F32)?,
//!     };
//!     // Materialised replicated here, to compare; built deferred, it would be
//!     // materialised after the plan, each rank drawing only its shards.
//!     Materializer::from_seed(0).materialize(&mlp)?;
//!     let x = Var::constant(distribute_tensor(&Tensor::randn(&[3, 4], DType::F32, 5)?, &mesh, &[Placement::Replicate])?);
//!     let before = mlp.call(&x)?.value().full_tensor()?;
//!     // Megatron's MLP: `up` column-wise, `down` row-wise; one all-reduce in forward.
//!     let plan = ParallelPlan::new()
//!         .add("up", ColwiseParallel::default())
//!         .add("down", RowwiseParallel::default());
//!     parallelize_module(&mlp, &mesh, &plan)?;
//!     assert_eq!(mlp.up.weight.value()?.placements(), &[Placement::Shard(0)]);
//!     assert_eq!(mlp.down.weight.value()?.placements(), &[Placement::Shard(1)]);
//!     let y = mlp.call(&x)?;
//!     assert_eq!(y.value().placements(), &[Placement::Replicate]);
//!     let after = y.value().full_tensor()?.to_f64_vec();
//!     Ok(after.iter().zip(before.to_f64_vec()).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max))
//! })
//! .unwrap();
//! assert!(out[0] < 1e-5);
//! ```
//!
//! A user's model becomes parallelizable by listing its children
//! ([`Module::named_children`]) and calling them with [`Module::call`]: the styles
//! find their modules by fully qualified name and act through hooks. Activations
//! stay DTensors, so the model's forward is written with global shapes and runs on
//! local shards wherever the placements allow (attention after column-parallel
//! q/k/v runs `n_heads / tp` heads per rank).
//!
//! Parameters may live on a larger mesh (`("dp", "tp")`): pass `mesh.dim("tp")` as
//! the tp mesh; the styles change only the tp dim's placements, and the other dims
//! (data parallel) keep theirs. Apply tensor parallelism before `fully_shard`.
//!
//! Cross entropy on class-sharded logits (a column-parallel output head with
//! `output_layouts: Shard(-1)`) moves only per-row statistics, never the logits
//! (PyTorch: `loss_parallel`): see `Var::cross_entropy`.
//!
//! PyTorch: `torch.distributed.tensor.parallel`.

mod style;

use std::rc::Rc;

use tessera_autograd::nn::{Module, ModuleId, named_modules};
use tessera_mesh::DeviceMesh;

use crate::{Error, Result};

pub use style::{
    ColwiseParallel, ParallelStyle, PrepareModuleInput, PrepareModuleOutput, RowwiseParallel, SequenceParallel,
    StyleCtx, TpLayout,
};

/// A module's name in messages: `` `layers.0.attention.wq` ``, or "the root module".
pub(crate) fn at(fqn: &str) -> String {
    if fqn.is_empty() {
        "the root module".into()
    } else {
        format!("`{fqn}`")
    }
}

/// The error of a plan or style that does not fit (see [`Error::TensorParallel`]).
pub(crate) fn tp_error(detail: String) -> Error {
    Error::TensorParallel { detail }
}

/// The dim of `mesh` that `tp` is (a 1-D mesh taken with `mesh.dim(..)`, or
/// `mesh` itself when it is 1-D).
pub(crate) fn tp_dim(mesh: &DeviceMesh, tp: &DeviceMesh) -> Option<usize> {
    if mesh.same_as(tp) {
        return (mesh.ndim() == 1).then_some(0);
    }
    (0..mesh.ndim()).find(|&i| {
        mesh.dim(i)
            .is_ok_and(|d| d.comm_id() == tp.comm_id() && d.shape() == tp.shape())
    })
}

/// Module name patterns and the styles to apply, in order. A pattern is a fully
/// qualified module name whose parts may hold `*` wildcards, each matching within
/// one part (`"layers.*.attention.wq"`); `""` is the root.
///
/// PyTorch: the `parallelize_plan` dict of `parallelize_module`.
#[derive(Clone, Debug, Default)]
pub struct ParallelPlan {
    entries: Vec<(String, Rc<dyn ParallelStyle>)>,
}

impl ParallelPlan {
    /// An empty plan.
    pub fn new() -> ParallelPlan {
        ParallelPlan::default()
    }

    /// The plan with `style` applied to the modules matching `pattern`.
    #[must_use]
    pub fn add(mut self, pattern: &str, style: impl ParallelStyle + 'static) -> ParallelPlan {
        self.entries.push((pattern.to_string(), Rc::new(style)));
        self
    }

    /// The entries, in order.
    pub fn entries(&self) -> impl Iterator<Item = (&str, &dyn ParallelStyle)> {
        self.entries.iter().map(|(p, s)| (p.as_str(), &**s))
    }
}

/// One style applied to one module, as [`parallelize_module`] reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Applied {
    /// The module's fully qualified name.
    pub fqn: String,
    /// The style (its `Debug` form, with its layouts).
    pub style: String,
}

/// Whether `fqn` matches `pattern` part by part (`*` within a part).
fn matches(pattern: &str, fqn: &str) -> bool {
    if pattern.is_empty() || fqn.is_empty() {
        return pattern == fqn;
    }
    let (p, f): (Vec<&str>, Vec<&str>) = (pattern.split('.').collect(), fqn.split('.').collect());
    p.len() == f.len() && p.iter().zip(&f).all(|(p, f)| glob(p.as_bytes(), f.as_bytes()))
}

/// `*` matches any run of characters.
fn glob(p: &[u8], s: &[u8]) -> bool {
    match p.split_first() {
        None => s.is_empty(),
        Some((b'*', rest)) => (0..=s.len()).any(|i| glob(rest, &s[i..])),
        Some((c, rest)) => s.first() == Some(c) && glob(rest, &s[1..]),
    }
}

/// Applies `plan` to the modules of `module` over the 1-D tensor-parallel mesh
/// `tp_mesh` (the whole parameter mesh, or one of its dims: `mesh.dim("tp")`).
/// Every entry is checked before any parameter changes, so a plan that does not
/// fit leaves the model as it was. Returns what was applied, in order.
///
/// PyTorch: `torch.distributed.tensor.parallel.parallelize_module`.
///
/// # Errors
/// A `tp_mesh` that is not 1-D; a plan entry matching no module; a style on a
/// module type it does not support; a parameter on a mesh without the tp dim, or
/// not replicated (already parallelized, or sharded by FSDP: apply TP first);
/// each naming the module.
#[track_caller]
pub fn parallelize_module(module: &dyn Module, tp_mesh: &DeviceMesh, plan: &ParallelPlan) -> Result<Vec<Applied>> {
    let _site = tessera_mesh::callsite::enter();
    let modules = named_modules(module);
    let checked = (|| {
        if tp_mesh.ndim() != 1 {
            return Err(tp_error(format!(
                "the tp mesh must be 1-D (pass mesh.dim(\"tp\")), got shape {:?} with dims {:?}",
                tp_mesh.shape(),
                tp_mesh.names()
            )));
        }
        // The tree names the parameters that errors and checkpoints name.
        tessera_autograd::nn::name_parameters(module)?;
        let mut work: Vec<(&str, &dyn Module, &dyn ParallelStyle)> = Vec::new();
        for (pattern, style) in plan.entries() {
            let hits: Vec<_> = modules.iter().filter(|(n, _)| matches(pattern, n)).collect();
            if hits.is_empty() {
                let top: Vec<&str> = modules.iter().skip(1).take(12).map(|(n, _)| n.as_str()).collect();
                return Err(tp_error(format!(
                    "plan entry `{pattern}` ({style:?}) matches no module (modules: {top:?}{})",
                    if modules.len() > 13 { ", ..." } else { "" }
                )));
            }
            work.extend(hits.into_iter().map(|(n, m)| (n.as_str(), *m, style)));
        }
        for &(fqn, m, style) in &work {
            let ctx = StyleCtx {
                fqn,
                root: module,
                tp_mesh,
            };
            style.check(m, &ctx)?;
            ModuleId::at(module, fqn)?;
        }
        Ok(work)
    })();
    // Every rank must apply the same styles to the same parameters.
    let geometry = checked.as_ref().map_or(0, |work| {
        let plan: Vec<String> = work.iter().map(|(fqn, _, style)| format!("{fqn}: {style:?}")).collect();
        crate::agree::geometry_hash_with(&module.parameters(), &plan.join("; "))
    });
    let work = crate::agree::agree(tp_mesh, checked, geometry, "parallelize_module with the same plan")?;
    let mut applied = Vec::with_capacity(work.len());
    for (fqn, m, style) in work {
        let ctx = StyleCtx {
            fqn,
            root: module,
            tp_mesh,
        };
        style.apply(m, &ctx)?;
        applied.push(Applied {
            fqn: fqn.to_string(),
            style: format!("{style:?}"),
        });
    }
    Ok(applied)
}

#[cfg(test)]
mod tests {
    use super::matches;

    #[test]
    fn patterns_match_part_by_part() {
        assert!(matches("layers.*.attention.wq", "layers.0.attention.wq"));
        assert!(matches("layers.*.attention.wq", "layers.12.attention.wq"));
        assert!(!matches("layers.*.attention.wq", "layers.0.attention.wq.x"));
        assert!(
            !matches("layers.*", "layers.0.attention"),
            "a star stays within its part"
        );
        assert!(matches("layers.*.feed_forward.w*", "layers.1.feed_forward.w2"));
        assert!(matches("", ""));
        assert!(!matches("", "output"));
        assert!(matches("output", "output"));
        assert!(!matches("out", "output"));
    }
}
