//! ascend-pd: KV-cache transfer between prefill (sender) and decode
//! (receiver) workers for disaggregated LLM serving on Ascend NPUs.
//!
//! Layout: [`config`] (LMCache-style YAML), [`memory`] (pools, paged
//! allocator, chunk objects).

#![warn(missing_docs)]

pub mod backend;
pub mod channel;
pub mod config;
pub mod memory;
pub mod protocol;
