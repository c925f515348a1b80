//! The device runtime: the caching allocator, collectives between ranks
//! sharing a GPU and over NCCL, and the AdamW step.

use super::*;

/// The caching allocator reuses blocks: a loop of the same work asks the
/// driver for memory only in its first iteration, and the tracker's device
/// bytes return to where they were.
#[test]
#[ignore = "needs a CUDA GPU"]
fn caching_allocator_reuses_and_tracks() {
    launch(1, |_| {
        let before = tessera_tensor::memory::device_stats().current_bytes;
        let x = gpu(&rand(&[256, 1024], DType::F32, 30));
        assert_eq!(
            tessera_tensor::memory::device_stats().current_bytes - before,
            256 * 1024 * 4,
            "device bytes charged to the rank"
        );
        let w = gpu(&rand(&[1024, 1024], DType::F32, 31));
        let step = |x: &Tensor| {
            x.matmul(&w)
                .unwrap()
                .gelu()
                .unwrap()
                .softmax(1)
                .unwrap()
                .sum(&[0], false)
                .unwrap()
        };
        step(&x);
        cuda::synchronize(0)?;
        let warm = cuda::memory_stats(0)?;
        for _ in 0..200 {
            step(&x);
        }
        cuda::synchronize(0)?;
        let after = cuda::memory_stats(0)?;
        println!("allocator: {warm:?} -> {after:?}");
        assert_eq!(
            after.driver_allocations, warm.driver_allocations,
            "no new device memory after the first step"
        );
        assert_eq!(after.reserved_bytes, warm.reserved_bytes, "no growth over 200 steps");
        drop((x, w));
        assert_eq!(
            tessera_tensor::memory::device_stats().current_bytes,
            before,
            "every device byte given back"
        );
        cuda::empty_cache(0)?;
        assert!(
            cuda::memory_stats(0)?.reserved_bytes < after.reserved_bytes,
            "empty_cache returns cached blocks"
        );
        Ok(())
    })
    .unwrap();
}

/// Ranks that are threads sharing the GPU: collectives equal their host
/// counterparts on the same data.
#[test]
#[ignore = "needs a CUDA GPU"]
fn collectives_on_one_gpu() {
    for world in [2, 4] {
        let out = launch(world, move |ctx| {
            let r = ctx.rank();
            let group = cuda::comm::LocalGroup::new(ctx.comm())?;
            let mine = rand(&[world * 3, 5], DType::F32, 40 + r as u64);
            let every: Vec<Tensor> = (0..world)
                .map(|p| rand(&[world * 3, 5], DType::F32, 40 + p as u64))
                .collect();
            let sum = every.iter().skip(1).fold(every[0].clone(), |a, b| a.add(b).unwrap());
            let d = gpu(&mine);
            for _ in 0..3 {
                let g = group.all_gather(&d)?;
                assert_eq!(host(&g), Tensor::cat(&every, 0)?, "all_gather on rank {r}");
                let a = group.all_reduce(&d, ReduceOp::Sum)?;
                assert!(rel_err(&host(&a), &sum) < 1e-6, "all_reduce on rank {r}");
                let s = group.reduce_scatter(&d, ReduceOp::Avg)?;
                let want = sum.narrow(0, r * 3, 3)?.mul_scalar(1.0 / world as f64)?;
                assert!(rel_err(&host(&s), &want) < 1e-6, "reduce_scatter on rank {r}");
            }
            let m = group.all_reduce(&d, ReduceOp::Max)?;
            let want = every
                .iter()
                .skip(1)
                .fold(every[0].clone(), |a, b| a.maximum(b).unwrap());
            assert_eq!(host(&m), want, "max on rank {r}");
            Ok(r)
        })
        .unwrap();
        println!("collectives on one GPU: {world} ranks ok ({out:?})");
    }
}

/// NCCL with one rank (the machines that run these checks have one GPU).
#[test]
#[ignore = "needs a CUDA GPU"]
fn nccl_world_one() {
    launch(1, |ctx| {
        println!("NCCL version {}", cuda::comm::Nccl::version()?);
        let nccl = cuda::comm::Nccl::new(ctx.comm(), 0)?;
        let x = rand(&[8, 4], DType::F32, 50);
        let d = gpu(&x);
        assert_eq!(host(&nccl.all_reduce(&d, ReduceOp::Sum)?), x);
        assert_eq!(host(&nccl.all_gather(&d)?), x);
        assert_eq!(host(&nccl.reduce_scatter(&d, ReduceOp::Sum)?), x);
        let xb = gpu(&x.cast(DType::BF16)?);
        assert_eq!(host(&nccl.all_reduce(&xb, ReduceOp::Sum)?), x.cast(DType::BF16)?);
        Ok(())
    })
    .unwrap();
}

/// The device AdamW step against the host's formula (same scalars, same
/// order of operations) over 5 steps; a shared parameter is copied, not
/// changed under its other holder.
#[test]
#[ignore = "needs a CUDA GPU"]
fn adamw_matches_the_host_formula() {
    let n = 1000;
    let (lr, b1, b2, eps, wd) = (1e-2f64, 0.9f64, 0.95f64, 1e-8f64, 0.1f64);
    let mut p = rand(&[n], DType::F32, 60).to_vec::<f32>().unwrap();
    let (mut m, mut v) = (vec![0f32; n], vec![0f32; n]);
    let mut dp = gpu(&Tensor::from_slice(&p, &[n]).unwrap());
    let (mut dm, mut dv) = (
        gpu(&Tensor::zeros(&[n], DType::F32).unwrap()),
        gpu(&Tensor::zeros(&[n], DType::F32).unwrap()),
    );
    let scalars = |step: i32| cuda::AdamScalars {
        decay: (1.0 - lr * wd) as f32,
        lerp_weight: (1.0 - b1) as f32,
        beta2: b2 as f32,
        one_minus_beta2: (1.0 - b2) as f32,
        bias_correction2_sqrt: (1.0 - b2.powi(step)).sqrt() as f32,
        eps: eps as f32,
        neg_step_size: (-lr / (1.0 - b1.powi(step))) as f32,
        lerp_small: 1,
    };
    for step in 1..=5 {
        let g = rand(&[n], DType::F32, 60 + step as u64).to_vec::<f32>().unwrap();
        let s = scalars(step);
        cuda::adamw_step(
            &mut dp,
            &gpu(&Tensor::from_slice(&g, &[n]).unwrap()),
            &mut dm,
            &mut dv,
            s,
        )
        .unwrap();
        for i in 0..n {
            let pi = p[i] * s.decay;
            let mi = s.lerp_weight.mul_add(g[i] - m[i], m[i]);
            let vi = v[i] * s.beta2 + s.one_minus_beta2 * g[i] * g[i];
            let denom = vi.sqrt() / s.bias_correction2_sqrt + s.eps;
            p[i] = pi + s.neg_step_size * mi / denom;
            m[i] = mi;
            v[i] = vi;
        }
    }
    let got = host(&dp).to_vec::<f32>().unwrap();
    let same = got.iter().zip(&p).filter(|(a, b)| a.to_bits() == b.to_bits()).count();
    println!("check adamw 5 steps: {same} of {n} elements bit for bit");
    assert_eq!(same, n, "the device step differs from the host formula");
    // Copy on write: the other handle keeps the old values.
    let other = dp.clone();
    let before = host(&other);
    cuda::adamw_step(
        &mut dp,
        &gpu(&Tensor::ones(&[n], DType::F32).unwrap()),
        &mut dm,
        &mut dv,
        scalars(6),
    )
    .unwrap();
    assert_eq!(
        host(&other),
        before,
        "a shared parameter changed under its other holder"
    );
    assert!(!dp.shares_storage(&other) && host(&dp) != before);
}

/// Uneven and segmented collectives between ranks sharing the GPU, against
/// the same data gathered on the host.
#[test]
#[ignore = "needs a CUDA GPU"]
fn uneven_collectives_on_one_gpu() {
    let world = 3;
    launch(world, move |ctx| {
        let r = ctx.rank();
        let group = cuda::comm::LocalGroup::new(ctx.comm())?;
        // Rank p holds p + 2 elements valued 100·p + i.
        let counts: Vec<usize> = (0..world).map(|p| p + 2).collect();
        let mine: Vec<f32> = (0..counts[r]).map(|i| (100 * r + i) as f32).collect();
        let got = group.all_gather_v(&gpu(&Tensor::from_slice(&mine, &[counts[r]])?), &counts)?;
        let want: Vec<f32> = (0..world)
            .flat_map(|p| (0..counts[p]).map(move |i| (100 * p + i) as f32))
            .collect();
        assert_eq!(host(&got).to_vec::<f32>()?, want, "all_gather_v on rank {r}");
        // reduce_scatter_v of i64: every rank sends 0..9 plus its rank.
        let send: Vec<i64> = (0..9).map(|i| i + r as i64).collect();
        let got = group.reduce_scatter_v(&gpu(&Tensor::from_slice(&send, &[9])?), &[2, 3, 4], ReduceOp::Sum)?;
        let start = [0, 2, 5][r];
        let want: Vec<i64> = (0..[2, 3, 4][r]).map(|i| 3 * (start + i) as i64 + 3).collect();
        assert_eq!(host(&got).to_vec::<i64>()?, want, "reduce_scatter_v on rank {r}");
        // all_to_all_v: rank p sends q + 1 copies of 10·p + q to rank q.
        let send_counts: Vec<usize> = (0..world).map(|q| q + 1).collect();
        let send: Vec<f32> = (0..world)
            .flat_map(|q| std::iter::repeat_n((10 * r + q) as f32, q + 1))
            .collect();
        let recv_counts = vec![r + 1; world];
        let got = group.all_to_all_v(
            &gpu(&Tensor::from_slice(&send, &[send.len()])?),
            &send_counts,
            &recv_counts,
        )?;
        let want: Vec<f32> = (0..world)
            .flat_map(|p| std::iter::repeat_n((10 * p + r) as f32, r + 1))
            .collect();
        assert_eq!(host(&got).to_vec::<f32>()?, want, "all_to_all_v on rank {r}");
        // Segmented gather: segments [2, 1] of every rank side by side.
        let seg: Vec<f32> = (0..3).map(|i| (10 * r + i) as f32).collect();
        let got = group.all_gather_segmented(&gpu(&Tensor::from_slice(&seg, &[3])?), &[2, 1])?;
        let mut want = Vec::new();
        for p in 0..world {
            want.extend([(10 * p) as f32, (10 * p + 1) as f32]);
        }
        for p in 0..world {
            want.push((10 * p + 2) as f32);
        }
        assert_eq!(host(&got).to_vec::<f32>()?, want, "all_gather_segmented on rank {r}");
        // Counts that disagree are refused on every rank.
        let e = group
            .all_gather_v(&gpu(&Tensor::from_slice(&mine, &[counts[r]])?), &[1, 1])
            .unwrap_err()
            .to_string();
        assert!(e.contains("counts"), "{e}");
        Ok(())
    })
    .unwrap();
}

/// Small copies to the GPU and the kernels that use them queue without the
/// host waiting (through pinned slots, reused once their copies have run:
/// 100 copies pass through 32 slots with the right values); reading a result
/// waits once, and so does a copy too large for a slot.
#[test]
#[ignore = "needs a CUDA GPU"]
fn the_host_waits_only_to_read() {
    let before = cuda::host_waits(0).unwrap();
    let mut acc = gpu(&Tensor::zeros(&[1000], DType::F32).unwrap());
    for i in 0..20 {
        acc = acc
            .add(&gpu(&Tensor::full(&[1000], i as f64, DType::F32).unwrap()))
            .unwrap();
    }
    assert_eq!(
        cuda::host_waits(0).unwrap(),
        before,
        "small copies and adds waited for the GPU"
    );
    for i in 20..100 {
        acc = acc
            .add(&gpu(&Tensor::full(&[1000], i as f64, DType::F32).unwrap()))
            .unwrap();
    }
    let queued = cuda::host_waits(0).unwrap();
    assert!(
        host(&acc).to_f64_vec().iter().all(|&x| x == 4950.0),
        "values lost passing through the slots"
    );
    assert_eq!(cuda::host_waits(0).unwrap(), queued + 1, "one read, one wait");
    let big = gpu(&Tensor::ones(&[1 << 17], DType::F32).unwrap());
    assert_eq!(cuda::host_waits(0).unwrap(), queued + 2, "a 512 KiB copy waits");
    assert_eq!(host(&big).to_f64_vec().iter().sum::<f64>(), (1 << 17) as f64);
}
