//! The size and alignment of a devdax device, read from sysfs (the character
//! device's directory or the dax bus's).

use super::error::DaxError;
use super::DEFAULT_ALIGN;
use std::io::ErrorKind;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

/// Size and alignment of a devdax device, from sysfs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    pub size: u64,
    pub align: u64,
}

/// Size and alignment of the devdax device at `path`, checking that it is one.
pub fn devdax_geometry(path: &str) -> Result<Geometry, DaxError> {
    let meta = std::fs::metadata(path).map_err(|err| match err.kind() {
        ErrorKind::NotFound => DaxError::NoDevice {
            path: path.to_string(),
        },
        _ => DaxError::io(path, "stat", err),
    })?;
    if !meta.file_type().is_char_device() {
        return Err(DaxError::NotCharDevice {
            path: path.to_string(),
        });
    }
    sysfs_geometry(Path::new("/sys"), path, meta.rdev()).map_err(|detail| DaxError::NotDaxDevice {
        path: path.to_string(),
        detail,
    })
}

/// Major and minor number of a device number, as glibc encodes them.
fn major_minor(rdev: u64) -> (u64, u64) {
    let major = ((rdev >> 32) & 0xffff_f000) | ((rdev >> 8) & 0x0fff);
    let minor = ((rdev >> 12) & 0xffff_ff00) | (rdev & 0xff);
    (major, minor)
}

/// Reads size and alignment from the sysfs tree under `sysfs` (a parameter so
/// tests can give a fake tree). The size comes from the character device's
/// directory, or the dax bus's; a missing `align` means the 2 MiB default.
fn sysfs_geometry(sysfs: &Path, dev_path: &str, rdev: u64) -> Result<Geometry, String> {
    let (major, minor) = major_minor(rdev);
    let char_dir = sysfs.join(format!("dev/char/{major}:{minor}"));
    // The device's own name (daxX.Y) even when `dev_path` is a symlink.
    let name = std::fs::canonicalize(&char_dir)
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_os_string()))
        .or_else(|| {
            std::fs::canonicalize(dev_path)
                .ok()
                .and_then(|p| p.file_name().map(|n| n.to_os_string()))
        })
        .ok_or_else(|| format!("no sysfs entry {}", char_dir.display()))?;
    let bus_dir = sysfs.join("bus/dax/devices").join(name);
    let dirs = [char_dir, bus_dir];
    let size = read_attr(&dirs, "size")?.ok_or_else(|| {
        format!(
            "no size in {} or {}",
            dirs[0].join("size").display(),
            dirs[1].join("size").display()
        )
    })?;
    let align = read_attr(&[dirs[1].clone(), dirs[0].clone()], "align")?.unwrap_or(DEFAULT_ALIGN);
    if !align.is_power_of_two() {
        return Err(format!("sysfs align {align} is not a power of two"));
    }
    Ok(Geometry { size, align })
}

/// The first of `dirs`/`name` that exists, parsed as a number.
fn read_attr(dirs: &[PathBuf], name: &str) -> Result<Option<u64>, String> {
    for dir in dirs {
        let p = dir.join(name);
        match std::fs::read_to_string(&p) {
            Ok(text) => {
                return parse_sysfs_number(&text).map(Some).ok_or_else(|| {
                    format!("{} holds `{}`, not a number", p.display(), text.trim())
                })
            }
            Err(e) if e.kind() == ErrorKind::NotFound => continue,
            Err(e) => return Err(format!("cannot read {}: {e}", p.display())),
        }
    }
    Ok(None)
}

fn parse_sysfs_number(text: &str) -> Option<u64> {
    let t = text.trim();
    match t.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => t.parse().ok(),
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::ScratchPath;
    use super::*;

    #[test]
    fn sysfs_geometry_from_a_fake_tree() {
        let root = ScratchPath::new("sysfs");
        let rdev = (251u64 << 8) | 3; // 251:3
        let bus = root.0.join("bus/dax/devices/dax3.0");
        let chr = root.0.join("dev/char/251:3");
        std::fs::create_dir_all(&bus).expect("mkdir");
        std::fs::create_dir_all(root.0.join("dev/char")).expect("mkdir");
        std::os::unix::fs::symlink(&bus, &chr).expect("symlink");

        let e = sysfs_geometry(&root.0, "/dev/dax3.0", rdev).expect_err("no size");
        assert!(e.contains("size"), "{e}");

        std::fs::write(bus.join("size"), "1073741824\n").expect("write");
        let g = sysfs_geometry(&root.0, "/dev/dax3.0", rdev).expect("size only");
        assert_eq!(
            g,
            Geometry {
                size: 1 << 30,
                align: DEFAULT_ALIGN
            }
        );

        std::fs::write(bus.join("align"), "1073741824\n").expect("write");
        let g = sysfs_geometry(&root.0, "/dev/dax3.0", rdev).expect("size and align");
        assert_eq!(g.align, 1 << 30);

        std::fs::write(bus.join("align"), "lots\n").expect("write");
        assert!(sysfs_geometry(&root.0, "/dev/dax3.0", rdev).is_err());
        std::fs::write(bus.join("align"), "3145728\n").expect("write");
        assert!(sysfs_geometry(&root.0, "/dev/dax3.0", rdev).is_err());
    }

    #[test]
    fn device_numbers() {
        assert_eq!(major_minor((251 << 8) | 3), (251, 3));
        // glibc's makedev for a major and minor that do not fit in 8 bits.
        let (major, minor) = (0x12345u64, 0x6789au64);
        let rdev = ((major & 0xffff_f000) << 32)
            | ((major & 0x0fff) << 8)
            | ((minor & 0xffff_ff00) << 12)
            | (minor & 0xff);
        assert_eq!(major_minor(rdev), (major, minor));
    }
}
