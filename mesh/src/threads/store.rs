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

#[cfg(test)]
thread_local! {
    /// Lines a [`Writer`] on this thread wrote in part through the cache
    /// (tests check that chained pieces stream the lines they meet in).
    pub(crate) static PARTIAL_LINES: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

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
        // A chain of one piece: its whole lines streamed, the partial ones
        // at either end through the cache (when the writer drops).
        // SAFETY: the caller's contract; the writer ends here.
        unsafe { Writer::new(self, dst.cast()).put(0, src) }
    }
}

/// Writes one collective's output piece by piece (element offsets into the
/// output, any order) with a [`Store`]. Streaming, a piece that continues
/// where the last one ended (a chain) shares the cache line they meet in: the
/// writer assembles such a line from both and streams it whole, so a gather
/// of 512-byte runs into an output 16 bytes off a line boundary (the `malloc`
/// default) streams every line but the chain's first and last, which go
/// through the cache, instead of two lines per run written by halves at two
/// different times (each read for ownership, the second often after the first
/// was evicted). Dropping the writer writes the line a chain ended in.
pub(crate) struct Writer {
    store: Store,
    out: *mut u8,
    /// Streaming: the address where the current chain continues (0: none).
    next: usize,
    /// The line `next` falls in, assembled up to `next`, from byte `from`
    /// (where the chain entered it; 0 when it entered at the line's start).
    line: Line,
    from: usize,
}

/// One cache line's bytes.
#[repr(align(64))]
struct Line([u8; 64]);

impl Writer {
    /// A writer of the output at `out` with `store`.
    ///
    /// # Safety
    /// `out` is this rank's output pointer; every [`put`](Self::put) names a
    /// region of it that is in bounds and not read or written by anyone else
    /// until the writer is dropped and the collective's next barrier point
    /// is passed.
    pub(crate) unsafe fn new(store: Store, out: *mut u8) -> Writer {
        Writer {
            store,
            out,
            next: 0,
            line: Line([0; 64]),
            from: 0,
        }
    }

    /// Writes `src` at element offset `at` of the output.
    ///
    /// # Safety
    /// `out` holds `T` elements and `at + src.len()` of them are in bounds
    /// (the contract of [`new`](Self::new)); `src` does not overlap it.
    pub(crate) unsafe fn put<T: Copy>(&mut self, at: usize, src: &[T]) {
        let size = std::mem::size_of::<T>();
        // SAFETY: the caller's contract, in bytes.
        unsafe { self.put_bytes(at * size, src.as_ptr().cast(), std::mem::size_of_val(src)) }
    }

    /// Writes `n` zero elements of `T` at element offset `at`.
    ///
    /// # Safety
    /// As [`put`](Self::put) for `n` elements.
    pub(crate) unsafe fn zeros<T: Copy>(&mut self, at: usize, n: usize) {
        static ZEROS: [u8; 4096] = [0; 4096];
        let size = std::mem::size_of::<T>();
        let (mut at, mut left) = (at * size, n * size);
        while left > 0 {
            let k = left.min(ZEROS.len());
            // SAFETY: the caller's contract; `ZEROS` holds `k` bytes.
            unsafe { self.put_bytes(at, ZEROS.as_ptr(), k) };
            (at, left) = (at + k, left - k);
        }
    }

    /// # Safety
    /// Bytes `at..at + n` of the output are ours (see [`new`](Self::new)) and
    /// `src` holds `n` bytes outside it.
    unsafe fn put_bytes(&mut self, at: usize, src: *const u8, n: usize) {
        if n == 0 {
            return;
        }
        // SAFETY: in bounds, the caller's contract.
        let dst = unsafe { self.out.add(at) };
        match self.store {
            // SAFETY: the caller's contract.
            Store::Cached => unsafe { std::ptr::copy_nonoverlapping(src, dst, n) },
            // SAFETY: the caller's contract.
            Store::Streaming => unsafe { self.chain(dst, src, n) },
        }
    }

    /// The streaming form of [`put_bytes`](Self::put_bytes).
    ///
    /// # Safety
    /// As [`put_bytes`](Self::put_bytes), with `dst` the absolute address.
    unsafe fn chain(&mut self, mut dst: *mut u8, mut src: *const u8, mut n: usize) {
        const LINE: usize = 64;
        #[cfg(test)]
        STREAMED_BYTES.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
        if dst as usize != self.next {
            self.end_chain();
            self.from = dst as usize % LINE;
        }
        // SAFETY: the caller's contract bounds every write to `dst..dst + n`
        // and every read to `src..src + n`; the line buffer is written at
        // `off..off + k <= 64`.
        unsafe {
            let off = dst as usize % LINE;
            if off != 0 || n < LINE {
                // Into the line in progress; stream it once whole.
                let k = (LINE - off).min(n);
                std::ptr::copy_nonoverlapping(src, self.line.0.as_mut_ptr().add(off), k);
                (dst, src, n) = (dst.add(k), src.add(k), n - k);
                if (dst as usize).is_multiple_of(LINE) {
                    self.emit(dst.sub(LINE));
                }
            }
            let lines = n / LINE;
            if lines > 0 {
                stream_lines(dst, src, lines);
                (dst, src, n) = (dst.add(lines * LINE), src.add(lines * LINE), n - lines * LINE);
            }
            // What is left starts a line (`dst` is aligned here when `n > 0`).
            std::ptr::copy_nonoverlapping(src, self.line.0.as_mut_ptr(), n);
            self.next = dst.add(n) as usize;
        }
    }

    /// Writes the completed line at `line`: streamed when the chain covered
    /// all of it, else its covered bytes through the cache.
    ///
    /// # Safety
    /// The chain covered bytes `from..64` of the line at `line`.
    unsafe fn emit(&mut self, line: *mut u8) {
        // SAFETY: the caller's contract; `line` is 64-byte aligned.
        unsafe {
            if self.from == 0 {
                stream_lines(line, self.line.0.as_ptr(), 1);
            } else {
                let from = self.from;
                std::ptr::copy_nonoverlapping(self.line.0.as_ptr().add(from), line.add(from), 64 - from);
                #[cfg(test)]
                PARTIAL_LINES.with(|c| c.set(c.get() + 1));
            }
        }
        self.from = 0;
    }

    /// Writes the partial line the chain ended in (through the cache).
    fn end_chain(&mut self) {
        let end = self.next % 64;
        if self.next != 0 && end > self.from {
            let line = (self.next - end) as *mut u8;
            // SAFETY: the chain covered bytes `from..end` of that line of our
            // output (the contract of `new`).
            unsafe {
                std::ptr::copy_nonoverlapping(
                    self.line.0.as_ptr().add(self.from),
                    line.add(self.from),
                    end - self.from,
                )
            };
            #[cfg(test)]
            PARTIAL_LINES.with(|c| c.set(c.get() + 1));
        }
        self.next = 0;
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        self.end_chain();
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
/// operations, sixteen lanes at a time with AVX-512, else four). The elements
/// before `out`'s first vector boundary and the last partial vector go
/// through the cache.
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
    let wide = avx512();
    let lanes = if wide { 16 } else { 4 };
    let head = out.align_offset(lanes * 4).min(len);
    let body = (len - head) / lanes * lanes;
    // SAFETY: every index below is under `len` (the caller's bound), and the
    // body starts on a vector boundary of `out` (`head` aligns it).
    unsafe {
        for i in 0..head {
            *out.add(i) = scalar(i);
        }
        if wide {
            stream_sum_avx512(parts, out, head..head + body, avg);
        } else {
            stream_sum_sse(parts, out, head..head + body, avg);
        }
        for i in head + body..len {
            *out.add(i) = scalar(i);
        }
    }
}

/// The body of [`stream_sum_f32`] sixteen lanes at a time: 64-byte streaming
/// stores, one whole line each.
///
/// # Safety
/// As [`stream_sum_f32`] for `range` (a multiple of 16 long, starting on a
/// 64-byte boundary of `out`); the CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn stream_sum_avx512(parts: &[&[f32]], out: *mut f32, range: std::ops::Range<usize>, avg: Option<f32>) {
    use std::arch::x86_64::{_mm512_add_ps, _mm512_div_ps, _mm512_loadu_ps, _mm512_set1_ps, _mm512_stream_ps};
    let n = _mm512_set1_ps(avg.unwrap_or(1.0));
    for i in range.step_by(16) {
        // SAFETY: per the contract, `i + 16` is within every part and `out`,
        // and `out + i` is 64-byte aligned.
        unsafe {
            let mut a = _mm512_loadu_ps(parts[0].as_ptr().add(i));
            for p in &parts[1..] {
                a = _mm512_add_ps(a, _mm512_loadu_ps(p.as_ptr().add(i)));
            }
            if avg.is_some() {
                a = _mm512_div_ps(a, n);
            }
            _mm512_stream_ps(out.add(i), a);
        }
    }
}

/// The body of [`stream_sum_f32`] four lanes at a time (SSE, part of x86-64).
///
/// # Safety
/// As [`stream_sum_f32`] for `range` (a multiple of 4 long, starting on a
/// 16-byte boundary of `out`).
#[cfg(target_arch = "x86_64")]
unsafe fn stream_sum_sse(parts: &[&[f32]], out: *mut f32, range: std::ops::Range<usize>, avg: Option<f32>) {
    use std::arch::x86_64::{_mm_add_ps, _mm_div_ps, _mm_loadu_ps, _mm_set1_ps, _mm_stream_ps};
    // SAFETY: SSE is part of x86-64.
    let n = unsafe { _mm_set1_ps(avg.unwrap_or(1.0)) };
    for i in range.step_by(4) {
        // SAFETY: per the contract, `i + 4` is within every part and `out`,
        // and `out + i` is 16-byte aligned.
        unsafe {
            let mut a = _mm_loadu_ps(parts[0].as_ptr().add(i));
            for p in &parts[1..] {
                a = _mm_add_ps(a, _mm_loadu_ps(p.as_ptr().add(i)));
            }
            if avg.is_some() {
                a = _mm_div_ps(a, n);
            }
            _mm_stream_ps(out.add(i), a);
        }
    }
}

/// Streams `lines` 64-byte lines from `src` to the line-aligned `dst`, with
/// the widest kernel the CPU has. Only whole lines stream: a partly written
/// line leaves the write-combining buffer as a partial write, several times
/// the cost of a full one.
///
/// # Safety
/// `dst` is 64-byte aligned and valid for `64 · lines` writes, `src` for as
/// many reads, and they do not overlap.
#[cfg(target_arch = "x86_64")]
unsafe fn stream_lines(dst: *mut u8, src: *const u8, lines: usize) {
    // SAFETY: the caller's contract (and the CPU's AVX-512F, checked).
    unsafe {
        if avx512() {
            stream_lines_avx512(dst, src, lines);
        } else {
            stream_lines_sse2(dst, src, lines);
        }
    }
}

/// Elsewhere nothing streams: an ordinary copy of the lines.
///
/// # Safety
/// As the x86-64 form.
#[cfg(not(target_arch = "x86_64"))]
unsafe fn stream_lines(dst: *mut u8, src: *const u8, lines: usize) {
    // SAFETY: the caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, lines * 64) }
}

/// Whether the CPU has AVX-512F (detected once).
#[cfg(target_arch = "x86_64")]
fn avx512() -> bool {
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| std::arch::is_x86_feature_detected!("avx512f"))
}

/// Streams `lines` 64-byte lines from `src` to the line-aligned `dst`, one
/// 64-byte store each: with 16-byte streaming stores (four per line) a copy
/// whose source is read in runs of a few KiB (an all-to-all's strided boxes)
/// ran at half the speed of the same bytes read contiguously; with whole-line
/// stores, within 10 to 25%.
///
/// # Safety
/// `dst` is 64-byte aligned and valid for `64 · lines` writes, `src` for as
/// many reads, they do not overlap, and the CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn stream_lines_avx512(dst: *mut u8, src: *const u8, lines: usize) {
    use std::arch::x86_64::{__m512i, _mm512_loadu_si512, _mm512_stream_si512};
    for i in 0..lines {
        // SAFETY: per the contract, line `i` is inside both buffers and the
        // store is aligned.
        unsafe {
            let v = _mm512_loadu_si512(src.add(i * 64).cast::<__m512i>());
            _mm512_stream_si512(dst.add(i * 64).cast::<__m512i>(), v);
        }
    }
}

/// [`stream_lines_avx512`] with four 16-byte streaming stores a line (SSE2,
/// part of x86-64).
///
/// # Safety
/// As [`stream_lines_avx512`], without the AVX-512 requirement.
#[cfg(target_arch = "x86_64")]
unsafe fn stream_lines_sse2(dst: *mut u8, src: *const u8, lines: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
    for at in (0..lines * 64).step_by(16) {
        // SAFETY: per the contract, `at + 16 <= 64 · lines`, and the store is
        // 16-byte aligned (`dst` is 64-byte aligned).
        unsafe {
            let v = _mm_loadu_si128(src.add(at).cast::<__m128i>());
            _mm_stream_si128(dst.add(at).cast::<__m128i>(), v);
        }
    }
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

    /// Writes `pieces` (`(at, len)` in bytes, in the order given) of `src`
    /// to the same offsets of a buffer `offset` bytes past a line boundary
    /// with a [`Writer`], and returns the buffer (0xAA where nothing was
    /// written) and the lines written in part through the cache.
    fn write_pieces(store: Store, offset: usize, pieces: &[(usize, usize)], src: &[u8]) -> (Vec<u8>, usize) {
        #[repr(align(64))]
        struct Buf([u8; 4096]);
        let mut buf = Box::new(Buf([0xAA; 4096]));
        let partial = PARTIAL_LINES.with(|c| c.get());
        {
            // SAFETY: every piece lies inside `src` and, `offset` bytes in,
            // inside `buf` (the callers keep `offset + at + len <= 4096`);
            // nothing else touches `buf` while the writer lives.
            let mut w = unsafe { Writer::new(store, buf.0.as_mut_ptr().add(offset)) };
            for &(at, len) in pieces {
                if at == usize::MAX {
                    // SAFETY: as above.
                    unsafe { w.zeros::<u8>(len, 70) };
                } else {
                    // SAFETY: as above.
                    unsafe { w.put(at, &src[at..at + len]) };
                }
            }
        }
        order_streamed_stores();
        let partial = PARTIAL_LINES.with(|c| c.get()) - partial;
        (buf.0[offset..].to_vec(), partial)
    }

    /// Pieces in output order at every misalignment, with gaps, zeros and
    /// pieces shorter than a line, and the same pieces in any order: every
    /// byte lands where an ordinary copy puts it, nothing else is written.
    #[test]
    fn writers_put_every_piece_where_a_copy_would() {
        let src: Vec<u8> = (0..3000u32).map(|i| (i * 31 + 7) as u8).collect();
        let mut rng = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = |n: usize| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            (rng % n as u64) as usize
        };
        for trial in 0..300 {
            // Pieces of 1..=200 bytes, some with a gap before, up to 3000 bytes.
            let mut pieces = Vec::new();
            let mut at = next(70);
            while at < 2800 {
                let len = 1 + next(200);
                pieces.push((at, len.min(3000 - at)));
                at += len + if next(4) == 0 { next(90) } else { 0 };
            }
            let mut want = vec![0xAAu8; 4096];
            for &(at, len) in &pieces {
                want[at..at + len].copy_from_slice(&src[at..at + len]);
            }
            // Zeros over a piece of its own (written last: a placed run of zeros).
            pieces.push((usize::MAX, 3000 + next(10)));
            let z = pieces.last().unwrap().1;
            want[z..z + 70].fill(0);
            let shuffled = {
                let mut p = pieces.clone();
                for i in (1..p.len()).rev() {
                    p.swap(i, next(i + 1));
                }
                p
            };
            for store in [Store::Cached, Store::Streaming] {
                for (order, list) in [("in order", &pieces), ("shuffled", &shuffled)] {
                    let offset = trial % 64;
                    let (got, _) = write_pieces(store, offset, list, &src);
                    assert_eq!(
                        got,
                        want[..4096 - offset],
                        "{store:?}, {order}, offset {offset}: {list:?}"
                    );
                }
            }
        }
    }

    /// Pieces that continue each other share the line they meet in: a chain
    /// of 512-byte pieces 16 bytes off a line boundary writes two lines
    /// through the cache (its first and last), the same pieces out of order
    /// two for every piece.
    #[test]
    fn chained_pieces_stream_the_lines_they_meet_in() {
        let src: Vec<u8> = (0..4096u32).map(|i| (i * 13 + 1) as u8).collect();
        let pieces: Vec<(usize, usize)> = (0..7).map(|i| (i * 512, 512)).collect();
        let (got, partial) = write_pieces(Store::Streaming, 16, &pieces, &src);
        assert_eq!(&got[..7 * 512], &src[..7 * 512]);
        assert_eq!(partial, 2, "in output order");
        let apart: Vec<(usize, usize)> = pieces.iter().rev().copied().collect();
        let (got, partial) = write_pieces(Store::Streaming, 16, &apart, &src);
        assert_eq!(&got[..7 * 512], &src[..7 * 512]);
        assert_eq!(partial, 14, "each piece on its own");
        // On a line boundary, chained or not, every line is whole.
        assert_eq!(write_pieces(Store::Streaming, 0, &apart, &src).1, 0);
    }

    /// Both whole-line kernels (AVX-512 where the CPU has it, SSE2 always)
    /// copy every line, from any source alignment, and nothing past them.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn both_line_kernels_copy_whole_lines() {
        #[repr(align(64))]
        struct Lines([u8; 64 * 6]);
        let src: Vec<u8> = (0..64 * 5 + 64).map(|i: u32| (i * 13 + 5) as u8).collect();
        type Kernel = unsafe fn(*mut u8, *const u8, usize);
        let mut kernels: Vec<(&str, Kernel)> = vec![("sse2", stream_lines_sse2)];
        if avx512() {
            kernels.push(("avx512", |d, s, n| {
                // SAFETY: the CPU has AVX-512F (checked); the rest is the caller's.
                unsafe { stream_lines_avx512(d, s, n) }
            }));
        }
        for (name, kernel) in kernels {
            for from in [0, 1, 16, 63] {
                for lines in 0..=5 {
                    let mut dst = Lines([0xAA; 64 * 6]);
                    // SAFETY: `dst` is 64-byte aligned with room for 6 lines,
                    // `src[from..]` holds at least 5; they are distinct.
                    unsafe { kernel(dst.0.as_mut_ptr(), src[from..].as_ptr(), lines) };
                    order_streamed_stores();
                    let n = 64 * lines;
                    assert_eq!(&dst.0[..n], &src[from..from + n], "{name} from {from}, {lines} lines");
                    assert!(dst.0[n..].iter().all(|&b| b == 0xAA), "{name} wrote past {lines} lines");
                }
            }
        }
    }

    /// Streamed sums and averages have the bits of adding in rank order (and
    /// dividing), at every alignment and length, with either vector width.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn streamed_sums_have_the_bits_of_rank_order() {
        let part = |r: u32| -> Vec<f32> {
            (0..160u32)
                .map(|i| ((i * 37 + r * 11) % 101) as f32 * 0.37 - 17.0 + r as f32 / 3.0)
                .collect()
        };
        let parts = [part(0), part(1), part(2)];
        let views: Vec<&[f32]> = parts.iter().map(|p| &p[..]).collect();
        #[repr(align(64))]
        struct Out([f32; 160]);
        type Body = unsafe fn(&[&[f32]], *mut f32, std::ops::Range<usize>, Option<f32>);
        let mut bodies: Vec<(&str, Body, usize)> = vec![("sse", stream_sum_sse, 4)];
        if avx512() {
            bodies.push((
                "avx512",
                |p, o, r, a| {
                    // SAFETY: the CPU has AVX-512F (checked); the rest is the caller's.
                    unsafe { stream_sum_avx512(p, o, r, a) }
                },
                16,
            ));
        }
        for avg in [None, Some(3.0f32)] {
            let want: Vec<u32> = (0..160)
                .map(|i| {
                    let a = views[0][i] + views[1][i] + views[2][i];
                    avg.map_or(a, |n| a / n).to_bits()
                })
                .collect();
            for at in [0, 1, 5, 16] {
                for len in [0, 3, 16, 37, 100, 144 - at] {
                    let mut out = Out([f32::NAN; 160]);
                    let inputs: Vec<&[f32]> = views.iter().map(|v| &v[at..]).collect();
                    // SAFETY: `at + len <= 160`; the parts do not overlap `out`.
                    unsafe { stream_sum_f32(&inputs, out.0.as_mut_ptr().add(at), len, avg) };
                    order_streamed_stores();
                    let got: Vec<u32> = out.0[at..at + len].iter().map(|x| x.to_bits()).collect();
                    assert_eq!(got, want[at..at + len], "at {at}, len {len}, avg {avg:?}");
                    assert!(
                        out.0[..at].iter().chain(&out.0[at + len..]).all(|x| x.is_nan()),
                        "wrote outside"
                    );
                }
            }
            for (name, body, lanes) in &bodies {
                let mut out = Out([f32::NAN; 160]);
                // SAFETY: 144 elements from an aligned start, a multiple of the
                // lanes; the parts do not overlap `out`.
                unsafe { body(&views, out.0.as_mut_ptr(), 0..144 / lanes * lanes, avg) };
                order_streamed_stores();
                let got: Vec<u32> = out.0[..144].iter().map(|x| x.to_bits()).collect();
                assert_eq!(got, want[..144], "{name}, avg {avg:?}");
            }
        }
    }
}
