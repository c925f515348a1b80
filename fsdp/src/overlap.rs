//! How much of each unit's communication its rank hid behind its own work:
//! every bucket collective a unit waits for adds when it ran on the
//! communication thread and how long the rank blocked for it.

use std::ops::AddAssign;
use std::time::Duration;

use tessera_mesh::WorkTiming;

/// One kind of a unit's collectives: how many ran asynchronously, how long
/// they ran on the communication thread, and how long the rank's thread
/// blocked waiting for them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CollectiveTimes {
    /// Collectives that ran on the communication thread.
    pub count: u64,
    /// Their time on the communication thread.
    pub run: Duration,
    /// How long the rank blocked waiting for them (the exposed time; it also
    /// counts the time a collective waited in the queue behind others).
    pub exposed: Duration,
    /// The part of `run` the rank did not wait for, summed per collective
    /// ([`WorkTiming::hidden`]).
    pub hidden: Duration,
}

impl CollectiveTimes {
    /// Adds one waited collective (ignored when nothing ran asynchronously).
    pub(crate) fn add(&mut self, timing: Option<WorkTiming>) {
        let Some(t) = timing.filter(|t| t.ran.is_some()) else {
            return;
        };
        self.count += 1;
        self.run += t.run();
        self.exposed += t.blocked;
        self.hidden += t.hidden();
    }

    /// The fraction of the run time hidden behind the rank's work (`hidden /
    /// run`), `None` when nothing ran.
    pub fn hidden_fraction(&self) -> Option<f64> {
        (!self.run.is_zero()).then(|| self.hidden.as_secs_f64() / self.run.as_secs_f64())
    }
}

/// A unit's collectives since FSDP began or since the last
/// [`reset_comm_overlap`](crate::FsdpModule::reset_comm_overlap), by kind:
/// the parameters' all-gathers (prefetched ones included), the gradients'
/// reduce-scatters, and HSDP's all-reduces over the replicate dim.
///
/// PyTorch has no direct counterpart: its profiler's trace shows the same as
/// NCCL kernels on the communication stream beside the compute stream's waits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CommOverlap {
    /// The unit's parameter all-gathers.
    pub all_gather: CollectiveTimes,
    /// The unit's gradient reduce-scatters.
    pub reduce_scatter: CollectiveTimes,
    /// The unit's gradient all-reduces over the replicate dim (HSDP).
    pub all_reduce: CollectiveTimes,
}

/// Sums another unit's (or step's) times into these.
impl AddAssign for CollectiveTimes {
    fn add_assign(&mut self, other: CollectiveTimes) {
        self.count += other.count;
        self.run += other.run;
        self.exposed += other.exposed;
        self.hidden += other.hidden;
    }
}

/// Sums another unit's collectives into these, kind by kind.
impl AddAssign for CommOverlap {
    fn add_assign(&mut self, other: CommOverlap) {
        self.all_gather += other.all_gather;
        self.reduce_scatter += other.reduce_scatter;
        self.all_reduce += other.all_reduce;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_add_kind_by_kind() {
        let t = |n: u64, ms: u64| CollectiveTimes {
            count: n,
            run: Duration::from_millis(ms),
            exposed: Duration::from_millis(ms / 4),
            hidden: Duration::from_millis(ms - ms / 4),
        };
        let mut a = CommOverlap {
            all_gather: t(1, 8),
            reduce_scatter: t(2, 4),
            all_reduce: CollectiveTimes::default(),
        };
        a += CommOverlap {
            all_gather: t(3, 16),
            reduce_scatter: CollectiveTimes::default(),
            all_reduce: t(1, 40),
        };
        assert_eq!(a.all_gather, t(4, 24));
        assert_eq!(a.reduce_scatter, t(2, 4));
        assert_eq!(a.all_reduce, t(1, 40));
        let f = a.all_gather.hidden_fraction().expect("a run");
        assert!((f - 18.0 / 24.0).abs() < 1e-12, "{f}");
        assert_eq!(CollectiveTimes::default().hidden_fraction(), None);
    }
}
