//! [`ReduceOp`]: how reductions combine values.

use std::fmt;

use crate::{DType, Error, Result};

/// How a reduction combines values from every rank.
///
/// PyTorch: `torch.distributed.ReduceOp`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ReduceOp {
    /// Sum.
    Sum,
    /// Arithmetic mean (sum divided by the number of ranks). Floats only.
    Avg,
    /// Element-wise maximum.
    Max,
    /// Element-wise minimum.
    Min,
    /// Product.
    Product,
}

impl ReduceOp {
    /// Every reduction, for tests.
    pub const ALL: [ReduceOp; 5] = [
        ReduceOp::Sum,
        ReduceOp::Avg,
        ReduceOp::Max,
        ReduceOp::Min,
        ReduceOp::Product,
    ];

    /// Checks that the reduction is defined for `dtype` (`op` names the caller in errors).
    pub fn check(self, op: &'static str, dtype: DType) -> Result<()> {
        let hint = match (self, dtype) {
            (_, DType::U8) => "; raw bytes can be gathered or exchanged but not reduced",
            (ReduceOp::Avg, DType::I64) => "; reduce with Sum and divide explicitly",
            _ => return Ok(()),
        };
        Err(Error::UnsupportedReduction {
            op,
            reduce: self,
            dtype,
            hint,
        })
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Avg => "avg",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
            ReduceOp::Product => "product",
        })
    }
}
