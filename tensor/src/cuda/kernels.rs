//! The CUDA C sources of the kernels and their compilation by NVRTC.
//!
//! Every kernel is in one source, compiled once per GPU (for its compute
//! capability) on first use and kept for the process's life.

use cudarc::nvrtc::{CompileOptions, Ptx, compile_ptx_with_opts};

use super::library::check_library;
use crate::{Error, Result};

/// The CUDA C source of every kernel.
pub const SOURCE: &str = include_str!("kernels.cu");

/// Compiles [`SOURCE`] to PTX for compute capability `arch` (`(9, 0)` for
/// Hopper). NVRTC is a host library: this runs on a machine without a GPU,
/// which is how CI checks that every kernel compiles.
///
/// # Errors
/// [`Error::Device`] when NVRTC cannot be loaded or the source does not
/// compile (with NVRTC's log).
pub fn compile_ptx(arch: (i32, i32)) -> Result<String> {
    Ok(compile(arch)?.to_src())
}

pub(crate) fn compile(arch: (i32, i32)) -> Result<Ptx> {
    check_library("nvrtc")?;
    // `arch` must live for the program's life; the few distinct values leak once.
    let arch_name: &'static str = Box::leak(format!("compute_{}{}", arch.0, arch.1).into_boxed_str());
    let opts = CompileOptions {
        // No fused multiply-adds: element-wise results round as the CPU kernels' do.
        fmad: Some(false),
        arch: Some(arch_name),
        options: vec!["--std=c++17".into()],
        ..Default::default()
    };
    compile_ptx_with_opts(SOURCE, opts).map_err(|e| Error::Device {
        op: "cuda",
        detail: format!("the kernels do not compile for {arch_name}: {e}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kernel source compiles for Hopper and Ampere (NVRTC only: no GPU
    /// needed; CI installs NVRTC), and every kernel the ops launch is in it.
    #[test]
    fn kernels_compile_to_ptx() {
        for arch in [(9, 0), (8, 0)] {
            let ptx = match compile_ptx(arch) {
                Ok(p) => p,
                Err(e) => panic!("{e}"),
            };
            let mut names = vec![
                "copy_w1",
                "copy_w2",
                "copy_w4",
                "copy_w8",
                "cast_f32_bf16",
                "cast_bf16_f32",
                "cast_f64_bf16",
                "reduce_rows_f32",
                "softmax_rows_bf16",
                "softmax_backward_rows_f32",
                "norm_rows_f32",
                "norm_backward_rows_bf16",
                "column_sums_f32",
                "column_sums_bf16",
                "column_finish_f64",
                "causal_zero_w2",
                "causal_zero_w4",
                "causal_zero_w8",
                "copy_words_w1",
                "copy_words_w2",
                "copy_words_w4",
                "copy_words_w8",
                "copy_words_w16",
                "cross_entropy_rows_f32",
                "cross_entropy_backward_bf16",
                "sum_f64_ordered",
                "embedding_w4",
                "embedding_backward_bf16",
                "reduce_peers_f32",
                "reduce_peers_bf16",
                "adamw_f32",
                "fill_bf16",
                "attention_bf16_e16",
                "attention_bf16_e32",
                "attention_bf16_e64",
                "attention_bf16_e128",
                "batch_pointers",
            ];
            let ops = [
                "binary_add",
                "binary_minimum",
                "scalar_minimum",
                "binary_sub",
                "binary_mul",
                "binary_div",
                "binary_maximum",
                "binary_pow",
                "binary_gelu_backward",
                "binary_silu_backward",
                "scalar_mul",
                "unary_gelu",
                "unary_silu",
                "unary_rsqrt",
                "unary_exp",
                "unary_neg",
            ];
            let typed: Vec<String> = ops
                .iter()
                .flat_map(|o| ["f32", "f64", "bf16"].map(|t| format!("{o}_{t}")))
                .collect();
            names.extend(typed.iter().map(String::as_str));
            // Every warp-per-row kernel a row op can ask for (`ops::row_kernel`).
            let slots = (0..=1024).filter_map(super::super::driver::warp_slots);
            let warp: Vec<String> = ["softmax", "softmax_backward", "norm", "norm_backward"]
                .iter()
                .flat_map(|f| {
                    slots
                        .clone()
                        .flat_map(move |k| ["f32", "f64", "bf16"].map(|t| format!("{f}_warp{k}_{t}")))
                })
                .collect();
            names.extend(warp.iter().map(String::as_str));
            let dense_casts =
                ["f32_bf16", "bf16_f32", "f32_f64", "f64_f32", "bf16_f64"].map(|c| format!("cast_dense_{c}"));
            names.extend(dense_casts.iter().map(String::as_str));
            for name in names {
                assert!(
                    ptx.contains(&format!(".entry {name}(")),
                    "{name} is missing from the PTX for {arch:?}"
                );
            }
        }
    }
}
