//! AdamW against PyTorch's formula, its state, and its errors.

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
        assert!(err.contains("optimizer state was built for f32[4] (Shard(0))"), "{err}");
        Ok(())
    })
    .unwrap();
}
