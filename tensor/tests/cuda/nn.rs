//! The ops of the reference models on the device: the LLaMA ops, the row
//! kernels at their widths, the causal products, the Transformer ops and the
//! matrix products.

use super::*;

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

/// Fused attention on the device (the chain of products and softmax kernels,
/// the causal scores' masked half never written) against the host's, forward
/// and backward: short sequences (one dense product) and long ones (row
/// blocks), heads read as a view of `[b, t, h, e]`, causal or not. Blocks
/// freed full of NaN first, so that scores reusing them would show any
/// masked element that is read.
#[test]
#[ignore = "needs a CUDA GPU"]
fn attention_forward_and_backward() {
    use tessera_tensor::ops::Attention;
    for dtype in [DType::F32, DType::BF16] {
        for (t, is_causal) in [(100, true), (512, true), (300, false)] {
            let heads = |seed| rand(&[2, t, 3, 16], dtype, seed).permute(&[0, 2, 1, 3]).unwrap();
            let (q, k, v, g) = (heads(41), heads(42), heads(43), heads(44));
            let attn = Attention { scale: 0.25, is_causal };
            let (out, probs) = q.attention(&k, &v, attn).unwrap();
            let grads = g.attention_backward(&q, &k, &v, &probs, attn, [true; 3]).unwrap();
            drop(gpu(&Tensor::full(&[2, 3, t, t], f64::NAN, dtype).unwrap()));
            let (dq, dk, dv, dg) = (gpu(&q), gpu(&k), gpu(&v), gpu(&g));
            let (dout, dprobs) = dq.attention(&dk, &dv, attn).unwrap();
            drop(gpu(&Tensor::full(&[2, 3, t, t], f64::NAN, dtype).unwrap()));
            let dgrads = dg.attention_backward(&dq, &dk, &dv, &dprobs, attn, [true; 3]).unwrap();
            let what = |p: &str| format!("attention {p} t={t} causal={is_causal}");
            check(&what("out"), &dout, &out, dtype);
            check(&what("probs"), &dprobs, &probs, dtype);
            for (name, (d, h)) in ["dq", "dk", "dv"].into_iter().zip(dgrads.iter().zip(&grads)) {
                check(&what(name), d.as_ref().unwrap(), h.as_ref().unwrap(), dtype);
            }
        }
    }
}

/// bf16 attention's one-kernel forward (tensor cores) against the host's, at
/// every head size it takes, causal and not, heads read as views of
/// `[b, t, h, e]`: the output comes back in the queries' memory order (the
/// chain's would be contiguous, so the kernel must have run), the weights
/// contiguous with zeros where masked, and the backward from its weights
/// matches the host's.
#[test]
#[ignore = "needs a CUDA GPU"]
fn attention_fused_bf16() {
    use tessera_tensor::ops::Attention;
    let dtype = DType::BF16;
    for (t, e, is_causal) in [
        (512, 64, true),
        (96, 16, false),
        (160, 128, true),
        (48, 32, true),
        (32, 16, true),
    ] {
        let heads = |seed| rand(&[2, t, 3, e], dtype, seed).permute(&[0, 2, 1, 3]).unwrap();
        let (q, k, v, g) = (heads(51), heads(52), heads(53), heads(54));
        let attn = Attention {
            scale: 1.0 / (e as f64).sqrt(),
            is_causal,
        };
        let (out, probs) = q.attention(&k, &v, attn).unwrap();
        let grads = g.attention_backward(&q, &k, &v, &probs, attn, [true; 3]).unwrap();
        drop(gpu(&Tensor::full(&[2, 3, t, t], f64::NAN, dtype).unwrap()));
        // The same views on the GPU (not contiguous copies of them).
        let on_gpu = |seed| gpu(&rand(&[2, t, 3, e], dtype, seed)).permute(&[0, 2, 1, 3]).unwrap();
        let (dq, dk, dv, dg) = (on_gpu(51), on_gpu(52), on_gpu(53), on_gpu(54));
        assert!(!dq.is_contiguous());
        let (dout, dprobs) = dq.attention(&dk, &dv, attn).unwrap();
        let what = |p: &str| format!("fused attention {p} t={t} e={e} causal={is_causal}");
        assert_eq!(
            dout.strides(),
            dq.strides(),
            "{}: not the fused kernel's layout",
            what("out")
        );
        assert!(dprobs.is_contiguous());
        check(&what("out"), &dout, &out, dtype);
        check(&what("probs"), &dprobs, &probs, dtype);
        if is_causal {
            let p = host(&dprobs).to_f64_vec();
            let masked = (0..p.len()).filter(|&i| i % t > (i / t) % t);
            assert!(
                masked.clone().all(|i| p[i] == 0.0),
                "{}: masked weights not zero",
                what("probs")
            );
        }
        let dgrads = dg.attention_backward(&dq, &dk, &dv, &dprobs, attn, [true; 3]).unwrap();
        for (name, (d, h)) in ["dq", "dk", "dv"].into_iter().zip(dgrads.iter().zip(&grads)) {
            check(&what(name), d.as_ref().unwrap(), h.as_ref().unwrap(), dtype);
        }
    }
    // Where it does not apply (a head size of 24, 100 queries, f32) the chain
    // runs: a contiguous output.
    for (t, e, dtype) in [(64, 24, DType::BF16), (100, 16, DType::BF16), (64, 64, DType::F32)] {
        let q = gpu(&rand(&[2, t, 3, e], dtype, 55)).permute(&[0, 2, 1, 3]).unwrap();
        let (out, _) = q
            .attention(
                &q,
                &q,
                Attention {
                    scale: 0.5,
                    is_causal: true,
                },
            )
            .unwrap();
        assert!(
            out.is_contiguous(),
            "t={t} e={e} {dtype}: expected the chain's contiguous output"
        );
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
        // Rows wider than a block's pass, logits spread wide (each thread's
        // running maximum grows often), a −∞ logit and a NaN one.
        let mut spread = Tensor::randn(&[6, 5000], DType::F64, 13).unwrap().to_f64_vec();
        spread.iter_mut().for_each(|v| *v *= 8.0);
        spread[2 * 5000 + 17] = f64::NEG_INFINITY;
        spread[4 * 5000 + 4999] = f64::NAN;
        let spread = Tensor::from_vec(spread, &[6, 5000]).unwrap().cast(dtype).unwrap();
        let st = Tensor::from_vec(vec![0i64, 4999, 3, 2500, 7, 4096], &[6]).unwrap();
        let want = spread.cross_entropy(&st, Reduction::None).unwrap().to_f64_vec();
        let got = host(&gpu(&spread).cross_entropy(&gpu(&st), Reduction::None).unwrap()).to_f64_vec();
        for (row, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                (g.is_nan() && w.is_nan()) || (g - w).abs() <= tol(dtype) * w.abs().max(1.0),
                "cross_entropy of wide row {row} ({dtype}): {g} on the GPU, {w} on the host"
            );
        }
        check(
            "cross_entropy_backward wide rows",
            &gpu(&spread.narrow(0, 0, 4).unwrap())
                .cross_entropy_backward(&gpu(&st.narrow(0, 0, 4).unwrap()), 0.25)
                .unwrap(),
            &spread
                .narrow(0, 0, 4)
                .unwrap()
                .cross_entropy_backward(&st.narrow(0, 0, 4).unwrap(), 0.25)
                .unwrap(),
            dtype,
        );
        let bad = gpu(&Tensor::from_vec(vec![3i64; 36].into_iter().chain([300]).collect(), &[37]).unwrap());
        // A bad target is reported when the host next waits for the GPU (the
        // loss's read here), once: the op itself queues without a wait.
        let waits = cuda::host_waits(0).unwrap();
        let loss = dl.cross_entropy(&bad, Reduction::Mean).unwrap();
        assert_eq!(cuda::host_waits(0).unwrap(), waits, "cross_entropy waited for the GPU");
        let e = loss.to(Device::Cpu).unwrap_err().to_string();
        assert!(e.contains("target 300 of row 36 is not a class"), "{e}");
        assert!(
            cuda::host_waits(0).unwrap() > waits,
            "reading the loss did not count a wait"
        );
        loss.to(Device::Cpu).unwrap();

        let table = rand(&[50, 64], dtype, 11);
        let idx = Tensor::from_vec(vec![3i64, 7, 3, 49, 0, 7], &[2, 3]).unwrap();
        check(
            "embedding",
            &gpu(&table).embedding(&gpu(&idx)).unwrap(),
            &table.embedding(&idx).unwrap(),
            dtype,
        );
        // An index out of range: zeros in its row, the error at the next wait
        // (a synchronize here), naming the index and where it was.
        let far = gpu(&Tensor::from_vec(vec![3i64, 50, 1], &[3]).unwrap());
        let rows = gpu(&table).embedding(&far).unwrap();
        let e = cuda::synchronize(0).unwrap_err().to_string();
        assert!(
            e.contains("index 50 (element 1 of indices of shape [3]) is out of range for a table of 50 rows"),
            "{e}"
        );
        assert!(
            host(&rows)
                .narrow(0, 1, 1)
                .unwrap()
                .to_f64_vec()
                .iter()
                .all(|&x| x == 0.0)
        );
        cuda::synchronize(0).unwrap();
        let ge = rand(&[6, 64], dtype, 12);
        let flat = idx.reshape(&[6]).unwrap();
        check(
            "embedding_dense_backward",
            &gpu(&ge).embedding_dense_backward(&gpu(&flat), 50, 0).unwrap(),
            &ge.embedding_dense_backward(&flat, 50, 0).unwrap(),
            dtype,
        );
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
        // Stacks times one shared matrix: folded into one product when the
        // stack's rows are evenly spaced, batched otherwise.
        let stack = rand(&[2, 3, 40, 16], dtype, 26);
        let (w, wt) = (rand(&[16, 24], dtype, 27), rand(&[24, 16], dtype, 28));
        type Views = fn(&Tensor, &Tensor, &Tensor) -> (Tensor, Tensor);
        let cases: [(&str, Views); 4] = [
            ("folded 4-D", |s, w, _| (s.clone(), w.clone())),
            ("folded, shared matrix transposed", |s, _, wt| {
                (s.clone(), wt.transpose(0, 1).unwrap())
            }),
            ("folded, a stack of one", |s, w, _| {
                (s.clone(), w.reshape(&[1, 16, 24]).unwrap())
            }),
            ("rows not evenly spaced", |s, w, _| {
                (s.narrow(2, 0, 30).unwrap(), w.clone())
            }),
        ];
        for (what, views) in cases {
            let (a, b) = views(&stack, &w, &wt);
            let (da, db) = views(&gpu(&stack), &gpu(&w), &gpu(&wt));
            check(
                &format!("matmul {what}"),
                &da.matmul(&db).unwrap(),
                &a.matmul(&b).unwrap(),
                dtype,
            );
        }
        let (q, k) = (rand(&[2, 3, 10, 16], dtype, 24), rand(&[2, 3, 12, 16], dtype, 25));
        check(
            "matmul q·kᵀ (batched)",
            &gpu(&q).matmul(&gpu(&k).transpose(2, 3).unwrap()).unwrap(),
            &q.matmul(&k.transpose(2, 3).unwrap()).unwrap(),
            dtype,
        );
        // Heads read from `[b, t, h, e]` (batch dims without one stride) are
        // read in place through arrays of addresses: the product allocates
        // its output and the arrays, no copy of an operand; causal parts too.
        use tessera_tensor::ops::Causal;
        let heads = |x: &Tensor| x.permute(&[0, 2, 1, 3]).unwrap();
        let (q, k) = (rand(&[2, 64, 3, 16], dtype, 26), rand(&[2, 64, 3, 16], dtype, 27));
        let (dq, dk) = (gpu(&q), gpu(&k));
        let kt = |x: &Tensor| heads(x).transpose(2, 3).unwrap();
        let before = cuda::memory_stats(0).unwrap().allocated_bytes;
        cuda::reset_peak_memory_stats(0).unwrap();
        let scores = heads(&dq).matmul(&kt(&dk)).unwrap();
        let extra = cuda::memory_stats(0).unwrap().peak_allocated_bytes - before;
        let (out_bytes, operand_bytes) = (scores.size_in_bytes(), dq.size_in_bytes());
        assert!(
            extra < out_bytes + operand_bytes,
            "{dtype}: the product of heads allocated {extra} B for a {out_bytes} B output: an operand was copied"
        );
        check(
            "matmul heads in place",
            &scores,
            &heads(&q).matmul(&kt(&k)).unwrap(),
            dtype,
        );
        for part in [Causal::Scores, Causal::Weights] {
            let (hq, hk) = (heads(&q), kt(&k));
            let (want, got) = match part {
                Causal::Scores => (
                    hq.matmul_causal(&hk, part).unwrap(),
                    heads(&dq).matmul_causal(&kt(&dk), part).unwrap(),
                ),
                _ => {
                    let p = hq
                        .matmul_causal(&hk, Causal::Scores)
                        .unwrap()
                        .attention_probs(0.25, true)
                        .unwrap();
                    let dp = gpu(&p);
                    (
                        p.matmul_causal(&heads(&k), part).unwrap(),
                        dp.matmul_causal(&heads(&dk), part).unwrap(),
                    )
                }
            };
            check(&format!("matmul_causal {part:?} heads in place"), &got, &want, dtype);
        }
        let long = rand(&[2, 512, 3, 16], dtype, 28);
        let hl = heads(&long);
        check(
            "matmul_causal Scores heads in place, row blocks",
            &heads(&gpu(&long))
                .matmul_causal(&kt(&gpu(&long)), Causal::Scores)
                .unwrap(),
            &hl.matmul_causal(&hl.transpose(2, 3).unwrap(), Causal::Scores).unwrap(),
            dtype,
        );
    }
}
