//! The first bring-up check on one host: opens the device as an agent and as a worker
//! would, brings a queue pair up between the two over loopback, WRITEs a pattern,
//! READs it back, expects a WRITE with that key from another connection's queue pair
//! (another protection domain) to fail at the NIC, deregisters the region and expects
//! a late WRITE with the released key to fail too, then fences and counts what is
//! left. `maru-rdma-check`
//! prints the lines; the RDMA-gated test runs the same function.

use super::settings::VerbsSettings;
use super::{VerbsTarget, VerbsTransport};
use crate::transport::{
    BatchState, LocalBuffer, Op, OpKind, PeerId, Registration, Target, Transport, TransportError,
};
use std::time::Duration;

/// One finding: what was checked, whether it passed, what was seen.
#[derive(Debug, Clone)]
pub struct CheckLine {
    pub what: &'static str,
    pub ok: bool,
    pub detail: String,
}

fn line(what: &'static str, ok: bool, detail: impl Into<String>) -> CheckLine {
    CheckLine {
        what,
        ok,
        detail: detail.into(),
    }
}

/// The locked-memory limit (registrations pin pages; `ulimit -l`).
fn memlock() -> CheckLine {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: writes one rlimit.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut r) } != 0 {
        return line(
            "memlock limit",
            false,
            std::io::Error::last_os_error().to_string(),
        );
    }
    if r.rlim_cur == libc::RLIM_INFINITY {
        line("memlock limit", true, "unlimited")
    } else {
        line(
            "memlock limit",
            r.rlim_cur >= 1 << 30,
            format!(
                "{} MiB (registrations pin the staging buffer and every region: raise `ulimit -l` / LimitMEMLOCK= to unlimited)",
                r.rlim_cur >> 20
            ),
        )
    }
}

/// Registers `staging` with `worker` and connects it to the peer of `reg`, bringing
/// its queue pair up at `target` as agent connection `conn` (its protection domain).
fn connect_as(
    conn: u64,
    worker: &VerbsTransport,
    staging: &mut [u8],
    target: &VerbsTarget,
    reg: &Registration,
) -> Result<PeerId, TransportError> {
    worker.register_local(LocalBuffer::of(staging))?;
    worker.connect(&reg.transport, &mut |half| {
        target.accept_peer_on(conn, half)
    })
}

/// Runs the checks. `Err(Unavailable)`: no usable device (nothing else was tried).
pub fn run(settings: &VerbsSettings) -> Result<Vec<CheckLine>, TransportError> {
    let mut out = vec![memlock()];
    let target = VerbsTarget::open_with(settings)?;
    let worker = VerbsTransport::open_with(settings)?;
    out.push(line(
        "device",
        true,
        format!(
            "{} port {} (InfiniBand transport; fork protection on); target metadata {}",
            target.device(),
            settings.port,
            target.meta()
        ),
    ));
    const LEN: usize = 1 << 20;
    let mut region = vec![0u8; LEN];
    let mut staging = vec![0u8; 2 * LEN];
    // SAFETY: `region` outlives its registration (deregistered below or at the
    // target's drop, which comes before `region`'s).
    const CONN: u64 = 1;
    let reg = unsafe { target.register(CONN, region.as_mut_ptr(), LEN as u64, true) }?;
    let peer = connect_as(CONN, &worker, &mut staging, &target, &reg)?;
    out.push(line(
        "queue pair bring-up",
        true,
        format!(
            "{} responder queue pair(s) at the target",
            target.queue_pairs()
        ),
    ));
    for (i, b) in staging[..LEN].iter_mut().enumerate() {
        *b = (i * 7 + 3) as u8;
    }
    let op = |kind, local_offset| Op {
        kind,
        local_offset,
        remote_addr: reg.addr,
        rkey: reg.rkey,
        len: LEN as u64,
    };
    let wait = |b| worker.wait(b, Duration::from_secs(10));
    let w = worker.post(peer, &[op(OpKind::Write, 0)])?;
    let st = wait(w);
    out.push(line(
        "RDMA WRITE of 1 MiB",
        st == BatchState::Done,
        format!("{st:?}"),
    ));
    let r = worker.post(peer, &[op(OpKind::Read, LEN as u64)])?;
    let st = wait(r);
    let same = staging[..LEN] == staging[LEN..];
    out.push(line(
        "RDMA READ back",
        st == BatchState::Done && same,
        format!(
            "{st:?}, pattern {}",
            if same { "matches" } else { "DIFFERS" }
        ),
    ));
    // Another agent connection (its own protection domain) presenting this key.
    const OTHER: u64 = 2;
    let intruder = VerbsTransport::open_with(settings)?;
    let mut other_staging = vec![0u8; LEN];
    let other = connect_as(OTHER, &intruder, &mut other_staging, &target, &reg)?;
    let st = intruder
        .post(other, &[op(OpKind::Write, 0)])
        .map(|b| intruder.wait(b, Duration::from_secs(10)))?;
    out.push(line(
        "WRITE with the key from another connection",
        matches!(st, BatchState::Failed(TransportError::BadKey { .. })),
        format!("{st:?} (expected a remote access error: the key is in another protection domain)"),
    ));
    let _ = intruder.fence(other);
    target.connection_closed(OTHER);
    drop(intruder);
    drop(other_staging);
    target.deregister(reg.rkey)?;
    let late = worker.post(peer, &[op(OpKind::Write, 0)])?;
    let st = wait(late);
    out.push(line(
        "late WRITE with a released key",
        matches!(st, BatchState::Failed(TransportError::BadKey { .. })),
        format!("{st:?} (expected a remote access error: the NIC refuses a released key)"),
    ));
    let fenced = worker.fence(peer);
    out.push(line("fence", fenced.is_ok(), format!("{fenced:?}")));
    let closed = target.connection_closed(CONN);
    out.push(line(
        "queue pairs after close",
        target.queue_pairs() == 0 && target.undestroyed_queue_pairs() == 0,
        format!(
            "{closed} destroyed at close, {} left (compare `rdma resource show qp` before and after)",
            target.queue_pairs()
        ),
    ));
    drop(worker);
    drop(target);
    drop(region);
    Ok(out)
}
