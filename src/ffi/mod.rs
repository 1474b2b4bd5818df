//! The C ABI (`include/ascend_pd.h`, generated from this module by
//! cbindgen and checked in CI).
//!
//! Conventions, for every function:
//! - it returns a status (`APD_OK` or an `APD_ERR_*` code); on failure
//!   [`apd_last_error`] gives the library's message, which names the
//!   argument or the problem and the fix;
//! - no panic crosses the boundary (a panic is `APD_ERR_INTERNAL`);
//! - every pointer and length is checked before use: a null pointer with a
//!   non-zero length, a non-UTF-8 string, a length beyond the data are
//!   `APD_ERR_INVALID_ARGUMENT`;
//! - objects are handles (an id in a typed struct): a handle that was
//!   closed, never opened, or is of another kind gives `APD_ERR_CLOSED`,
//!   never undefined behaviour.
//!
//! Threading: every function may be called from any thread, concurrently,
//! on the same or different handles; the log callback is called from the
//! library's threads, possibly concurrently.

mod handles;
mod log_bridge;

use crate::backend::{lock, BackendError, SenderTimeouts, TransferSpec};
use crate::config::{PdConfig, PortList, Role};
use crate::kv::{KvCache, KvCacheSpec, KvStrides, KvTensor};
use crate::layout::{Dtype, MemFormat};
use crate::memory::DualStats;
use crate::requests::{
    Availability, CancelState, Completion, LoadQueue, LoadRequest, Outcome, SaveQueue, SaveRequest,
    SharedKvCache,
};
use crate::{Receiver, Sender};
use handles::{Object, ReceiverObj, SenderObj};
use std::cell::RefCell;
use std::ffi::{c_char, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Receives one log record: its level (1 error … 5 trace), its module and
/// its message (NUL-terminated, valid during the call), and the
/// `user_data` given to `apd_set_log_callback`. NULL means none.
pub type ApdLogCallback = Option<
    unsafe extern "C" fn(
        level: i32,
        target: *const c_char,
        message: *const c_char,
        user_data: *mut c_void,
    ),
>;

/// The version of this ABI; bumped on any incompatible change.
pub const APD_ABI_VERSION: u32 = 2;

/// Success.
pub const APD_OK: i32 = 0;
/// A pointer, length, string or value passed in is unusable (the message names it).
pub const APD_ERR_INVALID_ARGUMENT: i32 = 1;
/// The configuration is invalid (the message lists every problem).
pub const APD_ERR_CONFIG: i32 = 2;
/// The handle is closed, was never opened, or is of another kind.
pub const APD_ERR_CLOSED: i32 = 3;
/// A transfer, socket or peer failed.
pub const APD_ERR_BACKEND: i32 = 4;
/// A KV cache operation failed (geometry, device).
pub const APD_ERR_KV_CACHE: i32 = 5;
/// The queue is full; poll finished requests and retry.
pub const APD_ERR_BUSY: i32 = 6;
/// A bug in the library (a panic was caught); the message says where.
pub const APD_ERR_INTERNAL: i32 = 7;

/// Chunk memory format `KV_2LTD` (K and V planes), as on the wire.
pub const APD_FMT_KV_2LTD: i32 = 1;
/// Chunk memory format MLA (one latent plane per layer), as on the wire.
pub const APD_FMT_MLA: i32 = 6;

/// `bfloat16`.
pub const APD_DTYPE_BFLOAT16: i32 = 0;
/// `float16`.
pub const APD_DTYPE_FLOAT16: i32 = 1;
/// `float32`.
pub const APD_DTYPE_FLOAT32: i32 = 2;
/// `int8`.
pub const APD_DTYPE_INT8: i32 = 3;
/// `uint8`.
pub const APD_DTYPE_UINT8: i32 = 4;

/// `ApdKvCacheDesc::device` of a host (CPU) cache.
pub const APD_DEVICE_CPU: i32 = -1;

/// The request's save or load completed.
pub const APD_REQ_DONE: i32 = 0;
/// It failed; `ApdCompletion::message` says why.
pub const APD_REQ_FAILED: i32 = 1;
/// It was cancelled.
pub const APD_REQ_CANCELLED: i32 = 2;

/// The request had not started; it will be reported as cancelled.
pub const APD_CANCEL_NOT_STARTED: i32 = 0;
/// The request is running; it will be reported as cancelled when it ends.
pub const APD_CANCEL_CANCELLING: i32 = 1;
/// The request had already ended; what it left behind is being released.
pub const APD_CANCEL_ALREADY_ENDED: i32 = 2;
/// No request with this id is known.
pub const APD_CANCEL_UNKNOWN: i32 = 3;

/// Bytes of `ApdCompletion::req_id`, NUL included: request ids must be shorter.
pub const APD_REQ_ID_MAX: usize = 256;
/// Bytes of `ApdCompletion::message`, NUL included (longer messages are cut).
pub const APD_MESSAGE_MAX: usize = 1024;
/// Ids of released saves that wait for `apd_sender_poll_released` before
/// the oldest are dropped.
pub const APD_RELEASED_MAX: usize = 16384;
const _: () = assert!(APD_RELEASED_MAX == crate::requests::RELEASED_MEMORY);

/// A parsed configuration.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ApdConfig {
    /// Handle id (0 is never a valid handle).
    pub id: u64,
}

/// A KV cache (the engine's memory, wrapped).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ApdKvCache {
    /// Handle id.
    pub id: u64,
}

/// A prefill worker's sender and its save queue.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ApdSender {
    /// Handle id.
    pub id: u64,
}

/// A decode worker's receiver and its load queue.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ApdReceiver {
    /// Handle id.
    pub id: u64,
}

/// One engine tensor of a KV cache.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ApdKvTensor {
    /// Base address (`tensor.data_ptr()`): host memory, or device memory
    /// for an NPU cache.
    pub addr: u64,
    /// Bytes of the tensor.
    pub bytes: u64,
}

/// The geometry and memory of an engine's KV cache.
///
/// `tensors`: 1 tensor holding the whole cache as
/// `[layers][planes][num_blocks * block_size][hidden]`, or one tensor per
/// layer and plane, `[num_blocks, block_size, hidden]` each, in the order
/// layer0.K, layer0.V, layer1.K, ... (vLLM-Ascend's per-layer K and V
/// tensors; MLA: one latent tensor per layer).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ApdKvCacheDesc {
    /// `APD_FMT_KV_2LTD` or `APD_FMT_MLA`.
    pub fmt: i32,
    /// `APD_DTYPE_*`.
    pub dtype: i32,
    /// Transformer layers.
    pub layers: u64,
    /// Blocks per tensor.
    pub num_blocks: u64,
    /// Tokens per block.
    pub block_size: u64,
    /// Elements per token (num_kv_heads × head_size, or the MLA latent size).
    pub hidden: u64,
    /// `APD_DEVICE_CPU`, or the NPU id of device memory.
    pub device: i32,
    /// The tensors (see above).
    pub tensors: *const ApdKvTensor,
    /// How many tensors.
    pub num_tensors: u64,
    /// Optional `aclrtStream` of the engine (NPU caches only), which must
    /// belong to `device` (the library cannot check that): copies are
    /// queued on it, ordered with the engine's kernels. NULL: the cache
    /// uses a stream of its own.
    pub stream: *mut c_void,
}

/// How one plane of each layer of an engine's KV cache lays out its
/// elements (for `apd_kv_cache_wrap_strided`, which takes one per plane of
/// a layer: K's then V's, or the MLA latent's): element (block b, token t
/// of the block, head h, element e) of the plane lives at `base +
/// b * block_stride + t * token_stride + h * head_stride + e *
/// elem_stride`. Strides are in bytes; `es` below is the element size.
///
/// - vLLM-Ascend's per-layer K and V `[num_blocks, block_size, heads, head]`
///   (and each half of a stacked `[2, num_blocks, block_size, heads, head]`):
///   `block_stride = block_size * heads * head * es`, `token_stride =
///   heads * head * es`, `head_stride = head * es`, `elem_stride = es`
///   (or 0), the same for K and V;
/// - MLA: `num_heads = 1`, `head_size` = the latent size;
/// - vLLM's CPU backend (ISAs vec and vec16), one `[num_blocks, heads,
///   block_size, 2 * head]` tensor per layer holding, per (block, head), a
///   cell of K's `block_size * head` elements stored transposed (element e
///   of token t at `e * block_size + t`), then V's token-major (at
///   `t * head + e`): both `block_stride = heads * 2 * block_size * head *
///   es`, `head_stride = 2 * block_size * head * es`; K `token_stride =
///   es`, `elem_stride = block_size * es`; V `token_stride = head * es`,
///   `elem_stride = es`. K's base is the tensor's, V's `block_size * head *
///   es` later (host caches only: every element of K is its own copy).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ApdKvStrides {
    /// KV heads per token of a plane (1 for MLA).
    pub num_heads: u64,
    /// Elements per head (the MLA latent size); `num_heads * head_size`
    /// must equal `ApdKvCacheDesc.hidden`.
    pub head_size: u64,
    /// Bytes from one block to the next.
    pub block_stride: u64,
    /// Bytes from one token of a block to the next.
    pub token_stride: u64,
    /// Bytes from one head of a token to the next.
    pub head_stride: u64,
    /// Bytes from one element of a head to the next; 0 means the element
    /// size (a head's elements contiguous).
    pub elem_stride: u64,
}

/// Where a request's KV goes: the decode worker's side-channel ports.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ApdPeer {
    /// The receiver's host (NUL-terminated).
    pub host: *const c_char,
    /// The receiver's `pd_peer_init_port` for this rank.
    pub init_port: u16,
    /// The receiver's `pd_peer_alloc_port` for this rank.
    pub alloc_port: u16,
}

/// One finished request.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ApdCompletion {
    /// The request id (NUL-terminated).
    pub req_id: [c_char; APD_REQ_ID_MAX],
    /// `APD_REQ_DONE`, `APD_REQ_FAILED` or `APD_REQ_CANCELLED`.
    pub status: i32,
    /// Why it failed (NUL-terminated; empty otherwise; cut at `APD_MESSAGE_MAX - 1` bytes).
    pub message: [c_char; APD_MESSAGE_MAX],
    /// When it ended, not when it was polled: nanoseconds of the host's
    /// `CLOCK_MONOTONIC` (Python's `time.monotonic_ns()`); 0 if unknown.
    pub ended_ns: u64,
}

/// The id of a save that no longer reads the engine's cache
/// (`apd_sender_poll_released`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ApdReqId {
    /// The request id (NUL-terminated).
    pub req_id: [c_char; APD_REQ_ID_MAX],
}

/// Page counters of a worker's pools (CPU and NPU summed).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ApdPoolStats {
    /// Pages in the pools.
    pub total: u64,
    /// Pages free.
    pub free: u64,
    /// Pages handed out (pinned and quarantined included).
    pub allocated: u64,
    /// Pages pinned for a pull.
    pub pinned: u64,
    /// Pages waiting until no peer can touch them.
    pub quarantined: u64,
}

/// A failed call: its status and message.
pub(crate) struct Failure {
    status: i32,
    message: String,
}

impl Failure {
    fn new(status: i32, message: impl Into<String>) -> Failure {
        Failure {
            status,
            message: message.into(),
        }
    }

    fn arg(name: &str, what: impl std::fmt::Display) -> Failure {
        Failure::new(
            APD_ERR_INVALID_ARGUMENT,
            format!("argument `{name}` {what}"),
        )
    }
}

impl From<BackendError> for Failure {
    fn from(e: BackendError) -> Failure {
        let status = match &e {
            BackendError::InvalidInput(_) => APD_ERR_INVALID_ARGUMENT,
            BackendError::Config(_) => APD_ERR_CONFIG,
            BackendError::Backpressure(_) => APD_ERR_BUSY,
            // A layer-wise save the engine closed early failed as a
            // transfer does: nothing of it is loadable at the receiver.
            BackendError::LayerMissing { .. } => APD_ERR_BACKEND,
            _ => APD_ERR_BACKEND,
        };
        Failure::new(status, e.to_string())
    }
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_last_error(msg: &str) {
    // A NUL inside a message would cut it short: show it instead.
    let c = CString::new(msg.replace('\0', "\\0")).unwrap_or_default();
    LAST_ERROR.with(|e| *e.borrow_mut() = c);
}

/// Runs one ABI call: its status, the thread's last error, no unwinding out.
fn call(name: &str, f: impl FnOnce() -> Result<(), Failure>) -> i32 {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => {
            set_last_error("");
            APD_OK
        }
        Ok(Err(e)) => {
            set_last_error(&format!("{name}: {}", e.message));
            e.status
        }
        Err(p) => {
            let msg = format!(
                "{name}: internal error (a bug in ascend-pd; please report it): {}",
                crate::backend::panic_text(&*p)
            );
            log::error!("{msg}");
            set_last_error(&msg);
            APD_ERR_INTERNAL
        }
    }
}

/// A NUL-terminated UTF-8 string argument.
///
/// # Safety
/// `p` is null or points to a NUL-terminated string.
unsafe fn arg_str<'a>(name: &str, p: *const c_char) -> Result<&'a str, Failure> {
    if p.is_null() {
        return Err(Failure::arg(name, "is null"));
    }
    // SAFETY: non-null and NUL-terminated by the caller's contract.
    unsafe { CStr::from_ptr(p) }
        .to_str()
        .map_err(|e| Failure::arg(name, format!("is not UTF-8: {e}")))
}

/// An array argument of `n` elements (`p` may be null only when `n` is 0).
///
/// # Safety
/// `p` is null or points to `n` readable elements.
unsafe fn arg_slice<'a, T>(name: &str, p: *const T, n: u64) -> Result<&'a [T], Failure> {
    if n == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(Failure::arg(name, format!("is null but its length is {n}")));
    }
    let n = usize::try_from(n)
        .ok()
        .filter(|n| {
            n.checked_mul(std::mem::size_of::<T>())
                .is_some_and(|b| b <= isize::MAX as usize)
        })
        .ok_or_else(|| Failure::arg(name, format!("has an impossible length {n}")))?;
    if (p as usize) % std::mem::align_of::<T>() != 0 {
        return Err(Failure::arg(name, "is not aligned for its element type"));
    }
    // SAFETY: non-null, aligned, length bounded; readable per the contract.
    Ok(unsafe { std::slice::from_raw_parts(p, n) })
}

/// An array of `n` strings.
///
/// # Safety
/// As [`arg_slice`], and each element as [`arg_str`].
unsafe fn arg_strs(name: &str, p: *const *const c_char, n: u64) -> Result<Vec<String>, Failure> {
    // SAFETY: forwarded.
    let ptrs = unsafe { arg_slice(name, p, n) }?;
    ptrs.iter()
        .enumerate()
        // SAFETY: forwarded.
        .map(|(i, &s)| unsafe { arg_str(&format!("{name}[{i}]"), s) }.map(str::to_string))
        .collect()
}

/// A struct argument passed by pointer.
///
/// # Safety
/// `p` is null or points to a valid `T`.
unsafe fn arg_ref<'a, T>(name: &str, p: *const T) -> Result<&'a T, Failure> {
    if p.is_null() {
        return Err(Failure::arg(name, "is null"));
    }
    if (p as usize) % std::mem::align_of::<T>() != 0 {
        return Err(Failure::arg(name, "is not aligned for its type"));
    }
    // SAFETY: non-null, aligned, valid per the contract.
    Ok(unsafe { &*p })
}

/// An out-parameter.
///
/// # Safety
/// `p` is null or points to writable memory for a `T`.
unsafe fn out<'a, T>(name: &str, p: *mut T) -> Result<&'a mut T, Failure> {
    if p.is_null() {
        return Err(Failure::arg(
            name,
            "is null: pass where to store the result",
        ));
    }
    if (p as usize) % std::mem::align_of::<T>() != 0 {
        return Err(Failure::arg(name, "is not aligned for its type"));
    }
    // SAFETY: non-null, aligned, writable per the contract.
    Ok(unsafe { &mut *p })
}

/// A save's or load's `req_id`, `keys` and `slot_mapping`, checked.
///
/// # Safety
/// As `arg_str`, `arg_strs` and `arg_slice` for each.
unsafe fn request_args<'a>(
    req_id: *const c_char,
    (keys, num_keys): (*const *const c_char, u64),
    (slot_mapping, num_slots): (*const i64, u64),
) -> Result<(&'a str, Vec<String>, &'a [i64]), Failure> {
    // SAFETY: forwarded to the caller's contract.
    let (id, keys, slots) = unsafe {
        (
            arg_str("req_id", req_id)?,
            arg_strs("keys", keys, num_keys)?,
            arg_slice("slot_mapping", slot_mapping, num_slots)?,
        )
    };
    req_id_arg("req_id", id)?;
    Ok((id, keys, slots))
}

fn req_id_arg(name: &str, id: &str) -> Result<(), Failure> {
    if id.is_empty() {
        return Err(Failure::arg(name, "is empty: pass the engine's request id"));
    }
    if id.len() >= APD_REQ_ID_MAX {
        return Err(Failure::arg(
            name,
            format!(
                "is {} bytes long; request ids must be shorter than APD_REQ_ID_MAX ({APD_REQ_ID_MAX})",
                id.len()
            ),
        ));
    }
    Ok(())
}

fn pool_stats(s: &DualStats) -> ApdPoolStats {
    let mut out = ApdPoolStats::default();
    for p in [&s.cpu, &s.npu].into_iter().flatten() {
        out.total += p.total as u64;
        out.free += p.free as u64;
        out.allocated += p.allocated as u64;
        out.pinned += p.pinned as u64;
        out.quarantined += p.quarantined as u64;
    }
    out
}

fn cancel_code(s: CancelState) -> i32 {
    match s {
        CancelState::NotStarted => APD_CANCEL_NOT_STARTED,
        CancelState::Cancelling => APD_CANCEL_CANCELLING,
        CancelState::AlreadyEnded => APD_CANCEL_ALREADY_ENDED,
        CancelState::Unknown => APD_CANCEL_UNKNOWN,
    }
}

/// Copies `s` into `dst` as a NUL-terminated string, cut at a character
/// boundary if it does not fit.
fn fill(dst: &mut [c_char], s: &str) {
    let mut n = s.len().min(dst.len() - 1);
    while !s.is_char_boundary(n) {
        n -= 1;
    }
    for (d, b) in dst.iter_mut().zip(s.as_bytes()[..n].iter()) {
        *d = *b as c_char;
    }
    dst[n] = 0;
}

/// A C record a poll writes, one per queued item.
trait PollRecord {
    /// What the queue reports.
    type Item;
    /// The record's C name, for errors.
    const NAME: &'static str;
    /// The record of `item`.
    fn of(item: &Self::Item) -> Self;
}

/// `at` in nanoseconds of `CLOCK_MONOTONIC` (the clock `Instant` reads on
/// Linux, and Python's `time.monotonic`); 0 if the clock cannot be read.
fn monotonic_ns(at: std::time::Instant) -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec into `ts`, which lives
    // across the call.
    if unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) } != 0 {
        return 0;
    }
    let now = u64::try_from(ts.tv_sec).unwrap_or(0) * 1_000_000_000
        + u64::try_from(ts.tv_nsec).unwrap_or(0);
    let ago = u64::try_from(
        std::time::Instant::now()
            .saturating_duration_since(at)
            .as_nanos(),
    )
    .unwrap_or(u64::MAX);
    now.saturating_sub(ago)
}

impl PollRecord for ApdCompletion {
    type Item = Completion;
    const NAME: &'static str = "ApdCompletion";

    fn of(c: &Completion) -> ApdCompletion {
        let (status, message) = match &c.outcome {
            Outcome::Done => (APD_REQ_DONE, ""),
            Outcome::Failed(m) => (APD_REQ_FAILED, m.as_str()),
            Outcome::Cancelled => (APD_REQ_CANCELLED, ""),
        };
        let mut rec = ApdCompletion {
            req_id: [0; APD_REQ_ID_MAX],
            status,
            message: [0; APD_MESSAGE_MAX],
            ended_ns: monotonic_ns(c.ended),
        };
        fill(&mut rec.req_id, &c.req_id);
        fill(&mut rec.message, message);
        rec
    }
}

impl PollRecord for ApdReqId {
    type Item = String;
    const NAME: &'static str = "ApdReqId";

    fn of(id: &String) -> ApdReqId {
        let mut rec = ApdReqId {
            req_id: [0; APD_REQ_ID_MAX],
        };
        fill(&mut rec.req_id, id);
        rec
    }
}

/// Writes up to `capacity` items of `backlog` (plus new ones from `fresh`)
/// to `out`; the rest wait for the next poll.
///
/// # Safety
/// `out` is null or points to `capacity` writable records.
unsafe fn poll_into<R: PollRecord>(
    backlog: &Mutex<std::collections::VecDeque<R::Item>>,
    fresh: impl FnOnce() -> Vec<R::Item>,
    out_ptr: *mut R,
    capacity: u64,
    count: *mut u64,
) -> Result<(), Failure> {
    // Every argument is checked before anything is taken from the queue,
    // so a bad call loses no completion.
    // SAFETY: forwarded.
    let count = unsafe { out("count", count) }?;
    if capacity > 0 && out_ptr.is_null() {
        return Err(Failure::arg(
            "out",
            format!("is null but capacity is {capacity}"),
        ));
    }
    if (out_ptr as usize) % std::mem::align_of::<R>() != 0 {
        return Err(Failure::arg(
            "out",
            format!("is not aligned for {}", R::NAME),
        ));
    }
    let cap = usize::try_from(capacity).unwrap_or(usize::MAX);
    let mut backlog = lock(backlog);
    // Taken from the queue only when needed: what the caller does not
    // take waits there, within the queue's bounds.
    if backlog.len() < cap {
        backlog.extend(fresh());
    }
    let n = backlog.len().min(cap);
    for i in 0..n {
        let rec = R::of(&backlog.pop_front().expect("n <= len"));
        // SAFETY: i < capacity; `out_ptr` points to `capacity` records.
        unsafe { out_ptr.add(i).write(rec) };
    }
    *count = n as u64;
    Ok(())
}

// ------------------------------------------------------------------ misc

/// The ABI version of the loaded library (`APD_ABI_VERSION` of its header).
#[no_mangle]
pub extern "C" fn apd_abi_version() -> u32 {
    APD_ABI_VERSION
}

/// The message of the last failed call on this thread ("" after a call
/// that succeeded). Valid until the next `apd_*` call on this thread;
/// never NULL.
#[no_mangle]
pub extern "C" fn apd_last_error() -> *const c_char {
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}

/// Routes the library's log records to `callback` (NULL: stop logging),
/// up to `max_level` (1 error, 2 warn, 3 info, 4 debug, 5 trace). The
/// callback gets the level, the module and the message (NUL-terminated,
/// valid during the call) and `user_data`; it may be called from any of
/// the library's threads, concurrently. A record being delivered when the
/// callback is replaced may still reach the old one: keep it (and
/// `user_data`) valid for the life of the process. Install it before
/// parsing a config to see the config's warnings (without a callback
/// nothing is logged). Fails if the process already has a Rust logger (a
/// Rust host configures logging through `log` instead).
#[no_mangle]
pub extern "C" fn apd_set_log_callback(
    callback: ApdLogCallback,
    user_data: *mut c_void,
    max_level: i32,
) -> i32 {
    call("apd_set_log_callback", || {
        log_bridge::set(callback, user_data, max_level)
    })
}

// ---------------------------------------------------------------- config

fn store_config(
    loaded: Result<crate::config::LoadedConfig, crate::ConfigError>,
) -> Result<u64, Failure> {
    let loaded = loaded.map_err(|e| Failure::new(APD_ERR_CONFIG, e.to_string()))?;
    for w in &loaded.warnings {
        log::warn!("config: {w}");
    }
    Ok(handles::insert(Object::Config(Arc::new(loaded.config))))
}

/// Parses and validates a YAML configuration (LMCache-style keys, see
/// docs/configuration.md) into `*out`.
///
/// # Safety
/// `yaml` is a NUL-terminated string; `out` points to writable memory.
#[no_mangle]
pub unsafe extern "C" fn apd_config_from_yaml(
    yaml: *const c_char,
    out_config: *mut ApdConfig,
) -> i32 {
    call("apd_config_from_yaml", || {
        // SAFETY: forwarded to the caller's contract.
        let (text, o) = unsafe { (arg_str("yaml", yaml)?, out("out_config", out_config)?) };
        o.id = store_config(PdConfig::from_yaml_str(text, "<yaml from the C ABI>"))?;
        Ok(())
    })
}

/// Reads, parses and validates a YAML configuration file into `*out`.
///
/// # Safety
/// `path` is a NUL-terminated string; `out` points to writable memory.
#[no_mangle]
pub unsafe extern "C" fn apd_config_from_file(
    path: *const c_char,
    out_config: *mut ApdConfig,
) -> i32 {
    call("apd_config_from_file", || {
        // SAFETY: forwarded to the caller's contract.
        let (p, o) = unsafe { (arg_str("path", path)?, out("out_config", out_config)?) };
        o.id = store_config(PdConfig::load(p))?;
        Ok(())
    })
}

/// Tokens per chunk of the configuration (`chunk_size`): a request of N
/// tokens has ceil(N / chunk_size) keys.
///
/// # Safety
/// `out` points to writable memory.
#[no_mangle]
pub unsafe extern "C" fn apd_config_chunk_size(config: ApdConfig, out_tokens: *mut u64) -> i32 {
    call("apd_config_chunk_size", || {
        let c = handles::config(config.id)?;
        // SAFETY: forwarded to the caller's contract.
        *unsafe { out("out_tokens", out_tokens) }? = c.chunk_size as u64;
        Ok(())
    })
}

/// Frees a configuration (senders and receivers started from it keep
/// their copy).
#[no_mangle]
pub extern "C" fn apd_config_free(config: ApdConfig) -> i32 {
    call("apd_config_free", || {
        handles::remove_config(config.id).map(drop)
    })
}

// -------------------------------------------------------------- kv cache

fn dtype_of(code: i32) -> Result<Dtype, Failure> {
    Ok(match code {
        APD_DTYPE_BFLOAT16 => Dtype::BFloat16,
        APD_DTYPE_FLOAT16 => Dtype::Float16,
        APD_DTYPE_FLOAT32 => Dtype::Float32,
        APD_DTYPE_INT8 => Dtype::Int8,
        APD_DTYPE_UINT8 => Dtype::UInt8,
        other => {
            return Err(Failure::arg(
                "desc.dtype",
                format!("is {other}, not an APD_DTYPE_* value (0 to 4)"),
            ))
        }
    })
}

fn dim(name: &str, v: u64) -> Result<usize, Failure> {
    match usize::try_from(v) {
        Ok(0) | Err(_) => Err(Failure::arg(name, format!("is {v}; it must be at least 1"))),
        Ok(n) => Ok(n),
    }
}

/// The geometry of `desc`, checked.
fn desc_spec(d: &ApdKvCacheDesc) -> Result<KvCacheSpec, Failure> {
    let fmt = match MemFormat::from_code(d.fmt as i64) {
        Some(f) => f,
        None => {
            return Err(Failure::arg(
                "desc.fmt",
                format!("is {}, not APD_FMT_KV_2LTD (1) or APD_FMT_MLA (6)", d.fmt),
            ))
        }
    };
    Ok(KvCacheSpec {
        fmt,
        layers: dim("desc.layers", d.layers)?,
        num_blocks: dim("desc.num_blocks", d.num_blocks)?,
        block_size: dim("desc.block_size", d.block_size)?,
        hidden: dim("desc.hidden", d.hidden)?,
        dtype: dtype_of(d.dtype)?,
    })
}

/// `strides[i]` read and checked against the geometry's `hidden` (the
/// rest is [`KvStrides::check`]'s, at wrap); `elem_stride` 0 is the
/// element size.
fn strides_of(st: &ApdKvStrides, i: usize, spec: &KvCacheSpec) -> Result<KvStrides, Failure> {
    let name = |field: &str| format!("strides[{i}].{field}");
    let bytes = |field: &str, v: u64| {
        usize::try_from(v).map_err(|_| {
            Failure::arg(
                &name(field),
                format!("is {v}, beyond this platform's addresses"),
            )
        })
    };
    let strides = KvStrides {
        num_heads: dim(&name("num_heads"), st.num_heads)?,
        head_size: dim(&name("head_size"), st.head_size)?,
        block_stride: bytes("block_stride", st.block_stride)?,
        token_stride: bytes("token_stride", st.token_stride)?,
        head_stride: bytes("head_stride", st.head_stride)?,
        elem_stride: match st.elem_stride {
            0 => spec.dtype.size(),
            v => bytes("elem_stride", v)?,
        },
    };
    if strides.num_heads.checked_mul(strides.head_size) != Some(spec.hidden) {
        return Err(Failure::arg(
            "desc.hidden",
            format!(
                "is {} but strides[{i}].num_heads × strides[{i}].head_size is {} × {}: hidden \
                 is the elements of one token of a plane, num_heads × head_size",
                spec.hidden, strides.num_heads, strides.head_size
            ),
        ));
    }
    Ok(strides)
}

/// `strides` (one per plane of a layer, or one shared), read and checked
/// against `spec`.
fn plane_strides_of(
    strides: &[ApdKvStrides],
    spec: &KvCacheSpec,
) -> Result<Vec<KvStrides>, Failure> {
    let planes = spec.planes();
    if strides.len() != 1 && strides.len() != planes {
        return Err(Failure::arg(
            "num_strides",
            format!(
                "is {}: pass {}",
                strides.len(),
                if planes == 2 {
                    "2 (K's strides, then V's) or 1 (shared by K and V)"
                } else {
                    "1 (the MLA latent's strides)"
                }
            ),
        ));
    }
    strides
        .iter()
        .enumerate()
        .map(|(i, st)| strides_of(st, i, spec))
        .collect()
}

/// Wraps `desc`'s memory (laid out by `strides`, or as `apd_kv_cache_wrap`
/// describes without them) into a cache handle in `o`.
///
/// # Safety
/// `d.tensors` is null or points to `d.num_tensors` readable entries, each
/// naming memory that stays allocated until the cache is freed.
unsafe fn wrap_desc(
    d: &ApdKvCacheDesc,
    strides: Option<&[ApdKvStrides]>,
    o: &mut ApdKvCache,
) -> Result<(), Failure> {
    let spec = desc_spec(d)?;
    let strides = strides.map(|st| plane_strides_of(st, &spec)).transpose()?;
    // SAFETY: forwarded.
    let tensors = unsafe { arg_slice("desc.tensors", d.tensors, d.num_tensors) }?;
    if tensors.is_empty() {
        return Err(Failure::arg(
            "desc.tensors",
            "is empty: pass the cache's tensors",
        ));
    }
    let tensors: Vec<KvTensor> = tensors
        .iter()
        .map(|t| KvTensor {
            addr: t.addr,
            bytes: usize::try_from(t.bytes).unwrap_or(usize::MAX),
        })
        .collect();
    let kv = |e: crate::KvError| {
        let arg = match e {
            crate::KvError::InvalidStrides(_) => "strides",
            _ => "desc",
        };
        Failure::new(APD_ERR_KV_CACHE, format!("{arg}: {e}"))
    };
    let cache = match d.device {
        APD_DEVICE_CPU => {
            if !d.stream.is_null() {
                return Err(Failure::arg(
                    "desc.stream",
                    "is set for a host cache: streams belong to NPU caches; pass NULL",
                ));
            }
            match strides {
                // SAFETY: the tensors are the engine's host memory, alive
                // until the cache is freed (the caller's contract).
                None => unsafe { KvCache::wrap_host(spec, &tensors) },
                // SAFETY: as above, one plane each.
                Some(st) => unsafe { KvCache::wrap_host_strided(spec, &st, &tensors) },
            }
            .map_err(kv)?
        }
        id if id >= 0 => {
            let device = crate::memory::npu::AclRuntime::load()
                .and_then(|rt| rt.device(id as u32))
                .map_err(|e| Failure::new(APD_ERR_KV_CACHE, e.to_string()))?;
            let stream = if d.stream.is_null() {
                None
            } else {
                // SAFETY: the engine's live stream on this device, per
                // the caller's contract; we never destroy it.
                Some(
                    unsafe { device.borrow_stream(d.stream.cast()) }
                        .map_err(|e| Failure::arg("desc.stream", e))?,
                )
            };
            match strides {
                // SAFETY: device memory of `device`, alive until the cache
                // is freed (the caller's contract).
                None => unsafe { KvCache::wrap_npu(&device, spec, &tensors, stream) },
                // SAFETY: as above, one plane each.
                Some(st) => unsafe {
                    KvCache::wrap_npu_strided(&device, spec, &st, &tensors, stream)
                },
            }
            .map_err(kv)?
        }
        other => {
            return Err(Failure::arg(
                "desc.device",
                format!("is {other}: pass APD_DEVICE_CPU (-1) or an NPU id (0 or more)"),
            ))
        }
    };
    o.id = handles::insert(Object::Cache(SharedKvCache::new(cache)));
    Ok(())
}

/// Wraps the engine's KV cache described by `desc` (see
/// `ApdKvCacheDesc`) into `*out`. Every tensor is checked against the
/// geometry first (non-null, aligned, large enough, no overlap); every
/// later copy stays inside them. An NPU cache needs the CANN runtime
/// (`ASCEND_PD_CANN_LIB_DIR`).
///
/// # Safety
/// `desc` points to a valid description whose tensors stay allocated
/// until `apd_kv_cache_free`; `out` points to writable memory.
#[no_mangle]
pub unsafe extern "C" fn apd_kv_cache_wrap(
    desc: *const ApdKvCacheDesc,
    out_cache: *mut ApdKvCache,
) -> i32 {
    call("apd_kv_cache_wrap", || {
        // SAFETY: forwarded to the caller's contract.
        let d = unsafe { arg_ref("desc", desc) }?;
        // SAFETY: forwarded.
        let o = unsafe { out("out_cache", out_cache) }?;
        // SAFETY: forwarded.
        unsafe { wrap_desc(d, None, o) }
    })
}

/// Wraps an engine's KV cache whose planes are laid out by strides (see
/// `ApdKvStrides`: vLLM's CPU backend with K and V in one tensor per
/// layer, per-layer or stacked K and V, MLA) into `*out_cache`.
/// `strides` holds `num_strides` entries, one per plane of a layer
/// (K's then V's; MLA: the latent's), applied to every layer; for K and V
/// one entry means both planes share it. `desc.tensors` holds exactly one
/// entry per layer and plane, in the order layer0.K, layer0.V, layer1.K,
/// ... (MLA: one latent per layer): that plane's base address and the
/// bytes available from it (to the end of its tensor). `desc.hidden` must
/// equal `num_heads * head_size`.
///
/// Checked before anything moves: no zero dimension, strides multiples of
/// the element size, no two elements of a plane sharing a byte, every
/// element of every slot inside its plane's bytes, and no byte reachable
/// from two planes (planes that share a tensor must keep to disjoint parts
/// of a cell their common strides repeat, as vLLM's CPU layout does). On
/// an NPU each token's elements must be contiguous in every plane
/// (`elem_stride = element size`, `head_stride = head_size * element
/// size`); other layouts are supported in host memory. Failures are
/// `APD_ERR_INVALID_ARGUMENT` (an unreadable argument) or
/// `APD_ERR_KV_CACHE` (a layout the library refuses), with the message in
/// `apd_last_error`.
///
/// # Safety
/// `desc` points to a valid description and `strides` to `num_strides`
/// entries; the planes stay allocated until `apd_kv_cache_free`; `out`
/// points to writable memory.
#[no_mangle]
pub unsafe extern "C" fn apd_kv_cache_wrap_strided(
    desc: *const ApdKvCacheDesc,
    strides: *const ApdKvStrides,
    num_strides: u64,
    out_cache: *mut ApdKvCache,
) -> i32 {
    call("apd_kv_cache_wrap_strided", || {
        // SAFETY: forwarded to the caller's contract.
        let d = unsafe { arg_ref("desc", desc) }?;
        // SAFETY: forwarded.
        let st = unsafe { arg_slice("strides", strides, num_strides) }?;
        // SAFETY: forwarded.
        let o = unsafe { out("out_cache", out_cache) }?;
        // SAFETY: forwarded.
        unsafe { wrap_desc(d, Some(st), o) }
    })
}

/// Frees a KV cache handle (never the engine's memory). A save or load
/// still running keeps using the cache until it ends: free the cache only
/// after its requests finished (or after closing the sender/receiver).
#[no_mangle]
pub extern "C" fn apd_kv_cache_free(cache: ApdKvCache) -> i32 {
    call("apd_kv_cache_free", || {
        handles::remove_cache(cache.id).map(drop)
    })
}

// ---------------------------------------------------------------- sender

fn role_of(c: &PdConfig, want: Role) -> Result<(), Failure> {
    if c.role == want {
        return Ok(());
    }
    Err(Failure::new(
        APD_ERR_CONFIG,
        format!(
            "argument `config` is a {} config (pd_role: {}): start a {} from a config with \
             pd_role: {}",
            c.role.name(),
            c.role.name(),
            want.name(),
            want.name()
        ),
    ))
}

/// Starts a sender for TP rank `rank` from `config` (`pd_role: sender`)
/// with its save queue.
///
/// # Safety
/// `out_sender` points to writable memory.
#[no_mangle]
pub unsafe extern "C" fn apd_sender_start(
    config: ApdConfig,
    rank: u32,
    out_sender: *mut ApdSender,
) -> i32 {
    call("apd_sender_start", || {
        // SAFETY: forwarded to the caller's contract.
        let o = unsafe { out("out_sender", out_sender) }?;
        let c = handles::config(config.id)?;
        role_of(&c, Role::Sender)?;
        let sender = Sender::start(&c, rank as usize, SenderTimeouts::default())?;
        let queue = SaveQueue::new(Arc::new(sender))?;
        o.id = handles::insert(Object::Sender(Arc::new(SenderObj::new(queue))));
        Ok(())
    })
}

/// Queues the save of request `req_id`: its chunks are gathered from
/// `cache` at `slot_mapping` (one slot per token, vLLM's; no padding
/// slot: a negative one is refused, naming its index), then sent to
/// `peer` as `keys` (one per chunk of chunk_size tokens). Returns at once;
/// `apd_sender_poll` reports the end. `is_last_prefill` != 0 sends the
/// proxy its `ProxyNotif` after the save. Every decode rank this prefill
/// rank feeds is reached at `peer`'s ports; when it feeds several (decode
/// TP larger than prefill TP), use `apd_sender_submit_save_ranks`.
///
/// # Safety
/// Strings are NUL-terminated; arrays hold their given lengths; `peer`
/// points to a valid `ApdPeer`.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn apd_sender_submit_save(
    sender: ApdSender,
    req_id: *const c_char,
    keys: *const *const c_char,
    num_keys: u64,
    cache: ApdKvCache,
    slot_mapping: *const i64,
    num_slots: u64,
    peer: *const ApdPeer,
    is_last_prefill: i32,
) -> i32 {
    call("apd_sender_submit_save", || {
        // SAFETY: forwarded to the caller's contract.
        unsafe {
            submit_save(
                sender,
                req_id,
                (keys, num_keys),
                cache,
                (slot_mapping, num_slots),
                PeerArgs::One(peer),
                is_last_prefill,
                false,
            )
        }
    })
}

/// `apd_sender_submit_save` to a decode side with several TP ranks:
/// `peers[d]` holds decode rank `d`'s ports (`num_peers` = the decode TP
/// size, `pd_peer_tp_size`), all on one host. Under heterogeneous TP each
/// decode rank this prefill rank feeds gets its head piece at its own
/// ports; a receiver answering as another rank is refused, never written.
///
/// # Safety
/// As `apd_sender_submit_save`; `peers` points to `num_peers` valid records.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn apd_sender_submit_save_ranks(
    sender: ApdSender,
    req_id: *const c_char,
    keys: *const *const c_char,
    num_keys: u64,
    cache: ApdKvCache,
    slot_mapping: *const i64,
    num_slots: u64,
    peers: *const ApdPeer,
    num_peers: u64,
    is_last_prefill: i32,
) -> i32 {
    call("apd_sender_submit_save_ranks", || {
        // SAFETY: forwarded to the caller's contract.
        unsafe {
            submit_save(
                sender,
                req_id,
                (keys, num_keys),
                cache,
                (slot_mapping, num_slots),
                PeerArgs::Ranks(peers, num_peers),
                is_last_prefill,
                false,
            )
        }
    })
}

/// The receivers of a save, as the C caller gave them: one `ApdPeer`
/// (`peer`, serving every decode rank), or one per decode TP rank
/// (`peers`, record `d` for rank `d`).
#[derive(Clone, Copy)]
enum PeerArgs {
    One(*const ApdPeer),
    Ranks(*const ApdPeer, u64),
}

/// The body of the submit and open-layered calls. `layered` opens a
/// layer-wise save instead of queueing a whole one.
///
/// # Safety
/// As the callers'.
#[allow(clippy::too_many_arguments)]
unsafe fn submit_save(
    sender: ApdSender,
    req_id: *const c_char,
    (keys, num_keys): (*const *const c_char, u64),
    cache: ApdKvCache,
    (slot_mapping, num_slots): (*const i64, u64),
    peers: PeerArgs,
    is_last_prefill: i32,
    layered: bool,
) -> Result<(), Failure> {
    let s = handles::sender(sender.id)?;
    let (what, per_rank) = match peers {
        PeerArgs::One(_) => ("peer", false),
        PeerArgs::Ranks(..) => ("peers", true),
    };
    let peers: &[ApdPeer] = match peers {
        PeerArgs::One(peer) => {
            if peer.is_null() {
                return Err(Failure::arg(
                    "peer",
                    "is null: pass the receiver's host and ports",
                ));
            }
            // SAFETY: forwarded to the caller's contract (one valid
            // `ApdPeer`); `arg_ref` checks its alignment.
            std::slice::from_ref(unsafe { arg_ref("peer", peer) }?)
        }
        PeerArgs::Ranks(peers, num_peers) => {
            if num_peers == 0 {
                return Err(Failure::arg(
                    "num_peers",
                    "is 0: pass one ApdPeer per decode TP rank",
                ));
            }
            // SAFETY: forwarded to the caller's contract.
            unsafe { arg_slice("peers", peers, num_peers) }?
        }
    };
    // SAFETY: forwarded to the caller's contract.
    let (id, keys, slots) =
        unsafe { request_args(req_id, (keys, num_keys), (slot_mapping, num_slots)) }?;
    let mut host: Option<&str> = None;
    for (d, p) in peers.iter().enumerate() {
        let name = |field: &str| match per_rank {
            true => format!("{what}[{d}]{field}"),
            false => format!("{what}{field}"),
        };
        // SAFETY: forwarded to the caller's contract.
        let h = unsafe { arg_str(&name(".host"), p.host) }?;
        if p.init_port == 0 || p.alloc_port == 0 {
            return Err(Failure::arg(
                &name(""),
                "has a zero port: pass the receiver's pd_peer_init_port and pd_peer_alloc_port",
            ));
        }
        match host {
            Some(first) if first != h => {
                return Err(Failure::arg(
                    &name(".host"),
                    format!(
                        "is {h:?}, but {what}[0].host is {first:?}: every decode rank of one \
                         save must be on one host"
                    ),
                ))
            }
            _ => host = Some(h),
        }
    }
    let host = host.expect("at least one peer, checked by the callers");
    // Each decode rank this prefill rank feeds needs its entry now, not a
    // failure at poll time.
    if per_rank {
        if let Some(d) = s
            .queue
            .sender()
            .routes()
            .iter()
            .map(|r| r.rank)
            .find(|&d| d >= peers.len())
        {
            return Err(Failure::arg(
                "num_peers",
                format!(
                    "is {}, but this prefill rank sends to decode rank {d}: pass one ApdPeer per \
                     decode TP rank (pd_peer_tp_size of them, peers[d] for rank d)",
                    peers.len()
                ),
            ));
        }
    }
    let ports = |port: fn(&ApdPeer) -> u16| match per_rank {
        true => PortList::PerRank(peers.iter().map(port).collect()),
        false => PortList::Single(port(&peers[0])),
    };
    let cache = handles::cache(cache.id)?;
    let req = SaveRequest {
        keys,
        slot_mapping: slots.to_vec(),
        spec: TransferSpec {
            req_id: id.to_string(),
            receiver_host: host.to_string(),
            receiver_init_port: ports(|p| p.init_port),
            receiver_alloc_port: ports(|p| p.alloc_port),
            is_last_prefill: is_last_prefill != 0,
            receiver_rank: None,
        },
    };
    match layered {
        true => s.queue.open_layered(req, &cache)?,
        false => s.queue.submit(req, &cache)?,
    }
    Ok(())
}

/// Queues the save of request `req_id` whose decode is not known yet
/// (router-native flow): gathered from `cache` at `slot_mapping` like any
/// save (`apd_sender_poll_released` reports it then), then parked under
/// `req_id` until a decode registers for it on this rank's registration
/// port (`apd_sender_register_port`); it then goes to that decode's
/// receiver, without the chunks the decode holds. One no decode registered
/// for within `pd_park_timeout` ends as failed (`apd_sender_poll`) and its
/// pages go back to the pool.
///
/// # Safety
/// As `apd_sender_submit_save`, without `peer`.
#[no_mangle]
pub unsafe extern "C" fn apd_sender_submit_parked_save(
    sender: ApdSender,
    req_id: *const c_char,
    keys: *const *const c_char,
    num_keys: u64,
    cache: ApdKvCache,
    slot_mapping: *const i64,
    num_slots: u64,
) -> i32 {
    call("apd_sender_submit_parked_save", || {
        let s = handles::sender(sender.id)?;
        // SAFETY: forwarded to the caller's contract.
        let (id, keys, slots) =
            unsafe { request_args(req_id, (keys, num_keys), (slot_mapping, num_slots)) }?;
        let cache = handles::cache(cache.id)?;
        let req = SaveRequest {
            keys,
            slot_mapping: slots.to_vec(),
            spec: TransferSpec {
                req_id: id.to_string(),
                receiver_host: String::new(),
                receiver_init_port: PortList::Single(0),
                receiver_alloc_port: PortList::Single(0),
                is_last_prefill: false,
                receiver_rank: None,
            },
        };
        s.queue.submit_parked(req, &cache)?;
        Ok(())
    })
}

/// `*port` = the port this sender's rank takes decode registrations on
/// (`pd_register_port[rank]`, or the free port chosen at start): what a
/// prefill's `kv_transfer_params` name for the router-native flow.
///
/// # Safety
/// `port` points to writable memory.
#[no_mangle]
pub unsafe extern "C" fn apd_sender_register_port(sender: ApdSender, port: *mut u16) -> i32 {
    call("apd_sender_register_port", || {
        let s = handles::sender(sender.id)?;
        // SAFETY: forwarded to the caller's contract.
        let o = unsafe { out("port", port) }?;
        *o = s.queue.register_port();
        Ok(())
    })
}

/// Registration counters of a sender (router-native flow).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ApdRegistrationStats {
    /// Transfers parked (gathered with no decode known yet).
    pub parked: u64,
    /// Registrations that attached a parked transfer.
    pub attached: u64,
    /// Parked transfers freed because no decode registered in time.
    pub expired: u64,
    /// Registrations answered with an error (unknown, expired, cancelled).
    pub refused: u64,
    /// Registrations dropped unanswered: forged (seal does not verify) or replayed.
    pub dropped: u64,
    /// Registrations that did not decode or named an unusable receiver.
    pub malformed: u64,
    /// Transfers parked now.
    pub parked_now: u64,
    /// Chunk pieces of attached transfers sent to their decode.
    pub chunks_sent: u64,
    /// Chunk pieces not sent because the decode's registration said it
    /// held them (its own prefix cache).
    pub chunks_skipped: u64,
}

/// Registration counters of a sender.
///
/// # Safety
/// `out` points to writable memory.
#[no_mangle]
pub unsafe extern "C" fn apd_sender_registration_stats(
    sender: ApdSender,
    out_stats: *mut ApdRegistrationStats,
) -> i32 {
    call("apd_sender_registration_stats", || {
        let s = handles::sender(sender.id)?;
        // SAFETY: forwarded to the caller's contract.
        let o = unsafe { out("out_stats", out_stats) }?;
        let r = s.queue.registration_stats();
        let p = r.parking;
        *o = ApdRegistrationStats {
            parked: p.parked,
            attached: p.attached,
            expired: p.expired,
            refused: p.refused,
            dropped: r.forged + r.replayed,
            malformed: r.malformed,
            parked_now: p.parked_now,
            chunks_sent: r.chunks_sent,
            chunks_skipped: r.chunks_skipped,
        };
        Ok(())
    })
}

/// Opens the layer-wise save of request `req_id` (push mode, usually with
/// `pd_layerwise: True`), before the engine's forward pass writes its KV:
/// the arguments are `apd_sender_submit_save`'s. The receiver allocates
/// the request's pages at once; each layer's rows of every chunk are
/// gathered from `cache` and sent as soon as the engine hands the layer
/// over (`apd_sender_save_layer`, or `apd_sender_save_layer_after` for an
/// NPU cache); the receiver holds the request only after the last layer
/// landed. End it with `apd_sender_close_layered_save`; `apd_sender_poll`
/// reports how it ended. A pull-mode sender refuses it
/// (`APD_ERR_INVALID_ARGUMENT`); so does a request id with a layer-wise
/// save still open. Under chunked prefill, open it in the step that
/// computes the request's last tokens: earlier steps already wrote every
/// layer of theirs.
///
/// # Safety
/// As `apd_sender_submit_save`.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn apd_sender_open_layered_save(
    sender: ApdSender,
    req_id: *const c_char,
    keys: *const *const c_char,
    num_keys: u64,
    cache: ApdKvCache,
    slot_mapping: *const i64,
    num_slots: u64,
    peer: *const ApdPeer,
    is_last_prefill: i32,
) -> i32 {
    call("apd_sender_open_layered_save", || {
        // SAFETY: forwarded to the caller's contract.
        unsafe {
            submit_save(
                sender,
                req_id,
                (keys, num_keys),
                cache,
                (slot_mapping, num_slots),
                PeerArgs::One(peer),
                is_last_prefill,
                true,
            )
        }
    })
}

/// `apd_sender_open_layered_save` to a decode side with several TP ranks
/// (`peers` as in `apd_sender_submit_save_ranks`): each decode rank this
/// prefill rank feeds gets every layer of its head piece.
///
/// # Safety
/// As `apd_sender_submit_save_ranks`.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn apd_sender_open_layered_save_ranks(
    sender: ApdSender,
    req_id: *const c_char,
    keys: *const *const c_char,
    num_keys: u64,
    cache: ApdKvCache,
    slot_mapping: *const i64,
    num_slots: u64,
    peers: *const ApdPeer,
    num_peers: u64,
    is_last_prefill: i32,
) -> i32 {
    call("apd_sender_open_layered_save_ranks", || {
        // SAFETY: forwarded to the caller's contract.
        unsafe {
            submit_save(
                sender,
                req_id,
                (keys, num_keys),
                cache,
                (slot_mapping, num_slots),
                PeerArgs::Ranks(peers, num_peers),
                is_last_prefill,
                true,
            )
        }
    })
}

/// A layer index argument (0 first); beyond the model's layers the save
/// refuses it, naming `kv_num_layers`.
fn layer_arg(layer: u64) -> usize {
    usize::try_from(layer).unwrap_or(usize::MAX)
}

/// Layer `layer` (0 first) of request `req_id`, whose layer-wise save is
/// open, is written in the engine's cache (a host cache, or an NPU cache
/// whose engine has waited for the layer's kernels): its rows of every
/// chunk are gathered and sent now, while the engine computes the next
/// layer. Layers may come in any order, each once. A layer index beyond
/// the model's, a layer handed over twice, or a request without an open
/// layer-wise save is `APD_ERR_INVALID_ARGUMENT`. A save that already
/// ended (it failed; `apd_sender_poll` says why) ignores it.
///
/// # Safety
/// `req_id` is NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn apd_sender_save_layer(
    sender: ApdSender,
    req_id: *const c_char,
    layer: u64,
) -> i32 {
    call("apd_sender_save_layer", || {
        let s = handles::sender(sender.id)?;
        // SAFETY: forwarded to the caller's contract.
        let id = unsafe { arg_str("req_id", req_id) }?;
        s.queue.save_layer(id, layer_arg(layer))?;
        Ok(())
    })
}

/// `apd_sender_save_layer` for an NPU cache whose engine queued layer
/// `layer`'s kernels on `stream` (its `aclrtStream`) and has not waited
/// for them: an event is recorded on `stream` now, and the layer's copies
/// run after it on the cache's own stream. A host cache, or a null
/// stream, is `APD_ERR_INVALID_ARGUMENT` (call `apd_sender_save_layer`).
///
/// # Safety
/// `req_id` is NUL-terminated; `stream` is a live `aclrtStream` of the
/// cache's NPU.
#[no_mangle]
pub unsafe extern "C" fn apd_sender_save_layer_after(
    sender: ApdSender,
    req_id: *const c_char,
    layer: u64,
    stream: *mut c_void,
) -> i32 {
    call("apd_sender_save_layer_after", || {
        let s = handles::sender(sender.id)?;
        // SAFETY: forwarded to the caller's contract.
        let id = unsafe { arg_str("req_id", req_id) }?;
        if stream.is_null() {
            return Err(Failure::arg(
                "stream",
                "is null: pass the engine's aclrtStream (for a host cache, or after waiting \
                 for the layer, call apd_sender_save_layer)",
            ));
        }
        // SAFETY: the caller's contract: `stream` is a live stream of the
        // cache's NPU (the queue checks the cache is an NPU cache).
        unsafe { s.queue.save_layer_after(id, layer_arg(layer), stream) }?;
        Ok(())
    })
}

/// Ends request `req_id`'s layer-wise save from the engine's side: no
/// more layers come. `*out_missing_layer` (if not NULL) is the first layer
/// never handed over, or -1 when every layer was. With every layer the
/// save finishes as usual; with one missing it fails (`apd_sender_poll`
/// reports `APD_REQ_FAILED`, naming the layer) and the receiver drops the
/// pages it allocated. A request without an open layer-wise save (never
/// opened, or already closed) is `APD_ERR_INVALID_ARGUMENT`.
///
/// # Safety
/// `req_id` is NUL-terminated; `out_missing_layer` is NULL or points to
/// writable memory.
#[no_mangle]
pub unsafe extern "C" fn apd_sender_close_layered_save(
    sender: ApdSender,
    req_id: *const c_char,
    out_missing_layer: *mut i64,
) -> i32 {
    call("apd_sender_close_layered_save", || {
        let s = handles::sender(sender.id)?;
        // SAFETY: forwarded to the caller's contract.
        let id = unsafe { arg_str("req_id", req_id) }?;
        let o = match out_missing_layer.is_null() {
            true => None,
            // SAFETY: non-null, so writable per the caller's contract;
            // `out` checks its alignment.
            false => Some(unsafe { out("out_missing_layer", out_missing_layer) }?),
        };
        let missing = s.queue.close_layered(id)?;
        if let Some(o) = o {
            *o = missing.map_or(-1, |l| i64::try_from(l).unwrap_or(i64::MAX));
        }
        Ok(())
    })
}

/// Writes up to `capacity` finished saves to `out` and their number to
/// `*count`; the others wait for the next poll. A done save's KV blocks
/// may be freed by the engine (any save's may once
/// `apd_sender_poll_released` reported it, usually sooner).
///
/// # Safety
/// `out` points to `capacity` writable records (may be NULL if 0);
/// `count` points to writable memory.
#[no_mangle]
pub unsafe extern "C" fn apd_sender_poll(
    sender: ApdSender,
    out_completions: *mut ApdCompletion,
    capacity: u64,
    count: *mut u64,
) -> i32 {
    call("apd_sender_poll", || {
        let s = handles::sender(sender.id)?;
        // SAFETY: forwarded to the caller's contract.
        unsafe {
            poll_into(
                &s.backlog,
                || s.queue.poll(),
                out_completions,
                capacity,
                count,
            )
        }
    })
}

/// Writes up to `capacity` ids of saves that no longer read the engine's
/// cache to `out`, and their number to `*count`; the others wait for the
/// next call. Once a save's id is reported here the engine may reuse the
/// KV blocks of its slot mapping, though its transfer may still run: the
/// final outcome (done, failed, cancelled) still comes from
/// `apd_sender_poll`. Each submitted save is reported once: when its
/// gather from the cache completed (for an NPU cache, when the device
/// copies have run); if it failed or was cancelled before or during its
/// gather, once no copy of it reads the cache any more (at the latest when
/// it ends); if cancelled before it started (or failed by
/// `apd_sender_close` before it started), at once. Ids wait until this
/// is called (`apd_sender_poll` does not take them); if more than
/// `APD_RELEASED_MAX` wait, the oldest are dropped (with a warning in the
/// log) — call this every step, or treat a save's final outcome as its
/// release too.
///
/// # Safety
/// `out` points to `capacity` writable records (may be NULL if 0);
/// `count` points to writable memory.
#[no_mangle]
pub unsafe extern "C" fn apd_sender_poll_released(
    sender: ApdSender,
    out: *mut ApdReqId,
    capacity: u64,
    count: *mut u64,
) -> i32 {
    call("apd_sender_poll_released", || {
        let s = handles::sender(sender.id)?;
        // SAFETY: forwarded to the caller's contract.
        unsafe {
            poll_into(
                &s.released_backlog,
                || s.queue.poll_cache_released(),
                out,
                capacity,
                count,
            )
        }
    })
}

/// Cancels request `req_id`; `*state` tells what was found
/// (`APD_CANCEL_*`). The receiver is told to drop what it holds of the
/// request (in the background).
///
/// # Safety
/// `req_id` is NUL-terminated; `state` points to writable memory.
#[no_mangle]
pub unsafe extern "C" fn apd_sender_cancel(
    sender: ApdSender,
    req_id: *const c_char,
    state: *mut i32,
) -> i32 {
    call("apd_sender_cancel", || {
        let s = handles::sender(sender.id)?;
        // SAFETY: forwarded to the caller's contract.
        let (id, st) = unsafe { (arg_str("req_id", req_id)?, out("state", state)?) };
        *st = cancel_code(s.queue.cancel(id));
        Ok(())
    })
}

/// Page counters of the sender's pools.
///
/// # Safety
/// `out` points to writable memory.
#[no_mangle]
pub unsafe extern "C" fn apd_sender_pool_stats(
    sender: ApdSender,
    out_stats: *mut ApdPoolStats,
) -> i32 {
    call("apd_sender_pool_stats", || {
        let s = handles::sender(sender.id)?;
        // SAFETY: forwarded to the caller's contract.
        *unsafe { out("out_stats", out_stats) }? =
            pool_stats(&s.queue.sender().allocator().stats());
        Ok(())
    })
}

/// Waits up to `timeout_ms` until no pull is pending (pull modes: every
/// receiver's PullDoneSignal arrived, so every pinned page is free);
/// `*drained` is 1 if none is left. Call before close for a clean stop.
///
/// # Safety
/// `drained` points to writable memory.
#[no_mangle]
pub unsafe extern "C" fn apd_sender_drain(
    sender: ApdSender,
    timeout_ms: u64,
    drained: *mut i32,
) -> i32 {
    call("apd_sender_drain", || {
        let s = handles::sender(sender.id)?;
        // SAFETY: forwarded to the caller's contract.
        let d = unsafe { out("drained", drained) }?;
        *d = i32::from(s.queue.sender().drain(Duration::from_millis(timeout_ms)));
        Ok(())
    })
}

/// How a drain before close ended (`apd_sender_drain_close`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ApdDrainReport {
    /// 1: every save, parked save and pull ended within the bound.
    pub drained: i32,
    /// Milliseconds waited.
    pub waited_ms: u64,
    /// Saves still queued or running at the bound (failed by the close).
    pub saves_left: u64,
    /// Parked saves no decode registered for by the bound (cancelled).
    pub parked_cancelled: u64,
    /// Requests with a pull pending at the bound (cancelled at their
    /// receiver, whose loads of them fail at once).
    pub pulls_cancelled: u64,
}

/// `timeout_ms` of `apd_sender_drain_close` that means the sender's
/// `pd_drain_timeout`.
pub const APD_DRAIN_CONFIGURED: u64 = u64::MAX;

/// Drains, then closes the sender (a rolling restart's clean stop): new
/// saves are refused at once, saves in flight, parked saves a decode
/// registers for meanwhile and pending pulls get up to `timeout_ms`
/// (`APD_DRAIN_CONFIGURED`: the config's `pd_drain_timeout`) to end; at the
/// bound what is left is cancelled (receivers are told, so their loads
/// fail at once), then the sender closes as `apd_sender_close`.
/// `*out_report` (may be NULL) says how the drain ended. The handle is
/// invalid afterwards.
///
/// # Safety
/// `out_report` is NULL or points to writable memory.
#[no_mangle]
pub unsafe extern "C" fn apd_sender_drain_close(
    sender: ApdSender,
    timeout_ms: u64,
    out_report: *mut ApdDrainReport,
) -> i32 {
    call("apd_sender_drain_close", || {
        let o = match out_report.is_null() {
            true => None,
            // SAFETY: non-null, so writable per the caller's contract.
            false => Some(unsafe { out("out_report", out_report) }?),
        };
        let s = handles::sender(sender.id)?;
        let timeout = match timeout_ms {
            APD_DRAIN_CONFIGURED => s.queue.sender().config().drain_timeout,
            ms => Duration::from_millis(ms),
        };
        let r = s.queue.drain(timeout);
        drop(s);
        if let Some(o) = o {
            *o = ApdDrainReport {
                drained: i32::from(r.drained),
                waited_ms: u64::try_from(r.waited.as_millis()).unwrap_or(u64::MAX),
                saves_left: r.saves_left as u64,
                parked_cancelled: r.parked_cancelled as u64,
                pulls_cancelled: r.pulls_cancelled as u64,
            };
        }
        handles::remove_sender(sender.id).map(|o| o.queue.shutdown())
    })
}

/// Closes the sender: saves running now finish, saves not started fail,
/// sockets close. The handle is invalid afterwards.
#[no_mangle]
pub extern "C" fn apd_sender_close(sender: ApdSender) -> i32 {
    call("apd_sender_close", || {
        // Joined here, even if another thread still holds the sender for
        // a moment: once this returns no save reads the engine's cache.
        handles::remove_sender(sender.id).map(|o| o.queue.shutdown())
    })
}

// -------------------------------------------------------------- receiver

/// Starts a receiver for TP rank `rank` from `config` (`pd_role:
/// receiver`) with its load queue.
///
/// # Safety
/// `out_receiver` points to writable memory.
#[no_mangle]
pub unsafe extern "C" fn apd_receiver_start(
    config: ApdConfig,
    rank: u32,
    out_receiver: *mut ApdReceiver,
) -> i32 {
    call("apd_receiver_start", || {
        // SAFETY: forwarded to the caller's contract.
        let o = unsafe { out("out_receiver", out_receiver) }?;
        let c = handles::config(config.id)?;
        role_of(&c, Role::Receiver)?;
        let receiver = Receiver::start(&c, rank as usize)?;
        let queue = LoadQueue::new(Arc::new(receiver))?;
        o.id = handles::insert(Object::Receiver(Arc::new(ReceiverObj::new(queue))));
        Ok(())
    })
}

/// `*ready` = 1 if every key is stored here (landed, or a pull-delay
/// proxy) and the request can be loaded, 0 otherwise.
///
/// # Safety
/// Strings are NUL-terminated; `keys` holds `num_keys` of them; `ready`
/// points to writable memory.
#[no_mangle]
pub unsafe extern "C" fn apd_receiver_available(
    receiver: ApdReceiver,
    keys: *const *const c_char,
    num_keys: u64,
    ready: *mut i32,
) -> i32 {
    call("apd_receiver_available", || {
        let r = handles::receiver(receiver.id)?;
        // SAFETY: forwarded to the caller's contract.
        let (keys, o) = unsafe { (arg_strs("keys", keys, num_keys)?, out("ready", ready)?) };
        if keys.is_empty() {
            return Err(Failure::arg("keys", "is empty: pass the request's keys"));
        }
        *o = i32::from(r.queue.available(&keys) == Availability::Ready);
        Ok(())
    })
}

/// Waits up to `timeout_ms` until every key can be loaded (as
/// `apd_receiver_available`); `*ready` = 1 if they all can, 0 at the
/// timeout. Returns the moment the last chunk lands (or its proxy
/// arrives): an engine with nothing else to run calls it instead of
/// polling at its next step.
///
/// # Safety
/// As `apd_receiver_available`.
#[no_mangle]
pub unsafe extern "C" fn apd_receiver_wait_available(
    receiver: ApdReceiver,
    keys: *const *const c_char,
    num_keys: u64,
    timeout_ms: u64,
    ready: *mut i32,
) -> i32 {
    call("apd_receiver_wait_available", || {
        let r = handles::receiver(receiver.id)?;
        // SAFETY: forwarded to the caller's contract.
        let (keys, o) = unsafe { (arg_strs("keys", keys, num_keys)?, out("ready", ready)?) };
        if keys.is_empty() {
            return Err(Failure::arg("keys", "is empty: pass the request's keys"));
        }
        let waited = r
            .queue
            .wait_available(&keys, Duration::from_millis(timeout_ms));
        *o = i32::from(waited);
        Ok(())
    })
}

/// Waits up to `timeout_ms` until a load has ended (done, failed or
/// cancelled) and waits for `apd_receiver_poll`; `*ended` = 1 if one has,
/// 0 at the timeout. Woken by the load's end, not a timer.
///
/// # Safety
/// `ended` points to writable memory.
#[no_mangle]
pub unsafe extern "C" fn apd_receiver_wait_ended(
    receiver: ApdReceiver,
    timeout_ms: u64,
    ended: *mut i32,
) -> i32 {
    call("apd_receiver_wait_ended", || {
        let r = handles::receiver(receiver.id)?;
        // SAFETY: forwarded to the caller's contract.
        let o = unsafe { out("ended", ended) }?;
        *o = i32::from(r.queue.wait_ended(Duration::from_millis(timeout_ms)));
        Ok(())
    })
}

/// Queues the load of request `req_id` (`keys`, one per chunk) into
/// `cache` at `slot_mapping` (one slot per token the keys hold; a negative
/// slot skips that token). Returns at once; `apd_receiver_poll` reports
/// the end: a mapping that does not match the stored tokens (a chunk
/// before the last not full, or the last not covering exactly the slots
/// left) fails the load before any byte moves. After a done load the
/// request's pages here are free.
///
/// # Safety
/// As `apd_sender_submit_save`.
#[no_mangle]
pub unsafe extern "C" fn apd_receiver_submit_load(
    receiver: ApdReceiver,
    req_id: *const c_char,
    keys: *const *const c_char,
    num_keys: u64,
    cache: ApdKvCache,
    slot_mapping: *const i64,
    num_slots: u64,
) -> i32 {
    call("apd_receiver_submit_load", || {
        let r = handles::receiver(receiver.id)?;
        // SAFETY: forwarded to the caller's contract.
        let (id, keys, slots) =
            unsafe { request_args(req_id, (keys, num_keys), (slot_mapping, num_slots)) }?;
        let cache = handles::cache(cache.id)?;
        r.queue.submit(
            LoadRequest {
                req_id: id.to_string(),
                keys,
                slot_mapping: slots.to_vec(),
            },
            &cache,
        )?;
        Ok(())
    })
}

/// As `apd_sender_poll`, for loads.
///
/// # Safety
/// As `apd_sender_poll`.
#[no_mangle]
pub unsafe extern "C" fn apd_receiver_poll(
    receiver: ApdReceiver,
    out_completions: *mut ApdCompletion,
    capacity: u64,
    count: *mut u64,
) -> i32 {
    call("apd_receiver_poll", || {
        let r = handles::receiver(receiver.id)?;
        // SAFETY: forwarded to the caller's contract.
        unsafe {
            poll_into(
                &r.backlog,
                || r.queue.poll(),
                out_completions,
                capacity,
                count,
            )
        }
    })
}

/// Registers this decode's receiver (its `pd_peer_host` and ports) for
/// transfer `transfer_id`, which a prefill parked (router-native flow),
/// with each prefill rank: `prefill_host` and `ports[0..num_ports]`, one
/// registration port per prefill rank, as the prefill's
/// `kv_transfer_params` name them. `held_tokens`: leading tokens the
/// decode already holds (their whole chunks are not sent). Sent in the
/// background; `apd_receiver_poll_registrations` reports each under
/// `req_id`: done, or failed with why (the prefill refused it, or did not
/// answer) — then the KV never comes.
///
/// # Safety
/// Strings are NUL-terminated; `ports` holds `num_ports` values.
#[no_mangle]
pub unsafe extern "C" fn apd_receiver_register(
    receiver: ApdReceiver,
    req_id: *const c_char,
    prefill_host: *const c_char,
    ports: *const u16,
    num_ports: u64,
    transfer_id: *const c_char,
    held_tokens: u64,
) -> i32 {
    call("apd_receiver_register", || {
        let r = handles::receiver(receiver.id)?;
        // SAFETY: forwarded to the caller's contract.
        let (id, host, ports, tid) = unsafe {
            (
                arg_str("req_id", req_id)?,
                arg_str("prefill_host", prefill_host)?,
                arg_slice("ports", ports, num_ports)?,
                arg_str("transfer_id", transfer_id)?,
            )
        };
        r.queue.register(id, host, ports, tid, held_tokens)?;
        Ok(())
    })
}

/// Registrations that ended since the last call (`apd_receiver_register`),
/// as completions: `APD_REQ_DONE` (the prefill sends), or `APD_REQ_FAILED`
/// with the reason. Arguments as `apd_receiver_poll`.
///
/// # Safety
/// As `apd_receiver_poll`.
#[no_mangle]
pub unsafe extern "C" fn apd_receiver_poll_registrations(
    receiver: ApdReceiver,
    out_completions: *mut ApdCompletion,
    capacity: u64,
    count: *mut u64,
) -> i32 {
    call("apd_receiver_poll_registrations", || {
        let r = handles::receiver(receiver.id)?;
        let fresh = || {
            r.queue
                .poll_registrations()
                .into_iter()
                .map(|(req_id, res)| {
                    crate::requests::Completion::now(
                        req_id,
                        match res {
                            Ok(()) => crate::requests::Outcome::Done,
                            Err(e) => crate::requests::Outcome::Failed(e),
                        },
                    )
                })
                .collect()
        };
        // SAFETY: forwarded to the caller's contract.
        unsafe {
            poll_into(
                &r.registered_backlog,
                fresh,
                out_completions,
                capacity,
                count,
            )
        }
    })
}

/// Cancels request `req_id` whose chunks are `keys`: its load is dropped
/// or reported as cancelled, and what this receiver holds of `keys` is
/// freed (pull-delay proxies are discarded, so senders release their
/// pins). `*state` tells what was found (`APD_CANCEL_*`).
///
/// Name the request as the prefill's save did (its `req_id`). Unless its
/// load here already ended, the request is then *withdrawn* for
/// `pd_resident_ttl` (600 s when that is 0; a running load withdraws it
/// if it fails): a save of it that reaches this receiver later is answered
/// as already sent, so nothing is stored, its sender writes nothing (push)
/// or releases its pins at once (pull), and the save ends as done.
///
/// # Safety
/// As `apd_receiver_available`.
#[no_mangle]
pub unsafe extern "C" fn apd_receiver_cancel(
    receiver: ApdReceiver,
    req_id: *const c_char,
    keys: *const *const c_char,
    num_keys: u64,
    state: *mut i32,
) -> i32 {
    call("apd_receiver_cancel", || {
        let r = handles::receiver(receiver.id)?;
        // SAFETY: forwarded to the caller's contract.
        let (id, keys, st) = unsafe {
            (
                arg_str("req_id", req_id)?,
                arg_strs("keys", keys, num_keys)?,
                out("state", state)?,
            )
        };
        *st = cancel_code(r.queue.cancel(id, &keys));
        Ok(())
    })
}

/// Page counters of the receiver's pools.
///
/// # Safety
/// `out` points to writable memory.
#[no_mangle]
pub unsafe extern "C" fn apd_receiver_pool_stats(
    receiver: ApdReceiver,
    out_stats: *mut ApdPoolStats,
) -> i32 {
    call("apd_receiver_pool_stats", || {
        let r = handles::receiver(receiver.id)?;
        // SAFETY: forwarded to the caller's contract.
        *unsafe { out("out_stats", out_stats) }? =
            pool_stats(&r.queue.receiver().allocator().stats());
        Ok(())
    })
}

/// Closes the receiver: loads running now finish, loads not started fail
/// and their keys are dropped, sockets close. The handle is invalid
/// afterwards.
#[no_mangle]
pub extern "C" fn apd_receiver_close(receiver: ApdReceiver) -> i32 {
    call("apd_receiver_close", || {
        // Joined here, even if another thread still holds the receiver
        // for a moment: once this returns no load writes the engine's cache.
        handles::remove_receiver(receiver.id).map(|o| o.queue.shutdown())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn last_error() -> String {
        // SAFETY: apd_last_error never returns NULL; the string lives until
        // the next call on this thread.
        unsafe { CStr::from_ptr(apd_last_error()) }
            .to_string_lossy()
            .into_owned()
    }

    #[test]
    fn a_panic_is_caught_at_the_boundary_and_reported() {
        let st = call("apd_test", || panic!("boom at the edge"));
        assert_eq!(st, APD_ERR_INTERNAL);
        let e = last_error();
        assert!(
            e.contains("apd_test") && e.contains("internal error"),
            "{e}"
        );
        assert!(e.contains("boom at the edge"), "{e}");
        // The next call that succeeds clears it.
        assert_eq!(call("apd_test", || Ok(())), APD_OK);
        assert_eq!(last_error(), "");
    }

    #[test]
    fn messages_are_cut_at_a_character_boundary_and_terminated() {
        let mut buf = [1 as c_char; 6];
        fill(&mut buf, "abcdé"); // é is 2 bytes: "abcd" + NUL fits, "abcdé" does not
                                 // SAFETY: `fill` always writes a NUL inside the buffer.
        let s = unsafe { CStr::from_ptr(buf.as_ptr()) };
        assert_eq!(s.to_str().unwrap(), "abcd");
        let mut buf = [1 as c_char; 4];
        fill(&mut buf, "");
        assert_eq!(buf[0], 0);
    }

    #[test]
    fn a_nul_inside_a_message_does_not_cut_it_short() {
        assert_eq!(
            call("apd_test", || Err(Failure::arg("x", "has a \0 inside"))),
            APD_ERR_INVALID_ARGUMENT
        );
        assert!(
            last_error().ends_with("has a \\0 inside"),
            "{}",
            last_error()
        );
    }
}
