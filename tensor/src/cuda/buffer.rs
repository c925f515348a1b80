//! A tensor's storage in device memory.

use std::sync::{Arc, PoisonError};

use cudarc::driver::result;
use tessera_mesh::{Buffer, DType};

use super::alloc::{Block, Pool};
use super::driver::{self, Gpu, RankStreams};
use super::library::cuda_error;
use super::staging::{SLOT_BYTES, Staging};
use crate::{Error, Result};

/// `len` elements of `dtype` in a block of device memory.
#[derive(Debug)]
pub(crate) struct CudaBuffer {
    gpu: Arc<Gpu>,
    block: Block,
    len: usize,
    dtype: DType,
}

impl CudaBuffer {
    /// Room for `len` elements of `dtype` for `streams`' rank on its GPU (its
    /// compute stream); the contents are not initialised.
    pub(crate) fn uninit_on(streams: &RankStreams, len: usize, dtype: DType, op: &'static str) -> Result<CudaBuffer> {
        let bytes = len
            .checked_mul(dtype.size_in_bytes())
            .ok_or_else(|| Error::OutOfMemory {
                op,
                shape: vec![len],
                dtype,
                bytes: None,
            })?;
        let block = Pool::allocate(&streams.gpu.pool, &streams.compute, bytes, op)?;
        Ok(CudaBuffer {
            gpu: Arc::clone(&streams.gpu),
            block,
            len,
            dtype,
        })
    }

    /// A copy of host `data` on GPU `ordinal`: queued through the rank's
    /// pinned slots when it fits one ([`SLOT_BYTES`]), without the host
    /// waiting; larger copies wait for the rank's queue.
    pub(crate) fn from_host(ordinal: usize, data: &Buffer) -> Result<CudaBuffer> {
        let gpu = driver::gpu(ordinal)?;
        let streams = driver::streams(&gpu)?;
        let out = Self::uninit_on(&streams, data.len(), data.dtype(), "to")?;
        if data.is_empty() {
            return Ok(out);
        }
        gpu.bind()?;
        let view = data.as_buf();
        let bytes = view.as_bytes();
        if bytes.len() <= SLOT_BYTES {
            // Queued through pinned memory: no wait for the device.
            let mut staging = streams.staging.lock().unwrap_or_else(PoisonError::into_inner);
            let st = match &mut *staging {
                Some(st) => st,
                none => none.insert(Staging::new(&gpu.ctx)?),
            };
            if st.copy(out.ptr(), bytes, &streams.compute)? {
                streams.count_wait();
            }
            return Ok(out);
        }
        let stream = streams.compute.cu_stream();
        tessera_mesh::dispatch_buf!(Buffer, data, v, _T => {
            // SAFETY: the block holds at least `v`'s bytes; the copy from
            // pageable memory has read `v` when the call returns.
            unsafe { result::memcpy_htod_async(out.ptr(), v.as_slice(), stream) }
        })
        .map_err(|e| cuda_error("to", e))?;
        streams.compute.synchronize().map_err(|e| cuda_error("to", e))?;
        streams.count_wait();
        Ok(out)
    }

    /// The elements `[start, start + len)` copied to the host.
    pub(crate) fn to_host(&self, start: usize, len: usize) -> Result<Buffer> {
        let gpu = self.gpu();
        let streams = driver::streams(gpu)?;
        gpu.bind()?;
        let src = self.ptr() + (start * self.dtype.size_in_bytes()) as u64;
        let mut out = Buffer::zeros(self.dtype, len);
        if len > 0 {
            let stream = streams.compute.cu_stream();
            tessera_mesh::dispatch_buf!(Buffer, &mut out, v, _T => {
                // SAFETY: `[start, start + len)` lies in the block (the caller's
                // layout says so); the stream is synchronised before `out` is read.
                unsafe { result::memcpy_dtoh_async(v.as_mut_slice(), src, stream) }
            })
            .map_err(|e| cuda_error("to", e))?;
        }
        // Work from other streams that wrote this buffer was ordered before the
        // compute stream by events; waiting for the compute stream waits for it.
        streams.wait("to", false)?;
        Ok(out)
    }

    pub(crate) fn ptr(&self) -> u64 {
        self.block.ptr()
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn dtype(&self) -> DType {
        self.dtype
    }

    pub(crate) fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    pub(crate) fn ordinal(&self) -> usize {
        self.gpu.ordinal
    }

    pub(crate) fn block(&self) -> &Block {
        &self.block
    }
}
