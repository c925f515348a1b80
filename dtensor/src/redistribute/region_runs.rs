//! The contiguous runs of a region of a row-major tensor, for readers that
//! fetch one rank's piece of a file.

use tessera_tensor::Error as TensorError;

use crate::spec::Region;
use crate::{Error, Result};

/// Calls `f(at, into, len)` for each maximal contiguous run of the region
/// `[offset, offset + shape)` of a row-major tensor of `global_shape`, in
/// row-major order: `at` is the run's first element in the tensor, `into` its
/// first element in the region (itself row-major), `len` its length. Trailing
/// dims the region holds whole merge into one run, so a region of whole rows is
/// a single run; a scalar is one run of 1, an empty region has none.
///
/// What a reader of a row-major file needs to fetch only one rank's piece
/// ([`Layout::local_region`](crate::Layout::local_region)): one positioned read
/// per run.
///
/// ```
/// use tessera_dtensor::redistribute::for_each_region_run;
///
/// let mut runs = Vec::new();
/// // Rows 1..3, columns 2..5 of a 4×6 matrix: one run per row.
/// for_each_region_run(&[4, 6], &[1, 2], &[2, 3], |at, into, len| runs.push((at, into, len)))?;
/// assert_eq!(runs, [(8, 0, 3), (14, 3, 3)]);
/// runs.clear();
/// // Rows 1..3, whole: one run.
/// for_each_region_run(&[4, 6], &[1, 0], &[2, 6], |at, into, len| runs.push((at, into, len)))?;
/// assert_eq!(runs, [(6, 0, 12)]);
/// # Ok::<(), tessera_dtensor::Error>(())
/// ```
///
/// # Errors
/// An `offset` or `shape` whose length differs from `global_shape`'s, or a
/// region that does not lie inside the tensor; `f` is not called.
pub fn for_each_region_run(
    global_shape: &[usize],
    offset: &[usize],
    shape: &[usize],
    f: impl FnMut(usize, usize, usize),
) -> Result<()> {
    let inside = offset.len() == global_shape.len()
        && shape.len() == global_shape.len()
        && (0..shape.len()).all(|d| {
            offset[d]
                .checked_add(shape[d])
                .is_some_and(|end| end <= global_shape[d])
        });
    if !inside {
        return Err(Error::from(TensorError::InvalidArgument {
            op: "for_each_region_run",
            detail: format!(
                "the region at offset {offset:?} of shape {shape:?} does not lie inside a tensor of shape \
                 {global_shape:?}; give one offset and one extent per dim, with offset + extent <= size"
            ),
        }));
    }
    let outer = Region {
        offset: vec![0; global_shape.len()],
        shape: global_shape.to_vec(),
    };
    let region = Region {
        offset: offset.to_vec(),
        shape: shape.to_vec(),
    };
    super::for_each_run(&outer, &region, &region, f);
    Ok(())
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn region_runs_reject_regions_outside() {
        macro_rules! case {
            ($shape:expr, $off:expr, $ext:expr) => {
                let mut calls = 0;
                let err = for_each_region_run(&$shape, &$off, &$ext, |_, _, _| calls += 1).unwrap_err();
                assert!(err.to_string().contains("does not lie inside"), "{err}");
                assert_eq!(calls, 0);
            };
        }
        case!([4, 6], [1], [2]);
        case!([4, 6], [1, 0], [2]);
        case!([4, 6], [3, 0], [2, 6]);
        case!([4, 6], [0, usize::MAX], [1, 1]);
        case!([], [0], [1]);
    }

    proptest! {
        /// The runs hold the region's elements in row-major order, each as few
        /// runs as contiguity allows (no run continues where the previous ended).
        #[test]
        fn region_runs_are_the_region_in_order(
            (global, offset, shape) in prop::collection::vec(0usize..5, 0..=3).prop_flat_map(|g| {
                let bounds: Vec<_> = g.iter().map(|&n| (0..=n).prop_flat_map(move |o| (Just(o), 0..=n - o))).collect();
                (Just(g), bounds)
            }).prop_map(|(g, b)| { let (o, s): (Vec<usize>, Vec<usize>) = b.into_iter().unzip(); (g, o, s) })
        ) {
            let mut runs = Vec::new();
            for_each_region_run(&global, &offset, &shape, |at, into, len| runs.push((at, into, len))).unwrap();
            let mut want = Vec::new();
            let strides: Vec<usize> = (0..global.len()).map(|d| global[d + 1..].iter().product()).collect();
            for flat in 0..shape.iter().product::<usize>() {
                let mut rest = flat;
                let mut at = 0;
                for d in (0..shape.len()).rev() {
                    at += (offset[d] + rest % shape[d]) * strides[d];
                    rest /= shape[d];
                }
                want.push(at);
            }
            let got: Vec<usize> = runs.iter().flat_map(|&(at, _, len)| at..at + len).collect();
            prop_assert_eq!(got, want);
            let mut next = 0;
            for (i, &(at, into, len)) in runs.iter().enumerate() {
                prop_assert_eq!(into, next);
                prop_assert!(len > 0);
                next += len;
                if i > 0 {
                    prop_assert_ne!(runs[i - 1].0 + runs[i - 1].2, at, "runs {:?} could merge", runs);
                }
            }
        }
    }
}
