//! Storage sessions: one per worker engine, bound to the client that opened it,
//! alive while its requests keep coming.
//!
//! A session that sends nothing for the session timeout expires. An ended session
//! (closed or expired) holds nothing: its regions went to the region keeper or back
//! to the RM, its leases ended, and it does not count toward the session limit. A
//! bounded record of ended sessions remains only to say why a late request fails.
//!
//! Every request checks for expired sessions and every turn of the event loop asks
//! when the next one expires, so the table keeps its sessions ordered by when they
//! were last seen, and counts them per client and per tenant: no operation visits
//! sessions other than those it acts on (see [`SessionTable::visited`]).

use super::keys::ScopeId;
use super::tenants::Access;
use crate::wire::meta::{Backend, SkipCounts};
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};

/// Ended sessions remembered for error messages; the oldest records go beyond this.
pub const ENDED_RECORDS: usize = 4096;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndReason {
    Closed,
    Expired,
}

#[derive(Debug, Clone)]
pub struct Session {
    pub id: u64,
    /// Who may act on it: the connection that opened it, or one presenting its secret.
    pub client_id: String,
    /// The tenant whose key that connection proved.
    pub tenant: String,
    /// What the tenant may do in the session's namespace (read or write).
    pub access: Access,
    pub engine_id: String,
    pub namespace: String,
    pub backend: Backend,
    pub scope: ScopeId,
    /// Regions the session owns, oldest first. Changed only through
    /// `MetaCore::join_region` and `leave_region`, which count them for the fair share.
    pub regions: BTreeSet<u64>,
    pub last_seen_ms: u64,
    /// False once a connection of its client closed, until its next request.
    pub connected: bool,
    pub hits: u64,
    pub misses: u64,
}

/// Why a request names a session it may not use; each message says what to do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SessionError {
    #[error("unknown session {session} (maru-server may have restarted): open a new session")]
    Unknown { session: u64 },
    #[error("session {session} {}: open a new session", reason.what())]
    Ended { session: u64, reason: EndReason },
    /// The session belongs to another client.
    #[error("session {session} is not a session of client {client_id}: open a new session")]
    NotYours { session: u64, client_id: String },
    #[error(
        "{open} sessions are open and maru-server takes at most {max}: close sessions or \
         raise the limit"
    )]
    Full { open: usize, max: usize },
}

impl EndReason {
    /// How a session that ended so is described in errors.
    fn what(self) -> &'static str {
        match self {
            EndReason::Closed => "is closed",
            EndReason::Expired => {
                "expired (no request within the session timeout); its regions went to the \
                 region keeper"
            }
        }
    }
}

/// What a new session is made of.
#[derive(Debug, Clone, Copy)]
pub struct NewSession<'a> {
    pub client_id: &'a str,
    pub tenant: &'a str,
    pub access: Access,
    pub engine_id: &'a str,
    pub namespace: &'a str,
    pub backend: Backend,
}

#[derive(Debug)]
pub struct SessionTable {
    sessions: BTreeMap<u64, Session>,
    ended: VecDeque<u64>,
    ended_reason: HashMap<u64, EndReason>,
    next_id: u64,
    max: usize,
    timeout_ms: u64,
    /// Sessions opened or ended since the last [`take_dirty`](Self::take_dirty),
    /// when the table is kept durable.
    dirty: Option<std::collections::BTreeSet<u64>>,
    changes: u64,
    /// Per open session, the skip counts its worker's last heartbeat reported (not
    /// kept durable: the next heartbeat after a restart says them again).
    skipped: BTreeMap<u64, SkipCounts>,
    /// The open sessions by (last seen, id): the expired ones come first.
    by_seen: BTreeSet<(u64, u64)>,
    /// Open sessions per client id and per tenant.
    per_client: HashMap<String, BTreeSet<u64>>,
    per_tenant: HashMap<String, usize>,
    /// Sessions visited by the lookups over many sessions (expiry, counts), for the
    /// tests that keep each operation's work independent of the number of sessions.
    visited: std::cell::Cell<u64>,
}

impl SessionTable {
    pub fn new(max: usize, timeout_ms: u64) -> SessionTable {
        SessionTable {
            sessions: BTreeMap::new(),
            ended: VecDeque::new(),
            ended_reason: HashMap::new(),
            next_id: 0,
            max,
            timeout_ms,
            dirty: None,
            changes: 0,
            skipped: BTreeMap::new(),
            by_seen: BTreeSet::new(),
            per_client: HashMap::new(),
            per_tenant: HashMap::new(),
            visited: std::cell::Cell::new(0),
        }
    }

    /// Sessions visited so far by the lookups over many sessions ([`expired`],
    /// [`next_expiry`], [`count_of`], [`has_client`], [`client_closed`]): each visits
    /// only the sessions it returns or changes, and at most one more; and by
    /// [`iter`](Self::iter), which visits them all.
    ///
    /// [`expired`]: Self::expired
    /// [`next_expiry`]: Self::next_expiry
    /// [`count_of`]: Self::count_of
    /// [`has_client`]: Self::has_client
    /// [`client_closed`]: Self::client_closed
    pub fn visited(&self) -> u64 {
        self.visited.get()
    }

    fn visit(&self, n: usize) {
        self.visited.set(self.visited.get() + n as u64);
    }

    /// Adds `s` to the indexes (it is not in the table yet).
    fn index(&mut self, s: &Session) {
        self.by_seen.insert((s.last_seen_ms, s.id));
        self.per_client
            .entry(s.client_id.clone())
            .or_default()
            .insert(s.id);
        *self.per_tenant.entry(s.tenant.clone()).or_default() += 1;
    }

    /// Takes `s` out of the indexes (it left the table).
    fn unindex(&mut self, s: &Session) {
        self.by_seen.remove(&(s.last_seen_ms, s.id));
        if let Some(ids) = self.per_client.get_mut(&s.client_id) {
            ids.remove(&s.id);
            if ids.is_empty() {
                self.per_client.remove(&s.client_id);
            }
        }
        if let Some(n) = self.per_tenant.get_mut(&s.tenant) {
            *n -= 1;
            if *n == 0 {
                self.per_tenant.remove(&s.tenant);
            }
        }
    }

    /// Session `id` sent a request at `now_ms` (its time runs from then); it is
    /// connected again.
    pub fn touch(&mut self, id: u64, now_ms: u64) {
        let Some(s) = self.sessions.get_mut(&id) else {
            return;
        };
        s.connected = true;
        if now_ms > s.last_seen_ms {
            self.by_seen.remove(&(s.last_seen_ms, id));
            s.last_seen_ms = now_ms;
            self.by_seen.insert((now_ms, id));
        }
    }

    /// Records which sessions open or end from now on.
    pub fn keep_journal(&mut self) {
        self.dirty.get_or_insert_with(Default::default);
    }

    fn mark(&mut self, id: u64) {
        if let Some(d) = &mut self.dirty {
            d.insert(id);
            self.changes += 1;
        }
    }

    pub fn changes(&self) -> u64 {
        self.changes
    }

    /// Sessions opened or ended since the last call.
    pub fn take_dirty(&mut self) -> std::collections::BTreeSet<u64> {
        self.dirty.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// Later sessions get ids from `next` on (recovery).
    pub fn restore_next(&mut self, next: u64) {
        self.next_id = self.next_id.max(next.saturating_sub(1));
    }

    /// The id the next session gets.
    pub fn next_id(&self) -> u64 {
        self.next_id + 1
    }

    /// Puts a recorded session back (recovery): it is not connected, and its time
    /// runs from `now_ms`. Later sessions get ids after `next` and after it.
    pub fn restore(&mut self, s: Session, next: u64) {
        self.next_id = self.next_id.max(s.id).max(next.saturating_sub(1));
        if let Some(old) = self.sessions.remove(&s.id) {
            self.unindex(&old);
        }
        self.index(&s);
        self.sessions.insert(s.id, s);
    }

    pub fn len(&self) -> usize {
        self.sessions.len()
    }

    pub fn is_empty(&self) -> bool {
        self.sessions.is_empty()
    }

    pub fn check_room(&self) -> Result<(), SessionError> {
        if self.sessions.len() >= self.max {
            return Err(SessionError::Full {
                open: self.sessions.len(),
                max: self.max,
            });
        }
        Ok(())
    }

    pub fn insert(&mut self, new: NewSession<'_>, scope: ScopeId, now_ms: u64) -> u64 {
        self.next_id += 1;
        let id = self.next_id;
        let NewSession {
            client_id,
            tenant,
            access,
            engine_id,
            namespace,
            backend,
        } = new;
        let s = Session {
            id,
            client_id: client_id.to_string(),
            tenant: tenant.to_string(),
            access,
            engine_id: engine_id.to_string(),
            namespace: namespace.to_string(),
            backend,
            scope,
            regions: BTreeSet::new(),
            last_seen_ms: now_ms,
            connected: true,
            hits: 0,
            misses: 0,
        };
        self.index(&s);
        self.sessions.insert(id, s);
        self.mark(id);
        id
    }

    pub fn get(&self, id: u64) -> Option<&Session> {
        self.sessions.get(&id)
    }

    /// A session the caller's request was just checked against (`MetaCore::session`):
    /// its absence is a bug, reported as an internal error.
    pub(super) fn checked(&self, id: u64) -> Result<&Session, crate::wire::WireError> {
        self.get(id)
            .ok_or_else(|| super::errors::internal(format!("session {id} vanished")))
    }

    /// The session to change; its `last_seen_ms`, `client_id` and `tenant` are the
    /// table's indexes' and change only through [`touch`](Self::touch).
    pub fn get_mut(&mut self, id: u64) -> Option<&mut Session> {
        self.sessions.get_mut(&id)
    }

    /// The session `id` of `client_id`, or why there is none.
    pub fn lookup(&self, client_id: &str, id: u64) -> Result<&Session, SessionError> {
        match self.sessions.get(&id) {
            Some(s) if s.client_id == client_id => Ok(s),
            Some(_) => Err(SessionError::NotYours {
                session: id,
                client_id: client_id.to_string(),
            }),
            None => Err(match self.ended_reason.get(&id) {
                Some(&reason) => SessionError::Ended {
                    session: id,
                    reason,
                },
                None => SessionError::Unknown { session: id },
            }),
        }
    }

    /// Keeps the skip counts session `id`'s worker reported (the last report wins;
    /// one entry per open session).
    pub fn note_skipped(&mut self, id: u64, counts: SkipCounts) {
        if self.sessions.contains_key(&id) {
            self.skipped.insert(id, counts);
        }
    }

    /// The skip counts session `id`'s worker last reported (0 before any).
    pub fn skipped(&self, id: u64) -> SkipCounts {
        self.skipped.get(&id).copied().unwrap_or_default()
    }

    /// Removes the session and remembers why it ended.
    pub fn end(&mut self, id: u64, reason: EndReason) -> Option<Session> {
        let s = self.sessions.remove(&id)?;
        self.unindex(&s);
        self.skipped.remove(&id);
        self.mark(id);
        self.ended.push_back(id);
        self.ended_reason.insert(id, reason);
        while self.ended.len() > ENDED_RECORDS {
            if let Some(old) = self.ended.pop_front() {
                self.ended_reason.remove(&old);
            }
        }
        Some(s)
    }

    pub fn deadline(&self, s: &Session) -> u64 {
        s.last_seen_ms.saturating_add(self.timeout_ms)
    }

    /// Sessions whose time is up at `now_ms`, longest silent first.
    pub fn expired(&self, now_ms: u64) -> Vec<u64> {
        let out: Vec<u64> = self
            .by_seen
            .iter()
            .take_while(|(seen, _)| seen.saturating_add(self.timeout_ms) <= now_ms)
            .map(|&(_, id)| id)
            .collect();
        self.visit(out.len() + 1);
        out
    }

    pub fn next_expiry(&self) -> Option<u64> {
        self.visit(1);
        self.by_seen
            .first()
            .map(|&(seen, _)| seen.saturating_add(self.timeout_ms))
    }

    /// Every open session (each counted as visited).
    pub fn iter(&self) -> impl Iterator<Item = &Session> {
        self.visit(self.sessions.len());
        self.sessions.values()
    }

    /// Live sessions of `tenant`.
    pub fn count_of(&self, tenant: &str) -> usize {
        self.visit(1);
        self.per_tenant.get(tenant).copied().unwrap_or(0)
    }

    /// Whether `client_id` has a live session.
    pub fn has_client(&self, client_id: &str) -> bool {
        self.visit(1);
        self.per_client.contains_key(client_id)
    }

    /// A connection of `client_id` closed: its sessions keep running (the worker
    /// may reconnect) and expire only when their requests stop.
    pub fn client_closed(&mut self, client_id: &str) {
        let ids = self.per_client.get(client_id);
        self.visit(ids.map_or(1, BTreeSet::len));
        for id in ids.into_iter().flatten() {
            if let Some(s) = self.sessions.get_mut(id) {
                s.connected = false;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::meta::keys::{KeyDirectory, Scope};

    fn new(client_id: &str) -> NewSession<'_> {
        NewSession {
            client_id,
            tenant: "t",
            access: Access::Write,
            engine_id: "e",
            namespace: "ns",
            backend: Backend::Cxl,
        }
    }

    fn table(max: usize) -> (SessionTable, ScopeId) {
        let mut d = KeyDirectory::new();
        let scope = d.scope_id(Scope {
            namespace: "ns".into(),
            layout: "l".into(),
            backend: Backend::Cxl,
        });
        (SessionTable::new(max, 100), scope)
    }

    #[test]
    fn sessions_belong_to_their_client_and_ended_ones_say_why() {
        let (mut t, scope) = table(4);
        let a = t.insert(new("c1"), scope, 0);
        assert!(t.lookup("c1", a).is_ok());
        assert!(matches!(
            t.lookup("c2", a),
            Err(SessionError::NotYours { .. })
        ));
        t.end(a, EndReason::Expired);
        let e = t.lookup("c1", a).unwrap_err();
        assert!(e.to_string().contains("expired"), "{e}");
        assert_eq!(
            t.lookup("c1", 99).unwrap_err(),
            SessionError::Unknown { session: 99 }
        );
    }

    #[test]
    fn ended_sessions_do_not_count_toward_the_limit() {
        let (mut t, scope) = table(1);
        let a = t.insert(new("c"), scope, 0);
        assert!(matches!(t.check_room(), Err(SessionError::Full { .. })));
        assert_eq!(t.expired(99), Vec::<u64>::new());
        assert_eq!(t.expired(100), vec![a]);
        t.end(a, EndReason::Expired);
        t.check_room().unwrap();
    }

    #[test]
    fn ended_records_are_bounded() {
        let (mut t, scope) = table(1);
        for _ in 0..ENDED_RECORDS + 10 {
            let id = t.insert(new("c"), scope, 0);
            t.end(id, EndReason::Closed);
        }
        assert_eq!(t.ended.len(), ENDED_RECORDS);
        assert_eq!(t.ended_reason.len(), ENDED_RECORDS);
        assert_eq!(
            t.lookup("c", 1).unwrap_err(),
            SessionError::Unknown { session: 1 }
        );
    }
}
