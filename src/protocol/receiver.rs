//! Sans-IO bookkeeping of a receiver (decode side): which keys it holds,
//! in what state, and what to answer and signal.
//!
//! [`KeyStore`] is driven by the messages the shell receives
//! ([`KeyStore::on_alloc_request`], [`KeyStore::on_pull_eager`],
//! [`KeyStore::on_pull_delay`]), by what the shell's transfers report
//! ([`KeyStore::mark_landed`], [`KeyStore::on_read_complete`],
//! [`KeyStore::end_proxy_read`]) and by time ([`KeyStore::sweep`]). It
//! returns the reply to send and any [`SendPullDone`] to push to a sender;
//! it never touches a socket or the clock.
//!
//! # Key states
//!
//! | state | pages | load path ([`KeyStore::get`]) |
//! |---|---|---|
//! | Resident | one page, data landed | [`Lookup::Resident`] |
//! | PendingPush | one page, allocated for a push, data not confirmed | [`Lookup::NotReady`] |
//! | PendingRead | one page, pull-eager read in flight | [`Lookup::NotReady`] |
//! | Proxy | none; the sender's [`BufferRef`] | [`Lookup::Proxy`] (or [`Lookup::Expired`] after the lease) |
//!
//! **Dedup**: a key in *any* state counts as present
//! ([`KeyStore::partition`]), so a second message for a key that is still
//! landing is not transferred twice; the only exception is a proxy whose
//! lease has passed, which is unreadable and is replaced. A pending push
//! that never lands is reclaimed by [`KeyStore::sweep`] after
//! `push_landing_timeout`; the transfer path must refuse writes to pages
//! that are no longer pending (the page may be reused), and the timeout
//! must exceed the sender's write timeout.
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
use super::messages::{
    AllocRequest, AscendAllocResponse, MessageType, PullReadyDoneAck, PullReadyNotif,
};
use super::validate::{check_alloc_request, check_pull_notif, InvalidMessage};
use crate::memory::{BufferRef, ChunkLayout, ChunkMeta, MemObj, MemoryError};

/// Fixed parameters of a receiver's store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReceiverConfig {
    /// This receiver's chunk layout; incoming messages must match it.
    pub layout: ChunkLayout,
    /// How long a page allocated for a push may wait for its data.
    pub push_landing_timeout: Duration,
    /// Reads must start at least this long before the pull's lease ends.
    pub lease_read_margin: Duration,
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
    /// The pull's lease end: never read at or after it.
    pub lease_deadline: Instant,
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
    Resident(&'a MemObj),
    /// Allocated but the data has not landed: never load it as valid.
    NotReady,
    /// A proxy: read it (between [`KeyStore::begin_proxy_read`] and
    /// [`KeyStore::end_proxy_read`]). Looking it up does not consume it.
    Proxy(&'a ProxyEntry),
    /// A proxy whose lease has passed (or is within the read margin): unreadable.
    Expired,
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
}

impl Verdict {
    /// Whether the message was accepted.
    pub fn is_accepted(&self) -> bool {
        matches!(self, Verdict::Accepted { .. })
    }
}

/// The answer to an `AllocRequest`.
#[derive(Debug)]
pub struct PushReply {
    /// The reply to send.
    pub response: AscendAllocResponse,
    /// What happened (for logs and counters).
    pub verdict: Verdict,
    /// Done signals freed by replacing expired proxies; send after the reply.
    pub done: Vec<SendPullDone>,
}

/// One chunk a pull-eager read must fetch.
#[derive(Clone, Debug)]
pub struct ReadItem {
    /// The key.
    pub key: String,
    /// The local page to read into (held for the read's duration).
    pub local: MemObj,
    /// The chunk on the sender.
    pub remote: BufferRef,
    /// Real bytes.
    pub bytes: usize,
}

/// The read a pull-eager handler asks the shell to perform, after sending the ack.
#[derive(Clone, Debug)]
pub struct EagerRead {
    /// The pull; pass it to [`KeyStore::on_read_complete`].
    pub pull_id: String,
    /// The sender to read from.
    pub sender_id: String,
    /// Do not start (or continue) reading at or after this instant.
    pub read_by: Instant,
    /// What to read.
    pub items: Vec<ReadItem>,
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

/// What [`KeyStore::remove`] removed.
#[derive(Debug)]
pub struct Removed {
    /// The state the key was in.
    pub state: KeyState,
    /// Its page, if it had one (drop it to return it to the pool).
    pub page: Option<MemObj>,
    /// The pull's Done, if removing this proxy resolved its last one.
    pub done: Option<SendPullDone>,
}

/// What [`KeyStore::mark_landed`] found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LandedReport {
    /// Keys that became resident.
    pub landed: usize,
    /// Keys (or `uuid[page]` refs) that were not pending pushes (reclaimed, unknown, ...).
    pub not_pending: Vec<String>,
}

/// What [`KeyStore::sweep`] did.
#[derive(Debug, Default)]
pub struct SweepReport {
    /// Pending pushes dropped past their landing deadline (pages back to the pool).
    pub reclaimed_pushes: Vec<String>,
    /// Pull-eager keys dropped because their read did not complete within the lease.
    pub failed_reads: Vec<String>,
    /// Proxies discarded because their lease passed.
    pub expired_proxies: Vec<String>,
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
    /// Done signals emitted.
    pub dones_emitted: u64,
    /// Messages answered `alloc_failed` because allocation failed.
    pub alloc_failures: u64,
    /// Pending pushes reclaimed by the sweep.
    pub reclaimed_pushes: u64,
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
    /// Rejected (invalid) `PullReadyNotif`s.
    pub rejected_pull_notifs: u64,
}

#[derive(Debug)]
enum Entry {
    Resident(MemObj),
    PendingPush {
        page: MemObj,
        peer: String,
        deadline: Instant,
    },
    PendingRead {
        page: MemObj,
        pull_id: String,
    },
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

#[derive(Debug)]
struct PullContext {
    ctx: TransferContext,
    /// Key of each slot.
    keys: Vec<String>,
}

#[derive(Debug)]
struct EagerPull {
    sender_id: String,
    done_url: String,
    deadline: Instant,
    keys: Vec<String>,
}

/// The receiver's keys, pull contexts and counters.
#[derive(Debug)]
pub struct KeyStore {
    config: ReceiverConfig,
    entries: HashMap<String, Entry>,
    /// Page of each pending push -> key, for [`KeyStore::mark_landed_refs`].
    pending_refs: HashMap<BufferRef, String>,
    contexts: HashMap<String, PullContext>,
    eager: HashMap<String, EagerPull>,
    counters: ReceiverCounters,
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

/// Runs `alloc` for `metas`, checking it returned exactly one page per meta.
fn allocate_all<F>(metas: &[ChunkMeta], alloc: F) -> Result<Vec<MemObj>, MemoryError>
where
    F: FnOnce(&[ChunkMeta]) -> Result<Vec<MemObj>, MemoryError>,
{
    if metas.is_empty() {
        return Ok(Vec::new());
    }
    let pages = alloc(metas)?;
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

impl KeyStore {
    /// An empty store.
    pub fn new(config: ReceiverConfig) -> KeyStore {
        KeyStore {
            config,
            entries: HashMap::new(),
            pending_refs: HashMap::new(),
            contexts: HashMap::new(),
            eager: HashMap::new(),
            counters: ReceiverCounters::default(),
        }
    }

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

    /// The state of `key`, if present.
    pub fn state(&self, key: &str) -> Option<KeyState> {
        self.entries.get(key).map(Entry::state)
    }

    /// Number of keys in the store.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether the store holds no key.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// What the load path may do with `key` at `now`. Never changes anything.
    pub fn get(&self, key: &str, now: Instant) -> Lookup<'_> {
        match self.entries.get(key) {
            None => Lookup::Missing,
            Some(Entry::Resident(p)) => Lookup::Resident(p),
            Some(Entry::PendingPush { .. } | Entry::PendingRead { .. }) => Lookup::NotReady,
            Some(Entry::Proxy(p)) => {
                if now >= self.read_by(p.lease_deadline) {
                    Lookup::Expired
                } else {
                    Lookup::Proxy(p)
                }
            }
        }
    }

    /// The pull-delay context of `pull_id`, while open.
    pub fn context(&self, pull_id: &str) -> Option<&TransferContext> {
        self.contexts.get(pull_id).map(|c| &c.ctx)
    }

    /// Removes `key` (eviction, or the load path is done with a resident
    /// key). A removed proxy is discarded in its context (after any read in
    /// flight ends); if that resolves its pull, the Done is returned.
    pub fn remove(&mut self, key: &str) -> Option<Removed> {
        let entry = self.take_entry(key)?;
        let state = entry.state();
        Some(match entry {
            Entry::Resident(page)
            | Entry::PendingPush { page, .. }
            | Entry::PendingRead { page, .. } => Removed {
                state,
                page: Some(page),
                done: None,
            },
            Entry::Proxy(p) => Removed {
                state,
                page: None,
                done: self.resolve_slot(&p.handle, |c, slot| c.discard(slot)),
            },
        })
    }

    // ------------------------------------------------------------- push

    /// Handles an `AllocRequest` from `peer`: validate, dedup, allocate the
    /// new keys all-or-nothing with `alloc`, and record them as pending
    /// pushes until [`KeyStore::mark_landed`]. On any failure nothing of the
    /// message stays and the reply says `alloc_failed`.
    pub fn on_alloc_request<F>(
        &mut self,
        req: &AllocRequest,
        peer: &str,
        now: Instant,
        alloc: F,
    ) -> PushReply
    where
        F: FnOnce(&[ChunkMeta]) -> Result<Vec<MemObj>, MemoryError>,
    {
        let checked = match check_alloc_request(req, &self.config.layout) {
            Ok(c) => c,
            Err(e) => {
                self.counters.rejected_alloc_requests += 1;
                return PushReply {
                    response: failed_push_response(),
                    verdict: Verdict::Rejected(e),
                    done: Vec::new(),
                };
            }
        };
        let done = self.replace_expired(&req.keys, now);
        let part = self.partition(&req.keys);
        let metas: Vec<ChunkMeta> = part.new.iter().map(|&i| checked.metas[i]).collect();
        let pages = match allocate_all(&metas, alloc) {
            Ok(p) => p,
            Err(e) => {
                self.counters.alloc_failures += 1;
                return PushReply {
                    response: failed_push_response(),
                    verdict: Verdict::AllocFailed(e),
                    done,
                };
            }
        };
        // Infallible from here: the message is accepted as a whole.
        let deadline = now + self.config.push_landing_timeout;
        let mut remote_indexes = Vec::with_capacity(pages.len());
        let mut remote_buffer_uuids = Vec::with_capacity(pages.len());
        for (&i, page) in part.new.iter().zip(pages) {
            let r = page.buffer_ref();
            remote_indexes.push(u64::from(r.page));
            remote_buffer_uuids.push(r.uuid.simple().to_string());
            self.pending_refs.insert(r, req.keys[i].clone());
            self.entries.insert(
                req.keys[i].clone(),
                Entry::PendingPush {
                    page,
                    peer: peer.to_owned(),
                    deadline,
                },
            );
        }
        self.counters.dedup_hits += part.present.len() as u64;
        PushReply {
            response: AscendAllocResponse {
                already_sent_indexes: indexes(&part.present),
                remote_indexes,
                remote_buffer_uuids,
                alloc_failed: false,
            },
            verdict: Verdict::Accepted {
                new: part.new.len(),
                present: part.present.len(),
            },
            done,
        }
    }

    /// The shell learned that the pushed data of `keys` has fully landed:
    /// they become resident. Keys that are not pending pushes are reported.
    pub fn mark_landed(&mut self, keys: &[String]) -> LandedReport {
        let mut report = LandedReport::default();
        for k in keys {
            if self.land(k) {
                report.landed += 1;
            } else {
                report.not_pending.push(k.clone());
            }
        }
        report
    }

    /// Like [`KeyStore::mark_landed`], addressed by the local pages written.
    pub fn mark_landed_refs(&mut self, refs: &[BufferRef]) -> LandedReport {
        let mut report = LandedReport::default();
        for r in refs {
            match self.pending_refs.get(r).cloned() {
                Some(k) if self.land(&k) => report.landed += 1,
                _ => report.not_pending.push(r.to_string()),
            }
        }
        report
    }

    /// The peer a pending push came from, if `key` is one.
    pub fn pending_push_peer(&self, key: &str) -> Option<&str> {
        match self.entries.get(key) {
            Some(Entry::PendingPush { peer, .. }) => Some(peer),
            _ => None,
        }
    }

    fn land(&mut self, key: &str) -> bool {
        match self.entries.remove(key) {
            Some(Entry::PendingPush { page, .. }) => {
                self.pending_refs.remove(&page.buffer_ref());
                self.entries.insert(key.to_owned(), Entry::Resident(page));
                self.counters.landed += 1;
                true
            }
            Some(other) => {
                self.entries.insert(key.to_owned(), other);
                false
            }
            None => false,
        }
    }

    // -------------------------------------------------------- pull-eager

    /// Handles a `PullReadyNotif` in pull-eager mode: validate, dedup,
    /// allocate pages for the new keys all-or-nothing, and return the ack
    /// plus the read to perform after sending it. `lease` is the read lease
    /// agreed with the sender. When the read ends, call
    /// [`KeyStore::on_read_complete`], which yields the Done.
    pub fn on_pull_eager<F>(
        &mut self,
        notif: &PullReadyNotif,
        now: Instant,
        lease: Duration,
        alloc: F,
    ) -> PullReply
    where
        F: FnOnce(&[ChunkMeta]) -> Result<Vec<MemObj>, MemoryError>,
    {
        let checked = match self.check_pull(notif) {
            Ok(c) => c,
            Err(reply) => return *reply,
        };
        let mut done = self.replace_expired(&notif.keys, now);
        let part = self.partition(&notif.keys);
        let metas: Vec<ChunkMeta> = part.new.iter().map(|&i| checked.metas[i]).collect();
        let pages = match allocate_all(&metas, alloc) {
            Ok(p) => p,
            Err(e) => {
                self.counters.alloc_failures += 1;
                return PullReply {
                    ack: failed_ack(),
                    verdict: Verdict::AllocFailed(e),
                    read: None,
                    done,
                };
            }
        };
        let deadline = now + lease;
        let mut items = Vec::with_capacity(pages.len());
        for (&i, page) in part.new.iter().zip(pages) {
            let key = notif.keys[i].clone();
            items.push(ReadItem {
                key: key.clone(),
                local: page.clone(),
                remote: checked.remote[i],
                bytes: checked.metas[i].byte_len(),
            });
            self.entries.insert(
                key,
                Entry::PendingRead {
                    page,
                    pull_id: notif.pull_id.clone(),
                },
            );
        }
        self.counters.dedup_hits += part.present.len() as u64;
        let read = if items.is_empty() {
            // Nothing to read: the sender may release at once (after the ack).
            self.counters.dones_emitted += 1;
            done.push(done_for(notif));
            None
        } else {
            self.eager.insert(
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
                read_by: self.read_by(deadline),
                items,
            })
        };
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

    /// The pull-eager read of `pull_id` ended (`ok`: every chunk arrived).
    /// On success its keys become resident; on failure they are dropped.
    /// Either way the pull's Done is returned — exactly once: a second call,
    /// or a call after the sweep gave up on the read, returns `None`.
    pub fn on_read_complete(&mut self, pull_id: &str, ok: bool) -> Option<SendPullDone> {
        let pull = self.eager.remove(pull_id)?;
        for k in &pull.keys {
            let ours = matches!(
                self.entries.get(k),
                Some(Entry::PendingRead { pull_id: p, .. }) if p == pull_id
            );
            if !ours {
                continue;
            }
            if ok {
                if let Some(Entry::PendingRead { page, .. }) = self.entries.remove(k) {
                    self.entries.insert(k.clone(), Entry::Resident(page));
                }
            } else {
                self.entries.remove(k);
                self.counters.failed_reads += 1;
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

    // -------------------------------------------------------- pull-delay

    /// Handles a `PullReadyNotif` in pull-delay mode: validate, dedup, and
    /// store a proxy (no pages) for every new key, all in one
    /// [`TransferContext`] whose lease ends at `now + lease`. The Done comes
    /// when every proxy is consumed or discarded.
    pub fn on_pull_delay(
        &mut self,
        notif: &PullReadyNotif,
        now: Instant,
        lease: Duration,
    ) -> PullReply {
        let checked = match self.check_pull(notif) {
            Ok(c) => c,
            Err(reply) => return *reply,
        };
        let mut done = self.replace_expired(&notif.keys, now);
        let part = self.partition(&notif.keys);
        let deadline = now + lease;
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
                }),
            );
        }
        self.counters.dedup_hits += part.present.len() as u64;
        if let Some(d) = ctx.done_if_empty() {
            self.counters.dones_emitted += 1;
            done.push(d);
        } else {
            self.contexts
                .insert(notif.pull_id.clone(), PullContext { ctx, keys });
        }
        PullReply {
            ack: PullReadyDoneAck {
                already_sent_indexes: indexes(&part.present),
                alloc_failed: false,
            },
            verdict: Verdict::Accepted {
                new: part.new.len(),
                present: part.present.len(),
            },
            read: None,
            done,
        }
    }

    /// Pins the proxy of `key` for a read starting at `now` and returns a
    /// copy of it. Does not consume it: the key stays in the store until
    /// [`KeyStore::end_proxy_read`]. Refused within the read margin of the
    /// lease end.
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
        let read_by = self.read_by(proxy.lease_deadline);
        let ctx = self
            .contexts
            .get_mut(&proxy.handle.pull_id)
            .ok_or_else(|| ProxyReadError::Missing(key.to_owned()))?;
        ctx.ctx
            .begin_read(proxy.handle.slot, now, read_by)
            .map_err(|e| match e {
                ProxyReadError::LeaseExpired(_) => ProxyReadError::LeaseExpired(key.to_owned()),
                ProxyReadError::Resolved(_) => ProxyReadError::Resolved(key.to_owned()),
                _ => ProxyReadError::Missing(key.to_owned()),
            })?;
        Ok(proxy)
    }

    /// Ends a read begun with [`KeyStore::begin_proxy_read`]. Once the slot
    /// resolves (consumed, or discarded after a failure) the key leaves the
    /// store (its data now lives in the KV cache, or is gone). Returns the
    /// pull's Done when this resolved its last proxy; unmatched or repeated
    /// calls return `None` and change nothing.
    pub fn end_proxy_read(
        &mut self,
        handle: &ProxyHandle,
        outcome: ReadOutcome,
    ) -> Option<SendPullDone> {
        self.resolve_slot(handle, |c, slot| c.end_read(slot, outcome))
    }

    // ------------------------------------------------------------- time

    /// Reclaims what time has run out for at `now`:
    ///
    /// * pending pushes past their landing deadline are dropped (the store
    ///   held their only reference, so the pages go back to the pool);
    /// * pull-eager reads not completed by their lease end: their keys are
    ///   dropped and the Done is emitted (the pages return when the shell
    ///   drops its [`EagerRead`]);
    /// * proxies whose lease has passed are discarded (a proxy with a read
    ///   in flight is discarded when that read ends); a pull whose proxies
    ///   are all resolved emits its Done.
    pub fn sweep(&mut self, now: Instant) -> SweepReport {
        let mut report = SweepReport::default();
        let stale: Vec<String> = self
            .entries
            .iter()
            .filter(|(_, e)| matches!(e, Entry::PendingPush { deadline, .. } if now >= *deadline))
            .map(|(k, _)| k.clone())
            .collect();
        for k in stale {
            self.take_entry(&k);
            self.counters.reclaimed_pushes += 1;
            report.reclaimed_pushes.push(k);
        }

        let late: Vec<String> = self
            .eager
            .iter()
            .filter(|(_, p)| now >= p.deadline)
            .map(|(id, _)| id.clone())
            .collect();
        for id in late {
            let keys = self
                .eager
                .get(&id)
                .map(|p| p.keys.clone())
                .unwrap_or_default();
            for k in &keys {
                if matches!(self.entries.get(k), Some(Entry::PendingRead { pull_id, .. }) if *pull_id == id)
                {
                    report.failed_reads.push(k.clone());
                }
            }
            if let Some(d) = self.on_read_complete(&id, false) {
                report.done.push(d);
            }
        }

        let expired: Vec<String> = self
            .contexts
            .iter()
            .filter(|(_, c)| c.ctx.is_expired(now))
            .map(|(id, _)| id.clone())
            .collect();
        for id in expired {
            let keys = match self.contexts.get(&id) {
                Some(c) => c.keys.clone(),
                None => continue,
            };
            for (slot, key) in keys.iter().enumerate() {
                let handle = ProxyHandle {
                    pull_id: id.clone(),
                    slot,
                };
                let outstanding = matches!(
                    self.contexts.get(&id).and_then(|c| c.ctx.slot(slot)),
                    Some(SlotState::Outstanding {
                        discard_pending: false,
                        ..
                    })
                );
                if !outstanding {
                    continue;
                }
                if self.is_proxy_of(key, &handle) {
                    self.take_entry(key);
                }
                self.counters.expired_proxies += 1;
                report.expired_proxies.push(key.clone());
                if let Some(d) = self.resolve_slot(&handle, |c, s| c.discard(s)) {
                    report.done.push(d);
                }
            }
        }
        report
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
        c.contexts_open = self.contexts.len();
        c.proxies_outstanding = self.contexts.values().map(|c| c.ctx.outstanding()).sum();
        c.eager_reads_open = self.eager.len();
        c
    }

    // ---------------------------------------------------------- helpers

    fn read_by(&self, lease_deadline: Instant) -> Instant {
        lease_deadline
            .checked_sub(self.config.lease_read_margin)
            .unwrap_or(lease_deadline)
    }

    /// Validates a notif and checks its pull id is not in use; on error
    /// the failed reply (boxed: it is large and rare).
    fn check_pull(
        &mut self,
        notif: &PullReadyNotif,
    ) -> Result<super::validate::CheckedPull, Box<PullReply>> {
        let checked = check_pull_notif(notif, &self.config.layout).and_then(|c| {
            if self.contexts.contains_key(&notif.pull_id) || self.eager.contains_key(&notif.pull_id)
            {
                Err(InvalidMessage::PullIdInUse {
                    msg: MessageType::PullReadyNotif,
                    pull_id: super::error::shorten(&notif.pull_id),
                })
            } else {
                Ok(c)
            }
        });
        checked.map_err(|e| {
            self.counters.rejected_pull_notifs += 1;
            Box::new(PullReply {
                ack: failed_ack(),
                verdict: Verdict::Rejected(e),
                read: None,
                done: Vec::new(),
            })
        })
    }

    /// Removes an entry, keeping the page-ref index in step.
    fn take_entry(&mut self, key: &str) -> Option<Entry> {
        let e = self.entries.remove(key)?;
        if let Entry::PendingPush { page, .. } = &e {
            self.pending_refs.remove(&page.buffer_ref());
        }
        Some(e)
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
        let pc = self.contexts.get_mut(&handle.pull_id)?;
        let done = f(&mut pc.ctx, handle.slot);
        let resolved = !matches!(
            pc.ctx.slot(handle.slot),
            Some(SlotState::Outstanding { .. }) | None
        );
        let finished = pc.ctx.is_finished();
        let key = pc.keys.get(handle.slot).cloned();
        if resolved {
            if let Some(k) = key {
                if self.is_proxy_of(&k, handle) {
                    self.entries.remove(&k);
                }
            }
        }
        if finished {
            self.contexts.remove(&handle.pull_id);
        }
        if done.is_some() {
            self.counters.dones_emitted += 1;
        }
        done
    }

    /// Discards proxies among `keys` whose lease has passed, so the message
    /// being handled treats them as new; returns Done signals this freed.
    fn replace_expired(&mut self, keys: &[String], now: Instant) -> Vec<SendPullDone> {
        let mut done = Vec::new();
        for k in keys {
            let handle = match self.entries.get(k) {
                Some(Entry::Proxy(p)) if now >= self.read_by(p.lease_deadline) => p.handle.clone(),
                _ => continue,
            };
            self.entries.remove(k);
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
