//! One turn of one connection ([`Turn`]): serving its whole frames (handshake steps,
//! then requests for the service) and reading more, within its turn's byte budget,
//! the pre-auth bound and the room granted for a large frame.

use super::conn::{fail, flush, Conn, Phase};
use super::counters::NetCounters;
use super::options::{ServerOptions, SMALL_FRAME};
use crate::net::classes::{Class, Classes};
use crate::net::handshake::Step;
use crate::net::room::FrameRoom;
use crate::net::service::{Opened, Service};
use crate::wire::{self, ErrorCode, FrameKind, WireError};
use mio::Token;
use std::io::{self, Read};

/// What serving a frame costs beyond its bytes, in bytes, against its turn's budget:
/// a flood of tiny requests pays for its decoding and replies too.
const FRAME_COST: u64 = 512;

/// One turn of one connection, and what it may use besides the connection.
pub(super) struct Turn<'a> {
    pub(super) tok: Token,
    pub(super) opts: &'a ServerOptions,
    pub(super) counters: &'a NetCounters,
    pub(super) room: &'a mut FrameRoom<Class, Token>,
    pub(super) classes: &'a mut Classes,
    /// Connections granted room when this one gave its grant back.
    pub(super) granted: &'a mut Vec<Token>,
    pub(super) now: u64,
}

/// How much a connection may read now.
enum Allowance {
    Bytes(usize),
    /// Its frame under way waits for room.
    Wait,
}

impl Turn<'_> {
    /// Serves `conn`'s whole frames and reads more, until it used `budget` bytes (read
    /// and served; a frame is served whole, so one frame more at most), has nothing
    /// more to do, or must wait: for its peer to read its replies, for deferred
    /// replies, for room for its frame. A connection that finished its handshake ends
    /// its turn there (its next one is its tenant's). Returns the bytes used and
    /// whether the connection is still there.
    pub(super) fn run<S: Service>(
        &mut self,
        conn: &mut Conn,
        service: &mut S,
        buf: &mut [u8],
        budget: u64,
    ) -> (u64, bool) {
        let class = conn.class;
        let mut spent = 0u64;
        loop {
            while spent < budget && conn.may_read(self.opts) && conn.class == class {
                match self.take_frame(conn) {
                    Ok(Some(f)) => {
                        spent += (f.body.len() + wire::frame::HEADER_LEN) as u64 + FRAME_COST;
                        self.serve(conn, service, f);
                    }
                    Ok(None) => break,
                    Err(e) => fail(conn, self.counters, ErrorCode::Protocol, e.to_string()),
                }
            }
            if conn.unsent() > 0 && !flush(conn, self.counters) {
                return (spent, false);
            }
            if spent >= budget || !conn.may_read(self.opts) || conn.class != class || !conn.unread {
                return (spent, true);
            }
            let want = match self.allowance(conn) {
                Allowance::Bytes(0) => return (spent, true),
                Allowance::Bytes(n) => n.min(buf.len()),
                Allowance::Wait => {
                    conn.waiting_room = true;
                    NetCounters::add(&self.counters.frame_room_waits, 1);
                    return (spent, true);
                }
            };
            match conn.stream.read(&mut buf[..want]) {
                Ok(0) => return (spent, self.gone(conn, service)),
                Ok(n) => {
                    if service.loop_timed() {
                        conn.times.read(std::time::Instant::now());
                    }
                    NetCounters::add(&self.counters.bytes_in, n as u64);
                    NetCounters::add(&self.counters.buffered, n as u64);
                    conn.decoder.push(&buf[..n]);
                    self.room.moved(self.tok, self.now);
                    spent += n as u64;
                    // A read that did not fill what it asked for drained the socket at
                    // that instant: readiness is edge-triggered, so bytes or a FIN that
                    // come later raise a new event. A peer that closed is read on to
                    // the end of its stream.
                    if n < want && !conn.peer_closed {
                        conn.unread = false;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => conn.unread = false,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    log::debug!("read from {} failed: {e}", conn.peer);
                    return (spent, self.gone(conn, service));
                }
            }
        }
    }

    /// The peer closed or the socket failed: what came before is served, its replies
    /// may still go out; the connection is gone.
    fn gone<S: Service>(&mut self, conn: &mut Conn, service: &mut S) -> bool {
        while conn.may_read(self.opts) {
            match self.take_frame(conn) {
                Ok(Some(f)) => self.serve(conn, service, f),
                Ok(None) | Err(_) => break,
            }
        }
        let _ = flush(conn, self.counters);
        false
    }

    /// The next whole frame, its bytes counted out of the buffered gauge and the
    /// room it was granted given back.
    fn take_frame(&mut self, conn: &mut Conn) -> Result<Option<wire::Frame>, wire::FrameError> {
        let before = conn.decoder.buffered();
        let f = conn.decoder.next_frame();
        let left = conn.decoder.buffered();
        NetCounters::sub(&self.counters.buffered, before.saturating_sub(left) as u64);
        if matches!(f, Ok(Some(_))) && self.room.granted(self.tok) > 0 {
            // A grant is for one whole frame: this one.
            self.granted.extend(self.room.give_back(self.tok, self.now));
        }
        f
    }

    /// How many bytes `conn` may read now: before its handshake ends, no more than the
    /// pre-auth frame under way may still need (a peer that proved nothing holds at
    /// most one such frame, whatever it sends); after, up to [`SMALL_FRAME`] buffered,
    /// or the whole frame under way once its room is granted.
    fn allowance(&mut self, conn: &Conn) -> Allowance {
        if conn.pending() {
            return Allowance::Bytes(conn.decoder.room());
        }
        let held = conn.decoder.buffered();
        let largest = self.opts.max_frame + wire::frame::HEADER_LEN;
        match conn.decoder.next_len() {
            // Larger than any frame: the decoder refuses it before reading on.
            Some(n) if n > SMALL_FRAME && n <= largest => {
                if self.room.granted(self.tok) == 0
                    && !self.room.ask(conn.class, self.tok, n, self.now)
                {
                    return Allowance::Wait;
                }
                Allowance::Bytes(n.saturating_sub(held))
            }
            _ => Allowance::Bytes(SMALL_FRAME.saturating_sub(held)),
        }
    }

    /// One whole frame: a handshake step, or a request for the service.
    fn serve<S: Service>(&mut self, conn: &mut Conn, service: &mut S, f: wire::Frame) {
        conn.last_frame_ms = self.now;
        match &mut conn.phase {
            Phase::Handshake(hs) => match hs.on_frame(&f) {
                Step::Send(bytes) => conn.out.extend(bytes),
                Step::Ready {
                    send,
                    client_id,
                    resume,
                    key_name,
                    key_id,
                } => {
                    conn.out.extend(send);
                    conn.decoder.set_max_body(self.opts.max_frame);
                    conn.class = self.classes.of(key_name.as_deref());
                    service.on_open(Opened {
                        conn: conn.id,
                        client_id: &client_id,
                        key_name: key_name.as_deref(),
                        resume: resume.as_deref(),
                        now_ms: self.now,
                    });
                    conn.phase = Phase::Ready {
                        client_id,
                        key: key_name.zip(key_id),
                    };
                }
                Step::Fail(e) => fail(conn, self.counters, e.code, e.message),
            },
            Phase::Ready { client_id, .. } if f.kind == FrameKind::Request => {
                let label = service
                    .loop_timed()
                    .then(|| service.request_label(&f.body))
                    .flatten();
                let reply = service.on_request(conn.id, client_id, &f.body, self.now);
                if reply.is_empty() {
                    conn.deferred += 1;
                    if let Some(l) = label {
                        conn.times.deferred(wire::request_id_of(&f.body), l);
                    }
                } else if let Some(l) = label {
                    conn.times.answered(l);
                }
                conn.out.extend(reply);
            }
            Phase::Ready { .. } => {
                // The frame was intact, so the stream is still in sync: reply and go on.
                let id = wire::request_id_of(&f.body);
                conn.out.extend(wire::reply_frame::<()>(
                    id,
                    Err(WireError::new(
                        ErrorCode::Protocol,
                        format!(
                            "unexpected {:?} frame after the handshake; send Request frames",
                            f.kind
                        ),
                    )),
                ));
            }
        }
    }
}
