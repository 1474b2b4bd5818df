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
//! The sans-IO protocol cores live beside the messages: [`SenderCore`]
//! ([`sender`]: the sequence of a put over [`PullPending`], the
//! [`CircuitBreaker`] and [`Backpressure`]) and [`ReceiverCore`]
//! ([`receiver`]: keys, push allocations lent to their writers, per-pull
//! [`TransferContext`]s), plus the pull [`lease`], the push [`notice`]s
//! and the field checks of incoming messages ([`validate`]). They are plain
//! structs driven by messages, completions and `Instant`s passed in, and
//! they say what to send and which pages to grant or release; the I/O
//! shell around them owns the sockets, threads, channel and clock.
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

mod error;
mod messages;

pub mod backpressure;
pub mod breaker;
pub mod context;
pub mod lease;
pub mod notice;
pub mod pending;
pub mod receiver;
pub mod recent;
pub mod sender;
pub mod validate;

#[cfg(test)]
mod core_tests;

#[cfg(test)]
mod sim_tests;

#[cfg(test)]
mod tests;

pub use backpressure::{Admission, Backpressure};
pub use breaker::{BreakerCounters, BreakerState, CircuitBreaker};
pub use context::{ProxyReadError, ReadOutcome, SendPullDone, SlotState, TransferContext};
pub use error::{DecodeError, EncodeError};
pub use lease::{read_margin, ClockMap, PullId};
pub use messages::{
    AllocRequest, AscendAllocResponse, Message, MessageType, ProxyNotif, PullDoneSignal,
    PullReadyDoneAck, PullReadyNotif, FMT_KV_2LTD, FMT_MLA, TYPE_KEY,
};
pub use notice::{PushNotice, PushOutcome};
pub use pending::{
    AckOutcome, Delivery, DoneOutcome, ExpiredPull, InsertError, InsertOutcome, PullCounters,
    PullPending, PullPendingLimits, ReleaseReason, ReleasedPull, ReqFailedOutcome,
};
pub use receiver::{
    AllocId, EagerRead, KeyState, Lookup, NoticeReply, Partition, ProxyEntry, ProxyHandle,
    PullPlan, PullReply, PushPlan, PushReply, ReadItem, ReceiverConfig, ReceiverCore,
    ReceiverCounters, Removed, SweepReport, Verdict,
};
pub use recent::RecentIds;
pub use sender::{
    Attached, Put, PutAction, PutEnd, PutFailure, PutOutcome, PutRejected, PutSpec, RequestKind,
    SenderConfig, SenderCore, SenderCounters, WriteEnd,
};
pub use validate::{
    check_alloc_request, check_pull_notif, CheckedChunks, CheckedPull, InvalidMessage,
};
