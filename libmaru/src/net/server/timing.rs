//! How long the loop held each timed request of one connection ([`ServedTimes`]):
//! from the read of its last byte to the write of its reply's last byte, for the
//! service's figures ([`Service::on_served`](crate::net::Service::on_served)). The
//! time a request waited for its connection's turn, the service's work, a deferred
//! reply's wait (a commit of the durable directory, a region from the RM) and the
//! write all count; what the kernel and the client do before the read and after the
//! write does not. Sans-I/O: the instants are given.

use std::time::Instant;

/// Most deferred requests timed at once on one connection: the loop stops reading a
/// connection at [`MAX_DEFERRED`](crate::net::service::MAX_DEFERRED) of them, so
/// this bound only matters if replies never come (their times are then dropped).
const MAX_TIMED_DEFERRED: usize = 64;

/// One connection's timed requests, from their read to the write of their replies.
#[derive(Debug)]
pub(super) struct ServedTimes {
    /// When bytes were last read from the socket: the read time of every whole
    /// frame decoded since.
    read_at: Instant,
    /// Answered, their replies not yet written whole: (label, read at).
    unwritten: Vec<(&'static str, Instant)>,
    /// Deferred by the service: (request id, label, read at).
    deferred: Vec<(u64, &'static str, Instant)>,
    /// Written whole, not yet handed to the service: (label, seconds).
    served: Vec<(&'static str, f64)>,
}

impl ServedTimes {
    pub(super) fn new(now: Instant) -> ServedTimes {
        ServedTimes {
            read_at: now,
            unwritten: Vec::new(),
            deferred: Vec::new(),
            served: Vec::new(),
        }
    }

    /// Bytes were read from the socket at `now`.
    pub(super) fn read(&mut self, now: Instant) {
        self.read_at = now;
    }

    /// A request decoded from what was read so far was answered at once.
    pub(super) fn answered(&mut self, label: &'static str) {
        self.unwritten.push((label, self.read_at));
    }

    /// A request decoded from what was read so far was deferred (answered later
    /// through [`delivered`](Self::delivered)).
    pub(super) fn deferred(&mut self, id: u64, label: &'static str) {
        if self.deferred.len() < MAX_TIMED_DEFERRED {
            self.deferred.push((id, label, self.read_at));
        }
    }

    /// Whether deferred requests wait for their replies (then a deferred reply's
    /// request id is worth reading).
    pub(super) fn awaits_deferred(&self) -> bool {
        !self.deferred.is_empty()
    }

    /// The deferred reply to request `id` was queued to be written.
    pub(super) fn delivered(&mut self, id: u64) {
        if let Some(i) = self.deferred.iter().position(|(d, _, _)| *d == id) {
            let (_, label, at) = self.deferred.swap_remove(i);
            self.unwritten.push((label, at));
        }
    }

    /// Whether answered requests wait for their replies to be written.
    pub(super) fn has_unwritten(&self) -> bool {
        !self.unwritten.is_empty()
    }

    /// Every reply queued so far was written whole at `now`.
    pub(super) fn written(&mut self, now: Instant) {
        for (label, at) in self.unwritten.drain(..) {
            self.served
                .push((label, now.saturating_duration_since(at).as_secs_f64()));
        }
    }

    /// The requests written whole since the last call: (label, seconds).
    pub(super) fn take_served(&mut self) -> std::vec::Drain<'_, (&'static str, f64)> {
        self.served.drain(..)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// A request counts from the read that brought it to the write of its reply,
    /// however long its reply was deferred; replies not yet written do not count.
    #[test]
    fn a_request_counts_from_its_read_to_its_reply_written() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let mut t = ServedTimes::new(t0);
        t.read(ms(1));
        t.answered("exists");
        t.deferred(7, "expand");
        t.read(ms(3));
        t.answered("publish");
        t.written(ms(4));
        let got: Vec<_> = t.take_served().collect();
        assert_eq!(got, vec![("exists", 0.003), ("publish", 0.001)]);
        assert!(t.awaits_deferred());
        t.delivered(99); // not one of ours: nothing moves
        t.written(ms(5));
        assert_eq!(t.take_served().count(), 0);
        t.delivered(7);
        assert!(!t.awaits_deferred());
        t.written(ms(21));
        let got: Vec<_> = t.take_served().collect();
        assert_eq!(got, vec![("expand", 0.02)]);
    }
}
