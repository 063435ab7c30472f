//! [`Key`]: a chunk key as the handler's calls take it, an owned `String` (a call
//! that outlives its caller's arguments: a submitted operation) or a `&str` borrowed
//! from the caller (the C API's synchronous calls: no copy of each key).

use serde::Serialize;

/// A chunk key: readable as a `str`, and written into a request as one.
pub trait Key: AsRef<str> + Serialize {}

impl<K: AsRef<str> + Serialize> Key for K {}
