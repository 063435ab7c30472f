//! Socket options the daemons set on every connection.

use std::os::fd::AsRawFd;

fn set(fd: i32, level: i32, name: i32, value: i32) {
    // SAFETY: a valid fd and a pointer to an int of the stated size.
    let r = unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            (&value as *const i32).cast(),
            std::mem::size_of::<i32>() as libc::socklen_t,
        )
    };
    if r != 0 {
        log::debug!(
            "setsockopt({level}, {name}) failed: {}",
            std::io::Error::last_os_error()
        );
    }
}

/// TCP keepalive 10 s idle, 5 s interval, 3 probes: a peer whose host died is noticed
/// in about 25 s, which starts the owner's grace timer at the RM.
pub fn keepalive(sock: &impl AsRawFd) {
    let fd = sock.as_raw_fd();
    set(fd, libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1);
    set(fd, libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, 10);
    set(fd, libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, 5);
    set(fd, libc::IPPROTO_TCP, libc::TCP_KEEPCNT, 3);
}
