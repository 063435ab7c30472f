//! One pool (one maru-server) of a handler: its storage session and its mover.
//! Store = pages → bytes into the region → publish (publish only after the bytes are
//! complete). Load = leases → READ/copy → release the leases.

use super::error::WorkerError;
use super::movers::{Mover, WriteItem};
use super::session::Session;
use crate::wire::meta::PublishEntry;

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
}

pub struct StoragePool {
    pub session: Session,
    mover: Box<dyn Mover>,
    pub stats: PoolStats,
    max_batch: usize,
}

impl StoragePool {
    pub fn open(session: Session, mut mover: Box<dyn Mover>) -> Result<StoragePool, WorkerError> {
        mover.adopt(&session.first_region)?;
        let max_batch = session.handshake.max_batch.max(1);
        Ok(StoragePool {
            session,
            mover,
            stats: PoolStats {
                regions: 1,
                ..PoolStats::default()
            },
            max_batch,
        })
    }

    pub fn page_size(&self) -> u64 {
        self.session.page_size
    }

    /// Stores chunks; per chunk: true when stored now or already present.
    pub fn store(
        &mut self,
        items: &[(&str, &[u8])],
        route_key: Option<&str>,
    ) -> Result<Vec<bool>, WorkerError> {
        let mut done = vec![false; items.len()];
        for (ci, chunk) in items.chunks(self.max_batch).enumerate() {
            let base = ci * self.max_batch;
            let r = self.store_some(chunk, route_key)?;
            done[base..base + r.len()].copy_from_slice(&r);
        }
        Ok(done)
    }

    fn store_some(
        &mut self,
        items: &[(&str, &[u8])],
        route_key: Option<&str>,
    ) -> Result<Vec<bool>, WorkerError> {
        for (k, d) in items {
            if k.is_empty() {
                return Err(WorkerError::InvalidArgument("empty key".into()));
            }
            if d.len() as u64 > self.page_size() {
                return Err(WorkerError::InvalidArgument(format!(
                    "chunk {k} is {} bytes, larger than the page size {}",
                    d.len(),
                    self.page_size()
                )));
            }
        }
        let keys: Vec<String> = items.iter().map(|(k, _)| k.to_string()).collect();
        let present = self.session.exists(&keys)?;
        let mut result = present.clone();
        let todo: Vec<usize> = (0..items.len()).filter(|&i| !present[i]).collect();
        self.stats.already_present += (items.len() - todo.len()) as u64;
        if todo.is_empty() {
            return Ok(result);
        }
        let (mut pages, mut missing) = self.session.alloc(todo.len() as u32, route_key)?;
        while missing > 0 {
            // The session's regions are full: one more region, then the rest.
            let grant = self.session.expand()?;
            self.mover.adopt(&grant)?;
            self.stats.regions += 1;
            let (more, m) = self.session.alloc(missing, route_key)?;
            if more.is_empty() && m == missing {
                break;
            }
            pages.extend(more);
            missing = m;
        }
        let writes: Vec<WriteItem<'_>> = todo
            .iter()
            .zip(&pages)
            .map(|(&i, p)| WriteItem {
                page: *p,
                data: items[i].1,
            })
            .collect();
        let ok = self.mover.write(&writes);
        let mut publish = Vec::new();
        let mut unused = Vec::new();
        for (w, (&i, good)) in writes.iter().zip(todo.iter().zip(&ok)) {
            if *good {
                publish.push((
                    i,
                    PublishEntry {
                        key: items[i].0.to_string(),
                        region_id: w.page.region_id,
                        offset: w.page.offset,
                        length: items[i].1.len() as u64,
                    },
                ));
            } else {
                unused.push(w.page);
            }
        }
        unused.extend(pages.iter().skip(writes.len()).copied());
        self.stats.store_skipped += (todo.len() - publish.len()) as u64;
        // Publish only what was written completely.
        if !publish.is_empty() {
            let entries = publish.iter().map(|(_, e)| e.clone()).collect();
            let is_new = self.session.publish(entries)?;
            for ((i, e), new) in publish.iter().zip(is_new) {
                result[*i] = true;
                if new {
                    self.stats.stored += 1;
                    self.stats.bytes_stored += e.length;
                } else {
                    // Another engine published the key first; our page is not needed.
                    self.stats.already_present += 1;
                    unused.push(crate::wire::meta::PageGrant {
                        region_id: e.region_id,
                        page: e.offset / self.session.page_size,
                        offset: e.offset,
                        length: self.session.page_size,
                    });
                }
            }
        }
        if let Err(e) = self.session.free_pages(&unused) {
            log::warn!(
                "pool {}: cannot return {} unused pages: {e}",
                self.session.url,
                unused.len()
            );
        }
        Ok(result)
    }

    /// Loads chunks; `None` for a miss or a failed read.
    pub fn load(&mut self, keys: &[String]) -> Result<Vec<Option<Vec<u8>>>, WorkerError> {
        let mut out = Vec::with_capacity(keys.len());
        for chunk in keys.chunks(self.max_batch) {
            out.extend(self.load_some(chunk)?);
        }
        Ok(out)
    }

    fn load_some(&mut self, keys: &[String]) -> Result<Vec<Option<Vec<u8>>>, WorkerError> {
        let leases = self.session.acquire(keys)?;
        let found: Vec<usize> = (0..keys.len()).filter(|&i| leases[i].is_some()).collect();
        let grants: Vec<_> = found.iter().filter_map(|&i| leases[i].clone()).collect();
        let data = self.mover.read(&grants);
        let ids = grants.iter().map(|g| g.lease_id).collect();
        if let Err(e) = self.session.release_leases(ids) {
            log::warn!(
                "pool {}: releasing leases failed (they expire on their own): {e}",
                self.session.url
            );
        }
        let mut out = vec![None; keys.len()];
        for (&i, d) in found.iter().zip(data) {
            match d {
                Some(bytes) => {
                    self.stats.hits += 1;
                    self.stats.bytes_loaded += bytes.len() as u64;
                    out[i] = Some(bytes);
                }
                None => self.stats.load_failed += 1,
            }
        }
        self.stats.misses += (keys.len() - found.len()) as u64;
        Ok(out)
    }

    pub fn exists(&mut self, keys: &[String]) -> Result<Vec<bool>, WorkerError> {
        let mut out = Vec::with_capacity(keys.len());
        for chunk in keys.chunks(self.max_batch) {
            out.extend(self.session.exists(chunk)?);
        }
        Ok(out)
    }

    pub fn heartbeat(&mut self) -> Result<(), WorkerError> {
        self.mover.reclaim();
        let boots = self.mover.boot_ids();
        self.session.heartbeat(boots)
    }

    pub fn close(&mut self) -> Result<(), WorkerError> {
        self.session.close()
    }
}
