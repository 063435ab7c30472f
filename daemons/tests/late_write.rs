//! A WRITE the old owner posted before it gave its region back, and that reaches the
//! memory node only after the release, never changes the bytes of the region's next
//! owner (DESIGN.md: "a late WRITE from an old owner fails at the NIC (key check)").
//!
//! RM and agent are real processes on loopback with a fake-DAX file; the old owner's
//! soft transport holds its WRITE back (delay injection) while the owner releases and
//! frees the region, a new owner gets the same device range and writes it, and only
//! then does the old WRITE go out.

mod support;

use maru::auth::SharedKey;
use maru::net::Client;
use maru::transport::soft::SoftTransport;
use maru::transport::{no_bringup, BatchState, LocalBuffer, Op, OpKind, Transport, TransportError};
use maru::wire::agent::{AgentReply, AgentRequest, MapReply};
use maru::wire::rm::{Handle, RmReply, RmRequest, SERVICE as RM};
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};
use support::{agent_client, connect, map_writable as map, wait_until, Daemon, Scratch};

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
/// (allocating and freeing at the RM).
struct Node {
    pool: std::path::PathBuf,
    key: SharedKey,
    agent: Daemon,
    _rm_d: Daemon,
    rm: Client,
    /// Last: removed after the daemons are gone.
    _s: Scratch,
}

fn node() -> Node {
    let mut s = Scratch::new("late-write");
    let support::MemoryNode {
        pool,
        key_path: _,
        key,
        agent,
        rm: rm_d,
    } = support::memory_node(&mut s, "64M");
    let rm = connect(&rm_d.addr, RM, "maru-server-test");

    Node {
        _s: s,
        pool,
        key,
        agent,
        _rm_d: rm_d,
        rm,
    }
}

/// The owner's way of giving a region back: release at the agent (deregistration),
/// then free at the RM, which reuses the range once nothing holds it.
fn give_back(n: &mut Node, owner: &mut Client, h: &Handle) {
    let rel: AgentReply = owner
        .call(&AgentRequest::Release { handle: h.clone() })
        .expect("release");
    assert_eq!(rel, AgentReply::Released { deregistered: true });
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

/// The bytes of the pool's device at `offset`.
fn device_bytes(n: &Node, offset: u64, len: usize) -> Vec<u8> {
    let f = std::fs::File::open(&n.pool).unwrap();
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
    let mut agent = agent_client(&n.agent.addr, &n.key, id);
    let map = map(&mut agent, &region);
    let mut staging = vec![fill; MIB as usize];
    let nic = SoftTransport::new(id, Some(n.key.clone()));
    nic.register_local(LocalBuffer {
        ptr: staging.as_mut_ptr(),
        len: staging.len(),
    })
    .unwrap();
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
    let Owner {
        region: old,
        agent: mut a,
        map: ma,
        staging: staging_a,
        nic: nic_a,
        peer: peer_a,
    } = old_owner(&mut n);
    nic_a.inject_write_delay(DELAY);
    let posted = Instant::now();
    let late = std::thread::scope(|scope| {
        let nic = &nic_a;
        let w = write_op(&ma, MIB);
        let poster = scope.spawn(move || {
            let b = nic.post(peer_a, &[w]).expect("post");
            nic.wait(b, T)
        });
        // Give the poster time to be inside post with its WRITE queued.
        std::thread::sleep(Duration::from_millis(100));

        give_back(&mut n, &mut a, &old);

        // The next owner gets the same device range and writes its own bytes.
        let new = alloc(&mut n.rm);
        assert_eq!(
            (new.offset, new.length),
            (old.offset, old.length),
            "the RM reused the range (else this test shows nothing)"
        );
        let Owner {
            agent: _b,
            map: mb,
            staging: mut staging_b,
            nic: nic_b,
            peer: peer_b,
            ..
        } = new_owner(&n, new.clone());
        let done = nic_b.post(peer_b, &[write_op(&mb, MIB)]).unwrap();
        assert_eq!(nic_b.wait(done, T), BatchState::Done);
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
        staging_b.fill(0);
        let rd = Op {
            kind: OpKind::Read,
            ..write_op(&mb, MIB)
        };
        let got = nic_b.post(peer_b, &[rd]).unwrap();
        assert_eq!(nic_b.wait(got, T), BatchState::Done);
        assert!(staging_b.iter().all(|&x| x == 0x5A));
        late
    });
    assert!(
        matches!(late, BatchState::Failed(TransportError::BadKey { .. })),
        "the late WRITE fails at the key check, got {late:?}"
    );
    drop(staging_a);
    drop(n);
}

#[test]
fn a_write_in_flight_at_release_lands_before_the_release_returns_never_after() {
    // The old owner's WRITE has started at the NIC (its header arrived) but its data
    // is slow: the release must wait for it (deregistration waits for operations on
    // the key), so it lands in the old owner's tenure and never in the next owner's.
    let mut n = node();
    let Owner {
        region: old,
        agent: mut a,
        map: ma,
        staging: staging_a,
        nic: nic_a,
        peer: peer_a,
    } = old_owner(&mut n);
    let stall = Duration::from_millis(1500);
    nic_a.inject_payload_stall(stall);
    let posted = Instant::now();
    let (in_flight, released_after) = std::thread::scope(|scope| {
        let nic = &nic_a;
        let w = write_op(&ma, MIB);
        let poster = scope.spawn(move || {
            let b = nic.post(peer_a, &[w]).expect("post");
            nic.wait(b, T)
        });
        // The header is at the NIC, the payload is not.
        std::thread::sleep(Duration::from_millis(300));
        let rel: AgentReply = a
            .call(&AgentRequest::Release {
                handle: old.clone(),
            })
            .expect("release");
        assert_eq!(rel, AgentReply::Released { deregistered: true });
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
    match n
        .rm
        .call(&RmRequest::Free {
            handle: old.clone(),
            request_id: 0,
        })
        .expect("free")
    {
        RmReply::Free(_) => {}
        r => panic!("{r:?}"),
    }
    assert!(wait_until(T, || regions(&mut n.rm) == 0 && holds(&mut n.rm) == 0));

    // The next owner gets the range and writes; nothing of the old WRITE comes after.
    let new = alloc(&mut n.rm);
    assert_eq!((new.offset, new.length), (old.offset, old.length));
    let Owner {
        agent: _b,
        map: mb,
        staging: staging_b,
        nic: nic_b,
        peer: peer_b,
        ..
    } = new_owner(&n, new.clone());
    let done = nic_b.post(peer_b, &[write_op(&mb, MIB)]).unwrap();
    assert_eq!(nic_b.wait(done, T), BatchState::Done);
    // The old owner's next WRITE on the same connection is refused at the key check.
    nic_a.inject_payload_stall(Duration::ZERO);
    let again = nic_a.post(peer_a, &[write_op(&ma, MIB)]).unwrap();
    assert!(matches!(
        nic_a.wait(again, T),
        BatchState::Failed(TransportError::BadKey { .. })
    ));
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        device_bytes(&n, new.offset, MIB as usize)
            .iter()
            .all(|&x| x == 0x5A),
        "the next owner's bytes are unchanged"
    );
    drop(staging_a);
    drop(staging_b);
    drop(n);
}
