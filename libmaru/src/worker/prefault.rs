//! Prefaulting a `cxl` worker's own regions off the store path: one background
//! thread per mover faults each newly mapped region in with `MADV_POPULATE_WRITE`, a
//! step at a time (no byte changes); a kernel that refuses stops it, and stores fault
//! the pages themselves.

use crate::dax::{DaxError, Mapping};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

/// Bytes populated per `madvise` call: small enough that a close (which stops the
/// thread between steps) does not wait long, large enough to be cheap.
const STEP: usize = 2 << 20;

/// The nice value of the prefault thread: it uses CPU the stores leave idle.
const NICE: libc::c_int = 19;

/// Populates `len` bytes at `offset` of a mapping; `Ok(false)`: not supported here.
pub type PopulateFn = fn(&Mapping, usize, usize) -> Result<bool, DaxError>;

fn populate(m: &Mapping, offset: usize, len: usize) -> Result<bool, DaxError> {
    m.populate_range(offset, len)
}

/// What the prefault thread did, for stats and tests.
#[derive(Debug, Default)]
struct Progress {
    bytes: AtomicU64,
    regions: AtomicU64,
    /// Set when the kernel refused: no more prefaulting.
    off: AtomicBool,
    /// Jobs submitted and not finished (or skipped) yet.
    pending: Mutex<u64>,
    idle: Condvar,
}

impl Progress {
    fn finish_one(&self) {
        if let Ok(mut p) = self.pending.lock() {
            *p = p.saturating_sub(1);
            if *p == 0 {
                self.idle.notify_all();
            }
        }
    }
}

/// Counters of a prefaulter.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct PrefaultStats {
    /// Bytes populated.
    pub bytes: u64,
    /// Regions populated completely.
    pub regions: u64,
    /// True once the kernel refused (prefaulting is off from then on).
    pub off: bool,
}

/// A background thread that populates the mappings submitted to it, in order.
/// Started on the first submit; stopped (between two steps) on drop.
pub struct Prefaulter {
    tx: Option<Sender<Arc<Mapping>>>,
    thread: Option<JoinHandle<()>>,
    stop: Arc<AtomicBool>,
    progress: Arc<Progress>,
    populate: PopulateFn,
}

impl Default for Prefaulter {
    fn default() -> Self {
        Prefaulter::new()
    }
}

impl Prefaulter {
    pub fn new() -> Prefaulter {
        Prefaulter::with_populate(populate)
    }

    /// A prefaulter that populates with `f` (tests: a kernel that refuses).
    pub fn with_populate(f: PopulateFn) -> Prefaulter {
        Prefaulter {
            tx: None,
            thread: None,
            stop: Arc::new(AtomicBool::new(false)),
            progress: Arc::new(Progress::default()),
            populate: f,
        }
    }

    /// Queues `map` to be populated. Best effort: when prefaulting is off or the
    /// thread cannot start, nothing happens (the stores fault the pages in).
    pub fn submit(&mut self, map: Arc<Mapping>) {
        if self.progress.off.load(Ordering::SeqCst) {
            return;
        }
        if self.tx.is_none() && !self.start() {
            return;
        }
        if let Ok(mut p) = self.progress.pending.lock() {
            *p += 1;
        }
        let sent = self.tx.as_ref().is_some_and(|tx| tx.send(map).is_ok());
        if !sent {
            self.progress.finish_one();
        }
    }

    #[allow(clippy::disallowed_methods)] // a driver: starts the prefault thread
    fn start(&mut self) -> bool {
        let (tx, rx) = mpsc::channel();
        let (stop, progress, f) = (self.stop.clone(), self.progress.clone(), self.populate);
        match std::thread::Builder::new()
            .name("maru-prefault".into())
            .spawn(move || run(rx, &stop, &progress, f))
        {
            Ok(h) => {
                self.tx = Some(tx);
                self.thread = Some(h);
                true
            }
            Err(e) => {
                log::warn!("cannot start the prefault thread ({e}): stores fault their pages in");
                self.progress.off.store(true, Ordering::SeqCst);
                false
            }
        }
    }

    pub fn stats(&self) -> PrefaultStats {
        PrefaultStats {
            bytes: self.progress.bytes.load(Ordering::Relaxed),
            regions: self.progress.regions.load(Ordering::Relaxed),
            off: self.progress.off.load(Ordering::SeqCst),
        }
    }

    /// Waits until every submitted mapping was populated or skipped (tests).
    #[cfg(test)]
    pub fn wait_idle(&self) {
        let Ok(mut p) = self.progress.pending.lock() else {
            return;
        };
        while *p > 0 {
            p = match self.progress.idle.wait(p) {
                Ok(p) => p,
                Err(_) => return,
            };
        }
    }
}

impl Drop for Prefaulter {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        drop(self.tx.take());
        if let Some(h) = self.thread.take() {
            // At most one step (a few ms) away: the thread checks `stop` between steps.
            let _ = h.join();
        }
    }
}

fn run(rx: Receiver<Arc<Mapping>>, stop: &AtomicBool, progress: &Progress, f: PopulateFn) {
    // SAFETY: gettid and setpriority have no memory preconditions; on Linux a nice
    // value set for a thread id applies to that thread only.
    let r = unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        libc::setpriority(libc::PRIO_PROCESS, tid, NICE)
    };
    if r != 0 {
        log::debug!(
            "prefault thread keeps its priority: {}",
            std::io::Error::last_os_error()
        );
    }
    // Blocks (no CPU) until a mapping comes or the mover goes.
    for map in rx {
        populate_one(&map, stop, progress, f);
        // The mapping is let go here: a mover that dropped it meanwhile unmaps it now.
        drop(map);
        progress.finish_one();
    }
}

fn populate_one(map: &Mapping, stop: &AtomicBool, progress: &Progress, f: PopulateFn) {
    let mut offset = 0;
    while offset < map.len() {
        if stop.load(Ordering::SeqCst) || progress.off.load(Ordering::SeqCst) {
            return;
        }
        let n = STEP.min(map.len() - offset);
        match f(map, offset, n) {
            Ok(true) => {
                progress.bytes.fetch_add(n as u64, Ordering::Relaxed);
            }
            Ok(false) => {
                if !map.is_protected() {
                    log::info!(
                        "{}: the kernel does not support MADV_POPULATE_WRITE/READ: regions are not prefaulted (stores and loads fault their pages in)",
                        map.path()
                    );
                    progress.off.store(true, Ordering::SeqCst);
                }
                return;
            }
            Err(e) => {
                log::info!("prefaulting stopped: {e} (stores fault their pages in)");
                progress.off.store(true, Ordering::SeqCst);
                return;
            }
        }
        offset += n;
    }
    progress.regions.fetch_add(1, Ordering::Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dax::{self, test_support::ScratchPath, DeviceKind, DEFAULT_ALIGN};

    const UNIT: u64 = DEFAULT_ALIGN;

    fn mapping(tag: &str, units: u64) -> (ScratchPath, Arc<Mapping>) {
        let p = ScratchPath::new(tag);
        let f = std::fs::File::create(&p.0).expect("create scratch file");
        f.set_len(units * UNIT).expect("set_len");
        let m =
            dax::map_range(p.as_str(), DeviceKind::File, 0, units * UNIT, UNIT, true).expect("map");
        (p, Arc::new(m))
    }

    fn pattern(n: usize, seed: u8) -> Vec<u8> {
        (0..n).map(|i| (i as u8).wrapping_mul(31) ^ seed).collect()
    }

    #[test]
    fn prefaulting_keeps_the_bytes_stored_before_and_during_it() {
        let (p, m) = mapping("prefault-bytes", 3);
        let before = pattern(1 << 20, 7);
        m.write_at(12345, &before).expect("write");
        // Another mapping of the same range (another engine) sees the same bytes.
        let other = dax::map_range(p.as_str(), DeviceKind::File, 0, 3 * UNIT, UNIT, false)
            .expect("map read-only");
        let mut pf = Prefaulter::new();
        pf.submit(m.clone());
        let during = pattern(1 << 20, 99);
        m.write_at(2 * UNIT as usize + 4096, &during)
            .expect("write");
        pf.wait_idle();
        let s = pf.stats();
        assert!(s.off || s.bytes == 3 * UNIT, "{s:?}");
        if !s.off {
            assert_eq!(s.regions, 1);
        }
        let b = m.as_slice().expect("readable");
        assert_eq!(&b[12345..12345 + before.len()], &before[..]);
        assert_eq!(&b[2 * UNIT as usize + 4096..][..during.len()], &during[..]);
        assert!(b[..12345].iter().all(|&x| x == 0));
        let o = other.as_slice().expect("readable");
        assert_eq!(&o[12345..12345 + before.len()], &before[..]);
    }

    fn refuse(_: &Mapping, _: usize, _: usize) -> Result<bool, DaxError> {
        Ok(false)
    }

    fn fail(m: &Mapping, _: usize, _: usize) -> Result<bool, DaxError> {
        Err(DaxError::io(
            m.path(),
            "madvise(MADV_POPULATE)",
            std::io::Error::from_raw_os_error(libc::EPERM),
        ))
    }

    #[test]
    fn a_kernel_that_refuses_turns_prefaulting_off_cleanly() {
        for f in [refuse as PopulateFn, fail as PopulateFn] {
            let (_p, m) = mapping("prefault-refused", 2);
            m.write_at(100, b"kept").expect("write");
            let mut pf = Prefaulter::with_populate(f);
            pf.submit(m.clone());
            pf.wait_idle();
            let s = pf.stats();
            assert!(s.off, "{s:?}");
            assert_eq!((s.bytes, s.regions), (0, 0));
            // Later regions are not even queued; the mapping stays usable.
            let (_q, m2) = mapping("prefault-refused-2", 1);
            pf.submit(m2.clone());
            pf.wait_idle();
            m2.write_at(0, b"still writable").expect("write");
            assert_eq!(&m.as_slice().expect("readable")[100..104], b"kept");
        }
    }

    #[test]
    fn dropping_the_prefaulter_stops_it_and_lets_the_mapping_go() {
        let (_p, m) = mapping("prefault-drop", 4);
        let mut pf = Prefaulter::new();
        pf.submit(m.clone());
        pf.submit(m.clone());
        drop(pf);
        // The thread is gone and holds no reference any more.
        assert_eq!(Arc::strong_count(&m), 1);
    }
}
