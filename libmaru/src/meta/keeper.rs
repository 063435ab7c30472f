//! The region keeper: regions whose worker left (drained close or expiry) while
//! they held keys, and every region on its way back to the RM.
//!
//! Keys outlive their writer: a kept region stays readable by other sessions. For
//! `remote_cxl` the keeper holds the region's mapping at its agent (a map with the
//! full handle, checked every `check_ms`), maps it again after the agent restarted,
//! and gives the region up when
//!
//! - the agent reports another boot id than the owner did (the memory node rebooted
//!   and lost what its CPU caches held),
//! - the agent refuses the handle,
//! - the agent has not answered for `silence_ms` (its keys stop being found at once;
//!   the release and free wait until the agent answers again),
//! - or the RM refused a region request of a live session (the core gives every
//!   kept region that holds no pinned key back at once, read longest ago first:
//!   departed engines' keys go before any live engine evicts its own).
//!
//! Giving a region back means: its keys are dropped at once (the core does that on
//! [`KeeperEvent::Lost`]), then its agent releases it, then the RM frees it. The RM
//! free never comes before a confirmed release for a region with an agent. A
//! refused release means the agent registers nothing under the handle; the RM's
//! holds keep the range out of reuse should anything still be registered.

use super::ports::{AgentPort, PortError, RmPort};
use crate::wire::rm::Handle;
use std::cell::Cell;
use std::collections::{BTreeMap, BTreeSet};

/// Every this many failed tries of one give-back, the failure is logged as an error.
const LOG_EVERY: u32 = 12;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GiveBackReason {
    /// Its owner left and it held no key.
    NoKeys,
    /// Its owner returned it.
    Returned,
    /// Its owner closed without draining.
    Abandoned,
    /// The memory node rebooted since the keys were written.
    Rebooted,
    /// The agent refused the handle.
    AgentRefused,
    /// The agent did not answer for the silence limit.
    AgentSilent,
    /// The RM refused a region request: kept regions read longest ago go back
    /// (departed engines' keys go before any live engine evicts its own; see
    /// `ROOM_SHARE`).
    RmPressure,
    /// maru-server took it from a session above its fair share of a full pool for a
    /// session waiting for a region (no page of it was being written, no key of it
    /// leased or pinned).
    FairShare,
    /// maru-server gives all its kept regions back (before it stops).
    Shutdown,
    /// The RM no longer holds it for this server (it reaped it while the server was
    /// away longer than its grace period).
    RmDropped,
    /// Its session held it without taking a page for the unused-region limit.
    Unused,
    /// The RM answered an allocation after the request that asked for it went away.
    Unclaimed,
    /// It was on its way back when maru-server stopped, or the RM held it for
    /// maru-server though its directory did not know it (an allocation answered as
    /// it stopped).
    Recovered,
}

impl GiveBackReason {
    pub fn as_str(self) -> &'static str {
        match self {
            GiveBackReason::NoKeys => "its owner left and it holds no key",
            GiveBackReason::Returned => "its owner returned it",
            GiveBackReason::Abandoned => "its owner closed without draining",
            GiveBackReason::Rebooted => "its memory node rebooted (boot id changed)",
            GiveBackReason::AgentRefused => "its agent refused the handle",
            GiveBackReason::AgentSilent => "its agent did not answer",
            GiveBackReason::RmPressure => {
                "the RM refused a region and kept regions of departed engines go first"
            }
            GiveBackReason::FairShare => {
                "its session holds more than its fair share of the full pool and another \
                 session waits for a region"
            }
            GiveBackReason::Shutdown => "maru-server gives its kept regions back",
            GiveBackReason::RmDropped => "the RM no longer holds it for this server",
            GiveBackReason::Unused => "its session held it without storing in it",
            GiveBackReason::Unclaimed => "the request it was allocated for went away",
            GiveBackReason::Recovered => {
                "it was going back, or unknown to the directory, when maru-server restarted"
            }
        }
    }
}

/// The first retry of a failed release or free comes this soon: a daemon's port
/// answers "unreachable" when the peer did not answer within a few ms while the call
/// goes on in the background (a loaded RM), and a session may be waiting for the
/// region. Retries then back off, doubling, up to `retry_ms`.
const FIRST_RETRY_MS: u64 = 25;

fn retry_after(failures: u32, retry_ms: u64) -> u64 {
    let n = failures.saturating_sub(1).min(16);
    FIRST_RETRY_MS.saturating_mul(1 << n).min(retry_ms)
}

/// What the core must do after the keeper acted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeeperEvent {
    /// A kept region is given up: drop its keys and end its leases now.
    Lost {
        region_id: u64,
        reason: GiveBackReason,
    },
    /// The RM freed the region: forget it.
    Freed { region_id: u64 },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeeperTimes {
    pub silence_ms: u64,
    pub check_ms: u64,
    pub retry_ms: u64,
}

#[derive(Debug, Clone)]
struct Kept {
    handle: Handle,
    agent: Option<String>,
    /// The boot id the region's keys were written under, once known.
    boot: Option<String>,
    mapped: bool,
    /// Last time the agent answered (or the take-over).
    last_answer_ms: u64,
    next_check_ms: u64,
}

#[derive(Debug, Clone)]
struct GiveBack {
    handle: Handle,
    agent: Option<String>,
    /// The agent confirmed the release (or there is no agent to ask).
    released: bool,
    reason: GiveBackReason,
    next_try_ms: u64,
    failures: u32,
}

#[derive(Debug)]
pub struct RegionKeeper {
    kept: BTreeMap<u64, Kept>,
    giving_back: BTreeMap<u64, GiveBack>,
    /// (when, region) of each region with something due: a kept region with an
    /// agent (its next check) and every region going back (its next try), so that
    /// a tick and the event loop's question of when to tick next visit only the
    /// regions due, not every region kept (issue 46).
    timers: BTreeSet<(u64, u64)>,
    /// The time of each region's entry in `timers`.
    armed: BTreeMap<u64, u64>,
    /// Regions visited by `next_deadline` and `run` (a measure of their work).
    visited: Cell<u64>,
    times: KeeperTimes,
}

impl RegionKeeper {
    pub fn new(times: KeeperTimes) -> RegionKeeper {
        RegionKeeper {
            kept: BTreeMap::new(),
            giving_back: BTreeMap::new(),
            timers: BTreeSet::new(),
            armed: BTreeMap::new(),
            visited: Cell::new(0),
            times,
        }
    }

    /// Regions visited so far by [`next_deadline`](Self::next_deadline) and
    /// [`run`](Self::run).
    pub fn visited(&self) -> u64 {
        self.visited.get()
    }

    /// Puts the region's timer where its state says: its next check if kept with an
    /// agent, its next try if going back, none otherwise.
    fn rearm(&mut self, id: u64) {
        let want = match (self.kept.get(&id), self.giving_back.get(&id)) {
            (Some(k), _) if k.agent.is_some() => Some(k.next_check_ms),
            (_, Some(g)) => Some(g.next_try_ms),
            _ => None,
        };
        let had = self.armed.get(&id).copied();
        if had == want {
            return;
        }
        if let Some(t) = had {
            self.timers.remove(&(t, id));
            self.armed.remove(&id);
        }
        if let Some(t) = want {
            self.timers.insert((t, id));
            self.armed.insert(id, t);
        }
    }

    /// The regions whose timer is due at `now`, by region id.
    fn due(&self, now: u64) -> Vec<u64> {
        let mut due: Vec<u64> = self
            .timers
            .range(..=(now, u64::MAX))
            .map(|&(_, id)| id)
            .collect();
        self.visited.set(self.visited.get() + due.len() as u64);
        due.sort_unstable();
        due
    }

    /// Takes a region over. With an agent, the keeper maps it at the next run.
    pub fn keep(&mut self, handle: Handle, agent: Option<String>, boot: Option<String>, now: u64) {
        log::info!(
            "region keeper: keeping region {} ({})",
            handle.region_id,
            agent.as_deref().unwrap_or("cxl")
        );
        let handle_id = handle.region_id;
        self.kept.insert(
            handle.region_id,
            Kept {
                handle,
                agent,
                boot,
                mapped: false,
                last_answer_ms: now,
                next_check_ms: now,
            },
        );
        self.rearm(handle_id);
    }

    /// Queues a region to go back. `released`: no release at an agent is needed
    /// (none serves it, or its owner's release was confirmed).
    pub fn give_back(
        &mut self,
        handle: Handle,
        agent: Option<String>,
        released: bool,
        reason: GiveBackReason,
        now: u64,
    ) {
        let released = released || agent.is_none();
        let id = handle.region_id;
        self.kept.remove(&id);
        self.giving_back.insert(
            id,
            GiveBack {
                handle,
                agent,
                released,
                reason,
                next_try_ms: now,
                failures: 0,
            },
        );
        self.rearm(id);
    }

    /// Gives a kept region up; the caller drops its keys. False if it is not kept.
    pub fn lose(&mut self, region_id: u64, reason: GiveBackReason, now: u64) -> bool {
        let Some(k) = self.kept.remove(&region_id) else {
            return false;
        };
        // An orderly stop is expected; every other reason loses keys others could read.
        let level = if reason == GiveBackReason::Shutdown {
            log::Level::Info
        } else {
            log::Level::Warn
        };
        log::log!(
            level,
            "region keeper: giving region {region_id} back: {}; its keys are no longer found",
            reason.as_str()
        );
        self.give_back(k.handle, k.agent, false, reason, now);
        true
    }

    /// Forgets a region without giving it back (the RM no longer has it).
    pub fn forget(&mut self, region_id: u64) {
        self.kept.remove(&region_id);
        self.giving_back.remove(&region_id);
        self.rearm(region_id);
    }

    pub fn is_kept(&self, region_id: u64) -> bool {
        self.kept.contains_key(&region_id)
    }

    pub fn is_mapped(&self, region_id: u64) -> bool {
        self.kept.get(&region_id).is_some_and(|k| k.mapped)
    }

    pub fn is_giving_back(&self, region_id: u64) -> bool {
        self.giving_back.contains_key(&region_id)
    }

    /// Whether the agent still has to confirm the release of a region going back.
    pub fn awaits_release(&self, region_id: u64) -> bool {
        self.giving_back
            .get(&region_id)
            .is_some_and(|g| !g.released)
    }

    pub fn kept_ids(&self) -> impl Iterator<Item = u64> + '_ {
        self.kept.keys().copied()
    }

    pub fn kept_len(&self) -> usize {
        self.kept.len()
    }

    pub fn giving_back_ids(&self) -> impl Iterator<Item = u64> + '_ {
        self.giving_back.keys().copied()
    }

    pub fn giving_back_len(&self) -> usize {
        self.giving_back.len()
    }

    /// A region given up to make room (kept regions for the RM's sake, a region
    /// taken for a fair share) has not reached the RM yet.
    pub fn pressure_pending(&self) -> bool {
        self.giving_back.values().any(|g| {
            matches!(
                g.reason,
                GiveBackReason::RmPressure | GiveBackReason::FairShare
            )
        })
    }

    pub fn next_deadline(&self) -> Option<u64> {
        let first = self.timers.first().map(|&(t, _)| t);
        self.visited
            .set(self.visited.get() + u64::from(first.is_some()));
        first
    }

    /// Checks kept mappings and moves give-backs on, as far as the ports allow.
    pub fn run(
        &mut self,
        now: u64,
        rm: &mut dyn RmPort,
        agents: &mut dyn AgentPort,
    ) -> Vec<KeeperEvent> {
        let mut events = Vec::new();
        self.check_mappings(now, agents, &mut events);
        let due = self.due(now);
        for id in due {
            if !self.giving_back.contains_key(&id) {
                continue;
            }
            self.release(id, now, agents);
            if let Some(e) = self.free_now(id, now, rm) {
                events.push(e);
            }
        }
        events
    }

    fn check_mappings(
        &mut self,
        now: u64,
        agents: &mut dyn AgentPort,
        events: &mut Vec<KeeperEvent>,
    ) {
        let due = self.due(now);
        for id in due {
            let Some(k) = self.kept.get_mut(&id) else {
                continue;
            };
            let Some(agent) = k.agent.clone() else {
                continue;
            };
            let outcome = match agents.map(&agent, &k.handle) {
                Ok(boot) if boot.is_empty() => Err(PortError::Unreachable(format!(
                    "agent {agent} reported no boot id"
                ))),
                other => other,
            };
            let lost = match outcome {
                Ok(boot) => match &k.boot {
                    Some(b) if *b != boot => {
                        log::warn!(
                            "region keeper: agent {agent} reports boot id {boot} for region \
                             {id}, whose keys were written under boot id {b}"
                        );
                        Some(GiveBackReason::Rebooted)
                    }
                    _ => {
                        if !k.mapped {
                            log::info!("region keeper: region {id} mapped at agent {agent}");
                        }
                        k.boot = Some(boot);
                        k.mapped = true;
                        k.last_answer_ms = now;
                        k.next_check_ms = now.saturating_add(self.times.check_ms);
                        None
                    }
                },
                Err(PortError::Refused(m)) => {
                    log::warn!("region keeper: agent {agent} refused region {id}: {m}");
                    Some(GiveBackReason::AgentRefused)
                }
                Err(PortError::Failed(m)) => {
                    // It answered: not silent, but the mapping is not held. Try again.
                    log::warn!("region keeper: agent {agent} failed to map region {id}: {m}");
                    k.mapped = false;
                    k.last_answer_ms = now;
                    k.next_check_ms = now.saturating_add(self.times.retry_ms);
                    None
                }
                Err(PortError::Unreachable(m)) => {
                    if k.mapped {
                        log::warn!(
                            "region keeper: agent {agent} of region {id} is unreachable: {m}"
                        );
                    }
                    k.mapped = false;
                    if now.saturating_sub(k.last_answer_ms) >= self.times.silence_ms {
                        Some(GiveBackReason::AgentSilent)
                    } else {
                        let give_up_at = k.last_answer_ms.saturating_add(self.times.silence_ms);
                        k.next_check_ms = now.saturating_add(self.times.retry_ms).min(give_up_at);
                        None
                    }
                }
            };
            if let Some(reason) = lost {
                self.lose(id, reason, now);
                events.push(KeeperEvent::Lost {
                    region_id: id,
                    reason,
                });
            }
            self.rearm(id);
        }
    }

    fn release(&mut self, id: u64, now: u64, agents: &mut dyn AgentPort) {
        self.release_once(id, now, agents);
        self.rearm(id);
    }

    fn release_once(&mut self, id: u64, now: u64, agents: &mut dyn AgentPort) {
        let retry_ms = self.times.retry_ms;
        let Some(g) = self.giving_back.get_mut(&id) else {
            return;
        };
        if g.released {
            return;
        }
        let Some(agent) = g.agent.clone() else {
            g.released = true;
            return;
        };
        match agents.release(&agent, &g.handle) {
            Ok(()) => g.released = true,
            Err(PortError::Refused(m)) => {
                log::info!(
                    "region {id}: agent {agent} registers nothing under its handle ({m}); \
                     freeing it at the RM"
                );
                g.released = true;
            }
            Err(e) => {
                g.failures += 1;
                g.next_try_ms = now.saturating_add(retry_after(g.failures, retry_ms));
                log_failure(id, g.failures, &format!("release at agent {agent}"), &e);
            }
        }
    }

    /// Holds a region going back (neither released nor freed) until `until`: a
    /// reader may still read it (see `MetaCore::old_leases_hold`).
    pub fn hold_back(&mut self, id: u64, until: u64) {
        if let Some(g) = self.giving_back.get_mut(&id) {
            g.next_try_ms = g.next_try_ms.max(until);
        }
        self.rearm(id);
    }

    /// Frees a give-back at the RM if its release is done (and it is not held back).
    /// `Freed` when the RM no longer has the region (freed now, or unknown to it
    /// already).
    pub fn free_now(&mut self, id: u64, now: u64, rm: &mut dyn RmPort) -> Option<KeeperEvent> {
        let e = self.free_once(id, now, rm);
        self.rearm(id);
        e
    }

    fn free_once(&mut self, id: u64, now: u64, rm: &mut dyn RmPort) -> Option<KeeperEvent> {
        let retry_ms = self.times.retry_ms;
        let g = self.giving_back.get_mut(&id)?;
        if !g.released || g.next_try_ms > now {
            return None;
        }
        match rm.free(&g.handle) {
            Ok(()) => {}
            Err(PortError::Refused(m)) => {
                log::info!("region {id}: the RM no longer has it ({m})");
            }
            Err(e) => {
                g.failures += 1;
                g.next_try_ms = now.saturating_add(retry_after(g.failures, retry_ms));
                log_failure(id, g.failures, "free at the RM", &e);
                return None;
            }
        }
        let g = self.giving_back.remove(&id)?;
        log::info!("region {id} given back to the RM: {}", g.reason.as_str());
        Some(KeeperEvent::Freed { region_id: id })
    }
}

fn log_failure(region_id: u64, failures: u32, what: &str, e: &PortError) {
    if failures == 1 {
        log::warn!("region {region_id}: {what} failed ({e}); retrying");
    } else if failures % LOG_EVERY == 0 {
        log::error!(
            "region {region_id}: {what} has failed {failures} times ({e}); the region stays \
             out of use until it succeeds"
        );
    }
}
