//! The agent's protection domains: one per owner of registrations (an authenticated
//! agent connection), holding that owner's memory registrations, with the owner's
//! responder queue pairs created in the same domain. The NIC accepts a remote key
//! only from a queue pair of the key's protection domain, so a worker that learns
//! another worker's key (read replies reveal addresses, mlx5 keys are guessable)
//! gets a remote access error, and nothing is read or written.
//!
//! A domain lives while it has registrations or its owner is open; once its owner
//! closed, it takes no new registration and goes with its last one (queue pairs keep
//! their own reference to the domain until they are destroyed, and the memory
//! registrations theirs, so rdma-core deallocates it only when nothing uses it).

use super::ops::{Access, MemoryOps, MrKeys};
use super::qp_table::QpOwner;
use crate::transport::TransportError;
use std::collections::HashMap;
use std::sync::Arc;

struct Domain<P> {
    pd: Arc<P>,
    /// Live registrations in it.
    mrs: usize,
    /// Its owner closed: no new registration, dropped when empty.
    closed: bool,
}

/// Makes a new, empty protection domain.
pub(crate) type NewDomain<P> = Box<dyn Fn() -> Result<P, String> + Send + Sync>;

/// The protection domains of a target, by owner, and which owner holds each key.
pub(crate) struct Domains<P> {
    new_domain: NewDomain<P>,
    by_owner: HashMap<QpOwner, Domain<P>>,
    owner_of: HashMap<u32, QpOwner>,
}

impl<P: MemoryOps> Domains<P> {
    pub fn new(new_domain: NewDomain<P>) -> Domains<P> {
        Domains {
            new_domain,
            by_owner: HashMap::new(),
            owner_of: HashMap::new(),
        }
    }

    /// `owner`'s domain, made now if it has none (for its queue pairs and keys).
    pub fn domain(&mut self, owner: QpOwner) -> Result<Arc<P>, TransportError> {
        if let Some(d) = self.by_owner.get(&owner) {
            if d.closed {
                return Err(TransportError::Setup(format!(
                    "{owner:?} closed: nothing more is registered or brought up for it"
                )));
            }
            return Ok(d.pd.clone());
        }
        let pd = Arc::new((self.new_domain)().map_err(TransportError::Setup)?);
        self.by_owner.insert(
            owner,
            Domain {
                pd: pd.clone(),
                mrs: 0,
                closed: false,
            },
        );
        Ok(pd)
    }

    /// Registers `len` bytes at `ptr` in `owner`'s domain.
    ///
    /// # Safety
    /// The range must stay mapped until [`Domains::deregister`] succeeded for its key.
    pub unsafe fn register(
        &mut self,
        owner: QpOwner,
        ptr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<MrKeys, TransportError> {
        let pd = self.domain(owner)?;
        // SAFETY: passed on to the caller.
        let keys = unsafe { pd.register(ptr, len, access) }.map_err(TransportError::Setup)?;
        if let Some(d) = self.by_owner.get_mut(&owner) {
            d.mrs += 1;
        }
        self.owner_of.insert(keys.rkey, owner);
        Ok(keys)
    }

    /// Deregisters `rkey` in the domain it lives in. A failure keeps it registered
    /// (retry).
    pub fn deregister(&mut self, rkey: u32) -> Result<(), TransportError> {
        let owner = *self.owner_of.get(&rkey).ok_or(TransportError::BadKey {
            rkey: u64::from(rkey),
        })?;
        let Some(d) = self.by_owner.get_mut(&owner) else {
            self.owner_of.remove(&rkey);
            return Err(TransportError::BadKey {
                rkey: u64::from(rkey),
            });
        };
        d.pd.deregister(rkey).map_err(TransportError::Setup)?;
        self.owner_of.remove(&rkey);
        d.mrs -= 1;
        if d.closed && d.mrs == 0 {
            self.by_owner.remove(&owner);
        }
        Ok(())
    }

    /// `owner` closed: its domain takes nothing new and goes with its last key.
    pub fn close(&mut self, owner: QpOwner) {
        match self.by_owner.get_mut(&owner) {
            Some(d) if d.mrs == 0 => {
                self.by_owner.remove(&owner);
            }
            Some(d) => d.closed = true,
            None => {}
        }
    }

    /// Live registrations, all domains.
    pub fn registrations(&self) -> usize {
        self.owner_of.len()
    }

    /// Domains kept (open owners and closed ones with registrations).
    pub fn len(&self) -> usize {
        self.by_owner.len()
    }

    #[cfg(test)]
    pub fn contains(&self, rkey: u32) -> bool {
        self.owner_of.contains_key(&rkey)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::verbs::fake::{FakeFabric, FakePd};

    fn domains(fabric: &Arc<FakeFabric>) -> Domains<FakePd> {
        let f = fabric.clone();
        Domains::new(Box::new(move || Ok(f.alloc_pd())))
    }

    const A: QpOwner = QpOwner::Connection(1);
    const B: QpOwner = QpOwner::Connection(2);

    /// The rule: a key is registered in its owner's domain, the owner's queue pair is
    /// made in that domain, and the NIC accepts a key only from a queue pair of its
    /// domain. Worker B's queue pair presenting worker A's key is refused.
    #[test]
    fn a_queue_pair_of_another_connection_cannot_use_a_key() {
        let fabric = Arc::new(FakeFabric::default());
        let mut d = domains(&fabric);
        let mut region = vec![0u8; 4096];
        // SAFETY: the fake never touches the memory.
        let ka =
            unsafe { d.register(A, region.as_mut_ptr(), 4096, Access::RemoteReadWrite) }.unwrap();
        let qp_a = d.domain(A).unwrap();
        let qp_b = d.domain(B).unwrap();
        assert!(qp_a.accepts(ka.rkey, true), "A's queue pair uses A's key");
        assert!(
            !qp_b.accepts(ka.rkey, true) && !qp_b.accepts(ka.rkey, false),
            "B's queue pair gets a remote access error with A's key"
        );
        assert_eq!(d.len(), 2);
        d.deregister(ka.rkey).unwrap();
        assert!(!qp_a.accepts(ka.rkey, false));
    }

    #[test]
    fn one_domain_per_owner_and_a_closed_owner_keeps_it_until_its_last_key_goes() {
        let fabric = Arc::new(FakeFabric::default());
        let mut d = domains(&fabric);
        let mut region = vec![0u8; 8192];
        let p = region.as_mut_ptr();
        // SAFETY: the fake never touches the memory.
        let k1 = unsafe { d.register(A, p, 4096, Access::RemoteReadWrite) }.unwrap();
        let k2 = unsafe { d.register(A, p, 4096, Access::RemoteRead) }.unwrap();
        assert_eq!(
            (fabric.domains_made(), d.len(), d.registrations()),
            (1, 1, 2)
        );
        d.close(A);
        assert_eq!(d.len(), 1, "kept: its keys are still registered");
        assert!(
            matches!(
                unsafe { d.register(A, p, 4096, Access::RemoteRead) },
                Err(TransportError::Setup(_))
            ),
            "a closed owner registers nothing new"
        );
        assert!(d.domain(A).is_err(), "nor brings up a queue pair");
        d.deregister(k1.rkey).unwrap();
        assert_eq!(d.len(), 1);
        d.deregister(k2.rkey).unwrap();
        assert_eq!((d.len(), d.registrations()), (0, 0));
        assert!(matches!(
            d.deregister(k2.rkey),
            Err(TransportError::BadKey { .. })
        ));
        // An owner closed with nothing registered leaves nothing behind.
        d.domain(B).unwrap();
        d.close(B);
        assert_eq!(d.len(), 0);
    }

    #[test]
    fn a_failed_deregistration_keeps_the_key_and_its_domain() {
        let fabric = Arc::new(FakeFabric::default());
        let mut d = domains(&fabric);
        let mut region = vec![0u8; 4096];
        // SAFETY: the fake never touches the memory.
        let k = unsafe { d.register(A, region.as_mut_ptr(), 4096, Access::RemoteRead) }.unwrap();
        let pd = d.domain(A).unwrap();
        d.close(A);
        pd.fail_deregistrations(1);
        assert!(d.deregister(k.rkey).is_err());
        assert!(d.contains(k.rkey) && pd.accepts(k.rkey, false));
        assert_eq!(d.len(), 1);
        d.deregister(k.rkey).unwrap();
        assert_eq!(d.len(), 0);
    }
}
