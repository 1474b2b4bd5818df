//! The decode side: serves handshakes and requests, stores chunks
//! (resident or as pull-delay proxies), loads them into a KV cache and
//! sends PullDoneSignal.
//!
//! What to answer, which pages to lend, grant, revoke or free and when a
//! Done goes out is decided by the [`ReceiverCore`]; this shell moves
//! frames and bytes:
//!
//! - [`requests`]: the request socket (ROUTER on `pd_peer_alloc_port`):
//!   `AllocRequest`, `PullReadyNotif`, push notices, and pull-eager reads;
//! - [`upkeep`]: the handshake events (attached senders) and the sweeper
//!   (timeouts, revoked grants, quarantined pages coming back);
//! - here: the public [`Receiver`] (lookups, fetch, the load path of
//!   [`crate::pipeline`]) and what the threads share.

mod requests;
mod upkeep;

use super::counters::{MessageCounters, MessageKind};
use super::zmq_io::PushPool;
use super::{check_config, lock, spawn, wait_until, BackendError, NodeId, Opened};
use crate::auth::{envelope_header, FrameKind, OpenError, Session};
use crate::channel::handshake::{Agreement, HandshakeServer, Hello, TpInfo};
use crate::channel::{GrantStats, PeerId, PeerPages, TransferChannel, TransferOp};
use crate::config::{PdConfig, Role, TransferMode};
use crate::kv::tp::Route;
use crate::kv::KvCache;
use crate::layout::ChunkLayout;
use crate::memory::{DualAllocator, DualStats, PagePool, SealedMemObj};
use crate::pipeline::load::{load_keys, LoadEnv};
use crate::pipeline::{LoadError, LoadOptions, LoadReport};
use crate::protocol::notice::route_node;
use crate::protocol::{
    HeadPiece, KeyState, Lookup, Message, ReadOutcome, ReceiverConfig, ReceiverCore,
    ReceiverCounters, SendPullDone, RESIDENT_EXPIRED,
};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Counters of a receiver.
#[derive(Clone, Debug)]
pub struct ReceiverStats {
    /// Pool counters (quarantined pages included).
    pub pools: DualStats,
    /// Core counters.
    pub store: ReceiverCounters,
    /// Messages and errors by kind.
    pub messages: Vec<(MessageKind, u64)>,
    /// Bytes read (pull) by this receiver.
    pub bytes_read: u64,
    /// Senders attached.
    pub peers: usize,
    /// Write grants on the channel (push) and refused peer requests.
    pub grants: GrantStats,
    /// Requests waiting for pages now (parked; other senders are served
    /// meanwhile).
    pub waiting_for_pages: usize,
    /// Requests refused at once because the wait queue was full.
    pub refused_waiting: u64,
    /// Multi-batch requests holding a page reservation now.
    pub reservations: usize,
    /// Senders found restarted: their old attachment and proxies were dropped.
    pub sender_restarts: u64,
    /// Senders whose process exited: their attachment and proxies were dropped.
    pub senders_gone: u64,
    /// Multi-batch requests refused because their whole budget did not fit.
    pub admission_refused: u64,
}

/// Why fetching some keys failed; the rest were fetched.
#[derive(Debug, thiserror::Error)]
#[error("{} key(s) could not be fetched: {}", failed.len(), failed.iter().map(|(k, e)| format!("{k}: {e}")).collect::<Vec<_>>().join("; "))]
pub struct FetchError {
    /// Each failed key and why.
    pub failed: Vec<(String, String)>,
}

/// An attached sender: its channel id and the agreed lease.
#[derive(Clone, Debug)]
struct PeerLink {
    peer: PeerId,
    lease: Duration,
    /// Pages in the buffer table it declared (only what it says: see
    /// [`Shared::proxy_cap`]).
    table_pages: u64,
    /// With a deployment secret: the session of this attachment. Only
    /// frames it opens act for this sender; our frames to it are sealed by it.
    session: Option<Arc<Session>>,
}

struct Shared {
    config: PdConfig,
    mode: TransferMode,
    alloc: DualAllocator,
    channel: Arc<dyn TransferChannel>,
    core: Mutex<ReceiverCore>,
    /// Notified when keys become resident (or give up landing).
    landed: Condvar,
    /// Attached senders by node id.
    peers: Mutex<HashMap<String, PeerLink>>,
    dones: PushPool,
    counters: Arc<MessageCounters>,
    /// The eager reader's queue; taken (closed) at shutdown once the
    /// request loop, which feeds it, has stopped.
    eager: Mutex<Option<crossbeam_channel::Sender<crate::protocol::EagerRead>>>,
    /// What the request loop's wait queue holds, and refused (for stats).
    waiting: AtomicUsize,
    refused_waiting: AtomicU64,
    /// Senders found restarted (a new process of the same identity attached).
    sender_restarts: AtomicU64,
    /// Senders whose process exited (their attachment and proxies dropped).
    senders_gone: AtomicU64,
    /// Reservations of multi-batch requests (see `protocol::admission`).
    admission: Mutex<crate::protocol::admission::Admission>,
    /// This rank's TP split (sent in the hello; pairs senders' head pieces).
    tp: Option<TpInfo>,
    /// The most proxies a sender whose pages the channel cannot verify
    /// (tcp) may hold here: the pages of this receiver's own pools, at
    /// least [`MIN_UNVERIFIED_PROXIES`].
    unverified_cap: u64,
    /// The link `pd_npu_link` selects, resolved at start: loads price
    /// their one-sided ops with it (see `pipeline::cost`).
    npu_link: Option<&'static ascend_sys::link::Link>,
    stop: AtomicBool,
}

/// The fewest proxies a tcp sender may hold here, however small this
/// receiver's pools (a pull-delay receiver needs few pages of its own).
pub const MIN_UNVERIFIED_PROXIES: u64 = 1024;

impl Shared {
    /// Drops what request `req_id` holds of `keys` (see
    /// [`ReceiverCore::cancel`]) and returns the keys dropped or marked.
    fn cancel(&self, req_id: &str, keys: &[String]) -> Vec<String> {
        lock(&self.admission).release(req_id);
        let c = lock(&self.core).cancel(Instant::now(), req_id, keys);
        let mut dropped = Vec::with_capacity(c.removed.len() + c.deferred.len());
        for (key, r) in c.removed {
            if let Some(d) = r.done {
                self.send_done(d);
            }
            dropped.push(key);
        }
        dropped.extend(c.deferred);
        log::debug!(
            "request {req_id:?} cancelled: dropped {} of its {} key(s)",
            dropped.len(),
            keys.len()
        );
        dropped
    }

    fn send_done(&self, d: SendPullDone) {
        let frame = Message::PullDoneSignal(d.signal).encode();
        let Some(frame) = self.seal_for(&d.sender_id, FrameKind::Done, frame) else {
            // Its attachment is gone: the sender's lease frees the pages.
            log::debug!(
                "no PullDoneSignal to {}: it is no longer attached, so nothing can seal one",
                d.sender_id
            );
            return;
        };
        self.counters.bump(MessageKind::PullDoneSignal);
        self.dones.send(&d.done_url, frame);
    }

    /// `message` as sender `node` takes it: as it is without a deployment
    /// secret; with one, sealed by its attachment's session (`None` when
    /// it has none: not attached).
    fn seal_for(&self, node: &str, kind: FrameKind, message: Vec<u8>) -> Option<Vec<u8>> {
        if self.channel.auth().is_none() {
            return Some(message);
        }
        let session = self.attached(node)?.session?;
        Some(session.seal(kind, &message))
    }

    /// A request frame as it may be acted on: as it came without a
    /// deployment secret; with one, opened by the session of the attached
    /// sender it names — whose node the frame's `route`, when it has one,
    /// must name too (a route is bound to its attachment, not trusted).
    fn open_request(&self, route: Option<&str>, frame: Vec<u8>) -> Result<Vec<u8>, OpenError> {
        if self.channel.auth().is_none() {
            return Ok(frame);
        }
        let (id, _) = envelope_header(&frame).ok_or(OpenError::NotSealed)?;
        let found = lock(&self.peers)
            .iter()
            .find(|(_, l)| l.session.as_ref().is_some_and(|s| *s.id() == id))
            .map(|(n, l)| (n.clone(), l.session.clone().expect("found by it")));
        let (node, session) = found.ok_or(OpenError::UnknownAttachment)?;
        let inner = session.open(FrameKind::Request, &frame)?.to_vec();
        if route.is_some_and(|r| route_node(r) != node) {
            return Err(OpenError::UnknownAttachment);
        }
        Ok(inner)
    }

    /// The most proxies `link`'s sender may hold here: each pins a page of
    /// its pool until its Done, so no more than the pages of its table the
    /// channel verified it registered (a declared table alone would let a
    /// sender make us store proxies without bound). Over a channel that
    /// cannot verify (tcp), its table but at most [`Shared::unverified_cap`].
    /// `None` while the channel cannot tell yet (hccl: setup still running).
    fn proxy_cap(&self, link: &PeerLink) -> Option<usize> {
        let cap = match self.channel.verified_peer_pages(link.peer) {
            PeerPages::Verified(n) => n.min(link.table_pages),
            PeerPages::Unverifiable => link.table_pages.min(self.unverified_cap),
            PeerPages::Pending => return None,
        };
        Some(usize::try_from(cap).unwrap_or(usize::MAX))
    }

    /// The link of sender `node`. Links are registered before the
    /// handshake's answer goes out, so a sender that heard it is known:
    /// no waiting here (an unknown node cannot stall the request loop).
    fn attached(&self, node: &str) -> Option<PeerLink> {
        lock(&self.peers).get(node).cloned()
    }

    /// Records an attached sender (run by the handshake server before it
    /// answers); a re-attach of the same node replaces its link.
    fn register(&self, a: &Agreement) {
        // A sender of the same identity under a new node id is the same
        // worker restarted (only one process binds its done port): its old
        // attachment and proxies go now.
        let stale: Vec<(String, PeerLink)> = match sender_identity(&a.remote.node) {
            Some(id) => lock(&self.peers)
                .iter()
                .filter(|(n, _)| **n != a.remote.node && sender_identity(n) == Some(id))
                .map(|(n, l)| (n.clone(), l.clone()))
                .collect(),
            None => Vec::new(),
        };
        for (node, link) in stale {
            lock(&self.peers).remove(&node);
            self.channel.detach(link.peer);
            let dropped = lock(&self.core).forget_sender(&node, Instant::now());
            self.sender_restarts.fetch_add(1, Ordering::Relaxed);
            log::info!(
                "sender {node} restarted (now {}): dropped its attachment and {dropped} proxy(ies) \
                 of its old process",
                a.remote.node
            );
        }
        let piece = self.piece_of(a);
        if let Some(p) = piece {
            log::info!(
                "sender {} sends head pieces: {} element(s) per token at element {} of this \
                 rank's {}",
                a.remote.node,
                p.hidden,
                p.offset,
                self.config.kv.hidden_size
            );
        }
        lock(&self.core).set_piece(&a.remote.node, piece);
        lock(&self.peers).insert(
            a.remote.node.clone(),
            PeerLink {
                peer: a.peer,
                lease: a.lease,
                table_pages: a
                    .remote
                    .buffers
                    .iter()
                    .map(|b| b.len.checked_div(b.page_size).unwrap_or(0))
                    .fold(0, u64::saturating_add),
                session: a.session.clone(),
            },
        );
    }
}

impl Shared {
    /// Forgets the senders the channel knows are gone (their process
    /// exited): their attachment goes, which unmaps (shm) or closes (hccl)
    /// their memory, and their proxies are discarded. Without this a
    /// decode worker kept every dead prefill process's pool mapped.
    pub(super) fn forget_gone_senders(&self) {
        let gone = self.channel.gone_peers();
        if gone.is_empty() {
            return;
        }
        // Taken out under one lock: a sender that re-attached meanwhile
        // has a new link, which stays.
        let dead: Vec<(String, PeerLink)> = {
            let mut peers = lock(&self.peers);
            let nodes: Vec<String> = peers
                .iter()
                .filter(|(_, l)| gone.contains(&l.peer))
                .map(|(n, _)| n.clone())
                .collect();
            nodes
                .into_iter()
                .filter_map(|n| peers.remove(&n).map(|l| (n, l)))
                .collect()
        };
        for (node, link) in dead {
            self.channel.detach(link.peer);
            let dropped = lock(&self.core).forget_sender(&node, Instant::now());
            self.senders_gone.fetch_add(1, Ordering::Relaxed);
            log::info!(
                "sender {node} is gone (its process exited or it detached): dropped its \
                 attachment and {dropped} proxy(ies) it announced"
            );
        }
        // Attachments no sender link names (a handshake that was refused
        // after attaching, say) go too; checked under the lock, so one
        // registered meanwhile is left to the next sweep.
        let peers = lock(&self.peers);
        for p in gone
            .into_iter()
            .filter(|p| !peers.values().any(|l| l.peer == *p))
        {
            self.channel.detach(p);
        }
    }

    /// The head piece sender `a` sends this rank (heterogeneous TP), or
    /// `None` for whole chunks. The hellos' agreement already refused
    /// senders that cannot be paired.
    fn piece_of(&self, a: &Agreement) -> Option<HeadPiece> {
        if self.config.tp_size == self.config.peer_tp() {
            return None;
        }
        let (ours, theirs) = (self.tp.as_ref()?, a.remote.tp.as_ref()?);
        let heads = ours.piece_from(theirs).ok()?;
        let plan = self.config.tp_plan().ok()?;
        let mine = plan.decode_heads(ours.rank);
        let per_head = self.config.head_elements();
        let piece = HeadPiece {
            hidden: heads.len() * per_head,
            offset: (heads.start - mine.start) * per_head,
        };
        (piece.hidden != self.config.kv.hidden_size).then_some(piece)
    }
}

/// What stays the same when a sender restarts: its host, done port and TP
/// rank (`host:port/p<pid>r<rank>-<nonce>` without pid and nonce). A sender
/// without a done port (push) has no identity of its own: two of them may
/// share a host.
fn sender_identity(node: &str) -> Option<(&str, &str)> {
    let (addr, rest) = node.split_once('/')?;
    if addr.ends_with(":0") {
        return None;
    }
    let rank = rest
        .strip_prefix('p')?
        .split_once('r')?
        .1
        .split_once('-')?
        .0;
    Some((addr, rank))
}

impl LoadEnv for Shared {
    fn core(&self) -> MutexGuard<'_, ReceiverCore> {
        lock(&self.core)
    }

    fn channel(&self) -> &dyn TransferChannel {
        self.channel.as_ref()
    }

    fn pool(&self) -> &Arc<PagePool> {
        self.alloc.primary()
    }

    fn layout(&self) -> ChunkLayout {
        self.config.chunk_layout()
    }

    fn page_wait(&self) -> Duration {
        self.config.alloc_fail_backoff_ttl
    }

    fn peer_of(&self, sender_id: &str) -> Option<PeerId> {
        self.attached(sender_id).map(|p| p.peer)
    }

    fn send_done(&self, done: SendPullDone) {
        Shared::send_done(self, done);
    }

    fn read_bytes(&self, bytes: u64) {
        self.counters.add_bytes(bytes);
    }

    fn transfer_failed(&self) {
        self.counters.bump(MessageKind::TransferError);
    }

    fn npu_link(&self) -> Option<&'static ascend_sys::link::Link> {
        self.npu_link
    }
}

/// A decode worker's PD receiver.
pub struct Receiver {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
    /// The eager reader (pull-eager), stopped after the request loop.
    reader: Option<JoinHandle<()>>,
    handshake: Option<HandshakeServer>,
}

impl Receiver {
    /// Starts a receiver for TP rank `rank` (role must be receiver): binds
    /// `pd_peer_init_port[rank]` and `pd_peer_alloc_port[rank]` on `pd_peer_host`.
    ///
    /// NPU pools (and hccl's pinned host pool) come from the CANN runtime,
    /// found as `ascend_sys` searches for it (`ASCEND_PD_CANN_LIB_DIR` first).
    pub fn start(config: &PdConfig, rank: usize) -> Result<Receiver, BackendError> {
        check_config(config, Role::Receiver)?;
        let host = config
            .peer_host
            .clone()
            .expect("validated: receiver has a host");
        let (Some(init_port), Some(alloc_port)) = (config.init_port(rank), config.alloc_port(rank))
        else {
            return Err(BackendError::Setup(format!(
                "pd_peer_init_port / pd_peer_alloc_port: no port for TP rank {rank}"
            )));
        };
        let node = NodeId::receiver(&host, alloc_port, rank);
        let Opened {
            alloc,
            channel,
            ctx,
            counters,
            pushes: dones,
            ..
        } = Opened::open(config, &host, &node, "pd-done-push")?;
        let core = ReceiverCore::new(ReceiverConfig {
            layout: config.chunk_layout(),
            push_landing_timeout: config.push_landing_timeout,
            read_margin_pct: config.pull_read_margin_pct,
            resident_ttl: Some(config.resident_ttl).filter(|t| !t.is_zero()),
        });
        let npu_link = config
            .npu_link
            .resolve()
            .map_err(|e| BackendError::Setup(format!("pd_npu_link: {e}")))?;
        if let (Some(l), Some(path)) = (npu_link, channel.link_path()) {
            log::info!(
                "loads price their {path:?} ops on the modeled link {} (pd_npu_link: {}) \
                 to choose direct or staged reads",
                l.name(),
                config.npu_link.name()
            );
        }
        let (eager_tx, eager_rx) = crossbeam_channel::unbounded();
        let own_pages = alloc.pools().map(|p| p.stats().total as u64).sum::<u64>();
        let shared = Arc::new(Shared {
            config: config.clone(),
            mode: config.mode(),
            alloc,
            channel: Arc::clone(&channel),
            core: Mutex::new(core),
            landed: Condvar::new(),
            peers: Mutex::new(HashMap::new()),
            dones,
            counters,
            eager: Mutex::new(Some(eager_tx)),
            waiting: AtomicUsize::new(0),
            refused_waiting: AtomicU64::new(0),
            sender_restarts: AtomicU64::new(0),
            senders_gone: AtomicU64::new(0),
            admission: Mutex::new(crate::protocol::admission::Admission::new(
                config.push_landing_timeout,
            )),
            tp: TpInfo::of(config, rank),
            unverified_cap: own_pages.max(MIN_UNVERIFIED_PROXIES),
            npu_link,
            stop: AtomicBool::new(false),
        });
        let hello = Hello::local(
            node.as_str(),
            Role::Receiver,
            shared.mode,
            config.pull_pending_ttl,
            channel.as_ref(),
        )
        .with_tp(shared.tp)
        .with_model(config.model_identity.clone());
        let (ev_tx, ev_rx) = crossbeam_channel::unbounded();
        let s2 = Arc::clone(&shared);
        let handshake = HandshakeServer::spawn_with(
            &ctx,
            &crate::backend::bind_url(config, &host, init_port),
            channel,
            hello,
            ev_tx,
            Box::new(move |a| {
                s2.register(a);
                Ok(())
            }),
        )?;
        let router = ctx
            .socket(zmq::ROUTER)
            .map_err(BackendError::zmq("creating the request socket"))?;
        router.set_linger(0).ok();
        router.set_rcvtimeo(100).ok();
        // A longer frame is dropped (with its connection) before ZMQ
        // buffers it: nobody can make us hold a 100 MB notification.
        router
            .set_maxmsgsize(config.max_message_bytes())
            .map_err(BackendError::zmq("capping the request socket's frame size"))?;
        let url = crate::backend::bind_url(config, &host, alloc_port);
        router.bind(&url).map_err(BackendError::zmq(format!(
            "binding the request socket {url} (pd_peer_alloc_port in use?)"
        )))?;
        // The decoder cache probe on its own port, when configured.
        let query = match config.query_port(rank) {
            None => None,
            Some(port) => {
                let sock = ctx
                    .socket(zmq::REP)
                    .map_err(BackendError::zmq("creating the query socket"))?;
                sock.set_linger(0).ok();
                sock.set_rcvtimeo(100).ok();
                sock.set_maxmsgsize(config.max_message_bytes())
                    .map_err(BackendError::zmq("capping the query socket's frame size"))?;
                let url = crate::backend::bind_url(config, &host, port);
                sock.bind(&url).map_err(BackendError::zmq(format!(
                    "binding the query socket {url} (pd_peer_query_port in use?)"
                )))?;
                Some(sock)
            }
        };
        // Built first, so a thread that cannot start drops it, and the drop
        // stops and joins the threads already started.
        let mut r = Receiver {
            shared,
            threads: Vec::new(),
            reader: None,
            handshake: Some(handshake),
        };
        let s = Arc::clone(&r.shared);
        r.threads.push(spawn("pd-recv-peers", move || {
            upkeep::peer_events(&s, ev_rx)
        })?);
        let s = Arc::clone(&r.shared);
        r.threads.push(spawn("pd-recv-requests", move || {
            requests::request_loop(&s, router)
        })?);
        let s = Arc::clone(&r.shared);
        r.threads
            .push(spawn("pd-recv-sweep", move || upkeep::sweep_loop(&s))?);
        if let Some(sock) = query {
            let s = Arc::clone(&r.shared);
            r.threads.push(spawn("pd-recv-query", move || {
                requests::query_loop(&s, sock)
            })?);
        }
        // One thread starts and watches every eager read (never a thread
        // per pull); the queue holds at most one read per allocated page.
        if r.shared.mode == TransferMode::PullEager {
            let s = Arc::clone(&r.shared);
            r.reader = Some(spawn("pd-eager-read", move || {
                requests::eager_reader(&s, eager_rx)
            })?);
        }
        Ok(r)
    }

    /// The transfer mode.
    pub fn mode(&self) -> TransferMode {
        self.shared.mode
    }

    /// The configuration it runs.
    pub fn config(&self) -> &PdConfig {
        &self.shared.config
    }

    /// The geometry of a full chunk (`chunk_size` tokens).
    pub fn chunk_layout(&self) -> ChunkLayout {
        self.shared.config.chunk_layout()
    }

    /// The allocator.
    pub fn allocator(&self) -> &DualAllocator {
        &self.shared.alloc
    }

    /// Whether `key` is stored (resident, pending, or a proxy).
    pub fn contains(&self, key: &str) -> bool {
        lock(&self.shared.core).contains(key)
    }

    /// Tokens of the pull-delay proxy stored for `key` (looking never consumes it).
    pub fn proxy_tokens(&self, key: &str) -> Option<usize> {
        match lock(&self.shared.core).get(key, Instant::now()) {
            Lookup::Proxy(p) => Some(p.tokens()),
            _ => None,
        }
    }

    /// The state of `key`, if stored.
    pub fn state(&self, key: &str) -> Option<KeyState> {
        lock(&self.shared.core).state(key)
    }

    /// The chunk of `key` if its data has fully landed (push / pull-eager).
    /// A chunk still being written or read is not returned.
    pub fn get(&self, key: &str) -> Option<SealedMemObj> {
        match lock(&self.shared.core).get(key, Instant::now()) {
            Lookup::Resident(m) => Some(m.clone()),
            _ => None,
        }
    }

    /// Like [`Receiver::get`], but waits up to `timeout` for a chunk that is
    /// still landing. `None` means missing or not landed in time.
    pub fn get_wait(&self, key: &str, timeout: Duration) -> Option<SealedMemObj> {
        // A timeout past what the clock can hold waits as long as it takes.
        let deadline = Instant::now().checked_add(timeout);
        let mut core = lock(&self.shared.core);
        loop {
            match core.get(key, Instant::now()) {
                Lookup::Resident(m) => return Some(m.clone()),
                Lookup::NotReady => {}
                _ => return None,
            }
            core = wait_until(
                &self.shared.landed,
                core,
                deadline,
                Some(Duration::from_millis(100)),
            )?;
        }
    }

    /// Waits up to `timeout` until every key of `keys` can be loaded (its
    /// chunk landed, or a proxy for it is held); true if they all can. Wakes
    /// when a chunk lands or proxies arrive, not on a polling interval.
    pub fn wait_loadable(&self, keys: &[String], timeout: Duration) -> bool {
        let deadline = Instant::now().checked_add(timeout);
        let mut core = lock(&self.shared.core);
        loop {
            let ready = keys
                .iter()
                .all(|k| matches!(core.state(k), Some(KeyState::Resident | KeyState::Proxy)));
            if ready {
                return true;
            }
            if self.shared.stop.load(Ordering::Acquire) {
                return false;
            }
            // Woken by landings, arriving proxies and the stop only (no
            // polling interval: a path that forgot to notify shows).
            match wait_until(&self.shared.landed, core, deadline, None) {
                Some(c) => core = c,
                None => return false,
            }
        }
    }

    /// Removes `key` (its page returns to the pool once no load uses it; a
    /// proxy counts as discarded, which may complete its pull's Done).
    /// Returns whether it was removed: a key still landing or being read
    /// stays until its transfer ends.
    pub fn remove(&self, key: &str) -> bool {
        let removed = lock(&self.shared.core).remove(key);
        match removed {
            Some(r) => {
                if let Some(d) = r.done {
                    self.shared.send_done(d);
                }
                true
            }
            None => false,
        }
    }

    /// Request `req_id` is done with `keys` (its load finished): each key
    /// that no other request holds is removed (its page returns, a proxy
    /// counts as discarded); a key another request still holds (a shared
    /// prefix) stays for it. Keys still landing are left alone.
    pub fn release(&self, req_id: &str, keys: &[String]) {
        for k in keys {
            let r = lock(&self.shared.core).release(req_id, k);
            if let Some(d) = r.and_then(|r| r.done) {
                self.shared.send_done(d);
            }
        }
    }

    /// Requests holding `key`, by the request ids their senders gave
    /// (0 when it is not stored or no sender named a request).
    pub fn holders(&self, key: &str) -> usize {
        lock(&self.shared.core).holders(key)
    }

    /// Cancels request `req_id` here: drops what this receiver holds of
    /// `keys`, as a `CancelNotif` from its sender would. Stored chunks go
    /// back to the pool, proxies are discarded (their pull's PullDoneSignal
    /// then releases the sender's pins), and keys still landing are
    /// dropped when their transfer ends. A key another request still holds
    /// (a shared prefix) stays for it. Returns the keys this request let go of.
    ///
    /// The request is also *withdrawn* here for `pd_resident_ttl` (600 s
    /// when that is 0): an `AllocRequest` or `PullReadyNotif` whose
    /// `req_id` is `req_id` and that comes later (its prefill did not know)
    /// is answered with every key already sent, so nothing is stored: the
    /// sender writes nothing (push) or releases its pins at the ack (pull).
    /// Name the request as the prefill's sender did (`TransferSpec::req_id`).
    pub fn cancel(&self, req_id: &str, keys: &[String]) -> Vec<String> {
        self.shared.cancel(req_id, keys)
    }

    /// Reads the pull-delay proxies of `keys` now into fresh pages and
    /// returns every key's chunk (resident keys are returned as they are).
    /// Fetched proxies are consumed: once all of a pull's proxies are, its
    /// PullDoneSignal goes out. On failure, the keys that failed are named,
    /// their proxies are discarded (Done still goes out) and nothing leaks.
    pub fn fetch(&self, keys: &[String]) -> Result<Vec<(String, SealedMemObj)>, FetchError> {
        let mut out = Vec::with_capacity(keys.len());
        let mut failed = Vec::new();
        for key in keys {
            match fetch_one(&self.shared, key) {
                Ok(m) => out.push((key.clone(), m)),
                Err(e) => failed.push((key.clone(), e)),
            }
        }
        if failed.is_empty() {
            Ok(out)
        } else {
            Err(FetchError { failed })
        }
    }

    /// Loads `keys` (one request, chunk `i` covering tokens
    /// `[i * chunk_size, i * chunk_size + tokens_i)`) into `cache` at the
    /// slots of `slot_mapping` (vLLM's: one slot per token,
    /// `block * block_size + offset`, negative = padding). The reference's
    /// `batched_to_gpu`. With [`LoadOptions::default`]; see
    /// [`Receiver::load_with`].
    pub fn load(
        &self,
        keys: &[String],
        slot_mapping: &[i64],
        cache: &mut KvCache,
    ) -> Result<LoadReport, LoadError> {
        self.load_with(keys, slot_mapping, cache, &LoadOptions::default())
    }

    /// Like [`Receiver::load`], with explicit options (see
    /// [`crate::pipeline`] for how proxies are read and what a failure
    /// leaves behind: nothing held, every failed pull's Done sent).
    pub fn load_with(
        &self,
        keys: &[String],
        slot_mapping: &[i64],
        cache: &mut KvCache,
        opts: &LoadOptions,
    ) -> Result<LoadReport, LoadError> {
        let lent = crate::pipeline::scatter::SharedCache::Lent(std::sync::Mutex::new(cache));
        load_keys(&*self.shared, keys, slot_mapping, &lent, opts)
    }

    /// [`Receiver::load_with`] into a cache other requests' loads use at
    /// the same time: it is locked only to plan and to scatter, never
    /// across a network read. The caller keeps the request's slots to
    /// this load (see `SharedKvCache::claim`).
    pub(crate) fn load_shared(
        &self,
        keys: &[String],
        slot_mapping: &[i64],
        cache: &std::sync::Mutex<KvCache>,
        opts: &LoadOptions,
    ) -> Result<LoadReport, LoadError> {
        let shared = crate::pipeline::scatter::SharedCache::Shared(cache);
        load_keys(&*self.shared, keys, slot_mapping, &shared, opts)
    }

    /// The prefill ranks this decode rank takes its chunks from, and the
    /// heads of each one's piece (`tp_size`, `pd_peer_tp_size`): one
    /// source with all of this rank's heads when both TP sizes match.
    pub fn sources(&self) -> Vec<Route> {
        let s = &self.shared;
        match (s.config.tp_plan(), s.tp) {
            (Ok(plan), Some(tp)) => plan.sources(tp.rank),
            _ => Vec::new(),
        }
    }

    /// The keys to load for the chunks `keys` of a request, and how many
    /// there are per chunk ([`LoadOptions::pieces_per_chunk`]): `keys`
    /// themselves when both TP sizes match, else each chunk's pieces from
    /// every source rank ([`crate::kv::tp::piece_key`]), chunk by chunk.
    pub fn piece_keys(&self, keys: &[String]) -> (Vec<String>, usize) {
        let s = &self.shared;
        if s.config.tp_size == s.config.peer_tp() {
            return (keys.to_vec(), 1);
        }
        let sources = self.sources();
        let pieces = keys
            .iter()
            .flat_map(|k| {
                sources
                    .iter()
                    .map(move |src| crate::kv::tp::piece_key(k, src.heads))
            })
            .collect();
        (pieces, sources.len().max(1))
    }

    /// Counters.
    pub fn stats(&self) -> ReceiverStats {
        let s = &self.shared;
        // One guard at a time: a temporary lives to the end of the struct
        // literal, and taking the same lock twice in it would deadlock.
        let (reservations, admission_refused) = {
            let a = lock(&s.admission);
            (a.open(), a.refused)
        };
        ReceiverStats {
            pools: s.alloc.stats(),
            store: lock(&s.core).counters(),
            messages: s.counters.snapshot(),
            bytes_read: s.counters.bytes(),
            peers: lock(&s.peers).len(),
            grants: s.channel.grant_stats(),
            waiting_for_pages: s.waiting.load(Ordering::Relaxed),
            refused_waiting: s.refused_waiting.load(Ordering::Relaxed),
            reservations,
            admission_refused,
            sender_restarts: s.sender_restarts.load(Ordering::Relaxed),
            senders_gone: s.senders_gone.load(Ordering::Relaxed),
        }
    }

    /// Stops every thread and closes the sockets. Stored chunks are dropped
    /// (their pages return to the pools).
    pub fn close(mut self) {
        self.stop_threads();
    }

    fn stop_threads(&mut self) {
        let s = &self.shared;
        s.stop.store(true, Ordering::Release);
        s.landed.notify_all();
        self.handshake = None;
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        // Nothing feeds the reader any more: closing its queue lets it
        // fail what is queued and give up what is in flight, then end.
        lock(&s.eager).take();
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
        // Grants first, then pages: a page returns only if its writer can
        // no longer touch it; the others stay quarantined with their pool.
        let kept = lock(&s.core).shut_down(|g| {
            s.channel.revoke(g);
            s.channel.is_quiescent(g)
        });
        if kept > 0 {
            log::warn!(
                "receiver stopped with {kept} page(s) lent to writers that may still write them; \
                 they stay quarantined (their pool is not freed)"
            );
        }
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.stop_threads();
    }
}

fn fetch_one(s: &Shared, key: &str) -> Result<SealedMemObj, String> {
    let now = Instant::now();
    let proxy = {
        let mut core = lock(&s.core);
        match core.get(key, now) {
            Lookup::Resident(m) => return Ok(m.clone()),
            Lookup::Missing => return Err("not stored".into()),
            Lookup::NotReady => return Err("its data has not landed yet".into()),
            Lookup::Expired => return Err("its pull lease expired".into()),
            Lookup::ResidentExpired => return Err(RESIDENT_EXPIRED.into()),
            Lookup::SenderRestarted => {
                return Err(
                    "its sender restarted or exited after announcing it; the data is gone".into(),
                )
            }
            Lookup::Proxy(_) => {}
        }
        core.begin_proxy_read(key, now).map_err(|e| e.to_string())?
    };
    let finish = |outcome: ReadOutcome| {
        let done = lock(&s.core).end_proxy_read(&proxy.handle, outcome);
        if let Some(d) = done {
            s.send_done(d);
        }
    };
    let Some(peer) = s.attached(&proxy.sender_id).map(|p| p.peer) else {
        finish(ReadOutcome::Failed);
        return Err(format!("sender {} is not attached", proxy.sender_id));
    };
    let page = match s.alloc.allocate_batch_until(
        &[proxy.meta],
        Instant::now() + s.config.alloc_fail_backoff_ttl,
    ) {
        Ok(mut p) => p.pop().expect("one page"),
        Err(e) => {
            finish(ReadOutcome::Failed);
            return Err(e.to_string());
        }
    };
    let op = TransferOp {
        local: page,
        remote: proxy.remote,
        local_offset: 0,
        remote_offset: 0,
        len: proxy.byte_len(),
    };
    // Waiting for the attachment and the page took time: the read may only
    // start inside its window.
    if Instant::now() >= proxy.read_by {
        finish(ReadOutcome::Failed);
        return Err("its read window closed while a page was found for it".into());
    }
    let result = match s.channel.submit_read(peer, vec![op]) {
        Err(e) => Err(e.to_string()),
        Ok(mut c) => match c.wait_until(proxy.lease_deadline) {
            Some(done) => done.result.map(|()| done.pages).map_err(|e| e.to_string()),
            // Dropping the completion leaves the page with the transfer.
            None => Err("the read did not finish within the pull's lease".into()),
        },
    };
    match result {
        Ok(mut pages) => {
            s.counters.add_bytes(proxy.byte_len() as u64);
            finish(ReadOutcome::Consumed);
            Ok(pages.pop().expect("one page").seal())
        }
        Err(e) => {
            s.counters.bump(MessageKind::TransferError);
            finish(ReadOutcome::Failed);
            Err(e)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::sender_identity;

    #[test]
    fn a_senders_identity_is_its_host_done_port_and_rank() {
        let a = sender_identity("10.0.0.1:17600/p123r0-0a1b2c3d");
        assert_eq!(a, Some(("10.0.0.1:17600", "0")));
        // Restarted: new pid and nonce, same identity.
        assert_eq!(sender_identity("10.0.0.1:17600/p999r0-ffffffff"), a);
        assert_ne!(sender_identity("10.0.0.1:17600/p999r1-ffffffff"), a);
        // Push senders (no done port) share a host: no identity.
        assert_eq!(sender_identity("10.0.0.1:0/p123r0-0a1b2c3d"), None);
        assert_eq!(sender_identity("not-a-sender-id"), None);
    }
}
