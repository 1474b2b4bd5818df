//! The receiver's load: a request's chunks into the paged KV cache
//! (the reference's `batched_to_gpu`).
//!
//! Resident chunks (push, pull-eager) are scattered from their sealed
//! pages. Pull-delay proxies are grouped per sender, and each group runs
//! through its own [`PingPongPipeline`] over pages allocated for it: two
//! pools of `depth` pages (depth from the pages free now, at most
//! `max_depth` and the group, at least 1). A proxy is consumed (and, with
//! its pull's last one, the pull's PullDoneSignal sent, exactly once) only
//! after its data is in the cache. A read is waited for no longer than its
//! pull's lease deadline: past it, the sender may have freed the pages, so
//! the read has failed, and its pages stay with the transfer (quarantined)
//! until it ends. On a failure that group's remaining proxies are not
//! read, scatters already started finish, the failed proxies are
//! discarded so their pulls' Done still goes out, and the keys come back in
//! [`LoadError::Incomplete`]. Invalid input (slot mapping, cache geometry)
//! is refused before anything is touched.

use super::pingpong::{
    allocate_pools, choose_depth, ItemOutcome, MicroBatch, PingPongPipeline, PipelineIo,
    ReadFailure,
};
use super::scatter::{ScatterItem, ScatterLane, ScatterTicket, SharedCache};
use super::{cost, KeyFailure, LoadError, LoadOptions, LoadReport};
use crate::channel::{Completion, DirectRead, PeerId, ReadOp, TransferChannel, TransferOp};
use crate::kv::{plan, KvCache, ScatterStats};
use crate::layout::ChunkLayout;
use crate::memory::{ChunkMeta, MemObj, PagePool, SealedMemObj};
use crate::protocol::{
    Lookup, ProxyEntry, ReadOutcome, ReceiverCore, SendPullDone, RESIDENT_EXPIRED,
};
use std::ops::Range;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, MutexGuard};
use std::time::{Duration, Instant};

/// What a load needs from the receiver around it.
pub(crate) trait LoadEnv: Sync {
    /// The receiver's core, locked.
    fn core(&self) -> MutexGuard<'_, ReceiverCore>;
    /// The transfer channel.
    fn channel(&self) -> &dyn TransferChannel;
    /// The pool pipeline pages come from.
    fn pool(&self) -> &Arc<PagePool>;
    /// The chunk layout.
    fn layout(&self) -> ChunkLayout;
    /// How long to wait for pipeline pages when none are free.
    fn page_wait(&self) -> Duration;
    /// The attached sender `sender_id`, if any.
    fn peer_of(&self, sender_id: &str) -> Option<PeerId>;
    /// Sends a PullDoneSignal.
    fn send_done(&self, done: SendPullDone);
    /// Counts bytes read from senders.
    fn read_bytes(&self, bytes: u64);
    /// Counts a failed transfer.
    fn transfer_failed(&self);
    /// The modeled Ascend link loads price their ops with (`pd_npu_link`),
    /// if any.
    fn npu_link(&self) -> Option<&'static ascend_sys::link::Link> {
        None
    }
}

/// One key of a load: its place in the request and its tokens' slots.
#[derive(Clone, Debug)]
struct LoadItem {
    index: usize,
    key: String,
    slots: Range<usize>,
}

/// The proxies of one sender in a load.
struct SenderGroup {
    sender_id: String,
    items: Vec<(LoadItem, ProxyEntry)>,
}

fn key_failure(key: &str, proxy: Option<&ProxyEntry>, reason: impl Into<String>) -> KeyFailure {
    KeyFailure {
        key: key.to_owned(),
        pull_id: proxy.map(|p| p.handle.pull_id.clone()),
        sender_id: proxy.map(|p| p.sender_id.clone()),
        reason: reason.into(),
    }
}

/// Discards the proxy of `key` if it is still stored (its pull's Done may
/// follow); returns whether a Done was sent.
pub(crate) fn discard_proxy(env: &impl LoadEnv, key: &str, req: Option<&str>) -> bool {
    // The core decides whether the key may go (other holders, claims).
    let done = env.core().give_up_proxy(key, req);
    match done {
        Some(d) => {
            env.send_done(d);
            true
        }
        None => false,
    }
}

#[derive(Default)]
struct LoadTally {
    loaded: Vec<usize>,
    failed: Vec<KeyFailure>,
    scatter: ScatterStats,
    bytes_read: u64,
    dones: usize,
    batches: usize,
    resident: usize,
    proxies: usize,
    depth: usize,
    pools: usize,
    peak_buffer_bytes: usize,
    direct: usize,
    /// Why the link model chose the path (see [`modeled_direct`]).
    path_reason: Option<String>,
}

impl LoadTally {
    /// Adds what a sender group loaded concurrently with others did (their
    /// staging pages coexist: the peaks add up).
    fn absorb(&mut self, t: LoadTally) {
        self.depth = self.depth.max(t.depth);
        self.pools = self.pools.max(t.pools);
        self.peak_buffer_bytes += t.peak_buffer_bytes;
        self.loaded.extend(t.loaded);
        self.failed.extend(t.failed);
        self.scatter.bytes += t.scatter.bytes;
        self.scatter.copies += t.scatter.copies;
        self.bytes_read += t.bytes_read;
        self.dones += t.dones;
        self.batches += t.batches;
        self.proxies += t.proxies;
        self.direct += t.direct;
    }
}

/// Loads `keys` (one request, chunk `i` covering tokens
/// `[i * chunk_size, i * chunk_size + tokens_i)`) into `cache` at the
/// slots of `slot_mapping`. See the module docs.
pub(crate) fn load_keys(
    env: &impl LoadEnv,
    keys: &[String],
    slot_mapping: &[i64],
    cache: &SharedCache<'_>,
    opts: &LoadOptions,
) -> Result<LoadReport, LoadError> {
    let start = Instant::now();
    let layout = env.layout();
    let (spec, device) = {
        let c = cache.lock();
        (*c.spec(), c.device())
    };
    spec.check_layout(&layout)?;
    // Every slot is checked once here, so no copy can fail on one later.
    plan::token_runs(slot_mapping, spec.slots())?;
    let per = opts.pieces_per_chunk.max(1);
    if keys.len() % per != 0 {
        return Err(LoadError::Pieces {
            chunk: keys.len() / per,
            detail: format!(
                "{} key(s) are not a whole number of chunks of {per} piece(s)",
                keys.len()
            ),
        });
    }

    // Classify under one lock; nothing changes until the input is validated.
    let mut tally = LoadTally::default();
    let mut resident: Vec<(LoadItem, SealedMemObj)> = Vec::new();
    let mut groups: Vec<SenderGroup> = Vec::new();
    let mut expired = Vec::new();
    {
        let core = env.core();
        let now = Instant::now();
        for (index, key) in keys.iter().enumerate() {
            let first = (index / per) * layout.tokens;
            let item = |tokens: usize| LoadItem {
                index,
                key: key.clone(),
                slots: first..first + tokens,
            };
            match core.get(key, now) {
                Lookup::Resident(m) => resident.push((item(m.tokens()), m.clone())),
                Lookup::Proxy(p) => {
                    let entry = (item(p.tokens()), p.clone());
                    match groups.iter_mut().find(|g| g.sender_id == p.sender_id) {
                        Some(g) => g.items.push(entry),
                        None => groups.push(SenderGroup {
                            sender_id: p.sender_id.clone(),
                            items: vec![entry],
                        }),
                    }
                }
                Lookup::NotReady => {
                    tally
                        .failed
                        .push(key_failure(key, None, "its data has not landed yet"))
                }
                Lookup::Expired => {
                    tally
                        .failed
                        .push(key_failure(key, None, "its pull lease expired"));
                    expired.push(key.clone());
                }
                Lookup::SenderRestarted => tally.failed.push(key_failure(
                    key,
                    None,
                    "its sender restarted or exited after announcing it; the data is gone \
                     (prefill again)",
                )),
                Lookup::ResidentExpired => {
                    tally.failed.push(key_failure(key, None, RESIDENT_EXPIRED))
                }
                Lookup::Missing => tally.failed.push(key_failure(key, None, "not stored")),
            }
        }
    }
    let metas = resident.iter().map(|(i, m)| (i, m.meta())).chain(
        groups
            .iter()
            .flat_map(|g| g.items.iter().map(|(i, p)| (i, p.meta))),
    );
    check_pieces(metas, per, spec.hidden)?;
    let items = resident
        .iter()
        .map(|(i, _)| i)
        .chain(groups.iter().flat_map(|g| g.items.iter().map(|(i, _)| i)));
    let chunks = keys.len() / per;
    for i in items {
        // Before any byte moves, every found chunk must fill exactly the
        // slots its position gives it: a short chunk would leave slots
        // unwritten under a load reported done.
        let chunk = i.index / per;
        let first = chunk * layout.tokens;
        let (expected, detail) = if chunk + 1 < chunks {
            (layout.tokens, "a chunk before the last must be full")
        } else {
            (
                slot_mapping.len().saturating_sub(first),
                "the last chunk must cover exactly the slots after the others",
            )
        };
        if i.slots.len() != expected && i.slots.end <= slot_mapping.len() {
            return Err(LoadError::SlotMappingMismatch {
                key: i.key.clone(),
                index: i.index,
                stored: i.slots.len(),
                expected,
                detail,
            });
        }
        if i.slots.end > slot_mapping.len() {
            return Err(LoadError::SlotMappingTooShort {
                key: i.key.clone(),
                index: i.index,
                start: i.slots.start,
                end: i.slots.end,
                len: slot_mapping.len(),
            });
        }
    }
    for k in &expired {
        tally.dones += usize::from(discard_proxy(env, k, None));
    }

    // A cache the channel can address (host memory for shm and tcp, the
    // NPU's memory registered with hccl): proxies are read straight into
    // it, one transfer per byte, no staging page. (Copies of a direct read
    // run in parallel: a slot mapping naming one slot twice goes through
    // the sequential staged path instead. A cache whose layout cuts tokens
    // into small runs, such as vLLM's CPU K with one run per element, is
    // staged too: see DIRECT_MIN_RUN.)
    let direct = !groups.is_empty()
        && opts.direct
        && env.channel().reads_direct(device)
        && worth_reading_direct(&cache.lock())
        && distinct_slots(slot_mapping)
        && modeled_direct(env, &groups, cache, slot_mapping, &mut tally)
        && registered(env.channel(), &mut cache.lock())
        && groups.iter().all(|g| prepared(env, &g.sender_id));
    let shared = cache;
    // A scatter thread only where it has reads to overlap the copies with:
    // staged reads of more than one micro-batch. Resident chunks (push,
    // pull-eager), direct reads (they start after the resident copies) and
    // one sender read in one micro-batch scatter on this thread instead: a
    // new thread can wait tens of ms for a core (see crate::threads).
    let staged = !groups.is_empty() && !direct;
    let one_batch = groups.len() == 1 && groups[0].items.len() <= opts.max_depth.max(1);
    if !staged {
        let mut lane = ScatterLane::here(shared, slot_mapping);
        scatter_resident(&mut lane, &resident, opts, &mut tally);
    }
    std::thread::scope(|scope| {
        if !staged {
            return;
        }
        let mut lane = match one_batch {
            true => ScatterLane::here(shared, slot_mapping),
            false => ScatterLane::new(scope, shared, slot_mapping),
        };
        scatter_resident(&mut lane, &resident, opts, &mut tally);
        // Several senders are read concurrently, each group with its own
        // ping-pong pools sized to its share of the free pages (and its own
        // scatter lane; scatters take turns on the cache). One after
        // another instead when a share could not hold a ping-pong pair (a
        // group would wait for pages another holds to its end), or when
        // the slot mapping names a slot twice (the later chunk in request
        // order must be the one left there, not whichever scatters last).
        let share = env.pool().stats().free / groups.len().max(1);
        if groups.len() < 2 || share < 2 || !distinct_slots(slot_mapping) {
            for g in &groups {
                load_group(env, g, layout, opts, &mut lane, &mut tally);
            }
            return;
        }
        let handles: Vec<_> = groups
            .iter()
            .map(|g| {
                let opts = LoadOptions {
                    max_depth: choose_depth(g.items.len(), share, opts.max_depth),
                    ..opts.clone()
                };
                scope.spawn(move || {
                    let mut lane = ScatterLane::new(scope, shared, slot_mapping);
                    let mut t = LoadTally::default();
                    load_group(env, g, layout, &opts, &mut lane, &mut t);
                    t
                })
            })
            .collect();
        // Every group is joined before a panic is passed on, so what the
        // others did (their Dones went out) is not lost with it.
        let mut panicked = None;
        for h in handles {
            match h.join() {
                Ok(t) => tally.absorb(t),
                Err(p) => panicked = panicked.or(Some(p)),
            }
        }
        if let Some(p) = panicked {
            std::panic::resume_unwind(p);
        }
    });
    if direct {
        // Each sender's proxies are read concurrently: their runs are
        // disjoint parts of the cache (see load_group_direct).
        let run = |g: &SenderGroup| {
            let mut t = LoadTally::default();
            load_group_direct(env, g, cache, slot_mapping, opts, &mut t);
            t
        };
        let parts: Vec<LoadTally> = match groups.as_slice() {
            [one] => vec![run(one)],
            _ => std::thread::scope(|sc| {
                let handles: Vec<_> = groups.iter().map(|g| sc.spawn(move || run(g))).collect();
                handles
                    .into_iter()
                    .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
                    .collect()
            }),
        };
        for t in parts {
            tally.absorb(t);
        }
    }

    let mut loaded = tally.loaded;
    loaded.sort_unstable();
    let report = LoadReport {
        loaded: loaded.into_iter().map(|i| keys[i].clone()).collect(),
        resident: tally.resident,
        proxies: tally.proxies,
        senders: groups.len(),
        depth: tally.depth,
        pools: tally.pools,
        micro_batches: tally.batches,
        peak_buffer_bytes: tally.peak_buffer_bytes,
        bytes_read: tally.bytes_read,
        bytes_scattered: tally.scatter.bytes as u64,
        copies: tally.scatter.copies as u64,
        dones_sent: tally.dones,
        direct: tally.direct,
        path_reason: tally.path_reason,
        elapsed: start.elapsed(),
    };
    if tally.failed.is_empty() {
        Ok(report)
    } else {
        let mut failed = tally.failed;
        let pos = |k: &str| keys.iter().position(|x| x == k).unwrap_or(usize::MAX);
        failed.sort_by_key(|f| pos(&f.key));
        Err(LoadError::Incomplete {
            failed,
            report: Box::new(report),
        })
    }
}

/// Checks that the pieces found for each chunk (those not already failed)
/// tile a cache token of `hidden` elements exactly once and agree on their
/// tokens; a chunk with a piece missing fails through that key instead.
fn check_pieces<'a>(
    found: impl Iterator<Item = (&'a LoadItem, ChunkMeta)>,
    per: usize,
    hidden: usize,
) -> Result<(), LoadError> {
    let mut chunks: std::collections::BTreeMap<usize, Vec<ChunkMeta>> = Default::default();
    for (item, meta) in found {
        chunks.entry(item.index / per).or_default().push(meta);
    }
    for (chunk, mut pieces) in chunks {
        // Overlaps and token counts are checked even for a chunk with a
        // piece missing (that chunk fails, but its pieces must not be
        // copied over one another meanwhile); coverage only when whole.
        let whole = pieces.len() >= per;
        pieces.sort_by_key(|m| m.hidden_offset);
        let mut at = 0;
        for m in &pieces {
            let placed = match whole {
                true => m.hidden_offset == at,
                false => m.hidden_offset >= at,
            };
            if !placed || m.tokens != pieces[0].tokens {
                return Err(LoadError::Pieces {
                    chunk,
                    detail: format!(
                        "its pieces hold elements {} of each token's {hidden}, with {} tokens",
                        pieces
                            .iter()
                            .map(|m| format!(
                                "[{}, {})",
                                m.hidden_offset,
                                m.hidden_offset + m.layout.hidden
                            ))
                            .collect::<Vec<_>>()
                            .join(" "),
                        pieces
                            .iter()
                            .map(|m| m.tokens.to_string())
                            .collect::<Vec<_>>()
                            .join("/")
                    ),
                });
            }
            at = m.hidden_offset + m.layout.hidden;
        }
        if whole && at != hidden {
            return Err(LoadError::Pieces {
                chunk,
                detail: format!("its {per} piece(s) hold {at} of each token's {hidden} elements"),
            });
        }
    }
    Ok(())
}

/// Scatters resident chunks from their own pages, `max_depth` per batch.
fn scatter_resident(
    lane: &mut ScatterLane<'_, '_>,
    resident: &[(LoadItem, SealedMemObj)],
    opts: &LoadOptions,
    tally: &mut LoadTally,
) {
    let mut tickets = Vec::new();
    for batch in resident.chunks(opts.max_depth.max(1)) {
        let items = batch
            .iter()
            .map(|(i, page)| ScatterItem {
                page: page.clone(),
                meta: page.meta(),
                slots: i.slots.clone(),
            })
            .collect();
        tickets.push((batch, lane.submit(items)));
    }
    for (batch, ticket) in tickets {
        match ticket.and_then(|t| lane.finish(t)) {
            Ok(st) => {
                tally.scatter.copies += st.copies;
                tally.scatter.bytes += st.bytes;
                tally.loaded.extend(batch.iter().map(|(i, _)| i.index));
                tally.resident += batch.len();
            }
            Err(e) => tally.failed.extend(
                batch
                    .iter()
                    .map(|(i, _)| key_failure(&i.key, None, e.clone())),
            ),
        }
    }
}

/// Runs one sender's proxies through a pipeline of their own pages, then
/// resolves every proxy it did not consume.
fn load_group(
    env: &impl LoadEnv,
    g: &SenderGroup,
    layout: ChunkLayout,
    opts: &LoadOptions,
    lane: &mut ScatterLane<'_, '_>,
    tally: &mut LoadTally,
) {
    let peer = env.peer_of(&g.sender_id).ok_or_else(|| {
        format!(
            "sender {} is not attached (it never completed a handshake, or went away)",
            g.sender_id
        )
    });
    let deadline = Instant::now() + env.page_wait();
    let pages = allocate_pools(
        env.pool(),
        ChunkMeta::full(layout),
        g.items.len(),
        opts.max_depth,
        deadline,
    );
    let mut pipe = match pages {
        Ok((pages, depth)) => PingPongPipeline::new(pages, depth),
        Err(e) => {
            let reason = format!("no pages to read into: {e}");
            for (item, proxy) in &g.items {
                tally.dones += usize::from(discard_proxy(env, &item.key, opts.req_id.as_deref()));
                tally
                    .failed
                    .push(key_failure(&item.key, Some(proxy), reason.clone()));
            }
            return;
        }
    }
    .expect("allocate_pools returns at least one page");
    tally.depth = tally.depth.max(pipe.depth());
    tally.pools = tally.pools.max(pipe.pools());
    tally.peak_buffer_bytes = tally.peak_buffer_bytes.max(pipe.buffer_bytes());
    let mut io = ProxyIo {
        env,
        req: opts.req_id.as_deref(),
        peer,
        items: &g.items,
        began: vec![None; g.items.len()],
        lane,
        tally,
    };
    let run = pipe.run(g.items.len(), &mut io);
    if run.pages_left_in_transfers > 0 {
        log::warn!(
            "{} page(s) stay with reads from {} given up past their lease; they return to the \
             pool when those transfers end",
            run.pages_left_in_transfers,
            g.sender_id
        );
    }
    let ProxyIo {
        mut began, tally, ..
    } = io;
    tally.batches += run.batches;
    for (j, outcome) in run.outcomes.into_iter().enumerate() {
        let (item, proxy) = &g.items[j];
        let reason = match outcome {
            ItemOutcome::Scattered => continue,
            ItemOutcome::Failed(e) => e,
            ItemOutcome::NotStarted => format!(
                "not read: an earlier micro-batch from sender {} failed",
                g.sender_id
            ),
        };
        // A pinned proxy ends its read as failed (discarded once no read is
        // in flight); an unpinned one is discarded. Either way its pull's
        // Done still goes out once all its proxies are resolved.
        let done = match began[j].take() {
            Some(p) => env.core().end_proxy_read_for(
                &p.handle,
                ReadOutcome::Failed,
                opts.req_id.as_deref(),
            ),
            None => {
                tally.dones += usize::from(discard_proxy(env, &item.key, opts.req_id.as_deref()));
                None
            }
        };
        if let Some(d) = done {
            env.send_done(d);
            tally.dones += 1;
        }
        tally
            .failed
            .push(key_failure(&item.key, Some(proxy), reason));
    }
    // The pipeline's idle pages go back now; pages a given-up read still
    // holds return when that transfer ends.
    drop(pipe);
}

/// Pins `item`'s proxy for a read — only if it is still the proxy the load
/// classified (`expect`): a key announced again meanwhile names other
/// bytes, possibly of another shape, and is left to a later load.
fn begin_same(
    core: &mut ReceiverCore,
    item: &LoadItem,
    expect: &ProxyEntry,
    now: Instant,
) -> Result<ProxyEntry, String> {
    if let Lookup::Proxy(p) = core.get(&item.key, now) {
        if p.handle != expect.handle {
            return Err(
                "it was announced again while this load ran (another pull); load it again".into(),
            );
        }
    }
    core.begin_proxy_read(&item.key, now)
        .map_err(|e| e.to_string())
}

/// Whether `cache` is registered with `channel` for direct reads, where
/// the channel needs it; registers it on first use (the registration lives
/// as long as the cache). A refusal is logged and the load is staged.
fn registered(channel: &dyn TransferChannel, cache: &mut KvCache) -> bool {
    let Some(id) = channel.direct_registry() else {
        return true;
    };
    if cache.is_registered_with(id) {
        return true;
    }
    // SAFETY: the regions are the cache's own memory (host memory, or
    // device memory of `cache.device()`, allocated by the runtime or by
    // the engine under wrap_npu's contract that it outlives the cache);
    // the registration is kept in the cache, which drops it before that
    // memory.
    match unsafe { channel.register_direct(cache.device(), &cache.regions()) } {
        Ok(Some(r)) => {
            cache.keep_registration(r);
            true
        }
        Ok(None) => true,
        Err(e) => {
            log::warn!(
                "the {} channel cannot read straight into this KV cache ({e}); loading through \
                 staging pages",
                channel.kind().name()
            );
            false
        }
    }
}

/// Whether the connection to `sender_id` is ready for direct reads (see
/// [`TransferChannel::prepare_direct`]); a refusal is logged and the load
/// is staged. A sender not attached fails its keys on either path.
fn prepared(env: &impl LoadEnv, sender_id: &str) -> bool {
    let Some(peer) = env.peer_of(sender_id) else {
        return true;
    };
    match env.channel().prepare_direct(peer) {
        Ok(()) => true,
        Err(e) => {
            log::warn!(
                "sender {sender_id} cannot be read straight into the KV cache ({e}); loading \
                 through staging pages"
            );
            false
        }
    }
}

/// Runs smaller than this that a cache's layout cuts tokens into (see
/// [`KvCache::min_run_bytes`]) send its loads through staging pages. Each
/// run of a direct read is its own operation: a request segment received
/// with its own system calls on tcp, a resolved piece on shm, a device
/// operation on hccl. For pieces of a token (heads apart, or elements
/// apart as in vLLM's CPU K, 2-byte runs: hundreds of thousands per chunk)
/// under about a kilobyte that costs more than the staged path's extra
/// copy (one large read into a page, then a host or device scatter).
/// Layouts whose runs are whole tokens or more load as before: their runs
/// are as coarse as a slot mapping's.
const DIRECT_MIN_RUN: usize = 1024;

/// Whether `cache`'s layout keeps runs coarse enough for a direct load
/// ([`DIRECT_MIN_RUN`]); logged when not.
fn worth_reading_direct(cache: &KvCache) -> bool {
    let run = cache.min_run_bytes();
    if run >= cache.spec().token_bytes() || run >= DIRECT_MIN_RUN {
        return true;
    }
    log::debug!(
        "this KV cache's layout cuts tokens into runs of {run} bytes (under {DIRECT_MIN_RUN}): \
         loading through staging pages rather than one direct read per run"
    );
    false
}

/// With a modeled link (`pd_npu_link`) under a channel whose ops follow
/// one (hccl), whether reading `groups` directly into the cache is modeled
/// no more than [`cost::DIRECT_TOLERANCE`] times slower than reading their
/// pages whole and scattering them (see [`cost`]); the reason goes to the
/// log and the load report. Without a model: true (direct wherever the
/// channel can).
fn modeled_direct(
    env: &impl LoadEnv,
    groups: &[SenderGroup],
    cache: &SharedCache<'_>,
    slot_mapping: &[i64],
    tally: &mut LoadTally,
) -> bool {
    let (Some(link), Some(path)) = (env.npu_link(), env.channel().link_path()) else {
        return true;
    };
    let mut direct = Vec::new();
    let mut staged = Vec::new();
    {
        let c = cache.lock();
        for (item, p) in groups.iter().flat_map(|g| g.items.iter()) {
            // A chunk the cache cannot take fails on either path; it is
            // left out of both prices.
            let Ok(ops) = direct_reads(&c, p, &slot_mapping[item.slots.clone()]) else {
                continue;
            };
            direct.extend(ops);
            staged.push(p.byte_len());
        }
    }
    let Some(price) = cost::PathPrice::of(link, path, &direct, staged) else {
        return true;
    };
    let wins = price.direct_wins();
    // Said once at info when the choice changes, and for every load at debug.
    static LAST: AtomicU8 = AtomicU8::new(0);
    let code = if wins { 1 } else { 2 };
    if LAST.swap(code, Ordering::Relaxed) != code {
        log::info!("pull-delay load path: {price}");
    } else {
        log::debug!("pull-delay load path: {price}");
    }
    tally.path_reason = Some(price.to_string());
    wins
}

/// The direct reads that bring `proxy`'s chunk into `cache` at `slots`:
/// one per run of the cache's copy plan, ranges adjacent in the page and
/// in the cache merged into one op.
fn direct_reads(
    cache: &KvCache,
    proxy: &ProxyEntry,
    slots: &[i64],
) -> Result<Vec<DirectRead>, crate::kv::KvError> {
    let mut ops: Vec<DirectRead> = cache
        .direct_targets(&proxy.meta, slots)?
        .into_iter()
        .map(|r| DirectRead {
            remote: proxy.remote,
            offset: r.chunk_offset,
            dst: r.addr,
            len: r.len,
        })
        .collect();
    cost::coalesce(&mut ops);
    Ok(ops)
}

/// Whether no slot appears twice in `slots` (padding aside).
fn distinct_slots(slots: &[i64]) -> bool {
    let mut v: Vec<i64> = slots.iter().copied().filter(|&s| s >= 0).collect();
    v.sort_unstable();
    v.windows(2).all(|w| w[0] != w[1])
}

/// Reads one sender's proxies straight into the cache (a direct
/// load), `max_depth` proxies per channel call. Each call returns only
/// when its copies are done, so none outlives the load; a proxy whose
/// lease ended before its copy finished is failed (the sender may have
/// reused its page), and every proxy still ends exactly once (its pull's
/// Done follows as on the staged path).
fn load_group_direct(
    env: &impl LoadEnv,
    g: &SenderGroup,
    cache: &SharedCache<'_>,
    slot_mapping: &[i64],
    opts: &LoadOptions,
    tally: &mut LoadTally,
) {
    let req = opts.req_id.as_deref();
    let peer = env.peer_of(&g.sender_id);
    for batch in g.items.chunks(opts.max_depth.max(1)) {
        let now = Instant::now();
        let mut began: Vec<(&LoadItem, ProxyEntry)> = Vec::new();
        let mut ops = Vec::new();
        let fail = |item: &LoadItem, proxy: &ProxyEntry, why: String, tally: &mut LoadTally| {
            tally.dones += usize::from(discard_proxy(env, &item.key, req));
            tally.failed.push(key_failure(&item.key, Some(proxy), why));
        };
        for (item, proxy) in batch {
            if peer.is_none() {
                let why = format!(
                    "sender {} is not attached (it never completed a handshake, or went away)",
                    g.sender_id
                );
                fail(item, proxy, why, tally);
                continue;
            }
            let began_one = begin_same(&mut env.core(), item, proxy, now);
            let p = match began_one {
                Ok(p) => p,
                Err(why) => {
                    fail(item, proxy, why, tally);
                    continue;
                }
            };
            // Checked with the layout before anything moved; it cannot fail
            // here except on a proxy whose chunk the cache cannot take.
            // The cache is locked only to plan: the read below runs
            // unlocked, so other requests' loads go on meanwhile.
            let targets = direct_reads(&cache.lock(), &p, &slot_mapping[item.slots.clone()]);
            match targets {
                Ok(mine) => {
                    ops.extend(mine);
                    began.push((item, p));
                }
                Err(_) => {
                    let done = env
                        .core()
                        .end_proxy_read_for(&p.handle, ReadOutcome::Failed, req);
                    if let Some(d) = done {
                        env.send_done(d);
                        tally.dones += 1;
                    }
                    tally.failed.push(key_failure(
                        &item.key,
                        Some(proxy),
                        "its chunk does not fit this KV cache",
                    ));
                }
            }
        }
        let Some(peer) = peer else { continue };
        if began.is_empty() {
            continue;
        }
        let bytes: u64 = ops.iter().map(|o| o.len as u64).sum();
        let deadline = began
            .iter()
            .map(|(_, p)| p.lease_deadline)
            .min()
            .unwrap_or(now);
        // SAFETY: every destination is a run of this cache's own memory
        // (direct_targets, from its copy plan; registered with the channel
        // where it needs that), alive while the load borrows the cache.
        // Nothing else writes those runs during the call: a lent cache is
        // this load's alone (the sender groups reading concurrently share
        // it only to plan); a shared engine cache's other loads hold slot
        // claims disjoint from this request's (SharedKvCache::claim), and
        // the engine leaves a loading request's slots alone. Runs never
        // overlap, within a group or across groups: each token has its
        // own slot (distinct_slots, checked before choosing this path) and
        // a chunk's runs cover distinct (layer, plane, slot) elements (the
        // head pieces of one chunk distinct elements: check_pieces).
        let read = unsafe { env.channel().read_direct(peer, &ops, deadline) };
        let finished = Instant::now();
        tally.batches += 1;
        if read.is_ok() {
            env.read_bytes(bytes);
            tally.bytes_read += bytes;
        } else {
            env.transfer_failed();
        }
        for (item, p) in began {
            let outcome = match &read {
                // The sender may free its pages at the lease's end: bytes
                // copied past it cannot be trusted (and a read still
                // waiting then was given up).
                _ if finished > p.lease_deadline => {
                    Err("the direct read did not finish within the pull's lease".to_string())
                }
                Err(e) => Err(format!("direct read from {peer}: {e}")),
                Ok(()) => Ok(()),
            };
            let ended = match &outcome {
                Ok(()) => ReadOutcome::Consumed,
                Err(_) => ReadOutcome::Failed,
            };
            let done = env.core().end_proxy_read_for(&p.handle, ended, req);
            if let Some(d) = done {
                env.send_done(d);
                tally.dones += 1;
            }
            match outcome {
                Ok(()) => {
                    tally.loaded.push(item.index);
                    tally.proxies += 1;
                    tally.direct += 1;
                    tally.scatter.bytes += p.byte_len();
                    tally.scatter.copies += ops.iter().filter(|o| o.remote == p.remote).count();
                }
                Err(why) => tally.failed.push(key_failure(&item.key, Some(&p), why)),
            }
        }
    }
}

/// The pipeline's I/O for one sender: proxy pins, channel reads, scatters
/// through the lane, and consumption once scattered.
struct ProxyIo<'l, 'a, 'c, E: LoadEnv> {
    env: &'l E,
    /// The request being loaded (see [`LoadOptions::req_id`]).
    req: Option<&'l str>,
    peer: Result<PeerId, String>,
    items: &'l [(LoadItem, ProxyEntry)],
    /// The proxy as pinned by `begin_proxy_read`, until its read is ended.
    began: Vec<Option<ProxyEntry>>,
    lane: &'l mut ScatterLane<'a, 'c>,
    tally: &'l mut LoadTally,
}

impl<E: LoadEnv> PipelineIo for ProxyIo<'_, '_, '_, E> {
    /// The completion, the batch's lease deadline, and its bytes.
    type Read = (Completion<MemObj>, Instant, u64);
    type Scatter = ScatterTicket;

    fn start_read(
        &mut self,
        b: &MicroBatch,
        pages: Vec<MemObj>,
    ) -> Result<Self::Read, (String, Vec<MemObj>)> {
        let peer = match self.peer.clone() {
            Ok(p) => p,
            Err(e) => return Err((e, pages)),
        };
        let now = Instant::now();
        let mut ops: Vec<ReadOp> = Vec::with_capacity(b.len());
        let mut deadline = None::<Instant>;
        {
            let mut core = self.env.core();
            let mut pages = pages.into_iter();
            for j in b.items.clone() {
                let page = pages.next().expect("one page per item");
                match begin_same(&mut core, &self.items[j].0, &self.items[j].1, now) {
                    Ok(p) => {
                        deadline =
                            Some(deadline.map_or(p.lease_deadline, |d| d.min(p.lease_deadline)));
                        ops.push(TransferOp {
                            local: page,
                            remote: p.remote,
                            local_offset: 0,
                            remote_offset: 0,
                            len: p.byte_len(),
                        });
                        self.began[j] = Some(p);
                    }
                    Err(e) => {
                        // Nothing was submitted: every page comes back.
                        let mut back: Vec<MemObj> = ops.into_iter().map(|o| o.local).collect();
                        back.push(page);
                        back.extend(pages);
                        return Err((e, back));
                    }
                }
            }
        }
        let bytes = ops.iter().map(|o| o.len as u64).sum();
        let c = self.env.channel().submit_read(peer, ops).map_err(|e| {
            self.env.transfer_failed();
            // A refused batch was never started: its pages went back to the
            // pool with it; the pipeline stops on this error.
            (format!("read from {peer}: {e}"), Vec::new())
        })?;
        Ok((c, deadline.unwrap_or(now), bytes))
    }

    fn finish_read(
        &mut self,
        b: &MicroBatch,
        read: Self::Read,
    ) -> Result<Vec<MemObj>, ReadFailure> {
        let (mut c, deadline, bytes) = read;
        // Past the deadline the sender may free its pages: a read that has
        // not completed by then cannot be trusted.
        match c.wait_until(deadline) {
            Some(done) => match done.result {
                Ok(()) => {
                    self.env.read_bytes(bytes);
                    self.tally.bytes_read += bytes;
                    Ok(done.pages)
                }
                Err(e) => {
                    self.env.transfer_failed();
                    let pages = (done.pages.len() == b.len()).then_some(done.pages);
                    Err((
                        format!("read of micro-batch {} failed: {e}", b.index),
                        pages,
                    ))
                }
            },
            None => {
                self.env.transfer_failed();
                // Dropping the completion leaves the pages with the
                // transfer, counted as quarantined, until it ends.
                drop(c);
                Err((
                    format!(
                        "read of micro-batch {} did not finish within the pull's lease",
                        b.index
                    ),
                    None,
                ))
            }
        }
    }

    fn start_scatter(
        &mut self,
        b: &MicroBatch,
        pages: &[SealedMemObj],
    ) -> Result<ScatterTicket, String> {
        let items = b
            .items
            .clone()
            .zip(pages)
            .map(|(j, page)| ScatterItem {
                page: page.clone(),
                // The proxy's chunk (tokens, head piece), not the staging
                // page's full-chunk layout.
                meta: self.items[j].1.meta,
                slots: self.items[j].0.slots.clone(),
            })
            .collect();
        self.lane.submit(items)
    }

    fn finish_scatter(&mut self, _b: &MicroBatch, t: ScatterTicket) -> Result<(), String> {
        let st = self.lane.finish(t)?;
        self.tally.scatter.copies += st.copies;
        self.tally.scatter.bytes += st.bytes;
        Ok(())
    }

    fn scattered(&mut self, b: &MicroBatch) {
        for j in b.items.clone() {
            let Some(p) = self.began[j].take() else {
                continue;
            };
            self.tally.loaded.push(self.items[j].0.index);
            self.tally.proxies += 1;
            let done =
                self.env
                    .core()
                    .end_proxy_read_for(&p.handle, ReadOutcome::Consumed, self.req);
            if let Some(d) = done {
                self.env.send_done(d);
                self.tally.dones += 1;
            }
        }
    }
}
