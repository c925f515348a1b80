//! One core's `f32` fused multiply-add peak, measured: the ceiling of any GEMM
//! micro-kernel on it, against which a benchmark reads its GEMMs' rate.

/// GFLOP/s of `f32` fused multiply-adds on the calling thread with the widest
/// vectors the CPU has (AVX-512F, else AVX2 with FMA): twelve independent
/// accumulators, enough to keep every FMA pipe busy, and the best of five
/// runs of ~10 ms. `None` on other CPUs (the benchmark then prints no ratio).
pub(crate) fn f32_fma_gflops() -> Option<f64> {
    #[cfg(target_arch = "x86_64")]
    {
        const ITERS: usize = 500_000;
        // The loop for the widest vectors present, and its lanes.
        let (run, lanes): (fn(usize) -> f32, usize) = if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: AVX-512F is present (checked above).
            (|n| unsafe { x86::fma_512(n) }, 16)
        } else if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
            // SAFETY: AVX2 and FMA are present (checked above).
            (|n| unsafe { x86::fma_256(n) }, 8)
        } else {
            return None;
        };
        let flops = (ITERS * x86::ACCUMULATORS * lanes * 2) as f64;
        let best = (0..5)
            .map(|_| {
                let t = std::time::Instant::now();
                std::hint::black_box(run(std::hint::black_box(ITERS)));
                t.elapsed().as_secs_f64()
            })
            .fold(f64::INFINITY, f64::min);
        Some(flops / best / 1e9)
    }
    #[cfg(not(target_arch = "x86_64"))]
    None
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// Independent FMA chains: more than latency × pipes (4 × 2 on current cores).
    pub(super) const ACCUMULATORS: usize = 12;

    /// `iters` rounds of one FMA per accumulator, 16 lanes each.
    #[target_feature(enable = "avx512f")]
    pub(super) fn fma_512(iters: usize) -> f32 {
        let mut acc = [_mm512_set1_ps(0.0); ACCUMULATORS];
        let (a, b) = (_mm512_set1_ps(0.999_999), _mm512_set1_ps(1e-7));
        for _ in 0..iters {
            for x in &mut acc {
                *x = _mm512_fmadd_ps(a, *x, b);
            }
        }
        acc.iter().map(|&x| _mm512_reduce_add_ps(x)).sum()
    }

    /// `iters` rounds of one FMA per accumulator, 8 lanes each.
    #[target_feature(enable = "avx2,fma")]
    pub(super) fn fma_256(iters: usize) -> f32 {
        let mut acc = [_mm256_set1_ps(0.0); ACCUMULATORS];
        let (a, b) = (_mm256_set1_ps(0.999_999), _mm256_set1_ps(1e-7));
        for _ in 0..iters {
            for x in &mut acc {
                *x = _mm256_fmadd_ps(a, *x, b);
            }
        }
        let mut lanes = [0f32; 8];
        acc.iter()
            .map(|&x| {
                // SAFETY: `lanes` holds the 8 floats stored.
                unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), x) };
                lanes.iter().sum::<f32>()
            })
            .sum()
    }
}
