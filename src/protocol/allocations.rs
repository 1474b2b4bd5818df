//! The push side of a receiver: the pages lent to each writer for one
//! `AllocRequest`, from the allocation to the writer's notice (or its
//! deadline) and the channel's word that nobody can touch them any more;
//! and what is remembered after (the answer to a repeated notice, routes
//! whose writers gave up).
//!
//! Plain data with the rules of an allocation's life; the keys the pages
//! are for live in [`super::receiver::ReceiverCore`]'s store.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::notice::PushOutcome;
use super::receiver::AllocId;
use super::recent::RecentIds;
use crate::channel::GrantId;
use crate::memory::{BufferRef, LentPage};

/// How many ended allocations are remembered for repeated notices.
pub(crate) const ENDED_CAPACITY: usize = 4096;
/// How long an ended allocation's answer is remembered.
pub(crate) const ENDED_LIFETIME: Duration = Duration::from_secs(600);

/// Pages lent to one writer for one `AllocRequest`.
#[derive(Debug)]
pub(crate) struct Allocation {
    pub route: String,
    /// Key of each page (in response order).
    pub keys: Vec<String>,
    pub pages: Vec<LentPage>,
    pub refs: Vec<BufferRef>,
    pub grant: GrantId,
    pub deadline: Instant,
    pub state: AllocState,
}

/// Where an allocation is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum AllocState {
    /// Lent to the writer, waiting for its notice.
    Open,
    /// No notice by the deadline: keys dropped, grant revoked, pages
    /// quarantined until the writer is quiescent.
    Revoked,
    /// The writer's notice came (its transfer is over), but the channel is
    /// still serving requests under the grant (tcp): the outcome applies
    /// once they end.
    Ending(PushOutcome),
}

/// The answer a route's last ended allocation got, with its pages.
pub(crate) type EndedAnswer = (Vec<BufferRef>, Result<(), String>);

/// Every allocation of a receiver, by id and by route.
#[derive(Debug)]
pub(crate) struct PushAllocations {
    allocs: HashMap<AllocId, Allocation>,
    /// The pending allocation of each route (a route has at most one: its
    /// writer sends the notice before its next request).
    by_route: HashMap<String, AllocId>,
    next: u64,
    /// The answer given to each route's last ended allocation, so a notice
    /// repeated after a lost reply gets the same answer.
    ended: RecentIds<EndedAnswer>,
    /// Routes whose writers said they gave them up (an `aborted` notice
    /// naming no pages): a request still in flight on one is refused.
    given_up: RecentIds<()>,
}

impl Default for PushAllocations {
    fn default() -> PushAllocations {
        PushAllocations {
            allocs: HashMap::new(),
            by_route: HashMap::new(),
            next: 0,
            ended: RecentIds::new(ENDED_CAPACITY, ENDED_LIFETIME),
            given_up: RecentIds::new(ENDED_CAPACITY, ENDED_LIFETIME),
        }
    }
}

impl PushAllocations {
    /// The id the next allocation gets (its keys are stored under it
    /// before it is [opened](PushAllocations::open)).
    pub(crate) fn next_id(&mut self) -> AllocId {
        let id = AllocId(self.next);
        self.next += 1;
        id
    }

    /// Opens allocation `id`: the pending one of its route from now on.
    pub(crate) fn open(&mut self, id: AllocId, a: Allocation) {
        self.by_route.insert(a.route.clone(), id);
        self.allocs.insert(id, a);
    }

    /// The pending allocation of `route`.
    pub(crate) fn of_route(&self, route: &str) -> Option<AllocId> {
        self.by_route.get(route).copied()
    }

    /// `route` has no pending allocation any more (its notice came).
    pub(crate) fn close_route(&mut self, route: &str) {
        self.by_route.remove(route);
    }

    pub(crate) fn get(&self, id: AllocId) -> Option<&Allocation> {
        self.allocs.get(&id)
    }

    pub(crate) fn get_mut(&mut self, id: AllocId) -> Option<&mut Allocation> {
        self.allocs.get_mut(&id)
    }

    /// Takes allocation `id` out (it ended), closing its route if it is
    /// still that route's pending one.
    pub(crate) fn take(&mut self, id: AllocId) -> Option<Allocation> {
        let a = self.allocs.remove(&id)?;
        if self.by_route.get(&a.route) == Some(&id) {
            self.by_route.remove(&a.route);
        }
        Some(a)
    }

    /// Remembers the answer `route`'s notice got, for a repeat.
    pub(crate) fn remember_end(&mut self, route: &str, answer: EndedAnswer, now: Instant) {
        self.ended.insert(route, answer, now);
    }

    /// The answer `route`'s last ended allocation got, if remembered.
    pub(crate) fn ended_answer(&self, route: &str, now: Instant) -> Option<&EndedAnswer> {
        self.ended.get(route, now)
    }

    /// The writer of `route` gave it up: a request still on its way there
    /// must not allocate.
    pub(crate) fn give_up(&mut self, route: &str, now: Instant) {
        self.given_up.insert(route, (), now);
    }

    /// Whether the writer of `route` gave it up.
    pub(crate) fn is_given_up(&self, route: &str, now: Instant) -> bool {
        self.given_up.get(route, now).is_some()
    }

    /// Grants of allocations waiting for the channel to say nobody can
    /// touch their pages (revoked, or ended while requests were served).
    pub(crate) fn awaiting_quiescence(&self) -> Vec<GrantId> {
        self.allocs
            .values()
            .filter(|a| a.state != AllocState::Open)
            .map(|a| a.grant)
            .collect()
    }

    /// The allocation of `grant` that waits for quiescence, and its state.
    pub(crate) fn settling(&self, grant: GrantId) -> Option<(AllocId, AllocState)> {
        self.allocs
            .iter()
            .find(|(_, a)| a.state != AllocState::Open && a.grant == grant)
            .map(|(id, a)| (*id, a.state))
    }

    /// Open allocations whose landing deadline has passed at `now`.
    pub(crate) fn late(&self, now: Instant) -> Vec<AllocId> {
        self.allocs
            .iter()
            .filter(|(_, a)| a.state == AllocState::Open && now >= a.deadline)
            .map(|(id, _)| *id)
            .collect()
    }

    /// (open, waiting for quiescence).
    pub(crate) fn counts(&self) -> (usize, usize) {
        let waiting = self
            .allocs
            .values()
            .filter(|a| a.state != AllocState::Open)
            .count();
        (self.allocs.len() - waiting, waiting)
    }

    /// Takes every allocation out (the receiver stops).
    pub(crate) fn drain(&mut self) -> Vec<Allocation> {
        self.by_route.clear();
        self.allocs.drain().map(|(_, a)| a).collect()
    }
}
