//! The reference Transformer under tensor parallelism against PyTorch's TP runs.

use crate::common::reference_losses;
use crate::{max_abs_diff, train};

fn check(label: &str, losses: &[f64], reference: &str, tol: f64) -> f64 {
    let want = reference_losses(reference);
    let worst = max_abs_diff(losses, &want[..losses.len()]);
    eprintln!(
        "{label} vs {reference}: max |Δloss| over {} steps = {worst:e}",
        losses.len()
    );
    assert!(worst < tol, "{label}: {losses:?}\nvs {reference} {want:?}");
    worst
}

#[test]
fn tp2_matches_pytorch() {
    check("tp=2", &train(1, 2, 8, false, 20).losses, "tp_W2_G8", 1e-5);
}

#[test]
fn tp4_matches_pytorch() {
    check("tp=4", &train(1, 4, 8, false, 20).losses, "tp_W4_G8", 1e-5);
}

#[test]
fn sequence_parallel_equals_the_plain_plan() {
    for tp in [2, 4] {
        let plain = train(1, tp, 8, false, 20).losses;
        let sp = train(1, tp, 8, true, 20).losses;
        let d = max_abs_diff(&plain, &sp);
        eprintln!("tp={tp}: sequence parallel vs plain: max |Δloss| = {d:e}");
        assert!(d < 1e-5, "tp={tp}: {sp:?} vs {plain:?}");
        check(&format!("sp tp={tp}"), &sp, &format!("tp_W{tp}_G8"), 1e-5);
    }
}

#[test]
fn dp2_tp2_equals_single_g8() {
    check("dp=2 × tp=2", &train(2, 2, 8, false, 20).losses, "single_G8", 1e-5);
}
