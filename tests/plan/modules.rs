//! Where a planned forward's bytes go: by kind of module, in proportion to
//! the batch.

use tessera::autograd::nn::{Materializer, Module};
use tessera::autograd::optim::{AdamW, AdamWConfig};
use tessera::dtensor::{Layout, Placement};
use tessera::fsdp::FsdpConfig;
use tessera::models::{Transformer, TransformerConfig};
use tessera::plan::{StepPlan, plan_step};
use tessera::{DType, DeviceMesh, launch};

fn plan(rows: usize) -> StepPlan {
    launch(2, move |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), &[2])?;
        let cfg = TransformerConfig::TINY;
        let model = Transformer::new(cfg, &mesh, DType::F32)?;
        model.fully_shard(&mesh, &FsdpConfig::default())?;
        Materializer::on_meta().materialize(&model)?;
        let mut opt = AdamW::new(model.parameters(), AdamWConfig::default())?;
        let batch = Layout::new(&[2], &[Placement::Shard(0)], &[2 * rows, cfg.seq + 1], DType::I64)?;
        plan_step(&mesh, &mut opt, &batch, |r| model.loss(r))
    })
    .unwrap()
    .remove(0)
}

#[test]
fn forward_bytes_are_credited_to_the_modules_that_keep_them() {
    let (one, two) = (plan(2), plan(4));
    let kinds = |p: &StepPlan, k: &str| p.forward_bytes_by_module.get(k).copied().unwrap_or(0);
    for k in ["attention", "feed_forward", "attention_norm", "ffn_norm", "output"] {
        let (a, b) = (kinds(&one, k), kinds(&two, k));
        assert!(a > 0, "{k} keeps nothing: {:?}", one.forward_bytes_by_module);
        // Activations are per row: twice the rows, twice the bytes.
        assert_eq!(b, 2 * a, "{k}: {a} bytes for 2 rows, {b} for 4");
    }
    // Parameters are not activations: the gathered blocks net out.
    assert!(kinds(&one, "(block)") <= 0, "{:?}", one.forward_bytes_by_module);
    assert!(one.peak_at.ends_with("forward") || one.peak_at.ends_with("backward"));
    assert_eq!(one.param_bytes, two.param_bytes);
    assert!(one.held_bytes > one.param_bytes, "AdamW's state is held too");
}
