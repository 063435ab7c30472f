//! The soft target's serving threads: each shard's poll loop, shard 0's door (accept,
//! and the handshake and bind stages' slots and deadlines), and the hand-over of a
//! bound connection to the next shard. What one connection does is in `conn.rs`.

use super::conn::{drive, stall_deadline, Conn, Drive};
use super::table::*;
use crate::auth::SharedKey;
use crate::net::slots::{Admit, Slots, StageLimits};
use crate::net::throttled_log;
use std::collections::HashMap;
use std::io;
use std::net::TcpListener;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub(super) const LISTENER: mio::Token = mio::Token(usize::MAX);
pub(super) const WAKER: mio::Token = mio::Token(usize::MAX - 1);

/// One serving thread (its own `Poll`), seen from the others.
pub(super) struct Shard {
    pub(super) waker: mio::Waker,
    /// Proven connections handed to it by the accepting shard.
    pub(super) inbox: Mutex<Vec<Conn>>,
    /// Owners closed since it last looked: their data connections go.
    pub(super) closed_owners: Mutex<Vec<u64>>,
    /// Bound connections it serves now.
    pub(super) serving: AtomicU64,
    /// Connections in their handshake now (shard 0 only).
    pub(super) pending: AtomicU64,
    /// Proven connections not bound yet (shard 0 only).
    pub(super) unbound: AtomicU64,
}

pub(super) struct Shared {
    pub(super) table: Table,
    pub(super) key: Option<SharedKey>,
    pub(super) io_timeout: Duration,
    pub(super) stop: AtomicBool,
    pub(super) shards: Vec<Shard>,
    pub(super) next_shard: AtomicU64,
}

impl Shared {
    /// One count of every shard (from shard `from` on), summed.
    pub(super) fn sum(&self, from: usize, count: impl Fn(&Shard) -> &AtomicU64) -> u64 {
        self.shards
            .iter()
            .skip(from)
            .map(|s| count(s).load(Ordering::SeqCst))
            .sum()
    }

    pub(super) fn unbound(&self) -> u64 {
        self.sum(0, |s| &s.unbound)
    }

    /// Bound connections served by the threads other than the door's.
    pub(super) fn serving_elsewhere(&self) -> usize {
        self.sum(1, |s| &s.serving) as usize
    }

    pub(super) fn serving(&self) -> u64 {
        self.sum(0, |s| &s.serving)
    }

    pub(super) fn pending(&self) -> u64 {
        self.sum(0, |s| &s.pending)
    }
}

/// Shard 0's door: the listener, and every connection not bound yet, by stage.
struct Door {
    listener: mio::net::TcpListener,
    slots: Slots<usize>,
}

/// The stages of [`Door::slots`].
const HANDSHAKE: usize = 0;
const UNBOUND: usize = 1;

impl Door {
    fn new(listener: mio::net::TcpListener) -> Door {
        Door {
            listener,
            slots: Slots::new(
                MAX_CONNECTIONS,
                &[
                    StageLimits {
                        cap: MAX_PENDING,
                        deadline_ms: HANDSHAKE_DEADLINE.as_millis() as u64,
                    },
                    StageLimits {
                        cap: MAX_UNBOUND,
                        deadline_ms: BIND_DEADLINE.as_millis() as u64,
                    },
                ],
            ),
        }
    }

    /// Accepts every connection waiting. Each takes a slot in its handshake, pushing
    /// out the oldest unbound connection when the stage or the whole port is full; a
    /// connection is refused only when every slot is bound.
    fn accept(
        &mut self,
        poll: &mio::Poll,
        conns: &mut HashMap<usize, Conn>,
        next: &mut usize,
        shared: &Shared,
    ) {
        loop {
            let (mut stream, peer) = match self.listener.accept() {
                Ok(x) => x,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    // EMFILE and friends: the next readiness retries.
                    log::warn!("soft NIC: accept failed: {e}");
                    return;
                }
            };
            let tok = free_token(conns, next);
            let bound = conns.len() - self.slots.len() + shared.serving_elsewhere();
            match self.slots.admit(tok, bound, shared.table.now_ms()) {
                Admit::Refused => {
                    shared.table.note(
                        log::Level::Warn,
                        "refused at accept (every slot bound)",
                        &peer.to_string(),
                        || {
                            format!(
                                "refusing a data connection from {peer}: {MAX_CONNECTIONS} \
                                 bound data connections open (the limit)"
                            )
                        },
                    );
                    continue;
                }
                Admit::In { push_out } => {
                    if let Some(c) = push_out.and_then(|t| conns.remove(&t)) {
                        let proven = c.proven();
                        shared.table.note(
                            log::Level::Info,
                            "pushed out by newer connections",
                            &c.peer,
                            || {
                                format!(
                                    "closing the {} connection from {} to make room for {peer}: \
                                     it was the oldest",
                                    if proven { "unbound" } else { "unproven" },
                                    c.peer
                                )
                            },
                        );
                    }
                }
            }
            let _ = stream.set_nodelay(true);
            let interest = mio::Interest::READABLE | mio::Interest::WRITABLE;
            if let Err(e) = poll
                .registry()
                .register(&mut stream, mio::Token(tok), interest)
            {
                log::warn!("soft NIC: cannot register a connection from {peer}: {e}");
                self.slots.remove(tok);
                continue;
            }
            conns.insert(tok, Conn::new(stream, peer.to_string(), shared.key.clone()));
        }
    }

    /// After connection `tok` was driven: one that proved the key now must bind (its
    /// stage pushes out its oldest member when full); one that bound leaves the door
    /// for a serving thread.
    fn moved_on(
        &mut self,
        me: usize,
        tok: usize,
        poll: &mio::Poll,
        conns: &mut HashMap<usize, Conn>,
        shared: &Shared,
    ) {
        let Some(stage) = self.slots.stage_of(tok) else {
            return; // bound already, served here
        };
        let Some(c) = conns.get(&tok).filter(|c| c.proven()) else {
            return;
        };
        if c.bound_to().is_some() {
            self.slots.remove(tok);
            hand_over(me, tok, poll, conns, shared);
        } else if stage == HANDSHAKE {
            let out = self.slots.advance(tok, UNBOUND, shared.table.now_ms());
            if let Some(c) = out.and_then(|t| conns.remove(&t)) {
                shared.table.note(
                    log::Level::Info,
                    "pushed out unbound by newer proven connections",
                    &c.peer,
                    || {
                        format!(
                            "closing the data connection from {}: it proved the key but did \
                             not bind, and is the oldest of {MAX_UNBOUND} such",
                            c.peer
                        )
                    },
                );
            }
        }
    }

    /// Connection `tok`, gone: forgets its slot and notes why when it was not bound.
    fn closed(&mut self, tok: usize, peer: &str, why: &str, shared: &Shared) {
        let Some(stage) = self.slots.stage_of(tok) else {
            log::debug!("soft NIC: connection from {peer} closed: {why}");
            return;
        };
        self.slots.remove(tok);
        let kind = if stage == HANDSHAKE {
            "closed in their handshake"
        } else {
            "closed before binding"
        };
        shared.table.note(log::Level::Info, kind, peer, || {
            format!("connection from {peer} {kind}: {why}")
        });
    }

    /// Closes the connections past their stage's deadline.
    fn expire(&mut self, conns: &mut HashMap<usize, Conn>, shared: &Shared) {
        for (tok, stage) in self.slots.expired(shared.table.now_ms()) {
            self.slots.remove(tok);
            let Some(c) = conns.remove(&tok) else {
                continue;
            };
            let (kind, within) = if stage == HANDSHAKE {
                ("no handshake in time", HANDSHAKE_DEADLINE)
            } else {
                ("not bound in time", BIND_DEADLINE)
            };
            shared.table.note(log::Level::Info, kind, &c.peer, || {
                format!(
                    "closing the data connection from {}: {kind} ({} ms)",
                    c.peer,
                    within.as_millis()
                )
            });
        }
    }
}

/// One serving thread. Shard 0 (`listener` given) also accepts, runs handshakes and
/// bindings, and hands each bound connection to the shards in turn.
pub(super) fn run_loop(
    me: usize,
    listener: Option<TcpListener>,
    mut poll: mio::Poll,
    shared: &Arc<Shared>,
) -> io::Result<()> {
    let mut door = match listener {
        Some(l) => {
            l.set_nonblocking(true)?;
            let mut l = mio::net::TcpListener::from_std(l);
            poll.registry()
                .register(&mut l, LISTENER, mio::Interest::READABLE)?;
            Some(Door::new(l))
        }
        None => None,
    };
    let shard = &shared.shards[me];
    let mut events = mio::Events::with_capacity(256);
    let mut conns: HashMap<usize, Conn> = HashMap::new();
    let mut next = 0usize;
    let mut scratch = vec![0u8; 64 << 10];
    loop {
        let now = Instant::now();
        let now_ms = shared.table.now_ms();
        let door_due = door.as_ref().and_then(|d| {
            d.slots
                .next_deadline()
                .into_iter()
                .chain(lock(&shared.table.log).next_deadline())
                .min()
                .map(|ms| Duration::from_millis(ms.saturating_sub(now_ms)))
        });
        let timeout = conns
            .values()
            .filter_map(|c| stall_deadline(c, shared.io_timeout))
            .map(|d| d.saturating_duration_since(now))
            .chain(door_due)
            .min();
        if let Err(e) = poll.poll(&mut events, timeout) {
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if shared.stop.load(Ordering::SeqCst) {
            return Ok(());
        }
        for ev in events.iter() {
            match ev.token() {
                LISTENER => {
                    if let Some(d) = &mut door {
                        d.accept(&poll, &mut conns, &mut next, shared);
                    }
                }
                WAKER => {
                    let closed = std::mem::take(&mut *lock(&shard.closed_owners));
                    conns.retain(|_, c| !c.bound_to().is_some_and(|o| closed.contains(&o)));
                    let handed = std::mem::take(&mut *lock(&shard.inbox));
                    for mut c in handed {
                        let tok = free_token(&conns, &mut next);
                        let interest = mio::Interest::READABLE | mio::Interest::WRITABLE;
                        if let Err(e) =
                            poll.registry()
                                .register(&mut c.stream, mio::Token(tok), interest)
                        {
                            log::warn!("soft NIC: cannot take a connection from {}: {e}", c.peer);
                            continue;
                        }
                        // Bytes may have come before it was registered here.
                        if let Drive::Open = drive(&mut c, &shared.table, &mut scratch) {
                            conns.insert(tok, c);
                        }
                    }
                }
                tok => {
                    let Some(c) = conns.get_mut(&tok.0) else {
                        continue;
                    };
                    if let Drive::Close(why) = drive(c, &shared.table, &mut scratch) {
                        let peer = std::mem::take(&mut c.peer);
                        conns.remove(&tok.0);
                        match &mut door {
                            Some(d) => d.closed(tok.0, &peer, &why, shared),
                            None => log::debug!("soft NIC: connection from {peer} closed: {why}"),
                        }
                        continue;
                    }
                    if let Some(d) = &mut door {
                        d.moved_on(me, tok.0, &poll, &mut conns, shared);
                    }
                }
            }
        }
        let now = Instant::now();
        let stalled: Vec<usize> = conns
            .iter()
            .filter(|(_, c)| stall_deadline(c, shared.io_timeout).is_some_and(|d| d <= now))
            .map(|(t, _)| *t)
            .collect();
        for tok in stalled {
            if let Some(c) = conns.remove(&tok) {
                log::info!(
                    "soft NIC: closing connection from {}: stalled mid-operation",
                    c.peer
                );
                if let Some(d) = &mut door {
                    d.slots.remove(tok);
                }
            }
        }
        match &mut door {
            Some(d) => {
                d.expire(&mut conns, shared);
                throttled_log::emit(
                    module_path!(),
                    lock(&shared.table.log).due(shared.table.now_ms()),
                );
                shard
                    .pending
                    .store(d.slots.count(HANDSHAKE) as u64, Ordering::SeqCst);
                shard
                    .unbound
                    .store(d.slots.count(UNBOUND) as u64, Ordering::SeqCst);
                shard
                    .serving
                    .store((conns.len() - d.slots.len()) as u64, Ordering::SeqCst);
            }
            None => shard.serving.store(conns.len() as u64, Ordering::SeqCst),
        }
    }
}

/// A token no connection of this shard uses.
fn free_token(conns: &HashMap<usize, Conn>, next: &mut usize) -> usize {
    loop {
        let t = *next;
        *next = (*next + 1) % WAKER.0;
        if !conns.contains_key(&t) {
            return t;
        }
    }
}

/// Gives a connection that just bound itself to the next shard in turn (keeps it
/// when that is this one).
fn hand_over(
    me: usize,
    tok: usize,
    poll: &mio::Poll,
    conns: &mut HashMap<usize, Conn>,
    shared: &Shared,
) {
    let n = shared.shards.len() as u64;
    let to = (shared.next_shard.fetch_add(1, Ordering::Relaxed) % n) as usize;
    if to == me {
        return;
    }
    let Some(mut c) = conns.remove(&tok) else {
        return;
    };
    let _ = poll.registry().deregister(&mut c.stream);
    let shard = &shared.shards[to];
    lock(&shard.inbox).push(c);
    shard.serving.fetch_add(1, Ordering::SeqCst);
    let _ = shard.waker.wake();
}
