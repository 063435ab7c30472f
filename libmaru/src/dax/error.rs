//! The one error type of the `dax` module.
//!
//! Every variant names the path it is about (where there is one) and the message
//! says what the operator can do, because these errors end up in front of a person
//! starting a daemon with the wrong flag or on the wrong host.

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

#[derive(Debug, thiserror::Error)]
pub enum DaxError {
    /// A system call on `path` failed; `op` says which step it was.
    #[error("{op} {path}: {err}")]
    Io {
        path: String,
        op: &'static str,
        #[source]
        err: io::Error,
    },
    /// `--dax PATH` names nothing.
    #[error(
        "DAX device {path} does not exist; check `daxctl list` on this host, \
         or on a host without CXL memory use --fake-dax PATH:SIZE instead of --dax"
    )]
    NoDevice { path: String },
    /// `--dax PATH` names something that is not a character device.
    #[error(
        "{path} is not a character device, so it is no devdax device; \
         for a file-backed pool use --fake-dax {path}:SIZE"
    )]
    NotCharDevice { path: String },
    /// A character device without the sysfs attributes of a devdax device.
    #[error(
        "{path} is a character device but not a devdax device ({detail}); \
         give a /dev/daxX.Y device (see `daxctl list`)"
    )]
    NotDaxDevice { path: String, detail: String },
    /// A file or device that does not exist (when reading a header).
    #[error("{path} does not exist")]
    NotFound { path: String },
    /// A fake DAX file that exists with another size than requested.
    #[error(
        "fake DAX file {path} exists with size {existing} bytes but {requested} were \
         asked for; give its size ({existing}) or remove the file to start a new pool"
    )]
    SizeMismatch {
        path: String,
        existing: u64,
        requested: u64,
    },
    /// A device or file too small for the header unit and one region.
    #[error(
        "{path} holds {size} bytes; a pool needs at least two alignment units of \
         {align} bytes (one for the header, one or more for regions)"
    )]
    TooSmall { path: String, size: u64, align: u64 },
    /// `--fake-dax PATH` names something other than a regular file.
    #[error(
        "{path} is not a regular file, so it cannot back a fake DAX pool; \
         for a devdax device use --dax {path}"
    )]
    NotRegularFile { path: String },
    /// An alignment that is not a power of two of at least a page.
    #[error("alignment {align} of {path} is not a power of two of at least the page size")]
    BadAlign { path: String, align: u64 },
    /// A fake DAX file whose first bytes are neither zero nor a Maru header.
    #[error(
        "{path} holds data that is not a Maru pool header; refusing to overwrite it \
         (remove the file or choose another path)"
    )]
    ForeignContent { path: String },
    /// A header with the Maru magic that cannot be read.
    #[error("device header{}: {problem}", of_path(path))]
    BadHeader {
        path: Option<String>,
        problem: HeaderProblem,
    },
    /// A command-line pool spec that does not parse.
    #[error("pool spec `{arg}`: {reason}")]
    BadSpec { arg: String, reason: String },
    /// A size string that does not parse.
    #[error(
        "size `{text}`: {reason} (give bytes, or a number with K, M, G or T, \
         binary, e.g. 4G or 512MiB)"
    )]
    BadSize { text: String, reason: String },
    /// A range whose offset or length is not a multiple of the alignment.
    #[error(
        "range at offset {offset} of length {length} of {path} is not aligned to \
         the device alignment of {align} bytes"
    )]
    Unaligned {
        path: String,
        offset: u64,
        length: u64,
        align: u64,
    },
    /// A range that is empty or reaches past the end of the device.
    #[error(
        "range at offset {offset} of length {length} is empty or does not fit in {path} \
         ({size} bytes)"
    )]
    OutOfRange {
        path: String,
        offset: u64,
        length: u64,
        size: u64,
    },
    /// Writable access asked of a read-only mapping.
    #[error("mapping of {path} is read-only; map it writable to write")]
    ReadOnly { path: String },
    /// Access asked of a mapping that was protected (quarantined).
    #[error("mapping of {path} is protected (quarantined) and no longer accessible")]
    Protected { path: String },
    /// The kernel's random source failed.
    #[error("cannot draw random bytes: {err}")]
    Random {
        #[source]
        err: io::Error,
    },
}

/// `" of PATH"` for a header read from `path`, nothing for one read from memory.
fn of_path(path: &Option<String>) -> String {
    path.as_ref()
        .map(|p| format!(" of {p}"))
        .unwrap_or_default()
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error as _;

    /// Every message, word for word: operators and scripts read them (they were
    /// written by hand before `thiserror`, and did not change with it).
    #[test]
    fn messages_are_pinned() {
        let p = || "/dev/dax0.0".to_string();
        let cases: Vec<(DaxError, &str)> = vec![
            (
                DaxError::io("/x", "open", io::Error::from(io::ErrorKind::NotFound)),
                "open /x: entity not found",
            ),
            (
                DaxError::NoDevice { path: p() },
                "DAX device /dev/dax0.0 does not exist; check `daxctl list` on this host, or on a host without CXL memory use --fake-dax PATH:SIZE instead of --dax",
            ),
            (
                DaxError::NotCharDevice { path: p() },
                "/dev/dax0.0 is not a character device, so it is no devdax device; for a file-backed pool use --fake-dax /dev/dax0.0:SIZE",
            ),
            (
                DaxError::NotDaxDevice { path: p(), detail: "no sysfs".into() },
                "/dev/dax0.0 is a character device but not a devdax device (no sysfs); give a /dev/daxX.Y device (see `daxctl list`)",
            ),
            (DaxError::NotFound { path: p() }, "/dev/dax0.0 does not exist"),
            (
                DaxError::SizeMismatch { path: p(), existing: 10, requested: 20 },
                "fake DAX file /dev/dax0.0 exists with size 10 bytes but 20 were asked for; give its size (10) or remove the file to start a new pool",
            ),
            (
                DaxError::TooSmall { path: p(), size: 1, align: 2 },
                "/dev/dax0.0 holds 1 bytes; a pool needs at least two alignment units of 2 bytes (one for the header, one or more for regions)",
            ),
            (
                DaxError::NotRegularFile { path: p() },
                "/dev/dax0.0 is not a regular file, so it cannot back a fake DAX pool; for a devdax device use --dax /dev/dax0.0",
            ),
            (
                DaxError::BadAlign { path: p(), align: 3 },
                "alignment 3 of /dev/dax0.0 is not a power of two of at least the page size",
            ),
            (
                DaxError::ForeignContent { path: p() },
                "/dev/dax0.0 holds data that is not a Maru pool header; refusing to overwrite it (remove the file or choose another path)",
            ),
            (
                DaxError::BadHeader {
                    path: Some(p()),
                    problem: HeaderProblem::Version { found: 9, reads: 1 },
                },
                "device header of /dev/dax0.0: header version 9 is not supported (this build reads version 1)",
            ),
            (
                DaxError::BadHeader {
                    path: None,
                    problem: HeaderProblem::Truncated { len: 1, need: 2 },
                },
                "device header: only 1 of 2 header bytes are present",
            ),
            (
                DaxError::BadSpec { arg: "a".into(), reason: "b".into() },
                "pool spec `a`: b",
            ),
            (
                DaxError::BadSize { text: "x".into(), reason: "y".into() },
                "size `x`: y (give bytes, or a number with K, M, G or T, binary, e.g. 4G or 512MiB)",
            ),
            (
                DaxError::Unaligned { path: p(), offset: 1, length: 2, align: 3 },
                "range at offset 1 of length 2 of /dev/dax0.0 is not aligned to the device alignment of 3 bytes",
            ),
            (
                DaxError::OutOfRange { path: p(), offset: 1, length: 2, size: 3 },
                "range at offset 1 of length 2 is empty or does not fit in /dev/dax0.0 (3 bytes)",
            ),
            (
                DaxError::ReadOnly { path: p() },
                "mapping of /dev/dax0.0 is read-only; map it writable to write",
            ),
            (
                DaxError::Protected { path: p() },
                "mapping of /dev/dax0.0 is protected (quarantined) and no longer accessible",
            ),
            (
                DaxError::Random { err: io::Error::from(io::ErrorKind::Interrupted) },
                "cannot draw random bytes: operation interrupted",
            ),
        ];
        for (e, want) in cases {
            assert_eq!(e.to_string(), want);
        }
    }

    /// The system error under an `Io` or `Random` is its source, not only its text.
    #[test]
    fn io_errors_are_sources() {
        let e = DaxError::io("/x", "open", io::Error::from(io::ErrorKind::NotFound));
        let src = e.source().expect("an io error's source");
        assert_eq!(src.to_string(), "entity not found");
        assert!(DaxError::NotFound { path: "/x".into() }.source().is_none());
    }
}
