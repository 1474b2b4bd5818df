//! A load never reports success with slots left unwritten, and a save never
//! ships a token it was not given: slot mappings that do not match what is
//! stored are refused before any byte moves, with the rule they broke, and
//! every page goes back to its pool. Real sockets (tcp), host KV caches.

mod common;

use ascend_pd::config::{ChannelKind, TransferMode};
use ascend_pd::kv::{KvCache, KvCacheSpec};
use ascend_pd::memory::pattern;
use ascend_pd::requests::{
    Availability, LoadQueue, LoadRequest, Outcome, SaveQueue, SaveRequest, SharedKvCache,
};
use ascend_pd::{Receiver, Sender};
use common::*;
use std::sync::Arc;
use std::time::Duration;

/// Tokens of the request saved: a full chunk and 5 more.
const TOKENS: usize = CHUNK + 5;

fn req_keys(name: &str) -> Vec<String> {
    (0..TOKENS.div_ceil(CHUNK))
        .map(|i| format!("{name}@{i}"))
        .collect()
}

fn is_zero(cache: &SharedKvCache) -> bool {
    let mut c = cache.lock();
    let spec = *c.spec();
    (0..spec.layers).all(|l| {
        (0..spec.planes())
            .all(|p| (0..spec.slots()).all(|s| c.token(l, p, s).unwrap().iter().all(|&b| b == 0)))
    })
}

fn mismatched_slot_mappings_are_refused(mode: TransferMode) {
    let what = format!("{mode:?}");
    let rc = receiver_config(ChannelKind::Tcp, mode, 16);
    let sc = sender_config(ChannelKind::Tcp, mode, 16);
    let receiver = Arc::new(Receiver::start(&rc, 0).unwrap());
    let sender = Arc::new(Sender::start(&sc, 0, Default::default()).unwrap());
    let saves = SaveQueue::new(Arc::clone(&sender)).unwrap();
    let loads = LoadQueue::new(Arc::clone(&receiver)).unwrap();

    let spec = KvCacheSpec::for_layout(&sc.chunk_layout(), 8, 8);
    let mut prefill = KvCache::host(spec).unwrap();
    let mut plane = vec![0u8; spec.plane_bytes()];
    for layer in 0..spec.layers {
        for p in 0..spec.planes() {
            pattern::fill(&mut plane, (layer * 10 + p + 1) as u64);
            prefill.write(spec.offset(layer, p, 0), &plane).unwrap();
        }
    }
    let prefill = SharedKvCache::new(prefill);
    let decode = SharedKvCache::new(KvCache::host(spec).unwrap());
    let from = |t: usize| t as i64;
    let to = |t: usize| (spec.slots() - 1 - t) as i64;

    // A save with a padding slot is refused at submit, naming the token;
    // nothing is gathered or sent.
    let mut padded: Vec<i64> = (0..TOKENS).map(from).collect();
    padded[7] = -1;
    let e = saves
        .submit(
            SaveRequest {
                keys: req_keys("pad"),
                slot_mapping: padded,
                spec: spec_for(&rc, "pad", true),
            },
            &prefill,
        )
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("token 7") && e.contains("padding"),
        "{what}: {e}"
    );
    assert_eq!(saves.in_flight(), (0, 0), "{what}");

    // Three requests of the same tokens, saved whole.
    for name in ["long", "swapped", "good"] {
        saves
            .submit(
                SaveRequest {
                    keys: req_keys(name),
                    slot_mapping: (0..TOKENS).map(from).collect(),
                    spec: spec_for(&rc, name, true),
                },
                &prefill,
            )
            .unwrap();
    }
    let done = poll_until(|| saves.poll(), 3);
    assert!(
        done.len() == 3 && done.iter().all(|c| c.outcome == Outcome::Done),
        "{what}: {done:?}"
    );
    for name in ["long", "swapped", "good"] {
        let k = req_keys(name);
        assert!(
            eventually(Duration::from_secs(30), || loads.available(&k)
                == Availability::Ready),
            "{what}: {name} never became loadable"
        );
    }

    // A slot mapping longer than what is stored (the same chunk count):
    // the last chunk holds 5 tokens, the mapping gives it CHUNK - 1.
    let long = TOKENS + CHUNK - 6;
    let cases = [
        ("long", req_keys("long"), long, "holds 5 token(s)"),
        // The keys in the wrong order: the first chunk is not full.
        (
            "swapped",
            req_keys("swapped").into_iter().rev().collect(),
            TOKENS,
            "a chunk before the last must be full",
        ),
    ];
    for (name, keys, n, says) in cases {
        loads
            .submit(
                LoadRequest {
                    req_id: name.into(),
                    keys,
                    slot_mapping: (0..n).map(to).collect(),
                },
                &decode,
            )
            .unwrap();
        let got = poll_until(|| loads.poll(), 1);
        assert_eq!(got.len(), 1, "{what}: {name}");
        match &got[0].outcome {
            Outcome::Failed(e) => assert!(e.contains(says), "{what}: {name}: {e}"),
            other => panic!("{what}: {name} loaded with a mismatched slot mapping: {other:?}"),
        }
        assert!(
            is_zero(&decode),
            "{what}: {name}: bytes moved before the refusal"
        );
    }

    // The matching load of the same data is done, every byte where it goes.
    loads
        .submit(
            LoadRequest {
                req_id: "good".into(),
                keys: req_keys("good"),
                slot_mapping: (0..TOKENS).map(to).collect(),
            },
            &decode,
        )
        .unwrap();
    let got = poll_until(|| loads.poll(), 1);
    assert_eq!(got[0].outcome, Outcome::Done, "{what}: {got:?}");
    {
        let (mut src, mut dst) = (prefill.lock(), decode.lock());
        for l in 0..spec.layers {
            for p in 0..spec.planes() {
                for t in 0..TOKENS {
                    assert_eq!(
                        src.token(l, p, from(t) as usize).unwrap(),
                        dst.token(l, p, to(t) as usize).unwrap(),
                        "{what}: token {t} layer {l} plane {p}"
                    );
                }
            }
        }
    }

    // The refused requests' pages, like the loaded one's, are back.
    assert!(
        eventually(Duration::from_secs(30), || {
            let s = receiver.stats().pools.cpu.unwrap();
            s.free == s.total && s.pinned == 0 && s.quarantined == 0
        }),
        "{what}: receiver pool {:?}",
        receiver.stats().pools
    );
    assert!(sender.drain(Duration::from_secs(30)), "{what}");
    assert!(
        eventually(Duration::from_secs(30), || {
            let s = sender.stats().pools.cpu.unwrap();
            s.free == s.total && s.pinned == 0 && s.quarantined == 0
        }),
        "{what}: sender pool {:?}",
        sender.stats().pools
    );
}

#[test]
fn push_refuses_slot_mappings_that_do_not_match_the_stored_tokens() {
    mismatched_slot_mappings_are_refused(TransferMode::Push);
}

#[test]
fn pull_delay_refuses_slot_mappings_that_do_not_match_the_stored_tokens() {
    mismatched_slot_mappings_are_refused(TransferMode::PullDelay);
}
