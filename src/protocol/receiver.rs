//! The receiver's sans-IO core (decode side): which keys it holds, in what
//! state, which of its pages are lent to which writer, and what to answer
//! and signal.
//!
//! [`ReceiverCore`] is driven by the messages the shell receives
//! ([`ReceiverCore::plan_push`] / [`ReceiverCore::commit_push`],
//! [`ReceiverCore::on_push_notice`], [`ReceiverCore::plan_pull`] /
//! [`ReceiverCore::commit_pull`]), by what the shell's transfers report
//! ([`ReceiverCore::on_read_complete`], [`ReceiverCore::end_proxy_read`]),
//! by what the channel says of revoked grants ([`ReceiverCore::on_quiescent`])
//! and by time ([`ReceiverCore::sweep`]). It returns the reply to send, the
//! grants to release or revoke and any [`SendPullDone`]; it never touches a
//! socket, a channel or the clock.
//!
//! # Key states
//!
//! | state | pages | load path ([`ReceiverCore::get`]) |
//! |---|---|---|
//! | Resident | one sealed page, data landed | [`Lookup::Resident`] |
//! | PendingPush | a page lent to its writer | [`Lookup::NotReady`] |
//! | PendingRead | a page owned by the pull-eager read in flight | [`Lookup::NotReady`] |
//! | Proxy | none; the sender's [`BufferRef`] | [`Lookup::Proxy`] (or [`Lookup::Expired`] within the read margin) |
//!
//! # Push allocations
//!
//! An `AllocRequest` arrives on a request socket whose identity, the
//! *route*, names its writer (`<node>#<n>`, see `notice`). Its new keys get
//! pages that are *lent* to that writer ([`LentPage`]: no local access)
//! and granted to it on the channel. The allocation ends with the writer's
//! [`PushNotice`] on the same route, matched by route and pages: `landed`
//! makes the keys resident, `aborted` frees the pages. A notice from another
//! route, or naming other pages, is refused. An allocation with no notice
//! by `pd_push_landing_timeout` loses its keys and its grant is *revoked*;
//! its pages stay quarantined until the channel says the writer can no
//! longer touch them (or a late notice proves it), and only then return to
//! the pool. No page ever goes to someone else while a writer may write it.
//!
//! **Dedup**: a key in *any* state counts as present
//! ([`ReceiverCore::partition`]), so a second message for a key that is
//! still landing is not transferred twice; the only exception is a proxy
//! whose read window has passed, which is unreadable and is replaced.
//!
//! # Ordering
//!
//! Every handler returns the reply (ack) first-class; a Done is only ever
//! produced by a later call (read complete, proxy consumed/discarded,
//! sweep) or, for a pull with nothing to read, in the same reply's
//! `done` — which the shell sends after the reply. So "ack before Done"
//! is the natural order.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::context::{ProxyReadError, ReadOutcome, SendPullDone, SlotState, TransferContext};
use super::lease::{from_wire_micros, read_margin, PullId};
use super::messages::{
    AllocRequest, AscendAllocResponse, MessageType, PullReadyDoneAck, PullReadyNotif,
};
use super::notice::{route_node, PushNotice, PushOutcome};
use super::ownership::KeyOwnership;
use super::pulls::{DelayContexts, EagerPull, EagerPulls};
use super::recent::RecentIds;
use super::validate::{check_alloc_request, check_pull_notif, CheckedPull, InvalidMessage};
use crate::channel::GrantId;
use crate::layout::ChunkLayout;
use crate::memory::{BufferRef, ChunkMeta, LentPage, MemObj, MemoryError, SealedMemObj};

use super::allocations::{AllocState, Allocation, PushAllocations, ENDED_CAPACITY};
/// How long a key whose proxy expired is reported as expired (not as
/// never stored) when it is looked up.
const EXPIRED_KEY_LIFETIME: Duration = Duration::from_secs(60);

/// How many withdrawn requests (see [`ReceiverCore::cancel`]) are
/// remembered at once; beyond it the oldest is forgotten, and a late
/// message of that request is served as before (its chunks wait for
/// `pd_resident_ttl` or their lease).
const WITHDRAWN_CAPACITY: usize = ENDED_CAPACITY;

/// How long a withdrawn request is remembered when chunks never expire
/// (`pd_resident_ttl: 0`): the default `pd_resident_ttl`, far beyond any
/// prefill's queueing delay.
const WITHDRAWN_LIFETIME_WITHOUT_TTL: Duration = Duration::from_secs(600);

/// Why a load cannot have a chunk dropped at `pd_resident_ttl`.
pub const RESIDENT_EXPIRED: &str = "it landed but was not loaded within pd_resident_ttl, so its \
     page went back to the pool (load sooner, or raise pd_resident_ttl)";

/// Fixed parameters of a receiver's core.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ReceiverConfig {
    /// This receiver's chunk layout; incoming messages must match it.
    pub layout: ChunkLayout,
    /// How long pages lent for a push wait for the writer's notice
    /// (`pd_push_landing_timeout`).
    pub push_landing_timeout: Duration,
    /// Share of the agreed lease, at its end, within which no read starts
    /// (`pd_pull_read_margin_pct`).
    pub read_margin_pct: f64,
    /// How long a landed chunk waits to be loaded or cancelled before
    /// [`ReceiverCore::sweep`] drops it (`pd_resident_ttl`; `None`: never).
    /// Also how long a cancelled request stays withdrawn
    /// ([`ReceiverCore::cancel`]; without a TTL, 600 s).
    pub resident_ttl: Option<Duration>,
}

/// Which state a key is in (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KeyState {
    /// Data landed.
    Resident,
    /// Allocated for a push, not confirmed landed.
    PendingPush,
    /// Allocated for a pull-eager read in flight.
    PendingRead,
    /// A pull-delay proxy.
    Proxy,
}

/// Identifies one proxy: its pull and its slot in the pull's context.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ProxyHandle {
    /// The pull.
    pub pull_id: String,
    /// Index of the proxy in the pull's [`TransferContext`].
    pub slot: usize,
}

/// A pull-delay key: where its data is on the sender. No local pages.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProxyEntry {
    /// The key.
    pub key: String,
    /// The chunk's address in the sender's pools.
    pub remote: BufferRef,
    /// Layout and tokens of the chunk.
    pub meta: ChunkMeta,
    /// The sender (`sender_id`), for grouping reads per sender.
    pub sender_id: String,
    /// Its pull's context.
    pub handle: ProxyHandle,
    /// The moment the sender may free the chunk: no read may still run then.
    pub lease_deadline: Instant,
    /// The last moment a read of it may start (the lease end minus the margin).
    pub read_by: Instant,
}

impl ProxyEntry {
    /// Real bytes to read.
    pub fn byte_len(&self) -> usize {
        self.meta.byte_len()
    }

    /// Tokens in the chunk.
    pub fn tokens(&self) -> usize {
        self.meta.tokens
    }
}

/// What the load path finds for a key.
#[derive(Debug)]
pub enum Lookup<'a> {
    /// Data is here.
    Resident(&'a SealedMemObj),
    /// Allocated but the data has not landed: never load it as valid.
    NotReady,
    /// A proxy: read it (between [`ReceiverCore::begin_proxy_read`] and
    /// [`ReceiverCore::end_proxy_read`]). Looking it up does not consume it.
    Proxy(&'a ProxyEntry),
    /// A proxy whose read window has passed: unreadable.
    Expired,
    /// A proxy whose sender restarted or exited: the data it pointed at is gone.
    SenderRestarted,
    /// A landed chunk nobody loaded or cancelled within `pd_resident_ttl`:
    /// dropped.
    ResidentExpired,
    /// Not here.
    Missing,
}

/// Which positions of a message's keys are already here and which are new.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Partition {
    /// Positions of keys present in any state.
    pub present: Vec<usize>,
    /// Positions of keys not present.
    pub new: Vec<usize>,
}

/// How a message was handled.
#[cfg_attr(not(test), allow(dead_code))] // details for tests and debugging
#[derive(Debug)]
pub enum Verdict {
    /// Accepted.
    Accepted {
        /// Keys that were new (allocated / proxied).
        new: usize,
        /// Keys already present (reported in `already_sent_indexes`).
        present: usize,
    },
    /// Allocation failed: nothing of the message was kept; the reply says `alloc_failed`.
    AllocFailed(MemoryError),
    /// The message was invalid: nothing was kept; the reply says `alloc_failed`.
    Rejected(InvalidMessage),
    /// The message's request was cancelled here before it came (see
    /// [`ReceiverCore::cancel`]): nothing was allocated or stored, and the
    /// reply names every key as already sent, so its sender writes nothing
    /// (push) or releases its pins at once (pull).
    Withdrawn {
        /// The request.
        req_id: String,
        /// Its keys in the message.
        keys: usize,
    },
}

/// A receiver-local allocation number.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AllocId(pub u64);

/// An `AllocRequest` checked and partitioned, waiting for its pages.
/// It claims the keys it found present: end it with
/// [`ReceiverCore::commit_push`], [`ReceiverCore::refuse_push`] or
/// [`ReceiverCore::shelve_push`], never by dropping it.
#[derive(Debug)]
#[must_use = "a plan claims keys: commit, refuse or shelve it"]
pub struct PushPlan {
    route: String,
    keys: Vec<String>,
    /// The request the keys belong to, if the `AllocRequest` said.
    req_id: Option<String>,
    part: Partition,
    metas: Vec<ChunkMeta>,
    done: Vec<SendPullDone>,
}

impl PushPlan {
    /// One chunk per page the shell must allocate (all or nothing).
    pub fn metas(&self) -> &[ChunkMeta] {
        &self.metas
    }

    /// The allocator's answer, checked to be one page per chunk before the
    /// shell grants them to anyone (a wrong count frees them at once).
    pub fn check_pages(
        &self,
        pages: Result<Vec<MemObj>, MemoryError>,
    ) -> Result<Vec<MemObj>, MemoryError> {
        pages.and_then(|p| exact_pages(&self.metas, p))
    }
}

/// The answer to an `AllocRequest`.
#[cfg_attr(not(test), allow(dead_code))] // details for tests and debugging
#[derive(Debug)]
pub struct PushReply {
    /// The reply to send.
    pub response: AscendAllocResponse,
    /// What happened (for logs and counters).
    pub verdict: Verdict,
    /// Done signals freed by replacing expired proxies; send after the reply.
    pub done: Vec<SendPullDone>,
}

/// What [`ReceiverCore::on_push_notice`] decided.
#[cfg_attr(not(test), allow(dead_code))] // details for tests and debugging
#[derive(Debug)]
pub struct NoticeReply {
    /// The answer: accepted, or refused and why.
    pub result: Result<(), String>,
    /// Keys that became resident.
    pub landed: usize,
}

/// What [`ReceiverCore::on_quiescent`] did with an allocation's pages.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Settled {
    /// Pages back in the pool.
    pub freed: usize,
    /// Keys that became resident.
    pub landed: usize,
}

/// A `PullReadyNotif` checked, with its read window, waiting for pages
/// (pull-eager) or to be stored (pull-delay). Like a [`PushPlan`], it
/// claims the keys it found present: end it with a commit or
/// [`ReceiverCore::shelve_pull`].
#[derive(Debug)]
#[must_use = "a plan claims keys: commit or shelve it"]
pub struct PullPlan {
    notif: PullReadyNotif,
    checked: CheckedPull,
    part: Partition,
    metas: Vec<ChunkMeta>,
    deadline: Instant,
    read_by: Instant,
    done: Vec<SendPullDone>,
}

impl PullPlan {
    /// The pages a pull-eager read needs (one per new key).
    pub fn metas(&self) -> &[ChunkMeta] {
        &self.metas
    }

    #[cfg(test)]
    /// The moment the sender may free the pull's pages (receiver clock).
    pub fn deadline(&self) -> Instant {
        self.deadline
    }
}

/// One chunk a pull-eager read must fetch into the page at the same
/// position of [`EagerRead::pages`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReadItem {
    /// The key.
    pub key: String,
    /// The chunk on the sender.
    pub remote: BufferRef,
    /// Real bytes.
    pub bytes: usize,
}

/// The read a pull-eager handler asks the shell to perform, after sending the ack.
#[derive(Debug)]
pub struct EagerRead {
    /// The pull; pass it to [`ReceiverCore::on_read_complete`].
    pub pull_id: String,
    /// The sender to read from.
    pub sender_id: String,
    /// Do not start reading at or after this instant.
    pub read_by: Instant,
    /// The sender may free its pages at this instant: a read not complete
    /// by then has failed.
    pub deadline: Instant,
    /// What to read.
    pub items: Vec<ReadItem>,
    /// The pages to read into (owned by the read until it completes).
    pub pages: Vec<MemObj>,
}

/// The answer to a `PullReadyNotif`.
#[derive(Debug)]
pub struct PullReply {
    /// The ack to send first.
    pub ack: PullReadyDoneAck,
    /// What happened.
    pub verdict: Verdict,
    /// Pull-eager: the read to perform after the ack.
    pub read: Option<EagerRead>,
    /// Done signals to send after the ack (a pull with nothing to read,
    /// expired proxies replaced by this message).
    pub done: Vec<SendPullDone>,
}

impl PullReply {
    /// Accepted: the keys of `part` already present are named in the ack.
    fn accepted(part: &Partition, read: Option<EagerRead>, done: Vec<SendPullDone>) -> PullReply {
        PullReply {
            ack: PullReadyDoneAck {
                already_sent_indexes: indexes(&part.present),
                alloc_failed: false,
            },
            verdict: Verdict::Accepted {
                new: part.new.len(),
                present: part.present.len(),
            },
            read,
            done,
        }
    }

    /// Nothing read: the ack says `alloc_failed`, so the sender releases.
    fn refused(verdict: Verdict, done: Vec<SendPullDone>) -> PullReply {
        PullReply {
            ack: failed_ack(),
            verdict,
            read: None,
            done,
        }
    }
}

/// What [`ReceiverCore::remove`] removed.
#[cfg_attr(not(test), allow(dead_code))] // details for tests and debugging
#[derive(Debug)]
pub struct Removed {
    /// The state the key was in.
    pub state: KeyState,
    /// Its page, if it was resident (drop it to return it to the pool).
    pub page: Option<SealedMemObj>,
    /// The pull's Done, if removing this proxy resolved its last one.
    pub done: Option<SendPullDone>,
}

/// What [`ReceiverCore::sweep`] did.
#[derive(Debug, Default)]
pub struct SweepReport {
    /// Keys of pushes whose writer sent no notice in time (dropped).
    pub reclaimed_pushes: Vec<String>,
    /// Grants to revoke: their pages stay quarantined until the channel
    /// says the writer can no longer touch them ([`ReceiverCore::on_quiescent`]).
    pub revoke: Vec<GrantId>,
    /// Pull-eager keys dropped because their read did not complete within the lease.
    pub failed_reads: Vec<String>,
    /// Proxies discarded because their lease passed.
    pub expired_proxies: Vec<String>,
    /// Landed chunks dropped because nobody loaded or cancelled them within
    /// `pd_resident_ttl` (their pages are back in the pool).
    pub expired_resident: Vec<String>,
    /// Done signals to send.
    pub done: Vec<SendPullDone>,
}

/// Receiver counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReceiverCounters {
    /// Keys resident.
    pub resident: usize,
    /// Keys pending a push.
    pub pending_push: usize,
    /// Keys pending a pull-eager read.
    pub pending_read: usize,
    /// Proxy keys in the store.
    pub proxies: usize,
    /// Proxies not yet resolved in open contexts (includes removed keys with a read in flight).
    pub proxies_outstanding: usize,
    /// Pull-delay contexts open.
    pub contexts_open: usize,
    /// Pull-eager reads open.
    pub eager_reads_open: usize,
    /// Push allocations waiting for their writer's notice.
    pub allocations_pending: usize,
    /// Push allocations revoked whose pages wait for the writer to be quiescent.
    pub allocations_quarantined: usize,
    /// Done signals emitted.
    pub dones_emitted: u64,
    /// Messages answered `alloc_failed` because allocation failed.
    pub alloc_failures: u64,
    /// Push allocations revoked because no notice came in time.
    pub reclaimed_pushes: u64,
    /// Push notices refused (wrong route, wrong pages, unknown allocation, too late).
    pub notices_refused: u64,
    /// Proxies discarded at lease end.
    pub expired_proxies: u64,
    /// Pull-eager keys whose read failed or timed out.
    pub failed_reads: u64,
    /// Push keys confirmed landed.
    pub landed: u64,
    /// Keys reported already present.
    pub dedup_hits: u64,
    /// Rejected (invalid) `AllocRequest`s.
    pub rejected_alloc_requests: u64,
    /// Rejected (invalid, unknown sender, late) `PullReadyNotif`s.
    pub rejected_pull_notifs: u64,
    /// Keys a `CancelNotif` dropped (now, or when their transfer ended).
    pub cancelled_keys: u64,
    /// Landed chunks dropped at `pd_resident_ttl`, never loaded.
    pub expired_resident: u64,
    /// Keys of `AllocRequest`s and `PullReadyNotif`s whose request was
    /// cancelled here before they came, answered as already sent (nothing
    /// allocated, stored or read).
    pub withdrawn_keys: u64,
}

#[derive(Debug)]
enum Entry {
    Resident(SealedMemObj),
    PendingPush { alloc: AllocId },
    PendingRead { pull_id: String },
    Proxy(ProxyEntry),
}

impl Entry {
    fn state(&self) -> KeyState {
        match self {
            Entry::Resident(_) => KeyState::Resident,
            Entry::PendingPush { .. } => KeyState::PendingPush,
            Entry::PendingRead { .. } => KeyState::PendingRead,
            Entry::Proxy(_) => KeyState::Proxy,
        }
    }
}

/// The receiver's keys, lent pages, pull contexts and counters.
#[derive(Debug)]
pub struct ReceiverCore {
    config: ReceiverConfig,
    entries: HashMap<String, Entry>,
    /// Pages lent to writers (push), by allocation and route.
    pushes: PushAllocations,
    /// Keys whose proxy the sweep discarded at its lease's end: a load of
    /// one says the lease expired rather than that it was never stored.
    expired_keys: RecentIds<Gone>,
    /// Pull-delay notifications whose proxies are stored.
    contexts: DelayContexts,
    /// Pull-eager notifications being read.
    eager: EagerPulls,
    /// Keys a `CancelNotif` named while their data was still landing: the
    /// transfer they wait for (its allocation or pull) is dropped, not
    /// stored, when it ends. Only keys still pending under that transfer
    /// are kept.
    cancelled: HashMap<String, Pending>,
    /// Requests [`ReceiverCore::cancel`] named ("withdrawn"): the decode
    /// side gave up on them, so their keys arriving later are answered as
    /// already sent instead of being stored for a load that never comes.
    /// Bounded in number and remembered for `pd_resident_ttl`, the longest
    /// such keys would otherwise have held their pages.
    withdrawn: RecentIds<()>,
    /// Who holds, claims and keeps the clock of each stored key: the one
    /// copy of the rule that says when a key may go.
    own: KeyOwnership,
    /// Senders whose chunks are head pieces (heterogeneous TP): their
    /// chunk width and where it starts in a token of this side's chunks,
    /// by sender node. Absent: whole chunks of [`ReceiverConfig::layout`].
    pieces: HashMap<String, HeadPiece>,
    counters: ReceiverCounters,
}

/// The chunks of a heterogeneous-TP sender: `hidden` elements per token,
/// elements `[offset, offset + hidden)` of this receiver's token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeadPiece {
    /// Elements per token in the sender's chunks.
    pub hidden: usize,
    /// Where they start in this side's token.
    pub offset: usize,
}

/// Why a proxy left the store before it was read (so a load of it says so).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Gone {
    LeaseExpired,
    SenderRestarted,
    ResidentTtl,
}

/// The transfer a pending key waits for.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Pending {
    Push(AllocId),
    Read(String),
}

/// What [`ReceiverCore::cancel`] did.
#[derive(Debug, Default)]
pub struct Cancelled {
    /// Keys dropped now, with what each held (drop the pages; send the Dones).
    pub removed: Vec<(String, Removed)>,
    /// Keys still landing: they are dropped when their transfer ends.
    pub deferred: Vec<String>,
}

fn failed_push_response() -> AscendAllocResponse {
    AscendAllocResponse {
        already_sent_indexes: Vec::new(),
        remote_indexes: Vec::new(),
        remote_buffer_uuids: Vec::new(),
        alloc_failed: true,
    }
}

fn failed_ack() -> PullReadyDoneAck {
    PullReadyDoneAck {
        already_sent_indexes: Vec::new(),
        alloc_failed: true,
    }
}

fn indexes(v: &[usize]) -> Vec<u64> {
    v.iter().map(|&i| i as u64).collect()
}

/// Checks that an allocator returned exactly one page per chunk.
fn exact_pages(metas: &[ChunkMeta], pages: Vec<MemObj>) -> Result<Vec<MemObj>, MemoryError> {
    if pages.len() != metas.len() {
        // Dropping `pages` returns whatever was handed out.
        return Err(MemoryError::InvalidGeometry(format!(
            "allocator returned {} page(s) for {} chunk(s)",
            pages.len(),
            metas.len()
        )));
    }
    Ok(pages)
}

impl ReceiverCore {
    /// An empty core.
    pub fn new(config: ReceiverConfig) -> ReceiverCore {
        ReceiverCore {
            config,
            entries: HashMap::new(),
            pushes: PushAllocations::default(),
            expired_keys: RecentIds::new(ENDED_CAPACITY, EXPIRED_KEY_LIFETIME),
            cancelled: HashMap::new(),
            withdrawn: RecentIds::new(
                WITHDRAWN_CAPACITY,
                config
                    .resident_ttl
                    .unwrap_or(WITHDRAWN_LIFETIME_WITHOUT_TTL),
            ),
            own: KeyOwnership::default(),
            pieces: HashMap::new(),
            contexts: DelayContexts::default(),
            eager: EagerPulls::default(),
            counters: ReceiverCounters::default(),
        }
    }

    #[cfg(test)]
    /// The configuration.
    pub fn config(&self) -> &ReceiverConfig {
        &self.config
    }

    /// Splits `keys` into positions already present (in any state) and new.
    pub fn partition(&self, keys: &[String]) -> Partition {
        let mut p = Partition::default();
        for (i, k) in keys.iter().enumerate() {
            if self.entries.contains_key(k) {
                p.present.push(i);
            } else {
                p.new.push(i);
            }
        }
        p
    }

    /// Whether `key` is present in any state.
    pub fn contains(&self, key: &str) -> bool {
        self.entries.contains_key(key)
    }

    /// Upstream LMCache's decoder cache probe: the keys of `keys` this
    /// store holds in any state (landed, landing, or a pull-delay proxy —
    /// the states an `AllocRequest` would count as already sent), with
    /// their positions in `keys`.
    pub fn query(&self, keys: &[String]) -> super::CacheQueryResponse {
        let mut r = super::CacheQueryResponse::default();
        for (i, k) in keys.iter().enumerate() {
            if self.entries.contains_key(k) {
                r.cached_keys.push(k.clone());
                r.cached_indexes.push(i as u64);
            }
        }
        r
    }

    /// The state of `key`, if present.
    pub fn state(&self, key: &str) -> Option<KeyState> {
        self.entries.get(key).map(Entry::state)
    }

    #[cfg(test)]
    /// Number of keys in the store.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    #[cfg(test)]
    /// Whether the store holds no key.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// What the load path may do with `key` at `now`. Never changes anything.
    pub fn get(&self, key: &str, now: Instant) -> Lookup<'_> {
        match self.entries.get(key) {
            None => match self.expired_keys.get(key, now) {
                Some(Gone::LeaseExpired) => Lookup::Expired,
                Some(Gone::SenderRestarted) => Lookup::SenderRestarted,
                Some(Gone::ResidentTtl) => Lookup::ResidentExpired,
                None => Lookup::Missing,
            },
            Some(Entry::Resident(p)) => Lookup::Resident(p),
            Some(Entry::PendingPush { .. } | Entry::PendingRead { .. }) => Lookup::NotReady,
            Some(Entry::Proxy(p)) => {
                if now >= p.read_by {
                    Lookup::Expired
                } else {
                    Lookup::Proxy(p)
                }
            }
        }
    }

    #[cfg(test)]
    /// The pull-delay context of `pull_id`, while open.
    pub fn context(&self, pull_id: &str) -> Option<&TransferContext> {
        self.contexts.get(pull_id)
    }

    /// Removes `key` (eviction, or the load path is done with a resident
    /// key). A removed proxy is discarded in its context (after any read in
    /// flight ends); if that resolves its pull, the Done is returned. A key
    /// still landing or being read stays until its transfer ends (its page
    /// is not ours to give back yet): `None`.
    ///
    /// A key an uncommitted plan claimed stays too (`None`): the claimant's
    /// sender is being told it is already here, so it will not send it.
    pub fn remove(&mut self, key: &str) -> Option<Removed> {
        if self.own.is_claimed(key) {
            return None;
        }
        self.expired_keys.forget(key);
        match self.entries.get(key)? {
            Entry::PendingPush { .. } | Entry::PendingRead { .. } => return None,
            Entry::Resident(_) | Entry::Proxy(_) => {}
        }
        let entry = self.unstore(key)?;
        let state = entry.state();
        Some(match entry {
            Entry::Resident(page) => Removed {
                state,
                page: Some(page),
                done: None,
            },
            Entry::Proxy(p) => Removed {
                state,
                page: None,
                done: self.resolve_slot(&p.handle, |c, slot| c.discard(slot)),
            },
            Entry::PendingPush { .. } | Entry::PendingRead { .. } => unreachable!("checked above"),
        })
    }

    /// A load gave up on the proxy of `key`: its read failed, or its lease
    /// ended (`req` is the loading request; `None` when the proxy is dead
    /// for everyone, as after its lease). The proxy goes (its pull's Done
    /// returned when that resolves the pull) unless another request still
    /// holds it or an uncommitted plan claimed it: then it stays for them,
    /// and `req`'s own hold goes when that request is released or
    /// cancelled, as after any load. Anything but a stored proxy: `None`.
    pub fn give_up_proxy(&mut self, key: &str, req: Option<&str>) -> Option<SendPullDone> {
        if self.state(key) != Some(KeyState::Proxy) {
            return None;
        }
        let kept_for_others = req.is_some() && self.own.wanted_by_others(key);
        if kept_for_others {
            return None;
        }
        self.remove(key).and_then(|r| r.done)
    }

    /// Sender `node` is gone (it restarted: a new process of the same
    /// identity attached; or its process exited). Its proxies point at
    /// memory that no longer exists: they are discarded now (a load of one
    /// says its sender restarted or exited) instead of failing their reads
    /// until their lease ends.
    /// Returns how many were discarded; their pulls' Dones are dropped
    /// (nobody is left to receive them).
    pub fn forget_sender(&mut self, node: &str, now: Instant) -> usize {
        self.pieces.remove(node);
        let keys: Vec<(String, ProxyHandle)> = self
            .entries
            .iter()
            .filter_map(|(k, e)| match e {
                Entry::Proxy(p) if p.sender_id == node => Some((k.clone(), p.handle.clone())),
                _ => None,
            })
            .collect();
        for (k, handle) in &keys {
            self.unstore(k);
            self.expired_keys.insert(k, Gone::SenderRestarted, now);
            let _ = self.resolve_slot(handle, |c, s| c.discard(s));
        }
        self.counters.expired_proxies += keys.len() as u64;
        keys.len()
    }

    /// Takes `key` out of the store, with its holders.
    fn unstore(&mut self, key: &str) -> Option<Entry> {
        self.own.forget(key);
        self.entries.remove(key)
    }

    /// An accepted announcement by request `req` ("" for none) of `new`
    /// keys (just stored) and `present` ones (stored before, in any state).
    fn hold(&mut self, req: &str, new: &[&String], present: &[&String]) {
        for k in new {
            self.own.hold_new(k, req);
        }
        for k in present {
            if self.entries.contains_key(k.as_str()) {
                // It gets the whole `pd_resident_ttl` to load it.
                self.own.hold_present(k, req);
                // Someone wants it again: a cancel mark left by its earlier
                // sole holder must not drop it when it lands.
                self.cancelled.remove(k.as_str());
            }
        }
    }

    /// Lets go of `req`'s hold on `key` if it must stay for others, and
    /// returns true; false when it is not stored or `req` is its last
    /// holder (the caller removes it). See [`KeyOwnership::let_go`].
    fn let_go(&mut self, key: &str, req: &str) -> bool {
        self.entries.contains_key(key) && self.own.let_go(key, req)
    }

    /// A plan found `part.present` of `keys` stored: they stay until the
    /// plan is committed or given up, whoever else lets go meanwhile
    /// (the shell allocates the plan's pages outside the core's lock).
    fn claim(&mut self, keys: &[String], part: &Partition) {
        for &i in &part.present {
            self.own.claim(&keys[i]);
        }
    }

    /// Ends a plan's claim on `part.present` of `keys`. With `kept`, the
    /// plan was committed and its request now holds them. Without, the
    /// plan was given up: a key nobody holds or claims any more goes now
    /// (a resident page back to the pool, a proxy discarded, whose Done is
    /// returned; a key still landing is dropped when it lands).
    fn unclaim(&mut self, keys: &[String], part: &Partition, kept: bool) -> Vec<SendPullDone> {
        let mut done = Vec::new();
        for &i in &part.present {
            let key = &keys[i];
            if self.own.unclaim(key, kept) {
                let mut out = Cancelled::default();
                self.drop_key(key, "", &mut out);
                done.extend(out.removed.into_iter().filter_map(|(_, r)| r.done));
            }
        }
        done
    }

    /// The requests holding `key` (0 when it is not stored).
    pub fn holders(&self, key: &str) -> usize {
        match self.entries.contains_key(key) {
            true => self.own.holders(key),
            false => 0,
        }
    }

    /// Request `req` is done with `key` (its load finished). If another
    /// request still holds it, only `req`'s hold goes (`page: None`);
    /// otherwise the key is removed as by [`ReceiverCore::remove`]. A key
    /// still landing is left alone (`None`).
    pub fn release(&mut self, req: &str, key: &str) -> Option<Removed> {
        let state = match self.entries.get(key)? {
            Entry::PendingPush { .. } | Entry::PendingRead { .. } => return None,
            e => e.state(),
        };
        if self.let_go(key, req) {
            return Some(Removed {
                state,
                page: None,
                done: None,
            });
        }
        self.remove(key)
    }

    /// Request `req` was cancelled at `now` (its sender's `CancelNotif`, or
    /// the decode side gave up on it): drops every key of `keys` this store
    /// holds for it. Resident chunks and proxies go now (a proxy counts as
    /// discarded, which may complete its pull's Done); a key still landing
    /// is dropped when its transfer ends instead of becoming resident. A
    /// key another request holds stays for it.
    ///
    /// `req` is also *withdrawn* for `pd_resident_ttl`: an `AllocRequest`
    /// or `PullReadyNotif` that names it in its `req_id` and comes later is
    /// answered with every key already sent ([`Verdict::Withdrawn`]), so
    /// nothing is allocated or stored and the sender writes nothing, or
    /// releases its pins at once. Messages without a `req_id`
    /// (LMCache-Ascend peers) are not affected.
    pub fn cancel(&mut self, now: Instant, req: &str, keys: &[String]) -> Cancelled {
        if !req.is_empty() {
            self.withdrawn.insert(req, (), now);
        }
        // Marks whose transfer ended some other way (a sweep, a revoke)
        // are stale: keep only those still waiting, so the map stays small.
        let entries = &self.entries;
        self.cancelled.retain(|k, p| match (entries.get(k), p) {
            (Some(Entry::PendingPush { alloc }), Pending::Push(a)) => alloc == a,
            (Some(Entry::PendingRead { pull_id }), Pending::Read(id)) => pull_id == id,
            _ => false,
        });
        let mut out = Cancelled::default();
        for key in keys {
            // Another request shares the key: only this one lets go.
            if self.let_go(key, req) {
                continue;
            }
            self.drop_key(key, req, &mut out);
        }
        self.counters.cancelled_keys += (out.removed.len() + out.deferred.len()) as u64;
        out
    }

    /// Drops `key`, which no request holds any more: a stored one goes now
    /// (into `out.removed`), one still landing when its transfer ends
    /// (`out.deferred`).
    fn drop_key(&mut self, key: &str, req: &str, out: &mut Cancelled) {
        let pending = match self.entries.get(key) {
            Some(Entry::PendingPush { alloc }) => Some(Pending::Push(*alloc)),
            Some(Entry::PendingRead { pull_id }) => Some(Pending::Read(pull_id.clone())),
            _ => None,
        };
        match pending {
            Some(p) => {
                // Its hold goes now: a request that claims the key
                // before it lands keeps it (see `hold`).
                self.own.drop_hold(key, req);
                self.cancelled.insert(key.to_string(), p);
                out.deferred.push(key.to_string());
            }
            None => {
                if let Some(r) = self.remove(key) {
                    out.removed.push((key.to_string(), r));
                }
            }
        }
    }

    /// Whether `key`, ending its wait for `transfer`, was cancelled meanwhile
    /// (and forgets the mark either way).
    fn take_cancelled(&mut self, key: &str, transfer: &Pending) -> bool {
        match self.cancelled.get(key) {
            Some(p) if p == transfer => {
                self.cancelled.remove(key);
                true
            }
            _ => false,
        }
    }

    /// Records that sender `node` sends head pieces (`None`: whole chunks);
    /// its messages are checked against, and its pages carry, that piece.
    pub fn set_piece(&mut self, node: &str, piece: Option<HeadPiece>) {
        match piece {
            Some(p) => self.pieces.insert(node.to_string(), p),
            None => self.pieces.remove(node),
        };
    }

    /// The chunk layout `node`'s messages must carry, and where its chunks
    /// start in a token.
    fn layout_from(&self, node: &str) -> (ChunkLayout, usize) {
        match self.pieces.get(node) {
            Some(p) => (
                ChunkLayout {
                    hidden: p.hidden,
                    ..self.config.layout
                },
                p.offset,
            ),
            None => (self.config.layout, 0),
        }
    }

    // ------------------------------------------------------------- push

    /// Checks an `AllocRequest` that came on `route` and partitions its keys.
    /// `Err` is the reply to send at once (invalid message, or nothing new
    /// to allocate; boxed: it is large); `Ok` asks the shell for [`PushPlan::metas`] pages, then
    /// [`ReceiverCore::commit_push`].
    pub fn plan_push(
        &mut self,
        now: Instant,
        route: &str,
        req: &AllocRequest,
    ) -> Result<PushPlan, Box<PushReply>> {
        let (layout, offset) = self.layout_from(route_node(route));
        let checked = match check_alloc_request(req, &layout).and_then(|c| {
            match self.pushes.is_given_up(route, now) {
                true => Err(InvalidMessage::RouteGivenUp {
                    msg: MessageType::AllocRequest,
                    route: super::error::shorten(route),
                }),
                false => Ok(c),
            }
        }) {
            Ok(c) => c,
            Err(e) => {
                self.counters.rejected_alloc_requests += 1;
                return Err(Box::new(PushReply {
                    response: failed_push_response(),
                    verdict: Verdict::Rejected(e),
                    done: Vec::new(),
                }));
            }
        };
        if let Some(verdict) = self.withdrawn_verdict(req.req_id.as_deref(), req.keys.len(), now) {
            return Err(Box::new(PushReply {
                response: AscendAllocResponse {
                    already_sent_indexes: (0..req.keys.len() as u64).collect(),
                    remote_indexes: Vec::new(),
                    remote_buffer_uuids: Vec::new(),
                    alloc_failed: false,
                },
                verdict,
                done: Vec::new(),
            }));
        }
        let done = self.replace_expired(&req.keys, now);
        let part = self.partition(&req.keys);
        let metas: Vec<ChunkMeta> = part
            .new
            .iter()
            .map(|&i| checked.metas[i].at_hidden_offset(offset))
            .collect();
        let plan = PushPlan {
            route: route.to_string(),
            keys: req.keys.clone(),
            req_id: req.req_id.clone(),
            part,
            metas,
            done,
        };
        self.claim(&plan.keys, &plan.part);
        if plan.metas.is_empty() {
            return Err(Box::new(self.commit_push(
                now,
                plan,
                Ok((Vec::new(), None)),
            )));
        }
        Ok(plan)
    }

    /// Refuses a push whose writer cannot be granted pages (its node is not
    /// attached, or its route does not name an allocation), before any page
    /// is taken for it.
    pub fn refuse_push(&mut self, plan: PushPlan) -> PushReply {
        let route = plan.route.clone();
        let done = self.shelve_push(plan);
        self.refuse_writer(&route, done)
    }

    /// Gives a push plan up: its pages are not free yet, and the shell
    /// plans the request again later (or refuses it). Returns the Done
    /// signals to send: those planning freed, and any of a key that only
    /// this plan still claimed.
    pub fn shelve_push(&mut self, plan: PushPlan) -> Vec<SendPullDone> {
        let mut done = plan.done;
        done.extend(self.unclaim(&plan.keys, &plan.part, false));
        done
    }

    /// Gives a pull plan up (see [`ReceiverCore::shelve_push`]).
    pub fn shelve_pull(&mut self, plan: PullPlan) -> Vec<SendPullDone> {
        let mut done = plan.done;
        done.extend(self.unclaim(&plan.notif.keys, &plan.part, false));
        done
    }

    fn refuse_writer(&mut self, route: &str, done: Vec<SendPullDone>) -> PushReply {
        self.counters.rejected_alloc_requests += 1;
        PushReply {
            response: failed_push_response(),
            verdict: Verdict::Rejected(InvalidMessage::UnknownSender {
                msg: MessageType::AllocRequest,
                sender: super::error::shorten(route_node(route)),
            }),
            done,
        }
    }

    /// Completes a push with the pages the shell allocated (all or nothing,
    /// checked by [`PushPlan::check_pages`]) and the write grant it made for them to the route's writer. Pages
    /// without a grant (the writer is not attached, or granting failed) are
    /// never advertised: the push fails, since a one-sided writer could
    /// reach pages nobody tracks. The pages are lent to the writer until
    /// its notice.
    pub fn commit_push(
        &mut self,
        now: Instant,
        plan: PushPlan,
        pages: Result<(Vec<MemObj>, Option<GrantId>), MemoryError>,
    ) -> PushReply {
        let PushPlan {
            route,
            keys,
            req_id,
            part,
            metas,
            mut done,
        } = plan;
        let (pages, grant) = match pages {
            Ok(p) => p,
            Err(e) => {
                self.counters.alloc_failures += 1;
                done.extend(self.unclaim(&keys, &part, false));
                return PushReply {
                    response: failed_push_response(),
                    verdict: Verdict::AllocFailed(e),
                    done,
                };
            }
        };
        debug_assert_eq!(pages.len(), metas.len(), "checked by PushPlan::check_pages");
        self.counters.dedup_hits += part.present.len() as u64;
        let response_for = |refs: &[BufferRef]| AscendAllocResponse {
            already_sent_indexes: indexes(&part.present),
            remote_indexes: refs.iter().map(|r| u64::from(r.page)).collect(),
            remote_buffer_uuids: refs.iter().map(|r| r.uuid.simple().to_string()).collect(),
            alloc_failed: false,
        };
        let verdict = Verdict::Accepted {
            new: part.new.len(),
            present: part.present.len(),
        };
        let req = req_id.as_deref().unwrap_or("");
        if pages.is_empty() {
            self.unclaim(&keys, &part, true);
            let present: Vec<&String> = part.present.iter().map(|&i| &keys[i]).collect();
            self.hold(req, &[], &present);
            return PushReply {
                response: response_for(&[]),
                verdict,
                done,
            };
        }
        let grant = match grant {
            Some(g) => g,
            None => {
                // Unadvertised, so nobody can have written them: free.
                drop(pages);
                done.extend(self.unclaim(&keys, &part, false));
                return self.refuse_writer(&route, done);
            }
        };
        self.unclaim(&keys, &part, true);
        let id = self.pushes.next_id();
        let refs: Vec<BufferRef> = pages.iter().map(|p| p.buffer_ref()).collect();
        let new_keys: Vec<String> = part.new.iter().map(|&i| keys[i].clone()).collect();
        for k in &new_keys {
            self.expired_keys.forget(k);
            self.entries
                .insert(k.clone(), Entry::PendingPush { alloc: id });
        }
        {
            let new: Vec<&String> = new_keys.iter().collect();
            let present: Vec<&String> = part.present.iter().map(|&i| &keys[i]).collect();
            self.hold(req, &new, &present);
        }
        // A route has one pending allocation: its writer notices before it
        // asks again. One left pending (the writer skipped its notice) waits
        // for its deadline.
        self.pushes.open(
            id,
            Allocation {
                route,
                keys: new_keys,
                pages: pages.into_iter().map(MemObj::lend).collect(),
                refs: refs.clone(),
                grant,
                deadline: now + self.config.push_landing_timeout,
                state: AllocState::Open,
            },
        );
        PushReply {
            response: response_for(&refs),
            verdict,
            done,
        }
    }

    /// A writer's notice, received on request route `from`. Accepted only
    /// when it names an open allocation of a route of the same writer
    /// (node) and exactly its pages; `aborted` with no pages names whatever
    /// the route was given (the writer never got the reply, so it wrote
    /// nothing). `release` tells the channel the writer is done with the
    /// allocation's grant and says whether nothing is still being served
    /// under it; if something is (tcp), the outcome waits for
    /// [`ReceiverCore::on_quiescent`]. `landed` makes the keys resident,
    /// `aborted` frees the pages. For an allocation already revoked either
    /// notice proves the writer is done (and `landed` is refused: its keys
    /// were dropped). A repeated notice (its first reply was lost) gets the
    /// first answer again.
    pub fn on_push_notice(
        &mut self,
        now: Instant,
        from: &str,
        notice: &PushNotice,
        release: impl FnOnce(GrantId) -> bool,
    ) -> NoticeReply {
        let refused = |me: &mut ReceiverCore, why: String| {
            me.counters.notices_refused += 1;
            NoticeReply {
                result: Err(why),
                landed: 0,
            }
        };
        if route_node(from) != route_node(&notice.route) {
            return refused(
                self,
                format!(
                    "{:?} may not end route {:?}'s allocation: it is another writer's",
                    route_node(from),
                    notice.route
                ),
            );
        }
        let unanswered = notice.refs.is_empty() && notice.outcome == PushOutcome::Aborted;
        if unanswered {
            // The request may still be on its way (notice and request come
            // on different sockets): it must not allocate when it arrives.
            self.pushes.give_up(&notice.route, now);
        }
        let Some(id) = self.pushes.of_route(&notice.route) else {
            if unanswered {
                // Nothing was allocated on that route (or it already ended).
                return NoticeReply {
                    result: Ok(()),
                    landed: 0,
                };
            }
            if let Some((refs, answer)) = self.pushes.ended_answer(&notice.route, now) {
                if *refs == notice.refs {
                    return NoticeReply {
                        result: answer.clone(),
                        landed: 0,
                    };
                }
            }
            return refused(
                self,
                format!(
                    "route {:?} has no open allocation (never made, or already ended)",
                    notice.route
                ),
            );
        };
        let a = self
            .pushes
            .get(id)
            .expect("a route's pending allocation is live");
        if !unanswered && a.refs != notice.refs {
            return refused(
                self,
                format!(
                    "the notice names {} page(s) that are not those of route {:?}'s allocation ({} page(s))",
                    notice.refs.len(),
                    notice.route,
                    a.refs.len()
                ),
            );
        }
        let (grant, revoked) = (a.grant, a.state == AllocState::Revoked);
        self.pushes.close_route(&notice.route);
        let settled = release(grant);
        let result = match (revoked, notice.outcome) {
            (true, PushOutcome::Landed) => {
                self.counters.notices_refused += 1;
                Err(format!(
                    "too late: the allocation waited longer than pd_push_landing_timeout ({:?}) and its chunks were dropped",
                    self.config.push_landing_timeout
                ))
            }
            _ => Ok(()),
        };
        // A revoked allocation's keys are gone: either notice only frees.
        let outcome = if revoked {
            PushOutcome::Aborted
        } else {
            notice.outcome
        };
        let landed = if settled {
            self.end_allocation(id, outcome)
        } else {
            let a = self.pushes.get_mut(id).expect("looked up above");
            a.state = AllocState::Ending(outcome);
            for p in &a.pages {
                p.quarantine();
            }
            if outcome == PushOutcome::Aborted {
                // The keys may be pushed again at once; the pages wait.
                let keys = a.keys.clone();
                self.drop_pending_keys(id, &keys);
            }
            0
        };
        self.pushes
            .remember_end(&notice.route, (notice.refs.clone(), result.clone()), now);
        NoticeReply { result, landed }
    }

    /// Ends allocation `id` whose writer is provably done with its pages:
    /// `landed` makes its still-pending keys resident, anything else goes
    /// back to the pool. Returns how many keys became resident.
    fn end_allocation(&mut self, id: AllocId, outcome: PushOutcome) -> usize {
        let Some(a) = self.pushes.take(id) else {
            return 0;
        };
        let mut landed = 0;
        for (key, page) in a.keys.into_iter().zip(a.pages) {
            let ours = matches!(self.entries.get(&key), Some(Entry::PendingPush { alloc }) if *alloc == id);
            let cancelled = ours && self.take_cancelled(&key, &Pending::Push(id));
            match (outcome, ours) {
                (PushOutcome::Landed, true) if cancelled => {
                    self.unstore(&key);
                    page.release_quiescent();
                }
                (PushOutcome::Landed, true) => {
                    self.entries
                        .insert(key, Entry::Resident(page.landed().seal()));
                    landed += 1;
                }
                (PushOutcome::Aborted, true) => {
                    self.unstore(&key);
                    page.release_quiescent();
                }
                // Only pending keys point at their allocation.
                (_, false) => page.release_quiescent(),
            }
        }
        self.counters.landed += landed as u64;
        landed
    }

    /// Forgets the keys of allocation `id` that still wait for it.
    fn drop_pending_keys(&mut self, id: AllocId, keys: &[String]) -> Vec<String> {
        let mut dropped = Vec::new();
        for k in keys {
            if matches!(self.entries.get(k), Some(Entry::PendingPush { alloc }) if *alloc == id) {
                self.unstore(k);
                dropped.push(k.clone());
            }
        }
        dropped
    }

    /// Grants whose allocations wait for the channel (revoked, or ended by
    /// the writer while requests under them were still served): ask the
    /// channel, then call [`ReceiverCore::on_quiescent`].
    pub fn awaiting_quiescence(&self) -> Vec<GrantId> {
        self.pushes.awaiting_quiescence()
    }

    /// The channel says nobody can touch the pages of `grant` any more:
    /// an allocation ended as `landed` becomes resident, any other goes
    /// back to the pool.
    pub fn on_quiescent(&mut self, grant: GrantId) -> Settled {
        let Some((id, state)) = self.pushes.settling(grant) else {
            return Settled::default();
        };
        let pages = self.pushes.get(id).map_or(0, |a| a.pages.len());
        let outcome = match state {
            AllocState::Ending(o) => o,
            _ => PushOutcome::Aborted,
        };
        let landed = self.end_allocation(id, outcome);
        Settled {
            freed: pages - landed,
            landed,
        }
    }

    // -------------------------------------------------------------- pull

    /// Checks a `PullReadyNotif` that came on route `from` (it must be the
    /// named sender's) from a sender whose agreed lease is
    /// `lease` (`None`: the sender never completed a handshake) and works
    /// out its read window: the deadline in the pull id, capped at
    /// `now + lease`. A notification that arrives after the window's start
    /// margin is refused (it waited too long; reading could outlive the
    /// sender's pins). `Err` is the reply to send at once.
    #[cfg(test)]
    pub fn plan_pull(
        &mut self,
        now: Instant,
        from: &str,
        notif: &PullReadyNotif,
        lease: Option<Duration>,
    ) -> Result<PullPlan, Box<PullReply>> {
        self.plan_pull_since(now, now, from, notif, lease)
    }

    /// `plan_pull` for a notification that arrived at
    /// `arrived` and waited (for pages) until `now`: the lease cap counts
    /// from its arrival, the read window is checked at `now`.
    pub fn plan_pull_since(
        &mut self,
        now: Instant,
        arrived: Instant,
        from: &str,
        notif: &PullReadyNotif,
        lease: Option<Duration>,
    ) -> Result<PullPlan, Box<PullReply>> {
        let msg = MessageType::PullReadyNotif;
        let short = |s: &str| super::error::shorten(s);
        let (layout, offset) = self.layout_from(route_node(from));
        let checked = check_pull_notif(notif, &layout)
            .map(|mut c| {
                for m in &mut c.metas {
                    *m = m.at_hidden_offset(offset);
                }
                c
            })
            .and_then(|c| {
                if route_node(from) == notif.sender_id {
                    Ok(c)
                } else {
                    Err(InvalidMessage::NotFromSender {
                        msg,
                        sender: short(&notif.sender_id),
                        from: short(route_node(from)),
                    })
                }
            })
            .and_then(|c| {
                if self.contexts.contains(&notif.pull_id) || self.eager.contains(&notif.pull_id) {
                    Err(InvalidMessage::PullIdInUse {
                        msg,
                        pull_id: short(&notif.pull_id),
                    })
                } else {
                    Ok(c)
                }
            })
            .and_then(|c| {
                let lease = lease.ok_or_else(|| InvalidMessage::UnknownSender {
                    msg,
                    sender: short(&notif.sender_id),
                })?;
                let id = PullId::parse(&notif.pull_id).ok_or_else(|| InvalidMessage::NoLease {
                    msg,
                    pull_id: short(&notif.pull_id),
                })?;
                let deadline = from_wire_micros(id.deadline_us).min(arrived.min(now) + lease);
                let read_by = deadline
                    .checked_sub(read_margin(lease, self.config.read_margin_pct))
                    .unwrap_or(deadline);
                if now >= read_by {
                    return Err(InvalidMessage::LeaseOver {
                        msg,
                        pull_id: short(&notif.pull_id),
                        late_ms: now.saturating_duration_since(read_by).as_millis() as u64,
                    });
                }
                Ok((c, deadline, read_by))
            });
        let (checked, deadline, read_by) = match checked {
            Ok(c) => c,
            Err(e) => {
                self.counters.rejected_pull_notifs += 1;
                return Err(Box::new(PullReply::refused(
                    Verdict::Rejected(e),
                    Vec::new(),
                )));
            }
        };
        let n = notif.keys.len();
        if let Some(verdict) = self.withdrawn_verdict(notif.req_id.as_deref(), n, now) {
            // Nothing to read: the ack releases the sender's pins, and the
            // Done after it does too should the ack be lost.
            self.counters.dones_emitted += 1;
            return Err(Box::new(PullReply {
                ack: PullReadyDoneAck {
                    already_sent_indexes: (0..n as u64).collect(),
                    alloc_failed: false,
                },
                verdict,
                read: None,
                done: vec![done_for(notif)],
            }));
        }
        let done = self.replace_expired(&notif.keys, now);
        let part = self.partition(&notif.keys);
        self.claim(&notif.keys, &part);
        let metas = part.new.iter().map(|&i| checked.metas[i]).collect();
        Ok(PullPlan {
            notif: notif.clone(),
            checked,
            part,
            metas,
            deadline,
            read_by,
            done,
        })
    }

    /// Completes a pull-delay notification: a proxy (no pages) for every
    /// new key, all in one [`TransferContext`]. The Done comes when every
    /// proxy is consumed or discarded.
    /// Like [`ReceiverCore::commit_pull_delay`], but refuses the
    /// notification when its sender would then have more than `limit`
    /// proxies outstanding here. A sender pins a page per proxy until its
    /// Done, so `limit` is the number of pages the transfer channel
    /// verified it registered (`TransferChannel::verified_peer_pages`; a
    /// receiver-side bound where the channel cannot verify): no honest
    /// sender exceeds it, and nobody can make us store proxies without
    /// bound by declaring a larger table.
    pub fn commit_pull_delay_capped(&mut self, plan: PullPlan, limit: usize) -> PullReply {
        let held = self.proxies_of(&plan.notif.sender_id);
        let new = plan.part.new.len();
        if held + new > limit {
            self.counters.rejected_pull_notifs += 1;
            let e = InvalidMessage::TooManyProxies {
                msg: MessageType::PullReadyNotif,
                sender: super::error::shorten(&plan.notif.sender_id),
                held,
                new,
                limit,
            };
            return PullReply::refused(Verdict::Rejected(e), self.shelve_pull(plan));
        }
        self.commit_pull_delay(plan)
    }

    /// Proxies of `sender_id` not yet consumed or discarded.
    pub fn proxies_of(&self, sender_id: &str) -> usize {
        self.contexts.outstanding_of(sender_id)
    }

    pub fn commit_pull_delay(&mut self, plan: PullPlan) -> PullReply {
        let PullPlan {
            notif,
            checked,
            part,
            deadline,
            read_by,
            mut done,
            ..
        } = plan;
        self.unclaim(&notif.keys, &part, true);
        let mut ctx = TransferContext::new(
            &notif.pull_id,
            &notif.sender_id,
            &notif.sender_done_url,
            part.new.len(),
            deadline,
        );
        let mut keys = Vec::with_capacity(part.new.len());
        for (slot, &i) in part.new.iter().enumerate() {
            let key = notif.keys[i].clone();
            keys.push(key.clone());
            self.expired_keys.forget(&key);
            self.entries.insert(
                key.clone(),
                Entry::Proxy(ProxyEntry {
                    key,
                    remote: checked.remote[i],
                    meta: checked.metas[i],
                    sender_id: notif.sender_id.clone(),
                    handle: ProxyHandle {
                        pull_id: notif.pull_id.clone(),
                        slot,
                    },
                    lease_deadline: deadline,
                    read_by,
                }),
            );
        }
        self.counters.dedup_hits += part.present.len() as u64;
        {
            let req = notif.req_id.as_deref().unwrap_or("");
            let new: Vec<&String> = part.new.iter().map(|&i| &notif.keys[i]).collect();
            let present: Vec<&String> = part.present.iter().map(|&i| &notif.keys[i]).collect();
            self.hold(req, &new, &present);
        }
        if let Some(d) = ctx.done_if_empty() {
            self.counters.dones_emitted += 1;
            done.push(d);
        } else {
            self.contexts.open(notif.pull_id.clone(), ctx, keys);
        }
        PullReply::accepted(&part, None, done)
    }

    /// Completes a pull-eager notification with the pages the shell
    /// allocated for its new keys (all or nothing): the ack, and the read
    /// to perform after sending it, which owns the pages. When the read
    /// ends, call [`ReceiverCore::on_read_complete`], which yields the Done.
    pub fn commit_pull_eager(
        &mut self,
        plan: PullPlan,
        pages: Result<Vec<MemObj>, MemoryError>,
    ) -> PullReply {
        let PullPlan {
            notif,
            checked,
            part,
            metas,
            deadline,
            read_by,
            mut done,
        } = plan;
        let pages = match pages.and_then(|p| exact_pages(&metas, p)) {
            Ok(p) => p,
            Err(e) => {
                self.counters.alloc_failures += 1;
                done.extend(self.unclaim(&notif.keys, &part, false));
                return PullReply::refused(Verdict::AllocFailed(e), done);
            }
        };
        self.unclaim(&notif.keys, &part, true);
        let items: Vec<ReadItem> = part
            .new
            .iter()
            .map(|&i| ReadItem {
                key: notif.keys[i].clone(),
                remote: checked.remote[i],
                bytes: checked.metas[i].byte_len(),
            })
            .collect();
        for it in &items {
            self.expired_keys.forget(&it.key);
            self.entries.insert(
                it.key.clone(),
                Entry::PendingRead {
                    pull_id: notif.pull_id.clone(),
                },
            );
        }
        self.counters.dedup_hits += part.present.len() as u64;
        {
            let req = notif.req_id.as_deref().unwrap_or("");
            let new: Vec<&String> = part.new.iter().map(|&i| &notif.keys[i]).collect();
            let present: Vec<&String> = part.present.iter().map(|&i| &notif.keys[i]).collect();
            self.hold(req, &new, &present);
        }
        let read = if items.is_empty() {
            // Nothing to read: the sender may release at once (after the ack).
            self.counters.dones_emitted += 1;
            done.push(done_for(&notif));
            None
        } else {
            self.eager.start(
                notif.pull_id.clone(),
                EagerPull {
                    sender_id: notif.sender_id.clone(),
                    done_url: notif.sender_done_url.clone(),
                    deadline,
                    keys: items.iter().map(|it| it.key.clone()).collect(),
                },
            );
            Some(EagerRead {
                pull_id: notif.pull_id.clone(),
                sender_id: notif.sender_id.clone(),
                read_by,
                deadline,
                items,
                pages,
            })
        };
        PullReply::accepted(&part, read, done)
    }

    /// The pull-eager read of `pull_id` ended: `Some(pages)` (in item
    /// order) when every chunk arrived before the deadline, `None` when it
    /// failed (its pages stay with the transfer until it ends). On success
    /// the keys become resident; on failure they are dropped. Either way
    /// the pull's Done is returned — exactly once: a second call, or a call
    /// after the sweep gave up on the read, returns `None` (and drops the
    /// pages it was given).
    pub fn on_read_complete(
        &mut self,
        pull_id: &str,
        pages: Option<Vec<MemObj>>,
    ) -> Option<SendPullDone> {
        let pull = self.eager.end(pull_id)?;
        let mut pages = pages.map(Vec::into_iter);
        for k in &pull.keys {
            let page = pages.as_mut().and_then(Iterator::next);
            let ours = matches!(
                self.entries.get(k),
                Some(Entry::PendingRead { pull_id: p }) if p == pull_id
            );
            if !ours {
                continue;
            }
            if self.take_cancelled(k, &Pending::Read(pull_id.to_owned())) {
                // Dropping the page returns it: the read is over.
                self.unstore(k);
                drop(page);
                continue;
            }
            match page {
                Some(p) => {
                    self.entries.insert(k.clone(), Entry::Resident(p.seal()));
                }
                None => {
                    self.unstore(k);
                    self.counters.failed_reads += 1;
                }
            }
        }
        self.counters.dones_emitted += 1;
        Some(SendPullDone {
            done_url: pull.done_url,
            sender_id: pull.sender_id,
            signal: super::messages::PullDoneSignal {
                pull_id: pull_id.to_owned(),
            },
        })
    }

    /// Pins the proxy of `key` for a read starting at `now` and returns a
    /// copy of it. Does not consume it: the key stays in the store until
    /// [`ReceiverCore::end_proxy_read`]. Refused from the proxy's `read_by` on.
    pub fn begin_proxy_read(
        &mut self,
        key: &str,
        now: Instant,
    ) -> Result<ProxyEntry, ProxyReadError> {
        let proxy = match self.entries.get(key) {
            None => return Err(ProxyReadError::Missing(key.to_owned())),
            Some(Entry::Proxy(p)) => p.clone(),
            Some(_) => return Err(ProxyReadError::NotAProxy(key.to_owned())),
        };
        self.contexts
            .begin_read(&proxy.handle, now, proxy.read_by)
            .ok_or_else(|| ProxyReadError::Missing(key.to_owned()))?
            .map_err(|e| match e {
                ProxyReadError::LeaseExpired(_) => ProxyReadError::LeaseExpired(key.to_owned()),
                ProxyReadError::Resolved(_) => ProxyReadError::Resolved(key.to_owned()),
                _ => ProxyReadError::Missing(key.to_owned()),
            })?;
        Ok(proxy)
    }

    /// Ends a read begun with [`ReceiverCore::begin_proxy_read`]. Once the slot
    /// resolves (consumed, or discarded after a failure) the key leaves the
    /// store (its data now lives in the KV cache, or is gone). Returns the
    /// pull's Done when this resolved its last proxy; unmatched or repeated
    /// calls return `None` and change nothing.
    pub fn end_proxy_read(
        &mut self,
        handle: &ProxyHandle,
        outcome: ReadOutcome,
    ) -> Option<SendPullDone> {
        self.end_proxy_read_for(handle, outcome, None)
    }

    /// [`ReceiverCore::end_proxy_read`] for a load of request `req`: a
    /// proxy it consumed that another request also holds is kept (its
    /// pull's Done, and the sender's pins, wait for the last holder). The
    /// caller then releases `req`'s hold ([`ReceiverCore::release`]) once
    /// the load is over.
    pub fn end_proxy_read_for(
        &mut self,
        handle: &ProxyHandle,
        outcome: ReadOutcome,
        req: Option<&str>,
    ) -> Option<SendPullDone> {
        let outcome = match (outcome, req, self.key_of(handle)) {
            // The hold itself goes with `release` after the load, once. A
            // read that failed for this request leaves the proxy to the
            // others too (if the sender is gone, their reads fail alike).
            (ReadOutcome::Consumed | ReadOutcome::Failed, Some(_), Some(k))
                if self.own.wanted_by_others(&k) =>
            {
                ReadOutcome::Kept
            }
            (o, _, _) => o,
        };
        self.resolve_slot(handle, |c, slot| c.end_read(slot, outcome))
    }

    /// The key of proxy `handle`, while it is the stored proxy of that key.
    fn key_of(&self, handle: &ProxyHandle) -> Option<String> {
        let k = self.contexts.key_at(handle)?;
        self.is_proxy_of(k, handle).then(|| k.clone())
    }

    // ------------------------------------------------------------- time

    /// Reclaims what time has run out for at `now`:
    ///
    /// * push allocations past their landing deadline lose their keys,
    ///   their grants are to be revoked, and their pages stay quarantined
    ///   until the writer is quiescent;
    /// * pull-eager reads not completed by their lease end: their keys are
    ///   dropped and the Done is emitted (the pages return when the read's
    ///   transfer ends);
    /// * proxies whose lease has passed are discarded (a proxy with a read
    ///   in flight is discarded when that read ends); a pull whose proxies
    ///   are all resolved emits its Done.
    pub fn sweep(&mut self, now: Instant) -> SweepReport {
        let mut report = SweepReport::default();
        for id in self.pushes.late(now) {
            let a = self.pushes.get_mut(id).expect("listed above");
            a.state = AllocState::Revoked;
            for p in &a.pages {
                p.quarantine();
            }
            report.revoke.push(a.grant);
            let keys = a.keys.clone();
            report
                .reclaimed_pushes
                .extend(self.drop_pending_keys(id, &keys));
            self.counters.reclaimed_pushes += 1;
        }

        for id in self.eager.late(now) {
            let keys = self.eager.keys_of(&id);
            for k in &keys {
                if matches!(self.entries.get(k), Some(Entry::PendingRead { pull_id }) if *pull_id == id)
                {
                    report.failed_reads.push(k.clone());
                }
            }
            if let Some(d) = self.on_read_complete(&id, None) {
                report.done.push(d);
            }
        }

        for id in self.contexts.expired(now) {
            let Some(keys) = self.contexts.keys_of(&id) else {
                continue;
            };
            for (slot, key) in keys.iter().enumerate() {
                let handle = ProxyHandle {
                    pull_id: id.clone(),
                    slot,
                };
                let outstanding = matches!(
                    self.contexts.slot(&handle),
                    Some(SlotState::Outstanding {
                        discard_pending: false,
                        ..
                    })
                );
                if !outstanding {
                    continue;
                }
                if self.is_proxy_of(key, &handle) {
                    self.unstore(key);
                    self.expired_keys.insert(key, Gone::LeaseExpired, now);
                }
                self.counters.expired_proxies += 1;
                report.expired_proxies.push(key.clone());
                if let Some(d) = self.resolve_slot(&handle, |c, s| c.discard(s)) {
                    report.done.push(d);
                }
            }
        }
        self.sweep_resident(now, &mut report);
        report
    }

    /// Drops landed chunks nobody loaded or cancelled within
    /// `pd_resident_ttl`, counted from the first sweep that saw them
    /// resident. Whoever holds them (a request that never came to load
    /// them) finds them gone: a load says so. A load already copying one
    /// keeps its page until it is done (pages are shared), so only the
    /// store forgets it.
    fn sweep_resident(&mut self, now: Instant, report: &mut SweepReport) {
        let Some(ttl) = self.config.resident_ttl else {
            return;
        };
        let mut late = Vec::new();
        for (k, e) in &self.entries {
            if matches!(e, Entry::Resident(_)) && self.own.resident_late(k, now, ttl) {
                late.push(k.clone());
            }
        }
        for k in late {
            if let Some(Entry::Resident(page)) = self.unstore(&k) {
                drop(page);
            }
            self.expired_keys.insert(&k, Gone::ResidentTtl, now);
            self.counters.expired_resident += 1;
            report.expired_resident.push(k);
        }
    }

    /// The counters.
    pub fn counters(&self) -> ReceiverCounters {
        let mut c = self.counters;
        c.resident = 0;
        c.pending_push = 0;
        c.pending_read = 0;
        c.proxies = 0;
        for e in self.entries.values() {
            match e.state() {
                KeyState::Resident => c.resident += 1,
                KeyState::PendingPush => c.pending_push += 1,
                KeyState::PendingRead => c.pending_read += 1,
                KeyState::Proxy => c.proxies += 1,
            }
        }
        (c.contexts_open, c.proxies_outstanding) = self.contexts.counts();
        c.eager_reads_open = self.eager.len();
        (c.allocations_pending, c.allocations_quarantined) = self.pushes.counts();
        c
    }

    /// The receiver stops: every allocation's grant is revoked by
    /// `revoke_quiescent`, which says whether its writer can no longer
    /// touch the pages. Those pages return to the pool; the others stay
    /// quarantined for good (the pool outlives the receiver rather than
    /// hand out a page a late write could reach). Pending keys are
    /// dropped. Returns how many pages stayed quarantined.
    pub fn shut_down(&mut self, mut revoke_quiescent: impl FnMut(GrantId) -> bool) -> usize {
        let mut kept = 0;
        for a in self.pushes.drain() {
            if revoke_quiescent(a.grant) {
                a.pages.into_iter().for_each(LentPage::release_quiescent);
            } else {
                kept += a.pages.len();
                a.pages.into_iter().for_each(LentPage::abandon);
            }
        }
        self.entries
            .retain(|_, e| !matches!(e, Entry::PendingPush { .. }));
        let entries = &self.entries;
        self.own.retain_stored(|k| entries.contains_key(k));
        kept
    }

    // ---------------------------------------------------------- helpers

    /// [`Verdict::Withdrawn`] (counted) when a message of request `req_id`
    /// with `keys` keys comes at `now` after a cancel withdrew the request.
    fn withdrawn_verdict(
        &mut self,
        req_id: Option<&str>,
        keys: usize,
        now: Instant,
    ) -> Option<Verdict> {
        let req_id = req_id.filter(|r| self.withdrawn.get(r, now).is_some())?;
        self.counters.withdrawn_keys += keys as u64;
        Some(Verdict::Withdrawn {
            req_id: req_id.to_string(),
            keys,
        })
    }

    fn is_proxy_of(&self, key: &str, handle: &ProxyHandle) -> bool {
        matches!(self.entries.get(key), Some(Entry::Proxy(p)) if p.handle == *handle)
    }

    /// Applies `f` to the handle's slot; when the slot ends up resolved its
    /// key leaves the store, and when the pull is finished the context is
    /// closed and its Done returned.
    fn resolve_slot<F>(&mut self, handle: &ProxyHandle, f: F) -> Option<SendPullDone>
    where
        F: FnOnce(&mut TransferContext, usize) -> Option<SendPullDone>,
    {
        let r = self.contexts.resolve(handle, f)?;
        if let Some(k) = r.resolved_key {
            if self.is_proxy_of(&k, handle) {
                self.unstore(&k);
            }
        }
        let done = r.done;
        if done.is_some() {
            self.counters.dones_emitted += 1;
        }
        done
    }

    /// Discards proxies among `keys` whose read window has passed, so the
    /// message being handled treats them as new; returns Done signals this freed.
    fn replace_expired(&mut self, keys: &[String], now: Instant) -> Vec<SendPullDone> {
        let mut done = Vec::new();
        for k in keys {
            let handle = match self.entries.get(k) {
                Some(Entry::Proxy(p)) if now >= p.read_by => p.handle.clone(),
                _ => continue,
            };
            self.unstore(k);
            self.counters.expired_proxies += 1;
            if let Some(d) = self.resolve_slot(&handle, |c, s| c.discard(s)) {
                done.push(d);
            }
        }
        done
    }
}

fn done_for(notif: &PullReadyNotif) -> SendPullDone {
    SendPullDone {
        done_url: notif.sender_done_url.clone(),
        sender_id: notif.sender_id.clone(),
        signal: super::messages::PullDoneSignal {
            pull_id: notif.pull_id.clone(),
        },
    }
}
