//! Writes in place (`cxl`) against real daemons on loopback: pages taken by their
//! writer, published only by it and only while their region is the engine's, given
//! back for reuse, never handed to another store or evicted meanwhile.

mod support;

use maru::wire::meta::Backend;
use maru::worker::movers;
use maru::worker::pool::{InPlacePage, InPlaceWrite, StoragePool, TestHooks};
use maru::worker::session::Session;
use maru::worker::Handler;
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use support::Stack;

fn stack() -> Stack {
    stack_of("inplace", "256M", false)
}

/// A stack of regions of 8 MiB, chunks of 64 KiB, over a pool of `pool` (with an
/// agent when `remote`).
fn stack_of(tag: &str, pool: &str, remote: bool) -> Stack {
    let args = support::strings(&["--region-size", "8M", "--chunk-size", "64K"]);
    support::stack(tag, pool, remote, &args)
}

fn config(st: &Stack, engine: &str) -> String {
    st.handler_config("cxl", engine, "llama-test", (4, 4))
        .to_string()
}

fn bytes(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect()
}

/// Each of `pages` written in place with `len` bytes of [`bytes`], page `i` under
/// the key and seed `of(i)`: the writes to publish.
fn write_pages(
    pages: Vec<InPlacePage>,
    len: usize,
    of: impl Fn(usize) -> (String, u8),
) -> Vec<InPlaceWrite> {
    pages
        .into_iter()
        .enumerate()
        .map(|(i, page)| {
            let (key, seed) = of(i);
            page.write(&bytes(seed, len)).unwrap();
            InPlaceWrite { key, page, len }
        })
        .collect()
}

/// A cxl pool that records the pages stores write into and, when told, finds its
/// regions' agent silent (so the pool gives them back and forgets them).
struct Watch {
    pool: StoragePool,
    written: Arc<Mutex<BTreeSet<(u64, u64)>>>,
    silent: Arc<AtomicBool>,
}

/// A pool of one 8 MiB region at most (128 pages of 64 KiB), no spare pages.
fn watched_pool(st: &Stack, engine: &str) -> Watch {
    watched_pool_of(st, engine, 8 << 20)
}

/// A pool of at most `max_bytes` of regions (0: no limit), no spare pages.
fn watched_pool_of(st: &Stack, engine: &str, max_bytes: u64) -> Watch {
    let session = Session::open(
        &st.server.addr,
        engine,
        support::server_key(&st.server.addr),
        engine,
        "llama-test",
        "default",
        Backend::Cxl,
        Duration::from_secs(10),
    )
    .unwrap();
    let written: Arc<Mutex<BTreeSet<(u64, u64)>>> = Arc::default();
    let silent = Arc::new(AtomicBool::new(false));
    let w = written.clone();
    let hooks = TestHooks {
        after_write: Some(Box::new(move |p, ok| {
            w.lock().unwrap().insert((p.region_id, p.page));
            ok
        })),
        silent: Some(silent.clone()),
        ..TestHooks::default()
    };
    let pool = StoragePool::open(session, movers::cxl(false))
        .unwrap()
        .with_max_bytes(max_bytes)
        .with_test_hooks(hooks);
    Watch {
        pool,
        written,
        silent,
    }
}

#[test]
fn a_page_written_in_place_is_found_once_its_writer_publishes_it_and_only_by_it() {
    let st = stack();
    let a = Handler::open(&config(&st, "writer")).unwrap();
    let b = Handler::open(&config(&st, "other")).unwrap();
    let pages = a.take_in_place(2, "req").unwrap();
    assert_eq!(pages.len(), 2);
    let data = [bytes(1, 65536), bytes(2, 1000)];
    for (p, d) in pages.iter().zip(&data) {
        assert_eq!(p.capacity, 65536);
        // The caller's copy, straight into the mapping.
        unsafe { std::ptr::copy_nonoverlapping(d.as_ptr(), p.ptr, d.len()) };
    }
    let keys = vec!["req/c0".to_string(), "req/c1".to_string()];
    let locs: Vec<(u64, u64)> = pages.iter().map(|p| (p.region_id, p.page)).collect();
    assert!(
        !b.exists_batch(&keys, Some("req")).unwrap()[0],
        "nothing is found before its writer publishes"
    );
    // A page named twice in one call is refused; the pages stay the writer's.
    let twice = [locs[0], locs[0]];
    let e = a.publish_in_place(&keys, &twice, &[10, 10]).unwrap_err();
    assert!(e.to_string().contains("twice"), "{e}");
    assert_eq!(a.held_in_place(), 2);
    // Another handler cannot publish the writer's pages.
    let e = b
        .publish_in_place(&keys, &locs, &[65536, 1000])
        .unwrap_err();
    assert!(e.to_string().contains("not taken"), "{e}");
    assert_eq!(
        a.publish_in_place(&keys, &locs, &[65536, 1000]).unwrap(),
        vec![true, true]
    );
    // Published once: the pages are no longer the writer's either.
    assert!(a.publish_in_place(&keys, &locs, &[65536, 1000]).is_err());
    assert_eq!(a.held_in_place(), 0);
    let got = b.load_batch(&keys, Some("req")).unwrap();
    assert_eq!(got[0].as_deref(), Some(data[0].as_slice()));
    assert_eq!(got[1].as_deref(), Some(data[1].as_slice()));
    a.close().unwrap();
    b.close().unwrap();
}

#[test]
fn a_page_of_a_region_lost_while_it_was_written_is_never_published() {
    let st = stack();
    let w = watched_pool(&st, "loser");
    let pages = w.pool.take_in_place(1, Some("lost")).unwrap();
    assert_eq!(pages.len(), 1);
    pages[0].write(&bytes(7, 4096)).unwrap();
    // Its region is given back (its agent silent too long) while it is written.
    w.silent.store(true, Ordering::SeqCst);
    w.pool.tick(0, w.pool.session.call_deadline()).unwrap();
    w.silent.store(false, Ordering::SeqCst);
    let mut pages = pages;
    let r = w
        .pool
        .publish_in_place(vec![InPlaceWrite {
            key: "lost/c0".into(),
            page: pages.remove(0),
            len: 4096,
        }])
        .unwrap();
    assert_eq!(r, vec![false], "nothing is published from a lost region");
    assert_eq!(
        w.pool.exists(&["lost/c0".to_string()]).unwrap(),
        vec![false]
    );
    w.pool.close(w.pool.session.call_deadline()).unwrap();
}

#[test]
fn pages_given_back_serve_later_writes_and_taken_pages_are_never_evicted_or_reused() {
    let st = stack();
    let w = watched_pool(&st, "taker");
    // Half the one region the pool may hold (its share, within max_bytes): a take
    // never holds more at once, so the engine's own stores keep room.
    let all = w.pool.take_in_place(200, Some("t")).unwrap();
    assert_eq!(all.len(), 64, "half of one region of 128 pages");
    assert!(
        w.pool.take_in_place(1, Some("t")).unwrap().is_empty(),
        "no more while half the share is taken"
    );
    let stored = w.pool.store(&[("t/own", &bytes(9, 100)[..])], Some("t"));
    assert_eq!(
        stored.unwrap(),
        vec![true],
        "the taker's own store has room"
    );
    w.pool.give_back_in_place(all);
    let again = w.pool.take_in_place(128, Some("t")).unwrap();
    assert_eq!(again.len(), 64, "pages given back are taken again");
    // Keep 8 pages taken; publish the rest, then store more chunks than fit: the
    // stores evict published keys, and never reuse a taken page.
    let mut again = again;
    let kept: Vec<_> = again.split_off(56);
    let kept_locs: BTreeSet<(u64, u64)> = kept
        .iter()
        .map(|p| (p.page.region_id, p.page.page))
        .collect();
    let writes = write_pages(again, 512, |i| (format!("t/p{i:03}"), i as u8));
    assert!(w.pool.publish_in_place(writes).unwrap().iter().all(|&b| b));
    let keys: Vec<String> = (0..300).map(|i| format!("s/c{i:03}")).collect();
    let data: Vec<Vec<u8>> = (0..300).map(|i| bytes(i as u8, 2048)).collect();
    for (k, d) in keys.chunks(30).zip(data.chunks(30)) {
        w.pool.store(&support::items(k, d), Some("s")).unwrap();
    }
    let written = w.written.lock().unwrap().clone();
    assert!(
        written.len() > 100,
        "the stores wrote by evicting ({})",
        written.len()
    );
    assert!(
        written.is_disjoint(&kept_locs),
        "a page taken for writing in place was handed to a store"
    );
    // The kept pages are still the taker's: it publishes them.
    let writes = write_pages(kept, 300, |i| (format!("k/{i}"), 200 + i as u8));
    assert!(w.pool.publish_in_place(writes).unwrap().iter().all(|&b| b));
    w.pool.close(w.pool.session.call_deadline()).unwrap();
}

#[test]
fn remote_cxl_refuses_writes_in_place_with_the_staging_way_named() {
    let st = stack_of("inplace-r", "64M", true);
    let cfg = st
        .handler_config("remote_cxl", "r", "llama-test", (2, 2))
        .to_string();
    let h = Handler::open(&cfg).unwrap();
    let e = h.take_in_place(1, "x").unwrap_err();
    assert!(e.to_string().contains("staging slots"), "{e}");
    assert!(h.regions().unwrap().is_empty());
    h.close().unwrap();
}

/// maru-server asks for a region back (another engine waits on a full pool): a region
/// with pages taken for writing in place stays until they are published or given back
/// (its takers would otherwise write into memory handed to another engine).
#[test]
fn a_region_with_pages_being_written_in_place_is_not_given_back_meanwhile() {
    let args: Vec<String> = ["--region-size", "8M", "--chunk-size", "64K"]
        .iter()
        .map(|a| a.to_string())
        .collect();
    // Room for two regions of 8 MiB (the device header takes the first 2 MiB).
    let st = support::stack("inplace-fair", "20M", false, &args);
    let a = watched_pool_of(&st, "hog", 0);
    // A stores 100 chunks into its first region, then takes half its share (both
    // regions) in place: pages of both regions are taken.
    let keys: Vec<String> = (0..100).map(|i| format!("hog/c{i:03}")).collect();
    let data = bytes(3, 100);
    let items: Vec<(&str, &[u8])> = keys.iter().map(|k| (k.as_str(), &data[..])).collect();
    assert!(a
        .pool
        .store(&items, Some("hog"))
        .unwrap()
        .iter()
        .all(|s| *s));
    let mut pages = a.pool.take_in_place(256, Some("hog")).unwrap();
    assert_eq!(pages.len(), 128, "half of its share of two regions");
    assert_eq!(a.pool.stats().regions, 2, "A holds the whole pool");
    let taken_in: BTreeSet<u64> = pages.iter().map(|p| p.page.region_id).collect();
    assert_eq!(taken_in.len(), 2, "pages of both regions taken");
    // B stores into the full pool: maru-server asks A for a fair share.
    let b = watched_pool_of(&st, "waiter", 0);
    let stored = b
        .pool
        .store(&[("w/c0", &bytes(1, 100)[..])], Some("w"))
        .unwrap();
    assert_eq!(stored, vec![false], "no room for B yet");
    // Without the rule A gives it back at its first heartbeat: 3 s is ample.
    let asked = support::wait_until(Duration::from_secs(3), || {
        a.pool.heartbeat(a.pool.session.call_deadline()).unwrap();
        b.pool
            .store(&[("w/c0", &bytes(1, 100)[..])], Some("w"))
            .unwrap()[0]
            || a.pool.stats().regions < 2
    });
    assert!(
        !asked || a.pool.stats().regions == 2,
        "A gave back a region while its pages were being written in place: {:?}",
        a.pool.stats()
    );
    assert_eq!(a.pool.stats().regions_given_back, 0);
    // A gives back the pages of one region: that region can go now.
    let first = pages[0].page.region_id;
    let (mine, rest): (Vec<_>, Vec<_>) = pages.drain(..).partition(|p| p.page.region_id == first);
    a.pool.give_back_in_place(mine);
    let gone = support::wait_until(Duration::from_secs(10), || {
        a.pool.heartbeat(a.pool.session.call_deadline()).unwrap();
        a.pool.stats().regions_given_back == 1
    });
    assert!(
        gone,
        "the region is given back once nothing is written into it: {:?}",
        a.pool.stats()
    );
    assert!(
        support::wait_until(Duration::from_secs(10), || b
            .pool
            .store(&[("w/c0", &bytes(1, 100)[..])], Some("w"))
            .unwrap()[0]),
        "B stores into the region A gave back"
    );
    a.pool.give_back_in_place(rest);
    a.pool.close(a.pool.session.call_deadline()).unwrap();
    b.pool.close(b.pool.session.call_deadline()).unwrap();
}
