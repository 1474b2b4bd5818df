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
use ascend_pd::kv::{KvCache, KvCacheSpec, KvTensor};
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

    /// Frees the memory, unless something may still reach it.
    fn release(self, cache: Arc<SharedKvCache>) {
        if Arc::strong_count(&cache) == 1 {
            drop(cache);
            // SAFETY: the only cache wrapping the memory is gone, and with
            // it every pointer the library held; `ptr`/`words` are the
            // boxed slice made in `zeroed`.
            drop(unsafe {
                Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.ptr, self.words))
            });
        } else {
            log::warn!("an engine cache is still shared at the end: its memory is leaked");
        }
    }
}

/// A host cache for chunks of `layout`, over memory the engine allocated.
fn engine_cache(layout: &ChunkLayout) -> anyhow::Result<(EngineMemory, Arc<SharedKvCache>)> {
    let spec = KvCacheSpec::for_layout(layout, BLOCKS, BLOCK);
    let mem = EngineMemory::zeroed(spec.bytes());
    // SAFETY: the memory is host memory of `spec.bytes()` bytes or more,
    // readable and writable, freed only after the cache (`release`); the
    // soak writes it only under the cache's lock, between requests.
    let cache = unsafe { KvCache::wrap_host(spec, &[mem.tensor()]) }?;
    Ok((mem, SharedKvCache::new(cache)))
}

/// A slot mapping for `tokens` tokens over randomly chosen blocks.
fn slot_mapping(rng: &mut fastrand::Rng, tokens: usize) -> Vec<i64> {
    let mut blocks: Vec<usize> = (0..BLOCKS).collect();
    rng.shuffle(&mut blocks);
    (0..tokens)
        .map(|t| (blocks[t / BLOCK] * BLOCK + t % BLOCK) as i64)
        .collect()
}

/// Chunk `i`'s bytes (`tokens` tokens of `key`'s pattern) at `slots`: for
/// each token, layer and plane, the byte range in the cache and in the chunk.
fn token_runs<'a>(
    spec: &'a KvCacheSpec,
    tokens: usize,
    slots: &'a [i64],
) -> impl Iterator<Item = (std::ops::Range<usize>, std::ops::Range<usize>)> + 'a {
    let tb = spec.token_bytes();
    let (layers, planes) = (spec.layers, spec.planes());
    (0..tokens).flat_map(move |t| {
        (0..planes).flat_map(move |plane| {
            (0..layers).map(move |layer| {
                let at = spec.offset(layer, plane, slots[t] as usize);
                // A chunk is [planes][layers][tokens][hidden].
                let from = ((plane * layers + layer) * tokens + t) * tb;
                (at..at + tb, from..from + tb)
            })
        })
    })
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
