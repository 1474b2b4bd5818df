//! The pull lease: one definition both sides derive everything from.
//!
//! # The invariant
//!
//! **The receiver never starts or continues a read of a pull's pages after
//! the sender may free them, and never uses bytes from a read that ended
//! after that moment.** It holds under delayed delivery (a notification
//! that waited in a queue), lost replies (REQ timeouts) and any TTLs.
//!
//! # How
//!
//! * **Length.** Both hellos propose a lease (each side's
//!   `pd_pull_pending_ttl`); the agreed lease `L` is the shorter one.
//! * **Start.** The sender starts the lease when it pins the pages, at `s0`
//!   on its own clock, *before* the notification leaves. It frees nothing
//!   before `s0 + L` (the sweep waits for `max(ttl, L)`; an unanswered
//!   notification holds its pins until `s0 + L` exactly).
//! * **Deadline on the receiver's clock.** The two monotonic clocks differ
//!   by an unknown offset `θ = R - S`. The handshake bounds it from below:
//!   the sender reads `s1` before sending its hello and `s4` after the
//!   answer arrives; the answer carries the receiver's clock `r` read in
//!   between, so `S(t_r) ≤ s4` and `θ ≥ r - s4` ([`ClockMap`]). The sender
//!   turns its free time into the receiver's clock conservatively,
//!   `D = s0 + L + (r - s4) - drift`, where `drift` allows both clocks to
//!   run apart by [`MAX_DRIFT_PPM`] since the measurement, and puts `D` in
//!   the pull id ([`PullId`]): the six wire messages keep their form.
//!   Any receiver instant before `D` is a sender instant before `s0 + L`.
//! * **Receiver.** It takes `min(D, arrival + L)` as the pull's deadline
//!   (a far-off `D` from a confused peer cannot extend it), refuses a
//!   notification that arrives within the read margin of it (the
//!   notification waited too long: `alloc_failed`, nothing read), starts no
//!   read within the margin ([`read_margin`], `pd_pull_read_margin_pct` of
//!   `L`), and waits for a read no longer than the deadline: a read still
//!   running then has failed, and its pages stay with the transfer
//!   (quarantined) until it ends.
//!
//! The margin only decides which reads are worth starting; safety comes
//! from the deadline alone, so a short `L` (a sender TTL of 2 s against a
//! receiver's 360 s) gives short but valid reads.

use std::time::{Duration, Instant};

/// Most drift assumed between two hosts' monotonic clocks, in parts per
/// million (NTP slews a clock by at most 500 ppm).
pub const MAX_DRIFT_PPM: u64 = 500;

pub(crate) use crate::wire::{from_micros as from_wire_micros, micros as wire_micros};

/// What a sender knows about a receiver's clock after a handshake.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClockMap {
    /// Lower bound of `receiver_clock - sender_clock`, in microseconds.
    offset_low_us: i128,
    /// When the bound was measured (sender clock).
    measured_at: Instant,
}

impl ClockMap {
    /// The bound from one exchange: our hello left at `sent`, the answer
    /// (carrying the receiver's clock `peer_us`, read while answering)
    /// arrived at `received`.
    pub fn measure(sent: Instant, received: Instant, peer_us: u64) -> ClockMap {
        debug_assert!(sent <= received);
        ClockMap {
            offset_low_us: i128::from(peer_us) - i128::from(wire_micros(received)),
            measured_at: received,
        }
    }

    /// When the bound was measured.
    pub fn measured_at(&self) -> Instant {
        self.measured_at
    }

    /// Microseconds the clocks may have drifted apart by `now`.
    pub fn drift_us(&self, now: Instant) -> u64 {
        let elapsed = now.saturating_duration_since(self.measured_at).as_micros() as u64;
        elapsed.saturating_mul(MAX_DRIFT_PPM) / 1_000_000
    }

    /// A receiver-clock instant (µs) that no receiver reading reaches
    /// before our clock reaches `t` (`t` no earlier than `now`).
    pub fn receiver_deadline_us(&self, t: Instant, now: Instant) -> u64 {
        let drift = i128::from(self.drift_us(t.max(now)));
        let d = i128::from(wire_micros(t)) + self.offset_low_us - drift;
        d.clamp(0, i128::from(u64::MAX)) as u64
    }
}

/// The part of the agreed lease `lease` within which no read is started:
/// `pct` percent of it (`pd_pull_read_margin_pct`).
pub fn read_margin(lease: Duration, pct: f64) -> Duration {
    let pct = if pct.is_finite() {
        pct.clamp(0.0, 99.0)
    } else {
        0.0
    };
    lease.mul_f64(pct / 100.0)
}

/// A pull id carrying its read deadline on the receiver's clock:
/// `<32 hex digits of a uuid4>-<deadline µs in hex>`. Peers that do not
/// know the form treat it as the opaque string it is on the wire.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PullId {
    /// The unique part.
    pub nonce: uuid::Uuid,
    /// The receiver-clock microseconds at which the sender may free.
    pub deadline_us: u64,
}

impl PullId {
    /// A fresh id for a pull due at `deadline_us` (receiver clock).
    pub fn new(deadline_us: u64) -> PullId {
        PullId {
            nonce: uuid::Uuid::new_v4(),
            deadline_us,
        }
    }

    /// A fresh id due at `deadline` of this process's own clock: only
    /// meaningful to a receiver in this process (tests, tools); a sender
    /// elsewhere converts with its [`ClockMap`].
    pub fn due_in_this_process(deadline: Instant) -> PullId {
        PullId::new(wire_micros(deadline))
    }

    /// The wire form.
    pub fn encode(&self) -> String {
        format!("{}-{:x}", self.nonce.simple(), self.deadline_us)
    }

    /// Parses the wire form; `None` for any other string.
    pub fn parse(s: &str) -> Option<PullId> {
        let (nonce, deadline) = s.split_once('-')?;
        if nonce.len() != 32 || deadline.is_empty() || deadline.len() > 16 {
            return None;
        }
        Some(PullId {
            nonce: uuid::Uuid::try_parse(nonce).ok()?,
            deadline_us: u64::from_str_radix(deadline, 16).ok()?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pull_ids_round_trip_and_other_strings_are_not_ours() {
        let id = PullId::new(0xdead_beef);
        let s = id.encode();
        assert_eq!(PullId::parse(&s), Some(id));
        for other in [
            "",
            "abc",
            "9b2f0c1e-8f0a-4d55-a1c0-6a4f9a2b7c11",
            "0123456789abcdef0123456789abcdef",
            "0123456789abcdef0123456789abcdef-",
            "0123456789abcdef0123456789abcdef-xyz",
            "0123456789abcdef0123456789abcdef-11112222333344445",
        ] {
            assert_eq!(PullId::parse(other), None, "{other:?}");
        }
    }

    /// Two simulated clocks: the receiver's reads `offset` µs more than the
    /// sender's. Whatever the (unknown) offset and the message delays, the
    /// deadline the sender computes is never after its own free time.
    #[test]
    fn the_receiver_deadline_never_passes_the_senders_free_time() {
        // Far enough after the epoch that the slower clock never reads below 0.
        let base = Instant::now() + Duration::from_secs(10);
        for offset in [-5_000_000i128, 0, 3_000, 7_000_000_000] {
            for (out_ms, back_ms) in [(0u64, 0u64), (1, 900), (700, 2), (50, 50)] {
                // Real time t (µs after base); S(t) = wire(base) + t; R(t) = S(t) + offset.
                let s = |t: u64| base + Duration::from_micros(t);
                let r = |t: u64| (i128::from(wire_micros(s(t))) + offset) as u64;
                let t_sent = 0;
                let t_answer = out_ms * 1000;
                let t_received = t_answer + back_ms * 1000;
                let map = ClockMap::measure(s(t_sent), s(t_received), r(t_answer));
                // A pull pinned an hour later with a 2 s lease.
                let t0 = t_received + 3_600_000_000;
                let free = t0 + 2_000_000;
                let d = map.receiver_deadline_us(s(free), s(t0));
                // The receiver reads at t only while R(t) < d; at the free time R(free) >= d.
                assert!(u128::from(r(free)) >= u128::from(d), "offset {offset}");
                // And the bound is tight up to the return delay and the drift allowance.
                let slack = i128::from(r(free)) - i128::from(d);
                let allowed = i128::from(back_ms * 1000) + i128::from(map.drift_us(s(free))) + 1;
                assert!(slack <= allowed, "slack {slack} > {allowed}");
            }
        }
    }

    #[test]
    fn the_read_margin_is_a_share_of_the_agreed_lease() {
        let l = Duration::from_secs(2);
        assert_eq!(read_margin(l, 10.0), Duration::from_millis(200));
        assert_eq!(
            read_margin(Duration::from_secs(360), 10.0),
            Duration::from_secs(36)
        );
        assert_eq!(read_margin(l, 0.0), Duration::ZERO);
        assert_eq!(read_margin(l, f64::NAN), Duration::ZERO);
        assert!(read_margin(l, 250.0) < l);
    }
}
