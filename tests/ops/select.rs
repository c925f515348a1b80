//! Selection, splitting and stacking: where_cond, masked_fill, index_select,
//! gather (and their scatter-add gradients), argmax/argmin, split, chunk, stack.
//! Masks are drawn as 0/1 indices and cast to `u8` inside the op.

use proptest::prelude::*;
use tessera::dtensor::{DTensor, DType, Tensor};

use crate::harness::{Op, cases, check, config, float, index, plain, singles};
use crate::op;

proptest! {
    #![proptest_config(config())]

    /// where_cond with a broadcast mask and a broadcast `y`, and masked_fill.
    #[test]
    fn where_and_masked_fill(c in plain(vec![
        vec![index(&[3, 4], 2), float(&[3, 4]), float(&[4])],
        vec![index(&[4], 2), float(&[2, 3, 4]), float(&[2, 3, 4])],
        vec![index(&[2, 1, 5], 2), float(&[2, 3, 5]), float(&[1])],
    ])) {
        check(c, [
            op!("where_cond", |x| x[0].cast(DType::U8)?.where_cond(&x[1], &x[2])).exact(),
            op!("masked_fill", |x| x[1].masked_fill(&x[0].cast(DType::U8)?, -3.5)).exact(),
        ])?;
    }

    /// index_select along a dim with repeated indices (param: the dim).
    #[test]
    fn index_select(c in cases(vec![
        (0, vec![float(&[5, 4]), index(&[6], 5)]),
        (1, vec![float(&[5, 4]), index(&[3], 4)]),
        (2, vec![float(&[2, 3, 5]), index(&[7], 5)]),
    ])) {
        let dim = c.param;
        check(c, [op!("index_select", |x| x[0].index_select(dim, &x[1])).exact()])?;
    }

    /// index_select's backward, the gradient `[.., n, ..]` added into `size`
    /// slices (param: the dim and the size).
    #[test]
    fn index_select_backward(c in cases(vec![
        ((0, 4), vec![float(&[6, 3]), index(&[6], 4)]),
        ((1, 5), vec![float(&[2, 4, 3]), index(&[4], 5)]),
    ])) {
        let (dim, size) = c.param;
        check(c, [op!("index_select_backward", |x| x[0].index_select_backward(dim, &x[1], size))])?;
    }

    /// gather along a dim with an index smaller off it (param: the dim).
    #[test]
    fn gather(c in cases(vec![
        (1, vec![float(&[4, 5]), index(&[4, 3], 5)]),
        (0, vec![float(&[4, 5]), index(&[6, 5], 4)]),
        (2, vec![float(&[2, 3, 4]), index(&[2, 2, 6], 4)]),
    ])) {
        let dim = c.param;
        check(c, [op!("gather", |x| x[0].gather(dim, &x[1])).exact()])?;
    }

    /// gather's backward into a tensor of the given shape (param: dim, shape).
    #[test]
    fn gather_backward(c in cases(vec![
        ((1, vec![4, 5]), vec![float(&[4, 3]), index(&[4, 3], 5)]),
        ((0, vec![3, 5]), vec![float(&[6, 5]), index(&[6, 5], 3)]),
    ])) {
        let (dim, shape) = c.param.clone();
        check(c, [op!("gather_backward", [shape], |x| x[0].gather_backward(dim, &x[1], &shape))])?;
    }

    /// argmax and argmin along every dim, with and without keepdim.
    #[test]
    fn argmax_argmin(c in plain(singles(&[&[5, 4], &[3, 4, 5]]))) {
        let rank = c.args[0].shape.len();
        let mut ops: Vec<Op> = Vec::new();
        for dim in 0..rank {
            for keep in [false, true] {
                ops.push(op!(format!("argmax({dim}, {keep})"), |x| x[0].argmax(dim, keep)).exact());
                ops.push(op!(format!("argmin({dim}, {keep})"), |x| x[0].argmin(dim, keep)).exact());
            }
        }
        check(c, ops)?;
    }

    /// Every piece of split and chunk, and stack along each dim.
    #[test]
    fn split_chunk_stack(c in plain(vec![vec![float(&[5, 4]), float(&[5, 4])], vec![float(&[3, 7]), float(&[3, 7])]])) {
        let rank = c.args[0].shape.len();
        let mut ops: Vec<Op> = Vec::new();
        for dim in 0..rank {
            let n = c.args[0].shape[dim];
            for i in 0..n.div_ceil(2) {
                ops.push(op!(format!("split(2, {dim})[{i}]"), |x| Ok(x[0].split(2, dim)?.swap_remove(i))).exact());
            }
            for i in 0..n.div_ceil(n.div_ceil(3)) {
                ops.push(op!(format!("chunk(3, {dim})[{i}]"), |x| Ok(x[0].chunk(3, dim)?.swap_remove(i))).exact());
            }
        }
        for dim in 0..=rank {
            ops.push(
                Op::new(
                    format!("stack({dim})"),
                    move |x: &[DTensor]| DTensor::stack(&[&x[0], &x[1]], dim),
                    move |x: &[Tensor]| Tensor::stack(x, dim),
                )
                .exact(),
            );
        }
        check(c, ops)?;
    }
}
