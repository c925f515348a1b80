//! DeviceMesh construction, coordinates, slicing and flattening.

use tessera::{CommunicatorExt, DeviceMesh, launch};

#[test]
fn coordinates_are_row_major() {
    let coords = launch(8, |ctx| {
        let mesh = DeviceMesh::with_names(ctx.into_comm(), &[2, 2, 2], &["pp", "dp", "tp"])?;
        assert_eq!(mesh.ndim(), 3);
        assert_eq!(mesh.size(), 8);
        assert_eq!(mesh.dim_size("dp")?, 2);
        Ok(mesh.coordinate().to_vec())
    })
    .unwrap();
    for (r, c) in coords.iter().enumerate() {
        assert_eq!(c, &vec![r / 4, (r / 2) % 2, r % 2]);
    }
}

#[test]
fn construction_errors() {
    macro_rules! bad {
        ($n:expr, $build:expr, $needle:expr) => {
            let errs = launch($n, |ctx| {
                let comm = ctx.into_comm();
                #[allow(clippy::redundant_closure_call)]
                let res: tessera::mesh::Result<DeviceMesh> = ($build)(comm);
                Ok(res.expect_err("must fail").to_string())
            })
            .unwrap();
            assert!(errs.iter().all(|e| e.contains($needle)), "{errs:?}");
        };
    }
    bad!(
        4,
        |c| DeviceMesh::new(c, &[2, 3]),
        "holds 6 ranks but the communicator has 4"
    );
    bad!(4, |c| DeviceMesh::new(c, &[4, 0]), "each of size ≥ 1");
    bad!(4, |c| DeviceMesh::new(c, &[]), "at least one dim");
    bad!(
        4,
        |c| DeviceMesh::with_names(c, &[2, 2], &["dp", "dp"]),
        "\"dp\" is used twice"
    );
    bad!(4, |c| DeviceMesh::with_names(c, &[2, 2], &["dp"]), "one name per dim");
}

#[test]
fn lookup_errors() {
    launch(4, |ctx| {
        let mesh = DeviceMesh::with_names(ctx.into_comm(), &[2, 2], &["dp", "tp"])?;
        let e = mesh.dim("pp").unwrap_err().to_string();
        assert!(
            e.contains("no mesh dim named \"pp\"") && e.contains("[\"dp\", \"tp\"]"),
            "{e}"
        );
        let e = mesh.dim(2).unwrap_err().to_string();
        assert!(e.contains("mesh dim 2 is out of range for a 2-D mesh"), "{e}");
        let e = mesh.flatten(&["tp", "dp"], "x").unwrap_err().to_string();
        assert!(e.contains("adjacent"), "{e}");
        Ok(())
    })
    .unwrap();
    launch(2, |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), &[2])?;
        let e = mesh.dim("dp").unwrap_err().to_string();
        assert!(e.contains("no dim names"), "{e}");
        Ok(())
    })
    .unwrap();
}

#[test]
fn slicing_gives_one_d_meshes() {
    launch(4, |ctx| {
        let r = ctx.rank();
        let mesh = DeviceMesh::with_names(ctx.into_comm(), &[2, 2], &["dp", "tp"])?;
        let tp = mesh.dim("tp")?;
        assert_eq!(tp.shape(), &[2]);
        assert_eq!(tp.names(), &["tp".to_string()]);
        assert_eq!(tp.coordinate(), &[r % 2]);
        assert_eq!(tp.ranks(), &[r - r % 2, r - r % 2 + 1]);
        let dp = mesh.dim(0)?;
        assert_eq!(dp.ranks(), &[r % 2, r % 2 + 2]);
        // The slice's communicator is the dim's.
        let got = dp.comm().all_gather_vec(&[r as i64])?;
        assert_eq!(got, vec![(r % 2) as i64, (r % 2 + 2) as i64]);
        Ok(())
    })
    .unwrap();
}

#[test]
fn slicing_several_dims_gives_a_sub_mesh() {
    launch(8, |ctx| {
        let r = ctx.rank();
        let mesh = DeviceMesh::with_names(ctx.into_comm(), &[2, 2, 2], &["dp_replicate", "dp_shard", "tp"])?;
        let dp = mesh.slice(&["dp_replicate", "dp_shard"])?;
        assert_eq!(dp.shape(), &[2, 2]);
        assert_eq!(dp.names(), &["dp_replicate".to_string(), "dp_shard".to_string()]);
        assert_eq!(dp.coordinate(), &[r / 4, (r / 2) % 2]);
        let mates: Vec<usize> = (0..4).map(|k| k * 2 + r % 2).collect();
        assert_eq!(dp.ranks(), &mates[..]);
        // Its communicator spans the four ranks with this rank's tp coordinate.
        let got = dp.comm().all_gather_vec(&[r as i64])?;
        assert_eq!(got, mates.iter().map(|&m| m as i64).collect::<Vec<_>>());
        // Its dims are the mesh's dims (same communicators), and a second slice is the first.
        assert_eq!(dp.dim("dp_shard")?.comm_id(), mesh.dim("dp_shard")?.comm_id());
        let before = mesh.stats();
        let again = mesh.slice(&["dp_replicate", "dp_shard"])?;
        assert!(again.same_as(&dp) && again.comm_id() == dp.comm_id());
        assert_eq!(
            (mesh.stats() - before).total_calls(),
            0,
            "the second slice does not communicate"
        );
        // Dims need not be adjacent; one dim is `dim`, all dims the mesh itself.
        let outer = mesh.slice(&["dp_replicate", "tp"])?;
        assert_eq!(
            outer.ranks(),
            &[r % 4 - r % 2, r % 4 - r % 2 + 1, r % 4 - r % 2 + 4, r % 4 - r % 2 + 5]
        );
        assert_eq!(mesh.slice(&["tp"])?.comm_id(), mesh.dim("tp")?.comm_id());
        assert!(mesh.slice(&["dp_replicate", "dp_shard", "tp"])?.same_as(&mesh));
        for bad in [&["dp_shard", "dp_replicate"][..], &["tp", "tp"], &[]] {
            let e = mesh.slice(bad).err().map(|e| e.to_string()).unwrap_or_default();
            assert!(e.contains("distinct mesh dims in mesh order"), "{bad:?}: {e}");
        }
        let e = mesh.slice(&["dp"]).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("no mesh dim named \"dp\""), "{e}");
        Ok(())
    })
    .unwrap();
}

#[test]
fn flatten_merges_adjacent_dims() {
    launch(8, |ctx| {
        let r = ctx.rank();
        let mesh = DeviceMesh::with_names(ctx.into_comm(), &[2, 2, 2], &["dp_replicate", "dp_shard", "tp"])?;
        let flat = mesh.flatten(&["dp_replicate", "dp_shard"], "dp")?;
        assert_eq!(flat.shape(), &[4, 2]);
        assert_eq!(flat.names(), &["dp".to_string(), "tp".to_string()]);
        assert_eq!(flat.coordinate(), &[r / 2, r % 2]);
        let dp = flat.dim("dp")?;
        let got = dp.comm().all_gather_vec(&[r as i64])?;
        let want: Vec<i64> = (0..4).map(|k| (k * 2 + r % 2) as i64).collect();
        assert_eq!(got, want);
        // The untouched dim keeps working.
        let tp = flat.dim_comm("tp")?.all_gather_vec(&[r as i64])?;
        assert_eq!(tp, vec![(r - r % 2) as i64, (r - r % 2 + 1) as i64]);
        Ok(())
    })
    .unwrap();
}

#[test]
fn stats_count_per_rank() {
    launch(2, |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), &[2])?;
        let before = mesh.stats();
        mesh.dim_comm(0)?.all_gather_vec(&[0u8; 10])?;
        let d = mesh.stats() - before;
        assert_eq!(d.calls(tessera::mesh::OpKind::AllGather), 1);
        assert_eq!(d.bytes(tessera::mesh::OpKind::AllGather), 10);
        Ok(())
    })
    .unwrap();
}

#[test]
fn unflatten_splits_a_dim() {
    let out = launch(8, |ctx| {
        let mesh = DeviceMesh::with_names(ctx.into_comm(), &[8], &["dp"])?;
        let split = mesh.unflatten("dp", &[2, 4], &["inter", "intra"])?;
        let r = mesh.rank() as i64;
        // The inner dim: 4 consecutive ranks; the outer: ranks 4 apart.
        let intra = split.dim_comm("intra")?.all_gather_vec(&[r])?;
        let inter = split.dim_comm("inter")?.all_gather_vec(&[r])?;
        let errors = [
            mesh.unflatten("dp", &[3, 3], &["a", "b"]).unwrap_err().to_string(),
            mesh.unflatten("dp", &[2, 4], &["a"]).unwrap_err().to_string(),
            mesh.unflatten("dp", &[2, 4], &["a", "a"]).unwrap_err().to_string(),
        ];
        Ok((
            split.shape().to_vec(),
            split.names().to_vec(),
            split.coordinate().to_vec(),
            intra,
            inter,
            errors,
        ))
    })
    .unwrap();
    for (r, (shape, names, coord, intra, inter, errors)) in out.iter().enumerate() {
        assert_eq!(shape, &[2, 4]);
        assert_eq!(names, &["inter", "intra"]);
        assert_eq!(coord, &[r / 4, r % 4]);
        let base = (r / 4 * 4) as i64;
        assert_eq!(intra, &(base..base + 4).collect::<Vec<_>>());
        assert_eq!(inter, &[(r % 4) as i64, (r % 4 + 4) as i64]);
        assert!(errors[0].contains("multiply"), "{}", errors[0]);
        assert!(errors[1].contains("one name per new dim"), "{}", errors[1]);
        assert!(errors[2].contains("used twice"), "{}", errors[2]);
    }
}
