//! How a collective writes its output: through the cache, or with streaming
//! (non-temporal) stores when the collective touches more bytes than the
//! last-level cache holds.
//!
//! A collective whose inputs and outputs together outgrow the last-level cache
//! cannot keep its output there anyway: writing it through the cache first reads
//! every output line from memory (read for ownership) and evicts the inputs that
//! peers are still reading. Streaming stores write whole lines to memory without
//! reading them and leave the cache to the inputs. Measured with two threads on
//! this project's 2-core test machine (32 MiB L3), an all-gather into 64 MiB
//! outputs took 6.8 ms with cached stores and 4.9 ms streamed; below the
//! cache's size streaming is slower (3× at 4 MiB), so smaller collectives keep
//! cached stores. The copies of the gathering collectives (all-gather and its
//! variants, all-to-all, an all-reduce's second phase) stream, and so do `f32`
//! sums and averages read straight from the inputs ([`stream_sum_f32`]:
//! reduce-scatter of 16 MiB on 2 ranks 0.85-1.15 → 0.6-0.7 ms in the same
//! measurement); other reductions write through the cache.
//!
//! Streaming stores are weakly ordered: every barrier point of a collective
//! ([`Committed::sync`](super::group::Committed::sync)) calls
//! [`order_streamed_stores`] before it arrives, so peers past the barrier read
//! what this rank streamed.

use std::sync::OnceLock;

use super::desc::Desc;

/// How one collective writes this rank's output.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Store {
    /// Ordinary stores, through the cache.
    Cached,
    /// Streaming stores past the cache (x86-64 only; elsewhere never chosen).
    Streaming,
}

/// Bytes written with streaming stores by this process (tests check that large
/// collectives take that path).
#[cfg(test)]
pub(crate) static STREAMED_BYTES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Last-level cache size assumed when the system does not say.
const DEFAULT_LLC_BYTES: usize = 32 << 20;

impl Store {
    /// The store for a collective whose ranks published `descs`: streaming when
    /// the bytes all ranks read and write together (every send and receive
    /// buffer) are at least the last-level cache's size.
    pub(crate) fn of(descs: &[Desc]) -> Store {
        let bytes = descs
            .iter()
            .map(|d| d.send_len * d.dtype.size_in_bytes() + d.recv_len * d.recv_dtype.size_in_bytes())
            .sum();
        Store::for_bytes(bytes, last_level_cache_bytes())
    }

    /// The store for a collective touching `bytes` bytes on a machine whose
    /// last-level cache holds `llc` bytes.
    pub(crate) fn for_bytes(bytes: usize, llc: usize) -> Store {
        if cfg!(target_arch = "x86_64") && bytes >= llc {
            Store::Streaming
        } else {
            Store::Cached
        }
    }

    /// Copies `src` to `dst` with this store.
    ///
    /// # Safety
    /// `dst` is valid for `src.len()` writes of `T` and does not overlap `src`.
    pub(crate) unsafe fn copy<T: Copy>(self, dst: *mut T, src: &[T]) {
        let n = std::mem::size_of_val(src);
        match self {
            // SAFETY: the caller's contract.
            Store::Cached => unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) },
            Store::Streaming => {
                #[cfg(test)]
                STREAMED_BYTES.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
                // SAFETY: the caller's contract, in bytes.
                unsafe { stream_bytes(dst.cast(), src.as_ptr().cast(), n) }
            }
        }
    }
}

/// Orders this thread's streaming stores before its later stores: every
/// barrier point of a collective calls it before arriving, so a peer that
/// passed the barrier reads what this rank streamed. (An `sfence` with no
/// streaming store pending costs a few cycles.)
pub(crate) fn order_streamed_stores() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `sfence` has no preconditions (SSE, part of x86-64).
    unsafe {
        std::arch::x86_64::_mm_sfence()
    }
}

/// `out[..len] = Σ parts` in part order (divided by `avg` when given), every
/// part `len` long, written with streaming stores straight from registers: the
/// bits of `a = p₀; a += p₁; …; a /= avg` element by element (the same IEEE
/// operations, four lanes at a time). The elements before `out`'s first 16-byte
/// boundary and the last `len % 4` go through the cache.
///
/// Loads of the inputs and stores of the output interleave vector by vector;
/// reducing a block into scratch first and streaming it after was measured no
/// faster than cached stores.
///
/// # Safety
/// `out` is valid for `len` writes, no part overlaps it, and `parts` is not
/// empty.
#[cfg(target_arch = "x86_64")]
pub(crate) unsafe fn stream_sum_f32(parts: &[&[f32]], out: *mut f32, len: usize, avg: Option<f32>) {
    use std::arch::x86_64::{_mm_add_ps, _mm_div_ps, _mm_loadu_ps, _mm_set1_ps, _mm_stream_ps};
    debug_assert!(!parts.is_empty() && parts.iter().all(|p| p.len() >= len));
    #[cfg(test)]
    STREAMED_BYTES.fetch_add(len * 4, std::sync::atomic::Ordering::Relaxed);
    let scalar = |i: usize| {
        let mut a = parts[0][i];
        for p in &parts[1..] {
            a += p[i];
        }
        avg.map_or(a, |n| a / n)
    };
    let head = out.align_offset(16).min(len);
    let body = (len - head) / 4 * 4;
    // SAFETY: every index below is under `len` (the caller's bound), and the
    // body's stores are 16-byte aligned (`head` aligns `out`).
    unsafe {
        for i in 0..head {
            *out.add(i) = scalar(i);
        }
        let n = _mm_set1_ps(avg.unwrap_or(1.0));
        for i in (head..head + body).step_by(4) {
            let mut a = _mm_loadu_ps(parts[0].as_ptr().add(i));
            for p in &parts[1..] {
                a = _mm_add_ps(a, _mm_loadu_ps(p.as_ptr().add(i)));
            }
            if avg.is_some() {
                a = _mm_div_ps(a, n);
            }
            _mm_stream_ps(out.add(i), a);
        }
        for i in head + body..len {
            *out.add(i) = scalar(i);
        }
    }
}

/// Copies `n` bytes with 16-byte streaming stores, the unaligned head and tail
/// with ordinary ones.
///
/// # Safety
/// As [`std::ptr::copy_nonoverlapping`] for `n` bytes.
#[cfg(target_arch = "x86_64")]
unsafe fn stream_bytes(dst: *mut u8, src: *const u8, n: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
    const LANE: usize = 16;
    // Only whole cache lines stream: a partly written line leaves the
    // write-combining buffer as a partial write, several times the cost of a
    // full one (a gather of 512-byte runs into buffers 16 bytes off a line
    // boundary, the malloc default, ran at half the speed of whole runs). The
    // partial lines at either end go through the cache.
    const LINE: usize = 64;
    let head = dst.align_offset(LINE).min(n);
    let lanes = (n - head) / LINE * (LINE / LANE);
    // SAFETY: the caller's contract; every offset below stays under `n`, and the
    // body's stores are 64-byte aligned (`head` aligns `dst`).
    unsafe {
        std::ptr::copy_nonoverlapping(src, dst, head);
        for i in 0..lanes {
            let at = head + i * LANE;
            let v = _mm_loadu_si128(src.add(at).cast::<__m128i>());
            _mm_stream_si128(dst.add(at).cast::<__m128i>(), v);
        }
        let done = head + lanes * LANE;
        std::ptr::copy_nonoverlapping(src.add(done), dst.add(done), n - done);
    }
}

/// Elsewhere [`Store::for_bytes`] never streams; an ordinary copy.
///
/// # Safety
/// As [`std::ptr::copy_nonoverlapping`] for `n` bytes.
#[cfg(not(target_arch = "x86_64"))]
unsafe fn stream_bytes(dst: *mut u8, src: *const u8, n: usize) {
    // SAFETY: the caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, n) }
}

/// The size of the largest cache the system reports (Linux sysfs), else 32 MiB.
pub(crate) fn last_level_cache_bytes() -> usize {
    static LLC: OnceLock<usize> = OnceLock::new();
    *LLC.get_or_init(|| {
        let dir = std::path::Path::new("/sys/devices/system/cpu/cpu0/cache");
        let sizes = std::fs::read_dir(dir).into_iter().flatten().flatten().filter_map(|e| {
            let size = std::fs::read_to_string(e.path().join("size")).ok()?;
            parse_cache_size(size.trim())
        });
        sizes.max().unwrap_or(DEFAULT_LLC_BYTES)
    })
}

/// A sysfs cache size (`"32768K"`, `"2M"`, `"512"`) in bytes.
fn parse_cache_size(s: &str) -> Option<usize> {
    let (digits, unit) = match s.as_bytes().last()? {
        b'K' => (&s[..s.len() - 1], 1 << 10),
        b'M' => (&s[..s.len() - 1], 1 << 20),
        b'G' => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    digits.parse::<usize>().ok().map(|v| v * unit)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_only_collectives_larger_than_the_cache() {
        let llc = 32 << 20;
        let expect_stream = if cfg!(target_arch = "x86_64") {
            Store::Streaming
        } else {
            Store::Cached
        };
        assert_eq!(Store::for_bytes(48 << 20, llc), expect_stream);
        assert_eq!(Store::for_bytes(llc, llc), expect_stream);
        assert_eq!(Store::for_bytes(llc - 1, llc), Store::Cached);
        assert_eq!(Store::for_bytes(12 << 20, llc), Store::Cached);
    }

    #[test]
    fn counts_every_buffer_of_every_rank() {
        // Two ranks, each 4 Mi f32 in and 2 Mi f32 out: 48 MiB in all.
        let mut d = Desc::new(crate::OpKind::ReduceScatter);
        (d.dtype, d.recv_dtype, d.send_len, d.recv_len) = (crate::DType::F32, crate::DType::F32, 4 << 20, 2 << 20);
        let llc = last_level_cache_bytes();
        let bytes: usize = 2 * ((4 << 20) + (2 << 20)) * 4;
        assert_eq!(Store::of(&[d, d]), Store::for_bytes(bytes, llc));
        assert_eq!(Store::of(&[d]), Store::for_bytes(bytes / 2, llc));
    }

    #[test]
    fn parses_sysfs_cache_sizes() {
        assert_eq!(parse_cache_size("32768K"), Some(32 << 20));
        assert_eq!(parse_cache_size("2M"), Some(2 << 20));
        assert_eq!(parse_cache_size("1G"), Some(1 << 30));
        assert_eq!(parse_cache_size("512"), Some(512));
        assert_eq!(parse_cache_size("K"), None);
        assert_eq!(parse_cache_size(""), None);
        assert_eq!(parse_cache_size("lots"), None);
    }

    /// Every length and misalignment of source and destination copies exactly,
    /// and nothing outside the destination is written.
    #[test]
    fn streaming_copies_match_ordinary_ones() {
        let src: Vec<u8> = (0..300u32).map(|i| (i * 7 + 3) as u8).collect();
        for store in [Store::Cached, Store::Streaming] {
            for from in 0..17 {
                for at in 0..17 {
                    for n in [0, 1, 15, 16, 17, 31, 32, 33, 64, 100, 250] {
                        let mut dst = vec![0xAAu8; 300];
                        // SAFETY: `at + n <= 300` and the buffers are distinct.
                        unsafe { store.copy(dst.as_mut_ptr().add(at), &src[from..from + n]) };
                        order_streamed_stores();
                        assert_eq!(
                            &dst[at..at + n],
                            &src[from..from + n],
                            "{store:?} from {from} at {at} n {n}"
                        );
                        assert!(
                            dst[..at].iter().chain(&dst[at + n..]).all(|&b| b == 0xAA),
                            "{store:?} wrote outside"
                        );
                    }
                }
            }
        }
    }
}
