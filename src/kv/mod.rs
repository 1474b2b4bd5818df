//! The paged KV cache a decode worker attends over, and the copies between
//! it and transfer chunks.
//!
//! [`KvCache`] is vLLM-style: per layer, K and V (MLA: one latent plane),
//! each `num_blocks × block_size × hidden`, laid out as
//! `[layers][planes][num_blocks * block_size][hidden]` in one allocation on
//! the worker's device (an NPU through ascend-sys — tested against the CANN
//! emulator only — or host memory for the `cpu` device).
//!
//! A *slot mapping* names, per token of a request, its slot
//! `block * block_size + offset` (vLLM's convention; a negative slot is
//! padding and is skipped). Chunk `i` of a request covers tokens
//! `[i * chunk_tokens, i * chunk_tokens + tokens_i)`.
//!
//! - [`KvCache::scatter`]: chunk (`KV_2LTD` / MLA layout, in a pool page) →
//!   the slots. Consecutive slots are coalesced into one copy per
//!   `(layer, plane)` ([`plan`]); on an NPU the copies are asynchronous
//!   device-to-device (or host-to-device) copies on the cache's load
//!   stream, finished by a [`KvFence`]; on the host they are memcpys.
//! - [`KvCache::gather`]: the reverse, for the sender side (an NPU cache
//!   into a CPU page is the device-to-host copy of CPU offload).
//!
//! An engine's own cache may be laid out otherwise: [`KvStrides`] describe
//! a plane layout by byte strides, one per plane of a layer (vLLM's CPU
//! backend keeps K transposed and V token-major in one tensor per layer),
//! and [`KvCache::wrap_host_strided`] wraps one plane base per
//! `(layer, plane)`. The logical layout that [`KvCacheSpec::offset`],
//! [`KvCache::read`] and [`KvCache::write`] speak stays
//! `[layers][planes][slots][hidden]` whatever the memory's.

mod cache;
pub mod plan;
mod strides;
/// The heads each TP rank holds (see [`crate::layout::tp`]).
pub use crate::layout::tp;

pub(crate) use cache::Unsettled;
pub use cache::{DirectRun, KvCache, KvFence, KvTensor, ScatterStats};
pub use strides::KvStrides;

use crate::memory::{ChunkLayout, DeviceKind, Dtype, MemFormat};

/// The shape of a paged KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KvCacheSpec {
    /// `KV_2LTD` (K and V planes) or MLA (one latent plane).
    pub fmt: MemFormat,
    /// Transformer layers.
    pub layers: usize,
    /// Blocks per plane.
    pub num_blocks: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Elements per token per plane (kv heads × head size, or the MLA latent size).
    pub hidden: usize,
    /// Element type.
    pub dtype: Dtype,
}

impl KvCacheSpec {
    /// A cache for chunks of `layout` with `num_blocks` blocks of `block_size` tokens.
    pub fn for_layout(layout: &ChunkLayout, num_blocks: usize, block_size: usize) -> KvCacheSpec {
        KvCacheSpec {
            fmt: layout.fmt,
            layers: layout.layers,
            num_blocks,
            block_size,
            hidden: layout.hidden,
            dtype: layout.dtype,
        }
    }

    /// Planes per layer (2 for `KV_2LTD`, 1 for MLA).
    pub fn planes(&self) -> usize {
        self.fmt.kv_planes()
    }

    /// Slots per plane (`num_blocks * block_size`).
    pub fn slots(&self) -> usize {
        self.num_blocks * self.block_size
    }

    /// Bytes of one token in one plane.
    pub fn token_bytes(&self) -> usize {
        self.hidden * self.dtype.size()
    }

    /// Bytes of one plane of one layer.
    pub fn plane_bytes(&self) -> usize {
        self.slots() * self.token_bytes()
    }

    /// Bytes of the whole cache.
    pub fn bytes(&self) -> usize {
        self.layers * self.planes() * self.plane_bytes()
    }

    /// Byte offset of `slot` in `(layer, plane)`.
    pub fn offset(&self, layer: usize, plane: usize, slot: usize) -> usize {
        ((layer * self.planes() + plane) * self.slots() + slot) * self.token_bytes()
    }

    /// Checks that chunks of `layout` can be scattered into this cache.
    pub fn check_layout(&self, layout: &ChunkLayout) -> Result<(), KvError> {
        if layout.fmt != self.fmt
            || layout.layers != self.layers
            || layout.hidden != self.hidden
            || layout.dtype != self.dtype
        {
            return Err(self.mismatch(layout, ""));
        }
        Ok(())
    }

    /// The error for a chunk of `layout` (placed as `at` says) this cache
    /// cannot take.
    fn mismatch(&self, layout: &ChunkLayout, at: &str) -> KvError {
        let geometry = |fmt: MemFormat, layers: usize, hidden: usize, dtype: Dtype, at: &str| {
            format!(
                "fmt {}, {layers} layers, hidden {hidden}{at}, {dtype}",
                fmt.code()
            )
        };
        KvError::LayoutMismatch {
            cache: geometry(self.fmt, self.layers, self.hidden, self.dtype, ""),
            chunk: geometry(layout.fmt, layout.layers, layout.hidden, layout.dtype, at),
        }
    }

    /// Checks that a chunk of `layout` whose elements start at element
    /// `offset` of each token (a head piece; 0 for a whole chunk) fits this
    /// cache.
    pub fn check_piece(&self, layout: &ChunkLayout, offset: usize) -> Result<(), KvError> {
        if offset == 0 && layout.hidden == self.hidden {
            return self.check_layout(layout);
        }
        let fits = offset
            .checked_add(layout.hidden)
            .is_some_and(|end| end <= self.hidden);
        if layout.fmt != self.fmt
            || layout.layers != self.layers
            || layout.dtype != self.dtype
            || !fits
        {
            return Err(self.mismatch(layout, &format!(" at element {offset}")));
        }
        Ok(())
    }

    fn validate(&self) -> Result<(), KvError> {
        let dims = [self.layers, self.num_blocks, self.block_size, self.hidden];
        if dims.contains(&0) {
            return Err(KvError::InvalidSpec(format!(
                "{self:?} has a zero dimension"
            )));
        }
        dims.iter()
            .try_fold(self.planes() * self.dtype.size(), |a, &d| a.checked_mul(d))
            .ok_or_else(|| KvError::InvalidSpec(format!("{self:?} overflows a byte count")))?;
        Ok(())
    }
}

/// Why a KV cache operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KvError {
    /// The cache spec makes no sense.
    #[error("invalid KV cache spec: {0}")]
    InvalidSpec(String),
    /// A slot lies outside the cache.
    #[error("token {token} maps to slot {slot}, but the cache has {slots} slots (num_blocks × block_size); check the slot mapping against the block table")]
    SlotOutOfRange {
        /// Token index in the chunk.
        token: usize,
        /// The slot.
        slot: i64,
        /// Slots in the cache.
        slots: usize,
    },
    /// A chunk's token count and its slots disagree.
    #[error("{slots} slot(s) for {tokens} token(s): pass exactly one slot per token of the chunk")]
    SlotCount {
        /// Tokens in the chunk.
        tokens: usize,
        /// Slots given.
        slots: usize,
    },
    /// The chunk does not have the cache's geometry.
    #[error("chunk ({chunk}) does not match the KV cache ({cache}); build the cache with KvCacheSpec::for_layout of the chunks' layout")]
    LayoutMismatch {
        /// The cache's geometry.
        cache: String,
        /// The chunk's geometry.
        chunk: String,
    },
    /// A chunk claims more tokens than its page holds.
    #[error("a chunk of {tokens} token(s) does not fit its {page_tokens}-token page")]
    TooManyTokens {
        /// Tokens asked for.
        tokens: usize,
        /// Tokens of a full chunk.
        page_tokens: usize,
    },
    /// This combination of cache and page memory cannot be copied.
    #[error("cannot copy between a KV cache on {cache} and a page on {page}: {hint}")]
    Unsupported {
        /// The cache's device.
        cache: DeviceKind,
        /// The page's device.
        page: DeviceKind,
        /// What to do instead.
        hint: &'static str,
    },
    /// The NPU runtime failed (allocation, copy, event).
    #[error("KV cache on the NPU: {context}: {source}")]
    Device {
        /// What was being done.
        context: String,
        /// The runtime's error.
        #[source]
        source: ascend_sys::Error,
    },
    /// Copying a page through the memory layer failed.
    #[error("KV cache copy: {0}")]
    Memory(#[from] crate::memory::MemoryError),
    /// The strides describe no valid plane layout.
    #[error("invalid KV cache strides: {0}")]
    InvalidStrides(String),
    /// Two planes' memory overlaps and the strides do not keep their
    /// elements apart.
    #[error("KV cache planes {first} and {second} overlap: {detail}")]
    PlanesOverlap {
        /// The first plane (index, layer and kind).
        first: String,
        /// The second plane.
        second: String,
        /// Where, and what to do.
        detail: String,
    },
    /// The layout is not supported on the cache's device.
    #[error("a KV cache on {device} cannot use this layout: {reason}")]
    DeviceLayout {
        /// The cache's device.
        device: DeviceKind,
        /// Why, and what to do instead.
        reason: String,
    },
    /// A byte range outside the cache was asked for.
    #[error("{len} bytes at offset {offset} exceed the {size}-byte KV cache")]
    OutOfBounds {
        /// Offset asked for.
        offset: usize,
        /// Length asked for.
        len: usize,
        /// The cache's size.
        size: usize,
    },
}
