//! The ping-pong pipeline as plain logic: micro-batching, depth choice,
//! pool reuse ordering and error draining, over an I/O trait
//! ([`PipelineIo`]) that the load path implements with real reads and
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
//! **A pool's pages are where its work is.** A read takes its pool's
//! pages by value and its completion gives them back; a scatter reads them
//! sealed, and the pipeline takes them back writable only when the scatter
//! has dropped its copies ([`SealedMemObj::try_unseal`]). A read that
//! failed without giving its pages back (given up past its deadline, or
//! abandoned while the device may still write) leaves them with the
//! transfer, quarantined: the run stops, and those pages are never read
//! into or scattered from again. At most one read is in flight and it is
//! always finished (or given up) before the run returns. The first
//! failure stops new reads; scatters already started are still finished
//! (their data is good).

use crate::memory::{ChunkMeta, MemObj, MemoryError, PagePool, SealedMemObj};
use std::collections::VecDeque;
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

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

/// A read that ended badly: why, and its pages if the transfer is over
/// (`None`: they stay with the transfer, quarantined, until it ends).
pub type ReadFailure = (String, Option<Vec<MemObj>>);

/// The I/O of a run. Each `start_*` returns a ticket that the pipeline
/// passes back to the matching `finish_*` exactly once (in start order for
/// scatters). Errors are messages naming what failed.
pub trait PipelineIo {
    /// A read in flight.
    type Read;
    /// A scatter in flight.
    type Scatter;
    /// Starts reading `batch`'s items into `pages` (one per item, in order),
    /// which the read owns until it ends. A read that cannot start gives
    /// its (untouched) pages back with the error.
    fn start_read(
        &mut self,
        batch: &MicroBatch,
        pages: Vec<MemObj>,
    ) -> Result<Self::Read, (String, Vec<MemObj>)>;
    /// Waits for a read: its pages, now holding the data, or the failure.
    fn finish_read(
        &mut self,
        batch: &MicroBatch,
        read: Self::Read,
    ) -> Result<Vec<MemObj>, ReadFailure>;
    /// Starts scattering `batch`'s items from `pages` (sealed: only read).
    /// The scatter keeps clones only until it finishes.
    fn start_scatter(
        &mut self,
        batch: &MicroBatch,
        pages: &[SealedMemObj],
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
    /// Pages left with a read that did not give them back.
    pub pages_left_in_transfers: usize,
}

impl PipelineRun {
    /// Whether every item was scattered.
    #[cfg(test)]
    pub fn all_scattered(&self) -> bool {
        self.outcomes.iter().all(|o| *o == ItemOutcome::Scattered)
    }
}

/// Two pools of `depth` pages (one when a request fits one batch) and the
/// schedule that reads into one while the other is scattered.
#[derive(Debug)]
pub struct PingPongPipeline {
    /// Each pool's pages while they are idle (taken by reads, given back).
    pools: Vec<Vec<MemObj>>,
    depth: usize,
    page_size: usize,
}

impl PingPongPipeline {
    /// Splits `pages` into pools of `depth` pages: two when there are at
    /// least `2 * depth`, else one (then batches alternate with no
    /// overlap). `None` when there is no page.
    pub fn new(mut pages: Vec<MemObj>, depth: usize) -> Option<PingPongPipeline> {
        let page_size = pages.first()?.pool().buffer().page_size();
        let depth = depth.clamp(1, pages.len());
        let pools = if pages.len() >= 2 * depth { 2 } else { 1 };
        pages.truncate(pools * depth);
        let mut it = pages.into_iter();
        let pools = (0..pools)
            .map(|_| it.by_ref().take(depth).collect())
            .collect();
        Some(PingPongPipeline {
            pools,
            depth,
            page_size,
        })
    }

    /// Pages per pool.
    pub fn depth(&self) -> usize {
        self.depth
    }

    /// Number of pools (1 or 2).
    pub fn pools(&self) -> usize {
        self.pools.len()
    }

    /// Bytes of every page the pipeline was built with (its peak buffer).
    pub fn buffer_bytes(&self) -> usize {
        self.pools.len() * self.depth * self.page_size
    }

    /// `n` idle pages of pool `p`, if it still has them.
    fn take(&mut self, p: usize, n: usize) -> Option<Vec<MemObj>> {
        let pool = &mut self.pools[p];
        (pool.len() >= n).then(|| pool.split_off(pool.len() - n))
    }

    /// Runs `items` items through read → scatter with `io` (see the module
    /// docs for the order). Returns only when nothing started is still in
    /// flight, or was given up and holds its own pages.
    pub fn run<I: PipelineIo>(&mut self, items: usize, io: &mut I) -> PipelineRun {
        let batches = micro_batches(items, self.depth, self.pools.len());
        let mut out = vec![ItemOutcome::NotStarted; items];
        let mut left_in_transfers = 0;
        let fail = |out: &mut [ItemOutcome], b: &MicroBatch, e: String| {
            for i in b.items.clone() {
                out[i] = ItemOutcome::Failed(e.clone());
            }
        };
        let mut scattering: VecDeque<(&MicroBatch, Vec<SealedMemObj>, I::Scatter)> =
            VecDeque::new();
        let mut reading = None;
        let mut stopped = false;
        if let Some(b0) = batches.first() {
            match self.start(io, b0) {
                Ok(r) => reading = Some((b0, r)),
                Err(e) => fail(&mut out, b0, e),
            }
        }
        while let Some((b, r)) = reading.take() {
            match io.finish_read(b, r) {
                Ok(pages) => {
                    let sealed: Vec<SealedMemObj> = pages.into_iter().map(MemObj::seal).collect();
                    match io.start_scatter(b, &sealed) {
                        Ok(s) => scattering.push_back((b, sealed, s)),
                        Err(e) => {
                            self.give_back(b.pool, sealed);
                            fail(&mut out, b, e);
                            stopped = true;
                        }
                    }
                }
                Err((e, pages)) => {
                    match pages {
                        Some(p) => self.pools[b.pool].extend(p),
                        None => left_in_transfers += b.len(),
                    }
                    fail(&mut out, b, e);
                    stopped = true;
                }
            }
            let Some(next) = batches.get(b.index + 1).filter(|_| !stopped) else {
                break;
            };
            // The next batch's pool is free once every scatter from it has finished.
            while scattering.iter().any(|(s, _, _)| s.pool == next.pool) {
                let (s, pages, t) = scattering.pop_front().expect("non-empty");
                if !self.finish_scatter(io, s, pages, t, &mut out) {
                    stopped = true;
                }
            }
            if stopped {
                break;
            }
            match self.start(io, next) {
                Ok(r) => reading = Some((next, r)),
                Err(e) => fail(&mut out, next, e),
            }
        }
        // Drain: every loop exit above has already finished its read; the
        // scatters started are finished here, before the pools may be freed.
        while let Some((s, pages, t)) = scattering.pop_front() {
            self.finish_scatter(io, s, pages, t, &mut out);
        }
        PipelineRun {
            outcomes: out,
            batches: batches.len(),
            pages_left_in_transfers: left_in_transfers,
        }
    }

    fn start<I: PipelineIo>(&mut self, io: &mut I, b: &MicroBatch) -> Result<I::Read, String> {
        let pages = self.take(b.pool, b.len()).ok_or_else(|| {
            format!(
                "pool {} lost pages to a read that never gave them back; micro-batch {} not read",
                b.pool, b.index
            )
        })?;
        io.start_read(b, pages).map_err(|(e, pages)| {
            self.pools[b.pool].extend(pages);
            e
        })
    }

    /// Takes sealed pages back writable; a page some copy still holds stays
    /// out of the pool (it returns to the allocator when that copy drops).
    fn give_back(&mut self, pool: usize, pages: Vec<SealedMemObj>) {
        for p in pages {
            match p.try_unseal() {
                Ok(m) => self.pools[pool].push(m),
                Err(still_shared) => {
                    log::error!(
                        "scatter source page {} is still shared after its scatter; not reused",
                        still_shared.buffer_ref()
                    );
                }
            }
        }
    }

    fn finish_scatter<I: PipelineIo>(
        &mut self,
        io: &mut I,
        b: &MicroBatch,
        pages: Vec<SealedMemObj>,
        t: I::Scatter,
        out: &mut [ItemOutcome],
    ) -> bool {
        let r = io.finish_scatter(b, t);
        self.give_back(b.pool, pages);
        match r {
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
        /// The read of this batch is given up with its pages still in the transfer.
        abandon_read: Option<usize>,
        fail_finish_scatter: Option<usize>,
        reads_in_flight: usize,
        scatters_in_flight: usize,
        max_reads_in_flight: usize,
        /// Page of each item when read (must be the page it is scattered from).
        page_of: std::collections::HashMap<usize, u32>,
        /// Pages of reads given up (the "transfer" that still holds them).
        in_transfer: Vec<MemObj>,
        /// Every page a read was started into, in order.
        read_pages: Vec<u32>,
    }

    impl PipelineIo for Script {
        type Read = (usize, Vec<MemObj>);
        type Scatter = usize;
        fn start_read(
            &mut self,
            b: &MicroBatch,
            pages: Vec<MemObj>,
        ) -> Result<Self::Read, (String, Vec<MemObj>)> {
            assert_eq!(pages.len(), b.len());
            self.log.push(Ev::StartRead(b.index, b.pool));
            if self.fail_start_read == Some(b.index) {
                return Err((format!("batch {} could not start", b.index), pages));
            }
            for (i, p) in b.items.clone().zip(&pages) {
                self.page_of.insert(i, p.page());
                self.read_pages.push(p.page());
            }
            self.reads_in_flight += 1;
            self.max_reads_in_flight = self.max_reads_in_flight.max(self.reads_in_flight);
            Ok((b.index, pages))
        }
        fn finish_read(
            &mut self,
            b: &MicroBatch,
            (t, pages): Self::Read,
        ) -> Result<Vec<MemObj>, ReadFailure> {
            assert_eq!(t, b.index);
            self.reads_in_flight -= 1;
            self.log.push(Ev::FinishRead(b.index));
            if self.abandon_read == Some(b.index) {
                self.in_transfer.extend(pages);
                return Err((format!("read of batch {} given up", b.index), None));
            }
            match self.fail_finish_read == Some(b.index) {
                true => Err((format!("read of batch {} failed", b.index), Some(pages))),
                false => Ok(pages),
            }
        }
        fn start_scatter(
            &mut self,
            b: &MicroBatch,
            pages: &[SealedMemObj],
        ) -> Result<usize, String> {
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
            let mut pipe = PingPongPipeline::new(pages, d).unwrap();
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
            assert_eq!((p.stats().allocated, p.stats().quarantined), (0, 0));
        }
    }

    #[test]
    fn a_failure_stops_new_reads_and_drains_what_is_in_flight() {
        // (which failure, batch): batches 0..8 of depth 2 over 16 items.
        for (kind, at) in [(0, 3), (1, 3), (2, 3), (0, 0), (1, 7), (2, 0)] {
            let (p, meta) = pool(8);
            let (pages, d) = allocate_pools(&p, meta, 16, 2, Instant::now()).unwrap();
            let mut pipe = PingPongPipeline::new(pages, d).unwrap();
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
            assert_eq!((p.stats().allocated, p.stats().quarantined), (0, 0));
        }
    }

    /// A read given up while its transfer still holds the pages (a lease
    /// timeout, an abandoned hccl batch): the run stops, those pages are
    /// never read into or scattered from again, and they stay out of the
    /// pool until the transfer lets go.
    #[test]
    fn an_abandoned_read_never_gives_its_pages_to_later_work() {
        let (p, meta) = pool(8);
        let (pages, d) = allocate_pools(&p, meta, 16, 2, Instant::now()).unwrap();
        let mut pipe = PingPongPipeline::new(pages, d).unwrap();
        let mut io = Script {
            abandon_read: Some(2),
            ..Script::default()
        };
        let run = pipe.run(16, &mut io);
        assert_eq!(run.pages_left_in_transfers, 2);
        let abandoned: Vec<u32> = io.in_transfer.iter().map(|m| m.page()).collect();
        // Batch 2 read into pool 0; nothing read after it, and its pages
        // were never read into again by the run.
        let last = io.read_pages.len();
        assert_eq!(&io.read_pages[last - 2..], &abandoned[..]);
        assert!(matches!(run.outcomes[4], ItemOutcome::Failed(_)));
        assert!(run.outcomes[6..]
            .iter()
            .all(|o| *o == ItemOutcome::NotStarted));
        // A second run over the same pipeline (the next sender group) has
        // lost pool 0: it fails rather than reuse the abandoned pages.
        let mut io2 = Script::default();
        let run2 = pipe.run(4, &mut io2);
        assert!(!run2.all_scattered());
        assert!(io2.read_pages.iter().all(|pg| !abandoned.contains(pg)));
        drop(pipe);
        // Only the transfer's pages are still out.
        assert_eq!(p.stats().allocated, 2);
        drop(io);
        assert_eq!((p.stats().allocated, p.stats().quarantined), (0, 0));
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
        let mut pipe = PingPongPipeline::new(one, 1).unwrap();
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
        assert_eq!((p.stats().allocated, p.stats().quarantined), (0, 0));
    }
}
