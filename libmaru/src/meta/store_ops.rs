//! The store side: pages of the session's regions, freeing unused pages, and
//! publishing keys after the worker's WRITE completed.

use super::core::MetaCore;
use super::errors::{bad_request, check_batch, check_key, permission};
use super::fast_hash::FastMap;
use super::journal::ReplyTiming;
use super::keys::{Location, Published};
use crate::wire::meta::{EntryRef, MetaReply, PageGrant, PageRef, PagesReply, MAX_KEY_LEN};
use crate::wire::WireError;
use std::collections::HashSet;

impl MetaCore {
    /// Up to `count` pages, oldest region first. Never asks the RM: the reply says
    /// how many are missing and the worker expands (or evicts) for them.
    pub(super) fn alloc_pages(
        &mut self,
        client_id: &str,
        session: u64,
        count: u32,
        route_key: Option<&str>,
        now_ms: u64,
    ) -> Result<MetaReply, WireError> {
        check_batch("pages", count as usize)?;
        if route_key.is_some_and(|k| k.len() > MAX_KEY_LEN) {
            return Err(bad_request(format!(
                "the route key is longer than {MAX_KEY_LEN} bytes"
            )));
        }
        let id = self.session(client_id, session, now_ms)?;
        let s = self.sessions.checked(id)?;
        let page_size = self.cfg.chunk_size;
        let mut pages = Vec::with_capacity(count as usize);
        // A region the session is asked to give back gets no new page. Regions it
        // holds unused (no page taken, no key: one just given) come first, so that a
        // region given to a storing session is not taken back as unused while the
        // session fills pages its evictions freed elsewhere.
        let asked = self.fair.asked_of(id);
        let mut order: Vec<u64> = s.regions.iter().copied().collect();
        order.sort_by_key(|rid| {
            let unused = self
                .regions
                .get(*rid)
                .is_some_and(|r| r.unused_since_ms.is_some());
            (!unused, *rid)
        });
        // With a durable directory, pages come from the session's reserve first:
        // those whose reservation is durable (the reply needs no commit), then those
        // whose reservation is not yet (the reply waits for it), then free ones (the
        // reply waits for their record).
        let durable = self.is_durable().then(|| self.durable_batch());
        let passes: &[Option<u64>] = match durable {
            Some(d) => &[Some(d), Some(u64::MAX), None],
            None => &[None],
        };
        for &upto in passes {
            for &rid in &order {
                if asked == Some(rid) || pages.len() == count as usize {
                    continue;
                }
                let Some(r) = self.regions.get_mut_quiet(rid) else {
                    continue;
                };
                let before = pages.len();
                while pages.len() < count as usize {
                    let page = match upto {
                        Some(u) => r.pages.take_reserved(u),
                        None => r.pages.alloc(),
                    };
                    let Some(page) = page else {
                        break;
                    };
                    pages.push(PageGrant {
                        region_id: rid,
                        page,
                        offset: page * page_size,
                        length: page_size,
                    });
                }
                if pages.len() > before && upto != durable {
                    if upto.is_none() {
                        self.regions.mark_dirty(rid);
                    }
                    self.set_reply_timing(ReplyTiming::AfterAll);
                }
            }
        }
        if durable.is_some() {
            if self.reply_timing() == ReplyTiming::AfterItsChanges {
                self.set_reply_timing(ReplyTiming::Early);
            }
            self.note_alloc(id, pages.len() as u64, now_ms);
            self.top_up_reserve(id, asked, &order);
        }
        let mut touched: Vec<u64> = pages.iter().map(|p| p.region_id).collect();
        touched.dedup();
        for rid in touched {
            self.note_region_use(rid, now_ms);
        }
        let missing = count - pages.len() as u32;
        let give_back = self.asked_back(id);
        let share_regions = Some(self.share_regions(id));
        Ok(MetaReply::Pages(PagesReply {
            pages,
            missing,
            give_back,
            share_regions,
        }))
    }

    /// Frees pages of the session that hold no key. All or nothing.
    pub(super) fn free_pages(
        &mut self,
        client_id: &str,
        session: u64,
        pages: &[PageRef],
        now_ms: u64,
    ) -> Result<MetaReply, WireError> {
        check_batch("pages", pages.len())?;
        let id = self.session(client_id, session, now_ms)?;
        let s = self.sessions.checked(id)?;
        let page_size = self.cfg.chunk_size;
        let mut seen = HashSet::new();
        for p in pages {
            let Some(r) = self
                .regions
                .get(p.region_id)
                .filter(|_| s.regions.contains(&p.region_id))
            else {
                return Err(permission(format!(
                    "region {} is not a region of session {id}; nothing was freed",
                    p.region_id
                )));
            };
            r.pages.check_free(p.page).map_err(|e| {
                bad_request(format!("region {}: {e}; nothing was freed", p.region_id))
            })?;
            if !seen.insert(*p) {
                return Err(bad_request(format!(
                    "page {} of region {} is named twice; nothing was freed",
                    p.page, p.region_id
                )));
            }
            if let Some(k) = self.keys.at(p.region_id, p.page * page_size) {
                let name = self.keys.get(k).map(|e| e.name).unwrap_or("?");
                return Err(bad_request(format!(
                    "page {} of region {} holds key {name:?}: remove the key instead; nothing \
                     was freed",
                    p.page, p.region_id
                )));
            }
        }
        let scope = s.scope;
        for p in pages {
            // Checked above; nothing else touched the pages since.
            self.free_unkeyed_page(p.region_id, p.page, scope);
            self.note_region_use(p.region_id, now_ms);
        }
        Ok(MetaReply::PagesFreed { freed: pages.len() })
    }

    /// Publishes keys into allocated pages of the caller's own regions, for a session
    /// whose tenant writes its namespace. All entries are checked before any is
    /// published; the first publish of a key wins (among the sessions of that tenant:
    /// no other tenant writes the namespace).
    pub(super) fn publish(
        &mut self,
        client_id: &str,
        session: u64,
        entries: &[EntryRef<'_>],
        now_ms: u64,
    ) -> Result<MetaReply, WireError> {
        check_batch("entries", entries.len())?;
        let id = self.writing_session(client_id, session, "publish", now_ms)?;
        let s = self.sessions.checked(id)?;
        let scope = s.scope;
        let page_size = self.cfg.chunk_size;
        let mut pages: FastMap<(u64, u64), &str> =
            FastMap::with_capacity_and_hasher(entries.len(), Default::default());
        for (i, e) in entries.iter().enumerate() {
            check_key(&e.key)?;
            if let Some(p) = &e.prev {
                check_key(p)?;
            }
            let at = |what: String| format!("entry {i} (key {:?}): {what}", &*e.key);
            let Some(r) = self
                .regions
                .get(e.region_id)
                .filter(|_| s.regions.contains(&e.region_id))
            else {
                return Err(permission(at(format!(
                    "region {} is not a region of session {id}; a session publishes only into \
                     its own regions; nothing was published",
                    e.region_id
                ))));
            };
            if e.offset % page_size != 0 || !r.pages.is_allocated(e.offset / page_size) {
                return Err(bad_request(at(format!(
                    "offset {} of region {} is not a page allocated to the session (pages are \
                     {page_size} bytes; take them with alloc); nothing was published",
                    e.offset, e.region_id
                ))));
            }
            if e.length == 0 || e.length > page_size {
                return Err(bad_request(at(format!(
                    "length {} must be 1 to the page size {page_size}; nothing was published",
                    e.length
                ))));
            }
            if let Some(k) = self.keys.at(e.region_id, e.offset) {
                let same = self
                    .keys
                    .get(k)
                    .is_some_and(|x| x.name == &*e.key && x.scope == scope);
                if !same {
                    return Err(bad_request(at(format!(
                        "the page at offset {} of region {} holds another key; nothing was \
                         published",
                        e.offset, e.region_id
                    ))));
                }
            }
            if let Some(other) = pages.insert((e.region_id, e.offset), &e.key) {
                if other != &*e.key {
                    return Err(bad_request(at(format!(
                        "key {other:?} of the same request is published at the same page; \
                         nothing was published"
                    ))));
                }
            }
        }
        let is_new = entries
            .iter()
            .map(|e| {
                let loc = Location {
                    region_id: e.region_id,
                    offset: e.offset,
                    length: e.length,
                };
                let new = matches!(
                    self.keys.publish(scope, &e.key, loc, e.prev.as_deref()),
                    Published::New(_)
                );
                if new {
                    self.page_keyed(e.region_id, e.offset / page_size);
                }
                new
            })
            .collect();
        // A lost publish is a lost key, never wrong bytes: the reply goes before its
        // commit (see `durable`).
        if self.journal.is_some() {
            self.set_reply_timing(ReplyTiming::Early);
        }
        let give_back = self.asked_back(id);
        Ok(MetaReply::Published { is_new, give_back })
    }
}
