//! Messages of the metadata server protocol (service name `maru-server`).
//!
//! A worker opens a *storage session* (engine id, cache namespace, KV layout digest,
//! backend), gets regions for it (the first with the session, one more per
//! `expand`), takes pages of its regions (`alloc`), writes them, then **publishes**
//! the keys. Sessions of the same namespace, layout and backend find published keys
//! (`exists`) and read them under a lease (`acquire` … `release_leases`). Eviction
//! (`victims`, `remove`) acts only on keys of the caller's own regions. A region goes
//! back with `return_region` after its agent released it; `close` ends a session and
//! hands its regions with keys to the server's region keeper.
//!
//! Each request is a JSON object with an `op` field; each reply is tagged by `kind`.
//! Offsets of pages, keys and leases are relative to the start of their region.
//!
//! Errors: `refused` — definitively not done and nothing held (unknown, ended or
//! foreign session: open a new one; a region larger than the RM's largest pool: do
//! not retry; the session or lease limit); `bad_request` — malformed input, a batch
//! over [`MAX_BATCH`], a double free (nothing changed); `permission` — another
//! session's region or lease (nothing changed); `no_space` — the RM has no room now
//! (the keeper may be giving a kept region back: retry); `unsupported` — a backend
//! this server is not configured for; `internal` — the RM could not be reached.

use super::rm::{Handle, PoolInfo};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Service name announced in the handshake.
pub const SERVICE: &str = "maru-server";
/// Capability: storage sessions for workers attached to CXL (they map regions
/// themselves).
pub const CAP_CXL_STORAGE: &str = "cxl_storage_v1";
/// Capability: storage sessions for workers that reach CXL memory of memory nodes
/// through agents; offered only when the server knows agents.
pub const CAP_REMOTE_CXL_STORAGE: &str = "remote_cxl_storage_v1";
/// Most keys, pages, entries or lease ids one request may carry. A larger batch is
/// refused whole (`bad_request`) and changes nothing.
pub const MAX_BATCH: usize = 4096;
/// Longest key (bytes).
pub const MAX_KEY_LEN: usize = 1024;
/// Longest engine id, namespace or layout digest (bytes).
pub const MAX_NAME_LEN: usize = 1024;
/// Most leases one session may hold at a time.
pub const LEASE_LIMIT: usize = 4096;
/// Most pages a heartbeat's `held_pages` may name (a larger report is refused whole,
/// `bad_request`; at most about 0.5 MiB of JSON, within a frame).
pub const MAX_HELD_PAGES: usize = 2 * MAX_BATCH;

/// Where a session's KV lives and how its worker reaches it.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[serde(rename_all = "snake_case")]
pub enum Backend {
    /// The worker is attached to the CXL memory and maps regions itself.
    Cxl,
    /// The worker reaches CXL memory of memory nodes with one-sided RDMA; each
    /// region is served by one agent.
    RemoteCxl,
}

impl Backend {
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Cxl => "cxl",
            Backend::RemoteCxl => "remote_cxl",
        }
    }
}

/// A key to publish at the location the caller wrote it to.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct PublishEntry {
    pub key: String,
    pub region_id: u64,
    /// Offset of the key's page in the region (a multiple of the page size).
    pub offset: u64,
    /// Bytes of the chunk (1 to the page size).
    pub length: u64,
    /// The key of the chunk before this one in its prefix chain (none for a chain's
    /// first chunk, or when the caller does not know). maru-server evicts the tails
    /// of chains before their heads with it; it is never checked to exist.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prev: Option<String>,
}

/// One page of a region.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Hash)]
pub struct PageRef {
    pub region_id: u64,
    pub page: u64,
}

fn yes() -> bool {
    true
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum MetaRequest {
    /// What this server offers: capabilities, the RM address, the agents, sizes.
    Handshake {},
    /// Open a storage session, with its first region unless `first_region` is false
    /// (a reader that never stores holds no region; the first store `expand`s).
    /// `layout` is the worker's digest of its KV layout (model, dtype, block and chunk
    /// size ...): keys are shared only between sessions of the same namespace, layout
    /// and backend.
    OpenSession {
        engine_id: String,
        namespace: String,
        layout: String,
        backend: Backend,
        #[serde(default = "yes")]
        first_region: bool,
    },
    /// One more region for the session.
    Expand { session: u64 },
    /// Up to `count` free pages of the session's regions. Never asks the RM: when the
    /// regions have fewer free pages the reply says how many are missing, and the
    /// worker calls `expand` (or evicts) for them.
    Alloc {
        session: u64,
        count: u32,
        /// The request's first chunk key. Pools are chosen by the worker, so the
        /// server only checks its length.
        #[serde(default)]
        route_key: Option<String>,
    },
    /// Give back pages taken with `alloc` that hold no published key (a store that
    /// was skipped, a key someone else published first). All or nothing.
    FreePages { session: u64, pages: Vec<PageRef> },
    /// Make keys findable. Only after the worker's WRITE of each chunk completed;
    /// only into allocated pages of the caller's own regions (all or nothing). The
    /// first publish of a key wins: later ones report `is_new: false` and change
    /// nothing (their page stays the caller's, to free or reuse).
    Publish {
        session: u64,
        entries: Vec<PublishEntry>,
    },
    /// Whether each key is published (same namespace, layout and backend).
    Exists { session: u64, keys: Vec<String> },
    /// A lease with a read handle for each found key; `null` for a miss.
    Acquire { session: u64, keys: Vec<String> },
    /// End leases of this session. An id of another session refuses the request
    /// whole; an id that already ended (region returned, lease expired) reports
    /// `false`.
    ReleaseLeases { session: u64, lease_ids: Vec<u64> },
    /// Up to `max` keys of the caller's own regions that no lease holds, least
    /// recently used first.
    Victims { session: u64, max: u32 },
    /// Unpublish keys of the caller's own regions and free their pages. Keys of other
    /// sessions' regions and leased keys are refused per key and stay as they are.
    Remove { session: u64, keys: Vec<String> },
    /// Pin found keys: a pinned key is neither a victim nor removed, and its region
    /// is not given back to make room, until the session unpins it or ends (or the
    /// region is lost). Counted per session and key. Misses are not pinned.
    Pin { session: u64, keys: Vec<String> },
    /// Drop one of this session's pins of each key.
    Unpin { session: u64, keys: Vec<String> },
    /// Give a region of the session back. `released`: its agent confirmed the
    /// release (or the region was never mapped and the agent holds nothing). Without
    /// it a `remote_cxl` region is released by the server before the RM frees it.
    ReturnRegion {
        session: u64,
        region_id: u64,
        released: bool,
    },
    /// The session is alive; the boot id its agent reported for each region it maps
    /// (`remote_cxl`), and the regions it maps without one (`cxl`). Named regions that
    /// are no longer the session's come back in `unknown_regions`.
    ///
    /// `leases`: the leases the worker holds now (reading, or views it lent out),
    /// at most [`LEASE_LIMIT`]. A maru-server that restarted on its durable directory
    /// keeps the pages of those keys from reuse while they run, and hands the pages
    /// of other recovered keys out again once every session of its last run has
    /// said what it holds (or ended). None: a worker that does not say (an older
    /// one): the server then waits out the lease timeout for it.
    Heartbeat {
        session: u64,
        #[serde(default, deserialize_with = "region_keyed")]
        boot_ids: BTreeMap<u64, String>,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        regions: Vec<u64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        leases: Option<Vec<HeldLease>>,
        /// The chunks the worker's stores into this pool skipped since it opened, per
        /// reason (absent from older workers); maru-server keeps the last report of
        /// each session for `stats` and `maru-usage`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        skipped: Option<SkipCounts>,
        /// Every page maru-server handed this session that holds no key the worker
        /// published and that the worker may still write or is writing (its spare
        /// pages, pages of stores in progress, pages taken in place, pages of failed
        /// writes kept out of use), at most [`MAX_HELD_PAGES`]; sent once, when a
        /// heartbeat reply asks for it (`held_pages_wanted`), with no reply of the
        /// last run that hands the worker pages still to come. A restarted
        /// maru-server frees the session's other pages it found allocated without a
        /// key. None: not a report (every other heartbeat, older workers).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        held_pages: Option<Vec<PageRef>>,
    },
    /// End the session. `drained`: the worker settled its WRITEs and leaves its
    /// regions to the region keeper (regions with keys stay readable, the others go
    /// back). Without it every region of the session goes back and its keys go.
    Close { session: u64, drained: bool },
    /// Counters of one session (or all) and the totals.
    Stats {
        #[serde(default)]
        session: Option<u64>,
    },
    /// Regions and bytes per session and kept by the region keeper.
    Usage,
}

/// A map keyed by region id. JSON object keys are strings, and a request body is
/// buffered before it is decoded (its `op` tag, the envelope's flattened fields), so
/// the ids arrive as strings and are parsed here.
fn region_keyed<'de, D>(d: D) -> Result<BTreeMap<u64, String>, D::Error>
where
    D: serde::Deserializer<'de>,
{
    let raw = BTreeMap::<String, String>::deserialize(d)?;
    raw.into_iter()
        .map(|(k, v)| match k.parse::<u64>() {
            Ok(id) => Ok((id, v)),
            Err(_) => Err(serde::de::Error::custom(format!(
                "{k:?} is not a region id"
            ))),
        })
        .collect()
}

/// A region handed to a session.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct RegionGrant {
    /// The full handle: the worker maps (`cxl`) or has its agent map (`remote_cxl`)
    /// the region with it, and releases it with it.
    pub handle: Handle,
    pub pool: PoolInfo,
    /// The agent serving the region (`host:port`); none for `cxl`.
    pub agent: Option<String>,
    pub page_size: u64,
    /// Pages in the region.
    pub pages: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct HandshakeReply {
    pub service: String,
    pub capabilities: Vec<String>,
    pub rm_address: String,
    /// Agents of the pool (`host:port`), for `remote_cxl`.
    pub agents: Vec<String>,
    /// Size of one region (bytes; the RM may round it up to its alignment).
    pub region_size: u64,
    /// Size of one page, which holds one chunk (bytes).
    pub chunk_size: u64,
    pub max_batch: usize,
    pub lease_limit: usize,
    /// A session without a request for this long expires.
    pub session_timeout_ms: u64,
    pub lease_timeout_ms: u64,
    /// This run of maru-server (another value after a restart; empty from older servers).
    #[serde(default)]
    pub instance: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct SessionReply {
    pub session: u64,
    pub page_size: u64,
    /// The first region; none when the open asked for none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub region: Option<RegionGrant>,
    /// Heartbeat well within this (a third of it, say).
    pub session_timeout_ms: u64,
    pub lease_timeout_ms: u64,
    pub lease_limit: usize,
    /// The session's secret (hex): the session answers only the connection that
    /// opened it, or a new connection whose hello presents this secret (`resume`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_secret: Option<String>,
}

/// A page taken by `alloc`.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub struct PageGrant {
    pub region_id: u64,
    pub page: u64,
    /// `page × page_size`.
    pub offset: u64,
    pub length: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct PagesReply {
    pub pages: Vec<PageGrant>,
    /// Pages asked for that the session's regions could not give: call `expand`.
    pub missing: u32,
    /// Regions the session is asked to give back (as `HeartbeatReply::give_back`),
    /// carried on this reply so that a storing session hears it at its next call.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub give_back: Vec<u64>,
    /// The session's fair share of the pool now, in regions: the RM's pools ÷ the
    /// storing tenants (itself counted), within its tenant's `max_regions`, ÷ its
    /// tenant's storing sessions; rounded up, at least one. The worker holds at most
    /// half of it in pages taken for writing in place.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub share_regions: Option<u64>,
}

/// Where a cxl reader finds a region on its own device.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct DeviceRange {
    pub uuid: String,
    /// Device path on the RM's host (the reader looks the UUID up locally).
    pub path: String,
    /// Offset of the region in the device.
    pub region_offset: u64,
    pub region_length: u64,
}

/// A lease on a found key: the range to read and the read handle for it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct LeaseGrant {
    pub lease_id: u64,
    pub region_id: u64,
    pub offset: u64,
    pub length: u64,
    /// Read token of exactly this range: HMAC of the region's RM token over
    /// (region id, offset, length).
    pub read_token: String,
    /// The agent serving the region (`remote_cxl`).
    pub agent: Option<String>,
    /// The region on the device (`cxl`).
    pub device: Option<DeviceRange>,
    /// The lease ends by itself after this long.
    pub expires_in_ms: u64,
    /// The memory node's boot id the region's keys were written under, as its owner
    /// reported it (`remote_cxl`). A reader whose agent reports another boot id reads
    /// nothing: the node rebooted and maru-server has not heard it yet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boot_id: Option<String>,
}

/// A lease a worker still holds, as it tells maru-server in its heartbeats: the id
/// and the page it was granted for, and how long it has left.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub struct HeldLease {
    pub lease_id: u64,
    pub region_id: u64,
    pub offset: u64,
    pub expires_in_ms: u64,
}

/// Chunks a worker's stores skipped (their result `false`, status OK), per reason,
/// since its handler opened the session's pool: as it tells maru-server in its
/// heartbeats, and as `stats` shows the last report per session. Reasons a worker
/// does not know are absent (0); reasons this build does not know are ignored.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(default)]
pub struct SkipCounts {
    /// No region to be had and nothing of the engine's own to evict.
    pub no_region: u64,
    /// No free staging slot.
    pub no_slot: u64,
    /// maru-server unavailable.
    pub pool_unavailable: u64,
    /// The engine's `max_bytes` reached and nothing to evict.
    pub max_bytes: u64,
}

/// A published key and where it is.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct KeyInfo {
    pub key: String,
    pub region_id: u64,
    pub offset: u64,
    pub length: u64,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum RemoveResult {
    /// Unpublished; its page is free again.
    Removed,
    NotFound,
    /// Refused: the key is in a region of another session or of the keeper.
    NotOwner,
    /// Refused: a reader holds a lease on it.
    Leased,
    /// Refused: a session pins it.
    Pinned,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ReturnReply {
    pub region_id: u64,
    /// The RM freed the region. False: the server finishes (release, free) later.
    pub freed: bool,
    pub keys_dropped: usize,
    pub leases_ended: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct HeartbeatReply {
    /// Regions named in the heartbeat that are not the session's (ignored).
    pub unknown_regions: Vec<u64>,
    /// Regions whose boot id changed: the memory node rebooted and their keys went.
    pub rebooted_regions: Vec<u64>,
    pub expires_in_ms: u64,
    /// Regions the session is asked to give back (evict, release at the agent,
    /// return): it holds more than its fair share of a full pool and another storing
    /// session waits for a region.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub give_back: Vec<u64>,
    /// maru-server restarted on its durable directory since this session was opened
    /// and wants to hear which pages the worker holds without a key (`held_pages` in
    /// a heartbeat): it then frees the others it found allocated without a key.
    #[serde(default, skip_serializing_if = "is_false")]
    pub held_pages_wanted: bool,
}

fn is_false(b: &bool) -> bool {
    !*b
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct CloseReply {
    /// Regions with keys the region keeper took over (still readable).
    pub kept: Vec<u64>,
    /// Regions going back (released at their agent, then freed at the RM).
    pub given_back: Vec<u64>,
    /// Leases the session held as a reader, now ended.
    pub leases_ended: usize,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct SessionStats {
    pub session: u64,
    pub engine_id: String,
    /// The tenant whose key opened it.
    #[serde(default)]
    pub tenant: String,
    pub backend: Option<Backend>,
    /// Published keys in the session's regions.
    pub keys: u64,
    pub regions: u64,
    /// Bytes of the session's regions.
    pub region_bytes: u64,
    /// Bytes of its published chunks.
    pub key_bytes: u64,
    /// Keys this session found / did not find with `acquire`.
    pub hits: u64,
    pub misses: u64,
    /// Leases the session holds now.
    pub leases: u64,
    /// Distinct keys the session pins now.
    #[serde(default)]
    pub pins: u64,
    /// Chunks its worker skipped, per reason, as its last heartbeat said (0 before
    /// one said, and for older workers).
    #[serde(default)]
    pub skipped: SkipCounts,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct TotalStats {
    pub sessions: u64,
    pub keys: u64,
    pub regions: u64,
    pub region_bytes: u64,
    pub key_bytes: u64,
    /// Since the server started, over every session.
    pub hits: u64,
    pub misses: u64,
    pub leases: u64,
    /// Distinct pinned keys.
    #[serde(default)]
    pub pinned_keys: u64,
    /// Regions of departed workers held by the region keeper, and their keys.
    pub kept_regions: u64,
    pub kept_keys: u64,
    /// Regions on their way back to the RM (release, then free).
    pub giving_back: u64,
    /// Keys removed by their owners since the server started (evictions).
    #[serde(default)]
    pub removed: u64,
    /// Of those, keys that still had stored successors in their prefix chain, which
    /// no load can reach after them.
    #[serde(default)]
    pub chains_cut: u64,
    /// Regions sessions returned because maru-server asked them for their fair share.
    #[serde(default)]
    pub fair_share_returns: u64,
    /// Storing sessions waiting for a region of the full pool now.
    #[serde(default)]
    pub waiting_for_region: u64,
    /// Requests waiting for the RM to allocate a region now.
    #[serde(default)]
    pub waiting_for_rm: u64,
    /// What the last start recovered from the durable directory (`--state-dir`):
    /// keys, regions, and how long it took (0 for a server in memory).
    #[serde(default)]
    pub recovered_keys: u64,
    #[serde(default)]
    pub recovered_regions: u64,
    #[serde(default)]
    pub recovery_ms: u64,
    /// Pages the last start found allocated without a key (a session's reserve, a
    /// publish lost in the crash) and not yet freed, and those freed so far because
    /// their session's report of the pages it holds (`held_pages`) did not name them.
    #[serde(default)]
    pub pages_in_doubt: u64,
    #[serde(default)]
    pub pages_in_doubt_freed: u64,
    /// Chunks skipped per reason, as the open sessions' workers last said, summed
    /// (saturating: the counts are the workers' word).
    #[serde(default)]
    pub skipped: SkipCounts,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct StatsReply {
    pub total: TotalStats,
    pub sessions: Vec<SessionStats>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct SessionUsage {
    pub session: u64,
    pub engine_id: String,
    pub client_id: String,
    /// The tenant whose key opened it.
    #[serde(default)]
    pub tenant: String,
    pub backend: Backend,
    pub namespace: String,
    pub regions: u64,
    /// Bytes of its regions.
    pub allocated: u64,
    /// Bytes of its pages in use.
    pub used: u64,
    /// Whether a connection of its client was open at its last request.
    pub connected: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct UsageReply {
    pub sessions: Vec<SessionUsage>,
    pub kept_regions: u64,
    pub kept_bytes: u64,
    pub giving_back: u64,
    pub giving_back_bytes: u64,
}

/// The result of each request, tagged by kind so a reply decodes without knowing the
/// request it answers.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum MetaReply {
    Handshake(HandshakeReply),
    Session(SessionReply),
    Region(RegionGrant),
    Pages(PagesReply),
    PagesFreed {
        freed: usize,
    },
    /// Per entry, in order.
    Published {
        is_new: Vec<bool>,
        /// Regions the session is asked to give back (as `HeartbeatReply::give_back`).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        give_back: Vec<u64>,
    },
    /// Per key, in order.
    Exists {
        found: Vec<bool>,
    },
    /// Per key, in order; `null` for a miss.
    Leases {
        leases: Vec<Option<LeaseGrant>>,
    },
    /// Per lease id, in order.
    LeasesReleased {
        released: Vec<bool>,
    },
    Victims {
        victims: Vec<KeyInfo>,
    },
    /// Per key, in order.
    Removed {
        results: Vec<RemoveResult>,
    },
    /// Per key, in order: found and pinned.
    Pinned {
        pinned: Vec<bool>,
    },
    /// Per key, in order: this session held a pin of it, and one was dropped.
    Unpinned {
        unpinned: Vec<bool>,
    },
    Returned(ReturnReply),
    Heartbeat(HeartbeatReply),
    Closed(CloseReply),
    Stats(StatsReply),
    Usage(UsageReply),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{decode_json, encode_json, Envelope, ReplyEnvelope};
    use proptest::prelude::*;

    fn handle() -> Handle {
        Handle::example()
    }

    #[test]
    fn request_json_shape() {
        let env: Envelope<MetaRequest> = decode_json(br#"{"id":1,"op":"handshake"}"#).unwrap();
        assert_eq!(env.body, MetaRequest::Handshake {});
        let env: Envelope<MetaRequest> = decode_json(
            br#"{"id":2,"op":"open_session","engine_id":"e","namespace":"n",
                 "layout":"l","backend":"remote_cxl"}"#,
        )
        .unwrap();
        assert!(matches!(
            env.body,
            MetaRequest::OpenSession {
                backend: Backend::RemoteCxl,
                first_region: true,
                ..
            }
        ));
        let env: Envelope<MetaRequest> =
            decode_json(br#"{"id":3,"op":"alloc","session":1,"count":2}"#).unwrap();
        assert_eq!(
            env.body,
            MetaRequest::Alloc {
                session: 1,
                count: 2,
                route_key: None
            }
        );
        let env: Envelope<MetaRequest> =
            decode_json(br#"{"id":4,"op":"heartbeat","session":1,"boot_ids":{"7":"b0","9":"b1"}}"#)
                .unwrap();
        match env.body {
            MetaRequest::Heartbeat { boot_ids, .. } => {
                assert_eq!(boot_ids.get(&7).map(String::as_str), Some("b0"));
                assert_eq!(boot_ids.len(), 2);
            }
            other => panic!("{other:?}"),
        }
        let env: Envelope<MetaRequest> = decode_json(br#"{"id":5,"op":"stats"}"#).unwrap();
        assert_eq!(env.body, MetaRequest::Stats { session: None });
        let env: Envelope<MetaRequest> = decode_json(br#"{"id":6,"op":"usage"}"#).unwrap();
        assert_eq!(env.body, MetaRequest::Usage);
    }

    #[test]
    fn requests_round_trip() {
        let reqs = [
            MetaRequest::Heartbeat {
                session: 2,
                boot_ids: [(7, "b0".to_string()), (u64::MAX, "b1".to_string())].into(),
                regions: vec![],
                leases: None,
                skipped: None,
                held_pages: None,
            },
            MetaRequest::Heartbeat {
                session: 2,
                boot_ids: BTreeMap::new(),
                regions: vec![3, u64::MAX],
                leases: Some(vec![HeldLease {
                    lease_id: u64::MAX,
                    region_id: 3,
                    offset: 1 << 20,
                    expires_in_ms: 59_000,
                }]),
                skipped: Some(SkipCounts {
                    no_region: 1,
                    max_bytes: u64::MAX,
                    ..Default::default()
                }),
                held_pages: Some(vec![PageRef {
                    region_id: u64::MAX,
                    page: 0,
                }]),
            },
            MetaRequest::Publish {
                session: 2,
                entries: vec![PublishEntry {
                    key: "k".into(),
                    region_id: 1,
                    offset: 0,
                    length: 9,
                    prev: Some("j".into()),
                }],
            },
            MetaRequest::FreePages {
                session: 2,
                pages: vec![PageRef {
                    region_id: 1,
                    page: 3,
                }],
            },
            MetaRequest::Stats { session: Some(4) },
            MetaRequest::Handshake {},
            MetaRequest::Usage,
        ];
        for body in reqs {
            let env = Envelope { id: 8, body };
            let back: Envelope<MetaRequest> = decode_json(&encode_json(&env)).unwrap();
            assert_eq!(back, env);
        }
    }

    #[test]
    fn malformed_requests_are_errors() {
        for body in [
            &br#"{"id":1,"op":"nope"}"#[..],
            br#"{"id":1,"op":"alloc","session":1}"#,
            br#"{"id":1,"op":"alloc","session":1,"count":-1}"#,
            br#"{"id":1,"op":"open_session","engine_id":"e","namespace":"n","layout":"l",
                 "backend":"cpu"}"#,
            br#"{"id":1,"op":"heartbeat","session":1,"boot_ids":{"x":"b"}}"#,
            br#"{"id":1,"op":"heartbeat","session":1,"skipped":{"no_region":-1}}"#,
            br#"{"id":1,"op":"heartbeat","session":1,"held_pages":[{"region_id":-1,"page":0}]}"#,
            br#"{"id":1,"op":"heartbeat","session":1,"held_pages":[{"region_id":1}]}"#,
            br#"{"id":1,"op":"heartbeat","session":1,"held_pages":7}"#,
            br#"{"id":1,"op":"heartbeat","session":1,"skipped":{"max_bytes":1e30}}"#,
            br#"{"id":1,"op":"exists","session":1,"keys":"k"}"#,
            br#"[1,2]"#,
        ] {
            assert!(
                decode_json::<Envelope<MetaRequest>>(body).is_err(),
                "{}",
                String::from_utf8_lossy(body)
            );
        }
    }

    #[test]
    fn replies_round_trip_by_kind() {
        let grant = RegionGrant {
            handle: handle(),
            pool: PoolInfo {
                pool_id: 0,
                path: "/dev/dax0.0".into(),
                uuid: "u".into(),
                kind: "devdax".into(),
                total: 1 << 30,
                free: 1 << 29,
                align: 2 << 20,
                draining: 0,
            },
            agent: Some("10.0.0.2:9860".into()),
            page_size: 1 << 20,
            pages: 2,
        };
        let replies = [
            MetaReply::Region(grant.clone()),
            MetaReply::Session(SessionReply {
                session: 3,
                page_size: 1 << 20,
                region: Some(grant),
                session_timeout_ms: 30_000,
                lease_timeout_ms: 60_000,
                lease_limit: LEASE_LIMIT,
                session_secret: Some("ab".into()),
            }),
            MetaReply::Leases {
                leases: vec![
                    None,
                    Some(LeaseGrant {
                        lease_id: 1,
                        region_id: 4,
                        offset: 0,
                        length: 10,
                        read_token: "ab".into(),
                        agent: None,
                        device: None,
                        expires_in_ms: 5,
                        boot_id: Some("boot-1".into()),
                    }),
                ],
            },
            MetaReply::Removed {
                results: vec![RemoveResult::NotOwner, RemoveResult::Removed],
            },
            MetaReply::PagesFreed { freed: 2 },
            MetaReply::Pinned {
                pinned: vec![true, false],
            },
            MetaReply::Unpinned {
                unpinned: vec![false],
            },
            MetaReply::Usage(UsageReply {
                sessions: vec![],
                kept_regions: 1,
                kept_bytes: 2,
                giving_back: 0,
                giving_back_bytes: 0,
            }),
        ];
        for r in replies {
            let env = ReplyEnvelope {
                id: 1,
                ok: Some(r.clone()),
                err: None,
            };
            let back: ReplyEnvelope<MetaReply> = decode_json(&encode_json(&env)).unwrap();
            assert_eq!(back.ok, Some(r));
        }
    }

    fn op_names() -> impl Strategy<Value = String> {
        prop_oneof![
            Just("handshake".to_string()),
            Just("open_session".to_string()),
            Just("expand".to_string()),
            Just("alloc".to_string()),
            Just("free_pages".to_string()),
            Just("publish".to_string()),
            Just("exists".to_string()),
            Just("acquire".to_string()),
            Just("release_leases".to_string()),
            Just("victims".to_string()),
            Just("remove".to_string()),
            Just("pin".to_string()),
            Just("unpin".to_string()),
            Just("return_region".to_string()),
            Just("heartbeat".to_string()),
            Just("close".to_string()),
            Just("stats".to_string()),
            Just("usage".to_string()),
            "[a-z_]{0,14}",
        ]
    }

    /// Odd JSON values for any field: numbers of every sign and size, strings,
    /// nested arrays and objects.
    fn odd_value() -> impl Strategy<Value = serde_json::Value> {
        use serde_json::{json, Value};
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(|n| json!(n)),
            any::<u64>().prop_map(|n| json!(n)),
            any::<f64>().prop_map(|f| json!(f)),
            ".{0,12}".prop_map(Value::String),
        ];
        leaf.prop_recursive(3, 24, 4, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                proptest::collection::btree_map("[a-z0-9_]{0,8}", inner, 0..4)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest! {
        /// The request decoder rejects or accepts arbitrary bytes without panicking.
        #[test]
        fn decoder_never_panics(data in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode_json::<Envelope<MetaRequest>>(&data);
        }

        /// Known and unknown ops with odd values in every field a request may carry.
        #[test]
        fn odd_json_never_panics(
            op in op_names(),
            fields in proptest::collection::btree_map(
                prop_oneof![
                    Just("session".to_string()), Just("count".to_string()),
                    Just("keys".to_string()), Just("entries".to_string()),
                    Just("pages".to_string()), Just("lease_ids".to_string()),
                    Just("boot_ids".to_string()), Just("backend".to_string()),
                    Just("engine_id".to_string()), Just("namespace".to_string()),
                    Just("layout".to_string()), Just("region_id".to_string()),
                    Just("released".to_string()), Just("drained".to_string()),
                    Just("max".to_string()), Just("route_key".to_string()),
                    Just("leases".to_string()), Just("regions".to_string()),
                    Just("skipped".to_string()),
                    Just("id".to_string()), "[a-z_]{1,8}",
                ],
                odd_value(),
                0..8,
            ),
        ) {
            let mut obj = serde_json::Map::new();
            obj.insert("id".into(), serde_json::json!(1));
            for (k, v) in fields {
                obj.insert(k, v);
            }
            obj.insert("op".into(), serde_json::Value::String(op));
            let body = serde_json::Value::Object(obj).to_string();
            let _ = decode_json::<Envelope<MetaRequest>>(body.as_bytes());
        }
    }
}
