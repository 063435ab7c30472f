//! Whether an existing fake-DAX pool file may be adopted.
//!
//! The RM serves the file's bytes to whoever holds a region of it: a file planted by
//! another user (or one that user can still write) would let that user read and
//! overwrite the KV of every engine. So an existing file must be a regular file owned
//! by the RM's user (or root), writable by nobody else.

use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// Checks an existing pool file at `path` (a missing one is fine: the RM creates it).
pub fn check_pool_file(path: &Path) -> Result<(), String> {
    let m = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(format!("pool file {}: {e}", path.display())),
    };
    if m.file_type().is_symlink() {
        return Err(format!(
            "pool file {} is a symbolic link: give the file's own path",
            path.display()
        ));
    }
    if !m.is_file() {
        // A devdax device or another special file: not a fake-DAX file.
        return Ok(());
    }
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    if m.uid() != me && m.uid() != 0 {
        return Err(format!(
            "pool file {} belongs to uid {}, not to this user (uid {me}): refusing to serve a \
             file another user planted; remove it or give another path",
            path.display(),
            m.uid()
        ));
    }
    if m.mode() & 0o022 != 0 {
        return Err(format!(
            "pool file {} has mode {:o}: group or others can write it, so they could read and \
             change every region; run `chmod 600 {}`",
            path.display(),
            m.mode() & 0o777,
            path.display()
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn open_or_linked_pool_files_are_refused() {
        let d = crate::rm::store::tests::TempDir::new("poolfile");
        let p = d.0.join("pool");
        assert!(
            check_pool_file(&p).is_ok(),
            "a missing file is created later"
        );
        std::fs::write(&p, b"x").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(check_pool_file(&p).is_ok());
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o666)).unwrap();
        assert!(check_pool_file(&p)
            .unwrap_err()
            .contains("others can write"));
        let l = d.0.join("link");
        std::os::unix::fs::symlink(&p, &l).unwrap();
        assert!(check_pool_file(&l).unwrap_err().contains("symbolic link"));
    }
}
