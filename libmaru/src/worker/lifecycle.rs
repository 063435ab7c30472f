//! The region lifecycle of a `remote_cxl` pool, as a sans-I/O core: what the worker
//! knows of the agents its own regions live on. The mover feeds in what agents said,
//! what failed, what maru-server heard and `now_ms`, and carries out what comes back.
//! The rules are in `docs/worker.md` ("Region lifecycle", "A stalled peer costs one
//! timeout"); each has a test below.

use std::collections::BTreeMap;

/// An agent unreachable this long loses the worker's regions there (as the region
/// keeper's regions do).
pub const AGENT_SILENCE_MS: u64 = 30_000;
/// How often the agents of own regions are probed while they answer.
pub const PROBE_EVERY_MS: u64 = 1_000;
/// How often an agent that is away is probed again (a store within a second of its
/// answering again uses it).
pub const AWAY_PROBE_EVERY_MS: u64 = 250;
/// How often an agent that did not answer a probe (and is not away) is probed again.
pub const SILENT_PROBE_EVERY_MS: u64 = 5_000;

/// What the worker made of an agent's identity (boot id and epoch).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Nothing changed (or the first time this agent is seen).
    Same,
    /// The agent restarted on the same boot: map the regions again, the bytes stay.
    Restarted,
    /// The memory node rebooted: these regions' keys are gone; out of use until
    /// maru-server has been told ([`Lifecycle::reported`]).
    Rebooted(Vec<u64>),
    /// The agent reported no boot id: it is treated as unreachable.
    NoBoot,
}

/// What the driver must do now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Ask this agent who it is; the answer to `seen`, a failure to `unreachable`.
    Probe(String),
    /// Map the worker's regions at this agent again (then `remapped`).
    Remap(String),
    /// Silent for [`AGENT_SILENCE_MS`]: give these regions back, then `forget` them.
    GiveBack { agent: String, regions: Vec<u64> },
}

#[derive(Debug, Default)]
struct AgentState {
    boot: Option<String>,
    epoch: Option<u64>,
    /// The agent's registrations of our regions may be gone: map them again.
    remap: bool,
    /// Since when the agent has not answered (None: it answers).
    silent_since: Option<u64>,
    /// A request's call ran into its deadline here, no answer since.
    away: bool,
    next_probe_ms: u64,
}

#[derive(Debug)]
struct RegionState {
    agent: String,
    /// The boot id the region's bytes belong to.
    boot: String,
    /// maru-server has been told `boot` (it has something to compare with).
    reported: bool,
    /// Its node rebooted, maru-server not told yet: not read, written or mapped.
    rebooted: bool,
}

/// The own regions of one pool and the agents they live on.
#[derive(Debug, Default)]
pub struct Lifecycle {
    agents: BTreeMap<String, AgentState>,
    regions: BTreeMap<u64, RegionState>,
}

impl Lifecycle {
    /// A new own region, mapped at `agent`, which reported `boot`; the verdict on it.
    pub fn adopt(
        &mut self,
        region: u64,
        agent: &str,
        boot: &str,
        epoch: Option<u64>,
        now_ms: u64,
    ) -> Verdict {
        let v = self.seen(agent, Some(boot), epoch, now_ms);
        if v != Verdict::NoBoot {
            self.regions.insert(
                region,
                RegionState {
                    agent: agent.to_string(),
                    boot: boot.to_string(),
                    reported: false,
                    rebooted: false,
                },
            );
        }
        v
    }

    /// An agent said who it is (a new control connection's welcome, a probe's answer,
    /// a map reply).
    pub fn seen(
        &mut self,
        agent: &str,
        boot: Option<&str>,
        epoch: Option<u64>,
        now_ms: u64,
    ) -> Verdict {
        let a = self.agents.entry(agent.to_string()).or_default();
        let Some(boot) = boot.filter(|b| !b.is_empty()) else {
            a.silent_since.get_or_insert(now_ms);
            return Verdict::NoBoot;
        };
        a.silent_since = None;
        a.away = false;
        let rebooted = a.boot.as_deref().is_some_and(|b| b != boot);
        let restarted = !rebooted && matches!((a.epoch, epoch), (Some(x), Some(y)) if x != y);
        a.boot = Some(boot.to_string());
        if epoch.is_some() {
            a.epoch = epoch;
        }
        if rebooted {
            a.remap = true;
            let mut ids = Vec::new();
            for (id, r) in self.regions.iter_mut().filter(|(_, r)| r.agent == agent) {
                if r.boot != boot {
                    r.boot = boot.to_string();
                    r.rebooted = true;
                    r.reported = false;
                    ids.push(*id);
                }
            }
            return Verdict::Rebooted(ids);
        }
        if restarted {
            a.remap = true;
            return Verdict::Restarted;
        }
        Verdict::Same
    }

    /// The control connection to `agent` broke: its registrations may be gone.
    pub fn link_broken(&mut self, agent: &str) {
        self.agents.entry(agent.to_string()).or_default().remap = true;
    }

    /// `agent` did not answer a probe (or the tick's connect): silent since then,
    /// probed every [`SILENT_PROBE_EVERY_MS`].
    pub fn unreachable(&mut self, agent: &str, now_ms: u64) {
        let a = self.agents.entry(agent.to_string()).or_default();
        a.silent_since.get_or_insert(now_ms);
        if !a.away {
            a.next_probe_ms = now_ms + SILENT_PROBE_EVERY_MS;
        }
    }

    /// A request's call to `agent` ran into its deadline: away (and silent) until it
    /// answers again. True when it was not away before (logged once).
    pub fn missed_deadline(&mut self, agent: &str, now_ms: u64) -> bool {
        let a = self.agents.entry(agent.to_string()).or_default();
        a.silent_since.get_or_insert(now_ms);
        let was = a.away;
        if !was {
            a.away = true;
            a.next_probe_ms = now_ms + AWAY_PROBE_EVERY_MS;
        }
        !was
    }

    /// Whether `agent` is away (`missed_deadline`, no answer since).
    pub fn is_away(&self, agent: &str) -> bool {
        self.agents.get(agent).is_some_and(|a| a.away)
    }

    /// The away agents whose probe is due at `now_ms` (the next one planned then).
    pub fn away_probes_due(&mut self, now_ms: u64) -> Vec<String> {
        let mut out = Vec::new();
        for (agent, a) in self.agents.iter_mut() {
            if a.away && now_ms >= a.next_probe_ms {
                a.next_probe_ms = now_ms + AWAY_PROBE_EVERY_MS;
                out.push(agent.clone());
            }
        }
        out
    }

    /// Whether the worker's regions at `agent` must be mapped again before use.
    pub fn needs_remap(&self, agent: &str) -> bool {
        self.agents.get(agent).is_some_and(|a| a.remap)
    }

    /// Whether the regions at `agent` may be mapped again: none waits for a reboot's report.
    pub fn may_map(&self, agent: &str) -> bool {
        !self
            .regions
            .values()
            .any(|r| r.agent == agent && r.rebooted)
    }

    /// Every region at `agent` is mapped again.
    pub fn remapped(&mut self, agent: &str) {
        if let Some(a) = self.agents.get_mut(agent) {
            a.remap = false;
        }
    }

    /// Whether an own region may be read or written now.
    pub fn usable(&self, region: u64) -> bool {
        self.regions.get(&region).is_some_and(|r| !r.rebooted)
    }

    /// Whether a lease on bytes written under `lease_boot` may be read at `agent`: only
    /// while it is on that boot as last seen (a lease without boot id: yes).
    pub fn lease_readable(&self, agent: &str, lease_boot: Option<&str>) -> bool {
        match lease_boot {
            None => true,
            Some(b) => self
                .agents
                .get(agent)
                .and_then(|a| a.boot.as_deref())
                .is_some_and(|now| now == b),
        }
    }

    /// The boot id an own region's bytes belong to (None: not an own region).
    pub fn boot_of(&self, region: u64) -> Option<&str> {
        self.regions.get(&region).map(|r| r.boot.as_str())
    }

    /// Whether a reboot was found that maru-server has not been told yet.
    pub fn rebooted_unreported(&self) -> bool {
        self.regions.values().any(|r| r.rebooted)
    }

    /// The boot ids to send with a heartbeat.
    pub fn boot_ids(&self) -> BTreeMap<u64, String> {
        self.regions
            .iter()
            .map(|(id, r)| (*id, r.boot.clone()))
            .collect()
    }

    /// Whether maru-server must hear the boot ids before anything else is published.
    pub fn must_report(&self) -> bool {
        self.regions.values().any(|r| !r.reported)
    }

    /// As `must_report`, for `regions` only (regions it does not know: no).
    pub fn must_report_for(&self, regions: &[u64]) -> bool {
        regions
            .iter()
            .any(|id| self.regions.get(id).is_some_and(|r| !r.reported))
    }

    /// maru-server answered a heartbeat that sent `sent`: those boot ids are reported
    /// (rebooted regions serve again: maru-server dropped their keys).
    pub fn reported(&mut self, sent: &BTreeMap<u64, String>) {
        for (id, boot) in sent {
            if let Some(r) = self.regions.get_mut(id) {
                if r.boot == *boot {
                    r.reported = true;
                    r.rebooted = false;
                }
            }
        }
    }

    /// The region is no longer the session's.
    pub fn forget(&mut self, region: u64) {
        self.regions.remove(&region);
    }

    /// The own regions at `agent`.
    pub fn regions_at(&self, agent: &str) -> Vec<u64> {
        self.regions
            .iter()
            .filter(|(_, r)| r.agent == agent)
            .map(|(id, _)| *id)
            .collect()
    }

    /// What is due at `now_ms`: probes, remaps, regions of silent agents (a report of
    /// boot ids the pool asks for itself: `must_report`).
    pub fn due(&mut self, now_ms: u64) -> Vec<Action> {
        let mut out = Vec::new();
        let mut agents: Vec<String> = self.regions.values().map(|r| r.agent.clone()).collect();
        agents.extend(
            self.agents
                .iter()
                .filter(|(_, a)| a.away)
                .map(|(agent, _)| agent.clone()),
        );
        agents.sort();
        agents.dedup();
        for agent in agents {
            let a = self.agents.entry(agent.clone()).or_default();
            if let Some(since) = a.silent_since {
                let regions = self.regions_at(&agent);
                if now_ms.saturating_sub(since) >= AGENT_SILENCE_MS && !regions.is_empty() {
                    out.push(Action::GiveBack { regions, agent });
                    continue;
                }
            }
            let a = self.agents.entry(agent.clone()).or_default();
            if now_ms >= a.next_probe_ms {
                a.next_probe_ms = now_ms
                    + if a.away {
                        AWAY_PROBE_EVERY_MS
                    } else if a.silent_since.is_some() {
                        SILENT_PROBE_EVERY_MS
                    } else {
                        PROBE_EVERY_MS
                    };
                out.push(Action::Probe(agent.clone()));
            }
            if a.remap && a.silent_since.is_none() && self.may_map(&agent) {
                out.push(Action::Remap(agent));
            }
        }
        out
    }
}

/// What becomes of the session a pool lost, once the pool has a new one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LostSession {
    /// The new session comes from another instance of maru-server (its keeper is gone
    /// with the old one): the worker releases the regions at their agents itself.
    ReleaseAtAgents,
    /// The same run (expired, or out of reach): its keeper takes the regions over.
    LeaveToKeeper,
}

/// Decides [`LostSession`] from maru-server's instance ids, old and new (an old one
/// that is unknown, from a server that does not send one, decides nothing).
pub fn lost_session(was_instance: &str, now_instance: &str) -> LostSession {
    if !was_instance.is_empty() && was_instance != now_instance {
        LostSession::ReleaseAtAgents
    } else {
        LostSession::LeaveToKeeper
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "10.0.0.1:9860";
    const B: &str = "10.0.0.2:9860";

    fn reported(l: &mut Lifecycle) {
        let sent = l.boot_ids();
        l.reported(&sent);
    }

    /// A publish waits only for the report of the regions it writes into: a region
    /// adopted by another store meanwhile does not hold it back.
    #[test]
    fn must_report_for_names_only_the_regions_asked_about() {
        let mut l = Lifecycle::default();
        assert_eq!(l.adopt(1, A, "boot-1", Some(7), 0), Verdict::Same);
        reported(&mut l);
        assert_eq!(l.adopt(2, A, "boot-1", Some(7), 0), Verdict::Same);
        assert!(l.must_report());
        assert!(!l.must_report_for(&[1]), "region 1 was reported");
        assert!(l.must_report_for(&[1, 2]), "region 2 is new");
        assert!(!l.must_report_for(&[9]), "a region it does not know");
        reported(&mut l);
        assert!(!l.must_report_for(&[1, 2]));
    }

    #[test]
    fn a_changed_boot_id_puts_the_agents_regions_out_of_use_until_maru_server_knows() {
        let mut l = Lifecycle::default();
        assert_eq!(l.adopt(1, A, "boot-1", Some(7), 0), Verdict::Same);
        assert_eq!(l.adopt(2, B, "boot-9", Some(3), 0), Verdict::Same);
        reported(&mut l);
        assert!(l.usable(1) && l.usable(2));
        // The agent of region 1 comes back with a new boot id.
        assert_eq!(
            l.seen(A, Some("boot-2"), Some(8), 10),
            Verdict::Rebooted(vec![1])
        );
        assert!(!l.usable(1), "stale bytes are neither read nor written");
        assert!(l.usable(2), "other agents' regions go on");
        assert!(
            !l.may_map(A),
            "not mapped again before maru-server drops the keys"
        );
        assert!(l.must_report());
        let due = l.due(10);
        assert!(!due.contains(&Action::Remap(A.into())), "{due:?}");
        // The heartbeat carries the new boot id: maru-server compares and drops keys.
        let sent = l.boot_ids();
        assert_eq!(sent.get(&1).map(String::as_str), Some("boot-2"));
        l.reported(&sent);
        assert!(l.usable(1), "serves new stores under the new boot");
        assert!(l.may_map(A) && l.needs_remap(A));
        assert!(l.due(2_000).contains(&Action::Remap(A.into())));
        l.remapped(A);
        assert!(!l.needs_remap(A));
    }

    #[test]
    fn a_lease_on_bytes_of_another_boot_is_not_read() {
        let mut l = Lifecycle::default();
        // A reader: no own region, it has seen the agent on boot-2.
        l.seen(A, Some("boot-2"), Some(1), 0);
        assert!(l.lease_readable(A, Some("boot-2")));
        assert!(
            !l.lease_readable(A, Some("boot-1")),
            "written before a reboot maru-server has not heard of yet"
        );
        assert!(!l.lease_readable(B, Some("boot-1")), "an agent never seen");
        assert!(l.lease_readable(A, None));
    }

    #[test]
    fn a_report_sent_before_another_reboot_does_not_clear_it() {
        let mut l = Lifecycle::default();
        l.adopt(1, A, "boot-1", None, 0);
        let stale = l.boot_ids();
        l.seen(A, Some("boot-2"), None, 5);
        l.reported(&stale);
        assert!(!l.usable(1), "maru-server heard boot-1, not boot-2");
    }

    #[test]
    fn a_new_regions_boot_id_reaches_maru_server_before_its_keys_are_published() {
        let mut l = Lifecycle::default();
        l.adopt(1, A, "boot-1", Some(1), 0);
        assert!(
            l.must_report(),
            "maru-server would have no boot id to compare with"
        );
        reported(&mut l);
        assert!(!l.must_report());
        l.adopt(2, A, "boot-1", Some(1), 0);
        assert!(l.must_report());
    }

    #[test]
    fn an_agent_without_boot_id_is_unreachable() {
        let mut l = Lifecycle::default();
        assert_eq!(l.adopt(1, A, "", None, 0), Verdict::NoBoot);
        assert!(!l.usable(1), "not adopted");
        l.adopt(2, A, "boot-1", None, 0);
        assert_eq!(l.seen(A, None, None, 100), Verdict::NoBoot);
        let due = l.due(100 + AGENT_SILENCE_MS);
        assert!(
            due.iter().any(|a| matches!(a, Action::GiveBack { .. })),
            "{due:?}"
        );
    }

    #[test]
    fn a_restart_on_the_same_boot_maps_again_and_keeps_the_keys() {
        let mut l = Lifecycle::default();
        l.adopt(1, A, "boot-1", Some(1), 0);
        reported(&mut l);
        assert_eq!(l.seen(A, Some("boot-1"), Some(1), 5), Verdict::Same);
        assert!(!l.needs_remap(A));
        assert_eq!(l.seen(A, Some("boot-1"), Some(2), 10), Verdict::Restarted);
        assert!(l.usable(1), "the bytes survived");
        assert!(!l.must_report());
        assert!(
            l.due(10).contains(&Action::Remap(A.into())),
            "mapped again at once"
        );
        // A broken control connection alone also maps again (registrations may be gone).
        l.remapped(A);
        l.link_broken(A);
        assert!(l.needs_remap(A));
    }

    #[test]
    fn an_agent_silent_for_30_s_loses_the_regions_there() {
        let mut l = Lifecycle::default();
        l.adopt(1, A, "boot-1", None, 0);
        l.adopt(2, A, "boot-1", None, 0);
        l.adopt(3, B, "boot-9", None, 0);
        reported(&mut l);
        l.unreachable(A, 1_000);
        // Still silent later: the first failure counts.
        l.unreachable(A, 20_000);
        let gives = |d: &[Action]| {
            d.iter()
                .filter_map(|a| match a {
                    Action::GiveBack { agent, regions } => Some((agent.clone(), regions.clone())),
                    _ => None,
                })
                .collect::<Vec<_>>()
        };
        assert!(gives(&l.due(1_000 + AGENT_SILENCE_MS - 1)).is_empty());
        assert_eq!(
            gives(&l.due(1_000 + AGENT_SILENCE_MS)),
            vec![(A.to_string(), vec![1, 2])]
        );
        // An answer in time resets the count.
        l.unreachable(B, 0);
        l.seen(B, Some("boot-9"), None, 29_000);
        assert!(gives(&l.due(60_000)).iter().all(|(a, _)| a != B));
        l.forget(1);
        l.forget(2);
        assert!(gives(&l.due(100_000)).is_empty());
    }

    #[test]
    fn agents_are_probed_every_second_silent_ones_every_five_and_away_ones_every_250_ms() {
        let mut l = Lifecycle::default();
        l.adopt(1, A, "boot-1", None, 0);
        reported(&mut l);
        assert_eq!(l.due(0), vec![Action::Probe(A.into())]);
        assert!(l.due(500).is_empty());
        assert_eq!(l.due(PROBE_EVERY_MS), vec![Action::Probe(A.into())]);
        // A probe that failed: silent, not away.
        l.unreachable(A, 1_000);
        assert!(!l.is_away(A));
        assert!(l.due(2_000).is_empty());
        assert!(l.away_probes_due(2_000).is_empty());
        assert_eq!(
            l.due(1_000 + SILENT_PROBE_EVERY_MS),
            vec![Action::Probe(A.into())]
        );
        l.seen(A, Some("boot-1"), None, 1_050);
        assert!(l.missed_deadline(A, 1_100));
        assert!(l.due(1_100 + AWAY_PROBE_EVERY_MS - 1).is_empty());
        assert_eq!(
            l.due(1_100 + AWAY_PROBE_EVERY_MS),
            vec![Action::Probe(A.into())]
        );
        // The quick path between ticks probes only away agents, on the same schedule.
        assert!(l.away_probes_due(1_100 + AWAY_PROBE_EVERY_MS).is_empty());
        assert_eq!(
            l.away_probes_due(1_100 + 2 * AWAY_PROBE_EVERY_MS),
            vec![A.to_string()]
        );
    }

    /// A stalled peer costs one timeout: an agent that did not answer is away (stores
    /// skip its regions, loads miss its bytes) from that moment until it answers
    /// again, and an away agent is probed within 250 ms even when no own region is
    /// there (a reader's agent), so the first call after it answers uses it.
    #[test]
    fn an_agent_that_did_not_answer_is_away_until_it_answers_again() {
        let mut l = Lifecycle::default();
        l.adopt(1, A, "boot-1", None, 0);
        reported(&mut l);
        assert!(!l.is_away(A));
        assert!(l.missed_deadline(A, 2_000), "newly away: said once");
        assert!(!l.missed_deadline(A, 2_100), "still away: not said again");
        assert!(l.is_away(A));
        assert!(!l.is_away(B));
        // A reader's agent (no own region there) is probed too while away.
        l.missed_deadline(B, 2_000);
        let probes = |d: Vec<Action>| {
            d.into_iter()
                .filter_map(|a| match a {
                    Action::Probe(x) => Some(x),
                    _ => None,
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(
            probes(l.due(2_000 + AWAY_PROBE_EVERY_MS)),
            vec![A.to_string(), B.to_string()]
        );
        // No give back for an agent without own regions, however long it is away.
        assert!(l
            .due(2_000 + AGENT_SILENCE_MS)
            .iter()
            .all(|a| !matches!(a, Action::GiveBack { agent, .. } if agent == B)));
        // The probe's answer: back at once, on the same boot (no remap, no report).
        assert_eq!(l.seen(A, Some("boot-1"), None, 2_600), Verdict::Same);
        assert!(!l.is_away(A));
        assert!(!l.must_report());
    }

    #[test]
    fn a_lost_session_is_released_only_when_maru_server_restarted() {
        assert_eq!(lost_session("run-1", "run-2"), LostSession::ReleaseAtAgents);
        assert_eq!(lost_session("run-1", "run-1"), LostSession::LeaveToKeeper);
        assert_eq!(lost_session("", "run-2"), LostSession::LeaveToKeeper);
    }
}
