//! The agent's responder queue pairs, keyed by the agent connection that brought them
//! up — never by an id the client declares, so no client can replace (or find)
//! another's. A connection's queue pairs are destroyed when it closes; a connection
//! that brings up more than its share replaces its own oldest; past the total cap a
//! new one is refused (live connections' queue pairs are never evicted). A queue pair
//! whose destroy failed is kept and its destroy retried on every sweep.

use super::ops::QueuePairOps;
use crate::transport::TransportError;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

/// Who a responder queue pair belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QpOwner {
    /// An authenticated agent connection (its id in the agent's event loop).
    Connection(u64),
    /// Brought up through [`Target::accept_peer`](crate::transport::Target::accept_peer),
    /// which carries no connection: keyed by the worker id the client declared (a
    /// random 64-bit number only that worker and the agent see). At the cap the
    /// oldest unbound owner's queue pairs are evicted, never a connection's.
    Unbound(u64),
}

pub(crate) struct QpTable {
    by_owner: HashMap<QpOwner, VecDeque<Arc<dyn QueuePairOps>>>,
    zombies: Vec<Arc<dyn QueuePairOps>>,
    /// Unbound owners, oldest first.
    unbound: VecDeque<QpOwner>,
    max_total: usize,
    max_per_owner: usize,
    /// Connections closed lately (at most [`CLOSED_MEMORY`]): a bring-up that finishes
    /// after its connection closed (it runs off the agent's loop) is destroyed, not
    /// kept for an owner that will never close again.
    closed: VecDeque<u64>,
}

/// Closed connections remembered (their ids are never reused; a bring-up outlives
/// its connection by at most its own duration).
const CLOSED_MEMORY: usize = 4096;

impl QpTable {
    pub fn new(max_total: usize, max_per_owner: usize) -> QpTable {
        QpTable {
            by_owner: HashMap::new(),
            zombies: Vec::new(),
            unbound: VecDeque::new(),
            max_total,
            max_per_owner: max_per_owner.max(1),
            closed: VecDeque::new(),
        }
    }

    /// Live queue pairs.
    pub fn len(&self) -> usize {
        self.by_owner.values().map(VecDeque::len).sum()
    }

    pub fn zombies(&self) -> usize {
        self.zombies.len()
    }

    /// Whether `owner` may bring up one more (checked before creating it); makes room
    /// by evicting the oldest unbound owner when that is the only way.
    pub fn admit(&mut self, owner: QpOwner) -> Result<(), TransportError> {
        if self.is_closed(owner) {
            return Err(closed_error(owner));
        }
        let own = self.by_owner.get(&owner).map_or(0, VecDeque::len);
        if own >= self.max_per_owner {
            // It replaces its own oldest.
            return Ok(());
        }
        while self.len() + self.zombies.len() >= self.max_total {
            let Some(oldest) = self.unbound.pop_front() else {
                break;
            };
            if oldest != owner {
                self.close(oldest);
            }
        }
        if self.len() + self.zombies.len() >= self.max_total {
            return Err(TransportError::Setup(format!(
                "the agent serves {} queue pairs already (at most {}); try again when other workers close",
                self.len(),
                self.max_total
            )));
        }
        Ok(())
    }

    fn is_closed(&self, owner: QpOwner) -> bool {
        matches!(owner, QpOwner::Connection(c) if self.closed.contains(&c))
    }

    /// Adds `qp` for `owner`, destroying the owner's oldest past its share. If the
    /// owner's connection closed meanwhile, `qp` is destroyed instead (`Err`).
    pub fn insert(
        &mut self,
        owner: QpOwner,
        qp: Arc<dyn QueuePairOps>,
    ) -> Result<(), TransportError> {
        if self.is_closed(owner) {
            self.retire(qp, "its connection closed during the bring-up");
            return Err(closed_error(owner));
        }
        if matches!(owner, QpOwner::Unbound(_)) && !self.unbound.contains(&owner) {
            self.unbound.push_back(owner);
        }
        let list = self.by_owner.entry(owner).or_default();
        list.push_back(qp);
        let mut retired = Vec::new();
        while list.len() > self.max_per_owner {
            if let Some(old) = list.pop_front() {
                retired.push(old);
            }
        }
        for old in retired {
            self.retire(old, "its connection brought up a newer one");
        }
        Ok(())
    }

    /// Destroys every queue pair of `owner` (its connection closed).
    pub fn close(&mut self, owner: QpOwner) -> usize {
        if let QpOwner::Connection(c) = owner {
            if !self.closed.contains(&c) {
                if self.closed.len() >= CLOSED_MEMORY {
                    self.closed.pop_front();
                }
                self.closed.push_back(c);
            }
        }
        self.unbound.retain(|o| *o != owner);
        let list = self.by_owner.remove(&owner).unwrap_or_default();
        let n = list.len();
        for qp in list {
            self.retire(qp, "its connection closed");
        }
        n
    }

    /// Destroys everything (the target closes). Returns how many stay undestroyed.
    pub fn close_all(&mut self) -> usize {
        let owners: Vec<QpOwner> = self.by_owner.keys().copied().collect();
        for o in owners {
            self.close(o);
        }
        self.retry();
        self.zombies.len()
    }

    /// Retries the destroy of every zombie.
    pub fn retry(&mut self) {
        self.zombies.retain(|qp| match qp.destroy() {
            Ok(()) => false,
            Err(e) => {
                log::debug!(
                    "verbs target: queue pair {} still not destroyed: {e}",
                    qp.qpn()
                );
                true
            }
        });
    }

    fn retire(&mut self, qp: Arc<dyn QueuePairOps>, why: &str) {
        match qp.destroy() {
            Ok(()) => log::debug!("verbs target: queue pair {} destroyed ({why})", qp.qpn()),
            Err(e) => {
                log::error!(
                    "verbs target: destroying queue pair {} ({why}) failed: {e}; retried by the sweep",
                    qp.qpn()
                );
                self.zombies.push(qp);
            }
        }
    }
}

fn closed_error(owner: QpOwner) -> TransportError {
    TransportError::Setup(format!(
        "{owner:?} closed: no queue pair is brought up for it"
    ))
}

#[cfg(test)]
mod tests {
    use super::super::fake::FakeQp;
    use super::*;

    fn qp(n: u32) -> Arc<FakeQp> {
        Arc::new(FakeQp::new(n))
    }

    /// A table (`max_total`, `max_per_owner`) with one queue pair brought up (admitted,
    /// then inserted) for each of `owners`, in order: QPNs 1, 2, ...
    fn brought_up(
        max_total: usize,
        max_per_owner: usize,
        owners: &[QpOwner],
    ) -> (QpTable, Vec<Arc<FakeQp>>) {
        let mut t = QpTable::new(max_total, max_per_owner);
        let qps: Vec<Arc<FakeQp>> = (1..=owners.len() as u32).map(qp).collect();
        for (&o, q) in owners.iter().zip(&qps) {
            t.admit(o).unwrap();
            t.insert(o, q.clone()).unwrap();
        }
        (t, qps)
    }

    #[test]
    fn a_connection_never_replaces_another_connections_queue_pair() {
        let (mut t, q) = brought_up(8, 2, &[QpOwner::Connection(1), QpOwner::Connection(2)]);
        let (a, b) = (&q[0], &q[1]);
        // Connection 2 brings up two more: its own oldest goes, connection 1's stays.
        t.insert(QpOwner::Connection(2), qp(3)).unwrap();
        t.insert(QpOwner::Connection(2), qp(4)).unwrap();
        assert!(!a.state().destroyed);
        assert!(b.state().destroyed);
        assert_eq!(t.len(), 3);
    }

    #[test]
    fn closing_a_connection_destroys_its_queue_pairs() {
        let (c1, c2) = (QpOwner::Connection(1), QpOwner::Connection(2));
        let (mut t, q) = brought_up(8, 4, &[c1, c1, c2]);
        let (a, b, c) = (&q[0], &q[1], &q[2]);
        assert_eq!(t.close(QpOwner::Connection(1)), 2);
        assert!(a.state().destroyed && b.state().destroyed);
        assert!(!c.state().destroyed);
        assert_eq!(t.len(), 1);
        assert_eq!(t.close(QpOwner::Connection(1)), 0);
    }

    #[test]
    fn past_the_cap_a_new_queue_pair_is_refused_and_no_live_one_is_evicted() {
        let (mut t, q) = brought_up(2, 4, &[QpOwner::Connection(1), QpOwner::Connection(2)]);
        let (a, b) = (&q[0], &q[1]);
        match t.admit(QpOwner::Connection(3)) {
            Err(TransportError::Setup(m)) => assert!(m.contains("at most 2"), "{m}"),
            other => panic!("{other:?}"),
        }
        assert!(!a.state().destroyed && !b.state().destroyed);
        t.close(QpOwner::Connection(1));
        t.admit(QpOwner::Connection(3)).unwrap();
    }

    #[test]
    fn at_the_cap_only_unbound_queue_pairs_are_evicted() {
        let (mut t, q) = brought_up(2, 1, &[QpOwner::Connection(1), QpOwner::Unbound(99)]);
        let (a, u) = (&q[0], &q[1]);
        t.admit(QpOwner::Connection(2)).unwrap();
        assert!(u.state().destroyed && !a.state().destroyed);
        t.insert(QpOwner::Connection(2), qp(3)).unwrap();
        assert!(t.admit(QpOwner::Unbound(5)).is_err());
    }

    #[test]
    fn a_failed_destroy_is_kept_counted_and_retried() {
        let mut t = QpTable::new(2, 4);
        let a = qp(1);
        a.state().destroy_failures = 1;
        t.insert(QpOwner::Connection(1), a.clone()).unwrap();
        t.close(QpOwner::Connection(1));
        assert_eq!((t.len(), t.zombies()), (0, 1));
        // A zombie still takes a place under the cap.
        t.insert(QpOwner::Connection(2), qp(2)).unwrap();
        assert!(t.admit(QpOwner::Connection(3)).is_err());
        t.retry();
        assert_eq!(t.zombies(), 0);
        assert!(a.state().destroyed);
        assert_eq!(t.close_all(), 0);
    }

    /// A bring-up that finishes after its connection closed (it runs off the agent's
    /// loop) leaves no queue pair behind.
    #[test]
    fn a_bring_up_that_outlives_its_connection_is_destroyed() {
        let mut t = QpTable::new(8, 2);
        t.admit(QpOwner::Connection(1)).unwrap();
        let late = qp(1);
        t.close(QpOwner::Connection(1));
        assert!(t.insert(QpOwner::Connection(1), late.clone()).is_err());
        assert!(late.state().destroyed);
        assert_eq!(t.len(), 0);
        assert!(t.admit(QpOwner::Connection(1)).is_err());
        t.admit(QpOwner::Connection(2)).unwrap();
    }
}
