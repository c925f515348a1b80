//! Device tensors against the host kernels, on a real GPU.
//!
//! Every test needs a CUDA GPU, so each is ignored in a plain `cargo test`;
//! `scripts/gpu-check.sh` runs them with `--ignored` on a GPU machine. Each
//! compares the device op with the same op on the host, on fresh random data.

use tessera_mesh::{ReduceOp, launch};
use tessera_tensor::cuda::{self, comm::DeviceCollectives};
use tessera_tensor::ops::Reduction;
use tessera_tensor::{DType, Device, Error, Tensor};

const GPU: Device = Device::Cuda(0);
const NEEDS_GPU: &str = "needs a CUDA GPU";

fn rand(shape: &[usize], dtype: DType, seed: u64) -> Tensor {
    Tensor::randn(shape, DType::F32, seed).unwrap().cast(dtype).unwrap()
}

fn gpu(t: &Tensor) -> Tensor {
    t.to(GPU).unwrap()
}

fn host(t: &Tensor) -> Tensor {
    assert_eq!(t.device(), GPU, "the op's result must stay on the GPU");
    t.to(Device::Cpu).unwrap()
}

/// ‖a − b‖ / ‖b‖ over f64 copies (0 for two zero tensors); NaN never passes.
fn rel_err(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.shape(), b.shape());
    let (x, y) = (a.to_f64_vec(), b.to_f64_vec());
    assert!(
        x.iter().all(|v| v.is_finite()) || x.iter().zip(&y).all(|(a, b)| a.is_nan() == b.is_nan()),
        "NaN in the device result"
    );
    let num: f64 = x.iter().zip(&y).map(|(a, b)| (a - b).powi(2)).sum();
    let den: f64 = y.iter().map(|b| b * b).sum();
    if den == 0.0 { num.sqrt() } else { (num / den).sqrt() }
}

fn tol(dtype: DType) -> f64 {
    if dtype == DType::BF16 { 1e-2 } else { 1e-6 }
}

fn check(what: &str, device: &Tensor, want: &Tensor, dtype: DType) {
    let e = rel_err(&host(device), want);
    println!("check {what:<40} {dtype:<5} rel_err {e:.2e}");
    assert!(
        e <= tol(dtype),
        "{what} ({dtype}): relative error {e:.3e} over {:.0e}",
        tol(dtype)
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn round_trip_and_views() {
    let _ = NEEDS_GPU;
    assert!(cuda::is_available(), "no GPU: run this on a GPU machine");
    println!("device {}", cuda::device_name(0).unwrap());
    for dtype in [DType::F32, DType::BF16, DType::F64, DType::I64, DType::U8] {
        let t = Tensor::arange(24, dtype).unwrap().reshape(&[2, 3, 4]).unwrap();
        let d = gpu(&t);
        assert_eq!((d.device(), d.shape(), d.dtype()), (GPU, t.shape(), dtype));
        assert_eq!(host(&d), t, "{dtype} round trip");
        // Views stay on the device and copy through the strided kernel.
        let v = d.transpose(0, 2).unwrap().narrow(1, 1, 2).unwrap();
        assert_eq!(
            host(&v.contiguous()),
            t.transpose(0, 2).unwrap().narrow(1, 1, 2).unwrap().contiguous()
        );
        assert_eq!(
            host(&Tensor::cat(&[d.clone(), d.clone()], 1).unwrap()),
            Tensor::cat(&[t.clone(), t.clone()], 1).unwrap()
        );
    }
    // Host readers that cannot fail copy from the device; slices are refused.
    let d = gpu(&Tensor::arange(4, DType::F32).unwrap());
    assert_eq!(d.to_vec::<f32>().unwrap(), vec![0.0, 1.0, 2.0, 3.0]);
    assert!(matches!(d.as_slice::<f32>(), Err(Error::Device { .. })));
    let e = d.add(&Tensor::ones(&[4], DType::F32).unwrap()).unwrap_err().to_string();
    assert!(e.contains("cuda:0") && e.contains("cpu"), "{e}");
}

/// Copies of views whose rows are dense (heads of a `[batch, tokens, heads,
/// size]` tensor, in words of 16 bytes down to one element) and of views
/// whose rows are not, every dtype: equal to the host's bit for bit.
#[test]
#[ignore = "needs a CUDA GPU"]
fn copies_of_views() {
    for dtype in [DType::F32, DType::BF16, DType::F64, DType::I64, DType::U8] {
        for size in [64, 8, 6, 5, 3] {
            let t = Tensor::arange(2 * 7 * 3 * size, DType::I64)
                .unwrap()
                .cast(dtype)
                .unwrap()
                .reshape(&[2, 7, 3, size])
                .unwrap();
            let d = gpu(&t);
            let heads = |x: &Tensor| x.permute(&[0, 2, 1, 3]).unwrap();
            assert_eq!(
                host(&heads(&d).contiguous()),
                heads(&t).contiguous(),
                "{dtype} heads of {size}"
            );
            // Rows starting at odd elements: narrower words or the element kernel.
            let cut = |x: &Tensor| x.narrow(3, 1, size - 1).unwrap().permute(&[1, 0, 2, 3]).unwrap();
            assert_eq!(
                host(&cut(&d).contiguous()),
                cut(&t).contiguous(),
                "{dtype} cut rows of {size}"
            );
            let cols = |x: &Tensor| x.transpose(2, 3).unwrap();
            assert_eq!(
                host(&cols(&d).contiguous()),
                cols(&t).contiguous(),
                "{dtype} columns of {size}"
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn casts() {
    let x = rand(&[1000], DType::F32, 1).mul_scalar(100.0).unwrap();
    for (from, to) in [
        (DType::F32, DType::BF16),
        (DType::BF16, DType::F32),
        (DType::F64, DType::BF16),
        (DType::F32, DType::F64),
    ] {
        let src = x.cast(from).unwrap();
        assert_eq!(
            host(&gpu(&src).cast(to).unwrap()),
            src.cast(to).unwrap(),
            "{from} -> {to} bit for bit"
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn element_wise_and_reductions() {
    for dtype in [DType::F32, DType::BF16] {
        let (a, b) = (rand(&[64, 257], dtype, 2), rand(&[257], dtype, 3));
        let (da, db) = (gpu(&a), gpu(&b));
        let pos = a.abs().unwrap().add_scalar(0.5).unwrap();
        let dpos = gpu(&pos);
        check("add (broadcast)", &da.add(&db).unwrap(), &a.add(&b).unwrap(), dtype);
        check(
            "sub",
            &da.sub(&da.mul_scalar(0.3).unwrap()).unwrap(),
            &a.sub(&a.mul_scalar(0.3).unwrap()).unwrap(),
            dtype,
        );
        check(
            "mul (transposed view)",
            &da.transpose(0, 1)
                .unwrap()
                .mul(&db.reshape(&[257, 1]).unwrap())
                .unwrap(),
            &a.transpose(0, 1).unwrap().mul(&b.reshape(&[257, 1]).unwrap()).unwrap(),
            dtype,
        );
        check("div", &da.div(&dpos).unwrap(), &a.div(&pos).unwrap(), dtype);
        check("maximum", &da.maximum(&db).unwrap(), &a.maximum(&b).unwrap(), dtype);
        check("pow", &dpos.pow(1.7).unwrap(), &pos.pow(1.7).unwrap(), dtype);
        check("minimum", &da.minimum(&db).unwrap(), &a.minimum(&b).unwrap(), dtype);
        check(
            "clamp",
            &da.clamp(Some(-0.5), Some(0.5)).unwrap(),
            &a.clamp(Some(-0.5), Some(0.5)).unwrap(),
            dtype,
        );
        for (name, f) in [
            ("neg", Tensor::neg as fn(&Tensor) -> tessera_tensor::Result<Tensor>),
            ("exp", Tensor::exp),
            ("tanh", Tensor::tanh),
            ("gelu", Tensor::gelu),
            ("silu", Tensor::silu),
            ("relu", Tensor::relu),
            ("sigmoid", Tensor::sigmoid),
            ("square", Tensor::square),
        ] {
            check(name, &f(&da).unwrap(), &f(&a).unwrap(), dtype);
        }
        check("log", &dpos.log().unwrap(), &pos.log().unwrap(), dtype);
        check("rsqrt", &dpos.rsqrt().unwrap(), &pos.rsqrt().unwrap(), dtype);
        check(
            "gelu_backward",
            &da.gelu_backward(&gpu(&b.broadcast_to(&[64, 257]).unwrap().contiguous()))
                .unwrap(),
            &a.gelu_backward(&b.broadcast_to(&[64, 257]).unwrap().contiguous())
                .unwrap(),
            dtype,
        );
        // Column sums over leading dims: uneven column tiles and row counts.
        let big = rand(&[3, 1367, 333], dtype, 15);
        check(
            "sum dims 0,1 (columns)",
            &gpu(&big).sum(&[0, 1], false).unwrap(),
            &big.sum(&[0, 1], false).unwrap(),
            dtype,
        );
        check(
            "mean dim 0 keepdim (columns)",
            &gpu(&big).mean(&[0], true).unwrap(),
            &big.mean(&[0], true).unwrap(),
            dtype,
        );
        check(
            "sum dim 0",
            &da.sum(&[0], false).unwrap(),
            &a.sum(&[0], false).unwrap(),
            dtype,
        );
        check(
            "sum dim 1 keepdim",
            &da.sum(&[1], true).unwrap(),
            &a.sum(&[1], true).unwrap(),
            dtype,
        );
        check(
            "mean all",
            &da.mean(&[0, 1], false).unwrap(),
            &a.mean(&[0, 1], false).unwrap(),
            dtype,
        );
        check(
            "max dim 1",
            &da.max(&[1], false).unwrap(),
            &a.max(&[1], false).unwrap(),
            dtype,
        );
    }
}

/// What the LLaMA-style model adds: rotary embeddings (tables on the host or
/// the device) and their backward, key/value heads repeated and summed back,
/// SiLU.
#[test]
#[ignore = "needs a CUDA GPU"]
fn llama_ops() {
    let (cos, sin) = tessera_tensor::ops::rotary_tables(&[0, 1, 2, 5, 9], 8, 10000.0).unwrap();
    for dtype in [DType::F32, DType::BF16] {
        let x = rand(&[3, 5, 4, 8], dtype, 11);
        let want = x.rotary_embedding(&cos, &sin).unwrap();
        check(
            "rotary_embedding",
            &gpu(&x).rotary_embedding(&cos, &sin).unwrap(),
            &want,
            dtype,
        );
        check(
            "rotary_embedding, tables on the GPU",
            &gpu(&x).rotary_embedding(&gpu(&cos), &gpu(&sin)).unwrap(),
            &want,
            dtype,
        );
        check(
            "rotary_embedding_backward",
            &gpu(&x).rotary_embedding_backward(&cos, &sin).unwrap(),
            &x.rotary_embedding_backward(&cos, &sin).unwrap(),
            dtype,
        );
        check(
            "repeat_interleave dim 2",
            &gpu(&x).repeat_interleave(2, 2).unwrap(),
            &x.repeat_interleave(2, 2).unwrap(),
            dtype,
        );
        check(
            "repeat_interleave_backward dim 2",
            &gpu(&x).repeat_interleave_backward(2, 2).unwrap(),
            &x.repeat_interleave_backward(2, 2).unwrap(),
            dtype,
        );
        check("silu", &gpu(&x).silu().unwrap(), &x.silu().unwrap(), dtype);
    }
}

/// Rows as wide as the warp-per-row kernels take (1024) and one past them,
/// for the softmax family and the norms, forward and backward.
#[test]
#[ignore = "needs a CUDA GPU"]
fn row_kernels_at_their_widths() {
    for dtype in [DType::F32, DType::BF16] {
        for n in [512, 1000, 1024, 1025] {
            let x = rand(&[40, n], dtype, 21);
            let g = rand(&[40, n], dtype, 22);
            let w = rand(&[n], dtype, 23);
            let (dx, dg, dw) = (gpu(&x), gpu(&g), gpu(&w));
            let what = |op: &str| format!("{op} n={n}");
            check(&what("softmax"), &dx.softmax(1).unwrap(), &x.softmax(1).unwrap(), dtype);
            let scores = x.reshape(&[1, 40, n]).unwrap();
            let p = scores.attention_probs(0.125, true).unwrap();
            check(
                &what("attention_probs causal"),
                &gpu(&scores).attention_probs(0.125, true).unwrap(),
                &p,
                dtype,
            );
            check(
                &what("softmax_backward"),
                &dg.softmax_backward(&gpu(&x.softmax(1).unwrap()), 1).unwrap(),
                &g.softmax_backward(&x.softmax(1).unwrap(), 1).unwrap(),
                dtype,
            );
            let (y, mean, rstd) = x.layer_norm_with_stats(Some(&w), None, 1e-5).unwrap();
            let (dy, dmean, drstd) = dx.layer_norm_with_stats(Some(&dw), None, 1e-5).unwrap();
            check(&what("layer_norm"), &dy, &y, dtype);
            check(
                &what("layer_norm_backward"),
                &dg.layer_norm_backward_with_stats(&dx, &dmean, &drstd, Some(&dw))
                    .unwrap(),
                &g.layer_norm_backward_with_stats(&x, &mean, &rstd, Some(&w)).unwrap(),
                dtype,
            );
            check(
                &what("rms_norm"),
                &dx.rms_norm_with_stats(Some(&dw), 1e-5).unwrap().0,
                &x.rms_norm_with_stats(Some(&w), 1e-5).unwrap().0,
                dtype,
            );
        }
    }
}

/// The causal parts of attention's products against the host's, dense (short
/// sequences) and in row blocks (long ones, uneven blocks included).
#[test]
#[ignore = "needs a CUDA GPU"]
fn causal_products() {
    use tessera_tensor::ops::Causal;
    for dtype in [DType::F32, DType::BF16] {
        for (t, s) in [(100, 100), (300, 300), (512, 512), (200, 260)] {
            let q = rand(&[2, 3, t, 16], dtype, 31);
            let k = rand(&[2, 3, s, 16], dtype, 32);
            let kt = k.transpose(2, 3).unwrap();
            let what = |p: &str| format!("matmul_causal {p} {t}x{s}");
            let scores = q.matmul_causal(&kt, Causal::Scores).unwrap();
            check(
                &what("Scores"),
                &gpu(&q)
                    .matmul_causal(&gpu(&k).transpose(2, 3).unwrap(), Causal::Scores)
                    .unwrap(),
                &scores,
                dtype,
            );
            if t != s {
                continue;
            }
            // Weights: the causal probabilities times values.
            let p = scores.attention_probs(0.25, true).unwrap();
            let v = rand(&[2, 3, s, 8], dtype, 33);
            check(
                &what("Weights"),
                &gpu(&p).matmul_causal(&gpu(&v), Causal::Weights).unwrap(),
                &p.matmul_causal(&v, Causal::Weights).unwrap(),
                dtype,
            );
            let g = rand(&[2, 3, t, 8], dtype, 34);
            let pt = p.transpose(2, 3).unwrap();
            check(
                &what("WeightsTransposed"),
                &gpu(&p)
                    .transpose(2, 3)
                    .unwrap()
                    .matmul_causal(&gpu(&g), Causal::WeightsTransposed)
                    .unwrap(),
                &pt.matmul_causal(&g, Causal::WeightsTransposed).unwrap(),
                dtype,
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn transformer_ops() {
    for dtype in [DType::F32, DType::BF16] {
        let x = rand(&[2, 4, 33, 33], dtype, 4);
        let dx = gpu(&x);
        check("softmax", &dx.softmax(3).unwrap(), &x.softmax(3).unwrap(), dtype);
        check("softmax dim 1", &dx.softmax(1).unwrap(), &x.softmax(1).unwrap(), dtype);
        check(
            "log_softmax",
            &dx.log_softmax(3).unwrap(),
            &x.log_softmax(3).unwrap(),
            dtype,
        );
        let p = x.attention_probs(0.125, true).unwrap();
        check(
            "attention_probs causal",
            &dx.attention_probs(0.125, true).unwrap(),
            &p,
            dtype,
        );
        let g = rand(&[2, 4, 33, 33], dtype, 5);
        check(
            "attention_probs_backward",
            &gpu(&g).attention_probs_backward(&gpu(&p), 0.125, true).unwrap(),
            &g.attention_probs_backward(&p, 0.125, true).unwrap(),
            dtype,
        );
        check(
            "softmax_backward",
            &gpu(&g).softmax_backward(&gpu(&p), 3).unwrap(),
            &g.softmax_backward(&p, 3).unwrap(),
            dtype,
        );

        let (h, w, b) = (
            rand(&[96, 200], dtype, 6),
            rand(&[200], dtype, 7),
            rand(&[200], dtype, 8),
        );
        let (dh, dw, db) = (gpu(&h), gpu(&w), gpu(&b));
        let (y, mean, rstd) = h.layer_norm_with_stats(Some(&w), Some(&b), 1e-5).unwrap();
        let (dy, dmean, drstd) = dh.layer_norm_with_stats(Some(&dw), Some(&db), 1e-5).unwrap();
        check("layer_norm", &dy, &y, dtype);
        check("layer_norm mean", &dmean, &mean, DType::F32);
        check("layer_norm rstd", &drstd, &rstd, DType::F32);
        let gy = rand(&[96, 200], dtype, 9);
        check(
            "layer_norm_backward",
            &gpu(&gy)
                .layer_norm_backward_with_stats(&dh, &dmean, &drstd, Some(&dw))
                .unwrap(),
            &gy.layer_norm_backward_with_stats(&h, &mean, &rstd, Some(&w)).unwrap(),
            dtype,
        );
        let (hb, gb) = (rand(&[2000, 1030], dtype, 16), rand(&[2000, 1030], dtype, 17));
        let (_, mb, rb) = hb.layer_norm_with_stats(None, None, 1e-5).unwrap();
        let (_, dmb, drb) = gpu(&hb).layer_norm_with_stats(None, None, 1e-5).unwrap();
        check(
            "layer_norm_weight_grad 2000x1030",
            &gpu(&gb)
                .layer_norm_weight_grad_with_stats(&gpu(&hb), &dmb, &drb)
                .unwrap(),
            &gb.layer_norm_weight_grad_with_stats(&hb, &mb, &rb).unwrap(),
            dtype,
        );
        check(
            "layer_norm_weight_grad",
            &gpu(&gy).layer_norm_weight_grad_with_stats(&dh, &dmean, &drstd).unwrap(),
            &gy.layer_norm_weight_grad_with_stats(&h, &mean, &rstd).unwrap(),
            dtype,
        );

        let (y, rstd) = h.rms_norm_with_stats(Some(&w), 1e-5).unwrap();
        let (dy, drstd) = dh.rms_norm_with_stats(Some(&dw), 1e-5).unwrap();
        check("rms_norm", &dy, &y, dtype);
        check("rms_norm rstd", &drstd, &rstd, DType::F32);
        check(
            "rms_norm_backward",
            &gpu(&gy).rms_norm_backward_with_stats(&dh, &drstd, Some(&dw)).unwrap(),
            &gy.rms_norm_backward_with_stats(&h, &rstd, Some(&w)).unwrap(),
            dtype,
        );
        check(
            "rms_norm_weight_grad",
            &gpu(&gy).rms_norm_weight_grad_with_stats(&dh, &drstd).unwrap(),
            &gy.rms_norm_weight_grad_with_stats(&h, &rstd).unwrap(),
            dtype,
        );

        let logits = rand(&[37, 300], dtype, 10);
        let targets = Tensor::from_vec((0..37).map(|i| (i * 41 % 300) as i64).collect(), &[37]).unwrap();
        let (dl, dt) = (gpu(&logits), gpu(&targets));
        for r in [Reduction::Mean, Reduction::Sum, Reduction::None] {
            check(
                &format!("cross_entropy {r:?}"),
                &dl.cross_entropy(&dt, r).unwrap(),
                &logits.cross_entropy(&targets, r).unwrap(),
                dtype,
            );
        }
        check(
            "cross_entropy_backward",
            &dl.cross_entropy_backward(&dt, 0.5).unwrap(),
            &logits.cross_entropy_backward(&targets, 0.5).unwrap(),
            dtype,
        );
        let bad = gpu(&Tensor::from_vec(vec![3i64; 36].into_iter().chain([300]).collect(), &[37]).unwrap());
        let e = dl.cross_entropy(&bad, Reduction::Mean).unwrap_err().to_string();
        assert!(e.contains("target 300 of row 36 is not a class"), "{e}");

        let table = rand(&[50, 64], dtype, 11);
        let idx = Tensor::from_vec(vec![3i64, 7, 3, 49, 0, 7], &[2, 3]).unwrap();
        check(
            "embedding",
            &gpu(&table).embedding(&gpu(&idx)).unwrap(),
            &table.embedding(&idx).unwrap(),
            dtype,
        );
        let ge = rand(&[6, 64], dtype, 12);
        let flat = idx.reshape(&[6]).unwrap();
        check(
            "embedding_dense_backward",
            &gpu(&ge).embedding_dense_backward(&gpu(&flat), 50, 0).unwrap(),
            &ge.embedding_dense_backward(&flat, 50, 0).unwrap(),
            dtype,
        );
        let e = gpu(&table)
            .embedding(&gpu(&Tensor::from_vec(vec![50i64], &[1]).unwrap()))
            .unwrap_err()
            .to_string();
        assert!(e.contains("index 50 (element 0"), "{e}");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn matrix_products() {
    for dtype in [DType::F32, DType::BF16] {
        let cases: [(&[usize], &[usize]); 4] = [
            (&[65, 130], &[130, 17]),
            (&[3, 33, 64], &[64, 48]),
            (&[2, 4, 16, 8], &[2, 4, 8, 16]),
            (&[5, 7], &[7]),
        ];
        for (sa, sb) in cases {
            let (a, b) = (rand(sa, dtype, 20), rand(sb, dtype, 21));
            check(
                &format!("matmul {sa:?}x{sb:?}"),
                &gpu(&a).matmul(&gpu(&b)).unwrap(),
                &a.matmul(&b).unwrap(),
                dtype,
            );
        }
        // Transposed and broadcast operands read in place or copied first.
        let (a, b) = (rand(&[40, 30], dtype, 22), rand(&[50, 40], dtype, 23));
        check(
            "matmul aᵀ·bᵀ",
            &gpu(&a)
                .transpose(0, 1)
                .unwrap()
                .matmul(&gpu(&b).transpose(0, 1).unwrap())
                .unwrap(),
            &a.transpose(0, 1).unwrap().matmul(&b.transpose(0, 1).unwrap()).unwrap(),
            dtype,
        );
        let (q, k) = (rand(&[2, 3, 10, 16], dtype, 24), rand(&[2, 3, 12, 16], dtype, 25));
        check(
            "matmul q·kᵀ (batched)",
            &gpu(&q).matmul(&gpu(&k).transpose(2, 3).unwrap()).unwrap(),
            &q.matmul(&k.transpose(2, 3).unwrap()).unwrap(),
            dtype,
        );
    }
}

/// The caching allocator reuses blocks: a loop of the same work asks the
/// driver for memory only in its first iteration, and the tracker's device
/// bytes return to where they were.
#[test]
#[ignore = "needs a CUDA GPU"]
fn caching_allocator_reuses_and_tracks() {
    launch(1, |_| {
        let before = tessera_tensor::memory::device_stats().current_bytes;
        let x = gpu(&rand(&[256, 1024], DType::F32, 30));
        assert_eq!(
            tessera_tensor::memory::device_stats().current_bytes - before,
            256 * 1024 * 4,
            "device bytes charged to the rank"
        );
        let w = gpu(&rand(&[1024, 1024], DType::F32, 31));
        let step = |x: &Tensor| {
            x.matmul(&w)
                .unwrap()
                .gelu()
                .unwrap()
                .softmax(1)
                .unwrap()
                .sum(&[0], false)
                .unwrap()
        };
        step(&x);
        cuda::synchronize(0)?;
        let warm = cuda::memory_stats(0)?;
        for _ in 0..200 {
            step(&x);
        }
        cuda::synchronize(0)?;
        let after = cuda::memory_stats(0)?;
        println!("allocator: {warm:?} -> {after:?}");
        assert_eq!(
            after.driver_allocations, warm.driver_allocations,
            "no new device memory after the first step"
        );
        assert_eq!(after.reserved_bytes, warm.reserved_bytes, "no growth over 200 steps");
        drop((x, w));
        assert_eq!(
            tessera_tensor::memory::device_stats().current_bytes,
            before,
            "every device byte given back"
        );
        cuda::empty_cache(0)?;
        assert!(
            cuda::memory_stats(0)?.reserved_bytes < after.reserved_bytes,
            "empty_cache returns cached blocks"
        );
        Ok(())
    })
    .unwrap();
}

/// Ranks that are threads sharing the GPU: collectives equal their host
/// counterparts on the same data.
#[test]
#[ignore = "needs a CUDA GPU"]
fn collectives_on_one_gpu() {
    for world in [2, 4] {
        let out = launch(world, move |ctx| {
            let r = ctx.rank();
            let group = cuda::comm::LocalGroup::new(ctx.comm())?;
            let mine = rand(&[world * 3, 5], DType::F32, 40 + r as u64);
            let every: Vec<Tensor> = (0..world)
                .map(|p| rand(&[world * 3, 5], DType::F32, 40 + p as u64))
                .collect();
            let sum = every.iter().skip(1).fold(every[0].clone(), |a, b| a.add(b).unwrap());
            let d = gpu(&mine);
            for _ in 0..3 {
                let g = group.all_gather(&d)?;
                assert_eq!(host(&g), Tensor::cat(&every, 0)?, "all_gather on rank {r}");
                let a = group.all_reduce(&d, ReduceOp::Sum)?;
                assert!(rel_err(&host(&a), &sum) < 1e-6, "all_reduce on rank {r}");
                let s = group.reduce_scatter(&d, ReduceOp::Avg)?;
                let want = sum.narrow(0, r * 3, 3)?.mul_scalar(1.0 / world as f64)?;
                assert!(rel_err(&host(&s), &want) < 1e-6, "reduce_scatter on rank {r}");
            }
            let m = group.all_reduce(&d, ReduceOp::Max)?;
            let want = every
                .iter()
                .skip(1)
                .fold(every[0].clone(), |a, b| a.maximum(b).unwrap());
            assert_eq!(host(&m), want, "max on rank {r}");
            Ok(r)
        })
        .unwrap();
        println!("collectives on one GPU: {world} ranks ok ({out:?})");
    }
}

/// NCCL with one rank (the machines that run these checks have one GPU).
#[test]
#[ignore = "needs a CUDA GPU"]
fn nccl_world_one() {
    launch(1, |ctx| {
        println!("NCCL version {}", cuda::comm::Nccl::version()?);
        let nccl = cuda::comm::Nccl::new(ctx.comm(), 0)?;
        let x = rand(&[8, 4], DType::F32, 50);
        let d = gpu(&x);
        assert_eq!(host(&nccl.all_reduce(&d, ReduceOp::Sum)?), x);
        assert_eq!(host(&nccl.all_gather(&d)?), x);
        assert_eq!(host(&nccl.reduce_scatter(&d, ReduceOp::Sum)?), x);
        let xb = gpu(&x.cast(DType::BF16)?);
        assert_eq!(host(&nccl.all_reduce(&xb, ReduceOp::Sum)?), x.cast(DType::BF16)?);
        Ok(())
    })
    .unwrap();
}

/// The device AdamW step against the host's formula (same scalars, same
/// order of operations) over 5 steps; a shared parameter is copied, not
/// changed under its other holder.
#[test]
#[ignore = "needs a CUDA GPU"]
fn adamw_matches_the_host_formula() {
    let n = 1000;
    let (lr, b1, b2, eps, wd) = (1e-2f64, 0.9f64, 0.95f64, 1e-8f64, 0.1f64);
    let mut p = rand(&[n], DType::F32, 60).to_vec::<f32>().unwrap();
    let (mut m, mut v) = (vec![0f32; n], vec![0f32; n]);
    let mut dp = gpu(&Tensor::from_slice(&p, &[n]).unwrap());
    let (mut dm, mut dv) = (
        gpu(&Tensor::zeros(&[n], DType::F32).unwrap()),
        gpu(&Tensor::zeros(&[n], DType::F32).unwrap()),
    );
    let scalars = |step: i32| cuda::AdamScalars {
        decay: (1.0 - lr * wd) as f32,
        lerp_weight: (1.0 - b1) as f32,
        beta2: b2 as f32,
        one_minus_beta2: (1.0 - b2) as f32,
        bias_correction2_sqrt: (1.0 - b2.powi(step)).sqrt() as f32,
        eps: eps as f32,
        neg_step_size: (-lr / (1.0 - b1.powi(step))) as f32,
        lerp_small: 1,
    };
    for step in 1..=5 {
        let g = rand(&[n], DType::F32, 60 + step as u64).to_vec::<f32>().unwrap();
        let s = scalars(step);
        cuda::adamw_step(
            &mut dp,
            &gpu(&Tensor::from_slice(&g, &[n]).unwrap()),
            &mut dm,
            &mut dv,
            s,
        )
        .unwrap();
        for i in 0..n {
            let pi = p[i] * s.decay;
            let mi = s.lerp_weight.mul_add(g[i] - m[i], m[i]);
            let vi = v[i] * s.beta2 + s.one_minus_beta2 * g[i] * g[i];
            let denom = vi.sqrt() / s.bias_correction2_sqrt + s.eps;
            p[i] = pi + s.neg_step_size * mi / denom;
            m[i] = mi;
            v[i] = vi;
        }
    }
    let got = host(&dp).to_vec::<f32>().unwrap();
    let same = got.iter().zip(&p).filter(|(a, b)| a.to_bits() == b.to_bits()).count();
    println!("check adamw 5 steps: {same} of {n} elements bit for bit");
    assert_eq!(same, n, "the device step differs from the host formula");
    // Copy on write: the other handle keeps the old values.
    let other = dp.clone();
    let before = host(&other);
    cuda::adamw_step(
        &mut dp,
        &gpu(&Tensor::ones(&[n], DType::F32).unwrap()),
        &mut dm,
        &mut dv,
        scalars(6),
    )
    .unwrap();
    assert_eq!(
        host(&other),
        before,
        "a shared parameter changed under its other holder"
    );
    assert!(!dp.shares_storage(&other) && host(&dp) != before);
}

/// Uneven and segmented collectives between ranks sharing the GPU, against
/// the same data gathered on the host.
#[test]
#[ignore = "needs a CUDA GPU"]
fn uneven_collectives_on_one_gpu() {
    let world = 3;
    launch(world, move |ctx| {
        let r = ctx.rank();
        let group = cuda::comm::LocalGroup::new(ctx.comm())?;
        // Rank p holds p + 2 elements valued 100·p + i.
        let counts: Vec<usize> = (0..world).map(|p| p + 2).collect();
        let mine: Vec<f32> = (0..counts[r]).map(|i| (100 * r + i) as f32).collect();
        let got = group.all_gather_v(&gpu(&Tensor::from_slice(&mine, &[counts[r]])?), &counts)?;
        let want: Vec<f32> = (0..world)
            .flat_map(|p| (0..counts[p]).map(move |i| (100 * p + i) as f32))
            .collect();
        assert_eq!(host(&got).to_vec::<f32>()?, want, "all_gather_v on rank {r}");
        // reduce_scatter_v of i64: every rank sends 0..9 plus its rank.
        let send: Vec<i64> = (0..9).map(|i| i + r as i64).collect();
        let got = group.reduce_scatter_v(&gpu(&Tensor::from_slice(&send, &[9])?), &[2, 3, 4], ReduceOp::Sum)?;
        let start = [0, 2, 5][r];
        let want: Vec<i64> = (0..[2, 3, 4][r]).map(|i| 3 * (start + i) as i64 + 3).collect();
        assert_eq!(host(&got).to_vec::<i64>()?, want, "reduce_scatter_v on rank {r}");
        // all_to_all_v: rank p sends q + 1 copies of 10·p + q to rank q.
        let send_counts: Vec<usize> = (0..world).map(|q| q + 1).collect();
        let send: Vec<f32> = (0..world)
            .flat_map(|q| std::iter::repeat_n((10 * r + q) as f32, q + 1))
            .collect();
        let recv_counts = vec![r + 1; world];
        let got = group.all_to_all_v(
            &gpu(&Tensor::from_slice(&send, &[send.len()])?),
            &send_counts,
            &recv_counts,
        )?;
        let want: Vec<f32> = (0..world)
            .flat_map(|p| std::iter::repeat_n((10 * p + r) as f32, r + 1))
            .collect();
        assert_eq!(host(&got).to_vec::<f32>()?, want, "all_to_all_v on rank {r}");
        // Segmented gather: segments [2, 1] of every rank side by side.
        let seg: Vec<f32> = (0..3).map(|i| (10 * r + i) as f32).collect();
        let got = group.all_gather_segmented(&gpu(&Tensor::from_slice(&seg, &[3])?), &[2, 1])?;
        let mut want = Vec::new();
        for p in 0..world {
            want.extend([(10 * p) as f32, (10 * p + 1) as f32]);
        }
        for p in 0..world {
            want.push((10 * p + 2) as f32);
        }
        assert_eq!(host(&got).to_vec::<f32>()?, want, "all_gather_segmented on rank {r}");
        // Counts that disagree are refused on every rank.
        let e = group
            .all_gather_v(&gpu(&Tensor::from_slice(&mine, &[counts[r]])?), &[1, 1])
            .unwrap_err()
            .to_string();
        assert!(e.contains("counts"), "{e}");
        Ok(())
    })
    .unwrap();
}
