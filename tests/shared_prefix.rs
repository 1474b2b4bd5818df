//! Shared-prefix ownership through the request API, over real sockets:
//! two requests whose first chunk is the same prefix key (deduplicated:
//! sent once) are loaded in either order, or one is cancelled first, and
//! the survivor still finds the prefix; every byte lands, and every pool
//! is back at its start. Before, the first load removed (push, pull-eager)
//! or consumed (pull-delay, LMCache-Ascend issue 250) the prefix under the
//! second request.
//!
//! Also here: a save that reaches the decode after the decode gave up on
//! its request lands nothing (the receiver answers it as already sent).

mod common;

use ascend_pd::config::{ChannelKind, PdConfig, TransferMode};
use ascend_pd::kv::{KvCache, KvCacheSpec};
use ascend_pd::memory::DualStats;
use ascend_pd::requests::{
    Availability, CancelState, Completion, LoadQueue, LoadRequest, Outcome, SaveQueue, SaveRequest,
    SharedKvCache,
};
use ascend_pd::{Receiver, Sender};
use common::*;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn settled(s: &DualStats) -> bool {
    [&s.cpu, &s.npu]
        .into_iter()
        .flatten()
        .all(|p| p.free == p.total && p.pinned == 0 && p.quarantined == 0)
}

fn wait_for(f: impl Fn() -> Vec<Completion>, n: usize) -> Vec<Completion> {
    let end = Instant::now() + Duration::from_secs(30);
    let mut got = Vec::new();
    while got.len() < n && Instant::now() < end {
        got.extend(f());
        std::thread::sleep(Duration::from_millis(2));
    }
    got
}

/// Prefill slots: the prefix is blocks 0..2 for both requests (prefix
/// caching shares them); request q's own chunk follows at 32 + 16 q.
fn prefill_slot(q: usize, t: usize) -> i64 {
    if t < CHUNK {
        t as i64
    } else {
        (32 + 16 * q + t - CHUNK) as i64
    }
}

fn decode_slot(q: usize, t: usize) -> i64 {
    (100 + 40 * q + t) as i64
}

fn req_keys(q: usize) -> Vec<String> {
    vec!["shared-prefix@0".into(), format!("shared-r{q}@1")]
}

/// A prefill cache whose every token holds bytes of its own.
fn prefill_cache(spec: KvCacheSpec) -> KvCache {
    let tb = spec.token_bytes();
    let mut pre = KvCache::host(spec).unwrap();
    for slot in 0..spec.slots() {
        for layer in 0..spec.layers {
            for plane in 0..spec.planes() {
                let bytes: Vec<u8> = (0..tb)
                    .map(|b| (slot * 7 + layer * 31 + plane * 17 + b) as u8)
                    .collect();
                pre.write(spec.offset(layer, plane, slot), &bytes).unwrap();
            }
        }
    }
    pre
}

#[derive(Clone, Copy, Debug)]
enum Plan {
    /// Load r0, then r1.
    InOrder,
    /// Load r1, then r0.
    Reversed,
    /// Cancel r0 on the decode side, then load r1.
    CancelFirst,
    /// Load r0, then cancel r1.
    CancelSecond,
}

/// A sender and a receiver over shm, their queues, and a prefill cache
/// (filled) and an empty decode cache of the same layout.
struct Pair {
    rc: PdConfig,
    spec: KvCacheSpec,
    receiver: Arc<Receiver>,
    sender: Arc<Sender>,
    saves: SaveQueue,
    loads: LoadQueue,
    pre: Arc<SharedKvCache>,
    dec: Arc<SharedKvCache>,
}

fn pair(mode: TransferMode) -> Pair {
    let rc = receiver_config(ChannelKind::Shm, mode, 16);
    let sc = sender_config(ChannelKind::Shm, mode, 16);
    let receiver = Arc::new(Receiver::start(&rc, 0).unwrap());
    let sender = Arc::new(Sender::start(&sc, 0, Default::default()).unwrap());
    let saves = SaveQueue::new(Arc::clone(&sender)).unwrap();
    let loads = LoadQueue::new(Arc::clone(&receiver)).unwrap();
    let spec = KvCacheSpec::for_layout(&sc.chunk_layout(), 16, 16);
    let pre = SharedKvCache::new(prefill_cache(spec));
    let dec = SharedKvCache::new(KvCache::host(spec).unwrap());
    Pair {
        rc,
        spec,
        receiver,
        sender,
        saves,
        loads,
        pre,
        dec,
    }
}

fn run(mode: TransferMode, plan: Plan) {
    let what = format!("{mode:?} {plan:?}");
    let Pair {
        rc,
        spec,
        receiver,
        sender,
        saves,
        loads,
        pre,
        dec,
    } = pair(mode);
    let tokens = 2 * CHUNK;
    for q in 0..2 {
        saves
            .submit(
                SaveRequest {
                    keys: req_keys(q),
                    slot_mapping: (0..tokens).map(|t| prefill_slot(q, t)).collect(),
                    spec: spec_for(&rc, &format!("r{q}"), true),
                },
                &pre,
            )
            .unwrap();
        // One after the other, so the second finds the prefix present.
        let done = wait_for(|| saves.poll(), 1);
        assert_eq!(done.len(), 1, "{what}");
        assert_eq!(done[0].outcome, Outcome::Done, "{what}: {done:?}");
    }
    assert_eq!(receiver.holders("shared-prefix@0"), 2, "{what}");
    for q in 0..2 {
        assert!(
            eventually(Duration::from_secs(20), || loads.available(&req_keys(q))
                == Availability::Ready),
            "{what}: r{q}"
        );
    }
    let load = |q: usize| {
        loads
            .submit(
                LoadRequest {
                    req_id: format!("r{q}"),
                    keys: req_keys(q),
                    slot_mapping: (0..tokens).map(|t| decode_slot(q, t)).collect(),
                },
                &dec,
            )
            .unwrap();
        let done = wait_for(|| loads.poll(), 1);
        assert_eq!(done.len(), 1, "{what}: r{q}");
        assert_eq!(done[0].outcome, Outcome::Done, "{what}: r{q}: {done:?}");
    };
    let loaded: Vec<usize> = match plan {
        Plan::InOrder => {
            load(0);
            load(1);
            vec![0, 1]
        }
        Plan::Reversed => {
            load(1);
            load(0);
            vec![0, 1]
        }
        Plan::CancelFirst => {
            assert_eq!(loads.cancel("r0", &req_keys(0)), CancelState::Unknown);
            assert_eq!(
                loads.available(&req_keys(1)),
                Availability::Ready,
                "{what}: the prefix survives the other's cancel"
            );
            load(1);
            vec![1]
        }
        Plan::CancelSecond => {
            load(0);
            assert_eq!(loads.cancel("r1", &req_keys(1)), CancelState::Unknown);
            vec![0]
        }
    };
    // Every loaded token holds the prefill's bytes of its slot.
    let mut pre = pre.lock();
    let mut dec = dec.lock();
    for &q in &loaded {
        for t in 0..tokens {
            for layer in 0..spec.layers {
                for plane in 0..spec.planes() {
                    assert_eq!(
                        dec.token(layer, plane, decode_slot(q, t) as usize).unwrap(),
                        pre.token(layer, plane, prefill_slot(q, t) as usize)
                            .unwrap(),
                        "{what}: r{q} token {t} layer {layer} plane {plane}"
                    );
                }
            }
        }
    }
    assert!(
        eventually(Duration::from_secs(20), || settled(&receiver.stats().pools)),
        "{what}: receiver pools {:?}",
        receiver.stats().pools
    );
    assert!(sender.drain(Duration::from_secs(20)), "{what}: pins left");
    assert!(
        eventually(Duration::from_secs(20), || settled(&sender.stats().pools)),
        "{what}: sender pools {:?}",
        sender.stats().pools
    );
}

#[test]
fn a_shared_prefix_survives_the_other_requests_load_or_cancel_in_every_mode() {
    for mode in [
        TransferMode::Push,
        TransferMode::PullEager,
        TransferMode::PullDelay,
    ] {
        for plan in [
            Plan::InOrder,
            Plan::Reversed,
            Plan::CancelFirst,
            Plan::CancelSecond,
        ] {
            run(mode, plan);
        }
    }
}

/// The decode gave up on request "p1" (aborted, refused, or its load timed
/// out) before any of its KV came, and cancelled it under the prefill's
/// request id. The prefill, not told, saves "p1" afterwards: its save ends
/// (done: nothing was left to send), no receiver page is taken and no key
/// stored, and the sender's pool is whole at once, nothing pinned until a
/// lease. Before, the chunks landed (or their proxies pinned the sender's
/// pages) and waited for `pd_resident_ttl` or the lease. Another request
/// with the same keys still lands and loads.
#[test]
fn a_save_reaching_the_decode_after_it_cancelled_the_request_lands_nothing() {
    for mode in [
        TransferMode::Push,
        TransferMode::PullEager,
        TransferMode::PullDelay,
    ] {
        late_save(mode);
    }
}

fn late_save(mode: TransferMode) {
    let what = format!("{mode:?}");
    let Pair {
        rc,
        spec,
        receiver,
        sender,
        saves,
        loads,
        pre,
        dec,
    } = pair(mode);
    let keys: Vec<String> = vec!["late@0".into(), "late@1".into()];
    let tokens = 2 * CHUNK;
    let save = |req: &str| {
        saves
            .submit(
                SaveRequest {
                    keys: keys.clone(),
                    slot_mapping: (0..tokens).map(|t| prefill_slot(0, t)).collect(),
                    spec: spec_for(&rc, req, true),
                },
                &pre,
            )
            .unwrap();
        let done = wait_for(|| saves.poll(), 1);
        assert_eq!(done.len(), 1, "{what}: {req}");
        assert_eq!(done[0].req_id, req, "{what}");
        assert_eq!(done[0].outcome, Outcome::Done, "{what}: {req}: {done:?}");
    };

    // Never submitted here: the receiver only learns the request is withdrawn.
    assert_eq!(loads.cancel("p1", &keys), CancelState::Unknown, "{what}");
    save("p1");
    for k in &keys {
        assert!(!receiver.contains(k), "{what}: {k} was stored");
    }
    assert_eq!(receiver.stats().store.withdrawn_keys, 2, "{what}");
    let pools = receiver.stats().pools;
    assert!(settled(&pools), "{what}: receiver pools {pools:?}");
    // Released at the ack: no lease, no Done to wait for.
    assert!(sender.drain(Duration::from_secs(2)), "{what}: pins left");
    assert!(
        eventually(Duration::from_secs(2), || settled(&sender.stats().pools)),
        "{what}: sender pools {:?}",
        sender.stats().pools
    );

    // Another request with the same keys lands and loads.
    save("p2");
    assert!(
        eventually(Duration::from_secs(20), || loads.available(&keys)
            == Availability::Ready),
        "{what}: p2"
    );
    loads
        .submit(
            LoadRequest {
                req_id: "p2".into(),
                keys: keys.clone(),
                slot_mapping: (0..tokens).map(|t| decode_slot(0, t)).collect(),
            },
            &dec,
        )
        .unwrap();
    let done = wait_for(|| loads.poll(), 1);
    assert_eq!(done.len(), 1, "{what}: p2");
    assert_eq!(done[0].outcome, Outcome::Done, "{what}: p2: {done:?}");
    {
        let mut pre = pre.lock();
        let mut dec = dec.lock();
        for t in 0..tokens {
            for layer in 0..spec.layers {
                for plane in 0..spec.planes() {
                    assert_eq!(
                        dec.token(layer, plane, decode_slot(0, t) as usize).unwrap(),
                        pre.token(layer, plane, prefill_slot(0, t) as usize)
                            .unwrap(),
                        "{what}: token {t} layer {layer} plane {plane}"
                    );
                }
            }
        }
    }
    assert_eq!(receiver.stats().store.withdrawn_keys, 2, "{what}");
    assert!(
        eventually(Duration::from_secs(20), || settled(&receiver.stats().pools)),
        "{what}: receiver pools {:?}",
        receiver.stats().pools
    );
    assert!(sender.drain(Duration::from_secs(20)), "{what}: pins left");
    assert!(
        eventually(Duration::from_secs(20), || settled(&sender.stats().pools)),
        "{what}: sender pools {:?}",
        sender.stats().pools
    );
}
