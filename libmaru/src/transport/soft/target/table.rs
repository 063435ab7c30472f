//! The soft target's registration table and what its serving threads share: the
//! registrations with their gates, the owners and their bindings, the limits.

use super::super::proto;
use crate::net::server::{DEFAULT_HANDSHAKE_TIMEOUT_MS, DEFAULT_PRE_AUTH_MAX_FRAME};
use crate::net::throttled_log::{self, ThrottledLog};
use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

/// What every serving thread and every connection checks and counts in: the
/// registrations by key, their owners, the operations served and refused, and the
/// log of connections closed or refused before binding, with the clock it runs on.
pub(super) struct Table {
    pub(super) regs: RwLock<HashMap<u64, Arc<Reg>>>,
    pub(super) owners: Arc<Mutex<Owners>>,
    /// Closes before binding and refused bindings, a line per interval (shard 0
    /// writes the summaries).
    pub(super) log: Mutex<ThrottledLog>,
    /// The responder's clock: milliseconds since it started.
    pub(super) started: Instant,
    pub(super) ops: AtomicU64,
    pub(super) rejected: AtomicU64,
}

impl Table {
    pub(super) fn new() -> Table {
        Table {
            regs: RwLock::new(HashMap::new()),
            owners: Arc::new(Mutex::new(Owners::default())),
            log: Mutex::new(ThrottledLog::new(
                "soft NIC: data connections closed or refused before binding",
                throttled_log::DEFAULT_INTERVAL_MS,
            )),
            started: Instant::now(),
            ops: AtomicU64::new(0),
            rejected: AtomicU64::new(0),
        }
    }

    pub(super) fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    /// Notes a connection closed or refused before binding (see [`ThrottledLog`]).
    pub(super) fn note(
        &self,
        level: log::Level,
        kind: &'static str,
        peer: &str,
        line: impl FnOnce() -> String,
    ) {
        let now = self.now_ms();
        throttled_log::emit(
            module_path!(),
            lock(&self.log).note(now, level, kind, peer, line),
        );
    }
}

/// Whether a registration is alive and how many operations use it now.
pub(super) struct Gate {
    pub(super) alive: bool,
    pub(super) users: usize,
}

pub(super) struct Reg {
    pub(super) base: u64,
    pub(super) len: u64,
    pub(super) writable: bool,
    /// The owner (agent connection) it was registered for.
    pub(super) owner: u64,
    pub(super) gate: Mutex<Gate>,
    pub(super) idle: Condvar,
}

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// An operation's use of a live registration; the registration's deregistration
/// waits until every use is dropped.
pub(super) struct RegUse(pub(super) Arc<Reg>);

impl RegUse {
    pub(super) fn take(reg: Arc<Reg>) -> Option<RegUse> {
        let mut g = lock(&reg.gate);
        if !g.alive {
            return None;
        }
        g.users += 1;
        drop(g);
        Some(RegUse(reg))
    }
}

impl Drop for RegUse {
    fn drop(&mut self) {
        let mut g = lock(&self.0.gate);
        g.users -= 1;
        if g.users == 0 {
            self.0.idle.notify_all();
        }
    }
}

/// The owners that registered something: their binding secrets, both ways, and how
/// many data connections each has bound.
#[derive(Default)]
pub(super) struct Owners {
    pub(super) secret_of: HashMap<u64, u128>,
    pub(super) owner_of: HashMap<u128, u64>,
    pub(super) bound: HashMap<u64, usize>,
}

/// A data connection's binding to its owner: counted in [`Owners::bound`] while it
/// lives, whichever thread drops it.
pub(super) struct Binding {
    pub(super) owner: u64,
    pub(super) owners: Arc<Mutex<Owners>>,
}

impl Binding {
    /// Binds to the owner of `secret`: `Err(status)` when the secret is unknown or the
    /// owner has [`MAX_PER_OWNER`] data connections already.
    pub(super) fn take(owners: &Arc<Mutex<Owners>>, secret: u128) -> Result<Binding, u32> {
        let mut o = lock(owners);
        let owner = *o.owner_of.get(&secret).ok_or(proto::ST_BAD_KEY)?;
        let n = o.bound.entry(owner).or_default();
        if *n >= MAX_PER_OWNER {
            return Err(proto::ST_LIMIT);
        }
        *n += 1;
        Ok(Binding {
            owner,
            owners: owners.clone(),
        })
    }
}

impl Drop for Binding {
    fn drop(&mut self) {
        let mut o = lock(&self.owners);
        if let Some(n) = o.bound.get_mut(&self.owner) {
            *n -= 1;
            if *n == 0 {
                o.bound.remove(&self.owner);
            }
        }
    }
}

/// Serving threads: one per core, at most this many. The first also accepts and runs
/// every handshake; proven connections are spread over all of them.
pub const MAX_SHARDS: usize = 4;

/// Most data connections open at once, in every stage. They share [`MAX_SHARDS`]
/// threads at most; this bounds descriptors and memory. When all are open, a new
/// connection pushes out the oldest one not bound yet, and is refused only when every
/// one is bound.
pub const MAX_CONNECTIONS: usize = 1024;
/// Most connections in their handshake at once, so peers without the key cannot
/// take the room of workers that proved it: a new one beyond it pushes out the oldest.
pub const MAX_PENDING: usize = 64;
/// Most proven connections not bound yet: one more pushes out the oldest of them, so
/// a key holder that never binds cannot take the room of workers that do.
pub const MAX_UNBOUND: usize = 64;
/// Most data connections bound to one owner (a worker opens 1 to 8 lanes per agent
/// connection); a BIND beyond it completes with [`proto::ST_LIMIT`].
pub const MAX_PER_OWNER: usize = 64;
/// The whole handshake (hello and key proof) must finish within this (the daemons'
/// control ports' default).
pub const HANDSHAKE_DEADLINE: Duration = Duration::from_millis(DEFAULT_HANDSHAKE_TIMEOUT_MS);
/// A proven connection must bind within this of its proof (a worker sends BIND right
/// after its handshake).
pub const BIND_DEADLINE: Duration = Duration::from_secs(5);
/// Largest frame before the key proof (a hello or a proof is a few hundred bytes; the
/// daemons' control ports' default).
pub const PRE_AUTH_MAX_FRAME: usize = DEFAULT_PRE_AUTH_MAX_FRAME;
