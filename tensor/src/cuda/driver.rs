//! One context per GPU with its allocator and compiled kernels, and each
//! rank's streams.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex, OnceLock, PoisonError};

use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream, LaunchConfig};
use tessera_mesh::context::{RankId, current_rank};

use super::alloc::Pool;
use super::blas::Blas;
use super::library::{check_library, cuda_error};
use super::staging::Staging;
use crate::{Error, Result, Tensor};

/// One GPU: its context, caching allocator and compiled kernels.
pub(crate) struct Gpu {
    pub(crate) ordinal: usize,
    pub(crate) ctx: Arc<CudaContext>,
    /// Compute capability (major, minor).
    pub(crate) arch: (i32, i32),
    pub(crate) pool: Arc<Pool>,
    module: OnceLock<std::result::Result<Arc<CudaModule>, String>>,
    functions: Mutex<HashMap<String, CudaFunction>>,
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "cuda:{}", self.ordinal)
    }
}

/// How many GPUs the driver sees (0 when there is no driver).
pub(crate) fn device_count() -> usize {
    if check_library("cuda").is_err() {
        return 0;
    }
    CudaContext::device_count().map_or(0, |n| n.max(0) as usize)
}

/// The GPU with this ordinal, its context made on first use.
pub(crate) fn gpu(ordinal: usize) -> Result<Arc<Gpu>> {
    static GPUS: LazyLock<Mutex<HashMap<usize, Arc<Gpu>>>> = LazyLock::new(Default::default);
    let mut gpus = GPUS.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(g) = gpus.get(&ordinal) {
        return Ok(Arc::clone(g));
    }
    check_library("cuda")?;
    let count = CudaContext::device_count().map_err(|e| cuda_error("cuda", e))?;
    if ordinal >= count.max(0) as usize {
        return Err(Error::Device {
            op: "cuda",
            detail: format!(
                "cuda:{ordinal} does not exist: the driver sees {count} GPU(s); use cuda:0 to cuda:{}",
                count - 1
            ),
        });
    }
    let ctx = CudaContext::new(ordinal).map_err(|e| cuda_error("cuda", e))?;
    // Tensors order their work by streams and events themselves (below), so
    // cudarc's own per-buffer event tracking is not used.
    // SAFETY: no cudarc-managed buffer (`CudaSlice`) is ever made on this context.
    unsafe { ctx.disable_event_tracking() };
    let arch = ctx.compute_capability().map_err(|e| cuda_error("cuda", e))?;
    let g = Arc::new(Gpu {
        ordinal,
        pool: Pool::new(Arc::clone(&ctx), ordinal),
        ctx,
        arch,
        module: OnceLock::new(),
        functions: Mutex::default(),
    });
    gpus.insert(ordinal, Arc::clone(&g));
    Ok(g)
}

impl Gpu {
    /// Makes this GPU's context current on the calling thread.
    pub(crate) fn bind(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(|e| cuda_error("cuda", e))
    }

    /// The kernel `name`, compiling every kernel source for this GPU on first use.
    pub(crate) fn function(&self, name: &str) -> Result<CudaFunction> {
        let mut functions = self.functions.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(f) = functions.get(name) {
            return Ok(f.clone());
        }
        let module = self
            .module
            .get_or_init(|| {
                let ptx = super::kernels::compile(self.arch).map_err(|e| e.to_string())?;
                self.ctx
                    .load_module(ptx)
                    .map_err(|e| format!("loading the compiled kernels: {e}"))
            })
            .as_ref()
            .map_err(|detail| Error::Device {
                op: "cuda",
                detail: detail.clone(),
            })?;
        let f = module.load_function(name).map_err(|e| Error::Device {
            op: "cuda",
            detail: format!("kernel {name} is not in the compiled sources: {e}"),
        })?;
        functions.insert(name.to_string(), f.clone());
        Ok(f)
    }
}

/// The streams of one rank on one GPU: kernels on `compute`, collectives on
/// `comm` (ordered against `compute` by events), and the cuBLAS handle bound
/// to `compute`.
pub(crate) struct RankStreams {
    pub(crate) gpu: Arc<Gpu>,
    pub(crate) compute: Arc<CudaStream>,
    pub(crate) comm: Arc<CudaStream>,
    pub(crate) blas: Blas,
    /// Checks of indices that kernels flag on the device, read when the host
    /// next waits for this rank's work ([`RankStreams::settle`]).
    pending: Mutex<Vec<PendingCheck>>,
    /// How many times the host has waited for this rank's work.
    waits: AtomicU64,
    /// Pinned slots for small copies from the host, made on first use.
    pub(crate) staging: Mutex<Option<Staging>>,
}

/// A check of indices whose verdict a kernel writes to the device word `flag`
/// (position `k + 1` of a bad index `k`, else 0); `what` says what is
/// wrong with index `k` of value `i`.
pub(crate) struct PendingCheck {
    pub(crate) flag: Tensor,
    pub(crate) indices: Tensor,
    pub(crate) op: &'static str,
    pub(crate) what: Box<dyn FnOnce(i64, usize) -> String + Send>,
}

/// Pending checks kept before the host waits for the device to read them.
const MAX_PENDING_CHECKS: usize = 64;

impl RankStreams {
    /// Queues `check`, read when the host next waits for this rank's work:
    /// reading it now would make the host wait for the device in the middle of
    /// a step. Past [`MAX_PENDING_CHECKS`] the queued ones are read now.
    pub(crate) fn defer(&self, check: PendingCheck) -> Result<()> {
        let full = {
            let mut p = self.pending.lock().unwrap_or_else(PoisonError::into_inner);
            p.push(check);
            p.len() >= MAX_PENDING_CHECKS
        };
        if full { self.settle() } else { Ok(()) }
    }

    /// Reads the pending checks (waiting for the kernels that set their
    /// flags): the first that failed is the error, and every check is dropped.
    pub(crate) fn settle(&self) -> Result<()> {
        let checks = std::mem::take(&mut *self.pending.lock().unwrap_or_else(PoisonError::into_inner));
        for c in checks {
            let k = c.flag.to(crate::Device::Cpu)?.to_vec::<i64>()?[0];
            if k > 0 {
                let at = k as usize - 1;
                let flat = c.indices.to(crate::Device::Cpu)?;
                let value = flat.reshape(&[flat.numel()])?.to_vec::<i64>()?[at];
                return Err(Error::InvalidArgument {
                    op: c.op,
                    detail: (c.what)(value, at),
                });
            }
        }
        Ok(())
    }

    /// Waits until the compute stream (with `comm`, the communication stream
    /// too) has run all it was given, counts the wait, and reads the pending
    /// checks: the device has caught up, so they cost no further wait. `op`
    /// names the caller in errors.
    pub(crate) fn wait(&self, op: &'static str, comm: bool) -> Result<()> {
        self.compute.synchronize().map_err(|e| cuda_error(op, e))?;
        if comm {
            self.comm.synchronize().map_err(|e| cuda_error(op, e))?;
        }
        self.count_wait();
        self.settle()
    }

    /// Counts a wait of the host for this rank's work.
    pub(crate) fn count_wait(&self) {
        self.waits.fetch_add(1, Ordering::Relaxed);
    }

    /// How many times the host has waited for this rank's work.
    pub(crate) fn waits(&self) -> u64 {
        self.waits.load(Ordering::Relaxed)
    }
}

// SAFETY: the cuBLAS handle is only used under `blas`'s own mutex, and streams
// and contexts are thread-safe CUDA objects.
unsafe impl Send for RankStreams {}
// SAFETY: as above.
unsafe impl Sync for RankStreams {}

type StreamKey = (Option<RankId>, usize);

/// Every rank's streams, by rank and GPU, created at a rank's first use of a GPU.
static STREAMS: LazyLock<Mutex<HashMap<StreamKey, Arc<RankStreams>>>> = LazyLock::new(Default::default);

/// Waits until the calling rank's work on every GPU it has used has finished
/// (nothing to wait for, and no driver loaded, when it has used none).
pub(crate) fn synchronize_rank() -> Result<()> {
    let rank = current_rank();
    let mine: Vec<Arc<RankStreams>> = STREAMS
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .iter()
        .filter(|((r, _), _)| *r == rank)
        .map(|(_, s)| Arc::clone(s))
        .collect();
    for s in mine {
        s.wait("synchronize", true)?;
    }
    Ok(())
}

/// The streams of the rank the calling thread works for, on `gpu`: every thread
/// of one rank shares them, so a rank's work is ordered whatever thread issues
/// it; threads outside a launch share one set per GPU.
pub(crate) fn streams(gpu: &Arc<Gpu>) -> Result<Arc<RankStreams>> {
    let key = (current_rank(), gpu.ordinal);
    let mut map = STREAMS.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(s) = map.get(&key) {
        return Ok(Arc::clone(s));
    }
    let compute = gpu.ctx.new_stream().map_err(|e| cuda_error("cuda", e))?;
    let comm = gpu.ctx.new_stream().map_err(|e| cuda_error("cuda", e))?;
    let blas = Blas::new(&gpu.ctx, &compute)?;
    let s = Arc::new(RankStreams {
        gpu: Arc::clone(gpu),
        compute,
        comm,
        blas,
        pending: Mutex::default(),
        waits: AtomicU64::new(0),
        staging: Mutex::default(),
    });
    map.insert(key, Arc::clone(&s));
    Ok(s)
}

/// A one-dimensional launch over `n` threads, 256 to a block.
pub(crate) fn grid_1d(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(256).clamp(1, 1 << 20) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Blocks of 32 columns × 32 lanes over `n` columns, times `chunks` of rows
/// (`kernels.cu`'s `column_sums`).
pub(crate) fn grid_columns(n: usize, chunks: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (
            n.div_ceil(32).clamp(1, u32::MAX as usize) as u32,
            chunks.clamp(1, 65535) as u32,
            1,
        ),
        block_dim: (1024, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Rows per block of the warp-per-row kernels (`kernels.cu`'s `WARP_ROWS`).
const WARP_ROWS_PER_BLOCK: usize = 4;

/// The slots per lane of the warp-per-row kernels for rows of `n` elements (a
/// power of two with `n ≤ 32·slots`), or `None` for rows longer than 1024,
/// which take the block-per-row kernels.
pub(crate) fn warp_slots(n: usize) -> Option<usize> {
    (n <= 1024).then(|| n.div_ceil(32).next_power_of_two())
}

/// One warp per row, [`WARP_ROWS_PER_BLOCK`] rows to a block (the kernels loop
/// over the grid, so the clamp only limits the launch).
pub(crate) fn grid_warp_rows(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.div_ceil(WARP_ROWS_PER_BLOCK).clamp(1, 1 << 20) as u32, 1, 1),
        block_dim: (32 * WARP_ROWS_PER_BLOCK as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One block of `threads` per row, `rows` blocks.
pub(crate) fn grid_rows(rows: usize, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.clamp(1, u32::MAX as usize) as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}
