//! The receiver's per-pull [`TransferContext`] (pull-delay mode): it tracks
//! the proxies of one `PullReadyNotif` and yields the single
//! `PullDoneSignal` to send once every proxy is resolved.
//!
//! Each proxy (a *slot*) is resolved exactly once, either **consumed**
//! (its data was read and scattered) or **discarded** (removed, evicted,
//! its read failed, or its lease passed). Reading a proxy is bracketed by
//! [`TransferContext::begin_read`] / [`TransferContext::end_read`]; a read
//! in flight is a pin that never resolves the slot by itself, and a
//! discard requested meanwhile waits for the read to end (the sender must
//! not free pages the receiver is still reading). Resolving a slot twice is
//! refused and counted; the Done action comes out exactly once.

use std::time::Instant;

use super::messages::PullDoneSignal;

/// "Send this `PullDoneSignal` to `done_url`" — the receiver's only output
/// towards a sender. Always sent after the pull's ack.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SendPullDone {
    /// Sender's PULL endpoint (`host:port`), from `sender_done_url`.
    pub done_url: String,
    /// The sender (`sender_id`).
    pub sender_id: String,
    /// The signal to send.
    pub signal: PullDoneSignal,
}

/// How a proxy read ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadOutcome {
    /// Data read and scattered: the proxy is consumed.
    Consumed,
    /// The read failed: the proxy is discarded.
    Failed,
    /// Data read and scattered, but another request still holds the key
    /// (a shared prefix): the proxy stays for it.
    Kept,
}

/// Why a proxy may not be read.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProxyReadError {
    /// No such key (or no such pull / slot).
    #[error("{0}: no such proxy")]
    Missing(String),
    /// The key holds data, not a proxy.
    #[error("{0}: not a proxy")]
    NotAProxy(String),
    /// The pull's lease has passed (or would pass within the read margin):
    /// the sender may free the pages, so they must not be read.
    #[error("{0}: the pull's lease has expired")]
    LeaseExpired(String),
    /// The proxy is already consumed or discarded.
    #[error("{0}: proxy already resolved")]
    Resolved(String),
}

/// The state of one proxy of a pull.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotState {
    /// Not resolved yet.
    Outstanding {
        /// Reads in flight.
        readers: u32,
        /// A discard (or a failed read) is waiting for the reads in flight.
        discard_pending: bool,
        /// A read in flight already consumed the data (the slot resolves as
        /// consumed when the last read ends).
        consumed: bool,
    },
    /// Read and scattered.
    Consumed,
    /// Removed, evicted, failed or expired.
    Discarded,
}

/// One pull's proxies and where to send its Done.
#[derive(Clone, Debug)]
pub struct TransferContext {
    pull_id: String,
    sender_id: String,
    done_url: String,
    lease_deadline: Instant,
    slots: Vec<SlotState>,
    unresolved: usize,
    done_emitted: bool,
    refused_resolutions: u64,
}

impl TransferContext {
    /// A context for a pull with `proxies` proxies, readable until
    /// `lease_deadline`.
    pub fn new(
        pull_id: &str,
        sender_id: &str,
        done_url: &str,
        proxies: usize,
        lease_deadline: Instant,
    ) -> TransferContext {
        TransferContext {
            pull_id: pull_id.to_owned(),
            sender_id: sender_id.to_owned(),
            done_url: done_url.to_owned(),
            lease_deadline,
            slots: vec![
                SlotState::Outstanding {
                    readers: 0,
                    discard_pending: false,
                    consumed: false,
                };
                proxies
            ],
            unresolved: proxies,
            done_emitted: false,
            refused_resolutions: 0,
        }
    }

    /// The pull's id.
    pub fn pull_id(&self) -> &str {
        &self.pull_id
    }

    /// The sender's id.
    pub fn sender_id(&self) -> &str {
        &self.sender_id
    }

    /// Where the Done goes.
    pub fn done_url(&self) -> &str {
        &self.done_url
    }

    /// The instant after which no proxy of this pull may be read.
    pub fn lease_deadline(&self) -> Instant {
        self.lease_deadline
    }

    /// Whether the lease has passed at `now`.
    pub fn is_expired(&self, now: Instant) -> bool {
        now >= self.lease_deadline
    }

    /// Proxies not yet resolved.
    pub fn outstanding(&self) -> usize {
        self.unresolved
    }

    /// Whether the Done has been emitted (every proxy resolved).
    pub fn is_finished(&self) -> bool {
        self.done_emitted
    }

    /// Resolutions refused because the slot was already resolved (or unknown).
    pub fn refused_resolutions(&self) -> u64 {
        self.refused_resolutions
    }

    /// The state of proxy `slot`.
    pub fn slot(&self, slot: usize) -> Option<SlotState> {
        self.slots.get(slot).copied()
    }

    /// The Done for a context that has nothing to resolve (zero proxies),
    /// emitted once; `None` otherwise.
    pub fn done_if_empty(&mut self) -> Option<SendPullDone> {
        if self.unresolved == 0 {
            self.emit_done()
        } else {
            None
        }
    }

    /// Pins proxy `slot` for a read starting at `now`. Refused when the
    /// slot is resolved or being discarded, or when `now` is not before
    /// `read_by` (the lease deadline minus the shell's read margin).
    /// Never resolves the slot.
    pub fn begin_read(
        &mut self,
        slot: usize,
        now: Instant,
        read_by: Instant,
    ) -> Result<(), ProxyReadError> {
        let name = || format!("{}[{slot}]", self.pull_id);
        if now >= read_by {
            return Err(ProxyReadError::LeaseExpired(name()));
        }
        match self.slots.get_mut(slot) {
            None => Err(ProxyReadError::Missing(name())),
            Some(SlotState::Outstanding {
                readers,
                discard_pending: false,
                consumed: false,
            }) => {
                *readers += 1;
                Ok(())
            }
            Some(_) => Err(ProxyReadError::Resolved(name())),
        }
    }

    /// Ends a read begun with [`TransferContext::begin_read`]. When the last
    /// read in flight ends the slot resolves: consumed if any read consumed
    /// it, discarded otherwise (failed reads, discard requested meanwhile).
    /// Returns the Done when this resolved the last proxy. An end without a
    /// matching begin is refused (counted) and changes nothing.
    pub fn end_read(&mut self, slot: usize, outcome: ReadOutcome) -> Option<SendPullDone> {
        let Some(SlotState::Outstanding {
            readers,
            discard_pending,
            consumed,
        }) = self.slots.get_mut(slot)
        else {
            self.refused_resolutions += 1;
            return None;
        };
        if *readers == 0 {
            self.refused_resolutions += 1;
            return None;
        }
        *readers -= 1;
        match outcome {
            ReadOutcome::Consumed => *consumed = true,
            ReadOutcome::Failed => *discard_pending = true,
            ReadOutcome::Kept => {}
        }
        // Another read still uses the sender's pages: resolve when it ends.
        if *readers > 0 {
            return None;
        }
        // Kept, and nobody consumed or discarded it meanwhile: it stays
        // outstanding for the request that still holds it.
        if !*consumed && !*discard_pending {
            return None;
        }
        let to = if *consumed {
            SlotState::Consumed
        } else {
            SlotState::Discarded
        };
        self.resolve(slot, to)
    }

    /// Discards proxy `slot` (removed, evicted, expired). With a read in
    /// flight the discard waits for [`TransferContext::end_read`]. Returns
    /// the Done when this resolved the last proxy; a second discard is
    /// refused (counted) and harmless.
    pub fn discard(&mut self, slot: usize) -> Option<SendPullDone> {
        match self.slots.get_mut(slot) {
            Some(SlotState::Outstanding { readers: 0, .. }) => {
                self.resolve(slot, SlotState::Discarded)
            }
            Some(SlotState::Outstanding {
                discard_pending, ..
            }) => {
                *discard_pending = true;
                None
            }
            _ => {
                self.refused_resolutions += 1;
                None
            }
        }
    }

    fn resolve(&mut self, slot: usize, to: SlotState) -> Option<SendPullDone> {
        self.slots[slot] = to;
        self.unresolved -= 1;
        if self.unresolved == 0 {
            self.emit_done()
        } else {
            None
        }
    }

    fn emit_done(&mut self) -> Option<SendPullDone> {
        if self.done_emitted {
            return None;
        }
        self.done_emitted = true;
        Some(SendPullDone {
            done_url: self.done_url.clone(),
            sender_id: self.sender_id.clone(),
            signal: PullDoneSignal {
                pull_id: self.pull_id.clone(),
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn ctx(n: usize, t0: Instant) -> TransferContext {
        TransferContext::new("pull", "s:1", "h:7700", n, t0 + Duration::from_secs(10))
    }

    #[test]
    fn done_exactly_once_across_consume_and_discard_mixes() {
        let t0 = Instant::now();
        let far = t0 + Duration::from_secs(10);
        // Every interleaving of consume / discard over 3 slots, with repeats.
        for mask in 0..8u32 {
            let mut c = ctx(3, t0);
            let mut dones = 0;
            for slot in 0..3 {
                let consume = mask & (1 << slot) != 0;
                let d = if consume {
                    c.begin_read(slot, t0, far).unwrap();
                    c.end_read(slot, ReadOutcome::Consumed)
                } else {
                    c.discard(slot)
                };
                dones += d.iter().count();
                // Resolving again is refused and emits nothing.
                assert!(c.discard(slot).is_none());
                assert!(c.end_read(slot, ReadOutcome::Consumed).is_none());
                assert!(c.begin_read(slot, t0, far).is_err());
            }
            assert_eq!(dones, 1, "mask {mask}");
            assert!(c.is_finished());
            assert_eq!(c.outstanding(), 0);
            assert_eq!(c.refused_resolutions(), 6);
            assert!(c.done_if_empty().is_none());
        }
    }

    #[test]
    fn done_carries_pull_id_and_url() {
        let t0 = Instant::now();
        let mut c = ctx(1, t0);
        let d = c.discard(0).unwrap();
        assert_eq!(d.signal.pull_id, "pull");
        assert_eq!(d.done_url, "h:7700");
        assert_eq!(d.sender_id, "s:1");
        assert_eq!(c.slot(0), Some(SlotState::Discarded));
    }

    #[test]
    fn discard_during_read_waits_for_the_read() {
        let t0 = Instant::now();
        let far = t0 + Duration::from_secs(10);
        let mut c = ctx(1, t0);
        c.begin_read(0, t0, far).unwrap();
        // Eviction while the read is in flight: no Done yet (the sender must keep the pages).
        assert!(c.discard(0).is_none());
        assert_eq!(c.outstanding(), 1);
        // No new read may start on a proxy being discarded.
        assert!(matches!(
            c.begin_read(0, t0, far),
            Err(ProxyReadError::Resolved(_))
        ));
        // The read ends: now the slot resolves and Done comes out.
        let d = c.end_read(0, ReadOutcome::Consumed).unwrap();
        assert_eq!(d.signal.pull_id, "pull");
        assert_eq!(c.slot(0), Some(SlotState::Consumed));
    }

    #[test]
    fn failed_read_discards_and_empty_context_is_done_at_once() {
        let t0 = Instant::now();
        let far = t0 + Duration::from_secs(10);
        let mut c = ctx(2, t0);
        c.begin_read(0, t0, far).unwrap();
        c.begin_read(0, t0, far).unwrap();
        assert!(c.end_read(0, ReadOutcome::Failed).is_none());
        assert_eq!(c.outstanding(), 2);
        assert!(c.end_read(0, ReadOutcome::Failed).is_none());
        assert_eq!(c.slot(0), Some(SlotState::Discarded));
        // Two readers: one consumed, one failed -> consumed, once both ended.
        c.begin_read(1, t0, far).unwrap();
        c.begin_read(1, t0, far).unwrap();
        assert!(c.end_read(1, ReadOutcome::Consumed).is_none());
        assert_eq!(c.outstanding(), 1);
        assert!(c.end_read(1, ReadOutcome::Failed).is_some());
        assert_eq!(c.slot(1), Some(SlotState::Consumed));

        let mut empty = ctx(0, t0);
        assert!(empty.done_if_empty().is_some());
        assert!(empty.done_if_empty().is_none());
    }

    #[test]
    fn reads_refused_at_or_after_the_read_deadline() {
        let t0 = Instant::now();
        let mut c = ctx(1, t0);
        let lease = c.lease_deadline();
        assert!(matches!(
            c.begin_read(0, lease, lease),
            Err(ProxyReadError::LeaseExpired(_))
        ));
        assert!(c.is_expired(lease));
        assert!(!c.is_expired(lease - Duration::from_millis(1)));
        assert!(c
            .begin_read(0, lease - Duration::from_millis(1), lease)
            .is_ok());
        assert!(matches!(
            c.begin_read(5, t0, lease),
            Err(ProxyReadError::Missing(_))
        ));
    }
}
