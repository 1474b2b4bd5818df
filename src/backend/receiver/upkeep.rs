//! The receiver's background work: attached senders (handshake events)
//! and the sweeper (push allocations past their deadline are revoked,
//! quarantined pages return once the channel says their writer is done,
//! late eager reads and expired proxies send their Done).

use super::super::lock;
use super::Shared;
use crate::channel::handshake::HandshakeEvent;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// How often the sweeper runs.
const SWEEP_EVERY: Duration = Duration::from_millis(200);

pub(super) fn peer_events(s: &Shared, rx: crossbeam_channel::Receiver<HandshakeEvent>) {
    while !s.stop.load(Ordering::Acquire) {
        match rx.recv_timeout(Duration::from_millis(100)) {
            // Registered by the handshake server before it answered.
            Ok(HandshakeEvent::Attached(a)) => {
                log::debug!("sender {} attached as {}", a.remote.node, a.peer);
            }
            Ok(HandshakeEvent::Refused { node, error }) => {
                log::warn!(
                    "refused a handshake from {}: {error}",
                    node.as_deref().unwrap_or("an unreadable peer")
                );
            }
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => {}
            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => break,
        }
    }
}

pub(super) fn sweep_loop(s: &Shared) {
    while !s.stop.load(Ordering::Acquire) {
        std::thread::sleep(SWEEP_EVERY);
        sweep_once(s);
    }
}

fn sweep_once(s: &Shared) {
    s.forget_gone_senders();
    let report = lock(&s.core).sweep(Instant::now());
    for k in &report.reclaimed_pushes {
        log::warn!(
            "push of {k} got no notice within pd_push_landing_timeout ({:?}); dropped, its page \
             quarantined until the writer can no longer touch it",
            s.config.push_landing_timeout
        );
    }
    if let Some(first) = report.expired_resident.first() {
        log::warn!(
            "{} landed chunk(s) (first {first}) were not loaded or cancelled within \
             pd_resident_ttl ({:?}); dropped, their pages back in the pool. If the engine \
             dropped those requests, cancel them instead; if it loads this late, raise \
             pd_resident_ttl",
            report.expired_resident.len(),
            s.config.resident_ttl
        );
    }
    for g in report.revoke {
        s.channel.revoke(g);
    }
    if !report.reclaimed_pushes.is_empty() || !report.failed_reads.is_empty() {
        s.landed.notify_all();
    }
    for d in report.done {
        s.send_done(d);
    }
    // Quarantined pages come back only when the channel can tell their
    // writer no longer touches them.
    let waiting = lock(&s.core).awaiting_quiescence();
    for g in waiting {
        if s.channel.is_quiescent(g) {
            let settled = lock(&s.core).on_quiescent(g);
            log::debug!(
                "{g}: nobody touches its pages any more; {} back in the pool, {} key(s) resident",
                settled.freed,
                settled.landed
            );
            if settled.landed > 0 {
                s.landed.notify_all();
            }
        }
    }
}
