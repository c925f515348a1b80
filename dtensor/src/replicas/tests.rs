use tessera_mesh::{CommCounts, OpKind, ReduceOp, launch};

use super::*;
use crate::{Placement::*, ShardOrder, distribute_tensor, distribute_tensor_from, distribute_tensor_with_order_from};

/// XXH64 of one buffer.
fn xxh64(bytes: &[u8]) -> u64 {
    let mut h = Xxh64::new();
    h.update(bytes);
    h.finish()
}

/// A `[4, 6]` f32 tensor `0, 1, 2, ...` plus `offset`.
fn input(offset: f32) -> Tensor {
    Tensor::from_vec((0..24).map(|i| i as f32 + offset).collect(), &[4, 6]).unwrap()
}

/// Runs `f` on every rank of a mesh of `shape` with dims named `names` (none
/// when empty), giving it the mesh and this rank; returns what each rank returned.
fn on_mesh<T, F>(shape: &[usize], names: &[&'static str], f: F) -> Vec<T>
where
    T: Send + 'static,
    F: Fn(&DeviceMesh, usize) -> Result<T> + Send + Sync + 'static,
{
    let (shape, names) = (shape.to_vec(), names.to_vec());
    launch(shape.iter().product(), move |ctx| {
        let mesh = if names.is_empty() {
            DeviceMesh::new(ctx.into_comm(), &shape)?
        } else {
            DeviceMesh::with_names(ctx.into_comm(), &shape, &names)?
        };
        let rank = mesh.rank();
        Ok(f(&mesh, rank)?)
    })
    .unwrap()
}

/// The collectives `f` issues on this rank.
fn counted<T>(mesh: &DeviceMesh, f: impl FnOnce() -> Result<T>) -> Result<(T, CommCounts)> {
    let before = mesh.stats();
    let out = f()?;
    Ok((out, mesh.stats() - before))
}

#[test]
fn xxh64_matches_the_reference_vectors() {
    macro_rules! case {
        ($input:expr, $want:expr) => {
            assert_eq!(xxh64($input), $want, "{:?}", String::from_utf8_lossy($input));
        };
    }
    case!(b"", 0xEF46_DB37_51D8_E999);
    case!(b"abc", 0x44BC_2CF5_AD77_0999);
    // 39 bytes: one stripe, then a word, a half word and bytes.
    case!(b"Nobody inspects the spammish repetition", 0xFBCE_A83C_8A37_8BF1);
    case!(b"The quick brown fox jumps over the lazy dog", 0x0B24_2D36_1FDA_71BC);
}

#[test]
fn xxh64_streams_in_any_chunks() {
    let data: Vec<u8> = (0..1000u32).map(|i| (i * 7 + i / 13) as u8).collect();
    let whole = xxh64(&data);
    for chunk in [1, 3, 7, 8, 31, 32, 33, 100, 999] {
        let mut h = Xxh64::new();
        data.chunks(chunk).for_each(|c| h.update(c));
        assert_eq!(h.finish(), whole, "chunks of {chunk}");
    }
}

#[test]
fn tensor_hash_ignores_strides_and_storage_offsets() {
    let t = Tensor::arange(2 * 3 * 40, DType::F32)
        .unwrap()
        .reshape(&[2, 3, 40])
        .unwrap();
    let strided = t.transpose(0, 2).unwrap(); // [40, 3, 2], not contiguous
    let narrowed = t.narrow(2, 5, 30).unwrap(); // an offset and a gap per row
    macro_rules! case {
        ($view:expr) => {
            let view = $view;
            let copy = Tensor::from_buffer(view.to_buffer(), view.shape()).unwrap();
            assert!(copy.is_contiguous());
            assert_eq!(tensor_hash(&view), tensor_hash(&copy), "{:?}", view.shape());
            // Copied a few bytes at a time: pieces along dim 0, then dim 1, ...
            for piece in [1, 8, 100, 1000] {
                assert_eq!(
                    hash_in_pieces(&view, piece),
                    tensor_hash(&copy),
                    "pieces of {piece} bytes"
                );
            }
        };
    }
    case!(t.clone());
    case!(strided.clone());
    case!(narrowed.clone());
    case!(t.narrow(0, 1, 1).unwrap());
    case!(strided.narrow(1, 1, 2).unwrap());
    case!(narrowed.transpose(0, 1).unwrap());
    case!(Tensor::zeros(&[3, 0, 2], DType::F64).unwrap().transpose(0, 2).unwrap());
}

#[test]
fn tensor_hash_tells_dtype_shape_and_values_apart() {
    let a = Tensor::from_vec(vec![1.5f64, -2.0], &[2]).unwrap();
    let bits: Vec<i64> = [1.5f64, -2.0].iter().map(|x| x.to_bits() as i64).collect();
    let same_bytes = Tensor::from_vec(bits, &[2]).unwrap();
    let hashes = [
        tensor_hash(&a),
        tensor_hash(&same_bytes),
        tensor_hash(&a.reshape(&[1, 2]).unwrap()),
        tensor_hash(&a.reshape(&[2, 1]).unwrap()),
        tensor_hash(&Tensor::from_vec(vec![1.5f64, -2.5], &[2]).unwrap()),
        tensor_hash(&Tensor::scalar(0.0, DType::F32).unwrap()),
        tensor_hash(&Tensor::zeros(&[0], DType::F32).unwrap()),
        tensor_hash(&Tensor::zeros(&[1], DType::F32).unwrap()),
    ];
    for i in 0..hashes.len() {
        for j in 0..i {
            assert_ne!(hashes[i], hashes[j], "cases {j} and {i}");
        }
    }
    assert_eq!(tensor_hash(&a), tensor_hash(&a.clone()));
}

#[test]
fn check_replicas_names_the_differing_rank_on_every_rank_of_a_1d_mesh() {
    let verdicts = on_mesh(&[3], &[], |mesh, rank| {
        let full = input(if rank == 1 { 0.5 } else { 0.0 });
        let w = distribute_tensor_from(&full, mesh, &[Replicate], None)?;
        Ok(check_replicas(&w, "layers.0.wq.weight").map_err(|e| e.to_string()))
    });
    let want = "replicas of `layers.0.wq.weight` differ on mesh dim 0 (size 3): ranks [1] hold other \
                values than rank 0 of the dim ([0]); build it identically on every rank (same seed, no \
                rank-dependent code), or pass src_data_rank (distribute_tensor_from) to take one rank's values";
    for (rank, v) in verdicts.iter().enumerate() {
        assert_eq!(v.as_ref().unwrap_err(), want, "rank {rank}");
    }
}

#[test]
fn check_replicas_on_a_2x2_mesh_reports_only_a_replicate_dim_that_differs() {
    // (placements, which ranks hold other values, the expected (dim, ranks, reference) or None).
    type Case = (
        [Placement; 2],
        &'static [usize],
        Option<(usize, &'static [usize], &'static [usize])>,
    );
    let cases: &[Case] = &[
        // Values differ along dim 0 (dp) only: dim 1 is consistent.
        ([Replicate, Replicate], &[2, 3], Some((0, &[2, 3], &[0, 1]))),
        // Differ along dim 1 (tp) only.
        ([Replicate, Replicate], &[1, 3], Some((1, &[1, 3], &[0, 2]))),
        // One rank differs: both dims see it; the first is reported.
        ([Replicate, Replicate], &[3], Some((0, &[3], &[1]))),
        ([Shard(0), Replicate], &[3], Some((1, &[3], &[2]))),
        ([Replicate, Shard(1)], &[1], Some((0, &[3], &[1]))),
        // Shard and Partial dims are not checked.
        ([Shard(0), Replicate], &[2, 3], None),
        ([Replicate, Shard(1)], &[1, 3], None),
        ([Partial(ReduceOp::Sum), Replicate], &[2, 3], None),
        ([Shard(0), Shard(1)], &[1, 2, 3], None),
        ([Replicate, Replicate], &[], None),
    ];
    for &(placements, odd, want) in cases {
        let verdicts = on_mesh(&[2, 2], &["dp", "tp"], move |mesh, rank| {
            let full = input(if odd.contains(&rank) { 100.0 } else { 0.0 });
            let w = distribute_tensor_from(&full, mesh, &placements, None)?;
            Ok(match check_replicas(&w, "w") {
                Ok(()) => None,
                Err(Error::ReplicasDiffer(d)) => {
                    assert_eq!((d.what.as_str(), d.dim_size), ("w", 2));
                    assert_eq!(d.dim_name.as_deref(), Some(["dp", "tp"][d.mesh_dim]));
                    Some((d.mesh_dim, d.ranks, d.reference))
                }
                Err(e) => panic!("{e}"),
            })
        });
        let want = want.map(|(d, r, f)| (d, r.to_vec(), f.to_vec()));
        for (rank, v) in verdicts.into_iter().enumerate() {
            assert_eq!(v, want, "{placements:?}, ranks {odd:?} differ: rank {rank}");
        }
    }
}

#[test]
fn check_replicas_of_equal_replicas_is_one_small_all_gather() {
    let out = on_mesh(&[2, 2], &[], |mesh, _| {
        let w = distribute_tensor_from(&input(0.0), mesh, &[Replicate, Shard(0)], None)?;
        let ((), counts) = counted(mesh, || check_replicas(&w, "w"))?;
        Ok(counts)
    });
    for counts in out {
        assert_eq!(counts.total_calls(), 1, "{counts}");
        // Two u64 words per rank, three peers.
        assert_eq!(counts.bytes(OpKind::AllGather), 3 * 16, "{counts}");
    }
}

#[test]
fn check_replicas_of_ranks_with_other_layouts_errors_on_every_rank() {
    let out = on_mesh(&[2], &[], |mesh, rank| {
        let placements = if rank == 0 { [Shard(0)] } else { [Replicate] };
        let w = distribute_tensor_from(&input(0.0), mesh, &placements, None)?;
        Ok(check_replicas(&w, "w").map_err(|e| e.to_string()))
    });
    for msg in out {
        let msg = msg.unwrap_err();
        assert!(
            msg.contains("ranks [1] hold `w` with another layout than rank 0"),
            "{msg}"
        );
    }
}

#[test]
fn distribute_tensor_gives_every_rank_the_source_ranks_values() {
    let cases: &[([Placement; 2], Option<usize>)] = &[
        ([Replicate, Replicate], None),
        ([Shard(0), Replicate], None),
        ([Shard(0), Shard(1)], None),
        ([Shard(1), Shard(1)], None),
        ([Partial(ReduceOp::Sum), Replicate], None),
        ([Replicate, Shard(0)], Some(0)),
        ([Replicate, Replicate], Some(3)),
        ([Shard(1), Replicate], Some(2)),
    ];
    for &(placements, src) in cases {
        let out = on_mesh(&[2, 2], &[], move |mesh, rank| {
            let mine = input(100.0 * rank as f32);
            let x = match src {
                None => distribute_tensor(&mine, mesh, &placements)?,
                Some(r) => distribute_tensor_from(&mine, mesh, &placements, Some(r))?,
            };
            check_replicas(&x, "x")?;
            x.full_tensor()
        });
        let want = input(100.0 * src.unwrap_or(0) as f32);
        for (rank, full) in out.into_iter().enumerate() {
            assert_eq!(full, want, "{placements:?} from {src:?}: rank {rank}");
        }
    }
}

#[test]
fn distribute_tensor_with_order_from_takes_the_source_too() {
    let placements = [Shard(0), Shard(0)];
    let out = on_mesh(&[2, 2], &[], move |mesh, rank| {
        let mine = input(100.0 * rank as f32);
        let x = distribute_tensor_with_order_from(
            &mine,
            mesh,
            &placements,
            ShardOrder::reversed_for(&placements),
            Some(1),
        )?;
        assert!(!x.layout().order.is_default());
        x.full_tensor()
    });
    assert!(out.iter().all(|full| *full == input(100.0)));
}

#[test]
fn distribute_tensor_of_identical_inputs_moves_no_data() {
    let out = on_mesh(&[2, 2], &[], |mesh, _| {
        let (x, counts) = counted(mesh, || distribute_tensor(&input(0.0), mesh, &[Shard(0), Replicate]))?;
        Ok((x.full_tensor()?, counts))
    });
    for (full, counts) in out {
        assert_eq!(full, input(0.0));
        // The hash all-gather alone: five u64 words per rank, three peers.
        assert_eq!(counts.total_calls(), 1, "{counts}");
        assert_eq!(counts.calls(OpKind::AllGather), 1, "{counts}");
        assert_eq!(counts.total_bytes(), 3 * 40, "{counts}");
    }
}

#[test]
fn distribute_tensor_of_differing_inputs_broadcasts_the_source_once() {
    let out = on_mesh(&[2, 2], &[], |mesh, rank| {
        let mine = input(if rank == 2 { 1.0 } else { 0.0 });
        let (_, counts) = counted(mesh, || distribute_tensor(&mine, mesh, &[Shard(0), Replicate]))?;
        Ok(counts)
    });
    for counts in out {
        assert_eq!(
            (counts.calls(OpKind::AllGather), counts.calls(OpKind::Broadcast)),
            (1, 1),
            "{counts}"
        );
        assert_eq!(counts.bytes(OpKind::Broadcast), 3 * 24 * 4 / 4, "{counts}");
    }
}

#[test]
fn distribute_tensor_from_none_trusts_every_rank_without_communicating() {
    let out = on_mesh(&[2], &[], |mesh, rank| {
        let mine = input(100.0 * rank as f32);
        let (x, counts) = counted(mesh, || distribute_tensor_from(&mine, mesh, &[Replicate], None))?;
        Ok((x.to_local().clone(), counts))
    });
    for (rank, (local, counts)) in out.into_iter().enumerate() {
        assert_eq!(local, input(100.0 * rank as f32));
        assert_eq!(counts, CommCounts::default(), "{counts}");
    }
}

#[test]
fn a_bad_source_rank_errors_on_every_rank() {
    macro_rules! case {
        ($src:expr, $want:expr) => {
            let out = on_mesh(&[2, 2], &[], |mesh, rank| {
                let src: fn(usize) -> usize = $src;
                Ok(
                    distribute_tensor_from(&input(0.0), mesh, &[Replicate, Shard(0)], Some(src(rank)))
                        .map(|_| ())
                        .map_err(|e| e.to_string()),
                )
            });
            for (rank, msg) in out.into_iter().enumerate() {
                assert_eq!(msg.unwrap_err(), $want, "rank {rank}");
            }
        };
    }
    case!(
        |_| 4,
        "distribute_tensor: src_data_rank 4 is not a rank of the mesh [2, 2], whose 4 ranks are 0..4 \
         (row-major over its coordinates)"
    );
    case!(
        |r| r % 2,
        "distribute_tensor: the ranks pass different src_data_rank ([0, 1, 0, 1], by rank); \
         every rank must pass the same one"
    );
    // Disagreeing, and out of range on some ranks: still the same error everywhere.
    case!(
        |r| r * 10,
        "distribute_tensor: the ranks pass different src_data_rank ([0, 10, 20, 30], by rank); \
         every rank must pass the same one"
    );
}

#[test]
fn another_shape_or_dtype_on_one_rank_errors_on_every_rank() {
    macro_rules! case {
        ($odd:expr, $want:expr) => {
            let out = on_mesh(&[3], &[], |mesh, rank| {
                let odd: fn() -> Tensor = $odd;
                let full = if rank == 1 { odd() } else { input(0.0) };
                Ok(distribute_tensor_from(&full, mesh, &[Shard(0)], Some(0))
                    .map(|_| ())
                    .map_err(|e| e.to_string()))
            });
            for (rank, msg) in out.into_iter().enumerate() {
                assert_eq!(msg.unwrap_err(), $want, "rank {rank}");
            }
        };
    }
    let tail = "every rank must pass a full tensor of the source's shape and dtype";
    case!(
        || Tensor::zeros(&[4, 5], DType::F32).unwrap(),
        format!("distribute_tensor: rank 0 (the source) holds a [4, 6] f32 tensor, but rank 1 a [4, 5] f32; {tail}")
    );
    case!(
        || Tensor::zeros(&[4, 6], DType::BF16).unwrap(),
        format!("distribute_tensor: rank 0 (the source) holds a [4, 6] f32 tensor, but rank 1 a [4, 6] bf16; {tail}")
    );
    // A 1-D tensor, on which Shard(0) would still fit, and a 3-D one.
    case!(
        || Tensor::zeros(&[24], DType::F32).unwrap(),
        format!("distribute_tensor: rank 0 (the source) holds a [4, 6] f32 tensor, but rank 1 a [24] f32; {tail}")
    );
    case!(
        || Tensor::zeros(&[4, 6, 1], DType::F32).unwrap(),
        format!("distribute_tensor: rank 0 (the source) holds a [4, 6] f32 tensor, but rank 1 a [4, 6, 1] f32; {tail}")
    );
}

#[test]
fn other_placements_on_one_rank_error_on_every_rank() {
    let out = on_mesh(&[2], &[], |mesh, rank| {
        let placements = if rank == 1 { [Shard(1)] } else { [Shard(0)] };
        Ok(distribute_tensor(&input(0.0), mesh, &placements)
            .map(|_| ())
            .map_err(|e| e.to_string()))
    });
    for (rank, msg) in out.into_iter().enumerate() {
        let msg = msg.unwrap_err();
        // Each rank names its own arguments in the placement notation.
        let mine = if rank == 1 { "(Shard(1))" } else { "(Shard(0))" };
        assert!(
            msg.starts_with("distribute_tensor: ranks [1] pass other placements or another shard order than rank 0")
                && msg.contains(&format!("(this rank: {mine} in order {{}})")),
            "{msg}"
        );
    }
}
