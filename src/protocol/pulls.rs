//! The pull side of a receiver: pull-delay contexts (one per notification
//! whose proxies are stored, until each proxy is consumed or discarded and
//! the pull's Done goes out) and pull-eager reads (one per notification
//! read at once, until its read ends or its deadline passes).
//!
//! Plain data with the rules of a pull's life; the keys the proxies and
//! reads are for live in [`super::receiver::ReceiverCore`]'s store.

use std::collections::HashMap;
use std::time::Instant;

use super::context::{ProxyReadError, SendPullDone, SlotState, TransferContext};
use super::receiver::ProxyHandle;

/// One pull-delay notification's proxies.
#[derive(Debug)]
struct PullContext {
    ctx: TransferContext,
    /// Key of each slot.
    keys: Vec<String>,
}

/// The open pull-delay contexts, by pull id.
#[derive(Debug, Default)]
pub(crate) struct DelayContexts {
    open: HashMap<String, PullContext>,
}

/// What resolving a proxy's slot did.
pub(crate) struct SlotResolved {
    /// The pull's Done, when this ended it.
    pub done: Option<SendPullDone>,
    /// The key of the slot, when the slot is no longer outstanding (its
    /// proxy leaves the store).
    pub resolved_key: Option<String>,
}

impl DelayContexts {
    /// Opens the context of `pull_id`, whose slot `i` is the proxy of `keys[i]`.
    pub(crate) fn open(&mut self, pull_id: String, ctx: TransferContext, keys: Vec<String>) {
        self.open.insert(pull_id, PullContext { ctx, keys });
    }

    /// Whether `pull_id`'s context is open.
    pub(crate) fn contains(&self, pull_id: &str) -> bool {
        self.open.contains_key(pull_id)
    }

    /// The context of `pull_id`, while open.
    #[cfg(test)]
    pub(crate) fn get(&self, pull_id: &str) -> Option<&TransferContext> {
        self.open.get(pull_id).map(|c| &c.ctx)
    }

    /// The key of `handle`'s slot.
    pub(crate) fn key_at(&self, handle: &ProxyHandle) -> Option<&String> {
        self.open.get(&handle.pull_id)?.keys.get(handle.slot)
    }

    /// The keys of `pull_id`'s slots, in slot order.
    pub(crate) fn keys_of(&self, pull_id: &str) -> Option<Vec<String>> {
        self.open.get(pull_id).map(|c| c.keys.clone())
    }

    /// Where `handle`'s slot is.
    pub(crate) fn slot(&self, handle: &ProxyHandle) -> Option<SlotState> {
        self.open.get(&handle.pull_id)?.ctx.slot(handle.slot)
    }

    /// Contexts whose lease has run out at `now`.
    pub(crate) fn expired(&self, now: Instant) -> Vec<String> {
        self.open
            .iter()
            .filter(|(_, c)| c.ctx.is_expired(now))
            .map(|(id, _)| id.clone())
            .collect()
    }

    /// Proxies of `sender_id` not yet consumed or discarded.
    pub(crate) fn outstanding_of(&self, sender_id: &str) -> usize {
        self.open
            .values()
            .filter(|c| c.ctx.sender_id() == sender_id)
            .map(|c| c.ctx.outstanding())
            .sum()
    }

    /// (open contexts, proxies outstanding in them).
    pub(crate) fn counts(&self) -> (usize, usize) {
        let outstanding = self.open.values().map(|c| c.ctx.outstanding()).sum();
        (self.open.len(), outstanding)
    }

    /// Pins `handle`'s proxy for a read starting at `now` (refused from
    /// `read_by` on). `None` when the context is not open.
    pub(crate) fn begin_read(
        &mut self,
        handle: &ProxyHandle,
        now: Instant,
        read_by: Instant,
    ) -> Option<Result<(), ProxyReadError>> {
        let pc = self.open.get_mut(&handle.pull_id)?;
        Some(pc.ctx.begin_read(handle.slot, now, read_by))
    }

    /// Applies `f` to `handle`'s slot; a context whose pull it finished
    /// closes. `None` when the context is not open.
    pub(crate) fn resolve<F>(&mut self, handle: &ProxyHandle, f: F) -> Option<SlotResolved>
    where
        F: FnOnce(&mut TransferContext, usize) -> Option<SendPullDone>,
    {
        let pc = self.open.get_mut(&handle.pull_id)?;
        let done = f(&mut pc.ctx, handle.slot);
        let resolved = !matches!(
            pc.ctx.slot(handle.slot),
            Some(SlotState::Outstanding { .. }) | None
        );
        let resolved_key = resolved
            .then(|| pc.keys.get(handle.slot).cloned())
            .flatten();
        if pc.ctx.is_finished() {
            self.open.remove(&handle.pull_id);
        }
        Some(SlotResolved { done, resolved_key })
    }
}

/// One pull-eager notification being read.
#[derive(Debug)]
pub(crate) struct EagerPull {
    pub sender_id: String,
    pub done_url: String,
    pub deadline: Instant,
    pub keys: Vec<String>,
}

/// The pull-eager reads in progress, by pull id.
#[derive(Debug, Default)]
pub(crate) struct EagerPulls {
    open: HashMap<String, EagerPull>,
}

impl EagerPulls {
    /// `pull_id`'s read started.
    pub(crate) fn start(&mut self, pull_id: String, pull: EagerPull) {
        self.open.insert(pull_id, pull);
    }

    /// Whether `pull_id`'s read is in progress.
    pub(crate) fn contains(&self, pull_id: &str) -> bool {
        self.open.contains_key(pull_id)
    }

    /// `pull_id`'s read ended: what it was (once).
    pub(crate) fn end(&mut self, pull_id: &str) -> Option<EagerPull> {
        self.open.remove(pull_id)
    }

    /// The keys `pull_id`'s read is for.
    pub(crate) fn keys_of(&self, pull_id: &str) -> Vec<String> {
        self.open
            .get(pull_id)
            .map(|p| p.keys.clone())
            .unwrap_or_default()
    }

    /// Reads whose deadline has passed at `now`.
    pub(crate) fn late(&self, now: Instant) -> Vec<String> {
        self.open
            .iter()
            .filter(|(_, p)| now >= p.deadline)
            .map(|(id, _)| id.clone())
            .collect()
    }

    /// Reads in progress.
    pub(crate) fn len(&self) -> usize {
        self.open.len()
    }
}
