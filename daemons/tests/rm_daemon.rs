//! The real maru-resource-manager on loopback with a fake-DAX file: lifecycle across
//! kill -9, bad input, key proofs, reaping.

mod support;

use maru::net::{Client, ClientError, ClientOptions};
use maru::wire::rm::{RmReply, RmRequest, SERVICE};
use maru::wire::{self, ErrorCode, FrameKind, WireError};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;
use support::{
    connect, rm_alloc as alloc, rm_holds as holds, rm_regions as regions, wait_until, Daemon,
    Scratch,
};

const BIN: &str = env!("CARGO_BIN_EXE_maru-resource-manager");
const MIB: u64 = 1 << 20;

fn rm_args(s: &mut Scratch, extra: &[&str]) -> Vec<String> {
    let pool = s.fake_dax("pool");
    let mut a = support::rm_args(s, &pool, "64M");
    a.extend(extra.iter().map(|x| x.to_string()));
    a
}

/// An RM on a pool of its own in a scratch dir named by `tag`, started with `extra`:
/// the dir (removed when it drops) and the arguments, to start it again.
fn started(tag: &str, extra: &[&str]) -> (Scratch, Vec<String>, Daemon) {
    let mut s = Scratch::new(tag);
    let args = rm_args(&mut s, extra);
    let rm = Daemon::start(BIN, &args, &s.dir);
    (s, args, rm)
}

#[test]
fn regions_and_holds_survive_kill9_and_restart() {
    let (s, args, rm) = started("rm-kill", &["--grace-period-s", "600"]);
    let mut owner = connect(&rm.addr, SERVICE, "owner-a");
    let live = alloc(&mut owner, 3 * MIB); // rounded up to 4 MiB
    assert_eq!(live.length, 4 * MIB);
    let held = alloc(&mut owner, 2 * MIB);
    let mut agent = connect(&rm.addr, SERVICE, "agent-n1");
    let hold = RmRequest::Hold {
        handle: held.clone(),
        node: "n1".into(),
        epoch: 1,
    };
    assert!(matches!(
        agent.call::<_, RmReply>(&hold),
        Ok(RmReply::Hold(_))
    ));
    let freed: RmReply = owner
        .call(&RmRequest::Free {
            handle: held.clone(),
            request_id: 0,
        })
        .unwrap();
    assert_eq!(freed, RmReply::Free(wire::rm::FreeReply { draining: true }));
    let before_regions = regions(&mut owner);
    let before_holds = holds(&mut owner);
    drop((owner, agent));

    rm.kill9();
    let rm = Daemon::start(BIN, &args, &s.dir);
    let mut owner = connect(&rm.addr, SERVICE, "owner-a");
    assert_eq!(regions(&mut owner), before_regions, "regions after restart");
    assert_eq!(holds(&mut owner), before_holds, "holds after restart");
    // The old handle is still valid.
    let acc: RmReply = owner
        .call(&RmRequest::GetAccess {
            handle: live.clone(),
        })
        .unwrap();
    assert!(
        matches!(acc, RmReply::Access(a) if a.offset == live.offset && a.length == live.length)
    );
    // A draining region cannot be held again, and that is a refusal.
    let mut agent = connect(&rm.addr, SERVICE, "agent-n1");
    let again = RmRequest::Hold {
        handle: held.clone(),
        node: "n2".into(),
        epoch: 1,
    };
    assert_eq!(
        support::remote_code(agent.call::<_, RmReply>(&again)),
        ErrorCode::Refused
    );
    // Its range is not reused while draining: allocations avoid it.
    let other = alloc(&mut owner, 2 * MIB);
    assert_ne!(other.offset, held.offset);
    // The last UNHOLD frees it for good.
    let un: RmReply = agent
        .call(&RmRequest::Unhold {
            region_id: held.region_id,
            node: "n1".into(),
            epoch: 1,
        })
        .unwrap();
    assert_eq!(
        un,
        RmReply::Unhold(wire::rm::UnholdReply {
            removed: true,
            freed: true
        })
    );
    assert!(regions(&mut owner)
        .iter()
        .all(|r| r.region_id != held.region_id));
    drop(rm);
}

#[test]
fn bad_input_gets_errors_and_changes_nothing() {
    let (_s, _, mut rm) = started("rm-bad", &[]);
    let mut good = connect(&rm.addr, SERVICE, "good");
    let h = alloc(&mut good, 2 * MIB);
    let snapshot = (regions(&mut good), holds(&mut good));

    let read_error_frame = |stream: &mut TcpStream| -> Option<WireError> {
        stream
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let mut buf = Vec::new();
        let _ = stream.read_to_end(&mut buf); // the daemon closes after the error frame
        let mut d = wire::FrameDecoder::new(1 << 20);
        d.push(&buf);
        match d.next_frame() {
            Ok(Some(f)) if f.kind == FrameKind::Error => wire::decode_json(&f.body).ok(),
            _ => None,
        }
    };

    // Garbage bytes: an unknown frame kind → protocol error, then close.
    let mut g = TcpStream::connect(&rm.addr).unwrap();
    g.write_all(b"\x05\x00\x00\x00\xEEgarbage").unwrap();
    let e = read_error_frame(&mut g).expect("error frame for garbage");
    assert_eq!(e.code, ErrorCode::Protocol);

    // An oversized frame → protocol error naming the limit.
    let mut o = TcpStream::connect(&rm.addr).unwrap();
    o.write_all(&wire::frame::encode_header(FrameKind::Handshake, 512 << 20))
        .unwrap();
    let e = read_error_frame(&mut o).expect("error frame for oversized");
    assert!(e.message.contains("exceeds the maximum"), "{}", e.message);

    // A wrong protocol version → version error, saying which side to upgrade: a
    // future one, and 1 (before map_reads and the acquire reply that names a region's
    // device once).
    for version in [999, 1] {
        let mut v = TcpStream::connect(&rm.addr).unwrap();
        let hello = serde_json::json!({"service": SERVICE, "version": version,
            "client_id": "x", "nonce": "00"});
        v.write_all(&wire::frame::encode(
            FrameKind::Handshake,
            hello.to_string().as_bytes(),
        ))
        .unwrap();
        let e = read_error_frame(&mut v).expect("error frame for version");
        assert_eq!(e.code, ErrorCode::Version);
        assert!(
            e.message
                .contains(&format!("version {version} is not supported"))
                && e.message.contains("upgrade"),
            "{}",
            e.message
        );
    }

    // A request before the handshake → protocol error.
    let mut r = TcpStream::connect(&rm.addr).unwrap();
    r.write_all(&wire::frame::encode(
        FrameKind::Request,
        br#"{"id":1,"op":"pools"}"#,
    ))
    .unwrap();
    assert_eq!(
        read_error_frame(&mut r).expect("error frame").code,
        ErrorCode::Protocol
    );

    // A truncated frame, then the peer goes away.
    let mut t = TcpStream::connect(&rm.addr).unwrap();
    t.write_all(&[100, 0, 0, 0, 1, b'{']).unwrap();
    drop(t);

    // After a good handshake: malformed JSON and unknown ops get error replies, and
    // the connection goes on serving.
    let mut c = connect(&rm.addr, SERVICE, "bad-client");
    c.send_raw(&wire::frame::encode(FrameKind::Request, b"{not json"))
        .unwrap();
    let f = c.recv_frame().unwrap();
    assert_eq!(f.kind, FrameKind::Reply);
    let env: wire::ReplyEnvelope<serde_json::Value> = wire::decode_json(&f.body).unwrap();
    assert_eq!(env.err.unwrap().code, ErrorCode::BadRequest);
    c.send_raw(&wire::frame::encode(
        FrameKind::Request,
        br#"{"id":5,"op":"format_disk"}"#,
    ))
    .unwrap();
    let env: wire::ReplyEnvelope<serde_json::Value> =
        wire::decode_json(&c.recv_frame().unwrap().body).unwrap();
    assert_eq!(env.id, 5);
    assert_eq!(env.err.unwrap().code, ErrorCode::BadRequest);

    // Wrong tokens are refusals; not being the owner is a permission error.
    let mut forged = h.clone();
    forged.token = "00".repeat(16);
    assert_eq!(
        support::remote_code(c.call::<_, RmReply>(&RmRequest::Free {
            handle: forged.clone(),
            request_id: 0
        })),
        ErrorCode::Refused
    );
    assert_eq!(
        support::remote_code(c.call::<_, RmReply>(&RmRequest::GetAccess {
            handle: forged.clone()
        })),
        ErrorCode::Refused
    );
    let hold = RmRequest::Hold {
        handle: forged,
        node: "n".into(),
        epoch: 1,
    };
    assert_eq!(
        support::remote_code(c.call::<_, RmReply>(&hold)),
        ErrorCode::Refused
    );
    assert_eq!(
        support::remote_code(c.call::<_, RmReply>(&RmRequest::Free {
            handle: h.clone(),
            request_id: 0
        })),
        ErrorCode::Permission
    );
    assert!(matches!(
        c.call::<_, RmReply>(&RmRequest::Pools),
        Ok(RmReply::Pools { .. })
    ));

    // The daemon is up, the first connection still works, and nothing changed.
    assert!(rm.is_running());
    assert_eq!((regions(&mut good), holds(&mut good)), snapshot);
    assert_eq!(rm.terminate(), Some(0), "clean exit on SIGTERM");
}

#[test]
fn a_key_file_requires_the_proof() {
    use std::os::unix::fs::PermissionsExt;
    let mut s = Scratch::new("rm-key");
    let key_path = s.dir.join("rm.key");
    let key = maru::auth::SharedKey::generate().unwrap();
    maru::auth::keyfile::write_new_key_file(&key_path, &key).unwrap();
    let args = rm_args(&mut s, &["--key-file", key_path.to_str().unwrap()]);
    let rm = Daemon::start(BIN, &args, &s.dir);

    let plain = ClientOptions::new(SERVICE, "nokey");
    assert!(matches!(
        Client::connect(&rm.addr, &plain),
        Err(ClientError::Auth { .. })
    ));
    let mut wrong = ClientOptions::new(SERVICE, "wrongkey");
    wrong.key = Some(maru::auth::SharedKey::generate().unwrap());
    assert!(matches!(
        Client::connect(&rm.addr, &wrong),
        Err(ClientError::Auth { .. })
    ));
    let mut right = ClientOptions::new(SERVICE, "rightkey");
    right.key = Some(key);
    let mut c = Client::connect(&rm.addr, &right).expect("right key connects");
    assert!(matches!(
        c.call::<_, RmReply>(&RmRequest::Pools),
        Ok(RmReply::Pools { .. })
    ));
    drop(rm);

    // A key file others can read is refused at start, with the fix in the message.
    std::fs::set_permissions(&key_path, std::fs::Permissions::from_mode(0o644)).unwrap();
    let out = std::process::Command::new(BIN)
        .args(&args)
        .arg("--port")
        .arg("0")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(78));
    assert!(String::from_utf8_lossy(&out.stderr).contains("chmod 600"));
}

#[test]
fn a_departed_owner_is_reaped_after_the_grace_period() {
    let (_s, _, rm) = started("rm-reap", &["--grace-period-s", "1"]);
    let mut watcher = connect(&rm.addr, SERVICE, "watcher");
    {
        let mut owner = connect(&rm.addr, SERVICE, "remote-owner");
        alloc(&mut owner, 2 * MIB);
    }
    assert_eq!(regions(&mut watcher).len(), 1);
    assert!(
        wait_until(Duration::from_secs(10), || regions(&mut watcher).is_empty()),
        "the region of an owner gone for over the grace period is freed"
    );
}

#[test]
fn start_up_errors_are_clear() {
    let s = Scratch::new("rm-noarg");
    let out = std::process::Command::new(BIN)
        .args(["--state-dir", s.dir.to_str().unwrap(), "--port", "0"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(78));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--fake-dax"));
    let out = std::process::Command::new(BIN)
        .args([
            "--state-dir",
            s.dir.to_str().unwrap(),
            "--dax",
            "/dev/dax-none.0",
            "--port",
            "0",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(78));
    assert!(String::from_utf8_lossy(&out.stderr).contains("/dev/dax-none.0"));
}
