//! maru-server's request decoder: the hot requests in one pass.
//!
//! `Envelope<MetaRequest>` is an internally tagged enum flattened into the envelope:
//! serde buffers such a body twice before it decodes a field (every key, value and
//! string of it copied into its `Content`: once for the envelope's flattened fields,
//! once more for the `op` tag). A worker's requests always begin with their `id` and
//! their `op` (the order `Envelope` and the tagged request encode them in), so the
//! requests of the data path (`publish`, `exists`, `acquire`, `alloc`, ...) are read
//! here field by field as they come: the id, the op, then the op's own fields
//! straight into the request. Any other body (another order, another op, a duplicate
//! `id` or `op`, anything malformed) goes through the buffered decoder, which gives
//! the same request or the same error as before: this path only ever accepts what
//! that one accepts, as the same request (property-tested in `meta_tests`).

use super::meta::{MetaRequest, PageRef, PublishEntry};
use super::{decode_json, Envelope, WireError};
use serde::de::{self, value::MapAccessDeserializer, Deserializer, IgnoredAny, MapAccess, Visitor};
use serde::Deserialize;
use std::fmt;

/// Decodes a request body as maru-server reads it: its id and its request.
pub fn decode_request(body: &[u8]) -> Result<Envelope<MetaRequest>, WireError> {
    match one_pass(body) {
        Some(env) => Ok(env),
        None => decode_json(body),
    }
}

/// The request in one pass, or None when the body is not one the fast path reads
/// (the buffered decoder then decides).
pub fn one_pass(body: &[u8]) -> Option<Envelope<MetaRequest>> {
    let mut de = serde_json::Deserializer::from_slice(body);
    let env = (&mut de).deserialize_map(InOrder).ok()?;
    de.end().ok()?;
    Some(env)
}

/// The first two keys of a request read in one pass.
#[derive(Deserialize, PartialEq, Eq)]
#[serde(field_identifier, rename_all = "snake_case")]
enum Head {
    Id,
    Op,
    #[serde(other)]
    Other,
}

/// The ops read in one pass.
#[derive(Clone, Copy)]
enum HotOp {
    Alloc,
    FreePages,
    Publish,
    Exists,
    Acquire,
    ReleaseLeases,
    Remove,
    Pin,
    Unpin,
}

impl<'de> Deserialize<'de> for HotOp {
    /// Only a string names an op here (the buffered decoder judges anything else).
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<HotOp, D::Error> {
        struct OpName;
        impl Visitor<'_> for OpName {
            type Value = HotOp;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("the name of an op of the data path")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<HotOp, E> {
                Ok(match v {
                    "alloc" => HotOp::Alloc,
                    "free_pages" => HotOp::FreePages,
                    "publish" => HotOp::Publish,
                    "exists" => HotOp::Exists,
                    "acquire" => HotOp::Acquire,
                    "release_leases" => HotOp::ReleaseLeases,
                    "remove" => HotOp::Remove,
                    "pin" => HotOp::Pin,
                    "unpin" => HotOp::Unpin,
                    _ => return Err(E::custom("not an op of the data path")),
                })
            }
        }
        d.deserialize_str(OpName)
    }
}

/// A field that must not come again after the head (`id`, `op`): present, whatever
/// its value (`null` too), it sends the body to the buffered decoder, which refuses
/// the duplicate.
#[derive(Default)]
struct Again(bool);

impl<'de> Deserialize<'de> for Again {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Again, D::Error> {
        IgnoredAny::deserialize(d)?;
        Ok(Again(true))
    }
}

/// The body of a hot op: `session`, the op's own fields, and a guard on each of the
/// head's fields (`id`, `op`) coming again; and how it becomes its request. Each body
/// refuses a field it does not know, which sends the request to the buffered decoder: a
/// value skipped here is not checked as the buffered decoder checks it (a string's
/// UTF-8, found by fuzz-smoke: `"rprev_ke!y": "\xb4"` taken here, refused there).
macro_rules! hot_body {
    ($name:ident { $($(#[$attr:meta])* $field:ident: $ty:ty),* $(,)? }
     |$b:ident, $op:pat_param| $request:expr) => {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct $name {
            session: u64,
            $($(#[$attr])* $field: $ty,)*
            #[serde(default)]
            id: Again,
            #[serde(default)]
            op: Again,
        }

        impl HotBody for $name {
            fn again(&self) -> bool {
                self.id.0 || self.op.0
            }
            fn request(self, $op: HotOp) -> MetaRequest {
                let $b = self;
                $request
            }
        }
    };
}

/// A hot op's body as [`hot_body`] writes it.
trait HotBody {
    /// True when the head's `id` or `op` came again in the body.
    fn again(&self) -> bool;
    /// The request `op` asks with this body.
    fn request(self, op: HotOp) -> MetaRequest;
}

// `exists`, `acquire`, `remove`, `pin` and `unpin`.
hot_body!(KeysBody { keys: Vec<String> } |b, op| {
    let (session, keys) = (b.session, b.keys);
    match op {
        HotOp::Exists => MetaRequest::Exists { session, keys },
        HotOp::Acquire => MetaRequest::Acquire { session, keys },
        HotOp::Remove => MetaRequest::Remove { session, keys },
        HotOp::Pin => MetaRequest::Pin { session, keys },
        _ => MetaRequest::Unpin { session, keys },
    }
});
hot_body!(PublishBody { entries: Vec<Entry> } |b, _| MetaRequest::Publish {
    session: b.session,
    entries: b.entries.into_iter().map(Entry::into_entry).collect(),
});
hot_body!(AllocBody {
    count: u32,
    #[serde(default)]
    route_key: Option<String>,
} |b, _| MetaRequest::Alloc {
    session: b.session,
    count: b.count,
    route_key: b.route_key,
});
hot_body!(FreePagesBody { pages: Vec<Page> } |b, _| MetaRequest::FreePages {
    session: b.session,
    pages: b.pages.into_iter().map(|p| PageRef { region_id: p.region_id, page: p.page }).collect(),
});
hot_body!(ReleaseBody { lease_ids: Vec<u64> } |b, _| MetaRequest::ReleaseLeases {
    session: b.session,
    lease_ids: b.lease_ids,
});

/// The body of `op` read from the rest of the map, as its request; an error (the
/// buffered decoder decides) where the head's fields come again.
fn hot<'de, B, A>(rest: MapAccessDeserializer<A>, op: HotOp) -> Result<MetaRequest, A::Error>
where
    B: HotBody + Deserialize<'de>,
    A: MapAccess<'de>,
{
    let b = B::deserialize(rest)?;
    if b.again() {
        return Err(other());
    }
    Ok(b.request(op))
}

/// The error that sends a body to the buffered decoder.
fn other<E: de::Error>() -> E {
    E::custom("another order or op: the buffered decoder reads it")
}

/// A [`PublishEntry`] that refuses a field it does not know (see [`hot_body`]).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    key: String,
    region_id: u64,
    offset: u64,
    length: u64,
    #[serde(default)]
    prev: Option<String>,
}

impl Entry {
    fn into_entry(self) -> PublishEntry {
        PublishEntry {
            key: self.key,
            region_id: self.region_id,
            offset: self.offset,
            length: self.length,
            prev: self.prev,
        }
    }
}

/// A [`PageRef`] that refuses a field it does not know.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Page {
    region_id: u64,
    page: u64,
}

/// Reads `{"id": .., "op": <a hot op>, <its fields>}`; an error for anything else.
struct InOrder;

impl<'de> Visitor<'de> for InOrder {
    type Value = Envelope<MetaRequest>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a request whose id and op come first")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        if map.next_key::<Head>()? != Some(Head::Id) {
            return Err(other());
        }
        let id: u64 = map.next_value()?;
        if map.next_key::<Head>()? != Some(Head::Op) {
            return Err(other());
        }
        let op: HotOp = map.next_value()?;
        let rest = MapAccessDeserializer::new(map);
        let body = match op {
            HotOp::Exists | HotOp::Acquire | HotOp::Remove | HotOp::Pin | HotOp::Unpin => {
                hot::<KeysBody, _>(rest, op)
            }
            HotOp::Publish => hot::<PublishBody, _>(rest, op),
            HotOp::Alloc => hot::<AllocBody, _>(rest, op),
            HotOp::FreePages => hot::<FreePagesBody, _>(rest, op),
            HotOp::ReleaseLeases => hot::<ReleaseBody, _>(rest, op),
        }?;
        Ok(Envelope { id, body })
    }
}
