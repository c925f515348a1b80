//! Element-wise ops: binary ops with broadcasting, unary ops, scalar ops.

use proptest::prelude::*;
use tessera::dtensor::{DTensor, Tensor};

use crate::harness::{Arg, check, config, float, plain, positive};
use crate::op;

/// Broadcasting pairs: trailing-dim vectors, size-1 dims on both sides, equal
/// shapes (even and uneven), a lower-rank left operand.
fn broadcast_pairs(rhs: fn(&[usize]) -> Arg) -> Vec<Vec<Arg>> {
    let pairs: [(&[usize], &[usize]); 8] = [
        (&[3, 5], &[5]),
        (&[3, 1], &[1, 5]),
        (&[5, 7], &[5, 7]),
        (&[4, 6], &[4, 6]),
        (&[2, 3, 4], &[3, 4]),
        (&[3, 5], &[3, 1]),
        (&[5], &[3, 5]),
        (&[2, 1, 4], &[3, 1]),
    ];
    pairs.iter().map(|(a, b)| vec![float(a), rhs(b)]).collect()
}

/// Shapes for one-input ops.
fn unary_shapes(kind: fn(&[usize]) -> Arg) -> Vec<Vec<Arg>> {
    [&[7][..], &[3, 5], &[4, 6], &[2, 3, 5]]
        .iter()
        .map(|s| vec![kind(s)])
        .collect()
}

/// Two operands of one shape (a gradient and an input).
fn pairs(kind: fn(&[usize]) -> Arg) -> Vec<Vec<Arg>> {
    [&[7][..], &[3, 5], &[4, 6], &[2, 3, 5]]
        .iter()
        .map(|s| vec![kind(s), kind(s)])
        .collect()
}

proptest! {
    #![proptest_config(config())]

    /// add, sub, mul, maximum and minimum with broadcasting.
    #[test]
    fn binary_ops(c in plain(broadcast_pairs(float))) {
        check(c, [
            op!("add", |x| x[0].add(&x[1])),
            op!("sub", |x| x[0].sub(&x[1])),
            op!("mul", |x| x[0].mul(&x[1])),
            op!("maximum", |x| x[0].maximum(&x[1])),
            op!("minimum", |x| x[0].minimum(&x[1])),
        ])?;
    }

    /// div with broadcasting, by a divisor away from zero.
    #[test]
    fn div(c in plain(broadcast_pairs(positive))) {
        check(c, [op!("div", |x| x[0].div(&x[1]))])?;
    }

    /// Unary ops on any real input.
    #[test]
    fn unary_ops(c in plain(unary_shapes(float))) {
        check(c, [
            op!("neg", |x| x[0].neg()),
            op!("exp", |x| x[0].exp()),
            op!("tanh", |x| x[0].tanh()),
            op!("gelu", |x| x[0].gelu()),
            op!("relu", |x| x[0].relu()),
            op!("silu", |x| x[0].silu()),
            op!("sigmoid", |x| x[0].sigmoid()),
            op!("abs", |x| x[0].abs()),
            op!("square", |x| x[0].square()),
            op!("pow(3)", |x| x[0].pow(3.0)),
            op!("clamp(-0.5, 0.5)", |x| x[0].clamp(Some(-0.5), Some(0.5))),
            op!("clamp(min 0.1)", |x| x[0].clamp(Some(0.1), None)),
        ])?;
    }

    /// GELU's backward given its output `gelu(x)`, as autograd calls it (a
    /// partial gradient stays partial). The output must be GELU's: with any
    /// other tensor `y / x` is ill-conditioned where `x` is small, and an input
    /// summed from partial pieces (one rounding off the full one) gives a
    /// different gradient there.
    #[test]
    fn gelu_backward_with_output(c in plain(pairs(float))) {
        check(c, [op!("gelu_backward_with_output", |x| x[0].gelu_backward_with_output(&x[1], &x[1].gelu()?))])?;
    }

    /// Unary ops defined on positive inputs.
    #[test]
    fn unary_positive_ops(c in plain(unary_shapes(positive))) {
        check(c, [
            op!("log", |x| x[0].log()),
            op!("sqrt", |x| x[0].sqrt()),
            op!("rsqrt", |x| x[0].rsqrt()),
            op!("pow(0.5)", |x| x[0].pow(0.5)),
        ])?;
    }

    /// Scalar ops (`Partial(sum)` inputs included: add_scalar must reduce first).
    #[test]
    fn scalar_ops(c in plain(unary_shapes(float))) {
        check(c, [
            op!("mul_scalar", |x| x[0].mul_scalar(2.5)),
            op!("div_scalar", |x| x[0].div_scalar(4.0)),
            op!("add_scalar", |x| x[0].add_scalar(1.5)),
            op!("sub_scalar", |x| x[0].sub_scalar(0.75)),
        ])?;
    }
}
