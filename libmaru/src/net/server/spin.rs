//! The loop's bounded busy poll after work ([`PollSpin`]): for `spin` after a turn
//! that had events, the loop polls without sleeping, so a client's next request
//! (after a copy of a few tens of µs) finds the loop running instead of a thread,
//! and on a VM a vCPU, to wake. A turn without events never extends the window: an
//! idle loop spins at most `spin` after its last event, then sleeps in `epoll_wait`
//! as before. Sans-I/O: the instants are given.

use std::time::{Duration, Instant};

/// When the loop may poll without sleeping.
#[derive(Debug)]
pub(super) struct PollSpin {
    spin: Duration,
    /// Poll without sleeping until then (None: sleep as the deadlines say).
    until: Option<Instant>,
}

impl PollSpin {
    /// `spin` zero: never spin.
    pub(super) fn new(spin: Duration) -> PollSpin {
        PollSpin { spin, until: None }
    }

    /// Whether it spins at all (the loop reads the clock for it only then).
    pub(super) fn on(&self) -> bool {
        !self.spin.is_zero()
    }

    /// A turn of the loop ended at `now`; `busy`: its poll returned events.
    pub(super) fn turned(&mut self, busy: bool, now: Instant) {
        if busy && !self.spin.is_zero() {
            self.until = Some(now + self.spin);
        } else if self.until.is_some_and(|u| now >= u) {
            self.until = None;
        }
    }

    /// Whether the next poll at `now` should not sleep.
    pub(super) fn spinning(&self, now: Instant) -> bool {
        self.until.is_some_and(|u| now < u)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPIN: Duration = Duration::from_micros(30);

    /// Empty turns from `t0` on, 1 µs apart (a loop polling with a zero timeout):
    /// how long until the loop sleeps again.
    fn spins_for(s: &mut PollSpin, t0: Instant) -> Duration {
        let mut now = t0;
        while s.spinning(now) {
            now += Duration::from_micros(1);
            s.turned(false, now);
            assert!(now - t0 < Duration::from_secs(1), "never stops spinning");
        }
        now - t0
    }

    #[test]
    fn an_idle_loop_spins_at_most_the_bound_after_its_last_event_then_sleeps() {
        let t0 = Instant::now();
        let mut s = PollSpin::new(SPIN);
        assert!(!s.spinning(t0), "a loop that served nothing does not spin");
        s.turned(true, t0);
        assert!(s.spinning(t0));
        assert_eq!(spins_for(&mut s, t0), SPIN);
        // Once it sleeps, a wake-up without events (a deadline) does not start a spin.
        let later = t0 + Duration::from_millis(5);
        s.turned(false, later);
        assert!(!s.spinning(later));
    }

    #[test]
    fn each_turn_with_events_starts_the_window_again() {
        let t0 = Instant::now();
        let mut s = PollSpin::new(SPIN);
        s.turned(true, t0);
        let t1 = t0 + Duration::from_micros(20);
        s.turned(true, t1);
        assert!(s.spinning(t0 + SPIN), "the second event's window runs on");
        assert_eq!(spins_for(&mut s, t1), SPIN);
    }

    #[test]
    fn a_zero_bound_never_spins() {
        let t0 = Instant::now();
        let mut s = PollSpin::new(Duration::ZERO);
        s.turned(true, t0);
        assert!(!s.spinning(t0));
    }
}
