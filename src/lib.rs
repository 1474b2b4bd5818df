//! ascend-pd: KV-cache transfer between prefill (sender) and decode
//! (receiver) workers for disaggregated LLM serving on Ascend NPUs.
//!
//! The surface a worker uses is re-exported here: [`Sender`] and
//! [`Receiver`] (started from a [`PdConfig`]), the pages a sender fills
//! ([`MemObj`], sealed into [`SealedMemObj`] to send), the decode side's
//! [`KvCache`] and [`LoadOptions`], and the errors. Everything else is in
//! the modules, from the bottom up: [`layout`] (what a chunk looks like,
//! and which KV heads each TP rank holds)
//! and the msgpack `wire` reader/writer; [`config`] (LMCache-style YAML)
//! and [`memory`] (pools, pages and who may touch them); [`channel`]
//! (one-sided transfers, grants) and [`protocol`] (the side-channel
//! messages, the pull lease, and the sans-IO sender/receiver cores that
//! decide what to send and which pages to grant or release); [`kv`] (the
//! paged KV cache) and [`pipeline`] (the receiver's load) above; [`backend`]
//! (sockets and threads) on top.
//!
//! Nothing here has run on Ascend hardware: the NPU and HCCL paths are
//! tested against the CANN emulator of `ascend-sys`.

#![warn(missing_docs)]

pub mod auth;
pub mod backend;
pub mod channel;
pub mod config;
pub mod ffi;
pub mod kv;
pub mod layout;
pub mod memory;
pub mod pipeline;
pub mod protocol;
pub mod requests;
pub(crate) mod threads;
pub(crate) mod wire;

pub use backend::{
    BackendError, FetchError, PutOutcome, Receiver, ReceiverStats, Sender, SenderStats,
    SenderTimeouts, TransferSpec,
};
pub use channel::ChannelError;
pub use config::{ConfigError, PdConfig};
pub use kv::{KvCache, KvCacheSpec, KvError, KvTensor};
pub use memory::{MemObj, MemoryError, SealedMemObj};
pub use pipeline::{KeyFailure, LoadError, LoadOptions, LoadReport};
