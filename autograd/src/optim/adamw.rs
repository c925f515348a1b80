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
mod tests {
    use tessera_dtensor::{DTensor, Placement::*, Tensor, distribute_tensor};
    use tessera_mesh::{DeviceMesh, launch};

    use tessera_tensor::kernel::PAR_MIN_ELEMENTS;

    use super::*;
    use crate::optim::on_one_rank;

    /// The reference README's formula, in f64, one element.
    fn reference(c: &AdamWConfig, p0: f64, grads: &[f64]) -> Vec<f64> {
        let (b1, b2) = c.betas;
        let (mut p, mut m, mut v) = (p0, 0.0, 0.0);
        let mut out = Vec::new();
        for (t, &g) in grads.iter().enumerate() {
            let t = (t + 1) as i32;
            p *= 1.0 - c.lr * c.weight_decay;
            m = b1 * m + (1.0 - b1) * g;
            v = b2 * v + (1.0 - b2) * g * g;
            p -= c.lr / (1.0 - b1.powi(t)) * m / (v.sqrt() / (1.0 - b2.powi(t)).sqrt() + c.eps);
            out.push(p);
        }
        out
    }

    fn replicated(mesh: &DeviceMesh, t: Tensor) -> DTensor {
        distribute_tensor(&t, mesh, &[Replicate]).unwrap()
    }

    /// A config from (lr, β₁, β₂, eps, weight decay).
    fn c(lr: f64, b1: f64, b2: f64, eps: f64, weight_decay: f64) -> AdamWConfig {
        AdamWConfig {
            lr,
            betas: (b1, b2),
            eps,
            weight_decay,
        }
    }

    const TINY: AdamWConfig = AdamWConfig {
        lr: 1e-3,
        betas: (0.9, 0.95),
        eps: 1e-8,
        weight_decay: 0.1,
    };

    /// A parameter large enough to split over a rank's threads is updated to
    /// the one-thread bits, uneven last block included.
    #[test]
    fn split_update_equals_the_one_thread_one() {
        let n = 3 * PAR_MIN_ELEMENTS + 7;
        let run = |threads: usize| {
            let opts = tessera_mesh::LaunchOptions::default().threads_per_rank(threads);
            let out = tessera_mesh::launch_with(&opts, 1, move |_| {
                assert_eq!(par_parts(n), threads, "the case must split over every thread");
                let x = |i: usize, t: f64| ((i as f64 * 0.37 + t).sin() * 0.5) as f32;
                let mut p: Vec<f32> = (0..n).map(|i| x(i, 0.0)).collect();
                let (mut m, mut v) = (vec![0f32; n], vec![0f32; n]);
                for t in 1..=3 {
                    let g: Vec<f32> = (0..n).map(|i| x(i, 0.11 * t as f64)).collect();
                    kernel(&Scalars::new(&TINY, t), &mut p, &g, &mut m, &mut v);
                }
                Ok([p, m, v].concat().iter().map(|x| x.to_bits()).collect::<Vec<_>>())
            });
            out.unwrap().remove(0)
        };
        let (one, three) = (run(1), run(3));
        assert_eq!(one.len(), 3 * n);
        assert!(one == three, "the split update differs from the one-thread one");
    }

    /// A parameter that alone holds its value's storage is stepped in place
    /// (same buffer after the step); one whose value someone else still holds
    /// is stepped on a copy, and the other holder keeps the old values. Both
    /// give the same bits.
    #[test]
    fn a_step_is_in_place_only_where_nobody_else_sees_the_value() {
        on_one_rank(|mesh| {
            let init = [0.5f32, -1.0, 2.0];
            let mut results = Vec::new();
            for keep in [false, true] {
                let p = Param::named("w", replicated(mesh, Tensor::from_vec(init.to_vec(), &[3])?));
                let held = keep.then(|| p.value()).transpose()?;
                let addr = |p: &Param| -> Result<usize> {
                    Ok(p.value()?.to_local().as_slice::<f32>().map(|s| s.as_ptr() as usize)?)
                };
                let before = addr(&p)?;
                let mut opt = AdamW::new(vec![p.clone()], TINY)?;
                p.set_grad(Some(replicated(mesh, Tensor::from_vec(vec![0.1f32, -0.2, 0.3], &[3])?)));
                opt.step()?;
                assert_eq!(
                    addr(&p)? == before,
                    !keep,
                    "in place exactly when nobody else holds the value"
                );
                if let Some(held) = held {
                    assert_eq!(
                        held.to_local().to_vec::<f32>()?,
                        init,
                        "the other holder's value changed"
                    );
                }
                let got = p.value()?.to_local().to_vec::<f32>()?;
                assert!(
                    got.iter().zip(init).all(|(g, i)| g != &i),
                    "the step did nothing: {got:?}"
                );
                results.push(got.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
            }
            assert_eq!(results[0], results[1], "in place and on a copy differ");
            Ok(())
        });
    }

    #[test]
    fn three_steps_match_the_formula() {
        // config, initial value, gradients at steps 1..=3
        let cases = [
            (TINY, 0.5, [0.1, -0.2, 0.3]),
            (TINY, -1.25, [1e-3, 1e-3, 1e-3]),
            (TINY, 2.0, [0.0, 0.0, 0.0]),
            (TINY, 0.1, [5.0, -7.0, 0.5]),
            (AdamWConfig::default(), 0.5, [0.1, -0.2, 0.3]),
            (c(0.1, 0.9, 0.999, 1e-8, 0.0), 3.0, [1.0, 2.0, -4.0]),
            (c(1e-3, 0.3, 0.6, 1e-8, 0.1), 0.7, [-0.5, 0.25, 0.125]),
            (c(1e-3, 0.0, 0.0, 1e-8, 0.1), 0.7, [-0.5, 0.25, 0.125]),
            // 1 − β₁ ≥ ½ takes PyTorch's other lerp formula.
            (c(1e-3, 0.25, 0.6, 1e-8, 0.1), 0.7, [-0.5, 0.25, 0.125]),
        ];
        // Three of them worked in f64 independently of `reference` (case index, p after each step).
        let by_hand = [
            (0, [0.4989500001, 0.49926347902766033, 0.49887514542262024]),
            (1, [-1.2508749900001002, -1.2517498925012003, -1.2526247075120502]),
            (5, [2.900000001, 2.8034817990281664, 2.8228612444556136]),
        ];
        for (i, h) in by_hand {
            let (c, p0, grads) = &cases[i];
            let want = reference(c, *p0, grads);
            assert!(
                want.iter().zip(h).all(|(w, h)| (w - h).abs() <= 1e-15 * h.abs()),
                "{want:?} vs {h:?}"
            );
        }
        on_one_rank(move |mesh| {
            for (c, p0, grads) in &cases {
                let want = reference(c, *p0, grads);
                for dtype in [DType::F64, DType::F32] {
                    let p = Param::named("w", replicated(mesh, Tensor::full(&[3], *p0, dtype)?));
                    let mut opt = AdamW::new(vec![p.clone()], *c)?;
                    for (t, g) in grads.iter().enumerate() {
                        p.set_grad(Some(replicated(mesh, Tensor::full(&[3], *g, dtype)?)));
                        opt.step()?;
                        let tol = if dtype == DType::F64 { 1e-15 } else { 1e-6 };
                        for x in p.value()?.to_local().to_f64_vec() {
                            assert!(
                                (x - want[t]).abs() <= tol * want[t].abs().max(1.0),
                                "{c:?} p0 {p0} {dtype} step {}: got {x}, want {}",
                                t + 1,
                                want[t]
                            );
                        }
                    }
                    assert_eq!(opt.steps(0), 3);
                }
            }
            Ok(())
        });
    }

    /// The vectorised FMA loop gives the bits of the baseline one (whose
    /// multiply-adds are software `fma`), in both lerp forms, on an odd length.
    #[test]
    fn kernel_variants_agree() {
        fn run<F: Real>(simd: Simd, c: &AdamWConfig, steps: u64) -> Vec<Vec<F>> {
            let n = 1003;
            let x = |i: usize, k: f64| F::real(((i as f64 * k).sin() * 3.0).powi(3));
            let mut p: Vec<F> = (0..n).map(|i| x(i, 0.37)).collect();
            let (mut m, mut v) = (vec![F::real(0.0); n], vec![F::real(0.0); n]);
            for t in 1..=steps {
                let g: Vec<F> = (0..n).map(|i| x(i, 0.11 * t as f64)).collect();
                kernel_on(simd, &Scalars::new(c, t), &mut p, &g, &mut m, &mut v);
            }
            vec![p, m, v]
        }
        let all = Simd::supported();
        for c in [TINY, c(1e-3, 0.25, 0.6, 1e-8, 0.1)] {
            let (want32, want64) = (run::<f32>(Simd::Baseline, &c, 3), run::<f64>(Simd::Baseline, &c, 3));
            for &simd in &all {
                let bits32 = |v: &Vec<Vec<f32>>| v.concat().iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                let bits64 = |v: &Vec<Vec<f64>>| v.concat().iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits32(&run::<f32>(simd, &c, 3)), bits32(&want32), "{simd:?} f32 {c:?}");
                assert_eq!(bits64(&run::<f64>(simd, &c, 3)), bits64(&want64), "{simd:?} f64 {c:?}");
            }
        }
    }

    #[test]
    fn f32_rounds_as_pytorch() {
        // Two steps in f32, spelled out as PyTorch's CPU kernels round each op.
        let c = TINY;
        let (p0, g) = (0.5f32, [0.1f32, -0.3]);
        let (mut p, mut m, mut v) = (p0, 0.0f32, 0.0f32);
        for (t, &g) in g.iter().enumerate() {
            let t = (t + 1) as f64;
            p *= (1.0 - c.lr * c.weight_decay) as f32;
            m = ((1.0 - 0.9f64) as f32).mul_add(g - m, m);
            v = v * 0.95f32 + (1.0 - 0.95f64) as f32 * g * g;
            let denom = v.sqrt() / ((1.0 - 0.95f64.powf(t)).powf(0.5) as f32) + 1e-8f32;
            p += (-(1e-3 / (1.0 - 0.9f64.powf(t)))) as f32 * m / denom;
        }
        let got = on_one_rank(move |mesh| {
            let param = Param::named("w", replicated(mesh, Tensor::from_vec(vec![p0], &[1])?));
            let mut opt = AdamW::new(vec![param.clone()], c)?;
            for &g in &g {
                param.set_grad(Some(replicated(mesh, Tensor::from_vec(vec![g], &[1])?)));
                opt.step()?;
            }
            Ok(param.value()?.to_local().to_vec::<f32>()?)
        });
        assert_eq!(got, vec![p]);
    }

    #[test]
    fn bf16_params_keep_f32_moments() {
        on_one_rank(|mesh| {
            let p = Param::named("w", replicated(mesh, Tensor::full(&[4], 1.0, DType::BF16)?));
            let mut opt = AdamW::new(vec![p.clone()], c(0.25, 0.9, 0.95, 1e-8, 0.0))?;
            p.set_grad(Some(replicated(mesh, Tensor::full(&[4], 1.0, DType::BF16)?)));
            opt.step()?;
            assert_eq!(p.value()?.dtype(), DType::BF16);
            assert_eq!(p.value()?.to_local().to_f64_vec(), vec![0.75; 4]);
            assert_eq!(opt.state[0].as_ref().unwrap().dtype, DType::F32);
            Ok(())
        });
    }

    #[test]
    fn skips_params_without_grad_and_rejects_bad_input() {
        on_one_rank(|mesh| {
            let p = Param::named("w", replicated(mesh, Tensor::full(&[2, 2], 1.0, DType::F32)?));
            let q = Param::named("q", replicated(mesh, Tensor::ones(&[2], DType::F32)?));
            let mut opt = AdamW::new(vec![p.clone(), q.clone()], TINY)?;
            opt.step()?;
            assert_eq!(opt.steps(0), 0);
            // A gradient of another shape is an error naming the parameter, and nothing changes.
            q.set_grad(Some(replicated(mesh, Tensor::ones(&[2], DType::F32)?)));
            p.set_grad(Some(replicated(mesh, Tensor::ones(&[4], DType::F32)?)));
            let err = opt.step().unwrap_err().to_string();
            assert!(err.contains("gradient of w") && err.contains("[4]"), "{err}");
            assert_eq!(q.value()?.to_local().to_f64_vec(), vec![1.0; 2]);
            assert_eq!(opt.steps(1), 0);

            for (c, what) in [
                (c(-1.0, 0.9, 0.95, 1e-8, 0.1), "lr is -1"),
                (c(f64::NAN, 0.9, 0.95, 1e-8, 0.1), "lr is NaN"),
                (c(1e-3, 1.0, 0.9, 1e-8, 0.1), "betas.0 is 1"),
                (c(1e-3, 0.9, -0.1, 1e-8, 0.1), "betas.1 is -0.1"),
                (c(1e-3, 0.9, 0.95, -1e-8, 0.1), "eps is -0.00000001"),
                (c(1e-3, 0.9, 0.95, 1e-8, -0.1), "weight_decay is -0.1"),
            ] {
                let err = AdamW::new(vec![p.clone()], c).err().unwrap().to_string();
                assert!(err.contains(what), "{err}");
            }
            let err = AdamW::new(vec![p.clone(), p.clone()], TINY).err().unwrap().to_string();
            assert!(err.contains("listed twice"), "{err}");
            let ids = Param::named("ids", replicated(mesh, Tensor::zeros(&[2], DType::I64)?));
            ids.set_grad(Some(ids.value()?));
            let err = AdamW::new(vec![ids], TINY)?.step().unwrap_err().to_string();
            assert!(err.contains("ids has dtype i64"), "{err}");
            Ok(())
        });
    }

    /// The full tensor after `steps` steps on a mesh of 2, parameter and gradients
    /// placed by `placement`; also checks that the steps issue no collective.
    fn run_on_two(placement: tessera_dtensor::Placement, steps: usize) -> Vec<Vec<f32>> {
        launch(2, move |ctx| {
            let mesh = DeviceMesh::new(ctx.into_comm(), &[2])?;
            let full = Tensor::randn(&[5, 3], DType::F32, 7)?;
            let p = Param::named("w", distribute_tensor(&full, &mesh, &[placement])?);
            let mut opt = AdamW::new(vec![p.clone()], TINY)?;
            for s in 0..steps {
                let g = Tensor::randn(&[5, 3], DType::F32, 100 + s as u64)?;
                p.set_grad(Some(distribute_tensor(&g, &mesh, &[placement])?));
                let before = mesh.stats().total_calls();
                opt.step()?;
                assert_eq!(mesh.stats().total_calls(), before, "a step communicates");
            }
            Ok(p.value()?.full_tensor()?.to_vec::<f32>()?)
        })
        .unwrap()
    }

    #[test]
    fn sharded_update_equals_replicated() {
        let sharded = run_on_two(Shard(0), 4);
        let replicated = run_on_two(Replicate, 4);
        assert_eq!(sharded, replicated);
        assert_eq!(sharded[0], sharded[1]);
        launch(2, |ctx| {
            let mesh = DeviceMesh::new(ctx.into_comm(), &[2])?;
            let p = Param::named(
                "w",
                distribute_tensor(&Tensor::ones(&[5], DType::F32)?, &mesh, &[Shard(0)])?,
            );
            p.set_grad(Some(p.value()?));
            let mut opt = AdamW::new(vec![p.clone()], TINY)?;
            opt.step()?;
            // Moments have the local shard's size: 3 + 2 elements.
            let slot = opt.state[0].as_mut().unwrap();
            assert_eq!(slot.exp_avg.get::<f32>(OP, "w")?.len(), [3, 2][mesh.coordinate()[0]]);
            Ok(())
        })
        .unwrap();
    }

    #[test]
    fn layout_change_after_first_step_is_an_error() {
        launch(2, |ctx| {
            let mesh = DeviceMesh::new(ctx.into_comm(), &[2])?;
            let p = Param::named(
                "w",
                distribute_tensor(&Tensor::ones(&[4], DType::F32)?, &mesh, &[Shard(0)])?,
            );
            p.set_grad(Some(p.value()?));
            let mut opt = AdamW::new(vec![p.clone()], TINY)?;
            opt.step()?;
            let r = p.value()?.redistribute(&[Replicate])?;
            p.set_value(r.clone());
            p.set_grad(Some(r));
            let err = opt.step().unwrap_err().to_string();
            assert!(err.contains("optimizer state was built for [S(0)]"), "{err}");
            Ok(())
        })
        .unwrap();
    }
}
