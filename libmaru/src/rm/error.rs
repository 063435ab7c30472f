//! Why a resource manager could not start.

use super::secret::SecretError;
use super::store::PersistError;
use std::fmt;

#[derive(Debug)]
pub enum RmError {
    /// The state could not be loaded.
    Persist(PersistError),
    /// The token secret could not be loaded or created.
    Secret(SecretError),
    /// Two pools carry the same device UUID: regions could not be told apart.
    DuplicatePool {
        uuid: String,
        first: String,
        second: String,
    },
    /// The loaded state contradicts itself or the pools (overlapping regions, a
    /// region outside its pool, a hold of an unknown region).
    Inconsistent(String),
}

impl fmt::Display for RmError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RmError::Persist(e) => write!(f, "cannot load the RM state: {e}"),
            RmError::Secret(e) => e.fmt(f),
            RmError::DuplicatePool {
                uuid,
                first,
                second,
            } => write!(
                f,
                "pools {first} and {second} carry the same UUID {uuid}; re-initialise the \
                 header of one of them (a copied device image keeps its UUID)"
            ),
            RmError::Inconsistent(why) => write!(
                f,
                "the RM state is inconsistent: {why}; fix the state file or move it away \
                 (its regions are then forgotten)"
            ),
        }
    }
}

impl std::error::Error for RmError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            RmError::Persist(e) => Some(e),
            RmError::Secret(e) => Some(e),
            _ => None,
        }
    }
}

impl From<PersistError> for RmError {
    fn from(e: PersistError) -> RmError {
        RmError::Persist(e)
    }
}

impl From<SecretError> for RmError {
    fn from(e: SecretError) -> RmError {
        RmError::Secret(e)
    }
}
