//! What maru-server keeps durable of its directory, as records the core emits
//! ([`MetaCore::take_changes`](super::MetaCore::take_changes)) and rebuilds itself
//! from ([`MetaCore::restore`](super::MetaCore::restore)).
//!
//! The core never writes: it hands out batches of records, numbered in order, and
//! learns from its driver which batch is durable
//! ([`MetaCore::durable`](super::MetaCore::durable)). A batch holds the latest state
//! of what changed since the one before (a key, a region with its allocated pages, a
//! session), so applying the batches in order to a table per kind gives the
//! directory as of the last durable batch.
//!
//! Keys are the bulk (one per stored chunk) and are encoded in a small binary form
//! ([`encode_key`], [`decode_key`]); regions and sessions, a few hundred at most, as
//! JSON. Decoding never panics: a record that does not decode is an error naming
//! what is wrong, which the store turns into a start error naming the file and the
//! record.

use super::tenants::Access;
use crate::wire::meta::Backend;
use crate::wire::rm::{Handle, PoolInfo};
use serde::{Deserialize, Serialize};
use std::fmt;

/// The format of the records; a store written by another format is refused.
pub const FORMAT: u32 = 1;

/// A key of the directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyRecord {
    pub id: u64,
    pub scope: u32,
    pub name: String,
    pub region_id: u64,
    pub offset: u64,
    pub length: u64,
    pub prev: Option<String>,
    /// Use stamp (eviction order: larger is more recent).
    pub used: u64,
}

/// Which sessions share keys (see `keys::Scope`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScopeRecord {
    pub id: u32,
    pub namespace: String,
    pub layout: String,
    pub backend: Backend,
}

/// Who holds a region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HolderRecord {
    Session(u64),
    Keeper,
    GivingBack,
}

/// A region maru-server holds at the RM, with the pages allocated in it (holding a
/// key, or handed to a worker that may be writing them).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionRecord {
    pub handle: Handle,
    pub pool: PoolInfo,
    pub agent: Option<String>,
    pub backend: Backend,
    pub holder: HolderRecord,
    pub boot_id: Option<String>,
    pub pages: u64,
    pub allocated: Vec<u64>,
}

/// A live storage session.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionRecord {
    pub id: u64,
    /// The owner its requests must come from (see `SessionBinding` in maru-server).
    pub owner: String,
    pub tenant: String,
    /// Its tenant writes its namespace (else reads it).
    pub writes: bool,
    pub engine_id: String,
    pub namespace: String,
    pub backend: Backend,
    pub scope: u32,
}

impl SessionRecord {
    pub fn access(&self) -> Access {
        if self.writes {
            Access::Write
        } else {
            Access::Read
        }
    }
}

/// One change of the directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Record {
    Scope(ScopeRecord),
    Session(SessionRecord),
    SessionGone(u64),
    /// The next session id to hand out (ended sessions' ids are not reused).
    NextSession(u64),
    Region(RegionRecord),
    RegionGone(u64),
    Key(KeyRecord),
    KeyGone(u64),
    /// A key was read: its new use stamp.
    Used {
        id: u64,
        used: u64,
    },
}

/// A batch of records; batches are made durable in the order of their numbers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Changes {
    pub batch: u64,
    pub records: Vec<Record>,
}

/// Everything a durable store holds, to rebuild the core from.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Image {
    pub scopes: Vec<ScopeRecord>,
    pub sessions: Vec<SessionRecord>,
    pub next_session: u64,
    pub regions: Vec<RegionRecord>,
    pub keys: Vec<KeyRecord>,
}

impl Image {
    /// Applies one batch, as a store does (tests, and stores kept in memory).
    pub fn apply(&mut self, changes: &Changes) {
        for r in &changes.records {
            match r {
                Record::Scope(s) => {
                    self.scopes.retain(|x| x.id != s.id);
                    self.scopes.push(s.clone());
                }
                Record::Session(s) => {
                    self.sessions.retain(|x| x.id != s.id);
                    self.sessions.push(s.clone());
                }
                Record::SessionGone(id) => self.sessions.retain(|x| x.id != *id),
                Record::NextSession(n) => self.next_session = *n,
                Record::Region(g) => {
                    self.regions
                        .retain(|x| x.handle.region_id != g.handle.region_id);
                    self.regions.push(g.clone());
                }
                Record::RegionGone(id) => self.regions.retain(|x| x.handle.region_id != *id),
                Record::Key(k) => {
                    self.keys.retain(|x| x.id != k.id);
                    self.keys.push(k.clone());
                }
                Record::KeyGone(id) => self.keys.retain(|x| x.id != *id),
                Record::Used { id, used } => {
                    if let Some(k) = self.keys.iter_mut().find(|k| k.id == *id) {
                        k.used = *used;
                    }
                }
            }
        }
    }
}

/// A record that does not decode, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordError(pub String);

impl fmt::Display for RecordError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RecordError {}

/// Longest name (key or previous key) a key record holds: more than any key the
/// wire accepts (`MAX_KEY_LEN`).
const MAX_NAME: usize = u16::MAX as usize;

const KEY_VERSION: u8 = 1;

/// The key record's value (its id is the table's key).
pub fn encode_key(k: &KeyRecord) -> Vec<u8> {
    let mut out = Vec::with_capacity(48 + k.name.len() + k.prev.as_ref().map_or(0, String::len));
    out.push(KEY_VERSION);
    out.extend_from_slice(&k.scope.to_le_bytes());
    for v in [k.region_id, k.offset, k.length, k.used] {
        out.extend_from_slice(&v.to_le_bytes());
    }
    put_name(&mut out, &k.name);
    match &k.prev {
        Some(p) => {
            out.push(1);
            put_name(&mut out, p);
        }
        None => out.push(0),
    }
    out
}

fn put_name(out: &mut Vec<u8>, s: &str) {
    // Names come from the wire, which bounds them far below this.
    let b = &s.as_bytes()[..s.len().min(MAX_NAME)];
    out.extend_from_slice(&(b.len() as u16).to_le_bytes());
    out.extend_from_slice(b);
}

/// Reads a key record's value; `id` is its table key.
pub fn decode_key(id: u64, bytes: &[u8]) -> Result<KeyRecord, RecordError> {
    let mut r = Reader { b: bytes, at: 0 };
    let version = r.u8("version")?;
    if version != KEY_VERSION {
        return Err(RecordError(format!(
            "key {id}: record version {version}, this maru-server reads {KEY_VERSION}"
        )));
    }
    let scope = u32::from_le_bytes(r.take::<4>("scope")?);
    let region_id = r.u64("region")?;
    let offset = r.u64("offset")?;
    let length = r.u64("length")?;
    let used = r.u64("use stamp")?;
    let name = r.name("name")?;
    let prev = match r.u8("previous-key flag")? {
        0 => None,
        1 => Some(r.name("previous key")?),
        f => {
            return Err(RecordError(format!(
                "key {id}: previous-key flag {f} is neither 0 nor 1"
            )))
        }
    };
    if r.at != bytes.len() {
        return Err(RecordError(format!(
            "key {id}: {} bytes after the record",
            bytes.len() - r.at
        )));
    }
    Ok(KeyRecord {
        id,
        scope,
        name,
        region_id,
        offset,
        length,
        prev,
        used,
    })
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn take<const N: usize>(&mut self, what: &str) -> Result<[u8; N], RecordError> {
        let end = self.at.checked_add(N).filter(|&e| e <= self.b.len());
        let Some(end) = end else {
            return Err(RecordError(format!(
                "the record ends before its {what} (byte {} of {})",
                self.at,
                self.b.len()
            )));
        };
        let mut a = [0u8; N];
        a.copy_from_slice(&self.b[self.at..end]);
        self.at = end;
        Ok(a)
    }

    fn u8(&mut self, what: &str) -> Result<u8, RecordError> {
        Ok(self.take::<1>(what)?[0])
    }

    fn u64(&mut self, what: &str) -> Result<u64, RecordError> {
        Ok(u64::from_le_bytes(self.take::<8>(what)?))
    }

    fn name(&mut self, what: &str) -> Result<String, RecordError> {
        let n = u16::from_le_bytes(self.take::<2>(what)?) as usize;
        let end = self.at.checked_add(n).filter(|&e| e <= self.b.len());
        let Some(end) = end else {
            return Err(RecordError(format!(
                "the record ends inside its {what} ({n} bytes at byte {} of {})",
                self.at,
                self.b.len()
            )));
        };
        let s = std::str::from_utf8(&self.b[self.at..end])
            .map_err(|e| RecordError(format!("its {what} is not UTF-8: {e}")))?;
        self.at = end;
        Ok(s.to_string())
    }
}

/// A JSON record (regions, sessions, scopes).
pub fn encode_json<T: Serialize>(v: &T) -> Vec<u8> {
    // These types hold strings and numbers only: serialising cannot fail.
    serde_json::to_vec(v).unwrap_or_default()
}

pub fn decode_json<T: for<'de> Deserialize<'de>>(what: &str, b: &[u8]) -> Result<T, RecordError> {
    serde_json::from_slice(b).map_err(|e| RecordError(format!("{what}: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn key(name: &str, prev: Option<&str>) -> KeyRecord {
        KeyRecord {
            id: 7,
            scope: 3,
            name: name.into(),
            region_id: 12,
            offset: 4 << 20,
            length: 1000,
            prev: prev.map(str::to_string),
            used: 99,
        }
    }

    #[test]
    fn a_key_record_reads_back_as_written() {
        for k in [key("a", None), key("ключ", Some("prev")), key("", Some(""))] {
            assert_eq!(decode_key(7, &encode_key(&k)).unwrap(), k);
        }
    }

    #[test]
    fn a_cut_or_grown_key_record_is_an_error_naming_what_is_wrong() {
        let b = encode_key(&key("abc", Some("xyz")));
        for n in 0..b.len() {
            let e = decode_key(7, &b[..n]).unwrap_err();
            assert!(e.0.contains("ends"), "{n}: {e}");
        }
        let mut long = b.clone();
        long.push(0);
        assert!(decode_key(7, &long)
            .unwrap_err()
            .0
            .contains("after the record"));
        let mut v2 = b.clone();
        v2[0] = 2;
        assert!(decode_key(7, &v2).unwrap_err().0.contains("version"));
    }

    proptest! {
        /// Any bytes decode to a record or an error, never a panic; a record that
        /// decodes encodes back to the same bytes.
        #[test]
        fn key_records_never_panic_and_round_trip(b in proptest::collection::vec(any::<u8>(), 0..200)) {
            if let Ok(k) = decode_key(1, &b) {
                prop_assert_eq!(encode_key(&k), b);
            }
        }

        #[test]
        fn written_key_records_read_back(name in ".{0,40}", prev in proptest::option::of(".{0,40}"),
                                         region in any::<u64>(), used in any::<u64>()) {
            let k = KeyRecord { id: 1, scope: 2, name, region_id: region, offset: 3, length: 4, prev, used };
            prop_assert_eq!(decode_key(1, &encode_key(&k)).unwrap(), k);
        }
    }
}
