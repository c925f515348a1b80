//! Large host buffers for exchanges and kernel outputs.
//!
//! A fresh multi-megabyte buffer costs a page fault per 4 KiB page on first touch
//! (and the kernel zeroes every page), which for the outputs of collectives can
//! cost more than the copy itself. Two remedies:
//!
//! - on Linux, buffers of 2 MiB or more are advised to use transparent huge pages
//!   before they are touched (512 times fewer faults where the system allows it);
//! - buffers of 256 KiB or more are a caching allocator's (PyTorch's CUDA
//!   caching allocator is the model; the pool is `tessera_mesh::pool`, below
//!   this crate, so that the collectives' outputs come from it too): allocated
//!   with the capacity of their size class (`tessera_mesh::pool::size_class`:
//!   512-byte steps to 1 MiB, then quarter powers of two, at most 25% slack),
//!   and when a tensor's storage (or an op's scratch buffer) is dropped,
//!   its buffer goes to its rank's pool instead of back to the system. Every
//!   large output here ([`reused`], `zeroed`, `with_capacity`, `written`) and
//!   every `Buffer::zeros` takes a kept buffer of its dtype and size class
//!   first, so a training step that allocates what the step before freed
//!   touches no fresh page. The memory tracker counts kept bytes as reserved,
//!   not in use ([`crate::memory::MemoryStats`]); a rank keeps at most its
//!   peak bytes in use, or 64 MiB when that is less, dropping its oldest
//!   buffers beyond, and [`empty_cache`] gives them all back (PyTorch:
//!   `torch.cuda.empty_cache`);
//! - with glibc, the first tensor storage tunes `malloc` to keep freed memory for
//!   reuse instead of handing it back to the system after every step (a heap
//!   allocation up to 32 MiB, no trimming below 1 GiB of free top, 64 MiB of top
//!   padding): a training step allocates and frees the same sizes every time, and
//!   returning them costs a page fault per page on the next step. Set
//!   `TESSERA_SYSTEM_MALLOC=1` to leave `malloc` as it is.
//!
//! Buffers whose size comes from a shape rather than from data that already
//! exists (constructors, casts, outputs that can outgrow their inputs such as
//! matmul, broadcasting, embedding and reductions of empty tensors, and exchange
//! buffers sized from a spec) are allocated here, fallibly: [`reused`] and the
//! crate's own `zeroed`, `with_capacity`, `written` and `zeros_buffer` check the
//! element and byte counts for overflow and return [`Error::OutOfMemory`] (naming the op, shape,
//! dtype and bytes) when the memory cannot be had, instead of aborting the process.

use std::mem::MaybeUninit;

use tessera_mesh::{Buffer, DType, Element};

use crate::{Error, Result};

/// The smallest buffer cached (`tessera_mesh::pool::MIN_BYTES`).
#[cfg(test)]
const CACHE_MIN_BYTES: usize = tessera_mesh::pool::MIN_BYTES;

/// The capacity in elements of `T` a buffer of `n` elements is allocated with
/// (`tessera_mesh::pool::capacity`).
fn capacity_for<T>(n: usize) -> usize {
    tessera_mesh::pool::capacity(std::mem::size_of::<T>(), n)
}

/// Connects the mesh crate's buffer pool to the memory tracker, once: kept
/// bytes count as reserved on their rank, and a thread keeps at most its
/// rank's peak bytes in use (at least 64 MiB).
fn install_pool_hooks() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        tessera_mesh::pool::set_hooks(tessera_mesh::pool::Hooks {
            charge: |bytes| Box::new(crate::memory::CacheCharge::new(bytes)),
            limit: || crate::memory::stats().peak_bytes,
        });
    });
}

/// Offers a dropped storage buffer to this thread's pool
/// (`tessera_mesh::pool::give`).
pub(crate) fn recycle(buf: Buffer) {
    install_pool_hooks();
    tessera_mesh::pool::give(buf);
}

/// A working buffer that goes back to its thread's pool when dropped (a
/// plain `Vec` would go back to the system, and the next step's would fault
/// fresh pages): for temporaries of an op that are not tensor storage.
pub(crate) struct Scratch<T: Element>(Vec<T>);

impl<T: Element> Scratch<T> {
    /// Wraps `v`.
    pub(crate) fn new(v: Vec<T>) -> Scratch<T> {
        Scratch(v)
    }
}

impl<T: Element> std::ops::Deref for Scratch<T> {
    type Target = Vec<T>;
    fn deref(&self) -> &Vec<T> {
        &self.0
    }
}

impl<T: Element> std::ops::DerefMut for Scratch<T> {
    fn deref_mut(&mut self) -> &mut Vec<T> {
        &mut self.0
    }
}

impl<T: Element> Drop for Scratch<T> {
    fn drop(&mut self) {
        recycle(T::into_buffer(std::mem::take(&mut self.0)));
    }
}

/// A kept buffer for `n` elements of `T`, taken out of this thread's pool,
/// its length `n` (its elements whatever they were).
fn cached<T: Element>(n: usize) -> Option<Vec<T>> {
    tessera_mesh::pool::take(T::DTYPE, n).and_then(|b| T::from_buffer(b).ok())
}

/// Gives this thread's kept buffers back to the system (they stop counting as
/// reserved). PyTorch: `torch.cuda.empty_cache` (here for the host, per rank
/// thread).
pub fn empty_cache() {
    tessera_mesh::pool::empty_cache();
}

/// Bytes this thread's pool keeps now.
pub fn cached_bytes() -> usize {
    tessera_mesh::pool::cached_bytes()
}

/// A vector for a tensor of `shape` whose contents are unspecified (but valid
/// values): a cached buffer of its size class when there is one, else a fresh
/// zeroed one. For outputs that the caller overwrites in full.
///
/// # Errors
/// [`Error::OutOfMemory`] (naming the op, shape, dtype and bytes) when the
/// element or byte count overflows or the memory cannot be had.
pub fn reused<T: Element>(op: &'static str, shape: &[usize]) -> Result<Vec<T>> {
    let n = checked_len(op, shape, T::DTYPE)?;
    match cached::<T>(n) {
        Some(v) => Ok(v),
        None => fresh_zeroed(op, shape, n),
    }
}

/// A vector for a tensor of `shape` whose every element `write` sets: a cached
/// buffer of its size class when there is one (as [`reused`]), else a fresh one
/// that is not zeroed first (a zeroing pass costs about as much as the writes).
///
/// # Safety
/// `write` must write every element of the slice it is given (whatever it
/// holds may be uninitialised), or panic.
///
/// # Errors
/// [`Error::OutOfMemory`] as for [`zeroed`].
pub(crate) unsafe fn written<T: Element>(
    op: &'static str,
    shape: &[usize],
    write: impl FnOnce(&mut [MaybeUninit<T>]),
) -> Result<Vec<T>> {
    let n = checked_len(op, shape, T::DTYPE)?;
    let mut v = with_capacity::<T>(op, shape)?;
    write(&mut v.spare_capacity_mut()[..n]);
    // SAFETY: the capacity is at least `n`, and `write` set every element below it.
    unsafe { v.set_len(n) };
    Ok(v)
}

/// The bytes a tensor of `shape` and `dtype` needs, or `None` when the count
/// overflows 128 bits. A shape with a zero dim needs none.
fn byte_count(shape: &[usize], dtype: DType) -> Option<u128> {
    if shape.contains(&0) {
        return Some(0);
    }
    shape
        .iter()
        .try_fold(dtype.size_in_bytes() as u128, |bytes, &d| bytes.checked_mul(d as u128))
}

/// The error for a tensor of `shape` and `dtype` that cannot be allocated.
fn out_of_memory(op: &'static str, shape: &[usize], dtype: DType) -> Error {
    Error::OutOfMemory {
        op,
        shape: shape.to_vec(),
        dtype,
        bytes: byte_count(shape, dtype),
    }
}

/// The number of elements of a tensor of `shape` and `dtype`, checked before
/// anything is allocated.
///
/// # Errors
/// [`Error::OutOfMemory`] when the element or byte count overflows, or the bytes
/// exceed what one allocation may hold (`isize::MAX`).
pub fn checked_len(op: &'static str, shape: &[usize], dtype: DType) -> Result<usize> {
    match byte_count(shape, dtype) {
        // Tensors compute their element count left to right, so a zero-size shape
        // must not overflow before its zero dim either.
        Some(0) if shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d)).is_none() => Err(Error::InvalidArgument {
            op,
            detail: format!(
                "shape {shape:?} has a zero dim after dims whose product overflows usize; \
                 use smaller dims"
            ),
        }),
        // At most isize::MAX bytes, so the element count fits a usize too.
        Some(bytes) if bytes <= isize::MAX as u128 => Ok((bytes / dtype.size_in_bytes() as u128) as usize),
        _ => Err(out_of_memory(op, shape, dtype)),
    }
}

/// A zeroed buffer of `dtype` for a tensor of `shape` (see [`zeroed`]).
///
/// # Errors
/// [`Error::OutOfMemory`] as for [`zeroed`].
pub(crate) fn zeros_buffer(op: &'static str, shape: &[usize], dtype: DType) -> Result<Buffer> {
    let _t = crate::profile::scope(crate::profile::Kind::Allocation);
    crate::kernel::any_dispatch!(op, dtype, T => Ok(T::into_buffer(zeroed::<T>(op, shape)?)))
}

/// An empty vector with room for the elements of a tensor of `shape` (a
/// cached buffer of its size class when there is one), for outputs that are
/// filled by pushing or written in full.
///
/// # Errors
/// [`Error::OutOfMemory`] as for [`zeroed`].
pub(crate) fn with_capacity<T: Element>(op: &'static str, shape: &[usize]) -> Result<Vec<T>> {
    let n = checked_len(op, shape, T::DTYPE)?;
    if let Some(mut v) = cached::<T>(n) {
        v.clear();
        return Ok(v);
    }
    let mut v = Vec::new();
    v.try_reserve_exact(capacity_for::<T>(n))
        .map_err(|_| out_of_memory(op, shape, T::DTYPE))?;
    Ok(v)
}

/// Tunes glibc's `malloc` once per process (see the module docs).
pub(crate) fn tune_malloc_once() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if tessera_mesh::vars::flag_or("TESSERA_SYSTEM_MALLOC", false) {
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

/// The zero (default) elements of a tensor of `shape`, in fresh memory that the
/// system zeroes lazily (large buffers are not touched here).
///
/// # Errors
/// [`Error::OutOfMemory`] naming `op`, the shape, dtype and bytes when the counts
/// overflow or the allocator refuses the memory.
pub(crate) fn zeroed<T: Element>(op: &'static str, shape: &[usize]) -> Result<Vec<T>> {
    let _t = crate::profile::scope(crate::profile::Kind::Allocation);
    let n = checked_len(op, shape, T::DTYPE)?;
    if let Some(mut v) = cached::<T>(n) {
        // Refilled: a pass of writes over mapped pages costs less than the
        // faults and the kernel's zeroing of fresh ones.
        v.fill(T::default());
        return Ok(v);
    }
    fresh_zeroed(op, shape, n)
}

/// `n` (checked: a tensor of `shape`) zero elements in fresh memory, large
/// buffers advised to use huge pages; not from the pool.
fn fresh_zeroed<T: Element>(op: &'static str, shape: &[usize], n: usize) -> Result<Vec<T>> {
    let v = try_zeroed::<T>(n).ok_or_else(|| out_of_memory(op, shape, T::DTYPE))?;
    advise_huge(&v);
    Ok(v)
}

/// `n` zero elements, or `None` when the allocator refuses them. Like
/// `vec![T::default(); n]` (zeroed memory from the allocator, which for large
/// sizes means untouched pages), but fallible, for every element type.
fn try_zeroed<T: Element>(n: usize) -> Option<Vec<T>> {
    let cap = capacity_for::<T>(n);
    let layout = std::alloc::Layout::array::<T>(cap).ok()?;
    if layout.size() == 0 {
        return Some(Vec::new());
    }
    // SAFETY: `layout` has a non-zero size (checked above).
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) }.cast::<T>();
    if ptr.is_null() {
        return None;
    }
    // SAFETY: `ptr` comes from the global allocator with the layout of `[T; cap]`,
    // which is what a `Vec<T>` of capacity `cap` deallocates with; all `cap`
    // elements are initialized (`n ≤ cap` of them in use), because all-zero bytes
    // are a valid `T` (`Element: Pod`, so `Zeroable`), and they equal
    // `T::default()` (0, 0.0 or +0.0 in half precision).
    Some(unsafe { Vec::from_raw_parts(ptr, n, cap) })
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
    fn dropped_large_buffers_are_reused_by_size_class() {
        empty_cache();
        let n = 1 << 20; // 4 MiB of f32
        let v: Vec<f32> = vec![7.0; n];
        let ptr = v.as_ptr();
        recycle(Buffer::F32(v));
        let again: Vec<f32> = reused("t", &[n]).unwrap();
        assert_eq!(again.as_ptr(), ptr, "the cached buffer comes back");
        assert_eq!(again.len(), n);
        let other: Vec<f32> = reused("t", &[n]).unwrap();
        assert_ne!(other.as_ptr(), ptr, "a buffer is handed out once");
        assert!(other.iter().all(|&x| x == 0.0), "a fresh buffer is zeroed");
        // A size in the same class (4 MiB + 4 bytes and 4.9 MiB round up to
        // 5 MiB) reuses the buffer; its elements past the last length are set.
        let a: Vec<f32> = zeroed("t", &[n + 1]).unwrap();
        assert_eq!(a.capacity() * 4, tessera_mesh::pool::size_class((n + 1) * 4));
        let (a_ptr, a_cap) = (a.as_ptr(), a.capacity());
        recycle(Buffer::F32(a));
        let b: Vec<f32> = reused("t", &[a_cap - 3]).unwrap();
        assert_eq!(b.as_ptr(), a_ptr, "one size class, one buffer");
        assert!(
            b[n + 1..].iter().all(|&x| x == 0.0),
            "the tail past the last length is set"
        );
        recycle(Buffer::F32(b));
        let z: Vec<f32> = zeroed("t", &[n + 2]).unwrap();
        assert_eq!(z.as_ptr(), a_ptr, "zeros come from the cache too");
        assert!(z.iter().all(|&x| x == 0.0), "refilled with zeros");
        // From 256 KiB (a layer norm's output) buffers are cached; smaller ones are not.
        let mid = vec![2.0f32; CACHE_MIN_BYTES / 4];
        let mid_ptr = mid.as_ptr();
        recycle(Buffer::F32(mid));
        let again: Vec<f32> = reused("t", &[CACHE_MIN_BYTES / 4]).unwrap();
        assert_eq!(again.as_ptr(), mid_ptr, "a 256 KiB buffer comes back");
        let before = cached_bytes();
        recycle(Buffer::F32(vec![1.0f32; CACHE_MIN_BYTES / 4 - 1]));
        assert_eq!(cached_bytes(), before, "a buffer under 256 KiB is not cached");
        // One allocated elsewhere (its capacity not a size class) serves any
        // size it holds within that size's class; not a larger one.
        let odd = vec![1.0f32; (1 << 20) + 3];
        let odd_ptr = odd.as_ptr();
        recycle(Buffer::F32(odd));
        let larger: Vec<f32> = reused("t", &[(1 << 20) + 4]).unwrap();
        assert_ne!(larger.as_ptr(), odd_ptr);
        let smaller: Vec<f32> = reused("t", &[(1 << 20) + 2]).unwrap();
        assert_eq!((smaller.as_ptr(), smaller.len()), (odd_ptr, (1 << 20) + 2));
        assert_eq!(cached_bytes(), before);
        // Nor is a dtype mixed up: a bf16 request finds no f32 buffer.
        recycle(Buffer::F32(vec![0.0f32; n]));
        let h: Vec<half::bf16> = reused("t", &[2 * n]).unwrap();
        assert_eq!(
            cached_bytes(),
            before + 4 * n,
            "the f32 buffer stays for an f32 request"
        );
        drop(h);
        empty_cache();
        assert_eq!(cached_bytes(), 0);
    }

    #[test]
    fn cache_is_bounded_by_the_floor_or_the_ranks_peak() {
        empty_cache();
        for _ in 0..10 {
            recycle(Buffer::F64(vec![0.0; 1 << 20])); // 8 MiB each
        }
        assert!(cached_bytes() <= tessera_mesh::pool::FLOOR_BYTES, "{}", cached_bytes());
        assert!(
            cached_bytes() >= tessera_mesh::pool::FLOOR_BYTES - (8 << 20),
            "{}",
            cached_bytes()
        );
        empty_cache();
    }

    /// Temporaries wrapped in [`Scratch`] and large outputs computed on one
    /// thread (elementwise ops) come back through the pool: a second identical
    /// op touches the first one's pages, no fresh ones.
    #[test]
    fn scratch_and_serial_outputs_are_pooled() {
        use tessera_mesh::pool::stats;
        empty_cache();
        let n = 1 << 18; // 1 MiB of f32
        let s = Scratch::new(reused::<f32>("t", &[n]).unwrap());
        let ptr = s.as_ptr();
        drop(s);
        assert_eq!(
            (cached_bytes(), stats().kept_buffers),
            (4 * n, 1),
            "a dropped scratch buffer is kept"
        );
        let again: Vec<f32> = with_capacity("t", &[n]).unwrap();
        assert_eq!((again.as_ptr(), again.len()), (ptr, 0), "with_capacity takes it, empty");
        drop(again);
        empty_cache();
        // On a rank of one thread (its elementwise ops run serially).
        let opts = tessera_mesh::LaunchOptions {
            threads_per_rank: Some(1),
            ..Default::default()
        };
        let reused_output = tessera_mesh::launch_with(&opts, 1, move |_| {
            let x = crate::Tensor::ones(&[n], DType::F32)?;
            let y = x.add(&x)?;
            let y_ptr = y.as_slice::<f32>()?.as_ptr() as usize;
            drop(y);
            let before = stats();
            let z = x.add(&x)?;
            assert_eq!(z.as_slice::<f32>()?[n - 1], 2.0);
            assert_eq!((stats().hits, stats().misses), (before.hits + 1, before.misses));
            Ok(z.as_slice::<f32>()?.as_ptr() as usize == y_ptr)
        })
        .unwrap();
        assert!(reused_output[0], "the output's buffer is reused");
    }

    /// The tracker counts cached bytes as reserved on the rank that freed them,
    /// not in use; a buffer moving between a tensor and the cache leaves both
    /// peaks as they were, `empty_cache` and the end of the rank's thread
    /// return the reserved bytes to those in use.
    #[test]
    fn cached_bytes_are_reserved_on_their_rank() {
        use crate::memory::{reset_peak, stats, stats_of};
        use crate::{DType, Tensor};
        let id = tessera_mesh::context::RankId { job: 1 << 51, rank: 0 };
        std::thread::spawn(move || {
            tessera_mesh::context::scoped(id, || {
                // What the launcher holds for a rank's life.
                let _pool = tessera_mesh::pool::RankPool::new(id);
                let n = 1 << 18; // 1 MiB of f32
                let t = Tensor::zeros(&[n], DType::F32).unwrap();
                let s = stats();
                assert_eq!((s.current_bytes, s.reserved_bytes), (4 * n, 4 * n));
                drop(t);
                let s = stats();
                assert_eq!((s.current_bytes, s.reserved_bytes), (0, 4 * n), "freed, kept");
                assert_eq!((s.peak_bytes, s.peak_reserved_bytes), (4 * n, 4 * n));
                reset_peak();
                let t = Tensor::zeros(&[n], DType::F32).unwrap();
                let s = stats();
                assert_eq!(
                    (s.current_bytes, s.reserved_bytes, s.peak_reserved_bytes),
                    (4 * n, 4 * n, 4 * n)
                );
                drop(t);
                empty_cache();
                assert_eq!(stats().reserved_bytes, 0);
                drop(Tensor::zeros(&[n], DType::F32).unwrap());
                assert_eq!(stats().reserved_bytes, 4 * n);
            });
        })
        .join()
        .unwrap();
        assert_eq!(stats_of(id).reserved_bytes, 0, "the rank's end gave its pool back");
    }

    #[test]
    fn buffers_are_usable() {
        let v: Vec<f32> = zeroed("t", &[3, 1 << 20]).unwrap();
        assert_eq!(v.len(), 3 << 20);
        assert!(v.iter().all(|&x| x == 0.0));
        let small: Vec<i64> = zeroed("t", &[7]).unwrap();
        assert_eq!(small, vec![0; 7]);
        let halves: Vec<half::bf16> = zeroed("t", &[2, 3]).unwrap();
        assert_eq!(halves, vec![half::bf16::ZERO; 6]);
        let none: Vec<f64> = zeroed("t", &[4, 0]).unwrap();
        assert!(none.is_empty());
        let room: Vec<u8> = with_capacity("t", &[5, 2]).unwrap();
        assert!(room.is_empty() && room.capacity() >= 10);
    }

    /// Ops whose output comes from small inputs but a large shape: an error naming
    /// the op, shape, dtype and bytes, never an abort.
    #[test]
    fn ops_with_large_outputs_fail_cleanly() {
        use crate::Tensor;
        macro_rules! case {
            ($res:expr, $want:expr) => {
                let e = $res.unwrap_err();
                assert!(matches!(e, Error::OutOfMemory { .. }), "{e:?}");
                assert!(e.to_string().starts_with($want), "{e} lacks {:?}", $want);
            };
        }
        const M: usize = 1 << 20;
        let col = Tensor::zeros(&[M, 1], DType::F32).unwrap();
        let row = Tensor::zeros(&[1, M], DType::F32).unwrap();
        let four_tib = "cannot allocate 4398046511104 bytes for a [1048576, 1048576] f32 tensor";
        case!(col.matmul(&row), &format!("matmul: {four_tib}"));
        let (a, b) = (
            Tensor::zeros(&[M, 0], DType::F32).unwrap(),
            Tensor::zeros(&[0, M], DType::F32).unwrap(),
        );
        case!(a.matmul(&b), &format!("matmul: {four_tib}"));
        case!(col.add(&row), &format!("broadcast: {four_tib}"));
        case!(
            Tensor::scalar(1.0, DType::F32).unwrap().broadcast_to(&[1 << 40]),
            "broadcast_to: cannot allocate 4398046511104 bytes for a [1099511627776] f32 tensor"
        );
        let idx = Tensor::zeros(&[M], DType::I64).unwrap();
        case!(row.embedding(&idx), &format!("embedding: {four_tib}"));
        let empty = Tensor::zeros(&[1 << 40, 0], DType::F32).unwrap();
        case!(
            empty.sum(&[1], false),
            "sum: cannot allocate 4398046511104 bytes for a [1099511627776] f32 tensor"
        );
        case!(empty.layer_norm(None, None, 1e-5), "layer_norm: cannot allocate");
        // Concatenated sizes that overflow are an error too.
        let wide = Tensor::zeros(&[usize::MAX, 0], DType::U8).unwrap();
        let e = Tensor::cat(&[wide.clone(), wide], 0).unwrap_err().to_string();
        assert!(e.contains("cat: the sizes of dim 0 add up past usize::MAX"), "{e}");
    }

    #[test]
    fn sizes_are_checked_before_allocating() {
        // (shape, dtype, elements or the bytes the error names). 2^40 bytes and up:
        // more than any test machine holds, so the allocator refuses them at once.
        macro_rules! case {
            ($shape:expr, $dtype:expr, ok $n:expr) => {
                let shape: &[usize] = &$shape;
                assert_eq!(checked_len("t", shape, $dtype).unwrap(), $n, "{shape:?}");
            };
            ($shape:expr, $dtype:expr, err $bytes:expr) => {
                let shape: &[usize] = &$shape;
                let e = zeros_buffer("t", shape, $dtype).unwrap_err();
                let want = format!("t: cannot allocate {} for a {shape:?} {} tensor", $bytes, $dtype);
                assert!(e.to_string().starts_with(&want), "{e} lacks {want}");
                assert!(matches!(e, Error::OutOfMemory { dtype, .. } if dtype == $dtype));
            };
        }
        case!([2, 3], DType::F32, ok 6);
        case!([], DType::U8, ok 1);
        case!([0, usize::MAX, usize::MAX], DType::F64, ok 0);
        let e = checked_len("t", &[usize::MAX, usize::MAX, 0], DType::F64).unwrap_err();
        assert!(
            e.to_string().contains("a zero dim after dims whose product overflows"),
            "{e}"
        );
        case!([1 << 40], DType::F32, err "4398046511104 bytes");
        case!([1 << 20, 1 << 20], DType::BF16, err "2199023255552 bytes");
        case!([1 << 40], DType::U8, err "1099511627776 bytes");
        case!([1 << 40, 1 << 40], DType::F32, err "4835703278458516698824704 bytes");
        case!([usize::MAX / 2], DType::F32, err "36893488147419103228 bytes");
        case!([usize::MAX; 3], DType::I64, err "more than 2^128 bytes");
        // Each fallible allocator says the same.
        let e = with_capacity::<f32>("cap", &[1 << 40]).unwrap_err().to_string();
        assert!(
            e.starts_with("cap: cannot allocate 4398046511104 bytes for a [1099511627776] f32"),
            "{e}"
        );
        let e = reused::<i64>("re", &[1 << 40]).unwrap_err().to_string();
        assert!(
            e.starts_with("re: cannot allocate 8796093022208 bytes for a [1099511627776] i64"),
            "{e}"
        );
    }
}
