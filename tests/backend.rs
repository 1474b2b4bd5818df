//! The sender and receiver backends over real sockets on loopback: every
//! mode over shm and tcp, dedup, partial chunks, breaker, TTL release,
//! dead peers, the Done-before-ack race and malformed frames. Every byte
//! is verified at the receiver and pool counters return to their start.

mod common;

use ascend_pd::backend::{BackendError, MessageKind, PutOutcome, Receiver, Sender};
use ascend_pd::channel::handshake::{self, HandshakeServer, Hello};
use ascend_pd::channel::{self as chan};
use ascend_pd::config::{ChannelKind, PortList, Role, TransferMode};
use ascend_pd::memory::{ChunkMeta, DualAllocator, DualSpec, MemObj, PoolKind};
use ascend_pd::protocol::{
    BreakerState, Message, PullDoneSignal, PullReadyDoneAck, PullReadyNotif,
};
use common::*;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const CHANNELS: [ChannelKind; 2] = [ChannelKind::Shm, ChannelKind::Tcp];
const MODES: [TransferMode; 3] = [
    TransferMode::Push,
    TransferMode::PullEager,
    TransferMode::PullDelay,
];

fn msg(stats: &[(MessageKind, u64)], kind: MessageKind) -> u64 {
    stats
        .iter()
        .find(|(k, _)| *k == kind)
        .map_or(0, |(_, n)| *n)
}

/// Takes every key's chunk from the receiver (fetching proxies), checks
/// its bytes, and removes it.
fn consume_and_verify(
    r: &Receiver,
    mode: TransferMode,
    ks: &[String],
    last_tokens: &[(usize, usize)],
) {
    let got: Vec<(String, ascend_pd::memory::SealedMemObj)> = match mode {
        TransferMode::PullDelay => r.fetch(ks).unwrap(),
        _ => ks
            .iter()
            .map(|k| {
                let o = r
                    .get_wait(k, Duration::from_secs(10))
                    .unwrap_or_else(|| panic!("{mode:?}: {k} never landed"));
                (k.clone(), o)
            })
            .collect(),
    };
    for (i, (k, o)) in got.iter().enumerate() {
        assert!(holds(o, k), "{mode:?}: bytes of {k} differ");
        let expect = last_tokens
            .iter()
            .find(|(idx, _)| *idx == i)
            .map_or(CHUNK, |(_, t)| *t);
        assert_eq!(o.tokens(), expect, "{mode:?}: {k} token count");
    }
    drop(got);
    for k in ks {
        r.remove(k);
    }
}

#[test]
fn request_streams_with_dedup_and_partial_chunks_arrive_byte_exact() {
    for ch in CHANNELS {
        for mode in MODES {
            let (r, rc, s) = pair(ch, mode, 64);
            let r_start = r.stats().pools.cpu.unwrap();
            // Request 1: six chunks, the last one partial.
            let k1 = keys("req1", 6);
            let c1 = chunks(&s, &k1, 7);
            let out = s.put(&k1, &c1, &spec_for(&rc, "req1", true)).unwrap();
            assert!(
                matches!(
                    out,
                    PutOutcome::Pushed { written: 6, .. }
                        | PutOutcome::Announced { announced: 6, .. }
                ),
                "{ch:?} {mode:?}: {out:?}"
            );
            drop(c1);
            // Request 2 re-sends three of request 1's keys: they are skipped.
            let mut k2: Vec<String> = k1[..3].to_vec();
            k2.extend(keys("req2", 3));
            let c2 = chunks(&s, &k2, CHUNK);
            let out = s.put(&k2, &c2, &spec_for(&rc, "req2", true)).unwrap();
            match &out {
                PutOutcome::Pushed {
                    written,
                    already_present,
                } => {
                    assert_eq!((*written, *already_present), (3, 3), "{ch:?}")
                }
                PutOutcome::Announced {
                    announced,
                    already_present,
                    ..
                } => {
                    assert_eq!((*announced, *already_present), (3, 3), "{ch:?} {mode:?}")
                }
                other => panic!("{ch:?} {mode:?}: {other:?}"),
            }
            drop(c2);
            assert!(r.stats().store.dedup_hits >= 3);
            consume_and_verify(&r, mode, &k1, &[(5, 7)]);
            consume_and_verify(&r, mode, &k2[3..], &[]);
            // Every pin is released by PullDoneSignal, every page is back.
            assert!(
                s.drain(Duration::from_secs(10)),
                "{ch:?} {mode:?}: {:?}",
                s.stats().pulls
            );
            assert_no_pages(
                s.stats().pools.cpu.unwrap(),
                &format!("{ch:?} {mode:?} sender"),
            );
            let rp = r.stats().pools.cpu.unwrap();
            assert_eq!(rp.allocated, r_start.allocated, "{ch:?} {mode:?} receiver");
            assert_eq!(rp.quarantined, 0, "{ch:?} {mode:?} receiver");
            if mode.is_pull() {
                assert_eq!(s.stats().pulls.done_released, 2, "{ch:?} {mode:?}");
            }
        }
    }
}

#[test]
fn alloc_failure_opens_the_breaker_which_closes_after_the_ttl() {
    for mode in [TransferMode::Push, TransferMode::PullEager] {
        let mut rc = receiver_config(ChannelKind::Tcp, mode, 4);
        rc.alloc_fail_backoff_ttl = Duration::from_millis(100);
        let r = Receiver::start(&rc, 0).unwrap();
        let mut sc = sender_config(ChannelKind::Tcp, mode, 64);
        sc.alloc_fail_backoff_ttl = Duration::from_millis(400);
        let s = Sender::start(&sc, 0, Default::default()).unwrap();
        let peer_key = format!("127.0.0.1:{}", rc.alloc_port(0).unwrap());
        // Eight chunks into a four-page receiver: it rolls back and says so.
        let big = keys("big", 8);
        let c = chunks(&s, &big, CHUNK);
        let out = s.put(&big, &c, &spec_for(&rc, "big", true)).unwrap();
        assert_eq!(out, PutOutcome::ReceiverAllocFailed, "{mode:?}");
        assert!(matches!(
            s.breaker_state(&peer_key),
            BreakerState::Open { .. }
        ));
        assert_no_pages(r.stats().pools.cpu.unwrap(), "rolled back");
        assert_eq!(
            s.stats().pools.cpu.unwrap().pinned,
            0,
            "{mode:?}: pins released"
        );
        assert!(!r.contains(&big[0]));
        // While open, puts to that receiver are skipped without a message.
        let sent_before = msg(&s.stats().messages, MessageKind::AllocRequest)
            + msg(&s.stats().messages, MessageKind::PullReadyNotif);
        let small = keys("small", 2);
        let c2 = chunks(&s, &small, CHUNK);
        let out = s.put(&small, &c2, &spec_for(&rc, "small", true)).unwrap();
        assert_eq!(out, PutOutcome::SkippedBreakerOpen);
        let sent_after = msg(&s.stats().messages, MessageKind::AllocRequest)
            + msg(&s.stats().messages, MessageKind::PullReadyNotif);
        assert_eq!(sent_before, sent_after, "nothing sent while open");
        assert_eq!(msg(&s.stats().messages, MessageKind::BreakerSkip), 1);
        // After the TTL the breaker closes and the same put goes through.
        std::thread::sleep(Duration::from_millis(450));
        assert_eq!(s.breaker_state(&peer_key), BreakerState::Closed);
        let out = s.put(&small, &c2, &spec_for(&rc, "small", true)).unwrap();
        assert!(
            matches!(
                out,
                PutOutcome::Pushed { written: 2, .. } | PutOutcome::Announced { announced: 2, .. }
            ),
            "{mode:?}: {out:?}"
        );
        drop((c, c2));
        consume_and_verify(&r, mode, &small, &[]);
        assert!(s.drain(Duration::from_secs(10)));
        assert_no_pages(s.stats().pools.cpu.unwrap(), "sender pool");
        assert_eq!(s.stats().breaker.opens, 1);
    }
}

#[test]
fn a_sender_waiting_for_pages_never_delays_another_senders_request() {
    for mode in [TransferMode::Push, TransferMode::PullEager] {
        let mut rc = receiver_config(ChannelKind::Tcp, mode, 8);
        // Long enough that the test would see it: under a blocking loop,
        // b's second put would wait for a's 60 s.
        rc.alloc_fail_backoff_ttl = Duration::from_secs(60);
        let r = Receiver::start(&rc, 0).unwrap();
        let start = r.stats().pools.cpu.unwrap();
        let a = Sender::start(
            &sender_config(ChannelKind::Tcp, mode, 16),
            0,
            Default::default(),
        )
        .unwrap();
        let b = Sender::start(
            &sender_config(ChannelKind::Tcp, mode, 16),
            0,
            Default::default(),
        )
        .unwrap();
        // b fills six of the receiver's eight pages (resident until removed).
        let fill = keys("fill", 6);
        let cf = chunks(&b, &fill, CHUNK);
        b.put(&fill, &cf, &spec_for(&rc, "fill", true)).unwrap();
        assert!(eventually(Duration::from_secs(10), || fill.iter().all(
            |k| r.state(k) == Some(ascend_pd::protocol::KeyState::Resident)
        )));
        let waits = keys("waits", 4);
        let one = keys("one", 1);
        // a asks for four pages; two are free, so its request waits.
        let ca = chunks(&a, &waits, CHUNK);
        std::thread::scope(|scope| {
            let a_put = scope.spawn(|| a.put(&waits, &ca, &spec_for(&rc, "waits", true)).unwrap());
            assert!(
                eventually(Duration::from_secs(10), || r.stats().waiting_for_pages == 1),
                "{mode:?}: a's request never waited for pages"
            );
            // b's one-page request is answered while a's still waits.
            let c1 = chunks(&b, &one, CHUNK);
            let out = b.put(&one, &c1, &spec_for(&rc, "one", true)).unwrap();
            assert!(
                matches!(
                    out,
                    PutOutcome::Pushed { written: 1, .. }
                        | PutOutcome::Announced { announced: 1, .. }
                ),
                "{mode:?}: {out:?}"
            );
            assert!(
                !a_put.is_finished(),
                "{mode:?}: a's put ended before pages were freed"
            );
            assert_eq!(r.stats().waiting_for_pages, 1, "{mode:?}");
            // Freeing b's first pages lets a's request through.
            for k in &fill {
                assert!(r.remove(k), "{mode:?}: {k}");
            }
            let out = a_put.join().unwrap();
            assert!(
                matches!(
                    out,
                    PutOutcome::Pushed { written: 4, .. }
                        | PutOutcome::Announced { announced: 4, .. }
                ),
                "{mode:?}: {out:?}"
            );
        });
        // The receiver publishes its wait queue's length after the retry
        // that answered a's request: a moment after a's put returned.
        assert!(
            eventually(Duration::from_secs(10), || r.stats().waiting_for_pages == 0),
            "{mode:?}: a's request still counted as waiting"
        );
        consume_and_verify(&r, mode, &waits, &[]);
        consume_and_verify(&r, mode, &one, &[]);
        drop((cf, ca));
        assert!(a.drain(Duration::from_secs(10)) && b.drain(Duration::from_secs(10)));
        for s in [&a, &b] {
            assert_no_pages(s.stats().pools.cpu.unwrap(), &format!("{mode:?} sender"));
        }
        let end = r.stats().pools.cpu.unwrap();
        assert_eq!(
            (end.allocated, end.quarantined),
            (start.allocated, 0),
            "{mode:?} receiver"
        );
    }
}

#[test]
fn a_receiver_that_dies_mid_pull_has_its_pins_released_at_the_ttl() {
    let rc = receiver_config(ChannelKind::Tcp, TransferMode::PullDelay, 32);
    let r = Receiver::start(&rc, 0).unwrap();
    let mut sc = sender_config(ChannelKind::Tcp, TransferMode::PullDelay, 32);
    sc.pull_pending_ttl = Duration::from_millis(600);
    let s = Sender::start(&sc, 0, Default::default()).unwrap();
    let ks = keys("orphan", 5);
    let c = chunks(&s, &ks, 3);
    let out = s.put(&ks, &c, &spec_for(&rc, "orphan", true)).unwrap();
    assert!(matches!(out, PutOutcome::Announced { announced: 5, .. }));
    drop(c);
    assert_eq!(s.stats().pools.cpu.unwrap().pinned, 5);
    // The receiver goes away without reading or sending Done.
    r.close();
    let released = eventually(Duration::from_secs(10), || {
        s.stats().pools.cpu.unwrap().pinned == 0
    });
    assert!(released, "{:?}", s.stats().pulls);
    assert_eq!(s.stats().pulls.expired, 1);
    assert_no_pages(s.stats().pools.cpu.unwrap(), "sender pool");
}

/// Chunks pushed for requests the decode engine never loads nor cancels
/// (it dropped them) go back to the pool at `pd_resident_ttl`; a late
/// fetch says why they are gone. In push and pull-eager alike.
#[test]
fn landed_chunks_nobody_loads_go_back_to_the_pool_at_the_resident_ttl() {
    for mode in [TransferMode::Push, TransferMode::PullEager] {
        let mut rc = receiver_config(ChannelKind::Shm, mode, 32);
        rc.resident_ttl = Duration::from_millis(400);
        let r = Receiver::start(&rc, 0).unwrap();
        let s = Sender::start(
            &sender_config(ChannelKind::Shm, mode, 32),
            0,
            Default::default(),
        )
        .unwrap();
        let ks = keys("abandoned", 4);
        let c = chunks(&s, &ks, CHUNK);
        s.put(&ks, &c, &spec_for(&rc, "abandoned", true)).unwrap();
        drop(c);
        assert!(
            eventually(Duration::from_secs(10), || ks.iter().all(|k| r.contains(k))),
            "{mode:?}: the chunks landed"
        );
        assert!(
            eventually(Duration::from_secs(10), || !ks
                .iter()
                .any(|k| r.contains(k))),
            "{mode:?}: still held after the TTL: {:?}",
            r.stats().store
        );
        assert_eq!(r.stats().store.expired_resident, 4, "{mode:?}");
        assert_no_pages(r.stats().pools.cpu.unwrap(), "receiver pool");
        let e = r.fetch(&ks).unwrap_err().to_string();
        assert!(e.contains("pd_resident_ttl"), "{e}");
        assert!(s.drain(Duration::from_secs(10)));
        assert_no_pages(s.stats().pools.cpu.unwrap(), "sender pool");
    }
}

#[test]
fn a_sender_that_dies_during_delay_pull_fails_the_fetch_without_a_hang() {
    let (r, rc, s) = pair(ChannelKind::Tcp, TransferMode::PullDelay, 32);
    let ks = keys("gone", 3);
    let c = chunks(&s, &ks, CHUNK);
    s.put(&ks, &c, &spec_for(&rc, "gone", true)).unwrap();
    drop(c);
    drop(s);
    let start = Instant::now();
    let e = r.fetch(&ks).unwrap_err();
    assert!(start.elapsed() < Duration::from_secs(60), "bounded");
    assert_eq!(e.failed.len(), 3, "{e}");
    assert!(e.to_string().contains("gone-0"), "{e}");
    // The proxies were discarded and their pages (none held) are not leaked.
    assert!(!r.contains(&ks[0]));
    assert_no_pages(r.stats().pools.cpu.unwrap(), "receiver pool");
    assert_eq!(r.stats().store.contexts_open, 0);
}

/// A receiver built by hand: the real channel and handshake server, but a
/// raw REP socket for allocation whose behaviour the test scripts.
struct ScriptedReceiver {
    alloc_url: String,
    rc: ascend_pd::config::PdConfig,
    _alloc: DualAllocator,
    _hs: HandshakeServer,
}

fn scripted_receiver(mode: TransferMode) -> ScriptedReceiver {
    let rc = receiver_config(ChannelKind::Tcp, mode, 8);
    let alloc = DualAllocator::new(&ascend_pd::backend::pools::pool_spec(&rc, 0), None).unwrap();
    let pools: Vec<_> = alloc.pools().cloned().collect();
    let ch = chan::open(ChannelKind::Tcp, "127.0.0.1", "scripted", &pools, None).unwrap();
    let hello = Hello::local(
        "scripted",
        Role::Receiver,
        mode,
        Duration::from_secs(60),
        ch.as_ref(),
    );
    let (tx, rx) = crossbeam_channel::unbounded();
    std::thread::spawn(move || for _ in rx {});
    let ctx = zmq::Context::new();
    let hs = HandshakeServer::spawn(
        &ctx,
        &format!("tcp://127.0.0.1:{}", rc.init_port(0).unwrap()),
        ch,
        hello,
        tx,
    )
    .unwrap();
    ScriptedReceiver {
        alloc_url: format!("tcp://127.0.0.1:{}", rc.alloc_port(0).unwrap()),
        rc,
        _alloc: alloc,
        _hs: hs,
    }
}

#[test]
fn done_before_ack_releases_the_pins_once() {
    let fake = scripted_receiver(TransferMode::PullEager);
    let url = fake.alloc_url.clone();
    let server = std::thread::spawn(move || {
        let ctx = zmq::Context::new();
        let rep = ctx.socket(zmq::REP).unwrap();
        rep.bind(&url).unwrap();
        rep.set_rcvtimeo(10_000).unwrap();
        let frame = rep.recv_bytes(0).unwrap();
        let notif = PullReadyNotif::decode(&frame).unwrap();
        // Done first, on the PUSH socket, then the ack after a pause.
        let push = ctx.socket(zmq::PUSH).unwrap();
        push.connect(&format!("tcp://{}", notif.sender_done_url))
            .unwrap();
        push.send(
            Message::PullDoneSignal(PullDoneSignal {
                pull_id: notif.pull_id.clone(),
            })
            .encode(),
            0,
        )
        .unwrap();
        std::thread::sleep(Duration::from_millis(200));
        rep.send(
            Message::PullReadyDoneAck(PullReadyDoneAck {
                already_sent_indexes: vec![],
                alloc_failed: false,
            })
            .encode(),
            0,
        )
        .unwrap();
        std::thread::sleep(Duration::from_millis(300));
    });
    let sc = sender_config(ChannelKind::Tcp, TransferMode::PullEager, 16);
    let s = Sender::start(&sc, 0, Default::default()).unwrap();
    let ks = keys("race", 3);
    let c = chunks(&s, &ks, CHUNK);
    let out = s.put(&ks, &c, &spec_for(&fake.rc, "race", true)).unwrap();
    drop(c);
    assert!(matches!(out, PutOutcome::Announced { .. }), "{out:?}");
    assert!(eventually(Duration::from_secs(5), || s
        .stats()
        .pools
        .cpu
        .unwrap()
        .pinned
        == 0));
    let p = s.stats().pulls;
    assert_eq!(p.done_released, 1, "{p:?}");
    assert_eq!(p.done_before_ack, 1, "{p:?}");
    assert_no_pages(s.stats().pools.cpu.unwrap(), "sender pool");
    server.join().unwrap();
}

#[test]
fn a_dead_receiver_does_not_block_puts_to_another() {
    // Receiver A handshakes but never answers on its allocation socket.
    let dead = scripted_receiver(TransferMode::Push);
    let ctx = zmq::Context::new();
    let silent = ctx.socket(zmq::REP).unwrap();
    silent.bind(&dead.alloc_url).unwrap();
    let (live, live_rc) = {
        let rc = receiver_config(ChannelKind::Tcp, TransferMode::Push, 16);
        (Receiver::start(&rc, 0).unwrap(), rc)
    };
    let sc = sender_config(ChannelKind::Tcp, TransferMode::Push, 32);
    let timeouts = ascend_pd::backend::SenderTimeouts {
        request: Duration::from_millis(1500),
        ..Default::default()
    };
    let s = Arc::new(Sender::start(&sc, 0, timeouts).unwrap());
    let dead_done = Arc::new(AtomicBool::new(false));
    let (s2, flag, spec) = (
        Arc::clone(&s),
        Arc::clone(&dead_done),
        spec_for(&dead.rc, "a", true),
    );
    let blocked = std::thread::spawn(move || {
        let ks = keys("to-dead", 2);
        let c = chunks(&s2, &ks, CHUNK);
        let r = s2.put(&ks, &c, &spec);
        flag.store(true, Ordering::SeqCst);
        r
    });
    std::thread::sleep(Duration::from_millis(100));
    let ks = keys("to-live", 2);
    let c = chunks(&s, &ks, CHUNK);
    s.put(&ks, &c, &spec_for(&live_rc, "b", true)).unwrap();
    assert!(
        !dead_done.load(Ordering::SeqCst),
        "the put to the live receiver finished while the dead one was still waiting"
    );
    let o = live.get_wait(&ks[0], Duration::from_secs(5)).unwrap();
    assert!(holds(&o, &ks[0]));
    let e = blocked.join().unwrap().unwrap_err();
    assert!(matches!(e, BackendError::Timeout { .. }), "{e}");
    assert!(e.to_string().contains("socket was reset"), "{e}");
    assert!(msg(&s.stats().messages, MessageKind::Timeout) >= 1);
    drop((o, c));
    // The request socket was replaced: the next put fails the same clean way.
    let ks = keys("to-dead-again", 1);
    let c = chunks(&s, &ks, CHUNK);
    assert!(s.put(&ks, &c, &spec_for(&dead.rc, "c", true)).is_err());
    drop(c);
    assert_no_pages(s.stats().pools.cpu.unwrap(), "sender pool");
}

/// Deterministic garbage: random bytes, truncations and bit flips of real frames.
fn garbage(n: usize) -> Vec<Vec<u8>> {
    let real = [
        Message::PullDoneSignal(PullDoneSignal {
            pull_id: "x".repeat(32),
        })
        .encode(),
        Message::PullReadyDoneAck(PullReadyDoneAck {
            already_sent_indexes: vec![1, 2],
            alloc_failed: false,
        })
        .encode(),
    ];
    let mut x = 0x1234_5678_9abc_def0u64;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    (0..n)
        .map(|i| match i % 3 {
            0 => (0..(next() % 64) as usize).map(|_| next() as u8).collect(),
            1 => {
                let f = &real[i % real.len()];
                f[..(next() as usize % f.len())].to_vec()
            }
            _ => {
                let mut f = real[i % real.len()].clone();
                let j = next() as usize % f.len();
                f[j] ^= 1 << (next() % 8);
                f
            }
        })
        .collect()
}

#[test]
fn malformed_frames_on_every_socket_leave_both_sides_serving() {
    for mode in [TransferMode::Push, TransferMode::PullDelay] {
        let (r, rc, s) = pair(ChannelKind::Tcp, mode, 32);
        let ctx = zmq::Context::new();
        let frames = garbage(60);
        for (port, is_alloc) in [
            (rc.alloc_port(0).unwrap(), true),
            (rc.init_port(0).unwrap(), false),
        ] {
            let req = ctx.socket(zmq::REQ).unwrap();
            req.set_rcvtimeo(5000).unwrap();
            req.set_linger(0).unwrap();
            req.connect(&format!("tcp://127.0.0.1:{port}")).unwrap();
            for f in &frames {
                req.send(&f[..], 0).unwrap();
                let reply = req.recv_bytes(0).expect("every frame gets a reply");
                if is_alloc {
                    // An error reply the sender side understands as a failure.
                    match Message::decode(&reply).unwrap() {
                        Message::AscendAllocResponse(a) => assert!(a.alloc_failed),
                        Message::PullReadyDoneAck(a) => assert!(a.alloc_failed),
                        other => panic!("{other:?}"),
                    }
                } else {
                    // A refusal, never the table.
                    assert!(Hello::decode(&reply).is_err());
                    let why = handshake::refusal_reason(&reply).expect("a refusal");
                    assert!(!why.is_empty());
                }
            }
        }
        if mode.is_pull() {
            let push = ctx.socket(zmq::PUSH).unwrap();
            push.set_linger(1000).unwrap();
            let done_port = match s_done_port(&s) {
                Some(p) => p,
                None => panic!("pull sender has a done port"),
            };
            push.connect(&format!("tcp://127.0.0.1:{done_port}"))
                .unwrap();
            for f in &frames {
                push.send(&f[..], 0).unwrap();
            }
            assert!(eventually(Duration::from_secs(5), || {
                msg(&s.stats().messages, MessageKind::Malformed)
                    + msg(&s.stats().messages, MessageKind::PullDoneSignal)
                    >= 40
            }));
        }
        assert!(msg(&r.stats().messages, MessageKind::Malformed) >= 40);
        // Both sides still work.
        let ks = keys("after-fuzz", 3);
        let c = chunks(&s, &ks, 9);
        s.put(&ks, &c, &spec_for(&rc, "ok", true)).unwrap();
        drop(c);
        consume_and_verify(&r, mode, &ks, &[(2, 9)]);
        assert!(s.drain(Duration::from_secs(10)));
        assert_no_pages(s.stats().pools.cpu.unwrap(), "sender pool");
        assert_no_pages(r.stats().pools.cpu.unwrap(), "receiver pool");
    }
}

fn s_done_port(s: &Sender) -> Option<u16> {
    s.done_port()
}

#[test]
fn bad_puts_are_refused_by_name_and_send_nothing() {
    let (_r, rc, s) = pair(ChannelKind::Tcp, TransferMode::Push, 16);
    let ks = keys("bad", 2);
    let c = chunks(&s, &ks, CHUNK);
    let spec = spec_for(&rc, "bad", false);
    let e = s.put(&ks[..1], &c, &spec).unwrap_err();
    assert!(e.to_string().contains("1 keys but 2 chunks"), "{e}");
    let e = s
        .put(&[ks[0].clone(), ks[0].clone()], &c, &spec)
        .unwrap_err();
    assert!(e.to_string().contains("repeated"), "{e}");
    // A partial chunk that is not the last.
    let mut partial = s.allocate(&[3, CHUNK]).unwrap();
    for (o, k) in partial.iter_mut().zip(&ks) {
        ascend_pd::memory::pattern::fill(o.host_bytes_mut().unwrap(), seed_of(k));
    }
    let partial: Vec<_> = partial.into_iter().map(MemObj::seal).collect();
    let e = s.put(&ks, &partial, &spec).unwrap_err();
    assert!(e.to_string().contains("only the last chunk may be"), "{e}");
    // A page that is not from this sender's pools.
    let other = DualAllocator::new(
        &DualSpec {
            cpu_bytes: Some(1 << 16),
            npu: None,
            page_size: s.chunk_layout().page_bytes(),
            placement: PoolKind::Cpu,
            shareable_cpu: false,
        },
        None,
    )
    .unwrap();
    let foreign: Vec<_> = other
        .allocate_batch(&[ChunkMeta::full(s.chunk_layout()); 2])
        .unwrap()
        .into_iter()
        .map(MemObj::seal)
        .collect();
    let e = s.put(&ks, &foreign, &spec).unwrap_err();
    assert!(
        e.to_string().contains("not a page of this sender's pools"),
        "{e}"
    );
    // A rank the spec has no port for.
    let mut short = spec.clone();
    short.receiver_alloc_port = PortList::PerRank(vec![]);
    assert!(s.put(&ks, &c, &short).is_err());
    assert_eq!(msg(&s.stats().messages, MessageKind::AllocRequest), 0);
}

#[test]
fn a_batch_above_the_high_water_mark_is_an_error_not_a_deadlock() {
    let (_r, rc, s) = pair(ChannelKind::Tcp, TransferMode::PullEager, 10);
    // 10 pages at 2% reserve: high-water 9 pinned pages. A 10-chunk batch can never fit.
    let ks = keys("huge", 10);
    let c = chunks(&s, &ks, CHUNK);
    let start = Instant::now();
    let e = s.put(&ks, &c, &spec_for(&rc, "huge", true)).unwrap_err();
    assert!(matches!(e, BackendError::Backpressure(_)), "{e}");
    assert!(e.to_string().contains("can never fit"), "{e}");
    assert!(start.elapsed() < Duration::from_secs(5));
    drop(c);
    assert_eq!(s.stats().pools.cpu.unwrap().pinned, 0);
}

#[test]
fn a_sender_process_killed_during_shm_delay_pull_fails_the_fetch_without_a_hang() {
    use std::io::BufRead;
    // shm keeps the peer's memfd mapped after it dies, so only a real
    // process death (seen through its pidfd) can prove the fetch refuses.
    let rc = receiver_config(ChannelKind::Shm, TransferMode::PullDelay, 32);
    let r = Receiver::start(&rc, 0).unwrap();
    let sc = sender_config(ChannelKind::Shm, TransferMode::PullDelay, 32);
    let dir = std::env::temp_dir().join(format!("ascend-pd-kill-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let yaml = dir.join("sender.yaml");
    std::fs::write(&yaml, sc.to_effective_yaml()).unwrap();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_ascend-bench"))
        .args([
            "sender",
            "--config",
            yaml.to_str().unwrap(),
            "--receiver",
            "127.0.0.1",
        ])
        .arg(format!("--init-port={}", rc.init_port(0).unwrap()))
        .arg(format!("--alloc-port={}", rc.alloc_port(0).unwrap()))
        .args([
            "--requests",
            "1",
            "--prompt-tokens",
            "48",
            "--prefix",
            "killme",
        ])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert!(line.contains("\"announced\""), "{line}");
    let ks: Vec<String> = (0..3).map(|i| format!("killme-0/{i}")).collect();
    assert!(ks.iter().all(|k| r.contains(k)));
    child.kill().unwrap();
    child.wait().unwrap();
    let start = Instant::now();
    let e = r.fetch(&ks).unwrap_err();
    assert!(start.elapsed() < Duration::from_secs(30), "bounded");
    assert_eq!(e.failed.len(), 3, "{e}");
    assert!(
        e.to_string().contains("exited"),
        "the pidfd saw the death: {e}"
    );
    assert_no_pages(r.stats().pools.cpu.unwrap(), "pages returned");
    assert_eq!(r.stats().store.contexts_open, 0);
    // The dead sender's attachment goes too (its pool unmapped).
    assert!(
        eventually(Duration::from_secs(10), || r.stats().peers == 0),
        "{} sender(s) still attached",
        r.stats().peers
    );
    // Counted just after the attachment goes (the sweep detaches, then counts).
    assert!(
        eventually(Duration::from_secs(10), || r.stats().senders_gone == 1),
        "senders_gone {}",
        r.stats().senders_gone
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// A receiver process that dies holding pull-delay proxies never sends
/// their Done: the sender sees the death (shm: its pidfd) and releases the
/// pins at once, not at pd_pull_pending_ttl, and drops the attachment
/// (unmapping the dead receiver's pool); the next put attaches afresh.
#[test]
fn a_receiver_process_that_dies_has_its_pins_released_without_waiting_for_the_ttl() {
    let mode = TransferMode::PullDelay;
    let rc = receiver_config(ChannelKind::Shm, mode, 32);
    let dir = std::env::temp_dir().join(format!("ascend-pd-recv-dies-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let yaml = dir.join("receiver.yaml");
    std::fs::write(&yaml, rc.to_effective_yaml()).unwrap();
    let mut child = spawn_receiver(&yaml);
    let mut sc = sender_config(ChannelKind::Shm, mode, 32);
    sc.pull_pending_ttl = Duration::from_secs(600);
    let s = Sender::start(&sc, 0, Default::default()).unwrap();
    let pinned = || s.stats().pools.cpu.unwrap().pinned;
    let ks = keys("orphaned-pins", 3);
    let c = chunks(&s, &ks, CHUNK);
    let out = s.put(&ks, &c, &spec_for(&rc, "orphaned-pins", false));
    assert!(
        matches!(out, Ok(PutOutcome::Announced { announced: 3, .. })),
        "{out:?}"
    );
    drop(c);
    // A live receiver is never taken for dead: several sweeps later the
    // pins still wait for its Done.
    std::thread::sleep(Duration::from_millis(800));
    assert_eq!(pinned(), 3);
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(
        eventually(Duration::from_secs(10), || pinned() == 0),
        "pins still held: {:?}",
        s.stats().pulls
    );
    assert!(s.drain(Duration::from_secs(10)));
    assert_no_pages(s.stats().pools.cpu.unwrap(), "sender pool");
    // A receiver started again on those ports gets the next put: the
    // sender attaches afresh.
    let mut child = spawn_receiver(&yaml);
    let ks = keys("after-death", 2);
    let c = chunks(&s, &ks, CHUNK);
    let out = s.put(&ks, &c, &spec_for(&rc, "after-death", false));
    assert!(
        matches!(out, Ok(PutOutcome::Announced { announced: 2, .. })),
        "{out:?}"
    );
    drop(c);
    child.kill().unwrap();
    child.wait().unwrap();
    let _ = std::fs::remove_dir_all(dir);
}

/// An `ascend-bench receiver` process on `yaml`, once it says it is ready.
fn spawn_receiver(yaml: &std::path::Path) -> std::process::Child {
    use std::io::BufRead;
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_ascend-bench"))
        .args(["receiver", "--config"])
        .arg(yaml)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert!(line.contains("receiver_ready"), "{line}");
    child
}

#[test]
fn starting_with_the_wrong_role_or_an_invalid_config_names_the_key() {
    let sc = sender_config(ChannelKind::Tcp, TransferMode::Push, 4);
    let e = Receiver::start(&sc, 0).err().unwrap().to_string();
    assert!(e.contains("pd_role") && e.contains("sender config"), "{e}");
    let mut rc = receiver_config(ChannelKind::Tcp, TransferMode::Push, 4);
    let e = Sender::start(&rc, 0, Default::default())
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("pd_role") && e.contains("receiver config"),
        "{e}"
    );
    rc.delay_pull = true;
    let e = Receiver::start(&rc, 0).err().unwrap().to_string();
    assert!(
        e.contains("pd_delay_pull") && e.contains("pd_pull_mode: true"),
        "{e}"
    );
    // The same ports are free again: nothing was bound by the failed starts.
    rc.delay_pull = false;
    let r = Receiver::start(&rc, 0).unwrap();
    drop(r);
}

/// A receiver that restarts (same ports, new process state: new buffer
/// uuids, no attachments) is recognised on the very next put: the refusal
/// from the new process makes the sender attach again, the new
/// incarnation in the handshake says it restarted, and the put goes
/// through — no failed request, no breaker. Pulls announced to the old
/// process (a pull-delay request nobody loaded) are released then, not at
/// their TTL. Before, the first put after a restart failed and opened the
/// breaker.
#[test]
fn a_restarted_receiver_gets_the_next_put_and_frees_what_the_old_one_held() {
    for ch in CHANNELS {
        for mode in MODES {
            let rc = receiver_config(ch, mode, 16);
            let mut sc = sender_config(ch, mode, 16);
            // Released only by the restart, never by the sweep, in this test.
            sc.pull_pending_ttl = Duration::from_secs(300);
            let s = Sender::start(&sc, 0, Default::default()).unwrap();
            let r = Receiver::start(&rc, 0).unwrap();
            let k = keys("before", 2);
            let c = chunks(&s, &k, CHUNK);
            s.put(&k, &c, &spec_for(&rc, "before", true)).unwrap();
            drop(c);
            consume_and_verify(&r, mode, &k, &[]);
            // A request the old process never loads: its pins wait for a
            // Done that will not come.
            let stranded = keys("stranded", 3);
            let c = chunks(&s, &stranded, CHUNK);
            s.put(&stranded, &c, &spec_for(&rc, "stranded", true))
                .unwrap();
            drop(c);
            drop(r);
            let r = Receiver::start(&rc, 0).unwrap();
            let k = keys("after", 2);
            let c = chunks(&s, &k, CHUNK);
            let out = s.put(&k, &c, &spec_for(&rc, "after", true));
            assert!(
                matches!(
                    out,
                    Ok(PutOutcome::Pushed { written: 2, .. })
                        | Ok(PutOutcome::Announced { announced: 2, .. })
                ),
                "{ch:?} {mode:?}: the first put after the restart: {out:?}"
            );
            drop(c);
            consume_and_verify(&r, mode, &k, &[]);
            let st = s.stats();
            assert_eq!(st.receiver_restarts, 1, "{ch:?} {mode:?}");
            assert_eq!(st.breaker.opens, 0, "{ch:?} {mode:?}: {:?}", st.breaker);
            // Everything of the old process came back well before any TTL.
            assert!(
                s.drain(Duration::from_secs(10)),
                "{ch:?} {mode:?}: pins left"
            );
            assert!(
                eventually(Duration::from_secs(10), || {
                    let p = s.stats().pools.cpu.unwrap();
                    (p.allocated, p.pinned, p.quarantined) == (0, 0, 0)
                }),
                "{ch:?} {mode:?}: sender pages left: {:?}",
                s.stats().pools
            );
            assert_no_pages(r.stats().pools.cpu.unwrap(), "receiver");
            drop(s);
        }
    }
}

/// A pull-delay sender that restarts (same host, done port and rank; new
/// process state) is recognised by the receiver when the new one attaches:
/// the old one's attachment and proxies are dropped at once, a load of a
/// key it announced says its sender restarted, and the new sender's
/// requests load normally. Every receiver page comes back.
#[test]
fn a_restarted_sender_replaces_its_old_attachment_and_its_dead_proxies() {
    for ch in CHANNELS {
        let mode = TransferMode::PullDelay;
        let rc = receiver_config(ch, mode, 16);
        let sc = sender_config(ch, mode, 16);
        let r = Receiver::start(&rc, 0).unwrap();
        let s = Sender::start(&sc, 0, Default::default()).unwrap();
        let old = keys("old-sender", 2);
        let c = chunks(&s, &old, CHUNK);
        s.put(&old, &c, &spec_for(&rc, "old", true)).unwrap();
        drop(c);
        drop(s);
        assert_eq!(r.stats().store.proxies, 2, "{ch:?}");
        let s = Sender::start(&sc, 0, Default::default()).unwrap();
        let new = keys("new-sender", 2);
        let c = chunks(&s, &new, CHUNK);
        s.put(&new, &c, &spec_for(&rc, "new", true)).unwrap();
        drop(c);
        let st = r.stats();
        assert_eq!(st.sender_restarts, 1, "{ch:?}");
        assert_eq!(st.peers, 1, "{ch:?}: the old attachment is gone");
        assert_eq!(st.store.proxies, 2, "{ch:?}: only the new sender's proxies");
        let e = r.fetch(&old).unwrap_err().to_string();
        assert!(e.contains("its sender restarted"), "{ch:?}: {e}");
        consume_and_verify(&r, mode, &new, &[]);
        assert!(s.drain(Duration::from_secs(10)), "{ch:?}");
        assert_no_pages(r.stats().pools.cpu.unwrap(), "receiver");
    }
}

/// Peak resident memory of process `pid` (VmHWM), in bytes.
fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM in /proc/PID/status");
    kb * 1024
}

/// Issue 11: a 96 MiB frame (2 million keys' worth) sent to a receiver's
/// request socket used to be buffered and decoded (its RSS jumped by
/// hundreds of MiB). ZMQ now drops it at the socket, before buffering: the
/// receiver process's peak RSS grows by less than 8 MiB, and it keeps
/// answering other senders.
#[test]
fn an_oversized_frame_is_dropped_at_the_socket_without_growing_the_receiver() {
    let rc = receiver_config(ChannelKind::Tcp, TransferMode::PullDelay, 32);
    assert!(
        rc.max_message_bytes() < 4 << 20,
        "{}",
        rc.max_message_bytes()
    );
    let dir = std::env::temp_dir().join(format!("ascend-pd-big-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let yaml = dir.join("receiver.yaml");
    std::fs::write(&yaml, rc.to_effective_yaml()).unwrap();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_ascend-bench"))
        .args(["receiver", "--config", yaml.to_str().unwrap()])
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let ctx = zmq::Context::new();
    let url = format!("tcp://127.0.0.1:{}", rc.alloc_port(0).unwrap());
    // A small malformed frame always gets an answer: the receiver serves.
    let answers = || {
        let req = ctx.socket(zmq::REQ).unwrap();
        req.set_linger(0).unwrap();
        req.set_rcvtimeo(500).unwrap();
        req.connect(&url).unwrap();
        req.send(&b"\x81\xa4type\xa4junk"[..], 0).unwrap();
        req.recv_bytes(0).is_ok()
    };
    assert!(eventually(Duration::from_secs(20), answers), "receiver up");
    let before = peak_rss(child.id());
    let big = vec![0x91u8; 96 << 20];
    let req = ctx.socket(zmq::REQ).unwrap();
    req.set_linger(0).unwrap();
    req.set_rcvtimeo(2000).unwrap();
    req.connect(&url).unwrap();
    req.send(big, 0).unwrap();
    assert!(
        req.recv_bytes(0).is_err(),
        "no answer: the frame was dropped"
    );
    assert!(answers(), "still serving after the oversized frame");
    let grown = peak_rss(child.id()).saturating_sub(before);
    child.kill().unwrap();
    child.wait().unwrap();
    let _ = std::fs::remove_dir_all(dir);
    assert!(
        grown < 8 << 20,
        "the receiver's peak RSS grew by {} MiB",
        grown >> 20
    );
}

/// A prefill and a decode whose KV is of different models
/// (`pd_model_identity`) are refused at the handshake: the sender's put
/// fails naming both identities and the key, the receiver attaches no
/// sender, and no page of either side is taken.
#[test]
fn peers_of_different_models_are_refused_at_the_handshake_by_name() {
    for channel in [ChannelKind::Tcp, ChannelKind::Shm] {
        let mut rc = receiver_config(channel, TransferMode::Push, 16);
        let mut sc = sender_config(channel, TransferMode::Push, 16);
        rc.model_identity = Some("llama-8b@rev1".into());
        sc.model_identity = Some("llama-8b@rev2".into());
        let r = Receiver::start(&rc, 0).unwrap();
        let s = Sender::start(&sc, 0, Default::default()).unwrap();
        let ks = keys("model", 2);
        let c = chunks(&s, &ks, CHUNK);
        let e = s
            .put(&ks, &c, &spec_for(&rc, "model", true))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("llama-8b@rev1") && e.contains("llama-8b@rev2"),
            "{channel:?}: {e}"
        );
        assert!(e.contains("pd_model_identity"), "{channel:?}: {e}");
        drop(c);
        assert_eq!(r.stats().peers, 0, "{channel:?}");
        assert_no_pages(r.stats().pools.cpu.unwrap(), "receiver pool");
        assert!(s.drain(Duration::from_secs(10)));
        assert_no_pages(s.stats().pools.cpu.unwrap(), "sender pool");
    }
}
