//! A storage session at one pool's maru-server: typed calls over up to [`MAX_LINKS`]
//! reconnecting links, one per call in flight (every link after the first presents
//! the session's secret, binding it to the same principal).

use super::held::{HeldPages, NoReport};
use super::wire::{
    EntryRef, ExistsOk, KeysCall, KindOnly, LeasesOk, PagesOk, PinnedOk, PublishedOk, RemovedOk,
    ReplyKind, VictimsOk,
};
use crate::net::{ClientOptions, Link, LinkError};
use crate::wire::meta::{
    Backend, HandshakeReply, HeartbeatReply, HeldLease, KeyInfo, LeaseGrant, MetaReply,
    MetaRequest, PageGrant, PageRef, PublishEntry, RegionGrant, RemoveResult, SessionReply,
    SERVICE,
};
use crate::wire::ErrorCode;
use crate::worker::clock::{now_ms, Deadline};
use crate::worker::error::{Peer, WorkerError};
use crate::worker::op_stats::{contacted, Contact};
use serde::{de::DeserializeOwned, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::Duration;

/// Connections a session opens at most (its requests in flight at once).
pub const MAX_LINKS: usize = 8;

/// The links of a session: idle ones, and how many exist.
struct Links<L = Link> {
    idle: Vec<L>,
    open: usize,
    /// Calls waiting for a link to come free (a link given back wakes one only then:
    /// std's notify is a `futex` system call whether or not a thread waits).
    waiting: usize,
    /// Options of a new link (with the session's secret).
    opts: ClientOptions,
}

pub struct Session {
    pub url: String,
    links: Mutex<Links>,
    freed: Condvar,
    /// The leases held now, by id: (region, offset, when it runs out), told in each
    /// heartbeat; forgotten once their release is sent or they ran out.
    held: Mutex<HashMap<u64, (u64, u64, u64)>>,
    /// The pages handed to the session that hold no key it published, and the gate
    /// between the calls that change them and a report of them (see `held`).
    unkeyed: HeldPages,
    pub id: u64,
    pub page_size: u64,
    pub handshake: HandshakeReply,
    /// A region the open came with (none: the first store expands).
    pub first_region: Option<RegionGrant>,
    pub session_timeout_ms: u64,
    /// When maru-server last answered a call of this session (`clock::now_ms`): one
    /// out of reach for longer than the session timeout has expired the session.
    answered_ms: AtomicU64,
    /// When a call last ran into its deadline unanswered (0: never; `core::server_away`).
    unanswered_ms: AtomicU64,
    /// Regions maru-server asked back on a reply other than a heartbeat's, not yet
    /// acted on (see [`take_asked`](Self::take_asked)).
    asked: Mutex<Vec<u64>>,
    /// Whether the last store of this session found none of its keys present (its
    /// `exists` found none, and its publish answered every key new): the next store
    /// skips its `exists` round trip then (see `StoragePool::store_some`).
    stores_fresh: AtomicBool,
    /// The session's fair share in regions as maru-server last told it (`alloc`
    /// replies); 0: not heard yet.
    share_regions: AtomicU64,
}

fn unexpected(what: &str, r: MetaReply) -> WorkerError {
    WorkerError::Transport(format!("maru-server answered {what} with {r:?}"))
}

impl Session {
    /// Handshake (proving `key`, the engine's tenant key, when given) and open a
    /// session. `backend` must be among the server's capabilities.
    #[allow(clippy::too_many_arguments)]
    pub fn open(
        url: &str,
        client_id: &str,
        key: Option<crate::auth::SharedKey>,
        engine_id: &str,
        namespace: &str,
        layout: &str,
        backend: Backend,
        timeout: Duration,
    ) -> Result<Session, WorkerError> {
        let mut opts = ClientOptions::new(SERVICE, client_id.to_string());
        opts.key = key;
        opts.connect_timeout = timeout.min(Duration::from_secs(5));
        opts.call_timeout = timeout;
        let mut link = Link::new(url, opts.clone());
        let at = |e| WorkerError::from_link(Peer::Server(url.to_string()), e);
        let handshake = match link
            .call::<_, MetaReply>(&MetaRequest::Handshake {})
            .map_err(at)?
        {
            MetaReply::Handshake(h) => h,
            r => return Err(unexpected("handshake", r)),
        };
        let cap = match backend {
            Backend::Cxl => crate::wire::meta::CAP_CXL_STORAGE,
            Backend::RemoteCxl => crate::wire::meta::CAP_REMOTE_CXL_STORAGE,
        };
        if !handshake.capabilities.iter().any(|c| c == cap) {
            return Err(WorkerError::Config(format!(
                "maru-server at {url} does not offer {cap} (it offers {:?}); for remote_cxl start it with --remote-cxl-agent",
                handshake.capabilities
            )));
        }
        let req = MetaRequest::OpenSession {
            engine_id: engine_id.into(),
            namespace: namespace.into(),
            layout: layout.into(),
            backend,
            // A region is taken by the first store: a reader that never stores holds
            // none.
            first_region: false,
        };
        let s: SessionReply = match link.call::<_, MetaReply>(&req).map_err(at)? {
            MetaReply::Session(s) => s,
            r => return Err(unexpected("open_session", r)),
        };
        link.set_resume(s.session_secret.clone());
        opts.resume = s.session_secret.clone();
        Ok(Session {
            url: url.to_string(),
            links: Mutex::new(Links {
                idle: vec![link],
                open: 1,
                waiting: 0,
                opts,
            }),
            freed: Condvar::new(),
            held: Mutex::new(HashMap::new()),
            unkeyed: HeldPages::default(),
            id: s.session,
            page_size: s.page_size,
            handshake,
            first_region: s.region,
            session_timeout_ms: s.session_timeout_ms,
            answered_ms: AtomicU64::new(now_ms()),
            unanswered_ms: AtomicU64::new(0),
            asked: Mutex::new(Vec::new()),
            stores_fresh: AtomicBool::new(false),
            share_regions: AtomicU64::new(0),
        })
    }

    /// How long each call polls for maru-server's reply before it blocks.
    pub fn set_reply_spin(&self, spin: Duration) {
        if let Ok(mut l) = self.links.lock() {
            l.opts.reply_spin = spin;
            for link in &mut l.idle {
                link.set_reply_spin(spin);
            }
        }
    }

    /// The session's own call timeout from now (calls made outside a request).
    pub fn call_deadline(&self) -> Deadline {
        let limit = self
            .links
            .lock()
            .map(|l| l.opts.call_timeout)
            .unwrap_or(Duration::from_secs(10));
        Deadline::after(limit)
    }

    /// A call made for a request: waiting for a free link, connecting, the request
    /// and its reply all end by the request's deadline `by` (`timeout_ms` from its
    /// start), so a stalled maru-server costs a request about its timeout, however
    /// many calls it makes. `req`: any encoding of a `MetaRequest` (one that borrows
    /// its keys: [`KeysCall`]); the reply decoded as `Rep` (`MetaReply`, or a struct
    /// of one kind: see [`ExistsOk`]).
    fn call<Req: Serialize, Rep: DeserializeOwned>(
        &self,
        req: &Req,
        by: Deadline,
    ) -> Result<Rep, WorkerError> {
        let lent = take_lent(&self.links, &self.freed, by, |opts| {
            Link::new(self.url.clone(), opts.clone())
        })?;
        let mut link = lent.ok_or_else(|| {
            WorkerError::unavailable(
                Peer::Server(self.url.clone()),
                format!(
                    "no connection to maru-server at {} came free by the request's deadline ({MAX_LINKS} busy)",
                    self.url
                ),
            )
        })?;
        let left = by.left();
        if left.is_zero() {
            give_lent(&self.links, &self.freed, link);
            return Err(WorkerError::unavailable(
                Peer::Server(self.url.clone()),
                format!(
                    "maru-server at {}: the request's deadline passed before this call",
                    self.url
                ),
            ));
        }
        contacted(Contact::Server);
        let r = link.call_within::<_, Rep>(req, left);
        give_lent(&self.links, &self.freed, link);
        let was_away = self.away();
        if let Err(LinkError::Unreachable(e)) = &r {
            self.unanswered_ms.store(now_ms().max(1), Ordering::Relaxed);
            if !was_away {
                log::warn!(
                    "maru-server at {} did not answer ({e}): exists answers false, stores skip and loads miss at once until a probe (every {} ms) sees it answer",
                    self.url,
                    crate::worker::lifecycle::AWAY_PROBE_EVERY_MS
                );
            }
        } else {
            self.answered_ms.store(now_ms(), Ordering::Relaxed);
            if was_away {
                log::warn!("maru-server at {} answers again", self.url);
            }
        }
        r.map_err(|e| session_error(&self.url, self.id, e))
    }

    /// Whether maru-server is away: a call ran into its deadline after its last
    /// answer (`core::server_away`). Exists, stores and loads of the pool do not wait
    /// on it then; a probe (`ping`) every 250 ms finds it answering again.
    pub fn away(&self) -> bool {
        super::core::server_away(
            self.answered_ms.load(Ordering::Relaxed),
            self.unanswered_ms.load(Ordering::Relaxed),
        )
    }

    /// The cheapest call (an `exists` of no key), by `by`: whether maru-server answers.
    pub(crate) fn ping(&self, by: Deadline) -> Result<(), WorkerError> {
        self.exists::<&str>(&[], by).map(|_| ())
    }

    /// maru-server asked for these regions back on a reply (any call of a storing
    /// session carries the ask, so it is heard at once, not at the next heartbeat).
    fn note_asked(&self, regions: Vec<u64>) {
        if regions.is_empty() {
            return;
        }
        let mut a = self.asked.lock().unwrap_or_else(|e| e.into_inner());
        for r in regions {
            if !a.contains(&r) {
                a.push(r);
            }
        }
    }

    /// Whether a store asks `exists` before it writes: unless the last store found
    /// none of its keys present.
    pub fn store_asks_exists(&self) -> bool {
        !self.stores_fresh.load(Ordering::Relaxed)
    }

    /// What a store found: some of its keys present already (its `exists`, or a
    /// publish that answered a key not new), or none (its `exists` found none).
    pub fn note_store_found(&self, any_present: bool) {
        self.stores_fresh.store(!any_present, Ordering::Relaxed);
    }

    /// The session's fair share in regions as maru-server last told it (None: no
    /// `alloc` answered yet, or a maru-server that does not tell).
    pub fn share_regions(&self) -> Option<u64> {
        Some(self.share_regions.load(Ordering::Relaxed)).filter(|&s| s > 0)
    }

    /// The regions asked back since the last call (for the pool core to act on).
    pub fn take_asked(&self) -> Vec<u64> {
        let mut a = self.asked.lock().unwrap_or_else(|e| e.into_inner());
        std::mem::take(&mut *a)
    }

    pub fn expand(&self, by: Deadline) -> Result<RegionGrant, WorkerError> {
        match self.call::<_, MetaReply>(&MetaRequest::Expand { session: self.id }, by)? {
            MetaReply::Region(g) => Ok(g),
            r => Err(unexpected("expand", r)),
        }
    }

    /// Pages for `count` chunks; `missing` of them did not fit (expand first).
    pub fn alloc(
        &self,
        count: u32,
        route_key: Option<&str>,
        by: Deadline,
    ) -> Result<(Vec<PageGrant>, u32), WorkerError> {
        let guard = self.unkeyed.enter(by, "alloc", &self.url)?;
        let p: PagesOk = self.call(
            &MetaRequest::Alloc {
                session: self.id,
                count,
                route_key: route_key.map(str::to_string),
            },
            by,
        )?;
        p.kind.expect(ReplyKind::Pages, "alloc")?;
        guard.granted(&p.pages);
        drop(guard);
        self.note_asked(p.give_back);
        if let Some(s) = p.share_regions {
            self.share_regions.store(s.max(1), Ordering::Relaxed);
        }
        Ok((p.pages, p.missing))
    }

    pub fn free_pages(&self, pages: &[PageGrant], by: Deadline) -> Result<(), WorkerError> {
        if pages.is_empty() {
            return Ok(());
        }
        let guard = self.unkeyed.enter(by, "free_pages", &self.url)?;
        // Not held from here, whatever the answer: the worker does not use them again.
        guard.released(pages.iter().map(|p| (p.region_id, p.page)));
        let pages = pages
            .iter()
            .map(|p| PageRef {
                region_id: p.region_id,
                page: p.page,
            })
            .collect();
        let r: KindOnly = self.call(
            &MetaRequest::FreePages {
                session: self.id,
                pages,
            },
            by,
        )?;
        r.kind.expect(ReplyKind::PagesFreed, "free_pages")
    }

    pub fn publish(
        &self,
        entries: Vec<PublishEntry>,
        by: Deadline,
    ) -> Result<Vec<bool>, WorkerError> {
        let refs: Vec<EntryRef<'_>> = entries.iter().map(EntryRef::of).collect();
        self.publish_refs(&refs, by)
    }

    /// As [`publish`](Self::publish), the entries borrowing their keys (a store's).
    pub fn publish_refs(
        &self,
        entries: &[EntryRef<'_>],
        by: Deadline,
    ) -> Result<Vec<bool>, WorkerError> {
        let guard = self.unkeyed.enter(by, "publish", &self.url)?;
        let page_size = self.page_size.max(1);
        let pages: Vec<(u64, u64)> = entries
            .iter()
            .map(|e| (e.region_id, e.offset / page_size))
            .collect();
        let req: KeysCall<'_, &str> = KeysCall::Publish {
            session: self.id,
            entries,
        };
        let r = self
            .call::<_, PublishedOk>(&req, by)
            .and_then(|p| p.kind.expect(ReplyKind::Published, "publish").map(|()| p));
        match r {
            Ok(PublishedOk {
                is_new, give_back, ..
            }) => {
                // A key another session published first leaves its page held (the
                // store keeps it for the next one).
                guard.released(
                    pages
                        .iter()
                        .zip(&is_new)
                        .filter(|(_, &new)| new)
                        .map(|(p, _)| *p),
                );
                drop(guard);
                self.note_asked(give_back);
                Ok(is_new)
            }
            Err(e) => {
                // The keys may be published: the store keeps these pages out of use.
                guard.released(pages);
                Err(e)
            }
        }
    }

    /// Whether each key is published (`keys`: `String`s or `&str`s, sent as they are).
    pub fn exists<K: Serialize>(&self, keys: &[K], by: Deadline) -> Result<Vec<bool>, WorkerError> {
        let r: ExistsOk = self.call(
            &KeysCall::Exists {
                session: self.id,
                keys,
            },
            by,
        )?;
        r.kind.expect(ReplyKind::Exists, "exists")?;
        Ok(r.found)
    }

    pub fn acquire<K: Serialize>(
        &self,
        keys: &[K],
        by: Deadline,
    ) -> Result<Vec<Option<LeaseGrant>>, WorkerError> {
        let r: LeasesOk = self.call(
            &KeysCall::Acquire {
                session: self.id,
                keys,
            },
            by,
        )?;
        r.kind.expect(ReplyKind::Leases, "acquire")?;
        let leases = r.leases;
        let now = now_ms();
        if let Ok(mut h) = self.held.lock() {
            for l in leases.iter().flatten() {
                let ends = now.saturating_add(l.expires_in_ms);
                h.insert(l.lease_id, (l.region_id, l.offset, ends));
            }
        }
        Ok(leases)
    }

    /// Unpublishes keys of this session's own regions (their pages are free again).
    pub fn remove<K: Serialize>(
        &self,
        keys: &[K],
        by: Deadline,
    ) -> Result<Vec<RemoveResult>, WorkerError> {
        let req = KeysCall::Remove {
            session: self.id,
            keys,
        };
        let r: RemovedOk = self.call(&req, by)?;
        r.kind.expect(ReplyKind::Removed, "remove")?;
        Ok(r.results)
    }

    /// Up to `max` keys of the session's own regions to evict, in eviction order.
    pub fn victims(&self, max: u32, by: Deadline) -> Result<Vec<KeyInfo>, WorkerError> {
        let req = MetaRequest::Victims {
            session: self.id,
            max,
        };
        let r: VictimsOk = self.call(&req, by)?;
        r.kind.expect(ReplyKind::Victims, "victims")?;
        Ok(r.victims)
    }

    /// Pins found keys (`pin`; per key: found and pinned), or drops one of this
    /// session's pins of each (per key: one was dropped).
    pub fn pin<K: Serialize>(
        &self,
        keys: &[K],
        pin: bool,
        by: Deadline,
    ) -> Result<Vec<bool>, WorkerError> {
        let session = self.id;
        let (req, kind, what) = match pin {
            true => (KeysCall::Pin { session, keys }, ReplyKind::Pinned, "pin"),
            false => (
                KeysCall::Unpin { session, keys },
                ReplyKind::Unpinned,
                "unpin",
            ),
        };
        let r: PinnedOk = self.call(&req, by)?;
        r.kind.expect(kind, what)?;
        Ok(r.pinned)
    }

    pub fn release_leases(&self, ids: Vec<u64>, by: Deadline) -> Result<(), WorkerError> {
        if ids.is_empty() {
            return Ok(());
        }
        if let Ok(mut h) = self.held.lock() {
            for id in &ids {
                h.remove(id);
            }
        }
        let r: KindOnly = self.call(
            &MetaRequest::ReleaseLeases {
                session: self.id,
                lease_ids: ids,
            },
            by,
        )?;
        r.kind.expect(ReplyKind::LeasesReleased, "release_leases")
    }

    /// Gives one of the session's regions back: its keys stop being found at once.
    /// `released`: the worker released it at its agent already (else maru-server's
    /// region keeper does before the RM frees it).
    pub fn return_region(
        &self,
        region_id: u64,
        released: bool,
        by: Deadline,
    ) -> Result<(), WorkerError> {
        match self.call::<_, MetaReply>(
            &MetaRequest::ReturnRegion {
                session: self.id,
                region_id,
                released,
            },
            by,
        )? {
            MetaReply::Returned(_) => {
                self.unkeyed.region_gone(region_id);
                Ok(())
            }
            r => Err(unexpected("return_region", r)),
        }
    }

    /// The session is alive: the regions the worker writes into (`boot_ids`,
    /// `regions`), the leases held, the skip counts. `no_session`, or no answer for
    /// longer than the session timeout, is [`WorkerError::SessionLost`].
    pub fn heartbeat(
        &self,
        boot_ids: BTreeMap<u64, String>,
        regions: Vec<u64>,
        skipped: crate::wire::meta::SkipCounts,
        by: Deadline,
    ) -> Result<HeartbeatReply, WorkerError> {
        let now = now_ms();
        // More than a request carries (leases of two runs at once): say nothing, and
        // a restarted server waits out the lease timeout for this session instead.
        let leases = self.held.lock().ok().and_then(|mut h| {
            h.retain(|_, (_, _, ends)| *ends > now);
            (h.len() <= crate::wire::meta::MAX_BATCH).then(|| {
                h.iter()
                    .map(|(&lease_id, &(region_id, offset, ends))| HeldLease {
                        lease_id,
                        region_id,
                        offset,
                        expires_in_ms: ends - now,
                    })
                    .collect()
            })
        });
        let r = self.call::<_, MetaReply>(
            &MetaRequest::Heartbeat {
                session: self.id,
                boot_ids,
                regions,
                leases,
                skipped: Some(skipped),
                held_pages: None,
            },
            by,
        );
        match r {
            Ok(MetaReply::Heartbeat(h)) => {
                for &rid in &h.unknown_regions {
                    self.unkeyed.region_gone(rid);
                }
                if h.held_pages_wanted {
                    self.report_held(by);
                }
                Ok(h)
            }
            Ok(r) => Err(unexpected("heartbeat", r)),
            Err(e @ WorkerError::Unavailable { .. }) => {
                let silent = now_ms().saturating_sub(self.answered_ms.load(Ordering::Relaxed));
                if silent >= self.session_timeout_ms {
                    Err(WorkerError::SessionLost {
                        url: self.url.clone(),
                        session: self.id,
                        reason: format!(
                            "no answer for {silent} ms, longer than the session timeout ({e})"
                        ),
                    })
                } else {
                    Err(e)
                }
            }
            Err(e) => Err(e),
        }
    }

    /// Tells a restarted maru-server which pages the session holds without a key (see
    /// `held`); one not sent goes when the next heartbeat reply asks again.
    fn report_held(&self, by: Deadline) {
        let r = self.unkeyed.report(by, |pages| {
            let n = pages.len();
            let r = self.call::<_, MetaReply>(
                &MetaRequest::Heartbeat {
                    session: self.id,
                    boot_ids: BTreeMap::new(),
                    regions: Vec::new(),
                    leases: None,
                    skipped: None,
                    held_pages: Some(pages),
                },
                by,
            );
            (n, r)
        });
        let why = match r {
            Ok((n, Ok(_))) => {
                log::info!(
                    "pool {}: told the restarted maru-server the {n} page(s) session {} holds without a key; it frees the others it found allocated without one",
                    self.url,
                    self.id
                );
                return;
            }
            Err(NoReport::Busy) => return,
            Ok((_, Err(e))) => format!("its heartbeat failed: {e}"),
            Err(e) => e.to_string(),
        };
        log::warn!(
            "pool {}: the pages session {} holds without a key were not reported to the restarted maru-server ({why}); reported when it asks again",
            self.url,
            self.id
        );
    }

    pub fn close(&self, by: Deadline) -> Result<(), WorkerError> {
        self.call::<_, MetaReply>(
            &MetaRequest::Close {
                session: self.id,
                drained: true,
            },
            by,
        )
        .map(|_| ())
    }

    /// Closes the session of an open that failed after it was opened (`why`), so a
    /// failed open leaves none; one not closed ends when its heartbeats stop.
    pub fn close_failed_open(&self, why: &WorkerError, by: Deadline) {
        match self.close(by) {
            Ok(()) => log::debug!(
                "pool {}: session {} closed: the open failed ({why})",
                self.url,
                self.id
            ),
            Err(e) => log::warn!(
                "pool {}: session {} of a failed open ({why}) could not be closed: {e}; maru-server ends it after {} ms without heartbeats",
                self.url,
                self.id,
                self.session_timeout_ms
            ),
        }
    }
}

/// A link of `links` for one call: an idle one, a new one (`make`, up to
/// `MAX_LINKS`), or else the next one given back, waited for until `by` (None then).
fn take_lent<L>(
    links: &Mutex<Links<L>>,
    freed: &Condvar,
    by: Deadline,
    make: impl FnOnce(&ClientOptions) -> L,
) -> Result<Option<L>, WorkerError> {
    let closed = || WorkerError::Closed;
    let busy = |l: &mut Links<L>| l.idle.is_empty() && l.open >= MAX_LINKS;
    let mut l = links.lock().map_err(|_| closed())?;
    if busy(&mut l) {
        l.waiting += 1;
        l = freed
            .wait_timeout_while(l, by.left(), busy)
            .map_err(|_| closed())?
            .0;
        l.waiting -= 1;
    }
    if let Some(link) = l.idle.pop() {
        return Ok(Some(link));
    }
    if l.open < MAX_LINKS {
        l.open += 1;
        return Ok(Some(make(&l.opts)));
    }
    Ok(None)
}

/// Gives a link back to `links`, waking a call that waits for one (only then: std's
/// notify is a `futex` system call whether or not a thread waits, and a call gives
/// its link back every time).
fn give_lent<L>(links: &Mutex<Links<L>>, freed: &Condvar, link: L) {
    let wake = match links.lock() {
        Ok(mut l) => {
            l.idle.push(link);
            l.waiting > 0
        }
        Err(_) => true,
    };
    if wake {
        freed.notify_one();
    }
}

/// The error of a call of session `session` at maru-server `url`: its `no_session`
/// code (the session is not open there any more) is [`WorkerError::SessionLost`];
/// anything else as any call's.
fn session_error(url: &str, session: u64, e: LinkError) -> WorkerError {
    match e {
        LinkError::Remote(w) if w.code == ErrorCode::NoSession => WorkerError::SessionLost {
            url: url.to_string(),
            session,
            reason: w.message,
        },
        e => WorkerError::from_link(Peer::Server(url.to_string()), e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::WireError;

    #[test]
    fn a_link_given_back_wakes_a_call_waiting_for_one() {
        let links = Mutex::new(Links::<usize> {
            idle: Vec::new(),
            open: 0,
            waiting: 0,
            opts: ClientOptions::new(SERVICE, "t"),
        });
        let freed = Condvar::new();
        let mut made = 0;
        let mut taken: Vec<usize> = (0..MAX_LINKS)
            .map(|_| {
                let by = Deadline::after(Duration::ZERO);
                let l = take_lent(&links, &freed, by, |_| {
                    made += 1;
                    made
                });
                l.unwrap()
                    .expect("a new link while fewer than MAX_LINKS exist")
            })
            .collect();
        // All busy: nothing by a deadline already passed.
        let none = take_lent(&links, &freed, Deadline::after(Duration::ZERO), |_| 0);
        assert!(none.unwrap().is_none());
        std::thread::scope(|s| {
            let waiter = s.spawn(|| {
                let t = now_ms();
                let got = take_lent(
                    &links,
                    &freed,
                    Deadline::after(Duration::from_secs(5)),
                    |_| 0,
                );
                (got.unwrap(), Duration::from_millis(now_ms() - t))
            });
            // Given back once the waiter waits (bounded: 5 s).
            for _ in 0..5000 {
                if links.lock().unwrap().waiting == 1 {
                    break;
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            assert_eq!(links.lock().unwrap().waiting, 1, "the waiter never waited");
            give_lent(&links, &freed, taken.pop().unwrap());
            let (got, waited) = waiter.join().unwrap();
            assert_eq!(got, Some(MAX_LINKS));
            assert!(waited < Duration::from_secs(2), "woken after {waited:?}");
        });
        assert_eq!(links.lock().unwrap().waiting, 0);
        assert_eq!(made, MAX_LINKS);
    }

    #[test]
    fn no_session_is_a_lost_session_and_a_refusal_is_not() {
        let gone = WireError::new(
            ErrorCode::NoSession,
            "session 7 expired: open a new session",
        );
        match session_error("h:1", 7, LinkError::Remote(gone)) {
            WorkerError::SessionLost {
                url,
                session,
                reason,
            } => {
                assert_eq!((url.as_str(), session), ("h:1", 7));
                assert!(reason.contains("expired"), "{reason}");
            }
            e => panic!("no_session must be SessionLost, not {e:?}"),
        }
        let refused = WireError::new(ErrorCode::Refused, "the region can never be allocated");
        assert!(matches!(
            session_error("h:1", 7, LinkError::Remote(refused)),
            WorkerError::Refused { .. }
        ));
        assert!(matches!(
            session_error("h:1", 7, LinkError::Unreachable("down".into())),
            WorkerError::Unavailable { .. }
        ));
    }
}
