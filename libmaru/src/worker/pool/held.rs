//! The pages a session holds without a key (from an `alloc` until freed or published
//! into), for the report a restarted maru-server asks for. Complete when sent: the
//! calls that change them each hold a [`CallGuard`] until their answer is noted, and
//! the report waits for none in flight (see `docs/worker.md`).

use crate::wire::meta::{PageGrant, PageRef, MAX_HELD_PAGES};
use crate::worker::clock::Deadline;
use crate::worker::condition::Condition;
use crate::worker::error::WorkerError;
use std::collections::BTreeSet;
use std::sync::{Mutex, MutexGuard};

#[derive(Debug, Default)]
struct State {
    /// (region, page) handed out and not yet freed or published.
    pages: BTreeSet<(u64, u64)>,
    /// Calls in flight that change `pages`.
    calls: usize,
    /// A report is being made: no such call starts.
    reporting: bool,
}

/// The pages held and the gate between the calls that change them and the report.
#[derive(Debug, Default)]
pub struct HeldPages {
    state: Mutex<State>,
    changed: Condition,
}

/// A call that changes what is held, in flight (see the module docs): what its
/// answer did is noted through it; dropping it ends the call.
pub struct CallGuard<'a> {
    held: &'a HeldPages,
}

/// Why a report was not sent.
#[derive(Debug, thiserror::Error)]
pub enum NoReport {
    #[error("another report is being made")]
    Busy,
    #[error("calls in flight did not end by the call timeout")]
    Timeout,
    #[error("{0} pages held, more than a report names ({max}); those a restarted maru-server found allocated without a key stay the session's until their region goes", max = MAX_HELD_PAGES)]
    TooMany(usize),
}

impl HeldPages {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts a call that changes what is held: waits (at most until `by`) while a
    /// report is being made. `op` at maru-server `url`: the call, for the error.
    pub fn enter(&self, by: Deadline, op: &str, url: &str) -> Result<CallGuard<'_>, WorkerError> {
        let (mut s, _) = (self.changed)
            .wait_timeout_while(self.lock(), by.left(), |s| s.reporting)
            .unwrap_or_else(|e| e.into_inner());
        if s.reporting {
            return Err(WorkerError::Timeout(format!(
                "{op} at maru-server {url}: waited until the request's deadline for the report of the pages \
                 this session holds to a restarted maru-server"
            )));
        }
        s.calls += 1;
        Ok(CallGuard { held: self })
    }

    /// Whether a report is being made.
    #[cfg(test)]
    pub fn reporting(&self) -> bool {
        self.lock().reporting
    }

    /// Pages held now.
    #[cfg(test)]
    pub fn count(&self) -> usize {
        self.lock().pages.len()
    }

    /// The pages of a region the session no longer holds go (they went with it).
    pub fn region_gone(&self, region: u64) {
        self.lock().pages.retain(|&(r, _)| r != region);
    }

    /// Makes a report: waits (at most until `by`) until no call that changes what is
    /// held is in flight, keeps new ones waiting, and hands the pages held to `send`
    /// (the heartbeat that carries them); new calls go on once it returned.
    pub fn report<T>(
        &self,
        by: Deadline,
        send: impl FnOnce(Vec<PageRef>) -> T,
    ) -> Result<T, NoReport> {
        let pages = {
            let mut s = self.lock();
            if s.reporting {
                return Err(NoReport::Busy);
            }
            if s.pages.len() > MAX_HELD_PAGES {
                return Err(NoReport::TooMany(s.pages.len()));
            }
            s.reporting = true;
            let (mut s, _) = (self.changed)
                .wait_timeout_while(s, by.left(), |s| s.calls > 0)
                .unwrap_or_else(|e| e.into_inner());
            let why = match (s.calls, s.pages.len()) {
                (0, n) if n <= MAX_HELD_PAGES => None,
                (0, n) => Some(NoReport::TooMany(n)),
                _ => Some(NoReport::Timeout),
            };
            if let Some(why) = why {
                s.reporting = false;
                drop(s);
                self.changed.notify_all();
                return Err(why);
            }
            s.pages
                .iter()
                .map(|&(region_id, page)| PageRef { region_id, page })
                .collect()
        };
        let out = send(pages);
        self.lock().reporting = false;
        self.changed.notify_all();
        Ok(out)
    }
}

impl CallGuard<'_> {
    /// An `alloc` reply handed these pages out.
    pub fn granted(&self, pages: &[PageGrant]) {
        let mut s = self.held.lock();
        s.pages.extend(pages.iter().map(|p| (p.region_id, p.page)));
    }

    /// These pages are no longer held: freed (a `free_pages` about to be sent), or
    /// holding a key the worker published (or may have: its answer never came).
    pub fn released(&self, pages: impl IntoIterator<Item = (u64, u64)>) {
        let mut s = self.held.lock();
        for p in pages {
            s.pages.remove(&p);
        }
    }
}

impl Drop for CallGuard<'_> {
    fn drop(&mut self) {
        let mut s = self.held.lock();
        s.calls = s.calls.saturating_sub(1);
        drop(s);
        self.held.changed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::time::Duration;

    fn page(region_id: u64, page: u64) -> PageGrant {
        PageGrant {
            region_id,
            page,
            offset: page << 20,
            length: 1 << 20,
        }
    }

    fn soon() -> Deadline {
        Deadline::after(Duration::from_secs(5))
    }

    /// A store whose alloc is in flight when the report is asked for keeps its pages:
    /// the report waits for the alloc's answer and names them, and a call started
    /// while the report is being made waits for it.
    #[test]
    fn a_store_in_progress_across_the_report_keeps_its_pages() {
        let held = HeldPages::default();
        held.enter(soon(), "alloc", "s")
            .unwrap()
            .granted(&[page(1, 0), page(1, 1)]);
        let (entered_tx, entered_rx) = mpsc::channel();
        let (go_tx, go_rx) = mpsc::channel::<()>();
        std::thread::scope(|t| {
            let held = &held;
            let store = t.spawn(move || {
                let g = held.enter(soon(), "alloc", "s").unwrap();
                entered_tx.send(()).unwrap();
                // The old run's reply is read only after the report was asked for.
                go_rx.recv().unwrap();
                while !held.reporting() {
                    std::thread::sleep(Duration::from_millis(1));
                }
                g.granted(&[page(1, 7)]);
            });
            entered_rx.recv().unwrap();
            let reporter = t.spawn(move || {
                held.report(soon(), |pages| {
                    // While the report is out, a new call waits for it.
                    let blocked =
                        held.enter(Deadline::after(Duration::from_millis(30)), "alloc", "s");
                    assert!(blocked.is_err(), "a call must wait for the report");
                    pages
                })
            });
            go_tx.send(()).unwrap();
            store.join().unwrap();
            let pages = reporter.join().unwrap().unwrap();
            let named: Vec<(u64, u64)> = pages.iter().map(|p| (p.region_id, p.page)).collect();
            assert_eq!(named, vec![(1, 0), (1, 1), (1, 7)]);
        });
        // After the report, calls go on.
        let g = held.enter(soon(), "free_pages", "s").unwrap();
        g.released([(1, 0)]);
        drop(g);
        assert_eq!(held.count(), 2);
    }

    #[test]
    fn a_report_gives_up_while_a_call_stays_in_flight_and_calls_then_go_on() {
        let held = HeldPages::default();
        let g = held.enter(soon(), "alloc", "s").unwrap();
        let r = held.report(Deadline::after(Duration::from_millis(20)), |p| p.len());
        assert!(matches!(r, Err(NoReport::Timeout)), "{r:?}");
        // The gate opened again: another call starts at once.
        drop(
            held.enter(Deadline::after(Duration::ZERO), "alloc", "s")
                .unwrap(),
        );
        drop(g);
        assert_eq!(held.report(soon(), |p| p.len()).unwrap(), 0);
    }

    #[test]
    fn pages_freed_published_or_of_a_region_gone_are_not_named() {
        let held = HeldPages::default();
        let g = held.enter(soon(), "alloc", "s").unwrap();
        g.granted(&[page(1, 0), page(1, 1), page(2, 0), page(3, 4)]);
        g.released([(1, 1)]);
        drop(g);
        held.region_gone(2);
        let named = held.report(soon(), |p| p).unwrap();
        assert_eq!(
            named,
            vec![
                PageRef {
                    region_id: 1,
                    page: 0
                },
                PageRef {
                    region_id: 3,
                    page: 4
                }
            ]
        );
    }

    #[test]
    fn more_pages_than_a_report_may_name_are_not_reported() {
        let held = HeldPages::default();
        let g = held.enter(soon(), "alloc", "s").unwrap();
        let many: Vec<PageGrant> = (0..=MAX_HELD_PAGES as u64).map(|p| page(1, p)).collect();
        g.granted(&many);
        drop(g);
        let r = held.report(soon(), |p| p.len());
        assert!(matches!(r, Err(NoReport::TooMany(n)) if n == MAX_HELD_PAGES + 1));
    }
}
