//! A rank waiting for its peers in a collective gives its core away (a short
//! spin, then a sleep that the arrival completing the barrier ends), so ranks
//! that outnumber the cores do not take time from the ranks they wait for.

use std::time::Duration;

use tessera::launch;

/// CPU time the calling thread has used.
fn thread_cpu() -> Duration {
    let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `t` is a valid timespec to write; CLOCK_THREAD_CPUTIME_ID exists on Linux.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID) failed");
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

/// Rank 1 waits a second at a barrier for rank 0. Spinning or yielding, that
/// second costs about a second of CPU; sleeping in short steps (wake, look,
/// sleep again every 50 µs) cost 225 ms when measured; parked until the barrier
/// completes, a few milliseconds (a look for failures every 2 ms; up to 16 ms
/// seen with the test suite loading both cores). The bound sits between.
#[test]
fn a_rank_waiting_at_a_barrier_sleeps() {
    const LATE: Duration = Duration::from_secs(1);
    let cpu = launch(2, |ctx| {
        let comm = ctx.into_comm();
        if comm.rank() == 0 {
            std::thread::sleep(LATE);
            comm.barrier()?;
            return Ok(None);
        }
        let (start, before) = (std::time::Instant::now(), thread_cpu());
        comm.barrier()?;
        let (waited, used) = (start.elapsed(), thread_cpu() - before);
        Ok(Some((waited, used)))
    })
    .expect("the barrier completes");
    let (waited, used) = cpu[1].expect("rank 1 measured its wait");
    assert!(
        waited >= LATE / 2,
        "rank 1 waited only {waited:?} for a peer {LATE:?} late"
    );
    assert!(
        used < Duration::from_millis(60),
        "rank 1 used {used:?} of CPU while waiting {waited:?} at a barrier: it should sleep, not spin"
    );
}
