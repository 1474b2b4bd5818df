//! `Receiver::load`: pull-delay proxies read through the ping-pong pipeline
//! and scattered into a paged KV cache, resident chunks scattered from
//! their pages. Every byte is checked at its slot (and every other slot
//! left untouched), Done counts and pool counters are checked after each
//! scenario, including a read that fails mid-pipeline.

mod common;

use ascend_pd::backend::{MessageKind, Receiver, Sender};
use ascend_pd::channel::{self as chan, handshake, handshake::Hello, Access, GrantTag};
use ascend_pd::config::{BufferDevice, ChannelKind, NpuLink, PdConfig, Role, TransferMode};
use ascend_pd::kv::{KvCache, KvCacheSpec};
use ascend_pd::memory::npu::AclRuntime;
use ascend_pd::memory::{pattern, ChunkLayout, ChunkMeta, MemObj, PagePool, RegisteredBuffer};
use ascend_pd::pipeline::{LoadError, LoadOptions, LoadReport};
use ascend_pd::protocol::{PullDoneSignal, PullId};
use common::*;
use std::time::{Duration, Instant};

/// xorshift64: deterministic "random" slot mappings.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = (self.next() % (i as u64 + 1)) as usize;
            v.swap(i, j);
        }
    }
}

const BLOCK: usize = 8;

/// Slots for `tokens` tokens: `Blocks` = a shuffled block table (runs of
/// whole blocks, as vLLM hands them out), `Scattered` = every token on a
/// random free slot (no two tokens adjacent in general).
#[derive(Clone, Copy, Debug)]
enum Mapping {
    Blocks,
    Scattered,
}

fn slot_mapping(tokens: usize, blocks: usize, how: Mapping, seed: u64) -> Vec<i64> {
    let mut rng = Rng(seed | 1);
    match how {
        Mapping::Blocks => {
            let mut table: Vec<usize> = (0..blocks).collect();
            rng.shuffle(&mut table);
            (0..tokens)
                .map(|t| (table[t / BLOCK] * BLOCK + t % BLOCK) as i64)
                .collect()
        }
        Mapping::Scattered => {
            let mut slots: Vec<i64> = (0..(blocks * BLOCK) as i64).collect();
            rng.shuffle(&mut slots);
            slots.truncate(tokens);
            slots
        }
    }
}

fn cache_for(cfg: &PdConfig, blocks: usize) -> KvCache {
    KvCache::host(KvCacheSpec::for_layout(&cfg.chunk_layout(), blocks, BLOCK)).unwrap()
}

/// Checks that chunk `i` of `keys` (its tokens from `tokens`) sits at its
/// slots in every layer and plane, and that every other slot is still zero.
fn assert_cache_holds(
    cache: &mut KvCache,
    layout: &ChunkLayout,
    keys: &[String],
    tokens: &[usize],
    slots: &[i64],
) {
    let spec = *cache.spec();
    let tb = spec.token_bytes();
    let mut used = vec![false; spec.slots()];
    for (i, key) in keys.iter().enumerate() {
        let n = tokens[i];
        let mut chunk = vec![0u8; layout.bytes_for(n)];
        pattern::fill(&mut chunk, seed_of(key));
        for t in 0..n {
            let slot = slots[i * layout.tokens + t] as usize;
            used[slot] = true;
            for plane in 0..spec.planes() {
                for layer in 0..spec.layers {
                    let at = ((plane * spec.layers + layer) * n + t) * tb;
                    let got = cache.token(layer, plane, slot).unwrap();
                    assert_eq!(
                        got,
                        &chunk[at..at + tb],
                        "{key}: token {t} (slot {slot}) layer {layer} plane {plane}"
                    );
                }
            }
        }
    }
    for (slot, _) in used.iter().enumerate().filter(|(_, u)| !**u) {
        for plane in 0..spec.planes() {
            for layer in 0..spec.layers {
                let got = cache.token(layer, plane, slot).unwrap();
                assert!(got.iter().all(|&b| b == 0), "slot {slot} was written");
            }
        }
    }
}

fn token_counts(n: usize, last: usize) -> Vec<usize> {
    let mut t = vec![CHUNK; n];
    *t.last_mut().unwrap() = last;
    t
}

fn msg(stats: &[(MessageKind, u64)], kind: MessageKind) -> u64 {
    stats
        .iter()
        .find(|(k, _)| *k == kind)
        .map_or(0, |(_, n)| *n)
}

/// The sender got exactly `pulls` Dones, none twice, and holds no page.
fn assert_released(s: &Sender, pulls: u64) {
    assert!(s.drain(Duration::from_secs(10)), "{:?}", s.stats().pulls);
    let p = s.stats().pulls;
    assert_eq!(p.done_released, pulls, "{p:?}");
    assert_eq!(p.done_already_released, 0, "{p:?}");
    assert_no_pages(s.stats().pools.cpu.unwrap(), "sender pool");
}

/// The receiver holds no page, no proxy and no open context.
fn assert_receiver_idle(r: &Receiver) {
    let st = r.stats();
    assert_no_pages(st.pools.cpu.unwrap(), "receiver pages");
    assert_eq!(st.store.proxies, 0, "proxies left");
    assert_eq!(st.store.contexts_open, 0, "contexts left");
}

fn put_delay(s: &Sender, rc: &PdConfig, req: &str, n: usize, last: usize) -> Vec<String> {
    let ks = keys(req, n);
    let c = chunks(s, &ks, last);
    s.put(&ks, &c, &spec_for(rc, req, true)).unwrap();
    ks
}

#[test]
fn every_byte_lands_at_its_slot_for_random_slot_mappings() {
    for (ch, how) in [
        (ChannelKind::Shm, Mapping::Blocks),
        (ChannelKind::Tcp, Mapping::Scattered),
    ] {
        let (r, rc, s) = pair(ch, TransferMode::PullDelay, 32);
        // Ten chunks, the last one partial: 9 × 16 + 7 tokens.
        let ks = put_delay(&s, &rc, "rand", 10, 7);
        let tokens = token_counts(10, 7);
        let blocks = 24;
        let slots = slot_mapping(9 * CHUNK + 7, blocks, how, 42);
        let mut cache = cache_for(&rc, blocks);
        // The ping-pong path (shm would read straight into this host
        // cache otherwise: see `direct_load_*`).
        let opts = LoadOptions {
            max_depth: 3,
            direct: false,
            ..Default::default()
        };
        let report = r.load_with(&ks, &slots, &mut cache, &opts).unwrap();
        assert_eq!(report.loaded, ks, "{ch:?}");
        assert_eq!(report.load_path(), "staged");
        assert_eq!((report.proxies, report.resident), (10, 0));
        assert_eq!(
            (report.depth, report.pools, report.micro_batches),
            (3, 2, 4)
        );
        assert_eq!(report.dones_sent, 1);
        let layout = rc.chunk_layout();
        assert_eq!(
            report.bytes_read,
            (9 * layout.page_bytes() + layout.bytes_for(7)) as u64
        );
        assert_eq!(report.bytes_scattered, report.bytes_read);
        if let Mapping::Blocks = how {
            // Whole blocks coalesce: 2 per 16-token chunk (+1 for the 7-token one) per layer and plane.
            assert_eq!(report.copies, ((9 * 2 + 1) * 2 * 2) as u64);
        }
        assert_cache_holds(&mut cache, &layout, &ks, &tokens, &slots);
        // Consumed proxies leave the store; the pull's Done went out once.
        assert!(!r.contains(&ks[0]));
        assert_released(&s, 1);
        assert_receiver_idle(&r);
        assert_eq!(msg(&r.stats().messages, MessageKind::PullDoneSignal), 1);
    }
}

#[test]
fn mla_chunks_land_in_the_latent_plane() {
    let mut rc = receiver_config(ChannelKind::Tcp, TransferMode::PullDelay, 16);
    rc.kv.use_mla = true;
    rc.buffer_size = 16 * rc.page_bytes();
    let r = Receiver::start(&rc, 0).unwrap();
    let mut sc = sender_config(ChannelKind::Tcp, TransferMode::PullDelay, 16);
    sc.kv.use_mla = true;
    sc.buffer_size = 16 * sc.page_bytes();
    let s = Sender::start(&sc, 0, Default::default()).unwrap();
    let ks = put_delay(&s, &rc, "mla", 5, 3);
    let slots = slot_mapping(4 * CHUNK + 3, 12, Mapping::Scattered, 7);
    let mut cache = cache_for(&rc, 12);
    assert_eq!(cache.spec().planes(), 1);
    let report = r.load(&ks, &slots, &mut cache).unwrap();
    assert_eq!(report.loaded.len(), 5);
    assert_cache_holds(
        &mut cache,
        &rc.chunk_layout(),
        &ks,
        &token_counts(5, 3),
        &slots,
    );
    assert_released(&s, 1);
    assert_receiver_idle(&r);
}

#[test]
fn depth_one_and_depth_beyond_the_request_both_load_everything() {
    let (r, rc, s) = pair(ChannelKind::Shm, TransferMode::PullDelay, 32);
    let blocks = 16;
    for (max_depth, n, expect) in [(1, 6, (1, 2, 6)), (64, 5, (5, 1, 1))] {
        let req = format!("depth{max_depth}");
        let ks = put_delay(&s, &rc, &req, n, CHUNK);
        let slots = slot_mapping(n * CHUNK, blocks, Mapping::Blocks, max_depth as u64);
        let mut cache = cache_for(&rc, blocks);
        let report = r
            .load_with(
                &ks,
                &slots,
                &mut cache,
                &LoadOptions {
                    max_depth,
                    direct: false,
                    ..Default::default()
                },
            )
            .unwrap();
        assert_eq!(
            (report.depth, report.pools, report.micro_batches),
            expect,
            "max_depth {max_depth}"
        );
        let page = rc.chunk_layout().page_bytes();
        assert_eq!(report.peak_buffer_bytes, expect.0 * expect.1 * page);
        assert_cache_holds(&mut cache, &rc.chunk_layout(), &ks, &vec![CHUNK; n], &slots);
        assert_receiver_idle(&r);
    }
    assert_released(&s, 2);
}

#[test]
fn two_senders_proxies_in_one_load_are_grouped_per_sender() {
    // Staged: a pipeline per sender; direct (shm and tcp into a host
    // cache): the two senders' proxies are read concurrently.
    for (ch, direct) in [
        (ChannelKind::Tcp, false),
        (ChannelKind::Tcp, true),
        (ChannelKind::Shm, true),
    ] {
        two_senders(ch, direct);
    }
}

fn two_senders(ch: ChannelKind, direct: bool) {
    let (r, rc, a) = pair(ch, TransferMode::PullDelay, 32);
    let sc = sender_config(ch, TransferMode::PullDelay, 32);
    let b = Sender::start(&sc, 0, Default::default()).unwrap();
    let ka = put_delay(&a, &rc, "alpha", 4, CHUNK);
    let kb = put_delay(&b, &rc, "beta", 3, 5);
    // The request interleaves them: a0 b0 a1 b1 a2 a3 b2 (b2 is the partial last chunk).
    let order = [&ka[0], &kb[0], &ka[1], &kb[1], &ka[2], &ka[3], &kb[2]];
    let req: Vec<String> = order.iter().map(|k| (*k).clone()).collect();
    let tokens = token_counts(7, 5);
    let slots = slot_mapping(6 * CHUNK + 5, 16, Mapping::Blocks, 3);
    let mut cache = cache_for(&rc, 16);
    let report = r
        .load_with(
            &req,
            &slots,
            &mut cache,
            &LoadOptions {
                max_depth: 2,
                direct,
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!(report.senders, 2);
    assert_eq!(report.loaded, req, "request order");
    // alpha: 4 proxies in 2 batches, beta: 3 in 2.
    assert_eq!(report.micro_batches, 4);
    let want = if direct { "direct" } else { "staged" };
    assert_eq!(report.load_path(), want, "{ch:?}");
    assert_eq!(report.dones_sent, 2);
    assert_cache_holds(&mut cache, &rc.chunk_layout(), &req, &tokens, &slots);
    assert_released(&a, 1);
    assert_released(&b, 1);
    assert_receiver_idle(&r);
}

/// The staged path reads several senders at once: with one sender's
/// transfer server stalled, the other's proxies are read, scattered and
/// their pull's Done sent before the stalled one answers (read one after
/// another, the second group would wait for the first).
#[test]
fn staged_loads_read_a_second_sender_while_the_first_stalls() {
    let (r, rc, s) = pair(ChannelKind::Tcp, TransferMode::PullDelay, 32);
    let gate = Gate::new();
    let held = keys("held", 4);
    let fake = ScriptedSender::announce_via(&rc, &held, None, Some(&gate));
    let free = put_delay(&s, &rc, "free", 4, CHUNK);
    // The stalled sender's keys come first: a sequential load starts there.
    let req: Vec<String> = held.iter().chain(&free).cloned().collect();
    let slots = slot_mapping(8 * CHUNK, 16, Mapping::Blocks, 21);
    let mut cache = cache_for(&rc, 16);
    gate.hold(true);
    let report = std::thread::scope(|sc| {
        let load = sc.spawn(|| {
            let opts = LoadOptions {
                max_depth: 2,
                direct: false,
                ..Default::default()
            };
            r.load_with(&req, &slots, &mut cache, &opts)
        });
        let freed = eventually(Duration::from_secs(20), || {
            s.stats().pulls.done_released == 1
        });
        gate.hold(false);
        let report = load.join().unwrap().unwrap();
        assert!(freed, "the free sender's pull waited for the stalled one");
        report
    });
    assert_eq!((report.senders, report.load_path()), (2, "staged"));
    assert_eq!(report.loaded, req);
    assert_eq!(report.dones_sent, 2);
    // Both groups' pools were out at once (the peaks add up).
    let page = rc.chunk_layout().page_bytes();
    assert_eq!(report.peak_buffer_bytes, 2 * 4 * page);
    assert_cache_holds(&mut cache, &rc.chunk_layout(), &req, &[CHUNK; 8], &slots);
    assert_eq!(
        fake.dones(Duration::from_millis(500)),
        vec![fake.pull_id.clone()]
    );
    assert_released(&s, 1);
    assert_receiver_idle(&r);
}

#[test]
fn resident_chunks_are_scattered_from_their_pages_without_reads() {
    for mode in [TransferMode::Push, TransferMode::PullEager] {
        let (r, rc, s) = pair(ChannelKind::Shm, mode, 32);
        let ks = keys("res", 6);
        let c = chunks(&s, &ks, 9);
        s.put(&ks, &c, &spec_for(&rc, "res", true)).unwrap();
        drop(c);
        for k in &ks {
            assert!(r.get_wait(k, Duration::from_secs(10)).is_some(), "{k}");
        }
        let read_before = r.stats().bytes_read;
        let slots = slot_mapping(5 * CHUNK + 9, 12, Mapping::Scattered, 9);
        let mut cache = cache_for(&rc, 12);
        let report = r.load(&ks, &slots, &mut cache).unwrap();
        assert_eq!((report.resident, report.proxies), (6, 0), "{mode:?}");
        assert_eq!((report.bytes_read, report.depth), (0, 0));
        assert_eq!(r.stats().bytes_read, read_before);
        assert_cache_holds(
            &mut cache,
            &rc.chunk_layout(),
            &ks,
            &token_counts(6, 9),
            &slots,
        );
        // Resident chunks stay stored until removed.
        assert!(r.contains(&ks[0]));
        for k in &ks {
            r.remove(k);
        }
        assert_no_pages(r.stats().pools.cpu.unwrap(), "receiver pool");
    }
}

#[test]
fn bad_input_is_refused_before_anything_is_touched_and_missing_keys_are_named() {
    let (r, rc, s) = pair(ChannelKind::Shm, TransferMode::PullDelay, 16);
    let ks = put_delay(&s, &rc, "bad", 3, CHUNK);
    let mut cache = cache_for(&rc, 8);
    // Too short a slot mapping.
    let e = r.load(&ks, &[0; 40], &mut cache).unwrap_err().to_string();
    assert!(
        e.contains("bad-2") && e.contains("[32, 48)") && e.contains("40"),
        "{e}"
    );
    // A slot beyond the cache.
    let mut slots: Vec<i64> = (0..48).collect();
    slots[20] = 64;
    let e = r.load(&ks, &slots, &mut cache).unwrap_err().to_string();
    assert!(e.contains("slot 64") && e.contains("64 slots"), "{e}");
    // A cache of another geometry.
    let mut other = KvCache::host(KvCacheSpec {
        hidden: 16,
        ..*cache.spec()
    })
    .unwrap();
    let e = r.load(&ks, &slots, &mut other).unwrap_err().to_string();
    assert!(e.contains("hidden 16") && e.contains("hidden 32"), "{e}");
    // Nothing was consumed: all three proxies are still there.
    assert_eq!(r.stats().store.proxies, 3);
    // Missing keys are named; the rest still load.
    let slots: Vec<i64> = (0..64).collect();
    let mut req = ks.clone();
    req.push("nowhere".into());
    let e = r.load(&req, &slots, &mut cache).unwrap_err();
    let LoadError::Incomplete { failed, report } = &e else {
        panic!("{e}")
    };
    assert_eq!(failed.len(), 1);
    assert_eq!(
        (failed[0].key.as_str(), failed[0].reason.as_str()),
        ("nowhere", "not stored")
    );
    assert_eq!(report.loaded, ks);
    assert!(e.to_string().contains("1 of 4 key(s) not loaded"), "{e}");
    assert_released(&s, 1);
    assert_receiver_idle(&r);
}

/// A loopback TCP forwarder whose replies (target to client) can be held:
/// a sender whose transfer server stalls, deterministically.
struct Gate {
    addr: String,
    held: std::sync::Arc<std::sync::atomic::AtomicBool>,
    listener: std::net::TcpListener,
}

impl Gate {
    fn new() -> Gate {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        Gate {
            addr: listener.local_addr().unwrap().to_string(),
            held: Default::default(),
            listener,
        }
    }

    fn hold(&self, on: bool) {
        self.held.store(on, std::sync::atomic::Ordering::SeqCst);
    }

    /// Forwards every connection to `target` from now on.
    fn forward_to(&self, target: &str) {
        use std::io::{Read, Write};
        let listener = self.listener.try_clone().unwrap();
        let (target, held) = (target.to_string(), std::sync::Arc::clone(&self.held));
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { return };
                let Ok(server) = std::net::TcpStream::connect(&target) else {
                    continue;
                };
                let pipe = |mut from: std::net::TcpStream,
                            mut to: std::net::TcpStream,
                            held: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>| {
                    std::thread::spawn(move || {
                        let mut buf = vec![0u8; 1 << 16];
                        while let Ok(n) = from.read(&mut buf) {
                            if n == 0 {
                                break;
                            }
                            while held
                                .as_ref()
                                .is_some_and(|h| h.load(std::sync::atomic::Ordering::SeqCst))
                            {
                                std::thread::sleep(Duration::from_millis(5));
                            }
                            if to.write_all(&buf[..n]).is_err() {
                                break;
                            }
                        }
                        let _ = to.shutdown(std::net::Shutdown::Write);
                    });
                };
                pipe(
                    client.try_clone().unwrap(),
                    server.try_clone().unwrap(),
                    None,
                );
                pipe(server, client, Some(std::sync::Arc::clone(&held)));
            }
        });
    }
}

/// A sender driven by hand: a real tcp channel and handshake, a raw REQ for
/// its PullReadyNotif (whose page indexes the test chooses), a PULL socket
/// counting the Dones it gets.
struct ScriptedSender {
    _pool: std::sync::Arc<PagePool>,
    _ch: std::sync::Arc<dyn chan::TransferChannel>,
    _pages: Vec<ascend_pd::memory::SealedMemObj>,
    done: zmq::Socket,
    _ctx: zmq::Context,
    pull_id: String,
}

impl ScriptedSender {
    /// Announces `keys` (full chunks) as one pull with a 60 s lease; `bad`
    /// replaces one page index.
    fn announce(rc: &PdConfig, keys: &[String], bad: Option<(usize, u64)>) -> Self {
        Self::announce_via(rc, keys, bad, None)
    }

    /// As [`ScriptedSender::announce`], its transfer server reached through
    /// `gate` (the receiver gets the gate's address in the hello).
    fn announce_via(
        rc: &PdConfig,
        keys: &[String],
        bad: Option<(usize, u64)>,
        gate: Option<&Gate>,
    ) -> Self {
        let layout = rc.chunk_layout();
        let page = layout.page_bytes();
        let pool = PagePool::new(RegisteredBuffer::host(keys.len() * page, page, false).unwrap());
        let mut pages = pool
            .allocate_batch(&vec![ChunkMeta::full(layout); keys.len()])
            .unwrap();
        for (p, k) in pages.iter_mut().zip(keys) {
            pattern::fill(p.host_bytes_mut().unwrap(), seed_of(k));
        }
        let pages: Vec<_> = pages.into_iter().map(MemObj::seal).collect();
        let node = "scripted-sender:1";
        let ch = chan::open(
            ChannelKind::Tcp,
            "127.0.0.1",
            node,
            std::slice::from_ref(&pool),
            None,
        )
        .unwrap();
        let mut hello = Hello::local(
            node,
            Role::Sender,
            TransferMode::PullDelay,
            Duration::from_secs(60),
            ch.as_ref(),
        );
        if let Some(g) = gate {
            let chan::Endpoint::Tcp { addr } = &hello.endpoint else {
                panic!("a tcp endpoint")
            };
            g.forward_to(addr);
            hello.endpoint = chan::Endpoint::Tcp {
                addr: g.addr.clone(),
            };
        }
        let ctx = zmq::Context::new();
        let init = format!("tcp://127.0.0.1:{}", rc.init_port(0).unwrap());
        let a =
            handshake::connect(&ctx, &init, ch.as_ref(), &hello, Duration::from_secs(10)).unwrap();
        // The receiver may read exactly the announced pages.
        let refs: Vec<_> = pages.iter().map(|p| p.buffer_ref()).collect();
        ch.grant(a.peer, Access::Read, GrantTag::UNTAGGED, &refs)
            .unwrap();
        // Same process as the receiver: its clock is ours.
        let pull_id =
            PullId::due_in_this_process(Instant::now() + Duration::from_secs(60)).encode();
        let done = ctx.socket(zmq::PULL).unwrap();
        let done_port = free_port();
        done.bind(&format!("tcp://127.0.0.1:{done_port}")).unwrap();
        let mut indexes: Vec<u64> = pages.iter().map(|p| u64::from(p.page())).collect();
        if let Some((i, page)) = bad {
            indexes[i] = page;
        }
        let notif = pull_notif(
            layout,
            pull_id.clone(),
            keys,
            (pool.uuid(), indexes),
            node,
            format!("127.0.0.1:{done_port}"),
        );
        let ack = announce_pull(&ctx, rc, notif);
        assert!(!ack.alloc_failed, "{ack:?}");
        ScriptedSender {
            _pool: pool,
            _ch: ch,
            _pages: pages,
            done,
            _ctx: ctx,
            pull_id,
        }
    }

    /// The Dones that arrive within `wait` of each other.
    fn dones(&self, wait: Duration) -> Vec<String> {
        let mut out = Vec::new();
        self.done.set_rcvtimeo(wait.as_millis() as i32).unwrap();
        while let Ok(frame) = self.done.recv_bytes(0) {
            out.push(PullDoneSignal::decode(&frame).unwrap().pull_id);
        }
        out
    }
}

#[test]
fn a_read_failure_mid_pipeline_reports_the_request_frees_the_pools_and_sends_done_once() {
    // Staged: the failed micro-batch stops the later ones. Direct: each
    // batch is its own read, so only the failed one's keys fail.
    read_failure(false);
    read_failure(true);
}

fn read_failure(direct: bool) {
    let rc = receiver_config(ChannelKind::Tcp, TransferMode::PullDelay, 16);
    let r = Receiver::start(&rc, 0).unwrap();
    let start = r.stats();
    let ks = keys("broken", 8);
    // Chunk 5 names a page the sender never registered: micro-batch 2
    // (chunks 4 and 5, depth 2) fails after batches 0 and 1 were loaded.
    let fake = ScriptedSender::announce(&rc, &ks, Some((5, 999)));
    let slots = slot_mapping(8 * CHUNK, 16, Mapping::Blocks, 5);
    let mut cache = cache_for(&rc, 16);
    let e = r
        .load_with(
            &ks,
            &slots,
            &mut cache,
            &LoadOptions {
                max_depth: 2,
                direct,
                ..Default::default()
            },
        )
        .unwrap_err();
    let text = e.to_string();
    let LoadError::Incomplete { failed, report } = e else {
        panic!("{text}")
    };
    let (loaded, failed_want): (Vec<usize>, Vec<&str>) = match direct {
        false => (
            (0..4).collect(),
            vec!["broken-4", "broken-5", "broken-6", "broken-7"],
        ),
        true => (vec![0, 1, 2, 3, 6, 7], vec!["broken-4", "broken-5"]),
    };
    let loaded_keys: Vec<String> = loaded.iter().map(|&i| ks[i].clone()).collect();
    assert_eq!(report.loaded, loaded_keys, "{text}");
    let failed_keys: Vec<&str> = failed.iter().map(|f| f.key.as_str()).collect();
    assert_eq!(failed_keys, failed_want);
    for f in &failed {
        assert_eq!(f.pull_id.as_deref(), Some(fake.pull_id.as_str()));
        assert_eq!(f.sender_id.as_deref(), Some("scripted-sender:1"));
    }
    assert!(failed[0].reason.contains("page 999 out of range"), "{text}");
    if !direct {
        assert!(failed[2].reason.contains("earlier micro-batch"), "{text}");
        assert!(text.contains("4 of 8 key(s) not loaded"), "{text}");
        // What was loaded is right; what failed never reached the cache.
        assert_cache_holds(
            &mut cache,
            &rc.chunk_layout(),
            &ks[..4],
            &[CHUNK; 4],
            &slots,
        );
    } else {
        // The refused batch moved nothing (every range is checked first);
        // the others are right.
        assert!(text.contains("2 of 8 key(s) not loaded"), "{text}");
        let sl: Vec<i64> = loaded
            .iter()
            .flat_map(|&i| slots[i * CHUNK..(i + 1) * CHUNK].to_vec())
            .collect();
        let n = loaded_keys.len();
        assert_cache_holds(
            &mut cache,
            &rc.chunk_layout(),
            &loaded_keys,
            &vec![CHUNK; n],
            &sl,
        );
    }
    // The pull's Done went out exactly once, and the load said so.
    assert_eq!(report.dones_sent, 1);
    assert_eq!(fake.dones(Duration::from_millis(500)), vec![fake.pull_id]);
    assert_eq!(msg(&r.stats().messages, MessageKind::PullDoneSignal), 1);
    // Pools and store are back where they started.
    let end = r.stats();
    assert_eq!(
        end.pools.cpu.unwrap().allocated,
        start.pools.cpu.unwrap().allocated
    );
    assert_eq!((end.store.proxies, end.store.contexts_open), (0, 0));
    assert_eq!(end.store.dones_emitted, 1);
    assert!(msg(&end.messages, MessageKind::TransferError) >= 1);
}

#[test]
fn concurrent_loads_competing_for_pages_fall_back_to_a_smaller_depth() {
    // A receiver with 6 pages for its pipelines.
    let (r, rc, s) = pair(ChannelKind::Shm, TransferMode::PullDelay, 6);
    let mut sc = sender_config(ChannelKind::Shm, TransferMode::PullDelay, 64);
    sc.buffer_size = 64 * sc.page_bytes();
    let s2 = Sender::start(&sc, 0, Default::default()).unwrap();
    drop(s);
    // Three pages held elsewhere: a load for 16 chunks gets depth 1, not a failure.
    let held = r
        .allocator()
        .allocate_batch(&[ChunkMeta::full(rc.chunk_layout()); 3])
        .unwrap();
    let ks = put_delay(&s2, &rc, "squeezed", 16, CHUNK);
    let slots = slot_mapping(16 * CHUNK, 32, Mapping::Blocks, 1);
    let mut cache = cache_for(&rc, 32);
    let staged = LoadOptions {
        direct: false,
        ..Default::default()
    };
    let report = r.load_with(&ks, &slots, &mut cache, &staged).unwrap();
    assert_eq!((report.depth, report.pools), (1, 2));
    assert_cache_holds(&mut cache, &rc.chunk_layout(), &ks, &[CHUNK; 16], &slots);
    drop(held);
    // Two loads at once over 6 pages: each gets what is free, both complete.
    let ka = put_delay(&s2, &rc, "left", 12, CHUNK);
    let kb = put_delay(&s2, &rc, "right", 12, 4);
    let sa = slot_mapping(12 * CHUNK, 24, Mapping::Blocks, 2);
    let sb = slot_mapping(11 * CHUNK + 4, 24, Mapping::Scattered, 3);
    let (mut ca, mut cb) = (cache_for(&rc, 24), cache_for(&rc, 24));
    let (ra, rb): (LoadReport, LoadReport) = std::thread::scope(|sc| {
        let a = sc.spawn(|| r.load_with(&ka, &sa, &mut ca, &staged).unwrap());
        let b = sc.spawn(|| r.load_with(&kb, &sb, &mut cb, &staged).unwrap());
        (a.join().unwrap(), b.join().unwrap())
    });
    assert!(ra.depth >= 1 && rb.depth >= 1);
    assert!(ra.depth * ra.pools <= 6 && rb.depth * rb.pools <= 6);
    assert_cache_holds(&mut ca, &rc.chunk_layout(), &ka, &[CHUNK; 12], &sa);
    assert_cache_holds(&mut cb, &rc.chunk_layout(), &kb, &token_counts(12, 4), &sb);
    assert!(r.stats().pools.cpu.unwrap().high_water <= 6);
    assert_released(&s2, 3);
    assert_receiver_idle(&r);
}

/// NPU 0 of the CANN emulator.
fn emulated_npu() -> ascend_sys::Device {
    let dir = ascend_emu::install_dir().expect("the emulator is a dev-dependency");
    AclRuntime::from_dir(&dir)
        .expect("the emulator loads")
        .device(0)
        .unwrap()
}

#[test]
fn an_npu_cache_is_loaded_through_the_emulator() {
    let dev = emulated_npu();
    let mut rc = receiver_config(ChannelKind::Tcp, TransferMode::PullDelay, 8);
    rc.buffer_device = BufferDevice::Npu(Some(0));
    let r = Receiver::start(&rc, 0).unwrap();
    let sc = sender_config(ChannelKind::Tcp, TransferMode::PullDelay, 16);
    let s = Sender::start(&sc, 0, Default::default()).unwrap();
    let ks = put_delay(&s, &rc, "npu", 9, 11);
    let slots = slot_mapping(8 * CHUNK + 11, 20, Mapping::Blocks, 17);
    let spec = KvCacheSpec::for_layout(&rc.chunk_layout(), 20, BLOCK);
    let mut cache = KvCache::npu(&dev, spec).unwrap();
    let report = r
        .load_with(
            &ks,
            &slots,
            &mut cache,
            &LoadOptions {
                max_depth: 2,
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!((report.depth, report.micro_batches), (2, 5));
    // An NPU cache over tcp keeps the staged path through NPU pages.
    assert_eq!(report.load_path(), "staged");
    assert_cache_holds(
        &mut cache,
        &rc.chunk_layout(),
        &ks,
        &token_counts(9, 11),
        &slots,
    );
    assert_released(&s, 1);
    assert_no_pages(r.stats().pools.npu.unwrap(), "receiver NPU pool");
    assert_eq!(r.stats().store.contexts_open, 0);
}

/// Issue 12's direct load over hccl: the NPU cache is registered with the
/// channel on the first load and each proxy is one `HcclBatchGet` per run
/// straight into it (the emulator checks every local range against memory
/// registered on the communicator). No staging page is taken; a second
/// cache, after the first is dropped (and deregistered), loads directly
/// too; `direct: false` still stages.
#[test]
fn an_npu_cache_over_hccl_is_read_directly() {
    let dev = emulated_npu();
    let mut rc = receiver_config(ChannelKind::Hccl, TransferMode::PullDelay, 8);
    rc.buffer_device = BufferDevice::Npu(Some(0));
    let r = Receiver::start(&rc, 0).unwrap();
    let sc = sender_config(ChannelKind::Hccl, TransferMode::PullDelay, 32);
    let s = Sender::start(&sc, 0, Default::default()).unwrap();
    let spec = KvCacheSpec::for_layout(&rc.chunk_layout(), 20, BLOCK);
    let npu_pool = || r.stats().pools.npu.unwrap();
    for (round, direct) in [(0u64, true), (1, true), (2, false)] {
        let req = format!("hccl-direct-{round}");
        let ks = put_delay(&s, &rc, &req, 9, 11);
        let how = [Mapping::Blocks, Mapping::Scattered][round as usize % 2];
        let slots = slot_mapping(8 * CHUNK + 11, 20, how, 40 + round);
        let mut cache = KvCache::npu(&dev, spec).unwrap();
        let before = npu_pool();
        let opts = LoadOptions {
            direct,
            ..Default::default()
        };
        let report = r.load_with(&ks, &slots, &mut cache, &opts).unwrap();
        if direct {
            assert_eq!(report.load_path(), "direct", "round {round}");
            assert_eq!((report.proxies, report.direct), (9, 9));
            assert_eq!(
                (report.depth, report.pools, report.peak_buffer_bytes),
                (0, 0, 0)
            );
            assert_eq!(npu_pool().high_water, before.high_water, "a page was taken");
        } else {
            assert_eq!(report.load_path(), "staged");
            assert!(npu_pool().high_water > 0);
        }
        assert_eq!(report.dones_sent, 1);
        assert_cache_holds(
            &mut cache,
            &rc.chunk_layout(),
            &ks,
            &token_counts(9, 11),
            &slots,
        );
        assert_no_pages(npu_pool(), "receiver NPU pool");
        assert_eq!(r.stats().store.proxies, 0);
        assert_eq!(r.stats().store.contexts_open, 0);
    }
    assert_released(&s, 3);

    // The sender goes away after announcing: the direct load fails those
    // keys by name, in bounded time, and leaves nothing behind.
    let ks = put_delay(&s, &rc, "hccl-gone", 4, CHUNK);
    drop(s);
    let slots = slot_mapping(4 * CHUNK, 20, Mapping::Blocks, 50);
    let mut cache = KvCache::npu(&dev, spec).unwrap();
    let e = r
        .load_with(&ks, &slots, &mut cache, &LoadOptions::default())
        .unwrap_err();
    let text = e.to_string();
    let LoadError::Incomplete { failed, .. } = e else {
        panic!("{text}")
    };
    assert_eq!(failed.len(), 4, "{text}");
    assert!(
        failed
            .iter()
            .all(|f| f.reason.contains("gone") || f.reason.contains("not attached")),
        "{text}"
    );
    assert_no_pages(npu_pool(), "receiver NPU pool");
    assert_eq!(r.stats().store.proxies, 0);
    assert_eq!(r.stats().store.contexts_open, 0);
}

/// Issue 28: with a modeled link (`pd_npu_link: a2-roce`), a pull-delay
/// load over hccl prices both paths on it and reports which it took. Each
/// token holds 128 KiB per layer and plane, so a chunk of 16 tokens is
/// 2 MiB per layer and plane. Scattered slots make every token its own
/// 128 KiB run: HCCL's comm path on A2 RoCE moves those at 5.7 GB/s
/// against 19.8 for the whole 8 MiB page, so the load stages. Slots in
/// order make each layer and plane of a chunk one 2 MiB run (its slots
/// span two blocks, contiguous): as fast as the page, so the load reads
/// directly.
/// Chosen by the path the load reports, not by timing; every byte is
/// checked and every page comes back.
#[test]
fn a_modeled_a2_roce_link_stages_small_runs_and_reads_large_runs_directly() {
    let dev = emulated_npu();
    let wide = |c: &mut PdConfig| {
        c.kv.num_kv_heads = 8;
        c.kv.head_size = 8192;
        c.kv.hidden_size = 65536;
    };
    let mut rc = receiver_config(ChannelKind::Hccl, TransferMode::PullDelay, 1);
    wide(&mut rc);
    rc.buffer_size = 4 * rc.page_bytes();
    rc.buffer_device = BufferDevice::Npu(Some(0));
    rc.npu_link = NpuLink::parse("a2-roce").unwrap();
    let r = Receiver::start(&rc, 0).unwrap();
    let mut sc = sender_config(ChannelKind::Hccl, TransferMode::PullDelay, 1);
    wide(&mut sc);
    sc.buffer_size = 4 * sc.page_bytes();
    let s = Sender::start(&sc, 0, Default::default()).unwrap();
    assert_eq!(rc.page_bytes(), 8 << 20);
    let blocks = 6;
    let spec = KvCacheSpec::for_layout(&rc.chunk_layout(), blocks, BLOCK);
    let npu_pool = || r.stats().pools.npu.unwrap();
    let tokens = CHUNK + 5;
    for (round, how) in [(0u64, Some(Mapping::Scattered)), (1, None)] {
        let req = format!("modeled-{round}");
        let ks = put_delay(&s, &rc, &req, 2, 5);
        let slots = match how {
            Some(m) => slot_mapping(tokens, blocks, m, 70 + round),
            None => (0..tokens as i64).collect(),
        };
        let mut cache = KvCache::npu(&dev, spec).unwrap();
        let before = npu_pool().high_water;
        let report = r.load(&ks, &slots, &mut cache).unwrap();
        let reason = report.path_reason.clone().unwrap_or_default();
        if how.is_some() {
            assert_eq!(report.load_path(), "staged", "{reason}");
            assert!(reason.starts_with("staged: modeled on a2-roce"), "{reason}");
            assert!(npu_pool().high_water > before, "the staged load took pages");
        } else {
            assert_eq!(report.load_path(), "direct", "{reason}");
            assert!(reason.starts_with("direct: modeled on a2-roce"), "{reason}");
            assert_eq!(npu_pool().high_water, before, "a page was taken");
            // One op per chunk, layer and plane: 2 chunks x 2 layers x 2
            // planes.
            assert_eq!(report.copies, 8, "{reason}");
        }
        assert_cache_holds(
            &mut cache,
            &rc.chunk_layout(),
            &ks,
            &token_counts(2, 5),
            &slots,
        );
        assert_no_pages(npu_pool(), "receiver NPU pool");
        assert_eq!(r.stats().store.proxies, 0);
    }
    assert_released(&s, 2);
}

/// A cache HCCL cannot take (an engine's per-layer tensors, more of them
/// than a communicator's 256 registrations) is loaded through staging
/// pages instead, every byte in place.
#[test]
fn an_hccl_cache_too_fragmented_to_register_is_staged() {
    let dev = emulated_npu();
    let layers = 130;
    let mut rc = receiver_config(ChannelKind::Hccl, TransferMode::PullDelay, 8);
    rc.kv.num_layers = layers;
    rc.buffer_size = 8 * rc.page_bytes();
    rc.buffer_device = BufferDevice::Npu(Some(0));
    let r = Receiver::start(&rc, 0).unwrap();
    let mut sc = sender_config(ChannelKind::Hccl, TransferMode::PullDelay, 8);
    sc.kv.num_layers = layers;
    sc.buffer_size = 8 * sc.page_bytes();
    let s = Sender::start(&sc, 0, Default::default()).unwrap();
    let ks = put_delay(&s, &rc, "fragmented", 3, 9);
    let spec = KvCacheSpec::for_layout(&rc.chunk_layout(), 8, BLOCK);
    // One tensor per layer and plane, as an engine allocates them.
    let (tensors, refs) = npu_tensors(&dev, &spec);
    // SAFETY: device memory of `dev`, alive until after the cache is dropped.
    let mut cache = unsafe { KvCache::wrap_npu(&dev, spec, &refs, None) }.unwrap();
    let slots = slot_mapping(2 * CHUNK + 9, 8, Mapping::Blocks, 60);
    let report = r
        .load_with(&ks, &slots, &mut cache, &LoadOptions::default())
        .unwrap();
    assert_eq!(report.load_path(), "staged");
    assert_cache_holds(
        &mut cache,
        &rc.chunk_layout(),
        &ks,
        &token_counts(3, 9),
        &slots,
    );
    drop(cache);
    drop(tensors);
    assert_released(&s, 1);
    assert_no_pages(r.stats().pools.npu.unwrap(), "receiver NPU pool");
}

/// Issue 12's direct load: over shm and tcp into a host cache, pull-delay proxies
/// are read straight into the KV cache at their slots — no staging page
/// is taken from the receiver's pool — with every byte where the staged
/// path puts it, Dones sent once, and pools and store settled.
#[test]
fn direct_load_reads_straight_into_the_cache_with_no_staging_pages() {
    for ch in [ChannelKind::Shm, ChannelKind::Tcp] {
        direct_load_over(ch);
    }
}

fn direct_load_over(ch: ChannelKind) {
    let (r, rc, s) = pair(ch, TransferMode::PullDelay, 32);
    for (how, seed) in [(Mapping::Blocks, 5), (Mapping::Scattered, 6)] {
        let req = format!("direct-{seed}");
        let ks = put_delay(&s, &rc, &req, 10, 7);
        let tokens = token_counts(10, 7);
        let slots = slot_mapping(9 * CHUNK + 7, 24, how, seed);
        let mut cache = cache_for(&rc, 24);
        let before = r.stats().pools.cpu.unwrap();
        let report = r
            .load_with(&ks, &slots, &mut cache, &LoadOptions::default())
            .unwrap();
        assert_eq!(report.load_path(), "direct");
        assert_eq!((report.proxies, report.direct), (10, 10));
        // No pipeline ran: no depth, no pools, no staging bytes, and the
        // receiver's pool never lent a page.
        assert_eq!(
            (report.depth, report.pools, report.peak_buffer_bytes),
            (0, 0, 0)
        );
        let after = r.stats().pools.cpu.unwrap();
        assert_eq!(after.high_water, before.high_water, "a page was taken");
        assert_eq!(after.allocated, 0);
        let layout = rc.chunk_layout();
        let bytes = (9 * layout.page_bytes() + layout.bytes_for(7)) as u64;
        assert_eq!((report.bytes_read, report.bytes_scattered), (bytes, bytes));
        assert_eq!(report.dones_sent, 1);
        assert_cache_holds(&mut cache, &layout, &ks, &tokens, &slots);
        assert!(!r.contains(&ks[0]), "consumed proxies leave the store");
        assert_receiver_idle(&r);
    }
    assert_released(&s, 2);
    assert_eq!(r.stats().pools.cpu.unwrap().high_water, 0);
    // A slot mapping naming one slot twice is loaded through the
    // sequential staged path (direct copies run in parallel).
    let ks = put_delay(&s, &rc, "twice", 2, CHUNK);
    let mut slots = slot_mapping(2 * CHUNK, 24, Mapping::Blocks, 9);
    slots[CHUNK] = slots[0];
    let mut cache = cache_for(&rc, 24);
    let report = r
        .load_with(&ks, &slots, &mut cache, &LoadOptions::default())
        .unwrap();
    assert_eq!(report.load_path(), "staged");
    assert_receiver_idle(&r);
}
