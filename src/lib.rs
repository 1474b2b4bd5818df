//! ascend-pd: KV-cache transfer between prefill (sender) and decode
//! (receiver) workers for disaggregated LLM serving on Ascend NPUs.
//!
//! Layout: [`layout`] (what a chunk looks like) and the msgpack `wire`
//! reader/writer at the bottom; [`config`] (LMCache-style YAML) and
//! [`memory`] (pools, paged allocator, chunk objects) on them; [`channel`]
//! (one-sided transfers) and [`protocol`] (side-channel messages and the
//! sans-IO cores) on `memory`; [`kv`] (the paged KV cache and scatter) and
//! [`pipeline`] (the pull-delay load) above; [`backend`] (sockets and
//! threads) on top.

#![warn(missing_docs)]

pub mod backend;
pub mod channel;
pub mod config;
pub mod kv;
pub mod layout;
pub mod memory;
pub mod pipeline;
pub mod protocol;
pub(crate) mod wire;
