//! The router-native flow's decisions on the prefill side (sans-IO): saves
//! whose decode is not known yet are *parked* under a transfer id until a
//! decode registers for them, for at most the parking time.
//!
//! A save is expected from its submission on ([`ParkingLot::expect`]): a
//! registration may arrive before its gather finished (the prefill
//! answered the request while its save was still gathering), and is kept
//! until the pages are parked ([`ParkingLot::park`]), which then attaches
//! at once. Each transfer attaches once; a later registration for it (a
//! second decode rank, a retry) is answered as already taken. A transfer
//! no decode registered for within the parking time expires
//! ([`ParkingLot::expire`]): its pages go back to the pool and a late
//! registration is told it expired, not that the id is unknown. The
//! payload `P` is whatever the shell parks (the gathered pages); the lot
//! never looks inside it.

use super::recent::RecentIds;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// How long ended transfers are remembered (to tell a late registration
/// why), and how many at most.
const ENDED_MEMORY: Duration = Duration::from_secs(600);
const ENDED_CAPACITY: usize = 4096;

/// How a transfer left the lot, as told to a late registration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ended {
    /// A decode registered and the transfer went to it.
    Attached,
    /// No decode registered within the parking time.
    Expired,
    /// The prefill cancelled it (its request ended abnormally, or the
    /// sender closed).
    Cancelled,
}

/// What a registration found.
#[derive(Debug, PartialEq, Eq)]
pub enum Registered<P, R> {
    /// The transfer was parked: send it to the registrant now.
    Attach(P, R),
    /// The transfer is still gathering: it goes to the registrant once parked.
    Held,
    /// The transfer already went (or goes) to the first registrant.
    AlreadyTaken,
    /// The transfer ended before this registration.
    Ended(Ended),
    /// No transfer of that id is known here.
    Unknown,
}

/// Counters of the lot.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ParkingCounters {
    /// Transfers parked (gathered with no decode known).
    pub parked: u64,
    /// Registrations that attached a transfer.
    pub attached: u64,
    /// Transfers freed because no decode registered in time.
    pub expired: u64,
    /// Registrations answered with an error (unknown, expired, cancelled).
    pub refused: u64,
    /// Transfers parked now.
    pub parked_now: u64,
}

enum Slot<P, R> {
    /// Submitted, still gathering; a registration may already wait.
    Gathering {
        deadline: Instant,
        waiting: Option<R>,
    },
    /// Gathered and parked.
    Parked { deadline: Instant, payload: P },
}

/// The parked transfers of one prefill rank (see the [module docs](self)).
pub struct ParkingLot<P, R> {
    timeout: Duration,
    slots: HashMap<String, Slot<P, R>>,
    ended: RecentIds<Ended>,
    counters: ParkingCounters,
}

impl<P, R> ParkingLot<P, R> {
    /// A lot whose transfers wait at most `timeout` for a registration.
    pub fn new(timeout: Duration) -> ParkingLot<P, R> {
        ParkingLot {
            timeout,
            slots: HashMap::new(),
            ended: RecentIds::new(ENDED_CAPACITY, ENDED_MEMORY),
            counters: ParkingCounters::default(),
        }
    }

    /// The parking time.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// A save of transfer `id` was submitted at `now`: a registration for
    /// it is held until it is parked. False if `id` is in the lot already.
    pub fn expect(&mut self, id: &str, now: Instant) -> bool {
        if self.slots.contains_key(id) {
            return false;
        }
        self.slots.insert(
            id.to_owned(),
            Slot::Gathering {
                deadline: now + self.timeout,
                waiting: None,
            },
        );
        true
    }

    /// Transfer `id` is gathered into `payload` at `now`.
    /// `Ok(Some((payload, registration)))`: a decode registered meanwhile,
    /// send it there now; `Ok(None)`: parked; `Err(payload)`: the transfer
    /// is not expected (cancelled or expired meanwhile), free it.
    pub fn park(&mut self, id: &str, payload: P, now: Instant) -> Result<Option<(P, R)>, P> {
        match self.slots.remove(id) {
            Some(Slot::Gathering {
                waiting: Some(r), ..
            }) => {
                self.counters.attached += 1;
                self.ended.insert(id, Ended::Attached, now);
                Ok(Some((payload, r)))
            }
            Some(Slot::Gathering {
                deadline,
                waiting: None,
            }) => {
                self.slots
                    .insert(id.to_owned(), Slot::Parked { deadline, payload });
                self.counters.parked += 1;
                self.counters.parked_now += 1;
                Ok(None)
            }
            Some(other) => {
                self.slots.insert(id.to_owned(), other);
                Err(payload)
            }
            None => Err(payload),
        }
    }

    /// A decode registered `registration` for transfer `id` at `now`.
    pub fn register(&mut self, id: &str, registration: R, now: Instant) -> Registered<P, R> {
        let verdict = match self.slots.remove(id) {
            Some(Slot::Parked { payload, .. }) => {
                self.counters.attached += 1;
                self.counters.parked_now -= 1;
                self.ended.insert(id, Ended::Attached, now);
                return Registered::Attach(payload, registration);
            }
            Some(Slot::Gathering {
                deadline,
                waiting: None,
            }) => {
                self.slots.insert(
                    id.to_owned(),
                    Slot::Gathering {
                        deadline,
                        waiting: Some(registration),
                    },
                );
                return Registered::Held;
            }
            Some(held @ Slot::Gathering { .. }) => {
                self.slots.insert(id.to_owned(), held);
                return Registered::AlreadyTaken;
            }
            None => match self.ended.get(id, now) {
                Some(Ended::Attached) => return Registered::AlreadyTaken,
                Some(e) => Registered::Ended(*e),
                None => Registered::Unknown,
            },
        };
        self.counters.refused += 1;
        verdict
    }

    /// Cancels transfer `id`: its payload if it was parked (free it).
    /// `None` also when it was gathering (its [`ParkingLot::park`] then
    /// fails) or unknown.
    pub fn cancel(&mut self, id: &str, now: Instant) -> Option<P> {
        let slot = self.slots.remove(id)?;
        self.ended.insert(id, Ended::Cancelled, now);
        match slot {
            Slot::Parked { payload, .. } => {
                self.counters.parked_now -= 1;
                Some(payload)
            }
            Slot::Gathering { .. } => None,
        }
    }

    /// The transfers whose parking time ended by `now`: each with its
    /// payload if it was parked (free it), `None` if it was still
    /// gathering (its park then fails).
    pub fn expire(&mut self, now: Instant) -> Vec<(String, Option<P>)> {
        let due: Vec<String> = self
            .slots
            .iter()
            .filter(|(_, s)| match s {
                Slot::Gathering {
                    deadline,
                    waiting: None,
                } => *deadline <= now,
                Slot::Parked { deadline, .. } => *deadline <= now,
                _ => false,
            })
            .map(|(id, _)| id.clone())
            .collect();
        let mut out = Vec::with_capacity(due.len());
        for id in due {
            let payload = match self.slots.remove(&id) {
                Some(Slot::Parked { payload, .. }) => {
                    self.counters.parked_now -= 1;
                    Some(payload)
                }
                _ => None,
            };
            self.counters.expired += 1;
            self.ended.insert(&id, Ended::Expired, now);
            out.push((id, payload));
        }
        out
    }

    /// The ids of the transfers in the lot (gathering or parked).
    pub fn ids(&self) -> Vec<String> {
        self.slots.keys().cloned().collect()
    }

    /// Transfers in the lot (gathering or parked).
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Whether the lot is empty.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// The lot's counters.
    pub fn counters(&self) -> ParkingCounters {
        self.counters
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Duration = Duration::from_secs(30);

    fn lot() -> ParkingLot<Vec<u32>, &'static str> {
        ParkingLot::new(T)
    }

    #[test]
    fn a_registration_attaches_a_parked_transfer_once() {
        let (mut l, t0) = (lot(), Instant::now());
        assert!(l.expect("a", t0));
        assert!(!l.expect("a", t0), "an id is expected once");
        assert_eq!(l.park("a", vec![1, 2], t0), Ok(None));
        assert_eq!(l.counters().parked_now, 1);
        assert_eq!(
            l.register("a", "decode-1", t0 + Duration::from_secs(1)),
            Registered::Attach(vec![1, 2], "decode-1")
        );
        assert_eq!(l.register("a", "decode-2", t0), Registered::AlreadyTaken);
        assert!(l.is_empty());
        let c = l.counters();
        assert_eq!(
            (c.parked, c.attached, c.parked_now, c.refused),
            (1, 1, 0, 0)
        );
    }

    #[test]
    fn a_registration_before_the_gather_ended_is_held_until_parked() {
        let (mut l, t0) = (lot(), Instant::now());
        l.expect("a", t0);
        assert_eq!(l.register("a", "d", t0), Registered::Held);
        assert_eq!(l.register("a", "other", t0), Registered::AlreadyTaken);
        // Held registrations keep the transfer from expiring.
        assert!(l.expire(t0 + T * 2).is_empty());
        assert_eq!(l.park("a", vec![7], t0), Ok(Some((vec![7], "d"))));
        assert!(l.is_empty());
        assert_eq!(l.register("a", "late", t0), Registered::AlreadyTaken);
    }

    #[test]
    fn unregistered_transfers_expire_and_late_registrations_are_told_so() {
        let (mut l, t0) = (lot(), Instant::now());
        l.expect("parked", t0);
        l.park("parked", vec![1], t0).unwrap();
        l.expect("gathering", t0);
        assert!(l.expire(t0 + T - Duration::from_millis(1)).is_empty());
        let mut gone = l.expire(t0 + T);
        gone.sort();
        assert_eq!(
            gone,
            vec![
                ("gathering".to_owned(), None),
                ("parked".to_owned(), Some(vec![1]))
            ]
        );
        // The gather that ends after its expiry is refused: free its pages.
        assert_eq!(l.park("gathering", vec![9], t0 + T), Err(vec![9]));
        assert_eq!(
            l.register("parked", "d", t0 + T),
            Registered::Ended(Ended::Expired)
        );
        assert_eq!(l.register("nobody", "d", t0), Registered::Unknown);
        let c = l.counters();
        assert_eq!((c.expired, c.refused, c.parked_now), (2, 2, 0));
    }

    #[test]
    fn a_cancelled_transfer_frees_its_pages_and_refuses_registrations() {
        let (mut l, t0) = (lot(), Instant::now());
        l.expect("a", t0);
        l.park("a", vec![3], t0).unwrap();
        assert_eq!(l.cancel("a", t0), Some(vec![3]));
        assert_eq!(
            l.register("a", "d", t0),
            Registered::Ended(Ended::Cancelled)
        );
        l.expect("b", t0);
        assert_eq!(l.cancel("b", t0), None);
        assert_eq!(l.park("b", vec![4], t0), Err(vec![4]));
        assert_eq!(l.cancel("nobody", t0), None);
        assert!(l.is_empty());
    }
}
