//! The settings of the daemons' event loop ([`ServerOptions`]): every bound a peer
//! could otherwise push without limit, and their defaults.

use crate::auth::Keyring;
use crate::wire;

/// Settings of the loop: every bound a peer could otherwise push without limit.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// Largest frame body accepted on a connection after its handshake.
    pub max_frame: usize,
    /// Largest frame body accepted before the handshake finished (a hello or a proof
    /// is a few hundred bytes): a peer without the key cannot make the daemon buffer more.
    pub pre_auth_max_frame: usize,
    /// Connections open at once. When they are all open, a new connection pushes out
    /// the oldest one still in its handshake; only when every one has finished its
    /// handshake is a new connection closed at accept.
    pub max_connections: usize,
    /// Connections still in their handshake at once. Kept below `max_connections` so
    /// peers without the key cannot take the room of authenticated clients: a new one
    /// beyond it pushes out the oldest connection still in its handshake.
    pub max_pending: usize,
    /// Keys a client may prove (the server proves the one the client names back;
    /// one key for most daemons, one per tenant for maru-server). None: no proof.
    pub keys: Option<Keyring>,
    /// A connection that has not finished its whole handshake after this long is closed.
    pub handshake_timeout_ms: u64,
    /// A connection that sent no whole frame for this long after its handshake is
    /// closed (0: never). Clients' heartbeats and calls refresh it.
    pub idle_timeout_ms: u64,
    /// Bytes of replies a connection may leave unread; beyond it the loop stops
    /// reading its requests until it reads its replies (backpressure).
    pub max_unsent: usize,
    /// Bytes of frames larger than [`SMALL_FRAME`] the loop holds while they arrive,
    /// every connection together: such a frame is read only once its whole size fits
    /// here, else its connection is not read until room comes back. Raised to at
    /// least `frame_room_per_tenant`.
    pub frame_room: usize,
    /// The most of `frame_room` the connections of one tenant (the key they proved;
    /// every client of a daemon without tenants is one) hold at once. Raised to at
    /// least one largest frame.
    pub frame_room_per_tenant: usize,
    /// While a frame waits for room, a connection granted room whose peer sent nothing
    /// of its frame for this long is closed, giving the room back.
    pub frame_stall_ms: u64,
    /// After a turn with events, the loop polls without sleeping for this long before
    /// it blocks in `epoll_wait` again (zero: never): a client's next request finds it
    /// awake. An idle loop spins at most this long after its last event.
    pub poll_spin: std::time::Duration,
}

/// Default whole-handshake deadline (5 s).
pub const DEFAULT_HANDSHAKE_TIMEOUT_MS: u64 = 5_000;
/// Default largest frame before the key proof (4 KiB).
pub const DEFAULT_PRE_AUTH_MAX_FRAME: usize = 4 << 10;
/// Default idle timeout after the handshake (5 minutes).
pub const DEFAULT_IDLE_TIMEOUT_MS: u64 = 300_000;
/// Default bound on a connection's unsent replies (4 MiB).
pub const DEFAULT_MAX_UNSENT: usize = 4 << 20;
/// Bytes of frames any connection may hold without asking for room (16 KiB): most
/// requests, and the start of a larger frame (its length prefix).
pub const SMALL_FRAME: usize = 16 << 10;
/// Default room for larger frames while they arrive, every connection together (32 MiB).
pub const DEFAULT_FRAME_ROOM: usize = 32 << 20;
/// Default share of that room one tenant may hold (16 MiB).
pub const DEFAULT_FRAME_ROOM_PER_TENANT: usize = 16 << 20;
/// Default time a peer granted room may send nothing while others wait (10 s).
pub const DEFAULT_FRAME_STALL_MS: u64 = 10_000;
/// Default busy poll after a turn with events, µs (see [`ServerOptions::poll_spin`]).
pub const DEFAULT_POLL_SPIN_US: u64 = 0;

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            max_frame: wire::DEFAULT_MAX_FRAME,
            pre_auth_max_frame: DEFAULT_PRE_AUTH_MAX_FRAME,
            max_connections: 1024,
            max_pending: 256,
            keys: None,
            handshake_timeout_ms: DEFAULT_HANDSHAKE_TIMEOUT_MS,
            idle_timeout_ms: DEFAULT_IDLE_TIMEOUT_MS,
            max_unsent: DEFAULT_MAX_UNSENT,
            frame_room: DEFAULT_FRAME_ROOM,
            frame_room_per_tenant: DEFAULT_FRAME_ROOM_PER_TENANT,
            frame_stall_ms: DEFAULT_FRAME_STALL_MS,
            poll_spin: std::time::Duration::from_micros(DEFAULT_POLL_SPIN_US),
        }
    }
}

impl ServerOptions {
    /// Pending connections allowed: `max_pending`, but always below the total cap
    /// (a quarter of it is kept for authenticated clients) and at least one.
    pub(super) fn pending_cap(&self) -> usize {
        let room = self.max_connections - self.max_connections / 4;
        self.max_pending.min(room).max(1)
    }
}
