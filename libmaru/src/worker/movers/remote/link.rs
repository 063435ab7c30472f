//! The control connection to one agent, used by one caller at a time (waiting at most
//! until its deadline), given back when the [`LinkLease`] drops. One per agent: on
//! verbs a registration lives in the connection's protection domain, and a soft data
//! connection is bound to the control connection that mapped its regions.

use crate::net::Link;
use crate::worker::clock::Deadline;
use std::ops::{Deref, DerefMut};
use std::sync::{Condvar, Mutex, MutexGuard};

pub(crate) struct AgentLink {
    slot: Mutex<Slot>,
    back: Condvar,
}

struct Slot {
    /// None while a caller has it.
    link: Option<Link>,
    /// Drop the connection before the next use (the agent restarted, or a data
    /// connection to it failed: the control connection likely went too).
    reset: bool,
}

impl AgentLink {
    pub(super) fn new(link: Link) -> AgentLink {
        AgentLink {
            slot: Mutex::new(Slot {
                link: Some(link),
                reset: false,
            }),
            back: Condvar::new(),
        }
    }

    fn slot(&self) -> MutexGuard<'_, Slot> {
        self.slot.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The connection, once no other caller has it, or None if another still has it
    /// at `deadline`.
    pub(super) fn take(&self, deadline: Deadline) -> Option<LinkLease<'_>> {
        let (s, _) = (self.back)
            .wait_timeout_while(self.slot(), deadline.left(), |s| s.link.is_none())
            .unwrap_or_else(|e| e.into_inner());
        self.lend(s)
    }

    /// The connection if no other caller has it now.
    pub(super) fn try_take(&self) -> Option<LinkLease<'_>> {
        self.lend(self.slot())
    }

    fn lend(&self, mut s: MutexGuard<'_, Slot>) -> Option<LinkLease<'_>> {
        let mut link = s.link.take()?;
        if std::mem::take(&mut s.reset) {
            link.reset();
        }
        Some(LinkLease {
            link: Some(link),
            home: self,
        })
    }

    /// Drops the connection before its next use (now, if no caller has it).
    pub(super) fn reset_later(&self) {
        let mut s = self.slot();
        match s.link.as_mut() {
            Some(l) => l.reset(),
            None => s.reset = true,
        }
    }
}

/// The connection, taken from its [`AgentLink`] until dropped.
pub(super) struct LinkLease<'a> {
    link: Option<Link>,
    home: &'a AgentLink,
}

impl Deref for LinkLease<'_> {
    type Target = Link;
    fn deref(&self) -> &Link {
        // Some until drop.
        self.link.as_ref().unwrap_or_else(|| unreachable!())
    }
}

impl DerefMut for LinkLease<'_> {
    fn deref_mut(&mut self) -> &mut Link {
        self.link.as_mut().unwrap_or_else(|| unreachable!())
    }
}

impl Drop for LinkLease<'_> {
    fn drop(&mut self) {
        let mut s = self.home.slot();
        if let Some(mut link) = self.link.take() {
            if std::mem::take(&mut s.reset) {
                link.reset();
            }
            s.link = Some(link);
        }
        drop(s);
        self.home.back.notify_one();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::ClientOptions;
    use std::time::Duration;

    fn link() -> AgentLink {
        AgentLink::new(Link::new("127.0.0.1:9", ClientOptions::new("test", "t")))
    }

    #[test]
    fn a_second_caller_waits_at_most_until_its_deadline() {
        let l = link();
        let first = l.take(Deadline::after(Duration::ZERO)).expect("free");
        assert!(l.try_take().is_none(), "one caller at a time");
        let d = Deadline::after(Duration::from_millis(30));
        assert!(l.take(d).is_none(), "still taken at the deadline");
        assert!(d.passed());
        drop(first);
        assert!(l.try_take().is_some(), "back once the lease drops");
    }

    #[test]
    fn a_lease_given_back_wakes_a_waiter() {
        let l = link();
        let first = l.take(Deadline::after(Duration::from_secs(1))).unwrap();
        std::thread::scope(|s| {
            let w = s.spawn(|| l.take(Deadline::after(Duration::from_secs(10))).is_some());
            std::thread::sleep(Duration::from_millis(20));
            drop(first);
            assert!(w.join().unwrap());
        });
    }
}
