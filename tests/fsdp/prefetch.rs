//! Explicit forward and backward prefetch changes only the order of the gathers:
//! the same collectives and the same losses as implicit prefetch.

use tessera::fsdp::FsdpConfig;
use tessera::models::FsdpUnits;

use crate::{Job, calls, reshard, train};

fn explicit(u: &FsdpUnits) {
    u.blocks[0].set_modules_to_forward_prefetch(&[&u.blocks[1]]);
    u.blocks[1].set_modules_to_backward_prefetch(&[&u.blocks[0]]);
}

#[test]
fn explicit_prefetch_changes_only_the_order() {
    for cfg in [FsdpConfig::default(), reshard(false)] {
        let implicit = train(&Job::fsdp(&[2], 8, 5, cfg.clone()));
        let set = train(&Job {
            setup: explicit,
            ..Job::fsdp(&[2], 8, 5, cfg.clone())
        });
        let bwd_gathers = if cfg.reshard_after_forward == Some(false) { 0 } else { 2 };
        for (s, (f, b)) in set.fwd.iter().zip(&set.bwd).enumerate() {
            assert_eq!(calls(f), (3, 0, 0, 0), "forward of step {s}: {f}");
            assert_eq!(calls(b), (bwd_gathers, 3, 0, 0), "backward of step {s}: {b}");
        }
        assert_eq!(set.fwd, implicit.fwd);
        assert_eq!(set.bwd, implicit.bwd);
        assert_eq!(set.losses, implicit.losses, "{cfg:?}");
    }
}
