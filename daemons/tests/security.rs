//! Security checks against real daemons on loopback that the other suites leave out:
//! no map/unmap/release (and no soft-NIC operation) without the key proof, release
//! only with the region's handle, read tokens bound to their region and range, a
//! read registration refuses WRITEs, loopback by default (and said so in --help),
//! maru-server refuses an agent key file others can read, units run unprivileged.
//! (Already covered elsewhere: wrong or missing key at the agent and RM,
//! agent_daemon.rs / rm_daemon.rs; key files others can read at the agent and RM.)

mod support;

use maru::auth::SharedKey;
use maru::net::{Client, ClientError};
use maru::transport::soft::proto::{Request, OP_WRITE};
use maru::transport::{no_bringup, BatchState, Op, OpKind, Transport, TransportError};
use maru::wire::agent::{AgentReply, AgentRequest, MappingState, ReadRange, SERVICE as AGENT};
use maru::wire::rm::{Handle, SERVICE as RM};
use maru::wire::{self, ErrorCode, FrameDecoder, FrameKind};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::time::Duration;
use support::{connect, map_writable as map, Daemon, AGENT_BIN, RM_BIN, SERVER_BIN};

const MIB: u64 = 1 << 20;
const T: Duration = Duration::from_secs(10);

type Node = support::OwnNode;

fn node() -> Node {
    support::own_node("security", "64M")
}

/// A node, a client of its RM (as maru-server, which allocates `N` regions of 4 MiB:
/// they stay allocated while it is connected) and a client of its agent as the owner
/// of the regions (`worker-a`), which maps none yet.
fn node_with_owner<const N: usize>() -> (Node, Client, Client, [Handle; N]) {
    let n = node();
    let mut rm = connect(&n.rm.addr, RM, "maru-server-test");
    let regions = std::array::from_fn(|_| support::rm_alloc(&mut rm, 4 * MIB));
    let owner = agent_client(&n, "worker-a");
    (n, rm, owner, regions)
}

fn agent_client(n: &Node, id: &str) -> Client {
    support::agent_client(&n.agent.addr, &n.key, id)
}

fn refused(r: Result<AgentReply, ClientError>) -> bool {
    matches!(r, Err(ClientError::Remote(e)) if e.code == ErrorCode::Refused || e.code == ErrorCode::Permission)
}

/// The agent's view of a region: (state, released, holders).
fn mapping(c: &mut Client, region_id: u64) -> Option<(MappingState, bool, Vec<String>)> {
    match c.call(&AgentRequest::Status).expect("status") {
        AgentReply::Status(s) => s
            .mappings
            .into_iter()
            .find(|m| m.region_id == region_id)
            .map(|m| (m.state, m.released, m.holders)),
        r => panic!("{r:?}"),
    }
}

/// Reads frames until an error frame or the end of the connection; true when no
/// reply frame came (the request was not served).
fn served_nothing(s: &mut TcpStream) -> bool {
    s.set_read_timeout(Some(T)).unwrap();
    let mut dec = FrameDecoder::new(wire::DEFAULT_MAX_FRAME);
    let mut buf = [0u8; 4096];
    loop {
        while let Ok(Some(f)) = dec.next_frame() {
            match f.kind {
                FrameKind::Reply => return false,
                FrameKind::Error => return true,
                _ => {}
            }
        }
        match s.read(&mut buf) {
            Ok(0) | Err(_) => return true,
            Ok(n) => dec.push(&buf[..n]),
        }
    }
}

fn hello(id: &str) -> Vec<u8> {
    let h = serde_json::json!({"service": AGENT, "version": wire::PROTOCOL_VERSION,
                               "client_id": id, "nonce": "ab".repeat(32)});
    wire::frame::encode(FrameKind::Handshake, h.to_string().as_bytes())
}

fn request(op: &AgentRequest) -> Vec<u8> {
    let env = wire::Envelope { id: 1, body: op };
    wire::frame::encode(FrameKind::Request, &wire::encode_json(&env))
}

#[test]
fn no_connection_maps_unmaps_or_releases_without_the_key_proof() {
    let (n, _rm, mut owner, [h]) = node_with_owner();
    map(&mut owner, &h);
    let before = mapping(&mut owner, h.region_id).expect("mapped");
    let ops = [
        AgentRequest::Release { handle: h.clone() },
        AgentRequest::Unmap {
            region_id: h.region_id,
        },
        AgentRequest::Map {
            handle: h.clone(),
            writable: true,
        },
    ];
    for op in &ops {
        // A request as the first frame.
        let mut s = TcpStream::connect(&n.agent.addr).unwrap();
        s.write_all(&request(op)).unwrap();
        assert!(
            served_nothing(&mut s),
            "{op:?} before any handshake was served"
        );
        // Hello, then the request instead of the proof.
        let mut s = TcpStream::connect(&n.agent.addr).unwrap();
        s.write_all(&hello("worker-a")).unwrap();
        s.write_all(&request(op)).unwrap();
        assert!(served_nothing(&mut s), "{op:?} without a proof was served");
        // Hello, a made-up proof, then the request.
        let mut s = TcpStream::connect(&n.agent.addr).unwrap();
        s.write_all(&hello("worker-a")).unwrap();
        let proof = serde_json::json!({"proof": "cd".repeat(32)}).to_string();
        s.write_all(&wire::frame::encode(FrameKind::Handshake, proof.as_bytes()))
            .unwrap();
        s.write_all(&request(op)).unwrap();
        assert!(
            served_nothing(&mut s),
            "{op:?} with a forged proof was served"
        );
    }
    assert_eq!(
        mapping(&mut owner, h.region_id),
        Some(before),
        "the mapping is as it was: live, not released, same holders"
    );
    assert_eq!(
        mapping(&mut owner, h.region_id).map(|m| (m.0, m.1)),
        Some((MappingState::Live, false))
    );
}

#[test]
fn the_soft_nic_serves_no_operation_without_the_key_proof() {
    let (n, _rm, mut owner, [h]) = node_with_owner();
    let m = map(&mut owner, &h);
    let data_addr = m.transport["soft"]["addr"]
        .as_str()
        .expect("soft.addr")
        .to_string();
    // A WRITE header with the right key and address, and its payload, on a data
    // connection that skipped the handshake.
    let mut s = TcpStream::connect(&data_addr).unwrap();
    s.set_read_timeout(Some(T)).unwrap();
    let req = Request {
        op: OP_WRITE,
        seq: 1,
        addr: m.addr,
        rkey: m.rkey,
        len: 4096,
    };
    let _ = s.write_all(&req.encode());
    let _ = s.write_all(&[0xAB; 4096]);
    let mut got = Vec::new();
    let _ = s.read_to_end(&mut got);
    // The NIC answers with a protocol error frame (or nothing) and closes: never a
    // completion.
    if !got.is_empty() {
        let mut dec = FrameDecoder::new(wire::DEFAULT_MAX_FRAME);
        dec.push(&got);
        let f = dec.next_frame().expect("a frame").expect("a whole frame");
        assert_eq!(f.kind, FrameKind::Error, "{got:?}");
    }
    // A wrong key cannot open a data connection at all.
    let mut staging = vec![0u8; 4096];
    let nic = support::soft_nic("intruder", &SharedKey::generate().unwrap(), &mut staging);
    assert!(matches!(
        nic.connect(&m.transport, &mut no_bringup),
        Err(TransportError::Setup(_))
    ));
    let f = std::fs::File::open(&n.pool).unwrap();
    let mut bytes = vec![0u8; 4096];
    f.read_exact_at(&mut bytes, h.offset).unwrap();
    assert!(bytes.iter().all(|&b| b != 0xAB), "nothing was written");
}

#[test]
fn release_needs_the_regions_handle() {
    let (n, _rm, mut owner, [h, other]) = node_with_owner();
    map(&mut owner, &h);
    let mut intruder = agent_client(&n, "worker-b");
    let mut forged = h.clone();
    forged.token = "00".repeat(16);
    // Another region's token (a handle the caller does hold) does not open this one.
    let mut swapped = h.clone();
    swapped.token = other.token.clone();
    // A handle with the right token and a changed range is not this region's either.
    let mut widened = h.clone();
    widened.length *= 2;
    for (how, handle) in [
        ("forged", forged),
        ("swapped", swapped),
        ("widened", widened),
    ] {
        let r = intruder.call(&AgentRequest::Release { handle });
        assert!(refused(r), "a {how} handle released the region");
    }
    assert_eq!(
        mapping(&mut owner, h.region_id).map(|m| (m.0, m.1)),
        Some((MappingState::Live, false)),
        "still live, not released"
    );
    let r: AgentReply = owner
        .call(&AgentRequest::Release { handle: h.clone() })
        .unwrap();
    assert_eq!(r, AgentReply::Released { deregistered: true });
}

#[test]
fn read_tokens_open_only_their_own_range_of_their_own_region_and_only_for_reading() {
    let (n, _rm, mut owner, [x, y]) = node_with_owner();
    map(&mut owner, &x);
    map(&mut owner, &y);
    let mut reader = agent_client(&n, "worker-b");
    let tok = maru::auth::read_token(&x.token, x.region_id, 0, MIB);
    let try_map = |c: &mut Client, region_id: u64, offset: u64, length: u64, t: &str| {
        let ranges = vec![ReadRange {
            region_id,
            offset,
            length,
            read_token: t.to_string(),
        }];
        let r = c.call::<_, AgentReply>(&AgentRequest::MapReads { ranges });
        r.and_then(|r| {
            r.single_read()
                .map(AgentReply::Mapped)
                .map_err(ClientError::Remote)
        })
    };
    // Reused for another offset of the same length, another region, a sub-range.
    assert!(refused(try_map(&mut reader, x.region_id, MIB, MIB, &tok)));
    assert!(refused(try_map(&mut reader, y.region_id, 0, MIB, &tok)));
    assert!(refused(try_map(&mut reader, x.region_id, 0, MIB / 2, &tok)));
    // Forged: the region token itself, random hex, empty.
    assert!(refused(try_map(&mut reader, x.region_id, 0, MIB, &x.token)));
    assert!(refused(try_map(
        &mut reader,
        x.region_id,
        0,
        MIB,
        &"5a".repeat(16)
    )));
    assert!(refused(try_map(&mut reader, x.region_id, 0, MIB, "")));
    // The right token maps the range, for READ only.
    let m = match try_map(&mut reader, x.region_id, 0, MIB, &tok) {
        Ok(AgentReply::Mapped(m)) => m,
        r => panic!("{r:?}"),
    };
    let mut staging = vec![0x77u8; 4096];
    let nic = support::soft_nic("worker-b", &n.key, &mut staging);
    let peer = nic.connect(&m.transport, &mut no_bringup).unwrap();
    let op = |kind| Op {
        kind,
        local_offset: 0,
        remote_addr: m.addr,
        rkey: m.rkey,
        len: 4096,
    };
    let b = nic.post(peer, &[op(OpKind::Write)]).unwrap();
    assert!(
        matches!(
            nic.wait(b, T),
            BatchState::Failed(TransportError::ReadOnly { .. })
        ),
        "a WRITE through a read registration is refused"
    );
    let b = nic.post(peer, &[op(OpKind::Read)]).unwrap();
    assert_eq!(nic.wait(b, T), BatchState::Done);
    // Past the end of the read range: refused at the NIC.
    let past = Op {
        remote_addr: m.addr + MIB - 2048,
        ..op(OpKind::Read)
    };
    let b = nic.post(peer, &[past]).unwrap();
    assert!(matches!(
        nic.wait(b, T),
        BatchState::Failed(TransportError::OutOfRange { .. })
    ));
}

#[test]
fn rm_server_and_agent_listen_on_loopback_by_default_and_say_so() {
    for bin in [RM_BIN, SERVER_BIN, AGENT_BIN] {
        let out = std::process::Command::new(bin)
            .arg("--help")
            .output()
            .unwrap();
        let help = String::from_utf8_lossy(&out.stdout);
        assert!(
            help.contains("[default: 127.0.0.1]"),
            "{bin} --help does not show the loopback default:\n{help}"
        );
        // The RM and maru-server speak without a key by default: their help says the
        // protocol is plaintext (the agent requires its key on every connection).
        if bin != AGENT_BIN {
            assert!(help.contains("plaintext"), "{bin}: {help}");
        }
    }
    // Started without --host, they listen on 127.0.0.1.
    let n = node();
    assert!(n.rm.addr.starts_with("127.0.0.1:"), "{}", n.rm.addr);
    assert!(n.agent.addr.starts_with("127.0.0.1:"), "{}", n.agent.addr);
    let server = Daemon::start(
        SERVER_BIN,
        &["--rm-address".into(), n.rm.addr.clone()],
        &n.s.dir,
    );
    assert!(server.addr.starts_with("127.0.0.1:"), "{}", server.addr);
}

#[test]
fn maru_server_refuses_an_agent_key_file_others_can_read() {
    use std::os::unix::fs::PermissionsExt;
    let n = node();
    std::fs::set_permissions(&n.key_path, std::fs::Permissions::from_mode(0o644)).unwrap();
    let out = std::process::Command::new(SERVER_BIN)
        .args([
            "--rm-address",
            &n.rm.addr,
            "--remote-cxl-agent",
            &n.agent.addr,
            "--remote-cxl-agent-key-file",
            &n.key_path.display().to_string(),
            "--rm-key-file",
            &support::rm_key_path(&n.rm.addr)
                .unwrap()
                .display()
                .to_string(),
            "--port",
            "0",
        ])
        .output()
        .unwrap();
    assert_ne!(out.status.code(), Some(0));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("chmod 600"), "{err}");
}

#[test]
fn systemd_units_run_the_daemons_as_an_unprivileged_user() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("systemd");
    let mut units = 0;
    for e in std::fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().and_then(|x| x.to_str()) != Some("service") {
            continue;
        }
        units += 1;
        let text = std::fs::read_to_string(&p).unwrap();
        let user = text
            .lines()
            .find_map(|l| l.trim().strip_prefix("User="))
            .unwrap_or_else(|| panic!("{} has no User=", p.display()));
        assert!(
            !user.is_empty() && user != "root" && user != "0",
            "{} runs as {user:?}",
            p.display()
        );
    }
    assert!(units >= 4, "the units are in {}", dir.display());
}
