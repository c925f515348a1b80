//! [`Sgd`]: stochastic gradient descent with momentum.

use tessera_dtensor::{DTensor, Layout};
use tessera_mesh::DType;

use tessera_tensor::kernel::Real;

use super::{Optimizer, Ready, StateVec, check_range, check_state_layout, check_unique, local_cow, update_local};
use crate::{Error, Param, Result};

const OP: &str = "SGD";

/// The hyperparameters of [`Sgd`]; the defaults are PyTorch's.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SgdConfig {
    /// Learning rate (default 1e-3).
    pub lr: f64,
    /// Momentum factor (default 0: plain SGD, no state).
    pub momentum: f64,
    /// Dampening of the momentum (default 0).
    pub dampening: f64,
    /// L2 penalty added to the gradient (default 0).
    pub weight_decay: f64,
    /// Nesterov momentum (default false; needs momentum > 0 and no dampening).
    pub nesterov: bool,
}

impl Default for SgdConfig {
    fn default() -> SgdConfig {
        SgdConfig {
            lr: 1e-3,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        }
    }
}

impl SgdConfig {
    fn validate(&self) -> Result<()> {
        check_range(OP, "lr", self.lr, self.lr >= 0.0, "≥ 0")?;
        check_range(OP, "momentum", self.momentum, self.momentum >= 0.0, "≥ 0")?;
        check_range(OP, "dampening", self.dampening, self.dampening.is_finite(), "finite")?;
        check_range(OP, "weight_decay", self.weight_decay, self.weight_decay >= 0.0, "≥ 0")?;
        if self.nesterov && (self.momentum <= 0.0 || self.dampening != 0.0) {
            return Err(Error::Config {
                op: OP,
                detail: format!(
                    "Nesterov momentum needs momentum > 0 and dampening 0 (got momentum {}, dampening {})",
                    self.momentum, self.dampening
                ),
            });
        }
        Ok(())
    }
}

/// Stochastic gradient descent with momentum, per element of the local shard:
///
/// ```text
/// d ← g + wd·p
/// b ← d                      (first step)
/// b ← momentum·b + (1 − dampening)·d   (later steps)
/// d ← d + momentum·b  (Nesterov)  or  d ← b
/// p ← p − lr·d
/// ```
///
/// With `momentum == 0` there is no state and `p ← p − lr·(g + wd·p)`. The order of
/// operations is that of PyTorch's single-tensor CPU implementation, whose
/// vectorized `add(x, y, alpha)` is one fused multiply-add; scalars are rounded
/// once to the parameter's dtype (`f32` for `bf16`/`f16` parameters, whose
/// momentum buffers are `f32`).
///
/// PyTorch: `torch.optim.SGD(params, lr, momentum, dampening, weight_decay,
/// nesterov, foreach=False)` (no `maximize` or parameter groups).
pub struct Sgd {
    config: SgdConfig,
    params: Vec<Param>,
    state: Vec<Option<Slot>>,
}

/// The momentum buffer of one parameter (created on its first step).
struct Slot {
    layout: Layout,
    dtype: DType,
    buf: Option<StateVec>,
}

/// The per-step scalars in the compute dtype.
struct Scalars<F> {
    weight_decay: Option<F>,
    momentum: Option<F>,
    one_minus_dampening: F,
    nesterov: bool,
    neg_lr: F,
}

/// One SGD step over local slices of equal length. `buf` is the momentum buffer
/// (`first`: it holds nothing yet).
fn kernel<F: Real>(s: &Scalars<F>, p: &mut [F], g: &[F], buf: Option<(&mut [F], bool)>) {
    let n = p.len();
    let g = &g[..n];
    match (s.momentum, buf) {
        (Some(momentum), Some((buf, first))) => {
            let buf = &mut buf[..n];
            for i in 0..n {
                // grad.add(param, alpha=weight_decay)
                let d = s.weight_decay.map_or(g[i], |wd| p[i].mul_add(wd, g[i]));
                // buf = clone(grad), or buf.mul_(momentum).add_(grad, alpha=1 - dampening)
                let b = if first {
                    d
                } else {
                    d.mul_add(s.one_minus_dampening, buf[i] * momentum)
                };
                buf[i] = b;
                // grad.add(buf, alpha=momentum) or buf
                let d = if s.nesterov { b.mul_add(momentum, d) } else { b };
                // param.add_(grad, alpha=-lr)
                p[i] = d.mul_add(s.neg_lr, p[i]);
            }
        }
        _ => {
            for i in 0..n {
                let d = s.weight_decay.map_or(g[i], |wd| p[i].mul_add(wd, g[i]));
                p[i] = d.mul_add(s.neg_lr, p[i]);
            }
        }
    }
}

impl Sgd {
    /// An optimizer over `params`.
    ///
    /// # Errors
    /// A hyperparameter out of range (negative `lr`, `momentum` or `weight_decay`,
    /// Nesterov without momentum or with dampening), or a parameter listed twice.
    pub fn new(params: Vec<Param>, config: SgdConfig) -> Result<Sgd> {
        config.validate()?;
        check_unique(OP, &params)?;
        let state = params.iter().map(|_| None).collect();
        Ok(Sgd { config, params, state })
    }

    /// The hyperparameters.
    pub fn config(&self) -> &SgdConfig {
        &self.config
    }

    /// The state slot of parameter `index` from its checkpointed tensors, checked.
    fn slot_of(&self, index: usize, tensors: &[(&str, DTensor)]) -> Result<Slot> {
        let p = super::param_at(OP, &self.params, index)?;
        super::only_known(OP, p, tensors, self.state_names())?;
        let b = super::StateVec::from_dtensor(
            OP,
            p,
            "momentum_buffer",
            super::named(OP, p, tensors, "momentum_buffer")?,
        )?;
        Ok(Slot {
            layout: p.layout(),
            dtype: b.dtype(),
            buf: Some(b),
        })
    }
}

impl super::PerParam for Sgd {
    const OP: &'static str = OP;

    fn param_list(&self) -> &[Param] {
        &self.params
    }

    fn prepare(&mut self, r: &Ready) -> Result<()> {
        if r.value.to_local().is_cuda() {
            return Err(Error::Config {
                op: OP,
                detail: format!(
                    "parameter {} is on {}: SGD has no GPU step yet; use AdamW, or train on the CPU",
                    self.params[r.index].name(),
                    r.value.to_local().device()
                ),
            });
        }
        let name = self.params[r.index].name();
        match &self.state[r.index] {
            Some(slot) => {
                check_state_layout(OP, &name, &slot.layout, r.value.layout())?;
                if slot.dtype != r.dtype {
                    return Err(Error::Config {
                        op: OP,
                        detail: format!(
                            "parameter {name} now computes in {} but its state is {}; keep parameter dtypes",
                            r.dtype, slot.dtype
                        ),
                    });
                }
            }
            None => {
                self.state[r.index] = Some(Slot {
                    layout: r.value.layout().clone(),
                    dtype: r.dtype,
                    buf: None,
                })
            }
        }
        Ok(())
    }

    fn update<F: Real>(&mut self, r: Ready) -> Result<()> {
        let c = self.config;
        let p = &self.params[r.index];
        // INVARIANT: `prepare` created the slot for every ready parameter.
        let slot = self.state[r.index].as_mut().expect("state prepared");
        let n = r.value.to_local().numel();
        let grad = local_cow::<F>(r.grad.to_local())?;
        if grad.len() != n {
            return Err(Error::Config {
                op: OP,
                detail: format!(
                    "parameter {}: local sizes differ (value {n}, gradient {})",
                    p.name(),
                    grad.len()
                ),
            });
        }
        let scalars = Scalars {
            weight_decay: (c.weight_decay != 0.0).then(|| F::real(c.weight_decay)),
            momentum: (c.momentum != 0.0).then(|| F::real(c.momentum)),
            one_minus_dampening: F::real(1.0 - c.dampening),
            nesterov: c.nesterov,
            neg_lr: F::real(-c.lr),
        };
        let buf = if c.momentum != 0.0 {
            let first = slot.buf.is_none();
            let buf = slot.buf.get_or_insert_with(|| StateVec::zeros(r.dtype, n));
            Some((buf.get::<F>(OP, &p.name())?, first))
        } else {
            None
        };
        update_local::<F>(p, r.value, |data| kernel(&scalars, data, &grad, buf))?;
        Ok(())
    }
}

impl Optimizer for Sgd {
    fn step(&mut self) -> Result<()> {
        super::step_all(self)
    }

    fn state_names(&self) -> &'static [&'static str] {
        &["momentum_buffer"]
    }

    fn state_tensors(&self) -> Result<Vec<(usize, &'static str, DTensor)>> {
        let mut out = Vec::new();
        for (i, (p, slot)) in self.params.iter().zip(&self.state).enumerate() {
            if let Some(Slot {
                layout, buf: Some(b), ..
            }) = slot
            {
                out.push((i, "momentum_buffer", b.to_dtensor(p, layout)?));
            }
        }
        Ok(out)
    }

    fn load_state_tensors(&mut self, states: &[(usize, Vec<(&str, DTensor)>)]) -> Result<()> {
        for (i, slot) in super::slots_of(states, |i, ts| self.slot_of(i, ts))? {
            self.state[i] = Some(slot);
        }
        Ok(())
    }

    fn check_state_tensors(&self, states: &[(usize, Vec<(&str, DTensor)>)]) -> Result<()> {
        super::slots_of(states, |i, ts| self.slot_of(i, ts)).map(drop)
    }

    fn params(&self) -> &[Param] {
        &self.params
    }

    fn lr(&self) -> f64 {
        self.config.lr
    }

    fn set_lr(&mut self, lr: f64) -> Result<()> {
        check_range(OP, "lr", lr, lr >= 0.0, "≥ 0")?;
        self.config.lr = lr;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use tessera_dtensor::{Placement::*, Tensor, distribute_tensor};
    use tessera_mesh::{DeviceMesh, launch};

    use super::*;
    use crate::optim::on_one_rank;

    /// PyTorch's SGD in f64, one element.
    fn reference(c: &SgdConfig, p0: f64, grads: &[f64]) -> Vec<f64> {
        let (mut p, mut buf) = (p0, None::<f64>);
        let mut out = Vec::new();
        for &g in grads {
            let mut d = g + c.weight_decay * p;
            if c.momentum != 0.0 {
                let b = match buf {
                    None => d,
                    Some(b) => c.momentum * b + (1.0 - c.dampening) * d,
                };
                buf = Some(b);
                d = if c.nesterov { d + c.momentum * b } else { b };
            }
            p -= c.lr * d;
            out.push(p);
        }
        out
    }

    /// A config from (lr, momentum, dampening, weight decay, nesterov).
    fn c(lr: f64, momentum: f64, dampening: f64, weight_decay: f64, nesterov: bool) -> SgdConfig {
        SgdConfig {
            lr,
            momentum,
            dampening,
            weight_decay,
            nesterov,
        }
    }

    #[test]
    fn three_steps_match_the_formula() {
        // config, initial value, gradients at steps 1..=3
        let cases = [
            (c(0.1, 0.0, 0.0, 0.0, false), 1.0, [1.0, 2.0, -1.0]),
            (c(0.1, 0.5, 0.0, 0.0, false), 1.0, [1.0, 2.0, -1.0]),
            (c(0.1, 0.0, 0.0, 0.5, false), 1.0, [0.0, 0.0, 0.0]),
            (c(0.1, 0.9, 0.0, 0.01, false), 0.3, [0.2, -0.1, 0.4]),
            (c(0.1, 0.9, 0.1, 0.0, false), 0.3, [0.2, -0.1, 0.4]),
            (c(0.1, 0.9, 0.0, 0.0, true), 0.3, [0.2, -0.1, 0.4]),
            (c(1e-3, 0.9, 0.0, 1e-4, true), -2.0, [5.0, 1.0, 0.0]),
        ];
        // The first three by hand: p − 0.1 g; momentum 0.5 (b = 1, 2.5, 0.25); d = g + p/2.
        let by_hand = [[0.9, 0.7, 0.8], [0.9, 0.65, 0.625], [0.95, 0.9025, 0.857375]];
        for ((c, p0, grads), h) in cases.iter().zip(by_hand) {
            let want = reference(c, *p0, grads);
            assert!(
                want.iter().zip(h).all(|(w, h)| (w - h).abs() < 1e-15),
                "{c:?}: {want:?} vs {h:?}"
            );
        }
        on_one_rank(move |mesh| {
            for (c, p0, grads) in &cases {
                let want = reference(c, *p0, grads);
                for dtype in [DType::F64, DType::F32] {
                    let p = Param::named(
                        "w",
                        distribute_tensor(&Tensor::full(&[2], *p0, dtype)?, mesh, &[Replicate])?,
                    );
                    let mut opt = Sgd::new(vec![p.clone()], *c)?;
                    for (t, g) in grads.iter().enumerate() {
                        p.set_grad(Some(distribute_tensor(
                            &Tensor::full(&[2], *g, dtype)?,
                            mesh,
                            &[Replicate],
                        )?));
                        opt.step()?;
                        let tol = if dtype == DType::F64 { 1e-15 } else { 1e-6 };
                        for x in p.value()?.to_local().to_f64_vec() {
                            assert!(
                                (x - want[t]).abs() <= tol,
                                "{c:?} {dtype} step {}: got {x}, want {}",
                                t + 1,
                                want[t]
                            );
                        }
                    }
                }
            }
            Ok(())
        });
    }

    #[test]
    fn bad_configs() {
        for (c, what) in [
            (c(-0.1, 0.0, 0.0, 0.0, false), "lr is -0.1"),
            (c(0.1, -0.9, 0.0, 0.0, false), "momentum is -0.9"),
            (c(0.1, 0.0, 0.0, -1.0, false), "weight_decay is -1"),
            (c(0.1, 0.0, 0.0, 0.0, true), "Nesterov momentum needs"),
            (c(0.1, 0.9, 0.1, 0.0, true), "dampening 0.1"),
        ] {
            let err = Sgd::new(vec![], c).err().unwrap().to_string();
            assert!(err.contains(what), "{err}");
        }
    }

    #[test]
    fn sharded_update_equals_replicated() {
        let config = SgdConfig {
            lr: 0.05,
            momentum: 0.9,
            weight_decay: 0.01,
            ..SgdConfig::default()
        };
        let run = |placement| {
            launch(2, move |ctx| {
                let mesh = DeviceMesh::new(ctx.into_comm(), &[2])?;
                let full = Tensor::randn(&[3, 5], DType::F32, 1)?;
                let p = Param::named("w", distribute_tensor(&full, &mesh, &[placement])?);
                let mut opt = Sgd::new(vec![p.clone()], config)?;
                for s in 0..3 {
                    let g = Tensor::randn(&[3, 5], DType::F32, 10 + s)?;
                    p.set_grad(Some(distribute_tensor(&g, &mesh, &[placement])?));
                    let before = mesh.stats().total_calls();
                    opt.step()?;
                    assert_eq!(mesh.stats().total_calls(), before, "a step communicates");
                }
                opt.zero_grad();
                assert!(p.grad().is_none());
                Ok(p.value()?.full_tensor()?.to_vec::<f32>()?)
            })
            .unwrap()
        };
        let (sharded, replicated) = (run(Shard(1)), run(Replicate));
        assert_eq!(sharded, replicated);
    }
}
