//! `FsdpModule::comm_overlap`: every unit's all-gathers, reduce-scatters and
//! HSDP all-reduces are counted once each as they are waited for (the counts
//! match the mesh's own collective counters, and follow the reshard knob), the
//! times of each kind are consistent (hidden within the run, hidden plus
//! exposed covering it), a reset starts over, and a one-rank shard dim, which
//! runs nothing asynchronously, counts nothing.

use std::time::Duration;

use tessera::autograd::backward;
use tessera::fsdp::{CollectiveTimes, CommOverlap, FsdpConfig, FsdpModule};
use tessera::models::FsdpUnits;
use tessera::{DeviceMesh, launch};

use crate::common::{tiny_model, tokens};
use crate::{TestResult, batch, calls};

/// Rank-local consistency of one kind's times.
fn check_times(what: &str, t: &CollectiveTimes) {
    assert!(
        t.hidden <= t.run,
        "{what}: hidden {:?} beyond the run {:?}",
        t.hidden,
        t.run
    );
    assert!(
        t.hidden + t.exposed >= t.run,
        "{what}: hidden {:?} and exposed {:?} do not cover the run {:?}",
        t.hidden,
        t.exposed,
        t.run
    );
    match t.hidden_fraction() {
        Some(f) => assert!((0.0..=1.0).contains(&f), "{what}: hidden fraction {f}"),
        None => assert_eq!(t.run, Duration::ZERO, "{what}: no fraction for a run"),
    }
    if t.count == 0 {
        assert_eq!(
            (t.run, t.exposed, t.hidden),
            (Duration::ZERO, Duration::ZERO, Duration::ZERO),
            "{what}"
        );
    }
}

/// Per unit (root first): (all-gathers, reduce-scatters, all-reduces) counted.
fn counts(units: &FsdpUnits) -> Vec<(u64, u64, u64)> {
    let all: Vec<&FsdpModule> = std::iter::once(&units.root).chain(&units.blocks).collect();
    all.iter()
        .enumerate()
        .map(|(i, u)| {
            let o = u.comm_overlap();
            for (kind, t) in [
                ("all-gather", &o.all_gather),
                ("reduce-scatter", &o.reduce_scatter),
                ("all-reduce", &o.all_reduce),
            ] {
                check_times(&format!("unit {i} {kind}"), t);
            }
            (o.all_gather.count, o.reduce_scatter.count, o.all_reduce.count)
        })
        .collect()
}

fn reset(units: &FsdpUnits) {
    units.root.reset_comm_overlap();
    units.blocks.iter().for_each(FsdpModule::reset_comm_overlap);
}

/// One training step's forward and backward on `mesh`.
fn step(
    model: &tessera::models::Transformer,
    mesh: &DeviceMesh,
    toks: &tessera::dtensor::Tensor,
    s: usize,
) -> TestResult<()> {
    let loss = model.loss(&batch(toks, s, 0..8, mesh)?)?;
    backward(&loss)?;
    Ok(())
}

#[test]
fn every_units_collectives_are_counted_once_each() {
    let toks = tokens();
    launch(2, move |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), &[2])?;
        let model = tiny_model(&mesh)?;
        let units = model.fully_shard(&mesh, &FsdpConfig::default())?;
        assert_eq!(counts(&units), vec![(0, 0, 0); 3], "before any step");
        let rows = batch(&toks, 0, 0..8, &mesh)?;
        let before = mesh.stats();
        backward(&model.loss(&rows)?)?;
        let c = mesh.stats() - before;
        // Blocks gather in forward and again in backward (resharded after
        // forward); the root keeps its parameters from forward to backward.
        let got = counts(&units);
        assert_eq!(got, vec![(1, 1, 0), (2, 1, 0), (2, 1, 0)], "one step");
        let (ag, rs, ar, _) = calls(&c);
        let sum = |f: fn(&(u64, u64, u64)) -> u64| got.iter().map(f).sum::<u64>();
        assert_eq!(
            (sum(|x| x.0), sum(|x| x.1), sum(|x| x.2)),
            (ag, rs, ar),
            "the units' counts against the mesh's collective counters: {c}"
        );
        // Two more steps add up.
        step(&model, &mesh, &toks, 1)?;
        step(&model, &mesh, &toks, 2)?;
        assert_eq!(counts(&units), vec![(3, 3, 0), (6, 3, 0), (6, 3, 0)], "three steps");
        // A reset starts over; kept after forward, the blocks gather once a step.
        reset(&units);
        assert_eq!(units.root.comm_overlap(), CommOverlap::default(), "after a reset");
        units.root.set_reshard_after_forward(false);
        step(&model, &mesh, &toks, 3)?;
        assert_eq!(
            counts(&units),
            vec![(1, 1, 0), (1, 1, 0), (1, 1, 0)],
            "kept after forward"
        );
        Ok(())
    })
    .unwrap();
}

#[test]
fn hsdp_counts_its_all_reduces_and_one_rank_counts_nothing() {
    let toks = tokens();
    launch(4, move |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), &[2, 2])?;
        let model = tiny_model(&mesh)?;
        let units = model.fully_shard(&mesh, &FsdpConfig::default())?;
        step(&model, &mesh, &toks, 0)?;
        assert_eq!(
            counts(&units),
            vec![(1, 1, 1), (2, 1, 1), (2, 1, 1)],
            "HSDP 2x2, one step"
        );
        Ok(())
    })
    .unwrap();
    // A shard dim of one rank: its buckets are the local tensors, nothing runs
    // on a communication thread, nothing is counted.
    let toks = tokens();
    launch(2, move |ctx| {
        let mesh = DeviceMesh::new(ctx.into_comm(), &[2, 1])?;
        let model = tiny_model(&mesh)?;
        let units = model.fully_shard(&mesh, &FsdpConfig::default())?;
        step(&model, &mesh, &toks, 0)?;
        let got = counts(&units);
        assert!(
            got.iter().all(|&(g, r, _)| (g, r) == (0, 0)),
            "a one-rank shard dim: {got:?}"
        );
        assert!(
            got.iter().all(|&(_, _, a)| a == 1),
            "its all-reduces over the replicate dim: {got:?}"
        );
        Ok(())
    })
    .unwrap();
}
