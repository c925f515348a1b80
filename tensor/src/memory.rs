//! Per-rank accounting of tensor storage: current and peak bytes.
//!
//! Every tensor storage charges its byte size to the rank the allocating thread
//! works for ([`current_rank`]), and gives the bytes back to the *same* rank
//! when it is dropped, on whatever thread that happens. Counters are kept per
//! `(job, rank)`, so ranks that are threads of one process (the threads backend),
//! and concurrent jobs (tests running in parallel), never mix. Threads that work
//! for no rank (outside a launch, or in an MPI process where the process is the
//! rank) share one process-wide "no rank" counter set.
//!
//! Views (`narrow`, `chunk`, `transpose`, `reshape` of contiguous data) share
//! their storage and allocate nothing; `contiguous` of a strided view, `cat`,
//! `cast` and every constructor allocate. Only the logical size of a storage is
//! counted (elements × dtype size), not allocator slack.
//!
//! PyTorch: `torch.cuda.memory_allocated` / `max_memory_allocated` /
//! `reset_peak_memory_stats`, but per rank and for host tensors too.
//!
//! ```
//! use tessera_tensor::{memory, DType, Tensor};
//! use tessera_mesh::context::{scoped, RankId};
//!
//! // Pretend this thread is rank 0 of some job (a launcher does this for real).
//! let id = RankId { job: 1 << 40, rank: 0 };
//! scoped(id, || -> tessera_tensor::Result<()> {
//!     let a = Tensor::zeros(&[256, 4], DType::F32)?; // 4 KiB
//!     let halves = a.chunk(2, 0)?; // views: nothing allocated
//!     assert_eq!(memory::stats().current_bytes, 4096);
//!     let b = halves[1].cast(DType::F64)?; // 128 × 4 × 8 bytes
//!     assert_eq!(memory::stats().current_bytes, 4096 + 4096);
//!     drop((a, halves));
//!     assert_eq!(memory::stats().current_bytes, 4096); // `b` is left
//!     assert_eq!(memory::stats().peak_bytes, 8192);
//!     memory::reset_peak();
//!     assert_eq!(memory::stats().peak_bytes, 4096);
//!     drop(b);
//!     Ok(())
//! })?;
//! assert_eq!(memory::stats_of(id).current_bytes, 0);
//! # Ok::<(), tessera_tensor::Error>(())
//! ```

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Mutex, PoisonError};

use tessera_mesh::context::{RankId, current_rank};

/// Current and peak bytes of tensor storage owned by one rank: in use by
/// tensors, and reserved (in use, plus the freed buffers the rank's host
/// cache keeps for reuse; PyTorch: `memory_allocated` and `memory_reserved`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct MemoryStats {
    /// Bytes of storage alive now.
    pub current_bytes: usize,
    /// The most bytes alive at once since the rank started or since [`reset_peak`].
    pub peak_bytes: usize,
    /// Bytes alive now plus those the rank's cache keeps (see `alloc`).
    pub reserved_bytes: usize,
    /// The most reserved bytes at once since the rank started or since [`reset_peak`].
    pub peak_reserved_bytes: usize,
}

/// What a rank's bytes hold, as FSDP's memory tracker sorts them. A storage
/// starts as [`Activations`](Category::Activations) (what ops allocate) and is
/// moved to another category by what keeps it: a parameter's value
/// ([`Parameters`](Category::Parameters)), its gradient, an optimizer's state,
/// FSDP's gathered parameters and gradients waiting to be reduced, a
/// collective's buffers in flight.
///
/// PyTorch: the reference types of `torch.distributed._tools`'
/// `FSDPMemTracker` (sharded and unsharded parameters and gradients,
/// activations and temporaries, all-gather and reduce-scatter buffers,
/// optimizer state).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Category {
    /// Activations kept for backward and the temporaries of ops (the default).
    Activations,
    /// Parameters as the rank holds them between steps (FSDP: its shards).
    Parameters,
    /// Parameters gathered for compute (FSDP's unsharded units, and the pieces
    /// kept by resharding to smaller groups).
    GatheredParameters,
    /// Gradients of the parameters (FSDP: reduced shards).
    Gradients,
    /// Gradients of gathered parameters waiting for their reduction.
    UnshardedGradients,
    /// Optimizer state (moments, step counts).
    OptimizerState,
    /// Buffers of collectives in flight, outside any tensor.
    CollectiveBuffers,
}

impl Category {
    /// Every category, in order.
    pub const ALL: [Category; 7] = [
        Category::Activations,
        Category::Parameters,
        Category::GatheredParameters,
        Category::Gradients,
        Category::UnshardedGradients,
        Category::OptimizerState,
        Category::CollectiveBuffers,
    ];

    /// A short name: `activations`, `parameters`, `gathered_parameters`,
    /// `gradients`, `unsharded_gradients`, `optimizer_state`, `collective_buffers`.
    pub fn name(self) -> &'static str {
        match self {
            Category::Activations => "activations",
            Category::Parameters => "parameters",
            Category::GatheredParameters => "gathered_parameters",
            Category::Gradients => "gradients",
            Category::UnshardedGradients => "unsharded_gradients",
            Category::OptimizerState => "optimizer_state",
            Category::CollectiveBuffers => "collective_buffers",
        }
    }

    fn from_index(i: u8) -> Category {
        Category::ALL[usize::from(i).min(Category::ALL.len() - 1)]
    }
}

/// A rank's bytes by [`Category`]: now, and at its peak (since the last
/// [`reset_peak`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CategoryStats {
    /// Bytes alive now, by [`Category::ALL`] index.
    pub current: [usize; 7],
    /// Bytes alive at the moment of the peak, by [`Category::ALL`] index
    /// (they sum to the peak).
    pub at_peak: [usize; 7],
}

impl CategoryStats {
    /// Bytes of `category` at the peak.
    pub fn at_peak(&self, category: Category) -> usize {
        self.at_peak[category as usize]
    }

    /// Bytes of `category` now.
    pub fn current(&self, category: Category) -> usize {
        self.current[category as usize]
    }
}

/// The counters of one rank (or of "no rank").
#[derive(Debug, Default)]
struct Counters {
    /// Bytes alive by category ([`Category::ALL`] index).
    by_category: [AtomicUsize; 7],
    /// `by_category` when `peak` was last raised or reset.
    at_peak: [AtomicUsize; 7],
    current: AtomicUsize,
    /// Bytes ever charged (the rank's allocation traffic).
    total: AtomicUsize,
    /// Elements of tensor storage ever allocated (whatever their dtype).
    total_elements: AtomicUsize,
    peak: AtomicUsize,
    cached: AtomicUsize,
    peak_reserved: AtomicUsize,
}

impl Counters {
    fn add(&self, bytes: usize, category: Category) {
        self.total.fetch_add(bytes, Ordering::Relaxed);
        self.by_category[category as usize].fetch_add(bytes, Ordering::Relaxed);
        let now = self.current.fetch_add(bytes, Ordering::Relaxed) + bytes;
        if self.peak.fetch_max(now, Ordering::Relaxed) < now {
            self.snapshot_categories();
        }
        self.peak_reserved
            .fetch_max(now + self.cached.load(Ordering::Relaxed), Ordering::Relaxed);
    }

    fn sub(&self, bytes: usize, category: Category) {
        self.by_category[category as usize].fetch_sub(bytes, Ordering::Relaxed);
        self.current.fetch_sub(bytes, Ordering::Relaxed);
    }

    /// Copies the bytes by category into `at_peak`.
    fn snapshot_categories(&self) {
        for (now, at) in self.by_category.iter().zip(&self.at_peak) {
            at.store(now.load(Ordering::Relaxed), Ordering::Relaxed);
        }
    }

    fn categories(&self) -> CategoryStats {
        let read = |a: &[AtomicUsize; 7]| std::array::from_fn(|i| a[i].load(Ordering::Relaxed));
        CategoryStats {
            current: read(&self.by_category),
            at_peak: read(&self.at_peak),
        }
    }

    fn stats(&self) -> MemoryStats {
        let current_bytes = self.current.load(Ordering::Relaxed);
        MemoryStats {
            current_bytes,
            peak_bytes: self.peak.load(Ordering::Relaxed),
            reserved_bytes: current_bytes + self.cached.load(Ordering::Relaxed),
            peak_reserved_bytes: self.peak_reserved.load(Ordering::Relaxed),
        }
    }

    fn reset_peak(&self) {
        let now = self.current.load(Ordering::Relaxed);
        self.peak.store(now, Ordering::Relaxed);
        self.snapshot_categories();
        self.peak_reserved
            .store(now + self.cached.load(Ordering::Relaxed), Ordering::Relaxed);
    }
}

/// The bytes of one freed buffer a rank's host cache keeps, counted as
/// reserved (not in use) on that rank until the buffer leaves the cache.
/// A buffer moving between a tensor and the cache changes neither peak: it is
/// counted as cached before its tensor's charge goes, and leaves the cache
/// before the next tensor's charge comes.
#[derive(Debug)]
pub(crate) struct CacheCharge {
    counters: Arc<Counters>,
    bytes: usize,
}

impl CacheCharge {
    /// Counts `bytes` as cached on the current thread's rank.
    pub(crate) fn new(bytes: usize) -> CacheCharge {
        let counters = current_counters();
        counters.cached.fetch_add(bytes, Ordering::Relaxed);
        CacheCharge { counters, bytes }
    }
}

impl Drop for CacheCharge {
    fn drop(&mut self) {
        self.counters.cached.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

/// Counters of every rank seen so far. Entries stay after their job ends (a few
/// dozen bytes each) so that a job's peaks can be read after it returns.
static RANKS: LazyLock<Mutex<HashMap<RankId, Arc<Counters>>>> = LazyLock::new(Default::default);

/// Device (GPU) counters of every rank seen so far, kept apart from host bytes.
static DEVICE_RANKS: LazyLock<Mutex<HashMap<RankId, Arc<Counters>>>> = LazyLock::new(Default::default);

/// Device counters for threads that work for no rank.
static DEVICE_NO_RANK: LazyLock<Arc<Counters>> = LazyLock::new(Default::default);

/// Counters for threads that work for no rank.
static NO_RANK: LazyLock<Arc<Counters>> = LazyLock::new(Default::default);

thread_local! {
    /// The category new storage of this thread is charged as.
    static ALLOCATING_AS: std::cell::Cell<Category> = const { std::cell::Cell::new(Category::Activations) };
    /// The counters of the rank this thread last allocated for, to skip the lock.
    static CACHED: RefCell<Option<(RankId, Arc<Counters>)>> = const { RefCell::new(None) };
}

fn counters_of(id: RankId) -> Arc<Counters> {
    // A panic while holding this lock cannot leave the map inconsistent (inserts
    // are single calls), so a poisoned lock is still good to use.
    let mut map = RANKS.lock().unwrap_or_else(PoisonError::into_inner);
    Arc::clone(map.entry(id).or_default())
}

/// The counters of the rank the current thread works for.
fn current_counters() -> Arc<Counters> {
    let Some(id) = current_rank() else {
        return Arc::clone(&NO_RANK);
    };
    CACHED.with(|cache| {
        let mut cache = cache.borrow_mut();
        match &*cache {
            Some((cached, counters)) if *cached == id => Arc::clone(counters),
            _ => {
                let counters = counters_of(id);
                *cache = Some((id, Arc::clone(&counters)));
                counters
            }
        }
    })
}

/// The device counters of the rank the current thread works for.
fn current_device_counters() -> Arc<Counters> {
    let Some(id) = current_rank() else {
        return Arc::clone(&DEVICE_NO_RANK);
    };
    let mut map = DEVICE_RANKS.lock().unwrap_or_else(PoisonError::into_inner);
    Arc::clone(map.entry(id).or_default())
}

/// Device memory of the rank the current thread works for: bytes of its live
/// GPU tensors, all GPUs together (PyTorch: `torch.cuda.memory_allocated` and
/// `max_memory_allocated`, per rank). The caching allocator's reserved bytes are
/// `tessera_tensor::cuda::memory_stats`.
pub fn device_stats() -> MemoryStats {
    current_device_counters().stats()
}

/// Sets the current rank's device peak to its current device bytes.
pub fn reset_device_peak() {
    current_device_counters().reset_peak();
}

/// Memory statistics of the rank the current thread works for (the "no rank"
/// counters outside a launch).
pub fn stats() -> MemoryStats {
    current_counters().stats()
}

/// Bytes ever charged to the rank the current thread works for (host
/// storage): the allocation traffic of its ops, each new output counted once.
/// Subtract two readings to count what a step allocated.
pub fn allocated_bytes() -> usize {
    current_counters().total.load(Ordering::Relaxed)
}

/// Elements of host tensor storage ever allocated by the rank the current
/// thread works for, whatever their dtype: its ops' element traffic (a bf16
/// element costs an element-wise kernel about what an f32 one does).
/// Subtract two readings to count what a step allocated.
pub fn allocated_elements() -> usize {
    current_counters().total_elements.load(Ordering::Relaxed)
}

/// Memory statistics of rank `id` (all zero for a rank that never allocated).
pub fn stats_of(id: RankId) -> MemoryStats {
    let map = RANKS.lock().unwrap_or_else(PoisonError::into_inner);
    map.get(&id).map(|c| c.stats()).unwrap_or_default()
}

/// Runs `f` with every storage it allocates on this thread charged as
/// `category` from the start (instead of [`Category::Activations`]), so that a
/// peak reached by that allocation counts it as such.
pub fn allocating_as<T>(category: Category, f: impl FnOnce() -> T) -> T {
    let before = ALLOCATING_AS.with(|c| c.replace(category));
    // Restored however `f` leaves (a panic included).
    struct Restore(Category);
    impl Drop for Restore {
        fn drop(&mut self) {
            ALLOCATING_AS.with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(before);
    f()
}

/// The bytes of the rank the current thread works for, by [`Category`]: now
/// and at its peak.
pub fn category_stats() -> CategoryStats {
    current_counters().categories()
}

/// Sets the current thread's rank's peak to its current bytes, to measure the
/// peak of one phase (PyTorch: `torch.cuda.reset_peak_memory_stats`).
pub fn reset_peak() {
    current_counters().reset_peak();
}

/// Bytes charged to one rank, given back to that rank when dropped.
///
/// Every tensor storage holds one. Code that keeps large buffers outside
/// tensors (a flat communication bucket, say) can hold one too, so that the
/// per-rank peaks stay honest.
#[derive(Debug)]
pub struct Allocation {
    counters: Arc<Counters>,
    bytes: usize,
    /// Its [`Category`] (index), which the holder may change.
    category: AtomicU8,
}

impl Allocation {
    /// Charges `bytes` to the rank the current thread works for, as
    /// [`Category::Activations`] (or what [`allocating_as`] says).
    pub fn charge(bytes: usize) -> Allocation {
        Allocation::charge_as(bytes, ALLOCATING_AS.with(std::cell::Cell::get))
    }

    /// Charges `bytes` to the rank the current thread works for, as `category`.
    pub fn charge_as(bytes: usize, category: Category) -> Allocation {
        Allocation::on(current_counters(), bytes, category)
    }

    /// Charges a new host storage of `elements` elements (`bytes` bytes) to
    /// the rank the current thread works for, as [`charge`](Self::charge)
    /// does, counting its elements too (see [`allocated_elements`]).
    pub(crate) fn charge_storage(bytes: usize, elements: usize) -> Allocation {
        let counters = current_counters();
        counters.total_elements.fetch_add(elements, Ordering::Relaxed);
        Allocation::on(counters, bytes, ALLOCATING_AS.with(std::cell::Cell::get))
    }

    /// Charges `bytes` of device memory to the rank the current thread works for.
    pub fn charge_device(bytes: usize) -> Allocation {
        Allocation::on(current_device_counters(), bytes, Category::Activations)
    }

    /// `bytes` of `category` added to `counters`, given back when dropped.
    fn on(counters: Arc<Counters>, bytes: usize, category: Category) -> Allocation {
        counters.add(bytes, category);
        Allocation {
            counters,
            bytes,
            category: AtomicU8::new(category as u8),
        }
    }

    /// The bytes this allocation holds.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// What the bytes hold.
    pub fn category(&self) -> Category {
        Category::from_index(self.category.load(Ordering::Relaxed))
    }

    /// Counts the bytes as `category` from now on. The categories at the
    /// peak are those of the moment an allocation raised it: a peak already
    /// reached keeps them (to count a new buffer as something else at its
    /// peak, allocate it so, with [`charge_as`](Self::charge_as) or inside
    /// [`allocating_as`]).
    pub fn set_category(&self, category: Category) {
        let old = Category::from_index(self.category.swap(category as u8, Ordering::Relaxed));
        if old != category {
            self.counters.by_category[category as usize].fetch_add(self.bytes, Ordering::Relaxed);
            self.counters.by_category[old as usize].fetch_sub(self.bytes, Ordering::Relaxed);
        }
    }
}

impl Drop for Allocation {
    fn drop(&mut self) {
        self.counters.sub(self.bytes, self.category());
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicU64;
    use std::thread;

    use tessera_mesh::context::scoped;

    use super::*;
    use crate::{DType, Tensor};

    /// A job number no launcher and no other test uses.
    fn fresh_job() -> u64 {
        static NEXT: AtomicU64 = AtomicU64::new(1 << 50);
        NEXT.fetch_add(1, Ordering::Relaxed)
    }

    fn rank(rank: usize) -> RankId {
        RankId { job: fresh_job(), rank }
    }

    /// Stats of small tensors (under the cache's 256 KiB): nothing cached, so
    /// reserved equals in use.
    fn mb(current: usize, peak: usize) -> MemoryStats {
        MemoryStats {
            current_bytes: current,
            peak_bytes: peak,
            reserved_bytes: current,
            peak_reserved_bytes: peak,
        }
    }

    /// Bytes start as activations, move with `set_memory_category` (every
    /// view of the storage at once), leave with their storage; the snapshot
    /// at the peak sums to the peak and keeps the categories of that moment.
    #[test]
    fn bytes_are_counted_by_category_and_snapshot_at_the_peak() {
        let id = rank(0);
        scoped(id, || {
            let idx = |c: Category| c as usize;
            let a = Tensor::zeros(&[100], DType::F32).unwrap();
            let half = a.narrow(0, 0, 50).unwrap();
            assert_eq!(a.memory_category(), Category::Activations);
            half.set_memory_category(Category::Parameters);
            assert_eq!(a.memory_category(), Category::Parameters, "views share the storage");
            let c = category_stats();
            assert_eq!(c.current(Category::Parameters), 400);
            assert_eq!(c.current(Category::Activations), 0);
            let g = Allocation::charge_as(64, Category::CollectiveBuffers);
            let t = Tensor::zeros(&[8], DType::F64).unwrap();
            // The peak (528 bytes) with its categories.
            let c = category_stats();
            assert_eq!(stats().peak_bytes, 528);
            assert_eq!(c.at_peak.iter().sum::<usize>(), 528);
            assert_eq!(c.at_peak[idx(Category::Parameters)], 400);
            assert_eq!(c.at_peak[idx(Category::CollectiveBuffers)], 64);
            assert_eq!(c.at_peak[idx(Category::Activations)], 64);
            t.set_memory_category(Category::Gradients);
            assert_eq!(
                category_stats().at_peak(Category::Gradients),
                0,
                "the peak keeps its moment"
            );
            drop(g);
            let u = allocating_as(Category::Gradients, || Tensor::zeros(&[200], DType::F32).unwrap());
            assert_eq!(u.memory_category(), Category::Gradients);
            let c = category_stats();
            assert_eq!(stats().peak_bytes, 400 + 64 + 800);
            assert_eq!(
                c.at_peak(Category::Gradients),
                64 + 800,
                "allocated as gradients at the peak"
            );
            assert_eq!(
                Tensor::zeros(&[1], DType::F32).unwrap().memory_category(),
                Category::Activations
            );
            drop(u);
            t.set_memory_category(Category::OptimizerState);
            let c = category_stats();
            assert_eq!(c.current(Category::OptimizerState), 64);
            assert_eq!(c.current(Category::CollectiveBuffers), 0);
            assert_eq!(
                c.at_peak(Category::Gradients),
                864,
                "a peak passed keeps its categories"
            );
            assert_eq!(c.at_peak(Category::OptimizerState), 0);
            reset_peak();
            let c = category_stats();
            assert_eq!(c.at_peak, c.current);
            drop((a, half, t));
            assert_eq!(category_stats().current, [0; 7]);
        });
    }

    /// Allocated elements count storage by element whatever the dtype;
    /// views add none.
    #[test]
    fn allocated_elements_count_every_dtype_alike() {
        scoped(rank(0), || {
            let (e0, b0) = (allocated_elements(), allocated_bytes());
            let a = Tensor::zeros(&[10, 10], DType::F32).unwrap();
            let h = a.cast(DType::BF16).unwrap();
            let _view = h.narrow(0, 0, 5).unwrap();
            assert_eq!(allocated_elements() - e0, 200);
            assert_eq!(allocated_bytes() - b0, 600);
            let _m = Tensor::meta(&[7], DType::BF16).unwrap();
            assert_eq!(
                allocated_elements() - e0,
                207,
                "meta storage counts as the host's would"
            );
        });
    }

    #[test]
    fn allocation_and_drop_are_counted() {
        let id = rank(0);
        scoped(id, || {
            assert_eq!(stats(), mb(0, 0));
            let a = Tensor::zeros(&[10, 10], DType::F32).unwrap();
            assert_eq!(stats(), mb(400, 400));
            let b = Tensor::ones(&[3], DType::BF16).unwrap();
            assert_eq!(stats(), mb(406, 406));
            let a2 = a.clone();
            assert_eq!(stats(), mb(406, 406), "clones share storage");
            drop(a);
            assert_eq!(stats(), mb(406, 406), "a clone keeps the storage alive");
            drop(a2);
            assert_eq!(stats(), mb(6, 406));
            drop(b);
            assert_eq!(stats(), mb(0, 406));
        });
        assert_eq!(stats_of(id), mb(0, 406));
    }

    #[test]
    fn every_allocating_op_is_counted_and_views_are_not() {
        let id = rank(0);
        scoped(id, || {
            macro_rules! case {
                ($name:literal, $make:expr, $bytes:expr) => {{
                    let base = stats().current_bytes;
                    let made = $make;
                    assert_eq!(stats().current_bytes - base, $bytes, "{}", $name);
                    drop(made);
                    assert_eq!(stats().current_bytes, base, "{} dropped", $name);
                }};
            }
            let t = Tensor::arange(24, DType::F32).unwrap().reshape(&[4, 6]).unwrap();
            assert_eq!(stats().current_bytes, 96);
            case!("narrow", t.narrow(1, 1, 3).unwrap(), 0);
            case!("chunk", t.chunk(3, 0).unwrap(), 0);
            case!("transpose", t.transpose(0, 1).unwrap(), 0);
            case!("reshape", t.reshape(&[24]).unwrap(), 0);
            case!("contiguous of contiguous", t.contiguous(), 0);
            case!("same-dtype cast", t.cast(DType::F32).unwrap(), 0);
            case!("contiguous of strided", t.narrow(1, 0, 2).unwrap().contiguous(), 32);
            case!(
                "reshape of strided",
                t.transpose(0, 1).unwrap().reshape(&[24]).unwrap(),
                96
            );
            case!("cast", t.cast(DType::F64).unwrap(), 192);
            case!("cat", Tensor::cat(&[t.clone(), t.clone()], 0).unwrap(), 192);
            case!("from_vec", Tensor::from_vec(vec![1i64; 5], &[5]).unwrap(), 40);
            case!("randn", Tensor::randn(&[8], DType::F16, 1).unwrap(), 16);
            case!("u8", Tensor::zeros(&[7], DType::U8).unwrap(), 7);
        });
    }

    #[test]
    fn peak_and_reset() {
        scoped(rank(3), || {
            let a = Tensor::zeros(&[100], DType::F64).unwrap();
            let b = Tensor::zeros(&[100], DType::F64).unwrap();
            drop(a);
            assert_eq!(stats(), mb(800, 1600));
            reset_peak();
            assert_eq!(stats(), mb(800, 800));
            let c = Tensor::zeros(&[50], DType::F64).unwrap();
            drop(c);
            assert_eq!(stats(), mb(800, 1200));
            drop(b);
            reset_peak();
            assert_eq!(stats(), mb(0, 0));
        });
    }

    #[test]
    fn two_ranks_on_two_threads_are_separate() {
        let job = fresh_job();
        let ids = [RankId { job, rank: 0 }, RankId { job, rank: 1 }];
        let handles: Vec<_> = ids
            .iter()
            .enumerate()
            .map(|(i, &id)| {
                thread::spawn(move || {
                    scoped(id, || {
                        let t = Tensor::zeros(&[1000 * (i + 1)], DType::F32).unwrap();
                        let s = stats();
                        drop(t);
                        s
                    })
                })
            })
            .collect();
        let seen: Vec<MemoryStats> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        assert_eq!(seen, vec![mb(4000, 4000), mb(8000, 8000)]);
        assert_eq!(stats_of(ids[0]), mb(0, 4000));
        assert_eq!(stats_of(ids[1]), mb(0, 8000));
        assert_eq!(stats_of(RankId { job, rank: 2 }), mb(0, 0));
    }

    #[test]
    fn drop_on_another_thread_gives_back_to_the_allocating_rank() {
        let (owner, other) = (rank(0), rank(1));
        let t = scoped(owner, || Tensor::zeros(&[64], DType::I64).unwrap());
        assert_eq!(stats_of(owner), mb(512, 512));
        thread::spawn(move || {
            scoped(other, || {
                let view = t.narrow(0, 0, 8).unwrap();
                drop(t);
                assert_eq!(stats_of(owner).current_bytes, 512, "the view keeps it");
                drop(view);
            })
        })
        .join()
        .unwrap();
        assert_eq!(stats_of(owner), mb(0, 512));
        assert_eq!(stats_of(other), mb(0, 0));
    }

    #[test]
    fn switching_rank_on_one_thread_charges_each() {
        let (a, b) = (rank(0), rank(1));
        let ta = scoped(a, || Tensor::zeros(&[2], DType::F32).unwrap());
        let tb = scoped(b, || Tensor::zeros(&[3], DType::F32).unwrap());
        let ta2 = scoped(a, || Tensor::zeros(&[4], DType::F32).unwrap());
        assert_eq!(stats_of(a), mb(24, 24));
        assert_eq!(stats_of(b), mb(12, 12));
        drop((ta, tb, ta2));
        assert_eq!(stats_of(a).current_bytes, 0);
        assert_eq!(stats_of(b).current_bytes, 0);
    }

    #[test]
    fn explicit_allocations_are_counted() {
        let id = rank(0);
        scoped(id, || {
            let a = Allocation::charge(1234);
            assert_eq!(a.bytes(), 1234);
            assert_eq!(stats(), mb(1234, 1234));
            drop(a);
            assert_eq!(stats(), mb(0, 1234));
        });
    }
}
