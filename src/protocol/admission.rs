//! Deadlock-free admission of multi-batch requests (plain logic, time and
//! pool occupancy passed in).
//!
//! Upstream LMCache's async backend sends a request's keys in several
//! `AllocRequest` batches carrying `req_id`, `total_chunks` and
//! `is_last_batch`. Allocated batch by batch, several such requests can
//! each hold part of the pool and all wait for the rest: none completes.
//! Here a request's whole page budget is reserved when its first batch
//! arrives — or it is refused at once, never left half-admitted — and its
//! later batches draw on the reservation. Requests without those fields
//! are admitted batch by batch from the pages nobody reserved (and may
//! wait for them, as before). A reservation ends with the request's last
//! batch, its cancel, or `idle` after its last activity.

use std::collections::HashMap;
use std::time::{Duration, Instant};

/// What a batch says about its request (the async `AllocRequest` fields).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchOf<'a> {
    /// The request.
    pub req_id: &'a str,
    /// Chunks of the whole request.
    pub total_chunks: usize,
    /// Whether this batch is the request's last.
    pub last: bool,
}

/// The decision for one batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Gate {
    /// Allocate the batch now.
    Go,
    /// Not enough unreserved pages yet: wait (the caller's deadline applies).
    Wait,
    /// Refused at once; the reason names the numbers.
    Refuse(String),
}

#[derive(Debug)]
struct Reservation {
    /// Pages still reserved for the request's later batches.
    remaining: usize,
    /// Dropped if no batch comes by then.
    expires: Instant,
}

/// The reservations of one receiver pool.
#[derive(Debug)]
pub struct Admission {
    reservations: HashMap<String, Reservation>,
    idle: Duration,
    /// Reservations refused (the request could not fit).
    pub refused: u64,
    /// Reservations dropped unfinished at their idle timeout.
    pub expired: u64,
}

/// Requests with a reservation at once; beyond, new multi-batch requests
/// are refused (each reservation also takes pages, so this is rarely hit).
pub const MAX_RESERVATIONS: usize = 4096;

impl Admission {
    /// No reservations; one lasts `idle` after its request's last batch.
    pub fn new(idle: Duration) -> Admission {
        Admission {
            reservations: HashMap::new(),
            idle,
            refused: 0,
            expired: 0,
        }
    }

    /// Pages reserved for requests' later batches.
    pub fn reserved(&self) -> usize {
        self.reservations.values().map(|r| r.remaining).sum()
    }

    /// Requests holding a reservation.
    pub fn open(&self) -> usize {
        self.reservations.len()
    }

    /// Decides a batch needing `pages` new pages when `free` pages of the
    /// pool are free, for request `of` when the batch said which.
    pub fn admit(
        &mut self,
        now: Instant,
        of: Option<BatchOf<'_>>,
        pages: usize,
        free: usize,
    ) -> Gate {
        self.sweep(now);
        let unreserved = free.saturating_sub(self.reserved());
        let Some(b) = of else {
            return if pages <= unreserved {
                Gate::Go
            } else {
                Gate::Wait
            };
        };
        if let Some(r) = self.reservations.get(b.req_id) {
            // A request sending more than it announced draws the rest from
            // the unreserved pages, like any other batch.
            let extra = pages.saturating_sub(r.remaining);
            return if extra <= unreserved {
                Gate::Go
            } else {
                Gate::Wait
            };
        }
        // The first batch: the whole request must fit now.
        let need = b.total_chunks.max(pages);
        if need > unreserved || self.reservations.len() >= MAX_RESERVATIONS {
            self.refused += 1;
            return Gate::Refuse(format!(
                "request {:?} needs {need} page(s) for its {} chunk(s); {unreserved} of {free} free \
                 page(s) are not reserved by other requests: refused now rather than admitted in \
                 part (retry later, or give the receiver a larger pd_buffer_size)",
                b.req_id, b.total_chunks
            ));
        }
        if !b.last {
            self.reservations.insert(
                b.req_id.to_string(),
                Reservation {
                    remaining: need,
                    expires: now + self.idle,
                },
            );
        }
        Gate::Go
    }

    /// A batch admitted by [`Admission::admit`] was allocated `used` pages.
    pub fn allocated(&mut self, now: Instant, of: Option<BatchOf<'_>>, used: usize) {
        let Some(b) = of else { return };
        if b.last {
            self.reservations.remove(b.req_id);
            return;
        }
        if let Some(r) = self.reservations.get_mut(b.req_id) {
            r.remaining = r.remaining.saturating_sub(used);
            r.expires = now + self.idle;
        }
    }

    /// The request was cancelled (or is otherwise over): its reservation goes.
    pub fn release(&mut self, req_id: &str) -> bool {
        self.reservations.remove(req_id).is_some()
    }

    /// Drops reservations whose request went quiet.
    pub fn sweep(&mut self, now: Instant) {
        let before = self.reservations.len();
        self.reservations.retain(|_, r| now < r.expires);
        self.expired += (before - self.reservations.len()) as u64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const IDLE: Duration = Duration::from_secs(30);

    fn batch(req: &str, total: usize, last: bool) -> Option<BatchOf<'_>> {
        Some(BatchOf {
            req_id: req,
            total_chunks: total,
            last,
        })
    }

    /// Four requests of 4 chunks, sent 2 at a time, on an 8-page pool.
    /// Batch by batch, each first batch fits (8 pages taken) and every
    /// second batch waits for pages that never come: a deadlock. With
    /// reservations, two requests are admitted whole and complete; the
    /// other two are refused at once, and fit once the first are done.
    #[test]
    fn concurrent_multi_batch_requests_complete_or_are_refused_never_deadlock() {
        let t = Instant::now();
        let mut a = Admission::new(IDLE);
        let mut free = 8usize;
        let mut held: HashMap<&str, usize> = HashMap::new();
        let mut refused = Vec::new();
        // Every request's first batch arrives before any second batch.
        for r in ["r1", "r2", "r3", "r4"] {
            match a.admit(t, batch(r, 4, false), 2, free) {
                Gate::Go => {
                    free -= 2;
                    a.allocated(t, batch(r, 4, false), 2);
                    *held.entry(r).or_default() += 2;
                }
                Gate::Refuse(why) => {
                    assert!(why.contains("needs 4 page(s)"), "{why}");
                    refused.push(r);
                }
                Gate::Wait => panic!("{r}: a first batch never waits"),
            }
        }
        assert_eq!(refused, ["r3", "r4"]);
        assert_eq!(a.reserved(), 4, "two pages left for each admitted request");
        // Their second batches draw on the reservation: no waiting.
        for r in ["r1", "r2"] {
            assert_eq!(a.admit(t, batch(r, 4, true), 2, free), Gate::Go, "{r}");
            free -= 2;
            a.allocated(t, batch(r, 4, true), 2);
            *held.get_mut(r).unwrap() += 2;
        }
        assert_eq!((free, a.reserved(), a.open()), (0, 0, 0));
        assert_eq!(held["r1"] + held["r2"], 8);
        // r1 and r2 are loaded and their pages freed: r3 now fits.
        free = 8;
        assert_eq!(a.admit(t, batch("r3", 4, false), 2, free), Gate::Go);
        assert_eq!(a.refused, 2);
    }

    #[test]
    fn batches_without_a_request_use_only_unreserved_pages() {
        let t = Instant::now();
        let mut a = Admission::new(IDLE);
        assert_eq!(a.admit(t, batch("big", 6, false), 2, 8), Gate::Go);
        a.allocated(t, batch("big", 6, false), 2);
        // 6 free, 4 of them reserved for "big".
        assert_eq!(a.admit(t, None, 2, 6), Gate::Go);
        assert_eq!(a.admit(t, None, 3, 6), Gate::Wait);
        // A cancel frees the reservation.
        assert!(a.release("big"));
        assert_eq!(a.admit(t, None, 3, 6), Gate::Go);
    }

    #[test]
    fn a_single_batch_request_reserves_nothing() {
        let t = Instant::now();
        let mut a = Admission::new(IDLE);
        assert_eq!(a.admit(t, batch("one", 3, true), 3, 4), Gate::Go);
        a.allocated(t, batch("one", 3, true), 3);
        assert_eq!((a.reserved(), a.open()), (0, 0));
        assert!(matches!(
            a.admit(t, batch("two", 5, true), 5, 4),
            Gate::Refuse(_)
        ));
    }

    #[test]
    fn a_quiet_reservation_expires_and_a_larger_batch_draws_the_rest() {
        let t = Instant::now();
        let mut a = Admission::new(IDLE);
        a.admit(t, batch("r", 4, false), 1, 8);
        a.allocated(t, batch("r", 4, false), 1);
        assert_eq!(a.reserved(), 3);
        // More than announced: the extra comes from unreserved pages.
        assert_eq!(a.admit(t, batch("r", 4, false), 5, 7), Gate::Go);
        assert_eq!(a.admit(t, batch("r", 4, false), 8, 7), Gate::Wait);
        a.sweep(t + IDLE);
        assert_eq!((a.reserved(), a.expired), (0, 1));
    }
}
