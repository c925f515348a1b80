//! [`clip_grad_norm`]: gradient clipping by the global 2-norm.

use tessera_dtensor::{DTensor, Placement, ReduceOp};
use tessera_mesh::{CommunicatorExt, DType, DeviceMesh};

use tessera_tensor::kernel::Real;

use super::{local_cow, with_local};
use crate::{Error, Param, Result};

const OP: &str = "clip_grad_norm";

/// Scales all gradients so that their global 2-norm is at most `max_norm`, and
/// returns the norm before clipping. Collective: every rank of the parameters'
/// meshes must call it, with the same parameters in the same order.
///
/// The norm is that of all gradients together, as if each were one full tensor on
/// one device: each rank sums the squares of its local shards in `f64`, counting a
/// replicated shard once (on coordinate 0 of each `Replicate` mesh dim), and one
/// all_reduce (sum) per mesh adds the ranks' sums. With `total > max_norm` every
/// gradient is multiplied by `max_norm / (total + 1e-6)` (in the gradient's dtype,
/// `f32` for half types), locally; otherwise the gradients are left as they are.
/// A NaN or infinite norm is returned as is and makes the gradients NaN, as
/// PyTorch does by default. `max_norm = f64::INFINITY` only measures the norm.
///
/// Gradients are normally in their parameter's placements, never partial. A
/// `Partial` gradient is reduced (one more all_reduce per such gradient) to
/// measure its norm, then scaled in its own placements.
///
/// PyTorch: `torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=2.0)`
/// (over DTensor gradients, as PyTorch's DTensor-based parallelism uses it).
///
/// # Errors
/// A negative or NaN `max_norm`, a non-float gradient, a `Partial(product)`
/// gradient (scaling it is not linear), or a communication failure.
#[track_caller]
pub fn clip_grad_norm(params: &[Param], max_norm: f64) -> Result<f64> {
    let _site = tessera_mesh::callsite::enter().tag(tessera_mesh::callsite::tag_of(&clip_tag(params)));
    if max_norm.is_nan() || max_norm < 0.0 {
        return Err(Error::Config {
            op: OP,
            detail: format!("max_norm is {max_norm}, it must be ≥ 0"),
        });
    }
    let mut grads = Vec::new();
    for p in params {
        let Some(g) = p.grad() else { continue };
        if !g.dtype().is_float() {
            return Err(Error::Config {
                op: OP,
                detail: format!(
                    "the gradient of {} has dtype {}; gradients must be floats",
                    p.name(),
                    g.dtype()
                ),
            });
        }
        if g.placements().contains(&Placement::Partial(ReduceOp::Product)) {
            return Err(Error::Config {
                op: OP,
                detail: format!(
                    "the gradient of {} is a pending product ({}); reduce it before clipping",
                    p.name(),
                    tessera_dtensor::PlacementsDisplay(g.placements())
                ),
            });
        }
        grads.push((p, g));
    }
    if grads.is_empty() {
        return Ok(0.0);
    }

    // Sum of squares per mesh, in the order the meshes first appear (the same on every rank).
    let mut groups: Vec<(DeviceMesh, f64)> = Vec::new();
    for (_, g) in &grads {
        let s = local_sum_of_squares(g)?;
        match groups.iter_mut().find(|(m, _)| m.same_as(g.mesh())) {
            Some((_, acc)) => *acc += s,
            None => groups.push((g.mesh().clone(), s)),
        }
    }
    let mut total_sq = 0.0;
    for (mesh, s) in &groups {
        let mut buf = [*s];
        mesh.comm().all_reduce_slice(&mut buf, ReduceOp::Sum)?;
        total_sq += buf[0];
    }
    let total = total_sq.sqrt();

    let clip_coef = max_norm / (total + 1e-6);
    // A NaN coefficient (from a NaN norm) spreads, as in PyTorch.
    if clip_coef.is_nan() || clip_coef < 1.0 {
        for (p, g) in &grads {
            let scaled = match g.dtype() {
                DType::F64 => scale::<f64>(g, clip_coef)?,
                _ => scale::<f32>(g, clip_coef)?,
            };
            p.set_grad(Some(scaled));
        }
    }
    Ok(total)
}

/// What `clip_grad_norm` is about, for its call-site tag: every parameter's
/// name and shape (the same list on every rank in SPMD code).
fn clip_tag(params: &[Param]) -> Vec<(String, Vec<usize>)> {
    params.iter().map(|p| (p.name(), p.shape())).collect()
}

/// This rank's share of `‖g‖²`: the squares of its local elements, or 0 where
/// another rank holds the same copy (a non-zero coordinate along a replicated mesh
/// dim). Partial dims are reduced first.
fn local_sum_of_squares(g: &DTensor) -> Result<f64> {
    let reduced;
    let g = if g.layout().has_partial() {
        let placements: Vec<Placement> = g
            .placements()
            .iter()
            .map(|p| if p.is_partial() { Placement::Replicate } else { *p })
            .collect();
        reduced = g.redistribute_with_order(&placements, g.layout().order.clone())?;
        &reduced
    } else {
        g
    };
    let coord = g.mesh().coordinate();
    let owner = g
        .placements()
        .iter()
        .zip(coord)
        .all(|(p, &c)| !p.is_replicate() || c == 0);
    if !owner {
        return Ok(0.0);
    }
    fn sum_sq<F: Real>(t: &tessera_dtensor::Tensor) -> Result<f64> {
        Ok(local_cow::<F>(t)?.iter().map(|&x| x.widen() * x.widen()).sum())
    }
    match g.dtype() {
        DType::F64 => sum_sq::<f64>(g.to_local()),
        _ => sum_sq::<f32>(g.to_local()),
    }
}

/// `g · coef` locally, computed in `F` with `coef` rounded to `F`.
fn scale<F: Real>(g: &DTensor, coef: f64) -> Result<DTensor> {
    let c = F::real(coef);
    let data: Vec<F> = local_cow::<F>(g.to_local())?.iter().map(|&x| x * c).collect();
    with_local(g, data)
}

#[cfg(test)]
mod tests {
    use tessera_dtensor::{Placement::*, Tensor, distribute_tensor};
    use tessera_mesh::{OpKind, launch};

    use super::*;
    use crate::optim::on_one_rank;

    #[test]
    fn norm_and_scaling_on_one_rank() {
        on_one_rank(|mesh| {
            let rep =
                |v: Vec<f32>| distribute_tensor(&Tensor::from_vec(v.clone(), &[v.len()]).unwrap(), mesh, &[Replicate]);
            let a = Param::named("a", rep(vec![0.0; 2])?);
            let b = Param::named("b", rep(vec![0.0; 1])?);
            let c = Param::named("c", rep(vec![0.0; 1])?);
            a.set_grad(Some(rep(vec![3.0, 0.0])?));
            b.set_grad(Some(rep(vec![4.0])?));
            let params = [a.clone(), b.clone(), c.clone()];
            // No clipping below the threshold (at it, the 1e-6 in the coefficient clips a hair).
            assert_eq!(clip_grad_norm(&params, 6.0)?, 5.0);
            assert_eq!(b.grad().unwrap().to_local().to_vec::<f32>()?, vec![4.0]);
            // Clipping to 1: coefficient 1 / (5 + 1e-6).
            assert_eq!(clip_grad_norm(&params, 1.0)?, 5.0);
            let coef = (1.0 / (5.0 + 1e-6)) as f32;
            assert_eq!(a.grad().unwrap().to_local().to_vec::<f32>()?, vec![3.0 * coef, 0.0]);
            assert_eq!(b.grad().unwrap().to_local().to_vec::<f32>()?, vec![4.0 * coef]);
            assert!(c.grad().is_none());
            assert!((clip_grad_norm(&params, f64::INFINITY)? - 1.0).abs() < 1e-6);
            // Nothing to clip: 0, no collective.
            let before = mesh.stats().total_calls();
            assert_eq!(clip_grad_norm(std::slice::from_ref(&c), 1.0)?, 0.0);
            assert_eq!(mesh.stats().total_calls(), before);
            let err = clip_grad_norm(&params, -1.0).unwrap_err().to_string();
            assert!(err.contains("max_norm is -1"), "{err}");
            // A NaN gradient makes the norm NaN and every gradient NaN.
            b.set_grad(Some(rep(vec![f32::NAN])?));
            assert!(clip_grad_norm(&params, 1.0)?.is_nan());
            assert!(a.grad().unwrap().to_local().to_f64_vec().iter().all(|x| x.is_nan()));
            Ok(())
        });
    }

    /// Per case: mesh shape and two parameters' placements; every rank returns
    /// (norm, all_reduces issued, clipped full gradients).
    type Run = Vec<(f64, u64, Vec<Vec<f64>>)>;

    fn run(mesh_shape: &'static [usize], placements: [&'static [Placement]; 2], max_norm: f64) -> Run {
        let world = mesh_shape.iter().product();
        launch(world, move |ctx| {
            let mesh = DeviceMesh::new(ctx.into_comm(), mesh_shape)?;
            let shapes: [&[usize]; 2] = [&[5, 3], &[7]];
            let mut params = Vec::new();
            for (i, (shape, pl)) in shapes.iter().zip(placements).enumerate() {
                let full = Tensor::randn(shape, DType::F32, 3 + i as u64)?;
                let p = Param::named(format!("p{i}"), distribute_tensor(&full, &mesh, pl)?);
                let g = Tensor::randn(shape, DType::F32, 30 + i as u64)?;
                p.set_grad(Some(distribute_tensor(&g, &mesh, pl)?));
                params.push(p);
            }
            let before = mesh.stats();
            let norm = clip_grad_norm(&params, max_norm)?;
            let reduces = mesh.stats().calls(OpKind::AllReduce) - before.calls(OpKind::AllReduce);
            let total = mesh.stats().total_calls() - before.total_calls();
            assert_eq!(total, reduces, "only all_reduces");
            let mut full = Vec::new();
            for p in &params {
                full.push(p.grad().unwrap().full_tensor()?.to_f64_vec());
            }
            Ok((norm, reduces, full))
        })
        .unwrap()
    }

    #[test]
    fn sharded_and_replicated_grads_give_the_same_norm_with_one_all_reduce() {
        let oracle = run(&[1], [&[Replicate], &[Replicate]], 1.0);
        let (want_norm, _, want_grads) = &oracle[0];
        // The same norm by hand from the unclipped gradients.
        let by_hand: f64 = [(&[5usize, 3][..], 30u64), (&[7][..], 31)]
            .iter()
            .flat_map(|(s, seed)| Tensor::randn(s, DType::F32, *seed).unwrap().to_f64_vec())
            .map(|x| x * x)
            .sum::<f64>()
            .sqrt();
        assert!((want_norm - by_hand).abs() < 1e-12, "{want_norm} vs {by_hand}");
        assert!(*want_norm > 1.0, "the case must clip");
        let cases: &[(&'static [usize], [&'static [Placement]; 2])] = &[
            (&[2], [&[Shard(0)], &[Shard(0)]]),
            (&[2], [&[Replicate], &[Replicate]]),
            (&[2], [&[Shard(1)], &[Replicate]]),
            (&[4], [&[Shard(0)], &[Shard(0)]]),
            (&[2, 2], [&[Replicate, Shard(0)], &[Replicate, Shard(0)]]),
            (&[2, 2], [&[Shard(0), Shard(1)], &[Replicate, Replicate]]),
            (&[2, 2], [&[Shard(0), Shard(0)], &[Shard(0), Replicate]]),
        ];
        for (shape, pl) in cases {
            for (rank, (norm, reduces, grads)) in run(shape, *pl, 1.0).into_iter().enumerate() {
                let ctx = format!("mesh {shape:?} {pl:?} rank {rank}");
                assert!(
                    (norm - want_norm).abs() < 1e-12 * want_norm,
                    "{ctx}: {norm} vs {want_norm}"
                );
                assert_eq!(reduces, 1, "{ctx}");
                for (got, want) in grads.iter().flatten().zip(want_grads.iter().flatten()) {
                    assert!(
                        (got - want).abs() < 1e-6 * want.abs().max(1e-3),
                        "{ctx}: {got} vs {want}"
                    );
                }
            }
        }
    }

    #[test]
    fn partial_grads_are_reduced_before_squaring() {
        let out = launch(2, |ctx| {
            let mesh = DeviceMesh::new(ctx.into_comm(), &[2])?;
            let p = Param::named(
                "w",
                distribute_tensor(&Tensor::zeros(&[2], DType::F64)?, &mesh, &[Replicate])?,
            );
            // Partial values [1, 2] and [2, 2]: the gradient is [3, 4], norm 5 (not √13).
            let local = if mesh.coordinate()[0] == 0 {
                vec![1.0, 2.0]
            } else {
                vec![2.0, 2.0]
            };
            let g = DTensor::from_local(Tensor::from_vec(local, &[2])?, &mesh, &[Partial(ReduceOp::Sum)], &[2])?;
            p.set_grad(Some(g));
            let norm = clip_grad_norm(std::slice::from_ref(&p), 2.5)?;
            let g = p.grad().unwrap();
            assert_eq!(g.placements(), &[Partial(ReduceOp::Sum)]);
            Ok((norm, g.full_tensor()?.to_vec::<f64>()?))
        })
        .unwrap();
        for (norm, g) in out {
            assert_eq!(norm, 5.0);
            let c = 2.5 / (5.0 + 1e-6);
            assert!(
                (g[0] - 3.0 * c).abs() < 1e-12 && (g[1] - 4.0 * c).abs() < 1e-12,
                "{g:?}"
            );
        }
    }
}
