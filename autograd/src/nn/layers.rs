//! The basic layers.

use tessera_dtensor::{DType, Tensor};
use tessera_mesh::DeviceMesh;

use super::{Module, join, replicated, uniform};
use crate::{Param, Result, Var};

/// `y = x · Wᵀ + b`, `W` stored `[out, in]`.
///
/// PyTorch: `torch.nn.Linear` (same initialisation law: uniform in ±1/√in).
pub struct Linear {
    /// `[out, in]`.
    pub weight: Param,
    /// `[out]`, if any.
    pub bias: Option<Param>,
}

impl Linear {
    /// A replicated linear layer named `prefix.weight` / `prefix.bias`, initialised
    /// from `seed` (`seed + 1` for the bias).
    ///
    /// Collective over `mesh` (every rank must call it): the values are rank 0's,
    /// as [`distribute_tensor`](tessera_dtensor::distribute_tensor) takes them.
    ///
    /// # Errors
    /// Tensor construction failures, a communication failure.
    pub fn new(
        prefix: &str,
        in_features: usize,
        out_features: usize,
        bias: bool,
        mesh: &DeviceMesh,
        dtype: DType,
        seed: u64,
    ) -> Result<Linear> {
        let bound = 1.0 / (in_features.max(1) as f64).sqrt();
        let weight = replicated(
            join(prefix, "weight"),
            &uniform(&[out_features, in_features], bound, dtype, seed)?,
            mesh,
        )?;
        let bias = if bias {
            Some(replicated(
                join(prefix, "bias"),
                &uniform(&[out_features], bound, dtype, seed + 1)?,
                mesh,
            )?)
        } else {
            None
        };
        Ok(Linear { weight, bias })
    }
}

impl Module for Linear {
    fn own_parameters(&self) -> Vec<(String, Param)> {
        let bias = self.bias.clone().map(|b| ("bias".to_string(), b));
        std::iter::once(("weight".to_string(), self.weight.clone()))
            .chain(bias)
            .collect()
    }

    fn forward(&self, x: &Var) -> Result<Var> {
        x.linear(&self.weight.var(), self.bias.as_ref().map(Param::var).as_ref())
    }
}

/// A lookup table `[num, dim]`; forward takes `i64` indices.
///
/// PyTorch: `torch.nn.Embedding` (initialised from a standard normal).
pub struct Embedding {
    /// `[num, dim]`.
    pub weight: Param,
}

impl Embedding {
    /// A replicated table named `prefix.weight`.
    ///
    /// Collective over `mesh` (every rank must call it): the values are rank 0's,
    /// as [`distribute_tensor`](tessera_dtensor::distribute_tensor) takes them.
    ///
    /// # Errors
    /// Tensor construction failures, a communication failure.
    pub fn new(prefix: &str, num: usize, dim: usize, mesh: &DeviceMesh, dtype: DType, seed: u64) -> Result<Embedding> {
        let full = Tensor::randn(&[num, dim], dtype, seed)?;
        Ok(Embedding {
            weight: replicated(join(prefix, "weight"), &full, mesh)?,
        })
    }
}

impl Module for Embedding {
    fn own_parameters(&self) -> Vec<(String, Param)> {
        vec![("weight".into(), self.weight.clone())]
    }

    fn forward(&self, indices: &Var) -> Result<Var> {
        self.weight.var().embedding(indices)
    }
}

/// Layer norm over the last dim with affine weight and bias.
///
/// PyTorch: `torch.nn.LayerNorm` (weight ones, bias zeros).
pub struct LayerNorm {
    /// `[dim]`.
    pub weight: Param,
    /// `[dim]`.
    pub bias: Param,
    /// Added to the variance.
    pub eps: f64,
}

impl LayerNorm {
    /// A replicated layer norm named `prefix.weight` / `prefix.bias`.
    ///
    /// Collective over `mesh` (every rank must call it): the values are rank 0's,
    /// as [`distribute_tensor`](tessera_dtensor::distribute_tensor) takes them.
    ///
    /// # Errors
    /// Tensor construction failures, a communication failure.
    pub fn new(prefix: &str, dim: usize, eps: f64, mesh: &DeviceMesh, dtype: DType) -> Result<LayerNorm> {
        Ok(LayerNorm {
            weight: replicated(join(prefix, "weight"), &Tensor::ones(&[dim], dtype)?, mesh)?,
            bias: replicated(join(prefix, "bias"), &Tensor::zeros(&[dim], dtype)?, mesh)?,
            eps,
        })
    }
}

impl Module for LayerNorm {
    fn own_parameters(&self) -> Vec<(String, Param)> {
        vec![
            ("weight".into(), self.weight.clone()),
            ("bias".into(), self.bias.clone()),
        ]
    }

    fn forward(&self, x: &Var) -> Result<Var> {
        x.layer_norm(Some(&self.weight.var()), Some(&self.bias.var()), self.eps)
    }
}
