//! GEMM benchmark: `Tensor::matmul` on one thread with each pure-Rust kernel.
//!
//! ```text
//! cargo run --release --example bench_gemm -- [--json PATH] [--iters N]
//! ```
//!
//! For each case the operands are built once; a sample is as many `matmul_with`
//! calls as fill about 50 ms, samples of the two kernels alternate, and the
//! table shows the median of `N` samples per kernel (default 7, after one
//! warm-up call each). GFLOP/s counts `2·m·n·k` per product.
//!
//! The `gemm cold` column times the `gemm` kernel with its operands evicted
//! from the core's private caches first: before every timed call (one call per
//! timing) the benchmark writes a 64 MiB buffer, untimed. Inside a training
//! step the operands of most products were written long enough before (a
//! saved activation, a freshly gathered weight) that this is the state they
//! are in, so `cold/hot` is the share of the hot figure that a step can expect.
//!
//! In the `gemm` column, batched `f32` products small enough (attention's
//! per-head `q·kᵀ`, depth up to 256 and sides up to 512) run the crate's own
//! AVX-512 kernel for them (same bits as the `gemm` crate; `matmul/small.rs`)
//! where the CPU has AVX-512F.
//!
//! The baseline is `matrixmultiply` (what ndarray's `dot` runs); `ratio` is the
//! `gemm` crate's GFLOP/s over the baseline's (above 1 = `gemm` faster).
//! `GemmKernel::auto()` picks `gemm` on CPUs with AVX-512 and `matrixmultiply`
//! elsewhere. The times include allocating the output tensor, as every
//! `matmul` call does. OpenBLAS is not a dependency (the default build needs no
//! system library), so it is not measured here.
//!
//! A second table times `bf16` products of the bench Transformer's shapes three
//! ways, alternately: the widened path (the `f32` `gemm` kernel with the
//! conversions fused in), `GemmKernel::Bf16Dot` (the CPU's bf16 dot-product
//! instruction, where the CPU has AVX512_BF16; the table says so otherwise),
//! and `f32` operands of the same shape on `gemm`. Its JSON records have
//! `dtype` `bf16` and the fields `via_f32_median_s`, `bf16_dot_median_s`,
//! `f32_gemm_median_s`, `dot_over_via_f32`, `dot_over_f32`.

#[path = "common/mod.rs"]
mod common;

use std::hint::black_box;
use std::process::ExitCode;
use std::time::Instant;

use common::{Json, median};
use tessera::dtensor::{DType, Tensor};
use tessera::tensor::ops::GemmKernel;
use tessera::{BoxError, LaunchOptions, launch_with};

const DEFAULT_ITERS: usize = 7;
/// Wall time one sample aims for.
const SAMPLE_S: f64 = 0.05;

const USAGE: &str = "usage: bench_gemm [--json PATH] [--iters N]
  --json PATH  also write the results as a JSON array of records (atomically)
  --iters N    timed samples per case and kernel (default 7; one warm-up call comes first)";

/// One product: `a [batch.., m, k] × b [batch.., k, n]`, with `b` optionally a
/// transposed view (as `x · Wᵀ` and `q · kᵀ` read it) and `a` optionally one
/// (as a weight gradient `dyᵀ · x` reads it).
struct Case {
    name: &'static str,
    dtype: DType,
    batch: usize,
    m: usize,
    k: usize,
    n: usize,
    a_transposed: bool,
    b_transposed: bool,
}

fn cases() -> Vec<Case> {
    // An f32 product of `batch` entries `[m, k] × [k, n]`, operands transposed views or not.
    let case = |name, batch, mkn, a_t, b_t| Case::new(name, DType::F32, batch, mkn, a_t, b_t);
    let sq = |name, n| case(name, 1, [n, n, n], false, false);
    vec![
        sq("sgemm 512", 512),
        sq("sgemm 1024", 1024),
        sq("sgemm 2048", 2048),
        Case {
            dtype: DType::F64,
            ..sq("dgemm 1024", 1024)
        },
        Case {
            dtype: DType::BF16,
            ..sq("bf16 1024 (via f32)", 1024)
        },
        case("sgemm 1024 x Bᵀ (view)", 1, [1024; 3], false, true),
        // The tiny reference model: a linear layer on 8×32 tokens, and per-head attention scores.
        case("linear [256,64]·Wᵀ[64,256]", 1, [256, 64, 256], false, true),
        case("q·kᵀ 32 × [32,16]·[16,32]", 32, [32, 16, 32], false, true),
        // The bench Transformer's output layer on one rank of FSDP W=2 (512 tokens,
        // dim 256, vocab 4096): forward, input gradient, weight gradient.
        case("head x·Wᵀ [512,256]·[256,4096]", 1, [512, 256, 4096], false, true),
        case("head dy·W [512,4096]·[4096,256]", 1, [512, 4096, 256], false, false),
        case("head dyᵀ·x [4096,512]·[512,256]", 1, [4096, 512, 256], true, false),
        // Its attention scores (4 rows × 8 heads, seq 128, head size 32): q·kᵀ per head.
        case("q·kᵀ 32 × [128,32]·[32,128]", 32, [128, 32, 128], false, true),
    ]
}

impl Case {
    /// A product of `batch` entries `[m, k] × [k, n]` of `dtype`.
    fn new(
        name: &'static str,
        dtype: DType,
        batch: usize,
        [m, k, n]: [usize; 3],
        a_transposed: bool,
        b_transposed: bool,
    ) -> Case {
        Case {
            name,
            dtype,
            batch,
            m,
            k,
            n,
            a_transposed,
            b_transposed,
        }
    }

    fn operands(&self) -> Result<(Tensor, Tensor), BoxError> {
        let a = if self.a_transposed {
            Tensor::randn(&[self.batch, self.k, self.m], self.dtype, 1)?.transpose(1, 2)?
        } else {
            Tensor::randn(&[self.batch, self.m, self.k], self.dtype, 1)?
        };
        let b = if self.b_transposed {
            Tensor::randn(&[self.batch, self.n, self.k], self.dtype, 2)?.transpose(1, 2)?
        } else {
            Tensor::randn(&[self.batch, self.k, self.n], self.dtype, 2)?
        };
        Ok((a, b))
    }

    fn flops(&self) -> f64 {
        2.0 * (self.batch * self.m * self.n * self.k) as f64
    }
}

/// Seconds per `matmul_with` call of each kernel, over `reps` calls.
fn sample(a: &Tensor, b: &Tensor, kernel: GemmKernel, reps: usize) -> Result<f64, BoxError> {
    let t = Instant::now();
    for _ in 0..reps {
        black_box(a.matmul_with(b, kernel)?);
    }
    Ok(t.elapsed().as_secs_f64() / reps as f64)
}

/// Bytes written between the calls of a cold sample: many times the L2 of any
/// core this runs on, so that neither operand is left in it.
const EVICT_BYTES: usize = 64 << 20;

/// Calls per cold sample (each timed alone, after an eviction).
const COLD_CALLS: usize = 5;

/// The median seconds of one `gemm` call with its operands evicted from the
/// core's caches first (see the module docs), over `iters` samples of
/// [`COLD_CALLS`] calls each.
fn time_cold(a: &Tensor, b: &Tensor, iters: usize, evict: &mut [u8]) -> Result<f64, BoxError> {
    let mut times = Vec::with_capacity(iters * COLD_CALLS);
    for i in 0..iters * COLD_CALLS {
        evict.fill(i as u8);
        black_box(&mut *evict);
        times.push(sample(a, b, GemmKernel::Gemm, 1)?);
    }
    Ok(median(&times))
}

/// The median seconds of one call with each kernel, `[matrixmultiply, gemm]`,
/// over `iters` samples taken alternately (so that load from other processes
/// falls on both alike).
fn time(a: &Tensor, b: &Tensor, iters: usize) -> Result<[f64; 2], BoxError> {
    let t = time_alternating(&[(a, b, GemmKernel::MatrixMultiply), (a, b, GemmKernel::Gemm)], iters)?;
    Ok([t[0], t[1]])
}

/// The median seconds of one call of each `(a, b, kernel)`, over `iters`
/// samples of each taken in turn.
fn time_alternating(runs: &[(&Tensor, &Tensor, GemmKernel)], iters: usize) -> Result<Vec<f64>, BoxError> {
    let mut reps = Vec::with_capacity(runs.len());
    for &(a, b, kernel) in runs {
        let once = sample(a, b, kernel, 1)?;
        reps.push(((SAMPLE_S / once.max(1e-7)) as usize).clamp(1, 100_000));
    }
    let mut samples = vec![Vec::with_capacity(iters); runs.len()];
    for _ in 0..iters {
        for ((&(a, b, kernel), &r), s) in runs.iter().zip(&reps).zip(&mut samples) {
            s.push(sample(a, b, kernel, r)?);
        }
    }
    Ok(samples.iter().map(|s| median(s)).collect())
}

/// The bench Transformer's products (one rank of FSDP W=2: 512 tokens, dim 256,
/// MLP 1024, vocab 4096, 8 heads of 32) and a square one, for the `bf16` table.
fn bf16_cases() -> Vec<Case> {
    let case = |name, batch, mkn, a_t, b_t| Case::new(name, DType::BF16, batch, mkn, a_t, b_t);
    vec![
        case("square 1024", 1, [1024; 3], false, false),
        case("linear x·Wᵀ [512,256]·[256,256]", 1, [512, 256, 256], false, true),
        case("w1 x·Wᵀ [512,256]·[256,1024]", 1, [512, 256, 1024], false, true),
        case("w2 dy·W [512,256]·[256,1024]", 1, [512, 256, 1024], false, false),
        case("w1 dyᵀ·x [1024,512]·[512,256]", 1, [1024, 512, 256], true, false),
        case("head x·Wᵀ [512,256]·[256,4096]", 1, [512, 256, 4096], false, true),
        case("head dyᵀ·x [4096,512]·[512,256]", 1, [4096, 512, 256], true, false),
        case("q·kᵀ 32 × [128,32]·[32,128]", 32, [128, 32, 128], false, true),
        case("p·v 32 × [128,128]·[128,32]", 32, [128, 128, 32], false, false),
    ]
}

/// The `bf16` table: the dot-product kernel against the widened path (the `f32`
/// `gemm` kernel with the conversions fused in) and against `f32` operands of
/// the same shape on `gemm`, timed alternately.
fn run_bf16(args: &common::BenchArgs, records: &mut Vec<Json>) -> Result<(), BoxError> {
    println!();
    if !GemmKernel::bf16_dot_detected() {
        println!("bf16 dot-product kernel: this CPU lacks AVX512_BF16; not measured");
        return Ok(());
    }
    println!(
        "{:<30} {:>12} {:>12} {:>10} {:>12} {:>10} {:>12}",
        "bf16 case", "via f32", "bf16 dot", "dot/via", "f32 gemm", "dot/f32", "max |diff|"
    );
    println!(
        "{:<30} {:>12} {:>12} {:>10} {:>12}",
        "", "GFLOP/s", "GFLOP/s", "", "GFLOP/s"
    );
    for case in bf16_cases() {
        let (a, b) = case.operands()?;
        let (a32, b32) = (a.cast(DType::F32)?, b.cast(DType::F32)?);
        let runs = [
            (&a, &b, GemmKernel::Gemm),
            (&a, &b, GemmKernel::Bf16Dot),
            (&a32, &b32, GemmKernel::Gemm),
        ];
        let t = time_alternating(&runs, args.iters)?;
        let [via, dot, f32] = [t[0], t[1], t[2]].map(|s| case.flops() / s / 1e9);
        // The two bf16 paths round the same sums, added in another order.
        let (x, y) = (
            a.matmul_with(&b, GemmKernel::Gemm)?.to_f64_vec(),
            a.matmul_with(&b, GemmKernel::Bf16Dot)?.to_f64_vec(),
        );
        let diff = x.iter().zip(&y).map(|(p, q)| (p - q).abs()).fold(0.0, f64::max);
        println!(
            "{:<30} {via:>12.1} {dot:>12.1} {:>10.2} {f32:>12.1} {:>10.2} {diff:>12.1e}",
            case.name,
            dot / via,
            dot / f32
        );
        records.push(Json::Obj(vec![
            ("case".into(), Json::Str(case.name.into())),
            ("dtype".into(), Json::Str("bf16".into())),
            ("batch".into(), Json::Int(case.batch as u64)),
            ("m".into(), Json::Int(case.m as u64)),
            ("k".into(), Json::Int(case.k as u64)),
            ("n".into(), Json::Int(case.n as u64)),
            ("via_f32_median_s".into(), Json::Num(t[0])),
            ("bf16_dot_median_s".into(), Json::Num(t[1])),
            ("f32_gemm_median_s".into(), Json::Num(t[2])),
            ("dot_over_via_f32".into(), Json::Num(dot / via)),
            ("dot_over_f32".into(), Json::Num(dot / f32)),
            ("max_abs_diff".into(), Json::Num(diff)),
            ("iters".into(), Json::Int(args.iters as u64)),
        ]));
    }
    println!("via f32: bf16 operands widened into the f32 `gemm` kernel; bf16 dot: GemmKernel::Bf16Dot (VDPBF16PS);");
    println!(
        "f32 gemm: the same shape in f32; dot/via and dot/f32 are GFLOP/s ratios (above 1 = the dot kernel faster)."
    );
    Ok(())
}

fn main() -> ExitCode {
    common::bench_main(
        "bench_gemm",
        USAGE,
        common::parse_args(std::env::args().skip(1), DEFAULT_ITERS),
        run,
    )
}

/// Runs the cases on one in-process rank with one thread for its kernels:
/// outside a rank, `matmul` splits large products over every core.
fn run(args: &common::BenchArgs) -> Result<(), BoxError> {
    let opts = LaunchOptions::default().threads_per_rank(1);
    let args = args.clone();
    launch_with(&opts, 1, move |_| run_cases(&args))?;
    Ok(())
}

fn run_cases(args: &common::BenchArgs) -> Result<(), BoxError> {
    assert_eq!(tessera::mesh::intra_op_threads(), 1, "the cases must run on one thread");
    let auto = GemmKernel::auto();
    println!(
        "one thread; GemmKernel::auto() = {auto:?}; median of {} samples",
        args.iters
    );
    println!(
        "{:<30} {:>16} {:>14} {:>8} {:>12} {:>10} {:>12}",
        "case", "matrixmultiply", "gemm", "ratio", "max |diff|", "gemm cold", "cold/hot"
    );
    println!(
        "{:<30} {:>16} {:>14} {:>8} {:>12} {:>10}",
        "", "GFLOP/s", "GFLOP/s", "", "", "GFLOP/s"
    );
    let mut records = Vec::new();
    let mut evict = vec![0u8; EVICT_BYTES];
    for case in cases() {
        let (a, b) = case.operands()?;
        let [base, fast] = time(&a, &b, args.iters)?;
        let cold = time_cold(&a, &b, args.iters, &mut evict)?;
        // Both kernels must agree (up to summation order).
        let (x, y) = (
            a.matmul_with(&b, GemmKernel::MatrixMultiply)?.to_f64_vec(),
            a.matmul_with(&b, GemmKernel::Gemm)?.to_f64_vec(),
        );
        let diff = x.iter().zip(&y).map(|(p, q)| (p - q).abs()).fold(0.0, f64::max);
        let (g_base, g_fast) = (case.flops() / base / 1e9, case.flops() / fast / 1e9);
        let ratio = g_fast / g_base;
        let g_cold = case.flops() / cold / 1e9;
        let cold_ratio = g_cold / g_fast;
        println!(
            "{:<30} {g_base:>16.1} {g_fast:>14.1} {ratio:>8.2} {diff:>12.1e} {g_cold:>10.1} {cold_ratio:>12.2}",
            case.name
        );
        records.push(Json::Obj(vec![
            ("case".into(), Json::Str(case.name.into())),
            ("dtype".into(), Json::Str(case.dtype.to_string())),
            ("batch".into(), Json::Int(case.batch as u64)),
            ("m".into(), Json::Int(case.m as u64)),
            ("k".into(), Json::Int(case.k as u64)),
            ("n".into(), Json::Int(case.n as u64)),
            ("a_transposed_view".into(), Json::Str(case.a_transposed.to_string())),
            ("b_transposed_view".into(), Json::Str(case.b_transposed.to_string())),
            ("matrixmultiply_median_s".into(), Json::Num(base)),
            ("gemm_median_s".into(), Json::Num(fast)),
            ("matrixmultiply_gflops".into(), Json::Num(g_base)),
            ("gemm_gflops".into(), Json::Num(g_fast)),
            ("ratio".into(), Json::Num(ratio)),
            ("gemm_cold_median_s".into(), Json::Num(cold)),
            ("gemm_cold_gflops".into(), Json::Num(g_cold)),
            ("cold_over_hot".into(), Json::Num(cold_ratio)),
            ("max_abs_diff".into(), Json::Num(diff)),
            ("auto".into(), Json::Str(format!("{auto:?}"))),
            ("iters".into(), Json::Int(args.iters as u64)),
        ]));
    }
    println!("\nratio = gemm GFLOP/s / matrixmultiply GFLOP/s (matrixmultiply is ndarray's dot).");
    println!(
        "gemm cold: operands evicted from the core's caches before each call ({} MiB written, untimed); cold/hot = gemm cold / gemm.",
        EVICT_BYTES >> 20
    );
    run_bf16(args, &mut records)?;
    if let Some(path) = &args.json {
        common::write_atomic(path, &(Json::Arr(records).render() + "\n"))?;
        println!("wrote {}", path.display());
    }
    Ok(())
}
