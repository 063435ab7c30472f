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
//! what is wrong, which the store logs, dropping the record.
//!
//! **Every record carries a check of its own fields** (`check`: 64 bits of SHA-256
//! over them; a key's also covers the boot id of its region, so a key never outlives
//! the memory it was written in). A restore serves only records whose check holds:
//! a bit flipped in a record on disk, after a clean stop or a crash, makes it a miss,
//! never another key's bytes ([`Sealed`], [`key_check`]).

use super::tenants::Access;
use crate::wire::meta::Backend;
use crate::wire::rm::{Handle, PoolInfo};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// The format of the records. Format 2 added each record's check; a directory of
/// format 1 is sealed into format 2 at its first start
/// ([`seal_format1`](super::seal_format1)); one of any other format is refused.
pub const FORMAT: u32 = 2;

/// 64 bits of SHA-256 over `label` and `parts`, each part preceded by its length.
fn digest(label: &[u8], parts: &[&[u8]]) -> u64 {
    let mut h = Sha256::new();
    h.update(label);
    for p in parts {
        h.update((p.len() as u64).to_le_bytes());
        h.update(p);
    }
    let d = h.finalize();
    let mut b = [0u8; 8];
    b.copy_from_slice(&d[..8]);
    u64::from_le_bytes(b)
}

/// The check of key record `k` (every field but its use stamp, which changes on
/// reads and only orders eviction), bound to `boot_id`, the boot id of its region's
/// memory node when it was written.
pub fn key_check(k: &KeyRecord, boot_id: Option<&str>) -> u64 {
    let prev = k.prev.as_deref().map(str::as_bytes);
    digest(
        b"maru-key-record",
        &[
            &k.id.to_le_bytes(),
            &k.scope.to_le_bytes(),
            k.name.as_bytes(),
            &k.region_id.to_le_bytes(),
            &k.offset.to_le_bytes(),
            &k.length.to_le_bytes(),
            &[prev.is_some() as u8],
            prev.unwrap_or_default(),
            &[boot_id.is_some() as u8],
            boot_id.unwrap_or_default().as_bytes(),
        ],
    )
}

impl KeyRecord {
    /// The record with its check (see [`key_check`]).
    pub fn sealed(mut self, boot_id: Option<&str>) -> KeyRecord {
        self.check = key_check(&self, boot_id);
        self
    }

    /// Whether its check holds for a region of boot id `boot_id`.
    pub fn verify(&self, boot_id: Option<&str>) -> bool {
        self.check == key_check(self, boot_id)
    }
}

/// A JSON record with a check over its other fields: the digest of its JSON with
/// the check at 0.
pub trait Sealed: Serialize + Clone {
    const LABEL: &'static [u8];
    fn check_mut(&mut self) -> &mut u64;

    /// Sets its check.
    fn seal(&mut self) {
        *self.check_mut() = 0;
        let c = digest(Self::LABEL, &[&encode_json(self)]);
        *self.check_mut() = c;
    }

    /// The record with its check set.
    fn sealed(mut self) -> Self {
        self.seal();
        self
    }

    /// Whether its check holds.
    fn verify(&self) -> bool {
        let mut c = self.clone();
        let had = *c.check_mut();
        c.seal();
        *c.check_mut() == had
    }
}

impl Sealed for ScopeRecord {
    const LABEL: &'static [u8] = b"maru-scope-record";
    fn check_mut(&mut self) -> &mut u64 {
        &mut self.check
    }
}

impl Sealed for RegionRecord {
    const LABEL: &'static [u8] = b"maru-region-record";
    fn check_mut(&mut self) -> &mut u64 {
        &mut self.check
    }
}

impl Sealed for SessionRecord {
    const LABEL: &'static [u8] = b"maru-session-record";
    fn check_mut(&mut self) -> &mut u64 {
        &mut self.check
    }
}

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
    /// See [`key_check`].
    pub check: u64,
}

/// Which sessions share keys (see `keys::Scope`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScopeRecord {
    pub id: u32,
    pub namespace: String,
    pub layout: String,
    pub backend: Backend,
    /// See [`Sealed`].
    #[serde(default)]
    pub check: u64,
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
    /// See [`Sealed`].
    #[serde(default)]
    pub check: u64,
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
    /// See [`Sealed`].
    #[serde(default)]
    pub check: u64,
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
    /// A key removed: its record and its use-stamp row, if it has one.
    KeyGone(u64),
    /// A key removed that has no use-stamp row (no [`Record::Used`] of it was
    /// handed over, nor was it restored): its record only.
    KeyGoneUnread(u64),
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

impl Record {
    /// Sets the check of a JSON record (scope, session, region), which the core
    /// leaves to the store. A key record's check is set by the core (it binds its
    /// region's boot id, which the record does not hold); the others have none.
    pub fn seal(&mut self) {
        match self {
            Record::Scope(s) => s.seal(),
            Record::Session(s) => s.seal(),
            Record::Region(g) => g.seal(),
            _ => {}
        }
    }
}

impl Changes {
    /// Seals every record (see [`Record::seal`]): a store does it before it writes
    /// the batch, off maru-server's event loop.
    pub fn seal(&mut self) {
        self.records.iter_mut().for_each(Record::seal);
    }
}

/// Everything a durable store holds, to rebuild the core from.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Image {
    pub scopes: Vec<ScopeRecord>,
    pub sessions: Vec<SessionRecord>,
    pub next_session: u64,
    pub regions: Vec<RegionRecord>,
    pub keys: Vec<KeyRecord>,
    /// Starts of the server on this store, the one restoring included (0: none
    /// counted); lease ids of each run are apart.
    pub run: u64,
    /// The longest lease the last run could have granted (its lease timeout, or a
    /// longer one of a run before it whose leases may still run).
    pub lease_timeout_ms: u64,
    /// Key ids below this are on the store, also in a record that does not decode
    /// or a use-stamp row alone (0: none beyond [`keys`](Self::keys)): a restore
    /// hands out none of them, nor any id of `keys`, again.
    pub key_ids_end: u64,
}

impl Image {
    /// Applies one batch, sealed as a store seals it (tests, and stores kept in
    /// memory).
    pub fn apply(&mut self, changes: &Changes) {
        let mut changes = changes.clone();
        changes.seal();
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
                Record::KeyGone(id) | Record::KeyGoneUnread(id) => {
                    self.keys.retain(|x| x.id != *id)
                }
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
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct RecordError(pub String);

/// Longest name (key or previous key) a key record holds: more than any key the
/// wire accepts (`MAX_KEY_LEN`).
const MAX_NAME: usize = u16::MAX as usize;

const KEY_VERSION: u8 = 2;

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
    out.extend_from_slice(&k.check.to_le_bytes());
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
    let check = r.u64("check")?;
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
        check,
    })
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    /// The next `n` bytes, or None (nothing read) when the record ends before them.
    fn next(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.b.len())?;
        let s = &self.b[self.at..end];
        self.at = end;
        Some(s)
    }

    fn take<const N: usize>(&mut self, what: &str) -> Result<[u8; N], RecordError> {
        let Some(s) = self.next(N) else {
            return Err(RecordError(format!(
                "the record ends before its {what} (byte {} of {})",
                self.at,
                self.b.len()
            )));
        };
        let mut a = [0u8; N];
        a.copy_from_slice(s);
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
        let Some(s) = self.next(n) else {
            return Err(RecordError(format!(
                "the record ends inside its {what} ({n} bytes at byte {} of {})",
                self.at,
                self.b.len()
            )));
        };
        let s = std::str::from_utf8(s)
            .map_err(|e| RecordError(format!("its {what} is not UTF-8: {e}")))?;
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
            check: 5,
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
        v2[0] = 1;
        assert!(decode_key(7, &v2).unwrap_err().0.contains("version"));
    }

    #[test]
    fn a_check_binds_every_field_and_the_boot_id() {
        let k = key("abc", Some("p")).sealed(Some("boot-1"));
        assert!(k.verify(Some("boot-1")));
        assert!(!k.verify(Some("boot-2")), "another boot of its region");
        assert!(!k.verify(None));
        let mut changed = vec![k.clone(); 7];
        changed[0].id += 1;
        changed[1].scope ^= 1;
        changed[2].name.push('x');
        changed[3].region_id ^= 1;
        changed[4].offset ^= 1 << 20;
        changed[5].length ^= 1;
        changed[6].prev = None;
        for c in changed {
            assert!(!c.verify(Some("boot-1")), "{c:?}");
        }
        let mut stamp = k.clone();
        stamp.used += 1;
        assert!(stamp.verify(Some("boot-1")), "the use stamp is not checked");
    }

    fn region() -> RegionRecord {
        RegionRecord {
            handle: Handle {
                region_id: 3,
                offset: 4 << 20,
                length: 4 << 20,
                token: "t".into(),
            },
            pool: PoolInfo {
                pool_id: 1,
                path: "/dev/dax0.0".into(),
                uuid: "u".into(),
                kind: "cxl".into(),
                total: 1 << 30,
                free: 0,
                align: 2 << 20,
                draining: 0,
            },
            agent: Some("a:1".into()),
            backend: Backend::Cxl,
            holder: HolderRecord::Session(4),
            boot_id: Some("b".into()),
            pages: 4,
            allocated: vec![0, 2],
            check: 0,
        }
    }

    proptest! {
        /// A bit flipped anywhere in a sealed region record's JSON gives a record
        /// that does not decode or whose check fails, never another region.
        #[test]
        fn a_flipped_bit_in_a_json_record_never_verifies(bit in 0usize..4096) {
            let r = region().sealed();
            prop_assert!(r.verify());
            let mut b = encode_json(&r);
            let bit = bit % (b.len() * 8);
            b[bit / 8] ^= 1 << (bit % 8);
            if let Ok(back) = decode_json::<RegionRecord>("region", &b) {
                prop_assert!(back == r || !back.verify(), "{}", String::from_utf8_lossy(&b));
            }
        }

        /// The same for key records, checked against their region's boot id.
        #[test]
        fn a_flipped_bit_in_a_key_record_never_verifies(bit in 0usize..4096) {
            let k = key("model-x/chunk-0004", None).sealed(Some("boot"));
            let mut b = encode_key(&k);
            let bit = bit % (b.len() * 8);
            b[bit / 8] ^= 1 << (bit % 8);
            if let Ok(back) = decode_key(k.id, &b) {
                prop_assert!(back.used != k.used || !back.verify(Some("boot")), "{back:?}");
            }
        }
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
            let k = KeyRecord { id: 1, scope: 2, name, region_id: region, offset: 3, length: 4, prev, used, check: 9 };
            prop_assert_eq!(decode_key(1, &encode_key(&k)).unwrap(), k);
        }
    }
}
