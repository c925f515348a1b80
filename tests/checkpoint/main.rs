//! Sharded checkpoints of DTensors (`tessera::dtensor::checkpoint`): saved on one
//! mesh and layout, loaded onto any other (property test), each rank reading only
//! its bytes and one replica writing each chunk; atomic replacement; and the
//! errors of missing, truncated or corrupt files; model and optimizer checkpoints
//! that resume a run bitwise on its mesh and within 1e-6 on others.
//!
//! Property cases: 48 by default, `PROPTEST_CASES` overrides.

#[path = "../common/mod.rs"]
mod common;

mod dtensors;
mod errors;
mod fuzz_state_dict;
mod one_rank;
mod resume;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

/// A fresh directory path under the system's temporary directory (not created).
pub fn scratch(tag: &str) -> PathBuf {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    std::env::temp_dir().join(format!("tessera-ckpt-{tag}-{}-{n}", std::process::id()))
}

/// Removes `dir` (and its temporary sibling) when dropped.
pub struct Cleanup(pub PathBuf);

impl Drop for Cleanup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The files in `dir`, sorted.
pub fn files_in(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}
