//! A map kept for the whole process: the planner's routes and search trees and
//! dispatch's choices, each a pure function of its key, computed once and shared
//! by every rank thread.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Mutex, MutexGuard, OnceLock};

/// A process-wide map of at most `bound` keys, emptied when it is full (the keys of
/// a training job are a few hundred layouts, planned again every step; a job
/// that keeps making new ones gets them computed afresh rather than held forever).
pub(crate) struct Memo<K, V> {
    map: OnceLock<Mutex<HashMap<K, V>>>,
    bound: usize,
}

impl<K: Hash + Eq, V> Memo<K, V> {
    /// An empty map holding up to `bound` keys.
    pub(crate) const fn new(bound: usize) -> Self {
        Memo {
            map: OnceLock::new(),
            bound,
        }
    }

    /// The map, locked. A poisoned lock only means another thread panicked while
    /// holding it; the map itself is whole (one insert or clear at a time).
    pub(crate) fn lock(&self) -> MutexGuard<'_, HashMap<K, V>> {
        self.map
            .get_or_init(Mutex::default)
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// The map, locked and with room for one more key (emptied when full).
    pub(crate) fn with_room(&self) -> MutexGuard<'_, HashMap<K, V>> {
        let mut map = self.lock();
        if map.len() >= self.bound {
            map.clear();
        }
        map
    }

    /// A clone of the value of `key`, if it is kept.
    pub(crate) fn get(&self, key: &K) -> Option<V>
    where
        V: Clone,
    {
        self.lock().get(key).cloned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_values_up_to_its_bound_then_starts_again() {
        static M: Memo<u32, &str> = Memo::new(2);
        M.with_room().insert(1, "a");
        M.with_room().insert(2, "b");
        assert_eq!((M.get(&1), M.get(&2), M.get(&3)), (Some("a"), Some("b"), None));
        M.with_room().insert(3, "c");
        assert_eq!(
            (M.get(&1), M.get(&3)),
            (None, Some("c")),
            "full: emptied before the third key"
        );
        assert_eq!(M.lock().len(), 1);
    }
}
