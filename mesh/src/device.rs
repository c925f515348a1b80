//! Where a tensor's storage lives.

use std::fmt;
use std::str::FromStr;

use crate::{Error, Result};

/// The device that holds a tensor's storage. PyTorch: `torch.device`.
///
/// `Cuda(n)` is the `n`-th GPU; it exists in every build so that code naming it
/// compiles everywhere, and using it in a build without the `cuda` feature is an
/// error that says so. `Meta` holds shapes and dtypes without values (PyTorch:
/// the `meta` device): every op on a meta tensor checks its arguments, charges
/// its output's bytes to the memory tracker and computes nothing, so a step run
/// on meta tensors measures a real step's memory and collectives without its
/// arithmetic or its memory.
///
/// ```
/// use tessera_mesh::Device;
///
/// assert_eq!("cuda:1".parse::<Device>()?, Device::Cuda(1));
/// assert_eq!("cuda".parse::<Device>()?, Device::Cuda(0));
/// assert_eq!(Device::Cpu.to_string(), "cpu");
/// assert_eq!("meta".parse::<Device>()?, Device::Meta);
/// assert!("gpu".parse::<Device>().is_err());
/// # Ok::<(), tessera_mesh::Error>(())
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Device {
    /// Host memory (the default).
    #[default]
    Cpu,
    /// The GPU with this ordinal (`cuda:N`).
    Cuda(usize),
    /// No storage: shapes and dtypes only (`meta`).
    Meta,
}

impl Device {
    /// Whether this is a GPU.
    pub fn is_cuda(self) -> bool {
        matches!(self, Device::Cuda(_))
    }

    /// Whether this is the meta device (no values). PyTorch: `Tensor.is_meta`.
    pub fn is_meta(self) -> bool {
        self == Device::Meta
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
            Device::Meta => f.write_str("meta"),
        }
    }
}

impl FromStr for Device {
    type Err = Error;

    /// `cpu`, `cuda` (GPU 0) or `cuda:N`.
    fn from_str(s: &str) -> Result<Device> {
        let bad = || Error::Device(format!("{s:?} is not a device; use cpu, cuda, cuda:N or meta"));
        match s {
            "cpu" => Ok(Device::Cpu),
            "meta" => Ok(Device::Meta),
            "cuda" => Ok(Device::Cuda(0)),
            _ => {
                let n = s.strip_prefix("cuda:").ok_or_else(bad)?;
                n.parse().map(Device::Cuda).map_err(|_| bad())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_and_print() {
        for (text, d) in [
            ("cpu", Device::Cpu),
            ("cuda", Device::Cuda(0)),
            ("cuda:3", Device::Cuda(3)),
            ("meta", Device::Meta),
        ] {
            assert_eq!(text.parse::<Device>().unwrap(), d);
        }
        assert_eq!(Device::Cuda(2).to_string(), "cuda:2");
        assert_eq!(Device::Meta.to_string(), "meta");
        assert!(Device::Meta.is_meta() && !Device::Meta.is_cuda() && !Device::Cpu.is_meta());
        for bad in ["cuda:", "cuda:x", "CPU", "cuda:-1"] {
            let e = bad.parse::<Device>().unwrap_err().to_string();
            assert!(e.contains(bad) && e.contains("cuda:N"), "{e}");
        }
    }
}
