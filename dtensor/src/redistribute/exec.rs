//! Runs a [`Plan`] on this rank's local tensor.
//!
//! Every step that moves shards is an exchange of regions of the global tensor:
//! for each peer, the part of this rank's current region that the peer's next
//! region needs is packed into the send buffer; what arrives is placed into this
//! rank's next region. When those parts are consecutive row-major runs (gathering
//! or scattering along the outermost dim), the local buffer is sent as is and the
//! received buffer becomes the result, with no packing copies; when they are
//! strided boxes, an all-gather or all-to-all moves them as lists of runs
//! (`all_gather_v_runs`, `all_to_all_v_runs`), each element read where its
//! sender holds it and written where its receiver wants it (one copy on the
//! threads backend; the provided defaults pack and unpack).

use std::borrow::Cow;

use tessera_mesh::{Communicator, DeviceMesh, Element, Planned, ReduceOp, Run};

use super::step::{Plan, StepKind};
use super::{group_coords, group_index};
use crate::spec::{Layout, Region};
use crate::tensor_comm::{HostComm, TensorComm, tensor_path_forced};
use crate::{Result, Tensor};
use tessera_tensor::alloc::{checked_len, reused};

/// The op named in allocation errors.
const OP: &str = "redistribute";

/// Runs `plan` on `local` (this rank's tensor of `plan.src`), returning the local
/// tensor of `plan.dst()`.
pub(crate) fn execute(local: &Tensor, mesh: &DeviceMesh, plan: &Plan) -> Result<Tensor> {
    let _t = tessera_tensor::profile::scope(tessera_tensor::profile::Kind::Communication);
    let coord = mesh.coordinate();
    let mut t = local.clone();
    for (before, step) in plan.transitions() {
        // A one-rank group moves nothing: this rank's piece is the same before
        // and after, so no collective (and no synchronization) is issued.
        if step.kind.collective().is_some() && step.collective().is_none() {
            debug_assert_eq!(before.region(coord)?, step.after.region(coord)?);
            continue;
        }
        // One mesh dim talks over its own communicator; several over the
        // sub-mesh of those dims (split once per mesh, then reused).
        let sub;
        let comm = match &step.mesh_dims[..] {
            [m] => mesh.dim_comm(*m)?,
            dims if dims.len() == mesh.ndim() => mesh.comm(),
            dims => {
                sub = mesh.slice_dims(dims)?;
                sub.comm()
            }
        };
        let ex = Exchange {
            comm,
            before,
            after: &step.after,
            coord,
            group: &step.mesh_dims,
        };
        t = if t.is_cuda() {
            ex.run_on_device(&t, step.kind)?
        } else if t.is_meta() {
            ex.run_meta(&t, step.kind)?
        } else if tensor_path_forced() {
            ex.run_tensors(&t, step.kind, &HostComm(comm))?
        } else {
            tessera_tensor::any_dispatch!("redistribute", t.dtype(), T => ex.run::<T>(&t, step.kind)?)
        };
    }
    Ok(t)
}

/// Outgoing and incoming regions of an all-to-all, and their element counts.
type AllToAllParts = (Vec<Region>, Vec<Region>, Vec<usize>, Vec<usize>);

/// One step's context.
struct Exchange<'a> {
    comm: &'a dyn Communicator,
    before: &'a Layout,
    after: &'a Layout,
    coord: &'a [usize],
    group: &'a [usize],
}

impl Exchange<'_> {
    fn regions(&self, layout: &Layout) -> Result<Vec<Region>> {
        group_coords(&layout.mesh_shape, self.coord, self.group)
            .iter()
            .map(|c| layout.region(c))
            .collect()
    }

    /// An all-to-all's parts: what this rank's current region sends to each
    /// peer, what it receives from each, and their element counts.
    fn all_to_all_parts(&self, mine_before: &Region, mine_after: &Region) -> Result<AllToAllParts> {
        let outgoing: Vec<Region> = self
            .regions(self.after)?
            .iter()
            .map(|r| mine_before.intersect(r))
            .collect();
        let incoming: Vec<Region> = self
            .regions(self.before)?
            .iter()
            .map(|r| r.intersect(mine_after))
            .collect();
        let send_counts = outgoing.iter().map(Region::numel).collect();
        let recv_counts = incoming.iter().map(Region::numel).collect();
        Ok((outgoing, incoming, send_counts, recv_counts))
    }

    fn run<T: Element>(&self, t: &Tensor, kind: StepKind) -> Result<Tensor> {
        let mine_before = self.before.region(self.coord)?;
        let mine_after = self.after.region(self.coord)?;
        // The new region's size is checked before any count below is computed
        // from it (the before region is the tensor this rank already holds).
        checked_len(OP, &mine_after.shape, T::DTYPE)?;
        let t = t.contiguous();
        let src: &[T] = t.as_slice()?;
        let out: Vec<T> = match kind {
            StepKind::Slice => pack(src, &mine_before, std::slice::from_ref(&mine_after))?.into_owned(),
            StepKind::Partition { op } => {
                // Partitions are planned along one mesh dim; along several, the
                // value stays on the group's first rank.
                if self.group.iter().all(|&m| self.coord[m] == 0) {
                    return Ok(t);
                }
                return match op {
                    ReduceOp::Sum => Ok(Tensor::zeros(t.shape(), t.dtype())?),
                    ReduceOp::Product => Ok(Tensor::ones(t.shape(), t.dtype())?),
                    _ => Ok(t),
                };
            }
            StepKind::AllReduce { op } => {
                let mut out = buffer_for::<T>(src.len(), &mine_after)?;
                self.comm.all_reduce_into(T::buf(src), T::buf_mut(&mut out), op)?;
                out
            }
            StepKind::AllGather => {
                // Each piece lands in place, read where its sender holds it
                // (strided when gathering along an inner dim).
                let pieces = self.regions(self.before)?;
                let runs: Vec<Vec<Run>> = pieces.iter().map(|p| runs(p, &mine_after, p)).collect();
                let mut recv = buffer_for::<T>(mine_after.numel(), &mine_after)?;
                self.comm.all_gather_v_runs(T::buf(src), T::buf_mut(&mut recv), &runs)?;
                recv
            }
            StepKind::ReduceScatter { op, .. } => {
                // Every rank of the group holds the same region (partial sums
                // of it): each block reduced run by run where the ranks hold
                // it, strided or not.
                let pieces = self.regions(self.after)?;
                let runs: Vec<Vec<Run>> = pieces.iter().map(|p| runs(&mine_before, p, p)).collect();
                let mut recv = buffer_for::<T>(mine_after.numel(), &mine_after)?;
                self.comm
                    .reduce_scatter_v_runs(T::buf(src), T::buf_mut(&mut recv), &runs, op)?;
                recv
            }
            StepKind::AllToAll => {
                // To each peer: this rank's region where the peer's next one
                // meets it; from each: the peer's region where it meets ours.
                // Each run read where its sender holds it and written where
                // its receiver wants it: no packing or unpacking pass.
                let send_runs: Vec<Vec<Run>> = (self.regions(self.after)?.iter())
                    .map(|to| runs(&mine_before, to, &mine_before.intersect(to)))
                    .collect();
                let recv_runs: Vec<Vec<Run>> = (self.regions(self.before)?.iter())
                    .map(|from| runs(from, &mine_after, &from.intersect(&mine_after)))
                    .collect();
                let mut recv = buffer_for::<T>(mine_after.numel(), &mine_after)?;
                self.comm
                    .all_to_all_v_runs(T::buf(src), &send_runs, T::buf_mut(&mut recv), &recv_runs)?;
                recv
            }
        };
        Ok(Tensor::from_vec(out, &mine_after.shape)?)
    }
}

impl Exchange<'_> {
    /// [`run`](Self::run) in a planning run (a meta tensor): the collective
    /// that `run` issues, counted as issuing it would count it
    /// ([`Communicator::count_planned`]), and its output, the buffer `run`
    /// allocates; nothing moves.
    fn run_meta(&self, t: &Tensor, kind: StepKind) -> Result<Tensor> {
        let mine_before = self.before.region(self.coord)?;
        let mine_after = self.after.region(self.coord)?;
        let dtype = t.dtype();
        checked_len(OP, &mine_after.shape, dtype)?;
        let t = t.contiguous();
        let numels = |regions: Vec<Region>| regions.iter().map(Region::numel).collect::<Vec<_>>();
        match kind {
            StepKind::Slice => {}
            StepKind::Partition { op } => {
                if self.group.iter().all(|&m| self.coord[m] == 0) {
                    return Ok(t);
                }
                return match op {
                    ReduceOp::Sum | ReduceOp::Product => Ok(Tensor::meta(t.shape(), dtype)?),
                    _ => Ok(t),
                };
            }
            StepKind::AllReduce { op } => {
                op.check("all_reduce", dtype)?;
                self.comm.count_planned(Planned::AllReduce { dtype, len: t.numel() })?;
            }
            StepKind::AllGather => {
                let counts = numels(self.regions(self.before)?);
                self.comm.count_planned(Planned::AllGather { dtype, counts: &counts })?;
            }
            StepKind::ReduceScatter { op, .. } => {
                op.check("reduce_scatter", dtype)?;
                let counts = numels(self.regions(self.after)?);
                self.comm
                    .count_planned(Planned::ReduceScatter { dtype, counts: &counts })?;
            }
            StepKind::AllToAll => {
                let (_, _, send_counts, _) = self.all_to_all_parts(&mine_before, &mine_after)?;
                self.comm.count_planned(Planned::AllToAll {
                    dtype,
                    send_counts: &send_counts,
                })?;
            }
        }
        Ok(Tensor::meta(&mine_after.shape, dtype)?)
    }

    /// [`run`](Self::run) for a tensor on a GPU: the tensor path over the
    /// GPU's collectives between ranks that share it.
    fn run_on_device(&self, t: &Tensor, kind: StepKind) -> Result<Tensor> {
        let group = crate::tensor_comm::device_group(self.comm, t)?;
        self.run_tensors(t, kind, &*group)
    }

    /// [`run`](Self::run) in whole-tensor ops (views, copies, concatenation,
    /// [`Tensor::assemble`]) and whole-tensor collectives: what device
    /// tensors, whose elements the host cannot slice, take.
    fn run_tensors(&self, t: &Tensor, kind: StepKind, comm: &dyn TensorComm) -> Result<Tensor> {
        let mine_before = self.before.region(self.coord)?;
        let mine_after = self.after.region(self.coord)?;
        checked_len(OP, &mine_after.shape, t.dtype())?;
        let me = group_index(&self.before.mesh_shape, self.coord, self.group);
        let flat = match kind {
            StepKind::Slice => pack_tensor(t, &mine_before, std::slice::from_ref(&mine_after))?,
            StepKind::Partition { op } => {
                if self.group.iter().all(|&m| self.coord[m] == 0) {
                    return Ok(t.clone());
                }
                return Ok(match op {
                    ReduceOp::Sum => Tensor::assemble(t.shape(), t.dtype(), t.device(), &[])?,
                    ReduceOp::Product => Tensor::ones(t.shape(), t.dtype())?.to(t.device())?,
                    _ => t.clone(),
                });
            }
            StepKind::AllReduce { op } => comm.all_reduce(&t.contiguous().reshape(&[t.numel()])?, op)?,
            StepKind::AllGather => {
                let pieces = self.regions(self.before)?;
                let counts: Vec<usize> = pieces.iter().map(Region::numel).collect();
                let recv = comm.all_gather_v(&t.contiguous().reshape(&[t.numel()])?, &counts)?;
                place_tensor(recv, &mine_after, &pieces)?
            }
            StepKind::ReduceScatter { op, .. } => {
                let pieces = self.regions(self.after)?;
                let counts: Vec<usize> = pieces.iter().map(Region::numel).collect();
                let send = pack_tensor(t, &mine_before, &pieces)?;
                let _ = me;
                comm.reduce_scatter_v(&send, &counts, op)?
            }
            StepKind::AllToAll => {
                let (outgoing, incoming, send_counts, recv_counts) =
                    self.all_to_all_parts(&mine_before, &mine_after)?;
                let send = pack_tensor(t, &mine_before, &outgoing)?;
                let recv = comm.all_to_all_v(&send, &send_counts, &recv_counts)?;
                place_tensor(recv, &mine_after, &incoming)?
            }
        };
        Ok(flat.reshape(&mine_after.shape)?)
    }
}

/// The box `part` of `t` (laid out as `outer`), as a view.
fn box_of(t: &Tensor, outer: &Region, part: &Region) -> Result<Tensor> {
    let rel = part.relative_to(outer);
    let mut v = t.clone();
    for (d, (&at, &len)) in rel.iter().zip(&part.shape).enumerate() {
        v = v.narrow(d, at, len)?;
    }
    Ok(v)
}

/// [`pack`] for whole tensors: the parts of `t` (laid out as `outer`)
/// flattened and concatenated in order, a flat view when they already are.
fn pack_tensor(t: &Tensor, outer: &Region, parts: &[Region]) -> Result<Tensor> {
    let flat = t.contiguous().reshape(&[t.numel()])?;
    if tiles_in_order(outer, parts) {
        return Ok(flat);
    }
    // Empty parts (a peer whose box misses this rank's) send nothing.
    let pieces = parts
        .iter()
        .filter(|p| p.numel() > 0)
        .map(|p| Ok(box_of(t, outer, p)?.contiguous().reshape(&[p.numel()])?))
        .collect::<Result<Vec<Tensor>>>()?;
    if pieces.is_empty() {
        return Ok(flat.narrow(0, 0, 0)?);
    }
    Ok(Tensor::cat(&pieces, 0)?)
}

/// [`place_all`] for whole tensors: the concatenated `parts` of the flat
/// `data` placed into a tensor laid out as `outer` (flat); `data` itself when
/// the parts tile `outer` in order.
fn place_tensor(data: Tensor, outer: &Region, parts: &[Region]) -> Result<Tensor> {
    if tiles_in_order(outer, parts) {
        return Ok(data);
    }
    let mut at = 0;
    let mut boxes = Vec::with_capacity(parts.len());
    for p in parts.iter().filter(|p| p.numel() > 0) {
        boxes.push((p.relative_to(outer), data.narrow(0, at, p.numel())?.reshape(&p.shape)?));
        at += p.numel();
    }
    let refs: Vec<(&[usize], &Tensor)> = boxes.iter().map(|(o, b)| (&o[..], b)).collect();
    let out = Tensor::assemble(&outer.shape, data.dtype(), data.device(), &refs)?;
    Ok(out.reshape(&[outer.numel()])?)
}

/// A buffer of `n` elements for this rank's new region `r`; an allocation error
/// names `r`'s shape when the buffer is all of it, else the flat count.
fn buffer_for<T: Element>(n: usize, r: &Region) -> Result<Vec<T>> {
    let flat = [n];
    let shape = if r.numel() == n { &r.shape[..] } else { &flat[..] };
    Ok(reused(OP, shape)?)
}

/// Row-major strides of `shape`.
fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        s[d] = s[d + 1] * shape[d + 1];
    }
    s
}

/// If `part` (inside `outer`) is one contiguous run of `outer`'s row-major buffer,
/// its start.
fn run_start(outer: &Region, part: &Region) -> Option<usize> {
    let rel = part.relative_to(outer);
    let st = strides(&outer.shape);
    let start = rel.iter().zip(&st).map(|(o, s)| o * s).sum();
    if part.numel() == 0 {
        return Some(start);
    }
    let Some(k) = (0..outer.shape.len()).rev().find(|&d| part.shape[d] != outer.shape[d]) else {
        return Some(start);
    };
    part.shape[..k].iter().all(|&s| s == 1).then_some(start)
}

/// Whether `parts`, in order, are consecutive runs tiling `outer`'s buffer.
fn tiles_in_order(outer: &Region, parts: &[Region]) -> bool {
    let mut at = 0;
    for p in parts.iter().filter(|p| p.numel() > 0) {
        if run_start(outer, p) != Some(at) {
            return false;
        }
        at += p.numel();
    }
    at == outer.numel()
}

/// Calls `f(src_offset, dst_offset, len)` for each maximal contiguous run of
/// `part`, in row-major order, where `src` is laid out as `a` and `dst` as `b`
/// (both contain `part`). Trailing dims that `part`, `a` and `b` all hold whole
/// merge into one run: whole rows of a matrix are a single run.
pub(crate) fn for_each_run(a: &Region, b: &Region, part: &Region, mut f: impl FnMut(usize, usize, usize)) {
    if part.numel() == 0 {
        return;
    }
    let nd = part.shape.len();
    if nd == 0 {
        f(0, 0, 1);
        return;
    }
    let (sa, sb) = (strides(&a.shape), strides(&b.shape));
    let (ra, rb) = (part.relative_to(a), part.relative_to(b));
    let (k, run) = run_dims(a, b, part);
    // The offsets of the run at `idx` (over dims `..k`), kept as `idx` steps.
    let mut idx = vec![0usize; k];
    let mut oa: usize = (0..nd).map(|d| ra[d] * sa[d]).sum();
    let mut ob: usize = (0..nd).map(|d| rb[d] * sb[d]).sum();
    loop {
        f(oa, ob, run);
        let mut d = k;
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            idx[d] += 1;
            (oa, ob) = (oa + sa[d], ob + sb[d]);
            if idx[d] < part.shape[d] {
                break;
            }
            idx[d] = 0;
            (oa, ob) = (oa - sa[d] * part.shape[d], ob - sb[d] * part.shape[d]);
        }
    }
}

/// The first dim `k` a run of `part` spans (every dim after it is whole in
/// `a`, `b` and `part`) and the run's length.
fn run_dims(a: &Region, b: &Region, part: &Region) -> (usize, usize) {
    let nd = part.shape.len();
    let mut k = nd.saturating_sub(1);
    while k > 0 && part.shape[k] == a.shape[k] && part.shape[k] == b.shape[k] {
        k -= 1;
    }
    (k, part.shape[k..].iter().product())
}

/// The runs of `part` from a buffer laid out as `a` to one laid out as `b`
/// ([`for_each_run`]): what a runs collective moves of it. Sender and
/// receiver derive the same list from the same regions.
fn runs(a: &Region, b: &Region, part: &Region) -> Vec<Run> {
    let mut out = Vec::with_capacity(part.numel() / run_dims(a, b, part).1.max(1));
    for_each_run(a, b, part, |src, dst, len| out.push(Run { src, dst, len }));
    out
}

/// The parts of `src` (laid out as `outer`) concatenated in order; borrowed when they
/// already are `src`'s buffer in order.
fn pack<'a, T: Element>(src: &'a [T], outer: &Region, parts: &[Region]) -> Result<Cow<'a, [T]>> {
    if tiles_in_order(outer, parts) {
        return Ok(Cow::Borrowed(src));
    }
    let mut out = reused::<T>(OP, &[parts.iter().map(Region::numel).sum()])?;
    let (mut moves, mut at) = (Vec::new(), 0);
    for p in parts {
        for_each_run(outer, p, p, |src, _, len| {
            moves.push(Run { src, dst: at, len });
            at += len;
        });
    }
    // Streamed past the cache when large, as a collective writes: a slice of
    // a replicated [4096, 4096] f32 into 32 MiB took 3.3-4.4 ms written
    // through the cache against 1.9-2.1 ms for a memcpy of the same bytes.
    tessera_mesh::copy_runs(src, &mut out, &moves)?;
    Ok(Cow::Owned(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn region(offset: &[usize], shape: &[usize]) -> Region {
        Region {
            offset: offset.to_vec(),
            shape: shape.to_vec(),
        }
    }

    #[test]
    fn runs() {
        let outer = region(&[0, 0], &[4, 6]);
        macro_rules! case {
            ($off:expr, $shape:expr, $want:expr) => {
                assert_eq!(
                    run_start(&outer, &region(&$off, &$shape)),
                    $want,
                    "{:?} {:?}",
                    $off,
                    $shape
                );
            };
        }
        case!([0, 0], [4, 6], Some(0));
        case!([2, 0], [2, 6], Some(12));
        case!([1, 2], [1, 3], Some(8));
        case!([0, 3], [4, 3], None);
        case!([1, 0], [2, 3], None);
        case!([3, 6], [0, 0], Some(24));
    }

    #[test]
    fn runs_merge_whole_trailing_dims() {
        macro_rules! case {
            ($a:expr, $b:expr, $part:expr, $want:expr) => {
                let mut got = Vec::new();
                for_each_run(&$a, &$b, &$part, |s, d, n| got.push((s, d, n)));
                assert_eq!(got, $want, "{:?} {:?} {:?}", $a, $b, $part);
            };
        }
        let full = region(&[0, 0, 0], &[2, 3, 4]);
        let rows = region(&[0, 1, 0], &[2, 2, 4]);
        let block = region(&[1, 0, 1], &[1, 2, 2]);
        case!(full, full, full, [(0, 0, 24)]);
        case!(full, rows, rows, [(4, 0, 8), (16, 8, 8)]);
        case!(rows, full, rows, [(0, 4, 8), (8, 16, 8)]);
        case!(full, block, block, [(13, 0, 2), (17, 2, 2)]);
        case!(rows, block, region(&[1, 1, 1], &[1, 1, 2]), [(9, 2, 2)]);
        case!(full, full, region(&[1, 0, 0], &[1, 3, 4]), [(12, 12, 12)]);
        case!(
            full,
            full,
            region(&[0, 3, 0], &[2, 0, 4]),
            Vec::<(usize, usize, usize)>::new()
        );
        case!(region(&[], &[]), region(&[], &[]), region(&[], &[]), [(0, 0, 1)]);
        case!(region(&[5], &[6]), region(&[7], &[3]), region(&[7], &[3]), [(2, 0, 3)]);
    }

    #[test]
    fn pack_and_runs_round_trip() {
        // A 4×6 buffer split into column blocks 0..2, 2..4, 4..6 (not row-major runs).
        let outer = region(&[10, 0], &[4, 6]);
        let src: Vec<i64> = (0..24).collect();
        let parts: Vec<Region> = (0..3).map(|k| region(&[10, 2 * k], &[4, 2])).collect();
        let packed = pack(&src, &outer, &parts).unwrap();
        assert!(matches!(packed, Cow::Owned(_)));
        assert_eq!(&packed[..8], &[0, 1, 6, 7, 12, 13, 18, 19]);
        // The runs of each part back into the layout restore the buffer.
        let mut back = vec![0i64; 24];
        let mut at = 0;
        for p in &parts {
            for r in super::runs(p, &outer, p) {
                back[r.dst..r.dst + r.len].copy_from_slice(&packed[at + r.src..at + r.src + r.len]);
            }
            at += p.numel();
        }
        assert_eq!(back, src);
        // Row blocks are runs: no copy.
        let rows: Vec<Region> = (0..2).map(|k| region(&[10 + 2 * k, 0], &[2, 6])).collect();
        assert!(matches!(pack(&src, &outer, &rows).unwrap(), Cow::Borrowed(_)));
    }

    #[test]
    fn scalars_and_empty_parts() {
        let outer = region(&[], &[]);
        assert_eq!(
            pack(&[7.0f32], &outer, std::slice::from_ref(&outer))
                .unwrap()
                .into_owned(),
            vec![7.0]
        );
        let outer = region(&[0], &[3]);
        let parts = [region(&[0], &[3]), region(&[3], &[0])];
        assert!(tiles_in_order(&outer, &parts));
    }
}
