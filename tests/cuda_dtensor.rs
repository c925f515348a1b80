//! DTensors whose local tensors are on one GPU shared by thread ranks: every
//! redistribution and bucket collective equals the host's on the same data.
//!
//! Each test needs a CUDA GPU, so each is ignored in a plain `cargo test`;
//! `scripts/gpu-check.sh` runs them with `--ignored` on a GPU machine.

use proptest::prelude::*;
use proptest::test_runner::Config;
use tessera::dtensor::bucket::{all_gather_bucket, reduce_scatter_bucket};
use tessera::dtensor::testing::{partial_local, test_values, transition};
use tessera::dtensor::{DTensor, DType, Device, Tensor, distribute_tensor_with_order};
use tessera::mesh::{DeviceMesh, launch};

const GPU: Device = Device::Cuda(0);

fn close(got: &Tensor, want: &Tensor) -> bool {
    let (rtol, atol) = match want.dtype() {
        DType::BF16 => (1e-2, 1e-2),
        DType::F32 => (1e-5, 1e-5),
        _ => (1e-12, 1e-12),
    };
    if matches!(want.dtype(), DType::I64 | DType::U8) {
        return got == want;
    }
    got.allclose(want, rtol, atol)
}

fn cases() -> Config {
    let mut c = Config::default();
    if std::env::var_os("PROPTEST_CASES").is_none() {
        c.cases = 48;
    }
    c.failure_persistence = None;
    c
}

proptest! {
    #![proptest_config(cases())]

    /// Redistributing a DTensor whose local tensors are on the GPU gives, on
    /// every rank, the host's local tensor (on the GPU).
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn device_redistribute_equals_host(t in transition(true, true)) {
        let case = t.clone();
        let n = t.src.mesh_shape.iter().product();
        let outs = launch(n, move |ctx| {
            let t = &case;
            let mesh = DeviceMesh::new(ctx.into_comm(), &t.src.mesh_shape)?;
            let full = test_values(&t.src.shape, t.src.dtype)?;
            let x = match t.source {
                tessera::dtensor::testing::Source::Distribute => {
                    distribute_tensor_with_order(&full, &mesh, &t.src.placements, t.src.order.clone())?
                }
                tessera::dtensor::testing::Source::FromLocal => {
                    let local = partial_local(&full, &t.src, mesh.coordinate(), t.seed)?;
                    DTensor::from_local_with_layout(local, &mesh, t.src.clone())?
                }
            };
            let want = x.redistribute_with_order(&t.dst.placements, t.dst.order.clone())?;
            let xd = DTensor::from_local_with_layout(x.to_local().to(GPU)?, &mesh, x.layout().clone())?;
            let yd = xd.redistribute_with_order(&t.dst.placements, t.dst.order.clone())?;
            let device = yd.to_local().device();
            Ok((device, yd.to_local().to(Device::Cpu)?, want.to_local().clone()))
        })
        .map_err(|e| TestCaseError::fail(format!("{t:?}: {e}")))?;
        for (r, (device, got, want)) in outs.iter().enumerate() {
            prop_assert_eq!(*device, GPU, "rank {}: the result left the GPU", r);
            prop_assert!(close(got, want), "rank {} of {:?}: device {:?}, host {:?}", r, t, got, want);
        }
    }
}

/// FSDP's bucket collectives on the GPU: a gather and a reduce-scatter of
/// uneven members equal the host's.
#[test]
#[ignore = "needs a CUDA GPU"]
fn device_buckets_equal_host() {
    for world in [2, 3, 4] {
        launch(world, move |ctx| {
            let mesh = DeviceMesh::new(ctx.into_comm(), &[world])?;
            let shapes: [&[usize]; 3] = [&[7, 5], &[3], &[10, 2, 3]];
            let fulls: Vec<Tensor> = shapes
                .iter()
                .map(|s| test_values(s, DType::F32))
                .collect::<Result<_, _>>()?;
            let sharded: Vec<DTensor> = fulls
                .iter()
                .map(|f| tessera::dtensor::distribute_tensor(f, &mesh, &[tessera::dtensor::Placement::Shard(0)]))
                .collect::<Result<_, _>>()?;
            let on_gpu: Vec<DTensor> = sharded
                .iter()
                .map(|x| DTensor::from_local_with_layout(x.to_local().to(GPU)?, &mesh, x.layout().clone()))
                .collect::<Result<_, _>>()?;
            for dtype in [DType::F32, DType::BF16] {
                let host = all_gather_bucket(&sharded, 0, dtype)?.wait()?;
                let dev = all_gather_bucket(&on_gpu, 0, dtype)?.wait()?;
                for (h, d) in host.iter().zip(&dev) {
                    assert_eq!(d.to_local().device(), GPU);
                    assert_eq!(
                        d.to_local().to(Device::Cpu)?,
                        *h.to_local(),
                        "gather {dtype} on {world} ranks"
                    );
                }
            }
            // Partial sums: each rank's own values.
            let partial: Vec<DTensor> = fulls
                .iter()
                .map(|f| {
                    let local = f.mul_scalar(1.0 + mesh.rank() as f64)?;
                    DTensor::from_local(
                        local,
                        &mesh,
                        &[tessera::dtensor::Placement::Partial(tessera::mesh::ReduceOp::Sum)],
                        f.shape(),
                    )
                })
                .collect::<Result<_, _>>()?;
            let partial_gpu: Vec<DTensor> = partial
                .iter()
                .map(|x| DTensor::from_local_with_layout(x.to_local().to(GPU)?, &mesh, x.layout().clone()))
                .collect::<Result<_, _>>()?;
            let host = reduce_scatter_bucket(&partial, 0)?.wait()?;
            let dev = reduce_scatter_bucket(&partial_gpu, 0)?.wait()?;
            for (h, d) in host.iter().zip(&dev) {
                assert!(
                    close(&d.to_local().to(Device::Cpu)?, h.to_local()),
                    "reduce-scatter on {world} ranks"
                );
            }
            Ok(())
        })
        .unwrap();
        println!("buckets on one GPU: {world} ranks ok");
    }
}

/// The tiny Transformer's loss and gradients on the GPU equal the host's, on
/// one rank and under FSDP on 2 ranks sharing the GPU (a mesh on the GPU:
/// parameters materialised there, tokens distributed there).
#[test]
#[ignore = "needs a CUDA GPU"]
fn tiny_transformer_forward_backward_on_gpu() {
    use tessera::models::{Transformer, TransformerConfig};
    let cfg = TransformerConfig::TINY;
    model_forward_backward_on_gpu("tiny transformer", (cfg.seq, cfg.vocab), |mesh| {
        Transformer::new(TransformerConfig::TINY, mesh, DType::F32)
    });
}

/// The LLaMA-style model (RMSNorm, rotary positions, grouped-query attention,
/// SwiGLU) on the GPU: the same loss and gradients as on the host.
#[test]
#[ignore = "needs a CUDA GPU"]
fn tiny_llama_forward_backward_on_gpu() {
    use tessera::models::{Llama, LlamaConfig};
    let cfg = LlamaConfig::TINY;
    model_forward_backward_on_gpu("tiny llama", (cfg.seq, cfg.vocab), |mesh| {
        Llama::new(LlamaConfig::TINY, mesh, DType::F32)
    });
}

/// `build`'s model on 1 and 2 ranks, on the host and on the GPU (FSDP over
/// the ranks, parameters materialised there, tokens distributed there): the
/// same loss and gradients.
fn model_forward_backward_on_gpu<M: tessera::models::CausalLm>(
    name: &str,
    (seq, vocab): (usize, usize),
    build: fn(&DeviceMesh) -> tessera::autograd::Result<M>,
) {
    use tessera::autograd::nn::Materializer;
    use tessera::autograd::{Var, backward};
    use tessera::dtensor::{Placement, distribute_tensor_from};
    use tessera::fsdp::FsdpConfig;

    for world in [1, 2] {
        let out = launch(world, move |ctx| {
            let host_mesh = DeviceMesh::new(ctx.into_comm(), &[world])?;
            let rows = Tensor::from_vec(
                tessera::data::batch(tessera::data::DATA_SEED, 0, 0..4, seq + 1, vocab as u64),
                &[4, seq + 1],
            )?;
            let mut results = Vec::new();
            for device in [Device::Cpu, GPU] {
                let mesh = host_mesh.clone().on_device(device);
                let model = build(&mesh)?;
                if world > 1 {
                    model.fully_shard(&mesh, &FsdpConfig::default())?;
                }
                Materializer::from_seed(7).materialize(&model)?;
                let params = model.parameters();
                let x = distribute_tensor_from(&rows, &mesh, &[Placement::Shard(0)], None)?;
                assert_eq!(x.to_local().device(), device);
                let loss = model.loss(&Var::constant(x))?;
                let value = loss.value().full_tensor()?.to_f64_vec()[0];
                backward(&loss)?;
                let grads: Vec<Tensor> = params
                    .iter()
                    .map(|p| {
                        let g = p.grad().ok_or("no gradient")?;
                        assert_eq!(g.to_local().device(), device, "{}", p.name());
                        Ok(g.to_local().to(Device::Cpu)?)
                    })
                    .collect::<Result<_, tessera::BoxError>>()?;
                results.push((value, grads));
            }
            let (host, dev) = (&results[0], &results[1]);
            let worst = host
                .1
                .iter()
                .zip(&dev.1)
                .map(|(h, d)| {
                    let (h, d) = (h.to_f64_vec(), d.to_f64_vec());
                    let num: f64 = h.iter().zip(&d).map(|(a, b)| (a - b).powi(2)).sum();
                    let den: f64 = h.iter().map(|a| a * a).sum();
                    (num / den.max(1e-30)).sqrt()
                })
                .fold(0.0f64, f64::max);
            Ok((host.0, dev.0, worst))
        })
        .unwrap();
        for (r, (h, d, worst)) in out.iter().enumerate() {
            println!(
                "{name} on {world} rank(s), rank {r}: loss host {h:.8} gpu {d:.8}, worst gradient rel_err {worst:.2e}"
            );
            assert!((h - d).abs() <= 1e-5 * h.abs(), "loss {h} vs {d}");
            assert!(*worst < 1e-4, "gradients differ: {worst:.2e}");
        }
    }
}
