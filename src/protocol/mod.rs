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
//! | [`RegisterDecode`] | transfer_id, receiver_host, receiver_init_port, receiver_alloc_port, held_tokens=0 |
//! | [`RegisterDecodeAck`] | accepted, error="" |
//!
//! Encoding reproduces msgspec byte for byte (every value in its smallest
//! msgpack form, defaulted fields always written). Decoding accepts any key
//! order and any integer width, skips unknown keys, applies defaults, and
//! reports every other deviation as a [`DecodeError`] naming the message
//! type and field; it never panics and never trusts a length the input
//! cannot back.
//!
//! The sans-IO protocol cores live beside the messages (crate-internal):
//! the sender core (the sequence of a put over the pinned-pull table, the
//! circuit breaker and backpressure) and the receiver core (keys, push
//! allocations lent to their writers, per-pull [`TransferContext`]s), plus
//! the pull [`lease`], the push [`notice`]s and the field checks of
//! incoming messages. They are plain structs driven by messages,
//! completions and `Instant`s passed in, and they say what to send and
//! which pages to grant or release; the I/O shell around them (the
//! `backend`) owns the sockets, threads, channel and clock. Their
//! outcomes and counters are public: [`PutOutcome`], [`PullCounters`],
//! [`BreakerCounters`], [`ReceiverCounters`], [`KeyState`].
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

pub(crate) mod admission;
pub(crate) mod allocations;
pub(crate) mod backpressure;
pub(crate) mod breaker;
pub(crate) mod context;
pub mod lease;
pub mod notice;
pub(crate) mod ownership;
pub mod parking;
pub(crate) mod pending;
pub(crate) mod pulls;
pub(crate) mod receiver;
pub(crate) mod recent;
pub(crate) mod sender;
pub(crate) mod validate;
pub(crate) mod waiting;

// What users of the library see: the messages, and the counters, states
// and outcomes the backend reports.
pub use breaker::{BreakerCounters, BreakerState};
pub use context::{ReadOutcome, SendPullDone, SlotState, TransferContext};
pub use error::{DecodeError, EncodeError};
pub use lease::{ClockMap, PullId};
pub use messages::{
    AllocRequest, AscendAllocResponse, CacheQueryRequest, CacheQueryResponse, CancelNotif, Message,
    MessageType, ProxyNotif, PullDoneSignal, PullReadyDoneAck, PullReadyNotif, RegisterDecode,
    RegisterDecodeAck, FMT_KV_2LTD, FMT_MLA, TYPE_KEY,
};
pub use notice::{PushNotice, PushOutcome};
pub use parking::ParkingCounters;
pub use pending::PullCounters;
pub use receiver::{HeadPiece, KeyState, ProxyEntry, ProxyHandle, ReceiverCounters};
pub use sender::{ChunkDesc, PutOutcome};
pub use validate::InvalidMessage;

// The sans-IO cores, for the shell (backend).
pub(crate) use backpressure::Backpressure;
pub(crate) use pending::{Delivery, DoneOutcome};
pub(crate) use receiver::{
    EagerRead, Lookup, ReceiverConfig, ReceiverCore, Verdict, RESIDENT_EXPIRED,
};
pub(crate) use sender::{
    Attached, PutAction, PutFailure, PutRejected, PutSpec, RequestKind, SenderConfig, SenderCore,
    WriteEnd,
};
pub(crate) use waiting::{Retry, WaitQueue, MAX_WAITING};

// ... and the rest of them for the tests.
#[cfg(test)]
use {
    backpressure::Admission,
    breaker::CircuitBreaker,
    context::ProxyReadError,
    lease::read_margin,
    pending::{
        AckOutcome, InsertError, InsertOutcome, PullPending, PullPendingLimits, ReleaseReason,
        ReleasedPull, ReqFailedOutcome,
    },
    receiver::{NoticeReply, PullReply, PushReply, Settled},
    sender::{Put, PutEnd},
};

#[cfg(test)]
mod core_tests;

#[cfg(test)]
mod sim_tests;

#[cfg(test)]
mod tests;
