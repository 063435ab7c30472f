//! maru-server's durable directory (`--state-dir`): the metadata core's record
//! batches ([`maru::meta::records`]) kept in an embedded B-tree store (redb: crash-safe
//! commits with checksums, space reused as keys come and go), one table per kind of
//! record, plus the session secrets and the server's instance and run number.
//!
//! Batches are written by a thread of their own ([`StoreWriter`]): the event loop
//! hands over each batch and goes on; the writer takes every batch waiting, commits
//! them together (one fsync for all: a group commit), then says how far it got and
//! wakes the loop, which sends the replies that waited for those batches.

use maru::meta::records::{
    decode_json, decode_key, encode_json, encode_key, Changes, Image, KeyRecord, Record,
    RecordError, RegionRecord, ScopeRecord, Sealed, SessionRecord, FORMAT,
};
use redb::{Database, ReadableTable, ReadableTableMetadata, TableDefinition};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

const KEYS: TableDefinition<u64, &[u8]> = TableDefinition::new("keys");
/// Use stamps newer than the key's record (reads since it was written).
const USED: TableDefinition<u64, u64> = TableDefinition::new("used");
const REGIONS: TableDefinition<u64, &[u8]> = TableDefinition::new("regions");
const SESSIONS: TableDefinition<u64, &[u8]> = TableDefinition::new("sessions");
const SCOPES: TableDefinition<u32, &[u8]> = TableDefinition::new("scopes");
/// sha256 (hex) of a session secret → its owner and tenant.
const SECRETS: TableDefinition<&str, &[u8]> = TableDefinition::new("secrets");
const META: TableDefinition<&str, &[u8]> = TableDefinition::new("meta");

/// The meta record of the longest lease a start must wait out for the run before it.
const LEASE_TIMEOUT: &str = "lease_timeout_ms";

/// The store's page cache (redb's: 9/10 for reads, 1/10 for writes), a fixed size
/// whatever the keys. A recovery reads every key once, in order: no cache speeds it;
/// commits append new keys at the end of their table and rewrite use stamps all over
/// it, so a cache keeps warm the tables' upper pages (a few MiB at 16 M keys), and a
/// miss is a read from the kernel's page cache on the store's thread, not the loop.
const CACHE_BYTES: usize = 16 << 20;

/// A session secret kept across restarts (its hash only), with a check of its fields
/// ([`Sealed`]).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SecretRecord {
    pub owner: String,
    pub tenant: String,
    #[serde(default)]
    pub check: u64,
}

impl Sealed for SecretRecord {
    const LABEL: &'static [u8] = b"maru-secret-record";
    fn check_mut(&mut self) -> &mut u64 {
        &mut self.check
    }
}

/// A change to the kept session secrets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SecretOp {
    Put(String, SecretRecord),
    Delete(String),
}

/// What a state directory held at start.
pub struct Loaded {
    pub image: Image,
    pub secrets: Vec<(String, SecretRecord)>,
    /// Names this directory (and so the server) across restarts.
    pub instance: String,
    /// Starts of maru-server on this directory, this one included (also in
    /// `image.run`; `image.lease_timeout_ms` is the longest lease of the last run).
    pub run: u64,
    /// When the lease timeout recorded for the next start may come down to this
    /// run's (once every lease of the last run, longer, has run out; see
    /// [`StoreWriter::start`]): None when it is this run's already.
    pub lease_timeout_settles: Option<(Duration, u64)>,
    /// How long reading the directory took.
    pub read: Duration,
    /// Records that did not decode or whose check failed here (secrets): dropped
    /// and logged, never served (the core checks the others' at restore).
    pub dropped: u64,
    /// The directory was of record format 1 and was sealed into this format at this
    /// start ([`maru::meta::seal_format1`]).
    pub upgraded: Option<maru::meta::Sealed1>,
    /// The file was damaged past what the store can read (a bit changed in its
    /// structure, seen by the store's own checks): it was moved here and this start
    /// began with an empty directory (every key a miss, never a refused start).
    pub set_aside: Option<PathBuf>,
}

/// A scalar of the meta table (format, instance, run, lease timeout, next session
/// id), kept twice (under its name and under its name with [`SECOND_COPY`]), each
/// copy with a check of its name and value ([`Sealed`]): a copy changed on disk
/// fails its check and the other one is read.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
struct Scalar {
    name: String,
    value: String,
    #[serde(default)]
    check: u64,
}

impl Sealed for Scalar {
    const LABEL: &'static [u8] = b"maru-meta-scalar";
    fn check_mut(&mut self) -> &mut u64 {
        &mut self.check
    }
}

/// The name of a scalar's second copy is its name and this.
const SECOND_COPY: &str = "#2";

/// The run taken when neither copy of the run counter holds its check: above any
/// run a directory reaches by counting starts, so lease ids of this run
/// ([`maru::meta::LEASE_RUN_SHIFT`]) stay apart from the last run's.
const UNKNOWN_RUN: u64 = 1 << 23;

/// The last run's lease timeout taken when neither copy of it holds its check
/// (pages of recovered keys wait for the leases of the last run at most this long).
const UNKNOWN_LEASE_MS: u64 = 3_600_000;

/// Writes both copies of scalar `name`.
fn put_scalar(
    meta: &mut redb::Table<&str, &[u8]>,
    name: &str,
    value: &str,
) -> Result<(), redb::StorageError> {
    let rec = Scalar {
        name: name.into(),
        value: value.into(),
        check: 0,
    }
    .sealed();
    let bytes = encode_json(&rec);
    meta.insert(name, bytes.as_slice())?;
    meta.insert(format!("{name}{SECOND_COPY}").as_str(), bytes.as_slice())?;
    Ok(())
}

/// What the copies of a scalar read back as.
#[derive(Debug, Clone, PartialEq, Eq)]
enum ScalarRead {
    /// Neither copy is there.
    Absent,
    /// The values of the copies that hold their check (or, in a directory written
    /// before scalars were sealed, the bare value under its name).
    Values(Vec<String>),
    /// Copies are there, and none holds its check: changed on disk.
    Bad,
}

impl ScalarRead {
    /// The largest number among the values (counters only grow).
    fn number(&self) -> Option<u64> {
        match self {
            ScalarRead::Values(v) => v.iter().filter_map(|x| x.parse::<u64>().ok()).max(),
            _ => None,
        }
    }

    fn text(&self) -> Option<&str> {
        match self {
            ScalarRead::Values(v) => v.first().map(String::as_str),
            _ => None,
        }
    }
}

/// Reads both copies of scalar `name`. A bare value (no JSON: what a directory
/// written before scalars were sealed holds under the name) is taken as it is, once:
/// the start writes it back sealed. A sealed copy with one changed bit is never
/// taken for a bare one (it keeps its quotes).
fn get_scalar(
    meta: &impl ReadableTable<&'static str, &'static [u8]>,
    name: &str,
) -> Result<ScalarRead, redb::StorageError> {
    let mut values = Vec::new();
    let mut seen = false;
    for (key, first) in [
        (name.to_string(), true),
        (format!("{name}{SECOND_COPY}"), false),
    ] {
        let Some(v) = meta.get(key.as_str())? else {
            continue;
        };
        seen = true;
        let b = v.value();
        match decode_json::<Scalar>("scalar", b) {
            Ok(s) if s.name == name && s.verify() => values.push(s.value),
            Ok(_) => {}
            Err(_) if first && !b.contains(&b'"') && !b.contains(&b'{') => {
                values.push(String::from_utf8_lossy(b).to_string())
            }
            Err(_) => {}
        }
    }
    Ok(match (seen, values.is_empty()) {
        (false, _) => ScalarRead::Absent,
        (true, true) => ScalarRead::Bad,
        (true, false) => ScalarRead::Values(values),
    })
}

/// Why reading the directory file failed.
enum Fail {
    /// The file is damaged past what the store reads (its checks fail, or its
    /// structure does not hold together): it is set aside and the start goes on
    /// with an empty directory.
    Damaged(String),
    /// Anything else (I/O, a format this server does not read): the start is
    /// refused with the error.
    Refused(String),
}

impl Fail {
    fn message(self) -> String {
        match self {
            Fail::Damaged(m) | Fail::Refused(m) => m,
        }
    }
}

/// Maps a store error to a [`Fail`]: I/O errors refuse the start, the rest are
/// damage.
fn fail<'a, E: Into<redb::Error>>(p: &'a Path, what: &'a str) -> impl Fn(E) -> Fail + 'a {
    move |e| {
        let e: redb::Error = e.into();
        let msg = err(p, what, &e);
        match e {
            // What redb reads as a file that is not its own (a garbled header).
            redb::Error::Io(ref io)
                if matches!(
                    io.kind(),
                    std::io::ErrorKind::InvalidData | std::io::ErrorKind::UnexpectedEof
                ) =>
            {
                Fail::Damaged(msg)
            }
            redb::Error::Io(_)
            | redb::Error::DatabaseAlreadyOpen
            | redb::Error::UpgradeRequired(_)
            | redb::Error::LockPoisoned(_) => Fail::Refused(msg),
            _ => Fail::Damaged(msg),
        }
    }
}

/// A key record of record format 1: format 2's without the check at its end (and
/// version byte 1).
fn decode_key_format1(id: u64, bytes: &[u8]) -> Result<KeyRecord, RecordError> {
    match bytes.first() {
        Some(1) => {}
        v => {
            return Err(RecordError(format!(
                "key {id}: record version {v:?}, format 1 has version 1"
            )))
        }
    }
    let mut b = Vec::with_capacity(bytes.len() + 8);
    b.push(2);
    b.extend_from_slice(&bytes[1..]);
    b.extend_from_slice(&[0; 8]);
    decode_key(id, &b)
}

/// How long a start tries a held lock again: a fork of the process that closed the
/// store (any thread spawning a program) holds its descriptor until the child's exec.
const LOCK_WAIT: Duration = Duration::from_millis(250);

/// An open state directory.
pub struct MetaStore {
    db: Database,
    path: PathBuf,
    /// The lock file, held (flock) while the store is open.
    _lock: std::fs::File,
}

/// What a start made of the meta scalars: the instance, this run, the last run's
/// lease timeout.
type Started = (String, u64, u64);

/// Opens the store in `file` and reads it: a directory of record format 1 sealed
/// into this format first, this start counted, every table read.
fn load(
    file: std::fs::File,
    path: &Path,
    instance: &mut dyn FnMut() -> String,
    lease_timeout_ms: u64,
) -> Result<(Database, Option<maru::meta::Sealed1>, Started, ReadBack), Fail> {
    let db = std::panic::catch_unwind(|| {
        Database::builder()
            .set_cache_size(CACHE_BYTES)
            .create_file(file)
    })
    .map_err(|_| {
        Fail::Damaged(err(
            path,
            "open",
            "the store panicked reading the file (corrupted?)",
        ))
    })?
    .map_err(fail(path, "open"))?;
    let read = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let upgraded = upgrade_format1(&db, path)?;
        let started = start_run(&db, path, instance, lease_timeout_ms)?;
        let back = read_all(&db, path)?;
        Ok::<_, Fail>((upgraded, started, back))
    }))
    .map_err(|_| {
        Fail::Damaged(err(
            path,
            "read",
            "the store panicked reading the file (corrupted?)",
        ))
    })??;
    Ok((db, read.0, read.1, read.2))
}

impl MetaStore {
    /// Opens (or makes) the state directory `dir` (0700; refused when it is a
    /// symbolic link, another user's, or group or others may access it), locks it
    /// against a second maru-server, and reads it. Its files are opened without
    /// following symbolic links and made 0600 (an existing one others may access is
    /// refused). A record that does not decode is dropped and logged (a miss, never
    /// served); the core checks each record's own check at restore. A commit cut by
    /// a crash is rolled back by the store to the last whole one.
    ///
    /// `lease_timeout_ms` is this run's: recorded before anything is served (the
    /// longer of it and the last run's, while leases of the last run may run), so
    /// that the next start knows how long a lease of this run may last.
    pub fn open(
        dir: &Path,
        new_instance: impl FnOnce() -> String,
        lease_timeout_ms: u64,
    ) -> Result<(MetaStore, Loaded), String> {
        let started = Instant::now();
        let dir_fd = open_state_dir(dir)?;
        let lock_path = dir.join(LOCK_FILE);
        let lock = open_private_file(&dir_fd, LOCK_FILE, &lock_path)?;
        // SAFETY: flock on a file descriptor this function owns.
        let locked =
            || unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) == 0 };
        let by = started + LOCK_WAIT;
        while !locked() {
            if Instant::now() >= by {
                return Err(format!(
                    "state directory {} is in use by another maru-server: give each server \
                     its own --state-dir (or --in-memory for a throwaway one)",
                    dir.display()
                ));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let path = dir.join(DIRECTORY_FILE);
        let mut make = Some(new_instance);
        let mut made: Option<String> = None;
        let mut instance = move || -> String {
            if made.is_none() {
                made = make.take().map(|f| f());
            }
            made.clone().unwrap_or_default()
        };
        let file = open_private_file(&dir_fd, DIRECTORY_FILE, &path)?;
        let (
            db,
            upgraded,
            set_aside_at,
            (instance, run, last_lease_ms),
            (mut image, secrets, dropped),
        ) = match load(file, &path, &mut instance, lease_timeout_ms) {
            Ok((db, up, started, back)) => (db, up, None, started, back),
            Err(Fail::Refused(e)) => return Err(e),
            Err(Fail::Damaged(e)) => {
                let aside = set_aside(&dir_fd, &path)?;
                log::error!(
                    "{e}: the store cannot read it; moved to {} and starting with an empty \
                         directory (every key a miss, a new instance: the RM reaps the old \
                         one's regions after its grace period). Remove that file once it is no \
                         longer wanted",
                    aside.display()
                );
                let file = open_private_file(&dir_fd, DIRECTORY_FILE, &path)?;
                let (db, up, started, back) =
                    load(file, &path, &mut instance, lease_timeout_ms).map_err(Fail::message)?;
                (db, up, Some(aside), started, back)
            }
        };
        let store = MetaStore {
            db,
            path: path.clone(),
            _lock: lock,
        };
        image.run = run;
        image.lease_timeout_ms = last_lease_ms;
        let lease_timeout_settles = (last_lease_ms > lease_timeout_ms)
            .then(|| (Duration::from_millis(last_lease_ms), lease_timeout_ms));
        Ok((
            store,
            Loaded {
                image,
                secrets,
                instance,
                run,
                lease_timeout_settles,
                read: started.elapsed(),
                dropped,
                upgraded,
                set_aside: set_aside_at,
            },
        ))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Records the lease timeout the next start waits out for this run's leases.
    fn record_lease_timeout(&self, ms: u64) -> Result<(), String> {
        let p = &self.path;
        let txn = self.db.begin_write().map_err(|e| err(p, "begin", e))?;
        {
            let mut meta = txn.open_table(META).map_err(|e| err(p, "meta", e))?;
            put_scalar(&mut meta, LEASE_TIMEOUT, &ms.to_string()).map_err(|e| err(p, "meta", e))?;
        }
        txn.commit().map_err(|e| err(p, "commit", e))
    }

    /// Applies jobs in one transaction and commits (durable when this returns Ok).
    fn commit(&self, jobs: &[Job]) -> Result<(), String> {
        let p = &self.path;
        let txn = self.db.begin_write().map_err(|e| err(p, "begin", e))?;
        {
            let mut keys = txn.open_table(KEYS).map_err(|e| err(p, "keys", e))?;
            let mut used = txn.open_table(USED).map_err(|e| err(p, "used", e))?;
            let mut regions = txn.open_table(REGIONS).map_err(|e| err(p, "regions", e))?;
            let mut sessions = txn
                .open_table(SESSIONS)
                .map_err(|e| err(p, "sessions", e))?;
            let mut scopes = txn.open_table(SCOPES).map_err(|e| err(p, "scopes", e))?;
            let mut secrets = txn.open_table(SECRETS).map_err(|e| err(p, "secrets", e))?;
            let mut meta = txn.open_table(META).map_err(|e| err(p, "meta", e))?;
            let w = |e: redb::StorageError| err(p, "write", e);
            for job in jobs {
                for r in job.changes.iter().flat_map(|c| &c.records) {
                    match r {
                        Record::Scope(s) => {
                            scopes.insert(s.id, encode_json(s).as_slice()).map_err(w)?;
                        }
                        Record::Session(s) => {
                            sessions
                                .insert(s.id, encode_json(s).as_slice())
                                .map_err(w)?;
                        }
                        Record::SessionGone(id) => _ = sessions.remove(*id).map_err(w)?,
                        Record::NextSession(n) => {
                            put_scalar(&mut meta, "next_session", &n.to_string()).map_err(w)?;
                        }
                        Record::Region(g) => {
                            regions
                                .insert(g.handle.region_id, encode_json(g).as_slice())
                                .map_err(w)?;
                        }
                        Record::RegionGone(id) => _ = regions.remove(*id).map_err(w)?,
                        Record::Key(k) => {
                            keys.insert(k.id, encode_key(k).as_slice()).map_err(w)?;
                        }
                        Record::KeyGone(id) => {
                            keys.remove(*id).map_err(w)?;
                            used.remove(*id).map_err(w)?;
                        }
                        Record::KeyGoneUnread(id) => _ = keys.remove(*id).map_err(w)?,
                        Record::Used { id, used: u } => {
                            used.insert(*id, *u).map_err(w)?;
                        }
                    }
                }
                for s in &job.secrets {
                    match s {
                        SecretOp::Put(h, rec) => {
                            secrets
                                .insert(h.as_str(), encode_json(rec).as_slice())
                                .map_err(w)?;
                        }
                        SecretOp::Delete(h) => {
                            secrets.remove(h.as_str()).map_err(w)?;
                        }
                    }
                }
            }
        }
        txn.commit().map_err(|e| err(p, "commit", e))
    }
}

/// Makes every table, checks the format, counts this start and records its lease
/// timeout (the longer of it and the last run's), every scalar written back sealed.
/// Returns the instance, the run and the last run's lease timeout (0: none
/// recorded). A scalar whose copies both fail their check is logged and replaced:
/// the instance by a new one, the run by [`UNKNOWN_RUN`] (if higher), the last
/// run's lease timeout by [`UNKNOWN_LEASE_MS`] (if longer); the format's makes the
/// file damaged.
fn start_run(
    db: &Database,
    p: &Path,
    new_instance: &mut dyn FnMut() -> String,
    lease_timeout_ms: u64,
) -> Result<Started, Fail> {
    let txn = db.begin_write().map_err(fail(p, "begin"))?;
    let (instance, run, last_lease_ms) = {
        let mut meta = txn.open_table(META).map_err(fail(p, "meta"))?;
        let bad = |name: &str| {
            log::error!(
                "{}: both copies of {name} in the meta table fail their check (changed on disk)",
                p.display()
            );
        };
        match get_scalar(&meta, "format").map_err(fail(p, "meta"))? {
            ScalarRead::Absent => {}
            ScalarRead::Bad => {
                return Err(Fail::Damaged(err(
                    p,
                    "meta",
                    "both copies of the record format fail their check",
                )))
            }
            f => {
                let f = f.text().unwrap_or_default().to_string();
                if f != FORMAT.to_string() {
                    return Err(Fail::Refused(err(
                        p,
                        "meta",
                        format!(
                            "written in record format {f}, this maru-server reads format \
                             {FORMAT} (and seals format 1 into it): start the maru-server that \
                             wrote it, or move the file away to start with an empty directory"
                        ),
                    )));
                }
            }
        }
        let instance = match get_scalar(&meta, "instance").map_err(fail(p, "meta"))? {
            ScalarRead::Values(v) => v.into_iter().next().unwrap_or_else(&mut *new_instance),
            ScalarRead::Absent => new_instance(),
            ScalarRead::Bad => {
                bad("the instance");
                new_instance()
            }
        };
        let run = match get_scalar(&meta, "run").map_err(fail(p, "meta"))? {
            ScalarRead::Bad => {
                bad("the run counter");
                UNKNOWN_RUN
            }
            r => r.number().unwrap_or(0),
        } + 1;
        let last_lease_ms = match get_scalar(&meta, LEASE_TIMEOUT).map_err(fail(p, "meta"))? {
            ScalarRead::Bad => {
                bad("the lease timeout");
                UNKNOWN_LEASE_MS.max(lease_timeout_ms)
            }
            r => r.number().unwrap_or(0),
        };
        let next_session = get_scalar(&meta, "next_session").map_err(fail(p, "meta"))?;
        if next_session == ScalarRead::Bad {
            bad("the next session id (every recorded session's id stays taken)");
        }
        for (k, v) in [
            ("format", FORMAT.to_string()),
            ("instance", instance.clone()),
            ("run", run.to_string()),
            (
                LEASE_TIMEOUT,
                last_lease_ms.max(lease_timeout_ms).to_string(),
            ),
            (
                "next_session",
                next_session.number().unwrap_or(0).to_string(),
            ),
        ] {
            put_scalar(&mut meta, k, &v).map_err(fail(p, "meta"))?;
        }
        (instance, run, last_lease_ms)
    };
    for name in ["keys", "regions", "sessions"] {
        let def: TableDefinition<u64, &[u8]> = TableDefinition::new(name);
        txn.open_table(def).map_err(fail(p, "tables"))?;
    }
    txn.open_table(USED).map_err(fail(p, "used"))?;
    txn.open_table(SCOPES).map_err(fail(p, "scopes"))?;
    txn.open_table(SECRETS).map_err(fail(p, "secrets"))?;
    txn.commit().map_err(fail(p, "commit"))?;
    Ok((instance, run, last_lease_ms))
}

/// Each record of `table` decoded as JSON (`what`) into `into`; one that does not
/// decode, or that `check` refuses given its key (saying why), goes to `bad` (table,
/// id, why) and is never served.
fn read_records<K, R>(
    t: &impl ReadableTable<K, &'static [u8]>,
    p: &Path,
    (table, what): (&str, &str),
    into: &mut Vec<R>,
    bad: &mut impl FnMut(&str, String, String),
    check: impl Fn(u64, &R) -> Result<(), String>,
) -> Result<(), Fail>
where
    K: redb::Key + 'static,
    for<'a> K::SelfType<'a>: Into<u64>,
    R: for<'de> serde::Deserialize<'de>,
{
    for item in t.iter().map_err(fail(p, table))? {
        let (k, v) = item.map_err(fail(p, table))?;
        let id: u64 = k.value().into();
        let why = match decode_json::<R>(what, v.value()) {
            Ok(r) => match check(id, &r) {
                Ok(()) => {
                    into.push(r);
                    continue;
                }
                Err(why) => why,
            },
            Err(e) => e.0,
        };
        bad(table, id.to_string(), why);
    }
    Ok(())
}

/// Writes `rows` (key, encoded record) into `table` as part of the format 1 upgrade.
fn insert_all<'k, K: redb::Key + 'static>(
    txn: &redb::WriteTransaction,
    table: TableDefinition<K, &[u8]>,
    p: &Path,
    rows: impl IntoIterator<Item = (K::SelfType<'k>, Vec<u8>)>,
) -> Result<(), Fail> {
    let mut t = txn.open_table(table).map_err(fail(p, "upgrade"))?;
    for (k, v) in rows {
        t.insert(k, v.as_slice()).map_err(fail(p, "upgrade"))?;
    }
    Ok(())
}

/// The tables read by [`read_records`], with what each holds.
const AS_SCOPES: (&str, &str) = ("scopes", "scope");
const AS_SESSIONS: (&str, &str) = ("sessions", "session");
const AS_REGIONS: (&str, &str) = ("regions", "region");

/// Any scope record is kept. Format 1 and 2 store scopes alike.
fn any_scope(_: u64, _: &ScopeRecord) -> Result<(), String> {
    Ok(())
}

/// A region record under another region's key (not the one written there) is
/// refused. Format 1 and 2 store regions alike.
fn own_region(id: u64, r: &RegionRecord) -> Result<(), String> {
    match r.handle.region_id {
        named if named == id => Ok(()),
        named => Err(format!("it names region {named}")),
    }
}

/// A directory of record format 1 (the release before checks: records without a
/// check, bare scalars) is sealed into this format once, in one commit: every table
/// read as format 1 wrote it, [`maru::meta::seal_format1`] drops what it cannot
/// vouch for, and the rest is written back sealed (secrets too). Logs what it did.
fn upgrade_format1(db: &Database, p: &Path) -> Result<Option<maru::meta::Sealed1>, Fail> {
    let txn = db.begin_write().map_err(fail(p, "begin"))?;
    {
        let meta = txn.open_table(META).map_err(fail(p, "meta"))?;
        let f = get_scalar(&meta, "format").map_err(fail(p, "meta"))?;
        if f.text() != Some("1") {
            return Ok(None);
        }
    }
    let mut img = Image::default();
    let mut undecoded = 0u64;
    let mut bad = |table: &str, id: String, e: String| {
        undecoded += 1;
        log::warn!(
            "upgrade from record format 1: {}: record {id} of table {table} does not decode \
             ({e}): dropped, never served",
            p.display()
        );
    };
    let mut secrets = Vec::new();
    let mut used_ids = Vec::new();
    {
        let t = txn.open_table(SCOPES).map_err(fail(p, "scopes"))?;
        read_records(&t, p, AS_SCOPES, &mut img.scopes, &mut bad, any_scope)?;
        let t = txn.open_table(SESSIONS).map_err(fail(p, "sessions"))?;
        read_records(
            &t,
            p,
            AS_SESSIONS,
            &mut img.sessions,
            &mut bad,
            |id, s| match s.id {
                named if named == id => Ok(()),
                named => Err(format!("it names {named}")),
            },
        )?;
        let t = txn.open_table(REGIONS).map_err(fail(p, "regions"))?;
        read_records(&t, p, AS_REGIONS, &mut img.regions, &mut bad, own_region)?;
        let t = txn.open_table(KEYS).map_err(fail(p, "keys"))?;
        for item in t.iter().map_err(fail(p, "keys"))? {
            let (k, v) = item.map_err(fail(p, "keys"))?;
            match decode_key_format1(k.value(), v.value()) {
                Ok(rec) => img.keys.push(rec),
                Err(e) => bad("keys", k.value().to_string(), e.0),
            }
        }
        let t = txn.open_table(SECRETS).map_err(fail(p, "secrets"))?;
        for item in t.iter().map_err(fail(p, "secrets"))? {
            let (k, v) = item.map_err(fail(p, "secrets"))?;
            match decode_json::<SecretRecord>("secret", v.value()) {
                Ok(s) => secrets.push((k.value().to_string(), s.sealed())),
                Err(e) => bad("secrets", "(a secret's hash)".into(), e.0),
            }
        }
        let t = txn.open_table(USED).map_err(fail(p, "used"))?;
        for item in t.iter().map_err(fail(p, "used"))? {
            used_ids.push(item.map_err(fail(p, "used"))?.0.value());
        }
    }
    let mut done = maru::meta::seal_format1(&mut img);
    done.dropped += undecoded;
    let kept: std::collections::BTreeSet<u64> = img.keys.iter().map(|k| k.id).collect();
    {
        for name in ["keys", "regions", "sessions"] {
            let def: TableDefinition<u64, &[u8]> = TableDefinition::new(name);
            txn.delete_table(def).map_err(fail(p, "upgrade"))?;
        }
        txn.delete_table(SCOPES).map_err(fail(p, "upgrade"))?;
        txn.delete_table(SECRETS).map_err(fail(p, "upgrade"))?;
        let scopes = img.scopes.iter().map(|s| (s.id, encode_json(s)));
        insert_all(&txn, SCOPES, p, scopes)?;
        let sessions = img.sessions.iter().map(|s| (s.id, encode_json(s)));
        insert_all(&txn, SESSIONS, p, sessions)?;
        let regions = img.regions.iter();
        insert_all(
            &txn,
            REGIONS,
            p,
            regions.map(|g| (g.handle.region_id, encode_json(g))),
        )?;
        insert_all(
            &txn,
            KEYS,
            p,
            img.keys.iter().map(|k| (k.id, encode_key(k))),
        )?;
        let secrets = secrets.iter().map(|(h, s)| (h.as_str(), encode_json(s)));
        insert_all(&txn, SECRETS, p, secrets)?;
        let mut t = txn.open_table(USED).map_err(fail(p, "upgrade"))?;
        for id in used_ids.iter().filter(|id| !kept.contains(id)) {
            t.remove(*id).map_err(fail(p, "upgrade"))?;
        }
        let mut meta = txn.open_table(META).map_err(fail(p, "upgrade"))?;
        put_scalar(&mut meta, "format", &FORMAT.to_string()).map_err(fail(p, "upgrade"))?;
    }
    txn.commit().map_err(fail(p, "commit"))?;
    log::warn!(
        "{}: upgraded from record format 1 to format {FORMAT}: {} records sealed ({} keys, {} \
         regions, {} sessions, {} scopes, {} secrets), {} dropped (see above; their keys are \
         misses)",
        p.display(),
        done.kept + secrets.len() as u64,
        img.keys.len(),
        img.regions.len(),
        img.sessions.len(),
        img.scopes.len(),
        secrets.len(),
        done.dropped
    );
    Ok(Some(done))
}

/// Reads every table. A record that does not decode, or a secret whose check
/// fails, is dropped and logged (the core checks the other records' checks at
/// restore). Returns the image, the secrets and how many records were dropped.
fn read_all(db: &Database, p: &Path) -> Result<ReadBack, Fail> {
    let txn = db.begin_read().map_err(fail(p, "begin"))?;
    let mut img = Image::default();
    let mut dropped = 0u64;
    let mut session_ids_end = 0u64;
    let mut bad = |table: &str, id: String, e: String| {
        dropped += 1;
        log::warn!(
            "{}: record {id} of table {table} does not decode ({e}): dropped, never served",
            p.display()
        );
    };
    let t = txn.open_table(SCOPES).map_err(fail(p, "scopes"))?;
    read_records(&t, p, AS_SCOPES, &mut img.scopes, &mut bad, any_scope)?;
    let t = txn.open_table(SESSIONS).map_err(fail(p, "sessions"))?;
    for item in t.iter().map_err(fail(p, "sessions"))? {
        let (k, v) = item.map_err(fail(p, "sessions"))?;
        session_ids_end = session_ids_end.max(k.value().saturating_add(1));
        match decode_json::<SessionRecord>("session", v.value()) {
            Ok(s) => img.sessions.push(s),
            Err(e) => bad("sessions", k.value().to_string(), e.0),
        }
    }
    let t = txn.open_table(REGIONS).map_err(fail(p, "regions"))?;
    read_records(&t, p, AS_REGIONS, &mut img.regions, &mut bad, own_region)?;
    let used = txn.open_table(USED).map_err(fail(p, "used"))?;
    let t = txn.open_table(KEYS).map_err(fail(p, "keys"))?;
    img.keys
        .reserve(usize::try_from(t.len().map_err(fail(p, "keys"))?).unwrap_or(0));
    // Both tables are in key id order: one walk of each side by side (a merge), not
    // a lookup in `used` per key.
    let mut uses = used
        .iter()
        .map_err(fail(p, "used"))?
        .map(|u| u.map(|(id, at)| (id.value(), at.value())))
        .peekable();
    for item in t.iter().map_err(fail(p, "keys"))? {
        let (k, v) = item.map_err(fail(p, "keys"))?;
        let id = k.value();
        img.key_ids_end = id.saturating_add(1);
        let mut last_use = None;
        loop {
            match uses.peek() {
                Some(Ok((uid, at))) if *uid <= id => {
                    if *uid == id {
                        last_use = Some(*at);
                    }
                    uses.next();
                }
                Some(Err(_)) => {
                    if let Some(Err(e)) = uses.next() {
                        return Err(fail(p, "used")(e));
                    }
                }
                _ => break,
            }
        }
        match decode_key(id, v.value()) {
            Ok(mut rec) => {
                if let Some(u) = last_use {
                    rec.used = rec.used.max(u);
                }
                img.keys.push(rec);
            }
            Err(e) => bad("keys", id.to_string(), e.0),
        }
    }
    // Ids past the last key's with a use stamp stay taken too (`Image::key_ids_end`).
    let last_use = uses.last().transpose().map_err(fail(p, "used"))?;
    img.key_ids_end = last_use.map_or(img.key_ids_end, |(id, _)| id.saturating_add(1));
    let meta = txn.open_table(META).map_err(fail(p, "meta"))?;
    // Every recorded session's id stays taken, also one whose record does not
    // decode (its worker may still be there): the counter may have been changed on
    // disk (its copies then fail their checks) or rolled back.
    img.next_session = get_scalar(&meta, "next_session")
        .map_err(fail(p, "meta"))?
        .number()
        .unwrap_or(0)
        .max(session_ids_end);
    let t = txn.open_table(SECRETS).map_err(fail(p, "secrets"))?;
    let mut secrets = Vec::new();
    for item in t.iter().map_err(fail(p, "secrets"))? {
        let (k, v) = item.map_err(fail(p, "secrets"))?;
        match decode_json::<SecretRecord>("secret", v.value()) {
            Ok(s) if s.verify() => secrets.push((k.value().to_string(), s)),
            Ok(_) => bad(
                "secrets",
                "(a secret's hash)".into(),
                "its check fails: changed on disk".into(),
            ),
            Err(e) => bad("secrets", "(a secret's hash)".into(), e.0),
        }
    }
    Ok((img, secrets, dropped))
}

/// What [`read_all`] reads: the image, the secrets, the records dropped.
type ReadBack = (Image, Vec<(String, SecretRecord)>, u64);

mod state_dir;
mod writer;

use state_dir::{err, open_private_file, open_state_dir, set_aside};
pub use state_dir::{DIRECTORY_FILE, LOCK_FILE};
pub use writer::StoreWriter;

/// What the loop hands the writer.
struct Job {
    seq: u64,
    changes: Option<Changes>,
    secrets: Vec<SecretOp>,
}

#[cfg(test)]
mod tests;
