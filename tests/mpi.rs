//! The MPI backend end to end (feature `mpi`; `cargo test --features mpi --test mpi`).
//!
//! Without an MPI launch in its environment this binary is the driver: it starts
//! itself under `mpirun` (`-n 2` and `-n 4`, `--oversubscribe`, as root
//! `--allow-run-as-root`) once per scenario, with a deadline, and checks each
//! job's exit status and output. Under `mpirun` it runs the scenario named by its
//! argument as one rank:
//!
//! - `contract`: the communicator contract of `tessera::mesh::testing` (the same
//!   body the threads backend passes under `cargo test`), meshes' sub-communicators,
//!   and overlap of the asynchronous forms;
//! - `fsdp`: FSDP (W2, W4) and HSDP (2x2) train the tiny reference Transformer to
//!   PyTorch's losses within 1e-5 at every step;
//! - `mismatch` (with `TESSERA_MPI_CHECK=1`): ranks that call different
//!   collectives, or pass different or invalid lengths, all get errors naming both
//!   sides, and the communicator stays usable;
//! - `agree`: a fault on one rank only (a state-dict value rank 0 cannot decode,
//!   a checkpoint chunk corrupt in rank 1's copy): every rank returns an error,
//!   nothing is applied, and the ranks stay in step;
//! - `fail-error`, `fail-panic`, `fail-abort`, `fail-exit`, `stall`,
//!   `fail-pending`: a rank fails mid-step by returning an error, panicking, dying
//!   (`abort`), exiting with status 0, never arriving at a collective, or
//!   returning an error while its own asynchronous collective still waits for a
//!   slow peer; the job must end promptly with a message naming the rank (and,
//!   for `fail-exit` and `stall`, what it was doing);
//! - `stall-mesh`, `stall-mesh-chain`: on a 2x2 mesh with TP-then-DP traffic,
//!   rank 0 stalls; the abort names rank 0 as the rank not progressing, also when
//!   the rank that times out (rank 3 alone, in `stall-mesh-chain`) waits on it only
//!   through rank 1, which waits on rank 0 in another group.
//!
//! The driver also runs the `train` example with 4 threads and under `mpirun -n 4`
//! and compares the losses, and runs `hsdp_multinode` under `mpirun -n 4` (the
//! examples must be built: `cargo test` builds them). A scenario name as argument
//! runs only the matching scenarios (`cargo test --features mpi --test mpi -- fsdp`).
//! `TESSERA_MPIRUN` names another launcher binary.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{adamw, reference_losses, tiny_model, tokens};
use tessera::autograd::nn::Module;
use tessera::autograd::nn::ParameterDict;
use tessera::autograd::optim::{AdamW, Optimizer};
use tessera::autograd::{Param, Var, backward, load_checkpoint, load_state_dict, save_checkpoint};
use tessera::dtensor::{Placement, Tensor, distribute_tensor};
use tessera::fsdp::FsdpConfig;
use tessera::mesh::{OpKind, testing};
use tessera::{BoxError, CommunicatorExt, DeviceMesh, LaunchOptions, ReduceOp, launch, launch_with, mpi_env};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match mpi_env() {
        Some(env) => {
            let scenario = args.first().map(String::as_str).unwrap_or("");
            if let Err(e) = rank_main(scenario) {
                eprintln!("rank {}: scenario {scenario}: {e}", env.rank);
                std::process::exit(2);
            }
        }
        None => driver(&args),
    }
}

// ----- the ranks ----------------------------------------------------------------

fn rank_main(scenario: &str) -> Result<(), BoxError> {
    let world = mpi_env()
        .and_then(|e| e.size)
        .ok_or("no MPI world size in the environment")?;
    match scenario {
        "contract" => contract(world),
        "fsdp" => fsdp(world),
        "fail-error" | "fail-panic" | "fail-abort" | "fail-exit" | "stall" => fail(world, scenario),
        "fail-pending" => fail_pending(world),
        "stall-mesh" | "stall-mesh-chain" => stall_mesh(world, scenario == "stall-mesh-chain"),
        "mismatch" => mismatch(world),
        "agree" => agree(world),
        other => Err(format!("unknown scenario {other:?}").into()),
    }
}

fn contract(world: usize) -> Result<(), BoxError> {
    launch(world, move |ctx| {
        assert_eq!(ctx.comm().backend(), "mpi");
        testing::check_all(ctx.comm());
        testing::check_overlap(ctx.comm(), Duration::from_millis(500));
        // A variable-count collective counts once, as with threads (its cross-rank
        // check is not a collective the caller issued).
        let comm = ctx.comm();
        let counts = testing::chunk_counts(5, comm.size());
        let before = comm.stats().snapshot();
        let mut recv = [0.0f32; 5];
        comm.all_gather_v(
            (&vec![1.0f32; counts[comm.rank()]][..]).into(),
            (&mut recv[..]).into(),
            &counts,
        )?;
        let d = comm.stats().snapshot() - before;
        assert_eq!(
            (d.calls(OpKind::AllGather), d.total_calls()),
            (1, 1),
            "stats of all_gather_v"
        );
        let shape: &[usize] = if ctx.world_size() == 4 {
            &[2, 2]
        } else {
            &[ctx.world_size()]
        };
        let rank = ctx.rank();
        testing::check_mesh(ctx.into_comm(), shape);
        if rank == 0 {
            println!("contract ok on {world} ranks (mesh {shape:?})");
        }
        Ok(())
    })?;
    Ok(())
}

/// Trains the tiny model on `shape` with FSDP and returns the losses.
fn train_tiny(shape: &'static [usize], g: usize, steps: usize) -> Result<Vec<f64>, BoxError> {
    let toks = tokens();
    let world = shape.iter().product();
    let runs = launch(world, move |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), shape)?;
        let model = tiny_model(&mesh)?;
        let params = model.parameters();
        model.fully_shard(&mesh, &FsdpConfig::default())?;
        let mut opt = AdamW::new(params, adamw())?;
        let mut losses = Vec::new();
        for step in 0..steps {
            let t = toks.narrow(0, step, 1)?.narrow(1, 0, g)?.reshape(&[g, 33])?;
            let rows = distribute_tensor(&t, &mesh, &vec![Placement::Shard(0); shape.len()])?;
            let loss = model.loss(&Var::constant(rows))?;
            losses.push(loss.value().full_tensor()?.to_f64_vec()[0]);
            backward(&loss)?;
            opt.step()?;
            opt.zero_grad();
        }
        Ok(losses)
    })?;
    Ok(runs.into_iter().next().ok_or("no result")?)
}

fn fsdp(world: usize) -> Result<(), BoxError> {
    let jobs: &[(&[usize], usize, &str)] = match world {
        2 => &[(&[2], 8, "fsdp_W2_G8")],
        4 => &[(&[4], 16, "fsdp_W4_G16"), (&[2, 2], 16, "hsdp_2x2_G16")],
        n => return Err(format!("no FSDP reference for {n} ranks").into()),
    };
    for &(shape, g, reference) in jobs {
        let losses = train_tiny(shape, g, 20)?;
        let want = reference_losses(reference);
        let d = losses.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        if d > 1e-5 {
            return Err(format!("mesh {shape:?}: max |Δloss| {d:.3e} vs {reference} exceeds 1e-5").into());
        }
        if tessera::is_lead_process() {
            println!("fsdp parity mesh {shape:?} vs {reference}: max |Δloss| = {d:.3e} over 20 steps");
        }
    }
    Ok(())
}

/// A fault on one rank only, under MPI: a state dict whose value rank 0 cannot
/// decode, and a checkpoint chunk corrupt on rank 1's copy. Every rank returns
/// an error, nothing is applied, and the ranks stay in step (a barrier after
/// each passes): no rank is left inside a collective.
fn agree(world: usize) -> Result<(), BoxError> {
    launch(world, move |ctx| {
        let r = ctx.rank();
        let mesh = DeviceMesh::new(ctx.into_comm(), &[world])?;
        // One directory for the job, named by rank 0.
        let mut tag = [i64::from(std::process::id())];
        mesh.comm().broadcast_slice(&mut tag, 0)?;
        let dir = std::env::temp_dir().join(format!("tessera-mpi-agree-{}", tag[0]));
        let _ = std::fs::create_dir_all(&dir);
        let sharded = |n: usize, scale: f32| {
            let t = Tensor::from_vec((0..n).map(|i| i as f32 * scale).collect::<Vec<_>>(), &[n])?;
            distribute_tensor(&t, &mesh, &[Placement::Shard(0)])
        };
        // The state dict: `mask` is U64 with a value beyond i64::MAX.
        let file = dir.join(format!("bad-{r}.safetensors"));
        let header = br#"{"mask":{"dtype":"U64","shape":[4],"data_offsets":[0,32]},"w":{"dtype":"F32","shape":[4],"data_offsets":[32,48]}}"#;
        let mut header = header.to_vec();
        while !header.len().is_multiple_of(8) {
            header.push(b' ');
        }
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(&header);
        [1u64, 2, u64::MAX, 4]
            .iter()
            .for_each(|v| bytes.extend_from_slice(&v.to_le_bytes()));
        [10f32, 11.0, 12.0, 13.0]
            .iter()
            .for_each(|v| bytes.extend_from_slice(&v.to_le_bytes()));
        std::fs::write(&file, bytes)?;
        let w = Param::new(sharded(4, 1.0)?);
        let mask = Param::new(distribute_tensor(
            &Tensor::from_vec(vec![0i64; 4], &[4])?,
            &mesh,
            &[Placement::Shard(0)],
        )?);
        ParameterDict::new([("w", w.clone()), ("mask", mask.clone())])?;
        let e = load_state_dict(&[w.clone(), mask], &file)
            .err()
            .ok_or("a bad state dict loaded")?
            .to_string();
        assert!(e.contains("beyond i64::MAX"), "rank {r}: {e}");
        assert_eq!(
            w.value()?.full_tensor()?,
            Tensor::from_vec(vec![0f32, 1.0, 2.0, 3.0], &[4])?
        );
        mesh.comm().barrier()?;
        // The checkpoint: saved whole, then rank 1 reads a copy with a flipped byte.
        let good = dir.join("ckpt");
        let p = Param::new(sharded(8, 0.5)?);
        ParameterDict::new([("p", p.clone())])?;
        save_checkpoint(&good, std::slice::from_ref(&p), None, Default::default())?;
        let mine = if r == 1 {
            let bad = dir.join("ckpt-bad");
            std::fs::create_dir_all(&bad)?;
            for f in std::fs::read_dir(&good)? {
                let f = f?;
                std::fs::copy(f.path(), bad.join(f.file_name()))?;
            }
            let chunk = bad.join("shard-00002-model-00001-of-00001.safetensors");
            let mut b = std::fs::read(&chunk)?;
            let at = b.len() - 2;
            b[at] ^= 0x10;
            std::fs::write(&chunk, b)?;
            bad
        } else {
            good.clone()
        };
        let q = Param::new(sharded(8, 0.0)?);
        ParameterDict::new([("p", q.clone())])?;
        let e = load_checkpoint(&mine, std::slice::from_ref(&q), None)
            .err()
            .ok_or("a corrupt chunk loaded")?
            .to_string();
        assert!(r == 1 || e.contains("rank 1 failed"), "rank {r}: {e}");
        assert_eq!(
            q.value()?.full_tensor()?,
            Tensor::from_vec(vec![0f32; 8], &[8])?,
            "rank {r}: a failed load changed p"
        );
        mesh.comm().barrier()?;
        if r == 0 {
            println!("agreement checks ok on {world} ranks");
            let _ = std::fs::remove_dir_all(&dir);
        }
        Ok(())
    })?;
    Ok(())
}

/// With `TESSERA_MPI_CHECK=1`, mismatched calls fail on every rank with errors
/// naming both sides, and the communicator stays usable.
fn mismatch(world: usize) -> Result<(), BoxError> {
    launch(world, move |ctx| {
        let (comm, r) = (ctx.comm(), ctx.rank());
        let expect = |what: &str, res: tessera::mesh::Result<()>, needle: &str| {
            let e = res
                .err()
                .unwrap_or_else(|| panic!("{what} on rank {r}: expected an error"))
                .to_string();
            assert!(e.contains(needle), "{what} on rank {r}: {e}");
        };
        // Different lengths.
        let send = vec![1.0f32; 4 + r.min(1)];
        let mut recv = vec![0.0f32; send.len() * world];
        let res = comm.all_gather_slice(&send, &mut recv);
        let e = res.err().map(|e| e.to_string()).unwrap_or_default();
        let site = format!("call sites: rank 0 at tests/mpi.rs:{}:", line!() - 2);
        for needle in [
            "rank 0 called all_gather(send 4 × f32) but rank 1 called all_gather(send 5 × f32)",
            &site,
        ] {
            assert!(e.contains(needle), "lengths on rank {r}: {e}");
        }
        // Strict mode: two same-shape all-reduces swapped on rank 1.
        if tessera::mesh::vars::flag_or("TESSERA_STRICT_COLLECTIVES", false) {
            let (mut a, mut b) = ([1.0f32; 4], [2.0f32; 4]);
            let res = if r == 0 {
                comm.all_reduce_slice(&mut a, ReduceOp::Sum)
            } else {
                comm.all_reduce_slice(&mut b, ReduceOp::Sum)
            };
            let (l0, l1) = (line!() - 4, line!() - 2);
            let e = res.err().map(|e| e.to_string()).unwrap_or_default();
            for needle in [
                "different call sites".to_string(),
                format!("rank 0 at tests/mpi.rs:{l0}:"),
                format!("rank 1 at tests/mpi.rs:{l1}:"),
            ] {
                assert!(e.contains(&needle), "reorder on rank {r}: {e}");
            }
        }
        // Different collectives.
        let mut x = vec![1.0f32; 8];
        let res = if r == 0 {
            comm.all_reduce_slice(&mut x, ReduceOp::Sum)
        } else {
            comm.broadcast_slice(&mut x, 0)
        };
        expect(
            "kinds",
            res,
            "rank 0 called all_reduce(sum, send 8 × f32) but rank 1 called broadcast(root 0, 8 × f32)",
        );
        // Different reductions, dtypes and roots of the same collective.
        let mut x = vec![1.0f32; 8];
        let op = if r == 0 { ReduceOp::Sum } else { ReduceOp::Max };
        expect(
            "reductions",
            comm.all_reduce_slice(&mut x, op),
            "rank 0 called all_reduce(sum, send 8 × f32) but rank 1 called all_reduce(max, send 8 × f32)",
        );
        let res = if r == 0 {
            comm.all_reduce_slice(&mut [1.0f32; 8], ReduceOp::Sum)
        } else {
            comm.all_reduce_slice(&mut [1.0f64; 8], ReduceOp::Sum)
        };
        expect(
            "dtypes",
            res,
            "rank 0 called all_reduce(sum, send 8 × f32) but rank 1 called all_reduce(sum, send 8 × f64)",
        );
        expect(
            "roots",
            comm.broadcast_slice(&mut [1.0f32; 8], r.min(1)),
            "rank 0 called broadcast(root 0, 8 × f32) but rank 1 called broadcast(root 1, 8 × f32)",
        );
        // Rank 1's own arguments are wrong: it says why, the others that it refused.
        let mut short = vec![0.0f32; if r == 1 { 3 } else { 4 * world }];
        let res = comm.all_gather_slice(&[1.0f32; 4], &mut short);
        let needle = if r == 1 {
            "receive buffer holds 3 elements"
        } else {
            "rank 1 of a communicator"
        };
        expect("local", res, needle);
        // The same for an asynchronous form.
        let len = if r == 0 { 3 } else { 2 * world };
        let res = comm.all_to_all_async(vec![1.0f32; len].into()).wait().map(|_| ());
        let needle = if r == 0 {
            "must be a multiple of the group size"
        } else {
            "rank 0 of a communicator"
        };
        expect("async", res, needle);
        // Variable-count forms always compare: a rank with counts of the wrong
        // length says so, its peers that it refused; dtypes must agree.
        let counts = if r == 1 { vec![1; world + 1] } else { vec![1; world] };
        let mut recv = vec![0.0f32; world];
        let res = comm.all_gather_v((&[1.0f32][..]).into(), (&mut recv[..]).into(), &counts);
        let needle = if r == 1 {
            "counts (one per rank)"
        } else {
            "rank 1 rejected its own arguments to all_gather_v"
        };
        expect("v local", res, needle);
        let res = if r == 0 {
            comm.all_gather_v(
                (&[1.0f32][..]).into(),
                (&mut vec![0.0f32; world][..]).into(),
                &vec![1; world],
            )
        } else {
            comm.all_gather_v(
                (&[1.0f64][..]).into(),
                (&mut vec![0.0f64; world][..]).into(),
                &vec![1; world],
            )
        };
        expect("v dtype", res, "rank 0 called all_gather_v on f32 but rank 1 on f64");
        // Matching calls still work.
        let mut ok = vec![1.0f32; 8];
        comm.all_reduce_slice(&mut ok, ReduceOp::Sum)?;
        assert_eq!(ok, vec![world as f32; 8]);
        if r == 0 {
            println!("mismatch checks ok on {world} ranks");
        }
        Ok(())
    })?;
    Ok(())
}

/// Rank 1 fails while its asynchronous all_gather still waits for rank 0 (which
/// is slow): its error must end the job at once, not after rank 0 arrives.
fn fail_pending(world: usize) -> Result<(), BoxError> {
    launch(world, |ctx| {
        if ctx.rank() == 0 {
            std::thread::sleep(Duration::from_secs(30));
        }
        let work = ctx.comm().all_gather_async(vec![1.0f32; 16].into());
        if ctx.rank() == 1 {
            return Err("injected failure with a collective pending".into());
        }
        work.wait()?;
        Ok(())
    })?;
    Err("every rank finished, but rank 1 should have failed".into())
}

/// Rank 1 fails after two good steps; the others go on into the next collective.
fn fail(world: usize, how: &str) -> Result<(), BoxError> {
    let opts = LaunchOptions::from_env()?;
    let how = how.to_owned();
    launch_with(&opts, world, move |ctx| {
        let comm = ctx.comm();
        for step in 0..5 {
            if ctx.rank() == 1 && step == 2 {
                match how.as_str() {
                    "fail-error" => return Err("injected failure at step 2".into()),
                    "fail-panic" => panic!("injected panic at step 2"),
                    "fail-abort" => std::process::abort(),
                    "fail-exit" => std::process::exit(0),
                    _ => std::thread::sleep(Duration::from_secs(120)),
                }
            }
            let mut x = vec![1.0f32; 1024];
            comm.all_reduce_slice(&mut x, ReduceOp::Sum)?;
            assert_eq!(x[0], ctx.world_size() as f32);
        }
        Ok(())
    })?;
    Err("every rank finished, but rank 1 should have failed".into())
}

/// TP (dim 1) then DP (dim 0) all-reduces on a 2x2 mesh; rank 0 stalls at step
/// 2. Ranks 1 and 2 then wait on rank 0 directly, rank 3 (DP with rank 1) on
/// rank 1. With `chain`, only rank 3 has a short timeout, so it is the one that
/// times out.
fn stall_mesh(world: usize, chain: bool) -> Result<(), BoxError> {
    let rank = mpi_env().map_or(0, |e| e.rank);
    let timeout = if chain && rank != 3 { 60 } else { 3 };
    let opts = LaunchOptions::default().timeout(Duration::from_secs(timeout));
    launch_with(&opts, world, |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), &[2, 2])?;
        for step in 0..5 {
            if mesh.rank() == 0 && step == 2 {
                std::thread::sleep(Duration::from_secs(120));
            }
            let mut x = vec![1.0f32; 64];
            mesh.dim_comm(1)?.all_reduce_slice(&mut x, ReduceOp::Sum)?;
            mesh.dim_comm(0)?.all_reduce_slice(&mut x, ReduceOp::Sum)?;
        }
        Ok(())
    })?;
    Err("every rank finished, but rank 0 should have stalled".into())
}

// ----- the driver -----------------------------------------------------------------

struct Job {
    status: Option<i32>,
    stdout: String,
    stderr: String,
    took: Duration,
}

fn mpirun() -> String {
    std::env::var("TESSERA_MPIRUN").unwrap_or_else(|_| "mpirun".into())
}

/// Runs `program args` on `n` ranks under mpirun, killed after `deadline`.
fn run_mpi(n: usize, program: &Path, args: &[&str], envs: &[(&str, &str)], deadline: Duration) -> Job {
    let mut cmd = Command::new(mpirun());
    cmd.args(["-n", &n.to_string(), "--oversubscribe"]);
    // SAFETY-free check for root: OpenMPI refuses root without this flag.
    if std::env::var("USER").map(|u| u == "root").unwrap_or(false) || is_root() {
        cmd.arg("--allow-run-as-root");
    }
    cmd.arg(program).args(args);
    run(cmd, envs, deadline)
}

fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .map(|l| l.split_whitespace().nth(1) == Some("0"))
        })
        .unwrap_or(false)
}

fn run(mut cmd: Command, envs: &[(&str, &str)], deadline: Duration) -> Job {
    let dir = std::env::temp_dir().join(format!("tessera-mpi-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (out, err) = (dir.join("stdout"), dir.join("stderr"));
    cmd.envs(envs.iter().copied())
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::fs::File::create(&err).unwrap());
    let t = Instant::now();
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {cmd:?}: {e} (is OpenMPI installed? apt-get install openmpi-bin)"));
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s.code();
        }
        if t.elapsed() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "{cmd:?} still running after {deadline:?}: it hangs\nstderr:\n{}",
                std::fs::read_to_string(&err).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let job = Job {
        status,
        stdout: std::fs::read_to_string(&out).unwrap_or_default(),
        stderr: std::fs::read_to_string(&err).unwrap_or_default(),
        took: t.elapsed(),
    };
    let _ = std::fs::remove_dir_all(&dir);
    job
}

fn expect_ok(what: &str, job: &Job) {
    assert_eq!(
        job.status,
        Some(0),
        "{what}: exit status {:?}\nstdout:\n{}\nstderr:\n{}",
        job.status,
        job.stdout,
        job.stderr
    );
}

fn expect_failure(what: &str, job: &Job, needles: &[&str]) {
    assert!(
        job.status.is_some_and(|s| s != 0),
        "{what}: the job should fail, exit status {:?}\nstderr:\n{}",
        job.status,
        job.stderr
    );
    for n in needles {
        assert!(job.stderr.contains(n), "{what}: stderr lacks {n:?}:\n{}", job.stderr);
    }
    println!(
        "{what}: ended in {:.1} s with status {:?}",
        job.took.as_secs_f64(),
        job.status
    );
}

/// `target/<profile>/examples/<name>`, next to this test's `deps` directory.
fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps/<test>");
    profile_dir.join("examples").join(name)
}

fn losses(path: &Path) -> Vec<f64> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["loss"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

/// A failure scenario: its name, extra environment, and what stderr must say.
type FailCase = (
    &'static str,
    &'static [(&'static str, &'static str)],
    &'static [&'static str],
);

fn driver(args: &[String]) {
    let only = args.iter().find(|a| !a.starts_with('-')).cloned();
    let want = |name: &str| only.as_deref().is_none_or(|o| name.contains(o));
    let me = std::env::current_exe().unwrap();
    let minute = Duration::from_secs(60);
    let mut ran = 0;
    for n in [2, 4] {
        if want("contract") {
            let job = run_mpi(n, &me, &["contract"], &[], 5 * minute);
            expect_ok(&format!("contract on {n} ranks"), &job);
            assert!(
                job.stdout.contains(&format!("contract ok on {n} ranks")),
                "{}",
                job.stdout
            );
            print!("{}", job.stdout);
            ran += 1;
        }
        if want("fsdp") {
            let job = run_mpi(n, &me, &["fsdp"], &[], 5 * minute);
            expect_ok(&format!("fsdp on {n} ranks"), &job);
            assert_eq!(job.stdout.matches("fsdp parity").count(), n / 2, "{}", job.stdout);
            print!("{}", job.stdout);
            ran += 1;
        }
    }
    if want("agree") {
        let job = run_mpi(2, &me, &["agree"], &[], minute);
        expect_ok("agreement on 2 ranks", &job);
        assert!(job.stdout.contains("agreement checks ok on 2 ranks"), "{}", job.stdout);
        print!("{}", job.stdout);
        ran += 1;
    }
    if want("mismatch") {
        let job = run_mpi(2, &me, &["mismatch"], &[("TESSERA_MPI_CHECK", "1")], minute);
        expect_ok("mismatch on 2 ranks", &job);
        assert!(job.stdout.contains("mismatch checks ok on 2 ranks"), "{}", job.stdout);
        // By default (the digest check) and in strict mode.
        let job = run_mpi(2, &me, &["mismatch"], &[], minute);
        expect_ok("mismatch on 2 ranks, default checks", &job);
        assert!(job.stdout.contains("mismatch checks ok on 2 ranks"), "{}", job.stdout);
        let job = run_mpi(2, &me, &["mismatch"], &[("TESSERA_STRICT_COLLECTIVES", "1")], minute);
        expect_ok("mismatch on 2 ranks, strict", &job);
        assert!(job.stdout.contains("mismatch checks ok on 2 ranks"), "{}", job.stdout);
        print!("{}", job.stdout);
        ran += 1;
    }
    let fail_cases: [FailCase; 6] = [
        (
            "fail-pending",
            &[],
            &[
                "rank 1 of 2 failed: injected failure with a collective pending",
                "aborting the MPI job",
            ],
        ),
        (
            "fail-error",
            &[],
            &["rank 1 of 2 failed: injected failure at step 2", "aborting the MPI job"],
        ),
        (
            "fail-panic",
            &[],
            &["rank 1 of 2 panicked: injected panic at step 2", "aborting the MPI job"],
        ),
        ("fail-abort", &[], &["rank 1"]),
        (
            "stall",
            &[("TESSERA_TIMEOUT_S", "3")],
            &[
                "rank 0 waited",
                "in all_reduce",
                "never arrived",
                "aborting the MPI job",
                "rank 1: outside any collective for",
                "(last: all_reduce #2 of a group of 2 ranks, where it is rank 1 (world ranks [0, 1]))",
            ],
        ),
        (
            "fail-exit",
            &[("TESSERA_TIMEOUT_S", "3")],
            &[
                "rank 0 waited",
                "in all_reduce",
                "rank 1 exited (its process called exit) while this rank waited for it, before its closure returned",
                "aborting the MPI job",
            ],
        ),
    ];
    for (scenario, envs, needles) in fail_cases {
        if want(scenario) {
            let job = run_mpi(2, &me, &[scenario], envs, minute);
            expect_failure(&format!("{scenario} on 2 ranks"), &job, needles);
            assert!(job.took < Duration::from_secs(20), "{scenario}: took {:?}", job.took);
            ran += 1;
        }
    }
    if want("stall") {
        // Ranks 0, 2 and 3 time out together: their watchdogs answer each other
        // while they collect answers, and whichever aborts first names all three peers.
        let job = run_mpi(4, &me, &["stall"], &[("TESSERA_TIMEOUT_S", "3")], minute);
        let needles = [
            "never arrived",
            "what the other 3 ranks of that group report:",
            "rank 1: outside any collective for",
            "in all_reduce #3 of a group of 4 ranks",
        ];
        expect_failure("stall on 4 ranks", &job, &needles);
        assert!(
            job.took < Duration::from_secs(20),
            "stall on 4 ranks: took {:?}",
            job.took
        );
        ran += 1;
    }
    for (scenario, needles) in [
        (
            "stall-mesh",
            &[
                "never arrived",
                "the rank not progressing is rank 0",
                "rank 0: outside any collective for",
            ][..],
        ),
        (
            "stall-mesh-chain",
            &[
                "tessera: rank 3 waited",
                "the rank not progressing is rank 0; the waits that lead to it:",
                "tessera: rank 3:   rank 1: waiting",
                "in all_reduce #3 of a group of 2 ranks, where it is rank 1 (world ranks [0, 1])",
                "tessera: rank 3:   rank 0: outside any collective for",
                "(last: all_reduce #2 of a group of 2 ranks, where it is rank 0 (world ranks [0, 2]))",
                "what the other rank of that group reports:",
            ][..],
        ),
    ] {
        if want(scenario) {
            let job = run_mpi(4, &me, &[scenario], &[], minute);
            expect_failure(&format!("{scenario} on 4 ranks"), &job, needles);
            assert!(job.took < Duration::from_secs(30), "{scenario}: took {:?}", job.took);
            ran += 1;
        }
    }
    if want("train") {
        let train = example("train");
        assert!(
            train.exists(),
            "{} is missing: build it with `cargo build --features mpi --example train` (cargo test builds it)",
            train.display()
        );
        let dir = std::env::temp_dir().join(format!("tessera-mpi-train-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (a, b) = (dir.join("threads.json"), dir.join("mpi.json"));
        let flags = [
            "--steps",
            "4",
            "--dim",
            "64",
            "--n-layers",
            "2",
            "--n-heads",
            "4",
            "--vocab",
            "256",
            "--seq",
            "32",
        ];
        let mut threads = Command::new(&train);
        threads.args(flags).args(["--world-size", "4", "--losses-out"]).arg(&a);
        expect_ok("train on 4 threads", &run(threads, &[], 5 * minute));
        let b_str = b.to_str().unwrap();
        let mut mpi_args: Vec<&str> = flags.to_vec();
        mpi_args.extend(["--losses-out", b_str]);
        let job = run_mpi(4, &train, &mpi_args, &[], 5 * minute);
        expect_ok("train under mpirun -n 4", &job);
        assert!(
            !job.stdout.contains('\r'),
            "a log of mpirun holds no \\r frames: {:?}",
            job.stdout
        );
        let (la, lb) = (losses(&a), losses(&b));
        assert_eq!(la.len(), lb.len());
        let d = la.iter().zip(&lb).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max);
        println!(
            "train: 4 threads vs mpirun -n 4, {} steps: max |Δloss| = {d:.3e}",
            la.len()
        );
        assert!(d <= 1e-6, "train losses differ: threads {la:?} vs MPI {lb:?}");
        // Planned under MPI (a process per rank): every rank's peak, gathered,
        // as the same plan on threads gives them.
        let (pa, pb) = (dir.join("plan-threads.json"), dir.join("plan-mpi.json"));
        let mut threads = Command::new(&train);
        threads
            .args(flags)
            .args(["--world-size", "4", "--tp", "2", "--plan", "--plan-out"])
            .arg(&pa);
        expect_ok("train --plan on 4 threads", &run(threads, &[], 5 * minute));
        let pb_str = pb.to_str().unwrap();
        let mut mpi_args: Vec<&str> = flags.to_vec();
        mpi_args.extend(["--tp", "2", "--plan", "--plan-out", pb_str]);
        let job = run_mpi(4, &train, &mpi_args, &[], 5 * minute);
        expect_ok("train --plan under mpirun -n 4", &job);
        let peaks = |p: &Path| -> Vec<u64> {
            let v: serde_json::Value = serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap();
            v["peak_bytes_per_rank"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap())
                .collect()
        };
        let (threads_peaks, mpi_peaks) = (peaks(&pa), peaks(&pb));
        println!("train --plan: peaks per rank {threads_peaks:?} (threads) vs {mpi_peaks:?} (MPI)");
        assert_eq!(threads_peaks.len(), 4);
        assert_eq!(threads_peaks, mpi_peaks, "planned peaks per rank, threads vs MPI");
        let _ = std::fs::remove_dir_all(&dir);
        ran += 1;
    }
    if want("hsdp_multinode") {
        let bin = example("hsdp_multinode");
        assert!(
            bin.exists(),
            "{} is missing: build it with `cargo build --features mpi --example hsdp_multinode`",
            bin.display()
        );
        let job = run_mpi(4, &bin, &["--steps", "2"], &[], 5 * minute);
        expect_ok("hsdp_multinode under mpirun -n 4", &job);
        assert!(job.stdout.contains("backend mpi; mesh [2, 2]"), "{}", job.stdout);
        assert!(
            !job.stdout.contains("warning"),
            "one host: no shard group spans hosts\n{}",
            job.stdout
        );
        print!("{}", job.stdout);
        ran += 1;
    }
    assert!(ran > 0, "no scenario matches {only:?}");
    println!("mpi: {ran} scenario runs passed");
}
