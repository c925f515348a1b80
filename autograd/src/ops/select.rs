//! Selection ops and their gradients: `where_cond`, `masked_fill`,
//! `index_select`, `gather`; `argmax`/`argmin` (no gradient); splitting and
//! stacking.

use smallvec::smallvec;
use tessera_dtensor::{DTensor, Placement, Tensor};
use tessera_tensor::ops::{chunk_sizes, split_ranges, split_sizes, stack_pieces};

use super::unbroadcast;
use crate::{Result, Var};

/// A replicated rank-0 zero of `like`'s dtype on its mesh.
fn zero_like(like: &DTensor) -> tessera_dtensor::Result<DTensor> {
    let mesh = like.mesh();
    DTensor::from_local(
        Tensor::zeros(&[], like.dtype())?.to(like.to_local().device())?,
        mesh,
        &vec![Placement::Replicate; mesh.ndim()],
        &[],
    )
}

impl Var {
    /// Where the mask `self` (`u8`, a constant) is set, `x`; elsewhere `y`
    /// (broadcast together; see [`DTensor::where_cond`]). The gradient flows to
    /// `x` where the mask is set and to `y` elsewhere.
    ///
    /// PyTorch: `torch.where(cond, x, y)`.
    ///
    /// # Errors
    /// As [`DTensor::where_cond`].
    pub fn where_cond(&self, x: &Var, y: &Var) -> Result<Var> {
        let mask = self.value().clone();
        let value = mask.where_cond(x.value(), y.value())?;
        let (sx, sy) = (x.value().shape().to_vec(), y.value().shape().to_vec());
        let (need_x, need_y) = (x.requires_grad(), y.requires_grad());
        Ok(Var::from_op("where_cond", value, &[self, x, y], move |g| {
            let gx = if need_x {
                Some(unbroadcast(&mask.where_cond(g, &zero_like(g)?)?, &sx)?)
            } else {
                None
            };
            let gy = if need_y {
                Some(unbroadcast(&g.masked_fill(&mask, 0.0)?, &sy)?)
            } else {
                None
            };
            Ok(smallvec![None, gx, gy])
        }))
    }

    /// This var with `value` wherever `mask` (`u8`, a constant) is set; the
    /// gradient is zero there.
    ///
    /// PyTorch: `Tensor.masked_fill(mask, value)`.
    ///
    /// # Errors
    /// As [`DTensor::masked_fill`].
    pub fn masked_fill(&self, mask: &Var, value: f64) -> Result<Var> {
        let m = mask.value().clone();
        let out = self.value().masked_fill(&m, value)?;
        Ok(Var::from_op("masked_fill", out, &[self, mask], move |g| {
            Ok(smallvec![Some(g.masked_fill(&m, 0.0)?), None])
        }))
    }

    /// The slices of `dim` at `index` (`i64 [n]`, a constant); the gradient adds
    /// each slice back where it came from (repeats accumulate).
    ///
    /// PyTorch: `torch.index_select(x, dim, index)`.
    ///
    /// # Errors
    /// As [`DTensor::index_select`].
    pub fn index_select(&self, dim: impl tessera_dtensor::Dim, index: &Var) -> Result<Var> {
        let dim = dim.resolve("index_select", self.value().shape().len())?;
        let idx = index.value().clone();
        let value = self.value().index_select(dim, &idx)?;
        let size = self.value().shape()[dim];
        Ok(Var::from_op("index_select", value, &[self, index], move |g| {
            Ok(smallvec![Some(g.index_select_backward(dim, &idx, size)?), None])
        }))
    }

    /// Elements along `dim` picked per position by `index` (`i64`, a constant,
    /// the rank of this var); the gradient scatters back, adding repeats.
    ///
    /// PyTorch: `torch.gather(x, dim, index)`.
    ///
    /// # Errors
    /// As [`DTensor::gather`].
    pub fn gather(&self, dim: impl tessera_dtensor::Dim, index: &Var) -> Result<Var> {
        let dim = dim.resolve("gather", self.value().shape().len())?;
        let idx = index.value().clone();
        let value = self.value().gather(dim, &idx)?;
        let shape = self.value().shape().to_vec();
        Ok(Var::from_op("gather", value, &[self, index], move |g| {
            Ok(smallvec![Some(g.gather_backward(dim, &idx, &shape)?), None])
        }))
    }

    /// The index of the largest value along `dim` (`i64`, a constant: no
    /// gradient flows through an index).
    ///
    /// PyTorch: `torch.argmax(x, dim, keepdim)`.
    ///
    /// # Errors
    /// As [`DTensor::argmax`].
    pub fn argmax(&self, dim: impl tessera_dtensor::Dim, keepdim: bool) -> Result<Var> {
        let dim = dim.resolve("argmax", self.value().shape().len())?;
        Ok(Var::constant(self.value().argmax(dim, keepdim)?))
    }

    /// The index of the smallest value along `dim` (`i64`, a constant).
    ///
    /// PyTorch: `torch.argmin(x, dim, keepdim)`.
    ///
    /// # Errors
    /// As [`DTensor::argmin`].
    pub fn argmin(&self, dim: impl tessera_dtensor::Dim, keepdim: bool) -> Result<Var> {
        let dim = dim.resolve("argmin", self.value().shape().len())?;
        Ok(Var::constant(self.value().argmin(dim, keepdim)?))
    }

    /// Pieces of `split_size` along `dim`, the last shorter; each piece's
    /// gradient lands in its slice.
    ///
    /// PyTorch: `torch.split(x, split_size, dim)`.
    ///
    /// # Errors
    /// `dim` out of range, `split_size == 0` for a non-empty dim.
    pub fn split(&self, split_size: usize, dim: impl tessera_dtensor::Dim) -> Result<Vec<Var>> {
        let dim = dim.resolve("split", self.value().shape().len())?;
        self.split_with_sizes(&split_sizes("split", self.value().shape(), split_size, dim)?, dim)
    }

    /// Pieces of `sizes[i]` along `dim`, in order.
    ///
    /// PyTorch: `torch.split(x, sizes, dim)`.
    ///
    /// # Errors
    /// Sizes that do not add up to the dim; `dim` out of range.
    pub fn split_with_sizes(&self, sizes: &[usize], dim: impl tessera_dtensor::Dim) -> Result<Vec<Var>> {
        let dim = dim.resolve("split_with_sizes", self.value().shape().len())?;
        split_ranges("split_with_sizes", self.value().shape(), sizes, dim)?
            .into_iter()
            .map(|(start, len)| self.narrow(dim, start, len))
            .collect()
    }

    /// `ceil(size / n)` slices along `dim` per piece (fewer than `n` pieces
    /// when the size runs out first).
    ///
    /// PyTorch: `torch.chunk(x, n, dim)`.
    ///
    /// # Errors
    /// `dim` out of range, `n == 0`.
    pub fn chunk(&self, n: usize, dim: impl tessera_dtensor::Dim) -> Result<Vec<Var>> {
        let dim = dim.resolve("chunk", self.value().shape().len())?;
        self.split_with_sizes(&chunk_sizes("chunk", self.value().shape(), n, dim)?, dim)
    }

    /// Vars of one shape stacked along a new dim `dim`.
    ///
    /// PyTorch: `torch.stack`.
    ///
    /// # Errors
    /// No vars, shapes that differ, `dim` past the rank.
    pub fn stack(xs: &[&Var], dim: impl tessera_dtensor::Dim) -> Result<Var> {
        // No tensors: any dim resolves, and the missing input is the error below.
        let dim = dim.resolve("stack", xs.first().map_or(usize::MAX, |x| x.value().shape().len() + 1))?;
        let pieces = stack_pieces("stack", xs.iter().map(|x| x.value().shape()), dim)?;
        let unsqueezed = xs
            .iter()
            .zip(&pieces)
            .map(|(x, s)| x.reshape(s))
            .collect::<Result<Vec<_>>>()?;
        Var::cat(&unsqueezed.iter().collect::<Vec<_>>(), dim)
    }
}
