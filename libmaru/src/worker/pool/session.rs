//! A storage session at one pool's maru-server: typed calls over a small set of
//! reconnecting links. Concurrent requests of a handler each take a link of their
//! own (up to [`MAX_LINKS`]), so that one slow reply does not hold the others: every
//! link after the first presents the session's secret in its hello, and maru-server
//! binds it to the same principal (see `SessionBinding` in maru-server).

use crate::net::{ClientOptions, Link, LinkError};
use crate::wire::meta::{
    Backend, HandshakeReply, HeartbeatReply, KeyInfo, LeaseGrant, MetaReply, MetaRequest,
    PageGrant, PageRef, PublishEntry, RegionGrant, RemoveResult, SessionReply, SERVICE,
};
use crate::worker::clock::now_ms;
use crate::worker::error::{Peer, WorkerError};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::Duration;

/// Connections a session opens at most (its requests in flight at once).
pub const MAX_LINKS: usize = 8;

/// The links of a session: idle ones, and how many exist.
struct Links {
    idle: Vec<Link>,
    open: usize,
    /// Options of a new link (with the session's secret).
    opts: ClientOptions,
}

pub struct Session {
    pub url: String,
    links: Mutex<Links>,
    freed: Condvar,
    pub id: u64,
    pub page_size: u64,
    pub handshake: HandshakeReply,
    /// A region the open came with (none: the first store expands).
    pub first_region: Option<RegionGrant>,
    pub session_timeout_ms: u64,
    /// When maru-server last answered a call of this session (`clock::now_ms`): one
    /// out of reach for longer than the session timeout has expired the session.
    answered_ms: AtomicU64,
    /// Regions maru-server asked back on a reply other than a heartbeat's, not yet
    /// acted on (see [`take_asked`](Self::take_asked)).
    asked: Mutex<Vec<u64>>,
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
                opts,
            }),
            freed: Condvar::new(),
            id: s.session,
            page_size: s.page_size,
            handshake,
            first_region: s.region,
            session_timeout_ms: s.session_timeout_ms,
            answered_ms: AtomicU64::new(now_ms()),
            asked: Mutex::new(Vec::new()),
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

    /// A link of its own for one call: an idle one, a new one (up to `MAX_LINKS`),
    /// or else the next one given back.
    fn take_link(&self) -> Result<Link, WorkerError> {
        let closed = || WorkerError::Closed;
        let mut l = self.links.lock().map_err(|_| closed())?;
        loop {
            if let Some(link) = l.idle.pop() {
                return Ok(link);
            }
            if l.open < MAX_LINKS {
                l.open += 1;
                return Ok(Link::new(self.url.clone(), l.opts.clone()));
            }
            l = self.freed.wait(l).map_err(|_| closed())?;
        }
    }

    fn give_link(&self, link: Link) {
        if let Ok(mut l) = self.links.lock() {
            l.idle.push(link);
        }
        self.freed.notify_one();
    }

    fn call(&self, req: &MetaRequest) -> Result<MetaReply, WorkerError> {
        let mut link = self.take_link()?;
        let r = link.call::<_, MetaReply>(req);
        self.give_link(link);
        if !matches!(r, Err(LinkError::Unreachable(_))) {
            self.answered_ms.store(now_ms(), Ordering::Relaxed);
        }
        r.map_err(|e| WorkerError::from_link(Peer::Server(self.url.clone()), e))
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

    pub fn expand(&self) -> Result<RegionGrant, WorkerError> {
        match self.call(&MetaRequest::Expand { session: self.id })? {
            MetaReply::Region(g) => Ok(g),
            r => Err(unexpected("expand", r)),
        }
    }

    /// Pages for `count` chunks; `missing` of them did not fit (expand first).
    pub fn alloc(
        &self,
        count: u32,
        route_key: Option<&str>,
    ) -> Result<(Vec<PageGrant>, u32), WorkerError> {
        match self.call(&MetaRequest::Alloc {
            session: self.id,
            count,
            route_key: route_key.map(str::to_string),
        })? {
            MetaReply::Pages(p) => {
                self.note_asked(p.give_back);
                if let Some(s) = p.share_regions {
                    self.share_regions.store(s.max(1), Ordering::Relaxed);
                }
                Ok((p.pages, p.missing))
            }
            r => Err(unexpected("alloc", r)),
        }
    }

    pub fn free_pages(&self, pages: &[PageGrant]) -> Result<(), WorkerError> {
        if pages.is_empty() {
            return Ok(());
        }
        let pages = pages
            .iter()
            .map(|p| PageRef {
                region_id: p.region_id,
                page: p.page,
            })
            .collect();
        self.call(&MetaRequest::FreePages {
            session: self.id,
            pages,
        })
        .map(|_| ())
    }

    pub fn publish(&self, entries: Vec<PublishEntry>) -> Result<Vec<bool>, WorkerError> {
        match self.call(&MetaRequest::Publish {
            session: self.id,
            entries,
        })? {
            MetaReply::Published { is_new, give_back } => {
                self.note_asked(give_back);
                Ok(is_new)
            }
            r => Err(unexpected("publish", r)),
        }
    }

    pub fn exists(&self, keys: &[String]) -> Result<Vec<bool>, WorkerError> {
        match self.call(&MetaRequest::Exists {
            session: self.id,
            keys: keys.to_vec(),
        })? {
            MetaReply::Exists { found } => Ok(found),
            r => Err(unexpected("exists", r)),
        }
    }

    pub fn acquire(&self, keys: &[String]) -> Result<Vec<Option<LeaseGrant>>, WorkerError> {
        match self.call(&MetaRequest::Acquire {
            session: self.id,
            keys: keys.to_vec(),
        })? {
            MetaReply::Leases { leases } => Ok(leases),
            r => Err(unexpected("acquire", r)),
        }
    }

    /// Unpublishes keys of this session's own regions (their pages are free again).
    pub fn remove(&self, keys: &[String]) -> Result<Vec<RemoveResult>, WorkerError> {
        match self.call(&MetaRequest::Remove {
            session: self.id,
            keys: keys.to_vec(),
        })? {
            MetaReply::Removed { results } => Ok(results),
            r => Err(unexpected("remove", r)),
        }
    }

    /// Up to `max` keys of the session's own regions to evict, in eviction order.
    pub fn victims(&self, max: u32) -> Result<Vec<KeyInfo>, WorkerError> {
        match self.call(&MetaRequest::Victims {
            session: self.id,
            max,
        })? {
            MetaReply::Victims { victims } => Ok(victims),
            r => Err(unexpected("victims", r)),
        }
    }

    /// Pins found keys (per key: found and pinned).
    pub fn pin(&self, keys: &[String]) -> Result<Vec<bool>, WorkerError> {
        match self.call(&MetaRequest::Pin {
            session: self.id,
            keys: keys.to_vec(),
        })? {
            MetaReply::Pinned { pinned } => Ok(pinned),
            r => Err(unexpected("pin", r)),
        }
    }

    /// Drops one of this session's pins of each key (per key: one was dropped).
    pub fn unpin(&self, keys: &[String]) -> Result<Vec<bool>, WorkerError> {
        match self.call(&MetaRequest::Unpin {
            session: self.id,
            keys: keys.to_vec(),
        })? {
            MetaReply::Unpinned { unpinned } => Ok(unpinned),
            r => Err(unexpected("unpin", r)),
        }
    }

    pub fn release_leases(&self, ids: Vec<u64>) -> Result<(), WorkerError> {
        if ids.is_empty() {
            return Ok(());
        }
        self.call(&MetaRequest::ReleaseLeases {
            session: self.id,
            lease_ids: ids,
        })
        .map(|_| ())
    }

    /// Gives one of the session's regions back: its keys stop being found at once.
    /// `released`: the worker released it at its agent already (else maru-server's
    /// region keeper does before the RM frees it).
    pub fn return_region(&self, region_id: u64, released: bool) -> Result<(), WorkerError> {
        match self.call(&MetaRequest::ReturnRegion {
            session: self.id,
            region_id,
            released,
        })? {
            MetaReply::Returned(_) => Ok(()),
            r => Err(unexpected("return_region", r)),
        }
    }

    /// The session is alive. `boot_ids` and `regions` name the regions the worker
    /// writes into; the reply says which of them are no longer the session's.
    ///
    /// A heartbeat names nothing but the session, so maru-server refusing it means the
    /// session is gone (expired, unknown after a restart, not this client's): that is
    /// [`WorkerError::SessionLost`], as is maru-server out of reach for longer than
    /// the session timeout (it expired the session meanwhile).
    pub fn heartbeat(
        &self,
        boot_ids: BTreeMap<u64, String>,
        regions: Vec<u64>,
    ) -> Result<HeartbeatReply, WorkerError> {
        let r = self.call(&MetaRequest::Heartbeat {
            session: self.id,
            boot_ids,
            regions,
        });
        match r {
            Ok(MetaReply::Heartbeat(h)) => Ok(h),
            Ok(r) => Err(unexpected("heartbeat", r)),
            Err(WorkerError::Refused { reason, .. } | WorkerError::Permission { reason, .. }) => {
                Err(self.lost(reason))
            }
            Err(e @ WorkerError::Unavailable { .. }) => {
                let silent = now_ms().saturating_sub(self.answered_ms.load(Ordering::Relaxed));
                if silent >= self.session_timeout_ms {
                    Err(self.lost(format!(
                        "no answer for {silent} ms, longer than the session timeout ({e})"
                    )))
                } else {
                    Err(e)
                }
            }
            Err(e) => Err(e),
        }
    }

    fn lost(&self, reason: String) -> WorkerError {
        WorkerError::SessionLost {
            url: self.url.clone(),
            session: self.id,
            reason,
        }
    }

    pub fn close(&self) -> Result<(), WorkerError> {
        self.call(&MetaRequest::Close {
            session: self.id,
            drained: true,
        })
        .map(|_| ())
    }
}
