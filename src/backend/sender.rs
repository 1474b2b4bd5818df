//! The prefill side: `put` chunks to a receiver in the configured mode.

use super::counters::{MessageCounters, MessageKind};
use super::zmq_io::{PushPool, ReqClient, ReqFailure};
use super::{check_config, lock, spawn, BackendError};
use crate::channel::handshake::{self, Hello};
use crate::channel::{self, landed, PeerId, TransferChannel, TransferOp};
use crate::config::{PdConfig, PortList, Role, TransferMode};
use crate::memory::{BufferRef, ChunkLayout, ChunkMeta, DualAllocator, DualStats, MemObj};
use crate::protocol::{
    Admission, AllocRequest, AscendAllocResponse, Backpressure, BreakerCounters, BreakerState,
    CircuitBreaker, Delivery, DoneOutcome, InsertOutcome, Message, ProxyNotif, PullCounters,
    PullPending, PullPendingLimits, PullReadyDoneAck, PullReadyNotif,
};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use uuid::Uuid;

/// Where one request's KV goes (what the scheduler tells the prefill worker).
#[derive(Clone, Debug)]
pub struct TransferSpec {
    /// The request id, sent to the proxy in `ProxyNotif`.
    pub req_id: String,
    /// The receiver's host.
    pub receiver_host: String,
    /// The receiver's `pd_peer_init_port` (one per TP rank, or one for all).
    pub receiver_init_port: PortList,
    /// The receiver's `pd_peer_alloc_port` (one per TP rank, or one for all).
    pub receiver_alloc_port: PortList,
    /// Whether this put carries the request's last prefill chunk (then `ProxyNotif` follows).
    pub is_last_prefill: bool,
}

/// What a put did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PutOutcome {
    /// Push: the new chunks were written and reported landed.
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
        /// already have arrived by the time `put` returns).
        announced: usize,
        /// Chunks the receiver already had (unpinned at once).
        already_present: usize,
    },
    /// The receiver's breaker is open after an allocation failure: nothing was sent.
    SkippedBreakerOpen,
    /// The receiver could not allocate: nothing was sent, the breaker is now open.
    ReceiverAllocFailed,
}

/// Counters of a sender.
#[derive(Clone, Debug)]
pub struct SenderStats {
    /// Pool counters (pinned pages included).
    pub pools: DualStats,
    /// Pull bookkeeping.
    pub pulls: PullCounters,
    /// Breaker counters.
    pub breaker: BreakerCounters,
    /// Messages and errors by kind.
    pub messages: Vec<(MessageKind, u64)>,
    /// Bytes written (push) by this sender.
    pub bytes_written: u64,
}

/// Side-channel timing of a sender (defaults suit loopback and LAN peers).
#[derive(Clone, Debug)]
pub struct SenderTimeouts {
    /// Handshake with a receiver.
    pub handshake: Duration,
    /// One AllocRequest / PullReadyNotif round trip.
    pub request: Duration,
    /// Longest wait for pull backpressure to clear.
    pub backpressure: Duration,
    /// How often the TTL sweep runs.
    pub sweep_every: Duration,
}

impl Default for SenderTimeouts {
    fn default() -> Self {
        SenderTimeouts {
            handshake: Duration::from_secs(10),
            request: Duration::from_secs(10),
            backpressure: Duration::from_secs(30),
            sweep_every: Duration::from_millis(200),
        }
    }
}

struct Link {
    peer: Option<(PeerId, Duration)>,
    init_url: String,
    /// AllocRequest / PullReadyNotif to the receiver's alloc port.
    req: ReqClient,
    /// Landed notices to the receiver's init port (push mode).
    landed: ReqClient,
}

struct Shared {
    config: PdConfig,
    mode: TransferMode,
    rank: usize,
    node: String,
    done_url: String,
    done_port: Option<u16>,
    ctx: zmq::Context,
    alloc: DualAllocator,
    channel: Arc<dyn TransferChannel>,
    local_uuids: HashSet<Uuid>,
    pending: Mutex<PullPending>,
    released: Condvar,
    breaker: Mutex<CircuitBreaker>,
    backpressure: Backpressure,
    links: Mutex<HashMap<String, Arc<Mutex<Link>>>>,
    proxy: PushPool,
    counters: Arc<MessageCounters>,
    stop: AtomicBool,
    timeouts: SenderTimeouts,
}

/// A prefill worker's PD sender.
pub struct Sender {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

impl Sender {
    /// Starts a sender for TP rank `rank` with `config` (role must be sender).
    /// NPU pools (and hccl's pinned host pool) come from the CANN runtime,
    /// found as `ascend_sys` searches for it (`ASCEND_PD_CANN_LIB_DIR` first).
    pub fn start(
        config: &PdConfig,
        rank: usize,
        timeouts: SenderTimeouts,
    ) -> Result<Sender, BackendError> {
        check_config(config, Role::Sender)?;
        let mode = config.mode();
        let host = config
            .peer_host
            .clone()
            .unwrap_or_else(|| "127.0.0.1".to_string());
        // A bare `npu` device means NPU <rank>; CANN is loaded only if a pool needs it.
        let alloc = super::pools::allocator_for(config, rank as u32)?;
        let pools: Vec<_> = alloc.pools().cloned().collect();
        let channel = channel::open(config.transfer_channel, &host, &pools)?;
        let local_uuids = pools.iter().map(|p| p.uuid()).collect();
        let ctx = zmq::Context::new();
        let counters = Arc::new(MessageCounters::default());
        let c2 = Arc::clone(&counters);
        let proxy = PushPool::spawn(&ctx, "pd-proxy-push", move |_| {
            c2.bump(MessageKind::Timeout);
        })?;
        let done_port = if mode.is_pull() {
            Some(config.done_port(rank).ok_or_else(|| {
                BackendError::Setup(format!(
                    "pd_pull_done_port: no port for TP rank {rank} (give one per rank)"
                ))
            })?)
        } else {
            None
        };
        let node = format!("{host}:{}", done_port.unwrap_or(0));
        let total = alloc.primary().stats().total;
        let shared = Arc::new(Shared {
            config: config.clone(),
            mode,
            rank,
            done_url: node.clone(),
            done_port,
            node,
            ctx,
            backpressure: Backpressure::new(total, config.backpressure_reserve_pct),
            alloc,
            channel,
            local_uuids,
            pending: Mutex::new(PullPending::new(PullPendingLimits::default())),
            released: Condvar::new(),
            breaker: Mutex::new(CircuitBreaker::new()),
            links: Mutex::new(HashMap::new()),
            proxy,
            counters,
            stop: AtomicBool::new(false),
            timeouts,
        });
        let mut threads = Vec::new();
        if let Some(port) = done_port {
            let sock = shared
                .ctx
                .socket(zmq::PULL)
                .map_err(BackendError::zmq("creating the PullDoneSignal socket"))?;
            sock.set_rcvtimeo(100).ok();
            sock.set_linger(0).ok();
            let url = format!("tcp://{host}:{port}");
            sock.bind(&url).map_err(BackendError::zmq(format!(
                "binding the PullDoneSignal socket {url} (pd_pull_done_port in use?)"
            )))?;
            let s = Arc::clone(&shared);
            threads.push(spawn("pd-done-listener", move || done_loop(&s, sock))?);
        }
        let s = Arc::clone(&shared);
        threads.push(spawn("pd-sender-sweep", move || sweep_loop(&s))?);
        Ok(Sender { shared, threads })
    }

    /// The transfer mode.
    pub fn mode(&self) -> TransferMode {
        self.shared.mode
    }

    /// The port of the PullDoneSignal socket (pull modes).
    pub fn done_port(&self) -> Option<u16> {
        self.shared.done_port
    }

    /// The layout of one full chunk.
    pub fn chunk_layout(&self) -> ChunkLayout {
        self.shared.config.chunk_layout()
    }

    /// The allocator (pages to fill before `put` come from its placement pool).
    pub fn allocator(&self) -> &DualAllocator {
        &self.shared.alloc
    }

    /// Pages for chunks of `tokens` tokens each (only the last may be partial).
    pub fn allocate(&self, tokens: &[usize]) -> Result<Vec<MemObj>, BackendError> {
        let layout = self.chunk_layout();
        let metas: Vec<ChunkMeta> = tokens
            .iter()
            .map(|&t| ChunkMeta::partial(layout, t))
            .collect();
        Ok(self.shared.alloc.allocate_batch(&metas)?)
    }

    /// Sends `chunks` (one per key, pages of this sender's pools) to the
    /// receiver of `spec` in the configured mode. Returns once the data is
    /// written (push) or announced and acknowledged (pull); in pull modes
    /// the pages stay pinned until the receiver's PullDoneSignal.
    pub fn put(
        &self,
        keys: &[String],
        chunks: &[MemObj],
        spec: &TransferSpec,
    ) -> Result<PutOutcome, BackendError> {
        let s = &self.shared;
        let result = self.put_inner(keys, chunks, spec);
        if spec.is_last_prefill {
            // The proxy learns the request is done whatever happened, so the
            // decode side never waits for KV that will not come.
            let frame = Message::ProxyNotif(ProxyNotif {
                req_id: spec.req_id.clone(),
            })
            .encode();
            if let (Some(h), Some(p)) = (&s.config.proxy_host, s.config.proxy_port) {
                s.proxy.send(&format!("{h}:{p}"), frame);
                s.counters.bump(MessageKind::ProxyNotif);
            }
        }
        result
    }

    fn put_inner(
        &self,
        keys: &[String],
        chunks: &[MemObj],
        spec: &TransferSpec,
    ) -> Result<PutOutcome, BackendError> {
        let s = &self.shared;
        if s.stop.load(Ordering::Acquire) {
            return Err(BackendError::Closed);
        }
        let layout = check_put(s, keys, chunks)?;
        let rank = s.rank;
        let alloc_port = spec.receiver_alloc_port.for_rank(rank).ok_or_else(|| {
            BackendError::InvalidInput(format!(
                "receiver_alloc_port has no entry for TP rank {rank}"
            ))
        })?;
        let init_port = spec.receiver_init_port.for_rank(rank).ok_or_else(|| {
            BackendError::InvalidInput(format!(
                "receiver_init_port has no entry for TP rank {rank}"
            ))
        })?;
        let peer_key = format!("{}:{alloc_port}", spec.receiver_host);
        if !lock(&s.breaker).allows(&peer_key, Instant::now()) {
            s.counters.bump(MessageKind::BreakerSkip);
            return Ok(PutOutcome::SkippedBreakerOpen);
        }
        let link = {
            let mut links = lock(&s.links);
            Arc::clone(links.entry(peer_key.clone()).or_insert_with(|| {
                Arc::new(Mutex::new(Link {
                    peer: None,
                    init_url: format!("tcp://{}:{init_port}", spec.receiver_host),
                    landed: ReqClient::new(
                        &s.ctx,
                        &format!("tcp://{}:{init_port}", spec.receiver_host),
                        s.timeouts.request,
                    ),
                    req: ReqClient::new(&s.ctx, &format!("tcp://{peer_key}"), s.timeouts.request),
                }))
            }))
        };
        // One request at a time per receiver; other receivers proceed in parallel.
        let mut link = lock(&link);
        let (peer, lease) = match link.peer {
            Some(p) => p,
            None => {
                let hello = Hello::local(
                    &s.node,
                    Role::Sender,
                    s.mode,
                    s.config.pull_pending_ttl,
                    s.channel.as_ref(),
                );
                let a = handshake::connect(
                    &s.ctx,
                    &link.init_url,
                    s.channel.as_ref(),
                    &hello,
                    s.timeouts.handshake,
                )?;
                log::debug!("attached receiver {} as {}", a.remote.node, a.peer);
                link.peer = Some((a.peer, a.lease));
                (a.peer, a.lease)
            }
        };
        let last_chunk_toks = chunks.last().map_or(0, MemObj::tokens) as u64;
        let shape: Vec<u64> = layout.full_shape().iter().map(|&d| d as u64).collect();
        match s.mode {
            TransferMode::Push => {
                let req = AllocRequest {
                    keys: keys.to_vec(),
                    fmt: layout.fmt.code(),
                    shape,
                    dtype: layout.dtype.name().to_string(),
                    last_chunk_toks,
                };
                s.counters.bump(MessageKind::AllocRequest);
                let reply = link
                    .req
                    .request(&Message::AllocRequest(req).encode(), "AllocRequest")
                    .map_err(|f| self.req_failed(&mut link, f))?;
                let resp = AscendAllocResponse::decode(&reply).map_err(|e| {
                    s.counters.bump(MessageKind::Malformed);
                    BackendError::BadReply {
                        peer: peer_key.clone(),
                        detail: e.to_string(),
                    }
                })?;
                s.counters.bump(MessageKind::AllocResponse);
                if resp.alloc_failed {
                    self.open_breaker(&peer_key);
                    return Ok(PutOutcome::ReceiverAllocFailed);
                }
                let ops = push_ops(&peer_key, chunks, &resp)?;
                let written = ops.len();
                let bytes: u64 = ops.iter().map(|o| o.len as u64).sum();
                let refs: Vec<BufferRef> = ops.iter().map(|o| o.remote).collect();
                if let Err(e) = s.channel.write(peer, ops) {
                    s.counters.bump(MessageKind::TransferError);
                    // The receiver reclaims the unwritten pages after its landing timeout.
                    link.peer = None;
                    return Err(e.into());
                }
                s.counters.add_bytes(bytes);
                link.landed
                    .request(&landed::encode(&s.node, &refs), "landed notice")
                    .map_err(|f| self.req_failed(&mut link, f))?;
                Ok(PutOutcome::Pushed {
                    written,
                    already_present: chunks.len() - written,
                })
            }
            TransferMode::PullEager | TransferMode::PullDelay => {
                self.wait_backpressure(chunks.len())?;
                let pull_id = Uuid::new_v4().simple().to_string();
                let notif = PullReadyNotif {
                    pull_id: pull_id.clone(),
                    keys: keys.to_vec(),
                    sender_buffer_uuids: chunks
                        .iter()
                        .map(|c| c.buffer_ref().uuid.simple().to_string())
                        .collect(),
                    sender_mem_indexes: chunks.iter().map(|c| u64::from(c.page())).collect(),
                    sender_id: s.node.clone(),
                    sender_done_url: s.done_url.clone(),
                    fmt: layout.fmt.code(),
                    shape,
                    dtype: layout.dtype.name().to_string(),
                    last_chunk_toks,
                };
                let now = Instant::now();
                match lock(&s.pending).insert(
                    &pull_id,
                    &peer_key,
                    &spec.req_id,
                    chunks.to_vec(),
                    now,
                    lease,
                ) {
                    Ok(InsertOutcome::Pending) => {}
                    Ok(InsertOutcome::AlreadyDone(_)) => {
                        return Err(BackendError::InvalidInput(format!(
                            "pull id {pull_id} was already reported done"
                        )))
                    }
                    Err(e) => return Err(BackendError::InvalidInput(e.to_string())),
                }
                s.counters.bump(MessageKind::PullReadyNotif);
                let reply = match link
                    .req
                    .request(&Message::PullReadyNotif(notif).encode(), "PullReadyNotif")
                {
                    Ok(r) => r,
                    Err(f) => {
                        let delivery = match f {
                            ReqFailure::NotSent(_) => Delivery::NotSent,
                            ReqFailure::NoReply(_) => Delivery::Unknown,
                        };
                        {
                            let mut pending = lock(&s.pending);
                            let _released =
                                pending.on_req_failed(&pull_id, delivery, Instant::now());
                        }
                        s.released.notify_all();
                        return Err(self.req_failed(&mut link, f));
                    }
                };
                let ack = match PullReadyDoneAck::decode(&reply) {
                    Ok(a) => a,
                    Err(e) => {
                        s.counters.bump(MessageKind::Malformed);
                        // The receiver may still read: hold the pins until the lease.
                        {
                            let mut pending = lock(&s.pending);
                            let _held =
                                pending.on_req_failed(&pull_id, Delivery::Unknown, Instant::now());
                        }
                        return Err(BackendError::BadReply {
                            peer: peer_key,
                            detail: e.to_string(),
                        });
                    }
                };
                s.counters.bump(MessageKind::PullReadyDoneAck);
                let opens_breaker = {
                    let mut pending = lock(&s.pending);
                    let outcome = pending.on_ack(&pull_id, &ack, Instant::now());
                    outcome.opens_breaker()
                };
                s.released.notify_all();
                if opens_breaker {
                    self.open_breaker(&peer_key);
                    return Ok(PutOutcome::ReceiverAllocFailed);
                }
                let already_present = ack.already_sent_indexes.len();
                Ok(PutOutcome::Announced {
                    announced: chunks.len().saturating_sub(already_present),
                    pull_id,
                    already_present,
                })
            }
        }
    }

    fn req_failed(&self, link: &mut Link, f: ReqFailure) -> BackendError {
        let s = &self.shared;
        s.counters.bump(MessageKind::Timeout);
        // The receiver may have restarted: handshake again next time.
        link.peer = None;
        let e = f.into_error();
        log::warn!("{e}");
        e
    }

    fn open_breaker(&self, peer_key: &str) {
        let s = &self.shared;
        lock(&s.breaker).open(peer_key, Instant::now(), s.config.alloc_fail_backoff_ttl);
        log::warn!(
            "receiver {peer_key} could not allocate; skipping it for {:?}",
            s.config.alloc_fail_backoff_ttl
        );
    }

    fn wait_backpressure(&self, pages: usize) -> Result<(), BackendError> {
        let s = &self.shared;
        let deadline = Instant::now() + s.timeouts.backpressure;
        let mut pending = lock(&s.pending);
        loop {
            match s.backpressure.check(pending.pinned_pages(), pages) {
                Admission::Admit => return Ok(()),
                Admission::TooLarge => {
                    return Err(BackendError::Backpressure(format!(
                        "a batch of {pages} pages can never fit under the high-water mark of {} pinned pages (pool {} pages, reserve {}%); split the put or raise pd_buffer_size",
                        s.backpressure.high_water(),
                        s.backpressure.total_pages(),
                        s.config.backpressure_reserve_pct
                    )))
                }
                Admission::Wait => {
                    let now = Instant::now();
                    if now >= deadline || s.stop.load(Ordering::Acquire) {
                        return Err(BackendError::Backpressure(format!(
                            "{} pages still pinned after {:?} (high-water {}); receivers are not sending PullDoneSignal",
                            pending.pinned_pages(),
                            s.timeouts.backpressure,
                            s.backpressure.high_water()
                        )));
                    }
                    pending = s
                        .released
                        .wait_timeout(pending, (deadline - now).min(Duration::from_millis(100)))
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                }
            }
        }
    }

    /// The breaker state towards the receiver at `host:alloc_port`.
    pub fn breaker_state(&self, peer_key: &str) -> BreakerState {
        lock(&self.shared.breaker).state(peer_key, Instant::now())
    }

    /// Counters.
    pub fn stats(&self) -> SenderStats {
        let s = &self.shared;
        SenderStats {
            pools: s.alloc.stats(),
            pulls: lock(&s.pending).counters(),
            breaker: lock(&s.breaker).counters(),
            messages: s.counters.snapshot(),
            bytes_written: s.counters.bytes(),
        }
    }

    /// Waits until no pull is pending (every Done arrived or the TTL released
    /// it), up to `timeout`. Returns whether none is left.
    pub fn drain(&self, timeout: Duration) -> bool {
        let s = &self.shared;
        let deadline = Instant::now() + timeout;
        let mut pending = lock(&s.pending);
        while !pending.is_empty() {
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            pending = s
                .released
                .wait_timeout(pending, (deadline - now).min(Duration::from_millis(50)))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        true
    }

    /// Drains pending pulls for up to `timeout`, then stops every thread.
    pub fn close(mut self, timeout: Duration) {
        self.drain(timeout);
        self.stop_threads();
    }

    fn stop_threads(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        self.shared.released.notify_all();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Drop for Sender {
    fn drop(&mut self) {
        self.stop_threads();
    }
}

/// Checks a put's inputs: one chunk per key, pages of our pools, one layout,
/// only the last chunk partial.
fn check_put(s: &Shared, keys: &[String], chunks: &[MemObj]) -> Result<ChunkLayout, BackendError> {
    let bad = |m: String| Err(BackendError::InvalidInput(m));
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
    let layout = chunks[0].meta().layout;
    if layout != s.config.chunk_layout() {
        return bad(format!(
            "chunk layout {layout:?} differs from the configured {:?}",
            s.config.chunk_layout()
        ));
    }
    for (i, c) in chunks.iter().enumerate() {
        if !s.local_uuids.contains(&c.buffer_ref().uuid) {
            return bad(format!(
                "chunk {i} is not a page of this sender's pools (allocate with Sender::allocate)"
            ));
        }
        if c.meta().layout != layout {
            return bad(format!("chunk {i} has a different layout"));
        }
        if i + 1 < chunks.len() && c.tokens() != layout.tokens {
            return bad(format!(
                "chunk {i} is partial ({} tokens) but only the last chunk may be",
                c.tokens()
            ));
        }
    }
    Ok(layout)
}

/// Pairs the chunks the receiver wants with the pages it allocated.
fn push_ops(
    peer: &str,
    chunks: &[MemObj],
    resp: &AscendAllocResponse,
) -> Result<Vec<TransferOp>, BackendError> {
    let bad = |detail: String| BackendError::BadReply {
        peer: peer.to_string(),
        detail,
    };
    let present: HashSet<u64> = resp.already_sent_indexes.iter().copied().collect();
    if resp
        .already_sent_indexes
        .iter()
        .any(|&i| i >= chunks.len() as u64)
    {
        return Err(bad("already_sent_indexes out of range".into()));
    }
    let new: Vec<&MemObj> = chunks
        .iter()
        .enumerate()
        .filter(|(i, _)| !present.contains(&(*i as u64)))
        .map(|(_, c)| c)
        .collect();
    if resp.remote_indexes.len() != new.len() || resp.remote_buffer_uuids.len() != new.len() {
        return Err(bad(format!(
            "{} new chunks but {} remote indexes and {} uuids",
            new.len(),
            resp.remote_indexes.len(),
            resp.remote_buffer_uuids.len()
        )));
    }
    new.into_iter()
        .zip(resp.remote_indexes.iter().zip(&resp.remote_buffer_uuids))
        .map(|(c, (&page, uuid))| {
            let uuid = Uuid::parse_str(uuid).map_err(|e| bad(format!("uuid {uuid:?}: {e}")))?;
            let page = u32::try_from(page).map_err(|_| bad(format!("page {page} too large")))?;
            Ok(TransferOp::chunk(c.clone(), BufferRef { uuid, page }))
        })
        .collect()
}

fn done_loop(s: &Shared, sock: zmq::Socket) {
    while !s.stop.load(Ordering::Acquire) {
        let frame = match sock.recv_bytes(0) {
            Ok(f) => f,
            Err(zmq::Error::EAGAIN) | Err(zmq::Error::EINTR) => continue,
            Err(e) => {
                log::warn!("PullDoneSignal socket failed: {e}");
                break;
            }
        };
        match Message::decode(&frame) {
            Ok(Message::PullDoneSignal(d)) => {
                s.counters.bump(MessageKind::PullDoneSignal);
                {
                    // Released pages go back to the pool while the pending
                    // lock is held, so whoever sees the pull gone (drain,
                    // backpressure) also sees its pages free.
                    let mut pending = lock(&s.pending);
                    let outcome = pending.on_done(&d.pull_id, Instant::now());
                    if let DoneOutcome::Early = outcome {
                        log::debug!("PullDoneSignal for unknown pull {}", d.pull_id);
                    }
                }
                s.released.notify_all();
            }
            Ok(other) => {
                if s.counters.bump(MessageKind::Malformed) == 0 {
                    log::warn!(
                        "unexpected {} on the PullDoneSignal socket (ignored; logged once)",
                        other.message_type()
                    );
                }
            }
            Err(e) => {
                if s.counters.bump(MessageKind::Malformed) == 0 {
                    log::warn!(
                        "malformed frame on the PullDoneSignal socket: {e} (ignored; logged once)"
                    );
                }
            }
        }
    }
}

fn sweep_loop(s: &Shared) {
    while !s.stop.load(Ordering::Acquire) {
        std::thread::sleep(s.timeouts.sweep_every);
        let now = Instant::now();
        let expired = lock(&s.pending).sweep(now, s.config.pull_pending_ttl);
        if !expired.is_empty() {
            for e in &expired {
                log::warn!(
                    "pull {} to {} expired after the TTL: {} pinned pages released",
                    e.pull_id,
                    e.peer,
                    e.pages
                );
            }
            s.released.notify_all();
        }
        lock(&s.breaker).prune(now);
    }
}
