//! Tests of the matrix product.

use tessera_mesh::DType;

use super::half_gemm::{HALF_PANEL_BYTES, HALF_SCRATCH, HALF_SCRATCH_KEEP};
use super::*;
use crate::ops::testutil::{assert_close, sample, tol};

mod bf16_dot;
mod causal;
mod outer_kernel;

#[test]
fn large_products_split_over_the_ranks_threads() {
    let rows = |block, parts| Split {
        by_rows: true,
        block,
        parts,
    };
    assert_eq!(split(2, [1024, 256, 256]), rows(512, 2));
    assert_eq!(split(3, [1000, 256, 256]), rows(336, 3), "blocks of whole tiles");
    assert_eq!(
        split(2, [256, 1024, 4096]),
        Split {
            by_rows: false,
            block: 2048,
            parts: 2
        },
        "wide: by columns"
    );
    assert_eq!(split(1, [1024, 256, 256]).parts, 1, "one thread");
    assert_eq!(
        split(1, [256, 768, 32000]),
        Split {
            by_rows: false,
            block: MAX_BLOCK_COLUMNS,
            parts: 8
        },
        "a vocabulary-wide head, in blocks of columns on one thread too"
    );
    assert_eq!(split(2, [256, 768, 32000]).block, MAX_BLOCK_COLUMNS, "and on two");
    assert_eq!(split(2, [16, 16, 16]).parts, 1, "too small");
    assert_eq!(split(8, [40, 100_000, 8]), rows(16, 3), "no block under a tile");
}

#[test]
fn small_batched_products_split_by_entry() {
    // Attention's per-head products: 64 entries of 1 MFLOP.
    assert_eq!(batch_threads(2, 64, [128, 32, 128]), 2);
    assert_eq!(batch_threads(1, 64, [128, 32, 128]), 1, "one thread");
    assert_eq!(batch_threads(4, 3, [256, 32, 256]), 3, "no more threads than entries");
    assert_eq!(batch_threads(2, 4, [8, 8, 8]), 1, "too little work in all");
    assert_eq!(batch_threads(2, 4, [1024, 256, 256]), 1, "each entry splits itself");
}

#[test]
fn a_split_batch_equals_the_single_threaded_one() {
    let (a, b) = (
        sample(&[4, 64, 64, 32], DType::F32, 13),
        sample(&[64, 32, 64], DType::F32, 14),
    );
    assert_eq!(batch_threads(2, 256, [64, 32, 64]), 2, "the case must split");
    let product = |threads: usize| {
        let (a, b) = (a.clone(), b.clone());
        let opts = tessera_mesh::LaunchOptions::default().threads_per_rank(threads);
        tessera_mesh::launch_with(&opts, 1, move |_| Ok(a.matmul(&b)?)).unwrap()
    };
    let (one, two) = (product(1), product(2));
    assert_eq!(one[0].to_f64_vec(), two[0].to_f64_vec());
    let (shape, want) = reference(&a, &b);
    assert_eq!(two[0].shape(), &shape[..]);
    assert_close(&two[0], &want, 1e-5, "split batch (f32 sums of 32 products)");
}

#[test]
fn a_split_product_equals_the_single_threaded_one() {
    // By rows, by columns, and by rows of an uneven last block.
    for (sa, sb) in [
        ([512, 256], [256, 384]),
        ([96, 256], [256, 1024]),
        ([520, 192], [192, 200]),
    ] {
        let (a, b) = (sample(&sa, DType::F32, 11), sample(&sb, DType::F32, 12));
        assert!(split(3, [sa[0], sa[1], sb[1]]).parts > 1, "{sa:?} x {sb:?} must split");
        for kernel in [GemmKernel::Gemm, GemmKernel::MatrixMultiply] {
            let product = |threads: usize| {
                let (a, b) = (a.clone(), b.clone());
                let opts = tessera_mesh::LaunchOptions::default().threads_per_rank(threads);
                tessera_mesh::launch_with(&opts, 1, move |_| Ok(a.matmul_with(&b, kernel)?)).unwrap()
            };
            let (one, three) = (product(1), product(3));
            assert_eq!(
                one[0].to_f64_vec(),
                three[0].to_f64_vec(),
                "{sa:?} x {sb:?} {kernel:?}: each output element sums in the same order"
            );
            let (_, want) = reference(&a, &b);
            assert_close(&three[0], &want, 4.0 * sa[1] as f64 * tol(DType::F32), "split product");
        }
    }
}

/// A product wider than [`MAX_BLOCK_COLUMNS`] runs in blocks of columns (an
/// uneven last one here), with the bits of one call of the kernel over all of
/// it: each output element sums in the same order.
#[test]
fn a_wide_product_in_blocks_of_columns_equals_one_call() {
    let (m, k, n) = (64, 40, MAX_BLOCK_COLUMNS + 904);
    let (a, b) = (sample(&[m, k], DType::F32, 21), sample(&[k, n], DType::F32, 22));
    assert_eq!(split(1, [m, k, n]).parts, 2, "the case must run in two blocks");
    let opts = tessera_mesh::LaunchOptions::default().threads_per_rank(1);
    let (a2, b2) = (a.clone(), b.clone());
    let blocked = tessera_mesh::launch_with(&opts, 1, move |_| Ok(a2.matmul_with(&b2, GemmKernel::Gemm)?)).unwrap();
    let mat = |t: &Tensor| Mat {
        ptr: t.view::<f32>().unwrap().as_ptr(),
        rs: t.strides()[0] as isize,
        cs: t.strides()[1] as isize,
    };
    let mut whole = vec![f32::NAN; m * n];
    // SAFETY: `a` and `b` are m×k and k×n views of live tensors; `whole`
    // holds m rows of n.
    unsafe {
        <f32 as Gemm>::gemm(
            GemmKernel::Gemm,
            [m, k, n],
            mat(&a),
            mat(&b),
            whole.as_mut_ptr(),
            n as isize,
        )
    };
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&blocked[0].to_vec::<f32>().unwrap()), bits(&whole));
}

/// The half-precision product as the f32 GEMM of the widened operands,
/// rounded once: what the fused path must equal bit for bit.
fn widened_product(a: &Tensor, b: &Tensor, kernel: GemmKernel) -> Vec<f64> {
    let (a32, b32) = (a.cast(DType::F32).unwrap(), b.cast(DType::F32).unwrap());
    let p = a32.matmul_with(&b32, kernel).unwrap().cast(a.dtype()).unwrap();
    p.to_f64_vec()
}

#[test]
fn half_products_round_the_f32_product_once() {
    // Panels by columns (n >= m) and by rows, one panel and several (an
    // uneven last one: the f32 panel holds 2^18 elements), row-major,
    // transposed, narrowed, strided and batched operands.
    let t = |shape: &[usize], dtype, seed| sample(shape, dtype, seed).transpose(0, 1).unwrap();
    for dtype in [DType::BF16, DType::F16] {
        let cases: Vec<(Tensor, Tensor)> = vec![
            (sample(&[64, 48], dtype, 1), sample(&[48, 96], dtype, 2)),
            (sample(&[96, 48], dtype, 1), t(&[40, 48], dtype, 2)),
            (sample(&[200, 64], dtype, 3), t(&[2100, 64], dtype, 4)),
            (t(&[72, 2100], dtype, 5), sample(&[72, 200], dtype, 6)),
            (
                sample(&[40, 80], dtype, 7).narrow(1, 8, 64).unwrap(),
                sample(&[64, 30], dtype, 8),
            ),
            // Neither stride 1: rows 2 apart, columns 100 apart.
            (
                sample(&[64, 50, 2], dtype, 9)
                    .narrow(2, 0, 1)
                    .unwrap()
                    .permute(&[2, 1, 0])
                    .unwrap(),
                sample(&[64, 30], dtype, 10),
            ),
            (sample(&[3, 33, 17], dtype, 11), t(&[40, 17], dtype, 12)),
            (sample(&[4, 128, 32], dtype, 13), sample(&[4, 32, 128], dtype, 14)),
        ];
        for (a, b) in &cases {
            let [m, n] = [a.shape()[a.rank() - 2], b.shape()[b.rank() - 1]];
            let long_panels = (HALF_PANEL_BYTES / 4 / m.min(n)).next_multiple_of(SPLIT_ALIGN);
            let what = format!(
                "{:?} x {:?} {dtype} ({} panels)",
                a.shape(),
                b.shape(),
                m.max(n).div_ceil(long_panels)
            );
            for kernel in [GemmKernel::Gemm, GemmKernel::MatrixMultiply] {
                let got = a.matmul_with(b, kernel).unwrap();
                assert_eq!(got.dtype(), dtype, "{what}");
                assert_eq!(got.to_f64_vec(), widened_product(a, b, kernel), "{what} {kernel:?}");
            }
        }
    }
}

#[test]
fn half_products_split_over_threads_equal_the_single_threaded_one() {
    let (a, b) = (
        sample(&[520, 192], DType::BF16, 21),
        sample(&[200, 192], DType::BF16, 22),
    );
    let b = b.transpose(0, 1).unwrap();
    assert!(split(2, [520, 192, 200]).parts > 1, "the case must split");
    let product = |threads: usize| {
        let (a, b) = (a.clone(), b.clone());
        let opts = tessera_mesh::LaunchOptions::default().threads_per_rank(threads);
        tessera_mesh::launch_with(&opts, 1, move |_| Ok(a.matmul_with(&b, GemmKernel::auto())?)).unwrap()
    };
    let two = product(2);
    assert_eq!(product(1)[0].to_f64_vec(), two[0].to_f64_vec());
    assert_eq!(two[0].to_f64_vec(), widened_product(&a, &b, GemmKernel::auto()));
}

#[test]
fn half_product_scratch_is_kept_only_up_to_its_cap() {
    let scratch = || HALF_SCRATCH.with(|s| s.borrow().iter().map(|v| v.capacity() * 4).collect::<Vec<_>>());
    // Run on a fresh thread so other tests' products do not count.
    std::thread::spawn(move || {
        // The widened path (f16: never the bf16 dot kernel).
        let (a, b) = (sample(&[64, 64], DType::F16, 1), sample(&[64, 64], DType::F16, 2));
        a.matmul(&b).unwrap();
        let kept = scratch();
        assert!(
            kept.iter().all(|&c| c > 0),
            "a small product's scratch is kept for the next: {kept:?}"
        );
        // A widened operand of 4096 x 2304 f32 (36 MiB) is over the cap.
        let (a, b) = (sample(&[4096, 2304], DType::F16, 3), sample(&[2304, 16], DType::F16, 4));
        a.matmul(&b).unwrap();
        let kept = scratch();
        assert!(
            kept.iter().all(|&c| c <= HALF_SCRATCH_KEEP),
            "scratch over the cap is freed: {kept:?}"
        );
        assert!(kept[2] > 0, "the output panel, under the cap, is kept");
    })
    .join()
    .unwrap();
}

/// The naive product in f64 with torch.matmul's shape rules.
fn reference(a: &Tensor, b: &Tensor) -> (Vec<usize>, Vec<f64>) {
    let promote = |t: &Tensor, left: bool| match (t.rank(), left) {
        (1, true) => vec![1, t.numel()],
        (1, false) => vec![t.numel(), 1],
        _ => t.shape().to_vec(),
    };
    let (sa, sb) = (promote(a, true), promote(b, false));
    let (ra, rb) = (sa.len(), sb.len());
    let (m, k, n) = (sa[ra - 2], sa[ra - 1], sb[rb - 1]);
    let batch = broadcast_shapes("t", &sa[..ra - 2], &sb[..rb - 2]).unwrap();
    let (x, y) = (a.to_f64_vec(), b.to_f64_vec());
    let count: usize = batch.iter().product();
    let mut out = Vec::new();
    let base = |s: &[usize], bi: usize| {
        // Offset of batch entry `bi` of `batch` in a tensor with batch dims `s`.
        let (mut rest, mut off, mut stride) = (bi, 0, 1);
        for d in (0..batch.len()).rev() {
            let i = rest % batch[d];
            rest /= batch[d];
            let lead = batch.len() - s.len();
            if d >= lead {
                let size = s[d - lead];
                off += if size == 1 { 0 } else { i * stride };
                stride *= size;
            }
        }
        off
    };
    for bi in 0..count {
        let (oa, ob) = (base(&sa[..ra - 2], bi) * m * k, base(&sb[..rb - 2], bi) * k * n);
        for i in 0..m {
            for j in 0..n {
                out.push((0..k).map(|l| x[oa + i * k + l] * y[ob + l * n + j]).sum());
            }
        }
    }
    let mut shape = batch;
    if a.rank() > 1 {
        shape.push(m);
    }
    if b.rank() > 1 {
        shape.push(n);
    }
    (shape, out)
}

#[test]
fn matmul_table() {
    macro_rules! case {
        ($a:expr, $b:expr, $shape:expr) => {
            for dtype in [DType::F32, DType::F64, DType::BF16, DType::F16] {
                let (a, b): (Tensor, Tensor) = ($a(dtype), $b(dtype));
                let (shape, want) = reference(&a, &b);
                assert_eq!(shape, $shape);
                for kernel in [GemmKernel::Gemm, GemmKernel::MatrixMultiply] {
                    let got = a.matmul_with(&b, kernel).unwrap();
                    let what = format!("{:?} x {:?} {dtype} {kernel:?}", a.shape(), b.shape());
                    assert_eq!(got.shape(), &shape[..], "{what}");
                    assert_eq!(got.dtype(), dtype);
                    // Sums of k products: allow a few roundings per term.
                    let k = a.shape()[a.rank() - 1].max(1) as f64;
                    assert_close(&got, &want, 4.0 * k * tol(dtype), &what);
                }
                assert_eq!(a.matmul(&b).unwrap().shape(), &shape[..]);
            }
        };
    }
    let s = |shape: &'static [usize], seed| move |d| sample(shape, d, seed);
    let t = |shape: &'static [usize], seed| move |d| sample(shape, d, seed).transpose(0, 1).unwrap();
    case!(s(&[2, 3], 1), s(&[3, 4], 2), vec![2, 4]);
    case!(s(&[1, 1], 1), s(&[1, 1], 2), vec![1, 1]);
    case!(s(&[17, 33], 1), s(&[33, 9], 2), vec![17, 9]);
    case!(t(&[3, 2], 1), s(&[3, 4], 2), vec![2, 4]);
    case!(s(&[2, 3], 1), t(&[4, 3], 2), vec![2, 4]);
    case!(t(&[3, 2], 1), t(&[4, 3], 2), vec![2, 4]);
    case!(s(&[2, 3, 4], 1), s(&[2, 4, 5], 2), vec![2, 3, 5]);
    case!(s(&[2, 1, 3, 4], 1), s(&[3, 4, 5], 2), vec![2, 3, 3, 5]);
    case!(s(&[5, 3, 4], 1), s(&[4, 2], 2), vec![5, 3, 2]);
    case!(s(&[2, 5, 3, 4], 1), t(&[2, 4], 2), vec![2, 5, 3, 2]);
    case!(s(&[3, 4], 1), s(&[2, 4, 5], 2), vec![2, 3, 5]);
    case!(s(&[4], 1), s(&[4, 3], 2), vec![3]);
    case!(s(&[3, 4], 1), s(&[4], 2), vec![3]);
    case!(s(&[4], 1), s(&[4], 2), Vec::<usize>::new());
    case!(s(&[4], 1), s(&[2, 4, 3], 2), vec![2, 3]);
    case!(s(&[2, 3, 4], 1), s(&[4], 2), vec![2, 3]);
    // Batched transposes (attention's q·kᵀ) and narrowed views.
    let kt = |d| sample(&[2, 5, 4], d, 3).transpose(1, 2).unwrap();
    case!(s(&[2, 3, 4], 1), kt, vec![2, 3, 5]);
    let qn = |d| sample(&[2, 3, 8], d, 4).narrow(2, 2, 4).unwrap();
    case!(qn, kt, vec![2, 3, 5]);
    let rows = |d| sample(&[4, 6, 4], d, 5).narrow(1, 1, 3).unwrap();
    case!(rows, s(&[4, 2], 2), vec![4, 3, 2]);
    let perm = |d| sample(&[3, 2, 4], d, 6).permute(&[1, 0, 2]).unwrap();
    case!(perm, s(&[4, 5], 2), vec![2, 3, 5]);
    // Empty dims.
    case!(s(&[2, 0], 1), s(&[0, 3], 2), vec![2, 3]);
    case!(s(&[0, 3], 1), s(&[3, 2], 2), vec![0, 2]);
    case!(s(&[2, 3], 1), s(&[3, 0], 2), vec![2, 0]);
    case!(s(&[0, 2, 3], 1), s(&[3, 2], 2), vec![0, 2, 2]);
}

/// The output is not zeroed before the GEMM writes it: with the allocator
/// handing back blocks just filled with NaN, every path (one tall GEMM,
/// per-batch GEMMs, broadcast batches, vectors, both kernels) still gives
/// the reference product.
#[test]
fn matmul_writes_every_output_element() {
    let cases: [(&[usize], &[usize]); 6] = [
        (&[17, 33], &[33, 9]),
        (&[3, 5, 7], &[7, 11]),
        (&[3, 5, 7], &[3, 7, 11]),
        (&[2, 1, 5, 3], &[4, 3, 6]),
        (&[1, 64], &[64, 1]),
        (&[65, 2], &[2, 130]),
    ];
    for (sa, sb) in cases {
        for dtype in [DType::F32, DType::F64] {
            let (a, b) = (sample(sa, dtype, 7), sample(sb, dtype, 8));
            let (shape, want) = reference(&a, &b);
            for kernel in [GemmKernel::Gemm, GemmKernel::MatrixMultiply] {
                for _ in 0..3 {
                    drop(std::hint::black_box(vec![f64::NAN; want.len()]));
                    drop(std::hint::black_box(vec![f32::NAN; want.len()]));
                    let got = a.matmul_with(&b, kernel).unwrap();
                    assert_eq!(got.shape(), &shape[..]);
                    let what = format!("{sa:?} x {sb:?} {dtype} {kernel:?}");
                    assert_close(&got, &want, 4.0 * sa[sa.len() - 1] as f64 * tol(dtype), &what);
                }
            }
        }
    }
}

#[test]
fn matmul_known_product() {
    let a = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]).unwrap();
    let b = Tensor::from_vec(vec![7.0f32, 8.0, 9.0, 10.0, 11.0, 12.0], &[3, 2]).unwrap();
    for kernel in [GemmKernel::Gemm, GemmKernel::MatrixMultiply] {
        let c = a.matmul_with(&b, kernel).unwrap();
        assert_eq!(c.to_vec::<f32>().unwrap(), vec![58.0, 64.0, 139.0, 154.0]);
    }
    let zero = Tensor::zeros(&[2, 0], DType::F64)
        .unwrap()
        .matmul(&Tensor::zeros(&[0, 2], DType::F64).unwrap());
    assert_eq!(zero.unwrap().to_vec::<f64>().unwrap(), vec![0.0; 4]);
}

#[test]
fn matmul_errors() {
    macro_rules! case {
        ($res:expr, $msg:expr) => {
            assert_eq!($res.unwrap_err().to_string(), $msg);
        };
    }
    let f = |shape: &[usize]| sample(shape, DType::F32, 1);
    case!(
        f(&[2, 3]).matmul(&f(&[4, 5])),
        "matmul: shape mismatch: cannot multiply [2, 3] by [4, 5]: inner dims 3 and 4 differ"
    );
    case!(
        f(&[2, 2, 3]).matmul(&f(&[3, 3, 4])),
        "matmul: shape mismatch: cannot multiply [2, 2, 3] by [3, 3, 4]: batch dims [2] and [3] do not broadcast"
    );
    case!(
        f(&[3]).matmul(&f(&[4])),
        "matmul: shape mismatch: cannot multiply [3] by [4]: inner dims 3 and 4 differ"
    );
    case!(
        f(&[]).matmul(&f(&[2])),
        "matmul: cannot multiply [] by [2]: both operands need at least one dim; use mul for scalars"
    );
    case!(
        f(&[2, 2]).matmul(&sample(&[2, 2], DType::F64, 1)),
        "matmul: expected dtype f32, got f64"
    );
    let i = Tensor::zeros(&[2, 2], DType::I64).unwrap();
    case!(
        i.matmul(&i),
        "matmul: dtype i64 is not a floating-point type; cast the tensor to a float dtype first"
    );
}

/// An `f32` product by a transposed row-major matrix (a linear layer's `Wᵀ`,
/// here with ragged sizes, a row stride past its width, and a batch of rows
/// folded into one product) is turned over first: the result is the f64
/// product within f32 tolerance, and the product by a contiguous copy of the
/// same operand bit for bit; too few rows keep the strided operand, and so
/// does a weight as wide as deep or wider. The second weight is large enough
/// for the copy to be split over the rank's threads.
#[test]
fn products_by_transposed_weights_turn_them_over() {
    // (x's shape, w's rows, w's width before narrowing to x's last dim): w
    // narrows (fewer rows than x's last dim).
    let cases: [(&[usize], usize, usize); 2] = [(&[3, 25, 23], 13, 27), (&[2, 40, 512], 300, 520)];
    for (case, (xs, rows, width)) in cases.into_iter().enumerate() {
        let k = xs[2];
        let x = sample(xs, DType::F32, 1);
        let w = sample(&[rows, width], DType::F32, 2).narrow(1, 2, k).unwrap();
        let wt = w.transpose(0, 1).unwrap();
        assert_eq!(
            (wt.strides()[0], wt.strides()[1]),
            (1, width),
            "a transposed, narrowed view"
        );
        let view = wt.view::<f32>().unwrap();
        let mat = |t: &Tensor| Mat {
            ptr: view.as_ptr(),
            rs: t.strides()[0] as isize,
            cs: t.strides()[1] as isize,
        };
        let m = xs[0] * xs[1];
        assert!(turned_rhs(GemmKernel::Gemm, m, [k, rows], mat(&wt)).unwrap().is_some());
        assert!(
            turned_rhs(GemmKernel::Gemm, TURN_MIN_ROWS - 1, [k, rows], mat(&wt))
                .unwrap()
                .is_none()
        );
        // A weight as wide as deep (its first k rows) or wider keeps the view.
        let wide = sample(&[k + 5, width], DType::F32, 3).narrow(1, 2, k).unwrap();
        let wide_t = wide.transpose(0, 1).unwrap();
        let wide_view = wide_t.view::<f32>().unwrap();
        let wide_mat = Mat {
            ptr: wide_view.as_ptr(),
            rs: 1,
            cs: width as isize,
        };
        for n in [k, k + 5] {
            assert!(
                turned_rhs(GemmKernel::Gemm, m, [k, n], wide_mat).unwrap().is_none(),
                "k {k}, n {n}"
            );
        }
        assert!(
            turned_rhs(GemmKernel::MatrixMultiply, m, [k, rows], mat(&wt))
                .unwrap()
                .is_none()
        );
        let got = x.matmul_with(&wt, GemmKernel::Gemm).unwrap();
        let (shape, want) = reference(&x, &wt);
        assert_eq!(got.shape(), &shape[..]);
        assert_close(
            &got,
            &want,
            4.0 * k as f64 * tol(DType::F32),
            &format!("x·Wᵀ turned over, case {case}"),
        );
        let copy = x.matmul_with(&wt.contiguous(), GemmKernel::Gemm).unwrap();
        let bits = |t: &Tensor| {
            t.to_vec::<f32>()
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect::<Vec<_>>()
        };
        assert_eq!(bits(&got), bits(&copy), "case {case}");
    }
}
