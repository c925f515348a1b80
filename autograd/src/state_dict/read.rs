//! Reading a safetensors file without trusting it: the 8-byte header length and
//! the JSON header are checked against the file's size first, then only the
//! bytes the header declares are read. A corrupt length, a device such as
//! `/dev/zero` or a truncated file is an error before the data is read.
//! [`open_checked`] does the checking, for [`read_file`] (the whole file) and for
//! [`SafetensorsReader`](super::SafetensorsReader) (regions of its tensors).

use std::fs::File;
use std::io::Read;
use std::path::Path;

use safetensors::tensor::{Metadata, TensorInfo};

use crate::{Error, Result};

/// The largest JSON header accepted (the `safetensors` crate's own limit).
const MAX_HEADER_BYTES: u64 = 100_000_000;

/// The error for a file that is not valid safetensors: the path, what is wrong,
/// and what to do.
pub(super) fn invalid(path: &Path, detail: impl std::fmt::Display) -> Error {
    Error::StateDict(format!(
        "{}: not a valid safetensors file ({detail}); it may be truncated or corrupt, write it again",
        path.display()
    ))
}

/// The data bytes `metadata` declares, checked against the `size - 8 - n` bytes
/// a file of `size` bytes with an `n`-byte header holds after it. Each tensor's
/// byte span must be as long as its shape and dtype need, and the spans must
/// follow one another from byte 0 (the `safetensors` crate's rules). An error
/// names the first tensor at fault: its span, or where it is cut off, or the
/// bytes left over.
fn check_data_section(path: &Path, metadata: &Metadata, size: u64, n: u64) -> Result<u64> {
    let available = size - 8 - n;
    let mut spans: Vec<(usize, usize, String, &TensorInfo)> = metadata
        .tensors()
        .into_iter()
        .map(|(name, info)| (info.data_offsets.0, info.data_offsets.1, name, info))
        .collect();
    spans.sort_by(|a, b| (a.0, a.1, &a.2).cmp(&(b.0, b.1, &b.2)));
    let mut at = 0;
    for (start, end, name, info) in &spans {
        let need = info.shape.iter().try_fold(info.dtype.size(), |a, &b| a.checked_mul(b));
        if need != end.checked_sub(*start) {
            let need = need.map_or("more than usize::MAX".to_string(), |b| b.to_string());
            return Err(invalid(
                path,
                format!(
                    "tensor {name:?} is {:?} of shape {:?}, {need} bytes, but its header gives it bytes \
                     {start}..{end}",
                    info.dtype, info.shape
                ),
            ));
        }
        if *start != at {
            return Err(invalid(
                path,
                format!(
                    "tensor {name:?} starts at byte {start} of the data section, where the tensors before it \
                     end at {at}; tensors must follow one another"
                ),
            ));
        }
        at = *end;
    }
    let declared = at as u64;
    if let Some((start, end, name, _)) = spans.iter().find(|s| s.1 as u64 > available) {
        return Err(invalid(
            path,
            format!(
                "truncated: tensor {name:?} needs bytes {start}..{end} of the data section, but the file \
                 holds {available} data bytes after its {n}-byte header ({size} bytes in all; the header \
                 declares {declared})"
            ),
        ));
    }
    if declared < available {
        return Err(invalid(
            path,
            format!(
                "{} bytes follow the {declared} data bytes its header declares",
                available - declared
            ),
        ));
    }
    Ok(declared)
}

/// A safetensors file opened and checked against its size: a regular file, its
/// header parsed, every tensor's span consistent, the data section exactly as
/// long as the header declares. The cursor stands at the data section.
pub(super) struct Checked {
    /// The open file.
    pub(super) file: File,
    /// The JSON header, as the file holds it.
    pub(super) header: Vec<u8>,
    /// The parsed header.
    pub(super) metadata: Metadata,
    /// Where the data section starts: 8 + the header's length.
    pub(super) data_start: u64,
    /// The data section's length.
    pub(super) data_len: u64,
}

/// Opens the safetensors file at `path` and checks its length prefix, header
/// and data section against its size, reading only the prefix and the header.
///
/// # Errors
/// [`Error::Io`] when the file cannot be opened or read; [`Error::StateDict`]
/// naming the path for anything but a regular file, a header length past the end
/// of the file or above 100 MB, a header that is not a safetensors header, a
/// tensor whose byte span does not fit its shape and dtype or does not follow
/// the one before, a data section shorter than the header declares (the first
/// tensor cut off and the byte counts) or longer.
pub(super) fn open_checked(path: &Path) -> Result<Checked> {
    let io = |source| Error::Io {
        path: path.to_path_buf(),
        action: "cannot read",
        source,
    };
    let mut file = File::open(path).map_err(io)?;
    let meta = file.metadata().map_err(io)?;
    if !meta.is_file() {
        let kind = if meta.is_dir() {
            "a directory"
        } else {
            "a device, pipe or socket"
        };
        return Err(Error::StateDict(format!(
            "{}: not a regular file ({kind}); pass the path of a safetensors file",
            path.display()
        )));
    }
    let size = meta.len();
    if size < 8 {
        return Err(invalid(
            path,
            format!("the file holds {size} bytes, fewer than the 8 of the header length"),
        ));
    }
    let mut prefix = [0u8; 8];
    file.read_exact(&mut prefix).map_err(io)?;
    let n = u64::from_le_bytes(prefix);
    if n > size - 8 {
        return Err(invalid(
            path,
            format!("the header length is {n} bytes but only {} bytes follow it", size - 8),
        ));
    }
    if n > MAX_HEADER_BYTES {
        return Err(invalid(
            path,
            format!("the header length is {n} bytes, more than the {MAX_HEADER_BYTES} allowed"),
        ));
    }
    // At most MAX_HEADER_BYTES, so the cast is exact.
    let mut header = vec![0u8; n as usize];
    file.read_exact(&mut header).map_err(io)?;
    let metadata: Metadata = serde_json::from_slice(&header)
        .map_err(|e| invalid(path, format!("its {n}-byte header is not a safetensors header: {e}")))?;
    let data_len = check_data_section(path, &metadata, size, n)?;
    Ok(Checked {
        file,
        header,
        metadata,
        data_start: 8 + n,
        data_len,
    })
}

/// The whole of the safetensors file at `path` (length prefix, header and data),
/// after checking the header against the file's size ([`open_checked`]).
///
/// # Errors
/// As [`open_checked`], and [`Error::StateDict`] naming the path for a buffer
/// that cannot be allocated or a file that shrinks while it is read.
pub(super) fn read_file(path: &Path) -> Result<Vec<u8>> {
    let Checked {
        mut file,
        header,
        data_start,
        data_len,
        ..
    } = open_checked(path)?;
    // `data_start + data_len` is the size of the file, which exists, so it fits.
    let total = (data_start + data_len) as usize;
    let mut bytes = Vec::new();
    bytes.try_reserve_exact(total).map_err(|_| {
        Error::StateDict(format!(
            "{}: cannot allocate {total} bytes to read the file",
            path.display()
        ))
    })?;
    bytes.extend_from_slice(&(header.len() as u64).to_le_bytes());
    bytes.extend_from_slice(&header);
    (&mut file)
        .take(data_len)
        .read_to_end(&mut bytes)
        .map_err(|source| Error::Io {
            path: path.to_path_buf(),
            action: "cannot read",
            source,
        })?;
    if bytes.len() != total {
        return Err(invalid(
            path,
            format!(
                "truncated while reading: {} of {data_len} data bytes",
                bytes.len() - data_start as usize
            ),
        ));
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::super::tests::{TmpDir, bytes_read};
    use super::*;

    /// A file of `len` bytes (sparse: no disk) that starts with `head`.
    fn sparse(path: &Path, head: &[u8], len: u64) {
        let mut f = File::create(path).unwrap();
        std::io::Write::write_all(&mut f, head).unwrap();
        f.set_len(len).unwrap();
    }

    /// A header `json` with its length prefix (unpadded).
    fn headed(json: &str) -> Vec<u8> {
        let mut v = (json.len() as u64).to_le_bytes().to_vec();
        v.extend_from_slice(json.as_bytes());
        v
    }

    #[test]
    fn a_corrupt_header_is_rejected_before_the_data_is_read() {
        let dir = TmpDir::new("read-header");
        let path = dir.0.join("big.safetensors");
        let gib = 1u64 << 30;
        let before = bytes_read();
        for (case, head, needle) in [
            (
                "length past the end",
                b"garbage!".to_vec(),
                "only 1073741816 bytes follow it",
            ),
            (
                "length 2^40",
                (1u64 << 40).to_le_bytes().to_vec(),
                "the header length is 1099511627776",
            ),
            (
                "length over the limit",
                (200_000_000u64).to_le_bytes().to_vec(),
                "more than the 100000000 allowed",
            ),
            (
                "not json",
                headed("{not json"),
                "its 9-byte header is not a safetensors header",
            ),
            (
                "bad offsets",
                headed(r#"{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,"x"]}}"#),
                "header is not a safetensors header",
            ),
        ] {
            sparse(&path, &head, gib);
            let err = read_file(&path).unwrap_err().to_string();
            assert!(
                err.contains("big.safetensors: not a valid safetensors file"),
                "{case}: {err}"
            );
            assert!(err.contains(needle), "{case}: {err} lacks {needle:?}");
        }
        if let (Some(before), Some(after)) = (before, bytes_read()) {
            assert!(after - before < 1 << 20, "read {} bytes of 5 GiB files", after - before);
        }
    }

    #[test]
    fn a_device_or_directory_is_rejected() {
        macro_rules! case {
            ($path:expr, $needle:expr) => {
                let err = read_file(Path::new($path)).unwrap_err().to_string();
                assert!(err.contains($needle), "{err} lacks {:?}", $needle);
            };
        }
        #[cfg(unix)]
        case!("/dev/zero", "/dev/zero: not a regular file (a device, pipe or socket)");
        let dir = TmpDir::new("read-dir");
        case!(&dir.0, "not a regular file (a directory)");
        case!(&dir.0.join("missing"), "missing: cannot read");
    }

    #[test]
    fn truncated_and_overlong_data_name_the_tensor_and_counts() {
        let dir = TmpDir::new("read-truncated");
        let path = dir.0.join("t.safetensors");
        let json = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F64","shape":[4],"data_offsets":[8,40]}}"#;
        let whole = [headed(json), vec![0u8; 40]].concat();
        let h = headed(json).len();
        macro_rules! case {
            ($len:expr, ok) => {
                std::fs::write(&path, &whole[..$len]).unwrap();
                assert_eq!(read_file(&path).unwrap(), whole);
            };
            ($bytes:expr, $needle:expr) => {
                std::fs::write(&path, $bytes).unwrap();
                let err = read_file(&path).unwrap_err().to_string();
                assert!(
                    err.contains("t.safetensors: not a valid safetensors file"),
                    "{err}"
                );
                assert!(err.contains($needle), "{err} lacks {:?}", $needle);
            };
        }
        case!(whole.len(), ok);
        case!(
            &whole[..h + 20],
            "truncated: tensor \"b\" needs bytes 8..40 of the data section, but the file holds 20 data bytes"
        );
        case!(&whole[..h + 4], "truncated: tensor \"a\" needs bytes 0..8");
        case!(
            &whole[..h],
            "holds 0 data bytes after its 108-byte header (116 bytes in all; the header declares 40)"
        );
        case!(
            [&whole[..], b"tail"].concat(),
            "4 bytes follow the 40 data bytes its header declares"
        );
        case!(
            &whole[..5],
            "the file holds 5 bytes, fewer than the 8 of the header length"
        );
    }
}
