//! `verbs`: real RDMA over RC queue pairs (cargo feature `verbs`), built on `sideway`.
//! rdma-core is loaded at run time (rdma-mummy-sys dlopens `libibverbs.so.1`), so
//! libmaru builds and loads on hosts without it; opening a transport there, or on a
//! host without an RDMA device, fails with [`TransportError::Unavailable`](crate::transport::TransportError::Unavailable) naming the
//! device looked for:
//! `no RDMA device found (looked for mlx5_0); use --transport soft on hosts without RDMA`.
//!
//! # How it maps to the trait
//!
//! * [`VerbsTarget`] (agent, memory node) opens one device port and one protection
//!   domain. [`Target::register`](crate::transport::Target::register) registers a
//!   memory region with REMOTE_READ (plus REMOTE_WRITE and LOCAL_WRITE when writable)
//!   and returns its rkey, `addr = ptr`, and `{"verbs": {"qp_type": "rc", "device",
//!   "port", "lid", "gid", "target"}}` as the metadata
//!   ([`proto::TargetMeta`]). [`deregister`](crate::transport::Target::deregister) is
//!   `ibv_dereg_mr`: when it returns, the NIC refuses the key (a late READ/WRITE gets a
//!   remote access error, nothing is read or written) and no DMA is still touching the
//!   range; if rdma-core reports a failure the region stays registered and the call
//!   can be retried. [`accept_peer`](crate::transport::Target::accept_peer) creates
//!   one responder RC queue pair for a worker, brings it to RTS towards the worker's
//!   half ([`proto::WorkerHalf`]) and answers with ours ([`proto::TargetHalf`]); a
//!   worker that connects again replaces its previous queue pair, and at most
//!   [`target::MAX_TARGET_QPS`] are kept (oldest destroyed first).
//! * [`VerbsTransport`] (worker) registers the staging buffer with LOCAL_WRITE only
//!   (READs land in it; its queue pairs accept no remote operation at all).
//!   [`connect`](crate::transport::Transport::connect) creates an RC queue pair and its
//!   own completion queue on the transport's completion channel, sends our half
//!   (lid, gid, qpn, psn, mtu, READ depth) through the `Bringup` callback (the agent's
//!   control connection), takes the target's half and moves the queue pair
//!   INIT → RTR → RTS (path MTU: the smaller of both ports'; READ depth: the smaller of
//!   our initiator depth and the target's responder resources). One live queue pair per
//!   agent: connecting again with the same metadata returns the same peer.
//!   [`post`](crate::transport::Transport::post) turns each operation into one RDMA
//!   READ/WRITE work request (one scatter entry in the registered staging buffer) and
//!   posts them as a chain; a batch larger than the free send-queue room is posted in
//!   pieces as completions free room.
//!
//! # Work requests: every one signalled
//!
//! The `wr_id` is `(batch mod 2^40) << 24 | index` ([`proto::pack_wr_id`]); a batch
//! holds fewer than 2^24 operations. **Every** work request is signalled, not only the
//! last of a batch: operations are large (slots of tens of KiB to MiB), so a
//! completion per operation costs nothing measurable, and it makes the accounting
//! exact: each posted request yields exactly one completion — success, error or flush —
//! and the per-queue-pair in-flight list shrinks by one for each. "Every posted request
//! of this queue pair is accounted for" is then a count, not an inference from
//! completion order, and the completion queue (one per queue pair, sized to the send
//! queue) can never overflow.
//!
//! A failed operation fails its batch with its own error (`BadKey` for a remote access
//! error — the NIC reports a bad key, a range outside the region and a WRITE to a
//! read-only region alike —, `LocalRange` for a local protection error, `PeerLost`
//! otherwise). As RC prescribes, the queue pair then enters the error state: the other
//! operations in flight are flushed (`PeerLost`), later posts are refused with
//! `PeerLost`, and the peer must be fenced and connected again.
//!
//! # Why only RC
//!
//! RC is the queue-pair type whose one-sided READ/WRITE the responder's NIC executes
//! and key-checks itself. UD has no one-sided RDMA at all: an "RDMA" over UD is
//! emulated in software on the memory node, where a released key is not checked by
//! the NIC, which is the one guarantee the release path relies on (a late WRITE of a
//! region's previous owner must fail at the NIC). UD, UC and anything else are
//! refused in the metadata and both bring-up halves; DC (also NIC-checked) is not
//! implemented in this build and refused too.
//!
//! # Progress: event fd plus a fallback, no busy polling
//!
//! One progress thread per transport blocks in `poll(2)` on the completion channel's
//! (non-blocking) event fd, with a 100 ms timeout. On an event it reads every pending
//! `ibv_get_cq_event`, acknowledges each at once, re-arms that completion queue
//! (`ibv_req_notify_cq`) and only then drains it, so a completion landing after the
//! drain raises a new event. On a timeout it re-arms and drains every queue pair: a
//! lost or never-armed event delays a batch by at most 100 ms instead of stalling it.
//! Drained completions update the batch table and wake `wait` through a `Condvar`, as
//! the soft transport's reader does. Idle, the thread wakes ten times a second and
//! polls each completion queue once; it never spins.
//!
//! # What fence proves
//!
//! [`fence`](crate::transport::Transport::fence) removes the peer (new posts get
//! `NoPeer`), moves its queue pair to ERR — the NIC stops executing it and completes
//! every posted request with a flush error — and drains its completion queue until
//! every posted request has its completion (bounded by 5 s); then it destroys the
//! queue pair. Since every request is signalled, an empty in-flight list means the NIC
//! has finished with each of them: no DMA of that peer's operations touches the
//! staging buffer any more, and their slots can be reused. If the flushes do not all
//! arrive in time the queue pair is destroyed anyway, the operations are failed, and
//! `fence` returns `PeerLost` so the caller keeps those slots out of use.
//!
//! # Not covered here
//!
//! Hosts without an RDMA device can only run the error paths (the unit tests below);
//! the data path needs a NIC (or rdma_rxe / siw) and a second process.

pub(crate) mod device;
pub mod proto;
mod status;
pub mod target;
mod worker;

pub use target::VerbsTarget;
pub use worker::VerbsTransport;

#[cfg(test)]
mod tests;
