//! Replies kept for retries: a client that lost the reply to an ALLOC or FREE sends
//! the same request with the same non-zero `request_id` and gets the first reply
//! again, instead of a second region or a "not allocated" refusal.
//!
//! Bounded (oldest entries go first) and kept for a limited time; not persisted.

use crate::wire::rm::{RmReply, RmRequest};
use std::collections::{HashMap, VecDeque};

/// Entries kept at most.
pub const REPLY_CACHE_ENTRIES: usize = 1024;
/// How long a reply is kept (ms).
pub const REPLY_CACHE_TTL_MS: u64 = 60_000;

#[derive(Debug, Clone)]
struct Entry {
    request: RmRequest,
    reply: RmReply,
    at_ms: u64,
}

/// What a lookup found.
#[derive(Debug, Clone, PartialEq)]
pub enum Replay {
    /// The request was seen: here is its reply.
    Reply(RmReply),
    /// The request id was used for a different request.
    Mismatch,
}

#[derive(Debug, Clone)]
pub struct ReplyCache {
    capacity: usize,
    ttl_ms: u64,
    entries: HashMap<(String, u64), Entry>,
    order: VecDeque<(String, u64)>,
}

impl Default for ReplyCache {
    fn default() -> ReplyCache {
        ReplyCache::new(REPLY_CACHE_ENTRIES, REPLY_CACHE_TTL_MS)
    }
}

impl ReplyCache {
    pub fn new(capacity: usize, ttl_ms: u64) -> ReplyCache {
        ReplyCache {
            capacity: capacity.max(1),
            ttl_ms,
            entries: HashMap::new(),
            order: VecDeque::new(),
        }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The reply kept for (`client`, `request_id`), if it is still fresh.
    pub fn lookup(
        &self,
        client: &str,
        request_id: u64,
        request: &RmRequest,
        now_ms: u64,
    ) -> Option<Replay> {
        let e = self.entries.get(&(client.to_string(), request_id))?;
        if e.at_ms.saturating_add(self.ttl_ms) <= now_ms {
            return None;
        }
        Some(if &e.request == request {
            Replay::Reply(e.reply.clone())
        } else {
            Replay::Mismatch
        })
    }

    pub fn insert(
        &mut self,
        client: &str,
        request_id: u64,
        request: RmRequest,
        reply: RmReply,
        now_ms: u64,
    ) {
        let key = (client.to_string(), request_id);
        let entry = Entry {
            request,
            reply,
            at_ms: now_ms,
        };
        if self.entries.insert(key.clone(), entry).is_some() {
            self.order.retain(|k| k != &key);
        }
        self.order.push_back(key);
        while self.entries.len() > self.capacity {
            match self.order.pop_front() {
                Some(old) => {
                    self.entries.remove(&old);
                }
                None => break,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::rm::FreeReply;

    fn req(n: u64) -> RmRequest {
        RmRequest::Alloc {
            size: n,
            pool: None,
            request_id: 1,
        }
    }

    fn reply() -> RmReply {
        RmReply::Free(FreeReply { draining: false })
    }

    #[test]
    fn bounded_expiring_and_checked() {
        let mut c = ReplyCache::new(2, 100);
        c.insert("a", 1, req(1), reply(), 0);
        assert_eq!(c.lookup("a", 1, &req(1), 99), Some(Replay::Reply(reply())));
        assert_eq!(c.lookup("a", 1, &req(2), 99), Some(Replay::Mismatch));
        assert_eq!(c.lookup("b", 1, &req(1), 99), None);
        assert_eq!(c.lookup("a", 1, &req(1), 100), None);
        c.insert("a", 2, req(1), reply(), 0);
        c.insert("a", 3, req(1), reply(), 0);
        assert_eq!(c.len(), 2);
        assert_eq!(c.lookup("a", 1, &req(1), 0), None);
        assert!(c.lookup("a", 3, &req(1), 0).is_some());
    }
}
