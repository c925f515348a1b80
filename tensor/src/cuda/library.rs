//! The CUDA libraries: each checked before cudarc loads it (cudarc panics when
//! one is missing; this gives an error naming the library and the fix), and
//! the error of a failed call.

use std::collections::HashMap;
use std::ffi::CString;
use std::fmt::Display;
use std::sync::{LazyLock, Mutex, PoisonError};

use crate::{Error, Result};

/// An [`Error::Device`] for a failed CUDA call.
pub(crate) fn cuda_error(op: &'static str, e: impl Display) -> Error {
    Error::Device {
        op,
        detail: format!("CUDA call failed: {e}"),
    }
}

/// Errors unless the CUDA library `lib` (`cuda`, `nvrtc`, `cublas`, `nccl`) can
/// be loaded under one of the names cudarc tries.
pub(crate) fn check_library(lib: &'static str) -> Result<()> {
    static SEEN: LazyLock<Mutex<HashMap<&'static str, bool>>> = LazyLock::new(Default::default);
    let mut seen = SEEN.lock().unwrap_or_else(PoisonError::into_inner);
    let names = cudarc::get_lib_name_candidates(lib);
    let found = *seen.entry(lib).or_insert_with(|| {
        names.iter().any(|name| {
            let Ok(c) = CString::new(name.as_str()) else {
                return false;
            };
            // SAFETY: `c` is a valid C string; the handle is closed at once (cudarc
            // opens the library again itself).
            unsafe {
                let handle = libc::dlopen(c.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL);
                if handle.is_null() {
                    false
                } else {
                    libc::dlclose(handle);
                    true
                }
            }
        })
    });
    if found {
        return Ok(());
    }
    let what = match lib {
        "cuda" => "the NVIDIA driver's libcuda (is there a GPU and its driver?)",
        "nvrtc" => "NVRTC, CUDA's run-time compiler (pip's nvidia-cuda-nvrtc wheel has it)",
        "cublas" => "cuBLAS (pip's nvidia-cublas wheel has it)",
        "nccl" => "NCCL (pip's nvidia-nccl-cu13 wheel has it)",
        _ => "a CUDA library",
    };
    Err(Error::Device {
        op: "cuda",
        detail: format!(
            "cannot load {what}: none of {names:?} is on the library path; \
             put the folder that holds it on LD_LIBRARY_PATH"
        ),
    })
}
