//! What one rank asked a collective to do ([`Desc`]), published so that peers can
//! check it and read the buffers it names.

use std::fmt;

use smallvec::SmallVec;

use crate::callsite::CallSite;
use crate::{DType, OpKind, ReduceOp};

/// What one rank asked a collective to do; published so peers can check it and
/// read the buffers it names.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Desc {
    pub(crate) kind: OpKind,
    pub(crate) seq: u64,
    pub(crate) dtype: DType,
    pub(crate) recv_dtype: DType,
    pub(crate) send_ptr: usize,
    pub(crate) send_len: usize,
    /// When the send buffer is [`Pieces`](crate::Pieces): the address and length
    /// of its run table (`(address, elements)`, address 0 for zeros), which
    /// `send_ptr` then does not name.
    pub(crate) runs: (usize, usize),
    pub(crate) recv_ptr: usize,
    pub(crate) recv_len: usize,
    pub(crate) root: usize,
    pub(crate) reduce: Option<ReduceOp>,
    pub(crate) color: u32,
    pub(crate) key: u32,
    /// The variable-count form of `kind` (`all_gather_v`, ...): its counts are
    /// published beside the descriptor ([`Group::enter_v`](super::group::Group::enter_v)).
    pub(crate) v: bool,
    /// The runs form of a variable-count collective (`all_to_all_v_runs`):
    /// each receiver reads runs of its peers' buffers where they lie.
    pub(crate) placed: bool,
    /// Where the rank issued the collective ([`callsite`](crate::callsite)), when known.
    pub(crate) site: Option<CallSite>,
}

impl Desc {
    pub(crate) fn new(kind: OpKind) -> Desc {
        Desc {
            kind,
            seq: 0,
            dtype: DType::U8,
            recv_dtype: DType::U8,
            send_ptr: 0,
            send_len: 0,
            runs: (0, 0),
            recv_ptr: 0,
            recv_len: 0,
            root: 0,
            reduce: None,
            color: 0,
            key: 0,
            v: false,
            placed: false,
            site: None,
        }
    }

    /// The collective's name (`"all_gather_v"` for the variable-count forms).
    pub(crate) fn name(&self) -> &'static str {
        if self.placed {
            crate::comm::runs_name(self.kind)
        } else if self.v {
            crate::comm::v_name(self.kind)
        } else {
            self.kind.name()
        }
    }
}

impl Default for Desc {
    fn default() -> Self {
        Desc::new(OpKind::Barrier)
    }
}

impl fmt::Display for Desc {
    /// The call, then ` at file:line:col` when its call site is known.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.fmt_call(f)?;
        match &self.site {
            Some(site) => write!(f, " at {site}"),
            None => Ok(()),
        }
    }
}

impl Desc {
    fn fmt_call(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (s, r, d) = (self.send_len, self.recv_len, self.dtype);
        match self.kind {
            OpKind::AllGather | OpKind::AllToAll => {
                write!(f, "{}(send {s} × {d}, recv {r} × {})", self.name(), self.recv_dtype)
            }
            OpKind::ReduceScatter => write!(
                f,
                "{}({}, send {s} × {d}, recv {r} × {})",
                self.name(),
                self.reduce.unwrap_or(ReduceOp::Sum),
                self.recv_dtype
            ),
            OpKind::AllReduce => write!(f, "all_reduce({}, {s} × {d})", self.reduce.unwrap_or(ReduceOp::Sum)),
            OpKind::Broadcast => write!(f, "broadcast(root {}, {s} × {d})", self.root),
            OpKind::Barrier => f.write_str("barrier()"),
            OpKind::Split => write!(f, "split(color {}, key {})", self.color, self.key),
        }
    }
}

/// The descriptors of every rank for the collective being run.
pub(crate) type Descs = SmallVec<[Desc; 8]>;

/// The count arrays one rank passed to a variable-count collective (`recv` is
/// empty except for `all_to_all_v`).
#[derive(Clone, Debug, Default)]
pub(crate) struct Counts {
    pub(crate) send: Vec<usize>,
    pub(crate) recv: Vec<usize>,
}
