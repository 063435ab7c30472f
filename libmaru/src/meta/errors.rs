//! Wire errors of the metadata core, built in one place so each code means one
//! thing: `refused` (definitively not done, nothing held: an unknown or ended
//! session, a region that can never be allocated, the lease or session limit),
//! `bad_request` (malformed input: nothing changed), `permission` (another session's
//! region or lease: nothing changed), `no_space` (the RM has no room now: retry),
//! `unsupported` (not configured here), `internal` (the RM could not be reached, or
//! an inconsistency: retry), `no_session` (the session named is not open here:
//! unknown, expired, closed or another client's; nothing was done).

use super::leases::LeaseError;
use super::sessions::SessionError;
use crate::wire::meta::{MAX_BATCH, MAX_KEY_LEN};
use crate::wire::{ErrorCode, WireError};

/// One constructor per error code the core answers with: `refused(m)` is the
/// [`ErrorCode::Refused`] error saying `m`, and so on.
macro_rules! code_errors {
    ($($name:ident => $code:ident),* $(,)?) => {
        $(
            pub(super) fn $name(m: impl Into<String>) -> WireError {
                WireError::new(ErrorCode::$code, m)
            }
        )*
    };
}

code_errors! {
    refused => Refused,
    bad_request => BadRequest,
    permission => Permission,
    no_space => NoSpace,
    unsupported => Unsupported,
    internal => Internal,
}

/// A batch larger than [`MAX_BATCH`] is refused whole.
pub(super) fn check_batch(what: &str, n: usize) -> Result<(), WireError> {
    if n > MAX_BATCH {
        return Err(bad_request(format!(
            "{n} {what} in one request; at most {MAX_BATCH} are taken: split the batch"
        )));
    }
    Ok(())
}

pub(super) fn check_key(key: &str) -> Result<(), WireError> {
    if key.is_empty() || key.len() > MAX_KEY_LEN {
        let shown: String = key.chars().take(64).collect();
        return Err(bad_request(format!(
            "key {shown:?} ({} bytes) must be 1 to {MAX_KEY_LEN} bytes",
            key.len()
        )));
    }
    Ok(())
}

pub(super) fn check_keys(keys: &[crate::wire::meta::Text<'_>]) -> Result<(), WireError> {
    check_batch("keys", keys.len())?;
    keys.iter().try_for_each(|k| check_key(k))
}

/// A session that is not open here: its client opens a new one.
pub(super) fn no_session(m: impl Into<String>) -> WireError {
    WireError::new(ErrorCode::NoSession, m)
}

impl From<SessionError> for WireError {
    fn from(e: SessionError) -> WireError {
        match e {
            // The client's session is gone: a code of its own, so the client knows
            // without asking again (a heartbeat) that it must open a new one.
            SessionError::Unknown { .. }
            | SessionError::Ended { .. }
            | SessionError::NotYours { .. } => no_session(e.to_string()),
            SessionError::Full { .. } => refused(e.to_string()),
        }
    }
}

impl From<LeaseError> for WireError {
    fn from(e: LeaseError) -> WireError {
        match e {
            LeaseError::Limit { .. } => refused(e.to_string()),
            LeaseError::NotYours { .. } => permission(e.to_string()),
        }
    }
}
