//! One connection as the event loop holds it ([`Conn`]): its socket, its frames in
//! and out, its handshake phase and the bounds it is under; writing its replies out
//! ([`flush`]) and closing it on a protocol error ([`fail`]).

use super::counters::NetCounters;
use super::options::ServerOptions;
use super::timing::ServedTimes;
use crate::net::classes::Class;
use crate::net::handshake::ServerHandshake;
use crate::net::service::{ConnId, MAX_DEFERRED};
use crate::net::text::clip;
use crate::wire::{self, ErrorCode, FrameDecoder, WireError};
use mio::net::TcpStream;
use std::io::{self, Write};
use std::net::SocketAddr;

pub(super) enum Phase {
    Handshake(ServerHandshake),
    /// `key`: the keyring's name and id of the key it proved (None without keys).
    Ready {
        client_id: String,
        key: Option<(String, String)>,
    },
}

/// Why a connection that had not finished its handshake is closed, to be logged
/// through the loop's [`ThrottledLog`] when it goes.
pub(super) struct PreAuthEnd {
    pub(super) level: log::Level,
    pub(super) kind: &'static str,
    pub(super) line: String,
}

pub(super) struct Conn {
    pub(super) id: ConnId,
    pub(super) stream: TcpStream,
    pub(super) peer: SocketAddr,
    pub(super) decoder: FrameDecoder,
    pub(super) out: Vec<u8>,
    pub(super) out_pos: usize,
    pub(super) phase: Phase,
    /// Set when it is closed before its handshake ended.
    pub(super) pre_auth_end: Option<PreAuthEnd>,
    /// When the last whole frame arrived (idle timeout).
    pub(super) last_frame_ms: u64,
    /// Close once `out` is flushed (after an error frame).
    pub(super) closing: bool,
    /// The socket may hold bytes not read yet (reading stopped at a bound or a turn's
    /// budget; readiness is edge-triggered, so the loop remembers).
    pub(super) unread: bool,
    /// The peer closed its side: read on to the end of the stream.
    pub(super) peer_closed: bool,
    /// Its frame under way waits for room ([`FrameRoom`]): not read until granted.
    pub(super) waiting_room: bool,
    /// Whose turn it takes ([`FairQueue`]) and whose room it uses: its tenant, or
    /// `PRE_AUTH` during its handshake.
    pub(super) class: Class,
    /// The interest registered now: (readable, writable).
    pub(super) interest: (bool, bool),
    /// Replies the service deferred and has not handed back yet.
    pub(super) deferred: usize,
    /// Its timed requests, from their read to their replies' write.
    pub(super) times: ServedTimes,
}

impl Conn {
    pub(super) fn unsent(&self) -> usize {
        self.out.len() - self.out_pos
    }

    pub(super) fn pending(&self) -> bool {
        matches!(self.phase, Phase::Handshake(_))
    }

    /// Whether its requests may be read and served now.
    pub(super) fn may_read(&self, opts: &ServerOptions) -> bool {
        !self.closing && self.unsent() <= opts.max_unsent && self.deferred < MAX_DEFERRED
    }

    /// Whether a turn would do something: frames to serve, or bytes to read that it
    /// may hold.
    pub(super) fn has_work(&self, opts: &ServerOptions) -> bool {
        self.may_read(opts) && !self.waiting_room && (self.unread || self.decoder.frame_ready())
    }

    /// Past its handshake with nothing under way: no request part read, no reply
    /// owed or unsent. Such a connection of a tenant over its share of the
    /// connections may be pushed out for a connection of one under its share.
    pub(super) fn idle(&self) -> bool {
        !self.pending()
            && !self.closing
            && self.deferred == 0
            && self.unsent() == 0
            && self.decoder.buffered() == 0
            && !self.waiting_room
            && !self.unread
    }
}
/// Writes what is queued; false when the socket failed.
pub(super) fn flush(conn: &mut Conn, counters: &NetCounters) -> bool {
    while conn.out_pos < conn.out.len() {
        match conn.stream.write(&conn.out[conn.out_pos..]) {
            Ok(0) => return false,
            Ok(n) => {
                NetCounters::add(&counters.bytes_out, n as u64);
                conn.out_pos += n
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return true,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                log::debug!("write to {} failed: {e}", conn.peer);
                return false;
            }
        }
    }
    conn.out.clear();
    conn.out_pos = 0;
    if conn.times.has_unwritten() {
        conn.times.written(std::time::Instant::now());
    }
    true
}

pub(super) fn fail(conn: &mut Conn, counters: &NetCounters, code: ErrorCode, message: String) {
    let message = clip(&message);
    if code == ErrorCode::Auth {
        // An operator wants to see these (a wrong key file, a probe): logged through
        // the loop's summary, as a flood of them costs nothing to send.
        NetCounters::add(&counters.auth_failures, 1);
        conn.pre_auth_end = Some(PreAuthEnd {
            level: log::Level::Warn,
            kind: "key proof failed",
            line: format!(
                "connection from {}: key proof failed: {message}; closing",
                conn.peer
            ),
        });
    } else if conn.pending() {
        NetCounters::add(&counters.protocol_errors, 1);
        conn.pre_auth_end = Some(PreAuthEnd {
            level: log::Level::Info,
            kind: "handshake refused",
            line: format!("connection from {}: {message}; closing", conn.peer),
        });
    } else {
        NetCounters::add(&counters.protocol_errors, 1);
        log::info!("connection from {}: {message}; closing", conn.peer);
    }
    conn.out
        .extend(wire::error_frame(&WireError::new(code, message)));
    conn.closing = true;
}
