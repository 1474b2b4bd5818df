//! The ping-pong pipeline as plain logic: micro-batching, depth choice,
//! pool reuse ordering and error draining, over an I/O trait
//! ([`PipelineIo`]) that the receiver implements with real reads and
//! scatters and the tests implement with scripted ones.
//!
//! Order of work for micro-batches `0..n` over two pools:
//!
//! ```text
//! read(0) -> pool 0
//! for i in 0..n:
//!     wait read(i)
//!     start scatter(i) from pool i%2          (asynchronous)
//!     wait every scatter still using pool (i+1)%2, i.e. scatter(i-1)
//!     start read(i+1) -> pool (i+1)%2         (runs while scatter(i) runs)
//! wait the remaining scatters
//! ```
//!
//! A pool is reused only after the scatter that read from it has finished
//! (its completion was waited on: events, never sleeps). At most one read
//! is in flight and it is always waited for before the run returns, so the
//! caller may free the pools afterwards. The first failure stops new
//! reads; scatters already started are still finished (their data is good).

use crate::memory::{ChunkMeta, MemObj, MemoryError, PagePool};
use std::collections::VecDeque;
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One micro-batch: a run of consecutive items read together into one pool.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MicroBatch {
    /// Position in the run (0-based).
    pub index: usize,
    /// The pool it is read into and scattered from.
    pub pool: usize,
    /// The items (indexes into the caller's list).
    pub items: Range<usize>,
}

impl MicroBatch {
    /// Items in the batch.
    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// Whether the batch has no items (never, for batches of a run).
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }
}

/// Splits `items` into micro-batches of `depth` (the last may be shorter),
/// batch `i` using pool `i % pools`.
pub fn micro_batches(items: usize, depth: usize, pools: usize) -> Vec<MicroBatch> {
    let depth = depth.max(1);
    let pools = pools.max(1);
    (0..items.div_ceil(depth))
        .map(|i| MicroBatch {
            index: i,
            pool: i % pools,
            items: i * depth..((i + 1) * depth).min(items),
        })
        .collect()
}

/// The depth (pages per pool) for `items` items when `free_pages` pages
/// are free: at most `max_depth` and at most the request, at least 1; one
/// pool when the whole request fits one batch, otherwise two pools that
/// together fit in the free pages.
pub fn choose_depth(items: usize, free_pages: usize, max_depth: usize) -> usize {
    let want = max_depth.max(1).min(items.max(1));
    if items <= want && free_pages >= want {
        return want;
    }
    want.min(free_pages / 2).max(1)
}

/// Pages the pools of a run of `items` items at `depth` need.
pub fn pages_needed(items: usize, depth: usize) -> usize {
    if items <= depth {
        items.max(1)
    } else {
        2 * depth
    }
}

/// Allocates the pools for `items` chunks from `pool`: the depth comes
/// from the pages free now ([`choose_depth`]); when a concurrent
/// allocation took them meanwhile, the depth shrinks instead of failing,
/// down to one pool of one page, which is waited for until `deadline`.
/// Returns the pages and the depth.
pub fn allocate_pools(
    pool: &Arc<PagePool>,
    meta: ChunkMeta,
    items: usize,
    max_depth: usize,
    deadline: Instant,
) -> Result<(Vec<MemObj>, usize), MemoryError> {
    let mut depth = choose_depth(items, pool.stats().free, max_depth);
    loop {
        let n = pages_needed(items, depth);
        // Ask only for what is free: a doomed request would count as a failure.
        if pool.stats().free >= n {
            if let Ok(pages) = pool.allocate_batch(&vec![meta; n]) {
                return Ok((pages, depth));
            }
        }
        if depth > 1 {
            depth /= 2;
            continue;
        }
        // One page is the floor: a single pool, read and scattered in turn.
        let pages = pool.allocate_batch_until(&[meta], deadline)?;
        return Ok((pages, 1));
    }
}

/// The I/O of a run. Each `start_*` returns a ticket that the pipeline
/// passes back to the matching `finish_*` exactly once (in start order for
/// scatters). Errors are messages naming what failed.
pub trait PipelineIo {
    /// A read in flight.
    type Read;
    /// A scatter in flight.
    type Scatter;
    /// Starts reading `batch`'s items into `pages` (one page per item, in order).
    fn start_read(&mut self, batch: &MicroBatch, pages: &[MemObj]) -> Result<Self::Read, String>;
    /// Waits for a read.
    fn finish_read(&mut self, batch: &MicroBatch, read: Self::Read) -> Result<(), String>;
    /// Starts scattering `batch`'s items from `pages`.
    fn start_scatter(
        &mut self,
        batch: &MicroBatch,
        pages: &[MemObj],
    ) -> Result<Self::Scatter, String>;
    /// Waits for a scatter.
    fn finish_scatter(&mut self, batch: &MicroBatch, scatter: Self::Scatter) -> Result<(), String>;
    /// `batch`'s data is in the KV cache (called right after its scatter
    /// finished, before the pool is reused).
    fn scattered(&mut self, batch: &MicroBatch) {
        let _ = batch;
    }
}

/// What happened to one item.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ItemOutcome {
    /// Read and scattered.
    Scattered,
    /// Its batch's read or scatter failed (the message says which and why).
    Failed(String),
    /// Never started: an earlier batch failed.
    NotStarted,
}

/// The result of [`PingPongPipeline::run`].
#[derive(Clone, Debug)]
pub struct PipelineRun {
    /// One outcome per item.
    pub outcomes: Vec<ItemOutcome>,
    /// Micro-batches in the run.
    pub batches: usize,
    /// Wall time of the run.
    pub elapsed: Duration,
}

impl PipelineRun {
    /// Whether every item was scattered.
    pub fn all_scattered(&self) -> bool {
        self.outcomes.iter().all(|o| *o == ItemOutcome::Scattered)
    }
}

/// Two pools of `depth` pages (one when a request fits one batch) and the
/// schedule that reads into one while the other is scattered.
#[derive(Debug)]
pub struct PingPongPipeline {
    pools: Vec<Vec<MemObj>>,
    depth: usize,
}

impl PingPongPipeline {
    /// Splits `pages` into pools of `depth` pages: two when there are at
    /// least `2 * depth`, else one (then batches alternate with no
    /// overlap). `None` when there is no page.
    pub fn new(mut pages: Vec<MemObj>, depth: usize) -> Option<PingPongPipeline> {
        if pages.is_empty() {
            return None;
        }
        let depth = depth.clamp(1, pages.len());
        let pools = if pages.len() >= 2 * depth { 2 } else { 1 };
        pages.truncate(pools * depth);
        let mut it = pages.into_iter();
        let pools = (0..pools)
            .map(|_| it.by_ref().take(depth).collect())
            .collect();
        Some(PingPongPipeline { pools, depth })
    }

    /// Pages per pool.
    pub fn depth(&self) -> usize {
        self.depth
    }

    /// Number of pools (1 or 2).
    pub fn pools(&self) -> usize {
        self.pools.len()
    }

    /// Bytes of every page the pipeline holds (its peak buffer).
    pub fn buffer_bytes(&self) -> usize {
        self.pools
            .iter()
            .flatten()
            .map(|p| p.pool().buffer().page_size())
            .sum()
    }

    fn pages(&self, b: &MicroBatch) -> &[MemObj] {
        &self.pools[b.pool][..b.len()]
    }

    /// Runs `items` items through read → scatter with `io` (see the module
    /// docs for the order). Returns only when nothing started is still in
    /// flight.
    pub fn run<I: PipelineIo>(&self, items: usize, io: &mut I) -> PipelineRun {
        let start = Instant::now();
        let batches = micro_batches(items, self.depth, self.pools.len());
        let mut out = vec![ItemOutcome::NotStarted; items];
        let fail = |out: &mut [ItemOutcome], b: &MicroBatch, e: String| {
            for i in b.items.clone() {
                out[i] = ItemOutcome::Failed(e.clone());
            }
        };
        let mut scattering: VecDeque<(&MicroBatch, I::Scatter)> = VecDeque::new();
        let mut reading = None;
        let mut stopped = false;
        if let Some(b0) = batches.first() {
            match io.start_read(b0, self.pages(b0)) {
                Ok(r) => reading = Some((b0, r)),
                Err(e) => fail(&mut out, b0, e),
            }
        }
        while let Some((b, r)) = reading.take() {
            match io.finish_read(b, r) {
                Ok(()) => match io.start_scatter(b, self.pages(b)) {
                    Ok(s) => scattering.push_back((b, s)),
                    Err(e) => {
                        fail(&mut out, b, e);
                        stopped = true;
                    }
                },
                Err(e) => {
                    fail(&mut out, b, e);
                    stopped = true;
                }
            }
            let Some(next) = batches.get(b.index + 1).filter(|_| !stopped) else {
                break;
            };
            // The next batch's pool is free once every scatter from it has finished.
            while scattering.iter().any(|(s, _)| s.pool == next.pool) {
                let (s, t) = scattering.pop_front().expect("checked non-empty");
                if !finish_scatter(io, s, t, &mut out) {
                    stopped = true;
                }
            }
            if stopped {
                break;
            }
            match io.start_read(next, self.pages(next)) {
                Ok(r) => reading = Some((next, r)),
                Err(e) => fail(&mut out, next, e),
            }
        }
        // Drain: every loop exit above has already waited for its read; the
        // scatters started are finished here, before the pools may be freed.
        while let Some((s, t)) = scattering.pop_front() {
            finish_scatter(io, s, t, &mut out);
        }
        PipelineRun {
            outcomes: out,
            batches: batches.len(),
            elapsed: start.elapsed(),
        }
    }

    /// The pages back (dropping them returns them to their pool).
    pub fn into_pages(self) -> Vec<MemObj> {
        self.pools.into_iter().flatten().collect()
    }
}

fn finish_scatter<I: PipelineIo>(
    io: &mut I,
    b: &MicroBatch,
    t: I::Scatter,
    out: &mut [ItemOutcome],
) -> bool {
    match io.finish_scatter(b, t) {
        Ok(()) => {
            for i in b.items.clone() {
                out[i] = ItemOutcome::Scattered;
            }
            io.scattered(b);
            true
        }
        Err(e) => {
            for i in b.items.clone() {
                out[i] = ItemOutcome::Failed(e.clone());
            }
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::{ChunkLayout, Dtype, MemFormat, RegisteredBuffer};

    fn pool(pages: usize) -> (Arc<PagePool>, ChunkMeta) {
        let layout = ChunkLayout {
            fmt: MemFormat::Kv2Ltd,
            layers: 1,
            tokens: 4,
            hidden: 4,
            dtype: Dtype::UInt8,
        };
        let buf = RegisteredBuffer::host(pages * layout.page_bytes(), layout.page_bytes(), false)
            .unwrap();
        (PagePool::new(buf), ChunkMeta::full(layout))
    }

    #[derive(Debug, Clone, PartialEq, Eq)]
    enum Ev {
        StartRead(usize, usize),
        FinishRead(usize),
        StartScatter(usize, usize),
        FinishScatter(usize),
        Scattered(usize),
    }

    /// Records every call; fails the read (start or finish) or the scatter
    /// finish of chosen batches; checks the pages it is handed.
    #[derive(Default)]
    struct Script {
        log: Vec<Ev>,
        fail_start_read: Option<usize>,
        fail_finish_read: Option<usize>,
        fail_finish_scatter: Option<usize>,
        reads_in_flight: usize,
        scatters_in_flight: usize,
        max_reads_in_flight: usize,
        /// Page of each item when read (must be the page it is scattered from).
        page_of: std::collections::HashMap<usize, u32>,
    }

    impl PipelineIo for Script {
        type Read = usize;
        type Scatter = usize;
        fn start_read(&mut self, b: &MicroBatch, pages: &[MemObj]) -> Result<usize, String> {
            assert_eq!(pages.len(), b.len());
            self.log.push(Ev::StartRead(b.index, b.pool));
            if self.fail_start_read == Some(b.index) {
                return Err(format!("batch {} could not start", b.index));
            }
            for (i, p) in b.items.clone().zip(pages) {
                self.page_of.insert(i, p.page());
            }
            self.reads_in_flight += 1;
            self.max_reads_in_flight = self.max_reads_in_flight.max(self.reads_in_flight);
            Ok(b.index)
        }
        fn finish_read(&mut self, b: &MicroBatch, t: usize) -> Result<(), String> {
            assert_eq!(t, b.index);
            self.reads_in_flight -= 1;
            self.log.push(Ev::FinishRead(b.index));
            match self.fail_finish_read == Some(b.index) {
                true => Err(format!("read of batch {} failed", b.index)),
                false => Ok(()),
            }
        }
        fn start_scatter(&mut self, b: &MicroBatch, pages: &[MemObj]) -> Result<usize, String> {
            for (i, p) in b.items.clone().zip(pages) {
                assert_eq!(
                    self.page_of[&i],
                    p.page(),
                    "item {i} scattered from its read page"
                );
            }
            self.scatters_in_flight += 1;
            self.log.push(Ev::StartScatter(b.index, b.pool));
            Ok(b.index)
        }
        fn finish_scatter(&mut self, b: &MicroBatch, t: usize) -> Result<(), String> {
            assert_eq!(t, b.index);
            self.scatters_in_flight -= 1;
            self.log.push(Ev::FinishScatter(b.index));
            match self.fail_finish_scatter == Some(b.index) {
                true => Err(format!("scatter of batch {} failed", b.index)),
                false => Ok(()),
            }
        }
        fn scattered(&mut self, b: &MicroBatch) {
            self.log.push(Ev::Scattered(b.index));
        }
    }

    /// A pool is read into again only after the scatter that used it
    /// finished, and read i+1 starts before scatter i finishes (overlap).
    fn check_ordering(log: &[Ev], depth_batches: usize) {
        let pos = |e: &Ev| log.iter().position(|x| x == e);
        for (i, e) in log.iter().enumerate() {
            if let Ev::StartRead(b, pool) = e {
                for (j, prev) in log[..i].iter().enumerate() {
                    if let Ev::StartScatter(pb, ppool) = prev {
                        if ppool == pool && pb < b {
                            let fin = pos(&Ev::FinishScatter(*pb)).expect("finished");
                            assert!(
                                fin < i,
                                "read {b} into pool {pool} before scatter {pb} finished: {log:?}"
                            );
                            assert!(j < fin);
                        }
                    }
                }
            }
        }
        for b in 0..depth_batches.saturating_sub(1) {
            let next_read = pos(&Ev::StartRead(b + 1, (b + 1) % 2)).unwrap();
            let this_done = pos(&Ev::FinishScatter(b)).unwrap();
            assert!(next_read < this_done, "no overlap at batch {b}: {log:?}");
        }
    }

    #[test]
    fn every_item_is_scattered_once_with_pools_reused_only_after_their_scatter() {
        for (items, depth) in [(1, 1), (7, 1), (8, 3), (64, 8), (5, 16)] {
            let (p, meta) = pool(32);
            let (pages, d) = allocate_pools(&p, meta, items, depth, Instant::now()).unwrap();
            assert_eq!(d, depth.min(items));
            let pipe = PingPongPipeline::new(pages, d).unwrap();
            let mut io = Script::default();
            let run = pipe.run(items, &mut io);
            assert!(run.all_scattered(), "{items}/{depth}: {:?}", run.outcomes);
            assert_eq!(run.batches, items.div_ceil(d));
            let scattered = io
                .log
                .iter()
                .filter(|e| matches!(e, Ev::Scattered(_)))
                .count();
            assert_eq!(scattered, run.batches);
            assert_eq!(io.max_reads_in_flight, 1);
            assert_eq!((io.reads_in_flight, io.scatters_in_flight), (0, 0));
            check_ordering(&io.log, run.batches);
            // Pools: one when a single batch holds the request, else two.
            assert_eq!(pipe.pools(), if items <= d { 1 } else { 2 });
            drop(pipe);
            assert_eq!(p.stats().allocated, 0);
        }
    }

    #[test]
    fn a_failure_stops_new_reads_and_drains_what_is_in_flight() {
        // (which failure, batch): batches 0..8 of depth 2 over 16 items.
        for (kind, at) in [(0, 3), (1, 3), (2, 3), (0, 0), (1, 7), (2, 0)] {
            let (p, meta) = pool(8);
            let (pages, d) = allocate_pools(&p, meta, 16, 2, Instant::now()).unwrap();
            let pipe = PingPongPipeline::new(pages, d).unwrap();
            let mut io = Script::default();
            match kind {
                0 => io.fail_start_read = Some(at),
                1 => io.fail_finish_read = Some(at),
                _ => io.fail_finish_scatter = Some(at),
            }
            let run = pipe.run(16, &mut io);
            assert_eq!(
                (io.reads_in_flight, io.scatters_in_flight),
                (0, 0),
                "drained"
            );
            for (i, o) in run.outcomes.iter().enumerate() {
                let b = i / 2;
                let expect_ok = b < at || (kind == 2 && b == at + 1);
                match o {
                    ItemOutcome::Scattered => assert!(expect_ok, "{kind}/{at}: item {i}"),
                    ItemOutcome::Failed(e) => {
                        assert_eq!(b, at, "{kind}/{at}: item {i}: {e}");
                        assert!(e.contains(&format!("batch {at}")), "{e}");
                    }
                    ItemOutcome::NotStarted => assert!(b > at, "{kind}/{at}: item {i}"),
                }
            }
            // Nothing is read after the failure.
            let last_read = io
                .log
                .iter()
                .filter_map(|e| match e {
                    Ev::StartRead(b, _) => Some(*b),
                    _ => None,
                })
                .max()
                .unwrap();
            let expect_last = if kind == 2 { at + 1 } else { at };
            assert_eq!(last_read, expect_last, "{kind}/{at}: {:?}", io.log);
            drop(pipe);
            assert_eq!(p.stats().allocated, 0);
        }
    }

    #[test]
    fn depth_follows_free_pages_and_the_request() {
        assert_eq!(choose_depth(64, 100, 8), 8);
        assert_eq!(choose_depth(64, 6, 8), 3);
        assert_eq!(choose_depth(64, 1, 8), 1);
        assert_eq!(choose_depth(64, 0, 8), 1);
        // A request smaller than the depth takes one pool of its size.
        assert_eq!(choose_depth(3, 100, 8), 3);
        assert_eq!(pages_needed(3, 3), 3);
        assert_eq!(choose_depth(3, 2, 8), 1);
        assert_eq!(pages_needed(64, 8), 16);
        assert_eq!(choose_depth(0, 10, 8), 1);
        let b = micro_batches(10, 4, 2);
        assert_eq!(b.len(), 3);
        assert_eq!((b[2].pool, b[2].items.clone()), (0, 8..10));
    }

    #[test]
    fn allocation_shrinks_the_depth_when_pages_are_taken() {
        let (p, meta) = pool(8);
        let held = p.allocate_batch(&[meta; 5]).unwrap();
        // 3 free: depth 1 with two pools (2 pages).
        let (pages, d) = allocate_pools(&p, meta, 64, 8, Instant::now()).unwrap();
        assert_eq!((pages.len(), d), (2, 1));
        // 1 free: a single pool of one page, still runs everything.
        let (one, d) = allocate_pools(&p, meta, 64, 8, Instant::now()).unwrap();
        assert_eq!((one.len(), d), (1, 1));
        let pipe = PingPongPipeline::new(one, 1).unwrap();
        assert_eq!(pipe.pools(), 1);
        let mut io = Script::default();
        assert!(pipe.run(5, &mut io).all_scattered());
        // None free: waits until the deadline, then a clear error.
        let e = allocate_pools(&p, meta, 64, 8, Instant::now())
            .unwrap_err()
            .to_string();
        assert!(e.contains("timed out"), "{e}");
        assert_eq!(p.stats().failed_allocations, 1);
        drop((held, pages, pipe));
        assert_eq!(p.stats().allocated, 0);
    }
}
