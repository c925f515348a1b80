//! Errors: every rank gets a `Result` error (never a panic or hang) whose message
//! names what is wrong.

use tessera::dtensor::Placement::{Replicate as R, Shard as S};
use tessera::dtensor::{DType, Result, Tensor, distribute_tensor};
use tessera::tensor::ops::Reduction;
use tessera::{BoxError, DeviceMesh};

use crate::harness::on_mesh;

/// Runs `f` on every rank of a mesh; each rank must get an error containing every needle.
#[track_caller]
fn expect_err<T>(mesh: &[usize], needles: &[&str], f: impl Fn(&DeviceMesh) -> Result<T> + Send + Sync + 'static) {
    let outs = on_mesh(mesh, move |m| -> std::result::Result<(Vec<usize>, String), BoxError> {
        match f(m) {
            Ok(_) => Err("expected an error".into()),
            Err(e) => Ok((m.coordinate().to_vec(), e.to_string())),
        }
    })
    .unwrap();
    for (coord, msg) in outs {
        for needle in needles {
            assert!(msg.contains(needle), "rank {coord:?}: {msg:?} lacks {needle:?}");
        }
    }
}

fn randn(shape: &[usize]) -> tessera::tensor::Result<Tensor> {
    Tensor::randn(shape, DType::F64, 3)
}

fn idx(v: &[i64], shape: &[usize]) -> tessera::tensor::Result<Tensor> {
    Tensor::from_vec(v.to_vec(), shape)
}

#[test]
fn operands_on_different_meshes() {
    // The two 1-D meshes along the dims of a 2×2 mesh.
    expect_err(&[2, 2], &["add", "different meshes"], |m| {
        let a = distribute_tensor(&randn(&[4, 3])?, &m.dim(0)?, &[S(0)])?;
        let b = distribute_tensor(&randn(&[4, 3])?, &m.dim(1)?, &[S(0)])?;
        a.add(&b)
    });
    // Two meshes of the same shape over different communicators.
    expect_err(&[4], &["matmul", "different meshes"], |m| {
        let other = DeviceMesh::new(m.comm().split(0, m.comm().rank() as u32)?, &[4])?;
        let a = distribute_tensor(&randn(&[4, 3])?, m, &[S(0)])?;
        let b = distribute_tensor(&randn(&[3, 2])?, &other, &[R])?;
        a.matmul(&b)
    });
    expect_err(&[2, 2], &["embedding", "different meshes"], |m| {
        let table = distribute_tensor(&randn(&[7, 4])?, &m.dim(0)?, &[R])?;
        let i = distribute_tensor(&idx(&[1, 2], &[2])?, &m.dim(1)?, &[R])?;
        table.embedding(&i)
    });
}

#[test]
fn matmul_inner_dims_differ() {
    expect_err(&[2], &["matmul", "[3, 5]", "[4, 2]", "inner dims differ"], |m| {
        let a = distribute_tensor(&randn(&[3, 5])?, m, &[S(0)])?;
        let b = distribute_tensor(&randn(&[4, 2])?, m, &[R])?;
        a.matmul(&b)
    });
    expect_err(&[2, 2], &["matmul", "[2, 3, 5]", "[2, 6, 4]"], |m| {
        let a = distribute_tensor(&randn(&[2, 3, 5])?, m, &[S(0), R])?;
        let b = distribute_tensor(&randn(&[2, 6, 4])?, m, &[R, S(2)])?;
        a.matmul(&b)
    });
}

#[test]
fn cross_entropy_target_shape() {
    expect_err(&[2], &["cross_entropy", "[4, 5]", "[5]"], |m| {
        let logits = distribute_tensor(&randn(&[4, 5])?, m, &[S(0)])?;
        let t = distribute_tensor(&idx(&[0, 1, 2, 3, 4], &[5])?, m, &[S(0)])?;
        logits.cross_entropy(&t, Reduction::Mean)
    });
    expect_err(&[2, 2], &["cross_entropy", "[2, 3, 5]", "[3, 2]"], |m| {
        let logits = distribute_tensor(&randn(&[2, 3, 5])?, m, &[S(0), R])?;
        let t = distribute_tensor(&idx(&[0; 6], &[3, 2])?, m, &[R, R])?;
        logits.cross_entropy(&t, Reduction::Sum)
    });
    // Float targets.
    expect_err(&[2], &["cross_entropy", "i64"], |m| {
        let logits = distribute_tensor(&randn(&[4, 5])?, m, &[R])?;
        let t = distribute_tensor(&randn(&[4])?, m, &[R])?;
        logits.cross_entropy(&t, Reduction::Mean)
    });
}

#[test]
fn cross_entropy_with_grad_needs_the_class_dim_whole() {
    expect_err(
        &[2],
        &["cross_entropy", "Shard(1)", "cross_entropy_class_parallel"],
        |m| {
            let logits = distribute_tensor(&randn(&[4, 6])?, m, &[S(1)])?;
            let t = distribute_tensor(&idx(&[0, 1, 2, 3], &[4])?, m, &[R])?;
            Ok(logits.cross_entropy_with_grad(&t, Reduction::Mean)?.1)
        },
    );
}

#[test]
fn embedding_index_out_of_range() {
    let bad = [0, 3, 7, 1, 2, 6];
    // Replicated table and indices: every rank looks up the bad index.
    expect_err(&[2], &["embedding", "index 7", "7 rows"], move |m| {
        let table = distribute_tensor(&randn(&[7, 4])?, m, &[R])?;
        let i = distribute_tensor(&idx(&bad, &[2, 3])?, m, &[R])?;
        table.embedding(&i)
    });
    // Row-sharded table: every rank checks against the whole vocabulary.
    for p in [[S(0), R], [S(0), S(0)]] {
        expect_err(&[2, 2], &["embedding", "index 7", "7 rows"], move |m| {
            let table = distribute_tensor(&randn(&[7, 4])?, m, &p)?;
            let i = distribute_tensor(&idx(&bad, &[2, 3])?, m, &[R, R])?;
            table.embedding(&i)
        });
    }
    expect_err(&[4], &["embedding", "index -1"], |m| {
        let table = distribute_tensor(&randn(&[7, 4])?, m, &[S(0)])?;
        let i = distribute_tensor(&idx(&[2, -1, 3], &[3])?, m, &[R])?;
        table.embedding(&i)
    });
}

/// With batch-sharded indices only the rank holding the bad index can see it: the
/// launch fails (no hang, no silent result) naming the index.
#[test]
fn embedding_index_out_of_range_on_one_shard() {
    let err = on_mesh(&[4], |m| -> std::result::Result<Tensor, BoxError> {
        let table = distribute_tensor(&randn(&[7, 4])?, m, &[R])?;
        let i = distribute_tensor(&idx(&[0, 1, 2, 3, 4, 5, 6, 9], &[8])?, m, &[S(0)])?;
        Ok(table.embedding(&i)?.full_tensor()?)
    })
    .unwrap_err();
    assert!(err.contains("index 9"), "{err}");
}
