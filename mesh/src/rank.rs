//! What a rank's closure receives ([`RankCtx`]) and may return ([`BoxError`]), as
//! every backend hands them over.

use crate::Communicator;

/// Any error a rank's closure returns (`?` converts every error type into it).
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What a rank's closure receives: its world communicator.
pub struct RankCtx {
    comm: Box<dyn Communicator>,
    job: u64,
}

impl RankCtx {
    pub(crate) fn new(comm: Box<dyn Communicator>, job: u64) -> RankCtx {
        RankCtx { comm, job }
    }
    /// This rank, `0..world_size`.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }
    /// Number of ranks in the job.
    pub fn world_size(&self) -> usize {
        self.comm.size()
    }
    /// The world communicator.
    pub fn comm(&self) -> &dyn Communicator {
        &*self.comm
    }
    /// Takes the world communicator (to build a [`DeviceMesh`](crate::DeviceMesh) over it).
    pub fn into_comm(self) -> Box<dyn Communicator> {
        self.comm
    }
    /// The job's process-unique number.
    pub fn job(&self) -> u64 {
        self.job
    }
}

/// The text of a panic payload (`&str` or `String`).
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic payload".into())
}
