//! The status code every fallible C function returns, and the one table from
//! libmaru's errors (a daemon's [`ErrorCode`], the worker's [`WorkerError`]) to it.

use crate::wire::ErrorCode;
use crate::worker::WorkerError;

/// The result of a libmaru call.
///
/// The values are stable: a code keeps its number for the life of the ABI and a
/// number is never reused for another meaning. New codes may be added, so treat
/// an unknown value like `MARU_ERR_INTERNAL`. Whenever a call returns anything
/// but `MARU_OK`, `maru_last_error()` on the same thread says what failed.
#[allow(non_camel_case_types)]
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum maru_status_t {
    /// Success. The thread's last error is cleared.
    MARU_OK = 0,
    /// A required pointer argument was NULL; the message names the argument.
    MARU_ERR_NULL_ARGUMENT = 1,
    /// An argument was out of range or malformed (bad UTF-8, zero length, unknown
    /// key, a request the service rejected as invalid).
    MARU_ERR_INVALID_ARGUMENT = 2,
    /// The configuration is invalid or names something that does not exist.
    /// Retrying does not help: fix the configuration.
    MARU_ERR_CONFIG = 3,
    /// A service or device is unreachable or temporarily unable to serve.
    /// Transient: retrying later may succeed.
    MARU_ERR_UNAVAILABLE = 4,
    /// The key, region or pool asked for does not exist.
    MARU_ERR_NOT_FOUND = 5,
    /// The service definitively refused the request: nothing was done and
    /// nothing is held on the caller's behalf.
    MARU_ERR_REFUSED = 6,
    /// No space: no pool, region or staging slot can hold the request now.
    MARU_ERR_NO_SPACE = 7,
    /// The operation did not finish within its deadline; its outcome is unknown.
    MARU_ERR_TIMEOUT = 8,
    /// Authentication or authorization failed (wrong key proof, wrong token,
    /// not the owner).
    MARU_ERR_AUTH = 9,
    /// A peer broke the protocol or speaks an incompatible version.
    MARU_ERR_PROTOCOL = 10,
    /// An operating-system I/O call failed; the message carries the OS error.
    MARU_ERR_IO = 11,
    /// The object is in use by another operation; retry after it completes.
    MARU_ERR_BUSY = 12,
    /// The handle or connection was closed or shut down.
    MARU_ERR_CLOSED = 13,
    /// The caller's buffer is too small; the call reports the size it needs.
    MARU_ERR_BUFFER_TOO_SMALL = 14,
    /// A bug or an unexpected condition inside libmaru or a Maru daemon.
    MARU_ERR_INTERNAL = 15,
    /// Not an error: the asynchronous operation has not finished yet (from
    /// `maru_op_poll`, or `maru_op_wait` when its timeout passed). Poll or wait again.
    MARU_PENDING = 16,
    /// libmaru panicked inside this call; the panic was stopped at the boundary
    /// and its message is the last error. The handle involved should be freed.
    MARU_ERR_PANIC = 99,
}

impl maru_status_t {
    /// Every code, in numeric order.
    pub const ALL: [maru_status_t; 18] = [
        maru_status_t::MARU_OK,
        maru_status_t::MARU_ERR_NULL_ARGUMENT,
        maru_status_t::MARU_ERR_INVALID_ARGUMENT,
        maru_status_t::MARU_ERR_CONFIG,
        maru_status_t::MARU_ERR_UNAVAILABLE,
        maru_status_t::MARU_ERR_NOT_FOUND,
        maru_status_t::MARU_ERR_REFUSED,
        maru_status_t::MARU_ERR_NO_SPACE,
        maru_status_t::MARU_ERR_TIMEOUT,
        maru_status_t::MARU_ERR_AUTH,
        maru_status_t::MARU_ERR_PROTOCOL,
        maru_status_t::MARU_ERR_IO,
        maru_status_t::MARU_ERR_BUSY,
        maru_status_t::MARU_ERR_CLOSED,
        maru_status_t::MARU_ERR_BUFFER_TOO_SMALL,
        maru_status_t::MARU_ERR_INTERNAL,
        maru_status_t::MARU_PENDING,
        maru_status_t::MARU_ERR_PANIC,
    ];

    /// The code for a raw value from C, if it is one we know. C may pass any
    /// integer, so a raw value is never transmuted into the enum.
    pub fn from_raw(raw: u32) -> Option<maru_status_t> {
        maru_status_t::ALL.into_iter().find(|s| *s as u32 == raw)
    }

    /// A short, static, NUL-terminated description of the code.
    pub fn description(self) -> &'static std::ffi::CStr {
        match self {
            maru_status_t::MARU_OK => c"ok",
            maru_status_t::MARU_ERR_NULL_ARGUMENT => c"null argument",
            maru_status_t::MARU_ERR_INVALID_ARGUMENT => c"invalid argument",
            maru_status_t::MARU_ERR_CONFIG => c"configuration error",
            maru_status_t::MARU_ERR_UNAVAILABLE => c"unavailable",
            maru_status_t::MARU_ERR_NOT_FOUND => c"not found",
            maru_status_t::MARU_ERR_REFUSED => c"refused",
            maru_status_t::MARU_ERR_NO_SPACE => c"no space",
            maru_status_t::MARU_ERR_TIMEOUT => c"timed out",
            maru_status_t::MARU_ERR_AUTH => c"authentication failed",
            maru_status_t::MARU_ERR_PROTOCOL => c"protocol error",
            maru_status_t::MARU_ERR_IO => c"I/O error",
            maru_status_t::MARU_ERR_BUSY => c"busy",
            maru_status_t::MARU_ERR_CLOSED => c"closed",
            maru_status_t::MARU_ERR_BUFFER_TOO_SMALL => c"buffer too small",
            maru_status_t::MARU_ERR_INTERNAL => c"internal error",
            maru_status_t::MARU_PENDING => c"pending",
            maru_status_t::MARU_ERR_PANIC => c"panic inside libmaru",
        }
    }
}

impl From<ErrorCode> for maru_status_t {
    /// The status a C caller sees for an error a daemon sent back.
    fn from(code: ErrorCode) -> maru_status_t {
        match code {
            ErrorCode::Refused => maru_status_t::MARU_ERR_REFUSED,
            ErrorCode::BadRequest => maru_status_t::MARU_ERR_INVALID_ARGUMENT,
            ErrorCode::Protocol | ErrorCode::Version | ErrorCode::Unsupported => {
                maru_status_t::MARU_ERR_PROTOCOL
            }
            ErrorCode::Auth | ErrorCode::Permission => maru_status_t::MARU_ERR_AUTH,
            ErrorCode::NoSpace => maru_status_t::MARU_ERR_NO_SPACE,
            ErrorCode::NoPool => maru_status_t::MARU_ERR_NOT_FOUND,
            // The change is not yet durable at the daemon; retrying is the cure.
            ErrorCode::Storage => maru_status_t::MARU_ERR_UNAVAILABLE,
            ErrorCode::Internal => maru_status_t::MARU_ERR_INTERNAL,
            // A session gone: a new one is opened (as `SessionLost`, below).
            ErrorCode::NoSession => maru_status_t::MARU_ERR_UNAVAILABLE,
        }
    }
}

impl From<&WorkerError> for maru_status_t {
    /// The status a C caller sees for an error of the data path.
    fn from(e: &WorkerError) -> maru_status_t {
        match e {
            WorkerError::Config(_) => maru_status_t::MARU_ERR_CONFIG,
            WorkerError::InvalidArgument(_) => maru_status_t::MARU_ERR_INVALID_ARGUMENT,
            WorkerError::Unavailable { .. } => maru_status_t::MARU_ERR_UNAVAILABLE,
            // A new session is opened in the background: transient.
            WorkerError::SessionLost { .. } => maru_status_t::MARU_ERR_UNAVAILABLE,
            // As a daemon's `auth` and `permission` codes (above).
            WorkerError::Auth { .. } | WorkerError::Permission { .. } => {
                maru_status_t::MARU_ERR_AUTH
            }
            WorkerError::Refused { .. } => maru_status_t::MARU_ERR_REFUSED,
            WorkerError::NoSpace(_) => maru_status_t::MARU_ERR_NO_SPACE,
            WorkerError::Timeout(_) => maru_status_t::MARU_ERR_TIMEOUT,
            WorkerError::Transport(_) => maru_status_t::MARU_ERR_IO,
            WorkerError::Busy(_) => maru_status_t::MARU_ERR_BUSY,
            WorkerError::Closed => maru_status_t::MARU_ERR_CLOSED,
        }
    }
}

impl From<WorkerError> for FfiError {
    fn from(e: WorkerError) -> FfiError {
        (maru_status_t::from(&e), e.to_string())
    }
}

/// What a failed exported body reports: the status C sees and the message
/// `maru_last_error()` gives (what failed, on what, and what to do about it).
pub type FfiError = (maru_status_t, String);

/// A status value as C passes it in: any 32-bit integer, so never transmuted into
/// [`maru_status_t`]. The header spells it `maru_status_t` (cbindgen.toml renames it).
#[repr(transparent)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StatusArg(pub u32);

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn values_are_stable() {
        let expected: [(maru_status_t, u32); 18] = [
            (maru_status_t::MARU_OK, 0),
            (maru_status_t::MARU_ERR_NULL_ARGUMENT, 1),
            (maru_status_t::MARU_ERR_INVALID_ARGUMENT, 2),
            (maru_status_t::MARU_ERR_CONFIG, 3),
            (maru_status_t::MARU_ERR_UNAVAILABLE, 4),
            (maru_status_t::MARU_ERR_NOT_FOUND, 5),
            (maru_status_t::MARU_ERR_REFUSED, 6),
            (maru_status_t::MARU_ERR_NO_SPACE, 7),
            (maru_status_t::MARU_ERR_TIMEOUT, 8),
            (maru_status_t::MARU_ERR_AUTH, 9),
            (maru_status_t::MARU_ERR_PROTOCOL, 10),
            (maru_status_t::MARU_ERR_IO, 11),
            (maru_status_t::MARU_ERR_BUSY, 12),
            (maru_status_t::MARU_ERR_CLOSED, 13),
            (maru_status_t::MARU_ERR_BUFFER_TOO_SMALL, 14),
            (maru_status_t::MARU_ERR_INTERNAL, 15),
            (maru_status_t::MARU_PENDING, 16),
            (maru_status_t::MARU_ERR_PANIC, 99),
        ];
        for (status, raw) in expected {
            assert_eq!(status as u32, raw, "{status:?}");
            assert_eq!(maru_status_t::from_raw(raw), Some(status));
        }
        assert_eq!(maru_status_t::from_raw(17), None);
        assert_eq!(maru_status_t::from_raw(u32::MAX), None);
    }

    #[test]
    fn descriptions_are_distinct() {
        let all: HashSet<_> = maru_status_t::ALL.iter().map(|s| s.description()).collect();
        assert_eq!(all.len(), maru_status_t::ALL.len());
    }

    #[test]
    fn only_refused_maps_to_refused() {
        let codes = [
            ErrorCode::Refused,
            ErrorCode::BadRequest,
            ErrorCode::Protocol,
            ErrorCode::Version,
            ErrorCode::Auth,
            ErrorCode::Permission,
            ErrorCode::NoSpace,
            ErrorCode::NoPool,
            ErrorCode::Storage,
            ErrorCode::Unsupported,
            ErrorCode::Internal,
        ];
        for code in codes {
            let status = maru_status_t::from(code);
            assert_ne!(status, maru_status_t::MARU_OK, "{code:?}");
            assert_eq!(
                status == maru_status_t::MARU_ERR_REFUSED,
                code == ErrorCode::Refused,
                "{code:?}"
            );
        }
    }

    /// A key that does not prove reaches a C caller as MARU_ERR_AUTH, whichever
    /// daemon it was (it used to be a refusal or a configuration error).
    #[test]
    fn a_failed_key_proof_is_auth_and_a_lost_session_unavailable() {
        use crate::worker::Peer;
        let agent = Peer::Agent("10.0.0.2:9860".into());
        let server = Peer::Server("10.0.0.1:5555".into());
        for (e, want) in [
            (
                WorkerError::Auth {
                    peer: agent.clone(),
                    reason: "key".into(),
                },
                maru_status_t::MARU_ERR_AUTH,
            ),
            (
                WorkerError::Permission {
                    peer: server.clone(),
                    reason: "not yours".into(),
                },
                maru_status_t::MARU_ERR_AUTH,
            ),
            (
                WorkerError::Refused {
                    peer: server,
                    reason: "no".into(),
                },
                maru_status_t::MARU_ERR_REFUSED,
            ),
            (
                WorkerError::SessionLost {
                    url: "10.0.0.1:5555".into(),
                    session: 3,
                    reason: "expired".into(),
                },
                maru_status_t::MARU_ERR_UNAVAILABLE,
            ),
        ] {
            assert_eq!(maru_status_t::from(&e), want, "{e}");
        }
    }
}
