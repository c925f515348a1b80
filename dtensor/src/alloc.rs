//! Large host buffers for exchanges and kernel outputs.
//!
//! A fresh multi-megabyte buffer costs a page fault per 4 KiB page on first touch,
//! which for the outputs of collectives can cost more than the copy itself. On
//! Linux, buffers of 2 MiB or more are advised to use transparent huge pages
//! before they are touched (512 times fewer faults where the system allows it).

use tessera_mesh::Element;

/// Below this size the advice is not worth a system call.
const HUGE: usize = 2 << 20;

/// A vector of `n` default (zero) elements.
pub(crate) fn zeroed<T: Element>(n: usize) -> Vec<T> {
    let v = vec![T::default(); n];
    advise_huge(&v);
    v
}

/// An empty vector with room for `n` elements.
pub(crate) fn with_capacity<T: Element>(n: usize) -> Vec<T> {
    let v: Vec<T> = Vec::with_capacity(n);
    // The advice covers the allocation behind the (still empty) vector.
    advise_raw(v.as_ptr() as usize, v.capacity() * size_of::<T>());
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
    fn buffers_are_usable() {
        let v: Vec<f32> = zeroed(3 << 20);
        assert_eq!(v.len(), 3 << 20);
        assert!(v.iter().all(|&x| x == 0.0));
        let mut w: Vec<f64> = with_capacity(1 << 20);
        w.extend((0..1 << 20).map(|i| i as f64));
        assert_eq!(w[12345], 12345.0);
        let small: Vec<i64> = zeroed(7);
        assert_eq!(small, vec![0; 7]);
    }
}
