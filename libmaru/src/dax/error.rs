//! The one error type of the `dax` module.
//!
//! Every variant names the path it is about (where there is one) and the message
//! says what the operator can do, because these errors end up in front of a person
//! starting a daemon with the wrong flag or on the wrong host.

use std::fmt;
use std::io;

/// What is wrong with a device header that carries the Maru magic.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeaderProblem {
    /// Fewer bytes than a whole header.
    #[error("only {len} of {need} header bytes are present")]
    Truncated { len: usize, need: usize },
    /// A header of a version this build does not read (it reads `reads`).
    #[error("header version {found} is not supported (this build reads version {reads})")]
    Version { found: u32, reads: u32 },
}

#[derive(Debug)]
pub enum DaxError {
    /// A system call on `path` failed; `op` says which step it was.
    Io {
        path: String,
        op: &'static str,
        err: io::Error,
    },
    /// `--dax PATH` names nothing.
    NoDevice { path: String },
    /// `--dax PATH` names something that is not a character device.
    NotCharDevice { path: String },
    /// A character device without the sysfs attributes of a devdax device.
    NotDaxDevice { path: String, detail: String },
    /// A file or device that does not exist (when reading a header).
    NotFound { path: String },
    /// A fake DAX file that exists with another size than requested.
    SizeMismatch {
        path: String,
        existing: u64,
        requested: u64,
    },
    /// A device or file too small for the header unit and one region.
    TooSmall { path: String, size: u64, align: u64 },
    /// `--fake-dax PATH` names something other than a regular file.
    NotRegularFile { path: String },
    /// An alignment that is not a power of two of at least a page.
    BadAlign { path: String, align: u64 },
    /// A fake DAX file whose first bytes are neither zero nor a Maru header.
    ForeignContent { path: String },
    /// A header with the Maru magic that cannot be read.
    BadHeader {
        path: Option<String>,
        problem: HeaderProblem,
    },
    /// A command-line pool spec that does not parse.
    BadSpec { arg: String, reason: String },
    /// A size string that does not parse.
    BadSize { text: String, reason: String },
    /// A range whose offset or length is not a multiple of the alignment.
    Unaligned {
        path: String,
        offset: u64,
        length: u64,
        align: u64,
    },
    /// A range that is empty or reaches past the end of the device.
    OutOfRange {
        path: String,
        offset: u64,
        length: u64,
        size: u64,
    },
    /// Writable access asked of a read-only mapping.
    ReadOnly { path: String },
    /// Access asked of a mapping that was protected (quarantined).
    Protected { path: String },
    /// The kernel's random source failed.
    Random { err: io::Error },
}

impl DaxError {
    pub(crate) fn io(path: &str, op: &'static str, err: io::Error) -> DaxError {
        DaxError::Io {
            path: path.to_string(),
            op,
            err,
        }
    }
}

impl fmt::Display for DaxError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DaxError::Io { path, op, err } => write!(f, "{op} {path}: {err}"),
            DaxError::NoDevice { path } => write!(
                f,
                "DAX device {path} does not exist; check `daxctl list` on this host, \
                 or on a host without CXL memory use --fake-dax PATH:SIZE instead of --dax"
            ),
            DaxError::NotCharDevice { path } => write!(
                f,
                "{path} is not a character device, so it is no devdax device; \
                 for a file-backed pool use --fake-dax {path}:SIZE"
            ),
            DaxError::NotDaxDevice { path, detail } => write!(
                f,
                "{path} is a character device but not a devdax device ({detail}); \
                 give a /dev/daxX.Y device (see `daxctl list`)"
            ),
            DaxError::NotFound { path } => write!(f, "{path} does not exist"),
            DaxError::SizeMismatch {
                path,
                existing,
                requested,
            } => write!(
                f,
                "fake DAX file {path} exists with size {existing} bytes but {requested} were \
                 asked for; give its size ({existing}) or remove the file to start a new pool"
            ),
            DaxError::TooSmall { path, size, align } => write!(
                f,
                "{path} holds {size} bytes; a pool needs at least two alignment units of \
                 {align} bytes (one for the header, one or more for regions)"
            ),
            DaxError::NotRegularFile { path } => write!(
                f,
                "{path} is not a regular file, so it cannot back a fake DAX pool; \
                 for a devdax device use --dax {path}"
            ),
            DaxError::BadAlign { path, align } => write!(
                f,
                "alignment {align} of {path} is not a power of two of at least the page size"
            ),
            DaxError::ForeignContent { path } => write!(
                f,
                "{path} holds data that is not a Maru pool header; refusing to overwrite it \
                 (remove the file or choose another path)"
            ),
            DaxError::BadHeader { path, problem } => match path {
                Some(p) => write!(f, "device header of {p}: {problem}"),
                None => write!(f, "device header: {problem}"),
            },
            DaxError::BadSpec { arg, reason } => write!(f, "pool spec `{arg}`: {reason}"),
            DaxError::BadSize { text, reason } => write!(
                f,
                "size `{text}`: {reason} (give bytes, or a number with K, M, G or T, \
                 binary, e.g. 4G or 512MiB)"
            ),
            DaxError::Unaligned {
                path,
                offset,
                length,
                align,
            } => write!(
                f,
                "range at offset {offset} of length {length} of {path} is not aligned to \
                 the device alignment of {align} bytes"
            ),
            DaxError::OutOfRange {
                path,
                offset,
                length,
                size,
            } => write!(
                f,
                "range at offset {offset} of length {length} is empty or does not fit in {path} \
                 ({size} bytes)"
            ),
            DaxError::ReadOnly { path } => {
                write!(
                    f,
                    "mapping of {path} is read-only; map it writable to write"
                )
            }
            DaxError::Protected { path } => write!(
                f,
                "mapping of {path} is protected (quarantined) and no longer accessible"
            ),
            DaxError::Random { err } => write!(f, "cannot draw random bytes: {err}"),
        }
    }
}

impl std::error::Error for DaxError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            DaxError::Io { err, .. } | DaxError::Random { err } => Some(err),
            _ => None,
        }
    }
}
