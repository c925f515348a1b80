//! The fused `scaled_dot_product_attention` against the chain of ops it replaces:
//! the same values and gradients bit for bit, with batch and head shards, in f32
//! and bf16; one op on the tape; errors that name the shapes.

use tessera::autograd::{Param, Result as AResult, Var, backward, clear_tape, recorded_ops};
use tessera::dtensor::{DType, Placement, Placement::*, Tensor};

use crate::harness::{R, constant, on_mesh, param, uniform, weighted_sum};

/// `q`, `k`, `v` `[2, 4, 6, 3]` (batch, heads, tokens, head size) as parameters
/// placed as `at`, in `dtype`.
fn qkv(mesh: &tessera::DeviceMesh, dtype: DType, at: &[Placement]) -> R<[Param; 3]> {
    let make = |name: &str, seed| -> R<Param> { param(name, &uniform(&[2, 4, 6, 3], seed).cast(dtype)?, mesh, at) };
    Ok([make("q", 1)?, make("k", 2)?, make("v", 3)?])
}

/// What the chain computes: `softmax(causal_mask(q·kᵀ·scale))·v`.
fn chain(q: &Var, k: &Var, v: &Var, causal: bool, scale: f64) -> AResult<Var> {
    let scores = q.matmul(&k.transpose(2, 3)?)?.mul_scalar(scale)?;
    let scores = if causal {
        scores.causal_mask(f64::NEG_INFINITY)?
    } else {
        scores
    };
    scores.softmax(3)?.matmul(v)
}

/// Bits of the output and of the three gradients (full tensors), for the fused
/// op or the chain.
fn run(mesh_shape: &[usize], at: &[Placement], dtype: DType, causal: bool, fused: bool) -> Vec<Vec<u64>> {
    let at = at.to_vec();
    on_mesh(mesh_shape, move |mesh| {
        let [q, k, v] = qkv(mesh, dtype, &at)?;
        let (qv, kv, vv) = (q.var()?, k.var()?, v.var()?);
        let out = if fused {
            qv.scaled_dot_product_attention(&kv, &vv, causal, None)?
        } else {
            chain(&qv, &kv, &vv, causal, 1.0 / 3f64.sqrt())?
        };
        let r = constant(&uniform(&[2, 4, 6, 3], 4).cast(dtype)?, mesh, &at)?;
        backward(&weighted_sum(&out, &r)?)?;
        let bits = |t: Tensor| t.to_f64_vec().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        let mut seen = vec![bits(out.value().full_tensor()?)];
        for p in [&q, &k, &v] {
            seen.push(bits(p.grad().ok_or("no gradient")?.full_tensor()?));
        }
        Ok(seen)
    })
    .remove(0)
}

#[test]
fn fused_attention_equals_the_chain_bit_for_bit() {
    let layouts: [(&[usize], &[Placement]); 4] = [
        (&[1], &[Replicate]),
        (&[2], &[Shard(1)]), // heads, as tensor parallelism shards them
        (&[2], &[Shard(0)]), // batch, as FSDP's data parallelism does
        (&[2, 2], &[Shard(0), Shard(1)]),
    ];
    for dtype in [DType::F32, DType::BF16] {
        for (mesh, at) in layouts {
            for causal in [true, false] {
                let what = format!("{dtype} mesh {mesh:?} {at:?} causal {causal}");
                let (got, want) = (run(mesh, at, dtype, causal, true), run(mesh, at, dtype, causal, false));
                for (i, name) in ["output", "dq", "dk", "dv"].iter().enumerate() {
                    assert_eq!(got[i], want[i], "{name}, {what}");
                }
            }
        }
    }
}

#[test]
fn fused_attention_is_one_op_on_the_tape() {
    let counts = on_mesh(&[1], |mesh| {
        let [q, k, v] = qkv(mesh, DType::F32, &[Replicate])?;
        clear_tape();
        q.var()?
            .scaled_dot_product_attention(&k.var()?, &v.var()?, true, None)?;
        let fused = recorded_ops();
        clear_tape();
        chain(&q.var()?, &k.var()?, &v.var()?, true, 0.5)?;
        let chained = recorded_ops();
        clear_tape();
        Ok((fused, chained))
    });
    // The chain: transpose, matmul, mul_scalar, causal_mask, softmax, matmul.
    assert_eq!(counts[0], (1, 6));
}

#[test]
fn fused_attention_errors_name_the_shapes() {
    let msgs = on_mesh(&[1], |mesh| {
        let var = |shape: &[usize]| constant(&uniform(shape, 1).cast(DType::F32)?, mesh, &[Replicate]);
        let q = var(&[2, 5, 3])?.detach();
        let err = |k: &[usize], v: &[usize], scale| -> R<String> {
            let (k, v) = (var(k)?, var(v)?);
            Ok(q.scaled_dot_product_attention(&k, &v, true, scale)
                .err()
                .ok_or("no error")?
                .to_string())
        };
        Ok(vec![
            err(&[2, 5, 4], &[2, 5, 3], None)?,
            err(&[2, 7, 3], &[2, 6, 3], None)?,
            err(&[1, 5, 3], &[1, 5, 3], None)?,
            err(&[5, 3], &[5, 3], None)?,
            err(&[2, 5, 3], &[2, 5, 3], Some(f64::INFINITY))?,
            err(&[2, 5, 3], &[2, 5, 3], Some(f64::NAN))?,
        ])
    });
    let want = [
        "q [2, 5, 3], k [2, 5, 4], v [2, 5, 3]: q's head size 3 differs from k's 4",
        "q [2, 5, 3], k [2, 7, 3], v [2, 6, 3]: k has 7 keys but v has 6 values",
        "q [2, 5, 3], k [1, 5, 3], v [1, 5, 3]: their batch dims must be equal",
        "q [2, 5, 3], k [5, 3], v [5, 3]: q, k and v need one rank ≥ 2",
        "the scale must be finite, got inf",
        "the scale must be finite, got NaN",
    ];
    for (got, want) in msgs[0].iter().zip(want) {
        assert!(
            got.contains("scaled_dot_product_attention") && got.contains(want),
            "{got}"
        );
    }
}
