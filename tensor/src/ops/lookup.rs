//! Element-wise functions of 16-bit floats read from a table.
//!
//! A `bf16` or `f16` element has 65,536 bit patterns, so a function of one
//! such element that is costly to compute (GELU, its derivative, `exp`,
//! `tanh`, SiLU, ...) is computed once for every pattern, by the same code and
//! in the same precision as the direct kernel (`f32`, one rounding), and then
//! read per element: the same bits as computing it, for the cost of a load
//! from a table of 128 KiB (results) or 256 KiB (`f32` factors) that stays in
//! the core's L2 cache. A table is built the first time a tensor of at least
//! [`TABLE_MIN`] elements needs it (65,536 evaluations: about as long as
//! computing one such tensor directly) and kept for the process; smaller
//! tensors are computed directly.

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::mem::MaybeUninit;
use std::sync::{Mutex, OnceLock, PoisonError};

use half::{bf16, f16};

use crate::kernel::Float;

/// Elements from which an op on a 16-bit float tensor reads its table.
pub(crate) const TABLE_MIN: usize = 1 << 16;

/// Elements read through tables by this process (tests check that large
/// tensors take the table path).
#[cfg(test)]
pub(crate) static LOOKED_UP: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// A 16-bit float type: its bits, and back.
pub(crate) trait Half: Float + 'static {
    fn bits(self) -> u16;
    fn from_bits(bits: u16) -> Self;
}

impl Half for bf16 {
    #[inline(always)]
    fn bits(self) -> u16 {
        self.to_bits()
    }
    #[inline(always)]
    fn from_bits(bits: u16) -> Self {
        bf16::from_bits(bits)
    }
}

impl Half for f16 {
    #[inline(always)]
    fn bits(self) -> u16 {
        self.to_bits()
    }
    #[inline(always)]
    fn from_bits(bits: u16) -> Self {
        f16::from_bits(bits)
    }
}

/// The built tables, by the function's key type and the element type.
type Registry = Mutex<HashMap<(TypeId, TypeId), &'static (dyn Any + Send + Sync)>>;

/// The table of `f` over every bit pattern of `T`, under the key type `K`
/// (one function per key: an op's type): built on first use, outside the
/// lock (two threads may both build it; the first to finish is kept, and
/// both are equal), and kept for the process.
fn table<K: 'static, T: Half, V: Copy + Send + Sync + 'static>(f: impl Fn(T) -> V) -> &'static [V] {
    static TABLES: OnceLock<Registry> = OnceLock::new();
    let key = (TypeId::of::<K>(), TypeId::of::<T>());
    let tables = TABLES.get_or_init(Registry::default);
    let found = |t: &'static (dyn Any + Send + Sync)| -> &'static [V] {
        t.downcast_ref::<Box<[V]>>().expect("one value type per table key")
    };
    if let Some(&t) = tables.lock().unwrap_or_else(PoisonError::into_inner).get(&key) {
        return found(t);
    }
    let built: Box<[V]> = (0..=u16::MAX).map(|bits| f(T::from_bits(bits))).collect();
    let leaked: &'static (dyn Any + Send + Sync) = Box::leak(Box::new(built));
    let mut tables = tables.lock().unwrap_or_else(PoisonError::into_inner);
    found(*tables.entry(key).or_insert(leaked))
}

/// `out[i] = f(x[i])` through `K`'s table of `f` over `T` (`f` must be a
/// function of its argument alone), split over the rank's threads.
pub(crate) fn map<K: 'static, T: Half>(x: &[T], out: &mut [MaybeUninit<T>], f: impl Fn(T) -> T) {
    debug_assert_eq!(x.len(), out.len());
    let table = table::<K, T, u16>(|x| f(x).bits());
    #[cfg(test)]
    LOOKED_UP.fetch_add(out.len(), std::sync::atomic::Ordering::Relaxed);
    crate::kernel::par_rows(out, 1, |start, out| {
        for (o, &x) in out.iter_mut().zip(&x[start..]) {
            *o = MaybeUninit::new(T::from_bits(table[usize::from(x.bits())]));
        }
    });
}

/// `out[i] = round(g[i] · d(x[i]))` in `f32`, with `d` read from `K`'s table
/// of it over `T` (a derivative, which `g` scales: a backward's gradient).
pub(crate) fn scale<K: 'static, T: Half>(g: &[T], x: &[T], out: &mut [MaybeUninit<T>], d: impl Fn(T::Acc) -> T::Acc)
where
    T::Acc: Send + Sync + 'static,
{
    debug_assert!(g.len() == out.len() && x.len() == out.len());
    let table = table::<K, T, T::Acc>(|x| d(x.to_acc()));
    #[cfg(test)]
    LOOKED_UP.fetch_add(out.len(), std::sync::atomic::Ordering::Relaxed);
    crate::kernel::par_rows(out, 1, |start, out| {
        let (g, x) = (&g[start..start + out.len()], &x[start..start + out.len()]);
        #[cfg(target_arch = "x86_64")]
        if TypeId::of::<T>() == TypeId::of::<bf16>() && simd::detected() {
            // SAFETY: `T` is `bf16` (checked), so `T::Acc` is `f32` and the
            // slices are of `u16` bits and `f32`s; the CPU has the
            // instructions (checked); the three slices are as long.
            unsafe {
                simd::scale_bf16(
                    g.as_ptr().cast(),
                    x.as_ptr().cast(),
                    table.as_ptr().cast(),
                    out.as_mut_ptr().cast(),
                    out.len(),
                )
            };
            return;
        }
        for ((o, &g), &x) in out.iter_mut().zip(g).zip(x) {
            *o = MaybeUninit::new(T::from_acc(g.to_acc() * table[usize::from(x.bits())]));
        }
    });
}

/// [`scale`] for `bf16` on AVX-512: 16 elements per step, the factors
/// gathered from the table, products rounded as casts round.
#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::x86_64::{
        __mmask16, _MM_HINT_T0, _mm_prefetch, _mm256_maskz_loadu_epi16, _mm512_castsi512_ps, _mm512_cvtepu16_epi32,
        _mm512_mask_i32gather_ps, _mm512_mul_ps, _mm512_setzero_ps, _mm512_slli_epi32,
    };

    use crate::ops::matmul::bf16_dot::round_store;

    /// Whether this CPU has AVX-512F, BW and VL, detected once.
    pub(super) fn detected() -> bool {
        static DETECTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *DETECTED.get_or_init(|| {
            std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512bw")
                && std::arch::is_x86_feature_detected!("avx512vl")
        })
    }

    /// Elements ahead of the current ones whose lines are prefetched.
    const AHEAD: usize = 256;

    /// `out[i] = bf16(f32(g[i]) · table[x[i]])` for `i < len`, on bits.
    ///
    /// # Safety
    /// `g`, `x` and `out` must be valid for `len` elements, `table` for
    /// 65,536; the CPU must have AVX-512F, BW and VL.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn scale_bf16(g: *const u16, x: *const u16, table: *const f32, out: *mut u16, len: usize) {
        for at in (0..len).step_by(16) {
            let lanes = (len - at).min(16);
            let mask: __mmask16 = if lanes == 16 { u16::MAX } else { (1 << lanes) - 1 };
            // SAFETY: the masked loads read elements at..at+lanes only, inside
            // `g` and `x`; every index is a u16, inside the table; the store
            // writes `lanes` elements at `out + at` (caller).
            unsafe {
                _mm_prefetch::<_MM_HINT_T0>(g.wrapping_add(at + AHEAD).cast());
                _mm_prefetch::<_MM_HINT_T0>(x.wrapping_add(at + AHEAD).cast());
                let g = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
                    _mm256_maskz_loadu_epi16(mask, g.add(at).cast()),
                )));
                let index = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, x.add(at).cast()));
                let d = _mm512_mask_i32gather_ps::<4>(_mm512_setzero_ps(), mask, index, table.cast());
                round_store(_mm512_mul_ps(g, d), out.add(at), lanes);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use half::{bf16, f16};

    use super::*;
    use crate::{DType, Tensor};

    /// Every bit pattern of `T` (NaNs and infinities included), as one tensor.
    fn every<T: Half>() -> Tensor {
        let all: Vec<T> = (0..=u16::MAX).map(T::from_bits).collect();
        Tensor::from_vec(all, &[1 << 16]).unwrap()
    }

    /// The bits of `t`.
    fn bits<T: Half>(t: &Tensor) -> Vec<u16> {
        t.to_vec::<T>().unwrap().into_iter().map(Half::bits).collect()
    }

    /// `f` of `t` in pieces smaller than [`TABLE_MIN`] (computed, not looked up).
    fn in_pieces<T: Half>(t: &Tensor, f: impl Fn(&Tensor) -> Tensor) -> Vec<u16> {
        let n = t.numel();
        (0..n)
            .step_by(4096)
            .flat_map(|at| bits::<T>(&f(&t.narrow(0, at, 4096.min(n - at)).unwrap())))
            .collect()
    }

    /// A large tensor's op through its table gives the bits of computing it,
    /// for every input a 16-bit float can hold, and does go through the table.
    #[test]
    fn tables_give_the_bits_of_computing() {
        type Op = fn(&Tensor) -> Tensor;
        let ops: [(&str, Op); 8] = [
            ("gelu", |t| t.gelu().unwrap()),
            ("exp", |t| t.exp().unwrap()),
            ("log", |t| t.log().unwrap()),
            ("rsqrt", |t| t.rsqrt().unwrap()),
            ("tanh", |t| t.tanh().unwrap()),
            ("erf", |t| t.erf().unwrap()),
            ("sigmoid", |t| t.sigmoid().unwrap()),
            ("silu", |t| t.silu().unwrap()),
        ];
        fn check<T: Half>(name: &str, op: Op) {
            let x = every::<T>();
            let before = LOOKED_UP.load(Ordering::Relaxed);
            let looked_up = op(&x);
            assert!(
                LOOKED_UP.load(Ordering::Relaxed) - before >= 1 << 16,
                "{name}: the table was not read"
            );
            assert_eq!(bits::<T>(&looked_up), in_pieces::<T>(&x, op), "{name} {:?}", x.dtype());
        }
        for (name, op) in ops {
            check::<bf16>(name, op);
            check::<f16>(name, op);
        }
    }

    /// GELU's gradient through the table of its derivative gives the bits of
    /// computing it, for every input and a spread of gradients.
    #[test]
    fn gelu_backward_table_gives_the_bits_of_computing() {
        fn check<T: Half>(dtype: DType) {
            let x = every::<T>();
            let g = Tensor::randn(&[1 << 16], DType::F32, 7).unwrap().cast(dtype).unwrap();
            let before = LOOKED_UP.load(Ordering::Relaxed);
            let looked_up = g.gelu_backward(&x).unwrap();
            assert!(
                LOOKED_UP.load(Ordering::Relaxed) - before >= 1 << 16,
                "the table was not read"
            );
            let n = x.numel();
            let computed: Vec<u16> = (0..n)
                .step_by(4096)
                .flat_map(|at| {
                    let len = 4096.min(n - at);
                    let (g, x) = (g.narrow(0, at, len).unwrap(), x.narrow(0, at, len).unwrap());
                    bits::<T>(&g.gelu_backward(&x).unwrap())
                })
                .collect();
            assert_eq!(bits::<T>(&looked_up), computed, "{dtype:?}");
        }
        check::<bf16>(DType::BF16);
        check::<f16>(DType::F16);
    }
}
