//! Full state dicts of sharded parameters: saved from FSDP on 2 ranks (gathered,
//! one file), loaded into FSDP on 4 ranks and into HSDP 2×2 (each rank keeps its
//! rows): the full weights are the same everywhere.

use tessera::autograd::nn::Module;
use tessera::autograd::optim::{AdamW, Optimizer};
use tessera::autograd::{backward, load_state_dict, save_state_dict_full};
use tessera::fsdp::FsdpConfig;
use tessera::models::{Transformer, TransformerConfig};
use tessera::{DType, DeviceMesh, launch};

use crate::common::{adamw, tiny_model, tokens};
use crate::{TestResult, batch};

fn full_weights(model: &Transformer) -> TestResult<Vec<(String, Vec<f64>)>> {
    model
        .parameters()
        .iter()
        .map(|p| Ok((p.name(), p.value()?.full_tensor()?.to_f64_vec())))
        .collect()
}

#[test]
fn saved_on_one_mesh_loads_onto_another() {
    let dir = std::env::temp_dir().join(format!("tessera-fsdp-sd-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("model.safetensors");
    let toks = tokens();
    let saved = launch(2, {
        let path = path.clone();
        move |ctx| {
            let mesh = DeviceMesh::new(ctx.into_comm(), &[2])?;
            let model = tiny_model(&mesh)?;
            model.fully_shard(&mesh, &FsdpConfig::default())?;
            let mut opt = AdamW::new(model.parameters(), adamw())?;
            let loss = model.loss(&batch(&toks, 0, 0..8, &mesh)?)?;
            backward(&loss)?;
            opt.step()?;
            save_state_dict_full(&model.parameters(), &path)?;
            full_weights(&model)
        }
    })
    .unwrap();
    for shape in [&[4][..], &[2, 2]] {
        let loaded = launch(4, {
            let path = path.clone();
            move |ctx| {
                let mesh = DeviceMesh::new(ctx.into_comm(), shape)?;
                let model = Transformer::new(TransformerConfig::TINY, &mesh, DType::F32)?;
                let units = model.fully_shard(&mesh, &FsdpConfig::default())?;
                load_state_dict(&model.parameters(), &path)?;
                assert_eq!(
                    model.tok_embeddings.weight.value()?.placements(),
                    units.root.placements()
                );
                full_weights(&model)
            }
        })
        .unwrap();
        for rank in &loaded {
            assert_eq!(rank, &saved[0], "mesh {shape:?}");
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
