//! Tests of loading and saving state dicts.

use tessera_dtensor::{Placement, Placement::*, distribute_tensor};
use tessera_mesh::{DeviceMesh, launch};

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

use super::*;

/// A fresh empty directory under the system temp dir, removed on drop (shared by
/// the state-dict modules' tests).
pub(super) struct TmpDir(pub(super) PathBuf);

impl TmpDir {
    pub(super) fn new(tag: &str) -> TmpDir {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let dir = std::env::temp_dir().join(format!(
            "tessera-state-dict-{tag}-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        TmpDir(dir)
    }

    pub(super) fn file(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }

    /// The names in the directory (to spot leftover temporary files).
    pub(super) fn entries(&self) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(&self.0)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }
}

impl Drop for TmpDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// This thread's I/O counter `field` of `/proc/thread-self/io` so far (Linux;
/// `None` elsewhere): `rchar` bytes read, `syscr` read calls. Reading the
/// counters counts too: one read call of a few hundred bytes.
pub(super) fn io_counter(field: &str) -> Option<u64> {
    use std::io::Read;
    let mut buf = [0u8; 4096];
    let n = std::fs::File::open("/proc/thread-self/io").ok()?.read(&mut buf).ok()?;
    std::str::from_utf8(&buf[..n])
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(": ")?.parse().ok())
}

/// Bytes this thread has read through system calls so far ([`io_counter`]).
pub(super) fn bytes_read() -> Option<u64> {
    io_counter("rchar")
}

fn data(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/data").join(name)
}

/// Three tensors of three dtypes: (name, full tensor).
fn sample() -> Vec<(String, Tensor)> {
    vec![
        ("w".into(), Tensor::randn(&[5, 3], DType::F32, 1).unwrap()),
        ("layers.0.b".into(), Tensor::randn(&[7], DType::F64, 2).unwrap()),
        (
            "h".into(),
            Tensor::randn(&[2, 2], DType::F32, 3)
                .unwrap()
                .cast(DType::BF16)
                .unwrap(),
        ),
    ]
}

/// Parameters with `sample`'s names, shapes and dtypes, zero, placed by `placements`.
fn zeros_like_sample(mesh: &DeviceMesh, placements: &[&[Placement]]) -> Result<Vec<Param>> {
    sample()
        .iter()
        .zip(placements)
        .map(|((n, t), pl)| {
            Ok(Param::named(
                n.clone(),
                distribute_tensor(&Tensor::zeros(t.shape(), t.dtype())?, mesh, pl)?,
            ))
        })
        .collect()
}

fn err_of(r: Result<()>) -> String {
    r.unwrap_err().to_string()
}

#[test]
fn write_then_read_keeps_names_dtypes_values() {
    let dir = TmpDir::new("rw");
    let path = dir.file("a.safetensors");
    write_safetensors(&path, &sample()).unwrap();
    let mut got = read_safetensors(&path).unwrap();
    got.sort_by(|a, b| a.0.cmp(&b.0));
    let mut want = sample();
    want.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(got, want);
    assert_eq!(dir.entries(), vec!["a.safetensors"]);
    // The safetensors crate reads it too, data aligned to its dtype.
    let bytes = std::fs::read(&path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    for (_, v) in st.tensors() {
        assert_eq!(
            (v.data().as_ptr() as usize - bytes.as_ptr() as usize - 8) % v.dtype().size(),
            0
        );
    }
    let err = err_of(write_safetensors(
        &path,
        &[("x".into(), want[0].1.clone()), ("x".into(), want[1].1.clone())],
    ));
    assert!(err.contains("two tensors are named \"x\""), "{err}");
}

#[test]
fn round_trip_on_one_and_two_ranks() {
    let dir = TmpDir::new("round-trip");
    for (world, save_pl, load_pl) in [
        (
            1,
            [&[Replicate][..], &[Replicate], &[Replicate]],
            [&[Replicate][..], &[Replicate], &[Replicate]],
        ),
        (
            2,
            [&[Shard(0)][..], &[Shard(0)], &[Replicate]],
            [&[Shard(1)][..], &[Replicate], &[Shard(0)]],
        ),
        (
            2,
            [&[Replicate][..], &[Shard(0)], &[Shard(1)]],
            [&[Shard(0)][..], &[Shard(0)], &[Replicate]],
        ),
    ] {
        let path = dir.file(&format!("w{world}.safetensors"));
        launch(world, {
            let path = path.clone();
            move |ctx| {
                let mesh = DeviceMesh::new(ctx.into_comm(), &[world])?;
                let params: Vec<Param> = sample()
                    .into_iter()
                    .zip(save_pl)
                    .map(|((n, t), pl)| Ok(Param::named(n, distribute_tensor(&t, &mesh, pl)?)))
                    .collect::<Result<_>>()?;
                let before = mesh.stats().total_calls();
                save_state_dict_full(&params, &path)?;
                assert!(mesh.stats().total_calls() > before || world == 1);
                // No barrier needed: the file is in place when save returns.
                let loaded = zeros_like_sample(&mesh, &load_pl)?;
                let before = mesh.stats();
                load_state_dict(&loaded, &path)?;
                // Rank 0 reads: one all-gather agrees on its verdict, one
                // all-to-all per tensor hands every rank its piece, and one
                // more all-gather agrees that every piece arrived.
                let calls = mesh.stats() - before;
                assert_eq!(calls.calls(tessera_mesh::OpKind::AllGather), 2);
                assert_eq!(calls.calls(tessera_mesh::OpKind::Broadcast), 0);
                assert_eq!(calls.calls(tessera_mesh::OpKind::AllToAll), loaded.len() as u64);
                for ((p, (name, t)), pl) in loaded.iter().zip(sample()).zip(load_pl) {
                    assert_eq!(p.name(), name);
                    assert_eq!(p.value()?.placements(), pl);
                    assert_eq!(p.value()?.full_tensor()?, t, "{name}");
                    // The local piece owns its storage: no view of the file's full tensor.
                    let local = p.value()?.to_local().clone();
                    assert!(local.numel() == t.numel() || local.size_in_bytes() < t.size_in_bytes());
                }
                Ok(())
            }
        })
        .unwrap();
        let mut got = read_safetensors(&path).unwrap();
        got.sort_by(|a, b| a.0.cmp(&b.0));
        let mut want = sample();
        want.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(got, want, "world {world}");
    }
    // One file per save, no temporary left behind.
    assert_eq!(dir.entries(), vec!["w1.safetensors", "w2.safetensors"]);
}

#[test]
fn mismatches_are_listed_and_change_nothing() {
    let dir = TmpDir::new("errors");
    let path = dir.file("m.safetensors");
    let s = sample();
    // The file lacks "h" and has an extra "extra".
    let mut file = vec![
        s[0].clone(),
        s[1].clone(),
        ("extra".to_string(), Tensor::zeros(&[1], DType::F32).unwrap()),
    ];
    write_safetensors(&path, &file).unwrap();
    let p = path.display().to_string();
    launch(1, {
        let path = path.clone();
        move |ctx| {
            let mesh = DeviceMesh::new(ctx.into_comm(), &[1])?;
            let params = zeros_like_sample(&mesh, &[&[Replicate], &[Replicate], &[Replicate]])?;
            let err = err_of(load_state_dict(&params, &path));
            assert!(err.contains(&p), "{err}");
            assert!(err.contains("missing tensors [\"h\"]"), "{err}");
            assert!(err.contains("unexpected tensors [\"extra\"]"), "{err}");
            assert!(params.iter().all(|p| {
                p.value()
                    .is_ok_and(|v| v.to_local().to_f64_vec().iter().all(|&x| x == 0.0))
            }));
            Ok(())
        }
    })
    .unwrap();

    // Right names, wrong shapes and an integer tensor for a float parameter.
    file = vec![
        (s[0].0.clone(), Tensor::zeros(&[3, 5], DType::F32).unwrap()),
        (s[1].0.clone(), Tensor::zeros(&[7], DType::I64).unwrap()),
        s[2].clone(),
    ];
    write_safetensors(&path, &file).unwrap();
    launch(1, move |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), &[1])?;
        let params = zeros_like_sample(&mesh, &[&[Replicate], &[Replicate], &[Replicate]])?;
        let err = err_of(load_state_dict(&params, &path));
        assert!(
            err.contains("w: shape mismatch, the parameter is [5, 3] but the file holds [3, 5]"),
            "{err}"
        );
        assert!(
            err.contains("layers.0.b: dtype I64 in the file cannot be converted to the parameter's f64"),
            "{err}"
        );
        assert!(
            params[2].value()?.to_local().to_f64_vec().iter().all(|&x| x == 0.0),
            "h loaded anyway"
        );
        // Two parameters with one name.
        let dup = vec![params[0].clone(), params[0].clone()];
        assert!(err_of(load_state_dict(&dup, &path)).contains("two tensors are named \"w\""));
        Ok(())
    })
    .unwrap();
}

#[test]
fn truncated_missing_and_garbage_files_name_the_path() {
    let dir = TmpDir::new("corrupt");
    let path = dir.file("t.safetensors");
    write_safetensors(&path, &sample()).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    for (case, content) in [
        ("truncated data", bytes[..bytes.len() - 3].to_vec()),
        ("truncated header", bytes[..20].to_vec()),
        ("empty", Vec::new()),
        ("garbage", b"not a safetensors file at all".to_vec()),
    ] {
        std::fs::write(&path, &content).unwrap();
        let err = read_safetensors(&path).unwrap_err().to_string();
        assert!(err.contains(&path.display().to_string()), "{case}: {err}");
        assert!(err.contains("not a valid safetensors file"), "{case}: {err}");
        let err = launch(1, {
            let path = path.clone();
            move |ctx| {
                let mesh = DeviceMesh::new(ctx.into_comm(), &[1])?;
                let params = zeros_like_sample(&mesh, &[&[Replicate], &[Replicate], &[Replicate]])?;
                Ok(err_of(load_state_dict(&params, &path)))
            }
        })
        .unwrap()
        .remove(0);
        assert!(err.contains("may be truncated or corrupt"), "{case}: {err}");
    }
    let err = read_safetensors(dir.file("nope.safetensors")).unwrap_err().to_string();
    assert!(err.contains("nope.safetensors: cannot read"), "{err}");
}

#[test]
fn failed_write_leaves_the_old_file() {
    let dir = TmpDir::new("atomic");
    let path = dir.file("keep.safetensors");
    write_safetensors(&path, &sample()).unwrap();
    // A file in a directory that does not exist: an error naming it, nothing written.
    let err = write_safetensors(dir.file("no/such/dir.safetensors"), &sample())
        .unwrap_err()
        .to_string();
    assert!(err.contains("cannot create"), "{err}");
    // Overwriting replaces the file whole.
    let other = vec![("only".to_string(), Tensor::ones(&[2], DType::F32).unwrap())];
    write_safetensors(&path, &other).unwrap();
    assert_eq!(read_safetensors(&path).unwrap(), other);
    assert_eq!(dir.entries(), vec!["keep.safetensors"]);
    // An uncommitted file removes its temporary on drop.
    let mut f = AtomicFile::create(&path).unwrap();
    f.write(b"partial").unwrap();
    drop(f);
    assert_eq!(dir.entries(), vec!["keep.safetensors"]);
    assert_eq!(read_safetensors(&path).unwrap(), other);
}

#[test]
fn a_failed_save_fails_on_every_rank() {
    let dir = TmpDir::new("save-fails");
    let path = dir.file("missing-dir/x.safetensors");
    let errs = launch(2, move |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), &[2])?;
        let w = Param::named(
            "w",
            distribute_tensor(&Tensor::ones(&[4], DType::F32)?, &mesh, &[Shard(0)])?,
        );
        Ok(err_of(save_state_dict_full(&[w], &path)))
    })
    .unwrap();
    assert!(errs[0].contains("cannot create"), "{}", errs[0]);
    assert!(
        errs[1].contains("the writing rank (rank 0 of DeviceMesh([2]"),
        "{}",
        errs[1]
    );
    assert!(errs.iter().all(|e| e.contains("missing-dir")));
    assert!(dir.entries().is_empty());
}

#[test]
fn half_and_double_files_load_into_f32() {
    let dir = TmpDir::new("dtypes");
    let path = dir.file("h.safetensors");
    let full = Tensor::randn(&[4, 2], DType::F32, 9).unwrap();
    for dtype in [DType::BF16, DType::F16, DType::F64] {
        let stored = full.cast(dtype).unwrap();
        write_safetensors(&path, &[("w".into(), stored.clone())]).unwrap();
        launch(2, {
            let path = path.clone();
            move |ctx| {
                let mesh = DeviceMesh::new(ctx.into_comm(), &[2])?;
                let w = Param::named(
                    "w",
                    distribute_tensor(&Tensor::zeros(&[4, 2], DType::F32)?, &mesh, &[Shard(0)])?,
                );
                load_state_dict(std::slice::from_ref(&w), &path)?;
                assert_eq!(w.value()?.dtype(), DType::F32);
                assert_eq!(w.value()?.full_tensor()?, stored.cast(DType::F32)?, "{dtype}");
                Ok(())
            }
        })
        .unwrap();
    }
}

/// The tiny model's parameters, as the reference README lists them.
fn tiny_names_and_shapes() -> Vec<(String, Vec<usize>)> {
    let (dim, vocab, seq) = (64, 256, 32);
    let mut v = vec![
        ("tok_embeddings.weight".to_string(), vec![vocab, dim]),
        ("pos_embeddings.weight".to_string(), vec![seq, dim]),
    ];
    for i in 0..2 {
        let l = |s: &str| format!("layers.{i}.{s}");
        v.push((l("attention_norm.weight"), vec![dim]));
        v.push((l("attention_norm.bias"), vec![dim]));
        for w in ["wq", "wk", "wv", "wo"] {
            v.push((l(&format!("attention.{w}.weight")), vec![dim, dim]));
        }
        v.push((l("ffn_norm.weight"), vec![dim]));
        v.push((l("ffn_norm.bias"), vec![dim]));
        v.push((l("feed_forward.w1.weight"), vec![4 * dim, dim]));
        v.push((l("feed_forward.w1.bias"), vec![4 * dim]));
        v.push((l("feed_forward.w2.weight"), vec![dim, 4 * dim]));
        v.push((l("feed_forward.w2.bias"), vec![dim]));
    }
    v.push(("norm.weight".to_string(), vec![dim]));
    v.push(("norm.bias".to_string(), vec![dim]));
    v.push(("output.weight".to_string(), vec![vocab, dim]));
    v
}

#[test]
fn reference_files_load() {
    let want = tiny_names_and_shapes();
    assert_eq!(want.len(), 29);
    for file in ["tiny_init.safetensors", "tiny_single_G8.final.safetensors"] {
        let got = read_safetensors(data(file)).unwrap();
        let mut names: Vec<(String, Vec<usize>)> = got.iter().map(|(n, t)| (n.clone(), t.shape().to_vec())).collect();
        names.sort();
        let mut w = want.clone();
        w.sort();
        assert_eq!(names, w, "{file}");
        assert!(got.iter().all(|(_, t)| t.dtype() == DType::F32));
        // LayerNorm starts at weight 1, bias 0 (PyTorch's init); a sanity check of the bytes.
        if file == "tiny_init.safetensors" {
            let norm = &got.iter().find(|(n, _)| n == "norm.weight").unwrap().1;
            assert!(norm.to_f64_vec().iter().all(|&x| x == 1.0));
        }
    }
    // Loaded into Shard(0) parameters on 2 ranks, every piece is the file's.
    let path = data("tiny_init.safetensors");
    let full = read_safetensors(&path).unwrap();
    launch(2, move |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), &[2])?;
        let params: Vec<Param> = want
            .iter()
            .map(|(n, s)| {
                Ok(Param::named(
                    n.clone(),
                    distribute_tensor(&Tensor::zeros(s, DType::F32)?, &mesh, &[Shard(0)])?,
                ))
            })
            .collect::<Result<_>>()?;
        load_state_dict(&params, &path)?;
        for p in &params {
            let t = &full.iter().find(|(n, _)| *n == p.name()).unwrap().1;
            assert_eq!(&p.value()?.full_tensor()?, t, "{}", p.name());
        }
        Ok(())
    })
    .unwrap();

    let tokens = read_safetensors(data("tiny_tokens_G16.safetensors")).unwrap();
    assert_eq!(tokens.len(), 1);
    assert_eq!(tokens[0].0, "tokens");
    assert_eq!(
        (tokens[0].1.dtype(), tokens[0].1.shape()),
        (DType::I64, &[20, 16, 33][..])
    );
    assert!(
        tokens[0]
            .1
            .to_vec::<i64>()
            .unwrap()
            .iter()
            .all(|&t| (0..256).contains(&t))
    );

    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(data("tiny_reference.json")).unwrap()).unwrap();
    let losses = json["runs"]["single_G8"]["loss"].as_array().unwrap();
    assert_eq!(losses.len(), 20);
}
