//! Sharded checkpoints of DTensors (`tessera::dtensor::checkpoint`): saved on one
//! mesh and layout, loaded onto any other (property test), each rank reading only
//! its bytes and one replica writing each chunk; atomic replacement; and the
//! errors of missing, truncated or corrupt files; model and optimizer checkpoints
//! that resume a run bitwise on its mesh and within 1e-6 on others.
//!
//! Property cases: 48 by default, `PROPTEST_CASES` overrides. Fuzz and fault
//! campaign cases: 300 by default, `TESSERA_FUZZ_CASES` overrides.

#[path = "../common/mod.rs"]
mod common;

mod dtensors;
mod errors;
mod fuzz;
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

/// Copies the files of `from` into a fresh `to`.
pub fn copy_dir(from: &Path, to: &Path) {
    let _ = std::fs::remove_dir_all(to);
    std::fs::create_dir_all(to).unwrap();
    for f in files_in(from) {
        std::fs::copy(from.join(&f), to.join(&f)).unwrap();
    }
}

/// The number of fuzz cases: `TESSERA_FUZZ_CASES`, or 300.
///
/// # Panics
/// A value that is not a whole number (failing the test that asked).
pub fn fuzz_cases() -> usize {
    cases_from(std::env::var("TESSERA_FUZZ_CASES")).unwrap_or_else(|e| panic!("{e}"))
}

/// The number of fuzz cases a value of `TESSERA_FUZZ_CASES` asks for.
fn cases_from(v: Result<String, std::env::VarError>) -> Result<usize, String> {
    let hint = "give a whole number of cases, e.g. TESSERA_FUZZ_CASES=5000";
    match v {
        Err(std::env::VarError::NotPresent) => Ok(300),
        Ok(v) => v
            .trim()
            .parse()
            .map_err(|e| format!("TESSERA_FUZZ_CASES={v:?}: {e}; {hint}")),
        Err(e) => Err(format!("TESSERA_FUZZ_CASES: {e}; {hint}")),
    }
}

#[test]
fn fuzz_case_counts() {
    use std::env::VarError::NotPresent;
    assert_eq!(cases_from(Err(NotPresent)), Ok(300));
    assert_eq!(cases_from(Ok("5000".into())), Ok(5000));
    assert_eq!(cases_from(Ok(" 7\n".into())), Ok(7));
    for bad in ["", "lots", "-1", "1e3", "3.5"] {
        let e = cases_from(Ok(bad.into())).unwrap_err();
        assert!(
            e.starts_with(&format!("TESSERA_FUZZ_CASES={bad:?}")) && e.contains("whole number"),
            "{e}"
        );
    }
}

/// xorshift64*: a small deterministic generator for the fuzz cases.
pub struct Rng(pub u64);

impl Rng {
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A number in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }
}
