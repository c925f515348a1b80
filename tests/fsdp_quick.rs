use serde_json::Value;
use std::path::PathBuf;
use tessera::autograd::nn::Module;
use tessera::autograd::optim::{AdamW, AdamWConfig, Optimizer};
use tessera::autograd::{Var, backward, load_state_dict, read_safetensors};
use tessera::dtensor::{Placement, Tensor, distribute_tensor};
use tessera::fsdp::{FsdpConfig, MixedPrecisionPolicy};
use tessera::models::{Transformer, TransformerConfig};
use tessera::{DType, DeviceMesh, launch};

fn data(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data").join(name)
}
fn reference_losses(run: &str) -> Vec<f64> {
    let text = std::fs::read_to_string(data("tiny_reference.json")).unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();
    v["runs"][run]["loss"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}
fn tokens() -> Tensor {
    let all = read_safetensors(data("tiny_tokens_G16.safetensors")).unwrap();
    all.into_iter().find(|(n, _)| n == "tokens").unwrap().1
}

fn train(mesh_shape: &[usize], g: usize, steps: usize, cfg: FsdpConfig) -> (Vec<f64>, Vec<tessera::mesh::CommCounts>) {
    let toks = tokens();
    let world: usize = mesh_shape.iter().product();
    let runs = launch(world, |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), mesh_shape)?;
        let model = Transformer::new(TransformerConfig::TINY, &mesh, DType::F32, 0)?;
        let params = model.parameters();
        load_state_dict(&params, data("tiny_init.safetensors"))?;
        let _units = model.fully_shard(&mesh, &cfg)?;
        let config = AdamWConfig {
            lr: 1e-3,
            betas: (0.9, 0.95),
            eps: 1e-8,
            weight_decay: 0.1,
        };
        let mut opt = AdamW::new(params.clone(), config)?;
        let mut losses = Vec::new();
        let mut counts = Vec::new();
        let data_pl = vec![Placement::Shard(0); mesh_shape.len()];
        for step in 0..steps {
            let rows = toks.narrow(0, step, 1)?.narrow(1, 0, g)?.reshape(&[g, 33])?;
            let rows = Var::constant(distribute_tensor(&rows, &mesh, &data_pl)?);
            let before = mesh.stats();
            let loss = model.loss(&rows)?;
            if step == 1 {
                eprintln!("fwd {:?}", mesh.stats() - before);
            }
            backward(&loss)?;
            counts.push(mesh.stats() - before);
            losses.push(loss.value().full_tensor()?.to_f64_vec()[0]);
            opt.step()?;
            opt.zero_grad();
        }
        Ok((losses, counts))
    })
    .unwrap();
    runs.into_iter().next().unwrap()
}

#[test]
fn quick() {
    for (shape, g, run, cfg) in [
        (vec![2], 8, "fsdp_W2_G8", FsdpConfig::default()),
        (vec![2, 2], 16, "hsdp_2x2_G16", FsdpConfig::default()),
        (
            vec![2],
            8,
            "fsdp_W2_G8_bf16",
            FsdpConfig {
                mp_policy: MixedPrecisionPolicy::bf16(),
                ..Default::default()
            },
        ),
    ] {
        let (l, c) = train(&shape, g, 5, cfg);
        let r = reference_losses(run);
        let d = l.iter().zip(&r).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        println!("{run}: max diff {d:e} {:?} {:?}", &l[..3], c[1]);
    }
}
