//! A checkpoint that is missing, truncated or corrupt, or asked for what it does
//! not hold: each a clear error naming the file and tensor, never a panic; and a
//! fuzz test mutating a real checkpoint (truncations, byte flips, index edits)
//! that accepts no wrong value, shape or dtype.
//!
//! Fuzz cases: 300 by default, `TESSERA_FUZZ_CASES` overrides.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::Value;
use tessera::dtensor::checkpoint::{Checkpoint, INDEX_FILE, save};
use tessera::dtensor::testing::test_values;
use tessera::dtensor::{DTensor, DType, Layout, Placement, ReduceOp, Tensor, distribute_tensor};
use tessera::{DeviceMesh, launch};

use crate::{Cleanup, Rng, copy_dir, files_in, fuzz_cases, scratch};

/// The tensors of the test checkpoint: name, shape, dtype, placement on 2 ranks.
const TENSORS: [(&str, &[usize], DType, Placement); 3] = [
    ("w", &[6, 4], DType::F32, Placement::Shard(0)),
    ("b", &[5], DType::F64, Placement::Shard(0)),
    ("step", &[1], DType::I64, Placement::Replicate),
];

/// Saves the test checkpoint at `dir` from 2 ranks.
fn make(dir: &Path) {
    let d = dir.to_path_buf();
    launch(2, move |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), &[2])?;
        let xs: Vec<(&str, DTensor)> = TENSORS
            .iter()
            .map(|(n, shape, dt, p)| Ok((*n, distribute_tensor(&test_values(shape, *dt)?, &mesh, &[*p])?)))
            .collect::<tessera::dtensor::Result<_>>()?;
        let refs: Vec<(&str, &DTensor)> = xs.iter().map(|(n, x)| (*n, x)).collect();
        save(&d, &refs, BTreeMap::from([("step".to_string(), "3".to_string())]))?;
        Ok(())
    })
    .unwrap();
}

/// Opens `dir` and loads every test tensor replicated on one rank: their full
/// values, or the first error's message. A panic fails the launch (and the test).
fn try_load(dir: &Path) -> Result<Vec<Tensor>, String> {
    let d = dir.to_path_buf();
    launch(1, move |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), &[1])?;
        let run = || -> tessera::dtensor::Result<Vec<Tensor>> {
            let ckpt = Checkpoint::open(&d)?;
            TENSORS
                .iter()
                .map(|(n, shape, dt, _)| {
                    let layout = Layout::new(&[1], &[Placement::Replicate], shape, *dt)?;
                    Ok(ckpt.load(n, &mesh, layout)?.to_local().clone())
                })
                .collect()
        };
        Ok(run().map_err(|e| e.to_string()))
    })
    .expect("loading a damaged checkpoint must not panic")
    .swap_remove(0)
}

fn pristine() -> Vec<Tensor> {
    TENSORS
        .iter()
        .map(|(_, shape, dt, _)| test_values(shape, *dt).unwrap())
        .collect()
}

fn edit_index(dir: &Path, f: impl FnOnce(&mut Value)) {
    let p = dir.join(INDEX_FILE);
    let mut v: Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(&p, serde_json::to_vec(&v).unwrap()).unwrap();
}

fn expect_err(dir: &Path, want: &[&str]) {
    let e = try_load(dir).expect_err("a damaged checkpoint must not load");
    for w in want {
        assert!(e.contains(w), "{e:?} should mention {w:?}");
    }
}

#[test]
fn damaged_checkpoints_are_named() {
    let base = scratch("base");
    let _c = Cleanup(base.clone());
    make(&base);
    assert_eq!(try_load(&base).unwrap(), pristine());
    let work = scratch("work");
    let _w = Cleanup(work.clone());
    let reset = || copy_dir(&base, &work);

    // No index at all, and an index that is not JSON.
    expect_err(&scratch("nowhere"), &["index.json", "cannot read the index"]);
    reset();
    std::fs::write(work.join(INDEX_FILE), b"{\"format\": ").unwrap();
    expect_err(&work, &["index.json", "not a valid checkpoint index"]);
    // A chunk file cut short, or gone.
    reset();
    let f = work.join("shard-00002-model-00001-of-00001.safetensors");
    let len = std::fs::metadata(&f).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&f)
        .unwrap()
        .set_len(len - 3)
        .unwrap();
    expect_err(&work, &["shard-00002-model-00001-of-00001.safetensors", "truncated"]);
    reset();
    std::fs::remove_file(&f).unwrap();
    expect_err(
        &work,
        &[
            "shard-00002-model-00001-of-00001.safetensors",
            "missing chunk file of tensor",
        ],
    );
    // The index claims another shape or dtype.
    reset();
    edit_index(&work, |v| v["tensors"]["w"]["shape"] = serde_json::json!([6, 5]));
    expect_err(&work, &["tensor w"]);
    reset();
    edit_index(&work, |v| v["tensors"]["w"]["dtype"] = "F64".into());
    expect_err(&work, &["tensor w", "need"]);
    reset();
    edit_index(&work, |v| v["tensors"]["w"]["dtype"] = "Q8".into());
    expect_err(&work, &["tensor w", "unknown dtype"]);
    // A flipped data byte.
    reset();
    let f = work.join("shard-00001-model-00001-of-00001.safetensors");
    let mut bytes = std::fs::read(&f).unwrap();
    let at = bytes.len() - 1;
    bytes[at] ^= 0x40;
    std::fs::write(&f, bytes).unwrap();
    expect_err(
        &work,
        &["shard-00001-model-00001-of-00001.safetensors", "checksum", "corrupt"],
    );
    // Asking for what is not there.
    reset();
    let d = work.clone();
    let asked = launch(1, move |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), &[1])?;
        let ckpt = Checkpoint::open(&d)?;
        let r = Layout::new(&[1], &[Placement::Replicate], &[6, 4], DType::F32)?;
        let missing = ckpt.load("v", &mesh, r.clone()).unwrap_err().to_string();
        let shape = ckpt
            .load(
                "w",
                &mesh,
                Layout::new(&[1], &[Placement::Replicate], &[4, 6], DType::F32)?,
            )
            .unwrap_err()
            .to_string();
        let dtype = ckpt
            .load(
                "w",
                &mesh,
                Layout::new(&[1], &[Placement::Replicate], &[6, 4], DType::BF16)?,
            )
            .unwrap_err()
            .to_string();
        Ok((missing, shape, dtype, ckpt.metadata().clone()))
    })
    .unwrap()
    .swap_remove(0);
    assert!(asked.0.contains("no tensor v"), "{}", asked.0);
    assert!(asked.1.contains("tensor w is saved as [6, 4] f32"), "{}", asked.1);
    assert!(asked.2.contains("asked for [6, 4] bf16"), "{}", asked.2);
    assert_eq!(asked.3["step"], "3");
}

#[test]
fn partial_tensors_are_not_saved() {
    let dir = scratch("partial");
    let _c = Cleanup(dir.clone());
    let d = dir.clone();
    let errs = launch(2, move |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), &[2])?;
        let p = DTensor::from_local(
            Tensor::zeros(&[3], DType::F32)?,
            &mesh,
            &[Placement::Partial(ReduceOp::Sum)],
            &[3],
        )?;
        Ok(save(&d, &[("g", &p)], BTreeMap::new()).unwrap_err().to_string())
    })
    .unwrap();
    for e in errs {
        assert!(
            e.contains("tensor g") && e.contains("reduce the Partial dims first"),
            "{e}"
        );
    }
    assert!(!dir.exists());
}

/// One random index edit: a number nudged, a string or dtype replaced, an
/// array shortened, a field removed.
fn mutate_index(v: &mut Value, rng: &mut Rng) {
    let names: Vec<String> = v["tensors"].as_object().unwrap().keys().cloned().collect();
    let t = &mut v["tensors"][&names[rng.below(names.len())]];
    match rng.below(6) {
        0 => {
            let d = rng.below(t["shape"].as_array().unwrap().len());
            let x = t["shape"][d].as_u64().unwrap();
            t["shape"][d] = (x + 1 + rng.below(3) as u64).into();
        }
        1 => t["dtype"] = ["F32", "F64", "BF16", "I64", "U8", "F16", "x"][rng.below(7)].into(),
        _ => {
            let n = t["chunks"].as_array().unwrap().len();
            let c = &mut t["chunks"][rng.below(n)];
            let fields = ["offsets", "shape", "file", "key", "begin", "end", "checksums"];
            let f = fields[rng.below(fields.len())];
            match &mut c[f] {
                Value::Number(x) => {
                    let x = x.as_u64().unwrap();
                    c[f] = (if rng.below(2) == 0 {
                        x + 1 + rng.below(8) as u64
                    } else {
                        x.saturating_sub(1)
                    })
                    .into();
                }
                Value::Array(a) if !a.is_empty() => {
                    let i = rng.below(a.len());
                    a[i] = (a[i].as_u64().unwrap() + 1).into();
                }
                Value::String(s) => *s = format!("{s}x"),
                _ => {
                    c.as_object_mut().unwrap().remove(f);
                }
            }
        }
    }
}

/// Mutates a real checkpoint at random: truncations, single byte flips anywhere
/// in any file, index edits. Loading never panics (a panic fails the launch),
/// and never returns anything but the saved values.
#[test]
fn fuzzed_checkpoints_never_load_wrong() {
    let cases = fuzz_cases();
    let base = scratch("fuzzbase");
    let _c = Cleanup(base.clone());
    make(&base);
    let want = pristine();
    let files = files_in(&base);
    let work: PathBuf = scratch("fuzz");
    let _w = Cleanup(work.clone());
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let (mut rejected, mut harmless) = (0, 0);
    let mut kinds = [0usize; 3];
    for case in 0..cases {
        copy_dir(&base, &work);
        let kind = rng.below(3);
        kinds[kind] += 1;
        let f = work.join(&files[rng.below(files.len())]);
        match kind {
            0 => {
                let len = std::fs::metadata(&f).unwrap().len();
                let keep = rng.below(len as usize) as u64;
                std::fs::OpenOptions::new()
                    .write(true)
                    .open(&f)
                    .unwrap()
                    .set_len(keep)
                    .unwrap();
            }
            1 => {
                let mut bytes = std::fs::read(&f).unwrap();
                let i = rng.below(bytes.len());
                bytes[i] ^= 1 << rng.below(8);
                std::fs::write(&f, bytes).unwrap();
            }
            _ => edit_index(&work, |v| mutate_index(v, &mut rng)),
        }
        match try_load(&work) {
            Err(_) => rejected += 1,
            Ok(got) => {
                assert_eq!(got, want, "case {case}: a damaged checkpoint loaded other values");
                harmless += 1;
            }
        }
    }
    println!(
        "fuzz: {cases} mutations ({} truncations, {} byte flips, {} index edits): {rejected} rejected with an \
         error, {harmless} harmless (the saved values loaded), 0 panics, 0 wrong loads",
        kinds[0], kinds[1], kinds[2]
    );
    assert!(rejected > cases / 2, "most mutations must be caught");
}
