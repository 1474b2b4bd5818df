//! Page-aligned host memory for CPU pools.
//!
//! Regions are aligned to 2 MiB so transparent huge pages can back them, and
//! can be created in a memfd so another process on the host can map the same
//! pages (the `shm` channel exports them this way).

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;

/// Alignment of every host region: the x86-64 / aarch64 huge page size.
pub const HOST_REGION_ALIGN: usize = 2 << 20;

/// An owned, mapped, zero-initialised range of host memory.
#[derive(Debug)]
pub struct HostRegion {
    ptr: NonNull<u8>,
    len: usize,
    fd: Option<OwnedFd>,
}

// SAFETY: the region is plain memory owned by this value; access goes through
// raw pointers whose synchronisation is the caller's (page ownership) business.
unsafe impl Send for HostRegion {}
// SAFETY: as above; `&HostRegion` only hands out the base address and the fd.
unsafe impl Sync for HostRegion {}

/// The seals of a shared region's memfd: its size can never change, and
/// no further seal can be added (so nobody can forbid our writes).
pub const SIZE_SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;

/// The seals on `fd`; an error when it cannot be sealed at all (not a memfd).
pub fn seals_of(fd: std::os::fd::BorrowedFd<'_>) -> io::Result<libc::c_int> {
    // SAFETY: fcntl(F_GET_SEALS) on a valid fd takes no argument.
    let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    if seals < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(seals)
}

/// The kernel's page size: 4 KiB on x86-64, 4, 16 or 64 KiB on aarch64.
fn page_size() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(p).ok().filter(|&p| p > 0).unwrap_or(4096)
}

impl HostRegion {
    /// Private anonymous memory of `len` bytes (`len` > 0), 2 MiB aligned.
    pub fn anonymous(len: usize) -> io::Result<HostRegion> {
        Self::map(len, None)
    }

    /// Memory in a new memfd named `name`, shareable with other processes
    /// through [`HostRegion::fd`]. The memfd is sealed at its size
    /// ([`SIZE_SEALS`]): a process that opens it can never shrink it under
    /// our mapping (which would SIGBUS us) nor grow it.
    pub fn shared(len: usize, name: &str) -> io::Result<HostRegion> {
        let cname = std::ffi::CString::new(name.replace('\0', "_")).expect("nul removed");
        // SAFETY: memfd_create reads a valid NUL-terminated string and returns a new fd or -1.
        let raw = unsafe {
            libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a fresh fd we own.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let size = libc::off_t::try_from(len)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "region too large"))?;
        // SAFETY: ftruncate on our own fd.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), size) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fcntl on our own fd with an integer argument.
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, SIZE_SEALS) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Self::map(len, Some(fd))
    }

    fn map(len: usize, fd: Option<OwnedFd>) -> io::Result<HostRegion> {
        if len == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "host region of 0 bytes",
            ));
        }
        let reserve = len
            .checked_add(HOST_REGION_ALIGN)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "region too large"))?;
        // Reserve address space with slack, then place the real mapping at the
        // first 2 MiB boundary inside it and give back the rest.
        // SAFETY: an anonymous PROT_NONE reservation touches no existing mapping.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                reserve,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let start = raw as usize;
        let aligned = start.next_multiple_of(HOST_REGION_ALIGN);
        let (flags, fd_raw) = match &fd {
            Some(f) => (libc::MAP_SHARED | libc::MAP_FIXED, f.as_raw_fd()),
            None => (
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                -1,
            ),
        };
        // SAFETY: [aligned, aligned+len) lies inside the reservation we own, so
        // MAP_FIXED replaces only our own PROT_NONE pages.
        let mapped = unsafe {
            libc::mmap(
                aligned as *mut libc::c_void,
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                flags,
                fd_raw,
                0,
            )
        };
        let err = (mapped == libc::MAP_FAILED).then(io::Error::last_os_error);
        // Trim the slack before and after (or everything on failure). The
        // mapping ends at a page boundary (munmap takes only page-aligned
        // addresses): on a kernel with 64 KiB pages (aarch64) a `len` that
        // is a multiple of 4 KiB still ends mid-page.
        let head = aligned - start;
        let tail_start = aligned + len.next_multiple_of(page_size());
        let tail = start + reserve - tail_start;
        // SAFETY: each range is part of our reservation and not the live mapping.
        unsafe {
            if let Some(e) = err {
                libc::munmap(raw, reserve);
                return Err(e);
            }
            if head > 0 {
                libc::munmap(raw, head);
            }
            if tail > 0 {
                libc::munmap(tail_start as *mut libc::c_void, tail);
            }
            // Advisory only: THP may be disabled, which is fine.
            libc::madvise(mapped, len, libc::MADV_HUGEPAGE);
        }
        Ok(HostRegion {
            ptr: NonNull::new(mapped.cast()).expect("mmap returned a non-null address"),
            len,
            fd,
        })
    }

    /// Base address.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: regions are never empty.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The memfd holding the pages, for regions made by [`HostRegion::shared`].
    pub fn fd(&self) -> Option<BorrowedFd<'_>> {
        self.fd.as_ref().map(|f| f.as_fd())
    }

    /// Faults every page in now, so first-touch cost is not paid mid-transfer.
    pub fn prefault(&self) {
        // One syscall where the kernel has MADV_POPULATE_WRITE (5.14+).
        const MADV_POPULATE_WRITE: libc::c_int = 23;
        // SAFETY: advising our own writable mapping; contents are unchanged.
        if unsafe { libc::madvise(self.ptr.as_ptr().cast(), self.len, MADV_POPULATE_WRITE) } == 0 {
            return;
        }
        let step = 4096;
        let mut off = 0;
        while off < self.len {
            // SAFETY: off < len, inside our writable mapping; the volatile
            // read-modify-write of the same value keeps contents unchanged.
            unsafe {
                let p = self.ptr.as_ptr().add(off);
                p.write_volatile(p.read_volatile());
            }
            off += step;
        }
    }
}

impl Drop for HostRegion {
    fn drop(&mut self) {
        // SAFETY: we own exactly this mapping; nobody can use it after drop.
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.len);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regions_are_aligned_zeroed_and_writable() {
        for r in [
            HostRegion::anonymous(3 * 4096 + 5).unwrap(),
            HostRegion::shared(3 * 4096 + 5, "test").unwrap(),
        ] {
            assert_eq!(r.as_ptr() as usize % HOST_REGION_ALIGN, 0);
            // SAFETY: the region is len bytes of writable memory owned by `r`.
            let s = unsafe { std::slice::from_raw_parts_mut(r.as_ptr(), r.len()) };
            assert!(s.iter().all(|&b| b == 0));
            s.fill(0xAB);
            r.prefault();
            assert!(s.iter().all(|&b| b == 0xAB));
        }
    }

    #[test]
    fn shared_region_is_visible_through_its_fd() {
        let r = HostRegion::shared(8192, "visible").unwrap();
        // SAFETY: writable region owned by `r`.
        unsafe { r.as_ptr().add(100).write(42) };
        let fd = r.fd().unwrap().as_raw_fd();
        // SAFETY: mapping our own memfd read-only, unmapped below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                8192,
                libc::PROT_READ,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        // SAFETY: offset 100 is inside the 8192-byte mapping.
        let v = unsafe { p.cast::<u8>().add(100).read() };
        // SAFETY: unmapping what we mapped.
        unsafe { libc::munmap(p, 8192) };
        assert_eq!(v, 42);
    }

    #[test]
    fn a_shared_regions_memfd_can_be_neither_shrunk_nor_grown() {
        let r = HostRegion::shared(8192, "sealed").unwrap();
        let fd = r.fd().unwrap();
        assert_eq!(seals_of(fd).unwrap() & SIZE_SEALS, SIZE_SEALS);
        for size in [0, 4096, 16384] {
            // SAFETY: ftruncate on a valid fd; it must fail.
            let rc = unsafe { libc::ftruncate(fd.as_raw_fd(), size) };
            assert_eq!(rc, -1, "resized to {size}");
            assert_eq!(io::Error::last_os_error().raw_os_error(), Some(libc::EPERM));
        }
        // Still whole, and nobody can lift the seals.
        // SAFETY: the region is 8192 bytes and ours.
        unsafe { r.as_ptr().add(8191).write(7) };
        // SAFETY: fcntl on a valid fd with an integer argument; it must fail.
        let rc = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_WRITE) };
        assert_eq!(rc, -1);
    }

    #[test]
    fn zero_length_is_an_error() {
        assert!(HostRegion::anonymous(0).is_err());
    }
}
