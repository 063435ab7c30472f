//! The loop on loopback, in process: the bound on partly received frames after the
//! handshake (`FrameRoom`), read from the loop's own gauge of the bytes it buffers.

use super::server::{NetCounters, Server, ServerOptions, SMALL_FRAME};
use super::service::{ConnId, Service};
use super::{Client, ClientOptions};
use crate::auth::SharedKey;
use crate::wire::{self, FrameDecoder, FrameKind, WireError};
use mio::net::TcpStream;
use std::io::{ErrorKind, Read, Write};
use std::sync::Arc;
use std::time::{Duration, Instant};

const MIB: usize = 1 << 20;

/// Answers every request with its body's length.
struct Sizes;

impl Service for Sizes {
    fn service_name(&self) -> &'static str {
        "sizes"
    }

    fn on_request(&mut self, _: ConnId, _: &str, body: &[u8], _: u64) -> Vec<u8> {
        wire::reply_frame(wire::request_id_of(body), Ok::<_, WireError>(body.len()))
    }
}

/// A loop serving [`Sizes`] with `opts`, running until the test process ends.
fn start(opts: ServerOptions) -> (String, Arc<NetCounters>) {
    let (mut server, addr) = Server::loopback(opts);
    let counters = server.counters();
    std::thread::spawn(move || server.run(&mut Sizes));
    (addr, counters)
}

/// A connection past its handshake (proving `key`), as a raw non-blocking socket.
fn connected(addr: &str, key: Option<&SharedKey>) -> TcpStream {
    let mut o = ClientOptions::new("sizes", "t");
    o.key = key.cloned();
    let (s, rest) = Client::connect(addr, &o).expect("connect").into_parts();
    assert!(rest.is_empty());
    s.set_nonblocking(true).expect("non-blocking");
    // The client's socket as a mio one: the test only reads and writes it.
    TcpStream::from_std(s)
}

/// A request frame whose body is `len` bytes.
fn request(len: usize) -> Vec<u8> {
    wire::frame::encode(FrameKind::Request, &vec![b' '; len])
}

/// Writes what the socket takes of `bytes[*at..end]` without blocking.
fn write_some(s: &mut TcpStream, bytes: &[u8], at: &mut usize, end: usize) {
    while *at < end {
        match s.write(&bytes[*at..end]) {
            Ok(0) => return,
            Ok(n) => *at += n,
            Err(e) if e.kind() == ErrorKind::WouldBlock => return,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => panic!("write: {e}"),
        }
    }
}

/// Writes every `(socket, frame, written)` up to `end(frame)` bytes, as far as the
/// sockets take them, until nothing moves for 300 ms (or 10 s passed).
fn push_all(conns: &mut [(TcpStream, Vec<u8>, usize)], end: impl Fn(&[u8]) -> usize) {
    let start = Instant::now();
    let mut quiet_since = Instant::now();
    while quiet_since.elapsed() < Duration::from_millis(300) && start.elapsed().as_secs() < 10 {
        let mut moved = false;
        for (s, f, at) in conns.iter_mut() {
            let before = *at;
            let stop = end(f);
            write_some(s, f, at, stop);
            moved |= *at > before;
        }
        if moved {
            quiet_since = Instant::now();
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Reads `s` until a reply arrives (or `limit` passes): the body length it reports.
fn reply_within(s: &mut TcpStream, limit: Duration) -> Option<usize> {
    let deadline = Instant::now() + limit;
    let mut dec = FrameDecoder::new(MIB);
    let mut buf = [0u8; 4096];
    while Instant::now() < deadline {
        match s.read(&mut buf) {
            Ok(0) => return None,
            Ok(n) => dec.push(&buf[..n]),
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(2))
            }
            Err(e) => panic!("read: {e}"),
        }
        if let Ok(Some(f)) = dec.next_frame() {
            let env: wire::ReplyEnvelope<usize> = wire::decode_json(&f.body).expect("a reply");
            return env.ok;
        }
    }
    None
}

fn buffered(c: &NetCounters) -> usize {
    NetCounters::get(&c.buffered) as usize
}

/// 40 connections each send all of a 1 MiB frame but its last KiB. With 4 MiB of
/// room, the loop holds at most 16 KiB of each plus the 4 MiB (it held all 40 MiB
/// before the bound); a small request of another connection is answered meanwhile;
/// once the senders finish their frames every one is answered (the room goes round:
/// grants are of whole frames, so no two half-read frames wait on each other) and
/// nothing stays buffered.
#[test]
fn partial_large_frames_hold_no_more_than_the_room_and_all_complete() {
    let room = 4 * MIB;
    let (addr, counters) = start(ServerOptions {
        frame_room: room,
        frame_room_per_tenant: room,
        ..ServerOptions::default()
    });
    let n = 40;
    let mut conns: Vec<(TcpStream, Vec<u8>, usize)> = (0..n)
        .map(|_| (connected(&addr, None), request(MIB - 64), 0))
        .collect();
    push_all(&mut conns, |f| f.len() - 1024);
    let held = buffered(&counters);
    let bound = n * SMALL_FRAME + room;
    assert!(
        held <= bound,
        "{held} bytes of partial frames buffered, over {bound}"
    );
    assert!(held >= room, "the room was used: {held}");
    assert!(NetCounters::get(&counters.frame_room_waits) > 0);
    let mut other = connected(&addr, None);
    let small = request(100);
    write_some(&mut other, &small, &mut 0, small.len());
    assert_eq!(reply_within(&mut other, Duration::from_secs(5)), Some(100));
    // The rest of every frame: each is answered.
    push_all(&mut conns, |f| f.len());
    assert!(conns.iter().all(|(_, f, at)| *at == f.len()), "all sent");
    for (i, (s, _, _)) in conns.iter_mut().enumerate() {
        assert_eq!(
            reply_within(s, Duration::from_secs(10)),
            Some(MIB - 64),
            "connection {i}"
        );
    }
    assert_eq!(buffered(&counters), 0);
}

/// Tenant `a`'s 10 connections stall with partial 1 MiB frames; they hold at most
/// their tenant's share of the room (2 of 4 MiB), so tenant `b`'s 1 MiB request is
/// read and answered at once. Without the per-tenant share, `a` took all the room
/// and `b`'s frame waited for it.
#[test]
fn one_tenants_stalled_frames_leave_room_for_another_tenants() {
    let (ka, kb) = (
        SharedKey::generate().unwrap(),
        SharedKey::generate().unwrap(),
    );
    let keys = crate::auth::Keyring::new(vec![("a".into(), ka.clone()), ("b".into(), kb.clone())])
        .expect("keyring");
    let (addr, counters) = start(ServerOptions {
        keys: Some(keys),
        frame_room: 4 * MIB,
        frame_room_per_tenant: 2 * MIB,
        ..ServerOptions::default()
    });
    let mut stalled: Vec<(TcpStream, Vec<u8>, usize)> = (0..10)
        .map(|_| (connected(&addr, Some(&ka)), request(MIB - 64), 0))
        .collect();
    push_all(&mut stalled, |f| f.len() - 1024);
    assert!(buffered(&counters) <= 10 * SMALL_FRAME + 2 * MIB);
    let mut b = vec![(connected(&addr, Some(&kb)), request(MIB - 64), 0)];
    push_all(&mut b, |f| f.len());
    assert_eq!(
        reply_within(&mut b[0].0, Duration::from_secs(5)),
        Some(MIB - 64),
        "tenant b's frame was not served beside tenant a's stalled ones"
    );
}

/// Whether the loop closed `s` within `limit` (replies it sent are read and dropped).
fn closed_within(s: &mut TcpStream, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    let mut buf = [0u8; 4096];
    while Instant::now() < deadline {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(5))
            }
            Err(_) => return true,
        }
    }
    false
}

/// Two connections are granted the whole room (2 MiB) and then send nothing more of
/// their frames. Nobody waiting, they keep it past `frame_stall_ms` (a slow peer then
/// harms no one); once a third's 1 MiB frame waits for room, those silent for
/// `frame_stall_ms` are closed and the waiting frame is read and answered.
#[test]
fn a_granted_frame_whose_peer_stalls_while_others_wait_is_closed() {
    let (addr, counters) = start(ServerOptions {
        frame_room: 2 * MIB,
        frame_room_per_tenant: 2 * MIB,
        frame_stall_ms: 500,
        ..ServerOptions::default()
    });
    let mut stalled: Vec<(TcpStream, Vec<u8>, usize)> = (0..2)
        .map(|_| (connected(&addr, None), request(MIB - 64), 0))
        .collect();
    push_all(&mut stalled, |f| f.len() - 1024);
    // Nobody waits: past the stall time, both are still open.
    std::thread::sleep(Duration::from_millis(800));
    for (s, _, _) in stalled.iter_mut() {
        assert!(
            !closed_within(s, Duration::from_millis(50)),
            "closed though nobody waited"
        );
    }
    let mut waiting = vec![(connected(&addr, None), request(MIB - 64), 0)];
    push_all(&mut waiting, |f| f.len());
    assert!(
        NetCounters::get(&counters.frame_room_waits) > 0,
        "it waited"
    );
    assert_eq!(
        reply_within(&mut waiting[0].0, Duration::from_secs(5)),
        Some(MIB - 64),
        "the waiting frame was never read"
    );
    let closed = stalled
        .iter_mut()
        .filter_map(|(s, _, _)| closed_within(s, Duration::from_secs(2)).then_some(()))
        .count();
    assert!(closed >= 1, "no stalled connection was closed");
}
