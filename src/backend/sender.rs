//! The prefill side: `put` chunks to a receiver in the configured mode.
//!
//! The sequence of a put (breaker, handshake on demand, admission, grant,
//! pin, notification, write, notice) is decided by the sans-IO
//! [`SenderCore`]; this shell performs each [`PutAction`] — a handshake,
//! a request on the receiver's socket, a channel write or grant, a wait —
//! and reports back, plus the PullDoneSignal listener and the TTL sweeper.

use super::counters::{MessageCounters, MessageKind};
use super::zmq_io::{PushPool, ReqClient, ReqFailure};
use super::{check_config, lock, spawn, wait_until, BackendError, NodeId, Opened};
use crate::auth::{envelope_header, FrameKind, OpenError, Session};
use crate::channel::handshake::{self, Hello, TpInfo};
use crate::channel::{Access, GrantStats, GrantTag, TransferChannel};
use crate::config::{PdConfig, PortList, Role, TransferMode};
use crate::kv::tp::Route;
use crate::layout::ChunkLayout;
use crate::memory::{ChunkMeta, DualAllocator, DualStats, MemObj, SealedMemObj};
use crate::protocol::{
    Attached, BreakerCounters, BreakerState, CancelNotif, ChunkDesc, ClockMap, Delivery,
    DoneOutcome, Message, PullCounters, PutAction, PutFailure, PutOutcome, PutRejected, PutSpec,
    RequestKind, SenderConfig, SenderCore, WriteEnd,
};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Hands a layer-wise push its layers ([`Sender::put_layers`]).
pub trait LayerSource {
    /// Waits until the engine wrote layer `layer` of the put's chunks and
    /// returns the writes of that layer's ranges: for each `(chunk index,
    /// receiver page)` of `targets`, the chunk's page with that layer's K
    /// and V rows filled, written to the same ranges of the receiver's page
    /// ([`ChunkMeta::layer_ranges`]). `Err(why)` when the layer never comes
    /// (the save was closed early, cancelled, or timed out): the put then
    /// ends, and the receiver drops what it allocated.
    fn layer(
        &mut self,
        layer: usize,
        targets: &[(usize, crate::memory::BufferRef)],
    ) -> Result<Vec<crate::channel::WriteOp>, String>;

    /// Called while layer `layer - 1` is being written: a source may get
    /// layer `layer` ready now (wait for it, gather it) so that it is not
    /// on the path after that write; [`LayerSource::layer`] then returns
    /// it. `layer` may be one past the last. The default does nothing.
    fn prefetch(&mut self, layer: usize, targets: &[(usize, crate::memory::BufferRef)]) {
        let _ = (layer, targets);
    }

    /// Layer `layer` written straight from the engine's memory into the
    /// receiver's pages, with no staging page: `None` (the default) when
    /// this source stages, and [`LayerSource::layer`] is asked instead.
    /// Errors as for `layer`.
    fn direct_layer(
        &mut self,
        layer: usize,
        targets: &[(usize, crate::memory::BufferRef)],
    ) -> Option<Result<DirectLayer, String>> {
        let _ = (layer, targets);
        None
    }
}

/// One layer's direct writes ([`LayerSource::direct_layer`]): ranges of
/// host memory sent straight into the receiver's pages.
pub struct DirectLayer {
    ops: Vec<crate::channel::DirectWrite>,
}

impl DirectLayer {
    /// The writes of one layer.
    ///
    /// # Safety
    /// Each op's `[src, src + len)` must be host memory that stays
    /// readable, and that nothing writes, until the put that asked for the
    /// layer returned (the write reads it until then).
    pub unsafe fn new(ops: Vec<crate::channel::DirectWrite>) -> DirectLayer {
        DirectLayer { ops }
    }
}

/// What a put sends: sealed chunks, or layers from a [`LayerSource`].
enum Payload<'a> {
    Whole(&'a [SealedMemObj]),
    Layers(&'a mut dyn LayerSource),
}

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
    /// The decode TP rank to send to. `None`: the rank this prefill rank
    /// feeds — its own rank when both sides have the same TP size, the one
    /// decode rank whose heads it holds when the prefill TP is larger.
    /// Required when the decode TP is larger (then each decode rank gets
    /// its own head slice: see [`Sender::routes`]).
    pub receiver_rank: Option<usize>,
}

/// Counters of a sender.
#[derive(Clone, Debug)]
pub struct SenderStats {
    /// Pool counters (pinned and quarantined pages included).
    pub pools: DualStats,
    /// Pull bookkeeping.
    pub pulls: PullCounters,
    /// Breaker counters.
    pub breaker: BreakerCounters,
    /// Messages and errors by kind.
    pub messages: Vec<(MessageKind, u64)>,
    /// Bytes written (push) by this sender.
    pub bytes_written: u64,
    /// Read grants on the channel (pull modes).
    pub grants: GrantStats,
    /// Push notices receivers refused.
    pub notices_refused: u64,
    /// Receivers found restarted on a put (which then went to the new process).
    pub receiver_restarts: u64,
}

/// Side-channel timing of a sender (defaults suit loopback and LAN peers).
#[derive(Clone, Debug)]
pub struct SenderTimeouts {
    /// Handshake with a receiver (and its clock probe).
    pub handshake: Duration,
    /// One AllocRequest / PullReadyNotif / push notice round trip.
    pub request: Duration,
    /// How often the TTL sweep runs.
    pub sweep_every: Duration,
}

impl Default for SenderTimeouts {
    fn default() -> Self {
        SenderTimeouts {
            handshake: Duration::from_secs(10),
            request: Duration::from_secs(10),
            sweep_every: Duration::from_millis(200),
        }
    }
}

/// The sockets to one receiver; its lock serializes puts to that receiver.
struct PeerLink {
    init_url: String,
    req: ReqClient,
    /// The decode TP rank of the receiver behind this link, as its hello
    /// said (`None` before the first handshake, or from a peer that sends
    /// no TP split).
    rank: Option<usize>,
    /// With a deployment secret: the session of the current attachment,
    /// which seals our requests and opens their replies.
    session: Option<Arc<Session>>,
}

/// Sessions of earlier attachments to one receiver kept to open the
/// PullDoneSignals it sealed under them (queued before a re-attach).
const SESSIONS_PER_RECEIVER: usize = 4;

impl PeerLink {
    /// Sends `frame` (sealed, with a secret) on the request socket as
    /// `route` and returns the reply (opened). A reply that does not open
    /// is dropped and counted; the request then got no usable reply.
    fn request(
        &mut self,
        counters: &MessageCounters,
        peer_key: &str,
        route: &str,
        frame: &[u8],
        what: &str,
    ) -> Result<Vec<u8>, ReqFailure> {
        let Some(session) = self.session.clone() else {
            return self.req.request(route, frame, what);
        };
        let sealed = session.seal(FrameKind::Request, frame);
        let reply = self.req.request(route, &sealed, what)?;
        match session.open(FrameKind::Reply, &reply) {
            Ok(inner) => Ok(inner.to_vec()),
            Err(e) => {
                counters.bump(MessageKind::AuthDropped);
                log::debug!("dropped the reply to {what} from {peer_key}: {e}");
                // Whatever the real reply is, it must not be taken for
                // the next request's.
                self.req.reset();
                Err(ReqFailure::NoReply(BackendError::BadReply {
                    peer: peer_key.to_string(),
                    detail: format!("the reply to {what} failed authentication: {e}"),
                }))
            }
        }
    }
}

fn wrong_rank(peer_key: &str, got: usize, want: usize) -> BackendError {
    BackendError::InvalidInput(format!(
        "the receiver at {peer_key} is decode TP rank {got}, but this transfer is for decode \
         rank {want}: give the transfer one receiver port per decode rank (a list for \
         pd_peer_init_port and pd_peer_alloc_port; through the C ABI, \
         apd_sender_submit_save_ranks with one ApdPeer per rank; in Python, lists for \
         init_port and alloc_port)"
    ))
}

struct Shared {
    config: PdConfig,
    node: NodeId,
    done_port: Option<u16>,
    ctx: zmq::Context,
    alloc: DualAllocator,
    channel: Arc<dyn TransferChannel>,
    core: Mutex<SenderCore>,
    /// Notified whenever pins are released (waits for backpressure, drain).
    released: Condvar,
    links: Mutex<HashMap<String, Arc<Mutex<PeerLink>>>>,
    /// With a deployment secret: the sessions of our attachments and the
    /// receiver (`peer_key`) of each, newest last, a few per receiver.
    sessions: Mutex<Vec<(String, Arc<Session>)>>,
    proxy: PushPool,
    counters: Arc<MessageCounters>,
    stop: AtomicBool,
    timeouts: SenderTimeouts,
    /// This rank's TP split (sent in the hello).
    tp: Option<TpInfo>,
    /// The decode ranks this rank feeds, and the heads of each piece.
    routes: Vec<Route>,
    /// What one full chunk of a put looks like (a head piece under a larger decode TP).
    piece_layout: ChunkLayout,
    head_elements: usize,
}

impl Shared {
    /// Releases the grants of pulls the core released, revokes those of
    /// pulls that expired, frees what is quiescent, and wakes waiters.
    fn apply_releases(&self, core: &mut SenderCore) {
        // A grant still serving a read keeps its pages (quarantined)
        // until it is quiescent, below.
        let grants = core.release_grants(|g| self.channel.release(g));
        for g in core.take_grant_revokes() {
            self.channel.revoke(g);
        }
        let mut freed = !grants.is_empty();
        for g in core.awaiting_quiescence() {
            if self.channel.is_quiescent(g) {
                core.on_quiescent(g);
                freed = true;
            }
        }
        if freed {
            self.released.notify_all();
        }
    }
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
        let done_port = if mode.is_pull() {
            Some(config.done_port(rank).ok_or_else(|| {
                BackendError::Setup(format!(
                    "pd_pull_done_port: no port for TP rank {rank} (give one per rank)"
                ))
            })?)
        } else {
            None
        };
        let node = NodeId::sender(&host, done_port, rank);
        let Opened {
            alloc,
            pools,
            channel,
            ctx,
            counters,
            pushes: proxy,
        } = Opened::open(config, &host, &node, "pd-proxy-push")?;
        let total = alloc.primary().stats().total;
        let plan = config
            .tp_plan()
            .map_err(|e| BackendError::Setup(format!("pd_peer_tp_size: {e}")))?;
        let routes = plan.targets(rank);
        // Every piece this rank sends has the same width: its whole chunk,
        // or (decode TP larger) one decode rank's heads.
        let piece_layout = match routes.first() {
            // Mixed TP sizes (validated: hidden = heads x head size).
            Some(r) if config.tp_size != config.peer_tp() => ChunkLayout {
                hidden: r.heads.len() * config.head_elements(),
                ..config.chunk_layout()
            },
            _ => config.chunk_layout(),
        };
        let core = SenderCore::new(SenderConfig {
            node: node.as_str().to_string(),
            done_url: format!("{host}:{}", done_port.unwrap_or(0)),
            mode,
            layout: piece_layout,
            pools: pools.iter().map(|p| p.uuid()).collect(),
            pull_pending_ttl: config.pull_pending_ttl,
            alloc_fail_backoff_ttl: config.alloc_fail_backoff_ttl,
            backpressure: crate::protocol::Backpressure::new(
                total,
                config.backpressure_reserve_pct,
            ),
            reserve_pct: config.backpressure_reserve_pct,
        });
        let shared = Arc::new(Shared {
            config: config.clone(),
            node,
            done_port,
            ctx,
            alloc,
            channel,
            core: Mutex::new(core),
            released: Condvar::new(),
            links: Mutex::new(HashMap::new()),
            sessions: Mutex::new(Vec::new()),
            proxy,
            counters,
            stop: AtomicBool::new(false),
            timeouts,
            tp: TpInfo::of(config, rank),
            routes,
            piece_layout,
            head_elements: config.head_elements(),
        });
        let mut threads = Vec::new();
        if let Some(port) = done_port {
            let sock = shared
                .ctx
                .socket(zmq::PULL)
                .map_err(BackendError::zmq("creating the PullDoneSignal socket"))?;
            sock.set_rcvtimeo(100).ok();
            sock.set_linger(0).ok();
            sock.set_maxmsgsize(config.max_message_bytes())
                .map_err(BackendError::zmq(
                    "capping the PullDoneSignal socket's frame size",
                ))?;
            let url = crate::backend::bind_url(config, &host, port);
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
        self.shared.config.mode()
    }

    /// This sender's node id (unique per process and TP rank).
    pub fn node(&self) -> &str {
        self.shared.node.as_str()
    }

    /// The TP rank this sender serves.
    pub fn rank(&self) -> usize {
        self.shared.node.rank()
    }

    /// The port of the PullDoneSignal socket (pull modes).
    pub fn done_port(&self) -> Option<u16> {
        self.shared.done_port
    }

    /// The configuration the sender started with.
    pub fn config(&self) -> &PdConfig {
        &self.shared.config
    }

    /// The layout of one full chunk as `put` sends it: this rank's whole
    /// chunk, or — when the decode TP is larger than the prefill TP — one
    /// decode rank's head slice of it (see [`Sender::routes`]).
    pub fn chunk_layout(&self) -> ChunkLayout {
        self.shared.piece_layout
    }

    /// The decode ranks this prefill rank sends to and the heads each
    /// gets, from `tp_size` and `pd_peer_tp_size`: its own rank with all
    /// its heads when both TP sizes match. A chunk for route `r` holds the
    /// elements `[r.heads.start * e, r.heads.end * e)` of the model's token
    /// minus this rank's first head (`e` = [`Sender::head_elements`]);
    /// [`Sender::piece_offset`] gives that start in this rank's token.
    pub fn routes(&self) -> &[Route] {
        &self.shared.routes
    }

    /// The puts that send the chunks `keys` of a request: per decode rank
    /// this rank feeds, the route and the keys to put under. With the same
    /// TP size on both sides that is `keys` to this rank's own decode rank;
    /// under heterogeneous TP each route's keys name its head piece
    /// ([`crate::kv::tp::piece_key`]), as a decode rank's
    /// [`crate::Receiver::piece_keys`] expects. Empty for a rank whose
    /// replicated MLA latent another rank sends.
    pub fn pieces(&self, keys: &[String]) -> Vec<(Route, Vec<String>)> {
        let s = &self.shared;
        let hetero = s.config.tp_size != s.config.peer_tp();
        s.routes
            .iter()
            .map(|r| {
                let keys = match hetero {
                    true => keys
                        .iter()
                        .map(|k| crate::kv::tp::piece_key(k, r.heads))
                        .collect(),
                    false => keys.to_vec(),
                };
                (*r, keys)
            })
            .collect()
    }

    /// Elements of one KV head in a token (the whole latent for MLA).
    pub fn head_elements(&self) -> usize {
        self.shared.head_elements
    }

    /// Where route `route`'s piece starts in a token of this rank's chunk
    /// (elements), to gather it from the rank's KV cache.
    pub fn piece_offset(&self, route: &Route) -> usize {
        let s = &self.shared;
        let first = s
            .config
            .tp_plan()
            .map_or(0, |p| p.prefill_heads(s.node.rank()).start);
        match s.tp.is_some_and(|t| t.replicated) {
            true => 0,
            false => (route.heads.start - first) * s.head_elements,
        }
    }

    /// The decode rank a put of `spec` goes to (see [`TransferSpec::receiver_rank`]).
    fn receiver_rank(&self, spec: &TransferSpec) -> Result<usize, BackendError> {
        let s = &self.shared;
        let rank = self.shared_rank();
        let ranks: Vec<usize> = s.routes.iter().map(|r| r.rank).collect();
        match (spec.receiver_rank, ranks.as_slice()) {
            (Some(d), _) if ranks.contains(&d) => Ok(d),
            (Some(d), _) => Err(BackendError::InvalidInput(format!(
                "decode rank {d} is not fed by prefill rank {rank} (tp_size {}, pd_peer_tp_size \
                 {}): it sends to rank(s) {ranks:?}",
                s.config.tp_size,
                s.config.peer_tp()
            ))),
            (None, [d]) => Ok(*d),
            (None, []) => Err(BackendError::InvalidInput(format!(
                "prefill rank {rank} sends nothing: its MLA latent is the same as another \
                 rank's, which sends it (tp_size {} > pd_peer_tp_size {}); skip the put here",
                s.config.tp_size,
                s.config.peer_tp()
            ))),
            (None, _) => Err(BackendError::InvalidInput(format!(
                "prefill rank {rank} feeds decode ranks {ranks:?} (pd_peer_tp_size {} > tp_size \
                 {}): set TransferSpec::receiver_rank and put each its head slice \
                 (Sender::routes)",
                s.config.peer_tp(),
                s.config.tp_size
            ))),
        }
    }

    /// The allocator (pages to fill before `put` come from its placement pool).
    pub fn allocator(&self) -> &DualAllocator {
        &self.shared.alloc
    }

    /// Pages for chunks of `tokens` tokens each (only the last may be
    /// partial), to fill and [seal](MemObj::seal) before `put` — for this
    /// rank's one route (see [`Sender::allocate_for`] when it feeds several
    /// decode ranks).
    pub fn allocate(&self, tokens: &[usize]) -> Result<Vec<MemObj>, BackendError> {
        match self.shared.routes.as_slice() {
            [] => self.allocate_for(None, tokens),
            [one] => self.allocate_for(Some(one), tokens),
            many => Err(BackendError::InvalidInput(format!(
                "this prefill rank feeds {} decode ranks, each with its own head slice: allocate \
                 each one's pages with Sender::allocate_for(route)",
                many.len()
            ))),
        }
    }

    /// Pages for the head piece `route` carries (from [`Sender::routes`]):
    /// tagged with where that piece starts in this rank's token, so a
    /// [`crate::kv::KvCache::gather`] into them takes exactly those heads,
    /// and `put` to `route.rank` accepts only them.
    pub fn allocate_for(
        &self,
        route: Option<&Route>,
        tokens: &[usize],
    ) -> Result<Vec<MemObj>, BackendError> {
        let layout = self.chunk_layout();
        let offset = route.map_or(0, |r| self.piece_offset(r));
        let metas: Vec<ChunkMeta> = tokens
            .iter()
            .map(|&t| ChunkMeta::partial(layout, t).at_hidden_offset(offset))
            .collect();
        Ok(self.shared.alloc.allocate_batch(&metas)?)
    }

    /// Sends `chunks` (one per key, sealed pages of this sender's pools) to
    /// the receiver of `spec` in the configured mode. Returns once the data
    /// is written and accepted as landed (push) or announced and
    /// acknowledged (pull); in pull modes the pages stay pinned (and
    /// readable by that receiver only) until its PullDoneSignal.
    pub fn put(
        &self,
        keys: &[String],
        chunks: &[SealedMemObj],
        spec: &TransferSpec,
    ) -> Result<PutOutcome, BackendError> {
        let descs: Vec<ChunkDesc> = chunks.iter().map(|c| ChunkDesc::of(c)).collect();
        self.run_put(keys, &descs, spec, Payload::Whole(chunks))
    }

    /// A layer-wise push (push mode) of the chunks `descs` describes, one
    /// per key: the receiver allocates for all of them first, then each
    /// layer is written as soon as `source` hands it over (it blocks until
    /// the engine wrote that layer), and the receiver takes the chunks as
    /// landed only after the last layer. If `source` says a layer never
    /// comes, the receiver is told to drop the allocation and the put fails
    /// ([`BackendError::LayerMissing`]).
    pub fn put_layers(
        &self,
        keys: &[String],
        descs: &[ChunkDesc],
        spec: &TransferSpec,
        source: &mut dyn LayerSource,
    ) -> Result<PutOutcome, BackendError> {
        self.run_put(keys, descs, spec, Payload::Layers(source))
    }

    fn run_put(
        &self,
        keys: &[String],
        descs: &[ChunkDesc],
        spec: &TransferSpec,
        mut payload: Payload<'_>,
    ) -> Result<PutOutcome, BackendError> {
        let s = &self.shared;
        let max_keys = s.config.max_keys_per_message();
        if keys.len() as u64 > max_keys {
            return Err(BackendError::InvalidInput(format!(
                "a put of {} keys exceeds pd_max_keys_per_message ({max_keys}): the receiver \
                 would drop the message; split the put, or raise pd_max_keys_per_message on \
                 both sides",
                keys.len()
            )));
        }
        let rank = self.receiver_rank(spec)?;
        // A chunk must hold the heads of the decode rank it goes to: its
        // pages say where in this rank's token they were taken from.
        if let Some(route) = s.routes.iter().find(|r| r.rank == rank) {
            let want = self.piece_offset(route);
            if let Some((i, c)) = descs
                .iter()
                .enumerate()
                .find(|(_, c)| c.meta.hidden_offset != want)
            {
                return Err(BackendError::InvalidInput(format!(
                    "chunk {i} holds the heads starting at element {} of this rank's token, but \
                     decode rank {rank} takes {} (starting at element {want}): allocate its \
                     pages with Sender::allocate_for(route) and gather into them",
                    c.meta.hidden_offset, route.heads
                )));
            }
        }
        let (init, alloc) = match (
            spec.receiver_init_port.for_rank(rank),
            spec.receiver_alloc_port.for_rank(rank),
        ) {
            (Some(i), Some(a)) => (i, a),
            _ => {
                return Err(BackendError::InvalidInput(format!(
                    "the transfer spec has no receiver port for TP rank {rank}"
                )))
            }
        };
        let host = &spec.receiver_host;
        let peer_key = format!("{host}:{alloc}");
        let link_arc = self.link(
            &peer_key,
            &format!("tcp://{host}:{init}"),
            &format!("tcp://{host}:{alloc}"),
        );
        // Held for the whole of a put (the receiver keeps one pending
        // allocation per route), except while a layer-wise put writes or
        // waits for the engine's layers — a whole forward pass: its
        // allocation got a route of its own (SenderCore::first_layer), and
        // other puts to this receiver go on meanwhile.
        let mut held = Some(lock(&link_arc));
        macro_rules! link {
            () => {
                held.get_or_insert_with(|| lock(&link_arc))
            };
        }
        self.check_rank(link!(), &peer_key, rank)?;
        let put_spec = PutSpec {
            peer_key: peer_key.clone(),
            req_id: spec.req_id.clone(),
            is_last_prefill: spec.is_last_prefill,
        };
        let (mut put, mut action) = match &payload {
            Payload::Whole(chunks) => {
                lock(&s.core).begin_put(Instant::now(), put_spec, keys.to_vec(), chunks.to_vec())
            }
            Payload::Layers(_) => {
                lock(&s.core).begin_layered_put(Instant::now(), put_spec, keys.to_vec(), descs)
            }
        };
        let mut last_io: Option<BackendError> = None;
        let end = loop {
            action = match action {
                PutAction::Finish(end) => break end,
                PutAction::Connect => {
                    let attached = match self.connect(link!(), &peer_key, rank) {
                        Ok(a) => Some(a),
                        Err(e) => {
                            log::warn!("handshake with {peer_key}: {e}");
                            last_io = Some(e);
                            None
                        }
                    };
                    lock(&s.core).on_connected(&mut put, Instant::now(), attached)
                }
                PutAction::ProbeIncarnation => {
                    let incarnation = self
                        .probe(&link!().init_url)
                        .map_err(|e| last_io = Some(e.into()))
                        .ok()
                        .and_then(|p| p.incarnation);
                    lock(&s.core).on_probed(&mut put, Instant::now(), incarnation)
                }
                PutAction::SyncClock => {
                    let clock = self
                        .probe(&link!().init_url)
                        .map(|p| ClockMap::measure(p.sent, p.received, p.clock_us))
                        .map_err(|e| last_io = Some(e.into()))
                        .ok();
                    lock(&s.core).on_clock(&mut put, Instant::now(), clock)
                }
                PutAction::WaitForPins { until } => {
                    let mut core = lock(&s.core);
                    let now = Instant::now();
                    if now < until && !s.stop.load(Ordering::Acquire) {
                        let wait = (until - now).min(Duration::from_millis(100));
                        core = s
                            .released
                            .wait_timeout(core, wait)
                            .unwrap_or_else(|p| p.into_inner())
                            .0;
                    }
                    core.on_pins_released(&mut put, Instant::now())
                }
                PutAction::Grant { peer, pages } => {
                    let grant = s
                        .channel
                        .grant(peer, Access::Read, GrantTag::UNTAGGED, &pages)
                        .map_err(|e| last_io = Some(e.into()))
                        .ok();
                    lock(&s.core).on_granted(&mut put, Instant::now(), grant)
                }
                PutAction::Request { route, frame, kind } => {
                    s.counters.bump(match kind {
                        RequestKind::AllocRequest => MessageKind::AllocRequest,
                        RequestKind::PullReadyNotif => MessageKind::PullReadyNotif,
                        RequestKind::PushNotice => MessageKind::PushNotice,
                    });
                    let link = link!();
                    // A layer-wise put decided on its notice without the
                    // link, and another put may have retired that route
                    // since: a notice names its allocation's route in its
                    // frame and may go on any socket of ours, so it takes
                    // the current one (a retired route is never reused).
                    let route = match kind {
                        RequestKind::PushNotice => lock(&s.core).route(&peer_key),
                        _ => route,
                    };
                    let reply =
                        match link.request(&s.counters, &peer_key, &route, &frame, kind.name()) {
                            Ok(r) => Ok(r),
                            Err(f) => {
                                s.counters.bump(MessageKind::Timeout);
                                let delivery = match f {
                                    ReqFailure::NotSent(_) => Delivery::NotSent,
                                    ReqFailure::NoReply(_) => Delivery::Unknown,
                                };
                                let e = f.into_error();
                                log::warn!("{e}");
                                last_io = Some(e);
                                Err(delivery)
                            }
                        };
                    let mut core = lock(&s.core);
                    let next = core.on_reply(&mut put, Instant::now(), reply);
                    s.apply_releases(&mut core);
                    next
                }
                PutAction::Write { peer, tag, ops } => {
                    let end = self.write(peer, tag, ops, &mut last_io);
                    lock(&s.core).on_written(&mut put, Instant::now(), end)
                }
                PutAction::WriteLayer {
                    peer,
                    tag,
                    layer,
                    targets,
                } => {
                    held = None;
                    let direct = match &mut payload {
                        Payload::Layers(source) => source.direct_layer(layer, &targets),
                        Payload::Whole(_) => None,
                    };
                    match direct {
                        Some(Ok(d)) => {
                            let end = self.write_direct(peer, tag, &d, &mut last_io);
                            lock(&s.core).on_written(&mut put, Instant::now(), end)
                        }
                        Some(Err(why)) => {
                            lock(&s.core).on_layer_missing(&mut put, Instant::now(), why)
                        }
                        None => {
                            let ops = match &mut payload {
                                Payload::Layers(source) => source.layer(layer, &targets),
                                Payload::Whole(_) => {
                                    Err("a whole put was asked for a layer".into())
                                }
                            };
                            match ops {
                                Ok(ops) => {
                                    let end = match &mut payload {
                                        Payload::Layers(source) => {
                                            self.write_then(peer, tag, ops, &mut last_io, || {
                                                source.prefetch(layer + 1, &targets)
                                            })
                                        }
                                        Payload::Whole(_) => {
                                            self.write(peer, tag, ops, &mut last_io)
                                        }
                                    };
                                    lock(&s.core).on_written(&mut put, Instant::now(), end)
                                }
                                Err(why) => {
                                    lock(&s.core).on_layer_missing(&mut put, Instant::now(), why)
                                }
                            }
                        }
                    }
                }
            };
        };
        s.apply_releases(&mut lock(&s.core));
        if let Some(n) = end.proxy_notif {
            if let (Some(h), Some(p)) = (&s.config.proxy_host, s.config.proxy_port) {
                s.proxy
                    .send(&format!("{h}:{p}"), Message::ProxyNotif(n).encode());
                s.counters.bump(MessageKind::ProxyNotif);
            }
        }
        match end.result {
            Ok(PutOutcome::SkippedBreakerOpen) => {
                s.counters.bump(MessageKind::BreakerSkip);
                Ok(PutOutcome::SkippedBreakerOpen)
            }
            Ok(o) => Ok(o),
            Err(PutFailure::Io) => Err(last_io.unwrap_or_else(|| {
                BackendError::Setup(format!("put to {peer_key} failed without an I/O error"))
            })),
            Err(PutFailure::Rejected(r)) => {
                if matches!(r, PutRejected::BadReply { .. }) {
                    s.counters.bump(MessageKind::Malformed);
                }
                Err(r.into())
            }
        }
    }

    /// Whether a put can write straight from host memory (push over a
    /// channel that sends from caller memory; `pd_push_direct_write`).
    pub fn writes_direct(&self) -> bool {
        let s = &self.shared;
        s.config.push_direct_write
            && s.config.mode() == TransferMode::Push
            && s.channel.writes_direct(crate::memory::DeviceKind::Cpu)
    }

    /// Runs one direct write to the end and says how it ended.
    fn write_direct(
        &self,
        peer: crate::channel::PeerId,
        tag: GrantTag,
        layer: &DirectLayer,
        last_io: &mut Option<BackendError>,
    ) -> WriteEnd {
        let s = &self.shared;
        let bytes: u64 = layer.ops.iter().map(|o| o.len as u64).sum();
        let deadline = Instant::now() + s.config.push_landing_timeout;
        // SAFETY: DirectLayer::new's contract: every source stays readable
        // and unwritten until this put returns, and write_direct returns
        // only once no byte of it is read any more.
        let r = unsafe { s.channel.write_direct(peer, tag, &layer.ops, deadline) };
        match r {
            Ok(()) => {
                s.counters.add_bytes(bytes);
                WriteEnd::Written
            }
            Err(e) => {
                *last_io = Some(e.into());
                s.counters.bump(MessageKind::TransferError);
                // Nothing of it runs after the call.
                WriteEnd::Failed
            }
        }
    }

    /// Runs one push write to the end and says how it ended (its bytes
    /// counted, its error kept in `last_io`).
    fn write(
        &self,
        peer: crate::channel::PeerId,
        tag: GrantTag,
        ops: Vec<crate::channel::WriteOp>,
        last_io: &mut Option<BackendError>,
    ) -> WriteEnd {
        self.write_then(peer, tag, ops, last_io, || {})
    }

    /// [`Sender::write`], running `meanwhile` once the write is submitted
    /// and before waiting for it (a layer-wise put gathers its next layer).
    fn write_then(
        &self,
        peer: crate::channel::PeerId,
        tag: GrantTag,
        ops: Vec<crate::channel::WriteOp>,
        last_io: &mut Option<BackendError>,
        meanwhile: impl FnOnce(),
    ) -> WriteEnd {
        let s = &self.shared;
        let bytes: u64 = ops.iter().map(|o| o.len as u64).sum();
        let end = match s.channel.submit_write(peer, tag, ops) {
            Err(e) => {
                // Refused before any byte moved.
                *last_io = Some(e.into());
                WriteEnd::Failed
            }
            Ok(c) => {
                meanwhile();
                let done = c.wait();
                match done.result {
                    Ok(()) => {
                        s.counters.add_bytes(bytes);
                        WriteEnd::Written
                    }
                    Err(e) => {
                        // The channel gives the pages back only
                        // once nothing of the write runs.
                        let over = !done.pages.is_empty();
                        *last_io = Some(e.into());
                        if over {
                            WriteEnd::Failed
                        } else {
                            WriteEnd::Abandoned
                        }
                    }
                }
            }
        };
        if !matches!(end, WriteEnd::Written) {
            s.counters.bump(MessageKind::TransferError);
        }
        end
    }

    /// Tells the receiver of `spec` that request `req_id` is cancelled
    /// (upstream LMCache's `CancelNotif`): it drops what it holds of `keys`
    /// — stored chunks go back to its pool, pull-delay proxies are
    /// discarded so their PullDoneSignal releases our pins, and keys still
    /// landing are dropped when they land. Returns the keys it dropped. A
    /// receiver this sender never attached holds nothing of ours: no
    /// message is sent and nothing is returned.
    pub fn cancel(
        &self,
        req_id: &str,
        keys: &[String],
        spec: &TransferSpec,
    ) -> Result<Vec<String>, BackendError> {
        let s = &self.shared;
        let rank = self.receiver_rank(spec)?;
        let (Some(init), Some(alloc)) = (
            spec.receiver_init_port.for_rank(rank),
            spec.receiver_alloc_port.for_rank(rank),
        ) else {
            return Err(BackendError::InvalidInput(format!(
                "the transfer spec has no receiver port for TP rank {rank}"
            )));
        };
        let host = &spec.receiver_host;
        let peer_key = format!("{host}:{alloc}");
        if lock(&s.core).attached(&peer_key).is_none() {
            return Ok(Vec::new());
        }
        let link = self.link(
            &peer_key,
            &format!("tcp://{host}:{init}"),
            &format!("tcp://{host}:{alloc}"),
        );
        let mut link = lock(&link);
        self.check_rank(&mut link, &peer_key, rank)?;
        let route = lock(&s.core).route(&peer_key);
        let frame = Message::CancelNotif(CancelNotif {
            req_id: req_id.to_string(),
            keys: keys.to_vec(),
        })
        .encode();
        s.counters.bump(MessageKind::CancelNotif);
        let reply = link
            .request(&s.counters, &peer_key, &route, &frame, "CancelNotif")
            .map_err(|f| {
                s.counters.bump(MessageKind::Timeout);
                f.into_error()
            })?;
        match Message::decode(&reply) {
            Ok(Message::CancelNotif(c)) => Ok(c.keys),
            Ok(other) => Err(BackendError::BadReply {
                peer: peer_key,
                detail: format!(
                    "it answered a CancelNotif with {}: it does not understand cancellation \
                     (an older ascend-pd or LMCache-Ascend peer), so what it holds stays until \
                     the decode side loads or removes it",
                    other.message_type()
                ),
            }),
            Err(e) => {
                s.counters.bump(MessageKind::Malformed);
                Err(BackendError::BadReply {
                    peer: peer_key,
                    detail: format!("a malformed answer to a CancelNotif: {e}"),
                })
            }
        }
    }

    fn shared_rank(&self) -> usize {
        self.shared.node.rank()
    }

    /// The link to the receiver at `peer_key`, made on first use.
    fn link(&self, peer_key: &str, init_url: &str, alloc_url: &str) -> Arc<Mutex<PeerLink>> {
        let s = &self.shared;
        Arc::clone(
            lock(&s.links)
                .entry(peer_key.to_string())
                .or_insert_with(|| {
                    Arc::new(Mutex::new(PeerLink {
                        init_url: init_url.to_string(),
                        req: ReqClient::new(&s.ctx, alloc_url, s.timeouts.request),
                        rank: None,
                        session: None,
                    }))
                }),
        )
    }

    /// Refuses to use `link` for a put or cancel meant for decode rank
    /// `want` when the receiver behind it said it is another rank: the
    /// chunks would land as the wrong rank's heads (or under keys nobody
    /// there loads). Unless that receiver has restarted since (another
    /// process answers the probe): then the put goes on, and its new
    /// handshake says which rank answers now.
    fn check_rank(
        &self,
        link: &mut PeerLink,
        peer_key: &str,
        want: usize,
    ) -> Result<(), BackendError> {
        let s = &self.shared;
        let Some(got) = link.rank.filter(|&got| got != want) else {
            return Ok(());
        };
        let attached = lock(&s.core).attached(peer_key).map(|a| a.incarnation);
        let answering = self.probe(&link.init_url).ok().and_then(|p| p.incarnation);
        match (attached, answering) {
            // Not attached: the put's handshake checks the rank first.
            (None, _) => Ok(()),
            (Some(old), Some(new)) if old != new => {
                link.rank = None;
                Ok(())
            }
            // The same process (or one we cannot ask, which may be it).
            _ => Err(wrong_rank(peer_key, got, want)),
        }
    }

    /// The handshake: attaches the receiver and measures its clock. A
    /// receiver that says it is not decode rank `rank` is detached again
    /// and refused.
    fn connect(
        &self,
        link: &mut PeerLink,
        peer_key: &str,
        rank: usize,
    ) -> Result<Attached, BackendError> {
        let s = &self.shared;
        let hello = self.hello();
        let a = handshake::connect(
            &s.ctx,
            &link.init_url,
            s.channel.as_ref(),
            &hello,
            s.timeouts.handshake,
        )?;
        // What this handshake says replaces what an earlier one said.
        link.rank = a.remote.tp.map(|t| t.rank);
        link.session = a.session.clone();
        if let Some(session) = &a.session {
            let mut sessions = lock(&s.sessions);
            sessions.push((peer_key.to_string(), Arc::clone(session)));
            let mine = sessions.iter().filter(|(p, _)| p == peer_key).count();
            if mine > SESSIONS_PER_RECEIVER {
                let oldest = sessions.iter().position(|(p, _)| p == peer_key);
                sessions.remove(oldest.expect("counted"));
            }
        }
        if let Some(got) = link.rank.filter(|&got| got != rank) {
            s.channel.detach(a.peer);
            return Err(wrong_rank(peer_key, got, rank));
        }
        let (sent, received) = a
            .exchange
            .expect("the connecting side records its exchange");
        Ok(Attached {
            incarnation: a.remote.incarnation,
            peer: a.peer,
            lease: a.lease,
            clock: ClockMap::measure(sent, received, a.remote.clock_us),
        })
    }

    /// This sender's half of a handshake.
    fn hello(&self) -> Hello {
        let s = &self.shared;
        Hello::local(
            s.node.as_str(),
            Role::Sender,
            s.config.mode(),
            s.config.pull_pending_ttl,
            s.channel.as_ref(),
        )
        .with_tp(s.tp)
        .with_model(s.config.model_identity.clone())
    }

    /// A diagnostic handshake with the receiver of `spec` (what `ascend-bench
    /// doctor` runs): the full hello exchange (release, model identity,
    /// mode, channel, TP split, and the deployment secret when one is set),
    /// then the attachment is dropped at once; nothing else is sent. The
    /// error names what differs and the fix. Returns the receiver's hello.
    pub fn check_receiver(&self, spec: &TransferSpec) -> Result<Hello, BackendError> {
        let s = &self.shared;
        let rank = self.receiver_rank(spec)?;
        let Some(init) = spec.receiver_init_port.for_rank(rank) else {
            return Err(BackendError::InvalidInput(format!(
                "the transfer spec has no receiver init port for TP rank {rank}"
            )));
        };
        let hello = self.hello();
        let a = handshake::connect(
            &s.ctx,
            &format!("tcp://{}:{init}", spec.receiver_host),
            s.channel.as_ref(),
            &hello,
            s.timeouts.handshake,
        )?;
        s.channel.detach(a.peer);
        Ok(a.remote)
    }

    /// Probes the receiver listening at `init_url` for its clock and
    /// incarnation; answers that fail authentication are dropped and counted.
    fn probe(&self, init_url: &str) -> Result<handshake::Probed, crate::channel::ChannelError> {
        let s = &self.shared;
        handshake::probe(
            &s.ctx,
            init_url,
            s.timeouts.handshake,
            s.channel.auth(),
            &mut || {
                s.counters.bump(MessageKind::AuthDropped);
            },
        )
    }

    /// The breaker state towards the receiver at `host:alloc_port`.
    pub fn breaker_state(&self, peer_key: &str) -> BreakerState {
        lock(&self.shared.core).breaker_state(peer_key, Instant::now())
    }

    /// Counters.
    pub fn stats(&self) -> SenderStats {
        let s = &self.shared;
        let c = lock(&s.core).counters();
        SenderStats {
            pools: s.alloc.stats(),
            pulls: c.pulls,
            breaker: c.breaker,
            messages: s.counters.snapshot(),
            bytes_written: s.counters.bytes(),
            grants: s.channel.grant_stats(),
            notices_refused: c.notices_refused,
            receiver_restarts: c.receiver_restarts,
        }
    }

    /// Waits until no pull is pending (every Done arrived, or the TTL or
    /// the receiver's end released it) and every page a pull pinned is
    /// back, up to `timeout`. Returns whether none is left.
    pub fn drain(&self, timeout: Duration) -> bool {
        let s = &self.shared;
        // A timeout past what the clock can hold (u64::MAX ms) waits as
        // long as it takes.
        let deadline = Instant::now().checked_add(timeout);
        let mut core = lock(&s.core);
        // A pull released without its Done keeps its pages until its
        // revoked grant is quiescent: wait for those too (the sweep settles them).
        while !core.is_drained() {
            match wait_until(&s.released, core, deadline, Some(Duration::from_millis(50))) {
                Some(c) => core = c,
                None => return false,
            }
        }
        true
    }

    /// The requests with a pull pending (pages pinned for a receiver that
    /// has not read them yet), each once.
    pub fn pending_requests(&self) -> Vec<String> {
        lock(&self.shared.core).pending_requests()
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
        // With a secret, only a signal sealed by the attachment it names
        // the pull of is acted on.
        let (frame, from) = match open_done(s, &frame) {
            Ok(opened) => opened,
            Err(why) => {
                s.counters.bump(MessageKind::AuthDropped);
                log::debug!("dropped a frame on the PullDoneSignal socket: {why}");
                continue;
            }
        };
        match Message::decode(&frame) {
            Ok(Message::PullDoneSignal(d)) => {
                // Released pages go back to the pool while the core lock is
                // held, so whoever sees the pull gone (drain, backpressure)
                // also sees its pages free.
                let mut core = lock(&s.core);
                let now = Instant::now();
                let outcome = match &from {
                    None => Some(core.on_done_signal(now, &d.pull_id)),
                    Some(peer_key) => core.on_done_signal_from(now, &d.pull_id, peer_key),
                };
                let Some(outcome) = outcome else {
                    drop(core);
                    s.counters.bump(MessageKind::AuthDropped);
                    log::debug!(
                        "dropped a PullDoneSignal for pull {} from {}, which it was not announced to",
                        d.pull_id,
                        from.as_deref().unwrap_or("?")
                    );
                    continue;
                };
                s.counters.bump(MessageKind::PullDoneSignal);
                if let DoneOutcome::Early = outcome {
                    log::debug!("PullDoneSignal for unknown pull {}", d.pull_id);
                }
                s.apply_releases(&mut core);
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

/// A frame of the PullDoneSignal socket as it may be acted on: as it came,
/// without a secret; with one, opened by the session it names, with the
/// receiver (`peer_key`) of that session.
fn open_done(s: &Shared, frame: &[u8]) -> Result<(Vec<u8>, Option<String>), OpenError> {
    if s.channel.auth().is_none() {
        return Ok((frame.to_vec(), None));
    }
    let (id, _) = envelope_header(frame).ok_or(OpenError::NotSealed)?;
    let found = lock(&s.sessions)
        .iter()
        .find(|(_, session)| *session.id() == id)
        .map(|(p, session)| (p.clone(), Arc::clone(session)));
    let (peer_key, session) = found.ok_or(OpenError::UnknownAttachment)?;
    let inner = session.open(FrameKind::Done, frame)?;
    Ok((inner.to_vec(), Some(peer_key)))
}

fn sweep_loop(s: &Shared) {
    while !s.stop.load(Ordering::Acquire) {
        std::thread::sleep(s.timeouts.sweep_every);
        let gone = s.channel.gone_peers();
        if !gone.is_empty() {
            let ended = {
                let mut core = lock(&s.core);
                let ended = core.receivers_gone(&gone, Instant::now());
                // Revoked, and freed if quiescent, under the same lock: a
                // waiter that sees the pulls gone sees their pages back.
                s.apply_releases(&mut core);
                ended
            };
            for (peer, pulls) in ended {
                log::info!(
                    "receiver {peer} is gone (its process exited or it detached): attachment \
                     dropped, {pulls} pull(s) announced to it released"
                );
            }
            // Outside the core's lock: dropping the last reference may
            // unmap a pool or synchronise a stream.
            for p in &gone {
                s.channel.detach(*p);
            }
            s.released.notify_all();
        }
        let mut core = lock(&s.core);
        let expired = core.sweep(Instant::now());
        for e in &expired {
            log::warn!(
                "pull {} (request {}) to {} expired after the TTL with no PullDoneSignal{}: {} \
                 pinned page(s) released",
                e.pull_id,
                e.req_id,
                e.peer,
                if e.acked { "" } else { " and no ack" },
                e.pages
            );
        }
        s.apply_releases(&mut core);
        if !expired.is_empty() {
            s.released.notify_all();
        }
    }
}
