//! Autograd on the threads backend: every op's gradient against finite
//! differences; gradients of sharded runs against the single-rank run; the
//! placement, accumulation and no-grad rules of gradients; and activation
//! checkpointing (same gradients, fewer bytes held after forward).
//!
//! Property cases: 24 by default, `PROPTEST_CASES` overrides. Failures are saved
//! under `target/proptest-regressions/` (out of git).

mod attention;
mod checkpointing;
mod dropout;
mod gradcheck;
mod harness;
mod loss_parallel;
mod rules;
mod sharded;
