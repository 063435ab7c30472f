//! SIGINT/SIGTERM as an event: `signal-hook` writes a byte to a socket pair that the
//! event loop polls (its self-pipe pattern: the handler does nothing but that write,
//! which is async-signal-safe), so a daemon stops cleanly (saving state) without
//! waking up to check a flag.

use std::io::{ErrorKind, Read};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;

/// The read end of the signal pipe. Create it once per process.
pub struct SignalPipe {
    read: UnixStream,
}

impl SignalPipe {
    /// Installs handlers for SIGINT and SIGTERM and ignores SIGPIPE.
    pub fn install() -> std::io::Result<SignalPipe> {
        let (read, write) = UnixStream::pair()?;
        read.set_nonblocking(true)?;
        signal_hook::low_level::pipe::register(libc::SIGINT, write.try_clone()?)?;
        signal_hook::low_level::pipe::register(libc::SIGTERM, write)?;
        // A peer that went away is an error on the write, not the end of the daemon.
        // SAFETY: setting a signal's disposition to ignored runs no code of ours.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_IGN);
        }
        Ok(SignalPipe { read })
    }

    pub fn fd(&self) -> RawFd {
        self.read.as_raw_fd()
    }

    /// Reads what the handler wrote; true if a signal arrived.
    pub fn drain(&self) -> bool {
        let mut buf = [0u8; 64];
        let mut got = false;
        loop {
            match (&self.read).read(&mut buf) {
                Ok(0) => return got,
                Ok(_) => got = true,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => return got,
            }
        }
    }
}
