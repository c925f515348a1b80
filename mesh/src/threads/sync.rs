//! Synchronisation helpers shared by the threads backend's job state
//! ([`World`](super::world::World)), its groups' barriers
//! ([`Group`](super::group::Group)) and the cross-group mismatch check
//! ([`Activity`](super::activity::Activity)): cache-line padding, the members'
//! barrier points, and a lock that survives a panicking holder.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// Pads a value to its own cache line pair, so ranks spinning on neighbours' counters
/// do not share lines.
#[repr(align(128))]
#[derive(Default)]
pub(crate) struct Padded<T>(pub(crate) T);

/// Barrier points each member of a group has reached.
pub(crate) type Phases = Arc<Vec<Padded<AtomicU64>>>;

/// The group ranks that have not reached barrier point `phase`.
pub(crate) fn behind(phases: &[Padded<AtomicU64>], phase: u64) -> impl Iterator<Item = usize> + '_ {
    (0..phases.len()).filter(move |&q| phases[q].0.load(Ordering::Acquire) < phase)
}

/// Locks a mutex, recovering the data if a panicking thread poisoned it: every
/// value guarded here stays consistent across a panic (plain data, written whole).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
