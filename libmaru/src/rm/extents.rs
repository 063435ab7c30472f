//! First-fit allocation of aligned ranges of one pool's data area.
//!
//! The free space is an offset-sorted list of extents. A region takes the first
//! extent that holds it once its start is aligned up; what is left before and after
//! it stays free, and a freed range merges with its free neighbours, so freeing
//! everything gives back the whole data area as one extent. Offsets are device
//! offsets (the data area starts after the device header), aligned as absolute
//! device offsets, because that is what a DAX mapping needs.

use std::collections::BTreeMap;

/// Free space of one pool.
#[derive(Debug, Clone)]
pub struct ExtentAllocator {
    start: u64,
    end: u64,
    align: u64,
    /// offset → length of each free extent; never empty, never touching.
    free: BTreeMap<u64, u64>,
    free_bytes: u64,
}

/// A range that cannot be given back or taken out of the free space.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExtentError {
    /// The range is empty or not inside the pool's data area.
    #[error(
        "range [{offset:#x}, +{length:#x}) is empty or outside the pool's data area \
             [{start:#x}, {end:#x})"
    )]
    OutOfRange {
        offset: u64,
        length: u64,
        start: u64,
        end: u64,
    },
    /// `free`: part of the range is already free (a double free).
    #[error("range [{offset:#x}, +{length:#x}) is already (partly) free: freed twice")]
    AlreadyFree { offset: u64, length: u64 },
    /// `reserve`: part of the range is not free (it overlaps another region).
    #[error("range [{offset:#x}, +{length:#x}) overlaps a range already allocated")]
    NotFree { offset: u64, length: u64 },
}

/// `value` rounded up to a multiple of `align`, or `None` on overflow.
fn align_up(value: u64, align: u64) -> Option<u64> {
    value.checked_next_multiple_of(align)
}

impl ExtentAllocator {
    /// All of `[start, end)` free. An alignment of 0 is taken as 1.
    pub fn new(start: u64, end: u64, align: u64) -> ExtentAllocator {
        let mut free = BTreeMap::new();
        let end = end.max(start);
        if end > start {
            free.insert(start, end - start);
        }
        ExtentAllocator {
            start,
            end,
            align: align.max(1),
            free,
            free_bytes: end - start,
        }
    }

    pub fn align(&self) -> u64 {
        self.align
    }

    /// Bytes of the data area (free or not).
    pub fn total(&self) -> u64 {
        self.end - self.start
    }

    pub fn free_bytes(&self) -> u64 {
        self.free_bytes
    }

    /// The longest free extent (what the largest possible allocation could use,
    /// before aligning its start).
    pub fn largest_free(&self) -> u64 {
        self.free.values().copied().max().unwrap_or(0)
    }

    /// The length a request of `len` bytes takes: `len` aligned up. `None` if that
    /// overflows.
    pub fn aligned_len(&self, len: u64) -> Option<u64> {
        align_up(len, self.align)
    }

    /// Takes the first range that fits `len` bytes aligned up, its start aligned up.
    /// Returns its offset; its length is [`aligned_len`](Self::aligned_len)`(len)`.
    pub fn alloc(&mut self, len: u64) -> Option<u64> {
        let size = self.aligned_len(len)?;
        if size == 0 {
            return None;
        }
        let (ext_off, ext_len, start) = self.free.iter().find_map(|(&off, &l)| {
            let start = align_up(off, self.align)?;
            let fits = start.checked_add(size)? <= off + l;
            fits.then_some((off, l, start))
        })?;
        self.take(ext_off, ext_len, start, size);
        Some(start)
    }

    /// Takes `[offset, offset + len)` out of the free space, exactly: used to rebuild
    /// a pool from the persisted regions. Fails if any of it is not free.
    pub fn reserve(&mut self, offset: u64, len: u64) -> Result<(), ExtentError> {
        let end = self.check_range(offset, len)?;
        let not_free = ExtentError::NotFree {
            offset,
            length: len,
        };
        let (&ext_off, &ext_len) = self
            .free
            .range(..=offset)
            .next_back()
            .ok_or(not_free.clone())?;
        if ext_off + ext_len < end {
            return Err(not_free);
        }
        self.take(ext_off, ext_len, offset, len);
        Ok(())
    }

    /// Gives `[offset, offset + len)` back, merging it with free neighbours. Fails,
    /// changing nothing, if any of it is already free or outside the data area.
    pub fn free(&mut self, offset: u64, len: u64) -> Result<(), ExtentError> {
        let end = self.check_range(offset, len)?;
        let already = ExtentError::AlreadyFree {
            offset,
            length: len,
        };
        let before = self
            .free
            .range(..=offset)
            .next_back()
            .map(|(&o, &l)| (o, l));
        if let Some((o, l)) = before {
            if o + l > offset {
                return Err(already);
            }
        }
        let after = self.free.range(offset..).next().map(|(&o, &l)| (o, l));
        if let Some((o, _)) = after {
            if o < end {
                return Err(already);
            }
        }
        let mut new_off = offset;
        let mut new_len = len;
        if let Some((o, l)) = before {
            if o + l == offset {
                self.free.remove(&o);
                new_off = o;
                new_len += l;
            }
        }
        if let Some((o, l)) = after {
            if o == end {
                self.free.remove(&o);
                new_len += l;
            }
        }
        self.free.insert(new_off, new_len);
        self.free_bytes += len;
        Ok(())
    }

    /// The free extents, offset order (for tests and diagnostics).
    pub fn extents(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.free.iter().map(|(&o, &l)| (o, l))
    }

    fn check_range(&self, offset: u64, len: u64) -> Result<u64, ExtentError> {
        let out = ExtentError::OutOfRange {
            offset,
            length: len,
            start: self.start,
            end: self.end,
        };
        let end = offset.checked_add(len).ok_or(out.clone())?;
        if len == 0 || offset < self.start || end > self.end {
            return Err(out);
        }
        Ok(end)
    }

    /// Splits `[start, start + size)` out of the free extent `[ext_off, +ext_len)`,
    /// which contains it.
    fn take(&mut self, ext_off: u64, ext_len: u64, start: u64, size: u64) {
        self.free.remove(&ext_off);
        if start > ext_off {
            self.free.insert(ext_off, start - ext_off);
        }
        let tail = ext_off + ext_len - (start + size);
        if tail > 0 {
            self.free.insert(start + size, tail);
        }
        self.free_bytes -= size;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MB2: u64 = 2 << 20;

    #[test]
    fn first_fit_aligns_size_and_start() {
        // Data area starting off alignment: the first region starts at the next unit.
        let mut a = ExtentAllocator::new(4096, 4096 + 10 * MB2, MB2);
        let r1 = a.alloc(1).unwrap();
        assert_eq!(r1, MB2);
        assert_eq!(a.aligned_len(1), Some(MB2));
        let r2 = a.alloc(MB2 + 1).unwrap();
        assert_eq!(r2, 2 * MB2);
        // The unaligned head stays free, as does the tail.
        assert_eq!(a.free_bytes(), 10 * MB2 - 3 * MB2);
        assert_eq!(a.extents().next(), Some((4096, MB2 - 4096)));
        a.free(r1, MB2).unwrap();
        // The freed first unit merges with the head; the next fit reuses it.
        assert_eq!(a.extents().next(), Some((4096, 2 * MB2 - 4096)));
        assert_eq!(a.alloc(MB2), Some(MB2));
    }

    #[test]
    fn nothing_fits_and_zero_length() {
        let mut a = ExtentAllocator::new(MB2, 3 * MB2, MB2);
        assert_eq!(a.alloc(0), None);
        assert_eq!(a.alloc(3 * MB2), None);
        assert_eq!(a.alloc(u64::MAX), None);
        assert_eq!(a.alloc(2 * MB2), Some(MB2));
        assert_eq!(a.alloc(1), None);
        assert_eq!(a.largest_free(), 0);
    }

    #[test]
    fn reserve_and_free_errors() {
        let mut a = ExtentAllocator::new(MB2, 9 * MB2, MB2);
        a.reserve(3 * MB2, MB2).unwrap();
        assert_eq!(
            a.reserve(3 * MB2, MB2),
            Err(ExtentError::NotFree {
                offset: 3 * MB2,
                length: MB2
            })
        );
        assert!(matches!(
            a.reserve(2 * MB2, 2 * MB2),
            Err(ExtentError::NotFree { .. })
        ));
        assert!(matches!(
            a.reserve(0, MB2),
            Err(ExtentError::OutOfRange { .. })
        ));
        assert!(matches!(
            a.free(2 * MB2, MB2),
            Err(ExtentError::AlreadyFree { .. })
        ));
        assert!(matches!(
            a.free(3 * MB2, 2 * MB2),
            Err(ExtentError::AlreadyFree { .. })
        ));
        assert!(matches!(
            a.free(8 * MB2, 2 * MB2),
            Err(ExtentError::OutOfRange { .. })
        ));
        let before = a.free_bytes();
        a.free(3 * MB2, MB2).unwrap();
        assert_eq!(a.free_bytes(), before + MB2);
        assert_eq!(a.extents().collect::<Vec<_>>(), vec![(MB2, 8 * MB2)]);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Alloc(u64),
        Free(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (1u64..5 * 4096).prop_map(Op::Alloc),
            any::<usize>().prop_map(Op::Free),
        ]
    }

    proptest! {
        /// Live ranges never overlap, stay aligned and inside the area; free bytes plus
        /// live bytes is the whole area; freeing everything leaves one extent.
        #[test]
        fn random_alloc_free(head in 0u64..4096, ops in proptest::collection::vec(op(), 0..200)) {
            let align = 4096;
            let start = 4096 + head;
            let end = start + 64 * 4096;
            let mut a = ExtentAllocator::new(start, end, align);
            let mut live: Vec<(u64, u64)> = Vec::new();
            for op in ops {
                match op {
                    Op::Alloc(n) => {
                        if let Some(off) = a.alloc(n) {
                            let len = a.aligned_len(n).unwrap();
                            prop_assert_eq!(off % align, 0);
                            prop_assert!(off >= start && off + len <= end);
                            for &(o, l) in &live {
                                prop_assert!(off + len <= o || o + l <= off, "overlap");
                            }
                            live.push((off, len));
                        }
                    }
                    Op::Free(i) if !live.is_empty() => {
                        let (o, l) = live.swap_remove(i % live.len());
                        a.free(o, l).unwrap();
                    }
                    Op::Free(_) => {}
                }
                let used: u64 = live.iter().map(|&(_, l)| l).sum();
                prop_assert_eq!(a.free_bytes() + used, end - start);
                let listed: u64 = a.extents().map(|(_, l)| l).sum();
                prop_assert_eq!(listed, a.free_bytes());
            }
            for (o, l) in live.drain(..) {
                a.free(o, l).unwrap();
            }
            prop_assert_eq!(a.extents().collect::<Vec<_>>(), vec![(start, end - start)]);
        }
    }
}
