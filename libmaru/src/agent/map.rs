//! Map and map_reads: from a handle (or read tokens) to registered ranges.
//!
//! A map holds the region at the RM before it registers anything, because a range
//! the RM does not know is held could be handed to another owner while this NIC
//! still accepts writes to it. Every failure after a successful hold unholds again.

use super::core::{internal, refused, rm_error, AgentCore, Ports};
use super::mapping::{Grant, RegionMapping};
use super::ports::{NicPort, Registration, RmCallError};
use super::released::same_handle;
use crate::auth::{read_token, token_matches};
use crate::wire::agent::{AgentReply, MapReply, RangeMapped, ReadRange, MAX_READ_RANGES};
use crate::wire::rm::Handle;
use crate::wire::{ErrorCode, WireError};

impl AgentCore {
    pub(super) fn map(
        &mut self,
        client: &str,
        handle: Handle,
        writable: bool,
        p: &mut Ports<'_>,
    ) -> Result<AgentReply, WireError> {
        let id = handle.region_id;
        if self.released.contains(&handle) {
            return Err(refused(format!(
                "region {id} was released at this agent: its handle cannot be mapped again"
            )));
        }
        let mapped = match self.mappings.get(&id) {
            Some(m) if !same_handle(&m.handle, &handle) => {
                return Err(refused(format!(
                    "the handle does not match region {id} as this agent maps it (wrong token, \
                     offset or length)"
                )));
            }
            Some(m) if m.retiring => {
                return Err(internal(format!(
                    "region {id} is being torn down at this agent (a deregistration failed and \
                     is retried by the sweep); map it again later"
                )));
            }
            Some(_) => true,
            None => false,
        };
        // The hold checks the handle (and that the region is not draining) even for a
        // region mapped already: a freed region must not take new holders.
        match p.rm.hold(&handle, &self.node, self.epoch) {
            Ok(()) => self.unholds.hold_confirmed(id),
            Err(e @ RmCallError::Refused(_)) => return Err(rm_error(id, "hold", e)),
            Err(e @ RmCallError::Failed(_)) => {
                // The hold may have been recorded. A region mapped here is held by
                // this node anyway; otherwise the hold is ours to undo.
                if !mapped {
                    self.unholds.queue(id);
                }
                return Err(rm_error(id, "hold", e));
            }
        }
        let grant = Grant::Whole { writable };
        if mapped {
            return self.join(client, id, grant, p.nic).map(AgentReply::Mapped);
        }
        match self.map_new(client, &handle, grant, p) {
            Ok(reply) => Ok(AgentReply::Mapped(reply)),
            Err(e) => {
                // Nothing of the region is registered: the hold goes.
                self.unholds.queue(id);
                self.send_unhold(id, p.rm);
                Err(e)
            }
        }
    }

    /// Maps and registers a region held just now; the caller unholds on error.
    fn map_new(
        &mut self,
        client: &str,
        handle: &Handle,
        grant: Grant,
        p: &mut Ports<'_>,
    ) -> Result<MapReply, WireError> {
        let id = handle.region_id;
        let access =
            p.rm.get_access(handle)
                .map_err(|e| rm_error(id, "access check", e))?;
        if (access.region_id, access.offset, access.length) != (id, handle.offset, handle.length) {
            return Err(internal(format!(
                "the resource manager describes region {id} as region {} ({} bytes at {}), \
                 but the handle says {} bytes at {}; not mapped",
                access.region_id, access.length, access.offset, handle.length, handle.offset
            )));
        }
        let range = p.mem.map(&access).map_err(|e| {
            internal(format!(
                "cannot map region {id} ({} bytes at {} of {}): {e}",
                access.length, access.offset, access.path
            ))
        })?;
        if range.len != access.length {
            p.mem.unmap(range.id);
            return Err(internal(format!(
                "mapping region {id} gave {} bytes instead of {}; not mapped",
                range.len, access.length
            )));
        }
        let reg = match p
            .nic
            .register(client, range.ptr, range.len, grant.writable())
        {
            Ok(reg) => reg,
            Err(e) => {
                // Never registered, so no key to outlive: unmap at once.
                p.mem.unmap(range.id);
                return Err(internal(format!(
                    "cannot register region {id} with the NIC: {e}"
                )));
            }
        };
        let reply = map_reply(&self.boot_id, id, &reg, 0, range.len);
        let m = RegionMapping::new(handle.clone(), range, grant, reg, client);
        self.mappings.insert(id, m);
        log::info!("region {id} mapped for client {client}");
        Ok(reply)
    }

    /// Registers each of `ranges` (at most [`MAX_READ_RANGES`], else nothing is
    /// done) as `map_read` below; a range that fails says why and leaves the others
    /// be. One request for all of a load's ranges at this agent: a reader waits one
    /// round trip, not one per range.
    pub(super) fn map_reads(
        &mut self,
        client: &str,
        ranges: &[ReadRange],
        nic: &mut dyn NicPort,
    ) -> Result<AgentReply, WireError> {
        if ranges.len() > MAX_READ_RANGES {
            return Err(WireError::new(
                ErrorCode::BadRequest,
                format!(
                    "map_reads of {} ranges: at most {MAX_READ_RANGES} go in one request \
                     (nothing was mapped); send the rest in another",
                    ranges.len()
                ),
            ));
        }
        let ranges = ranges
            .iter()
            .map(|r| match self.map_read(client, r, nic) {
                Ok(m) => RangeMapped::Mapped(m),
                Err(e) => RangeMapped::Failed(e),
            })
            .collect();
        Ok(AgentReply::MappedReads { ranges })
    }

    /// Registers a read-only range of a region the owner mapped here. A read handle
    /// never maps a region on its own: its token proves a lease, not ownership, and
    /// the region's hold belongs to its owner's map.
    fn map_read(
        &mut self,
        client: &str,
        r: &ReadRange,
        nic: &mut dyn NicPort,
    ) -> Result<MapReply, WireError> {
        let (region_id, offset, length, token) = (r.region_id, r.offset, r.length, &r.read_token);
        let Some(m) = self.mappings.get(&region_id).filter(|m| !m.retiring) else {
            return Err(refused(format!(
                "region {region_id} is not mapped at this agent; a read handle maps only a \
                 region its owner has mapped here"
            )));
        };
        // The token first, so that nothing about the region is told without it.
        let expected = read_token(&m.handle.token, region_id, offset, length);
        if !token_matches(&expected, token) {
            return Err(refused(format!(
                "the read token does not match {length} bytes at {offset} of region {region_id}"
            )));
        }
        let inside = offset
            .checked_add(length)
            .is_some_and(|end| end <= m.handle.length);
        if length == 0 || !inside {
            return Err(refused(format!(
                "{length} bytes at {offset} are not a range of region {region_id} ({} bytes)",
                m.handle.length
            )));
        }
        self.join(client, region_id, Grant::Range { offset, length }, nic)
    }

    /// Gives `client` its own registration of the region for `grant` (in its
    /// connection's protection domain), unless it has one already.
    fn join(
        &mut self,
        client: &str,
        region_id: u64,
        grant: Grant,
        nic: &mut dyn NicPort,
    ) -> Result<MapReply, WireError> {
        let Some(m) = self.mappings.get_mut(&region_id) else {
            return Err(internal(format!(
                "region {region_id} is not in this agent's table any more; map it again"
            )));
        };
        let (offset, length) = grant.span(m.range.len);
        if m.registration(grant, client).is_none() {
            // offset + length lies inside the mapped range (checked by the caller).
            let reg = nic
                .register(client, m.range.ptr + offset, length, grant.writable())
                .map_err(|e| {
                    internal(format!(
                        "cannot register {length} bytes at {offset} of region {region_id} with \
                         the NIC: {e}"
                    ))
                })?;
            m.add_registration(grant, reg, client);
        }
        match m.registration(grant, client) {
            Some(reg) => Ok(map_reply(&self.boot_id, region_id, reg, offset, length)),
            None => Err(internal(format!(
                "region {region_id}: its registration is missing right after the map; retry"
            ))),
        }
    }
}

/// A map reply: one registration, its place in the region, and the node's boot id.
fn map_reply(
    boot_id: &str,
    region_id: u64,
    reg: &Registration,
    offset: u64,
    length: u64,
) -> MapReply {
    MapReply {
        region_id,
        addr: reg.addr,
        rkey: reg.rkey,
        length,
        offset_in_region: offset,
        transport: reg.transport.clone(),
        boot_id: boot_id.to_string(),
    }
}

#[cfg(test)]
#[path = "map_tests.rs"]
mod tests;
