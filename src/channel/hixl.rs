//! `hixl`: HIXL's client-server one-sided put/get between Ascend devices
//! (`libcann_hixl.so`), through ascend-sys.
//!
//! **One server, one client per peer.** Data moves both ways (a push
//! writes into the receiver's pages, a pull reads the sender's), so each
//! side runs one [`HixlServer`] exposing every local pool (NPU pools as
//! device memory, CPU pools as ACL-pinned host memory; HIXL, like HCCL,
//! registers nothing else), registered before it listens; and for each
//! peer one [`HixlClient`], with the local pools registered before it
//! connects to that peer's server. A write is a batched put from our
//! page into the peer's, a read a batched get. Remote addresses are the
//! peer's `base + page * page_size` from its buffer table, after the
//! shared op check bounds-checked them and setup checked that the regions
//! the peer's server reported cover its whole table.
//!
//! **The handshake** carries this side's server address and HIXL endpoint
//! (protocol, device physical id, RoCE IPv4) and, like hccl, a liveness
//! listener and a session: the connecting side offers a fresh session
//! ([`TransferChannel::offer`]) and dials the liveness link; the other side
//! answers with the same session. Nothing in attach blocks: the liveness
//! link and the client's connect run on a setup thread, which
//! [`TransferChannel::wait_ready`] and every submit wait for (bounded).
//!
//! **In flight.** The channel keeps at most [`HIXL_OPS_IN_FLIGHT_LIMIT`]
//! ops in flight per client (HIXL itself bounds only a host-endpoint
//! client's unqueried transfers, by the same number, which this covers):
//! a batch is split into parts of at most that many ops, and each part
//! waits (bounded by the batch timeout) for the client's budget. Each part is polled by the completion thread; the
//! batch completes, with its pages, when its last part has.
//!
//! **Failures and pages.** HIXL only says a transfer stopped touching its
//! memory when it reports it completed, or when the client is destroyed.
//! A batch given up unfinished (peer gone past the grace, timed out, a
//! failed query) is reported failed at once; its pages stay quarantined
//! with its client, which is marked failed and replaced on the next batch,
//! and go back to their pools only after that client is destroyed (once
//! no batch holds it any more). A batch call that fails leaves the client
//! failed too (HIXL documents it), and it is replaced the same way.
//!
//! **Direct reads** (a load straight into an NPU KV cache) need the cache
//! registered on the client before it connects, and the cache is
//! registered after the channel opened. So direct reads use a second
//! client per peer, made on first use with every region registered for
//! direct reads so far; registering another region replaces it on its
//! next use, and dropping a registration destroys the direct clients that
//! have it. A direct read still running at its deadline destroys its
//! client, so nothing lands in the cache after the call returned. Direct
//! writes from caller memory are refused (as on hccl): the memory would
//! have to be registered on the client first.
//!
//! **Dead peers** are seen as on hccl, by the liveness link (see
//! `liveness`); a revoked grant is quiescent once the peer closed its end.
//! Our own setup failing does not prove it: the peer connects its client
//! to our server once its end of the liveness link opened, whatever becomes
//! of our setup after that. Only a failure before the peer's end could
//! open does (the listening side acks the link only once its setup took
//! it).
//! HIXL cannot refuse a connected client's access to the server's memory,
//! and its server takes any client that reaches its port: keep the port
//! off untrusted networks (the deployment secret authenticates the
//! handshake and the liveness link, not HIXL's own connections).
//!
//! Nothing here has run on Ascend hardware or against a real
//! `libcann_hixl.so`; it is tested against the CANN emulator
//! (`ascend-sys/emu`), which ignores the endpoint's protocol and address.

use super::liveness::{LinkRole, Watch, WatchServer};
use super::one_sided::device_channel_methods;
use super::one_sided::{
    acl_pools, batch_spans, check_coverage, complete_loop, direct_spans, lock, Abandoned, Batch,
    Bounds, DevicePeer, DevicePeers, DirectLink, DirectRegion, DirectState, Finish, InFlight,
    LocalMem, Pending, Polled, SetupFailure, Span, Watched,
};
use super::{
    pages_of, table_of, watch_ops, Access, BufferDesc, ChannelError, Completion, DirectRead,
    DirectRegistration, Endpoint, GrantId, GrantStats, GrantTag, LocalPage, OpKind, PeerId,
    PeerPages, PeerTable, ReadOp, TransferChannel, TransferOp, WriteOp,
};
use crate::auth::Secret;
use crate::config::{ChannelKind, HixlProtocol as ProtocolSetting, HixlSettings};
use crate::memory::{BufferRef, DeviceKind, MemObj, PagePool, SealedMemObj};
use ascend_sys::{
    Device, Hixl, HixlClient, HixlEndpoint, HixlMemId, HixlOp, HixlProtocol, HixlServer,
    HixlTransfer, HixlTransferState, MemKind, HIXL_OPS_IN_FLIGHT_LIMIT,
};
use crossbeam_channel::Sender;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};
use uuid::Uuid;

pub use super::hccl::HcclOptions as HixlOptions;

/// Backlog of the HIXL server's listening socket.
const SERVER_BACKLOG: u32 = 64;
/// Longest pause between two looks at a running transfer.
const MAX_POLL_PAUSE: Duration = Duration::from_millis(1);

fn hixl_err(context: String) -> impl FnOnce(ascend_sys::Error) -> ChannelError {
    move |source| ChannelError::Npu { context, source }
}

/// The HIXL endpoint of this worker's NPU `device` as `settings` describe it.
pub fn local_endpoint(settings: &HixlSettings, device: u32) -> HixlEndpoint {
    HixlEndpoint {
        protocol: match settings.protocol {
            ProtocolSetting::Roce => HixlProtocol::Roce,
            ProtocolSetting::Hccs => HixlProtocol::Hccs,
        },
        device_phy_id: settings.device_phy_id.unwrap_or(device),
        ipv4: settings.device_ip,
    }
}

/// Why `settings` cannot make a HIXL endpoint here, with the fix: RoCE
/// needs the NPU's address outside the emulator (which ignores endpoints).
pub fn endpoint_problem(settings: &HixlSettings, emulator: bool) -> Option<String> {
    (settings.protocol == ProtocolSetting::Roce && settings.device_ip.is_none() && !emulator).then(
        || {
            "a RoCE HIXL endpoint needs the NPU's RoCE address: set pd_hixl_device_ip (see \
             `hccn_tool -i <device> -ip -g`), or pd_hixl_protocol: hccs between NPUs of one \
             server"
                .to_string()
        },
    )
}

/// The hixl channel of one worker: its HIXL server over its pools, its
/// liveness listener, its peers.
pub struct HixlChannel {
    // Dropped first: stops routing liveness links to peers.
    watch: WatchServer,
    // Then the server: no client reaches our pools after it.
    _server: HixlServer,
    server_addr: String,
    hixl: Hixl,
    device: Device,
    endpoint: HixlEndpoint,
    pools: Vec<Arc<PagePool>>,
    local: Vec<LocalMem>,
    local_uuids: HashSet<Uuid>,
    opts: HixlOptions,
    offers: Mutex<HashMap<u64, Instant>>,
    peers: DevicePeers<Link>,
    auth: Option<Secret>,
    /// This instance, for direct registrations ([`TransferChannel::direct_registry`]).
    id: u64,
    direct: Arc<Mutex<DirectState<Link>>>,
}

/// Instances made so far (their ids).
static INSTANCES: AtomicU64 = AtomicU64::new(0);

impl HixlChannel {
    /// A channel over `pools` (every one allocated by the ACL runtime, all
    /// for one NPU); the HIXL server and the liveness listener bind
    /// `at.bind` and are advertised at `at.advertise`, the server on
    /// `settings.port` (0: a free port), the liveness listener on `at.port`.
    pub fn new(
        at: &super::ListenAt,
        pools: &[Arc<PagePool>],
        settings: &HixlSettings,
        opts: HixlOptions,
    ) -> Result<HixlChannel, ChannelError> {
        let (device, local) = acl_pools(pools, "hixl")?;
        let hixl = device
            .acl()
            .hixl()
            .map_err(hixl_err("loading HIXL for the hixl channel".into()))?;
        if let Some(problem) = endpoint_problem(settings, hixl.is_emulator()) {
            return Err(ChannelError::Unsupported(problem));
        }
        let endpoint = local_endpoint(settings, device.id());
        // HIXL wants the device bound on the thread that makes a server or
        // client with device endpoints.
        device
            .bind()
            .map_err(hixl_err(format!("binding NPU {} for HIXL", device.id())))?;
        // The emulator binds port 0 itself; real HIXL wants a port.
        let host = at.bind.as_str();
        let port = match settings.port {
            0 if !hixl.is_emulator() => free_port(host)?,
            p => p,
        };
        let server = HixlServer::create(&hixl, host, port, &[endpoint]).map_err(hixl_err(
            format!("creating the HIXL server on {host}:{port}"),
        ))?;
        for (i, mem) in local.iter().enumerate() {
            let (kind, addr, len) = mem.region();
            // SAFETY: the pool's memory is held by `local` (and the pool)
            // for the channel's life, and the server (destroyed first in
            // drop order) exposes it only to peers' one-sided ops, which
            // touch a page only under a grant of it (revoked grants wait
            // for quiescence before the page goes back to its pool).
            unsafe { server.register(&format!("pool{i}"), kind, addr, len) }.map_err(hixl_err(
                format!("registering pool {i} ({len} bytes) on the HIXL server"),
            ))?;
        }
        server
            .listen(SERVER_BACKLOG)
            .map_err(hixl_err("starting the HIXL server".into()))?;
        let port = server
            .port()
            .map_err(hixl_err("reading the HIXL server's port".into()))?;
        log::info!(
            "hixl channel: HIXL server on {host}:{port} ({}), NPU {}",
            hixl.library_path().display(),
            device.id()
        );
        Ok(HixlChannel {
            watch: WatchServer::bind(at, "hixl")?,
            _server: server,
            server_addr: at.advertised(port),
            hixl,
            endpoint,
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

    /// Requires peers to prove they hold `secret` in the handshake and on
    /// the liveness link.
    pub fn with_auth(mut self, secret: Option<Secret>) -> HixlChannel {
        self.auth = secret;
        self
    }

    /// The NPU the server and clients run on.
    pub fn device_id(&self) -> u32 {
        self.device.id()
    }

    /// `host:port` of this side's HIXL server.
    pub fn server_addr(&self) -> &str {
        &self.server_addr
    }

    fn peer(&self, id: PeerId) -> Result<Arc<DevicePeer<Link>>, ChannelError> {
        self.peers.get(id)
    }

    fn endpoint_with(&self, session: u64) -> Endpoint {
        Endpoint::Hixl {
            session,
            server: self.server_addr.clone(),
            device: self.endpoint,
            watch: self.watch.advertised().to_string(),
        }
    }

    fn bounds(&self) -> Bounds {
        hixl_bounds(&self.opts)
    }
}

fn hixl_bounds(opts: &HixlOptions) -> Bounds {
    opts.bounds_for("hixl", "liveness link, HIXL client connect, remote regions")
}

/// A free TCP port on `host` for the HIXL server (real HIXL takes no port 0).
fn free_port(host: &str) -> Result<u16, ChannelError> {
    let (listener, addr, _) = super::bind_listener(
        &super::ListenAt::any(host),
        "probe for a free HIXL server port",
    )?;
    drop(listener);
    Ok(addr.port())
}

impl TransferChannel for HixlChannel {
    fn kind(&self) -> ChannelKind {
        ChannelKind::Hixl
    }

    /// HIXL's client-server path, which the link table prices apart from
    /// HCCL's communication domain.
    fn link_path(&self) -> Option<super::LinkPath> {
        Some(super::LinkPath::Hixl)
    }

    fn local_table(&self) -> Vec<BufferDesc> {
        table_of(&self.pools)
    }

    fn endpoint(&self) -> Endpoint {
        self.endpoint_with(0)
    }

    fn offer(&self) -> Result<Option<Endpoint>, ChannelError> {
        let session = Uuid::new_v4().as_u64_pair().0;
        let mut offers = lock(&self.offers);
        // Offers a peer refused are never answered; forget them eventually.
        let stale = self.opts.setup_timeout * 2;
        offers.retain(|_, at| at.elapsed() < stale);
        offers.insert(session, Instant::now());
        Ok(Some(self.endpoint_with(session)))
    }

    fn answer(&self, offered: &Endpoint) -> Option<Endpoint> {
        match offered {
            Endpoint::Hixl { session, .. } => Some(self.endpoint_with(*session)),
            _ => None,
        }
    }

    fn attach(
        &self,
        node: &str,
        table: &[BufferDesc],
        endpoint: &Endpoint,
    ) -> Result<PeerId, ChannelError> {
        let Endpoint::Hixl {
            session,
            server,
            device,
            watch,
        } = endpoint
        else {
            return Err(ChannelError::Handshake(format!(
                "peer {node} did not send a hixl endpoint"
            )));
        };
        let table = PeerTable::new(table)?;
        let (ip, port) = split_server(node, server)?;
        // The link's proof covers the session and the offering side's server.
        let link = if lock(&self.offers).remove(session).is_some() {
            // We connected and offered: the answer names our offer.
            let fresh = self.server_addr.as_bytes();
            LinkRole::dial(node, watch, *session, fresh, self.auth.as_ref())?
        } else if *session == 0 {
            return Err(ChannelError::Handshake(format!(
                "peer {node} sent a hixl endpoint without a session (the connecting side must \
                 offer one: use handshake::connect)"
            )));
        } else {
            let proof = self.auth.clone().map(|s| (s, server.as_bytes().to_vec()));
            LinkRole::Await(self.watch.expect(*session, proof))
        };
        let dialer = Arc::new(Dialer {
            hixl: self.hixl.clone(),
            device: self.device.clone(),
            node: node.to_string(),
            local: self.local.clone(),
            local_endpoint: self.endpoint,
            server_ip: ip,
            server_port: port,
            remote_endpoint: *device,
            table: table.clone(),
            timeout: self.opts.setup_timeout,
        });
        let bounds = self.bounds();
        let job_bounds = bounds.clone();
        let job = move || Link::open(dialer, link, job_bounds);
        self.peers.attach(node, table, bounds, "pd-hixl-setup", job)
    }

    unsafe fn register_direct(
        &self,
        device: DeviceKind,
        regions: &[(usize, usize)],
    ) -> Result<Option<DirectRegistration>, ChannelError> {
        if !self.reads_direct(device) {
            return Err(ChannelError::Unsupported(format!(
                "hixl reads straight only into memory of NPU {} (its clients' device), not \
                 {device}",
                self.device.id()
            )));
        }
        lock(&self.direct)
            .add(&self.direct, self.id, regions)
            .map(Some)
    }

    fn prepare_direct(&self, peer: PeerId) -> Result<(), ChannelError> {
        let p = self.peer(peer)?;
        let link = p.setup.wait(&p.node)?;
        let mut st = lock(&self.direct);
        link.direct_client(&mut st, &link).map(|_| ())
    }

    /// Gets from the peer's pages straight into registered NPU memory on
    /// this peer's direct client, waiting for every part. At `deadline`
    /// (or the batch timeout, or the grace after the peer is seen gone)
    /// the client is destroyed, which ends HIXL's access to the memory, so
    /// nothing lands after the call returned.
    unsafe fn read_direct(
        &self,
        peer: PeerId,
        ops: &[DirectRead],
        deadline: Instant,
    ) -> Result<(), ChannelError> {
        let p = self.peer(peer)?;
        let regions = lock(&self.direct).regions.clone();
        let batch: Vec<HixlOp> = direct_spans(&p.table, ops, &regions, "hixl")?
            .into_iter()
            .map(hixl_op)
            .collect();
        if batch.is_empty() {
            return Ok(());
        }
        let link = p.live_link()?;
        let mut st = lock(&self.direct);
        let mut client = link.direct_client(&mut st, &link)?;
        drop(st);
        let until = deadline.min(Instant::now() + self.opts.batch_timeout);
        let result = {
            let c = client.as_ref().expect("made above");
            // SAFETY: every local range is inside a region registered on
            // this client (checked above, and direct_client registered
            // every region); the caller owns that memory for the whole
            // call and nothing else touches it (read_direct's contract).
            // Every remote range is inside a page of the peer's table,
            // which setup proved covered by the peer server's regions.
            // The call returns only once every part completed or the
            // client is destroyed (below).
            unsafe { get_all(c, &batch, &link.watch, &p.node, &self.opts, until) }
        };
        if result.is_err() {
            // Destroyed here: HIXL no longer writes into the cache.
            *client = None;
        }
        result
    }

    device_channel_methods!();
}

impl HixlChannel {
    fn submit<P: LocalPage>(
        &self,
        peer: PeerId,
        kind: OpKind,
        ops: Vec<TransferOp<P>>,
    ) -> Result<Completion<P>, ChannelError> {
        let p = self.peer(peer)?;
        let batch: Vec<HixlOp> = batch_spans(&p.table, &ops, &self.local_uuids, "hixl")?
            .into_iter()
            .map(hixl_op)
            .collect();
        if batch.is_empty() {
            return Ok(Completion::ready(Ok(()), pages_of(ops)));
        }
        let link = p.live_link()?;
        let client = link.client()?;
        let deadline = Instant::now() + self.opts.batch_timeout;
        let (tx, completion) = Completion::pending(watch_ops(&ops));
        let whole: Box<dyn Finish> = Box::new(Batch { ops, tx });
        let parts: Vec<&[HixlOp]> = batch.chunks(HIXL_OPS_IN_FLIGHT_LIMIT).collect();
        let joint = (parts.len() > 1).then(|| Arc::new(Mutex::new(Joint::default())));
        let mut whole = Some(whole);
        for (i, part) in parts.iter().enumerate() {
            let last = i + 1 == parts.len();
            let finish: Box<dyn Finish> = match (&joint, last) {
                (None, _) => whole.take().expect("one part"),
                (Some(j), false) => Box::new(Part(Arc::clone(j))),
                (Some(j), true) => Box::new(Last {
                    whole: whole.take().expect("the last part"),
                    joint: Arc::clone(j),
                    client: Arc::clone(&client),
                    _link: Arc::clone(&link),
                }),
            };
            let issued = client.issue(kind, part, deadline, &p.node);
            let pending: Box<dyn Pending> = match issued {
                Ok(t) => Box::new(
                    Running::new(t, part.len(), Arc::clone(&client), &p.node).holding(&link),
                ),
                Err(e) if i == 0 => {
                    // Nothing was issued: the pages were never touched.
                    drop(finish);
                    return Err(e);
                }
                // Earlier parts run: the pages go with the last entry,
                // which ends once they did.
                Err(e) => {
                    let finish = match finish {
                        f if last => f,
                        _ => Box::new(Last {
                            whole: whole.take().expect("not yet handed over"),
                            joint: Arc::clone(joint.as_ref().expect("several parts")),
                            client: Arc::clone(&client),
                            _link: Arc::clone(&link),
                        }),
                    };
                    let refused = Refused {
                        error: Some(e),
                        _link: Arc::clone(&link),
                    };
                    link.queue(Box::new(refused), finish, 0, deadline);
                    break;
                }
            };
            link.queue(pending, finish, part.len(), deadline);
        }
        Ok(completion)
    }
}

/// A span as a HIXL op.
fn hixl_op(s: Span) -> HixlOp {
    HixlOp {
        remote: s.remote,
        local: s.local as usize as *mut u8,
        len: s.len,
    }
}

/// `ip` and `port` of a peer's `host:port` server address.
fn split_server(node: &str, server: &str) -> Result<(String, u16), ChannelError> {
    server
        .rsplit_once(':')
        .and_then(|(ip, port)| Some((ip.trim_matches(['[', ']']).to_string(), port.parse().ok()?)))
        .filter(|(ip, port)| !ip.is_empty() && *port != 0)
        .ok_or_else(|| {
            ChannelError::Handshake(format!("peer {node}: bad HIXL server address {server:?}"))
        })
}

/// What a client of one peer's server needs: ours to register, theirs to
/// connect to and check.
struct Dialer {
    hixl: Hixl,
    device: Device,
    node: String,
    local: Vec<LocalMem>,
    local_endpoint: HixlEndpoint,
    server_ip: String,
    server_port: u16,
    remote_endpoint: HixlEndpoint,
    table: PeerTable,
    timeout: Duration,
}

impl Dialer {
    /// A connected client with our pools registered (or, with `direct`,
    /// those regions instead), whose server's regions cover the peer's table.
    fn open(&self, direct: Option<&[DirectRegion]>) -> Result<Client, String> {
        let e = |what: String| move |err: ascend_sys::Error| format!("{what}: {err}");
        // Setup threads and submitters differ: bind on this one.
        self.device
            .bind()
            .map_err(e(format!("binding NPU {} for HIXL", self.device.id())))?;
        let client = HixlClient::create(
            &self.hixl,
            &self.server_ip,
            self.server_port,
            &self.local_endpoint,
            &self.remote_endpoint,
        )
        .map_err(e(format!(
            "creating a HIXL client of {}:{}",
            self.server_ip, self.server_port
        )))?;
        let mut mems = Vec::new();
        match direct {
            None => {
                for (i, m) in self.local.iter().enumerate() {
                    let (kind, addr, len) = m.region();
                    // SAFETY: the pool's memory outlives the client (the
                    // channel's `local`, cloned into this dialer, holds it);
                    // a page is touched only by a batch that owns it.
                    let id = unsafe { client.register(&format!("pool{i}"), kind, addr, len) }
                        .map_err(e(format!("registering pool {i} on the HIXL client")))?;
                    mems.push(id);
                }
            }
            Some(regions) => {
                for r in regions {
                    // SAFETY: register_direct's caller keeps the region
                    // allocated device memory until its registration is
                    // dropped, and that drop destroys this client first
                    // (DirectLink::forget_direct, under the state lock).
                    let id = unsafe {
                        client.register(
                            &format!("kv{}", r.id),
                            MemKind::Device,
                            r.addr as *mut u8,
                            r.len,
                        )
                    }
                    .map_err(e(format!(
                        "registering the KV cache ({} bytes at {:#x}) on the HIXL client",
                        r.len, r.addr
                    )))?;
                    mems.push(id);
                }
            }
        }
        client.connect(self.timeout).map_err(e(format!(
            "connecting to the HIXL server of {} at {}:{}",
            self.node, self.server_ip, self.server_port
        )))?;
        let remote = client
            .remote_mems(self.timeout)
            .map_err(e("reading the peer server's regions".into()))?;
        let regions: Vec<(u64, u64)> = remote.iter().map(|m| (m.addr, m.len)).collect();
        check_coverage(&self.table, &regions, "its HIXL server")?;
        Ok(Client {
            client,
            _mems: mems,
            regions: direct.map_or_else(Vec::new, |r| r.iter().map(|r| r.id).collect()),
            budget: Budget::new(HIXL_OPS_IN_FLIGHT_LIMIT),
            failed: AtomicBool::new(false),
            graveyard: Mutex::new(Vec::new()),
        })
    }
}

/// A connected client. Field order is drop order: the client is destroyed
/// before the pages of batches given up on it go back to their pools.
struct Client {
    client: HixlClient,
    _mems: Vec<HixlMemId>,
    /// Direct-read regions registered on it (by id).
    regions: Vec<u64>,
    budget: Budget,
    /// HIXL left it unusable, or a batch on it was given up.
    failed: AtomicBool,
    /// Pages (and transfers) of batches given up while HIXL may still
    /// copy: held until the client is destroyed.
    graveyard: Mutex<Vec<Box<dyn Send>>>,
}

impl Client {
    /// Takes budget for `part`, then starts it.
    fn issue(
        &self,
        kind: OpKind,
        part: &[HixlOp],
        deadline: Instant,
        node: &str,
    ) -> Result<HixlTransfer, ChannelError> {
        if !self.budget.take(part.len(), deadline) {
            return Err(ChannelError::Timeout {
                what: format!(
                    "room for {} op(s) among the {HIXL_OPS_IN_FLIGHT_LIMIT} HIXL takes in flight \
                     to {node}",
                    part.len()
                ),
                after: deadline.saturating_duration_since(Instant::now()),
            });
        }
        let (call, started) = match kind {
            // SAFETY: every local range is inside a page (check_ops: len <=
            // page size) of a pool registered on this client; every remote
            // range is inside a page of the peer's table, which the client's
            // setup proved covered by the server's regions. The pages are
            // owned by the batch, which the completion thread holds until
            // HIXL reports the part completed, or keeps (with the client)
            // until the client is destroyed when given up.
            OpKind::Write => ("put", unsafe { self.client.put_async(part) }),
            // SAFETY: as for the put; the protocol does not touch the
            // pages a read owns until it completed.
            OpKind::Read => ("get", unsafe { self.client.get_async(part) }),
        };
        started.map_err(|source| {
            self.budget.give(part.len());
            // HIXL documents the client failed after FAILED or TIMEOUT.
            if source.hixl_status() != Some(ascend_sys::sys::HIXL_PARAM_INVALID) {
                self.failed.store(true, Ordering::SeqCst);
            }
            ChannelError::Npu {
                context: format!("HIXL batch {call} of {} op(s) to {node}", part.len()),
                source,
            }
        })
    }
}

/// Ops a client may still start, of HIXL's in-flight limit.
struct Budget {
    free: Mutex<usize>,
    freed: Condvar,
}

impl Budget {
    fn new(n: usize) -> Budget {
        Budget {
            free: Mutex::new(n),
            freed: Condvar::new(),
        }
    }

    /// Takes `n` ops of room, waiting until `deadline`; false past it.
    fn take(&self, n: usize, deadline: Instant) -> bool {
        let mut free = lock(&self.free);
        while *free < n {
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            free = self
                .freed
                .wait_timeout(free, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        *free -= n;
        true
    }

    fn give(&self, n: usize) {
        *lock(&self.free) += n;
        self.freed.notify_all();
    }
}

/// A peer's ready connection: its client (replaced when it failed), the
/// direct-read client, the liveness link and the completion thread's queue.
/// Every queued part holds it, so it drops only after the last one ended;
/// field order is drop order, and our end of the liveness link closes
/// last, once the clients it held are destroyed (see `Closing`).
struct Link {
    completer: Sender<InFlight>,
    dialer: Arc<Dialer>,
    client: Mutex<Arc<Client>>,
    /// The client direct reads use (see the module docs); direct reads of
    /// this peer run one at a time under this lock.
    direct: Mutex<Option<Client>>,
    watch: Closing,
}

/// Our end of a liveness link, closed when dropped: the promise to the
/// peer that nothing of ours touches its memory any more.
struct Closing(Arc<Watch>);

impl Drop for Closing {
    fn drop(&mut self) {
        self.0.close();
    }
}

impl std::ops::Deref for Closing {
    type Target = Watch;
    fn deref(&self) -> &Watch {
        &self.0
    }
}

impl Link {
    /// Runs a peer's setup: liveness link, client, completion thread.
    fn open(dialer: Arc<Dialer>, role: LinkRole, bounds: Bounds) -> Result<Link, SetupFailure> {
        let deadline = Instant::now() + bounds.setup_timeout;
        // Our server serves every pool to any client that reaches it, and
        // the peer connects its client once its end of the liveness link
        // is open: from then on it may write our pages, whatever becomes
        // of our side's setup, until it closes that end.
        let watch = role.open(deadline).map_err(SetupFailure::link)?;
        let client = dialer
            .open(None)
            .map_err(|m| SetupFailure::exposed(m, &watch))?;
        let (tx, rx) = crossbeam_channel::unbounded();
        let (node, w) = (dialer.node.clone(), Arc::clone(&watch));
        let stuck = AtomicBool::new(false);
        std::thread::Builder::new()
            .name("pd-hixl-done".into())
            .spawn(move || complete_loop(&rx, &w, &node, &bounds, &stuck))
            .map_err(|e| {
                SetupFailure::exposed(format!("spawning the completion thread: {e}"), &watch)
            })?;
        Ok(Link {
            completer: tx,
            dialer,
            client: Mutex::new(Arc::new(client)),
            direct: Mutex::new(None),
            watch: Closing(watch),
        })
    }

    /// The client to submit on: the current one, or a new one in place of
    /// a failed one (whose batches keep it until they ended).
    fn client(&self) -> Result<Arc<Client>, ChannelError> {
        let mut current = lock(&self.client);
        if current.failed.load(Ordering::SeqCst) {
            log::info!(
                "hixl: the client of {} failed; connecting a new one",
                self.dialer.node
            );
            let fresh = self.dialer.open(None).map_err(|m| {
                ChannelError::Handshake(format!(
                    "hixl: replacing the failed client of {}: {m}",
                    self.dialer.node
                ))
            })?;
            *current = Arc::new(fresh);
        }
        Ok(Arc::clone(&current))
    }

    /// Queues a part for the completion thread.
    fn queue(
        &self,
        pending: Box<dyn Pending>,
        batch: Box<dyn Finish>,
        count: usize,
        deadline: Instant,
    ) {
        let entry = InFlight {
            pending,
            batch,
            count,
            deadline,
        };
        if let Err(crossbeam_channel::SendError(entry)) = self.completer.send(entry) {
            // The completer ends only with the link, which the caller
            // holds; should it be gone, keep the pages as HIXL may copy.
            let keep = entry.batch.abandon(Err(ChannelError::WorkerLost(
                "hixl completion thread ended".into(),
            )));
            std::mem::forget(keep);
        }
    }

    /// The direct-read client, made (or remade, when regions were
    /// registered since) with every region of `st` registered. `link` is
    /// `self`, remembered for deregistration before anything registers.
    fn direct_client<'a>(
        &'a self,
        st: &mut DirectState<Link>,
        link: &Arc<Link>,
    ) -> Result<std::sync::MutexGuard<'a, Option<Client>>, ChannelError> {
        st.remember(link);
        let mut direct = lock(&self.direct);
        let want: Vec<u64> = st.regions.iter().map(|r| r.id).collect();
        if direct.as_ref().is_some_and(|c| c.regions != want) {
            // Idle (direct reads hold this lock): destroying is safe.
            *direct = None;
        }
        if direct.is_none() {
            if st.regions.is_empty() {
                return Err(ChannelError::Unsupported(
                    "no memory is registered for direct reads on this hixl channel (register the \
                     KV cache: TransferChannel::register_direct)"
                        .into(),
                ));
            }
            let c = self.dialer.open(Some(&st.regions)).map_err(|m| {
                ChannelError::Handshake(format!(
                    "hixl: the direct-read client of {}: {m}",
                    self.dialer.node
                ))
            })?;
            *direct = Some(c);
        }
        Ok(direct)
    }
}

impl Watched for Link {
    fn watch(&self) -> &Arc<Watch> {
        &self.watch.0
    }
}

impl DirectLink for Link {
    fn forget_direct(&self, ids: &[u64]) {
        let mut direct = lock(&self.direct);
        if direct
            .as_ref()
            .is_some_and(|c| c.regions.iter().any(|id| ids.contains(id)))
        {
            // No direct read runs (they hold this lock); destroying the
            // client ends HIXL's hold on the memory being given back.
            *direct = None;
        }
    }
}

/// Gets `ops` on `client` in parts within HIXL's in-flight limit, each
/// waited for; `Err` when one failed, the peer went (past the grace), or
/// `until` passed. The caller destroys the client on `Err`.
///
/// # Safety
/// As [`HixlClient::get_async`], until this returns `Ok` or the client is
/// destroyed.
unsafe fn get_all(
    client: &Client,
    ops: &[HixlOp],
    watch: &Watch,
    node: &str,
    opts: &HixlOptions,
    until: Instant,
) -> Result<(), ChannelError> {
    for part in ops.chunks(HIXL_OPS_IN_FLIGHT_LIMIT) {
        // SAFETY: passed on from the caller.
        let t = unsafe { client.client.get_async(part) }.map_err(hixl_err(format!(
            "HIXL direct get of {} op(s) from {node}",
            part.len()
        )))?;
        let mut running = Running::new(t, 0, client, node);
        let mut gone_at: Option<Instant> = None;
        loop {
            match running.poll() {
                Polled::Done => break,
                Polled::Waiting => {}
                Polled::Ended(e) | Polled::Broken(e) => return Err(e),
            }
            let now = Instant::now();
            if let Err(detail) = watch.check() {
                let at = *gone_at.get_or_insert(now);
                if now.duration_since(at) >= opts.gone_grace {
                    return Err(ChannelError::PeerGone {
                        peer: node.to_string(),
                        op: None,
                        detail: format!("{detail}; the direct read did not finish"),
                    });
                }
            }
            if now >= until {
                return Err(ChannelError::Timeout {
                    what: format!("HIXL direct read of {} op(s) from {node}", ops.len()),
                    after: opts.batch_timeout,
                });
            }
        }
    }
    watch.check().map_err(|d| ChannelError::PeerGone {
        peer: node.to_string(),
        op: None,
        detail: format!("{d}; the direct read ran, but not with a live peer"),
    })
}

/// A started part, polled until HIXL reports it completed.
struct Running<C> {
    transfer: Option<HixlTransfer>,
    /// Budget to give back once it completed (0: none was taken).
    ops: usize,
    client: C,
    node: String,
    pause: Duration,
    /// A queued part keeps its peer's link (and our end of the liveness
    /// link) open until it ended.
    _link: Option<Arc<Link>>,
}

impl<C: std::ops::Deref<Target = Client>> Running<C> {
    fn new(transfer: HixlTransfer, ops: usize, client: C, node: &str) -> Running<C> {
        Running {
            transfer: Some(transfer),
            ops,
            client,
            node: node.to_string(),
            pause: Duration::from_micros(10),
            _link: None,
        }
    }

    fn holding(self, link: &Arc<Link>) -> Running<C> {
        Running {
            _link: Some(Arc::clone(link)),
            ..self
        }
    }

    fn poll(&mut self) -> Polled {
        let Some(t) = self.transfer.take() else {
            return Polled::Broken(ChannelError::WorkerLost(format!(
                "a HIXL transfer to {} was polled after it ended",
                self.node
            )));
        };
        let answer = self.client.client.query(t);
        let broken = |what: String, source: Option<ascend_sys::Error>| {
            Polled::Broken(match source {
                Some(source) => ChannelError::Npu {
                    context: what,
                    source,
                },
                None => ChannelError::WorkerLost(what),
            })
        };
        if !matches!(
            answer,
            Ok((HixlTransferState::Completed | HixlTransferState::Waiting, _))
        ) {
            self.client.failed.store(true, Ordering::SeqCst);
        }
        match answer {
            Ok((HixlTransferState::Completed, _)) => {
                self.client.budget.give(self.ops);
                Polled::Done
            }
            Ok((HixlTransferState::Waiting, Some(t))) => {
                self.transfer = Some(t);
                std::thread::sleep(self.pause);
                self.pause = (self.pause * 2).min(MAX_POLL_PAUSE);
                Polled::Waiting
            }
            // HIXL names no outcome here that proves the copies stopped.
            Ok((state, t)) => {
                self.transfer = t;
                broken(
                    format!("HIXL reported a transfer to {} {state:?}", self.node),
                    None,
                )
            }
            Err(e) => broken(
                format!("querying a HIXL transfer to {}", self.node),
                Some(e),
            ),
        }
    }
}

impl Pending for Running<Arc<Client>> {
    fn poll(&mut self) -> Polled {
        Running::poll(self)
    }

    /// Kept with the client (marked failed, so the next batch uses a new
    /// one) until it is destroyed: only that ends HIXL's hold on the pages.
    fn abandon(self: Box<Self>, pages: Box<dyn Send>) -> Option<Box<dyn Abandoned>> {
        self.client.failed.store(true, Ordering::SeqCst);
        let mut graveyard = lock(&self.client.graveyard);
        graveyard.push(pages);
        if let Some(t) = self.transfer {
            graveyard.push(Box::new(t));
        }
        None
    }
}

/// A part that could not start: it ends failed once the parts before it
/// did (holding the link until then, as they do).
struct Refused {
    error: Option<ChannelError>,
    _link: Arc<Link>,
}

impl Pending for Refused {
    fn poll(&mut self) -> Polled {
        Polled::Ended(
            self.error
                .take()
                .unwrap_or_else(|| ChannelError::WorkerLost("a refused HIXL part".into())),
        )
    }

    fn abandon(self: Box<Self>, pages: Box<dyn Send>) -> Option<Box<dyn Abandoned>> {
        // Never abandoned (it ends at once); should it be, keep the pages.
        std::mem::forget(pages);
        None
    }
}

/// What the parts of one batch learnt before its last part ends.
#[derive(Default)]
struct Joint {
    error: Option<ChannelError>,
    /// A part was given up while HIXL may still copy.
    abandoned: bool,
}

/// A part before the last: it holds no pages, and tells the last how it ended.
struct Part(Arc<Mutex<Joint>>);

impl Finish for Part {
    fn complete(self: Box<Self>, result: Result<(), ChannelError>) {
        if let Err(e) = result {
            lock(&self.0).error.get_or_insert(e);
        }
    }

    fn abandon(self: Box<Self>, result: Result<(), ChannelError>) -> Box<dyn Send> {
        let mut j = lock(&self.0);
        j.abandoned = true;
        if let Err(e) = result {
            j.error.get_or_insert(e);
        }
        Box::new(())
    }
}

/// The last part: it reports the whole batch, with its pages unless an
/// earlier part was given up (then they wait with the client).
struct Last {
    whole: Box<dyn Finish>,
    joint: Arc<Mutex<Joint>>,
    client: Arc<Client>,
    /// Closed only after the client above is gone (field order).
    _link: Arc<Link>,
}

impl Finish for Last {
    fn complete(self: Box<Self>, result: Result<(), ChannelError>) {
        let Last {
            whole,
            joint,
            client,
            _link: link,
        } = *self;
        let mut j = lock(&joint);
        let earlier = j.error.take();
        let result = match (earlier, result) {
            (Some(e), _) | (None, Err(e)) => Err(e),
            (None, Ok(())) => Ok(()),
        };
        if j.abandoned {
            let pages = whole.abandon(result);
            lock(&client.graveyard).push(pages);
        } else {
            whole.complete(result);
        }
        drop(j);
        // The client (perhaps the last hold on it, destroying it) before
        // the link, whose drop closes our end of the liveness link.
        drop(client);
        drop(link);
    }

    fn abandon(self: Box<Self>, result: Result<(), ChannelError>) -> Box<dyn Send> {
        let error = lock(&self.joint).error.take();
        self.whole.abandon(error.map_or(result, Err))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_addresses_split_into_ip_and_port_or_are_refused_by_name() {
        assert_eq!(
            split_server("p", "10.0.0.8:26000").unwrap(),
            ("10.0.0.8".to_string(), 26000)
        );
        assert_eq!(
            split_server("p", "[::1]:7").unwrap(),
            ("::1".to_string(), 7)
        );
        for bad in ["10.0.0.8", ":80", "h:0", "h:x", ""] {
            let e = split_server("peer-3", bad).unwrap_err().to_string();
            assert!(
                e.contains("peer-3") && e.contains("bad HIXL server address"),
                "{e}"
            );
        }
    }

    #[test]
    fn the_budget_bounds_ops_in_flight_and_waits_are_bounded() {
        let b = Budget::new(10);
        let soon = || Instant::now() + Duration::from_millis(20);
        assert!(b.take(6, soon()));
        assert!(!b.take(5, soon()), "only 4 left");
        assert!(b.take(4, soon()));
        b.give(6);
        assert!(b.take(6, soon()));
        // A waiter is woken by the room given back.
        let b = Arc::new(b);
        let b2 = Arc::clone(&b);
        let t = std::thread::spawn(move || b2.take(3, Instant::now() + Duration::from_secs(30)));
        b.give(3);
        assert!(t.join().unwrap());
    }

    #[test]
    fn a_roce_endpoint_without_an_address_is_refused_outside_the_emulator_naming_the_fix() {
        let roce = HixlSettings::default();
        let e = endpoint_problem(&roce, false).expect("refused on CANN");
        assert!(
            e.contains("pd_hixl_device_ip") && e.contains("pd_hixl_protocol: hccs"),
            "{e}"
        );
        assert_eq!(
            endpoint_problem(&roce, true),
            None,
            "the emulator ignores it"
        );
        let with_ip = HixlSettings {
            device_ip: Some("10.0.0.8".parse().unwrap()),
            ..roce
        };
        assert_eq!(endpoint_problem(&with_ip, false), None);
        let hccs = HixlSettings {
            protocol: ProtocolSetting::Hccs,
            ..roce
        };
        assert_eq!(endpoint_problem(&hccs, false), None);
    }

    #[test]
    fn the_endpoint_follows_the_settings_and_defaults_to_the_pools_npu() {
        let mut s = HixlSettings::default();
        let e = local_endpoint(&s, 3);
        assert_eq!(
            (e.protocol, e.device_phy_id, e.ipv4),
            (HixlProtocol::Roce, 3, None)
        );
        s.protocol = ProtocolSetting::Hccs;
        s.device_phy_id = Some(9);
        s.device_ip = Some("192.168.1.8".parse().unwrap());
        let e = local_endpoint(&s, 3);
        assert_eq!(
            (e.protocol, e.device_phy_id, e.ipv4),
            (HixlProtocol::Hccs, 9, Some("192.168.1.8".parse().unwrap()))
        );
    }
}
