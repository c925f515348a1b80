//! Jobs that would hang end promptly with an error naming the cause: ranks waiting
//! for each other on different communicators of one mesh, a rank stuck outside any
//! collective, and an unusable `TESSERA_TIMEOUT_S`.

use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tessera::mesh::Error;
use tessera::{CommunicatorExt, DeviceMesh, LaunchOptions, launch, launch_with};

/// A timeout far beyond what any check here may take: the hang must end long before it.
fn patient() -> LaunchOptions {
    LaunchOptions::default().timeout(Duration::from_secs(120))
}

/// Runs `body` on a mesh of `shape` and returns launch's error, each rank's own
/// error and how long the launch took.
fn run_mesh(
    shape: &'static [usize],
    opts: &LaunchOptions,
    body: impl Fn(&DeviceMesh) -> Result<(), Error> + Send + Sync + 'static,
) -> (Error, Vec<Option<Error>>, Duration) {
    let n = shape.iter().product();
    let seen: Arc<Mutex<Vec<Option<Error>>>> = Arc::new(Mutex::new((0..n).map(|_| None).collect()));
    let start = Instant::now();
    let errs = seen.clone();
    let err = launch_with(opts, n, move |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), shape)?;
        let out = body(&mesh);
        if let Err(e) = out {
            let text = e.to_string();
            errs.lock().unwrap()[mesh.rank()] = Some(e);
            return Err(text.into());
        }
        Ok(())
    })
    .expect_err("the job must fail");
    let took = start.elapsed();
    let seen = std::mem::take(&mut *seen.lock().unwrap());
    (err, seen, took)
}

/// Every rank of `ranks` got `Error::Mismatch` naming each `needle`.
fn assert_mismatch(seen: &[Option<Error>], ranks: &[usize], needles: &[&str]) {
    for &r in ranks {
        match &seen[r] {
            Some(e @ Error::Mismatch { .. }) => {
                let msg = e.to_string();
                for needle in needles {
                    assert!(msg.contains(needle), "rank {r}: {needle:?} missing from: {msg}");
                }
            }
            other => panic!("rank {r}: expected a mismatch, got {other:?}"),
        }
    }
}

#[test]
fn ranks_waiting_on_different_communicators_all_get_a_mismatch() {
    // The two communicators of a 1-D mesh: its dim's and the whole mesh's.
    let (err, seen, took) = run_mesh(&[2], &patient(), |mesh| {
        if mesh.rank() == 0 {
            mesh.dim_comm(0)?.all_gather_vec(&[1.0f32; 4]).map(drop)
        } else {
            mesh.comm().barrier()
        }
    });
    assert!(
        took < Duration::from_secs(30),
        "took {took:?}: only the timeout ended it"
    );
    assert_mismatch(
        &seen,
        &[0, 1],
        &[
            "rank 0 called all_gather(send 4 × f32, recv 8 × f32) at tests/comm/hangs.rs:64:",
            "rank 1 called barrier() at tests/comm/hangs.rs:66:",
            "waits there for rank(s) [1]",
            "waits there for rank(s) [0]",
        ],
    );
    assert!(matches!(err, Error::RankFailed { .. }), "{err}");
    assert!(err.to_string().contains("collectives of different groups"), "{err}");
}

#[test]
fn a_cross_group_mismatch_on_a_2d_mesh_names_every_waiting_rank() {
    let (_, seen, took) = run_mesh(&[2, 2], &patient(), |mesh| {
        if mesh.rank() == 0 {
            mesh.dim_comm(0)?
                .all_reduce_slice(&mut [1.0f32; 3], tessera::ReduceOp::Sum)
        } else {
            mesh.comm().barrier()
        }
    });
    assert!(took < Duration::from_secs(30), "took {took:?}");
    assert_mismatch(
        &seen,
        &[0, 1, 2, 3],
        &[
            "rank 0 called all_reduce(sum, 3 × f32)",
            "rank 1 called barrier()",
            "rank 3 called barrier()",
        ],
    );
}

#[test]
fn a_mismatch_involving_an_asynchronous_collective_is_found() {
    // Rank 0 queues an all_gather on the dim communicator (its communication
    // thread waits there for rank 1) and then waits in a barrier of the whole mesh;
    // rank 1 waits in a barrier of a third communicator. Every thread of both
    // ranks waits for the other rank.
    let (_, seen, took) = run_mesh(&[2], &patient(), |mesh| {
        let third = mesh.comm().split(0, mesh.rank() as u32)?;
        if mesh.rank() == 0 {
            let work = mesh.dim_comm(0)?.all_gather_async(vec![1.0f32; 4].into());
            mesh.comm().barrier()?;
            work.wait().map(drop)
        } else {
            third.barrier()
        }
    });
    assert!(took < Duration::from_secs(30), "took {took:?}");
    assert_mismatch(
        &seen,
        &[0, 1],
        &[
            "rank 0 called all_gather(send 4 × f32, recv 8 × f32)",
            "rank 0 called barrier()",
            "rank 1 called barrier()",
        ],
    );
}

#[test]
fn waits_across_communicators_that_resolve_are_not_mismatches() {
    // Legal interleavings where, for a while, every rank waits on some group: an
    // asynchronous collective on one communicator overlapping blocking ones on the
    // other, with a late rank. None of it may be reported.
    let out = launch_with(&patient(), 4, |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), &[2, 2])?;
        let r = mesh.rank();
        for i in 0..40u64 {
            let work = mesh
                .dim_comm(1)?
                .all_reduce_async(vec![r as f32; 64].into(), tessera::ReduceOp::Sum);
            if (r as u64 + i).is_multiple_of(3) {
                std::thread::sleep(Duration::from_millis(15));
            }
            mesh.comm().barrier()?;
            let x = mesh.dim_comm(0)?.all_gather_vec(&[r as f32])?;
            let sum: Vec<f32> = work.wait_vec()?;
            assert_eq!(x.len(), 2);
            assert_eq!(sum.len(), 64);
        }
        Ok(())
    });
    assert!(out.is_ok(), "{:?}", out.err());
}

/// A rank stuck outside any collective: its thread stays, detached, until the
/// test process exits.
fn stuck_forever() -> ! {
    loop {
        std::thread::sleep(Duration::from_secs(1));
    }
}

#[test]
fn launch_returns_for_a_rank_stuck_while_its_peers_wait_in_a_collective() {
    let opts = LaunchOptions::default().timeout(Duration::from_millis(300));
    let start = Instant::now();
    let err = launch_with(&opts, 3, |ctx| {
        if ctx.rank() == 1 {
            stuck_forever();
        }
        ctx.comm().barrier()?;
        Ok(())
    })
    .expect_err("rank 1 never arrives");
    // The peers time out (one timeout), then launch waits one more for rank 1.
    assert!(start.elapsed() < Duration::from_secs(20), "took {:?}", start.elapsed());
    assert!(matches!(err, Error::RankFailed { rank: 1, .. }), "{err}");
    assert!(err.to_string().contains("did not enter barrier"), "{err}");
}

#[test]
fn launch_returns_for_a_rank_stuck_after_the_others_returned() {
    let opts = LaunchOptions::default().timeout(Duration::from_millis(300));
    let start = Instant::now();
    let err = launch_with(&opts, 3, |ctx| {
        if ctx.rank() == 2 {
            stuck_forever();
        }
        Ok(ctx.rank())
    })
    .expect_err("rank 2 never returns");
    assert!(start.elapsed() < Duration::from_secs(20), "took {:?}", start.elapsed());
    assert!(matches!(err, Error::RankFailed { rank: 2, .. }), "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains("did not return from its closure") && msg.contains("detached"),
        "{msg}"
    );
}

#[test]
fn a_slow_rank_within_the_timeout_is_waited_for() {
    let opts = LaunchOptions::default().timeout(Duration::from_secs(5));
    let out = launch_with(&opts, 2, |ctx| {
        if ctx.rank() == 1 {
            std::thread::sleep(Duration::from_millis(300));
        }
        Ok(ctx.rank())
    })
    .unwrap();
    assert_eq!(out, vec![0, 1]);
}

/// The child half of `an_unusable_timeout_is_a_launch_error`: `launch` under the
/// environment the parent set.
#[test]
#[ignore = "run by an_unusable_timeout_is_a_launch_error in a child process with TESSERA_TIMEOUT_S set"]
fn timeout_from_env_child() {
    let got = launch(2, |ctx| Ok(ctx.rank()));
    match std::env::var("TESSERA_TIMEOUT_S").as_deref() {
        Ok("2.5") => assert_eq!(got.unwrap(), vec![0, 1]),
        Ok(v) => {
            let e = got.expect_err("an unusable TESSERA_TIMEOUT_S must fail the launch");
            assert!(matches!(e, Error::Launch(_)), "{e}");
            let msg = e.to_string();
            assert!(msg.contains("TESSERA_TIMEOUT_S") && msg.contains(v), "{msg}");
        }
        Err(_) => panic!("TESSERA_TIMEOUT_S is not set"),
    }
}

#[test]
fn an_unusable_timeout_is_a_launch_error() {
    // In child processes: the environment is process-wide and other tests launch.
    for value in ["2.5", "0", "1e-300", "1e20", "18446744073709551616", "soon"] {
        let out = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "hangs::timeout_from_env_child", "--ignored", "--nocapture"])
            .env("TESSERA_TIMEOUT_S", value)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "TESSERA_TIMEOUT_S={value}: {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            stdout.contains("1 passed"),
            "TESSERA_TIMEOUT_S={value}: the child ran no test: {stdout}"
        );
    }
}
