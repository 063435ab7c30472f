//! maru-server's request decoder: the hot requests in one pass, their keys borrowed.
//!
//! `Envelope<MetaRequest>` is an internally tagged enum flattened into the envelope:
//! serde buffers such a body twice before it decodes a field (every key, value and
//! string of it copied into its `Content`: once for the envelope's flattened fields,
//! once more for the `op` tag). A worker's requests always begin with their `id` and
//! their `op` (the order `Envelope` and the tagged request encode them in), so the
//! requests of the data path (`publish`, `exists`, `acquire`, `alloc`, ...) are read
//! here field by field as they come: the id, the op, then the op's own fields
//! straight into the request ([`HotRequest`]), whose keys and previous keys borrow
//! the request's bytes (a [`Text`]: copied only where the JSON string has escapes).
//! Any other body (another order, another op, a duplicate `id` or `op`, anything
//! malformed) goes through the buffered decoder, which gives the same request or the
//! same error as before: this path only ever accepts what that one accepts, as the
//! same request (property-tested in `meta_tests`, and by fuzz target
//! `meta_messages`).

use super::meta::{MetaRequest, PageRef, PublishEntry};
use super::{decode_json, Envelope, WireError};
use serde::de::{self, value::MapAccessDeserializer, Deserializer, IgnoredAny, MapAccess, Visitor};
use serde::Deserialize;
use std::borrow::Cow;
use std::fmt;
use std::marker::PhantomData;

/// A request as maru-server reads it: one of the data path, borrowing the request's
/// bytes, or any other (as the buffered decoder reads it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request<'a> {
    Hot(HotRequest<'a>),
    Full(MetaRequest),
}

/// A request of the data path, read in one pass: the [`MetaRequest`] of the same
/// name, its keys borrowed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HotRequest<'a> {
    Alloc {
        session: u64,
        count: u32,
        route_key: Option<Text<'a>>,
    },
    FreePages {
        session: u64,
        pages: Vec<PageRef>,
    },
    Publish {
        session: u64,
        entries: Vec<EntryRef<'a>>,
    },
    /// `exists`, `acquire`, `remove`, `pin`, `unpin`.
    Keys {
        op: KeysOp,
        session: u64,
        keys: Vec<Text<'a>>,
    },
    ReleaseLeases {
        session: u64,
        lease_ids: Vec<u64>,
    },
}

/// The requests that name keys only.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeysOp {
    Exists,
    Acquire,
    Remove,
    Pin,
    Unpin,
}

/// A string of a request: the request's own bytes, or a copy where its JSON had
/// escapes.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(transparent)]
pub struct Text<'a>(#[serde(borrow)] pub Cow<'a, str>);

impl std::ops::Deref for Text<'_> {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

impl<'a> From<&'a str> for Text<'a> {
    fn from(s: &'a str) -> Text<'a> {
        Text(Cow::Borrowed(s))
    }
}

/// A [`PublishEntry`] whose key and previous key may borrow the request's bytes.
/// It refuses a field it does not know (see [`hot_body`]).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EntryRef<'a> {
    #[serde(borrow)]
    pub key: Text<'a>,
    pub region_id: u64,
    pub offset: u64,
    pub length: u64,
    #[serde(default, borrow)]
    pub prev: Option<Text<'a>>,
}

impl<'a> From<&'a PublishEntry> for EntryRef<'a> {
    fn from(e: &'a PublishEntry) -> EntryRef<'a> {
        EntryRef {
            key: e.key.as_str().into(),
            region_id: e.region_id,
            offset: e.offset,
            length: e.length,
            prev: e.prev.as_deref().map(Text::from),
        }
    }
}

impl EntryRef<'_> {
    pub fn to_owned(&self) -> PublishEntry {
        PublishEntry {
            key: self.key.to_string(),
            region_id: self.region_id,
            offset: self.offset,
            length: self.length,
            prev: self.prev.as_deref().map(str::to_string),
        }
    }
}

impl Request<'_> {
    /// The [`MetaRequest`] it reads as (the buffered decoder's request).
    pub fn into_owned(self) -> MetaRequest {
        let h = match self {
            Request::Full(r) => return r,
            Request::Hot(h) => h,
        };
        let owned = |keys: Vec<Text<'_>>| keys.iter().map(|k| k.to_string()).collect();
        match h {
            HotRequest::Alloc {
                session,
                count,
                route_key,
            } => MetaRequest::Alloc {
                session,
                count,
                route_key: route_key.as_deref().map(str::to_string),
            },
            HotRequest::FreePages { session, pages } => MetaRequest::FreePages { session, pages },
            HotRequest::Publish { session, entries } => MetaRequest::Publish {
                session,
                entries: entries.iter().map(EntryRef::to_owned).collect(),
            },
            HotRequest::Keys { op, session, keys } => {
                let keys = owned(keys);
                match op {
                    KeysOp::Exists => MetaRequest::Exists { session, keys },
                    KeysOp::Acquire => MetaRequest::Acquire { session, keys },
                    KeysOp::Remove => MetaRequest::Remove { session, keys },
                    KeysOp::Pin => MetaRequest::Pin { session, keys },
                    KeysOp::Unpin => MetaRequest::Unpin { session, keys },
                }
            }
            HotRequest::ReleaseLeases { session, lease_ids } => {
                MetaRequest::ReleaseLeases { session, lease_ids }
            }
        }
    }
}

impl From<MetaRequest> for Request<'_> {
    fn from(r: MetaRequest) -> Self {
        Request::Full(r)
    }
}

/// Decodes a request body as maru-server reads it: its id and its request.
pub fn decode_request(body: &[u8]) -> Result<Envelope<Request<'_>>, WireError> {
    match one_pass(body) {
        Some(env) => Ok(env),
        None => decode_json::<Envelope<MetaRequest>>(body).map(|e| Envelope {
            id: e.id,
            body: Request::Full(e.body),
        }),
    }
}

/// The request in one pass, or None when the body is not one the fast path reads
/// (the buffered decoder then decides).
pub fn one_pass(body: &[u8]) -> Option<Envelope<Request<'_>>> {
    let mut de = serde_json::Deserializer::from_slice(body);
    let env = (&mut de).deserialize_map(InOrder).ok()?;
    de.end().ok()?;
    Some(Envelope {
        id: env.id,
        body: Request::Hot(env.body),
    })
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
        struct $name<'a> {
            session: u64,
            $($(#[$attr])* $field: $ty,)*
            #[serde(default)]
            id: Again,
            #[serde(default)]
            op: Again,
            #[serde(skip)]
            _borrows: PhantomData<&'a str>,
        }

        impl<'a> HotBody<'a> for $name<'a> {
            fn again(&self) -> bool {
                self.id.0 || self.op.0
            }
            fn request(self, $op: HotOp) -> HotRequest<'a> {
                let $b = self;
                $request
            }
        }
    };
}

/// A hot op's body as [`hot_body`] writes it.
trait HotBody<'a> {
    /// True when the head's `id` or `op` came again in the body.
    fn again(&self) -> bool;
    /// The request `op` asks with this body.
    fn request(self, op: HotOp) -> HotRequest<'a>;
}

// `exists`, `acquire`, `remove`, `pin` and `unpin`.
hot_body!(KeysBody { #[serde(borrow)] keys: Vec<Text<'a>> } |b, op| HotRequest::Keys {
    op: match op {
        HotOp::Exists => KeysOp::Exists,
        HotOp::Acquire => KeysOp::Acquire,
        HotOp::Remove => KeysOp::Remove,
        HotOp::Pin => KeysOp::Pin,
        _ => KeysOp::Unpin,
    },
    session: b.session,
    keys: b.keys,
});
hot_body!(PublishBody { #[serde(borrow)] entries: Vec<EntryRef<'a>> } |b, _| HotRequest::Publish {
    session: b.session,
    entries: b.entries,
});
hot_body!(AllocBody {
    count: u32,
    #[serde(default, borrow)]
    route_key: Option<Text<'a>>,
} |b, _| HotRequest::Alloc {
    session: b.session,
    count: b.count,
    route_key: b.route_key,
});
hot_body!(FreePagesBody { pages: Vec<Page> } |b, _| HotRequest::FreePages {
    session: b.session,
    pages: b.pages.into_iter().map(|p| PageRef { region_id: p.region_id, page: p.page }).collect(),
});
hot_body!(ReleaseBody { lease_ids: Vec<u64> } |b, _| HotRequest::ReleaseLeases {
    session: b.session,
    lease_ids: b.lease_ids,
});

/// The body of `op` read from the rest of the map, as its request; an error (the
/// buffered decoder decides) where the head's fields come again.
fn hot<'de, B, A>(rest: MapAccessDeserializer<A>, op: HotOp) -> Result<HotRequest<'de>, A::Error>
where
    B: HotBody<'de> + Deserialize<'de>,
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
    type Value = Envelope<HotRequest<'de>>;

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
