//! NPU pools (and pinned CPU pools) over the CANN ACL runtime, through
//! `ascend-sys`.
//!
//! [`AclRuntime`] is the product's [`NpuRuntime`]: NPU pools are
//! `aclrtMalloc` buffers ([`AclDeviceMemory`]), and CPU pools the `hccl`
//! channel must register are `aclrtMallocHost` buffers ([`AclHostMemory`]).
//! Channels get the `ascend-sys` handles back with [`device_buffer`] and
//! [`pinned_buffer`]; [`read_page`] / [`write_page`] move a page's bytes
//! to and from host memory wherever the page lives.
//!
//! The `ascend-sys` handle of a pool reaches every page of it, whoever owns
//! the page and whatever transfer is using it, so handing it out is
//! `unsafe`: only the channels, which move the bytes of pages they were
//! given (or that a live grant lends them), may use it. Everyone else
//! reaches a page's bytes through its handle ([`read_page`], [`write_page`],
//! [`Page::host_bytes`](super::Page::host_bytes)):
//! ```compile_fail,E0133
//! # use ascend_pd::memory::{npu, RegisteredBuffer};
//! # fn f(buffer: &RegisteredBuffer) {
//! // error: a pool-wide handle needs `unsafe` (and a reason no transfer runs)
//! let bytes = npu::pinned_buffer(buffer).map(|h| h.device().id());
//! # }
//! ```
//! ```compile_fail,E0133
//! # use ascend_pd::memory::{npu, RegisteredBuffer};
//! # fn f(buffer: &RegisteredBuffer) {
//! let dev = npu::device_buffer(buffer); // error: as above
//! # }
//! ```
//! Nor through the pool's memory object:
//! ```compile_fail,E0133
//! # use ascend_pd::memory::{npu::AclHostMemory, RegisteredBuffer};
//! # fn f(buffer: &RegisteredBuffer) {
//! let any = buffer.pinned_memory().and_then(|m| m.as_any());
//! let host = any.and_then(|a| a.downcast_ref::<AclHostMemory>());
//! let bytes = host.map(|h| h.buffer().as_slice()); // error: `buffer` is unsafe
//! # }
//! ```
//!
//! Nothing here has run on Ascend hardware; it is tested against the CANN
//! emulator (`ascend-sys/emu`).

use super::buffer::{DeviceMemory, NpuRuntime, PinnedHostMemory, RegisteredBuffer};
use super::pool::{MemObj, Page};
use super::MemoryError;
use ascend_sys::{Acl, Device, DeviceBuffer, HostBuffer};
use std::any::Any;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The CANN runtime (or its emulator) as the source of NPU pools.
#[derive(Clone, Debug)]
pub struct AclRuntime {
    acl: Acl,
}

/// The error for a CANN that cannot be loaded: what was tried and the two ways out.
fn no_runtime(e: &ascend_sys::Error) -> MemoryError {
    MemoryError::NoNpuRuntime(format!("cannot load the CANN runtime: {e}"))
}

fn device_error(what: &str, e: &ascend_sys::Error) -> MemoryError {
    MemoryError::Device(format!("{what}: {e}"))
}

impl AclRuntime {
    /// Wraps an initialised runtime.
    pub fn new(acl: Acl) -> AclRuntime {
        AclRuntime { acl }
    }

    /// Loads CANN from the default search (`ASCEND_PD_CANN_LIB_DIR` first,
    /// see `ascend_sys::search_locations`), or takes the runtime this
    /// process already loaded. The error lists what was tried and how to fix it.
    pub fn load() -> Result<AclRuntime, MemoryError> {
        Acl::init().map(AclRuntime::new).map_err(|e| no_runtime(&e))
    }

    /// Loads CANN (or the emulator) from `dir` only.
    pub fn from_dir(dir: &Path) -> Result<AclRuntime, MemoryError> {
        Acl::init_from_dir(dir)
            .map(AclRuntime::new)
            .map_err(|e| no_runtime(&e))
    }

    /// The runtime.
    pub fn acl(&self) -> &Acl {
        &self.acl
    }

    /// A context for NPU `id`.
    pub fn device(&self, id: u32) -> Result<Device, MemoryError> {
        self.acl
            .device(id)
            .map_err(|e| device_error(&format!("opening NPU {id}"), &e))
    }
}

impl NpuRuntime for AclRuntime {
    fn alloc(&self, device: u32, len: usize) -> Result<Box<dyn DeviceMemory>, MemoryError> {
        let buffer = self
            .device(device)?
            .alloc(len)
            .map_err(|e| device_error(&format!("allocating {len} bytes on NPU {device}"), &e))?;
        Ok(Box::new(AclDeviceMemory {
            buffer: Arc::new(buffer),
        }))
    }

    fn describe(&self) -> String {
        let path = self.acl.library_path();
        if self.acl.is_emulator() {
            let real = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
            format!("CANN emulator (ascend-emu) at {}", real.display())
        } else {
            format!("CANN runtime at {}", path.display())
        }
    }

    fn alloc_pinned_host(
        &self,
        device: u32,
        len: usize,
    ) -> Option<Result<Box<dyn PinnedHostMemory>, MemoryError>> {
        Some((|| {
            let dev = self.device(device)?;
            let buffer = dev.alloc_host(len).map_err(|e| {
                device_error(&format!("allocating {len} bytes of pinned host memory"), &e)
            })?;
            Ok(Box::new(AclHostMemory {
                buffer: Arc::new(buffer),
                device: dev,
            }) as Box<dyn PinnedHostMemory>)
        })())
    }
}

/// An NPU pool's memory: an `aclrtMalloc` buffer, shared with the channels
/// that register it (HCCL) or copy through it (tcp staging).
#[derive(Debug)]
pub struct AclDeviceMemory {
    buffer: Arc<DeviceBuffer>,
}

impl AclDeviceMemory {
    /// The ascend-sys buffer: every page of the pool.
    ///
    /// # Safety
    /// The buffer reaches pages other handles own and transfers use. The
    /// caller may copy into or out of a page through it only while it owns
    /// that page (or serves a live grant of it), and no transfer, peer or
    /// other owner writes that page meanwhile.
    pub unsafe fn buffer(&self) -> &Arc<DeviceBuffer> {
        &self.buffer
    }
}

impl DeviceMemory for AclDeviceMemory {
    fn device_ptr(&self) -> u64 {
        self.buffer.addr()
    }

    fn len(&self) -> usize {
        self.buffer.len()
    }

    fn device_index(&self) -> u32 {
        self.buffer.device().id()
    }

    fn as_any(&self) -> Option<&dyn Any> {
        Some(self)
    }
}

/// A pinned CPU pool's memory: an `aclrtMallocHost` buffer and the NPU it
/// was allocated for (the device an `hccl` communicator over it runs on).
#[derive(Debug)]
pub struct AclHostMemory {
    buffer: Arc<HostBuffer>,
    device: Device,
}

impl AclHostMemory {
    /// The ascend-sys buffer: every page of the pool (its safe
    /// `as_slice` included).
    ///
    /// # Safety
    /// As [`AclDeviceMemory::buffer`]: read or write a page through it only
    /// while you own the page (or serve a live grant of it) and nobody else
    /// writes it meanwhile.
    pub unsafe fn buffer(&self) -> &Arc<HostBuffer> {
        &self.buffer
    }

    /// The NPU the memory was allocated for.
    pub fn device(&self) -> &Device {
        &self.device
    }
}

impl PinnedHostMemory for AclHostMemory {
    fn host_ptr(&self) -> *mut u8 {
        self.buffer.as_ptr().cast()
    }

    fn len(&self) -> usize {
        self.buffer.len()
    }

    fn as_any(&self) -> Option<&dyn Any> {
        Some(self)
    }
}

fn acl_device(buffer: &RegisteredBuffer) -> Option<&AclDeviceMemory> {
    buffer
        .device_memory()?
        .as_any()?
        .downcast_ref::<AclDeviceMemory>()
}

fn acl_host(buffer: &RegisteredBuffer) -> Option<&AclHostMemory> {
    buffer
        .pinned_memory()?
        .as_any()?
        .downcast_ref::<AclHostMemory>()
}

/// The `aclrtMalloc` buffer behind an NPU pool made by [`AclRuntime`]
/// (`None` for CPU pools and NPU pools of other runtimes).
///
/// # Safety
/// The buffer reaches every page of the pool: see [`AclDeviceMemory::buffer`].
/// Copy through it only into or out of pages the caller owns or serves
/// under a live grant, while nobody else writes them.
pub unsafe fn device_buffer(buffer: &RegisteredBuffer) -> Option<&Arc<DeviceBuffer>> {
    // SAFETY: forwarded to our caller's contract.
    acl_device(buffer).map(|d| unsafe { d.buffer() })
}

/// The pinned memory behind a CPU pool made by [`AclRuntime`]
/// (`None` for mapped CPU pools and NPU pools).
///
/// # Safety
/// As [`device_buffer`]: the handle (through [`AclHostMemory::buffer`])
/// reaches every page of the pool.
pub unsafe fn pinned_buffer(buffer: &RegisteredBuffer) -> Option<&AclHostMemory> {
    acl_host(buffer)
}

/// Whether `buffer` is an NPU pool made by [`AclRuntime`] (whose pages
/// [`read_page`] / [`write_page`] and the tcp channel can copy).
pub fn is_acl_device(buffer: &RegisteredBuffer) -> bool {
    acl_device(buffer).is_some()
}

/// Whether `buffer` is a CPU pool pinned by [`AclRuntime`] (which the
/// `hccl` channel can register).
pub fn is_acl_pinned(buffer: &RegisteredBuffer) -> bool {
    acl_host(buffer).is_some()
}

/// The NPU an ACL-backed pool belongs to (device pools) or was pinned for
/// (pinned CPU pools).
pub fn device_of(buffer: &RegisteredBuffer) -> Option<Device> {
    acl_device(buffer)
        .map(|d| d.buffer.device().clone())
        .or_else(|| acl_host(buffer).map(|h| h.device().clone()))
}

/// Where a page range lives, checked against the page.
fn page_range(obj: &Page, offset: usize, len: usize) -> Result<usize, MemoryError> {
    let page_size = obj.pool().buffer().page_size();
    match offset.checked_add(len) {
        Some(end) if end <= page_size => Ok(obj.page() as usize * page_size + offset),
        _ => Err(MemoryError::InvalidGeometry(format!(
            "{len} bytes at offset {offset} exceed the {page_size}-byte page"
        ))),
    }
}

/// Copies `dst.len()` bytes at `offset` in `obj`'s page into `dst`, wherever
/// the page lives (host memory, or an NPU through a device-to-host copy).
/// `obj` is a [`MemObj`] or a [`SealedMemObj`](super::SealedMemObj): a page
/// no transfer writes.
pub fn read_page(obj: &Page, offset: usize, dst: &mut [u8]) -> Result<(), MemoryError> {
    let at = page_range(obj, offset, dst.len())?;
    let buffer = obj.pool().buffer();
    if let Some(base) = buffer.host_ptr() {
        // SAFETY: [at, at+len) lies inside the pool (page_range), the pool
        // outlives `obj`, `dst` is a distinct exclusive slice, and a `&Page`
        // comes from a sole owner or a sealed page: nobody writes it now.
        let src = unsafe { std::slice::from_raw_parts(base.add(at), dst.len()) };
        dst.copy_from_slice(src);
        return Ok(());
    }
    let dev = &acl_device(buffer).ok_or_else(|| not_acl(buffer))?.buffer;
    dev.copy_to_host(at, dst)
        .map_err(|e| device_error(&format!("reading {}", obj.buffer_ref()), &e))
}

/// Copies `src` into `obj`'s page at `offset`, wherever the page lives.
/// `&mut MemObj`: the page's sole owner, so nobody reads or writes it meanwhile.
pub fn write_page(obj: &mut MemObj, offset: usize, src: &[u8]) -> Result<(), MemoryError> {
    let at = page_range(obj, offset, src.len())?;
    let buffer = obj.pool().buffer();
    if let Some(base) = buffer.host_ptr() {
        // SAFETY: the range lies inside the pool; `&mut MemObj` is the only
        // handle to the page (never cloned, not lent, not in a transfer).
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), base.add(at), src.len()) };
        return Ok(());
    }
    let dev = &acl_device(buffer).ok_or_else(|| not_acl(buffer))?.buffer;
    dev.copy_from_host(at, src)
        .map_err(|e| device_error(&format!("writing {}", obj.buffer_ref()), &e))
}

fn not_acl(buffer: &RegisteredBuffer) -> MemoryError {
    MemoryError::Device(format!(
        "pool {} on {} was not allocated by the ACL runtime; its bytes cannot be copied",
        buffer.uuid().simple(),
        buffer.device()
    ))
}

/// Calls `sync` (a stream's synchronisation) until it succeeds, `on_error`
/// at its first failure: an error is never proof that the device stopped,
/// so this does not return while the device may still touch memory the
/// caller gives back (`at_risk` names it, for the log). Logged at the first
/// failure and then about once a minute.
pub(crate) fn settle_with<E: std::fmt::Display>(
    mut sync: impl FnMut() -> Result<(), E>,
    context: &str,
    at_risk: &str,
    on_error: impl FnOnce(),
) {
    let mut on_error = Some(on_error);
    let mut failures = 0u64;
    let mut pause = Duration::from_millis(20);
    let mut log_at = Instant::now();
    loop {
        let e = match sync() {
            Ok(()) => {
                if failures > 0 {
                    log::warn!(
                        "{context}: the stream synchronised after {failures} failed attempt(s)"
                    );
                }
                return;
            }
            Err(e) => e,
        };
        failures += 1;
        if let Some(f) = on_error.take() {
            f();
        }
        if Instant::now() >= log_at {
            log::error!(
                "{context}: the stream could not be synchronised ({e}; attempt {failures}); \
                 waiting, as the device may still touch {at_risk}"
            );
            log_at = Instant::now() + Duration::from_secs(60);
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_secs(1));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::{
        ChunkLayout, ChunkMeta, CpuBacking, DeviceKind, Dtype, DualAllocator, DualSpec, MemFormat,
        PoolKind,
    };

    fn emulator() -> AclRuntime {
        let dir = ascend_emu::install_dir().expect("the emulator is a dev-dependency");
        AclRuntime::from_dir(&dir).expect("the emulator loads")
    }

    fn layout(bytes: usize) -> ChunkLayout {
        ChunkLayout {
            fmt: MemFormat::Kv2Ltd,
            layers: 1,
            tokens: 1,
            hidden: bytes / 4,
            dtype: Dtype::BFloat16,
        }
    }

    #[test]
    fn npu_pools_hold_device_buffers_and_pages_copy_both_ways() {
        let rt = emulator();
        let buf = RegisteredBuffer::npu(&rt, 1, 3 * 4096, 4096).unwrap();
        assert_eq!(buf.device(), DeviceKind::Npu(1));
        // SAFETY: only the address and device are looked at; no byte moves.
        let dev = unsafe { device_buffer(&buf) }.expect("ACL device buffer");
        assert_eq!(dev.addr(), buf.base());
        assert_eq!(dev.device().id(), 1);
        assert!(is_acl_device(&buf) && !is_acl_pinned(&buf) && buf.host_ptr().is_none());
        let pool = crate::memory::PagePool::new(buf);
        let mut objs = pool
            .allocate_batch(&[ChunkMeta::full(layout(4096)); 3])
            .unwrap();
        let data: Vec<u8> = (0..4096u32).map(|i| (i * 7 % 251) as u8).collect();
        write_page(&mut objs[1], 0, &data).unwrap();
        write_page(&mut objs[2], 100, &data[..50]).unwrap();
        let mut back = vec![0u8; 4096];
        read_page(&objs[1], 0, &mut back).unwrap();
        assert_eq!(back, data);
        let mut part = vec![0u8; 50];
        read_page(&objs[2], 100, &mut part).unwrap();
        assert_eq!(part, &data[..50]);
        // The copy went to page 1 only: page 0 is untouched (the emulator zero-fills).
        let mut first = vec![1u8; 4096];
        read_page(&objs[0], 0, &mut first).unwrap();
        assert!(first.iter().all(|&b| b == 0));
        let e = read_page(&objs[0], 4050, &mut part)
            .unwrap_err()
            .to_string();
        assert!(e.contains("exceed the 4096-byte page"), "{e}");
        drop(objs);
        assert_eq!((pool.stats().allocated, pool.stats().quarantined), (0, 0));
    }

    #[test]
    fn pinned_cpu_pools_are_host_memory_with_an_acl_buffer() {
        let rt = emulator();
        let buf = RegisteredBuffer::pinned_host(&rt, 0, 2 * 1024, 1024).unwrap();
        assert_eq!(buf.device(), DeviceKind::Cpu);
        // SAFETY: only the address is looked at; no byte moves.
        let addr = unsafe { pinned_buffer(&buf).expect("ACL host buffer").buffer() }.addr();
        assert_eq!(addr, buf.base());
        assert_eq!(Some(buf.base() as *mut u8), buf.host_ptr());
        assert!(buf.shared_fd().is_none() && !is_acl_device(&buf) && is_acl_pinned(&buf));
        assert_eq!(device_of(&buf).map(|d| d.id()), Some(0));
        let pool = crate::memory::PagePool::new(buf);
        let mut o = pool.allocate(ChunkMeta::full(layout(1024))).unwrap();
        o.host_bytes_mut().unwrap().fill(0x5a);
        let mut back = vec![0u8; 1024];
        read_page(&o, 0, &mut back).unwrap();
        assert!(back.iter().all(|&b| b == 0x5a));
    }

    #[test]
    fn the_dual_allocator_builds_pinned_cpu_and_npu_pools() {
        let rt = emulator();
        let spec = DualSpec {
            cpu_bytes: Some(4 * 1024),
            npu: Some((2, 8 * 1024)),
            page_size: 1024,
            placement: PoolKind::Npu,
            shareable_cpu: false,
        };
        let a = DualAllocator::build(&spec, Some(&rt), CpuBacking::Pinned { device: 2 }).unwrap();
        let cpu = a.pool(PoolKind::Cpu).unwrap().buffer();
        assert!(is_acl_pinned(cpu));
        assert_eq!(device_of(cpu).map(|d| d.id()), Some(2));
        assert_eq!(a.primary_device(), DeviceKind::Npu(2));
        assert_eq!(a.stats().npu.unwrap().total, 8);
        let e = DualAllocator::build(&spec, None, CpuBacking::Pinned { device: 0 })
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("NPU runtime") && e.contains("ASCEND_PD_CANN_LIB_DIR"),
            "{e}"
        );
    }

    #[test]
    fn a_missing_cann_says_how_to_fix_it() {
        let e = no_runtime(&ascend_sys::Error::LibraryNotFound {
            library: "libascendcl.so",
            attempts: vec![ascend_sys::LoadAttempt {
                path: "/nowhere/libascendcl.so".into(),
                outcome: "not found".into(),
            }],
        })
        .to_string();
        for words in [
            "/nowhere/libascendcl.so",
            "ASCEND_PD_CANN_LIB_DIR",
            "pd_buffer_device: cpu",
        ] {
            assert!(e.contains(words), "{words}: {e}");
        }
    }
}
