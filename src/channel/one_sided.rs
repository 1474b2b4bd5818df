//! What the one-sided device channels (`hccl`, `hixl`) share: the
//! per-peer setup that runs on its own thread and is waited on (bounded),
//! the batch that owns its pages until the device is done with them, the
//! completion thread that waits for each batch in slices while watching
//! the peer's liveness link, and the rules for work given up unfinished
//! (its pages stay quarantined until the device proves it stopped).
//!
//! Each channel supplies what differs: how a batch is polled
//! ([`Pending`]), and how work given up unfinished is held until the
//! device can no longer touch its pages ([`Pending::abandon`]).

use super::grant::GrantTable;
use super::liveness::{LinkFailure, Watch};
use super::{
    check_grant_pages, check_ops, pages_of, table_pages, Access, BufferDesc, ChannelError,
    CompletionSender, DirectRead, DirectRegistration, GrantId, GrantStats, GrantTag, LocalPage,
    PeerId, PeerPages, PeerRegistry, PeerTable, TransferOp,
};
#[cfg(test)]
use crate::memory::npu::settle_with;
use crate::memory::npu::{device_buffer, device_of, pinned_buffer};
use crate::memory::BufferRef;
use crate::memory::PagePool;
use ascend_sys::{Device, DeviceBuffer, HostBuffer, MemKind};
use crossbeam_channel::Receiver;
use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};
use uuid::Uuid;

/// The [`TransferChannel`](super::TransferChannel) methods the device
/// channels implement identically, over the fields both have: `peers` (a
/// [`DevicePeers`]), `pools`, `auth`, `device`, `id` (the direct-read
/// registry), `watch` (the liveness listener) and a `submit(peer, kind,
/// ops)` of their own. Expanded inside each channel's
/// `impl TransferChannel`, so the two cannot drift apart.
macro_rules! device_channel_methods {
    () => {
        fn detach(&self, peer: PeerId) {
            self.peers.detach(peer);
        }

        fn gone_peers(&self) -> Vec<PeerId> {
            self.peers.gone()
        }

        fn wait_ready(&self, peer: PeerId) -> Result<(), ChannelError> {
            self.peers.wait_ready(peer)
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

        fn grant(
            &self,
            peer: PeerId,
            access: Access,
            tag: GrantTag,
            pages: &[BufferRef],
        ) -> Result<GrantId, ChannelError> {
            self.peers.grant(&self.pools, peer, access, tag, pages)
        }

        fn release(&self, grant: GrantId) -> bool {
            self.peers.release(grant)
        }

        fn revoke(&self, grant: GrantId) {
            self.peers.revoke(grant);
        }

        fn is_quiescent(&self, grant: GrantId) -> bool {
            self.peers.is_quiescent(grant)
        }

        fn auth(&self) -> Option<&Secret> {
            self.auth.as_ref()
        }

        /// The pages of the peer's table once setup proved every buffer
        /// inside memory the peer registered with the device runtime (HCCL,
        /// or the regions its HIXL server reported), no two overlapping;
        /// pending until then (a table alone is only what the peer says).
        fn verified_peer_pages(&self, peer: PeerId) -> PeerPages {
            self.peers.verified_pages(peer)
        }

        fn grant_stats(&self) -> GrantStats {
            self.peers
                .grant_stats(self.watch.shared.unproven.load(Ordering::Relaxed))
        }
    };
}
pub(crate) use device_channel_methods;

/// A local pool as the device channels register it: NPU pools as device
/// memory, CPU pools as ACL-pinned host memory (nothing else registers).
#[derive(Clone)]
pub(crate) enum LocalMem {
    Device(Arc<DeviceBuffer>),
    Host(Arc<HostBuffer>),
}

impl LocalMem {
    /// The kind, address and length to register.
    pub(crate) fn region(&self) -> (MemKind, *mut u8, usize) {
        match self {
            LocalMem::Device(b) => (MemKind::Device, b.as_ptr().cast(), b.len()),
            LocalMem::Host(b) => (MemKind::Host, b.as_ptr().cast(), b.len()),
        }
    }
}

/// The device of `pools` and each pool as `channel` registers it: every
/// pool must be allocated by the ACL runtime, all for one NPU.
pub(crate) fn acl_pools(
    pools: &[Arc<PagePool>],
    channel: &str,
) -> Result<(Device, Vec<LocalMem>), ChannelError> {
    let mut local = Vec::new();
    let mut device: Option<Device> = None;
    for p in pools {
        let b = p.buffer();
        // SAFETY: registered with a peer's connection, which reads or
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
                "the {channel} channel registers pools allocated by the ACL runtime, but pool {} \
                 on {} is not (build the allocator with backend::pools::allocator_for, which \
                 pins the CPU pool for transfer_channel: {channel}, or use transfer_channel: tcp)",
                b.uuid().simple(),
                b.device()
            )));
        };
        let d = device_of(b).expect("ACL-backed pools know their device");
        match &device {
            Some(first) if first.id() != d.id() => {
                return Err(ChannelError::Unsupported(format!(
                    "{channel} pools must belong to one NPU; found NPU {} and NPU {}",
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
        ChannelError::Unsupported(format!("the {channel} channel needs at least one pool"))
    })?;
    Ok((device, local))
}

/// An attached peer of a device channel: its validated table and its setup.
pub(crate) struct DevicePeer<L> {
    pub(crate) node: String,
    pub(crate) table: PeerTable,
    pub(crate) setup: Arc<SetupCell<L>>,
}

/// The peers of a device channel and the grants of its pages to them. The
/// device copies one-sidedly, so a grant cannot be enforced: a revoked
/// grant is quiescent once the peer can no longer touch our memory (our
/// setup with it failed before it could reach our memory, or it closed its
/// end of the liveness link).
pub(crate) struct DevicePeers<L> {
    peers: PeerRegistry<DevicePeer<L>>,
    grants: GrantTable<Arc<SetupCell<L>>>,
}

impl<L> Default for DevicePeers<L> {
    fn default() -> Self {
        DevicePeers {
            peers: PeerRegistry::default(),
            grants: GrantTable::default(),
        }
    }
}

impl<L: Watched> DevicePeers<L> {
    /// The peer `id`.
    pub(crate) fn get(&self, id: PeerId) -> Result<Arc<DevicePeer<L>>, ChannelError> {
        self.peers.get(id)
    }

    /// Attaches `node` with its `table`, whose setup runs `job` on a thread
    /// named `thread`; a peer attached before as `node` is closed.
    pub(crate) fn attach(
        &self,
        node: &str,
        table: PeerTable,
        bounds: Bounds,
        thread: &str,
        job: impl FnOnce() -> Result<L, SetupFailure> + Send + 'static,
    ) -> Result<PeerId, ChannelError> {
        let setup = Arc::new(SetupCell::new(bounds));
        let cell = Arc::clone(&setup);
        std::thread::Builder::new()
            .name(thread.into())
            .spawn(move || cell.finish(job()))
            .map_err(|source| ChannelError::Io {
                context: format!("spawning the {thread} thread"),
                source,
            })?;
        let peer = Arc::new(DevicePeer {
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

    /// Detaches `id`: new batches are refused; its link closes once the
    /// batches still holding it have ended.
    pub(crate) fn detach(&self, id: PeerId) {
        if let Some(p) = self.peers.remove(id) {
            p.setup.close();
        }
    }

    /// The peers that closed their end of the liveness link.
    pub(crate) fn gone(&self) -> Vec<PeerId> {
        self.peers.select(|p| p.setup.peer_closed())
    }

    /// Waits (bounded) for `id`'s setup and reports its failure.
    pub(crate) fn wait_ready(&self, id: PeerId) -> Result<(), ChannelError> {
        let p = self.get(id)?;
        p.setup.wait(&p.node).map(|_| ())
    }

    /// Grants `pages` of `pools` to `peer`.
    pub(crate) fn grant(
        &self,
        pools: &[Arc<PagePool>],
        peer: PeerId,
        access: Access,
        tag: GrantTag,
        pages: &[BufferRef],
    ) -> Result<GrantId, ChannelError> {
        check_grant_pages(pools, pages)?;
        let (node, p) = self.peers.entry(peer)?;
        Ok(self
            .grants
            .add(&node, access, tag, pages, Arc::clone(&p.setup)))
    }

    /// See [`super::TransferChannel::release`].
    pub(crate) fn release(&self, grant: GrantId) -> bool {
        self.grants.release(grant)
    }

    /// See [`super::TransferChannel::revoke`].
    pub(crate) fn revoke(&self, grant: GrantId) {
        self.grants.revoke(grant);
    }

    /// See [`super::TransferChannel::is_quiescent`].
    pub(crate) fn is_quiescent(&self, grant: GrantId) -> bool {
        self.grants
            .settle(grant, |e| e.read_only() || e.session.peer_cannot_access())
    }

    /// The grant counters, with `unproven` liveness hellos refused.
    pub(crate) fn grant_stats(&self, unproven: u64) -> GrantStats {
        GrantStats {
            unauthenticated: unproven,
            ..self.grants.stats()
        }
    }

    /// The pages of the peer's table once setup proved every buffer inside
    /// memory the peer registered, no two overlapping; pending until then
    /// (a table alone is only what the peer says).
    pub(crate) fn verified_pages(&self, id: PeerId) -> PeerPages {
        let Ok(p) = self.get(id) else {
            return PeerPages::Verified(0);
        };
        match p.setup.ready() {
            None => PeerPages::Pending,
            Some(true) => PeerPages::Verified(table_pages(p.table.descs())),
            Some(false) => PeerPages::Verified(0),
        }
    }
}

/// One op of a device channel's batch: `len` bytes between the local
/// address `local` and the peer's address `remote`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Span {
    pub(crate) local: u64,
    pub(crate) remote: u64,
    pub(crate) len: u64,
}

impl Span {
    /// The span of `len` bytes between `local` and byte `off` of the peer's
    /// buffer `remote` names (already resolved against `table`); none for
    /// an empty range.
    fn of(table: &PeerTable, remote: BufferRef, local: u64, off: u64, len: usize) -> Option<Span> {
        if len == 0 {
            return None;
        }
        let base = table.get(&remote.uuid).expect("resolved before").base;
        Some(Span {
            local,
            remote: base + off,
            len: len as u64,
        })
    }
}

/// The spans of a batch of `channel`, after the shared op check: every
/// remote range inside a page of the peer's `table`, every local page of a
/// pool of this channel (`local_uuids`, registered with the device).
pub(crate) fn batch_spans<P: LocalPage>(
    table: &PeerTable,
    ops: &[TransferOp<P>],
    local_uuids: &HashSet<Uuid>,
    channel: &str,
) -> Result<Vec<Span>, ChannelError> {
    let offsets = check_ops(table, ops, false)?;
    let mut spans = Vec::with_capacity(ops.len());
    for (i, (op, off)) in ops.iter().zip(&offsets).enumerate() {
        if !local_uuids.contains(&op.local.pool().uuid()) {
            return Err(ChannelError::BadLocal {
                op: i,
                local: op.local.buffer_ref(),
                reason: format!(
                    "its pool is not registered with this {channel} channel (open the channel \
                     over every pool transfers use)"
                ),
            });
        }
        spans.extend(Span::of(
            table,
            op.remote,
            op.local.addr() + op.local_offset as u64,
            *off + op.remote_offset as u64,
            op.len,
        ));
    }
    Ok(spans)
}

/// The spans of a direct read of `channel`: every remote range inside a
/// page of the peer's `table`, every destination inside memory registered
/// for direct reads (`regions`).
pub(crate) fn direct_spans(
    table: &PeerTable,
    ops: &[DirectRead],
    regions: &[DirectRegion],
    channel: &str,
) -> Result<Vec<Span>, ChannelError> {
    let mut spans = Vec::with_capacity(ops.len());
    for (i, op) in ops.iter().enumerate() {
        let page = table.resolve_direct(i, op)?;
        if !regions.iter().any(|r| r.holds(op.dst, op.len)) {
            return Err(ChannelError::Unsupported(format!(
                "direct read op {i}: [{:#x}, +{}) is not in memory registered with this \
                 {channel} channel (register the KV cache: TransferChannel::register_direct)",
                op.dst, op.len
            )));
        }
        spans.extend(Span::of(
            table,
            op.remote,
            op.dst as u64,
            page + op.offset as u64,
            op.len,
        ));
    }
    Ok(spans)
}

impl<L: Watched> DevicePeer<L> {
    /// The peer's connection once its setup is done and its liveness link
    /// still open (a batch to a peer seen gone is refused).
    pub(crate) fn live_link(&self) -> Result<Arc<L>, ChannelError> {
        let link = self.setup.wait(&self.node)?;
        if let Err(detail) = link.watch().check() {
            return Err(ChannelError::PeerGone {
                peer: self.node.clone(),
                op: None,
                detail,
            });
        }
        Ok(link)
    }
}

/// Checks that the peer's table (what ops address) lies inside the memory
/// it registered (`regions`: address, bytes), each byte in one buffer only:
/// the table's pages are then memory the peer holds (a pull-delay
/// receiver's proxy cap). `api` names where it registered ("HCCL").
pub(crate) fn check_coverage(
    table: &PeerTable,
    regions: &[(u64, u64)],
    api: &str,
) -> Result<(), String> {
    let mut descs: Vec<&BufferDesc> = table.descs().collect();
    descs.sort_by_key(|d| d.base);
    if let Some(w) = descs.windows(2).find(|w| w[0].base + w[0].len > w[1].base) {
        return Err(format!(
            "peer buffers {} and {} overlap (at {:#x}); each buffer is its own memory",
            w[0].uuid.simple(),
            w[1].uuid.simple(),
            w[1].base
        ));
    }
    for d in descs {
        let covered = regions
            .iter()
            .any(|&(addr, len)| addr <= d.base && d.base + d.len <= addr.saturating_add(len));
        if !covered {
            return Err(format!(
                "peer buffer {} ({} bytes at {:#x}) is not inside any memory the peer registered \
                 with {api}",
                d.uuid.simple(),
                d.len,
                d.base
            ));
        }
    }
    Ok(())
}

/// How often a waiting batch looks at the liveness link.
pub(crate) const WAIT_SLICE: Duration = Duration::from_millis(20);

/// Locks `m`, carrying on after a panic elsewhere poisoned it.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The bounds on one peer's setup and batches.
#[derive(Clone, Debug)]
pub(crate) struct Bounds {
    /// The channel's name, for errors and logs.
    pub(crate) channel: &'static str,
    /// What setup does, for the timeout's message.
    pub(crate) setup_steps: &'static str,
    /// Longest a peer's setup may take, counted from attach.
    pub(crate) setup_timeout: Duration,
    /// Longest one batch may run before it is reported as timed out.
    pub(crate) batch_timeout: Duration,
    /// How long a running batch may still finish after its peer was seen gone.
    pub(crate) gone_grace: Duration,
}

/// A peer's ready connection, as far as the shared machinery looks at it.
pub(crate) trait Watched: Send + Sync + 'static {
    /// The liveness link of the pair.
    fn watch(&self) -> &Arc<Watch>;
}

/// A region of caller memory registered for direct reads (a KV cache).
#[derive(Clone, Copy, Debug)]
pub(crate) struct DirectRegion {
    pub(crate) id: u64,
    pub(crate) addr: usize,
    pub(crate) len: usize,
}

impl DirectRegion {
    /// Whether `[addr, addr + len)` lies inside this region.
    pub(crate) fn holds(&self, addr: usize, len: usize) -> bool {
        self.addr <= addr
            && addr
                .checked_add(len)
                .is_some_and(|e| e <= self.addr + self.len)
    }
}

/// A connection to a peer that registers direct-read regions on itself
/// (hccl: on its communicator; hixl: on its client).
pub(crate) trait DirectLink: Send + Sync + 'static {
    /// Deregisters the regions `ids` from this connection. Called when the
    /// registration is dropped: no direct read into them is running then.
    fn forget_direct(&self, ids: &[u64]);
}

/// Memory registered for direct reads (KV caches), and the links it may be
/// registered on. A link registers a region the first time it needs it;
/// dropping a region's registration deregisters it on every such link.
/// This lock is always taken before a link's own, which orders both.
pub(crate) struct DirectState<L> {
    next: u64,
    /// Every registration's regions, in the order they were made.
    pub(crate) regions: Vec<DirectRegion>,
    links: Vec<Weak<L>>,
}

impl<L> Default for DirectState<L> {
    fn default() -> Self {
        DirectState {
            next: 0,
            regions: Vec::new(),
            links: Vec::new(),
        }
    }
}

impl<L: DirectLink> DirectState<L> {
    /// Registers `regions` (checked against those already registered) for
    /// the channel instance `channel`; dropping what is returned forgets
    /// them here and on every remembered link.
    /// `self` is `state`, locked.
    pub(crate) fn add(
        &mut self,
        state: &Arc<Mutex<DirectState<L>>>,
        channel: u64,
        regions: &[(usize, usize)],
    ) -> Result<DirectRegistration, ChannelError> {
        let st = self;
        check_new_regions(&st.regions, regions)?;
        let mut ids = Vec::with_capacity(regions.len());
        for &(addr, len) in regions {
            st.next += 1;
            let id = st.next;
            st.regions.push(DirectRegion { id, addr, len });
            ids.push(id);
        }
        Ok(DirectRegistration::new(
            channel,
            Box::new(DirectHold {
                state: Arc::clone(state),
                ids,
            }),
        ))
    }

    /// Remembers `link` for deregistration (once), before anything is
    /// registered on it, so a failure part-way leaves nothing a dropped
    /// registration cannot find.
    pub(crate) fn remember(&mut self, link: &Arc<L>) {
        if !self.links.iter().any(|l| l.as_ptr() == Arc::as_ptr(link)) {
            self.links.retain(|l| l.strong_count() > 0);
            self.links.push(Arc::downgrade(link));
        }
    }
}

/// What a [`DirectRegistration`] of a device channel holds: dropping it
/// forgets its regions and deregisters them from every link.
struct DirectHold<L: DirectLink> {
    // Strong: links (an abandoned batch's, say) can outlive the channel,
    // and their registrations must still go with the memory.
    state: Arc<Mutex<DirectState<L>>>,
    ids: Vec<u64>,
}

impl<L: DirectLink> Drop for DirectHold<L> {
    fn drop(&mut self) {
        let mut st = lock(&self.state);
        st.regions.retain(|r| !self.ids.contains(&r.id));
        st.links.retain(|l| l.strong_count() > 0);
        for link in st.links.iter().filter_map(Weak::upgrade) {
            // A direct read holds `&` to the memory for its whole call, so
            // none is in flight here: deregistering is safe.
            link.forget_direct(&self.ids);
        }
    }
}

/// Checks regions to be registered for direct reads against those already
/// registered (`have`): each non-empty, not wrapping, and overlapping none.
fn check_new_regions(
    have: &[DirectRegion],
    regions: &[(usize, usize)],
) -> Result<(), ChannelError> {
    for &(addr, len) in regions {
        if len == 0 || addr.checked_add(len).is_none() {
            return Err(ChannelError::Unsupported(format!(
                "cannot register {len} bytes at {addr:#x} for direct reads"
            )));
        }
        if let Some(r) = have
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
    Ok(())
}

/// A peer's setup outcome, waited on by submit and wait_ready.
pub(crate) struct SetupCell<L> {
    bounds: Bounds,
    state: Mutex<SetupState<L>>,
    changed: Condvar,
    started: Instant,
}

/// Why a peer's setup failed, and what then proves that the peer cannot
/// touch our memory. Our own failure is no such proof by itself: the
/// peer's setup may have gone through (hixl: its client connected to our
/// server, which serves every pool; hccl: it holds our descriptors).
pub(crate) struct SetupFailure {
    message: String,
    /// `None`: the failure came before the peer could reach our memory.
    /// `Some`: it may have, and may write our pages until it closes its
    /// end of this liveness link.
    exposed: Option<Arc<Watch>>,
}

impl SetupFailure {
    /// A failure before the peer could reach our memory.
    pub(crate) fn unexposed(message: impl Into<String>) -> SetupFailure {
        SetupFailure {
            message: message.into(),
            exposed: None,
        }
    }

    /// A failure after the peer may have reached our memory; `watch` is
    /// the liveness link whose closing proves it no longer can.
    pub(crate) fn exposed(message: impl Into<String>, watch: &Arc<Watch>) -> SetupFailure {
        SetupFailure {
            message: message.into(),
            exposed: Some(Arc::clone(watch)),
        }
    }

    /// A liveness link that did not open: the peer reached our memory only
    /// if its end may have opened.
    pub(crate) fn link(f: LinkFailure) -> SetupFailure {
        SetupFailure {
            message: f.message,
            exposed: f.maybe_open,
        }
    }
}

/// What proves a peer whose setup ended without a usable link cannot touch
/// our memory.
#[derive(Clone)]
enum Proof {
    /// Our setup failed before it could reach our memory.
    NeverReached,
    /// It closes its end of this liveness link (or its process exits).
    Closes(Arc<Watch>),
}

impl Proof {
    fn holds(&self) -> bool {
        match self {
            Proof::NeverReached => true,
            Proof::Closes(w) => w.peer_closed(),
        }
    }
}

enum SetupState<L> {
    Pending,
    Ready(Arc<L>),
    Failed(String, Proof),
    /// Detached: with what proves the peer off our memory once its setup
    /// ended (`None` while it still runs).
    Closed(Option<Proof>),
}

impl<L: Watched> SetupCell<L> {
    pub(crate) fn new(bounds: Bounds) -> SetupCell<L> {
        SetupCell {
            bounds,
            state: Mutex::new(SetupState::Pending),
            changed: Condvar::new(),
            started: Instant::now(),
        }
    }

    pub(crate) fn finish(&self, r: Result<L, SetupFailure>) {
        let mut s = lock(&self.state);
        let failed = |f: SetupFailure| {
            let proof = match f.exposed {
                Some(w) => {
                    // Nothing of ours touches the peer's memory any more:
                    // close our end, and keep reading the peer's.
                    w.close();
                    Proof::Closes(w)
                }
                None => Proof::NeverReached,
            };
            (f.message, proof)
        };
        match (&*s, r) {
            // Detached meanwhile: the link drops here, closing its end of
            // the liveness link; keep reading the peer's end.
            (SetupState::Closed(_), Ok(link)) => {
                *s = SetupState::Closed(Some(Proof::Closes(Arc::clone(link.watch()))))
            }
            (SetupState::Closed(_), Err(f)) => *s = SetupState::Closed(Some(failed(f).1)),
            (_, Ok(link)) => *s = SetupState::Ready(Arc::new(link)),
            (_, Err(f)) => {
                let (m, proof) = failed(f);
                *s = SetupState::Failed(m, proof);
            }
        }
        drop(s);
        self.changed.notify_all();
    }

    /// Detaches: new batches are refused; the link (and our end of the
    /// liveness link) closes once the batches still holding it have ended.
    pub(crate) fn close(&self) {
        let mut s = lock(&self.state);
        let proof = match &*s {
            SetupState::Ready(link) => Some(Proof::Closes(Arc::clone(link.watch()))),
            SetupState::Failed(_, p) => Some(p.clone()),
            SetupState::Closed(p) => p.clone(),
            SetupState::Pending => None,
        };
        *s = SetupState::Closed(proof);
        drop(s);
        self.changed.notify_all();
    }

    /// `None` while setup runs; then whether it completed (and the peer
    /// is still attached).
    pub(crate) fn ready(&self) -> Option<bool> {
        match &*lock(&self.state) {
            SetupState::Pending => None,
            SetupState::Ready(_) => Some(true),
            SetupState::Failed(..) | SetupState::Closed(_) => Some(false),
        }
    }

    /// Whether a set-up peer closed its end of the liveness link (it
    /// exited, or detached after its last batch).
    pub(crate) fn peer_closed(&self) -> bool {
        matches!(&*lock(&self.state), SetupState::Ready(link) if link.watch().peer_closed())
    }

    /// Whether the peer can no longer touch our memory: our setup with it
    /// failed before it could reach our memory, or it closed its end of the
    /// liveness link (after its last batch) or exited. Our setup failing
    /// later, or a detach while it still runs, proves nothing.
    pub(crate) fn peer_cannot_access(&self) -> bool {
        match &*lock(&self.state) {
            SetupState::Pending | SetupState::Closed(None) => false,
            SetupState::Ready(link) => link.watch().peer_closed(),
            SetupState::Failed(_, p) | SetupState::Closed(Some(p)) => p.holds(),
        }
    }

    /// Waits (until the setup timeout, counted from attach) for the
    /// outcome: the ready connection, or why there is none.
    pub(crate) fn wait(&self, node: &str) -> Result<Arc<L>, ChannelError> {
        let timeout = self.bounds.setup_timeout;
        let deadline = self.started + timeout;
        let mut s = lock(&self.state);
        loop {
            match &*s {
                SetupState::Ready(l) => return Ok(Arc::clone(l)),
                SetupState::Failed(m, _) => {
                    return Err(ChannelError::Handshake(format!(
                        "{} setup with {node} failed: {m}",
                        self.bounds.channel
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
                        "{} setup with {node} ({})",
                        self.bounds.channel, self.bounds.setup_steps
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

/// A batch's pages and its waiter, whatever the pages' type.
pub(crate) trait Finish: Send {
    /// The device finished the batch: report with the pages.
    fn complete(self: Box<Self>, result: Result<(), ChannelError>);
    /// The batch is given up while the device may still use its pages:
    /// report now without them; they stay quarantined in what is returned
    /// until the device is done with them.
    fn abandon(self: Box<Self>, result: Result<(), ChannelError>) -> Box<dyn Send>;
}

pub(crate) struct Batch<P> {
    pub(crate) ops: Vec<TransferOp<P>>,
    pub(crate) tx: CompletionSender<P>,
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

/// What one look at a running batch found.
pub(crate) enum Polled {
    /// The device finished every op.
    Done,
    /// Still running.
    Waiting,
    /// It ended failed, and the device no longer touches its pages.
    Ended(ChannelError),
    /// The look itself failed: nothing says the device stopped.
    Broken(ChannelError),
}

/// A submitted batch as its channel tracks it.
pub(crate) trait Pending: Send + 'static {
    /// Looks at the batch, waiting at most about [`WAIT_SLICE`].
    fn poll(&mut self) -> Polled;
    /// The batch is given up while the device may still use `pages`: the
    /// channel keeps them until the device can no longer touch them, and
    /// returns what the completion thread must look at again for that
    /// (`None`: the channel holds them itself).
    fn abandon(self: Box<Self>, pages: Box<dyn Send>) -> Option<Box<dyn Abandoned>>;
}

/// Work given up unfinished, held by the completion thread.
pub(crate) trait Abandoned: Send {
    /// Whether the device proved the work finished (then it is dropped,
    /// and its pages with it).
    fn finished(&mut self) -> bool;
}

/// A submitted batch on its way to the completion thread.
pub(crate) struct InFlight {
    pub(crate) pending: Box<dyn Pending>,
    pub(crate) batch: Box<dyn Finish>,
    pub(crate) count: usize,
    pub(crate) deadline: Instant,
}

/// How often abandoned work is looked at when no batch comes.
const ABANDONED_CHECK: Duration = Duration::from_millis(200);

/// Reports each batch of one peer as the device finishes it (in submission
/// order, as one stream or client runs them). Ends when every sender of
/// `rx` is gone (the link was dropped: no batch holds it any more).
/// `stuck` is set once a batch was given up: later batches get no grace.
pub(crate) fn complete_loop(
    rx: &Receiver<InFlight>,
    watch: &Watch,
    node: &str,
    bounds: &Bounds,
    stuck: &AtomicBool,
) {
    let mut abandoned: Vec<Box<dyn Abandoned>> = Vec::new();
    loop {
        abandoned.retain_mut(|a| !a.finished());
        let entry = match rx.recv_timeout(ABANDONED_CHECK) {
            Ok(e) => e,
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => continue,
            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => break,
        };
        let InFlight {
            mut pending,
            batch,
            count,
            deadline,
        } = entry;
        let was_stuck = stuck.load(Ordering::SeqCst);
        match wait_batch(
            pending.as_mut(),
            watch,
            node,
            bounds,
            was_stuck,
            count,
            deadline,
        ) {
            Ok(result) => {
                drop(pending);
                batch.complete(result);
            }
            Err(error) => {
                stuck.store(true, Ordering::SeqCst);
                let pages = batch.abandon(Err(error));
                abandoned.extend(pending.abandon(pages));
            }
        }
    }
}

/// `Ok(outcome)` once the device finished the batch (or it ended failed
/// with its pages free); `Err` when it was abandoned unfinished (peer gone
/// past the grace, past the deadline, or the look itself failed).
fn wait_batch(
    pending: &mut dyn Pending,
    watch: &Watch,
    node: &str,
    bounds: &Bounds,
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
        match pending.poll() {
            Polled::Done => {
                return Ok(match watch.check() {
                    Ok(()) => Ok(()),
                    Err(d) => Err(gone(format!(
                        "{d}; the batch of {count} op(s) ran, but not with a live peer"
                    ))),
                })
            }
            Polled::Waiting => {}
            Polled::Ended(e) => return Ok(Err(e)),
            Polled::Broken(e) => return Err(e),
        }
        let now = Instant::now();
        if gone_at.is_none() {
            if let Err(d) = watch.check() {
                gone_at = Some((now, d));
            }
        }
        if let Some((at, d)) = &gone_at {
            if stuck || now.duration_since(*at) >= bounds.gone_grace {
                return Err(gone(format!(
                    "{d}; the batch of {count} op(s) did not finish"
                )));
            }
        }
        if now >= deadline {
            return Err(ChannelError::Timeout {
                what: format!("{} batch of {count} op(s) with peer {node}", bounds.channel),
                after: bounds.batch_timeout,
            });
        }
    }
}

/// Whether the device proved that abandoned work finished: only its own
/// word that the work completed counts. A failed query is no proof that
/// the device stopped writing, so the work's pages stay quarantined (and
/// are looked at again on the next pass).
pub(crate) fn proven_finished<E: std::fmt::Display>(query: Result<bool, E>, node: &str) -> bool {
    match query {
        Ok(done) => done,
        Err(e) => {
            log::warn!(
                "abandoned work to {node}: querying whether it finished failed ({e}); its \
                 pages stay quarantined until the device says it did"
            );
            false
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
        abandoned.retain(|_| !proven_finished(Ok::<bool, ascend_sys::Error>(true), "peer"));
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
            "the KV cache slots of this read",
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
            "nothing",
            || panic!("no failure"),
        );
    }
}

#[cfg(test)]
mod setup_tests {
    use super::*;
    use std::io::Read;
    use std::net::{TcpListener, TcpStream};

    struct FakeLink(Arc<Watch>);

    impl Watched for FakeLink {
        fn watch(&self) -> &Arc<Watch> {
            &self.0
        }
    }

    /// Our end of a liveness link, and the peer's.
    fn link() -> (Arc<Watch>, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let ours = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (theirs, _) = l.accept().unwrap();
        (Arc::new(Watch::new(ours).unwrap()), theirs)
    }

    fn cell() -> SetupCell<FakeLink> {
        let t = Duration::from_secs(5);
        SetupCell::new(Bounds {
            channel: "test",
            setup_steps: "test",
            setup_timeout: t,
            batch_timeout: t,
            gone_grace: t,
        })
    }

    fn proven_within(cell: &SetupCell<FakeLink>, timeout: Duration) -> bool {
        let end = Instant::now() + timeout;
        while !cell.peer_cannot_access() {
            if Instant::now() >= end {
                return false;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        true
    }

    /// Our setup failing proves the peer off our memory only when it
    /// failed before the peer could reach it; after, only the peer closing
    /// its end of the liveness link does (ours is closed at the failure,
    /// so it learns we are gone), detached or not.
    #[test]
    fn a_failed_setup_is_proof_only_if_the_peer_never_reached_our_memory() {
        let c = cell();
        c.finish(Err(SetupFailure::unexposed("no liveness link")));
        assert!(c.peer_cannot_access());
        let e = c.wait("peer").map(|_| ()).unwrap_err().to_string();
        assert!(e.contains("no liveness link"), "{e}");

        let (w, mut theirs) = link();
        let c = cell();
        c.finish(Err(SetupFailure::exposed("a buffer is not covered", &w)));
        assert!(!proven_within(&c, Duration::from_millis(200)));
        theirs
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        assert_eq!(theirs.read(&mut [0u8; 1]).unwrap(), 0, "our end is closed");
        c.close();
        assert!(!proven_within(&c, Duration::from_millis(200)), "detached");
        drop(theirs);
        assert!(proven_within(&c, Duration::from_secs(10)));
    }

    /// A peer detached while its setup still runs is not proven off our
    /// memory: the setup may complete (then its link tells) or fail after
    /// the peer reached our memory.
    #[test]
    fn a_detach_while_setup_runs_waits_for_its_outcome() {
        let c = cell();
        c.close();
        assert!(!c.peer_cannot_access(), "the setup still runs");
        let (w, theirs) = link();
        c.finish(Ok(FakeLink(Arc::clone(&w))));
        assert!(!proven_within(&c, Duration::from_millis(200)));
        drop(theirs);
        assert!(proven_within(&c, Duration::from_secs(10)));

        let c = cell();
        c.close();
        let (w, theirs) = link();
        c.finish(Err(SetupFailure::exposed("late", &w)));
        assert!(!proven_within(&c, Duration::from_millis(200)));
        drop(theirs);
        assert!(proven_within(&c, Duration::from_secs(10)));

        let c = cell();
        c.close();
        c.finish(Err(SetupFailure::unexposed("early")));
        assert!(c.peer_cannot_access());
    }
}
