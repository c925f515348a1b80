//! The basic layers.

use tessera_dtensor::DType;
use tessera_mesh::DeviceMesh;

use super::Module;
use super::init::{FanMode, Init, Nonlinearity};
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
    /// A deferred linear layer replicated on `mesh` (no storage until
    /// materialised). Its default init is PyTorch's: weight
    /// `kaiming_uniform(a = √5)`, i.e. uniform in ±1/√in, bias uniform in ±1/√in.
    ///
    /// Collective over `mesh` (every rank must call it): the values are rank 0's,
    /// as [`distribute_tensor`](tessera_dtensor::distribute_tensor) takes them.
    ///
    /// # Errors
    /// Sizes a tensor cannot have.
    pub fn new(in_features: usize, out_features: usize, bias: bool, mesh: &DeviceMesh, dtype: DType) -> Result<Linear> {
        Ok(Linear {
            weight: Param::deferred(&[out_features, in_features], dtype, mesh)?,
            bias: if bias {
                Some(Param::deferred(&[out_features], dtype, mesh)?)
            } else {
                None
            },
        })
    }
}

impl Module for Linear {
    fn own_parameters(&self) -> Vec<(String, Param)> {
        let bias = self.bias.clone().map(|b| ("bias".to_string(), b));
        std::iter::once(("weight".to_string(), self.weight.clone()))
            .chain(bias)
            .collect()
    }

    fn init_scheme(&self, param: &str) -> Option<Init> {
        let fan_in = self.weight.shape().get(1).copied().unwrap_or(1).max(1) as f64;
        match param {
            "weight" => Some(Init::KaimingUniform {
                a: 5f64.sqrt(),
                mode: FanMode::FanIn,
                nonlinearity: Nonlinearity::LeakyRelu,
            }),
            "bias" => Some(Init::Uniform {
                low: -1.0 / fan_in.sqrt(),
                high: 1.0 / fan_in.sqrt(),
            }),
            _ => None,
        }
    }

    fn forward(&self, x: &Var) -> Result<Var> {
        let bias = self.bias.as_ref().map(Param::var).transpose()?;
        x.linear(&self.weight.var()?, bias.as_ref())
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
    /// A deferred table replicated on `mesh`; default init standard normal.
    ///
    /// Collective over `mesh` (every rank must call it): the values are rank 0's,
    /// as [`distribute_tensor`](tessera_dtensor::distribute_tensor) takes them.
    ///
    /// # Errors
    /// Sizes a tensor cannot have.
    pub fn new(num: usize, dim: usize, mesh: &DeviceMesh, dtype: DType) -> Result<Embedding> {
        Ok(Embedding {
            weight: Param::deferred(&[num, dim], dtype, mesh)?,
        })
    }
}

impl Module for Embedding {
    fn own_parameters(&self) -> Vec<(String, Param)> {
        vec![("weight".into(), self.weight.clone())]
    }

    fn init_scheme(&self, param: &str) -> Option<Init> {
        (param == "weight").then_some(Init::Normal { mean: 0.0, std: 1.0 })
    }

    fn forward(&self, indices: &Var) -> Result<Var> {
        self.weight.var()?.embedding(indices)
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
    /// A deferred layer norm replicated on `mesh`; default init weight ones,
    /// bias zeros.
    ///
    /// Collective over `mesh` (every rank must call it): the values are rank 0's,
    /// as [`distribute_tensor`](tessera_dtensor::distribute_tensor) takes them.
    ///
    /// # Errors
    /// Sizes a tensor cannot have.
    pub fn new(dim: usize, eps: f64, mesh: &DeviceMesh, dtype: DType) -> Result<LayerNorm> {
        Ok(LayerNorm {
            weight: Param::deferred(&[dim], dtype, mesh)?,
            bias: Param::deferred(&[dim], dtype, mesh)?,
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

    fn init_scheme(&self, param: &str) -> Option<Init> {
        match param {
            "weight" => Some(Init::Ones),
            "bias" => Some(Init::Zeros),
            _ => None,
        }
    }

    fn forward(&self, x: &Var) -> Result<Var> {
        x.layer_norm(Some(&self.weight.var()?), Some(&self.bias.var()?), self.eps)
    }
}

/// RMSNorm over the last dim with a weight (LLaMA's norm): see
/// [`Var::rms_norm`].
///
/// PyTorch: `torch.nn.RMSNorm` (weight ones).
pub struct RMSNorm {
    /// `[dim]`.
    pub weight: Param,
    /// Added to the mean of squares.
    pub eps: f64,
}

impl RMSNorm {
    /// A deferred RMSNorm replicated on `mesh`; default init weight ones.
    ///
    /// # Errors
    /// Sizes a tensor cannot have.
    pub fn new(dim: usize, eps: f64, mesh: &DeviceMesh, dtype: DType) -> Result<RMSNorm> {
        Ok(RMSNorm {
            weight: Param::deferred(&[dim], dtype, mesh)?,
            eps,
        })
    }
}

impl Module for RMSNorm {
    fn own_parameters(&self) -> Vec<(String, Param)> {
        vec![("weight".into(), self.weight.clone())]
    }

    fn init_scheme(&self, param: &str) -> Option<Init> {
        (param == "weight").then_some(Init::Ones)
    }

    fn forward(&self, x: &Var) -> Result<Var> {
        x.rms_norm(Some(&self.weight.var()?), self.eps)
    }
}

/// Dropout while training, the identity in evaluation: each element zeroed
/// with probability `p` and the others scaled by `1 / (1 − p)`, each call with
/// the rank's next key ([`random::next_key`](crate::random::next_key)). The
/// mask is drawn at each element's global index, so a sharded activation (FSDP,
/// tensor or sequence parallel) drops exactly what one rank would, and a block
/// recomputed in backward replays its masks.
///
/// PyTorch: `torch.nn.Dropout` (`train()` / `eval()`).
pub struct Dropout {
    p: f64,
    training: std::cell::Cell<bool>,
}

impl Dropout {
    /// A dropout layer with probability `p`, training.
    ///
    /// # Errors
    /// `p` outside `[0, 1]`.
    pub fn new(p: f64) -> Result<Dropout> {
        tessera_tensor::random::check_dropout_p("Dropout::new", p).map_err(tessera_dtensor::Error::from)?;
        Ok(Dropout {
            p,
            training: std::cell::Cell::new(true),
        })
    }

    /// The probability of dropping an element.
    pub fn p(&self) -> f64 {
        self.p
    }

    /// Switches between training (`true`: drop) and evaluation (`false`: pass
    /// through). PyTorch: `module.train(mode)`.
    pub fn train(&self, training: bool) {
        self.training.set(training);
    }

    /// Whether the layer drops ([`train`](Self::train)).
    pub fn is_training(&self) -> bool {
        self.training.get()
    }
}

impl Module for Dropout {
    fn forward(&self, x: &Var) -> Result<Var> {
        if !self.training.get() || self.p == 0.0 {
            return Ok(x.clone());
        }
        x.dropout(self.p, crate::random::next_key())
    }
}

/// Free-standing parameters by name, with no forward of its own: the root of a
/// tree for parameters that belong to no layer (a learned scale, the parameters
/// of a hand-written function). Its names are its keys.
///
/// PyTorch: `torch.nn.ParameterDict`.
pub struct ParameterDict {
    params: Vec<(String, Param)>,
}

impl ParameterDict {
    /// The parameters under their keys, named by them ([`name_parameters`](super::name_parameters)).
    ///
    /// # Errors
    /// Two parameters under one key.
    pub fn new<S: Into<String>>(params: impl IntoIterator<Item = (S, Param)>) -> Result<ParameterDict> {
        let dict = ParameterDict {
            params: params.into_iter().map(|(k, p)| (k.into(), p)).collect(),
        };
        super::name_parameters(&dict)?;
        Ok(dict)
    }

    /// The parameter under `key`.
    pub fn get(&self, key: &str) -> Option<&Param> {
        self.params.iter().find(|(k, _)| k == key).map(|(_, p)| p)
    }
}

impl Module for ParameterDict {
    fn own_parameters(&self) -> Vec<(String, Param)> {
        self.params.clone()
    }

    fn forward(&self, _: &Var) -> Result<Var> {
        Err(crate::Error::Config {
            op: "ParameterDict",
            detail: "a ParameterDict holds parameters and has no forward; use them through their vars".into(),
        })
    }
}
