//! Explicit forward and backward prefetch changes only the order of the gathers:
//! the same collectives and the same losses as implicit prefetch; and the order
//! itself, read from the units' gather states at probes in forward and backward.

use std::cell::RefCell;
use std::rc::Rc;

use smallvec::smallvec;
use tessera::autograd::nn::{Inputs, Module, ModuleHooks, ModuleId, register_module_hooks};
use tessera::autograd::{Var, backward};
use tessera::fsdp::{FsdpConfig, FsdpModule, GatherState};
use tessera::models::FsdpUnits;
use tessera::{DeviceMesh, launch};

use crate::common::{tiny_model, tokens};
use crate::{Job, TestResult, batch, calls, reshard, train};

fn explicit(u: &FsdpUnits) {
    u.blocks[0].set_modules_to_forward_prefetch(&[&u.blocks[1]]);
    u.blocks[1].set_modules_to_backward_prefetch(&[&u.blocks[0]]);
}

#[test]
fn explicit_prefetch_changes_only_the_order() {
    for cfg in [FsdpConfig::default(), reshard(false)] {
        let implicit = train(&Job::fsdp(&[2], 8, 5, cfg.clone()));
        let set = train(&Job {
            setup: explicit,
            ..Job::fsdp(&[2], 8, 5, cfg.clone())
        });
        let bwd_gathers = if cfg.reshard_after_forward == Some(false) { 0 } else { 2 };
        for (s, (f, b)) in set.fwd.iter().zip(&set.bwd).enumerate() {
            assert_eq!(calls(f), (3, 0, 0, 0), "forward of step {s}: {f}");
            assert_eq!(calls(b), (bwd_gathers, 3, 0, 0), "backward of step {s}: {b}");
        }
        assert_eq!(set.fwd, implicit.fwd);
        assert_eq!(set.bwd, implicit.bwd);
        assert_eq!(set.losses, implicit.losses, "{cfg:?}");
    }
}

/// Probe points with the units' gather states there.
type Log = Vec<(String, Vec<GatherState>)>;

/// Records the units' gather states at points of forward and backward.
struct Probe {
    name: &'static str,
    units: Vec<FsdpModule>,
    log: Rc<RefCell<Log>>,
}

fn states(units: &[FsdpModule]) -> Vec<GatherState> {
    units.iter().map(FsdpModule::gather_state).collect()
}

impl ModuleHooks for Probe {
    /// Runs after the unit's own pre-forward (registered after it): records the
    /// states there, and wraps the input so that backward records them again
    /// once the module's backward (and its FSDP post-backward) is done.
    fn pre_forward(&self, inputs: Inputs) -> tessera::autograd::Result<Inputs> {
        self.log
            .borrow_mut()
            .push((format!("forward {}", self.name), states(&self.units)));
        let (units, log, name) = (self.units.clone(), self.log.clone(), self.name);
        let x = inputs.single()?;
        Ok(Inputs::from(Var::from_op("probe", x.value().clone(), &[x], move |g| {
            log.borrow_mut()
                .push((format!("after backward {name}"), states(&units)));
            Ok(smallvec![Some(g.clone())])
        })))
    }

    fn post_forward(&self, out: Var) -> tessera::autograd::Result<Var> {
        Ok(out)
    }
}

/// The gather states of (block 0, block 1, root) at each probe of the third
/// step, with `setup` applied to the units.
fn probe(setup: fn(&FsdpUnits)) -> Log {
    let toks = tokens();
    launch(2, move |ctx| -> TestResult<_> {
        let mesh = DeviceMesh::new(ctx.into_comm(), &[2])?;
        let model = tiny_model(&mesh)?;
        let u = model.fully_shard(&mesh, &FsdpConfig::default())?;
        setup(&u);
        let units = vec![u.blocks[0].clone(), u.blocks[1].clone(), u.root.clone()];
        let log = Rc::new(RefCell::new(Vec::new()));
        let mut handles = Vec::new();
        for (name, m) in [
            ("root", &model as &dyn Module),
            ("block 0", &model.layers[0]),
            ("block 1", &model.layers[1]),
        ] {
            let p = Probe {
                name,
                units: units.clone(),
                log: log.clone(),
            };
            handles.push(register_module_hooks(&ModuleId::of(m)?, Rc::new(p)));
        }
        for step in 0..3 {
            log.borrow_mut().clear();
            let loss = model.loss(&batch(&toks, step, 0..8, &mesh)?)?;
            backward(&loss)?;
        }
        let out = log.borrow().clone();
        Ok(out)
    })
    .unwrap()
    .swap_remove(0)
}

/// The issue order of the all-gathers: the units a pre-forward (or
/// pre-backward) prefetches are `Gathering` at the next probe. Implicit
/// prefetch gathers the next unit; each explicit list changes which one, and a
/// test whose setter did nothing would see the implicit states.
#[test]
fn explicit_prefetch_sets_the_issue_order() {
    use GatherState::{Gathering as G, Sharded as S, Unsharded as U};
    let at = |log: &Log, point: &str| {
        log.iter()
            .find(|(p, _)| p == point)
            .unwrap_or_else(|| panic!("no probe {point}: {log:?}"))
            .1
            .clone()
    };
    let implicit = probe(|_| {});
    // Root's pre-forward prefetches block 0; block 0's, block 1.
    assert_eq!(at(&implicit, "forward root"), [G, S, U]);
    assert_eq!(at(&implicit, "forward block 0"), [U, G, U]);
    // Block 1's pre-backward prefetched block 0 (block 1 reshards once its
    // parameters' gradients, recorded before the probe, arrive).
    assert_eq!(at(&implicit, "after backward block 1"), [G, U, U]);

    // The root prefetches block 1 first; block 0 then gathers on its own.
    let root_first = probe(|u| u.root.set_modules_to_forward_prefetch(&[&u.blocks[1]]));
    assert_eq!(at(&root_first, "forward root"), [S, G, U]);
    assert_eq!(at(&root_first, "forward block 0"), [U, G, U]);

    // Nothing prefetched in forward or backward: every unit gathers when it runs.
    let none = probe(|u| {
        u.root.set_modules_to_forward_prefetch(&[]);
        u.blocks[0].set_modules_to_forward_prefetch(&[]);
        u.blocks[1].set_modules_to_backward_prefetch(&[]);
    });
    assert_eq!(at(&none, "forward root"), [S, S, U]);
    assert_eq!(at(&none, "forward block 0"), [U, S, U]);
    assert_eq!(at(&none, "after backward block 1"), [S, U, U]);

    // Block 0 prefetched by the root's pre-backward instead of block 1's.
    let from_root = probe(|u| {
        u.root.set_modules_to_backward_prefetch(&[&u.blocks[0]]);
        u.blocks[1].set_modules_to_backward_prefetch(&[]);
    });
    assert_eq!(at(&from_root, "after backward block 1"), [G, U, U]);
}
