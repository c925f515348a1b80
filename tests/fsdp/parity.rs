//! The tiny reference Transformer under FSDP (W2, W4), HSDP (2×2, the shard dim
//! first or last) and bf16 mixed precision against PyTorch's FSDP2 losses, step by step.

use tessera::dtensor::Placement;
use tessera::fsdp::FsdpConfig;
use tessera::models::UnitLayout;

use crate::common::reference_losses;
use crate::{Job, Run, bf16, max_abs_diff, reshard, train};

/// Trains `job` and checks every step's loss against the reference run.
fn check(label: &str, job: &Job, reference: &str, tol: f64) -> Run {
    let run = train(job);
    let want = reference_losses(reference);
    assert_eq!(run.losses.len(), job.steps);
    let d = max_abs_diff(&run.losses, &want[..job.steps]);
    println!(
        "parity {label:<28} vs {reference:<16}: max |Δloss| = {d:.3e} over {} steps",
        job.steps
    );
    for (s, (got, want)) in run.losses.iter().zip(&want).enumerate() {
        assert!(
            (got - want).abs() <= tol,
            "{label}: step {s} loss {got} vs reference {want} (tolerance {tol})"
        );
    }
    run
}

/// Torchtitan's units (embeddings and head on their own) train exactly as
/// PyTorch's FSDP2 run of blocks and root, on FSDP and HSDP.
#[test]
fn split_ends_units() {
    for (label, mesh, g, reference) in [
        ("FSDP W2 split ends", &[2][..], 8, "fsdp_W2_G8"),
        ("HSDP 2x2 split ends", &[2, 2][..], 16, "hsdp_2x2_G16"),
    ] {
        let job = Job {
            units: UnitLayout::SplitEnds,
            ..Job::fsdp(mesh, g, 10, FsdpConfig::default())
        };
        check(label, &job, reference, 1e-5);
    }
}

#[test]
fn fsdp_w2() {
    let run = check(
        "FSDP W2",
        &Job::fsdp(&[2], 8, 20, FsdpConfig::default()),
        "fsdp_W2_G8",
        1e-5,
    );
    assert!(run.placements.iter().all(|p| p == &[Placement::Shard(0)]));
    check(
        "FSDP W2 no reshard",
        &Job::fsdp(&[2], 8, 20, reshard(false)),
        "fsdp_W2_G8",
        1e-5,
    );
}

#[test]
fn fsdp_w4() {
    check(
        "FSDP W4",
        &Job::fsdp(&[4], 16, 20, FsdpConfig::default()),
        "fsdp_W4_G16",
        1e-5,
    );
    check(
        "FSDP W4 no reshard",
        &Job::fsdp(&[4], 16, 20, reshard(false)),
        "fsdp_W4_G16",
        1e-5,
    );
}

#[test]
fn hsdp_2x2() {
    let run = check(
        "HSDP 2x2",
        &Job::fsdp(&[2, 2], 16, 20, FsdpConfig::default()),
        "hsdp_2x2_G16",
        1e-5,
    );
    assert!(
        run.placements
            .iter()
            .all(|p| p == &[Placement::Replicate, Placement::Shard(0)])
    );
    check(
        "HSDP 2x2 no reshard",
        &Job::fsdp(&[2, 2], 16, 20, reshard(false)),
        "hsdp_2x2_G16",
        1e-5,
    );
}

/// HSDP with the shard dim named, and first: `[Shard(0), Replicate]`.
#[test]
fn hsdp_named_shard_dim_first() {
    let job = Job {
        names: Some(&["shard", "replicate"]),
        ..Job::fsdp(
            &[2, 2],
            16,
            10,
            FsdpConfig {
                shard_dim: Some("shard".into()),
                ..FsdpConfig::default()
            },
        )
    };
    let run = check("HSDP 2x2 shard dim 0", &job, "hsdp_2x2_G16", 1e-5);
    assert!(
        run.placements
            .iter()
            .all(|p| p == &[Placement::Shard(0), Placement::Replicate])
    );
}

#[test]
fn fsdp_w2_bf16() {
    check("FSDP W2 bf16", &Job::fsdp(&[2], 8, 20, bf16()), "fsdp_W2_G8_bf16", 1e-3);
}
