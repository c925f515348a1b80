//! [`AdamW`]: Adam with decoupled weight decay.

use tessera_dtensor::{DTensor, Layout};
use tessera_mesh::DType;

use tessera_tensor::kernel::{Real, Simd, par_parts};

use super::{Optimizer, Ready, StateVec, check_range, check_state_layout, check_unique, local_cow, update_local};
use crate::{Error, Param, Result};

const OP: &str = "AdamW";

/// The hyperparameters of [`AdamW`]; the defaults are PyTorch's.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWConfig {
    /// Learning rate (default 1e-3).
    pub lr: f64,
    /// Decay rates of the first and second moments (default (0.9, 0.999)).
    pub betas: (f64, f64),
    /// Added to the denominator (default 1e-8).
    pub eps: f64,
    /// Decoupled weight decay: each step first multiplies the parameter by
    /// `1 − lr · weight_decay` (default 1e-2).
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> AdamWConfig {
        AdamWConfig {
            lr: 1e-3,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 1e-2,
        }
    }
}

impl AdamWConfig {
    fn validate(&self) -> Result<()> {
        let (b1, b2) = self.betas;
        check_range(OP, "lr", self.lr, self.lr >= 0.0, "≥ 0")?;
        check_range(OP, "betas.0", b1, (0.0..1.0).contains(&b1), "in [0, 1)")?;
        check_range(OP, "betas.1", b2, (0.0..1.0).contains(&b2), "in [0, 1)")?;
        check_range(OP, "eps", self.eps, self.eps >= 0.0, "≥ 0")?;
        check_range(OP, "weight_decay", self.weight_decay, self.weight_decay >= 0.0, "≥ 0")
    }
}

/// Adam with decoupled weight decay, step `t` counted per parameter from 1:
///
/// ```text
/// p ← p · (1 − lr·wd)
/// m ← β₁·m + (1 − β₁)·g                 (as lerp(m, g, 1 − β₁))
/// v ← β₂·v + (1 − β₂)·g²
/// p ← p − lr / (1 − β₁ᵗ) · m / (√v / √(1 − β₂ᵗ) + eps)
/// ```
///
/// Each rank updates its local shard in one loop, in the order of operations and
/// the precision of PyTorch's single-tensor CPU implementation (`foreach=False`,
/// `fused=False`): the scalars (`1 − lr·wd`, `lr / (1 − β₁ᵗ)`, `(1 − β₂ᵗ)^½`, …) are
/// computed in `f64` as Python does and rounded once to the parameter's dtype;
/// the element-wise math runs in that dtype (`f32` for `bf16`/`f16` parameters,
/// whose moments are kept in `f32`). The moment update uses a fused multiply-add,
/// as PyTorch's vectorized `lerp` does.
///
/// PyTorch: `torch.optim.AdamW(params, lr, betas, eps, weight_decay, foreach=False)`
/// (no `amsgrad`, `maximize` or parameter groups).
pub struct AdamW {
    config: AdamWConfig,
    params: Vec<Param>,
    state: Vec<Option<Slot>>,
}

/// The state of one parameter: its step count and moments over its local shard.
struct Slot {
    layout: Layout,
    dtype: DType,
    step: u64,
    exp_avg: StateVec,
    exp_avg_sq: StateVec,
}

/// The per-step scalars, rounded to the compute dtype as PyTorch's kernels round
/// their Python-float arguments.
struct Scalars<F> {
    decay: F,
    /// `1 − β₁`, and whether it is below ½ (PyTorch's lerp switches formula there).
    lerp_weight: F,
    lerp_small: bool,
    beta2: F,
    one_minus_beta2: F,
    bias_correction2_sqrt: F,
    eps: F,
    neg_step_size: F,
}

impl<F: Real> Scalars<F> {
    fn new(c: &AdamWConfig, step: u64) -> Scalars<F> {
        let (beta1, beta2) = c.betas;
        let t = step as f64;
        // As `_single_tensor_adam`: Python floats, `**` is C `pow`.
        let bias_correction1 = 1.0 - beta1.powf(t);
        let bias_correction2 = 1.0 - beta2.powf(t);
        let step_size = c.lr / bias_correction1;
        let bias_correction2_sqrt = bias_correction2.powf(0.5);
        let lerp_weight = 1.0 - beta1;
        Scalars {
            decay: F::real(1.0 - c.lr * c.weight_decay),
            lerp_weight: F::real(lerp_weight),
            lerp_small: lerp_weight.abs() < 0.5,
            beta2: F::real(beta2),
            one_minus_beta2: F::real(1.0 - beta2),
            bias_correction2_sqrt: F::real(bias_correction2_sqrt),
            eps: F::real(c.eps),
            neg_step_size: F::real(-step_size),
        }
    }
}

/// One AdamW step over local slices of equal length, on the widest loop that
/// the CPU runs (see [`kernel_on`]), in blocks over the rank's threads when
/// each gets at least [`PAR_MIN_ELEMENTS`](tessera_tensor::kernel::PAR_MIN_ELEMENTS) (every element is updated by the
/// same code at any split, so the bits do not depend on it).
fn kernel<F: Real>(s: &Scalars<F>, p: &mut [F], g: &[F], m: &mut [F], v: &mut [F]) {
    let simd = Simd::best();
    let n = p.len();
    let parts = par_parts(n);
    if parts <= 1 || g.len() < n || m.len() < n || v.len() < n {
        // (Short slices are the body's to reject, on one thread.)
        kernel_on(simd, s, p, g, m, v);
        return;
    }
    let per = n.div_ceil(parts);
    type Block<'a, F> = (&'a mut [F], &'a [F], &'a mut [F], &'a mut [F]);
    let blocks: Vec<std::sync::Mutex<Block<'_, F>>> = p
        .chunks_mut(per)
        .zip(g.chunks(per))
        .zip(m.chunks_mut(per))
        .zip(v.chunks_mut(per))
        .map(|(((p, g), m), v)| std::sync::Mutex::new((p, g, m, v)))
        .collect();
    tessera_mesh::parallel_for(blocks.len(), |i| {
        let mut block = blocks[i].lock().unwrap_or_else(|e| e.into_inner());
        let (p, g, m, v) = &mut *block;
        kernel_on(simd, s, p, g, m, v);
    });
}

/// [`kernel`] on the loop compiled for `simd` (see [`Simd::run`]), which the CPU
/// must support. Every operation is an IEEE add, multiply, divide, square root or
/// fused multiply-add (one rounding on every instruction set, libm's software
/// one on the baseline), so every loop gives the same bits.
fn kernel_on<F: Real>(simd: Simd, s: &Scalars<F>, p: &mut [F], g: &[F], m: &mut [F], v: &mut [F]) {
    simd.run(
        #[inline(always)]
        || kernel_body(s, p, g, m, v),
    )
}

#[inline(always)]
fn kernel_body<F: Real>(s: &Scalars<F>, p: &mut [F], g: &[F], m: &mut [F], v: &mut [F]) {
    let n = p.len();
    let (g, m, v) = (&g[..n], &mut m[..n], &mut v[..n]);
    let one = F::real(1.0);
    let (w, w_minus_one) = (s.lerp_weight, s.lerp_weight - one);
    for i in 0..n {
        // param.mul_(1 - lr * weight_decay); a no-op multiply by 1 when wd = 0.
        let pi = p[i] * s.decay;
        let gi = g[i];
        // exp_avg.lerp_(grad, 1 - beta1): fmadd(w, g - m, m), or fmadd(w - 1, g - m, g).
        let mi = if s.lerp_small {
            w.mul_add(gi - m[i], m[i])
        } else {
            w_minus_one.mul_add(gi - m[i], gi)
        };
        // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        let vi = v[i] * s.beta2 + s.one_minus_beta2 * gi * gi;
        // denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        let denom = vi.sqrt() / s.bias_correction2_sqrt + s.eps;
        // param.addcdiv_(exp_avg, denom, value=-step_size)
        p[i] = pi + s.neg_step_size * mi / denom;
        m[i] = mi;
        v[i] = vi;
    }
}

impl AdamW {
    /// An optimizer over `params`.
    ///
    /// # Errors
    /// A hyperparameter out of range (negative `lr`, `eps` or `weight_decay`, a beta
    /// outside `[0, 1)`), or a parameter listed twice.
    pub fn new(params: Vec<Param>, config: AdamWConfig) -> Result<AdamW> {
        config.validate()?;
        check_unique(OP, &params)?;
        let state = params.iter().map(|_| None).collect();
        Ok(AdamW { config, params, state })
    }

    /// The hyperparameters.
    pub fn config(&self) -> &AdamWConfig {
        &self.config
    }

    /// The number of steps taken by the parameter at `index` (0 before its first
    /// gradient).
    pub fn steps(&self, index: usize) -> u64 {
        self.state.get(index).and_then(|s| s.as_ref()).map_or(0, |s| s.step)
    }

    /// The state slot of parameter `index` from its checkpointed tensors, checked.
    fn slot_of(&self, index: usize, tensors: &[(&str, DTensor)]) -> Result<Slot> {
        let p = super::param_at(OP, &self.params, index)?;
        super::only_known(OP, p, tensors, self.state_names())?;
        let exp_avg = super::StateVec::from_dtensor(OP, p, "exp_avg", super::named(OP, p, tensors, "exp_avg")?)?;
        let exp_avg_sq =
            super::StateVec::from_dtensor(OP, p, "exp_avg_sq", super::named(OP, p, tensors, "exp_avg_sq")?)?;
        let step = super::step_of(OP, p, super::named(OP, p, tensors, "step")?)?;
        if exp_avg.dtype() != exp_avg_sq.dtype() {
            return Err(Error::Config {
                op: OP,
                detail: format!("the moments of {} differ in dtype", p.name()),
            });
        }
        Ok(Slot {
            layout: p.layout(),
            dtype: exp_avg.dtype(),
            step,
            exp_avg,
            exp_avg_sq,
        })
    }
}

impl super::PerParam for AdamW {
    const OP: &'static str = OP;

    fn param_list(&self) -> &[Param] {
        &self.params
    }

    /// Checks `r` against its state (creating it on the first step).
    fn prepare(&mut self, r: &Ready) -> Result<()> {
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
                let local = r.value.to_local();
                let (n, device) = (local.numel(), local.device());
                if device.is_cuda() && r.dtype != DType::F32 {
                    return Err(Error::Config {
                        op: OP,
                        detail: format!(
                            "parameter {name} computes in {} on {device}; the GPU step takes f32 parameters",
                            r.dtype
                        ),
                    });
                }
                self.state[r.index] = Some(Slot {
                    layout: r.value.layout().clone(),
                    dtype: r.dtype,
                    step: 0,
                    exp_avg: StateVec::zeros_on(r.dtype, n, device)?,
                    exp_avg_sq: StateVec::zeros_on(r.dtype, n, device)?,
                });
            }
        }
        Ok(())
    }

    fn update<F: Real>(&mut self, r: Ready) -> Result<()> {
        #[cfg(feature = "cuda")]
        if r.value.to_local().is_cuda() {
            return self.update_on_device(r);
        }
        let p = &self.params[r.index];
        // INVARIANT: `prepare` created the slot for every ready parameter.
        let slot = self.state[r.index].as_mut().expect("state prepared");
        let n = r.value.to_local().numel();
        let grad = local_cow::<F>(r.grad.to_local())?;
        let scalars = Scalars::<F>::new(&self.config, slot.step + 1);
        let m = slot.exp_avg.get::<F>(OP, &p.name())?;
        let v = slot.exp_avg_sq.get::<F>(OP, &p.name())?;
        if grad.len() != n || m.len() != n || v.len() != n {
            return Err(Error::Config {
                op: OP,
                detail: format!(
                    "parameter {}: local sizes differ (value {n}, gradient {}, state {})",
                    p.name(),
                    grad.len(),
                    m.len()
                ),
            });
        }
        update_local::<F>(p, r.value, |data| kernel(&scalars, data, &grad, m, v))?;
        slot.step += 1;
        Ok(())
    }
}

#[cfg(feature = "cuda")]
impl AdamW {
    /// [`update`](super::PerParam::update) of a parameter on a GPU: the
    /// device kernel with the host's f32 scalars, in place on the parameter's
    /// local tensor and the moments.
    fn update_on_device(&mut self, r: Ready) -> Result<()> {
        let p = &self.params[r.index];
        // INVARIANT: `prepare` created the slot for every ready parameter.
        let slot = self.state[r.index].as_mut().expect("state prepared");
        let s = Scalars::<f32>::new(&self.config, slot.step + 1);
        let scalars = tessera_tensor::cuda::AdamScalars {
            decay: s.decay,
            lerp_weight: s.lerp_weight,
            beta2: s.beta2,
            one_minus_beta2: s.one_minus_beta2,
            bias_correction2_sqrt: s.bias_correction2_sqrt,
            eps: s.eps,
            neg_step_size: s.neg_step_size,
            lerp_small: i32::from(s.lerp_small),
        };
        let grad = r.grad.to_local().cast(DType::F32)?;
        let (m, v) = (&mut slot.exp_avg, &mut slot.exp_avg_sq);
        let (Some(m), Some(v)) = (m.device_mut(), v.device_mut()) else {
            return Err(Error::Config {
                op: OP,
                detail: format!("the state of {} is on the host but the parameter is on a GPU", p.name()),
            });
        };
        // The copy of the value `ready_param` took goes first, so that the
        // parameter may hold its storage alone and be updated in place.
        drop(r.value);
        let mut current = p.value_mut()?;
        // The kernel takes any shapes of one element count, and copies the
        // parameter first only if another handle shares its storage.
        current.update_local(|local| Ok(tessera_tensor::cuda::adamw_step(local, &grad, m, v, scalars)?))?;
        slot.step += 1;
        Ok(())
    }
}

impl Optimizer for AdamW {
    fn step(&mut self) -> Result<()> {
        super::step_all(self)
    }

    fn state_names(&self) -> &'static [&'static str] {
        &["exp_avg", "exp_avg_sq", "step"]
    }

    fn replicated_state_names(&self) -> &'static [&'static str] {
        &["step"]
    }

    fn state_tensors(&self) -> Result<Vec<(usize, &'static str, DTensor)>> {
        let mut out = Vec::new();
        for (i, (p, slot)) in self.params.iter().zip(&self.state).enumerate() {
            let Some(s) = slot else { continue };
            out.push((i, "exp_avg", s.exp_avg.to_dtensor(p, &s.layout)?));
            out.push((i, "exp_avg_sq", s.exp_avg_sq.to_dtensor(p, &s.layout)?));
            out.push((i, "step", super::step_tensor(&p.mesh(), s.step)?));
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
mod tests;
