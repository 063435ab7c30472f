//! Key files: the shared secret of the agents (and optionally the RM), refused when
//! readable by group or others.
//!
//! Format: the key as hex on one line (64 hex digits = 32 bytes, at least 16 bytes),
//! comments starting with `#` and blank lines ignored. `maru-rm-ctl gen-key` and
//! `make keys` write such files with mode 0600.

use std::fmt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// Minimum key length in bytes.
pub const MIN_KEY_LEN: usize = 16;

/// A shared key. Debug output never shows the bytes.
#[derive(Clone)]
pub struct SharedKey(Vec<u8>);

impl SharedKey {
    pub fn from_bytes(bytes: Vec<u8>) -> Result<SharedKey, KeyFileError> {
        if bytes.len() < MIN_KEY_LEN {
            return Err(KeyFileError::TooShort {
                path: None,
                len: bytes.len(),
            });
        }
        Ok(SharedKey(bytes))
    }

    pub fn bytes(&self) -> &[u8] {
        &self.0
    }

    /// The key's public name: 8 bytes of an HMAC of the key, as hex. A client names
    /// the key it is about to prove with it (the hello's `key_id`), so that a server
    /// holding several keys (maru-server's tenants) knows which one to prove back and
    /// check; it tells nothing about the key's bytes, and naming a key proves nothing:
    /// only the proof over both nonces does.
    pub fn id(&self) -> String {
        super::to_hex(&super::hmac_parts(&self.0, &[b"maru-key-id"])[..8])
    }

    /// A new random 32-byte key.
    pub fn generate() -> std::io::Result<SharedKey> {
        Ok(SharedKey(super::random_bytes(32)?))
    }

    /// The key as the text of a key file.
    pub fn to_file_text(&self) -> String {
        format!(
            "# maru shared key (keep mode 0600)\n{}\n",
            super::to_hex(&self.0)
        )
    }
}

impl fmt::Debug for SharedKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SharedKey({} bytes)", self.0.len())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum KeyFileError {
    #[error("cannot read key file {}: {err}", .path.display())]
    Io {
        path: PathBuf,
        #[source]
        err: std::io::Error,
    },
    /// Group or others may read (or write) the file.
    #[error(
        "key file {} has mode {:o}: group or others can access it; run `chmod 600 {}`",
        .path.display(), .mode & 0o777, .path.display()
    )]
    TooOpen { path: PathBuf, mode: u32 },
    /// The file belongs to another user than the daemon's (or root).
    #[error(
        "key file {} is owned by uid {uid}, not by this daemon's user (uid {me}) or root: \
         another user could have written it; run `chown {me} {}`",
        .path.display(), .path.display()
    )]
    ForeignOwner { path: PathBuf, uid: u32, me: u32 },
    #[error("key file {} does not hold a hex key on its first non-comment line", .path.display())]
    NotHex { path: PathBuf },
    #[error("key{} is {len} bytes; at least {MIN_KEY_LEN} are required", in_path(.path))]
    TooShort { path: Option<PathBuf>, len: usize },
}

/// " in PATH" when a key came from a file, nothing otherwise.
fn in_path(path: &Option<PathBuf>) -> String {
    path.as_ref()
        .map(|p| format!(" in {}", p.display()))
        .unwrap_or_default()
}

/// Parses the text of a key file.
pub fn parse_key_text(path: &Path, text: &str) -> Result<SharedKey, KeyFileError> {
    let line = text
        .lines()
        .map(str::trim)
        .find(|l| !l.is_empty() && !l.starts_with('#'))
        .ok_or_else(|| KeyFileError::NotHex {
            path: path.to_path_buf(),
        })?;
    let bytes = super::from_hex(line).ok_or_else(|| KeyFileError::NotHex {
        path: path.to_path_buf(),
    })?;
    if bytes.len() < MIN_KEY_LEN {
        return Err(KeyFileError::TooShort {
            path: Some(path.to_path_buf()),
            len: bytes.len(),
        });
    }
    Ok(SharedKey(bytes))
}

/// Whether a file of owner `uid` may be trusted by this process: its own user's,
/// or root's. Returns this process's user when not.
pub fn foreign_owner(uid: u32) -> Option<u32> {
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    (uid != me && uid != 0).then_some(me)
}

/// Reads a key file, refusing one that group or others can access. A client reads
/// the key its daemon made, owned by the daemon's user: the owner is not checked
/// here (see [`load_owned_key_file`] for files that grant authority).
pub fn load_key_file(path: &Path) -> Result<SharedKey, KeyFileError> {
    load_checked(path, false)
}

/// Reads a key file that grants authority (a tenant's key named by the tenants
/// file), refusing also one that another user than this process's (or root) owns.
/// The checks are on the file read (its open descriptor), not on its name.
pub fn load_owned_key_file(path: &Path) -> Result<SharedKey, KeyFileError> {
    load_checked(path, true)
}

fn load_checked(path: &Path, owner: bool) -> Result<SharedKey, KeyFileError> {
    use std::io::Read;
    use std::os::unix::fs::MetadataExt;
    let io = |err| KeyFileError::Io {
        path: path.to_path_buf(),
        err,
    };
    let f = std::fs::File::open(path).map_err(io)?;
    let meta = f.metadata().map_err(io)?;
    let mode = meta.permissions().mode();
    if mode & 0o077 != 0 {
        return Err(KeyFileError::TooOpen {
            path: path.to_path_buf(),
            mode,
        });
    }
    if let Some(me) = foreign_owner(meta.uid()).filter(|_| owner) {
        return Err(KeyFileError::ForeignOwner {
            path: path.to_path_buf(),
            uid: meta.uid(),
            me,
        });
    }
    let mut text = String::new();
    f.take(1 << 16).read_to_string(&mut text).map_err(io)?;
    parse_key_text(path, &text)
}

/// Writes a new key file with mode 0600 (refuses to overwrite an existing file).
pub fn write_new_key_file(path: &Path, key: &SharedKey) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)?;
    f.write_all(key.to_file_text().as_bytes())?;
    f.sync_all()
}

/// Loads the key file at `path`, or creates one (a fresh random key, mode 0600, in a
/// directory created 0700 if missing) when there is none.
pub fn load_or_create_key(path: &Path) -> Result<SharedKey, KeyFileError> {
    if !path.exists() {
        let io = |err| KeyFileError::Io {
            path: path.to_path_buf(),
            err,
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            use std::os::unix::fs::DirBuilderExt;
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(io)?;
        }
        let key = SharedKey::generate().map_err(io)?;
        match write_new_key_file(path, &key) {
            Ok(()) => log::info!(
                "created key file {} (mode 0600): give it to this daemon's clients",
                path.display()
            ),
            // Another process created it meanwhile: use that one.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(io(e)),
        }
    }
    load_key_file(path)
}

/// Environment variable naming the key file a worker proves to maru-server.
pub const SERVER_KEY_ENV: &str = "MARU_SERVER_KEY_FILE";

/// The maru-server key a worker proves: the file named by `MARU_SERVER_KEY_FILE`, or
/// none when it is unset (then only a server without a key accepts the worker).
pub fn server_key_from_env() -> Result<Option<SharedKey>, KeyFileError> {
    match std::env::var_os(SERVER_KEY_ENV) {
        Some(p) if !p.is_empty() => load_key_file(Path::new(&p)).map(Some),
        _ => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_short_key_says_where_it_came_from_only_when_it_came_from_a_file() {
        let from_file = KeyFileError::TooShort {
            path: Some(PathBuf::from("/k")),
            len: 3,
        };
        let given = KeyFileError::TooShort { path: None, len: 3 };
        assert_eq!(
            from_file.to_string(),
            format!("key in /k is 3 bytes; at least {MIN_KEY_LEN} are required")
        );
        assert_eq!(
            given.to_string(),
            format!("key is 3 bytes; at least {MIN_KEY_LEN} are required")
        );
    }
    use proptest::prelude::*;

    fn tmp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("maru-key-{}-{name}", std::process::id()));
        let _ = std::fs::remove_file(&d);
        d
    }

    #[test]
    fn refuses_group_or_world_readable() {
        let p = tmp("open");
        write_new_key_file(&p, &SharedKey::generate().unwrap()).unwrap();
        assert!(load_key_file(&p).is_ok());
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o640)).unwrap();
        let e = load_key_file(&p).unwrap_err();
        assert!(matches!(e, KeyFileError::TooOpen { .. }), "{e}");
        assert!(e.to_string().contains("chmod 600"));
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o604)).unwrap();
        assert!(matches!(
            load_key_file(&p),
            Err(KeyFileError::TooOpen { .. })
        ));
        std::fs::remove_file(&p).unwrap();
    }

    #[test]
    fn refuses_a_key_file_of_another_user() {
        // Only root can give a file away; elsewhere the rule is checked on its own.
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        assert_eq!(foreign_owner(me), None);
        assert_eq!(foreign_owner(0), None, "root's files are trusted");
        let other = if me == 65534 { 65533 } else { 65534 };
        assert_eq!(foreign_owner(other), Some(me));
        if me != 0 {
            return;
        }
        let p = tmp("foreign");
        write_new_key_file(&p, &SharedKey::generate().unwrap()).unwrap();
        std::os::unix::fs::chown(&p, Some(65534), None).unwrap();
        // A client reads its daemon's key whoever owns it; a file that grants
        // authority is refused when another user owns it.
        assert!(load_key_file(&p).is_ok());
        let e = load_owned_key_file(&p).unwrap_err();
        // root's own uid is 0, which is trusted; a root daemon refuses nobody's file.
        assert!(matches!(e, KeyFileError::ForeignOwner { .. }), "{e}");
        assert!(e.to_string().contains("chown"), "{e}");
        std::fs::remove_file(&p).unwrap();
    }

    #[test]
    fn parses_comments_and_rejects_short_keys() {
        let p = Path::new("k");
        let k = parse_key_text(p, "# c\n\n  00112233445566778899aabbccddeeff  \n").unwrap();
        assert_eq!(k.bytes().len(), 16);
        assert!(matches!(
            parse_key_text(p, "0011"),
            Err(KeyFileError::TooShort { .. })
        ));
        assert!(matches!(
            parse_key_text(p, "xyz"),
            Err(KeyFileError::NotHex { .. })
        ));
        assert!(matches!(
            parse_key_text(p, "# only\n"),
            Err(KeyFileError::NotHex { .. })
        ));
    }

    proptest! {
        #[test]
        fn key_text_parser_never_panics(s in ".{0,200}") {
            let _ = parse_key_text(Path::new("p"), &s);
        }
    }
}
