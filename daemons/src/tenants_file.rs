//! maru-server's tenants file (`--tenants FILE`, TOML): each tenant's key file and
//! namespaces, and its limits. The keys go into the server's keyring (the handshake
//! names the connection's tenant by the key it proved), the rest into the core
//! ([`Tenants`]). The file is read again when it changes; a file that does not parse
//! or check leaves the tenants in force as they were (logged).
//!
//! The file says who owns which namespace, so it is trusted only as a key file is:
//! owned by the daemon's user or root and writable by no one else (group or others),
//! else refused at start and not reloaded (an error naming the file and the fix).
//! The key files it names are checked the same way, and refused when group or others
//! may read them at all.
//!
//! A tenant's key that a reload removes or changes ends what it proved: the loop
//! closes its connections ([`Keyring::in_force`]) and the daemon ends its sessions
//! and forgets their secrets ([`Reloaded::rekeyed`]), so a tenant added back under
//! the same name starts with nothing of the old one's.
//!
//! ```toml
//! [tenants.alpha]
//! key_file = "alpha.key"           # relative to this file; mode 0600
//! write = ["llama-3.1-8b", "alpha-*"]
//! read = ["shared-*"]
//! max_sessions = 64                # optional limits, per tenant
//! max_regions = 0                  # 0: its share of the pool only
//! max_pins = 65536
//! max_parked = 32
//! max_connections = 256            # its share of --max-clients (default: an even part)
//!
//! [tenants.default]                # optional: the tenant of the server's own key
//! write = ["*"]                    # absent: every namespace no other tenant writes
//! ```

use maru::auth::{keyfile::load_owned_key_file, Keyring, SharedKey};
use maru::meta::tenants::{DEFAULT_LIMITS, DEFAULT_TENANT_LIMITS};
use maru::meta::{NsPattern, TenantLimits, TenantSpec, Tenants, DEFAULT_TENANT};
use serde::Deserialize;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::SystemTime;

/// How often the file is looked at for a change.
pub const CHECK_EVERY_MS: u64 = 2_000;

/// Largest tenants file read (a few hundred tenants fit in far less).
const MAX_FILE: u64 = 1 << 20;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileText {
    #[serde(default)]
    tenants: BTreeMap<String, TenantText>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TenantText {
    key_file: Option<PathBuf>,
    write: Option<Vec<String>>,
    #[serde(default)]
    read: Vec<String>,
    max_sessions: Option<usize>,
    max_regions: Option<usize>,
    max_pins: Option<usize>,
    max_parked: Option<usize>,
    max_connections: Option<usize>,
}

/// What a tenants file says: the core's tenants, each tenant's key file, and the
/// connections of those that give a limit.
#[derive(Debug)]
pub struct Parsed {
    pub tenants: Tenants,
    pub key_files: Vec<(String, PathBuf)>,
    pub connection_limits: HashMap<String, usize>,
}

/// A tenants file read: the tenants, the keyring's named keys and connection limits,
/// and the key files read.
pub struct Loaded {
    pub tenants: Tenants,
    pub keys: Vec<(String, SharedKey)>,
    pub connection_limits: HashMap<String, usize>,
    pub key_files: Vec<PathBuf>,
}

fn patterns(tenant: &str, what: &str, v: &[String]) -> Result<Vec<NsPattern>, String> {
    v.iter()
        .map(|p| NsPattern::parse(p).map_err(|e| format!("tenant {tenant}, {what}: {}", e.0)))
        .collect()
}

/// Parses and checks the text of a tenants file found in `dir` (key files are
/// relative to it). The default tenant (the server's own key) is always there.
pub fn parse(text: &str, dir: &Path) -> Result<Parsed, String> {
    let f: FileText = toml::from_str(text).map_err(|e| e.to_string())?;
    let mut specs = Vec::with_capacity(f.tenants.len() + 1);
    let mut key_files = Vec::new();
    let mut connection_limits = HashMap::new();
    if !f.tenants.contains_key(DEFAULT_TENANT) {
        specs.push(TenantSpec::unclaimed(DEFAULT_TENANT_LIMITS));
    }
    for (name, t) in &f.tenants {
        let is_default = name == DEFAULT_TENANT;
        let base = if is_default {
            DEFAULT_TENANT_LIMITS
        } else {
            DEFAULT_LIMITS
        };
        let limits = TenantLimits {
            max_sessions: t.max_sessions.unwrap_or(base.max_sessions),
            max_regions: t.max_regions.unwrap_or(base.max_regions),
            max_pins: t.max_pins.unwrap_or(base.max_pins),
            max_parked: t.max_parked.unwrap_or(base.max_parked),
        };
        if let Some(n) = t.max_connections {
            if n == 0 {
                return Err(format!(
                    "tenant {name}: max_connections = 0 would keep it out; give it at least 1 \
                     (or leave it out for an even part of --max-clients)"
                ));
            }
            connection_limits.insert(name.clone(), n);
        }
        match (&t.key_file, is_default) {
            (Some(_), true) => {
                return Err(format!(
                    "tenant {DEFAULT_TENANT} has the server's own key (--key-file): give it no \
                     key_file"
                ))
            }
            (None, false) => return Err(format!("tenant {name} has no key_file")),
            (Some(k), false) => key_files.push((name.clone(), dir.join(k))),
            (None, true) => {}
        }
        if !is_default && t.write.is_none() {
            return Err(format!(
                "tenant {name} writes no namespace: give it write = [\"namespace\", ...] \
                 (an empty list for a tenant that only reads)"
            ));
        }
        specs.push(TenantSpec {
            name: name.clone(),
            write: t
                .write
                .as_deref()
                .map(|w| patterns(name, "write", w))
                .transpose()?,
            read: patterns(name, "read", &t.read)?,
            limits,
        });
    }
    let tenants = Tenants::new(specs).map_err(|e| e.0)?;
    Ok(Parsed {
        tenants,
        key_files,
        connection_limits,
    })
}

/// Checks that the tenants file `meta` (of `path`, as opened) may be trusted: owned
/// by this process's user or root, writable by neither group nor others.
fn check_trusted(path: &Path, meta: &std::fs::Metadata) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    if let Some(me) = maru::auth::keyfile::foreign_owner(meta.uid()) {
        return Err(format!(
            "{} is owned by uid {}, not by this daemon's user (uid {me}) or root: another \
             user could say who owns which namespace; run `chown {me} {}`",
            path.display(),
            meta.uid(),
            path.display()
        ));
    }
    let mode = meta.mode() & 0o7777;
    if mode & 0o022 != 0 {
        return Err(format!(
            "{} has mode {mode:o}: group or others can write it and so say who owns which \
             namespace; run `chmod go-w {}`",
            path.display(),
            path.display()
        ));
    }
    Ok(())
}

/// Reads `path` and every key file it names: the tenants and the named keys of the
/// keyring (the server's own key under the default tenant's name). A file or key file
/// another user could have written is refused (see the module docs).
pub fn load(path: &Path, server_key: &SharedKey) -> Result<Loaded, String> {
    use std::io::Read;
    let file = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let meta = file
        .metadata()
        .map_err(|e| format!("{}: {e}", path.display()))?;
    check_trusted(path, &meta)?;
    if meta.len() > MAX_FILE {
        return Err(format!(
            "{} is {} bytes; a tenants file is at most {MAX_FILE}",
            path.display(),
            meta.len()
        ));
    }
    let mut text = String::new();
    file.take(MAX_FILE)
        .read_to_string(&mut text)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    let dir = path.parent().unwrap_or(Path::new("."));
    let p = parse(&text, dir).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut keys = vec![(DEFAULT_TENANT.to_string(), server_key.clone())];
    for (name, file) in &p.key_files {
        let k = load_owned_key_file(file).map_err(|e| {
            format!(
                "{}: tenant {name}: {e} (make one with `maru-server gen-key {}`)",
                path.display(),
                file.display()
            )
        })?;
        keys.push((name.clone(), k));
    }
    Ok(Loaded {
        tenants: p.tenants,
        keys,
        connection_limits: p.connection_limits,
        key_files: p.key_files.into_iter().map(|(_, f)| f).collect(),
    })
}

/// A tenants file read again: the tenants now in force, and the tenants whose key it
/// removed or changed (their sessions end: see the module docs).
pub struct Reloaded {
    pub tenants: Tenants,
    pub rekeyed: Vec<String>,
}

/// Each name's key id.
fn key_ids(keys: &[(String, SharedKey)]) -> BTreeMap<String, String> {
    keys.iter().map(|(n, k)| (n.clone(), k.id())).collect()
}

/// The tenants file of a running server: read again when it changed.
pub struct TenantsFile {
    path: PathBuf,
    server_key: SharedKey,
    keyring: Keyring,
    /// The file's stamp and its key files', as last read.
    seen: Vec<Option<Stamp>>,
    key_files: Vec<PathBuf>,
    /// The id of each tenant's key in force.
    key_ids: BTreeMap<String, String>,
    next_check_ms: u64,
}

/// What tells a changed file: its time, size, inode, owner and mode (a file put in
/// its place, or a `chmod` or `chown` that makes it trusted again, reads it again).
type Stamp = (SystemTime, u64, u64, u32, u32);

fn stamp(path: &Path) -> Option<Stamp> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path).ok()?;
    Some((m.modified().ok()?, m.len(), m.ino(), m.uid(), m.mode()))
}

/// The stamps of the tenants file and of its key files: a key file replaced in place
/// (a rotated key) reads the tenants again too.
fn stamps(path: &Path, key_files: &[PathBuf]) -> Vec<Option<Stamp>> {
    std::iter::once(path)
        .chain(key_files.iter().map(PathBuf::as_path))
        .map(stamp)
        .collect()
}

impl TenantsFile {
    /// Reads the file now (an error stops the server: the operator is there) and
    /// puts its keys into `keyring`.
    pub fn open(
        path: &Path,
        server_key: SharedKey,
        keyring: Keyring,
    ) -> Result<(TenantsFile, Tenants), String> {
        let l = load(path, &server_key)?;
        let seen = stamps(path, &l.key_files);
        let key_ids = key_ids(&l.keys);
        keyring
            .replace_limited(l.keys, l.connection_limits)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        let f = TenantsFile {
            path: path.to_path_buf(),
            server_key,
            keyring,
            seen,
            key_files: l.key_files,
            key_ids,
            next_check_ms: 0,
        };
        Ok((f, l.tenants))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn next_check_ms(&self) -> u64 {
        self.next_check_ms
    }

    /// The new tenants if the file changed since it was last read and reads well
    /// (its keys already in the keyring), with the tenants whose key went or
    /// changed; None otherwise.
    pub fn reload_if_changed(&mut self, now_ms: u64) -> Option<Reloaded> {
        if now_ms < self.next_check_ms {
            return None;
        }
        self.next_check_ms = now_ms + CHECK_EVERY_MS;
        let now = stamps(&self.path, &self.key_files);
        if now == self.seen {
            return None;
        }
        self.seen = now;
        let loaded = load(&self.path, &self.server_key).and_then(|l| {
            let ids = key_ids(&l.keys);
            // Look at the key files it names now (a stamp taken after the read: a
            // change meanwhile reads it once more).
            self.seen = stamps(&self.path, &l.key_files);
            self.key_files = l.key_files;
            self.keyring
                .replace_limited(l.keys, l.connection_limits)
                .map_err(|e| format!("{}: {e}", self.path.display()))?;
            let rekeyed = self
                .key_ids
                .iter()
                .filter(|(name, id)| ids.get(*name) != Some(*id))
                .map(|(name, _)| name.clone())
                .collect();
            self.key_ids = ids;
            Ok(Reloaded {
                tenants: l.tenants,
                rekeyed,
            })
        });
        match loaded {
            Ok(r) => Some(r),
            Err(e) => {
                log::error!("tenants file not reloaded, the tenants in force stay: {e}");
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use maru::meta::Access;
    use proptest::prelude::*;

    const EXAMPLE: &str = r#"
        [tenants.alpha]
        key_file = "alpha.key"
        write = ["llama-8b", "alpha-*"]
        read = ["shared-*"]
        max_sessions = 4

        [tenants.beta]
        key_file = "/etc/maru/beta.key"
        write = ["shared-docs"]
    "#;

    #[test]
    fn a_tenants_file_names_keys_namespaces_and_limits() {
        let p = parse(EXAMPLE, Path::new("/etc/maru/tenants")).unwrap();
        assert_eq!(
            p.key_files,
            [
                (
                    "alpha".to_string(),
                    PathBuf::from("/etc/maru/tenants/alpha.key")
                ),
                ("beta".to_string(), PathBuf::from("/etc/maru/beta.key")),
            ]
        );
        let t = &p.tenants;
        assert_eq!(t.access("alpha", "alpha-1"), Access::Write);
        assert_eq!(t.access("alpha", "shared-docs"), Access::Read);
        assert_eq!(t.access("default", "anything-else"), Access::Write);
        assert_eq!(t.access("default", "llama-8b"), Access::None);
        assert_eq!(t.limits("alpha").max_sessions, 4);
        assert_eq!(t.limits("beta").max_pins, DEFAULT_LIMITS.max_pins);
    }

    #[test]
    fn mistakes_are_refused_with_what_to_change() {
        for (text, says) in [
            ("[tenants.a]\nwrite = [\"x\"]", "no key_file"),
            ("[tenants.a]\nkey_file = \"k\"", "writes no namespace"),
            ("[tenants.default]\nkey_file = \"k\"", "server's own key"),
            ("[tenants.a]\nkey_file = \"k\"\nwrite = [\"x\"]\ncolour = 1", "unknown field"),
            (
                "[tenants.a]\nkey_file = \"k\"\nwrite = [\"x*\"]\n[tenants.b]\nkey_file = \"l\"\nwrite = [\"xy\"]",
                "one writing tenant",
            ),
            ("[tenants.\"a b\"]\nkey_file = \"k\"\nwrite = []", "tenant name"),
            ("[tenants.a]\nkey_file = \"k\"\nwrite = [\"a*b\"]", "only at the end"),
        ] {
            let e = parse(text, Path::new(".")).unwrap_err();
            assert!(e.contains(says), "{text:?}: {e}");
        }
    }

    #[test]
    fn a_changed_file_is_read_again_and_a_broken_one_keeps_the_tenants() {
        let (dir, path, key) = tenants_dir("reload", "");
        let server = SharedKey::generate().unwrap();
        let ring = Keyring::single(server.clone());
        let (mut f, t) = TenantsFile::open(&path, server, ring.clone()).unwrap();
        assert_eq!(t.access("a", "a"), Access::Write);
        assert_eq!(ring.find(Some(&key.id())).unwrap().0, "a");
        assert!(f.reload_if_changed(0).is_none(), "unchanged");
        std::fs::write(
            &path,
            "[tenants.a]\nkey_file = \"a.key\"\nwrite = [\"b\"]\n# more\n",
        )
        .unwrap();
        let t = f.reload_if_changed(CHECK_EVERY_MS).expect("read again");
        assert_eq!(t.tenants.access("a", "b"), Access::Write);
        assert!(t.rekeyed.is_empty(), "no key changed");
        std::fs::write(&path, "[tenants.a]\nwrite = [\"b\"]\n# broken now\n\n").unwrap();
        assert!(f.reload_if_changed(2 * CHECK_EVERY_MS).is_none());
        assert_eq!(
            ring.find(Some(&key.id())).unwrap().0,
            "a",
            "the keys in force stay"
        );
        // A's key file is replaced in place (the tenants file left as it is): a is
        // rekeyed, its old key no longer in force.
        std::fs::write(
            &path,
            "[tenants.a]\nkey_file = \"a.key\"\nwrite = [\"a\"]\n",
        )
        .unwrap();
        assert!(f.reload_if_changed(3 * CHECK_EVERY_MS).is_some());
        std::fs::remove_file(dir.join("a.key")).unwrap();
        let new = SharedKey::generate().unwrap();
        maru::auth::keyfile::write_new_key_file(&dir.join("a.key"), &new).unwrap();
        let r = f.reload_if_changed(4 * CHECK_EVERY_MS).expect("read again");
        assert_eq!(r.rekeyed, ["a"]);
        assert!(!ring.in_force("a", &key.id()));
        assert!(ring.in_force("a", &new.id()));
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A fresh directory `tag` with tenant a's key file `a.key` and a tenants file
    /// giving a that key and write access to namespace a, then the lines `more`.
    fn tenants_dir(tag: &str, more: &str) -> (PathBuf, PathBuf, SharedKey) {
        let dir = std::env::temp_dir().join(format!("maru-tenants-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let key = SharedKey::generate().unwrap();
        maru::auth::keyfile::write_new_key_file(&dir.join("a.key"), &key).unwrap();
        let path = dir.join("tenants.toml");
        let text = format!("[tenants.a]\nkey_file = \"a.key\"\nwrite = [\"a\"]\n{more}");
        std::fs::write(&path, text).unwrap();
        (dir, path, key)
    }

    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn a_tenants_file_others_can_write_is_refused_naming_the_fix() {
        let (dir, path, _) = tenants_dir("mode", "max_connections = 5\n");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let server = SharedKey::generate().unwrap();
        let l = load(&path, &server).expect("0644 is fine: nothing secret in it");
        assert_eq!(l.connection_limits.get("a"), Some(&5));
        for mode in [0o666, 0o664, 0o646] {
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
            let e = load(&path, &server).err().expect("refused");
            assert!(
                e.contains("chmod go-w") && e.contains("tenants.toml"),
                "{e}"
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn max_connections_zero_is_refused() {
        let e = parse(
            "[tenants.a]\nkey_file = \"k\"\nwrite = [\"x\"]\nmax_connections = 0",
            Path::new("."),
        )
        .unwrap_err();
        assert!(e.contains("max_connections"), "{e}");
    }

    proptest! {
        /// Any text: a parse or an error, never a panic.
        #[test]
        fn the_parser_never_panics(s in ".{0,400}") {
            let _ = parse(&s, Path::new("."));
        }

        #[test]
        fn tables_with_odd_values(name in "[a-z]{1,8}", w in proptest::collection::vec(".{0,12}", 0..4)) {
            let text = format!("[tenants.{name}]\nkey_file = \"k\"\nwrite = {w:?}\n");
            let _ = parse(&text, Path::new("."));
        }
    }
}
