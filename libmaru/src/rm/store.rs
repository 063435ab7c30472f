//! Where the state goes: a trait, the state directory, and an in-memory store whose
//! failures tests choose.
//!
//! A save is durable only once its directory entry is: `state.json` is written as
//! `state.json.tmp`, fsynced, renamed over `state.json`, and then the directory is
//! fsynced. A crash before the rename leaves the old state; after a rename whose
//! directory sync failed, a crash may bring back the old state, which is why the
//! resource manager answers such a save with a storage error and saves again on a
//! retry.

use super::state::{RmState, STATE_VERSION};
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

/// Name of the state file in the state directory.
pub const STATE_FILE: &str = "state.json";
/// Name of the file a save writes before renaming it over [`STATE_FILE`].
pub const STATE_TMP_FILE: &str = "state.json.tmp";

/// Persists the resource manager's state. `save` returns only once the state is
/// durable; an error means it may not be.
pub trait StateStore: Send {
    fn save(&mut self, state: &RmState) -> Result<(), PersistError>;
    /// The last saved state, or `None` if none was ever saved.
    fn load(&mut self) -> Result<Option<RmState>, PersistError>;
}

/// The step of a save or load that failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Creating or writing the temporary file.
    Write,
    /// Fsync of the temporary file.
    Fsync,
    /// Renaming the temporary file over the state file.
    Rename,
    /// Fsync of the state directory after the rename.
    DirSync,
    /// Reading the state file.
    Read,
    /// The state file is not a state this build understands.
    Parse,
}

impl Step {
    /// What to do about a failure at this step (after the error).
    fn hint(self) -> &'static str {
        match self {
            Step::Parse => "; fix or move the file away (the regions it lists are lost then)",
            Step::Read => "",
            _ => "; check the disk and the permissions of the state directory",
        }
    }

    fn describe(self) -> &'static str {
        match self {
            Step::Write => "cannot write",
            Step::Fsync => "cannot fsync",
            Step::Rename => "cannot rename into place",
            Step::DirSync => "cannot fsync the directory of",
            Step::Read => "cannot read",
            Step::Parse => "cannot parse",
        }
    }
}

/// A failed save or load: which step, on which path, why.
#[derive(Debug, thiserror::Error)]
#[error("{} {}: {err}{}", .step.describe(), .path.display(), .step.hint())]
pub struct PersistError {
    pub step: Step,
    pub path: PathBuf,
    #[source]
    pub err: std::io::Error,
}

impl PersistError {
    fn new(step: Step, path: &Path, err: std::io::Error) -> PersistError {
        PersistError {
            step,
            path: path.to_path_buf(),
            err,
        }
    }
}

/// Parses a state file's text, refusing another format version.
/// Public for the fuzz targets; the daemons go through [`DirStore`].
#[doc(hidden)]
pub fn parse_state(path: &Path, text: &[u8]) -> Result<RmState, PersistError> {
    let bad = |msg: String| {
        PersistError::new(
            Step::Parse,
            path,
            std::io::Error::new(std::io::ErrorKind::InvalidData, msg),
        )
    };
    let state: RmState = serde_json::from_slice(text).map_err(|e| bad(e.to_string()))?;
    if state.version != STATE_VERSION {
        return Err(bad(format!(
            "state version {} (this build reads version {STATE_VERSION})",
            state.version
        )));
    }
    Ok(state)
}

/// The state directory: `state.json` (and `secret`, see
/// [`load_or_create_secret`](super::load_or_create_secret)).
#[derive(Debug, Clone)]
pub struct DirStore {
    dir: PathBuf,
}

impl DirStore {
    /// Uses `dir`, creating it (mode 0700) if it does not exist. Refuses a directory
    /// that group or others can write, or that another user owns: whoever can write
    /// it can swap the state (and plant links the RM would follow).
    pub fn open(dir: impl Into<PathBuf>) -> Result<DirStore, PersistError> {
        let dir = dir.into();
        private_dir(&dir).map_err(|e| PersistError::new(Step::Write, &dir, e))?;
        Ok(DirStore { dir })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn state_path(&self) -> PathBuf {
        self.dir.join(STATE_FILE)
    }
}

/// Creates `dir` (and missing parents) with mode 0700, then checks it: a directory,
/// owned by this user (or root), not writable by group or others.
pub fn private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::MetadataExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)?;
    let m = std::fs::metadata(dir)?;
    if !m.is_dir() {
        return Err(std::io::Error::other("not a directory"));
    }
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    if m.uid() != me && m.uid() != 0 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            format!(
                "owned by uid {}, not by this user (uid {me}); use a directory of your own",
                m.uid()
            ),
        ));
    }
    if m.mode() & 0o022 != 0 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            format!(
                "mode {:o}: group or others can write it; run `chmod 700 {}`",
                m.mode() & 0o7777,
                dir.display()
            ),
        ));
    }
    Ok(())
}

/// Fsyncs a directory, so that a rename or a new file in it survives a crash.
pub(crate) fn sync_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

impl StateStore for DirStore {
    fn save(&mut self, state: &RmState) -> Result<(), PersistError> {
        let tmp = self.dir.join(STATE_TMP_FILE);
        let path = self.state_path();
        let text = serde_json::to_vec_pretty(state).map_err(|e| {
            PersistError::new(Step::Write, &tmp, std::io::Error::other(e.to_string()))
        })?;
        // A leftover temp file (or a link someone planted in its place) is removed,
        // never followed: the new one is created exclusively, without following links.
        match std::fs::remove_file(&tmp) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(PersistError::new(Step::Write, &tmp, e)),
        }
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&tmp)
            .map_err(|e| PersistError::new(Step::Write, &tmp, e))?;
        f.write_all(&text)
            .map_err(|e| PersistError::new(Step::Write, &tmp, e))?;
        f.sync_all()
            .map_err(|e| PersistError::new(Step::Fsync, &tmp, e))?;
        drop(f);
        std::fs::rename(&tmp, &path).map_err(|e| PersistError::new(Step::Rename, &path, e))?;
        sync_dir(&self.dir).map_err(|e| PersistError::new(Step::DirSync, &self.dir, e))
    }

    fn load(&mut self) -> Result<Option<RmState>, PersistError> {
        // A leftover state.json.tmp is a save that did not reach its rename: ignored.
        let path = self.state_path();
        match std::fs::read(&path) {
            Ok(text) => parse_state(&path, &text).map(Some),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(PersistError::new(Step::Read, &path, e)),
        }
    }
}

/// A store in memory, for tests: clones share one state, so a test keeps a clone to
/// look at what was saved and to make steps fail.
#[derive(Debug, Clone, Default)]
pub struct MemStore {
    inner: Arc<Mutex<MemInner>>,
}

#[derive(Debug, Default)]
struct MemInner {
    /// What the last complete save wrote.
    durable: Option<RmState>,
    saves: usize,
    attempts: usize,
    fail_next: Option<Step>,
    fail_always: Option<Step>,
}

impl MemStore {
    pub fn new() -> MemStore {
        MemStore::default()
    }

    /// A store that already holds `state`, as if saved by an earlier run.
    pub fn with_state(state: RmState) -> MemStore {
        let s = MemStore::new();
        s.lock().durable = Some(state);
        s
    }

    fn lock(&self) -> MutexGuard<'_, MemInner> {
        // A test that panicked while holding the lock leaves usable data.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The next save (or load, for `Read`/`Parse`) fails at `step`, once.
    pub fn fail_next(&self, step: Step) {
        self.lock().fail_next = Some(step);
    }

    /// Every save (or load) fails at `step` until set to `None`.
    pub fn fail_always(&self, step: Option<Step>) {
        self.lock().fail_always = step;
    }

    /// The state of the last successful save.
    pub fn saved(&self) -> Option<RmState> {
        self.lock().durable.clone()
    }

    /// Successful saves so far.
    pub fn saves(&self) -> usize {
        self.lock().saves
    }

    /// Saves tried so far, failed or not.
    pub fn attempts(&self) -> usize {
        self.lock().attempts
    }

    fn injected(inner: &mut MemInner, steps: &[Step]) -> Option<Step> {
        if let Some(s) = inner.fail_next.filter(|s| steps.contains(s)) {
            inner.fail_next = None;
            return Some(s);
        }
        inner.fail_always.filter(|s| steps.contains(s))
    }

    fn error(step: Step) -> PersistError {
        PersistError::new(
            step,
            Path::new("<memory>"),
            std::io::Error::other("injected failure"),
        )
    }
}

impl StateStore for MemStore {
    fn save(&mut self, state: &RmState) -> Result<(), PersistError> {
        let mut inner = self.lock();
        inner.attempts += 1;
        let save_steps = [Step::Write, Step::Fsync, Step::Rename, Step::DirSync];
        if let Some(step) = Self::injected(&mut inner, &save_steps) {
            return Err(Self::error(step));
        }
        inner.durable = Some(state.clone());
        inner.saves += 1;
        Ok(())
    }

    fn load(&mut self) -> Result<Option<RmState>, PersistError> {
        let mut inner = self.lock();
        if let Some(step) = Self::injected(&mut inner, &[Step::Read, Step::Parse]) {
            return Err(Self::error(step));
        }
        Ok(inner.durable.clone())
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::rm::state::{HoldRecord, RegionRecord};

    /// A fresh directory under the system temp dir, removed when dropped.
    pub(crate) struct TempDir(pub PathBuf);

    impl TempDir {
        pub(crate) fn new(name: &str) -> TempDir {
            use std::sync::atomic::{AtomicUsize, Ordering};
            static N: AtomicUsize = AtomicUsize::new(0);
            let p = std::env::temp_dir().join(format!(
                "maru-rm-{}-{}-{name}",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            ));
            let _ = std::fs::remove_dir_all(&p);
            std::fs::create_dir_all(&p).unwrap();
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o700)).unwrap();
            TempDir(p)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn sample() -> RmState {
        RmState {
            version: STATE_VERSION,
            next_region_id: 3,
            regions: vec![RegionRecord {
                region_id: 2,
                owner: "host:1".into(),
                pool_uuid: "u".into(),
                offset: 1 << 21,
                length: 1 << 21,
                requested: 5,
                nonce: u64::MAX,
                draining: true,
            }],
            holds: vec![HoldRecord {
                region_id: 2,
                node: "n".into(),
                epoch: 4,
            }],
        }
    }

    #[test]
    fn dir_store_round_trip_and_atomic_file() {
        let d = TempDir::new("store");
        let mut s = DirStore::open(d.0.join("sub")).unwrap();
        assert_eq!(s.load().unwrap(), None);
        s.save(&sample()).unwrap();
        assert!(!s.dir().join(STATE_TMP_FILE).exists());
        assert_eq!(s.load().unwrap(), Some(sample()));
        // A second store on the same directory (a restart) reads the same state.
        let mut again = DirStore::open(d.0.join("sub")).unwrap();
        assert_eq!(again.load().unwrap(), Some(sample()));
        // A leftover temporary file from a crashed save is ignored.
        std::fs::write(s.dir().join(STATE_TMP_FILE), b"{partial").unwrap();
        assert_eq!(again.load().unwrap(), Some(sample()));
    }

    #[test]
    fn state_dir_is_created_private_and_refused_when_others_can_write() {
        use std::os::unix::fs::PermissionsExt;
        let d = TempDir::new("perm");
        // Whatever the umask, a new state directory is 0700.
        // SAFETY: umask only swaps the process mask; restored below.
        let old = unsafe { libc::umask(0) };
        let made = DirStore::open(d.0.join("new"));
        unsafe { libc::umask(old) };
        made.unwrap();
        let mode = std::fs::metadata(d.0.join("new"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o700);
        let open = d.0.join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = DirStore::open(&open).unwrap_err().to_string();
        assert!(e.contains("others can write"), "{e}");
    }

    #[test]
    fn a_planted_temp_file_link_is_not_followed() {
        let d = TempDir::new("link");
        let mut s = DirStore::open(d.0.join("st")).unwrap();
        let victim = d.0.join("victim");
        std::fs::write(&victim, b"precious").unwrap();
        std::os::unix::fs::symlink(&victim, s.dir().join(STATE_TMP_FILE)).unwrap();
        s.save(&sample()).unwrap();
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
        assert_eq!(s.load().unwrap(), Some(sample()));
    }

    #[test]
    fn dir_store_reports_step_and_path() {
        let d = TempDir::new("bad");
        let mut s = DirStore::open(&d.0).unwrap();
        std::fs::write(s.state_path(), b"not json").unwrap();
        let e = s.load().unwrap_err();
        assert_eq!(e.step, Step::Parse);
        assert!(e.to_string().contains("state.json"), "{e}");

        let mut v = sample();
        v.version = 99;
        std::fs::write(s.state_path(), serde_json::to_vec(&v).unwrap()).unwrap();
        let e = s.load().unwrap_err();
        assert!(e.to_string().contains("version 99"), "{e}");

        // A directory in the way of the temporary file makes the write step fail.
        std::fs::create_dir(s.dir().join(STATE_TMP_FILE)).unwrap();
        let e = s.save(&sample()).unwrap_err();
        assert_eq!(e.step, Step::Write);
        assert!(e.path.ends_with(STATE_TMP_FILE), "{e}");
    }

    #[test]
    fn mem_store_injects_failures() {
        let m = MemStore::new();
        let mut s: Box<dyn StateStore> = Box::new(m.clone());
        m.fail_next(Step::DirSync);
        assert_eq!(s.save(&sample()).unwrap_err().step, Step::DirSync);
        assert_eq!(m.saved(), None);
        s.save(&sample()).unwrap();
        assert_eq!(m.saved(), Some(sample()));
        m.fail_always(Some(Step::Rename));
        assert!(s.save(&sample()).is_err());
        assert!(s.save(&sample()).is_err());
        m.fail_always(None);
        s.save(&sample()).unwrap();
        assert_eq!((m.saves(), m.attempts()), (2, 5));
        m.fail_next(Step::Read);
        assert!(s.load().is_err());
        assert_eq!(s.load().unwrap(), Some(sample()));
    }
}

#[cfg(test)]
mod parse_props {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The state-file decoder refuses arbitrary bytes with a parse error naming the
        /// file, and never panics.
        #[test]
        fn state_decoder_never_panics(data in proptest::collection::vec(any::<u8>(), 0..512)) {
            if let Err(e) = parse_state(Path::new("state.json"), &data) {
                prop_assert_eq!(e.step, Step::Parse);
            }
        }

        /// Structured but wrong state files (odd versions, ids, fields) are handled too.
        #[test]
        fn odd_state_json(version in any::<i64>(), next in any::<i64>(), off in any::<u64>(), s in ".{0,20}") {
            let text = serde_json::json!({"version": version, "next_region_id": next,
                "regions": [{"region_id": 1, "owner": s, "pool_uuid": s, "offset": off, "length": off,
                             "requested": 1, "nonce": 2, "draining": false}], "holds": []}).to_string();
            let _ = parse_state(Path::new("state.json"), text.as_bytes());
        }
    }
}
