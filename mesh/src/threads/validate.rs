//! Checks that every rank called the same collective with compatible arguments.
//! Runs on every rank over the same descriptors, so all ranks report the same error.

use super::desc::{Counts, Desc};
use crate::comm::{Call, VArgs, check_call, check_v};
use crate::{Error, Result};

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
        if !dq.v {
            let call = Call {
                kind: dq.kind,
                dtype: dq.dtype,
                recv_dtype: dq.recv_dtype,
                send_len: dq.send_len,
                recv_len: dq.recv_len,
                root: dq.root,
            };
            check_call(op, &call, n, members[q])?;
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
