//! Sans-IO bookkeeping of a pull-mode sender (prefill side): which pages
//! are pinned (and granted to a receiver) for which pull, and when they may
//! be released.
//!
//! The shell (sockets, threads) drives [`PullPending`] with what it
//! observes — the reply to a `PullReadyNotif`, a `PullDoneSignal`, a failed
//! REQ, the passage of time — and acts on the returned outcomes. Nothing
//! here reads the clock: every method takes `now`.
//!
//! # Release rules
//!
//! A pull's pages are pinned from [`PullPending::insert`] (called *before*
//! the `PullReadyNotif` is sent) until one of:
//!
//! * **`PullDoneSignal`** ([`PullPending::on_done`]): the receiver finished
//!   reading; everything is released.
//! * **ack with `alloc_failed`** ([`PullPending::on_ack`]): the receiver rolled
//!   the whole message back and will not read; everything is released at
//!   once and the shell opens the peer's breaker.
//! * **ack `already_sent_indexes`**: the receiver already holds those keys
//!   and never reads their pages, so those pages are unpinned right away;
//!   the others stay pinned until Done. If the ack lists every page the
//!   pull is released at the ack (a Done that follows counts as duplicate).
//! * **REQ failure** ([`PullPending::on_req_failed`]): if the notification
//!   certainly never left (the notification never left) the pages are released at
//!   once. If it may have reached the receiver ([`Delivery::Unknown`]: reply
//!   timeout, broken socket after the send), the receiver may have accepted
//!   it and may read until its lease ends, so the pages stay pinned until
//!   `created + lease` (or an earlier Done) — never freed before the lease.
//! * **TTL sweep** (the TTL sweep): the safety net for a receiver
//!   that died; an entry is released at `created + max(ttl, lease)`, so
//!   never before its lease even with a TTL shorter than the lease.
//!
//! Released and swept ids are remembered for a bounded time in a bounded
//! set ([`RecentIds`]), so a late or repeated Done is recognised as
//! [`DoneOutcome::AlreadyReleased`] and never frees anything twice. A Done
//! for an id never seen is remembered in the (equally bounded) early-done
//! set; if that id is later inserted it is released at once.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::messages::PullReadyDoneAck;
use super::recent::RecentIds;
use crate::channel::GrantId;
use crate::memory::SealedMemObj;

/// Bounds of the sender's id memories.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PullPendingLimits {
    /// Most ids in the early-done set; the oldest is evicted beyond it.
    pub early_done_capacity: usize,
    /// How long an early Done is remembered.
    pub early_done_lifetime: Duration,
    /// Most recently released ids remembered (to classify late/duplicate Done).
    pub released_capacity: usize,
    /// How long a released id is remembered.
    pub released_lifetime: Duration,
}

impl Default for PullPendingLimits {
    /// 4096 early ids for 60 s; 16384 released ids for 10 minutes.
    fn default() -> Self {
        PullPendingLimits {
            early_done_capacity: 4096,
            early_done_lifetime: Duration::from_secs(60),
            released_capacity: 16384,
            released_lifetime: Duration::from_secs(600),
        }
    }
}

/// Why a pull's pages were released.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReleaseReason {
    /// The receiver's `PullDoneSignal`.
    Done,
    /// The ack said the receiver already holds every key.
    AllAlreadySent,
    /// The ack said `alloc_failed`.
    AllocFailed,
    /// The REQ failed before the notification left.
    ReqFailed,
    /// The TTL sweep (after the lease).
    Expired,
    /// The id was in the early-done set when it was inserted.
    EarlyDone,
    /// The receiver restarted: the process that could read the pull is gone.
    PeerRestarted,
}

/// A pull whose pages were just released. The pages are already unpinned;
/// they return to their pool when the caller drops them (and any other
/// holder drops its clones).
#[cfg_attr(not(test), allow(dead_code))] // details for tests and debugging
#[derive(Debug)]
pub struct ReleasedPull {
    /// The pull's id.
    pub pull_id: String,
    /// The receiver it was for.
    pub peer: String,
    /// The caller's tag (request id) given at insert.
    pub req_id: String,
    /// The pages still held by the entry, unpinned.
    pub pages: Vec<SealedMemObj>,
    /// The read grant the receiver held on them, to release on the channel.
    pub grant: Option<GrantId>,
    /// Why.
    pub reason: ReleaseReason,
    /// Whether the ack had arrived before the release.
    pub acked: bool,
}

/// What [`PullPending::insert`] did.
#[derive(Debug)]
pub enum InsertOutcome {
    /// Pages pinned; send the `PullReadyNotif` now.
    Pending,
    /// A Done for this id had already arrived (early-done set): nothing was
    /// pinned and the pages are handed back. Do not send the notification.
    AlreadyDone(ReleasedPull),
}

/// Why an insert was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum InsertError {
    /// The `pull_id` is already pending (ids must be fresh uuid4s).
    #[error("pull_id {0:?} is already pending")]
    DuplicatePullId(String),
    /// The `pull_id` is empty.
    #[error("pull_id is empty")]
    EmptyPullId,
}

/// What [`PullPending::on_ack`] did.
#[cfg_attr(not(test), allow(dead_code))] // details for tests and debugging
#[derive(Debug)]
pub enum AckOutcome {
    /// The receiver accepted; pages it already held were unpinned.
    Accepted {
        /// Pages unpinned because the receiver already had their keys.
        unpinned_early: usize,
        /// Pages still pinned, waiting for Done.
        still_pinned: usize,
        /// `already_sent_indexes` entries outside the pull (ignored).
        invalid_indexes: usize,
    },
    /// Every page was already on the receiver: the pull is released.
    AllAlreadySent(ReleasedPull),
    /// `alloc_failed=true`: the pull is released; open the peer's breaker.
    AllocFailed(ReleasedPull),
    /// The pull was already released (Done before ack, sweep, ...).
    AlreadyReleased {
        /// How it was released.
        reason: ReleaseReason,
        /// Whether this ack said `alloc_failed`.
        alloc_failed: bool,
    },
    /// The pull is not known at all (an ack for another pull, a bug).
    Unknown {
        /// Whether this ack said `alloc_failed`.
        alloc_failed: bool,
    },
    /// A second ack for an already acked pull; ignored.
    DuplicateAck,
}

impl AckOutcome {
    /// Whether the shell should open the peer's circuit breaker: exactly
    /// when the ack said `alloc_failed`, whatever the pull's state.
    pub fn opens_breaker(&self) -> bool {
        match self {
            AckOutcome::AllocFailed(_) => true,
            AckOutcome::AlreadyReleased { alloc_failed, .. }
            | AckOutcome::Unknown { alloc_failed } => *alloc_failed,
            _ => false,
        }
    }
}

/// What [`PullPending::on_done`] did.
#[cfg_attr(not(test), allow(dead_code))] // details for tests and debugging
#[derive(Debug)]
pub enum DoneOutcome {
    /// The pull's pages were released.
    Released(ReleasedPull),
    /// The pull had already been released (duplicate Done, Done after the
    /// sweep or after an all-already-sent ack). Nothing freed twice.
    AlreadyReleased(ReleaseReason),
    /// No such pull (yet): remembered in the bounded early-done set.
    Early,
}

/// Whether the `PullReadyNotif` of a failed REQ may have reached the receiver.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Delivery {
    /// The send itself failed: the receiver never saw the notification.
    NotSent,
    /// The send went out but the reply did not come (timeout, broken
    /// socket): the receiver may have accepted it.
    Unknown,
}

/// What [`PullPending::on_req_failed`] did.
#[cfg_attr(not(test), allow(dead_code))] // details for tests and debugging
#[derive(Debug)]
pub enum ReqFailedOutcome {
    /// Released now (the notification never left).
    Released(ReleasedPull),
    /// Kept pinned until `until` (the lease end) or an earlier Done.
    HeldUntilLease {
        /// When the sweep will release it.
        until: Instant,
    },
    /// No such pending pull.
    Unknown,
}

/// One pull swept by the TTL sweep.
#[derive(Clone, Debug)]
pub struct ExpiredPull {
    /// The pull's id.
    pub pull_id: String,
    /// The receiver.
    pub peer: String,
    /// The caller's tag.
    pub req_id: String,
    /// Pages that were still pinned (now unpinned and dropped).
    pub pages: usize,
    /// Whether the ack had arrived.
    pub acked: bool,
    /// The read grant to revoke on the channel: the receiver sent no Done,
    /// so a request of its may still be served from the pages.
    pub grant: Option<GrantId>,
    /// The pages, unpinned; keep them until the grant is quiescent.
    pub held: Vec<SealedMemObj>,
}

/// Counters of a sender's pinned pulls.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PullCounters {
    /// Pulls currently pending.
    pub pulls_pending: usize,
    /// Pages pinned by pending pulls.
    pub pinned_pages: usize,
    /// Pulls inserted.
    pub inserted: u64,
    /// Acks that said `alloc_failed`.
    pub acks_alloc_failed: u64,
    /// Pages unpinned at ack time because the receiver already held them.
    pub pages_unpinned_at_ack: u64,
    /// Pulls released at ack because every key was already sent.
    pub released_all_already_sent: u64,
    /// Done signals that released a pull.
    pub done_released: u64,
    /// Done signals that released a pull before its ack arrived.
    pub done_before_ack: u64,
    /// Done signals for an already released pull (duplicate or late).
    pub done_already_released: u64,
    /// Done signals for unknown pulls (recorded as early).
    pub done_early: u64,
    /// Inserts released at once because their id was in the early-done set.
    pub early_done_matched: u64,
    /// REQ failures released at once (the notification never left).
    pub req_failed_released: u64,
    /// REQ failures held until the lease (it may have been delivered).
    pub req_failed_held: u64,
    /// Calls to the TTL sweep.
    pub sweeps: u64,
    /// Pulls released by the sweep.
    pub expired: u64,
    /// Ids currently in the early-done set.
    pub early_done_size: usize,
}

#[derive(Debug)]
struct Entry {
    peer: String,
    req_id: String,
    /// `None` once unpinned early (already sent on the receiver).
    pages: Vec<Option<SealedMemObj>>,
    grant: Option<GrantId>,
    held: usize,
    created: Instant,
    lease: Duration,
    acked: bool,
    /// Set when the REQ failed with unknown delivery: release at the lease.
    req_failed: bool,
}

impl Entry {
    fn release_at(&self, ttl: Duration) -> Instant {
        if self.req_failed {
            self.created + self.lease
        } else {
            self.created + ttl.max(self.lease)
        }
    }
}

/// The sender's table of pulls whose pages are pinned for a receiver.
#[derive(Debug)]
pub struct PullPending {
    entries: HashMap<String, Entry>,
    early_done: RecentIds<()>,
    released: RecentIds<ReleaseReason>,
    pinned_pages: usize,
    counters: PullCounters,
}

impl Default for PullPending {
    fn default() -> Self {
        PullPending::new(PullPendingLimits::default())
    }
}

impl PullPending {
    /// An empty table with the given id-memory bounds.
    pub fn new(limits: PullPendingLimits) -> PullPending {
        PullPending {
            entries: HashMap::new(),
            early_done: RecentIds::new(limits.early_done_capacity, limits.early_done_lifetime),
            released: RecentIds::new(limits.released_capacity, limits.released_lifetime),
            pinned_pages: 0,
            counters: PullCounters::default(),
        }
    }

    /// Registers a pull and pins its pages. Call before sending the
    /// `PullReadyNotif` (so a Done can never precede the entry); `now` is
    /// the start of the lease, `lease` the read lease agreed with `peer` in
    /// the handshake; `grant` the receiver's read grant on the pages;
    /// `req_id` is a free-form tag returned with every release.
    #[allow(clippy::too_many_arguments)]
    pub fn insert(
        &mut self,
        pull_id: &str,
        peer: &str,
        req_id: &str,
        pages: Vec<SealedMemObj>,
        now: Instant,
        lease: Duration,
        grant: Option<GrantId>,
    ) -> Result<InsertOutcome, InsertError> {
        if pull_id.is_empty() {
            return Err(InsertError::EmptyPullId);
        }
        if self.entries.contains_key(pull_id) {
            return Err(InsertError::DuplicatePullId(pull_id.to_owned()));
        }
        self.counters.inserted += 1;
        if self.early_done.take(pull_id, now).is_some() {
            self.counters.early_done_matched += 1;
            self.released.insert(pull_id, ReleaseReason::EarlyDone, now);
            return Ok(InsertOutcome::AlreadyDone(ReleasedPull {
                pull_id: pull_id.to_owned(),
                peer: peer.to_owned(),
                req_id: req_id.to_owned(),
                pages,
                grant,
                reason: ReleaseReason::EarlyDone,
                acked: false,
            }));
        }
        for p in &pages {
            p.pin();
        }
        self.pinned_pages += pages.len();
        let held = pages.len();
        self.entries.insert(
            pull_id.to_owned(),
            Entry {
                peer: peer.to_owned(),
                req_id: req_id.to_owned(),
                pages: pages.into_iter().map(Some).collect(),
                grant,
                held,
                created: now,
                lease,
                acked: false,
                req_failed: false,
            },
        );
        Ok(InsertOutcome::Pending)
    }

    /// The receiver's reply to the notification.
    pub fn on_ack(&mut self, pull_id: &str, ack: &PullReadyDoneAck, now: Instant) -> AckOutcome {
        if ack.alloc_failed {
            self.counters.acks_alloc_failed += 1;
        }
        let Some(entry) = self.entries.get_mut(pull_id) else {
            return match self.released.get(pull_id, now) {
                Some(&reason) => AckOutcome::AlreadyReleased {
                    reason,
                    alloc_failed: ack.alloc_failed,
                },
                None => AckOutcome::Unknown {
                    alloc_failed: ack.alloc_failed,
                },
            };
        };
        if entry.acked {
            return AckOutcome::DuplicateAck;
        }
        entry.acked = true;
        entry.req_failed = false;
        if ack.alloc_failed {
            let released = self.release(pull_id, ReleaseReason::AllocFailed, now);
            return AckOutcome::AllocFailed(released);
        }
        // The receiver never reads pages of keys it already holds: unpin them now.
        let mut unpinned = 0;
        let mut invalid = 0;
        for &i in &ack.already_sent_indexes {
            match usize::try_from(i).ok().and_then(|i| entry.pages.get_mut(i)) {
                Some(slot) => {
                    if let Some(page) = slot.take() {
                        page.unpin();
                        unpinned += 1;
                    }
                }
                None => invalid += 1,
            }
        }
        entry.held -= unpinned;
        self.pinned_pages -= unpinned;
        self.counters.pages_unpinned_at_ack += unpinned as u64;
        if entry.held == 0 {
            self.counters.released_all_already_sent += 1;
            let released = self.release(pull_id, ReleaseReason::AllAlreadySent, now);
            return AckOutcome::AllAlreadySent(released);
        }
        AckOutcome::Accepted {
            unpinned_early: unpinned,
            still_pinned: entry.held,
            invalid_indexes: invalid,
        }
    }

    /// The receiver (`peer`) pull `pull_id` was announced to, while it is pending.
    pub fn peer_of(&self, pull_id: &str) -> Option<&str> {
        self.entries.get(pull_id).map(|e| e.peer.as_str())
    }

    /// A `PullDoneSignal` for `pull_id` arrived.
    pub fn on_done(&mut self, pull_id: &str, now: Instant) -> DoneOutcome {
        if let Some(entry) = self.entries.get(pull_id) {
            self.counters.done_released += 1;
            if !entry.acked {
                self.counters.done_before_ack += 1;
            }
            return DoneOutcome::Released(self.release(pull_id, ReleaseReason::Done, now));
        }
        if let Some(&reason) = self.released.get(pull_id, now) {
            self.counters.done_already_released += 1;
            return DoneOutcome::AlreadyReleased(reason);
        }
        self.counters.done_early += 1;
        self.early_done.insert(pull_id, (), now);
        DoneOutcome::Early
    }

    /// The REQ carrying the notification failed (timeout or broken socket).
    /// See the module docs for the rule: released now only when the
    /// notification certainly never left.
    pub fn on_req_failed(
        &mut self,
        pull_id: &str,
        delivery: Delivery,
        now: Instant,
    ) -> ReqFailedOutcome {
        let Some(entry) = self.entries.get_mut(pull_id) else {
            return ReqFailedOutcome::Unknown;
        };
        match delivery {
            Delivery::NotSent => {
                self.counters.req_failed_released += 1;
                ReqFailedOutcome::Released(self.release(pull_id, ReleaseReason::ReqFailed, now))
            }
            Delivery::Unknown => {
                self.counters.req_failed_held += 1;
                entry.req_failed = true;
                ReqFailedOutcome::HeldUntilLease {
                    until: entry.created + entry.lease,
                }
            }
        }
    }

    /// Releases every pull that is due at `now`: `created + max(ttl, lease)`,
    /// or `created + lease` after a REQ failure of unknown delivery. The
    /// pages are unpinned and handed back with each expired pull.
    pub fn sweep(&mut self, now: Instant, ttl: Duration) -> Vec<ExpiredPull> {
        self.counters.sweeps += 1;
        self.early_done.expire(now);
        self.released.expire(now);
        let due: Vec<String> = self
            .entries
            .iter()
            .filter(|(_, e)| now >= e.release_at(ttl))
            .map(|(id, _)| id.clone())
            .collect();
        self.counters.expired += due.len() as u64;
        self.release_all(due, ReleaseReason::Expired, now)
    }

    /// Releases each of `ids` for `reason`, handing back its pages.
    fn release_all(
        &mut self,
        ids: Vec<String>,
        reason: ReleaseReason,
        now: Instant,
    ) -> Vec<ExpiredPull> {
        ids.into_iter()
            .map(|id| {
                let r = self.release(&id, reason, now);
                ExpiredPull {
                    pull_id: r.pull_id,
                    peer: r.peer,
                    req_id: r.req_id,
                    pages: r.pages.len(),
                    acked: r.acked,
                    grant: r.grant,
                    held: r.pages,
                }
            })
            .collect()
    }

    /// Releases every pull announced to `peer`, whose process is known to
    /// be gone (it restarted: a new incarnation answers on its port). The
    /// pages are unpinned and handed back as with the sweep; the caller
    /// revokes the grants and keeps the pages until the channel is
    /// quiescent.
    pub fn release_peer(&mut self, peer: &str, now: Instant) -> Vec<ExpiredPull> {
        let gone: Vec<String> = self
            .entries
            .iter()
            .filter(|(_, e)| e.peer == peer)
            .map(|(id, _)| id.clone())
            .collect();
        self.release_all(gone, ReleaseReason::PeerRestarted, now)
    }

    #[cfg(test)]
    /// The earliest instant at which the TTL sweep with `ttl` would
    /// release something (for the shell's timer), if anything is pending.
    pub fn next_expiry(&self, ttl: Duration) -> Option<Instant> {
        self.entries.values().map(|e| e.release_at(ttl)).min()
    }

    #[cfg(test)]
    /// Whether `pull_id` is pending.
    pub fn contains(&self, pull_id: &str) -> bool {
        self.entries.contains_key(pull_id)
    }

    /// Pages pinned by pending pulls (the input of [`super::Backpressure::check`]).
    pub fn pinned_pages(&self) -> usize {
        self.pinned_pages
    }

    /// Pulls pending.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// The requests (`req_id` tags) with a pull pending, each once.
    pub fn requests(&self) -> Vec<String> {
        let mut ids: Vec<String> = self.entries.values().map(|e| e.req_id.clone()).collect();
        ids.sort();
        ids.dedup();
        ids
    }

    #[cfg(test)]
    /// Whether no pull is pending.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The counters.
    pub fn counters(&self) -> PullCounters {
        PullCounters {
            pulls_pending: self.entries.len(),
            pinned_pages: self.pinned_pages,
            early_done_size: self.early_done.len(),
            ..self.counters
        }
    }

    /// Removes the entry (which must exist), unpins what it still holds and
    /// remembers the id as released.
    fn release(&mut self, pull_id: &str, reason: ReleaseReason, now: Instant) -> ReleasedPull {
        let (pull_id, entry) = self
            .entries
            .remove_entry(pull_id)
            .expect("release is only called for pending pulls");
        let pages: Vec<SealedMemObj> = entry.pages.into_iter().flatten().collect();
        for p in &pages {
            p.unpin();
        }
        self.pinned_pages -= pages.len();
        self.released.insert(&pull_id, reason, now);
        ReleasedPull {
            pull_id,
            peer: entry.peer,
            req_id: entry.req_id,
            pages,
            grant: entry.grant,
            reason,
            acked: entry.acked,
        }
    }
}
