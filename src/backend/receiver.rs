//! The decode side: serves handshakes and allocation requests, stores
//! chunks (resident or as pull-delay proxies) and sends PullDoneSignal.

use super::counters::{MessageCounters, MessageKind};
use super::zmq_io::PushPool;
use super::{pd_log, BackendError};
use crate::channel::handshake::{HandshakeEvent, HandshakeServer, Hello};
use crate::channel::{self, PeerId, TransferChannel, TransferOp};
use crate::config::{PdConfig, Role, TransferMode};
use crate::memory::{
    ChunkMeta, DualAllocator, DualSpec, DualStats, MemObj, MemoryError, NpuRuntime,
};
use crate::protocol::{
    check_alloc_request, check_pull_notif, AscendAllocResponse, EagerRead, KeyState, KeyStore,
    Lookup, Message, ReadOutcome, ReceiverConfig, ReceiverCounters, SendPullDone,
};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
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

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// How long a pushed chunk may stay unwritten before its pages are reclaimed.
const PUSH_LANDING_TIMEOUT: Duration = Duration::from_secs(30);

impl Receiver {
    /// Starts a receiver for TP rank `rank` (role must be receiver): binds
    /// `pd_peer_init_port[rank]` and `pd_peer_alloc_port[rank]` on `pd_peer_host`.
    pub fn start(
        config: &PdConfig,
        rank: usize,
        npu: Option<&dyn NpuRuntime>,
    ) -> Result<Receiver, BackendError> {
        if config.role != Role::Receiver {
            return Err(BackendError::Setup(
                "pd_role: Receiver::start needs pd_role: receiver".into(),
            ));
        }
        config.validate().map_err(|problems| {
            BackendError::Setup(
                problems
                    .iter()
                    .map(|p| p.to_string())
                    .collect::<Vec<_>>()
                    .join("; "),
            )
        })?;
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
        let alloc = DualAllocator::new(&DualSpec::from_config(config, rank as u32), npu)?;
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

fn spawn(name: &str, f: impl FnOnce() + Send + 'static) -> Result<JoinHandle<()>, BackendError> {
    std::thread::Builder::new()
        .name(name.into())
        .spawn(f)
        .map_err(|e| BackendError::Setup(format!("spawning {name}: {e}")))
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
                pd_log!(debug, "sender {} attached as {}", a.remote.node, a.peer);
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
                pd_log!(
                    warn,
                    "refused a handshake from {}: {error}",
                    node.as_deref().unwrap_or("an unreadable peer")
                );
            }
            Ok(HandshakeEvent::Landed { node, refs }) => {
                let report = lock(&s.store).mark_landed_refs(&refs);
                if !report.not_pending.is_empty() {
                    pd_log!(
                        warn,
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
            Err(zmq::Error::EAGAIN) => continue,
            Err(e) => {
                pd_log!(warn, "allocation socket failed: {e}");
                break;
            }
        };
        let (reply, after) = handle_frame(s, &frame);
        if let Err(e) = rep.send(reply, 0) {
            pd_log!(warn, "could not reply on the allocation socket: {e}");
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
                pd_log!(warn, "malformed frame on the allocation socket: {e} (replied alloc_failed; logged once)");
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
                    pd_log!(warn, "PullReadyNotif from {} which never completed a handshake (refused; logged once)", notif.sender_id);
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
                pd_log!(
                    warn,
                    "{} does not belong on a {} receiver's allocation socket (replied alloc_failed; logged once)",
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
            pd_log!(warn, "allocation failed, replied alloc_failed: {e}");
        }
        crate::protocol::Verdict::Rejected(e) => {
            if s.counters.bump(MessageKind::Rejected) == 0 {
                pd_log!(warn, "rejected a message: {e} (logged once)");
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
            let bytes: u64 = read.items.iter().map(|i| i.bytes as u64).sum();
            let ops: Vec<TransferOp> = read
                .items
                .iter()
                .map(|i| TransferOp {
                    local: i.local.clone(),
                    remote: i.remote,
                    len: i.bytes,
                })
                .collect();
            let budget = read.read_by.saturating_duration_since(Instant::now());
            let ok = match s2.channel.submit_read(peer, ops) {
                Ok(mut c) => match c.wait_timeout(budget) {
                    Some(Ok(())) => true,
                    Some(Err(e)) => {
                        pd_log!(warn, "eager read of pull {} failed: {e}", read.pull_id);
                        false
                    }
                    None => {
                        // The lease ran out: drop the keys; the sender keeps
                        // its pages until the lease anyway.
                        pd_log!(
                            warn,
                            "eager read of pull {} did not finish within its lease",
                            read.pull_id
                        );
                        false
                    }
                },
                Err(e) => {
                    pd_log!(
                        warn,
                        "eager read of pull {} could not start: {e}",
                        read.pull_id
                    );
                    false
                }
            };
            if ok {
                s2.counters.add_bytes(bytes);
            } else {
                s2.counters.bump(MessageKind::TransferError);
            }
            let done = lock(&s2.store).on_read_complete(&read.pull_id, ok);
            s2.landed.notify_all();
            if let Some(d) = done {
                send_done(&s2, d);
            }
        });
    if let Err(e) = spawned {
        pd_log!(warn, "cannot start an eager read thread: {e}");
    }
}

fn sweep_loop(s: &Shared) {
    while !s.stop.load(Ordering::Acquire) {
        std::thread::sleep(Duration::from_millis(200));
        let report = lock(&s.store).sweep(Instant::now());
        for k in &report.reclaimed_pushes {
            pd_log!(warn, "push of {k} never landed; its page was reclaimed");
        }
        for d in report.done {
            send_done(s, d);
        }
    }
}
