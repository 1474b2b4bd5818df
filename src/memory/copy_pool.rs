//! The process's copy pool: a few threads that run large host copies (shm
//! transfers, host KV-cache gathers and scatters) on several cores.
//!
//! # One pool per process, sized by the first worker
//!
//! The pool is process-wide, not per [`Sender`](crate::Sender) or
//! [`Receiver`](crate::Receiver): its threads stand for the cores the
//! process may copy on, and two workers in one process (a test, a bench, an
//! engine with both roles) each with a pool of their own would run twice as
//! many copy threads as cores. The host KV-cache copies
//! (`kv::KvCache`), which see no config, use it too.
//! The first worker to start sizes it from its `pd_copy_threads`
//! ([`configure`]); a later worker asking for another size gets a warning
//! and shares the pool as it is. Copies that run before any worker started
//! use [`default_threads`]. With one thread no pool is built: every copy
//! runs inline on its calling thread, as before the pool existed.
//!
//! Only batches of at least [`PARALLEL_MIN_BYTES`] go to the pool (a thread
//! hop costs more than a small copy); they are cut into parts of about
//! [`SLICE_BYTES`]. Every pool thread takes one part, then the next part
//! left, until none is left; the caller waits for all of them.
//!
//! [`copy_pool_stats`] counts what each pool thread copied, so a test can
//! prove copies ran there.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::OnceLock;

/// Batches smaller than this are copied inline on the calling thread.
pub const PARALLEL_MIN_BYTES: usize = 8 << 20;
/// About this many bytes make one part handed to a pool thread.
pub const SLICE_BYTES: usize = 2 << 20;
/// The most threads a pool may have (`pd_copy_threads`' upper bound).
pub const MAX_THREADS: usize = 256;

/// The pool's size when no config says: the cores available, at most 8.
pub fn default_threads() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .clamp(1, 8)
}

/// The size the first worker asked for.
static WANTED: OnceLock<usize> = OnceLock::new();
/// The pool, built at the first large copy; `None`: one thread, copies inline.
static POOL: OnceLock<Option<rayon::ThreadPool>> = OnceLock::new();

static JOBS: AtomicU64 = AtomicU64::new(0);
static GATHER_BYTES: AtomicU64 = AtomicU64::new(0);
static GATHER_POOLED_BYTES: AtomicU64 = AtomicU64::new(0);
static SCATTER_BYTES: AtomicU64 = AtomicU64::new(0);
static SCATTER_POOLED_BYTES: AtomicU64 = AtomicU64::new(0);
#[allow(clippy::declare_interior_mutable_const)]
const ZERO: AtomicU64 = AtomicU64::new(0);
static BYTES_BY_THREAD: [AtomicU64; MAX_THREADS] = [ZERO; MAX_THREADS];
static PARTS_BY_THREAD: [AtomicU64; MAX_THREADS] = [ZERO; MAX_THREADS];

/// Sizes the process's copy pool: `threads` (clamped to
/// `1..=`[`MAX_THREADS`]) if this is the first call and no copy has built
/// the pool yet; otherwise a differing size is logged and ignored.
pub fn configure(threads: usize) {
    let threads = threads.clamp(1, MAX_THREADS);
    let wanted = *WANTED.get_or_init(|| threads);
    let built = POOL
        .get()
        .map(|p| p.as_ref().map_or(1, |p| p.current_num_threads()));
    let have = built.unwrap_or(wanted);
    if have != threads {
        log::warn!(
            "pd_copy_threads: {threads} ignored: this process's copy pool already has {have} \
             thread(s), sized by the first worker that started (one pool per process)"
        );
    }
}

/// The pool, built on first use; `None` when it has one thread.
fn pool() -> Option<&'static rayon::ThreadPool> {
    POOL.get_or_init(|| {
        let threads = *WANTED.get_or_init(default_threads);
        if threads <= 1 {
            return None;
        }
        match rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("apd-copy-{i}"))
            .panic_handler(|_| log::error!("a copy-pool job panicked"))
            .build()
        {
            Ok(p) => {
                log::debug!("copy pool: {threads} threads");
                Some(p)
            }
            Err(e) => {
                log::warn!("cannot start the copy pool ({e}); copies run inline");
                None
            }
        }
    })
    .as_ref()
}

/// Whether a batch of `bytes` runs on the pool (there is one, and the
/// batch is at least [`PARALLEL_MIN_BYTES`]).
pub(crate) fn is_pooled(bytes: usize) -> bool {
    bytes >= PARALLEL_MIN_BYTES && pool().is_some()
}

/// Runs `job` on a pool thread and returns at once, when the batch of
/// `bytes` is pooled (see [`is_pooled`]); otherwise hands `job` back.
pub(crate) fn spawn_if_pooled<F: FnOnce() + Send + 'static>(bytes: usize, job: F) -> Option<F> {
    match pool() {
        Some(p) if bytes >= PARALLEL_MIN_BYTES => {
            p.spawn(job);
            None
        }
        _ => Some(job),
    }
}

/// Cuts `n` items, whose sizes `len(i)` give, into contiguous ranges of
/// about [`SLICE_BYTES`]; an item larger than that is a range of its own.
fn parts(n: usize, len: impl Fn(usize) -> usize) -> Vec<(Range<usize>, usize)> {
    let mut out = Vec::new();
    let (mut start, mut bytes) = (0, 0);
    for i in 0..n {
        bytes += len(i);
        if bytes >= SLICE_BYTES {
            out.push((start..i + 1, bytes));
            (start, bytes) = (i + 1, 0);
        }
    }
    if start < n {
        out.push((start..n, bytes));
    }
    out
}

/// Runs `copy` over the items `0..n` (item `i` is `len(i)` bytes), split
/// over the pool when the total is at least [`PARALLEL_MIN_BYTES`], there
/// is a pool and `disjoint()` says the items' destinations are pairwise
/// disjoint (asked only then); otherwise `copy(0..n)` inline, in order.
/// Returns whether the pool ran it. Blocks until every part is done.
///
/// `copy` may run on several threads at once for disjoint ranges of items
/// (only when `disjoint()` returned true): it must be race-free for any two
/// disjoint ranges run concurrently given that.
pub(crate) fn run_split<F>(
    n: usize,
    len: impl Fn(usize) -> usize,
    disjoint: impl FnOnce() -> bool,
    copy: F,
) -> bool
where
    F: Fn(Range<usize>) + Sync,
{
    let total: usize = (0..n).map(&len).sum();
    let pooled = pool().filter(|_| total >= PARALLEL_MIN_BYTES && n > 1);
    let Some(p) = pooled.filter(|_| disjoint()) else {
        copy(0..n);
        return false;
    };
    JOBS.fetch_add(1, Ordering::Relaxed);
    let parts = parts(n, len);
    let threads = p.current_num_threads();
    // Every pool thread runs this once (a thread busy with another batch
    // runs it while it waits, as rayon's waits do, so nothing deadlocks).
    // Thread i first takes part i, so each thread copies when there are at
    // least as many parts as threads; the rest go to whoever is free.
    let next = AtomicUsize::new(threads);
    let (parts, copy) = (&parts, &copy);
    p.broadcast(|ctx| {
        let i = ctx.index();
        let mut take = i;
        while let Some((range, bytes)) = parts.get(take) {
            copy(range.clone());
            if i < MAX_THREADS {
                BYTES_BY_THREAD[i].fetch_add(*bytes as u64, Ordering::Relaxed);
                PARTS_BY_THREAD[i].fetch_add(1, Ordering::Relaxed);
            }
            take = next.fetch_add(1, Ordering::Relaxed);
        }
    });
    true
}

/// One memcpy; addresses as integers so pieces can cross threads.
#[derive(Clone, Copy, Debug)]
pub(crate) struct CopyPiece {
    pub(crate) src: usize,
    pub(crate) dst: usize,
    pub(crate) len: usize,
}

/// Whether no two pieces' destinations share a byte.
fn disjoint_destinations(pieces: &[CopyPiece]) -> bool {
    let mut d: Vec<(usize, usize)> = pieces.iter().map(|p| (p.dst, p.len)).collect();
    d.sort_unstable();
    d.windows(2).all(|w| w[0].0 + w[0].1 <= w[1].0)
}

/// Copies every piece, on the pool when the batch is large and the
/// pieces' destinations are pairwise disjoint (checked here: otherwise they
/// are copied inline, in order, as one thread always did).
///
/// # Safety
/// For the whole call, each piece's `src` must be readable and its `dst`
/// writable for `len` bytes, and nothing else may write those bytes; no
/// destination may overlap any piece's source.
pub(crate) unsafe fn copy_pieces(pieces: &[CopyPiece]) -> bool {
    run_split(
        pieces.len(),
        |i| pieces[i].len,
        || disjoint_destinations(pieces),
        |r| {
            for pc in &pieces[r] {
                // SAFETY: the caller's contract: `src` readable and `dst`
                // writable for `len` bytes, no destination overlapping a
                // source. Pieces run on several threads only when
                // disjoint_destinations proved no two destinations share a
                // byte, so this copy races with no other.
                unsafe {
                    std::ptr::copy_nonoverlapping(pc.src as *const u8, pc.dst as *mut u8, pc.len);
                }
            }
        },
    )
}

/// Copies each `(src, dst)` pair (equal lengths), on the pool when the
/// pairs total at least [`PARALLEL_MIN_BYTES`], as shm batches are; returns
/// whether the pool ran them. (The borrows make every destination disjoint
/// from every other slice.) `ascend-bench` measures the pool with it.
///
/// # Panics
/// If a pair's lengths differ.
pub fn copy_pairs(pairs: &mut [(&[u8], &mut [u8])]) -> bool {
    let mut pieces = Vec::with_capacity(pairs.len());
    for (src, dst) in pairs.iter_mut() {
        assert_eq!(src.len(), dst.len(), "copy_pairs: lengths differ");
        let mut done = 0;
        while done < src.len() {
            let n = (src.len() - done).min(1 << 20);
            pieces.push(CopyPiece {
                src: src.as_ptr() as usize + done,
                dst: dst.as_mut_ptr() as usize + done,
                len: n,
            });
            done += n;
        }
    }
    // SAFETY: each piece lies inside one pair's `src` (borrowed shared) or
    // `dst` (borrowed exclusively) for this whole call, so sources are
    // readable, destinations writable and touched by nothing else, and no
    // `&mut` destination overlaps any other slice.
    unsafe { copy_pieces(&pieces) }
}

/// Counts `bytes` gathered from a host KV cache (`pooled`: on the pool).
pub(crate) fn count_gather(bytes: usize, pooled: bool) {
    GATHER_BYTES.fetch_add(bytes as u64, Ordering::Relaxed);
    if pooled {
        GATHER_POOLED_BYTES.fetch_add(bytes as u64, Ordering::Relaxed);
    }
}

/// Counts `bytes` scattered into a host KV cache (`pooled`: on the pool).
pub(crate) fn count_scatter(bytes: usize, pooled: bool) {
    SCATTER_BYTES.fetch_add(bytes as u64, Ordering::Relaxed);
    if pooled {
        SCATTER_POOLED_BYTES.fetch_add(bytes as u64, Ordering::Relaxed);
    }
}

/// What the process's copy pool has run since the process started.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct CopyPoolStats {
    /// Threads of the pool; 0 until it is built, and when it has one
    /// thread (copies inline, no pool).
    pub threads: usize,
    /// Batches split over the pool.
    pub jobs: u64,
    /// Bytes each pool thread copied (`apd-copy-{i}` at index `i`).
    pub bytes_by_thread: Vec<u64>,
    /// Parts each pool thread copied.
    pub parts_by_thread: Vec<u64>,
    /// Bytes gathered from host KV caches into pages, inline or pooled.
    pub gather_bytes: u64,
    /// Of those, bytes gathered by batches split over the pool.
    pub gather_pooled_bytes: u64,
    /// Bytes scattered from pages into host KV caches, inline or pooled.
    pub scatter_bytes: u64,
    /// Of those, bytes scattered by batches split over the pool.
    pub scatter_pooled_bytes: u64,
}

impl CopyPoolStats {
    /// Pool threads that copied anything.
    pub fn threads_used(&self) -> usize {
        self.bytes_by_thread.iter().filter(|&&b| b > 0).count()
    }

    /// Bytes all pool threads copied.
    pub fn pooled_bytes(&self) -> u64 {
        self.bytes_by_thread.iter().sum()
    }
}

/// The copy pool's counters (see [`CopyPoolStats`]).
pub fn copy_pool_stats() -> CopyPoolStats {
    let threads = POOL
        .get()
        .and_then(|p| p.as_ref())
        .map_or(0, |p| p.current_num_threads());
    let load = |a: &[AtomicU64]| -> Vec<u64> {
        a[..threads]
            .iter()
            .map(|x| x.load(Ordering::Relaxed))
            .collect()
    };
    CopyPoolStats {
        threads,
        jobs: JOBS.load(Ordering::Relaxed),
        bytes_by_thread: load(&BYTES_BY_THREAD),
        parts_by_thread: load(&PARTS_BY_THREAD),
        gather_bytes: GATHER_BYTES.load(Ordering::Relaxed),
        gather_pooled_bytes: GATHER_POOLED_BYTES.load(Ordering::Relaxed),
        scatter_bytes: SCATTER_BYTES.load(Ordering::Relaxed),
        scatter_pooled_bytes: SCATTER_POOLED_BYTES.load(Ordering::Relaxed),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_cover_every_item_once() {
        let lens = [1usize << 20, 3 << 20, 10, 5 << 20, 1, 1];
        let ps = parts(lens.len(), |i| lens[i]);
        let mut next = 0;
        for (r, b) in &ps {
            assert_eq!(r.start, next);
            assert_eq!(*b, lens[r.clone()].iter().sum::<usize>());
            next = r.end;
        }
        assert_eq!(next, lens.len());
        assert!(parts(0, |_| 0).is_empty());
    }

    #[test]
    fn copy_pairs_copies_every_byte() {
        let src: Vec<Vec<u8>> = (0..5u8).map(|i| vec![i + 1; (3 << 20) + 7]).collect();
        let mut dst: Vec<Vec<u8>> = src.iter().map(|s| vec![0; s.len()]).collect();
        let mut pairs: Vec<(&[u8], &mut [u8])> = src
            .iter()
            .zip(dst.iter_mut())
            .map(|(s, d)| (&s[..], &mut d[..]))
            .collect();
        copy_pairs(&mut pairs);
        assert_eq!(src, dst);
    }

    #[test]
    fn a_later_size_does_not_resize_a_built_pool() {
        // Build the pool (whatever size the process gave it) with a copy
        // large enough to be pooled.
        let src = vec![7u8; PARALLEL_MIN_BYTES];
        let mut dst = vec![0u8; PARALLEL_MIN_BYTES];
        copy_pairs(&mut [(&src[..], &mut dst[..])]);
        assert_eq!(src, dst);
        let threads = copy_pool_stats().threads;
        configure(threads + 1);
        assert_eq!(copy_pool_stats().threads, threads);
    }

    #[test]
    fn overlapping_destinations_are_found() {
        let pc = |dst, len| CopyPiece { src: 0, dst, len };
        assert!(disjoint_destinations(&[pc(10, 5), pc(0, 10), pc(15, 1)]));
        assert!(!disjoint_destinations(&[pc(10, 5), pc(0, 11)]));
        assert!(!disjoint_destinations(&[pc(3, 1), pc(3, 1)]));
    }
}
