//! Tests of the small `f32` kernel and of the causal parts of a product.

use tessera_mesh::DType;

use super::*;

/// The small `f32` kernel gives the `gemm` crate's bits (one chain of fused
/// multiply-adds per element, from zero) for every layout it reads: left
/// operands row-major with a row stride past the depth or transposed, right
/// operands read in place (row stride past the width) or copied transposed;
/// ragged row tiles (1 to 11 rows left) and column tiles (1, 15, 17 columns),
/// depths up to `MAX_DEPTH`.
#[cfg(target_arch = "x86_64")]
#[test]
fn small_products_have_the_gemm_crates_bits() {
    // Without AVX-512F the small kernel never runs (`entry` takes the `gemm`
    // crate for these shapes too): the products are then checked against the
    // reference only.
    let small_kernel = small::detected();
    // (m, k, n) with m·n > 256 and k > 2: the `gemm` crate takes its packed
    // micro-kernels there (tiny products take its dot-product kernels, which sum
    // in another order).
    let shapes = [
        (128, 32, 128),
        (128, 128, 32),
        (37, 3, 17),
        (13, 256, 33),
        (25, 65, 15),
        (12, 7, 48),
        (64, 100, 31),
        (300, 16, 1 + 16),
    ];
    for (case, &(m, k, n)) in shapes.iter().enumerate() {
        let seed = 10 * case as u64;
        // Left: row-major narrowed to k of k + 3 columns, or a transposed view.
        let lefts = [
            sample(&[m, k + 3], DType::F32, seed).narrow(1, 1, k).unwrap(),
            sample(&[k, m], DType::F32, seed + 1).transpose(0, 1).unwrap(),
        ];
        // Right: row-major narrowed (read in place) or a transposed view (copied).
        let rights = [
            sample(&[k, n + 5], DType::F32, seed + 2).narrow(1, 2, n).unwrap(),
            sample(&[n, k], DType::F32, seed + 3).transpose(0, 1).unwrap(),
        ];
        for a in &lefts {
            for b in &rights {
                let mat = |t: &Tensor| Mat {
                    ptr: t.view::<f32>().unwrap().as_ptr(),
                    rs: t.strides()[0] as isize,
                    cs: t.strides()[1] as isize,
                };
                assert_eq!(small::fits([m, k, n], mat(b)), small_kernel);
                let run = |small_kernel: bool| {
                    let mut c = vec![f32::NAN; m * n];
                    // SAFETY: both operands are m×k and k×n views of live tensors,
                    // `c` holds m rows of n.
                    unsafe {
                        if small_kernel {
                            small::product([m, k, n], mat(a), mat(b), c.as_mut_ptr(), n as isize, Causal::Dense);
                        } else {
                            gemm_split(
                                GemmKernel::Gemm,
                                [m, k, n],
                                mat(a),
                                mat(b),
                                OutPtr(c.as_mut_ptr()),
                                n as isize,
                            );
                        }
                    }
                    c.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                };
                let what = format!("{m}x{k}x{n}, strides {:?} x {:?}", a.strides(), b.strides());
                let got = run(small_kernel);
                if small_kernel {
                    assert_eq!(got, run(false), "{what}");
                }
                let (_, want) = reference(&a.contiguous(), &b.contiguous());
                let got = Tensor::from_vec(got.iter().map(|&b| f32::from_bits(b)).collect(), &[m, n]).unwrap();
                assert_close(&got, &want, 4.0 * k as f64 * tol(DType::F32), &what);
            }
        }
    }
    let wide = Mat::<f32> {
        ptr: std::ptr::null(),
        rs: 7,
        cs: 7,
    };
    assert!(!small::fits([8, 8, 8], wide), "no unit stride: the gemm crate");
    let broadcast = Mat::<f32> { rs: 1, cs: 0, ..wide };
    assert!(
        !small::fits([8, 8, 8], broadcast),
        "overlapping columns: the gemm crate"
    );
    let b = Mat::<f32> { cs: 1, ..wide };
    assert!(!small::fits([8, small::MAX_DEPTH + 1, 8], b), "too deep");
    assert!(!small::fits([small::MAX_SIDE + 1, 8, 8], b), "too tall");
}

/// Each causal part against the dense product, on batched operands (views as
/// attention makes them: heads of a `[batch, tokens, heads, size]` tensor), as
/// many queries as keys and not, in every float dtype: scores are the dense
/// product's on and below the diagonal and zero above; products by weights
/// that are zero where the mask says are the dense product's.
#[test]
fn causal_parts_equal_the_dense_products() {
    for dtype in [DType::F32, DType::F64, DType::BF16] {
        for (t, s, e) in [(128, 128, 32), (7, 7, 3), (20, 33, 5), (40, 24, 16)] {
            let heads = |len: usize, seed| sample(&[2, len, 3, e], dtype, seed).permute(&[0, 2, 1, 3]).unwrap();
            let (q, k, v) = (heads(t, 1), heads(s, 2), heads(s, 3));
            let what = format!("{dtype} T {t} S {s} E {e}");
            // Scores [2, 3, t, s].
            let kt = k.transpose(2, 3).unwrap();
            let dense = q.matmul(&kt).unwrap().to_f64_vec();
            let got = q.matmul_causal(&kt, Causal::Scores).unwrap();
            assert_eq!(got.shape(), &[2, 3, t, s]);
            let got = got.to_f64_vec();
            for (x, (&g, &d)) in got.iter().zip(&dense).enumerate() {
                let (i, j) = ((x / s) % t, x % s);
                let want = if j <= i { d } else { 0.0 };
                assert_eq!(g, want, "scores [{i}, {j}], {what}");
            }
            // Weights [2, 3, t, s] zero at j > i, times values [2, 3, s, e].
            let mask = Tensor::ones(&[t, s], dtype).unwrap().causal_mask(0.0).unwrap();
            let p = sample(&[2, 3, t, s], dtype, 4).mul(&mask).unwrap();
            let dense = p.matmul(&v).unwrap().to_f64_vec();
            assert_eq!(
                p.matmul_causal(&v, Causal::Weights).unwrap().to_f64_vec(),
                dense,
                "weights, {what}"
            );
            // Their transpose [2, 3, s, t] times gradients [2, 3, t, e].
            let pt = p.transpose(2, 3).unwrap();
            let g = sample(&[2, 3, t, e], dtype, 5);
            let dense = pt.matmul(&g).unwrap().to_f64_vec();
            assert_eq!(
                pt.matmul_causal(&g, Causal::WeightsTransposed).unwrap().to_f64_vec(),
                dense,
                "transposed weights, {what}"
            );
            assert_eq!(
                q.matmul_causal(&kt, Causal::Dense).unwrap().to_f64_vec(),
                q.matmul(&kt).unwrap().to_f64_vec()
            );
        }
    }
    let (a, b) = (sample(&[4], DType::F32, 1), sample(&[4, 4], DType::F32, 2));
    let err = a.matmul_causal(&b, Causal::Scores).unwrap_err().to_string();
    assert!(err.contains("Scores needs matrices") && err.contains("[4]"), "{err}");
}

/// The causal parts skip what the mask zeroes: elements of the weights a whole
/// row tile past the diagonal are not read (NaN there does not reach the
/// product, as it does the dense one's; nearer ones are read, and are zero in
/// attention); scores above the diagonal are zero even where the dense product
/// is NaN.
#[cfg(target_arch = "x86_64")]
#[test]
fn causal_parts_do_not_read_or_compute_the_masked_half() {
    let t = 50;
    // [3, t, t] weights: random at j <= i, NaN at j >= i + 12 (the tile height),
    // zero between; `zeroed` has zeros for the NaN.
    let values = sample(&[3, t, t], DType::F32, 1).to_vec::<f32>().unwrap();
    let weights = |far: f32| {
        let w = values.iter().enumerate().map(|(x, &v)| {
            let (i, j) = ((x / t) % t, x % t);
            if j <= i {
                v
            } else if j >= i + 12 {
                far
            } else {
                0.0
            }
        });
        Tensor::from_vec(w.collect(), &[3, t, t]).unwrap()
    };
    let (p, zeroed) = (weights(f32::NAN), weights(0.0));
    let v = sample(&[3, t, 8], DType::F32, 2);
    assert!(zeroed.matmul(&v).unwrap().to_f64_vec().iter().all(|x| x.is_finite()));
    assert!(
        p.matmul(&v).unwrap().to_f64_vec().iter().any(|x| x.is_nan()),
        "the dense product reads the NaN"
    );
    let pt = p.transpose(1, 2).unwrap();
    let g = sample(&[3, t, 8], DType::F32, 3);
    let (weights, transposed) = (
        p.matmul_causal(&v, Causal::Weights).unwrap(),
        pt.matmul_causal(&g, Causal::WeightsTransposed).unwrap(),
    );
    if small::detected() {
        assert_eq!(weights.to_f64_vec(), zeroed.matmul(&v).unwrap().to_f64_vec());
        let zt = zeroed.transpose(1, 2).unwrap();
        assert_eq!(transposed.to_f64_vec(), zt.matmul(&g).unwrap().to_f64_vec());
    } else {
        // Without AVX-512F the weights' parts are the dense products (the
        // `gemm` crate's), which read the NaN.
        let bits = |t: &Tensor| t.to_f64_vec().iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&weights), bits(&p.matmul(&v).unwrap()));
        assert_eq!(bits(&transposed), bits(&pt.matmul(&g).unwrap()));
    }
    scores_skip_later_keys(t, DType::F32);
}

/// Keys with NaN from position 20 on: the causal scores of queries before 20
/// are finite, and every score above the diagonal is 0 (where the dense
/// product has NaN).
fn scores_skip_later_keys(t: usize, dtype: DType) {
    let mut k = sample(&[1, t, 8], DType::F32, 4).to_vec::<f32>().unwrap();
    k[20 * 8..].iter_mut().for_each(|x| *x = f32::NAN);
    let k = Tensor::from_vec(k, &[1, t, 8]).unwrap().cast(dtype).unwrap();
    let q = sample(&[1, t, 8], dtype, 5);
    let scores = q
        .matmul_causal(&k.transpose(1, 2).unwrap(), Causal::Scores)
        .unwrap()
        .to_f64_vec();
    for i in 0..20 {
        assert!(
            scores[i * t..(i + 1) * t].iter().all(|x| x.is_finite()),
            "{dtype} row {i}"
        );
    }
    for i in 0..t {
        assert!(
            scores[i * t + i + 1..(i + 1) * t].iter().all(|&x| x == 0.0),
            "{dtype} row {i}"
        );
    }
}

/// A causal part's flops are the multiply-adds of the kept (query, key)
/// pairs, counted here one by one; a dense product's are `2·m·k·n`.
#[test]
fn part_flops_count_the_kept_pairs() {
    for (m, k, n) in [(1, 1, 1), (5, 3, 5), (8, 4, 3), (3, 4, 8), (6, 6, 6), (2, 9, 7)] {
        let pairs = |t: usize, s: usize| (0..t).flat_map(|i| (0..s).filter(move |&j| j <= i)).count() as u128;
        let mkn = [m, k, n];
        assert_eq!(part_flops(3, Causal::Dense, mkn), 2 * 3 * (m * k * n) as u128);
        // Scores [T = m, S = n] along k; weights [T = m, S = k] along n;
        // transposed weights [S = m, T = k] along n.
        assert_eq!(
            part_flops(3, Causal::Scores, mkn),
            6 * pairs(m, n) * k as u128,
            "{mkn:?}"
        );
        assert_eq!(
            part_flops(3, Causal::Weights, mkn),
            6 * pairs(m, k) * n as u128,
            "{mkn:?}"
        );
        assert_eq!(
            part_flops(3, Causal::WeightsTransposed, mkn),
            6 * pairs(k, m) * n as u128,
            "{mkn:?}"
        );
    }
    // A square causal product does a little over half of the dense one's work.
    let half =
        part_flops(1, Causal::Scores, [128, 32, 128]) as f64 / part_flops(1, Causal::Dense, [128, 32, 128]) as f64;
    assert!((half - 0.5).abs() < 0.01, "{half}");
}

/// The `bf16` dot-product kernel's causal parts skip the masked half as the
/// small `f32` kernel's do: weights a tile and a pair past the diagonal (NaN
/// here) are not read, so the parts equal the dense products of the weights
/// with zeros there, bit for bit; scores above the diagonal are zero where
/// the dense product is NaN.
#[cfg(target_arch = "x86_64")]
#[test]
fn bf16_causal_parts_do_not_read_the_masked_half() {
    let t = 50;
    let values = sample(&[3, t, t], DType::F32, 1).to_vec::<f32>().unwrap();
    // NaN at j >= i + 14 (a 12-row tile and a pair), zero between.
    let weights = |far: f32| {
        let w = values.iter().enumerate().map(|(x, &v)| {
            let (i, j) = ((x / t) % t, x % t);
            half::bf16::from_f32(if j <= i {
                v
            } else if j >= i + 14 {
                far
            } else {
                0.0
            })
        });
        Tensor::from_vec(w.collect(), &[3, t, t]).unwrap()
    };
    let (p, zeroed) = (weights(f32::NAN), weights(0.0));
    let v = sample(&[3, t, 8], DType::BF16, 2);
    let g = sample(&[3, t, 8], DType::BF16, 3);
    let pt = p.transpose(1, 2).unwrap();
    let (weights, transposed) = (
        p.matmul_causal(&v, Causal::Weights).unwrap(),
        pt.matmul_causal(&g, Causal::WeightsTransposed).unwrap(),
    );
    let bits = |t: &Tensor| t.to_f64_vec().iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    if GemmKernel::auto_for(DType::BF16) == GemmKernel::Bf16Dot {
        assert_eq!(bits(&weights), bits(&zeroed.matmul(&v).unwrap()));
        let zt = zeroed.transpose(1, 2).unwrap();
        assert_eq!(bits(&transposed), bits(&zt.matmul(&g).unwrap()));
    } else {
        // Without the instruction the parts are the widened dense products,
        // which read the NaN.
        assert_eq!(bits(&weights), bits(&p.matmul(&v).unwrap()));
        assert_eq!(bits(&transposed), bits(&pt.matmul(&g).unwrap()));
    }
    scores_skip_later_keys(t, DType::BF16);
}
