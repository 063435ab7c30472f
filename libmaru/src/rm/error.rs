//! Why a resource manager could not start.

use super::secret::SecretError;
use super::store::PersistError;

#[derive(Debug, thiserror::Error)]
pub enum RmError {
    /// The state could not be loaded.
    #[error("cannot load the RM state: {0}")]
    Persist(#[from] PersistError),
    /// The token secret could not be loaded or created.
    #[error("{0}")]
    Secret(#[from] SecretError),
    /// Two pools carry the same device UUID: regions could not be told apart.
    #[error(
        "pools {first} and {second} carry the same UUID {uuid}; re-initialise the header of \
         one of them (a copied device image keeps its UUID)"
    )]
    DuplicatePool {
        uuid: String,
        first: String,
        second: String,
    },
    /// The loaded state contradicts itself or the pools (overlapping regions, a
    /// region outside its pool, a hold of an unknown region).
    #[error(
        "the RM state is inconsistent: {0}; fix the state file or move it away (its regions \
         are then forgotten)"
    )]
    Inconsistent(String),
}
