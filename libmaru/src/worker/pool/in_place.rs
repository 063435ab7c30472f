//! Writes in place (`cxl`): the caller takes pages of the session's own regions,
//! writes into this host's mapping, then publishes or gives them back. The core's
//! rules are those of stores (`writing`, the `Token` re-check), and a caller holds at
//! most half its session's fair share taken.

use super::core::{Ending, Taken, Token};
use super::wire::EntryRef;
use super::StoragePool;
use crate::dax::Mapping;
use crate::wire::meta::PageGrant;
use crate::worker::clock::Deadline;
use crate::worker::error::WorkerError;
use std::sync::Arc;

/// A page taken for writing in place. Holds its region's mapping, so the memory the
/// caller writes into stays mapped until the page is published or given back, even if
/// the region is lost meanwhile.
pub struct InPlacePage {
    pub page: PageGrant,
    map: Arc<Mapping>,
    /// What its region was when the page was taken (the adoption that mapped it).
    token: Option<Token>,
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
            .map_err(|e| WorkerError::Transport(format!("write in place: {e}")))
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
    /// the session cannot grow and nothing can be evicted), at most maru-server's
    /// batch limit (`max_batch` of its handshake) in one call. `cxl` only.
    pub fn take_in_place(
        &self,
        n: usize,
        route_key: Option<&str>,
    ) -> Result<Vec<InPlacePage>, WorkerError> {
        if !self.mover.writes_in_place() {
            return Err(WorkerError::InvalidArgument(
                "writes in place need backend cxl (this host maps the region); on remote_cxl fill store staging slots (maru_slots_acquire) and store from them".into(),
            ));
        }
        let by = self.deadline();
        // One alloc takes at most a batch: more is "fewer than asked", not an error.
        let n = n.min(self.max_batch);
        // At most half the session's share is held taken in place (`in_place_room`):
        // its share comes with `alloc` replies, asked first if not heard yet.
        if self.session.share_regions().is_none() {
            self.session.alloc(0, route_key, by)?;
        }
        let region_pages = self.session.handshake.region_size / self.page_size().max(1);
        let room = self
            .core
            .lock()
            .in_place_room(self.session.share_regions(), region_pages);
        if room < n {
            log::debug!(
                "pool {}: {n} page(s) asked to write in place, {room} given: at most half of the engine's share of the pool ({:?} regions) is held taken at once",
                self.session.url,
                self.session.share_regions()
            );
        }
        let n = n.min(room);
        if n == 0 {
            return Ok(Vec::new());
        }
        // The pages are marked as being written (`writing`) from here on.
        let taken = self.take_pages(Taken::default(), n, route_key, by)?;
        let size = self.page_size() as usize;
        let mut out = Vec::with_capacity(taken.pages.len());
        let mut unusable = Vec::new();
        for &page in &taken.pages {
            match self.mover.own_mapping(page.region_id) {
                Some(map) if page.offset as usize + size <= map.len() => out.push(InPlacePage {
                    page,
                    map,
                    token: taken.token(page.region_id),
                    capacity: size,
                }),
                _ => unusable.push(page),
            }
        }
        if !unusable.is_empty() {
            log::warn!(
                "pool {}: {} page(s) granted outside this host's mappings of the session's regions; not used",
                self.session.url,
                unusable.len()
            );
            let writing = unusable.iter().map(|p| p.region_id).collect();
            self.store_end(
                Ending {
                    writing,
                    ..Ending::default()
                },
                by,
            );
        }
        self.core.lock().in_place_moved(out.len(), true);
        Ok(out)
    }

    /// Publishes pages written in place (the chunks of one request, in chain order);
    /// per chunk: true when published now or already present. A page whose region is
    /// no longer the pool's (on the adoption it was taken from) is not published
    /// (false) and dropped; a key another engine published first frees its page for
    /// later stores.
    pub fn publish_in_place(&self, writes: Vec<InPlaceWrite>) -> Result<Vec<bool>, WorkerError> {
        // One deadline for every call of the request: re-checks, reports, publishes.
        let by = self.deadline();
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
                self.give_back(writes.into_iter().map(|w| w.page).collect(), by);
                return Err(WorkerError::InvalidArgument(why));
            }
        }
        // No longer held taken, whatever the publish does (see `in_place_room`).
        self.core.lock().in_place_moved(writes.len(), false);
        let mut result = Vec::with_capacity(writes.len());
        let mut writes = writes.into_iter();
        loop {
            let batch: Vec<InPlaceWrite> = writes.by_ref().take(self.max_batch).collect();
            if batch.is_empty() {
                return Ok(result);
            }
            let writing = batch.iter().map(|w| w.page.page.region_id).collect();
            let mut end = Ending {
                writing,
                ..Ending::default()
            };
            let r = self.publish_written(batch, &mut end, by);
            // Whatever happened, the pages are no longer being written.
            self.store_end(end, by);
            result.extend(r?);
        }
    }

    fn publish_written(
        &self,
        writes: Vec<InPlaceWrite>,
        end: &mut Ending,
        by: Deadline,
    ) -> Result<Vec<bool>, WorkerError> {
        let pages: Vec<PageGrant> = writes.iter().map(|w| w.page.page).collect();
        let taken = Taken::of(writes.iter().map(|w| (w.page.page, w.page.token.clone())));
        let entry = |k: usize, before: Option<usize>| {
            let w = &writes[k];
            EntryRef {
                key: &w.key,
                region_id: w.page.page.region_id,
                offset: w.page.page.offset,
                length: w.len as u64,
                prev: before.map(|p| writes[p].key.as_str()),
            }
        };
        let ok = vec![true; writes.len()];
        let mut result = vec![false; writes.len()];
        for k in self.publish(&pages, &ok, &taken, &entry, end, by)? {
            result[k] = true;
        }
        Ok(result)
    }

    /// Gives back pages taken for writing in place and not published: those of regions
    /// still the pool's serve later stores; the others are dropped with their region.
    pub fn give_back_in_place(&self, pages: Vec<InPlacePage>) {
        self.give_back(pages, self.deadline())
    }

    fn give_back(&self, pages: Vec<InPlacePage>, by: Deadline) {
        let writing: Vec<u64> = pages.iter().map(|p| p.page.region_id).collect();
        let unused = {
            let mut c = self.core.lock();
            c.in_place_moved(writing.len(), false);
            pages
                .into_iter()
                .filter(|p| c.token_is(p.page.region_id, p.token.as_ref()))
                .map(|p| p.page)
                .collect()
        };
        let end = Ending {
            unused,
            writing,
            ..Ending::default()
        };
        self.store_end(end, by);
    }
}
