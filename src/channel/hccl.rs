//! `hccl`: HCCL one-sided put/get between Ascend devices, through ascend-sys.
//!
//! One two-rank communicator per peer pair. Every local pool is registered
//! on it (NPU pools as device memory, CPU pools as ACL-pinned host memory;
//! HCCL takes nothing else), the descriptors are exchanged, the peer's
//! regions enabled, and batches become one `HcclBatchPut` (write) or
//! `HcclBatchGet` (read) on a per-peer stream. Remote addresses are the
//! peer's `base + page * page_size` from its buffer table, after
//! the shared op check bounds-checked them and setup checked that the regions the
//! peer enabled cover its whole table.
//!
//! **Ranks and the handshake.** The connecting side (a sender, in
//! [`handshake::connect`](super::handshake::connect)) makes a fresh root
//! info for each connection ([`TransferChannel::offer`]) and is rank 0, as
//! HCCL wants rank 0 in the process that made the root info. The listening
//! side is rank 1; its answer echoes the offer's session.
//!
//! **No deadlock.** Communicator init and descriptor exchange are
//! collectives that block until both ranks call them, and the listening
//! side attaches *before* it replies, so neither side may run them inside
//! [`TransferChannel::attach`]. Attach only validates, records the peer and
//! starts the setup (liveness link → init → register every pool → exchange
//! → enable access → check coverage → stream) on a thread, returning the
//! [`PeerId`] at once. [`TransferChannel::wait_ready`] (called by
//! `handshake::connect`) and every submit wait for that setup, bounded by
//! [`HcclOptions::setup_timeout`], and report its failure.
//!
//! **Dead peers.** HCCL gives no per-peer liveness, and the emulator's
//! one-sided copies even succeed into a dead peer's still-mapped memory. So
//! each peer pair also holds a small TCP *liveness link* (rank 0 connects
//! to the listener named in the endpoint; keepalive on): its closing means
//! the peer process exited or detached. A batch is refused if the link is
//! closed, and a batch that completes after the link closed is reported as
//! [`ChannelError::PeerGone`]. Waits on the stream are sliced and bounded
//! ([`HcclOptions::batch_timeout`], and [`HcclOptions::gone_grace`] after
//! the peer is seen gone). With a deployment secret the link's hello
//! carries a proof over its session and root info, and the listener takes
//! no link without it (see `route_watch`). A batch abandoned while the device may still be
//! copying is reported failed at once, but keeps its pages, quarantined,
//! until the stream finishes them (never freed under DMA).
//!
//! **Closing is a promise.** A side closes its end of the liveness link
//! (half-close: it keeps reading the other end) only when its `Link` is
//! dropped, which is after every batch that used it has left the stream.
//! So the peer closing its end proves it can no longer touch our memory:
//! that is when a revoked grant is quiescent (the peer's process exiting
//! closes it too). Nothing else can prove it: HCCL cannot refuse a peer's
//! one-sided access.
//!
//! Nothing here has run on Ascend hardware; it is tested against the CANN
//! emulator (`ascend-sys/emu`).

use super::grant::GrantTable;
use super::{
    bind_listener, check_grant_pages, check_ops, pages_of, table_of, watch_ops, Access, BufferDesc,
    ChannelError, Completion, CompletionSender, DirectRead, DirectRegistration, Endpoint, GrantId,
    GrantStats, GrantTag, LocalPage, OpKind, PeerId, PeerPages, PeerRegistry, PeerTable, ReadOp,
    TransferChannel, TransferOp, WriteOp,
};
use crate::auth::{Proof, Secret, Step, PROOF_LEN};
use crate::config::ChannelKind;
use crate::memory::npu::{device_buffer, device_of, pinned_buffer};
use crate::memory::{BufferRef, DeviceKind, MemObj, PagePool, SealedMemObj};
use ascend_sys::{
    Comm, Device, DeviceBuffer, HostBuffer, MemKind, OneSidedOp, RegisteredMem, RemoteMem,
    RootInfo, Stream,
};
use crossbeam_channel::{Receiver, Sender};
use std::collections::{HashMap, HashSet};
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use uuid::Uuid;

/// Most peer descriptors accepted in one exchange (a worker has two pools).
const MAX_REMOTE_DESCS: usize = 64;
/// First bytes on a liveness link: magic, a flag byte, 3 pad bytes, the
/// session; with a deployment secret the flag is [`WATCH_PROVEN`] and the
/// proof ([`watch_proof`]) follows. Without one the flag is 0 and nothing
/// follows (the wire of before).
const WATCH_MAGIC: &[u8; 4] = b"APDW";
/// Bytes of a liveness link's hello before its proof.
const WATCH_HELLO: usize = 16;
/// The flag byte of a hello whose proof follows.
const WATCH_PROVEN: u8 = 1;
/// How often a waiting batch looks at the liveness link.
const WAIT_SLICE: Duration = Duration::from_millis(20);

/// Tuning of the hccl channel.
#[derive(Clone, Debug)]
pub struct HcclOptions {
    /// Longest a peer's setup (liveness link, communicator init,
    /// registration, descriptor exchange) may take, counted from attach.
    pub setup_timeout: Duration,
    /// Longest one batch may run before it is reported as timed out.
    pub batch_timeout: Duration,
    /// How long a running batch may still finish after its peer was seen gone.
    pub gone_grace: Duration,
}

impl Default for HcclOptions {
    fn default() -> Self {
        HcclOptions {
            setup_timeout: Duration::from_secs(60),
            batch_timeout: Duration::from_secs(60),
            gone_grace: Duration::from_secs(2),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn npu_err(context: String) -> impl FnOnce(ascend_sys::Error) -> ChannelError {
    move |source| ChannelError::Npu { context, source }
}

/// A local pool as HCCL registers it.
#[derive(Clone)]
enum LocalMem {
    Device(Arc<DeviceBuffer>),
    Host(Arc<HostBuffer>),
}

/// The hccl channel of one worker: its pools, its liveness listener, its peers.
pub struct HcclChannel {
    // Dropped first: stops routing liveness links to peers.
    watch: WatchServer,
    device: Device,
    pools: Vec<Arc<PagePool>>,
    local: Vec<LocalMem>,
    local_uuids: HashSet<Uuid>,
    opts: HcclOptions,
    offers: Mutex<HashMap<u64, (RootInfo, Instant)>>,
    peers: PeerRegistry<HcclPeer>,
    grants: GrantTable<Arc<SetupCell>>,
    auth: Option<Secret>,
    /// This instance, for direct registrations ([`TransferChannel::direct_registry`]).
    id: u64,
    direct: Arc<Mutex<DirectState>>,
}

/// Instances made so far (their ids).
static INSTANCES: AtomicU64 = AtomicU64::new(0);

/// Memory registered for direct reads (KV caches), and the links it is
/// registered on. Each link registers a region on its communicator the
/// first time it reads into registered memory; dropping a region's
/// registration deregisters it on every such link. One lock, always taken
/// before a link's `direct`, orders both.
#[derive(Default)]
struct DirectState {
    next: u64,
    regions: Vec<DirectRegion>,
    links: Vec<Weak<Link>>,
}

#[derive(Clone, Copy, Debug)]
struct DirectRegion {
    id: u64,
    addr: usize,
    len: usize,
}

impl DirectRegion {
    fn holds(&self, addr: usize, len: usize) -> bool {
        self.addr <= addr
            && addr
                .checked_add(len)
                .is_some_and(|e| e <= self.addr + self.len)
    }
}

/// What a [`DirectRegistration`] of this channel holds: dropping it
/// forgets its regions and deregisters them from every link.
struct DirectHold {
    // Strong: links (an abandoned batch's, say) can outlive the channel,
    // and their registrations must still go with the memory.
    state: Arc<Mutex<DirectState>>,
    ids: Vec<u64>,
}

impl Drop for DirectHold {
    fn drop(&mut self) {
        let mut st = lock(&self.state);
        st.regions.retain(|r| !self.ids.contains(&r.id));
        st.links.retain(|l| l.strong_count() > 0);
        for link in st.links.iter().filter_map(Weak::upgrade) {
            // A direct read holds `&` to the memory for its whole call, so
            // none is in flight here: deregistering is safe.
            lock(&link.direct).retain(|(id, _)| !self.ids.contains(id));
        }
    }
}

struct HcclPeer {
    node: String,
    table: PeerTable,
    setup: Arc<SetupCell>,
}

impl HcclChannel {
    /// A channel over `pools` (every one allocated by the ACL runtime, all
    /// for one NPU); the liveness listener binds `host`.
    pub fn new(
        host: &str,
        pools: &[Arc<PagePool>],
        opts: HcclOptions,
    ) -> Result<HcclChannel, ChannelError> {
        let mut local = Vec::new();
        let mut device: Option<Device> = None;
        for p in pools {
            let b = p.buffer();
            // SAFETY: registered with a peer's communicator, which reads or
            // writes a page only under a grant of it (or in a batch holding
            // its handle); revoked grants wait for quiescence before the
            // page goes back to its pool.
            let mem = if let Some(d) = unsafe { device_buffer(b) } {
                LocalMem::Device(Arc::clone(d))
            } else if let Some(h) = unsafe { pinned_buffer(b) } {
                // SAFETY: as above.
                LocalMem::Host(Arc::clone(unsafe { h.buffer() }))
            } else {
                return Err(ChannelError::Unsupported(format!(
                    "the hccl channel registers pools allocated by the ACL runtime, but pool {} on {} \
                     is not (build the allocator with backend::pools::allocator_for, which pins \
                     the CPU pool for transfer_channel: hccl, or use transfer_channel: tcp)",
                    b.uuid().simple(),
                    b.device()
                )));
            };
            let d = device_of(b).expect("ACL-backed pools know their device");
            match &device {
                Some(first) if first.id() != d.id() => {
                    return Err(ChannelError::Unsupported(format!(
                        "hccl pools must belong to one NPU; found NPU {} and NPU {}",
                        first.id(),
                        d.id()
                    )))
                }
                Some(_) => {}
                None => device = Some(d),
            }
            local.push(mem);
        }
        let device = device.ok_or_else(|| {
            ChannelError::Unsupported("the hccl channel needs at least one pool".into())
        })?;
        let acl = device.acl();
        acl.hccl_status()
            .map_err(npu_err("loading HCCL for the hccl channel".into()))?;
        if !acl.one_sided_supported() {
            return Err(ChannelError::Unsupported(format!(
                "{} lacks the HCCL one-sided API (HcclRegisterMem ... HcclBatchGet); \
                 use a CANN release that has it, or transfer_channel: tcp",
                acl.hccl_library_path()
                    .map_or_else(|| "libhccl.so".into(), |p| p.display().to_string())
            )));
        }
        Ok(HcclChannel {
            watch: WatchServer::bind(host)?,
            device,
            local_uuids: pools.iter().map(|p| p.uuid()).collect(),
            pools: pools.to_vec(),
            local,
            opts,
            offers: Mutex::new(HashMap::new()),
            peers: PeerRegistry::default(),
            grants: GrantTable::default(),
            auth: None,
            id: INSTANCES.fetch_add(1, Ordering::Relaxed),
            direct: Arc::default(),
        })
    }

    /// Requires peers to prove they hold `secret` in the handshake (which
    /// carries the communicator's root info).
    pub fn with_auth(mut self, secret: Option<Secret>) -> HcclChannel {
        self.auth = secret;
        self
    }

    /// The NPU the communicators run on.
    pub fn device_id(&self) -> u32 {
        self.device.id()
    }

    fn peer(&self, id: PeerId) -> Result<Arc<HcclPeer>, ChannelError> {
        self.peers.get(id)
    }

    fn endpoint_with(&self, root_info: Vec<u8>, session: u64) -> Endpoint {
        Endpoint::Hccl {
            root_info,
            session,
            device: self.device.id(),
            watch: self.watch.addr.to_string(),
        }
    }
}

impl TransferChannel for HcclChannel {
    fn kind(&self) -> ChannelKind {
        ChannelKind::Hccl
    }

    fn link_path(&self) -> Option<super::LinkPath> {
        Some(super::LinkPath::Comm)
    }

    fn local_table(&self) -> Vec<BufferDesc> {
        table_of(&self.pools)
    }

    fn endpoint(&self) -> Endpoint {
        self.endpoint_with(Vec::new(), 0)
    }

    fn offer(&self) -> Result<Option<Endpoint>, ChannelError> {
        let root = self
            .device
            .hccl_root_info()
            .map_err(npu_err("creating an HCCL root info".into()))?;
        let session = Uuid::new_v4().as_u64_pair().0;
        let bytes = root.as_bytes().to_vec();
        let mut offers = lock(&self.offers);
        // Offers a peer refused are never answered; forget them eventually.
        let stale = self.opts.setup_timeout * 2;
        offers.retain(|_, (_, at)| at.elapsed() < stale);
        offers.insert(session, (root, Instant::now()));
        Ok(Some(self.endpoint_with(bytes, session)))
    }

    fn answer(&self, offered: &Endpoint) -> Option<Endpoint> {
        match offered {
            Endpoint::Hccl { session, .. } => Some(self.endpoint_with(Vec::new(), *session)),
            _ => None,
        }
    }

    fn attach(
        &self,
        node: &str,
        table: &[BufferDesc],
        endpoint: &Endpoint,
    ) -> Result<PeerId, ChannelError> {
        let Endpoint::Hccl {
            root_info,
            session,
            watch,
            ..
        } = endpoint
        else {
            return Err(ChannelError::Handshake(format!(
                "peer {node} did not send an hccl endpoint"
            )));
        };
        let table = PeerTable::new(table)?;
        let role = if root_info.is_empty() {
            // We connected and offered: the answer names our offer.
            let (root, _) = lock(&self.offers).remove(session).ok_or_else(|| {
                ChannelError::Handshake(format!(
                    "peer {node} answered hccl session {session:016x}, which this side never offered \
                     or already used (the connecting side must offer a root info: use handshake::connect)"
                ))
            })?;
            let addr = watch
                .to_socket_addrs()
                .ok()
                .and_then(|mut a| a.next())
                .ok_or_else(|| {
                    ChannelError::Handshake(format!("peer {node}: bad liveness address {watch:?}"))
                })?;
            // With a secret the link's hello proves it is ours: nobody
            // else can take the link the peer will trust as our liveness.
            let proof = self
                .auth
                .as_ref()
                .map(|s| watch_proof(s, *session, root.as_bytes(), watch));
            SetupRole::Root {
                root,
                watch: addr,
                session: *session,
                proof,
            }
        } else {
            let root = RootInfo::from_bytes(root_info).map_err(|e| {
                ChannelError::Handshake(format!("peer {node} sent a bad root info: {e}"))
            })?;
            let proof = self.auth.clone().map(|s| (s, root_info.clone()));
            SetupRole::Joiner {
                root,
                watch: self.watch.expect(*session, proof),
            }
        };
        let setup = Arc::new(SetupCell::new());
        let job = SetupJob {
            node: node.to_string(),
            device: self.device.clone(),
            local: self.local.clone(),
            table: table.clone(),
            role,
            opts: self.opts.clone(),
        };
        let cell = Arc::clone(&setup);
        std::thread::Builder::new()
            .name("pd-hccl-setup".into())
            .spawn(move || cell.finish(job.run()))
            .map_err(|source| ChannelError::Io {
                context: "spawning the hccl setup thread".into(),
                source,
            })?;
        let peer = Arc::new(HcclPeer {
            node: node.to_string(),
            table,
            setup,
        });
        let (id, replaced) = self.peers.insert(node, peer);
        for old in replaced {
            old.setup.close();
        }
        Ok(id)
    }

    fn detach(&self, peer: PeerId) {
        if let Some(p) = self.peers.remove(peer) {
            p.setup.close();
        }
    }

    fn gone_peers(&self) -> Vec<PeerId> {
        self.peers.select(|p| p.setup.peer_closed())
    }

    fn wait_ready(&self, peer: PeerId) -> Result<(), ChannelError> {
        let p = self.peer(peer)?;
        p.setup.wait(&p.node, self.opts.setup_timeout).map(|_| ())
    }

    fn submit_read(
        &self,
        peer: PeerId,
        ops: Vec<ReadOp>,
    ) -> Result<Completion<MemObj>, ChannelError> {
        self.submit(peer, OpKind::Read, ops)
    }

    fn submit_write(
        &self,
        peer: PeerId,
        tag: GrantTag,
        ops: Vec<WriteOp>,
    ) -> Result<Completion<SealedMemObj>, ChannelError> {
        // One-sided: the peer cannot check a tag; its quarantine of
        // revoked pages is what keeps a late write harmless.
        let _ = tag;
        self.submit(peer, OpKind::Write, ops)
    }

    fn reads_direct(&self, device: DeviceKind) -> bool {
        device == DeviceKind::Npu(self.device.id())
    }

    fn direct_registry(&self) -> Option<u64> {
        Some(self.id)
    }

    unsafe fn register_direct(
        &self,
        device: DeviceKind,
        regions: &[(usize, usize)],
    ) -> Result<Option<DirectRegistration>, ChannelError> {
        if !self.reads_direct(device) {
            return Err(ChannelError::Unsupported(format!(
                "hccl reads straight only into memory of NPU {} (its communicators' device), not \
                 {device}",
                self.device.id()
            )));
        }
        let mut st = lock(&self.direct);
        let total = self.local.len() + st.regions.len() + regions.len();
        if total > ascend_sys::REGISTRATION_LIMIT {
            return Err(ChannelError::Unsupported(format!(
                "{} region(s) for direct reads would make {total} HCCL registrations per \
                 communicator, more than the {} it accepts (allocate the KV cache as one tensor, \
                 or fewer)",
                regions.len(),
                ascend_sys::REGISTRATION_LIMIT
            )));
        }
        for &(addr, len) in regions {
            if len == 0 || addr.checked_add(len).is_none() {
                return Err(ChannelError::Unsupported(format!(
                    "cannot register {len} bytes at {addr:#x} for direct reads"
                )));
            }
            if let Some(r) = st
                .regions
                .iter()
                .find(|r| addr < r.addr + r.len && r.addr < addr + len)
            {
                return Err(ChannelError::Unsupported(format!(
                    "[{addr:#x}, +{len}) overlaps memory already registered for direct reads \
                     ([{:#x}, +{}]): is another KV cache over the same memory alive?",
                    r.addr, r.len
                )));
            }
        }
        let mut ids = Vec::with_capacity(regions.len());
        for &(addr, len) in regions {
            st.next += 1;
            let id = st.next;
            st.regions.push(DirectRegion { id, addr, len });
            ids.push(id);
        }
        Ok(Some(DirectRegistration::new(
            self.id,
            Box::new(DirectHold {
                state: Arc::clone(&self.direct),
                ids,
            }),
        )))
    }

    fn prepare_direct(&self, peer: PeerId) -> Result<(), ChannelError> {
        let p = self.peer(peer)?;
        let link = p.setup.wait(&p.node, self.opts.setup_timeout)?;
        self.register_on(&link)
    }

    /// One `HcclBatchGet` (split at the op limit) straight into registered
    /// device memory. Unlike tcp, a read cannot be given up at `deadline`:
    /// the device could still write into the cache afterwards, so the call
    /// waits for the stream to finish the batch (logging while it takes
    /// longer than the batch timeout) and the caller discards what
    /// finished past the lease.
    unsafe fn read_direct(
        &self,
        peer: PeerId,
        ops: &[DirectRead],
        deadline: Instant,
    ) -> Result<(), ChannelError> {
        let _ = deadline;
        let p = self.peer(peer)?;
        let regions = lock(&self.direct).regions.clone();
        let mut batch = Vec::with_capacity(ops.len());
        for (i, op) in ops.iter().enumerate() {
            let page = p.table.resolve_direct(i, op)?;
            if !regions.iter().any(|r| r.holds(op.dst, op.len)) {
                return Err(ChannelError::Unsupported(format!(
                    "direct read op {i}: [{:#x}, +{}) is not in memory registered with this hccl \
                     channel (register the KV cache: TransferChannel::register_direct)",
                    op.dst, op.len
                )));
            }
            batch.extend(one_sided(
                &p.table,
                op.remote,
                op.dst as u64,
                page + op.offset as u64,
                op.len,
            ));
        }
        if batch.is_empty() {
            return Ok(());
        }
        let link = p.setup.wait(&p.node, self.opts.setup_timeout)?;
        if let Err(detail) = link.watch.check() {
            return Err(ChannelError::PeerGone {
                peer: p.node.clone(),
                op: None,
                detail,
            });
        }
        if link.stuck.load(Ordering::SeqCst) {
            return Err(ChannelError::WorkerLost(format!(
                "the hccl stream to {} is stuck behind work given up unfinished; direct reads are \
                 not queued behind it (the peer must reconnect)",
                p.node
            )));
        }
        self.register_on(&link)?;
        let context = format!(
            "HcclBatchGet of {} direct op(s) from {}",
            batch.len(),
            p.node
        );
        // SAFETY: every local range is inside a region registered for
        // direct reads (checked above) and so on this communicator
        // (register_on); the caller owns that memory for the whole call
        // (read_direct's contract), and its registration is dropped only
        // with the memory's owner, which the caller borrows past this call.
        // Every remote range is inside a page of the peer's table, which
        // setup proved covered by regions enabled on this communicator. The
        // call returns only after the stream finished the batch.
        let done = match unsafe { link.comm.batch_get(&link.stream, &batch) } {
            Ok(d) => d,
            Err(source) => {
                if matches!(source, ascend_sys::Error::BatchInFlight { .. }) {
                    // Queued but untracked: wait for the whole stream.
                    settle(&link, &context);
                }
                return Err(npu_err(context)(source));
            }
        };
        let mut warn_at = Instant::now() + self.opts.batch_timeout;
        loop {
            match done.wait(WAIT_SLICE) {
                Ok(()) => break,
                Err(ascend_sys::Error::Timeout { .. }) => {
                    if Instant::now() >= warn_at {
                        log::warn!(
                            "{context} has not finished after {:?}; still waiting, as the device \
                             may yet write into the KV cache",
                            self.opts.batch_timeout
                        );
                        warn_at += self.opts.batch_timeout;
                    }
                }
                // What was queued has run; a later part was refused.
                Err(source @ ascend_sys::Error::BatchPartlyQueued { .. }) => {
                    return Err(npu_err(context)(source))
                }
                Err(source) => {
                    settle(&link, &context);
                    return Err(npu_err(context)(source));
                }
            }
        }
        link.watch.check().map_err(|d| ChannelError::PeerGone {
            peer: p.node.clone(),
            op: None,
            detail: format!("{d}; the direct read ran, but not with a live peer"),
        })
    }

    fn grant(
        &self,
        peer: PeerId,
        access: Access,
        tag: GrantTag,
        pages: &[BufferRef],
    ) -> Result<GrantId, ChannelError> {
        check_grant_pages(&self.pools, pages)?;
        let (node, p) = self.peers.entry(peer)?;
        Ok(self
            .grants
            .add(&node, access, tag, pages, Arc::clone(&p.setup)))
    }

    fn release(&self, grant: GrantId) -> bool {
        self.grants.release(grant)
    }

    fn revoke(&self, grant: GrantId) {
        self.grants.revoke(grant);
    }

    fn is_quiescent(&self, grant: GrantId) -> bool {
        self.grants
            .settle(grant, |e| e.read_only() || e.session.peer_cannot_access())
    }

    fn auth(&self) -> Option<&Secret> {
        self.auth.as_ref()
    }

    /// The pages of the peer's table once setup proved every buffer inside
    /// memory the peer registered with HCCL, no two overlapping; pending
    /// until then (a table alone is only what the peer says).
    fn verified_peer_pages(&self, peer: PeerId) -> PeerPages {
        let Ok(p) = self.peer(peer) else {
            return PeerPages::Verified(0);
        };
        match p.setup.ready() {
            None => PeerPages::Pending,
            Some(true) => PeerPages::Verified(super::table_pages(p.table.descs())),
            Some(false) => PeerPages::Verified(0),
        }
    }

    fn grant_stats(&self) -> GrantStats {
        GrantStats {
            unauthenticated: self.watch.shared.unproven.load(Ordering::Relaxed),
            ..self.grants.stats()
        }
    }
}

impl HcclChannel {
    /// Registers every direct-read region on `link`'s communicator that is
    /// not yet, and remembers the link for deregistration.
    fn register_on(&self, link: &Arc<Link>) -> Result<(), ChannelError> {
        let mut st = lock(&self.direct);
        // Known before anything is registered on it, so a failure part-way
        // leaves nothing a dropped registration cannot find.
        if !st.links.iter().any(|l| l.as_ptr() == Arc::as_ptr(link)) {
            st.links.retain(|l| l.strong_count() > 0);
            st.links.push(Arc::downgrade(link));
        }
        let mut have = lock(&link.direct);
        for r in &st.regions {
            if have.iter().any(|(id, _)| *id == r.id) {
                continue;
            }
            // SAFETY: register_direct's caller keeps the region allocated
            // device memory until its registration is dropped, and that
            // drop removes this entry (under the lock held here) first.
            let reg = unsafe {
                link.comm
                    .register_raw(MemKind::Device, r.addr as *mut std::ffi::c_void, r.len)
            }
            .map_err(npu_err(format!(
                "registering the KV cache ({} bytes at {:#x}) with HCCL for direct reads",
                r.len, r.addr
            )))?;
            have.push((r.id, reg));
        }
        Ok(())
    }

    fn submit<P: LocalPage>(
        &self,
        peer: PeerId,
        kind: OpKind,
        ops: Vec<TransferOp<P>>,
    ) -> Result<Completion<P>, ChannelError> {
        let p = self.peer(peer)?;
        let offsets = check_ops(&p.table, &ops, false)?;
        let mut batch = Vec::with_capacity(ops.len());
        for (i, (op, off)) in ops.iter().zip(&offsets).enumerate() {
            let pool = op.local.pool();
            if !self.local_uuids.contains(&pool.uuid()) {
                return Err(ChannelError::BadLocal {
                    op: i,
                    local: op.local.buffer_ref(),
                    reason: "its pool is not registered with this hccl channel (open the channel \
                             over every pool transfers use)"
                        .into(),
                });
            }
            batch.extend(one_sided(
                &p.table,
                op.remote,
                op.local.addr() + op.local_offset as u64,
                *off + op.remote_offset as u64,
                op.len,
            ));
        }
        if batch.is_empty() {
            return Ok(Completion::ready(Ok(()), pages_of(ops)));
        }
        let link = p.setup.wait(&p.node, self.opts.setup_timeout)?;
        if let Err(detail) = link.watch.check() {
            return Err(ChannelError::PeerGone {
                peer: p.node.clone(),
                op: None,
                detail,
            });
        }
        let (call, done) = match kind {
            OpKind::Write => (
                "HcclBatchPut",
                // SAFETY: every local range is inside a page (check_ops: len
                // <= page size) of a pool registered on this communicator
                // (local_uuids; setup registered every pool); every remote
                // range is inside a page of the peer's table, which setup
                // proved covered by regions enabled on this communicator.
                // The registrations and enabled regions live in `link`, and
                // the pages in `ops`; both are held by the in-flight entry
                // until the stream has finished the batch.
                unsafe { link.comm.batch_put(&link.stream, &batch) },
            ),
            OpKind::Read => (
                "HcclBatchGet",
                // SAFETY: as for the put; the local pages are owned by `ops`
                // and the protocol does not touch them until completion.
                unsafe { link.comm.batch_get(&link.stream, &batch) },
            ),
        };
        let context = format!("{call} of {} op(s) with {}", batch.len(), p.node);
        let done = match done {
            Ok(d) => d,
            // Queued but untracked: the device may still use these pages.
            // They stay quarantined for the life of the process rather
            // than go back to a pool under a transfer.
            Err(source @ ascend_sys::Error::BatchInFlight { .. }) => {
                let (tx, completion) = Completion::pending(watch_ops(&ops));
                let keep =
                    Box::new(Batch { ops, tx }).abandon(Err(ChannelError::Npu { context, source }));
                log::error!(
                    "hccl batch with {} could not be tracked; its pages stay quarantined",
                    p.node
                );
                std::mem::forget(keep);
                return Ok(completion);
            }
            Err(e) => return Err(npu_err(context)(e)),
        };
        let (tx, completion) = Completion::pending(watch_ops(&ops));
        let entry = InFlight {
            done,
            batch: Box::new(Batch { ops, tx }),
            link: Arc::clone(&link),
            count: batch.len(),
            deadline: Instant::now() + self.opts.batch_timeout,
        };
        if let Err(crossbeam_channel::SendError(entry)) = link.completer.send(entry) {
            // The completer only ends when the link is dropped, which `link`
            // prevents; should it be gone, keep the pages as the device may
            // still use them.
            let keep = entry.batch.abandon(Err(ChannelError::WorkerLost(
                "hccl completion thread ended".into(),
            )));
            std::mem::forget(keep);
        }
        Ok(completion)
    }
}

/// Which rank this side is, and what it needs for the rendezvous.
enum SetupRole {
    /// The connecting side: it made the root info and dials the liveness link.
    Root {
        root: RootInfo,
        watch: SocketAddr,
        session: u64,
        /// With a deployment secret: the proof the hello carries.
        proof: Option<Proof>,
    },
    /// The listening side: the liveness link arrives through the watch server.
    Joiner {
        root: RootInfo,
        watch: Receiver<TcpStream>,
    },
}

/// Everything a peer's setup thread needs.
struct SetupJob {
    node: String,
    device: Device,
    local: Vec<LocalMem>,
    table: PeerTable,
    role: SetupRole,
    opts: HcclOptions,
}

impl SetupJob {
    fn run(self) -> Result<Link, String> {
        let deadline = Instant::now() + self.opts.setup_timeout;
        let (root, rank, watch) = match self.role {
            SetupRole::Root {
                root,
                watch,
                session,
                proof,
            } => (root, 0, dial_watch(watch, session, proof, deadline)?),
            SetupRole::Joiner { root, watch } => {
                let left = deadline.saturating_duration_since(Instant::now());
                let s = watch.recv_timeout(left).map_err(|_| {
                    format!("the peer did not open its liveness link within {left:?}")
                })?;
                (root, 1, s)
            }
        };
        let watch = Arc::new(Watch::new(watch)?);
        let e = |what: &str| {
            let what = what.to_string();
            move |err: ascend_sys::Error| format!("{what}: {err}")
        };
        let comm = Comm::init_two_ranks(&self.device, &root, rank)
            .map_err(e("joining the two-rank communicator"))?;
        let regs: Vec<RegisteredMem> = self
            .local
            .iter()
            .map(|m| match m {
                LocalMem::Device(b) => comm.register_device_buffer(b),
                LocalMem::Host(b) => comm.register_host_buffer(b),
            })
            .collect::<Result<_, _>>()
            .map_err(e("registering a pool"))?;
        let refs: Vec<&RegisteredMem> = regs.iter().collect();
        let descs = comm
            .exchange_descriptors(&refs, MAX_REMOTE_DESCS)
            .map_err(e("exchanging memory descriptors"))?;
        let remotes: Vec<RemoteMem> = descs
            .iter()
            .map(|d| comm.enable_access(d))
            .collect::<Result<_, _>>()
            .map_err(e("enabling access to the peer's memory"))?;
        // The peer's table (what ops address) must lie inside what it
        // registered, each byte in one buffer only: the table's pages are
        // then memory the peer holds (a pull-delay receiver's proxy cap).
        let mut descs: Vec<&BufferDesc> = self.table.descs().collect();
        descs.sort_by_key(|d| d.base);
        if let Some(w) = descs.windows(2).find(|w| w[0].base + w[0].len > w[1].base) {
            return Err(format!(
                "peer buffers {} and {} overlap (at {:#x}); each buffer is its own memory",
                w[0].uuid.simple(),
                w[1].uuid.simple(),
                w[1].base
            ));
        }
        for d in self.table.descs() {
            let covered = remotes
                .iter()
                .any(|r| r.addr() <= d.base && d.base + d.len <= r.addr().saturating_add(r.len()));
            if !covered {
                return Err(format!(
                    "peer buffer {} ({} bytes at {:#x}) is not inside any memory the peer registered \
                     with HCCL",
                    d.uuid.simple(),
                    d.len,
                    d.base
                ));
            }
        }
        let stream = self
            .device
            .create_stream()
            .map_err(e("creating the transfer stream"))?;
        let (tx, rx) = crossbeam_channel::unbounded();
        let (node, opts, w) = (self.node.clone(), self.opts.clone(), Arc::clone(&watch));
        std::thread::Builder::new()
            .name("pd-hccl-done".into())
            .spawn(move || complete_loop(&rx, &w, &node, &opts))
            .map_err(|e| format!("spawning the completion thread: {e}"))?;
        Ok(Link {
            completer: tx,
            stream,
            _remotes: remotes,
            direct: Mutex::new(Vec::new()),
            stuck: AtomicBool::new(false),
            _regs: regs,
            comm,
            watch,
        })
    }
}

/// The proof a liveness link's hello carries with a deployment secret: over
/// the session and the offer's root info (both fresh per connection, and
/// exchanged only in the authenticated handshake) and the listener's
/// address as its answer named it. Good for that one link only.
fn watch_proof(secret: &Secret, session: u64, root_info: &[u8], listener: &str) -> Proof {
    secret.prove(
        Step::HcclWatch,
        &[&session.to_le_bytes(), root_info, listener.as_bytes()],
    )
}

/// The opening bytes of a liveness link: the 16-byte hello, and with a
/// deployment secret the flag and the proof.
fn watch_hello(session: u64, proof: Option<&Proof>) -> Vec<u8> {
    let mut hello = vec![0u8; WATCH_HELLO];
    hello[..4].copy_from_slice(WATCH_MAGIC);
    hello[8..].copy_from_slice(&session.to_le_bytes());
    if let Some(p) = proof {
        hello[4] = WATCH_PROVEN;
        hello.extend_from_slice(p);
    }
    hello
}

fn dial_watch(
    addr: SocketAddr,
    session: u64,
    proof: Option<Proof>,
    deadline: Instant,
) -> Result<TcpStream, String> {
    let left = deadline.saturating_duration_since(Instant::now());
    let io = |e: io::Error| format!("liveness link to {addr}: {e}");
    let mut s =
        TcpStream::connect_timeout(&addr, left.max(Duration::from_millis(1))).map_err(io)?;
    s.set_read_timeout(Some(left.max(Duration::from_millis(1))))
        .map_err(io)?;
    s.write_all(&watch_hello(session, proof.as_ref()))
        .map_err(io)?;
    let mut ack = [0u8; 1];
    s.read_exact(&mut ack).map_err(|e| {
        let why = if proof.is_some() {
            " (or did not take its proof: is its pd_auth_secret_file the same?)"
        } else {
            ""
        };
        format!("the peer refused the liveness link for this session{why}: {e}")
    })?;
    Ok(s)
}

/// A peer's ready connection: communicator, registrations, enabled peer
/// regions, stream, liveness link, and the completion thread's queue.
struct Link {
    completer: Sender<InFlight>,
    // Field order is drop order: the stream finishes its work before the
    // regions and registrations it uses go, and those before the communicator.
    stream: Stream,
    _remotes: Vec<RemoteMem>,
    /// Direct-read regions registered on this communicator, by region id.
    direct: Mutex<Vec<(u64, RegisteredMem)>>,
    /// Set once work on the stream was given up unfinished: a direct read
    /// queued behind it could wait forever, so none is queued any more.
    stuck: AtomicBool,
    _regs: Vec<RegisteredMem>,
    comm: Comm,
    watch: Arc<Watch>,
}

/// The liveness link to one peer. Nothing is sent on it after the opening
/// bytes; its closing (EOF or error) is the signal.
struct Watch {
    stream: TcpStream,
    /// The first terminal answer the socket gave. The kernel reports a
    /// socket error once and then reads as EOF, so a keepalive timeout
    /// (no proof) would look like a clean close (proof) on the next look:
    /// the first answer is kept and every later question gets it.
    end: std::sync::Mutex<Option<LinkEnd>>,
}

/// How a liveness link ended.
#[derive(Clone, Debug, PartialEq, Eq)]
enum LinkEnd {
    /// EOF: the peer closed it (its process exited or detached).
    Closed,
    /// Reset by the peer's host: its process is gone.
    Reset(String),
    /// Anything else (a keepalive timeout in a partition): no proof the
    /// peer stopped.
    Failed(String),
}

impl Watch {
    fn new(stream: TcpStream) -> Result<Watch, String> {
        set_keepalive(&stream);
        stream
            .set_nonblocking(true)
            .map_err(|e| format!("liveness link: {e}"))?;
        Ok(Watch {
            stream,
            end: std::sync::Mutex::new(None),
        })
    }

    /// How the link ended, if it has; the first answer is remembered.
    fn end(&self) -> Option<LinkEnd> {
        let mut end = self.end.lock().unwrap_or_else(|e| e.into_inner());
        if end.is_none() {
            let mut b = [0u8; 1];
            *end = match self.stream.peek(&mut b) {
                Ok(0) => Some(LinkEnd::Closed),
                Ok(_) => None,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => None,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => None,
                Err(e) if e.kind() == io::ErrorKind::ConnectionReset => {
                    Some(LinkEnd::Reset(e.to_string()))
                }
                Err(e) => Some(LinkEnd::Failed(e.to_string())),
            };
        }
        end.clone()
    }

    /// `Err` with what was seen once the peer closed the link or it broke.
    fn check(&self) -> Result<(), String> {
        match self.end() {
            None => Ok(()),
            Some(LinkEnd::Closed) => {
                Err("its liveness link closed (the process exited or detached)".into())
            }
            Some(LinkEnd::Reset(e) | LinkEnd::Failed(e)) => {
                Err(format!("its liveness link failed: {e}"))
            }
        }
    }

    /// Whether the peer closed its end, or its process is gone (reset):
    /// it can no longer touch our memory (see the module docs). A link
    /// that merely failed (a keepalive timeout in a network partition) is
    /// no such proof, now or on any later look: HCCL traffic may take
    /// another network, so its DMA may still be queued.
    fn peer_closed(&self) -> bool {
        matches!(self.end(), Some(LinkEnd::Closed | LinkEnd::Reset(_)))
    }

    /// Closes our end for writing: the peer sees EOF, and we keep reading
    /// its end to learn when it closes too.
    fn close(&self) {
        let _ = self.stream.shutdown(Shutdown::Write);
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        self.watch.close();
    }
}

/// Keepalive so a peer host that vanishes without closing is noticed too.
fn set_keepalive(s: &TcpStream) {
    let fd = s.as_raw_fd();
    let set = |level: libc::c_int, name: libc::c_int, value: libc::c_int| {
        // SAFETY: setsockopt on a socket we own, reading one c_int whose
        // size we pass; failure only leaves the default in place.
        unsafe {
            libc::setsockopt(
                fd,
                level,
                name,
                (&value as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            );
        }
    };
    set(libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1);
    set(libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, 5);
    set(libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, 2);
    set(libc::IPPROTO_TCP, libc::TCP_KEEPCNT, 3);
}

/// A peer's setup outcome, waited on by submit and wait_ready.
struct SetupCell {
    state: Mutex<SetupState>,
    changed: Condvar,
    started: Instant,
}

enum SetupState {
    Pending,
    Ready(Arc<Link>),
    Failed(String),
    /// Detached; the liveness link of a setup that had completed, to learn
    /// when the peer closes its end.
    Closed(Option<Arc<Watch>>),
}

impl SetupCell {
    fn new() -> SetupCell {
        SetupCell {
            state: Mutex::new(SetupState::Pending),
            changed: Condvar::new(),
            started: Instant::now(),
        }
    }

    fn finish(&self, r: Result<Link, String>) {
        let mut s = lock(&self.state);
        match (&*s, r) {
            // Detached meanwhile: the link drops here, closing its end of
            // the liveness link; keep reading the peer's end.
            (SetupState::Closed(_), Ok(link)) => {
                *s = SetupState::Closed(Some(Arc::clone(&link.watch)))
            }
            (SetupState::Closed(_), Err(_)) => {}
            (_, Ok(link)) => *s = SetupState::Ready(Arc::new(link)),
            (_, Err(m)) => *s = SetupState::Failed(m),
        }
        drop(s);
        self.changed.notify_all();
    }

    /// Detaches: new batches are refused; the link (and our end of the
    /// liveness link) closes once the batches still holding it have ended.
    fn close(&self) {
        let mut s = lock(&self.state);
        let watch = match &*s {
            SetupState::Ready(link) => Some(Arc::clone(&link.watch)),
            SetupState::Closed(w) => w.clone(),
            _ => None,
        };
        *s = SetupState::Closed(watch);
        drop(s);
        self.changed.notify_all();
    }

    /// `None` while setup runs; then whether it completed (and the peer
    /// is still attached).
    fn ready(&self) -> Option<bool> {
        match &*lock(&self.state) {
            SetupState::Pending => None,
            SetupState::Ready(_) => Some(true),
            SetupState::Failed(_) | SetupState::Closed(_) => Some(false),
        }
    }

    /// Whether a set-up peer closed its end of the liveness link (it
    /// exited, or detached after its last batch).
    fn peer_closed(&self) -> bool {
        matches!(&*lock(&self.state), SetupState::Ready(link) if link.watch.peer_closed())
    }

    /// Whether the peer can no longer touch our memory: its setup never
    /// completed, or it closed its end of the liveness link (after its last
    /// batch) or exited.
    fn peer_cannot_access(&self) -> bool {
        match &*lock(&self.state) {
            SetupState::Pending => false,
            SetupState::Ready(link) => link.watch.peer_closed(),
            SetupState::Failed(_) | SetupState::Closed(None) => true,
            SetupState::Closed(Some(w)) => w.peer_closed(),
        }
    }

    fn wait(&self, node: &str, timeout: Duration) -> Result<Arc<Link>, ChannelError> {
        let deadline = self.started + timeout;
        let mut s = lock(&self.state);
        loop {
            match &*s {
                SetupState::Ready(l) => return Ok(Arc::clone(l)),
                SetupState::Failed(m) => {
                    return Err(ChannelError::Handshake(format!(
                        "hccl setup with {node} failed: {m}"
                    )))
                }
                SetupState::Closed(_) => {
                    return Err(ChannelError::PeerGone {
                        peer: node.to_string(),
                        op: None,
                        detail: "detached".into(),
                    })
                }
                SetupState::Pending => {}
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(ChannelError::Timeout {
                    what: format!(
                        "hccl setup with {node} (communicator init, registration, descriptor exchange)"
                    ),
                    after: timeout,
                });
            }
            s = self
                .changed
                .wait_timeout(s, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

/// A submitted batch: the stream's completion, and what must live until it.
struct InFlight {
    done: ascend_sys::Completion,
    batch: Box<dyn Finish>,
    link: Arc<Link>,
    count: usize,
    deadline: Instant,
}

/// A batch's pages and its waiter, whatever the pages' type.
trait Finish: Send {
    /// The stream finished the batch: report with the pages.
    fn complete(self: Box<Self>, result: Result<(), ChannelError>);
    /// The batch is given up while the device may still use its pages:
    /// report now without them; they stay quarantined in what is returned
    /// until the stream is done with them.
    fn abandon(self: Box<Self>, result: Result<(), ChannelError>) -> Box<dyn Send>;
}

struct Batch<P> {
    ops: Vec<TransferOp<P>>,
    tx: CompletionSender<P>,
}

impl<P: LocalPage> Finish for Batch<P> {
    fn complete(self: Box<Self>, result: Result<(), ChannelError>) {
        let Batch { ops, tx } = *self;
        tx.complete(result, pages_of(ops));
    }

    fn abandon(self: Box<Self>, result: Result<(), ChannelError>) -> Box<dyn Send> {
        let Batch { ops, tx } = *self;
        for op in &ops {
            op.local.watch().quarantine_if_held();
        }
        tx.complete(result, Vec::new());
        Box::new(ops)
    }
}

/// Work the stream may still be doing after its batch was reported failed:
/// its pages (quarantined) and regions stay held until the stream finishes it.
struct Abandoned {
    done: ascend_sys::Completion,
    _pages: Box<dyn Send>,
    _link: Arc<Link>,
}

/// How often abandoned work is looked at when no batch comes.
const ABANDONED_CHECK: Duration = Duration::from_millis(200);

/// Reports each batch of one peer as its stream finishes it (stream order,
/// so one thread in submission order suffices). Ends when the link is
/// dropped (no batch holds it any more).
fn complete_loop(rx: &Receiver<InFlight>, watch: &Watch, node: &str, opts: &HcclOptions) {
    let mut abandoned: Vec<Abandoned> = Vec::new();
    // Set once a batch was abandoned: the stream is stuck, later batches
    // behind it get no grace.
    let mut stuck = false;
    loop {
        // Abandoned work the device proved finished frees its pages and its
        // hold on the link; a failed query keeps them quarantined.
        abandoned.retain(|a| !proven_finished(a.done.is_complete(), node));
        let entry = match rx.recv_timeout(ABANDONED_CHECK) {
            Ok(e) => e,
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => continue,
            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => break,
        };
        let InFlight {
            done,
            batch,
            link,
            count,
            deadline,
        } = entry;
        match wait_batch(&done, watch, node, opts, stuck, count, deadline) {
            Ok(result) => {
                drop(link);
                batch.complete(result);
            }
            Err(error) => {
                stuck = true;
                link.stuck.store(true, Ordering::SeqCst);
                let pages = batch.abandon(Err(error));
                abandoned.push(Abandoned {
                    done,
                    _pages: pages,
                    _link: link,
                });
            }
        }
    }
}

/// The op moving `len` bytes between `local` and byte `off` of the peer's
/// buffer `remote` names (already resolved against `table`); none for an
/// empty range.
fn one_sided(
    table: &PeerTable,
    remote: BufferRef,
    local: u64,
    off: u64,
    len: usize,
) -> Option<OneSidedOp> {
    if len == 0 {
        return None;
    }
    let base = table.get(&remote.uuid).expect("resolved before").base;
    Some(OneSidedOp {
        local_addr: local,
        remote_addr: base + off,
        len: len as u64,
    })
}

/// Whether the device proved that abandoned work finished: only its own
/// word that the work completed counts. A failed query is no proof that
/// the device stopped writing, so the work's pages stay quarantined (and
/// are looked at again on the next pass).
fn proven_finished(query: Result<bool, ascend_sys::Error>, node: &str) -> bool {
    match query {
        Ok(done) => done,
        Err(e) => {
            log::warn!(
                "abandoned hccl work to {node}: querying whether it finished failed ({e}); its \
                 pages stay quarantined until the device says it did"
            );
            false
        }
    }
}

/// Waits for everything queued on `link`'s stream: a direct read whose
/// batch cannot be tracked must not return while the device may still
/// write into the caller's memory.
fn settle(link: &Link, context: &str) {
    settle_with(
        || link.stream.synchronize(),
        context,
        || link.stuck.store(true, Ordering::SeqCst),
    );
}

/// Calls `sync` until it succeeds, `on_error` at its first failure: an
/// error is never proof that the device stopped, so this does not return
/// while the device may still write into memory the caller gives back.
/// Logged at the first failure and then about once a minute.
fn settle_with<E: std::fmt::Display>(
    mut sync: impl FnMut() -> Result<(), E>,
    context: &str,
    on_error: impl FnOnce(),
) {
    let mut on_error = Some(on_error);
    let mut failures = 0u64;
    let mut pause = WAIT_SLICE;
    let mut log_at = Instant::now();
    loop {
        let e = match sync() {
            Ok(()) => {
                if failures > 0 {
                    log::warn!(
                        "{context}: the stream synchronised after {failures} failed attempt(s)"
                    );
                }
                return;
            }
            Err(e) => e,
        };
        failures += 1;
        if let Some(f) = on_error.take() {
            f();
        }
        if Instant::now() >= log_at {
            log::error!(
                "{context}: the stream could not be synchronised ({e}; attempt {failures}); \
                 waiting, as the device may still write into the KV cache slots of this read"
            );
            log_at = Instant::now() + Duration::from_secs(60);
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_secs(1));
    }
}

/// `Ok(outcome)` once the stream finished the batch; `Err` when it was
/// abandoned unfinished (peer gone past the grace, past the deadline, or
/// the wait itself failed).
fn wait_batch(
    done: &ascend_sys::Completion,
    watch: &Watch,
    node: &str,
    opts: &HcclOptions,
    stuck: bool,
    count: usize,
    deadline: Instant,
) -> Result<Result<(), ChannelError>, ChannelError> {
    let gone = |detail: String| ChannelError::PeerGone {
        peer: node.to_string(),
        op: None,
        detail,
    };
    let mut gone_at: Option<(Instant, String)> = None;
    loop {
        match done.wait(WAIT_SLICE) {
            Ok(()) => {
                return Ok(match watch.check() {
                    Ok(()) => Ok(()),
                    Err(d) => Err(gone(format!(
                        "{d}; the batch of {count} op(s) ran, but not with a live peer"
                    ))),
                })
            }
            Err(ascend_sys::Error::Timeout { .. }) => {}
            // Split across several calls, a later one refused: what was
            // queued has run, so the batch ends (failed) and frees its pages.
            Err(source @ ascend_sys::Error::BatchPartlyQueued { .. }) => {
                return Ok(Err(ChannelError::Npu {
                    context: format!("batch of {count} op(s) with {node}"),
                    source,
                }))
            }
            // Nothing says a failed wait cancelled the queued copies: the
            // batch is abandoned and its pages stay with it.
            Err(source) => {
                return Err(ChannelError::Npu {
                    context: format!("batch of {count} op(s) with {node}"),
                    source,
                })
            }
        }
        let now = Instant::now();
        if gone_at.is_none() {
            if let Err(d) = watch.check() {
                gone_at = Some((now, d));
            }
        }
        if let Some((at, d)) = &gone_at {
            if stuck || now.duration_since(*at) >= opts.gone_grace {
                return Err(gone(format!(
                    "{d}; the batch of {count} op(s) did not finish"
                )));
            }
        }
        if now >= deadline {
            return Err(ChannelError::Timeout {
                what: format!("hccl batch of {count} op(s) with peer {node}"),
                after: opts.batch_timeout,
            });
        }
    }
}

/// Accepts liveness links and hands each to the setup waiting for its session.
struct WatchServer {
    stop: Arc<AtomicBool>,
    addr: SocketAddr,
    shared: Arc<WatchShared>,
    accept: Option<JoinHandle<()>>,
}

/// What the liveness listener's threads share.
struct WatchShared {
    /// The listener's address as endpoints name it (a proof covers it).
    addr: String,
    /// The setups waiting for their link, by session.
    waiting: Mutex<HashMap<u64, Waiting>>,
    /// Hellos for a waiting session that carried no valid proof of the
    /// deployment secret (refused; the session stays for the genuine one).
    unproven: AtomicU64,
}

/// A setup waiting for its liveness link.
struct Waiting {
    tx: Sender<TcpStream>,
    /// With a deployment secret: the secret and the offer's root info,
    /// which the hello must prove (see [`watch_proof`]).
    proof: Option<(Secret, Vec<u8>)>,
}

impl WatchServer {
    fn bind(host: &str) -> Result<WatchServer, ChannelError> {
        let (listener, addr) = bind_listener(host, "hccl liveness listener")?;
        let stop = Arc::new(AtomicBool::new(false));
        let shared = Arc::new(WatchShared {
            addr: addr.to_string(),
            waiting: Mutex::default(),
            unproven: AtomicU64::new(0),
        });
        let (stop2, shared2) = (Arc::clone(&stop), Arc::clone(&shared));
        let accept = std::thread::Builder::new()
            .name("pd-hccl-watch".into())
            .spawn(move || {
                // Hellos are read off this thread, each by its deadline: a
                // connection that says nothing holds up no other.
                let reading = Arc::new(AtomicUsize::new(0));
                for s in listener.incoming() {
                    if stop2.load(Ordering::Acquire) {
                        break;
                    }
                    let Ok(s) = s else { continue };
                    if reading.fetch_add(1, Ordering::AcqRel) >= MAX_WATCH_HELLOS {
                        // Closing refuses it; the dialer's setup reports it.
                        reading.fetch_sub(1, Ordering::AcqRel);
                        log::warn!(
                            "hccl liveness listener: {MAX_WATCH_HELLOS} connections are still \
                             to say their hello; refused another"
                        );
                        continue;
                    }
                    let (shared, reading2) = (Arc::clone(&shared2), Arc::clone(&reading));
                    let spawned = std::thread::Builder::new()
                        .name("pd-hccl-hello".into())
                        .spawn(move || {
                            route_watch(s, &shared);
                            reading2.fetch_sub(1, Ordering::AcqRel);
                        });
                    if spawned.is_err() {
                        reading.fetch_sub(1, Ordering::AcqRel);
                    }
                }
            })
            .map_err(|source| ChannelError::Io {
                context: "spawning the liveness listener thread".into(),
                source,
            })?;
        Ok(WatchServer {
            stop,
            addr,
            shared,
            accept: Some(accept),
        })
    }

    /// Where the link for `session` will be delivered; with `proof` (the
    /// secret and the offer's root info) only to a hello that proves it.
    fn expect(&self, session: u64, proof: Option<(Secret, Vec<u8>)>) -> Receiver<TcpStream> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        lock(&self.shared.waiting).insert(session, Waiting { tx, proof });
        rx
    }
}

/// Most liveness-link hellos read at once (a thread each, for at most
/// [`WATCH_HELLO_TIMEOUT`]); connections beyond are closed.
const MAX_WATCH_HELLOS: usize = 128;
/// How long a liveness link may take, in all, to send its hello.
const WATCH_HELLO_TIMEOUT: Duration = Duration::from_secs(5);

/// Fills `buf` from `s` by `deadline`, however the bytes trickle in.
fn read_by(s: &mut TcpStream, buf: &mut [u8], deadline: Instant) -> io::Result<()> {
    let mut got = 0;
    while got < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        s.set_read_timeout(Some(left))?;
        match s.read(&mut buf[got..]) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Reads a liveness link's hello and hands the link to the setup waiting
/// for its session. Closing it (every refusal) tells the dialer it was
/// refused. With a deployment secret, a hello without a valid proof is
/// refused and counted, and leaves the session waiting for the genuine one:
/// whoever learnt the session cannot take the link whose closing is proof
/// that the peer stopped.
fn route_watch(mut s: TcpStream, shared: &WatchShared) {
    let deadline = Instant::now() + WATCH_HELLO_TIMEOUT;
    let mut hello = [0u8; WATCH_HELLO];
    if read_by(&mut s, &mut hello, deadline).is_err() || &hello[..4] != WATCH_MAGIC {
        return;
    }
    let session = u64::from_le_bytes(hello[8..].try_into().expect("8 bytes"));
    // Looked at, not taken: the session is taken only by a proven hello.
    let wants = match lock(&shared.waiting).get(&session) {
        Some(w) => w.proof.clone(),
        None => return,
    };
    if let Some((secret, root_info)) = wants {
        let mut proof = [0u8; PROOF_LEN];
        let proven = hello[4] == WATCH_PROVEN
            && read_by(&mut s, &mut proof, deadline).is_ok()
            && secret.verify(
                Step::HcclWatch,
                &[&session.to_le_bytes(), &root_info, shared.addr.as_bytes()],
                &proof,
            );
        if !proven {
            let from = s
                .peer_addr()
                .map_or_else(|_| "?".to_string(), |a| a.to_string());
            if shared.unproven.fetch_add(1, Ordering::Relaxed) == 0 {
                log::warn!(
                    "hccl liveness listener: refused a link from {from} for a waiting session \
                     that did not prove the deployment secret (counted in \
                     grants.unauthenticated; logged once)"
                );
            } else {
                log::debug!("hccl liveness listener: refused an unproven link from {from}");
            }
            return;
        }
    }
    let Some(w) = lock(&shared.waiting).remove(&session) else {
        // Taken meanwhile by another proven hello.
        return;
    };
    if s.write_all(&[1]).is_ok() {
        let _ = w.tx.send(s);
    }
}

impl Drop for WatchServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(200));
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod device_word_tests {
    use super::*;
    use std::cell::Cell;

    fn query_failed() -> ascend_sys::Error {
        ascend_sys::Error::Timeout {
            what: "event",
            timeout: Duration::ZERO,
        }
    }

    /// Abandoned work whose completion query fails keeps its pages: the
    /// old loop took the error for "finished" and freed pages the device
    /// might still be writing.
    #[test]
    fn a_failed_query_never_frees_abandoned_pages() {
        let pages = Arc::new(());
        let mut abandoned = vec![Arc::clone(&pages)];
        for failed in [true, false, true] {
            let answer = || {
                if failed {
                    Err(query_failed())
                } else {
                    Ok(false)
                }
            };
            abandoned.retain(|_| !proven_finished(answer(), "peer"));
            assert_eq!(Arc::strong_count(&pages), 2, "the pages stay held");
        }
        abandoned.retain(|_| !proven_finished(Ok(true), "peer"));
        assert_eq!(
            Arc::strong_count(&pages),
            1,
            "freed once the device said so"
        );
    }

    /// A direct read whose stream cannot be synchronised does not return
    /// (giving the KV cache back to the engine) until it can.
    #[test]
    fn a_failed_synchronise_is_retried_until_the_device_answers() {
        let calls = Cell::new(0);
        let marked = Cell::new(0);
        settle_with(
            || {
                calls.set(calls.get() + 1);
                if calls.get() < 4 {
                    Err(query_failed())
                } else {
                    Ok(())
                }
            },
            "test read",
            || marked.set(marked.get() + 1),
        );
        assert_eq!(
            calls.get(),
            4,
            "returned only after the stream synchronised"
        );
        assert_eq!(
            marked.get(),
            1,
            "the link is marked stuck at the first failure"
        );
        settle_with(
            || Ok::<(), String>(()),
            "test read",
            || panic!("no failure"),
        );
    }
}

#[cfg(test)]
mod watch_tests {
    use super::*;
    use std::net::TcpListener;

    fn pair() -> (Watch, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let ours = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (theirs, _) = l.accept().unwrap();
        (Watch::new(ours).unwrap(), theirs)
    }

    /// Issue 25 item 8: the listener read each hello on its accept thread,
    /// for up to 5 s per connection, so connections that said nothing
    /// held up every good peer's liveness link behind them (ten of them:
    /// 50 s, past any setup). Hellos are now read off the accept thread.
    #[test]
    fn a_good_peers_hello_is_accepted_while_silent_connections_are_open() {
        let server = WatchServer::bind("127.0.0.1").unwrap();
        let delivered = server.expect(41, None);
        let silent: Vec<TcpStream> = (0..10)
            .map(|_| TcpStream::connect(server.addr).unwrap())
            .collect();
        let ours = dial_watch(
            server.addr,
            41,
            None,
            Instant::now() + Duration::from_secs(20),
        )
        .expect("the good peer's hello is accepted");
        let theirs = delivered
            .recv_timeout(Duration::from_secs(20))
            .expect("its link is handed to the setup waiting for it");
        assert_eq!(ours.local_addr().unwrap(), theirs.peer_addr().unwrap());
        // A wrong session is still refused (closed without the ack).
        let e = dial_watch(
            server.addr,
            42,
            None,
            Instant::now() + Duration::from_secs(20),
        )
        .unwrap_err();
        assert!(e.contains("refused"), "{e}");
        drop(silent);
    }

    /// Issue 25: anyone who saw a session in the handshake could open its
    /// liveness link first; the link was then theirs, and their closing it
    /// was taken as proof the peer stopped (its pages freed while it might
    /// still write). With a secret, hellos without a valid proof are
    /// refused and counted, and the session stays for the genuine one.
    #[test]
    fn with_a_secret_forged_liveness_hellos_are_refused_and_the_genuine_one_attached() {
        let secret = Secret::from_bytes(&[7; 32]).unwrap();
        let other = Secret::from_bytes(&[8; 32]).unwrap();
        let root_info = vec![0x5a; 64];
        let server = WatchServer::bind("127.0.0.1").unwrap();
        let listener = server.addr.to_string();
        let session = 0x1234_5678_9abc_def0;
        let delivered = server.expect(session, Some((secret.clone(), root_info.clone())));
        let deadline = || Instant::now() + Duration::from_secs(20);
        let forged = |bytes: Vec<u8>| {
            let mut s = TcpStream::connect(server.addr).unwrap();
            s.write_all(&bytes).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
            let mut ack = [0u8; 1];
            // Closed without the ack: refused.
            assert_eq!(s.read(&mut ack).unwrap(), 0, "a forged hello was taken");
        };
        // The right session and no proof (the wire without a secret).
        forged(watch_hello(session, None));
        // A proof under another secret, or for another session or root info.
        let wrong = [
            watch_proof(&other, session, &root_info, &listener),
            watch_proof(&secret, session + 1, &root_info, &listener),
            watch_proof(&secret, session, &[0x5b; 64], &listener),
            watch_proof(&secret, session, &root_info, "127.0.0.1:1"),
        ];
        for p in &wrong {
            forged(watch_hello(session, Some(p)));
        }
        // The right flag and a truncated proof, then EOF.
        let mut short = watch_hello(session, Some(&wrong[0]));
        short.truncate(WATCH_HELLO + 8);
        let mut s = TcpStream::connect(server.addr).unwrap();
        s.write_all(&short).unwrap();
        s.shutdown(Shutdown::Write).unwrap();
        assert_eq!(s.read(&mut [0u8; 1]).unwrap(), 0);
        assert_eq!(server.shared.unproven.load(Ordering::Relaxed), 6);
        assert!(delivered.try_recv().is_err(), "nothing was attached");
        // The genuine hello still finds its session.
        let proof = watch_proof(&secret, session, &root_info, &listener);
        let ours = dial_watch(server.addr, session, Some(proof), deadline())
            .expect("the genuine hello is accepted");
        let theirs = delivered
            .recv_timeout(Duration::from_secs(20))
            .expect("its link is handed to the setup");
        assert_eq!(ours.local_addr().unwrap(), theirs.peer_addr().unwrap());
        assert_eq!(server.shared.unproven.load(Ordering::Relaxed), 6);
        // Once taken, the session is gone: a replay of that very hello is refused.
        let e = dial_watch(server.addr, session, Some(proof), deadline()).unwrap_err();
        assert!(
            e.contains("refused") && e.contains("pd_auth_secret_file"),
            "{e}"
        );
    }

    #[test]
    fn a_clean_close_is_proof_and_stays_so() {
        let (w, theirs) = pair();
        assert!(w.check().is_ok() && !w.peer_closed());
        drop(theirs);
        let deadline = Instant::now() + Duration::from_secs(10);
        while !w.peer_closed() {
            assert!(Instant::now() < deadline, "EOF never seen");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(w.check().unwrap_err().contains("closed"));
        assert!(w.peer_closed());
    }

    /// The kernel reports a keepalive timeout once, then reads EOF; the
    /// first answer (no proof) must stand, or a partitioned writer's pages
    /// would be freed on the next sweep.
    #[test]
    fn a_failed_link_never_turns_into_proof_on_a_later_look() {
        let (w, theirs) = pair();
        *w.end.lock().unwrap() = Some(LinkEnd::Failed("Connection timed out".into()));
        drop(theirs);
        std::thread::sleep(Duration::from_millis(50));
        for _ in 0..3 {
            assert!(!w.peer_closed());
            assert!(w.check().unwrap_err().contains("timed out"));
        }
    }
}
