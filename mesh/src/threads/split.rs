//! `split` on the threads backend ([`split_group`]): ranks of a group with the same color form a
//! new group.

use std::sync::Arc;

use super::desc::Desc;
use super::group::Group;
use super::sync::lock;
use crate::{OpKind, Result};

/// Splits `group`: ranks with the same color form a new group ordered by (key, rank).
/// Returns the new group and group rank `r`'s rank in it.
///
/// The first member to get here makes the new group and leaves it in the parent
/// group's pending splits, keyed by the split's sequence number and the color, for
/// the other members to pick up.
pub(crate) fn split_group(group: &Arc<Group>, r: usize, color: u32, key: u32) -> Result<(Arc<Group>, usize)> {
    let mut d = Desc::new(OpKind::Split);
    d.color = color;
    d.key = key;
    let (descs, done) = group.enter(r, d)?;
    done.finish()?;
    let seq = descs[r].seq;
    let mut mine: Vec<(u32, usize)> = descs
        .iter()
        .enumerate()
        .filter(|(_, dq)| dq.color == color)
        .map(|(q, dq)| (dq.key, q))
        .collect();
    mine.sort_unstable();
    let new_rank = mine.iter().position(|&(_, q)| q == r).unwrap_or(0);
    let members: Vec<usize> = mine.iter().map(|&(_, q)| group.members[q]).collect();
    let n = members.len();
    let k = (seq, color);
    let mut splits = lock(&group.splits);
    let g = if let Some(i) = splits.iter().position(|e| e.0 == k) {
        let g = splits[i].1.clone();
        splits[i].2 -= 1;
        if splits[i].2 == 0 {
            splits.swap_remove(i);
        }
        g
    } else {
        let g = Group::new(group.world.clone(), members);
        if n > 1 {
            splits.push((k, g.clone(), n - 1));
        }
        g
    };
    Ok((g, new_rank))
}
