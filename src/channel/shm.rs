//! `shm`: same-host transfers through shared memory.
//!
//! Our CPU pools live in memfds; the peer opens them through
//! `/proc/<pid>/fd/<fd>` and maps them, so a read or write is a memcpy
//! between the two mappings with no copy in between. Host memory only: an
//! NPU pool is refused (device memory is not host-mappable on real hardware).
//! The peer's liveness is watched through a pidfd: a batch that ran while
//! the peer died reports [`ChannelError::PeerGone`].
//!
//! A peer maps our pools, so nothing here can refuse its access: a revoked
//! write grant is quiescent only once the peer process has exited.

use super::grant::GrantTable;
use super::{
    check_grant_pages, check_ops, pages_of, table_of, watch_ops, Access, BufferDesc, ChannelError,
    Completion, DirectRead, DirectWrite, Endpoint, GrantId, GrantStats, GrantTag, LocalPage,
    OpKind, PeerId, PeerPages, PeerRegistry, PeerTable, ReadOp, TransferChannel, TransferOp,
    WriteOp,
};
use crate::auth::Secret;
use crate::config::ChannelKind;
use crate::memory::copy_pool::{self, CopyPiece};
use crate::memory::{BufferRef, DeviceKind, MemObj, PagePool, SealedMemObj};
use std::collections::{HashMap, HashSet};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use uuid::Uuid;

/// Pieces no larger than this are handed to the copy pool's threads (a
/// batch is pooled from [`copy_pool::PARALLEL_MIN_BYTES`]).
const SLICE_BYTES: usize = 1 << 20;

/// The shm channel of one worker.
pub struct ShmChannel {
    pools: Vec<Arc<PagePool>>,
    peers: PeerRegistry<ShmPeer>,
    grants: GrantTable<Arc<ShmPeer>>,
    auth: Option<Secret>,
}

struct Mapping {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a Mapping is a shared-memory range; it is only accessed through
// raw copies whose ordering the protocol guarantees (one-sided semantics).
unsafe impl Send for Mapping {}
// SAFETY: as above; `&Mapping` only exposes the base pointer and length.
unsafe impl Sync for Mapping {}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: we mapped exactly this range in `attach` and own it.
        unsafe {
            libc::munmap(self.ptr.cast(), self.len);
        }
    }
}

struct ShmPeer {
    node: String,
    table: PeerTable,
    maps: HashMap<Uuid, Mapping>,
    pidfd: Option<OwnedFd>,
    pid: u32,
}

impl ShmPeer {
    /// Whether the peer process still runs.
    fn alive(&self) -> bool {
        match &self.pidfd {
            Some(fd) => {
                let mut p = libc::pollfd {
                    fd: fd.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                };
                // SAFETY: one valid pollfd, zero timeout.
                let n = unsafe { libc::poll(&mut p, 1, 0) };
                // A pidfd becomes readable when the process exits.
                !(n > 0 && p.revents & libc::POLLIN != 0)
            }
            None => {
                // SAFETY: signal 0 only checks existence.
                let r = unsafe { libc::kill(self.pid as libc::pid_t, 0) };
                // Only ESRCH proves the process is gone (EPERM: it runs, as
                // another user).
                r == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
            }
        }
    }
}

impl ShmChannel {
    /// A channel over `pools`, which must be CPU pools in shared memory
    /// (`DualSpec::shareable_cpu`, set automatically for `transfer_channel: shm`).
    pub fn new(pools: &[Arc<PagePool>]) -> Result<ShmChannel, ChannelError> {
        for p in pools {
            let b = p.buffer();
            if b.device() != DeviceKind::Cpu {
                return Err(ChannelError::Unsupported(format!(
                    "the shm channel moves host memory only, but pool {} is on {}; use pd_buffer_device: cpu, or transfer_channel tcp/hccl",
                    b.uuid().simple(),
                    b.device()
                )));
            }
            if b.shared_fd().is_none() {
                return Err(ChannelError::Unsupported(format!(
                    "pool {} is not in shared memory; build it shareable (DualSpec.shareable_cpu)",
                    b.uuid().simple()
                )));
            }
        }
        Ok(ShmChannel {
            pools: pools.to_vec(),
            peers: PeerRegistry::default(),
            grants: GrantTable::default(),
            auth: None,
        })
    }

    /// Requires peers to prove they hold `secret` in the handshake.
    pub fn with_auth(mut self, secret: Option<Secret>) -> ShmChannel {
        self.auth = secret;
        self
    }

    fn peer(&self, id: PeerId) -> Result<Arc<ShmPeer>, ChannelError> {
        self.peers.get(id)
    }
}

fn open_peer_fd(pid: u32, fd: i32) -> Result<OwnedFd, std::io::Error> {
    let path = std::ffi::CString::new(format!("/proc/{pid}/fd/{fd}")).expect("no nul");
    // SAFETY: valid C string; the result is checked.
    let raw = unsafe { libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    if raw < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh fd we own.
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}

/// Before a peer's pool is mapped: the fd must be a memfd of exactly the
/// announced size, sealed against shrinking and growing. An unsealed file
/// could be truncated by its owner (or anyone who can open it) while we
/// copy, and the copy would die of SIGBUS.
fn check_peer_memfd(
    node: &str,
    desc: &BufferDesc,
    fd: i32,
    file: &OwnedFd,
    st: &libc::stat,
) -> Result<(), ChannelError> {
    let pool = desc.uuid.simple();
    let refuse = |what: String| {
        Err(ChannelError::Handshake(format!(
            "peer {node}: pool {pool} (fd {fd}) {what}; refusing to map it. Both sides must run \
             an ascend-pd that seals its shm pools"
        )))
    };
    if st.st_mode & libc::S_IFMT != libc::S_IFREG {
        return refuse("is not a memfd".into());
    }
    let seals = match crate::memory::host::seals_of(file.as_fd()) {
        Ok(s) => s,
        Err(e) => return refuse(format!("is not a sealable memfd ({e})")),
    };
    let needed = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
    if seals & needed != needed {
        return refuse("is not sealed against shrinking and growing".into());
    }
    if st.st_size < 0 || st.st_size as u64 != desc.len {
        return refuse(format!(
            "has {} bytes, but {} were announced",
            st.st_size, desc.len
        ));
    }
    Ok(())
}

fn pidfd_open(pid: u32) -> Option<OwnedFd> {
    // SAFETY: the pidfd_open syscall takes (pid, flags) and returns an fd or -1.
    let raw = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::c_long, 0) };
    // SAFETY: a fresh fd we own when non-negative.
    (raw >= 0).then(|| unsafe { OwnedFd::from_raw_fd(raw as i32) })
}

impl TransferChannel for ShmChannel {
    fn kind(&self) -> ChannelKind {
        ChannelKind::Shm
    }

    fn local_table(&self) -> Vec<BufferDesc> {
        table_of(&self.pools)
    }

    fn endpoint(&self) -> Endpoint {
        Endpoint::Shm {
            pid: std::process::id(),
            fds: self
                .pools
                .iter()
                .map(|p| p.buffer().shared_fd().map_or(-1, |f| f.as_raw_fd()))
                .collect(),
        }
    }

    fn attach(
        &self,
        node: &str,
        table: &[BufferDesc],
        endpoint: &Endpoint,
    ) -> Result<PeerId, ChannelError> {
        let Endpoint::Shm { pid, fds } = endpoint else {
            return Err(ChannelError::Handshake(format!(
                "peer {node} did not send an shm endpoint"
            )));
        };
        if fds.len() != table.len() {
            return Err(ChannelError::Handshake(format!(
                "peer {node} sent {} fds for {} buffers",
                fds.len(),
                table.len()
            )));
        }
        let peer_table = PeerTable::new(table)?;
        let mut maps = HashMap::new();
        // Each buffer its own memfd: one mapped twice would count twice.
        let mut files = HashSet::new();
        for (desc, &fd) in table.iter().zip(fds) {
            if desc.device != DeviceKind::Cpu {
                return Err(ChannelError::Unsupported(format!(
                    "peer {node} registered an {} pool; shm maps host memory only",
                    desc.device
                )));
            }
            let io = |context: String| move |source| ChannelError::Io { context, source };
            let file = open_peer_fd(*pid, fd).map_err(io(format!(
                "opening peer {node}'s pool via /proc/{pid}/fd/{fd} (shm needs both processes on one host, same user)"
            )))?;
            // SAFETY: fstat fills a zeroed stat struct for a valid fd.
            let mut st: libc::stat = unsafe { std::mem::zeroed() };
            // SAFETY: valid fd and out-pointer.
            if unsafe { libc::fstat(file.as_raw_fd(), &mut st) } != 0 {
                return Err(io("fstat of a peer pool".into())(
                    std::io::Error::last_os_error(),
                ));
            }
            let len = usize::try_from(desc.len).map_err(|_| {
                ChannelError::Handshake(format!("peer {node}: pool too large for this host"))
            })?;
            check_peer_memfd(node, desc, fd, &file, &st)?;
            if !files.insert((st.st_dev, st.st_ino)) {
                return Err(ChannelError::Handshake(format!(
                    "peer {node} listed one memfd (fd {fd}) for two buffers; each pool is its own"
                )));
            }
            // SAFETY: mapping `len` bytes of a memfd of exactly that size,
            // sealed so nobody can shrink it under the mapping.
            let ptr = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED,
                    file.as_raw_fd(),
                    0,
                )
            };
            if ptr == libc::MAP_FAILED {
                return Err(io("mapping a peer pool".into())(
                    std::io::Error::last_os_error(),
                ));
            }
            maps.insert(
                desc.uuid,
                Mapping {
                    ptr: ptr.cast(),
                    len,
                },
            );
        }
        let peer = Arc::new(ShmPeer {
            node: node.to_string(),
            table: peer_table,
            maps,
            pidfd: pidfd_open(*pid),
            pid: *pid,
        });
        // A reconnect from the same node replaces (and unmaps) the old mapping.
        Ok(self.peers.insert(node, peer).0)
    }

    fn detach(&self, peer: PeerId) {
        self.peers.remove(peer);
    }

    fn gone_peers(&self) -> Vec<PeerId> {
        self.peers.select(|p| !p.alive())
    }

    fn submit_read(
        &self,
        peer: PeerId,
        ops: Vec<ReadOp>,
    ) -> Result<Completion<MemObj>, ChannelError> {
        self.submit(peer, OpKind::Read, ops)
    }

    fn submit_write(
        &self,
        peer: PeerId,
        tag: GrantTag,
        ops: Vec<WriteOp>,
    ) -> Result<Completion<SealedMemObj>, ChannelError> {
        // One-sided: the peer cannot check a tag; its quarantine of
        // revoked pages is what keeps a late write harmless.
        let _ = tag;
        self.submit(peer, OpKind::Write, ops)
    }

    fn reads_direct(&self, device: DeviceKind) -> bool {
        device == DeviceKind::Cpu
    }

    fn writes_direct(&self, device: DeviceKind) -> bool {
        device == DeviceKind::Cpu
    }

    unsafe fn write_direct(
        &self,
        peer: PeerId,
        tag: GrantTag,
        ops: &[DirectWrite],
        deadline: std::time::Instant,
    ) -> Result<(), ChannelError> {
        // One-sided, as submit_write: a memcpy into a mapped page cannot
        // stall on the peer, and its quarantine of revoked pages keeps a
        // late write harmless.
        let _ = (tag, deadline);
        let plan = |p: &ShmPeer| {
            let mut pieces = Vec::with_capacity(ops.len());
            for (i, op) in ops.iter().enumerate() {
                let page = p
                    .table
                    .resolve_range(i, op.remote, op.offset, op.len, "write")?;
                let map = &p.maps[&op.remote.uuid];
                slice_into(
                    &mut pieces,
                    op.src,
                    map.ptr as usize + page as usize + op.offset,
                    op.len,
                );
            }
            Ok(pieces)
        };
        // SAFETY: resolve_range proved each destination range lies inside
        // a page of a mapped peer pool, granted to us for writing; each
        // source is memory this write's caller may read and nothing writes
        // for the call (write_direct's contract).
        unsafe { self.copy_direct(peer, ops.len(), "write", plan) }
    }

    unsafe fn read_direct(
        &self,
        peer: PeerId,
        ops: &[DirectRead],
        deadline: std::time::Instant,
    ) -> Result<(), ChannelError> {
        // A memcpy from a mapped page cannot stall on the peer; the caller
        // checks the lease once the copies are done.
        let _ = deadline;
        let plan = |p: &ShmPeer| {
            let mut pieces = Vec::with_capacity(ops.len());
            for (i, op) in ops.iter().enumerate() {
                let page = p.table.resolve_direct(i, op)?;
                let map = &p.maps[&op.remote.uuid];
                slice_into(
                    &mut pieces,
                    map.ptr as usize + page as usize + op.offset,
                    op.dst,
                    op.len,
                );
            }
            Ok(pieces)
        };
        // SAFETY: resolve_direct proved each source range lies inside a
        // page of a mapped peer pool; each destination is memory this
        // read's caller may write and nothing else touches for the call
        // (read_direct's contract).
        unsafe { self.copy_direct(peer, ops.len(), "read", plan) }
    }

    fn grant(
        &self,
        peer: PeerId,
        access: Access,
        tag: GrantTag,
        pages: &[BufferRef],
    ) -> Result<GrantId, ChannelError> {
        check_grant_pages(&self.pools, pages)?;
        let (node, p) = self.peers.entry(peer)?;
        Ok(self.grants.add(&node, access, tag, pages, p))
    }

    fn release(&self, grant: GrantId) -> bool {
        self.grants.release(grant)
    }

    fn revoke(&self, grant: GrantId) {
        self.grants.revoke(grant);
    }

    fn is_quiescent(&self, grant: GrantId) -> bool {
        // The peer's mapping of our pools lives as long as its process.
        self.grants
            .settle(grant, |e| e.read_only() || !e.session.alive())
    }

    fn auth(&self) -> Option<&Secret> {
        self.auth.as_ref()
    }

    /// The pages of the peer's mapped pools: attach mapped each buffer of
    /// its table from a distinct sealed memfd of exactly its size.
    fn verified_peer_pages(&self, peer: PeerId) -> PeerPages {
        let Ok(p) = self.peers.get(peer) else {
            return PeerPages::Verified(0);
        };
        PeerPages::Verified(super::table_pages(
            p.table.descs().filter(|d| p.maps.contains_key(&d.uuid)),
        ))
    }

    fn grant_stats(&self) -> GrantStats {
        self.grants.stats()
    }
}

impl ShmChannel {
    /// Runs the copies `plan` makes from `peer`'s mapped pages (a direct
    /// read or write of `ops` ops, `what`), on the copy pool, with the
    /// peer's process checked alive before and after.
    ///
    /// # Safety
    /// Each piece's source must be readable and its destination writable
    /// for its length, nothing else touching either for the call: `plan`
    /// resolves the peer side inside its mapped pages, and the caller
    /// vouches for its own memory.
    unsafe fn copy_direct(
        &self,
        peer: PeerId,
        ops: usize,
        what: &str,
        plan: impl FnOnce(&ShmPeer) -> Result<Vec<CopyPiece>, ChannelError>,
    ) -> Result<(), ChannelError> {
        let p = self.peer(peer)?;
        let pieces = plan(&p)?;
        if !p.alive() {
            return Err(ChannelError::PeerGone {
                peer: p.node.clone(),
                op: None,
                detail: format!("process {} exited", p.pid),
            });
        }
        // SAFETY: the caller's contract for every piece; peer mappings
        // stay mapped while `p` lives, and peer mappings and local memory
        // are distinct, so no destination overlaps a source. copy_pieces
        // splits over threads only pieces whose destinations it proved
        // disjoint.
        unsafe { copy_pool::copy_pieces(&pieces) };
        if !p.alive() {
            return Err(ChannelError::PeerGone {
                peer: p.node.clone(),
                op: Some(ops.saturating_sub(1)),
                detail: format!("process {} exited during the {what}", p.pid),
            });
        }
        Ok(())
    }

    fn submit<P: LocalPage>(
        &self,
        peer: PeerId,
        kind: OpKind,
        ops: Vec<TransferOp<P>>,
    ) -> Result<Completion<P>, ChannelError> {
        let p = self.peer(peer)?;
        let offsets = check_ops(&p.table, &ops, true)?;
        if !p.alive() {
            return Err(ChannelError::PeerGone {
                peer: p.node.clone(),
                op: None,
                detail: format!("process {} exited", p.pid),
            });
        }
        let total: usize = ops.iter().map(|o| o.len).sum();
        if !copy_pool::is_pooled(total) {
            // Small batches (and every batch without a pool) copy inline:
            // a thread hop costs more than the copy.
            let r = run_copies(&p, kind, &ops, &offsets);
            return Ok(Completion::ready(r, pages_of(ops)));
        }
        // Large batches run on the copy pool, split over its threads; the
        // ops (and so their local pages) move into the job and come back
        // with its result.
        let (tx, completion) = Completion::pending(watch_ops(&ops));
        let job = move || {
            let r = run_copies(&p, kind, &ops, &offsets);
            tx.complete(r, pages_of(ops));
        };
        if let Some(job) = copy_pool::spawn_if_pooled(total, job) {
            job();
        }
        Ok(completion)
    }
}

/// Appends the copy of `len` bytes from `src` to `dst` as pieces of at
/// most [`SLICE_BYTES`], so a few large ops still spread over the pool.
fn slice_into(pieces: &mut Vec<CopyPiece>, src: usize, dst: usize, len: usize) {
    let mut done = 0;
    while done < len {
        let n = (len - done).min(SLICE_BYTES);
        pieces.push(CopyPiece {
            src: src + done,
            dst: dst + done,
            len: n,
        });
        done += n;
    }
}

fn run_copies<P: LocalPage>(
    p: &ShmPeer,
    kind: OpKind,
    ops: &[TransferOp<P>],
    offsets: &[u64],
) -> Result<(), ChannelError> {
    let mut pieces = Vec::with_capacity(ops.len());
    for (op, &off) in ops.iter().zip(offsets) {
        let map = &p.maps[&op.remote.uuid];
        let remote = map.ptr as usize + off as usize + op.remote_offset;
        let local = op.local.addr() as usize + op.local_offset;
        let (src, dst) = match kind {
            OpKind::Read => (remote, local),
            OpKind::Write => (local, remote),
        };
        slice_into(&mut pieces, src, dst, op.len);
    }
    // SAFETY: check_ops proved each remote range lies inside a page of a
    // mapped peer pool (mapped while `p` lives) and each local range inside
    // the op's page, a live local page the op holds for the whole batch (a
    // read's page is ours alone; a written remote page is granted to us by
    // the peer, which does not touch it until told the write is done).
    // Peer mappings and our pages are distinct memory, so no destination
    // overlaps a source. copy_pieces splits over threads only pieces whose
    // destinations it proved pairwise disjoint.
    unsafe { copy_pool::copy_pieces(&pieces) };
    if !p.alive() {
        return Err(ChannelError::PeerGone {
            peer: p.node.clone(),
            op: Some(ops.len().saturating_sub(1)),
            detail: format!("process {} exited during the batch", p.pid),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::host::SIZE_SEALS;

    /// A memfd of `len` bytes, with `seals` added.
    fn memfd(len: u64, seals: libc::c_int) -> OwnedFd {
        // SAFETY: valid C string; the result is checked.
        let raw = unsafe { libc::memfd_create(c"peer-pool".as_ptr(), libc::MFD_ALLOW_SEALING) };
        assert!(raw >= 0);
        // SAFETY: a fresh fd we own.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: ftruncate and fcntl on our own fd.
        unsafe {
            assert_eq!(libc::ftruncate(fd.as_raw_fd(), len as libc::off_t), 0);
            if seals != 0 {
                assert_eq!(libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals), 0);
            }
        }
        fd
    }

    fn attach(fd: &OwnedFd, announced: u64) -> Result<PeerId, ChannelError> {
        let ch = ShmChannel::new(&[]).unwrap();
        let desc = BufferDesc {
            uuid: Uuid::new_v4(),
            base: 0x10_0000,
            len: announced,
            page_size: 4096,
            device: DeviceKind::Cpu,
        };
        let ep = Endpoint::Shm {
            pid: std::process::id(),
            fds: vec![fd.as_raw_fd()],
        };
        ch.attach("peer", &[desc], &ep)
    }

    #[test]
    fn a_peer_pool_is_mapped_only_as_a_sealed_memfd_of_the_announced_size() {
        let len = 16 * 4096;
        let refused = |fd: &OwnedFd, announced: u64, why: &str| {
            let e = attach(fd, announced).unwrap_err().to_string();
            assert!(
                e.contains("refusing to map") && e.contains(why),
                "{why}: {e}"
            );
        };
        // Unsealed: its owner could shrink it under our copies (SIGBUS).
        refused(
            &memfd(len, 0),
            len,
            "not sealed against shrinking and growing",
        );
        refused(&memfd(len, libc::F_SEAL_GROW), len, "not sealed");
        // Sealed, but not the size announced (larger or smaller).
        refused(&memfd(len, SIZE_SEALS), 2 * len, "were announced");
        refused(&memfd(len, SIZE_SEALS), len / 2, "were announced");
        // Not a memfd at all.
        let dir = std::env::temp_dir().join(format!("apd-shm-{}", std::process::id()));
        std::fs::write(&dir, vec![0u8; len as usize]).unwrap();
        let file: OwnedFd = std::fs::File::open(&dir).unwrap().into();
        refused(&file, len, "not a sealable memfd");
        std::fs::remove_file(&dir).ok();
        // A sealed memfd of the right size is mapped.
        assert!(attach(&memfd(len, SIZE_SEALS), len).is_ok());
    }

    #[test]
    fn a_peer_cannot_shrink_our_pool_under_its_mapping() {
        use crate::memory::{DualAllocator, DualSpec, PoolKind};
        let spec = DualSpec {
            cpu_bytes: Some(8 * 4096),
            npu: None,
            page_size: 4096,
            placement: PoolKind::Cpu,
            shareable_cpu: true,
        };
        let alloc = DualAllocator::new(&spec, None).unwrap();
        let pool = Arc::clone(alloc.pools().next().unwrap());
        let ch = ShmChannel::new(&[Arc::clone(&pool)]).unwrap();
        let Endpoint::Shm { pid, fds } = ch.endpoint() else {
            unreachable!()
        };
        // What a peer does: open the pool through /proc, then truncate it.
        let theirs = open_peer_fd(pid, fds[0]).unwrap();
        // SAFETY: ftruncate on a valid fd; it must fail.
        let rc = unsafe { libc::ftruncate(theirs.as_raw_fd(), 0) };
        assert_eq!(rc, -1);
        assert_eq!(
            std::io::Error::last_os_error().raw_os_error(),
            Some(libc::EPERM)
        );
        // The pool is whole: its last byte is still ours to write.
        let last = pool.buffer().len() - 1;
        // SAFETY: `last` is inside the pool's host region.
        unsafe { pool.buffer().host_ptr().unwrap().add(last).write(1) };
    }
}
