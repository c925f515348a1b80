//! Checks that every rank called the same collective with compatible arguments.
//! Runs on every rank over the same descriptors, so all ranks report the same error.

use super::desc::{Counts, Desc};
use crate::comm::{Call, VArgs, check_call, check_v};
use crate::{Error, OpKind, Result};

/// `members[q]` is the world rank of group rank `q` (errors name world ranks).
/// `counts[q]` are rank `q`'s count arrays when every rank called a
/// variable-count collective (empty otherwise). Tags that both ranks set must
/// agree; with `strict`, call sites and tags must be equal too.
pub(crate) fn validate(d: &[Desc], counts: &[Counts], members: &[usize], strict: bool) -> Result<()> {
    let n = d.len();
    let first = &d[0];
    for (q, dq) in d.iter().enumerate().skip(1) {
        // Variable-count forms send different lengths from each rank; their
        // lengths are checked against the counts below.
        let same_call = dq.kind == first.kind
            && dq.v == first.v
            && dq.placed == first.placed
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
        if let (Some(a), Some(b)) = (&first.site, &dq.site) {
            let tags = a.tags_conflict(b) || (strict && a.tag != b.tag);
            if tags || (strict && !a.same_site(b)) {
                let why = if tags {
                    "the same collective about different things (their entry points' tags differ: \
                     e.g. clip_grad_norm over different parameters, a redistribute of another shape or placements)"
                } else {
                    "the same collective from different call sites (strict collectives: \
                     TESSERA_STRICT_COLLECTIVES / LaunchOptions::strict_collectives)"
                };
                return Err(Error::Mismatch {
                    detail: format!(
                        "rank {} called {first} but rank {} called {dq} (collective #{} of a group of {n}): {why}; \
                         every rank must issue the same collectives in the same order",
                        members[0], members[q], first.seq
                    ),
                });
            }
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
                // The runs form of all_to_all_v need not send all of its buffer.
                send_len: if dq.placed && dq.kind == OpKind::AllToAll {
                    c.send.iter().sum()
                } else {
                    dq.send_len
                },
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
