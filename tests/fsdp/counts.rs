//! Collectives per step (calls and bytes of all_gather, reduce_scatter,
//! all_reduce) of FSDP, HSDP, bf16 gathers and gradient accumulation.

use tessera::fsdp::FsdpConfig;
use tessera::mesh::OpKind;
use tessera::models::{FsdpUnits, UnitLayout};

use crate::accumulation::accumulate;
use crate::{Job, Run, bf16, calls, reshard, train};

/// Checks every step of `run`: forward and backward (all_gather,
/// reduce_scatter, all_reduce, other) calls.
fn check(label: &str, run: &Run, fwd: (u64, u64, u64, u64), bwd: (u64, u64, u64, u64)) {
    println!("counts {label:<22}: forward {} | backward {}", run.fwd[1], run.bwd[1]);
    for (s, (f, b)) in run.fwd.iter().zip(&run.bwd).enumerate() {
        assert_eq!(calls(f), fwd, "{label}: forward of step {s}: {f}");
        assert_eq!(calls(b), bwd, "{label}: backward of step {s}: {b}");
    }
}

/// Bytes this rank sends per all-gather round of every unit: `(W−1)/W` of the
/// gathered `[W, bucket]` buffer.
fn gather_bytes(run: &Run, world: u64, gather_size: usize, master_size: usize) -> u64 {
    run.sharded_bytes
        .iter()
        .map(|&b| (world - 1) * (b / master_size * gather_size) as u64)
        .sum()
}

fn no_reshard_setter(u: &FsdpUnits) {
    u.root.set_reshard_after_forward(false);
}

#[test]
fn fsdp_reshard_after_forward() {
    let run = train(&Job::fsdp(&[2], 8, 5, FsdpConfig::default()));
    // Three units: forward gathers each; backward gathers the two blocks again
    // (the root keeps its parameters) and reduce-scatters all three.
    check("FSDP W2", &run, (3, 0, 0, 0), (2, 3, 0, 0));
    let all = gather_bytes(&run, 2, 4, 4);
    assert_eq!(run.fwd[1].bytes(OpKind::AllGather), all);
    let root = run.sharded_bytes[2] as u64;
    assert_eq!(run.bwd[1].bytes(OpKind::AllGather), all - root);
    assert_eq!(run.bwd[1].bytes(OpKind::ReduceScatter), all);
}

/// `UnitLayout::SplitEnds`: the embeddings and the final norm with the head
/// are units of their own and the root holds nothing: forward gathers four
/// units, backward the blocks and the embeddings again (the head is kept from
/// its forward, which its backward follows at once) and reduce-scatters all
/// four, moving the bytes the blocks-and-root layout moves plus the
/// embeddings' second gather; the losses are those of that layout, bit for bit.
#[test]
fn fsdp_split_ends() {
    let blocks = train(&Job::fsdp(&[2], 8, 5, FsdpConfig::default()));
    let run = train(&Job {
        units: UnitLayout::SplitEnds,
        ..Job::fsdp(&[2], 8, 5, FsdpConfig::default())
    });
    check("FSDP W2 split ends", &run, (4, 0, 0, 0), (3, 4, 0, 0));
    assert_eq!(run.losses, blocks.losses, "the same training, other units");
    // Units: two blocks, the embeddings, the head, the (empty) root.
    assert_eq!(run.sharded_bytes.len(), 5);
    assert_eq!(run.sharded_bytes[4], 0, "the root keeps no parameters");
    let all = gather_bytes(&run, 2, 4, 4);
    assert_eq!(all, gather_bytes(&blocks, 2, 4, 4), "the same parameters, other units");
    assert_eq!(run.fwd[1].bytes(OpKind::AllGather), all);
    let head = run.sharded_bytes[3] as u64;
    assert_eq!(run.bwd[1].bytes(OpKind::AllGather), all - head);
    assert_eq!(run.bwd[1].bytes(OpKind::ReduceScatter), all);
}

#[test]
fn fsdp_keep_after_forward() {
    // Kept after forward (by config or by the recursive setter), every unit
    // still reshards after backward: the next forward gathers all three.
    let run = train(&Job::fsdp(&[2], 8, 5, reshard(false)));
    check("FSDP W2 no reshard", &run, (3, 0, 0, 0), (0, 3, 0, 0));
    let setter = train(&Job {
        setup: no_reshard_setter,
        ..Job::fsdp(&[2], 8, 5, FsdpConfig::default())
    });
    check("FSDP W2 setter", &setter, (3, 0, 0, 0), (0, 3, 0, 0));
    assert_eq!(setter.losses, run.losses);
}

#[test]
fn hsdp() {
    let run = train(&Job::fsdp(&[2, 2], 16, 5, FsdpConfig::default()));
    check("HSDP 2x2", &run, (3, 0, 0, 0), (2, 3, 3, 0));
    let run = train(&Job::fsdp(&[2, 2], 16, 5, reshard(false)));
    check("HSDP 2x2 no reshard", &run, (3, 0, 0, 0), (0, 3, 3, 0));
}

#[test]
fn bf16_gathers_half_the_bytes() {
    let f32_run = train(&Job::fsdp(&[2], 8, 3, FsdpConfig::default()));
    let bf16_run = train(&Job::fsdp(&[2], 8, 3, bf16()));
    check("FSDP W2 bf16", &bf16_run, (3, 0, 0, 0), (2, 3, 0, 0));
    for s in 0..3 {
        let (a, b) = (&f32_run, &bf16_run);
        assert_eq!(2 * b.fwd[s].bytes(OpKind::AllGather), a.fwd[s].bytes(OpKind::AllGather));
        assert_eq!(2 * b.bwd[s].bytes(OpKind::AllGather), a.bwd[s].bytes(OpKind::AllGather));
        // Gradients are reduced in f32 either way.
        assert_eq!(
            b.bwd[s].bytes(OpKind::ReduceScatter),
            a.bwd[s].bytes(OpKind::ReduceScatter)
        );
    }
    assert_eq!(
        bf16_run.fwd[0].bytes(OpKind::AllGather),
        gather_bytes(&bf16_run, 2, 2, 4)
    );
    println!(
        "counts all_gather bytes per forward: f32 {} B, bf16 {} B",
        f32_run.fwd[0].bytes(OpKind::AllGather),
        bf16_run.fwd[0].bytes(OpKind::AllGather)
    );
}

/// Three micro-batches, gradient sync off for the first two.
#[test]
fn accumulation() {
    for (shape, g, ar) in [(&[2][..], 4, 0), (&[2, 2][..], 4, 3)] {
        let acc = accumulate(shape, g, 1, |_| {});
        let c = &acc.counts[0];
        println!(
            "counts accumulation {shape:?}: micro-batches {} | {} | {}",
            c[0], c[1], c[2]
        );
        assert_eq!(calls(&c[0]), (5, 0, 0, 0), "micro-batch 1 of {shape:?}: {}", c[0]);
        assert_eq!(calls(&c[1]), (5, 0, 0, 0), "micro-batch 2 of {shape:?}: {}", c[1]);
        assert_eq!(calls(&c[2]), (5, 3, ar, 0), "micro-batch 3 of {shape:?}: {}", c[2]);
    }
}
