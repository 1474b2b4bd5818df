//! The sender's per-peer circuit breaker (`pd_alloc_fail_backoff_ttl`).
//!
//! After a receiver answers `alloc_failed=true`, the sender skips every
//! transfer to that receiver for a TTL instead of pinning pages and paying a
//! round trip that will most likely fail again. Sans-IO: time is passed in.

use std::collections::HashMap;
use std::time::{Duration, Instant};

/// The breaker's state for one peer at a given instant.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BreakerState {
    /// Transfers to the peer are allowed.
    Closed,
    /// Transfers to the peer are skipped until `until`.
    Open {
        /// First instant at which the breaker is closed again.
        until: Instant,
    },
}

/// Counters of a sender's per-receiver circuit breaker.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BreakerCounters {
    /// Calls to `open` (including ones that extended an open breaker).
    pub opens: u64,
    /// Transfers refused by `allows`.
    pub skips: u64,
    /// Breakers that closed because their TTL passed (seen by `allows` or pruning).
    pub closes: u64,
    /// Peers whose breaker is currently recorded as open (expired ones included until pruned).
    pub open_peers: usize,
}

/// Per-peer TTL backoff. A peer key is any stable string naming the
/// receiver, e.g. `"host:alloc_port"`.
///
/// Only open breakers are stored; an entry is removed as soon as it is
/// seen expired, and every `open` prunes all expired
/// entries, so the map holds at most the peers that failed within one TTL.
#[derive(Debug, Default)]
pub struct CircuitBreaker {
    open_until: HashMap<String, Instant>,
    counters: BreakerCounters,
}

impl CircuitBreaker {
    /// A breaker with every peer closed.
    pub fn new() -> CircuitBreaker {
        CircuitBreaker::default()
    }

    /// Opens (or extends) `peer`'s breaker until `now + ttl`, after the peer
    /// reported an allocation failure. An already-open breaker is never
    /// shortened: its end becomes the later of the two.
    pub fn open(&mut self, peer: &str, now: Instant, ttl: Duration) {
        self.prune(now);
        let until = now + ttl;
        self.counters.opens += 1;
        self.open_until
            .entry(peer.to_owned())
            .and_modify(|u| *u = (*u).max(until))
            .or_insert(until);
    }

    /// Whether a transfer to `peer` may go ahead at `now`. A refusal is
    /// counted as a skip; a breaker whose TTL has passed closes here.
    pub fn allows(&mut self, peer: &str, now: Instant) -> bool {
        match self.open_until.get(peer) {
            None => true,
            Some(&until) if now < until => {
                self.counters.skips += 1;
                false
            }
            Some(_) => {
                self.open_until.remove(peer);
                self.counters.closes += 1;
                true
            }
        }
    }

    /// `peer`'s state at `now`, without counting or changing anything.
    pub fn state(&self, peer: &str, now: Instant) -> BreakerState {
        match self.open_until.get(peer) {
            Some(&until) if now < until => BreakerState::Open { until },
            _ => BreakerState::Closed,
        }
    }

    /// Removes every breaker whose TTL has passed at `now`; returns how many.
    pub fn prune(&mut self, now: Instant) -> usize {
        let before = self.open_until.len();
        self.open_until.retain(|_, until| now < *until);
        let closed = before - self.open_until.len();
        self.counters.closes += closed as u64;
        closed
    }

    /// The counters.
    pub fn counters(&self) -> BreakerCounters {
        BreakerCounters {
            open_peers: self.open_until.len(),
            ..self.counters
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TTL: Duration = Duration::from_secs(2);

    #[test]
    fn breaker_opens_skips_and_closes_after_ttl() {
        let t0 = Instant::now();
        let mut b = CircuitBreaker::new();
        assert!(b.allows("r:7400", t0));
        b.open("r:7400", t0, TTL);
        assert_eq!(
            b.state("r:7400", t0),
            BreakerState::Open { until: t0 + TTL }
        );
        assert!(!b.allows("r:7400", t0 + Duration::from_millis(1999)));
        assert!(!b.allows("r:7400", t0 + Duration::from_millis(1)));
        // Other peers are unaffected.
        assert!(b.allows("other:7400", t0));
        // Closed exactly at the TTL.
        assert_eq!(b.state("r:7400", t0 + TTL), BreakerState::Closed);
        assert!(b.allows("r:7400", t0 + TTL));
        let c = b.counters();
        assert_eq!((c.opens, c.skips, c.closes, c.open_peers), (1, 2, 1, 0));
    }

    #[test]
    fn reopening_extends_and_never_shortens() {
        let t0 = Instant::now();
        let mut b = CircuitBreaker::new();
        b.open("p", t0, TTL);
        b.open("p", t0 + Duration::from_secs(1), TTL);
        assert_eq!(
            b.state("p", t0),
            BreakerState::Open {
                until: t0 + Duration::from_secs(3)
            }
        );
        // A shorter TTL later does not pull the end in.
        b.open("p", t0 + Duration::from_secs(1), Duration::from_millis(10));
        assert!(!b.allows("p", t0 + Duration::from_millis(2500)));
        assert!(b.allows("p", t0 + Duration::from_secs(3)));
        assert_eq!(b.counters().opens, 3);
    }

    #[test]
    fn expired_breakers_are_pruned_so_the_map_stays_small() {
        let t0 = Instant::now();
        let mut b = CircuitBreaker::new();
        for i in 0..1000 {
            b.open(&format!("peer{i}"), t0, TTL);
        }
        assert_eq!(b.counters().open_peers, 1000);
        // One open after the TTL prunes the 1000 expired entries.
        b.open("late", t0 + TTL, TTL);
        assert_eq!(b.counters().open_peers, 1);
        assert_eq!(b.counters().closes, 1000);
        assert_eq!(b.prune(t0 + TTL * 2), 1);
        assert_eq!(b.counters().open_peers, 0);
    }
}
