//! A queue pair without a NIC, for tests: it takes posts, and the test decides when
//! the "NIC" executes them. It completes in order, can fail one request mid-chain
//! (the queue pair then flushes the rest), withhold the flushes of a move to ERR,
//! fail its destroy a number of times, refuse a post at a given request, and let a
//! completion land right after a poll (the arm/drain race). Events follow
//! `ibv_req_notify_cq`: a completion raises one only while the queue is armed, and
//! raising it disarms the queue.

use super::engine::LocalReg;
use super::ops::{Access, Completion, MemoryOps, MrKeys, PostRefused, QueuePairOps, WorkRequest};
use crate::transport::LocalBuffer;
use std::collections::VecDeque;
use std::sync::{Mutex, MutexGuard};

/// `ibv_wc_status` values the fake produces.
const WC_REM_ACCESS_ERR: u32 = 10;
const WC_WR_FLUSH_ERR: u32 = 5;

/// A staging buffer of 64 KiB as the engine knows it once registered (lkey 0x11),
/// and the bytes it points into (keep them as long as the registration).
pub(crate) fn staging() -> (LocalReg, Vec<u8>) {
    let mut buf = vec![0u8; 1 << 16];
    let reg = LocalReg {
        buf: LocalBuffer::of(&mut buf),
        lkey: 0x11,
        max_op_len: 1 << 20,
    };
    (reg, buf)
}

#[derive(Default)]
pub(crate) struct FakeState {
    /// Posted, not executed: (request number since creation, request).
    sq: VecDeque<(usize, WorkRequest)>,
    cq: VecDeque<Completion>,
    armed: bool,
    /// Completion events raised and not yet taken by the test.
    pub events: usize,
    /// In ERR (after a failed request or `to_error`).
    pub error: bool,
    /// `to_error` (and a failure) leave the posted requests unflushed.
    pub withhold_flushes: bool,
    /// The next this many destroys fail.
    pub destroy_failures: usize,
    pub destroy_calls: usize,
    pub destroyed: bool,
    /// The request with this number is refused by `post` (and the chain stops there).
    pub refuse_at: Option<usize>,
    /// The request with this number completes with a remote access error.
    pub fail_at: Option<usize>,
    /// Right after the next poll returns, the NIC completes this many requests.
    pub land_after_poll: usize,
    /// Requests accepted so far.
    pub posted: usize,
    /// `ibv_post_send` calls and their chain lengths.
    pub chains: Vec<usize>,
}

pub(crate) struct FakeQp {
    qpn: u32,
    s: Mutex<FakeState>,
}

impl FakeQp {
    pub fn new(qpn: u32) -> FakeQp {
        FakeQp {
            qpn,
            s: Mutex::new(FakeState::default()),
        }
    }

    pub fn state(&self) -> MutexGuard<'_, FakeState> {
        self.s.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The NIC executes the first `n` posted requests (fewer if fewer are posted).
    pub fn complete(&self, n: usize) {
        complete(&mut self.state(), n);
    }

    /// Requests posted and not executed.
    pub fn queued(&self) -> usize {
        self.state().sq.len()
    }

    /// Takes the raised events (how many).
    pub fn take_events(&self) -> usize {
        std::mem::take(&mut self.state().events)
    }
}

fn push(s: &mut FakeState, wc: Completion) {
    s.cq.push_back(wc);
    if s.armed {
        s.armed = false;
        s.events += 1;
    }
}

fn flush_all(s: &mut FakeState) {
    if s.withhold_flushes {
        return;
    }
    while let Some((_, wr)) = s.sq.pop_front() {
        push(
            s,
            Completion {
                wr_id: wr.wr_id,
                status: WC_WR_FLUSH_ERR,
                vendor_err: 0,
            },
        );
    }
}

fn complete(s: &mut FakeState, n: usize) {
    for _ in 0..n {
        if s.error {
            return;
        }
        let Some((num, wr)) = s.sq.pop_front() else {
            return;
        };
        let status = if s.fail_at == Some(num) {
            WC_REM_ACCESS_ERR
        } else {
            0
        };
        push(
            s,
            Completion {
                wr_id: wr.wr_id,
                status,
                vendor_err: 0,
            },
        );
        if status != 0 {
            // RC: the queue pair enters ERR and flushes everything after it.
            s.error = true;
            flush_all(s);
        }
    }
}

impl QueuePairOps for FakeQp {
    fn qpn(&self) -> u32 {
        self.qpn
    }

    fn post(&self, chain: &[WorkRequest]) -> Result<(), PostRefused> {
        let mut s = self.state();
        s.chains.push(chain.len());
        if s.destroyed {
            return Err(PostRefused {
                first_bad: 0,
                errno: libc::EINVAL,
            });
        }
        for (i, wr) in chain.iter().enumerate() {
            let num = s.posted;
            if s.refuse_at == Some(num) {
                s.refuse_at = None;
                return Err(PostRefused {
                    first_bad: i,
                    errno: libc::ENOMEM,
                });
            }
            s.posted += 1;
            s.sq.push_back((num, *wr));
        }
        if s.error {
            // Posting to a queue pair in ERR: the requests are flushed.
            flush_all(&mut s);
        }
        Ok(())
    }

    fn poll(&self, out: &mut Vec<Completion>) -> Result<(), String> {
        let mut s = self.state();
        out.extend(s.cq.drain(..));
        let n = std::mem::take(&mut s.land_after_poll);
        complete(&mut s, n);
        Ok(())
    }

    fn arm(&self) -> Result<(), String> {
        self.state().armed = true;
        Ok(())
    }

    fn to_error(&self) -> Result<(), String> {
        let mut s = self.state();
        if s.destroyed {
            return Err("destroyed".into());
        }
        s.error = true;
        flush_all(&mut s);
        Ok(())
    }

    fn destroy(&self) -> Result<(), String> {
        let mut s = self.state();
        s.destroy_calls += 1;
        if s.destroyed {
            return Ok(());
        }
        if s.destroy_failures > 0 {
            s.destroy_failures -= 1;
            return Err("ibv_destroy_qp: Device or resource busy".into());
        }
        s.destroyed = true;
        Ok(())
    }
}

/// A NIC's key space for fake protection domains: keys are unique across domains,
/// as a NIC's are.
#[derive(Default)]
pub(crate) struct FakeFabric {
    next_key: std::sync::atomic::AtomicU32,
    made: std::sync::atomic::AtomicUsize,
}

impl FakeFabric {
    pub fn alloc_pd(self: &std::sync::Arc<Self>) -> FakePd {
        self.made.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        FakePd {
            fabric: self.clone(),
            mrs: Mutex::new(std::collections::HashMap::new()),
            fail_deregister: Mutex::new(0),
        }
    }

    /// Protection domains allocated so far.
    pub fn domains_made(&self) -> usize {
        self.made.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// A protection domain without a NIC: its registrations by key, and the NIC's rule
/// that a queue pair of this domain reaches only them.
pub(crate) struct FakePd {
    fabric: std::sync::Arc<FakeFabric>,
    mrs: Mutex<std::collections::HashMap<u32, Access>>,
    fail_deregister: Mutex<usize>,
}

impl FakePd {
    /// Whether a queue pair of this domain may READ (or WRITE) with `rkey`: the key
    /// must be registered in this domain with that access.
    pub fn accepts(&self, rkey: u32, write: bool) -> bool {
        let mrs = self.mrs.lock().unwrap_or_else(|p| p.into_inner());
        match mrs.get(&rkey) {
            Some(Access::RemoteReadWrite) => true,
            Some(Access::RemoteRead) => !write,
            _ => false,
        }
    }

    /// The next `n` deregistrations fail.
    pub fn fail_deregistrations(&self, n: usize) {
        *self
            .fail_deregister
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = n;
    }
}

impl MemoryOps for FakePd {
    unsafe fn register(
        &self,
        _ptr: *mut u8,
        _len: usize,
        access: Access,
    ) -> Result<MrKeys, String> {
        let k = self
            .fabric
            .next_key
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst)
            + 1;
        self.mrs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(k, access);
        Ok(MrKeys { lkey: k, rkey: k })
    }

    fn deregister(&self, rkey: u32) -> Result<(), String> {
        let mut f = self
            .fail_deregister
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if *f > 0 {
            *f -= 1;
            return Err("ibv_dereg_mr: Device or resource busy".into());
        }
        match self
            .mrs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&rkey)
        {
            Some(_) => Ok(()),
            None => Err(format!("key {rkey:#x} is not registered here")),
        }
    }
}
