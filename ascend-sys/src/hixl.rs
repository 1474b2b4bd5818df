//! HIXL's client/server one-sided transfer API (`libcann_hixl.so`), safe.
//!
//! A [`HixlServer`] registers memory, then listens on a TCP address; a
//! [`HixlClient`] registers its own memory, connects, fetches the server's
//! registered regions ([`HixlClient::remote_mems`]) and then reads
//! ([`HixlClient::get_async`]) or writes ([`HixlClient::put_async`]) them
//! in batches of [`HixlOp`]s, polling each [`HixlTransfer`] with
//! [`HixlClient::query`].
//!
//! HIXL is optional: [`Acl::hixl`] loads the library on first use and
//! fails with [`Error::Unsupported`] (saying what to install) when it is
//! absent; nothing else in this crate needs it.
//!
//! Rules HIXL documents, which the wrappers keep or pass on:
//! - memory is registered before `listen` (server) or `connect` (client);
//! - after `connect` the client fetches the remote regions once;
//! - a put moves local → remote, a get remote → local;
//! - an empty batch is `HIXL_PARAM_INVALID`; on a client whose local
//!   endpoint is on the host at most [`HIXL_UNQUERIED_TRANSFER_LIMIT`]
//!   transfers may wait to be queried completed (`HIXL_RESOURCE_EXHAUSTED`
//!   beyond); nothing limits the ops of a batch;
//! - a batch call failing with `HIXL_FAILED` or `HIXL_TIMEOUT` leaves the
//!   client failed: later batches fail too, so drop it and create another
//!   ([`Error::hixl_status`] tells the code);
//! - a query that answers "completed" frees the transfer inside HIXL, so
//!   [`HixlClient::query`] takes the transfer by value and hands it back
//!   only while it is still waiting; HIXL never reports a stuck transfer
//!   (no TIMEOUT / FAILED state), so callers keep their own deadline and
//!   recreate the client past it.
//!
//! Every call on one server or client is serialised by a lock: HIXL does
//! not document which of its calls may run concurrently on one handle.
//!
//! Nothing here has run against a real libcann_hixl.so; the tests run
//! against the CANN emulator (ascend-sys/emu), which implements these
//! functions over loopback TCP and shared memory.

use std::ffi::{c_char, c_void, CStr, CString};
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use crate::acl::Acl;
use crate::error::{Error, Result};
use crate::hccl::MemKind;
use crate::result::{func, hixl_result};
use crate::sys;

/// File name of the HIXL library.
pub const HIXL_LIBRARY: &str = "libcann_hixl.so";
/// Transfers ([`HixlTransfer`]s, i.e. batches) not yet queried completed
/// that HIXL v9.1.0 keeps completion flags for on a client whose *local
/// endpoint is on the host*; one more batch call is then refused with
/// `HIXL_RESOURCE_EXHAUSTED` ([`crate::result::HIXL_RESOURCE_EXHAUSTED`],
/// 203900) until a query reports one completed. A client on a device
/// endpoint (every [`HixlEndpoint`]) has no such limit, and no HIXL limit
/// counts ops.
pub const HIXL_UNQUERIED_TRANSFER_LIMIT: usize = 4096;
/// The same number as [`HIXL_UNQUERIED_TRANSFER_LIMIT`], under its earlier
/// name. It is not a HIXL limit on ops: HIXL accepts batches of any size;
/// a caller may still use it as its own bound on ops in flight.
pub const HIXL_OPS_IN_FLIGHT_LIMIT: usize = HIXL_UNQUERIED_TRANSFER_LIMIT;
/// Traffic class [`HixlClient::create`] gives RDMA traffic: HIXL v9.1.0's
/// own default for RoCE NICs.
pub const HIXL_DEFAULT_TRAFFIC_CLASS: u8 = 132;
/// Service level [`HixlClient::create`] gives RDMA traffic: HIXL v9.1.0's
/// own default for RoCE NICs.
pub const HIXL_DEFAULT_SERVICE_LEVEL: u8 = 4;
/// How the tags of the regions a HIXL server registers for itself begin
/// (its completion flags, in v9.1.0); [`HixlClient::remote_mems`] leaves
/// them out where it knows the tags, and `register` refuses such tags.
pub const HIXL_BUILTIN_TAG_PREFIX: &str = "_hixl_builtin_";
/// Name of the emulator-only function that reports the port an emulated
/// server bound when it was created with port 0.
pub const EMU_SERVER_PORT_SYMBOL: &str = "ascend_emu_hixl_server_port";

type EmuPortFn = unsafe extern "C" fn(sys::HixlServerHandle, *mut u32) -> sys::HixlStatus;

/// The opened libcann_hixl.so, shared by every [`Hixl`] of the process.
pub(crate) struct HixlShared {
    lib: sys::HixlLib,
    path: PathBuf,
    /// Under the emulator: a second handle on the same file (so the symbol
    /// below stays valid) and its port query.
    emu_port: Option<(libloading::Library, EmuPortFn)>,
}

impl HixlShared {
    pub(crate) fn new(lib: sys::HixlLib, path: PathBuf, emulator: bool) -> HixlShared {
        let emu_port = emulator.then(|| emu_port_fn(&path)).flatten();
        HixlShared {
            lib,
            path,
            emu_port,
        }
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }
}

fn emu_port_fn(path: &Path) -> Option<(libloading::Library, EmuPortFn)> {
    // SAFETY: the file is the emulator library the loader has already
    // mapped (its initialisers ran); this only takes another reference.
    let lib = unsafe { libloading::Library::new(path) }.ok()?;
    // SAFETY: the emulator exports this symbol with exactly EmuPortFn's
    // signature; the Library kept next to it keeps it mapped.
    let f = unsafe { lib.get::<EmuPortFn>(EMU_SERVER_PORT_SYMBOL.as_bytes()) }
        .ok()
        .map(|s| *s)?;
    Some((lib, f))
}

impl Acl {
    /// HIXL (`libcann_hixl.so`), loaded on the first call and kept: next
    /// to libascendcl.so first, then in the same search order as the other
    /// CANN libraries; under the emulator, the emulator. Absent: an
    /// [`Error::Unsupported`] naming what to install (HIXL ships with CANN
    /// 9.1 or as the hixl package); lacking a required function:
    /// [`Error::MissingSymbol`]. Nothing else fails when HIXL is absent.
    pub fn hixl(&self) -> Result<Hixl> {
        Ok(Hixl {
            shared: self.libs().hixl()?,
            acl: self.clone(),
        })
    }

    /// The libcann_hixl.so in use, once [`Acl::hixl`] has loaded it.
    pub fn hixl_library_path(&self) -> Option<&Path> {
        self.libs().hixl_path()
    }
}

/// The loaded HIXL library. Cheap to clone; keeps the runtime alive.
#[derive(Clone)]
pub struct Hixl {
    shared: Arc<HixlShared>,
    acl: Acl,
}

impl std::fmt::Debug for Hixl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hixl")
            .field("path", &self.shared.path)
            .finish()
    }
}

impl Hixl {
    /// The libcann_hixl.so in use.
    pub fn library_path(&self) -> &Path {
        &self.shared.path
    }

    /// True when this is the CANN emulator's implementation.
    pub fn is_emulator(&self) -> bool {
        self.acl.is_emulator()
    }

    fn lib(&self) -> &sys::HixlLib {
        &self.shared.lib
    }

    fn check(&self, call: &'static str, code: sys::HixlStatus) -> Result<()> {
        hixl_result(call, code, || self.acl.libs().recent_error())
    }
}

/// Calls a HIXL function from the table and checks its status; an absent
/// symbol is [`Error::Unsupported`]. Must be used inside `unsafe`.
macro_rules! hixl_call {
    ($hixl:expr, $name:ident ( $($arg:expr),* $(,)? )) => {{
        let hixl: &Hixl = $hixl;
        match func(&hixl.lib().$name, stringify!($name)) {
            Ok(f) => hixl.check(stringify!($name), f($($arg),*)),
            Err(e) => Err(e),
        }
    }};
}

/// The transport of an endpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HixlProtocol {
    /// RDMA over Converged Ethernet (`COMM_PROTOCOL_ROCE`).
    Roce,
    /// Huawei Cache Coherence System, inside a server or super node
    /// (`COMM_PROTOCOL_HCCS`).
    Hccs,
}

/// One device endpoint (an `EndpointDesc` located on a device).
///
/// Encoded as HIXL v9.1.0's own endpoint generator does, since a server
/// matches a client's wanted endpoint field by field: a RoCE endpoint by
/// its IPv4 address (so it needs one: without it the address type is
/// reserved, which real HIXL never matches, and [`HixlServer::create`] /
/// [`HixlClient::create`] refuse it outside the emulator); an HCCS
/// endpoint by its device id (address type ID, id = the physical device
/// id; an `ipv4` given is ignored).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HixlEndpoint {
    /// Its transport.
    pub protocol: HixlProtocol,
    /// The device's physical id (not the logical id ACL numbers devices
    /// by; the two differ when a container or `ASCEND_RT_VISIBLE_DEVICES`
    /// remaps devices). ascend-sys does not bind CANN's logical → physical
    /// lookup (`aclrtGetPhyDevIdByLogicDevId`): take the physical id from
    /// the deployment (e.g. `npu-smi info`).
    pub device_phy_id: u32,
    /// The RoCE NIC's IPv4 address: required for RoCE outside the
    /// emulator, ignored for HCCS.
    pub ipv4: Option<Ipv4Addr>,
}

/// `superDevId` meaning "none" for an HCCS endpoint.
const NO_SUPER_DEVICE: u32 = u32::MAX;

impl HixlEndpoint {
    /// The C description: protocol; for RoCE the IPv4 address (network
    /// byte order; reserved address type without one), for HCCS address
    /// type ID holding the physical device id; device location with the
    /// physical id and, for HCCS, no super device (`0xFFFFFFFF`);
    /// everything else zero.
    pub fn to_raw(&self) -> sys::EndpointDesc {
        let mut d = sys::EndpointDesc {
            protocol: match self.protocol {
                HixlProtocol::Roce => sys::COMM_PROTOCOL_ROCE,
                HixlProtocol::Hccs => sys::COMM_PROTOCOL_HCCS,
            },
            ..Default::default()
        };
        match (self.protocol, self.ipv4) {
            (HixlProtocol::Hccs, _) => {
                d.commAddr.type_ = sys::COMM_ADDR_TYPE_ID;
                d.commAddr.__bindgen_anon_1 = sys::CommAddr__bindgen_ty_1 {
                    id: self.device_phy_id,
                };
            }
            (HixlProtocol::Roce, Some(ip)) => {
                d.commAddr.type_ = sys::COMM_ADDR_TYPE_IP_V4;
                d.commAddr.__bindgen_anon_1 = sys::CommAddr__bindgen_ty_1 {
                    addr: u32::from_ne_bytes(ip.octets()),
                };
            }
            (HixlProtocol::Roce, None) => d.commAddr.type_ = sys::COMM_ADDR_TYPE_RESERVED,
        }
        d.loc.locType = sys::ENDPOINT_LOC_TYPE_DEVICE;
        d.loc.__bindgen_anon_1 = sys::EndpointLoc__bindgen_ty_1 {
            device: sys::EndpointLoc__bindgen_ty_1__bindgen_ty_1 {
                devPhyId: self.device_phy_id,
                superDevId: match self.protocol {
                    HixlProtocol::Hccs => NO_SUPER_DEVICE,
                    HixlProtocol::Roce => 0,
                },
                serverIdx: 0,
                superPodIdx: 0,
            },
        };
        d
    }

    /// Refuses what real HIXL can never match: a RoCE endpoint without an
    /// IPv4 address (the emulator stands in for it by device).
    fn check_matchable(&self, emulator: bool, role: &str) -> Result<()> {
        if self.protocol == HixlProtocol::Roce && self.ipv4.is_none() && !emulator {
            return Err(Error::InvalidArgument(format!(
                "the {role} RoCE endpoint on device {} has no IPv4 address; HIXL matches RoCE \
                 endpoints by address, so give it the device NIC's IPv4 address (ipv4: Some(..))",
                self.device_phy_id
            )));
        }
        Ok(())
    }
}

fn mem_type(kind: MemKind) -> sys::CommMemType {
    match kind {
        MemKind::Device => sys::COMM_MEM_TYPE_DEVICE,
        MemKind::Host => sys::COMM_MEM_TYPE_HOST,
    }
}

fn c_string(what: &str, s: &str) -> Result<CString> {
    CString::new(s).map_err(|_| {
        Error::InvalidArgument(format!(
            "{what} {s:?} contains a NUL byte; HIXL takes C strings"
        ))
    })
}

/// A registration tag: non-empty (HIXL lists the tags of only the tagged
/// regions, so one untagged region would leave a client unable to pair
/// tags with regions) and free of NUL bytes.
fn tag_c_string(tag: &str) -> Result<CString> {
    if tag.is_empty() {
        return Err(Error::InvalidArgument(
            "an empty HIXL memory tag: HIXL leaves untagged regions out of the tag list it \
             hands clients, which then cannot tell which tag is whose; give every region a \
             non-empty tag"
                .into(),
        ));
    }
    if tag.starts_with(HIXL_BUILTIN_TAG_PREFIX) {
        return Err(Error::InvalidArgument(format!(
            "HIXL memory tag {tag:?} starts with {HIXL_BUILTIN_TAG_PREFIX:?}, which marks HIXL's \
             own regions (clients leave them out); choose another tag"
        )));
    }
    c_string("memory tag", tag)
}

/// Which of the tag pointers `HixlCSClientGetRemoteMem` hands out may be
/// read, for `n` regions. HIXL appends a tag only for a tagged region and
/// does not say how many it appended, so the list is `n` long only when
/// every region is tagged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum TagPlan {
    /// No tag list: no region is tagged.
    NoneTagged,
    /// Exactly `n` tags, the i-th naming region i.
    Paired,
    /// Between 1 and `n` tags, of unknown count and pairing: read none.
    Unknown,
}

pub(crate) fn tag_plan(n: usize, list_is_null: bool, every_region_tagged: bool) -> TagPlan {
    if list_is_null {
        TagPlan::NoneTagged
    } else if n == 1 || every_region_tagged {
        // A non-NULL list holds at least one tag and at most n.
        TagPlan::Paired
    } else {
        TagPlan::Unknown
    }
}

/// A timeout in the milliseconds HIXL takes: a `u32` that HIXL converts
/// to `int32_t`, so clamped to `i32::MAX` (about 24.8 days).
fn millis(timeout: Duration) -> u32 {
    const MAX: u32 = i32::MAX as u32;
    u32::try_from(timeout.as_millis()).map_or(MAX, |ms| ms.min(MAX))
}

/// The C description of a client; it points into its arguments.
fn client_desc(
    local: &sys::EndpointDesc,
    remote: &sys::EndpointDesc,
    server_ip: &CStr,
    server_port: u16,
    tc: u8,
    sl: u8,
) -> sys::HixlClientDesc {
    sys::HixlClientDesc {
        local_endpoint: local,
        remote_endpoint: remote,
        server_ip: server_ip.as_ptr(),
        server_port: u32::from(server_port),
        tc,
        sl,
        ..Default::default()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A raw HIXL handle; only the owning wrapper uses it, under its lock.
#[derive(Debug)]
struct Handle(*mut c_void);

// SAFETY: HIXL handles are plain identifiers the library accepts from any
// thread; the wrappers serialise every call on one handle with a lock.
unsafe impl Send for Handle {}
// SAFETY: as above; shared access only passes the value to HIXL under the lock.
unsafe impl Sync for Handle {}

/// A registration (`MemHandle`) of a server or client; give it back to
/// the same object's `unregister` (another one refuses it). Dropping it does not unregister (the
/// registration then lasts until the server or client is destroyed).
#[derive(Debug)]
pub struct HixlMemId {
    handle: Handle,
    /// Process-unique id of the server or client that registered it.
    owner: u64,
}

/// A region the server registered, as [`HixlClient::remote_mems`] copied
/// it out of HIXL's list.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HixlRemoteMem {
    /// The tag the server registered it with; "" when it has none or when
    /// [`HixlClient::remote_mems`] could not pair tags with regions.
    pub tag: String,
    /// Device or host memory.
    pub kind: MemKind,
    /// Its address in the server's address space (what ops name).
    pub addr: u64,
    /// Its length in bytes.
    pub len: u64,
}

/// One transfer of `len` bytes: a put writes `[local, local+len)` to
/// `[remote, remote+len)`, a get the other way.
#[derive(Clone, Copy, Debug)]
pub struct HixlOp {
    /// Address in the server's registered memory.
    pub remote: u64,
    /// Address in memory registered on this client.
    pub local: *mut u8,
    /// Bytes.
    pub len: u64,
}

// SAFETY: an op is a pair of addresses and a length; it dereferences
// nothing. Whoever submits it promises the memory is valid (put_async /
// get_async are unsafe).
unsafe impl Send for HixlOp {}
// SAFETY: as above.
unsafe impl Sync for HixlOp {}

/// A submitted batch (`CompleteHandle`), to be polled with
/// [`HixlClient::query`] until completed. Dropping it without that leaves
/// the batch running and HIXL's record of it in place (on a host-endpoint
/// client it keeps counting towards [`HIXL_UNQUERIED_TRANSFER_LIMIT`])
/// until the client is destroyed; the memory it names must stay untouched
/// until then.
///
/// It belongs to the client that started it: [`HixlClient::query`] on any
/// other client refuses it (HIXL would take it for one of its own).
#[derive(Debug)]
pub struct HixlTransfer {
    handle: Handle,
    /// [`HixlClient`]'s process-unique id.
    client: u64,
}

/// What a query found.
///
/// HIXL v9.1.0 answers only Waiting or Completed, on the host and the
/// device path alike: a transfer that never completes (a dead peer, a
/// broken link) stays Waiting for ever. Give every transfer a deadline of
/// your own; past it, stop polling and destroy the client (drop it, after
/// which the memory may be reused) and create a new one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HixlTransferState {
    /// Still running, or stuck (see above).
    Waiting,
    /// Done; every byte has moved. The transfer is gone.
    Completed,
    /// Timed out (reserved by HIXL, never reported by v9.1.0).
    TimedOut,
    /// Failed (reserved by HIXL, never reported by v9.1.0).
    Failed,
}

/// A HIXL server: registers memory, then listens for clients.
/// Dropping it destroys it (`HixlCSServerDestroy`); that never panics.
pub struct HixlServer {
    hixl: Hixl,
    handle: Handle,
    /// Process-unique; every registration records it.
    id: u64,
    port: u16,
    calls: Mutex<()>,
}

impl std::fmt::Debug for HixlServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HixlServer")
            .field("handle", &self.handle)
            .field("id", &self.id)
            .field("port", &self.port)
            .finish()
    }
}

impl HixlServer {
    /// Creates a server that will listen on `ip:port` offering `endpoints`
    /// (`HixlCSServerCreate`, no global resource configuration).
    ///
    /// Port 0 asks for an ephemeral port; only the emulator supports it
    /// (read the port with [`HixlServer::port`] after `listen`). With real
    /// HIXL pick a port yourself. With device endpoints HIXL wants the
    /// device bound on the calling thread first ([`crate::Device::bind`]).
    pub fn create(
        hixl: &Hixl,
        ip: &str,
        port: u16,
        endpoints: &[HixlEndpoint],
    ) -> Result<HixlServer> {
        if port == 0 && !hixl.is_emulator() {
            return Err(Error::InvalidArgument(
                "HIXL server port 0: an ephemeral port is an emulator feature; \
                 give the server a fixed free port"
                    .into(),
            ));
        }
        if endpoints.is_empty() {
            return Err(Error::InvalidArgument(
                "a HIXL server needs at least one endpoint to offer".into(),
            ));
        }
        for e in endpoints {
            e.check_matchable(hixl.is_emulator(), "server's")?;
        }
        let ip_c = c_string("server ip", ip)?;
        let raw: Vec<sys::EndpointDesc> = endpoints.iter().map(HixlEndpoint::to_raw).collect();
        let desc = sys::HixlServerDesc {
            endpoint_list: raw.as_ptr(),
            server_ip: ip_c.as_ptr(),
            server_port: u32::from(port),
            endpoint_list_num: u32::try_from(raw.len()).map_err(|_| {
                Error::InvalidArgument(format!("{} endpoints are too many", raw.len()))
            })?,
            ..Default::default()
        };
        let config = sys::HixlServerConfig::default();
        let mut handle: sys::HixlServerHandle = std::ptr::null_mut();
        // SAFETY: desc, the endpoint array and the ip string outlive the
        // call; config is zeroed (no configuration string); handle is a
        // valid out-parameter.
        unsafe { hixl_call!(hixl, HixlCSServerCreate(&desc, &config, &mut handle))? };
        Ok(HixlServer {
            hixl: hixl.clone(),
            handle: Handle(handle),
            id: NEXT_OBJECT_ID.fetch_add(1, Ordering::Relaxed),
            port,
            calls: Mutex::new(()),
        })
    }

    /// Registers `[addr, addr+len)` for clients to access
    /// (`HixlCSServerRegMem`); call before [`HixlServer::listen`]. `tag`
    /// must be non-empty ([`Error::InvalidArgument`] otherwise): HIXL lists
    /// only the tagged regions' tags, and a client can pair tags with
    /// regions only when every region has one.
    ///
    /// # Safety
    /// `[addr, addr+len)` is memory of kind `kind` that stays allocated
    /// until the server is destroyed, or until it is unregistered after
    /// every client that fetched it has disconnected (been destroyed).
    pub unsafe fn register(
        &self,
        tag: &str,
        kind: MemKind,
        addr: *mut u8,
        len: usize,
    ) -> Result<HixlMemId> {
        let tag = tag_c_string(tag)?;
        let mem = sys::CommMem {
            type_: mem_type(kind),
            addr: addr.cast(),
            size: len as u64,
        };
        let mut id: sys::MemHandle = std::ptr::null_mut();
        let _calls = lock(&self.calls);
        // SAFETY: the handle is live (destroyed only in Drop); tag and mem
        // outlive the call; the caller vouches for the memory.
        unsafe {
            hixl_call!(
                &self.hixl,
                HixlCSServerRegMem(self.handle.0, tag.as_ptr(), &mem, &mut id)
            )?
        };
        Ok(HixlMemId {
            handle: Handle(id),
            owner: self.id,
        })
    }

    /// Starts listening (`HixlCSServerListen`).
    pub fn listen(&self, backlog: u32) -> Result<()> {
        let _calls = lock(&self.calls);
        // SAFETY: the handle is live.
        unsafe { hixl_call!(&self.hixl, HixlCSServerListen(self.handle.0, backlog)) }
    }

    /// Unregisters memory (`HixlCSServerUnregMem`); HIXL wants the
    /// clients gone first.
    pub fn unregister(&self, id: HixlMemId) -> Result<()> {
        let _calls = lock(&self.calls);
        check_owner(&id, self.id, "server")?;
        // SAFETY: the handle is live. `id` is a handle this server's
        // HixlCSServerRegMem gave out (HixlMemId is made nowhere else; its
        // owner was checked) and, taken by value, is unregistered once.
        unsafe { hixl_call!(&self.hixl, HixlCSServerUnregMem(self.handle.0, id.handle.0)) }
    }

    /// The port clients connect to: the one given to
    /// [`HixlServer::create`], or, when that was 0 (emulator only), the
    /// port the emulator bound, known once [`HixlServer::listen`] returned.
    pub fn port(&self) -> Result<u16> {
        if self.port != 0 {
            return Ok(self.port);
        }
        let Some((_, f)) = self.hixl.shared.emu_port.as_ref() else {
            return Err(Error::Unsupported(EMU_SERVER_PORT_SYMBOL));
        };
        let mut port = 0u32;
        let _calls = lock(&self.calls);
        // SAFETY: the handle is live; port is a valid out-parameter.
        let code = unsafe { f(self.handle.0, &mut port) };
        self.hixl.check(EMU_SERVER_PORT_SYMBOL, code)?;
        u16::try_from(port)
            .map_err(|_| Error::InvalidArgument(format!("emulator reported port {port}")))
    }
}

impl Drop for HixlServer {
    fn drop(&mut self) {
        // SAFETY: the handle is live and used by nobody else (&mut self).
        if let Err(e) = unsafe { hixl_call!(&self.hixl, HixlCSServerDestroy(self.handle.0)) } {
            log::warn!("destroying a HIXL server: {e}");
        }
    }
}

/// Refuses a registration made by another server or client: HIXL would
/// look the handle up among its own.
fn check_owner(id: &HixlMemId, me: u64, what: &str) -> Result<()> {
    if id.owner != me {
        return Err(Error::InvalidArgument(format!(
            "a HIXL registration of object #{} given to the unregister of {what} #{me}: \
             unregister it on the server or client that registered it",
            id.owner
        )));
    }
    Ok(())
}

/// A sync batch that failed or timed out may still be moving bytes inside
/// HIXL: count it as unfinished for good.
fn note_unfinished_sync(calls: &mut Outstanding, r: &Result<()>) {
    if let Err(e) = r {
        if matches!(e.hixl_status(), Some(sys::HIXL_TIMEOUT | sys::HIXL_FAILED)) {
            calls.0 += 1;
        }
    }
}

/// A HIXL client of one server. Dropping it destroys it
/// (`HixlCSClientDestroy`); that never panics.
pub struct HixlClient {
    hixl: Hixl,
    handle: Handle,
    /// Process-unique (a counter, never reused, unlike handle addresses);
    /// every transfer records it.
    id: u64,
    /// Serialises calls; counts the transfers not yet queried completed.
    calls: Mutex<Outstanding>,
}

/// Async transfers of a client not yet queried completed (dropped ones
/// included: HIXL may still be moving their bytes).
#[derive(Debug, Default)]
struct Outstanding(usize);

/// The next [`HixlServer`] / [`HixlClient`] id.
static NEXT_OBJECT_ID: AtomicU64 = AtomicU64::new(1);

impl std::fmt::Debug for HixlClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HixlClient")
            .field("handle", &self.handle)
            .field("id", &self.id)
            .finish()
    }
}

impl HixlClient {
    /// Creates a client of the server at `server_ip:server_port`, moving
    /// data between `local` (this side's endpoint) and `remote` (one the
    /// server offers) (`HixlCSClientCreate`, no global resource
    /// configuration, traffic class [`HIXL_DEFAULT_TRAFFIC_CLASS`] and
    /// service level [`HIXL_DEFAULT_SERVICE_LEVEL`], HIXL's defaults). As
    /// with the server, bind the device on the calling thread first.
    pub fn create(
        hixl: &Hixl,
        server_ip: &str,
        server_port: u16,
        local: &HixlEndpoint,
        remote: &HixlEndpoint,
    ) -> Result<HixlClient> {
        Self::create_with_traffic_class(
            hixl,
            server_ip,
            server_port,
            local,
            remote,
            HIXL_DEFAULT_TRAFFIC_CLASS,
            HIXL_DEFAULT_SERVICE_LEVEL,
        )
    }

    /// [`HixlClient::create`] with the RDMA traffic class `tc` and service
    /// level `sl` the client's traffic carries (HIXL passes them to the
    /// NIC; they must match the network's QoS setup). The emulator
    /// ignores both.
    pub fn create_with_traffic_class(
        hixl: &Hixl,
        server_ip: &str,
        server_port: u16,
        local: &HixlEndpoint,
        remote: &HixlEndpoint,
        tc: u8,
        sl: u8,
    ) -> Result<HixlClient> {
        local.check_matchable(hixl.is_emulator(), "local")?;
        remote.check_matchable(hixl.is_emulator(), "remote")?;
        let ip_c = c_string("server ip", server_ip)?;
        let (local_raw, remote_raw) = (local.to_raw(), remote.to_raw());
        let desc = client_desc(&local_raw, &remote_raw, &ip_c, server_port, tc, sl);
        let config = sys::HixlClientConfig::default();
        let mut handle: sys::HixlClientHandle = std::ptr::null_mut();
        // SAFETY: desc and everything it points to outlive the call; config
        // is zeroed; handle is a valid out-parameter.
        unsafe { hixl_call!(hixl, HixlCSClientCreate(&desc, &config, &mut handle))? };
        Ok(HixlClient {
            hixl: hixl.clone(),
            handle: Handle(handle),
            id: NEXT_OBJECT_ID.fetch_add(1, Ordering::Relaxed),
            calls: Mutex::new(Outstanding::default()),
        })
    }

    /// Registers local memory for transfers (`HixlCSClientRegMem`); call
    /// before [`HixlClient::connect`]. `tag` must be non-empty, as for
    /// [`HixlServer::register`].
    ///
    /// # Safety
    /// `[addr, addr+len)` is memory of kind `kind` that stays allocated
    /// until the client is destroyed, or until it is unregistered after
    /// every transfer naming it has been queried completed.
    pub unsafe fn register(
        &self,
        tag: &str,
        kind: MemKind,
        addr: *mut u8,
        len: usize,
    ) -> Result<HixlMemId> {
        let tag = tag_c_string(tag)?;
        let mem = sys::CommMem {
            type_: mem_type(kind),
            addr: addr.cast(),
            size: len as u64,
        };
        let mut id: sys::MemHandle = std::ptr::null_mut();
        let _calls = lock(&self.calls);
        // SAFETY: the handle is live; tag and mem outlive the call; the
        // caller vouches for the memory.
        unsafe {
            hixl_call!(
                &self.hixl,
                HixlCSClientRegMem(self.handle.0, tag.as_ptr(), &mem, &mut id)
            )?
        };
        Ok(HixlMemId {
            handle: Handle(id),
            owner: self.id,
        })
    }

    /// Connects to the server (`HixlCSClientConnect`). HIXL tries once: a
    /// server not listening yet fails at once (`HIXL_FAILED`), so connect
    /// only after the server's [`HixlServer::listen`]. Each phase of the
    /// connection (TCP connect, then HIXL's handshake) may take the whole
    /// `timeout` (`HIXL_TIMEOUT` past it), so the call can take a multiple
    /// of it. Timeouts are clamped to `i32::MAX` ms, as HIXL takes them.
    pub fn connect(&self, timeout: Duration) -> Result<()> {
        let _calls = lock(&self.calls);
        // SAFETY: the handle is live.
        unsafe {
            hixl_call!(
                &self.hixl,
                HixlCSClientConnect(self.handle.0, millis(timeout))
            )
        }
    }

    /// The server's registered regions (`HixlCSClientGetRemoteMem`),
    /// copied out of the lists HIXL owns (which the next call frees). Call
    /// once after [`HixlClient::connect`], before any transfer. Refused
    /// ([`Error::InvalidArgument`]) while a transfer of this client has not
    /// been queried completed (a dropped one counts until the client is
    /// destroyed): HIXL drops and re-imports the server's memory on every
    /// call.
    ///
    /// Identify regions by address and length. HIXL hands out the tags of
    /// the tagged regions only, without their count, so this safe form
    /// fills [`HixlRemoteMem::tag`] only when the pairing is certain (no
    /// tag list at all, or a single region) and leaves every tag `""`
    /// otherwise. When the server tags every region, as any
    /// [`HixlServer`] does, [`HixlClient::remote_mems_tagged`] reads them.
    ///
    /// A real HIXL server also lists regions of its own (tags starting
    /// [`HIXL_BUILTIN_TAG_PREFIX`]; writing them would corrupt its
    /// completion flags). They are left out when the tags are known; when
    /// they are not (tags `""` here), they are among the regions returned:
    /// only ever name regions you know by address.
    pub fn remote_mems(&self, timeout: Duration) -> Result<Vec<HixlRemoteMem>> {
        self.fetch_remote_mems(timeout, false)
    }

    /// [`HixlClient::remote_mems`] with every region's tag, and without
    /// the server's own regions (tags starting [`HIXL_BUILTIN_TAG_PREFIX`]).
    ///
    /// # Safety
    /// Every region the server registered carries a non-empty tag (true of
    /// a server made with [`HixlServer`], whose `register` refuses empty
    /// tags). Otherwise HIXL's tag list is shorter than its region list
    /// and this reads past its end.
    pub unsafe fn remote_mems_tagged(&self, timeout: Duration) -> Result<Vec<HixlRemoteMem>> {
        self.fetch_remote_mems(timeout, true)
    }

    fn fetch_remote_mems(
        &self,
        timeout: Duration,
        every_region_tagged: bool,
    ) -> Result<Vec<HixlRemoteMem>> {
        let mut mems: *mut sys::CommMem = std::ptr::null_mut();
        let mut tags: *mut *mut c_char = std::ptr::null_mut();
        let mut n = 0u32;
        let calls = lock(&self.calls);
        if calls.0 > 0 {
            return Err(Error::InvalidArgument(format!(
                "{} transfer(s) of this HIXL client have not been queried completed, and \
                 fetching the remote regions makes HIXL import the server's memory anew under \
                 them; query every transfer to completion first (one dropped unqueried counts \
                 until the client is destroyed: create a new client instead)",
                calls.0
            )));
        }
        // SAFETY: the handle is live; the three out-parameters are valid.
        unsafe {
            hixl_call!(
                &self.hixl,
                HixlCSClientGetRemoteMem(
                    self.handle.0,
                    &mut mems,
                    &mut tags,
                    &mut n,
                    millis(timeout)
                )
            )?
        };
        let n = n as usize;
        if n == 0 {
            return Ok(Vec::new());
        }
        if mems.is_null() {
            return Err(Error::InvalidArgument(format!(
                "HixlCSClientGetRemoteMem reported {n} regions but no list"
            )));
        }
        // SAFETY: on success HIXL hands out n CommMem entries that stay
        // valid until the next GetRemoteMem on this client, which our lock
        // keeps out until the copies below are done.
        let mems = unsafe { std::slice::from_raw_parts(mems, n) };
        let tags: Option<&[*mut c_char]> = match tag_plan(n, tags.is_null(), every_region_tagged) {
            // SAFETY: the tag list holds one pointer per tagged region;
            // Paired means every region is tagged (the caller of
            // remote_mems_tagged vouches for it, or n is 1 and a non-NULL
            // list holds at least one), so it holds n; valid as long as
            // the regions (see above).
            TagPlan::Paired => Some(unsafe { std::slice::from_raw_parts(tags, n) }),
            TagPlan::NoneTagged => None,
            TagPlan::Unknown => {
                log::debug!(
                    "HixlCSClientGetRemoteMem: {n} regions and a tag list of unknown length; \
                     tags left empty (remote_mems_tagged reads them when every region is tagged)"
                );
                None
            }
        };
        let mut out = Vec::with_capacity(n);
        for (i, m) in mems.iter().enumerate() {
            let kind = match m.type_ {
                sys::COMM_MEM_TYPE_DEVICE => MemKind::Device,
                sys::COMM_MEM_TYPE_HOST => MemKind::Host,
                other => {
                    return Err(Error::InvalidArgument(format!(
                        "HixlCSClientGetRemoteMem: region {i} has unknown memory type {other}"
                    )))
                }
            };
            let tag = match tags.map(|t| t[i]) {
                // SAFETY: a non-NULL tag is a NUL-terminated string valid
                // until the next GetRemoteMem (see above).
                Some(p) if !p.is_null() => {
                    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
                }
                _ => String::new(),
            };
            if tag.starts_with(HIXL_BUILTIN_TAG_PREFIX) {
                continue;
            }
            out.push(HixlRemoteMem {
                tag,
                kind,
                addr: m.addr as u64,
                len: m.size,
            });
        }
        Ok(out)
    }

    fn raw_ops(ops: &[HixlOp]) -> Result<(u32, Vec<sys::HixlOneSideOpDesc>)> {
        let n = u32::try_from(ops.len()).map_err(|_| {
            Error::InvalidArgument(format!("{} ops do not fit one HIXL batch", ops.len()))
        })?;
        let raw = ops
            .iter()
            .map(|op| sys::HixlOneSideOpDesc {
                remote_buf: op.remote as usize as *mut c_void,
                local_buf: op.local.cast(),
                len: op.len,
            })
            .collect();
        Ok((n, raw))
    }

    /// Starts reading every op's remote range into its local range
    /// (`HixlCSClientBatchGetAsync`). An empty batch is HIXL's
    /// `HIXL_PARAM_INVALID`.
    ///
    /// # Safety
    /// Every op's remote range lies in a remote region, its local range in
    /// memory registered on this client, and nothing else touches the
    /// local range until the transfer is Completed or the client is
    /// destroyed.
    pub unsafe fn get_async(&self, ops: &[HixlOp]) -> Result<HixlTransfer> {
        let (n, raw) = Self::raw_ops(ops)?;
        let mut t: sys::CompleteHandle = std::ptr::null_mut();
        let mut calls = lock(&self.calls);
        // SAFETY: the handle is live; raw holds n descriptors; t is a valid
        // out-parameter; the caller vouches for the ranges.
        unsafe {
            hixl_call!(
                &self.hixl,
                HixlCSClientBatchGetAsync(self.handle.0, n, raw.as_ptr(), &mut t)
            )?
        };
        calls.0 += 1;
        Ok(HixlTransfer {
            handle: Handle(t),
            client: self.id,
        })
    }

    /// Starts writing every op's local range to its remote range
    /// (`HixlCSClientBatchPutAsync`). An empty batch is HIXL's
    /// `HIXL_PARAM_INVALID`.
    ///
    /// # Safety
    /// As [`HixlClient::get_async`]; the local range must not be written
    /// until the transfer is Completed or the client is destroyed.
    pub unsafe fn put_async(&self, ops: &[HixlOp]) -> Result<HixlTransfer> {
        let (n, raw) = Self::raw_ops(ops)?;
        let mut t: sys::CompleteHandle = std::ptr::null_mut();
        let mut calls = lock(&self.calls);
        // SAFETY: as in get_async.
        unsafe {
            hixl_call!(
                &self.hixl,
                HixlCSClientBatchPutAsync(self.handle.0, n, raw.as_ptr(), &mut t)
            )?
        };
        calls.0 += 1;
        Ok(HixlTransfer {
            handle: Handle(t),
            client: self.id,
        })
    }

    /// Reads every op and waits for the whole batch, at most `timeout`
    /// (`HixlCSClientBatchGetSync`; `HIXL_TIMEOUT` past it, which leaves
    /// the client failed). Blocks every other call on this client.
    ///
    /// # Safety
    /// As [`HixlClient::get_async`]; after a failure or timeout the local
    /// ranges may still be written until the client is destroyed.
    pub unsafe fn get_sync(&self, ops: &[HixlOp], timeout: Duration) -> Result<()> {
        let (n, raw) = Self::raw_ops(ops)?;
        let mut calls = lock(&self.calls);
        // SAFETY: the handle is live; raw holds n descriptors.
        let r = unsafe {
            hixl_call!(
                &self.hixl,
                HixlCSClientBatchGetSync(self.handle.0, n, raw.as_ptr(), millis(timeout))
            )
        };
        note_unfinished_sync(&mut calls, &r);
        r
    }

    /// Writes every op and waits for the whole batch, at most `timeout`
    /// (`HixlCSClientBatchPutSync`). Blocks every other call on this client.
    ///
    /// # Safety
    /// As [`HixlClient::get_sync`].
    pub unsafe fn put_sync(&self, ops: &[HixlOp], timeout: Duration) -> Result<()> {
        let (n, raw) = Self::raw_ops(ops)?;
        let mut calls = lock(&self.calls);
        // SAFETY: as in get_sync.
        let r = unsafe {
            hixl_call!(
                &self.hixl,
                HixlCSClientBatchPutSync(self.handle.0, n, raw.as_ptr(), millis(timeout))
            )
        };
        note_unfinished_sync(&mut calls, &r);
        r
    }

    /// Polls a transfer (`HixlCSClientQueryCompleteStatus`). Completed
    /// frees it inside HIXL, so it comes back only while Waiting (and on
    /// the reserved TimedOut / Failed, where HIXL documents nothing).
    /// HIXL never reports a stuck transfer: the caller needs a deadline of
    /// its own (see [`HixlTransferState`]).
    /// On an error the transfer is dropped. A transfer of another client
    /// is refused ([`Error::InvalidArgument`]) before HIXL sees it: HIXL
    /// would treat it as one of this client's and free it.
    pub fn query(&self, t: HixlTransfer) -> Result<(HixlTransferState, Option<HixlTransfer>)> {
        if t.client != self.id {
            return Err(Error::InvalidArgument(format!(
                "a HIXL transfer of client #{} queried on client #{}: query a transfer on the \
                 client that started it",
                t.client, self.id
            )));
        }
        let mut status: sys::HixlCompleteStatus = sys::HIXL_COMPLETE_STATUS_WAITING;
        let mut calls = lock(&self.calls);
        // SAFETY: the handle is live; t came from this client (checked
        // above by id) and has not completed (a completed one is never
        // handed back); status is a valid out-parameter.
        unsafe {
            hixl_call!(
                &self.hixl,
                HixlCSClientQueryCompleteStatus(self.handle.0, t.handle.0, &mut status)
            )?
        };
        Ok(match status {
            sys::HIXL_COMPLETE_STATUS_COMPLETED => {
                calls.0 = calls.0.saturating_sub(1);
                (HixlTransferState::Completed, None)
            }
            sys::HIXL_COMPLETE_STATUS_WAITING => (HixlTransferState::Waiting, Some(t)),
            sys::HIXL_COMPLETE_STATUS_TIMEOUT => (HixlTransferState::TimedOut, Some(t)),
            sys::HIXL_COMPLETE_STATUS_FAILED => (HixlTransferState::Failed, Some(t)),
            other => {
                return Err(Error::InvalidArgument(format!(
                    "HixlCSClientQueryCompleteStatus answered unknown status {other}"
                )))
            }
        })
    }

    /// Unregisters local memory (`HixlCSClientUnregMem`); only after every
    /// transfer naming it has been queried completed.
    pub fn unregister(&self, id: HixlMemId) -> Result<()> {
        let _calls = lock(&self.calls);
        check_owner(&id, self.id, "client")?;
        // SAFETY: the handle is live. `id` is a handle this client's
        // HixlCSClientRegMem gave out (HixlMemId is made nowhere else; its
        // owner was checked) and, taken by value, is unregistered once.
        unsafe { hixl_call!(&self.hixl, HixlCSClientUnregMem(self.handle.0, id.handle.0)) }
    }
}

impl Drop for HixlClient {
    fn drop(&mut self) {
        // SAFETY: the handle is live and used by nobody else (&mut self).
        if let Err(e) = unsafe { hixl_call!(&self.hixl, HixlCSClientDestroy(self.handle.0)) } {
            log::warn!("destroying a HIXL client: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoint_description_carries_protocol_address_and_device() {
        let e = HixlEndpoint {
            protocol: HixlProtocol::Roce,
            device_phy_id: 3,
            ipv4: Some(Ipv4Addr::new(10, 0, 0, 7)),
        };
        let d = e.to_raw();
        assert_eq!(d.protocol, sys::COMM_PROTOCOL_ROCE);
        assert_eq!(d.commAddr.type_, sys::COMM_ADDR_TYPE_IP_V4);
        // SAFETY: the IPv4 member was the one written.
        let addr = unsafe { d.commAddr.__bindgen_anon_1.addr };
        assert_eq!(addr.to_ne_bytes(), [10, 0, 0, 7]);
        assert_eq!(d.loc.locType, sys::ENDPOINT_LOC_TYPE_DEVICE);
        // SAFETY: the device member was the one written.
        let dev = unsafe { d.loc.__bindgen_anon_1.device };
        assert_eq!(dev.devPhyId, 3);
        assert_eq!(dev.superDevId, 0);
        let roce_bare = HixlEndpoint { ipv4: None, ..e }.to_raw();
        assert_eq!(roce_bare.commAddr.type_, sys::COMM_ADDR_TYPE_RESERVED);
        // HCCS: identified by the physical device id, no super device; an
        // IPv4 address is ignored.
        for ipv4 in [None, Some(Ipv4Addr::new(10, 0, 0, 7))] {
            let h = HixlEndpoint {
                protocol: HixlProtocol::Hccs,
                device_phy_id: 5,
                ipv4,
            }
            .to_raw();
            assert_eq!(h.protocol, sys::COMM_PROTOCOL_HCCS);
            assert_eq!(h.commAddr.type_, sys::COMM_ADDR_TYPE_ID);
            // SAFETY: the id member was the one written.
            assert_eq!(unsafe { h.commAddr.__bindgen_anon_1.id }, 5);
            // SAFETY: the device member was the one written.
            let dev = unsafe { h.loc.__bindgen_anon_1.device };
            assert_eq!((dev.devPhyId, dev.superDevId), (5, u32::MAX));
        }
    }

    #[test]
    fn a_roce_endpoint_without_an_address_is_refused_outside_the_emulator() {
        let bare = HixlEndpoint {
            protocol: HixlProtocol::Roce,
            device_phy_id: 2,
            ipv4: None,
        };
        let err = bare.check_matchable(false, "local").unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)));
        assert!(err.to_string().contains("ipv4: Some"), "{err}");
        assert!(bare.check_matchable(true, "local").is_ok());
        let hccs = HixlEndpoint {
            protocol: HixlProtocol::Hccs,
            ..bare
        };
        assert!(hccs.check_matchable(false, "local").is_ok());
        let addressed = HixlEndpoint {
            ipv4: Some(Ipv4Addr::LOCALHOST),
            ..bare
        };
        assert!(addressed.check_matchable(false, "local").is_ok());
    }

    #[test]
    fn the_agreed_thread_properties_hold() {
        fn send<T: Send>() {}
        fn send_sync<T: Send + Sync>() {}
        send_sync::<Hixl>();
        send_sync::<HixlServer>();
        send_sync::<HixlClient>();
        send_sync::<HixlOp>();
        send::<HixlMemId>();
        send::<HixlTransfer>();
    }

    #[test]
    fn tags_are_read_only_when_the_list_is_provably_as_long_as_the_regions() {
        // No list: nothing is tagged.
        assert_eq!(tag_plan(5, true, false), TagPlan::NoneTagged);
        assert_eq!(tag_plan(5, true, true), TagPlan::NoneTagged);
        // A list with several regions: only the caller's word pairs them.
        assert_eq!(tag_plan(5, false, false), TagPlan::Unknown);
        assert_eq!(tag_plan(2, false, false), TagPlan::Unknown);
        assert_eq!(tag_plan(5, false, true), TagPlan::Paired);
        // One region and a non-NULL list: exactly one tag.
        assert_eq!(tag_plan(1, false, false), TagPlan::Paired);
    }

    #[test]
    fn empty_tags_are_refused_naming_the_fix() {
        let err = tag_c_string("").unwrap_err();
        assert!(err.to_string().contains("non-empty tag"), "{err}");
        assert!(tag_c_string("a\0b").is_err());
        let err = tag_c_string("_hixl_builtin_mine").unwrap_err();
        assert!(err.to_string().contains("choose another tag"), "{err}");
        assert_eq!(tag_c_string("pool0").unwrap().as_bytes(), b"pool0");
    }

    #[test]
    fn a_client_description_carries_traffic_class_and_service_level() {
        let ep = HixlEndpoint {
            protocol: HixlProtocol::Roce,
            device_phy_id: 1,
            ipv4: Some(Ipv4Addr::LOCALHOST),
        }
        .to_raw();
        let d = client_desc(&ep, &ep, c"10.0.0.1", 7000, 132, 4);
        assert_eq!((d.tc, d.sl, d.server_port), (132, 4, 7000));
        assert_eq!(
            (HIXL_DEFAULT_TRAFFIC_CLASS, HIXL_DEFAULT_SERVICE_LEVEL),
            (132, 4)
        );
        let d = client_desc(&ep, &ep, c"10.0.0.1", 7000, 96, 3);
        assert_eq!((d.tc, d.sl), (96, 3));
    }

    #[test]
    fn a_sync_batch_that_failed_or_timed_out_stays_unfinished() {
        let err = |code| hixl_result("HixlCSClientBatchGetSync", code, || None);
        let mut n = Outstanding::default();
        note_unfinished_sync(&mut n, &Ok(()));
        note_unfinished_sync(&mut n, &err(sys::HIXL_PARAM_INVALID));
        assert_eq!(n.0, 0, "nothing started");
        note_unfinished_sync(&mut n, &err(sys::HIXL_TIMEOUT));
        note_unfinished_sync(&mut n, &err(sys::HIXL_FAILED));
        assert_eq!(n.0, 2);
    }

    #[test]
    fn timeouts_saturate_to_i32_max_millis() {
        assert_eq!(millis(Duration::from_millis(1500)), 1500);
        assert_eq!(
            millis(Duration::from_millis(i32::MAX as u64)),
            i32::MAX as u32
        );
        assert_eq!(
            millis(Duration::from_millis(u32::MAX as u64)),
            i32::MAX as u32
        );
        assert_eq!(millis(Duration::from_secs(u64::MAX / 4)), i32::MAX as u32);
    }
}
