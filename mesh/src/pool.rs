//! Large host buffers kept for reuse, per rank (shared by the rank's threads:
//! its own, and the communication thread whose collectives allocate their
//! outputs; per thread for threads that work for no rank): a caching
//! allocator in the manner of PyTorch's for the device.
//!
//! A buffer of 256 KiB or more that its owner gives back ([`give`]: tensor
//! storage when it drops) waits here, and the next request of its dtype whose
//! size it holds within that size's class ([`size_class`]: at most a quarter
//! more) takes it ([`take`], and [`Buffer::zeros`] for large buffers) instead
//! of memory fresh from the system, whose every page faults on first touch —
//! above 32 MiB every allocation is fresh pages, since `malloc` maps those
//! directly. A rank keeps at most what its owner's limit allows (the memory
//! tracker's peak of the rank, at least 64 MiB; see [`set_hooks`]), dropping
//! its oldest buffers beyond, and [`empty_cache`] gives them all back.

use std::any::Any;
use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex, OnceLock, PoisonError};

use crate::context::{RankId, current_rank};
use crate::{Buffer, DType};

/// The smallest buffer kept: below, `malloc`'s free lists serve as well.
pub const MIN_BYTES: usize = 256 << 10;
/// What a thread keeps at most without hooks.
pub const FLOOR_BYTES: usize = 64 << 20;

/// The size class of `bytes`: multiples of 512 bytes up to 1 MiB, above that
/// multiples of a quarter of the power of two below (at most 25% more;
/// PyTorch's `roundup_power2_divisions` of 4).
pub fn size_class(bytes: usize) -> usize {
    const SMALL: usize = 1 << 20;
    let bytes = bytes.max(1);
    if bytes <= SMALL {
        return bytes.div_ceil(512) * 512;
    }
    if bytes.is_power_of_two() {
        return bytes;
    }
    let step = (bytes.next_power_of_two() / 2) / 4;
    bytes.div_ceil(step) * step
}

/// What the memory tracker above this crate adds: a charge that counts a kept
/// buffer's bytes as reserved on the current thread's rank (released when the
/// buffer leaves, also when the thread ends), and the bytes the current
/// thread may keep.
#[derive(Clone, Copy, Debug)]
pub struct Hooks {
    /// A token charging `bytes` as kept; dropping it releases them.
    pub charge: fn(usize) -> Box<dyn Any + Send>,
    /// The bytes the current thread may keep (at least [`FLOOR_BYTES`] are).
    pub limit: fn() -> usize,
}

static HOOKS: OnceLock<Hooks> = OnceLock::new();

/// Installs the tracker's hooks (once per process; later calls are ignored).
pub fn set_hooks(h: Hooks) {
    let _ = HOOKS.set(h);
}

/// One rank's kept buffers, oldest first, each with its charge.
#[derive(Default)]
struct Pool {
    buffers: Vec<(Buffer, Option<Box<dyn Any + Send>>)>,
    /// Kept bytes and the counters (`kept_buffers` is the length of `buffers`).
    counts: PoolStats,
}

/// What a rank's pool holds and has done since the rank started or since
/// [`empty_cache`] (PyTorch: the `num_alloc_retries`-style counters of
/// `torch.cuda.memory_stats`, here for host buffers).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Bytes kept now (reserved, not in use).
    pub kept_bytes: usize,
    /// Buffers kept now.
    pub kept_buffers: usize,
    /// Requests of 256 KiB or more served by a kept buffer.
    pub hits: u64,
    /// Requests of 256 KiB or more that found none (fresh memory, whose
    /// pages fault on first touch).
    pub misses: u64,
    /// Kept buffers dropped to stay within the limit.
    pub evictions: u64,
}

/// The pools of the ranks running now (removed when a rank ends: [`RankPool`]).
static RANKS: LazyLock<Mutex<HashMap<RankId, Arc<Mutex<Pool>>>>> = LazyLock::new(Default::default);

thread_local! {
    /// The pool of a thread that works for no rank.
    static OWN: Arc<Mutex<Pool>> = Arc::default();
}

/// The pool of the current thread's rank (or its own), `None` during thread exit.
fn pool() -> Option<Arc<Mutex<Pool>>> {
    match current_rank() {
        Some(id) => {
            let mut map = RANKS.lock().unwrap_or_else(PoisonError::into_inner);
            Some(Arc::clone(map.entry(id).or_default()))
        }
        None => OWN.try_with(Arc::clone).ok(),
    }
}

/// Ends a rank's pool when dropped (its buffers freed, their charges
/// released): held by the rank's thread for the rank's life.
#[derive(Debug)]
pub struct RankPool(RankId);

impl RankPool {
    /// The guard of rank `id`'s pool.
    pub fn new(id: RankId) -> RankPool {
        RankPool(id)
    }
}

impl Drop for RankPool {
    fn drop(&mut self) {
        let p = RANKS.lock().unwrap_or_else(PoisonError::into_inner).remove(&self.0);
        drop(p);
    }
}

/// The capacity in bytes of `buf`.
pub fn capacity_bytes(buf: &Buffer) -> usize {
    crate::dispatch_buf!(Buffer, buf, v, T => v.capacity() * std::mem::size_of::<T>())
}

/// Keeps `buf` for a later [`take`] when it holds 256 KiB or more and the
/// thread's limit allows; frees it otherwise.
pub fn give(buf: Buffer) {
    let bytes = capacity_bytes(&buf);
    if bytes < MIN_BYTES {
        return;
    }
    let hooks = HOOKS.get();
    let limit = hooks.map_or(FLOOR_BYTES, |h| (h.limit)().max(FLOOR_BYTES));
    if bytes > limit {
        return;
    }
    // The pool may be gone during thread exit; then the buffer is simply freed.
    let Some(pool) = pool() else { return };
    let charge = hooks.map(|h| (h.charge)(bytes));
    let mut p = pool.lock().unwrap_or_else(PoisonError::into_inner);
    p.counts.kept_bytes += bytes;
    p.buffers.push((buf, charge));
    while p.counts.kept_bytes > limit {
        let (old, _charge) = p.buffers.remove(0);
        p.counts.kept_bytes -= capacity_bytes(&old);
        p.counts.evictions += 1;
    }
}

/// A kept buffer of `dtype` for `len` elements, its length set to `len` (its
/// elements whatever they were, zeros past its last length), or `None`.
pub fn take(dtype: DType, len: usize) -> Option<Buffer> {
    let want = len.saturating_mul(dtype.size_in_bytes());
    if want < MIN_BYTES {
        return None;
    }
    let class = size_class(want);
    let pool = pool()?;
    let mut buf = {
        let mut p = pool.lock().unwrap_or_else(PoisonError::into_inner);
        let i = p
            .buffers
            .iter()
            .rposition(|(b, _)| b.dtype() == dtype && (want..=class).contains(&capacity_bytes(b)));
        let Some(i) = i else {
            p.counts.misses += 1;
            return None;
        };
        p.counts.hits += 1;
        let (b, _charge) = p.buffers.remove(i);
        p.counts.kept_bytes -= capacity_bytes(&b);
        b
    };
    crate::dispatch_buf!(Buffer, &mut buf, v, T => v.resize(len, T::default()));
    Some(buf)
}

/// The capacity in elements that a buffer of `len` elements of `elem` bytes
/// is allocated with, so that it can serve every later request of its size
/// class: the class's bytes from [`MIN_BYTES`] (when a whole number of
/// elements), `len` below.
pub fn capacity(elem: usize, len: usize) -> usize {
    let elem = elem.max(1);
    let bytes = len.saturating_mul(elem);
    if bytes < MIN_BYTES {
        return len;
    }
    let class = size_class(bytes);
    if class.is_multiple_of(elem) { class / elem } else { len }
}

/// A buffer of `len` elements of `dtype` from the pool ([`take`]) or, when it
/// has none, fresh with the [`capacity`] of its size class: zero-filled when
/// `zeroed` (a kept one refilled), else of length 0 (its caller writes `len`
/// elements).
pub fn alloc(dtype: DType, len: usize, zeroed: bool) -> Buffer {
    if let Some(mut b) = take(dtype, len) {
        crate::dispatch_buf!(Buffer, &mut b, v, T => if zeroed {
            v.fill(T::default())
        } else {
            v.clear()
        });
        return b;
    }
    fn fresh<T: crate::Element>(len: usize, zeroed: bool) -> Buffer {
        let cap = capacity(std::mem::size_of::<T>(), len);
        if zeroed {
            // Zeroed memory from the allocator: for large sizes, untouched pages.
            let mut v = bytemuck::zeroed_vec::<T>(cap);
            v.truncate(len);
            T::into_buffer(v)
        } else {
            T::into_buffer(Vec::with_capacity(cap))
        }
    }
    match dtype {
        DType::F32 => fresh::<f32>(len, zeroed),
        DType::F64 => fresh::<f64>(len, zeroed),
        DType::BF16 => fresh::<half::bf16>(len, zeroed),
        DType::F16 => fresh::<half::f16>(len, zeroed),
        DType::I64 => fresh::<i64>(len, zeroed),
        DType::U8 => fresh::<u8>(len, zeroed),
    }
}

/// Gives the current rank's kept buffers (a thread's, outside a rank) back to
/// the system. PyTorch: `torch.cuda.empty_cache` (here for host buffers).
pub fn empty_cache() {
    if let Some(pool) = pool() {
        let old = std::mem::take(&mut *pool.lock().unwrap_or_else(PoisonError::into_inner));
        drop(old);
    }
}

/// Bytes the current thread's rank (or the thread) keeps now.
pub fn cached_bytes() -> usize {
    stats().kept_bytes
}

/// The current thread's rank's pool counters (a thread's, outside a rank).
pub fn stats() -> PoolStats {
    pool().map_or_else(PoolStats::default, |p| {
        let p = p.lock().unwrap_or_else(PoisonError::into_inner);
        PoolStats {
            kept_buffers: p.buffers.len(),
            ..p.counts
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_classes() {
        for (bytes, want) in [
            (0, 512),
            (1, 512),
            (512, 512),
            (513, 1024),
            (1 << 20, 1 << 20),
            ((1 << 20) + 1, (1 << 20) + (1 << 18)),
            (3 << 20, 3 << 20),
            ((5 << 20) + 7, 6 << 20),
            (1 << 30, 1 << 30),
        ] {
            assert_eq!(size_class(bytes), want, "{bytes}");
        }
        for bytes in [1usize, 700, 1 << 20, (1 << 20) + 1, 3_000_001, 1 << 33] {
            let c = size_class(bytes);
            assert!(c >= bytes && c as f64 <= bytes as f64 * 1.25 + 512.0, "{bytes} -> {c}");
        }
    }

    #[test]
    fn large_zeros_reuse_a_given_buffer_and_come_back_zeroed() {
        empty_cache();
        let n = 1 << 20; // 4 MiB of f32
        let b = Buffer::F32(vec![7.0; n]);
        let ptr = b.as_buf().as_bytes().as_ptr();
        give(b);
        assert_eq!(cached_bytes(), 4 * n);
        let z = Buffer::zeros(DType::F32, n - 5);
        assert_eq!(z.as_buf().as_bytes().as_ptr(), ptr, "the kept buffer comes back");
        assert!(z.as_buf().as_bytes().iter().all(|&x| x == 0), "zeroed");
        assert_eq!((z.len(), cached_bytes()), (n - 5, 0));
        // Another dtype, a size past the buffer, or one more than a class
        // below it, takes fresh memory.
        give(z);
        assert!(take(DType::BF16, n).is_none());
        assert!(take(DType::F32, n + 1).is_none());
        assert!(take(DType::F32, n / 2).is_none());
        assert!(take(DType::F32, n - 5).is_some());
        // Small buffers are not kept; a thread keeps at most its limit.
        give(Buffer::F32(vec![0.0; 1000]));
        assert_eq!(cached_bytes(), 0);
        for _ in 0..20 {
            give(Buffer::F64(vec![0.0; 1 << 20]));
        }
        assert!(
            (FLOOR_BYTES - (8 << 20)..=FLOOR_BYTES).contains(&cached_bytes()),
            "{}",
            cached_bytes()
        );
        empty_cache();
        assert_eq!(cached_bytes(), 0);
    }

    #[test]
    fn fresh_buffers_have_their_size_class_and_are_counted() {
        empty_cache();
        let n = (1 << 20) + 3; // a little over 4 MiB of f32: class 5 MiB
        let b = alloc(DType::F32, n, true);
        let cap = capacity_bytes(&b);
        assert_eq!(cap, size_class(4 * n));
        assert_eq!(cap, 5 << 20);
        assert!(b.as_buf().as_bytes().iter().all(|&x| x == 0));
        assert_eq!(
            stats(),
            PoolStats {
                misses: 1,
                ..PoolStats::default()
            }
        );
        let ptr = b.as_buf().as_bytes().as_ptr();
        give(b);
        // Any size of the class takes it back: one fewer element, and the
        // class's largest (which the first request's exact capacity would
        // not have held).
        let c = alloc(DType::F32, (5 << 18) - 1, false);
        assert_eq!(
            (c.as_buf().as_bytes().as_ptr(), c.len()),
            (ptr, 0),
            "unwritten, length 0"
        );
        give(c);
        let d = alloc(DType::F32, 5 << 18, true);
        assert_eq!(d.as_buf().as_bytes().as_ptr(), ptr);
        assert_eq!(
            stats(),
            PoolStats {
                hits: 2,
                misses: 1,
                ..PoolStats::default()
            }
        );
        give(d);
        assert_eq!((stats().kept_bytes, stats().kept_buffers), (5 << 20, 1));
        // Small requests are neither kept nor counted.
        let _small = alloc(DType::F32, 100, true);
        assert_eq!(stats().misses, 1);
        // Past the limit the oldest buffers go, counted.
        let held: Vec<Buffer> = (0..20).map(|_| alloc(DType::U8, 8 << 20, false)).collect();
        held.into_iter().for_each(give);
        assert!(stats().evictions >= 8, "{:?}", stats());
        assert_eq!(capacity(4, 100), 100, "below 256 KiB: exact");
        assert_eq!(
            capacity(3, 1 << 20),
            1 << 20,
            "a class not a whole number of elements: exact"
        );
        empty_cache();
        assert_eq!(stats(), PoolStats::default());
    }
}
