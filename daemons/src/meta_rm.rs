//! The RM as maru-server uses it ([`MetaRm`]): allocations on a thread of their own,
//! the keeper's and the periodic calls off the loop, the keep-alive connection.

use crate::meta_agents::AGENT_WAIT;
use crate::peer_calls::{port_error, unexpected, PeerCalls};
use maru::meta::{PoolSizes, PortError, RmPort};
use maru::net::{ClientOptions, Link, Replier};
use maru::wire::rm::{AllocReply, Handle, RmReply, RmRequest};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

/// A call to the RM made off the event loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum RmKey {
    Free(u64),
    Pools,
}

/// The RM as maru-server uses it. Every call runs on a thread of its own: the core's
/// allocations ([`Action::Alloc`]) on `rm-alloc` and its checks of which regions the
/// RM holds for this server ([`Action::CheckRm`]) on `rm-check`, whose answers wake
/// the loop and go to the core as events ([`MetaCore::alloc_done`],
/// [`MetaCore::rm_regions`]); the keeper's calls (frees, the pools' sizes) on
/// `rm-link`, each waiting on the loop at most [`AGENT_WAIT`]. So a stopped RM never
/// stalls the loop, and sessions that do not need it stay fast.
pub struct MetaRm {
    /// The start-up check's connection.
    link: Link,
    /// This server's client id at the RM (the owner of its regions).
    client_id: String,
    opts: ClientOptions,
    bg: PeerCalls<RmKey, RmRequest, Result<RmReply, PortError>>,
    allocator: Option<OffLoop<AllocReply>>,
    checker: Option<OffLoop<Vec<u64>>>,
    sizes: Option<PoolSizes>,
    /// When `sizes` came.
    sizes_at: Option<std::time::Instant>,
    wait: Duration,
    addr: String,
}

/// Calls to the RM of one kind, one at a time, on a thread of their own (`rm-alloc`
/// for allocations, `rm-check` for the list of the server's regions): each answer
/// wakes the loop, which hands it to the core as an event.
struct OffLoop<A> {
    jobs: mpsc::Sender<(u64, RmRequest)>,
    done: mpsc::Receiver<(u64, Result<A, PortError>)>,
    /// An answer is waiting in `done` (set before the loop is woken).
    ready: Arc<AtomicBool>,
}

impl<A: Send + 'static> OffLoop<A> {
    /// Starts thread `name`, which makes each call on `link` and reads its answer
    /// with `answer`.
    fn start(
        name: &str,
        mut link: Link,
        waker: Replier,
        answer: fn(RmReply) -> Result<A, PortError>,
    ) -> OffLoop<A> {
        let (jobs, rx) = mpsc::channel::<(u64, RmRequest)>();
        let (tx, done) = mpsc::channel();
        let ready = Arc::new(AtomicBool::new(false));
        let flag = ready.clone();
        let spawned = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                while let Ok((id, req)) = rx.recv() {
                    let reply = link.call::<_, RmReply>(&req).map_err(port_error);
                    if tx.send((id, reply.and_then(answer))).is_err() {
                        return;
                    }
                    flag.store(true, Ordering::SeqCst);
                    waker.wake();
                }
            });
        if let Err(e) = spawned {
            log::error!("cannot start thread {name}: {e}");
        }
        OffLoop { jobs, done, ready }
    }

    /// Hands call `id` to the `what` thread of `off` (the RM at `addr`); an error when
    /// that thread was never started or is gone.
    fn send_on(
        off: &Option<OffLoop<A>>,
        id: u64,
        req: RmRequest,
        what: &str,
        addr: &str,
    ) -> Result<(), PortError> {
        match off {
            Some(o) if o.jobs.send((id, req)).is_ok() => Ok(()),
            _ => Err(PortError::Unreachable(format!(
                "the {what} thread for the RM at {addr} is gone"
            ))),
        }
    }

    fn answered(&self) -> bool {
        self.ready.load(Ordering::SeqCst)
    }

    fn take(&self) -> Vec<(u64, Result<A, PortError>)> {
        self.ready.store(false, Ordering::SeqCst);
        self.done.try_iter().collect()
    }
}

fn alloc_answer(r: RmReply) -> Result<AllocReply, PortError> {
    match r {
        RmReply::Alloc(a) => Ok(a),
        r => Err(unexpected(r)),
    }
}

fn regions_answer(r: RmReply) -> Result<Vec<u64>, PortError> {
    match r {
        RmReply::Regions { regions } => Ok(regions.into_iter().map(|r| r.region_id).collect()),
        r => Err(unexpected(r)),
    }
}

impl MetaRm {
    pub fn new(addr: &str, client_id: String, key: Option<maru::auth::SharedKey>) -> MetaRm {
        let mut opts = ClientOptions::new(maru::wire::rm::SERVICE, client_id.clone());
        opts.key = key;
        opts.connect_timeout = Duration::from_secs(2);
        opts.call_timeout = Duration::from_secs(5);
        // The RM's list of this server's regions (about 230 bytes each, with their
        // tokens) passes the default 1 MiB frame at about 4,500 regions: the restart
        // of a server holding more was refused, and its check of which regions the RM
        // still holds failed quietly (issue 46, make bench-scale at 4 M keys).
        opts.max_frame = RM_MAX_FRAME;
        let mut bg_link = Link::new(addr, opts.clone());
        let bg = PeerCalls::start("rm-link".into(), move |req: RmRequest| {
            bg_link.call::<_, RmReply>(&req).map_err(port_error)
        });
        MetaRm {
            link: Link::new(addr, opts.clone()),
            client_id,
            opts,
            bg,
            allocator: None,
            checker: None,
            sizes: None,
            sizes_at: None,
            wait: AGENT_WAIT,
            addr: addr.to_string(),
        }
    }

    /// Starts the allocation and check threads; their answers wake the loop through
    /// `waker`.
    pub(crate) fn start_allocator(&mut self, waker: Replier) {
        let link = Link::new(self.addr.clone(), self.opts.clone());
        self.allocator = Some(OffLoop::start(
            "rm-alloc",
            link,
            waker.clone(),
            alloc_answer,
        ));
        let link = Link::new(self.addr.clone(), self.opts.clone());
        self.checker = Some(OffLoop::start("rm-check", link, waker, regions_answer));
    }

    /// Sends the core's allocation to the RM (answered through [`take_allocs`]).
    pub(crate) fn start_alloc(&mut self, alloc: u64, size: u64) -> Result<(), PortError> {
        let req = RmRequest::Alloc {
            size,
            pool: None,
            request_id: 0,
        };
        OffLoop::send_on(&self.allocator, alloc, req, "allocation", &self.addr)
    }

    /// Asks the RM for the regions it holds for this server (answered through
    /// [`take_checks`]).
    pub(crate) fn start_check(&mut self, check: u64) -> Result<(), PortError> {
        let req = RmRequest::Regions {
            owner: Some(self.client_id.clone()),
        };
        OffLoop::send_on(&self.checker, check, req, "check", &self.addr)
    }

    /// Whether an allocation's or a check's answer waits to be taken.
    pub(crate) fn alloc_answered(&self) -> bool {
        self.allocator.as_ref().is_some_and(OffLoop::answered)
            || self.checker.as_ref().is_some_and(OffLoop::answered)
    }

    /// The answers of allocations that came back.
    pub(crate) fn take_allocs(&mut self) -> Vec<(u64, Result<AllocReply, PortError>)> {
        self.allocator
            .as_ref()
            .map(OffLoop::take)
            .unwrap_or_default()
    }

    /// The answers of checks that came back: the ids of the server's regions.
    pub(crate) fn take_checks(&mut self) -> Vec<(u64, Result<Vec<u64>, PortError>)> {
        self.checker.as_ref().map(OffLoop::take).unwrap_or_default()
    }

    /// Lets the off-loop calls wait up to `wait` (at shutdown).
    pub fn set_wait(&mut self, wait: Duration) {
        self.wait = wait;
    }

    fn bg_call(&mut self, key: RmKey, req: RmRequest) -> Result<RmReply, PortError> {
        let peer = format!("the RM at {}", self.addr);
        self.bg
            .call(&peer, key, req, self.wait)
            .unwrap_or_else(|m| Err(PortError::Unreachable(m)))
    }

    /// The regions the RM holds for this server, with their handles' tokens, asked
    /// on the start-up connection (a restart, before serving).
    pub fn owned_region_infos(&mut self) -> Result<Vec<maru::wire::rm::RegionInfo>, String> {
        let req = RmRequest::Regions {
            owner: Some(self.client_id.clone()),
        };
        match self.link.call::<_, RmReply>(&req) {
            Ok(RmReply::Regions { regions }) => Ok(regions),
            Ok(r) => Err(format!("unexpected reply {r:?}")),
            Err(e) => Err(e.to_string()),
        }
    }

    /// Connects now (maru-server refuses to start without its RM).
    pub fn check(&mut self) -> Result<(), String> {
        self.link.client().map(|_| ()).map_err(|e| e.to_string())
    }

    /// Keeps one connection to the RM open, from a thread of its own, with a cheap
    /// call every `every` (or a third of the idle timeout the RM announces): the RM closes connections idle past its idle timeout, and
    /// an owner with no connection left loses its regions after the RM's grace period.
    /// A quiet server (no new region for minutes) must not look gone.
    pub fn keep_alive(
        addr: &str,
        client_id: String,
        key: Option<maru::auth::SharedKey>,
        every: Duration,
    ) {
        let mut opts = ClientOptions::new(maru::wire::rm::SERVICE, client_id);
        opts.key = key;
        opts.connect_timeout = Duration::from_secs(2);
        opts.call_timeout = Duration::from_secs(5);
        let mut link = Link::new(addr, opts);
        let spawned = std::thread::Builder::new()
            .name("rm-keepalive".into())
            .spawn(move || loop {
                if let Err(e) = link.call::<_, RmReply>(&RmRequest::Pools) {
                    log::debug!("RM keep-alive: {e}");
                }
                // Well within the idle timeout the RM announces, if it is shorter.
                let idle = link
                    .client()
                    .ok()
                    .and_then(|c| c.welcome().info.get("idle_timeout_ms")?.as_u64())
                    .filter(|ms| *ms > 0)
                    .map_or(every, |ms| every.min(Duration::from_millis(ms / 3)));
                std::thread::sleep(idle);
            });
        if let Err(e) = spawned {
            log::warn!("cannot start the RM keep-alive thread: {e}");
        }
    }
}

/// The largest frame maru-server reads from its RM (an authenticated peer): room
/// for the list of about 290,000 regions.
pub const RM_MAX_FRAME: usize = 64 << 20;

/// How long the RM's pool sizes, once heard, are taken as they are (they change only
/// when the RM's pools do; a region request asks for them each time).
const POOLS_FRESH: Duration = Duration::from_secs(10);

/// How often maru-server's keep-alive connection calls the RM.
pub const RM_KEEPALIVE: Duration = Duration::from_secs(15);

impl RmPort for MetaRm {
    fn free(&mut self, h: &Handle) -> Result<(), PortError> {
        let req = RmRequest::Free {
            handle: h.clone(),
            request_id: 0,
        };
        match self.bg_call(RmKey::Free(h.region_id), req)? {
            RmReply::Free(_) => Ok(()),
            r => Err(unexpected(r)),
        }
    }

    fn pool_sizes(&mut self) -> Result<PoolSizes, PortError> {
        // Asked before every region request: an answer of the last POOLS_FRESH
        // serves, so the loop waits for the RM at most once in that time (issue 46).
        if let Some((v, at)) = self.sizes.zip(self.sizes_at) {
            if at.elapsed() < POOLS_FRESH {
                return Ok(v);
            }
        }
        match self.bg_call(RmKey::Pools, RmRequest::Pools) {
            Ok(RmReply::Pools { pools }) => {
                let v = PoolSizes {
                    largest: pools.iter().map(|p| p.total).max().unwrap_or(0),
                    total: pools.iter().map(|p| p.total).sum(),
                };
                self.sizes = Some(v);
                self.sizes_at = Some(std::time::Instant::now());
                Ok(v)
            }
            Ok(r) => Err(unexpected(r)),
            // The last answer stands while the RM is slow (pools seldom change).
            Err(e) => self.sizes.ok_or(e),
        }
    }
}
