//! The state directory's files, opened safely: the directory and its files are this
//! user's (or root's) and private (0700, 0600), opened without following a symbolic
//! link and relative to the directory; a damaged store file is set aside.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};

/// The store's file in the state directory.
pub const DIRECTORY_FILE: &str = "directory.redb";
/// Held (flock) while a maru-server uses the state directory.
pub const LOCK_FILE: &str = "lock";

pub(super) fn err(path: &Path, what: &str, e: impl std::fmt::Display) -> String {
    format!("{} ({what}): {e}", path.display())
}

/// Opens the state directory `dir`, made 0700 if missing, without following a
/// symbolic link, and checks it: a directory of this user (or root) that neither
/// group nor others may access. Its files are opened relative to it.
pub(super) fn open_state_dir(dir: &Path) -> Result<OwnedFd, String> {
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
    tighten(&fd, &m, 0o700, dir).map_err(|e| {
        what(format!(
            "{e}; run `chmod 700 {}` once you know what it holds",
            dir.display()
        ))
    })?;
    Ok(fd)
}

/// A state directory or file of this user that group or others may read but not
/// write (what an older maru-server made: 0755, 0644) is made `private` (0700,
/// 0600) and logged; one that group or others may write, or one of root that group
/// or others may read (this user may not change it), is an error naming its mode.
fn tighten(fd: &OwnedFd, m: &libc::stat, private: u32, path: &Path) -> Result<(), String> {
    let mode = m.st_mode & 0o7777;
    if mode & 0o077 == 0 {
        return Ok(());
    }
    if mode & 0o022 != 0 {
        return Err(format!(
            "mode {mode:o}: group or others may write it, so what it holds may not be this \
             server's"
        ));
    }
    // SAFETY: geteuid has no preconditions.
    if m.st_uid != unsafe { libc::geteuid() } {
        return Err(format!(
            "mode {mode:o}: group or others may read it, and it is root's"
        ));
    }
    // SAFETY: fd is an open descriptor this process owns.
    if unsafe { libc::fchmod(fd.as_raw_fd(), private as libc::mode_t) } != 0 {
        return Err(format!(
            "mode {mode:o}: group or others may read it, and it cannot be made {private:o}: {}",
            std::io::Error::last_os_error()
        ));
    }
    log::warn!(
        "{}: mode {mode:o} let group or others read it (an older maru-server made it so): \
         made {private:o}",
        path.display()
    );
    Ok(())
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
pub(super) fn open_private_file(
    dir: &OwnedFd,
    name: &str,
    path: &Path,
) -> Result<std::fs::File, String> {
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
    tighten(&fd, &m, 0o600, path).map_err(|e| {
        err(
            path,
            "open",
            format!(
                "{e}; run `chmod 600 {}` once you know what it holds, or move it away",
                path.display()
            ),
        )
    })?;
    Ok(std::fs::File::from(fd))
}

/// Moves the damaged directory file aside (`directory.redb.damaged-<unix seconds>`
/// in the state directory, 0600 as it was); returns where.
pub(super) fn set_aside(dir: &OwnedFd, path: &Path) -> Result<PathBuf, String> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let name = format!("{DIRECTORY_FILE}.damaged-{secs}");
    let from = std::ffi::CString::new(DIRECTORY_FILE).map_err(|e| err(path, "set aside", e))?;
    let to = std::ffi::CString::new(name.as_str()).map_err(|e| err(path, "set aside", e))?;
    // SAFETY: dir is an open directory descriptor; both names are NUL-terminated.
    let r = unsafe { libc::renameat(dir.as_raw_fd(), from.as_ptr(), dir.as_raw_fd(), to.as_ptr()) };
    if r != 0 {
        return Err(err(path, "set aside", std::io::Error::last_os_error()));
    }
    Ok(path.with_file_name(name))
}
