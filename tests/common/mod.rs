//! The PyTorch reference data shared by the parity test crates (`mod common;`):
//! file paths, the reference losses and token batches, the tiny model loaded with
//! the reference's initial weights, and the reference AdamW.
#![allow(dead_code)]

use std::path::PathBuf;

use serde_json::Value;
use tessera::autograd::optim::AdamWConfig;
use tessera::autograd::{load_state_dict, nn::Module, read_safetensors};
use tessera::dtensor::Tensor;
use tessera::models::{Transformer, TransformerConfig};
use tessera::{DType, DeviceMesh};

/// `tests/data/<name>`.
pub(crate) fn data(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data").join(name)
}

/// `runs.<run>.loss` of the PyTorch reference (20 steps).
pub(crate) fn reference_losses(run: &str) -> Vec<f64> {
    reference_losses_in("tiny_reference.json", run)
}

/// The losses of `run` in the reference file `file` (in `tests/data`).
pub(crate) fn reference_losses_in(file: &str, run: &str) -> Vec<f64> {
    let text = std::fs::read_to_string(data(file)).unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();
    v["runs"][run]["loss"]
        .as_array()
        .unwrap_or_else(|| panic!("no reference run {run} in {file}"))
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

pub(crate) fn tokens() -> Tensor {
    let all = read_safetensors(data("tiny_tokens_G16.safetensors")).unwrap();
    all.into_iter().find(|(n, _)| n == "tokens").unwrap().1
}

/// The tiny reference Transformer on `mesh` (replicated) with the reference's
/// initial weights.
pub(crate) fn tiny_model(mesh: &DeviceMesh) -> tessera::autograd::Result<Transformer> {
    let model = Transformer::new(TransformerConfig::TINY, mesh, DType::F32)?;
    load_state_dict(&model.parameters(), data("tiny_init.safetensors"))?;
    Ok(model)
}

/// The reference AdamW.
pub(crate) fn adamw() -> AdamWConfig {
    AdamWConfig {
        lr: 1e-3,
        betas: (0.9, 0.95),
        eps: 1e-8,
        weight_decay: 0.1,
    }
}

/// The largest `|a − b|` (the lengths must agree).
pub(crate) fn max_abs_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len(), "lengths differ");
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max)
}
