//! DTensor ops against the single-device oracle: every op runs on meshes `[2]`,
//! `[4]` and `[2, 2]` with placements drawn per input (Replicate, Shard of each
//! dim, Partial(sum) for floats) and its `full_tensor()` is compared with the
//! local `Tensor` op on the full inputs; exact collective counts of the strategies
//! that must not communicate; and the errors ops report.
//!
//! Property cases: 32 per op and mesh by default, `PROPTEST_CASES` overrides.
//! Failures are saved under `target/proptest-regressions/` (out of git).

mod class_sharded;
mod contract;
mod counts;
mod empty;
mod errors;
mod harness;
mod nn;
mod pointwise;
mod select;
mod shape;
