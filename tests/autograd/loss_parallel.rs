//! Tensor-parallel ops and their gradients against one device seeing the full
//! tensors:
//!
//! - cross entropy on class-sharded logits (loss parallel): the loss and the logits'
//!   gradient on tp = 2, 3, 4 and on a 2×2 (dp, tp) mesh, vocabularies that do not
//!   divide (empty class shards included); the forward moves exactly two all_reduces
//!   of `rows` and `2 · rows` elements, the backward nothing, and the gradient has
//!   the logits' placements;
//! - a row-parallel linear (`x` `Shard(-1)`, `W` `Shard(1)`) with a replicated bias:
//!   the output stays `Partial(sum)`, the bias is added once whichever way the output
//!   is reduced, a reduction to `Shard(1)` is one reduce_scatter, and the gradients
//!   of `x`, `W` and the bias are the full-tensor ones;
//! - the gradient of a row- or column-sharded embedding table: sharded like the
//!   table, no communication in backward, no full table built;
//! - 16-bit logits: the loss of their `f32` upcast and its gradient rounded
//!   back, bit for bit, with no cast op where the class dim is whole.

use std::cell::RefCell;
use std::rc::Rc;

use tessera::autograd::{Var, backward};
use tessera::dtensor::Placement::{self, Partial, Replicate, Shard};
use tessera::dtensor::sharding::shard_size_and_offset;
use tessera::dtensor::{DType, ReduceOp, Tensor, distribute_tensor};
use tessera::mesh::observe::{self, OpLog};
use tessera::mesh::{CommCounts, OpKind};
use tessera::tensor::memory;
use tessera::tensor::ops::Reduction;

use crate::harness::{
    constant, full_grad, indices, max_rel_err, on_mesh, param, replicate, scalar, uniform, weighted_sum,
};

const SUM: Placement = Partial(ReduceOp::Sum);

/// Tolerance of f64 results (the brief asks 1e-6; f64 does far better).
const TOL: f64 = 1e-12;

/// What one rank saw of cross entropy's forward and backward.
struct CeOut {
    coord: Vec<usize>,
    loss: f64,
    loss_placements: Vec<Placement>,
    /// The gradient reaching the logits, as it arrived.
    grad: Tensor,
    grad_placements: Vec<Placement>,
    forward: CommCounts,
    backward: CommCounts,
    /// The DTensor ops of forward and backward, as the op log names them.
    ops: Vec<&'static str>,
    loss_dtype: DType,
}

/// Cross entropy of `[..., V]` logits on one device, and the gradient of the
/// loss with respect to the logits.
fn ce_oracle(logits: &Tensor, targets: &Tensor, reduction: Reduction) -> (f64, Tensor) {
    let v = *logits.shape().last().unwrap();
    let n = targets.numel();
    let flat = logits.reshape(&[n, v]).unwrap();
    let t = targets.reshape(&[n]).unwrap();
    let loss = flat.cross_entropy(&t, reduction).unwrap().to_f64_vec()[0];
    let scale = if reduction == Reduction::Mean {
        1.0 / n as f64
    } else {
        1.0
    };
    let grad = flat.cross_entropy_backward(&t, scale).unwrap();
    (loss, grad.reshape(logits.shape()).unwrap())
}

/// Runs cross entropy of `logits` placed `lp` against `targets` placed `tp` and its
/// backward on `mesh_shape`, catching the logits' gradient as it arrives.
fn run_ce(
    mesh_shape: &[usize],
    logits: &Tensor,
    targets: &Tensor,
    lp: &[Placement],
    tp: &[Placement],
    reduction: Reduction,
) -> Vec<CeOut> {
    let (logits, targets, lp, tp) = (logits.clone(), targets.clone(), lp.to_vec(), tp.to_vec());
    on_mesh(mesh_shape, move |mesh| {
        let x = distribute_tensor(&logits, mesh, &lp)?;
        let t = constant(&targets, mesh, &tp)?;
        let caught = Rc::new(RefCell::new(None));
        let sink = Rc::clone(&caught);
        let x = Var::with_grad_hook("logits", x, move |g| {
            *sink.borrow_mut() = Some(g.clone());
            Ok(())
        });
        let rec = observe::record_ops(OpLog::Ops);
        let s0 = mesh.stats();
        let loss = x.cross_entropy(&t, reduction)?;
        let s1 = mesh.stats();
        backward(&loss)?;
        let s2 = mesh.stats();
        let events = rec.finish();
        let g = caught.borrow_mut().take().ok_or("no gradient reached the logits")?;
        Ok(CeOut {
            coord: mesh.coordinate().to_vec(),
            loss_placements: loss.value().placements().to_vec(),
            loss: scalar(&loss)?,
            loss_dtype: loss.value().dtype(),
            grad_placements: g.placements().to_vec(),
            grad: g.full_tensor()?,
            forward: s1 - s0,
            backward: s2 - s1,
            ops: observe::op_log_entries(&events).iter().map(|(_, r)| r.op).collect(),
        })
    })
}

/// Checks every rank's loss and gradient against the oracle, the gradient's
/// placements, no communication in backward, and that the forward ran exactly two
/// all_reduces (max, then sum of exp and target logit) of `rows` and `2 · rows`
/// elements over `tp` ranks (`rows` this rank's rows).
#[track_caller]
fn check_ce(
    what: &str,
    outs: &[CeOut],
    want: &(f64, Tensor),
    lp: &[Placement],
    loss_p: &[Placement],
    tp: usize,
    rows: usize,
) {
    let ar = |elems: usize| OpKind::AllReduce.bytes_sent(tp, elems * 8);
    for o in outs {
        let at = format!("{what} at {:?}", o.coord);
        assert!(
            (o.loss - want.0).abs() <= TOL * want.0.abs().max(1.0),
            "{at}: loss {} want {}",
            o.loss,
            want.0
        );
        let err = max_rel_err(&o.grad, &want.1).unwrap();
        assert!(err <= TOL, "{at}: gradient off by {err:e}");
        assert_eq!(o.grad_placements, lp, "{at}: gradient placements");
        assert_eq!(o.loss_placements, loss_p, "{at}: loss placements");
        assert_eq!(o.backward.total_calls(), 0, "{at}: backward ran {}", o.backward);
        assert_eq!(o.forward.total_calls(), 2, "{at}: forward ran {}", o.forward);
        assert_eq!(o.forward.calls(OpKind::AllReduce), 2, "{at}: forward ran {}", o.forward);
        assert_eq!(
            o.forward.total_bytes(),
            ar(rows) + ar(2 * rows),
            "{at}: forward ran {}",
            o.forward
        );
    }
}

#[test]
fn loss_parallel_matches_full_tensor_on_tp_meshes() {
    let (b, t) = (2, 3);
    // tp = 4 with V = 6 leaves the last rank no classes (chunks 2, 2, 2, 0).
    for (tp, vocab) in [(2, 7), (3, 10), (3, 7), (4, 10), (4, 6)] {
        let logits = uniform(&[b, t, vocab], 1 + vocab as u64).mul_scalar(4.0).unwrap();
        let targets = indices(&[b, t], vocab, 2 + tp as u64);
        for reduction in [Reduction::Mean, Reduction::Sum] {
            let want = ce_oracle(&logits, &targets, reduction);
            let (lp, rep) = ([Shard(2)], [Replicate]);
            let outs = run_ce(&[tp], &logits, &targets, &lp, &rep, reduction);
            let what = format!("tp={tp} V={vocab} {reduction:?}");
            check_ce(&what, &outs, &want, &lp, &rep, tp, b * t);
        }
    }
}

#[test]
fn loss_parallel_on_dp_by_tp_mesh() {
    // Batch Shard(0) on dp, classes Shard(2) on tp; targets given replicated (a
    // free slice) or already batch-sharded.
    let (b, t, vocab) = (4, 3, 7);
    let logits = uniform(&[b, t, vocab], 11).mul_scalar(3.0).unwrap();
    let targets = indices(&[b, t], vocab, 12);
    let lp = [Shard(0), Shard(2)];
    for tp in [[Replicate, Replicate], [Shard(0), Replicate]] {
        for reduction in [Reduction::Mean, Reduction::Sum] {
            let want = ce_oracle(&logits, &targets, reduction);
            let outs = run_ce(&[2, 2], &logits, &targets, &lp, &tp, reduction);
            let what = format!("[S(0), S(2)] targets {tp:?} {reduction:?}");
            check_ce(&what, &outs, &want, &lp, &[SUM, Replicate], 2, b / 2 * t);
        }
    }
    // Classes sharded on dp and batch on tp: the roles follow the placements.
    let want = ce_oracle(&logits, &targets, Reduction::Mean);
    let lp = [Shard(2), Shard(1)];
    let outs = run_ce(&[2, 2], &logits, &targets, &lp, &[Replicate, Shard(1)], Reduction::Mean);
    // T = 3 over 2: the ranks at tp coordinate 1 hold one time step of each batch row.
    for o in &outs {
        let rows = b * shard_size_and_offset(t, 2, o.coord[1]).0;
        check_ce(
            "[S(2), S(1)]",
            std::slice::from_ref(o),
            &want,
            &lp,
            &[Replicate, SUM],
            2,
            rows,
        );
    }
}

#[test]
fn loss_parallel_in_f32() {
    let (b, t, vocab) = (3, 2, 10);
    let logits = uniform(&[b, t, vocab], 21).cast(DType::F32).unwrap();
    let targets = indices(&[b, t], vocab, 22);
    let want = ce_oracle(&logits, &targets, Reduction::Mean);
    for tp in [3, 4] {
        let outs = run_ce(&[tp], &logits, &targets, &[Shard(2)], &[Replicate], Reduction::Mean);
        for o in &outs {
            assert!(
                (o.loss - want.0).abs() <= 1e-6,
                "tp={tp}: loss {} want {}",
                o.loss,
                want.0
            );
            assert_eq!(o.grad.dtype(), DType::F32);
            let err = max_rel_err(&o.grad, &want.1).unwrap();
            assert!(err <= 1e-6, "tp={tp}: gradient off by {err:e}");
            // The statistics travel in f32: 4 bytes per element.
            let ar = |e: usize| OpKind::AllReduce.bytes_sent(tp, e * 4);
            assert_eq!(
                o.forward.total_bytes(),
                ar(b * t) + ar(2 * b * t),
                "tp={tp}: {}",
                o.forward
            );
            assert_eq!(o.backward.total_calls(), 0, "tp={tp}: backward ran {}", o.backward);
        }
    }
}

/// What one rank saw of a row-parallel linear.
struct LinearOut {
    coord: Vec<usize>,
    out_placements: Vec<Placement>,
    /// Collectives of the linear itself.
    linear: CommCounts,
    /// Collectives of reducing its output.
    reduce: CommCounts,
    /// The reduced output.
    full: Tensor,
    /// Full gradients of x, W, b and their placements.
    grads: Vec<(Tensor, Vec<Placement>)>,
}

/// `y = x · Wᵀ + b` with `x` `[B, T, in]` `Shard(2)`, `W` `[out, in]` `Shard(1)` and
/// `b` replicated on a 1-D mesh of `tp`, the output redistributed to `target`, and
/// the gradients of `loss = Σ y · r` (`r` placed like the reduced output).
fn run_linear(tp: usize, target: Placement, x: &Tensor, w: &Tensor, b: &Tensor, r: &Tensor) -> Vec<LinearOut> {
    let (x, w, b, r) = (x.clone(), w.clone(), b.clone(), r.clone());
    on_mesh(&[tp], move |mesh| {
        let px = param("x", &x, mesh, &[Shard(2)])?;
        let pw = param("w", &w, mesh, &[Shard(1)])?;
        let pb = param("b", &b, mesh, &[Replicate])?;
        let s0 = mesh.stats();
        let y = px.var()?.linear(&pw.var()?, Some(&pb.var()?))?;
        let s1 = mesh.stats();
        let out_placements = y.value().placements().to_vec();
        let z = y.redistribute(&[target])?;
        let s2 = mesh.stats();
        let loss = weighted_sum(&z, &constant(&r, mesh, &[target])?)?;
        backward(&loss)?;
        let mut grads = Vec::new();
        for p in [&px, &pw, &pb] {
            let g = p.grad().ok_or("missing gradient")?;
            grads.push((full_grad(p)?, g.placements().to_vec()));
        }
        Ok(LinearOut {
            coord: mesh.coordinate().to_vec(),
            out_placements,
            linear: s1 - s0,
            reduce: s2 - s1,
            full: z.value().full_tensor()?,
            grads,
        })
    })
}

#[test]
fn row_parallel_linear_defers_the_bias() {
    let (bt, t, fin, fout) = (2, 3, 7, 5);
    let x = uniform(&[bt, t, fin], 31);
    let w = uniform(&[fout, fin], 32);
    let b = uniform(&[fout], 33);
    let r = uniform(&[bt, t, fout], 34);
    let want = x.matmul(&w.transpose(0, 1).unwrap()).unwrap().add(&b).unwrap();
    let n = bt * t;
    let want_gx = r.matmul(&w).unwrap();
    let want_gw = r
        .reshape(&[n, fout])
        .unwrap()
        .transpose(0, 1)
        .unwrap()
        .matmul(&x.reshape(&[n, fin]).unwrap())
        .unwrap();
    let want_gb = r.sum(&[0, 1], false).unwrap();
    let wants = [(&want_gx, Shard(2)), (&want_gw, Shard(1)), (&want_gb, Replicate)];
    for tp in [2, 3] {
        for (target, kind) in [(Replicate, OpKind::AllReduce), (Shard(1), OpKind::ReduceScatter)] {
            for o in run_linear(tp, target, &x, &w, &b, &r) {
                let at = format!("tp={tp} -> {target:?} at {:?}", o.coord);
                assert_eq!(o.out_placements, [SUM], "{at}: the output stays partial");
                assert_eq!(o.linear.total_calls(), 0, "{at}: the linear ran {}", o.linear);
                assert_eq!(o.reduce.total_calls(), 1, "{at}: reducing ran {}", o.reduce);
                assert_eq!(o.reduce.calls(kind), 1, "{at}: reducing ran {}", o.reduce);
                // The bias added once, not tp times.
                let err = max_rel_err(&o.full, &want).unwrap();
                assert!(err <= TOL, "{at}: output off by {err:e}");
                for ((got, gp), (want, wp)) in o.grads.iter().zip(wants) {
                    let err = max_rel_err(got, want).unwrap();
                    assert!(err <= TOL, "{at}: gradient {gp:?} off by {err:e}");
                    assert_eq!(gp, &[wp], "{at}");
                }
            }
        }
    }
    // Replicate → Partial(sum) is the planner's free local partition.
    let plans = on_mesh(&[3], |mesh| {
        let b = distribute_tensor(&uniform(&[5], 35), mesh, &[Replicate])?;
        let partial = b.redistribute(&[SUM])?;
        let plan = b.redistribute_plan(&[SUM])?;
        Ok((plan.collectives(), plan.bytes(), partial.to_local().to_f64_vec()))
    });
    for (coord, (collectives, bytes, local)) in plans.into_iter().enumerate() {
        assert_eq!((collectives, bytes), (0, 0));
        let kept = local.iter().any(|&v| v != 0.0);
        assert_eq!(kept, coord == 0, "the value is kept on coordinate 0 only: {local:?}");
    }
}

/// What one rank saw of an embedding's backward.
struct EmbOut {
    coord: Vec<usize>,
    grad: Tensor,
    placements: Vec<Placement>,
    local_shape: Vec<usize>,
    backward: CommCounts,
    /// Peak bytes allocated during backward above what was alive before it.
    peak: usize,
}

/// `loss = Σ embedding(table, idx) · r` with the table placed `tp` on `mesh_shape`
/// and the indices and `r` replicated; the table's gradient as it lands. With
/// `gather`, the embedding's output is made replicated first (its gradient then
/// arrives in the output's placements), else used as it is (its gradient arrives
/// replicated).
fn run_embedding(
    mesh_shape: &[usize],
    table: &Tensor,
    idx: &Tensor,
    r: &Tensor,
    tp: &[Placement],
    gather: bool,
) -> Vec<EmbOut> {
    let (table, idx, r, tp) = (table.clone(), idx.clone(), r.clone(), tp.to_vec());
    on_mesh(mesh_shape, move |mesh| {
        let rep = replicate(mesh.ndim());
        let p = param("table", &table, mesh, &tp)?;
        let i = constant(&idx, mesh, &rep)?;
        let mut y = p.var()?.embedding(&i)?;
        if gather {
            y = y.redistribute(&rep)?;
        }
        let loss = weighted_sum(&y, &constant(&r, mesh, &rep)?)?;
        memory::reset_peak();
        let before = memory::stats().current_bytes;
        let s0 = mesh.stats();
        backward(&loss)?;
        let s1 = mesh.stats();
        let peak = memory::stats().peak_bytes - before;
        let g = p.grad().ok_or("the table has no gradient")?;
        Ok(EmbOut {
            coord: mesh.coordinate().to_vec(),
            placements: g.placements().to_vec(),
            local_shape: g.to_local().shape().to_vec(),
            grad: g.full_tensor()?,
            backward: s1 - s0,
            peak,
        })
    })
}

/// The gradient of `Σ embedding(table, idx) · r` with respect to a `[vocab, d]` table.
fn embedding_grad_oracle(vocab: usize, d: usize, idx: &Tensor, r: &Tensor) -> Tensor {
    let mut g = vec![0.0; vocab * d];
    let rows = r.to_f64_vec();
    for (k, &i) in idx.to_vec::<i64>().unwrap().iter().enumerate() {
        let i = i as usize;
        for j in 0..d {
            g[i * d + j] += rows[k * d + j];
        }
    }
    Tensor::from_vec(g, &[vocab, d]).unwrap()
}

#[test]
fn embedding_gradient_keeps_the_table_sharding() {
    let (b, t) = (2, 3);
    // Uneven rows and columns; tp = 4 with V = 6 or d = 5 leaves a rank an empty shard.
    for (tp, vocab, d) in [(2, 7, 5), (3, 10, 5), (4, 6, 5), (4, 10, 5)] {
        let table = uniform(&[vocab, d], 41);
        let idx = indices(&[b, t], vocab, 42 + tp as u64);
        let r = uniform(&[b, t, d], 43);
        let want = embedding_grad_oracle(vocab, d, &idx, &r);
        for ((dim, size), gather) in [(0, vocab), (1, d)].into_iter().flat_map(|s| [(s, true), (s, false)]) {
            for o in run_embedding(&[tp], &table, &idx, &r, &[Shard(dim)], gather) {
                let at = format!("tp={tp} V={vocab} d={d} Shard({dim}) gather {gather} at {:?}", o.coord);
                let err = max_rel_err(&o.grad, &want).unwrap();
                assert!(err <= TOL, "{at}: gradient off by {err:e}");
                assert_eq!(o.placements, [Shard(dim)], "{at}");
                let mut local = vec![vocab, d];
                local[dim] = shard_size_and_offset(size, tp, o.coord[0]).0;
                assert_eq!(o.local_shape, local, "{at}");
                assert_eq!(o.backward.total_calls(), 0, "{at}: backward ran {}", o.backward);
            }
        }
    }
    // Rows on dp, columns on tp.
    let (vocab, d) = (7, 5);
    let table = uniform(&[vocab, d], 44);
    let idx = indices(&[b, t], vocab, 45);
    let r = uniform(&[b, t, d], 46);
    let want = embedding_grad_oracle(vocab, d, &idx, &r);
    for o in run_embedding(&[2, 2], &table, &idx, &r, &[Shard(0), Shard(1)], true) {
        let at = format!("[S(0), S(1)] at {:?}", o.coord);
        assert!(max_rel_err(&o.grad, &want).unwrap() <= TOL, "{at}");
        assert_eq!(o.placements, [Shard(0), Shard(1)], "{at}");
        let local = vec![
            shard_size_and_offset(vocab, 2, o.coord[0]).0,
            shard_size_and_offset(d, 2, o.coord[1]).0,
        ];
        assert_eq!(o.local_shape, local, "{at}");
        assert_eq!(o.backward.total_calls(), 0, "{at}: backward ran {}", o.backward);
    }
}

#[test]
fn row_sharded_embedding_gradient_builds_no_full_table() {
    let (b, t, vocab, d) = (2, 3, 1000, 8);
    let full_bytes = vocab * d * 8;
    let table = uniform(&[vocab, d], 51);
    let idx = indices(&[b, t], vocab, 52);
    let r = uniform(&[b, t, d], 53);
    let want = embedding_grad_oracle(vocab, d, &idx, &r);
    for tp in [2, 4] {
        for o in run_embedding(&[tp], &table, &idx, &r, &[Shard(0)], true) {
            let at = format!("tp={tp} at {:?}", o.coord);
            assert!(max_rel_err(&o.grad, &want).unwrap() <= TOL, "{at}");
            let shard_bytes = shard_size_and_offset(vocab, tp, o.coord[0]).0 * d * 8;
            // The shard and a few [B, T, d] gradients; a full table would not fit.
            assert!(
                o.peak >= shard_bytes,
                "{at}: peak {} below the shard's {shard_bytes}",
                o.peak
            );
            assert!(
                o.peak < shard_bytes + full_bytes / 4,
                "{at}: backward peaked at {} bytes, the full table is {full_bytes}",
                o.peak
            );
        }
    }
}

/// `bf16` and `f16` logits: the loss is that of the logits cast to `f32` and
/// the logits' gradient that loss's gradient cast back, bit for bit, on one
/// rank and batch-sharded (the loss of two partial sums within 1e-6); where
/// the class dim is whole no `cast` op runs in forward or backward (the upcast
/// happens as the loss reads the logits, the rounding as it writes the
/// gradient); class-sharded logits are cast and take the loss-parallel path.
#[test]
fn half_logits_lose_in_f32_without_a_cast() {
    let (b, t, vocab) = (4, 3, 10);
    for dtype in [DType::BF16, DType::F16] {
        let logits = uniform(&[b, t, vocab], 31)
            .mul_scalar(4.0)
            .unwrap()
            .cast(dtype)
            .unwrap();
        let targets = indices(&[b, t], vocab, 32);
        let n = b * t;
        let up = logits.cast(DType::F32).unwrap().reshape(&[n, vocab]).unwrap();
        let flat_t = targets.reshape(&[n]).unwrap();
        let want_loss = up.cross_entropy(&flat_t, Reduction::Mean).unwrap().to_f64_vec()[0];
        let want_grad = up
            .cross_entropy_backward(&flat_t, 1.0 / n as f64)
            .unwrap()
            .cast(dtype)
            .unwrap()
            .reshape(&[b, t, vocab])
            .unwrap();
        let bits = |t: &Tensor| -> Vec<u64> { t.to_f64_vec().into_iter().map(f64::to_bits).collect() };
        for (mesh, lp, tp) in [
            (&[1][..], [Replicate], [Replicate]),
            (&[2][..], [Shard(0)], [Shard(0)]),
            (&[2][..], [Shard(2)], [Replicate]),
        ] {
            let outs = run_ce(mesh, &logits, &targets, &lp, &tp, Reduction::Mean);
            for CeOut {
                loss_dtype,
                loss,
                grad,
                ops,
                ..
            } in outs
            {
                let what = format!("{dtype} logits placed {lp:?} on {mesh:?}");
                assert_eq!(loss_dtype, DType::F32, "{what}: loss dtype");
                assert_eq!(grad.dtype(), dtype, "{what}: gradient dtype");
                if lp[0] == Shard(2) {
                    assert!(
                        ops.contains(&"cast"),
                        "{what}: class-sharded logits are cast first: {ops:?}"
                    );
                    assert!(
                        (loss - want_loss).abs() <= 1e-6 * want_loss.abs(),
                        "{what}: loss {loss} want {want_loss}"
                    );
                    let err = max_rel_err(&grad, &want_grad).unwrap();
                    assert!(err <= 1e-2, "{what}: gradient off by {err:e}");
                    continue;
                }
                assert!(!ops.contains(&"cast"), "{what}: a cast ran: {ops:?}");
                assert!(ops.contains(&"cross_entropy"), "{what}: {ops:?}");
                if mesh == [1] {
                    assert_eq!(loss.to_bits(), want_loss.to_bits(), "{what}: loss");
                } else {
                    assert!(
                        (loss - want_loss).abs() <= 1e-6 * want_loss.abs(),
                        "{what}: loss {loss} want {want_loss}"
                    );
                }
                assert_eq!(bits(&grad), bits(&want_grad), "{what}: gradient");
            }
        }
    }
}
