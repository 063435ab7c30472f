//! What a pool counts ([`PoolStats`], kept by the pool core), reported by `stats()`.

/// Counters of a pool, reported by `stats()`.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct PoolStats {
    pub stored: u64,
    pub store_skipped: u64,
    pub already_present: u64,
    pub bytes_stored: u64,
    pub hits: u64,
    pub misses: u64,
    pub load_failed: u64,
    pub bytes_loaded: u64,
    pub regions: u64,
    /// Regions taken before the session's regions were full (see `Mover::wants_lead`).
    pub regions_ahead: u64,
    /// Bytes of own regions faulted in off the store path (`cxl`).
    pub prefaulted_bytes: u64,
    /// Regions maru-server no longer counted among the session's (see `heartbeat`),
    /// or given back because their agent stayed silent (see `tick`).
    pub regions_lost: u64,
    /// Why the last load that failed failed (an agent's refusal, say).
    pub last_load_error: Option<String>,
    /// Keys of the session's own regions removed to make room for new stores, and
    /// their bytes.
    pub evictions: u64,
    pub bytes_evicted: u64,
    /// Regions given back because maru-server asked for a fair share of a full pool.
    pub regions_given_back: u64,
    /// Chunks not stored because no page could be found or made free (every page of
    /// the session leased or pinned, and no region to be had).
    pub store_no_room: u64,
    /// Chunks not stored, per reason (see `skips`).
    pub skipped: crate::worker::skips::SkipCounts,
}

impl PoolStats {
    /// Adds another pool's counters (the handler's total); the last load error is
    /// the other's when it has one.
    pub fn add(&mut self, s: &PoolStats) {
        let PoolStats {
            stored,
            store_skipped,
            already_present,
            bytes_stored,
            hits,
            misses,
            load_failed,
            bytes_loaded,
            regions,
            regions_ahead,
            prefaulted_bytes,
            regions_lost,
            last_load_error,
            evictions,
            bytes_evicted,
            regions_given_back,
            store_no_room,
            skipped,
        } = s;
        // Every field named above: a new counter must be added here to compile.
        self.stored += stored;
        self.store_skipped += store_skipped;
        self.already_present += already_present;
        self.bytes_stored += bytes_stored;
        self.hits += hits;
        self.misses += misses;
        self.load_failed += load_failed;
        self.bytes_loaded += bytes_loaded;
        self.regions += regions;
        self.regions_ahead += regions_ahead;
        self.prefaulted_bytes += prefaulted_bytes;
        self.regions_lost += regions_lost;
        if last_load_error.is_some() {
            self.last_load_error.clone_from(last_load_error);
        }
        self.evictions += evictions;
        self.bytes_evicted += bytes_evicted;
        self.regions_given_back += regions_given_back;
        self.store_no_room += store_no_room;
        self.skipped.add(skipped);
    }
}
