//! `verbs`: real RDMA over RC queue pairs (cargo feature `verbs`), built on `sideway`.
//! rdma-core is loaded at run time (rdma-mummy-sys dlopens `libibverbs.so.1`), so
//! libmaru builds and loads on hosts without it; opening a transport there, or on a
//! host without an RDMA device, fails with [`TransportError::Unavailable`](crate::transport::TransportError::Unavailable) naming the
//! device looked for:
//! `no RDMA device found (looked for mlx5_0); use --transport soft on hosts without RDMA`.
//!
//! # How it maps to the trait
//!
//! * [`VerbsTarget`] (agent, memory node) opens one device port, with one
//!   protection domain per agent connection (`domains.rs`): the connection's
//!   registrations and its responder queue pairs, so a key works only from the
//!   queue pairs of the connection it was issued to. [`Target::register`](crate::transport::Target::register) registers a
//!   memory region with REMOTE_READ (plus REMOTE_WRITE and LOCAL_WRITE when writable)
//!   and returns its rkey, `addr = ptr`, and `{"verbs": {"qp_type": "rc", "device",
//!   "port", "lid", "gid", "target"}}` as the metadata
//!   ([`proto::TargetMeta`]). [`deregister`](crate::transport::Target::deregister) is
//!   `ibv_dereg_mr`: when it returns, the NIC refuses the key (a late READ/WRITE gets a
//!   remote access error, nothing is read or written) and no DMA is still touching the
//!   range; if rdma-core reports a failure the region stays registered and the call
//!   can be retried. [`VerbsTarget::accept_peer_on`] creates a responder RC queue
//!   pair owned by the agent connection that asked ([`QpOwner`]), brings it to RTS
//!   towards the worker's half ([`proto::WorkerHalf`]) and answers with ours
//!   ([`proto::TargetHalf`]); [`VerbsTarget::connection_closed`] destroys that
//!   connection's queue pairs. A connection keeps at most
//!   [`target::MAX_QPS_PER_CONNECTION`] (its newest replaces its oldest); past
//!   [`target::MAX_TARGET_QPS`] in all a new one is refused — a live connection's
//!   queue pair is never evicted.
//! * [`VerbsTransport`] (worker) registers the staging buffer with LOCAL_WRITE only
//!   (READs land in it; its queue pairs accept no remote operation at all).
//!   [`connect`](crate::transport::Transport::connect) creates an RC queue pair and its
//!   own completion queue on the transport's completion channel, sends our half
//!   (lid, gid, qpn, psn, mtu, READ depth) through the `Bringup` callback (the agent's
//!   control connection), takes the target's half and moves the queue pair
//!   INIT → RTR → RTS (path MTU: the smaller of both ports'; READ depth: the smaller of
//!   our initiator depth and the target's responder resources; GRH traffic class and
//!   service level from [`VerbsSettings`]). With `qps_per_agent` > 1 it brings up
//!   that many, and the peer is their group (`lanes.rs`): batches go to them in
//!   turn, an error on one fails only its batches. Connecting again with the same
//!   metadata returns the same peer while all its queue pairs are usable.
//!   [`post`](crate::transport::Transport::post) turns each operation into one RDMA
//!   READ/WRITE work request (one scatter entry in the registered staging buffer) and
//!   posts as much as the send queue has room for as one chain; the rest waits in the
//!   peer's backlog and is posted as completions free room. `post` never blocks.
//!
//! # The verbs calls behind a trait
//!
//! Every call the data path makes goes through `ops::QueuePairOps` (post a chain,
//! poll, arm, move to ERR, destroy) and `ops::MemoryOps` (register, deregister).
//! The bookkeeping over them (`engine.rs` on the worker, `qp_table.rs` at the agent)
//! is tested over a fake queue pair (`fake.rs`) that completes in order, fails a
//! request mid-chain, withholds flushes, fails destroys and refuses a post at a given
//! request: `cargo test -p maru --features verbs --lib transport::verbs` needs no
//! RDMA device. Queue pairs and completion queues are created and destroyed with
//! direct rdma-core calls (`sys.rs`), not sideway's owning types, whose drops assert
//! that a destroy succeeded: a failed destroy is an error that is retried, never a
//! panic.
//!
//! # Open-time checks
//!
//! Only devices of the InfiniBand transport (InfiniBand and RoCE ports) are opened;
//! iWARP (siw, cxgb, irdma in iWARP mode) and others are refused with a clear
//! `Unavailable`. `ibv_fork_init` is called before anything is registered, and the
//! open is refused unless `ibv_is_fork_initialized` reports fork protection enabled
//! or unneeded (a `fork()` in the engine could otherwise leave the NIC writing READ
//! data into pages the process no longer sees). The progress thread also reads the
//! device's async events: a queue-pair error fails that peer, a port error or a
//! fatal device error fails every peer, a port, LID or GID change reads the port's
//! addresses again (a GID change also fails every peer, whose queue pairs use the old
//! one). At the agent a thread of the target reads them off the event loop (an address
//! change re-reads the LID and GID put in every registration's metadata) and retries
//! failed queue-pair destroys.
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
//! # Progress: event fds plus a fallback, no busy polling
//!
//! One progress thread per transport blocks in `poll(2)` on the completion channel's
//! and the async-event fd (both non-blocking), with a 100 ms timeout. On a completion
//! event it reads every pending `ibv_get_cq_event`, acknowledges each at once, re-arms
//! that completion queue (`ibv_req_notify_cq`) and only then drains it, so a
//! completion landing after the drain raises a new event; then it posts what now fits
//! from the backlog. Every 100 ms it sweeps every queue pair the same way (a lost
//! event delays a batch by at most that), fails a backlog that found no send-queue
//! room for 10 s (the peer with it: its queue pair goes to ERR), and retries the
//! destroy of queue pairs whose destroy failed.
//!
//! # What fence proves
//!
//! [`fence`](crate::transport::Transport::fence) stops new posts to the peer, fails
//! its backlog (never posted), moves its queue pair to ERR — the NIC stops executing
//! it and completes every posted request with a flush error — drains its completion
//! queue until every posted request has its completion (bounded by 5 s), then
//! destroys the queue pair. Either proof makes the peer's slots reusable: every
//! request accounted for (a full flush; every request is signalled, so an empty
//! in-flight list means the NIC is done with each), or `ibv_destroy_qp` succeeded
//! (the NIC executes nothing of it afterwards) — so a flush timeout followed by a
//! successful destroy is a success. With neither, `fence` returns `PeerLost` and the
//! peer is kept as a zombie: the caller keeps the slots, the next `fence` of that
//! peer (and every sweep) retries the destroy, and only a successful destroy makes
//! `fence` return `Ok` (after which the peer is unknown: `NoPeer`).
//!
//! # Not covered here
//!
//! The bookkeeping runs over the fake; the rdma-core calls themselves need a NIC (or
//! rdma_rxe; siw is iWARP and refused) and a second process: see
//! `docs/transports.md` for the first bring-up checklist and `maru-rdma-check`.

pub mod check;
pub(crate) mod device;
mod domains;
mod engine;
#[cfg(test)]
mod fake;
mod lanes;
mod ops;
pub mod proto;
mod qp_table;
pub mod settings;
mod status;
mod sys;
pub mod target;
mod worker;

pub use qp_table::QpOwner;
pub use settings::VerbsSettings;
pub use target::VerbsTarget;
pub use worker::VerbsTransport;

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_engine;
