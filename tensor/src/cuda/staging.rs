//! Pinned host memory through which small host-to-device copies pass without
//! the host waiting for the device (PyTorch's pinned-memory caching host
//! allocator does the same for `non_blocking` copies).
//!
//! A copy from pageable memory must end before its source can be freed, so
//! the host would wait for the rank's whole queue of kernels: positions, the
//! seed of a backward and other small constants uploaded mid-step would each
//! drain the GPU. Through a pinned slot, the copy is queued on the rank's
//! stream like a kernel and the slot is reused once an event says its copy
//! has run.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaEvent, CudaStream, result};

use super::library::cuda_error;
use crate::Result;

/// The largest copy a slot takes; larger copies wait for the device.
pub(crate) const SLOT_BYTES: usize = 256 << 10;
/// Slots per rank: a copy waits only when the copy `SLOTS` before it has not run.
const SLOTS: usize = 32;

/// One rank's ring of pinned slots, each with the event of its last copy.
pub(crate) struct Staging {
    base: *mut u8,
    events: Vec<CudaEvent>,
    recorded: Vec<bool>,
    next: usize,
}

// SAFETY: the pinned block is owned by this value alone and used under the
// rank's mutex; events are thread-safe CUDA objects.
unsafe impl Send for Staging {}

impl Staging {
    /// `SLOTS` slots of pinned memory in `ctx`.
    pub(crate) fn new(ctx: &Arc<CudaContext>) -> Result<Staging> {
        ctx.bind_to_thread().map_err(|e| cuda_error("to", e))?;
        // SAFETY: a fresh allocation; its bytes are written before any is read.
        let base = unsafe { result::malloc_host(SLOT_BYTES * SLOTS, 0) }.map_err(|e| cuda_error("to", e))?;
        let events = (0..SLOTS)
            .map(|_| ctx.new_event(None))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| cuda_error("to", e))?;
        Ok(Staging {
            base: base.cast(),
            events,
            recorded: vec![false; SLOTS],
            next: 0,
        })
    }

    /// Queues the copy of `bytes` (at most [`SLOT_BYTES`]) to device address
    /// `dst` on `stream` through the next slot; returns whether the host had
    /// to wait for that slot's previous copy.
    pub(crate) fn copy(&mut self, dst: u64, bytes: &[u8], stream: &CudaStream) -> Result<bool> {
        debug_assert!(bytes.len() <= SLOT_BYTES);
        let i = self.next;
        self.next = (i + 1) % SLOTS;
        let event = &self.events[i];
        let waited = self.recorded[i] && !event.is_complete();
        if waited {
            event.synchronize().map_err(|e| cuda_error("to", e))?;
        }
        // SAFETY: slot `i` lies in the pinned block, and its previous copy
        // has run (checked above), so nothing else reads it.
        let slot = unsafe { std::slice::from_raw_parts_mut(self.base.add(i * SLOT_BYTES), bytes.len()) };
        slot.copy_from_slice(bytes);
        // SAFETY: `dst` holds `bytes.len()` bytes (the caller's new buffer);
        // the slot stays untouched until the event recorded next has passed.
        unsafe { result::memcpy_htod_async(dst, slot, stream.cu_stream()) }.map_err(|e| cuda_error("to", e))?;
        event.record(stream).map_err(|e| cuda_error("to", e))?;
        self.recorded[i] = true;
        Ok(waited)
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        for (e, &r) in self.events.iter().zip(&self.recorded) {
            if r {
                let _ = e.synchronize();
            }
        }
        // SAFETY: allocated by `malloc_host`, and no copy reads it any more.
        let _ = unsafe { result::free_host(self.base.cast()) };
    }
}
