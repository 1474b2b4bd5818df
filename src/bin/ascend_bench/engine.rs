//! The soak's engines: a prefill engine and a decode engine, each with a
//! paged KV cache in memory it allocated itself (as vLLM allocates its
//! own), wrapped by the library with `KvCache::wrap_host` and driven
//! through the request API users take — `SaveQueue` gathers a request's
//! chunks from the prefill cache and puts them, `LoadQueue` loads them
//! into the decode cache at the request's slots (pull-delay proxies read
//! straight into the cache over tcp and shm).
//!
//! The decode engine keeps an image of what its whole cache must hold:
//! after a done load every byte of the request is checked at its slots and
//! every other byte against the image (a load writes only its own slots);
//! after a failed load the bytes outside its slots are checked the same
//! way and its slots are put back to the image, so a write that arrives
//! after a load was given up shows at the next check.

use crate::roles::key_seed;
use ascend_pd::backend::{Receiver, Sender, TransferSpec};
use ascend_pd::kv::{KvCache, KvCacheSpec, KvStrides, KvTensor};
use ascend_pd::layout::ChunkLayout;
use ascend_pd::memory::pattern;
use ascend_pd::requests::{
    Availability, Completion, LoadQueue, LoadRequest, Outcome, SaveQueue, SaveRequest,
    SharedKvCache,
};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Tokens per block of the engines' caches (smaller than a chunk, so a
/// chunk's slots break at block boundaries).
const BLOCK: usize = 8;
/// Blocks per cache: room for the largest request (a pool hog of the
/// receiver's whole pool) with blocks to spare for shuffling.
const BLOCKS: usize = 64;
/// Longest a save or load may take before the soak calls it lost.
const COMPLETION_WAIT: Duration = Duration::from_secs(60);

/// How the bench's engine KV caches lie in memory (`--kv-layout`): each
/// one the library wraps with `KvCache::wrap_host` (the contiguous layout)
/// or `KvCache::wrap_host_strided` (the others).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum KvLayout {
    /// vLLM-Ascend's: per layer a K and a V `[num_blocks, block_size,
    /// heads, head]` (the contiguous layout; MLA: one latent per layer).
    #[default]
    Ascend,
    /// GPU backends': one `[2, num_blocks, block_size, heads × head]`
    /// tensor per layer, K's plane then V's, the layers' tensors apart.
    Stacked,
    /// vLLM's CPU backend's: one `[num_blocks, heads, block_size, 2 ×
    /// head]` tensor per layer, each (block, head) holding K transposed
    /// (element-major) then V token-major; not for MLA.
    VllmCpu,
}

impl KvLayout {
    /// The flag's value.
    pub fn name(self) -> &'static str {
        match self {
            KvLayout::Ascend => "ascend",
            KvLayout::Stacked => "stacked",
            KvLayout::VllmCpu => "vllm-cpu",
        }
    }
}

/// Bytes from one layer's tensor to the next in a non-contiguous engine
/// cache: its `planes × plane_bytes` rounded up to a 4 KiB page, and a page
/// more, so the layers lie apart as separately allocated tensors do (and a
/// write at a contiguous-layout offset lands in the wrong place).
fn layer_stride(spec: &KvCacheSpec) -> usize {
    (spec.planes() * spec.plane_bytes()).div_ceil(4096) * 4096 + 4096
}

/// Bytes an engine cache of `spec` in layout `kv` allocates.
fn engine_bytes(spec: &KvCacheSpec, kv: KvLayout) -> usize {
    match kv {
        KvLayout::Ascend => spec.bytes(),
        _ => spec.layers * layer_stride(spec),
    }
}

/// Wraps `mem` (at least [`engine_bytes`] long) as a host cache of `spec`
/// in layout `kv`; `heads`: KV heads per plane (vLLM's CPU layout is per
/// head).
///
/// # Safety
/// As [`KvCache::wrap_host`]: the memory stays allocated, readable and
/// writable until the cache is dropped.
unsafe fn wrap_engine_memory(
    spec: KvCacheSpec,
    mem: &EngineMemory,
    kv: KvLayout,
    heads: usize,
) -> anyhow::Result<KvCache> {
    let whole = mem.tensor();
    let layers: Vec<KvTensor> = (0..spec.layers)
        .map(|l| KvTensor {
            addr: whole.addr + (l * layer_stride(&spec)) as u64,
            bytes: spec.planes() * spec.plane_bytes(),
        })
        .collect();
    let (strides, planes) = match kv {
        // SAFETY: forwarded to the caller's contract.
        KvLayout::Ascend => return Ok(unsafe { KvCache::wrap_host(spec, &[whole]) }?),
        KvLayout::Stacked => (
            vec![KvStrides::contiguous(&spec)],
            KvStrides::stacked_planes(&spec, &layers)?,
        ),
        KvLayout::VllmCpu => {
            let why = |e: ascend_pd::kv::KvError| anyhow::anyhow!("--kv-layout vllm-cpu: {e}");
            (
                KvStrides::vllm_cpu(&spec, heads).map_err(why)?.to_vec(),
                KvStrides::vllm_cpu_planes(&spec, heads, &layers).map_err(why)?,
            )
        }
    };
    // SAFETY: every plane lies inside `mem` (each layer's tensor is
    // `planes × plane_bytes` from its start, `layer_stride` apart, all in
    // `engine_bytes`); the rest is the caller's contract.
    Ok(unsafe { KvCache::wrap_host_strided(spec, &strides, &planes) }?)
}

/// A host KV cache in a chosen layout over memory the bench allocated, and
/// that memory, freed after the cache: the decode side's cache.
pub struct OwnedKvCache {
    cache: Option<KvCache>,
    mem: Option<EngineMemory>,
}

impl OwnedKvCache {
    /// A zeroed host cache of `spec` in layout `kv` (`heads`: KV heads per
    /// plane).
    pub fn host(spec: KvCacheSpec, kv: KvLayout, heads: usize) -> anyhow::Result<OwnedKvCache> {
        let mem = EngineMemory::zeroed(engine_bytes(&spec, kv));
        // SAFETY: the memory is zeroed host memory of `engine_bytes`, freed
        // only in `drop`, after the cache.
        match unsafe { wrap_engine_memory(spec, &mem, kv, heads) } {
            Ok(cache) => Ok(OwnedKvCache {
                cache: Some(cache),
                mem: Some(mem),
            }),
            Err(e) => {
                // SAFETY: no cache was made over the memory.
                unsafe { mem.free() };
                Err(e)
            }
        }
    }

    /// A cache that owns its memory (`KvCache::host`, `KvCache::npu`).
    pub fn own(cache: KvCache) -> OwnedKvCache {
        OwnedKvCache {
            cache: Some(cache),
            mem: None,
        }
    }
}

impl std::ops::Deref for OwnedKvCache {
    type Target = KvCache;
    fn deref(&self) -> &KvCache {
        self.cache.as_ref().expect("set until drop")
    }
}

impl std::ops::DerefMut for OwnedKvCache {
    fn deref_mut(&mut self) -> &mut KvCache {
        self.cache.as_mut().expect("set until drop")
    }
}

impl Drop for OwnedKvCache {
    fn drop(&mut self) {
        drop(self.cache.take());
        if let Some(mem) = self.mem.take() {
            // SAFETY: the only cache over the memory was just dropped.
            unsafe { mem.free() };
        }
    }
}

/// Memory an engine allocated for its KV cache; the library's `KvCache`
/// wraps it. Freed only once nothing can reach it any more.
struct EngineMemory {
    ptr: *mut u64,
    words: usize,
}

impl EngineMemory {
    fn zeroed(bytes: usize) -> EngineMemory {
        // u64 words: aligned for any element type.
        let words = bytes.div_ceil(8);
        let b: Box<[u64]> = vec![0u64; words].into_boxed_slice();
        EngineMemory {
            ptr: Box::into_raw(b).cast::<u64>(),
            words,
        }
    }

    fn tensor(&self) -> KvTensor {
        KvTensor {
            addr: self.ptr as u64,
            bytes: self.words * 8,
        }
    }

    /// The cache's bytes.
    ///
    /// # Safety
    /// No worker may copy into or out of the cache meanwhile (hold
    /// [`SharedKvCache::lock`]).
    unsafe fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: the allocation is `words * 8` bytes, live until drop;
        // the caller excludes the library's workers.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.cast::<u8>(), self.words * 8) }
    }

    /// Frees the memory.
    ///
    /// # Safety
    /// Nothing may reach it any more (no cache wraps it).
    unsafe fn free(self) {
        // SAFETY: `ptr`/`words` are the boxed slice made in `zeroed`, which
        // the caller says nothing reaches any more.
        drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.ptr, self.words)) });
    }

    /// Frees the memory, unless something may still reach it.
    fn release(self, cache: Arc<SharedKvCache>) {
        if Arc::strong_count(&cache) == 1 {
            drop(cache);
            // SAFETY: the only cache wrapping the memory is gone, and with
            // it every pointer the library held.
            unsafe { self.free() };
        } else {
            log::warn!("an engine cache is still shared at the end: its memory is leaked");
        }
    }
}

/// A host cache for chunks of `layout`, over memory the engine allocated
/// (the soak's engines: the contiguous layout).
fn engine_cache(layout: &ChunkLayout) -> anyhow::Result<(EngineMemory, Arc<SharedKvCache>)> {
    engine_cache_of(layout, BLOCKS, BLOCK, KvLayout::Ascend, 1)
}

/// [`engine_cache`] of `blocks` blocks of `block` tokens in layout `kv`
/// (`heads`: KV heads per plane).
fn engine_cache_of(
    layout: &ChunkLayout,
    blocks: usize,
    block: usize,
    kv: KvLayout,
    heads: usize,
) -> anyhow::Result<(EngineMemory, Arc<SharedKvCache>)> {
    let spec = KvCacheSpec::for_layout(layout, blocks, block);
    let mem = EngineMemory::zeroed(engine_bytes(&spec, kv));
    // SAFETY: the memory is host memory of `engine_bytes` bytes or more,
    // readable and writable, freed only after the cache (`release`); the
    // engines write it only where no save reads (under the cache's lock, or
    // a layer not yet handed over to a layer-wise save).
    match unsafe { wrap_engine_memory(spec, &mem, kv, heads) } {
        Ok(cache) => Ok((mem, SharedKvCache::new(cache))),
        Err(e) => {
            // SAFETY: no cache was made over the memory.
            unsafe { mem.free() };
            Err(e)
        }
    }
}

/// A slot mapping for `tokens` tokens over randomly chosen blocks.
fn slot_mapping(rng: &mut fastrand::Rng, tokens: usize) -> Vec<i64> {
    let mut blocks: Vec<usize> = (0..BLOCKS).collect();
    rng.shuffle(&mut blocks);
    (0..tokens)
        .map(|t| (blocks[t / BLOCK] * BLOCK + t % BLOCK) as i64)
        .collect()
}

/// Chunk `i`'s bytes (`tokens` tokens of `key`'s pattern) at `slots`: the
/// byte ranges in the cache and in the chunk, one per layer, plane and run
/// of tokens that lie one after the other on both sides (a block's worth
/// where the slots of a block are consecutive).
pub fn token_runs(
    spec: &KvCacheSpec,
    tokens: usize,
    slots: &[i64],
) -> Vec<(std::ops::Range<usize>, std::ops::Range<usize>)> {
    let tb = spec.token_bytes();
    let (layers, planes) = (spec.layers, spec.planes());
    let mut runs: Vec<(std::ops::Range<usize>, std::ops::Range<usize>)> = Vec::new();
    for plane in 0..planes {
        for layer in 0..layers {
            for (t, &slot) in slots.iter().enumerate().take(tokens) {
                let at = spec.offset(layer, plane, slot as usize);
                // A chunk is [planes][layers][tokens][hidden].
                let from = ((plane * layers + layer) * tokens + t) * tb;
                match runs.last_mut() {
                    Some((a, f)) if a.end == at && f.end == from => {
                        a.end += tb;
                        f.end += tb;
                    }
                    _ => runs.push((at..at + tb, from..from + tb)),
                }
            }
        }
    }
    runs
}

/// The pattern of `key`, `tokens` tokens long.
fn chunk_bytes(layout: &ChunkLayout, key: &str, tokens: usize) -> Vec<u8> {
    let mut b = vec![0u8; layout.bytes_for(tokens)];
    pattern::fill(&mut b, key_seed(key));
    b
}

/// A failed load's reason for the table: the first key's, without the key
/// and the pull (they differ per request).
fn load_reason(why: &str) -> String {
    let first = why
        .split_once(" not loaded: ")
        .map_or(why, |(_, rest)| rest.split("; ").next().unwrap_or(rest));
    let reason = first
        .split_once("): ")
        .or_else(|| first.split_once(": "))
        .map_or(first, |(_, r)| r);
    format!("load: {}", crate::soak::short_reason(reason))
}

/// Polls `poll` until `req` completes (at most [`COMPLETION_WAIT`]).
fn completion(mut poll: impl FnMut() -> Vec<Completion>, req: &str) -> Option<Outcome> {
    let deadline = Instant::now() + COMPLETION_WAIT;
    loop {
        if let Some(c) = poll().into_iter().find(|c| c.req_id == req) {
            return Some(c.outcome);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// How push saves from `cache` write: `direct` (from the cache into the
/// receiver's pages) or `staged` (gathered into pool pages first); `None`
/// in the pull modes.
fn push_write(saves: &SaveQueue, cache: &SharedKvCache) -> Option<&'static str> {
    match saves.sender().mode() {
        ascend_pd::config::TransferMode::Push => Some(match saves.writes_direct(cache) {
            true => "direct",
            false => "staged",
        }),
        _ => None,
    }
}

/// The prefill engine: its KV cache and its save queue.
pub struct PrefillEngine {
    saves: SaveQueue,
    cache: Arc<SharedKvCache>,
    mem: EngineMemory,
    layout: ChunkLayout,
    rng: fastrand::Rng,
}

impl PrefillEngine {
    pub fn start(sender: Arc<Sender>, seed: u64) -> anyhow::Result<PrefillEngine> {
        let layout = sender.chunk_layout();
        let (mem, cache) = engine_cache(&layout)?;
        Ok(PrefillEngine {
            saves: SaveQueue::new(sender)?,
            cache,
            mem,
            layout,
            rng: fastrand::Rng::with_seed(seed),
        })
    }

    /// "Computes" request `req` (each chunk's pattern into the cache at
    /// fresh slots) and saves it through the queue; its end, or why not.
    pub fn save(
        &mut self,
        req: &str,
        keys: &[String],
        tokens: &[usize],
        spec: TransferSpec,
    ) -> Result<(), String> {
        let sender = Arc::clone(self.saves.sender());
        // The engine schedules a save once its sender has the pages (pull
        // pins wait for a receiver's Done), a few seconds at most.
        let deadline = Instant::now() + Duration::from_secs(10);
        while sender
            .stats()
            .pools
            .cpu
            .is_some_and(|p| p.free < keys.len())
            && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(5));
        }
        let total: usize = tokens.iter().sum();
        let slots = slot_mapping(&mut self.rng, total);
        {
            let _guard = self.cache.lock();
            // SAFETY: the guard keeps every worker out of the cache.
            let mem = unsafe { self.mem.bytes_mut() };
            let spec = *self.cache.spec();
            let mut first = 0;
            for (k, &t) in keys.iter().zip(tokens) {
                let chunk = chunk_bytes(&self.layout, k, t);
                for (at, from) in token_runs(&spec, t, &slots[first..first + t]) {
                    mem[at].copy_from_slice(&chunk[from]);
                }
                first += t;
            }
        }
        let save = SaveRequest {
            keys: keys.to_vec(),
            slot_mapping: slots,
            spec,
        };
        self.saves
            .submit(save, &self.cache)
            .map_err(|e| format!("save: {}", crate::soak::short_reason(&e.to_string())))?;
        let out = completion(|| self.saves.poll(), req);
        // Released saves are the engine's business; keep the list short.
        let _ = self.saves.poll_cache_released();
        match out {
            Some(Outcome::Done) => Ok(()),
            Some(Outcome::Failed(why)) => Err(format!("save: {}", crate::soak::short_reason(&why))),
            Some(Outcome::Cancelled) => Err("save: cancelled".into()),
            None => Err("save: no end within 60 s".into()),
        }
    }

    pub fn close(self) {
        self.saves.shutdown();
        drop(self.saves);
        self.mem.release(self.cache);
    }
}

/// How a request's load ended in the decode engine.
pub enum Loaded {
    /// Done, and every byte is at its slots.
    Verified,
    /// Bytes in the cache are wrong: the key (or `<stray write>`).
    Corrupted(String),
    /// The load failed (reported so); the reason.
    Failed(String),
}

/// The decode engine: its KV cache, its load queue, and the image of what
/// the cache must hold.
pub struct DecodeEngine {
    loads: LoadQueue,
    cache: Arc<SharedKvCache>,
    mem: EngineMemory,
    image: Vec<u8>,
    layout: ChunkLayout,
    rng: fastrand::Rng,
}

impl DecodeEngine {
    pub fn start(receiver: Arc<Receiver>, seed: u64) -> anyhow::Result<DecodeEngine> {
        let layout = receiver.chunk_layout();
        let (mem, cache) = engine_cache(&layout)?;
        let image = vec![0u8; cache.spec().bytes()];
        Ok(DecodeEngine {
            loads: LoadQueue::new(receiver)?,
            cache,
            mem,
            image,
            layout,
            rng: fastrand::Rng::with_seed(seed),
        })
    }

    /// Waits (up to `wait`) for every key of `req` to be available, then
    /// `stall`s (an engine busy elsewhere), loads it through the queue into
    /// the cache at fresh slots, and checks the whole cache. Every key is
    /// removed from the receiver afterwards.
    pub fn load(
        &mut self,
        req: &str,
        keys: &[String],
        tokens: &[usize],
        wait: Duration,
        stall: Duration,
    ) -> Loaded {
        let r = Arc::clone(self.loads.receiver());
        let out = self.load_inner(req, keys, tokens, wait, stall);
        for k in keys {
            r.remove(k);
        }
        out
    }

    fn load_inner(
        &mut self,
        req: &str,
        keys: &[String],
        tokens: &[usize],
        wait: Duration,
        stall: Duration,
    ) -> Loaded {
        let deadline = Instant::now() + wait;
        while self.loads.available(keys) != Availability::Ready {
            if Instant::now() >= deadline {
                return Loaded::Failed("load: a chunk never landed".into());
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        std::thread::sleep(stall);
        let total: usize = tokens.iter().sum();
        let slots = slot_mapping(&mut self.rng, total);
        let load = LoadRequest {
            req_id: req.to_string(),
            keys: keys.to_vec(),
            slot_mapping: slots.clone(),
        };
        if let Err(e) = self.loads.submit(load, &self.cache) {
            return Loaded::Failed(format!(
                "load: {}",
                crate::soak::short_reason(&e.to_string())
            ));
        }
        let out = completion(|| self.loads.poll(), req);
        let _guard = self.cache.lock();
        // SAFETY: the guard keeps every worker out of the cache.
        let mem = unsafe { self.mem.bytes_mut() };
        let spec = *self.cache.spec();
        let mut corrupted = None;
        // The request's bytes: where they must be (done), or the image put
        // back (failed: its slots may hold anything, and it said so).
        let mut first = 0;
        for (k, &t) in keys.iter().zip(tokens) {
            let chunk = chunk_bytes(&self.layout, k, t);
            for (at, from) in token_runs(&spec, t, &slots[first..first + t]) {
                if matches!(out, Some(Outcome::Done)) {
                    if mem[at.clone()] != chunk[from.clone()] && corrupted.is_none() {
                        corrupted = Some(k.clone());
                    }
                    self.image[at].copy_from_slice(&chunk[from]);
                } else {
                    mem[at.clone()].copy_from_slice(&self.image[at]);
                }
            }
            first += t;
        }
        // Nothing else changed.
        if corrupted.is_none() && mem[..self.image.len()] != self.image[..] {
            corrupted = Some(format!("<stray write> (after {req})"));
        }
        if corrupted.is_some() {
            // Checked from a known state again at the next request.
            mem[..self.image.len()].copy_from_slice(&self.image);
        }
        match (corrupted, out) {
            (Some(k), _) => Loaded::Corrupted(k),
            (None, Some(Outcome::Done)) => Loaded::Verified,
            (None, Some(Outcome::Failed(why))) => Loaded::Failed(load_reason(&why)),
            (None, Some(Outcome::Cancelled)) => Loaded::Failed("load: cancelled".into()),
            (None, None) => Loaded::Failed("load: no end within 60 s".into()),
        }
    }

    pub fn close(self) {
        self.loads.shutdown();
        drop(self.loads);
        self.mem.release(self.cache);
    }
}

/// Tokens per KV block of `ascend-bench run`'s engine caches (`--block-size`)
/// by default: vLLM-Ascend's block size.
pub const DEFAULT_BLOCK_SIZE: usize = 128;

/// The largest `--block-size`: an engine cache has a few blocks to spare,
/// so its memory grows with the block size.
pub const MAX_BLOCK_SIZE: usize = 1024;

/// `--block-size N`: tokens per KV block, 1 to [`MAX_BLOCK_SIZE`].
pub fn parse_block_size(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if (1..=MAX_BLOCK_SIZE).contains(&n) => Ok(n),
        _ => Err(format!(
            "expected tokens per KV block, 1 to {MAX_BLOCK_SIZE} (vLLM-Ascend uses \
             {DEFAULT_BLOCK_SIZE})"
        )),
    }
}

/// Spare blocks of an engine cache beyond what its requests need, so a
/// shuffled block table still varies.
const SPARE_BLOCKS: usize = 2;

/// When one request's prefill and save happened (wall seconds, see
/// [`crate::roles::wall`]).
pub struct PrefillTimes {
    /// The prefill started (layer 0's compute; a layer-wise save is opened now).
    pub start: f64,
    /// The last layer's KV is in the cache.
    pub end: f64,
    /// The save reported its end.
    pub saved: f64,
}

/// `ascend-bench run`'s prefill engine: a host KV cache it allocated, a
/// forward pass modelled layer by layer (`layer_ms` of compute as a sleep,
/// then the layer's KV — each chunk's pattern — written into the cache),
/// and the save through the request API: submitted after the last layer,
/// or (layer-wise) opened before layer 0 with each layer handed over as
/// soon as it is written.
pub struct RunPrefill {
    saves: SaveQueue,
    cache: Arc<SharedKvCache>,
    mem: EngineMemory,
    layout: ChunkLayout,
    blocks: usize,
    /// Tokens per block (`--block-size`).
    block: usize,
    rng: fastrand::Rng,
    /// The cache's layout (`--kv-layout`).
    kv: KvLayout,
    /// Thread CPU seconds spent generating and writing the KV (the bench's
    /// stand-in for the model, not the library's work).
    pub bench_cpu_s: f64,
}

impl RunPrefill {
    /// How its push saves write (see [`push_write`]).
    pub fn push_write(&self) -> Option<&'static str> {
        push_write(&self.saves, &self.cache)
    }

    /// An engine for requests of up to `max_tokens` tokens, its cache in
    /// layout `kv` (`heads`: KV heads per plane) in blocks of `block`
    /// tokens.
    pub fn start(
        sender: Arc<Sender>,
        max_tokens: usize,
        seed: u64,
        (kv, heads): (KvLayout, usize),
        block: usize,
    ) -> anyhow::Result<RunPrefill> {
        let layout = sender.chunk_layout();
        let block = block.max(1);
        let blocks = max_tokens.div_ceil(block) + SPARE_BLOCKS;
        let (mem, cache) = engine_cache_of(&layout, blocks, block, kv, heads)?;
        // Touch every page now, as an engine's cache is before serving: the
        // first request's layers would otherwise pay the page faults.
        let base = mem.ptr.cast::<u8>();
        for at in (0..mem.words * 8).step_by(4096) {
            // SAFETY: `at` is inside the allocation of `words * 8` bytes,
            // which nothing else uses yet (no save was queued).
            unsafe { std::ptr::write_volatile(base.add(at), 0) };
        }
        Ok(RunPrefill {
            saves: SaveQueue::new(sender)?,
            cache,
            mem,
            layout,
            blocks,
            block,
            rng: fastrand::Rng::with_seed(seed),
            kv,
            bench_cpu_s: 0.0,
        })
    }

    /// The cache's layout.
    pub fn kv_layout(&self) -> KvLayout {
        self.kv
    }

    /// Prefills request `req` (chunks `keys` of `tokens` tokens) layer by
    /// layer and saves it; when each step happened, and how the save ended.
    pub fn run(
        &mut self,
        req: &str,
        keys: &[String],
        tokens: &[usize],
        spec: TransferSpec,
        layer_ms: f64,
        layerwise: bool,
    ) -> (PrefillTimes, Result<(), String>) {
        // The request's KV values exist before its prefill starts (what the
        // model would compute); writing them is part of each layer.
        let cpu0 = crate::roles::thread_cpu_s();
        let chunks: Vec<Vec<u8>> = keys
            .iter()
            .zip(tokens)
            .map(|(k, &t)| chunk_bytes(&self.layout, k, t))
            .collect();
        self.bench_cpu_s += crate::roles::thread_cpu_s() - cpu0;
        let total: usize = tokens.iter().sum();
        let mut blocks: Vec<usize> = (0..self.blocks).collect();
        self.rng.shuffle(&mut blocks);
        let b = self.block;
        let slots: Vec<i64> = (0..total)
            .map(|t| (blocks[t / b] * b + t % b) as i64)
            .collect();
        let save = SaveRequest {
            keys: keys.to_vec(),
            slot_mapping: slots.clone(),
            spec,
        };
        let compute = Duration::from_secs_f64(layer_ms.max(0.0) / 1e3);
        let start = crate::roles::wall();
        let mut times = PrefillTimes {
            start,
            end: start,
            saved: start,
        };
        let short = |e: &dyn std::fmt::Display| e.to_string();
        let mut save = Some(save);
        if layerwise {
            if let Err(e) = self
                .saves
                .open_layered(save.take().expect("set"), &self.cache)
            {
                return (times, Err(format!("open_layered: {}", short(&e))));
            }
        }
        for layer in 0..self.layout.layers {
            // The device computes the layer; the host waits.
            if !compute.is_zero() {
                std::thread::sleep(compute);
            }
            let cpu0 = crate::roles::thread_cpu_s();
            let written = self.write_layer(&chunks, tokens, &slots, layer);
            self.bench_cpu_s += crate::roles::thread_cpu_s() - cpu0;
            if let Err(e) = written {
                if layerwise {
                    let _ = self.saves.close_layered(req);
                }
                return (times, Err(format!("writing layer {layer}: {}", short(&e))));
            }
            if layerwise {
                if let Err(e) = self.saves.save_layer(req, layer) {
                    let _ = self.saves.close_layered(req);
                    return (times, Err(format!("save_layer: {}", short(&e))));
                }
            }
        }
        times.end = crate::roles::wall();
        let sent = match save.take() {
            Some(save) => self.saves.submit(save, &self.cache).map_err(|e| short(&e)),
            None => match self.saves.close_layered(req) {
                Ok(None) => Ok(()),
                Ok(Some(l)) => Err(format!("layer {l} was never handed over")),
                Err(e) => Err(short(&e)),
            },
        };
        if let Err(e) = sent {
            return (times, Err(format!("save: {e}")));
        }
        let out = completion(|| self.saves.poll(), req);
        times.saved = crate::roles::wall();
        let _ = self.saves.poll_cache_released();
        let r = match out {
            Some(Outcome::Done) => Ok(()),
            Some(Outcome::Failed(why)) => Err(format!("save: {why}")),
            Some(Outcome::Cancelled) => Err("save: cancelled".into()),
            None => Err("save: no end within 60 s".into()),
        };
        (times, r)
    }

    /// Writes layer `layer` of every chunk (its K and V rows) at the
    /// request's slots: straight into the memory in the contiguous layout,
    /// through the cache (`KvCache::write`, which maps each token's bytes
    /// through the layout's strides) in the others.
    fn write_layer(
        &self,
        chunks: &[Vec<u8>],
        tokens: &[usize],
        slots: &[i64],
        layer: usize,
    ) -> Result<(), ascend_pd::kv::KvError> {
        let spec = *self.cache.spec();
        let (tb, layers, planes) = (spec.token_bytes(), spec.layers, spec.planes());
        if self.kv != KvLayout::Ascend {
            // Under the lock: no worker copies meanwhile (a layer-wise save
            // reads only layers handed over, but the lock is what lets us
            // write through the cache).
            let mut cache = self.cache.lock();
            let mut first = 0;
            for (chunk, &t) in chunks.iter().zip(tokens) {
                for (i, &slot) in slots[first..first + t].iter().enumerate() {
                    for plane in 0..planes {
                        let at = spec.offset(layer, plane, slot as usize);
                        let from = ((plane * layers + layer) * t + i) * tb;
                        cache.write(at, &chunk[from..from + tb])?;
                    }
                }
                first += t;
            }
            return Ok(());
        }
        let base = self.mem.ptr.cast::<u8>();
        let len = self.mem.words * 8;
        let mut first = 0;
        for (chunk, &t) in chunks.iter().zip(tokens) {
            for (i, &slot) in slots[first..first + t].iter().enumerate() {
                for plane in 0..planes {
                    let at = spec.offset(layer, plane, slot as usize);
                    // A chunk is [planes][layers][tokens][hidden].
                    let from = ((plane * layers + layer) * t + i) * tb;
                    assert!(at + tb <= len && from + tb <= chunk.len());
                    // SAFETY: `at..at + tb` lies in the engine's allocation
                    // (checked above) and `chunk` is a separate Vec. No save
                    // reads these bytes now: a layer-wise save reads only
                    // layers already handed over (this one is not yet), and
                    // a whole-request save is submitted after the last layer
                    // (the one before ended: `run` waits for it). Raw copies,
                    // no reference to the whole cache, so the library's
                    // reads of other layers meanwhile alias nothing.
                    unsafe {
                        std::ptr::copy_nonoverlapping(chunk.as_ptr().add(from), base.add(at), tb);
                    }
                }
            }
            first += t;
        }
        Ok(())
    }

    /// Stops the save queue and frees the cache.
    pub fn close(self) {
        self.saves.shutdown();
        drop(self.saves);
        self.mem.release(self.cache);
    }
}

/// A save [`OpenPrefill`] submitted: when, and the blocks it holds until
/// the library reports the cache released.
struct OpenSave {
    submitted: f64,
    blocks: Vec<usize>,
    gathered: Option<f64>,
}

/// A request [`OpenPrefill`] is writing into its cache.
struct Pending {
    req: String,
    keys: Vec<String>,
    tokens: Vec<usize>,
    spec: TransferSpec,
    slots: Vec<i64>,
    blocks: Vec<usize>,
    /// The next chunk to write, and its first token.
    next: usize,
    first: usize,
}

/// How one open-loop save ended.
pub struct OpenSaved {
    pub req: String,
    /// Submitted (wall seconds).
    pub submitted: f64,
    /// `SaveQueue::poll_cache_released` reported it (its gather is over).
    pub gathered: f64,
    /// `SaveQueue::poll` reported its end.
    pub ended: f64,
    pub result: Result<(), String>,
}

/// `ascend-bench run`'s open-loop prefill engine: a host KV cache with
/// room for several requests at once, each written at blocks taken from a
/// free list and saved with `SaveQueue::submit`; a request's blocks go
/// back to the list when `SaveQueue::poll_cache_released` reports its save
/// (or it ended), as an engine reuses KV blocks.
pub struct OpenPrefill {
    saves: SaveQueue,
    cache: Arc<SharedKvCache>,
    mem: EngineMemory,
    free: Vec<usize>,
    /// Tokens per block (`--block-size`).
    block: usize,
    open: std::collections::HashMap<String, OpenSave>,
    pending: Option<Pending>,
    rng: fastrand::Rng,
    /// `--verify sample`: the receivers check only some requests whole.
    sample: bool,
    /// The cache's layout (`--kv-layout`).
    kv: KvLayout,
    /// Thread CPU seconds spent generating and writing the KV (the bench's
    /// stand-in for the model, not the library's work).
    pub bench_cpu_s: f64,
}

impl OpenPrefill {
    /// How its push saves write (see [`push_write`]).
    pub fn push_write(&self) -> Option<&'static str> {
        push_write(&self.saves, &self.cache)
    }

    /// An engine for `in_flight` requests of up to `max_tokens` tokens;
    /// `sample`: the receivers check every byte of only some requests
    /// ([`crate::roles::checked_whole`]); its cache in layout `kv`
    /// (`heads`: KV heads per plane) in blocks of `block` tokens.
    pub fn start(
        sender: Arc<Sender>,
        max_tokens: usize,
        in_flight: usize,
        seed: u64,
        sample: bool,
        (kv, heads): (KvLayout, usize),
        block: usize,
    ) -> anyhow::Result<OpenPrefill> {
        let layout = sender.chunk_layout();
        let block = block.max(1);
        let blocks = max_tokens.div_ceil(block) * in_flight.max(1) + SPARE_BLOCKS;
        let (mem, cache) = engine_cache_of(&layout, blocks, block, kv, heads)?;
        let base = mem.ptr.cast::<u8>();
        for at in (0..mem.words * 8).step_by(4096) {
            // SAFETY: `at` is inside the allocation of `words * 8` bytes,
            // which nothing else uses yet (no save was queued).
            unsafe { std::ptr::write_volatile(base.add(at), 0) };
        }
        Ok(OpenPrefill {
            saves: SaveQueue::new(sender)?,
            cache,
            mem,
            free: (0..blocks).collect(),
            block,
            open: Default::default(),
            pending: None,
            rng: fastrand::Rng::with_seed(seed),
            sample,
            kv,
            bench_cpu_s: 0.0,
        })
    }

    /// The cache's layout.
    pub fn kv_layout(&self) -> KvLayout {
        self.kv
    }

    /// Saves submitted whose end was not polled yet.
    pub fn in_flight(&self) -> usize {
        self.open.len() + usize::from(self.pending.is_some())
    }

    /// Saves submitted that still read the cache (their gather is not over).
    pub fn gathering(&self) -> usize {
        self.open.values().filter(|s| s.gathered.is_none()).count()
    }

    /// Whether the cache has free blocks for a request of `tokens` tokens
    /// and no request is being written.
    pub fn has_room(&self, tokens: usize) -> bool {
        self.pending.is_none() && self.free.len() >= tokens.div_ceil(self.block)
    }

    /// Whether a request's KV is being written (see [`OpenPrefill::step`]).
    pub fn writing(&self) -> bool {
        self.pending.is_some()
    }

    /// Starts request `req`: takes free blocks for its chunks (`keys`,
    /// `tokens` tokens each), whose KV (each key's pattern)
    /// [`OpenPrefill::step`] writes into the cache one chunk at a time
    /// before submitting the save.
    pub fn begin(
        &mut self,
        req: &str,
        keys: Vec<String>,
        tokens: &[usize],
        spec: TransferSpec,
    ) -> Result<(), String> {
        let total: usize = tokens.iter().sum();
        let b = self.block;
        let need = total.div_ceil(b);
        if self.free.len() < need || self.pending.is_some() {
            return Err(format!("{req}: no free KV blocks"));
        }
        self.rng.shuffle(&mut self.free);
        let blocks: Vec<usize> = self.free.drain(..need).collect();
        let slots: Vec<i64> = (0..total)
            .map(|t| (blocks[t / b] * b + t % b) as i64)
            .collect();
        self.pending = Some(Pending {
            req: req.to_string(),
            keys,
            tokens: tokens.to_vec(),
            spec,
            slots,
            blocks,
            next: 0,
            first: 0,
        });
        Ok(())
    }

    /// Writes the next chunk of the request begun; after its last, submits
    /// the save. `Some` when the request left the writer: its save was
    /// submitted (`Ok`), or refused.
    pub fn step(&mut self) -> Option<Result<String, (String, String)>> {
        let p = self.pending.as_mut()?;
        if p.next < p.keys.len() {
            let cpu0 = crate::roles::thread_cpu_s();
            // Other saves may be gathering: write under the cache's lock,
            // a chunk at a time so they interleave.
            let mut guard = self.cache.lock();
            let spec = *self.cache.spec();
            let t = p.tokens[p.next];
            let seed = key_seed(&p.keys[p.next]);
            let len = t * spec.token_bytes() * spec.layers * spec.planes();
            let whole = crate::roles::checked_whole(&p.req, self.sample);
            // The chunk's pattern, made where the model would write it: all
            // of it, or (a request the receivers check only in part) the
            // bytes they check, its first and last — in either layout.
            let runs = token_runs(&spec, t, &p.slots[p.first..p.first + t]);
            let runs = runs.into_iter().filter_map(|(at, from)| match whole {
                true => Some((at, from)),
                false if from.start == 0 => Some((at.start..at.start + 1, 0..1)),
                false if from.end == len => Some((at.end - 1..at.end, len - 1..len)),
                false => None,
            });
            let mut failed = None;
            if self.kv == KvLayout::Ascend {
                // SAFETY: the guard keeps every worker out of the cache.
                let mem = unsafe { self.mem.bytes_mut() };
                for (at, from) in runs {
                    pattern::fill_at(&mut mem[at], seed, from.start);
                }
            } else {
                // `at` is an offset of the logical (contiguous) layout:
                // the pattern made in a scratch buffer and written through
                // the cache, which maps it through the layout's strides.
                let mut buf = Vec::new();
                for (at, from) in runs {
                    buf.resize(at.len(), 0);
                    pattern::fill_at(&mut buf, seed, from.start);
                    if let Err(e) = guard.write(at.start, &buf) {
                        failed = Some(format!("writing the KV: {e}"));
                        break;
                    }
                }
            }
            p.first += t;
            p.next += 1;
            drop(guard);
            if let Some(why) = failed {
                let p = self.pending.take()?;
                self.free.extend(p.blocks);
                return Some(Err((p.req, why)));
            }
            self.bench_cpu_s += crate::roles::thread_cpu_s() - cpu0;
            return None;
        }
        let p = self.pending.take()?;
        let save = SaveRequest {
            keys: p.keys,
            slot_mapping: p.slots,
            spec: p.spec,
        };
        let submitted = crate::roles::wall();
        if let Err(e) = self.saves.submit(save, &self.cache) {
            self.free.extend(p.blocks);
            return Some(Err((p.req, format!("save: {e}"))));
        }
        self.open.insert(
            p.req.clone(),
            OpenSave {
                submitted,
                blocks: p.blocks,
                gathered: None,
            },
        );
        Some(Ok(p.req))
    }

    /// Takes the library's news: saves whose gather is over give their
    /// blocks back; the saves that ended are returned.
    pub fn poll(&mut self) -> Vec<OpenSaved> {
        let now = crate::roles::wall();
        for id in self.saves.poll_cache_released() {
            if let Some(s) = self.open.get_mut(&id) {
                s.gathered = Some(now);
                self.free.append(&mut s.blocks);
            }
        }
        let mut out = Vec::new();
        for c in self.saves.poll() {
            let Some(mut s) = self.open.remove(&c.req_id) else {
                continue;
            };
            // An ended save no longer reads the cache either.
            self.free.append(&mut s.blocks);
            out.push(OpenSaved {
                req: c.req_id,
                submitted: s.submitted,
                gathered: s.gathered.unwrap_or(now),
                ended: now,
                result: match c.outcome {
                    Outcome::Done => Ok(()),
                    Outcome::Failed(why) => Err(format!("save: {why}")),
                    Outcome::Cancelled => Err("save: cancelled".into()),
                },
            });
        }
        out
    }

    /// Stops the save queue and frees the cache.
    pub fn close(self) {
        self.saves.shutdown();
        drop(self.saves);
        self.mem.release(self.cache);
    }
}
