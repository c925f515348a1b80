//! Parallel loops over a rank's helper threads: blocks of whole rows, so that
//! every element is computed by the same code in the same order whatever the split.

/// Fewest elements of output per thread that a kernel splits over the rank's
/// threads: below it, handing out the parts costs more than they save.
pub const PAR_MIN_ELEMENTS: usize = 1 << 15;

/// How many threads the kernels' row loops split an output of `len` elements over (1:
/// not split).
pub fn par_parts(len: usize) -> usize {
    (len / PAR_MIN_ELEMENTS).clamp(1, tessera_mesh::intra_op_threads())
}

/// Runs `f(start, block)` over blocks of `out` that hold whole rows of `row`
/// elements (`start` is the block's first element), one block per thread on
/// the rank's [`intra_op_threads`](tessera_mesh::intra_op_threads) when each
/// gets at least [`PAR_MIN_ELEMENTS`], else one block on this thread.
pub(crate) fn par_rows<C: Send>(out: &mut [C], row: usize, f: impl Fn(usize, &mut [C]) + Sync) {
    par_blocks(out, row, par_parts(out.len()), f);
}

/// [`par_rows`] over at most `parts` blocks: for outputs much smaller than the
/// work behind them (one loss per row of logits), with `parts` from
/// [`par_parts`] of the work's size.
pub(crate) fn par_blocks<C: Send>(out: &mut [C], row: usize, parts: usize, f: impl Fn(usize, &mut [C]) + Sync) {
    let rows = out.len().checked_div(row).unwrap_or(0);
    let parts = parts.min(rows);
    if parts <= 1 {
        f(0, out);
        return;
    }
    let per = rows.div_ceil(parts) * row;
    let blocks: Vec<std::sync::Mutex<&mut [C]>> = out.chunks_mut(per).map(std::sync::Mutex::new).collect();
    tessera_mesh::parallel_for(blocks.len(), |i| {
        let mut block = blocks[i].lock().unwrap_or_else(|e| e.into_inner());
        f(i * per, &mut block);
    });
}

/// Sums over rows into `acc`, one element per column (a reduction over the
/// leading dims, a norm's weight gradient): `f(c0, cols)` adds every row's
/// columns `c0..c0 + cols.len()` into `cols`, in row order, in blocks of
/// columns over the rank's threads when the `work` (elements read) is large
/// enough ([`par_parts`]). Each block accumulates in a buffer of its own and
/// is copied out once: blocks of `acc` share a cache line where they meet,
/// and two threads updating it on every row passed it between their cores
/// (two threads summed `[1024, 256]` over its rows 2.3x slower than one).
/// Every column gets the bits one thread would give it.
pub(crate) fn par_columns<A: Copy + Send>(acc: &mut [A], work: usize, f: impl Fn(usize, &mut [A]) + Sync) {
    let parts = par_parts(work);
    if parts <= 1 {
        f(0, acc);
        return;
    }
    par_blocks(acc, 1, parts, |c0, block| {
        let mut own = block.to_vec();
        f(c0, &mut own);
        block.copy_from_slice(&own);
    });
}
