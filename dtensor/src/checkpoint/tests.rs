//! Checkpoint trust: block checksums on partial reads, chunk file headers
//! checked against the index, the checkpoint id stamped in every file, and the
//! removal of dead writers' temporaries (never a live writer's).

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::path::{Path, PathBuf};

use serde_json::Value;
use tessera_mesh::{DType, DeviceMesh, launch};

use super::{Checkpoint, INDEX_FILE, Index, save};
use crate::{Layout, Placement, Tensor, distribute_tensor};

/// A fresh directory under the system's temporary directory, removed on drop.
pub(super) struct Scratch(pub(super) PathBuf);

impl Scratch {
    pub(super) fn new(tag: &str) -> Scratch {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let p = std::env::temp_dir().join(format!("tessera-ckpt-unit-{tag}-{}-{n}", std::process::id()));
        let _ = fs::remove_dir_all(&p);
        fs::create_dir_all(&p).unwrap();
        Scratch(p)
    }

    fn entries(&self) -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(&self.0)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// `w`: f32 [64, 1024] (256 KiB, four 64 KiB blocks), values `offset + k`.
const ROWS: usize = 64;
const COLS: usize = 1024;

fn full(offset: f64) -> Tensor {
    let v: Vec<f32> = (0..ROWS * COLS).map(|k| (offset + k as f64) as f32).collect();
    Tensor::from_vec(v, &[ROWS, COLS]).unwrap()
}

/// Saves `w` (values from `offset`) and a small `b` at `dir`, row-sharded on 2 ranks.
fn make(dir: &Path, offset: f64) {
    let d = dir.to_path_buf();
    launch(2, move |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), &[2])?;
        let w = distribute_tensor(&full(offset), &mesh, &[Placement::Shard(0)])?;
        let b = distribute_tensor(&Tensor::arange(6, DType::F64)?, &mesh, &[Placement::Shard(0)])?;
        save(&d, &[("w", &w), ("b", &b)], BTreeMap::new())?;
        Ok(())
    })
    .unwrap();
}

/// Loads `w` on `n` ranks placed `p`: per rank, its local piece (or the error)
/// and the bytes it read.
fn load(dir: &Path, n: usize, p: Placement) -> Vec<(Result<Tensor, String>, u64)> {
    let d = dir.to_path_buf();
    launch(n, move |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), &[n])?;
        let layout = Layout::new(&[n], &[p], &[ROWS, COLS], DType::F32)?;
        let ckpt = match Checkpoint::open(&d) {
            Ok(c) => c,
            Err(e) => return Ok((Err(e.to_string()), 0)),
        };
        let got = ckpt.load("w", &mesh, layout).map(|x| x.to_local().clone());
        Ok((got.map_err(|e| e.to_string()), ckpt.bytes_read()))
    })
    .unwrap()
}

/// The rows `[from, to)` of `full(0.0)`.
fn rows(from: usize, to: usize) -> Tensor {
    let v: Vec<f32> = (from * COLS..to * COLS).map(|k| k as f32).collect();
    Tensor::from_vec(v, &[to - from, COLS]).unwrap()
}

/// Where the data of chunk file `file` starts.
fn data_start(file: &Path) -> u64 {
    let bytes = fs::read(file).unwrap();
    8 + u64::from_le_bytes(bytes[..8].try_into().unwrap())
}

fn flip(file: &Path, at: u64) {
    let mut bytes = fs::read(file).unwrap();
    bytes[at as usize] ^= 0x10;
    fs::write(file, bytes).unwrap();
}

/// Edits `index.json` through `f` and seals it again (its own checksum made
/// to match), as a consistent rewrite would: so that the checks behind the
/// index's checksum are what a test meets.
fn edit_index(dir: &Path, f: impl FnOnce(&mut Value)) {
    let p = dir.join(INDEX_FILE);
    let mut v: Value = serde_json::from_slice(&fs::read(&p).unwrap()).unwrap();
    f(&mut v);
    let mut index: Index = serde_json::from_value(v).unwrap();
    index.checksum = index.sealed_checksum().unwrap();
    fs::write(&p, serde_json::to_vec(&index).unwrap()).unwrap();
}

/// Rewrites the safetensors header of chunk file `name` in `dir` through `f`,
/// and shifts the byte ranges the index gives its chunks by the header's
/// change in length (so that only the header disagrees with the index).
fn edit_header(dir: &Path, name: &str, f: impl FnOnce(&mut Value)) {
    let file = dir.join(name);
    let bytes = fs::read(&file).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut v: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    f(&mut v);
    let text = serde_json::to_vec(&v).unwrap();
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&text);
    out.extend_from_slice(&bytes[8 + n..]);
    fs::write(&file, out).unwrap();
    let delta = text.len() as i64 - n as i64;
    edit_index(dir, |v| {
        for t in v["tensors"].as_object_mut().unwrap().values_mut() {
            for c in t["chunks"].as_array_mut().unwrap() {
                if c["file"] == name {
                    for k in ["begin", "end"] {
                        c[k] = (c[k].as_i64().unwrap() + delta).into();
                    }
                }
            }
        }
    });
}

fn assert_errs(got: &[(Result<Tensor, String>, u64)], want: &[&str]) {
    for (r, (g, _)) in got.iter().enumerate() {
        let e = g
            .as_ref()
            .map_err(Clone::clone)
            .expect_err(&format!("a damaged checkpoint must not load (expected {want:?})"));
        for w in want {
            assert!(e.contains(w), "rank {r}: {e:?} should mention {w:?}");
        }
    }
}

#[test]
fn partial_reads_read_whole_blocks_and_check_them() {
    let dir = Scratch::new("blocks");
    let ck = dir.0.join("ck");
    make(&ck, 0.0);
    let index = Checkpoint::open(&ck).unwrap().index().clone();
    assert_eq!((index.version, index.block_size, index.id.len()), (3, 64 << 10, 32));
    assert_eq!(
        index.tensors["w"].chunks[0].checksums.len(),
        2 * 16,
        "two blocks per chunk"
    );
    // Four row shards: each is one whole block, read exactly.
    let got = load(&ck, 4, Placement::Shard(0));
    for (r, (g, read)) in got.iter().enumerate() {
        assert_eq!(g.as_ref().unwrap(), &rows(16 * r, 16 * (r + 1)), "rank {r}");
        assert_eq!(*read, 64 << 10, "rank {r} reads its one block");
    }
    // Column shards: each rank needs half of every row, and every block holds
    // rows: it reads (and checks) all 256 KiB, the bound of twice its bytes.
    let got = load(&ck, 2, Placement::Shard(1));
    for (r, (g, read)) in got.iter().enumerate() {
        assert_eq!(g.as_ref().unwrap().shape(), &[ROWS, COLS / 2], "rank {r}");
        assert_eq!(*read, 256 << 10, "rank {r}");
    }
    // A flipped byte in block 1 of rank 0's chunk: the rank reading that block
    // (in part: rows 16..32 of 0..32) fails naming file, tensor and block; the
    // rest read unharmed blocks and get the saved values.
    let f = ck.join("shard-00001-model-00001-of-00001.safetensors");
    flip(&f, data_start(&f) + (64 << 10) + 4 * COLS as u64 + 1);
    let got = load(&ck, 4, Placement::Shard(0));
    let e = got[1].0.as_ref().unwrap_err();
    for w in [
        "shard-00001-model-00001-of-00001.safetensors",
        "tensor w",
        "block 1",
        "checksum",
    ] {
        assert!(e.contains(w), "{e}");
    }
    for r in [0, 2, 3] {
        assert_eq!(got[r].0.as_ref().unwrap(), &rows(16 * r, 16 * (r + 1)), "rank {r}");
    }
    // Read in part by every rank (column shards): all fail.
    assert_errs(
        &load(&ck, 2, Placement::Shard(1)),
        &["shard-00001-model-00001-of-00001.safetensors", "tensor w"],
    );
}

#[test]
fn chunk_headers_are_checked_against_the_index() {
    let dir = Scratch::new("headers");
    let base = dir.0.join("base");
    make(&base, 0.0);
    let other = dir.0.join("other");
    make(&other, 1000.0);
    let work = dir.0.join("work");
    let reset = || {
        let _ = fs::remove_dir_all(&work);
        fs::create_dir_all(&work).unwrap();
        for f in [
            "index.json",
            "shard-00001-model-00001-of-00001.safetensors",
            "shard-00002-model-00001-of-00001.safetensors",
        ] {
            fs::copy(base.join(f), work.join(f)).unwrap();
        }
    };
    let r0 = work.join("shard-00001-model-00001-of-00001.safetensors");
    let r1 = work.join("shard-00002-model-00001-of-00001.safetensors");
    macro_rules! case {
        ($damage:expr, $want:expr) => {
            reset();
            $damage;
            assert_errs(&load(&work, 1, Placement::Replicate), &$want);
            assert_errs(&load(&work, 3, Placement::Shard(1)), &$want);
        };
    }
    reset();
    assert_eq!(load(&work, 1, Placement::Replicate)[0].0.as_ref().unwrap(), &full(0.0));
    // The index names the other rank's file for a chunk (shard-00001 ->
    // shard-00002), which holds the tensor's other chunk under the same key.
    case!(
        edit_index(&work, |v| v["tensors"]["w"]["chunks"][0]["file"] =
            "shard-00002-model-00001-of-00001.safetensors".into()),
        [
            "shard-00002-model-00001-of-00001.safetensors",
            "tensor w",
            "chunks 0 and 1 are both \"w\""
        ]
    );
    // Sharded safetensors readers would put a chunk elsewhere than the index.
    case!(
        edit_header(&work, "shard-00001-model-00001-of-00001.safetensors", |h| {
            let info = h["__metadata__"]["DCP_SHARDING_INFO"]
                .as_str()
                .unwrap()
                .replace("[0,0]", "[1,0]");
            h["__metadata__"]["DCP_SHARDING_INFO"] = info.into();
        }),
        [
            "shard-00001-model-00001-of-00001.safetensors",
            "tensor w",
            "DCP_SHARDING_INFO puts chunk w at [1, 0]"
        ]
    );
    // The two files swapped on disk.
    case!(
        {
            fs::rename(&r0, work.join("x")).unwrap();
            fs::rename(&r1, &r0).unwrap();
            fs::rename(work.join("x"), &r1).unwrap();
        },
        ["shard-0000", "renamed or swapped"]
    );
    // A file of another checkpoint of the same shapes.
    case!(
        fs::copy(other.join("shard-00002-model-00001-of-00001.safetensors"), &r1).unwrap(),
        [
            "shard-00002-model-00001-of-00001.safetensors",
            "copied from another checkpoint",
            "tensor"
        ]
    );
    // Headers that disagree with the index: dtype, shape, byte range, an extra
    // chunk, an unstamped file.
    case!(
        edit_header(
            &work,
            "shard-00001-model-00001-of-00001.safetensors",
            |h| h["w"]["dtype"] = "I32".into()
        ),
        [
            "shard-00001-model-00001-of-00001.safetensors",
            "tensor w",
            "chunk w",
            "the index says"
        ]
    );
    case!(
        edit_header(
            &work,
            "shard-00001-model-00001-of-00001.safetensors",
            |h| h["w"]["shape"] = serde_json::json!([1024, 32])
        ),
        [
            "shard-00001-model-00001-of-00001.safetensors",
            "tensor w",
            "the index says"
        ]
    );
    case!(
        edit_header(
            &work,
            "shard-00001-model-00001-of-00001.safetensors",
            |h| h["w"]["data_offsets"][0] = 8.into()
        ),
        [
            "shard-00001-model-00001-of-00001.safetensors",
            "tensor w",
            "the index says"
        ]
    );
    case!(
        edit_header(&work, "shard-00001-model-00001-of-00001.safetensors", |h| h["x"] =
            h["b"].clone()),
        [
            "shard-00001-model-00001-of-00001.safetensors",
            "\"x\" is not in the index"
        ]
    );
    case!(
        edit_header(&work, "shard-00001-model-00001-of-00001.safetensors", |h| {
            let b = h.as_object_mut().unwrap().remove("b").unwrap();
            h["x"] = b;
        }),
        [
            "shard-00001-model-00001-of-00001.safetensors",
            "tensor b",
            "chunk b",
            "does not hold it"
        ]
    );
    case!(
        edit_header(&work, "shard-00001-model-00001-of-00001.safetensors", |h| {
            h.as_object_mut().unwrap().remove("__metadata__");
        }),
        [
            "shard-00001-model-00001-of-00001.safetensors",
            "not a chunk file of a checkpoint"
        ]
    );
    case!(
        fs::write(&r0, vec![0xffu8; fs::metadata(&r0).unwrap().len() as usize]).unwrap(),
        ["shard-00001-model-00001-of-00001.safetensors", "not a safetensors file"]
    );
    // The index edited without sealing it again (a metadata value, a block
    // checksum): caught by its own checksum.
    case!(
        {
            let p = work.join(INDEX_FILE);
            let mut v: Value = serde_json::from_slice(&fs::read(&p).unwrap()).unwrap();
            v["metadata"]["step"] = "6".into();
            fs::write(&p, serde_json::to_vec(&v).unwrap()).unwrap();
        },
        ["index.json", "does not match its checksum", "edited or is corrupt"]
    );
    case!(
        {
            let p = work.join(INDEX_FILE);
            let mut v: Value = serde_json::from_slice(&fs::read(&p).unwrap()).unwrap();
            let sums = v["tensors"]["w"]["chunks"][1]["checksums"]
                .as_str()
                .unwrap()
                .to_string();
            let first = if sums.starts_with('0') { "1" } else { "0" };
            let sums = format!("{first}{}", &sums[1..]);
            v["tensors"]["w"]["chunks"][1]["checksums"] = sums.into();
            fs::write(&p, serde_json::to_vec(&v).unwrap()).unwrap();
        },
        ["index.json", "does not match its checksum"]
    );
    // The index: an id that is not 32 hex digits, and version 1.
    case!(
        edit_index(&work, |v| v["id"] = "xyz".into()),
        ["index.json", "32 lowercase hex digits"]
    );
    case!(
        edit_index(&work, |v| v["version"] = 1.into()),
        [
            "index.json",
            "version 1; this build reads \"tessera-checkpoint\" versions 2 to 3",
            "not read"
        ]
    );
    case!(
        edit_index(&work, |v| v["tensors"]["w"]["chunks"][1]["key"] = "w@4,0".into()),
        ["tensor w", "keyed \"w@4,0\""]
    );
}

/// The PID of a process that has exited (a child, reaped).
fn dead_pid() -> u32 {
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let pid = child.id();
    child.wait().unwrap();
    pid
}

#[test]
#[cfg_attr(not(target_os = "linux"), ignore = "needs /proc to tell dead writers")]
fn saves_and_loads_remove_dead_writers_temporaries_only() {
    let dir = Scratch::new("temps");
    let dead = dead_pid();
    let id = "0123456789abcdef0123456789abcdef";
    let mk = |name: &str, lock: bool| {
        let p = dir.0.join(name);
        fs::create_dir_all(&p).unwrap();
        fs::write(p.join("shard-00001-model-00001-of-00001.safetensors"), b"half").unwrap();
        if lock {
            fs::write(p.join("writer.lock"), format!("pid {dead}")).unwrap();
        }
    };
    // Dead writers: with a lock file nobody holds, without one, a file of an
    // atomic write; each of another checkpoint name than the next save's.
    mk(&format!(".step_000014.tmp-{dead}-{id}"), true);
    mk(&format!(".step_000015.tmp-{dead}-{id}"), false);
    fs::write(dir.0.join(format!(".latest.tmp-{dead}-3")), b"step_").unwrap();
    // Live writers: one holding its lock (a writer on another host, whose PID
    // means nothing here), one of this process, and an atomic write's file held
    // locked; and names that are no temporaries.
    let held = format!(".step_000016.tmp-{dead}-{id}");
    mk(&held, true);
    let lock = File::options()
        .write(true)
        .open(dir.0.join(&held).join("writer.lock"))
        .unwrap();
    lock.try_lock().unwrap();
    let own = format!(".step_000017.tmp-{}-{id}", std::process::id());
    mk(&own, true);
    let held_file = format!(".result.json.tmp-{dead}-0");
    fs::write(dir.0.join(&held_file), b"{").unwrap();
    let file_lock = File::options().write(true).open(dir.0.join(&held_file)).unwrap();
    file_lock.try_lock().unwrap();
    fs::write(dir.0.join(".hidden"), b"x").unwrap();
    fs::create_dir_all(dir.0.join(".step_000018.tmp")).unwrap();
    let mut survivors = vec![
        ".hidden".to_string(),
        held.clone(),
        held_file.clone(),
        own.clone(),
        ".step_000018.tmp".into(),
    ];
    survivors.sort();

    // A load removes the dead ones.
    make(&dir.0.join("a"), 0.0);
    let mut want = survivors.clone();
    want.push("a".into());
    want.sort();
    mk(&format!(".step_000014.tmp-{dead}-{id}"), true);
    assert_ne!(dir.entries(), want);
    Checkpoint::open(dir.0.join("a")).unwrap();
    assert_eq!(dir.entries(), want, "a load removes dead writers' temporaries only");
    // So does a save; and a save leaves no temporary and no lock file.
    mk(&format!(".step_000015.tmp-{dead}-{id}"), false);
    fs::write(dir.0.join(format!(".latest.tmp-{dead}-4")), b"step_").unwrap();
    make(&dir.0.join("b"), 0.0);
    want.push("b".into());
    want.sort();
    assert_eq!(dir.entries(), want, "a save removes dead writers' temporaries only");
    let mut files: Vec<String> = fs::read_dir(dir.0.join("b"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    assert_eq!(
        files,
        [
            "index.json",
            "shard-00001-model-00001-of-00001.safetensors",
            "shard-00002-model-00001-of-00001.safetensors"
        ]
    );
    // Once the writers are gone, their temporaries go too (this process's own
    // still counts as live).
    drop((lock, file_lock));
    Checkpoint::open(dir.0.join("a")).unwrap();
    let mut want: Vec<String> = [".hidden", &own, ".step_000018.tmp", "a", "b"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    want.sort();
    assert_eq!(dir.entries(), want);
}

#[test]
fn saving_over_a_checkpoint_leaves_no_temporary() {
    let dir = Scratch::new("replace");
    let ck = dir.0.join("ck");
    // An older version's temporary of the same name is removed as before.
    fs::create_dir_all(dir.0.join(".ck.tmp")).unwrap();
    make(&ck, 0.0);
    let first = Checkpoint::open(&ck).unwrap().index().id.clone();
    make(&ck, 5.0);
    let second = Checkpoint::open(&ck).unwrap().index().id.clone();
    assert_ne!(first, second, "every save draws a new id");
    assert_eq!(dir.entries(), ["ck"]);
    assert_eq!(load(&ck, 1, Placement::Replicate)[0].0.as_ref().unwrap(), &full(5.0));
}

#[test]
fn an_abandoned_background_save_leaves_no_temporary() {
    let dir = Scratch::new("abandon");
    make(&dir.0.join("ck"), 0.0);
    let d = dir.0.join("ck");
    launch(2, move |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), &[2])?;
        let w = distribute_tensor(&full(9.0), &mesh, &[Placement::Shard(0)])?;
        let pending = super::async_save(&d, &[("w", &w)], BTreeMap::new())?;
        mesh.comm().barrier()?;
        drop(pending);
        mesh.comm().barrier()?;
        Ok(())
    })
    .unwrap();
    assert_eq!(dir.entries(), ["ck"]);
    assert_eq!(
        load(&dir.0.join("ck"), 1, Placement::Replicate)[0].0.as_ref().unwrap(),
        &full(0.0)
    );
}

/// A version 2 checkpoint (chunks keyed `NAME@OFFSETS` in
/// `rankNNNNN.safetensors`, written by the build before version 3: `w` =
/// `arange(12)` as [4, 3] over 2 ranks, `b` = `arange(5)` f64 replicated,
/// metadata `step` 7) still loads, onto any layout, with its checks.
#[test]
fn version_2_checkpoints_still_load() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/data/checkpoint_v2");
    let ckpt = Checkpoint::open(&dir).unwrap();
    assert_eq!((ckpt.index().version, ckpt.metadata()["step"].as_str()), (2, "7"));
    let d = dir.clone();
    launch(2, move |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), &[2])?;
        let ckpt = Checkpoint::open(&d)?;
        let w = ckpt.load(
            "w",
            &mesh,
            Layout::new(&[2], &[Placement::Shard(1)], &[4, 3], DType::F32)?,
        )?;
        assert_eq!(
            w.full_tensor()?.to_f64_vec(),
            (0..12).map(f64::from).collect::<Vec<_>>()
        );
        let b = ckpt.load("b", &mesh, Layout::new(&[2], &[Placement::Shard(0)], &[5], DType::F64)?)?;
        assert_eq!(b.full_tensor()?.to_f64_vec(), (0..5).map(f64::from).collect::<Vec<_>>());
        Ok(())
    })
    .unwrap();
}
