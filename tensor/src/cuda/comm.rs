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

use cudarc::driver::{result, sys};
use cudarc::nccl::{result as nccl, sys as nccl_sys};
use tessera_mesh::{Communicator, CommunicatorExt, DType, ReduceOp};

use super::driver::{RankStreams, check_library, cuda_error};
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
    /// count and dtype swapped with its peers (checked equal), and `work`
    /// enqueued on the communication stream once every peer's input is ready;
    /// the compute stream then waits for `work` and for every peer's reads of
    /// this rank's input (so that its memory is not reused before).
    fn exchange(
        &self,
        op: &'static str,
        t: &Tensor,
        out_shape: &[usize],
        work: impl FnOnce(&RankStreams, &Tensor, &[u64]) -> Result<()>,
    ) -> Result<Tensor> {
        let t = ops::contiguous(t)?;
        let s = ops::rank_streams(&t)?;
        let out = ops::empty_like_on(&s, out_shape, t.dtype())?;
        s.gpu.bind()?;
        let ready = s.compute.record_event(None).map_err(|e| cuda_error(op, e))?;
        let mine = [
            ops::address(&t) as i64,
            ready.cu_event() as i64,
            t.numel() as i64,
            dtype_code(t.dtype()),
        ];
        let all = self.comm.all_gather_vec::<i64>(&mine).map_err(comm_error)?;
        let peers: Vec<&[i64]> = all.chunks_exact(4).collect();
        if let Some((r, p)) = peers
            .iter()
            .enumerate()
            .find(|(_, p)| p[2] != mine[2] || p[3] != mine[3])
        {
            return Err(Error::Device {
                op,
                detail: format!(
                    "rank {} has {} elements of dtype code {} but rank {r} has {} of code {}; every rank must pass the same shape and dtype",
                    self.comm.rank(),
                    mine[2],
                    mine[3],
                    p[2],
                    p[3]
                ),
            });
        }
        for p in &peers {
            // SAFETY: each peer's event is alive until the closing barrier.
            unsafe {
                result::stream::wait_event(
                    s.comm.cu_stream(),
                    p[1] as sys::CUevent,
                    sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                )
            }
            .map_err(|e| cuda_error(op, e))?;
        }
        let addrs: Vec<u64> = peers.iter().map(|p| p[0] as u64).collect();
        work(&s, &out, &addrs)?;
        let done = s.comm.record_event(None).map_err(|e| cuda_error(op, e))?;
        s.compute.wait(&done).map_err(|e| cuda_error(op, e))?;
        let dones = self
            .comm
            .all_gather_vec::<i64>(&[done.cu_event() as i64])
            .map_err(comm_error)?;
        for &d in &dones {
            // SAFETY: each peer's event is alive until the closing barrier.
            unsafe {
                result::stream::wait_event(
                    s.compute.cu_stream(),
                    d as sys::CUevent,
                    sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                )
            }
            .map_err(|e| cuda_error(op, e))?;
        }
        // Every peer has enqueued its waits on this rank's events: they may go.
        self.comm.barrier().map_err(comm_error)?;
        drop((ready, done));
        ops::used_on(&out, &s.comm)?;
        Ok(out)
    }
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
        let bytes = t.size_in_bytes();
        self.exchange("all_gather", t, &shape, |s, out, addrs| {
            let base = ops::address(out);
            for (p, &src) in addrs.iter().enumerate() {
                // SAFETY: `out` holds `size` inputs' bytes; each peer's input is
                // alive and ready (waited for above).
                unsafe { result::memcpy_dtod_async(base + (p * bytes) as u64, src, bytes, s.comm.cu_stream()) }
                    .map_err(|e| cuda_error("all_gather", e))?;
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
        self.exchange("reduce_scatter", t, &shape, |s, out, addrs| {
            let mut peers = Peers {
                n: addrs.len() as i32,
                ..Peers::default()
            };
            peers.ptr[..addrs.len()].copy_from_slice(addrs);
            ops::reduce_peers(s, out, peers, rank * len, len, op_code(op)?)
        })
    }

    fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        let len = t.numel();
        self.exchange("all_reduce", t, t.shape(), |s, out, addrs| {
            let mut peers = Peers {
                n: addrs.len() as i32,
                ..Peers::default()
            };
            peers.ptr[..addrs.len()].copy_from_slice(addrs);
            ops::reduce_peers(s, out, peers, 0, len, op_code(op)?)
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
