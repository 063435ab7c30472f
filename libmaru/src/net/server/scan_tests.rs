//! The loop's work per request does not grow with the connections open: it looks
//! at every connection (for the idle timeout) at most once per check interval, not
//! at every turn, and finds a deferred reply's connection by its id (issue 46).

use super::{NetCounters, Server, ServerOptions};
use crate::net::service::{ConnId, Replier, Service};
use crate::net::{Client, ClientOptions};
use crate::wire::{self, WireError};
use std::sync::atomic::Ordering;
use std::sync::mpsc;

/// Answers every other request at once and defers the rest, handing them back
/// through the loop's [`Replier`] from another thread.
struct HalfDeferred {
    n: u64,
    later: mpsc::Sender<(ConnId, Vec<u8>)>,
}

impl Service for HalfDeferred {
    fn service_name(&self) -> &'static str {
        "scan"
    }

    fn on_request(&mut self, conn: ConnId, _: &str, body: &[u8], _: u64) -> Vec<u8> {
        self.n += 1;
        let reply = wire::reply_frame(wire::request_id_of(body), Ok::<_, WireError>(self.n));
        if self.n % 2 == 0 {
            return reply;
        }
        let _ = self.later.send((conn, reply));
        Vec::new()
    }
}

#[test]
fn a_request_looks_at_no_other_connection() {
    const IDLE: usize = 300;
    const CALLS: u64 = 400;
    let (mut server, addr) = Server::loopback(ServerOptions::default());
    let counters: std::sync::Arc<NetCounters> = server.counters();
    let replier: Replier = server.replier();
    let (later, deferred) = mpsc::channel::<(ConnId, Vec<u8>)>();
    std::thread::spawn(move || {
        for (conn, reply) in deferred {
            replier.send(conn, reply);
        }
    });
    std::thread::spawn(move || server.run(&mut HalfDeferred { n: 0, later }));
    let opts = ClientOptions::new("scan", "t");
    let _idle: Vec<Client> = (0..IDLE)
        .map(|_| Client::connect(&addr, &opts).expect("connect"))
        .collect();
    let mut c = Client::connect(&addr, &opts).expect("connect");
    let before = counters.conns_visited.load(Ordering::Relaxed);
    let start = std::time::Instant::now();
    for _ in 0..CALLS {
        let _: u64 = c.call(&serde_json::json!({"op": "x"})).expect("call");
    }
    let visited = counters.conns_visited.load(Ordering::Relaxed) - before;
    // One look per deferred reply, and a check of every connection at most once a
    // second (the default idle timeout's interval) and once more at either end.
    let checks = start.elapsed().as_secs() + 2;
    let most = CALLS + checks * (IDLE as u64 + 1);
    assert!(
        visited <= most,
        "{CALLS} calls beside {IDLE} idle connections looked at {visited} connections \
         (at most {most}): a walk over every connection per request"
    );
}
