//! Reference models.

mod transformer;

pub use transformer::{Block, Transformer, TransformerConfig};
