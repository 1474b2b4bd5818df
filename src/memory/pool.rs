//! The paged allocator over one [`RegisteredBuffer`], and the page
//! handles it gives out.
//!
//! # Who may touch a page's bytes
//!
//! A page has exactly one of these owners at any time, and the types say
//! which:
//!
//! | handle | who has it | bytes |
//! |---|---|---|
//! | [`MemObj`] | one owner (not `Clone`) | read and write ([`MemObj::host_bytes_mut`]) |
//! | [`SealedMemObj`] | any number of holders (`Clone`) | read only, never written again |
//! | [`LentPage`] | a remote peer or a device copy is using it | none |
//!
//! [`MemObj::seal`] freezes a page so it can be shared (a chunk to send, a
//! chunk the load path scatters from); [`SealedMemObj::try_unseal`] gives
//! the writable handle back only when no other holder is left. A transfer
//! takes its pages by value and its completion gives them back (see
//! `channel`). [`MemObj::lend`] hands a page to a peer that writes it
//! one-sidedly; [`LentPage::landed`] takes it back once the peer reported
//! completion, [`LentPage::release_quiescent`] returns it to the pool once
//! the peer can no longer touch it. Until then a lent page whose lending
//! ended early is *quarantined*: counted in [`PoolStats::quarantined`],
//! and never handed to anyone else. A [`LentPage`] dropped without either
//! call stays quarantined for good rather than risk a late write landing in
//! a page someone else owns.
//!
//! Pages held by a transfer whose completion was given up on (the waiter
//! dropped it) are quarantined the same way until the transfer ends.
//!
//! ```
//! use ascend_pd::layout::{ChunkLayout, Dtype, MemFormat};
//! use ascend_pd::memory::{ChunkMeta, MemObj, PagePool, RegisteredBuffer};
//!
//! let layout = ChunkLayout { fmt: MemFormat::Kv2Ltd, layers: 1, tokens: 4, hidden: 8, dtype: Dtype::UInt8 };
//! let pool = PagePool::new(RegisteredBuffer::host(4 * 64, 64, false)?);
//! let mut page: MemObj = pool.allocate(ChunkMeta::full(layout))?;
//! page.host_bytes_mut().unwrap().fill(7); // sole owner: may write
//! let chunk = page.seal(); // from now on only read, by any number of holders
//! let reader = chunk.clone();
//! assert_eq!(reader.host_bytes().unwrap()[0], 7);
//! let chunk = chunk.try_unseal().unwrap_err(); // `reader` still reads it
//! drop(reader);
//! let page = chunk.try_unseal().unwrap(); // writable again: nobody else holds it
//! let lent = page.lend(); // a peer writes it now: no local access at all
//! lent.quarantine(); // its lending ended without a report
//! assert_eq!(pool.stats().quarantined, 1);
//! lent.release_quiescent(); // the peer provably cannot touch it any more
//! assert_eq!((pool.stats().allocated, pool.stats().quarantined), (0, 0));
//! # Ok::<(), ascend_pd::memory::MemoryError>(())
//! ```
//!
//! What the types refuse (each of these was possible before, and each
//! could let bytes land in a page someone else was using):
//!
//! A page handed to a transfer is the transfer's until its completion gives
//! it back:
//! ```compile_fail,E0382
//! # use ascend_pd::layout::{ChunkLayout, Dtype, MemFormat};
//! # use ascend_pd::memory::{BufferRef, ChunkMeta, PagePool, RegisteredBuffer};
//! # use ascend_pd::channel::ReadOp;
//! # let layout = ChunkLayout { fmt: MemFormat::Kv2Ltd, layers: 1, tokens: 4, hidden: 8, dtype: Dtype::UInt8 };
//! # let pool = PagePool::new(RegisteredBuffer::host(64, 64, false).unwrap());
//! # let remote = BufferRef { uuid: uuid::Uuid::nil(), page: 0 };
//! let page = pool.allocate(ChunkMeta::full(layout)).unwrap();
//! let op = ReadOp::chunk(page, remote); // a read will write it
//! let bytes = page.host_bytes(); // error: the page moved into the op
//! ```
//! A page is never shared writable:
//! ```compile_fail,E0308
//! # use ascend_pd::layout::{ChunkLayout, Dtype, MemFormat};
//! # use ascend_pd::memory::{ChunkMeta, MemObj, PagePool, RegisteredBuffer};
//! # let layout = ChunkLayout { fmt: MemFormat::Kv2Ltd, layers: 1, tokens: 4, hidden: 8, dtype: Dtype::UInt8 };
//! # let pool = PagePool::new(RegisteredBuffer::host(64, 64, false).unwrap());
//! let page = pool.allocate(ChunkMeta::full(layout)).unwrap();
//! let copy: MemObj = page.clone(); // error: MemObj is not Clone
//! ```
//! A sealed page is never written again:
//! ```compile_fail,E0599
//! # use ascend_pd::layout::{ChunkLayout, Dtype, MemFormat};
//! # use ascend_pd::memory::{ChunkMeta, PagePool, RegisteredBuffer};
//! # let layout = ChunkLayout { fmt: MemFormat::Kv2Ltd, layers: 1, tokens: 4, hidden: 8, dtype: Dtype::UInt8 };
//! # let pool = PagePool::new(RegisteredBuffer::host(64, 64, false).unwrap());
//! let mut chunk = pool.allocate(ChunkMeta::full(layout)).unwrap().seal();
//! chunk.host_bytes_mut(); // error: no such method on a sealed page
//! ```
//! Nor is the KV cache gathered into one (a device copy writes the page,
//! which moves into the gather):
//! ```compile_fail,E0308
//! # use ascend_pd::layout::{ChunkLayout, Dtype, MemFormat};
//! # use ascend_pd::memory::{ChunkMeta, PagePool, RegisteredBuffer};
//! # use ascend_pd::kv::{KvCache, KvCacheSpec};
//! # let layout = ChunkLayout { fmt: MemFormat::Kv2Ltd, layers: 1, tokens: 4, hidden: 8, dtype: Dtype::UInt8 };
//! # let pool = PagePool::new(RegisteredBuffer::host(64, 64, false).unwrap());
//! # let mut cache = KvCache::host(KvCacheSpec::for_layout(&layout, 1, 4)).unwrap();
//! let chunk = pool.allocate(ChunkMeta::full(layout)).unwrap().seal();
//! cache.gather(&[0, 1, 2, 3], &chunk); // error: gather takes the `MemObj`
//! ```
//! A page lent to a peer has no local byte access:
//! ```compile_fail,E0599
//! # use ascend_pd::layout::{ChunkLayout, Dtype, MemFormat};
//! # use ascend_pd::memory::{ChunkMeta, PagePool, RegisteredBuffer};
//! # let layout = ChunkLayout { fmt: MemFormat::Kv2Ltd, layers: 1, tokens: 4, hidden: 8, dtype: Dtype::UInt8 };
//! # let pool = PagePool::new(RegisteredBuffer::host(64, 64, false).unwrap());
//! let lent = pool.allocate(ChunkMeta::full(layout)).unwrap().lend();
//! lent.host_bytes(); // error: no such method on a lent page
//! ```

use super::buffer::{BufferRef, DeviceKind, RegisteredBuffer};
use super::MemoryError;
use crate::layout::{ChunkLayout, Dtype, MemFormat};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::Instant;
use uuid::Uuid;

/// Counters of one pool, read atomically together.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Pages in the pool.
    pub total: usize,
    /// Pages free.
    pub free: usize,
    /// Pages handed out (`total - free`), quarantined ones included.
    pub allocated: usize,
    /// Allocated pages currently pinned.
    pub pinned: usize,
    /// Allocated pages nobody may use yet: a peer or an abandoned transfer
    /// may still touch them. They return to the pool once it cannot.
    pub quarantined: usize,
    /// Most pages ever allocated at once.
    pub high_water: usize,
    /// Most pages ever pinned at once.
    pub pinned_high_water: usize,
    /// Allocation requests that could not be satisfied (exhaustion or deadline).
    pub failed_allocations: u64,
}

#[derive(Debug)]
struct PoolState {
    free: Vec<u32>,
    pinned: usize,
    quarantined: usize,
    high_water: usize,
    pinned_high_water: usize,
    failed: u64,
}

/// A thread-safe allocator of fixed-size pages over one registered buffer.
///
/// Allocation and release are O(1) (a free-list stack). Pages come back
/// only when their last handle drops, so no caller frees by hand.
pub struct PagePool {
    buffer: RegisteredBuffer,
    state: Mutex<PoolState>,
    page_freed: Condvar,
}

impl fmt::Debug for PagePool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PagePool")
            .field("uuid", &self.buffer.uuid())
            .field("device", &self.buffer.device())
            .field("stats", &self.stats())
            .finish()
    }
}

/// What a page will hold: the chunk layout and how many of its tokens are real.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkMeta {
    /// The full-chunk layout.
    pub layout: ChunkLayout,
    /// Tokens actually present (`layout.tokens` for a full chunk).
    pub tokens: usize,
    /// Where this chunk's `layout.hidden` elements start in a token of the
    /// KV cache: 0 unless the chunk is a head piece of a heterogeneous-TP
    /// transfer (the KV module's `tp` plan decides the pieces).
    pub hidden_offset: usize,
}

impl ChunkMeta {
    /// A full chunk of `layout`.
    pub fn full(layout: ChunkLayout) -> ChunkMeta {
        ChunkMeta {
            layout,
            tokens: layout.tokens,
            hidden_offset: 0,
        }
    }

    /// A chunk of `layout` holding `tokens` tokens (a partial last chunk when fewer than a full one).
    pub fn partial(layout: ChunkLayout, tokens: usize) -> ChunkMeta {
        ChunkMeta {
            layout,
            tokens,
            hidden_offset: 0,
        }
    }

    /// This chunk as the piece of a token's elements starting at `offset`
    /// (a head slice; see [`ChunkMeta::hidden_offset`]).
    pub fn at_hidden_offset(self, offset: usize) -> ChunkMeta {
        ChunkMeta {
            hidden_offset: offset,
            ..self
        }
    }

    /// Real bytes of this chunk.
    pub fn byte_len(&self) -> usize {
        self.layout.bytes_for(self.tokens)
    }

    /// The wire shape of this chunk.
    pub fn shape(&self) -> [usize; 4] {
        self.layout.shape_for(self.tokens)
    }

    /// The byte ranges `(offset, len)` of layer `layer` in this chunk's
    /// page, one per plane (K then V; MLA: one): the chunk is `[planes,
    /// layers, tokens, hidden]`, so a layer's row of each plane is
    /// contiguous. `None` past the last layer.
    pub fn layer_ranges(&self, layer: usize) -> Option<Vec<(usize, usize)>> {
        let [planes, layers, tokens, hidden] = self.shape();
        if layer >= layers {
            return None;
        }
        let row = tokens * hidden * self.layout.dtype.size();
        Some(
            (0..planes)
                .map(|p| ((p * layers + layer) * row, row))
                .collect(),
        )
    }
}

impl PagePool {
    /// A pool with every page of `buffer` free.
    pub fn new(buffer: RegisteredBuffer) -> Arc<PagePool> {
        let n = buffer.num_pages() as u32;
        // Reverse so pages are handed out in ascending order from a fresh pool.
        let free: Vec<u32> = (0..n).rev().collect();
        Arc::new(PagePool {
            buffer,
            state: Mutex::new(PoolState {
                free,
                pinned: 0,
                quarantined: 0,
                high_water: 0,
                pinned_high_water: 0,
                failed: 0,
            }),
            page_freed: Condvar::new(),
        })
    }

    /// The registered buffer behind the pool.
    pub fn buffer(&self) -> &RegisteredBuffer {
        &self.buffer
    }

    /// The buffer's UUID.
    pub fn uuid(&self) -> Uuid {
        self.buffer.uuid()
    }

    /// The counters, consistent with each other.
    pub fn stats(&self) -> PoolStats {
        let s = self.lock();
        let total = self.buffer.num_pages();
        PoolStats {
            total,
            free: s.free.len(),
            allocated: total - s.free.len(),
            pinned: s.pinned,
            quarantined: s.quarantined,
            high_water: s.high_water,
            pinned_high_water: s.pinned_high_water,
            failed_allocations: s.failed,
        }
    }

    /// One page now, or [`MemoryError::Exhausted`].
    pub fn allocate(self: &Arc<Self>, meta: ChunkMeta) -> Result<MemObj, MemoryError> {
        Ok(self.allocate_batch(&[meta])?.pop().expect("one page"))
    }

    /// `metas.len()` pages now, all or nothing.
    pub fn allocate_batch(
        self: &Arc<Self>,
        metas: &[ChunkMeta],
    ) -> Result<Vec<MemObj>, MemoryError> {
        self.check_fits(metas)?;
        let mut s = self.lock();
        match self.take(&mut s, metas) {
            Some(objs) => Ok(objs),
            None => {
                s.failed += 1;
                Err(self.exhausted(metas.len(), s.free.len()))
            }
        }
    }

    /// `metas.len()` pages if they are free now, all or nothing; `Ok(None)`
    /// when they are not (not counted as a failure: the caller retries, and
    /// counts its last try with [`PagePool::allocate_batch`]). A batch that
    /// can never fit is an error at once.
    pub fn try_allocate_batch(
        self: &Arc<Self>,
        metas: &[ChunkMeta],
    ) -> Result<Option<Vec<MemObj>>, MemoryError> {
        self.check_fits(metas)?;
        if metas.len() > self.buffer.num_pages() {
            self.lock().failed += 1;
            return Err(self.exhausted(metas.len(), self.stats().free));
        }
        let mut s = self.lock();
        Ok(self.take(&mut s, metas))
    }

    /// Like [`PagePool::allocate_batch`], but waits for pages to come back until
    /// `deadline`. All or nothing.
    pub fn allocate_batch_until(
        self: &Arc<Self>,
        metas: &[ChunkMeta],
        deadline: Instant,
    ) -> Result<Vec<MemObj>, MemoryError> {
        self.check_fits(metas)?;
        if metas.len() > self.buffer.num_pages() {
            self.lock().failed += 1;
            return Err(self.exhausted(metas.len(), self.stats().free));
        }
        let mut s = self.lock();
        loop {
            if let Some(objs) = self.take(&mut s, metas) {
                return Ok(objs);
            }
            let now = Instant::now();
            if now >= deadline {
                s.failed += 1;
                return Err(MemoryError::Timeout {
                    pool: self.describe(),
                    requested: metas.len(),
                    free: s.free.len(),
                });
            }
            s = self
                .page_freed
                .wait_timeout(s, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// "cpu pool 5f0c..." for messages.
    pub fn describe(&self) -> String {
        format!(
            "{} pool {}",
            self.buffer.device(),
            self.buffer.uuid().simple()
        )
    }

    fn exhausted(&self, requested: usize, free: usize) -> MemoryError {
        MemoryError::Exhausted {
            pool: self.describe(),
            requested,
            free,
            total: self.buffer.num_pages(),
        }
    }

    fn check_fits(&self, metas: &[ChunkMeta]) -> Result<(), MemoryError> {
        for m in metas {
            let bytes = m.byte_len();
            if bytes > self.buffer.page_size() || m.tokens == 0 || m.tokens > m.layout.tokens {
                return Err(MemoryError::ChunkDoesNotFit {
                    bytes,
                    tokens: m.tokens,
                    page_size: self.buffer.page_size(),
                });
            }
        }
        Ok(())
    }

    fn take(self: &Arc<Self>, s: &mut PoolState, metas: &[ChunkMeta]) -> Option<Vec<MemObj>> {
        if s.free.len() < metas.len() {
            return None;
        }
        let start = s.free.len() - metas.len();
        let pages: Vec<u32> = s.free.drain(start..).rev().collect();
        let allocated = self.buffer.num_pages() - s.free.len();
        s.high_water = s.high_water.max(allocated);
        Some(
            pages
                .into_iter()
                .zip(metas)
                .map(|(page, meta)| {
                    MemObj(Arc::new(Page {
                        pool: Arc::clone(self),
                        page,
                        meta: *meta,
                        pins: AtomicU32::new(0),
                        quarantined: AtomicBool::new(false),
                    }))
                })
                .collect(),
        )
    }

    fn lock(&self) -> MutexGuard<'_, PoolState> {
        // A panic while holding the lock cannot leave the free list torn (each
        // critical section is a push/drain), so keep serving after poisoning.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn release(&self, page: u32, was_pinned: bool, was_quarantined: bool) {
        let mut s = self.lock();
        debug_assert!(!s.free.contains(&page), "page {page} freed twice");
        s.free.push(page);
        if was_pinned {
            s.pinned -= 1;
        }
        if was_quarantined {
            s.quarantined -= 1;
        }
        drop(s);
        self.page_freed.notify_all();
    }

    fn pin_changed(&self, pinned: bool) {
        let mut s = self.lock();
        if pinned {
            s.pinned += 1;
            s.pinned_high_water = s.pinned_high_water.max(s.pinned);
        } else {
            s.pinned -= 1;
        }
    }

    fn quarantine_added(&self) {
        self.lock().quarantined += 1;
    }

    fn quarantine_removed(&self) {
        self.lock().quarantined -= 1;
    }
}

/// One allocated page of a pool: where it is and what chunk it holds.
///
/// Reached through [`MemObj`] and [`SealedMemObj`] (which deref to it), so
/// whoever can call [`Page::host_bytes`] either owns the page alone or
/// holds a sealed page that nobody writes.
pub struct Page {
    pool: Arc<PagePool>,
    page: u32,
    meta: ChunkMeta,
    pins: AtomicU32,
    quarantined: AtomicBool,
}

impl Drop for Page {
    fn drop(&mut self) {
        let was_pinned = *self.pins.get_mut() > 0;
        let was_quarantined = *self.quarantined.get_mut();
        self.pool.release(self.page, was_pinned, was_quarantined);
    }
}

impl fmt::Debug for Page {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Page")
            .field("ref", &self.buffer_ref())
            .field("device", &self.device())
            .field("shape", &self.shape())
            .field("bytes", &self.byte_len())
            .field("pins", &self.pins.load(Ordering::Relaxed))
            .finish()
    }
}

impl Page {
    /// `(buffer uuid, page)`: how peers address this chunk.
    pub fn buffer_ref(&self) -> BufferRef {
        BufferRef {
            uuid: self.pool.uuid(),
            page: self.page,
        }
    }

    /// The pool this page belongs to.
    pub fn pool(&self) -> &Arc<PagePool> {
        &self.pool
    }

    /// Page index in its pool.
    pub fn page(&self) -> u32 {
        self.page
    }

    /// CPU or NPU.
    pub fn device(&self) -> DeviceKind {
        self.pool.buffer.device()
    }

    /// Address of the page's first byte (host pointer or device address).
    pub fn addr(&self) -> u64 {
        self.pool
            .buffer
            .page_addr(self.page)
            .expect("a page is inside its pool")
    }

    /// Chunk metadata.
    pub fn meta(&self) -> ChunkMeta {
        self.meta
    }

    /// Real bytes of the chunk (a prefix of the page for a partial chunk).
    pub fn byte_len(&self) -> usize {
        self.meta.byte_len()
    }

    /// Wire shape (`[planes, layers, tokens, hidden]`).
    pub fn shape(&self) -> [usize; 4] {
        self.meta.shape()
    }

    /// Tokens in the chunk.
    pub fn tokens(&self) -> usize {
        self.meta.tokens
    }

    /// Element type.
    pub fn dtype(&self) -> Dtype {
        self.meta.layout.dtype
    }

    /// Memory format.
    pub fn fmt(&self) -> MemFormat {
        self.meta.layout.fmt
    }

    /// The chunk's real bytes, for CPU pages (`None` on NPU pages).
    ///
    /// Only reachable through a [`MemObj`] (sole owner, no transfer holds
    /// the page) or a [`SealedMemObj`] (nobody writes it any more).
    pub fn host_bytes(&self) -> Option<&[u8]> {
        let base = self.pool.buffer.host_ptr()?;
        let off = self.page as usize * self.pool.buffer.page_size();
        // SAFETY: [off, off+byte_len) lies inside the pool (checked at
        // allocation: byte_len <= page_size) and the pool outlives `self`.
        // Writers of a page need a `MemObj` (exclusive) or a lent page (no
        // local handle); `&self` here comes from neither while they write.
        Some(unsafe { std::slice::from_raw_parts(base.add(off), self.byte_len()) })
    }

    /// Marks the page quarantined (counted once) until it is released.
    fn mark_quarantined(&self) {
        if !self.quarantined.swap(true, Ordering::AcqRel) {
            self.pool.quarantine_added();
        }
    }
}

/// A page with a single owner, which may write it. Not `Clone`: sharing a
/// page means sealing it first ([`MemObj::seal`]). The page returns to its
/// pool when the handle drops.
pub struct MemObj(Arc<Page>);

impl fmt::Debug for MemObj {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("MemObj").field(&*self.0).finish()
    }
}

impl std::ops::Deref for MemObj {
    type Target = Page;
    fn deref(&self) -> &Page {
        &self.0
    }
}

impl MemObj {
    /// Mutable access to the chunk's bytes, for CPU pages.
    pub fn host_bytes_mut(&mut self) -> Option<&mut [u8]> {
        let base = self.0.pool.buffer.host_ptr()?;
        let off = self.0.page as usize * self.0.pool.buffer.page_size();
        let len = self.0.meta.byte_len();
        // SAFETY: inside the pool as in `host_bytes`; a `MemObj` is the only
        // handle to its page (never cloned; sealing or lending consumes it),
        // and `&mut self` keeps it so for the borrow.
        Some(unsafe { std::slice::from_raw_parts_mut(base.add(off), len) })
    }

    /// Freezes the page: from now on it is only read, by as many holders as
    /// need it (a chunk to send, a resident chunk to scatter).
    pub fn seal(self) -> SealedMemObj {
        SealedMemObj(self.0)
    }

    /// Hands the page to a remote peer (or device copy) that writes it
    /// without us: no local byte access until it comes back with
    /// [`LentPage::landed`].
    pub fn lend(self) -> LentPage {
        LentPage { page: Some(self.0) }
    }

    /// A weak handle that can mark the page quarantined later (used by a
    /// transfer's completion when its waiter gives up).
    pub(crate) fn watch(&self) -> PageWatch {
        PageWatch(Arc::downgrade(&self.0))
    }
}

/// A page frozen for reading: clones share it, nobody writes it. It returns
/// to its pool when the last clone drops.
#[derive(Clone)]
pub struct SealedMemObj(Arc<Page>);

impl fmt::Debug for SealedMemObj {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("SealedMemObj").field(&*self.0).finish()
    }
}

impl std::ops::Deref for SealedMemObj {
    type Target = Page;
    fn deref(&self) -> &Page {
        &self.0
    }
}

impl SealedMemObj {
    /// The writable handle back, if this is the last holder of the page.
    pub fn try_unseal(mut self) -> Result<MemObj, SealedMemObj> {
        if Arc::get_mut(&mut self.0).is_some() {
            Ok(MemObj(self.0))
        } else {
            Err(self)
        }
    }

    /// Live holders of this page.
    pub fn ref_count(&self) -> usize {
        Arc::strong_count(&self.0)
    }

    /// Marks the page pinned (the protocol holds it for a peer). Pins nest.
    pub fn pin(&self) {
        if self.0.pins.fetch_add(1, Ordering::AcqRel) == 0 {
            self.0.pool.pin_changed(true);
        }
    }

    /// Undoes one [`SealedMemObj::pin`]. Returns false (and changes nothing) when not pinned.
    pub fn unpin(&self) -> bool {
        let prev = self
            .0
            .pins
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |p| p.checked_sub(1));
        match prev {
            Ok(1) => {
                self.0.pool.pin_changed(false);
                true
            }
            Ok(_) => true,
            Err(_) => false,
        }
    }

    /// Outstanding pins.
    pub fn pin_count(&self) -> u32 {
        self.0.pins.load(Ordering::Acquire)
    }

    /// Whether pinned.
    pub fn is_pinned(&self) -> bool {
        self.pin_count() > 0
    }

    pub(crate) fn watch(&self) -> PageWatch {
        PageWatch(Arc::downgrade(&self.0))
    }

    /// Counts the page as quarantined until it returns to its pool (a peer
    /// may still be reading it under a grant that ended without its report).
    pub(crate) fn quarantine(&self) {
        self.0.mark_quarantined();
    }
}

/// A page lent to a peer that may write it at any moment: no byte access.
///
/// It leaves this state only through [`LentPage::landed`] (the peer said
/// its write completed: the bytes are now ours) or
/// [`LentPage::release_quiescent`] (the peer can no longer touch the page:
/// it reported, or its access was revoked and drained). [`LentPage::quarantine`]
/// records that the lending ended without completion. Dropped without
/// either call, the page stays out of the pool for good (counted as
/// quarantined) instead of being reused under a late write.
pub struct LentPage {
    page: Option<Arc<Page>>,
}

impl fmt::Debug for LentPage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.page {
            Some(p) => f.debug_tuple("LentPage").field(&**p).finish(),
            None => f.write_str("LentPage(<released>)"),
        }
    }
}

impl LentPage {
    fn inner(&self) -> &Page {
        self.page
            .as_ref()
            .expect("a lent page is held until consumed")
    }

    /// `(buffer uuid, page)` of the page.
    pub fn buffer_ref(&self) -> BufferRef {
        self.inner().buffer_ref()
    }

    /// The chunk the page will hold.
    pub fn meta(&self) -> ChunkMeta {
        self.inner().meta()
    }

    /// The page's pool.
    pub fn pool(&self) -> &Arc<PagePool> {
        self.inner().pool()
    }

    /// Whether the page is counted as quarantined.
    pub fn is_quarantined(&self) -> bool {
        self.inner().quarantined.load(Ordering::Acquire)
    }

    /// The peer reported that its write completed: the page is ours again.
    pub fn landed(mut self) -> MemObj {
        let page = self.page.take().expect("held until consumed");
        if page.quarantined.swap(false, Ordering::AcqRel) {
            page.pool.quarantine_removed();
        }
        MemObj(page)
    }

    /// The lending ended without completion (timeout, revoke): the page is
    /// counted as quarantined until [`LentPage::release_quiescent`].
    pub fn quarantine(&self) {
        self.inner().mark_quarantined();
    }

    /// The peer can no longer touch the page: back to the pool.
    pub fn release_quiescent(mut self) {
        drop(self.page.take());
    }

    /// Nobody will learn when the peer is done (its owner is shutting
    /// down): the page stays quarantined for good, and with it its pool.
    /// The caller reports it; dropping a `LentPage` does the same with an
    /// error logged per page.
    pub(crate) fn abandon(mut self) {
        if let Some(page) = self.page.take() {
            page.mark_quarantined();
            std::mem::forget(page);
        }
    }
}

impl Drop for LentPage {
    fn drop(&mut self) {
        if let Some(page) = self.page.take() {
            // Nobody proved the peer is done with it: keep it out of the
            // pool rather than hand it to someone a late write would corrupt.
            page.mark_quarantined();
            log::error!(
                "lent page {} dropped while its peer may still write it; kept quarantined",
                page.buffer_ref()
            );
            std::mem::forget(page);
        }
    }
}

/// A weak handle on a page held elsewhere (by a transfer in flight).
pub(crate) struct PageWatch(Weak<Page>);

impl PageWatch {
    /// Marks the page quarantined if it is still held (its transfer still
    /// runs); it is counted until the transfer drops it.
    pub(crate) fn quarantine_if_held(&self) -> bool {
        match self.0.upgrade() {
            Some(p) => {
                p.mark_quarantined();
                true
            }
            None => false,
        }
    }
}
