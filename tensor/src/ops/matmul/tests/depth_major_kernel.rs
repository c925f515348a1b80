//! Tests of the kernel for products whose operands both run along the depth
//! in their slow dim (a weight gradient `dyᵀ·x`).

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

/// The depth-major kernel against the `gemm` crate on the same views, and both
/// against the f64 product: ragged tiles of rows (m not a multiple of 6) and
/// columns (not of 64), depths past one packed panel (128) and past the
/// `gemm` crate's own blocks, blocks of rows (past 192), of packed columns
/// (past 1024) and of output rows per pass over the depth (past 1024 rows of
/// a block of 1024 columns, the 4 MiB block), operands narrowed from wider
/// tensors. Each element is one
/// chain of fused multiply-adds over the depth from zero, so where the `gemm`
/// crate sums the whole depth in one chain (every shape here) the bits agree.
#[cfg(target_arch = "x86_64")]
#[test]
fn depth_major_products_have_the_gemm_crates_bits() {
    if !small::detected() {
        // Without AVX-512F the kernel never runs (`fits` is false): the
        // `gemm` crate's products are checked by the other tests.
        assert!(!depth_major::fits(
            [64, 64, 64],
            mat(&sample(&[64, 64], DType::F32, 1).transpose(0, 1).unwrap()),
            mat(&sample(&[64, 64], DType::F32, 2))
        ));
        return;
    }
    let shapes = [
        (16, 16, 16),
        (37, 129, 65),
        (200, 300, 130),
        (20, 64, 1030),
        (193, 130, 64),
        (1100, 130, 1030),
    ];
    for (case, &(m, k, n)) in shapes.iter().enumerate() {
        let seed = 10 * case as u64;
        // `a` is the transposed view of a row-major [k, m + 3] narrowed to m
        // columns; `b` a row-major [k, n + 5] narrowed to n.
        let a = sample(&[k, m + 3], DType::F32, seed)
            .narrow(1, 2, m)
            .unwrap()
            .transpose(0, 1)
            .unwrap();
        let b = sample(&[k, n + 5], DType::F32, seed + 1).narrow(1, 1, n).unwrap();
        assert!(depth_major::fits([m, k, n], mat(&a), mat(&b)), "{m}x{k}x{n} must fit");
        let run = |depth_major: bool| {
            let mut c = vec![f32::NAN; m * n];
            // SAFETY: both operands are m×k and k×n views of live tensors, `c`
            // holds m rows of n.
            unsafe {
                if depth_major {
                    depth_major::product([m, k, n], mat(&a), mat(&b), c.as_mut_ptr(), n as isize);
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
        let (got, gemm) = (run(true), run(false));
        let bits = |c: &[f32]| c.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        let what = format!("{m}x{k}x{n}");
        assert_eq!(bits(&got), bits(&gemm), "{what}: the gemm crate's bits");
        let (_, want) = reference(&a.contiguous(), &b.contiguous());
        let got = Tensor::from_vec(got, &[m, n]).unwrap();
        assert_close(&got, &want, 4.0 * k as f64 * tol(DType::F32), &what);
    }
}

/// Which products take the kernel: a left operand with unit row stride (a
/// transposed row-major matrix) times a right one with unit column stride,
/// no side under 16; everything else stays on the `gemm` crate.
#[cfg(target_arch = "x86_64")]
#[test]
fn only_depth_major_operands_take_the_kernel() {
    let at = Mat::<f32> {
        ptr: std::ptr::null(),
        rs: 1,
        cs: 300,
    };
    let b = Mat::<f32> {
        ptr: std::ptr::null(),
        rs: 300,
        cs: 1,
    };
    let on = small::detected();
    assert_eq!(depth_major::fits([256, 1024, 256], at, b), on, "dyᵀ·x");
    let a_rows = Mat::<f32> { rs: 300, cs: 1, ..at };
    assert!(!depth_major::fits([256, 1024, 256], a_rows, b), "row-major left: x·W");
    let b_cols = Mat::<f32> { rs: 1, cs: 300, ..b };
    assert!(
        !depth_major::fits([256, 1024, 256], at, b_cols),
        "transposed right: x·Wᵀ"
    );
    assert!(!depth_major::fits([15, 1024, 256], at, b), "too few rows");
    assert!(!depth_major::fits([256, 15, 256], at, b), "too shallow");
    assert!(!depth_major::fits([256, 1024, 15], at, b), "too few columns");
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
