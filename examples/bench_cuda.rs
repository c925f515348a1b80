//! GPU kernels' rates: matrix products (cuBLAS through `Tensor::matmul`) on
//! the shapes of the bench and large training configs, and the memory-bound
//! kernels' bandwidth, each the median of timed repeats after a warm-up.
//!
//! ```text
//! cargo run --release --features cuda --example bench_cuda -- [--json] [--reps N]
//! ```
//!
//! `scripts/gpu-check.sh` runs it beside PyTorch's own products on the same
//! shapes (TF32 off) and prints the ratios.

use std::time::Instant;

use tessera::tensor::{DType, Device, Tensor, cuda};

/// A memory-bound case: its name, passes over the data, and the call.
type Case<'a> = (&'static str, f64, Box<dyn FnMut() -> Tensor + 'a>);

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Seconds per call of `f`, the median of `reps` timed calls after 3 warm-ups.
fn time(reps: usize, mut f: impl FnMut() -> Tensor) -> f64 {
    for _ in 0..3 {
        f();
    }
    cuda::synchronize(0).expect("synchronize");
    let mut v = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t = Instant::now();
        let out = f();
        cuda::synchronize(0).expect("synchronize");
        v.push(t.elapsed().as_secs_f64());
        drop(out);
    }
    median(v)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let json = args.iter().any(|a| a == "--json");
    let reps = args
        .iter()
        .position(|a| a == "--reps")
        .and_then(|i| args.get(i + 1))
        .map(|v| v.parse())
        .transpose()?
        .unwrap_or(20);
    let gpu = Device::Cuda(0);
    let name = cuda::device_name(0)?;
    // (label, m, k, n): the products of one Transformer block's forward.
    let shapes = [
        ("bench qkv", 2 * 64, 128, 3 * 128),
        ("bench mlp", 2 * 64, 128, 4 * 128),
        ("bench head", 2 * 64, 128, 512),
        ("large qkv", 8 * 512, 1024, 3 * 1024),
        ("large mlp up", 8 * 512, 1024, 4 * 1024),
        ("large mlp down", 8 * 512, 4 * 1024, 1024),
        ("large head", 8 * 512, 1024, 32000),
        ("square 8192", 8192, 8192, 8192),
    ];
    let mut rows = Vec::new();
    for dtype in [DType::F32, DType::BF16] {
        for &(label, m, k, n) in &shapes {
            let a = Tensor::randn(&[m, k], DType::F32, 1)?.cast(dtype)?.to(gpu)?;
            let b = Tensor::randn(&[k, n], DType::F32, 2)?.cast(dtype)?.to(gpu)?;
            let reps = if m * k * n > 1 << 36 { reps.min(10) } else { reps };
            let s = time(reps, || a.matmul(&b).expect("matmul"));
            let tflops = 2.0 * (m * k * n) as f64 / s / 1e12;
            rows.push((format!("matmul {label} {m}x{k}x{n}"), dtype, s, tflops, "TFLOP/s"));
        }
    }
    // Memory-bound kernels: bytes read and written per call over time.
    let n = 64 << 20;
    for dtype in [DType::F32, DType::BF16] {
        let x = Tensor::randn(&[n / 4096, 4096], DType::F32, 3)?.cast(dtype)?.to(gpu)?;
        let y = Tensor::randn(&[n / 4096, 4096], DType::F32, 4)?.cast(dtype)?.to(gpu)?;
        let w = Tensor::randn(&[4096], DType::F32, 5)?.cast(dtype)?.to(gpu)?;
        let bytes = (n * dtype.size_in_bytes()) as f64;
        let cases: Vec<Case> = vec![
            ("add", 3.0, Box::new(|| x.add(&y).expect("add"))),
            ("gelu", 2.0, Box::new(|| x.gelu().expect("gelu"))),
            ("softmax rows", 2.0, Box::new(|| x.softmax(1).expect("softmax"))),
            (
                "layer_norm rows",
                2.0,
                Box::new(|| x.layer_norm(Some(&w), Some(&w), 1e-5).expect("layer_norm")),
            ),
            (
                "transpose copy",
                2.0,
                Box::new(|| x.transpose(0, 1).expect("t").contiguous()),
            ),
        ];
        for (label, passes, mut f) in cases {
            let s = time(reps, &mut f);
            rows.push((format!("{label} 64M"), dtype, s, passes * bytes / s / 1e9, "GB/s"));
        }
    }
    if json {
        let items: Vec<String> = rows
            .iter()
            .map(|(l, d, s, r, u)| {
                format!("{{\"case\":\"{l}\",\"dtype\":\"{d}\",\"seconds\":{s:e},\"rate\":{r:.3},\"unit\":\"{u}\"}}")
            })
            .collect();
        println!("{{\"device\":\"{name}\",\"results\":[{}]}}", items.join(","));
    } else {
        println!("bench_cuda on {name} (median of {reps})");
        for (l, d, s, r, u) in &rows {
            println!("{l:<40} {d:<5} {:>10.3} ms {r:>10.1} {u}", s * 1e3);
        }
    }
    Ok(())
}
