//! Message, error and byte counters both sides keep for tests, the bench and operators.

use std::sync::atomic::{AtomicU64, Ordering};

/// What a counter counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MessageKind {
    /// `AllocRequest` sent or received.
    AllocRequest,
    /// `AscendAllocResponse` sent or received.
    AllocResponse,
    /// `PullReadyNotif` sent or received.
    PullReadyNotif,
    /// `PullReadyDoneAck` sent or received.
    PullReadyDoneAck,
    /// `PullDoneSignal` sent or received.
    PullDoneSignal,
    /// `ProxyNotif` sent.
    ProxyNotif,
    /// Push notice (landed / aborted) sent or received.
    PushNotice,
    /// A frame that could not be decoded, or a message on the wrong socket.
    Malformed,
    /// A message that decoded but failed validation.
    Rejected,
    /// A side-channel request that timed out (socket replaced).
    Timeout,
    /// A transfer (read or write batch) that failed.
    TransferError,
    /// Puts skipped because the receiver's breaker was open.
    BreakerSkip,
    /// `CancelNotif` sent or received.
    CancelNotif,
    /// `CacheQueryRequest` received.
    CacheQuery,
    /// With a deployment secret: a side-channel frame (or probe answer)
    /// that failed authentication — not sealed, altered, replayed, or
    /// naming what its attachment does not own. Dropped, never acted on.
    AuthDropped,
}

const KINDS: usize = 15;

impl MessageKind {
    /// Every kind, in counter order.
    pub const ALL: [MessageKind; KINDS] = [
        MessageKind::AllocRequest,
        MessageKind::AllocResponse,
        MessageKind::PullReadyNotif,
        MessageKind::PullReadyDoneAck,
        MessageKind::PullDoneSignal,
        MessageKind::ProxyNotif,
        MessageKind::PushNotice,
        MessageKind::Malformed,
        MessageKind::Rejected,
        MessageKind::Timeout,
        MessageKind::TransferError,
        MessageKind::BreakerSkip,
        MessageKind::CancelNotif,
        MessageKind::CacheQuery,
        MessageKind::AuthDropped,
    ];

    /// A snake_case name for metrics.
    pub fn name(self) -> &'static str {
        match self {
            MessageKind::AllocRequest => "alloc_request",
            MessageKind::AllocResponse => "alloc_response",
            MessageKind::PullReadyNotif => "pull_ready_notif",
            MessageKind::PullReadyDoneAck => "pull_ready_done_ack",
            MessageKind::PullDoneSignal => "pull_done_signal",
            MessageKind::ProxyNotif => "proxy_notif",
            MessageKind::PushNotice => "push_notice",
            MessageKind::Malformed => "malformed",
            MessageKind::Rejected => "rejected",
            MessageKind::Timeout => "timeout",
            MessageKind::TransferError => "transfer_error",
            MessageKind::BreakerSkip => "breaker_skip",
            MessageKind::CancelNotif => "cancel_notif",
            MessageKind::CacheQuery => "cache_query",
            MessageKind::AuthDropped => "auth_dropped",
        }
    }
}

/// Lock-free counters of one side.
#[derive(Debug, Default)]
pub struct MessageCounters {
    counts: [AtomicU64; KINDS],
    bytes: AtomicU64,
}

impl MessageCounters {
    /// Adds one to `kind`; returns the previous count (0 means first occurrence).
    pub fn bump(&self, kind: MessageKind) -> u64 {
        self.counts[kind as usize].fetch_add(1, Ordering::Relaxed)
    }

    /// The count of `kind`.
    pub fn get(&self, kind: MessageKind) -> u64 {
        self.counts[kind as usize].load(Ordering::Relaxed)
    }

    /// Adds transferred bytes.
    pub fn add_bytes(&self, n: u64) {
        self.bytes.fetch_add(n, Ordering::Relaxed);
    }

    /// Bytes moved by transfers this side started.
    pub fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }

    /// Every kind with its count.
    pub fn snapshot(&self) -> Vec<(MessageKind, u64)> {
        MessageKind::ALL.iter().map(|&k| (k, self.get(k))).collect()
    }
}
