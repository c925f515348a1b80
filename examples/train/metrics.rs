//! Per-step metrics (`--metrics-out PATH`: one JSON line per step) and the
//! model FLOPs utilisation against the machine's measured `f32` FMA peak.

use std::fs::File;
use std::io::Write as _;
use std::path::Path;

use tessera::BoxError;

use crate::args::{Arch, Args};
use crate::common;

/// What one step reports (rank 0 writes it; the memory columns hold every rank's).
pub(crate) struct StepMetrics {
    /// 1-based.
    pub(crate) step: usize,
    pub(crate) loss: f64,
    /// The learning rate this step's update used.
    pub(crate) lr: f64,
    /// The global 2-norm of the gradients before the update.
    pub(crate) grad_norm: f64,
    pub(crate) step_time_s: f64,
    /// Tensor bytes each rank holds after the step, and its peak during it.
    pub(crate) bytes_in_use: Vec<usize>,
    pub(crate) peak_bytes: Vec<usize>,
}

/// Model FLOPs of one token, forward and backward (PaLM's count): 6 per
/// parameter, plus attention's scores and weighted sums, `12 · layers · dim · seq`.
pub(crate) fn flops_per_token(args: &Args) -> f64 {
    let m = args.model;
    let dim = match args.arch {
        Arch::Gpt => m.dim,
        Arch::Llama => args.llama().head_dim() * m.n_heads,
    };
    (6 * args.num_params() + 12 * m.n_layers * dim * m.seq) as f64
}

/// The machine's `f32` FMA peak in FLOP/s: one core's, measured now, times the
/// cores this process may use. `None` where the measurement is not available.
pub(crate) fn machine_peak_flops() -> Option<(f64, usize)> {
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    common::peak::f32_fma_gflops().map(|g| (g * 1e9 * cores as f64, cores))
}

/// Rank 0's `--metrics-out` file: one JSON object per line, each written whole
/// and flushed, so a running job can be followed and a killed one keeps its
/// finished steps.
pub(crate) struct MetricsWriter {
    file: File,
    tokens_per_step: f64,
    peak_flops: Option<f64>,
    flops_per_token: f64,
}

impl MetricsWriter {
    /// Creates (or truncates) `path`.
    pub(crate) fn create(path: &Path, args: &Args, peak_flops: Option<f64>) -> Result<MetricsWriter, BoxError> {
        let file = File::create(path).map_err(|e| format!("--metrics-out {}: {e}", path.display()))?;
        Ok(MetricsWriter {
            file,
            tokens_per_step: (args.global_batch() * args.model.seq) as f64,
            peak_flops,
            flops_per_token: flops_per_token(args),
        })
    }

    /// Appends the line of one step.
    pub(crate) fn write(&mut self, m: &StepMetrics) -> Result<(), BoxError> {
        let tokens_per_s = self.tokens_per_step / m.step_time_s;
        let mfu = self.peak_flops.map(|p| tokens_per_s * self.flops_per_token / p);
        let line = serde_json::json!({
            "step": m.step,
            "loss": m.loss,
            "lr": m.lr,
            "grad_norm": m.grad_norm,
            "step_time_s": m.step_time_s,
            "tokens_per_s": tokens_per_s,
            "mfu": mfu,
            "bytes_in_use_per_rank": m.bytes_in_use,
            "peak_bytes_per_rank": m.peak_bytes,
        });
        let mut text = serde_json::to_string(&line)?;
        text.push('\n');
        self.file.write_all(text.as_bytes())?;
        self.file.flush()?;
        Ok(())
    }
}
