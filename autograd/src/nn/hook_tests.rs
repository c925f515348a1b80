//! Module identity and hooks: several per module in order, parameter-less modules,
//! identity across moves, removal and unwinding.

use std::cell::RefCell;
use std::rc::Rc;

use tessera_dtensor::{DType, Placement, Tensor, distribute_tensor};
use tessera_mesh::{DeviceMesh, launch};

use super::*;

/// An activation: no parameters.
struct Tanh;

impl Module for Tanh {
    fn forward(&self, x: &Var) -> Result<Var> {
        x.tanh()
    }
}

struct Block {
    fc: Linear,
    act: Tanh,
}

impl Module for Block {
    fn named_children(&self) -> Vec<(String, &dyn Module)> {
        vec![("fc".into(), &self.fc), ("act".into(), &self.act)]
    }

    fn forward(&self, x: &Var) -> Result<Var> {
        self.act.call(&self.fc.call(x)?)
    }
}

/// Iterates its blocks itself (the list is never called): hooks on a block or
/// on an activation inside it still run.
struct Net {
    blocks: Vec<Block>,
}

impl Module for Net {
    fn named_children(&self) -> Vec<(String, &dyn Module)> {
        vec![("blocks".into(), &self.blocks)]
    }

    fn forward(&self, x: &Var) -> Result<Var> {
        self.blocks.iter().try_fold(x.clone(), |h, b| b.call(&h))
    }
}

fn net(mesh: &DeviceMesh, n: usize) -> Result<Net> {
    let blocks = (0..n)
        .map(|_| {
            Ok(Block {
                fc: Linear::new(3, 3, true, mesh, DType::F64)?,
                act: Tanh,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let net = Net { blocks };
    crate::nn::Materializer::from_seed(10).materialize(&net)?;
    Ok(net)
}

fn input(mesh: &DeviceMesh) -> Result<Var> {
    let x = Tensor::randn(&[2, 3], DType::F64, 1)?;
    Ok(Var::constant(distribute_tensor(&x, mesh, &[Placement::Replicate])?))
}

/// Logs `tag:pre`, `tag:post`, `tag:failed`; its pre scales the input by `scale`
/// (so a hook that did not run changes the output), or fails when `fail`.
struct Log {
    tag: &'static str,
    log: Rc<RefCell<Vec<String>>>,
    scale: f64,
    fail: bool,
}

impl ModuleHooks for Log {
    fn pre_forward(&self, inputs: Inputs) -> Result<Inputs> {
        self.log.borrow_mut().push(format!("{}:pre", self.tag));
        if self.fail {
            return Err(Error::Config {
                op: "test",
                detail: format!("{} fails", self.tag),
            });
        }
        inputs.map(|_, x| x.mul_scalar(self.scale))
    }

    fn post_forward(&self, output: Var) -> Result<Var> {
        self.log.borrow_mut().push(format!("{}:post", self.tag));
        Ok(output)
    }

    fn forward_failed(&self) {
        self.log.borrow_mut().push(format!("{}:failed", self.tag));
    }
}

fn hook(tag: &'static str, log: &Rc<RefCell<Vec<String>>>, scale: f64) -> Rc<dyn ModuleHooks> {
    Rc::new(Log {
        tag,
        log: log.clone(),
        scale,
        fail: false,
    })
}

fn values(v: &Var) -> Result<Vec<f64>> {
    Ok(v.value().full_tensor()?.to_f64_vec())
}

#[test]
fn several_hooks_on_one_module_run_in_registration_order() {
    launch(1, |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), &[1])?;
        let net = net(&mesh, 2)?;
        let x = input(&mesh)?;
        let plain = values(&net.call(&x)?)?;
        let log = Rc::new(RefCell::new(Vec::new()));
        let id = ModuleId::at(&net, "blocks.1.fc")?;
        assert_eq!(id, ModuleId::of(&net.blocks[1].fc)?, "by path or by module: one id");
        let a = register_module_hooks(&id, hook("a", &log, 2.0));
        let _b = register_module_hooks(&id, hook("b", &log, 3.0));
        assert_eq!(module_hooks_len(&id), 2);
        let hooked = net.call(&x)?;
        assert_eq!(*log.borrow(), ["a:pre", "b:pre", "a:post", "b:post"]);
        assert_ne!(values(&hooked)?, plain, "the pre hooks changed block 1's input");
        // Removing one leaves the other.
        assert!(a.remove());
        assert!(!a.remove(), "removed already");
        log.borrow_mut().clear();
        net.call(&x)?;
        assert_eq!(*log.borrow(), ["b:pre", "b:post"]);
        assert!(_b.remove());
        assert_eq!(values(&net.call(&x)?)?, plain);
        Ok(())
    })
    .unwrap();
}

#[test]
fn a_parameterless_module_carries_hooks_by_its_place_in_the_tree() {
    launch(1, |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), &[1])?;
        let net = net(&mesh, 2)?;
        let x = input(&mesh)?;
        let log = Rc::new(RefCell::new(Vec::new()));
        let act1 = ModuleId::at(&net, "blocks.1.act")?;
        assert_ne!(act1, ModuleId::at(&net, "blocks.0.act")?, "same type, other place");
        let h = register_module_hooks(&act1, hook("act1", &log, 1.0));
        net.call(&x)?;
        assert_eq!(*log.borrow(), ["act1:pre", "act1:post"], "only block 1's activation");
        // Called from its block directly (no parent call on the stack above the block).
        log.borrow_mut().clear();
        net.blocks[1].call(&x)?;
        net.blocks[0].call(&x)?;
        assert_eq!(*log.borrow(), ["act1:pre", "act1:post"]);
        // Alone, a parameter-less module has no identity.
        log.borrow_mut().clear();
        net.blocks[1].act.call(&x)?;
        assert!(log.borrow().is_empty());
        assert!(h.remove());
        let err = ModuleId::of(&Tanh).unwrap_err().to_string();
        assert!(err.contains("ModuleId::at"), "{err}");
        let err = ModuleId::at(&vec![Tanh], "0").unwrap_err().to_string();
        assert!(
            err.contains("`0` and every module above it hold no parameters"),
            "{err}"
        );
        Ok(())
    })
    .unwrap();
}

#[test]
fn identity_survives_moves_and_tells_a_list_from_its_element() {
    launch(1, |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), &[1])?;
        let log = Rc::new(RefCell::new(Vec::new()));
        // Registered on a model that is then moved (out of the closure, into a box).
        let build = || -> Result<(Net, HookHandle, HookHandle)> {
            let net = net(&mesh, 1)?;
            let block = register_module_hooks(&ModuleId::of(&net.blocks[0])?, hook("block", &log, 1.0));
            let act = register_module_hooks(&ModuleId::at(&net, "blocks.0.act")?, hook("act", &log, 1.0));
            Ok((net, block, act))
        };
        let (net, _block, _act) = build()?;
        let moved = Box::new(net);
        let list: &Vec<Block> = &moved.blocks;
        assert_ne!(
            ModuleId::of(list)?,
            ModuleId::of(&list[0])?,
            "a one-element list holds the same parameters as its element"
        );
        moved.call(&input(&mesh)?)?;
        assert_eq!(*log.borrow(), ["block:pre", "act:pre", "act:post", "block:post"]);
        Ok(())
    })
    .unwrap();
}

#[test]
fn a_failing_hook_unwinds_the_hooks_that_ran_last_first() {
    launch(1, |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), &[1])?;
        let net = net(&mesh, 1)?;
        let log = Rc::new(RefCell::new(Vec::new()));
        let id = ModuleId::of(&net.blocks[0])?;
        let _a = register_module_hooks(&id, hook("a", &log, 1.0));
        let _b = register_module_hooks(&id, hook("b", &log, 1.0));
        let _c = register_module_hooks(
            &id,
            Rc::new(Log {
                tag: "c",
                log: log.clone(),
                scale: 1.0,
                fail: true,
            }),
        );
        let err = net.call(&input(&mesh)?).unwrap_err().to_string();
        assert!(err.contains("c fails"), "{err}");
        assert_eq!(*log.borrow(), ["a:pre", "b:pre", "c:pre", "b:failed", "a:failed"]);
        Ok(())
    })
    .unwrap();
}

#[test]
fn get_submodule_names_what_is_missing() {
    launch(1, |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), &[1])?;
        let net = net(&mesh, 2)?;
        assert_eq!(
            get_submodule(&net, "blocks.1.fc")?.parameters()[0].name(),
            "blocks.1.fc.weight"
        );
        let err = get_submodule(&net, "blocks.2.fc")
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            err.contains("no module `blocks.2.fc`: `blocks` has no child `2` (its children: [\"0\", \"1\"])"),
            "{err}"
        );
        let err = ModuleId::at(&net, "head").unwrap_err().to_string();
        assert!(err.contains("the root has no child `head`"), "{err}");
        Ok(())
    })
    .unwrap();
}

/// A module of two positional inputs and an optional named one:
/// `fc(x) · gate + bias`, where `bias` is named.
struct Gated {
    fc: Linear,
}

impl Module for Gated {
    fn named_children(&self) -> Vec<(String, &dyn Module)> {
        vec![("fc".into(), &self.fc)]
    }

    fn forward(&self, _x: &Var) -> Result<Var> {
        Err(Error::Config {
            op: "Gated",
            detail: "needs (x, gate)".into(),
        })
    }

    fn forward_with(&self, inputs: &Inputs) -> Result<Var> {
        let y = self.fc.call(inputs.get(0)?)?.mul(inputs.get(1)?)?;
        match inputs.named("bias") {
            Some(b) => y.add(b),
            None => Ok(y),
        }
    }
}

#[test]
fn a_module_of_several_inputs_runs_between_hooks_that_see_them_all() {
    launch(1, |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), &[1])?;
        let m = Gated {
            fc: Linear::new(3, 3, false, &mesh, DType::F64)?,
        };
        crate::nn::Materializer::from_seed(3).materialize(&m)?;
        let (x, gate) = (input(&mesh)?, input(&mesh)?.mul_scalar(0.5)?);
        let bias = input(&mesh)?.mul_scalar(-1.0)?;
        let direct = m.fc.forward(&x)?.mul(&gate)?.add(&bias)?;
        let inputs = Inputs::new().arg(&x).arg(&gate).kwarg("bias", &bias);
        assert_eq!(values(&m.call_with(inputs.clone())?)?, values(&direct)?);
        // A hook scaling every input by 2: fc(2x)·2g + 2b = 4·fc(x)·g + 2b.
        let log = Rc::new(RefCell::new(Vec::new()));
        let h = register_module_hooks(&ModuleId::of(&m)?, hook("m", &log, 2.0));
        let hooked = m.call_with(inputs)?;
        let want =
            m.fc.forward(&x)?
                .mul(&gate)?
                .mul_scalar(4.0)?
                .add(&bias.mul_scalar(2.0)?)?;
        let (got, want) = (values(&hooked)?, values(&want)?);
        assert!(
            got.iter().zip(&want).all(|(a, b)| (a - b).abs() < 1e-12),
            "{got:?} vs {want:?}"
        );
        assert_eq!(*log.borrow(), ["m:pre", "m:post"]);
        assert!(h.remove());
        // Missing inputs are named; a one-input module refuses several.
        let err = m.call_with(Inputs::from(&x)).unwrap_err().to_string();
        assert!(
            err.contains("needs positional input 1 but was called with 1 positional input"),
            "{err}"
        );
        let err =
            m.fc.call_with(Inputs::new().arg(&x).kwarg("mask", &x))
                .unwrap_err()
                .to_string();
        assert!(
            err.contains("takes one input but was called with 1 positional input and `mask`"),
            "{err}"
        );
        // `call` runs forward_with too (with one positional input).
        assert!(m.call(&x).unwrap_err().to_string().contains("needs positional input 1"));
        assert!(m.forward(&x).unwrap_err().to_string().contains("needs (x, gate)"));
        assert!(
            Inputs::new()
                .require("positions")
                .unwrap_err()
                .to_string()
                .contains("`positions`")
        );
        Ok(())
    })
    .unwrap();
}
