//! Every collective against its oracle, for world sizes 1, 2, 3, 4, 8 and every
//! dtype, on the world communicator and on sub-communicators of meshes; the
//! provided (padded) variable-count forms through a wrapper that overrides nothing.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tessera::mesh::{Buf, BufMut, CommStats, OpKind, Result, testing};
use tessera::{Communicator, CommunicatorExt, LaunchOptions, ReduceOp, launch, launch_with};

/// Delegates only the required methods of [`Communicator`] to a real communicator,
/// so every provided method (the padded variable-count forms included) runs its
/// default. Its splits are wrapped too.
pub(crate) struct Defaults(pub(crate) Box<dyn Communicator>);

impl Communicator for Defaults {
    fn rank(&self) -> usize {
        self.0.rank()
    }
    fn size(&self) -> usize {
        self.0.size()
    }
    fn all_gather(&self, send: Buf<'_>, recv: BufMut<'_>) -> Result<()> {
        self.0.all_gather(send, recv)
    }
    fn reduce_scatter(&self, send: Buf<'_>, recv: BufMut<'_>, op: ReduceOp) -> Result<()> {
        self.0.reduce_scatter(send, recv, op)
    }
    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<()> {
        self.0.broadcast(buf, root)
    }
    fn barrier(&self) -> Result<()> {
        self.0.barrier()
    }
    fn split(&self, color: u32, key: u32) -> Result<Box<dyn Communicator>> {
        Ok(Box::new(Defaults(self.0.split(color, key)?)))
    }
    fn stats(&self) -> &CommStats {
        self.0.stats()
    }
}

#[test]
fn contract_on_world_sizes() {
    for n in [1, 2, 3, 4, 8] {
        launch(n, |ctx| {
            testing::check_all(ctx.comm());
            Ok(())
        })
        .unwrap_or_else(|e| panic!("world size {n}: {e}"));
    }
}

/// Every mesh dim's communicator holds exactly the ranks that differ only along that
/// dim (the contract body the MPI tests run too).
fn check_dim_comms(shape: &'static [usize]) {
    let n: usize = shape.iter().product();
    launch(n, move |ctx| {
        testing::check_mesh(ctx.into_comm(), shape);
        Ok(())
    })
    .unwrap();
}

#[test]
fn sub_communicators_of_2x2_mesh() {
    check_dim_comms(&[2, 2]);
}

#[test]
fn sub_communicators_of_2x2x2_mesh() {
    check_dim_comms(&[2, 2, 2]);
}

#[test]
fn sub_communicators_of_uneven_mesh() {
    check_dim_comms(&[3, 2]);
}

/// An asynchronous collective returns before its peers have even entered it, so
/// the rank can compute meanwhile. Rank 1 enters only after rank 0's issue call
/// has returned and rank 0 has seen it unfinished: a blocking implementation
/// would deadlock here (and fail by the short timeout).
#[test]
fn async_returns_before_peers_arrive() {
    let issued = AtomicBool::new(false);
    let opts = LaunchOptions::default().timeout(Duration::from_secs(20));
    let out = launch_with(&opts, 2, move |ctx| {
        let comm = ctx.comm();
        if ctx.rank() == 0 {
            let mut work = comm.all_gather_async(vec![1.0f32; 1000].into());
            let unfinished = !work.is_done();
            issued.store(true, Ordering::Release);
            // Compute while the collective is pending.
            let busy: f64 = (0..100_000).map(|i| (i as f64).sqrt()).sum();
            let got = work.wait_vec::<f32>()?;
            assert_eq!(got.len(), 2000);
            assert!(got[..1000].iter().all(|&x| x == 1.0) && got[1000..].iter().all(|&x| x == 2.0));
            Ok((unfinished, busy > 0.0))
        } else {
            while !issued.load(Ordering::Acquire) {
                std::thread::yield_now();
            }
            let got = comm.all_gather_vec(&vec![2.0f32; 1000])?;
            assert_eq!(got.len(), 2000);
            Ok((true, true))
        }
    })
    .unwrap();
    assert_eq!(
        out[0],
        (true, true),
        "rank 0's async all_gather must be pending after it returned"
    );
}

/// `Work::wait_timed`: a wait that had to block says how long (rank 1 joins
/// only after rank 0 started waiting, and sleeps first), one that found the
/// collective finished blocked for nothing; either way the communication
/// thread's run lies after the issue; a handle completed at issue ran nothing.
#[test]
fn async_work_tells_when_it_ran_and_how_long_it_blocked() {
    let waiting = AtomicBool::new(false);
    let opts = LaunchOptions::default().timeout(Duration::from_secs(20));
    launch_with(&opts, 2, move |ctx| {
        let comm = ctx.comm();
        if ctx.rank() == 0 {
            let work = comm.all_gather_async(vec![1.0f32; 1000].into());
            waiting.store(true, Ordering::Release);
            let (got, t) = work.wait_timed();
            assert_eq!(got?.len(), 2000);
            let (start, end) = t
                .ran
                .expect("an asynchronous collective ran on the communication thread");
            assert!(t.issued <= start && start <= end, "{t:?}");
            assert!(
                t.blocked >= Duration::from_millis(10),
                "rank 1 joined 100 ms after the wait began: {t:?}"
            );
            assert!(t.hidden() <= t.run(), "{t:?}");
            // Finished before asked for: no blocking, all of the run hidden.
            let mut work = comm.all_gather_async(vec![1.0f32; 10].into());
            while !work.is_done() {
                std::thread::sleep(Duration::from_millis(1));
            }
            let (got, t) = work.wait_timed();
            assert_eq!(got?.len(), 20);
            assert!(t.ran.is_some(), "{t:?}");
            assert_eq!(t.blocked, Duration::ZERO, "{t:?}");
            assert_eq!(t.hidden(), t.run(), "{t:?}");
        } else {
            while !waiting.load(Ordering::Acquire) {
                std::thread::yield_now();
            }
            std::thread::sleep(Duration::from_millis(100));
            assert_eq!(comm.all_gather_vec(&vec![2.0f32; 1000])?.len(), 2000);
            assert_eq!(comm.all_gather_vec(&[2.0f32; 10])?.len(), 20);
        }
        Ok(())
    })
    .unwrap();
    let (got, t) = tessera::mesh::Work::ready(Ok(vec![1.0f32].into())).wait_timed();
    assert_eq!(got.unwrap().len(), 1);
    assert_eq!(
        (t.ran, t.run(), t.hidden(), t.blocked),
        (None, Duration::ZERO, Duration::ZERO, Duration::ZERO)
    );
}

/// Asynchronous collectives complete in issue order even when waited in reverse.
#[test]
fn async_issue_order() {
    launch(3, |ctx| {
        let comm = ctx.comm();
        let works: Vec<_> = (0..5)
            .map(|k| comm.all_reduce_async(vec![(k * 10 + ctx.rank()) as i64; 4].into(), tessera::ReduceOp::Sum))
            .collect();
        for (k, w) in works.into_iter().enumerate().rev() {
            let v = w.wait_vec::<i64>()?;
            assert_eq!(v, vec![(k * 30 + 3) as i64; 4]);
        }
        Ok(())
    })
    .unwrap();
}

/// The provided forms, padded to the largest count, pass the same contract
/// (on the world and on split sub-groups, whose communicators are wrapped too).
#[test]
fn padded_variable_count_defaults_are_correct() {
    for n in [1, 2, 3, 4, 8] {
        launch(n, |ctx| {
            let comm = Defaults(ctx.into_comm());
            testing::check_variable_all(&comm);
            testing::check_runs::<f32>(&comm);
            testing::check_runs::<i64>(&comm);
            testing::check_split(&comm);
            Ok(())
        })
        .unwrap_or_else(|e| panic!("world size {n}: {e}"));
    }
}

/// The provided [`Pieces`](tessera::mesh::Pieces) forms (packing first) pass the
/// same contract as the threads backend's in-place reads.
#[test]
fn packed_pieces_defaults_are_correct() {
    for n in [1, 2, 3] {
        launch(n, |ctx| {
            let comm = Defaults(ctx.into_comm());
            testing::check_pieces::<f32>(&comm);
            testing::check_pieces::<f64>(&comm);
            testing::check_pieces::<i64>(&comm);
            Ok(())
        })
        .unwrap_or_else(|e| panic!("world size {n}: {e}"));
    }
}

/// `m[i][j]`: elements rank `i` sends to rank `j` (every diagonal entry nonzero, so
/// counting the own segment, or the even-split formula, gives other numbers).
fn a2a_counts(n: usize) -> Vec<Vec<usize>> {
    (0..n).map(|i| (0..n).map(|j| i + 2 * j + 1).collect()).collect()
}

/// Runs all_to_all_v of f32 with [`a2a_counts`] and returns what the stats saw.
fn a2a_v_stats(comm: &dyn Communicator) -> Result<tessera::mesh::CommCounts> {
    let (r, n) = (comm.rank(), comm.size());
    let m = a2a_counts(n);
    let recv_counts: Vec<usize> = (0..n).map(|i| m[i][r]).collect();
    let send = vec![r as f32; m[r].iter().sum()];
    let mut recv = vec![0.0f32; recv_counts.iter().sum()];
    let before = comm.stats().snapshot();
    comm.all_to_all_v((&send[..]).into(), &m[r], (&mut recv[..]).into(), &recv_counts)?;
    let d = comm.stats().snapshot() - before;
    let want: Vec<f32> = (0..n).flat_map(|i| vec![i as f32; m[i][r]]).collect();
    assert_eq!(recv, want, "all_to_all_v on rank {r}");
    Ok(d)
}

/// The threads backend moves exactly the logical data: all_gather_v and
/// reduce_scatter_v count their logical totals, all_to_all_v exactly the bytes
/// that leave the rank, and nothing else runs (no exchange of counts, no padding).
#[test]
fn variable_count_stats_count_logical_bytes() {
    let n = 4;
    launch(n, move |ctx| {
        let comm = ctx.comm();
        let r = comm.rank();
        let counts = testing::chunk_counts(5, n);
        assert_eq!(counts, [2, 2, 1, 0]);

        let before = comm.stats().snapshot();
        let mut out = [0.0f32; 5];
        comm.all_gather_v((&vec![1.0f32; counts[r]][..]).into(), (&mut out[..]).into(), &counts)?;
        let mut mine = vec![0.0f64; counts[r]];
        comm.reduce_scatter_v(
            (&[1.0f64; 5][..]).into(),
            (&mut mine[..]).into(),
            &counts,
            ReduceOp::Sum,
        )?;
        let d = comm.stats().snapshot() - before;
        // Each rank's exact share: n−1 copies of its own piece gathered, the
        // input less its own piece scattered; summed over the ranks, (n−1)
        // times the whole buffer (the mean rounded down would lose bytes).
        assert_eq!(d.calls(OpKind::AllGather), 1);
        assert_eq!(d.bytes(OpKind::AllGather), ((n - 1) * counts[r] * 4) as u64);
        assert_eq!(d.calls(OpKind::ReduceScatter), 1);
        assert_eq!(d.bytes(OpKind::ReduceScatter), ((5 - counts[r]) * 8) as u64);
        assert_eq!(d.total_calls(), 2, "rank {r}: {d}");
        let all = comm.all_gather_vec(&[d.bytes(OpKind::AllGather) as i64, d.bytes(OpKind::ReduceScatter) as i64])?;
        let sum = |k: usize| all.chunks(2).map(|c| c[k]).sum::<i64>();
        assert_eq!((sum(0), sum(1)), (3 * 5 * 4, 3 * 5 * 8), "rank {r}: {all:?}");

        let d = a2a_v_stats(comm)?;
        let m = a2a_counts(n);
        let off_rank: usize = m[r].iter().sum::<usize>() - m[r][r];
        assert_eq!(d.calls(OpKind::AllToAll), 1);
        assert_eq!(d.bytes(OpKind::AllToAll), (off_rank * 4) as u64, "rank {r}: {d}");
        assert_eq!(d.total_calls(), 1, "rank {r}: {d}");
        Ok(())
    })
    .unwrap();
}

/// The padded defaults record the collectives they really run: one all_gather
/// of every rank's counts, then an all_to_all of blocks padded to the largest
/// count, which in this wrapper is itself the provided all_to_all (an all_gather
/// of every rank's whole padded input).
#[test]
fn padded_defaults_record_what_they_move() {
    let n = 4;
    launch(n, move |ctx| {
        let comm = Defaults(ctx.into_comm());
        let d = a2a_v_stats(&comm)?;
        let block = a2a_counts(n).iter().flatten().copied().max().unwrap_or(0);
        assert_eq!(block, 3 * n - 2);
        let counts_row = (2 + 2 * n) * 8;
        let padded_input = n * block * 4;
        assert_eq!(d.calls(OpKind::AllGather), 2, "{d}");
        assert_eq!(
            d.bytes(OpKind::AllGather),
            OpKind::AllGather.bytes_sent(n, counts_row * n) + OpKind::AllGather.bytes_sent(n, padded_input * n),
            "{d}"
        );
        assert_eq!(d.total_calls(), 2, "{d}");
        Ok(())
    })
    .unwrap();
}

/// The delay-based overlap check the MPI tests run, on threads too.
#[test]
fn overlap_check_on_threads() {
    launch(3, |ctx| {
        testing::check_overlap(ctx.comm(), Duration::from_millis(300));
        Ok(())
    })
    .unwrap();
}
