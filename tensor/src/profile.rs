//! Where a rank's time goes, by kind of work: opt-in timers around the local
//! kernels of DTensor ops, the redistributions and bucket collectives, buffer
//! allocation and the optimizers' updates.
//!
//! Timing is off until [`enable`]; off, a scope costs one relaxed atomic load.
//! Scopes nest and count exclusive time: an allocation inside a GEMM counts as
//! allocation, not GEMM. Totals are per thread (a rank's thread under the
//! threads backend); [`take`] returns and resets the calling thread's.
//!
//! Matrix products also count their floating-point operations ([`add_flops`],
//! `2·m·k·n` for a dense product, the computed part of a causal one), under
//! the kind of the scope they run in, so that a GEMM's time can be read as a
//! rate ([`Profile::flops`]).
//!
//! ```
//! use tessera_tensor::profile::{self, Kind};
//! use tessera_tensor::{DType, Tensor};
//!
//! profile::enable(true);
//! let a = Tensor::ones(&[64, 64], DType::F32).unwrap();
//! {
//!     let _t = profile::scope(Kind::Gemm);
//!     a.matmul(&a).unwrap();
//! }
//! let p = profile::take();
//! assert_eq!(p.count(Kind::Gemm), 1);
//! profile::enable(false);
//! ```

use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

static ENABLED: AtomicBool = AtomicBool::new(false);
static SYNC_DEVICE: AtomicBool = AtomicBool::new(false);

/// A kind of work.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    /// Matrix multiplications (the local GEMMs of `matmul`).
    Gemm,
    /// Element-wise, shape and indexing ops (add, mul, GELU, casts, views, copies).
    Elementwise,
    /// Reductions (sum, mean, max, argmax).
    Reduction,
    /// The fused neural-network kernels (softmax, layer norm, embedding, cross
    /// entropy, and their backward).
    Nn,
    /// Collectives and the packing around them (redistribute, bucket collectives),
    /// including the wait for peers.
    Communication,
    /// Fresh buffers (zeroing, page faults).
    Allocation,
    /// Optimizer updates.
    Optimizer,
}

impl Kind {
    /// Every kind, in display order.
    pub const ALL: [Kind; 7] = [
        Kind::Gemm,
        Kind::Elementwise,
        Kind::Reduction,
        Kind::Nn,
        Kind::Communication,
        Kind::Allocation,
        Kind::Optimizer,
    ];

    /// A short name.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Gemm => "gemm",
            Kind::Elementwise => "elementwise",
            Kind::Reduction => "reduction",
            Kind::Nn => "nn",
            Kind::Communication => "communication",
            Kind::Allocation => "allocation",
            Kind::Optimizer => "optimizer",
        }
    }

    fn index(self) -> usize {
        Kind::ALL.iter().position(|&k| k == self).unwrap_or(0)
    }

    /// The kind of a DTensor op's local kernel, by the op's name.
    pub fn of_op(op: &str) -> Kind {
        match op {
            "matmul" | "matmul_causal" | "linear" | "bmm" => Kind::Gemm,
            "sum" | "mean" | "max" | "min" | "argmax" | "sum_to_shape" => Kind::Reduction,
            o if o.contains("softmax")
                || o.contains("layer_norm")
                || o.contains("embedding")
                || o.contains("cross_entropy")
                || o.contains("causal")
                || o.contains("attention") =>
            {
                Kind::Nn
            }
            _ => Kind::Elementwise,
        }
    }
}

/// Time and calls per kind, on one thread.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Profile {
    time: [Duration; 7],
    count: [u64; 7],
    flops: [u64; 7],
}

impl Profile {
    /// Exclusive time spent in `kind`.
    pub fn time(&self, kind: Kind) -> Duration {
        self.time[kind.index()]
    }

    /// Scopes of `kind` entered.
    pub fn count(&self, kind: Kind) -> u64 {
        self.count[kind.index()]
    }

    /// Time in all kinds.
    pub fn total(&self) -> Duration {
        self.time.iter().sum()
    }

    /// Floating-point operations counted ([`add_flops`]) in scopes of `kind`:
    /// the matrix products run there, whichever threads ran their parts.
    pub fn flops(&self, kind: Kind) -> u64 {
        self.flops[kind.index()]
    }
}

impl std::ops::AddAssign for Profile {
    fn add_assign(&mut self, o: Profile) {
        for i in 0..self.time.len() {
            self.time[i] += o.time[i];
            self.count[i] += o.count[i];
            self.flops[i] += o.flops[i];
        }
    }
}

struct Frame {
    kind: Kind,
    /// The DTensor op whose local kernel this scope times ([`op_scope`]).
    op: Option<&'static str>,
    start: Instant,
    /// Time of the scopes nested in this one.
    inner: Duration,
}

#[derive(Default)]
struct State {
    totals: Profile,
    /// Exclusive time and calls per op name, in first-seen order.
    ops: Vec<OpTime>,
    stack: Vec<Frame>,
}

/// Exclusive time and calls of one DTensor op's local kernels (see [`take_ops`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpTime {
    /// The op's name, as given to `dispatch` (`"matmul"`, `"softmax"`, ...).
    pub op: &'static str,
    /// Its kind.
    pub kind: Kind,
    /// Exclusive time in its local kernels.
    pub time: Duration,
    /// Kernels run.
    pub count: u64,
}

thread_local! {
    static STATE: RefCell<State> = RefCell::new(State::default());
    /// FLOPs of products in 16-bit floats counted on this thread (also in
    /// [`add_flops`]'s totals), for estimates that rate them apart.
    static HALF_FLOPS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// [`add_flops`] for a product in `dtype`; a 16-bit float product's are also
/// counted apart, for [`take_half_flops`].
pub fn add_flops_of(flops: u64, dtype: tessera_mesh::DType) {
    if !enabled() {
        return;
    }
    add_flops(flops);
    if matches!(dtype, tessera_mesh::DType::BF16 | tessera_mesh::DType::F16) {
        HALF_FLOPS.with(|h| h.set(h.get().saturating_add(flops)));
    }
}

/// The calling thread's FLOPs of 16-bit float products since the last call
/// (counted while timing is on), reset.
pub fn take_half_flops() -> u64 {
    HALF_FLOPS.with(|h| h.replace(0))
}

/// Turns timing on or off for every thread.
pub fn enable(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

/// Whether timing is on.
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// With timing on, makes every scope wait for the calling rank's queued GPU
/// work when it opens and when it closes, so that a kernel's device time counts
/// in the scope that launched it rather than in whichever later scope first
/// waits for the GPU (the profile's view of a GPU run; it costs the overlap of
/// host and device, so steps run slower). Off by default; without the `cuda`
/// feature, or for a rank that has not used a GPU, it changes nothing.
/// PyTorch's profiler records device time with events instead.
pub fn sync_device(on: bool) {
    SYNC_DEVICE.store(on, Ordering::Relaxed);
}

/// Waits for the calling rank's GPU work when [`sync_device`] asks for it.
fn wait_for_device() {
    #[cfg(feature = "cuda")]
    if SYNC_DEVICE.load(Ordering::Relaxed) {
        // A failed kernel surfaces again at the op's own next wait: the
        // profile only times.
        let _ = crate::cuda::driver::synchronize_rank();
    }
}

/// The calling thread's totals since the last `take`, reset.
pub fn take() -> Profile {
    STATE.with(|s| std::mem::take(&mut s.borrow_mut().totals))
}

/// The calling thread's time per op since the last `take_ops`, reset, in the
/// order the ops first ran. Only the local kernels of DTensor ops count here
/// (see [`op_scope`]); their sum is at most the [`Profile`]'s time in their kinds.
pub fn take_ops() -> Vec<OpTime> {
    STATE.with(|s| std::mem::take(&mut s.borrow_mut().ops))
}

/// Adds `o` into `sum`: to the entry of the same op, else as a new last entry
/// (to total [`take_ops`] over several steps).
pub fn add_op(sum: &mut Vec<OpTime>, o: OpTime) {
    match sum.iter_mut().find(|s| s.op == o.op) {
        Some(s) => {
            s.time += o.time;
            s.count += o.count;
        }
        None => sum.push(o),
    }
}

/// Counts `flops` floating-point operations under the kind of the calling
/// thread's innermost open scope (a `matmul` op's is [`Kind::Gemm`]). Kernels
/// call it once per product on the thread that runs the op, before handing
/// parts to other threads; without an open scope, or with timing off, the
/// operations are not counted.
pub fn add_flops(flops: u64) {
    if !enabled() {
        return;
    }
    let _ = STATE.try_with(|s| {
        let mut s = s.borrow_mut();
        if let Some(kind) = s.stack.last().map(|f| f.kind) {
            let f = &mut s.totals.flops[kind.index()];
            *f = f.saturating_add(flops);
        }
    });
}

/// Times the rest of the enclosing block as `kind` (exclusive of nested scopes).
#[must_use = "the scope times until it is dropped"]
pub fn scope(kind: Kind) -> Scope {
    push(kind, None)
}

/// Times the rest of the enclosing block as the local kernel of DTensor op `op`:
/// counted under [`Kind::of_op`] and, by name, in [`take_ops`].
#[must_use = "the scope times until it is dropped"]
pub fn op_scope(op: &'static str) -> Scope {
    push(Kind::of_op(op), Some(op))
}

fn push(kind: Kind, op: Option<&'static str>) -> Scope {
    if !enabled() {
        return Scope { active: false };
    }
    wait_for_device();
    let pushed = STATE
        .try_with(|s| {
            s.borrow_mut().stack.push(Frame {
                kind,
                op,
                start: Instant::now(),
                inner: Duration::ZERO,
            })
        })
        .is_ok();
    Scope { active: pushed }
}

/// A running timer; see [`scope`].
pub struct Scope {
    active: bool,
}

impl Drop for Scope {
    fn drop(&mut self) {
        if !self.active {
            return;
        }
        wait_for_device();
        let _ = STATE.try_with(|s| {
            let mut s = s.borrow_mut();
            let Some(f) = s.stack.pop() else { return };
            let all = f.start.elapsed();
            let own = all.saturating_sub(f.inner);
            let i = f.kind.index();
            s.totals.time[i] += own;
            s.totals.count[i] += 1;
            if let Some(op) = f.op {
                add_op(
                    &mut s.ops,
                    OpTime {
                        op,
                        kind: f.kind,
                        time: own,
                        count: 1,
                    },
                );
            }
            if let Some(parent) = s.stack.last_mut() {
                parent.inner += all;
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;

    /// Timing is switched on and off for every thread: one test at a time.
    static SERIAL: Mutex<()> = Mutex::new(());

    /// Nested scopes count exclusive time; off, nothing is counted.
    #[test]
    fn nested_scopes_are_exclusive() {
        let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        enable(true);
        take();
        {
            let _outer = scope(Kind::Gemm);
            std::thread::sleep(Duration::from_millis(20));
            let _inner = scope(Kind::Allocation);
            std::thread::sleep(Duration::from_millis(30));
        }
        let p = take();
        assert_eq!((p.count(Kind::Gemm), p.count(Kind::Allocation)), (1, 1));
        assert!(p.time(Kind::Allocation) >= Duration::from_millis(30));
        assert!(p.time(Kind::Gemm) >= Duration::from_millis(20));
        assert!(
            p.time(Kind::Gemm) < Duration::from_millis(30),
            "{:?}",
            p.time(Kind::Gemm)
        );
        enable(false);
        {
            let _t = scope(Kind::Nn);
        }
        assert_eq!(take(), Profile::default());
    }

    /// Operations count under the innermost open scope's kind, and nowhere
    /// without a scope or with timing off.
    #[test]
    fn flops_count_under_the_innermost_scope() {
        let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        enable(true);
        take();
        add_flops(7);
        {
            let _outer = op_scope("matmul");
            add_flops(100);
            {
                let _inner = scope(Kind::Nn);
                add_flops(10);
            }
            add_flops(1);
        }
        let p = take();
        assert_eq!((p.flops(Kind::Gemm), p.flops(Kind::Nn)), (101, 10));
        let mut sum = p;
        sum += p;
        assert_eq!(sum.flops(Kind::Gemm), 202);
        enable(false);
        {
            let _t = scope(Kind::Gemm);
            add_flops(5);
        }
        assert_eq!(take(), Profile::default());
    }

    /// A product run under an op scope counts its `2·m·k·n`.
    #[test]
    fn matmul_counts_its_flops() {
        let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let a = crate::Tensor::ones(&[3, 4, 5], crate::DType::F32).unwrap();
        let b = crate::Tensor::ones(&[5, 6], crate::DType::F32).unwrap();
        enable(true);
        take();
        {
            let _t = op_scope("matmul");
            a.matmul(&b).unwrap();
        }
        let p = take();
        enable(false);
        assert_eq!(p.flops(Kind::Gemm), 2 * 3 * 4 * 5 * 6);
    }

    /// The fused attention kernels count the flops of the chain of products
    /// they replace, causal or not, for every set of gradients asked for.
    #[test]
    fn fused_attention_counts_the_flops_of_its_chain() {
        use crate::ops::{Attention, Causal};
        let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let t = |x: &crate::Tensor| x.transpose(2, 3).unwrap();
        let (q, k, v) = (
            crate::Tensor::ones(&[2, 3, 8, 4], crate::DType::F32).unwrap(),
            crate::Tensor::ones(&[2, 3, 6, 4], crate::DType::F32).unwrap(),
            crate::Tensor::ones(&[2, 3, 6, 5], crate::DType::F32).unwrap(),
        );
        let g = crate::Tensor::ones(&[2, 3, 8, 5], crate::DType::F32).unwrap();
        let counted = |f: &dyn Fn()| {
            enable(true);
            take();
            {
                let _t = scope(Kind::Gemm);
                f();
            }
            let p = take();
            enable(false);
            p.flops(Kind::Gemm)
        };
        for is_causal in [false, true] {
            let attn = Attention { scale: 0.5, is_causal };
            let part = |p| if is_causal { p } else { Causal::Dense };
            let probs = q.attention(&k, &v, attn).unwrap().1;
            let fused = counted(&|| drop(q.attention(&k, &v, attn).unwrap()));
            let chain = counted(&|| {
                let s = q.matmul_causal(&t(&k), part(Causal::Scores)).unwrap();
                probs.matmul_causal(&v, part(Causal::Weights)).unwrap();
                drop(s);
            });
            assert_eq!(fused, chain, "forward, causal {is_causal}");
            for need in [[true, true, true], [false, false, true], [true, false, false]] {
                let fused = counted(&|| drop(g.attention_backward(&q, &k, &v, &probs, attn, need).unwrap()));
                let chain = counted(&|| {
                    if need[2] {
                        t(&probs).matmul_causal(&g, part(Causal::WeightsTransposed)).unwrap();
                    }
                    if need[0] || need[1] {
                        // The weights' gradient has the shape of the weights.
                        g.matmul_causal(&t(&v), part(Causal::Scores)).unwrap();
                    }
                    if need[0] {
                        probs.matmul_causal(&k, part(Causal::Weights)).unwrap();
                    }
                    if need[1] {
                        t(&probs).matmul_causal(&q, part(Causal::WeightsTransposed)).unwrap();
                    }
                });
                assert_eq!(fused, chain, "backward {need:?}, causal {is_causal}");
            }
        }
    }

    #[test]
    fn op_kinds_follow_the_op_names() {
        let kinds = [
            ("matmul", Kind::Gemm),
            ("matmul_causal", Kind::Gemm),
            ("sum", Kind::Reduction),
            ("softmax_backward", Kind::Nn),
            ("attention_probs", Kind::Nn),
            ("attention_probs_backward", Kind::Nn),
            ("layer_norm_weight_grad", Kind::Nn),
            ("cross_entropy", Kind::Nn),
            ("causal_mask", Kind::Nn),
            ("gelu", Kind::Elementwise),
            ("mul_scalar", Kind::Elementwise),
        ];
        for (op, kind) in kinds {
            assert_eq!(Kind::of_op(op), kind, "{op}");
        }
    }

    /// Op scopes count under their op's kind and, by name, in `take_ops`.
    #[test]
    fn op_scopes_are_counted_by_name() {
        let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        enable(true);
        take();
        take_ops();
        for _ in 0..2 {
            let _t = op_scope("softmax");
            std::thread::sleep(Duration::from_millis(5));
        }
        {
            let _t = op_scope("matmul");
            let _a = scope(Kind::Allocation);
            std::thread::sleep(Duration::from_millis(5));
        }
        let ops = take_ops();
        let p = take();
        enable(false);
        let names: Vec<(&str, Kind, u64)> = ops.iter().map(|o| (o.op, o.kind, o.count)).collect();
        assert_eq!(names, [("softmax", Kind::Nn, 2), ("matmul", Kind::Gemm, 1)]);
        assert!(ops[0].time >= Duration::from_millis(10));
        // The allocation inside the matmul is not the matmul's.
        assert!(ops[1].time < Duration::from_millis(5), "{:?}", ops[1].time);
        assert_eq!(p.count(Kind::Nn), 2);
        assert!(take_ops().is_empty());
    }
}
