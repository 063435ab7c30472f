//! The keys a server accepts, each naming a principal.
//!
//! A daemon with one key (the RM, the agents) has a keyring of one entry. maru-server
//! has one entry per tenant (and its own key, the `default` tenant): a client names
//! the key it is about to prove by its [id](SharedKey::id) in its hello, the server
//! proves that key back and checks the client's proof with it, and the connection is
//! then the principal of that key's name. The name comes from the server's own
//! configuration, never from the client: a client that names a key it does not hold
//! fails the proof.
//!
//! A `Keyring` is a shared handle: the loop's handshakes read it, and the daemon may
//! replace its entries (maru-server reloading its tenants file). A replace counts a
//! new [generation](Keyring::generation): the loop then closes every connection whose
//! key is no longer [in force](Keyring::in_force) (a key removed or changed ends what
//! it proved).
//!
//! Each name may also carry a limit on its connections ([`Keyring::connection_limit`]):
//! the loop's share of `max_connections` for that key's connections.

use super::SharedKey;
use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

/// The name of the only key of a keyring made with [`Keyring::single`].
pub const DEFAULT_KEY_NAME: &str = "default";

struct Entry {
    name: String,
    id: String,
    key: SharedKey,
}

#[derive(Default)]
struct Ring {
    entries: Vec<Entry>,
    /// Connections a name may hold, where its configuration says.
    limits: HashMap<String, usize>,
}

/// Named keys (see the module docs). Cloning shares the entries.
#[derive(Clone)]
pub struct Keyring {
    ring: Arc<RwLock<Ring>>,
    generation: Arc<AtomicU64>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyringError {
    /// Two entries with one name.
    #[error("the key name {0:?} is given twice")]
    DuplicateName(String),
    /// Two names with the same key: a client proving it could not be told apart.
    #[error(
        "{first:?} and {second:?} have the same key: give each its own key file \
             (maru-rm-ctl gen-key)"
    )]
    SameKey { first: String, second: String },
    /// A keyring needs at least one key.
    #[error("no key")]
    Empty,
}

/// Why no key of the ring fits a hello.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NoKey {
    /// The hello names a key this server does not hold.
    #[error("the client's key (id {}) is not one this server accepts: check the key file, \
         or that its tenant is in the server's tenants file", crate::net::clip(.0))]
    Unknown(String),
    /// The hello names no key and the ring holds several.
    #[error(
        "this server accepts {keys} keys and the client named none (key_id): \
         upgrade the client"
    )]
    Unnamed { keys: usize },
}

fn build(named: Vec<(String, SharedKey)>) -> Result<Vec<Entry>, KeyringError> {
    if named.is_empty() {
        return Err(KeyringError::Empty);
    }
    let mut out: Vec<Entry> = Vec::with_capacity(named.len());
    for (name, key) in named {
        if out.iter().any(|e| e.name == name) {
            return Err(KeyringError::DuplicateName(name));
        }
        let id = key.id();
        if let Some(e) = out
            .iter()
            .find(|e| e.id == id && crate::auth::ct_eq(e.key.bytes(), key.bytes()))
        {
            return Err(KeyringError::SameKey {
                first: e.name.clone(),
                second: name,
            });
        }
        out.push(Entry { name, id, key });
    }
    Ok(out)
}

impl Keyring {
    /// One key, named [`DEFAULT_KEY_NAME`].
    pub fn single(key: SharedKey) -> Keyring {
        let id = key.id();
        Keyring::of(vec![Entry {
            name: DEFAULT_KEY_NAME.to_string(),
            id,
            key,
        }])
    }

    fn of(entries: Vec<Entry>) -> Keyring {
        Keyring {
            ring: Arc::new(RwLock::new(Ring {
                entries,
                limits: HashMap::new(),
            })),
            generation: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Named keys; names and keys must be distinct.
    pub fn new(named: Vec<(String, SharedKey)>) -> Result<Keyring, KeyringError> {
        Ok(Keyring::of(build(named)?))
    }

    /// Replaces the entries (for every holder of this handle). On an error the old
    /// entries stay.
    pub fn replace(&self, named: Vec<(String, SharedKey)>) -> Result<(), KeyringError> {
        self.replace_limited(named, HashMap::new())
    }

    /// Replaces the entries and the connection limits of their names (see
    /// [`connection_limit`](Self::connection_limit)). On an error the old ones stay.
    pub fn replace_limited(
        &self,
        named: Vec<(String, SharedKey)>,
        limits: HashMap<String, usize>,
    ) -> Result<(), KeyringError> {
        let entries = build(named)?;
        let new = Ring { entries, limits };
        match self.ring.write() {
            Ok(mut e) => *e = new,
            Err(poisoned) => *poisoned.into_inner() = new,
        }
        self.generation.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }

    /// Counts replaces: a holder that saw another generation looks again at which
    /// keys are in force.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::SeqCst)
    }

    /// Whether the key of id `key_id` is still in the ring under `name` (a key
    /// removed, or its name given another key, is not).
    pub fn in_force(&self, name: &str, key_id: &str) -> bool {
        self.read()
            .entries
            .iter()
            .any(|e| e.name == name && crate::auth::ct_eq(e.id.as_bytes(), key_id.as_bytes()))
    }

    /// The connections the name's configuration allows it, if it says.
    pub fn connection_limit(&self, name: &str) -> Option<usize> {
        self.read().limits.get(name).copied()
    }

    /// The connection limits given, summed, and how many names have one.
    pub fn connection_limits(&self) -> (usize, usize) {
        let r = self.read();
        let named = r
            .limits
            .keys()
            .filter(|n| r.entries.iter().any(|e| &e.name == *n));
        named.fold((0, 0), |(sum, n), name| {
            (sum.saturating_add(r.limits[name]), n + 1)
        })
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Ring> {
        self.ring.read().unwrap_or_else(|p| p.into_inner())
    }

    pub fn len(&self) -> usize {
        self.read().entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.read().entries.is_empty()
    }

    /// The names, in order.
    pub fn names(&self) -> Vec<String> {
        self.read().entries.iter().map(|e| e.name.clone()).collect()
    }

    /// The key a hello names by `key_id` (its name and the key). A one-key ring
    /// answers with its key whatever the hello names (or none, for clients that
    /// predate key ids): the proof then tells a client with another key, as it always
    /// did ("the peer does not hold the same key file").
    pub fn find(&self, key_id: Option<&str>) -> Result<(String, SharedKey), NoKey> {
        let ring = self.read();
        let entries = &ring.entries;
        let found = match (key_id, entries.as_slice()) {
            (_, [only]) => only,
            (Some(id), _) => entries
                .iter()
                .find(|e| crate::auth::ct_eq(e.id.as_bytes(), id.as_bytes()))
                .ok_or_else(|| NoKey::Unknown(id.to_string()))?,
            (None, _) => {
                return Err(NoKey::Unnamed {
                    keys: entries.len(),
                })
            }
        };
        Ok((found.name.clone(), found.key.clone()))
    }
}

impl fmt::Debug for Keyring {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Keyring({:?})", self.names())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(b: u8) -> SharedKey {
        SharedKey::from_bytes(vec![b; 32]).unwrap()
    }

    #[test]
    fn a_key_is_found_by_its_id_and_named_by_the_ring() {
        let ring = Keyring::new(vec![("alpha".into(), key(1)), ("beta".into(), key(2))]).unwrap();
        let (name, k) = ring.find(Some(&key(2).id())).unwrap();
        assert_eq!(name, "beta");
        assert_eq!(k.bytes(), key(2).bytes());
        assert!(matches!(
            ring.find(Some(&key(3).id())),
            Err(NoKey::Unknown(_))
        ));
        assert_eq!(ring.find(None).unwrap_err(), NoKey::Unnamed { keys: 2 });
        // A one-key ring proves its key to whoever asks: clients that name no key, and
        // clients with another key, which then fail the proof as before key ids.
        let one = Keyring::single(key(1));
        assert_eq!(one.find(None).unwrap().0, DEFAULT_KEY_NAME);
        assert_eq!(
            one.find(Some(&key(2).id())).unwrap().1.bytes(),
            key(1).bytes()
        );
    }

    #[test]
    fn ids_differ_per_key_and_reveal_no_bytes() {
        assert_ne!(key(1).id(), key(2).id());
        assert_eq!(key(1).id(), key(1).id());
        assert_eq!(key(1).id().len(), 16);
        assert!(!key(1).id().contains(&crate::auth::to_hex(&[1u8; 4])));
    }

    #[test]
    fn names_and_keys_must_be_distinct_and_a_bad_replace_keeps_the_old_ring() {
        assert_eq!(
            Keyring::new(vec![("a".into(), key(1)), ("a".into(), key(2))]).unwrap_err(),
            KeyringError::DuplicateName("a".into())
        );
        assert!(matches!(
            Keyring::new(vec![("a".into(), key(1)), ("b".into(), key(1))]),
            Err(KeyringError::SameKey { .. })
        ));
        assert_eq!(Keyring::new(vec![]).unwrap_err(), KeyringError::Empty);
        let ring = Keyring::single(key(1));
        let shared = ring.clone();
        ring.replace(vec![("t".into(), key(5))]).unwrap();
        assert_eq!(shared.names(), ["t"], "every holder sees the new entries");
        assert!(ring.replace(vec![]).is_err());
        assert_eq!(shared.names(), ["t"]);
    }

    #[test]
    fn a_replace_counts_a_generation_and_ends_keys_no_longer_in_force() {
        let ring = Keyring::new(vec![("alpha".into(), key(1)), ("beta".into(), key(2))]).unwrap();
        let g = ring.generation();
        assert!(ring.in_force("beta", &key(2).id()));
        assert!(
            !ring.in_force("alpha", &key(2).id()),
            "a key under another name"
        );
        // beta's key rotated, gamma added with a limit.
        ring.replace_limited(
            vec![
                ("alpha".into(), key(1)),
                ("beta".into(), key(3)),
                ("gamma".into(), key(4)),
            ],
            HashMap::from([("gamma".to_string(), 7), ("nobody".to_string(), 9)]),
        )
        .unwrap();
        assert!(ring.generation() > g);
        assert!(ring.in_force("alpha", &key(1).id()));
        assert!(!ring.in_force("beta", &key(2).id()), "the old key of beta");
        assert!(ring.in_force("beta", &key(3).id()));
        assert_eq!(ring.connection_limit("gamma"), Some(7));
        assert_eq!(ring.connection_limit("alpha"), None);
        assert_eq!(
            ring.connection_limits(),
            (7, 1),
            "limits of names in the ring only"
        );
        // A failed replace changes nothing, generation included.
        let g = ring.generation();
        assert!(ring.replace(vec![]).is_err());
        assert_eq!(ring.generation(), g);
    }
}
