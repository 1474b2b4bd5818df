//! Memory registered with a transfer channel as the destination of direct
//! reads.

/// Memory registered with a channel for direct reads (a KV cache the
/// transfers land in, for channels that can only address registered
/// memory). Dropping it deregisters the memory on every connection that
/// used it; keep it no longer than the memory.
pub struct DirectRegistration {
    channel: u64,
    _hold: Box<dyn Send + Sync>,
}

impl std::fmt::Debug for DirectRegistration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DirectRegistration")
            .field("channel", &self.channel)
            .finish()
    }
}

impl DirectRegistration {
    /// A registration with channel `channel` (`TransferChannel::direct_registry`),
    /// undone when `hold` is dropped.
    pub(crate) fn new(channel: u64, hold: Box<dyn Send + Sync>) -> DirectRegistration {
        DirectRegistration {
            channel,
            _hold: hold,
        }
    }

    /// The channel it belongs to.
    pub fn channel(&self) -> u64 {
        self.channel
    }
}
