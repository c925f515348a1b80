//! Dropout as a module: masks drawn from the rank's seeded stream of keys,
//! the identity in evaluation, replayed when a checkpointed block recomputes,
//! and the same elements dropped on any mesh.

use tessera::autograd::nn::{Dropout, Module};
use tessera::autograd::random::manual_seed;
use tessera::autograd::{Param, Result, Var, backward, checkpoint};
use tessera::dtensor::{DType, Placement, Placement::*, Tensor};

use crate::harness::{R, full_grad, gathered, max_rel_err, on_mesh, param, uniform};

const WIDTH: usize = 32;
const BATCH: usize = 8;
const LAYERS: usize = 3;

#[test]
fn dropout_draws_a_new_mask_per_call_and_passes_through_in_evaluation() {
    let out = on_mesh(&[1], |mesh| -> R<_> {
        let ones = Var::constant(tessera::dtensor::distribute_tensor(
            &Tensor::ones(&[BATCH, WIDTH], DType::F64)?,
            mesh,
            &[Replicate],
        )?);
        let d = Dropout::new(0.5)?;
        manual_seed(5);
        let first = d.forward(&ones)?.value().full_tensor()?.to_f64_vec();
        let second = d.forward(&ones)?.value().full_tensor()?.to_f64_vec();
        manual_seed(5);
        let again = d.forward(&ones)?.value().full_tensor()?.to_f64_vec();
        d.train(false);
        let evaluated = d.forward(&ones)?.value().full_tensor()?.to_f64_vec();
        Ok((first, second, again, evaluated, d.is_training()))
    })
    .remove(0);
    let (first, second, again, evaluated, training) = out;
    assert!(
        first.iter().all(|&v| v == 0.0 || v == 2.0),
        "kept elements are scaled by 2"
    );
    let dropped = first.iter().filter(|&&v| v == 0.0).count();
    assert!((80..=176).contains(&dropped), "{dropped} of 256 dropped at p = 0.5");
    assert_ne!(first, second, "each call draws another mask");
    assert_eq!(first, again, "the same seed gives the same masks");
    assert!(
        !training && evaluated.iter().all(|&v| v == 1.0),
        "evaluation passes through"
    );
    let e = Dropout::new(-0.1).err().expect("p < 0 is refused").to_string();
    assert!(e.contains("not a probability"), "{e}");
}

/// `h ← dropout(gelu(h·Wᵢᵀ))` for every layer, each dropout its own module.
fn stack(h: &Var, layers: &[(Param, std::rc::Rc<Dropout>)]) -> Result<Var> {
    let mut h = h.clone();
    for (w, d) in layers {
        h = d.forward(&h.linear(&gathered(w)?, None)?.gelu()?)?;
    }
    Ok(h)
}

/// The gradients of the input and the weights, the model run plainly or with
/// each layer checkpointed, the batch placed `batch` on `mesh_shape`.
fn grads(mesh_shape: &[usize], batch: &'static [Placement], checkpointed: bool) -> Vec<Tensor> {
    on_mesh(mesh_shape, move |mesh| -> R<_> {
        let x = param("x", &uniform(&[BATCH, WIDTH], 1), mesh, batch)?;
        let replicated = vec![Replicate; mesh.shape().len()];
        let layers = (0..LAYERS)
            .map(|i| -> R<_> {
                let w = uniform(&[WIDTH, WIDTH], 10 + i as u64).mul_scalar(0.3)?;
                Ok((
                    param(&format!("w{i}"), &w, mesh, &replicated)?,
                    std::rc::Rc::new(Dropout::new(0.3)?),
                ))
            })
            .collect::<R<Vec<_>>>()?;
        manual_seed(9);
        let mut h = x.var()?;
        for layer in &layers {
            h = if checkpointed {
                let layer = [layer.clone()];
                checkpoint(&[h], move |xs| stack(&xs[0], &layer))?
            } else {
                stack(&h, std::slice::from_ref(layer))?
            };
        }
        backward(&h.square()?.sum(&[0, 1], false)?)?;
        let mut grads = vec![full_grad(&x)?];
        for (w, _) in &layers {
            grads.push(full_grad(w)?);
        }
        Ok(grads)
    })
    .remove(0)
}

#[test]
fn a_recomputed_block_replays_its_dropout_masks() {
    let plain = grads(&[1], &[Replicate], false);
    for (mesh, batch, checkpointed) in [
        (&[1][..], &[Replicate][..], true),
        (&[2], &[Shard(0)], false),
        (&[2], &[Shard(0)], true),
        (&[2, 2], &[Shard(0), Shard(1)], true),
    ] {
        let got = grads(mesh, batch, checkpointed);
        for (i, (g, w)) in got.iter().zip(&plain).enumerate() {
            let e = max_rel_err(g, w).unwrap();
            assert!(
                e <= 1e-10,
                "{mesh:?} {batch:?} checkpointed {checkpointed}: gradient {i} (0 is the input) off by {e:.2e}"
            );
        }
    }
}
