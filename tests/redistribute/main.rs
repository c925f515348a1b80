//! Redistribution on the threads backend: property tests over random meshes,
//! shapes, placements (Partial included) and shard orders; plan tables for named
//! cases; and the errors redistribute and `from_local` report.
//!
//! Property cases: 256 each by default, `PROPTEST_CASES` overrides. Failures are
//! saved under `target/proptest-regressions/` (out of git) and replayed first.

mod bucket;
mod errors;
mod harness;
mod oracle;
mod props;
mod tables;
