//! Every collective against its oracle, for world sizes 1, 2, 3, 4, 8 and every
//! dtype, on the world communicator and on sub-communicators of meshes.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tessera::mesh::testing;
use tessera::{CommunicatorExt, DeviceMesh, LaunchOptions, launch, launch_with};

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

/// Every mesh dim's communicator holds exactly the ranks that differ only along that dim.
fn check_dim_comms(shape: &[usize]) {
    let n: usize = shape.iter().product();
    launch(n, |ctx| {
        let world_rank = ctx.rank() as i64;
        let mesh = DeviceMesh::new(ctx.into_comm(), shape)?;
        for d in 0..shape.len() {
            let comm = mesh.dim_comm(d)?;
            assert_eq!(comm.size(), shape[d]);
            assert_eq!(comm.rank(), mesh.coordinate()[d]);
            let got = comm.all_gather_vec(&[world_rank])?;
            let stride: usize = shape[d + 1..].iter().product();
            let base = world_rank as usize - mesh.coordinate()[d] * stride;
            let want: Vec<i64> = (0..shape[d]).map(|k| (base + k * stride) as i64).collect();
            assert_eq!(got, want, "mesh {shape:?} dim {d} rank {world_rank}");
            testing::check_blocking::<f32>(comm);
            testing::check_blocking::<half::bf16>(comm);
            testing::check_async::<i64>(comm);
        }
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
    let out = launch_with(&opts, 2, |ctx| {
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
