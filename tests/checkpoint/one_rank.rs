//! A fault on one rank only, at each public entry point that mixes local work
//! with collectives (state dicts, checkpoints): every rank returns an error
//! (the failed rank its own, the others one naming it), nothing is applied on
//! any rank, and the ranks are still in step afterwards (a barrier passes, which
//! a rank left inside a collective would turn into a mismatch or a hang).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tessera::DeviceMesh;
use tessera::autograd::nn::ParameterDict;
use tessera::autograd::optim::{AdamW, AdamWConfig, Optimizer};
use tessera::autograd::{Param, load_checkpoint, load_state_dict, save_checkpoint, save_state_dict_full};
use tessera::dtensor::checkpoint::save;
use tessera::dtensor::{DTensor, DType, Placement, Tensor, distribute_tensor};
use tessera::mesh::{LaunchOptions, launch_with};

use crate::{Cleanup, scratch};

/// What one rank saw: the operation's error (if any) and whether a barrier
/// after it passed.
#[derive(Debug)]
struct Seen {
    error: Option<String>,
    in_step: bool,
}

/// Runs `op` on 2 ranks with a short timeout and returns each rank's [`Seen`].
fn on_two_ranks<F>(op: F) -> Vec<Seen>
where
    F: Fn(&DeviceMesh) -> Result<(), String> + Send + Sync + 'static,
{
    let opts = LaunchOptions::default().timeout(Duration::from_secs(5));
    launch_with(&opts, 2, move |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), &[2])?;
        let error = op(&mesh).err();
        let in_step = mesh.comm().barrier().is_ok();
        Ok(Seen { error, in_step })
    })
    .expect("no rank may fail outside the operation under test")
}

/// Every rank failed, the failed rank with `own`, the other naming it, and
/// all ranks passed the barrier afterwards.
fn assert_agreed(seen: &[Seen], failed: usize, own: &str) {
    for (r, s) in seen.iter().enumerate() {
        assert!(s.in_step, "rank {r} is out of step after the failed operation: {s:?}");
        let e = s
            .error
            .as_deref()
            .unwrap_or_else(|| panic!("rank {r} returned Ok: {seen:?}"));
        assert!(
            e.contains(own),
            "rank {r}'s error does not carry the fault ({own:?}): {e}"
        );
        if r != failed {
            assert!(
                e.contains(&format!("rank {failed} failed")),
                "rank {r}'s error does not name rank {failed}: {e}"
            );
        }
    }
}

fn sharded(mesh: &DeviceMesh, t: &Tensor) -> tessera::dtensor::Result<DTensor> {
    distribute_tensor(t, mesh, &[Placement::Shard(0)])
}

fn f32s(n: usize, scale: f32) -> Tensor {
    Tensor::from_vec((0..n).map(|i| i as f32 * scale).collect::<Vec<_>>(), &[n]).unwrap()
}

/// Writes a safetensors file with `w` (F32 [4]) and `mask` (U64 [4], one value
/// beyond `i64::MAX`): its header is valid, one of its values is not.
fn write_bad_u64(path: &Path) {
    let header = r#"{"mask":{"dtype":"U64","shape":[4],"data_offsets":[0,32]},"w":{"dtype":"F32","shape":[4],"data_offsets":[32,48]}}"#;
    let mut header = header.as_bytes().to_vec();
    while !header.len().is_multiple_of(8) {
        header.push(b' ');
    }
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(&header);
    for v in [1u64, 2, u64::MAX, 4] {
        bytes.extend_from_slice(&v.to_le_bytes());
    }
    for v in [10f32, 11.0, 12.0, 13.0] {
        bytes.extend_from_slice(&v.to_le_bytes());
    }
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn a_bad_value_in_a_state_dict_fails_every_rank_and_changes_nothing() {
    let dir = scratch("one-rank-sd");
    std::fs::create_dir_all(&dir).unwrap();
    let _c = Cleanup(dir.clone());
    let file = dir.join("bad.safetensors");
    write_bad_u64(&file);
    // `w` is scattered before `mask` fails to decode on rank 0.
    let seen = on_two_ranks(move |mesh| {
        let run = || -> tessera::autograd::Result<()> {
            let w = Param::new(sharded(mesh, &f32s(4, 1.0))?);
            let mask = Param::new(sharded(mesh, &Tensor::from_vec(vec![0i64; 4], &[4])?)?);
            ParameterDict::new([("w", w.clone()), ("mask", mask.clone())])?;
            let result = load_state_dict(&[w.clone(), mask], &file);
            assert_eq!(w.value()?.full_tensor()?, f32s(4, 1.0), "a failed load changed w");
            result
        };
        run().map_err(|e| e.to_string())
    });
    assert_agreed(&seen, 0, "beyond i64::MAX");
}

/// Saves `w` and `b` (F32, sharded on 2 ranks) and AdamW-style state for both
/// at `dir`; `b`'s step count is saved as `step_dtype`.
fn save_with_state(dir: &Path, step_dtype: DType) {
    let d = dir.to_path_buf();
    launch_with(&LaunchOptions::default(), 2, move |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), &[2])?;
        let rep = [Placement::Replicate];
        let step = |dt| {
            distribute_tensor(
                &Tensor::from_vec(vec![3i64], &[1]).unwrap().cast(dt).unwrap(),
                &mesh,
                &rep,
            )
        };
        let t: Vec<(String, DTensor)> = vec![
            ("w".into(), sharded(&mesh, &f32s(6, 0.5))?),
            ("b".into(), sharded(&mesh, &f32s(4, -1.0))?),
            ("optim.w.exp_avg".into(), sharded(&mesh, &f32s(6, 0.1))?),
            ("optim.w.exp_avg_sq".into(), sharded(&mesh, &f32s(6, 0.2))?),
            ("optim.w.step".into(), step(DType::I64)?),
            ("optim.b.exp_avg".into(), sharded(&mesh, &f32s(4, 0.3))?),
            ("optim.b.exp_avg_sq".into(), sharded(&mesh, &f32s(4, 0.4))?),
            ("optim.b.step".into(), step(step_dtype)?),
        ];
        let refs: Vec<(&str, &DTensor)> = t.iter().map(|(n, x)| (n.as_str(), x)).collect();
        save(&d, &refs, BTreeMap::new())?;
        Ok(())
    })
    .unwrap();
}

/// Loads the checkpoint `dir_of(rank)` into fresh `w`, `b` and AdamW on each
/// rank, checks that a failure left them untouched, and returns the result.
fn load_fresh(mesh: &DeviceMesh, dir: &Path) -> Result<(), String> {
    let run = || -> tessera::autograd::Result<()> {
        let (w, b) = (
            Param::new(sharded(mesh, &f32s(6, 0.0))?),
            Param::new(sharded(mesh, &f32s(4, 0.0))?),
        );
        ParameterDict::new([("w", w.clone()), ("b", b.clone())])?;
        let mut opt = AdamW::new(vec![w.clone(), b.clone()], AdamWConfig::default())?;
        let result = load_checkpoint(dir, &[w.clone(), b.clone()], Some(&mut opt as &mut dyn Optimizer));
        if result.is_err() {
            assert_eq!(w.value()?.full_tensor()?, f32s(6, 0.0), "a failed load changed w");
            assert_eq!(b.value()?.full_tensor()?, f32s(4, 0.0), "a failed load changed b");
            assert_eq!(
                (opt.steps(0), opt.steps(1)),
                (0, 0),
                "a failed load changed the optimizer"
            );
            assert!(opt.state_tensors()?.is_empty(), "a failed load left optimizer state");
        } else {
            assert_eq!(w.value()?.full_tensor()?, f32s(6, 0.5));
            assert_eq!((opt.steps(0), opt.steps(1)), (3, 3));
        }
        result.map(drop)
    };
    run().map_err(|e| e.to_string())
}

#[test]
fn a_bad_optimizer_entry_applies_nothing() {
    let dir = scratch("one-rank-opt");
    let _c = Cleanup(dir.clone());
    save_with_state(&dir, DType::F64);
    let d = dir.clone();
    let seen = on_two_ranks(move |mesh| load_fresh(mesh, &d));
    for (r, s) in seen.iter().enumerate() {
        assert!(s.in_step, "rank {r} out of step");
        let e = s
            .error
            .as_deref()
            .unwrap_or_else(|| panic!("rank {r} loaded a bad step"));
        assert!(e.contains("step of b"), "rank {r}: {e}");
    }
}

#[test]
fn a_good_checkpoint_loads_everything() {
    let dir = scratch("one-rank-ok");
    let _c = Cleanup(dir.clone());
    save_with_state(&dir, DType::I64);
    let d = dir.clone();
    let seen = on_two_ranks(move |mesh| load_fresh(mesh, &d));
    assert!(seen.iter().all(|s| s.error.is_none() && s.in_step), "{seen:?}");
}

/// Copies the checkpoint `from` to `to` and flips one data byte of rank 1's
/// chunk file there.
fn corrupt_copy(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
    let f = to.join("shard-00002-model-00001-of-00001.safetensors");
    let mut bytes = std::fs::read(&f).unwrap();
    let at = bytes.len() - 3;
    bytes[at] ^= 0x40;
    std::fs::write(&f, bytes).unwrap();
}

#[test]
fn a_chunk_corrupt_on_one_ranks_disk_fails_every_rank_and_changes_nothing() {
    let (good, bad) = (scratch("one-rank-good"), scratch("one-rank-bad"));
    let _c = (Cleanup(good.clone()), Cleanup(bad.clone()));
    save_with_state(&good, DType::I64);
    corrupt_copy(&good, &bad);
    // Rank 1 reads a copy whose chunk file its own disk corrupted.
    let dirs: [PathBuf; 2] = [good.clone(), bad.clone()];
    let seen = on_two_ranks(move |mesh| load_fresh(mesh, &dirs[mesh.comm().rank()]));
    assert_agreed(&seen, 1, "checksum");
}

/// Parameters `v` and `w` (named), where rank 1 forgot to materialise `w`.
fn deferred_on_rank_1(mesh: &DeviceMesh) -> tessera::autograd::Result<[Param; 2]> {
    let (w, v) = (sharded(mesh, &f32s(4, 1.0))?, sharded(mesh, &f32s(6, 1.0))?);
    let w = if mesh.comm().rank() == 1 {
        Param::deferred(&[4], DType::F32, mesh)?
    } else {
        Param::new(w)
    };
    let v = Param::new(v);
    ParameterDict::new([("v", v.clone()), ("w", w.clone())])?;
    Ok([v, w])
}

#[test]
fn a_parameter_deferred_on_one_rank_fails_a_full_save_on_every_rank() {
    let dir = scratch("one-rank-full");
    std::fs::create_dir_all(&dir).unwrap();
    let _c = Cleanup(dir.clone());
    let file = dir.join("full.safetensors");
    let f = file.clone();
    let seen = on_two_ranks(move |mesh| {
        let run = || -> tessera::autograd::Result<()> {
            let [v, w] = deferred_on_rank_1(mesh)?;
            save_state_dict_full(&[v, w], &f)
        };
        run().map_err(|e| e.to_string())
    });
    assert_agreed(&seen, 1, "deferred");
    assert!(!file.exists(), "a failed save left a file");
}

#[test]
fn a_parameter_deferred_on_one_rank_fails_a_checkpoint_save_on_every_rank() {
    let dir = scratch("one-rank-save");
    let _c = Cleanup(dir.clone());
    let d = dir.clone();
    let seen = on_two_ranks(move |mesh| {
        let run = || -> tessera::autograd::Result<()> {
            let [v, w] = deferred_on_rank_1(mesh)?;
            save_checkpoint(&d, &[v, w], None, BTreeMap::new()).map(drop)
        };
        run().map_err(|e| e.to_string())
    });
    assert_agreed(&seen, 1, "deferred");
    assert!(!dir.exists(), "a failed save left a checkpoint");
}
