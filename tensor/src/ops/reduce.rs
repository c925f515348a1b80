//! Reductions along dims: sum, mean, max, argmax, and `sum_to_shape` (the rule
//! that undoes broadcasting in backward passes).

use tessera_mesh::Element;

use super::elementwise::broadcast_shapes;
use super::{check_dim, elements, output};
use crate::kernel::Simd;
use crate::kernel::{Float, Real, float_dispatch};
use crate::{Error, Result, Tensor};

/// Sum of `row` in `f64`, with eight independent accumulators (fast, and
/// partly pairwise, so the error grows slower than a plain loop's).
pub(crate) fn sum_f64<T: Float>(row: &[T]) -> f64 {
    sum_map_f64(row, |x| x.wide())
}

/// `Σ f(x)` over `row` in `f64`, with eight independent accumulators.
#[inline(always)]
pub(crate) fn sum_map_f64<T: Copy>(row: &[T], f: impl Fn(T) -> f64) -> f64 {
    let mut acc = [0f64; 8];
    let chunks = row.chunks_exact(8);
    let tail: f64 = chunks.remainder().iter().map(|&x| f(x)).sum();
    for c in chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a += f(x);
        }
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// Largest of `a` and `b`, NaN winning (as PyTorch's max).
#[inline(always)]
pub(crate) fn nan_max<R: Real>(a: R, b: R) -> R {
    if b > a || b.is_nan() { b } else { a }
}

/// The largest element of `row` in the compute type (−inf when empty, NaN if
/// any is NaN), with eight independent lanes that compile to vector max.
#[inline(always)]
pub(crate) fn row_max<T: Float>(row: &[T]) -> T::Acc {
    let mut acc = [T::Acc::NEG_INFINITY; 8];
    // Per lane, so that a chunk costs a compare and a mask `or`, not a flag
    // gathered from the lanes each time.
    let mut nan = [false; 8];
    let chunks = row.chunks_exact(8);
    let tail = chunks
        .remainder()
        .iter()
        .fold(T::Acc::NEG_INFINITY, |m, &x| nan_max(m, x.to_acc()));
    for c in chunks {
        for ((a, n), &x) in acc.iter_mut().zip(&mut nan).zip(c) {
            let x = x.to_acc();
            *n |= x.is_nan();
            *a = if x > *a { x } else { *a };
        }
    }
    if nan.contains(&true) {
        return T::Acc::real(f64::NAN);
    }
    acc.into_iter().fold(tail, nan_max)
}

/// One reduction: a running state per output element, fed in the order of
/// the reduced elements.
trait Reducer<T: Float> {
    type State: Copy + Send;
    type Out: Element;
    fn init() -> Self::State;
    fn push(s: &mut Self::State, x: T);
    fn finish(s: Self::State, count: usize) -> Self::Out;
    /// The state after a whole contiguous row.
    #[inline]
    fn row(row: &[T]) -> Self::State {
        let mut s = Self::init();
        row.iter().for_each(|&x| Self::push(&mut s, x));
        s
    }
}

struct Sum;
impl<T: Float> Reducer<T> for Sum {
    type State = f64;
    type Out = T;
    fn init() -> f64 {
        0.0
    }
    #[inline(always)]
    fn push(s: &mut f64, x: T) {
        *s += x.wide();
    }
    fn finish(s: f64, _count: usize) -> T {
        T::from_wide(s)
    }
    fn row(row: &[T]) -> f64 {
        sum_f64(row)
    }
}

/// A [`Sum`] divided by the count.
struct Mean;
impl<T: Float> Reducer<T> for Mean {
    type State = f64;
    type Out = T;
    fn init() -> f64 {
        <Sum as Reducer<T>>::init()
    }
    #[inline(always)]
    fn push(s: &mut f64, x: T) {
        <Sum as Reducer<T>>::push(s, x)
    }
    fn finish(s: f64, count: usize) -> T {
        // 0 / 0 is NaN for an empty reduction, as in PyTorch.
        T::from_wide(s / count as f64)
    }
    fn row(row: &[T]) -> f64 {
        <Sum as Reducer<T>>::row(row)
    }
}

struct Max;
impl<T: Float> Reducer<T> for Max {
    type State = T::Acc;
    type Out = T;
    fn init() -> T::Acc {
        T::Acc::NEG_INFINITY
    }
    #[inline(always)]
    fn push(s: &mut T::Acc, x: T) {
        *s = nan_max(*s, x.to_acc());
    }
    fn finish(s: T::Acc, _count: usize) -> T {
        T::from_acc(s)
    }
    fn row(row: &[T]) -> T::Acc {
        row_max(row)
    }
}

struct ArgMax;
impl<T: Float> Reducer<T> for ArgMax {
    /// Best value, its index, and how many elements were seen.
    type State = (T::Acc, i64, i64);
    type Out = i64;
    fn init() -> Self::State {
        (T::Acc::NEG_INFINITY, 0, 0)
    }
    #[inline(always)]
    fn push(s: &mut Self::State, x: T) {
        let x = x.to_acc();
        // The first maximum wins; the first NaN beats everything.
        if !s.0.is_nan() && (x > s.0 || x.is_nan()) {
            (s.0, s.1) = (x, s.2);
        }
        s.2 += 1;
    }
    fn finish(s: Self::State, _count: usize) -> i64 {
        s.1
    }
}

struct ArgMin;
impl<T: Float> Reducer<T> for ArgMin {
    /// Best value, its index, and how many elements were seen.
    type State = (T::Acc, i64, i64);
    type Out = i64;
    fn init() -> Self::State {
        (-T::Acc::NEG_INFINITY, 0, 0)
    }
    #[inline(always)]
    fn push(s: &mut Self::State, x: T) {
        let x = x.to_acc();
        // The first minimum wins; the first NaN beats everything.
        if !s.0.is_nan() && (x < s.0 || x.is_nan()) {
            (s.0, s.1) = (x, s.2);
        }
        s.2 += 1;
    }
    fn finish(s: Self::State, _count: usize) -> i64 {
        s.1
    }
}

/// Which dims a reduction removes, checked: a mask over the input's dims.
/// The shape of a reduction of `shape` over the dims `mask` marks.
fn reduced_shape(shape: &[usize], mask: &[bool], keepdim: bool) -> Vec<usize> {
    (shape.iter().zip(mask))
        .filter_map(|(&n, &m)| if m { keepdim.then_some(1) } else { Some(n) })
        .collect()
}

fn reduced_mask(op: &'static str, shape: &[usize], dims: &[usize]) -> Result<Vec<bool>> {
    let mut mask = vec![false; shape.len()];
    for &d in dims {
        check_dim(op, d, shape.len())?;
        if std::mem::replace(&mut mask[d], true) {
            return Err(Error::InvalidArgument {
                op,
                detail: format!("dim {d} appears twice in {dims:?}; list each dim once"),
            });
        }
    }
    Ok(mask)
}

/// Reduces `t` over the dims in `mask` with `R`.
fn reduce<T: Float, R: Reducer<T>>(op: &'static str, t: &Tensor, mask: &[bool], keepdim: bool) -> Result<Tensor> {
    let shape = t.shape();
    let out_shape: Vec<usize> = (0..shape.len())
        .filter_map(|d| match (mask[d], keepdim) {
            (false, _) => Some(shape[d]),
            (true, true) => Some(1),
            (true, false) => None,
        })
        .collect();
    let count: usize = (0..shape.len()).filter(|&d| mask[d]).map(|d| shape[d]).product();
    // An empty input can reduce to a large output (`[n, 0]` summed over dim 1).
    let kept = crate::alloc::checked_len(op, &out_shape, R::Out::DTYPE)?;
    // The reduced dims as a suffix (rows), as a prefix (columns), or neither.
    let first_reduced = mask.iter().position(|&m| m).unwrap_or(shape.len());
    let suffix = mask[first_reduced..].iter().all(|&m| m);
    let first_kept = mask.iter().position(|&m| !m).unwrap_or(shape.len());
    let prefix = mask[first_kept..].iter().all(|&m| !m);
    let out: Vec<R::Out> = if count == 0 {
        let mut out = crate::alloc::with_capacity(op, &out_shape)?;
        out.resize(kept, R::finish(R::init(), 0));
        out
    } else if kept == 0 {
        Vec::new()
    } else if suffix {
        reduce_rows::<T, R>(&elements::<T>(t)?, kept, count)
    } else if prefix {
        reduce_columns::<T, R>(&elements::<T>(t)?, kept, count)
    } else if let Some(inner) = middle_block(shape, mask) {
        reduce_middle::<T, R>(op, &elements::<T>(t)?, &out_shape, inner, count)?
    } else {
        // Move the reduced dims last (one copy), then reduce rows.
        let order: Vec<usize> = (0..shape.len())
            .filter(|&d| !mask[d])
            .chain((0..shape.len()).filter(|&d| mask[d]))
            .collect();
        let moved = t.permute(&order)?.contiguous();
        reduce_rows::<T, R>(moved.as_slice::<T>()?, kept, count)
    };
    output(out, &out_shape)
}

/// Reduces the leading dims of `x` (`count` rows of `kept` columns): blocks of
/// columns over the rank's threads, each column fed its rows in order as on
/// one thread.
fn reduce_columns<T: Float, R: Reducer<T>>(x: &[T], kept: usize, count: usize) -> Vec<R::Out> {
    let mut acc = vec![R::init(); kept];
    let simd = Simd::best();
    crate::kernel::par_columns(&mut acc, x.len(), |c0, cols| {
        simd.run(
            #[inline(always)]
            || {
                for row in x.chunks_exact(kept) {
                    for (s, &v) in cols.iter_mut().zip(&row[c0..]) {
                        R::push(s, v);
                    }
                }
            },
        )
    });
    acc.into_iter().map(|s| R::finish(s, count)).collect()
}

/// Reduces one run of dims between kept ones (repeat_interleave's gradient,
/// `[.., groups, repeats, ..]` summed over the repeats): each output row of
/// `inner` elements sums its `count` input rows in order into a scratch row
/// and is written finished, in blocks of output rows over the rank's threads.
fn reduce_middle<T: Float, R: Reducer<T>>(
    op: &'static str,
    x: &[T],
    out_shape: &[usize],
    inner: usize,
    count: usize,
) -> Result<Vec<R::Out>> {
    let simd = Simd::best();
    let fill = |out: &mut [std::mem::MaybeUninit<R::Out>]| {
        crate::kernel::par_rows(out, inner, |start, block| {
            simd.run(
                #[inline(always)]
                || {
                    let mut acc = vec![R::init(); inner];
                    for (j, o) in block.chunks_exact_mut(inner).enumerate() {
                        let row = start / inner + j;
                        acc.fill(R::init());
                        for input in x[row * count * inner..(row + 1) * count * inner].chunks_exact(inner) {
                            for (s, &v) in acc.iter_mut().zip(input) {
                                R::push(s, v);
                            }
                        }
                        for (o, &s) in o.iter_mut().zip(&acc) {
                            *o = std::mem::MaybeUninit::new(R::finish(s, count));
                        }
                    }
                },
            )
        })
    };
    // SAFETY: the blocks of `par_rows` tile the output in whole rows of
    // `inner` elements, and every element of each row is written.
    unsafe { crate::alloc::written(op, out_shape, fill) }
}

/// The elements per output row when the dims `mask` reduces are one run with
/// kept dims on both sides (`[.., kept, reduced.., kept..]`): the product of
/// the kept dims after the run (non-zero); `None` for any other mask.
fn middle_block(shape: &[usize], mask: &[bool]) -> Option<usize> {
    let a = mask.iter().position(|&m| m)?;
    let b = a + mask[a..].iter().take_while(|&&m| m).count();
    let inner: usize = shape[b..].iter().product();
    (a > 0 && b < mask.len() && mask[b..].iter().all(|&m| !m) && inner > 0).then_some(inner)
}

/// `R` over each of the `kept` rows of `count` elements of `x`, in blocks of
/// rows over the rank's threads.
fn reduce_rows<T: Float, R: Reducer<T>>(x: &[T], kept: usize, count: usize) -> Vec<R::Out> {
    let mut acc = vec![R::init(); kept];
    crate::kernel::par_blocks(&mut acc, 1, crate::kernel::par_parts(x.len()), |start, block| {
        for (s, row) in block.iter_mut().zip(x[start * count..].chunks_exact(count)) {
            *s = R::row(row);
        }
    });
    acc.into_iter().map(|s| R::finish(s, count)).collect()
}

impl Tensor {
    /// The sum over `dims` (each at most once; an empty list reduces nothing),
    /// keeping them as size-1 dims when `keepdim`. Accumulates in `f64`. A sum
    /// over an empty dim is 0. PyTorch: `torch.sum(x, dims, keepdim)` (where,
    /// unlike here, `dim=[]` means every dim: use [`sum_all`](Self::sum_all)).
    ///
    /// # Errors
    /// [`Error::DimOutOfRange`]; [`Error::InvalidArgument`] for a repeated dim or
    /// an integer tensor.
    pub fn sum(&self, dims: &[impl crate::Dim], keepdim: bool) -> Result<Tensor> {
        let dims = &crate::resolve_dims(dims, "sum", self.rank())?[..];
        let mask = reduced_mask("sum", self.shape(), dims)?;
        if let Some(out) = super::meta_float(
            "sum",
            &[self],
            &reduced_shape(self.shape(), &mask, keepdim),
            self.dtype(),
        ) {
            return out;
        }
        #[cfg(feature = "cuda")]
        if self.is_cuda() {
            let dims: Vec<usize> = (0..self.rank()).filter(|&d| mask[d]).collect();
            return crate::cuda::ops::reduce(self, &dims, keepdim, crate::cuda::ops::Reduce::Sum);
        }
        float_dispatch!("sum", self.dtype(), T => reduce::<T, Sum>("sum", self, &mask, keepdim))
    }

    /// The mean over `dims`, as [`sum`](Self::sum) divides by the count (NaN
    /// over an empty dim). PyTorch: `torch.mean(x, dims, keepdim)`.
    ///
    /// # Errors
    /// As [`sum`](Self::sum).
    pub fn mean(&self, dims: &[impl crate::Dim], keepdim: bool) -> Result<Tensor> {
        let dims = &crate::resolve_dims(dims, "mean", self.rank())?[..];
        let mask = reduced_mask("mean", self.shape(), dims)?;
        if let Some(out) = super::meta_float(
            "mean",
            &[self],
            &reduced_shape(self.shape(), &mask, keepdim),
            self.dtype(),
        ) {
            return out;
        }
        #[cfg(feature = "cuda")]
        if self.is_cuda() {
            let dims: Vec<usize> = (0..self.rank()).filter(|&d| mask[d]).collect();
            return crate::cuda::ops::reduce(self, &dims, keepdim, crate::cuda::ops::Reduce::Mean);
        }
        float_dispatch!("mean", self.dtype(), T => reduce::<T, Mean>("mean", self, &mask, keepdim))
    }

    /// The largest value over `dims` (NaN if any is NaN). PyTorch:
    /// `torch.amax(x, dims, keepdim)` (and the values of `torch.max(x, dim)`).
    ///
    /// # Errors
    /// As [`sum`](Self::sum), and [`Error::InvalidArgument`] when a reduced dim
    /// is empty (a maximum of nothing).
    pub fn max(&self, dims: &[impl crate::Dim], keepdim: bool) -> Result<Tensor> {
        let dims = &crate::resolve_dims(dims, "max", self.rank())?[..];
        let mask = reduced_mask("max", self.shape(), dims)?;
        self.check_not_empty("max", &mask)?;
        if let Some(out) = super::meta_float(
            "max",
            &[self],
            &reduced_shape(self.shape(), &mask, keepdim),
            self.dtype(),
        ) {
            return out;
        }
        #[cfg(feature = "cuda")]
        if self.is_cuda() {
            let dims: Vec<usize> = (0..self.rank()).filter(|&d| mask[d]).collect();
            return crate::cuda::ops::reduce(self, &dims, keepdim, crate::cuda::ops::Reduce::Max);
        }
        float_dispatch!("max", self.dtype(), T => reduce::<T, Max>("max", self, &mask, keepdim))
    }

    /// The index (`i64`) of the largest value along `dim`, the first one on
    /// ties (a NaN counts as largest). PyTorch: `torch.argmax(x, dim, keepdim)`.
    ///
    /// # Errors
    /// [`Error::DimOutOfRange`]; [`Error::InvalidArgument`] for an empty `dim`
    /// or an integer tensor.
    pub fn argmax(&self, dim: impl crate::Dim, keepdim: bool) -> Result<Tensor> {
        let dim = dim.resolve("argmax", self.rank())?;
        let mask = reduced_mask("argmax", self.shape(), &[dim])?;
        self.check_not_empty("argmax", &mask)?;
        let shape = reduced_shape(self.shape(), &mask, keepdim);
        if let Some(out) = super::meta_float("argmax", &[self], &shape, tessera_mesh::DType::I64) {
            return out;
        }
        float_dispatch!("argmax", self.dtype(), T => reduce::<T, ArgMax>("argmax", self, &mask, keepdim))
    }

    /// The index (`i64`) of the smallest value along `dim`, the first one on
    /// ties (a NaN counts as smallest). PyTorch: `torch.argmin(x, dim, keepdim)`.
    ///
    /// # Errors
    /// [`Error::DimOutOfRange`]; [`Error::InvalidArgument`] for an empty `dim`
    /// or an integer tensor.
    pub fn argmin(&self, dim: impl crate::Dim, keepdim: bool) -> Result<Tensor> {
        let dim = dim.resolve("argmin", self.rank())?;
        let mask = reduced_mask("argmin", self.shape(), &[dim])?;
        self.check_not_empty("argmin", &mask)?;
        let shape = reduced_shape(self.shape(), &mask, keepdim);
        if let Some(out) = super::meta_float("argmin", &[self], &shape, tessera_mesh::DType::I64) {
            return out;
        }
        float_dispatch!("argmin", self.dtype(), T => reduce::<T, ArgMin>("argmin", self, &mask, keepdim))
    }

    /// The sum of all elements as a rank-0 tensor (0 when empty).
    /// PyTorch: `torch.sum(x)`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an integer tensor.
    pub fn sum_all(&self) -> Result<Tensor> {
        let dims: Vec<usize> = (0..self.rank()).collect();
        self.sum(&dims, false)
    }

    /// Sums this tensor down to `shape`, a shape that broadcasts to this one:
    /// extra leading dims are summed away and dims where `shape` has 1 are
    /// summed with keepdim. This undoes broadcasting in backward passes
    /// (the gradient of `a + b` with respect to `b` is `grad.sum_to_shape(b.shape())`).
    /// Returns this tensor itself when the shapes are equal.
    /// PyTorch: `torch.Tensor.sum_to_size`.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] when `shape` does not broadcast to this tensor's
    /// shape; [`Error::InvalidArgument`] for an integer tensor.
    pub fn sum_to_shape(&self, shape: &[usize]) -> Result<Tensor> {
        let mismatch = || Error::ShapeMismatch {
            op: "sum_to_shape",
            detail: format!(
                "cannot sum {:?} to {shape:?}: {shape:?} does not broadcast to {:?}",
                self.shape(),
                self.shape()
            ),
        };
        if shape == self.shape() {
            return Ok(self.clone());
        }
        let fits = shape.len() <= self.rank()
            && broadcast_shapes("sum_to_shape", shape, self.shape()).is_ok_and(|b| b == self.shape());
        if !fits {
            return Err(mismatch());
        }
        let lead = self.rank() - shape.len();
        let dims: Vec<usize> = (0..self.rank())
            .filter(|&d| d < lead || (shape[d - lead] == 1 && self.shape()[d] != 1))
            .collect();
        self.sum(&dims, true)?.reshape(shape)
    }

    fn check_not_empty(&self, op: &'static str, mask: &[bool]) -> Result<()> {
        match mask.iter().zip(self.shape()).position(|(&m, &s)| m && s == 0) {
            Some(d) => Err(Error::InvalidArgument {
                op,
                detail: format!(
                    "dim {d} of shape {:?} is empty, and {op} of no elements is undefined",
                    self.shape()
                ),
            }),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use tessera_mesh::DType;

    use super::*;
    use crate::ops::testutil::{assert_close, sample, tol};

    /// The naive reduction of `x` (shape `shape`) over `dims` in f64.
    fn reference(x: &[f64], shape: &[usize], dims: &[usize], f: fn(&[f64]) -> f64) -> Vec<f64> {
        let kept: Vec<usize> = (0..shape.len()).filter(|d| !dims.contains(d)).collect();
        let out_n: usize = kept.iter().map(|&d| shape[d]).product();
        let mut groups = vec![Vec::new(); out_n];
        for (i, &v) in x.iter().enumerate() {
            let (mut rest, mut o) = (i, 0);
            let mut idx = vec![0; shape.len()];
            for d in (0..shape.len()).rev() {
                idx[d] = rest % shape[d];
                rest /= shape[d];
            }
            for &d in &kept {
                o = o * shape[d] + idx[d];
            }
            groups[o].push(v);
        }
        groups.iter().map(|g| f(g)).collect()
    }

    fn fsum(g: &[f64]) -> f64 {
        g.iter().sum()
    }
    fn fmean(g: &[f64]) -> f64 {
        g.iter().sum::<f64>() / g.len() as f64
    }
    fn fmax(g: &[f64]) -> f64 {
        g.iter().copied().fold(f64::NEG_INFINITY, f64::max)
    }
    fn fargmax(g: &[f64]) -> f64 {
        let m = fmax(g);
        g.iter().position(|&x| x == m).unwrap() as f64
    }

    #[test]
    fn reduce_table() {
        type Method = fn(&Tensor, &[usize], bool) -> Result<Tensor>;
        type Reference = fn(&[f64]) -> f64;
        let ops: [(&str, Method, Reference); 3] = [
            ("sum", Tensor::sum, fsum),
            ("mean", Tensor::mean, fmean),
            ("max", Tensor::max, fmax),
        ];
        macro_rules! case {
            ($t:expr, $dims:expr, $keep_shape:expr, $drop_shape:expr) => {
                for dtype in [DType::F32, DType::F64, DType::BF16, DType::F16] {
                    let t: Tensor = $t(dtype);
                    for (name, method, f) in ops {
                        let want = reference(&t.to_f64_vec(), t.shape(), &$dims, f);
                        let what = format!("{name} {:?} over {:?} {dtype}", t.shape(), $dims);
                        let got = method(&t, &$dims, true).unwrap();
                        assert_eq!(got.shape(), &$keep_shape[..], "{what}");
                        assert_eq!(got.dtype(), dtype);
                        assert_close(&got, &want, tol(dtype), &what);
                        let got = method(&t, &$dims, false).unwrap();
                        assert_eq!(got.shape(), &$drop_shape[..], "{what}");
                        assert_close(&got, &want, tol(dtype), &what);
                    }
                }
            };
        }
        let s = |shape: &'static [usize]| move |d| sample(shape, d, 21);
        case!(s(&[2, 3, 4]), [2], [2, 3, 1], [2, 3]);
        case!(s(&[2, 3, 4]), [1, 2], [2, 1, 1], [2]);
        case!(s(&[2, 3, 4]), [0], [1, 3, 4], [3, 4]);
        case!(s(&[2, 3, 4]), [0, 1], [1, 1, 4], [4]);
        case!(s(&[2, 3, 4]), [1], [2, 1, 4], [2, 4]);
        // A run of reduced dims between kept ones, and reduced dims apart.
        case!(s(&[2, 3, 4, 5]), [2, 1], [2, 1, 1, 5], [2, 5]);
        case!(s(&[2, 3, 4, 5]), [1, 3], [2, 1, 4, 1], [2, 4]);
        case!(s(&[2, 3, 4]), [2, 0], [1, 3, 1], [3]);
        case!(s(&[2, 3, 4]), [0, 1, 2], [1, 1, 1], [0usize; 0]);
        case!(s(&[2, 3, 4]), [0usize; 0], [2, 3, 4], [2, 3, 4]);
        case!(s(&[5]), [0], [1], [0usize; 0]);
        case!(s(&[]), [0usize; 0], [0usize; 0], [0usize; 0]);
        case!(s(&[1000]), [0], [1], [0usize; 0]);
        case!(s(&[0, 3]), [1], [0, 1], [0]);
        // Strided inputs.
        let t = |d| sample(&[4, 3, 2], d, 22).transpose(0, 2).unwrap();
        case!(t, [2], [2, 3, 1], [2, 3]);
        case!(t, [0], [1, 3, 4], [3, 4]);
        case!(t, [1], [2, 1, 4], [2, 4]);
        let n = |d| sample(&[3, 7], d, 23).narrow(1, 2, 4).unwrap();
        case!(n, [1], [3, 1], [3]);
        case!(n, [0], [1, 4], [4]);
    }

    #[test]
    fn argmax_and_empty_reductions() {
        let t = sample(&[3, 4, 5], DType::F32, 9).transpose(0, 1).unwrap();
        for dim in 0..3 {
            let got = t.argmax(dim, false).unwrap();
            assert_eq!(got.dtype(), DType::I64);
            let want = reference(&t.to_f64_vec(), t.shape(), &[dim], fargmax);
            assert_eq!(got.to_f64_vec(), want, "dim {dim}");
            assert_eq!(t.argmax(dim, true).unwrap().rank(), 3);
        }
        let ties = Tensor::from_vec(vec![1.0f32, 3.0, 3.0, f32::NAN, 0.0, f32::NAN], &[2, 3]).unwrap();
        assert_eq!(ties.argmax(1, false).unwrap().to_vec::<i64>().unwrap(), vec![1, 0]);
        let m = ties.max(&[1], false).unwrap().to_vec::<f32>().unwrap();
        assert!(m[0] == 3.0 && m[1].is_nan(), "{m:?}");
        // Rows longer than the eight lanes of the vector max, with NaN and -inf.
        let mut v = vec![f32::NEG_INFINITY; 40];
        v[5] = -3.0;
        v[20 + 12] = f32::NAN;
        v[20 + 3] = 7.0;
        let long = Tensor::from_vec(v, &[2, 20]).unwrap();
        let m = long.max(&[1], false).unwrap().to_vec::<f32>().unwrap();
        assert!(m[0] == -3.0 && m[1].is_nan(), "{m:?}");
        assert_eq!(long.argmax(1, false).unwrap().to_vec::<i64>().unwrap(), vec![5, 12]);
        let all_inf = Tensor::full(&[17], f64::NEG_INFINITY, DType::F64).unwrap();
        assert_eq!(
            all_inf.max(&[0], false).unwrap().to_vec::<f64>().unwrap(),
            vec![f64::NEG_INFINITY]
        );
        assert_eq!(all_inf.argmax(0, false).unwrap().to_vec::<i64>().unwrap(), vec![0]);
        let e = Tensor::zeros(&[2, 0], DType::F32).unwrap();
        assert_eq!(e.sum(&[1], false).unwrap().to_vec::<f32>().unwrap(), vec![0.0, 0.0]);
        assert!(
            e.mean(&[1], false)
                .unwrap()
                .to_vec::<f32>()
                .unwrap()
                .iter()
                .all(|x| x.is_nan())
        );
        assert_eq!(e.sum_all().unwrap().to_vec::<f32>().unwrap(), vec![0.0]);
        assert_eq!(e.max(&[0], false).unwrap().shape(), &[0]);
    }

    #[test]
    fn sum_all_is_accurate() {
        // 1e6 values of 0.1 in f32: a naive f32 loop drifts by ~1e-3 relative.
        let t = Tensor::full(&[1000, 1000], 0.1, DType::F32).unwrap();
        let s = t.sum_all().unwrap();
        assert_eq!(s.shape(), &[0usize; 0]);
        let want = 0.1f32 as f64 * 1e6;
        assert!((s.to_f64_vec()[0] - want).abs() <= 1e-7 * want);
    }

    #[test]
    fn sum_to_shape_table() {
        macro_rules! case {
            ($from:expr, $to:expr) => {
                for dtype in [DType::F32, DType::F64] {
                    let g = sample(&$from, dtype, 5);
                    let got = g.sum_to_shape(&$to).unwrap();
                    assert_eq!(got.shape(), &$to[..]);
                    // The reference: sum every element onto its broadcast source.
                    let to: Vec<usize> = $to.to_vec();
                    let lead = $from.len() - to.len();
                    let mut want = vec![0.0; to.iter().product()];
                    let x = g.to_f64_vec();
                    for (i, v) in x.iter().enumerate() {
                        let (mut rest, mut o) = (i, 0);
                        let mut idx = vec![0; $from.len()];
                        for d in (0..$from.len()).rev() {
                            idx[d] = rest % $from[d];
                            rest /= $from[d];
                        }
                        for (k, &s) in to.iter().enumerate() {
                            o = o * s + if s == 1 { 0 } else { idx[lead + k] };
                        }
                        want[o] += v;
                    }
                    assert_close(&got, &want, tol(dtype), &format!("{:?} -> {:?}", $from, $to));
                }
            };
        }
        case!([3, 4], [3, 4]);
        case!([3, 4], [4]);
        case!([3, 4], [3, 1]);
        case!([3, 4], [1, 4]);
        case!([3, 4], [0usize; 0]);
        case!([2, 3, 4], [3, 1]);
        case!([2, 3, 4], [1]);
        case!([2, 1, 4], [1, 4]);
        let t = sample(&[2, 3], DType::F32, 1);
        assert!(t.sum_to_shape(&[2, 3]).unwrap().shares_storage(&t));
    }

    #[test]
    fn reduce_errors() {
        macro_rules! case {
            ($res:expr, $msg:expr) => {
                assert_eq!($res.unwrap_err().to_string(), $msg);
            };
        }
        let t = sample(&[2, 3], DType::F32, 1);
        case!(t.sum(&[2], false), "sum: dim 2 is out of range for a tensor of rank 2");
        case!(
            t.mean(&[1, 1], false),
            "mean: dim 1 appears twice in [1, 1]; list each dim once"
        );
        case!(
            Tensor::zeros(&[2, 0], DType::F32).unwrap().max(&[1], true),
            "max: dim 1 of shape [2, 0] is empty, and max of no elements is undefined"
        );
        case!(
            t.argmax(5, true),
            "argmax: dim 5 is out of range for a tensor of rank 2"
        );
        case!(
            t.sum_to_shape(&[3, 3]),
            "sum_to_shape: shape mismatch: cannot sum [2, 3] to [3, 3]: [3, 3] does not broadcast to [2, 3]"
        );
        case!(
            t.sum_to_shape(&[1, 2, 3]),
            "sum_to_shape: shape mismatch: cannot sum [2, 3] to [1, 2, 3]: [1, 2, 3] does not broadcast to [2, 3]"
        );
        case!(
            Tensor::arange(3, DType::I64).unwrap().sum_all(),
            "sum: dtype i64 is not a floating-point type; cast the tensor to a float dtype first"
        );
    }
}
