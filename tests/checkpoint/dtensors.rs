//! DTensor checkpoints across meshes and layouts, bytes read and written, atomic
//! replacement.

use std::collections::BTreeMap;

use proptest::prelude::*;
use proptest::test_runner::Config;
use tessera::dtensor::checkpoint::{Checkpoint, save};
use tessera::dtensor::testing::{global_shape, mesh_shape, order_from_keys, placements, test_values};
use tessera::dtensor::{DType, Layout, Placement, ShardOrder, Tensor, distribute_tensor, distribute_tensor_with_order};
use tessera::{DeviceMesh, launch};

use crate::{Cleanup, files_in, scratch};

fn config() -> Config {
    let mut c = Config::default();
    if std::env::var_os("PROPTEST_CASES").is_none() {
        c.cases = 48;
    }
    c.failure_persistence = None;
    c
}

/// A layout on some mesh: 1–3-D, up to 8 ranks, Shard/Replicate in any order.
fn layout(shape: Vec<usize>, dtype: DType) -> impl Strategy<Value = Layout> {
    mesh_shape().prop_flat_map(move |mesh| {
        let (shape, rank) = (shape.clone(), shape.len());
        (
            placements(rank, mesh.len(), vec![]),
            prop::collection::vec(any::<u8>(), mesh.len()),
        )
            .prop_map(move |(p, keys)| {
                let order = order_from_keys(&p, &keys).expect("a key per mesh dim");
                Layout::with_order(&mesh, &p, order, &shape, dtype).expect("valid layout")
            })
    })
}

/// Saves `full` under `src` on its mesh, then loads it under `dst` on its own
/// mesh; returns per destination rank the full tensor, the bytes it read and
/// the bytes of the chunks its piece overlaps.
fn round_trip(full: &Tensor, src: &Layout, dst: &Layout) -> Vec<(Tensor, u64, u64)> {
    let dir = scratch("prop");
    let _clean = Cleanup(dir.clone());
    let (d, f, s) = (dir.clone(), full.clone(), src.clone());
    launch(s.mesh_shape.iter().product(), move |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), &s.mesh_shape)?;
        let x = distribute_tensor_with_order(&f, &mesh, &s.placements, s.order.clone())?;
        save(&d, &[("x", &x)], BTreeMap::new())?;
        Ok(())
    })
    .unwrap();
    let dst = dst.clone();
    launch(dst.mesh_shape.iter().product(), move |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), &dst.mesh_shape)?;
        let ckpt = Checkpoint::open(&dir)?;
        let y = ckpt.load("x", &mesh, dst.clone())?;
        // The bytes of the chunks this rank's piece overlaps (all of one block
        // for these small tensors: a load reads whole blocks).
        let (at, shape) = dst.local_region(mesh.coordinate())?;
        let block = ckpt.index().block_size;
        let mut overlapped = 0;
        for c in &ckpt.index().tensors["x"].chunks {
            assert!(c.end - c.begin <= block, "a chunk of more than one block");
            let meets = (0..at.len()).all(|d| at[d] < c.offsets[d] + c.shape[d] && c.offsets[d] < at[d] + shape[d]);
            if meets && shape.iter().all(|&n| n > 0) {
                overlapped += c.end - c.begin;
            }
        }
        Ok((y.full_tensor()?, ckpt.bytes_read(), overlapped))
    })
    .unwrap()
}

proptest! {
    #![proptest_config(config())]

    /// Any layout to any layout, on meshes of different shapes, uneven splits
    /// included: the loaded tensor is the saved one, and each rank read exactly
    /// the blocks its piece overlaps (for these small tensors, one block per
    /// chunk: the chunks it overlaps, whole, checked against their checksums).
    #[test]
    fn any_layout_to_any_layout(
        (src, dst) in (global_shape(1..=3), prop_oneof![Just(DType::F32), Just(DType::F64), Just(DType::I64)])
            .prop_flat_map(|(shape, dt)| (layout(shape.clone(), dt), layout(shape, dt)))
    ) {
        let full = test_values(&src.shape, src.dtype).unwrap();
        for (r, (got, read, overlapped)) in round_trip(&full, &src, &dst).iter().enumerate() {
            prop_assert_eq!(got, &full, "rank {}", r);
            prop_assert_eq!(read, overlapped, "rank {} read other bytes", r);
        }
    }
}

/// FSDP over TP's layout (`[Shard(0), Shard(0)]`, the dp shard splitting the tp
/// shard) saved on 2×2, loaded onto one rank, onto FSDP on 2, and onto HSDP+TP
/// 2×2×2 with an uneven dim.
#[test]
fn fsdp_tp_layouts_reshard() {
    let full = test_values(&[10, 6], DType::F32).unwrap();
    let p = [Placement::Shard(0), Placement::Shard(0)];
    let src = Layout::with_order(&[2, 2], &p, ShardOrder::reversed_for(&p), &[10, 6], DType::F32).unwrap();
    let p3 = [Placement::Replicate, Placement::Shard(0), Placement::Shard(1)];
    for dst in [
        Layout::new(&[1], &[Placement::Replicate], &[10, 6], DType::F32).unwrap(),
        Layout::new(&[2], &[Placement::Shard(0)], &[10, 6], DType::F32).unwrap(),
        Layout::new(&[2, 2, 2], &p3, &[10, 6], DType::F32).unwrap(),
        Layout::with_order(&[4, 1], &p, ShardOrder::reversed_for(&p), &[10, 6], DType::F32).unwrap(),
    ] {
        for (r, (got, _, _)) in round_trip(&full, &src, &dst).iter().enumerate() {
            assert_eq!(got, &full, "rank {r} of {:?}", dst.mesh_shape);
        }
    }
}

/// One replica writes each chunk: on a 2×2 mesh placed `[Replicate, Shard(0)]`
/// only the two ranks at coordinate 0 of the replicate dim write; a replicated
/// scalar is written once.
#[test]
fn one_replica_writes_each_chunk() {
    let dir = scratch("replica");
    let _clean = Cleanup(dir.clone());
    let d = dir.clone();
    let reports = launch(4, move |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), &[2, 2])?;
        let w = distribute_tensor(
            &test_values(&[6, 4], DType::F32)?,
            &mesh,
            &[Placement::Replicate, Placement::Shard(0)],
        )?;
        let step = distribute_tensor(&Tensor::from_vec(vec![7i64], &[1])?, &mesh, &[Placement::Replicate; 2])?;
        Ok(save(&d, &[("w", &w), ("step", &step)], BTreeMap::new())?)
    })
    .unwrap();
    let written: Vec<u64> = reports.iter().map(|r| r.bytes_written).collect();
    assert_eq!(written, [3 * 4 * 4 + 8, 3 * 4 * 4, 0, 0]);
    assert_eq!(
        files_in(&dir),
        [
            "index.json",
            "shard-00001-model-00001-of-00001.safetensors",
            "shard-00002-model-00001-of-00001.safetensors"
        ]
    );
    let ckpt = Checkpoint::open(&dir).unwrap();
    assert_eq!(ckpt.entry("w").unwrap().chunks.len(), 2);
    assert_eq!(ckpt.entry("step").unwrap().chunks.len(), 1);
}

/// A second save replaces the first in one step; a save that fails leaves the
/// previous checkpoint and no temporary; so does a save that was killed (its
/// temporary, of a dead writer, is removed by the next save).
#[test]
fn saves_replace_atomically() {
    let parent = scratch("atomic");
    let _clean = Cleanup(parent.clone());
    let dir = parent.join("ck");
    let save_value = |v: f32, bad: bool| {
        let d = dir.clone();
        launch(2, move |ctx| {
            let mesh = DeviceMesh::new(ctx.into_comm(), &[2])?;
            let x = distribute_tensor(
                &Tensor::full(&[4], f64::from(v), DType::F32)?,
                &mesh,
                &[Placement::Shard(0)],
            )?;
            let names: &[&str] = if bad { &["x", "x"] } else { &["x"] };
            let list: Vec<(&str, &_)> = names.iter().map(|n| (*n, &x)).collect();
            Ok(save(&d, &list, BTreeMap::new()).map(|_| ()).map_err(|e| e.to_string()))
        })
        .unwrap()
    };
    let read = || read_value(&dir);
    assert!(save_value(1.0, false).iter().all(Result::is_ok));
    assert_eq!(read(), 1.0);
    assert!(save_value(2.0, false).iter().all(Result::is_ok));
    assert_eq!(read(), 2.0);
    let failed = save_value(3.0, true);
    for e in &failed {
        assert!(e.as_ref().unwrap_err().contains("two tensors are named \"x\""), "{e:?}");
    }
    assert_eq!(read(), 2.0, "a failed save keeps the previous checkpoint");
    assert_eq!(files_in(&parent), ["ck"], "no temporary directory is left");
    // A killed save's leftovers (a dead process's temporary, its lock free) do
    // not disturb loading, and the next save or load clears them.
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let dead = child.id();
    child.wait().unwrap();
    let tmp = parent.join(format!(".ck.tmp-{dead}-00112233445566778899aabbccddeeff"));
    std::fs::create_dir_all(&tmp).unwrap();
    std::fs::write(tmp.join("shard-00001-model-00001-of-00001.safetensors"), b"half").unwrap();
    std::fs::write(tmp.join("writer.lock"), b"pid 1").unwrap();
    assert_eq!(read(), 2.0);
    assert_eq!(
        files_in(&parent),
        ["ck"],
        "the load removed the dead writer's temporary"
    );
    std::fs::create_dir_all(&tmp).unwrap();
    assert!(save_value(4.0, false).iter().all(Result::is_ok));
    assert_eq!(read(), 4.0);
    assert_eq!(files_in(&parent), ["ck"]);
}

/// The first element of the checkpoint's `x`, read on one rank.
fn read_value(dir: &std::path::Path) -> f32 {
    let dir = dir.to_path_buf();
    launch(1, move |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), &[1])?;
        let layout = Layout::new(&[1], &[Placement::Replicate], &[4], DType::F32)?;
        let x = Checkpoint::open(&dir)?.load("x", &mesh, layout)?;
        Ok(x.to_local().to_f64_vec()[0] as f32)
    })
    .unwrap()[0]
}
