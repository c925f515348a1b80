//! A one-rank shard dim: DDP. On a `[4, 1]` mesh FSDP only all-reduces gradients,
//! and trains as FSDP on 4 ranks does.

use tessera::fsdp::FsdpConfig;
use tessera::mesh::OpKind;

use crate::common::reference_losses;
use crate::{Job, calls, max_abs_diff, train};

#[test]
fn mesh_4x1_all_reduces_only() {
    let ddp = train(&Job::fsdp(&[4, 1], 16, 20, FsdpConfig::default()));
    let fsdp = train(&Job::fsdp(&[4], 16, 20, FsdpConfig::default()));
    // The same model without FSDP on the same mesh: what the model itself issues.
    let plain = train(&Job {
        fsdp: None,
        ..Job::fsdp(&[4, 1], 16, 1, FsdpConfig::default())
    });
    println!(
        "counts DDP [4, 1]: forward {} | backward {} (no FSDP on [4, 1]: forward {})",
        ddp.fwd[1], ddp.bwd[1], plain.fwd[0]
    );
    // The batch is `[Shard(0), Shard(0)]`: narrowing it to inputs and targets
    // gathers over the one-rank dim (two all_gather calls of 0 bytes, issued by
    // DTensor's narrow, with or without FSDP). FSDP adds no gather and no scatter.
    assert_eq!(plain.fwd[0].bytes(OpKind::AllGather), 0);
    for (s, (f, b)) in ddp.fwd.iter().zip(&ddp.bwd).enumerate() {
        assert_eq!(calls(f), calls(&plain.fwd[0]), "forward of step {s}: {f}");
        assert_eq!(
            f.calls(OpKind::ReduceScatter) + f.calls(OpKind::AllReduce),
            0,
            "forward of step {s}: {f}"
        );
        assert_eq!(f.bytes(OpKind::AllGather), 0, "forward of step {s}: {f}");
        assert_eq!(calls(b), (0, 0, 3, 0), "backward of step {s}: {b}");
    }
    let d = max_abs_diff(&ddp.losses, &fsdp.losses);
    let d_ref = max_abs_diff(&ddp.losses, &reference_losses("fsdp_W4_G16"));
    println!("parity DDP [4, 1] vs FSDP W4: max |Δloss| = {d:.3e}; vs fsdp_W4_G16 {d_ref:.3e} over 20 steps");
    assert!(d <= 1e-6, "DDP and FSDP losses differ by {d}");
    assert!(d_ref <= 1e-5);
}
