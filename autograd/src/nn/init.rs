//! Initialisation schemes ([`Init`]): what a parameter is filled with when it is
//! materialised, computed from its *global* shape so that every mesh gives the
//! same law (and, with the counter-based generator, the same values).
//!
//! PyTorch: `torch.nn.init`.

use tessera_tensor::random::Distribution;

use crate::{Error, Result};

/// Which fan a Kaiming scheme scales by.
///
/// PyTorch: the `mode` argument of `kaiming_uniform_` / `kaiming_normal_`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FanMode {
    /// Inputs per output (`shape[1] · receptive field`): preserves the forward variance.
    FanIn,
    /// Outputs per input (`shape[0] · receptive field`): preserves the backward variance.
    FanOut,
}

/// The nonlinearity a scheme's gain is computed for.
///
/// PyTorch: `torch.nn.init.calculate_gain`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Nonlinearity {
    /// Linear or identity (and the convolutions): gain 1.
    Linear,
    /// Sigmoid: gain 1.
    Sigmoid,
    /// Tanh: gain 5/3.
    Tanh,
    /// ReLU: gain √2.
    Relu,
    /// Leaky ReLU with the scheme's `a` as negative slope: gain √(2 / (1 + a²)).
    LeakyRelu,
    /// SELU: gain 3/4.
    Selu,
}

impl Nonlinearity {
    /// The recommended gain (`a`: the negative slope, for [`LeakyRelu`](Self::LeakyRelu)).
    ///
    /// PyTorch: `torch.nn.init.calculate_gain(nonlinearity, param=a)`.
    pub fn gain(self, a: f64) -> f64 {
        match self {
            Nonlinearity::Linear | Nonlinearity::Sigmoid => 1.0,
            Nonlinearity::Tanh => 5.0 / 3.0,
            Nonlinearity::Relu => 2f64.sqrt(),
            Nonlinearity::LeakyRelu => (2.0 / (1.0 + a * a)).sqrt(),
            Nonlinearity::Selu => 0.75,
        }
    }
}

/// How a parameter is initialised.
///
/// PyTorch: the functions of `torch.nn.init` (named on each variant).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    /// All zeros. PyTorch: `zeros_`.
    Zeros,
    /// All ones. PyTorch: `ones_`.
    Ones,
    /// Every element `value`. PyTorch: `constant_`.
    Constant(f64),
    /// Uniform in `[low, high)`. PyTorch: `uniform_(a=low, b=high)`.
    Uniform {
        /// Lower bound.
        low: f64,
        /// Upper bound.
        high: f64,
    },
    /// Normal. PyTorch: `normal_(mean, std)`.
    Normal {
        /// Mean.
        mean: f64,
        /// Standard deviation.
        std: f64,
    },
    /// Normal truncated to `[low, high]` (absolute bounds, as PyTorch's).
    /// PyTorch: `trunc_normal_(mean, std, a=low, b=high)`.
    TruncNormal {
        /// Mean.
        mean: f64,
        /// Standard deviation.
        std: f64,
        /// Lower bound.
        low: f64,
        /// Upper bound.
        high: f64,
    },
    /// Uniform in ±`gain · √(6 / (fan_in + fan_out))`. PyTorch: `xavier_uniform_(gain)`.
    XavierUniform {
        /// Scale.
        gain: f64,
    },
    /// Normal with std `gain · √(2 / (fan_in + fan_out))`. PyTorch: `xavier_normal_(gain)`.
    XavierNormal {
        /// Scale.
        gain: f64,
    },
    /// Uniform in ±`√3 · gain / √fan`. PyTorch: `kaiming_uniform_(a, mode, nonlinearity)`
    /// (its defaults: `a = 0`, [`FanMode::FanIn`], [`Nonlinearity::LeakyRelu`]).
    KaimingUniform {
        /// The negative slope (used by [`Nonlinearity::LeakyRelu`]).
        a: f64,
        /// Which fan.
        mode: FanMode,
        /// Which gain.
        nonlinearity: Nonlinearity,
    },
    /// Normal with std `gain / √fan`. PyTorch: `kaiming_normal_(a, mode, nonlinearity)`.
    KaimingNormal {
        /// The negative slope (used by [`Nonlinearity::LeakyRelu`]).
        a: f64,
        /// Which fan.
        mode: FanMode,
        /// Which gain.
        nonlinearity: Nonlinearity,
    },
}

/// `(fan_in, fan_out)` of a parameter of global `shape`.
///
/// PyTorch: `torch.nn.init._calculate_fan_in_and_fan_out`.
///
/// # Errors
/// Fewer than 2 dims (fans are not defined for vectors).
pub fn fans(shape: &[usize]) -> Result<(usize, usize)> {
    if shape.len() < 2 {
        return Err(Error::Config {
            op: "init",
            detail: format!(
                "fan in and fan out need at least 2 dims, the parameter has shape {shape:?}; use a scheme \
                 without fans (uniform, normal, zeros) for it"
            ),
        });
    }
    let receptive: usize = shape[2..].iter().product();
    Ok((shape[1] * receptive, shape[0] * receptive))
}

impl Init {
    /// The distribution this scheme draws a parameter of global `shape` from.
    ///
    /// # Errors
    /// A fan-based scheme on a parameter with fewer than 2 dims or a zero fan.
    pub fn distribution(&self, shape: &[usize]) -> Result<Distribution> {
        let fan = |mode: FanMode| -> Result<f64> {
            let (fan_in, fan_out) = fans(shape)?;
            let f = match mode {
                FanMode::FanIn => fan_in,
                FanMode::FanOut => fan_out,
            };
            if f == 0 {
                return Err(Error::Config {
                    op: "init",
                    detail: format!("a Kaiming scheme on shape {shape:?} divides by a zero fan"),
                });
            }
            Ok(f as f64)
        };
        let xavier_std = |gain: f64| -> Result<f64> {
            let (fan_in, fan_out) = fans(shape)?;
            Ok(gain * (2.0 / (fan_in + fan_out).max(1) as f64).sqrt())
        };
        Ok(match *self {
            Init::Zeros => Distribution::Constant(0.0),
            Init::Ones => Distribution::Constant(1.0),
            Init::Constant(v) => Distribution::Constant(v),
            Init::Uniform { low, high } => Distribution::Uniform { low, high },
            Init::Normal { mean, std } => Distribution::Normal { mean, std },
            Init::TruncNormal { mean, std, low, high } => Distribution::TruncNormal { mean, std, low, high },
            Init::XavierUniform { gain } => {
                let bound = 3f64.sqrt() * xavier_std(gain)?;
                Distribution::Uniform {
                    low: -bound,
                    high: bound,
                }
            }
            Init::XavierNormal { gain } => Distribution::Normal {
                mean: 0.0,
                std: xavier_std(gain)?,
            },
            Init::KaimingUniform { a, mode, nonlinearity } => {
                let bound = 3f64.sqrt() * nonlinearity.gain(a) / fan(mode)?.sqrt();
                Distribution::Uniform {
                    low: -bound,
                    high: bound,
                }
            }
            Init::KaimingNormal { a, mode, nonlinearity } => Distribution::Normal {
                mean: 0.0,
                std: nonlinearity.gain(a) / fan(mode)?.sqrt(),
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bounds(d: Distribution) -> (f64, f64) {
        match d {
            Distribution::Uniform { low, high } => (low, high),
            other => panic!("not uniform: {other:?}"),
        }
    }

    #[test]
    fn fans_come_from_the_global_shape_as_pytorch_computes_them() {
        assert_eq!(fans(&[8, 3]).unwrap(), (3, 8));
        assert_eq!(fans(&[16, 4, 3, 3]).unwrap(), (36, 144));
        let e = fans(&[8]).unwrap_err().to_string();
        assert!(e.contains("at least 2 dims") && e.contains("[8]"), "{e}");
    }

    #[test]
    fn schemes_give_pytorchs_bounds_and_stds() {
        // nn.Linear's default: kaiming_uniform(a=√5) on [out=8, in=3] is ±1/√3.
        let linear = Init::KaimingUniform {
            a: 5f64.sqrt(),
            mode: FanMode::FanIn,
            nonlinearity: Nonlinearity::LeakyRelu,
        };
        let (lo, hi) = bounds(linear.distribution(&[8, 3]).unwrap());
        assert!((hi - 1.0 / 3f64.sqrt()).abs() < 1e-15 && lo == -hi);
        // xavier_uniform(gain 1) on [8, 3]: √(6/11).
        let (_, hi) = bounds(Init::XavierUniform { gain: 1.0 }.distribution(&[8, 3]).unwrap());
        assert!((hi - (6.0f64 / 11.0).sqrt()).abs() < 1e-15);
        // kaiming_normal(relu, fan_out) on [8, 3]: √2/√8 = 0.5.
        let kn = Init::KaimingNormal {
            a: 0.0,
            mode: FanMode::FanOut,
            nonlinearity: Nonlinearity::Relu,
        };
        assert_eq!(
            kn.distribution(&[8, 3]).unwrap(),
            Distribution::Normal { mean: 0.0, std: 0.5 }
        );
        let xn = Init::XavierNormal { gain: 2.0 }.distribution(&[6, 2]).unwrap();
        assert_eq!(
            xn,
            Distribution::Normal {
                mean: 0.0,
                std: 2.0 * 0.25f64.sqrt()
            }
        );
        assert_eq!(Init::Ones.distribution(&[3]).unwrap(), Distribution::Constant(1.0));
        assert!(Init::XavierUniform { gain: 1.0 }.distribution(&[3]).is_err());
        assert!(kn.distribution(&[0, 3]).unwrap_err().to_string().contains("zero fan"));
    }

    #[test]
    fn gains_match_calculate_gain() {
        assert_eq!(Nonlinearity::Relu.gain(0.0), 2f64.sqrt());
        assert_eq!(Nonlinearity::Tanh.gain(0.0), 5.0 / 3.0);
        assert!((Nonlinearity::LeakyRelu.gain(0.01) - (2.0 / 1.0001f64).sqrt()).abs() < 1e-15);
        assert_eq!(Nonlinearity::Linear.gain(3.0), 1.0);
    }
}
