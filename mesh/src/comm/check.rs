//! The checks one rank can make on its own arguments to a fixed-size collective,
//! shared by every backend (the threads backend runs them over every rank's
//! arguments, the MPI backend over its own before calling into MPI).

use crate::{DType, Error, OpKind, Result};

/// One rank's arguments to a fixed-size collective.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Call {
    pub(crate) kind: OpKind,
    pub(crate) dtype: DType,
    pub(crate) recv_dtype: DType,
    pub(crate) send_len: usize,
    pub(crate) recv_len: usize,
    pub(crate) root: usize,
}

/// Checks `call` for a group of `n` ranks: matching dtypes, buffer lengths that fit
/// the collective, a root in range. `op` names the collective and `rank` the caller
/// in errors.
pub(crate) fn check_call(op: &'static str, call: &Call, n: usize, rank: usize) -> Result<()> {
    let has_recv = matches!(
        call.kind,
        OpKind::AllGather | OpKind::ReduceScatter | OpKind::AllToAll | OpKind::AllReduce
    );
    if has_recv && call.recv_dtype != call.dtype {
        return Err(Error::DTypeMismatch {
            op,
            send: call.dtype,
            recv: call.recv_dtype,
        });
    }
    let bad = |what, expected, got| Error::BadLength {
        op,
        rank,
        what,
        expected,
        got,
    };
    match call.kind {
        OpKind::AllGather if call.recv_len != n * call.send_len => {
            Err(bad("receive buffer", n * call.send_len, call.recv_len))
        }
        OpKind::ReduceScatter | OpKind::AllToAll if !call.send_len.is_multiple_of(n) => Err(bad(
            "send buffer (must be a multiple of the group size)",
            call.send_len.div_ceil(n) * n,
            call.send_len,
        )),
        OpKind::ReduceScatter if call.recv_len * n != call.send_len => {
            Err(bad("receive buffer", call.send_len / n, call.recv_len))
        }
        OpKind::AllToAll | OpKind::AllReduce if call.recv_len != call.send_len => {
            Err(bad("receive buffer", call.send_len, call.recv_len))
        }
        OpKind::Broadcast if call.root >= n => Err(Error::InvalidRank {
            op,
            rank: call.root,
            size: n,
        }),
        _ => Ok(()),
    }
}
