//! maru-server's durable directory (`--state-dir`): the metadata core's record
//! batches ([`maru::meta::records`]) kept in an embedded B-tree store (redb: crash-safe
//! commits with checksums, space reused as keys come and go), one table per kind of
//! record, plus the session secrets and the server's instance and run number.
//!
//! Batches are written by a thread of their own ([`StoreWriter`]): the event loop
//! hands over each batch and goes on; the writer takes every batch waiting, commits
//! them together (one fsync for all: a group commit), then says how far it got and
//! wakes the loop, which sends the replies that waited for those batches. So publish
//! throughput does not depend on one fsync per request.

use maru::meta::records::{
    decode_json, decode_key, encode_json, encode_key, Changes, Image, Record, RegionRecord,
    ScopeRecord, Sealed, SessionRecord, FORMAT,
};
use redb::{Database, ReadableTable, TableDefinition};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
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

/// The store's file in the state directory.
pub const DIRECTORY_FILE: &str = "directory.redb";
/// Held (flock) while a maru-server uses the state directory.
pub const LOCK_FILE: &str = "lock";
/// The store's page cache: a recovery reads every key once.
const CACHE_BYTES: usize = 64 << 20;

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
}

/// An open state directory.
pub struct MetaStore {
    db: Database,
    path: PathBuf,
    /// The lock file, held (flock) while the store is open.
    _lock: std::fs::File,
}

fn err(path: &Path, what: &str, e: impl std::fmt::Display) -> String {
    format!("{} ({what}): {e}", path.display())
}

/// Opens the state directory `dir`, made 0700 if missing, without following a
/// symbolic link, and checks it: a directory of this user (or root) that neither
/// group nor others may access. Its files are opened relative to it.
fn open_state_dir(dir: &Path) -> Result<OwnedFd, String> {
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::fs::DirBuilderExt;
    let what = |e: String| format!("state directory {}: {e}", dir.display());
    match std::fs::symlink_metadata(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(|e| what(e.to_string()))?;
        }
        Err(e) => return Err(what(e.to_string())),
        Ok(_) => {}
    }
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes())
        .map_err(|_| what("a NUL byte in the path".into()))?;
    // SAFETY: a NUL-terminated path; the descriptor returned is owned below.
    let fd = unsafe {
        libc::open(
            c.as_ptr(),
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        let e = std::io::Error::last_os_error();
        return Err(what(if e.raw_os_error() == Some(libc::ELOOP) {
            "is a symbolic link: give --state-dir the real directory".into()
        } else {
            format!("{e} (it must be a directory, not a symbolic link)")
        }));
    }
    // SAFETY: fd is a descriptor just opened and owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let m = fstat(&fd).map_err(|e| what(e.to_string()))?;
    if let Some(me) = maru::auth::keyfile::foreign_owner(m.st_uid) {
        return Err(what(format!(
            "owned by uid {}, not by this user (uid {me}) or root: use a directory of your own",
            m.st_uid
        )));
    }
    if m.st_mode & 0o077 != 0 {
        return Err(what(format!(
            "mode {:o}: group or others may access it; run `chmod 700 {}`",
            m.st_mode & 0o7777,
            dir.display()
        )));
    }
    Ok(fd)
}

fn fstat(fd: &OwnedFd) -> std::io::Result<libc::stat> {
    // SAFETY: an all-zero stat is a valid value to be overwritten by fstat.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fd is open; st is a valid out pointer.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(st)
}

/// Opens (or makes, 0600) the file `name` of the state directory `dir` without
/// following a symbolic link: a regular file of this user (or root) that neither
/// group nor others may access.
fn open_private_file(dir: &OwnedFd, name: &str, path: &Path) -> Result<std::fs::File, String> {
    let c = std::ffi::CString::new(name).map_err(|_| err(path, "open", "a NUL byte"))?;
    // SAFETY: dir is an open directory descriptor and c a NUL-terminated name.
    let fd = unsafe {
        libc::openat(
            dir.as_raw_fd(),
            c.as_ptr(),
            libc::O_RDWR | libc::O_CREAT | libc::O_NOFOLLOW | libc::O_CLOEXEC,
            0o600 as libc::c_uint,
        )
    };
    if fd < 0 {
        let e = std::io::Error::last_os_error();
        return Err(if e.raw_os_error() == Some(libc::ELOOP) {
            err(
                path,
                "open",
                "a symbolic link, which maru-server does not follow in its state directory: \
                 remove it",
            )
        } else {
            err(path, "open", e)
        });
    }
    // SAFETY: fd is a descriptor just opened and owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let m = fstat(&fd).map_err(|e| err(path, "stat", e))?;
    if m.st_mode & libc::S_IFMT != libc::S_IFREG {
        return Err(err(path, "open", "not a regular file: remove it"));
    }
    if let Some(me) = maru::auth::keyfile::foreign_owner(m.st_uid) {
        return Err(err(
            path,
            "open",
            format!(
                "owned by uid {}, not by this user (uid {me}) or root; run `chown {me} {}`",
                m.st_uid,
                path.display()
            ),
        ));
    }
    if m.st_mode & 0o077 != 0 {
        return Err(err(
            path,
            "open",
            format!(
                "mode {:o}: group or others may access it; run `chmod 600 {}`",
                m.st_mode & 0o7777,
                path.display()
            ),
        ));
    }
    Ok(std::fs::File::from(fd))
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
        if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            return Err(format!(
                "state directory {} is in use by another maru-server: give each server its \
                 own --state-dir (or --in-memory for a throwaway one)",
                dir.display()
            ));
        }
        let path = dir.join(DIRECTORY_FILE);
        let file = open_private_file(&dir_fd, DIRECTORY_FILE, &path)?;
        let db = std::panic::catch_unwind(|| {
            Database::builder()
                .set_cache_size(CACHE_BYTES)
                .create_file(file)
        })
        .map_err(|_| {
            err(
                &path,
                "open",
                "the store panicked reading the file (corrupted?)",
            )
        })?
        .map_err(|e| {
            err(
                &path,
                "open",
                format!("{e}; move the file away to start with an empty directory"),
            )
        })?;
        let store = MetaStore {
            db,
            path: path.clone(),
            _lock: lock,
        };
        let (instance, run, last_lease_ms) = store.start_run(new_instance, lease_timeout_ms)?;
        let (mut image, secrets, dropped) = store.read_all()?;
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
            },
        ))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Makes every table, checks the format, counts this start and records its lease
    /// timeout (the longer of it and the last run's). Returns the instance, the run
    /// and the last run's lease timeout (0: none recorded).
    fn start_run(
        &self,
        new_instance: impl FnOnce() -> String,
        lease_timeout_ms: u64,
    ) -> Result<(String, u64, u64), String> {
        let p = &self.path;
        let txn = self.db.begin_write().map_err(|e| err(p, "begin", e))?;
        let (instance, run, last_lease_ms) = {
            let mut meta = txn.open_table(META).map_err(|e| err(p, "meta", e))?;
            let get = |t: &redb::Table<&str, &[u8]>, k: &str| -> Result<Option<Vec<u8>>, String> {
                Ok(t.get(k)
                    .map_err(|e| err(p, "meta", e))?
                    .map(|v| v.value().to_vec()))
            };
            if let Some(f) = get(&meta, "format")? {
                let f = String::from_utf8_lossy(&f).to_string();
                if f != FORMAT.to_string() {
                    return Err(err(
                        p,
                        "meta",
                        format!(
                            "written in record format {f}, this maru-server reads format \
                             {FORMAT}: start the maru-server that wrote it, or move the file \
                             away to start with an empty directory"
                        ),
                    ));
                }
            }
            let instance = match get(&meta, "instance")? {
                Some(i) => String::from_utf8_lossy(&i).to_string(),
                None => new_instance(),
            };
            let number = |k: &str| -> Result<u64, String> {
                Ok(get(&meta, k)?
                    .and_then(|r| String::from_utf8_lossy(&r).parse::<u64>().ok())
                    .unwrap_or(0))
            };
            let run = number("run")? + 1;
            let last_lease_ms = number(LEASE_TIMEOUT)?;
            for (k, v) in [
                ("format", FORMAT.to_string()),
                ("instance", instance.clone()),
                ("run", run.to_string()),
                (
                    LEASE_TIMEOUT,
                    last_lease_ms.max(lease_timeout_ms).to_string(),
                ),
            ] {
                meta.insert(k, v.as_bytes())
                    .map_err(|e| err(p, "meta", e))?;
            }
            (instance, run, last_lease_ms)
        };
        for name in ["keys", "regions", "sessions"] {
            let def: TableDefinition<u64, &[u8]> = TableDefinition::new(name);
            txn.open_table(def).map_err(|e| err(p, name, e))?;
        }
        txn.open_table(USED).map_err(|e| err(p, "used", e))?;
        txn.open_table(SCOPES).map_err(|e| err(p, "scopes", e))?;
        txn.open_table(SECRETS).map_err(|e| err(p, "secrets", e))?;
        txn.commit().map_err(|e| err(p, "commit", e))?;
        Ok((instance, run, last_lease_ms))
    }

    /// Records the lease timeout the next start waits out for this run's leases.
    fn record_lease_timeout(&self, ms: u64) -> Result<(), String> {
        let p = &self.path;
        let txn = self.db.begin_write().map_err(|e| err(p, "begin", e))?;
        {
            let mut meta = txn.open_table(META).map_err(|e| err(p, "meta", e))?;
            meta.insert(LEASE_TIMEOUT, ms.to_string().as_bytes())
                .map_err(|e| err(p, "meta", e))?;
        }
        txn.commit().map_err(|e| err(p, "commit", e))
    }

    /// Reads every table. A record that does not decode, or a secret whose check
    /// fails, is dropped and logged (the core checks the other records' checks at
    /// restore). Returns the image, the secrets and how many records were dropped.
    fn read_all(&self) -> Result<ReadBack, String> {
        let p = &self.path;
        let txn = self.db.begin_read().map_err(|e| err(p, "begin", e))?;
        let mut img = Image::default();
        let mut dropped = 0u64;
        let mut bad = |table: &str, id: String, e: String| {
            dropped += 1;
            log::warn!(
                "{}: record {id} of table {table} does not decode ({e}): dropped, never served",
                p.display()
            );
        };
        let t = txn.open_table(SCOPES).map_err(|e| err(p, "scopes", e))?;
        for item in t.iter().map_err(|e| err(p, "scopes", e))? {
            let (k, v) = item.map_err(|e| err(p, "scopes", e))?;
            match decode_json::<ScopeRecord>("scope", v.value()) {
                Ok(s) => img.scopes.push(s),
                Err(e) => bad("scopes", k.value().to_string(), e.0),
            }
        }
        let t = txn
            .open_table(SESSIONS)
            .map_err(|e| err(p, "sessions", e))?;
        for item in t.iter().map_err(|e| err(p, "sessions", e))? {
            let (k, v) = item.map_err(|e| err(p, "sessions", e))?;
            match decode_json::<SessionRecord>("session", v.value()) {
                Ok(s) => img.sessions.push(s),
                Err(e) => bad("sessions", k.value().to_string(), e.0),
            }
        }
        let t = txn.open_table(REGIONS).map_err(|e| err(p, "regions", e))?;
        for item in t.iter().map_err(|e| err(p, "regions", e))? {
            let (k, v) = item.map_err(|e| err(p, "regions", e))?;
            match decode_json::<RegionRecord>("region", v.value()) {
                // The table's key is the region id: a record naming another is not
                // the one written there.
                Ok(r) if r.handle.region_id == k.value() => img.regions.push(r),
                Ok(r) => bad(
                    "regions",
                    k.value().to_string(),
                    format!("it names region {}", r.handle.region_id),
                ),
                Err(e) => bad("regions", k.value().to_string(), e.0),
            }
        }
        let used = txn.open_table(USED).map_err(|e| err(p, "used", e))?;
        let t = txn.open_table(KEYS).map_err(|e| err(p, "keys", e))?;
        for item in t.iter().map_err(|e| err(p, "keys", e))? {
            let (k, v) = item.map_err(|e| err(p, "keys", e))?;
            let id = k.value();
            match decode_key(id, v.value()) {
                Ok(mut rec) => {
                    if let Some(u) = used.get(id).map_err(|e| err(p, "used", e))? {
                        rec.used = rec.used.max(u.value());
                    }
                    img.keys.push(rec);
                }
                Err(e) => bad("keys", id.to_string(), e.0),
            }
        }
        let meta = txn.open_table(META).map_err(|e| err(p, "meta", e))?;
        img.next_session = meta
            .get("next_session")
            .map_err(|e| err(p, "meta", e))?
            .and_then(|v| String::from_utf8_lossy(v.value()).parse().ok())
            .unwrap_or(0);
        let t = txn.open_table(SECRETS).map_err(|e| err(p, "secrets", e))?;
        let mut secrets = Vec::new();
        for item in t.iter().map_err(|e| err(p, "secrets", e))? {
            let (k, v) = item.map_err(|e| err(p, "secrets", e))?;
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
                        Record::SessionGone(id) => {
                            sessions.remove(*id).map_err(w)?;
                        }
                        Record::NextSession(n) => {
                            meta.insert("next_session", n.to_string().as_bytes())
                                .map_err(w)?;
                        }
                        Record::Region(g) => {
                            regions
                                .insert(g.handle.region_id, encode_json(g).as_slice())
                                .map_err(w)?;
                        }
                        Record::RegionGone(id) => {
                            regions.remove(*id).map_err(w)?;
                        }
                        Record::Key(k) => {
                            keys.insert(k.id, encode_key(k).as_slice()).map_err(w)?;
                            used.remove(k.id).map_err(w)?;
                        }
                        Record::KeyGone(id) => {
                            keys.remove(*id).map_err(w)?;
                            used.remove(*id).map_err(w)?;
                        }
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

/// What [`MetaStore::read_all`] reads: the image, the secrets, the records dropped.
type ReadBack = (Image, Vec<(String, SecretRecord)>, u64);

/// What the loop hands the writer.
struct Job {
    seq: u64,
    changes: Option<Changes>,
    secrets: Vec<SecretOp>,
}

enum Msg {
    Job(Job),
    /// Answer once every job sent before is durable (shutdown).
    Sync(mpsc::Sender<()>),
}

/// The writer thread and what it has made durable.
pub struct StoreWriter {
    tx: Option<mpsc::Sender<Msg>>,
    thread: Option<std::thread::JoinHandle<()>>,
    next_seq: u64,
    /// The last job made durable, and the last core batch among them.
    durable_seq: Arc<AtomicU64>,
    durable_batch: Arc<AtomicU64>,
    /// A commit failed (it is retried; replies wait meanwhile).
    failing: Arc<AtomicBool>,
    /// Commits and jobs committed (group commit: jobs per commit).
    pub commits: Arc<AtomicU64>,
    pub jobs: Arc<AtomicU64>,
    /// The loop waits for the next commit: wake it after it.
    wanted: Arc<AtomicBool>,
}

/// How soon a failed commit is tried again.
const RETRY: Duration = Duration::from_secs(1);

impl StoreWriter {
    /// Starts the writer; it wakes the loop by calling `wake` after a commit the loop
    /// waits for ([`wake_when_durable`](Self::wake_when_durable)).
    /// `settle`: after that long, record that lease timeout for the next start
    /// ([`Loaded::lease_timeout_settles`]).
    pub fn start(
        store: MetaStore,
        wake: impl Fn() + Send + 'static,
        settle: Option<(Duration, u64)>,
    ) -> StoreWriter {
        let (tx, rx) = mpsc::channel::<Msg>();
        let durable_seq = Arc::new(AtomicU64::new(0));
        let durable_batch = Arc::new(AtomicU64::new(0));
        let failing = Arc::new(AtomicBool::new(false));
        let commits = Arc::new(AtomicU64::new(0));
        let jobs_n = Arc::new(AtomicU64::new(0));
        let wanted = Arc::new(AtomicBool::new(false));
        let (ds, db, fl, cm, jn, wn) = (
            durable_seq.clone(),
            durable_batch.clone(),
            failing.clone(),
            commits.clone(),
            jobs_n.clone(),
            wanted.clone(),
        );
        let thread = std::thread::Builder::new()
            .name("meta-store".into())
            .spawn(move || {
                let mut syncs: Vec<mpsc::Sender<()>> = Vec::new();
                let mut settle = settle.map(|(after, ms)| (Instant::now() + after, ms));
                loop {
                    let first = match settle {
                        Some((at, ms)) => {
                            match rx.recv_timeout(at.saturating_duration_since(Instant::now())) {
                                Ok(m) => m,
                                Err(mpsc::RecvTimeoutError::Timeout) => {
                                    match store.record_lease_timeout(ms) {
                                        Ok(()) => settle = None,
                                        Err(e) => {
                                            log::warn!(
                                                "cannot record the lease timeout: {e}; retrying"
                                            );
                                            settle = Some((Instant::now() + RETRY, ms));
                                        }
                                    }
                                    continue;
                                }
                                Err(mpsc::RecvTimeoutError::Disconnected) => break,
                            }
                        }
                        None => match rx.recv() {
                            Ok(m) => m,
                            Err(_) => break,
                        },
                    };
                    // Everything waiting goes into one commit: jobs that came while the
                    // last commit ran share this one (the loop itself gathers early
                    // answered changes for up to its lazy window before it sends them).
                    let mut jobs = Vec::new();
                    for m in std::iter::once(first).chain(rx.try_iter()) {
                        match m {
                            Msg::Job(j) => jobs.push(j),
                            Msg::Sync(s) => syncs.push(s),
                        }
                    }
                    if !jobs.is_empty() {
                        let mut tries = 0u32;
                        while let Err(e) = store.commit(&jobs) {
                            tries += 1;
                            fl.store(true, Ordering::SeqCst);
                            if tries == 1 || tries % 60 == 0 {
                                log::error!(
                                    "cannot make the directory durable: {e}; retrying every {} s \
                                     (replies that change it wait)",
                                    RETRY.as_secs()
                                );
                            }
                            std::thread::sleep(RETRY);
                        }
                        fl.store(false, Ordering::SeqCst);
                        cm.fetch_add(1, Ordering::Relaxed);
                        jn.fetch_add(jobs.len() as u64, Ordering::Relaxed);
                        if let Some(b) = jobs
                            .iter()
                            .filter_map(|j| j.changes.as_ref())
                            .map(|c| c.batch)
                            .max()
                        {
                            db.fetch_max(b, Ordering::SeqCst);
                        }
                        if let Some(j) = jobs.last() {
                            ds.fetch_max(j.seq, Ordering::SeqCst);
                        }
                        // Only when the loop waits for a commit: a commit of early
                        // answered changes alone does not wake it (it sees how far the
                        // store got before its next request).
                        if wn.swap(false, Ordering::SeqCst) {
                            wake();
                        }
                    }
                    for s in syncs.drain(..) {
                        let _ = s.send(());
                    }
                }
                // The sender is gone: close the store cleanly (no repair at next start).
                drop(store);
            });
        let thread = match thread {
            Ok(t) => Some(t),
            Err(e) => {
                log::error!("cannot start the store thread: {e}");
                None
            }
        };
        StoreWriter {
            tx: Some(tx),
            thread,
            next_seq: 0,
            durable_seq,
            durable_batch,
            failing,
            commits,
            jobs: jobs_n,
            wanted,
        }
    }

    /// Wake the loop after the next commit (a reply or a freed page waits for it).
    /// Set it before looking at [`durable_seq`](Self::durable_seq): a commit that
    /// ends in between wakes the loop, one that ended before is seen there.
    pub fn wake_when_durable(&self) {
        self.wanted.store(true, Ordering::SeqCst);
    }

    /// Hands over a batch (and secret changes); returns its job number, durable once
    /// [`durable_seq`](Self::durable_seq) reaches it. The writer commits it at once
    /// with every job waiting (one commit for all of them).
    pub fn send(&mut self, changes: Option<Changes>, secrets: Vec<SecretOp>) -> u64 {
        self.next_seq += 1;
        let seq = self.next_seq;
        let job = Job {
            seq,
            changes,
            secrets,
        };
        if let Some(tx) = &self.tx {
            if tx.send(Msg::Job(job)).is_err() {
                log::error!("the store thread is gone: changes are no longer made durable");
            }
        }
        seq
    }

    pub fn durable_seq(&self) -> u64 {
        self.durable_seq.load(Ordering::SeqCst)
    }

    pub fn durable_batch(&self) -> u64 {
        self.durable_batch.load(Ordering::SeqCst)
    }

    pub fn sent_seq(&self) -> u64 {
        self.next_seq
    }

    pub fn is_failing(&self) -> bool {
        self.failing.load(Ordering::SeqCst)
    }

    /// Waits until every job sent so far is durable, at most `wait`.
    pub fn sync(&self, wait: Duration) -> bool {
        let Some(tx) = &self.tx else {
            return false;
        };
        let (stx, srx) = mpsc::channel();
        if tx.send(Msg::Sync(stx)).is_err() {
            return false;
        }
        srx.recv_timeout(wait).is_ok()
    }

    /// Stops the writer after what was sent, and closes the store.
    pub fn close(&mut self) {
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for StoreWriter {
    fn drop(&mut self) {
        self.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use maru::meta::records::KeyRecord;

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
    fn a_second_server_on_the_same_directory_is_refused() {
        let d = dir();
        let (_a, _) = MetaStore::open(&d, || "i".into(), 60_000).unwrap();
        let e = MetaStore::open(&d, || "i".into(), 60_000).err().unwrap();
        assert!(e.contains("in use by another maru-server"), "{e}");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_corrupted_file_is_a_start_error_naming_it_never_a_panic() {
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
        // Garbage over every part of the file in turn: each open answers (an error
        // that names the file, or a directory as of the last whole commit).
        let mut errors = 0;
        for at in (0..clean.len()).step_by(clean.len() / 16 + 1) {
            let mut b = clean.clone();
            let end = (at + 512).min(b.len());
            for x in &mut b[at..end] {
                *x ^= 0x5a;
            }
            std::fs::write(&f, &b).unwrap();
            match MetaStore::open(&d, || "i".into(), 60_000) {
                Ok((_s, l)) => assert!(l.image.keys.len() <= 199),
                Err(e) => {
                    assert!(e.contains(&f.display().to_string()), "{e}");
                    errors += 1;
                }
            }
        }
        assert!(errors > 0, "some corruption is seen");
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
}
