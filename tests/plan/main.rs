//! Planning runs: a training step on meta tensors (shapes, no values) measures
//! the memory and the collectives of the same step on real tensors.

mod modules;
mod step;
