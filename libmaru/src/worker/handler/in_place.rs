//! Writes in place through the handler (`cxl`): the pages the caller took, by
//! (region id, page index), until published or given back (the rules are
//! `pool::in_place`'s); and views of whole regions this host maps.

use super::{Handler, Inner};
use crate::dax::Mapping;
use crate::worker::config::BackendKind;
use crate::worker::error::WorkerError;
use crate::worker::pool::{InPlacePage, InPlaceWrite, StoragePool};
use std::collections::HashMap;
use std::sync::{Arc, MutexGuard};

/// A page taken for writing in place, as the caller sees it.
#[derive(Debug, Clone, Copy)]
pub struct InPlaceInfo {
    pub region_id: u64,
    pub page: u64,
    /// Byte offset of the page in its region.
    pub offset: u64,
    /// The page in this host's writable mapping; valid until published or given back.
    pub ptr: *mut u8,
    pub capacity: usize,
}

/// Pages the caller holds for writing in place: (region id, page) → (pool, page).
#[derive(Default)]
pub(super) struct InPlaceTable {
    pages: HashMap<(u64, u64), (usize, InPlacePage)>,
}

/// A region this host maps, as handed to the caller for a view.
#[derive(Debug, Clone, Copy)]
pub struct RegionInfo {
    pub region_id: u64,
    pub ptr: *mut u8,
    pub len: usize,
    pub page_size: u64,
    /// True for the session's own regions (mapped writable).
    pub writable: bool,
}

/// Mappings handed out as region views: held until the handler closes, so a view
/// never outlives its memory while the handler is open.
#[derive(Default)]
pub(super) struct RegionViews {
    held: HashMap<u64, Arc<Mapping>>,
}

impl Inner {
    fn in_place_table(&self) -> Result<MutexGuard<'_, InPlaceTable>, WorkerError> {
        self.in_place.lock().map_err(|_| WorkerError::Closed)
    }

    /// Pool `i`, if it has a session now (a reference: the pool's own locks guard
    /// its bookkeeping).
    fn pool_at(&self, i: usize) -> Result<Option<Arc<StoragePool>>, WorkerError> {
        if self.stop.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(WorkerError::Closed);
        }
        Ok(self
            .pools
            .get(i)
            .ok_or_else(|| WorkerError::InvalidArgument(format!("no pool {i}")))?
            .lock()
            .map_err(|_| WorkerError::Closed)?
            .clone())
    }
}

impl Handler {
    /// Takes up to `n` pages of the engine's own regions (in the pool `route_key`
    /// picks) for writing chunks in place (`cxl` only). The caller writes each chunk at
    /// `ptr`, then publishes it ([`Handler::publish_in_place`]) or gives the page back
    /// ([`Handler::give_back_in_place`]). Fewer than `n` when the pool has no room.
    pub fn take_in_place(
        &self,
        n: usize,
        route_key: &str,
    ) -> Result<Vec<InPlaceInfo>, WorkerError> {
        if self.inner.cfg.backend != BackendKind::Cxl {
            return Err(WorkerError::InvalidArgument(
                "writes in place need backend cxl; on remote_cxl fill store staging slots (maru_slots_acquire) and store from them".into(),
            ));
        }
        let i = self
            .inner
            .router
            .lock()
            .map_err(|_| WorkerError::Closed)?
            .pick(route_key);
        let Some(pool) = self.inner.pool_at(i)? else {
            return Ok(Vec::new());
        };
        let pages = pool.take_in_place(n, Some(route_key));
        self.inner.ahead.note(&pool);
        let pages = pages?;
        let mut t = self.inner.in_place_table()?;
        Ok(pages
            .into_iter()
            .map(|p| {
                let info = InPlaceInfo {
                    region_id: p.page.region_id,
                    page: p.page.page,
                    offset: p.page.offset,
                    ptr: p.ptr(),
                    capacity: p.capacity(),
                };
                t.pages.insert((info.region_id, info.page), (i, p));
                info
            })
            .collect())
    }

    /// Takes the caller's pages out of the table, all of one pool.
    fn untable(&self, pages: &[(u64, u64)]) -> Result<(usize, Vec<InPlacePage>), WorkerError> {
        let mut seen = std::collections::HashSet::with_capacity(pages.len());
        if let Some(d) = pages.iter().find(|l| !seen.insert(**l)) {
            return Err(WorkerError::InvalidArgument(format!(
                "page {} of region {} is named twice in one call",
                d.1, d.0
            )));
        }
        let mut t = self.inner.in_place_table()?;
        let mut pool = None;
        for loc in pages {
            match t.pages.get(loc) {
                None => {
                    return Err(WorkerError::InvalidArgument(format!(
                        "page {} of region {} is not taken for writing in place by this handler (published or given back already?)",
                        loc.1, loc.0
                    )))
                }
                Some((i, _)) if pool.is_some_and(|p| p != *i) => {
                    return Err(WorkerError::InvalidArgument(
                        "pages of one call must come from one pool (one route key)".into(),
                    ))
                }
                Some((i, _)) => pool = Some(*i),
            }
        }
        let taken = pages
            .iter()
            .filter_map(|loc| t.pages.remove(loc).map(|(_, p)| p))
            .collect();
        Ok((pool.unwrap_or(0), taken))
    }

    /// Publishes `keys[i]` with the first `lens[i]` bytes of page `pages[i]`, the
    /// chunks of one request in chain order; per chunk: published now or already
    /// present. The pages are no longer the caller's afterwards, whatever the outcome.
    pub fn publish_in_place<K: AsRef<str>>(
        &self,
        keys: &[K],
        pages: &[(u64, u64)],
        lens: &[usize],
    ) -> Result<Vec<bool>, WorkerError> {
        if keys.len() != pages.len() || lens.len() != pages.len() {
            return Err(WorkerError::InvalidArgument(format!(
                "{} keys, {} pages and {} lengths",
                keys.len(),
                pages.len(),
                lens.len()
            )));
        }
        if keys.iter().any(|k| k.as_ref().is_empty()) {
            return Err(WorkerError::InvalidArgument("empty key \"\"".into()));
        }
        {
            // Checked while the pages are still the caller's (an error keeps them so).
            let t = self.inner.in_place_table()?;
            for ((loc, &len), key) in pages.iter().zip(lens).zip(keys) {
                if let Some((_, p)) = t.pages.get(loc) {
                    if len > p.capacity() {
                        return Err(WorkerError::InvalidArgument(format!(
                            "chunk {} is {len} bytes, larger than its page ({})",
                            key.as_ref(),
                            p.capacity()
                        )));
                    }
                }
            }
        }
        let (i, taken) = self.untable(pages)?;
        let writes = taken
            .into_iter()
            .zip(keys.iter().zip(lens))
            .map(|(page, (key, &len))| InPlaceWrite {
                key: key.as_ref().to_string(),
                page,
                len,
            })
            .collect();
        let Some(pool) = self.inner.pool_at(i)? else {
            return Ok(vec![false; keys.len()]);
        };
        match pool.publish_in_place(writes) {
            Err(e) => self.inner.pool_failed(i, &pool, e, vec![false; keys.len()]),
            r => r,
        }
    }

    /// Gives back pages taken for writing in place and not published.
    pub fn give_back_in_place(&self, pages: &[(u64, u64)]) -> Result<(), WorkerError> {
        let (i, taken) = self.untable(pages)?;
        if let Some(pool) = self.inner.pool_at(i)? {
            pool.give_back_in_place(taken);
        }
        Ok(())
    }

    /// Pages the caller holds for writing in place now.
    pub fn held_in_place(&self) -> usize {
        self.inner
            .in_place
            .lock()
            .map(|t| t.pages.len())
            .unwrap_or(0)
    }

    /// The regions this host maps now (`cxl`): the engine's own (writable) and the
    /// other engines' it has read from (read-only).
    pub fn regions(&self) -> Result<Vec<RegionInfo>, WorkerError> {
        let mut out = Vec::new();
        for i in 0..self.inner.pools.len() {
            if let Some(pool) = self.inner.pool_at(i)? {
                let page_size = pool.page_size();
                for (region_id, m) in pool.mappings() {
                    out.push(RegionInfo {
                        region_id,
                        ptr: m.as_ptr(),
                        len: m.len(),
                        page_size,
                        writable: m.is_writable(),
                    });
                }
            }
        }
        // By region, the writable mapping of an own region before its read-only one.
        out.sort_by_key(|r| (r.region_id, !r.writable));
        Ok(out)
    }

    /// A view of a region this host maps (the writable mapping of an own one), held
    /// until the handler closes; `None` when this host does not map it.
    pub fn region_view(&self, region_id: u64) -> Result<Option<RegionInfo>, WorkerError> {
        for i in 0..self.inner.pools.len() {
            let Some(pool) = self.inner.pool_at(i)? else {
                continue;
            };
            let page_size = pool.page_size();
            // The writable mapping of an own region before its read-only one.
            let found = pool
                .mappings()
                .into_iter()
                .filter(|(r, _)| *r == region_id)
                .max_by_key(|(_, m)| m.is_writable());
            if let Some((_, m)) = found {
                let info = RegionInfo {
                    region_id,
                    ptr: m.as_ptr(),
                    len: m.len(),
                    page_size,
                    writable: m.is_writable(),
                };
                self.inner
                    .region_views
                    .lock()
                    .map_err(|_| WorkerError::Closed)?
                    .held
                    .entry(region_id)
                    .or_insert(m);
                return Ok(Some(info));
            }
        }
        Ok(None)
    }

    /// Ends what `close` must end of writes in place and region views: pages still
    /// taken go with the sessions; region views' mappings may go.
    pub(super) fn close_in_place(&self) {
        if let Ok(mut t) = self.inner.in_place.lock() {
            t.pages.clear();
        }
        if let Ok(mut v) = self.inner.region_views.lock() {
            v.held.clear();
        }
    }
}
