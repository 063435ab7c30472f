//! A WRITE the old owner posted before it gave its region back, and that reaches the
//! memory node only after the release, never changes the bytes of the region's next
//! owner (DESIGN.md: "a late WRITE from an old owner fails at the NIC (key check)").
//!
//! RM and agent are real processes on loopback with a fake-DAX file; the old owner's
//! soft transport holds its WRITE back (delay injection) while the owner releases and
//! frees the region, a new owner gets the same device range and writes it, and only
//! then does the old WRITE go out.

mod support;

use maru::net::Client;
use maru::transport::soft::SoftTransport;
use maru::transport::{no_bringup, BatchState, Op, OpKind, Transport, TransportError};
use maru::wire::agent::{AgentReply, AgentRequest, MapReply};
use maru::wire::rm::{Handle, RmReply, RmRequest, SERVICE as RM};
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};
use support::{agent_client, connect, map_writable as map, wait_until};

const MIB: u64 = 1 << 20;
const T: Duration = Duration::from_secs(10);
/// How long the old owner's WRITE is held back: far longer than release, free,
/// allocation and the new owner's WRITE take on loopback (checked below).
const DELAY: Duration = Duration::from_secs(3);

fn alloc(rm: &mut Client) -> Handle {
    support::rm_alloc(rm, 4 * MIB)
}

fn regions(rm: &mut Client) -> usize {
    support::rm_regions(rm).len()
}

fn holds(rm: &mut Client) -> usize {
    support::rm_holds(rm).len()
}

fn write_op(m: &MapReply, len: u64) -> Op {
    Op {
        kind: OpKind::Write,
        local_offset: 0,
        remote_addr: m.addr,
        rkey: m.rkey,
        len,
    }
}

/// RM and agent on loopback over a fake-DAX pool; `rm` plays maru-server's part
/// (allocating and freeing at the RM). Fields drop in order: the connection first.
struct Node {
    rm: Client,
    node: support::OwnNode,
}

fn node() -> Node {
    let node = support::own_node("late-write", "64M");
    let rm = connect(&node.rm.addr, RM, "maru-server-test");
    Node { rm, node }
}

/// The owner's way of giving a region back: release at the agent (deregistration),
/// then free at the RM, which reuses the range once nothing holds it.
fn give_back(n: &mut Node, owner: &mut Client, h: &Handle) {
    release(owner, h);
    free(n, h);
}

/// Releases `h` at the agent over `owner`: the agent deregisters it.
fn release(owner: &mut Client, h: &Handle) {
    let rel: AgentReply = owner
        .call(&AgentRequest::Release { handle: h.clone() })
        .expect("release");
    assert_eq!(rel, AgentReply::Released { deregistered: true });
}

/// Frees `h` at the RM (as maru-server does) and waits until it is gone, unheld.
fn free(n: &mut Node, h: &Handle) {
    match n
        .rm
        .call(&RmRequest::Free {
            handle: h.clone(),
            request_id: 0,
        })
        .expect("free")
    {
        RmReply::Free(_) => {}
        r => panic!("{r:?}"),
    }
    assert!(
        wait_until(T, || regions(&mut n.rm) == 0 && holds(&mut n.rm) == 0),
        "the freed region is gone at the RM, unheld"
    );
}

/// Posts a 1 MiB WRITE of the staging buffer behind `nic` into the region of `map`
/// (over `peer`) on a thread of `scope`, which returns how the WRITE ended.
fn post_write<'scope>(
    scope: &'scope std::thread::Scope<'scope, '_>,
    nic: &'scope SoftTransport,
    peer: maru::transport::PeerId,
    map: &MapReply,
) -> std::thread::ScopedJoinHandle<'scope, BatchState> {
    let w = write_op(map, MIB);
    scope.spawn(move || {
        let b = nic.post(peer, &[w]).expect("post");
        nic.wait(b, T)
    })
}

/// The bytes of the pool's device at `offset`.
fn device_bytes(n: &Node, offset: u64, len: usize) -> Vec<u8> {
    let f = std::fs::File::open(&n.node.pool).unwrap();
    let mut bytes = vec![0u8; len];
    f.read_exact_at(&mut bytes, offset).unwrap();
    bytes
}

/// An owner of a region: the region mapped at the agent under client `id`, a 1 MiB
/// staging buffer of `fill` registered with its own soft NIC, and its peer at the agent.
struct Owner {
    region: Handle,
    agent: Client,
    map: MapReply,
    /// Registered with `nic`: kept alive (and in place) while the NIC may use it.
    staging: Vec<u8>,
    nic: SoftTransport,
    peer: maru::transport::PeerId,
}

fn owner(n: &Node, region: Handle, id: &str, fill: u8) -> Owner {
    let mut agent = agent_client(&n.node.agent.addr, &n.node.key, id);
    let map = map(&mut agent, &region);
    let mut staging = vec![fill; MIB as usize];
    let nic = support::soft_nic(id, &n.node.key, &mut staging);
    let peer = nic.connect(&map.transport, &mut no_bringup).unwrap();
    Owner {
        region,
        agent,
        map,
        staging,
        nic,
        peer,
    }
}

/// The old owner: a fresh region, its staging buffer 0xEE.
fn old_owner(n: &mut Node) -> Owner {
    let region = alloc(&mut n.rm);
    owner(n, region, "worker-old", 0xEE)
}

/// The next owner of `region` (the old owner's range, given out again), staging 0x5A.
fn new_owner(n: &Node, region: Handle) -> Owner {
    owner(n, region, "worker-new", 0x5A)
}

#[test]
fn a_write_posted_before_release_that_lands_after_it_never_reaches_the_next_owner() {
    let mut n = node();
    // The old owner maps its region and posts a WRITE that the NIC holds back.
    let mut a = old_owner(&mut n);
    a.nic.inject_write_delay(DELAY);
    let posted = Instant::now();
    let late = std::thread::scope(|scope| {
        let poster = post_write(scope, &a.nic, a.peer, &a.map);
        // Give the poster time to be inside post with its WRITE queued.
        std::thread::sleep(Duration::from_millis(100));

        let old = a.region.clone();
        give_back(&mut n, &mut a.agent, &old);

        // The next owner gets the same device range and writes its own bytes.
        let new = alloc(&mut n.rm);
        assert_eq!(
            (new.offset, new.length),
            (old.offset, old.length),
            "the RM reused the range (else this test shows nothing)"
        );
        let mut b = new_owner(&n, new.clone());
        let done = b.nic.post(b.peer, &[write_op(&b.map, MIB)]).unwrap();
        assert_eq!(b.nic.wait(done, T), BatchState::Done);
        assert!(
            posted.elapsed() < DELAY,
            "release, free, new map and WRITE took {:?}, longer than the injected delay: \
             the old WRITE may have landed before the release, the test is inconclusive",
            posted.elapsed()
        );

        // Now the old WRITE goes out, and the NIC refuses its key.
        let late = poster.join().expect("poster thread");
        assert!(posted.elapsed() >= DELAY);
        let bytes = device_bytes(&n, new.offset, MIB as usize);
        assert!(
            bytes.iter().all(|&x| x == 0x5A),
            "the next owner's bytes are unchanged ({} bytes differ)",
            bytes.iter().filter(|&&x| x != 0x5A).count()
        );
        // And the new owner reads its own bytes back over the transport.
        b.staging.fill(0);
        let rd = Op {
            kind: OpKind::Read,
            ..write_op(&b.map, MIB)
        };
        let got = b.nic.post(b.peer, &[rd]).unwrap();
        assert_eq!(b.nic.wait(got, T), BatchState::Done);
        assert!(b.staging.iter().all(|&x| x == 0x5A));
        late
    });
    assert!(
        matches!(late, BatchState::Failed(TransportError::BadKey { .. })),
        "the late WRITE fails at the key check, got {late:?}"
    );
    drop(a);
    drop(n);
}

#[test]
fn a_write_in_flight_at_release_lands_before_the_release_returns_never_after() {
    // The old owner's WRITE has started at the NIC (its header arrived) but its data
    // is slow: the release must wait for it (deregistration waits for operations on
    // the key), so it lands in the old owner's tenure and never in the next owner's.
    let mut n = node();
    let mut a = old_owner(&mut n);
    let old = a.region.clone();
    let stall = Duration::from_millis(1500);
    a.nic.inject_payload_stall(stall);
    let posted = Instant::now();
    let (in_flight, released_after) = std::thread::scope(|scope| {
        let poster = post_write(scope, &a.nic, a.peer, &a.map);
        // The header is at the NIC, the payload is not.
        std::thread::sleep(Duration::from_millis(300));
        release(&mut a.agent, &old);
        let released_after = posted.elapsed();
        (poster.join().expect("poster thread"), released_after)
    });
    assert!(
        released_after >= stall,
        "the release returned after {released_after:?}, before the WRITE in flight ended ({stall:?})"
    );
    // The WRITE ended before the deregistration: it completed, in the old tenure.
    assert_eq!(in_flight, BatchState::Done);
    assert!(device_bytes(&n, old.offset, MIB as usize)
        .iter()
        .all(|&x| x == 0xEE));
    free(&mut n, &old);

    // The next owner gets the range and writes; nothing of the old WRITE comes after.
    let new = alloc(&mut n.rm);
    assert_eq!((new.offset, new.length), (old.offset, old.length));
    let b = new_owner(&n, new.clone());
    let done = b.nic.post(b.peer, &[write_op(&b.map, MIB)]).unwrap();
    assert_eq!(b.nic.wait(done, T), BatchState::Done);
    // The old owner's next WRITE on the same connection is refused at the key check.
    a.nic.inject_payload_stall(Duration::ZERO);
    let again = a.nic.post(a.peer, &[write_op(&a.map, MIB)]).unwrap();
    assert!(matches!(
        a.nic.wait(again, T),
        BatchState::Failed(TransportError::BadKey { .. })
    ));
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        device_bytes(&n, new.offset, MIB as usize)
            .iter()
            .all(|&x| x == 0x5A),
        "the next owner's bytes are unchanged"
    );
    drop((a, b));
    drop(n);
}
