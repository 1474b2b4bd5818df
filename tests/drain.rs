//! Draining a prefill before it stops (a rolling restart): `SaveQueue::drain`
//! refuses new saves at once, lets the transfers in flight end within its
//! bound, and at the bound cancels what is left at its receiver, whose
//! load then fails at once instead of waiting out a timeout. Both pools
//! come back on every path. Pull-delay over tcp: the decode reads a
//! request's pages only when it loads it, so a pull stays in flight for
//! as long as the test wants.

mod common;

use ascend_pd::config::{ChannelKind, PdConfig, TransferMode};
use ascend_pd::kv::{KvCache, KvCacheSpec};
use ascend_pd::memory::pattern;
use ascend_pd::requests::{
    Availability, LoadQueue, LoadRequest, Outcome, SaveQueue, SaveRequest, SharedKvCache,
};
use ascend_pd::{Receiver, Sender};
use common::*;
use std::sync::Arc;
use std::time::{Duration, Instant};

const TOKENS: usize = 2 * CHUNK + 7;

struct Rig {
    rc: PdConfig,
    receiver: Arc<Receiver>,
    sender: Arc<Sender>,
    saves: SaveQueue,
    loads: LoadQueue,
    spec: KvCacheSpec,
    prefill: Arc<SharedKvCache>,
}

fn rig() -> Rig {
    let rc = receiver_config(ChannelKind::Tcp, TransferMode::PullDelay, 16);
    let sc = sender_config(ChannelKind::Tcp, TransferMode::PullDelay, 16);
    let receiver = Arc::new(Receiver::start(&rc, 0).unwrap());
    let sender = Arc::new(Sender::start(&sc, 0, Default::default()).unwrap());
    let saves = SaveQueue::new(Arc::clone(&sender)).unwrap();
    let loads = LoadQueue::new(Arc::clone(&receiver)).unwrap();
    let spec = KvCacheSpec::for_layout(&sc.chunk_layout(), 8, 16);
    let prefill = SharedKvCache::new(KvCache::host(spec).unwrap());
    {
        let mut c = prefill.lock();
        let mut plane = vec![0u8; spec.plane_bytes()];
        for l in 0..spec.layers {
            for p in 0..spec.planes() {
                pattern::fill(&mut plane, (l * 5 + p + 3) as u64);
                c.write(spec.offset(l, p, 0), &plane).unwrap();
            }
        }
    }
    Rig {
        rc,
        receiver,
        sender,
        saves,
        loads,
        spec,
        prefill,
    }
}

fn keys_of(name: &str) -> Vec<String> {
    (0..TOKENS.div_ceil(CHUNK))
        .map(|i| format!("{name}@{i}"))
        .collect()
}

impl Rig {
    fn request(&self, name: &str) -> SaveRequest {
        SaveRequest {
            keys: keys_of(name),
            slot_mapping: (0..TOKENS as i64).collect(),
            spec: spec_for(&self.rc, name, true),
        }
    }

    /// Saves `name` and waits until the decode holds its proxies (the pull
    /// is in flight: announced, not read).
    fn save_announced(&self, name: &str) {
        self.saves
            .submit(self.request(name), &self.prefill)
            .unwrap();
        let done = poll_until(|| self.saves.poll(), 1);
        assert_eq!(done[0].outcome, Outcome::Done, "{done:?}");
        assert!(
            eventually(Duration::from_secs(30), || self
                .loads
                .available(&keys_of(name))
                == Availability::Ready),
            "{name}: never announced"
        );
        assert_eq!(self.sender.pending_requests(), vec![name.to_string()]);
    }

    fn load(&self, name: &str) -> (Outcome, Arc<SharedKvCache>, Vec<i64>) {
        let decode = SharedKvCache::new(KvCache::host(self.spec).unwrap());
        let slots: Vec<i64> = (0..TOKENS)
            .map(|t| (self.spec.slots() - 1 - t) as i64)
            .collect();
        self.loads
            .submit(
                LoadRequest {
                    req_id: name.into(),
                    keys: keys_of(name),
                    slot_mapping: slots.clone(),
                },
                &decode,
            )
            .unwrap();
        let got = poll_until(|| self.loads.poll(), 1);
        (got[0].outcome.clone(), decode, slots)
    }

    fn pools_back(&self, what: &str) {
        assert!(
            eventually(Duration::from_secs(30), || {
                let r = self.receiver.stats().pools.cpu.unwrap();
                let s = self.sender.stats().pools.cpu.unwrap();
                r.free == r.total
                    && r.pinned == 0
                    && r.quarantined == 0
                    && s.free == s.total
                    && s.pinned == 0
                    && s.quarantined == 0
            }),
            "{what}: receiver {:?}, sender {:?}",
            self.receiver.stats().pools,
            self.sender.stats().pools
        );
    }
}

/// A decode that loads while the prefill drains gets every byte; the
/// drain ends as soon as the pull is read, and refuses a new save meanwhile.
#[test]
fn a_drain_waits_for_the_pull_in_flight_and_refuses_new_saves() {
    let r = rig();
    r.save_announced("inflight");
    let report = std::thread::scope(|s| {
        let drain = s.spawn(|| r.saves.drain(Duration::from_secs(60)));
        assert!(
            eventually(Duration::from_secs(10), || r.saves.is_draining()),
            "never draining"
        );
        let e = r
            .saves
            .submit(r.request("late"), &r.prefill)
            .unwrap_err()
            .to_string();
        assert!(e.contains("draining"), "{e}");
        // The decode loads now, after the drain began.
        let (outcome, decode, slots) = r.load("inflight");
        assert_eq!(outcome, Outcome::Done);
        let (mut src, mut dst) = (r.prefill.lock(), decode.lock());
        for l in 0..r.spec.layers {
            for p in 0..r.spec.planes() {
                for (t, slot) in slots.iter().enumerate() {
                    assert_eq!(
                        src.token(l, p, t).unwrap(),
                        dst.token(l, p, *slot as usize).unwrap(),
                        "token {t} layer {l} plane {p}"
                    );
                }
            }
        }
        drop((src, dst));
        drain.join().unwrap()
    });
    assert!(report.drained, "{report:?}");
    assert_eq!(
        (
            report.saves_left,
            report.parked_cancelled,
            report.pulls_cancelled
        ),
        (0, 0, 0)
    );
    assert!(report.waited < Duration::from_secs(60), "{report:?}");
    r.pools_back("loaded during the drain");
}

/// A decode that does not load within the bound: the drain cancels the
/// pull at its receiver, the decode's later load fails at once (not at a
/// timeout), and both pools come back.
#[test]
fn at_the_bound_the_pull_left_is_cancelled_and_the_decode_fails_at_once() {
    let r = rig();
    r.save_announced("stale");
    let report = r.saves.drain(Duration::from_millis(300));
    assert!(!report.drained, "{report:?}");
    assert_eq!(report.pulls_cancelled, 1, "{report:?}");
    assert!(report.waited >= Duration::from_millis(300), "{report:?}");
    // The receiver was told: the request is no longer loadable.
    assert!(
        eventually(Duration::from_secs(10), || r
            .loads
            .available(&keys_of("stale"))
            != Availability::Ready),
        "the decode still holds the cancelled request"
    );
    let started = Instant::now();
    let (outcome, _, _) = r.load("stale");
    assert!(matches!(outcome, Outcome::Failed(_)), "{outcome:?}");
    // "At once": well inside the receiver's own timeouts (the lease and
    // the pull TTL are minutes), not a timed assertion on a tight bound.
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "{:?}",
        started.elapsed()
    );
    r.pools_back("cancelled at the bound");
    // A drain with nothing in flight ends at once.
    assert!(r.saves.drain(Duration::from_secs(30)).drained);
}
