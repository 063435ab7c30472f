//! SIGINT/SIGTERM as an event: the handler writes one byte to a pipe that the event
//! loop polls, so a daemon stops cleanly (saving state) without waking up to check a
//! flag. Writing to a pipe is async-signal-safe.

use std::os::fd::RawFd;
use std::sync::atomic::{AtomicI32, Ordering};

static WRITE_FD: AtomicI32 = AtomicI32::new(-1);

extern "C" fn on_signal(_sig: libc::c_int) {
    let fd = WRITE_FD.load(Ordering::Relaxed);
    if fd >= 0 {
        let b = 1u8;
        // SAFETY: write(2) is async-signal-safe; the pipe is non-blocking.
        unsafe {
            libc::write(fd, (&b as *const u8).cast(), 1);
        }
    }
}

/// The read end of the signal pipe. Create it once per process.
pub struct SignalPipe {
    read_fd: RawFd,
}

impl SignalPipe {
    /// Installs handlers for SIGINT and SIGTERM and ignores SIGPIPE.
    pub fn install() -> std::io::Result<SignalPipe> {
        let mut fds = [0i32; 2];
        // SAFETY: fds has room for two descriptors.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_NONBLOCK | libc::O_CLOEXEC) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        WRITE_FD.store(fds[1], Ordering::Relaxed);
        // SAFETY: installing a handler that only calls write(2).
        unsafe {
            let handler = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
            libc::signal(libc::SIGINT, handler);
            libc::signal(libc::SIGTERM, handler);
            libc::signal(libc::SIGPIPE, libc::SIG_IGN);
        }
        Ok(SignalPipe { read_fd: fds[0] })
    }

    pub fn fd(&self) -> RawFd {
        self.read_fd
    }

    /// Reads what the handler wrote; true if a signal arrived.
    pub fn drain(&self) -> bool {
        let mut buf = [0u8; 64];
        let mut got = false;
        loop {
            // SAFETY: reading into a local buffer from our own pipe.
            let n = unsafe { libc::read(self.read_fd, buf.as_mut_ptr().cast(), buf.len()) };
            if n <= 0 {
                return got;
            }
            got = true;
        }
    }
}
