//! Heterogeneous TP over real sockets: prefill and decode ranks of
//! different TP sizes, in both directions, in every mode. Each prefill rank
//! sends head pieces of a request's chunks as `Sender::routes` says; each
//! decode rank loads the pieces of its sources into its KV cache, and every
//! byte of every loaded slot must equal what a same-TP run would hold: the
//! decode rank's heads of the model's token. Pools end where they started.

mod common;

use ascend_pd::backend::TransferSpec;
use ascend_pd::config::{ChannelKind, PdConfig, PortList, TransferMode};
use ascend_pd::kv::tp::{HeadRange, TpPlan};
use ascend_pd::kv::{KvCache, KvCacheSpec};
use ascend_pd::memory::{pattern, DualStats, MemObj};
use ascend_pd::pipeline::{LoadError, LoadOptions};
use ascend_pd::{Receiver, Sender};
use common::*;
use std::sync::Arc;
use std::time::Duration;

/// The model's KV heads, and elements per head.
const HEADS: usize = 4;
const HEAD: usize = 16;
const LAYERS: usize = 2;
/// A request: two full chunks and a partial one.
const TOKENS: usize = 2 * CHUNK + 5;

fn settled(s: &DualStats) -> bool {
    [&s.cpu, &s.npu]
        .into_iter()
        .flatten()
        .all(|p| p.free == p.total && p.pinned == 0 && p.quarantined == 0)
}

struct Deployment {
    receivers: Vec<Arc<Receiver>>,
    senders: Vec<Arc<Sender>>,
    rc: PdConfig,
    sc: PdConfig,
    plan: TpPlan,
    mla: bool,
}

fn deploy(channel: ChannelKind, mode: TransferMode, a: usize, b: usize, mla: bool) -> Deployment {
    // Whole-model width per token: HEADS x HEAD, or the MLA latent.
    let per = |tp: usize| if mla { HEADS * HEAD } else { HEADS / tp * HEAD };
    let shape = |c: &mut PdConfig, tp: usize, peer: usize| {
        c.kv.num_layers = LAYERS;
        c.kv.use_mla = mla;
        c.kv.num_kv_heads = if mla { 1 } else { HEADS / tp };
        c.kv.head_size = if mla { HEADS * HEAD } else { HEAD };
        c.kv.hidden_size = per(tp);
        c.tp_size = tp;
        c.peer_tp_size = Some(peer);
        c.buffer_size = 32 * c.page_bytes();
    };
    let mut rc = receiver_config(channel, mode, 32);
    shape(&mut rc, b, a);
    rc.peer_init_port = Some(PortList::PerRank((0..b).map(|_| free_port()).collect()));
    rc.peer_alloc_port = Some(PortList::PerRank((0..b).map(|_| free_port()).collect()));
    let receivers = (0..b)
        .map(|d| Arc::new(Receiver::start(&rc, d).unwrap()))
        .collect();
    let mut sc = sender_config(channel, mode, 32);
    shape(&mut sc, a, b);
    sc.pull_done_port = Some(PortList::PerRank((0..a).map(|_| free_port()).collect()));
    let senders = (0..a)
        .map(|p| Arc::new(Sender::start(&sc, p, Default::default()).unwrap()))
        .collect();
    let plan = rc.tp_plan().unwrap();
    Deployment {
        receivers,
        senders,
        rc,
        sc,
        plan,
        mla,
    }
}

/// Elements of one model token (what a TP-1 rank holds; the MLA latent
/// has the same width here).
fn model_width(_mla: bool) -> usize {
    HEADS * HEAD
}

/// The model's chunk `c` of request `req` at full width: a pattern of
/// `[planes][layers][tokens][model_width]` bf16 elements.
fn model_chunk(req: &str, c: usize, tokens: usize, mla: bool) -> Vec<u8> {
    let planes = if mla { 1 } else { 2 };
    let mut v = vec![0u8; planes * LAYERS * tokens * model_width(mla) * 2];
    pattern::fill(&mut v, seed_of(&format!("{req}/{c}")));
    v
}

/// Elements `[from, from + width)` of every token of a model chunk.
fn slice_tokens(model: &[u8], from: usize, width: usize, mla: bool) -> Vec<u8> {
    let row = model_width(mla) * 2;
    model
        .chunks(row)
        .flat_map(|tok| tok[from * 2..(from + width) * 2].iter().copied())
        .collect()
}

fn elements(heads: HeadRange, mla: bool) -> (usize, usize) {
    match mla {
        true => (0, HEADS * HEAD),
        false => (heads.start * HEAD, heads.len() * HEAD),
    }
}

fn piece_key(req: &str, c: usize, heads: HeadRange) -> String {
    format!("{req}/{c}/h{}-{}", heads.start, heads.end)
}

fn tokens_of(c: usize) -> usize {
    (TOKENS - c * CHUNK).min(CHUNK)
}

const N_CHUNKS: usize = TOKENS.div_ceil(CHUNK);

/// Every prefill rank sends its pieces of request `req` to the decode
/// ranks it feeds.
fn prefill(dep: &Deployment, req: &str) {
    for (p, s) in dep.senders.iter().enumerate() {
        for route in s.routes().to_vec() {
            let (from, width) = elements(route.heads, dep.mla);
            assert_eq!(s.chunk_layout().hidden, width);
            let tokens: Vec<usize> = (0..N_CHUNKS).map(tokens_of).collect();
            let mut pages = s.allocate_for(Some(&route), &tokens).unwrap();
            let mut keys = Vec::new();
            for (c, page) in pages.iter_mut().enumerate() {
                let model = model_chunk(req, c, tokens_of(c), dep.mla);
                let piece = slice_tokens(&model, from, width, dep.mla);
                page.host_bytes_mut().unwrap()[..piece.len()].copy_from_slice(&piece);
                keys.push(piece_key(req, c, route.heads));
            }
            let chunks: Vec<_> = pages.into_iter().map(MemObj::seal).collect();
            let mut spec = spec_for(&dep.rc, req, true);
            spec.receiver_rank = Some(route.rank);
            s.put(&keys, &chunks, &spec)
                .unwrap_or_else(|e| panic!("prefill rank {p} -> decode {}: {e}", route.rank));
        }
    }
}

/// Decode rank `d` loads request `req` and checks every loaded byte.
fn decode(dep: &Deployment, d: usize, req: &str) {
    let r = &dep.receivers[d];
    let sources = dep.plan.sources(d);
    let keys: Vec<String> = (0..N_CHUNKS)
        .flat_map(|c| sources.iter().map(move |s| piece_key(req, c, s.heads)))
        .collect();
    assert!(
        eventually(Duration::from_secs(20), || keys
            .iter()
            .all(|k| r.contains(k))),
        "decode rank {d}: pieces of {req} did not arrive"
    );
    let layout = dep.rc.chunk_layout();
    let spec = KvCacheSpec::for_layout(&layout, 8, 8);
    let mut cache = KvCache::host(spec).unwrap();
    // Slots in reverse block order, so a piece cannot land by accident.
    let slots: Vec<i64> = (0..TOKENS).map(|t| (63 - t) as i64).collect();
    let opts = LoadOptions {
        pieces_per_chunk: sources.len(),
        ..LoadOptions::default()
    };
    for k in &keys {
        if dep.rc.mode() != TransferMode::PullDelay {
            r.get_wait(k, Duration::from_secs(20)).unwrap();
        }
    }
    let report = r
        .load_with(&keys, &slots, &mut cache, &opts)
        .unwrap_or_else(|e| panic!("decode rank {d}: {e}"));
    assert_eq!(report.loaded.len(), keys.len());
    let (from, width) = elements(dep.plan.decode_heads(d), dep.mla);
    let planes = if dep.mla { 1 } else { 2 };
    for c in 0..N_CHUNKS {
        let model = model_chunk(req, c, tokens_of(c), dep.mla);
        let want = slice_tokens(&model, from, width, dep.mla);
        let row = width * 2;
        for plane in 0..planes {
            for layer in 0..LAYERS {
                for t in 0..tokens_of(c) {
                    let slot = slots[c * CHUNK + t] as usize;
                    let got = cache.token(layer, plane, slot).unwrap();
                    let i = (plane * LAYERS + layer) * tokens_of(c) + t;
                    assert!(
                        got == want[i * row..(i + 1) * row],
                        "decode rank {d}, {req} chunk {c}, plane {plane}, layer {layer}, \
                         token {t}: not the model's heads {:?}",
                        dep.plan.decode_heads(d)
                    );
                }
            }
        }
    }
    for k in &keys {
        r.remove(k);
    }
}

fn finish(dep: Deployment) {
    for s in &dep.senders {
        assert!(s.drain(Duration::from_secs(20)), "sender pins not released");
        assert!(
            settled(&s.stats().pools),
            "sender pool: {:?}",
            s.stats().pools
        );
    }
    for r in &dep.receivers {
        assert!(
            eventually(Duration::from_secs(10), || settled(&r.stats().pools)),
            "receiver pool: {:?}",
            r.stats().pools
        );
    }
}

fn run(channel: ChannelKind, mode: TransferMode, a: usize, b: usize, mla: bool) {
    let dep = deploy(channel, mode, a, b, mla);
    for q in 0..2 {
        let req = format!("{}-{a}to{b}-r{q}", mode.name());
        prefill(&dep, &req);
        for d in 0..b {
            decode(&dep, d, &req);
        }
    }
    finish(dep);
}

#[test]
fn prefill_tp_2_feeds_decode_tp_1_in_every_mode() {
    for mode in [
        TransferMode::Push,
        TransferMode::PullEager,
        TransferMode::PullDelay,
    ] {
        run(ChannelKind::Shm, mode, 2, 1, false);
    }
}

#[test]
fn prefill_tp_1_feeds_decode_tp_2_in_every_mode() {
    for mode in [
        TransferMode::Push,
        TransferMode::PullEager,
        TransferMode::PullDelay,
    ] {
        run(ChannelKind::Shm, mode, 1, 2, false);
    }
}

#[test]
fn wider_splits_and_tcp_work_too() {
    run(ChannelKind::Tcp, TransferMode::PullDelay, 4, 2, false);
    run(ChannelKind::Tcp, TransferMode::Push, 2, 4, false);
}

#[test]
fn an_mla_latent_is_replicated_from_one_prefill_rank() {
    run(ChannelKind::Shm, TransferMode::Push, 2, 1, true);
    run(ChannelKind::Shm, TransferMode::PullDelay, 1, 2, true);
    // Prefill rank 1 of 2 holds the same latent as rank 0, which sends it.
    let dep = deploy(ChannelKind::Shm, TransferMode::Push, 2, 1, true);
    assert!(dep.senders[1].routes().is_empty());
    let chunks = {
        let mut p = dep.senders[1].allocate(&[CHUNK]).unwrap();
        p[0].host_bytes_mut().unwrap().fill(1);
        vec![p.pop().unwrap().seal()]
    };
    let e = dep.senders[1]
        .put(&["x".into()], &chunks, &spec_for(&dep.rc, "x", true))
        .unwrap_err()
        .to_string();
    assert!(e.contains("sends nothing") && e.contains("MLA"), "{e}");
    drop(chunks);
    finish(dep);
}

#[test]
fn a_decode_rank_missing_a_piece_or_misconfigured_is_told_why() {
    let dep = deploy(ChannelKind::Shm, TransferMode::Push, 2, 1, false);
    prefill(&dep, "r");
    let r = &dep.receivers[0];
    let layout = dep.rc.chunk_layout();
    let mut cache = KvCache::host(KvCacheSpec::for_layout(&layout, 8, 8)).unwrap();
    let slots: Vec<i64> = (0..CHUNK as i64).collect();
    // One prefill rank's piece alone, as if the TPs matched.
    let half = piece_key("r", 0, HeadRange { start: 0, end: 2 });
    let e = r
        .load_with(&[half], &slots, &mut cache, &LoadOptions::default())
        .unwrap_err();
    assert!(matches!(e, LoadError::Pieces { chunk: 0, .. }), "{e}");
    assert!(e.to_string().contains("pieces_per_chunk"), "{e}");
    // The put of a sender that does not name its decode rank, when it feeds two.
    for c in 0..N_CHUNKS {
        for h in [0, 2] {
            r.remove(&piece_key(
                "r",
                c,
                HeadRange {
                    start: h,
                    end: h + 2,
                },
            ));
        }
    }
    finish(dep);

    let dep = deploy(ChannelKind::Shm, TransferMode::Push, 1, 2, false);
    let chunks = {
        // Several routes: allocate names no route and is refused.
        let e = dep.senders[0].allocate(&[CHUNK]).unwrap_err().to_string();
        assert!(e.contains("allocate_for"), "{e}");
        let route = dep.senders[0].routes()[0];
        let mut p = dep.senders[0].allocate_for(Some(&route), &[CHUNK]).unwrap();
        p[0].host_bytes_mut().unwrap().fill(1);
        vec![p.pop().unwrap().seal()]
    };
    let e = dep.senders[0]
        .put(&["x".into()], &chunks, &spec_for(&dep.rc, "x", true))
        .unwrap_err()
        .to_string();
    assert!(e.contains("receiver_rank") && e.contains("[0, 1]"), "{e}");
    // Rank 0's heads put to decode rank 1 (which takes heads [2, 4)):
    // refused, not delivered as rank 1's heads.
    let mut spec = spec_for(&dep.rc, "x", true);
    spec.receiver_rank = Some(1);
    let e = dep.senders[0]
        .put(&["x".into()], &chunks, &spec)
        .unwrap_err()
        .to_string();
    assert!(e.contains("decode rank 1 takes heads [2, 4)"), "{e}");
    drop(chunks);
    finish(dep);

    // A receiver that expects a prefill TP of 4 refuses a sender of TP 2.
    let mut dep = deploy(ChannelKind::Shm, TransferMode::Push, 2, 1, false);
    let mut wrong = dep.rc.clone();
    wrong.peer_tp_size = Some(4);
    wrong.kv.num_kv_heads = HEADS;
    wrong.peer_init_port = Some(PortList::PerRank(vec![free_port()]));
    wrong.peer_alloc_port = Some(PortList::PerRank(vec![free_port()]));
    let bad = Receiver::start(&wrong, 0).unwrap();
    let chunks = {
        let mut p = dep.senders[0].allocate(&[CHUNK]).unwrap();
        p[0].host_bytes_mut().unwrap().fill(1);
        vec![p.pop().unwrap().seal()]
    };
    let e = dep.senders[0]
        .put(&["x".into()], &chunks, &spec_for(&wrong, "x", true))
        .unwrap_err()
        .to_string();
    assert!(e.contains("pd_peer_tp_size"), "{e}");
    drop(chunks);
    bad.close();
    dep.receivers.truncate(1);
    finish(dep);
}

mod request_api {
    //! The request API under heterogeneous TP: a `SaveQueue` per prefill
    //! rank gathers each decode rank's head piece from its engine-owned
    //! cache; a `LoadQueue` per decode rank loads every piece with the
    //! request's plain keys. The calls are the same as under one TP size.
    use super::*;
    use ascend_pd::requests::{
        Availability, Completion, LoadQueue, LoadRequest, Outcome, SaveQueue, SaveRequest,
        SharedKvCache,
    };
    use std::time::Instant;

    /// The model's token `t` of `(layer, plane)`, elements
    /// `[from, from + width)`: a slice of one pattern over the whole model.
    fn model_token(req: &str, at: (usize, usize, usize), from: usize, width: usize) -> Vec<u8> {
        let (layer, plane, t) = at;
        let mut v = vec![0u8; width * 2];
        let row = (layer * 2 + plane) * TOKENS + t;
        pattern::fill_at(&mut v, seed_of(req), (row * model_width(false) + from) * 2);
        v
    }

    fn cache_for(c: &PdConfig) -> Arc<SharedKvCache> {
        let spec = KvCacheSpec::for_layout(&c.chunk_layout(), 8, 8);
        SharedKvCache::new(KvCache::host(spec).unwrap())
    }

    fn wait(f: impl Fn() -> Vec<Completion>) -> Completion {
        let end = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(c) = f().pop() {
                return c;
            }
            assert!(Instant::now() < end, "no completion within 30 s");
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    fn prefill_slot(t: usize) -> i64 {
        t as i64
    }

    fn decode_slot(t: usize) -> i64 {
        (63 - t) as i64
    }

    fn run(mode: TransferMode, a: usize, b: usize, cancel: bool) {
        let dep = deploy(ChannelKind::Shm, mode, a, b, false);
        let req = format!("api-{}-{a}to{b}", mode.name());
        let keys: Vec<String> = (0..N_CHUNKS).map(|c| format!("{req}/{c}")).collect();
        // Each prefill rank's engine cache holds its heads of the model.
        let saves: Vec<(SaveQueue, Arc<SharedKvCache>)> = dep
            .senders
            .iter()
            .enumerate()
            .map(|(p, s)| {
                let cache = cache_for(&dep.sc);
                let heads = dep.plan.prefill_heads(p);
                for t in 0..TOKENS {
                    for layer in 0..LAYERS {
                        for plane in 0..2 {
                            let mut c = cache.lock();
                            let at = c.spec().offset(layer, plane, prefill_slot(t) as usize);
                            let v = model_token(
                                &req,
                                (layer, plane, t),
                                heads.start * HEAD,
                                heads.len() * HEAD,
                            );
                            c.write(at, &v).unwrap();
                        }
                    }
                }
                (SaveQueue::new(Arc::clone(s)).unwrap(), cache)
            })
            .collect();
        for (q, cache) in &saves {
            q.submit(
                SaveRequest {
                    keys: keys.clone(),
                    slot_mapping: (0..TOKENS).map(prefill_slot).collect(),
                    spec: spec_for(&dep.rc, &req, true),
                },
                cache,
            )
            .unwrap();
        }
        for (q, _) in &saves {
            let c = wait(|| q.poll());
            assert!(matches!(c.outcome, Outcome::Done), "{c:?}");
        }
        let loads: Vec<LoadQueue> = dep
            .receivers
            .iter()
            .map(|r| LoadQueue::new(Arc::clone(r)).unwrap())
            .collect();
        for (d, q) in loads.iter().enumerate() {
            assert!(
                eventually(Duration::from_secs(20), || q.available(&keys)
                    == Availability::Ready),
                "decode rank {d}: {:?}",
                q.available(&keys)
            );
        }
        if cancel {
            // Cancelled on the prefill side after the save: every decode
            // rank it went to drops its pieces.
            for (sq, _) in &saves {
                sq.cancel(&req);
            }
            for (d, q) in loads.iter().enumerate() {
                assert!(
                    eventually(Duration::from_secs(20), || matches!(
                        q.available(&keys),
                        Availability::NotYet { ready: 0, .. }
                    )),
                    "decode rank {d} still holds pieces of a cancelled request"
                );
            }
        }
        for (d, q) in loads.into_iter().enumerate() {
            if cancel {
                continue;
            }
            let cache = cache_for(&dep.rc);
            q.submit(
                LoadRequest {
                    req_id: req.clone(),
                    keys: keys.clone(),
                    slot_mapping: (0..TOKENS).map(decode_slot).collect(),
                },
                &cache,
            )
            .unwrap();
            let c = wait(|| q.poll());
            assert!(matches!(c.outcome, Outcome::Done), "decode rank {d}: {c:?}");
            let heads = dep.plan.decode_heads(d);
            let mut c = cache.lock();
            for t in 0..TOKENS {
                for layer in 0..LAYERS {
                    for plane in 0..2 {
                        let want = model_token(
                            &req,
                            (layer, plane, t),
                            heads.start * HEAD,
                            heads.len() * HEAD,
                        );
                        let got = c.token(layer, plane, decode_slot(t) as usize).unwrap();
                        assert!(got == want, "decode rank {d}, token {t}: not its heads");
                    }
                }
            }
            drop(c);
            q.close();
        }
        drop(saves);
        finish(dep);
    }

    #[test]
    fn save_and_load_queues_move_head_pieces_in_both_directions() {
        run(TransferMode::Push, 2, 1, false);
        run(TransferMode::PullDelay, 2, 1, false);
        run(TransferMode::PullEager, 1, 2, false);
        run(TransferMode::PullDelay, 1, 2, false);
    }

    #[test]
    fn a_cancel_reaches_every_decode_rank_a_save_went_to() {
        run(TransferMode::Push, 1, 2, true);
        run(TransferMode::PullDelay, 2, 1, true);
    }
}

/// With the same TP size on both sides a config may set `kv_hidden_size`
/// on its own (not heads x head size): chunks keep that width end to end.
#[test]
fn the_same_tp_keeps_an_explicit_hidden_size() {
    let mut rc = receiver_config(ChannelKind::Shm, TransferMode::Push, 8);
    let mut sc = sender_config(ChannelKind::Shm, TransferMode::Push, 8);
    for c in [&mut rc, &mut sc] {
        c.kv.hidden_size = 48;
        c.buffer_size = 8 * c.page_bytes();
    }
    let r = Receiver::start(&rc, 0).unwrap();
    let s = Sender::start(&sc, 0, Default::default()).unwrap();
    assert_eq!(s.chunk_layout().hidden, 48);
    let ks = keys("wide", 2);
    let c = chunks(&s, &ks, CHUNK);
    s.put(&ks, &c, &spec_for(&rc, "wide", true)).unwrap();
    for k in &ks {
        let m = r.get_wait(k, Duration::from_secs(10)).expect("landed");
        assert!(holds(&m, k), "{k}");
        r.remove(k);
    }
    drop(c);
    assert!(s.drain(Duration::from_secs(10)));
}

/// Decode rank 1's heads sent to a port where decode rank 0 listens (one
/// port given for every rank, as a single-port spec says): refused by name,
/// before the first and on every later use of that link, whichever rank's
/// put came first. Rank 0 holds nothing of rank 1's, and pools settle.
#[test]
fn a_piece_sent_to_a_port_where_another_decode_rank_listens_is_refused() {
    for first in [1, 0] {
        let dep = deploy(ChannelKind::Shm, TransferMode::Push, 1, 2, false);
        let s = &dep.senders[0];
        let rank0 = |ports: &Option<PortList>| {
            PortList::Single(ports.as_ref().unwrap().for_rank(0).unwrap())
        };
        let mut spec = spec_for(&dep.rc, "x", true);
        spec.receiver_init_port = rank0(&dep.rc.peer_init_port);
        spec.receiver_alloc_port = rank0(&dep.rc.peer_alloc_port);
        let put = |d: usize| put_piece(s, &spec, d);
        let order = if first == 1 { [1, 0, 1] } else { [0, 1, 1] };
        for d in order {
            match (d, put(d)) {
                (0, r) => {
                    r.unwrap_or_else(|e| panic!("rank 0's own piece: {e}"));
                }
                (_, Ok(o)) => panic!("rank 1's piece was delivered to rank 0: {o:?}"),
                (_, Err(e)) => {
                    let e = e.to_string();
                    assert!(
                        e.contains("is decode TP rank 0") && e.contains("decode rank 1"),
                        "{e}"
                    );
                    assert!(e.contains("one receiver port per decode rank"), "{e}");
                }
            }
        }
        let r0 = &dep.receivers[0];
        let h1 = s.routes()[1].heads;
        assert!(!r0.contains(&piece_key("x", 1, h1)), "first {first}");
        assert!(r0.contains(&piece_key("x", 0, s.routes()[0].heads)));
        r0.remove(&piece_key("x", 0, s.routes()[0].heads));
        finish(dep);
    }
}

/// The refusal above holds while the process that said "decode rank 0"
/// answers at that port. Restarted there as decode rank 1 (a redeploy
/// that moved the ranks), it gets rank 1's pieces: the probe sees another
/// process (or, never attached, the put's own handshake asks), and the new
/// handshake says rank 1.
#[test]
fn a_receiver_restarted_as_another_rank_at_the_same_port_gets_that_ranks_pieces() {
    for attached_first in [true, false] {
        let mut dep = deploy(ChannelKind::Shm, TransferMode::Push, 1, 2, false);
        let s = Arc::clone(&dep.senders[0]);
        let port0 = |ports: &Option<PortList>| ports.as_ref().unwrap().for_rank(0).unwrap();
        let (init0, alloc0) = (
            port0(&dep.rc.peer_init_port),
            port0(&dep.rc.peer_alloc_port),
        );
        let spec = TransferSpec {
            receiver_init_port: PortList::Single(init0),
            receiver_alloc_port: PortList::Single(alloc0),
            ..spec_for(&dep.rc, "x", true)
        };
        let put = |d: usize| put_piece(&s, &spec, d);
        if attached_first {
            put(0).unwrap();
        }
        assert!(put(1).is_err(), "rank 0 still answers there");
        assert!(put(1).is_err(), "and again");
        // Decode rank 0 goes; decode rank 1 starts on its ports.
        let old = Arc::try_unwrap(dep.receivers.remove(0)).ok().unwrap();
        old.remove(&piece_key("x", 0, s.routes()[0].heads));
        old.close();
        let mut moved = dep.rc.clone();
        moved.peer_init_port = Some(PortList::PerRank(vec![free_port(), init0]));
        moved.peer_alloc_port = Some(PortList::PerRank(vec![free_port(), alloc0]));
        let r1 = Receiver::start(&moved, 1).unwrap();
        put(1).unwrap_or_else(|e| panic!("attached first {attached_first}: now rank 1: {e}"));
        let k1 = piece_key("x", 1, s.routes()[1].heads);
        assert!(r1.contains(&k1));
        r1.remove(&k1);
        dep.receivers.push(Arc::new(r1));
        drop(s);
        finish(dep);
    }
}

/// Puts decode rank `d`'s one-chunk piece "x" of prefill sender `s` under
/// `spec`, naming rank `d`.
fn put_piece(
    s: &Sender,
    spec: &TransferSpec,
    d: usize,
) -> Result<ascend_pd::PutOutcome, ascend_pd::BackendError> {
    let route = s.routes()[d];
    let mut p = s.allocate_for(Some(&route), &[CHUNK]).unwrap();
    p[0].host_bytes_mut().unwrap().fill(d as u8 + 1);
    let chunks = vec![p.pop().unwrap().seal()];
    let spec = TransferSpec {
        receiver_rank: Some(d),
        ..spec.clone()
    };
    s.put(&[piece_key("x", d, route.heads)], &chunks, &spec)
}
