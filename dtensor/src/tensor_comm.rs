//! Collectives on whole flat tensors: the path of tensors on a GPU, whose
//! elements the host cannot slice (redistribution and bucket collectives pack
//! and place with tensor ops, then call these), and, in tests, of host tensors
//! through the host communicator, so that the path is checked on every machine.

use tessera_mesh::{Communicator, ReduceOp};

use crate::{Result, Tensor};

thread_local! {
    /// Whether this thread runs host tensors through the tensor path (tests).
    static FORCE_TENSOR_PATH: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

pub(crate) fn tensor_path_forced() -> bool {
    FORCE_TENSOR_PATH.with(std::cell::Cell::get)
}

/// Runs `f` with this thread's host tensors redistributed through the tensor
/// path that device tensors take (whole-tensor packing and collectives), so
/// that the host tests check that path too.
#[cfg(any(test, feature = "testing"))]
pub fn with_tensor_path<R>(f: impl FnOnce() -> R) -> R {
    let before = FORCE_TENSOR_PATH.with(|c| c.replace(true));
    let out = f();
    FORCE_TENSOR_PATH.with(|c| c.set(before));
    out
}

/// Collectives on whole flat tensors: what the tensor path needs. Device
/// tensors use the GPU's (ranks sharing one GPU); host tensors, in tests, the
/// communicator's through host buffers.
pub(crate) trait TensorComm {
    /// `t` split into `segments` on every rank, gathered segment by segment
    /// (see `Communicator::all_gather_segmented`).
    fn all_gather_segmented(&self, t: &Tensor, segments: &[usize]) -> Result<Tensor>;
    fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor>;
    fn all_gather_v(&self, t: &Tensor, counts: &[usize]) -> Result<Tensor>;
    fn reduce_scatter_v(&self, t: &Tensor, counts: &[usize], op: ReduceOp) -> Result<Tensor>;
    fn all_to_all_v(&self, t: &Tensor, send: &[usize], recv: &[usize]) -> Result<Tensor>;
}

/// The host communicator's collectives on host tensors.
pub(crate) struct HostComm<'a>(pub(crate) &'a dyn Communicator);

impl TensorComm for HostComm<'_> {
    fn all_gather_segmented(&self, t: &Tensor, segments: &[usize]) -> Result<Tensor> {
        let n = t.numel() * self.0.size();
        let mut out = tessera_mesh::Buffer::zeros(t.dtype(), n);
        self.0.all_gather_segmented(t.as_buf()?, out.as_buf_mut(), segments)?;
        Ok(Tensor::from_buffer(out, &[n])?)
    }

    fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        let mut out = tessera_mesh::Buffer::zeros(t.dtype(), t.numel());
        self.0.all_reduce_into(t.as_buf()?, out.as_buf_mut(), op)?;
        Ok(Tensor::from_buffer(out, &[t.numel()])?)
    }

    fn all_gather_v(&self, t: &Tensor, counts: &[usize]) -> Result<Tensor> {
        let n = counts.iter().sum();
        let mut out = tessera_mesh::Buffer::zeros(t.dtype(), n);
        self.0.all_gather_v(t.as_buf()?, out.as_buf_mut(), counts)?;
        Ok(Tensor::from_buffer(out, &[n])?)
    }

    fn reduce_scatter_v(&self, t: &Tensor, counts: &[usize], op: ReduceOp) -> Result<Tensor> {
        let n = counts[self.0.rank()];
        let mut out = tessera_mesh::Buffer::zeros(t.dtype(), n);
        self.0.reduce_scatter_v(t.as_buf()?, out.as_buf_mut(), counts, op)?;
        Ok(Tensor::from_buffer(out, &[n])?)
    }

    fn all_to_all_v(&self, t: &Tensor, send: &[usize], recv: &[usize]) -> Result<Tensor> {
        let n = recv.iter().sum();
        let mut out = tessera_mesh::Buffer::zeros(t.dtype(), n);
        self.0.all_to_all_v(t.as_buf()?, send, out.as_buf_mut(), recv)?;
        Ok(Tensor::from_buffer(out, &[n])?)
    }
}

/// The device collectives of ranks that share one GPU.
#[cfg(feature = "cuda")]
impl TensorComm for tessera_tensor::cuda::comm::LocalGroup<'_> {
    fn all_gather_segmented(&self, t: &Tensor, segments: &[usize]) -> Result<Tensor> {
        Ok(tessera_tensor::cuda::comm::LocalGroup::all_gather_segmented(
            self, t, segments,
        )?)
    }

    fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        use tessera_tensor::cuda::comm::DeviceCollectives;
        Ok(DeviceCollectives::all_reduce(self, t, op)?)
    }

    fn all_gather_v(&self, t: &Tensor, counts: &[usize]) -> Result<Tensor> {
        Ok(tessera_tensor::cuda::comm::LocalGroup::all_gather_v(self, t, counts)?)
    }

    fn reduce_scatter_v(&self, t: &Tensor, counts: &[usize], op: ReduceOp) -> Result<Tensor> {
        Ok(tessera_tensor::cuda::comm::LocalGroup::reduce_scatter_v(
            self, t, counts, op,
        )?)
    }

    fn all_to_all_v(&self, t: &Tensor, send: &[usize], recv: &[usize]) -> Result<Tensor> {
        Ok(tessera_tensor::cuda::comm::LocalGroup::all_to_all_v(
            self, t, send, recv,
        )?)
    }
}

/// The device collectives for `t`'s ranks over `comm`.
pub(crate) fn device_group<'a>(comm: &'a dyn Communicator, t: &Tensor) -> Result<Box<dyn TensorComm + 'a>> {
    #[cfg(feature = "cuda")]
    {
        let _ = t;
        Ok(Box::new(tessera_tensor::cuda::comm::LocalGroup::new(comm)?))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = comm;
        Err(tessera_tensor::Error::Device {
            op: "collective",
            detail: format!("a tensor on {} needs the cuda feature", t.device()),
        }
        .into())
    }
}
