//! A service whose work runs off the event loop: the loop only moves bytes, and the
//! service's requests, closes and timers run in order on one worker thread (the core
//! keeps its order rules: a close comes after the requests before it), their replies
//! handed back through the server's [`Replier`]. Requests a [`Lane`] picks (work
//! that touches no shared state, such as an RDMA queue-pair bring-up) run on a small
//! pool of their own, so a slow one delays neither the core nor the loop.
//!
//! A connection has at most [`maru::net::MAX_DEFERRED`] replies outstanding (the loop
//! stops reading it meanwhile), so the queues stay bounded by the connection cap.

use maru::net::{ConnId, Replier, Service};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

/// Serves one request of a connection: returns the reply frame.
pub type Serve = dyn Fn(ConnId, &str, &[u8]) -> Vec<u8> + Send + Sync;
/// Whether a lane serves a request body.
pub type Picks = fn(&[u8]) -> bool;

/// Requests served on a pool of their own.
pub struct Lane {
    /// Whether this lane serves the request (decided on the loop: keep it cheap).
    pub picks: Picks,
    pub serve: Arc<Serve>,
    pub threads: usize,
}

enum Job {
    Open {
        conn: ConnId,
        client_id: String,
        key_name: Option<String>,
        resume: Option<String>,
        now: u64,
    },
    Request {
        conn: ConnId,
        client_id: String,
        body: Vec<u8>,
        now: u64,
    },
    Close {
        conn: ConnId,
        client_id: String,
        now: u64,
    },
    Tick(u64),
    Shutdown(u64),
}

/// No deadline (in `deadline`).
const NONE: u64 = u64::MAX;

/// `S` on a worker thread, seen from the loop.
pub struct OffLoop {
    name: &'static str,
    /// The service's welcome as it was when moved off the loop; its `uptime_s` is
    /// brought up to date from `started` at each welcome.
    welcome: serde_json::Value,
    started: std::time::Instant,
    jobs: Sender<Job>,
    lane: Option<(Picks, Sender<Job>)>,
    /// The service's next deadline, as the worker last read it.
    deadline: Arc<AtomicU64>,
    /// A tick is queued and not yet run: no other is asked for meanwhile.
    tick_queued: Arc<AtomicBool>,
    worker: Option<JoinHandle<()>>,
}

impl OffLoop {
    /// Moves `service` to a worker thread; replies go back through `replier`.
    pub fn new<S: Service + Send + 'static>(
        service: S,
        replier: Replier,
        lane: Option<Lane>,
    ) -> std::io::Result<OffLoop> {
        let name = service.service_name();
        let welcome = service.welcome_info();
        let deadline = Arc::new(AtomicU64::new(service.next_deadline().unwrap_or(NONE)));
        let tick_queued = Arc::new(AtomicBool::new(false));
        let (jobs, rx) = channel();
        let (d, t, r) = (deadline.clone(), tick_queued.clone(), replier.clone());
        let worker = std::thread::Builder::new()
            .name(format!("{name}-core"))
            .spawn(move || run(service, rx, r, d, t))?;
        let lane = match lane {
            Some(l) => {
                let (tx, rx) = channel::<Job>();
                let rx = Arc::new(Mutex::new(rx));
                for i in 0..l.threads.max(1) {
                    let (rx, serve, r) = (rx.clone(), l.serve.clone(), replier.clone());
                    std::thread::Builder::new()
                        .name(format!("{name}-lane{i}"))
                        .spawn(move || run_lane(&rx, &*serve, &r))?;
                }
                Some((l.picks, tx))
            }
            None => None,
        };
        Ok(OffLoop {
            name,
            welcome,
            started: std::time::Instant::now(),
            jobs,
            lane,
            deadline,
            tick_queued,
            worker: Some(worker),
        })
    }

    fn queue(&self, job: Job) {
        if self.jobs.send(job).is_err() {
            log::error!("{}: the worker thread is gone; request dropped", self.name);
        }
    }
}

fn run<S: Service>(
    mut s: S,
    rx: Receiver<Job>,
    replier: Replier,
    deadline: Arc<AtomicU64>,
    tick_queued: Arc<AtomicBool>,
) {
    let publish = |s: &S| deadline.store(s.next_deadline().unwrap_or(NONE), Ordering::SeqCst);
    while let Ok(job) = rx.recv() {
        match job {
            Job::Open {
                conn,
                client_id,
                key_name,
                resume,
                now,
            } => s.on_open(
                conn,
                &client_id,
                key_name.as_deref(),
                resume.as_deref(),
                now,
            ),
            Job::Request {
                conn,
                client_id,
                body,
                now,
            } => {
                let reply = s.on_request(conn, &client_id, &body, now);
                publish(&s);
                replier.send(conn, reply);
                continue;
            }
            Job::Close {
                conn,
                client_id,
                now,
            } => s.on_close(conn, &client_id, now),
            Job::Tick(now) => {
                s.on_tick(now);
                tick_queued.store(false, Ordering::SeqCst);
                publish(&s);
                replier.wake();
                continue;
            }
            Job::Shutdown(now) => {
                s.on_shutdown(now);
                return;
            }
        }
        publish(&s);
    }
}

fn run_lane(rx: &Mutex<Receiver<Job>>, serve: &Serve, replier: &Replier) {
    loop {
        let job = match rx.lock() {
            Ok(r) => r.recv(),
            Err(_) => return,
        };
        match job {
            Ok(Job::Request {
                conn,
                client_id,
                body,
                ..
            }) => replier.send(conn, serve(conn, &client_id, &body)),
            Ok(_) => {}
            Err(_) => return,
        }
    }
}

impl Service for OffLoop {
    fn service_name(&self) -> &'static str {
        self.name
    }

    fn welcome_info(&self) -> serde_json::Value {
        let mut w = self.welcome.clone();
        if let Some(up) = w.get_mut("uptime_s") {
            let base = up.as_u64().unwrap_or(0);
            *up = (base + self.started.elapsed().as_secs()).into();
        }
        w
    }

    fn on_open(
        &mut self,
        conn: ConnId,
        client_id: &str,
        key_name: Option<&str>,
        resume: Option<&str>,
        now_ms: u64,
    ) {
        self.queue(Job::Open {
            conn,
            client_id: client_id.to_string(),
            key_name: key_name.map(str::to_string),
            resume: resume.map(str::to_string),
            now: now_ms,
        });
    }

    fn on_request(&mut self, conn: ConnId, client_id: &str, body: &[u8], now_ms: u64) -> Vec<u8> {
        let job = Job::Request {
            conn,
            client_id: client_id.to_string(),
            body: body.to_vec(),
            now: now_ms,
        };
        match &self.lane {
            Some((picks, tx)) if picks(body) => {
                if tx.send(job).is_err() {
                    log::error!(
                        "{}: the lane's threads are gone; request dropped",
                        self.name
                    );
                }
            }
            _ => self.queue(job),
        }
        // The reply comes through the replier.
        Vec::new()
    }

    fn on_close(&mut self, conn: ConnId, client_id: &str, now_ms: u64) {
        self.queue(Job::Close {
            conn,
            client_id: client_id.to_string(),
            now: now_ms,
        });
    }

    fn on_tick(&mut self, now_ms: u64) {
        if !self.tick_queued.swap(true, Ordering::SeqCst) {
            self.queue(Job::Tick(now_ms));
        }
    }

    fn next_deadline(&self) -> Option<u64> {
        if self.tick_queued.load(Ordering::SeqCst) {
            return None;
        }
        match self.deadline.load(Ordering::SeqCst) {
            NONE => None,
            d => Some(d),
        }
    }

    fn on_shutdown(&mut self, now_ms: u64) {
        self.queue(Job::Shutdown(now_ms));
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use maru::net::{Client, ClientOptions, Clock, Server, ServerOptions};
    use maru::wire::agent::{AgentReply, AgentRequest, SERVICE};
    use maru::wire::{self, Envelope};
    use std::time::{Duration, Instant};

    const SLOW: Duration = Duration::from_millis(1500);

    /// An agent whose NIC registration (a map) takes 1.5 s.
    struct SlowNic;

    impl Service for SlowNic {
        fn service_name(&self) -> &'static str {
            SERVICE
        }

        fn on_request(&mut self, _: ConnId, _: &str, body: &[u8], _: u64) -> Vec<u8> {
            let env: Envelope<AgentRequest> = wire::decode_json(body).unwrap();
            let reply = match env.body {
                AgentRequest::Map { .. } => {
                    std::thread::sleep(SLOW);
                    AgentReply::Unmapped { removed: true }
                }
                AgentRequest::ConnectPeer { info } => AgentReply::Peer { info },
                _ => AgentReply::Unmapped { removed: false },
            };
            wire::reply_frame(env.id, Ok::<_, wire::WireError>(reply))
        }
    }

    /// The lane's pick: a bring-up (as the agent's own lane picks).
    fn is_connect_peer(body: &[u8]) -> bool {
        matches!(
            wire::decode_json::<Envelope<AgentRequest>>(body),
            Ok(Envelope {
                body: AgentRequest::ConnectPeer { .. },
                ..
            })
        )
    }

    fn lane() -> Lane {
        Lane {
            picks: is_connect_peer,
            serve: Arc::new(|_, _, body| {
                let env: Envelope<AgentRequest> = wire::decode_json(body).unwrap();
                let AgentRequest::ConnectPeer { info } = env.body else {
                    panic!("not a bring-up");
                };
                wire::reply_frame(env.id, Ok::<_, wire::WireError>(AgentReply::Peer { info }))
            }),
            threads: 2,
        }
    }

    /// Starts a loop serving `SlowNic` (off the loop or on it) and returns its address.
    fn start(off_loop: bool) -> String {
        let mut server = Server::bind(
            "127.0.0.1:0".parse().unwrap(),
            ServerOptions::default(),
            Clock::new(),
        )
        .unwrap();
        let addr = server.local_addr().unwrap().to_string();
        let replier = server.replier();
        std::thread::spawn(move || {
            if off_loop {
                let mut s = OffLoop::new(SlowNic, replier, Some(lane())).unwrap();
                let _ = server.run(&mut s);
            } else {
                let _ = server.run(&mut SlowNic);
            }
        });
        addr
    }

    fn handle() -> maru::wire::rm::Handle {
        maru::wire::rm::Handle {
            region_id: 1,
            offset: 0,
            length: 4096,
            token: "t".into(),
        }
    }

    /// While connection A's registration takes 1.5 s, connection B connects (handshake)
    /// and brings up a queue pair, and gets both answers at once; A gets its answer
    /// after the registration. Served on the loop, B waits for A (checked below, so
    /// the measurement does detect a stalled loop).
    fn others_wait_behind_a_slow_registration(off_loop: bool) -> Duration {
        let addr = start(off_loop);
        let opts = ClientOptions::new(SERVICE, "w");
        let mut a = Client::connect(&addr, &opts).unwrap();
        let slow = std::thread::spawn(move || {
            let t = Instant::now();
            let r: AgentReply = a
                .call(&AgentRequest::Map {
                    handle: handle(),
                    writable: true,
                })
                .unwrap();
            assert_eq!(r, AgentReply::Unmapped { removed: true });
            t.elapsed()
        });
        std::thread::sleep(Duration::from_millis(200));
        let t = Instant::now();
        let mut b = Client::connect(&addr, &opts).unwrap();
        let info = serde_json::json!({ "qpn": 7 });
        let r: AgentReply = b
            .call(&AgentRequest::ConnectPeer { info: info.clone() })
            .unwrap();
        let waited = t.elapsed();
        assert_eq!(r, AgentReply::Peer { info });
        assert!(slow.join().unwrap() >= SLOW);
        waited
    }

    #[test]
    fn a_slow_registration_does_not_delay_another_connections_requests() {
        let waited = others_wait_behind_a_slow_registration(true);
        assert!(
            waited < Duration::from_millis(500),
            "connection B waited {waited:?} behind A's registration"
        );
        let on_loop = others_wait_behind_a_slow_registration(false);
        assert!(
            on_loop >= Duration::from_millis(1000),
            "served on the loop, B should have waited ({on_loop:?})"
        );
    }

    /// Counts the requests the loop hands to the wrapped service.
    struct Counting(OffLoop, Arc<std::sync::atomic::AtomicUsize>);

    impl Service for Counting {
        fn service_name(&self) -> &'static str {
            self.0.service_name()
        }

        fn on_request(&mut self, conn: ConnId, id: &str, body: &[u8], now: u64) -> Vec<u8> {
            self.1.fetch_add(1, Ordering::SeqCst);
            self.0.on_request(conn, id, body, now)
        }
    }

    /// A client that pipelines requests without waiting cannot queue more than
    /// `MAX_DEFERRED` of them off the loop: the loop stops reading it meanwhile. Every
    /// request is still answered, in order.
    #[test]
    fn a_pipelining_client_has_at_most_max_deferred_requests_queued() {
        use std::io::{Read, Write};
        const N: u64 = 40;
        let mut server = Server::bind(
            "127.0.0.1:0".parse().unwrap(),
            ServerOptions::default(),
            Clock::new(),
        )
        .unwrap();
        let addr = server.local_addr().unwrap().to_string();
        let seen = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (replier, s2) = (server.replier(), seen.clone());
        std::thread::spawn(move || {
            /// Each request takes 100 ms.
            struct Slow;
            impl Service for Slow {
                fn service_name(&self) -> &'static str {
                    SERVICE
                }
                fn on_request(&mut self, _: ConnId, _: &str, body: &[u8], _: u64) -> Vec<u8> {
                    std::thread::sleep(Duration::from_millis(100));
                    let id = wire::request_id_of(body);
                    wire::reply_frame(
                        id,
                        Ok::<_, wire::WireError>(AgentReply::Unmapped { removed: false }),
                    )
                }
            }
            let mut s = Counting(OffLoop::new(Slow, replier, None).unwrap(), s2);
            let _ = server.run(&mut s);
        });
        let c = Client::connect(&addr, &ClientOptions::new(SERVICE, "pipe")).unwrap();
        let (mut stream, _) = c.into_parts();
        let mut out = Vec::new();
        for id in 1..=N {
            let body = wire::encode_json(&Envelope {
                id,
                body: AgentRequest::Status,
            });
            out.extend(wire::frame::encode(wire::FrameKind::Request, &body));
        }
        stream.write_all(&out).unwrap();
        std::thread::sleep(Duration::from_millis(450));
        let taken = seen.load(Ordering::SeqCst);
        // About 4 answered in 450 ms, plus at most MAX_DEFERRED (8) waiting; without
        // the bound the loop takes all 40 at once.
        assert!(
            taken <= 6 + maru::net::MAX_DEFERRED && taken < N as usize / 2,
            "{taken} requests taken off the socket with ~4 answered"
        );
        let mut dec = wire::FrameDecoder::new(1 << 20);
        let mut ids = Vec::new();
        let mut buf = [0u8; 4096];
        stream
            .set_read_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        while ids.len() < N as usize {
            match dec.next_frame().unwrap() {
                Some(f) => ids.push(wire::request_id_of(&f.body)),
                None => {
                    let n = stream.read(&mut buf).unwrap();
                    assert!(n > 0, "closed after {} replies", ids.len());
                    dec.push(&buf[..n]);
                }
            }
        }
        assert_eq!(ids, (1..=N).collect::<Vec<_>>());
    }
}
