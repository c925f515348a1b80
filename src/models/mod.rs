//! Reference models.

mod transformer;

pub use transformer::{Attention, Block, FeedForward, FsdpUnits, Transformer, TransformerConfig};
