//! Errors of the worker data path, converted once at the C boundary into status codes.

use crate::net::LinkError;
use crate::wire::{ErrorCode, WireError};
use std::fmt;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WorkerError {
    /// The configuration is wrong: fix it (never retried).
    Config(String),
    /// A bad argument from the caller (a chunk larger than a page, an empty key).
    InvalidArgument(String),
    /// A pool (maru-server, agent or RM) cannot be reached now; retried in the background.
    Unavailable(String),
    /// A daemon refused (definitively).
    Refused(String),
    /// No room (no staging slot, no region).
    NoSpace(String),
    /// A transfer did not finish in time (its slots are kept until the peer is fenced).
    Timeout(String),
    /// A transfer or protocol failure.
    Transport(String),
    /// The object is in use by another operation.
    Busy(String),
    /// The handler is closed.
    Closed,
}

impl fmt::Display for WorkerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WorkerError::Config(m) => write!(f, "configuration error: {m}"),
            WorkerError::InvalidArgument(m) => write!(f, "invalid argument: {m}"),
            WorkerError::Unavailable(m) => write!(f, "unavailable: {m}"),
            WorkerError::Refused(m) => write!(f, "refused: {m}"),
            WorkerError::NoSpace(m) => write!(f, "no space: {m}"),
            WorkerError::Timeout(m) => write!(f, "timeout: {m}"),
            WorkerError::Transport(m) => write!(f, "transfer failed: {m}"),
            WorkerError::Busy(m) => write!(f, "busy: {m}"),
            WorkerError::Closed => write!(f, "the handler is closed"),
        }
    }
}

impl std::error::Error for WorkerError {}

impl From<WireError> for WorkerError {
    fn from(e: WireError) -> WorkerError {
        match e.code {
            ErrorCode::Refused | ErrorCode::Permission | ErrorCode::Auth => {
                WorkerError::Refused(e.message)
            }
            ErrorCode::NoSpace | ErrorCode::NoPool => WorkerError::NoSpace(e.message),
            ErrorCode::BadRequest => WorkerError::InvalidArgument(e.message),
            ErrorCode::Unsupported | ErrorCode::Version => WorkerError::Config(e.message),
            _ => WorkerError::Unavailable(e.message),
        }
    }
}

impl From<LinkError> for WorkerError {
    fn from(e: LinkError) -> WorkerError {
        match e {
            LinkError::Remote(w) => w.into(),
            LinkError::Unreachable(m) => WorkerError::Unavailable(m),
            LinkError::Rejected(m) => WorkerError::Config(m),
        }
    }
}
