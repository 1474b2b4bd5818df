//! The emulated ACL runtime: process state, devices, memory, copies,
//! streams and events. The C entry points in `ffi` are thin shims over these
//! functions.

use std::any::Any;
use std::cell::Cell;
use std::collections::HashMap;
use std::ffi::CStr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use crate::memory::{Lookup, Placement, Region, Regions};
use crate::status::*;
use crate::stream::{Copy, Event, Stream, Task};

/// Default number of emulated devices (override: `ASCEND_EMU_DEVICE_COUNT`).
const DEFAULT_DEVICE_COUNT: u32 = 8;
/// Default bytes per emulated device (override: `ASCEND_EMU_DEVICE_MEMORY`).
const DEFAULT_DEVICE_MEMORY: usize = 16 << 30;

/// SoC the emulator reports (override: `ASCEND_EMU_SOC_NAME`). It picks the
/// HCCL limits the emulator enforces, as the SoC does on real hardware.
const DEFAULT_SOC_NAME: &str = "Ascend910B3";

/// Ops one `HcclBatchPut`/`HcclBatchGet` call accepts on Atlas A2/A3 SoCs.
pub(crate) const BATCH_OP_LIMIT: usize = 256;
/// Ops per call on the Ascend 950 generation.
pub(crate) const BATCH_OP_LIMIT_950: usize = 64;
/// Live `HcclRegisterMem` registrations one communicator accepts.
pub(crate) const REGISTRATION_LIMIT: usize = 256;

/// The SoC name `aclrtGetSocName` returns (NUL-terminated, lives forever).
pub(crate) fn soc_name() -> &'static CStr {
    static NAME: OnceLock<std::ffi::CString> = OnceLock::new();
    NAME.get_or_init(|| {
        let name = std::env::var("ASCEND_EMU_SOC_NAME")
            .ok()
            .filter(|n| !n.is_empty() && !n.contains('\0'))
            .unwrap_or_else(|| DEFAULT_SOC_NAME.to_string());
        std::ffi::CString::new(name).unwrap_or_default()
    })
}

/// The per-call op limit of the emulated SoC.
pub(crate) fn batch_op_limit() -> usize {
    if soc_name().to_bytes().starts_with(b"Ascend950") {
        BATCH_OP_LIMIT_950
    } else {
        BATCH_OP_LIMIT
    }
}

/// Free and total bytes of the current device (`aclrtGetMemInfo`; every
/// memory kind is the one emulated device memory).
pub(crate) fn mem_info(attr: u32) -> Result<(usize, usize), Failure> {
    if attr > 9 {
        return Err(Failure::acl(
            ACL_ERROR_INVALID_PARAM,
            format!("unknown memory attribute {attr}"),
        ));
    }
    let device = current_device()?;
    let st = runtime().initialized()?;
    let used = st.regions.device_bytes(device).min(st.device_memory);
    Ok((st.device_memory - used, st.device_memory))
}

/// `aclrtMemcpyKind` values.
pub(crate) const MEMCPY_HOST_TO_HOST: u32 = 0;
pub(crate) const MEMCPY_HOST_TO_DEVICE: u32 = 1;
pub(crate) const MEMCPY_DEVICE_TO_HOST: u32 = 2;
pub(crate) const MEMCPY_DEVICE_TO_DEVICE: u32 = 3;

/// `aclrtEventRecordedStatus` values.
pub(crate) const EVENT_NOT_READY: u32 = 0;
pub(crate) const EVENT_COMPLETE: u32 = 1;

pub(crate) struct State {
    initialized: bool,
    pub device_count: u32,
    device_memory: usize,
    pub regions: Regions,
    streams: HashMap<usize, Arc<Stream>>,
    default_streams: HashMap<i32, Arc<Stream>>,
    events: HashMap<usize, Arc<Event>>,
}

/// Process-wide emulator state.
pub(crate) struct Runtime {
    state: Mutex<State>,
    next_handle: AtomicUsize,
}

fn env_number<T: std::str::FromStr>(name: &str) -> Option<T> {
    std::env::var(name).ok()?.trim().parse().ok()
}

pub(crate) fn runtime() -> &'static Runtime {
    static RUNTIME: OnceLock<Runtime> = OnceLock::new();
    RUNTIME.get_or_init(|| Runtime {
        state: Mutex::new(State {
            initialized: false,
            device_count: env_number("ASCEND_EMU_DEVICE_COUNT")
                .filter(|n| (1..=64).contains(n))
                .unwrap_or(DEFAULT_DEVICE_COUNT),
            device_memory: env_number("ASCEND_EMU_DEVICE_MEMORY").unwrap_or(DEFAULT_DEVICE_MEMORY),
            regions: Regions::default(),
            streams: HashMap::new(),
            default_streams: HashMap::new(),
            events: HashMap::new(),
        }),
        // Handles are small distinct non-null numbers; 0 stays "default stream".
        next_handle: AtomicUsize::new(0x1000),
    })
}

thread_local! {
    static CURRENT_DEVICE: Cell<Option<i32>> = const { Cell::new(None) };
}

/// The device bound to the calling thread by `aclrtSetDevice`.
pub(crate) fn current_device() -> Result<i32, Failure> {
    CURRENT_DEVICE.with(Cell::get).ok_or_else(|| {
        Failure::acl(
            ACL_ERROR_RT_CONTEXT_NULL,
            "no device is set on this thread; call aclrtSetDevice first",
        )
    })
}

/// Which kind of memory a copy argument must be.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Side {
    Device(i32),
    Host,
}

impl Runtime {
    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn new_handle(&self) -> usize {
        self.next_handle.fetch_add(0x10, Ordering::Relaxed)
    }

    /// Locks the state and checks `aclInit` has run.
    pub(crate) fn initialized(&self) -> Result<MutexGuard<'_, State>, Failure> {
        let st = self.lock();
        if !st.initialized {
            return Err(Failure::acl(
                ACL_ERROR_UNINITIALIZE,
                "aclInit has not been called (or aclFinalize has)",
            ));
        }
        Ok(st)
    }
}

impl State {
    fn check_device_id(&self, id: i32) -> Result<(), Failure> {
        if id < 0 || id as u32 >= self.device_count {
            return Err(Failure::acl(
                ACL_ERROR_RT_INVALID_DEVICEID,
                format!(
                    "device {id} does not exist; the emulator has devices 0..{}",
                    self.device_count
                ),
            ));
        }
        Ok(())
    }

    /// Checks that `[addr, addr+len)` is memory of the kind `side` names and
    /// returns its allocation when the emulator knows it. Ordinary host memory
    /// (not from aclrtMallocHost) is accepted unchecked, as on real hardware.
    pub(crate) fn check_range(
        &self,
        what: &str,
        addr: usize,
        len: usize,
        side: Side,
    ) -> Result<Option<Arc<Region>>, Failure> {
        let bad = |msg: String| Failure::acl(ACL_ERROR_RT_PARAM_INVALID, msg);
        match (self.regions.lookup(addr, len), side) {
            (Lookup::Inside(r), Side::Device(d)) => match r.placement {
                Placement::Device(owner) if owner == d => Ok(Some(r)),
                Placement::Device(owner) => Err(bad(format!(
                    "{what} {addr:#x} is memory of device {owner}, but the operation runs on device {d}"
                ))),
                Placement::Host => Err(bad(format!(
                    "{what} {addr:#x} is pinned host memory, but the copy kind needs device memory"
                ))),
            },
            (Lookup::Inside(r), Side::Host) => match r.placement {
                Placement::Host => Ok(Some(r)),
                Placement::Device(owner) => Err(bad(format!(
                    "{what} {addr:#x} is memory of device {owner}, but the copy kind needs host memory"
                ))),
            },
            (Lookup::Overruns(r), _) => Err(bad(format!(
                "{what} range [{addr:#x}, +{len}) runs past the end of {}",
                r.describe()
            ))),
            (Lookup::Unknown, Side::Device(d)) => Err(bad(format!(
                "{what} {addr:#x} (+{len}) is not device memory of device {d} (not from aclrtMalloc, or already freed)"
            ))),
            (Lookup::Unknown, Side::Host) => Ok(None),
        }
    }

    /// Resolves a stream handle; 0 is the current device's default stream.
    pub(crate) fn stream(&mut self, handle: usize) -> Result<Arc<Stream>, Failure> {
        if handle == 0 {
            let device = current_device()?;
            if let Some(s) = self.default_streams.get(&device) {
                return Ok(s.clone());
            }
            let s = Stream::start(device).map_err(|e| {
                Failure::acl(
                    ACL_ERROR_RT_INTERNAL_ERROR,
                    format!("cannot start stream: {e}"),
                )
            })?;
            self.default_streams.insert(device, s.clone());
            return Ok(s);
        }
        self.streams.get(&handle).cloned().ok_or_else(|| {
            Failure::acl(
                ACL_ERROR_RT_INVALID_HANDLE,
                format!("{handle:#x} is not a live stream"),
            )
        })
    }

    fn event(&self, handle: usize) -> Result<Arc<Event>, Failure> {
        self.events.get(&handle).cloned().ok_or_else(|| {
            Failure::acl(
                ACL_ERROR_RT_INVALID_HANDLE,
                format!("{handle:#x} is not a live event"),
            )
        })
    }
}

/// A stream used from a thread bound to a different device is an error on
/// the real runtime too (the stream belongs to another context).
pub(crate) fn check_stream_context(stream: &Stream) -> Result<(), Failure> {
    let current = current_device()?;
    if current != stream.device {
        return Err(Failure::acl(
            ACL_ERROR_RT_STREAM_CONTEXT,
            format!(
                "stream belongs to device {}, but this thread's current device is {current}",
                stream.device
            ),
        ));
    }
    Ok(())
}

pub(crate) fn init(config: Option<&CStr>) -> Result<(), Failure> {
    let mut st = runtime().lock();
    if st.initialized {
        return Err(Failure::acl(
            ACL_ERROR_REPEAT_INITIALIZE,
            "aclInit was already called in this process",
        ));
    }
    if let Some(path) = config
        .map(|c| c.to_string_lossy())
        .filter(|p| !p.is_empty())
    {
        if !std::path::Path::new(path.as_ref()).is_file() {
            return Err(Failure::acl(
                ACL_ERROR_INVALID_FILE,
                format!("config file {path} does not exist"),
            ));
        }
    }
    st.initialized = true;
    Ok(())
}

pub(crate) fn finalize() -> Result<(), Failure> {
    let mut st = runtime().lock();
    if !st.initialized {
        return Err(Failure::acl(
            ACL_ERROR_REPEAT_FINALIZE,
            "aclFinalize without a matching aclInit",
        ));
    }
    st.initialized = false;
    Ok(())
}

pub(crate) fn set_device(id: i32) -> Result<(), Failure> {
    runtime().initialized()?.check_device_id(id)?;
    CURRENT_DEVICE.with(|c| c.set(Some(id)));
    Ok(())
}

/// Unbinds the device from the calling thread. Memory stays allocated until
/// freed (the emulator does not tear down a device's resources).
pub(crate) fn reset_device(id: i32) -> Result<(), Failure> {
    runtime().initialized()?.check_device_id(id)?;
    CURRENT_DEVICE.with(|c| {
        if c.get() == Some(id) {
            c.set(None);
        }
    });
    Ok(())
}

pub(crate) fn device_count() -> Result<u32, Failure> {
    Ok(runtime().initialized()?.device_count)
}

fn allocate(size: usize, placement: Placement) -> Result<usize, Failure> {
    let rt = runtime();
    let mut st = rt.initialized()?;
    if size == 0 {
        return Err(Failure::acl(
            ACL_ERROR_INVALID_PARAM,
            "size must be positive",
        ));
    }
    if let Placement::Device(d) = placement {
        let used = st.regions.device_bytes(d);
        if used.saturating_add(size) > st.device_memory {
            return Err(Failure::acl(
                ACL_ERROR_RT_MEMORY_ALLOCATION,
                format!(
                    "device {d} out of memory: {size} bytes requested, {} of {} bytes free",
                    st.device_memory - used.min(st.device_memory),
                    st.device_memory
                ),
            ));
        }
    }
    let region = Region::create(rt.new_handle() as u64, size, placement).map_err(|e| {
        Failure::acl(
            ACL_ERROR_RT_MEMORY_ALLOCATION,
            format!("cannot map {size} bytes of shared memory: {e}"),
        )
    })?;
    let base = region.base;
    st.regions.insert(Arc::new(region));
    Ok(base)
}

pub(crate) fn malloc(size: usize, policy: u32) -> Result<usize, Failure> {
    if policy & 0xff > 5 {
        return Err(Failure::acl(
            ACL_ERROR_INVALID_PARAM,
            format!("unknown allocation policy {policy:#x}"),
        ));
    }
    let device = current_device()?;
    allocate(size, Placement::Device(device))
}

pub(crate) fn malloc_host(size: usize) -> Result<usize, Failure> {
    allocate(size, Placement::Host)
}

fn release(ptr: usize, want: Placement) -> Result<(), Failure> {
    let mut st = runtime().initialized()?;
    if ptr == 0 {
        return Err(Failure::acl(ACL_ERROR_INVALID_PARAM, "pointer is NULL"));
    }
    let (call, other) = match want {
        Placement::Host => ("aclrtFreeHost", "aclrtFree"),
        Placement::Device(_) => ("aclrtFree", "aclrtFreeHost"),
    };
    let found = st.regions.get_base(ptr).map(|r| r.placement);
    match found {
        Some(Placement::Host) if want == Placement::Host => {}
        Some(Placement::Device(_)) if want != Placement::Host => {}
        Some(_) => {
            return Err(Failure::acl(
                ACL_ERROR_RT_PARAM_INVALID,
                format!("{ptr:#x} was not allocated for {call}; release it with {other}"),
            ))
        }
        None => {
            let msg = match st.regions.lookup(ptr, 1) {
                Lookup::Inside(r) | Lookup::Overruns(r) => format!(
                    "{ptr:#x} points inside {} but is not its start",
                    r.describe()
                ),
                Lookup::Unknown => {
                    format!("{ptr:#x} is not a live allocation (never allocated, or already freed)")
                }
            };
            return Err(Failure::acl(ACL_ERROR_RT_PARAM_INVALID, msg));
        }
    }
    // Tasks still queued on a stream hold their own Arc, so the pages stay
    // mapped until they have run.
    st.regions.remove_base(ptr);
    Ok(())
}

pub(crate) fn free(ptr: usize) -> Result<(), Failure> {
    release(ptr, Placement::Device(-1))
}

pub(crate) fn free_host(ptr: usize) -> Result<(), Failure> {
    release(ptr, Placement::Host)
}

/// Validates a copy and returns it plus the allocations it touches.
fn plan_copy(
    st: &State,
    dst: usize,
    dst_max: usize,
    src: usize,
    count: usize,
    kind: u32,
    device: Option<i32>,
) -> Result<(Copy, Vec<Arc<dyn Any + Send + Sync>>), Failure> {
    if dst == 0 || src == 0 {
        return Err(Failure::acl(
            ACL_ERROR_INVALID_PARAM,
            "source or destination is NULL",
        ));
    }
    if count > dst_max {
        return Err(Failure::acl(
            ACL_ERROR_RT_PARAM_INVALID,
            format!("count {count} exceeds destMax {dst_max}"),
        ));
    }
    let need_device = || {
        device.ok_or_else(|| {
            Failure::acl(
                ACL_ERROR_RT_CONTEXT_NULL,
                "no device is set on this thread; call aclrtSetDevice first",
            )
        })
    };
    let (dst_side, src_side) = match kind {
        MEMCPY_HOST_TO_HOST => (Side::Host, Side::Host),
        MEMCPY_HOST_TO_DEVICE => (Side::Device(need_device()?), Side::Host),
        MEMCPY_DEVICE_TO_HOST => (Side::Host, Side::Device(need_device()?)),
        MEMCPY_DEVICE_TO_DEVICE => {
            let d = need_device()?;
            (Side::Device(d), Side::Device(d))
        }
        other => {
            return Err(Failure::acl(
                ACL_ERROR_RT_PARAM_INVALID,
                format!("unknown copy kind {other}"),
            ))
        }
    };
    let d = st.check_range("destination", dst, count, dst_side)?;
    let s = st.check_range("source", src, count, src_side)?;
    let keep: Vec<Arc<dyn Any + Send + Sync>> = d
        .into_iter()
        .chain(s)
        .map(|r| r as Arc<dyn Any + Send + Sync>)
        .collect();
    Ok((
        Copy {
            dst,
            src,
            len: count,
        },
        keep,
    ))
}

pub(crate) fn memcpy(
    dst: usize,
    dst_max: usize,
    src: usize,
    count: usize,
    kind: u32,
) -> Result<(), Failure> {
    let st = runtime().initialized()?;
    let device = current_device().ok();
    let (copy, keep) = plan_copy(&st, dst, dst_max, src, count, kind, device)?;
    drop(st);
    // SAFETY: plan_copy checked both ranges against live allocations of the
    // right kind (host memory the emulator does not own is the caller's
    // responsibility, as with the real runtime); `keep` pins them mapped.
    unsafe { std::ptr::copy(copy.src as *const u8, copy.dst as *mut u8, copy.len) };
    drop(keep);
    Ok(())
}

pub(crate) fn memcpy_async(
    dst: usize,
    dst_max: usize,
    src: usize,
    count: usize,
    kind: u32,
    stream: usize,
) -> Result<(), Failure> {
    let mut st = runtime().initialized()?;
    let stream = st.stream(stream)?;
    check_stream_context(&stream)?;
    let (copy, keep) = plan_copy(&st, dst, dst_max, src, count, kind, Some(stream.device))?;
    drop(st);
    if let Some((f, _)) = crate::fault::strike(&copy, crate::fault::FaultPoint::Queue) {
        return Err(f);
    }
    stream.submit(Task::Copies {
        copies: vec![copy],
        keep,
        // Local copies are not on the modeled link.
        pace: std::time::Duration::ZERO,
        fault: crate::fault::strike(&copy, crate::fault::FaultPoint::Run).map(|(f, _)| f),
    })?;
    if let Some((f, times)) = crate::fault::strike(&copy, crate::fault::FaultPoint::Sync) {
        stream.arm_sync_fault(f, times);
    }
    Ok(())
}

pub(crate) fn memset(ptr: usize, max: usize, value: i32, count: usize) -> Result<(), Failure> {
    let st = runtime().initialized()?;
    if ptr == 0 {
        return Err(Failure::acl(ACL_ERROR_INVALID_PARAM, "pointer is NULL"));
    }
    if count > max {
        return Err(Failure::acl(
            ACL_ERROR_RT_PARAM_INVALID,
            format!("count {count} exceeds maxCount {max}"),
        ));
    }
    let region = match st.regions.lookup(ptr, count) {
        Lookup::Inside(r) if r.placement == Placement::Host => r,
        _ => st
            .check_range("target", ptr, count, Side::Device(current_device()?))?
            .expect("device ranges are always known allocations"),
    };
    drop(st);
    // SAFETY: the range lies inside a live allocation held by `region`.
    unsafe { std::ptr::write_bytes(ptr as *mut u8, value as u8, count) };
    drop(region);
    Ok(())
}

pub(crate) fn create_stream() -> Result<usize, Failure> {
    let rt = runtime();
    let mut st = rt.initialized()?;
    let device = current_device()?;
    let stream = Stream::start(device).map_err(|e| {
        Failure::acl(
            ACL_ERROR_RT_INTERNAL_ERROR,
            format!("cannot start stream: {e}"),
        )
    })?;
    let handle = rt.new_handle();
    st.streams.insert(handle, stream);
    Ok(handle)
}

pub(crate) fn destroy_stream(handle: usize) -> Result<(), Failure> {
    let mut st = runtime().initialized()?;
    let stream = st.streams.remove(&handle).ok_or_else(|| {
        Failure::acl(
            ACL_ERROR_RT_INVALID_HANDLE,
            format!("{handle:#x} is not a live stream"),
        )
    })?;
    stream.close();
    Ok(())
}

pub(crate) fn synchronize_stream(handle: usize) -> Result<(), Failure> {
    let stream = runtime().initialized()?.stream(handle)?;
    stream.synchronize()
}

pub(crate) fn create_event() -> Result<usize, Failure> {
    let rt = runtime();
    let mut st = rt.initialized()?;
    let handle = rt.new_handle();
    st.events.insert(handle, Arc::new(Event::default()));
    Ok(handle)
}

pub(crate) fn destroy_event(handle: usize) -> Result<(), Failure> {
    let mut st = runtime().initialized()?;
    st.events.remove(&handle).map(drop).ok_or_else(|| {
        Failure::acl(
            ACL_ERROR_RT_INVALID_HANDLE,
            format!("{handle:#x} is not a live event"),
        )
    })
}

pub(crate) fn record_event(event: usize, stream: usize) -> Result<(), Failure> {
    let mut st = runtime().initialized()?;
    let event = st.event(event)?;
    let stream = st.stream(stream)?;
    check_stream_context(&stream)?;
    drop(st);
    if let Some(f) = stream.sync_fault() {
        event.arm_sync_fault(f);
    }
    let seq = event.begin_record();
    let queued = stream.submit(Task::Record {
        event: event.clone(),
        seq,
    });
    if queued.is_err() {
        event.complete(seq);
    }
    queued
}

pub(crate) fn query_event(event: usize) -> Result<u32, Failure> {
    let event = runtime().initialized()?.event(event)?;
    Ok(if event.is_complete() {
        EVENT_COMPLETE
    } else {
        EVENT_NOT_READY
    })
}

pub(crate) fn synchronize_event(event: usize) -> Result<(), Failure> {
    let event = runtime().initialized()?.event(event)?;
    if let Some(f) = event.take_sync_fault() {
        return Err(f);
    }
    let seq = event.latest();
    event.wait_for(seq);
    event.failure_at(seq).map_or(Ok(()), Err)
}

pub(crate) fn stream_wait_event(stream: usize, event: usize) -> Result<(), Failure> {
    let mut st = runtime().initialized()?;
    let event = st.event(event)?;
    let stream = st.stream(stream)?;
    check_stream_context(&stream)?;
    drop(st);
    let seq = event.latest();
    stream.submit(Task::Wait { event, seq })
}
