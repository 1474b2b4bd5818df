//! The sender's sans-IO core (prefill side): the sequence of a put, and
//! everything the puts share (pinned pulls, breaker, backpressure, what is
//! known of each receiver).
//!
//! A put is a [`Put`] driven by [`SenderCore`]: each call takes what the
//! shell observed (a handshake's result, a reply, a write's end, the
//! passage of time) and returns the next [`PutAction`] — connect, send
//! this frame, write these pages, grant these pages, wait for pins — until
//! [`PutAction::Finish`]. Grants to release come out of
//! [`SenderCore::take_grant_releases`]. Nothing here touches a socket, a
//! channel or the clock, so every race is a deterministic test.
//!
//! # Push
//!
//! breaker → handshake if needed → `AllocRequest` → write the new chunks
//! into the granted pages → a [`PushNotice`] (`landed`, or `aborted` when
//! the write failed and is over) on the same request route. A write given
//! up while the device may still run it (hccl) sends no notice: the link is
//! re-established, which replaces the route and, on the receiver, the
//! attachment whose closing tells it we are done.
//!
//! # Pull
//!
//! breaker → handshake if needed → clock check (see [`lease`](super::lease))
//! → admission under the backpressure mark (pages are *reserved* at
//! admission, so concurrent puts cannot overshoot it) → read grant to the
//! receiver → pin (the lease starts) → `PullReadyNotif` whose pull id
//! carries the receiver-clock deadline → the ack ([`PullPending`] rules).
//!
//! # Routes
//!
//! Requests to one receiver go on one REQ socket whose identity, the
//! route `<node>#<n>`, names this sender to the receiver. The core bumps
//! `n` whenever the socket must be replaced (a failed request, a new
//! handshake), so the receiver never confuses an old socket's late
//! messages with the new one's.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use uuid::Uuid;

use super::backpressure::{Admission, Backpressure};
use super::breaker::{BreakerState, CircuitBreaker};
use super::lease::{ClockMap, PullId};
use super::messages::{
    AllocRequest, AscendAllocResponse, ProxyNotif, PullReadyDoneAck, PullReadyNotif,
};
use super::notice::{decode_reply, PushNotice, PushOutcome};
use super::pending::{
    AckOutcome, Delivery, DoneOutcome, ExpiredPull, InsertOutcome, PullCounters, PullPending,
    PullPendingLimits, ReleasedPull,
};
use crate::channel::{GrantId, GrantTag, PeerId, WriteOp};
use crate::config::TransferMode;
use crate::layout::ChunkLayout;
use crate::memory::{BufferRef, ChunkMeta, Page, SealedMemObj};

pub use super::breaker::BreakerCounters;

/// Fixed parameters of a sender's core.
#[derive(Clone, Debug)]
pub struct SenderConfig {
    /// This sender's node id (unique per process and TP rank): its
    /// handshake node, its `sender_id`, the prefix of its routes.
    pub node: String,
    /// Where receivers send PullDoneSignal (`host:port`; pull modes).
    pub done_url: String,
    /// The transfer mode.
    pub mode: TransferMode,
    /// The chunk layout of every put.
    pub layout: ChunkLayout,
    /// The pools chunks must come from.
    pub pools: HashSet<Uuid>,
    /// `pd_pull_pending_ttl`.
    pub pull_pending_ttl: Duration,
    /// `pd_alloc_fail_backoff_ttl`.
    pub alloc_fail_backoff_ttl: Duration,
    /// The pull backpressure mark.
    pub backpressure: Backpressure,
    /// `pd_pull_backpressure_reserve_pct` (for messages).
    pub reserve_pct: f64,
}

/// Where one put goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PutSpec {
    /// The receiver, `host:alloc_port` (also its breaker key).
    pub peer_key: String,
    /// The request id, sent to the proxy in `ProxyNotif`.
    pub req_id: String,
    /// Whether the put carries the request's last prefill chunk (then
    /// `ProxyNotif` follows, whatever happened).
    pub is_last_prefill: bool,
}

/// What a handshake established with a receiver.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Attached {
    /// The receiver on the channel.
    pub peer: PeerId,
    /// The agreed pull lease.
    pub lease: Duration,
    /// The receiver's clock, as far as the handshake could tell.
    pub clock: ClockMap,
    /// Which start of the receiver this is (its hello's `incarnation`).
    pub incarnation: u64,
}

/// What a put did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PutOutcome {
    /// Push: the new chunks were written and the receiver accepted them as landed.
    Pushed {
        /// Chunks written.
        written: usize,
        /// Chunks the receiver already had (not sent again).
        already_present: usize,
    },
    /// Pull: the chunks are pinned and announced; they are released on the
    /// receiver's PullDoneSignal (or at the TTL, never before the lease).
    Announced {
        /// The pull's id.
        pull_id: String,
        /// Chunks the receiver will read (pinned until its Done, which may
        /// already have arrived by the time the put returns).
        announced: usize,
        /// Chunks the receiver already had (unpinned at once).
        already_present: usize,
    },
    /// The receiver's breaker is open after an allocation failure: nothing was sent.
    SkippedBreakerOpen,
    /// The receiver could not allocate (or refused the notification):
    /// nothing was sent, the breaker is now open.
    ReceiverAllocFailed,
}

/// Why a put failed in the protocol (I/O failures are the shell's).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PutRejected {
    /// The caller's input is unusable (named; nothing was sent).
    #[error("invalid put: {0}")]
    InvalidInput(String),
    /// Pull backpressure did not clear in time, or the batch can never fit.
    #[error("backpressure: {0}")]
    Backpressure(String),
    /// The receiver answered with something that is not the expected message.
    #[error("{peer}: bad reply: {detail}")]
    BadReply {
        /// The receiver.
        peer: String,
        /// What was wrong.
        detail: String,
    },
    /// A layer-wise push ended before every layer was handed over: the
    /// receiver was told to drop what it allocated.
    #[error("layer {layer} of {layers} never came: {why}")]
    LayerMissing {
        /// The first layer that was not written.
        layer: usize,
        /// Layers of the model.
        layers: usize,
        /// Why the engine's layers stopped.
        why: String,
    },
    /// The receiver refused our push notice: the chunks are not resident there.
    #[error("{peer} refused the push notice: {why}")]
    NoticeRefused {
        /// The receiver.
        peer: String,
        /// Its reason.
        why: String,
    },
}

/// How a put failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PutFailure {
    /// The last I/O the shell reported failed (the shell holds the error).
    Io,
    /// The protocol refused it.
    Rejected(PutRejected),
}

/// How a put ended, and what to tell the proxy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PutEnd {
    /// The outcome.
    pub result: Result<PutOutcome, PutFailure>,
    /// Send this to the proxy (the request's last prefill chunk), whatever
    /// the outcome, so the decode side never waits for KV that will not come.
    pub proxy_notif: Option<ProxyNotif>,
}

/// Which request a frame is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestKind {
    /// `AllocRequest`.
    AllocRequest,
    /// `PullReadyNotif`.
    PullReadyNotif,
    /// Our push notice.
    PushNotice,
}

impl RequestKind {
    /// A name for messages and counters.
    pub fn name(self) -> &'static str {
        match self {
            RequestKind::AllocRequest => "AllocRequest",
            RequestKind::PullReadyNotif => "PullReadyNotif",
            RequestKind::PushNotice => "push notice",
        }
    }
}

/// How a write ended, as far as its pages are concerned.
#[derive(Debug)]
pub enum WriteEnd {
    /// Every byte was written.
    Written,
    /// The write failed and is over: nothing of it touches the receiver's
    /// pages any more (the channel gave the pages back).
    Failed,
    /// The write failed but may still run (the channel kept the pages).
    Abandoned,
}

/// The next thing the shell must do for a put.
#[derive(Debug)]
pub enum PutAction {
    /// Handshake with the receiver; report with [`SenderCore::on_connected`].
    Connect,
    /// Re-measure the receiver's clock (the handshake socket's clock probe);
    /// report with [`SenderCore::on_clock`].
    SyncClock,
    /// Ask the receiver's init socket for its incarnation (a clock probe,
    /// no attach), then call [`SenderCore::on_probed`]: the receiver
    /// refused us, and only a new incarnation means it restarted.
    ProbeIncarnation,
    /// Wait until pinned pages are released or until `until`, then
    /// [`SenderCore::on_pins_released`].
    WaitForPins {
        /// The longest wait.
        until: Instant,
    },
    /// Grant `peer` read access to `pages`; report with [`SenderCore::on_granted`].
    Grant {
        /// The receiver.
        peer: PeerId,
        /// Our pages it will read.
        pages: Vec<BufferRef>,
    },
    /// Send `frame` on the request socket with identity `route` (replace
    /// the socket if its identity differs); report with [`SenderCore::on_reply`].
    Request {
        /// The socket identity to send from.
        route: String,
        /// The frame.
        frame: Vec<u8>,
        /// What it is.
        kind: RequestKind,
    },
    /// Layer-wise push: write layer `layer`'s ranges of the chunks in
    /// `targets` (`(chunk index, receiver page)`) to `peer` once the engine
    /// has handed that layer over; report with [`SenderCore::on_written`],
    /// or with [`SenderCore::on_layer_missing`] if the layer never comes.
    WriteLayer {
        /// The receiver.
        peer: PeerId,
        /// The allocation's grant tag (as for [`PutAction::Write`]).
        tag: GrantTag,
        /// The layer to write (0 first).
        layer: usize,
        /// The chunks the receiver wants and where each goes.
        targets: Vec<(usize, BufferRef)>,
    },
    /// Write `ops` to `peer`; report with [`SenderCore::on_written`].
    Write {
        /// The receiver.
        peer: PeerId,
        /// The allocation's grant tag (its route's number): the receiver
        /// serves these writes only under that allocation.
        tag: GrantTag,
        /// The chunks and their destinations.
        ops: Vec<WriteOp>,
    },
    /// The put is over.
    Finish(PutEnd),
}

#[derive(Debug)]
enum State {
    Connecting,
    SyncingClock,
    /// A refusal is being checked against the receiver's incarnation.
    Probing,
    Admitting {
        deadline: Instant,
    },
    Granting {
        reserved: usize,
    },
    /// The grant came back; the notification is being built.
    Granted,
    Announcing {
        pull_id: String,
    },
    Allocating {
        route: String,
    },
    Writing {
        route: String,
        refs: Vec<BufferRef>,
        already: usize,
    },
    /// A layer-wise push writes layer `layer` (earlier layers are written).
    Layering {
        route: String,
        targets: Vec<(usize, BufferRef)>,
        already: usize,
        layer: usize,
    },
    Noticing {
        frame: Vec<u8>,
        refs: usize,
        outcome: PushOutcome,
        already: usize,
        attempts: u32,
        /// Set when we wrote nothing into an allocation we could not use:
        /// the put ends with this whatever the notice's reply.
        unused: Option<PutFailure>,
    },
    Finished,
}

/// One put in progress (see the module docs).
#[derive(Debug)]
pub struct Put {
    spec: PutSpec,
    keys: Vec<String>,
    chunks: Vec<SealedMemObj>,
    /// Chunks of the put and the last one's tokens (a layer-wise put
    /// holds no pages: its shell writes them layer by layer).
    count: usize,
    last_tokens: usize,
    /// Layer-wise push: the model's layers, written one at a time.
    layers: Option<usize>,
    state: State,
    /// The receiver's refusal made us attach again to see whether it
    /// restarted: the incarnation that refused. Asked at most once a put.
    suspect: Option<u64>,
    restart_checked: bool,
}

#[derive(Debug, Default)]
struct Link {
    attached: Option<Attached>,
    /// The route number; a fresh one whenever the request socket is
    /// replaced (see [`SenderCore::new_route`]).
    epoch: u64,
}

/// Sender counters of the core.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SenderCounters {
    /// Pull bookkeeping.
    pub pulls: PullCounters,
    /// Circuit breaker.
    pub breaker: BreakerCounters,
    /// Pages admitted under backpressure but not pinned yet.
    pub reserved_pages: usize,
    /// Push notices the receivers refused.
    pub notices_refused: u64,
    /// Receivers found restarted: a refusal came from a new incarnation,
    /// which got the put instead.
    pub receiver_restarts: u64,
}

/// A sender's shared protocol state and the put sequence.
#[derive(Debug)]
pub struct SenderCore {
    cfg: SenderConfig,
    pending: PullPending,
    breaker: CircuitBreaker,
    links: HashMap<String, Link>,
    reserved: usize,
    /// Grants to release on the channel, each with its pages: they stay
    /// here until the channel says no request is served in them any more.
    releases: Vec<(GrantId, Vec<SealedMemObj>)>,
    revokes: Vec<GrantId>,
    /// Pages of pulls that expired without a Done, until their revoked
    /// grant is quiescent (no request of the receiver is still served).
    expired: Vec<(GrantId, Vec<SealedMemObj>)>,
    notices_refused: u64,
    /// Receivers found restarted (a new incarnation answered a refusal).
    restarts: u64,
    /// The last route number handed out, to any link.
    routes: u64,
}

/// How many times a push notice is sent when its reply is lost.
pub const NOTICE_ATTEMPTS: u32 = 3;

/// Longest wait for backpressure to clear, per put.
pub const BACKPRESSURE_WAIT: Duration = Duration::from_secs(30);

impl SenderCore {
    /// A core with nothing pending.
    pub fn new(cfg: SenderConfig) -> SenderCore {
        SenderCore {
            cfg,
            pending: PullPending::new(PullPendingLimits::default()),
            breaker: CircuitBreaker::new(),
            links: HashMap::new(),
            reserved: 0,
            releases: Vec::new(),
            revokes: Vec::new(),
            expired: Vec::new(),
            notices_refused: 0,
            restarts: 0,
            routes: 0,
        }
    }

    /// Gives `peer_key`'s link a route no link of this sender used before.
    ///
    /// The receiver tags a push allocation's write grant with its route's
    /// number, so a write left queued on a connection we gave up on can
    /// never be served under a later allocation of the same page: every
    /// write that does not land ends its route (the link is broken or the
    /// request socket replaced), and numbers are never reused, not even by
    /// another link to the same receiver.
    fn new_route(&mut self, peer_key: &str) -> &mut Link {
        self.routes += 1;
        let link = self.links.entry(peer_key.to_string()).or_default();
        link.epoch = self.routes;
        link
    }

    /// The request route to `peer_key` now (`<node>#<n>`).
    pub fn route(&self, peer_key: &str) -> String {
        let epoch = self.links.get(peer_key).map_or(0, |l| l.epoch);
        format!("{}#{epoch}", self.cfg.node)
    }

    /// What is known of `peer_key`, if attached.
    pub fn attached(&self, peer_key: &str) -> Option<Attached> {
        self.links.get(peer_key)?.attached
    }

    /// Starts a put of `chunks` (one per key, sealed pages of our pools).
    /// Bad input is refused before anything is sent or pinned.
    pub fn begin_put(
        &mut self,
        now: Instant,
        spec: PutSpec,
        keys: Vec<String>,
        chunks: Vec<SealedMemObj>,
    ) -> (Put, PutAction) {
        let descs: Vec<ChunkDesc> = chunks.iter().map(|c| ChunkDesc::of(c)).collect();
        self.start(now, spec, keys, chunks, &descs, None)
    }

    /// Starts a layer-wise push (push mode only) of the chunks `descs`
    /// describes, one per key: after the receiver allocated, the core asks
    /// for one layer at a time ([`PutAction::WriteLayer`]) and sends the
    /// `landed` notice only after the last, so the receiver never counts a
    /// chunk as landed before every layer of it is written. The shell keeps
    /// the pages (it fills each layer before writing it).
    pub fn begin_layered_put(
        &mut self,
        now: Instant,
        spec: PutSpec,
        keys: Vec<String>,
        descs: &[ChunkDesc],
    ) -> (Put, PutAction) {
        let layers = self.cfg.layout.layers;
        self.start(now, spec, keys, Vec::new(), descs, Some(layers))
    }

    fn start(
        &mut self,
        now: Instant,
        spec: PutSpec,
        keys: Vec<String>,
        chunks: Vec<SealedMemObj>,
        descs: &[ChunkDesc],
        layers: Option<usize>,
    ) -> (Put, PutAction) {
        let mut put = Put {
            spec,
            keys,
            chunks,
            count: descs.len(),
            last_tokens: descs.last().map_or(0, |d| d.meta.tokens),
            layers,
            state: State::Finished,
            suspect: None,
            restart_checked: false,
        };
        let checked = match layers {
            Some(_) if self.cfg.mode != TransferMode::Push => {
                Err(PutRejected::InvalidInput(format!(
                    "a layer-wise save needs push mode (pd_layerwise), but this sender runs {}",
                    self.cfg.mode
                )))
            }
            Some(0) => Err(PutRejected::InvalidInput(
                "a layer-wise save needs a model with at least one layer".into(),
            )),
            _ => self.check_put(&put.keys, descs),
        };
        if let Err(e) = checked {
            let end = self.finish(&mut put, Err(PutFailure::Rejected(e)));
            return (put, end);
        }
        if !self.breaker.allows(&put.spec.peer_key, now) {
            let end = self.finish(&mut put, Ok(PutOutcome::SkippedBreakerOpen));
            return (put, end);
        }
        let action = self.after_connect(&mut put, now);
        (put, action)
    }

    /// The handshake ended: `Some` when a receiver is attached.
    pub fn on_connected(&mut self, put: &mut Put, now: Instant, r: Option<Attached>) -> PutAction {
        debug_assert!(matches!(put.state, State::Connecting));
        // A new attachment gets a fresh request socket: the receiver may be
        // a new process, and the old socket's late messages must not count.
        let peer = put.spec.peer_key.clone();
        let link = self.new_route(&peer);
        let Some(a) = r else {
            link.attached = None;
            return self.finish(put, Err(PutFailure::Io));
        };
        let incarnation = a.incarnation;
        link.attached = Some(a);
        match put.suspect.take() {
            // The receiver that refused us is still the one answering: the
            // refusal stands (it is full, or refuses us for its reasons).
            Some(old) if old == incarnation => {
                self.open_breaker(&peer, now);
                self.finish(put, Ok(PutOutcome::ReceiverAllocFailed))
            }
            Some(_) => {
                // It restarted: nothing announced to the old process can be
                // read any more, and the put goes to the new one.
                self.on_peer_restarted(&peer, now);
                self.after_connect(put, now)
            }
            None => self.after_connect(put, now),
        }
    }

    /// The receiver at `peer` restarted (a new incarnation answers): its
    /// pulls are released now — their grants revoked, their pages kept
    /// until the channel is quiescent — instead of at their TTL.
    fn on_peer_restarted(&mut self, peer: &str, now: Instant) {
        self.restarts += 1;
        let gone = self.pending.release_peer(peer, now);
        log::info!(
            "receiver {peer} restarted: attached again; {} pull(s) announced to its old process \
             are released",
            gone.len()
        );
        let mut gone = gone;
        self.hold_until_quiescent(&mut gone);
    }

    /// The receivers attached as `gone` are gone (their process exited):
    /// their attachments end, so the next put to one attaches afresh, and
    /// the pulls announced to them are released now instead of at the TTL
    /// (revoked, kept until the channel says they are quiescent). Returns
    /// the peer keys and how many pulls each lost.
    pub fn receivers_gone(&mut self, gone: &[PeerId], now: Instant) -> Vec<(String, usize)> {
        let keys: Vec<String> = self
            .links
            .iter()
            .filter(|(_, l)| l.attached.as_ref().is_some_and(|a| gone.contains(&a.peer)))
            .map(|(k, _)| k.clone())
            .collect();
        keys.into_iter()
            .map(|k| {
                if let Some(l) = self.links.get_mut(&k) {
                    l.attached = None;
                }
                let mut released = self.pending.release_peer(&k, now);
                self.hold_until_quiescent(&mut released);
                (k, released.len())
            })
            .collect()
    }

    /// Pulls released while a reader may still be inside their pages:
    /// quarantined, their grants revoked, kept until quiescent.
    fn hold_until_quiescent(&mut self, pulls: &mut [ExpiredPull]) {
        for e in pulls {
            if let Some(g) = e.grant {
                let held = std::mem::take(&mut e.held);
                for p in &held {
                    p.quarantine();
                }
                self.revokes.push(g);
                self.expired.push((g, held));
            }
        }
    }

    /// The receiver refused to allocate. Once a put, its incarnation is
    /// probed first: a receiver that restarted refuses us (it does not know
    /// us) exactly as a full one does, and only a new incarnation tells
    /// them apart. The probe does not attach, so a receiver that is merely
    /// full keeps our attachment and the reads in flight under it.
    fn refused(&mut self, put: &mut Put, now: Instant) -> PutAction {
        let peer = put.spec.peer_key.clone();
        if !put.restart_checked {
            if let Some(a) = self.attached(&peer) {
                put.restart_checked = true;
                put.suspect = Some(a.incarnation);
                put.state = State::Probing;
                return PutAction::ProbeIncarnation;
            }
        }
        self.full(put, now)
    }

    /// The refusal stands: skip the receiver for the backoff window, keeping
    /// our attachment (it is the same process).
    fn full(&mut self, put: &mut Put, now: Instant) -> PutAction {
        let peer = put.spec.peer_key.clone();
        self.breaker
            .open(&peer, now, self.cfg.alloc_fail_backoff_ttl);
        log::warn!(
            "receiver {peer} could not allocate; skipping it for {:?}",
            self.cfg.alloc_fail_backoff_ttl
        );
        self.finish(put, Ok(PutOutcome::ReceiverAllocFailed))
    }

    /// The incarnation probe after a refusal ended (`None`: no answer, or
    /// a peer that does not say).
    pub fn on_probed(
        &mut self,
        put: &mut Put,
        now: Instant,
        incarnation: Option<u64>,
    ) -> PutAction {
        debug_assert!(matches!(put.state, State::Probing));
        match (put.suspect, incarnation) {
            // A new process answers: attach to it; `on_connected` retries.
            (Some(old), Some(new)) if old != new => {
                put.state = State::Connecting;
                PutAction::Connect
            }
            // The same process: it is full (or refuses us for its reasons).
            (Some(_), Some(_)) => {
                put.suspect = None;
                self.full(put, now)
            }
            // No answer or no incarnation: as before, attach again next time.
            _ => {
                put.suspect = None;
                self.open_breaker(&put.spec.peer_key.clone(), now);
                self.finish(put, Ok(PutOutcome::ReceiverAllocFailed))
            }
        }
    }

    /// The clock probe ended: `Some` with the new measurement.
    pub fn on_clock(&mut self, put: &mut Put, now: Instant, clock: Option<ClockMap>) -> PutAction {
        debug_assert!(matches!(put.state, State::SyncingClock));
        match (clock, self.links.get_mut(&put.spec.peer_key)) {
            (
                Some(c),
                Some(Link {
                    attached: Some(a), ..
                }),
            ) => {
                a.clock = c;
                self.admit(put, now, now + BACKPRESSURE_WAIT)
            }
            _ => {
                self.broken(&put.spec.peer_key);
                self.finish(put, Err(PutFailure::Io))
            }
        }
    }

    /// Pins were released (or the wait ended): try the admission again.
    pub fn on_pins_released(&mut self, put: &mut Put, now: Instant) -> PutAction {
        let State::Admitting { deadline } = put.state else {
            return self.finish(put, Err(PutFailure::Io));
        };
        self.admit(put, now, deadline)
    }

    /// The read grant for a pull was made (`None`: the channel refused,
    /// e.g. the receiver was detached meanwhile).
    pub fn on_granted(&mut self, put: &mut Put, now: Instant, grant: Option<GrantId>) -> PutAction {
        let State::Granting { reserved } = put.state else {
            return self.finish(put, Err(PutFailure::Io));
        };
        // The reservation ends here, whatever follows: the pins (if any)
        // now count in the pending map.
        self.reserved -= reserved;
        put.state = State::Granted;
        let Some(grant) = grant else {
            return self.finish(put, Err(PutFailure::Io));
        };
        let Some(a) = self.attached(&put.spec.peer_key) else {
            self.releases.push((grant, put.chunks.clone()));
            return self.finish(put, Err(PutFailure::Io));
        };
        // The lease starts now, with the pins, before the notification leaves.
        let deadline_us = a.clock.receiver_deadline_us(now + a.lease, now);
        let pull_id = PullId::new(deadline_us).encode();
        let layout = self.cfg.layout;
        let notif = PullReadyNotif {
            pull_id: pull_id.clone(),
            keys: put.keys.clone(),
            sender_buffer_uuids: put
                .chunks
                .iter()
                .map(|c| c.buffer_ref().uuid.simple().to_string())
                .collect(),
            sender_mem_indexes: put.chunks.iter().map(|c| u64::from(c.page())).collect(),
            sender_id: self.cfg.node.clone(),
            sender_done_url: self.cfg.done_url.clone(),
            fmt: layout.fmt.code(),
            shape: layout.full_shape().iter().map(|&d| d as u64).collect(),
            dtype: layout.dtype.name().to_string(),
            last_chunk_toks: put.chunks.last().map_or(0, |c| c.tokens()) as u64,
            // Our receivers (only they pass our handshake) keep a key
            // shared by several requests until each is done with it.
            req_id: Some(put.spec.req_id.clone()),
            // A put is not told how many more of its request follow, so it
            // does not announce a size: the receiver admits it from the
            // unreserved pages (and may wait for them, as before).
            is_last_batch: None,
            total_chunks: None,
        };
        let inserted = self.pending.insert(
            &pull_id,
            &put.spec.peer_key,
            &put.spec.req_id,
            put.chunks.clone(),
            now,
            a.lease,
            Some(grant),
        );
        match inserted {
            Ok(InsertOutcome::Pending) => {}
            Ok(InsertOutcome::AlreadyDone(r)) => {
                self.queue_release(&r);
                return self.finish(
                    put,
                    Err(PutFailure::Rejected(PutRejected::InvalidInput(format!(
                        "pull id {pull_id} was already reported done"
                    )))),
                );
            }
            Err(e) => {
                self.releases.push((grant, put.chunks.clone()));
                return self.finish(
                    put,
                    Err(PutFailure::Rejected(PutRejected::InvalidInput(
                        e.to_string(),
                    ))),
                );
            }
        }
        put.state = State::Announcing {
            pull_id: pull_id.clone(),
        };
        PutAction::Request {
            route: self.route(&put.spec.peer_key),
            frame: super::Message::PullReadyNotif(notif).encode(),
            kind: RequestKind::PullReadyNotif,
        }
    }

    /// The request sent by the last [`PutAction::Request`] was answered
    /// (`Ok(reply)`), or failed with what is known of its delivery.
    pub fn on_reply(
        &mut self,
        put: &mut Put,
        now: Instant,
        reply: Result<Vec<u8>, Delivery>,
    ) -> PutAction {
        let reply = match reply {
            Ok(r) => r,
            Err(delivery) => {
                // The shell replaces the socket; so does the route.
                self.new_route(&put.spec.peer_key);
                if let State::Noticing {
                    frame, attempts, ..
                } = &mut put.state
                {
                    // The notice names its allocation's route, so the next
                    // socket may repeat it; a repeat is answered alike.
                    if *attempts < NOTICE_ATTEMPTS {
                        *attempts += 1;
                        return PutAction::Request {
                            route: self.route(&put.spec.peer_key),
                            frame: frame.clone(),
                            kind: RequestKind::PushNotice,
                        };
                    }
                }
                if let State::Allocating { route } = &put.state {
                    if delivery == Delivery::Unknown {
                        // The receiver may have allocated on that route and
                        // we never saw where: tell it nothing was written.
                        let route = route.clone();
                        return self.unused_allocation(put, route, PutFailure::Io);
                    }
                }
                if let State::Announcing { pull_id } = &put.state {
                    let pull_id = pull_id.clone();
                    // Released now only if it never left; otherwise held
                    // until the lease end (the receiver may read until then).
                    if let super::pending::ReqFailedOutcome::Released(r) =
                        self.pending.on_req_failed(&pull_id, delivery, now)
                    {
                        self.queue_release(&r);
                    }
                }
                let failure = match &mut put.state {
                    State::Noticing { unused, .. } => unused.take(),
                    _ => None,
                };
                return self.finish(put, Err(failure.unwrap_or(PutFailure::Io)));
            }
        };
        match std::mem::replace(&mut put.state, State::Finished) {
            State::Allocating { route } => self.on_alloc_response(put, now, route, &reply),
            State::Announcing { pull_id } => self.on_ack(put, now, &pull_id, &reply),
            State::Noticing {
                unused: Some(failure),
                ..
            } => {
                if !matches!(decode_reply(&reply), Ok(Ok(()))) {
                    log::warn!(
                        "receiver {} did not take back an allocation we left unwritten; its pages \
                         stay quarantined until its landing timeout and our exit",
                        put.spec.peer_key
                    );
                }
                self.finish(put, Err(failure))
            }
            State::Noticing {
                outcome,
                already,
                refs,
                ..
            } => match decode_reply(&reply) {
                Ok(Ok(())) => match outcome {
                    PushOutcome::Landed => self.finish(
                        put,
                        Ok(PutOutcome::Pushed {
                            written: refs,
                            already_present: already,
                        }),
                    ),
                    PushOutcome::Aborted => self.finish(put, Err(PutFailure::Io)),
                },
                Ok(Err(why)) => {
                    self.notices_refused += 1;
                    let e = match outcome {
                        PushOutcome::Landed => PutFailure::Rejected(PutRejected::NoticeRefused {
                            peer: put.spec.peer_key.clone(),
                            why,
                        }),
                        PushOutcome::Aborted => PutFailure::Io,
                    };
                    self.finish(put, Err(e))
                }
                Err(detail) => {
                    self.broken(&put.spec.peer_key);
                    let e = match outcome {
                        PushOutcome::Landed => PutFailure::Rejected(PutRejected::BadReply {
                            peer: put.spec.peer_key.clone(),
                            detail,
                        }),
                        PushOutcome::Aborted => PutFailure::Io,
                    };
                    self.finish(put, Err(e))
                }
            },
            other => {
                put.state = other;
                self.finish(put, Err(PutFailure::Io))
            }
        }
    }

    /// The push write ended.
    pub fn on_written(&mut self, put: &mut Put, now: Instant, end: WriteEnd) -> PutAction {
        let (route, refs, already) = match std::mem::replace(&mut put.state, State::Finished) {
            State::Writing {
                route,
                refs,
                already,
            } => (route, refs, already),
            State::Layering {
                route,
                targets,
                already,
                layer,
            } => {
                let layers = put.layers.unwrap_or(0);
                if matches!(end, WriteEnd::Written) && layer + 1 < layers {
                    let Some(a) = self.attached(&put.spec.peer_key) else {
                        // Another put to this receiver failed meanwhile and
                        // the link is to be attached again: nothing more is
                        // written into this allocation, and the receiver is
                        // told to drop it now rather than at its timeout.
                        put.state = State::Layering {
                            route,
                            targets,
                            already,
                            layer: layer + 1,
                        };
                        return self.on_layer_missing(
                            put,
                            now,
                            "the link to the receiver failed during the save (another request's \
                             transfer to it failed); the save is given up"
                                .into(),
                        );
                    };
                    let tag = GrantTag::of_route(&route).unwrap_or(GrantTag::UNTAGGED);
                    put.state = State::Layering {
                        route,
                        targets: targets.clone(),
                        already,
                        layer: layer + 1,
                    };
                    return PutAction::WriteLayer {
                        peer: a.peer,
                        tag,
                        layer: layer + 1,
                        targets,
                    };
                }
                // The last layer is written (landed), or a write failed.
                (route, targets.into_iter().map(|t| t.1).collect(), already)
            }
            _ => return self.finish(put, Err(PutFailure::Io)),
        };
        let outcome = match end {
            WriteEnd::Written => PushOutcome::Landed,
            WriteEnd::Failed => {
                // Attach again next time: the receiver may have restarted
                // (new pools), which fails every write until we do.
                self.broken(&put.spec.peer_key);
                PushOutcome::Aborted
            }
            WriteEnd::Abandoned => {
                // No notice until the device lets go: re-attach, which
                // replaces our attachment (and route) on the receiver.
                self.broken(&put.spec.peer_key);
                return self.finish(put, Err(PutFailure::Io));
            }
        };
        let frame = PushNotice {
            route,
            outcome,
            refs: refs.clone(),
        }
        .encode();
        put.state = State::Noticing {
            frame: frame.clone(),
            refs: refs.len(),
            outcome,
            already,
            attempts: 1,
            unused: None,
        };
        PutAction::Request {
            route: self.route(&put.spec.peer_key),
            frame,
            kind: RequestKind::PushNotice,
        }
    }

    /// A `PullDoneSignal` for `pull_id` arrived at `now`.
    pub fn on_done_signal(&mut self, now: Instant, pull_id: &str) -> DoneOutcome {
        self.done_signal(now, pull_id)
    }

    /// A `PullDoneSignal` for `pull_id` that the receiver `peer_key`
    /// authenticated (it came sealed by that attachment): acted on like
    /// [`SenderCore::on_done_signal`], unless the pull is pending towards
    /// another receiver — then `None`, and nothing changes (one receiver
    /// cannot free the pages another still reads).
    pub fn on_done_signal_from(
        &mut self,
        now: Instant,
        pull_id: &str,
        peer_key: &str,
    ) -> Option<DoneOutcome> {
        match self.pending.peer_of(pull_id) {
            Some(p) if p != peer_key => None,
            _ => Some(self.done_signal(now, pull_id)),
        }
    }

    fn done_signal(&mut self, now: Instant, pull_id: &str) -> DoneOutcome {
        let outcome = self.pending.on_done(pull_id, now);
        if let DoneOutcome::Released(r) = &outcome {
            self.queue_release(r);
        }
        outcome
    }

    /// Releases pulls due at `now` (never before their lease) and prunes
    /// closed breakers. A pull that expires got no Done: its grant is to be
    /// revoked ([`SenderCore::take_grant_revokes`]) and its pages stay
    /// quarantined here until the channel says the grant is quiescent
    /// ([`SenderCore::on_quiescent`]).
    pub fn sweep(&mut self, now: Instant) -> Vec<ExpiredPull> {
        let mut expired = self.pending.sweep(now, self.cfg.pull_pending_ttl);
        self.hold_until_quiescent(&mut expired);
        self.breaker.prune(now);
        expired
    }

    /// Keeps a released pull's pages with its grant until the channel
    /// released the grant ([`SenderCore::release_grants`]).
    fn queue_release(&mut self, r: &ReleasedPull) {
        if let Some(g) = r.grant {
            self.releases.push((g, r.pages.clone()));
        }
    }

    /// Releases on the channel (`release`) the grants of pulls released
    /// since the last call (the receiver reported). `release` returns
    /// whether no request is served in the pages any more; when it is not
    /// (a read of the receiver is still being sent out of them), the pages
    /// are quarantined and kept until the channel says the grant is
    /// quiescent ([`SenderCore::awaiting_quiescence`]), as for an expired
    /// pull: a page a reader is still inside never goes back to its pool.
    /// Returns the grants released.
    pub fn release_grants(&mut self, mut release: impl FnMut(GrantId) -> bool) -> Vec<GrantId> {
        let mut done = Vec::new();
        for (g, pages) in std::mem::take(&mut self.releases) {
            done.push(g);
            if !release(g) {
                for p in &pages {
                    p.quarantine();
                }
                self.expired.push((g, pages));
            }
        }
        done
    }

    /// Grants whose pulls were released since the last call, as
    /// [`SenderCore::release_grants`] with a channel that always reports
    /// the pages free.
    #[cfg(test)]
    pub fn take_grant_releases(&mut self) -> Vec<GrantId> {
        self.release_grants(|_| true)
    }

    /// Grants of pulls that expired since the last call (revoke them on the channel).
    pub fn take_grant_revokes(&mut self) -> Vec<GrantId> {
        std::mem::take(&mut self.revokes)
    }

    /// Revoked grants (and released ones still served) whose pages wait
    /// for quiescence.
    pub fn awaiting_quiescence(&self) -> Vec<GrantId> {
        self.expired.iter().map(|(g, _)| *g).collect()
    }

    /// The channel says revoked grant `grant` is quiescent: its pages go.
    pub fn on_quiescent(&mut self, grant: GrantId) {
        self.expired.retain(|(g, _)| *g != grant);
    }

    /// The breaker state towards `peer_key`.
    pub fn breaker_state(&self, peer_key: &str, now: Instant) -> BreakerState {
        self.breaker.state(peer_key, now)
    }

    /// Pulls pending.
    pub fn pulls_pending(&self) -> usize {
        self.pending.len()
    }

    /// The requests with a pull pending, each once.
    pub fn pending_requests(&self) -> Vec<String> {
        self.pending.requests()
    }

    /// Whether every pull has ended with its pages back: none pending, and
    /// none released without a Done (expired, or its receiver gone or
    /// restarted) whose pages still wait for their grant to be quiescent.
    /// [`SenderCore::pulls_pending`] reaching 0 is not enough: those pages
    /// leave the pull before they leave this core.
    pub fn is_drained(&self) -> bool {
        self.pulls_pending() == 0 && self.expired.is_empty()
    }

    /// The counters.
    pub fn counters(&self) -> SenderCounters {
        SenderCounters {
            pulls: self.pending.counters(),
            breaker: self.breaker.counters(),
            reserved_pages: self.reserved,
            notices_refused: self.notices_refused,
            receiver_restarts: self.restarts,
        }
    }

    // ---------------------------------------------------------- steps

    fn after_connect(&mut self, put: &mut Put, now: Instant) -> PutAction {
        let Some(a) = self.attached(&put.spec.peer_key) else {
            put.state = State::Connecting;
            return PutAction::Connect;
        };
        if self.cfg.mode == TransferMode::Push {
            let layout = self.cfg.layout;
            let req = AllocRequest {
                keys: put.keys.clone(),
                fmt: layout.fmt.code(),
                shape: layout.full_shape().iter().map(|&d| d as u64).collect(),
                dtype: layout.dtype.name().to_string(),
                last_chunk_toks: put.last_tokens as u64,
                // Upstream's optional request id (only our receivers pass
                // our handshake, and they keep a key shared by several
                // requests until each is done with it).
                req_id: Some(put.spec.req_id.clone()),
                ..AllocRequest::default()
            };
            let route = self.route(&put.spec.peer_key);
            put.state = State::Allocating {
                route: route.clone(),
            };
            return PutAction::Request {
                route,
                frame: super::Message::AllocRequest(req).encode(),
                kind: RequestKind::AllocRequest,
            };
        }
        // The deadline we send is only as good as our view of the
        // receiver's clock: re-measure once drift could eat 5 % of the lease.
        if u128::from(a.clock.drift_us(now)) * 20 > a.lease.as_micros() {
            put.state = State::SyncingClock;
            return PutAction::SyncClock;
        }
        self.admit(put, now, now + BACKPRESSURE_WAIT)
    }

    fn admit(&mut self, put: &mut Put, now: Instant, deadline: Instant) -> PutAction {
        let n = put.chunks.len();
        let bp = self.cfg.backpressure;
        match bp.check(self.pending.pinned_pages() + self.reserved, n) {
            Admission::Admit => {
                let Some(a) = self.attached(&put.spec.peer_key) else {
                    return self.finish(put, Err(PutFailure::Io));
                };
                // Reserved now, pinned at the grant: two puts cannot both
                // pass the check and overshoot the mark together.
                self.reserved += n;
                put.state = State::Granting { reserved: n };
                PutAction::Grant {
                    peer: a.peer,
                    pages: put.chunks.iter().map(|c| c.buffer_ref()).collect(),
                }
            }
            Admission::TooLarge => self.finish(
                put,
                Err(PutFailure::Rejected(PutRejected::Backpressure(format!(
                    "a batch of {n} pages can never fit under the high-water mark of {} pinned pages \
                     (pool {} pages, reserve {}%); split the put or raise pd_buffer_size",
                    bp.high_water(),
                    bp.total_pages(),
                    self.cfg.reserve_pct
                )))),
            ),
            Admission::Wait if now >= deadline => self.finish(
                put,
                Err(PutFailure::Rejected(PutRejected::Backpressure(format!(
                    "{} pages still pinned after {BACKPRESSURE_WAIT:?} (high-water {}); receivers \
                     are not sending PullDoneSignal",
                    self.pending.pinned_pages() + self.reserved,
                    bp.high_water()
                )))),
            ),
            Admission::Wait => {
                put.state = State::Admitting { deadline };
                PutAction::WaitForPins { until: deadline }
            }
        }
    }

    fn on_alloc_response(
        &mut self,
        put: &mut Put,
        now: Instant,
        route: String,
        reply: &[u8],
    ) -> PutAction {
        let peer = put.spec.peer_key.clone();
        let resp = match AscendAllocResponse::decode(reply) {
            Ok(r) => r,
            Err(e) => {
                self.broken(&peer);
                let e = PutFailure::Rejected(PutRejected::BadReply {
                    peer,
                    detail: e.to_string(),
                });
                return self.unused_allocation(put, route, e);
            }
        };
        if resp.alloc_failed {
            return self.refused(put, now);
        }
        if put.layers.is_some() {
            return self.first_layer(put, route, &resp);
        }
        let ops = match push_ops(&put.chunks, &resp) {
            Ok(ops) => ops,
            Err(detail) => {
                self.broken(&peer);
                let e = PutFailure::Rejected(PutRejected::BadReply { peer, detail });
                return self.unused_allocation(put, route, e);
            }
        };
        let already = put.chunks.len() - ops.len();
        if ops.is_empty() {
            return self.finish(
                put,
                Ok(PutOutcome::Pushed {
                    written: 0,
                    already_present: already,
                }),
            );
        }
        let Some(a) = self.attached(&peer) else {
            return self.unused_allocation(put, route, PutFailure::Io);
        };
        // Routes are `<node>#<n>` (SenderCore::route); were one not, the
        // receiver would refuse the untagged write, never misplace it.
        let tag = GrantTag::of_route(&route).unwrap_or(GrantTag::UNTAGGED);
        put.state = State::Writing {
            route,
            refs: ops.iter().map(|o| o.remote).collect(),
            already,
        };
        PutAction::Write {
            peer: a.peer,
            tag,
            ops,
        }
    }

    /// A layer-wise push's allocation came back: ask for layer 0.
    fn first_layer(
        &mut self,
        put: &mut Put,
        route: String,
        resp: &AscendAllocResponse,
    ) -> PutAction {
        let peer = put.spec.peer_key.clone();
        let targets = match push_targets(put.count, resp) {
            Ok(t) => t,
            Err(detail) => {
                self.broken(&peer);
                let e = PutFailure::Rejected(PutRejected::BadReply { peer, detail });
                return self.unused_allocation(put, route, e);
            }
        };
        let already = put.count - targets.len();
        if targets.is_empty() {
            return self.finish(
                put,
                Ok(PutOutcome::Pushed {
                    written: 0,
                    already_present: already,
                }),
            );
        }
        let Some(a) = self.attached(&peer) else {
            return self.unused_allocation(put, route, PutFailure::Io);
        };
        let tag = GrantTag::of_route(&route).unwrap_or(GrantTag::UNTAGGED);
        // The receiver keeps one pending allocation per route, and this one
        // stays pending for a whole forward pass: the puts that start
        // meanwhile get a route of their own. Its notice still names this
        // route, which any later socket of ours may carry.
        self.new_route(&peer);
        put.state = State::Layering {
            route,
            targets: targets.clone(),
            already,
            layer: 0,
        };
        PutAction::WriteLayer {
            peer: a.peer,
            tag,
            layer: 0,
            targets,
        }
    }

    /// A layer-wise push's next layer never came (the engine closed the
    /// save early, cancelled it, or stopped handing layers over): the
    /// receiver is told to drop the allocation (`aborted`), and the put
    /// fails with `why`.
    pub fn on_layer_missing(&mut self, put: &mut Put, _now: Instant, why: String) -> PutAction {
        let State::Layering {
            route,
            targets,
            layer,
            ..
        } = std::mem::replace(&mut put.state, State::Finished)
        else {
            return self.finish(put, Err(PutFailure::Io));
        };
        let layers = put.layers.unwrap_or(0);
        let frame = PushNotice {
            route,
            outcome: PushOutcome::Aborted,
            refs: targets.iter().map(|t| t.1).collect(),
        }
        .encode();
        put.state = State::Noticing {
            frame: frame.clone(),
            refs: targets.len(),
            outcome: PushOutcome::Aborted,
            already: 0,
            attempts: 1,
            unused: Some(PutFailure::Rejected(PutRejected::LayerMissing {
                layer,
                layers,
                why,
            })),
        };
        PutAction::Request {
            route: self.route(&put.spec.peer_key),
            frame,
            kind: RequestKind::PushNotice,
        }
    }

    fn on_ack(&mut self, put: &mut Put, now: Instant, pull_id: &str, reply: &[u8]) -> PutAction {
        let ack = match PullReadyDoneAck::decode(reply) {
            Ok(a) => a,
            Err(e) => {
                // The receiver may still read: hold the pins until the lease.
                self.pending.on_req_failed(pull_id, Delivery::Unknown, now);
                return self.finish(
                    put,
                    Err(PutFailure::Rejected(PutRejected::BadReply {
                        peer: put.spec.peer_key.clone(),
                        detail: e.to_string(),
                    })),
                );
            }
        };
        let outcome = self.pending.on_ack(pull_id, &ack, now);
        match &outcome {
            AckOutcome::AllAlreadySent(r) | AckOutcome::AllocFailed(r) => self.queue_release(r),
            _ => {}
        }
        if outcome.opens_breaker() {
            return self.refused(put, now);
        }
        let already_present = ack.already_sent_indexes.len();
        self.finish(
            put,
            Ok(PutOutcome::Announced {
                announced: put.chunks.len().saturating_sub(already_present),
                pull_id: pull_id.to_string(),
                already_present,
            }),
        )
    }

    /// We will not write into whatever the receiver allocated on `route`
    /// (we never learnt where, or cannot use it): an `aborted` notice with
    /// no pages gives it back at once instead of at the landing timeout
    /// (on one-sided channels, at our exit). The put then ends with
    /// `failure`.
    fn unused_allocation(
        &mut self,
        put: &mut Put,
        route: String,
        failure: PutFailure,
    ) -> PutAction {
        let frame = PushNotice {
            route,
            outcome: PushOutcome::Aborted,
            refs: Vec::new(),
        }
        .encode();
        put.state = State::Noticing {
            frame: frame.clone(),
            refs: 0,
            outcome: PushOutcome::Aborted,
            already: 0,
            attempts: 1,
            unused: Some(failure),
        };
        PutAction::Request {
            route: self.route(&put.spec.peer_key),
            frame,
            kind: RequestKind::PushNotice,
        }
    }

    fn finish(&mut self, put: &mut Put, result: Result<PutOutcome, PutFailure>) -> PutAction {
        if let State::Granting { reserved } = put.state {
            self.reserved -= reserved;
        }
        put.state = State::Finished;
        // The put's own references go now; pages a pull still advertises
        // stay pinned by its pending entry, the rest return to the pool
        // even if the shell keeps the finished put around.
        put.chunks = Vec::new();
        PutAction::Finish(PutEnd {
            result,
            proxy_notif: put.spec.is_last_prefill.then(|| ProxyNotif {
                req_id: put.spec.req_id.clone(),
            }),
        })
    }

    /// The receiver refused to allocate: skip it for the backoff window,
    /// then attach again (a receiver that restarted, or lost our
    /// attachment, refuses us the same way as a full one).
    fn open_breaker(&mut self, peer: &str, now: Instant) {
        self.broken(peer);
        self.breaker
            .open(peer, now, self.cfg.alloc_fail_backoff_ttl);
        log::warn!(
            "receiver {peer} could not allocate; skipping it for {:?}",
            self.cfg.alloc_fail_backoff_ttl
        );
    }

    /// The receiver must be attached again (and the route replaced).
    fn broken(&mut self, peer: &str) {
        self.new_route(peer).attached = None;
    }

    /// One chunk per key, pages of our pools, one layout, only the last
    /// chunk partial.
    fn check_put(&self, keys: &[String], chunks: &[ChunkDesc]) -> Result<(), PutRejected> {
        let bad = |m: String| Err(PutRejected::InvalidInput(m));
        if keys.is_empty() {
            return bad("no keys".into());
        }
        if keys.len() != chunks.len() {
            return bad(format!("{} keys but {} chunks", keys.len(), chunks.len()));
        }
        let mut seen = HashSet::new();
        for k in keys {
            if k.is_empty() || !seen.insert(k.as_str()) {
                return bad(format!("key {k:?} is empty or repeated"));
            }
        }
        let layout = self.cfg.layout;
        for (i, c) in chunks.iter().enumerate() {
            if !self.cfg.pools.contains(&c.pool) {
                return bad(format!(
                    "chunk {i} is not a page of this sender's pools (allocate with Sender::allocate)"
                ));
            }
            if c.meta.layout != layout {
                return bad(format!(
                    "chunk {i} has layout {:?}, not the configured {layout:?}",
                    c.meta.layout
                ));
            }
            if i + 1 < chunks.len() && c.meta.tokens != layout.tokens {
                return bad(format!(
                    "chunk {i} is partial ({} tokens) but only the last chunk may be",
                    c.meta.tokens
                ));
            }
        }
        Ok(())
    }
}

/// What the core checks of a chunk it is asked to send.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkDesc {
    /// The pool its page is in.
    pub pool: Uuid,
    /// Its layout and tokens.
    pub meta: ChunkMeta,
}

impl ChunkDesc {
    /// The description of `page`.
    pub fn of(page: &Page) -> ChunkDesc {
        ChunkDesc {
            pool: page.buffer_ref().uuid,
            meta: page.meta(),
        }
    }
}

/// Pairs the chunks (of `count`) the receiver wants with the pages it
/// allocated: `(chunk index, receiver page)`, in chunk order.
fn push_targets(
    count: usize,
    resp: &AscendAllocResponse,
) -> Result<Vec<(usize, BufferRef)>, String> {
    let present: HashSet<u64> = resp.already_sent_indexes.iter().copied().collect();
    if resp.already_sent_indexes.iter().any(|&i| i >= count as u64) {
        return Err("already_sent_indexes out of range".into());
    }
    let new: Vec<usize> = (0..count)
        .filter(|i| !present.contains(&(*i as u64)))
        .collect();
    if resp.remote_indexes.len() != new.len() || resp.remote_buffer_uuids.len() != new.len() {
        return Err(format!(
            "{} new chunks but {} remote indexes and {} uuids",
            new.len(),
            resp.remote_indexes.len(),
            resp.remote_buffer_uuids.len()
        ));
    }
    new.into_iter()
        .zip(resp.remote_indexes.iter().zip(&resp.remote_buffer_uuids))
        .map(|(i, (&page, uuid))| {
            let uuid = Uuid::parse_str(uuid).map_err(|e| format!("uuid {uuid:?}: {e}"))?;
            let page = u32::try_from(page).map_err(|_| format!("page {page} too large"))?;
            Ok((i, BufferRef { uuid, page }))
        })
        .collect()
}

/// Pairs the chunks the receiver wants with the pages it allocated.
fn push_ops(chunks: &[SealedMemObj], resp: &AscendAllocResponse) -> Result<Vec<WriteOp>, String> {
    Ok(push_targets(chunks.len(), resp)?
        .into_iter()
        .map(|(i, remote)| WriteOp::chunk(chunks[i].clone(), remote))
        .collect())
}
