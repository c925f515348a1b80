//! Raw access to the buffers of a collective: peers' published inputs read in
//! place, and this rank's own output written through its pointer.

use crate::Element;
use crate::threads::desc::Desc;
use crate::threads::store::{Store, Writer};

/// Peer `q`'s buffer at `ptr` as a slice.
///
/// # Safety
/// `ptr`/`len` must come from a descriptor published in the current collective,
/// whose owner stays inside the collective (and does not write this region) until
/// the next barrier point.
pub(super) unsafe fn peer<'a, T>(ptr: usize, len: usize) -> &'a [T] {
    if len == 0 {
        return &[];
    }
    // SAFETY: the caller guarantees the region is live, initialised, aligned for T
    // (it came from a `&[T]`) and not written concurrently.
    unsafe { std::slice::from_raw_parts(ptr as *const T, len) }
}

/// Writes `src` into this rank's own output at element offset `at` with `store`.
///
/// # Safety
/// `out` is this rank's output pointer (from its `&mut [T]`), `at + src.len()` is
/// within it, and no peer reads that region during this phase.
pub(super) unsafe fn write<T: Copy>(store: Store, out: *mut T, at: usize, src: &[T]) {
    // SAFETY: per the caller's contract the destination is in bounds and exclusively ours;
    // the source belongs to another buffer, so they do not overlap.
    unsafe { store.copy(out.add(at), src) }
}

/// The run of peer `dq`'s send buffer that holds element `pos` (`pos <
/// send_len`): the address of that element (0 inside a run of zeros) and the
/// elements left in the run from it. A flat buffer is one run.
///
/// # Safety
/// `dq` was published in the current collective (its run table, if any, is alive).
pub(super) unsafe fn run_at(dq: &Desc, size: usize, pos: usize) -> (usize, usize) {
    if dq.runs.0 == 0 {
        return (dq.send_ptr + pos * size, dq.send_len - pos);
    }
    // SAFETY: the table was published with this descriptor and outlives the collective.
    let table = unsafe { std::slice::from_raw_parts(dq.runs.0 as *const (usize, usize), dq.runs.1) };
    let mut start = 0;
    for &(addr, n) in table {
        if pos < start + n {
            let off = pos - start;
            return (if addr == 0 { 0 } else { addr + off * size }, n - off);
        }
        start += n;
    }
    // INVARIANT: the runs add up to `send_len` (both come from one `Pieces`), and
    // callers only ask for `pos < send_len` (validated against every peer).
    unreachable!("element {pos} past a run table of {start} elements")
}

/// Copies elements `[from, from + len)` of peer `dq`'s send buffer (flat or
/// runs) to element `at` of the output `w` writes.
///
/// # Safety
/// As [`Writer::put`] for `len` elements at `at`; `dq` as in [`run_at`], with
/// `from + len <= send_len`.
pub(super) unsafe fn copy_from_peer<T: Element>(w: &mut Writer, dq: &Desc, from: usize, len: usize, at: usize) {
    let size = size_of::<T>();
    let mut done = 0;
    while done < len {
        // SAFETY: per this function's contract.
        let (addr, left) = unsafe { run_at(dq, size, from + done) };
        let n = left.min(len - done);
        if addr == 0 {
            // SAFETY: in bounds and ours (the contract); all-zero bits are T's zero.
            unsafe { w.zeros::<T>(at + done, n) };
        } else {
            // SAFETY: the run holds `left >= n` elements from `addr`.
            unsafe { w.put(at + done, peer::<T>(addr, n)) };
        }
        done += n;
    }
}
