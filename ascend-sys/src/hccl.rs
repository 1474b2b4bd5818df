//! HCCL: two-rank communicators from a root info, registered memory,
//! descriptor exchange and one-sided batch put/get.
//!
//! The real flow (and the emulator's) is: rank 0 makes a [`RootInfo`] and
//! sends its bytes to rank 1 over any side channel; both call
//! [`Comm::init_two_ranks`]; each registers memory ([`Comm::register_device_buffer`],
//! [`Comm::register_host_buffer`]); both call [`Comm::exchange_descriptors`]
//! (HCCL moves the descriptors itself and sets up the one-sided connection
//! there, so this step cannot be replaced by sending descriptor bytes
//! yourself); each enables access to the peer's descriptors
//! ([`Comm::enable_access`]) and then issues [`Comm::batch_put`] /
//! [`Comm::batch_get`] with addresses inside those regions.
//!
//! Runtime limits (CANN 8.5 sources; see ascend-sys/README.md): one
//! `HcclBatchPut`/`HcclBatchGet` call takes at most [`BATCH_OP_LIMIT`] ops
//! ([`BATCH_OP_LIMIT_ASCEND950`] on the Ascend 950 generation) and refuses
//! more with `HCCL_E_PARA`; a communicator holds at most
//! [`REGISTRATION_LIMIT`] registrations and refuses more with
//! `HCCL_E_UNAVAIL`. CANN offers no query for either. Batches are split
//! into calls of at most [`Comm::batch_op_limit`] ops, queued in order on
//! one stream; registrations beyond the limit are refused here, naming it.

use std::any::Any;
use std::ffi::c_void;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::acl::Device;
use crate::error::{Error, Result};
use crate::memory::{DeviceBuffer, HostBuffer};
use crate::result::{hccl_call, hccl_one_sided_call};
use crate::stream::{Completion, Stream};
use crate::sys;

/// Size of an HCCL root info in bytes.
pub const ROOT_INFO_LEN: usize = sys::HCCL_ROOT_INFO_BYTES as usize;
/// Size of an HCCL memory descriptor in bytes.
pub const MEM_DESCRIPTOR_LEN: usize = sys::HCCL_MEM_DESC_LENGTH as usize + 1;

/// The rendezvous blob rank 0 creates and every rank passes to
/// [`Comm::init_two_ranks`]. Opaque; send it as bytes.
#[derive(Clone, PartialEq, Eq)]
pub struct RootInfo(Box<[u8; ROOT_INFO_LEN]>);

impl std::fmt::Debug for RootInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RootInfo({} bytes)", ROOT_INFO_LEN)
    }
}

impl RootInfo {
    /// The bytes to send to the other rank.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0[..]
    }

    /// Rebuilds a root info received from rank 0; must be exactly
    /// [`ROOT_INFO_LEN`] bytes.
    pub fn from_bytes(bytes: &[u8]) -> Result<RootInfo> {
        let arr: [u8; ROOT_INFO_LEN] = bytes.try_into().map_err(|_| {
            Error::InvalidArgument(format!(
                "root info must be {ROOT_INFO_LEN} bytes, got {}",
                bytes.len()
            ))
        })?;
        Ok(RootInfo(Box::new(arr)))
    }

    fn to_raw(&self) -> sys::HcclRootInfo {
        let mut raw = sys::HcclRootInfo::default();
        for (d, s) in raw.internal.iter_mut().zip(self.0.iter()) {
            *d = *s as std::ffi::c_char;
        }
        raw
    }
}

/// An opaque HCCL memory descriptor ([`MEM_DESCRIPTOR_LEN`] bytes).
#[derive(Clone, PartialEq, Eq)]
pub struct MemDescriptor(Box<[u8; MEM_DESCRIPTOR_LEN]>);

impl std::fmt::Debug for MemDescriptor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MemDescriptor({} bytes)", MEM_DESCRIPTOR_LEN)
    }
}

impl MemDescriptor {
    /// The raw bytes (e.g. for logging or carrying in a handshake).
    pub fn as_bytes(&self) -> &[u8] {
        &self.0[..]
    }

    /// Rebuilds a descriptor from its bytes; must be exactly
    /// [`MEM_DESCRIPTOR_LEN`] bytes. A descriptor only grants access after
    /// it went through [`Comm::exchange_descriptors`] on the same
    /// communicator.
    pub fn from_bytes(bytes: &[u8]) -> Result<MemDescriptor> {
        let arr: [u8; MEM_DESCRIPTOR_LEN] = bytes.try_into().map_err(|_| {
            Error::InvalidArgument(format!(
                "memory descriptor must be {MEM_DESCRIPTOR_LEN} bytes, got {}",
                bytes.len()
            ))
        })?;
        Ok(MemDescriptor(Box::new(arr)))
    }

    fn to_raw(&self) -> sys::HcclMemDesc {
        let mut raw = sys::HcclMemDesc::default();
        for (d, s) in raw.desc.iter_mut().zip(self.0.iter()) {
            *d = *s as std::ffi::c_char;
        }
        raw
    }

    fn from_raw(raw: &sys::HcclMemDesc) -> MemDescriptor {
        let mut arr = [0u8; MEM_DESCRIPTOR_LEN];
        for (d, s) in arr.iter_mut().zip(raw.desc.iter()) {
            *d = *s as u8;
        }
        MemDescriptor(Box::new(arr))
    }
}

/// Where registered memory lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemKind {
    /// Device memory.
    Device,
    /// Host memory.
    Host,
}

impl MemKind {
    fn raw(self) -> sys::HcclMemType {
        match self {
            MemKind::Device => sys::HCCL_MEM_TYPE_DEVICE,
            MemKind::Host => sys::HCCL_MEM_TYPE_HOST,
        }
    }
}

impl Device {
    /// Creates a root info (`HcclGetRootInfo`); call on rank 0.
    pub fn hccl_root_info(&self) -> Result<RootInfo> {
        self.bind()?;
        let mut raw = sys::HcclRootInfo::default();
        // SAFETY: raw is a valid out-parameter of the declared size.
        unsafe { hccl_call!(self.libs(), HcclGetRootInfo(&mut raw))? };
        let mut bytes = Box::new([0u8; ROOT_INFO_LEN]);
        for (d, s) in bytes.iter_mut().zip(raw.internal.iter()) {
            *d = *s as u8;
        }
        Ok(RootInfo(bytes))
    }
}

/// Ops one batch call accepts on Atlas A2/A3 SoCs (`MAX_DESC_NUM` in CANN 8.5).
pub const BATCH_OP_LIMIT: usize = 256;
/// Ops one batch call accepts on the Ascend 950 generation.
pub const BATCH_OP_LIMIT_ASCEND950: usize = 64;
/// Live registrations one communicator accepts.
pub const REGISTRATION_LIMIT: usize = 256;
/// Environment variable overriding the per-call op limit (a positive number).
pub const BATCH_OP_LIMIT_ENV: &str = "ASCEND_PD_HCCL_MAX_BATCH_OPS";

/// The per-call op limit of the SoC `aclrtGetSocName` names (Atlas A2/A3
/// when unknown).
pub fn batch_op_limit_for_soc(soc: Option<&str>) -> usize {
    match soc {
        Some(s) if s.starts_with("Ascend950") => BATCH_OP_LIMIT_ASCEND950,
        _ => BATCH_OP_LIMIT,
    }
}

/// The op limit a new communicator uses: [`BATCH_OP_LIMIT_ENV`] when set to
/// a positive number, else the SoC's. A malformed override is an error, not
/// silently ignored.
fn initial_op_limit(device: &Device) -> Result<usize> {
    match std::env::var(BATCH_OP_LIMIT_ENV) {
        Ok(v) if !v.trim().is_empty() => match v.trim().parse::<usize>() {
            Ok(n) if n > 0 => Ok(n),
            _ => Err(Error::InvalidArgument(format!(
                "{BATCH_OP_LIMIT_ENV}={v:?}: expected a positive number of ops per \
                 HcclBatchPut/HcclBatchGet call (unset it to use the SoC's limit)"
            ))),
        },
        _ => Ok(batch_op_limit_for_soc(device.acl().soc_name().as_deref())),
    }
}

struct CommInner {
    device: Device,
    raw: sys::HcclComm,
    rank: u32,
    /// Serialises calls on the communicator.
    calls: Mutex<()>,
    /// Ops per batch call (see the module notes).
    op_limit: AtomicUsize,
    /// Live registrations.
    registrations: AtomicUsize,
}

// SAFETY: the handle is only used under `calls`, with the device bound.
unsafe impl Send for CommInner {}
// SAFETY: see Send.
unsafe impl Sync for CommInner {}

impl CommInner {
    fn lock(&self) -> Result<std::sync::MutexGuard<'_, ()>> {
        self.device.bind()?;
        Ok(self.calls.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

impl Drop for CommInner {
    fn drop(&mut self) {
        if self.device.bind().is_ok() {
            // SAFETY: raw is a live communicator destroyed exactly once; all
            // registrations and enabled regions hold an Arc and are gone.
            let _ = unsafe { hccl_call!(self.device.libs(), HcclCommDestroy(self.raw)) };
        }
    }
}

/// A two-rank HCCL communicator. Cheap to clone; destroyed when the last
/// clone and every registration made on it are gone.
#[derive(Clone)]
pub struct Comm {
    inner: Arc<CommInner>,
}

impl std::fmt::Debug for Comm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Comm")
            .field("device", &self.inner.device.id())
            .field("rank", &self.inner.rank)
            .finish()
    }
}

/// One transfer of a batch: `len` bytes between a local address (inside
/// memory registered on the communicator) and a remote address (inside a
/// region enabled with [`Comm::enable_access`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct OneSidedOp {
    /// Local address.
    pub local_addr: u64,
    /// Address in the peer's memory, as its [`RemoteMem::addr`] reports.
    pub remote_addr: u64,
    /// Bytes to move.
    pub len: u64,
}

impl Comm {
    /// Joins a two-rank communicator as `rank` (0 or 1). Blocks until the
    /// other rank joins or HCCL's connect timeout (`HCCL_CONNECT_TIMEOUT`,
    /// seconds) passes. Rank 0 must be the process that made `root`.
    pub fn init_two_ranks(device: &Device, root: &RootInfo, rank: u32) -> Result<Comm> {
        if rank > 1 {
            return Err(Error::InvalidArgument(format!(
                "rank {rank} in a two-rank communicator"
            )));
        }
        device.bind()?;
        let op_limit = initial_op_limit(device)?;
        let raw_root = root.to_raw();
        let mut raw: sys::HcclComm = std::ptr::null_mut();
        // SAFETY: raw_root lives across the call; raw is a valid out-parameter.
        unsafe {
            hccl_call!(
                device.libs(),
                HcclCommInitRootInfo(2, &raw_root, rank, &mut raw)
            )?
        };
        Ok(Comm {
            inner: Arc::new(CommInner {
                device: device.clone(),
                raw,
                rank,
                calls: Mutex::new(()),
                op_limit: AtomicUsize::new(op_limit),
                registrations: AtomicUsize::new(0),
            }),
        })
    }

    /// Ops per `HcclBatchPut`/`HcclBatchGet` call; larger batches are split.
    pub fn batch_op_limit(&self) -> usize {
        self.inner.op_limit.load(Ordering::Relaxed)
    }

    /// Changes the ops per call (at least 1). Above the runtime's own limit
    /// the runtime refuses the call; tests use that to see the refusal.
    pub fn set_batch_op_limit(&self, ops: usize) {
        self.inner.op_limit.store(ops.max(1), Ordering::Relaxed);
    }

    /// Live registrations on this communicator.
    pub fn registrations(&self) -> usize {
        self.inner.registrations.load(Ordering::Relaxed)
    }

    /// This rank.
    pub fn rank(&self) -> u32 {
        self.inner.rank
    }

    /// The other rank.
    pub fn peer_rank(&self) -> u32 {
        1 - self.inner.rank
    }

    /// The device the communicator runs on.
    pub fn device(&self) -> &Device {
        &self.inner.device
    }

    /// Registers a device buffer for one-sided access by the peer. The
    /// registration keeps the buffer alive.
    pub fn register_device_buffer(&self, buffer: &Arc<DeviceBuffer>) -> Result<RegisteredMem> {
        // SAFETY: the registration holds an Arc to the buffer, so the range
        // stays allocated while it is registered.
        let mut reg = unsafe { self.register_raw(MemKind::Device, buffer.as_ptr(), buffer.len())? };
        reg.owner = Some(buffer.clone());
        Ok(reg)
    }

    /// Registers a pinned host buffer for one-sided access by the peer. The
    /// registration keeps the buffer alive.
    pub fn register_host_buffer(&self, buffer: &Arc<HostBuffer>) -> Result<RegisteredMem> {
        // SAFETY: as in register_device_buffer.
        let mut reg = unsafe { self.register_raw(MemKind::Host, buffer.as_ptr(), buffer.len())? };
        reg.owner = Some(buffer.clone());
        Ok(reg)
    }

    /// Registers `len` bytes at `addr` (`HcclRegisterMem`).
    ///
    /// # Safety
    /// The memory must stay allocated, of kind `kind`, until the returned
    /// registration and every completion using it are dropped.
    pub unsafe fn register_raw(
        &self,
        kind: MemKind,
        addr: *mut c_void,
        len: usize,
    ) -> Result<RegisteredMem> {
        let _guard = self.inner.lock()?;
        let live = self.inner.registrations.load(Ordering::Relaxed);
        if live >= REGISTRATION_LIMIT {
            return Err(Error::Limit {
                what: "HcclRegisterMem on one communicator",
                asked: live + 1,
                limit: REGISTRATION_LIMIT,
                why: "HCCL refuses more with HCCL_E_UNAVAIL; register whole pools, not pages, \
                      or drop registrations no longer used"
                    .into(),
            });
        }
        let mut desc = sys::HcclMemDesc::default();
        // SAFETY: the range is valid per the caller's contract; desc is a
        // valid out-parameter.
        unsafe {
            hccl_one_sided_call!(
                self.inner.device.libs(),
                HcclRegisterMem(
                    self.inner.raw,
                    self.peer_rank(),
                    kind.raw() as std::ffi::c_int,
                    addr,
                    len as u64,
                    &mut desc,
                )
            )?
        };
        self.inner.registrations.fetch_add(1, Ordering::Relaxed);
        Ok(RegisteredMem {
            comm: self.inner.clone(),
            desc: MemDescriptor::from_raw(&desc),
            kind,
            addr: addr as u64,
            len: len as u64,
            owner: None,
        })
    }

    /// Sends the descriptors of `local` to the peer and returns the peer's
    /// (`HcclExchangeMemDesc`). Both ranks must call it; blocks until both
    /// have. At most `max_remote` peer descriptors are accepted.
    pub fn exchange_descriptors(
        &self,
        local: &[&RegisteredMem],
        max_remote: usize,
    ) -> Result<Vec<MemDescriptor>> {
        for reg in local {
            if !Arc::ptr_eq(&reg.comm, &self.inner) {
                return Err(Error::InvalidArgument(
                    "a registration from another communicator was passed to exchange_descriptors"
                        .into(),
                ));
            }
        }
        let count = u32::try_from(local.len())
            .map_err(|_| Error::InvalidArgument("too many local descriptors".into()))?;
        let capacity = u32::try_from(max_remote)
            .map_err(|_| Error::InvalidArgument("max_remote too large".into()))?;
        let mut local_raw: Vec<sys::HcclMemDesc> = local.iter().map(|r| r.desc.to_raw()).collect();
        let mut remote_raw = vec![sys::HcclMemDesc::default(); max_remote];
        let mut local_descs = sys::HcclMemDescs {
            array: local_raw.as_mut_ptr(),
            arrayLength: count,
        };
        let mut remote_descs = sys::HcclMemDescs {
            array: remote_raw.as_mut_ptr(),
            arrayLength: capacity,
        };
        let mut actual = 0u32;
        let _guard = self.inner.lock()?;
        // SAFETY: both arrays live across the call and hold the lengths
        // declared; actual is a valid out-parameter. Timeout 0 means HCCL's
        // own timeout, as its documentation asks.
        unsafe {
            hccl_one_sided_call!(
                self.inner.device.libs(),
                HcclExchangeMemDesc(
                    self.inner.raw,
                    self.peer_rank(),
                    &mut local_descs,
                    0,
                    &mut remote_descs,
                    &mut actual,
                )
            )?
        };
        let actual = (actual as usize).min(max_remote);
        Ok(remote_raw[..actual]
            .iter()
            .map(MemDescriptor::from_raw)
            .collect())
    }

    /// Maps the peer memory `remote` describes for one-sided access
    /// (`HcclEnableMemAccess`). Access ends when the result is dropped.
    pub fn enable_access(&self, remote: &MemDescriptor) -> Result<RemoteMem> {
        let mut raw_desc = remote.to_raw();
        let mut mem = sys::HcclMem::default();
        let _guard = self.inner.lock()?;
        // SAFETY: raw_desc and mem are valid for the call.
        unsafe {
            hccl_one_sided_call!(
                self.inner.device.libs(),
                HcclEnableMemAccess(self.inner.raw, &mut raw_desc, &mut mem)
            )?
        };
        let kind = if mem.type_ == sys::HCCL_MEM_TYPE_HOST {
            MemKind::Host
        } else {
            MemKind::Device
        };
        Ok(RemoteMem {
            comm: self.inner.clone(),
            desc: remote.clone(),
            kind,
            addr: mem.addr as u64,
            len: mem.size,
        })
    }

    fn batch(
        &self,
        stream: &Stream,
        ops: &[OneSidedOp],
        put: bool,
        hold: Vec<Arc<dyn Any + Send + Sync>>,
    ) -> Result<Completion> {
        if stream.device().id() != self.inner.device.id() {
            return Err(Error::InvalidArgument(format!(
                "stream is on device {}, the communicator on device {}",
                stream.device().id(),
                self.inner.device.id()
            )));
        }
        let call = if put { "HcclBatchPut" } else { "HcclBatchGet" };
        let limit = self.batch_op_limit();
        // Counts are in elements of the data type; bytes as UINT8.
        let mut raw: Vec<sys::HcclOneSideOpDesc> = ops
            .iter()
            .map(|op| sys::HcclOneSideOpDesc {
                localAddr: op.local_addr as *mut c_void,
                remoteAddr: op.remote_addr as *mut c_void,
                count: op.len,
                dataType: sys::HCCL_DATA_TYPE_UINT8,
            })
            .collect();
        // The completion's event exists before any call is queued: once
        // something is queued, failing to make it would leave work in flight
        // that nothing tracks.
        let event = self.inner.device.create_event()?;
        let mut queued = 0usize;
        let mut failure = None;
        {
            let _guard = self.inner.lock()?;
            let libs = self.inner.device.libs();
            for chunk in raw.chunks_mut(limit) {
                let n = u32::try_from(chunk.len())
                    .map_err(|_| Error::InvalidArgument("too many ops in one call".into()))?;
                // SAFETY: chunk holds n op descriptors and lives across the
                // call; address validity is the caller's contract
                // (batch_put/get). Chunks are queued in order on one stream.
                let r = unsafe {
                    if put {
                        hccl_one_sided_call!(
                            libs,
                            HcclBatchPut(
                                self.inner.raw,
                                self.peer_rank(),
                                chunk.as_mut_ptr(),
                                n,
                                stream.as_raw()
                            )
                        )
                    } else {
                        hccl_one_sided_call!(
                            libs,
                            HcclBatchGet(
                                self.inner.raw,
                                self.peer_rank(),
                                chunk.as_mut_ptr(),
                                n,
                                stream.as_raw()
                            )
                        )
                    }
                };
                match r {
                    Ok(()) => queued += chunk.len(),
                    // Nothing queued yet: nothing in flight, plain failure.
                    Err(e) if queued == 0 => return Err(e),
                    Err(e) => {
                        failure = Some(Error::BatchPartlyQueued {
                            call,
                            queued,
                            total: ops.len(),
                            cause: e.to_string(),
                        });
                        break;
                    }
                }
            }
        }
        let mut hold = hold;
        hold.push(Arc::new(self.clone()) as Arc<dyn Any + Send + Sync>);
        // A partly queued batch still gets a real completion: the caller
        // must not reuse its memory before the queued calls have run.
        match stream.record(&event) {
            Ok(()) => Ok(Completion::new(event, hold, failure)),
            Err(e) if queued == 0 => Err(e),
            // Queued work and no event to track it: wait for the stream so
            // the error means "nothing in flight"; if even that fails, say
            // the memory may still be in use.
            Err(e) => match stream.synchronize() {
                Ok(()) => Err(e),
                Err(sync) => Err(Error::BatchInFlight {
                    call,
                    cause: format!("{e}; then waiting for the stream failed: {sync}"),
                }),
            },
        }
    }

    /// Queues writes of local memory into the peer's memory on `stream`
    /// (`HcclBatchPut`) and returns their completion.
    ///
    /// # Safety
    /// Every local range must lie in memory registered on this communicator
    /// and every remote range in a region enabled by [`Comm::enable_access`]
    /// (the library checks this and may also refuse); those registrations
    /// and [`RemoteMem`]s must stay alive, and the local memory unwritten,
    /// until the completion reports done.
    pub unsafe fn batch_put(&self, stream: &Stream, ops: &[OneSidedOp]) -> Result<Completion> {
        self.batch(stream, ops, true, Vec::new())
    }

    /// Queues reads of the peer's memory into local memory on `stream`
    /// (`HcclBatchGet`) and returns their completion.
    ///
    /// # Safety
    /// As for [`Comm::batch_put`]; in addition the local destination memory
    /// must not be read or written by the CPU until the completion reports
    /// done.
    pub unsafe fn batch_get(&self, stream: &Stream, ops: &[OneSidedOp]) -> Result<Completion> {
        self.batch(stream, ops, false, Vec::new())
    }
}

/// Memory registered on a communicator; deregistered on drop.
pub struct RegisteredMem {
    comm: Arc<CommInner>,
    desc: MemDescriptor,
    kind: MemKind,
    addr: u64,
    len: u64,
    owner: Option<Arc<dyn Any + Send + Sync>>,
}

impl std::fmt::Debug for RegisteredMem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegisteredMem")
            .field("kind", &self.kind)
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .finish()
    }
}

impl RegisteredMem {
    /// The descriptor to exchange with the peer.
    pub fn descriptor(&self) -> &MemDescriptor {
        &self.desc
    }

    /// Device or host memory.
    pub fn kind(&self) -> MemKind {
        self.kind
    }

    /// Start address.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// True for an empty registration (never produced; HCCL refuses them).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for RegisteredMem {
    fn drop(&mut self) {
        let mut raw = self.desc.to_raw();
        if let Ok(_guard) = self.comm.lock() {
            // SAFETY: raw describes a live registration, deregistered once.
            let _ = unsafe {
                hccl_one_sided_call!(
                    self.comm.device.libs(),
                    HcclDeregisterMem(self.comm.raw, &mut raw)
                )
            };
        }
        self.comm.registrations.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Peer memory enabled for one-sided access; disabled on drop.
pub struct RemoteMem {
    comm: Arc<CommInner>,
    desc: MemDescriptor,
    kind: MemKind,
    addr: u64,
    len: u64,
}

impl std::fmt::Debug for RemoteMem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteMem")
            .field("kind", &self.kind)
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .finish()
    }
}

impl RemoteMem {
    /// Device or host memory on the peer.
    pub fn kind(&self) -> MemKind {
        self.kind
    }

    /// The peer's start address; remote addresses in ops are relative to it.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// True for an empty region.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The descriptor this access was enabled from.
    pub fn descriptor(&self) -> &MemDescriptor {
        &self.desc
    }
}

impl Drop for RemoteMem {
    fn drop(&mut self) {
        let mut raw = self.desc.to_raw();
        if let Ok(_guard) = self.comm.lock() {
            // SAFETY: raw names a region enabled on this communicator.
            let _ = unsafe {
                hccl_one_sided_call!(
                    self.comm.device.libs(),
                    HcclDisableMemAccess(self.comm.raw, &mut raw)
                )
            };
        }
    }
}
