//! View-like ops: transpose, permute, reshape, narrow, cat (bit-exact unless a
//! partial input was split into random pieces).

use proptest::prelude::*;
use tessera::dtensor::{DTensor, Tensor};

use crate::harness::{Op, cases, check, config, float, plain, singles};
use crate::op;

/// Every permutation of `0..n`.
fn permutations(n: usize) -> Vec<Vec<usize>> {
    if n == 0 {
        return vec![vec![]];
    }
    let mut out = Vec::new();
    for p in permutations(n - 1) {
        for i in 0..=p.len() {
            let mut q = p.clone();
            q.insert(i, n - 1);
            out.push(q);
        }
    }
    out
}

proptest! {
    #![proptest_config(config())]

    /// transpose of every pair of dims (itself included) and every permute.
    #[test]
    fn transpose_permute(c in plain(singles(&[&[3, 5], &[4, 6], &[2, 3, 4], &[3, 5, 7]]))) {
        let rank = c.args[0].shape.len();
        let perms = permutations(rank);
        let mut ops: Vec<Op> = Vec::new();
        for a in 0..rank {
            for b in a..rank {
                ops.push(op!(format!("transpose({a}, {b})"), |x| x[0].transpose(a, b)).exact());
            }
        }
        for p in &perms {
            ops.push(op!(format!("permute({p:?})"), [p], |x| x[0].permute(&p)).exact());
        }
        check(c, ops)?;
    }

    /// reshape: merging and splitting dims after a leading dim, size-1 dims, and
    /// shapes where no dim survives.
    #[test]
    fn reshape(c in cases(vec![
        (vec![vec![2, 12], vec![6, 4], vec![4, 3, 2], vec![24], vec![2, 3, 4]], vec![float(&[2, 3, 4])]),
        (vec![vec![2, 3, 4], vec![24], vec![4, 6]], vec![float(&[6, 4])]),
        (vec![vec![15], vec![3, 1, 5], vec![5, 3]], vec![float(&[3, 5])]),
        (vec![vec![3, 5]], vec![float(&[3, 1, 5])]),
        (vec![vec![3, 35], vec![15, 7], vec![105], vec![7, 5, 3]], vec![float(&[3, 5, 7])]),
        (vec![vec![3, 5], vec![5, 3]], vec![float(&[15])]),
    ])) {
        let ops: Vec<Op> = c
            .param
            .iter()
            .map(|s| op!(format!("reshape({s:?})"), [s], |x| x[0].reshape(&s)).exact())
            .collect();
        check(c, ops)?;
    }

    /// narrow of every dim: whole, from 1, the back half, the last entry, empty.
    #[test]
    fn narrow(c in plain(singles(&[&[7], &[3, 5], &[4, 6], &[2, 3, 5]]))) {
        let mut ranges = Vec::new();
        for (d, &n) in c.args[0].shape.iter().enumerate() {
            for (start, len) in [(0, n), (1, n - 1), (n / 2, n - n / 2), (n - 1, 1), (0, 0), (n, 0)] {
                ranges.push((d, start, len));
            }
        }
        let ops: Vec<Op> = ranges
            .iter()
            .map(|&(d, s, l)| op!(format!("narrow({d}, {s}, {l})"), |x| x[0].narrow(d, s, l)).exact())
            .collect();
        check(c, ops)?;
    }

    /// cat of two and three inputs along each dim.
    #[test]
    fn cat(c in cases(vec![
        (0, vec![float(&[3, 5]), float(&[2, 5])]),
        (1, vec![float(&[3, 5]), float(&[3, 2])]),
        (0, vec![float(&[3, 5]), float(&[3, 5]), float(&[1, 5])]),
        (1, vec![float(&[2, 3, 4]), float(&[2, 1, 4]), float(&[2, 5, 4])]),
        (2, vec![float(&[2, 3, 4]), float(&[2, 3, 3])]),
        (0, vec![float(&[4, 6]), float(&[4, 6]), float(&[4, 6])]),
    ])) {
        let dim = c.param;
        let dist = move |x: &[DTensor]| DTensor::cat(&x.iter().collect::<Vec<_>>(), dim);
        let local = move |x: &[Tensor]| Tensor::cat(x, dim);
        check(c, [Op::new(format!("cat(dim {dim})"), dist, local).exact()])?;
    }
}
