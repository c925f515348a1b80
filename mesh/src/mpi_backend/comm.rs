//! [`MpiComm`]: one MPI communicator as a Tessera [`Communicator`].

use std::os::raw::c_int;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use mpi::ffi;

use super::agree::Fingerprint;
use super::call::{Agreement, Comm, Exec, agree_on, count, counts, exec, gather_words, print};
use super::messages::error_string;
use super::ops::{Handle, average, datatype, in_place_send, ptr, ptr_mut};
use super::runtime::Runtime;
use super::status::Watch;
use crate::comm::{
    Call, Worker, all_to_all_v_bytes, check_call, check_v_local, check_v_rows, nbytes as bytes, reduce_scatter_v_bytes,
    v_name, v_row,
};
use crate::stats::CommStats;
use crate::{Buf, BufMut, Buffer, Communicator, DType, Error, OpKind, ReduceOp, Result, Work};

/// This process's handle on one MPI communicator (a duplicate it owns).
pub(crate) struct MpiComm {
    raw: Comm,
    rank: usize,
    size: usize,
    rt: &'static Runtime,
    worker: Worker,
    watch: Arc<Watch>,
    /// Collectives whose fingerprints this communicator has checked.
    seq: Arc<AtomicU64>,
}

impl MpiComm {
    /// A duplicate of `MPI_COMM_WORLD`.
    pub(crate) fn world(rt: &'static Runtime) -> Result<MpiComm> {
        // SAFETY: MPI is initialised; reading a predefined handle.
        let mut raw = unsafe { ffi::RSMPI_COMM_NULL };
        // SAFETY: `raw` is a valid out-pointer.
        let rc = unsafe { ffi::MPI_Comm_dup(ffi::RSMPI_COMM_WORLD, &mut raw) };
        if rc != 0 {
            return Err(Error::Launch(format!("MPI_Comm_dup: {}", error_string(rc))));
        }
        // SAFETY: `raw` is the communicator just created.
        let rc = unsafe { ffi::MPI_Comm_set_errhandler(raw, ffi::RSMPI_ERRORS_RETURN) };
        if rc != 0 {
            return Err(Error::Launch(format!("MPI_Comm_set_errhandler: {}", error_string(rc))));
        }
        Ok(MpiComm::wrap(rt, Handle(raw)))
    }

    /// Takes ownership of `raw` (freed on drop).
    fn wrap(rt: &'static Runtime, raw: Comm) -> MpiComm {
        let (mut rank, mut size): (c_int, c_int) = (0, 0);
        // SAFETY: `raw` is a live communicator; out-pointers are valid.
        unsafe {
            ffi::MPI_Comm_rank(raw.0, &mut rank);
            ffi::MPI_Comm_size(raw.0, &mut size);
        }
        let (rank, size) = (usize::try_from(rank).unwrap_or(0), usize::try_from(size).unwrap_or(1));
        MpiComm {
            raw,
            rank,
            size,
            rt,
            worker: Worker::new(rank, format!("tessera-mpi-comm-{}", rt.world_rank), None),
            watch: Watch::new(raw.0, rank, size),
            seq: Arc::default(),
        }
    }

    /// This rank's own check of its arguments: `recv` is the output's dtype and
    /// length (`None` for in-place collectives).
    fn check(&self, kind: OpKind, send: &Buf<'_>, recv: Option<(DType, usize)>, root: usize) -> Result<()> {
        let (recv_dtype, recv_len) = recv.unwrap_or((send.dtype(), send.len()));
        let call = Call {
            kind,
            dtype: send.dtype(),
            recv_dtype,
            send_len: send.len(),
            recv_len,
            root,
        };
        check_call(kind.name(), &call, self.size, self.rank)
    }

    /// Waits for queued asynchronous collectives and counts a blocking one.
    /// Times it for [`observe`](crate::observe) until the returned span drops.
    fn begin(&self, kind: OpKind, bytes: usize) -> crate::observe::Span {
        self.begin_sent(kind, kind.bytes_sent(self.size, bytes))
    }

    /// [`begin`](Self::begin) of a collective that sends exactly `sent` bytes
    /// from this rank.
    fn begin_sent(&self, kind: OpKind, sent: u64) -> crate::observe::Span {
        self.worker.fence();
        self.rt.stats.record_exact(kind, sent);
        crate::observe::collective(self.addr(), kind, self.size, sent, false)
    }

    /// This communicator's address, by which meshes name it.
    fn addr(&self) -> usize {
        (self as *const Self).cast::<()>() as usize
    }

    fn run(&self, kind: OpKind, call: impl FnOnce() -> c_int) -> Result<()> {
        exec(&self.watch, kind, self.rank, call)
    }

    /// What the fingerprint check of a collective issued by the caller needs.
    #[track_caller]
    fn agreement(&self) -> Agreement {
        Agreement {
            site: Some(crate::callsite::here()),
            seq: self.seq.clone(),
            full: self.rt.check_calls,
        }
    }

    /// `local` is this rank's own check of its arguments. Unless fingerprints
    /// are off, every rank then compares its call with the others' (a rank whose
    /// own check failed takes part too, so its peers fail with it instead of
    /// waiting for it).
    #[track_caller]
    fn validate(&self, fp: Fingerprint, local: Result<()>) -> Result<()> {
        let a = self.agreement();
        if !a.on() {
            return local;
        }
        self.worker.fence();
        let fp = Fingerprint {
            ok: local.is_ok(),
            ..fp
        };
        let agreed = agree_on(self.raw, &self.watch, self.rank, self.size, fp, &a);
        local.and(agreed)
    }

    /// The cross-rank check of a variable-count collective, always made (as the
    /// threads backend does): every rank all-gathers whether its own checks
    /// (`local`) passed and its dtype, then its [`v_row`], and all run
    /// [`check_v_rows`] over the same rows. A rank whose own checks failed takes
    /// part too, so its peers fail with it instead of waiting. Returns `local`'s value.
    fn exchange_v<T>(
        &self,
        kind: OpKind,
        send: &Buf<'_>,
        recv_len: usize,
        counts_in: &[usize],
        recv_counts: &[usize],
        local: Result<T>,
    ) -> Result<T> {
        let n = self.size;
        let dtype = |w: i64| DType::ALL[usize::try_from(w).unwrap_or(0).min(DType::ALL.len() - 1)];
        let mut row = vec![
            i64::from(local.is_ok()),
            DType::ALL.iter().position(|&d| d == send.dtype()).unwrap_or(0) as i64,
        ];
        row.extend(v_row(kind, n, send.len(), recv_len, counts_in, recv_counts));
        self.worker.fence();
        let all = gather_words(self.raw, &self.watch, self.rank, n, kind, &row)?;
        let local = local?;
        let rows: Vec<&[i64]> = all.chunks_exact(row.len()).collect();
        let name = v_name(kind);
        if let Some(q) = rows.iter().position(|r| r[0] == 0) {
            return Err(Error::Mismatch {
                detail: format!("rank {q} rejected its own arguments to {name} (its error says why)"),
            });
        }
        if let Some(q) = rows.iter().position(|r| r[1] != rows[0][1]) {
            return Err(Error::Mismatch {
                detail: format!(
                    "rank 0 called {name} on {} but rank {q} on {}",
                    dtype(rows[0][1]),
                    dtype(rows[q][1])
                ),
            });
        }
        let tails: Vec<&[i64]> = rows.iter().map(|r| &r[2..]).collect();
        check_v_rows(kind, n, &tails)?;
        Ok(local)
    }

    #[track_caller]
    fn exec_for(&self, kind: OpKind) -> Exec {
        Exec {
            raw: self.raw,
            watch: self.watch.clone(),
            rank: self.rank,
            size: self.size,
            kind,
            check: self.agreement(),
        }
    }

    /// Queues `f` (given the communicator) on the communication thread.
    #[track_caller]
    fn submit(&self, kind: OpKind, bytes: usize, f: impl FnOnce(Exec) -> Result<Buffer> + Send + 'static) -> Work {
        // An all-reduce's count depends on this rank's chunk (the stats table).
        let sent = match kind {
            OpKind::AllReduce => OpKind::all_reduce_sent(self.size, self.rank, bytes),
            _ => kind.bytes_sent(self.size, bytes),
        };
        self.rt.stats.record_exact(kind, sent);
        let run = crate::observe::queued(self.addr(), kind, self.size, sent);
        let ex = self.exec_for(kind);
        self.worker.submit(move || f(ex)).labelled(run)
    }

    /// An asynchronous collective whose arguments failed this rank's own checks:
    /// the error, after (with `TESSERA_MPI_CHECK`) telling the peers in the
    /// cross-rank comparison, in issue order, so they fail instead of waiting.
    #[track_caller]
    fn reject(&self, fp: Fingerprint, e: Error) -> Work {
        let ex = self.exec_for(fp.kind);
        if !ex.check.on() {
            return Work::ready(Err(e));
        }
        let fp = Fingerprint { ok: false, ..fp };
        self.worker.submit(move || {
            // The comparison fails (this rank's print says so); our own error says more.
            let _ = agree_on(ex.raw, &ex.watch, ex.rank, ex.size, fp, &ex.check);
            Err(e)
        })
    }
}

impl Drop for MpiComm {
    fn drop(&mut self) {
        // The communication thread may still use the communicator: end it first. If
        // a collective is still waiting for peers (this rank is failing mid-step), the
        // thread is left to it and the communicator is leaked rather than freed under
        // it: the launcher is about to report the failure and abort the job.
        if !self.worker.stop_or_detach() {
            return;
        }
        if !mpi::environment::is_finalized() {
            // SAFETY: this handle owns the communicator and nothing uses it any more.
            unsafe { ffi::MPI_Comm_free(&mut self.raw.0) };
        }
    }
}

impl Communicator for MpiComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn stats(&self) -> &CommStats {
        &self.rt.stats
    }

    fn backend(&self) -> &'static str {
        "mpi"
    }

    fn all_gather(&self, send: Buf<'_>, mut recv: BufMut<'_>) -> Result<()> {
        let local = self.check(OpKind::AllGather, &send, Some((recv.dtype(), recv.len())), 0);
        self.validate(print(OpKind::AllGather, send.dtype(), send.len(), 0, None), local)?;
        let _obs = self.begin(OpKind::AllGather, bytes(&send) * self.size);
        let (c, dt) = (count("all_gather", self.rank, send.len())?, datatype(send.dtype()));
        count("all_gather", self.rank, recv.len())?;
        let (s, r) = (ptr(&send), ptr_mut(&mut recv));
        // SAFETY: `s` holds `c` elements and `r` `size * c` (checked above), both of `dt`.
        self.run(OpKind::AllGather, || unsafe {
            ffi::MPI_Allgather(s, c, dt, r, c, dt, self.raw.0)
        })
    }

    fn reduce_scatter(&self, send: Buf<'_>, mut recv: BufMut<'_>, op: ReduceOp) -> Result<()> {
        let local = self
            .check(OpKind::ReduceScatter, &send, Some((recv.dtype(), recv.len())), 0)
            .and_then(|_| op.check("reduce_scatter", send.dtype()));
        self.validate(
            print(OpKind::ReduceScatter, send.dtype(), send.len(), 0, Some(op)),
            local,
        )?;
        let _obs = self.begin(OpKind::ReduceScatter, bytes(&send));
        count("reduce_scatter", self.rank, send.len())?;
        let c = count("reduce_scatter", self.rank, recv.len())?;
        let (dt, mop) = (datatype(send.dtype()), self.rt.ops.get(send.dtype(), op));
        let (s, r) = (ptr(&send), ptr_mut(&mut recv));
        // SAFETY: `s` holds `size * c` elements and `r` `c`, both of `dt`.
        self.run(OpKind::ReduceScatter, || unsafe {
            ffi::MPI_Reduce_scatter_block(s, r, c, dt, mop, self.raw.0)
        })?;
        average(op, &mut recv, self.size);
        Ok(())
    }

    fn all_reduce(&self, mut buf: BufMut<'_>, op: ReduceOp) -> Result<()> {
        let local = op.check("all_reduce", buf.dtype());
        self.validate(print(OpKind::AllReduce, buf.dtype(), buf.len(), 0, Some(op)), local)?;
        let _obs = self.begin_sent(
            OpKind::AllReduce,
            OpKind::all_reduce_sent(self.size, self.rank, bytes(&buf.as_buf())),
        );
        let (c, dtype) = (count("all_reduce", self.rank, buf.len())?, buf.dtype());
        let (dt, mop) = (datatype(dtype), self.rt.ops.get(dtype, op));
        let (s, _copy) = in_place_send(self.rt.in_place, &buf.as_buf());
        let r = ptr_mut(&mut buf);
        // SAFETY: `r` holds `c` elements of `dt`; `s` is MPI_IN_PLACE or a copy of them.
        self.run(OpKind::AllReduce, || unsafe {
            ffi::MPI_Allreduce(s, r, c, dt, mop, self.raw.0)
        })?;
        average(op, &mut buf, self.size);
        Ok(())
    }

    fn all_reduce_into(&self, send: Buf<'_>, mut recv: BufMut<'_>, op: ReduceOp) -> Result<()> {
        let local = self
            .check(OpKind::AllReduce, &send, Some((recv.dtype(), recv.len())), 0)
            .and_then(|_| op.check("all_reduce", send.dtype()));
        self.validate(print(OpKind::AllReduce, send.dtype(), send.len(), 0, Some(op)), local)?;
        let _obs = self.begin_sent(
            OpKind::AllReduce,
            OpKind::all_reduce_sent(self.size, self.rank, bytes(&send)),
        );
        let c = count("all_reduce", self.rank, send.len())?;
        let (dt, mop) = (datatype(send.dtype()), self.rt.ops.get(send.dtype(), op));
        let (s, r) = (ptr(&send), ptr_mut(&mut recv));
        // SAFETY: both buffers hold `c` elements of `dt` (checked above).
        self.run(OpKind::AllReduce, || unsafe {
            ffi::MPI_Allreduce(s, r, c, dt, mop, self.raw.0)
        })?;
        average(op, &mut recv, self.size);
        Ok(())
    }

    fn all_to_all(&self, send: Buf<'_>, mut recv: BufMut<'_>) -> Result<()> {
        let local = self.check(OpKind::AllToAll, &send, Some((recv.dtype(), recv.len())), 0);
        self.validate(print(OpKind::AllToAll, send.dtype(), send.len(), 0, None), local)?;
        let _obs = self.begin(OpKind::AllToAll, bytes(&send));
        count("all_to_all", self.rank, send.len())?;
        let (c, dt) = (
            count("all_to_all", self.rank, send.len() / self.size)?,
            datatype(send.dtype()),
        );
        let (s, r) = (ptr(&send), ptr_mut(&mut recv));
        // SAFETY: both buffers hold `size * c` elements of `dt` (checked above).
        self.run(OpKind::AllToAll, || unsafe {
            ffi::MPI_Alltoall(s, c, dt, r, c, dt, self.raw.0)
        })
    }

    fn broadcast(&self, mut buf: BufMut<'_>, root: usize) -> Result<()> {
        let local = self.check(OpKind::Broadcast, &buf.as_buf(), None, root);
        self.validate(print(OpKind::Broadcast, buf.dtype(), buf.len(), root, None), local)?;
        let _obs = self.begin(OpKind::Broadcast, bytes(&buf.as_buf()));
        let (c, dt) = (count("broadcast", self.rank, buf.len())?, datatype(buf.dtype()));
        let root = count("broadcast", self.rank, root)?;
        let b = ptr_mut(&mut buf);
        // SAFETY: `b` holds `c` elements of `dt`; `root` is in range (checked above).
        self.run(OpKind::Broadcast, || unsafe {
            ffi::MPI_Bcast(b, c, dt, root, self.raw.0)
        })
    }

    fn barrier(&self) -> Result<()> {
        self.validate(Fingerprint::bare(OpKind::Barrier), Ok(()))?;
        let _obs = self.begin(OpKind::Barrier, 0);
        // SAFETY: a live communicator.
        self.run(OpKind::Barrier, || unsafe { ffi::MPI_Barrier(self.raw.0) })
    }

    fn split(&self, color: u32, key: u32) -> Result<Box<dyn Communicator>> {
        let arg = |v: u32, what: &'static str| {
            c_int::try_from(v).map_err(|_| Error::BadLength {
                op: "split",
                rank: self.rank,
                what,
                expected: c_int::MAX as usize,
                got: v as usize,
            })
        };
        let args = arg(color, "color (at most 2^31 - 1)").and_then(|c| Ok((c, arg(key, "key (at most 2^31 - 1)")?)));
        let (local, args) = match args {
            Ok(a) => (Ok(()), Some(a)),
            Err(e) => (Err(e), None),
        };
        self.validate(Fingerprint::bare(OpKind::Split), local)?;
        let Some((color, key)) = args else {
            unreachable!("validate returns the local error")
        };
        let _obs = self.begin(OpKind::Split, 0);
        // SAFETY: reading a predefined handle.
        let mut raw = unsafe { ffi::RSMPI_COMM_NULL };
        // SAFETY: a live communicator; `raw` is a valid out-pointer.
        self.run(OpKind::Split, || unsafe {
            ffi::MPI_Comm_split(self.raw.0, color, key, &mut raw)
        })?;
        Ok(Box::new(MpiComm::wrap(self.rt, Handle(raw))))
    }

    fn all_gather_v(&self, send: Buf<'_>, mut recv: BufMut<'_>, counts_in: &[usize]) -> Result<()> {
        let op = "all_gather_v";
        let local = check_v_local(self, OpKind::AllGather, &send, &recv, counts_in, &[]).and_then(|_| {
            count(op, self.rank, send.len())?;
            counts(op, self.rank, counts_in)
        });
        let local = self.exchange_v(OpKind::AllGather, &send, recv.len(), counts_in, &[], local)?;
        let ((c, displs), sc, dt) = (local, send.len() as c_int, datatype(send.dtype()));
        // n−1 copies of its own piece (the stats table).
        let own = send.len() * send.dtype().size_in_bytes();
        let _obs = self.begin_sent(OpKind::AllGather, ((self.size - 1) * own) as u64);
        let (s, r) = (ptr(&send), ptr_mut(&mut recv));
        // SAFETY: the counts were checked on every rank against the buffer lengths.
        self.run(OpKind::AllGather, || unsafe {
            ffi::MPI_Allgatherv(s, sc, dt, r, c.as_ptr(), displs.as_ptr(), dt, self.raw.0)
        })
    }

    fn reduce_scatter_v(&self, send: Buf<'_>, mut recv: BufMut<'_>, counts_in: &[usize], op: ReduceOp) -> Result<()> {
        let name = "reduce_scatter_v";
        let local = check_v_local(self, OpKind::ReduceScatter, &send, &recv, counts_in, &[])
            .and_then(|dtype| op.check(name, dtype))
            .and_then(|_| counts(name, self.rank, counts_in));
        let (c, _) = self.exchange_v(OpKind::ReduceScatter, &send, recv.len(), counts_in, &[], local)?;
        // The input less its own piece (the stats table).
        let sent = reduce_scatter_v_bytes(send.dtype(), bytes(&send), counts_in, self.rank);
        let _obs = self.begin_sent(OpKind::ReduceScatter, sent);
        let dtype = send.dtype();
        let (dt, mop) = (datatype(dtype), self.rt.ops.get(dtype, op));
        let (s, r) = (ptr(&send), ptr_mut(&mut recv));
        // SAFETY: the counts were checked on every rank against the buffer lengths.
        self.run(OpKind::ReduceScatter, || unsafe {
            ffi::MPI_Reduce_scatter(s, r, c.as_ptr(), dt, mop, self.raw.0)
        })?;
        average(op, &mut recv, self.size);
        Ok(())
    }

    fn all_to_all_v(
        &self,
        send: Buf<'_>,
        send_counts: &[usize],
        mut recv: BufMut<'_>,
        recv_counts: &[usize],
    ) -> Result<()> {
        let op = "all_to_all_v";
        let local = check_v_local(self, OpKind::AllToAll, &send, &recv, send_counts, recv_counts)
            .and_then(|_| Ok((counts(op, self.rank, send_counts)?, counts(op, self.rank, recv_counts)?)));
        let ((sc, sd), (rc, rd)) =
            self.exchange_v(OpKind::AllToAll, &send, recv.len(), send_counts, recv_counts, local)?;
        let _obs = self.begin_sent(
            OpKind::AllToAll,
            all_to_all_v_bytes(send.dtype(), send_counts, self.rank),
        );
        let dt = datatype(send.dtype());
        let (s, r) = (ptr(&send), ptr_mut(&mut recv));
        // SAFETY: the counts were checked on every rank against the buffer lengths.
        self.run(OpKind::AllToAll, || unsafe {
            ffi::MPI_Alltoallv(
                s,
                sc.as_ptr(),
                sd.as_ptr(),
                dt,
                r,
                rc.as_ptr(),
                rd.as_ptr(),
                dt,
                self.raw.0,
            )
        })
    }

    fn all_gather_segmented_async(&self, send: Buffer, segments: Vec<usize>) -> Work {
        let n = self.size;
        let (rank, len, dtype) = (self.rank, send.len(), send.dtype());
        if let Err(e) = crate::comm::check_segments(
            self,
            (send.dtype(), send.len()),
            (dtype, len.saturating_mul(n)),
            &segments,
        ) {
            return Work::ready(Err(e));
        }
        self.submit(OpKind::AllGather, len * dtype.size_in_bytes() * n, move |ex| {
            ex.agree(dtype, len, 0, None)?;
            let c = count("all_gather", rank, len)?;
            count("all_gather", rank, len * n)?;
            let mut rank_major = Buffer::zeros(dtype, len * n);
            let (s, r, dt) = (
                ptr(&send.as_buf()),
                ptr_mut(&mut rank_major.as_buf_mut()),
                datatype(dtype),
            );
            // SAFETY: `send` holds `c` elements and `rank_major` `n * c`, both owned by this job.
            ex.run(|comm| unsafe { ffi::MPI_Allgather(s, c, dt, r, c, dt, comm) })?;
            let mut recv = Buffer::zeros(dtype, len * n);
            crate::comm::segment_major(&rank_major.as_buf(), &mut recv.as_buf_mut(), &segments, n)?;
            Ok(recv)
        })
    }

    fn all_gather_async(&self, send: Buffer) -> Work {
        let n = self.size;
        let (rank, len, dtype) = (self.rank, send.len(), send.dtype());
        self.submit(OpKind::AllGather, len * dtype.size_in_bytes() * n, move |ex| {
            ex.agree(dtype, len, 0, None)?;
            let c = count("all_gather", rank, len)?;
            count("all_gather", rank, len * n)?;
            let mut recv = Buffer::zeros(dtype, len * n);
            let (s, r, dt) = (ptr(&send.as_buf()), ptr_mut(&mut recv.as_buf_mut()), datatype(dtype));
            // SAFETY: `send` holds `c` elements and `recv` `n * c`, both owned by this job.
            ex.run(|comm| unsafe { ffi::MPI_Allgather(s, c, dt, r, c, dt, comm) })?;
            Ok(recv)
        })
    }

    fn reduce_scatter_async(&self, send: Buffer, op: ReduceOp) -> Work {
        let (n, rank, dtype) = (self.size, self.rank, send.dtype());
        let block = send.len() / n;
        // The output is ours to size: only the send length can be wrong.
        let checked = self
            .check(OpKind::ReduceScatter, &send.as_buf(), Some((dtype, block)), 0)
            .and_then(|_| op.check("reduce_scatter", dtype));
        if let Err(e) = checked {
            return self.reject(print(OpKind::ReduceScatter, dtype, send.len(), 0, Some(op)), e);
        }
        let mop = Handle(self.rt.ops.get(dtype, op));
        self.submit(OpKind::ReduceScatter, send.len() * dtype.size_in_bytes(), move |ex| {
            ex.agree(dtype, send.len(), 0, Some(op))?;
            count("reduce_scatter", rank, send.len())?;
            let c = count("reduce_scatter", rank, block)?;
            let mut recv = Buffer::zeros(dtype, block);
            let (s, r, dt) = (ptr(&send.as_buf()), ptr_mut(&mut recv.as_buf_mut()), datatype(dtype));
            let mop = mop.get();
            // SAFETY: `send` holds `n * c` elements and `recv` `c`, both owned by this job.
            ex.run(|comm| unsafe { ffi::MPI_Reduce_scatter_block(s, r, c, dt, mop, comm) })?;
            average(op, &mut recv.as_buf_mut(), n);
            Ok(recv)
        })
    }

    fn all_reduce_async(&self, mut buf: Buffer, op: ReduceOp) -> Work {
        let (n, rank, dtype) = (self.size, self.rank, buf.dtype());
        if let Err(e) = op.check("all_reduce", dtype) {
            return self.reject(print(OpKind::AllReduce, dtype, buf.len(), 0, Some(op)), e);
        }
        let mop = Handle(self.rt.ops.get(dtype, op));
        let in_place = self.rt.in_place;
        self.submit(OpKind::AllReduce, buf.len() * dtype.size_in_bytes(), move |ex| {
            ex.agree(dtype, buf.len(), 0, Some(op))?;
            let c = count("all_reduce", rank, buf.len())?;
            let (s, _copy) = in_place_send(in_place, &buf.as_buf());
            let (r, dt, mop) = (ptr_mut(&mut buf.as_buf_mut()), datatype(dtype), mop.get());
            // SAFETY: `buf` holds `c` elements of `dt`; `s` is MPI_IN_PLACE or a copy of them.
            ex.run(|comm| unsafe { ffi::MPI_Allreduce(s, r, c, dt, mop, comm) })?;
            average(op, &mut buf.as_buf_mut(), n);
            Ok(buf)
        })
    }

    fn all_to_all_async(&self, send: Buffer) -> Work {
        let (n, rank, dtype) = (self.size, self.rank, send.dtype());
        if !send.len().is_multiple_of(n) {
            let e = Error::BadLength {
                op: "all_to_all",
                rank,
                what: "send buffer (must be a multiple of the group size)",
                expected: send.len().div_ceil(n) * n,
                got: send.len(),
            };
            return self.reject(print(OpKind::AllToAll, dtype, send.len(), 0, None), e);
        }
        self.submit(OpKind::AllToAll, send.len() * dtype.size_in_bytes(), move |ex| {
            ex.agree(dtype, send.len(), 0, None)?;
            count("all_to_all", rank, send.len())?;
            let c = count("all_to_all", rank, send.len() / n)?;
            let mut recv = Buffer::zeros(dtype, send.len());
            let (s, r, dt) = (ptr(&send.as_buf()), ptr_mut(&mut recv.as_buf_mut()), datatype(dtype));
            // SAFETY: both buffers hold `n * c` elements of `dt`, owned by this job.
            ex.run(|comm| unsafe { ffi::MPI_Alltoall(s, c, dt, r, c, dt, comm) })?;
            Ok(recv)
        })
    }

    fn broadcast_async(&self, mut buf: Buffer, root: usize) -> Work {
        let (n, rank) = (self.size, self.rank);
        let dtype: DType = buf.dtype();
        if root >= n {
            let e = Error::InvalidRank {
                op: "broadcast",
                rank: root,
                size: n,
            };
            return self.reject(print(OpKind::Broadcast, dtype, buf.len(), root, None), e);
        }
        self.submit(OpKind::Broadcast, buf.len() * dtype.size_in_bytes(), move |ex| {
            ex.agree(dtype, buf.len(), root, None)?;
            let c = count("broadcast", rank, buf.len())?;
            let root = count("broadcast", rank, root)?;
            let (b, dt) = (ptr_mut(&mut buf.as_buf_mut()), datatype(dtype));
            // SAFETY: `buf` holds `c` elements of `dt`, owned by this job.
            ex.run(|comm| unsafe { ffi::MPI_Bcast(b, c, dt, root, comm) })?;
            Ok(buf)
        })
    }
}
