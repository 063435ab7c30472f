//! Opening pools: size, alignment and identity of a devdax device or a fake DAX
//! file, creating the device header on first use.
//!
//! Opening takes an exclusive `flock` on the device for the header check, so two
//! daemons starting at once on a new device agree on one UUID.

use std::fs::{File, OpenOptions};
use std::io::ErrorKind;
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;

use super::error::DaxError;
use super::geometry::devdax_geometry;
use super::header::{DeviceHeader, HEADER_LEN};
use super::map::map_file;
use super::spec::PoolSpec;
use super::{is_aligned, DeviceInfo, DeviceKind, DEFAULT_ALIGN};

/// Opens the pool `spec` names, writing a fresh device header if it has none.
///
/// A fake DAX file is created (mode 0600) when absent; an existing one must have
/// the requested size. Opening the same pool again gives the same UUID.
pub fn open_pool(spec: &PoolSpec) -> Result<DeviceInfo, DaxError> {
    match spec {
        PoolSpec::FakeDax { path, size } => open_fake_dax(path, *size),
        PoolSpec::DevDax { path } => open_devdax(path),
    }
}

fn open_fake_dax(path: &str, size: u64) -> Result<DeviceInfo, DaxError> {
    if size < 2 * DEFAULT_ALIGN || !is_aligned(size, DEFAULT_ALIGN) {
        return Err(DaxError::TooSmall {
            path: path.to_string(),
            size,
            align: DEFAULT_ALIGN,
        });
    }
    let mut opts = OpenOptions::new();
    opts.read(true).write(true);
    let (file, created) = match opts.clone().create_new(true).mode(0o600).open(path) {
        Ok(f) => (f, true),
        Err(e) if e.kind() == ErrorKind::AlreadyExists => (
            opts.open(path)
                .map_err(|err| DaxError::io(path, "open fake DAX file", err))?,
            false,
        ),
        Err(err) => return Err(DaxError::io(path, "create fake DAX file", err)),
    };
    let result = init_fake_dax(&file, path, size);
    if result.is_err() && created {
        // Do not leave a half-made pool behind that the next start would trip on.
        let _ = std::fs::remove_file(path);
    }
    result
}

fn init_fake_dax(file: &File, path: &str, size: u64) -> Result<DeviceInfo, DaxError> {
    lock_exclusive(file, path)?;
    let meta = file
        .metadata()
        .map_err(|err| DaxError::io(path, "stat", err))?;
    if !meta.is_file() {
        return Err(DaxError::NotRegularFile {
            path: path.to_string(),
        });
    }
    // An empty file holds neither header nor data: it is a pool not yet sized
    // (new, or its creator has not got the lock yet).
    match meta.len() {
        0 => file
            .set_len(size)
            .map_err(|err| DaxError::io(path, "set length of", err))?,
        len if len == size => {}
        existing => {
            return Err(DaxError::SizeMismatch {
                path: path.to_string(),
                existing,
                requested: size,
            })
        }
    }
    let mut buf = [0u8; HEADER_LEN];
    file.read_exact_at(&mut buf, 0)
        .map_err(|err| DaxError::io(path, "read header of", err))?;
    let header = match decode_at(&buf, path)? {
        Some(h) => h,
        None if buf.iter().all(|&b| b == 0) => {
            let h = DeviceHeader::generate()?;
            file.write_all_at(&h.encode(), 0)
                .map_err(|err| DaxError::io(path, "write header of", err))?;
            file.sync_all()
                .map_err(|err| DaxError::io(path, "fsync", err))?;
            h
        }
        // A file is easily named by mistake; never overwrite what is not ours.
        None => {
            return Err(DaxError::ForeignContent {
                path: path.to_string(),
            })
        }
    };
    Ok(DeviceInfo {
        path: path.to_string(),
        uuid: header.uuid_string(),
        kind: DeviceKind::File,
        device_size: size,
        align: DEFAULT_ALIGN,
        data_offset: DEFAULT_ALIGN,
    })
}

fn open_devdax(path: &str) -> Result<DeviceInfo, DaxError> {
    let geometry = devdax_geometry(path)?;
    if geometry.size < 2 * geometry.align {
        return Err(DaxError::TooSmall {
            path: path.to_string(),
            size: geometry.size,
            align: geometry.align,
        });
    }
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .map_err(|err| DaxError::io(path, "open DAX device", err))?;
    lock_exclusive(&file, path)?;
    // devdax supports no read(2)/write(2): the header is read and written
    // through a mapping of the first alignment unit.
    let mut unit = map_file(&file, path, 0, geometry.align, geometry.size, true)?;
    let bytes = unit.as_mut_slice()?;
    let header = match decode_at(&bytes[..HEADER_LEN], path)? {
        Some(h) => h,
        // A devdax device is given to Maru whole: whatever else is in its first
        // unit (stale contents after a reboot, say) is not a pool.
        None => {
            let h = DeviceHeader::generate()?;
            bytes[..HEADER_LEN].copy_from_slice(&h.encode());
            h
        }
    };
    if let Err(err) = msync(&unit) {
        return Err(DaxError::io(path, "msync header of", err));
    }
    Ok(DeviceInfo {
        path: path.to_string(),
        uuid: header.uuid_string(),
        kind: DeviceKind::DevDax,
        device_size: geometry.size,
        align: geometry.align,
        data_offset: geometry.align,
    })
}

fn msync(unit: &super::Mapping) -> std::io::Result<()> {
    // SAFETY: the pointer and length are exactly the live mapping `unit`.
    let r = unsafe { libc::msync(unit.as_ptr().cast(), unit.len(), libc::MS_SYNC) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// The UUID in the header of the device or file at `path`, `None` where it has
/// no header. Hosts use it to find their own path of a pool named by UUID.
pub fn scan_uuid(path: &str) -> Result<Option<String>, DaxError> {
    let meta = std::fs::metadata(path).map_err(|err| match err.kind() {
        ErrorKind::NotFound => DaxError::NotFound {
            path: path.to_string(),
        },
        _ => DaxError::io(path, "stat", err),
    })?;
    let file = File::open(path).map_err(|err| DaxError::io(path, "open", err))?;
    let header = if meta.file_type().is_char_device() {
        let geometry = devdax_geometry(path)?;
        let unit = map_file(&file, path, 0, geometry.align, geometry.size, false)?;
        let bytes = unit.as_slice()?;
        decode_at(&bytes[..HEADER_LEN], path)?
    } else if meta.is_file() {
        let mut buf = [0u8; HEADER_LEN];
        let n = read_prefix(&file, &mut buf).map_err(|err| DaxError::io(path, "read", err))?;
        decode_at(&buf[..n], path)?
    } else {
        None
    };
    Ok(header.map(|h| h.uuid_string()))
}

/// Reads up to `buf.len()` bytes from the start of `file`, fewer at its end.
fn read_prefix(file: &File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match file.read_at(&mut buf[n..], n as u64) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

fn decode_at(buf: &[u8], path: &str) -> Result<Option<DeviceHeader>, DaxError> {
    DeviceHeader::decode(buf).map_err(|e| match e {
        DaxError::BadHeader { problem, .. } => DaxError::BadHeader {
            path: Some(path.to_string()),
            problem,
        },
        other => other,
    })
}

fn lock_exclusive(file: &File, path: &str) -> Result<(), DaxError> {
    loop {
        // SAFETY: the descriptor is open for the lifetime of `file`; the lock
        // goes with it when the file is closed.
        let r = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) };
        if r == 0 {
            return Ok(());
        }
        let err = std::io::Error::last_os_error();
        if err.kind() != ErrorKind::Interrupted {
            return Err(DaxError::io(path, "lock", err));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::ScratchPath;
    use super::super::{map_range, DEFAULT_ALIGN};
    use super::*;
    use std::os::unix::fs::MetadataExt;

    const UNIT: u64 = DEFAULT_ALIGN;

    fn fake(p: &ScratchPath, units: u64) -> PoolSpec {
        PoolSpec::FakeDax {
            path: p.as_str().to_string(),
            size: units * UNIT,
        }
    }

    #[test]
    fn fake_pool_is_created_and_keeps_its_uuid() {
        let p = ScratchPath::new("pool-create");
        let a = open_pool(&fake(&p, 4)).expect("create");
        assert_eq!(a.kind, DeviceKind::File);
        assert_eq!(a.device_size, 4 * UNIT);
        assert_eq!((a.align, a.data_offset), (UNIT, UNIT));
        assert_eq!(a.usable(), 3 * UNIT);
        assert_eq!(a.uuid.len(), 36);
        let meta = std::fs::metadata(&p.0).expect("exists");
        assert_eq!(meta.len(), 4 * UNIT);
        assert_eq!(meta.mode() & 0o777, 0o600);
        let b = open_pool(&fake(&p, 4)).expect("reopen");
        assert_eq!(a, b);
        assert_eq!(scan_uuid(p.as_str()).expect("scan"), Some(a.uuid));
    }

    #[test]
    fn fake_pool_size_mismatch_is_refused() {
        let p = ScratchPath::new("pool-size");
        open_pool(&fake(&p, 4)).expect("create");
        let e = open_pool(&fake(&p, 8)).expect_err("other size");
        assert!(
            matches!(
                e,
                DaxError::SizeMismatch {
                    existing,
                    requested,
                    ..
                } if existing == 4 * UNIT && requested == 8 * UNIT
            ),
            "{e}"
        );
        assert!(e.to_string().contains(p.as_str()), "{e}");
        // The refused open leaves the pool as it was.
        assert_eq!(std::fs::metadata(&p.0).expect("exists").len(), 4 * UNIT);
    }

    #[test]
    fn empty_existing_file_becomes_a_pool() {
        let p = ScratchPath::new("pool-empty");
        File::create(&p.0).expect("create");
        let info = open_pool(&fake(&p, 2)).expect("sized and headed");
        assert_eq!(scan_uuid(p.as_str()).expect("scan"), Some(info.uuid));
    }

    #[test]
    fn foreign_file_is_not_overwritten() {
        let p = ScratchPath::new("pool-foreign");
        let f = File::create(&p.0).expect("create");
        f.set_len(2 * UNIT).expect("set_len");
        f.write_all_at(b"not a pool", 0).expect("write");
        let e = open_pool(&fake(&p, 2)).expect_err("foreign");
        assert!(matches!(e, DaxError::ForeignContent { .. }), "{e}");
        let bytes = std::fs::read(&p.0).expect("read");
        assert_eq!(&bytes[..10], b"not a pool");
    }

    #[test]
    fn header_written_by_open_is_seen_through_a_mapping() {
        let p = ScratchPath::new("pool-map");
        let info = open_pool(&fake(&p, 2)).expect("create");
        let m = map_range(&info.path, info.kind, 0, info.align, info.align, false).expect("map");
        let h = DeviceHeader::decode(m.as_slice().expect("readable"))
            .expect("valid")
            .expect("present");
        assert_eq!(h.uuid_string(), info.uuid);
    }

    #[test]
    fn scan_of_files_without_header() {
        let p = ScratchPath::new("scan-none");
        std::fs::write(&p.0, b"MARU").expect("write");
        assert_eq!(scan_uuid(p.as_str()).expect("scan"), None);
        std::fs::write(&p.0, b"MARUDEV\0\x01").expect("write");
        let e = scan_uuid(p.as_str()).expect_err("truncated header");
        assert!(
            matches!(e, DaxError::BadHeader { path: Some(_), .. }),
            "{e}"
        );
        let missing = ScratchPath::new("scan-missing");
        let e = scan_uuid(missing.as_str()).expect_err("missing");
        assert!(matches!(e, DaxError::NotFound { .. }), "{e}");
    }

    #[test]
    fn missing_devdax_names_path_and_fake_dax() {
        let p = ScratchPath::new("no-dax");
        let spec = PoolSpec::DevDax {
            path: p.as_str().to_string(),
        };
        let e = open_pool(&spec).expect_err("missing");
        assert!(matches!(e, DaxError::NoDevice { .. }), "{e}");
        let text = e.to_string();
        assert!(
            text.contains(p.as_str()) && text.contains("--fake-dax"),
            "{text}"
        );
    }

    #[test]
    fn devdax_must_be_a_dax_char_device() {
        let p = ScratchPath::new("dax-regular");
        std::fs::write(&p.0, b"").expect("write");
        let spec = PoolSpec::DevDax {
            path: p.as_str().to_string(),
        };
        let e = open_pool(&spec).expect_err("regular file");
        assert!(matches!(e, DaxError::NotCharDevice { .. }), "{e}");
        let null = PoolSpec::DevDax {
            path: "/dev/null".into(),
        };
        let e = open_pool(&null).expect_err("not dax");
        assert!(matches!(e, DaxError::NotDaxDevice { .. }), "{e}");
    }
}
