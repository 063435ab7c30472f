//! One region mapped at this agent: its range, its registrations and who holds them.
//!
//! A region is mapped once and shared by every holder, but each holder (an agent
//! connection) gets registrations of its own, one per kind of access ([`Grant`]):
//! the NIC puts them in that connection's protection domain, so a key works only on
//! the queue pair of the connection it was issued to, a reader's key can never
//! write, and a keeper that only holds the region gets no write key either. A
//! registration lives while its holder holds it; a deregistration that fails keeps
//! its key in `stuck`, and
//! until the sweep deregisters it the region is neither unmapped nor unheld: the NIC
//! may still accept that key.

use super::ports::{MappedRange, NicPort, Registration};
use crate::wire::agent::{MappingInfo, MappingState};
use crate::wire::rm::Handle;
use std::collections::{BTreeMap, BTreeSet};

/// What one registration of a region lets peers do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Grant {
    /// The whole region, remote WRITE allowed when `writable`.
    Whole { writable: bool },
    /// `length` bytes at `offset` of the region, remote READ only (a read handle).
    Range { offset: u64, length: u64 },
}

impl Grant {
    /// Where the granted range starts in the region and how long it is.
    pub fn span(self, region_len: u64) -> (u64, u64) {
        match self {
            Grant::Whole { .. } => (0, region_len),
            Grant::Range { offset, length } => (offset, length),
        }
    }

    pub fn writable(self) -> bool {
        matches!(self, Grant::Whole { writable: true })
    }
}

/// A key whose deregistration failed, with the last error.
#[derive(Debug)]
struct Stuck {
    rkey: u64,
    error: String,
}

#[derive(Debug)]
pub(crate) struct RegionMapping {
    /// The handle the RM accepted when the region was mapped.
    pub handle: Handle,
    pub range: MappedRange,
    /// One registration per holder and grant.
    slots: BTreeMap<(String, Grant), Registration>,
    stuck: Vec<Stuck>,
    /// Going away (released, refused by the RM, or out of holders): takes no new
    /// holder, and leaves the table once every key is deregistered.
    pub retiring: bool,
    pub released: bool,
}

impl RegionMapping {
    /// A freshly mapped and registered region with its first holder.
    pub fn new(
        handle: Handle,
        range: MappedRange,
        grant: Grant,
        reg: Registration,
        client: &str,
    ) -> RegionMapping {
        let mut m = RegionMapping {
            handle,
            range,
            slots: BTreeMap::new(),
            stuck: Vec::new(),
            retiring: false,
            released: false,
        };
        m.add_registration(grant, reg, client);
        m
    }

    /// `client`'s registration for `grant`, if it has one.
    pub fn registration(&self, grant: Grant, client: &str) -> Option<&Registration> {
        self.slots.get(&(client.to_string(), grant))
    }

    pub fn add_registration(&mut self, grant: Grant, reg: Registration, client: &str) {
        self.slots.insert((client.to_string(), grant), reg);
    }

    pub fn holds(&self, client: &str) -> bool {
        self.slots.keys().any(|(c, _)| c == client)
    }

    /// No registration is left: the region has no holder.
    pub fn unused(&self) -> bool {
        self.slots.is_empty()
    }

    /// Nothing registered and nothing stuck: the range may go to quarantine and
    /// the hold to the RM.
    pub fn clean(&self) -> bool {
        self.slots.is_empty() && self.stuck.is_empty()
    }

    /// The last deregistration error of a stuck key, if any is stuck.
    pub fn stuck_error(&self) -> Option<&str> {
        self.stuck.last().map(|s| s.error.as_str())
    }

    /// Drops `client` from every registration (only from read handles when
    /// `reads_only`) and deregisters its registrations. Returns whether
    /// the client held anything that was dropped.
    pub fn drop_holder(&mut self, client: &str, reads_only: bool, nic: &mut dyn NicPort) -> bool {
        let gone: Vec<(String, Grant)> = self
            .slots
            .keys()
            .filter(|(c, g)| c == client && (!reads_only || matches!(g, Grant::Range { .. })))
            .cloned()
            .collect();
        for k in &gone {
            if let Some(reg) = self.slots.remove(k) {
                self.deregister(reg.rkey, nic);
            }
        }
        !gone.is_empty()
    }

    /// Deregisters every registration whoever holds it (release, or the RM no
    /// longer knows the handle).
    pub fn deregister_all(&mut self, nic: &mut dyn NicPort) {
        for (_, reg) in std::mem::take(&mut self.slots) {
            self.deregister(reg.rkey, nic);
        }
    }

    /// Tries the failed deregistrations again; keeps the ones that fail again.
    pub fn retry_stuck(&mut self, nic: &mut dyn NicPort) {
        let region_id = self.handle.region_id;
        self.stuck.retain_mut(|s| match nic.deregister(s.rkey) {
            Ok(()) => {
                log::info!("region {region_id}: key {} deregistered on retry", s.rkey);
                false
            }
            Err(e) => {
                s.error = e;
                true
            }
        });
    }

    fn deregister(&mut self, rkey: u64, nic: &mut dyn NicPort) {
        if let Err(error) = nic.deregister(rkey) {
            log::warn!(
                "region {}: deregistration of key {rkey} failed: {error}; the range stays \
                 mapped and held until the sweep deregisters it",
                self.handle.region_id
            );
            self.stuck.push(Stuck { rkey, error });
        }
    }

    pub fn info(&self) -> MappingInfo {
        let holders: BTreeSet<&str> = self.slots.keys().map(|(c, _)| c.as_str()).collect();
        MappingInfo {
            region_id: self.handle.region_id,
            offset: self.handle.offset,
            length: self.handle.length,
            state: if self.retiring {
                MappingState::Retiring
            } else {
                MappingState::Live
            },
            released: self.released,
            holders: holders.into_iter().map(str::to_string).collect(),
            registrations: self.slots.len(),
            failed_deregistrations: self.stuck.len(),
        }
    }
}
