//! Staging slots: one registered buffer split into fixed slots, in two independently
//! sized pools (loads, stores), so neither side starves the other. A [`Slot`] is
//! owned and goes back to its pool when dropped: exactly once by construction (a
//! transfer of unknown outcome keeps its slots by keeping the values: `isolation`).

use super::condition::Condition;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SlotPool {
    Load,
    Store,
}

impl fmt::Display for SlotPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SlotPool::Load => "load",
            SlotPool::Store => "store",
        })
    }
}

/// Sizes of the staging buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StagingLayout {
    pub slot_size: usize,
    pub load_slots: usize,
    pub store_slots: usize,
}

impl StagingLayout {
    pub fn total_bytes(&self) -> usize {
        self.slot_size * (self.load_slots + self.store_slots)
    }

    /// The slots of one pool (0: the handler has none of that kind).
    pub fn slots(&self, pool: SlotPool) -> usize {
        match pool {
            SlotPool::Load => self.load_slots,
            SlotPool::Store => self.store_slots,
        }
    }

    /// Checks the layout against one request's working set: `chunk` bytes per slot,
    /// `min_load` and `min_store` slots at least. A configured size that cannot hold
    /// that is a configuration error (reported at open, never retried).
    pub fn validate(&self, chunk: usize, min_load: usize, min_store: usize) -> Result<(), String> {
        if self.slot_size < chunk {
            return Err(format!(
                "staging slot size {} is smaller than the chunk size {chunk}",
                self.slot_size
            ));
        }
        if self.load_slots < min_load {
            return Err(format!(
                "{} load slots cannot hold one request's load batch of {min_load} chunks; raise the load staging size",
                self.load_slots
            ));
        }
        if self.store_slots < min_store {
            return Err(format!(
                "{} store slots cannot hold one step's {min_store} chunks; raise the store staging size",
                self.store_slots
            ));
        }
        Ok(())
    }
}

/// The free slots of each pool, by `SlotPool as usize`.
type FreeLists = [Vec<usize>; 2];

struct Inner {
    layout: StagingLayout,
    free: Mutex<FreeLists>,
    /// Notified by every slot that comes back (one per chunk of a transfer through
    /// slots), waited on only by an `acquire` that found none free: a [`Condition`],
    /// whose notify makes no system call while nobody waits.
    cv: Condition,
    /// The buffer itself (owned here so it outlives every slot).
    buf: Buffer,
}

// SAFETY: the raw base pointer is only dereferenced through slots, each of which is
// owned by one holder at a time.
unsafe impl Send for Inner {}
unsafe impl Sync for Inner {}

/// Anonymous memory for the staging buffer, aligned to 2 MiB and advised to use
/// transparent huge pages (512 times fewer pages to touch and to register); without
/// them it stays on 4 KiB pages, which works the same.
struct Buffer {
    ptr: *mut u8,
    len: usize,
}

/// The alignment (and huge-page size) of the staging buffer.
const HUGE: usize = 2 << 20;

impl Buffer {
    fn new(len: usize) -> std::io::Result<Buffer> {
        if len == 0 {
            // No slot at all (a handler that only looks keys up): no mapping.
            return Ok(Buffer {
                ptr: std::ptr::NonNull::dangling().as_ptr(),
                len: 0,
            });
        }
        // Room to slide the start to a 2 MiB boundary; the slack is unmapped below.
        let span = len
            .checked_add(HUGE)
            .ok_or_else(|| std::io::Error::other("staging buffer size overflows"))?;
        // SAFETY: an anonymous private mapping; checked for MAP_FAILED.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                span,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        let base = p as usize;
        let start = (base + HUGE - 1) & !(HUGE - 1);
        let (head, tail) = (start - base, span - (start - base) - len);
        // SAFETY: both pieces lie inside the mapping just made and outside
        // `start..start + len`; unmapping them leaves the buffer itself mapped.
        unsafe {
            if head > 0 {
                libc::munmap(p, head);
            }
            if tail > 0 {
                libc::munmap((start + len) as *mut libc::c_void, tail);
            }
        }
        // SAFETY: advice on the buffer's own range; it changes no byte.
        if unsafe { libc::madvise(start as *mut libc::c_void, len, libc::MADV_HUGEPAGE) } != 0 {
            log::debug!(
                "staging buffer: no transparent huge pages ({}); 4 KiB pages",
                std::io::Error::last_os_error()
            );
        }
        Ok(Buffer {
            ptr: start as *mut u8,
            len,
        })
    }

    /// Faults every page in now (see [`StagingSlots::populate`]).
    fn populate(&self) {
        if self.len == 0 {
            return;
        }
        // SAFETY: the buffer's own range, mapped and writable; populating it changes
        // no byte.
        let r = unsafe {
            libc::madvise(
                self.ptr.cast(),
                self.len,
                crate::dax::map::MADV_POPULATE_WRITE,
            )
        };
        if r == 0 {
            return;
        }
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::EINVAL) {
            // Before Linux 5.14: touch each page; the buffer is fresh, all zeros.
            for at in (0..self.len).step_by(4096) {
                // SAFETY: `at` lies inside the buffer, which no slot holder has yet.
                unsafe { self.ptr.add(at).write_volatile(0) };
            }
            return;
        }
        log::warn!(
            "staging buffer: cannot fault its {} bytes in ahead ({err}); transfers fault them in on first use",
            self.len
        );
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        if self.len == 0 {
            return; // nothing was mapped
        }
        // SAFETY: unmapping what `new` mapped.
        unsafe {
            libc::munmap(self.ptr.cast(), self.len);
        }
    }
}

/// The staging buffer and its slot pools.
#[derive(Clone)]
pub struct StagingSlots {
    inner: Arc<Inner>,
}

/// One slot, owned. Dropping it returns it to its pool.
pub struct Slot {
    index: usize,
    pool: SlotPool,
    inner: Arc<Inner>,
}

impl fmt::Debug for Slot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Slot({} {})", self.pool, self.index)
    }
}

impl StagingSlots {
    pub fn new(layout: StagingLayout) -> std::io::Result<StagingSlots> {
        let buf = Buffer::new(layout.total_bytes())?;
        let free = [
            (0..layout.load_slots).rev().collect(),
            (layout.load_slots..layout.load_slots + layout.store_slots)
                .rev()
                .collect(),
        ];
        Ok(StagingSlots {
            inner: Arc::new(Inner {
                layout,
                free: Mutex::new(free),
                cv: Condition::default(),
                buf,
            }),
        })
    }

    pub fn layout(&self) -> StagingLayout {
        self.inner.layout
    }

    /// Faults every page of the buffer in now, as an RDMA registration would, so no
    /// transfer stops to have a page zeroed (0.3–0.4 s stalls seen with 4 engines).
    /// Best effort.
    pub fn populate(&self) {
        self.inner.buf.populate();
    }

    /// The whole buffer (to register with the transport and the memory hook); null
    /// and 0 bytes for a layout of no slots.
    pub fn buffer(&self) -> (*mut u8, usize) {
        match self.inner.layout.total_bytes() {
            0 => (std::ptr::null_mut(), 0),
            len => (self.inner.buf.ptr, len),
        }
    }

    /// Free slots of a pool now.
    pub fn free(&self, pool: SlotPool) -> usize {
        self.inner
            .free
            .lock()
            .map(|f| f[pool as usize].len())
            .unwrap_or(0)
    }

    /// Takes up to `n` free slots of `pool` without waiting (maybe none).
    pub fn try_acquire(&self, pool: SlotPool, n: usize) -> Vec<Slot> {
        let Ok(mut f) = self.inner.free.lock() else {
            return Vec::new();
        };
        self.take(&mut f, pool, n)
    }

    /// Takes between 1 and `n` slots, waiting up to `timeout` for at least one.
    pub fn acquire(&self, pool: SlotPool, n: usize, timeout: Duration) -> Vec<Slot> {
        let Ok(f) = self.inner.free.lock() else {
            return Vec::new();
        };
        // A pool of no slots never has one free: no wait.
        let wait = n > 0 && self.inner.layout.slots(pool) > 0;
        let none_free = |f: &mut FreeLists| wait && f[pool as usize].is_empty();
        match self.inner.cv.wait_timeout_while(f, timeout, none_free) {
            Ok((mut f, _)) => self.take(&mut f, pool, n),
            Err(_) => Vec::new(),
        }
    }

    fn take(&self, f: &mut FreeLists, pool: SlotPool, n: usize) -> Vec<Slot> {
        let l = &mut f[pool as usize];
        let k = n.min(l.len());
        let at = l.len() - k;
        l.drain(at..)
            .map(|index| Slot {
                index,
                pool,
                inner: self.inner.clone(),
            })
            .collect()
    }
}

impl Slot {
    pub fn pool(&self) -> SlotPool {
        self.pool
    }

    pub fn index(&self) -> usize {
        self.index
    }

    /// Offset of the slot in the staging buffer.
    pub fn offset(&self) -> usize {
        self.index * self.inner.layout.slot_size
    }

    pub fn len(&self) -> usize {
        self.inner.layout.slot_size
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn as_ptr(&self) -> *mut u8 {
        // SAFETY: offset is inside the buffer by construction of the slot index.
        unsafe { self.inner.buf.ptr.add(self.offset()) }
    }

    /// The slot's bytes. Not to be used while a transfer into it is in flight.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: the slot is owned by `self`; no other slot overlaps it.
        unsafe { std::slice::from_raw_parts(self.as_ptr(), self.len()) }
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, exclusively.
        unsafe { std::slice::from_raw_parts_mut(self.as_ptr(), self.len()) }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Ok(mut f) = self.inner.free.lock() {
            f[self.pool as usize].push(self.index);
        }
        self.inner.cv.notify_all();
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)] // tests drive threads and clocks
mod tests {
    use super::*;
    use std::time::Instant;

    /// After `populate`, every page of the buffer is in memory before any slot is
    /// used (`mincore`), so no transfer stops to fault one in.
    #[test]
    fn every_page_of_a_populated_buffer_is_in_memory() {
        let len = 3 * HUGE + 4096;
        let b = Buffer::new(len).unwrap();
        b.populate();
        let pages = len.div_ceil(4096);
        let mut resident = vec![0u8; pages];
        // SAFETY: the buffer's own, page-aligned range and a vector of one byte per page.
        let r = unsafe { libc::mincore(b.ptr.cast(), len, resident.as_mut_ptr()) };
        assert_eq!(r, 0, "mincore: {}", std::io::Error::last_os_error());
        let missing = resident.iter().filter(|&&v| v & 1 == 0).count();
        assert_eq!(missing, 0, "{missing} of {pages} pages not in memory");
    }

    #[test]
    fn the_buffer_starts_on_a_huge_page_boundary_and_every_byte_is_usable() {
        for len in [2, 4096, HUGE, 3 * HUGE + 5] {
            let b = Buffer::new(len).unwrap();
            assert_eq!(b.ptr as usize % HUGE, 0, "len {len}");
            assert_eq!(b.len, len);
            // SAFETY: the buffer's own range.
            let bytes = unsafe { std::slice::from_raw_parts_mut(b.ptr, b.len) };
            bytes[0] = 1;
            bytes[len - 1] = 2;
            assert_eq!((bytes[0], bytes[len - 1]), (1, 2));
        }
    }

    /// A handler configured with no slots (a process that only looks keys up) maps no
    /// staging memory, and asking a pool of no slots for one answers at once instead
    /// of waiting out the timeout.
    #[test]
    fn no_slots_map_nothing_and_never_wait() {
        let none = slots(0, 0);
        assert_eq!(none.buffer().1, 0);
        none.populate();
        let t = Instant::now();
        assert!(none
            .acquire(SlotPool::Load, 1, Duration::from_secs(5))
            .is_empty());
        assert!(none
            .acquire(SlotPool::Store, 4, Duration::from_secs(5))
            .is_empty());
        assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
        // One kind only: the other still lends and waits as before.
        let loads = slots(2, 0);
        assert!(loads
            .acquire(SlotPool::Store, 1, Duration::from_secs(5))
            .is_empty());
        assert_eq!(loads.acquire(SlotPool::Load, 3, Duration::ZERO).len(), 2);
    }

    fn slots(l: usize, s: usize) -> StagingSlots {
        StagingSlots::new(StagingLayout {
            slot_size: 4096,
            load_slots: l,
            store_slots: s,
        })
        .unwrap()
    }

    #[test]
    fn pools_are_independent() {
        let st = slots(2, 3);
        let stores = st.try_acquire(SlotPool::Store, 10);
        assert_eq!(stores.len(), 3);
        // Stores holding every store slot leave the load slots alone.
        let loads = st.try_acquire(SlotPool::Load, 10);
        assert_eq!(loads.len(), 2);
        assert!(st
            .acquire(SlotPool::Store, 1, Duration::from_millis(10))
            .is_empty());
        drop(stores);
        assert_eq!(st.free(SlotPool::Store), 3);
        assert_eq!(st.free(SlotPool::Load), 0);
        drop(loads);
        assert_eq!(st.free(SlotPool::Load), 2);
    }

    #[test]
    fn slots_do_not_overlap_and_return_once() {
        let st = slots(3, 3);
        let mut all = st.try_acquire(SlotPool::Load, 3);
        all.extend(st.try_acquire(SlotPool::Store, 3));
        let mut offs: Vec<usize> = all.iter().map(|s| s.offset()).collect();
        offs.sort();
        offs.dedup();
        assert_eq!(offs.len(), 6);
        for (i, s) in all.iter_mut().enumerate() {
            s.bytes_mut().fill(i as u8);
        }
        for (i, s) in all.iter().enumerate() {
            assert!(s.bytes().iter().all(|&b| b == i as u8));
        }
        drop(all);
        assert_eq!(st.free(SlotPool::Load) + st.free(SlotPool::Store), 6);
    }

    /// Seen failing with the notify of a slot's drop skipped (the waiter sat out its
    /// 10 s).
    #[test]
    fn a_waiter_gets_a_slot_when_one_comes_back() {
        let st = slots(1, 0);
        let held = st.try_acquire(SlotPool::Load, 1);
        let st2 = st.clone();
        let t = std::thread::spawn(move || {
            let start = std::time::Instant::now();
            let got = st2
                .acquire(SlotPool::Load, 1, Duration::from_secs(10))
                .len();
            (got, start.elapsed())
        });
        std::thread::sleep(Duration::from_millis(20));
        drop(held);
        let (got, took) = t.join().unwrap();
        assert_eq!(got, 1);
        assert!(took < Duration::from_secs(5), "woken after {took:?}");
    }

    #[test]
    fn validate_rejects_a_layout_that_cannot_hold_a_request() {
        let l = StagingLayout {
            slot_size: 1 << 20,
            load_slots: 4,
            store_slots: 8,
        };
        assert!(l.validate(1 << 20, 4, 8).is_ok());
        assert!(l
            .validate(2 << 20, 4, 8)
            .unwrap_err()
            .contains("chunk size"));
        assert!(l.validate(1 << 20, 5, 8).unwrap_err().contains("load"));
        assert!(l.validate(1 << 20, 4, 9).unwrap_err().contains("store"));
    }
}
