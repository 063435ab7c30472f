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

pub use super::meta_decode::{
    decode_request, one_pass, EntryRef, HotRequest, KeysOp, Request, Text,
};
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

impl PageGrant {
    /// The entry that publishes `key` on this page, `length` bytes of chunk, first of
    /// its chain (no `prev`).
    pub fn entry(&self, key: String, length: u64) -> PublishEntry {
        PublishEntry {
            key,
            region_id: self.region_id,
            offset: self.offset,
            length,
            prev: None,
        }
    }
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
    /// (region id, offset, length), which the region's agent checks before it maps
    /// the range for the reader. Empty for a `cxl` lease: its reader maps the device
    /// itself, no agent checks a token, and a token would prove nothing there. (Still
    /// written, empty, for workers that require the field; read as empty when absent.)
    #[serde(default)]
    pub read_token: String,
    /// The agent serving the region (`remote_cxl`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub agent: Option<String>,
    /// The region on the device (`cxl`). In maru-server's reply, only the first
    /// lease of each region carries it (see `wire::lease_wire`); the decoder gives it
    /// to the later leases of that region.
    #[serde(skip_serializing_if = "Option::is_none")]
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
    /// Per key, in order; `null` for a miss. Each region's device comes with its
    /// first lease only (`wire::lease_wire`).
    Leases {
        #[serde(deserialize_with = "super::lease_wire::filled")]
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
