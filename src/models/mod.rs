//! Reference models.

mod transformer;

pub use transformer::{Block, FsdpUnits, Transformer, TransformerConfig};
