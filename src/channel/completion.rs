//! The result of a submitted batch, and the pages it gives back.
//!
//! A batch owns its local pages from submit until the channel is done
//! with them; the [`Completion`] hands them back with the outcome. A
//! waiter that stops waiting (drops its completion, or keeps it past a
//! timeout and drops it then) does not get the pages early: they stay
//! with the transfer, counted as quarantined, and return to their pool
//! only when the transfer has really ended.

use super::ChannelError;
use crate::memory::{MemObj, Page, PageWatch, SealedMemObj};
use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::ops::Deref;
use std::time::{Duration, Instant};

/// A local page a transfer can own: the destination of a read ([`MemObj`],
/// written by the transfer) or the source of a write ([`SealedMemObj`],
/// only read).
pub(crate) trait LocalPage: Deref<Target = Page> + Send + Sync + 'static {
    /// A weak handle to mark the page quarantined if the waiter gives up.
    fn watch(&self) -> PageWatch;
}

impl LocalPage for MemObj {
    fn watch(&self) -> PageWatch {
        MemObj::watch(self)
    }
}

impl LocalPage for SealedMemObj {
    fn watch(&self) -> PageWatch {
        SealedMemObj::watch(self)
    }
}

/// How a batch ended, with its local pages.
#[derive(Debug)]
pub struct Done<P> {
    /// Whether every op of the batch completed.
    pub result: Result<(), ChannelError>,
    /// The batch's local pages, in op order. On a failed read their bytes
    /// are undefined (partly written); the channel no longer touches them.
    pub pages: Vec<P>,
}

/// The result of a submitted batch, to wait on or poll. Dropping it while
/// the batch still runs leaves the pages with the transfer (quarantined)
/// until it ends.
#[must_use = "a completion must be waited on to learn whether the transfer succeeded"]
pub struct Completion<P> {
    state: State<P>,
    watches: Vec<PageWatch>,
}

enum State<P> {
    Ready(Option<Done<P>>),
    Pending(Receiver<Done<P>>),
    Finished,
}

/// The worker's half of a [`Completion`].
pub(crate) struct CompletionSender<P>(Sender<Done<P>>);

impl<P> CompletionSender<P> {
    /// Reports the batch's outcome and gives its pages back. Call only when
    /// nothing of the batch can touch the pages any more.
    pub(crate) fn complete(self, result: Result<(), ChannelError>, pages: Vec<P>) {
        // The waiter may have given up: the pages then drop here, which is
        // the moment they may go back to their pool.
        let _ = self.0.send(Done { result, pages });
    }
}

impl<P> std::fmt::Debug for Completion<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match &self.state {
            State::Ready(_) => "ready",
            State::Pending(_) => "pending",
            State::Finished => "finished",
        };
        f.debug_struct("Completion").field("state", &state).finish()
    }
}

impl<P> Completion<P> {
    /// A pending completion for a batch over the pages `watches` follow,
    /// and the sender that finishes it.
    pub(crate) fn pending(watches: Vec<PageWatch>) -> (CompletionSender<P>, Completion<P>) {
        let (tx, rx) = crossbeam_channel::bounded(1);
        (
            CompletionSender(tx),
            Completion {
                state: State::Pending(rx),
                watches,
            },
        )
    }

    /// A completion that is already finished.
    pub fn ready(result: Result<(), ChannelError>, pages: Vec<P>) -> Completion<P> {
        Completion {
            state: State::Ready(Some(Done { result, pages })),
            watches: Vec::new(),
        }
    }

    /// Blocks until the batch finished.
    pub fn wait(mut self) -> Done<P> {
        match std::mem::replace(&mut self.state, State::Finished) {
            State::Ready(Some(d)) => d,
            State::Pending(rx) => rx.recv().unwrap_or_else(|_| lost()),
            State::Ready(None) | State::Finished => finished_twice(),
        }
    }

    /// Waits up to `timeout`; `None` while the batch still runs (the pages
    /// stay with it).
    pub fn wait_timeout(&mut self, timeout: Duration) -> Option<Done<P>> {
        let r = match &mut self.state {
            State::Ready(d) => return Some(d.take().unwrap_or_else(finished_twice)),
            State::Pending(rx) => match rx.recv_timeout(timeout) {
                Ok(d) => d,
                Err(RecvTimeoutError::Timeout) => return None,
                Err(RecvTimeoutError::Disconnected) => lost(),
            },
            State::Finished => finished_twice(),
        };
        self.state = State::Finished;
        Some(r)
    }

    /// Waits until `deadline`: `None` while the batch still runs then (the
    /// pages stay with it). A batch whose end is first seen at or after
    /// `deadline` (it finished in a race with the deadline, or was ready
    /// before this call but the caller came late) reports a
    /// [`ChannelError::Timeout`] with its pages: nothing proves it ended in
    /// time, so a read's bytes must not be used.
    pub fn wait_until(&mut self, deadline: Instant) -> Option<Done<P>> {
        let mut done = self.wait_timeout(deadline.saturating_duration_since(Instant::now()))?;
        if done.result.is_ok() && Instant::now() >= deadline {
            done.result = Err(ChannelError::Timeout {
                what: "a transfer seen finished only at its deadline".into(),
                after: Duration::ZERO,
            });
        }
        Some(done)
    }

    /// Checks without blocking; `None` while the batch still runs.
    pub fn poll(&mut self) -> Option<Done<P>> {
        let r = match &mut self.state {
            State::Ready(d) => return Some(d.take().unwrap_or_else(finished_twice)),
            State::Pending(rx) => match rx.try_recv() {
                Ok(d) => d,
                Err(TryRecvError::Empty) => return None,
                Err(TryRecvError::Disconnected) => lost(),
            },
            State::Finished => finished_twice(),
        };
        self.state = State::Finished;
        Some(r)
    }
}

impl<P> Drop for Completion<P> {
    fn drop(&mut self) {
        if let State::Pending(_) = self.state {
            // The waiter gave up while the batch may still touch its pages:
            // they stay with the transfer, counted as quarantined.
            for w in &self.watches {
                w.quarantine_if_held();
            }
        }
    }
}

/// A worker that ended without reporting (a panic: a bug). Its pages were
/// dropped with it.
fn lost<P>() -> Done<P> {
    Done {
        result: Err(ChannelError::WorkerLost(
            "the transfer worker ended without a result".into(),
        )),
        pages: Vec::new(),
    }
}

fn finished_twice<P>() -> Done<P> {
    Done {
        result: Err(ChannelError::WorkerLost(
            "this completion's result was already taken".into(),
        )),
        pages: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{ChunkLayout, Dtype, MemFormat};
    use crate::memory::{ChunkMeta, PagePool, RegisteredBuffer};
    use std::sync::Arc;

    fn pool(pages: usize) -> (Arc<PagePool>, ChunkMeta) {
        let layout = ChunkLayout {
            fmt: MemFormat::Kv2Ltd,
            layers: 1,
            tokens: 1,
            hidden: 512,
            dtype: Dtype::BFloat16,
        };
        let buf = RegisteredBuffer::host(pages * 2048, 2048, false).unwrap();
        (PagePool::new(buf), ChunkMeta::full(layout))
    }

    #[test]
    fn pages_come_back_with_the_outcome_once() {
        let (p, meta) = pool(2);
        let pages = p.allocate_batch(&[meta; 2]).unwrap();
        let (tx, mut c) = Completion::pending(pages.iter().map(LocalPage::watch).collect());
        assert!(c.poll().is_none());
        tx.complete(Ok(()), pages);
        let d = c.poll().unwrap();
        assert!(d.result.is_ok());
        assert_eq!(d.pages.len(), 2);
        assert!(matches!(
            c.poll().unwrap().result,
            Err(ChannelError::WorkerLost(_))
        ));
        drop((c, d));
        assert_eq!((p.stats().allocated, p.stats().quarantined), (0, 0));
    }

    #[test]
    fn a_dropped_waiter_leaves_the_pages_quarantined_until_the_transfer_ends() {
        let (p, meta) = pool(3);
        let pages = p.allocate_batch(&[meta; 3]).unwrap();
        let (tx, mut c) = Completion::pending(pages.iter().map(LocalPage::watch).collect());
        // The waiter times out and gives up; the worker still holds the pages.
        assert!(c.wait_timeout(Duration::from_millis(1)).is_none());
        drop(c);
        let s = p.stats();
        assert_eq!((s.allocated, s.quarantined), (3, 3));
        // Nobody can allocate them meanwhile.
        assert!(p.allocate(meta).is_err());
        // The transfer ends: only now do they return.
        tx.complete(Err(ChannelError::WorkerLost("test".into())), pages);
        let s = p.stats();
        assert_eq!((s.allocated, s.quarantined), (0, 0));
    }

    /// Review finding: a read that finished (or was done inline, like a
    /// small shm copy) was used even when its end was first seen past the
    /// pull's deadline, after the sender may have freed its pages.
    #[test]
    fn a_result_seen_only_at_or_after_the_deadline_is_not_trusted() {
        let (p, meta) = pool(3);
        let page = p.allocate_batch(&[meta]).unwrap();
        let mut c = Completion::ready(Ok(()), page);
        let late = c.wait_until(Instant::now()).unwrap();
        assert!(
            matches!(late.result, Err(ChannelError::Timeout { .. })),
            "{:?}",
            late.result
        );
        assert_eq!(late.pages.len(), 1, "the transfer is over: pages come back");
        drop(late);
        let page = p.allocate_batch(&[meta]).unwrap();
        let (tx, mut c) = Completion::pending(page.iter().map(LocalPage::watch).collect());
        tx.complete(Ok(()), page);
        let d = c
            .wait_until(Instant::now() + Duration::from_secs(60))
            .unwrap();
        assert!(d.result.is_ok(), "in time");
        // A failure keeps its own error.
        let page = p.allocate_batch(&[meta]).unwrap();
        let mut c = Completion::ready(Err(ChannelError::WorkerLost("x".into())), page);
        let past = Instant::now();
        assert!(matches!(
            c.wait_until(past).unwrap().result,
            Err(ChannelError::WorkerLost(_))
        ));
        drop(d);
        assert_eq!((p.stats().allocated, p.stats().quarantined), (0, 0));
    }

    #[test]
    fn a_worker_lost_without_reporting_is_an_error_not_a_hang() {
        let (p, meta) = pool(1);
        let pages = p.allocate_batch(&[meta]).unwrap();
        let (tx, c) = Completion::<MemObj>::pending(pages.iter().map(LocalPage::watch).collect());
        drop((tx, pages));
        assert!(matches!(c.wait().result, Err(ChannelError::WorkerLost(_))));
        assert_eq!((p.stats().allocated, p.stats().quarantined), (0, 0));
    }
}
