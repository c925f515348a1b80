//! The barrier protocol's invariants, driven step by step on one group.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::desc::Desc;
use super::group::Group;
use super::world::World;
use crate::{Error, OpKind};

/// A job of `n` ranks with a short timeout (the committed barrier must ignore it).
fn group(n: usize) -> (Arc<World>, Arc<Group>) {
    let world = World::new(u64::MAX, n, Duration::from_millis(50), (true, false));
    let g = Group::new(world.clone(), (0..n).collect());
    (world, g)
}

/// The failure that caused the segfault: rank 1's closure fails and returns while
/// its communication thread is still inside a collective, reading rank 0's buffer.
/// Rank 0 must stay in the collective (its buffer alive) until rank 1's reads end,
/// although rank 1 has left its closure, the job is poisoned and the timeout passed.
#[test]
fn a_committed_peer_is_waited_for_even_after_its_rank_failed() {
    let (world, g) = group(2);
    let reading = AtomicBool::new(true);
    std::thread::scope(|s| {
        let peer = s.spawn(|| {
            let (_, done) = g.enter(1, Desc::new(OpKind::AllGather)).unwrap();
            world.poison(1, "injected failure".into());
            world.mark_exited(1);
            std::thread::sleep(Duration::from_millis(200));
            reading.store(false, Ordering::SeqCst);
            done.finish()
        });
        let (_, done) = g.enter(0, Desc::new(OpKind::AllGather)).unwrap();
        done.finish().unwrap();
        assert!(
            !reading.load(Ordering::SeqCst),
            "rank 0 left the collective while rank 1 still read its buffer"
        );
        peer.join().unwrap().unwrap();
    });
    // The next collective fails at once, naming the failed rank.
    let e = g.enter(0, Desc::new(OpKind::AllGather)).map(|_| ()).unwrap_err();
    assert!(matches!(e, Error::PeerFailed { rank: 1, .. }), "{e}");
}

/// A rank that unwinds out of a collective's data phase (an all-reduce, two
/// barrier points) still passes every barrier point, so its peers neither hang
/// nor leave early.
#[test]
fn a_rank_unwinding_from_the_data_phase_passes_every_barrier_point() {
    let (_, g) = group(3);
    let start = Instant::now();
    std::thread::scope(|s| {
        let peers: Vec<_> = (1..3)
            .map(|r| {
                let g = &g;
                s.spawn(move || {
                    let (_, mut done) = g.enter(r, Desc::new(OpKind::AllReduce)).unwrap();
                    done.sync();
                    done.finish()
                })
            })
            .collect();
        let unwound = s
            .spawn(|| {
                let (_, _done) = g.enter(0, Desc::new(OpKind::AllReduce)).unwrap();
                std::thread::sleep(Duration::from_millis(100));
                panic!("injected panic in the data phase");
            })
            .join();
        assert!(unwound.is_err());
        for p in peers {
            p.join().unwrap().unwrap();
        }
    });
    assert!(start.elapsed() >= Duration::from_millis(100));
    // The group is still consistent: the next collective runs on every rank.
    std::thread::scope(|s| {
        for r in 0..3 {
            let g = &g;
            s.spawn(move || g.enter(r, Desc::new(OpKind::Barrier)).unwrap().1.finish().unwrap());
        }
    });
}

/// A collective larger than the last-level cache writes its output with
/// streaming stores, exactly: an all-gather and an all-reduce whose ranks'
/// segments start off any 16-byte boundary (odd element counts) stream their
/// copies, and every element lands where a cached copy would put it; `f32`
/// reduce-scatters (sum and average, blocks off 16-byte boundaries) stream
/// the bits of the element-wise sum in rank order.
#[test]
#[cfg_attr(not(target_arch = "x86_64"), ignore = "streaming stores are used on x86-64 only")]
fn collectives_larger_than_the_cache_stream_exact_results() {
    use crate::threads::store::{STREAMED_BYTES, last_level_cache_bytes};
    use crate::{CommunicatorExt, ReduceOp};
    // Two ranks each sending `c` f32 and receiving `2c`: 24·c bytes in all, past the cache.
    let c = last_level_cache_bytes() / 24 + 3;
    let before = STREAMED_BYTES.load(Ordering::Relaxed);
    let results = crate::launch(2, move |ctx| {
        let comm = ctx.comm();
        let r = ctx.rank();
        let value = |q: usize, i: usize| (q * 1_000_003 + i % 65_521) as f32;
        let send: Vec<f32> = (0..c).map(|i| value(r, i)).collect();
        let mut gathered = vec![0f32; 2 * c];
        comm.all_gather((&send[..]).into(), (&mut gathered[..]).into())?;
        let gathered_ok = gathered.iter().enumerate().all(|(i, &v)| v == value(i / c, i % c));
        // An all-reduce of 2c elements per rank (32·c bytes): its second phase copies
        // the peer's reduced half, which starts at element c (off 16 bytes).
        let mut sum = gathered.clone();
        comm.all_reduce_slice(&mut sum, ReduceOp::Sum)?;
        let sum_ok = sum.iter().zip(&gathered).all(|(&s, &g)| s == 2.0 * g);
        // Reduce-scatters of 2c inexact values per rank (24·c bytes) into c each,
        // summed and averaged from registers: rank r's block starts at element r·c.
        let inexact = |q: usize, i: usize| (i % 1000) as f32 * 0.1 + q as f32 * 0.37;
        let input: Vec<f32> = (0..2 * c).map(|i| inexact(r, i)).collect();
        let mut scattered = vec![0f32; c];
        let mut reduce_ok = Vec::new();
        for (op, scale) in [(ReduceOp::Sum, None), (ReduceOp::Avg, Some(2f32))] {
            comm.reduce_scatter((&input[..]).into(), (&mut scattered[..]).into(), op)?;
            reduce_ok.push(scattered.iter().enumerate().all(|(i, &v)| {
                let sum = inexact(0, r * c + i) + inexact(1, r * c + i);
                v.to_bits() == scale.map_or(sum, |n| sum / n).to_bits()
            }));
        }
        Ok((gathered_ok, sum_ok, reduce_ok))
    })
    .unwrap();
    assert_eq!(results, vec![(true, true, vec![true, true]); 2]);
    let streamed = STREAMED_BYTES.load(Ordering::Relaxed) - before;
    // Each rank streams its whole gathered output, the peer's half of the sum and
    // both reduce-scatters' outputs.
    assert!(streamed >= 2 * (2 * c + c + 2 * c) * 4, "streamed {streamed} bytes");
}

/// A gather of runs past the cache's size whose two peers' runs alternate in
/// the output (odd lengths, so their meetings fall inside lines), one list in
/// reverse order: every element lands where its run says, streamed.
#[test]
#[cfg_attr(not(target_arch = "x86_64"), ignore = "streaming stores are used on x86-64 only")]
fn gathered_runs_that_alternate_stream_exact_results() {
    use crate::comm::Run;
    use crate::threads::store::{STREAMED_BYTES, last_level_cache_bytes};
    // Two ranks each sending `c` f32 and receiving `2c`: past the cache.
    let run = 37;
    let rows = last_level_cache_bytes() / (24 * run) + 1;
    let c = rows * run;
    let before = STREAMED_BYTES.load(Ordering::Relaxed);
    let results = crate::launch(2, move |ctx| {
        let comm = ctx.comm();
        let value = |q: usize, i: usize| (q * 1_000_003 + i) as f32;
        let send: Vec<f32> = (0..c).map(|i| value(ctx.rank(), i)).collect();
        // Output row k: run k of peer 0, then run k of peer 1 (its runs in
        // reverse order in its list).
        let lists: Vec<Vec<Run>> = (0..2)
            .map(|q| {
                let list = (0..rows).map(|k| Run {
                    src: k * run,
                    dst: 2 * k * run + q * run,
                    len: run,
                });
                if q == 1 { list.rev().collect() } else { list.collect() }
            })
            .collect();
        let mut out = vec![-1f32; 2 * c];
        comm.all_gather_v_runs((&send[..]).into(), (&mut out[..]).into(), &lists)?;
        Ok((0..2 * rows).all(|j| {
            let (k, q) = (j / 2, j % 2);
            (0..run).all(|i| out[j * run + i] == value(q, k * run + i))
        }))
    })
    .unwrap();
    assert_eq!(results, vec![true; 2]);
    let streamed = STREAMED_BYTES.load(Ordering::Relaxed) - before;
    assert!(streamed >= 2 * 2 * c * 4, "streamed {streamed} bytes");
}

/// A local runs copy past the cache's size (runs of odd lengths, out of
/// order) streams and puts every element where its run says; one run past
/// either buffer is an error that copies nothing.
#[test]
fn local_runs_copies_stream_and_check_their_runs() {
    use crate::comm::Run;
    use crate::threads::store::{STREAMED_BYTES, last_level_cache_bytes};
    let (run, rows) = (37, last_level_cache_bytes() / (8 * 37) + 1);
    let src: Vec<f32> = (0..2 * run * rows).map(|i| i as f32).collect();
    // Every other run of the source, the later half first.
    let mut runs: Vec<Run> = (0..rows)
        .map(|k| Run {
            src: 2 * k * run,
            dst: k * run,
            len: run,
        })
        .collect();
    runs.rotate_left(rows / 2);
    let mut dst = vec![-1f32; run * rows];
    let before = STREAMED_BYTES.load(Ordering::Relaxed);
    crate::copy_runs(&src, &mut dst, &runs).unwrap();
    if cfg!(target_arch = "x86_64") {
        assert!(STREAMED_BYTES.load(Ordering::Relaxed) - before >= dst.len() * 4);
    }
    assert!(
        dst.iter()
            .enumerate()
            .all(|(i, &v)| v == ((i / run) * 2 * run + i % run) as f32)
    );
    let mut small = [0f32; 4];
    for (bad, what) in [
        (Run { src: 5, dst: 0, len: 2 }, "source"),
        (Run { src: 0, dst: 3, len: 2 }, "destination"),
    ] {
        let err = crate::copy_runs(&src[..6], &mut small, &[Run { src: 0, dst: 0, len: 1 }, bad]).unwrap_err();
        assert!(
            matches!(err, Error::RunOutside { what: w, end: 7 | 5, .. } if w == what),
            "{err}"
        );
        assert_eq!(small, [0.0; 4], "nothing copied");
    }
}
