//! Memory: registered pools, the paged allocator, and chunk objects.
//!
//! A pool is a [`RegisteredBuffer`] (CPU or NPU memory with a UUID) cut into
//! pages of one full chunk. [`PagePool`] hands pages out as [`MemObj`]s
//! (one owner, writable), which can be sealed into [`SealedMemObj`]s
//! (shared, read-only) or lent to a peer as [`LentPage`]s (no local access);
//! see [`pool`] for who may touch a page's bytes when. A page returns to its
//! pool when its last handle drops, so no path (success, error, timeout,
//! unwinding) can leak one, and never while a peer or a transfer may still
//! write it (such pages are counted as quarantined). [`DualAllocator`]
//! holds a worker's CPU and NPU pools and picks one by role. [`npu`] is the
//! CANN (ACL) runtime behind NPU pools and pinned CPU pools. [`copy_pool`]
//! runs large host copies on a few threads.

pub mod buffer;
pub mod copy_pool;
mod direct;
pub mod dual;
pub mod host;
pub mod npu;
pub mod pattern;
pub mod pool;

pub use crate::layout::{ChunkLayout, Dtype, MemFormat, UnknownDtype};
pub use buffer::{
    BufferRef, DeviceKind, DeviceMemory, NpuRuntime, PinnedHostMemory, RegisteredBuffer,
};
pub use copy_pool::{copy_pool_stats, CopyPoolStats};
pub use direct::DirectRegistration;
pub use dual::{CpuBacking, DualAllocator, DualSpec, DualStats, PoolKind};
pub use host::HostRegion;
pub(crate) use pool::PageWatch;
pub use pool::{ChunkMeta, LentPage, MemObj, Page, PagePool, PoolStats, SealedMemObj};

/// Why memory could not be had.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MemoryError {
    /// Not enough free pages right now.
    #[error("{pool}: {requested} page(s) requested, {free} of {total} free")]
    Exhausted {
        /// Which pool.
        pool: String,
        /// Pages asked for.
        requested: usize,
        /// Pages free at the time.
        free: usize,
        /// Pages in the pool.
        total: usize,
    },
    /// Admission refused the request at once instead of admitting it in
    /// part (its whole budget did not fit the pages nobody reserved).
    #[error("not admitted: {0}")]
    NotAdmitted(String),
    /// Pages did not come free before the deadline.
    #[error(
        "{pool}: timed out waiting for {requested} free page(s) ({free} free at the deadline)"
    )]
    Timeout {
        /// Which pool.
        pool: String,
        /// Pages asked for.
        requested: usize,
        /// Pages free at the deadline.
        free: usize,
    },
    /// A chunk larger than a page (or with no tokens) was asked for.
    #[error("a chunk of {tokens} token(s) / {bytes} bytes does not fit a {page_size}-byte page")]
    ChunkDoesNotFit {
        /// Bytes of the chunk.
        bytes: usize,
        /// Its tokens.
        tokens: usize,
        /// The pool's page size.
        page_size: usize,
    },
    /// Host memory could not be mapped.
    #[error("cannot map {bytes} bytes of host memory: {source}")]
    HostAlloc {
        /// Size asked for.
        bytes: usize,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// An NPU pool was asked for but there is no NPU runtime.
    #[error("{0}; install CANN or point ASCEND_PD_CANN_LIB_DIR at its lib64 (or at the emulator), or set pd_buffer_device: cpu")]
    NoNpuRuntime(String),
    /// The NPU runtime failed.
    #[error("NPU memory: {0}")]
    Device(String),
    /// Page size or pool size make no sense.
    #[error("invalid pool geometry: {0}")]
    InvalidGeometry(String),
}
