//! The paged allocator over one [`RegisteredBuffer`], and [`MemObj`], the
//! reference-counted page it hands out.

use super::buffer::{BufferRef, DeviceKind, RegisteredBuffer};
use super::MemoryError;
use crate::layout::{ChunkLayout, Dtype, MemFormat};
use std::fmt;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Instant;
use uuid::Uuid;

/// Counters of one pool, read atomically together.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Pages in the pool.
    pub total: usize,
    /// Pages free.
    pub free: usize,
    /// Pages handed out (`total - free`).
    pub allocated: usize,
    /// Allocated pages currently pinned.
    pub pinned: usize,
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
    high_water: usize,
    pinned_high_water: usize,
    failed: u64,
}

/// A thread-safe allocator of fixed-size pages over one registered buffer.
///
/// Allocation and release are O(1) (a free-list stack). Pages come back
/// only through [`MemObj`] drops, so no caller frees by hand.
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
}

impl ChunkMeta {
    /// A full chunk of `layout`.
    pub fn full(layout: ChunkLayout) -> ChunkMeta {
        ChunkMeta {
            layout,
            tokens: layout.tokens,
        }
    }

    /// A chunk of `layout` holding `tokens` tokens (a partial last chunk when fewer than a full one).
    pub fn partial(layout: ChunkLayout, tokens: usize) -> ChunkMeta {
        ChunkMeta { layout, tokens }
    }

    /// Real bytes of this chunk.
    pub fn byte_len(&self) -> usize {
        self.layout.bytes_for(self.tokens)
    }

    /// The wire shape of this chunk.
    pub fn shape(&self) -> [usize; 4] {
        self.layout.shape_for(self.tokens)
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

    /// Like [`PagePool::allocate_batch`], but waits for pages to come back until
    /// `deadline` (the receiver's retry loop). All or nothing.
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

    fn release(&self, page: u32, was_pinned: bool) {
        let mut s = self.lock();
        debug_assert!(!s.free.contains(&page), "page {page} freed twice");
        s.free.push(page);
        if was_pinned {
            s.pinned -= 1;
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
}

struct Page {
    pool: Arc<PagePool>,
    page: u32,
    meta: ChunkMeta,
    pins: AtomicU32,
}

impl Drop for Page {
    fn drop(&mut self) {
        let was_pinned = *self.pins.get_mut() > 0;
        self.pool.release(self.page, was_pinned);
    }
}

/// A page of a pool holding one (possibly partial) chunk. Cloning shares the
/// page; the page returns to its pool when the last clone drops.
#[derive(Clone)]
pub struct MemObj(Arc<Page>);

impl fmt::Debug for MemObj {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemObj")
            .field("ref", &self.buffer_ref())
            .field("device", &self.device())
            .field("shape", &self.shape())
            .field("bytes", &self.byte_len())
            .field("pins", &self.pin_count())
            .finish()
    }
}

impl MemObj {
    /// `(buffer uuid, page)`: how peers address this chunk.
    pub fn buffer_ref(&self) -> BufferRef {
        BufferRef {
            uuid: self.0.pool.uuid(),
            page: self.0.page,
        }
    }

    /// The pool this page belongs to.
    pub fn pool(&self) -> &Arc<PagePool> {
        &self.0.pool
    }

    /// Page index in its pool.
    pub fn page(&self) -> u32 {
        self.0.page
    }

    /// CPU or NPU.
    pub fn device(&self) -> DeviceKind {
        self.0.pool.buffer.device()
    }

    /// Address of the page's first byte (host pointer or device address).
    pub fn addr(&self) -> u64 {
        self.0
            .pool
            .buffer
            .page_addr(self.0.page)
            .expect("a MemObj's page is inside its pool")
    }

    /// Chunk metadata.
    pub fn meta(&self) -> ChunkMeta {
        self.0.meta
    }

    /// Real bytes of the chunk (a prefix of the page for a partial chunk).
    pub fn byte_len(&self) -> usize {
        self.0.meta.byte_len()
    }

    /// Wire shape (`[planes, layers, tokens, hidden]`).
    pub fn shape(&self) -> [usize; 4] {
        self.0.meta.shape()
    }

    /// Tokens in the chunk.
    pub fn tokens(&self) -> usize {
        self.0.meta.tokens
    }

    /// Element type.
    pub fn dtype(&self) -> Dtype {
        self.0.meta.layout.dtype
    }

    /// Memory format.
    pub fn fmt(&self) -> MemFormat {
        self.0.meta.layout.fmt
    }

    /// Live clones of this object (the page's reference count).
    pub fn ref_count(&self) -> usize {
        Arc::strong_count(&self.0)
    }

    /// Marks the page pinned (the protocol holds it for a peer). Pins nest.
    pub fn pin(&self) {
        if self.0.pins.fetch_add(1, Ordering::AcqRel) == 0 {
            self.0.pool.pin_changed(true);
        }
    }

    /// Undoes one [`MemObj::pin`]. Returns false (and changes nothing) when not pinned.
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

    /// The chunk's real bytes, for CPU pages (`None` on NPU pages).
    ///
    /// A peer's one-sided write may land in the page concurrently, as DMA
    /// would; the protocol only reads a page after its transfer completed.
    pub fn host_bytes(&self) -> Option<&[u8]> {
        let base = self.0.pool.buffer.host_ptr()?;
        let off = self.0.page as usize * self.0.pool.buffer.page_size();
        // SAFETY: [off, off+byte_len) lies inside the pool (checked at
        // allocation: byte_len <= page_size), and the pool outlives `self`.
        Some(unsafe { std::slice::from_raw_parts(base.add(off), self.byte_len()) })
    }

    /// Mutable access to the chunk's bytes, for CPU pages held by exactly one
    /// `MemObj` (no clone can observe the write).
    pub fn host_bytes_mut(&mut self) -> Option<&mut [u8]> {
        let page = Arc::get_mut(&mut self.0)?;
        let base = page.pool.buffer.host_ptr()?;
        let off = page.page as usize * page.pool.buffer.page_size();
        let len = page.meta.byte_len();
        // SAFETY: inside the pool as above; `Arc::get_mut` proved this is the
        // only handle to the page, and `&mut self` keeps it so for the borrow.
        Some(unsafe { std::slice::from_raw_parts_mut(base.add(off), len) })
    }
}
