//! The receiver's load: pull-delay proxies read through a ping-pong
//! pipeline that overlaps reading chunk N+1 from a sender with scattering
//! chunk N into the paged KV cache, and resident chunks scattered from
//! their pages.
//!
//! - [`ProxyMemoryObj`] (the protocol's [`ProxyEntry`]): a pull-delay key
//!   held by the receiver without any local page — the sender's
//!   [`BufferRef`](crate::memory::BufferRef), the chunk's meta, the sender,
//!   its pull's slot and the lease. Looking one up or pinning it for a read
//!   never consumes it; only the end of a read after its data was
//!   scattered does.
//! - [`TransferContext`]: one pull's proxies; it yields the pull's single
//!   `PullDoneSignal` once every proxy is consumed or discarded.
//! - the ping-pong pipeline (`pingpong`): two pools of `depth` pages;
//!   micro-batch `i` is read into pool `i % 2` while micro-batch `i - 1` is
//!   scattered, and a pool's pages are read into again only once its
//!   scatter gave them back;
//! - the load (`load`): grouping per sender, a pipeline per group,
//!   draining, Done — behind the receiver's `load`.

pub(crate) mod cost;
pub(crate) mod load;
pub(crate) mod pingpong;
pub(crate) mod scatter;

pub use crate::protocol::{ProxyEntry, TransferContext};

use crate::kv::KvError;
use std::fmt;
use std::time::Duration;

/// A pull-delay proxy: the receiver's handle on a chunk that still lives in
/// a sender's pool (LMCache-Ascend's `ProxyMemoryObj`). See [`ProxyEntry`].
pub type ProxyMemoryObj = ProxyEntry;

/// Default upper bound on the pages per ping-pong pool.
pub const DEFAULT_MAX_DEPTH: usize = 8;

/// How a load runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoadOptions {
    /// Upper bound on the pages per pool; the depth used is also bounded by
    /// the pages free when the load starts and by the request (at least 1).
    pub max_depth: usize,
    /// The request being loaded, if known (the request API sets it): a
    /// proxy it reads that another request also holds (a shared prefix)
    /// is kept instead of consumed. Release the request's holds with
    /// `Receiver::release` after the load (the request API does).
    pub req_id: Option<String>,
    /// Keys per chunk of the request (default 1). Under heterogeneous TP a
    /// decode rank fed by several prefill ranks loads one head piece from
    /// each: pass the pieces of chunk 0, then those of chunk 1, and so on
    /// (`keys[i]` covers chunk `i / pieces_per_chunk`). Together the
    /// pieces of a chunk must cover the cache's token exactly once.
    pub pieces_per_chunk: usize,
    /// Read pull-delay proxies straight into the KV cache where the
    /// channel can address it (default true; `shm` into a host cache),
    /// instead of through ping-pong staging pages. A cache whose layout
    /// cuts tokens into runs under 1 KiB (vLLM's CPU backend: one per
    /// element of K) is staged regardless: one transfer operation per
    /// small run costs more than the staging copy.
    pub direct: bool,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            max_depth: DEFAULT_MAX_DEPTH,
            req_id: None,
            pieces_per_chunk: 1,
            direct: true,
        }
    }
}

/// What a load did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LoadReport {
    /// Keys whose data is now in the KV cache, in request order.
    pub loaded: Vec<String>,
    /// Of those, resident chunks (push / pull-eager) scattered from their pages.
    pub resident: usize,
    /// Of those, pull-delay proxies read and scattered (now consumed).
    pub proxies: usize,
    /// Senders whose proxies were loaded (one pipeline run each).
    pub senders: usize,
    /// Pages per pool (0 when there was no proxy; the largest over senders).
    pub depth: usize,
    /// Pools used (2, or 1 when the request fits one batch or pages were short).
    pub pools: usize,
    /// Micro-batches run over all senders.
    pub micro_batches: usize,
    /// Bytes of pages a pipeline held at once: `pools × depth × page size`,
    /// independent of the request length (senders are loaded one after another).
    pub peak_buffer_bytes: usize,
    /// Bytes read from senders.
    pub bytes_read: u64,
    /// Bytes scattered into the KV cache.
    pub bytes_scattered: u64,
    /// Copies issued into the KV cache (after coalescing slot runs).
    pub copies: u64,
    /// PullDoneSignals this load sent (pulls it completed).
    pub dones_sent: usize,
    /// Of the proxies, those read straight into the KV cache (a direct
    /// load: no staging page); the others went through the ping-pong pages.
    pub direct: usize,
    /// Why the proxies took the path they did, when a modeled link chose
    /// it (`pd_npu_link` under hccl): both paths' modeled link time.
    pub path_reason: Option<String>,
    /// Wall time of the load.
    pub elapsed: Duration,
}

impl LoadReport {
    /// How the load's proxies reached the cache: `"direct"` (read straight
    /// into it), `"staged"` (through ping-pong pages; also when some were
    /// direct and some not), or `"resident"` (no proxies: push / pull-eager
    /// data scattered from its own pages).
    pub fn load_path(&self) -> &'static str {
        match (self.proxies, self.direct) {
            (0, _) => "resident",
            (p, d) if p == d => "direct",
            _ => "staged",
        }
    }
}

/// A key that was not loaded, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyFailure {
    /// The key.
    pub key: String,
    /// Its pull (request), for proxies.
    pub pull_id: Option<String>,
    /// Its sender, for proxies.
    pub sender_id: Option<String>,
    /// What went wrong.
    pub reason: String,
}

impl fmt::Display for KeyFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.key)?;
        if let Some(p) = &self.pull_id {
            write!(f, " (pull {p}")?;
            if let Some(s) = &self.sender_id {
                write!(f, " from {s}")?;
            }
            f.write_str(")")?;
        }
        write!(f, ": {}", self.reason)
    }
}

/// Why a load did not load everything.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LoadError {
    /// The slot mapping does not cover a key's tokens. Nothing was touched.
    #[error("the slot mapping has {len} entries but key {key} (chunk {index}) covers tokens [{start}, {end}); pass one slot per token of the request, chunk i starting at token i × chunk_size")]
    SlotMappingTooShort {
        /// The key.
        key: String,
        /// Its position in the request.
        index: usize,
        /// Its first token.
        start: usize,
        /// One past its last token.
        end: usize,
        /// Entries in the slot mapping.
        len: usize,
    },
    /// The slot mapping's length does not match the tokens stored under
    /// the keys: a chunk before the last is not full, or the last does not
    /// cover exactly the slots after the others. Loading anyway would
    /// report success with slots left unwritten. Nothing was touched.
    #[error("key {key} (chunk {index}) holds {stored} token(s) but the slot mapping gives it {expected}: {detail}; the keys must be those the prefill saved for exactly this request's tokens (every chunk but the last holds chunk_size tokens, the last the rest), with one slot per token")]
    SlotMappingMismatch {
        /// The key.
        key: String,
        /// Its position in the request.
        index: usize,
        /// Tokens stored under it.
        stored: usize,
        /// Tokens the slot mapping gives its chunk.
        expected: usize,
        /// Which rule was broken.
        detail: &'static str,
    },
    /// The KV cache cannot take these chunks (geometry, slots). Nothing was touched.
    #[error(transparent)]
    Kv(#[from] KvError),
    /// The head pieces given for a chunk do not make up a whole token of
    /// the cache (heterogeneous TP). Nothing was touched.
    #[error("chunk {chunk}: {detail}; under heterogeneous TP pass every source rank's piece of each chunk, in chunk order, with LoadOptions::pieces_per_chunk set to their number")]
    Pieces {
        /// The chunk (position in the request).
        chunk: usize,
        /// What is wrong.
        detail: String,
    },
    /// Some keys could not be loaded; the others were (see `report`). Failed
    /// proxies were discarded, so their pulls' Done still goes out; no page
    /// is held.
    #[error("{} of {} key(s) not loaded: {}", failed.len(), failed.len() + report.loaded.len(), failed.iter().map(|f| f.to_string()).collect::<Vec<_>>().join("; "))]
    Incomplete {
        /// Each key that was not loaded.
        failed: Vec<KeyFailure>,
        /// What was loaded.
        report: Box<LoadReport>,
    },
}
