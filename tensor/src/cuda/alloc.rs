//! The caching allocator of device memory, modelled on PyTorch's CUDA caching
//! allocator: a freed block is kept, by size class and by the stream it was
//! used on, and handed to the next allocation of that class on that stream
//! without a call to the driver. Work on one stream runs in order, so a block
//! freed while kernels still read it can be reused at once on that stream; a
//! block another stream used too (a collective on the communication stream, a
//! peer rank's copy) waits for the events recorded after those uses
//! (PyTorch: `record_stream`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use cudarc::driver::{CudaContext, CudaEvent, CudaStream, result, sys};

use super::library::cuda_error;
use crate::{Error, Result};

/// Statistics of one GPU's caching allocator (PyTorch:
/// `torch.cuda.memory_stats`'s `allocated_bytes` and `reserved_bytes`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CudaMemoryStats {
    /// Bytes of blocks in use by tensors (rounded up to their size class).
    pub allocated_bytes: usize,
    /// Bytes the allocator holds from the driver: in use, cached, or waiting
    /// for another stream.
    pub reserved_bytes: usize,
    /// The most `allocated_bytes` at once since the start or the last reset.
    pub peak_allocated_bytes: usize,
    /// The most `reserved_bytes` at once since the start or the last reset.
    pub peak_reserved_bytes: usize,
    /// How many times the allocator asked the driver for memory (a steady
    /// training loop stops asking after its first steps).
    pub driver_allocations: usize,
}

/// The size classes of device blocks: the host allocator's.
pub(crate) use tessera_mesh::pool::size_class;

/// A block freed while another stream may still use it.
struct Pending {
    ptr: sys::CUdeviceptr,
    size: usize,
    stream: usize,
    events: Vec<CudaEvent>,
}

#[derive(Default)]
struct Inner {
    /// Free blocks by (stream, size class).
    free: HashMap<(usize, usize), Vec<sys::CUdeviceptr>>,
    pending: Vec<Pending>,
    stats: CudaMemoryStats,
}

/// One GPU's pool of device memory.
pub(crate) struct Pool {
    ctx: Arc<CudaContext>,
    ordinal: usize,
    inner: Mutex<Inner>,
}

impl Pool {
    pub(crate) fn new(ctx: Arc<CudaContext>, ordinal: usize) -> Arc<Pool> {
        Arc::new(Pool {
            ctx,
            ordinal,
            inner: Mutex::default(),
        })
    }

    fn bind(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(|e| cuda_error("cuda", e))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // Every update is a single call that leaves the maps consistent.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn stats(&self) -> CudaMemoryStats {
        self.lock().stats
    }

    pub(crate) fn reset_peaks(&self) {
        let mut inner = self.lock();
        inner.stats.peak_allocated_bytes = inner.stats.allocated_bytes;
        inner.stats.peak_reserved_bytes = inner.stats.reserved_bytes;
    }

    /// Gives every cached block back to the driver (PyTorch:
    /// `torch.cuda.empty_cache`). Blocks in use or waiting for another stream stay.
    pub(crate) fn empty_cache(&self) -> Result<()> {
        self.bind()?;
        let mut inner = self.lock();
        Self::collect_pending(&mut inner);
        let free = std::mem::take(&mut inner.free);
        for ((_, size), ptrs) in free {
            for ptr in ptrs {
                // SAFETY: a cached block is owned by the pool alone; cuMemFree
                // waits for work still using it.
                unsafe { result::free_sync(ptr) }.map_err(|e| cuda_error("empty_cache", e))?;
                inner.stats.reserved_bytes -= size;
            }
        }
        Ok(())
    }

    /// Moves pending blocks whose events have all completed to the free lists.
    fn collect_pending(inner: &mut Inner) {
        let pending = std::mem::take(&mut inner.pending);
        for p in pending {
            if p.events.iter().all(|e| e.try_is_complete().unwrap_or(false)) {
                inner.free.entry((p.stream, p.size)).or_default().push(p.ptr);
            } else {
                inner.pending.push(p);
            }
        }
    }

    /// A block of at least `bytes` for work on `stream`.
    pub(crate) fn allocate(
        pool: &Arc<Pool>,
        stream: &Arc<CudaStream>,
        bytes: usize,
        op: &'static str,
    ) -> Result<Block> {
        let size = size_class(bytes);
        let key = stream_key(stream);
        let mut inner = pool.lock();
        let mut ptr = inner.free.get_mut(&(key, size)).and_then(Vec::pop);
        if ptr.is_none() && !inner.pending.is_empty() {
            Self::collect_pending(&mut inner);
            ptr = inner.free.get_mut(&(key, size)).and_then(Vec::pop);
        }
        let ptr = match ptr {
            Some(p) => p,
            None => {
                pool.bind()?;
                // SAFETY: a plain device allocation of `size` bytes.
                let fresh = match unsafe { result::malloc_sync(size) } {
                    Ok(p) => p,
                    Err(_) => {
                        // Out of memory: give the cache back and try once more.
                        drop(inner);
                        pool.empty_cache()?;
                        inner = pool.lock();
                        // SAFETY: as above.
                        unsafe { result::malloc_sync(size) }.map_err(|e| {
                            let (free, total) = pool.ctx.mem_get_info().unwrap_or((0, 0));
                            Error::Device {
                                op,
                                detail: format!(
                                    "cuda:{} is out of memory allocating {size} bytes ({e}): tensors hold \
                                     {} bytes, the allocator {} bytes, the GPU has {free} of {total} bytes \
                                     free; use a smaller batch or shard over more ranks",
                                    pool.ordinal, inner.stats.allocated_bytes, inner.stats.reserved_bytes
                                ),
                            }
                        })?
                    }
                };
                let s = &mut inner.stats;
                s.reserved_bytes += size;
                s.peak_reserved_bytes = s.peak_reserved_bytes.max(s.reserved_bytes);
                s.driver_allocations += 1;
                fresh
            }
        };
        let s = &mut inner.stats;
        s.allocated_bytes += size;
        s.peak_allocated_bytes = s.peak_allocated_bytes.max(s.allocated_bytes);
        Ok(Block {
            ptr,
            size,
            stream: key,
            pool: Arc::clone(pool),
            uses: Mutex::default(),
        })
    }
}

fn stream_key(stream: &CudaStream) -> usize {
    stream.cu_stream() as usize
}

/// A block of device memory, back in its pool when dropped.
pub(crate) struct Block {
    ptr: sys::CUdeviceptr,
    size: usize,
    stream: usize,
    pool: Arc<Pool>,
    /// Events recorded after uses on other streams.
    uses: Mutex<Vec<CudaEvent>>,
}

impl std::fmt::Debug for Block {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Block({:#x}, {} bytes on cuda:{})",
            self.ptr, self.size, self.pool.ordinal
        )
    }
}

impl Block {
    pub(crate) fn ptr(&self) -> sys::CUdeviceptr {
        self.ptr
    }

    /// Notes that `stream`, not the block's own, used the block: it is reused
    /// only after the work on `stream` issued so far has completed.
    pub(crate) fn used_on(&self, stream: &CudaStream) -> Result<()> {
        if stream_key(stream) == self.stream {
            return Ok(());
        }
        let event = stream.record_event(None).map_err(|e| cuda_error("record_stream", e))?;
        self.uses.lock().unwrap_or_else(PoisonError::into_inner).push(event);
        Ok(())
    }
}

impl Drop for Block {
    fn drop(&mut self) {
        let events = std::mem::take(self.uses.get_mut().unwrap_or_else(PoisonError::into_inner));
        let mut inner = self.pool.lock();
        inner.stats.allocated_bytes -= self.size;
        if events.is_empty() {
            inner.free.entry((self.stream, self.size)).or_default().push(self.ptr);
        } else {
            inner.pending.push(Pending {
                ptr: self.ptr,
                size: self.size,
                stream: self.stream,
                events,
            });
        }
    }
}
