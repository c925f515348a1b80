//! Errors: every rank gets a `Result` error (never a panic or hang) whose message
//! names what is wrong.

use tessera::ReduceOp;
use tessera::dtensor::Placement::{Partial, Replicate as R, Shard as S};
use tessera::dtensor::{DTensor, DType, Layout, Result, Tensor, distribute_tensor};
use tessera::{BoxError, DeviceMesh};

use crate::harness::on_mesh;

/// Runs `f` on every rank of a mesh; each rank must get an error containing every
/// needle (`{coord}` in a needle stands for the rank's coordinate).
fn expect_err<T>(mesh: &[usize], needles: &[&str], f: impl Fn(&DeviceMesh) -> Result<T> + Send + Sync + 'static) {
    let outs = on_mesh(mesh, move |m| -> Result<(Vec<usize>, String), BoxError> {
        match f(m) {
            Ok(_) => Err("expected an error".into()),
            Err(e) => Ok((m.coordinate().to_vec(), e.to_string())),
        }
    })
    .unwrap();
    for (coord, msg) in outs {
        for needle in needles {
            let needle = needle.replace("{coord}", &format!("{coord:?}"));
            assert!(msg.contains(&needle), "rank {coord:?}: {msg:?} lacks {needle:?}");
        }
    }
}

fn full(shape: &[usize], dtype: DType) -> tessera::tensor::Result<Tensor> {
    Tensor::arange(shape.iter().product(), dtype)?.reshape(shape)
}

#[test]
fn placements_length_differs_from_mesh_dims() {
    let needle = "(Shard(0)) has 1 placements but the mesh has 2 dims";
    expect_err(&[2, 2], &[needle], |m| {
        distribute_tensor(&full(&[4, 4], DType::F64)?, m, &[S(0)])
    });
    expect_err(
        &[2, 2],
        &["(Replicate, Replicate, Replicate) has 3 placements but the mesh has 2 dims"],
        |m| distribute_tensor(&full(&[4, 4], DType::F64)?, m, &[R, R])?.redistribute(&[R, R, R]),
    );
    expect_err(
        &[2],
        &["(Shard(0), Replicate) has 2 placements but the mesh has 1 dims"],
        |m| DTensor::from_local(full(&[2, 4], DType::F64)?, m, &[S(0), R], &[4, 4]),
    );
}

#[test]
fn shard_dim_past_tensor_rank() {
    expect_err(
        &[2, 2],
        &["placement 1 of (Replicate, Shard(2)) is Shard(2) but the tensor has rank 2"],
        |m| distribute_tensor(&full(&[4, 4], DType::F64)?, m, &[R, S(2)]),
    );
    expect_err(
        &[2],
        &["placement 0 of (Shard(1)) is Shard(1) but the tensor has rank 1"],
        |m| distribute_tensor(&full(&[4], DType::F64)?, m, &[R])?.redistribute(&[S(1)]),
    );
}

#[test]
fn from_local_shape_inconsistent_with_global() {
    // [4, 4] over 2 ranks by rows gives each [2, 4]; every rank passes [3, 4].
    expect_err(
        &[2],
        &[
            "DTensor::from_local",
            "mesh coordinate {coord}",
            "shape [3, 4]",
            "f64[4,4] (Shard(0))",
            "gives it [2, 4]",
        ],
        |m| DTensor::from_local(full(&[3, 4], DType::F64)?, m, &[S(0)], &[4, 4]),
    );
    // Uneven: [5] over 2×2 with [S(0), S(0)] is 2, 1, 1, 1; every rank passes [2].
    let outs = on_mesh(&[2, 2], |m| {
        Ok(DTensor::from_local(full(&[2], DType::F64)?, m, &[S(0), S(0)], &[5])
            .map(|_| ())
            .map_err(|e| e.to_string()))
    })
    .unwrap();
    assert!(outs[0].is_ok(), "{:?}", outs[0]);
    for (rank, coord) in [(1, "[0, 1]"), (2, "[1, 0]"), (3, "[1, 1]")] {
        let msg = outs[rank].as_ref().unwrap_err();
        assert!(
            msg.contains(&format!("mesh coordinate {coord}")) && msg.contains("gives it [1]"),
            "{msg}"
        );
    }
}

#[test]
fn from_local_dtype_differs_from_layout() {
    expect_err(&[2], &["DTensor::from_local", "expected dtype f64, got f32"], |m| {
        let layout = Layout::new(m.shape(), &[S(0)], &[4, 4], DType::F64)?;
        DTensor::from_local_with_layout(full(&[2, 4], DType::F32)?, m, layout)
    });
}

#[test]
fn partial_avg_on_i64() {
    let needles = [
        "Partial(avg)",
        "reduction avg is not defined for i64",
        "reduce with Sum and divide explicitly",
    ];
    let avg = Partial(ReduceOp::Avg);
    expect_err(&[2], &needles, move |m| {
        distribute_tensor(&full(&[4], DType::I64)?, m, &[avg])
    });
    expect_err(&[2], &needles, move |m| {
        DTensor::from_local(full(&[4], DType::I64)?, m, &[avg], &[4])
    });
    expect_err(&[2, 2], &needles, move |m| {
        distribute_tensor(&full(&[4], DType::I64)?, m, &[S(0), R])?.redistribute(&[S(0), avg])
    });
}

#[test]
fn partial_on_raw_bytes_and_non_commuting_mix() {
    expect_err(&[2], &["raw bytes can be gathered or exchanged but not reduced"], |m| {
        distribute_tensor(&full(&[4], DType::U8)?, m, &[Partial(ReduceOp::Sum)])
    });
    expect_err(
        &[2, 2],
        &["(Partial(sum), Partial(max)) mixes pending reductions that do not commute"],
        |m| {
            distribute_tensor(
                &full(&[4], DType::F64)?,
                m,
                &[Partial(ReduceOp::Sum), Partial(ReduceOp::Max)],
            )
        },
    );
}

#[test]
fn shard_to_partial_is_rejected() {
    expect_err(
        &[2],
        &["redistribute", "mesh dim 0: Shard(0) -> Partial(sum) is not defined"],
        |m| distribute_tensor(&full(&[4, 2], DType::F64)?, m, &[S(0)])?.redistribute(&[Partial(ReduceOp::Sum)]),
    );
    expect_err(&[2, 2], &["mesh dim 1: Shard(1) -> Partial(max) is not defined"], |m| {
        let x = distribute_tensor(&full(&[4, 2], DType::F64)?, m, &[R, S(1)])?;
        x.redistribute_plan(&[R, Partial(ReduceOp::Max)])
    });
}

#[test]
fn partial_to_other_partial_is_rejected() {
    expect_err(
        &[2],
        &["mesh dim 0: Partial(sum) -> Partial(max) would change a pending reduction"],
        |m| {
            let x = distribute_tensor(&full(&[4, 2], DType::F64)?, m, &[Partial(ReduceOp::Sum)])?;
            x.redistribute(&[Partial(ReduceOp::Max)])
        },
    );
    expect_err(
        &[2, 2],
        &["mesh dim 1: Partial(avg) -> Partial(sum) would change a pending reduction"],
        |m| {
            let x = distribute_tensor(&full(&[4, 2], DType::F64)?, m, &[R, Partial(ReduceOp::Avg)])?;
            x.redistribute(&[S(0), Partial(ReduceOp::Sum)])
        },
    );
}
