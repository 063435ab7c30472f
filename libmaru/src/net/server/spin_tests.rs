//! The loop's busy poll on loopback ([`ServerOptions::poll_spin`]): after a request
//! it polls without sleeping, and once the bound has passed with nothing more to do
//! it sleeps again, taking no CPU.

use super::{Server, ServerOptions};
use crate::net::service::{ConnId, Service};
use crate::net::{Client, ClientOptions};
use crate::wire::{self, FrameKind, WireError};
use std::io::{Read, Write};
use std::time::Duration;

/// Answers every request with 0.
struct Zero;

impl Service for Zero {
    fn service_name(&self) -> &'static str {
        "zero"
    }

    fn on_request(&mut self, _: ConnId, _: &str, body: &[u8], _: u64) -> Vec<u8> {
        wire::reply_frame(wire::request_id_of(body), Ok::<_, WireError>(0usize))
    }
}

/// Nanoseconds thread `tid` of this process has run.
fn cpu_ns(tid: libc::pid_t) -> u64 {
    let path = format!("/proc/self/task/{tid}/schedstat");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    text.split_whitespace()
        .next()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{path}: {text}"))
}

#[test]
fn after_a_request_the_loop_spins_then_sleeps_once_its_bound_passed() {
    let spin = Duration::from_millis(100);
    let (mut server, addr) = Server::loopback(ServerOptions {
        poll_spin: spin,
        ..ServerOptions::default()
    });
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        // SAFETY: gettid has no preconditions.
        let _ = tx.send(unsafe { libc::gettid() });
        server.run(&mut Zero)
    });
    let tid = rx.recv().expect("the loop's thread id");
    let (mut s, _) = Client::connect(&addr, &ClientOptions::new("zero", "t"))
        .expect("connect")
        .into_parts();
    // Settle: the handshake's own spin is over.
    std::thread::sleep(3 * spin);
    let quiet = cpu_ns(tid);
    std::thread::sleep(3 * spin);
    let asleep = cpu_ns(tid) - quiet;

    s.write_all(&wire::frame::encode(FrameKind::Request, br#"{"id":1}"#))
        .expect("request");
    let mut buf = [0u8; 256];
    assert!(s.read(&mut buf).expect("reply") > 0);
    let served = cpu_ns(tid);
    std::thread::sleep(3 * spin);
    let spun = cpu_ns(tid) - served;
    let after = cpu_ns(tid);
    std::thread::sleep(3 * spin);
    let idle = cpu_ns(tid) - after;

    // Spinning 100 ms on a loaded 2-core machine still takes several ms of CPU; a
    // sleeping loop takes well under one.
    let ms = 1_000_000;
    assert!(
        spun > 5 * ms,
        "the loop did not spin after the request: {spun} ns"
    );
    assert!(
        asleep < 2 * ms,
        "the loop ran while idle before: {asleep} ns"
    );
    assert!(
        idle < 2 * ms,
        "the loop still ran {idle} ns in {:?} after its bound of {spin:?}",
        3 * spin
    );
}
