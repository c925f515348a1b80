//! Flat-bucket collectives: many DTensors gathered, reduce-scattered or
//! all-reduced over one mesh dim in one padded collective.
//!
//! FSDP moves a unit's parameters and gradients this way: one all-gather of the
//! unit's shards before it computes, one reduce-scatter of its gradients after.
//! Each function checks that every input is placed for the step, lays the local
//! pieces out as one send buffer (each tensor's piece padded to `ceil(rows / n)`
//! rows, torch.chunk's size, so every rank sends the same number of elements)
//! without copying them ([`Pieces`]: the threads backend reads them where they
//! are, others pack them), issues one asynchronous collective over `mesh_dim`'s
//! communicator and returns a [`BucketWork`]; [`BucketWork::wait`] unpacks the
//! results as DTensors (a gather's are views of the one received buffer, which
//! the collective lays out tensor by tensor:
//! [`Communicator::all_gather_segmented`](tessera_mesh::Communicator::all_gather_segmented)).
//! The result of each input is what [`DTensor::redistribute_with_order`] gives for the
//! same step (the tests check this), in one collective instead of one per tensor.
//!
//! - [`all_gather_bucket`]: `Shard(0)` → `Replicate` on `mesh_dim`, where `mesh_dim`
//!   is the last (innermost) split of tensor dim 0; casts to a gather dtype.
//! - [`reduce_scatter_bucket`]: `Partial(sum)` → `Shard(0)` on `mesh_dim`, which
//!   becomes the innermost split of tensor dim 0 (so it splits what other mesh dims
//!   left of dim 0: FSDP over tensor parallelism).
//! - [`all_reduce_bucket`]: `Partial(sum)` → `Replicate` on `mesh_dim`.
//!
//! On a one-rank mesh dim nothing is packed, copied or communicated: each
//! output holds its input's local tensor (cast when a gather changes the dtype),
//! so FSDP on a one-rank mesh costs what the plain model costs. The bytes of
//! the send and receive buffers are charged to the rank's [memory](tessera_tensor::memory) tracker
//! while the collective is in flight.
//!
//! PyTorch: `foreach_all_gather` / `foreach_reduce` of FSDP2's
//! `_fsdp_collectives.py`.
//!
//! ```
//! use tessera_dtensor::bucket::{all_gather_bucket, reduce_scatter_bucket};
//! use tessera_dtensor::{distribute_tensor, DType, Placement::*, Tensor};
//! use tessera_mesh::{launch, DeviceMesh, ReduceOp};
//!
//! launch(2, |ctx| {
//!     let mesh = DeviceMesh::new(ctx.into_comm(), &[2])?;
//!     let a = Tensor::arange(10, DType::F32)?.reshape(&[5, 2])?;
//!     let b = Tensor::arange(3, DType::F32)?;
//!     let shards = [
//!         distribute_tensor(&a, &mesh, &[Shard(0)])?,
//!         distribute_tensor(&b, &mesh, &[Shard(0)])?,
//!     ];
//!     // One all-gather for both tensors.
//!     let full = all_gather_bucket(&shards, 0, DType::F32)?.wait()?;
//!     assert_eq!(full[0].placements(), &[Replicate]);
//!     assert_eq!(full[1].to_local(), &b);
//!     // Summing a replicated tensor's partial copies: twice the value, sharded.
//!     let partial = tessera_dtensor::DTensor::from_local(a.clone(), &mesh, &[Partial(ReduceOp::Sum)], &[5, 2])?;
//!     let summed = reduce_scatter_bucket(&[partial], 0)?.wait()?;
//!     assert_eq!(summed[0].placements(), &[Shard(0)]);
//!     assert_eq!(summed[0].full_tensor()?, a.add(&a)?);
//!     Ok(())
//! })
//! .unwrap();
//! ```

use tessera_mesh::{DType, DeviceMesh, HeldBuf, Pieces, Planned, ReduceOp, Work, WorkTiming};

use tessera_tensor::Error as TensorError;
use tessera_tensor::memory::{Allocation, Category, allocating_as};

use crate::sharding::{padded_chunk_size, shard_size_and_offset, split_chain};
use crate::spec::{Layout, PlacementsDisplay};
use crate::tensor_comm::{HostComm, TensorComm, device_group, tensor_path_forced};
use crate::{DTensor, Error, Placement, Result, ShardOrder, Tensor};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Gather,
    Scatter,
    AllReduce,
}

impl Kind {
    fn op(self) -> &'static str {
        match self {
            Kind::Gather => "all_gather_bucket",
            Kind::Scatter => "reduce_scatter_bucket",
            Kind::AllReduce => "all_reduce_bucket",
        }
    }
}

/// One tensor's place in the bucket.
struct Entry {
    /// The output's layout.
    layout: Layout,
    /// The output's local shape.
    local_shape: Vec<usize>,
    /// Element offset of this tensor's piece in a rank's block.
    offset: usize,
    /// Elements of every rank's (padded) piece.
    padded: usize,
}

enum Flight {
    /// An empty bucket.
    Empty,
    /// A one-rank mesh dim: nothing to pack or communicate; each input's local
    /// tensor (cast to the bucket's dtype) is its output's.
    Local(Vec<Tensor>),
    Comm {
        work: Work,
        /// The send and receive buffers while the collective runs.
        _charge: Allocation,
    },
    /// The tensor path (device tensors): the received flat tensor, ordered
    /// after the collective on the device's streams.
    Done(Tensor),
    /// A planning run (meta tensors): the output, and the inputs the host
    /// path's send reads in place, held until `wait` as a collective still in
    /// flight holds them (the most memory the step can hold: the collective
    /// done no sooner than it is waited for).
    Planned { out: Tensor, _sent: Vec<Tensor> },
}

/// A bucket collective in flight; [`wait`](Self::wait) returns one DTensor per
/// input, in input order.
#[must_use = "a bucket collective must be waited on"]
pub struct BucketWork {
    kind: Kind,
    /// `None` for an empty bucket.
    mesh: Option<DeviceMesh>,
    entries: Vec<Entry>,
    /// Elements of one rank's block.
    block: usize,
    /// Ranks along the mesh dim.
    world: usize,
    dtype: DType,
    flight: Flight,
}

impl std::fmt::Debug for BucketWork {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "BucketWork({}, {} tensors, {} elements per rank over {} ranks)",
            self.kind.op(),
            self.entries.len(),
            self.block,
            self.world
        )
    }
}

fn placement_error(kind: Kind, detail: String) -> Error {
    Error::Placement { op: kind.op(), detail }
}

/// Checks the inputs and works out every output's layout and place in the bucket.
fn plan(kind: Kind, inputs: &[DTensor], mesh_dim: usize, dtype: DType) -> Result<(Vec<Entry>, usize)> {
    let mut entries = Vec::with_capacity(inputs.len());
    let mut block = 0;
    let Some(first) = inputs.first() else {
        return Ok((entries, 0));
    };
    let mesh = first.mesh();
    check_inputs(kind, inputs, mesh_dim, dtype)?;
    let coord = mesh.coordinate();
    for (i, x) in inputs.iter().enumerate() {
        let local = x.to_local().shape();
        let row_numel: usize = local.iter().skip(1).product();
        let out = match kind {
            Kind::Gather => gathered(x, i, mesh_dim)?,
            Kind::Scatter => scattered(x, i, mesh_dim)?,
            Kind::AllReduce => all_reduced(x, i, mesh_dim)?,
        };
        let out_layout = Layout::with_order(mesh.shape(), &out.placements, out.order, x.shape(), dtype)?;
        let (local_shape, padded) = match kind {
            Kind::AllReduce => (local.to_vec(), out.padded_rows),
            _ => ([&[out.rows][..], &local[1..]].concat(), out.padded_rows * row_numel),
        };
        debug_assert_eq!(out_layout.local_shape(coord)?, local_shape, "{}: input {i}", kind.op());
        entries.push(Entry {
            layout: out_layout,
            local_shape,
            offset: block,
            padded,
        });
        block += padded;
    }
    Ok((entries, block))
}

/// Errors unless the mesh dim exists and every input lives on the first input's
/// mesh (and, for reductions, has the bucket's dtype).
fn check_inputs(kind: Kind, inputs: &[DTensor], mesh_dim: usize, dtype: DType) -> Result<()> {
    let mesh = inputs[0].mesh();
    if mesh_dim >= mesh.ndim() {
        return Err(placement_error(
            kind,
            format!(
                "mesh dim {mesh_dim} is past the {}-D mesh {:?}",
                mesh.ndim(),
                mesh.shape()
            ),
        ));
    }
    for (i, x) in inputs.iter().enumerate() {
        if !x.mesh().same_as(mesh) {
            return Err(placement_error(
                kind,
                format!(
                    "input {i} lives on mesh {:?}, input 0 on {:?}; a bucket runs over one mesh",
                    x.mesh().shape(),
                    mesh.shape()
                ),
            ));
        }
        if kind != Kind::Gather && x.dtype() != dtype {
            return Err(Error::from(TensorError::DTypeMismatch {
                op: kind.op(),
                expected: dtype,
                got: x.dtype(),
            }));
        }
    }
    Ok(())
}

/// One input's output in a bucket: its placements and shard order, and its
/// local rows (elements, for an all-reduce) before and after padding.
struct Out {
    placements: Vec<Placement>,
    order: ShardOrder,
    rows: usize,
    padded_rows: usize,
}

/// Input `i`'s output when gathered over `mesh_dim` (which must be the last
/// split of its dim 0).
fn gathered(x: &DTensor, i: usize, mesh_dim: usize) -> Result<Out> {
    let kind = Kind::Gather;
    let (p, mesh) = (x.placements(), x.mesh());
    let chain = x.layout().order.order_of(p, 0);
    if p[mesh_dim] != Placement::Shard(0) || chain.last() != Some(&mesh_dim) {
        return Err(placement_error(
            kind,
            format!(
                "input {i} is placed {} (dim 0 split by mesh dims {:?}); gathering over mesh dim \
                 {mesh_dim} needs Shard(0) there, as the last split of dim 0",
                PlacementsDisplay(p),
                chain.as_slice()
            ),
        ));
    }
    let mut out = p.to_vec();
    out[mesh_dim] = Placement::Replicate;
    let split = *split_chain(x.shape()[0], mesh.shape(), &chain, mesh.coordinate())?
        .last()
        .expect("the chain holds mesh_dim");
    let order = x.layout().order.with_chain(&out, 0, &chain[..chain.len() - 1])?;
    Ok(Out {
        placements: out,
        order,
        rows: split.logical_size,
        padded_rows: split.padded_chunk_size(),
    })
}

/// Errors unless input `i` is a pending sum over `mesh_dim`.
fn need_partial_sum(kind: Kind, x: &DTensor, i: usize, mesh_dim: usize) -> Result<()> {
    let p = x.placements();
    if p[mesh_dim] == Placement::Partial(ReduceOp::Sum) {
        return Ok(());
    }
    Err(placement_error(
        kind,
        format!(
            "input {i} is placed {}; reducing over mesh dim {mesh_dim} needs Partial(sum) there",
            PlacementsDisplay(p)
        ),
    ))
}

/// Input `i`'s output when reduce-scattered over `mesh_dim`: dim 0 split once more.
fn scattered(x: &DTensor, i: usize, mesh_dim: usize) -> Result<Out> {
    let kind = Kind::Scatter;
    need_partial_sum(kind, x, i, mesh_dim)?;
    if x.shape().is_empty() {
        return Err(placement_error(
            kind,
            format!("input {i} is a scalar; a reduce-scatter shards dim 0"),
        ));
    }
    let (p, mesh) = (x.placements(), x.mesh());
    let mut out = p.to_vec();
    out[mesh_dim] = Placement::Shard(0);
    let mut chain = x.layout().order.order_of(p, 0);
    chain.push(mesh_dim);
    let order = x.layout().order.with_chain(&out, 0, &chain)?;
    let rows = x.to_local().shape()[0];
    let world = mesh.shape()[mesh_dim];
    let (mine, _) = shard_size_and_offset(rows, world, mesh.coordinate()[mesh_dim]);
    Ok(Out {
        placements: out,
        order,
        rows: mine,
        padded_rows: padded_chunk_size(rows, world),
    })
}

/// Input `i`'s output when all-reduced over `mesh_dim`: replicated there.
fn all_reduced(x: &DTensor, i: usize, mesh_dim: usize) -> Result<Out> {
    need_partial_sum(Kind::AllReduce, x, i, mesh_dim)?;
    let mut out = x.placements().to_vec();
    out[mesh_dim] = Placement::Replicate;
    Ok(Out {
        placements: out,
        order: x.layout().order.clone(),
        rows: 1,
        padded_rows: x.to_local().numel(),
    })
}

/// A contiguous tensor (a view of a bucket input) that a [`Pieces`] send reads
/// where it is, keeping its storage alive until the collective is done.
struct Held(Tensor);

impl Held {
    /// `t`'s elements `[start, start + len)` (row-major) zero-padded to `len`,
    /// appended to `send`: a view of the flat contiguous `t` and a run of zeros.
    fn push_padded(send: &mut Pieces, flat: &Tensor, start: usize, len: usize) -> Result<()> {
        let real = flat.numel().saturating_sub(start).min(len);
        if real > 0 {
            send.push(Held(flat.narrow(0, start, real)?))?;
        }
        send.push_zeros(len - real);
        Ok(())
    }
}

impl HeldBuf for Held {
    fn held_buf(&self) -> tessera_mesh::Buf<'_> {
        // INVARIANT: only narrowed views of contiguous flat tensors are held.
        self.0.as_buf().expect("a held bucket piece is contiguous")
    }
}

fn start(
    kind: Kind,
    inputs: &[DTensor],
    mesh_dim: usize,
    dtype: DType,
    entries: Vec<Entry>,
    block: usize,
) -> Result<BucketWork> {
    let Some(mesh) = inputs.first().map(|x| x.mesh().clone()) else {
        return Ok(BucketWork {
            kind,
            mesh: None,
            entries,
            block,
            world: 1,
            dtype,
            flight: Flight::Empty,
        });
    };
    let world = mesh.shape()[mesh_dim];
    let locals = inputs
        .iter()
        .map(|x| x.to_local().cast(dtype))
        .collect::<tessera_tensor::Result<Vec<_>>>()?;
    let flight = if world == 1 {
        // One rank holds every piece whole (no padding): the outputs are the
        // inputs' local tensors (cast), re-placed, so no byte is copied.
        Flight::Local(locals)
    } else {
        communicate(kind, &mesh, mesh_dim, dtype, &locals, &entries, block)?
    };
    Ok(BucketWork {
        kind,
        mesh: Some(mesh),
        entries,
        block,
        world,
        dtype,
        flight,
    })
}

/// Packs the local tensors `locals` (of `dtype`) into one send buffer and
/// issues the bucket's collective over `mesh_dim` (more than one rank).
fn communicate(
    kind: Kind,
    mesh: &DeviceMesh,
    mesh_dim: usize,
    dtype: DType,
    locals: &[Tensor],
    entries: &[Entry],
    block: usize,
) -> Result<Flight> {
    let world = mesh.shape()[mesh_dim];
    // The send buffer as pieces, each tensor's rows padded to `padded`: a gather
    // or all-reduce sends one block; a reduce-scatter one block per rank,
    // rank-major (tensor i's rows for rank r at `r · block + offset_i`). A
    // backend that reads its peers' memory reads the pieces in place (no copy
    // into a flat bucket); others pack them.
    let flats = locals
        .iter()
        .map(|t| t.contiguous().reshape(&[t.numel()]))
        .collect::<tessera_tensor::Result<Vec<_>>>()?;
    let comm = mesh.dim_comm(mesh_dim)?;
    let recv_len = if kind == Kind::Gather { world * block } else { block };
    if flats.iter().any(Tensor::is_meta) {
        // A planning run: the collective the host path below issues, counted,
        // and its output, the one buffer that path allocates (its send reads
        // the inputs in place).
        let counts = vec![block; world];
        let call = match kind {
            Kind::Gather => Planned::AllGather { dtype, counts: &counts },
            Kind::Scatter => Planned::ReduceScatter { dtype, counts: &counts },
            Kind::AllReduce => Planned::AllReduce { dtype, len: block },
        };
        comm.count_planned(call)?;
        // The receive buffer in flight, as the host path's charge below.
        let out = allocating_as(Category::CollectiveBuffers, || Tensor::meta(&[recv_len], dtype))?;
        return Ok(Flight::Planned { out, _sent: flats });
    }
    let on_device = flats.iter().any(Tensor::is_cuda);
    if on_device || tensor_path_forced() {
        let group: Box<dyn TensorComm> = if on_device {
            device_group(comm, &flats[0])?
        } else {
            Box::new(HostComm(comm))
        };
        return Ok(Flight::Done(on_tensors(
            kind, world, dtype, &flats, entries, block, &*group,
        )?));
    }
    let ranks = if kind == Kind::Scatter { world } else { 1 };
    let mut send = Pieces::new(dtype);
    for r in 0..ranks {
        for (flat, e) in flats.iter().zip(entries) {
            Held::push_padded(&mut send, flat, r * e.padded, e.padded)?;
        }
    }
    let size = dtype.size_in_bytes();
    // The output only: a gather's or reduce-scatter's send is views of the
    // inputs, already counted; an all-reduce's packed send is its output.
    let charge = Allocation::charge_as(recv_len * size, Category::CollectiveBuffers);
    let work = match kind {
        // Segment order: each tensor's pieces from all ranks side by side, so
        // that `wait` hands out views of the buffer instead of copying them out.
        Kind::Gather => comm.all_gather_segmented_pieces_async(send, entries.iter().map(|e| e.padded).collect()),
        Kind::Scatter => comm.reduce_scatter_pieces_async(send, ReduceOp::Sum),
        // Reduced in place: the buffer is the output.
        Kind::AllReduce => comm.all_reduce_async(send.pack(), ReduceOp::Sum),
    };
    Ok(Flight::Comm { work, _charge: charge })
}

/// [`communicate`] in whole-tensor ops and collectives (the path of device
/// tensors): the same send layout, built by concatenating views and zero pads.
fn on_tensors(
    kind: Kind,
    world: usize,
    dtype: DType,
    flats: &[Tensor],
    entries: &[Entry],
    block: usize,
    comm: &dyn TensorComm,
) -> Result<Tensor> {
    let device = flats[0].device();
    let ranks = if kind == Kind::Scatter { world } else { 1 };
    let mut pieces = Vec::new();
    for r in 0..ranks {
        for (flat, e) in flats.iter().zip(entries) {
            let (start, len) = (r * e.padded, e.padded);
            let real = flat.numel().saturating_sub(start).min(len);
            if real > 0 {
                pieces.push(flat.narrow(0, start, real)?);
            }
            if len > real {
                pieces.push(Tensor::assemble(&[len - real], dtype, device, &[])?);
            }
        }
    }
    let send = if pieces.is_empty() {
        Tensor::assemble(&[0], dtype, device, &[])?
    } else {
        Tensor::cat(&pieces, 0)?
    };
    match kind {
        Kind::Gather => comm.all_gather_segmented(&send, &entries.iter().map(|e| e.padded).collect::<Vec<_>>()),
        Kind::Scatter => comm.reduce_scatter_v(&send, &vec![block; world], ReduceOp::Sum),
        Kind::AllReduce => comm.all_reduce(&send, ReduceOp::Sum),
    }
}

/// Gathers every input over `mesh_dim` in one all-gather, in `dtype`: each input
/// must be `Shard(0)` there with `mesh_dim` the last split of its dim 0; each
/// output is `Replicate` there (the other placements and splits unchanged).
///
/// # Errors
/// An input on another mesh or not placed as above, a mesh dim past the mesh
/// (each naming the input); a failed cast or collective.
pub fn all_gather_bucket(inputs: &[DTensor], mesh_dim: usize, dtype: DType) -> Result<BucketWork> {
    let _t = tessera_tensor::profile::scope(tessera_tensor::profile::Kind::Communication);
    let (entries, block) = plan(Kind::Gather, inputs, mesh_dim, dtype)?;
    start(Kind::Gather, inputs, mesh_dim, dtype, entries, block)
}

/// Reduce-scatters every input over `mesh_dim` in one reduce-scatter: each input
/// must be `Partial(sum)` there (all of one dtype); each output is `Shard(0)`
/// there, `mesh_dim` splitting dim 0 after the mesh dims that already split it.
///
/// # Errors
/// An input on another mesh, of another dtype, not `Partial(sum)` on `mesh_dim`,
/// or a scalar; a mesh dim past the mesh; a failed collective.
pub fn reduce_scatter_bucket(inputs: &[DTensor], mesh_dim: usize) -> Result<BucketWork> {
    let dtype = inputs.first().map_or(DType::F32, DTensor::dtype);
    let _t = tessera_tensor::profile::scope(tessera_tensor::profile::Kind::Communication);
    let (entries, block) = plan(Kind::Scatter, inputs, mesh_dim, dtype)?;
    start(Kind::Scatter, inputs, mesh_dim, dtype, entries, block)
}

/// All-reduces every input over `mesh_dim` in one all-reduce: each input must be
/// `Partial(sum)` there (all of one dtype); each output is `Replicate` there.
///
/// # Errors
/// As [`reduce_scatter_bucket`] (scalars are fine).
pub fn all_reduce_bucket(inputs: &[DTensor], mesh_dim: usize) -> Result<BucketWork> {
    let dtype = inputs.first().map_or(DType::F32, DTensor::dtype);
    let _t = tessera_tensor::profile::scope(tessera_tensor::profile::Kind::Communication);
    let (entries, block) = plan(Kind::AllReduce, inputs, mesh_dim, dtype)?;
    start(Kind::AllReduce, inputs, mesh_dim, dtype, entries, block)
}

impl BucketWork {
    /// Waits for the collective and unpacks one DTensor per input, in input order.
    ///
    /// # Errors
    /// The collective's failure (a peer that failed, a mismatch between ranks).
    pub fn wait(self) -> Result<Vec<DTensor>> {
        Ok(self.wait_timed()?.0)
    }

    /// [`wait`](Self::wait), also telling when the collective ran on the
    /// communication thread and how long this call blocked for it; `None`
    /// when nothing ran asynchronously (an empty bucket, a one-rank mesh dim,
    /// a planning run, a device tensor's collective).
    ///
    /// # Errors
    /// As [`wait`](Self::wait).
    pub fn wait_timed(self) -> Result<(Vec<DTensor>, Option<WorkTiming>)> {
        let _t = tessera_tensor::profile::scope(tessera_tensor::profile::Kind::Communication);
        let BucketWork {
            kind,
            mesh,
            entries,
            block,
            world,
            dtype,
            flight,
        } = self;
        let Some(mesh) = mesh else {
            return Ok((Vec::new(), None));
        };
        let recv_len = if kind == Kind::Gather { world * block } else { block };
        let mut timing = None;
        let data = match flight {
            Flight::Empty => return Ok((Vec::new(), None)),
            Flight::Local(locals) => {
                let out = locals
                    .into_iter()
                    .zip(entries)
                    .map(|(local, e)| {
                        debug_assert_eq!(local.shape(), &e.local_shape[..], "{}", kind.op());
                        DTensor::from_local_with_layout(local, &mesh, e.layout)
                    })
                    .collect::<Result<_>>()?;
                return Ok((out, None));
            }
            Flight::Done(data) => data,
            Flight::Planned { out, .. } => {
                // Received: an op's output from now on, as the host path's.
                out.set_memory_category(Category::Activations);
                out
            }
            Flight::Comm { work, _charge: charge } => {
                let (buf, ran) = work.wait_timed();
                let buf = buf?;
                timing = Some(ran);
                // The output's charge passes to its tensor (counted once).
                drop(charge);
                if buf.dtype() != dtype || buf.len() != recv_len {
                    return Err(Error::from(TensorError::InvalidArgument {
                        op: kind.op(),
                        detail: format!(
                            "the collective returned {} elements of {}, expected {recv_len} of {dtype}",
                            buf.len(),
                            buf.dtype()
                        ),
                    }));
                }
                Tensor::from_buffer(buf, &[recv_len])?
            }
        };
        let mut out = Vec::with_capacity(entries.len());
        match kind {
            Kind::Gather => {
                // Tensor i's pieces fill `world · padded` elements from `world · offset`
                // (padding only after the last real rows: torch.chunk's trailing
                // chunks are the short ones), so its full local value is a view.
                for e in entries {
                    let n: usize = e.local_shape.iter().product();
                    let local = data.narrow(0, world * e.offset, n)?.reshape(&e.local_shape)?;
                    out.push(DTensor::from_local_with_layout(local, &mesh, e.layout)?);
                }
            }
            Kind::Scatter | Kind::AllReduce => {
                for e in entries {
                    let n: usize = e.local_shape.iter().product();
                    let local = data.narrow(0, e.offset, n)?.reshape(&e.local_shape)?;
                    out.push(DTensor::from_local_with_layout(local, &mesh, e.layout)?);
                }
            }
        }
        Ok((out, timing))
    }
}
