//! A fault campaign against sharded checkpoints saved on 2 and on 3 ranks: each
//! case damages a copy (a flipped byte in a chunk file, header or data; a
//! flipped character in `index.json`, or a chunk's file renamed there; two
//! chunk files swapped; a file copied from another checkpoint of the same
//! shapes; a file truncated or renamed) and loads it onto a mesh of another
//! layout, so that chunks are read whole and in part. Every rank must load
//! exactly the saved values and metadata or fail: a rank that loads anything
//! else is a silent wrong load, and there must be none. Ranks load independently
//! (`Checkpoint::load` is not collective), so a case may fail on some ranks
//! only (those whose bytes the damage touched); such cases are counted apart.
//! Each damaged copy is then loaded through the collective `load_checkpoint`,
//! whose ranks agree before applying: there every rank loads or every rank
//! fails, and all stay in step.
//!
//! Cases: 300 by default, `TESSERA_FUZZ_CASES` overrides (a bad value fails).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use tessera::autograd::nn::ParameterDict;
use tessera::autograd::{Param, load_checkpoint};
use tessera::dtensor::checkpoint::{Checkpoint, INDEX_FILE, Index, save};
use tessera::dtensor::{DTensor, DType, Layout, Placement, Tensor, distribute_tensor};
use tessera::{DeviceMesh, launch};

use crate::{Cleanup, Rng, copy_dir, files_in, fuzz_cases, scratch};

/// The tensors: name, shape, dtype. `w` spans several 64 KiB checksum blocks
/// per chunk (288 KiB: 144 KiB chunks on 2 ranks, 96 KiB on 3).
const TENSORS: [(&str, &[usize], DType); 4] = [
    ("w", &[72, 1024], DType::F32),
    ("b", &[10], DType::F64),
    ("e", &[6, 5], DType::BF16),
    ("step", &[1], DType::I64),
];

/// The saved values of tensor `i`, from `seed`.
fn values(i: usize, seed: u64) -> Tensor {
    let (_, shape, dt) = TENSORS[i];
    let n: usize = shape.iter().product();
    let v: Vec<f64> = (0..n)
        .map(|k| ((k as u64 * 7 + seed * 13 + i as u64) % 251) as f64 - 100.0)
        .collect();
    Tensor::from_vec(v, shape).unwrap().cast(dt).unwrap()
}

/// The placement of tensor `i` for a mesh dim placed `p`: `Shard(d)` beyond
/// the tensor's dims shards its last dim.
fn fit(i: usize, p: Placement) -> Placement {
    match p {
        Placement::Shard(d) => Placement::Shard(d.min(TENSORS[i].1.len() - 1)),
        p => p,
    }
}

/// Saves the tensors (values from `seed`) at `dir` on `n` ranks: `w` row
/// shards, `b` shards, `e` column shards, `step` replicated.
fn make(dir: &Path, n: usize, seed: u64) {
    let d = dir.to_path_buf();
    launch(n, move |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), &[n])?;
        let place = [
            Placement::Shard(0),
            Placement::Shard(0),
            Placement::Shard(1),
            Placement::Replicate,
        ];
        let xs: Vec<DTensor> = (0..TENSORS.len())
            .map(|i| distribute_tensor(&values(i, seed), &mesh, &[place[i]]))
            .collect::<tessera::dtensor::Result<_>>()?;
        let refs: Vec<(&str, &DTensor)> = TENSORS.iter().zip(&xs).map(|(t, x)| (t.0, x)).collect();
        save(&d, &refs, saved_meta())?;
        Ok(())
    })
    .unwrap();
}

/// The metadata saved with the tensors.
fn saved_meta() -> BTreeMap<String, String> {
    BTreeMap::from([("step".to_string(), "7".to_string())])
}

/// A destination: mesh shape and placements (fitted per tensor).
type Dest = (&'static [usize], &'static [Placement]);

/// Destinations other than the save's layout: row shards on another number of
/// ranks (chunks read in part), column shards (every chunk read in part), a
/// 2-D mesh, and one rank reading everything whole.
const DESTS: [Dest; 5] = [
    (&[3], &[Placement::Shard(0)]),
    (&[2], &[Placement::Shard(0)]),
    (&[3], &[Placement::Shard(1)]),
    (&[2, 2], &[Placement::Shard(1), Placement::Shard(0)]),
    (&[1], &[Placement::Replicate]),
];

/// What one rank loaded: every tensor's local piece, and the metadata.
type Loaded = (Vec<Tensor>, BTreeMap<String, String>);

/// Per rank: the local pieces of every tensor loaded from `dir` onto `dest` and
/// the checkpoint's metadata, or the first error. A panic fails the launch (and the test).
fn load(dir: &Path, dest: Dest) -> Vec<Result<Loaded, String>> {
    let d = dir.to_path_buf();
    let n = dest.0.iter().product();
    launch(n, move |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), dest.0)?;
        let run = || {
            let ckpt = Checkpoint::open(&d)?;
            (0..TENSORS.len())
                .map(|i| {
                    let (name, shape, dt) = TENSORS[i];
                    let p: Vec<Placement> = dest.1.iter().map(|&p| fit(i, p)).collect();
                    let layout = Layout::new(dest.0, &p, shape, dt)?;
                    Ok(ckpt.load(name, &mesh, layout)?.to_local().clone())
                })
                .collect::<tessera::dtensor::Result<Vec<Tensor>>>()
                .map(|pieces| (pieces, ckpt.metadata().clone()))
        };
        Ok(run().map_err(|e| e.to_string()))
    })
    .expect("loading a damaged checkpoint must not panic")
}

/// [`load`] through the collective `load_checkpoint` (the tensors as deferred
/// parameters, which it materialises): per rank, what it loaded and whether the
/// ranks were in step afterwards (a barrier passed). The ranks agree before
/// applying, so every rank must load or every rank fail.
fn load_agreed(dir: &Path, dest: Dest) -> Vec<(Result<Loaded, String>, bool)> {
    let d = dir.to_path_buf();
    let n = dest.0.iter().product();
    launch(n, move |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), dest.0)?;
        let run = || -> tessera::autograd::Result<Loaded> {
            let mut named = Vec::new();
            for (i, &(name, shape, dt)) in TENSORS.iter().enumerate() {
                let p: Vec<Placement> = dest.1.iter().map(|&p| fit(i, p)).collect();
                let param = Param::deferred(shape, dt, &mesh)?;
                param.place(Layout::new(dest.0, &p, shape, dt)?)?;
                named.push((name, param));
            }
            let params: Vec<Param> = named.iter().map(|(_, p)| p.clone()).collect();
            ParameterDict::new(named)?;
            let report = load_checkpoint(&d, &params, None)?;
            let pieces = params
                .iter()
                .map(|p| Ok(p.value()?.to_local().clone()))
                .collect::<tessera::autograd::Result<_>>()?;
            Ok((pieces, report.metadata))
        };
        let loaded = run().map_err(|e| e.to_string());
        Ok((loaded, mesh.comm().barrier().is_ok()))
    })
    .expect("loading a damaged checkpoint must not panic or leave a rank behind")
}

/// Per destination, per rank, per tensor: the saved local piece.
type Pieces = Vec<Vec<Vec<Tensor>>>;

/// The saved pieces per destination and rank, checked against the full tensors.
fn pristine(dir: &Path, seed: u64) -> Pieces {
    DESTS
        .iter()
        .map(|&dest| {
            let d = dir.to_path_buf();
            let n = dest.0.iter().product();
            launch(n, move |ctx| {
                let mesh = DeviceMesh::new(ctx.into_comm(), dest.0)?;
                let ckpt = Checkpoint::open(&d)?;
                let mut pieces = Vec::new();
                for (i, &(name, shape, dt)) in TENSORS.iter().enumerate() {
                    let p: Vec<Placement> = dest.1.iter().map(|&p| fit(i, p)).collect();
                    let x = ckpt.load(name, &mesh, Layout::new(dest.0, &p, shape, dt)?)?;
                    assert_eq!(x.full_tensor()?, values(i, seed), "{name} onto {dest:?}");
                    pieces.push(x.to_local().clone());
                }
                Ok(pieces)
            })
            .unwrap()
        })
        .collect()
}

/// The mutations, by name.
const KINDS: [&str; 8] = [
    "data byte flip",
    "header byte flip",
    "index character flip",
    "index file renamed",
    "files swapped",
    "file from another checkpoint",
    "truncation",
    "file renamed",
];

/// Applies mutation `kind` to the checkpoint copy `work`; `other` is another
/// checkpoint of the same shapes and layout. Returns a description.
fn mutate(work: &Path, other: &Path, kind: usize, rng: &mut Rng) -> String {
    let chunk_files: Vec<String> = files_in(work).into_iter().filter(|f| f != INDEX_FILE).collect();
    let all = files_in(work);
    let pick = |rng: &mut Rng, v: &[String]| v[rng.below(v.len())].clone();
    match kind {
        0 | 1 => {
            let f = pick(rng, &chunk_files);
            let p = work.join(&f);
            let mut bytes = std::fs::read(&p).unwrap();
            let start = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
            let i = if kind == 0 {
                start + rng.below(bytes.len() - start)
            } else {
                rng.below(start)
            };
            let bit = rng.below(8);
            bytes[i] ^= 1 << bit;
            std::fs::write(&p, bytes).unwrap();
            format!("{f}: byte {i} bit {bit} flipped")
        }
        2 => {
            let p = work.join(INDEX_FILE);
            let mut bytes = std::fs::read(&p).unwrap();
            let i = rng.below(bytes.len());
            let bit = rng.below(7);
            bytes[i] ^= 1 << bit;
            std::fs::write(&p, bytes).unwrap();
            format!("index.json: character {i} bit {bit} flipped")
        }
        3 => {
            // A chunk's file renamed in the index to another rank's file
            // (`shard-00001-...` -> `shard-00002-...`).
            let p = work.join(INDEX_FILE);
            let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
            let (name, ..) = TENSORS[rng.below(TENSORS.len())];
            let chunks = v["tensors"][name]["chunks"].as_array_mut().unwrap();
            let k = rng.below(chunks.len());
            let from = chunks[k]["file"].as_str().unwrap().to_string();
            let others: Vec<String> = chunk_files.iter().filter(|f| **f != from).cloned().collect();
            let to = pick(rng, &others);
            chunks[k]["file"] = to.clone().into();
            // Half the time sealed again (as a consistent rewrite of the index
            // would be), so that the chunk files' headers must catch it.
            let sealed = rng.below(2) == 0;
            if sealed {
                let mut index: Index = serde_json::from_value(v.clone()).unwrap();
                index.checksum = index.sealed_checksum().unwrap();
                v = serde_json::to_value(&index).unwrap();
            }
            std::fs::write(&p, serde_json::to_vec_pretty(&v).unwrap()).unwrap();
            format!("index.json: chunk {k} of {name} moved from {from} to {to} (sealed again: {sealed})")
        }
        4 => {
            let a = pick(rng, &chunk_files);
            let others: Vec<String> = chunk_files.iter().filter(|f| **f != a).cloned().collect();
            let b = pick(rng, &others);
            let tmp = work.join("swap");
            std::fs::rename(work.join(&a), &tmp).unwrap();
            std::fs::rename(work.join(&b), work.join(&a)).unwrap();
            std::fs::rename(&tmp, work.join(&b)).unwrap();
            format!("{a} and {b} swapped")
        }
        5 => {
            let f = pick(rng, &all);
            std::fs::copy(other.join(&f), work.join(&f)).unwrap();
            format!("{f} copied from another checkpoint")
        }
        6 => {
            let f = pick(rng, &all);
            let p = work.join(&f);
            let len = std::fs::metadata(&p).unwrap().len();
            let keep = rng.below(len as usize) as u64;
            std::fs::OpenOptions::new()
                .write(true)
                .open(&p)
                .unwrap()
                .set_len(keep)
                .unwrap();
            format!("{f} truncated to {keep} of {len} bytes")
        }
        _ => {
            let f = pick(rng, &all);
            let others: Vec<String> = chunk_files.iter().filter(|c| **c != f).cloned().collect();
            let to = if f == INDEX_FILE || rng.below(2) == 0 {
                format!("{f}.old")
            } else {
                pick(rng, &others)
            };
            std::fs::rename(work.join(&f), work.join(&to)).unwrap();
            format!("{f} renamed to {to}")
        }
    }
}

#[test]
fn fault_campaign_never_loads_wrong_values() {
    let cases = fuzz_cases();
    let root = scratch("campaign");
    let _clean = Cleanup(root.clone());
    // Per save world size: the checkpoint, another of the same shapes and
    // layout (other values, its own id), and the saved pieces per destination.
    let sets: Vec<(usize, PathBuf, PathBuf, Pieces)> = [2usize, 3]
        .iter()
        .map(|&n| {
            let (base, other) = (root.join(format!("base{n}")), root.join(format!("other{n}")));
            make(&base, n, 1);
            make(&other, n, 2);
            let want = pristine(&base, 1);
            (n, base, other, want)
        })
        .collect();
    let work = root.join("work");
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    let (mut intact, mut rejected, mut asymmetric) = (0usize, 0usize, 0usize);
    let mut per_kind = [(0usize, 0usize, 0usize); KINDS.len()]; // cases, with an error, on some ranks only
    let mut wrong = Vec::new();
    let (mut collective_asymmetric, mut out_of_step) = (Vec::new(), 0usize);
    for case in 0..cases {
        let (n, base, other, want) = &sets[case % sets.len()];
        copy_dir(base, &work);
        let kind = rng.below(KINDS.len());
        let what = mutate(&work, other, kind, &mut rng);
        let d = rng.below(DESTS.len());
        let got = load(&work, DESTS[d]);
        let errs = got.iter().filter(|g| g.is_err()).count();
        per_kind[kind].0 += 1;
        for (r, g) in got.iter().enumerate() {
            if let Ok((pieces, meta)) = g
                && (*pieces != want[d][r] || *meta != saved_meta())
            {
                wrong.push(format!(
                    "case {case} (saved on {n}, {what}, onto {:?}): rank {r}",
                    DESTS[d]
                ));
            }
        }
        match errs {
            0 => intact += 1,
            e if e == got.len() => rejected += 1,
            _ => {
                asymmetric += 1;
                per_kind[kind].2 += 1;
            }
        }
        if errs > 0 {
            per_kind[kind].1 += 1;
        }
        // The same damage through the collective load: all or nothing, in step.
        let agreed = load_agreed(&work, DESTS[d]);
        let agreed_errs = agreed.iter().filter(|(g, _)| g.is_err()).count();
        for (r, (g, in_step)) in agreed.iter().enumerate() {
            if let Ok((pieces, meta)) = g
                && (*pieces != want[d][r] || *meta != saved_meta())
            {
                wrong.push(format!(
                    "case {case} (saved on {n}, {what}, onto {:?}): rank {r} of load_checkpoint",
                    DESTS[d]
                ));
            }
            if !in_step {
                out_of_step += 1;
            }
        }
        if agreed_errs != 0 && agreed_errs != agreed.len() {
            collective_asymmetric.push(format!(
                "case {case} (saved on {n}, {what}, onto {:?}): {agreed:?}",
                DESTS[d]
            ));
        }
    }
    let kinds: Vec<String> = KINDS
        .iter()
        .zip(per_kind)
        .map(|(k, (n, e, some))| format!("{k} {e}/{n} ({some} on some ranks only)"))
        .collect();
    println!(
        "fault campaign: {cases} cases on checkpoints saved on 2 and 3 ranks, loaded onto other layouts: {} silent \
         wrong loads, {rejected} rejected on every rank, {asymmetric} rejected on some ranks only (the others \
         loaded the saved values), {intact} harmless (every rank loaded the saved values); cases with an error, \
         by mutation: {}; through load_checkpoint: {} rank-asymmetric outcomes, {out_of_step} ranks out of step",
        wrong.len(),
        kinds.join(", "),
        collective_asymmetric.len()
    );
    assert!(
        collective_asymmetric.is_empty(),
        "load_checkpoint disagreed across ranks:\n{}",
        collective_asymmetric.join("\n")
    );
    assert_eq!(out_of_step, 0, "ranks out of step after load_checkpoint");
    assert!(wrong.is_empty(), "silent wrong loads:\n{}", wrong.join("\n"));
    assert_eq!(intact + rejected + asymmetric, cases);
    if cases >= 100 {
        assert!(rejected > cases / 2, "most mutations must be caught on every rank");
    }
}
