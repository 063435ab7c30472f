//! Shared mappings of aligned ranges of a pool.
//!
//! Every mapping is `MAP_SHARED`: the bytes are the pool's bytes, seen by every
//! process (and, once registered, every NIC) that maps the same range. Ranges
//! must be aligned to the device alignment because devdax refuses anything else
//! and because a region's pages must never share a huge page with a neighbour.

use std::fs::{File, OpenOptions};

use memmap2::{Mmap, MmapMut, MmapOptions};

use super::error::DaxError;
use super::geometry::devdax_geometry;
use super::{is_aligned, DeviceKind};

/// `MADV_POPULATE_READ` / `MADV_POPULATE_WRITE` (Linux 5.14); spelled out
/// because not every libc crate version names them.
const MADV_POPULATE_READ: libc::c_int = 22;
pub(crate) const MADV_POPULATE_WRITE: libc::c_int = 23;

/// A mapped range of a pool. Unmapped on drop.
pub struct Mapping {
    path: String,
    offset: u64,
    inner: Inner,
    protected: bool,
}

enum Inner {
    ReadOnly(Mmap),
    Writable(MmapMut),
}

impl std::fmt::Debug for Mapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mapping")
            .field("path", &self.path)
            .field("offset", &self.offset)
            .field("len", &self.len())
            .field("writable", &self.is_writable())
            .field("protected", &self.protected)
            .finish()
    }
}

/// Maps `length` bytes at `offset` of the pool at `path`.
///
/// `offset` and `length` must be multiples of `align` (a power of two of at least
/// the page size), and the range must lie inside the device: a file mapping past
/// its end would fault on first touch instead of failing here.
pub fn map_range(
    path: &str,
    kind: DeviceKind,
    offset: u64,
    length: u64,
    align: u64,
    writable: bool,
) -> Result<Mapping, DaxError> {
    check_alignment(path, offset, length, align)?;
    let file = OpenOptions::new()
        .read(true)
        .write(writable)
        .open(path)
        .map_err(|err| match err.kind() {
            std::io::ErrorKind::NotFound if kind == DeviceKind::DevDax => DaxError::NoDevice {
                path: path.to_string(),
            },
            std::io::ErrorKind::NotFound => DaxError::NotFound {
                path: path.to_string(),
            },
            _ => DaxError::io(path, "open", err),
        })?;
    let size = match kind {
        DeviceKind::File => file
            .metadata()
            .map_err(|err| DaxError::io(path, "stat", err))?
            .len(),
        DeviceKind::DevDax => devdax_geometry(path)?.size,
    };
    map_file(&file, path, offset, length, size, writable)
}

/// Maps a range of an already opened pool whose size is known.
pub(crate) fn map_file(
    file: &File,
    path: &str,
    offset: u64,
    length: u64,
    size: u64,
    writable: bool,
) -> Result<Mapping, DaxError> {
    let out_of_range = || DaxError::OutOfRange {
        path: path.to_string(),
        offset,
        length,
        size,
    };
    let end = offset.checked_add(length).ok_or_else(out_of_range)?;
    if length == 0 || end > size {
        return Err(out_of_range());
    }
    let len = usize::try_from(length).map_err(|_| out_of_range())?;
    let mut opts = MmapOptions::new();
    opts.offset(offset).len(len);
    // SAFETY: the mapping is shared memory by design; other processes and NICs
    // change its bytes. Callers coordinate who writes which range (regions are
    // owned), which is what the rest of Maru enforces; the range lies within the
    // file, so no access faults for lack of backing.
    let inner = unsafe {
        if writable {
            opts.map_mut(file).map(Inner::Writable)
        } else {
            opts.map(file).map(Inner::ReadOnly)
        }
    }
    .map_err(|err| DaxError::io(path, "mmap", err))?;
    Ok(Mapping {
        path: path.to_string(),
        offset,
        inner,
        protected: false,
    })
}

fn check_alignment(path: &str, offset: u64, length: u64, align: u64) -> Result<(), DaxError> {
    if !align.is_power_of_two() || align < page_size() {
        return Err(DaxError::BadAlign {
            path: path.to_string(),
            align,
        });
    }
    if !is_aligned(offset, align) || !is_aligned(length, align) {
        return Err(DaxError::Unaligned {
            path: path.to_string(),
            offset,
            length,
            align,
        });
    }
    Ok(())
}

fn page_size() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if n > 0 {
        n as u64
    } else {
        4096
    }
}

impl Mapping {
    /// Start of the mapped range, for NIC registration and raw copies. Stays
    /// valid (though inaccessible after [`Mapping::protect_none`]) until drop.
    pub fn as_ptr(&self) -> *mut u8 {
        match &self.inner {
            Inner::ReadOnly(m) => m.as_ptr().cast_mut(),
            Inner::Writable(m) => m.as_ptr().cast_mut(),
        }
    }

    pub fn len(&self) -> usize {
        match &self.inner {
            Inner::ReadOnly(m) => m.len(),
            Inner::Writable(m) => m.len(),
        }
    }

    /// Never true: empty ranges are refused by [`map_range`].
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Offset of the range in the pool.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    pub fn path(&self) -> &str {
        &self.path
    }

    pub fn is_writable(&self) -> bool {
        matches!(self.inner, Inner::Writable(_))
    }

    pub fn is_protected(&self) -> bool {
        self.protected
    }

    /// The bytes of the range; refused once the range is protected.
    pub fn as_slice(&self) -> Result<&[u8], DaxError> {
        if self.protected {
            return Err(DaxError::Protected {
                path: self.path.clone(),
            });
        }
        Ok(match &self.inner {
            Inner::ReadOnly(m) => m,
            Inner::Writable(m) => m,
        })
    }

    /// The bytes of the range, writable; refused for read-only or protected
    /// mappings.
    pub fn as_mut_slice(&mut self) -> Result<&mut [u8], DaxError> {
        if self.protected {
            return Err(DaxError::Protected {
                path: self.path.clone(),
            });
        }
        match &mut self.inner {
            Inner::ReadOnly(_) => Err(DaxError::ReadOnly {
                path: self.path.clone(),
            }),
            Inner::Writable(m) => Ok(m),
        }
    }

    /// Makes the range inaccessible (`PROT_NONE`) while keeping it mapped.
    ///
    /// A released region is quarantined this way: its virtual addresses stay
    /// taken, so no new mapping (and no new NIC registration) gets the same
    /// addresses while stale references to them may still be around, and any
    /// stray access faults instead of reading or writing the next owner's bytes.
    /// Takes `&mut self` so that no slice of the range outlives the change.
    pub fn protect_none(&mut self) -> Result<(), DaxError> {
        // SAFETY: the pointer and length are exactly this mapping, which stays
        // mapped until drop; no slice borrows it (exclusive borrow), and the
        // slice accessors check `protected` from now on.
        let r = unsafe { libc::mprotect(self.as_ptr().cast(), self.len(), libc::PROT_NONE) };
        if r != 0 {
            return Err(DaxError::io(
                &self.path,
                "mprotect(PROT_NONE)",
                std::io::Error::last_os_error(),
            ));
        }
        self.protected = true;
        Ok(())
    }

    /// Where `len` bytes at `offset` of this mapping may be written: refused for
    /// read-only or protected mappings and for bytes outside the range. The pointer
    /// is valid for writes of `len` bytes while `self` lives and is not protected.
    pub fn writable_range(&self, offset: usize, len: usize) -> Result<*mut u8, DaxError> {
        if self.protected {
            return Err(DaxError::Protected {
                path: self.path.clone(),
            });
        }
        if !self.is_writable() {
            return Err(DaxError::ReadOnly {
                path: self.path.clone(),
            });
        }
        let end = offset
            .checked_add(len)
            .filter(|&e| e <= self.len())
            .ok_or_else(|| DaxError::OutOfRange {
                path: self.path.clone(),
                offset: self.offset + offset as u64,
                length: len as u64,
                size: self.offset + self.len() as u64,
            })?;
        debug_assert!(end <= self.len());
        // SAFETY: `offset <= end <= len`: the pointer stays inside this mapping.
        Ok(unsafe { self.as_ptr().add(offset) })
    }

    /// Copies `data` into the range at `offset` through the shared mapping.
    ///
    /// For a mapping shared between threads (`Arc<Mapping>`: one that a prefault
    /// thread populates while stores write into it). Refused as
    /// [`writable_range`](Self::writable_range) refuses.
    pub fn write_at(&self, offset: usize, data: &[u8]) -> Result<(), DaxError> {
        let dst = self.writable_range(offset, data.len())?;
        // SAFETY: `dst` is valid for `data.len()` bytes of this writable, unprotected
        // mapping, which stays mapped while `self` lives; `data` is caller memory, not
        // this mapping's range (a `&[u8]` of it would need `as_slice`, and callers
        // never pass one). The bytes are shared memory by design (see `map_file`): who
        // writes which range is coordinated by region and page ownership. The copy
        // streams past the caches (see `copy`): the writer does not read these bytes
        // again.
        unsafe {
            super::copy::copy_to_shared(dst, data);
        }
        Ok(())
    }

    /// Faults `len` bytes at `offset` of the range in now
    /// (`MADV_POPULATE_WRITE` on a writable mapping, `MADV_POPULATE_READ` on a
    /// read-only one). Changes no byte. `Ok(false)`: not done, because the kernel
    /// does not know the advice (before 5.14) or the range is protected.
    pub fn populate_range(&self, offset: usize, len: usize) -> Result<bool, DaxError> {
        if self.protected {
            return Ok(false);
        }
        let Some(len) = offset
            .checked_add(len)
            .map(|e| e.min(self.len()))
            .and_then(|e| e.checked_sub(offset))
            .filter(|&l| l > 0)
        else {
            return Ok(true);
        };
        let advice = if self.is_writable() {
            MADV_POPULATE_WRITE
        } else {
            MADV_POPULATE_READ
        };
        // SAFETY: `offset..offset + len` lies inside this mapping (clamped above), which
        // stays mapped while `self` lives; populating changes no contents.
        let r = unsafe { libc::madvise(self.as_ptr().add(offset).cast(), len, advice) };
        if r != 0 {
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::EINVAL) {
                return Ok(false);
            }
            return Err(DaxError::io(&self.path, "madvise(MADV_POPULATE)", err));
        }
        Ok(true)
    }

    /// Faults the whole range in now (best effort), so the first transfer into
    /// it does not pay for page faults. Kernels before 5.14 do not know the
    /// advice (`EINVAL`); that is not an error.
    pub fn populate(&self) -> Result<(), DaxError> {
        if self.protected {
            return Ok(());
        }
        let advice = if self.is_writable() {
            MADV_POPULATE_WRITE
        } else {
            MADV_POPULATE_READ
        };
        // SAFETY: the pointer and length are exactly this mapping; populating
        // changes no contents.
        let r = unsafe { libc::madvise(self.as_ptr().cast(), self.len(), advice) };
        if r != 0 {
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() != Some(libc::EINVAL) {
                return Err(DaxError::io(&self.path, "madvise(MADV_POPULATE)", err));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::ScratchPath;
    use super::super::DEFAULT_ALIGN;
    use super::*;

    const UNIT: u64 = DEFAULT_ALIGN;

    fn pool_file(tag: &str, units: u64) -> ScratchPath {
        let p = ScratchPath::new(tag);
        let f = File::create(&p.0).expect("create scratch file");
        f.set_len(units * UNIT).expect("set_len");
        p
    }

    #[test]
    fn bytes_are_shared_between_mappings() {
        let p = pool_file("map-shared", 3);
        let mut w = map_range(p.as_str(), DeviceKind::File, UNIT, UNIT, UNIT, true).expect("map");
        assert_eq!(w.len() as u64, UNIT);
        w.populate().expect("populate");
        let s = w.as_mut_slice().expect("writable");
        s[0] = 0xab;
        s[UNIT as usize - 1] = 0xcd;
        let r = map_range(p.as_str(), DeviceKind::File, UNIT, UNIT, UNIT, false).expect("map");
        r.populate().expect("populate");
        let rs = r.as_slice().expect("readable");
        assert_eq!((rs[0], rs[UNIT as usize - 1]), (0xab, 0xcd));
        // The other unit is untouched.
        let o = map_range(p.as_str(), DeviceKind::File, 2 * UNIT, UNIT, UNIT, false).expect("map");
        assert_eq!(o.as_slice().expect("readable")[0], 0);
    }

    #[test]
    fn read_only_mapping_refuses_writes() {
        let p = pool_file("map-ro", 2);
        let mut r = map_range(p.as_str(), DeviceKind::File, 0, UNIT, UNIT, false).expect("map");
        assert!(matches!(r.as_mut_slice(), Err(DaxError::ReadOnly { .. })));
    }

    #[test]
    fn unaligned_ranges_are_rejected() {
        let p = pool_file("map-unaligned", 3);
        for (offset, length) in [(4096, UNIT), (UNIT, 4096), (1, UNIT)] {
            let e = map_range(p.as_str(), DeviceKind::File, offset, length, UNIT, true)
                .expect_err("unaligned");
            assert!(matches!(e, DaxError::Unaligned { .. }), "{e}");
        }
        let e = map_range(p.as_str(), DeviceKind::File, 0, UNIT, 3 << 20, true).expect_err("align");
        assert!(matches!(e, DaxError::BadAlign { .. }), "{e}");
    }

    #[test]
    fn ranges_past_the_end_are_rejected() {
        let p = pool_file("map-range", 2);
        for (offset, length) in [(UNIT, 2 * UNIT), (0, 0), (u64::MAX - UNIT + 1, UNIT)] {
            let e = map_range(p.as_str(), DeviceKind::File, offset, length, UNIT, false)
                .expect_err("out of range");
            assert!(matches!(e, DaxError::OutOfRange { .. }), "{e}");
        }
    }

    #[test]
    fn write_at_and_populate_range_keep_the_bytes() {
        let p = pool_file("map-write-at", 2);
        let w = map_range(p.as_str(), DeviceKind::File, 0, UNIT, UNIT, true).expect("map");
        w.write_at(4096, b"kv bytes").expect("write_at");
        w.write_at(UNIT as usize - 2, b"xy")
            .expect("write_at at the end");
        assert!(matches!(
            w.write_at(UNIT as usize - 1, b"xy"),
            Err(DaxError::OutOfRange { .. })
        ));
        assert!(matches!(
            w.write_at(usize::MAX, b"x"),
            Err(DaxError::OutOfRange { .. })
        ));
        // Populating (whole, in parts, past the end) changes no byte.
        for (o, n) in [
            (0, UNIT as usize),
            (4096, 8192),
            (UNIT as usize - 4096, 1 << 30),
        ] {
            w.populate_range(o, n).expect("populate_range");
        }
        assert!(w.populate_range(usize::MAX, 10).expect("empty range"));
        let s = w.as_slice().expect("readable");
        assert_eq!(&s[4096..4104], b"kv bytes");
        assert_eq!(&s[UNIT as usize - 2..], b"xy");
        assert!(s[..4096].iter().all(|&b| b == 0));
        let r = map_range(p.as_str(), DeviceKind::File, 0, UNIT, UNIT, false).expect("map");
        assert!(matches!(
            r.write_at(0, b"x"),
            Err(DaxError::ReadOnly { .. })
        ));
        r.populate_range(0, UNIT as usize).expect("populate read");
        assert_eq!(&r.as_slice().expect("readable")[4096..4104], b"kv bytes");
    }

    #[test]
    fn protected_mapping_refuses_access() {
        let p = pool_file("map-protect", 2);
        let mut m = map_range(p.as_str(), DeviceKind::File, UNIT, UNIT, UNIT, true).expect("map");
        m.protect_none().expect("mprotect");
        assert!(m.is_protected());
        assert!(matches!(m.as_slice(), Err(DaxError::Protected { .. })));
        assert!(matches!(m.as_mut_slice(), Err(DaxError::Protected { .. })));
        m.populate().expect("no-op when protected");
        assert!(!m.populate_range(0, 4096).expect("not done when protected"));
        assert!(matches!(
            m.write_at(0, b"x"),
            Err(DaxError::Protected { .. })
        ));
    }

    #[test]
    fn missing_file_is_named() {
        let p = ScratchPath::new("map-missing");
        let e = map_range(p.as_str(), DeviceKind::File, 0, UNIT, UNIT, false).expect_err("missing");
        assert!(matches!(e, DaxError::NotFound { .. }), "{e}");
        assert!(e.to_string().contains(p.as_str()), "{e}");
    }
}
