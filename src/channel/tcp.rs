//! `tcp`: transfers over TCP, across any network.
//!
//! Every node runs a transfer server bound to its configured host. A peer
//! opens several connections to it and pipelines requests on each: a write
//! request carries its payload, which the server receives straight into the
//! registered page (no intermediate buffer); a read request is answered with
//! bytes sent straight out of the page. Large ops are cut into slices so
//! many slices are in flight at once. The server bounds-checks every request
//! against its own pools, whatever the client checked.
//!
//! NPU pages (pools allocated by the ACL runtime, `memory::npu`) on either
//! side are staged through pinned host memory, per connection, double
//! buffered so device copies overlap the socket (see `staging`): the
//! server receives a write into staging and copies it to the device, and
//! stages a read with device-to-host copies while it sends; the client
//! does the mirror image for its own NPU pages. A write's reply is sent
//! only once its bytes are in device memory.
//!
//! **Who may touch what.** Every connection opens with a hello naming the
//! client's node (magic `APDH`, node length u16, the node id, a 16-byte
//! nonce). The server answers `APDA` and a mode byte: 2 when it already
//! serves its maximum of connections (then it closes); 0 when it runs
//! without a secret; 1 followed by its own nonce and its proof over both
//! nonces and the node, when it runs with the deployment secret
//! ([`crate::auth`]). The client then checks that proof and sends its own
//! (32 bytes), and the server serves nothing before it checked it: the
//! node the grants name is authenticated. Both sides must run with the
//! same secret, or both without; anything else fails the connection with
//! an error naming `pd_auth_secret_file`. The server
//! serves a request only under a live [grant](super::grant) of that node
//! covering the page with that access and carrying the request's
//! [tag](super::GrantTag); anything else is refused (counted, logged once
//! per node) and the connection closed. The tag is what refuses a write
//! the client queued under an earlier grant of the same page (on a
//! connection it gave up on) once the page is granted to it again. A revoked grant is
//! quiescent once the requests it was serving have ended, and each
//! request has one deadline (`io_timeout`) for its header, payload and
//! reply together, so that is bounded however a peer trickles bytes. At
//! its cap of connections the server makes room for a new one by cutting
//! the connection idle longest (still saying its hello, or between
//! requests; clients reconnect when they find a pooled connection cut),
//! so idle connections cannot keep a client out either.
//!
//! Request (48 bytes, little-endian): magic `APDT`, op (1 write, 2 read),
//! flags (bit 0: tagged), 2 pad bytes, buffer uuid (16), page (u32),
//! offset in page (u32), length (u64), grant tag (u64, 0 when untagged); a
//! write's payload follows. Reply (8 bytes): status (0 ok), 3 pad
//! bytes, message length (u32), then the message, or a read's payload.

use super::grant::{GrantTable, Serving};
use super::staging::{StageError, Stager};
use super::{
    bind_listener, check_grant_pages, check_ops, pages_of, table_of, watch_ops, Access, BufferDesc,
    ChannelError, Completion, DirectRead, DirectWrite, Endpoint, GrantId, GrantStats, GrantTag,
    LocalPage, OpKind, PeerId, PeerPages, PeerRegistry, PeerTable, ReadOp, TransferChannel,
    TransferOp, WriteOp,
};
use crate::auth::{self, Nonce, Secret, Step, NONCE_LEN, PROOF_LEN, SECRET_ENV, SECRET_KEY};
use crate::config::ChannelKind;
use crate::memory::npu::{device_buffer, is_acl_device};
use crate::memory::{BufferRef, DeviceKind, MemObj, PagePool, SealedMemObj};
use ascend_sys::DeviceBuffer;
use std::collections::HashMap;
use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use uuid::Uuid;

const MAGIC: u32 = u32::from_le_bytes(*b"APDT");
const HELLO_MAGIC: &[u8; 4] = b"APDH";
const ANSWER_MAGIC: &[u8; 4] = b"APDA";
const MODE_OPEN: u8 = 0;
const MODE_AUTH: u8 = 1;
/// The answer of a server that serves its maximum of connections.
const MODE_BUSY: u8 = 2;
/// Default of [`TcpOptions::max_server_connections`]: room for 64 peers
/// at 4 connections each.
pub const DEFAULT_MAX_SERVER_CONNECTIONS: usize = 256;
/// Longest node id a connection hello may carry.
const MAX_NODE_LEN: usize = 1024;
const OP_WRITE: u8 = 1;
const OP_READ: u8 = 2;
const REQ_LEN: usize = 48;
const FLAG_TAGGED: u8 = 1;
const REPLY_LEN: usize = 8;
const MAX_ERROR_LEN: u32 = 4096;

/// Tuning of the tcp channel.
#[derive(Clone, Debug)]
pub struct TcpOptions {
    /// Connections per peer.
    pub connections: usize,
    /// Largest piece one request moves.
    pub slice_bytes: usize,
    /// Requests in flight per connection.
    pub window: usize,
    /// A socket that makes no progress for this long fails the batch. The
    /// server gives each request this long in all (its header, payload and
    /// reply, however the bytes trickle) and an idle connection this long
    /// between requests.
    pub io_timeout: Duration,
    /// The deployment secret: peers prove they hold it on every
    /// connection, and we prove it to them. `None`: unauthenticated.
    pub auth: Option<Secret>,
    /// Most connections the transfer server serves at once (one thread
    /// each). At the cap a new connection takes the slot of the one idle
    /// longest (saying its hello, or between requests); when every slot
    /// is inside a request, it is refused with a message saying so, and
    /// counted.
    pub max_server_connections: usize,
}

impl Default for TcpOptions {
    fn default() -> Self {
        TcpOptions {
            connections: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(2)
                .clamp(2, 4),
            slice_bytes: 1 << 20,
            window: 16,
            io_timeout: Duration::from_secs(30),
            auth: None,
            max_server_connections: DEFAULT_MAX_SERVER_CONNECTIONS,
        }
    }
}

/// Bound on each device-copy wait of the server's staging.
const SERVER_STAGE_TIMEOUT: Duration = Duration::from_secs(30);

/// A served pool: host memory at `ptr`, or an NPU buffer.
#[derive(Clone)]
struct LocalPool {
    ptr: usize,
    page_size: usize,
    pages: usize,
    device: Option<Arc<DeviceBuffer>>,
}

/// What every serving thread shares: the pools and the grants.
struct Served {
    pools: HashMap<Uuid, LocalPool>,
    grants: GrantTable<()>,
    io_timeout: Duration,
    auth: Option<Secret>,
    /// Connections refused for a failed or missing proof.
    unauthenticated: AtomicU64,
    unauthenticated_logged: AtomicBool,
    max_connections: usize,
    /// Connections refused at the cap.
    busy: AtomicU64,
}

/// The tcp channel of one worker: its transfer server and its peers.
pub struct TcpChannel {
    // Declared first so it drops first: serving threads touch the pools.
    server: ServerHandle,
    served: Arc<Served>,
    node: String,
    pools: Vec<Arc<PagePool>>,
    opts: TcpOptions,
    peers: PeerRegistry<TcpPeer>,
}

struct TcpPeer {
    node: String,
    addr: SocketAddr,
    table: PeerTable,
    conns: Vec<Mutex<Option<Conn>>>,
}

/// A client connection and its staging (made on first use of a local NPU page).
struct Conn {
    stream: TcpStream,
    stagers: Stagers,
}

/// One [`Stager`] per NPU, made when first needed.
#[derive(Default)]
struct Stagers(HashMap<u32, Stager>);

impl Stagers {
    fn get(&mut self, buf: &DeviceBuffer, timeout: Duration) -> Result<&mut Stager, StageError> {
        Ok(match self.0.entry(buf.device().id()) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert(Stager::new(buf.device(), timeout)?)
            }
        })
    }
}

struct ServerHandle {
    stop: Arc<AtomicBool>,
    addr: SocketAddr,
    /// The address peers are told to dial (`pd_peer_host` and the port).
    advertised: String,
    accept: Option<JoinHandle<()>>,
    conns: Arc<Mutex<ServedConns>>,
}

/// A handle on each connection being served (to cut it at shutdown, or
/// to make room at the cap), removed when its serving thread ends.
type ServedConns = HashMap<u64, ServedConn>;

/// A connection being served, and since when it has been idle (`None`:
/// inside a request).
struct ServedConn {
    stream: TcpStream,
    idle_since: Option<Instant>,
}

/// Lets a serving thread tell the accept loop whether its connection is
/// idle (evictable at the cap) or inside a request.
struct IdleMark {
    conns: Arc<Mutex<ServedConns>>,
    id: u64,
}

impl IdleMark {
    fn set(&self, idle: bool) {
        if let Some(c) = lock_conns(&self.conns).get_mut(&self.id) {
            c.idle_since = idle.then(Instant::now);
        }
    }
}

fn lock_conns(conns: &Mutex<ServedConns>) -> std::sync::MutexGuard<'_, ServedConns> {
    conns.lock().unwrap_or_else(|p| p.into_inner())
}

/// At the cap: cuts the connection idle longest (its thread then ends),
/// so idle connections cannot keep a client out. False when every
/// connection is inside a request.
fn evict_idlest(conns: &Mutex<ServedConns>) -> bool {
    let mut conns = lock_conns(conns);
    let idlest = conns
        .iter()
        .filter_map(|(id, c)| c.idle_since.map(|t| (t, *id)))
        .min();
    match idlest.and_then(|(_, id)| conns.remove(&id)) {
        Some(c) => {
            let _ = c.stream.shutdown(Shutdown::Both);
            true
        }
        None => false,
    }
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // Wake the accept loop, then cut every served connection.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(200));
        for (_, c) in lock_conns(&self.conns).drain() {
            let _ = c.stream.shutdown(Shutdown::Both);
        }
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
    }
}

impl TcpChannel {
    /// Binds the transfer server on `host` (port 0 picks a free port) over
    /// `pools`; `node` is this worker's id, presented on every connection
    /// it opens to a peer.
    pub fn bind(
        host: &str,
        node: &str,
        pools: &[Arc<PagePool>],
        opts: TcpOptions,
    ) -> Result<TcpChannel, ChannelError> {
        Self::bind_at(&super::ListenAt::any(host), node, pools, opts)
    }

    /// [`TcpChannel::bind`], the server bound on `at.bind:at.port` and
    /// advertised to peers as `at.advertise`.
    pub fn bind_at(
        at: &super::ListenAt,
        node: &str,
        pools: &[Arc<PagePool>],
        opts: TcpOptions,
    ) -> Result<TcpChannel, ChannelError> {
        if node.is_empty() || node.len() > MAX_NODE_LEN {
            return Err(ChannelError::Handshake(format!(
                "node id of {} bytes: it must be 1..={MAX_NODE_LEN} bytes",
                node.len()
            )));
        }
        let mut served = HashMap::new();
        for p in pools {
            let b = p.buffer();
            // SAFETY: the server copies into or out of a page of this pool
            // only while a live grant of the requesting peer covers it (the
            // owner lent or sealed it and waits for the grant to settle).
            let (ptr, device) = match (b.host_ptr(), unsafe { device_buffer(b) }) {
                (Some(ptr), _) => (ptr as usize, None),
                (None, Some(dev)) => (0, Some(Arc::clone(dev))),
                (None, None) => {
                    return Err(ChannelError::Unsupported(format!(
                        "the tcp channel stages NPU pools through the ACL runtime, but pool {} on {}                          was not allocated by it (build NPU pools with memory::npu::AclRuntime)",
                        b.uuid().simple(),
                        b.device()
                    )))
                }
            };
            served.insert(
                b.uuid(),
                LocalPool {
                    ptr,
                    page_size: b.page_size(),
                    pages: b.num_pages(),
                    device,
                },
            );
        }
        let (listener, addr, advertised) = bind_listener(at, "tcp transfer server")?;
        let stop = Arc::new(AtomicBool::new(false));
        let conns = Arc::new(Mutex::new(ServedConns::new()));
        let (stop2, conns2) = (Arc::clone(&stop), Arc::clone(&conns));
        // Served pools stay alive while the server runs: the channel owns them
        // and its `server` field (dropped first) joins every serving thread.
        let served = Arc::new(Served {
            pools: served,
            grants: GrantTable::default(),
            io_timeout: opts.io_timeout,
            auth: opts.auth.clone(),
            unauthenticated: AtomicU64::new(0),
            unauthenticated_logged: AtomicBool::new(false),
            max_connections: opts.max_server_connections.max(1),
            busy: AtomicU64::new(0),
        });
        let served2 = Arc::clone(&served);
        let accept = std::thread::Builder::new()
            .name("pd-tcp-accept".into())
            .spawn(move || accept_loop(listener, served2, stop2, conns2))
            .map_err(|source| ChannelError::Io {
                context: "spawning the tcp accept thread".into(),
                source,
            })?;
        Ok(TcpChannel {
            served,
            node: node.to_string(),
            pools: pools.to_vec(),
            opts,
            peers: PeerRegistry::default(),
            server: ServerHandle {
                stop,
                addr,
                advertised,
                accept: Some(accept),
                conns,
            },
        })
    }

    /// Where the transfer server listens.
    pub fn local_addr(&self) -> SocketAddr {
        self.server.addr
    }

    /// Connections the transfer server serves now: (idle — saying their
    /// hello or between requests, so evictable at the cap — and inside a
    /// request).
    pub fn served_connections(&self) -> (usize, usize) {
        let conns = lock_conns(&self.server.conns);
        let idle = conns.values().filter(|c| c.idle_since.is_some()).count();
        (idle, conns.len() - idle)
    }

    fn peer(&self, id: PeerId) -> Result<Arc<TcpPeer>, ChannelError> {
        self.peers.get(id)
    }
}

fn accept_loop(
    listener: TcpListener,
    served: Arc<Served>,
    stop: Arc<AtomicBool>,
    conns: Arc<Mutex<ServedConns>>,
) {
    let mut workers: Vec<JoinHandle<()>> = Vec::new();
    for (id, stream) in (0u64..).zip(listener.incoming()) {
        if stop.load(Ordering::Acquire) {
            break;
        }
        let stream = match stream {
            Ok(s) => s,
            Err(e) => {
                // Out of descriptors, say: do not spin while it lasts.
                log::warn!("tcp transfer server: accept failed: {e}");
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        workers.retain(|h| !h.is_finished());
        // Idle connections give way; an evicted one's thread ends at once
        // (its socket is cut), so the cap is exceeded only while it winds down.
        if workers.len() >= served.max_connections && !evict_idlest(&conns) {
            refuse_busy(stream, &served);
            continue;
        }
        if let Ok(c) = stream.try_clone() {
            lock_conns(&conns).insert(
                id,
                ServedConn {
                    stream: c,
                    idle_since: Some(Instant::now()),
                },
            );
        }
        let (served, conns2) = (Arc::clone(&served), Arc::clone(&conns));
        let spawned = std::thread::Builder::new()
            .name("pd-tcp-serve".into())
            .spawn(move || {
                let mark = IdleMark {
                    conns: Arc::clone(&conns2),
                    id,
                };
                serve_connection(stream, &served, &mark);
                // Our handle goes too, so the socket really closes.
                lock_conns(&conns2).remove(&id);
            });
        match spawned {
            Ok(h) => workers.push(h),
            Err(_) => drop(lock_conns(&conns).remove(&id)),
        }
        workers.retain(|h| !h.is_finished());
    }
    // Pools must outlive every serving thread: wait for them before returning.
    for c in lock_conns(&conns).values() {
        let _ = c.stream.shutdown(Shutdown::Both);
    }
    for h in workers {
        let _ = h.join();
    }
}

/// Refuses a connection over the cap: the busy answer (which the client
/// reports by name), then close. Counted; logged once.
fn refuse_busy(mut stream: TcpStream, served: &Served) {
    if served.busy.fetch_add(1, Ordering::Relaxed) == 0 {
        log::warn!(
            "tcp transfer server: refused a connection: it already serves its maximum of {} \
             (later refusals are only counted)",
            served.max_connections
        );
    }
    let mut answer = [0u8; 5];
    answer[..4].copy_from_slice(ANSWER_MAGIC);
    answer[4] = MODE_BUSY;
    // The client's hello is read first, so closing does not reset the
    // connection before the answer arrives; a client that sends nothing
    // waits at most this long (on the accept thread, only while at the cap).
    let _ = read_hello(&mut Deadline {
        stream: &mut stream,
        deadline: Instant::now() + Duration::from_millis(100),
        what: HELLO_LATE,
    });
    let _ = stream.write_all(&answer);
    let _ = stream.shutdown(Shutdown::Write);
}

fn reply(stream: &mut impl Write, status: u8, msg: &str) -> io::Result<()> {
    let mut h = [0u8; REPLY_LEN];
    h[0] = status;
    let m = &msg.as_bytes()[..msg.len().min(MAX_ERROR_LEN as usize)];
    h[4..8].copy_from_slice(&(m.len() as u32).to_le_bytes());
    stream.write_all(&h)?;
    stream.write_all(m)
}

/// Writes every byte of `bufs`, in as few calls as the stream takes
/// (one `writev` for a header and its payload).
fn write_all_vectored(w: &mut impl Write, mut bufs: &mut [IoSlice<'_>]) -> io::Result<()> {
    IoSlice::advance_slices(&mut bufs, 0);
    while !bufs.is_empty() {
        match w.write_vectored(bufs) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// How long a connection may take, in all, to send its hello and (with a
/// secret) its proof: a client that trickles bytes cannot hold a serving
/// slot longer.
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);

/// What a peer that missed its hello deadline is told.
const HELLO_LATE: &str = "the peer took too long to say who it is";
/// What a peer that missed a request's deadline is told (in the log).
const REQUEST_LATE: &str = "the peer took too long over one request";

/// A stream whose reads and writes must all end by `deadline` (each call
/// waits at most what is left), unlike a socket timeout, which counts per
/// call: a peer that trickles bytes gains nothing.
struct Deadline<'a> {
    stream: &'a mut TcpStream,
    deadline: Instant,
    /// What missing the deadline means, for the error.
    what: &'static str,
}

impl Deadline<'_> {
    fn left(&self) -> io::Result<Duration> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(self.late());
        }
        Ok(left)
    }

    fn late(&self) -> io::Error {
        io::Error::new(
            io::ErrorKind::TimedOut,
            format!("{} (past its deadline)", self.what),
        )
    }

    fn timed_out(&self, e: io::Error) -> io::Error {
        match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => self.late(),
            _ => e,
        }
    }
}

impl Read for Deadline<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.left()?;
        self.stream.set_read_timeout(Some(left))?;
        self.stream.read(buf).map_err(|e| self.timed_out(e))
    }
}

impl Write for Deadline<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let left = self.left()?;
        self.stream.set_write_timeout(Some(left))?;
        self.stream.write(buf).map_err(|e| self.timed_out(e))
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        let left = self.left()?;
        self.stream.set_write_timeout(Some(left))?;
        self.stream
            .write_vectored(bufs)
            .map_err(|e| self.timed_out(e))
    }

    fn flush(&mut self) -> io::Result<()> {
        self.stream.flush()
    }
}

/// A connection's hello: magic, node length, node id, nonce.
fn encode_hello(node: &str, nonce: &Nonce) -> Vec<u8> {
    let mut hello = Vec::with_capacity(6 + node.len() + NONCE_LEN);
    hello.extend_from_slice(HELLO_MAGIC);
    hello.extend_from_slice(&(node.len() as u16).to_le_bytes());
    hello.extend_from_slice(node.as_bytes());
    hello.extend_from_slice(nonce);
    hello
}

/// Reads a connection's hello: the client's node id and nonce.
fn read_hello(stream: &mut impl Read) -> Result<(String, Nonce), String> {
    let mut h = [0u8; 6];
    stream
        .read_exact(&mut h)
        .map_err(|e| format!("no connection hello: {e}"))?;
    if &h[..4] != HELLO_MAGIC {
        return Err("bad hello magic: not an ascend-pd tcp transfer client".into());
    }
    let len = usize::from(u16::from_le_bytes([h[4], h[5]]));
    if len == 0 || len > MAX_NODE_LEN {
        return Err(format!("hello node id of {len} bytes (1..={MAX_NODE_LEN})"));
    }
    let mut node = vec![0u8; len];
    stream
        .read_exact(&mut node)
        .map_err(|e| format!("truncated hello: {e}"))?;
    let mut nonce = [0u8; NONCE_LEN];
    stream
        .read_exact(&mut nonce)
        .map_err(|e| format!("truncated hello: {e}"))?;
    let node = String::from_utf8(node).map_err(|_| "hello node id is not UTF-8".to_string())?;
    Ok((node, nonce))
}

/// The server's side of a connection's authentication, after the hello:
/// answers, and with a secret checks the client's proof.
fn authenticate_client(
    stream: &mut (impl Read + Write),
    served: &Served,
    node: &str,
    client_nonce: &Nonce,
) -> Result<(), String> {
    let Some(secret) = &served.auth else {
        let mut a = [0u8; 5];
        a[..4].copy_from_slice(ANSWER_MAGIC);
        a[4] = MODE_OPEN;
        return stream
            .write_all(&a)
            .map_err(|e| format!("answering the hello: {e}"));
    };
    let ours = auth::nonce();
    let proof = secret.prove(Step::TcpServer, &[client_nonce, &ours, node.as_bytes()]);
    let mut a = Vec::with_capacity(5 + NONCE_LEN + PROOF_LEN);
    a.extend_from_slice(ANSWER_MAGIC);
    a.push(MODE_AUTH);
    a.extend_from_slice(&ours);
    a.extend_from_slice(&proof);
    stream
        .write_all(&a)
        .map_err(|e| format!("answering the hello: {e}"))?;
    let mut theirs = [0u8; PROOF_LEN];
    stream
        .read_exact(&mut theirs)
        .map_err(|e| format!("no proof of the deployment secret from {node}: {e}"))?;
    if secret.verify(
        Step::TcpClient,
        &[&ours, client_nonce, node.as_bytes()],
        &theirs,
    ) {
        Ok(())
    } else {
        Err(format!(
            "{node} did not prove it holds the deployment secret: its {SECRET_KEY} differs from \
             this worker's"
        ))
    }
}

/// The client's side of a connection's authentication: sends the hello,
/// checks the server's answer, proves our own secret when it asks.
fn authenticate_server(
    stream: &mut TcpStream,
    node: &str,
    auth: Option<&Secret>,
    server: &str,
) -> Result<(), String> {
    let ours = auth::nonce();
    stream
        .write_all(&encode_hello(node, &ours))
        .map_err(|e| format!("sending the hello: {e}"))?;
    let mut a = [0u8; 5];
    stream
        .read_exact(&mut a)
        .map_err(|e| format!("no answer to the hello: {e}"))?;
    if &a[..4] != ANSWER_MAGIC {
        return Err(format!(
            "{server} did not answer as an ascend-pd transfer server of this version"
        ));
    }
    match (a[4], auth) {
        (MODE_OPEN, None) => Ok(()),
        (MODE_OPEN, Some(_)) => Err(format!(
            "{server} runs without a deployment secret, but this worker has {SECRET_KEY} set: \
             set the same secret file on both workers (or on neither)"
        )),
        (MODE_AUTH, None) => Err(format!(
            "{server} requires the deployment secret: set {SECRET_KEY} (or {SECRET_ENV}) to the \
             same secret file it uses"
        )),
        (MODE_AUTH, Some(secret)) => {
            let mut rest = [0u8; NONCE_LEN + PROOF_LEN];
            stream
                .read_exact(&mut rest)
                .map_err(|e| format!("truncated answer to the hello: {e}"))?;
            let (theirs, proof) = rest.split_at(NONCE_LEN);
            if !secret.verify(Step::TcpServer, &[&ours, theirs, node.as_bytes()], proof) {
                return Err(format!(
                    "{server} did not prove it holds the deployment secret: its {SECRET_KEY} \
                     differs from this worker's"
                ));
            }
            let mine = secret.prove(Step::TcpClient, &[theirs, &ours, node.as_bytes()]);
            stream
                .write_all(&mine)
                .map_err(|e| format!("sending our proof: {e}"))
        }
        (MODE_BUSY, _) => Err(format!(
            "{server} refused the connection: its transfer server already serves its maximum of \
             connections (TcpOptions::max_server_connections); retry later, or give it fewer peers"
        )),
        (m, _) => Err(format!("{server} answered the hello with unknown mode {m}")),
    }
}

/// Serves one connection until EOF or error. A malformed, out-of-range or
/// ungranted request gets an error reply and closes the connection (its
/// payload length cannot be trusted to resynchronise).
fn serve_connection(mut stream: TcpStream, served: &Served, idle: &IdleMark) {
    // A stalled client must not hold a grant's request open forever.
    let _ = stream.set_write_timeout(Some(served.io_timeout));
    let mut timed = Deadline {
        stream: &mut stream,
        deadline: Instant::now() + HELLO_TIMEOUT.min(served.io_timeout),
        what: HELLO_LATE,
    };
    let said = read_hello(&mut timed).and_then(|(node, nonce)| {
        authenticate_client(&mut timed, served, &node, &nonce).map(|()| node)
    });
    let _ = stream.set_read_timeout(Some(served.io_timeout));
    let node = match said {
        Ok(n) => n,
        Err(msg) => {
            if served.auth.is_some() {
                served.unauthenticated.fetch_add(1, Ordering::Relaxed);
                if !served.unauthenticated_logged.swap(true, Ordering::Relaxed) {
                    log::warn!(
                        "tcp transfer server: refused a connection: {msg} (later refusals are \
                         only counted)"
                    );
                }
            }
            let _ = reply(&mut stream, 1, &msg);
            return;
        }
    };
    let mut req = [0u8; REQ_LEN];
    let mut stagers = Stagers::default();
    loop {
        // Idle (evictable at the cap) until a request's first byte; from
        // then on the whole request has one deadline, however its bytes
        // trickle in or its reply is read.
        idle.set(true);
        let _ = stream.set_read_timeout(Some(served.io_timeout));
        // Usually the whole header comes in this one read.
        let got = match stream.read(&mut req) {
            Ok(n) if n > 0 => n,
            _ => return,
        };
        idle.set(false);
        let mut stream = Deadline {
            stream: &mut stream,
            deadline: Instant::now() + served.io_timeout,
            what: REQUEST_LATE,
        };
        if stream.read_exact(&mut req[got..]).is_err() {
            return;
        }
        let r = Request::parse(&req);
        let op = r.op;
        let target = check_request(&served.pools, &r).and_then(|t| {
            let serving = served.grants.begin(&node, r.at, op == OP_WRITE, r.tag)?;
            Ok((t, serving))
        });
        let ((pool, at, len), serving) = match target {
            Ok(t) => t,
            Err(msg) => {
                let _ = reply(&mut stream, 1, &msg);
                return;
            }
        };
        if let Some(dev) = &pool.device {
            if !serve_device(&mut stream, &mut stagers, op, (dev, at, len), serving) {
                return;
            }
            continue;
        }
        let addr = (pool.ptr + at) as *mut u8;
        let ok = match op {
            OP_WRITE => {
                // SAFETY: check_request proved [addr, addr+len) lies inside
                // one page of a registered pool that outlives this thread
                // (accept_loop joins us before the pools can drop). The page
                // is under a live write grant of this client (`serving`
                // holds it): its owner lent it out and keeps no handle to
                // its bytes until the grant is over, which waits for us.
                let dst = unsafe { std::slice::from_raw_parts_mut(addr, len) };
                stream.read_exact(dst).and_then(|_| {
                    // Done with the page before the client can learn it:
                    // its notice then never finds this request in flight.
                    drop(serving);
                    reply(&mut stream, 0, "")
                })
            }
            _ => {
                // SAFETY: in the pool as above; under a live read grant the
                // page is sealed (only read) until the grant is over.
                let src = unsafe { std::slice::from_raw_parts(addr.cast_const(), len) };
                // The reply's header and the bytes in one call.
                let head = [0u8; REPLY_LEN];
                write_all_vectored(&mut stream, &mut [IoSlice::new(&head), IoSlice::new(src)])
            }
        };
        if ok.is_err() {
            return;
        }
    }
}

/// Serves one request on an NPU page (byte `at` of `dev`) through staging;
/// false when the connection must close.
fn serve_device<S>(
    stream: &mut Deadline<'_>,
    stagers: &mut Stagers,
    op: u8,
    (dev, at, len): (&DeviceBuffer, usize, usize),
    serving: Serving<'_, S>,
) -> bool {
    let stager = match stagers.get(dev, SERVER_STAGE_TIMEOUT) {
        Ok(s) => s,
        Err(e) => {
            let _ = reply(stream, 1, &format!("cannot stage NPU memory: {e:?}"));
            return false;
        }
    };
    // A status-0 reply header with no message.
    let ok_header = [0u8; REPLY_LEN];
    let mut out = Counted {
        inner: &mut *stream,
        written: 0,
    };
    let r = match op {
        // The reply goes out only once the bytes are in device memory.
        OP_WRITE => stager.recv_into(out.inner, dev, at, len).and_then(|()| {
            drop(serving); // the page is written: see serve_connection
            reply(out.inner, 0, "").map_err(StageError::Io)
        }),
        _ => stager.send_from(&mut out, dev, at, len, Some(&ok_header)),
    };
    let replied = out.written > 0;
    match r {
        Ok(()) => true,
        Err(StageError::Io(_)) => false,
        Err(StageError::Device(e)) => {
            // Reported while nothing of the reply has gone out; the
            // connection closes either way (the stream is out of step).
            if !replied {
                let _ = reply(stream, 1, &format!("NPU copy failed: {e}"));
            }
            false
        }
    }
}

/// A writer that counts what went through it.
struct Counted<'a, W> {
    inner: &'a mut W,
    written: usize,
}

impl<W: Write> Write for Counted<'_, W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.written += n;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// Checks a request against the served pools; returns the pool, the byte
/// offset in it and the length.
/// One transfer request's header (48 bytes, little-endian; see the
/// module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Request {
    magic: u32,
    op: u8,
    at: BufferRef,
    offset: u32,
    len: u64,
    tag: GrantTag,
}

impl Request {
    fn encode(&self) -> [u8; REQ_LEN] {
        let mut h = [0u8; REQ_LEN];
        h[0..4].copy_from_slice(&self.magic.to_le_bytes());
        h[4] = self.op;
        h[8..24].copy_from_slice(self.at.uuid.as_bytes());
        h[24..28].copy_from_slice(&self.at.page.to_le_bytes());
        h[28..32].copy_from_slice(&self.offset.to_le_bytes());
        h[32..40].copy_from_slice(&self.len.to_le_bytes());
        if let Some(t) = self.tag.get() {
            h[5] = FLAG_TAGGED;
            h[40..48].copy_from_slice(&t.to_le_bytes());
        }
        h
    }

    /// Every 48 bytes parse; [`check_request`] decides whether they mean
    /// anything.
    fn parse(h: &[u8; REQ_LEN]) -> Request {
        let u32_at = |i: usize| u32::from_le_bytes([h[i], h[i + 1], h[i + 2], h[i + 3]]);
        let u64_at = |i: usize| u64::from(u32_at(i)) | (u64::from(u32_at(i + 4)) << 32);
        let mut uuid = [0u8; 16];
        uuid.copy_from_slice(&h[8..24]);
        Request {
            magic: u32_at(0),
            op: h[4],
            at: BufferRef {
                uuid: Uuid::from_bytes(uuid),
                page: u32_at(24),
            },
            offset: u32_at(28),
            len: u64_at(32),
            tag: match h[5] & FLAG_TAGGED {
                0 => GrantTag::UNTAGGED,
                _ => GrantTag::new(u64_at(40)),
            },
        }
    }
}

/// Where a request's bytes are: its pool, the byte offset in it, the
/// length; or why it is refused.
fn check_request<'a>(
    pools: &'a HashMap<Uuid, LocalPool>,
    r: &Request,
) -> Result<(&'a LocalPool, usize, usize), String> {
    let (magic, op, uuid, page, offset, len) = (
        r.magic,
        r.op,
        r.at.uuid,
        r.at.page as usize,
        r.offset as usize,
        r.len,
    );
    if magic != MAGIC {
        return Err("bad magic: not an ascend-pd tcp transfer request".into());
    }
    if op != OP_WRITE && op != OP_READ {
        return Err(format!("unknown op {op}"));
    }
    let p = pools
        .get(&uuid)
        .ok_or_else(|| format!("unknown buffer {}", uuid.simple()))?;
    if page >= p.pages {
        return Err(format!(
            "page {page} out of range (buffer {} has {} pages)",
            uuid.simple(),
            p.pages
        ));
    }
    let len = usize::try_from(len).map_err(|_| "length too large".to_string())?;
    if offset.checked_add(len).is_none_or(|end| end > p.page_size) {
        return Err(format!(
            "{len} bytes at offset {offset} exceed the {}-byte page",
            p.page_size
        ));
    }
    Ok((p, page * p.page_size + offset, len))
}

/// One request of a batch: `len` bytes at `offset` within the op's pages.
#[derive(Clone, Copy)]
struct Slice {
    op: usize,
    /// Where the slice starts in the remote page (sent in the request).
    offset: usize,
    /// Where it starts in the local page.
    local: usize,
    len: usize,
}

impl TransferChannel for TcpChannel {
    fn kind(&self) -> ChannelKind {
        ChannelKind::Tcp
    }

    fn local_table(&self) -> Vec<BufferDesc> {
        table_of(&self.pools)
    }

    fn endpoint(&self) -> Endpoint {
        Endpoint::Tcp {
            addr: self.server.advertised.clone(),
        }
    }

    fn attach(
        &self,
        node: &str,
        table: &[BufferDesc],
        endpoint: &Endpoint,
    ) -> Result<PeerId, ChannelError> {
        let Endpoint::Tcp { addr } = endpoint else {
            return Err(ChannelError::Handshake(format!(
                "peer {node} did not send a tcp endpoint"
            )));
        };
        let addr = addr
            .to_socket_addrs()
            .ok()
            .and_then(|mut a| a.next())
            .ok_or_else(|| {
                ChannelError::Handshake(format!("peer {node}: bad transfer address {addr:?}"))
            })?;
        let peer = Arc::new(TcpPeer {
            node: node.to_string(),
            addr,
            table: PeerTable::new(table)?,
            conns: (0..self.opts.connections.max(1))
                .map(|_| Mutex::new(None))
                .collect(),
        });
        Ok(self.peers.insert(node, peer).0)
    }

    fn detach(&self, peer: PeerId) {
        self.peers.remove(peer);
    }

    fn submit_read(
        &self,
        peer: PeerId,
        ops: Vec<ReadOp>,
    ) -> Result<Completion<MemObj>, ChannelError> {
        self.submit(peer, OpKind::Read, GrantTag::UNTAGGED, ops)
    }

    fn reads_direct(&self, device: DeviceKind) -> bool {
        device == DeviceKind::Cpu
    }

    unsafe fn read_direct(
        &self,
        peer: PeerId,
        ops: &[DirectRead],
        deadline: Instant,
    ) -> Result<(), ChannelError> {
        let p = self.peer(peer)?;
        check_direct(&p, ops, "read")?;
        let (slices, segs) = direct_slices(ops, self.opts.slice_bytes);
        let (node, opts, segs) = (self.node.as_str(), &self.opts, segs.as_slice());
        let p = &*p;
        // on_connections returns only after every connection thread ended,
        // so no byte lands after this call.
        on_connections(p, &slices, |conn, mine| {
            run_direct_on_connection(p, node, conn, mine, segs, opts, deadline)
        })
    }

    fn writes_direct(&self, device: DeviceKind) -> bool {
        device == DeviceKind::Cpu
    }

    unsafe fn write_direct(
        &self,
        peer: PeerId,
        tag: GrantTag,
        ops: &[DirectWrite],
        deadline: Instant,
    ) -> Result<(), ChannelError> {
        let p = self.peer(peer)?;
        // Cut as a direct read is (ranges that continue one another in the
        // remote page share requests), the segments being the sources.
        let as_ranges: Vec<DirectRead> = ops
            .iter()
            .map(|o| DirectRead {
                remote: o.remote,
                offset: o.offset,
                dst: o.src,
                len: o.len,
            })
            .collect();
        check_direct(&p, &as_ranges, "write")?;
        let (slices, segs) = direct_slices(&as_ranges, self.opts.slice_bytes);
        let (node, opts, segs) = (self.node.as_str(), &self.opts, segs.as_slice());
        let p = &*p;
        // on_connections returns only after every connection thread ended,
        // so no byte is read from the sources after this call.
        on_connections(p, &slices, |conn, mine| {
            run_direct_write_on_connection(p, node, conn, tag, mine, segs, opts, deadline)
        })
    }

    fn submit_write(
        &self,
        peer: PeerId,
        tag: GrantTag,
        ops: Vec<WriteOp>,
    ) -> Result<Completion<SealedMemObj>, ChannelError> {
        self.submit(peer, OpKind::Write, tag, ops)
    }

    fn grant(
        &self,
        peer: PeerId,
        access: Access,
        tag: GrantTag,
        pages: &[BufferRef],
    ) -> Result<GrantId, ChannelError> {
        check_grant_pages(&self.pools, pages)?;
        let (node, _) = self.peers.entry(peer)?;
        Ok(self.served.grants.add(&node, access, tag, pages, ()))
    }

    fn release(&self, grant: GrantId) -> bool {
        self.served.grants.release(grant)
    }

    fn revoke(&self, grant: GrantId) {
        self.served.grants.revoke(grant);
    }

    fn is_quiescent(&self, grant: GrantId) -> bool {
        // Refused from the revoke on; quiescent once nothing is in flight.
        self.served.grants.settle(grant, |_| true)
    }

    fn grant_stats(&self) -> GrantStats {
        GrantStats {
            unauthenticated: self.served.unauthenticated.load(Ordering::Relaxed),
            busy: self.served.busy.load(Ordering::Relaxed),
            ..self.served.grants.stats()
        }
    }

    fn auth(&self) -> Option<&Secret> {
        self.opts.auth.as_ref()
    }

    /// Nothing: the peer's own process serves its pages, and would answer
    /// for pages it never had (a probe proves nothing), so a receiver
    /// bounds a tcp sender by what it controls itself.
    fn verified_peer_pages(&self, peer: PeerId) -> PeerPages {
        let _ = peer;
        PeerPages::Unverifiable
    }
}

impl TcpChannel {
    fn submit<P: LocalPage>(
        &self,
        peer: PeerId,
        kind: OpKind,
        tag: GrantTag,
        ops: Vec<TransferOp<P>>,
    ) -> Result<Completion<P>, ChannelError> {
        let p = self.peer(peer)?;
        check_ops(&p.table, &ops, false)?;
        for (i, op) in ops.iter().enumerate() {
            let b = op.local.pool().buffer();
            if op.local.device() != DeviceKind::Cpu && !is_acl_device(b) {
                return Err(ChannelError::BadLocal {
                    op: i,
                    local: op.local.buffer_ref(),
                    reason: format!(
                        "{} memory not allocated by the ACL runtime; tcp can only stage NPU pages \
                         of memory::npu pools",
                        op.local.device()
                    ),
                });
            }
        }
        let mut slices = Vec::new();
        for (i, op) in ops.iter().enumerate() {
            let mut off = 0;
            while off < op.len {
                let len = (op.len - off).min(self.opts.slice_bytes.max(1));
                slices.push(Slice {
                    op: i,
                    offset: op.remote_offset + off,
                    local: op.local_offset + off,
                    len,
                });
                off += len;
            }
        }
        let opts = self.opts.clone();
        let node = self.node.clone();
        let (tx, completion) = Completion::pending(watch_ops(&ops));
        // A kept thread: a new one can wait tens of ms for a core (see crate::threads).
        crate::threads::run("pd-tcp-batch", move || {
            let r = run_batch(&p, &node, (kind, tag), &ops, &slices, &opts);
            // Every connection thread of the batch has ended: the pages
            // are no longer touched.
            tx.complete(r, pages_of(ops));
        })
        .map_err(|source| ChannelError::Io {
            context: "spawning a tcp batch thread".into(),
            source,
        })?;
        Ok(completion)
    }
}

fn run_batch<P: LocalPage>(
    p: &TcpPeer,
    node: &str,
    kind: (OpKind, GrantTag),
    ops: &[TransferOp<P>],
    slices: &[Slice],
    opts: &TcpOptions,
) -> Result<(), ChannelError> {
    on_connections(p, slices, |conn, mine| {
        run_on_connection(p, node, conn, kind, ops, mine, opts)
    })
}

/// Spreads `items` over the peer's connections — connection `c` takes
/// items `c, c + n, ...`, so each gets a share of every op — and runs
/// `work` on each share with its connection held, one thread per
/// connection. Returns when every thread ended (no byte moves after), with
/// the first error; a connection whose work failed is dropped (its
/// stream's state is unknown) and made again on next use.
fn on_connections<T: Copy + Send + Sync>(
    p: &TcpPeer,
    items: &[T],
    work: impl Fn(&mut Option<Conn>, &[T]) -> Result<(), ChannelError> + Sync,
) -> Result<(), ChannelError> {
    if items.is_empty() {
        return Ok(());
    }
    let conns = p.conns.len().min(items.len());
    let work = &work;
    let share = |c: usize| -> Result<(), ChannelError> {
        let mine: Vec<T> = items.iter().skip(c).step_by(conns).copied().collect();
        let mut guard = p.conns[c].lock().unwrap_or_else(|e| e.into_inner());
        let r = work(&mut guard, &mine);
        if r.is_err() {
            *guard = None;
        }
        r
    };
    let share = &share;
    let results: Vec<Result<(), ChannelError>> = std::thread::scope(|s| {
        // The first share runs on this thread: a batch that fits one
        // connection starts no thread at all.
        let handles: Vec<_> = (1..conns).map(|c| s.spawn(move || share(c))).collect();
        let first = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| share(0)))
            .unwrap_or_else(|_| {
                Err(ChannelError::WorkerLost(
                    "tcp connection thread panicked".into(),
                ))
            });
        std::iter::once(first)
            .chain(handles.into_iter().map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(ChannelError::WorkerLost(
                        "tcp connection thread panicked".into(),
                    ))
                })
            }))
            .collect()
    });
    results.into_iter().collect()
}

fn gone(p: &TcpPeer, op: Option<usize>, e: &io::Error, timeout: Duration) -> ChannelError {
    if matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    ) {
        ChannelError::Timeout {
            what: format!(
                "tcp transfer with {} ({}){}",
                p.node,
                p.addr,
                op.map(|o| format!(", op {o}")).unwrap_or_default()
            ),
            after: timeout,
        }
    } else {
        ChannelError::PeerGone {
            peer: format!("{} ({})", p.node, p.addr),
            op,
            detail: e.to_string(),
        }
    }
}

/// The NPU buffer and byte offset of `len` bytes at `offset` in a local
/// NPU page (`None` for host pages; submit refused NPU pages without one).
fn local_device<P: LocalPage>(op: &TransferOp<P>, offset: usize) -> Option<(&DeviceBuffer, usize)> {
    let b = op.local.pool().buffer();
    // SAFETY: used only at `op.local`'s page, which the batch owns (a
    // `MemObj` to read into, a sealed page to write from) until it ends.
    let dev = unsafe { device_buffer(b) }?;
    Some((dev, op.local.page() as usize * b.page_size() + offset))
}

fn stage_err(p: &TcpPeer, op: usize, e: StageError, timeout: Duration) -> ChannelError {
    match e {
        StageError::Io(e) => gone(p, Some(op), &e, timeout),
        StageError::Device(source) => ChannelError::Npu {
            context: format!("op {op}: staging the local NPU page for {}", p.node),
            source,
        },
    }
}

/// Reads the server's reply to a request of op `op`: its bytes follow on
/// success; a refusal is the op's error, with the server's reason.
fn read_reply(
    p: &TcpPeer,
    stream: &mut TcpStream,
    op: usize,
    opts: &TcpOptions,
) -> Result<(), ChannelError> {
    let mut r = [0u8; REPLY_LEN];
    stream
        .read_exact(&mut r)
        .map_err(|e| gone(p, Some(op), &e, opts.io_timeout))?;
    let msg_len = u32::from_le_bytes(r[4..8].try_into().expect("4"));
    if r[0] != 0 {
        let mut msg = vec![0u8; msg_len.min(MAX_ERROR_LEN) as usize];
        let _ = stream.read_exact(&mut msg);
        return Err(ChannelError::Remote {
            op,
            message: String::from_utf8_lossy(&msg).into_owned(),
        });
    }
    Ok(())
}

/// The connection in `conn`, made (and authenticated) if there is none.
fn connected<'c>(
    p: &TcpPeer,
    node: &str,
    conn: &'c mut Option<Conn>,
    opts: &TcpOptions,
) -> Result<&'c mut Conn, ChannelError> {
    // The server cuts a connection idle too long, or to make room for
    // another client at its cap: open a new one rather than fail on it.
    if conn.as_ref().is_some_and(|c| closed_by_peer(&c.stream)) {
        *conn = None;
    }
    if conn.is_none() {
        let s = TcpStream::connect_timeout(&p.addr, opts.io_timeout)
            .map_err(|e| gone(p, None, &e, opts.io_timeout))?;
        s.set_nodelay(true).ok();
        s.set_read_timeout(Some(opts.io_timeout)).ok();
        s.set_write_timeout(Some(opts.io_timeout)).ok();
        // The server serves us only under grants made to our (proven) node.
        let mut s = s;
        let server = format!("{} ({})", p.node, p.addr);
        authenticate_server(&mut s, node, opts.auth.as_ref(), &server)
            .map_err(|e| ChannelError::Handshake(format!("tcp transfer connection: {e}")))?;
        *conn = Some(Conn {
            stream: s,
            stagers: Stagers::default(),
        });
    }
    Ok(conn.as_mut().expect("connected above"))
}

/// Whether the server closed (or broke) a connection between our
/// requests: it never sends anything unasked, so any readable state
/// (EOF, an error, stray bytes) means the connection is not usable.
fn closed_by_peer(stream: &TcpStream) -> bool {
    if stream.set_nonblocking(true).is_err() {
        return true;
    }
    let mut b = [0u8; 1];
    let usable = matches!(stream.peek(&mut b), Err(e) if e.kind() == io::ErrorKind::WouldBlock);
    stream.set_nonblocking(false).is_err() || !usable
}

/// One request of a direct read: `len` bytes at `offset` of op `op`'s
/// remote page (and of the ops after it that continue that range),
/// received straight into host memory, in order, at the destinations
/// `segs` indexes in the read's segment list.
#[derive(Clone, Copy)]
struct DirectSlice {
    op: usize,
    remote: BufferRef,
    offset: usize,
    len: usize,
    segs: (usize, usize),
}

/// Checks every range of a direct `what` ("read" or "write") against the
/// peer's table, and that it fits the protocol's 32-bit page offsets.
fn check_direct(p: &TcpPeer, ops: &[DirectRead], what: &str) -> Result<(), ChannelError> {
    for (i, op) in ops.iter().enumerate() {
        p.table
            .resolve_range(i, op.remote, op.offset, op.len, what)?;
        if u32::try_from(op.offset.saturating_add(op.len)).is_err() {
            return Err(ChannelError::BadRef {
                op: i,
                remote: op.remote,
                reason: format!("a direct {what} past 4 GiB into a page (tcp offsets are 32-bit)"),
            });
        }
    }
    Ok(())
}

/// Cuts a direct read into requests of at most `cap` bytes. Ops that
/// continue the previous one's remote range (a chunk's runs, which lie back
/// to back in its page) share requests, so a chunk scattered over many
/// cache blocks still moves in large requests. Returns the requests and
/// the (destination, bytes) segments they index.
fn direct_slices(ops: &[DirectRead], cap: usize) -> (Vec<DirectSlice>, Vec<(usize, usize)>) {
    let cap = cap.max(1);
    let (mut slices, mut segs): (Vec<DirectSlice>, Vec<(usize, usize)>) = (Vec::new(), Vec::new());
    for (i, op) in ops.iter().enumerate() {
        let mut off = 0;
        while off < op.len {
            let at = op.offset + off;
            let room = match slices.last() {
                Some(l) if l.remote == op.remote && l.offset + l.len == at && l.len < cap => {
                    cap - l.len
                }
                _ => 0,
            };
            let take = (op.len - off).min(if room > 0 { room } else { cap });
            if room > 0 {
                let l = slices.last_mut().expect("room implies a slice");
                l.len += take;
                l.segs.1 += 1;
            } else {
                slices.push(DirectSlice {
                    op: i,
                    remote: op.remote,
                    offset: at,
                    len: take,
                    segs: (segs.len(), segs.len() + 1),
                });
            }
            segs.push((op.dst + off, take));
            off += take;
        }
    }
    (slices, segs)
}

/// Sets both of `stream`'s I/O timeouts.
fn set_timeouts(stream: &TcpStream, t: Duration) {
    stream.set_read_timeout(Some(t)).ok();
    stream.set_write_timeout(Some(t)).ok();
}

/// Arms `stream` so its next blocking call waits at most until `deadline`
/// (and no longer than the I/O timeout); once the deadline has passed, a
/// timeout error saying `what` instead. Direct reads and writes re-arm
/// before every call, so a whole transfer ends by its deadline.
fn arm_until(
    stream: &TcpStream,
    deadline: Instant,
    opts: &TcpOptions,
    what: impl FnOnce() -> String,
) -> Result<(), ChannelError> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(ChannelError::Timeout {
            what: what(),
            after: opts.io_timeout.min(left),
        });
    }
    set_timeouts(stream, left.min(opts.io_timeout));
    Ok(())
}

/// A direct read's share of one connection: requests pipelined `window`
/// deep, each reply's bytes received into its destination.
fn run_direct_on_connection(
    p: &TcpPeer,
    node: &str,
    conn: &mut Option<Conn>,
    slices: &[DirectSlice],
    segs: &[(usize, usize)],
    opts: &TcpOptions,
    deadline: Instant,
) -> Result<(), ChannelError> {
    let Conn { stream, .. } = connected(p, node, conn, opts)?;
    // Past the deadline the peer may reuse its pages: the read is given up
    // (the caller drops the connection, so nothing sent later lands).
    let arm = |stream: &TcpStream, op: usize| {
        arm_until(stream, deadline, opts, || {
            format!(
                "direct read from {} ({}), op {op}: the pull's lease ended",
                p.node, p.addr
            )
        })
    };
    let window = opts.window.max(1);
    let (mut sent, mut done) = (0usize, 0usize);
    let mut heads = Vec::with_capacity(window * REQ_LEN);
    while done < slices.len() {
        // The requests the window has room for, in one write.
        heads.clear();
        let first = sent;
        while sent < slices.len() && sent - done < window {
            let sl = slices[sent];
            let h = Request {
                magic: MAGIC,
                op: OP_READ,
                at: sl.remote,
                offset: sl.offset as u32,
                len: sl.len as u64,
                tag: GrantTag::UNTAGGED,
            }
            .encode();
            heads.extend_from_slice(&h);
            sent += 1;
        }
        if !heads.is_empty() {
            let op = slices[first].op;
            arm(stream, op)?;
            stream
                .write_all(&heads)
                .map_err(|e| gone(p, Some(op), &e, opts.io_timeout))?;
        }
        let sl = slices[done];
        arm(stream, sl.op)?;
        read_reply(p, stream, sl.op, opts)?;
        let mut dst: Vec<IoSliceMut<'_>> = segs[sl.segs.0..sl.segs.1]
            .iter()
            .map(|&(dst, len)| {
                // SAFETY: read_direct's caller vouched that each op's [dst,
                // dst + len), which the segments split, is host memory it
                // may write, untouched by anyone else, for the whole call;
                // read_direct returns only after this thread ended. The
                // segments of one request do not overlap (they split
                // disjoint destinations).
                IoSliceMut::new(unsafe { std::slice::from_raw_parts_mut(dst as *mut u8, len) })
            })
            .collect();
        // Each call waits at most until the deadline (re-armed per call).
        let mut left: &mut [IoSliceMut<'_>] = &mut dst;
        while !left.is_empty() {
            arm(stream, sl.op)?;
            // (std passes at most the kernel's IOV_MAX segments per call.)
            let n = match stream.read_vectored(left) {
                Ok(0) => Err(io::Error::from(io::ErrorKind::UnexpectedEof)),
                Ok(n) => Ok(n),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(0),
                Err(e) => Err(e),
            }
            .map_err(|e| gone(p, Some(sl.op), &e, opts.io_timeout))?;
            IoSliceMut::advance_slices(&mut left, n);
        }
        done += 1;
    }
    // The connection is reused: back to the usual timeouts.
    set_timeouts(stream, opts.io_timeout);
    Ok(())
}

/// A direct write's share of one connection: requests pipelined `window`
/// deep, each sent with its payload gathered from its source segments.
#[allow(clippy::too_many_arguments)]
fn run_direct_write_on_connection(
    p: &TcpPeer,
    node: &str,
    conn: &mut Option<Conn>,
    tag: GrantTag,
    slices: &[DirectSlice],
    segs: &[(usize, usize)],
    opts: &TcpOptions,
    deadline: Instant,
) -> Result<(), ChannelError> {
    let Conn { stream, .. } = connected(p, node, conn, opts)?;
    // Past the deadline the write is given up (the caller drops the
    // connection).
    let arm = |stream: &TcpStream, op: usize| {
        arm_until(stream, deadline, opts, || {
            format!("direct write to {} ({}), op {op}", p.node, p.addr)
        })
    };
    let window = opts.window.max(1);
    let (mut sent, mut done) = (0usize, 0usize);
    while done < slices.len() {
        while sent < slices.len() && sent - done < window {
            let sl = slices[sent];
            let h = Request {
                magic: MAGIC,
                op: OP_WRITE,
                at: sl.remote,
                offset: sl.offset as u32,
                len: sl.len as u64,
                tag,
            }
            .encode();
            let mut bufs: Vec<IoSlice<'_>> = Vec::with_capacity(1 + sl.segs.1 - sl.segs.0);
            bufs.push(IoSlice::new(&h));
            for &(src, len) in &segs[sl.segs.0..sl.segs.1] {
                // SAFETY: write_direct's caller vouched that each op's [src,
                // src + len), which the segments split, is host memory it may
                // read and nothing writes for the whole call; write_direct
                // returns only after this thread ended.
                bufs.push(IoSlice::new(unsafe {
                    std::slice::from_raw_parts(src as *const u8, len)
                }));
            }
            // Each call waits at most until the deadline (re-armed per call).
            let mut left: &mut [IoSlice<'_>] = &mut bufs;
            while !left.is_empty() {
                arm(stream, sl.op)?;
                let n = match stream.write_vectored(left) {
                    Ok(0) => Err(io::Error::from(io::ErrorKind::WriteZero)),
                    Ok(n) => Ok(n),
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(0),
                    Err(e) => Err(e),
                }
                .map_err(|e| gone(p, Some(sl.op), &e, opts.io_timeout))?;
                IoSlice::advance_slices(&mut left, n);
            }
            sent += 1;
        }
        let sl = slices[done];
        arm(stream, sl.op)?;
        read_reply(p, stream, sl.op, opts)?;
        done += 1;
    }
    // The connection is reused: back to the usual timeouts.
    set_timeouts(stream, opts.io_timeout);
    Ok(())
}

fn run_on_connection<P: LocalPage>(
    p: &TcpPeer,
    node: &str,
    conn: &mut Option<Conn>,
    (kind, tag): (OpKind, GrantTag),
    ops: &[TransferOp<P>],
    slices: &[Slice],
    opts: &TcpOptions,
) -> Result<(), ChannelError> {
    let Conn { stream, stagers } = connected(p, node, conn, opts)?;
    let window = opts.window.max(1);
    let (mut sent, mut done) = (0usize, 0usize);
    let mut heads = Vec::with_capacity(window * REQ_LEN);
    while done < slices.len() {
        heads.clear();
        while sent < slices.len() && sent - done < window {
            let sl = slices[sent];
            let op = &ops[sl.op];
            let h = Request {
                magic: MAGIC,
                op: if kind == OpKind::Write {
                    OP_WRITE
                } else {
                    OP_READ
                },
                at: op.remote,
                offset: sl.offset as u32,
                len: sl.len as u64,
                tag,
            }
            .encode();
            if kind == OpKind::Read {
                // Reads' requests go out together, below.
                heads.extend_from_slice(&h);
                sent += 1;
                continue;
            }
            if let Some((dev, at)) = local_device(op, sl.local) {
                stream
                    .write_all(&h)
                    .map_err(|e| gone(p, Some(sl.op), &e, opts.io_timeout))?;
                stagers
                    .get(dev, opts.io_timeout)
                    .and_then(|st| st.send_from(stream, dev, at, sl.len, None))
                    .map_err(|e| stage_err(p, sl.op, e, opts.io_timeout))?;
                sent += 1;
                continue;
            }
            // SAFETY: check_ops proved sl.local+sl.len <= op.local_end()
            // <= the local page size, and `ops` keeps the page alive.
            let src = unsafe {
                std::slice::from_raw_parts(
                    (op.local.addr() as usize + sl.local) as *const u8,
                    sl.len,
                )
            };
            // The request and its payload in one call.
            write_all_vectored(stream, &mut [IoSlice::new(&h), IoSlice::new(src)])
                .map_err(|e| gone(p, Some(sl.op), &e, opts.io_timeout))?;
            sent += 1;
        }
        if !heads.is_empty() {
            let op = slices[done].op;
            stream
                .write_all(&heads)
                .map_err(|e| gone(p, Some(op), &e, opts.io_timeout))?;
        }
        let sl = slices[done];
        read_reply(p, stream, sl.op, opts)?;
        if kind == OpKind::Read {
            let op = &ops[sl.op];
            if let Some((dev, at)) = local_device(op, sl.local) {
                stagers
                    .get(dev, opts.io_timeout)
                    .and_then(|st| st.recv_into(stream, dev, at, sl.len))
                    .map_err(|e| stage_err(p, sl.op, e, opts.io_timeout))?;
                done += 1;
                continue;
            }
            // SAFETY: as for writes; the local page is a distinct, live
            // allocation that this batch owns for its duration.
            let dst = unsafe {
                std::slice::from_raw_parts_mut(
                    (op.local.addr() as usize + sl.local) as *mut u8,
                    sl.len,
                )
            };
            stream
                .read_exact(dst)
                .map_err(|e| gone(p, Some(sl.op), &e, opts.io_timeout))?;
        }
        done += 1;
    }
    Ok(())
}

/// The server's decoders, for the fuzz tests (`tests/fuzz.rs`).
#[doc(hidden)]
pub mod fuzzing {
    use super::*;

    /// Length of a request header.
    pub const REQUEST_LEN: usize = REQ_LEN;

    /// A valid request header.
    pub fn request(write: bool, at: BufferRef, offset: u32, len: u64, tag: Option<u64>) -> Vec<u8> {
        Request {
            magic: MAGIC,
            op: if write { OP_WRITE } else { OP_READ },
            at,
            offset,
            len,
            tag: tag.map_or(GrantTag::UNTAGGED, GrantTag::new),
        }
        .encode()
        .to_vec()
    }

    /// Checks a request header (its first 48 bytes, zero-padded) against
    /// pools of `(uuid, pages, page_size)` at address 0: the byte range it
    /// would touch, or why it is refused.
    pub fn check(header: &[u8], pools: &[(Uuid, usize, usize)]) -> Result<(usize, usize), String> {
        let mut h = [0u8; REQ_LEN];
        let n = header.len().min(REQ_LEN);
        h[..n].copy_from_slice(&header[..n]);
        let r = Request::parse(&h);
        if Request::parse(&r.encode()) != r {
            return Err("a parsed request does not encode back to itself".into());
        }
        let pools: HashMap<Uuid, LocalPool> = pools
            .iter()
            .map(|&(uuid, pages, page_size)| {
                let pool = LocalPool {
                    ptr: 0,
                    page_size,
                    pages,
                    device: None,
                };
                (uuid, pool)
            })
            .collect();
        check_request(&pools, &r).map(|(_, at, len)| (at, len))
    }

    /// A valid connection hello.
    pub fn hello(node: &str, nonce: [u8; 16]) -> Vec<u8> {
        encode_hello(node, &nonce)
    }

    /// Reads a connection hello from `bytes`: the node id, or why not.
    pub fn read(bytes: &[u8]) -> Result<String, String> {
        read_hello(&mut std::io::Cursor::new(bytes)).map(|(node, _)| node)
    }
}

#[cfg(test)]
mod direct_slice_tests {
    use super::*;
    use uuid::Uuid;

    fn read(page: u32, offset: usize, dst: usize, len: usize) -> DirectRead {
        DirectRead {
            remote: BufferRef {
                uuid: Uuid::nil(),
                page,
            },
            offset,
            dst,
            len,
        }
    }

    #[test]
    fn runs_back_to_back_in_a_page_share_requests_up_to_the_cap() {
        // Three runs of one page back to back (scattered in memory), then a
        // gap, then another page.
        let ops = [
            read(0, 0, 1000, 300),
            read(0, 300, 5000, 300),
            read(0, 600, 9000, 300),
            read(0, 1000, 20000, 100),
            read(1, 1100, 30000, 100),
        ];
        let (slices, segs) = direct_slices(&ops, 512);
        let got: Vec<_> = slices
            .iter()
            .map(|s| {
                (
                    s.op,
                    s.remote.page,
                    s.offset,
                    s.len,
                    segs[s.segs.0..s.segs.1].to_vec(),
                )
            })
            .collect();
        assert_eq!(
            got,
            vec![
                (0, 0, 0, 512, vec![(1000, 300), (5000, 212)]),
                (1, 0, 512, 388, vec![(5212, 88), (9000, 300)]),
                (3, 0, 1000, 100, vec![(20000, 100)]),
                (4, 1, 1100, 100, vec![(30000, 100)]),
            ]
        );
        // Every byte once, in order.
        let total: usize = segs.iter().map(|s| s.1).sum();
        assert_eq!(total, ops.iter().map(|o| o.len).sum::<usize>());
    }
}
