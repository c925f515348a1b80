//! Checks that every rank called the same collective with compatible arguments.
//! Runs on every rank over the same descriptors, so all ranks report the same error.

use super::group::{Counts, Desc};
use crate::comm::{VArgs, check_v};
use crate::{Error, OpKind, Result};

/// `members[q]` is the world rank of group rank `q` (errors name world ranks).
/// `counts[q]` are rank `q`'s count arrays when every rank called a
/// variable-count collective (empty otherwise).
pub(crate) fn validate(d: &[Desc], counts: &[Counts], members: &[usize]) -> Result<()> {
    let n = d.len();
    let first = &d[0];
    for (q, dq) in d.iter().enumerate().skip(1) {
        // Variable-count forms send different lengths from each rank; their
        // lengths are checked against the counts below.
        let same_call = dq.kind == first.kind
            && dq.v == first.v
            && dq.dtype == first.dtype
            && (first.v || dq.send_len == first.send_len)
            && dq.reduce == first.reduce
            && dq.root == first.root;
        if !same_call {
            return Err(Error::Mismatch {
                detail: format!(
                    "rank {} called {first} but rank {} called {dq} (collective #{} of a group of {n}); every rank must issue the same collectives in the same order",
                    members[0], members[q], first.seq
                ),
            });
        }
    }
    let op = first.name();
    for (q, dq) in d.iter().enumerate() {
        let has_recv = matches!(
            dq.kind,
            OpKind::AllGather | OpKind::ReduceScatter | OpKind::AllToAll | OpKind::AllReduce
        );
        if has_recv && dq.recv_dtype != dq.dtype {
            return Err(Error::DTypeMismatch {
                op,
                send: dq.dtype,
                recv: dq.recv_dtype,
            });
        }
        let bad = |what, expected, got| Error::BadLength {
            op,
            rank: members[q],
            what,
            expected,
            got,
        };
        match dq.kind {
            _ if dq.v => {}
            OpKind::AllGather if dq.recv_len != n * dq.send_len => {
                return Err(bad("receive buffer", n * dq.send_len, dq.recv_len));
            }
            OpKind::ReduceScatter | OpKind::AllToAll if !dq.send_len.is_multiple_of(n) => {
                return Err(bad(
                    "send buffer (must be a multiple of the group size)",
                    dq.send_len.div_ceil(n) * n,
                    dq.send_len,
                ));
            }
            OpKind::ReduceScatter if dq.recv_len * n != dq.send_len => {
                return Err(bad("receive buffer", dq.send_len / n, dq.recv_len));
            }
            OpKind::AllToAll | OpKind::AllReduce if dq.recv_len != dq.send_len => {
                return Err(bad("receive buffer", dq.send_len, dq.recv_len));
            }
            OpKind::Broadcast if dq.root >= n => {
                return Err(Error::InvalidRank {
                    op,
                    rank: dq.root,
                    size: n,
                });
            }
            _ => {}
        }
    }
    if first.v {
        let args: Vec<VArgs<'_>> = d
            .iter()
            .zip(counts)
            .map(|(dq, c)| VArgs {
                send_len: dq.send_len,
                recv_len: dq.recv_len,
                counts: &c.send,
                recv_counts: &c.recv,
            })
            .collect();
        check_v(first.kind, &args, |q| members[q])?;
    }
    if let Some(reduce) = first.reduce {
        reduce.check(op, first.dtype)?;
    }
    Ok(())
}
