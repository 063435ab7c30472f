//! The resource manager's token secret: created once in the state directory and
//! kept, because every region token is an HMAC under it and handles must stay valid
//! across restarts.
//!
//! A state that lists regions but has no secret is refused: a new secret would make
//! every existing handle fail its token check, so the owners could neither map nor
//! free their regions.

use super::store::{sync_dir, DirStore, PersistError, StateStore};
use crate::auth::keyfile::{load_key_file, write_new_key_file, KeyFileError, SharedKey};
use std::path::{Path, PathBuf};

/// Name of the secret file in the state directory.
pub const SECRET_FILE: &str = "secret";

/// Name of the key file clients prove, in the state directory, when the RM is not
/// given `--key-file` (created on the first start).
pub const RM_KEY_FILE: &str = "rm.key";

/// Length of the secret (bytes).
pub const SECRET_LEN: usize = 32;

#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    /// The file exists but cannot be used (unreadable, mode too open, not hex).
    #[error("RM secret: {0}")]
    KeyFile(#[source] KeyFileError),
    /// The file holds a key of another length.
    #[error("RM secret {} holds {len} bytes; it must hold {SECRET_LEN}", path.display())]
    WrongLength { path: PathBuf, len: usize },
    /// No secret, but the state lists regions whose tokens need the old one.
    #[error("RM secret {} is missing but the state lists {regions} region(s) whose tokens \
         were made with it; restore the secret file (a new one would invalidate every \
         handle), or move the state file away to start empty", path.display())]
    MissingWithRegions { path: PathBuf, regions: usize },
    /// The state file could not be read to check for regions.
    #[error("RM secret: checking the state: {0}")]
    State(#[source] PersistError),
    /// Creating the new secret failed.
    #[error("cannot create RM secret {}: {err}", path.display())]
    Create {
        path: PathBuf,
        #[source]
        err: std::io::Error,
    },
}

/// Reads `dir/secret`, or creates it (mode 0600, never overwriting) when it is
/// missing and the state in `dir` lists no regions. Refuses a secret file that group
/// or others can access.
pub fn load_or_create_secret(dir: &Path) -> Result<[u8; SECRET_LEN], SecretError> {
    let path = dir.join(SECRET_FILE);
    if !path.exists() {
        let state = DirStore::open(dir)
            .and_then(|mut s| s.load())
            .map_err(SecretError::State)?;
        let regions = state.map_or(0, |s| s.regions.len());
        if regions > 0 {
            return Err(SecretError::MissingWithRegions { path, regions });
        }
        let key = SharedKey::generate().map_err(|err| SecretError::Create {
            path: path.clone(),
            err,
        })?;
        match write_new_key_file(&path, &key) {
            Ok(()) => sync_dir(dir).map_err(|err| SecretError::Create {
                path: path.clone(),
                err,
            })?,
            // Another process created it meanwhile: use that one.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(err) => return Err(SecretError::Create { path, err }),
        }
    }
    let key = load_key_file(&path).map_err(SecretError::KeyFile)?;
    key.bytes()
        .try_into()
        .map_err(|_| SecretError::WrongLength {
            path,
            len: key.bytes().len(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rm::state::{RegionRecord, RmState};
    use crate::rm::store::tests::TempDir;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn created_once_then_kept() {
        let d = TempDir::new("secret");
        let a = load_or_create_secret(&d.0).unwrap();
        let mode = std::fs::metadata(d.0.join(SECRET_FILE))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        assert_eq!(load_or_create_secret(&d.0).unwrap(), a);
    }

    #[test]
    fn refuses_an_open_secret() {
        let d = TempDir::new("secret-open");
        load_or_create_secret(&d.0).unwrap();
        let p = d.0.join(SECRET_FILE);
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o640)).unwrap();
        let e = load_or_create_secret(&d.0).unwrap_err();
        assert!(e.to_string().contains("chmod 600"), "{e}");
    }

    #[test]
    fn missing_secret_with_regions_is_an_error() {
        let d = TempDir::new("secret-missing");
        let mut s = DirStore::open(&d.0).unwrap();
        let mut st = RmState::empty();
        st.regions.push(RegionRecord {
            region_id: 1,
            owner: "o".into(),
            pool_uuid: "u".into(),
            offset: 0,
            length: 1,
            requested: 1,
            nonce: 1,
            draining: false,
        });
        s.save(&st).unwrap();
        let e = load_or_create_secret(&d.0).unwrap_err();
        assert!(matches!(
            e,
            SecretError::MissingWithRegions { regions: 1, .. }
        ));
        assert!(!d.0.join(SECRET_FILE).exists());
        // With no regions left a new secret is fine.
        s.save(&RmState::empty()).unwrap();
        load_or_create_secret(&d.0).unwrap();
    }

    #[test]
    fn wrong_length_is_refused() {
        let d = TempDir::new("secret-len");
        let key = SharedKey::from_bytes(vec![7u8; 16]).unwrap();
        write_new_key_file(&d.0.join(SECRET_FILE), &key).unwrap();
        assert!(matches!(
            load_or_create_secret(&d.0),
            Err(SecretError::WrongLength { len: 16, .. })
        ));
    }
}
