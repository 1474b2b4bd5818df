//! Device memory, pinned host memory and synchronous copies.

use std::ffi::c_void;
use std::ptr::NonNull;

use crate::acl::Device;
use crate::error::{Error, Result};
use crate::result::acl_call;
use crate::sys;

/// Direction of a raw copy (`aclrtMemcpyKind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemcpyKind {
    /// Host to host.
    HostToHost,
    /// Host to device.
    HostToDevice,
    /// Device to host.
    DeviceToHost,
    /// Device to device (same device).
    DeviceToDevice,
}

impl MemcpyKind {
    pub(crate) fn raw(self) -> sys::aclrtMemcpyKind {
        match self {
            MemcpyKind::HostToHost => sys::ACL_MEMCPY_HOST_TO_HOST,
            MemcpyKind::HostToDevice => sys::ACL_MEMCPY_HOST_TO_DEVICE,
            MemcpyKind::DeviceToHost => sys::ACL_MEMCPY_DEVICE_TO_HOST,
            MemcpyKind::DeviceToDevice => sys::ACL_MEMCPY_DEVICE_TO_DEVICE,
        }
    }
}

/// Checks that `[offset, offset + len)` fits in `capacity` bytes.
pub(crate) fn check_span(what: &str, offset: usize, len: usize, capacity: usize) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= capacity => Ok(()),
        _ => Err(Error::InvalidArgument(format!(
            "{what}: range [{offset}, {offset}+{len}) exceeds its {capacity} bytes"
        ))),
    }
}

/// Device memory from `aclrtMalloc`, freed on drop.
///
/// Rust never dereferences it; the address ([`DeviceBuffer::as_ptr`],
/// [`DeviceBuffer::addr`]) is a value to hand to copies and HCCL
/// descriptors. Methods take `&self` because the device, not Rust, owns
/// the bytes; ordering device work on the memory is the caller's job, as
/// with any accelerator API.
pub struct DeviceBuffer {
    device: Device,
    ptr: NonNull<c_void>,
    len: usize,
}

// SAFETY: the buffer is a device address plus a length; it is never
// dereferenced by Rust, and the runtime accepts it from any thread.
unsafe impl Send for DeviceBuffer {}
// SAFETY: see Send; &self methods only pass the address to the runtime.
unsafe impl Sync for DeviceBuffer {}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("device", &self.device.id())
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len)
            .finish()
    }
}

impl Device {
    /// Allocates `len` bytes of device memory (contents unspecified).
    pub fn alloc(&self, len: usize) -> Result<DeviceBuffer> {
        if len == 0 {
            return Err(Error::InvalidArgument(
                "device allocation of 0 bytes".into(),
            ));
        }
        self.bind()?;
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: p is a valid out-parameter; the policy is a CANN constant.
        unsafe {
            acl_call!(
                self.libs(),
                aclrtMalloc(&mut p, len, sys::ACL_MEM_MALLOC_HUGE_FIRST)
            )?
        };
        let ptr = NonNull::new(p).ok_or_else(|| Error::Acl {
            call: "aclrtMalloc",
            code: sys::ACL_SUCCESS,
            message: "returned success but a NULL pointer".into(),
        })?;
        Ok(DeviceBuffer {
            device: self.clone(),
            ptr,
            len,
        })
    }

    /// Allocates `len` bytes of pinned host memory, zero-filled.
    pub fn alloc_host(&self, len: usize) -> Result<HostBuffer> {
        if len == 0 {
            return Err(Error::InvalidArgument("host allocation of 0 bytes".into()));
        }
        self.bind()?;
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: p is a valid out-parameter.
        unsafe { acl_call!(self.libs(), aclrtMallocHost(&mut p, len))? };
        let ptr = NonNull::new(p.cast::<u8>()).ok_or_else(|| Error::Acl {
            call: "aclrtMallocHost",
            code: sys::ACL_SUCCESS,
            message: "returned success but a NULL pointer".into(),
        })?;
        // SAFETY: the runtime just gave us len writable bytes at ptr; zeroing
        // makes every later slice view initialised memory.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, len) };
        Ok(HostBuffer {
            device: self.clone(),
            ptr,
            len,
        })
    }

    /// Raw synchronous copy (`aclrtMemcpy`), for addresses computed by the
    /// caller (pages inside pools, peer addresses).
    ///
    /// # Safety
    /// `dst` must be valid for `dst_capacity` bytes and `src` for `len`
    /// bytes, of the kinds `kind` names, and no Rust reference may alias the
    /// destination while the copy runs.
    pub unsafe fn memcpy(
        &self,
        dst: *mut c_void,
        dst_capacity: usize,
        src: *const c_void,
        len: usize,
        kind: MemcpyKind,
    ) -> Result<()> {
        self.bind()?;
        // SAFETY: forwarded to the caller's contract.
        unsafe {
            acl_call!(
                self.libs(),
                aclrtMemcpy(dst, dst_capacity, src, len, kind.raw())
            )
        }
    }
}

impl DeviceBuffer {
    /// The device the memory belongs to.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false (zero-byte buffers are refused).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device address, for raw copies and HCCL descriptors.
    pub fn as_ptr(&self) -> *mut c_void {
        self.ptr.as_ptr()
    }

    /// The device address as a number.
    pub fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    /// Copies `src` into this buffer at `offset` (host to device, blocking).
    pub fn copy_from_host(&self, offset: usize, src: &[u8]) -> Result<()> {
        check_span("device buffer", offset, src.len(), self.len)?;
        self.device.bind()?;
        // SAFETY: the destination range lies inside this allocation (checked
        // above) and src is a live slice of exactly src.len() bytes.
        unsafe {
            acl_call!(
                self.device.libs(),
                aclrtMemcpy(
                    self.as_ptr().cast::<u8>().add(offset).cast(),
                    self.len - offset,
                    src.as_ptr().cast(),
                    src.len(),
                    sys::ACL_MEMCPY_HOST_TO_DEVICE,
                )
            )
        }
    }

    /// Copies from this buffer at `offset` into `dst` (device to host, blocking).
    pub fn copy_to_host(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        check_span("device buffer", offset, dst.len(), self.len)?;
        self.device.bind()?;
        // SAFETY: the source range lies inside this allocation and dst is an
        // exclusively borrowed slice of dst.len() bytes.
        unsafe {
            acl_call!(
                self.device.libs(),
                aclrtMemcpy(
                    dst.as_mut_ptr().cast(),
                    dst.len(),
                    self.as_ptr().cast::<u8>().add(offset).cast(),
                    dst.len(),
                    sys::ACL_MEMCPY_DEVICE_TO_HOST,
                )
            )
        }
    }

    /// Copies `len` bytes from `src` at `src_offset` into this buffer at
    /// `offset` (device to device, blocking). Both must be on one device.
    pub fn copy_from_device(
        &self,
        offset: usize,
        src: &DeviceBuffer,
        src_offset: usize,
        len: usize,
    ) -> Result<()> {
        check_span("destination buffer", offset, len, self.len)?;
        check_span("source buffer", src_offset, len, src.len)?;
        self.device.bind()?;
        // SAFETY: both ranges lie inside their allocations (checked above).
        unsafe {
            acl_call!(
                self.device.libs(),
                aclrtMemcpy(
                    self.as_ptr().cast::<u8>().add(offset).cast(),
                    self.len - offset,
                    src.as_ptr().cast::<u8>().add(src_offset).cast(),
                    len,
                    sys::ACL_MEMCPY_DEVICE_TO_DEVICE,
                )
            )
        }
    }

    /// Sets `len` bytes at `offset` to `value` (blocking).
    pub fn fill(&self, offset: usize, len: usize, value: u8) -> Result<()> {
        check_span("device buffer", offset, len, self.len)?;
        self.device.bind()?;
        // SAFETY: the range lies inside this allocation (checked above).
        unsafe {
            acl_call!(
                self.device.libs(),
                aclrtMemset(
                    self.as_ptr().cast::<u8>().add(offset).cast(),
                    self.len - offset,
                    i32::from(value),
                    len,
                )
            )
        }
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // Errors cannot be reported from drop; the memory is then leaked,
        // which is the only safe outcome.
        if self.device.bind().is_ok() {
            // SAFETY: ptr came from aclrtMalloc and is freed exactly once.
            let _ = unsafe { acl_call!(self.device.libs(), aclrtFree(self.ptr.as_ptr())) };
        }
    }
}

/// Pinned host memory from `aclrtMallocHost`, freed on drop. Zero-filled
/// when allocated.
pub struct HostBuffer {
    device: Device,
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: HostBuffer owns its bytes like a Box<[u8]>.
unsafe impl Send for HostBuffer {}
// SAFETY: shared access only hands out &[u8] and raw addresses.
unsafe impl Sync for HostBuffer {}

impl std::fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostBuffer")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len)
            .finish()
    }
}

impl HostBuffer {
    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false (zero-byte buffers are refused).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The host address, for raw copies and HCCL descriptors.
    pub fn as_ptr(&self) -> *mut c_void {
        self.ptr.as_ptr().cast()
    }

    /// The host address as a number.
    pub fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    /// The bytes. Do not read while asynchronous work writes into the buffer.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr points to len initialised bytes (zeroed at allocation)
        // that live as long as self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in as_slice, and &mut self makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        if self.device.bind().is_ok() {
            // SAFETY: ptr came from aclrtMallocHost and is freed exactly once.
            let _ =
                unsafe { acl_call!(self.device.libs(), aclrtFreeHost(self.ptr.as_ptr().cast())) };
        }
    }
}
