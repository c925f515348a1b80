//! Tests of the outer-product kernel for the layouts the `gemm` crate packs
//! by gathering (a weight gradient `dyᵀ·x`, a linear layer's `x·Wᵀ`).

use tessera_mesh::DType;

use super::*;
use crate::ops::testutil::{assert_close, sample, tol};

/// The operand of a tensor view, as the kernels read it.
fn mat(t: &Tensor) -> Mat<f32> {
    Mat {
        ptr: t.view::<f32>().unwrap().as_ptr(),
        rs: t.strides()[0] as isize,
        cs: t.strides()[1] as isize,
    }
}

/// The three layouts the kernel takes, as views of wider tensors: `a`
/// depth-major (the transposed view of a row-major `[k, m + 3]` narrowed to
/// m columns) or row-major (`[m, k + 3]` narrowed); `b` row-major (`[k, n +
/// 5]` narrowed) or transposed (the view of a row-major `[n, k + 5]`
/// narrowed).
fn layouts(m: usize, k: usize, n: usize, seed: u64) -> Vec<(&'static str, Tensor, Tensor)> {
    let depth_major = || {
        sample(&[k, m + 3], DType::F32, seed)
            .narrow(1, 2, m)
            .unwrap()
            .transpose(0, 1)
            .unwrap()
    };
    let rows = || sample(&[m, k + 3], DType::F32, seed).narrow(1, 1, k).unwrap();
    let b_rows = || sample(&[k, n + 5], DType::F32, seed + 1).narrow(1, 1, n).unwrap();
    let b_turned = || {
        sample(&[n, k + 5], DType::F32, seed + 1)
            .narrow(1, 3, k)
            .unwrap()
            .transpose(0, 1)
            .unwrap()
    };
    vec![
        ("dyᵀ·x", depth_major(), b_rows()),
        ("dyᵀ·Wᵀ", depth_major(), b_turned()),
        ("x·Wᵀ", rows(), b_turned()),
    ]
}

/// The kernel against the `gemm` crate on the same views, and both against
/// the f64 product, in each layout it takes: ragged tiles of rows (m not a
/// multiple of 6) and columns (not of 64), depths past one packed panel
/// (128), not a multiple of 16 and past the `gemm` crate's own blocks,
/// blocks of rows (past 192), of packed columns (past 1024) and of output
/// rows per pass over the depth (past 1024 rows of a block of 1024 columns,
/// the 4 MiB block). Each element is one chain of fused multiply-adds over
/// the depth from zero (checked against `f32::mul_add` in order), so where
/// the `gemm` crate sums the whole depth in one chain (up to 512) the bits
/// agree.
#[cfg(target_arch = "x86_64")]
#[test]
fn outer_products_have_the_gemm_crates_bits() {
    let shapes = [
        (16, 16, 16),
        (37, 129, 65),
        (200, 300, 130),
        (20, 64, 1030),
        (193, 130, 64),
        (1100, 130, 1030),
        (37, 521, 530),
        (200, 600, 1030),
    ];
    let mut ran = 0;
    for (case, &(m, k, n)) in shapes.iter().enumerate() {
        for (layout, a, b) in layouts(m, k, n, 10 * case as u64) {
            let what = format!("{layout} {m}x{k}x{n}");
            if !outer::fits([m, k, n], mat(&a), mat(&b)) {
                // x·Wᵀ only 512 to 1024 deep and from 512 wide; nothing without
                // AVX-512F.
                assert!(
                    !small::detected() || (layout == "x·Wᵀ" && k.min(n) < 512),
                    "{what} must fit"
                );
                continue;
            }
            ran += 1;
            let run = |outer: bool| {
                let mut c = vec![f32::NAN; m * n];
                // SAFETY: both operands are m×k and k×n views of live
                // tensors, `c` holds m rows of n.
                unsafe {
                    if outer {
                        outer::product([m, k, n], mat(&a), mat(&b), c.as_mut_ptr(), n as isize);
                    } else {
                        <f32 as Gemm>::gemm(
                            GemmKernel::Gemm,
                            [m, k, n],
                            mat(&a),
                            mat(&b),
                            c.as_mut_ptr(),
                            n as isize,
                        );
                    }
                }
                c
            };
            let got = run(true);
            let bits = |c: &[f32]| c.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            // One fused multiply-add chain per element, in the depth's order.
            let (av, bv) = (
                a.contiguous().to_vec::<f32>().unwrap(),
                b.contiguous().to_vec::<f32>().unwrap(),
            );
            let chain: Vec<f32> = (0..m * n)
                .map(|e| (0..k).fold(0f32, |acc, t| av[e / n * k + t].mul_add(bv[t * n + e % n], acc)))
                .collect();
            assert_eq!(bits(&got), bits(&chain), "{what}: one FMA chain per element");
            if k <= 512 {
                assert_eq!(bits(&got), bits(&run(false)), "{what}: the gemm crate's bits");
            }
            let (_, want) = reference(&a.contiguous(), &b.contiguous());
            let got = Tensor::from_vec(got, &[m, n]).unwrap();
            assert_close(&got, &want, 4.0 * k as f64 * tol(DType::F32), &what);
        }
    }
    assert_eq!(ran, if small::detected() { 18 } else { 0 }, "products the kernel ran");
}

/// Which products take the kernel: depth-major left operands (unit row
/// stride) times row-major or transposed right ones, row-major left times
/// transposed right 512 to 1024 deep and from 512 wide, no side under 16; row-major
/// times row-major and everything else stays on the `gemm` crate.
#[cfg(target_arch = "x86_64")]
#[test]
fn only_the_layouts_the_gemm_crate_gathers_take_the_kernel() {
    let on = small::detected();
    let mat = |rs: isize, cs: isize| Mat::<f32> {
        ptr: std::ptr::null(),
        rs,
        cs,
    };
    let (depth_major, rows) = (mat(1, 1100), mat(1100, 1));
    let (b_rows, b_turned) = (mat(1100, 1), mat(1, 1100));
    assert_eq!(outer::fits([256, 1024, 256], depth_major, b_rows), on, "dyᵀ·x");
    assert_eq!(outer::fits([256, 1024, 256], depth_major, b_turned), on, "dyᵀ·Wᵀ");
    assert_eq!(outer::fits([256, 1024, 512], rows, b_turned), on, "x·Wᵀ");
    assert!(!outer::fits([256, 1024, 511], rows, b_turned), "x·Wᵀ, narrow");
    assert!(!outer::fits([256, 511, 1024], rows, b_turned), "x·Wᵀ, shallow");
    assert!(!outer::fits([256, 1025, 1024], mat(1100, 1), b_turned), "x·Wᵀ, deep");
    assert!(!outer::fits([256, 1024, 256], rows, b_rows), "row-major both: x·W");
    assert!(
        !outer::fits([256, 1024, 1024], mat(1100, 1100), b_rows),
        "no unit stride"
    );
    assert!(!outer::fits([15, 1024, 256], depth_major, b_rows), "too few rows");
    assert!(!outer::fits([256, 15, 256], depth_major, b_rows), "too shallow");
    assert!(!outer::fits([256, 1024, 15], depth_major, b_rows), "too few columns");
}

/// A weight gradient `dyᵀ·x` through `matmul` (a transposed view on the
/// left, split over the rank's threads by rows of the output) has the same
/// bits on one thread as on three, and is the f64 product's to rounding.
#[test]
fn a_split_weight_gradient_equals_the_single_threaded_one() {
    let (tokens, out, features) = (300, 520, 200);
    let dy = sample(&[tokens, out], DType::F32, 31);
    let x = sample(&[tokens, features], DType::F32, 32);
    assert!(split(3, [out, tokens, features]).parts > 1, "the case must split");
    let product = |threads: usize| {
        let (dy, x) = (dy.clone(), x.clone());
        let opts = tessera_mesh::LaunchOptions::default().threads_per_rank(threads);
        tessera_mesh::launch_with(&opts, 1, move |_| Ok(dy.transpose(0, 1)?.matmul(&x)?)).unwrap()
    };
    let (one, three) = (product(1), product(3));
    assert_eq!(one[0].to_f64_vec(), three[0].to_f64_vec());
    let (_, want) = reference(&dy.transpose(0, 1).unwrap().contiguous(), &x);
    assert_close(&three[0], &want, 4.0 * tokens as f64 * tol(DType::F32), "dyᵀ·x");
}
