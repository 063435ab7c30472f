//! The network layer shared by the daemons and their clients.
//!
//! [`server`] is the mio event loop every daemon runs: accept, frame, handshake
//! (version and key proof), dispatch to a [`Service`], timers, signals. A daemon is
//! a `Service`: a table of handlers over its sans-I/O core. [`client`] is the
//! blocking client the CLIs, tests and library use to talk to a daemon.

mod classes;
pub mod client;
pub mod fair;
pub mod handshake;
pub mod link;
pub mod room;
pub mod server;
#[cfg(test)]
mod server_tests;
pub mod service;
mod signals;
pub mod slots;
pub(crate) mod sockopt;
pub mod text;
pub mod throttled_log;

pub use client::{Client, ClientError, ClientOptions};
pub use link::{Link, LinkError};
pub use server::{NetCounters, Server, ServerCounts, ServerOptions};
pub use service::{ConnId, Opened, Replier, Service, MAX_DEFERRED};
pub use signals::SignalPipe;
pub use slots::{Admit, Slots, StageLimits};
pub use sockopt::recv_now;
pub use text::clip;
pub use throttled_log::ThrottledLog;

use std::time::Instant;

/// A monotonic millisecond clock, started when the daemon starts. Cores take time as
/// plain `u64` milliseconds so tests can drive them without waiting.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    start: Instant,
}

impl Clock {
    pub fn new() -> Clock {
        Clock {
            start: Instant::now(),
        }
    }

    pub fn now_ms(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }
}

impl Default for Clock {
    fn default() -> Self {
        Clock::new()
    }
}

/// The client id this process uses by default: `host:pid`.
pub fn default_client_id(prefix: &str) -> String {
    format!("{prefix}{}:{}", hostname(), std::process::id())
}

/// This host's name (from uname), or `localhost` if it cannot be read.
pub fn hostname() -> String {
    // SAFETY: utsname is plain data; uname fills it or fails.
    let mut u: libc::utsname = unsafe { std::mem::zeroed() };
    if unsafe { libc::uname(&mut u) } != 0 {
        return "localhost".into();
    }
    // SAFETY: uname NUL-terminates nodename.
    let c = unsafe { std::ffi::CStr::from_ptr(u.nodename.as_ptr()) };
    c.to_string_lossy().into_owned()
}
