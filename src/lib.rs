//! ascend-pd: KV-cache transfer between prefill (sender) and decode
//! (receiver) workers for disaggregated LLM serving on Ascend NPUs.
//!
//! Layout: [`config`] (LMCache-style YAML), [`memory`] (pools, paged
//! allocator, chunk objects), [`kv`] (the paged KV cache and scatter),
//! [`pipeline`] (pull-delay proxies and the ping-pong fetch + scatter).

#![warn(missing_docs)]

pub mod backend;
pub mod channel;
pub mod config;
pub mod kv;
pub mod memory;
pub mod pipeline;
pub mod protocol;
