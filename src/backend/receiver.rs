//! The decode side: serves handshakes and allocation requests, stores
//! chunks (resident or as pull-delay proxies) and sends PullDoneSignal.

use super::counters::{MessageCounters, MessageKind};
use super::zmq_io::PushPool;
use super::{check_config, lock, spawn, BackendError};
use crate::channel::handshake::{HandshakeEvent, HandshakeServer, Hello};
use crate::channel::Completion;
use crate::channel::{self, PeerId, TransferChannel, TransferOp};
use crate::config::{PdConfig, Role, TransferMode};
use crate::kv::{plan, KvCache, ScatterStats};
use crate::memory::{ChunkMeta, DualAllocator, DualStats, MemObj, MemoryError};
use crate::pipeline::scatter::{ScatterItem, ScatterLane, ScatterTicket};
use crate::pipeline::{
    allocate_pools, ItemOutcome, KeyFailure, LoadError, LoadOptions, LoadReport, MicroBatch,
    PingPongPipeline, PipelineIo,
};
use crate::protocol::{
    check_alloc_request, check_pull_notif, AscendAllocResponse, EagerRead, KeyState, KeyStore,
    Lookup, Message, ProxyEntry, ReadOutcome, ReceiverConfig, ReceiverCounters, SendPullDone,
};
use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Counters of a receiver.
#[derive(Clone, Debug)]
pub struct ReceiverStats {
    /// Pool counters.
    pub pools: DualStats,
    /// Key store counters.
    pub store: ReceiverCounters,
    /// Messages and errors by kind.
    pub messages: Vec<(MessageKind, u64)>,
    /// Bytes read (pull) by this receiver.
    pub bytes_read: u64,
    /// Senders attached.
    pub peers: usize,
}

/// Why fetching some keys failed; the rest were fetched.
#[derive(Debug, thiserror::Error)]
#[error("{} key(s) could not be fetched: {}", failed.len(), failed.iter().map(|(k, e)| format!("{k}: {e}")).collect::<Vec<_>>().join("; "))]
pub struct FetchError {
    /// Each failed key and why.
    pub failed: Vec<(String, String)>,
}

struct PeerLink {
    peer: PeerId,
    lease: Duration,
}

struct Shared {
    config: PdConfig,
    mode: TransferMode,
    alloc: DualAllocator,
    channel: Arc<dyn TransferChannel>,
    store: Mutex<KeyStore>,
    landed: Condvar,
    peers: Mutex<HashMap<String, PeerLink>>,
    peers_changed: Condvar,
    dones: PushPool,
    counters: Arc<MessageCounters>,
    stop: AtomicBool,
}

/// A decode worker's PD receiver.
pub struct Receiver {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
    handshake: Option<HandshakeServer>,
}

/// How long a pushed chunk may stay unwritten before its pages are reclaimed.
const PUSH_LANDING_TIMEOUT: Duration = Duration::from_secs(30);

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
        // A bare `npu` device means NPU <rank>; CANN is loaded only if a pool needs it.
        let alloc = super::pools::allocator_for(config, rank as u32)?;
        let pools: Vec<_> = alloc.pools().cloned().collect();
        let channel = channel::open(config.transfer_channel, &host, &pools)?;
        let ctx = zmq::Context::new();
        let counters = Arc::new(MessageCounters::default());
        let c2 = Arc::clone(&counters);
        let dones = PushPool::spawn(&ctx, "pd-done-push", move |_| {
            c2.bump(MessageKind::Timeout);
        })?;
        let ttl = config.pull_pending_ttl;
        let store = KeyStore::new(ReceiverConfig {
            layout: config.chunk_layout(),
            push_landing_timeout: PUSH_LANDING_TIMEOUT,
            // Stop starting reads well before the lease ends, so in-flight
            // reads finish while the sender still holds the pages.
            lease_read_margin: (ttl / 10).min(Duration::from_secs(5)),
        });
        let shared = Arc::new(Shared {
            config: config.clone(),
            mode: config.mode(),
            alloc,
            channel: Arc::clone(&channel),
            store: Mutex::new(store),
            landed: Condvar::new(),
            peers: Mutex::new(HashMap::new()),
            peers_changed: Condvar::new(),
            dones,
            counters,
            stop: AtomicBool::new(false),
        });
        let hello = Hello::local(
            &format!("{host}:{alloc_port}"),
            Role::Receiver,
            shared.mode,
            ttl,
            channel.as_ref(),
        );
        let (ev_tx, ev_rx) = crossbeam_channel::unbounded();
        let handshake = HandshakeServer::spawn(
            &ctx,
            &format!("tcp://{host}:{init_port}"),
            channel,
            hello,
            ev_tx,
        )?;
        let rep = ctx
            .socket(zmq::REP)
            .map_err(BackendError::zmq("creating the allocation socket"))?;
        rep.set_linger(0).ok();
        rep.set_rcvtimeo(100).ok();
        let url = format!("tcp://{host}:{alloc_port}");
        rep.bind(&url).map_err(BackendError::zmq(format!(
            "binding the allocation socket {url} (pd_peer_alloc_port in use?)"
        )))?;
        let mut threads = Vec::new();
        let s = Arc::clone(&shared);
        threads.push(spawn("pd-recv-peers", move || peer_events(&s, ev_rx))?);
        let s = Arc::clone(&shared);
        threads.push(spawn("pd-recv-alloc", move || alloc_loop(&s, rep))?);
        let s = Arc::clone(&shared);
        threads.push(spawn("pd-recv-sweep", move || sweep_loop(&s))?);
        Ok(Receiver {
            shared,
            threads,
            handshake: Some(handshake),
        })
    }

    /// The transfer mode.
    pub fn mode(&self) -> TransferMode {
        self.shared.mode
    }

    /// The allocator.
    pub fn allocator(&self) -> &DualAllocator {
        &self.shared.alloc
    }

    /// Whether `key` is stored (resident, pending, or a proxy).
    pub fn contains(&self, key: &str) -> bool {
        lock(&self.shared.store).contains(key)
    }

    /// Tokens of the pull-delay proxy stored for `key` (looking never consumes it).
    pub fn proxy_tokens(&self, key: &str) -> Option<usize> {
        match lock(&self.shared.store).get(key, Instant::now()) {
            Lookup::Proxy(p) => Some(p.tokens()),
            _ => None,
        }
    }

    /// The state of `key`, if stored.
    pub fn state(&self, key: &str) -> Option<KeyState> {
        lock(&self.shared.store).state(key)
    }

    /// The chunk of `key` if its data has fully landed (push / pull-eager).
    /// A chunk still being written or read is not returned.
    pub fn get(&self, key: &str) -> Option<MemObj> {
        match lock(&self.shared.store).get(key, Instant::now()) {
            Lookup::Resident(m) => Some(m.clone()),
            _ => None,
        }
    }

    /// Like [`Receiver::get`], but waits up to `timeout` for a chunk that is
    /// still landing. `None` means missing or not landed in time.
    pub fn get_wait(&self, key: &str, timeout: Duration) -> Option<MemObj> {
        let deadline = Instant::now() + timeout;
        let mut store = lock(&self.shared.store);
        loop {
            match store.get(key, Instant::now()) {
                Lookup::Resident(m) => return Some(m.clone()),
                Lookup::NotReady => {}
                _ => return None,
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            store = self
                .shared
                .landed
                .wait_timeout(store, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Removes `key` (its page returns to the pool; a proxy counts as
    /// discarded, which may complete its pull's Done). Returns whether it existed.
    pub fn remove(&self, key: &str) -> bool {
        let removed = lock(&self.shared.store).remove(key);
        match removed {
            Some(r) => {
                if let Some(d) = r.done {
                    send_done(&self.shared, d);
                }
                true
            }
            None => false,
        }
    }

    /// Reads the pull-delay proxies of `keys` now into fresh pages and
    /// returns every key's chunk (resident keys are returned as they are).
    /// Fetched proxies are consumed: once all of a pull's proxies are, its
    /// PullDoneSignal goes out. On failure, the keys that failed are named,
    /// their proxies are discarded (Done still goes out) and nothing leaks.
    pub fn fetch(&self, keys: &[String]) -> Result<Vec<(String, MemObj)>, FetchError> {
        let s = &self.shared;
        let mut out = Vec::with_capacity(keys.len());
        let mut failed = Vec::new();
        for key in keys {
            match fetch_one(s, key) {
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

    /// Like [`Receiver::load`], with explicit options.
    ///
    /// Resident chunks (push, pull-eager) are scattered from their pages
    /// and stay stored. Pull-delay proxies
    /// ([`ProxyMemoryObj`](crate::pipeline::ProxyMemoryObj)s) are grouped
    /// per sender and run through a [`PingPongPipeline`]: two pools of
    /// `depth` pages (depth from the pages free now, at most
    /// `opts.max_depth` and the request, at least 1; smaller when a
    /// concurrent load took pages), micro-batch `i` read into pool `i % 2`
    /// while micro-batch `i - 1` is scattered. A proxy is consumed (and,
    /// with its pull's last one, the pull's PullDoneSignal sent, exactly
    /// once) only after its data is in the cache. On a failure (read error,
    /// sender gone, lease expired) that sender's remaining proxies in this
    /// call are not read, in-flight work is drained, the failed proxies are
    /// discarded so their pulls' Done still goes out, and the keys come
    /// back in [`LoadError::Incomplete`]; no page is held afterwards.
    /// Invalid input (slot mapping, cache geometry) is refused before
    /// anything is touched.
    pub fn load_with(
        &self,
        keys: &[String],
        slot_mapping: &[i64],
        cache: &mut KvCache,
        opts: &LoadOptions,
    ) -> Result<LoadReport, LoadError> {
        load_keys(&self.shared, keys, slot_mapping, cache, opts)
    }

    /// Counters.
    pub fn stats(&self) -> ReceiverStats {
        let s = &self.shared;
        ReceiverStats {
            pools: s.alloc.stats(),
            store: lock(&s.store).counters(),
            messages: s.counters.snapshot(),
            bytes_read: s.counters.bytes(),
            peers: lock(&s.peers).len(),
        }
    }

    /// Stops every thread and closes the sockets. Stored chunks are dropped
    /// (their pages return to the pools).
    pub fn close(mut self) {
        self.stop_threads();
    }

    fn stop_threads(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        self.handshake = None;
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.stop_threads();
    }
}

fn send_done(s: &Shared, d: SendPullDone) {
    s.counters.bump(MessageKind::PullDoneSignal);
    s.dones
        .send(&d.done_url, Message::PullDoneSignal(d.signal).encode());
}

fn fetch_one(s: &Shared, key: &str) -> Result<MemObj, String> {
    let now = Instant::now();
    let proxy = {
        let mut store = lock(&s.store);
        match store.get(key, now) {
            Lookup::Resident(m) => return Ok(m.clone()),
            Lookup::Missing => return Err("not stored".into()),
            Lookup::NotReady => return Err("its data has not landed yet".into()),
            Lookup::Expired => return Err("its pull lease expired".into()),
            Lookup::Proxy(_) => {}
        }
        store
            .begin_proxy_read(key, now)
            .map_err(|e| e.to_string())?
    };
    let finish = |outcome: ReadOutcome| {
        let done = lock(&s.store).end_proxy_read(&proxy.handle, outcome);
        if let Some(d) = done {
            send_done(s, d);
        }
    };
    let peer = attached_peer(s, &proxy.sender_id).map(|p| p.0);
    let Some(peer) = peer else {
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
        local: page.clone(),
        remote: proxy.remote,
        len: proxy.byte_len(),
    };
    match s.channel.read(peer, vec![op]) {
        Ok(()) => {
            s.counters.add_bytes(proxy.byte_len() as u64);
            finish(ReadOutcome::Consumed);
            Ok(page)
        }
        Err(e) => {
            s.counters.bump(MessageKind::TransferError);
            finish(ReadOutcome::Failed);
            Err(e.to_string())
        }
    }
}

fn peer_events(s: &Shared, rx: crossbeam_channel::Receiver<HandshakeEvent>) {
    while !s.stop.load(Ordering::Acquire) {
        match rx.recv_timeout(Duration::from_millis(100)) {
            Ok(HandshakeEvent::Attached(a)) => {
                log::debug!("sender {} attached as {}", a.remote.node, a.peer);
                lock(&s.peers).insert(
                    a.remote.node.clone(),
                    PeerLink {
                        peer: a.peer,
                        lease: a.lease,
                    },
                );
                s.peers_changed.notify_all();
            }
            Ok(HandshakeEvent::Refused { node, error }) => {
                log::warn!(
                    "refused a handshake from {}: {error}",
                    node.as_deref().unwrap_or("an unreadable peer")
                );
            }
            Ok(HandshakeEvent::Landed { node, refs }) => {
                let report = lock(&s.store).mark_landed_refs(&refs);
                if !report.not_pending.is_empty() {
                    log::warn!(
                        "{node} reported {} page(s) landed that were not pending (reclaimed?)",
                        report.not_pending.len()
                    );
                }
                s.landed.notify_all();
            }
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => {}
            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => break,
        }
    }
}

/// The link of sender `node`. The handshake reply goes out before its
/// event is processed, so a notif may race ahead of the registration: wait
/// for it briefly (bounded) before calling the sender unknown.
fn attached_peer(s: &Shared, node: &str) -> Option<(PeerId, Duration)> {
    let deadline = Instant::now() + Duration::from_secs(2);
    let mut peers = lock(&s.peers);
    loop {
        if let Some(p) = peers.get(node) {
            return Some((p.peer, p.lease));
        }
        let now = Instant::now();
        if now >= deadline {
            return None;
        }
        peers = s
            .peers_changed
            .wait_timeout(peers, deadline - now)
            .unwrap_or_else(|p| p.into_inner())
            .0;
    }
}

/// A failed AscendAllocResponse: the reply to frames that cannot be served.
fn failed_reply() -> Vec<u8> {
    Message::AscendAllocResponse(AscendAllocResponse {
        already_sent_indexes: Vec::new(),
        remote_indexes: Vec::new(),
        remote_buffer_uuids: Vec::new(),
        alloc_failed: true,
    })
    .encode()
}

/// Allocates the pages for the new keys of a message outside the store
/// lock, waiting up to the backoff TTL for pages to come back; the store
/// then takes them (all or nothing) in its own bookkeeping.
fn preallocate(s: &Shared, metas: &[ChunkMeta]) -> Result<Vec<MemObj>, MemoryError> {
    if metas.is_empty() {
        return Ok(Vec::new());
    }
    s.alloc
        .allocate_batch_until(metas, Instant::now() + s.config.alloc_fail_backoff_ttl)
}

fn alloc_loop(s: &Arc<Shared>, rep: zmq::Socket) {
    while !s.stop.load(Ordering::Acquire) {
        let frame = match rep.recv_bytes(0) {
            Ok(f) => f,
            Err(zmq::Error::EAGAIN) | Err(zmq::Error::EINTR) => continue,
            Err(e) => {
                log::warn!("allocation socket failed: {e}");
                break;
            }
        };
        let (reply, after) = handle_frame(s, &frame);
        if let Err(e) = rep.send(reply, 0) {
            log::warn!("could not reply on the allocation socket: {e}");
        }
        // Work that must follow the reply (ack always before Done / reads).
        for d in after.dones {
            send_done(s, d);
        }
        if let Some(read) = after.read {
            start_eager_read(s, read);
        }
    }
}

#[derive(Default)]
struct AfterReply {
    dones: Vec<SendPullDone>,
    read: Option<(EagerRead, PeerId)>,
}

fn handle_frame(s: &Shared, frame: &[u8]) -> (Vec<u8>, AfterReply) {
    let mut after = AfterReply::default();
    let msg = match Message::decode(frame) {
        Ok(m) => m,
        Err(e) => {
            if s.counters.bump(MessageKind::Malformed) == 0 {
                log::warn!("malformed frame on the allocation socket: {e} (replied alloc_failed; logged once)");
            }
            return (failed_reply(), after);
        }
    };
    let now = Instant::now();
    let layout = s.config.chunk_layout();
    match msg {
        Message::AllocRequest(req) if s.mode == TransferMode::Push => {
            s.counters.bump(MessageKind::AllocRequest);
            let pages = check_alloc_request(&req, &layout).ok().map(|checked| {
                let part = lock(&s.store).partition(&req.keys);
                let metas: Vec<ChunkMeta> = part.new.iter().map(|&i| checked.metas[i]).collect();
                preallocate(s, &metas)
            });
            let reply = lock(&s.store).on_alloc_request(&req, "push", now, |metas| match pages {
                Some(Ok(p)) if p.len() == metas.len() => Ok(p),
                Some(Err(e)) => Err(e),
                _ => s.alloc.allocate_batch(metas),
            });
            note_verdict(s, &reply.verdict);
            after.dones = reply.done;
            s.counters.bump(MessageKind::AllocResponse);
            (Message::AscendAllocResponse(reply.response).encode(), after)
        }
        Message::PullReadyNotif(notif) if s.mode.is_pull() => {
            s.counters.bump(MessageKind::PullReadyNotif);
            let link = attached_peer(s, &notif.sender_id);
            let Some((peer, lease)) = link else {
                if s.counters.bump(MessageKind::Rejected) == 0 {
                    log::warn!("PullReadyNotif from {} which never completed a handshake (refused; logged once)", notif.sender_id);
                }
                return (failed_ack(), after);
            };
            let reply = if s.mode == TransferMode::PullEager {
                let pages = check_pull_notif(&notif, &layout).ok().map(|checked| {
                    let part = lock(&s.store).partition(&notif.keys);
                    let metas: Vec<ChunkMeta> =
                        part.new.iter().map(|&i| checked.metas[i]).collect();
                    preallocate(s, &metas)
                });
                lock(&s.store).on_pull_eager(&notif, now, lease, |metas| match pages {
                    Some(Ok(p)) if p.len() == metas.len() => Ok(p),
                    Some(Err(e)) => Err(e),
                    _ => s.alloc.allocate_batch(metas),
                })
            } else {
                lock(&s.store).on_pull_delay(&notif, now, lease)
            };
            note_verdict(s, &reply.verdict);
            after.dones = reply.done;
            after.read = reply.read.map(|r| (r, peer));
            s.counters.bump(MessageKind::PullReadyDoneAck);
            (Message::PullReadyDoneAck(reply.ack).encode(), after)
        }
        other => {
            if s.counters.bump(MessageKind::Malformed) == 0 {
                log::warn!("{} does not belong on a {} receiver's allocation socket (replied alloc_failed; logged once)",
                    other.message_type(),
                    s.mode
                );
            }
            let reply = match other {
                Message::PullReadyNotif(_) => failed_ack(),
                _ => failed_reply(),
            };
            (reply, after)
        }
    }
}

fn failed_ack() -> Vec<u8> {
    Message::PullReadyDoneAck(crate::protocol::PullReadyDoneAck {
        already_sent_indexes: Vec::new(),
        alloc_failed: true,
    })
    .encode()
}

fn note_verdict(s: &Shared, v: &crate::protocol::Verdict) {
    match v {
        crate::protocol::Verdict::Accepted { .. } => {}
        crate::protocol::Verdict::AllocFailed(e) => {
            log::warn!("allocation failed, replied alloc_failed: {e}");
        }
        crate::protocol::Verdict::Rejected(e) => {
            if s.counters.bump(MessageKind::Rejected) == 0 {
                log::warn!("rejected a message: {e} (logged once)");
            }
        }
    }
}

/// Reads an eager pull's chunks on its own thread, so a slow sender never
/// holds up the allocation socket or other senders' reads.
fn start_eager_read(s: &Arc<Shared>, (read, peer): (EagerRead, PeerId)) {
    let s2 = Arc::clone(s);
    let spawned = std::thread::Builder::new()
        .name("pd-eager-read".into())
        .spawn(move || {
            let EagerRead {
                pull_id,
                read_by,
                items,
                ..
            } = read;
            let bytes: u64 = items.iter().map(|i| i.bytes as u64).sum();
            // The ops take the pages over: once the channel is done with them
            // the store holds the only references (no clone outlives the read).
            let ops: Vec<TransferOp> = items
                .into_iter()
                .map(|i| TransferOp {
                    local: i.local,
                    remote: i.remote,
                    len: i.bytes,
                })
                .collect();
            let budget = read_by.saturating_duration_since(Instant::now());
            let ok = match s2.channel.submit_read(peer, ops) {
                Ok(mut c) => match c.wait_timeout(budget) {
                    Some(Ok(())) => true,
                    Some(Err(e)) => {
                        log::warn!("eager read of pull {} failed: {e}", pull_id);
                        false
                    }
                    None => {
                        // The lease ran out: drop the keys; the sender keeps
                        // its pages until the lease anyway.
                        log::warn!(
                            "eager read of pull {} did not finish within its lease",
                            pull_id
                        );
                        false
                    }
                },
                Err(e) => {
                    log::warn!("eager read of pull {} could not start: {e}", pull_id);
                    false
                }
            };
            if ok {
                s2.counters.add_bytes(bytes);
            } else {
                s2.counters.bump(MessageKind::TransferError);
            }
            let done = lock(&s2.store).on_read_complete(&pull_id, ok);
            s2.landed.notify_all();
            if let Some(d) = done {
                send_done(&s2, d);
            }
        });
    if let Err(e) = spawned {
        log::warn!("cannot start an eager read thread: {e}");
    }
}

fn sweep_loop(s: &Shared) {
    while !s.stop.load(Ordering::Acquire) {
        std::thread::sleep(Duration::from_millis(200));
        let report = lock(&s.store).sweep(Instant::now());
        for k in &report.reclaimed_pushes {
            log::warn!("push of {k} never landed; its page was reclaimed");
        }
        for d in report.done {
            send_done(s, d);
        }
    }
}

// ------------------------------------------------------------------ load

/// One key of a load: its place in the request and its tokens' slots.
#[derive(Clone, Debug)]
struct LoadItem {
    index: usize,
    key: String,
    slots: Range<usize>,
}

/// The proxies of one sender in a load.
struct SenderGroup {
    sender_id: String,
    items: Vec<(LoadItem, ProxyEntry)>,
}

fn key_failure(key: &str, proxy: Option<&ProxyEntry>, reason: impl Into<String>) -> KeyFailure {
    KeyFailure {
        key: key.to_owned(),
        pull_id: proxy.map(|p| p.handle.pull_id.clone()),
        sender_id: proxy.map(|p| p.sender_id.clone()),
        reason: reason.into(),
    }
}

/// Discards the proxy of `key` if it is still stored (its pull's Done may
/// follow); returns whether a Done was sent.
fn discard_proxy(s: &Shared, key: &str) -> bool {
    let removed = {
        let mut store = lock(&s.store);
        if store.state(key) == Some(KeyState::Proxy) {
            store.remove(key)
        } else {
            None
        }
    };
    match removed.and_then(|r| r.done) {
        Some(d) => {
            send_done(s, d);
            true
        }
        None => false,
    }
}

#[derive(Default)]
struct LoadTally {
    loaded: Vec<usize>,
    failed: Vec<KeyFailure>,
    scatter: ScatterStats,
    bytes_read: u64,
    dones: usize,
    batches: usize,
    resident: usize,
    proxies: usize,
}

fn load_keys(
    s: &Shared,
    keys: &[String],
    slot_mapping: &[i64],
    cache: &mut KvCache,
    opts: &LoadOptions,
) -> Result<LoadReport, LoadError> {
    let start = Instant::now();
    let layout = s.config.chunk_layout();
    cache.spec().check_layout(&layout)?;
    // Every slot is checked once here, so no copy can fail on one later.
    plan::token_runs(slot_mapping, cache.spec().slots())?;

    // Classify under one lock; nothing changes until the input is validated.
    let mut tally = LoadTally::default();
    let mut resident: Vec<(LoadItem, MemObj)> = Vec::new();
    let mut groups: Vec<SenderGroup> = Vec::new();
    let mut expired = Vec::new();
    {
        let store = lock(&s.store);
        let now = Instant::now();
        for (index, key) in keys.iter().enumerate() {
            let first = index * layout.tokens;
            let item = |tokens: usize| LoadItem {
                index,
                key: key.clone(),
                slots: first..first + tokens,
            };
            match store.get(key, now) {
                Lookup::Resident(m) => resident.push((item(m.tokens()), m.clone())),
                Lookup::Proxy(p) => {
                    let entry = (item(p.tokens()), p.clone());
                    match groups.iter_mut().find(|g| g.sender_id == p.sender_id) {
                        Some(g) => g.items.push(entry),
                        None => groups.push(SenderGroup {
                            sender_id: p.sender_id.clone(),
                            items: vec![entry],
                        }),
                    }
                }
                Lookup::NotReady => {
                    tally
                        .failed
                        .push(key_failure(key, None, "its data has not landed yet"))
                }
                Lookup::Expired => {
                    tally
                        .failed
                        .push(key_failure(key, None, "its pull lease expired"));
                    expired.push(key.clone());
                }
                Lookup::Missing => tally.failed.push(key_failure(key, None, "not stored")),
            }
        }
    }
    let items = resident
        .iter()
        .map(|(i, _)| i)
        .chain(groups.iter().flat_map(|g| g.items.iter().map(|(i, _)| i)));
    for i in items {
        if i.slots.end > slot_mapping.len() {
            return Err(LoadError::SlotMappingTooShort {
                key: i.key.clone(),
                index: i.index,
                start: i.slots.start,
                end: i.slots.end,
                len: slot_mapping.len(),
            });
        }
    }
    for k in &expired {
        tally.dones += usize::from(discard_proxy(s, k));
    }

    // The pools, sized for the largest sender group.
    let largest = groups.iter().map(|g| g.items.len()).max().unwrap_or(0);
    let mut pipe = None;
    if largest > 0 {
        let deadline = Instant::now() + s.config.alloc_fail_backoff_ttl;
        match allocate_pools(
            s.alloc.primary(),
            ChunkMeta::full(layout),
            largest,
            opts.max_depth,
            deadline,
        ) {
            Ok((pages, depth)) => pipe = PingPongPipeline::new(pages, depth),
            Err(e) => {
                let reason = format!("no pages to read into: {e}");
                for g in groups.drain(..) {
                    for (item, proxy) in g.items {
                        tally.dones += usize::from(discard_proxy(s, &item.key));
                        tally
                            .failed
                            .push(key_failure(&item.key, Some(&proxy), reason.clone()));
                    }
                }
            }
        }
    }

    std::thread::scope(|scope| {
        let mut lane = ScatterLane::new(scope, &mut *cache, slot_mapping);
        scatter_resident(&mut lane, &resident, opts, &mut tally);
        if let Some(pipe) = &pipe {
            for g in &groups {
                load_group(s, pipe, g, &mut lane, &mut tally);
            }
        }
    });

    let mut loaded = tally.loaded;
    loaded.sort_unstable();
    let report = LoadReport {
        loaded: loaded.into_iter().map(|i| keys[i].clone()).collect(),
        resident: tally.resident,
        proxies: tally.proxies,
        senders: groups.len(),
        depth: pipe.as_ref().map_or(0, PingPongPipeline::depth),
        pools: pipe.as_ref().map_or(0, PingPongPipeline::pools),
        micro_batches: tally.batches,
        peak_buffer_bytes: pipe.as_ref().map_or(0, PingPongPipeline::buffer_bytes),
        bytes_read: tally.bytes_read,
        bytes_scattered: tally.scatter.bytes as u64,
        copies: tally.scatter.copies as u64,
        dones_sent: tally.dones,
        elapsed: start.elapsed(),
    };
    // The pools go back before the caller sees the result.
    drop(pipe);
    if tally.failed.is_empty() {
        Ok(report)
    } else {
        let mut failed = tally.failed;
        let pos = |k: &str| keys.iter().position(|x| x == k).unwrap_or(usize::MAX);
        failed.sort_by_key(|f| pos(&f.key));
        Err(LoadError::Incomplete {
            failed,
            report: Box::new(report),
        })
    }
}

/// Scatters resident chunks from their own pages, `max_depth` per batch.
fn scatter_resident(
    lane: &mut ScatterLane<'_>,
    resident: &[(LoadItem, MemObj)],
    opts: &LoadOptions,
    tally: &mut LoadTally,
) {
    let mut tickets = Vec::new();
    for batch in resident.chunks(opts.max_depth.max(1)) {
        let items = batch
            .iter()
            .map(|(i, page)| ScatterItem {
                page: page.clone(),
                tokens: page.tokens(),
                slots: i.slots.clone(),
            })
            .collect();
        tickets.push((batch, lane.submit(items)));
    }
    for (batch, ticket) in tickets {
        match ticket.and_then(|t| lane.finish(t)) {
            Ok(st) => {
                tally.scatter.copies += st.copies;
                tally.scatter.bytes += st.bytes;
                tally.loaded.extend(batch.iter().map(|(i, _)| i.index));
                tally.resident += batch.len();
            }
            Err(e) => tally.failed.extend(
                batch
                    .iter()
                    .map(|(i, _)| key_failure(&i.key, None, e.clone())),
            ),
        }
    }
}

/// Runs one sender's proxies through the pipeline, then resolves every
/// proxy it did not consume.
fn load_group(
    s: &Shared,
    pipe: &PingPongPipeline,
    g: &SenderGroup,
    lane: &mut ScatterLane<'_>,
    tally: &mut LoadTally,
) {
    let peer = attached_peer(s, &g.sender_id).map(|p| p.0).ok_or_else(|| {
        format!(
            "sender {} is not attached (it never completed a handshake, or went away)",
            g.sender_id
        )
    });
    let mut io = ProxyIo {
        s,
        peer,
        items: &g.items,
        began: vec![None; g.items.len()],
        lane,
        tally,
    };
    let run = pipe.run(g.items.len(), &mut io);
    let ProxyIo {
        mut began, tally, ..
    } = io;
    tally.batches += run.batches;
    for (j, outcome) in run.outcomes.into_iter().enumerate() {
        let (item, proxy) = &g.items[j];
        let reason = match outcome {
            ItemOutcome::Scattered => continue,
            ItemOutcome::Failed(e) => e,
            ItemOutcome::NotStarted => format!(
                "not read: an earlier micro-batch from sender {} failed",
                g.sender_id
            ),
        };
        // A pinned proxy ends its read as failed (discarded once no read is
        // in flight); an unpinned one is discarded. Either way its pull's
        // Done still goes out once all its proxies are resolved.
        let done = match began[j].take() {
            Some(p) => lock(&s.store).end_proxy_read(&p.handle, ReadOutcome::Failed),
            None => {
                tally.dones += usize::from(discard_proxy(s, &item.key));
                None
            }
        };
        if let Some(d) = done {
            send_done(s, d);
            tally.dones += 1;
        }
        tally
            .failed
            .push(key_failure(&item.key, Some(proxy), reason));
    }
}

/// The pipeline's I/O for one sender: proxy pins, channel reads, scatters
/// through the lane, and consumption once scattered.
struct ProxyIo<'l, 'a> {
    s: &'l Shared,
    peer: Result<PeerId, String>,
    items: &'l [(LoadItem, ProxyEntry)],
    /// The proxy as pinned by `begin_proxy_read`, until its read is ended.
    began: Vec<Option<ProxyEntry>>,
    lane: &'l mut ScatterLane<'a>,
    tally: &'l mut LoadTally,
}

impl PipelineIo for ProxyIo<'_, '_> {
    /// The completion, the lease end of the batch, and its bytes.
    type Read = (Completion, Instant, u64);
    type Scatter = ScatterTicket;

    fn start_read(&mut self, b: &MicroBatch, pages: &[MemObj]) -> Result<Self::Read, String> {
        let peer = self.peer.clone()?;
        let now = Instant::now();
        let mut ops = Vec::with_capacity(b.len());
        let mut lease_end = None::<Instant>;
        {
            let mut store = lock(&self.s.store);
            for (j, page) in b.items.clone().zip(pages) {
                let p = store
                    .begin_proxy_read(&self.items[j].0.key, now)
                    .map_err(|e| e.to_string())?;
                lease_end = Some(lease_end.map_or(p.lease_deadline, |d| d.min(p.lease_deadline)));
                ops.push(TransferOp {
                    local: page.clone(),
                    remote: p.remote,
                    len: p.byte_len(),
                });
                self.began[j] = Some(p);
            }
        }
        let bytes = ops.iter().map(|o| o.len as u64).sum();
        let c = self.s.channel.submit_read(peer, ops).map_err(|e| {
            self.s.counters.bump(MessageKind::TransferError);
            format!("read from {peer}: {e}")
        })?;
        Ok((c, lease_end.unwrap_or(now), bytes))
    }

    fn finish_read(&mut self, b: &MicroBatch, read: Self::Read) -> Result<(), String> {
        let (mut c, lease_end, bytes) = read;
        let budget = lease_end.saturating_duration_since(Instant::now());
        let r = match c.wait_timeout(budget) {
            Some(Ok(())) => {
                self.s.counters.add_bytes(bytes);
                self.tally.bytes_read += bytes;
                return Ok(());
            }
            Some(Err(e)) => format!("read of micro-batch {} failed: {e}", b.index),
            // The op still holds its pages, so they return to the pool only
            // when the channel is done with them.
            None => format!(
                "read of micro-batch {} did not finish within the pull's lease",
                b.index
            ),
        };
        self.s.counters.bump(MessageKind::TransferError);
        Err(r)
    }

    fn start_scatter(&mut self, b: &MicroBatch, pages: &[MemObj]) -> Result<ScatterTicket, String> {
        let items = b
            .items
            .clone()
            .zip(pages)
            .map(|(j, page)| ScatterItem {
                page: page.clone(),
                tokens: self.began[j].as_ref().map_or(0, ProxyEntry::tokens),
                slots: self.items[j].0.slots.clone(),
            })
            .collect();
        self.lane.submit(items)
    }

    fn finish_scatter(&mut self, _b: &MicroBatch, t: ScatterTicket) -> Result<(), String> {
        let st = self.lane.finish(t)?;
        self.tally.scatter.copies += st.copies;
        self.tally.scatter.bytes += st.bytes;
        Ok(())
    }

    fn scattered(&mut self, b: &MicroBatch) {
        for j in b.items.clone() {
            let Some(p) = self.began[j].take() else {
                continue;
            };
            self.tally.loaded.push(self.items[j].0.index);
            self.tally.proxies += 1;
            let done = lock(&self.s.store).end_proxy_read(&p.handle, ReadOutcome::Consumed);
            if let Some(d) = done {
                send_done(self.s, d);
                self.tally.dones += 1;
            }
        }
    }
}
