//! Candidate generators: einsum-style contractions, element-wise ops with
//! broadcasting and the linearity rules for `Partial`, and reductions.

use smallvec::{SmallVec, smallvec};

use tessera_tensor::Error as TensorError;

#[cfg(test)]
use super::Candidate;
use super::{Candidates, DimOption, product};
use crate::{Error, Placement, ReduceOp, Result};

type Options = Vec<DimOption>;

/// How an element-wise op treats pending reductions (`Partial` inputs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Linearity {
    /// Not linear: inputs must be reduced first (exp, gelu, ...).
    None,
    /// Linear in all inputs together: partial sums add (add, sub, neg, scale).
    Additive,
    /// Linear in each input separately: one partial input times replicated others (mul).
    Multiplicative,
    /// Linear in the first input only: a partial numerator over a replicated divisor (div).
    FirstOnly,
}

const LINEAR_OPS: [ReduceOp; 2] = [ReduceOp::Sum, ReduceOp::Avg];

fn replicate_all(n: usize) -> DimOption {
    (smallvec![Placement::Replicate; n], Placement::Replicate)
}

/// Options on one mesh dim for `Partial` inputs of a linear op.
fn partial_options(n: usize, linearity: Linearity) -> Options {
    let mut out = Options::new();
    for op in LINEAR_OPS {
        let p = Placement::Partial(op);
        match linearity {
            Linearity::None => {}
            Linearity::Additive => out.push((smallvec![p; n], p)),
            Linearity::Multiplicative | Linearity::FirstOnly => {
                let which = if linearity == Linearity::FirstOnly { 1 } else { n };
                for i in 0..which {
                    let mut ins: SmallVec<[Placement; 3]> = smallvec![Placement::Replicate; n];
                    ins[i] = p;
                    out.push((ins, p));
                }
            }
        }
    }
    out
}

/// Candidates for an einsum-style contraction, e.g. `"mk,kn->mn"` (matmul) or
/// `"bmk,bkn->bmn"`. Letters are single ASCII letters; each input's letters name
/// its dims. On each mesh dim: everything replicated; an output letter sharded in
/// every input that has it; a contracted letter sharded in every input that has it,
/// giving `Partial(sum)`; and (the op being linear in each operand) one partial
/// operand with the others replicated, staying partial.
///
/// PyTorch: `torch.distributed.tensor._ops._einsum_strategy.gen_einsum_strategies`.
///
/// # Errors
/// A malformed spec (no `->`, an output letter absent from the inputs, a repeated letter).
pub(crate) fn einsum(spec: &str, mesh_ndim: usize) -> Result<Candidates> {
    let bad = |detail: String| {
        Error::from(TensorError::InvalidArgument {
            op: "einsum strategy",
            detail,
        })
    };
    let (lhs, out) = spec
        .split_once("->")
        .ok_or_else(|| bad(format!("{spec:?} has no \"->\"")))?;
    let inputs: Vec<&str> = lhs.split(',').collect();
    let all: Vec<&str> = inputs.iter().copied().chain([out]).collect();
    for s in &all {
        let mut seen = String::new();
        for c in s.chars() {
            if !c.is_ascii_alphabetic() || seen.contains(c) {
                return Err(bad(format!("{spec:?}: {s:?} must be distinct ASCII letters")));
            }
            seen.push(c);
        }
    }
    if let Some(c) = out.chars().find(|&c| !inputs.iter().any(|i| i.contains(c))) {
        return Err(bad(format!("{spec:?}: output letter {c:?} is in no input")));
    }
    let n = inputs.len();
    let mut options = vec![replicate_all(n)];
    let mut letters: Vec<char> = Vec::new();
    for c in inputs.iter().flat_map(|s| s.chars()) {
        if !letters.contains(&c) {
            letters.push(c);
        }
    }
    for c in letters {
        let ins: SmallVec<[Placement; 3]> = inputs
            .iter()
            .map(|s| s.find(c).map_or(Placement::Replicate, Placement::Shard))
            .collect();
        let o = out.find(c).map_or(Placement::Partial(ReduceOp::Sum), Placement::Shard);
        options.push((ins, o));
    }
    options.extend(partial_options(n, Linearity::Multiplicative));
    Ok(product(&vec![options; mesh_ndim], n))
}

/// Candidates for an element-wise op over inputs of `shapes` broadcast to `out`
/// (NumPy rules: shapes right-aligned, size-1 dims stretch). On each mesh dim:
/// everything replicated; an output dim sharded in every input where that dim is
/// not broadcast (broadcast inputs replicated); and the `Partial` options that
/// `linearity` allows.
pub(crate) fn pointwise(shapes: &[&[usize]], out: &[usize], mesh_ndim: usize, linearity: Linearity) -> Candidates {
    let n = shapes.len();
    let mut options = vec![replicate_all(n)];
    for d in 0..out.len() {
        let ins: SmallVec<[Placement; 3]> = shapes
            .iter()
            .map(|s| {
                let lead = out.len() - s.len();
                match d.checked_sub(lead) {
                    Some(di) if s[di] == out[d] => Placement::Shard(di),
                    _ => Placement::Replicate,
                }
            })
            .collect();
        options.push((ins, Placement::Shard(d)));
    }
    options.extend(partial_options(n, linearity));
    product(&vec![options; mesh_ndim], n)
}

/// Candidates for a one-input op that needs dims `whole` unsplit (softmax along a
/// dim, layer_norm over the last dims): other dims keep their shards; no `Partial`.
pub(crate) fn keep_shards_except(rank: usize, whole: &[usize], mesh_ndim: usize) -> Candidates {
    keep_shards_except_with(rank, whole, 1, 0, mesh_ndim)
}

/// [`keep_shards_except`] for `sharded` inputs of one shape that split alike (a
/// gradient and the forward value or output it belongs to), followed by
/// `replicated` inputs that every candidate replicates (layer norm's weight and
/// bias); the output splits as the sharded inputs do.
pub(crate) fn keep_shards_except_with(
    rank: usize,
    whole: &[usize],
    sharded: usize,
    replicated: usize,
    mesh_ndim: usize,
) -> Candidates {
    let n = sharded + replicated;
    let shard = |d| -> DimOption {
        let ins = (0..n).map(|i| {
            if i < sharded {
                Placement::Shard(d)
            } else {
                Placement::Replicate
            }
        });
        (ins.collect(), Placement::Shard(d))
    };
    let mut options = vec![replicate_all(n)];
    options.extend((0..rank).filter(|d| !whole.contains(d)).map(shard));
    product(&vec![options; mesh_ndim], n)
}

/// Candidates for a reduction of an input of rank `rank` over `dims` with `op`
/// (Sum, Max or Min; a mean is a sum scaled by the global count): a shard of a
/// reduced dim gives `Partial(op)`, a shard of a kept dim stays (renumbered unless
/// `keepdim`), and a `Partial(op)` input stays partial.
pub(crate) fn reduction(rank: usize, dims: &[usize], keepdim: bool, op: ReduceOp, mesh_ndim: usize) -> Candidates {
    let mut options = vec![replicate_all(1)];
    for d in 0..rank {
        let out = if dims.contains(&d) {
            Placement::Partial(op)
        } else if keepdim {
            Placement::Shard(d)
        } else {
            Placement::Shard(d - dims.iter().filter(|&&r| r < d).count())
        };
        options.push((smallvec![Placement::Shard(d)], out));
    }
    options.push((smallvec![Placement::Partial(op)], Placement::Partial(op)));
    product(&vec![options; mesh_ndim], 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Placement::{Partial, Replicate as R, Shard as S};

    const SUM: Placement = Partial(ReduceOp::Sum);

    fn has(cands: &[Candidate], ins: &[&[Placement]], out: &[Placement]) -> bool {
        cands
            .iter()
            .any(|c| c.output.as_slice() == out && c.inputs.iter().zip(ins).all(|(a, b)| a.as_slice() == *b))
    }

    #[test]
    fn matmul_rules() {
        let c = einsum("mk,kn->mn", 1).unwrap();
        macro_rules! case {
            ($a:expr, $b:expr => $o:expr) => {
                assert!(has(&c, &[&$a, &$b], &$o), "{:?} x {:?} -> {:?}", $a, $b, $o);
            };
        }
        case!([S(0)], [R] => [S(0)]);
        case!([R], [S(1)] => [S(1)]);
        case!([S(1)], [S(0)] => [SUM]);
        case!([SUM], [R] => [SUM]);
        case!([R], [SUM] => [SUM]);
        case!([R], [R] => [R]);
        assert!(!has(&c, &[&[SUM], &[SUM]], &[SUM]), "partial x partial is not partial");
        assert_eq!(einsum("mk,kn->mn", 2).unwrap().len(), c.len() * c.len());
    }

    #[test]
    fn einsum_errors() {
        for bad in ["mk,kn", "mk,kn->mz", "mm,kn->mn", "m1,kn->mn"] {
            assert!(einsum(bad, 1).is_err(), "{bad}");
        }
    }

    #[test]
    fn pointwise_broadcasting() {
        let c = pointwise(&[&[4, 3], &[3]], &[4, 3], 1, Linearity::Additive);
        assert!(has(&c, &[&[S(0)], &[R]], &[S(0)]), "the broadcast input is replicated");
        assert!(has(&c, &[&[S(1)], &[S(0)]], &[S(1)]));
        assert!(has(&c, &[&[SUM], &[SUM]], &[SUM]));
        let c = pointwise(&[&[4, 1], &[4, 3]], &[4, 3], 1, Linearity::Multiplicative);
        assert!(has(&c, &[&[R], &[S(1)]], &[S(1)]), "a size-1 dim is not sharded");
        assert!(has(&c, &[&[SUM], &[R]], &[SUM]) && has(&c, &[&[R], &[SUM]], &[SUM]));
        assert!(!has(&c, &[&[SUM], &[SUM]], &[SUM]));
        let c = pointwise(&[&[4], &[4]], &[4], 1, Linearity::FirstOnly);
        assert!(has(&c, &[&[SUM], &[R]], &[SUM]) && !has(&c, &[&[R], &[SUM]], &[SUM]));
        let c = pointwise(&[&[4]], &[4], 1, Linearity::None);
        assert!(c.iter().all(|c| !c.inputs[0].iter().any(|p| p.is_partial())));
    }

    #[test]
    fn reductions() {
        let c = reduction(3, &[1], false, ReduceOp::Sum, 1);
        assert!(has(&c, &[&[S(1)]], &[SUM]));
        assert!(has(&c, &[&[S(2)]], &[S(1)]));
        assert!(has(&c, &[&[S(0)]], &[S(0)]));
        assert!(has(&c, &[&[SUM]], &[SUM]));
        let c = reduction(3, &[1], true, ReduceOp::Max, 1);
        assert!(has(&c, &[&[S(2)]], &[S(2)]));
        assert!(has(&c, &[&[S(1)]], &[Partial(ReduceOp::Max)]));
        let c = keep_shards_except(3, &[2], 2);
        assert!(has(&c, &[&[S(0), S(1)]], &[S(0), S(1)]));
        assert!(c.iter().all(|c| !c.inputs[0].contains(&S(2))));
        // Two inputs split alike and one replicated: replicate or shard dim 0 on each of 2 mesh dims.
        let c = keep_shards_except_with(3, &[1, 2], 2, 1, 2);
        assert_eq!(c.len(), 4);
        assert!(has(&c, &[&[S(0), R], &[S(0), R], &[R, R]], &[S(0), R]));
        assert!(has(&c, &[&[S(0), S(0)], &[S(0), S(0)], &[R, R]], &[S(0), S(0)]));
        assert!(
            c.iter()
                .all(|c| c.inputs[0] == c.inputs[1] && c.inputs[2].iter().all(|&p| p == R))
        );
    }
}
