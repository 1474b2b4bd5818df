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
//! no link without it (see `liveness`). A batch abandoned while the device may still be
//! copying is reported failed at once, but keeps its pages, quarantined,
//! until the stream finishes them (never freed under DMA).
//!
//! **Closing is a promise.** A side closes its end of the liveness link
//! (half-close: it keeps reading the other end) only when its `Link` is
//! dropped, which is after every batch that used it has left the stream.
//! So the peer closing its end proves it can no longer touch our memory:
//! that is when a revoked grant is quiescent (the peer's process exiting
//! closes it too). Nothing else can prove it: HCCL cannot refuse a peer's
//! one-sided access. Not even our own setup failing, unless it failed
//! before the descriptor exchange (a collective the peer cannot finish
//! without us): after it, the peer may hold our descriptors with access
//! enabled, so our end of the link is closed and we wait for the peer's.
//!
//! Nothing here has run on Ascend hardware; it is tested against the CANN
//! emulator (`ascend-sys/emu`).

use super::liveness::{LinkRole, Watch, WatchServer};
use super::one_sided::device_channel_methods;
use super::one_sided::{
    acl_pools, batch_spans, check_coverage, complete_loop, direct_spans, lock, proven_finished,
    Abandoned, Batch, Bounds, DevicePeer, DevicePeers, DirectLink, DirectState, Finish, InFlight,
    LocalMem, Pending, Polled, SetupFailure, Span, Watched, WAIT_SLICE,
};
use super::{
    pages_of, table_of, watch_ops, Access, BufferDesc, ChannelError, Completion, DirectRead,
    DirectRegistration, Endpoint, GrantId, GrantStats, GrantTag, LocalPage, OpKind, PeerId,
    PeerPages, PeerTable, ReadOp, TransferChannel, TransferOp, WriteOp,
};
use crate::auth::Secret;
use crate::config::ChannelKind;
use crate::memory::{BufferRef, DeviceKind, MemObj, PagePool, SealedMemObj};
use ascend_sys::{Comm, Device, MemKind, OneSidedOp, RegisteredMem, RemoteMem, RootInfo, Stream};
use crossbeam_channel::Sender;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use uuid::Uuid;

/// Most peer descriptors accepted in one exchange (a worker has two pools).
const MAX_REMOTE_DESCS: usize = 64;

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

impl HcclOptions {
    /// The bounds of the shared setup and completion machinery, for the
    /// channel named `channel` whose setup does `steps`.
    pub(crate) fn bounds_for(&self, channel: &'static str, steps: &'static str) -> Bounds {
        Bounds {
            channel,
            setup_steps: steps,
            setup_timeout: self.setup_timeout,
            batch_timeout: self.batch_timeout,
            gone_grace: self.gone_grace,
        }
    }

    fn bounds(&self) -> Bounds {
        self.bounds_for(
            "hccl",
            "communicator init, registration, descriptor exchange",
        )
    }
}

pub(crate) fn npu_err(context: String) -> impl FnOnce(ascend_sys::Error) -> ChannelError {
    move |source| ChannelError::Npu { context, source }
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
    peers: DevicePeers<Link>,
    auth: Option<Secret>,
    /// This instance, for direct registrations ([`TransferChannel::direct_registry`]).
    id: u64,
    direct: Arc<Mutex<DirectState<Link>>>,
}

/// Instances made so far (their ids).
static INSTANCES: AtomicU64 = AtomicU64::new(0);

impl HcclChannel {
    /// A channel over `pools` (every one allocated by the ACL runtime, all
    /// for one NPU); the liveness listener binds where `at` says.
    pub fn new(
        at: &super::ListenAt,
        pools: &[Arc<PagePool>],
        opts: HcclOptions,
    ) -> Result<HcclChannel, ChannelError> {
        let (device, local) = acl_pools(pools, "hccl")?;
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
            watch: WatchServer::bind(at, "hccl")?,
            device,
            local_uuids: pools.iter().map(|p| p.uuid()).collect(),
            pools: pools.to_vec(),
            local,
            opts,
            offers: Mutex::new(HashMap::new()),
            peers: DevicePeers::default(),
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

    fn peer(&self, id: PeerId) -> Result<Arc<DevicePeer<Link>>, ChannelError> {
        self.peers.get(id)
    }

    fn endpoint_with(&self, root_info: Vec<u8>, session: u64) -> Endpoint {
        Endpoint::Hccl {
            root_info,
            session,
            device: self.device.id(),
            watch: self.watch.advertised().to_string(),
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
        let (root, rank, link) = if root_info.is_empty() {
            // We connected and offered: the answer names our offer.
            let (root, _) = lock(&self.offers).remove(session).ok_or_else(|| {
                ChannelError::Handshake(format!(
                    "peer {node} answered hccl session {session:016x}, which this side never offered \
                     or already used (the connecting side must offer a root info: use handshake::connect)"
                ))
            })?;
            let link = LinkRole::dial(node, watch, *session, root.as_bytes(), self.auth.as_ref())?;
            (root, 0, link)
        } else {
            let root = RootInfo::from_bytes(root_info).map_err(|e| {
                ChannelError::Handshake(format!("peer {node} sent a bad root info: {e}"))
            })?;
            let proof = self.auth.clone().map(|s| (s, root_info.clone()));
            (root, 1, LinkRole::Await(self.watch.expect(*session, proof)))
        };
        let job = SetupJob {
            node: node.to_string(),
            device: self.device.clone(),
            local: self.local.clone(),
            table: table.clone(),
            root,
            rank,
            link,
            opts: self.opts.clone(),
        };
        self.peers.attach(
            node,
            table,
            self.opts.bounds(),
            "pd-hccl-setup",
            move || job.run(),
        )
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
        st.add(&self.direct, self.id, regions).map(Some)
    }

    fn prepare_direct(&self, peer: PeerId) -> Result<(), ChannelError> {
        let p = self.peer(peer)?;
        let link = p.setup.wait(&p.node)?;
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
        let batch: Vec<OneSidedOp> = direct_spans(&p.table, ops, &regions, "hccl")?
            .into_iter()
            .map(one_sided)
            .collect();
        if batch.is_empty() {
            return Ok(());
        }
        let link = p.live_link()?;
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

    device_channel_methods!();
}

impl HcclChannel {
    /// Registers every direct-read region on `link`'s communicator that is
    /// not yet, and remembers the link for deregistration.
    fn register_on(&self, link: &Arc<Link>) -> Result<(), ChannelError> {
        let mut st = lock(&self.direct);
        st.remember(link);
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
        let batch: Vec<OneSidedOp> = batch_spans(&p.table, &ops, &self.local_uuids, "hccl")?
            .into_iter()
            .map(one_sided)
            .collect();
        if batch.is_empty() {
            return Ok(Completion::ready(Ok(()), pages_of(ops)));
        }
        let link = p.live_link()?;
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
            pending: Box::new(OnStream {
                done,
                link: Arc::clone(&link),
                node: p.node.clone(),
            }),
            batch: Box::new(Batch { ops, tx }),
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

/// Everything a peer's setup thread needs.
struct SetupJob {
    node: String,
    device: Device,
    local: Vec<LocalMem>,
    table: PeerTable,
    root: RootInfo,
    /// 0 on the connecting side (which made the root info), 1 on the other.
    rank: u32,
    link: LinkRole,
    opts: HcclOptions,
}

impl SetupJob {
    fn run(self) -> Result<Link, SetupFailure> {
        let deadline = Instant::now() + self.opts.setup_timeout;
        // The peer reaches our memory only through the descriptors of the
        // exchange below, a collective it cannot finish without us: a
        // failure before it leaves our memory out of its reach.
        let watch = self
            .link
            .open(deadline)
            .map_err(|f| SetupFailure::unexposed(f.message))?;
        let (root, rank) = (self.root, self.rank);
        let before = |what: &str| {
            let what = what.to_string();
            move |err: ascend_sys::Error| SetupFailure::unexposed(format!("{what}: {err}"))
        };
        // From the exchange on, the peer may hold our descriptors and
        // write our pages until it closes its end of the liveness link.
        let after = |what: &str| {
            let (what, watch) = (what.to_string(), Arc::clone(&watch));
            move |err: ascend_sys::Error| SetupFailure::exposed(format!("{what}: {err}"), &watch)
        };
        let comm = Comm::init_two_ranks(&self.device, &root, rank)
            .map_err(before("joining the two-rank communicator"))?;
        let regs: Vec<RegisteredMem> = self
            .local
            .iter()
            .map(|m| match m {
                LocalMem::Device(b) => comm.register_device_buffer(b),
                LocalMem::Host(b) => comm.register_host_buffer(b),
            })
            .collect::<Result<_, _>>()
            .map_err(before("registering a pool"))?;
        let refs: Vec<&RegisteredMem> = regs.iter().collect();
        let descs = comm
            .exchange_descriptors(&refs, MAX_REMOTE_DESCS)
            .map_err(after("exchanging memory descriptors"))?;
        let remotes: Vec<RemoteMem> = descs
            .iter()
            .map(|d| comm.enable_access(d))
            .collect::<Result<_, _>>()
            .map_err(after("enabling access to the peer's memory"))?;
        let regions: Vec<(u64, u64)> = remotes.iter().map(|r| (r.addr(), r.len())).collect();
        check_coverage(&self.table, &regions, "HCCL")
            .map_err(|m| SetupFailure::exposed(m, &watch))?;
        let stream = self
            .device
            .create_stream()
            .map_err(after("creating the transfer stream"))?;
        let (tx, rx) = crossbeam_channel::unbounded();
        let stuck = Arc::new(AtomicBool::new(false));
        let (node, bounds, w, st) = (
            self.node.clone(),
            self.opts.bounds(),
            Arc::clone(&watch),
            Arc::clone(&stuck),
        );
        std::thread::Builder::new()
            .name("pd-hccl-done".into())
            .spawn(move || complete_loop(&rx, &w, &node, &bounds, &st))
            .map_err(|e| {
                SetupFailure::exposed(format!("spawning the completion thread: {e}"), &watch)
            })?;
        Ok(Link {
            completer: tx,
            stream,
            _remotes: remotes,
            direct: Mutex::new(Vec::new()),
            stuck,
            _regs: regs,
            comm,
            watch,
        })
    }
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
    stuck: Arc<AtomicBool>,
    _regs: Vec<RegisteredMem>,
    comm: Comm,
    watch: Arc<Watch>,
}

impl Drop for Link {
    fn drop(&mut self) {
        self.watch.close();
    }
}

impl Watched for Link {
    fn watch(&self) -> &Arc<Watch> {
        &self.watch
    }
}

impl DirectLink for Link {
    fn forget_direct(&self, ids: &[u64]) {
        lock(&self.direct).retain(|(id, _)| !ids.contains(id));
    }
}

/// A span as an HCCL one-sided op.
fn one_sided(s: Span) -> OneSidedOp {
    OneSidedOp {
        local_addr: s.local,
        remote_addr: s.remote,
        len: s.len,
    }
}

/// A batch on a peer's stream: its completion, and the link (regions,
/// registrations, stream) that must live until the stream finished it.
struct OnStream {
    done: ascend_sys::Completion,
    link: Arc<Link>,
    node: String,
}

impl Pending for OnStream {
    fn poll(&mut self) -> Polled {
        let failed = |source| ChannelError::Npu {
            context: format!("hccl batch with {}", self.node),
            source,
        };
        match self.done.wait(WAIT_SLICE) {
            Ok(()) => Polled::Done,
            Err(ascend_sys::Error::Timeout { .. }) => Polled::Waiting,
            // Split across several calls, a later one refused: what was
            // queued has run, so the batch ends (failed) and frees its pages.
            Err(source @ ascend_sys::Error::BatchPartlyQueued { .. }) => {
                Polled::Ended(failed(source))
            }
            // Nothing says a failed wait cancelled the queued copies: the
            // batch is abandoned and its pages stay with it.
            Err(source) => Polled::Broken(failed(source)),
        }
    }

    fn abandon(self: Box<Self>, pages: Box<dyn Send>) -> Option<Box<dyn Abandoned>> {
        Some(Box::new(StreamAbandoned {
            done: self.done,
            _pages: pages,
            _link: self.link,
            node: self.node,
        }))
    }
}

/// Work the stream may still be doing after its batch was reported failed:
/// its pages (quarantined) and regions stay held until the stream finishes it.
struct StreamAbandoned {
    done: ascend_sys::Completion,
    _pages: Box<dyn Send>,
    _link: Arc<Link>,
    node: String,
}

impl Abandoned for StreamAbandoned {
    fn finished(&mut self) -> bool {
        proven_finished(self.done.is_complete(), &self.node)
    }
}

/// Waits for everything queued on `link`'s stream: a direct read whose
/// batch cannot be tracked must not return while the device may still
/// write into the caller's memory.
fn settle(link: &Link, context: &str) {
    crate::memory::npu::settle_with(
        || link.stream.synchronize(),
        context,
        "the KV cache slots of this read",
        || link.stuck.store(true, Ordering::SeqCst),
    );
}
