//! Collectives between ranks whose tensors are on GPUs.
//!
//! - [`LocalGroup`]: ranks that are threads of one process sharing one GPU
//!   (the threads backend's device twin). The ranks meet through their host
//!   communicator to swap device addresses and events; the data moves on the
//!   GPU, by device-to-device copies and reduction kernels on each rank's
//!   communication stream, ordered against the compute streams by events.
//! - [`Nccl`]: one rank per GPU over NCCL, across processes and nodes, its
//!   unique id passed through the host communicator (MPI).
//!
//! Both take and return device tensors: `all_gather` concatenates along dim 0,
//! `reduce_scatter` gives rank `r` the `r`-th of `size` equal dim-0 chunks of
//! the reduction, as PyTorch's `all_gather_into_tensor` and
//! `reduce_scatter_tensor`.

use cudarc::driver::{CudaStream, result, sys};
use cudarc::nccl::{result as nccl, sys as nccl_sys};
use tessera_mesh::{Communicator, CommunicatorExt, DType, ReduceOp};

use super::driver::RankStreams;
use super::library::{check_library, cuda_error};
use super::ops::{self, Peers};
use crate::{Error, Result, Tensor};

/// Collectives over device tensors. PyTorch: the `torch.distributed` collectives
/// on CUDA tensors.
pub trait DeviceCollectives {
    /// The caller's rank in the group.
    fn rank(&self) -> usize;

    /// The number of ranks.
    fn size(&self) -> usize;

    /// Every rank's `t` concatenated along dim 0, in rank order (shapes must agree).
    ///
    /// # Errors
    /// [`Error::Device`] for tensors that are not on the GPU or differ between
    /// ranks, or a failed driver or host collective.
    fn all_gather(&self, t: &Tensor) -> Result<Tensor>;

    /// The `op`-reduction of every rank's `t` (dim 0 a multiple of the size),
    /// of which this rank gets the `rank`-th dim-0 chunk.
    ///
    /// # Errors
    /// As [`all_gather`](Self::all_gather), and for a dim 0 not divisible by the size.
    fn reduce_scatter(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor>;

    /// The `op`-reduction of every rank's `t`, on every rank.
    ///
    /// # Errors
    /// As [`all_gather`](Self::all_gather).
    fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor>;
}

fn comm_error(e: tessera_mesh::Error) -> Error {
    Error::Device {
        op: "collective",
        detail: format!("the host communicator failed: {e}"),
    }
}

fn unsupported(op: ReduceOp) -> Error {
    Error::Device {
        op: "collective",
        detail: format!("reduction {op:?} has no device kernel; use sum, avg, max, min or product"),
    }
}

fn op_code(op: ReduceOp) -> Result<i32> {
    Ok(match op {
        ReduceOp::Sum => 0,
        ReduceOp::Avg => 1,
        ReduceOp::Max => 2,
        ReduceOp::Min => 3,
        ReduceOp::Product => 4,
        other => return Err(unsupported(other)),
    })
}

/// The ranks of a host communicator whose threads share one GPU.
pub struct LocalGroup<'a> {
    comm: &'a dyn Communicator,
}

impl<'a> LocalGroup<'a> {
    /// The device twin of `comm`, whose ranks must be threads of this process
    /// (the threads backend) with their tensors on one GPU.
    ///
    /// # Errors
    /// [`Error::Device`] for a group of more than 16 ranks (the reduction
    /// kernel's limit).
    pub fn new(comm: &'a dyn Communicator) -> Result<LocalGroup<'a>> {
        if comm.size() > 16 {
            return Err(Error::Device {
                op: "LocalGroup",
                detail: format!("{} ranks share one GPU; at most 16 can", comm.size()),
            });
        }
        Ok(LocalGroup { comm })
    }

    /// One exchange: every rank's input is made ready, its address, element
    /// count, dtype and `extra` words swapped with its peers (the dtype checked
    /// equal, and the count too when `same_count`), and `work` enqueued on the
    /// communication stream once every peer's input is ready; the compute
    /// stream then waits for `work` and for every peer's reads of this rank's
    /// input (so that its memory is not reused before).
    fn exchange(
        &self,
        op: &'static str,
        t: &Tensor,
        out_shape: &[usize],
        extra: &[i64],
        same_count: bool,
        work: impl FnOnce(&RankStreams, &Tensor, &[Peer]) -> Result<()>,
    ) -> Result<Tensor> {
        let t = ops::contiguous(t)?;
        let s = ops::rank_streams(&t)?;
        let out = ops::empty_like_on(&s, out_shape, t.dtype())?;
        s.gpu.bind()?;
        let ready = s.compute.record_event(None).map_err(|e| cuda_error(op, e))?;
        let mut mine = vec![
            i64::from(std::process::id()),
            ops::address(&t) as i64,
            ready.cu_event() as i64,
            t.numel() as i64,
            dtype_code(t.dtype()),
            s.gpu.ordinal as i64,
            extra.len() as i64,
        ];
        mine.extend_from_slice(extra);
        let words = mine.len();
        // Every rank sends as many words (a mismatch is the host collective's error).
        let all = self.comm.all_gather_vec::<i64>(&mine).map_err(comm_error)?;
        let records: Vec<&[i64]> = all.chunks_exact(words).collect();
        check_records(op, self.comm.rank(), &mine, &records, same_count)?;
        wait_events(op, &s.comm, records.iter().map(|p| p[2]))?;
        let peers: Vec<Peer> = records
            .iter()
            .map(|p| Peer {
                addr: p[1] as u64,
                extra: p[7..].to_vec(),
            })
            .collect();
        work(&s, &out, &peers)?;
        let done = s.comm.record_event(None).map_err(|e| cuda_error(op, e))?;
        s.compute.wait(&done).map_err(|e| cuda_error(op, e))?;
        let dones = self
            .comm
            .all_gather_vec::<i64>(&[done.cu_event() as i64])
            .map_err(comm_error)?;
        wait_events(op, &s.compute, dones)?;
        // Every peer has enqueued its waits on this rank's events: they may go.
        self.comm.barrier().map_err(comm_error)?;
        drop((ready, done));
        ops::used_on(&out, &s.comm)?;
        Ok(out)
    }

    /// Copies `len` elements of `size` bytes from `src` (element `from`) to
    /// `dst` (element `to`) on the communication stream.
    fn copy(
        s: &RankStreams,
        op: &'static str,
        (dst, to): (u64, usize),
        (src, from): (u64, usize),
        len: usize,
        size: usize,
    ) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        // SAFETY: the caller's counts keep both ranges inside live buffers.
        unsafe {
            result::memcpy_dtod_async(
                dst + (to * size) as u64,
                src + (from * size) as u64,
                len * size,
                s.comm.cu_stream(),
            )
        }
        .map_err(|e| cuda_error(op, e))
    }

    /// Every rank's flat `t` concatenated (1-D), rank `r` giving `counts[r]`
    /// elements. PyTorch: `all_gather` with uneven sizes.
    ///
    /// # Errors
    /// As [`DeviceCollectives::all_gather`], and when this rank's `t` does not
    /// hold `counts[rank]` elements.
    pub fn all_gather_v(&self, t: &Tensor, counts: &[usize]) -> Result<Tensor> {
        self.check_counts("all_gather_v", t, counts, counts.get(self.rank()).copied())?;
        let size = t.dtype().size_in_bytes();
        let total = counts.iter().sum::<usize>();
        self.exchange("all_gather_v", t, &[total], &[], false, |s, out, peers| {
            let mut at = 0;
            for (p, peer) in peers.iter().enumerate() {
                Self::copy(
                    s,
                    "all_gather_v",
                    (ops::address(out), at),
                    (peer.addr, 0),
                    counts[p],
                    size,
                )?;
                at += counts[p];
            }
            Ok(())
        })
    }

    /// Every rank's flat `t` split into `segments` (lengths, the same on every
    /// rank), gathered segment by segment: segment `i` of every rank side by
    /// side, in rank order. PyTorch: FSDP2's per-parameter all-gather output.
    ///
    /// # Errors
    /// As [`DeviceCollectives::all_gather`], and when the segments do not add up
    /// to `t`'s elements.
    pub fn all_gather_segmented(&self, t: &Tensor, segments: &[usize]) -> Result<Tensor> {
        if segments.iter().sum::<usize>() != t.numel() {
            return Err(Error::Device {
                op: "all_gather_segmented",
                detail: format!("segments {segments:?} do not add up to the {} elements sent", t.numel()),
            });
        }
        let (size, world) = (t.dtype().size_in_bytes(), self.size());
        self.exchange(
            "all_gather_segmented",
            t,
            &[t.numel() * world],
            &[],
            true,
            |s, out, peers| {
                let mut off = 0;
                for &len in segments {
                    for (p, peer) in peers.iter().enumerate() {
                        Self::copy(
                            s,
                            "all_gather_segmented",
                            (ops::address(out), world * off + p * len),
                            (peer.addr, off),
                            len,
                            size,
                        )?;
                    }
                    off += len;
                }
                Ok(())
            },
        )
    }

    /// The `op`-reduction over ranks of the flat `t` split by `counts`, of which
    /// this rank gets part `rank` (`counts[rank]` elements).
    ///
    /// # Errors
    /// As [`DeviceCollectives::reduce_scatter`], and when `t` does not hold
    /// `Σ counts` elements.
    pub fn reduce_scatter_v(&self, t: &Tensor, counts: &[usize], op: ReduceOp) -> Result<Tensor> {
        self.check_counts("reduce_scatter_v", t, counts, Some(counts.iter().sum()))?;
        let (rank, code) = (self.rank(), op_code(op)?);
        let start: usize = counts[..rank].iter().sum();
        let len = counts[rank];
        self.exchange("reduce_scatter_v", t, &[len], &[], true, |s, out, peers| {
            ops::reduce_peers(s, out, peer_ptrs(peers), start, len, code)
        })
    }

    /// Each rank sends `send_counts[p]` elements of its flat `t` (in peer
    /// order) to peer `p` and receives `recv_counts[p]` from it, concatenated
    /// in peer order. PyTorch: `all_to_all_single` with split sizes.
    ///
    /// # Errors
    /// As [`DeviceCollectives::all_gather`], and for counts that disagree
    /// between senders and receivers or with `t`.
    pub fn all_to_all_v(&self, t: &Tensor, send_counts: &[usize], recv_counts: &[usize]) -> Result<Tensor> {
        const OP: &str = "all_to_all_v";
        self.check_counts(OP, t, send_counts, Some(send_counts.iter().sum()))?;
        self.check_counts(OP, t, recv_counts, None)?;
        let (rank, size) = (self.rank(), t.dtype().size_in_bytes());
        let extra: Vec<i64> = send_counts.iter().map(|&c| c as i64).collect();
        let total = recv_counts.iter().sum::<usize>();
        self.exchange(OP, t, &[total], &extra, false, |s, out, peers| {
            let mut at = 0;
            for (p, peer) in peers.iter().enumerate() {
                let sends: Vec<usize> = peer.extra.iter().map(|&c| c as usize).collect();
                if sends[rank] != recv_counts[p] {
                    return Err(Error::Device {
                        op: OP,
                        detail: format!(
                            "rank {p} sends {} elements to rank {rank}, which expects {}",
                            sends[rank], recv_counts[p]
                        ),
                    });
                }
                let from: usize = sends[..rank].iter().sum();
                Self::copy(s, OP, (ops::address(out), at), (peer.addr, from), recv_counts[p], size)?;
                at += recv_counts[p];
            }
            Ok(())
        })
    }

    /// Errors unless `counts` has one entry per rank and, when `want` is given,
    /// `t` holds `want` elements.
    fn check_counts(&self, op: &'static str, t: &Tensor, counts: &[usize], want: Option<usize>) -> Result<()> {
        if counts.len() != self.size() {
            return Err(Error::Device {
                op,
                detail: format!("{} counts for {} ranks; pass one per rank", counts.len(), self.size()),
            });
        }
        if let Some(w) = want
            && t.numel() != w
        {
            return Err(Error::Device {
                op,
                detail: format!(
                    "this rank passes {} elements but the counts {counts:?} say {w}",
                    t.numel()
                ),
            });
        }
        Ok(())
    }
}

/// A peer's side of an exchange.
struct Peer {
    addr: u64,
    extra: Vec<i64>,
}

fn peer_ptrs(peers: &[Peer]) -> Peers {
    let mut p = Peers {
        n: peers.len() as i32,
        ..Peers::default()
    };
    for (slot, peer) in p.ptr.iter_mut().zip(peers) {
        *slot = peer.addr;
    }
    p
}

/// Checks that every rank's exchange record (`records`) agrees with this rank's (`mine`).
fn check_records(op: &'static str, me: usize, mine: &[i64], records: &[&[i64]], same_count: bool) -> Result<()> {
    for (r, p) in records.iter().enumerate() {
        let problem = if p[0] != mine[0] {
            Some("runs in another process: ranks that share a GPU this way must be threads of one process (use NCCL across processes)".to_string())
        } else if p[5] != mine[5] {
            Some(format!("uses cuda:{} but rank {me} uses cuda:{}", p[5], mine[5]))
        } else if p[4] != mine[4] {
            Some("passes another dtype; every rank must pass the same dtype".to_string())
        } else if same_count && p[3] != mine[3] {
            Some(format!(
                "passes {} elements but rank {me} passes {}; every rank must pass the same shape",
                p[3], mine[3]
            ))
        } else {
            None
        };
        if let Some(why) = problem {
            return Err(Error::Device {
                op,
                detail: format!("rank {r} {why}"),
            });
        }
    }
    Ok(())
}

/// Makes `stream` wait for each of the peers' `events` (`CUevent` handles as words).
fn wait_events(op: &'static str, stream: &CudaStream, events: impl IntoIterator<Item = i64>) -> Result<()> {
    for event in events {
        // SAFETY: each peer's event is alive until the closing barrier.
        unsafe {
            result::stream::wait_event(
                stream.cu_stream(),
                event as sys::CUevent,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
        .map_err(|e| cuda_error(op, e))?;
    }
    Ok(())
}

fn dtype_code(d: DType) -> i64 {
    d.size_in_bytes() as i64 * 16 + i64::from(d.is_float())
}

impl DeviceCollectives for LocalGroup<'_> {
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn size(&self) -> usize {
        self.comm.size()
    }

    fn all_gather(&self, t: &Tensor) -> Result<Tensor> {
        let mut shape = t.shape().to_vec();
        if shape.is_empty() {
            shape.push(1);
        }
        shape[0] *= self.size();
        let (n, size) = (t.numel(), t.dtype().size_in_bytes());
        self.exchange("all_gather", t, &shape, &[], true, |s, out, peers| {
            for (p, peer) in peers.iter().enumerate() {
                Self::copy(s, "all_gather", (ops::address(out), p * n), (peer.addr, 0), n, size)?;
            }
            Ok(())
        })
    }

    fn reduce_scatter(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        let size = self.size();
        let rows = t.shape().first().copied().unwrap_or(1);
        if rows % size != 0 {
            return Err(Error::Device {
                op: "reduce_scatter",
                detail: format!(
                    "dim 0 of {:?} does not split into {size} equal chunks; pad it to a multiple of {size}",
                    t.shape()
                ),
            });
        }
        let mut shape = t.shape().to_vec();
        shape[0] /= size;
        let len = t.numel() / size;
        let rank = self.rank();
        let code = op_code(op)?;
        self.exchange("reduce_scatter", t, &shape, &[], true, |s, out, peers| {
            ops::reduce_peers(s, out, peer_ptrs(peers), rank * len, len, code)
        })
    }

    fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        let len = t.numel();
        let code = op_code(op)?;
        self.exchange("all_reduce", t, t.shape(), &[], true, |s, out, peers| {
            ops::reduce_peers(s, out, peer_ptrs(peers), 0, len, code)
        })
    }
}

/// An NCCL communicator: one rank per GPU, across processes and nodes.
/// PyTorch: the `nccl` backend of `torch.distributed`.
pub struct Nccl {
    comm: nccl_sys::ncclComm_t,
    rank: usize,
    size: usize,
    ordinal: usize,
}

// SAFETY: an NCCL communicator may be used from any thread, one call at a time
// (the `&self` methods issue one call each and NCCL serialises per communicator).
unsafe impl Send for Nccl {}

impl Nccl {
    /// Joins the NCCL communicator of `host`'s ranks on GPU `ordinal`: rank 0
    /// makes the unique id and `host` (MPI, or any communicator) broadcasts it.
    /// PyTorch: `init_process_group("nccl")`.
    ///
    /// # Errors
    /// [`Error::Device`] when NCCL cannot be loaded or initialised, or the host
    /// broadcast fails.
    pub fn new(host: &dyn Communicator, ordinal: usize) -> Result<Nccl> {
        check_library("nccl")?;
        let gpu = super::driver::gpu(ordinal)?;
        gpu.bind()?;
        let mut id = [0u8; 128];
        let made = if host.rank() == 0 {
            match nccl::get_uniqueid() {
                Ok(uid) => {
                    for (d, s) in id.iter_mut().zip(uid.internal) {
                        *d = s as u8;
                    }
                    1u8
                }
                Err(_) => 0,
            }
        } else {
            1
        };
        let mut msg = [&[made][..], &id[..]].concat();
        host.broadcast_slice(&mut msg, 0).map_err(comm_error)?;
        if msg[0] == 0 {
            return Err(Error::Device {
                op: "nccl",
                detail: "rank 0 could not make an NCCL unique id".into(),
            });
        }
        let mut uid = nccl_sys::ncclUniqueId { internal: [0; 128] };
        for (d, &s) in uid.internal.iter_mut().zip(&msg[1..]) {
            *d = s as _;
        }
        let mut comm = std::ptr::null_mut();
        // SAFETY: `comm` receives the new communicator; every rank passes the same id.
        unsafe { nccl::comm_init_rank(&mut comm, host.size() as i32, uid, host.rank() as i32) }.map_err(|e| {
            Error::Device {
                op: "nccl",
                detail: format!("ncclCommInitRank failed: {e:?}"),
            }
        })?;
        Ok(Nccl {
            comm,
            rank: host.rank(),
            size: host.size(),
            ordinal,
        })
    }

    /// The NCCL library's version (`22703` for 2.27.3).
    ///
    /// # Errors
    /// [`Error::Device`] when NCCL cannot be loaded.
    pub fn version() -> Result<i32> {
        check_library("nccl")?;
        nccl::get_nccl_version().map_err(|e| Error::Device {
            op: "nccl",
            detail: format!("{e:?}"),
        })
    }

    fn data_type(t: &Tensor) -> Result<nccl_sys::ncclDataType_t> {
        use nccl_sys::ncclDataType_t as D;
        Ok(match t.dtype() {
            DType::F32 => D::ncclFloat32,
            DType::F64 => D::ncclFloat64,
            DType::BF16 => D::ncclBfloat16,
            DType::F16 => D::ncclFloat16,
            DType::I64 => D::ncclInt64,
            DType::U8 => D::ncclUint8,
            other => {
                return Err(Error::Device {
                    op: "nccl",
                    detail: format!("dtype {other} has no NCCL type"),
                });
            }
        })
    }

    fn red_op(op: ReduceOp) -> Result<nccl_sys::ncclRedOp_t> {
        use nccl_sys::ncclRedOp_t as R;
        Ok(match op {
            ReduceOp::Sum => R::ncclSum,
            ReduceOp::Avg => R::ncclAvg,
            ReduceOp::Max => R::ncclMax,
            ReduceOp::Min => R::ncclMin,
            ReduceOp::Product => R::ncclProd,
            other => return Err(unsupported(other)),
        })
    }

    /// Runs `call` on the communication stream after the compute stream's work,
    /// and makes the compute stream wait for it.
    fn run(
        &self,
        op: &'static str,
        t: &Tensor,
        out_shape: &[usize],
        call: impl FnOnce(u64, u64, sys::CUstream) -> std::result::Result<(), String>,
    ) -> Result<Tensor> {
        if t.device() != crate::Device::Cuda(self.ordinal) {
            return Err(Error::Device {
                op,
                detail: format!(
                    "the tensor is on {} but this NCCL rank uses cuda:{}",
                    t.device(),
                    self.ordinal
                ),
            });
        }
        let t = ops::contiguous(t)?;
        let s = ops::rank_streams(&t)?;
        let out = ops::empty_like_on(&s, out_shape, t.dtype())?;
        s.comm.join(&s.compute).map_err(|e| cuda_error(op, e))?;
        call(ops::address(&t), ops::address(&out), s.comm.cu_stream()).map_err(|e| Error::Device {
            op,
            detail: format!("NCCL failed: {e}"),
        })?;
        s.compute.join(&s.comm).map_err(|e| cuda_error(op, e))?;
        ops::used_on(&t, &s.comm)?;
        ops::used_on(&out, &s.comm)?;
        Ok(out)
    }
}

impl Drop for Nccl {
    fn drop(&mut self) {
        // SAFETY: the communicator was made by `new` and is destroyed once.
        let _ = unsafe { nccl::comm_destroy(self.comm) };
    }
}

impl DeviceCollectives for Nccl {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn all_gather(&self, t: &Tensor) -> Result<Tensor> {
        let mut shape = t.shape().to_vec();
        if shape.is_empty() {
            shape.push(1);
        }
        shape[0] *= self.size;
        let (n, ty) = (t.numel(), Self::data_type(t)?);
        self.run("all_gather", t, &shape, |src, dst, stream| {
            // SAFETY: `dst` holds `size · n` elements, `src` n, on this GPU.
            unsafe { nccl::all_gather(src as _, dst as _, n, ty, self.comm, stream as _) }
                .map(|_| ())
                .map_err(|e| format!("{e:?}"))
        })
    }

    fn reduce_scatter(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        let rows = t.shape().first().copied().unwrap_or(1);
        if rows % self.size != 0 {
            return Err(Error::Device {
                op: "reduce_scatter",
                detail: format!(
                    "dim 0 of {:?} does not split into {} equal chunks",
                    t.shape(),
                    self.size
                ),
            });
        }
        let mut shape = t.shape().to_vec();
        shape[0] /= self.size;
        let (n, ty, rop) = (t.numel() / self.size, Self::data_type(t)?, Self::red_op(op)?);
        self.run("reduce_scatter", t, &shape, |src, dst, stream| {
            // SAFETY: `src` holds `size · n` elements, `dst` n, on this GPU.
            unsafe { nccl::reduce_scatter(src as _, dst as _, n, ty, rop, self.comm, stream as _) }
                .map(|_| ())
                .map_err(|e| format!("{e:?}"))
        })
    }

    fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        let (n, ty, rop) = (t.numel(), Self::data_type(t)?, Self::red_op(op)?);
        self.run("all_reduce", t, t.shape(), |src, dst, stream| {
            // SAFETY: `src` and `dst` hold n elements each, on this GPU.
            unsafe { nccl::all_reduce(src as _, dst as _, n, ty, rop, self.comm, stream as _) }
                .map(|_| ())
                .map_err(|e| format!("{e:?}"))
        })
    }
}
