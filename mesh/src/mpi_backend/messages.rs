//! Texts MPI gives (its error strings, the library's version) and the way out of
//! a failed job: print why, then end every process with `MPI_Abort`.

use std::io::Write;
use std::os::raw::{c_char, c_int};

use mpi::ffi;

/// The first `len` characters MPI wrote into `buf`, as trimmed text.
fn mpi_text(buf: &[c_char], len: c_int) -> String {
    let bytes: Vec<u8> = buf[..usize::try_from(len).unwrap_or(0).min(buf.len())]
        .iter()
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).trim().to_string()
}

/// The MPI library's version string (`MPI_Get_library_version`).
pub(super) fn library_version() -> String {
    let mut buf = vec![0 as c_char; 8192];
    let mut len: c_int = 0;
    // SAFETY: the buffer is larger than MPI_MAX_LIBRARY_VERSION_STRING.
    unsafe { ffi::MPI_Get_library_version(buf.as_mut_ptr(), &mut len) };
    mpi_text(&buf, len)
}

/// The text of an MPI error code.
pub(super) fn error_string(code: c_int) -> String {
    let mut buf = vec![0 as c_char; 1024];
    let mut len: c_int = 0;
    // SAFETY: the buffer is larger than MPI_MAX_ERROR_STRING.
    let rc = unsafe { ffi::MPI_Error_string(code, buf.as_mut_ptr(), &mut len) };
    if rc != 0 {
        return format!("MPI error code {code}");
    }
    format!("{} (MPI error code {code})", mpi_text(&buf, len))
}

/// Prints why and ends every process of the job.
pub(super) fn abort(world_rank: usize, why: &str) -> ! {
    abort_with(world_rank, why, &[])
}

/// Prints why, then each line of `details`, and ends every process of the job.
pub(super) fn abort_with(world_rank: usize, why: &str, details: &[String]) -> ! {
    let mut text = format!("tessera: rank {world_rank} {why}; aborting the MPI job\n");
    for d in details {
        text += &format!("tessera: rank {world_rank}: {d}\n");
    }
    write_stderr(&text);
    // SAFETY: MPI is initialised (only called after `runtime()` succeeded).
    unsafe { ffi::MPI_Abort(ffi::RSMPI_COMM_WORLD, 1) };
    // MPI_Abort does not return on any implementation we know; make sure.
    std::process::exit(1)
}

/// Writes `text` to stderr in one call (lines of several ranks interleave less).
pub(super) fn write_stderr(text: &str) {
    let _ = std::io::stderr().lock().write_all(text.as_bytes());
}
