//! How many bytes of partly received frames the event loop holds.
//!
//! Once a connection finished its handshake its frames may be as large as the daemon's
//! largest (1 MiB), and a peer may send all of a frame but its last byte and wait:
//! without a bound, connections × largest frame (a GiB for 1,024 connections). So the
//! loop reads a connection's frame only as far as it may hold it:
//!
//! - every connection may hold a *small* allowance (the loop's `SMALL_FRAME`, 16 KiB)
//!   without asking: the frames most requests are, and the start of a larger one;
//! - a larger frame is read only once its whole size is granted here, out of a room
//!   shared by every connection (`total`) of which one class, a tenant, may hold at
//!   most `per_class`. A frame that does not fit waits: its connection is not read
//!   (backpressure; the kernel's buffers then stop its peer) until room comes back,
//!   when a frame is complete or its connection closes. The room a daemon holds for
//!   frames never grows past its bound, whatever peers send.
//!
//! Whole frames are granted, never parts, so frames that got room always complete
//! once their peers send them: two half-received frames cannot block each other.
//! Waiting frames get room first come, first served, those that fit passing those
//! that do not yet: the connections that want the most wait, those that want little
//! go on. A class's cap keeps one tenant's stalled frames from taking the room of
//! another; and while anyone waits, a grant whose peer sent nothing of its frame for a
//! while is *stalled* ([`FrameRoom::stalled`]): the loop closes its connection, so a
//! peer cannot sit on room others need.
//!
//! Sans-I/O: the loop asks, reads what was granted (reporting progress), gives the
//! room back, and closes the stalled, passing the time in (`now_ms`).

use std::collections::{HashMap, VecDeque};
use std::hash::Hash;

/// The room for large frames: what is granted, to whom, and who waits.
#[derive(Debug)]
pub struct FrameRoom<C, K> {
    total: usize,
    per_class: usize,
    held: usize,
    held_by: HashMap<C, usize>,
    grants: HashMap<K, Grant<C>>,
    waiting: VecDeque<(K, C, usize)>,
}

#[derive(Debug, Clone, Copy)]
struct Grant<C> {
    class: C,
    bytes: usize,
    /// When it was granted, or when its peer last sent a byte of the frame.
    moved_ms: u64,
}

impl<C: Copy + Eq + Hash, K: Copy + Eq + Hash> FrameRoom<C, K> {
    /// `total` bytes for every connection together, `per_class` for one class; both
    /// raised to `largest` (the largest frame one grant may be) so that every frame
    /// fits once the room is free.
    pub fn new(total: usize, per_class: usize, largest: usize) -> FrameRoom<C, K> {
        let per_class = per_class.max(largest);
        FrameRoom {
            total: total.max(per_class),
            per_class,
            held: 0,
            held_by: HashMap::new(),
            grants: HashMap::new(),
            waiting: VecDeque::new(),
        }
    }

    /// Bytes granted now, to every connection.
    pub fn held(&self) -> usize {
        self.held
    }

    /// Bytes granted now to the connections of `class`.
    pub fn held_by(&self, class: C) -> usize {
        self.held_by.get(&class).copied().unwrap_or(0)
    }

    /// The bytes granted to `key` (0: none).
    pub fn granted(&self, key: K) -> usize {
        self.grants.get(&key).map_or(0, |g| g.bytes)
    }

    /// Connections waiting for room.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    fn fits(&self, class: C, bytes: usize) -> bool {
        self.held + bytes <= self.total && self.held_by(class) + bytes <= self.per_class
    }

    fn grant(&mut self, key: K, class: C, bytes: usize, now_ms: u64) {
        self.held += bytes;
        *self.held_by.entry(class).or_default() += bytes;
        self.grants.insert(
            key,
            Grant {
                class,
                bytes,
                moved_ms: now_ms,
            },
        );
    }

    /// `key`, of `class`, has a frame of `bytes` under way: true when the room is
    /// granted (read it whole); false when it must wait (it is told by
    /// [`give_back`](Self::give_back) once granted). Whoever waits does not fit (room
    /// that comes back goes to the waiters first), so one that fits takes it at once.
    /// A connection holds one grant: asking again gives back the one it had.
    pub fn ask(&mut self, class: C, key: K, bytes: usize, now_ms: u64) -> bool {
        self.give_back(key, now_ms);
        if self.fits(class, bytes) {
            self.grant(key, class, bytes, now_ms);
            return true;
        }
        self.waiting.push_back((key, class, bytes));
        false
    }

    /// `key`'s frame is complete, or `key` closed: its grant goes back (and it stops
    /// waiting). Returns the waiting connections granted room now, in the order they
    /// asked.
    pub fn give_back(&mut self, key: K, now_ms: u64) -> Vec<K> {
        self.waiting.retain(|w| w.0 != key);
        let Some(Grant { class, bytes, .. }) = self.grants.remove(&key) else {
            return Vec::new();
        };
        self.held -= bytes;
        if let Some(h) = self.held_by.get_mut(&class) {
            *h -= bytes;
            if *h == 0 {
                self.held_by.remove(&class);
            }
        }
        let mut granted = Vec::new();
        let mut i = 0;
        while i < self.waiting.len() {
            let (k, c, b) = self.waiting[i];
            if self.fits(c, b) {
                self.waiting.remove(i);
                self.grant(k, c, b, now_ms);
                granted.push(k);
            } else {
                i += 1;
            }
        }
        granted
    }

    /// `key`'s peer sent bytes of its granted frame (or its connection could not be
    /// read for a reason of the daemon's own): its stall clock starts again.
    pub fn moved(&mut self, key: K, now_ms: u64) {
        if let Some(g) = self.grants.get_mut(&key) {
            g.moved_ms = now_ms;
        }
    }

    /// While a frame waits for room, the grants whose peers sent nothing for
    /// `limit_ms` (close their connections; that gives their room back). Nothing
    /// while nobody waits: a slow peer then costs no one.
    pub fn stalled(&self, now_ms: u64, limit_ms: u64) -> Vec<K> {
        if self.waiting.is_empty() {
            return Vec::new();
        }
        self.grants
            .iter()
            .filter(|(_, g)| g.moved_ms.saturating_add(limit_ms) <= now_ms)
            .map(|(k, _)| *k)
            .collect()
    }

    /// When the next grant becomes stalled (see [`stalled`](Self::stalled)), if anyone
    /// waits.
    pub fn next_stall(&self, limit_ms: u64) -> Option<u64> {
        if self.waiting.is_empty() {
            return None;
        }
        self.grants
            .values()
            .map(|g| g.moved_ms.saturating_add(limit_ms))
            .min()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MIB: usize = 1 << 20;

    #[test]
    fn frames_beyond_the_room_wait_and_get_it_when_a_frame_completes() {
        let mut r: FrameRoom<u8, u32> = FrameRoom::new(3 * MIB, 3 * MIB, MIB);
        for k in 0..3 {
            assert!(r.ask(0, k, MIB, 0));
        }
        assert!(!r.ask(0, 3, MIB, 0), "a fourth 1 MiB frame waits");
        assert!(!r.ask(0, 4, MIB, 0));
        assert_eq!(r.held(), 3 * MIB);
        assert_eq!(r.give_back(1, 0), vec![3], "the first to wait goes first");
        assert_eq!(r.granted(3), MIB);
        assert_eq!(r.held(), 3 * MIB, "never more than the room");
        // A waiter that closes stops waiting.
        r.give_back(4, 0);
        assert_eq!(r.waiting(), 0);
        assert_eq!(r.give_back(0, 0), Vec::<u32>::new());
        assert_eq!(r.held(), 2 * MIB);
    }

    #[test]
    fn one_class_cannot_take_the_room_of_another() {
        let mut r: FrameRoom<u8, u32> = FrameRoom::new(4 * MIB, 2 * MIB, MIB);
        assert!(r.ask(0, 1, MIB, 0));
        assert!(r.ask(0, 2, MIB, 0));
        assert!(!r.ask(0, 3, MIB, 0), "class 0 holds its cap");
        assert!(r.ask(1, 10, MIB, 0), "class 1 still gets room");
        assert!(r.ask(1, 11, MIB, 0));
        assert_eq!(r.held_by(0), 2 * MIB);
        // Class 1's frame completes: the room is class 1's share, class 0 still waits.
        assert_eq!(r.give_back(10, 0), Vec::<u32>::new());
        assert_eq!(r.give_back(1, 0), vec![3]);
    }

    #[test]
    fn a_small_frame_passes_a_large_one_that_does_not_fit_yet() {
        let mut r: FrameRoom<u8, u32> = FrameRoom::new(2 * MIB, 2 * MIB, MIB);
        assert!(r.ask(0, 1, MIB + MIB / 2, 0));
        assert!(!r.ask(0, 2, MIB, 0), "does not fit");
        assert!(r.ask(0, 3, 100 << 10, 0), "fits beside it: granted");
        assert_eq!(r.give_back(1, 0), vec![2]);
    }

    #[test]
    fn a_grant_whose_peer_sends_nothing_is_stalled_only_while_others_wait() {
        let mut r: FrameRoom<u8, u32> = FrameRoom::new(2 * MIB, 2 * MIB, MIB);
        assert!(r.ask(0, 1, MIB, 1_000));
        assert!(r.ask(0, 2, MIB, 1_000));
        assert!(r.stalled(60_000, 10_000).is_empty(), "nobody waits");
        assert_eq!(r.next_stall(10_000), None);
        assert!(!r.ask(0, 3, MIB, 5_000));
        r.moved(2, 8_000);
        assert_eq!(r.next_stall(10_000), Some(11_000));
        assert!(r.stalled(10_999, 10_000).is_empty());
        assert_eq!(r.stalled(11_000, 10_000), vec![1], "2 sent since");
        // Its connection closes: the waiter gets the room.
        assert_eq!(r.give_back(1, 11_000), vec![3]);
        assert!(
            r.stalled(11_000, 10_000).is_empty(),
            "nobody waits any more"
        );
    }

    #[test]
    fn caps_are_raised_to_the_largest_frame() {
        let mut r: FrameRoom<u8, u32> = FrameRoom::new(10, 10, MIB);
        assert!(
            r.ask(0, 1, MIB, 0),
            "the largest frame always fits an empty room"
        );
        assert!(!r.ask(0, 2, MIB, 0));
    }

    proptest! {
        /// Whatever connections ask and give back, the room granted never passes the
        /// total or a class's cap, and nothing waits that would fit.
        #[test]
        fn grants_never_pass_the_caps(ops in proptest::collection::vec(
            (0u8..3, 0u32..24, 1usize..=MIB, any::<bool>()), 1..300)) {
            let (total, per_class) = (4 * MIB, 2 * MIB);
            let mut r: FrameRoom<u8, u32> = FrameRoom::new(total, per_class, MIB);
            let mut class_of: HashMap<u32, u8> = HashMap::new();
            for (class, key, bytes, ask) in ops {
                // A connection keeps its class.
                let class = *class_of.entry(key).or_insert(class);
                if ask { r.ask(class, key, bytes, 0); } else { r.give_back(key, 0); }
                prop_assert!(r.held() <= total);
                for c in 0..3 { prop_assert!(r.held_by(c) <= per_class); }
                let sum: usize = r.grants.values().map(|g| g.bytes).sum();
                prop_assert_eq!(sum, r.held());
                for (k, c, b) in &r.waiting {
                    prop_assert!(!r.fits(*c, *b), "{} waits though {} fits", k, b);
                }
            }
        }
    }
}
