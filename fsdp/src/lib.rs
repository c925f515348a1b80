//! Placeholder crate; filled by later work.
