//! Requests that wait for receiver pages without holding up anyone else.
//!
//! The receiver's request socket serves every sender. A request whose pages
//! are not free yet is parked here (bounded, with a deadline) and the
//! socket goes on answering other senders; the shell retries the parked
//! ones as pages come back. A route's frames are served in order: while a
//! route has a request parked, its later frames wait behind it (an LMCache
//! REQ peer never sends one, a misbehaving DEALER might). Plain logic: the
//! shell passes `now` and says whether each retry was served.

use std::collections::{HashSet, VecDeque};
use std::time::Instant;

/// Most requests parked at once; the next is refused at once (counted).
pub const MAX_WAITING: usize = 128;

/// One parked request.
#[derive(Debug)]
pub struct Waiter<T> {
    /// The requester's route on the request socket.
    pub route: Vec<u8>,
    /// What to serve (the decoded message).
    pub item: T,
    /// When waiting ends: the last retry fails for want of pages.
    pub deadline: Instant,
}

/// What a retry did with a parked request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Retry {
    /// Answered (served, refused or failed): it leaves the queue.
    Answered,
    /// Still no pages: it stays, and its route's later frames stay behind it.
    StillWaiting,
}

/// The bounded queue of parked requests, oldest first.
#[derive(Debug)]
pub struct WaitQueue<T> {
    waiters: VecDeque<Waiter<T>>,
    cap: usize,
    refused: u64,
}

impl<T> WaitQueue<T> {
    /// An empty queue holding at most `cap` requests.
    pub fn new(cap: usize) -> WaitQueue<T> {
        WaitQueue {
            waiters: VecDeque::new(),
            cap,
            refused: 0,
        }
    }

    /// Requests parked now.
    pub fn len(&self) -> usize {
        self.waiters.len()
    }

    /// True when nothing waits.
    pub fn is_empty(&self) -> bool {
        self.waiters.is_empty()
    }

    /// Requests refused because the queue was full.
    pub fn refused(&self) -> u64 {
        self.refused
    }

    /// True when `route` has a request parked: its next frame must wait
    /// behind it.
    pub fn holds(&self, route: &[u8]) -> bool {
        self.waiters.iter().any(|w| w.route == route)
    }

    /// Parks `item` until `deadline`. A full queue hands the item back (the
    /// shell refuses it at once; counted).
    pub fn park(&mut self, route: Vec<u8>, item: T, deadline: Instant) -> Result<(), T> {
        if self.waiters.len() >= self.cap {
            self.refused += 1;
            return Err(item);
        }
        self.waiters.push_back(Waiter {
            route,
            item,
            deadline,
        });
        Ok(())
    }

    /// The earliest deadline of a parked request (the shell wakes by then).
    pub fn next_deadline(&self) -> Option<Instant> {
        self.waiters.iter().map(|w| w.deadline).min()
    }

    /// Retries the parked requests, oldest first, at most one per route
    /// (the first of each route; the rest stay behind it). `serve` gets
    /// each request and whether this is its last chance (`now` is past its
    /// deadline; it may replace the item, e.g. with a decoded form), and
    /// must answer a request on its last chance: a
    /// `StillWaiting` then is taken as answered, so nothing waits forever.
    pub fn retry(&mut self, now: Instant, mut serve: impl FnMut(&mut Waiter<T>, bool) -> Retry) {
        let mut blocked: HashSet<Vec<u8>> = HashSet::new();
        let mut kept = VecDeque::with_capacity(self.waiters.len());
        while let Some(mut w) = self.waiters.pop_front() {
            if blocked.contains(&w.route) {
                kept.push_back(w);
                continue;
            }
            let last = now >= w.deadline;
            match serve(&mut w, last) {
                Retry::StillWaiting if !last => {
                    blocked.insert(w.route.clone());
                    kept.push_back(w);
                }
                _ => {}
            }
        }
        self.waiters = kept;
    }

    /// Empties the queue (shutdown), handing every request back.
    pub fn drain(&mut self) -> impl Iterator<Item = Waiter<T>> + '_ {
        self.waiters.drain(..)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn at(t0: Instant, ms: u64) -> Instant {
        t0 + Duration::from_millis(ms)
    }

    #[test]
    fn a_waiting_request_never_delays_another_routes_and_is_answered_by_its_deadline() {
        let t0 = Instant::now();
        let mut q = WaitQueue::new(8);
        q.park(b"a#1".to_vec(), "a", at(t0, 100)).unwrap();
        q.park(b"b#1".to_vec(), "b", at(t0, 500)).unwrap();
        assert_eq!(q.next_deadline(), Some(at(t0, 100)));
        // b's pages are free, a's are not: b is answered, a keeps waiting.
        let mut seen = Vec::new();
        q.retry(at(t0, 10), |w, last| {
            seen.push((w.item, last));
            if w.item == "b" {
                Retry::Answered
            } else {
                Retry::StillWaiting
            }
        });
        assert_eq!(seen, [("a", false), ("b", false)]);
        assert_eq!(q.len(), 1);
        assert!(q.holds(b"a#1") && !q.holds(b"b#1"));
        // At its deadline a gets its last chance; a StillWaiting then ends it.
        let mut seen = Vec::new();
        q.retry(at(t0, 100), |w, last| {
            seen.push((w.item, last));
            Retry::StillWaiting
        });
        assert_eq!(seen, [("a", true)]);
        assert!(q.is_empty());
        assert_eq!(q.next_deadline(), None);
    }

    #[test]
    fn a_routes_later_frames_wait_behind_its_parked_one_in_order() {
        let t0 = Instant::now();
        let mut q = WaitQueue::new(8);
        q.park(b"r".to_vec(), 1, at(t0, 100)).unwrap();
        q.park(b"s".to_vec(), 2, at(t0, 100)).unwrap();
        q.park(b"r".to_vec(), 3, at(t0, 100)).unwrap();
        // 1 still waits, so 3 (same route) is not even tried; 2 is.
        let mut tried = Vec::new();
        q.retry(at(t0, 1), |w, _| {
            tried.push(w.item);
            if w.item == 1 {
                Retry::StillWaiting
            } else {
                Retry::Answered
            }
        });
        assert_eq!(tried, [1, 2]);
        // Once 1 is answered, 3 is tried in the same pass.
        let mut tried = Vec::new();
        q.retry(at(t0, 2), |w, _| {
            tried.push(w.item);
            Retry::Answered
        });
        assert_eq!(tried, [1, 3]);
        assert!(q.is_empty());
    }

    #[test]
    fn a_full_queue_refuses_and_counts_without_touching_what_waits() {
        let t0 = Instant::now();
        let mut q = WaitQueue::new(2);
        q.park(b"a".to_vec(), 'a', at(t0, 100)).unwrap();
        q.park(b"b".to_vec(), 'b', at(t0, 100)).unwrap();
        assert_eq!(q.park(b"c".to_vec(), 'c', at(t0, 100)), Err('c'));
        assert_eq!(q.refused(), 1);
        let left: Vec<char> = q.drain().map(|w| w.item).collect();
        assert_eq!(left, ['a', 'b']);
    }
}
