//! Tests of the `bf16` dot-product kernel (`GemmKernel::Bf16Dot`): exact
//! sums rounded once, its split over threads, subnormals, refusals and the
//! scratch it keeps.

use tessera_mesh::DType;

use super::*;

/// A `bf16` tensor of `shape` with small integers (-2..=2): every sum of their
/// products is exact in `f32`, so any summation order gives the same bits.
fn small_integers(shape: &[usize], seed: u64) -> Tensor {
    let n: usize = shape.iter().product();
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let values: Vec<f32> = (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % 5) as f32 - 2.0
        })
        .collect();
    Tensor::from_vec(values, shape).unwrap().cast(DType::BF16).unwrap()
}

/// Products that cover the dot kernel's edges: rows and columns not multiples
/// of its 12 × 32 tile, odd `k` and `k = 1`, several row blocks (1000 rows of
/// `k = 2100` are 9 blocks), row-major, transposed, narrowed, strided (no
/// stride 1) and batched operands.
fn dot_cases(make: &dyn Fn(&[usize], u64) -> Tensor) -> Vec<(Tensor, Tensor)> {
    let t = |shape: &[usize], seed| make(shape, seed).transpose(0, 1).unwrap();
    vec![
        (make(&[64, 48], 1), make(&[48, 96], 2)),
        (make(&[13, 7], 1), make(&[7, 33], 2)),
        (make(&[5, 1], 1), make(&[1, 3], 2)),
        (make(&[96, 48], 1), t(&[40, 48], 2)),
        (t(&[300, 50], 3), make(&[300, 70], 4)),
        (make(&[1000, 2100], 5), t(&[45, 2100], 6)),
        (make(&[40, 80], 7).narrow(1, 8, 63).unwrap(), make(&[63, 30], 8)),
        (
            make(&[64, 50, 2], 9)
                .narrow(2, 0, 1)
                .unwrap()
                .permute(&[2, 1, 0])
                .unwrap(),
            make(&[30, 64, 2], 10)
                .narrow(2, 1, 1)
                .unwrap()
                .permute(&[2, 1, 0])
                .unwrap(),
        ),
        (make(&[3, 33, 17], 11), t(&[40, 17], 12)),
        (make(&[4, 128, 32], 13), make(&[4, 32, 128], 14)),
    ]
}

#[test]
fn bf16_dot_products_are_exact_sums_rounded_once() {
    if !GemmKernel::bf16_dot_detected() {
        let (a, b) = (small_integers(&[4, 4], 1), small_integers(&[4, 4], 2));
        let err = a.matmul_with(&b, GemmKernel::Bf16Dot).unwrap_err().to_string();
        assert!(err.contains("lacks the AVX512_BF16"), "{err}");
        assert_eq!(GemmKernel::auto_for(DType::BF16), GemmKernel::auto());
        return;
    }
    // Exact sums (small integers): the dot kernel equals the widened f32 GEMM
    // and the f64 product rounded to bf16, bit for bit, at every edge.
    for (a, b) in &dot_cases(&small_integers) {
        let what = format!("{:?} x {:?}", a.shape(), b.shape());
        let got = a.matmul_with(b, GemmKernel::Bf16Dot).unwrap();
        assert_eq!(got.dtype(), DType::BF16, "{what}");
        let (shape, want) = reference(a, b);
        assert_eq!(got.shape(), &shape[..], "{what}");
        let rounded: Vec<f64> = want
            .iter()
            .map(|&v| f64::from(half::bf16::from_f32(v as f32)))
            .collect();
        assert_eq!(got.to_f64_vec(), rounded, "{what}");
        assert_eq!(got.to_f64_vec(), widened_product(a, b, GemmKernel::Gemm), "{what}");
    }
}

#[test]
fn bf16_dot_products_are_within_rounding_of_the_exact_product() {
    if !GemmKernel::bf16_dot_detected() {
        assert_eq!(GemmKernel::auto_for(DType::BF16), GemmKernel::auto());
        let (a, b) = (sample(&[4, 4], DType::BF16, 1), sample(&[4, 4], DType::BF16, 2));
        assert!(
            a.matmul_with(&b, GemmKernel::Bf16Dot).is_err(),
            "refused without AVX512_BF16"
        );
        return;
    }
    let make = |shape: &[usize], seed| sample(shape, DType::BF16, seed);
    for (a, b) in &dot_cases(&make) {
        let k = a.shape()[a.rank() - 1];
        let what = format!("{:?} x {:?}", a.shape(), b.shape());
        let got = a.matmul_with(b, GemmKernel::Bf16Dot).unwrap().to_f64_vec();
        let widened = widened_product(a, b, GemmKernel::Gemm);
        let (_, want) = reference(a, b);
        let abs = |t: &Tensor| {
            let v: Vec<f64> = t.to_f64_vec().iter().map(|x| x.abs()).collect();
            Tensor::from_vec(v, t.shape()).unwrap()
        };
        let (_, magnitude) = reference(&abs(a), &abs(b));
        // f32 sums in any order: |error| <= k·2⁻²⁴·Σ|a·b|; then one rounding to
        // bf16: half an ulp, at most 2⁻⁸ of the result.
        let mut moved = 0;
        for (i, (((&g, &w), &x), &s)) in got.iter().zip(&want).zip(&widened).zip(&magnitude).enumerate() {
            let bound = k as f64 * 2f64.powi(-24) * s;
            assert!(
                (g - w).abs() <= (w.abs() + bound) * 2f64.powi(-8) + bound,
                "{what}: element {i}: got {g}, exact {w}"
            );
            moved += usize::from(g != x);
        }
        // The two kernels sum in different orders: their bf16 results agree
        // except where the f32 sums straddle a rounding boundary.
        assert!(
            moved * 50 <= got.len(),
            "{what}: {moved} of {} differ from the widened kernel",
            got.len()
        );
    }
    // `matmul` on bf16 picks the dot kernel here.
    assert_eq!(GemmKernel::auto_for(DType::BF16), GemmKernel::Bf16Dot);
    let (a, b) = (make(&[70, 90], 3), make(&[90, 50], 4));
    assert_eq!(
        a.matmul(&b).unwrap().to_f64_vec(),
        a.matmul_with(&b, GemmKernel::Bf16Dot).unwrap().to_f64_vec()
    );
}

#[test]
fn bf16_dot_split_over_threads_equals_the_single_threaded_one() {
    if !GemmKernel::bf16_dot_detected() {
        assert!(
            sample(&[2, 2], DType::BF16, 1)
                .matmul_with(&sample(&[2, 2], DType::BF16, 2), GemmKernel::Bf16Dot)
                .is_err()
        );
        return;
    }
    // By rows (with an uneven last block) and by columns; a batch of small products.
    let cases: [(&[usize], &[usize]); 3] = [
        (&[520, 192], &[192, 200]),
        (&[96, 256], &[256, 1024]),
        (&[64, 64, 32], &[64, 32, 64]),
    ];
    for (sa, sb) in cases {
        let (a, b) = (sample(sa, DType::BF16, 21), sample(sb, DType::BF16, 22));
        let product = |threads: usize| {
            let (a, b) = (a.clone(), b.clone());
            let opts = tessera_mesh::LaunchOptions::default().threads_per_rank(threads);
            tessera_mesh::launch_with(&opts, 1, move |_| Ok(a.matmul_with(&b, GemmKernel::Bf16Dot)?)).unwrap()
        };
        assert_eq!(
            product(1)[0].to_f64_vec(),
            product(3)[0].to_f64_vec(),
            "{sa:?} x {sb:?}: each output element sums in the same order"
        );
    }
}

#[test]
fn bf16_dot_counts_subnormal_inputs_as_zero_and_is_refused_for_other_dtypes() {
    let err = |kernel_dtype: DType| {
        let x = sample(&[2, 2], kernel_dtype, 1);
        x.matmul_with(&x, GemmKernel::Bf16Dot).unwrap_err().to_string()
    };
    assert_eq!(
        err(DType::F32),
        "matmul: cannot use GemmKernel::Bf16Dot: it multiplies bf16 operands, not f32; use \
         GemmKernel::auto_for"
    );
    assert!(err(DType::F16).contains("not f16"));
    if !GemmKernel::bf16_dot_detected() {
        assert!(err(DType::BF16).contains("lacks the AVX512_BF16"));
        return;
    }
    // 2⁻¹³⁰ is a bf16 subnormal: times 2¹⁰⁰ it is 2⁻³⁰ for the widened kernel,
    // zero for the instruction; 2⁻¹²⁰ (normal) counts in both.
    let a = Tensor::from_vec(vec![2f32.powi(-130), 2f32.powi(-120)], &[2, 1])
        .unwrap()
        .cast(DType::BF16)
        .unwrap();
    let b = Tensor::from_vec(vec![2f32.powi(100)], &[1, 1])
        .unwrap()
        .cast(DType::BF16)
        .unwrap();
    let dot = a.matmul_with(&b, GemmKernel::Bf16Dot).unwrap().to_f64_vec();
    assert_eq!(dot, vec![0.0, 2f64.powi(-20)]);
    assert_eq!(
        a.matmul_with(&b, GemmKernel::Gemm).unwrap().to_f64_vec(),
        vec![2f64.powi(-30), 2f64.powi(-20)]
    );
}

#[test]
fn bf16_dot_scratch_is_kept_only_up_to_its_cap() {
    if !GemmKernel::bf16_dot_detected() {
        let x = sample(&[2, 2], DType::BF16, 1);
        assert!(
            x.matmul_with(&x, GemmKernel::Bf16Dot).is_err(),
            "refused without AVX512_BF16"
        );
        return;
    }
    use crate::ops::matmul::bf16_dot::{SCRATCH, SCRATCH_KEEP};
    let scratch = || SCRATCH.with(|s| s.borrow().iter().map(|v| v.capacity() * 4).collect::<Vec<_>>());
    // On a fresh rank thread of one intra-op thread (so the product is not
    // split and other tests' products do not count).
    let opts = tessera_mesh::LaunchOptions::default().threads_per_rank(1);
    tessera_mesh::launch_with(&opts, 1, move |_| {
        // A transposed left operand is packed (a row-major one of even k is read in place).
        let a = sample(&[64, 64], DType::BF16, 1).transpose(0, 1).unwrap();
        a.matmul_with(&sample(&[64, 64], DType::BF16, 2), GemmKernel::Bf16Dot)
            .unwrap();
        let kept = scratch();
        assert!(
            kept.iter().all(|&c| c > 0),
            "a small product's scratch is kept: {kept:?}"
        );
        // The right operand packed: 6144 x 4096 bf16 (one block of columns),
        // 48 MiB, over the cap.
        let (a, b) = (
            sample(&[8, 6144], DType::BF16, 3),
            sample(&[6144, MAX_BLOCK_COLUMNS], DType::BF16, 4),
        );
        a.matmul_with(&b, GemmKernel::Bf16Dot).unwrap();
        let kept = scratch();
        assert_eq!(kept[1], 0, "the packed right operand over the cap is freed: {kept:?}");
        assert!(
            kept[0] > 0 && kept[0] <= SCRATCH_KEEP,
            "the left block, under the cap, is kept: {kept:?}"
        );
        Ok(())
    })
    .unwrap();
}
