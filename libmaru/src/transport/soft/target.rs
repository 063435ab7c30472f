//! The soft NIC's responder on the memory node: serves READ/WRITE against its
//! registration table and checks the remote key on every operation, as a NIC does.
//! This file holds the target and its registration table (keys, owners, gates); the
//! connections are served in `target/serve.rs` (the threads) and `target/conn.rs` (one
//! connection).
//!
//! A few threads (mio, one per core, at most [`MAX_SHARDS`]) serve every data
//! connection: the first accepts, runs every handshake and every connection's BIND,
//! and hands each bound connection to the threads in turn. A peer costs a small
//! buffer and a descriptor, never a thread of its own.
//!
//! Slots go as on the daemons' control ports ([`Slots`]): a connection is first in
//! its handshake (at most [`MAX_PENDING`] at once, [`PRE_AUTH_MAX_FRAME`] frames, the
//! whole handshake within [`HANDSHAKE_DEADLINE`]), then proven but unbound (at most
//! [`MAX_UNBOUND`], bound within [`BIND_DEADLINE`] of its proof), then bound to one
//! owner (at most [`MAX_PER_OWNER`] per owner). A newcomer to a full stage pushes out
//! that stage's oldest member, so neither a keyless flood nor a key holder that never
//! binds keeps a worker out; of [`MAX_CONNECTIONS`] slots, a new connection is
//! refused only when every one is bound. Closes before binding are logged as one
//! summary line per interval
//! ([`ThrottledLog`](crate::net::throttled_log::ThrottledLog)). Bytes go straight
//! between the socket and the registered memory: a WRITE's payload is read into the region,
//! a READ's is written from it, with no staging copy. A connection reads its next
//! request only once the previous one's reply left, so a peer that does not read
//! holds at most one reply.
//!
//! Keys are bound like a NIC's protection domains: every registration belongs to one
//! owner (the agent connection it was made for), and a data connection serves only
//! the keys of the owner it bound itself to (`OP_BIND` with the owner's binding
//! secret, which only the owner's map replies carry). Another owner's key fails with
//! a bad-key completion and nothing is read or written. When an owner goes
//! ([`SoftTarget::owner_closed`]) its data connections are closed.
//!
//! Each registration has a gate: an operation holds a use of it while it touches the
//! range, and deregistration closes the gate and waits for the uses to end, so when
//! `deregister` returns no operation is touching the range and every later one fails
//! with a bad key. A connection that stalls mid-operation is closed after
//! `io_timeout`, which bounds how long a deregistration can wait.

mod conn;
mod serve;
pub(super) mod table;

use serve::{run_loop, Shard, Shared, WAKER};
use table::*;

use super::proto::{CPL_LEN, REQ_LEN};
use crate::auth::SharedKey;

use crate::transport::{Registration, Target, TransportError};
use std::collections::HashMap;
use std::io;
use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLockWriteGuard};
use std::time::Duration;

/// The soft NIC responder of one agent.
pub struct SoftTarget {
    shared: Arc<Shared>,
    addr: SocketAddr,
    advertise: String,
    threads: Mutex<Vec<std::thread::JoinHandle<()>>>,
}

/// Counters of a responder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TargetStats {
    pub registrations: usize,
    pub ops: u64,
    /// Data connections that proved the key, bound or not yet.
    pub connections: usize,
    /// Of those, the ones not bound to an owner yet.
    pub unbound: u64,
    /// Connections in their handshake now.
    pub pending: u64,
    /// Operations refused for a bad key, range or access.
    pub rejected: u64,
}

impl SoftTarget {
    /// Listens on `bind` (port 0 picks one). `advertise` is the host workers connect
    /// to (the bound IP when empty). With a key, each data connection proves it.
    pub fn start(
        bind: SocketAddr,
        advertise: &str,
        key: Option<SharedKey>,
        io_timeout: Duration,
    ) -> io::Result<SoftTarget> {
        let listener = TcpListener::bind(bind)?;
        let addr = listener.local_addr()?;
        let host = if advertise.is_empty() {
            addr.ip().to_string()
        } else {
            advertise.to_string()
        };
        let advertise = if host.contains(':') {
            format!("[{host}]:{}", addr.port())
        } else {
            format!("{host}:{}", addr.port())
        };
        let n = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .clamp(1, MAX_SHARDS);
        let mut polls = Vec::with_capacity(n);
        let mut shards = Vec::with_capacity(n);
        for _ in 0..n {
            let poll = mio::Poll::new()?;
            shards.push(Shard {
                waker: mio::Waker::new(poll.registry(), WAKER)?,
                inbox: Mutex::new(Vec::new()),
                closed_owners: Mutex::new(Vec::new()),
                serving: AtomicU64::new(0),
                pending: AtomicU64::new(0),
                unbound: AtomicU64::new(0),
            });
            polls.push(poll);
        }
        let shared = Arc::new(Shared {
            table: Table::new(),
            key,
            io_timeout,
            stop: AtomicBool::new(false),
            shards,
            next_shard: AtomicU64::new(0),
        });
        let mut listener = Some(listener);
        let mut threads = Vec::with_capacity(n);
        for (i, poll) in polls.into_iter().enumerate() {
            let (s, l) = (shared.clone(), listener.take());
            threads.push(
                std::thread::Builder::new()
                    .name(format!("soft-nic{i}"))
                    .spawn(move || {
                        if let Err(e) = run_loop(i, l, poll, &s) {
                            log::error!("soft NIC: event loop {i} stopped: {e}");
                        }
                    })?,
            );
        }
        Ok(SoftTarget {
            shared,
            addr,
            advertise,
            threads: Mutex::new(threads),
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The `transport` metadata a worker of `owner` uses to connect: the address and
    /// the owner's binding secret.
    fn meta(&self, secret: u128) -> serde_json::Value {
        serde_json::json!({ "soft": { "addr": self.advertise, "bind": format!("{secret:032x}") } })
    }

    pub fn stats(&self) -> TargetStats {
        TargetStats {
            registrations: self.shared.table.regs.read().map(|r| r.len()).unwrap_or(0),
            ops: self.shared.table.ops.load(Ordering::Relaxed),
            connections: (self.shared.serving() + self.shared.unbound()) as usize,
            unbound: self.shared.unbound(),
            pending: self.shared.pending(),
            rejected: self.shared.table.rejected.load(Ordering::Relaxed),
        }
    }

    /// Stops serving and closes every data connection.
    pub fn shutdown(&self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        for s in &self.shared.shards {
            let _ = s.waker.wake();
        }
        for t in std::mem::take(&mut *lock(&self.threads)) {
            let _ = t.join();
        }
    }

    /// The registration table, to change it.
    fn regs_mut(&self) -> Result<RwLockWriteGuard<'_, HashMap<u64, Arc<Reg>>>, TransportError> {
        self.shared
            .table
            .regs
            .write()
            .map_err(|_| TransportError::Setup("registration table poisoned".into()))
    }
}

impl Drop for SoftTarget {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn random_u64() -> Result<u64, TransportError> {
    let b = crate::auth::random_bytes(8)
        .map_err(|e| TransportError::Setup(format!("cannot draw a key: {e}")))?;
    let mut x = [0u8; 8];
    x.copy_from_slice(&b);
    Ok(u64::from_le_bytes(x))
}

impl Target for SoftTarget {
    unsafe fn register(
        &self,
        owner: u64,
        ptr: *mut u8,
        len: u64,
        writable: bool,
    ) -> Result<Registration, TransportError> {
        let secret = {
            let mut o = lock(&self.shared.table.owners);
            match o.secret_of.get(&owner) {
                Some(s) => *s,
                None => {
                    let mut s = (u128::from(random_u64()?) << 64) | u128::from(random_u64()?);
                    while s == 0 || o.owner_of.contains_key(&s) {
                        s = (u128::from(random_u64()?) << 64) | u128::from(random_u64()?);
                    }
                    o.secret_of.insert(owner, s);
                    o.owner_of.insert(s, owner);
                    s
                }
            }
        };
        let mut regs = self.regs_mut()?;
        let mut rkey = random_u64()? | 1;
        while regs.contains_key(&rkey) {
            rkey = random_u64()? | 1;
        }
        let base = ptr as u64;
        regs.insert(
            rkey,
            Arc::new(Reg {
                base,
                len,
                writable,
                owner,
                gate: Mutex::new(Gate {
                    alive: true,
                    users: 0,
                }),
                idle: Condvar::new(),
            }),
        );
        Ok(Registration {
            rkey,
            addr: base,
            transport: self.meta(secret),
        })
    }

    fn deregister(&self, rkey: u64) -> Result<(), TransportError> {
        let reg = {
            let mut regs = self.regs_mut()?;
            regs.remove(&rkey).ok_or(TransportError::BadKey { rkey })?
        };
        // Wait for operations in flight on this key; later ones find it dead.
        let mut g = lock(&reg.gate);
        g.alive = false;
        while g.users > 0 {
            g = reg.idle.wait(g).unwrap_or_else(|p| p.into_inner());
        }
        Ok(())
    }

    /// The owner's binding secret goes (no new data connection binds to it) and its
    /// data connections are closed. Its registrations stay until deregistered.
    fn owner_closed(&self, owner: u64) {
        {
            let mut o = lock(&self.shared.table.owners);
            if let Some(s) = o.secret_of.remove(&owner) {
                o.owner_of.remove(&s);
            }
        }
        for s in &self.shared.shards {
            lock(&s.closed_owners).push(owner);
            let _ = s.waker.wake();
        }
    }
}

#[allow(dead_code)]
const _: () = assert!(CPL_LEN == 24 && REQ_LEN == 40);
