//! Learning-rate schedules: the factor of the base learning rate at each step
//! ([`Schedule`]), composed one after another ([`Schedule::then`]), and the
//! scheduler that applies them to an optimizer and whose state travels in a
//! checkpoint's metadata ([`LrScheduler`]).
//!
//! Every factor is a closed form of the step (PyTorch's `_get_closed_form_lr`),
//! so a resumed run continues exactly where it stopped.

use std::collections::BTreeMap;
use std::f64::consts::PI;

use super::Optimizer;
use crate::state_dict::Stateful;
use crate::state_dict::stateful::parsed;
use crate::{Error, Result};

const OP: &str = "lr_scheduler";

/// The factor of the base learning rate as a function of the step `t`
/// (0 before the first optimizer step).
#[derive(Clone, Debug, PartialEq)]
pub enum Schedule {
    /// Factor 1 at every step.
    ///
    /// PyTorch: no scheduler (`LambdaLR(lambda t: 1.0)`).
    Constant,
    /// From `start` to `end` linearly over `steps` steps, then `end`:
    /// `start + (end − start) · min(t, steps) / steps`.
    ///
    /// PyTorch: `LinearLR(start_factor, end_factor, total_iters)`.
    Linear {
        /// The factor at step 0.
        start: f64,
        /// The factor from step `steps` on.
        end: f64,
        /// Steps to get there (at least 1).
        steps: u64,
    },
    /// Half a cosine from 1 down to `min` over `steps` steps, then `min`:
    /// `min + (1 − min) · (1 + cos(π · min(t, steps) / steps)) / 2`.
    ///
    /// PyTorch: `CosineAnnealingLR(T_max=steps, eta_min=min · base_lr)`, whose
    /// closed form would rise again after `T_max`; this one stays at `min`.
    Cosine {
        /// Steps of the decay (at least 1).
        steps: u64,
        /// The final factor.
        min: f64,
    },
    /// `first` until step `at`, then `next` with its steps counted from `at`.
    ///
    /// PyTorch: `SequentialLR(schedulers=[first, next], milestones=[at])`.
    Then {
        /// The schedule before the milestone.
        first: Box<Schedule>,
        /// The milestone.
        at: u64,
        /// The schedule from the milestone on.
        next: Box<Schedule>,
    },
}

impl Schedule {
    /// `self` until step `at`, then `next` (counted from `at`).
    pub fn then(self, at: u64, next: Schedule) -> Schedule {
        Schedule::Then {
            first: Box::new(self),
            at,
            next: Box::new(next),
        }
    }

    /// Linear warmup from `1 / (warmup + 1)` to 1 over `warmup` steps, then
    /// cosine decay to `min` over the remaining `total − warmup` steps.
    ///
    /// # Errors
    /// `warmup` ≥ `total`, or a `min` outside `[0, 1]`.
    pub fn warmup_cosine(warmup: u64, total: u64, min: f64) -> Result<Schedule> {
        check(
            warmup < total,
            format!("warmup_cosine: warmup {warmup} must be below total {total}"),
        )?;
        check(
            (0.0..=1.0).contains(&min),
            format!("warmup_cosine: min {min} must lie in [0, 1]"),
        )?;
        Ok(warmup_to_one(warmup).then(
            warmup,
            Schedule::Cosine {
                steps: total - warmup,
                min,
            },
        ))
    }

    /// Warmup-stable-decay: linear warmup to 1 over `warmup` steps, factor 1
    /// until `total − decay`, then linear decay to `min` over the last `decay`
    /// steps.
    ///
    /// # Errors
    /// `warmup + decay` above `total`, `decay` 0, or a `min` outside `[0, 1]`.
    pub fn warmup_stable_decay(warmup: u64, decay: u64, total: u64, min: f64) -> Result<Schedule> {
        check(
            decay > 0 && warmup.saturating_add(decay) <= total,
            format!("warmup_stable_decay: warmup {warmup} + decay {decay} (at least 1) must fit in total {total}"),
        )?;
        check(
            (0.0..=1.0).contains(&min),
            format!("warmup_stable_decay: min {min} must lie in [0, 1]"),
        )?;
        let decay_at = total - decay;
        Ok(warmup_to_one(warmup).then(warmup, Schedule::Constant).then(
            decay_at,
            Schedule::Linear {
                start: 1.0,
                end: min,
                steps: decay,
            },
        ))
    }

    /// The factor at step `t`.
    pub fn factor(&self, t: u64) -> f64 {
        match self {
            Schedule::Constant => 1.0,
            Schedule::Linear { start, end, steps } => {
                let steps = (*steps).max(1);
                start + (end - start) * t.min(steps) as f64 / steps as f64
            }
            Schedule::Cosine { steps, min } => {
                let steps = (*steps).max(1);
                min + (1.0 - min) * (1.0 + (PI * t.min(steps) as f64 / steps as f64).cos()) / 2.0
            }
            Schedule::Then { first, at, next } => {
                if t < *at {
                    first.factor(t)
                } else {
                    next.factor(t - at)
                }
            }
        }
    }
}

/// Linear from `1 / (warmup + 1)` to 1 over `warmup` steps (constant 1 without warmup).
fn warmup_to_one(warmup: u64) -> Schedule {
    if warmup == 0 {
        return Schedule::Constant;
    }
    Schedule::Linear {
        start: 1.0 / (warmup + 1) as f64,
        end: 1.0,
        steps: warmup,
    }
}

fn check(ok: bool, detail: String) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(Error::Config { op: OP, detail })
    }
}

/// Applies a [`Schedule`] to an optimizer: the learning rate at step `t` is
/// `base_lr · schedule.factor(t)`, set when the scheduler is made (step 0) and
/// after each [`step`](Self::step).
///
/// PyTorch: `torch.optim.lr_scheduler.LRScheduler` (`scheduler.step()` after
/// `optimizer.step()`, `state_dict`/`load_state_dict`).
#[derive(Clone, Debug)]
pub struct LrScheduler {
    schedule: Schedule,
    base_lr: f64,
    step: u64,
}

/// The state key of the scheduler's step.
const STEP_KEY: &str = "step";
/// The state key of the scheduler's base learning rate.
const BASE_KEY: &str = "base_lr";

impl LrScheduler {
    /// A scheduler whose base learning rate is `opt`'s current one; sets
    /// `opt`'s learning rate to the factor at step 0.
    ///
    /// # Errors
    /// A learning rate the optimizer refuses (a negative factor).
    pub fn new(schedule: Schedule, opt: &mut dyn Optimizer) -> Result<LrScheduler> {
        let s = LrScheduler {
            schedule,
            base_lr: opt.lr(),
            step: 0,
        };
        opt.set_lr(s.lr())?;
        Ok(s)
    }

    /// The learning rate at the current step.
    pub fn lr(&self) -> f64 {
        self.base_lr * self.schedule.factor(self.step)
    }

    /// Steps taken.
    pub fn steps(&self) -> u64 {
        self.step
    }

    /// Advances one step and sets `opt`'s learning rate.
    ///
    /// # Errors
    /// A learning rate the optimizer refuses.
    pub fn step(&mut self, opt: &mut dyn Optimizer) -> Result<()> {
        self.step += 1;
        opt.set_lr(self.lr())
    }

    /// Moves the schedule to `steps` steps taken, its base learning rate kept:
    /// for a run resumed from a checkpoint that carries no scheduler state;
    /// [`apply`](Self::apply) then sets the optimizer's rate. PyTorch: setting
    /// `last_epoch`.
    pub fn set_steps(&mut self, steps: u64) {
        self.step = steps;
    }

    /// Sets `opt`'s learning rate to this step's: after restoring the
    /// scheduler from a checkpoint ([`Stateful::load_state_dict`]), before the
    /// first resumed step.
    ///
    /// # Errors
    /// A learning rate the optimizer refuses.
    pub fn apply(&self, opt: &mut dyn Optimizer) -> Result<()> {
        opt.set_lr(self.lr())
    }
}

/// The step and the base learning rate (`step`, `base_lr`; the schedule
/// itself is the program's). PyTorch: `LRScheduler.state_dict`.
impl Stateful for LrScheduler {
    fn state_dict(&self) -> BTreeMap<String, String> {
        BTreeMap::from([
            (STEP_KEY.to_string(), self.step.to_string()),
            (BASE_KEY.to_string(), self.base_lr.to_string()),
        ])
    }

    /// Restores the step and base learning rate; nothing changes unless both
    /// are good. The optimizer's learning rate is set by [`LrScheduler::apply`].
    fn load_state_dict(&mut self, state: &BTreeMap<String, String>) -> Result<()> {
        let step: u64 = parsed(state, STEP_KEY).map_err(|_| Error::Config {
            op: OP,
            detail: format!(
                "{STEP_KEY} is {:?}, not a step count",
                state.get(STEP_KEY).map_or("missing", String::as_str)
            ),
        })?;
        let base = state.get(BASE_KEY).map_or("missing", String::as_str);
        let base_lr: f64 = base
            .parse()
            .ok()
            .filter(|b: &f64| b.is_finite() && *b >= 0.0)
            .ok_or_else(|| Error::Config {
                op: OP,
                detail: format!("{BASE_KEY} is {base:?}, not a finite learning rate ≥ 0"),
            })?;
        self.step = step;
        self.base_lr = base_lr;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) {
        assert!((a - b).abs() < 1e-15, "{a} vs {b}");
    }

    #[test]
    fn factors_follow_pytorchs_closed_forms() {
        // LinearLR(start_factor=0.25, end_factor=1, total_iters=3).
        let lin = Schedule::Linear {
            start: 0.25,
            end: 1.0,
            steps: 3,
        };
        for (t, want) in [(0, 0.25), (1, 0.5), (2, 0.75), (3, 1.0), (9, 1.0)] {
            close(lin.factor(t), want);
        }
        // CosineAnnealingLR(T_max=4, eta_min=0.1·base): 1, 0.8682..., 0.55, 0.2318..., 0.1.
        let cos = Schedule::Cosine { steps: 4, min: 0.1 };
        let half = 0.5 * 2f64.sqrt() / 2.0;
        for (t, want) in [
            (0, 1.0),
            (1, 0.1 + 0.9 * (0.5 + half)),
            (2, 0.55),
            (3, 0.1 + 0.9 * (0.5 - half)),
            (4, 0.1),
            (7, 0.1),
        ] {
            close(cos.factor(t), want);
        }
        // SequentialLR: the second schedule counts from the milestone.
        let seq = lin.clone().then(3, cos.clone());
        close(seq.factor(2), 0.75);
        close(seq.factor(3), 1.0);
        close(seq.factor(5), 0.55);
        assert_eq!(Schedule::Constant.factor(123), 1.0);
    }

    #[test]
    fn warmup_cosine_and_wsd_shapes() {
        let s = Schedule::warmup_cosine(4, 10, 0.0).unwrap();
        close(s.factor(0), 0.2);
        close(s.factor(3), 0.8);
        close(s.factor(4), 1.0);
        close(s.factor(7), 0.5);
        close(s.factor(10), 0.0);
        let w = Schedule::warmup_stable_decay(2, 4, 10, 0.1).unwrap();
        close(w.factor(0), 1.0 / 3.0);
        close(w.factor(2), 1.0);
        close(w.factor(5), 1.0);
        close(w.factor(6), 1.0);
        close(w.factor(8), 0.55);
        close(w.factor(10), 0.1);
        for bad in [
            Schedule::warmup_cosine(10, 10, 0.0),
            Schedule::warmup_cosine(1, 10, 1.5),
            Schedule::warmup_stable_decay(5, 6, 10, 0.0),
            Schedule::warmup_stable_decay(0, 0, 10, 0.0),
        ] {
            let e = bad.unwrap_err().to_string();
            assert!(e.contains("lr_scheduler"), "{e}");
        }
    }

    #[test]
    fn a_scheduler_sets_the_lr_and_resumes_from_its_state() {
        use crate::Param;
        use crate::optim::{AdamW, AdamWConfig};
        use tessera_dtensor::{DType, Placement, Tensor, distribute_tensor};
        use tessera_mesh::{DeviceMesh, launch};

        launch(1, |ctx| {
            let mesh = DeviceMesh::new(ctx.into_comm(), &[1])?;
            let adamw = || -> Result<AdamW> {
                let w = distribute_tensor(&Tensor::ones(&[2], DType::F32)?, &mesh, &[Placement::Replicate])?;
                let config = AdamWConfig {
                    lr: 0.1,
                    ..AdamWConfig::default()
                };
                AdamW::new(vec![Param::new(w)], config)
            };
            let schedule = Schedule::warmup_cosine(2, 6, 0.0)?;
            let mut opt = adamw()?;
            let mut s = LrScheduler::new(schedule.clone(), &mut opt)?;
            close(opt.lr(), 0.1 / 3.0);
            s.step(&mut opt)?;
            s.step(&mut opt)?;
            close(opt.lr(), 0.1);
            // A resumed run: a fresh optimizer and scheduler, then the saved state.
            let (mut opt2, state) = (adamw()?, s.state_dict());
            let mut s2 = LrScheduler::new(schedule.clone(), &mut opt2)?;
            s2.load_state_dict(&state)?;
            s2.apply(&mut opt2)?;
            assert_eq!((s2.steps(), opt2.lr()), (2, opt.lr()));
            // Or moved to the step when a checkpoint carries no scheduler state.
            let mut opt3 = adamw()?;
            let mut s3 = LrScheduler::new(schedule, &mut opt3)?;
            s3.set_steps(2);
            s3.apply(&mut opt3)?;
            assert_eq!((s3.steps(), opt3.lr()), (2, opt.lr()));
            for _ in 0..5 {
                s.step(&mut opt)?;
                s2.step(&mut opt2)?;
                assert_eq!(opt.lr().to_bits(), opt2.lr().to_bits());
            }
            close(opt.lr(), 0.0);
            // Bad state: named, and nothing changes.
            let mut bad = state.clone();
            bad.remove(STEP_KEY);
            let e = s2.load_state_dict(&bad).unwrap_err().to_string();
            assert!(e.contains("step is \"missing\""), "{e}");
            bad.insert(STEP_KEY.into(), "-3".into());
            let e = s2.load_state_dict(&bad).unwrap_err().to_string();
            assert!(e.contains("not a step count"), "{e}");
            bad.insert(STEP_KEY.into(), "1".into());
            bad.insert(BASE_KEY.into(), "NaN".into());
            let e = s2.load_state_dict(&bad).unwrap_err().to_string();
            assert!(e.contains("not a finite learning rate"), "{e}");
            assert_eq!(s2.steps(), 7);
            Ok(())
        })
        .unwrap();
    }
}
