//! The emulated HCCL: a real two-process rendezvous over a loopback TCP
//! socket named in the root info, memory registration, descriptor exchange
//! over that socket, peer memory mapped through `/proc/<pid>/fd/<fd>`, and
//! batch put/get executed in stream order as plain memory copies.

use std::any::Any;
use std::collections::{BTreeMap, HashMap};
use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use crate::link::{self, Direction, Path as LinkPath};
use crate::memory::{Lookup, PeerMapError, PeerMapping, Placement, Region};
use crate::runtime::{current_device, runtime};
use crate::status::*;
use crate::stream::{Copy, Task};

pub(crate) const ROOT_INFO_BYTES: usize = 4108;
pub(crate) const MEM_DESC_BYTES: usize = 512;

const ROOT_MAGIC: &[u8; 8] = b"ASEMURI1";
const DESC_MAGIC: &[u8; 8] = b"ASEMUMD1";
const HELLO_MAGIC: &[u8; 8] = b"ASEMUHI1";
const XCHG_MAGIC: &[u8; 4] = b"XCHG";
/// Upper bound on descriptors accepted from a peer in one exchange.
const MAX_EXCHANGE: u32 = 1 << 20;

pub(crate) const MEM_TYPE_DEVICE: u32 = 0;
pub(crate) const MEM_TYPE_HOST: u32 = 1;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// How long connection setup and descriptor exchange may take
/// (`HCCL_CONNECT_TIMEOUT` seconds, as with real HCCL; default 120).
fn link_timeout() -> Duration {
    let secs = std::env::var("HCCL_CONNECT_TIMEOUT")
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|s| *s > 0)
        .unwrap_or(120);
    Duration::from_secs(secs)
}

fn io_failure(what: &str, e: &io::Error) -> Failure {
    let code = match e.kind() {
        io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => HCCL_E_TIMEOUT,
        _ => HCCL_E_TCP_TRANSFER,
    };
    Failure::hccl(code, format!("{what}: {e}"))
}

fn random_token() -> [u8; 16] {
    let mut token = [0u8; 16];
    // SAFETY: writes at most token.len() bytes into token.
    let n = unsafe { libc::getrandom(token.as_mut_ptr().cast(), token.len(), 0) };
    if n != token.len() as isize {
        // Fall back to time and pid; uniqueness within one host is all we need.
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        token[..8].copy_from_slice(&(t as u64).to_le_bytes());
        token[8..12].copy_from_slice(&std::process::id().to_le_bytes());
    }
    token
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// Listeners opened by `HcclGetRootInfo`, waiting for rank 0 to init.
fn pending_roots() -> &'static Mutex<HashMap<[u8; 16], TcpListener>> {
    static ROOTS: OnceLock<Mutex<HashMap<[u8; 16], TcpListener>>> = OnceLock::new();
    ROOTS.get_or_init(Default::default)
}

/// Live communicators by handle.
fn comms() -> &'static Mutex<HashMap<usize, Arc<Comm>>> {
    static COMMS: OnceLock<Mutex<HashMap<usize, Arc<Comm>>>> = OnceLock::new();
    COMMS.get_or_init(Default::default)
}

/// Fills a root info: magic, loopback port, token, root pid.
pub(crate) fn get_root_info(out: &mut [u8; ROOT_INFO_BYTES]) -> Result<(), Failure> {
    drop(
        runtime()
            .initialized()
            .map_err(|f| Failure::hccl(HCCL_E_RUNTIME, f.message))?,
    );
    current_device().map_err(|f| Failure::hccl(HCCL_E_RUNTIME, f.message))?;
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).map_err(|e| {
        Failure::hccl(
            HCCL_E_TCP_CONNECT,
            format!("cannot listen on loopback: {e}"),
        )
    })?;
    let port = listener
        .local_addr()
        .map_err(|e| Failure::hccl(HCCL_E_SYSCALL, e.to_string()))?
        .port();
    let token = random_token();
    out.fill(0);
    out[..8].copy_from_slice(ROOT_MAGIC);
    out[8..10].copy_from_slice(&port.to_le_bytes());
    out[10..26].copy_from_slice(&token);
    out[26..30].copy_from_slice(&std::process::id().to_le_bytes());
    lock(pending_roots()).insert(token, listener);
    Ok(())
}

struct RootInfo {
    port: u16,
    token: [u8; 16],
    root_pid: u32,
}

fn parse_root_info(b: &[u8; ROOT_INFO_BYTES]) -> Result<RootInfo, Failure> {
    if &b[..8] != ROOT_MAGIC {
        return Err(Failure::hccl(
            HCCL_E_PARA,
            "root info was not produced by HcclGetRootInfo of this emulator",
        ));
    }
    Ok(RootInfo {
        port: u16::from_le_bytes([b[8], b[9]]),
        token: b[10..26].try_into().expect("16 bytes"),
        root_pid: u32_at(b, 26),
    })
}

/// One region this process registered with a communicator.
struct Registration {
    id: u64,
    addr: usize,
    size: usize,
    region: Arc<Region>,
}

/// A peer region mapped into this process (unmapped when the last Arc,
/// the communicator's or a queued copy's, goes).
struct RemoteMapping {
    reg_id: u64,
    remote_addr: usize,
    size: usize,
    mapping: PeerMapping,
}

impl RemoteMapping {
    fn local_addr(&self, remote: usize) -> usize {
        self.mapping.base() + (remote - self.remote_addr)
    }
}

/// Decoded contents of an emulator memory descriptor.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Desc {
    owner_rank: u32,
    peer_rank: u32,
    token: [u8; 16],
    pid: u32,
    fd: i32,
    region_id: u64,
    offset: u64,
    size: u64,
    addr: u64,
    mem_type: u32,
    reg_id: u64,
}

impl Desc {
    // Bytes 0..8 hold the owner's and the peer's rank, where real HCCL keeps
    // its own rank ids too; the rest is the emulator's.
    fn encode(&self) -> [u8; MEM_DESC_BYTES] {
        let mut b = [0u8; MEM_DESC_BYTES];
        b[0..4].copy_from_slice(&self.owner_rank.to_le_bytes());
        b[4..8].copy_from_slice(&self.peer_rank.to_le_bytes());
        b[8..16].copy_from_slice(DESC_MAGIC);
        b[16..32].copy_from_slice(&self.token);
        b[32..36].copy_from_slice(&self.pid.to_le_bytes());
        b[36..40].copy_from_slice(&self.fd.to_le_bytes());
        b[40..48].copy_from_slice(&self.region_id.to_le_bytes());
        b[48..56].copy_from_slice(&self.offset.to_le_bytes());
        b[56..64].copy_from_slice(&self.size.to_le_bytes());
        b[64..72].copy_from_slice(&self.addr.to_le_bytes());
        b[72..76].copy_from_slice(&self.mem_type.to_le_bytes());
        b[76..84].copy_from_slice(&self.reg_id.to_le_bytes());
        b
    }

    fn decode(b: &[u8; MEM_DESC_BYTES]) -> Result<Desc, Failure> {
        if &b[8..16] != DESC_MAGIC {
            return Err(Failure::hccl(
                HCCL_E_PARA,
                "not a memory descriptor produced by HcclRegisterMem of this emulator",
            ));
        }
        Ok(Desc {
            owner_rank: u32_at(b, 0),
            peer_rank: u32_at(b, 4),
            token: b[16..32].try_into().expect("16 bytes"),
            pid: u32_at(b, 32),
            fd: u32_at(b, 36) as i32,
            region_id: u64_at(b, 40),
            offset: u64_at(b, 48),
            size: u64_at(b, 56),
            addr: u64_at(b, 64),
            mem_type: u32_at(b, 72),
            reg_id: u64_at(b, 76),
        })
    }
}

#[derive(Default)]
struct CommState {
    next_reg: u64,
    /// This process's registrations, by start address.
    registrations: BTreeMap<usize, Registration>,
    /// Set once descriptors have been exchanged; real HCCL builds the
    /// one-sided connection there, and enabling access needs it.
    connected: bool,
    /// Peer regions mapped here, by the peer's start address.
    enabled: BTreeMap<usize, Arc<RemoteMapping>>,
}

/// A two-rank communicator.
pub(crate) struct Comm {
    rank: u32,
    peer_rank: u32,
    device: i32,
    token: [u8; 16],
    peer_pid: u32,
    control: Mutex<TcpStream>,
    state: Mutex<CommState>,
}

fn comm(handle: usize) -> Result<Arc<Comm>, Failure> {
    if handle == 0 {
        return Err(Failure::hccl(HCCL_E_PTR, "communicator is NULL"));
    }
    lock(comms()).get(&handle).cloned().ok_or_else(|| {
        Failure::hccl(
            HCCL_E_PARA,
            format!("{handle:#x} is not a live communicator"),
        )
    })
}

fn hello(token: &[u8; 16], rank: u32) -> [u8; 32] {
    let mut b = [0u8; 32];
    b[..8].copy_from_slice(HELLO_MAGIC);
    b[8..24].copy_from_slice(token);
    b[24..28].copy_from_slice(&std::process::id().to_le_bytes());
    b[28..32].copy_from_slice(&rank.to_le_bytes());
    b
}

/// Rank 0: waits for rank 1 on the listener opened by HcclGetRootInfo.
fn accept_peer(root: &RootInfo, deadline: Instant) -> Result<(TcpStream, u32), Failure> {
    let listener = lock(pending_roots()).remove(&root.token).ok_or_else(|| {
        Failure::hccl(
            HCCL_E_PARA,
            "rank 0 must run in the process that called HcclGetRootInfo for this root info \
             (and only once per root info)",
        )
    })?;
    listener
        .set_nonblocking(true)
        .map_err(|e| io_failure("listener", &e))?;
    loop {
        match listener.accept() {
            Ok((mut s, _)) => {
                s.set_nonblocking(false)
                    .map_err(|e| io_failure("accept", &e))?;
                let left = deadline.saturating_duration_since(Instant::now());
                s.set_read_timeout(Some(left.max(Duration::from_millis(100))))
                    .map_err(|e| io_failure("accept", &e))?;
                let mut h = [0u8; 32];
                // A stray or broken connection is dropped; keep waiting.
                if s.read_exact(&mut h).is_err()
                    || &h[..8] != HELLO_MAGIC
                    || h[8..24] != root.token
                    || u32_at(&h, 28) != 1
                {
                    continue;
                }
                let peer_pid = u32_at(&h, 24);
                s.write_all(&hello(&root.token, 0))
                    .map_err(|e| io_failure("handshake with rank 1", &e))?;
                return Ok((s, peer_pid));
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    return Err(Failure::hccl(
                        HCCL_E_TIMEOUT,
                        "rank 1 did not connect before HCCL_CONNECT_TIMEOUT",
                    ));
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => return Err(io_failure("accept", &e)),
        }
    }
}

/// Rank 1: connects to rank 0's loopback port named in the root info.
fn connect_root(root: &RootInfo, deadline: Instant) -> Result<(TcpStream, u32), Failure> {
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, root.port));
    let mut s = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match TcpStream::connect_timeout(&addr, left.max(Duration::from_millis(100))) {
            Ok(s) => break s,
            Err(e) if Instant::now() >= deadline => {
                return Err(Failure::hccl(
                    HCCL_E_TCP_CONNECT,
                    format!("cannot reach rank 0 at {addr}: {e}"),
                ))
            }
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    };
    let left = deadline.saturating_duration_since(Instant::now());
    s.set_read_timeout(Some(left.max(Duration::from_millis(100))))
        .map_err(|e| io_failure("connect", &e))?;
    s.write_all(&hello(&root.token, 1))
        .map_err(|e| io_failure("handshake with rank 0", &e))?;
    let mut h = [0u8; 32];
    s.read_exact(&mut h)
        .map_err(|e| io_failure("handshake with rank 0", &e))?;
    if &h[..8] != HELLO_MAGIC || h[8..24] != root.token || u32_at(&h, 24) != root.root_pid {
        return Err(Failure::hccl(
            HCCL_E_TCP_CONNECT,
            format!("{addr} answered, but not as rank 0 of this root info"),
        ));
    }
    Ok((s, root.root_pid))
}

pub(crate) fn comm_init_root_info(
    n_ranks: u32,
    root: &[u8; ROOT_INFO_BYTES],
    rank: u32,
) -> Result<usize, Failure> {
    drop(
        runtime()
            .initialized()
            .map_err(|f| Failure::hccl(HCCL_E_RUNTIME, f.message))?,
    );
    let device = current_device().map_err(|f| Failure::hccl(HCCL_E_RUNTIME, f.message))?;
    if n_ranks != 2 {
        return Err(Failure::hccl(
            HCCL_E_NOT_SUPPORT,
            format!("the emulator supports 2-rank communicators only, not {n_ranks}"),
        ));
    }
    if rank >= n_ranks {
        return Err(Failure::hccl(
            HCCL_E_PARA,
            format!("rank {rank} out of range for {n_ranks} ranks"),
        ));
    }
    let root = parse_root_info(root)?;
    let timeout = link_timeout();
    let deadline = Instant::now() + timeout;
    let (stream, peer_pid) = if rank == 0 {
        accept_peer(&root, deadline)?
    } else {
        connect_root(&root, deadline)?
    };
    stream
        .set_read_timeout(Some(timeout))
        .and_then(|()| stream.set_write_timeout(Some(timeout)))
        .and_then(|()| stream.set_nodelay(true))
        .map_err(|e| io_failure("socket setup", &e))?;
    let comm = Arc::new(Comm {
        rank,
        peer_rank: 1 - rank,
        device,
        token: root.token,
        peer_pid,
        control: Mutex::new(stream),
        state: Mutex::new(CommState::default()),
    });
    let handle = runtime().new_handle();
    lock(comms()).insert(handle, comm);
    Ok(handle)
}

pub(crate) fn comm_destroy(handle: usize) -> Result<(), Failure> {
    comm(handle)?;
    lock(comms()).remove(&handle);
    Ok(())
}

impl Comm {
    fn check_peer(&self, remote_rank: u32) -> Result<(), Failure> {
        if remote_rank != self.peer_rank {
            return Err(Failure::hccl(
                HCCL_E_PARA,
                format!(
                    "remote rank {remote_rank} is not the peer of rank {} (the peer is {})",
                    self.rank, self.peer_rank
                ),
            ));
        }
        Ok(())
    }

    /// Decodes a descriptor this process registered on this communicator.
    fn own_desc(&self, bytes: &[u8; MEM_DESC_BYTES]) -> Result<Desc, Failure> {
        let d = Desc::decode(bytes)?;
        if d.token != self.token || d.pid != std::process::id() || d.owner_rank != self.rank {
            return Err(Failure::hccl(
                HCCL_E_PARA,
                "descriptor was not registered by this rank on this communicator",
            ));
        }
        Ok(d)
    }

    /// Decodes a descriptor the peer registered on this communicator.
    fn peer_desc(&self, bytes: &[u8; MEM_DESC_BYTES]) -> Result<Desc, Failure> {
        let d = Desc::decode(bytes)?;
        if d.token != self.token || d.pid != self.peer_pid || d.owner_rank != self.peer_rank {
            return Err(Failure::hccl(
                HCCL_E_PARA,
                format!(
                    "descriptor was not registered by rank {} of this communicator",
                    self.peer_rank
                ),
            ));
        }
        Ok(d)
    }
}

pub(crate) fn register_mem(
    handle: usize,
    remote_rank: u32,
    mem_type: i32,
    addr: usize,
    size: u64,
) -> Result<[u8; MEM_DESC_BYTES], Failure> {
    let c = comm(handle)?;
    c.check_peer(remote_rank)?;
    let para = |m: String| Failure::hccl(HCCL_E_PARA, m);
    let mem_type = match u32::try_from(mem_type) {
        Ok(t @ (MEM_TYPE_DEVICE | MEM_TYPE_HOST)) => t,
        _ => return Err(para(format!("unknown memory type {mem_type}"))),
    };
    let size = usize::try_from(size).map_err(|_| para("size does not fit".into()))?;
    if addr == 0 || size == 0 {
        return Err(para("address is NULL or size is 0".into()));
    }
    let region = match runtime().lock().regions.lookup(addr, size) {
        Lookup::Inside(r) => r,
        Lookup::Overruns(r) => {
            return Err(para(format!(
                "[{addr:#x}, +{size}) runs past the end of {}",
                r.describe()
            )))
        }
        Lookup::Unknown => {
            return Err(para(format!(
                "[{addr:#x}, +{size}) is not memory from aclrtMalloc/aclrtMallocHost; \
                 the emulator can only share memory it allocated"
            )))
        }
    };
    match (mem_type, region.placement) {
        (MEM_TYPE_DEVICE, Placement::Device(d)) if d == c.device => {}
        (MEM_TYPE_DEVICE, Placement::Device(d)) => {
            return Err(para(format!(
                "memory belongs to device {d}, the communicator to device {}",
                c.device
            )))
        }
        (MEM_TYPE_HOST, Placement::Host) => {}
        _ => {
            return Err(para(format!(
                "memory type {} does not match {}",
                if mem_type == MEM_TYPE_DEVICE {
                    "DEVICE"
                } else {
                    "HOST"
                },
                region.describe()
            )))
        }
    }
    let mut st = lock(&c.state);
    if st.registrations.len() >= crate::runtime::REGISTRATION_LIMIT {
        return Err(Failure::hccl(
            HCCL_E_UNAVAIL,
            format!(
                "this communicator already has {} registrations, the most it accepts",
                st.registrations.len()
            ),
        ));
    }
    let end = addr + size;
    let overlaps = st
        .registrations
        .range(..end)
        .next_back()
        .is_some_and(|(_, r)| r.addr + r.size > addr);
    if overlaps {
        return Err(para(format!(
            "[{addr:#x}, +{size}) overlaps memory already registered on this communicator"
        )));
    }
    st.next_reg += 1;
    let id = st.next_reg;
    let desc = Desc {
        owner_rank: c.rank,
        peer_rank: c.peer_rank,
        token: c.token,
        pid: std::process::id(),
        fd: region.raw_fd(),
        region_id: region.id,
        offset: (addr - region.base) as u64,
        size: size as u64,
        addr: addr as u64,
        mem_type,
        reg_id: id,
    };
    st.registrations.insert(
        addr,
        Registration {
            id,
            addr,
            size,
            region,
        },
    );
    Ok(desc.encode())
}

pub(crate) fn deregister_mem(handle: usize, desc: &[u8; MEM_DESC_BYTES]) -> Result<(), Failure> {
    let c = comm(handle)?;
    let d = c.own_desc(desc)?;
    let mut st = lock(&c.state);
    match st.registrations.get(&(d.addr as usize)) {
        Some(r) if r.id == d.reg_id => {
            st.registrations.remove(&(d.addr as usize));
            Ok(())
        }
        _ => Err(Failure::hccl(
            HCCL_E_NOT_FOUND,
            "memory is not registered (already deregistered?)",
        )),
    }
}

fn send_descs(s: &mut TcpStream, descs: &[[u8; MEM_DESC_BYTES]]) -> io::Result<()> {
    let mut msg = Vec::with_capacity(8 + descs.len() * MEM_DESC_BYTES);
    msg.extend_from_slice(XCHG_MAGIC);
    msg.extend_from_slice(&(descs.len() as u32).to_le_bytes());
    for d in descs {
        msg.extend_from_slice(d);
    }
    s.write_all(&msg)
}

fn recv_descs(s: &mut TcpStream) -> io::Result<Vec<[u8; MEM_DESC_BYTES]>> {
    let mut head = [0u8; 8];
    s.read_exact(&mut head)?;
    let n = u32_at(&head, 4);
    if &head[..4] != XCHG_MAGIC || n > MAX_EXCHANGE {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "peer sent a malformed descriptor exchange",
        ));
    }
    let mut out = vec![[0u8; MEM_DESC_BYTES]; n as usize];
    for d in &mut out {
        s.read_exact(d)?;
    }
    Ok(out)
}

/// Sends this rank's descriptors and receives the peer's. Rank 0 sends
/// first, rank 1 receives first, so large exchanges cannot deadlock.
pub(crate) fn exchange_mem_desc(
    handle: usize,
    remote_rank: u32,
    local: &[[u8; MEM_DESC_BYTES]],
    remote_capacity: usize,
) -> Result<Vec<[u8; MEM_DESC_BYTES]>, Failure> {
    let c = comm(handle)?;
    c.check_peer(remote_rank)?;
    {
        let st = lock(&c.state);
        for bytes in local {
            let d = c.own_desc(bytes)?;
            if st
                .registrations
                .get(&(d.addr as usize))
                .is_none_or(|r| r.id != d.reg_id)
            {
                return Err(Failure::hccl(
                    HCCL_E_PARA,
                    "a local descriptor names memory that is no longer registered",
                ));
            }
        }
    }
    let received = {
        let mut s = lock(&c.control);
        let what = format!("descriptor exchange with rank {}", c.peer_rank);
        if c.rank == 0 {
            send_descs(&mut s, local).map_err(|e| io_failure(&what, &e))?;
            recv_descs(&mut s).map_err(|e| io_failure(&what, &e))?
        } else {
            let r = recv_descs(&mut s).map_err(|e| io_failure(&what, &e))?;
            send_descs(&mut s, local).map_err(|e| io_failure(&what, &e))?;
            r
        }
    };
    for bytes in &received {
        c.peer_desc(bytes)?;
    }
    lock(&c.state).connected = true;
    if received.len() > remote_capacity {
        return Err(Failure::hccl(
            HCCL_E_PARA,
            format!(
                "rank {} sent {} descriptors but the remote array holds {remote_capacity}",
                c.peer_rank,
                received.len()
            ),
        ));
    }
    Ok(received)
}

/// What `HcclEnableMemAccess` reports: type, the peer's address, size.
pub(crate) struct EnabledMem {
    pub mem_type: u32,
    pub addr: usize,
    pub size: u64,
}

pub(crate) fn enable_mem_access(
    handle: usize,
    desc: &[u8; MEM_DESC_BYTES],
) -> Result<EnabledMem, Failure> {
    let c = comm(handle)?;
    let d = c.peer_desc(desc)?;
    let report = EnabledMem {
        mem_type: d.mem_type,
        addr: d.addr as usize,
        size: d.size,
    };
    let mut st = lock(&c.state);
    if !st.connected {
        return Err(Failure::hccl(
            HCCL_E_NOT_FOUND,
            format!(
                "no one-sided connection to rank {}; exchange memory descriptors first",
                c.peer_rank
            ),
        ));
    }
    if let Some(m) = st.enabled.get(&(d.addr as usize)) {
        if m.reg_id == d.reg_id {
            return Ok(report);
        }
    }
    let gone = || {
        Failure::hccl(
            HCCL_E_NOT_FOUND,
            format!(
                "memory of rank {} is gone (freed, deregistered or the process exited)",
                c.peer_rank
            ),
        )
    };
    let mapping = PeerMapping::open(d.pid, d.fd, d.region_id, d.offset as usize, d.size as usize)
        .map_err(|e| match e {
        PeerMapError::Gone => gone(),
        PeerMapError::Os(m) => Failure::hccl(HCCL_E_SYSCALL, m),
    })?;
    st.enabled.insert(
        d.addr as usize,
        Arc::new(RemoteMapping {
            reg_id: d.reg_id,
            remote_addr: d.addr as usize,
            size: d.size as usize,
            mapping,
        }),
    );
    Ok(report)
}

pub(crate) fn disable_mem_access(
    handle: usize,
    desc: &[u8; MEM_DESC_BYTES],
) -> Result<(), Failure> {
    let c = comm(handle)?;
    let d = c.peer_desc(desc)?;
    let mut st = lock(&c.state);
    match st.enabled.get(&(d.addr as usize)) {
        Some(m) if m.reg_id == d.reg_id => {
            // Copies already queued keep their own Arc to the mapping.
            st.enabled.remove(&(d.addr as usize));
            Ok(())
        }
        _ => Err(Failure::hccl(
            HCCL_E_NOT_FOUND,
            "access to this memory is not enabled",
        )),
    }
}

/// Bytes per element of an `HcclDataType`.
fn element_size(data_type: u32) -> Option<usize> {
    Some(match data_type {
        0 | 7 | 14..=17 => 1, // INT8, UINT8, HIF8, FP8 (E4M3, E5M2, E8M0)
        1 | 3 | 8 | 11 => 2,  // INT16, FP16, UINT16, BFP16
        2 | 4 | 9 => 4,       // INT32, FP32, UINT32
        5 | 6 | 10 => 8,      // INT64, UINT64, FP64
        12 => 16,             // INT128
        _ => return None,
    })
}

/// One put/get as the C caller described it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct OneSidedOp {
    pub local: usize,
    pub remote: usize,
    pub count: u64,
    pub data_type: u32,
}

/// Validates every op, then queues all of them as one task on the stream:
/// either the whole batch is queued or none of it.
pub(crate) fn batch(
    handle: usize,
    remote_rank: u32,
    ops: &[OneSidedOp],
    stream: usize,
    put: bool,
) -> Result<(), Failure> {
    // A misspelt link is refused, first, rather than run at memory speed.
    let model = link::from_env().map_err(|e| Failure::hccl(HCCL_E_PARA, e.to_string()))?;
    let c = comm(handle)?;
    c.check_peer(remote_rank)?;
    let stream = runtime()
        .initialized()
        .and_then(|mut st| st.stream(stream))
        .map_err(|f| Failure::hccl(HCCL_E_PARA, f.message))?;
    if stream.device != c.device {
        return Err(Failure::hccl(
            HCCL_E_PARA,
            format!(
                "stream belongs to device {}, the communicator to device {}",
                stream.device, c.device
            ),
        ));
    }
    let st = lock(&c.state);
    let mut copies = Vec::with_capacity(ops.len());
    let mut keep: Vec<Arc<dyn Any + Send + Sync>> = Vec::new();
    let mut kept_regions: Vec<u64> = Vec::new();
    let mut kept_maps: Vec<usize> = Vec::new();
    for (i, op) in ops.iter().enumerate() {
        let para = |m: String| Failure::hccl(HCCL_E_PARA, format!("op {i}: {m}"));
        let elem = element_size(op.data_type)
            .ok_or_else(|| para(format!("unknown data type {}", op.data_type)))?;
        let len = usize::try_from(op.count)
            .ok()
            .and_then(|n| n.checked_mul(elem))
            .ok_or_else(|| para("count overflows".into()))?;
        if op.local == 0 || op.remote == 0 {
            return Err(para("address is NULL".into()));
        }
        let local_end = op
            .local
            .checked_add(len)
            .ok_or_else(|| para("range overflows".into()))?;
        let reg = st
            .registrations
            .range(..=op.local)
            .next_back()
            .map(|(_, r)| r)
            .filter(|r| local_end <= r.addr + r.size)
            .ok_or_else(|| {
                para(format!(
                    "local range [{:#x}, +{len}) is not inside memory registered on this communicator",
                    op.local
                ))
            })?;
        let remote_end = op
            .remote
            .checked_add(len)
            .ok_or_else(|| para("range overflows".into()))?;
        let map = st
            .enabled
            .range(..=op.remote)
            .next_back()
            .map(|(_, m)| m)
            .filter(|m| remote_end <= m.remote_addr + m.size)
            .ok_or_else(|| {
                para(format!(
                    "remote range [{:#x}, +{len}) is outside every region of rank {} enabled for access",
                    op.remote, c.peer_rank
                ))
            })?;
        let there = map.local_addr(op.remote);
        copies.push(if put {
            Copy {
                dst: there,
                src: op.local,
                len,
            }
        } else {
            Copy {
                dst: op.local,
                src: there,
                len,
            }
        });
        if !kept_regions.contains(&reg.id) {
            kept_regions.push(reg.id);
            keep.push(reg.region.clone());
        }
        if !kept_maps.contains(&map.remote_addr) {
            kept_maps.push(map.remote_addr);
            keep.push(map.clone());
        }
    }
    drop(st);
    if copies.is_empty() {
        return Ok(());
    }
    let dir = if put {
        Direction::Write
    } else {
        Direction::Read
    };
    let sizes: Vec<u64> = copies.iter().map(|c| c.len as u64).collect();
    let pace = match model {
        Some(l) => {
            let secs = sizes
                .iter()
                .map(|&n| l.op_seconds(LinkPath::Comm, dir, n).unwrap_or(0.0))
                .sum::<f64>();
            Duration::from_secs_f64(secs)
        }
        None => Duration::ZERO,
    };
    stream
        .submit(Task::Copies {
            copies,
            keep,
            pace,
            fault: None,
        })
        .map_err(|f| Failure::hccl(HCCL_E_RUNTIME, f.message))?;
    // Accounted once queued, in the order batches were accepted; every
    // batch is submitted at modeled time 0 (see `link`), so they queue.
    if let Some(l) = model {
        lock(link::process_clock()).submit(l, LinkPath::Comm, dir, 0.0, sizes);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptor_round_trips_and_rejects_foreign_bytes() {
        let d = Desc {
            owner_rank: 1,
            peer_rank: 0,
            token: [7; 16],
            pid: 42,
            fd: 9,
            region_id: 0x1230,
            offset: 4096,
            size: 1 << 20,
            addr: 0x7f00_0000_1000,
            mem_type: MEM_TYPE_HOST,
            reg_id: 3,
        };
        let bytes = d.encode();
        assert_eq!(u32_at(&bytes, 0), 1, "owner rank sits where HCCL keeps it");
        assert_eq!(Desc::decode(&bytes).unwrap(), d);
        let err = Desc::decode(&[0u8; MEM_DESC_BYTES]).unwrap_err();
        assert_eq!(err.code, i64::from(HCCL_E_PARA));
    }

    #[test]
    fn element_sizes_follow_hccl_data_types() {
        assert_eq!(element_size(7), Some(1));
        assert_eq!(element_size(11), Some(2));
        assert_eq!(element_size(4), Some(4));
        assert_eq!(element_size(10), Some(8));
        assert_eq!(element_size(12), Some(16));
        assert_eq!(element_size(13), None);
    }
}
