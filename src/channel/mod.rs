//! Transfer channels: one-sided, batched reads and writes into a peer's
//! registered pools.
//!
//! Every implementation works the same way: a channel is built over the
//! local pools; a [handshake] exchanges buffer tables (and the
//! channel's own endpoint data) with a peer and yields a [`PeerId`]; then
//! [`TransferChannel::submit_read`] / [`TransferChannel::submit_write`]
//! move bytes between local pages and the peer's pages, addressed by
//! [`BufferRef`] and bounds-checked against the peer's table before
//! anything is copied.
//!
//! **Pages belong to their transfer.** A batch takes its local pages by
//! value — [`MemObj`]s to read into, [`SealedMemObj`]s to write from — and
//! its [`Completion`] gives them back once the channel can no longer touch
//! them. A waiter that gives up leaves them with the transfer, counted as
//! quarantined, until it ends. Pages a *peer* accesses one-sidedly are
//! covered by [grants](grant): tcp refuses what no live grant allows, and
//! a revoked grant's pages stay with their owner until
//! [`TransferChannel::is_quiescent`].
//!
//! - [`shm`]: same host; the peer's memfd pools are mapped and ops are memcpys.
//! - [`tcp`]: any network; a transfer server per node streams bytes in and
//!   out of registered pools (NPU pools staged through pinned host memory).
//! - [`hccl`]: HCCL one-sided put/get through ascend-sys, one two-rank
//!   communicator per peer pair (tested against the CANN emulator only).
//! - [`hixl`]: HIXL's client-server one-sided put/get through ascend-sys,
//!   one server per worker and one client per peer (tested against the
//!   CANN emulator only).

mod completion;
pub mod grant;
pub mod handshake;
pub mod hccl;
pub mod hixl;
mod liveness;
mod one_sided;
pub mod shm;
mod staging;
pub mod tcp;

pub use completion::{Completion, Done};
pub(crate) use completion::{CompletionSender, LocalPage};
pub use grant::{Access, GrantId, GrantStats, GrantTag};

use crate::auth::Secret;
use crate::config::{ChannelKind, HcclPath};
pub use crate::memory::DirectRegistration;
use crate::memory::{
    BufferRef, DeviceKind, MemObj, Page, PagePool, RegisteredBuffer, SealedMemObj,
};
/// The path a channel's ops take over an Ascend link ([`TransferChannel::link_path`]).
pub use ascend_sys::link::Path as LinkPath;
use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;
use std::time::Instant;
use uuid::Uuid;

/// What a peer needs to address one registered pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BufferDesc {
    /// The pool's UUID.
    pub uuid: Uuid,
    /// Base address in the owner's address space (informational for shm/tcp,
    /// the remote address for hccl).
    pub base: u64,
    /// Bytes in the pool.
    pub len: u64,
    /// Bytes per page.
    pub page_size: u64,
    /// CPU or NPU.
    pub device: DeviceKind,
}

impl BufferDesc {
    /// The descriptor of a local buffer.
    pub fn of(buffer: &RegisteredBuffer) -> BufferDesc {
        BufferDesc {
            uuid: buffer.uuid(),
            base: buffer.base(),
            len: buffer.len() as u64,
            page_size: buffer.page_size() as u64,
            device: buffer.device(),
        }
    }

    /// Pages in the pool.
    pub fn pages(&self) -> u64 {
        self.len / self.page_size
    }
}

/// A peer's buffer table, validated on arrival: every later reference is
/// checked against it.
#[derive(Clone, Debug, Default)]
pub struct PeerTable {
    by_uuid: HashMap<Uuid, BufferDesc>,
}

impl PeerTable {
    /// Validates a received table: page sizes non-zero, lengths whole pages,
    /// no duplicate UUIDs, no address overflow.
    pub fn new(descs: &[BufferDesc]) -> Result<PeerTable, ChannelError> {
        let mut by_uuid = HashMap::new();
        for d in descs {
            let bad = |why: &str| ChannelError::Handshake(format!("peer buffer {}: {why}", d.uuid));
            if d.page_size == 0 {
                return Err(bad("page size 0"));
            }
            if d.len == 0 || d.len % d.page_size != 0 {
                return Err(bad("length is not a positive whole number of pages"));
            }
            if d.base.checked_add(d.len).is_none() {
                return Err(bad("base + length overflows"));
            }
            if d.pages() > u64::from(u32::MAX) {
                return Err(bad("more pages than a u32 index can address"));
            }
            if by_uuid.insert(d.uuid, *d).is_some() {
                return Err(bad("UUID listed twice"));
            }
        }
        Ok(PeerTable { by_uuid })
    }

    /// The descriptor of `uuid`.
    pub fn get(&self, uuid: &Uuid) -> Option<&BufferDesc> {
        self.by_uuid.get(uuid)
    }

    /// All descriptors.
    pub fn descs(&self) -> impl Iterator<Item = &BufferDesc> {
        self.by_uuid.values()
    }

    /// Checks op `i` of a direct `what` ("read" or "write"): `len` bytes at
    /// `offset` of `remote` must lie inside one page of a known buffer.
    /// Returns the byte offset of that page in its buffer.
    pub(crate) fn resolve_range(
        &self,
        i: usize,
        remote: BufferRef,
        offset: usize,
        len: usize,
        what: &str,
    ) -> Result<u64, ChannelError> {
        self.resolve(remote, offset.saturating_add(len))
            .map(|(_, page)| page)
            .map_err(|reason| ChannelError::BadRef {
                op: i,
                remote,
                reason: format!("a direct {what} of {len} bytes at offset {offset}: {reason}"),
            })
    }

    /// [`PeerTable::resolve_range`] of a direct read.
    pub(crate) fn resolve_direct(&self, i: usize, op: &DirectRead) -> Result<u64, ChannelError> {
        self.resolve_range(i, op.remote, op.offset, op.len, "read")
    }

    /// Checks that `len` bytes at `remote` lie inside one page of a known
    /// buffer; returns the descriptor and the byte offset of the page.
    pub fn resolve(&self, remote: BufferRef, len: usize) -> Result<(&BufferDesc, u64), String> {
        let d = self
            .by_uuid
            .get(&remote.uuid)
            .ok_or_else(|| format!("unknown buffer {}", remote.uuid.simple()))?;
        if u64::from(remote.page) >= d.pages() {
            return Err(format!(
                "page {} out of range (buffer {} has {} pages)",
                remote.page,
                remote.uuid.simple(),
                d.pages()
            ));
        }
        if len as u64 > d.page_size {
            return Err(format!(
                "{len} bytes exceed the {}-byte page of buffer {}",
                d.page_size,
                remote.uuid.simple()
            ));
        }
        Ok((d, u64::from(remote.page) * d.page_size))
    }
}

/// One range of a direct read: `len` bytes at `offset` of a remote page
/// straight into caller memory at `dst` (a KV cache), with no local page
/// in between.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DirectRead {
    /// The remote page.
    pub remote: BufferRef,
    /// Where the range starts in that page.
    pub offset: usize,
    /// The address it goes to: a host address, or a device address in
    /// memory registered with the channel ([`TransferChannel::register_direct`]).
    pub dst: usize,
    /// Bytes.
    pub len: usize,
}

/// One range of a direct write: `len` bytes of caller memory at `src` (a
/// KV cache) straight to `offset` of a remote page, with no local page in
/// between.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DirectWrite {
    /// The host address the bytes come from.
    pub src: usize,
    /// The remote page.
    pub remote: BufferRef,
    /// Where the range starts in that page.
    pub offset: usize,
    /// Bytes.
    pub len: usize,
}

/// One transfer: `len` bytes between byte `local_offset` of a local page
/// and byte `remote_offset` of a remote page (a whole chunk is at 0 on both;
/// a layer-wise push moves one layer's rows of each chunk, from a staging
/// page that packs them, to where they belong in the receiver's pages).
/// The op owns its local page until its batch completes.
#[derive(Debug)]
pub struct TransferOp<P> {
    /// The local page (destination of a read, source of a write).
    pub local: P,
    /// The remote page.
    pub remote: BufferRef,
    /// Where the range starts in the local page.
    pub local_offset: usize,
    /// Where the range starts in the remote page.
    pub remote_offset: usize,
    /// Bytes to move (each range inside its page).
    pub len: usize,
}

impl<P: std::ops::Deref<Target = Page>> TransferOp<P> {
    /// An op moving the local chunk's real bytes (`local.byte_len()`).
    pub fn chunk(local: P, remote: BufferRef) -> TransferOp<P> {
        let len = local.byte_len();
        TransferOp::between(local, 0, remote, 0, len)
    }

    /// An op moving `len` bytes at `offset` of both pages.
    pub fn range(local: P, remote: BufferRef, offset: usize, len: usize) -> TransferOp<P> {
        TransferOp::between(local, offset, remote, offset, len)
    }

    /// An op moving `len` bytes from `local_offset` of the local page to
    /// (or from) `remote_offset` of the remote page.
    pub fn between(
        local: P,
        local_offset: usize,
        remote: BufferRef,
        remote_offset: usize,
        len: usize,
    ) -> TransferOp<P> {
        TransferOp {
            local,
            remote,
            local_offset,
            remote_offset,
            len,
        }
    }

    /// Where the range ends in the local page.
    pub fn local_end(&self) -> usize {
        self.local_offset.saturating_add(self.len)
    }

    /// Where the range ends in the remote page.
    pub fn remote_end(&self) -> usize {
        self.remote_offset.saturating_add(self.len)
    }
}

/// A read: the peer's page into a local page this op owns.
pub type ReadOp = TransferOp<MemObj>;

/// A write: a sealed local page into the peer's page.
pub type WriteOp = TransferOp<SealedMemObj>;

/// Read (remote → local) or write (local → remote).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OpKind {
    /// Copy from the peer's page into the local page.
    Read,
    /// Copy from the local page into the peer's page.
    Write,
}

/// A peer attached to a channel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PeerId(pub u64);

impl fmt::Display for PeerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "peer#{}", self.0)
    }
}

/// Why a channel operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ChannelError {
    /// An op addresses memory the peer did not register (nothing was moved).
    #[error("op {op}: bad remote reference {remote}: {reason}")]
    BadRef {
        /// Index of the op in its batch.
        op: usize,
        /// The reference.
        remote: BufferRef,
        /// What is wrong with it.
        reason: String,
    },
    /// An op's local side is unusable (nothing was moved).
    #[error("op {op}: bad local page {local}: {reason}")]
    BadLocal {
        /// Index of the op in its batch.
        op: usize,
        /// The local page.
        local: BufferRef,
        /// What is wrong with it.
        reason: String,
    },
    /// The peer went away (process exited, connection reset).
    #[error("{peer} is gone{}: {detail}", op.map(|o| format!(" (during op {o})")).unwrap_or_default())]
    PeerGone {
        /// Which peer.
        peer: String,
        /// The op that was running, if known.
        op: Option<usize>,
        /// What was observed.
        detail: String,
    },
    /// The peer did not answer in time.
    #[error("{what}: no answer within {after:?}")]
    Timeout {
        /// What was waited for.
        what: String,
        /// How long.
        after: Duration,
    },
    /// The peer reported an error for an op.
    #[error("op {op}: the peer refused it: {message}")]
    Remote {
        /// Index of the op in its batch.
        op: usize,
        /// The peer's message.
        message: String,
    },
    /// The handshake failed (bad table, wrong version, mode or channel).
    #[error("handshake: {0}")]
    Handshake(String),
    /// The two sides run different transfer modes.
    #[error("transfer mode mismatch: this side runs {local}, the peer {peer} runs {remote}; set the same pd_pull_mode / pd_delay_pull on both")]
    ModeMismatch {
        /// This side's mode.
        local: String,
        /// The peer's mode.
        remote: String,
        /// The peer's node id.
        peer: String,
    },
    /// The channel cannot do this (e.g. an NPU pool on shm).
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// No such peer is attached.
    #[error("{0} is not attached (handshake first, or it was replaced by a reconnect)")]
    UnknownPeer(PeerId),
    /// An I/O error outside any op.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A side-channel (ZMQ) error.
    #[error("{context}: {source}")]
    Zmq {
        /// What was being done.
        context: String,
        /// The ZMQ error.
        #[source]
        source: zmq::Error,
    },
    /// A transfer worker died without reporting (a bug; logged, never a hang).
    #[error("transfer worker ended without a result: {0}")]
    WorkerLost(String),
    /// The NPU runtime (ACL / HCCL) failed.
    #[error("{context}: {source}")]
    Npu {
        /// What was being done.
        context: String,
        /// The runtime's error.
        #[source]
        source: ascend_sys::Error,
    },
}

/// What the channel puts in our half of the handshake so the peer can reach our pools.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// shm: our pid and, per buffer (table order), the memfd number to open via `/proc`.
    Shm {
        /// Process id.
        pid: u32,
        /// One fd per buffer, in table order.
        fds: Vec<i32>,
    },
    /// tcp: where our transfer server listens.
    Tcp {
        /// `host:port`.
        addr: String,
    },
    /// hccl: the communicator rendezvous. The connecting side offers a
    /// fresh root info per connection (it becomes rank 0); the listening
    /// side answers with an empty `root_info` and the same `session`.
    Hccl {
        /// The HCCL root info (exactly `ascend_sys::ROOT_INFO_LEN` bytes) in
        /// an offer; empty in an answer or a plain advertisement.
        root_info: Vec<u8>,
        /// Names the offer (random), so the answer can be matched to it.
        session: u64,
        /// The NPU this side's communicator runs on (informational).
        device: u32,
        /// `host:port` of this side's liveness link listener: a TCP
        /// connection per peer whose closing tells that the peer is gone.
        watch: String,
    },
    /// hixl: where this side's HIXL server listens and its device
    /// endpoint. The connecting side offers a fresh `session` per
    /// connection; the listening side answers with the same one.
    Hixl {
        /// Names the offer (random); 0 in a plain advertisement.
        session: u64,
        /// `ip:port` of this side's HIXL server.
        server: String,
        /// This side's HIXL endpoint (protocol, device physical id, RoCE
        /// address), which the peer's client names as its remote.
        device: ascend_sys::HixlEndpoint,
        /// `host:port` of this side's liveness link listener (as hccl's).
        watch: String,
    },
}

/// A one-sided transfer channel over the local pools.
pub trait TransferChannel: Send + Sync {
    /// Which implementation.
    fn kind(&self) -> ChannelKind;

    /// The local buffer table (one entry per registered pool).
    fn local_table(&self) -> Vec<BufferDesc>;

    /// How a peer reaches our pools (sent in the handshake).
    fn endpoint(&self) -> Endpoint;

    /// The endpoint to send when connecting, when it must be fresh for each
    /// connection (hccl: a new root info). `None`: send [`TransferChannel::endpoint`].
    fn offer(&self) -> Result<Option<Endpoint>, ChannelError> {
        Ok(None)
    }

    /// The endpoint to answer a connecting peer's `offered` one with, when it
    /// depends on the offer (hccl echoes the session). `None`: the hello's own.
    fn answer(&self, offered: &Endpoint) -> Option<Endpoint> {
        let _ = offered;
        None
    }

    /// Waits (bounded by the channel's own setup timeout) until `peer` can
    /// move data, and reports a failed setup. Channels whose attach is
    /// complete on return have nothing to wait for.
    fn wait_ready(&self, peer: PeerId) -> Result<(), ChannelError> {
        let _ = peer;
        Ok(())
    }

    /// Sets up access to a peer from its table and endpoint. `node` names the
    /// peer; attaching a node again replaces its old connection.
    fn attach(
        &self,
        node: &str,
        table: &[BufferDesc],
        endpoint: &Endpoint,
    ) -> Result<PeerId, ChannelError>;

    /// Drops a peer's connection (in-flight batches finish or fail on
    /// their own, keeping their pages until they do).
    fn detach(&self, peer: PeerId);

    /// Attached peers known to be gone: their process exited (shm, seen
    /// through its pidfd) or they closed their side of the pair (hccl's
    /// liveness link). Nothing of ours is read or written by them any
    /// more; the caller detaches them, which unmaps (shm) or closes (hccl)
    /// what the attachment held. tcp cannot tell: none.
    fn gone_peers(&self) -> Vec<PeerId> {
        Vec::new()
    }

    /// Starts reading into `ops`' pages; every op is validated before any
    /// byte moves (a refused batch's pages are dropped untouched).
    fn submit_read(
        &self,
        peer: PeerId,
        ops: Vec<ReadOp>,
    ) -> Result<Completion<MemObj>, ChannelError>;

    /// Starts writing `ops`' sealed pages into the peer's pages, under the
    /// peer's grant tagged `tag` (see [`GrantTag`]; tcp sends it with every
    /// request and the peer refuses a write its grant's tag does not match).
    fn submit_write(
        &self,
        peer: PeerId,
        tag: GrantTag,
        ops: Vec<WriteOp>,
    ) -> Result<Completion<SealedMemObj>, ChannelError>;

    /// The software path this channel's one-sided ops take over an Ascend
    /// link, so that a load can price its op sizes with a link model
    /// ([`ascend_sys::link`], `pd_npu_link`): hccl's communication domain
    /// is [`LinkPath::Comm`]. `None` for channels whose cost does not follow
    /// the NPU link table (shm, tcp).
    fn link_path(&self) -> Option<LinkPath> {
        None
    }

    /// Whether [`TransferChannel::read_direct`] can read into memory of
    /// `device` (once registered, for channels with a
    /// [`TransferChannel::direct_registry`]).
    fn reads_direct(&self, device: DeviceKind) -> bool {
        let _ = device;
        false
    }

    /// `Some(id)` when direct reads can only land in memory registered with
    /// this channel instance ([`TransferChannel::register_direct`]); `id`
    /// names the instance, so a registration is never taken for another.
    fn direct_registry(&self) -> Option<u64> {
        None
    }

    /// Registers `regions` (address, bytes) of `device` as destinations of
    /// [`TransferChannel::read_direct`]; `Ok(None)` when the channel needs
    /// no registration. Refused (the caller stages instead) when the channel
    /// cannot address that memory.
    ///
    /// # Safety
    /// Each region must be memory of `device`, allocated by the runtime the
    /// channel uses, and stay allocated until the registration is dropped.
    unsafe fn register_direct(
        &self,
        device: DeviceKind,
        regions: &[(usize, usize)],
    ) -> Result<Option<DirectRegistration>, ChannelError> {
        let _ = (device, regions);
        Ok(None)
    }

    /// Makes `peer`'s connection ready for direct reads into the memory
    /// registered so far (hccl registers it on the peer's communicator),
    /// so a load can still choose to stage when that fails.
    fn prepare_direct(&self, peer: PeerId) -> Result<(), ChannelError> {
        let _ = peer;
        Ok(())
    }

    /// Reads every range of `ops` from `peer` straight into caller memory
    /// (host memory, or registered device memory) and returns once each has
    /// landed or failed — never earlier, so no copy
    /// outlives the call. Every remote range is validated before any byte
    /// moves. A read still waiting for the peer at `deadline` (the pulls'
    /// lease end, after which the peer may reuse its pages) is given up and
    /// its connection dropped, so nothing it would deliver later lands.
    /// Channels that cannot address caller memory refuse (the caller
    /// stages through its pages instead).
    ///
    /// # Safety
    /// Each `[dst, dst + len)` must be memory the caller may write for the
    /// whole call (host memory, or device memory it registered), that nothing else reads or writes meanwhile, and the
    /// ranges must not overlap one another.
    unsafe fn read_direct(
        &self,
        peer: PeerId,
        ops: &[DirectRead],
        deadline: Instant,
    ) -> Result<(), ChannelError> {
        let _ = (peer, ops, deadline);
        Err(ChannelError::Unsupported(format!(
            "the {} channel cannot read into caller memory",
            self.kind().name()
        )))
    }

    /// Whether [`TransferChannel::write_direct`] can send from caller
    /// memory on `device`.
    fn writes_direct(&self, device: DeviceKind) -> bool {
        let _ = device;
        false
    }

    /// Writes every range of `ops` from caller host memory straight into
    /// `peer`'s pages (granted to us for writing, under `tag`) and returns
    /// once each has landed or failed — never earlier, so no copy outlives
    /// the call. Every remote range is validated before any byte moves. A
    /// write still waiting for the peer at `deadline` is given up and its
    /// connection dropped. Channels that cannot send from caller memory
    /// refuse (the caller stages through its pages instead).
    ///
    /// # Safety
    /// Each `[src, src + len)` must be host memory the caller may read for
    /// the whole call and that nothing writes meanwhile.
    unsafe fn write_direct(
        &self,
        peer: PeerId,
        tag: GrantTag,
        ops: &[DirectWrite],
        deadline: Instant,
    ) -> Result<(), ChannelError> {
        let _ = (peer, tag, ops, deadline);
        Err(ChannelError::Unsupported(format!(
            "the {} channel cannot write from caller memory",
            self.kind().name()
        )))
    }

    /// Reads a batch and waits for it; the pages come back on success.
    fn read(&self, peer: PeerId, ops: Vec<ReadOp>) -> Result<Vec<MemObj>, ChannelError> {
        let done = self.submit_read(peer, ops)?.wait();
        done.result.map(|()| done.pages)
    }

    /// Writes a batch under the peer's grant tagged `tag` and waits for it.
    fn write(&self, peer: PeerId, tag: GrantTag, ops: Vec<WriteOp>) -> Result<(), ChannelError> {
        self.submit_write(peer, tag, ops)?.wait().result
    }

    /// Lets `peer` access `pages` of our pools with `access`, by requests
    /// tagged `tag`, until the grant is released or revoked (see [`grant`]).
    fn grant(
        &self,
        peer: PeerId,
        access: Access,
        tag: GrantTag,
        pages: &[BufferRef],
    ) -> Result<GrantId, ChannelError>;

    /// The peer reported it is done with the grant's pages (its write
    /// landed or failed quiescently, its reads ended, its lease passed).
    /// Returns whether nobody can touch the pages through this grant any
    /// more; false while requests of the peer are still being served in
    /// them (tcp; reads as much as writes: a page still being sent out
    /// must not go to a new owner), and then
    /// [`TransferChannel::is_quiescent`] says when they ended.
    fn release(&self, grant: GrantId) -> bool;

    /// Ends a grant without the peer's report: tcp refuses its later
    /// requests; the pages must wait for [`TransferChannel::is_quiescent`].
    fn revoke(&self, grant: GrantId);

    /// Whether the peer of a revoked grant can no longer touch its pages
    /// (true for grants that are gone).
    fn is_quiescent(&self, grant: GrantId) -> bool;

    /// The grant counters.
    fn grant_stats(&self) -> GrantStats;

    /// The deployment secret peers must prove they hold (in the handshake,
    /// and on tcp on every transfer connection); `None`: unauthenticated.
    fn auth(&self) -> Option<&Secret>;

    /// How many pages of `peer`'s buffer table this channel verified the
    /// peer really registered (a table is only what the peer says). A
    /// pull-delay receiver caps a sender's proxies by it. Conservatively
    /// [`PeerPages::Unverifiable`] unless the channel checks.
    fn verified_peer_pages(&self, peer: PeerId) -> PeerPages {
        let _ = peer;
        PeerPages::Unverifiable
    }
}

/// What a channel verified of the pages a peer registered
/// ([`TransferChannel::verified_peer_pages`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeerPages {
    /// This many pages of its table are backed by memory the channel saw
    /// (shm: mapped; hccl: inside regions the peer registered, no two
    /// buffers overlapping). 0 for an unknown or failed peer.
    Verified(u64),
    /// Not known yet (hccl: the peer's setup is still running); ask again.
    Pending,
    /// The channel cannot tell (tcp: the peer's own process serves its
    /// pages, and could answer for pages it never had).
    Unverifiable,
}

/// Pages in the buffers of `table`.
pub(crate) fn table_pages<'a>(table: impl IntoIterator<Item = &'a BufferDesc>) -> u64 {
    table
        .into_iter()
        .map(BufferDesc::pages)
        .fold(0, u64::saturating_add)
}

/// Opens the channel of `kind` over `pools`; `host` is where a tcp transfer
/// server (or the hccl / hixl liveness listener, and the HIXL server)
/// binds (the worker's own address), `node` this worker's id (its
/// handshake node; tcp presents it to peers). `hccl`, `hixl` and NPU pools
/// on `tcp` need pools allocated by the ACL runtime (`memory::npu`); the
/// device comes from the pools. `hccl` here is always HCCL's comm path,
/// and `hixl` takes the default `pd_hixl_*` settings: a worker's config
/// goes through [`open_configured`]. With `auth`, every
/// peer must prove it holds the secret ([`crate::auth`]); without, the data
/// plane is unauthenticated, and a warning says so once per process.
pub fn open(
    kind: ChannelKind,
    host: &str,
    node: &str,
    pools: &[Arc<PagePool>],
    auth: Option<Secret>,
) -> Result<Arc<dyn TransferChannel>, ChannelError> {
    open_at(kind, &Listeners::any(host), node, pools, auth)
}

/// [`open`], with each listener bound and advertised where `at` says.
pub fn open_at(
    kind: ChannelKind,
    at: &Listeners,
    node: &str,
    pools: &[Arc<PagePool>],
    auth: Option<Secret>,
) -> Result<Arc<dyn TransferChannel>, ChannelError> {
    if auth.is_none() {
        crate::auth::warn_unauthenticated_once();
    }
    Ok(match kind {
        ChannelKind::Shm => Arc::new(shm::ShmChannel::new(pools)?.with_auth(auth)),
        ChannelKind::Tcp => Arc::new(tcp::TcpChannel::bind_at(
            &at.data,
            node,
            pools,
            tcp::TcpOptions {
                auth,
                ..Default::default()
            },
        )?),
        ChannelKind::Hccl => Arc::new(
            hccl::HcclChannel::new(&at.liveness, pools, hccl::HcclOptions::default())?
                .with_auth(auth),
        ),
        ChannelKind::Hixl => Arc::new(
            hixl::HixlChannel::new(
                &at.liveness,
                pools,
                &crate::config::HixlSettings {
                    port: at.hixl_port,
                    ..Default::default()
                },
                hixl::HixlOptions::default(),
            )?
            .with_auth(auth),
        ),
    })
}

/// Which channel `transfer_channel: hccl` opens for `pd_hccl_path:
/// setting`, given whether the HIXL path can run (`hixl`: the library's
/// path, or why not: it did not load, or this worker's HIXL endpoint is
/// incomplete), and the reason, for the log. `hixl` where it cannot run is
/// an error that names the fix.
pub fn choose_hccl_path(
    setting: HcclPath,
    hixl: Result<&std::path::Path, String>,
) -> Result<(ChannelKind, String), ChannelError> {
    match (setting, hixl) {
        (HcclPath::Comm, _) => Ok((
            ChannelKind::Hccl,
            "HCCL's comm path, as pd_hccl_path: comm asks".into(),
        )),
        (HcclPath::Auto, Ok(path)) => Ok((
            ChannelKind::Hixl,
            format!(
                "the HIXL path: pd_hccl_path is auto and HIXL loaded from {}",
                path.display()
            ),
        )),
        (HcclPath::Auto, Err(why)) => Ok((
            ChannelKind::Hccl,
            format!("HCCL's comm path: pd_hccl_path is auto and the HIXL path cannot run ({why})"),
        )),
        (HcclPath::Hixl, Ok(path)) => Ok((
            ChannelKind::Hixl,
            format!(
                "the HIXL path, as pd_hccl_path: hixl asks (HIXL from {})",
                path.display()
            ),
        )),
        (HcclPath::Hixl, Err(why)) => Err(ChannelError::Unsupported(format!(
            "pd_hccl_path: hixl, but the HIXL path cannot run ({why}); where HIXL is missing, \
             install it (libcann_hixl.so, CANN 9.1 or the hixl package) next to libascendcl.so or \
             in ASCEND_PD_CANN_LIB_DIR, or set pd_hccl_path: comm (or auto) to run HCCL's comm \
             path"
        ))),
    }
}

/// Opens the channel `config` asks for over `pools` (see [`open`]):
/// `transfer_channel: hccl` runs the path [`choose_hccl_path`] picks for
/// its `pd_hccl_path` (logged, with the reason), and the HIXL path takes
/// the `pd_hixl_*` keys.
pub fn open_configured(
    config: &crate::config::PdConfig,
    at: &Listeners,
    node: &str,
    pools: &[Arc<PagePool>],
    auth: Option<Secret>,
) -> Result<Arc<dyn TransferChannel>, ChannelError> {
    let kind = match config.transfer_channel {
        ChannelKind::Hccl => {
            let acl = pools
                .iter()
                .find_map(|p| crate::memory::npu::device_of(p.buffer()))
                .map(|d| d.acl().clone());
            let hixl =
                match &acl {
                    Some(acl) => acl.hixl().map_err(|e| e.to_string()).and_then(|h| {
                        match hixl::endpoint_problem(&config.hixl, acl.is_emulator()) {
                            Some(problem) => Err(problem),
                            None => Ok(h),
                        }
                    }),
                    None => Err("no pool was allocated by the ACL runtime".into()),
                };
            let (kind, why) = choose_hccl_path(
                config.hccl_path,
                hixl.as_ref()
                    .map(|h| h.library_path())
                    .map_err(Clone::clone),
            )?;
            log::info!("transfer_channel hccl runs {why}");
            kind
        }
        kind => kind,
    };
    if kind != ChannelKind::Hixl {
        return open_at(kind, at, node, pools, auth);
    }
    if auth.is_none() {
        crate::auth::warn_unauthenticated_once();
    }
    Ok(Arc::new(
        hixl::HixlChannel::new(
            &at.liveness,
            pools,
            &crate::config::HixlSettings {
                port: at.hixl_port,
                ..config.hixl
            },
            hixl::HixlOptions::default(),
        )?
        .with_auth(auth),
    ))
}

/// Validates a batch against the peer table: the remote range exists and
/// the local page is host memory large enough. Returns each op's remote
/// page offset in its buffer.
pub(crate) fn check_ops<P: LocalPage>(
    table: &PeerTable,
    ops: &[TransferOp<P>],
    local_host_only: bool,
) -> Result<Vec<u64>, ChannelError> {
    ops.iter()
        .enumerate()
        .map(|(i, op)| {
            let (_, off) = table
                .resolve(op.remote, op.remote_end())
                .map_err(|reason| ChannelError::BadRef {
                    op: i,
                    remote: op.remote,
                    reason,
                })?;
            let page = op.local.pool().buffer().page_size();
            let bad_local = |reason: String| ChannelError::BadLocal {
                op: i,
                local: op.local.buffer_ref(),
                reason,
            };
            if op.local_end() > page {
                return Err(bad_local(format!(
                    "{} bytes at offset {} exceed the local {page}-byte page",
                    op.len, op.local_offset
                )));
            }
            if local_host_only && op.local.device() != DeviceKind::Cpu {
                return Err(bad_local(format!(
                    "{} memory; this channel moves host memory only",
                    op.local.device()
                )));
            }
            Ok(off)
        })
        .collect()
}

/// The peers attached to a channel, by id. Attaching a node again replaces
/// its old entry (a restarted peer), so stale ids fail as `UnknownPeer`.
pub(crate) struct PeerRegistry<P> {
    peers: std::sync::Mutex<HashMap<PeerId, (String, Arc<P>)>>,
    next: std::sync::atomic::AtomicU64,
}

impl<P> Default for PeerRegistry<P> {
    fn default() -> Self {
        PeerRegistry {
            peers: std::sync::Mutex::new(HashMap::new()),
            next: std::sync::atomic::AtomicU64::new(1),
        }
    }
}

impl<P> PeerRegistry<P> {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<PeerId, (String, Arc<P>)>> {
        self.peers.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers `peer` as `node`; returns its id and the entries it replaced.
    pub(crate) fn insert(&self, node: &str, peer: Arc<P>) -> (PeerId, Vec<Arc<P>>) {
        let id = PeerId(self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
        let mut peers = self.lock();
        let old: Vec<PeerId> = peers
            .iter()
            .filter(|(_, (n, _))| n == node)
            .map(|(id, _)| *id)
            .collect();
        let replaced = old
            .into_iter()
            .filter_map(|id| peers.remove(&id).map(|(_, p)| p))
            .collect();
        peers.insert(id, (node.to_string(), peer));
        (id, replaced)
    }

    /// The peer `id` and its node.
    pub(crate) fn entry(&self, id: PeerId) -> Result<(String, Arc<P>), ChannelError> {
        self.lock()
            .get(&id)
            .map(|(n, p)| (n.clone(), Arc::clone(p)))
            .ok_or(ChannelError::UnknownPeer(id))
    }

    /// The peer `id`.
    pub(crate) fn get(&self, id: PeerId) -> Result<Arc<P>, ChannelError> {
        self.lock()
            .get(&id)
            .map(|(_, p)| Arc::clone(p))
            .ok_or(ChannelError::UnknownPeer(id))
    }

    /// Forgets the peer `id`.
    pub(crate) fn remove(&self, id: PeerId) -> Option<Arc<P>> {
        self.lock().remove(&id).map(|(_, p)| p)
    }

    /// The peers for which `f` holds.
    pub(crate) fn select(&self, f: impl Fn(&P) -> bool) -> Vec<PeerId> {
        self.lock()
            .iter()
            .filter(|(_, (_, p))| f(p))
            .map(|(id, _)| *id)
            .collect()
    }
}

/// Where one listener of a worker binds, and the address peers are told
/// to reach it at (they differ behind NAT, in containers, or when binding
/// all interfaces).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ListenAt {
    /// The local address to bind (`pd_bind_host`; `0.0.0.0` for all).
    pub bind: String,
    /// The host put in the endpoint peers dial (`pd_peer_host`).
    pub advertise: String,
    /// The port (0: a free port, picked at bind).
    pub port: u16,
}

impl ListenAt {
    /// Binds and advertises `host`, on a free port.
    pub fn any(host: &str) -> ListenAt {
        ListenAt {
            bind: host.to_string(),
            advertise: host.to_string(),
            port: 0,
        }
    }

    /// `host:port` as peers dial it (IPv6 hosts in brackets).
    pub fn advertised(&self, port: u16) -> String {
        if self.advertise.contains(':') && !self.advertise.starts_with('[') {
            format!("[{}]:{port}", self.advertise)
        } else {
            format!("{}:{port}", self.advertise)
        }
    }
}

/// The listeners a channel may open: its data server (tcp) and its
/// liveness listener (hccl, hixl); the HIXL server's port is `pd_hixl_port`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Listeners {
    /// The tcp transfer server (`pd_data_port`).
    pub data: ListenAt,
    /// The hccl / hixl liveness listener (`pd_liveness_port`); the HIXL
    /// server binds the same host.
    pub liveness: ListenAt,
    /// The HIXL server's port (`pd_hixl_port`; 0: a free port).
    pub hixl_port: u16,
}

impl Listeners {
    /// Every listener on `host` (bound and advertised), on free ports.
    pub fn any(host: &str) -> Listeners {
        Listeners {
            data: ListenAt::any(host),
            liveness: ListenAt::any(host),
            hixl_port: 0,
        }
    }
}

/// Binds a TCP listener for `what` where `at` says; returns it, the
/// address it bound and the address peers are to dial.
pub(crate) fn bind_listener(
    at: &ListenAt,
    what: &str,
) -> Result<(std::net::TcpListener, std::net::SocketAddr, String), ChannelError> {
    let host = at.bind.as_str();
    let bound = std::net::TcpListener::bind((host, at.port));
    let listener = match (bound, at.port) {
        (Ok(l), _) => Ok(l),
        // A bind "host" that already names a port (tests pass `ip:port`).
        (Err(_), 0) => std::net::TcpListener::bind(host),
        (Err(e), _) => Err(e),
    }
    .map_err(|source| ChannelError::Io {
        context: format!(
            "binding the {what} on {host}:{} (change its port key or free the port)",
            at.port
        ),
        source,
    })?;
    let addr = listener.local_addr().map_err(|source| ChannelError::Io {
        context: format!("reading the {what} address"),
        source,
    })?;
    let advertised = at.advertised(addr.port());
    Ok((listener, addr, advertised))
}

/// Watches on the local pages of a batch (for its completion).
pub(crate) fn watch_ops<P: LocalPage>(ops: &[TransferOp<P>]) -> Vec<crate::memory::PageWatch> {
    ops.iter().map(|o| o.local.watch()).collect()
}

/// The local pages of a batch, in op order.
pub(crate) fn pages_of<P>(ops: Vec<TransferOp<P>>) -> Vec<P> {
    ops.into_iter().map(|o| o.local).collect()
}

/// Checks that every page to grant is a page of one of `pools`.
pub(crate) fn check_grant_pages(
    pools: &[Arc<PagePool>],
    pages: &[BufferRef],
) -> Result<(), ChannelError> {
    for (i, r) in pages.iter().enumerate() {
        let known = pools
            .iter()
            .any(|p| p.uuid() == r.uuid && (r.page as usize) < p.buffer().num_pages());
        if !known {
            return Err(ChannelError::BadLocal {
                op: i,
                local: *r,
                reason: "not a page of this channel's pools; nothing to grant".into(),
            });
        }
    }
    Ok(())
}

/// Registers pools with a channel: every pool's descriptor, and the pools kept alive.
pub(crate) fn table_of(pools: &[Arc<PagePool>]) -> Vec<BufferDesc> {
    pools.iter().map(|p| BufferDesc::of(p.buffer())).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn desc(pages: u64) -> BufferDesc {
        BufferDesc {
            uuid: Uuid::new_v4(),
            base: 0x1000,
            len: pages * 4096,
            page_size: 4096,
            device: DeviceKind::Cpu,
        }
    }

    #[test]
    fn resolve_checks_uuid_page_and_length() {
        let d = desc(4);
        let t = PeerTable::new(&[d]).unwrap();
        let ok = t
            .resolve(
                BufferRef {
                    uuid: d.uuid,
                    page: 3,
                },
                4096,
            )
            .unwrap();
        assert_eq!(ok.1, 3 * 4096);
        let e = t
            .resolve(
                BufferRef {
                    uuid: d.uuid,
                    page: 4,
                },
                1,
            )
            .unwrap_err();
        assert!(e.contains("page 4 out of range"), "{e}");
        let e = t
            .resolve(
                BufferRef {
                    uuid: d.uuid,
                    page: 0,
                },
                4097,
            )
            .unwrap_err();
        assert!(e.contains("4097 bytes exceed"), "{e}");
        let other = Uuid::new_v4();
        let e = t
            .resolve(
                BufferRef {
                    uuid: other,
                    page: 0,
                },
                1,
            )
            .unwrap_err();
        assert!(e.contains("unknown buffer"), "{e}");
    }

    #[test]
    fn the_hccl_path_follows_the_setting_and_whether_hixl_loads() {
        let lib = std::path::Path::new("/opt/cann/lib64/libcann_hixl.so");
        let absent = || Err("libcann_hixl.so not found in /opt/cann/lib64".to_string());
        let (k, why) = choose_hccl_path(HcclPath::Auto, Ok(lib)).unwrap();
        assert_eq!(k, ChannelKind::Hixl);
        assert!(
            why.contains("auto") && why.contains("/opt/cann/lib64/libcann_hixl.so"),
            "{why}"
        );
        let (k, why) = choose_hccl_path(HcclPath::Auto, absent()).unwrap();
        assert_eq!(k, ChannelKind::Hccl);
        assert!(
            why.contains("comm path") && why.contains("not found"),
            "{why}"
        );
        for hixl in [Ok(lib), absent()] {
            let (k, why) = choose_hccl_path(HcclPath::Comm, hixl).unwrap();
            assert_eq!(k, ChannelKind::Hccl);
            assert!(why.contains("pd_hccl_path: comm"), "{why}");
        }
        let (k, _) = choose_hccl_path(HcclPath::Hixl, Ok(lib)).unwrap();
        assert_eq!(k, ChannelKind::Hixl);
        let e = choose_hccl_path(HcclPath::Hixl, absent())
            .unwrap_err()
            .to_string();
        for words in [
            "pd_hccl_path: hixl",
            "not found",
            "install it (libcann_hixl.so",
            "pd_hccl_path: comm",
        ] {
            assert!(e.contains(words), "{words}: {e}");
        }
    }

    #[test]
    fn peer_tables_reject_nonsense() {
        let mut d = desc(2);
        d.page_size = 0;
        assert!(PeerTable::new(&[d]).is_err());
        let mut d = desc(2);
        d.len = 4097;
        assert!(PeerTable::new(&[d]).is_err());
        let mut d = desc(2);
        d.base = u64::MAX - 10;
        assert!(PeerTable::new(&[d]).is_err());
        let d = desc(2);
        let e = PeerTable::new(&[d, d]).unwrap_err().to_string();
        assert!(e.contains("twice"), "{e}");
    }
}
