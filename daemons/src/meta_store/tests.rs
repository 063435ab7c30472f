//! Tests of the durable directory's store.

use super::*;
use maru::meta::records::KeyRecord;
use std::collections::BTreeMap;

/// Commits `records` as the store's first job and batch.
fn commit_first(store: &MetaStore, records: Vec<Record>) {
    let job = Job {
        seq: 1,
        changes: Some(Changes { batch: 1, records }),
        secrets: vec![],
    };
    store.commit(&[job]).unwrap();
}

fn key(id: u64) -> KeyRecord {
    KeyRecord {
        id,
        scope: 0,
        name: format!("k{id}"),
        region_id: 1,
        offset: id * 4096,
        length: 10,
        prev: None,
        used: id,
        check: 0,
    }
}

fn dir() -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "maru-store-test-{}-{}",
        std::process::id(),
        maru::auth::to_hex(&maru::auth::random_bytes(4).unwrap())
    ));
    d
}

#[test]
fn batches_come_back_after_a_reopen_with_the_same_instance() {
    let d = dir();
    let (store, loaded) = MetaStore::open(&d, || "inst-1".into(), 60_000).unwrap();
    assert_eq!((loaded.run, loaded.instance.as_str()), (1, "inst-1"));
    let c = Changes {
        batch: 1,
        records: vec![
            Record::Key(key(1)),
            Record::Key(key(2)),
            Record::Used { id: 1, used: 50 },
            Record::NextSession(7),
        ],
    };
    let job = Job {
        seq: 1,
        changes: Some(c),
        secrets: vec![SecretOp::Put(
            "h".into(),
            SecretRecord {
                owner: "o".into(),
                tenant: "t".into(),
                check: 0,
            }
            .sealed(),
        )],
    };
    store.commit(&[job]).unwrap();
    store
        .commit(&[Job {
            seq: 2,
            changes: Some(Changes {
                batch: 2,
                records: vec![Record::KeyGone(2)],
            }),
            secrets: vec![],
        }])
        .unwrap();
    drop(store);
    let (_s, loaded) = MetaStore::open(&d, || "other".into(), 60_000).unwrap();
    assert_eq!((loaded.run, loaded.instance.as_str()), (2, "inst-1"));
    assert_eq!(loaded.image.keys.len(), 1);
    assert_eq!(loaded.image.keys[0].used, 50, "the read's stamp");
    assert_eq!(loaded.image.next_session, 7);
    assert_eq!(loaded.secrets.len(), 1);
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn each_key_gets_its_own_read_stamp_back_from_the_walk_beside_the_keys() {
    // The used table is read beside the keys table in one walk (a merge): stamps
    // of the first, a middle and the last key, none for the others, and one of a
    // removed key in between, come back on their own keys only.
    let d = dir();
    let (store, _) = MetaStore::open(&d, || "inst".into(), 60_000).unwrap();
    let mut records: Vec<Record> = (1..=6).map(|i| Record::Key(key(i))).collect();
    for (id, used) in [(1, 40), (3, 50), (4, 55), (6, 70)] {
        records.push(Record::Used { id, used });
    }
    records.push(Record::KeyGone(4));
    // A key removed with no use-stamp row: its record goes all the same.
    records.push(Record::KeyGoneUnread(5));
    commit_first(&store, records);
    drop(store);
    let (_s, loaded) = MetaStore::open(&d, || "other".into(), 60_000).unwrap();
    let got: Vec<(u64, u64)> = loaded.image.keys.iter().map(|k| (k.id, k.used)).collect();
    assert_eq!(got, [(1, 40), (2, 2), (3, 50), (6, 70)]);
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn ids_of_records_that_do_not_decode_and_of_lone_use_stamps_stay_taken() {
    // A new key's record is written without deleting a use-stamp row of its id: the
    // image's `key_ids_end` names every id on the store, also of a record that does
    // not decode (3, the last key) and of a use stamp alone (7), and a restore hands
    // out none again (`meta::durable_tests::a_restart_hands_out_no_key_id_recorded_before`).
    let d = dir();
    let (store, _) = MetaStore::open(&d, || "inst".into(), 60_000).unwrap();
    let mut records: Vec<Record> = (1..=3).map(|i| Record::Key(key(i))).collect();
    records.push(Record::Used { id: 3, used: 90 });
    commit_first(&store, records);
    let txn = store.db.begin_write().unwrap();
    txn.open_table(KEYS)
        .unwrap()
        .insert(3, &b"\x02not a key"[..])
        .unwrap();
    txn.commit().unwrap();
    drop(store);
    let (store, loaded) = MetaStore::open(&d, || "other".into(), 60_000).unwrap();
    let ids: Vec<u64> = loaded.image.keys.iter().map(|k| k.id).collect();
    assert_eq!((ids, loaded.image.key_ids_end), (vec![1, 2], 4));
    commit_first(&store, vec![Record::Used { id: 7, used: 95 }]);
    drop(store);
    let (_s, loaded) = MetaStore::open(&d, || "other".into(), 60_000).unwrap();
    assert_eq!(loaded.image.key_ids_end, 8);
    std::fs::remove_dir_all(&d).unwrap();
}

/// A fork of the process (another thread spawning a program) holds the lock's
/// descriptor until its exec: a store closed and opened again meanwhile waits for
/// it rather than refusing the start. Seen failing with the wait taken out ("in use
/// by another maru-server"), as a_flipped_bit_... did once beside the RM's
/// spawning test.
#[test]
fn a_reopen_waits_out_a_fork_that_still_holds_the_lock() {
    let d = dir();
    let (store, _) = MetaStore::open(&d, || "i".into(), 60_000).unwrap();
    let mut go = [0 as libc::c_int; 2];
    // SAFETY: a pipe into an array of two descriptors.
    assert_eq!(unsafe { libc::pipe(go.as_mut_ptr()) }, 0);
    // SAFETY: the child only reads, sleeps and exits (async-signal-safe calls).
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
    if pid == 0 {
        // Holds its copy of the lock's descriptor until 50 ms after the store closed.
        unsafe {
            let mut b = 0u8;
            libc::read(go[0], (&mut b as *mut u8).cast(), 1);
            libc::usleep(50_000);
            libc::_exit(0);
        }
    }
    drop(store);
    // SAFETY: writes one byte to the pipe made above, then closes both ends.
    unsafe {
        libc::write(go[1], [1u8].as_ptr().cast(), 1);
        libc::close(go[0]);
        libc::close(go[1]);
    }
    let again = MetaStore::open(&d, || "i".into(), 60_000);
    let mut status = 0;
    // SAFETY: waits for the child forked above.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    let (_s, _) = again.unwrap();
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn a_second_server_on_the_same_directory_is_refused() {
    let d = dir();
    let (_a, _) = MetaStore::open(&d, || "i".into(), 60_000).unwrap();
    let e = MetaStore::open(&d, || "i".into(), 60_000).err().unwrap();
    assert!(e.contains("in use by another maru-server"), "{e}");
    std::fs::remove_dir_all(&d).unwrap();
}

/// Issue 49: a file the store cannot read (garbage over part of it) never
/// refuses the start: it is set aside and the start goes on with an empty
/// directory. Seen failing with damage refusing the start (the earlier rule):
/// the first garbled open was an error.
#[test]
fn a_damaged_file_is_set_aside_and_the_start_goes_on_never_a_refusal_or_a_panic() {
    let d = dir();
    {
        let (store, _) = MetaStore::open(&d, || "i".into(), 60_000).unwrap();
        let recs = (1..200).map(|i| Record::Key(key(i))).collect();
        store
            .commit(&[Job {
                seq: 1,
                changes: Some(Changes {
                    batch: 1,
                    records: recs,
                }),
                secrets: vec![],
            }])
            .unwrap();
    }
    let f = d.join(DIRECTORY_FILE);
    let clean = std::fs::read(&f).unwrap();
    // Garbage over every part of the file in turn: each open answers (an empty
    // directory, the file set aside, or a directory as of the last whole commit).
    let mut aside = 0;
    for at in (0..clean.len()).step_by(clean.len() / 16 + 1) {
        let mut b = clean.clone();
        let end = (at + 512).min(b.len());
        for x in &mut b[at..end] {
            *x ^= 0x5a;
        }
        std::fs::write(&f, &b).unwrap();
        let (_s, l) = MetaStore::open(&d, || "new".into(), 60_000)
            .unwrap_or_else(|e| panic!("garbage at {at}: start refused: {e}"));
        assert!(l.image.keys.len() <= 199);
        if let Some(p) = &l.set_aside {
            aside += 1;
            assert_eq!(l.image.keys.len(), 0);
            assert_eq!(l.instance, "new", "an empty directory is a new one");
            assert_eq!(std::fs::read(p).unwrap(), b, "the damaged file is kept");
            std::fs::remove_file(p).unwrap();
        }
    }
    assert!(aside > 0, "some damage is seen");
    std::fs::remove_dir_all(&d).unwrap();
}

/// A key record as record format 1 wrote it (main at 18bee5a: `encode_key`
/// with `KEY_VERSION` 1, no check).
fn encode_key_format1(k: &KeyRecord) -> Vec<u8> {
    let mut out = vec![1u8];
    out.extend_from_slice(&k.scope.to_le_bytes());
    for v in [k.region_id, k.offset, k.length, k.used] {
        out.extend_from_slice(&v.to_le_bytes());
    }
    let name = |out: &mut Vec<u8>, s: &str| {
        out.extend_from_slice(&(s.len() as u16).to_le_bytes());
        out.extend_from_slice(s.as_bytes());
    };
    name(&mut out, &k.name);
    match &k.prev {
        Some(p) => {
            out.push(1);
            name(&mut out, p);
        }
        None => out.push(0),
    }
    out
}

/// A JSON record as format 1 wrote it: its struct had no `check`.
fn json_format1<T: serde::Serialize>(v: &T) -> Vec<u8> {
    let mut j = serde_json::to_value(v).unwrap();
    j.as_object_mut().unwrap().remove("check");
    serde_json::to_vec(&j).unwrap()
}

/// Writes the state directory `d` as the release of record format 1 did (main
/// at 18bee5a: the same redb 2.6.4 tables, bare scalars in `meta`, records
/// without checks, the file 0644 as it made it).
fn write_format1(d: &Path, img: &Image, secrets: &[(&str, SecretRecord)]) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(d).unwrap();
    std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o700)).unwrap();
    let f = d.join(DIRECTORY_FILE);
    let db = Database::create(&f).unwrap();
    let txn = db.begin_write().unwrap();
    {
        let mut meta = txn.open_table(META).unwrap();
        for (k, v) in [
            ("format", "1"),
            ("instance", "inst-old"),
            ("run", "3"),
            (LEASE_TIMEOUT, "60000"),
            ("next_session", "5"),
        ] {
            meta.insert(k, v.as_bytes()).unwrap();
        }
        let mut t = txn.open_table(SCOPES).unwrap();
        for s in &img.scopes {
            t.insert(s.id, json_format1(s).as_slice()).unwrap();
        }
        let mut t = txn.open_table(SESSIONS).unwrap();
        for s in &img.sessions {
            t.insert(s.id, json_format1(s).as_slice()).unwrap();
        }
        let mut t = txn.open_table(REGIONS).unwrap();
        for g in &img.regions {
            t.insert(g.handle.region_id, json_format1(g).as_slice())
                .unwrap();
        }
        let mut t = txn.open_table(KEYS).unwrap();
        for k in &img.keys {
            t.insert(k.id, encode_key_format1(k).as_slice()).unwrap();
        }
        let mut t = txn.open_table(USED).unwrap();
        t.insert(1, 77).unwrap();
        let mut t = txn.open_table(SECRETS).unwrap();
        for (h, s) in secrets {
            t.insert(*h, json_format1(s).as_slice()).unwrap();
        }
    }
    txn.commit().unwrap();
    drop(db);
    std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o644)).unwrap();
}

fn format1_image() -> Image {
    use maru::wire::meta::Backend;
    use maru::wire::rm::{Handle, PoolInfo};
    let region = RegionRecord {
        handle: Handle {
            region_id: 1,
            offset: 0,
            length: 4 * 4096,
            token: "t".into(),
        },
        pool: PoolInfo {
            pool_id: 0,
            path: "/dev/dax0.0".into(),
            uuid: "u".into(),
            kind: "file".into(),
            total: 1 << 30,
            free: 0,
            align: 4096,
            draining: 0,
        },
        agent: None,
        backend: Backend::Cxl,
        holder: maru::meta::records::HolderRecord::Session(4),
        boot_id: Some("b1".into()),
        pages: 4,
        allocated: vec![0, 1, 2],
        check: 0,
    };
    let k = |id: u64, region_id: u64, page: u64| KeyRecord {
        region_id,
        offset: page * 4096,
        length: 4000,
        ..key(id)
    };
    Image {
        scopes: vec![ScopeRecord {
            id: 0,
            namespace: "ns".into(),
            layout: "l".into(),
            backend: Backend::Cxl,
            check: 0,
        }],
        sessions: vec![SessionRecord {
            id: 4,
            owner: "w:1".into(),
            tenant: "default".into(),
            writes: true,
            engine_id: "e".into(),
            namespace: "ns".into(),
            backend: Backend::Cxl,
            scope: 0,
            check: 0,
        }],
        regions: vec![region],
        // 1: good; 2 and 3 at one page; 4 of a region not recorded; 5 on a page
        // not allocated.
        keys: vec![k(1, 1, 0), k(2, 1, 1), k(3, 1, 1), k(4, 9, 0), k(5, 1, 3)],
        ..Default::default()
    }
}

/// Issue 49: an upgrade keeps the cache. A directory written by the release of
/// record format 1 (by a test-only writer with that release's encoding: see
/// [`write_format1`]) is sealed into this format at the first start, once: the
/// records it can vouch for come back with their checks (a key's bound to its
/// region's boot id), the others are dropped (two keys at one page, a key of a
/// region not recorded or on a page not allocated), the scalars are taken as
/// they were and written back sealed, the 0644 file is made 0600. Seen failing
/// with the upgrade off: the start was refused ("written in record format 1").
#[test]
fn a_format1_directory_of_the_last_release_is_sealed_once_and_keeps_its_keys() {
    use std::os::unix::fs::PermissionsExt;
    let d = dir();
    let secret = SecretRecord {
        owner: "w:1".into(),
        tenant: "default".into(),
        check: 0,
    };
    write_format1(&d, &format1_image(), &[("h1", secret)]);
    let (store, l) = MetaStore::open(&d, || "fresh".into(), 60_000).unwrap();
    let mode = std::fs::metadata(d.join(DIRECTORY_FILE))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
    let up = l.upgraded.expect("upgraded");
    assert_eq!((up.kept, up.dropped), (4, 4), "{up:?}");
    assert_eq!((l.instance.as_str(), l.run), ("inst-old", 4));
    assert_eq!(l.image.lease_timeout_ms, 60_000);
    assert_eq!(l.image.next_session, 5);
    assert_eq!(l.image.keys.len(), 1);
    let k = &l.image.keys[0];
    assert_eq!((k.id, k.used), (1, 77), "the use stamp kept");
    assert!(k.verify(Some("b1")), "sealed with its region's boot id");
    assert!(l.image.regions.iter().all(|g| g.verify()));
    assert!(l.image.sessions.iter().all(|s| s.verify()));
    assert!(l.image.scopes.iter().all(|s| s.verify()));
    assert!(l.secrets.len() == 1 && l.secrets[0].1.verify());
    drop(store);
    // Once: the next start reads format 2 as it is.
    let (_s, l2) = MetaStore::open(&d, || "fresh".into(), 60_000).unwrap();
    assert_eq!(l2.upgraded, None);
    assert_eq!((l2.run, l2.image.keys.clone()), (5, l.image.keys.clone()));
    std::fs::remove_dir_all(&d).unwrap();
}

/// Issue 49: the state directory and its files, left readable by group or
/// others by an older maru-server (0755, 0644), are made 0700 and 0600 and the
/// start goes on; ones group or others may write, ones of another user, and
/// symbolic links are refused, naming the fix. Seen failing with the tightening
/// off (the 0755 directory refused).
#[test]
fn own_files_others_may_read_are_tightened_the_rest_refused() {
    use std::os::unix::fs::{chown, symlink, PermissionsExt};
    let set =
        |p: &Path, m: u32| std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).unwrap();
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    let d = dir();
    drop(MetaStore::open(&d, || "i".into(), 60_000).unwrap());
    set(&d, 0o755);
    set(&d.join(DIRECTORY_FILE), 0o644);
    set(&d.join(LOCK_FILE), 0o640);
    drop(MetaStore::open(&d, || "i".into(), 60_000).expect("tightened"));
    assert_eq!(mode(&d), 0o700);
    assert_eq!(mode(&d.join(DIRECTORY_FILE)), 0o600);
    assert_eq!(mode(&d.join(LOCK_FILE)), 0o600);
    let refused = |says: &str| {
        let e = MetaStore::open(&d, || "i".into(), 60_000)
            .err()
            .expect("refused");
        assert!(e.contains(says), "{says}: {e}");
    };
    for m in [0o775, 0o757, 0o720] {
        set(&d, m);
        refused("may write it");
        assert_eq!(mode(&d), m, "left as it was");
    }
    set(&d, 0o700);
    for m in [0o664, 0o646] {
        set(&d.join(DIRECTORY_FILE), m);
        refused("chmod 600");
    }
    set(&d.join(DIRECTORY_FILE), 0o600);
    // Another user's (the tests run as root: nobody's).
    if unsafe { libc::geteuid() } == 0 {
        chown(d.join(DIRECTORY_FILE), Some(65534), None).unwrap();
        refused("owned by uid 65534");
        chown(d.join(DIRECTORY_FILE), Some(0), None).unwrap();
        chown(&d, Some(65534), None).unwrap();
        refused("owned by uid 65534");
        chown(&d, Some(0), None).unwrap();
    }
    std::fs::rename(d.join(LOCK_FILE), d.join("lock.real")).unwrap();
    symlink(d.join("lock.real"), d.join(LOCK_FILE)).unwrap();
    refused("symbolic link");
    std::fs::remove_file(d.join(LOCK_FILE)).unwrap();
    drop(MetaStore::open(&d, || "i".into(), 60_000).expect("as it was"));
    std::fs::remove_dir_all(&d).unwrap();
}

/// Every place `needle` starts in `hay`.
fn find_all(hay: &[u8], needle: &[u8]) -> Vec<usize> {
    hay.windows(needle.len())
        .enumerate()
        .filter(|(_, w)| *w == needle)
        .map(|(i, _)| i)
        .collect()
}

/// Issue 49: a bit flipped in any field of any record (keys, regions,
/// sessions, the meta scalars; every copy of it in the file), in the file as a
/// clean stop left it or as a crash left it (copied while the store was open,
/// so its next open repairs it, checking the store's page checksums), never
/// refuses the start and never reads back as another record that holds its
/// check: each record read back is the one written, or fails its check (a
/// miss), or the file was set aside (every key a miss). Seen failing with damage
/// refusing the start (the crash image's repair found the page).
#[test]
fn a_flipped_bit_after_a_clean_stop_or_a_crash_is_a_miss_never_a_refusal() {
    const CASES: usize = 64;
    let d = dir();
    let boot = Some("boot-7");
    let keys: Vec<KeyRecord> = (1..=40)
        .map(|i| {
            KeyRecord {
                name: format!("pk-key-{i:04}"),
                region_id: 1 + i % 2,
                offset: i * 16384,
                length: 16000,
                ..key(i)
            }
            .sealed(boot)
        })
        .collect();
    let mut region = format1_image().regions[0].clone();
    region.boot_id = boot.map(String::from);
    let regions: Vec<RegionRecord> = (1..=2)
        .map(|r| {
            let mut g = region.clone();
            g.handle.region_id = r;
            g.handle.offset = r << 30;
            g.sealed()
        })
        .collect();
    let (clean, crashed) = {
        let (store, _) = MetaStore::open(&d, || "i".into(), 60_000).unwrap();
        let mut records: Vec<Record> = keys.iter().cloned().map(Record::Key).collect();
        records.extend(regions.iter().cloned().map(Record::Region));
        records.extend((1..=3).map(|i| Record::Session(session(i))));
        records.push(Record::NextSession(4));
        commit_first(&store, records);
        let crashed = std::fs::read(d.join(DIRECTORY_FILE)).unwrap();
        drop(store);
        (std::fs::read(d.join(DIRECTORY_FILE)).unwrap(), crashed)
    };
    // (start, end) of every copy of each record.
    let spans = |file: &[u8]| -> Vec<Vec<(usize, usize)>> {
        let mut out: Vec<Vec<(usize, usize)>> = Vec::new();
        for k in &keys {
            let copies: Vec<(usize, usize)> = find_all(file, k.name.as_bytes())
                .into_iter()
                .filter(|&at| at >= 39 && file[at - 39] == 2)
                .map(|at| (at - 39, at + k.name.len() + 1 + 8))
                .collect();
            out.push(copies);
        }
        for marker in [&br#"{"handle":"#[..], br#"{"id":"#, br#"{"name":""#] {
            let mut by_text: BTreeMap<Vec<u8>, Vec<(usize, usize)>> = BTreeMap::new();
            for start in find_all(file, marker) {
                let Some(end) = file[start..].iter().position(|&c| c == b'}') else {
                    continue;
                };
                // The region record's first '}' closes its handle: to the end of
                // its check.
                let end =
                    match find_all(&file[start..(start + 2048).min(file.len())], b"\"check\":")
                        .first()
                    {
                        Some(c) => {
                            start
                                + c
                                + file[start + c..]
                                    .iter()
                                    .position(|&x| x == b'}')
                                    .unwrap_or(0)
                                + 1
                        }
                        None => start + end + 1,
                    };
                by_text
                    .entry(file[start..(start + 24).min(end)].to_vec())
                    .or_default()
                    .push((start, end));
            }
            out.extend(by_text.into_values());
        }
        out.retain(|c| !c.is_empty());
        out
    };
    let mut rng = 0x49_f11b_u64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let (mut exact, mut missed, mut aside) = (0usize, 0usize, 0usize);
    for base in [&clean, &crashed] {
        std::fs::write(d.join(DIRECTORY_FILE), base).unwrap();
        let (_s, l) = MetaStore::open(&d, || "i".into(), 60_000).unwrap();
        assert_eq!(
            (
                l.image.keys.len(),
                l.image.sessions.len(),
                l.image.next_session
            ),
            (40, 3, 4),
            "unflipped"
        );
    }
    let found = [spans(&clean), spans(&crashed)];
    for all in &found {
        assert!(all.len() >= 40 + 2 + 3, "records found: {}", all.len());
    }
    for case in 0..CASES {
        let base = if case % 2 == 0 { &clean } else { &crashed };
        let all = &found[case % 2];
        let copies = &all[next() as usize % all.len()];
        let (start, end) = copies[0];
        let bit = next() as usize % ((end - start) * 8);
        let mut b = base.clone();
        for (s0, _) in copies {
            b[s0 + bit / 8] ^= 1 << (bit % 8);
        }
        std::fs::write(d.join(DIRECTORY_FILE), &b).unwrap();
        let (store, l) = MetaStore::open(&d, || "i".into(), 60_000).unwrap_or_else(|e| {
            panic!("case {case} (crash: {}): start refused: {e}", case % 2 == 1)
        });
        drop(store);
        if let Some(p) = &l.set_aside {
            aside += 1;
            std::fs::remove_file(p).unwrap();
            continue;
        }
        for k in &l.image.keys {
            if k.verify(boot) {
                let mut want = keys[(k.id - 1) as usize].clone();
                want.used = k.used;
                assert_eq!(
                    *k, want,
                    "case {case}: another key's record holds its check"
                );
                exact += 1;
            }
        }
        missed += keys.len() - l.image.keys.iter().filter(|k| k.verify(boot)).count();
        for g in &l.image.regions {
            assert!(!g.verify() || regions.contains(g), "case {case}: {g:?}");
        }
        for x in &l.image.sessions {
            assert!(!x.verify() || *x == session(x.id), "case {case}: {x:?}");
        }
        // The store's repair may roll back to the commit before (sessions and
        // counter with it): this run's session ids are above every earlier
        // run's (`SESSION_RUN_SHIFT`, at restore).
        assert!(
            l.image.next_session >= 4 || (l.image.sessions.is_empty() && l.run >= 2),
            "case {case}"
        );
    }
    eprintln!(
        "{CASES} cases: {exact} keys read back exact, {missed} misses, {aside} files set aside"
    );
    std::fs::remove_dir_all(&d).unwrap();
}

fn session(id: u64) -> SessionRecord {
    SessionRecord {
        id,
        owner: "w".into(),
        tenant: "t".into(),
        writes: true,
        engine_id: "e".into(),
        namespace: "n".into(),
        backend: maru::wire::meta::Backend::Cxl,
        scope: 0,
        check: 0,
    }
    .sealed()
}

/// Changes the meta and sessions tables of a closed store.
type Poke = dyn Fn(&mut redb::Table<&str, &[u8]>, &mut redb::Table<u64, &[u8]>);

/// Issue 49: the scalars of the meta table are checked. A next-session counter
/// changed on disk (both copies) or rolled back never names a recorded session
/// (also one whose record does not decode); one changed copy of a scalar is
/// read from the other; a run counter whose copies both fail is replaced by one
/// above any counted run. Seen failing with the floor of recorded session ids
/// removed (next session 2 with session 5 recorded).
#[test]
fn a_changed_or_rolled_back_counter_never_names_a_recorded_session() {
    let d = dir();
    {
        let (store, _) = MetaStore::open(&d, || "i".into(), 60_000).unwrap();
        let mut records: Vec<Record> = (1..=5).map(|i| Record::Session(session(i))).collect();
        records.push(Record::NextSession(9));
        commit_first(&store, records);
    }
    let poke = |f: &Poke| {
        let db = Database::open(d.join(DIRECTORY_FILE)).unwrap();
        let txn = db.begin_write().unwrap();
        {
            let mut meta = txn.open_table(META).unwrap();
            let mut sessions = txn.open_table(SESSIONS).unwrap();
            f(&mut meta, &mut sessions);
        }
        txn.commit().unwrap();
    };
    let open = || MetaStore::open(&d, || "i".into(), 60_000).unwrap().1;
    assert_eq!(open().image.next_session, 9);
    // Rolled back (sealed, both copies), and session 5's record garbled.
    poke(&|m, s| {
        put_scalar(m, "next_session", "2").unwrap();
        s.insert(5, b"{garbled".as_slice()).unwrap();
    });
    let l = open();
    assert_eq!(l.image.sessions.len(), 4);
    assert_eq!(
        l.image.next_session, 6,
        "after session 5, whose record is lost"
    );
    // Changed on disk: both copies fail their checks.
    poke(&|m, _| {
        for k in ["next_session", "next_session#2"] {
            let mut v = m.get(k).unwrap().unwrap().value().to_vec();
            let at = v.iter().position(|&c| c == b'2').unwrap();
            v[at] = b'1';
            m.insert(k, v.as_slice()).unwrap();
        }
    });
    assert_eq!(open().image.next_session, 6);
    // One copy of the run counter changed: the other is read.
    let run = open().run;
    poke(&|m, _| {
        m.insert("run", br#"{"name":"run","value":"1","check":0}"#.as_slice())
            .unwrap();
    });
    assert_eq!(open().run, run + 1);
    // Both: a run above any counted one.
    poke(&|m, _| {
        for k in ["run", "run#2"] {
            m.insert(k, br#"{"name":"run","value":"1","check":0}"#.as_slice())
                .unwrap();
        }
    });
    assert_eq!(open().run, UNKNOWN_RUN + 1);
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn a_longer_lease_timeout_of_the_last_run_stays_recorded_until_its_leases_ran_out() {
    let d = dir();
    drop(MetaStore::open(&d, || "i".into(), 600_000).unwrap());
    // A start with a shorter timeout waits out the last run's leases...
    let (store, l) = MetaStore::open(&d, || "i".into(), 60_000).unwrap();
    assert_eq!((l.image.run, l.image.lease_timeout_ms), (2, 600_000));
    assert_eq!(
        l.lease_timeout_settles,
        Some((Duration::from_millis(600_000), 60_000))
    );
    drop(store);
    // ...and so does the start after it, when it stopped before they ran out.
    let (store, l) = MetaStore::open(&d, || "i".into(), 60_000).unwrap();
    assert_eq!(l.image.lease_timeout_ms, 600_000);
    // Once they ran out, the writer records this run's.
    let mut w = StoreWriter::start(store, || {}, Some((Duration::ZERO, 60_000)));
    std::thread::sleep(Duration::from_millis(200));
    w.close();
    let (_s, l) = MetaStore::open(&d, || "i".into(), 60_000).unwrap();
    assert_eq!((l.image.run, l.image.lease_timeout_ms), (4, 60_000));
    assert_eq!(l.lease_timeout_settles, None);
    std::fs::remove_dir_all(&d).unwrap();
}

/// A job is committed by itself (nothing has to follow it), and jobs sent while a
/// commit runs share the next one (a group commit). Seen failing with a commit per
/// job.
#[test]
fn a_job_is_committed_alone_and_jobs_sent_together_share_commits() {
    let d = dir();
    let (store, _) = MetaStore::open(&d, || "i".into(), 60_000).unwrap();
    let mut w = StoreWriter::start(store, || {}, None);
    let batch = |b: u64| {
        Some(Changes {
            batch: b,
            records: vec![Record::Key(key(b))],
        })
    };
    let started = Instant::now();
    let seq = w.send(batch(1), vec![]);
    while w.durable_seq() < seq && started.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(w.durable_seq(), seq, "a job alone is committed");
    let commits = w.commits.load(Ordering::Relaxed);
    let mut last = 0;
    for b in 2..12 {
        last = w.send(batch(b), vec![]);
    }
    assert!(w.sync(Duration::from_secs(5)));
    assert_eq!(w.durable_seq(), last);
    let n = w.commits.load(Ordering::Relaxed) - commits;
    assert!(n < 10, "10 jobs sent at once took {n} commits");
    w.close();
    let (_s, l) = MetaStore::open(&d, || "i".into(), 60_000).unwrap();
    assert_eq!(l.image.keys.len(), 11);
    std::fs::remove_dir_all(&d).unwrap();
}

/// The core leaves the checks of its JSON records (scopes, sessions, regions) to the
/// store, off the event loop: the writer seals each batch before it writes it, so
/// every record it wrote holds its check when read back. Seen failing with the
/// writer's sealing left out (the region's and the session's checks were 0).
#[test]
fn the_writer_seals_the_records_the_core_left_unsealed() {
    let d = dir();
    let (store, _) = MetaStore::open(&d, || "i".into(), 60_000).unwrap();
    let mut w = StoreWriter::start(store, || {}, None);
    let mut region = format1_image().regions[0].clone();
    region.check = 0;
    let session = SessionRecord {
        check: 0,
        ..session(1)
    };
    let records = vec![Record::Region(region), Record::Session(session)];
    w.send(Some(Changes { batch: 1, records }), vec![]);
    assert!(w.sync(Duration::from_secs(5)));
    w.close();
    let (_s, l) = MetaStore::open(&d, || "i".into(), 60_000).unwrap();
    assert_eq!((l.image.regions.len(), l.image.sessions.len()), (1, 1));
    assert!(
        l.image.regions[0].verify(),
        "the region record holds its check"
    );
    assert!(
        l.image.sessions[0].verify(),
        "the session record holds its check"
    );
    std::fs::remove_dir_all(&d).unwrap();
}
