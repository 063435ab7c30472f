//! The upgrade of a directory of record format 1 (records without a check of their
//! own) into this format, once, at the first start on it ([`seal_format1`]).

use super::records::{Image, RegionRecord, Sealed};
use std::collections::{BTreeMap, BTreeSet};

/// What [`seal_format1`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Sealed1 {
    /// Records kept and sealed.
    pub kept: u64,
    /// Records dropped: never served, their keys misses.
    pub dropped: u64,
}

/// Seals a directory of record format 1 (records without a check of their own,
/// what the release before format 2 wrote) into this format, once, at the first
/// start on it: what can be checked without a check is, and a record that fails is
/// dropped (logged; never served, its key a miss):
///
/// - a region whose range of its pool overlaps another region's (neither);
/// - a key whose region is not recorded, whose offset is not the start of one of
///   its region's pages, whose length is 0 or longer than a page, whose page is not
///   allocated in its region's record, or whose scope is not recorded; two keys
///   at one page (neither);
/// - a session whose scope is not recorded.
///
/// The records kept get their checks (a key's bound to its region's boot id, as
/// written). A bit that changed on disk before this start in a field these checks
/// do not cover cannot be told from the value written: the release that wrote the
/// directory did not record one (the restore that follows checks the rest as on
/// every start).
pub fn seal_format1(image: &mut Image) -> Sealed1 {
    let mut out = Sealed1::default();
    let mut reject = |what: String| {
        log::warn!("upgrade from record format 1: {what}: dropped, never served");
        out.dropped += 1;
    };
    let overlapping = overlapping_regions(image.regions.iter());
    image.regions.retain(|g| {
        let keep = !overlapping.contains(&g.handle.region_id);
        if !keep {
            reject(format!(
                "region {} lies over pages another region's record holds",
                g.handle.region_id
            ));
        }
        keep
    });
    let scopes: BTreeSet<u32> = image.scopes.iter().map(|s| s.id).collect();
    image.sessions.retain(|s| {
        let keep = scopes.contains(&s.scope);
        if !keep {
            reject(format!(
                "session {} names scope {}, not recorded",
                s.id, s.scope
            ));
        }
        keep
    });
    let regions: BTreeMap<u64, &RegionRecord> = image
        .regions
        .iter()
        .map(|g| (g.handle.region_id, g))
        .collect();
    let mut at_page: BTreeMap<(u64, u64), usize> = BTreeMap::new();
    for k in &image.keys {
        *at_page.entry((k.region_id, k.offset)).or_default() += 1;
    }
    let mut kept_keys = Vec::with_capacity(image.keys.len());
    for k in std::mem::take(&mut image.keys) {
        let page = regions.get(&k.region_id).and_then(|g| {
            let size = g.handle.length.checked_div(g.pages)?;
            (size > 0
                && k.offset % size == 0
                && k.offset / size < g.pages
                && k.length > 0
                && k.length <= size
                && g.allocated.contains(&(k.offset / size)))
            .then_some(g)
        });
        let Some(g) = page else {
            reject(format!(
                "key record {} (region {}, offset {}, length {}) does not lie on an allocated \
                 page of a recorded region",
                k.id, k.region_id, k.offset, k.length
            ));
            continue;
        };
        if at_page.get(&(k.region_id, k.offset)).copied().unwrap_or(0) > 1 {
            reject(format!(
                "key record {}: another key is recorded at offset {} of region {}",
                k.id, k.offset, k.region_id
            ));
            continue;
        }
        if !scopes.contains(&k.scope) {
            reject(format!(
                "key record {} names scope {}, not recorded",
                k.id, k.scope
            ));
            continue;
        }
        let boot = g.boot_id.clone();
        kept_keys.push(k.sealed(boot.as_deref()));
    }
    image.keys = kept_keys;
    for s in &mut image.scopes {
        s.seal();
    }
    for s in &mut image.sessions {
        s.seal();
    }
    for g in &mut image.regions {
        g.seal();
    }
    out.kept =
        (image.scopes.len() + image.sessions.len() + image.regions.len() + image.keys.len()) as u64;
    out
}

/// The regions among `regions` whose range of their pool overlaps another's.
/// Logs each.
pub(super) fn overlapping_regions<'a>(
    regions: impl Iterator<Item = &'a RegionRecord>,
) -> BTreeSet<u64> {
    let mut by_pool: BTreeMap<u32, Vec<(u64, u64, u64)>> = BTreeMap::new();
    for g in regions {
        let h = &g.handle;
        by_pool.entry(g.pool.pool_id).or_default().push((
            h.offset,
            h.offset.saturating_add(h.length),
            h.region_id,
        ));
    }
    let mut overlapping = BTreeSet::new();
    for ranges in by_pool.values_mut() {
        ranges.sort_unstable();
        // The furthest end so far, and whose.
        let mut reach: Option<(u64, u64)> = None;
        for &(start, end, rid) in ranges.iter() {
            if let Some((far, who)) = reach {
                if start < far {
                    overlapping.insert(rid);
                    overlapping.insert(who);
                }
            }
            if reach.is_none_or(|(far, _)| end > far) {
                reach = Some((end, rid));
            }
        }
    }
    for rid in &overlapping {
        log::warn!(
            "recovery: region {rid} is recorded over pages another region's record holds: \
             dropped with its keys, never served"
        );
    }
    overlapping
}
