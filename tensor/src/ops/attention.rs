//! Fused scaled dot-product attention: the forward and backward of
//! `softmax(q·kᵀ·scale (+ causal mask))·v` one head at a time.
//!
//! The chain of ops (scores, [`Tensor::attention_probs`], the product by the
//! values, and in the backward the scores' gradient) writes the scores and
//! their gradient, `[..., T, S]` each, to memory only to read them back once.
//! Here each batch entry (a head of a sequence) runs its whole attention while
//! its operands are in the core's cache: its scores and their gradient live in
//! one scratch matrix per thread, and only what the backward needs (the
//! weights) and the results are written out. The products are the causal
//! parts of [`Tensor::matmul_causal`] (or dense ones), each row of weights is
//! computed by the code of [`Tensor::attention_probs`] and each row of the
//! scores' gradient by that of [`Tensor::attention_probs_backward`], so the
//! results have the chain's bits. The output and the gradients are stored in
//! their inputs' memory order (heads read as a view of `[b, t, h, e]` come
//! back as one), so merging heads back moves nothing.

use half::{bf16, f16};
use tessera_mesh::DType;

use super::matmul::{Causal, Gemm, GemmKernel, Mat, OutPtr, entry, part_flops};
use super::nn::{ProbsScratch, attention_probs_rows};
use super::nn_backward::attention_probs_grad_row;
use super::rows::causal_keep;
use super::{output, same_dtype};
use crate::kernel::Simd;
use crate::kernel::{Real, not_float};
use crate::{Error, Result, Tensor};

/// The scale and mask of a fused scaled dot-product attention
/// ([`Tensor::attention`], [`Tensor::attention_backward`]).
///
/// PyTorch: the `scale` and `is_causal` arguments of
/// `torch.nn.functional.scaled_dot_product_attention`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Attention {
    /// The factor of the scores `q·kᵀ` before the softmax (`1/√E` by
    /// PyTorch's default). Must be finite.
    pub scale: f64,
    /// Whether query `i` sees only keys `j <= i` (the top-left aligned mask
    /// of [`Tensor::causal_mask`]).
    pub is_causal: bool,
}

impl Attention {
    /// Errors unless queries, keys and values of shapes `q` `[..., L, E]`, `k`
    /// `[..., S, E]` and `v` `[..., S, Ev]` fit one attention (one rank ≥ 2,
    /// equal batch dims, head sizes and key counts that agree) and the scale is
    /// finite; `op` names the caller in the error.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] naming the three shapes and what does not fit;
    /// [`Error::InvalidArgument`] for a non-finite scale.
    pub fn check(&self, op: &'static str, q: &[usize], k: &[usize], v: &[usize]) -> Result<()> {
        let bad = |why: String| Error::ShapeMismatch {
            op,
            detail: format!("q {q:?}, k {k:?}, v {v:?}: {why}"),
        };
        let r = q.len();
        if r < 2 || k.len() != r || v.len() != r {
            return Err(bad(
                "q, k and v need one rank ≥ 2 ([..., L, E], [..., S, E], [..., S, Ev])".into(),
            ));
        }
        if q[..r - 2] != k[..r - 2] || q[..r - 2] != v[..r - 2] {
            return Err(bad("their batch dims must be equal".into()));
        }
        if q[r - 1] != k[r - 1] {
            return Err(bad(format!("q's head size {} differs from k's {}", q[r - 1], k[r - 1])));
        }
        if k[r - 2] != v[r - 2] {
            return Err(bad(format!("k has {} keys but v has {} values", k[r - 2], v[r - 2])));
        }
        if !self.scale.is_finite() {
            return Err(Error::InvalidArgument {
                op,
                detail: format!("the scale must be finite, got {}", self.scale),
            });
        }
        Ok(())
    }

    /// [`check`](Self::check), and errors unless the output's gradient `grad`
    /// and the weights `probs` have the shapes that the forward gives.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] naming the shapes, or [`check`](Self::check)'s errors.
    pub fn check_backward(
        &self,
        op: &'static str,
        [q, k, v]: [&[usize]; 3],
        grad: &[usize],
        probs: &[usize],
    ) -> Result<()> {
        self.check(op, q, k, v)?;
        let r = q.len();
        let (batch, l, s, ev) = (&q[..r - 2], q[r - 2], k[r - 2], v[r - 1]);
        for (got, what, last) in [(grad, "the output's gradient", ev), (probs, "probs", s)] {
            let want = [batch, &[l, last]].concat();
            if got != want {
                return Err(Error::ShapeMismatch {
                    op,
                    detail: format!("{what} has shape {got:?}; these q, k and v need {want:?}"),
                });
            }
        }
        Ok(())
    }

    /// `part` when causal, the dense product otherwise.
    fn part(&self, part: Causal) -> Causal {
        if self.is_causal { part } else { Causal::Dense }
    }
}

impl Tensor {
    /// Scaled dot-product attention of queries `self` `[..., L, E]` over keys
    /// `k` `[..., S, E]` and values `v` `[..., S, Ev]`, one fused kernel per
    /// batch entry: returns the output `softmax(q·kᵀ·scale (+ causal
    /// mask))·v`, `[..., L, Ev]`, and the attention weights `[..., L, S]`
    /// that [`attention_backward`](Self::attention_backward) needs. Bit for
    /// bit the chain `q.matmul_causal(kᵀ, Scores)`,
    /// [`attention_probs`](Self::attention_probs), `.matmul_causal(v, Weights)`
    /// (dense products when not causal), without the scores tensor. Batch
    /// entries run in parallel over the rank's threads. The output is stored
    /// in `self`'s memory order (see the module docs), the weights contiguous.
    /// On a GPU: bf16 with head sizes 16, 32, 64 or 128 and query and key
    /// counts in multiples of 16 runs one kernel on tensor cores (scores and
    /// weights rounded to bf16 where the chain rounds them, sums in another
    /// order: close to the chain, not its bits), other cases the chain's ops.
    ///
    /// PyTorch: `torch.ops.aten._scaled_dot_product_attention_math(q, k, v,
    /// is_causal=is_causal, scale=scale)`, which also returns the weights.
    ///
    /// # Errors
    /// As [`Attention::check`]; [`Error::DTypeMismatch`] for different dtypes;
    /// [`Error::InvalidArgument`] for integer tensors; [`Error::OutOfMemory`].
    pub fn attention(&self, k: &Tensor, v: &Tensor, attn: Attention) -> Result<(Tensor, Tensor)> {
        const OP: &str = "attention";
        attn.check(OP, self.shape(), k.shape(), v.shape())?;
        same_dtype(OP, self, k)?;
        same_dtype(OP, self, v)?;
        if self.is_meta() || k.is_meta() || v.is_meta() {
            // What the host kernel returns: the output and the weights.
            let lead = &self.shape()[..self.rank() - 1];
            let out = [lead, &[v.shape()[v.rank() - 1]]].concat();
            let probs = [lead, &[k.shape()[k.rank() - 2]]].concat();
            if !self.dtype().is_float() {
                return Err(not_float(OP, self.dtype()));
            }
            let r = self.rank();
            let (l, e, s, ev) = (
                self.shape()[r - 2],
                self.shape()[r - 1],
                k.shape()[r - 2],
                v.shape()[r - 1],
            );
            let count = lead[..r - 2].iter().product();
            count_flops(
                count,
                attn,
                &[(true, Causal::Scores, [l, e, s]), (true, Causal::Weights, [l, s, ev])],
                self.dtype(),
            );
            return Ok((Tensor::meta(&out, self.dtype())?, Tensor::meta(&probs, self.dtype())?));
        }
        // On a GPU (and for empty shapes) the chain of ops (products on
        // cuBLAS and the softmax kernel) or, for bf16, one fused kernel.
        if self.is_cuda() || self.shape().iter().chain(k.shape()).chain(v.shape()).any(|&d| d == 0) {
            return chain_forward(self, k, v, attn);
        }
        match self.dtype() {
            DType::F32 => forward::<f32>(self, k, v, attn),
            DType::F64 => forward::<f64>(self, k, v, attn),
            DType::BF16 => forward::<bf16>(self, k, v, attn),
            DType::F16 => forward::<f16>(self, k, v, attn),
            other => Err(not_float(OP, other)),
        }
    }

    /// The gradients of [`attention`](Self::attention) with respect to `q`,
    /// `k` and `v` (those that `need` asks for, `None` for the others), given
    /// the gradient `self` of its output `[..., L, Ev]` and the weights
    /// `probs` `[..., L, S]` it returned. Bit for bit the chain's backward:
    /// `dV = probsᵀ·dO`, `dP = dO·vᵀ`, `dS =`
    /// [`dP.attention_probs_backward(probs)`](Self::attention_probs_backward),
    /// `dQ = dS·k`, `dK = dSᵀ·q` (their causal parts when causal), with `dP`
    /// and `dS` one scratch matrix per thread instead of tensors. Each
    /// gradient is stored in its input's memory order.
    ///
    /// PyTorch: the backward of `torch.nn.functional.scaled_dot_product_attention`
    /// (its math path's autograd).
    ///
    /// # Errors
    /// As [`attention`](Self::attention); [`Error::ShapeMismatch`] when `self`
    /// or `probs` does not have the shape the forward gives.
    pub fn attention_backward(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        probs: &Tensor,
        attn: Attention,
        need: [bool; 3],
    ) -> Result<[Option<Tensor>; 3]> {
        const OP: &str = "attention_backward";
        attn.check_backward(OP, [q.shape(), k.shape(), v.shape()], self.shape(), probs.shape())?;
        for t in [q, k, v, probs] {
            same_dtype(OP, self, t)?;
        }
        if need == [false; 3] {
            return Ok([None, None, None]);
        }
        if [self, q, k, v, probs].iter().any(|t| t.is_meta()) {
            if !self.dtype().is_float() {
                return Err(not_float(OP, self.dtype()));
            }
            let r = q.rank();
            let count = q.shape()[..r - 2].iter().product();
            let (l, e, s, ev) = (q.shape()[r - 2], q.shape()[r - 1], k.shape()[r - 2], v.shape()[r - 1]);
            backward_flops(count, attn, need, [l, s, e, ev], self.dtype());
            let mut grads = [None, None, None];
            for (g, (x, n)) in grads.iter_mut().zip([q, k, v].into_iter().zip(need)) {
                if n {
                    *g = Some(Tensor::meta(x.shape(), self.dtype())?);
                }
            }
            return Ok(grads);
        }
        if self.is_cuda() || q.shape().iter().chain(k.shape()).chain(v.shape()).any(|&d| d == 0) {
            return chain_backward(self, q, k, v, probs, attn, need);
        }
        match self.dtype() {
            DType::F32 => backward::<f32>(self, q, k, v, probs, attn, need),
            DType::F64 => backward::<f64>(self, q, k, v, probs, attn, need),
            DType::BF16 => backward::<bf16>(self, q, k, v, probs, attn, need),
            DType::F16 => backward::<f16>(self, q, k, v, probs, attn, need),
            other => Err(not_float(OP, other)),
        }
    }
}

/// The scores `q·kᵀ` of the chain of ops. On a GPU the causal part's masked
/// elements are left unwritten: the chain reads them only through the softmax
/// kernels, which read the kept keys alone (a pass over half the scores saved).
fn chain_scores(q: &Tensor, kt: &Tensor, attn: Attention) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if q.is_cuda() && attn.is_causal {
        return crate::cuda::ops::causal_scores_unmasked(q, kt, &q.shape()[..q.rank() - 2]);
    }
    q.matmul_causal(kt, attn.part(Causal::Scores))
}

/// The forward as the chain of ops: on a GPU (products on cuBLAS, the
/// softmax kernels; the fused bf16 kernel where it applies) and for shapes
/// with an empty dim.
fn chain_forward(q: &Tensor, k: &Tensor, v: &Tensor, attn: Attention) -> Result<(Tensor, Tensor)> {
    // bf16 on a GPU: one kernel on tensor cores where the shapes suit it.
    #[cfg(feature = "cuda")]
    if q.is_cuda()
        && let Some(fused) = crate::cuda::ops::attention(q, k, v, attn)?
    {
        return Ok(fused);
    }
    let r = q.rank();
    let scores = chain_scores(q, &k.transpose(r - 2, r - 1)?, attn)?;
    let probs = scores.attention_probs(attn.scale, attn.is_causal)?;
    let out = probs.matmul_causal(v, attn.part(Causal::Weights))?;
    Ok((out, probs))
}

/// The backward as the chain of ops: on a GPU and for shapes with an empty dim.
fn chain_backward(
    g: &Tensor,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    probs: &Tensor,
    attn: Attention,
    need: [bool; 3],
) -> Result<[Option<Tensor>; 3]> {
    let r = q.rank();
    let t = |x: &Tensor| x.transpose(r - 2, r - 1);
    let gp = chain_scores(g, &t(v)?, attn)?;
    let gs = gp.attention_probs_backward(probs, attn.scale, attn.is_causal)?;
    let gq = need[0]
        .then(|| gs.matmul_causal(k, attn.part(Causal::Weights)))
        .transpose()?;
    let gk = need[1]
        .then(|| t(&gs)?.matmul_causal(q, attn.part(Causal::WeightsTransposed)))
        .transpose()?;
    let gv = need[2]
        .then(|| t(probs)?.matmul_causal(g, attn.part(Causal::WeightsTransposed)))
        .transpose()?;
    Ok([gq, gk, gv])
}

/// One operand of the fused kernels: its elements, and per batch entry the
/// offset of its matrix and that matrix's (row, column) strides.
struct Operand<'a, T> {
    base: *const T,
    offsets: Vec<isize>,
    rs: isize,
    cs: isize,
    _view: std::marker::PhantomData<&'a T>,
}

impl<'a, T: Gemm> Operand<'a, T> {
    fn new(t: &'a Tensor) -> Result<Operand<'a, T>> {
        let (r, strides) = (t.rank(), t.strides());
        Ok(Operand {
            base: t.view::<T>()?.as_ptr(),
            offsets: entry_offsets(t.shape(), strides),
            rs: strides[r - 2] as isize,
            cs: strides[r - 1] as isize,
            _view: std::marker::PhantomData,
        })
    }

    /// Batch entry `i`'s matrix, or its transpose.
    fn mat(&self, i: usize, transposed: bool) -> Mat<T> {
        let (rs, cs) = if transposed {
            (self.cs, self.rs)
        } else {
            (self.rs, self.cs)
        };
        Mat {
            ptr: self.base.wrapping_offset(self.offsets[i]),
            rs,
            cs,
        }
    }

    /// Asks the CPU to bring batch entry `i`'s matrix (`rows×cols`) into its
    /// L2 cache, so that the entry after the current one is there by the time
    /// its products start: inside a training step the operands were written
    /// long before (saved activations) and come from memory, one row of a
    /// head at a time ([`prefetch_rows`]).
    fn prefetch(&self, i: usize, rows: usize, cols: usize) {
        prefetch_rows(self.mat(i, false), rows, cols);
    }
}

/// Prefetch hints (into L2) for the `rows` rows of `cols` contiguous elements
/// of `m`: nothing when its columns are not contiguous or off x86-64. A hint
/// never faults and never changes a result.
fn prefetch_rows<T>(m: Mat<T>, rows: usize, cols: usize) {
    #[cfg(target_arch = "x86_64")]
    if m.cs == 1 {
        use std::arch::x86_64::{_MM_HINT_T1, _mm_prefetch};
        let bytes = cols * size_of::<T>();
        for r in 0..rows {
            let row = m.ptr.wrapping_offset(r as isize * m.rs).cast::<i8>();
            for line in row_lines(row as usize, bytes) {
                // SAFETY: a prefetch is a hint that neither reads nor faults,
                // whatever the address (`wrapping_add` keeps the pointer
                // arithmetic defined).
                unsafe { _mm_prefetch::<_MM_HINT_T1>(row.wrapping_add(line)) };
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (m, rows, cols);
}

/// Cache lines (of 64 bytes) are the unit of a prefetch.
#[cfg(target_arch = "x86_64")]
const LINE: usize = 64;

/// The offsets from `start` (an address) at which one address in each cache
/// line of the `bytes` bytes from `start` lies: every line they touch, once.
#[cfg(target_arch = "x86_64")]
fn row_lines(start: usize, bytes: usize) -> impl Iterator<Item = usize> {
    let lines = if bytes == 0 {
        0
    } else {
        (start + bytes - 1) / LINE - start / LINE + 1
    };
    // The first line from `start` itself, the others from their first byte.
    (0..lines).map(move |k| if k == 0 { 0 } else { (start / LINE + k) * LINE - start })
}

// SAFETY: an operand is only read, from storage its tensor keeps borrowed for
// the whole kernel (the lifetime `'a`), including by the threads of the split.
unsafe impl<T> Send for Operand<'_, T> {}
// SAFETY: as for Send.
unsafe impl<T> Sync for Operand<'_, T> {}

/// A contiguous `[count, rows, cols]` block of matrices: the attention
/// weights, or the scratch matrices of the parts of a split.
struct Block<T> {
    ptr: *mut T,
    rows: usize,
    cols: usize,
}

impl<T> Block<T> {
    /// Matrix `i` as the output of a product (row stride `cols`).
    fn out(&self, i: usize) -> OutPtr<T> {
        OutPtr(self.ptr.wrapping_add(i * self.rows * self.cols))
    }

    /// `a · b` (or its causal `part`) written to matrix `i`.
    ///
    /// # Safety
    /// As [`entry`]; no other thread may touch matrix `i` meanwhile.
    unsafe fn product(&self, i: usize, kernel: GemmKernel, mkn: [usize; 3], a: Mat<T>, b: Mat<T>, part: Causal)
    where
        T: Gemm,
    {
        // SAFETY: the caller's guarantees; matrix `i` is `rows×cols` with row stride `cols`.
        unsafe { entry(kernel, mkn, a, b, self.out(i), self.cols as isize, part) };
    }

    /// Matrix `i` as an operand (or its transpose).
    fn mat(&self, i: usize, transposed: bool) -> Mat<T> {
        let (rs, cs) = if transposed {
            (1, self.cols as isize)
        } else {
            (self.cols as isize, 1)
        };
        Mat {
            ptr: self.out(i).0.cast_const(),
            rs,
            cs,
        }
    }

    /// Matrix `i`'s elements.
    ///
    /// # Safety
    /// They must be initialised, and no other reference to them alive.
    #[allow(clippy::mut_from_ref)]
    unsafe fn slice(&self, i: usize) -> &mut [T] {
        // SAFETY: the caller's guarantees; callers pass `i` below the count the
        // block was made for, so the matrix is inside its allocation.
        unsafe { std::slice::from_raw_parts_mut(self.out(i).0, self.rows * self.cols) }
    }
}

// SAFETY: the threads of a split write disjoint matrices of a block (each
// part its own scratch, each batch entry its own weights), and
// `parallel_for` returns before the block's buffer is read or freed.
unsafe impl<T> Send for Block<T> {}
// SAFETY: as for Send.
unsafe impl<T> Sync for Block<T> {}

/// An output of the kernels stored in the memory order of the input it
/// belongs to (the forward's output and `dq` in `q`'s, `dk` in `k`'s, `dv` in
/// `v`'s), so that heads read as a permuted view of `[b, t, h, e]` come back
/// as such a view, and merging them back into `[b, t, h·e]` moves nothing.
/// Inputs whose last dim is not their innermost give a contiguous output.
///
/// PyTorch: `torch.empty_like(x)` (`memory_format=torch.preserve_format`).
struct Out<T> {
    buf: Vec<T>,
    /// `buf`'s elements (its heap buffer does not move with it).
    base: *mut T,
    /// The dims from outermost to innermost in memory.
    order: Vec<usize>,
    shape: Vec<usize>,
    /// Per batch entry, the offset of its matrix.
    offsets: Vec<isize>,
    /// The matrices' row stride (their columns are contiguous).
    rsc: isize,
}

impl<T: Gemm> Out<T> {
    /// Room for an output of `shape` in the memory order of `like`.
    fn like(op: &'static str, like: &Tensor, shape: &[usize]) -> Result<Out<T>> {
        let r = shape.len();
        let mut order: Vec<usize> = (0..r).collect();
        // Outermost first: larger strides first, ties (size-1 dims) in dim order.
        order.sort_by_key(|&d| std::cmp::Reverse(like.strides()[d]));
        if order[r - 1] != r - 1 || like.shape()[r - 1] == 1 {
            order = (0..r).collect();
        }
        let mut strides = vec![0; r];
        let mut step = 1;
        for &d in order.iter().rev() {
            strides[d] = step;
            step *= shape[d];
        }
        let mut buf = crate::alloc::with_capacity::<T>(op, shape)?;
        Ok(Out {
            base: buf.as_mut_ptr(),
            buf,
            offsets: entry_offsets(shape, &strides),
            rsc: strides[r - 2] as isize,
            order,
            shape: shape.to_vec(),
        })
    }

    /// `a · b` (or its causal `part`) written to batch entry `i`'s matrix.
    ///
    /// # Safety
    /// As [`entry`]; no other thread may touch that matrix meanwhile.
    unsafe fn product(&self, i: usize, kernel: GemmKernel, mkn: [usize; 3], a: Mat<T>, b: Mat<T>, part: Causal) {
        let c = OutPtr(self.base.wrapping_offset(self.offsets[i]));
        // SAFETY: the caller's guarantees; entry `i`'s matrix has row stride `rsc`.
        unsafe { entry(kernel, mkn, a, b, c, self.rsc, part) };
    }

    /// The tensor, once every element has been written.
    ///
    /// # Safety
    /// The products must have written every element.
    unsafe fn finish(mut self) -> Result<Tensor> {
        let stored: Vec<usize> = self.order.iter().map(|&d| self.shape[d]).collect();
        let n = stored.iter().product();
        // SAFETY: the caller's guarantee; the capacity is the shape's product.
        unsafe { self.buf.set_len(n) };
        let mut back = vec![0; self.order.len()];
        for (j, &d) in self.order.iter().enumerate() {
            back[d] = j;
        }
        output(self.buf, &stored)?.permute(&back)
    }
}

// SAFETY: the threads of a split write disjoint matrices of an output (each
// batch entry its own), and `parallel_for` returns before it is read or freed.
unsafe impl<T> Send for Out<T> {}
// SAFETY: as for Send.
unsafe impl<T> Sync for Out<T> {}

/// Per batch entry of a tensor of `shape` with `strides`, the offset of its
/// last two dims' matrix, batch entries in row-major order.
fn entry_offsets(shape: &[usize], strides: &[usize]) -> Vec<isize> {
    let r = shape.len();
    let count: usize = shape[..r - 2].iter().product();
    let mut offsets = Vec::with_capacity(count);
    let mut index = vec![0; r - 2];
    for _ in 0..count {
        offsets.push(index.iter().zip(strides).map(|(i, s)| i * s).sum::<usize>() as isize);
        for d in (0..r - 2).rev() {
            index[d] += 1;
            if index[d] < shape[d] {
                break;
            }
            index[d] = 0;
        }
    }
    offsets
}

/// How a batch of `count` entries is split over the rank's threads: the
/// number of parts (one per thread, at most one per entry) and the entries per
/// part (each part a contiguous run).
fn runs(count: usize) -> (usize, usize) {
    let parts = tessera_mesh::intra_op_threads().min(count).max(1);
    (parts, count.div_ceil(parts))
}

fn forward<T: Gemm>(q: &Tensor, k: &Tensor, v: &Tensor, attn: Attention) -> Result<(Tensor, Tensor)> {
    const OP: &str = "attention";
    let r = q.rank();
    let batch = &q.shape()[..r - 2];
    let (l, e, s, ev) = (q.shape()[r - 2], q.shape()[r - 1], k.shape()[r - 2], v.shape()[r - 1]);
    let count: usize = batch.iter().product();
    let probs_shape = [batch, &[l, s]].concat();
    let kernel = GemmKernel::auto_for(T::DTYPE);
    let (qo, ko, vo) = (Operand::<T>::new(q)?, Operand::<T>::new(k)?, Operand::<T>::new(v)?);
    let (parts, per) = runs(count);
    let out = Out::<T>::like(OP, q, &[batch, &[l, ev]].concat())?;
    // Rows are read as slices, so their buffers hold valid values from the start.
    let mut probs = crate::alloc::reused::<T>(OP, &probs_shape)?;
    let mut scores = crate::alloc::zeroed::<T>(OP, &[parts, l, s])?;
    let weights = Block {
        ptr: probs.as_mut_ptr(),
        rows: l,
        cols: s,
    };
    let scratch = Block {
        ptr: scores.as_mut_ptr(),
        rows: l,
        cols: s,
    };
    let scale = T::Acc::real(attn.scale);
    let simd = Simd::best();
    count_flops(
        count,
        attn,
        &[(true, Causal::Scores, [l, e, s]), (true, Causal::Weights, [l, s, ev])],
        T::DTYPE,
    );
    tessera_mesh::parallel_for(parts, |p| {
        let mut rows = ProbsScratch::<T>::default();
        let end = ((p + 1) * per).min(count);
        for i in p * per..end {
            if i + 1 < end {
                qo.prefetch(i + 1, l, e);
                ko.prefetch(i + 1, s, e);
                vo.prefetch(i + 1, s, ev);
            }
            // SAFETY: entry `i` of every operand is a matrix of its tensor
            // (`Operand`), `l×e`, `s×e` (read transposed) and `s×ev`; the
            // scores go to this part's own scratch matrix, the weights and the
            // output to entry `i`'s matrices of theirs, which no other part
            // touches, and the products write every element of each.
            unsafe {
                let (qi, kt) = (qo.mat(i, false), ko.mat(i, true));
                scratch.product(p, kernel, [l, e, s], qi, kt, attn.part(Causal::Scores));
                let (sc, w) = (scratch.slice(p), weights.slice(i));
                simd.run(
                    #[inline(always)]
                    || attention_probs_rows(attn.is_causal, scale, sc, w, s, &mut rows),
                );
                let (wi, vi) = (weights.mat(i, false), vo.mat(i, false));
                out.product(i, kernel, [l, s, ev], wi, vi, attn.part(Causal::Weights));
            }
        }
    });
    // SAFETY: the products wrote every element of the output.
    let out = unsafe { out.finish()? };
    Ok((out, output(probs, &probs_shape)?))
}

fn backward<T: Gemm>(
    g: &Tensor,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    probs: &Tensor,
    attn: Attention,
    need: [bool; 3],
) -> Result<[Option<Tensor>; 3]> {
    const OP: &str = "attention_backward";
    let r = q.rank();
    let batch = &q.shape()[..r - 2];
    let (l, e, s, ev) = (q.shape()[r - 2], q.shape()[r - 1], k.shape()[r - 2], v.shape()[r - 1]);
    let count: usize = batch.iter().product();
    let kernel = GemmKernel::auto_for(T::DTYPE);
    // The weights' rows are read as slices: contiguous (a no-op for the forward's).
    let probs = probs.contiguous();
    let [go, qo, ko, vo, po] = [g, q, k, v, &probs].map(Operand::<T>::new);
    let (go, qo, ko, vo, po) = (go?, qo?, ko?, vo?, po?);
    let y = probs.view::<T>()?;
    let y = y.as_slice().ok_or_else(|| Error::InvalidArgument {
        op: OP,
        detail: "internal error: contiguous weights without a slice".into(),
    })?;
    let (parts, per) = runs(count);
    // Each gradient in its input's memory order (none when not asked for).
    let grad = |want: bool, like: &Tensor| want.then(|| Out::<T>::like(OP, like, like.shape())).transpose();
    let (gq, gk, gv) = (grad(need[0], q)?, grad(need[1], k)?, grad(need[2], v)?);
    let need_s = need[0] || need[1];
    // Per part: the weights' gradient, then the scores'.
    let mut scratch = crate::alloc::zeroed::<T>(OP, &[parts, 2, l, s])?;
    let scratch = Block {
        ptr: scratch.as_mut_ptr(),
        rows: l,
        cols: s,
    };
    let scale = T::Acc::real(attn.scale);
    let simd = Simd::best();
    backward_flops(count, attn, need, [l, s, e, ev], T::DTYPE);
    tessera_mesh::parallel_for(parts, |p| {
        let end = ((p + 1) * per).min(count);
        for i in p * per..end {
            if i + 1 < end {
                for (o, rows, cols) in [(&go, l, ev), (&qo, l, e), (&ko, s, e), (&vo, s, ev), (&po, l, s)] {
                    o.prefetch(i + 1, rows, cols);
                }
            }
            // SAFETY: as in `forward`: entry `i` of every operand is a matrix
            // of its tensor, each part writes only its own scratch matrices
            // and entry `i`'s matrix of each gradient, and each product writes
            // every element of its output.
            unsafe {
                if let Some(gv) = &gv {
                    let (wt, gi) = (po.mat(i, true), go.mat(i, false));
                    gv.product(i, kernel, [s, l, ev], wt, gi, attn.part(Causal::WeightsTransposed));
                }
                if !need_s {
                    continue;
                }
                let (dp, ds) = (2 * p, 2 * p + 1);
                let (gi, vt) = (go.mat(i, false), vo.mat(i, true));
                scratch.product(dp, kernel, [l, ev, s], gi, vt, attn.part(Causal::Scores));
                let (x, z) = (scratch.slice(dp), scratch.slice(ds));
                let w = &y[i * l * s..(i + 1) * l * s];
                scores_grad(simd, attn.is_causal, scale, s, x, w, z);
                if let Some(gq) = &gq {
                    let (st, ki) = (scratch.mat(ds, false), ko.mat(i, false));
                    gq.product(i, kernel, [l, s, e], st, ki, attn.part(Causal::Weights));
                }
                if let Some(gk) = &gk {
                    let (st, qi) = (scratch.mat(ds, true), qo.mat(i, false));
                    gk.product(i, kernel, [s, l, e], st, qi, attn.part(Causal::WeightsTransposed));
                }
            }
        }
    });
    // SAFETY: the products wrote every element of each gradient asked for.
    let finish = |o: Option<Out<T>>| o.map(|o| unsafe { o.finish() }).transpose();
    Ok([finish(gq)?, finish(gk)?, finish(gv)?])
}

/// The scores' gradient `z` of one batch entry from the weights' gradient `x`
/// and the weights `w` (rows of `s`), compiled for the widest vectors the CPU has.
#[inline(always)]
fn scores_grad<T: Gemm>(simd: Simd, is_causal: bool, scale: T::Acc, s: usize, x: &[T], w: &[T], z: &mut [T]) {
    simd.run(
        #[inline(always)]
        || {
            let rows = x.chunks_exact(s).zip(w.chunks_exact(s)).zip(z.chunks_exact_mut(s));
            for (row, ((x, w), z)) in rows.enumerate() {
                attention_probs_grad_row(causal_keep(is_causal, row, s), scale, x, w, z);
            }
        },
    );
}

/// The flops of the backward's products for `count` batch entries of queries
/// `[l, e]`, keys `[s, e]` and values `[s, ev]`, for the gradients in `need`
/// (see [`count_flops`]).
fn backward_flops(count: usize, attn: Attention, need: [bool; 3], [l, s, e, ev]: [usize; 4], dtype: DType) {
    let need_s = need[0] || need[1];
    count_flops(
        count,
        attn,
        &[
            (need[2], Causal::WeightsTransposed, [s, l, ev]),
            (need_s, Causal::Scores, [l, ev, s]),
            (need[0], Causal::Weights, [l, s, e]),
            (need[1], Causal::WeightsTransposed, [s, l, e]),
        ],
        dtype,
    );
}

/// Counts (see [`crate::profile::add_flops`]) the flops of `count` batch
/// entries' `products` that run (the flag), each the given causal part (or
/// the dense product). Nothing to do while profiling is off.
fn count_flops(count: usize, attn: Attention, products: &[(bool, Causal, [usize; 3])], dtype: DType) {
    if !crate::profile::enabled() {
        return;
    }
    let flops: u128 = products
        .iter()
        .filter(|p| p.0)
        .map(|&(_, part, mkn)| part_flops(count, attn.part(part), mkn))
        .sum();
    crate::profile::add_flops_of(flops.try_into().unwrap_or(u64::MAX), dtype);
}

#[cfg(test)]
mod tests;
