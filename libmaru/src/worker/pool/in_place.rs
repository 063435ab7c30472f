//! Writes in place (`cxl`): the caller takes pages of the session's own regions,
//! writes each chunk straight into this host's mapping of the page (a GPU copies into
//! it), then publishes it, or gives the pages back. Each byte is moved once, by the
//! caller.
//!
//! The rules are those of every page, plus two of its own:
//! - A page taken for writing in place is the taker's until it publishes or gives it
//!   back: it is out of `spare` (no store takes it), holds no key (no eviction offers
//!   it), and its region is not given back for a fair share while it is taken.
//! - A page is published only while its region is still the session's and mapped by
//!   the same adoption it was taken from (for `cxl`, that mapping is the region's
//!   "boot": a region lost and adopted again is another mapping). Otherwise the bytes
//!   may have been written into memory that is no longer this engine's: nothing is
//!   published and the page is dropped with its region.
//!
//! The checks run with the pool borrowed mutably (under the handler's pool lock), so a
//! heartbeat that loses the region cannot come between the check and the publish.

use super::StoragePool;
use crate::dax::Mapping;
use crate::wire::meta::{PageGrant, PublishEntry};
use crate::worker::error::WorkerError;
use std::sync::Arc;

/// A page taken for writing in place. Holds its region's mapping, so the memory the
/// caller writes into stays mapped until the page is published or given back, even if
/// the region is lost meanwhile.
pub struct InPlacePage {
    pub page: PageGrant,
    map: Arc<Mapping>,
    capacity: usize,
}

impl std::fmt::Debug for InPlacePage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "InPlacePage(region {} page {})",
            self.page.region_id, self.page.page
        )
    }
}

impl InPlacePage {
    /// Start of the page in this host's writable mapping of its region.
    pub fn ptr(&self) -> *mut u8 {
        // In bounds: checked against the mapping's length when the page was taken.
        self.map.as_ptr().wrapping_add(self.page.offset as usize)
    }

    /// Bytes the page holds (the pool's page size).
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Writes `data` at the start of the page (tests, and callers without a raw copy).
    pub fn write(&self, data: &[u8]) -> Result<(), WorkerError> {
        if data.len() > self.capacity {
            return Err(WorkerError::InvalidArgument(format!(
                "{} bytes do not fit a page of {}",
                data.len(),
                self.capacity
            )));
        }
        self.map
            .write_at(self.page.offset as usize, data)
            .map_err(|e| WorkerError::Unavailable(e.to_string()))
    }
}

/// A page written in place, to publish under `key` with its first `len` bytes.
pub struct InPlaceWrite {
    pub key: String,
    pub page: InPlacePage,
    pub len: usize,
}

impl StoragePool {
    /// The mappings of regions the mover holds (`cxl`: own ones writable, others
    /// read-only), for region views.
    pub fn mappings(&self) -> Vec<(u64, Arc<Mapping>)> {
        self.mover.mappings()
    }

    /// Takes `n` pages of the session's own regions for writing in place (fewer when
    /// the session cannot grow and nothing can be evicted). `cxl` only.
    pub fn take_in_place(
        &mut self,
        n: usize,
        route_key: Option<&str>,
    ) -> Result<Vec<InPlacePage>, WorkerError> {
        if !self.mover.writes_in_place() {
            return Err(WorkerError::InvalidArgument(
                "writes in place need backend cxl (this host maps the region); on remote_cxl fill store staging slots (maru_slots_acquire) and store from them".into(),
            ));
        }
        let pages = self.take_pages(n, route_key)?;
        let size = self.page_size() as usize;
        let mut out = Vec::with_capacity(pages.len());
        let mut unusable = Vec::new();
        for page in pages {
            match self.mover.own_mapping(page.region_id) {
                Some(map) if page.offset as usize + size <= map.len() => {
                    *self.in_place.entry(page.region_id).or_default() += 1;
                    out.push(InPlacePage {
                        page,
                        map,
                        capacity: size,
                    });
                }
                _ => unusable.push(page),
            }
        }
        if !unusable.is_empty() {
            log::warn!(
                "pool {}: {} page(s) granted outside this host's mappings of the session's regions; not used",
                self.session.url,
                unusable.len()
            );
        }
        Ok(out)
    }

    /// True while the page's region is the session's and mapped by the adoption the
    /// page was taken from.
    fn still_ours(&self, p: &InPlacePage) -> bool {
        self.mover
            .own_mapping(p.page.region_id)
            .is_some_and(|m| Arc::ptr_eq(&m, &p.map))
    }

    /// The page is no longer taken (published, given back or dropped).
    fn untake(&mut self, region_id: u64) {
        if let Some(c) = self.in_place.get_mut(&region_id) {
            *c -= 1;
            if *c == 0 {
                self.in_place.remove(&region_id);
            }
        }
    }

    /// Whether pages of the region are taken for writing in place now (it must not be
    /// given back then: the takers would write into another engine's memory).
    pub(super) fn taken_in_place(&self, region_id: u64) -> bool {
        self.in_place.contains_key(&region_id)
    }

    /// Publishes pages written in place (the chunks of one request, in chain order);
    /// per chunk: true when published now or already present. A page whose region is
    /// no longer the session's is not published (false) and dropped; a key another
    /// engine published first frees its page for later stores.
    pub fn publish_in_place(
        &mut self,
        writes: Vec<InPlaceWrite>,
    ) -> Result<Vec<bool>, WorkerError> {
        let size = self.page_size() as usize;
        for w in &writes {
            if w.key.is_empty() || w.len > size {
                let why = if w.key.is_empty() {
                    "empty key".to_string()
                } else {
                    format!(
                        "chunk {} is {} bytes, larger than the page size {size}",
                        w.key, w.len
                    )
                };
                // Nothing is published; the pages go back for later stores.
                self.give_back_in_place(writes.into_iter().map(|w| w.page).collect());
                return Err(WorkerError::InvalidArgument(why));
            }
        }
        // maru-server hears the regions' boot ids before a key is published.
        self.report_boots()?;
        let mut result = vec![false; writes.len()];
        let mut live = Vec::with_capacity(writes.len());
        for (i, w) in writes.into_iter().enumerate() {
            self.untake(w.page.page.region_id);
            if self.still_ours(&w.page) {
                live.push((i, w));
            } else {
                self.stats.store_skipped += 1;
                log::warn!(
                    "pool {}: chunk {} not published: region {} was lost while it was written in place",
                    self.session.url,
                    w.key,
                    w.page.page.region_id
                );
            }
        }
        for batch in live.chunks(self.max_batch.max(1)) {
            let entries: Vec<PublishEntry> = batch
                .iter()
                .enumerate()
                .map(|(j, (_, w))| PublishEntry {
                    key: w.key.clone(),
                    region_id: w.page.page.region_id,
                    offset: w.page.page.offset,
                    length: w.len as u64,
                    prev: j.checked_sub(1).map(|p| batch[p].1.key.clone()),
                })
                .collect();
            let is_new = match self.session.publish(entries) {
                Ok(n) => n,
                Err(e) => {
                    // Not published: the pages hold no key and go back for reuse.
                    self.keep_spare(batch.iter().map(|(_, w)| w.page.page).collect());
                    return Err(e);
                }
            };
            let mut unused = Vec::new();
            for ((i, w), new) in batch.iter().zip(is_new) {
                result[*i] = true;
                if new {
                    self.stats.stored += 1;
                    self.stats.bytes_stored += w.len as u64;
                } else {
                    // Another engine published the key first: the page is not needed.
                    self.stats.already_present += 1;
                    unused.push(w.page.page);
                }
            }
            self.keep_spare(unused);
        }
        Ok(result)
    }

    /// Gives back pages taken for writing in place and not published: those of regions
    /// still the session's serve later stores; the others are dropped with their region.
    pub fn give_back_in_place(&mut self, pages: Vec<InPlacePage>) {
        let mut back = Vec::with_capacity(pages.len());
        for p in pages {
            self.untake(p.page.region_id);
            if self.still_ours(&p) {
                back.push(p.page);
            }
        }
        self.keep_spare(back);
    }
}
