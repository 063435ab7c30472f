//! Pool specs as given on the command line: `--dax /dev/daxX.Y` and
//! `--fake-dax PATH:SIZE`.
//!
//! Parsing is separate from opening so that a daemon rejects a bad flag before it
//! touches any device, and so that the parsers can be fuzzed without files.

use std::fmt;

use super::error::DaxError;
use super::{is_aligned, DEFAULT_ALIGN};

/// Where a pool lives, as the operator named it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PoolSpec {
    /// A devdax character device (`/dev/daxX.Y`) of CXL memory.
    DevDax { path: String },
    /// A regular file standing in for a DAX device (tmpfs, e.g. `/dev/shm`), for
    /// hosts without CXL memory.
    FakeDax { path: String, size: u64 },
}

impl PoolSpec {
    /// Parses the value of `--dax`.
    pub fn parse_dax(arg: &str) -> Result<PoolSpec, DaxError> {
        check_path(arg, arg)?;
        Ok(PoolSpec::DevDax {
            path: arg.to_string(),
        })
    }

    /// Parses the value of `--fake-dax`: `PATH:SIZE`, split at the last `:` so
    /// that paths may contain colons.
    ///
    /// The size must be a multiple of 2 MiB (the alignment of fake pools) and hold
    /// at least two such units: one for the header and one for a region.
    pub fn parse_fake_dax(arg: &str) -> Result<PoolSpec, DaxError> {
        let bad = |reason: String| DaxError::BadSpec {
            arg: arg.to_string(),
            reason,
        };
        let (path, size) = arg.rsplit_once(':').ok_or_else(|| {
            bad("missing size; write PATH:SIZE, e.g. /dev/shm/maru-pool0:4G".into())
        })?;
        check_path(arg, path)?;
        if size.trim().is_empty() {
            return Err(bad(
                "missing size; write PATH:SIZE, e.g. /dev/shm/maru-pool0:4G".into(),
            ));
        }
        let size = parse_size(size).map_err(|e| bad(e.to_string()))?;
        if size == 0 {
            return Err(bad("size is zero".into()));
        }
        if !is_aligned(size, DEFAULT_ALIGN) {
            return Err(bad(format!(
                "size {size} is not a multiple of 2 MiB ({DEFAULT_ALIGN} bytes)"
            )));
        }
        if size < 2 * DEFAULT_ALIGN {
            return Err(bad(format!(
                "size {size} is below 4 MiB: a pool needs one 2 MiB unit for its header \
                 and at least one for regions"
            )));
        }
        Ok(PoolSpec::FakeDax {
            path: path.to_string(),
            size,
        })
    }

    /// Parses a spec given as flag name and value (`"--dax"` or `"--fake-dax"`,
    /// with or without the dashes).
    pub fn parse_flag(flag: &str, value: &str) -> Result<PoolSpec, DaxError> {
        match flag.trim_start_matches('-') {
            "dax" => PoolSpec::parse_dax(value),
            "fake-dax" => PoolSpec::parse_fake_dax(value),
            other => Err(DaxError::BadSpec {
                arg: format!("{flag} {value}"),
                reason: format!("unknown pool flag `{other}`; use --dax or --fake-dax"),
            }),
        }
    }

    pub fn path(&self) -> &str {
        match self {
            PoolSpec::DevDax { path } | PoolSpec::FakeDax { path, .. } => path,
        }
    }
}

/// Writes the spec as the flag that would give it back.
impl fmt::Display for PoolSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PoolSpec::DevDax { path } => write!(f, "--dax {path}"),
            PoolSpec::FakeDax { path, size } => write!(f, "--fake-dax {path}:{size}"),
        }
    }
}

/// Parses the value of `--fake-dax` (see [`PoolSpec::parse_fake_dax`]).
pub fn parse_fake_dax(arg: &str) -> Result<PoolSpec, DaxError> {
    PoolSpec::parse_fake_dax(arg)
}

/// Parses the value of `--dax` (see [`PoolSpec::parse_dax`]).
pub fn parse_dax(arg: &str) -> Result<PoolSpec, DaxError> {
    PoolSpec::parse_dax(arg)
}

fn check_path(arg: &str, path: &str) -> Result<(), DaxError> {
    let reason = if path.is_empty() {
        "empty path"
    } else if path.contains('\0') {
        "path contains a NUL byte"
    } else {
        return Ok(());
    };
    Err(DaxError::BadSpec {
        arg: arg.to_string(),
        reason: reason.into(),
    })
}

/// Parses a size: plain bytes (`4096`), or a number with a binary suffix `K`,
/// `M`, `G`, `T` (also `KiB` .. `TiB`, and a trailing `B` for bytes), in any case.
///
/// Zero is accepted here; callers for which zero makes no sense reject it.
pub fn parse_size(s: &str) -> Result<u64, DaxError> {
    let bad = |reason: &str| DaxError::BadSize {
        text: s.to_string(),
        reason: reason.into(),
    };
    let t = s.trim();
    let digits_end = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, suffix) = t.split_at(digits_end);
    if digits.is_empty() {
        return Err(bad("no number"));
    }
    let shift = match suffix.to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kib" => 10,
        "m" | "mib" => 20,
        "g" | "gib" => 30,
        "t" | "tib" => 40,
        _ => return Err(bad("unknown unit")),
    };
    let n: u64 = digits.parse().map_err(|_| bad("number too large"))?;
    n.checked_mul(1u64 << shift)
        .ok_or_else(|| bad("size does not fit in 64 bits"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("0").expect("ok"), 0);
        assert_eq!(parse_size("4096").expect("ok"), 4096);
        assert_eq!(parse_size("4096B").expect("ok"), 4096);
        assert_eq!(parse_size("4K").expect("ok"), 4 << 10);
        assert_eq!(parse_size("4k").expect("ok"), 4 << 10);
        assert_eq!(parse_size("512MiB").expect("ok"), 512 * MIB);
        assert_eq!(parse_size("4G").expect("ok"), 4 << 30);
        assert_eq!(parse_size("4gib").expect("ok"), 4 << 30);
        assert_eq!(parse_size(" 2T ").expect("ok"), 2 << 40);
        for bad in [
            "",
            "G",
            "-1",
            "+1",
            "1.5G",
            "4GB",
            "4 G",
            "4X",
            "0x10",
            "99999999999999999999",
            "16777216T",
        ] {
            assert!(parse_size(bad).is_err(), "{bad:?} parsed");
        }
    }

    #[test]
    fn fake_dax_specs() {
        assert_eq!(
            PoolSpec::parse_fake_dax("/dev/shm/maru-pool0:4G").expect("ok"),
            PoolSpec::FakeDax {
                path: "/dev/shm/maru-pool0".into(),
                size: 4 << 30
            }
        );
        assert_eq!(
            PoolSpec::parse_fake_dax("/tmp/a:b:4M").expect("ok"),
            PoolSpec::FakeDax {
                path: "/tmp/a:b".into(),
                size: 4 * MIB
            }
        );
        for bad in [
            "/dev/shm/pool",
            "/dev/shm/pool:",
            ":4G",
            "/dev/shm/pool:0",
            "/dev/shm/pool:3M",
            "/dev/shm/pool:2M",
            "/dev/shm/pool:4097K",
            "/dev/shm/pool:lots",
            "/dev/\0pool:4G",
        ] {
            let e = PoolSpec::parse_fake_dax(bad).expect_err(bad);
            assert!(matches!(e, DaxError::BadSpec { .. }), "{e}");
        }
    }

    #[test]
    fn dax_specs() {
        assert_eq!(
            PoolSpec::parse_flag("--dax", "/dev/dax0.0").expect("ok"),
            PoolSpec::DevDax {
                path: "/dev/dax0.0".into()
            }
        );
        assert!(PoolSpec::parse_dax("").is_err());
        assert!(PoolSpec::parse_flag("--pool", "/dev/dax0.0").is_err());
    }

    #[test]
    fn display_round_trips() {
        for spec in [
            PoolSpec::DevDax {
                path: "/dev/dax1.0".into(),
            },
            PoolSpec::FakeDax {
                path: "/dev/shm/x".into(),
                size: 6 * MIB,
            },
        ] {
            let text = spec.to_string();
            let (flag, value) = text.split_once(' ').expect("flag and value");
            assert_eq!(PoolSpec::parse_flag(flag, value).expect("parses"), spec);
        }
    }

    proptest! {
        #[test]
        fn parsers_never_panic(s in ".*") {
            let _ = parse_size(&s);
            let _ = PoolSpec::parse_fake_dax(&s);
            let _ = PoolSpec::parse_dax(&s);
            let _ = PoolSpec::parse_flag(&s, &s);
        }

        #[test]
        fn sizes_with_units_parse(n in 0u64..1 << 20, unit in 0usize..5) {
            let names = ["", "K", "M", "G", "T"];
            let text = format!("{n}{}", names[unit]);
            prop_assert_eq!(parse_size(&text).ok(), n.checked_mul(1 << (10 * unit as u32)));
        }

        #[test]
        fn valid_fake_specs_parse(path in "/[a-z0-9:/._-]{1,30}", units in 2u64..4096) {
            let arg = format!("{path}:{}M", units * 2);
            let spec = PoolSpec::parse_fake_dax(&arg);
            prop_assert_eq!(spec.ok(), Some(PoolSpec::FakeDax { path, size: units * 2 * MIB }));
        }
    }
}
