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
