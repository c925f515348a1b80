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
//! The baseline is `matrixmultiply` (what ndarray's `dot` runs); `ratio` is the
//! `gemm` crate's GFLOP/s over the baseline's (above 1 = `gemm` faster).
//! `GemmKernel::auto()` picks `gemm` on CPUs with AVX-512 and `matrixmultiply`
//! elsewhere. The times include allocating the output tensor, as every
//! `matmul` call does. OpenBLAS is not a dependency (the default build needs no
//! system library), so it is not measured here.

#[path = "common/mod.rs"]
mod common;

use std::hint::black_box;
use std::process::ExitCode;
use std::time::Instant;

use common::{Json, median};
use tessera::dtensor::ops::GemmKernel;
use tessera::dtensor::{DType, Tensor};
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
    let case = |name, batch, [m, k, n]: [usize; 3], a_transposed, b_transposed| Case {
        name,
        dtype: DType::F32,
        batch,
        m,
        k,
        n,
        a_transposed,
        b_transposed,
    };
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
    const KERNELS: [GemmKernel; 2] = [GemmKernel::MatrixMultiply, GemmKernel::Gemm];
    let once = KERNELS.map(|k| sample(a, b, k, 1));
    let mut reps = [1; 2];
    for (r, t) in reps.iter_mut().zip(once) {
        *r = ((SAMPLE_S / t?.max(1e-7)) as usize).clamp(1, 100_000);
    }
    let mut samples = [Vec::with_capacity(iters), Vec::with_capacity(iters)];
    for _ in 0..iters {
        for i in 0..2 {
            samples[i].push(sample(a, b, KERNELS[i], reps[i])?);
        }
    }
    Ok(samples.map(|s| median(&s)))
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
    if let Some(path) = &args.json {
        common::write_atomic(path, &(Json::Arr(records).render() + "\n"))?;
        println!("wrote {}", path.display());
    }
    Ok(())
}
