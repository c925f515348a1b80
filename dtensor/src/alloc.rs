//! Large host buffers for exchanges and kernel outputs.
//!
//! A fresh multi-megabyte buffer costs a page fault per 4 KiB page on first touch
//! (and the kernel zeroes every page), which for the outputs of collectives can
//! cost more than the copy itself. Two remedies:
//!
//! - on Linux, buffers of 2 MiB or more are advised to use transparent huge pages
//!   before they are touched (512 times fewer faults where the system allows it);
//! - when a tensor's large storage is dropped on its rank's thread, the buffer goes
//!   to a small per-thread cache, and exchange buffers that are overwritten in full
//!   ([`reused`]) come from there first: no faults, no zeroing. The cache holds at
//!   most [`CACHE_BUFFERS`] buffers and [`CACHE_BYTES`] bytes per thread and dies
//!   with the thread; cached buffers are not tensor storage, so the memory tracker
//!   does not count them;
//! - with glibc, the first tensor storage tunes `malloc` to keep freed memory for
//!   reuse instead of handing it back to the system after every step (a heap
//!   allocation up to 32 MiB, no trimming below 1 GiB of free top, 64 MiB of top
//!   padding): a training step allocates and frees the same sizes every time, and
//!   returning them costs a page fault per page on the next step. Set
//!   `TESSERA_SYSTEM_MALLOC=1` to leave `malloc` as it is.

use std::cell::RefCell;

use tessera_mesh::{Buffer, Element};

/// Buffers kept per thread.
pub(crate) const CACHE_BUFFERS: usize = 4;
/// Bytes kept per thread.
pub(crate) const CACHE_BYTES: usize = 512 << 20;

thread_local! {
    static CACHE: RefCell<Vec<Buffer>> = const { RefCell::new(Vec::new()) };
}

/// Offers a dropped storage buffer to this thread's cache.
pub(crate) fn recycle(buf: Buffer) {
    let bytes = buf.len() * buf.dtype().size_in_bytes();
    if !(HUGE..=CACHE_BYTES).contains(&bytes) {
        return;
    }
    // The cache may be gone during thread exit; then the buffer is simply freed.
    let _ = CACHE.try_with(|c| {
        let mut c = c.borrow_mut();
        c.push(buf);
        let total = |c: &Vec<Buffer>| c.iter().map(|b| b.len() * b.dtype().size_in_bytes()).sum::<usize>();
        while c.len() > CACHE_BUFFERS || total(&c) > CACHE_BYTES {
            c.remove(0);
        }
    });
}

/// A vector of `n` elements whose contents are unspecified (but valid values): a
/// cached buffer of that exact size when there is one, else a fresh zeroed one.
/// For outputs that the caller overwrites in full.
pub(crate) fn reused<T: Element>(n: usize) -> Vec<T> {
    let hit = CACHE
        .try_with(|c| {
            let mut c = c.borrow_mut();
            let i = c.iter().position(|b| b.dtype() == T::DTYPE && b.len() == n)?;
            T::from_buffer(c.remove(i)).ok()
        })
        .ok()
        .flatten();
    hit.unwrap_or_else(|| zeroed(n))
}

/// Tunes glibc's `malloc` once per process (see the module docs).
pub(crate) fn tune_malloc_once() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if std::env::var_os("TESSERA_SYSTEM_MALLOC").is_some_and(|v| v != "0") {
            return;
        }
        tune_malloc();
    });
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn tune_malloc() {
    // SAFETY: mallopt only changes allocator parameters; it is called once,
    // before this process's tensors are allocated by this library.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
        libc::mallopt(libc::M_TOP_PAD, 64 << 20);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn tune_malloc() {}

/// Below this size the advice is not worth a system call.
const HUGE: usize = 2 << 20;

/// A vector of `n` default (zero) elements.
pub(crate) fn zeroed<T: Element>(n: usize) -> Vec<T> {
    let v = vec![T::default(); n];
    advise_huge(&v);
    v
}

fn advise_huge<T>(v: &[T]) {
    advise_raw(v.as_ptr() as usize, std::mem::size_of_val(v));
}

#[cfg(target_os = "linux")]
fn advise_raw(addr: usize, bytes: usize) {
    if bytes < HUGE {
        return;
    }
    const PAGE: usize = 4096;
    let start = addr.div_ceil(PAGE) * PAGE;
    let end = (addr + bytes) / PAGE * PAGE;
    if end > start {
        // SAFETY: [start, end) lies inside one live allocation owned by the caller;
        // MADV_HUGEPAGE only changes how the kernel backs those pages, never their
        // contents, so no Rust reference observes any change. A failure is harmless
        // (the pages stay small) and is ignored.
        unsafe {
            libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
        }
    }
}

#[cfg(not(target_os = "linux"))]
fn advise_raw(_addr: usize, _bytes: usize) {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dropped_large_buffers_are_reused() {
        let n = 1 << 20; // 4 MiB of f32
        let v: Vec<f32> = vec![7.0; n];
        let ptr = v.as_ptr();
        recycle(Buffer::F32(v));
        let again: Vec<f32> = reused(n);
        assert_eq!(again.as_ptr(), ptr, "the cached buffer comes back");
        assert_eq!(again.len(), n);
        let other: Vec<f32> = reused(n);
        assert_ne!(other.as_ptr(), ptr, "a buffer is handed out once");
        assert!(other.iter().all(|&x| x == 0.0), "a fresh buffer is zeroed");
        // Small buffers are not cached.
        let small = vec![1.0f32; 16];
        recycle(Buffer::F32(small));
        CACHE.with(|c| assert!(c.borrow().iter().all(|b| b.len() != 16)));
    }

    #[test]
    fn cache_is_bounded() {
        for _ in 0..10 {
            recycle(Buffer::F64(vec![0.0; 1 << 20]));
        }
        CACHE.with(|c| assert!(c.borrow().len() <= CACHE_BUFFERS));
    }

    #[test]
    fn buffers_are_usable() {
        let v: Vec<f32> = zeroed(3 << 20);
        assert_eq!(v.len(), 3 << 20);
        assert!(v.iter().all(|&x| x == 0.0));
        let small: Vec<i64> = zeroed(7);
        assert_eq!(small, vec![0; 7]);
    }
}
