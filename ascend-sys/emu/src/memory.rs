//! Emulated device and pinned-host memory.
//!
//! Every allocation is a memfd mapped `MAP_SHARED` into this process, so a
//! peer process can map the same pages (through `/proc/<pid>/fd/<fd>`) when
//! HCCL grants it access. The memfd is named `ascend-emu-<pid>-<id>` so the
//! peer can check that the descriptor still names the region it was told
//! about.

use std::collections::BTreeMap;
use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;

/// Where an allocation lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Placement {
    /// Device memory of the given device id (`aclrtMalloc`).
    Device(i32),
    /// Pinned host memory (`aclrtMallocHost`).
    Host,
}

/// One allocation: a mapped memfd.
#[derive(Debug)]
pub(crate) struct Region {
    pub id: u64,
    pub base: usize,
    pub len: usize,
    map_len: usize,
    fd: OwnedFd,
    pub placement: Placement,
}

pub(crate) fn page_size() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(p).ok().filter(|p| *p > 0).unwrap_or(4096)
}

pub(crate) fn round_up(n: usize, to: usize) -> Option<usize> {
    n.checked_add(to - 1).map(|v| v / to * to)
}

/// The memfd name of region `id` created by process `pid`.
pub(crate) fn memfd_name(pid: u32, id: u64) -> String {
    format!("ascend-emu-{pid}-{id}")
}

/// Allocations of at least this size start on a multiple of it, as the
/// runtime's huge-page allocations do (HCCS wants 2 MiB-aligned memory).
pub(crate) const HUGE_ALIGN: usize = 2 << 20;

/// Maps `len` bytes of `fd` shared and read-write; at a `HUGE_ALIGN`
/// boundary when `len` is at least that.
fn map_aligned(fd: i32, len: usize) -> io::Result<usize> {
    let map_fd_at = |at: *mut libc::c_void, flags: i32| {
        // SAFETY: fd is a valid memfd of at least len bytes; `at` is either
        // NULL (kernel's choice) or inside a reservation this function owns.
        let p = unsafe {
            libc::mmap(
                at,
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | flags,
                fd,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            Err(io::Error::last_os_error())
        } else {
            Ok(p as usize)
        }
    };
    if len < HUGE_ALIGN {
        return map_fd_at(std::ptr::null_mut(), 0);
    }
    // Reserve len + HUGE_ALIGN of address space, place the mapping on the
    // first boundary inside it, and give back the slack on both sides.
    let reserve_len = len + HUGE_ALIGN;
    // SAFETY: an anonymous PROT_NONE reservation at a kernel-chosen address.
    let reserve = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            reserve_len,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if reserve == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    let start = reserve as usize;
    let aligned = start.next_multiple_of(HUGE_ALIGN);
    let placed = map_fd_at(aligned as *mut libc::c_void, libc::MAP_FIXED);
    let (keep_from, keep_len) = match placed {
        Ok(_) => (aligned, len),
        Err(_) => (start, 0),
    };
    let tail = keep_from + keep_len;
    // SAFETY: both ranges lie inside the reservation made above and hold
    // nothing of ours (the mapping, if placed, is [keep_from, tail)).
    unsafe {
        if keep_from > start {
            libc::munmap(start as *mut libc::c_void, keep_from - start);
        }
        if start + reserve_len > tail {
            libc::munmap(tail as *mut libc::c_void, start + reserve_len - tail);
        }
    }
    placed
}

impl Region {
    /// Creates and maps a zero-filled region of `len` bytes.
    pub(crate) fn create(id: u64, len: usize, placement: Placement) -> io::Result<Region> {
        let map_len = round_up(len, page_size())
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "size overflows"))?;
        let name = CString::new(memfd_name(std::process::id(), id)).expect("no NUL in name");
        // SAFETY: name is a valid NUL-terminated string; flags are valid.
        let raw = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: raw is a freshly created descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let size = libc::off_t::try_from(map_len)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "size overflows off_t"))?;
        // SAFETY: fd is a valid memfd we own.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), size) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let ptr = map_aligned(fd.as_raw_fd(), map_len)?;
        Ok(Region {
            id,
            base: ptr,
            len,
            map_len,
            fd,
            placement,
        })
    }

    /// The memfd number in this process.
    pub(crate) fn raw_fd(&self) -> i32 {
        self.fd.as_raw_fd()
    }

    pub(crate) fn end(&self) -> usize {
        self.base + self.len
    }

    pub(crate) fn describe(&self) -> String {
        let place = match self.placement {
            Placement::Device(d) => format!("device {d} memory"),
            Placement::Host => "pinned host memory".to_string(),
        };
        format!("{place} [{:#x}, {:#x})", self.base, self.end())
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: base/map_len are exactly what mmap returned; every task that
        // could still touch the pages holds an Arc<Region>, so none remain.
        unsafe {
            libc::munmap(self.base as *mut libc::c_void, self.map_len);
        }
    }
}

/// Another process's allocation (or part of it) mapped into this one
/// through `/proc/<pid>/fd/<fd>`, as the peer's memfd.
#[derive(Debug)]
pub(crate) struct PeerMapping {
    map_base: usize,
    map_len: usize,
    /// Offset of the mapped range's first byte inside the mapping.
    delta: usize,
}

/// Why a peer's memory could not be mapped.
#[derive(Debug)]
pub(crate) enum PeerMapError {
    /// The descriptor no longer names that allocation: freed, or the
    /// process exited.
    Gone,
    /// Opening or mapping failed for another reason.
    Os(String),
}

impl PeerMapping {
    /// Maps `size` bytes at `offset` of region `region_id` of process
    /// `pid`, whose memfd is its descriptor `fd`; checks first that the
    /// descriptor still names that region.
    pub(crate) fn open(
        pid: u32,
        fd: i32,
        region_id: u64,
        offset: usize,
        size: usize,
    ) -> Result<PeerMapping, PeerMapError> {
        let path = format!("/proc/{pid}/fd/{fd}");
        if !peer_region_alive(pid, fd, region_id) {
            return Err(PeerMapError::Gone);
        }
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| PeerMapError::Os(format!("cannot open {path}: {e}")))?;
        let page = page_size();
        let page_off = offset / page * page;
        let delta = offset - page_off;
        let map_len = delta
            .checked_add(size)
            .and_then(|n| round_up(n, page))
            .ok_or_else(|| PeerMapError::Os("size overflows".into()))?;
        let file_len = file
            .metadata()
            .map_err(|e| PeerMapError::Os(e.to_string()))?
            .len();
        if (page_off + map_len) as u64 > file_len {
            return Err(PeerMapError::Gone);
        }
        // SAFETY: maps map_len bytes of a shared memfd at a page-aligned
        // offset inside the file (checked above); the kernel picks the address.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                page_off as libc::off_t,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(PeerMapError::Os(format!(
                "cannot map peer memory: {}",
                io::Error::last_os_error()
            )));
        }
        Ok(PeerMapping {
            map_base: ptr as usize,
            map_len,
            delta,
        })
    }

    /// This process's address of the mapped range's first byte.
    pub(crate) fn base(&self) -> usize {
        self.map_base + self.delta
    }
}

impl Drop for PeerMapping {
    fn drop(&mut self) {
        // SAFETY: exactly the mapping mmap returned; whoever copies through
        // it holds an Arc to its owner, so nothing uses it any more.
        unsafe {
            libc::munmap(self.map_base as *mut libc::c_void, self.map_len);
        }
    }
}

/// True while process `pid`'s descriptor `fd` is the memfd of its region
/// `region_id` (false once the region is freed or the process is gone).
pub(crate) fn peer_region_alive(pid: u32, fd: i32, region_id: u64) -> bool {
    std::fs::read_link(format!("/proc/{pid}/fd/{fd}")).is_ok_and(|link| {
        link.to_string_lossy()
            .contains(&format!("/memfd:{} ", memfd_name(pid, region_id)))
    })
}

/// Where an address range falls among the known allocations.
pub(crate) enum Lookup {
    /// Entirely inside this allocation.
    Inside(Arc<Region>),
    /// Starts inside this allocation but runs past its end.
    Overruns(Arc<Region>),
    /// Not inside any allocation.
    Unknown,
}

/// All live allocations of the process, by base address.
#[derive(Default)]
pub(crate) struct Regions {
    by_base: BTreeMap<usize, Arc<Region>>,
}

impl Regions {
    pub(crate) fn insert(&mut self, region: Arc<Region>) {
        self.by_base.insert(region.base, region);
    }

    /// Removes the allocation whose base is exactly `base`.
    pub(crate) fn remove_base(&mut self, base: usize) -> Option<Arc<Region>> {
        self.by_base.remove(&base)
    }

    pub(crate) fn get_base(&self, base: usize) -> Option<&Arc<Region>> {
        self.by_base.get(&base)
    }

    /// Finds the allocation holding `[addr, addr + len)`.
    pub(crate) fn lookup(&self, addr: usize, len: usize) -> Lookup {
        match self.by_base.range(..=addr).next_back() {
            Some((_, r)) if addr < r.end() || (len == 0 && addr == r.end()) => {
                match addr.checked_add(len) {
                    Some(end) if end <= r.end() => Lookup::Inside(r.clone()),
                    _ => Lookup::Overruns(r.clone()),
                }
            }
            _ => Lookup::Unknown,
        }
    }

    /// Bytes currently allocated on `device`.
    pub(crate) fn device_bytes(&self, device: i32) -> usize {
        self.by_base
            .values()
            .filter(|r| r.placement == Placement::Device(device))
            .map(|r| r.len)
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn region_is_zeroed_shared_memory_with_a_named_memfd() {
        let r = Region::create(7, 10_000, Placement::Host).unwrap();
        // SAFETY: the region maps at least len bytes at base.
        let bytes = unsafe { std::slice::from_raw_parts(r.base as *const u8, r.len) };
        assert!(bytes.iter().all(|b| *b == 0));
        let link = std::fs::read_link(format!("/proc/self/fd/{}", r.raw_fd())).unwrap();
        let expected = memfd_name(std::process::id(), 7);
        assert!(
            link.to_string_lossy().contains(&expected),
            "{link:?} should name {expected}"
        );
    }

    #[test]
    fn a_peer_mapping_sees_the_same_bytes_and_notices_a_freed_region() {
        let r = Region::create(9, 3 * page_size(), Placement::Host).unwrap();
        let at = page_size() + 100;
        // SAFETY: [base + at, +4) lies inside the region's mapping.
        unsafe {
            std::ptr::copy_nonoverlapping([1u8, 2, 3, 4].as_ptr(), (r.base + at) as *mut u8, 4)
        };
        let pid = std::process::id();
        let m = PeerMapping::open(pid, r.raw_fd(), 9, at, 4).unwrap();
        // SAFETY: the mapping holds the 4 bytes at base().
        let seen = unsafe { std::slice::from_raw_parts(m.base() as *const u8, 4) };
        assert_eq!(seen, [1, 2, 3, 4]);
        assert!(peer_region_alive(pid, r.raw_fd(), 9));
        assert!(!peer_region_alive(pid, r.raw_fd(), 10), "another region id");
        let fd = r.raw_fd();
        drop(r);
        assert!(matches!(
            PeerMapping::open(pid, fd, 9, 0, 4),
            Err(PeerMapError::Gone)
        ));
    }

    #[test]
    fn lookup_tells_inside_overrun_and_unknown_apart() {
        let mut regions = Regions::default();
        let r = Arc::new(Region::create(1, 4096, Placement::Device(0)).unwrap());
        let base = r.base;
        regions.insert(r);
        assert!(matches!(regions.lookup(base + 10, 100), Lookup::Inside(_)));
        assert!(matches!(
            regions.lookup(base + 4000, 200),
            Lookup::Overruns(_)
        ));
        assert!(matches!(regions.lookup(base + 4096, 1), Lookup::Unknown));
        assert!(matches!(regions.lookup(base - 1, 1), Lookup::Unknown));
        assert_eq!(regions.device_bytes(0), 4096);
        assert_eq!(regions.device_bytes(1), 0);
    }
}
