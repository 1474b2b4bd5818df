//! The emulated HIXL client/server API (`HixlCS*`, `libcann_hixl.so`).
//!
//! A server really listens on TCP at its `server_ip:server_port` once
//! `HixlCSServerListen` is called (port 0: an ephemeral port, reported by
//! the emulator-only `ascend_emu_hixl_server_port`). A client connects
//! there, checks that the server offers the endpoint the client names as
//! remote, and with `HixlCSClientGetRemoteMem` asks the server for its
//! registered regions: the server's pid, memfd number, region id and
//! offset of each, which the client maps through `/proc/<pid>/fd/<fd>`
//! (only memory from `aclrtMalloc` / `aclrtMallocHost` is registrable).
//! Batches are checked whole against the client's registered memory and
//! the mapped regions before anything moves, then copied in order on the
//! client's worker thread; with a link model (`ASCEND_PD_EMU_LINK`) every
//! op is accounted on the process's link clock on the `hixl` path and a
//! batch takes at least its modeled time. A query answers completed once
//! the copies ran.
//!
//! Wire protocol (loopback or any IPv4 TCP, little-endian):
//! - client → server: `HELLO_MAGIC`, client pid (u32), wanted endpoint
//!   ([`EndpointKey`], 20 bytes);
//! - server → client: `HELLO_MAGIC`, server pid (u32), 1 if it offers
//!   that endpoint else 0 (u32);
//! - then any number of: client sends `MEMS_REQUEST`; server answers
//!   `MEMS_REPLY`, a count (u32) and per region: addr (u64), size (u64),
//!   type (u32), fd (i32), region id (u64), offset (u64), tag length (u32),
//!   tag bytes.

use std::any::Any;
use std::collections::{BTreeMap, HashMap};
use std::ffi::{c_char, CString};
use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, Shutdown, SocketAddrV4, TcpListener, TcpStream};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::thread::JoinHandle;
use std::time::Duration;

use ascend_sys::sys;

use crate::link::{self, Direction, Path as LinkPath};
use crate::memory::{peer_region_alive, Lookup, PeerMapError, PeerMapping, Placement, Region};
use crate::runtime::runtime;
use crate::status::*;
use crate::stream::{Copy, Event, Stream, Task};

/// Transfers not yet queried completed that HIXL allows on a client whose
/// local endpoint is on the host (one completion flag each); a client on a
/// device has no such limit, and no limit counts ops.
pub(crate) const HOST_CLIENT_TRANSFER_LIMIT: usize = 4096;

/// Tag of the host region every emulated server registers for itself, as
/// a real HIXL server registers its completion flags under tags starting
/// `_hixl_builtin_` (which clients then see among the server's regions).
pub(crate) const BUILTIN_TAG: &str = "_hixl_builtin_emu_flag";
/// Bytes of that region.
const BUILTIN_LEN: usize = 64;

const HELLO_MAGIC: &[u8; 8] = b"ASEMUHX1";
const MEMS_REQUEST: &[u8; 4] = b"MEMS";
const MEMS_REPLY: &[u8; 4] = b"MEML";
/// Most regions a reply may carry (a sanity bound on what is read).
const MAX_REGIONS: u32 = 1 << 16;
/// Longest tag accepted.
const MAX_TAG: usize = 4096;

pub(crate) const MEM_TYPE_DEVICE: i32 = sys::COMM_MEM_TYPE_DEVICE;
pub(crate) const MEM_TYPE_HOST: i32 = sys::COMM_MEM_TYPE_HOST;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn para(m: impl Into<String>) -> Failure {
    Failure::hixl(HIXL_PARAM_INVALID, m)
}

fn failed(m: impl Into<String>) -> Failure {
    Failure::hixl(HIXL_FAILED, m)
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

// ------------------------------------------------------------ endpoints

/// What identifies an endpoint for matching: protocol, address and
/// location (the fields ascend-pd fills; the rest are ignored).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct EndpointKey {
    pub protocol: i32,
    pub addr_type: i32,
    /// IPv4 address (network order) or id, by `addr_type`; else 0.
    pub addr: u32,
    pub loc_type: i32,
    /// Device physical id for a device location, host id for a host one.
    pub loc_id: u32,
}

impl EndpointKey {
    pub(crate) fn from_raw(d: &sys::EndpointDesc) -> EndpointKey {
        let addr = match d.commAddr.type_ {
            // SAFETY: every member of the address union is plain bytes or
            // integers, so any of them may be read.
            sys::COMM_ADDR_TYPE_IP_V4 => unsafe { d.commAddr.__bindgen_anon_1.addr },
            // SAFETY: as above.
            sys::COMM_ADDR_TYPE_ID => unsafe { d.commAddr.__bindgen_anon_1.id },
            _ => 0,
        };
        let loc_id = match d.loc.locType {
            // SAFETY: the location union holds plain integers only.
            sys::ENDPOINT_LOC_TYPE_DEVICE => unsafe { d.loc.__bindgen_anon_1.device.devPhyId },
            // SAFETY: as above.
            sys::ENDPOINT_LOC_TYPE_HOST => unsafe { d.loc.__bindgen_anon_1.host.id },
            _ => 0,
        };
        EndpointKey {
            protocol: d.protocol,
            addr_type: d.commAddr.type_,
            addr,
            loc_type: d.loc.locType,
            loc_id,
        }
    }

    fn encode(&self) -> [u8; 20] {
        let mut b = [0u8; 20];
        b[0..4].copy_from_slice(&self.protocol.to_le_bytes());
        b[4..8].copy_from_slice(&self.addr_type.to_le_bytes());
        b[8..12].copy_from_slice(&self.addr.to_le_bytes());
        b[12..16].copy_from_slice(&self.loc_type.to_le_bytes());
        b[16..20].copy_from_slice(&self.loc_id.to_le_bytes());
        b
    }

    fn decode(b: &[u8; 20]) -> EndpointKey {
        EndpointKey {
            protocol: u32_at(b, 0) as i32,
            addr_type: u32_at(b, 4) as i32,
            addr: u32_at(b, 8),
            loc_type: u32_at(b, 12) as i32,
            loc_id: u32_at(b, 16),
        }
    }

    fn describe(&self) -> String {
        let proto = match self.protocol {
            sys::COMM_PROTOCOL_HCCS => "HCCS".to_string(),
            sys::COMM_PROTOCOL_ROCE => "RoCE".to_string(),
            p => format!("protocol {p}"),
        };
        let addr = match self.addr_type {
            sys::COMM_ADDR_TYPE_IP_V4 => format!(" {}", Ipv4Addr::from(self.addr.to_ne_bytes())),
            sys::COMM_ADDR_TYPE_ID => format!(" id {}", self.addr),
            _ => String::new(),
        };
        let loc = match self.loc_type {
            sys::ENDPOINT_LOC_TYPE_DEVICE => format!(" on device {}", self.loc_id),
            sys::ENDPOINT_LOC_TYPE_HOST => format!(" on host {}", self.loc_id),
            _ => String::new(),
        };
        format!("{proto}{addr}{loc}")
    }
}

/// Whether an endpoint a server offers is the one a client asks for, by
/// HIXL v9.1.0's rules: the protocols agree, then HCCS compares the ID
/// address (the physical device id) only; RoCE compares the address type
/// and the IPv4 address only (the location is not compared; the emulator
/// carries no IPv6 address, so IPv6 never matches); any other protocol
/// matches on the protocol alone (the emulator carries no UB EIDs). Real
/// HIXL never matches a RoCE endpoint whose address type is neither IPv4
/// nor IPv6; the emulator alone matches two such endpoints by device
/// location, standing in for an address ascend-sys asks for outside the
/// emulator.
pub(crate) fn endpoint_matches(offered: &EndpointKey, wanted: &EndpointKey) -> bool {
    if offered.protocol != wanted.protocol {
        return false;
    }
    match offered.protocol {
        sys::COMM_PROTOCOL_HCCS => offered.addr == wanted.addr,
        sys::COMM_PROTOCOL_ROCE => {
            offered.addr_type == wanted.addr_type
                && match offered.addr_type {
                    sys::COMM_ADDR_TYPE_IP_V4 => offered.addr == wanted.addr,
                    sys::COMM_ADDR_TYPE_IP_V6 => false,
                    // Emulator only (see above).
                    _ => offered.loc_type == wanted.loc_type && offered.loc_id == wanted.loc_id,
                }
        }
        _ => true,
    }
}

// ------------------------------------------------------------ wire format

/// The client's first message: its pid and the endpoint it wants.
fn encode_hello(pid: u32, wanted: &EndpointKey) -> [u8; 32] {
    let mut b = [0u8; 32];
    b[..8].copy_from_slice(HELLO_MAGIC);
    b[8..12].copy_from_slice(&pid.to_le_bytes());
    b[12..32].copy_from_slice(&wanted.encode());
    b
}

fn decode_hello(b: &[u8; 32]) -> Option<(u32, EndpointKey)> {
    (&b[..8] == HELLO_MAGIC).then(|| {
        let key = EndpointKey::decode(b[12..32].try_into().expect("20 bytes"));
        (u32_at(b, 8), key)
    })
}

/// The server's answer: its pid and whether it offers that endpoint.
fn encode_welcome(pid: u32, offered: bool) -> [u8; 16] {
    let mut b = [0u8; 16];
    b[..8].copy_from_slice(HELLO_MAGIC);
    b[8..12].copy_from_slice(&pid.to_le_bytes());
    b[12..16].copy_from_slice(&u32::from(offered).to_le_bytes());
    b
}

fn decode_welcome(b: &[u8; 16]) -> Option<(u32, bool)> {
    (&b[..8] == HELLO_MAGIC).then(|| (u32_at(b, 8), u32_at(b, 12) == 1))
}

/// One region as the server describes it to a client.
#[derive(Debug, Clone, PartialEq, Eq)]
struct RegionDesc {
    addr: u64,
    size: u64,
    mem_type: i32,
    fd: i32,
    region_id: u64,
    offset: u64,
    tag: String,
}

/// The server's answer to `MEMS_REQUEST` (tags cut at `MAX_TAG` bytes).
fn encode_regions(regions: &[RegionDesc]) -> Vec<u8> {
    let mut m = Vec::with_capacity(8 + regions.len() * 64);
    m.extend_from_slice(MEMS_REPLY);
    m.extend_from_slice(&(regions.len() as u32).to_le_bytes());
    for r in regions {
        m.extend_from_slice(&r.addr.to_le_bytes());
        m.extend_from_slice(&r.size.to_le_bytes());
        m.extend_from_slice(&r.mem_type.to_le_bytes());
        m.extend_from_slice(&r.fd.to_le_bytes());
        m.extend_from_slice(&r.region_id.to_le_bytes());
        m.extend_from_slice(&r.offset.to_le_bytes());
        let tag = &r.tag.as_bytes()[..r.tag.len().min(MAX_TAG)];
        m.extend_from_slice(&(tag.len() as u32).to_le_bytes());
        m.extend_from_slice(tag);
    }
    m
}

/// Reads one `encode_regions` message; refuses anything malformed.
fn read_regions(s: &mut impl Read) -> io::Result<Vec<RegionDesc>> {
    let bad = |m: &str| io::Error::new(io::ErrorKind::InvalidData, m.to_string());
    let mut head = [0u8; 8];
    s.read_exact(&mut head)?;
    let n = u32_at(&head, 4);
    if &head[..4] != MEMS_REPLY || n > MAX_REGIONS {
        return Err(bad("malformed region list"));
    }
    let mut out = Vec::with_capacity(n as usize);
    for _ in 0..n {
        let mut b = [0u8; 44];
        s.read_exact(&mut b)?;
        let tag_len = u32_at(&b, 40) as usize;
        if tag_len > MAX_TAG {
            return Err(bad("tag too long"));
        }
        let mut tag = vec![0u8; tag_len];
        s.read_exact(&mut tag)?;
        out.push(RegionDesc {
            addr: u64_at(&b, 0),
            size: u64_at(&b, 8),
            mem_type: u32_at(&b, 16) as i32,
            fd: u32_at(&b, 20) as i32,
            region_id: u64_at(&b, 24),
            offset: u64_at(&b, 32),
            tag: String::from_utf8_lossy(&tag).into_owned(),
        });
    }
    Ok(out)
}

// ------------------------------------------------------------ memory

/// One registered range of this process.
struct Registration {
    handle: usize,
    tag: String,
    addr: usize,
    size: usize,
    mem_type: i32,
    region: Arc<Region>,
}

/// Checks that `[addr, addr+size)` of type `mem_type` may be registered:
/// emulator-allocated memory of the matching kind.
fn registrable(mem_type: i32, addr: usize, size: u64) -> Result<Arc<Region>, Failure> {
    if mem_type != MEM_TYPE_DEVICE && mem_type != MEM_TYPE_HOST {
        return Err(para(format!(
            "memory type {mem_type} is neither COMM_MEM_TYPE_DEVICE (0) nor COMM_MEM_TYPE_HOST (1)"
        )));
    }
    let size = usize::try_from(size).map_err(|_| para("size does not fit"))?;
    if addr == 0 || size == 0 {
        return Err(para("address is NULL or size is 0"));
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
                "[{addr:#x}, +{size}) is not memory from aclrtMalloc/aclrtMallocHost; the \
                 emulator can only share memory it allocated (register such memory instead)"
            )))
        }
    };
    match (mem_type, region.placement) {
        (MEM_TYPE_DEVICE, Placement::Device(_)) | (MEM_TYPE_HOST, Placement::Host) => Ok(region),
        _ => Err(para(format!(
            "memory type {} does not match {}",
            if mem_type == MEM_TYPE_DEVICE {
                "DEVICE"
            } else {
                "HOST"
            },
            region.describe()
        ))),
    }
}

fn insert_registration(
    regs: &mut BTreeMap<usize, Registration>,
    tag: String,
    mem_type: i32,
    addr: usize,
    size: u64,
    region: Arc<Region>,
) -> Result<usize, Failure> {
    let size = size as usize;
    let end = addr + size;
    let overlaps = regs
        .range(..end)
        .next_back()
        .is_some_and(|(_, r)| r.addr + r.size > addr);
    if overlaps {
        return Err(para(format!(
            "[{addr:#x}, +{size}) overlaps memory already registered here"
        )));
    }
    let handle = runtime().new_handle();
    regs.insert(
        addr,
        Registration {
            handle,
            tag,
            addr,
            size,
            mem_type,
            region,
        },
    );
    Ok(handle)
}

fn remove_registration(
    regs: &mut BTreeMap<usize, Registration>,
    handle: usize,
) -> Result<(), Failure> {
    let addr = regs
        .values()
        .find(|r| r.handle == handle)
        .map(|r| r.addr)
        .ok_or_else(|| {
            para(format!(
                "{handle:#x} is not a live registration here (already unregistered?)"
            ))
        })?;
    regs.remove(&addr);
    Ok(())
}

// ------------------------------------------------------------ server

#[derive(Default)]
struct ServerState {
    regs: BTreeMap<usize, Registration>,
    /// The bound port once listening.
    listening: Option<u16>,
    stopping: bool,
    /// Clones of the accepted connections, shut down on destroy.
    conns: Vec<TcpStream>,
}

/// An emulated HIXL server.
pub(crate) struct Server {
    /// The host allocation behind the server's own region (BUILTIN_TAG).
    builtin: usize,
    ip: Ipv4Addr,
    port: u16,
    endpoints: Vec<EndpointKey>,
    state: Mutex<ServerState>,
    listener: Mutex<Option<TcpListener>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

fn servers() -> &'static Mutex<HashMap<usize, Arc<Server>>> {
    static SERVERS: OnceLock<Mutex<HashMap<usize, Arc<Server>>>> = OnceLock::new();
    SERVERS.get_or_init(Default::default)
}

fn server(handle: usize) -> Result<Arc<Server>, Failure> {
    if handle == 0 {
        return Err(para("server handle is NULL"));
    }
    lock(servers())
        .get(&handle)
        .cloned()
        .ok_or_else(|| para(format!("{handle:#x} is not a live HIXL server")))
}

fn parse_ip(ip: &str) -> Result<Ipv4Addr, Failure> {
    ip.parse::<Ipv4Addr>().map_err(|_| {
        para(format!(
            "server ip {ip:?} is not an IPv4 address (the emulator speaks IPv4 only)"
        ))
    })
}

fn parse_port(port: u32) -> Result<u16, Failure> {
    u16::try_from(port).map_err(|_| para(format!("port {port} is out of range")))
}

fn require_init() -> Result<(), Failure> {
    drop(
        runtime()
            .initialized()
            .map_err(|f| para(format!("{} (HIXL needs the ACL runtime)", f.message)))?,
    );
    Ok(())
}

pub(crate) fn server_create(
    ip: &str,
    port: u32,
    endpoints: &[sys::EndpointDesc],
) -> Result<usize, Failure> {
    require_init()?;
    let ip = parse_ip(ip)?;
    let port = parse_port(port)?;
    if endpoints.is_empty() {
        return Err(para(
            "the server offers no endpoint (endpoint_list_num is 0)",
        ));
    }
    // Like HIXL, the server registers memory of its own, listed to
    // clients with the rest.
    let builtin = crate::runtime::malloc_host(BUILTIN_LEN)
        .map_err(|f| failed(format!("allocating the server's own region: {}", f.message)))?;
    let mut state = ServerState::default();
    let registered = registrable(MEM_TYPE_HOST, builtin, BUILTIN_LEN as u64).and_then(|region| {
        insert_registration(
            &mut state.regs,
            BUILTIN_TAG.to_string(),
            MEM_TYPE_HOST,
            builtin,
            BUILTIN_LEN as u64,
            region,
        )
    });
    if let Err(f) = registered {
        let _ = crate::runtime::free_host(builtin);
        return Err(f);
    }
    let server = Arc::new(Server {
        builtin,
        ip,
        port,
        endpoints: endpoints.iter().map(EndpointKey::from_raw).collect(),
        state: Mutex::new(state),
        listener: Mutex::new(None),
        threads: Mutex::new(Vec::new()),
    });
    let handle = runtime().new_handle();
    lock(servers()).insert(handle, server);
    Ok(handle)
}

pub(crate) fn server_reg_mem(
    handle: usize,
    tag: String,
    mem_type: i32,
    addr: usize,
    size: u64,
) -> Result<usize, Failure> {
    let s = server(handle)?;
    let region = registrable(mem_type, addr, size)?;
    let mut st = lock(&s.state);
    // Stricter than HIXL v9.1.0, which does not check this; its
    // documentation asks for the order enforced here.
    if st.listening.is_some() {
        return Err(para(
            "the server is already listening; register all memory before HixlCSServerListen",
        ));
    }
    insert_registration(&mut st.regs, tag, mem_type, addr, size, region)
}

pub(crate) fn server_unreg_mem(handle: usize, mem: usize) -> Result<(), Failure> {
    let s = server(handle)?;
    let mut st = lock(&s.state);
    remove_registration(&mut st.regs, mem)
}

pub(crate) fn server_listen(handle: usize, _backlog: u32) -> Result<(), Failure> {
    let s = server(handle)?;
    if lock(&s.state).listening.is_some() {
        return Err(para("the server is already listening"));
    }
    let listener = TcpListener::bind(SocketAddrV4::new(s.ip, s.port))
        .map_err(|e| failed(format!("cannot listen on {}:{}: {e}", s.ip, s.port)))?;
    let port = listener
        .local_addr()
        .map_err(|e| failed(e.to_string()))?
        .port();
    let accepting = listener.try_clone().map_err(|e| failed(e.to_string()))?;
    *lock(&s.listener) = Some(listener);
    lock(&s.state).listening = Some(port);
    let server = s.clone();
    let t = std::thread::Builder::new()
        .name("ascend-emu-hixl-accept".into())
        .spawn(move || server.accept_loop(accepting))
        .map_err(|e| failed(format!("cannot start the accept thread: {e}")))?;
    lock(&s.threads).push(t);
    log::debug!("emulated HIXL server listening on {}:{port}", s.ip);
    Ok(())
}

/// The port an emulated server listens on (emulator only).
pub(crate) fn server_port(handle: usize) -> Result<u32, Failure> {
    let s = server(handle)?;
    let port = lock(&s.state).listening;
    port.map(u32::from)
        .ok_or_else(|| para("the server is not listening yet; call HixlCSServerListen first"))
}

pub(crate) fn server_destroy(handle: usize) -> Result<(), Failure> {
    let s = server(handle)?;
    lock(servers()).remove(&handle);
    s.stop();
    lock(&s.state).regs.clear();
    if let Err(f) = crate::runtime::free_host(s.builtin) {
        log::debug!(
            "emulated HIXL server: freeing its own region: {}",
            f.message
        );
    }
    Ok(())
}

impl Server {
    fn accept_loop(self: Arc<Self>, listener: TcpListener) {
        loop {
            let conn = listener.accept();
            let mut st = lock(&self.state);
            if st.stopping {
                return;
            }
            let Ok((stream, _)) = conn else { continue };
            let Ok(kept) = stream.try_clone() else {
                continue;
            };
            // Under the same lock as the stopping check: `stop` shuts down
            // every connection it sees, and sees every one accepted before it.
            st.conns.push(kept);
            drop(st);
            let server = self.clone();
            let spawned = std::thread::Builder::new()
                .name("ascend-emu-hixl-conn".into())
                .spawn(move || {
                    if let Err(e) = server.serve(stream) {
                        log::debug!("emulated HIXL server: a connection ended: {e}");
                    }
                });
            if let Ok(t) = spawned {
                lock(&self.threads).push(t);
            }
        }
    }

    /// Answers one client until it disconnects.
    fn serve(&self, mut s: TcpStream) -> io::Result<()> {
        s.set_nodelay(true)?;
        let mut hello = [0u8; 32];
        s.read_exact(&mut hello)?;
        let Some((_client_pid, wanted)) = decode_hello(&hello) else {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "not an emulated HIXL client",
            ));
        };
        let offered = self.endpoints.iter().any(|e| endpoint_matches(e, &wanted));
        s.write_all(&encode_welcome(std::process::id(), offered))?;
        if !offered {
            return Ok(());
        }
        loop {
            let mut req = [0u8; 4];
            match s.read_exact(&mut req) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
                Err(e) => return Err(e),
            }
            if &req != MEMS_REQUEST {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "unknown request",
                ));
            }
            let msg = self.regions_message();
            s.write_all(&msg)?;
        }
    }

    fn regions_message(&self) -> Vec<u8> {
        let st = lock(&self.state);
        let regions: Vec<RegionDesc> = st
            .regs
            .values()
            .map(|r| RegionDesc {
                addr: r.addr as u64,
                size: r.size as u64,
                mem_type: r.mem_type,
                fd: r.region.raw_fd(),
                region_id: r.region.id,
                offset: (r.addr - r.region.base) as u64,
                tag: r.tag.clone(),
            })
            .collect();
        encode_regions(&regions)
    }

    /// Stops listening, closes every connection and waits for the threads.
    fn stop(&self) {
        let conns = {
            let mut st = lock(&self.state);
            st.stopping = true;
            std::mem::take(&mut st.conns)
        };
        if let Some(l) = lock(&self.listener).take() {
            // SAFETY: shutdown on a listening socket we own wakes the
            // thread blocked in accept (Linux); it touches no memory.
            unsafe { libc::shutdown(std::os::fd::AsRawFd::as_raw_fd(&l), libc::SHUT_RDWR) };
        }
        for c in conns {
            let _ = c.shutdown(Shutdown::Both);
        }
        let threads = std::mem::take(&mut *lock(&self.threads));
        for t in threads {
            let _ = t.join();
        }
    }
}

// ------------------------------------------------------------ client

/// A server region mapped into this process.
struct RemoteRegion {
    tag: String,
    addr: usize,
    size: usize,
    mem_type: i32,
    fd: i32,
    region_id: u64,
    offset: u64,
    mapping: PeerMapping,
}

/// A submitted batch.
struct Transfer {
    event: Arc<Event>,
    seq: u64,
}

/// The lists `HixlCSClientGetRemoteMem` hands out; they stay valid until
/// the next call on the client (or its destruction). Like HIXL's, the tag
/// list holds the tags of the tagged regions only, in region order.
#[derive(Default)]
struct OutLists {
    mems: Vec<sys::CommMem>,
    tags: Vec<CString>,
    tag_ptrs: Vec<*mut c_char>,
}

// SAFETY: the raw pointers are addresses handed to the C caller, never
// dereferenced here; the strings they point into are owned by `tags`.
unsafe impl Send for OutLists {}

#[derive(Default)]
struct ClientState {
    regs: BTreeMap<usize, Registration>,
    conn: Option<TcpStream>,
    server_pid: u32,
    /// Server regions by their address in the server.
    remote: BTreeMap<usize, Arc<RemoteRegion>>,
    fetched: bool,
    out: OutLists,
    /// Why the client is failed, once a batch failed or timed out.
    failed: Option<String>,
    /// Transfers not yet queried completed (a sync call's only while it runs).
    transfers: HashMap<usize, Transfer>,
}

/// An emulated HIXL client.
pub(crate) struct Client {
    server: SocketAddrV4,
    remote_endpoint: EndpointKey,
    /// The local endpoint is on the host: HIXL's host path, which limits
    /// unqueried transfers.
    host_located: bool,
    worker: Arc<Stream>,
    state: Mutex<ClientState>,
}

fn clients() -> &'static Mutex<HashMap<usize, Arc<Client>>> {
    static CLIENTS: OnceLock<Mutex<HashMap<usize, Arc<Client>>>> = OnceLock::new();
    CLIENTS.get_or_init(Default::default)
}

fn client(handle: usize) -> Result<Arc<Client>, Failure> {
    if handle == 0 {
        return Err(para("client handle is NULL"));
    }
    lock(clients())
        .get(&handle)
        .cloned()
        .ok_or_else(|| para(format!("{handle:#x} is not a live HIXL client")))
}

pub(crate) fn client_create(
    ip: &str,
    port: u32,
    local: &sys::EndpointDesc,
    remote: &sys::EndpointDesc,
) -> Result<usize, Failure> {
    require_init()?;
    let ip = parse_ip(ip)?;
    let port = parse_port(port)?;
    if port == 0 {
        return Err(para(
            "server port 0: give the port the server listens on (with an ephemeral port, \
             ascend_emu_hixl_server_port tells it)",
        ));
    }
    let (local, remote) = (EndpointKey::from_raw(local), EndpointKey::from_raw(remote));
    if local.protocol != remote.protocol {
        return Err(para(format!(
            "local endpoint ({}) and remote endpoint ({}) speak different protocols",
            local.describe(),
            remote.describe()
        )));
    }
    let worker = Stream::start_named(-1, "ascend-emu-hixl-client".into())
        .map_err(|e| failed(format!("cannot start the client's worker: {e}")))?;
    let c = Arc::new(Client {
        server: SocketAddrV4::new(ip, port),
        remote_endpoint: remote,
        host_located: local.loc_type == sys::ENDPOINT_LOC_TYPE_HOST,
        worker,
        state: Mutex::new(ClientState::default()),
    });
    let handle = runtime().new_handle();
    lock(clients()).insert(handle, c);
    Ok(handle)
}

pub(crate) fn client_reg_mem(
    handle: usize,
    tag: String,
    mem_type: i32,
    addr: usize,
    size: u64,
) -> Result<usize, Failure> {
    let c = client(handle)?;
    let region = registrable(mem_type, addr, size)?;
    let mut st = lock(&c.state);
    if st.conn.is_some() {
        return Err(para(
            "the client is already connected; register all local memory before HixlCSClientConnect",
        ));
    }
    insert_registration(&mut st.regs, tag, mem_type, addr, size, region)
}

pub(crate) fn client_unreg_mem(handle: usize, mem: usize) -> Result<(), Failure> {
    let c = client(handle)?;
    let mut st = lock(&c.state);
    remove_registration(&mut st.regs, mem)
}

fn io_failure(what: &str, e: &io::Error) -> Failure {
    match e.kind() {
        io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => {
            Failure::hixl(HIXL_TIMEOUT, format!("{what}: no answer in time ({e})"))
        }
        io::ErrorKind::UnexpectedEof
        | io::ErrorKind::ConnectionReset
        | io::ErrorKind::ConnectionAborted
        | io::ErrorKind::BrokenPipe => failed(format!(
            "{what}: the server closed the connection (destroyed, or its process exited): {e}"
        )),
        _ => failed(format!("{what}: {e}")),
    }
}

pub(crate) fn client_connect(handle: usize, timeout_ms: u32) -> Result<(), Failure> {
    let c = client(handle)?;
    let mut st = lock(&c.state);
    if st.conn.is_some() {
        return Err(para("the client is already connected"));
    }
    // As HIXL: one attempt (a refusal fails at once, so connect only once
    // the server listens), then the handshake; each phase may take the
    // whole timeout.
    let timeout = Duration::from_millis(u64::from(timeout_ms)).max(Duration::from_millis(1));
    let addr = std::net::SocketAddr::V4(c.server);
    let mut s = TcpStream::connect_timeout(&addr, timeout).map_err(|e| match e.kind() {
        io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => Failure::hixl(
            HIXL_TIMEOUT,
            format!(
                "connecting to the HIXL server at {addr}: no answer within {timeout_ms} ms ({e})"
            ),
        ),
        _ => failed(format!(
            "connecting to the HIXL server at {addr}: {e}; is it listening \
             (HixlCSServerListen)? HIXL tries once: connect only after the server listens"
        )),
    })?;
    let what = format!("handshake with the HIXL server at {addr}");
    s.set_nodelay(true)
        .and_then(|()| s.set_read_timeout(Some(timeout)))
        .and_then(|()| s.set_write_timeout(Some(timeout)))
        .map_err(|e| io_failure(&what, &e))?;
    s.write_all(&encode_hello(std::process::id(), &c.remote_endpoint))
        .map_err(|e| io_failure(&what, &e))?;
    let mut reply = [0u8; 16];
    s.read_exact(&mut reply)
        .map_err(|e| io_failure(&what, &e))?;
    let Some((server_pid, offered)) = decode_welcome(&reply) else {
        return Err(failed(format!(
            "{addr} answered, but not as an emulated HIXL server"
        )));
    };
    if !offered {
        return Err(failed(format!(
            "the server at {addr} offers no endpoint matching the client's remote endpoint ({})",
            c.remote_endpoint.describe()
        )));
    }
    st.server_pid = server_pid;
    st.conn = Some(s);
    Ok(())
}

/// Asks the server for its regions, maps them, and fills the lists handed
/// to the caller. Returns pointers into `st.out` and the count.
pub(crate) fn client_get_remote_mem(
    handle: usize,
    timeout_ms: u32,
) -> Result<(*mut sys::CommMem, *mut *mut c_char, u32), Failure> {
    let c = client(handle)?;
    let mut guard = lock(&c.state);
    let st = &mut *guard;
    let server_pid = st.server_pid;
    let Some(s) = st.conn.as_mut() else {
        return Err(para(
            "the client is not connected; call HixlCSClientConnect first",
        ));
    };
    let what = format!("asking the HIXL server at {} for its memory", c.server);
    let timeout = Duration::from_millis(u64::from(timeout_ms).max(1));
    s.set_read_timeout(Some(timeout))
        .map_err(|e| io_failure(&what, &e))?;
    s.write_all(MEMS_REQUEST)
        .map_err(|e| io_failure(&what, &e))?;
    let descs = read_regions(s).map_err(|e| io_failure(&what, &e))?;
    let mut remote = BTreeMap::new();
    for d in descs {
        let same = st.remote.get(&(d.addr as usize)).filter(|r| {
            r.region_id == d.region_id
                && r.fd == d.fd
                && r.offset == d.offset
                && r.size as u64 == d.size
        });
        let region = match same {
            Some(r) => r.clone(),
            None => {
                let mapping = PeerMapping::open(
                    server_pid,
                    d.fd,
                    d.region_id,
                    d.offset as usize,
                    d.size as usize,
                )
                .map_err(|e| match e {
                    PeerMapError::Gone => failed(format!(
                        "the server's memory [{:#x}, +{}) is gone (freed, or its process exited)",
                        d.addr, d.size
                    )),
                    PeerMapError::Os(m) => failed(m),
                })?;
                Arc::new(RemoteRegion {
                    tag: d.tag,
                    addr: d.addr as usize,
                    size: d.size as usize,
                    mem_type: d.mem_type,
                    fd: d.fd,
                    region_id: d.region_id,
                    offset: d.offset,
                    mapping,
                })
            }
        };
        remote.insert(region.addr, region);
    }
    // Copies already queued keep their own Arc to regions dropped here.
    st.remote = remote;
    st.fetched = true;
    let mut out = OutLists::default();
    for r in st.remote.values() {
        out.mems.push(sys::CommMem {
            type_: r.mem_type,
            addr: r.addr as *mut std::ffi::c_void,
            size: r.size as u64,
        });
        // As HIXL: only a tagged region adds a tag, so with an untagged
        // region the tag list is shorter than the region list.
        if !r.tag.is_empty() {
            out.tags
                .push(CString::new(r.tag.replace('\0', " ")).unwrap_or_default());
        }
    }
    out.tag_ptrs = out.tags.iter().map(|t| t.as_ptr().cast_mut()).collect();
    st.out = out;
    let n = st.out.mems.len() as u32;
    // As HIXL: empty lists are handed out as NULL.
    let mems = if st.out.mems.is_empty() {
        std::ptr::null_mut()
    } else {
        st.out.mems.as_mut_ptr()
    };
    let tags = if st.out.tag_ptrs.is_empty() {
        std::ptr::null_mut()
    } else {
        st.out.tag_ptrs.as_mut_ptr()
    };
    Ok((mems, tags, n))
}

/// One op as the C caller described it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Op {
    pub remote: usize,
    pub local: usize,
    pub len: u64,
}

/// Checks a whole batch and queues it on the client's worker; nothing is
/// queued unless every op is valid. Returns the transfer's handle.
fn submit(
    c: &Client,
    st: &mut ClientState,
    model: Option<&link::Link>,
    ops: &[Op],
    put: bool,
) -> Result<usize, Failure> {
    if let Some(why) = &st.failed {
        return Err(failed(format!(
            "the client is in the failed state since an earlier batch failed ({why}); \
             destroy it and create another"
        )));
    }
    if ops.is_empty() {
        return Err(para("list_num is 0: a batch needs at least one op"));
    }
    if st.conn.is_none() || !st.fetched {
        return Err(para(
            "no remote memory known: connect (HixlCSClientConnect) and fetch the server's \
             memory (HixlCSClientGetRemoteMem) first",
        ));
    }
    if c.host_located && st.transfers.len() >= HOST_CLIENT_TRANSFER_LIMIT {
        return Err(Failure::hixl(
            HIXL_RESOURCE_EXHAUSTED,
            format!(
                "{} transfers of this host-endpoint client have not been queried completed, \
                 the most HIXL keeps completion flags for; query them \
                 (HixlCSClientQueryCompleteStatus) before starting more",
                st.transfers.len()
            ),
        ));
    }
    let mut copies = Vec::with_capacity(ops.len());
    let mut keep: Vec<Arc<dyn Any + Send + Sync>> = Vec::new();
    let mut kept_local: Vec<u64> = Vec::new();
    let mut used_remote: Vec<Arc<RemoteRegion>> = Vec::new();
    for (i, op) in ops.iter().enumerate() {
        let bad = |m: String| para(format!("op {i}: {m}"));
        let len = usize::try_from(op.len).map_err(|_| bad("len does not fit".into()))?;
        if op.local == 0 || op.remote == 0 {
            return Err(bad("an address is NULL".into()));
        }
        let local_end = op
            .local
            .checked_add(len)
            .ok_or_else(|| bad("local range overflows".into()))?;
        let reg = st
            .regs
            .range(..=op.local)
            .next_back()
            .map(|(_, r)| r)
            .filter(|r| local_end <= r.addr + r.size)
            .ok_or_else(|| {
                bad(format!(
                    "local range [{:#x}, +{len}) is not inside memory registered on this client",
                    op.local
                ))
            })?;
        let remote_end = op
            .remote
            .checked_add(len)
            .ok_or_else(|| bad("remote range overflows".into()))?;
        let rem = st
            .remote
            .range(..=op.remote)
            .next_back()
            .map(|(_, r)| r)
            .filter(|r| remote_end <= r.addr + r.size)
            .ok_or_else(|| {
                bad(format!(
                    "remote range [{:#x}, +{len}) is outside every region the server registered",
                    op.remote
                ))
            })?;
        let there = rem.mapping.base() + (op.remote - rem.addr);
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
        if !kept_local.contains(&reg.region.id) {
            kept_local.push(reg.region.id);
            keep.push(reg.region.clone());
        }
        if !used_remote.iter().any(|r| Arc::ptr_eq(r, rem)) {
            used_remote.push(rem.clone());
        }
    }
    // The server's memory must still exist: its process may have exited
    // (the mapping would keep the pages, and the copies would "succeed").
    for r in &used_remote {
        if !peer_region_alive(st.server_pid, r.fd, r.region_id) {
            return Err(failed(format!(
                "the server's memory [{:#x}, +{}) is gone (freed, or the server process {} exited)",
                r.addr, r.size, st.server_pid
            )));
        }
    }
    keep.extend(
        used_remote
            .into_iter()
            .map(|r| r as Arc<dyn Any + Send + Sync>),
    );
    let dir = if put {
        Direction::Write
    } else {
        Direction::Read
    };
    let sizes: Vec<u64> = copies.iter().map(|c| c.len as u64).collect();
    let pace = match model {
        Some(l) => Duration::from_secs_f64(
            sizes
                .iter()
                .map(|&n| l.op_seconds(LinkPath::Hixl, dir, n).unwrap_or(0.0))
                .sum::<f64>(),
        ),
        None => Duration::ZERO,
    };
    let event = Arc::new(Event::default());
    let seq = event.begin_record();
    c.worker
        .submit(Task::Copies {
            copies,
            keep,
            pace,
            fault: None,
        })
        .map_err(|f| failed(format!("the client's worker stopped: {}", f.message)))?;
    if let Err(f) = c.worker.submit(Task::Record {
        event: event.clone(),
        seq,
    }) {
        // Nobody may wait forever for a record that was never queued.
        event.complete(seq);
        return Err(failed(format!(
            "the client's worker stopped: {}",
            f.message
        )));
    }
    // Accounted once queued, in the order batches were accepted (every
    // batch is submitted at modeled time 0; see `link`).
    if let Some(l) = model {
        lock(link::process_clock()).submit(l, LinkPath::Hixl, dir, 0.0, sizes);
    }
    let handle = runtime().new_handle();
    st.transfers.insert(handle, Transfer { event, seq });
    Ok(handle)
}

/// A failing batch call (FAILED or TIMEOUT) leaves the client failed.
fn note_failure<T>(st: &mut ClientState, r: Result<T, Failure>) -> Result<T, Failure> {
    if let Err(f) = &r {
        let code = u32::try_from(f.code).unwrap_or(HIXL_FAILED);
        if (code == HIXL_FAILED || code == HIXL_TIMEOUT) && st.failed.is_none() {
            st.failed = Some(f.message.clone());
        }
    }
    r
}

/// The link model, or the refusal of a misspelt one (checked first, so a
/// typo never runs at memory speed).
fn link_model() -> Result<Option<&'static link::Link>, Failure> {
    link::from_env().map_err(|e| para(e.to_string()))
}

pub(crate) fn client_batch_async(handle: usize, ops: &[Op], put: bool) -> Result<usize, Failure> {
    let model = link_model()?;
    let c = client(handle)?;
    let mut st = lock(&c.state);
    let r = submit(&c, &mut st, model, ops, put);
    note_failure(&mut st, r)
}

pub(crate) fn client_batch_sync(
    handle: usize,
    ops: &[Op],
    put: bool,
    timeout_ms: u32,
) -> Result<(), Failure> {
    let model = link_model()?;
    let c = client(handle)?;
    let t = {
        let mut st = lock(&c.state);
        let r = submit(&c, &mut st, model, ops, put);
        note_failure(&mut st, r)?
    };
    let (event, seq) = {
        let st = lock(&c.state);
        let tr = &st.transfers[&t];
        (tr.event.clone(), tr.seq)
    };
    let done = event.wait_for_timeout(seq, Duration::from_millis(u64::from(timeout_ms)));
    let mut st = lock(&c.state);
    st.transfers.remove(&t);
    if done {
        Ok(())
    } else {
        let r = Err(Failure::hixl(
            HIXL_TIMEOUT,
            format!(
                "the batch of {} ops did not complete within {timeout_ms} ms",
                ops.len()
            ),
        ));
        note_failure(&mut st, r)
    }
}

/// True when completed (the transfer is then forgotten), false while waiting.
pub(crate) fn client_query(handle: usize, transfer: usize) -> Result<bool, Failure> {
    let c = client(handle)?;
    let mut st = lock(&c.state);
    let tr = st.transfers.get(&transfer).ok_or_else(|| {
        para(format!(
            "{transfer:#x} is not a pending transfer of this client (a transfer is released \
             by the query that reports it completed; never query it again)"
        ))
    })?;
    if !tr.event.is_complete() {
        return Ok(false);
    }
    st.transfers.remove(&transfer);
    Ok(true)
}

pub(crate) fn client_destroy(handle: usize) -> Result<(), Failure> {
    let c = client(handle)?;
    lock(clients()).remove(&handle);
    // Queued copies finish first: the caller may free its memory after this.
    let _ = c.worker.synchronize();
    c.worker.close();
    if let Some(s) = lock(&c.state).conn.take() {
        let _ = s.shutdown(Shutdown::Both);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(protocol: i32, ip: Option<[u8; 4]>, dev: u32) -> EndpointKey {
        EndpointKey {
            protocol,
            addr_type: if ip.is_some() {
                sys::COMM_ADDR_TYPE_IP_V4
            } else {
                sys::COMM_ADDR_TYPE_RESERVED
            },
            addr: ip.map_or(0, u32::from_ne_bytes),
            loc_type: sys::ENDPOINT_LOC_TYPE_DEVICE,
            loc_id: dev,
        }
    }

    fn hccs(id: u32, dev: u32) -> EndpointKey {
        EndpointKey {
            protocol: sys::COMM_PROTOCOL_HCCS,
            addr_type: sys::COMM_ADDR_TYPE_ID,
            addr: id,
            loc_type: sys::ENDPOINT_LOC_TYPE_DEVICE,
            loc_id: dev,
        }
    }

    #[test]
    fn endpoints_match_by_hixls_rules() {
        let roce = sys::COMM_PROTOCOL_ROCE;
        let offered = key(roce, Some([10, 0, 0, 1]), 2);
        assert!(endpoint_matches(&offered, &offered));
        // RoCE: the IPv4 address decides, not the location.
        assert!(endpoint_matches(
            &offered,
            &key(roce, Some([10, 0, 0, 1]), 3)
        ));
        assert!(!endpoint_matches(
            &offered,
            &key(roce, Some([10, 0, 0, 9]), 2)
        ));
        // A RoCE endpoint without an address never matches one with.
        assert!(!endpoint_matches(&offered, &key(roce, None, 2)));
        // Emulator only: two address-less RoCE endpoints match by device.
        assert!(endpoint_matches(&key(roce, None, 2), &key(roce, None, 2)));
        assert!(!endpoint_matches(&key(roce, None, 2), &key(roce, None, 3)));
        // HCCS: the id decides, not the location; never across protocols.
        assert!(endpoint_matches(&hccs(4, 4), &hccs(4, 0)));
        assert!(!endpoint_matches(&hccs(4, 4), &hccs(5, 4)));
        assert!(!endpoint_matches(&offered, &hccs(2, 2)));
        let k = key(sys::COMM_PROTOCOL_HCCS, Some([1, 2, 3, 4]), 7);
        assert_eq!(EndpointKey::decode(&k.encode()), k);
        assert_eq!(k.describe(), "HCCS 1.2.3.4 on device 7");
        assert_eq!(hccs(3, 3).describe(), "HCCS id 3 on device 3");
    }

    #[test]
    fn handshake_messages_round_trip_and_reject_strangers() {
        let k = key(sys::COMM_PROTOCOL_ROCE, Some([127, 0, 0, 1]), 1);
        assert_eq!(decode_hello(&encode_hello(42, &k)), Some((42, k)));
        assert_eq!(decode_hello(&[0u8; 32]), None);
        assert_eq!(decode_welcome(&encode_welcome(7, true)), Some((7, true)));
        assert_eq!(decode_welcome(&encode_welcome(7, false)), Some((7, false)));
        assert_eq!(decode_welcome(&[1u8; 16]), None);
    }

    #[test]
    fn region_lists_round_trip_and_malformed_ones_are_refused() {
        let regions = vec![
            RegionDesc {
                addr: 0x7f00_0000_0000,
                size: 1 << 20,
                mem_type: MEM_TYPE_DEVICE,
                fd: 9,
                region_id: 3,
                offset: 4096,
                tag: "kv-cache".into(),
            },
            RegionDesc {
                addr: 0x7f00_1000_0000,
                size: 64,
                mem_type: MEM_TYPE_HOST,
                fd: 10,
                region_id: 4,
                offset: 0,
                tag: String::new(),
            },
        ];
        let bytes = encode_regions(&regions);
        assert_eq!(read_regions(&mut &bytes[..]).unwrap(), regions);
        assert!(read_regions(&mut &encode_regions(&[])[..])
            .unwrap()
            .is_empty());
        // Truncated, wrong magic, absurd count.
        assert!(read_regions(&mut &bytes[..bytes.len() - 1]).is_err());
        let mut wrong = bytes.clone();
        wrong[0] = b'X';
        assert!(read_regions(&mut &wrong[..]).is_err());
        let mut huge = bytes.clone();
        huge[4..8].copy_from_slice(&(MAX_REGIONS + 1).to_le_bytes());
        assert!(read_regions(&mut &huge[..]).is_err());
    }
}
