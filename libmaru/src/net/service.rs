//! What a daemon plugs into the event loop ([`super::Server`]): the [`Service`] it
//! implements, what it hears of a new connection ([`Opened`]) and the [`Replier`]
//! through which replies computed off the loop come back.

/// Identifies one connection for the life of the server (never reused).
pub type ConnId = u64;

/// A connection that finished its handshake, as [`Service::on_open`] hears of it.
#[derive(Debug, Clone, Copy)]
pub struct Opened<'a> {
    pub conn: ConnId,
    /// The client id its hello named.
    pub client_id: &'a str,
    /// The name the daemon's keyring gives the key it proved (None when the daemon
    /// has no key).
    pub key_name: Option<&'a str>,
    /// The session secret its hello carried (a reconnecting client), if any.
    pub resume: Option<&'a str>,
    pub now_ms: u64,
}

/// What a daemon plugs into the loop.
pub trait Service {
    /// Name clients must ask for in their hello (`maru-rm`, ...).
    fn service_name(&self) -> &'static str;

    /// Extra facts for the welcome message (an agent's boot id, ...).
    fn welcome_info(&self) -> serde_json::Value {
        serde_json::Value::Null
    }

    /// A connection finished its handshake (see [`Opened`]).
    fn on_open(&mut self, _opened: Opened<'_>) {}

    /// One request frame body; returns the reply frame to send (encoded). An empty
    /// return means the reply comes later: computed off the loop and handed over
    /// through the server's [`Replier`], or computed by the service on the loop and
    /// handed over through [`Service::take_replies`]. The connection's requests are
    /// not read on while it has [`MAX_DEFERRED`] replies outstanding.
    fn on_request(&mut self, conn: ConnId, client_id: &str, body: &[u8], now_ms: u64) -> Vec<u8>;

    /// The label under which the loop times request `body` from the read of its last
    /// byte to the write of its reply's last byte ([`Service::on_served`]); None (the
    /// default): not timed. Asked only of a service whose [`Service::loop_timed`] is
    /// true: the loop reads no clock for requests otherwise.
    fn request_label(&self, _body: &[u8]) -> Option<&'static str> {
        None
    }

    /// A request labelled by [`Service::request_label`] was served: `seconds` from the
    /// loop's read of its last byte to its write of the reply's last byte (its turn's
    /// wait behind other connections, the service's work, a deferred reply's wait and
    /// the write included; the kernel's and the client's time before and after not).
    fn on_served(&mut self, _label: &'static str, _seconds: f64) {}

    /// The loop worked `wall` seconds between two polls (its events, a round of
    /// turns, the timers), of which its thread ran `cpu` seconds (the rest it waited
    /// for a CPU, or in a call that blocks): a request that arrived meanwhile waited
    /// up to `wall`, unread. Called at every turn of the loop; the default does
    /// nothing.
    fn on_loop_busy(&mut self, _wall: f64, _cpu: f64) {}

    /// Whether the loop times itself: its stretches for [`Service::on_loop_busy`] (two
    /// clock reads a turn, one of them a system call) and the requests labelled by
    /// [`Service::request_label`] (a clock read per read of a connection); the
    /// default: no.
    fn loop_timed(&self) -> bool {
        false
    }

    /// Replies to requests answered later (see `on_request`), by connection: the loop
    /// asks after every batch of events and every tick, and drops those of
    /// connections that closed. A service with such replies waiting keeps a
    /// `next_deadline` near, so the loop comes back for them.
    fn take_replies(&mut self) -> Vec<(ConnId, Vec<u8>)> {
        Vec::new()
    }

    /// A connection that had finished its handshake is gone.
    fn on_close(&mut self, _conn: ConnId, _client_id: &str, _now_ms: u64) {}

    /// Timers: called when `next_deadline` has passed (and after every batch of events).
    fn on_tick(&mut self, _now_ms: u64) {}

    /// The next time `on_tick` must run, in the clock's milliseconds.
    fn next_deadline(&self) -> Option<u64> {
        None
    }

    /// Called once when the loop stops (signal): save what must be saved.
    fn on_shutdown(&mut self, _now_ms: u64) {}
}

/// Most replies one connection may have outstanding off the loop (deferred); its
/// requests are read on only once one of them came back.
pub const MAX_DEFERRED: usize = 8;

/// Hands a reply computed off the loop (a deferred [`Service::on_request`]) back to
/// the loop, which sends it on the connection (dropped if the connection is gone).
/// Cloned into the threads that do the work.
#[derive(Clone)]
pub struct Replier {
    pub(super) tx: std::sync::mpsc::Sender<(ConnId, Vec<u8>)>,
    pub(super) waker: std::sync::Arc<mio::Waker>,
}

impl Replier {
    /// Wakes the loop without a reply, so it asks the service's `next_deadline` again.
    pub fn wake(&self) {
        if let Err(e) = self.waker.wake() {
            log::error!("cannot wake the event loop: {e}");
        }
    }

    pub fn send(&self, conn: ConnId, reply: Vec<u8>) {
        if self.tx.send((conn, reply)).is_ok() {
            if let Err(e) = self.waker.wake() {
                log::error!("cannot wake the event loop for a deferred reply: {e}");
            }
        }
    }
}
