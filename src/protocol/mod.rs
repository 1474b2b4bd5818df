//! Side-channel messages between prefill (sender), decode (receiver) and the
//! proxy, wire-compatible with LMCache-Ascend's `AscendPDBackend`.
//!
//! Each message is one ZMQ frame holding a msgpack map whose first key is
//! `"type"` (the message name), followed by the fields in the order of the
//! protocol table — msgspec's tagged-struct encoding:
//!
//! | type | fields (wire order) |
//! |---|---|
//! | [`AllocRequest`] | keys, fmt, shape, dtype, last_chunk_toks |
//! | [`AscendAllocResponse`] | already_sent_indexes, remote_indexes, remote_buffer_uuids, alloc_failed=false |
//! | [`PullReadyNotif`] | pull_id, keys, sender_buffer_uuids, sender_mem_indexes, sender_id, sender_done_url, fmt, shape, dtype, last_chunk_toks |
//! | [`PullReadyDoneAck`] | already_sent_indexes, alloc_failed=false |
//! | [`PullDoneSignal`] | pull_id |
//! | [`ProxyNotif`] | req_id |
//!
//! Encoding reproduces msgspec byte for byte (every value in its smallest
//! msgpack form, defaulted fields always written). Decoding accepts any key
//! order and any integer width, skips unknown keys, applies defaults, and
//! reports every other deviation as a [`DecodeError`] naming the message
//! type and field; it never panics and never trusts a length the input
//! cannot back.
//!
//! ```
//! use ascend_pd::protocol::{Message, PullDoneSignal};
//!
//! let sig = PullDoneSignal { pull_id: "abc".to_owned() };
//! let frame = sig.encode();
//! assert_eq!(Message::decode(&frame)?, Message::PullDoneSignal(sig.clone()));
//! assert_eq!(PullDoneSignal::decode(&frame)?, sig);
//! # Ok::<(), ascend_pd::protocol::DecodeError>(())
//! ```

pub(crate) mod codec;
mod error;
mod messages;

#[cfg(test)]
mod tests;

pub use error::{DecodeError, EncodeError};
pub use messages::{
    AllocRequest, AscendAllocResponse, Message, MessageType, ProxyNotif, PullDoneSignal,
    PullReadyDoneAck, PullReadyNotif, FMT_KV_2LTD, FMT_MLA, TYPE_KEY,
};
