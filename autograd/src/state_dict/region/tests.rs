//! Tests of reading regions: values bit for bit against slices of the full
//! tensors, bytes and read calls against the region's, every error named.

use std::sync::Arc;

use safetensors::tensor::Dtype;
use serde_json::json;
use tessera_dtensor::{Placement, Placement::*, ReduceOp, ShardOrder, distribute_tensor, distribute_tensor_with_order};
use tessera_mesh::launch;

use super::super::tests::{TmpDir, io_counter};
use super::super::{read_safetensors, write_safetensors};
use super::*;

/// SplitMix64: a small deterministic generator for random cases.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Shape, dtype and bytes of `t`: equal only when bit for bit equal.
fn bits(t: &Tensor) -> (Vec<usize>, DType, Vec<u8>) {
    (
        t.shape().to_vec(),
        t.dtype(),
        t.to_buffer().as_buf().as_bytes().to_vec(),
    )
}

/// The region `[offset, offset + shape)` of `full`, contiguous.
fn slice(full: &Tensor, offset: &[usize], shape: &[usize]) -> Tensor {
    let mut t = full.clone();
    for (d, (&o, &n)) in offset.iter().zip(shape).enumerate() {
        t = t.narrow(d, o, n).unwrap();
    }
    t.contiguous()
}

/// Writes a safetensors file by hand: (name, dtype name, shape, data offsets)
/// in the header, then `data`.
fn write_raw(path: &Path, tensors: &[(&str, &str, &[usize], [usize; 2])], data: &[u8]) {
    let mut header = serde_json::Map::new();
    for (name, dtype, shape, offsets) in tensors {
        header.insert(
            name.to_string(),
            json!({"dtype": dtype, "shape": shape, "data_offsets": offsets}),
        );
    }
    let text = serde_json::to_vec(&header).unwrap();
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&text);
    out.extend_from_slice(data);
    std::fs::write(path, out).unwrap();
}

/// The error of `r` as text, checked to name `path`.
fn err_of<T: std::fmt::Debug>(r: Result<T>, path: &Path) -> String {
    let err = r.unwrap_err().to_string();
    assert!(
        err.contains(&path.display().to_string()),
        "{err} does not name the file"
    );
    err
}

#[test]
fn regions_are_the_slices_of_the_full_tensors() {
    const DTYPES: [DType; 3] = [DType::F32, DType::BF16, DType::F64];
    let dir = TmpDir::new("region-values");
    let mut rng = Rng(7);
    for case in 0..40 {
        let path = dir.file(&format!("{case}.safetensors"));
        // Three tensors of rank 1–3, 0–6 elements a dim, each of a random dtype.
        let tensors: Vec<(String, Tensor)> = (0..3)
            .map(|i| {
                let shape: Vec<usize> = (0..1 + rng.below(3)).map(|_| rng.below(7)).collect();
                let t = Tensor::randn(&shape, DType::F64, rng.next()).unwrap();
                (format!("t{i}"), t.cast(DTYPES[rng.below(3)]).unwrap())
            })
            .collect();
        write_safetensors(&path, &tensors).unwrap();
        let reader = SafetensorsReader::open(&path).unwrap();
        let mut in_file: Vec<String> = read_safetensors(&path).unwrap().into_iter().map(|(n, _)| n).collect();
        let mut names: Vec<&str> = reader.names().collect();
        in_file.sort();
        names.sort();
        assert_eq!(names, in_file, "case {case}");
        for (name, t) in &tensors {
            assert_eq!(reader.info(name).unwrap(), (t.dtype(), t.shape()));
            for _ in 0..4 {
                let offset: Vec<usize> = t.shape().iter().map(|&n| rng.below(n + 1)).collect();
                let shape: Vec<usize> = t
                    .shape()
                    .iter()
                    .zip(&offset)
                    .map(|(&n, &o)| rng.below(n - o + 1))
                    .collect();
                let dtype = DTYPES[rng.below(3)];
                let got = reader.read_region(name, &offset, &shape, dtype).unwrap();
                assert_eq!(
                    bits(&got),
                    bits(&slice(t, &offset, &shape).cast(dtype).unwrap()),
                    "case {case}: {name} {:?} {} at {offset:?} of {shape:?} as {dtype}",
                    t.shape(),
                    t.dtype()
                );
            }
            let whole = reader
                .read_region(name, &vec![0; t.shape().len()], t.shape(), t.dtype())
                .unwrap();
            assert_eq!(bits(&whole), bits(t), "case {case}: {name} whole");
        }
    }
}

#[test]
fn scalars_and_integer_files_convert_as_load_state_dict_does() {
    let dir = TmpDir::new("region-ints");
    let path = dir.file("ints.safetensors");
    // As PyTorch writes them: I32, BOOL, a U64 that fits, and a scalar F16.
    let i32s: Vec<u8> = (-3i32..3).flat_map(i32::to_le_bytes).collect();
    let data = [
        i32s,
        vec![1, 0, 1],
        7u64.to_le_bytes().to_vec(),
        half::f16::from_f32(2.5).to_le_bytes().to_vec(),
    ]
    .concat();
    write_raw(
        &path,
        &[
            ("i", "I32", &[2, 3], [0, 24]),
            ("mask", "BOOL", &[3], [24, 27]),
            ("n", "U64", &[1], [27, 35]),
            ("s", "F16", &[], [35, 37]),
        ],
        &data,
    );
    let reader = SafetensorsReader::open(&path).unwrap();
    assert_eq!(reader.names().collect::<Vec<_>>(), ["i", "mask", "n", "s"]);
    macro_rules! case {
        ($name:expr, $off:expr, $shape:expr, $dtype:expr, $want:expr) => {
            let got = reader.read_region($name, &$off, &$shape, $dtype).unwrap();
            assert_eq!((got.dtype(), got.shape()), ($dtype, &$shape[..]), "{}", $name);
            assert_eq!(got.to_f64_vec(), $want, "{}", $name);
        };
    }
    case!("i", [0, 1], [2, 2], DType::I64, [-2.0, -1.0, 1.0, 2.0]);
    case!("i", [1, 0], [1, 3], DType::U8, [0.0, 1.0, 2.0]);
    case!("mask", [1], [2], DType::U8, [0.0, 1.0]);
    case!("n", [0], [1], DType::I64, [7.0]);
    case!("s", [], [], DType::F32, [2.5]);
    case!("s", [], [], DType::BF16, [2.5]);
    assert_eq!(reader.info("i").unwrap(), (DType::I64, &[2, 3][..]));
    assert_eq!(reader.info("mask").unwrap(), (DType::U8, &[3][..]));
    assert_eq!(reader.info("s").unwrap(), (DType::F16, &[][..]));
}

#[test]
fn decoded_dtype_is_what_decode_gives() {
    for dtype in [
        Dtype::BOOL,
        Dtype::U8,
        Dtype::I8,
        Dtype::I16,
        Dtype::U16,
        Dtype::I32,
        Dtype::U32,
        Dtype::I64,
        Dtype::U64,
        Dtype::F16,
        Dtype::BF16,
        Dtype::F32,
        Dtype::F64,
        Dtype::F8_E4M3,
        Dtype::F8_E5M2,
    ] {
        let bytes = vec![0u8; 2 * dtype.size()];
        let view = TensorView::new(dtype, vec![2], &bytes).unwrap();
        let decoded = decode(Path::new("x"), "t", &view).ok().map(|t| t.dtype());
        assert_eq!(decoded_dtype(dtype), decoded, "{dtype:?}");
    }
}

#[test]
fn only_the_regions_bytes_are_read() {
    let dir = TmpDir::new("region-bytes");
    let path = dir.file("big.safetensors");
    let w = Tensor::randn(&[64, 48, 32], DType::F32, 1).unwrap();
    write_safetensors(
        &path,
        &[
            ("w".into(), w.clone()),
            ("b".into(), Tensor::zeros(&[100], DType::F32).unwrap()),
        ],
    )
    .unwrap();
    let reader = SafetensorsReader::open(&path).unwrap();
    // (offset, shape, runs): whole trailing dims merge into one run.
    for (offset, shape, runs) in [
        ([8, 5, 0], [16, 12, 32], 16),
        ([8, 0, 0], [16, 48, 32], 1),
        ([0, 0, 3], [64, 48, 5], 64 * 48),
        ([63, 47, 31], [1, 1, 1], 1),
        ([10, 0, 0], [0, 48, 32], 0),
        ([0, 0, 0], [64, 48, 32], 1),
    ] {
        let bytes = shape.iter().product::<usize>() as u64 * 4;
        let counted = reader.bytes_read();
        let (rchar, syscr) = (io_counter("rchar"), io_counter("syscr"));
        let got = reader.read_region("w", &offset, &shape, DType::F32).unwrap();
        let (rchar_after, syscr_after) = (io_counter("rchar"), io_counter("syscr"));
        let case = format!("{shape:?} at {offset:?}");
        assert_eq!(reader.bytes_read() - counted, bytes, "{case}");
        // What the system saw: the region's bytes, one read call per run (and
        // reading the counters: one call of a few hundred bytes).
        if let (Some(a), Some(b)) = (rchar, rchar_after) {
            assert!((bytes..bytes + 4096).contains(&(b - a)), "{case}: {} bytes read", b - a);
        }
        if let (Some(a), Some(b)) = (syscr, syscr_after) {
            assert!(
                (runs..=runs + 2).contains(&(b - a)),
                "{case}: {} read calls for {runs} runs",
                b - a
            );
        }
        assert_eq!(bits(&got), bits(&slice(&w, &offset, &shape)), "{case}");
    }
}

/// Every shard, on meshes of one and two dims with uneven and empty shards,
/// is the full tensor's slice, converted, and its rank read only its bytes.
#[test]
fn shards_load_on_any_mesh_reading_only_their_bytes() {
    let dir = TmpDir::new("region-load");
    let path = dir.file("m.safetensors");
    let full = Tensor::randn(&[5, 7], DType::F64, 3)
        .unwrap()
        .cast(DType::BF16)
        .unwrap();
    let bias = Tensor::randn(&[9], DType::F32, 4).unwrap();
    write_safetensors(&path, &[("w".into(), full.clone()), ("b".into(), bias.clone())]).unwrap();
    let shared = Arc::new(SafetensorsReader::open(&path).unwrap());
    let p00 = [Shard(0), Shard(0)];
    let cases: Vec<(Vec<usize>, Vec<Placement>, ShardOrder)> = vec![
        (vec![1], vec![Replicate], ShardOrder::default_for(&[Replicate])),
        (vec![4], vec![Shard(0)], ShardOrder::default_for(&[Shard(0)])),
        (
            vec![2, 2],
            vec![Shard(0), Shard(1)],
            ShardOrder::default_for(&[Shard(0), Shard(1)]),
        ),
        (
            vec![2, 2],
            vec![Shard(1), Shard(1)],
            ShardOrder::default_for(&[Shard(1), Shard(1)]),
        ),
        (
            vec![2, 3],
            vec![Replicate, Shard(1)],
            ShardOrder::default_for(&[Replicate, Shard(1)]),
        ),
        (vec![2, 2], p00.to_vec(), ShardOrder::reversed_for(&p00)),
    ];
    for (mesh_shape, placements, order) in cases {
        let (path, full, bias, shared) = (path.clone(), full.clone(), bias.clone(), shared.clone());
        launch(mesh_shape.iter().product(), move |ctx| {
            let mesh = DeviceMesh::new(ctx.into_comm(), &mesh_shape)?;
            let case = format!("{placements:?} on {mesh_shape:?}, rank {}", mesh.comm().rank());
            let reader = SafetensorsReader::open(&path)?;
            let layout = Layout::with_order(mesh.shape(), &placements, order.clone(), &[5, 7], DType::F32)?;
            let w = reader.load("w", &mesh, layout)?;
            let want = distribute_tensor_with_order(&full.cast(DType::F32)?, &mesh, &placements, order.clone())?;
            assert_eq!(bits(w.to_local()), bits(want.to_local()), "{case}");
            assert_eq!(w.layout(), want.layout(), "{case}");
            assert_eq!(
                reader.bytes_read(),
                w.to_local().numel() as u64 * 2,
                "{case}: BF16 bytes"
            );
            // One reader shared by every rank's thread.
            let first = placements[0].shard_dim().map_or(Replicate, |_| Shard(0));
            let layout = Layout::new(mesh.shape(), &vec![first; mesh.ndim()], &[9], DType::F64)?;
            let b = shared.load("b", &mesh, layout)?;
            assert_eq!(b.full_tensor()?, bias.cast(DType::F64)?, "{case}");
            Ok(())
        })
        .unwrap();
    }
}

/// A file PyTorch wrote (`safetensors.torch.save_file`), every tensor split
/// over a 2×2 mesh.
#[test]
fn pytorch_files_load_shard_by_shard() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/data/tiny_init.safetensors");
    let full = read_safetensors(&path).unwrap();
    launch(4, move |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), &[2, 2])?;
        let reader = SafetensorsReader::open(&path)?;
        let mut local_bytes = 0;
        for (name, t) in &full {
            let layout = Layout::new(mesh.shape(), &[Shard(0), Shard(0)], t.shape(), DType::F32)?;
            let got = reader.load(name, &mesh, layout)?;
            let want = distribute_tensor(t, &mesh, &[Shard(0), Shard(0)])?;
            assert_eq!(bits(got.to_local()), bits(want.to_local()), "{name}");
            local_bytes += got.to_local().numel() as u64 * 4;
        }
        assert_eq!(reader.bytes_read(), local_bytes);
        Ok(())
    })
    .unwrap();
}

#[test]
fn errors_name_the_file_and_the_tensor() {
    let dir = TmpDir::new("region-errors");
    let path = dir.file("e.safetensors");
    write_safetensors(
        &path,
        &[
            ("w".into(), Tensor::zeros(&[4, 3], DType::F32).unwrap()),
            ("step".into(), Tensor::from_vec(vec![3i64], &[]).unwrap()),
        ],
    )
    .unwrap();
    let reader = SafetensorsReader::open(&path).unwrap();
    macro_rules! case {
        ($r:expr, $($needle:expr),+) => {
            let err = err_of($r, &path);
            $(assert!(err.contains($needle), "{err} lacks {:?}", $needle);)+
        };
    }
    case!(
        reader.read_region("v", &[0], &[1], DType::F32),
        "tensor \"v\": no such tensor (the file holds 2 tensors, e.g. [\"step\", \"w\"])"
    );
    case!(reader.info("v"), "tensor \"v\": no such tensor");
    case!(
        reader.read_region("w", &[0], &[1], DType::F32),
        "tensor \"w\": the region at offset [0] of shape [1] does not lie inside the tensor's shape [4, 3]"
    );
    case!(
        reader.read_region("w", &[3, 0], &[2, 3], DType::F32),
        "offset [3, 0] of shape [2, 3] does not lie inside"
    );
    case!(
        reader.read_region("w", &[0, usize::MAX], &[1, 2], DType::F32),
        "does not lie inside"
    );
    case!(
        reader.read_region("w", &[0, 0], &[1, 1], DType::I64),
        "tensor \"w\": dtype F32 in the file cannot be converted to the parameter's i64"
    );
    case!(
        reader.read_region("step", &[], &[], DType::F32),
        "tensor \"step\": dtype I64 in the file cannot be converted"
    );
    let errs = launch(1, move |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), &[1])?;
        let wrong = Layout::new(&[1], &[Shard(0)], &[3, 4], DType::F32)?;
        let partial = Layout::new(&[1], &[Partial(ReduceOp::Sum)], &[4, 3], DType::F32)?;
        Ok([
            reader.load("w", &mesh, wrong).map(|_| ()),
            reader.load("w", &mesh, partial).map(|_| ()),
            reader
                .load("v", &mesh, Layout::new(&[1], &[Replicate], &[1], DType::F32)?)
                .map(|_| ()),
        ])
    })
    .unwrap()
    .remove(0);
    let [wrong, partial, missing] = errs;
    case!(
        wrong,
        "tensor \"w\": shape mismatch, the file holds [4, 3] but the layout is of [3, 4]"
    );
    case!(partial, "tensor \"w\": load into Shard or Replicate placements, not");
    case!(missing, "tensor \"v\": no such tensor");
}

#[test]
fn corrupt_and_truncated_files_are_errors() {
    let dir = TmpDir::new("region-corrupt");
    let path = dir.file("c.safetensors");
    macro_rules! open_fails {
        ($($needle:expr),+) => {
            let err = err_of(SafetensorsReader::open(&path), &path);
            $(assert!(err.contains($needle), "{err} lacks {:?}", $needle);)+
        };
    }
    let good = Tensor::randn(&[6, 5], DType::F32, 9).unwrap();
    write_safetensors(&path, &[("w".into(), good)]).unwrap();
    let whole = std::fs::read(&path).unwrap();

    // Cut short before opening: the open says so.
    std::fs::write(&path, &whole[..whole.len() - 4]).unwrap();
    open_fails!(
        "not a valid safetensors file",
        "truncated: tensor \"w\" needs bytes 0..120"
    );
    // Cut short after opening: the read says so.
    std::fs::write(&path, &whole).unwrap();
    let reader = SafetensorsReader::open(&path).unwrap();
    std::fs::File::options()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(whole.len() as u64 - 40)
        .unwrap();
    assert_eq!(
        reader.read_region("w", &[0, 0], &[2, 5], DType::F32).unwrap().shape(),
        [2, 5]
    );
    let err = err_of(reader.read_region("w", &[4, 0], &[2, 5], DType::F32), &path);
    assert!(err.contains("truncated: tensor \"w\" is cut off"), "{err}");

    // Headers whose spans do not fit their tensors.
    write_raw(&path, &[("a", "F32", &[2], [0, 12])], &[0; 12]);
    open_fails!("tensor \"a\" is F32 of shape [2], 8 bytes, but its header gives it bytes 0..12");
    write_raw(
        &path,
        &[("a", "F32", &[2], [0, 8]), ("b", "F32", &[2], [12, 20])],
        &[0; 20],
    );
    open_fails!("tensor \"b\" starts at byte 12 of the data section, where the tensors before it end at 8");
    write_raw(
        &path,
        &[("a", "F32", &[2], [0, 8]), ("b", "F32", &[2], [4, 12])],
        &[0; 12],
    );
    open_fails!("tensor \"b\" starts at byte 4");
    write_raw(&path, &[("a", "F32", &[1 << 40, 1 << 40], [0, 8])], &[0; 8]);
    open_fails!("more than usize::MAX bytes");

    // Dtypes Tessera cannot hold, or values it cannot: errors naming the tensor.
    write_raw(
        &path,
        &[("f8", "F8_E4M3", &[2], [0, 2]), ("big", "U64", &[1], [2, 10])],
        &[[0u8; 2].as_slice(), &u64::MAX.to_le_bytes()].concat(),
    );
    let reader = SafetensorsReader::open(&path).unwrap();
    let err = err_of(reader.info("f8"), &path);
    assert!(
        err.contains("tensor \"f8\": dtype F8_E4M3, which Tessera cannot hold"),
        "{err}"
    );
    let err = err_of(reader.read_region("f8", &[0], &[2], DType::F32), &path);
    assert!(err.contains("tensor \"f8\""), "{err}");
    let err = err_of(reader.read_region("big", &[0], &[1], DType::I64), &path);
    assert!(err.contains("tensor big is U64 with values beyond i64::MAX"), "{err}");

    // Random damage to the prefix and header: errors or other values, never a panic.
    let mut rng = Rng(11);
    let header_end = 8 + u64::from_le_bytes(whole[..8].try_into().unwrap()) as usize;
    let mut opened = 0;
    for _ in 0..300 {
        let mut bytes = whole.clone();
        for _ in 0..1 + rng.below(3) {
            let at = rng.below(header_end);
            bytes[at] = rng.next() as u8;
        }
        std::fs::write(&path, &bytes).unwrap();
        let Ok(reader) = SafetensorsReader::open(&path) else {
            continue;
        };
        opened += 1;
        let names: Vec<String> = reader.names().map(str::to_string).collect();
        for name in names {
            if let Ok((dtype, shape)) = reader.info(&name) {
                let shape = shape.to_vec();
                let _ = reader.read_region(&name, &vec![0; shape.len()], &shape, dtype);
            }
        }
    }
    assert!(opened < 300, "some damage must be caught");
}

#[test]
fn readers_can_be_shared_between_threads() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<SafetensorsReader>();
}
