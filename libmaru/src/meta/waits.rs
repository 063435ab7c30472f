//! What waits for a region from the RM ([`RegionWaits`]): the requests parked until
//! its answer, the allocation in flight, and what the core hands its driver
//! ([`Action`]) and answers later ([`Ticket`]). The rules are in
//! [`alloc_ops`](super::alloc_ops), which acts on the core; the state is here, so
//! that the core does not import the module that imports it.

use super::errors::permission;
use super::ports::PoolSizes;
use super::tenants::{Access, Tenants};
use crate::wire::meta::{Backend, MetaReply};
use crate::wire::WireError;
use std::collections::VecDeque;

/// Names a request whose answer may come later ([`MetaCore::take_answers`](super::MetaCore::take_answers)): the
/// driver's choice, unique among its requests in flight.
pub type Ticket = u64;

/// What the core asks its driver to do, and to report back as an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// ALLOC a region of `size` bytes at the RM, then call
    /// [`MetaCore::alloc_done`](super::MetaCore::alloc_done) with `alloc` and the outcome. One is in flight at a
    /// time.
    Alloc { alloc: u64, size: u64 },
    /// Ask the RM which regions it holds for this server (its owner's list), then
    /// call [`MetaCore::rm_regions`](super::MetaCore::rm_regions) with `check` and
    /// the ids, or the error. One is in flight at a time.
    CheckRm { check: u64 },
}

/// What a new session asks for.
#[derive(Debug, Clone)]
pub(crate) struct OpenArgs {
    pub engine_id: String,
    pub namespace: String,
    pub layout: String,
    pub backend: Backend,
}

#[derive(Debug)]
pub(super) enum Want {
    /// A new session with its first region (the session is made when it comes).
    Open { args: OpenArgs, access: Access },
    /// One more region for the session.
    Expand { session: u64 },
}

#[derive(Debug)]
pub(super) struct Parked {
    pub(super) ticket: Ticket,
    pub(super) owner: String,
    pub(super) tenant: String,
    pub(super) since_ms: u64,
    pub(super) want: Want,
    /// The RM refused it and room is on its way: until when it waits for that room,
    /// and its answer then.
    pub(super) room: Option<(u64, WireError)>,
}

/// Requests waiting for a region, the allocation in flight, and what to hand the
/// driver.
#[derive(Debug, Default)]
pub(crate) struct RegionWaits {
    pub(super) parked: VecDeque<Parked>,
    pub(super) in_flight: Option<u64>,
    pub(super) next_alloc: u64,
    pub(super) actions: VecDeque<Action>,
    pub(super) answers: Vec<(Ticket, Result<MetaReply, WireError>)>,
    /// The RM's pool sizes as last heard.
    pub(super) sizes: Option<PoolSizes>,
    /// The RM refused the oldest waiting request and room is on its way (kept
    /// regions or a fair-share region going back): the next allocation waits for a
    /// region to be freed (or the request's `park_max_ms`).
    pub(super) room_coming: bool,
    /// Regions the RM freed since the server started (a free ends `room_coming`).
    pub(super) freed: u64,
}

impl RegionWaits {
    pub(super) fn parked_of(&self, tenant: &str) -> usize {
        self.parked.iter().filter(|p| p.tenant == tenant).count()
    }

    pub(super) fn opens_of(&self, tenant: &str) -> usize {
        self.parked
            .iter()
            .filter(|p| p.tenant == tenant && matches!(p.want, Want::Open { .. }))
            .count()
    }

    pub(super) fn len(&self) -> usize {
        self.parked.len()
    }

    /// When the oldest waiting request has waited `park_max_ms`, or one waiting for
    /// room has waited [`ROOM_WAIT_MS`](super::alloc_ops::ROOM_WAIT_MS).
    pub(super) fn next_deadline(&self, park_max_ms: u64) -> Option<u64> {
        let room = self
            .parked
            .iter()
            .filter_map(|p| p.room.as_ref().map(|r| r.0));
        self.parked
            .front()
            .map(|p| p.since_ms.saturating_add(park_max_ms))
            .into_iter()
            .chain(room)
            .min()
    }

    /// Tenants changed: an open waiting in a namespace its tenant no longer writes is
    /// answered now (an expand finds its session ended when its region comes).
    pub(super) fn forget_tenants(&mut self, tenants: &Tenants) {
        let mut keep = VecDeque::new();
        while let Some(p) = self.parked.pop_front() {
            match &p.want {
                Want::Open { args, .. }
                    if tenants.access(&p.tenant, &args.namespace) != Access::Write =>
                {
                    self.answers.push((
                        p.ticket,
                        Err(permission(format!(
                            "tenant {} no longer writes namespace {:?} (tenants reloaded)",
                            p.tenant,
                            crate::net::clip(&args.namespace)
                        ))),
                    ))
                }
                _ => keep.push_back(p),
            }
        }
        self.parked = keep;
    }
}
