//! A rank that fails, panics, never arrives or leaves early ends the job with
//! errors naming it on every rank, never a hang; ranks that disagree on a
//! collective all get an error describing both sides.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use tessera::mesh::Error;
use tessera::{CommunicatorExt, LaunchOptions, ReduceOp, launch, launch_with};

fn short() -> LaunchOptions {
    LaunchOptions::default().timeout(Duration::from_millis(300))
}

fn long() -> LaunchOptions {
    LaunchOptions::default().timeout(Duration::from_secs(60))
}

/// Runs `body` on 4 ranks, collecting the error each rank's collectives returned.
fn run(
    opts: &LaunchOptions,
    body: impl Fn(usize, &dyn tessera::Communicator) -> Result<(), String> + Sync,
) -> (Error, Vec<String>) {
    let seen = Mutex::new(vec![String::new(); 4]);
    let err = launch_with(opts, 4, |ctx| {
        let r = ctx.rank();
        let out = body(r, ctx.comm());
        if let Err(e) = &out {
            seen.lock().unwrap()[r] = e.clone();
        }
        out.map_err(Into::into)
    })
    .expect_err("the job must fail");
    (err, seen.into_inner().unwrap())
}

fn gather_twice(comm: &dyn tessera::Communicator) -> Result<(), String> {
    let x = [1.0f32; 16];
    comm.all_gather_vec(&x).map_err(|e| e.to_string())?;
    comm.all_gather_vec(&x).map_err(|e| e.to_string())?;
    Ok(())
}

#[test]
fn rank_error_poisons_everyone() {
    let (err, seen) = run(&long(), |r, comm| {
        if r == 2 {
            return Err("bad batch on rank 2".into());
        }
        gather_twice(comm)
    });
    assert!(matches!(err, Error::RankFailed { rank: 2, .. }), "{err}");
    assert!(err.to_string().contains("bad batch on rank 2"), "{err}");
    for r in [0, 1, 3] {
        assert!(
            seen[r].contains("rank 2 failed") && seen[r].contains("bad batch"),
            "rank {r}: {}",
            seen[r]
        );
    }
}

#[test]
fn rank_panic_poisons_everyone() {
    let start = Instant::now();
    let (err, seen) = run(&long(), |r, comm| {
        comm.barrier().map_err(|e| e.to_string())?;
        if r == 1 {
            panic!("boom on rank 1");
        }
        gather_twice(comm)
    });
    assert!(matches!(err, Error::RankFailed { rank: 1, .. }), "{err}");
    assert!(err.to_string().contains("panicked: boom on rank 1"), "{err}");
    for r in [0, 2, 3] {
        assert!(seen[r].contains("rank 1 failed: panicked"), "rank {r}: {}", seen[r]);
    }
    assert!(
        start.elapsed() < Duration::from_secs(30),
        "failure must not wait for the timeout"
    );
}

#[test]
fn rank_that_never_arrives_times_out() {
    let (err, seen) = run(&short(), |r, comm| {
        if r == 3 {
            std::thread::sleep(Duration::from_millis(1500));
            // Arriving late finds the job poisoned.
            return gather_twice(comm);
        }
        gather_twice(comm)
    });
    assert!(matches!(err, Error::RankFailed { rank: 3, .. }), "{err}");
    assert!(err.to_string().contains("did not enter all_gather"), "{err}");
    for (r, s) in seen.iter().enumerate().take(3) {
        assert!(
            (s.contains("timed out") && s.contains("[3]")) || s.contains("rank 3 failed"),
            "rank {r}: {s}"
        );
    }
    assert!(seen[3].contains("rank 3 failed"), "late rank: {}", seen[3]);
}

#[test]
fn rank_that_returns_early_is_reported_without_waiting_for_timeout() {
    let start = Instant::now();
    let (err, seen) = run(&long(), |r, comm| {
        if r == 0 {
            return Ok(());
        }
        gather_twice(comm)
    });
    assert!(matches!(err, Error::RankFailed { rank: 0, .. }), "{err}");
    assert!(err.to_string().contains("without entering all_gather"), "{err}");
    for (r, s) in seen.iter().enumerate().skip(1) {
        assert!(s.contains("rank 0 failed"), "rank {r}: {s}");
    }
    assert!(start.elapsed() < Duration::from_secs(30));
}

#[test]
fn pending_async_collective_fails_when_a_peer_dies() {
    let (err, seen) = run(&long(), |r, comm| {
        if r == 1 {
            return Err("rank 1 gave up".into());
        }
        let w = comm.all_gather_async(vec![0.0f64; 8].into());
        w.wait().map(|_| ()).map_err(|e| e.to_string())
    });
    assert!(matches!(err, Error::RankFailed { rank: 1, .. }), "{err}");
    for r in [0, 2, 3] {
        assert!(seen[r].contains("rank 1 failed"), "rank {r}: {}", seen[r]);
    }
}

#[test]
fn different_collectives_are_a_mismatch_on_every_rank() {
    let (_, seen) = run(&long(), |r, comm| {
        let mut x = [1.0f32; 4];
        let res = if r == 2 {
            comm.all_reduce_slice(&mut x, ReduceOp::Sum)
        } else {
            comm.all_gather_vec(&x).map(|_| ())
        };
        res.map_err(|e| e.to_string())
    });
    for (r, s) in seen.iter().enumerate() {
        assert!(s.contains("collective mismatch"), "rank {r}: {s}");
        assert!(
            s.contains("all_gather(send 4 × f32") && s.contains("rank 2 called all_reduce(sum, 4 × f32)"),
            "rank {r}: {s}"
        );
    }
}

#[test]
fn different_lengths_and_dtypes_are_a_mismatch() {
    let (_, seen) = run(&long(), |r, comm| {
        let len = if r == 3 { 5 } else { 4 };
        comm.all_gather_vec(&vec![1i64; len])
            .map(|_| ())
            .map_err(|e| e.to_string())
    });
    for s in &seen {
        assert!(
            s.contains("send 4 × i64") && s.contains("rank 3 called all_gather(send 5 × i64"),
            "{s}"
        );
    }
    let (_, seen) = run(&long(), |r, comm| {
        if r == 1 {
            comm.all_gather_vec(&[1.0f64; 4]).map(|_| ())
        } else {
            comm.all_gather_vec(&[1.0f32; 4]).map(|_| ())
        }
        .map_err(|e| e.to_string())
    });
    for s in &seen {
        assert!(
            s.contains("f32") && s.contains("rank 1 called all_gather(send 4 × f64"),
            "{s}"
        );
    }
}

#[test]
fn bad_receive_length_on_one_rank_fails_everyone() {
    let (_, seen) = run(&long(), |r, comm| {
        let mut recv = vec![0.0f32; if r == 1 { 15 } else { 16 }];
        comm.all_gather_slice(&[0.0f32; 4], &mut recv)
            .map_err(|e| e.to_string())
    });
    for s in &seen {
        assert!(
            s.contains("all_gather on rank 1: receive buffer holds 15 elements, expected 16"),
            "{s}"
        );
    }
}

#[test]
fn unsupported_reductions_are_errors() {
    let (_, seen) = run(&long(), |_, comm| {
        let mut x = [1i64; 4];
        comm.all_reduce_slice(&mut x, ReduceOp::Avg).map_err(|e| e.to_string())
    });
    for s in &seen {
        assert!(s.contains("avg is not defined for i64"), "{s}");
    }
}

#[test]
fn zero_ranks_is_an_error() {
    let err = launch(0, |_| Ok(())).unwrap_err();
    assert!(err.to_string().contains("at least 1"), "{err}");
}
