//! RM + remote CXL agent on loopback with a fake-DAX file, and a worker using the
//! soft transport: the bytes, the key checks, release, restart.

mod support;

use maru::auth::{keyfile::write_new_key_file, SharedKey};
use maru::net::{Client, ClientError, ClientOptions};
use maru::transport::{no_bringup, BatchState, Op, OpKind, Transport};
use maru::wire::agent::{AgentReply, AgentRequest, MapReply, ReadRange, SERVICE as AGENT};
use maru::wire::rm::{Handle, RmReply, RmRequest, SERVICE as RM};
use maru::wire::ErrorCode;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::time::Duration;
use support::{
    agent_client, connect, map_writable as map, wait_until, Daemon, Scratch, AGENT_BIN, RM_BIN,
};

const MIB: u64 = 1 << 20;
const T: Duration = Duration::from_secs(10);

/// The RM stops before its scratch directory goes (fields drop in order).
struct Pool {
    pool: PathBuf,
    key_path: PathBuf,
    key: SharedKey,
    rm: Daemon,
    s: Scratch,
}

fn pool() -> Pool {
    let mut s = Scratch::new("agent");
    let pool = s.fake_dax("pool");
    let key_path = s.dir.join("agent.key");
    let key = SharedKey::generate().unwrap();
    write_new_key_file(&key_path, &key).unwrap();
    let rm = Daemon::start(RM_BIN, &support::rm_args(&s, &pool, "64M"), &s.dir);
    Pool {
        s,
        pool,
        key_path,
        key,
        rm,
    }
}

fn agent_args(p: &Pool, boot_file: Option<&PathBuf>) -> Vec<String> {
    let mut a = support::agent_args(&p.rm.addr, &p.key_path, &p.pool);
    a.extend(["--quarantine-s".into(), "1".into()]);
    if let Some(b) = boot_file {
        a.push("--boot-id-file".into());
        a.push(b.display().to_string());
    }
    a
}

fn alloc(rm: &mut Client) -> Handle {
    support::rm_alloc(rm, 4 * MIB)
}

fn region_bytes(p: &Pool, h: &Handle, len: usize) -> Vec<u8> {
    let f = std::fs::File::open(&p.pool).unwrap();
    let mut b = vec![0u8; len];
    f.read_exact_at(&mut b, h.offset).unwrap();
    b
}

fn holds_of(rm: &mut Client, node: &str) -> usize {
    match rm
        .call(&RmRequest::Holds {
            node: Some(node.into()),
        })
        .unwrap()
    {
        RmReply::Holds { holds } => holds.len(),
        r => panic!("{r:?}"),
    }
}

/// What a test of one mapping starts from: an agent on `p` (its usual flags), the RM
/// connection maru-server would hold, a 4 MiB region `h` allocated there and mapped
/// writable by worker-a. Returns worker-a's agent connection, the RM connection, the
/// map reply, `h` and the agent.
fn mapped(p: &Pool) -> (Client, Client, MapReply, Handle, Daemon) {
    let agent = Daemon::start(AGENT_BIN, &agent_args(p, None), &p.s.dir);
    let mut rm = connect(&p.rm.addr, RM, "maru-server-test");
    let h = alloc(&mut rm);
    let mut owner = agent_client(&agent.addr, &p.key, "worker-a");
    let m = map(&mut owner, &h);
    (owner, rm, m, h, agent)
}

#[test]
fn map_write_read_release_and_a_late_write() {
    let p = pool();
    let (mut owner, mut rm, m, h, agent) = mapped(&p);
    assert_eq!(m.length, h.length);
    assert!(!m.boot_id.is_empty());
    assert_eq!(
        holds_of(&mut rm, "mem0"),
        1,
        "the agent holds the region at the RM"
    );

    let mut staging = vec![0u8; 2 * MIB as usize];
    for (i, b) in staging[..MIB as usize].iter_mut().enumerate() {
        *b = (i % 253) as u8;
    }
    let nic = support::soft_nic("worker-a", &p.key, &mut staging);
    let peer = nic.connect(&m.transport, &mut no_bringup).unwrap();
    let w = Op {
        kind: OpKind::Write,
        local_offset: 0,
        remote_addr: m.addr,
        rkey: m.rkey,
        len: MIB,
    };
    let b = nic.post(peer, &[w]).unwrap();
    assert_eq!(nic.wait(b, T), BatchState::Done);
    let r = Op {
        kind: OpKind::Read,
        local_offset: MIB,
        remote_addr: m.addr,
        rkey: m.rkey,
        len: MIB,
    };
    let b = nic.post(peer, &[r]).unwrap();
    assert_eq!(nic.wait(b, T), BatchState::Done);
    assert_eq!(staging[..MIB as usize], staging[MIB as usize..]);
    // The bytes are in the region of the device, where the RM said.
    let expect = staging[..MIB as usize].to_vec();
    assert_eq!(region_bytes(&p, &h, MIB as usize), expect);

    // A reader with a read token maps a range of the region; a forged token is refused.
    let mut reader = agent_client(&agent.addr, &p.key, "worker-b");
    let tok = maru::auth::read_token(&h.token, h.region_id, 0, MIB);
    let mut read = |region_id, offset, length, read_token| {
        let ranges = vec![ReadRange {
            region_id,
            offset,
            length,
            read_token,
        }];
        let r = reader.call::<_, AgentReply>(&AgentRequest::MapReads { ranges });
        r.and_then(|r| {
            r.single_read()
                .map(AgentReply::Mapped)
                .map_err(ClientError::Remote)
        })
    };
    let ok = read(h.region_id, 0, MIB, tok);
    assert!(matches!(ok, Ok(AgentReply::Mapped(_))), "{ok:?}");
    let forged = maru::auth::read_token(&h.token, h.region_id, 0, MIB);
    assert_eq!(
        support::remote_code(read(h.region_id, 0, 2 * MIB, forged)),
        ErrorCode::Refused
    );
    // A read handle for a region the agent has not mapped is refused.
    let other = alloc(&mut rm);
    let unmapped = maru::auth::read_token(&other.token, other.region_id, 0, MIB);
    assert_eq!(
        support::remote_code(read(other.region_id, 0, MIB, unmapped)),
        ErrorCode::Refused
    );

    // Release: later maps of the handle are refused, and a late WRITE with the old key
    // fails at the (soft) NIC and changes nothing.
    let rel: AgentReply = owner
        .call(&AgentRequest::Release { handle: h.clone() })
        .unwrap();
    assert_eq!(rel, AgentReply::Released { deregistered: true });
    assert_eq!(
        support::remote_code(owner.call::<_, AgentReply>(&AgentRequest::Map {
            handle: h.clone(),
            writable: true
        })),
        ErrorCode::Refused
    );
    staging[..MIB as usize].fill(0xEE);
    let b = nic.post(peer, &[w]).unwrap();
    assert!(
        matches!(nic.wait(b, T), BatchState::Failed(_)),
        "a late WRITE must fail"
    );
    assert_eq!(
        region_bytes(&p, &h, MIB as usize),
        expect,
        "the region's bytes are unchanged"
    );
    // The hold is gone at the RM once the agent deregistered the region.
    assert!(wait_until(T, || holds_of(&mut rm, "mem0") == 0));
}

#[test]
fn connections_must_prove_the_agent_key() {
    let p = pool();
    let agent = Daemon::start(AGENT_BIN, &agent_args(&p, None), &p.s.dir);
    let none = ClientOptions::new(AGENT, "nokey");
    assert!(matches!(
        Client::connect(&agent.addr, &none),
        Err(ClientError::Auth { .. })
    ));
    let mut wrong = ClientOptions::new(AGENT, "wrong");
    wrong.key = Some(SharedKey::generate().unwrap());
    assert!(matches!(
        Client::connect(&agent.addr, &wrong),
        Err(ClientError::Auth { .. })
    ));
}

#[test]
fn a_restarted_agent_resets_its_old_holds() {
    let p = pool();
    let args = agent_args(&p, None);
    let agent = Daemon::start(AGENT_BIN, &args, &p.s.dir);
    let mut rm = connect(&p.rm.addr, RM, "maru-server-test");
    let h = alloc(&mut rm);
    {
        let mut owner = agent_client(&agent.addr, &p.key, "worker-a");
        map(&mut owner, &h);
        assert_eq!(holds_of(&mut rm, "mem0"), 1);
        agent.kill9();
    }
    // The dead agent's hold stays until the agent comes back with a new epoch.
    assert_eq!(holds_of(&mut rm, "mem0"), 1);
    let agent = Daemon::start(AGENT_BIN, &args, &p.s.dir);
    assert_eq!(
        holds_of(&mut rm, "mem0"),
        0,
        "RESET_HOLDS at start dropped the old epoch's hold"
    );
    let mut owner = agent_client(&agent.addr, &p.key, "worker-a");
    let st: AgentReply = owner.call(&AgentRequest::Status).unwrap();
    assert!(matches!(st, AgentReply::Status(s) if s.mappings.is_empty()));
    // And it maps again.
    map(&mut owner, &h);
}

#[test]
fn start_up_refusals() {
    let p = pool();
    let run = |args: &[String]| {
        std::process::Command::new(AGENT_BIN)
            .args(args)
            .args(["--port", "0"])
            .output()
            .unwrap()
    };
    // No boot id.
    let missing = p.s.dir.join("no-boot-id");
    let out = run(&agent_args(&p, Some(&missing)));
    assert_eq!(out.status.code(), Some(78));
    assert!(String::from_utf8_lossy(&out.stderr).contains("boot id"));
    // Empty RM address.
    let mut a = agent_args(&p, None);
    a[1] = String::new();
    let out = run(&a);
    assert_eq!(out.status.code(), Some(78));
    assert!(String::from_utf8_lossy(&out.stderr).contains("resource manager address is empty"));
    // A key file others can read.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&p.key_path, std::fs::Permissions::from_mode(0o644)).unwrap();
    let out = run(&agent_args(&p, None));
    assert_eq!(out.status.code(), Some(78));
    assert!(String::from_utf8_lossy(&out.stderr).contains("chmod 600"));
    std::fs::set_permissions(&p.key_path, std::fs::Permissions::from_mode(0o600)).unwrap();
    // verbs on a host without RDMA (or a build without it) fails with a clear message.
    let mut a = agent_args(&p, None);
    a.extend([
        "--transport".into(),
        "verbs".into(),
        "--rdma-device".into(),
        "mlx5_0".into(),
    ]);
    let out = run(&a);
    assert_ne!(out.status.code(), Some(0));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("mlx5_0") || err.contains("verbs"), "{err}");
}

#[test]
fn a_range_mapped_again_within_the_quarantine_gets_a_new_key() {
    let p = pool();
    let (mut owner, mut rm, first, h, _agent) = mapped(&p);
    let rel: AgentReply = owner
        .call(&AgentRequest::Release { handle: h.clone() })
        .unwrap();
    assert_eq!(rel, AgentReply::Released { deregistered: true });
    assert!(wait_until(T, || holds_of(&mut rm, "mem0") == 0));
    // The RM may hand the same range out again once the agent unheld it...
    let _: RmReply = rm
        .call(&RmRequest::Free {
            handle: h.clone(),
            request_id: 0,
        })
        .unwrap();
    let again = alloc(&mut rm);
    assert_eq!(again.offset, h.offset, "the freed range is reused first");
    // ...but the agent maps it at another address with another key: the old range is
    // still mapped without access for the quarantine, so no old key can reach it.
    let second = map(&mut owner, &again);
    assert_ne!(second.rkey, first.rkey);
    assert_ne!(second.addr, first.addr);
}

#[test]
fn an_unhold_the_rm_missed_is_sent_by_the_sweep_once_it_is_back() {
    let mut p = pool();
    let agent = Daemon::start(AGENT_BIN, &agent_args(&p, None), &p.s.dir);
    let h = {
        let mut rm = connect(&p.rm.addr, RM, "maru-server-test");
        alloc(&mut rm)
    };
    let mut owner = agent_client(&agent.addr, &p.key, "worker-a");
    map(&mut owner, &h);
    // The RM goes away; the release still deregisters at once and queues the unhold.
    let mut rm_args = support::rm_args(&p.s, &p.pool, "64M");
    rm_args.extend(support::strings(&["--grace-period-s", "600"]));
    let port = p.rm.port();
    let old = std::mem::replace(&mut p.rm, placeholder());
    old.kill9();
    let rel: AgentReply = owner
        .call(&AgentRequest::Release { handle: h.clone() })
        .unwrap();
    assert_eq!(rel, AgentReply::Released { deregistered: true });
    let st = match owner.call::<_, AgentReply>(&AgentRequest::Status).unwrap() {
        AgentReply::Status(s) => s,
        r => panic!("{r:?}"),
    };
    assert_eq!(st.queued_unholds, 1, "the unhold waits for the RM");
    // The RM comes back on the agent's address with its state: the hold is still there.
    drop(std::mem::replace(
        &mut p.rm,
        Daemon::start_at(RM_BIN, &rm_args, &p.s.dir, port),
    ));
    let mut rm = connect(&p.rm.addr, RM, "observer");
    assert_eq!(holds_of(&mut rm, "mem0"), 1);
    // The sweep (every 5 s) sends it.
    assert!(
        wait_until(Duration::from_secs(20), || holds_of(&mut rm, "mem0") == 0),
        "the queued unhold reached the RM"
    );
}

/// A process that is not a daemon, standing in while the RM is down.
fn placeholder() -> Daemon {
    let child = std::process::Command::new("true").spawn().unwrap();
    Daemon {
        child,
        addr: String::new(),
        name: "placeholder".into(),
    }
}
