//! Registered buffers (one pool of memory each) and references into them.

use super::host::HostRegion;
use super::MemoryError;
use std::any::Any;
use std::fmt;
use std::os::fd::BorrowedFd;
use uuid::Uuid;

/// Where a pool's memory lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeviceKind {
    /// Host memory.
    Cpu,
    /// Memory of NPU `n`.
    Npu(u32),
}

impl fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceKind::Cpu => f.write_str("cpu"),
            DeviceKind::Npu(n) => write!(f, "npu:{n}"),
        }
    }
}

/// A chunk's address: which registered buffer, which page. Never a raw pointer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BufferRef {
    /// The buffer's UUID.
    pub uuid: Uuid,
    /// The page index inside it.
    pub page: u32,
}

impl fmt::Display for BufferRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}[{}]", self.uuid.simple(), self.page)
    }
}

/// Device memory handed out by an NPU runtime. Dropping it frees the memory.
pub trait DeviceMemory: Send + Sync + fmt::Debug {
    /// Device address of the first byte (not dereferenceable on the host).
    fn device_ptr(&self) -> u64;
    /// Length in bytes.
    fn len(&self) -> usize;
    /// Whether the allocation is empty (never, for pools).
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Which NPU owns it.
    fn device_index(&self) -> u32;
    /// The concrete allocation, for channels that need the runtime's own
    /// handle (the ACL runtime's `DeviceBuffer`, see `memory::npu`). `None`
    /// for implementations that offer nothing beyond this trait.
    fn as_any(&self) -> Option<&dyn Any> {
        None
    }
}

/// Pinned host memory handed out by an NPU runtime (`aclrtMallocHost`):
/// host-addressable, and registrable with the runtime's transfer engine
/// (HCCL), which ordinary mapped memory may not be. Dropping it frees it.
pub trait PinnedHostMemory: Send + Sync + fmt::Debug {
    /// Host address of the first byte.
    fn host_ptr(&self) -> *mut u8;
    /// Length in bytes.
    fn len(&self) -> usize;
    /// Whether the allocation is empty (never, for pools).
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The concrete allocation (the ACL runtime's `HostBuffer`), if any.
    fn as_any(&self) -> Option<&dyn Any> {
        None
    }
}

/// The source of NPU pools. The CANN runtime (or its emulator) implements it;
/// the allocator only needs this much, so it builds and tests without CANN.
pub trait NpuRuntime: Send + Sync {
    /// Allocates `len` bytes on NPU `device`.
    fn alloc(&self, device: u32, len: usize) -> Result<Box<dyn DeviceMemory>, MemoryError>;
    /// A one-line description for logs ("CANN at /usr/local/...", "emulator").
    fn describe(&self) -> String;
    /// Allocates `len` bytes of pinned host memory tied to NPU `device`, for
    /// CPU pools the `hccl` channel registers. `None` when the runtime has no
    /// such allocator.
    fn alloc_pinned_host(
        &self,
        device: u32,
        len: usize,
    ) -> Option<Result<Box<dyn PinnedHostMemory>, MemoryError>> {
        let _ = (device, len);
        None
    }
}

#[derive(Debug)]
enum Backing {
    Host(HostRegion),
    Pinned(Box<dyn PinnedHostMemory>),
    Device(Box<dyn DeviceMemory>),
}

/// One pool of memory (CPU or NPU), identified by a UUID v4 and cut into
/// equal pages of one chunk each.
#[derive(Debug)]
pub struct RegisteredBuffer {
    uuid: Uuid,
    device: DeviceKind,
    page_size: usize,
    num_pages: usize,
    backing: Backing,
}

impl RegisteredBuffer {
    /// A host pool of at least `bytes` (rounded up to whole pages, at least
    /// one) with `page_size`-byte pages. `shareable` puts it in a memfd so
    /// another process on the host can map it.
    pub fn host(bytes: usize, page_size: usize, shareable: bool) -> Result<Self, MemoryError> {
        let (num_pages, len) = page_geometry(bytes, page_size)?;
        let region = if shareable {
            HostRegion::shared(len, "ascend-pd-pool")
        } else {
            HostRegion::anonymous(len)
        }
        .map_err(|source| MemoryError::HostAlloc { bytes: len, source })?;
        Ok(RegisteredBuffer {
            uuid: Uuid::new_v4(),
            device: DeviceKind::Cpu,
            page_size,
            num_pages,
            backing: Backing::Host(region),
        })
    }

    /// An NPU pool of at least `bytes` (whole pages) on NPU `device`, from `runtime`.
    pub fn npu(
        runtime: &dyn NpuRuntime,
        device: u32,
        bytes: usize,
        page_size: usize,
    ) -> Result<Self, MemoryError> {
        let (num_pages, len) = page_geometry(bytes, page_size)?;
        let mem = runtime.alloc(device, len)?;
        if mem.len() < len {
            return Err(MemoryError::Device(format!(
                "{} returned {} bytes for a {len}-byte pool",
                runtime.describe(),
                mem.len()
            )));
        }
        Ok(RegisteredBuffer {
            uuid: Uuid::new_v4(),
            device: DeviceKind::Npu(device),
            page_size,
            num_pages,
            backing: Backing::Device(mem),
        })
    }

    /// A host pool of at least `bytes` (whole pages) in pinned host memory
    /// from `runtime` (tied to NPU `device`): what the `hccl` channel needs
    /// for a CPU pool, since HCCL registers only runtime-allocated memory.
    /// It is still an ordinary CPU pool for every other purpose.
    pub fn pinned_host(
        runtime: &dyn NpuRuntime,
        device: u32,
        bytes: usize,
        page_size: usize,
    ) -> Result<Self, MemoryError> {
        let (num_pages, len) = page_geometry(bytes, page_size)?;
        let mem = runtime.alloc_pinned_host(device, len).ok_or_else(|| {
            MemoryError::NoNpuRuntime(format!(
                "{} cannot allocate pinned host memory",
                runtime.describe()
            ))
        })??;
        if mem.len() < len {
            return Err(MemoryError::Device(format!(
                "{} returned {} bytes of pinned host memory for a {len}-byte pool",
                runtime.describe(),
                mem.len()
            )));
        }
        Ok(RegisteredBuffer {
            uuid: Uuid::new_v4(),
            device: DeviceKind::Cpu,
            page_size,
            num_pages,
            backing: Backing::Pinned(mem),
        })
    }

    /// The UUID peers address this buffer by.
    pub fn uuid(&self) -> Uuid {
        self.uuid
    }

    /// CPU or which NPU.
    pub fn device(&self) -> DeviceKind {
        self.device
    }

    /// Address of the first byte (a host pointer for CPU pools, a device address for NPU pools).
    pub fn base(&self) -> u64 {
        match &self.backing {
            Backing::Host(r) => r.as_ptr() as u64,
            Backing::Pinned(m) => m.host_ptr() as u64,
            Backing::Device(m) => m.device_ptr(),
        }
    }

    /// Bytes in the pool (`num_pages * page_size`).
    pub fn len(&self) -> usize {
        self.num_pages * self.page_size
    }

    /// Always false: pools have at least one page.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Bytes per page (one full chunk).
    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// Number of pages.
    pub fn num_pages(&self) -> usize {
        self.num_pages
    }

    /// Address of page `page`, or `None` when out of range.
    pub fn page_addr(&self, page: u32) -> Option<u64> {
        let page = page as usize;
        (page < self.num_pages).then(|| self.base() + (page * self.page_size) as u64)
    }

    /// Host pointer to the first byte, for CPU pools.
    pub fn host_ptr(&self) -> Option<*mut u8> {
        match &self.backing {
            Backing::Host(r) => Some(r.as_ptr()),
            Backing::Pinned(m) => Some(m.host_ptr()),
            Backing::Device(_) => None,
        }
    }

    /// The device memory of an NPU pool.
    pub fn device_memory(&self) -> Option<&dyn DeviceMemory> {
        match &self.backing {
            Backing::Device(m) => Some(m.as_ref()),
            _ => None,
        }
    }

    /// The pinned host memory of a CPU pool made by [`RegisteredBuffer::pinned_host`].
    pub fn pinned_memory(&self) -> Option<&dyn PinnedHostMemory> {
        match &self.backing {
            Backing::Pinned(m) => Some(m.as_ref()),
            _ => None,
        }
    }

    /// The memfd of a shareable CPU pool.
    pub fn shared_fd(&self) -> Option<BorrowedFd<'_>> {
        match &self.backing {
            Backing::Host(r) => r.fd(),
            Backing::Pinned(_) | Backing::Device(_) => None,
        }
    }

    /// Faults in a CPU pool's pages now (no-op for NPU pools and pinned
    /// pools, which the runtime zero-filled at allocation).
    pub fn prefault(&self) {
        if let Backing::Host(r) = &self.backing {
            r.prefault();
        }
    }
}

/// Pages and bytes for a pool of at least `bytes`: whole pages, at least one.
fn page_geometry(bytes: usize, page_size: usize) -> Result<(usize, usize), MemoryError> {
    if page_size == 0 {
        return Err(MemoryError::InvalidGeometry("page size is 0".into()));
    }
    let pages = bytes.div_ceil(page_size).max(1);
    if pages > u32::MAX as usize {
        return Err(MemoryError::InvalidGeometry(format!(
            "{pages} pages exceed the u32 page index"
        )));
    }
    let len = pages
        .checked_mul(page_size)
        .ok_or_else(|| MemoryError::InvalidGeometry(format!("{pages} x {page_size} overflows")))?;
    Ok((pages, len))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_size_rounds_up_to_whole_pages_and_at_least_one() {
        let b = RegisteredBuffer::host(10_000, 4096, false).unwrap();
        assert_eq!((b.num_pages(), b.len()), (3, 3 * 4096));
        let one = RegisteredBuffer::host(1, 4096, false).unwrap();
        assert_eq!(one.num_pages(), 1);
        let zero = RegisteredBuffer::host(0, 4096, false).unwrap();
        assert_eq!(zero.num_pages(), 1);
        assert_eq!(b.device(), DeviceKind::Cpu);
        assert_eq!(b.uuid().get_version_num(), 4);
        assert_ne!(b.uuid(), one.uuid());
    }

    #[test]
    fn page_addresses_are_bounds_checked() {
        let b = RegisteredBuffer::host(4 * 4096, 4096, false).unwrap();
        assert_eq!(b.page_addr(0), Some(b.base()));
        assert_eq!(b.page_addr(3), Some(b.base() + 3 * 4096));
        assert_eq!(b.page_addr(4), None);
    }

    #[test]
    fn zero_page_size_is_rejected() {
        let e = RegisteredBuffer::host(4096, 0, false).unwrap_err();
        assert!(e.to_string().contains("page size is 0"), "{e}");
    }
}
