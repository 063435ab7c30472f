//! Errors of the worker data path, typed: what failed, at which daemon, and so what a
//! caller can decide on. Converted once at the C boundary (`ffi::status`). A daemon's
//! error comes in through [`WorkerError::from_link`]; [`WorkerError::SessionLost`] is
//! the only one that sets a pool aside (`handler::pools`).

use crate::net::LinkError;
use crate::wire::{ErrorCode, WireError};
use std::fmt;

/// The daemon (or the host) an error comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Peer {
    /// maru-server at this URL.
    Server(String),
    /// A remote CXL agent at this address.
    Agent(String),
    /// This host (a thread or a buffer that could not be had).
    Host,
}

impl fmt::Display for Peer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Peer::Server(url) => write!(f, "maru-server at {url}"),
            Peer::Agent(addr) => write!(f, "agent {addr}"),
            Peer::Host => f.write_str("this host"),
        }
    }
}

/// What went wrong (`thiserror`: each variant's message next to it).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WorkerError {
    /// The configuration is wrong: fix it (never retried).
    #[error("configuration error: {0}")]
    Config(String),
    /// A bad argument from the caller (a chunk larger than a page, an empty key).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A daemon could not be reached, or a call's outcome is unknown; retried.
    #[error("{peer} is unavailable: {reason}")]
    Unavailable { peer: Peer, reason: String },
    /// The session at maru-server is gone: the pool is set aside and a new session
    /// opened in the background.
    #[error("session {session} at maru-server {url} is lost: {reason}")]
    SessionLost {
        url: String,
        session: u64,
        reason: String,
    },
    /// A key proof failed, ours or the daemon's: check the key file named.
    #[error("authentication with {peer} failed: {reason}")]
    Auth { peer: Peer, reason: String },
    /// The daemon does not let this client do that (not the owner, not its session).
    #[error("{peer} does not allow it: {reason}")]
    Permission { peer: Peer, reason: String },
    /// A daemon refused, definitively: nothing was done.
    #[error("{peer} refused: {reason}")]
    Refused { peer: Peer, reason: String },
    /// No room (no staging slot, no region).
    #[error("no space: {0}")]
    NoSpace(String),
    /// A transfer did not finish in time (its slots are kept until the peer is fenced).
    #[error("timeout: {0}")]
    Timeout(String),
    /// A transfer or protocol failure.
    #[error("transfer failed: {0}")]
    Transport(String),
    /// The object is in use by another operation.
    #[error("busy: {0}")]
    Busy(String),
    /// The handler is closed.
    #[error("the handler is closed")]
    Closed,
}

impl WorkerError {
    /// `peer` could not be reached (or did not answer in time).
    pub fn unavailable(peer: Peer, reason: impl Into<String>) -> WorkerError {
        WorkerError::Unavailable {
            peer,
            reason: reason.into(),
        }
    }

    /// A call to `peer` failed with `e`.
    pub fn from_link(peer: Peer, e: LinkError) -> WorkerError {
        match e {
            LinkError::Remote(w) => WorkerError::from_wire(peer, w),
            LinkError::Unreachable(reason) => WorkerError::Unavailable { peer, reason },
            LinkError::Auth(reason) => WorkerError::Auth { peer, reason },
            LinkError::Rejected(m) => WorkerError::Config(format!("{peer}: {m}")),
        }
    }

    /// `peer` answered with the error `e`.
    pub fn from_wire(peer: Peer, e: WireError) -> WorkerError {
        let reason = e.message;
        match e.code {
            // A session call maps this to `SessionLost` (`Session::call`, which
            // knows the session); elsewhere it is a refusal.
            ErrorCode::Refused | ErrorCode::NoSession => WorkerError::Refused { peer, reason },
            ErrorCode::Permission => WorkerError::Permission { peer, reason },
            ErrorCode::Auth => WorkerError::Auth { peer, reason },
            ErrorCode::NoSpace | ErrorCode::NoPool => WorkerError::NoSpace(reason),
            ErrorCode::BadRequest => WorkerError::InvalidArgument(format!("{peer}: {reason}")),
            ErrorCode::Unsupported | ErrorCode::Version => {
                WorkerError::Config(format!("{peer}: {reason}"))
            }
            ErrorCode::Protocol | ErrorCode::Storage | ErrorCode::Internal => {
                WorkerError::Unavailable { peer, reason }
            }
        }
    }

    /// True for an error only the caller can fix (a configuration, a key): such an
    /// error fails a handler's open at once, and is not retried in the background.
    pub fn is_fatal(&self) -> bool {
        matches!(
            self,
            WorkerError::Config(_) | WorkerError::Auth { .. } | WorkerError::Permission { .. }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wire(code: ErrorCode) -> LinkError {
        LinkError::Remote(WireError::new(code, "why"))
    }

    #[test]
    fn authentication_and_permission_do_not_collapse_into_a_refusal() {
        let s = || Peer::Server("10.0.0.1:9870".into());
        assert!(matches!(
            WorkerError::from_link(s(), wire(ErrorCode::Auth)),
            WorkerError::Auth { .. }
        ));
        assert!(matches!(
            WorkerError::from_link(s(), LinkError::Auth("the server rejected our proof".into())),
            WorkerError::Auth { .. }
        ));
        assert!(matches!(
            WorkerError::from_link(s(), wire(ErrorCode::Permission)),
            WorkerError::Permission { .. }
        ));
        assert!(matches!(
            WorkerError::from_link(s(), wire(ErrorCode::Refused)),
            WorkerError::Refused { .. }
        ));
        let e = WorkerError::from_link(Peer::Agent("10.0.0.2:9860".into()), wire(ErrorCode::Auth));
        assert_eq!(
            e.to_string(),
            "authentication with agent 10.0.0.2:9860 failed: why"
        );
        assert!(e.is_fatal());
    }

    #[test]
    fn a_refusal_is_not_fatal() {
        let server = WorkerError::from_link(Peer::Server("s:1".into()), wire(ErrorCode::Refused));
        assert!(!server.is_fatal());
    }
}
