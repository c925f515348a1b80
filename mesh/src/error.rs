//! The error type of `tessera-mesh`.

use std::time::Duration;

use crate::DType;

/// Errors from communicators, launchers and meshes.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Another rank failed (returned an error, panicked, timed out or exited early),
    /// and the group is poisoned: every later collective fails the same way.
    #[error("rank {rank} failed: {reason}")]
    PeerFailed {
        /// World rank that failed first.
        rank: usize,
        /// What happened to it.
        reason: String,
    },

    /// Ranks entered different collectives, or the same one with incompatible
    /// arguments. The message describes both sides.
    #[error("collective mismatch: {detail}")]
    Mismatch {
        /// Both sides of the disagreement.
        detail: String,
    },

    /// A buffer has the wrong number of elements for the collective.
    #[error("{op} on rank {rank}: {what} holds {got} elements, expected {expected}")]
    BadLength {
        /// The collective.
        op: &'static str,
        /// This rank (in the communicator).
        rank: usize,
        /// Which buffer.
        what: &'static str,
        /// Elements expected.
        expected: usize,
        /// Elements given.
        got: usize,
    },

    /// Input and output buffers of one call have different dtypes.
    #[error("{op}: send buffer is {send} but receive buffer is {recv}; both must have the same dtype")]
    DTypeMismatch {
        /// The collective.
        op: &'static str,
        /// Dtype of the send buffer.
        send: DType,
        /// Dtype of the receive buffer.
        recv: DType,
    },

    /// The reduction is not defined for the dtype.
    #[error("{op}: reduction {reduce} is not defined for {dtype}{hint}")]
    UnsupportedReduction {
        /// The collective.
        op: &'static str,
        /// The reduction asked for.
        reduce: crate::ReduceOp,
        /// The buffer's dtype.
        dtype: DType,
        /// What to do instead.
        hint: &'static str,
    },

    /// A root or peer rank outside the communicator.
    #[error("{op}: rank {rank} is out of range for a communicator of size {size}")]
    InvalidRank {
        /// The operation.
        op: &'static str,
        /// The offending rank.
        rank: usize,
        /// Communicator size.
        size: usize,
    },

    /// A rank's closure failed (returned an error or panicked); reported by `launch`.
    #[error("rank {rank} failed: {source}")]
    RankFailed {
        /// World rank that failed first.
        rank: usize,
        /// Its error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },

    /// This rank waited too long for peers that never arrived. `stalled` is the
    /// rank found not progressing: a missing peer itself, or the rank a missing
    /// peer waits on (through collectives of other groups); `detail` says who
    /// waits on whom and what the stalled rank last did.
    #[error(
        "timed out after {after:?} in {op} (collective #{seq} of this group) waiting on rank(s) {missing:?}; \
         rank {stalled} is not progressing: {detail}; raise the timeout (TESSERA_TIMEOUT_S) if it is only slow"
    )]
    Timeout {
        /// The collective.
        op: &'static str,
        /// Sequence number of the collective in its group.
        seq: u64,
        /// World ranks that had not arrived.
        missing: Vec<usize>,
        /// How long this rank waited.
        after: Duration,
        /// World rank found not progressing (the one to look at).
        stalled: usize,
        /// The waits leading from `missing` to `stalled`, and what `stalled` last did.
        detail: String,
    },

    /// A run of a local runs copy ([`copy_runs`](crate::copy_runs)) that
    /// reaches past the buffer it names.
    #[error("{op}: a run ends at element {end}, past the {what} of {len} elements")]
    RunOutside {
        /// The call.
        op: &'static str,
        /// Which buffer.
        what: &'static str,
        /// Where the run ends (elements).
        end: usize,
        /// The buffer's elements.
        len: usize,
    },

    /// A mesh that cannot be built or sliced as asked.
    #[error("invalid mesh: {0}")]
    Mesh(String),

    /// A device name that is not one (`"gpu"` for `"cuda"`).
    #[error("invalid device: {0}")]
    Device(String),

    /// Bad launch arguments or a backend that could not start.
    #[error("launch: {0}")]
    Launch(String),

    /// The MPI library returned an error from a call.
    #[error("{op} on rank {rank}: MPI error: {reason}")]
    Mpi {
        /// The collective.
        op: &'static str,
        /// Rank in the communicator.
        rank: usize,
        /// The library's message and error code.
        reason: String,
    },

    /// The backend's communication thread went away.
    #[error("communication thread of rank {rank} stopped: {reason}")]
    Backend {
        /// Rank in the communicator.
        rank: usize,
        /// What happened.
        reason: String,
    },
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
