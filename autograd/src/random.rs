//! The random state of modules that draw as they run ([`nn::Dropout`](crate::nn::Dropout)):
//! a seed and a count of draws, per rank.
//!
//! Each draw takes the next [`StreamKey`] stream of the seed, so the masks of a
//! step depend only on the seed and the order of the draws, which every rank of
//! an SPMD program shares: ranks draw the same keys, and the counter-based
//! generator makes each rank's shard of a mask that of the full mask. A block
//! recomputed in backward ([`checkpoint`](crate::checkpoint)) replays the draws
//! of its forward, as PyTorch's `preserve_rng_state` does.
//!
//! ```
//! use tessera_autograd::random::{manual_seed, next_key};
//!
//! manual_seed(7);
//! let (a, b) = (next_key(), next_key());
//! assert_ne!(a, b);
//! manual_seed(7);
//! assert_eq!(next_key(), a);
//! ```

use std::cell::Cell;

use tessera_dtensor::StreamKey;

thread_local! {
    /// This rank's `(seed, draws so far)`.
    static STATE: Cell<(u64, u64)> = const { Cell::new((0, 0)) };
}

/// Seeds this rank's draws and restarts their count (call it with the same seed
/// on every rank).
///
/// PyTorch: `torch.manual_seed`.
pub fn manual_seed(seed: u64) {
    STATE.with(|s| s.set((seed, 0)));
}

/// The key of the next draw: stream `n` of the seed's key, for the `n`-th draw
/// since [`manual_seed`] (a rank that never seeded draws with seed 0).
pub fn next_key() -> StreamKey {
    STATE.with(|s| {
        let (seed, n) = s.get();
        s.set((seed, n + 1));
        StreamKey::new(seed, "tessera.dropout").with_stream(n)
    })
}

/// The state to restore for a replay.
pub(crate) fn state() -> (u64, u64) {
    STATE.with(Cell::get)
}

/// Sets the state back to `state` while a replay runs, and to what it was
/// before when dropped.
pub(crate) struct Replay((u64, u64));

impl Replay {
    pub(crate) fn from(state: (u64, u64)) -> Replay {
        Replay(STATE.with(|s| s.replace(state)))
    }
}

impl Drop for Replay {
    fn drop(&mut self) {
        STATE.with(|s| s.set(self.0));
    }
}
