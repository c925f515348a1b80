//! The communicator contract: checks any [`Communicator`] must pass, written once
//! and run against every backend (threads under `cargo test`, MPI under `mpirun`).
//!
//! Every check is collective: all ranks of `comm` call it together. Each rank
//! builds inputs that are a known function of (rank, index), runs the collective
//! and compares with the result computed locally from that function (the oracle).
//! A failed check panics with a message naming the collective, dtype, length and rank.

use half::{bf16, f16};

use std::time::{Duration, Instant};

use crate::{Communicator, CommunicatorExt, DType, DeviceMesh, Element, OpKind, ReduceOp};

/// Buffer lengths (per rank block) every check covers: empty, tiny, odd, and
/// longer than one reduction block.
pub const LENS: [usize; 6] = [0, 1, 2, 7, 13, 2500];

/// An element type with exact conversions from small integers, for oracles.
pub trait TestElement: Element {
    /// Converts from f64 (rounding as the type does).
    fn from_f64(v: f64) -> Self;
    /// Converts to f64.
    fn to_f64(self) -> f64;
}

macro_rules! test_elem {
    ($t:ty, $from:expr, $to:expr) => {
        impl TestElement for $t {
            fn from_f64(v: f64) -> Self {
                $from(v)
            }
            fn to_f64(self) -> f64 {
                $to(self)
            }
        }
    };
}
test_elem!(f32, |v| v as f32, |x: f32| x as f64);
test_elem!(f64, |v| v, |x| x);
test_elem!(bf16, bf16::from_f64, bf16::to_f64);
test_elem!(f16, f16::from_f64, f16::to_f64);
test_elem!(i64, |v| v as i64, |x| x as f64);
test_elem!(u8, |v| v as u8, |x| x as f64);

/// The value rank `r` holds at index `i` (small integers, exact in every dtype).
pub fn value(r: usize, i: usize) -> f64 {
    ((r * 7 + i * 3) % 11) as f64
}

/// A positive value (for products: 1 or 2, so a product over 8 ranks stays exact).
fn pvalue(r: usize, i: usize) -> f64 {
    1.0 + ((r + i) % 2) as f64
}

fn input<T: TestElement>(r: usize, len: usize, f: fn(usize, usize) -> f64) -> Vec<T> {
    (0..len).map(|i| T::from_f64(f(r, i))).collect()
}

fn reduce_oracle(op: ReduceOp, n: usize, i: usize) -> f64 {
    let f = if op == ReduceOp::Product { pvalue } else { value };
    let vals = (0..n).map(|r| f(r, i));
    match op {
        ReduceOp::Sum => vals.sum(),
        ReduceOp::Avg => vals.sum::<f64>() / n as f64,
        ReduceOp::Max => vals.fold(f64::MIN, f64::max),
        ReduceOp::Min => vals.fold(f64::MAX, f64::min),
        ReduceOp::Product => vals.product(),
    }
}

fn assert_close<T: TestElement>(what: &str, got: &[T], want: impl Fn(usize) -> f64) {
    let tol = match T::DTYPE {
        DType::BF16 => 1e-2,
        DType::F16 => 1e-3,
        _ => 1e-12,
    };
    for (i, g) in got.iter().enumerate() {
        let (g, w) = (g.to_f64(), T::from_f64(want(i)).to_f64());
        assert!(
            (g - w).abs() <= tol * w.abs().max(1.0),
            "{what}: element {i}: got {g}, want {w}"
        );
    }
}

fn reductions_for(dtype: DType) -> Vec<ReduceOp> {
    ReduceOp::ALL
        .into_iter()
        .filter(|op| op.check("t", dtype).is_ok())
        .collect()
}

/// all_gather, reduce_scatter, all_reduce, all_to_all and broadcast of `T`, blocking forms.
pub fn check_blocking<T: TestElement>(comm: &dyn Communicator) {
    let (r, n) = (comm.rank(), comm.size());
    for len in LENS {
        let ctx = |op: &str| format!("{op} {} len {len} rank {r}/{n}", T::DTYPE);
        let send = input::<T>(r, len, value);
        let got = comm
            .all_gather_vec(&send)
            .unwrap_or_else(|e| panic!("{}: {e}", ctx("all_gather")));
        assert_close(&ctx("all_gather"), &got, |i| value(i / len.max(1), i % len.max(1)));

        let all: Vec<T> = input(r, len * n, value);
        let mut a2a = vec![T::default(); len * n];
        comm.all_to_all_slice(&all, &mut a2a)
            .unwrap_or_else(|e| panic!("{}: {e}", ctx("all_to_all")));
        // Block q comes from rank q's block r.
        assert_close(&ctx("all_to_all"), &a2a, |i| {
            value(i / len.max(1), r * len + i % len.max(1))
        });

        for root in [0, n - 1] {
            let mut b: Vec<T> = input(r, len, value);
            comm.broadcast_slice(&mut b, root)
                .unwrap_or_else(|e| panic!("{}: {e}", ctx("broadcast")));
            assert_close(&ctx("broadcast"), &b, |i| value(root, i));
        }

        for op in reductions_for(T::DTYPE) {
            let f = if op == ReduceOp::Product { pvalue } else { value };
            let what = ctx(&format!("all_reduce({op})"));
            let mut buf: Vec<T> = input(r, len, f);
            comm.all_reduce_slice(&mut buf, op)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_close(&what, &buf, |i| reduce_oracle(op, n, i));

            let what = ctx(&format!("all_reduce_into({op})"));
            let send: Vec<T> = input(r, len, f);
            let mut out = vec![T::default(); len];
            comm.all_reduce_into(T::buf(&send), T::buf_mut(&mut out), op)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_close(&what, &out, |i| reduce_oracle(op, n, i));
            assert_close(&format!("{what} leaves its input"), &send, |i| f(r, i));

            let what = ctx(&format!("reduce_scatter({op})"));
            let send: Vec<T> = input(r, len * n, f);
            let mut recv = vec![T::default(); len];
            comm.reduce_scatter_slice(&send, &mut recv, op)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_close(&what, &recv, |i| reduce_oracle(op, n, r * len + i));
        }
    }
}

/// `all_gather_segmented`, blocking and asynchronous, against the rank-major
/// gather reordered by segment: one segment (a plain gather), empty and uneven
/// segments, one element each; and the local error for segments that do not
/// tile the send buffer (every rank passes the same bad segments, so none
/// enters the collective).
pub fn check_segmented<T: TestElement>(comm: &dyn Communicator) {
    let (r, n) = (comm.rank(), comm.size());
    let cases: [&[usize]; 5] = [&[], &[13], &[3, 0, 7, 3], &[1; 6], &[0, 5, 0]];
    for segments in cases {
        let len: usize = segments.iter().sum();
        let what = format!("all_gather_segmented {} {segments:?} rank {r}/{n}", T::DTYPE);
        // Element i of the output: segment s of rank q, element j of it.
        let mut want = Vec::with_capacity(len * n);
        let mut from = 0;
        for &seg in segments {
            for q in 0..n {
                want.extend((from..from + seg).map(|i| value(q, i)));
            }
            from += seg;
        }
        let send = input::<T>(r, len, value);
        let mut got = vec![T::default(); len * n];
        comm.all_gather_segmented(T::buf(&send), T::buf_mut(&mut got), segments)
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_close(&what, &got, |i| want[i]);
        let got = comm
            .all_gather_segmented_async(T::into_buffer(send), segments.to_vec())
            .wait_vec::<T>()
            .unwrap_or_else(|e| panic!("{what} async: {e}"));
        assert_eq!(got.len(), len * n, "{what} async");
        assert_close(&format!("{what} async"), &got, |i| want[i]);
    }
    let send = input::<T>(r, 5, value);
    let mut out = vec![T::default(); 5 * n];
    let err = comm
        .all_gather_segmented(T::buf(&send), T::buf_mut(&mut out), &[2, 2])
        .expect_err("segments of 4 elements for a send of 5");
    assert!(err.to_string().contains("all_gather_segmented"), "{err}");
    let err = comm
        .all_gather_segmented_async(T::into_buffer(send), vec![6])
        .wait()
        .expect_err("segments of 6 elements for a send of 5");
    assert!(err.to_string().contains("all_gather_segmented"), "{err}");
}

/// The [`Pieces`](crate::Pieces) forms of the reduce-scatter and the segmented
/// all-gather give the flat forms' results bit for bit (and count the same
/// bytes): send buffers cut into held pieces and runs of zeros at places that
/// fall inside the reduction's blocks and across the ranks' blocks, the flat
/// equivalent holding the same elements; odd ranks send flat buffers while
/// even ones send pieces, so a backend reading its peers in place must read
/// both kinds.
pub fn check_pieces<T: TestElement>(comm: &dyn Communicator) {
    let (r, n) = (comm.rank(), comm.size());
    let bits = |v: &[T]| v.iter().map(|x| bytemuck::bytes_of(x).to_vec()).collect::<Vec<_>>();
    // Per-rank block lengths of the reduce-scatter (the last crosses a
    // reduction block of 2048 elements).
    for block in [1usize, 7, 2500] {
        let len = block * n;
        // Cuts: [0, a) held, [a, b) zeros, [b, c) held, [c, len) held.
        let (a, b) = (len / 3, len / 3 + len.div_ceil(5));
        let c = (b + 1).min(len);
        let flat: Vec<T> = (0..len)
            .map(|i| {
                if (a..b).contains(&i) {
                    T::default()
                } else {
                    T::from_f64(value(r, i))
                }
            })
            .collect();
        let pieces = |flat: &[T]| {
            let mut p = crate::Pieces::new(T::DTYPE);
            p.push(T::into_buffer(flat[..a].to_vec())).expect("same dtype");
            p.push_zeros(b - a);
            p.push(T::into_buffer(flat[b..c].to_vec())).expect("same dtype");
            p.push(T::into_buffer(flat[c..].to_vec())).expect("same dtype");
            assert_eq!(p.len(), len);
            p
        };
        for op in reductions_for(T::DTYPE) {
            let what = format!("reduce_scatter pieces {} {op} block {block} rank {r}/{n}", T::DTYPE);
            let want = comm
                .reduce_scatter_async(T::into_buffer(flat.clone()), op)
                .wait_vec::<T>()
                .unwrap_or_else(|e| panic!("{what} (flat): {e}"));
            let before = comm.stats().snapshot();
            let work = if r % 2 == 0 {
                comm.reduce_scatter_pieces_async(pieces(&flat), op)
            } else {
                comm.reduce_scatter_async(T::into_buffer(flat.clone()), op)
            };
            let got = work.wait_vec::<T>().unwrap_or_else(|e| panic!("{what}: {e}"));
            let d = comm.stats().snapshot() - before;
            assert_eq!(d.calls(OpKind::ReduceScatter), 1, "{what}");
            assert_eq!(
                d.bytes(OpKind::ReduceScatter),
                OpKind::ReduceScatter.bytes_sent(n, len * T::DTYPE.size_in_bytes()),
                "{what}"
            );
            assert_eq!(bits(&got), bits(&want), "{what}");
        }
        // The gather: the same cuts over a send of `len` elements, segments cut
        // elsewhere (an empty one, one across the run of zeros).
        let segments = [a.min(2), 0, len - a.min(2)];
        let what = format!("all_gather_segmented pieces {} len {len} rank {r}/{n}", T::DTYPE);
        let want = comm
            .all_gather_segmented_async(T::into_buffer(flat.clone()), segments.to_vec())
            .wait_vec::<T>()
            .unwrap_or_else(|e| panic!("{what} (flat): {e}"));
        let work = if r % 2 == 0 {
            comm.all_gather_segmented_pieces_async(pieces(&flat), segments.to_vec())
        } else {
            comm.all_gather_segmented_async(T::into_buffer(flat.clone()), segments.to_vec())
        };
        let got = work.wait_vec::<T>().unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_eq!(got.len(), len * n, "{what}");
        assert_eq!(bits(&got), bits(&want), "{what}");
    }
    // Segments that do not tile the pieces: the local error, on every rank.
    let mut p = crate::Pieces::new(T::DTYPE);
    p.push_zeros(5);
    let err = comm
        .all_gather_segmented_pieces_async(p, vec![2, 2])
        .wait()
        .expect_err("segments of 4 elements for pieces of 5");
    assert!(err.to_string().contains("all_gather_segmented"), "{err}");
}

/// The asynchronous forms of `T`: several in flight at once, waited in any order,
/// interleaved with a blocking collective (which must run after them).
pub fn check_async<T: TestElement>(comm: &dyn Communicator) {
    let (r, n) = (comm.rank(), comm.size());
    let len = 13;
    let w_gather = comm.all_gather_async(T::into_buffer(input(r, len, value)));
    let w_a2a = comm.all_to_all_async(T::into_buffer(input(r, len * n, value)));
    let w_bcast = comm.broadcast_async(T::into_buffer(input(r, len, value)), n - 1);
    let reduce = reductions_for(T::DTYPE).first().copied();
    let w_reduce = reduce.map(|op| {
        (
            comm.all_reduce_async(T::into_buffer(input(r, len, value)), op),
            comm.reduce_scatter_async(T::into_buffer(input(r, len * n, value)), op),
        )
    });
    // A blocking collective issued now runs after every queued one.
    let mut x = vec![T::from_f64(r as f64); 3];
    comm.broadcast_slice(&mut x, 0)
        .expect("blocking broadcast after async ones");
    assert_close("broadcast after async", &x, |_| 0.0);

    let what = format!("async {} rank {r}/{n}", T::DTYPE);
    if let Some((w_ar, w_rs)) = w_reduce {
        let op = reduce.unwrap_or(ReduceOp::Sum);
        let rs = w_rs
            .wait_vec::<T>()
            .unwrap_or_else(|e| panic!("{what} reduce_scatter: {e}"));
        assert_close(&what, &rs, |i| reduce_oracle(op, n, r * len + i));
        let ar = w_ar
            .wait_vec::<T>()
            .unwrap_or_else(|e| panic!("{what} all_reduce: {e}"));
        assert_close(&what, &ar, |i| reduce_oracle(op, n, i));
    }
    let b = w_bcast
        .wait_vec::<T>()
        .unwrap_or_else(|e| panic!("{what} broadcast: {e}"));
    assert_close(&what, &b, |i| value(n - 1, i));
    let a = w_a2a
        .wait_vec::<T>()
        .unwrap_or_else(|e| panic!("{what} all_to_all: {e}"));
    assert_close(&what, &a, |i| value(i / len, r * len + i % len));
    let g = w_gather
        .wait_vec::<T>()
        .unwrap_or_else(|e| panic!("{what} all_gather: {e}"));
    assert_close(&what, &g, |i| value(i / len, i % len));
}

/// Total sizes split by the variable-count checks: empty, smaller than the group,
/// uneven, and (4500) segments longer than one reduction block.
pub const V_SIZES: [usize; 6] = [0, 1, 5, 6, 13, 4500];

/// How `torch.chunk` splits `size` elements over `n` ranks: chunks of
/// `ceil(size / n)`, the last ones short or empty (5 over 4 → 2, 2, 1, 0).
pub fn chunk_counts(size: usize, n: usize) -> Vec<usize> {
    let c = size.div_ceil(n.max(1));
    (0..n).map(|q| c.min(size.saturating_sub(q * c))).collect()
}

/// Uneven counts with zeros anywhere (not only at the end), seeded by `k`.
fn ragged_counts(k: usize, n: usize) -> Vec<usize> {
    (0..n).map(|q| (q * 5 + k) % 4).collect()
}

fn prefix(counts: &[usize], q: usize) -> usize {
    counts[..q].iter().sum()
}

/// all_gather_v, reduce_scatter_v (every reduction the dtype allows) and
/// all_to_all_v of `T` with uneven counts, zeros included.
pub fn check_variable<T: TestElement>(comm: &dyn Communicator) {
    let (r, n) = (comm.rank(), comm.size());
    let mut cases: Vec<(String, Vec<usize>)> = V_SIZES
        .iter()
        .map(|&s| (format!("chunk({s})"), chunk_counts(s, n)))
        .collect();
    cases.extend((0..3).map(|k| (format!("ragged({k})"), ragged_counts(k, n))));
    for (name, counts) in &cases {
        let total: usize = counts.iter().sum();
        let ctx = |op: &str| format!("{op} {} counts {name} = {counts:?} rank {r}/{n}", T::DTYPE);

        let send = input::<T>(r, counts[r], value);
        let mut got = vec![T::default(); total];
        comm.all_gather_v(T::buf(&send), T::buf_mut(&mut got), counts)
            .unwrap_or_else(|e| panic!("{}: {e}", ctx("all_gather_v")));
        // Segment q holds rank q's input.
        let owner = |i: usize| (0..n).rfind(|&q| prefix(counts, q) <= i && counts[q] > 0).unwrap_or(0);
        assert_close(&ctx("all_gather_v"), &got, |i| {
            let q = owner(i);
            value(q, i - prefix(counts, q))
        });

        for op in reductions_for(T::DTYPE) {
            let f = if op == ReduceOp::Product { pvalue } else { value };
            let what = ctx(&format!("reduce_scatter_v({op})"));
            let send: Vec<T> = input(r, total, f);
            let mut recv = vec![T::default(); counts[r]];
            comm.reduce_scatter_v(T::buf(&send), T::buf_mut(&mut recv), counts, op)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_close(&what, &recv, |i| reduce_oracle(op, n, prefix(counts, r) + i));
        }
    }

    // all_to_all_v: rank i sends m[i][j] elements to rank j. Shard(0) → Shard(1)
    // of an a × b matrix (torch.chunk splits of both dims) and ragged matrices.
    let mut matrices: Vec<(String, Vec<Vec<usize>>)> = Vec::new();
    for (a, b) in [(5, 6), (0, 3), (1, 13), (13, 1), (4, 4)] {
        let (ra, cb) = (chunk_counts(a, n), chunk_counts(b, n));
        let m = (0..n).map(|i| (0..n).map(|j| ra[i] * cb[j]).collect()).collect();
        matrices.push((format!("shard {a}x{b}"), m));
    }
    for k in 0..3 {
        let m = (0..n)
            .map(|i| (0..n).map(|j| (i * 3 + j * 5 + k) % 4).collect())
            .collect();
        matrices.push((format!("ragged({k})"), m));
    }
    for (name, m) in &matrices {
        let send_counts = &m[r];
        let recv_counts: Vec<usize> = (0..n).map(|i| m[i][r]).collect();
        let what = format!("all_to_all_v {} {name} = {m:?} rank {r}/{n}", T::DTYPE);
        let send = input::<T>(r, send_counts.iter().sum(), value);
        let mut got = vec![T::default(); recv_counts.iter().sum()];
        comm.all_to_all_v(T::buf(&send), send_counts, T::buf_mut(&mut got), &recv_counts)
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        // Segment i comes from rank i: its segment r, which starts at prefix(m[i], r).
        let from = |k: usize| {
            (0..n)
                .rfind(|&i| prefix(&recv_counts, i) <= k && recv_counts[i] > 0)
                .unwrap_or(0)
        };
        assert_close(&what, &got, |k| {
            let i = from(k);
            value(i, prefix(&m[i], r) + k - prefix(&recv_counts, i))
        });
    }
}

/// Runs `$f::<T>(comm)` for every element type.
macro_rules! for_all_types {
    ($f:ident, $comm:expr) => {{
        $f::<f32>($comm);
        $f::<f64>($comm);
        $f::<bf16>($comm);
        $f::<f16>($comm);
        $f::<i64>($comm);
        $f::<u8>($comm);
    }};
}

/// Splits `comm` into even and odd ranks (reverse order by key) and checks the sub-groups.
pub fn check_split(comm: &dyn Communicator) {
    let (r, n) = (comm.rank(), comm.size());
    let sub = comm.split((r % 2) as u32, (n - r) as u32).expect("split");
    let members: Vec<usize> = (0..n).filter(|q| q % 2 == r % 2).rev().collect();
    assert_eq!(sub.size(), members.len(), "split size on rank {r}");
    assert_eq!(members[sub.rank()], r, "split rank order on rank {r}");
    let got = sub.all_gather_vec(&[r as i64]).expect("all_gather on split");
    assert_eq!(
        got,
        members.iter().map(|&q| q as i64).collect::<Vec<_>>(),
        "split all_gather on rank {r}"
    );
    for_all_types!(check_blocking, &*sub);
    check_variable_all(&*sub);
}

/// [`check_variable`] for every element type.
pub fn check_variable_all(comm: &dyn Communicator) {
    for_all_types!(check_variable, comm);
}

/// all_to_all_v_runs and all_gather_v_runs of `T`: an a × b matrix (a value
/// per global element) goes from row blocks to column blocks (each piece a
/// strided box of its sender's rows, and of its receiver's columns), then the
/// column blocks gather into the whole matrix; sizes uneven and some blocks
/// empty for larger groups; then partial sums of the whole matrix
/// reduce-scatter into the column blocks. Counted as their `_v` forms.
pub fn check_runs<T: TestElement>(comm: &dyn Communicator) {
    use crate::Run;
    let (r, n) = (comm.rank(), comm.size());
    for (a, b) in [(2 * n + 1, 3 * n + 2), (3, 5), (1, 1)] {
        let what = |op: &str| format!("{op} {} {a}x{b} rank {r}/{n}", T::DTYPE);
        let global = |row: usize, col: usize| value(0, row * b + col);
        let (ra, cb) = (chunk_counts(a, n), chunk_counts(b, n));
        let (ro, co) = (|q: usize| prefix(&ra, q), |q: usize| prefix(&cb, q));
        // Rows ro(i).. of every column on rank i ([ra[i], b]), all rows of
        // columns co(j).. on rank j ([a, cb[j]]): rank i's row x, columns of j.
        let moved = |i: usize, j: usize| -> Vec<Run> {
            (0..ra[i])
                .filter(|_| cb[j] > 0)
                .map(|x| Run {
                    src: x * b + co(j),
                    dst: (ro(i) + x) * cb[j],
                    len: cb[j],
                })
                .collect()
        };
        let send: Vec<T> = (0..ra[r] * b)
            .map(|k| T::from_f64(global(ro(r) + k / b, k % b)))
            .collect();
        let send_runs: Vec<Vec<Run>> = (0..n).map(|j| moved(r, j)).collect();
        let recv_runs: Vec<Vec<Run>> = (0..n).map(|i| moved(i, r)).collect();
        let mut cols = vec![T::default(); a * cb[r]];
        comm.all_to_all_v_runs(T::buf(&send), &send_runs, T::buf_mut(&mut cols), &recv_runs)
            .unwrap_or_else(|e| panic!("{}: {e}", what("all_to_all_v_runs")));
        assert_close(&what("all_to_all_v_runs"), &cols, |k| {
            global(k / cb[r], co(r) + k % cb[r])
        });

        // Column block q ([a, cb[q]]) lands in columns co(q).. of every row.
        let placed: Vec<Vec<Run>> = (0..n)
            .map(|q| {
                (0..a)
                    .filter(|_| cb[q] > 0)
                    .map(|y| Run {
                        src: y * cb[q],
                        dst: y * b + co(q),
                        len: cb[q],
                    })
                    .collect()
            })
            .collect();
        let before = comm.stats().snapshot();
        let mut whole = vec![T::default(); a * b];
        comm.all_gather_v_runs(T::buf(&cols), T::buf_mut(&mut whole), &placed)
            .unwrap_or_else(|e| panic!("{}: {e}", what("all_gather_v_runs")));
        assert_close(&what("all_gather_v_runs"), &whole, |k| global(k / b, k % b));
        let d = comm.stats().snapshot() - before;
        // Partial sums of the whole matrix (rank q holds value(q, ·)) reduce
        // into column blocks: each block's runs are strided in every input.
        if reductions_for(T::DTYPE).contains(&ReduceOp::Sum) {
            let full: Vec<T> = input(r, a * b, value);
            let mut block = vec![T::default(); a * cb[r]];
            comm.reduce_scatter_v_runs(
                T::buf(&full),
                T::buf_mut(&mut block),
                &placed_src(&placed),
                ReduceOp::Sum,
            )
            .unwrap_or_else(|e| panic!("{}: {e}", what("reduce_scatter_v_runs")));
            assert_close(&what("reduce_scatter_v_runs"), &block, |k| {
                let at = (k / cb[r]) * b + co(r) + k % cb[r];
                (0..n).map(|q| value(q, at)).sum()
            });
        }
        // (A provided default exchanges counts first: one more all_gather.)
        assert!(
            d.calls(OpKind::AllGather) >= 1 && d.calls(OpKind::AllToAll) == 0,
            "{}",
            what("all_gather_v_runs counted as all_gather_v")
        );
    }
}

/// A gather's runs seen from the other side: the reduce-scatter that splits
/// what `placed` gathered reads each run at its `dst` and writes it at its `src`.
fn placed_src(placed: &[Vec<crate::Run>]) -> Vec<Vec<crate::Run>> {
    placed
        .iter()
        .map(|runs| {
            runs.iter()
                .map(|r| crate::Run {
                    src: r.dst,
                    dst: r.src,
                    len: r.len,
                })
                .collect()
        })
        .collect()
}

/// Checks that the per-rank counters count each collective and its bytes.
pub fn check_stats(comm: &dyn Communicator) {
    let n = comm.size();
    let before = comm.stats().snapshot();
    let _ = comm.all_gather_vec(&[1.0f32; 8]).expect("all_gather");
    let mut x = [1.0f64; 8];
    comm.all_reduce_slice(&mut x, ReduceOp::Sum).expect("all_reduce");
    comm.barrier().expect("barrier");
    let d = comm.stats().snapshot() - before;
    assert_eq!(d.calls(OpKind::AllGather), 1);
    assert_eq!(d.calls(OpKind::AllReduce), 1);
    assert_eq!(d.calls(OpKind::Barrier), 1);
    assert_eq!(d.bytes(OpKind::AllGather), OpKind::AllGather.bytes_sent(n, 32 * n));
    assert_eq!(d.bytes(OpKind::AllReduce), OpKind::all_reduce_sent(n, comm.rank(), 64));
}

/// Every check above, for every element type.
pub fn check_all(comm: &dyn Communicator) {
    for_all_types!(check_blocking, comm);
    for_all_types!(check_async, comm);
    for_all_types!(check_segmented, comm);
    for_all_types!(check_pieces, comm);
    check_variable_all(comm);
    for_all_types!(check_runs, comm);
    check_split(comm);
    check_stats(comm);
    comm.barrier().expect("final barrier");
}

/// Builds a mesh of `shape` over `world` (every rank of it) and checks that each
/// mesh dim's communicator holds exactly the ranks that differ only along that
/// dim, in coordinate order, and passes the blocking, asynchronous and
/// variable-count checks.
pub fn check_mesh(world: Box<dyn Communicator>, shape: &[usize]) {
    let world_rank = world.rank();
    let mesh = DeviceMesh::new(world, shape).expect("mesh");
    for d in 0..shape.len() {
        let comm = mesh.dim_comm(d).expect("dim communicator");
        assert_eq!(comm.size(), shape[d], "mesh {shape:?} dim {d} size");
        assert_eq!(comm.rank(), mesh.coordinate()[d], "mesh {shape:?} dim {d} rank");
        let got = comm.all_gather_vec(&[world_rank as i64]).expect("all_gather");
        let stride: usize = shape[d + 1..].iter().product();
        let base = world_rank - mesh.coordinate()[d] * stride;
        let want: Vec<i64> = (0..shape[d]).map(|k| (base + k * stride) as i64).collect();
        assert_eq!(got, want, "mesh {shape:?} dim {d} members seen by rank {world_rank}");
        check_blocking::<f32>(comm);
        check_blocking::<bf16>(comm);
        check_async::<i64>(comm);
        check_segmented::<f32>(comm);
        check_variable::<f32>(comm);
        check_variable::<i64>(comm);
        check_runs::<f32>(comm);
    }
}

/// Asynchronous collectives overlap: rank 0 issues an all_gather while every
/// other rank is still asleep (for `delay`), gets its handle back at once and
/// sees it unfinished, computes, and only then waits. A backend that ran the
/// collective inside the issue call would block there for `delay`.
///
/// For backends whose ranks cannot share memory (MPI); the threads backend's own
/// test orders the ranks with a flag instead of a delay.
pub fn check_overlap(comm: &dyn Communicator, delay: Duration) {
    let (r, n) = (comm.rank(), comm.size());
    comm.barrier().expect("barrier");
    if r != 0 {
        std::thread::sleep(delay);
    }
    let t = Instant::now();
    let mut work = comm.all_gather_async(f32::into_buffer(vec![r as f32; 1000]));
    if r == 0 {
        let issued_in = t.elapsed();
        assert!(
            issued_in < delay / 2,
            "all_gather_async took {issued_in:?} to return while peers slept {delay:?}: it does not overlap"
        );
        assert!(!work.is_done(), "the all_gather finished before the peers entered it");
    }
    let busy: f64 = (0..200_000).map(|i| (i as f64).sqrt()).sum();
    assert!(busy > 0.0);
    let got = work.wait_vec::<f32>().expect("all_gather_async");
    let want: Vec<f32> = (0..n).flat_map(|q| vec![q as f32; 1000]).collect();
    assert_eq!(got, want, "overlapped all_gather on rank {r}");
}
