//! The soft NIC end to end on loopback: bytes, key checks, deregistration, fences.

use super::{SoftTarget, SoftTransport};
use crate::auth::SharedKey;
use crate::transport::{
    no_bringup, BatchState, LocalBuffer, Op, OpKind, PeerId, Registration, Target, Transport,
    TransportError,
};
use std::time::Duration;

const T: Duration = Duration::from_secs(10);

struct Rig {
    target: SoftTarget,
    region: Vec<u8>,
    staging: Vec<u8>,
    nic: SoftTransport,
}

/// `nic` with `staging` registered (keep it alive and in place while `nic` is used).
fn staged(nic: SoftTransport, staging: &mut [u8]) -> SoftTransport {
    nic.register_local(LocalBuffer::of(staging)).unwrap();
    nic
}

fn rig(key: Option<SharedKey>, region_len: usize, staging_len: usize) -> Rig {
    let target = SoftTarget::start(
        "127.0.0.1:0".parse().unwrap(),
        "",
        key.clone(),
        Duration::from_secs(5),
    )
    .unwrap();
    let mut staging = vec![0u8; staging_len];
    let nic = staged(SoftTransport::new("test-worker", key), &mut staging);
    Rig {
        target,
        region: vec![0u8; region_len],
        staging,
        nic,
    }
}

impl Rig {
    /// The whole region registered, writable, for owner 1.
    fn register_all(&mut self) -> Registration {
        // SAFETY: the region lives in the rig, as long as its target.
        unsafe {
            self.target
                .register(1, self.region.as_mut_ptr(), self.region.len() as u64, true)
        }
        .unwrap()
    }

    /// The whole region registered ([`Rig::register_all`]) and the NIC connected to it.
    fn connected(&mut self) -> (Registration, PeerId) {
        let reg = self.register_all();
        let peer = self.nic.connect(&reg.transport, &mut no_bringup).unwrap();
        (reg, peer)
    }
}

fn op(kind: OpKind, local_offset: u64, remote_addr: u64, rkey: u64, len: u64) -> Op {
    Op {
        kind,
        local_offset,
        remote_addr,
        rkey,
        len,
    }
}

#[test]
fn write_then_read_back_many_ops_in_flight() {
    let mut r = rig(None, 1 << 20, 1 << 20);
    let (reg, peer) = r.connected();
    for (i, b) in r.staging[..512 * 1024].iter_mut().enumerate() {
        *b = (i * 7 % 251) as u8;
    }
    // 128 WRITEs of 4 KiB into the region, in one batch.
    let writes: Vec<Op> = (0..128)
        .map(|i| op(OpKind::Write, i * 4096, reg.addr + i * 4096, reg.rkey, 4096))
        .collect();
    let b = r.nic.post(peer, &writes).unwrap();
    assert_eq!(r.nic.wait(b, T), BatchState::Done);
    assert_eq!(&r.region[..512 * 1024], &r.staging[..512 * 1024]);
    // READ them back into the other half of staging.
    let reads: Vec<Op> = (0..128)
        .map(|i| {
            op(
                OpKind::Read,
                512 * 1024 + i * 4096,
                reg.addr + i * 4096,
                reg.rkey,
                4096,
            )
        })
        .collect();
    let b = r.nic.post(peer, &reads).unwrap();
    assert_eq!(r.nic.wait(b, T), BatchState::Done);
    let (a, c) = r.staging.split_at(512 * 1024);
    assert_eq!(a, &c[..512 * 1024]);
    r.nic.forget(b);
    assert!(matches!(
        r.nic.state(b),
        BatchState::Failed(TransportError::NoBatch(_))
    ));
    assert_eq!(r.target.stats().ops, 256);
}

/// Bulk payloads (read with a raised receive low-water mark on both sides): rounds of
/// 32 WRITEs and 32 READs of 256 KiB and of 2 MiB in flight, every byte checked.
#[test]
fn large_chunks_many_in_flight_keep_every_byte() {
    for (chunk, rounds) in [(256usize << 10, 24usize), (2 << 20, 3)] {
        let n = 32;
        let half = n * chunk;
        let mut r = rig(None, half, 2 * half);
        let (reg, peer) = r.connected();
        for round in 0..rounds {
            for (i, b) in r.staging[..half].iter_mut().enumerate() {
                *b = (i * 13 + i / 4093 + round * 31) as u8;
            }
            let ops = |kind, base: usize| -> Vec<Op> {
                (0..n)
                    .map(|i| {
                        let (l, a) = ((base + i * chunk) as u64, (i * chunk) as u64);
                        op(kind, l, reg.addr + a, reg.rkey, chunk as u64)
                    })
                    .collect()
            };
            let b = r.nic.post(peer, &ops(OpKind::Write, 0)).unwrap();
            assert_eq!(r.nic.wait(b, T), BatchState::Done, "writes, round {round}");
            r.nic.forget(b);
            let b = r.nic.post(peer, &ops(OpKind::Read, half)).unwrap();
            assert_eq!(r.nic.wait(b, T), BatchState::Done, "reads, round {round}");
            r.nic.forget(b);
            let (sent, back) = r.staging.split_at(half);
            assert!(
                sent == back,
                "{chunk}-byte chunks came back changed in round {round}"
            );
            assert!(r.region[..] == *sent, "{chunk}-byte chunks landed changed");
        }
    }
}

#[test]
fn a_write_after_deregistration_fails_and_writes_nothing() {
    let mut r = rig(None, 64 * 1024, 64 * 1024);
    let (reg, peer) = r.connected();
    r.staging.fill(0xAB);
    r.target.deregister(reg.rkey).unwrap();
    let b = r
        .nic
        .post(peer, &[op(OpKind::Write, 0, reg.addr, reg.rkey, 4096)])
        .unwrap();
    assert!(matches!(
        r.nic.wait(b, T),
        BatchState::Failed(TransportError::BadKey { .. })
    ));
    assert!(
        r.region.iter().all(|&x| x == 0),
        "a late WRITE must not land"
    );
    // The connection keeps working for valid keys.
    let reg2 = r.register_all();
    assert_ne!(reg2.rkey, reg.rkey);
    let b = r
        .nic
        .post(peer, &[op(OpKind::Write, 0, reg2.addr, reg2.rkey, 4096)])
        .unwrap();
    assert_eq!(r.nic.wait(b, T), BatchState::Done);
    assert!(r.region[..4096].iter().all(|&x| x == 0xAB));
}

#[test]
fn unknown_key_range_and_read_only_are_refused() {
    let mut r = rig(None, 64 * 1024, 64 * 1024);
    let ro = unsafe {
        r.target
            .register(1, r.region.as_mut_ptr(), 32 * 1024, false)
    }
    .unwrap();
    let peer = r.nic.connect(&ro.transport, &mut no_bringup).unwrap();
    r.staging.fill(1);
    let cases = [
        op(OpKind::Write, 0, ro.addr, ro.rkey ^ 2, 16),
        op(OpKind::Write, 0, ro.addr, ro.rkey, 16),
        op(OpKind::Read, 0, ro.addr + 32 * 1024 - 8, ro.rkey, 16),
        op(OpKind::Read, 0, ro.addr.wrapping_sub(8), ro.rkey, 16),
    ];
    for c in cases {
        let b = r.nic.post(peer, &[c]).unwrap();
        assert!(matches!(r.nic.wait(b, T), BatchState::Failed(_)), "{c:?}");
    }
    assert!(r.region.iter().all(|&x| x == 0));
    assert_eq!(r.target.stats().rejected, 4);
    // Reads within range of a read-only registration work.
    let b = r
        .nic
        .post(peer, &[op(OpKind::Read, 0, ro.addr, ro.rkey, 16)])
        .unwrap();
    assert_eq!(r.nic.wait(b, T), BatchState::Done);
    // A local range outside the staging buffer is refused before anything is sent.
    assert!(matches!(
        r.nic.post(
            peer,
            &[op(OpKind::Read, 64 * 1024 - 8, ro.addr, ro.rkey, 16)]
        ),
        Err(TransportError::LocalRange { .. })
    ));
}

#[test]
fn fence_stops_the_peer() {
    let mut r = rig(None, 64 * 1024, 64 * 1024);
    let (reg, peer) = r.connected();
    r.nic.fence(peer).unwrap();
    assert!(matches!(
        r.nic
            .post(peer, &[op(OpKind::Read, 0, reg.addr, reg.rkey, 16)]),
        Err(TransportError::NoPeer(_))
    ));
    // Connecting again gives a working peer.
    let again = r.nic.connect(&reg.transport, &mut no_bringup).unwrap();
    assert_ne!(again, peer);
    let b = r
        .nic
        .post(again, &[op(OpKind::Read, 0, reg.addr, reg.rkey, 16)])
        .unwrap();
    assert_eq!(r.nic.wait(b, T), BatchState::Done);
}

#[test]
fn a_lost_responder_fails_pending_batches() {
    let mut r = rig(None, 64 * 1024, 64 * 1024);
    let (reg, peer) = r.connected();
    r.target.shutdown();
    // Give the reader a moment to see the close, then every post fails.
    let mut failed = false;
    for _ in 0..100 {
        match r
            .nic
            .post(peer, &[op(OpKind::Read, 0, reg.addr, reg.rkey, 16)])
        {
            Ok(b) => {
                if let BatchState::Failed(_) = r.nic.wait(b, T) {
                    failed = true;
                    break;
                }
            }
            Err(_) => {
                failed = true;
                break;
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(failed, "operations on a closed responder fail");
    r.nic.fence(peer).unwrap();
}

#[test]
fn the_data_connection_proves_the_key() {
    let key = SharedKey::generate().unwrap();
    let mut r = rig(Some(key), 4096, 4096);
    let reg = unsafe { r.target.register(1, r.region.as_mut_ptr(), 4096, true) }.unwrap();
    assert!(r.nic.connect(&reg.transport, &mut no_bringup).is_ok());
    // A worker with another key, and one with none.
    for (name, key) in [
        ("intruder", Some(SharedKey::generate().unwrap())),
        ("nokey", None),
    ] {
        let mut staging = vec![0u8; 4096];
        let nic = staged(SoftTransport::new(name, key), &mut staging);
        assert!(
            matches!(
                nic.connect(&reg.transport, &mut no_bringup),
                Err(TransportError::Setup(_))
            ),
            "{name}"
        );
    }
}

#[test]
fn refused_and_closed_data_connections_are_closed_and_forgotten() {
    use std::io::{Read, Write};
    let key = SharedKey::generate().unwrap();
    let mut r = rig(Some(key), 4096, 4096);
    let reg = unsafe { r.target.register(1, r.region.as_mut_ptr(), 4096, true) }.unwrap();
    let addr = reg.transport["soft"]["addr"].as_str().unwrap().to_string();
    // A peer that skips the handshake is refused and sees the connection end at
    // once (not when some timeout fires), and no descriptor stays behind.
    let mut s = std::net::TcpStream::connect(&addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    s.write_all(&[2, 0, 0, 0, 0, 0, 0, 0]).unwrap();
    let mut got = Vec::new();
    let t = std::time::Instant::now();
    s.read_to_end(&mut got)
        .expect("the NIC closes a refused connection");
    assert!(t.elapsed() < Duration::from_secs(3));
    // A worker that connects and goes away leaves nothing open either.
    let peer = r.nic.connect(&reg.transport, &mut no_bringup).unwrap();
    assert!(wait_for(|| r.target.stats().connections == 1));
    r.nic.fence(peer).unwrap();
    assert!(
        wait_for(|| r.target.stats().connections == 0),
        "{} data connections still open",
        r.target.stats().connections
    );
}

fn wait_for(mut f: impl FnMut() -> bool) -> bool {
    let deadline = std::time::Instant::now() + T;
    while std::time::Instant::now() < deadline {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    f()
}

/// A key works only on data connections of the owner it was registered for: worker B,
/// with the agent key and its own binding, presenting worker A's key (address and
/// all) gets a bad-key completion, and nothing of A's region is written or read.
#[test]
fn a_key_of_another_owner_is_refused_as_a_remote_access_error() {
    let mut r = rig(None, 64 * 1024, 64 * 1024);
    let mut region_b = vec![0u8; 4096];
    let a = unsafe { r.target.register(1, r.region.as_mut_ptr(), 64 * 1024, true) }.unwrap();
    let b = unsafe { r.target.register(2, region_b.as_mut_ptr(), 4096, true) }.unwrap();
    assert_ne!(a.transport, b.transport, "each owner has its own binding");
    let mut staging_b = vec![0x5Au8; 4096];
    let nic_b = staged(SoftTransport::new("worker-b", None), &mut staging_b);
    let peer_b = nic_b.connect(&b.transport, &mut no_bringup).unwrap();
    // B's own key works on B's connection.
    let ok = nic_b
        .post(peer_b, &[op(OpKind::Write, 0, b.addr, b.rkey, 16)])
        .unwrap();
    assert_eq!(nic_b.wait(ok, T), BatchState::Done);
    for kind in [OpKind::Write, OpKind::Read] {
        let bad = nic_b
            .post(peer_b, &[op(kind, 0, a.addr, a.rkey, 4096)])
            .unwrap();
        assert!(
            matches!(
                nic_b.wait(bad, T),
                BatchState::Failed(TransportError::BadKey { .. })
            ),
            "{kind:?} with another owner's key"
        );
    }
    assert!(
        r.region.iter().all(|&x| x == 0),
        "nothing of A's region written"
    );
    assert!(
        staging_b[16..].iter().all(|&x| x == 0x5A),
        "nothing of A's region read"
    );
    // A's own worker still uses its key.
    worker_writes(&r, &a);
    drop(region_b);
}

/// A binding secret never issued binds nothing: the connection is refused.
#[test]
fn a_forged_binding_is_refused() {
    let mut r = rig(None, 4096, 4096);
    let reg = unsafe { r.target.register(1, r.region.as_mut_ptr(), 4096, true) }.unwrap();
    let mut meta = reg.transport.clone();
    meta["soft"]["bind"] = serde_json::json!(format!("{:032x}", 12345u128));
    assert!(matches!(
        r.nic.connect(&meta, &mut no_bringup),
        Err(TransportError::Setup(_))
    ));
}

/// When the owner's agent connection closes, its data connections close too (as the
/// verbs target destroys its queue pairs) and its binding is no longer accepted.
#[test]
fn a_closed_owner_loses_its_data_connections_and_binding() {
    let mut r = rig(None, 4096, 4096);
    let reg = unsafe { r.target.register(7, r.region.as_mut_ptr(), 4096, true) }.unwrap();
    let peer = r.nic.connect(&reg.transport, &mut no_bringup).unwrap();
    assert!(wait_for(|| r.target.stats().connections == 1));
    r.target.owner_closed(7);
    assert!(wait_for(|| r.target.stats().connections == 0));
    let b = r
        .nic
        .post(peer, &[op(OpKind::Write, 0, reg.addr, reg.rkey, 16)]);
    if let Ok(b) = b {
        assert!(matches!(r.nic.wait(b, T), BatchState::Failed(_)));
    }
    let mut st = vec![0u8; 4096];
    let again = staged(SoftTransport::new("again", None), &mut st);
    assert!(again.connect(&reg.transport, &mut no_bringup).is_err());
    r.target.deregister(reg.rkey).unwrap();
}

/// How long a READ posted while another thread's WRITE is stuck mid-payload on the
/// same peer takes to complete, with `lanes` data connections per peer.
fn read_beside_a_stalled_write(lanes: u8) -> (Duration, usize) {
    let mut r = rig(None, 1 << 20, 1 << 20);
    let reg = r.register_all();
    let nic = staged(
        SoftTransport::new("lanes", None).with_lanes(lanes),
        &mut r.staging,
    );
    let peer = nic.connect(&reg.transport, &mut no_bringup).unwrap();
    assert_eq!(
        nic.connect(&reg.transport, &mut no_bringup).unwrap(),
        peer,
        "the same peer while its lanes are usable"
    );
    assert!(wait_for(
        || r.target.stats().connections == usize::from(lanes)
    ));
    let connections = r.target.stats().connections;
    nic.inject_payload_stall(Duration::from_millis(1500));
    let read_took = std::thread::scope(|s| {
        let nic = &nic;
        let writer = s.spawn(move || {
            let b = nic
                .post(peer, &[op(OpKind::Write, 0, reg.addr, reg.rkey, 4096)])
                .unwrap();
            nic.wait(b, T)
        });
        // The WRITE's header is out and its payload held back on its lane.
        std::thread::sleep(Duration::from_millis(200));
        let t = std::time::Instant::now();
        let b = nic
            .post(
                peer,
                &[op(OpKind::Read, 8192, reg.addr + 8192, reg.rkey, 4096)],
            )
            .unwrap();
        assert_eq!(nic.wait(b, T), BatchState::Done);
        let took = t.elapsed();
        assert_eq!(writer.join().unwrap(), BatchState::Done);
        took
    });
    // A fence closes every lane of the peer.
    nic.fence(peer).unwrap();
    assert!(
        wait_for(|| r.target.stats().connections == 0),
        "{} data connections still open after the fence",
        r.target.stats().connections
    );
    assert!(matches!(
        nic.post(peer, &[op(OpKind::Read, 0, reg.addr, reg.rkey, 16)]),
        Err(TransportError::NoPeer(_))
    ));
    (read_took, connections)
}

/// With two lanes, a batch goes on the lane with fewer operations in flight: a READ
/// posted while another thread's WRITE is stuck on one connection completes at once on
/// the other. With one lane it waits for the stuck WRITE (the contrast that shows the
/// test sees lanes at all).
#[test]
fn batches_of_one_peer_spread_over_its_lanes_and_a_fence_closes_every_lane() {
    let (two, conns) = read_beside_a_stalled_write(2);
    assert_eq!(conns, 2, "one data connection per lane");
    assert!(
        two < Duration::from_millis(700),
        "a READ beside a stalled WRITE took {two:?} with two lanes"
    );
    let (one, conns) = read_beside_a_stalled_write(1);
    assert_eq!(conns, 1);
    assert!(
        one >= Duration::from_millis(1000),
        "with one lane the READ queues behind the WRITE, took {one:?}"
    );
}

/// A raw data connection that finished its handshake (key proved when `key` is
/// given), not bound yet: the stream and the bytes read past the handshake.
fn proven(addr: &str, key: Option<&SharedKey>) -> (std::net::TcpStream, Vec<u8>) {
    let mut opts = crate::net::ClientOptions::new(super::proto::SERVICE, "raw");
    opts.key = key.cloned();
    opts.connect_timeout = T;
    let c = crate::net::Client::connect(addr, &opts).expect("a proven data connection");
    let (s, head) = c.into_parts();
    s.set_read_timeout(Some(T)).unwrap();
    (s, head)
}

/// The binding secret of a registration's transport metadata.
fn secret(reg: &crate::transport::Registration) -> u128 {
    u128::from_str_radix(reg.transport["soft"]["bind"].as_str().unwrap(), 16).unwrap()
}

/// Sends one request on a raw data connection and reads its completion.
fn call(
    s: &mut std::net::TcpStream,
    head: &mut Vec<u8>,
    req: super::proto::Request,
    payload: &[u8],
) -> super::proto::Completion {
    use std::io::{Read, Write};
    let mut bytes = req.encode().to_vec();
    bytes.extend_from_slice(payload);
    s.write_all(&bytes).unwrap();
    let mut c = [0u8; super::proto::CPL_LEN];
    let from_head = head.len().min(c.len());
    c[..from_head].copy_from_slice(&head[..from_head]);
    head.drain(..from_head);
    s.read_exact(&mut c[from_head..]).unwrap();
    super::proto::Completion::decode(&c)
}

fn bind_req(seq: u64, secret: u128) -> super::proto::Request {
    super::proto::Request {
        op: super::proto::OP_BIND,
        seq,
        addr: (secret >> 64) as u64,
        rkey: secret as u64,
        len: 0,
    }
}

/// A data connection bound to one owner stays that owner's: a BIND with another
/// owner's secret (which a worker holding two agent connections knows) is refused,
/// and the other owner's key still fails on it with nothing written. Binding to its
/// own owner again changes nothing.
#[test]
fn a_bound_data_connection_cannot_rebind_to_another_owner() {
    use super::proto::{Request, OP_WRITE, ST_BAD_KEY, ST_OK};
    let key = SharedKey::generate().unwrap();
    let mut r = rig(Some(key.clone()), 4096, 4096);
    let mut region_b = vec![0u8; 4096];
    let a = unsafe { r.target.register(1, r.region.as_mut_ptr(), 4096, true) }.unwrap();
    let b = unsafe { r.target.register(2, region_b.as_mut_ptr(), 4096, true) }.unwrap();
    let addr = a.transport["soft"]["addr"].as_str().unwrap().to_string();
    let (mut s, mut head) = proven(&addr, Some(&key));
    assert_eq!(
        call(&mut s, &mut head, bind_req(1, secret(&a)), &[]).status,
        ST_OK
    );
    assert_eq!(
        call(&mut s, &mut head, bind_req(2, secret(&a)), &[]).status,
        ST_OK,
        "its own owner again"
    );
    assert_eq!(
        call(&mut s, &mut head, bind_req(3, secret(&b)), &[]).status,
        ST_BAD_KEY,
        "a bound connection rebound to another owner"
    );
    let write_b = Request {
        op: OP_WRITE,
        seq: 4,
        addr: b.addr,
        rkey: b.rkey,
        len: 16,
    };
    assert_eq!(
        call(&mut s, &mut head, write_b, &[0xEE; 16]).status,
        ST_BAD_KEY
    );
    assert!(region_b.iter().all(|&x| x == 0), "B's region was written");
    // A's own key still works on it.
    let write_a = Request {
        op: OP_WRITE,
        seq: 5,
        addr: a.addr,
        rkey: a.rkey,
        len: 16,
    };
    assert_eq!(call(&mut s, &mut head, write_a, &[0xAA; 16]).status, ST_OK);
    assert!(r.region[..16].iter().all(|&x| x == 0xAA));
    drop(s);
    r.target.deregister(a.rkey).unwrap();
    r.target.deregister(b.rkey).unwrap();
    drop(region_b);
}

/// One owner binds at most `MAX_PER_OWNER` data connections: the next BIND completes
/// with `ST_LIMIT`, another owner still binds, and a slot freed by a closed connection
/// can be bound again.
#[test]
fn an_owner_binds_at_most_its_cap_of_data_connections() {
    use super::proto::{ST_LIMIT, ST_OK};
    use super::target::table::MAX_PER_OWNER;
    let mut r = rig(None, 4096, 4096);
    let mut region_b = vec![0u8; 4096];
    let a = unsafe { r.target.register(1, r.region.as_mut_ptr(), 4096, true) }.unwrap();
    let b = unsafe { r.target.register(2, region_b.as_mut_ptr(), 4096, true) }.unwrap();
    let addr = a.transport["soft"]["addr"].as_str().unwrap().to_string();
    let mut held = Vec::new();
    for i in 0..MAX_PER_OWNER {
        let (mut s, mut head) = proven(&addr, None);
        let c = call(&mut s, &mut head, bind_req(1, secret(&a)), &[]);
        assert_eq!(c.status, ST_OK, "binding {i} of {MAX_PER_OWNER}");
        held.push(s);
    }
    let (mut extra, mut head) = proven(&addr, None);
    assert_eq!(
        call(&mut extra, &mut head, bind_req(1, secret(&a)), &[]).status,
        ST_LIMIT
    );
    let (mut other, mut head_b) = proven(&addr, None);
    assert_eq!(
        call(&mut other, &mut head_b, bind_req(1, secret(&b)), &[]).status,
        ST_OK,
        "another owner is not held back"
    );
    assert!(wait_for(
        || r.target.stats().connections == MAX_PER_OWNER + 2
    ));
    drop(held.pop());
    assert!(wait_for(
        || r.target.stats().connections == MAX_PER_OWNER + 1
    ));
    let mut seq = 2;
    let bound_again = wait_for(|| {
        seq += 1;
        call(&mut extra, &mut head, bind_req(seq, secret(&a)), &[]).status == ST_OK
    });
    assert!(bound_again, "the closed connection's slot is free again");
    drop((held, extra, other));
    r.target.deregister(a.rkey).unwrap();
    r.target.deregister(b.rkey).unwrap();
    drop(region_b);
}

/// Whether the peer closed `s` within `limit`.
fn closed_within(s: &mut std::net::TcpStream, limit: Duration) -> bool {
    use std::io::Read;
    let deadline = std::time::Instant::now() + limit;
    let mut buf = [0u8; 256];
    while std::time::Instant::now() < deadline {
        s.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => return true,
        }
    }
    false
}

/// A rig whose NIC wants a key, with one registration of owner 1 over its region:
/// the rig, the key, the registration and the NIC's address.
fn keyed_rig() -> (Rig, SharedKey, crate::transport::Registration, String) {
    let key = SharedKey::generate().unwrap();
    let mut r = rig(Some(key.clone()), 4096, 4096);
    // SAFETY: the region lives in the rig, which outlives the registration.
    let reg = unsafe { r.target.register(1, r.region.as_mut_ptr(), 4096, true) }.unwrap();
    let addr = reg.transport["soft"]["addr"].as_str().unwrap().to_string();
    (r, key, reg, addr)
}

/// The rig's worker connects to `reg` and writes 16 bytes: its peer.
fn worker_writes(r: &Rig, reg: &crate::transport::Registration) -> crate::transport::PeerId {
    let peer = r.nic.connect(&reg.transport, &mut no_bringup).unwrap();
    let w = r
        .nic
        .post(peer, &[op(OpKind::Write, 0, reg.addr, reg.rkey, 16)])
        .unwrap();
    assert_eq!(r.nic.wait(w, T), BatchState::Done);
    peer
}

/// The first `n` of `conns` (the oldest) are closed within a second.
fn oldest_pushed_out(conns: &mut [std::net::TcpStream], n: usize, what: &str) {
    for (i, s) in conns.iter_mut().take(n).enumerate() {
        assert!(
            closed_within(s, Duration::from_secs(1)),
            "{what} {i}, among the oldest, was not pushed out"
        );
    }
}

/// Proven connections that never bind hold no slot for long: past `MAX_UNBOUND` the
/// oldest is pushed out at once, and the rest are closed at the bind deadline; a
/// worker connects and binds among them.
#[test]
fn proven_connections_that_never_bind_are_pushed_out_and_closed_at_the_deadline() {
    use super::target::table::{BIND_DEADLINE, MAX_UNBOUND};
    let (r, key, reg, addr) = keyed_rig();
    let start = std::time::Instant::now();
    let mut idle: Vec<_> = (0..MAX_UNBOUND + 8)
        .map(|_| proven(&addr, Some(&key)).0)
        .collect();
    assert!(wait_for(|| r.target.stats().unbound == MAX_UNBOUND as u64));
    oldest_pushed_out(&mut idle, 8, "unbound connection");
    let peer = worker_writes(&r, &reg);
    for s in idle.iter_mut().skip(8) {
        let left = (BIND_DEADLINE + Duration::from_secs(3)).saturating_sub(start.elapsed());
        assert!(
            closed_within(s, left),
            "an unbound connection outlived the bind deadline"
        );
    }
    assert!(
        start.elapsed() >= BIND_DEADLINE - Duration::from_millis(500),
        "closed before the deadline"
    );
    assert!(
        wait_for(|| {
            let st = r.target.stats();
            (st.unbound, st.connections) == (0, 1)
        }),
        "{:?}: only the worker's lane stays",
        r.target.stats()
    );
    r.nic.fence(peer).unwrap();
    r.target.deregister(reg.rkey).unwrap();
}

/// Connections that never finish their handshake hold no slot a worker needs: past
/// `MAX_PENDING` a new one pushes out the oldest at once (it used to be the new one
/// that was closed at accept, so a steady flood kept every worker out), and a worker
/// connects while they keep coming.
#[test]
fn a_flood_of_silent_connections_pushes_out_its_oldest_and_lets_a_worker_in() {
    use super::target::table::MAX_PENDING;
    let (r, _key, reg, addr) = keyed_rig();
    let mut flood: Vec<std::net::TcpStream> = (0..MAX_PENDING + 16)
        .map(|_| std::net::TcpStream::connect(&addr).unwrap())
        .collect();
    assert!(wait_for(|| r.target.stats().pending == MAX_PENDING as u64));
    oldest_pushed_out(&mut flood, 16, "silent connection");
    let peer = worker_writes(&r, &reg);
    drop(flood);
    r.nic.fence(peer).unwrap();
    r.target.deregister(reg.rkey).unwrap();
}
